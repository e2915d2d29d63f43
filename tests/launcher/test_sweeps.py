"""Sweeps: the experiment configs compose into valid jobs, smoke sweeps run, a failing job is recorded without
stopping the sweep, an interrupted sweep resumes without recomputing or duplicating a sample, and the results
gather into one table (``sparse_eval.results.collect``) and one status view (``sparse_eval.results.status``)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CONF = REPO / "conf"
SHARED_DATA = REPO.parent / "shared" / "data"
EXPERIMENTS = sorted(
    p.relative_to(CONF / "experiment").with_suffix("").as_posix() for p in (CONF / "experiment").rglob("*.yaml")
)
PAPER = [e for e in EXPERIMENTS if not e.startswith("smoke/")]
SMOKE = [e for e in EXPERIMENTS if e.startswith("smoke/")]
# smoke sweeps cheap enough to run every job of in the default test run (the others: their first job, marked
# slow; every job with SPARSE_EVAL_SMOKE_ALL=1)
FAST_SMOKE = ["smoke/ds_ppl", "smoke/ds_kv_retrieval", "smoke/quest_budgets"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def compose():
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from sparse_eval.config import register_configs

    register_configs()
    GlobalHydra.instance().clear()  # in case another test left one initialized
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        yield hydra_compose


def _data_dir() -> str | None:
    return os.environ.get("SPARSE_EVAL_DATA_DIR") or (str(SHARED_DATA) if SHARED_DATA.exists() else None)


def _jobs(compose, name: str, extra: list[str] = ()) -> list[list[str]]:
    from sparse_eval.launcher.sweep import sweep_jobs

    base = [f"+experiment={name}", *extra]
    cfg = compose(config_name="config", overrides=base, return_hydra_config=True)
    return sweep_jobs(cfg.hydra.sweeper.params, base)


def _covering(jobs: list[list[str]]) -> list[list[str]]:
    """A few jobs that together use every value of every swept key (greedy)."""
    seen: set[str] = set()
    out = []
    for job in jobs:
        if not set(job) <= seen:
            out.append(job)
            seen |= set(job)
    return out


# -- the configs -------------------------------------------------------------------------------------------------


def test_every_paper_experiment_has_a_smoke_variant_and_a_reference():
    assert PAPER, "no experiment configs"
    assert sorted(s[len("smoke/") :] for s in SMOKE) == PAPER
    for name in EXPERIMENTS:
        text = (CONF / "experiment" / f"{name}.yaml").read_text()
        assert text.startswith("# @package _global_"), name
        if name in PAPER:  # says what it reproduces
            assert re.search(r"\b(Table|Fig\.)\s*\d", text), name


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_jobs_compose_and_validate(compose, name):
    from sparse_eval.config import to_plain
    from sparse_eval.methods import build_method, make_config
    from sparse_eval.methods.base import resolve_dense_layers
    from sparse_eval.tasks import build_task

    jobs = _jobs(compose, name)
    header = (CONF / "experiment" / f"{name}.yaml").read_text()
    stated = re.search(r"(\d+) jobs", header)
    if stated:  # the comment's job count is the sweep's
        assert len(jobs) == int(stated.group(1)), (name, len(jobs))
    assert len({tuple(sorted(j)) for j in jobs}) == len(jobs)
    for job in _covering(jobs):
        cfg = compose(config_name="config", overrides=job)
        method = to_plain(cfg.method)
        build_method(make_config(method["name"], method))  # every value valid, by the method's own checks
        try:
            build_task(to_plain(cfg.task), data_dir=_data_dir())
        except FileNotFoundError:
            if _data_dir() is not None:
                raise  # with the data folder present every task must build
        if name.startswith("smoke/"):
            assert cfg.model.name == "stories260k"
            assert resolve_dense_layers(method["dense_layers"], 5), job
            continue
        assert cfg.eval.protocol == ("S" if name == "ds_ppl" else "A")
        if method["name"] == "magicpig":  # the paper's static keys and dense layers (§5.1)
            assert (method["sink"], resolve_dense_layers(method["dense_layers"], 32)) == (4, [0, 16])
            assert method["local"] == (24 if name == "lmeval_magicpig" else 64)
    # any model= override replaces the experiment's model
    cfg = compose(config_name="config", overrides=[*jobs[0], "model=smollm2_135m"])
    assert cfg.model.name == "smollm2_135m"


def test_sweep_over_methods_uses_variant_files(compose):
    """ruler_magicpig: one method axis over named configs, each with the paper's (K, L) / (page, ratio)."""
    from sparse_eval.config import to_plain

    jobs = _jobs(compose, "ruler_magicpig")
    seen = {}
    for job in jobs:
        if "task.length=16384" in job:
            m = to_plain(compose(config_name="config", overrides=job).method)
            seen[m["name"], m.get("K"), m.get("L"), m.get("page_size"), m.get("budget")] = m
    assert set(seen) == {
        ("full", None, None, None, None),
        ("magicpig", 10, 150, None, None),
        ("magicpig", 9, 120, None, None),
        ("magicpig", 8, 75, None, None),
        ("quest", None, None, 16, 0.04),
        ("quest", None, None, 32, 0.06),
        ("quest", None, None, 64, 0.08),
    }
    # the command line wins over the experiment's sweep of the same key
    assert {j for job in _jobs(compose, "ruler_magicpig", ["task.length=4096"]) for j in job if "length" in j} == {
        "task.length=4096"
    }


def test_launcher_presets_compose(compose):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="hydra-submitit-launcher not installed")
    cfg = compose(
        config_name="config",
        overrides=["hydra/launcher=slurm", "hydra.launcher.partition=gpu"],
        return_hydra_config=True,
    )
    launcher = cfg.hydra.launcher
    assert launcher._target_.startswith("hydra_plugins.")
    assert launcher.max_num_timeout > 0 and launcher.partition == "gpu" and launcher.gpus_per_node == 1
    try:
        import hydra_plugins.hydra_joblib_launcher  # noqa: F401
    except ImportError:
        return
    cfg = compose(config_name="config", overrides=["hydra/launcher=local_gpus"], return_hydra_config=True)
    assert cfg.hydra.launcher.n_jobs >= 1


# -- smoke sweeps, in process ------------------------------------------------------------------------------------


def _run_jobs(compose, name: str, runs_dir: Path, first_only: bool = False) -> list[dict]:
    from sparse_eval.launcher.runner import run

    data = _data_dir()
    extra = [f"paths.runs_dir={runs_dir}", "print_table=false"] + ([f"paths.data_dir={data}"] if data else [])
    jobs = _jobs(compose, name, extra)
    summaries = []
    for job in jobs[:1] if first_only else jobs:
        summaries += run(compose(config_name="config", overrides=job))
    return summaries


def _check_collected(runs_dir: Path, summaries: list[dict]) -> None:
    from sparse_eval.results.collect import collect

    df = collect(runs_dir)
    for s in summaries:
        rows = df[df.run_dir == s["run_dir"]]
        assert len(rows) >= 1 and (rows.state == "done").all()
        top = rows[rows.subtask.isin(["all"])] if (rows.subtask == "all").any() else rows
        if len(top) == 1 and s["score"] is not None:  # the table's score is the task's own aggregate
            assert top.score.iloc[0] == pytest.approx(s["score"], rel=1e-9)
        assert rows.samples.max() <= s["samples"]


@pytest.mark.parametrize("name", FAST_SMOKE)
def test_smoke_sweep_runs(compose, tmp_path, name):
    if name == "smoke/quest_budgets" and _data_dir() is None:
        pytest.skip("needs the shared data folder (LongBench TriviaQA)")
    summaries = _run_jobs(compose, name, tmp_path)
    assert summaries and all(s["samples"] >= 1 and s["failed"] == 0 for s in summaries)
    _check_collected(tmp_path, summaries)


@pytest.mark.slow
@pytest.mark.parametrize("name", [s for s in SMOKE if s not in FAST_SMOKE])
def test_smoke_sweep_first_job_runs(compose, tmp_path, name):
    if "lmeval" in name:
        pytest.importorskip("lm_eval")
    if ("longbench" in name or "lmeval" in name) and _data_dir() is None:
        pytest.skip("needs the shared data folder")
    # every job of these takes ~2 min in all on 2 cores: the first job here, all with SPARSE_EVAL_SMOKE_ALL=1
    summaries = _run_jobs(compose, name, tmp_path, first_only=not os.environ.get("SPARSE_EVAL_SMOKE_ALL"))
    assert summaries and all(s["samples"] >= 1 for s in summaries)
    _check_collected(tmp_path, summaries)


# -- a real multirun: a failing job, a killed sweep, the relaunch -------------------------------------------------


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_multirun_records_failures_and_resumes_after_kill(tmp_path):
    runs, sweep = tmp_path / "runs", tmp_path / "sweep"
    cmd = [
        sys.executable,
        "-m",
        "sparse_eval",
        "-m",
        "method=topk,oracle",
        f"model.path={tmp_path / 'no_such_model'},builtin:stories260K",
        "task.window=64",
        "task.num_samples=8",
        f"paths.runs_dir={runs}",
        f"hydra.sweep.dir={sweep}",
        "print_table=false",
        "preflight=false",
    ]  # launch the jobs with a missing model anyway: their failure is what is recorded here
    # 1st launch: jobs (topk, bad), (topk, ok), (oracle, bad), (oracle, ok); killed inside the last one
    proc = subprocess.Popen(
        cmd, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True
    )
    deadline = time.time() + 300
    target = None
    while time.time() < deadline and proc.poll() is None:
        found = [p for p in runs.glob("wikitext/stories260k/oracle-*/samples.jsonl") if _lines(p)]
        if found:
            target = found[0]
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait(timeout=60)
    assert target is not None, f"the oracle run never started: {proc.stderr.read().decode()[-3000:]}"
    before = _lines(target)
    assert 1 <= len(before) < 8, "the run finished before it could be interrupted"
    topk_runs = [p for p in runs.glob("wikitext/stories260k/topk-*/samples.jsonl") if _lines(p)]
    assert len(topk_runs) == 1
    topk_before = topk_runs[0].read_bytes()

    from sparse_eval.results.status import run_state
    from sparse_eval.results.store import find_run_dirs

    states = {
        d.name.split("-")[0] + ("-bad" if (d / "failed.json").exists() else ""): run_state(d, recent_s=0)["state"]
        for d in find_run_dirs(runs)
    }
    # the jobs with a missing model never started: they left no run dir (their error is in job_status.json)
    assert states == {"topk": "done", "oracle": "pending"}
    err = subprocess.run(
        [sys.executable, "-m", "sparse_eval.results.status", str(runs)],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    # killed a moment ago on this host: pending at once, not "running" for --recent seconds
    assert err.returncode == 0 and "1 done, 0 incomplete, 0 running, 0 failed, 1 pending" in err.stdout, err.stdout

    # 2nd launch, same command: finishes the oracle run from its first missing sample; the failures stay failures
    done = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=600)
    assert done.returncode == 1, done.stderr[-3000:]  # a sweep with failed jobs exits with 1
    assert "sweep: 4 jobs, 2 ok, 2 failed" in done.stdout + done.stderr
    report = json.loads((sweep / "sweep_status.json").read_text())
    assert (report["jobs"], report["ok"], report["failed"], report["missing"]) == (4, 2, 2, 0)
    assert all("no_such_model" in f["error"] for f in report["failures"])
    after = _lines(target)
    assert after[: len(before)] == before  # nothing recomputed
    ids = [json.loads(line)["id"] for line in after]
    assert len(ids) == len(set(ids)) == 8  # nothing duplicated, nothing missing
    assert json.loads((target.parent / "progress.json").read_text())["done_at_start"] == len(before)
    assert topk_runs[0].read_bytes() == topk_before  # the finished run was skipped
    for job in sweep.glob("*/job_status.json"):
        rec = json.loads(job.read_text())
        assert rec["status"] == ("failed" if any("no_such_model" in o for o in rec["overrides"]) else "ok")
    assert not [d for d in find_run_dirs(runs) if (d / "failed.json").exists()]

    # one table: one row per run, the task's own score
    out = subprocess.run(
        [sys.executable, "-m", "sparse_eval.results.collect", str(runs), "--quiet"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    import pandas as pd

    df = pd.read_csv(runs / "results.csv")
    assert sorted(df.state) == ["done", "done"]
    for _, row in df[df.state == "done"].iterrows():
        summary = json.loads((Path(row.run_dir) / "summary.json").read_text())
        assert row.score == pytest.approx(summary["score"], rel=1e-9)
        assert row.samples == row.expected_samples == 8 and row.complete
        assert row.metric == "ppl" and row.protocol == "S" and isinstance(row.git_commit, str)
    if (runs / "results.parquet").exists():
        assert len(pd.read_parquet(runs / "results.parquet")) == len(df)


# -- pieces ------------------------------------------------------------------------------------------------------


def test_run_lock_serializes_two_writers(tmp_path):
    from sparse_eval.results.store import lock_held, run_lock

    order = []
    with run_lock(tmp_path):
        assert lock_held(tmp_path)

        def second():
            with run_lock(tmp_path):
                order.append("second")

        t = threading.Thread(target=second)
        t.start()
        time.sleep(1.5)
        order.append("first done")
    t.join(timeout=10)
    assert order == ["first done", "second"]
    assert not lock_held(tmp_path)


def test_status_states(tmp_path):
    from sparse_eval.results.status import run_state
    from sparse_eval.results.store import find_run_dirs

    def make(name, records, expected, summary=False, failed=False, age=1000.0):
        d = tmp_path / "ruler" / "m" / name
        d.mkdir(parents=True)
        (d / "config.yaml").write_text("method: {name: full}\ntask: {name: ruler}\n")
        (d / "meta.json").write_text("{}")
        (d / "progress.json").write_text(json.dumps({"expected_samples": expected}))
        (d / "samples.jsonl").write_text(
            "".join(json.dumps({"id": f"s{i}", "status": s}) + "\n" for i, s in enumerate(records)) + '{"id": "torn'
        )
        if summary:
            (d / "summary.json").write_text("{}")
        if failed:
            (d / "failed.json").write_text(json.dumps({"error": "ValueError: bad"}))
        t = time.time() - age
        for f in d.iterdir():
            os.utime(f, (t, t))
        return d

    make("done-1", ["ok", "ok"], 2, summary=True)
    make("incomplete-5", ["ok", "error"], 2, summary=True)  # a failed sample: never done
    make("pending-2", ["ok"], 3)
    make("running-3", ["ok"], 3, age=5)
    make("failed-4", ["ok"], 3, failed=True)
    states = {d.name.split("-")[0]: run_state(d, recent_s=60) for d in find_run_dirs(tmp_path)}
    assert {k: v["state"] for k, v in states.items()} == {
        "done": "done",
        "incomplete": "incomplete",
        "pending": "pending",
        "running": "running",
        "failed": "failed",
    }
    assert (states["incomplete"]["written"], states["incomplete"]["errors"], states["incomplete"]["expected"]) == (
        2,
        1,
        2,
    )
    assert states["done"]["complete"] and not states["incomplete"]["complete"]
    assert states["failed"]["error"] == "ValueError: bad"


def test_gpu_claims_are_distinct_per_process(tmp_path):
    """Two job processes on a 3-GPU machine (faked by CUDA_VISIBLE_DEVICES) take different GPUs; a claim lasts
    as long as its process; nothing is claimed when there is at most one GPU."""
    code = (
        "import sys, time; from sparse_eval.launcher.sweep import claim_gpus; "
        f"print(claim_gpus(1, lock_dir={str(tmp_path)!r}, poll_s=0.1), flush=True); time.sleep(float(sys.argv[1]))"
    )
    env = _env(CUDA_VISIBLE_DEVICES="0,1,2")
    first = subprocess.Popen([sys.executable, "-c", code, "6"], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
    got1 = first.stdout.readline().strip()
    second = subprocess.run(
        [sys.executable, "-c", code, "0"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    first.kill()
    first.wait()
    assert got1 == "['0']" and second.stdout.strip() == "['1']", (got1, second.stdout, second.stderr)
    one = subprocess.run(
        [sys.executable, "-c", code, "0"],
        cwd=REPO,
        env=_env(CUDA_VISIBLE_DEVICES="3"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert one.stdout.strip() == "None"


def test_a_vanished_slurm_job_fails_instead_of_hanging(tmp_path, monkeypatch):
    from sparse_eval.launcher import sweep

    class Paths:
        result_pickle = tmp_path / "never.pkl"
        stderr = tmp_path / "log.err"

    class SlurmJob:  # what the launcher sees of a submitit job that died without a result
        job_id = "7_3"
        paths = Paths()

    monkeypatch.setattr(sweep, "_queue_state", lambda job_id: None)
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="left the queue without a result"):
        sweep.wait_for_result(SlurmJob(), poll_s=0.05, grace_s=0.3)
    assert time.monotonic() - t0 < 10


def _fake_slurm(tmp_path, monkeypatch, squeue_out: str, record: str) -> None:
    """``squeue`` and ``scontrol`` on PATH that print the given lines (a controller's view of one job)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in (("squeue", squeue_out), ("scontrol", record)):
        exe = bin_dir / name
        exe.write_text(f"#!/bin/sh\nprintf '%s' '{text}'\n")
        exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


def test_a_job_squeue_does_not_list_is_alive_while_its_record_says_so(tmp_path, monkeypatch):
    """A requeued job that squeue does not list (seen on a loaded machine) counts as alive while the controller's
    record gives a state in which it may still run; a final state counts as gone and is named in the error."""
    from sparse_eval.launcher import sweep

    _fake_slurm(tmp_path, monkeypatch, "RUNNING\n", "JobId=4 ArrayJobId=1 ArrayTaskId=2 JobState=RUNNING")
    assert sweep._queue_state("1_2") == "RUNNING"
    _fake_slurm(
        tmp_path, monkeypatch, "", "JobId=4 ArrayJobId=1 ArrayTaskId=2 JobState=PENDING Reason=BeginTime Restarts=1"
    )
    assert sweep._queue_state("1_2") == "PENDING"
    _fake_slurm(
        tmp_path,
        monkeypatch,
        "",
        "JobId=4 JobState=OUT_OF_MEMORY Reason=OutOfMemory ExitCode=0:125 Restarts=1 RunTime=00:00:07",
    )
    assert sweep._queue_state("1_2") is None

    class Paths:
        result_pickle = tmp_path / "never.pkl"
        stderr = tmp_path / "log.err"

    class SlurmJob:
        job_id = "1_2"
        paths = Paths()

    with pytest.raises(
        RuntimeError,
        match="Slurm: JobState=OUT_OF_MEMORY, Reason=OutOfMemory, ExitCode=0:125, Restarts=1, RunTime=00:00:07",
    ):
        sweep.wait_for_result(SlurmJob(), poll_s=0.05, grace_s=0.3)
    _fake_slurm(tmp_path, monkeypatch, "", "")  # the controller has forgotten it
    assert sweep._queue_state("1_2") is None and sweep.job_record("1_2") == {}
