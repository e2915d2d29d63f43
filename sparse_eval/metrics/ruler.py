"""RULER's metrics (NVIDIA/RULER ``scripts/eval/evaluate.py`` and ``scripts/eval/synthetic/constants.py``),
written from their definitions.

A prediction is first cleaned (``postprocess_pred``): surrounding whitespace stripped, every ASCII control
character ``\\x00-\\x1f`` replaced by a newline, stripped again.  Matching is case-insensitive substring search
of each reference in the prediction.  For one sample with references ``r_1..r_m`` and prediction ``p``:

* ``string_match_all`` (NIAH, VT, CWE, FWE): ``100 * (1/m) * sum_j [lower(r_j) in lower(p)]`` -- the fraction
  of the references found;
* ``string_match_part`` (QA): ``100 * max_j [lower(r_j) in lower(p)]`` -- any one reference found.

A task's score is the mean of its samples' scores (RULER rounds it to 2 decimals for ``summary.csv``;
``corpus_score`` does the same, the per-sample functions do not round).  Scores are in [0, 100].
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

_CONTROL = re.compile(r"[\x00-\x1f]")


def postprocess_pred(text: str) -> str:
    """RULER's ``postprocess_pred``: strip, control characters -> newline, strip."""
    return _CONTROL.sub("\n", text.strip()).strip()


def _found(pred: str, refs: Sequence[str]) -> list[float]:
    if not refs:
        raise ValueError("a RULER sample needs at least one reference")
    low = pred.lower()
    return [1.0 if r.lower() in low else 0.0 for r in refs]


def string_match_all(pred: str, refs: Sequence[str]) -> float:
    """One sample: 100 x the fraction of references that occur in the prediction (case-insensitive)."""
    hits = _found(pred, refs)
    return 100.0 * sum(hits) / len(hits)


def string_match_part(pred: str, refs: Sequence[str]) -> float:
    """One sample: 100 if any reference occurs in the prediction (case-insensitive), else 0."""
    return 100.0 * max(_found(pred, refs))


METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}


def metric_fn(name: str) -> Callable[[str, Sequence[str]], float]:
    try:
        return METRICS[name]
    except KeyError:
        raise ValueError(f"unknown RULER metric {name!r}; valid: {sorted(METRICS)}") from None


def corpus_score(metric: str, preds: Sequence[str], refs: Sequence[Sequence[str]]) -> float:
    """A task's score as RULER's ``summary.csv`` has it: mean of the per-sample scores, rounded to 2 decimals
    (predictions are taken as given; apply ``postprocess_pred`` first, as ``evaluate.py`` does)."""
    if len(preds) != len(refs) or not preds:
        raise ValueError(f"need as many predictions as reference lists (>0); got {len(preds)} and {len(refs)}")
    fn = metric_fn(metric)
    return round(sum(fn(p, r) for p, r in zip(preds, refs)) / len(preds), 2)
