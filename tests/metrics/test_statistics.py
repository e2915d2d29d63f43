"""Confidence intervals and paired differences (sparse_eval.metrics.statistics): coverage on synthetic data with a known
answer, pairing, and each task's score terms reproducing its own aggregate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparse_eval.metrics.statistics import ScoreTerms, bootstrap_ci, paired_difference, seed_spread


def _mean_terms(values, groups=None, prefix="s"):
    n = len(values)
    return ScoreTerms([f"{prefix}{i}" for i in range(n)], values, np.ones(n), np.zeros(n) if groups is None else groups)


@pytest.mark.parametrize("p,n", [(0.3, 100), (0.8, 50)])
def test_interval_coverage_of_a_known_mean(p, n):
    """Bernoulli(p) samples scored 0/100: the 95 % interval holds 100 p in about 95 % of 300 repetitions."""
    rng = np.random.default_rng(1)
    hits = 0
    for rep in range(300):
        x = 100.0 * (rng.random(n) < p)
        ci = bootstrap_ci(_mean_terms(x), n_boot=1000, seed=rep)
        hits += ci["lo"] <= 100 * p <= ci["hi"]
    assert 0.90 <= hits / 300 <= 0.99, hits / 300


def test_interval_coverage_of_a_perplexity():
    """Windows with known per-token NLL rate: exp(Σ nll / Σ tokens) of the population lies in the interval
    about 95 % of the time."""
    rng = np.random.default_rng(2)
    true_rate = 3.0
    hits = 0
    for rep in range(200):
        tokens = rng.integers(200, 512, size=40).astype(float)
        nll = tokens * true_rate + rng.normal(0, 30, size=40)  # zero-mean noise around the true rate
        t = ScoreTerms([f"w{i}" for i in range(40)], nll, tokens, np.zeros(40), transform="exp")
        ci = bootstrap_ci(t, n_boot=1000, seed=rep)
        hits += ci["lo"] <= math.exp(true_rate) <= ci["hi"]
    assert 0.88 <= hits / 200 <= 0.99, hits / 200


def test_stratified_macro_average_keeps_group_sizes():
    """Two subtasks with different means: every resample keeps each subtask's count, so the interval of the
    macro average is centred on it, and a constant subtask contributes no width."""
    a = np.full(30, 100.0)  # a subtask every method gets right
    b = 100.0 * (np.arange(30) % 2)  # 50 %
    t = _mean_terms(np.concatenate([a, b]), groups=np.array([0] * 30 + [1] * 30))
    ci = bootstrap_ci(t, n_boot=2000)
    assert ci["score"] == pytest.approx(75.0)
    # half the width of subtask b's own interval, since it is averaged with a zero-variance subtask
    cb = bootstrap_ci(_mean_terms(b), n_boot=2000)
    assert (ci["hi"] - ci["lo"]) == pytest.approx((cb["hi"] - cb["lo"]) / 2, rel=0.25)


def test_paired_difference_is_narrower_than_unpaired_and_detects_a_shift():
    rng = np.random.default_rng(3)
    hardness = rng.normal(0, 10, size=200)  # per-sample difficulty shared by both methods
    ref = 50 + hardness + rng.normal(0, 1, size=200)
    worse = 48 + hardness + rng.normal(0, 1, size=200)  # 2 points worse on every sample
    d = paired_difference(_mean_terms(worse), _mean_terms(ref))
    assert d["n"] == 200 and d["significant"] is True
    assert d["diff"] == pytest.approx(-2, abs=0.3) and d["lo"] <= -2 <= d["hi"]
    width_paired = d["hi"] - d["lo"]
    ci_a, ci_b = bootstrap_ci(_mean_terms(worse)), bootstrap_ci(_mean_terms(ref))
    assert width_paired < 0.3 * (ci_a["hi"] - ci_a["lo"] + ci_b["hi"] - ci_b["lo"])
    same = paired_difference(_mean_terms(ref), _mean_terms(ref))
    assert same["diff"] == 0 and same["significant"] is False


def test_paired_difference_uses_only_shared_samples():
    a = ScoreTerms(["x", "y", "z"], [1.0, 0.0, 1.0], [1, 1, 1], [0, 0, 0])
    b = ScoreTerms(["y", "z", "w"], [1.0, 1.0, 0.0], [1, 1, 1], [0, 0, 0])
    d = paired_difference(a, b)
    assert d["n"] == 2 and d["diff"] == pytest.approx(-0.5)
    assert d["significant"] is None  # 2 shared samples: too few to claim a difference either way
    assert paired_difference(a, ScoreTerms(["q"], [1.0], [1], [0]))["n"] == 0


def test_interval_end_points_are_the_resampled_quantiles():
    """bootstrap_ci and paired_difference, 95 %: the end points are the 2.5 % and 97.5 % quantiles of the score over
    the resamples, drawn here as the module docstring says (fixed seed) and scored by plain loops."""
    rng = np.random.default_rng(21)
    n, n_boot, seed = 23, 300, 4
    group = np.array([0] * 9 + [1] * 14)
    ids = [f"x{i}" for i in range(n)]
    a = ScoreTerms(ids, rng.normal(50, 20, n), np.ones(n), group)
    b = ScoreTerms(ids, a.num + rng.normal(-3, 5, n), np.ones(n), group)
    gen = np.random.default_rng(seed)
    counts = np.zeros((n_boot, n), dtype=np.int64)
    for g in (0, 1):
        idx = np.flatnonzero(group == g)
        counts[:, idx] = gen.multinomial(len(idx), [1.0 / len(idx)] * len(idx), size=n_boot)

    def score(t, r):  # the macro average over the groups of the resampled list r
        return np.mean(
            [sum(t.num[i] * counts[r, i] for i in np.flatnonzero(group == g)) / (group == g).sum() for g in (0, 1)]
        )

    lo, hi = np.quantile([score(a, r) for r in range(n_boot)], [0.025, 0.975])
    ci = bootstrap_ci(a, n_boot=n_boot, seed=seed)
    assert ci["level"] == 0.95
    assert ci["lo"] == pytest.approx(lo, rel=1e-12) and ci["hi"] == pytest.approx(hi, rel=1e-12)
    lo, hi = np.quantile([score(b, r) - score(a, r) for r in range(n_boot)], [0.025, 0.975])
    d = paired_difference(b, a, n_boot=n_boot, seed=seed)
    assert d["level"] == 0.95
    assert d["lo"] == pytest.approx(lo, rel=1e-12) and d["hi"] == pytest.approx(hi, rel=1e-12)


def test_intervals_are_seeded_and_empty_is_none():
    t = _mean_terms(np.arange(20.0))
    assert bootstrap_ci(t, seed=5) == bootstrap_ci(t, seed=5)
    assert bootstrap_ci(_mean_terms([]))["score"] is None


def test_seed_spread():
    s = seed_spread([1.0, 2.0, 3.0, None])
    assert s["n_seeds"] == 3 and s["mean"] == 2.0 and s["std"] == pytest.approx(1.0)
    assert seed_spread([4.0])["std"] is None


def test_every_task_terms_reproduce_its_aggregate():
    """score_terms(records).score() is the task's own headline metric, for each task's aggregation rule."""
    from sparse_eval.tasks import build_task

    rng = np.random.default_rng(4)
    wt = build_task({"name": "wikitext"})
    recs = [
        {"id": f"w{i}", "nll_sum": float(rng.uniform(500, 900)), "tokens": int(rng.integers(200, 300))}
        for i in range(7)
    ]
    assert wt.score_terms(recs).score() == pytest.approx(wt.aggregate(recs)["ppl"], rel=1e-12)

    ruler = build_task({"name": "ruler", "subtasks": ["niah_single_1", "vt", "cwe"], "haystack": "noise"})
    recs = [
        {"id": f"{s}-{i}", "subtask": s, "score": float(rng.choice([0, 50, 100])), "prediction": "x"}
        for s, k in (("niah_single_1", 5), ("vt", 3), ("cwe", 8))
        for i in range(k)
    ]
    assert ruler.score_terms(recs).score() == pytest.approx(ruler.aggregate(recs)["score"], rel=1e-12)

    kv = build_task({"name": "kv_retrieval"})
    recs = [
        {
            "id": str(i),
            "score": float(rng.choice([0, 100])),
            "gold_position": i % 3,
            "num_keys": 10,
            "prompt_tokens": 100,
        }
        for i in range(9)
    ]
    assert kv.score_terms(recs).score() == pytest.approx(kv.aggregate(recs)["accuracy"], rel=1e-12)


# -- over prompts and seeds (stochastic methods) ----------------------------------------------------------------


def _brute_two_level(runs, reference, n_boot, seed, level=0.95):
    """The two-level bootstrap of the module docstring written out plainly: explicit resampled index lists per
    group and explicit seed draws, loops instead of matrix products (same generator, same order of draws).
    ``reference``: None, one run (not resampled over seeds) or a list of runs (a second configuration's seeds,
    drawn after the first's)."""
    refs = [] if reference is None else (list(reference) if isinstance(reference, list) else [reference])
    ids = [i for i in runs[0].ids if all(i in t.ids for t in runs[1:] + refs)]
    sub = [t.subset(ids) for t in runs]
    ref_sub = [t.subset(ids) for t in refs]
    group = sub[0].group
    groups = sorted(set(group.tolist()))
    rng = np.random.default_rng(seed)
    counts = np.zeros((n_boot, len(ids)), dtype=np.int64)
    for g in groups:
        idx = np.flatnonzero(group == g)
        counts[:, idx] = rng.multinomial(len(idx), [1.0 / len(idx)] * len(idx), size=n_boot)
    picks = rng.integers(0, len(sub), size=(n_boot, len(sub)))
    ref_picks = rng.integers(0, len(ref_sub), size=(n_boot, len(ref_sub))) if len(ref_sub) > 1 else None
    transform = math.exp if sub[0].transform == "exp" else (lambda x: x)

    def score(t, b):
        per_group = []
        for g in groups:
            members = [i for i in np.flatnonzero(group == g) for _ in range(counts[b, i])]  # the resampled list
            per_group.append(sum(t.num[i] for i in members) / sum(t.den[i] for i in members))
        return transform(sum(per_group) / len(per_group))

    stats = []
    for b in range(n_boot):
        value = sum(score(sub[k], b) for k in picks[b]) / len(sub)
        if ref_picks is not None:
            value -= sum(score(ref_sub[k], b) for k in ref_picks[b]) / len(ref_sub)
        elif ref_sub:
            value -= score(ref_sub[0], b)
        stats.append(value)
    a = (1 - level) / 2
    return np.quantile(np.array(stats), [a, 1 - a])


@pytest.mark.parametrize("transform", ["identity", "exp"])
def test_two_level_interval_equals_brute_force(transform):
    """seed_pooled_ci / seed_pooled_difference reproduce an independent, loop-by-loop implementation of the same
    resampling (same generator seed) to 1e-12; the reference is paired on samples and not resampled over seeds."""
    from sparse_eval.metrics.statistics import seed_pooled_ci, seed_pooled_difference

    rng = np.random.default_rng(11)
    n, seeds, n_boot = 17, 3, 200
    group = np.array([0] * 6 + [1] * 4 + [2] * 7)
    ids = [f"x{i}" for i in range(n)]
    den = rng.integers(50, 100, size=n).astype(float) if transform == "exp" else np.ones(n)

    def terms(shift):
        num = (
            (den * (3.0 + shift + rng.normal(0, 0.3, size=n))) if transform == "exp" else rng.normal(50 + shift, 20, n)
        )
        return ScoreTerms(ids, num, den, group, transform)

    runs = [terms(0.1 * s) for s in range(seeds)]
    # one seed lost a sample: the seeds are pooled over the samples every seed finished
    runs[1] = runs[1].subset([i for i in ids if i != "x3"])
    full = terms(0.0)
    ci = seed_pooled_ci(runs, n_boot=n_boot, seed=7)
    lo, hi = _brute_two_level(runs, None, n_boot, 7)
    assert ci["n"] == n - 1 and ci["seeds"] == seeds
    assert ci["lo"] == pytest.approx(lo, rel=1e-12, abs=1e-12) and ci["hi"] == pytest.approx(hi, rel=1e-12, abs=1e-12)
    common = [i for i in ids if i != "x3"]
    assert ci["score"] == pytest.approx(np.mean([t.subset(common).score() for t in runs]), rel=1e-12)
    d = seed_pooled_difference(runs, full.subset([i for i in ids if i != "x5"]), n_boot=n_boot, seed=7)
    lo, hi = _brute_two_level(runs, full.subset([i for i in ids if i != "x5"]), n_boot, 7)
    assert d["n"] == n - 2
    assert d["lo"] == pytest.approx(lo, rel=1e-12, abs=1e-12) and d["hi"] == pytest.approx(hi, rel=1e-12, abs=1e-12)


def test_contrast_of_two_seed_pooled_configurations_equals_brute_force():
    """seed_pooled_contrast (setting A's seeds against setting B's, paired on prompts) reproduces the plain
    implementation (one set of sample weights, A's seed draws, then B's) to 1e-12 on the samples all six runs
    finished; with one reference run it is seed_pooled_difference exactly."""
    from sparse_eval.metrics.statistics import seed_pooled_contrast, seed_pooled_difference

    rng = np.random.default_rng(21)
    n, n_boot = 23, 300
    group = np.array([0] * 9 + [1] * 6 + [2] * 8)
    ids = [f"x{i}" for i in range(n)]
    prompt = rng.normal(0, 15, n)

    def run(shift):
        return ScoreTerms(ids, 40 + shift + prompt + rng.normal(0, 5, n), np.ones(n), group, "identity")

    a = [run(3.0 + 0.5 * s) for s in range(3)]
    b = [run(0.0 + 0.5 * s) for s in range(3)]
    b[2] = b[2].subset([i for i in ids if i != "x4"])  # a sample one run of B lacks: left out of both sides
    c = seed_pooled_contrast(a, b, n_boot=n_boot, seed=5)
    lo, hi = _brute_two_level(a, b, n_boot, 5)
    assert c["n"] == n - 1 and (c["seeds"], c["reference_seeds"]) == (3, 3)
    assert c["lo"] == pytest.approx(lo, rel=1e-12, abs=1e-12) and c["hi"] == pytest.approx(hi, rel=1e-12, abs=1e-12)
    common = [i for i in ids if i != "x4"]
    expect = np.mean([t.subset(common).score() for t in a]) - np.mean([t.subset(common).score() for t in b])
    assert c["diff"] == pytest.approx(expect, rel=1e-12) and c["lo"] < c["diff"] < c["hi"]
    one = seed_pooled_contrast(a, [b[0]], n_boot=n_boot, seed=5)
    assert one == dict(seed_pooled_difference(a, b[0], n_boot=n_boot, seed=5), reference_seeds=1)
    # two configurations that differ: the paired interval excludes 0; a configuration against itself: diff 0
    assert c["significant"] is True
    same = seed_pooled_contrast(a, a, n_boot=n_boot, seed=5)
    assert same["diff"] == 0.0 and same["lo"] < 0 < same["hi"]


def test_two_level_with_one_seed_is_the_one_level_bootstrap():
    from sparse_eval.metrics.statistics import seed_pooled_ci, seed_pooled_difference

    rng = np.random.default_rng(12)
    a, b = _mean_terms(rng.normal(50, 10, 40)), _mean_terms(rng.normal(48, 10, 40))
    one, ref = seed_pooled_ci([a], seed=3), bootstrap_ci(a, seed=3)
    assert (one["score"], one["lo"], one["hi"], one["n"]) == (ref["score"], ref["lo"], ref["hi"], ref["n"])
    d, dref = seed_pooled_difference([a], b, seed=3), paired_difference(a, b, seed=3)
    assert (d["diff"], d["lo"], d["hi"], d["n"], d["significant"]) == (
        dref["diff"],
        dref["lo"],
        dref["hi"],
        dref["n"],
        dref["significant"],
    )


def test_two_level_interval_covers_a_mean_with_seed_variance():
    """Crossed prompts × seeds, x[s, i] = μ + a_i + b_s + e: the two-level interval holds μ in about 95 % of the
    repetitions; the prompts-only interval of the same seed-averaged score misses far more often (it leaves out
    the seed variance σ_b²/S)."""
    from sparse_eval.metrics.statistics import seed_pooled_ci

    rng = np.random.default_rng(13)
    n, seeds, mu, reps = 60, 5, 50.0, 200
    hits_two = hits_one = 0
    for rep in range(reps):
        a = rng.normal(0, 10, n)
        b = rng.normal(0, 3, seeds)
        runs = [_mean_terms(mu + a + b[s] + rng.normal(0, 5, n)) for s in range(seeds)]
        ci = seed_pooled_ci(runs, n_boot=1000, seed=rep)
        hits_two += ci["lo"] <= mu <= ci["hi"]
        averaged = _mean_terms(np.mean([t.num for t in runs], axis=0))
        one = bootstrap_ci(averaged, n_boot=1000, seed=rep)
        hits_one += one["lo"] <= mu <= one["hi"]
    assert 0.86 <= hits_two / reps <= 0.99, hits_two / reps
    assert hits_one / reps <= hits_two / reps - 0.05, (hits_one / reps, hits_two / reps)
