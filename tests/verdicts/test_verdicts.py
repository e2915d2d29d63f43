"""Claims and their verdicts: the rule of sparse_eval.metrics.statistics.claim_verdict on constructed intervals
(boundaries included), the Monte Carlo error of an interval's end points, the claims' schema, and the generated verdicts
of experiments/ (each folder's section and the summary table are what ``python -m sparse_eval.verdicts`` writes from the
committed records)."""

from __future__ import annotations

import json
import math
import tarfile
from pathlib import Path

import numpy as np
import pytest

from sparse_eval.metrics import statistics as st
from sparse_eval.metrics.statistics import claim_verdict, quantile_mc_error, tost_interval

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"


# -- the rule ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "lo,hi,verdict",
    [
        (-1.0, 1.0, "equivalent"),
        (0.5, 1.5, "equivalent"),  # inside the margin though above 0: equivalent takes precedence
        (0.0, 1.0, "equivalent"),
        (-1.999, 1.999, "equivalent"),
        (-2.0, 1.0, "undecided"),  # an end point on the margin is not inside it, and the interval covers 0
        (-1.0, 2.0, "undecided"),
        (-3.0, 3.0, "undecided"),
        (-2.5, -0.5, "worse"),
        (-2.0, -0.1, "worse"),
        (-3.0, 0.0, "undecided"),  # an end point on 0 is not below it
        (0.5, 2.5, "better"),
        (0.0, 3.0, "undecided"),
        (-10.0, -3.0, "worse"),
    ],
)
def test_equivalence_rule(lo, hi, verdict):
    assert claim_verdict(lo, hi, "equivalence", 2.0) == verdict


@pytest.mark.parametrize(
    "lo,hi,verdict",
    [
        (0.1, 1.0, "better"),
        (0.0, 1.0, "non-inferior"),
        (-1.0, 1.0, "non-inferior"),
        (-1.0, -0.5, "non-inferior"),  # a loss shown to be smaller than the margin
        (-2.0, 1.0, "undecided"),  # on the margin: not above it
        (-5.0, -2.5, "inferior"),
        (-5.0, -2.0, "worse"),  # the upper end on −m is not below it, but below 0
        (-3.0, -1.0, "worse"),
        (-3.0, 1.0, "undecided"),
        (-3.0, 0.0, "undecided"),
    ],
)
def test_non_inferiority_rule(lo, hi, verdict):
    assert claim_verdict(lo, hi, "non_inferiority", 2.0) == verdict


@pytest.mark.parametrize(
    "lo,hi,verdict",
    [
        (0.1, 1.0, "better"),
        (0.0, 1.0, "undecided"),
        (-1.0, -0.1, "worse"),
        (-1.0, 0.0, "undecided"),
        (-1.0, 1.0, "undecided"),
    ],
)
def test_superiority_rule(lo, hi, verdict):
    assert claim_verdict(lo, hi, "superiority") == verdict


@pytest.mark.parametrize(
    "lo,hi,test,err,verdict",
    [
        (-1.9, 1.9, "equivalence", (0.05, 0.05), "equivalent"),  # 0.1 from each margin, error 0.05
        (-1.9, 1.9, "equivalence", (0.1, 0.0), "undecided"),  # lo within its error of −m (closed: −2.0 counts)
        (-1.95, 1.0, "equivalence", (0.05, 0.0), "undecided"),  # lo − e exactly on the margin
        (-1.9, 1.96, "equivalence", (0.0, 0.05), "undecided"),
        (0.01, 1.0, "equivalence", (0.05, 0.05), "equivalent"),  # near 0, which this verdict does not depend on
        (-5.0, -0.03, "equivalence", (0.05, 0.05), "undecided"),  # worse or undecided: undecided
        (-5.0, -0.03, "equivalence", (0.05, 0.02), "worse"),
        (-10.0, -3.0, "equivalence", (0.5, 0.5), "worse"),
        (0.04, 3.0, "superiority", (0.05, 0.0), "undecided"),
        (0.06, 3.0, "superiority", (0.05, 0.0), "better"),
        (-2.03, -0.5, "non_inferiority", (0.05, 0.0), "undecided"),  # non-inferior or worse
        (-5.0, -2.1, "non_inferiority", (0.0, 0.2), "undecided"),  # inferior or worse: two verdicts, undecided
        (-5.0, -2.5, "non_inferiority", (0.0, 0.2), "inferior"),
    ],
)
def test_monte_carlo_error_makes_a_close_call_undecided(lo, hi, test, err, verdict):
    margin = None if test == "superiority" else 2.0
    assert claim_verdict(lo, hi, test, margin, mc_error=err) == verdict


def test_bad_claims_are_refused_and_a_bad_interval_is_undecided():
    with pytest.raises(ValueError, match="margin"):
        claim_verdict(-1, 1, "equivalence", 0)
    with pytest.raises(ValueError, match="margin"):
        claim_verdict(-1, 1, "non_inferiority", None)
    with pytest.raises(ValueError, match="no margin"):
        claim_verdict(-1, 1, "superiority", 2.0)
    with pytest.raises(ValueError, match="test="):
        claim_verdict(-1, 1, "equal", 2.0)
    assert claim_verdict(math.nan, 1.0, "equivalence", 2.0) == "undecided"
    # an end point on the margin up to the last bits (a lattice of accuracies × 100) is on it
    assert claim_verdict(-2.0 + 1e-13, 1.0, "equivalence", 2.0) == "undecided"
    assert claim_verdict(-3.0, -1e-15, "equivalence", 2.0) == "undecided"
    assert claim_verdict(1.0, -1.0, "equivalence", 2.0) == "undecided"


# -- the interval and its Monte Carlo error ------------------------------------------------------------------


def test_mc_error_covers_the_true_quantile_and_has_the_binomial_size():
    """Normal draws: the 5 % quantile of N(0, 1) lies within the error of the estimate from 10,000 draws in about
    95 % of replications, and the error is about 1.96 standard errors of a sample quantile."""
    rng = np.random.default_rng(0)
    true = -1.6448536269514715
    se = math.sqrt(0.05 * 0.95 / 10_000) / (math.exp(-(true**2) / 2) / math.sqrt(2 * math.pi))
    hits, errs = 0, []
    for _ in range(200):
        x = rng.standard_normal(10_000)
        e = quantile_mc_error(x, 0.05)
        hits += abs(float(np.quantile(x, 0.05)) - true) <= e
        errs.append(e)
    assert hits / 200 >= 0.9, hits / 200
    assert 1.5 * se <= float(np.median(errs)) <= 3.0 * se, (np.median(errs), se)
    assert quantile_mc_error(np.full(1000, 3.0), 0.05) == 0.0  # replicates on one value: the end point is fixed
    assert math.isnan(quantile_mc_error(np.array([math.nan]), 0.05))


def test_tost_interval_is_the_one_minus_two_alpha_interval():
    x = np.random.default_rng(1).standard_normal(20_000)
    t = tost_interval(x, 0.05)
    assert (t["lo"], t["hi"]) == tuple(np.quantile(x, [0.05, 0.95]))
    assert t["level"] == pytest.approx(0.9) and 0 < t["lo_mc"] < 0.05 and 0 < t["hi_mc"] < 0.05
    with pytest.raises(ValueError, match="alpha"):
        tost_interval(x, 0.5)


def test_seed_pooled_draws_give_the_contrast_interval():
    rng = np.random.default_rng(2)
    n = 40
    ids = [f"x{i}" for i in range(n)]
    runs = [st.ScoreTerms(ids, rng.random(n) * 100, np.ones(n), np.arange(n) % 2) for _ in range(3)]
    ref = st.ScoreTerms(ids, rng.random(n) * 100, np.ones(n), np.arange(n) % 2)
    c = st.seed_pooled_contrast(runs, [ref], n_boot=3000, seed=4)
    d = st.seed_pooled_draws(runs, [ref], n_boot=3000, seed=4)
    assert (c["lo"], c["hi"]) == pytest.approx(tuple(np.quantile(d["theta_a"] - d["theta_b"], [0.025, 0.975])))
    assert c["diff"] == d["score_a"] - d["score_b"]


def test_resampled_weights_are_reused_exactly():
    """A draw made before is returned again and moves the generator as drawing anew would; a score read from the
    per-group blocks is the score of the whole weight matrix."""
    group = np.array([0] * 7 + [1] * 5)
    st._WEIGHTS_CACHE.clear()
    r1 = np.random.default_rng(11)
    w1 = st._resample_weights(group, 500, r1).dense()
    after1 = r1.integers(0, 1000, size=5)
    r2 = np.random.default_rng(11)
    w2 = st._resample_weights(group, 500, r2).dense()  # from the cache
    assert np.array_equal(w1, w2) and np.array_equal(after1, r2.integers(0, 1000, size=5))
    st._WEIGHTS_CACHE.clear()
    w3 = st._resample_weights(group, 500, np.random.default_rng(11)).dense()  # drawn anew
    assert np.array_equal(w1, w3)
    assert not np.array_equal(w1, st._resample_weights(group, 500, np.random.default_rng(12)).dense())
    t = st.ScoreTerms([f"s{i}" for i in range(12)], np.arange(12.0), np.arange(1.0, 13.0), group)
    w = st._resample_weights(group, 500, np.random.default_rng(11))
    assert t._stat(w) == pytest.approx(t._stat(w.dense()), rel=1e-13)  # the same sums (order of addition aside)


# -- the claims' schema --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "claim,msg",
    [
        ({"name": "x", "a": "topk-*"}, "margin"),
        ({"name": "x", "a": "topk-*", "margin": -1}, "margin"),
        ({"name": "x", "a": "topk-*", "margin": 2, "test": "equal"}, "test="),
        ({"name": "x", "a": "topk-*", "margin": 2, "test": "superiority"}, "no margin"),
        ({"name": "x", "a": "topk-*", "margin": 0.01, "scale": "log"}, "scale="),
        ({"name": "x", "a": "topk-*", "margin": 2, "scale": "relative"}, "fraction"),
        ({"name": "x", "a": "topk-*", "margin": 2, "alpha": 0.5}, "alpha="),
        ({"name": "x", "a": "topk-*", "margin": 2, "where": {"seed": 0}}, "valid keys"),
        ({"name": "x", "a": "topk-*", "marjin": 2}, "marjin"),
        ({"name": "x", "a": "topk-*", "margin": "two"}, "two"),
        ({"name": "x", "a": "", "margin": 2}, "empty"),
        ({"name": "x", "a": "topk-*", "margin": 2, "post_hoc": True}, "declared before its runs"),
    ],
)
def test_a_bad_claim_is_refused_at_start(claim, msg):
    from omegaconf import OmegaConf

    from sparse_eval.verdicts.claims import check_claims

    with pytest.raises(ValueError, match=msg):
        check_claims(OmegaConf.create({"claims": [claim]}))


def test_claims_of_the_experiment_configs_are_valid_and_recorded():
    from omegaconf import OmegaConf

    from sparse_eval.verdicts.claims import check_claims, claims_record

    declared = 0
    for p in sorted((ROOT / "conf" / "experiment").glob("*.yaml")):
        cfg = OmegaConf.load(p)
        declared += len(check_claims(cfg))
    assert declared > 0, "no experiment config declares its claims"
    cfg = OmegaConf.create({"claims": [{"name": "x", "a": "topk-*", "margin": 2}]})
    assert claims_record(cfg) == [
        {
            "name": "x",
            "test": "equivalence",
            "a": "topk-*",
            "b": "full",
            "margin": 2.0,
            "scale": "absolute",
            "alpha": 0.05,
            "score_factor": 1.0,
            "where": {},
            "note": None,
            "summary": True,
        }
    ]
    with pytest.raises(ValueError, match="two claims"):
        check_claims(OmegaConf.create({"claims": [{"name": "x", "a": "t", "margin": 2}] * 2}))


def test_a_run_with_a_bad_claim_is_refused_before_anything_runs(tmp_path):
    from omegaconf import OmegaConf

    from sparse_eval.launcher.runner import run

    cfg = OmegaConf.create(
        {"claims": [{"name": "x", "a": "topk-*", "margin": 0}], "paths": {"runs_dir": str(tmp_path)}}
    )
    with pytest.raises(ValueError, match="margin"):
        run(cfg)
    assert list(tmp_path.iterdir()) == []


def test_the_run_config_schema_refuses_an_unknown_claim_key():
    from omegaconf import OmegaConf

    from sparse_eval.config import Config

    schema = OmegaConf.structured(Config)
    ok = OmegaConf.merge(schema, {"claims": [{"name": "x", "a": "topk-*", "margin": 2}]})
    assert ok.claims[0].margin == 2.0 and ok.claims[0].b == "full"
    with pytest.raises(Exception, match="marjin"):
        OmegaConf.merge(schema, {"claims": [{"name": "x", "a": "topk-*", "marjin": 2}]})


# -- the committed verdicts ----------------------------------------------------------------------------------


def _folders():
    from sparse_eval.verdicts.evaluate import claim_folders

    return claim_folders(EXPERIMENTS)


def test_committed_verdict_sections_are_what_the_command_writes():
    """Each folder's verdicts.json was made from the claims.yaml and records committed now (their sha256), its
    README section is that verdicts.json rendered, and experiments/README.md's summary is all of them."""
    from sparse_eval.verdicts import evaluate as v

    folders = _folders()
    assert len(folders) >= 9
    assert not any(f.name in v.WITHDRAWN for f in folders)
    datas = []
    for f in folders:
        data = v.read_verdicts(f)
        assert data is not None, f"{f}: no verdicts.json; run python -m sparse_eval.verdicts --all --write"
        assert data["version"] == v.VERSION, f"{f}: verdicts.json of another version; regenerate it"
        assert v.inputs_now(f, data) == data["inputs"], f"{f}: claims.yaml or records changed; regenerate"
        text = (f / "README.md").read_text(encoding="utf-8")
        assert v.section_of(text, v.BEGIN, v.END) == v.folder_section(data), f"{f}/README.md: stale section"
        datas.append(data)
    summary = (EXPERIMENTS / "README.md").read_text(encoding="utf-8")
    assert v.section_of(summary, v.SUMMARY_BEGIN, v.SUMMARY_END) == v.summary_section(datas)
    for name in v.WITHDRAWN:  # withdrawn records: in no generated table
        assert f"`{name}/`" not in v.summary_section(datas)


@pytest.fixture(scope="module")
def longbench_rows(tmp_path_factory):
    """The rows of longbench_triviaqa_smollm2's runs (5 runs, 200 prompts), unpacked once."""
    from sparse_eval.verdicts.evaluate import extract, gather_rows

    tmp = tmp_path_factory.mktemp("longbench")
    with tarfile.open(EXPERIMENTS / "longbench_triviaqa_smollm2" / "runs.tar.gz") as tar:
        extract(tar, tmp)
    return tmp, gather_rows(tmp, set())


def test_a_folder_recomputed_from_its_records_gives_its_committed_verdicts(longbench_rows):
    from sparse_eval.verdicts import evaluate as v

    folder = EXPERIMENTS / "longbench_triviaqa_smollm2"
    spec, claims = v.load_claims_file(folder / v.CLAIMS_FILE)
    _, rows = longbench_rows
    results = [r for c in claims for r in v.evaluate_claim(c, rows, spec.n_boot, spec.seed)]
    committed = v.read_verdicts(folder)
    assert v.folder_section(dict(committed, claims=results)) == v.folder_section(committed)
    for f in ("error_vs_budget_smollm2_8k", "error_vs_budget_smollm2_4k_passages"):  # the descriptive ratios
        assert v.folder_section(v.compute_folder(EXPERIMENTS / f)) == v.folder_section(v.read_verdicts(EXPERIMENTS / f))


def test_a_claim_must_select_one_configuration_on_each_side(longbench_rows):
    from sparse_eval.verdicts.claims import as_claim
    from sparse_eval.verdicts.evaluate import ClaimError, evaluate_claim

    _, rows = longbench_rows
    with pytest.raises(ClaimError, match="2 configurations"):
        evaluate_claim(as_claim({"name": "x", "a": "magicpig-*", "margin": 2}), rows, 2000, 0)
    with pytest.raises(ClaimError, match="matches no row"):
        evaluate_claim(as_claim({"name": "x", "a": "topk-*", "margin": 2}), rows, 2000, 0)
    with pytest.raises(ClaimError, match="same configuration"):
        evaluate_claim(as_claim({"name": "x", "a": "full", "margin": 2}), rows, 2000, 0)


def test_claims_recorded_by_the_runs_are_tested_from_a_runs_folder(longbench_rows, capsys):
    """A runs folder has no claims.yaml: the claims its runs recorded in summary.json (declared before the runs)."""
    from sparse_eval.verdicts.evaluate import main

    tmp, _ = longbench_rows
    claim = {"name": "Quest (16, 0.05) ≈ full", "a": "quest-page_size=16-*", "margin": 2.0}
    for s in tmp.rglob("summary.json"):
        data = json.loads(s.read_text(encoding="utf-8"))
        s.write_text(json.dumps(dict(data, claims=[claim])), encoding="utf-8")
    assert main([str(tmp)]) == 0
    out = capsys.readouterr().out
    assert "before the runs" in out and "Quest (16, 0.05) ≈ full" in out and "-> worse" in out
    assert "post hoc" not in out


def test_a_claim_declared_after_its_run_is_marked_post_hoc_in_a_file_declared_before():
    """``post_hoc`` on one claim of a file whose claims were declared before the runs: that claim's test says
    "(post hoc)", the others do not, and the section's first line says such claims exist."""
    from sparse_eval.verdicts import evaluate as v

    data = v.read_verdicts(EXPERIMENTS / "ruler_qwen2_5_coder_1_5b")
    assert data["post_hoc"] is False
    marked = {r["name"]: v.test_text(r, data["post_hoc"]).endswith("(post hoc)") for r in data["claims"]}
    assert marked["TopK 0.06 ≈ full"] and not marked["MagicPIG (10, 150) ≈ full"]
    assert "those marked (post hoc) were declared after their runs" in v.folder_section(data)
    plain = dict(data, claims=[dict(r, post_hoc=None) for r in data["claims"]])
    assert "those marked (post hoc)" not in v.folder_section(plain)
