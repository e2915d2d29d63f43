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

**Over prompts and seeds (stochastic methods).**  A stochastic method (``Method.stochastic``: MagicPIG's hash
projections, oracle sampling's draws, Double Sparsity's random channels) run with seeds s = 1..S on the same
prompts i = 1..n gives records x[s, i]; seeds and prompts are *crossed* (every seed sees every prompt), not
nested.  Its score is the mean over seeds of each seed's score on the samples every seed finished,

    θ = (1/S) Σ_s score(x[s, ·]),

an estimate of the method's expected score over both the prompt population and the seed distribution.  In the
additive picture x[s, i] = μ + a_i + b_s + e_si its variance is σ_a²/n + σ_b²/S + σ_e²/(nS): the prompt effect a_i
is *shared* by all seeds, so it does not average out over seeds, while the seed effect b_s averages over S only.
The two-level bootstrap (``seed_pooled_ci``) reproduces both terms.  Each of ``n_boot`` replicates draws

  1. sample weights W: n_g draws with replacement within each group g (as above), ONE draw shared by all seeds
     (resampling prompts independently per seed would shrink the prompt term to σ_a²/(nS): too narrow);
  2. S seeds with replacement from the S seeds run,

and computes θ* = (1/S) Σ_k score(x[s*_k, ·]; W).  This is the pigeonhole (two-way crossed) bootstrap (Owen 2007,
Ann. Appl. Stat. 1(2)), which is mildly conservative in the interaction term σ_e².  With few seeds the seed term is
coarse: a resample of S values has (S−1)/S of their variance and S = 3 seeds give only 10 distinct seed multisets,
so the seed part of the interval is a rough, slightly narrow estimate; ``seed_std``, ``seed_min`` and
``seed_max`` are shown beside it.  With S = 1 the procedure is exactly the one-level bootstrap (same draws), and
the interval then omits the seed variation of a stochastic method (``collect``'s ``interval_omits_seeds``).

The paired difference of a stochastic method against full attention (deterministic: one run), over seeds
(``seed_pooled_difference``), is (1/S) Σ_s score(x[s, ·]) − score(y) on the samples that every seed AND full
attention finished; each replicate applies the same W to both sides (paired on samples) and resamples the seeds
of the method only.

Two configurations, each over its own seeds (``seed_pooled_contrast``, e.g. MagicPIG (9, 120) against (10, 150)),
are compared the same way: θ_A − θ_B on the samples every run of both finished, one W for both sides, then A's
seed draws, then B's (``python -m sparse_eval.contrast``).

Order of the draws (so that an independent implementation reproduces the intervals exactly):
``rng = numpy.random.default_rng(seed)``; for each group in increasing group id, ``rng.multinomial(n_g, [1/n_g]
* n_g, size=n_boot)`` gives W's columns of that group's samples (in their order); then, for the two-level
intervals, ``rng.integers(0, S, size=(n_boot, S))`` are the seed indices.  The 95 % interval is
``numpy.quantile(θ*, [0.025, 0.975])`` (linear interpolation) over the finite replicates.
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

    @classmethod
    def mean_of_subtask_means(cls, records: Sequence[dict[str, Any]], subtasks: Sequence[str]) -> "ScoreTerms":
        """RULER's and LongBench's headline, the mean of the subtasks' means: one group per subtask (each keeps its
        sample count in a resample), numbered in ``subtasks``' order and then by name for any other subtask found."""
        scored = [r for r in records if r.get("score") is not None]
        order = {s: k for k, s in enumerate(dict.fromkeys([*subtasks, *sorted(r["subtask"] for r in scored)]))}
        return cls(
            [r["id"] for r in scored],
            [r["score"] for r in scored],
            [1.0] * len(scored),
            [order[r["subtask"]] for r in scored],
        )

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


def _resample_weights(group: np.ndarray, n_boot: int, rng: np.random.Generator) -> np.ndarray:
    """float [n_boot, n]: how often each sample is drawn in each resample, drawn within its group (groups in
    increasing id, one multinomial each: see the module docstring)."""
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
    lo, hi = _interval(terms._stat(_resample_weights(terms.group, n_boot, np.random.default_rng(seed))), level)
    return {"score": terms.score(), "lo": lo, "hi": hi, "n": len(terms), "level": level, "n_boot": n_boot}


def paired_difference(
    terms: ScoreTerms, reference: ScoreTerms, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> dict[str, Any]:
    """{diff, lo, hi, n, significant}: score(terms) − score(reference) over the samples both have, with the
    paired bootstrap interval (one set of resample indices for both)."""
    ref_ids = set(reference.ids)
    shared = [i for i in terms.ids if i in ref_ids]
    if not shared:
        return {"diff": None, "lo": None, "hi": None, "n": 0, "level": level, "significant": None}
    a, b = terms.subset(shared), reference.subset(shared)
    if not np.array_equal(a.group, b.group):
        raise ValueError("paired_difference: the two runs put a shared sample in different groups")
    w = _resample_weights(a.group, n_boot, np.random.default_rng(seed))
    lo, hi = _interval(a._stat(w) - b._stat(w), level)
    significant = None if math.isnan(lo) or len(shared) < MIN_SIGNIFICANCE_N else bool(lo > 0 or hi < 0)
    return {
        "diff": a.score() - b.score(),
        "lo": lo,
        "hi": hi,
        "n": len(shared),
        "level": level,
        "significant": significant,
    }


def seed_spread(scores: Sequence[float]) -> dict[str, Any]:
    """{mean, std, n_seeds, min, max} of one configuration's scores over seeds (stochastic methods)."""
    vals = np.asarray([s for s in scores if s is not None and math.isfinite(s)], dtype=np.float64)
    if vals.size == 0:
        return {"mean": None, "std": None, "n_seeds": 0, "min": None, "max": None}
    return {
        "mean": float(vals.mean()),
        "std": float(vals.std(ddof=1)) if vals.size > 1 else None,
        "n_seeds": int(vals.size),
        "min": float(vals.min()),
        "max": float(vals.max()),
    }


def common_ids(runs: Sequence[ScoreTerms], reference: ScoreTerms | None = None) -> list[str]:
    """The sample ids that every run in ``runs`` (and ``reference``, when given) has, in the first run's order."""
    if not runs:
        return []
    have = [set(t.ids) for t in runs[1:]] + ([set(reference.ids)] if reference is not None else [])
    return [i for i in runs[0].ids if all(i in h for h in have)]


def _seed_subsets(runs: Sequence[ScoreTerms], ids: list[str], what: str) -> list[ScoreTerms]:
    subs = [t.subset(ids) for t in runs]
    if any(not np.array_equal(subs[0].group, t.group) or t.transform != subs[0].transform for t in subs[1:]):
        raise ValueError(f"{what}: the seeds' runs put a shared sample in different groups (not one task config)")
    return subs


def _seed_resample(per_seed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """[R]: per replicate, the mean over S seeds drawn with replacement of ``per_seed`` [S, R] (each seed's
    statistic under that replicate's sample weights)."""
    s, r = per_seed.shape
    idx = rng.integers(0, s, size=(r, s))
    return per_seed[idx, np.arange(r)[:, None]].mean(axis=1)


def seed_pooled_ci(
    runs: Sequence[ScoreTerms], n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> dict[str, Any]:
    """{score, lo, hi, n, seeds, per_seed, level, n_boot}: the mean over seeds of each seed's score on the samples
    every seed finished (``n`` of them; ``per_seed``: those scores), with the two-level bootstrap interval over
    prompts and seeds (module docstring).  ``runs``: one ScoreTerms per seed of one configuration.  One run: the
    interval of ``bootstrap_ci``, exactly."""
    ids = common_ids(runs)
    out = {
        "score": None,
        "lo": None,
        "hi": None,
        "n": len(ids),
        "seeds": len(runs),
        "per_seed": [],
        "level": level,
        "n_boot": n_boot,
    }
    if not ids:
        return out
    subs = _seed_subsets(runs, ids, "seed_pooled_ci")
    rng = np.random.default_rng(seed)
    w = _resample_weights(subs[0].group, n_boot, rng)
    stats = np.stack([t._stat(w) for t in subs])  # [S, R]
    lo, hi = _interval(_seed_resample(stats, rng), level)
    per_seed = [t.score() for t in subs]
    return dict(out, score=float(np.mean(per_seed)), lo=lo, hi=hi, per_seed=per_seed)


def seed_pooled_difference(
    runs: Sequence[ScoreTerms], reference: ScoreTerms, n_boot: int = N_BOOT, level: float = LEVEL, seed: int = 0
) -> dict[str, Any]:
    """{diff, lo, hi, n, seeds, significant}: (mean over seeds of score) − score(reference) over the samples every
    seed and the reference finished, with the two-level paired interval: the reference (full attention,
    deterministic) gets the same sample weights as each seed, the seeds are resampled (module docstring).  One
    run: exactly ``paired_difference``.  ``seed_pooled_contrast(runs, [reference])``, exactly."""
    return seed_pooled_contrast(runs, [reference], n_boot=n_boot, level=level, seed=seed)


def seed_pooled_contrast(
    runs: Sequence[ScoreTerms],
    reference_runs: Sequence[ScoreTerms],
    n_boot: int = N_BOOT,
    level: float = LEVEL,
    seed: int = 0,
) -> dict[str, Any]:
    """{diff, lo, hi, n, seeds, reference_seeds, significant}: θ_A − θ_B, two configurations each pooled over its
    seeds (``runs``: A's, ``reference_runs``: B's; θ as in the module docstring) on the samples every run of both
    finished, with the two-level paired interval.  Each replicate draws ONE set of sample weights W for both sides
    (paired on prompts), then A's seed indices, then B's (B's only when B has more than one run, so that a
    deterministic reference draws nothing: ``seed_pooled_difference`` is this with one reference run).  Use it to
    compare two settings of a stochastic method, e.g. MagicPIG (9, 120) against (10, 150), seeds 0–2 each."""
    ref_ids = [set(t.ids) for t in reference_runs]
    ids = [i for i in common_ids(runs) if all(i in r for r in ref_ids)] if reference_runs else []
    out = {"diff": None, "lo": None, "hi": None, "n": len(ids), "seeds": len(runs)}
    out.update(reference_seeds=len(reference_runs), level=level, significant=None)
    if not ids:
        return out
    subs = _seed_subsets(runs, ids, "seed_pooled_contrast")
    refs = _seed_subsets(reference_runs, ids, "seed_pooled_contrast")
    if not np.array_equal(subs[0].group, refs[0].group):
        raise ValueError("seed_pooled_contrast: the two configurations put a shared sample in different groups")
    rng = np.random.default_rng(seed)
    w = _resample_weights(refs[0].group, n_boot, rng)
    theta_a = _seed_resample(np.stack([t._stat(w) for t in subs]), rng)  # [R]
    ref_stats = np.stack([t._stat(w) for t in refs])  # [S_B, R]
    theta_b = ref_stats[0] if len(refs) == 1 else _seed_resample(ref_stats, rng)
    lo, hi = _interval(theta_a - theta_b, level)
    significant = None if math.isnan(lo) or len(ids) < MIN_SIGNIFICANCE_N else bool(lo > 0 or hi < 0)
    diff = float(np.mean([t.score() for t in subs]) - np.mean([t.score() for t in refs]))
    return dict(out, diff=diff, lo=lo, hi=hi, significant=significant)


def score_interval(task: Any, records: list[dict[str, Any]], seed: int = 0) -> dict[str, Any] | None:
    """The score's 95 % bootstrap interval over the finished samples (``sparse_eval.statistics``): {lo, hi, n,
    level, n_boot}; None where the task's samples are not units an interval can be drawn over."""
    terms = task.score_terms(records)
    if terms is None:
        return None
    ci = bootstrap_ci(terms, seed=seed)
    return {k: ci[k] for k in ("lo", "hi", "n", "level", "n_boot")}
