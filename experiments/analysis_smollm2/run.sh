#!/usr/bin/env bash
# The three analyses on SmolLM2-135M-Instruct (CPU), small sizes.  Output: experiments/analysis_smollm2/<name>/
set -euo pipefail
cd "$(dirname "$0")/../.."
out=experiments/analysis_smollm2
python -m sparse_eval.analysis analysis=geometry model=smollm2_135m analysis.num_sentences=16 analysis.sentence_len=256 analysis.length=2048 analysis.out=$out/geometry
python -m sparse_eval.analysis analysis=error_vs_budget model=smollm2_135m analysis.length=2048 analysis.out=$out/error_vs_budget
python -m sparse_eval.analysis analysis=ds_checks model=smollm2_135m analysis.out=$out/ds_checks
