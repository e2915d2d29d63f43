#!/usr/bin/env bash
# MagicPIG's per-row collision counts on the CPU, before (BASE) and after (HEAD) writing the comparison as floats:
# whole-process wall time of `python -m sparse_eval method=magicpig` (the default task, protocol S), the two
# commits alternating, PAIRS pairs, each run into a fresh runs folder; then the two runs' records compared.
# Usage: experiments/magicpig_row_counts_cpu/run.sh [BASE] [HEAD] [PAIRS]
set -euo pipefail
cd "$(dirname "$0")/../.."
base=${1:-7127717} head=${2:-221298f} pairs=${3:-3}
tmp=$(mktemp -d)
trap 'git worktree remove --force "$tmp/base" >/dev/null 2>&1; git worktree remove --force "$tmp/head" >/dev/null 2>&1; rm -rf "$tmp"' EXIT
git worktree add -q --detach "$tmp/base" "$base"
git worktree add -q --detach "$tmp/head" "$head"
echo "$(date -Iseconds) $(nproc) cores; base $base, head $head; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
for i in $(seq "$pairs"); do
    for which in base head; do
        rm -rf "$tmp/runs_$which"
        s=$(date +%s.%N)
        (cd "$tmp/$which" && python -m sparse_eval method=magicpig paths.runs_dir="$tmp/runs_$which" > /dev/null 2>&1)
        echo "pair $i $which $(echo "$(date +%s.%N) - $s" | bc) s"
    done
done
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
python scripts/compare_records.py "$tmp/runs_base" "$tmp/runs_head"
