"""One seed per run: it reaches the method's draws and the run's identity, a stochastic method runs once per seed,
a deterministic one once, and collect pools exactly the runs that differ only in their seed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import cfg_for

from sparse_eval.methods import METHODS, attend, build_method, make_config
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config
from sparse_eval.launcher.runner import run

VOLATILE = {"time_s"}


def _records(run_dir):
    recs = [json.loads(line) for line in Path(run_dir, "samples.jsonl").read_text().splitlines()]
    return {r["id"]: {k: v for k, v in r.items() if k not in VOLATILE} for r in recs}


@pytest.mark.parametrize("method", ["oracle", "magicpig"])
def test_the_seed_reaches_the_method(tmp_path, method):
    """seed=0 and seed=1 give different records (and run directories, each recording its seed); the same seed
    again gives identical records."""
    over = (f"method={method}", "task.num_samples=1", "task.window=128")
    exp = Experiment(run_config(cfg_for(tmp_path / "a", *over, "seed=[0,1]")))
    configs = exp.method_configs()
    assert [c.seed for c in configs] == [0, 1]
    s0, s1 = (exp.run_method(c) for c in configs)
    assert s0["run_dir"] != s1["run_dir"] and (s0["seed"], s1["seed"]) == (0, 1) and s0["stochastic"]
    for s, seed in ((s0, 0), (s1, 1)):
        ident = exp.identity(next(c for c in configs if c.seed == seed))
        assert ident["seed"] == ident["method"]["seed"] == seed
    r0, r1 = _records(s0["run_dir"]), _records(s1["run_dir"])
    assert r0.keys() == r1.keys()
    for sid in r0:
        assert r0[sid]["est_error"] != r1[sid]["est_error"]
        assert r0[sid] != r1[sid]
    again = Experiment(run_config(cfg_for(tmp_path / "b", *over, "seed=0")))
    (c,) = again.method_configs()
    assert again.run_dir(c)[1].name == Path(s0["run_dir"]).name  # one identity per seed
    assert _records(again.run_method(c)["run_dir"]) == r0


def test_deterministic_method_runs_once_filed_under_seed_0(tmp_path):
    over = ("task.num_samples=1", "task.window=64")
    topk = Experiment(run_config(cfg_for(tmp_path, "method=topk", *over, "seed=[0,1,2]")))
    (c,) = topk.method_configs()
    assert c.seed == 0
    plain = Experiment(run_config(cfg_for(tmp_path, "method=topk", *over)))
    assert topk.run_dir(c)[1] == plain.run_dir(plain.method_configs()[0])[1]
    assert Experiment(run_config(cfg_for(tmp_path, "method=topk", *over, "seed=5"))).method_configs()[0].seed == 0
    oracle = Experiment(run_config(cfg_for(tmp_path, "method=oracle", *over, "seed=[0,1,2]")))
    dirs = {oracle.run_dir(c)[1] for c in oracle.method_configs()}
    assert len(dirs) == 3


@pytest.mark.parametrize(
    "args,needle",
    [
        (["method=oracle", "method.seed=1"], "method.seed=1"),
        (["method=oracle", "seed=[0,0]"], "seed=[0, 0]"),
        (["method=oracle", "seed=-1"], "seed=-1"),
        (["method=oracle", "seed=[]"], "seed=[]"),
    ],
)
def test_a_second_seed_knob_or_a_bad_seed_is_refused(tmp_path, args, needle):
    with pytest.raises(ValueError) as err:
        run(cfg_for(tmp_path, *args, "task.num_samples=1"))
    assert needle in str(err.value) and "seed=" in str(err.value)
    assert not list(Path(tmp_path).glob("wikitext/*/*"))  # nothing written


def _stochastic_probe(name: str) -> tuple[bool, bool]:
    """(declared stochastic, output changes with the seed) of a method on random tensors."""
    torch.manual_seed(0)
    hq, hkv, n, d = 4, 2, 200, 16
    q, k, v = torch.randn(1, hq, 1, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    opts = {"sink": 0, "local": 0}
    if name == "double_sparsity":
        opts.update(channel_type="random")
    if name in ("topk", "oracle"):
        opts.update(budget=0.05)
    outs = [attend(name, q, k, v, compute_error=False, seed=s, **opts)[0] for s in (0, 1)]
    return build_method(make_config(name, opts)).stochastic, not torch.equal(*outs)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_methods_declare_whether_they_are_stochastic(name):
    """``Method.stochastic`` is true exactly for the methods whose output depends on the seed."""
    declared, changes = _stochastic_probe(name)
    assert declared == changes, (name, declared, changes)
    if name == "double_sparsity":  # calibrated channels are fixed: deterministic
        assert not build_method(make_config(name, {"channel_type": "qk"})).stochastic


# -- collect pools exactly the runs that differ only in their seed -------------------------------------------

SUBTASKS = ["niah_single_1", "fwe"]
TASK = {"name": "ruler", "subtasks": SUBTASKS, "num_samples": 12, "length": 4096, "haystack": "noise", "seed": 42}


def _fake_run(
    root: Path, method: dict, seed: int, scores: dict[str, float], task=TASK, top_seed=None, expected=None, errors=()
):
    from sparse_eval.results.store import config_hash, run_dir_for

    identity = {
        "model": {"name": "m", "path": "p"},
        "method": dict(method, seed=seed),
        "inputs": {},
        "task": task,
        "eval": {"protocol": "A", "compute_error": True, "prefill_chunk": None},
        "seed": seed if top_seed is None else top_seed,
    }
    d = run_dir_for(root, identity)
    d.mkdir(parents=True)
    from omegaconf import OmegaConf

    (d / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(identity)))
    (d / "meta.json").write_text("{}")
    (d / "progress.json").write_text(json.dumps({"expected_samples": expected or len(scores) + len(errors)}))
    lines = [
        {"id": i, "status": "ok", "subtask": i.rsplit("-", 1)[0], "score": sc, "prediction": "x"}
        for i, sc in scores.items()
    ]
    lines += [{"id": i, "status": "error", "error": "boom"} for i in errors]
    (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (d / "summary.json").write_text(json.dumps({"expected_samples": expected or len(scores) + len(errors)}))
    assert config_hash(identity) in d.name
    return d


def _scores(rng, shift=0.0, ids=None):
    ids = ids or [f"{s}-{i:04d}" for s in SUBTASKS for i in range(6)]
    return {i: float(np.clip(rng.normal(60 + shift, 30), 0, 100)) for i in ids}


def test_collect_pools_exactly_the_runs_that_differ_only_in_seed(tmp_path, capsys):
    from sparse_eval.results.collect import collect
    from sparse_eval.metrics.statistics import seed_pooled_ci, seed_pooled_difference
    from sparse_eval.tasks import build_task

    rng = np.random.default_rng(0)
    mp = {"name": "magicpig", "K": 10, "L": 150, "sink": 4, "local": 64, "dense_layers": [0, 16]}
    full = {"name": "full", "sink": 4, "local": 64, "dense_layers": [0, 1]}
    ref = _scores(rng)
    _fake_run(tmp_path, full, 0, ref)
    pooled = {s: _scores(rng, -5) for s in (0, 1, 2)}
    for s, sc in pooled.items():
        _fake_run(tmp_path, mp, s, sc)
    _fake_run(tmp_path, dict(mp, L=120), 0, _scores(rng))  # another config: its own group, one seed
    _fake_run(tmp_path, mp, 3, _scores(rng), task=dict(TASK, seed=7))  # other prompts: not pooled
    # a run made before the seed reached the methods: top-level seed 1, but the method drew from seed 0
    _fake_run(tmp_path, dict(mp, L=75), 0, _scores(rng), top_seed=0)
    _fake_run(tmp_path, dict(mp, L=75), 0, _scores(rng), top_seed=1)

    df = collect(tmp_path)
    whole = df[df.subtask == "all"]
    main = whole[
        (whole.method == "magicpig") & (whole["method.L"] == 150) & (whole.task_config.str.contains('"seed": 42'))
    ]
    assert sorted(main.seed) == [0, 1, 2] and (main.seeds == 3).all() and (main.seed_values == "0,1,2").all()
    assert main.seed_group.nunique() == 1 and (main.interval_omits_seeds == False).all()  # noqa: E712
    task = build_task(TASK)
    terms = [
        task.score_terms(
            [{"id": i, "subtask": i.rsplit("-", 1)[0], "score": v, "prediction": "x"} for i, v in pooled[s].items()]
        )
        for s in (0, 1, 2)
    ]
    ref_terms = task.score_terms(
        [{"id": i, "subtask": i.rsplit("-", 1)[0], "score": v, "prediction": "x"} for i, v in ref.items()]
    )
    ci, d = seed_pooled_ci(terms), seed_pooled_difference(terms, ref_terms)
    row = main.iloc[0]
    assert row.pooled_score == pytest.approx(ci["score"]) and row.pooled_n == 12
    assert (row.pooled_lo, row.pooled_hi) == pytest.approx((ci["lo"], ci["hi"]))
    assert (row.pooled_diff, row.pooled_diff_lo, row.pooled_diff_hi) == pytest.approx((d["diff"], d["lo"], d["hi"]))
    per_seed = [t.score() for t in terms]
    assert row.seed_std == pytest.approx(np.std(per_seed, ddof=1)) and row.seed_min == pytest.approx(min(per_seed))
    # the per-seed rows keep their own one-level intervals
    assert main.score.nunique() == 3
    others = whole[(whole.method == "magicpig") & ~whole.index.isin(main.index)]
    single = others[others["method.L"] == 120]
    assert (single.seeds == 1).all() and (single.interval_omits_seeds == True).all()  # noqa: E712
    other_prompts = others[others.task_config.str.contains('"seed": 7')]
    assert (other_prompts.seeds == 1).all() and other_prompts.pooled_diff.isna().all()  # no full run on those prompts
    legacy = others[others["method.L"] == 75]
    assert len(legacy) == 2 and (legacy.seeds == 1).all()  # the same draws twice: one seed
    assert "repeats seed 0" in capsys.readouterr().err
    full_row = whole[whole.method == "full"].iloc[0]
    assert full_row.stochastic == False and full_row.interval_omits_seeds == False  # noqa: E712
    assert not math.isnan(row.pooled_lo)


def test_a_seed_still_running_is_left_out_while_others_are_complete(tmp_path):
    from sparse_eval.results.collect import collect
    from sparse_eval.report.load import normalize
    from sparse_eval.report.tables import score_intervals

    rng = np.random.default_rng(1)
    mp = {"name": "magicpig", "K": 10, "L": 150, "sink": 4, "local": 64, "dense_layers": [0, 16]}
    _fake_run(tmp_path, {"name": "full", "sink": 4, "local": 64, "dense_layers": [0, 1]}, 0, _scores(rng))
    seed0 = _scores(rng, -5)
    _fake_run(tmp_path, mp, 0, seed0)  # complete: 12 of 12
    ids = [f"{s}-{i:04d}" for s in SUBTASKS for i in range(6)]  # both subtasks begun in every partial run
    _fake_run(tmp_path, mp, 1, _scores(rng, 20, [ids[0], ids[6]]), expected=12)  # 2 of 12 so far
    _fake_run(tmp_path, dict(mp, L=120), 0, _scores(rng, 0, [ids[0], ids[1], ids[6]]), expected=12)  # none complete
    _fake_run(tmp_path, dict(mp, L=120), 1, _scores(rng, 0, ids[0:3] + ids[6:8]), expected=12)
    df = collect(tmp_path)
    whole = df[(df.subtask == "all") & (df.method == "magicpig")]
    l150 = whole[whole["method.L"] == 150].set_index("seed")
    assert (l150.seeds == 1).all() and (l150.seed_values == "0").all() and (l150.seeds_left_out == "1").all()
    assert (bool(l150.loc[0, "pooled"]), bool(l150.loc[1, "pooled"])) == (True, False)
    assert l150.loc[0, "pooled_n"] == 12 and l150.loc[0, "pooled_score"] == pytest.approx(l150.loc[0, "score"])
    assert l150.loc[0, "interval_omits_seeds"] == True  # noqa: E712 - one seed pooled
    # no seed complete: all pooled on the samples every seed has, marked incomplete in the report
    l120 = whole[whole["method.L"] == 120]
    assert (l120.seeds == 2).all() and l120.seeds_left_out.isna().all() and l120.pooled.all()
    assert (l120.pooled_n == 3).all()

    path = tmp_path / "results.csv"
    df.to_csv(path, index=False)
    import pandas as pd

    table = score_intervals(normalize(pd.read_csv(path)))  # through a CSV, as report reads it
    rows = {r["Config"]: r for r in table.rows if r["Method"] == "MagicPIG"}
    assert rows["(10,150)"]["n"] == 12 and rows["(10,150)"]["Seeds"] == "1 † (+ seed 1 incomplete)"
    assert rows["(10,150)"]["Score"] == pytest.approx(l150.loc[0, "score"])
    assert [c for c in rows if c.startswith("(10,120)")] == ["(10,120) (incomplete: 8/24)"]


def test_contrast_pairs_two_configurations_each_pooled_over_its_seeds(tmp_path, capsys):
    """``python -m sparse_eval.results.contrast``: A (3 seeds) against B (3 seeds) is seed_pooled_contrast over their
    runs in seed order; against full attention it is collect's pooled difference; a pattern of two configurations, a
    pattern that matches nothing and two tasks are refused by name; an incomplete run takes away the claim."""
    from sparse_eval.results.collect import collect
    from sparse_eval.results.contrast import contrast, main
    from sparse_eval.metrics.statistics import seed_pooled_contrast
    from sparse_eval.tasks import build_task

    rng = np.random.default_rng(3)
    mp = {"name": "magicpig", "K": 10, "L": 150, "sink": 4, "local": 64, "dense_layers": [0, 16]}
    _fake_run(tmp_path, {"name": "full", "sink": 4, "local": 64, "dense_layers": [0, 1]}, 0, _scores(rng))
    a = {s: _scores(rng, -2) for s in (2, 0, 1)}
    b = {s: _scores(rng, -6) for s in (1, 2, 0)}
    for s, sc in a.items():
        _fake_run(tmp_path, dict(mp, K=9, L=120), s, sc)
    for s, sc in b.items():
        _fake_run(tmp_path, mp, s, sc)
    task = build_task(TASK)

    def terms(scores):
        return task.score_terms(
            [{"id": i, "subtask": i.rsplit("-", 1)[0], "score": v, "prediction": "x"} for i, v in scores.items()]
        )

    c = contrast(tmp_path, "magicpig-K=9-*", "magicpig-K=10-*")
    want = seed_pooled_contrast([terms(a[s]) for s in (0, 1, 2)], [terms(b[s]) for s in (0, 1, 2)])
    assert (c["diff"], c["lo"], c["hi"], c["n"]) == pytest.approx((want["diff"], want["lo"], want["hi"], want["n"]))
    assert c["a_seeds"] == [0, 1, 2] and c["b_seeds"] == [0, 1, 2] and c["incomplete"] == []
    df = collect(tmp_path)
    row = df[(df.subtask == "all") & (df.method == "magicpig") & (df["method.K"] == 9)].iloc[0]
    vs_full = contrast(tmp_path, "magicpig-K=9-*", "full-*")
    assert (vs_full["diff"], vs_full["lo"], vs_full["hi"]) == pytest.approx(
        (row.pooled_diff, row.pooled_diff_lo, row.pooled_diff_hi)
    )
    assert main([str(tmp_path), "--a", "magicpig-K=9-*", "--b", "magicpig-K=10-*"]) == 0
    assert "A − B = " in capsys.readouterr().out
    for pattern, needle in (("magicpig-*", "matches runs of 2 configurations"), ("quest-*", "matches no run")):
        with pytest.raises(SystemExit, match=needle):
            contrast(tmp_path, pattern, "full-*")
    _fake_run(tmp_path, dict(mp, K=8, L=75), 0, _scores(rng), task=dict(TASK, seed=7))
    with pytest.raises(SystemExit, match="differ in task_config"):
        contrast(tmp_path, "magicpig-K=8-*", "full-*")
    _fake_run(tmp_path, dict(mp, K=7, L=40), 0, _scores(rng), expected=30)  # 24 of 30 samples: incomplete
    partial = contrast(tmp_path, "magicpig-K=7-*", "full-*")
    assert partial["significant"] is None and len(partial["incomplete"]) == 1


def test_contrast_of_one_configuration_in_two_runs_folders_counts_the_same_predictions(tmp_path, capsys):
    """``--b-dir``: the same configuration run on two paths (e.g. the fused and the unfused kernels), one runs folder
    each: the paired difference of their scores and, per seed, how many samples got the same prediction."""
    from sparse_eval.results.contrast import contrast, main

    rng = np.random.default_rng(4)
    mp = {"name": "magicpig", "K": 10, "L": 150, "sink": 4, "local": 64, "dense_layers": [0, 16]}
    scores = {s: _scores(rng) for s in (0, 1)}
    for s in (0, 1):
        _fake_run(tmp_path / "a", mp, s, scores[s])
        d = _fake_run(tmp_path / "b", mp, s, scores[s])
        if s == 1:  # three of seed 1's predictions differ on path B
            lines = [json.loads(x) for x in (d / "samples.jsonl").read_text().splitlines()]
            for r in lines[:3]:
                r["prediction"] = "y"
            (d / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    n = len(scores[0])
    c = contrast(tmp_path / "a", "magicpig-*", "magicpig-*", tmp_path / "b")
    assert c["diff"] == 0 and c["same_predictions"] == [
        {"seed": 0, "same": n, "n": n},
        {"seed": 1, "same": n - 3, "n": n},
    ]
    assert main([str(tmp_path / "a"), "--a", "magicpig-*", "--b", "magicpig-*", "--b-dir", str(tmp_path / "b")]) == 0
    assert f"same prediction, seed 1: {n - 3} of {n} samples" in capsys.readouterr().out
    assert main([str(tmp_path / "a"), "--a", "m*", "--b", "m*", "--b-dir", str(tmp_path / "nowhere")]) == 2
