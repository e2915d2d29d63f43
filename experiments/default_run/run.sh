#!/usr/bin/env bash
# The default run: the shipped stories260K model, WikiText-2 perplexity on the bundled text, every method in
# `compare` (conf/config.yaml).  Prints the table of README.md, the wall time, and the conditions it was measured
# in (cores, the load average before and after: other processes on the machine stretch the time).
set -euo pipefail
cd "$(dirname "$0")/../.."
echo "$(date -Iseconds) $(nproc) cores; load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
time python -m sparse_eval
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
