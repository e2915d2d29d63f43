#!/usr/bin/env bash
# The three analyses on SmolLM2-135M-Instruct (CPU), small sizes.  Output: experiments/analysis_smollm2/<name>/
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/analysis_smollm2
python -m sparse_eval.analysis geometry model=smollm2_135m num_sentences=16 sentence_len=256 length=2048 out=$out/geometry
python -m sparse_eval.analysis error_vs_budget model=smollm2_135m length=2048 out=$out/error_vs_budget
python -m sparse_eval.analysis ds_checks model=smollm2_135m out=$out/ds_checks
