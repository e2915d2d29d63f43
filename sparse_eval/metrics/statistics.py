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
seed draws, then B's (``python -m sparse_eval.results.contrast``).

Order of the draws (so that an independent implementation reproduces the intervals exactly):
``rng = numpy.random.default_rng(seed)``; for each group in increasing group id, ``rng.multinomial(n_g, [1/n_g]
* n_g, size=n_boot)`` gives W's columns of that group's samples (in their order); then, for the two-level
intervals, ``rng.integers(0, S, size=(n_boot, S))`` are the seed indices.  The 95 % interval is
``numpy.quantile(θ*, [0.025, 0.975])`` (linear interpolation) over the finite replicates.  ``N_BOOT`` = 10,000
replicates by default.  A resample's weights depend only on the groups, ``n_boot`` and the generator's state, so
they are drawn once per (groups, n_boot, state) and reused (``_resample_weights``' cache): the same numbers, drawn
once for the many rows of a table that share a sample layout.

**Monte Carlo error of an end point** (``quantile_mc_error``).  An end point is a quantile of ``n_boot`` finite
replicates, so it moves with the draws.  Its error is bounded without assumptions on the replicates'
distribution by the order statistics that bracket the true quantile: the number of replicates below the q-quantile
of the bootstrap distribution is Binomial(R, q), so [X_(j), X_(k)] with j, k = R q ∓ z √(R q (1 − q)) (normal
approximation, z for 95 %) covers it with probability about 0.95 (the distribution-free interval for a quantile,
e.g. H. A. David & H. N. Nagaraja, *Order Statistics*, 3rd ed., Wiley 2003, §7.1).  The error reported is the larger
distance from the end point to those two order statistics.

**Claims: equivalence, non-inferiority, superiority** (``claim_verdict``).  A claim about a configuration A against
a reference B (full attention, or another configuration) is tested on the paired difference d = A − B (or the
relative difference A / B − 1), oriented so that d > 0 means A is better (the task's ``higher_is_better``), with
its paired bootstrap interval [lo, hi] at level 1 − 2α (α = 0.05: the 90 % interval) and a margin m > 0 declared
with the claim.  This is the two one-sided tests procedure (TOST; D. J. Schuirmann, "A comparison of the two
one-sided tests procedure and the power approach for assessing the equivalence of average bioavailability",
J. Pharmacokinet. Biopharm. 15(6):657–680, 1987) read off the interval: each end point of the (1 − 2α) interval is
a one-sided test at level α.  The rule, with strict inequalities (an end point on a boundary does not pass it):

* ``equivalence`` (A ≈ B within ±m): **equivalent** when −m < lo and hi < m; else **better** when lo > 0; else
  **worse** when hi < 0; else **undecided** (the interval reaches past a margin and covers 0).  Equivalent takes
  precedence: a difference shown to be inside the margin is what the claim asks, even where it also excludes 0.
* ``non_inferiority`` (A not worse than B by m or more): **better** when lo > 0; else **non-inferior** when
  lo > −m; else **inferior** when hi < −m; else **worse** when hi < 0; else **undecided**.
* ``superiority`` (A > B; no margin): **better** when lo > 0; **worse** when hi < 0; else **undecided**.

An end point within rounding of a boundary (1e-9, relative) is on it: replicates on a lattice (accuracies of n
prompts) put end points exactly on a margin, and the last bits of a sum must not decide the verdict.

Monte Carlo error: with end-point errors (e_lo, e_hi), the verdict stands only when the rule gives the same answer
for every interval whose end points lie within their errors of [lo, hi] (|lo′ − lo| ≤ e_lo, |hi′ − hi| ≤ e_hi);
otherwise it is **undecided**.  So a verdict whose deciding end point is within its Monte Carlo error of the margin
or of 0 is undecided; an end point near a boundary the verdict does not depend on changes nothing.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

N_BOOT = 10_000
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

    def _stat(self, weights: "np.ndarray | Weights") -> np.ndarray:
        """The score under sample weights [R, n] (a resample's counts, or ``_resample_weights``' per-group blocks of
        them, drawn for these terms' groups), one value per row."""
        per_group = []
        if isinstance(weights, Weights):
            for idx, block in weights.blocks:
                # einsum, not BLAS: a threaded gemv of these thin blocks is ten times slower on a busy machine
                num = np.einsum("ij,j->i", block, self.num[idx])
                den_g = self.den[idx]
                # a resample keeps each group's count: weights summing unit denominators give n_g exactly
                den = float(len(idx)) if np.all(den_g == 1.0) else np.einsum("ij,j->i", block, den_g)
                per_group.append(num / den)
        else:
            for g in np.unique(self.group):
                m = self.group == g
                per_group.append((weights[:, m] @ self.num[m]) / (weights[:, m] @ self.den[m]))
        return TRANSFORMS[self.transform](np.mean(per_group, axis=0))


TRANSFORMS: dict[str, Callable[[np.ndarray], np.ndarray]] = {"identity": lambda x: x, "exp": np.exp}


@dataclass(frozen=True, eq=False)
class Weights:
    """A resample's counts, group by group: ``blocks`` holds, per group in increasing id, (the positions of its
    samples, float [n_boot, n_g] counts) -- the columns of the [n_boot, n] weights, kept apart so that a score
    reads each group's block as it is (no gather of columns)."""

    n_boot: int
    n: int
    blocks: tuple[tuple[np.ndarray, np.ndarray], ...]

    def dense(self) -> np.ndarray:
        """float [n_boot, n]: the counts of every sample in each resample."""
        w = np.zeros((self.n_boot, self.n), dtype=np.float64)
        for idx, block in self.blocks:
            w[:, idx] = block
        return w

    @property
    def nbytes(self) -> int:
        return sum(block.nbytes for _, block in self.blocks)


# drawn weights reused (``_resample_weights``): {key: (weights, generator state after the draw)}, least recent first
_WEIGHTS_CACHE: "OrderedDict[str, tuple[Weights, dict[str, Any]]]" = OrderedDict()
WEIGHTS_CACHE_BYTES = 256 * 2**20  # at most this much held (a RULER run's 650 samples × 10,000 replicates: 52 MB)


def _resample_weights(group: np.ndarray, n_boot: int, rng: np.random.Generator) -> Weights:
    """How often each sample is drawn in each resample (``Weights``: per group, [n_boot, n_g]), drawn within its
    group (groups in increasing id, one multinomial each, columns in the samples' order: see the module docstring).
    The draw is a function of ``group``, ``n_boot`` and ``rng``'s state: a draw made before is returned again
    (read-only) and ``rng`` is moved to the state that draw left it in, exactly as drawing anew would."""
    state = rng.bit_generator.state
    group = np.ascontiguousarray(group, dtype=np.int64)
    key = hashlib.sha256(repr((state, n_boot, len(group))).encode() + group.tobytes()).hexdigest()
    hit = _WEIGHTS_CACHE.get(key)
    if hit is not None:
        _WEIGHTS_CACHE.move_to_end(key)
        rng.bit_generator.state = hit[1]
        return hit[0]
    blocks = []
    for g in np.unique(group):
        idx = np.flatnonzero(group == g)
        block = rng.multinomial(len(idx), np.full(len(idx), 1.0 / len(idx)), size=n_boot).astype(np.float64)
        idx.flags.writeable = block.flags.writeable = False
        blocks.append((idx, block))
    w = Weights(n_boot, len(group), tuple(blocks))
    if w.nbytes <= WEIGHTS_CACHE_BYTES // 4:
        _WEIGHTS_CACHE[key] = (w, rng.bit_generator.state)
        while sum(v[0].nbytes for v in _WEIGHTS_CACHE.values()) > WEIGHTS_CACHE_BYTES:
            _WEIGHTS_CACHE.popitem(last=False)
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
    """{diff, lo, hi, lo_mc, hi_mc, n, seeds, reference_seeds, significant}: θ_A − θ_B, two configurations each
    pooled over its seeds (``runs``: A's, ``reference_runs``: B's; θ as in the module docstring) on the samples every
    run of both finished, with the two-level paired interval.  Each replicate draws ONE set of sample weights W for
    both sides (paired on prompts), then A's seed indices, then B's (B's only when B has more than one run, so that a
    deterministic reference draws nothing: ``seed_pooled_difference`` is this with one reference run).  Use it to
    compare two settings of a stochastic method, e.g. MagicPIG (9, 120) against (10, 150), seeds 0–2 each.
    ``lo_mc``, ``hi_mc``: the end points' Monte Carlo errors (``quantile_mc_error``).  The replicates themselves:
    ``seed_pooled_draws``."""
    out = {"diff": None, "lo": None, "hi": None, "lo_mc": None, "hi_mc": None, "n": 0, "seeds": len(runs)}
    out.update(reference_seeds=len(reference_runs), level=level, significant=None)
    d = seed_pooled_draws(runs, reference_runs, n_boot=n_boot, seed=seed)
    out["n"] = len(d["ids"])
    if not d["ids"]:
        return out
    delta = d["theta_a"] - d["theta_b"]
    lo, hi = _interval(delta, level)
    significant = None if math.isnan(lo) or out["n"] < MIN_SIGNIFICANCE_N else bool(lo > 0 or hi < 0)
    a = (1.0 - level) / 2.0
    mc = {"lo_mc": quantile_mc_error(delta, a), "hi_mc": quantile_mc_error(delta, 1.0 - a)}
    return dict(out, diff=d["score_a"] - d["score_b"], lo=lo, hi=hi, significant=significant, **mc)


def seed_pooled_draws(
    runs: Sequence[ScoreTerms], reference_runs: Sequence[ScoreTerms], n_boot: int = N_BOOT, seed: int = 0
) -> dict[str, Any]:
    """The replicates behind ``seed_pooled_contrast``: {ids, score_a, score_b, theta_a, theta_b}: the samples every
    run of both sides finished, each side's score (the mean over its seeds), and each side's ``n_boot`` replicates
    θ*_A, θ*_B (float arrays, one W per replicate shared by both sides; module docstring).  A test of a claim
    derives its statistic from them (θ*_A − θ*_B, or θ*_A / θ*_B − 1).  No shared sample: ids [] and None for
    the rest."""
    ref_ids = [set(t.ids) for t in reference_runs]
    ids = [i for i in common_ids(runs) if all(i in r for r in ref_ids)] if reference_runs else []
    out: dict[str, Any] = {"ids": ids, "score_a": None, "score_b": None, "theta_a": None, "theta_b": None}
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
    return dict(
        out,
        score_a=float(np.mean([t.score() for t in subs])),
        score_b=float(np.mean([t.score() for t in refs])),
        theta_a=theta_a,
        theta_b=theta_b,
    )


def score_interval(task: Any, records: list[dict[str, Any]], seed: int = 0) -> dict[str, Any] | None:
    """The score's 95 % bootstrap interval over the finished samples (``sparse_eval.metrics.statistics``): {lo, hi, n,
    level, n_boot}; None where the task's samples are not units an interval can be drawn over."""
    terms = task.score_terms(records)
    if terms is None:
        return None
    ci = bootstrap_ci(terms, seed=seed)
    return {k: ci[k] for k in ("lo", "hi", "n", "level", "n_boot")}


# -- claims: equivalence, non-inferiority, superiority (module docstring) ---------------------------------------

TESTS = ("equivalence", "non_inferiority", "superiority")
VERDICTS = ("equivalent", "non-inferior", "better", "worse", "inferior", "undecided")
ALPHA = 0.05  # each one-sided test's level: the (1 − 2α) = 90 % interval decides
MC_LEVEL = 0.95  # the coverage of the order statistics that bound an end point's Monte Carlo error


def quantile_mc_error(draws: np.ndarray, q: float, mc_level: float = MC_LEVEL) -> float:
    """The Monte Carlo error of ``numpy.quantile(draws, q)`` (the finite draws): the larger distance from it to the
    order statistics X_(j), X_(k) that hold the q-quantile of the distribution the draws come from with probability
    about ``mc_level`` (j, k = R q ∓ z √(R q (1 − q)), the binomial count of draws below that quantile in its normal
    approximation, widened to whole ranks; module docstring).  NaN without finite draws."""
    v = np.sort(np.asarray(draws, dtype=np.float64)[np.isfinite(draws)])
    r = v.size
    if r == 0:
        return math.nan
    z = _normal_quantile(0.5 + mc_level / 2.0)
    half = z * math.sqrt(r * q * (1.0 - q))
    j = max(0, math.floor(r * q - half) - 1)  # 0-based: the order statistic X_(floor(Rq − h)) and below
    k = min(r - 1, math.ceil(r * q + half))  # 0-based: X_(ceil(Rq + h) + 1)
    x = float(np.quantile(v, q))
    err = float(max(x - v[j], v[k] - x))
    # replicates on a lattice (accuracies of n prompts) give an end point that does not move: 0, not rounding noise
    return 0.0 if err <= 1e-9 * max(1.0, abs(float(v[j])), abs(float(v[k]))) else err


def _normal_quantile(p: float) -> float:
    """The standard normal quantile, by bisection on the normal cdf (``math.erfc``)."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"_normal_quantile: p={p} must be in (0, 1)")
    lo, hi = -10.0, 10.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if 0.5 * math.erfc(-mid / math.sqrt(2.0)) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return (lo + hi) / 2.0


def tost_interval(draws: np.ndarray, alpha: float = ALPHA) -> dict[str, Any]:
    """{lo, hi, lo_mc, hi_mc, level}: the (1 − 2α) percentile interval of ``draws`` (a paired difference's bootstrap
    replicates) and each end point's Monte Carlo error (``quantile_mc_error``)."""
    if not 0.0 < alpha < 0.5:
        raise ValueError(f"alpha={alpha}: must be in (0, 0.5)")
    v = np.asarray(draws, dtype=np.float64)
    v = v[np.isfinite(v)]
    lo, hi = (float(x) for x in np.quantile(v, [alpha, 1.0 - alpha])) if v.size else (math.nan, math.nan)
    return {
        "lo": lo,
        "hi": hi,
        "lo_mc": quantile_mc_error(v, alpha),
        "hi_mc": quantile_mc_error(v, 1.0 - alpha),
        "level": 1.0 - 2.0 * alpha,
    }


def _rule(lo: float, hi: float, test: str, margin: float) -> str:
    """The verdict of an interval [lo, hi] of d (d > 0: A better) by the module docstring's rule, exactly."""
    if test == "equivalence":
        if -margin < lo and hi < margin:
            return "equivalent"
        return "better" if lo > 0 else "worse" if hi < 0 else "undecided"
    if test == "non_inferiority":
        if lo > 0:
            return "better"
        if lo > -margin:
            return "non-inferior"
        return "inferior" if hi < -margin else "worse" if hi < 0 else "undecided"
    return "better" if lo > 0 else "worse" if hi < 0 else "undecided"  # superiority


def _snap(x: float, thresholds: Sequence[float]) -> float:
    """``x`` put on a boundary it is within rounding of (1e-9, relative): replicates on a lattice (accuracies of n
    prompts, × 100) put end points exactly on a margin, and the last bits of a sum must not decide which side."""
    for t in thresholds:
        if abs(x - t) <= 1e-9 * max(1.0, abs(t)):
            return t
    return x


def _candidates(x: float, err: float, thresholds: Sequence[float]) -> list[float]:
    """Points of [x − err, x + err] that meet every side of every threshold in it: its ends, the thresholds inside
    and the midpoints between consecutive ones (the rule is constant between thresholds)."""
    pts = sorted({x - err, x + err, *(t for t in thresholds if x - err < t < x + err)})
    return sorted({*pts, *((a + b) / 2.0 for a, b in zip(pts, pts[1:]))})


def claim_verdict(
    lo: float,
    hi: float,
    test: str = "equivalence",
    margin: float | None = None,
    mc_error: tuple[float, float] = (0.0, 0.0),
) -> str:
    """The verdict of a claim (module docstring, "Claims"): ``lo``, ``hi``, the (1 − 2α) paired interval of the
    difference d oriented so that d > 0 means A is better than the reference; ``test`` one of ``TESTS``;
    ``margin`` > 0 (equivalence, non-inferiority; none for superiority); ``mc_error`` the end points' Monte Carlo
    errors (e_lo, e_hi).  One of ``VERDICTS``: the rule's answer when every interval within the Monte Carlo errors
    gets the same answer, else "undecided"."""
    if test not in TESTS:
        raise ValueError(f"test={test!r}; valid: {list(TESTS)}")
    if test == "superiority":
        if margin not in (None, 0):
            raise ValueError(f"a superiority claim has no margin (got {margin})")
        m = 0.0
    else:
        if margin is None or not math.isfinite(margin) or margin <= 0:
            raise ValueError(f"an {test} claim needs a finite margin > 0 (got {margin})")
        m = float(margin)
    if any(v is None or not math.isfinite(v) for v in (lo, hi)) or lo > hi:
        return "undecided"
    e_lo, e_hi = (0.0 if e is None or not math.isfinite(e) else abs(float(e)) for e in mc_error)
    thresholds = (-m, 0.0, m)
    lo, hi = _snap(float(lo), thresholds), _snap(float(hi), thresholds)
    answers = {
        _rule(a, b, test, m)
        for a in _candidates(lo, e_lo, thresholds)
        for b in _candidates(hi, e_hi, thresholds)
        if a <= b
    }
    return answers.pop() if len(answers) == 1 else "undecided"
