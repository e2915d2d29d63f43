"""The Hydra app and runner end to end: default command, resume after a kill, failures, config errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import jsonl_records
from helpers import cfg_for
from sparse_eval.config import register_configs
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config
from sparse_eval.launcher.runner import run

REPO = Path(__file__).resolve().parents[2]
register_configs()


def read_samples(run_dir):
    """The run's records in file order; a line that is not a record fails with an assertion (``jsonl_records``)."""
    return jsonl_records(Path(run_dir, "samples.jsonl"))


def run_cli(*args, cwd=REPO, timeout=300):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled")
    return subprocess.run(
        [sys.executable, "-m", "sparse_eval", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_default_command_end_to_end(tmp_path):
    """`python -m sparse_eval` with no arguments (only the output folder redirected) prints the comparison of every
    registered method (``compare_names``: no list to keep in step with the registry)."""
    from sparse_eval.methods import compare_names, is_dense

    names = compare_names()
    env_runs = dict(SPARSE_EVAL_RUNS_DIR=str(tmp_path))
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        **env_runs,
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("SPARSE_EVAL_DATA_DIR", None)  # the default run needs nothing outside the package
    res = subprocess.run(
        [sys.executable, "-m", "sparse_eval"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["method", "config"])
    table = {line.split()[0]: line for line in lines[header + 1 : header + 1 + len(names)]}
    assert list(table) == names and {"full", "topk", "oracle", "magicpig", "quest", "double_sparsity"} <= set(names)
    for col in ("ppl", "Cost1", "Cost2", "est_error"):
        assert col in lines[header]
    summaries = list(Path(tmp_path, "wikitext", "stories260k").glob("*/summary.json"))
    assert len(summaries) == len(names)
    for p in summaries:
        s = json.loads(p.read_text())
        assert s["failed"] == 0 and s["samples"] == 4 and s["protocol"] == "S"
        assert s["score"] is not None and s["score"] > 1
        if is_dense(s["method"]):
            assert s["cost2"] == 1 and s["est_error"] == 0
        else:
            assert 0 < s["cost2"] < 1 and s["est_error"] > 0


def test_single_method_run_writes_the_store(tmp_path):
    cfg = cfg_for(tmp_path, "method=topk", "task.num_samples=2", "task.window=128")
    (summary,) = run(cfg)
    run_dir = Path(summary["run_dir"])
    assert run_dir.parent == Path(tmp_path, "wikitext", "stories260k")
    assert run_dir.name.startswith("topk-budget=0.06-")
    for f in ("config.yaml", "meta.json", "samples.jsonl", "summary.json", "summary.csv"):
        assert (run_dir / f).exists(), f
    meta = json.loads((run_dir / "meta.json").read_text())
    assert "torch" in meta["versions"] and "cpu_count" in meta["hardware"] and "commit" in meta["git"]
    recs = read_samples(run_dir)
    assert sorted(r["id"] for r in recs) == ["w00000", "w00001"]  # in the stratified order (sparse_eval.run.ordering)
    assert all(r["status"] == "ok" and 0 < r["cost2"] < 1 and r["cost1"] == 0.5 for r in recs)
    assert summary["protocol"] == "S" and summary["dense_layers"] == [0, 1] and summary["sink"] == 4


def test_resume_after_interrupted_run(tmp_path, monkeypatch):
    over = ("method=oracle", "task.num_samples=4", "task.window=128")
    full = run(cfg_for(tmp_path / "a", *over))[0]

    exp = Experiment(run_config(cfg_for(tmp_path / "b", *over)))
    orig = exp.task.run
    calls = []

    def dying(sample, engine):
        if len(calls) == 2:
            raise KeyboardInterrupt  # a kill between samples
        calls.append(sample.id)
        return orig(sample, engine)

    monkeypatch.setattr(exp.task, "run", dying)
    with pytest.raises(KeyboardInterrupt):
        exp.run_method(exp.method_configs()[0])
    run_dir = Path(full["run_dir"].replace(str(tmp_path / "a"), str(tmp_path / "b")))
    assert len(read_samples(run_dir)) == 2
    # a kill in the middle of a write leaves a torn last line: it is dropped, not fatal
    with open(run_dir / "samples.jsonl", "a") as f:
        f.write('{"id": "w00002", "sta')

    exp2 = Experiment(run_config(cfg_for(tmp_path / "b", *over)))
    seen = []
    orig2 = exp2.task.run
    monkeypatch.setattr(exp2.task, "run", lambda s, e: seen.append(s.id) or orig2(s, e))
    resumed = exp2.run_method(exp2.method_configs()[0])
    assert sorted(seen) == sorted({"w00000", "w00001", "w00002", "w00003"} - set(calls))  # nothing recomputed
    recs = read_samples(run_dir)
    assert sorted(r["id"] for r in recs) == ["w00000", "w00001", "w00002", "w00003"]  # no duplicates
    assert resumed["score"] == pytest.approx(full["score"], rel=1e-6)  # same result as the uninterrupted run
    # the restart that added samples is on record beside the first start, with the count it found
    meta = json.loads((run_dir / "meta.json").read_text())
    assert [r["done_at_start"] for r in meta["resumes"]] == [2]
    assert {"git", "versions", "hardware", "argv", "started"} <= set(meta["resumes"][0])
    # each segment's counts at start and end: the interrupted first start stopped at 2, the restart at all 4
    assert (meta["done_at_start"], meta["done_at_end"], meta["resumes"][0]["done_at_end"]) == (0, 2, 4)
    from sparse_eval.results.collect import run_rows

    row = run_rows(run_dir, by_subtask=False)[0]
    assert (row["segments"], row["mixed_provenance"]) == (2, False)
    assert run(cfg_for(tmp_path / "b", *over))[0]["samples"] == 4  # a finished run is skipped
    assert len(json.loads((run_dir / "meta.json").read_text())["resumes"]) == 1  # and adds no segment


def test_failing_sample_is_recorded_and_run_goes_on(tmp_path, monkeypatch):
    exp = Experiment(run_config(cfg_for(tmp_path, "method=full", "task.num_samples=3", "task.window=64")))
    orig = exp.task.run

    def flaky(sample, engine):
        if sample.id == "w00001":
            raise RuntimeError("boom")
        return orig(sample, engine)

    monkeypatch.setattr(exp.task, "run", flaky)
    s = exp.run_method(exp.method_configs()[0])
    assert s["samples"] == 2 and s["failed"] == 1
    recs = {r["id"]: r for r in read_samples(s["run_dir"])}
    assert recs["w00001"]["status"] == "error" and "boom" in recs["w00001"]["error"]
    assert all(v is None or v == v for r in recs.values() for v in r.values() if isinstance(v, float))


@pytest.mark.parametrize(
    "args,needle",
    [
        (["method=nope"], "Could not find 'method/nope'"),
        (["method=topk", "method.bogus=1"], "bogus"),
        (["method=topk", "method.budget=0"], "method.budget=0"),
        (["method=topk", "method.budget=1.5"], "method.budget=1.5"),
        (["method=topk", "method.dense_layers=[0,9]"], "dense_layers"),
        (["task=nope"], "Could not find 'task/nope'"),
        (["method=full", "eval.protocol=Z"], "eval.protocol='Z'"),
        (["method=full", "model.path=/nonexistent/model"], "/nonexistent/model does not exist"),
        (["method=full", "model=smollm2_135m", "paths.models_dir=/nonexistent"], "scripts/get_smollm2.sh"),
    ],
)
def test_config_errors_fail_at_start_with_a_clear_message(tmp_path, args, needle):
    """In process (composition and ``run``); the command line's one-line form and exit status are checked in
    tests/project/test_user_path.py."""
    with pytest.raises(Exception) as err:
        run(cfg_for(tmp_path, *args, "task.num_samples=1"))
    text = f"{err.value} {err.value.__cause__ or ''}"
    assert needle in text, text[-2000:]
    assert not list(Path(tmp_path).glob("wikitext/*/*/samples.jsonl"))  # nothing ran


def test_wandb_offline_logger(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)  # the config's mode (offline) decides
    (summary,) = run(cfg_for(tmp_path, "method=topk", "logger=wandb", "task.num_samples=1", "task.window=96"))
    assert list(Path(summary["run_dir"]).glob("wandb/offline-run-*/run-*.wandb"))
