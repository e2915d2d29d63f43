"""Confidence intervals and paired differences (sparse_eval.statistics): coverage on synthetic data with a known
answer, pairing, and each task's score terms reproducing its own aggregate."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sparse_eval.statistics import ScoreTerms, bootstrap_ci, paired_difference, seed_spread


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
    recs = [{"id": f"w{i}", "nll_sum": float(rng.uniform(500, 900)), "tokens": int(rng.integers(200, 300))}
            for i in range(7)]
    assert wt.score_terms(recs).score() == pytest.approx(wt.aggregate(recs)["ppl"], rel=1e-12)

    ruler = build_task({"name": "ruler", "subtasks": ["niah_single_1", "vt", "cwe"], "haystack": "noise"})
    recs = [{"id": f"{s}-{i}", "subtask": s, "score": float(rng.choice([0, 50, 100])), "prediction": "x"}
            for s, k in (("niah_single_1", 5), ("vt", 3), ("cwe", 8)) for i in range(k)]
    assert ruler.score_terms(recs).score() == pytest.approx(ruler.aggregate(recs)["score"], rel=1e-12)

    kv = build_task({"name": "kv_retrieval"})
    recs = [{"id": str(i), "score": float(rng.choice([0, 100])), "gold_position": i % 3, "num_keys": 10,
             "prompt_tokens": 100} for i in range(9)]
    assert kv.score_terms(recs).score() == pytest.approx(kv.aggregate(recs)["accuracy"], rel=1e-12)
