#!/usr/bin/env bash
# A real sweep at small scale, rendered into the papers' tables and figures (issue: analysis and reports).
# SmolLM2-135M-Instruct on RULER at 2,048 tokens (2 subtasks, 1 sample each) and WikiText-2, stories260K on
# WikiText-2; CPU only.  Every sweep is one of conf/experiment/, narrowed on the command line.
set -euo pipefail
cd "$(dirname "$0")/../.."
export SPARSE_EVAL_DATA_DIR="${SPARSE_EVAL_DATA_DIR:-$(cd .. && pwd)/shared/data}" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
RUNS="${RUNS:-/tmp/report_small_runs}"
OUT="${OUT:-experiments/report_small}"
ruler=(model=smollm2_135m task.length=2048 task.num_samples=1 "task.subtasks=[niah_single_1,fwe]"
       eval.prefill_chunk=null "paths.runs_dir=$RUNS")
# MagicPIG Table 3 (and Table 9's Cost2 for the three (K, L) of Table 3) (SmolLM2 has 30 layers: MagicPIG's dense layers {0, 16} apply as they are)
python -m sparse_eval -m +experiment=ruler_magicpig "${ruler[@]}" task.length=2048
# MagicPIG Fig. 9a (centering) and Fig. 1 / 6c (TopK vs oracle sampling)
python -m sparse_eval -m +experiment=magicpig_centering "${ruler[@]}" method.L=150
python -m sparse_eval -m +experiment=topk_vs_oracle "${ruler[@]}" method.budget=0.01,0.1 "task.subtasks=[niah_single_2,fwe]"
# Double Sparsity Table 2 (perplexity by sparsity level) on the shipped model (its calibration file is committed)
python -m sparse_eval -m +experiment=ds_ppl model=stories260k task=wikitext_head task.window=512 task.num_samples=4 \
    method=full,double_sparsity_s2,double_sparsity_s4,double_sparsity_s8,double_sparsity_s16,double_sparsity_s32 "paths.runs_dir=$RUNS"
python -m sparse_eval.results.collect "$RUNS"
python -m sparse_eval.report "$RUNS" --out "$OUT"
cp "$RUNS/results.csv" "$OUT/results.csv"
