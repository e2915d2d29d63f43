#!/usr/bin/env bash
# SmolLM2-135M-Instruct under full attention on every task, offline, on a 2-core CPU (small sample counts).
# Needs the GGUF (scripts/get_smollm2.sh) and the shared data folder.  Results: runs/ then collect.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SPARSE_EVAL_DATA_DIR="${SPARSE_EVAL_DATA_DIR:-$(cd .. && pwd)/shared/data}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
RUNS="${RUNS:-/tmp/smollm2_full_runs}"
common=(model=smollm2_135m method=full "paths.runs_dir=$RUNS")
python -m sparse_eval "${common[@]}" task=wikitext task.window=2048 task.num_samples=4
python -m sparse_eval "${common[@]}" task=ruler task.length=4096 task.num_samples=2
python -m sparse_eval "${common[@]}" task=kv_retrieval task.source=published task.num_keys=75 task.num_samples=6 task.gold_position=original
python -m sparse_eval "${common[@]}" task=longbench 'task.subtasks=[triviaqa]' task.num_samples=5
python -m sparse_eval "${common[@]}" task=lm_eval 'task.tasks=[gsm8k_cot]' task.limit=3
python -m sparse_eval.results.collect "$RUNS"
cp "$RUNS/results.csv" experiments/smollm2_full/results.csv
