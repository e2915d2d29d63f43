"""How sure a score is: bootstrap confidence intervals over samples, and paired differences between methods.

Every task score is a transform of per-group ratios of per-sample sums, macro-averaged over groups:

    score = T( (1/G) Σ_g  Σ_{i∈g} num_i / Σ_{i∈g} den_i )

* a plain mean (accuracy, key-value retrieval): num_i = score_i, den_i = 1, one group, T = identity;
* RULER and LongBench (the mean of the subtasks' means): one group per subtask;
* perplexity over windows: num_i = NLL sum of window i, den_i = its token count, T = exp.

A task says how (``Task.score_terms``).  The interval is the percentile bootstrap: samples are drawn with
replacement *within each group* (so every resample keeps each subtask's sample count, as the benchmark fixes
it), the score is recomputed, and the 2.5 % and 97.5 % quantiles of ``n_boot`` resamples are the 95 % interval.
The resamples come from a seeded generator, so an interval is a pure function of the records.

The paired difference of method A against a reference (full attention) uses the samples both ran: the same
resample indices are applied to both, so the per-sample correlation (a hard sample is hard for both) narrows
the interval, as a paired test should.  A difference is *significant* when its interval excludes 0 (claimed from
``MIN_SIGNIFICANCE_N`` shared samples on).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

N_BOOT = 2000
LEVEL = 0.95
# below this many (paired) samples a percentile bootstrap has too few distinct resamples to claim a difference:
# ``significant`` is then None (unknown), not False
MIN_SIGNIFICANCE_N = 8


@dataclass
class ScoreTerms:
    """Per-sample terms of a score (see the module docstring); arrays of one length, in one sample order."""

    ids: list[str]
    num: np.ndarray  # float [n]
    den: np.ndarray  # float [n], > 0
    group: np.ndarray  # int [n]: stratum of each sample (0 everywhere for a plain mean)
    transform: str = "identity"  # "identity" | "exp"

    def __post_init__(self) -> None:
        self.num = np.asarray(self.num, dtype=np.float64)
        self.den = np.asarray(self.den, dtype=np.float64)
        self.group = np.asarray(self.group, dtype=np.int64)
        if not (len(self.ids) == len(self.num) == len(self.den) == len(self.group)):
            raise ValueError("ScoreTerms: ids, num, den and group must have one length")
        if self.transform not in TRANSFORMS:
            raise ValueError(f"ScoreTerms.transform={self.transform!r}; valid: {sorted(TRANSFORMS)}")

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, ids: Sequence[str]) -> "ScoreTerms":
        """The terms of ``ids`` (each present), in that order."""
        pos = {i: k for k, i in enumerate(self.ids)}
        idx = np.array([pos[i] for i in ids], dtype=np.int64)
        return ScoreTerms(list(ids), self.num[idx], self.den[idx], self.group[idx], self.transform)

    def score(self) -> float:
        return float(self._stat(np.ones((1, len(self)), dtype=np.float64))[0])

    def _stat(self, weights: np.ndarray) -> np.ndarray:
        """The score under sample weights [R, n] (a resample's counts), one value per row."""
        per_group = []
        for g in np.unique(self.group):
            m = self.group == g
            per_group.append((weights[:, m] @ self.num[m]) / (weights[:, m] @ self.den[m]))
        return TRANSFORMS[self.transform](np.mean(per_group, axis=0))


TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"identity": lambda x: x, "exp": np.exp}


def _resample_weights(group: np.ndarray, n_boot: int, seed: int) -> np.ndarray:
    """float [n_boot, n]: how often each sample is drawn in each resample, drawn within its group."""
    rng = np.random.default_rng(seed)
    w = np.zeros((n_boot, len(group)), dtype=np.float64)
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        w[:, idx] = rng.multinomial(len(idx), np.full(len(idx), 1.0 / len(idx)), size=n_boot)
    return w


def _interval(values: np.ndarray, level: float) -> tuple[float, float]:
    values = values[np.isfinite(values)]
    if values.size == 0:
        return math.nan, math.nan
    a = (1.0 - level) / 2.0
    lo, hi = np.quantile(values, [a, 1.0 - a])
    return float(lo), float(hi)


def bootstrap_ci(terms: ScoreTerms, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0) -> dict[str, Any]:
    """{score, lo, hi, n, level, n_boot}: the score of ``terms`` and its percentile-bootstrap interval.  With one
    sample (or one per group) the interval is the point itself: the record says n, so it reads as unsure."""
    if len(terms) == 0:
        return {"score": None, "lo": None, "hi": None, "n": 0, "level": level, "n_boot": n_boot}
    lo, hi = _interval(terms._stat(_resample_weights(terms.group, n_boot, seed)), level)
    return {"score": terms.score(), "lo": lo, "hi": hi, "n": len(terms), "level": level, "n_boot": n_boot}


def paired_difference(terms: ScoreTerms, reference: ScoreTerms, n_boot: int = N_BOOT, level: float = LEVEL,
                      seed: int = 0) -> dict[str, Any]:
    """{diff, lo, hi, n, significant}: score(terms) − score(reference) over the samples both have, with the
    paired bootstrap interval (one set of resample indices for both)."""
    ref_ids = set(reference.ids)
    shared = [i for i in terms.ids if i in ref_ids]
    if not shared:
        return {"diff": None, "lo": None, "hi": None, "n": 0, "level": level, "significant": None}
    a, b = terms.subset(shared), reference.subset(shared)
    if not np.array_equal(a.group, b.group):
        raise ValueError("paired_difference: the two runs put a shared sample in different groups")
    w = _resample_weights(a.group, n_boot, seed)
    lo, hi = _interval(a._stat(w) - b._stat(w), level)
    significant = None if math.isnan(lo) or len(shared) < MIN_SIGNIFICANCE_N else bool(lo > 0 or hi < 0)
    return {"diff": a.score() - b.score(), "lo": lo, "hi": hi, "n": len(shared), "level": level,
            "significant": significant}


def seed_spread(scores: Sequence[float]) -> dict[str, Any]:
    """{mean, std, n_seeds, min, max} of one configuration's scores over seeds (stochastic methods)."""
    vals = np.asarray([s for s in scores if s is not None and math.isfinite(s)], dtype=np.float64)
    if vals.size == 0:
        return {"mean": None, "std": None, "n_seeds": 0, "min": None, "max": None}
    return {"mean": float(vals.mean()), "std": float(vals.std(ddof=1)) if vals.size > 1 else None,
            "n_seeds": int(vals.size), "min": float(vals.min()), "max": float(vals.max())}
