"""Parallel jobs through Hydra's launchers (``hydra/launcher=local_gpus``: joblib): the records equal the basic
launcher's, job processes share GPUs in slots, and the launcher's deadline stops a sweep as Ctrl-C stops a run
(finished samples kept) so that the same command resumes it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytest.importorskip("hydra_plugins.hydra_joblib_launcher", reason="hydra-joblib-launcher not installed")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("WANDB_MODE", "disabled")
    env.update(extra)
    return env


def _sweep(args: list[str], runs: Path, sweep: Path, timeout: float = 600) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "sparse_eval", "-m", *args, f"paths.runs_dir={runs}", f"hydra.sweep.dir={sweep}"]
    cmd += ["print_table=false"]
    return subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout)


def _compare(a: Path, b: Path) -> tuple[list[str], int, int]:
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from compare_records import compare
    finally:
        sys.path.remove(str(REPO / "scripts"))
    return compare(a, b)


# -- joblib runs what the basic launcher runs ---------------------------------------------------------------------


def test_joblib_multirun_matches_the_basic_launcher(tmp_path):
    """Four jobs, two at a time: two methods x two seeds (full attention is deterministic: its two jobs share one
    run directory, the second waits on its lock and finds it done), the records identical to one-after-another."""
    jobs = ["method=full,oracle", "seed=0,1", "task.window=64", "task.num_samples=4"]
    basic = _sweep(jobs, tmp_path / "basic", tmp_path / "sweep_basic")
    assert basic.returncode == 0, basic.stderr[-3000:]
    par = _sweep(["hydra/launcher=local_gpus", "hydra.launcher.n_jobs=2", *jobs], tmp_path / "jl", tmp_path / "sw_jl")
    assert par.returncode == 0, par.stderr[-3000:]
    assert "Joblib.Parallel(n_jobs=2" in par.stdout + par.stderr
    report = json.loads((tmp_path / "sw_jl" / "sweep_status.json").read_text())
    assert (report["jobs"], report["ok"], report["failed"], report["stopped"]) == (4, 4, 0, 0)
    pids = {json.loads(p.read_text())["pid"] for p in (tmp_path / "sw_jl").glob("*/job_status.json")}
    assert os.getpid() not in pids and len(pids) >= 2  # the jobs ran in joblib's worker processes
    diffs, runs, samples = _compare(tmp_path / "basic", tmp_path / "jl")
    assert diffs == [] and runs == 3 and samples == 12, diffs


# -- the deadline -------------------------------------------------------------------------------------------------


def _samples(runs: Path) -> dict[str, list[str]]:
    return {
        p.parent.name: p.read_text().splitlines()
        for p in runs.glob("wikitext/stories260k/*/samples.jsonl")
        if p.read_text().strip()
    }


@pytest.mark.slow  # 1.5-4 min on 2 CPU cores; the deadline's pieces are checked fast below
def test_deadline_stops_the_sweep_and_the_same_command_resumes_it(tmp_path):
    """``hydra.launcher.deadline_s``: the running job stops (exit status 124) with its finished samples kept, the
    job not started is skipped, and the command launched again resumes the run at its first missing sample.  The
    run (oracle sampling, 60 windows of 256 tokens) takes minutes on 2 CPU cores; the deadline doubles from 30 s
    until a launch reached the samples (a loaded machine starts a job process slowly), and the test stops once a
    run was stopped part-way in two launches, the second further on than the first."""
    runs, sweep = tmp_path / "runs", tmp_path / "sweep"
    n = 60
    args = ["hydra/launcher=local_gpus", "hydra.launcher.n_jobs=1", "method=oracle,full", "task.window=256"]
    args.append(f"task.num_samples={n}")
    before: dict[str, list[str]] = {}
    resumed, deadline = False, 30
    for launch in range(5):
        res = _sweep([*args, f"hydra.launcher.deadline_s={deadline}"], runs, sweep)
        out = res.stdout + res.stderr
        assert res.returncode == 124, out[-3000:]
        assert "stopped at the deadline" in out and "the same command resumes" in out
        report = json.loads((sweep / "sweep_status.json").read_text())
        assert (report["jobs"], report["ok"], report["failed"], report["missing"]) == (2, 0, 0, 0), report
        assert [j["status"] for j in report["stopped_jobs"]][1:] == ["not started"]  # the full-attention job
        now = _samples(runs)
        assert all(name.startswith("oracle-") for name in now)
        for name, lines in before.items():
            assert now[name][: len(lines)] == lines, f"launch {launch}: {name} lost or rewrote samples"
            if 0 < len(lines) < len(now[name]) < n:  # stopped part-way twice, the second time further on
                progress = json.loads((runs / "wikitext" / "stories260k" / name / "progress.json").read_text())
                assert progress["done_at_start"] == len(lines)
                (job,) = [j for j in report["stopped_jobs"] if j["status"] == "stopped"]
                assert job["samples_written"] == len(now[name])
                resumed = True
        for lines in now.values():
            ids = [json.loads(line)["id"] for line in lines]
            assert len(ids) == len(set(ids)) <= n  # nothing written twice
        if resumed:
            break
        if not now:
            deadline *= 2
        before = now
    assert resumed, f"no run was stopped part-way in two launches: {[len(v) for v in before.values()]}"


def test_deadline_alarm_raises_in_the_block_and_is_disarmed_after(tmp_path):
    from sparse_eval.launcher.sweep import DeadlineReached, deadline_alarm

    handler = signal.getsignal(signal.SIGALRM)
    t0 = time.monotonic()
    with pytest.raises(DeadlineReached):
        with deadline_alarm((time.time() + 0.3, 60.0), tmp_path / "job_status.json", {"job_num": 0}):
            while time.monotonic() - t0 < 10:
                time.sleep(0.05)
    assert time.monotonic() - t0 < 5
    assert signal.getsignal(signal.SIGALRM) == handler and signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    assert not (tmp_path / "job_status.json").exists()  # the watchdog was cancelled
    assert isinstance(DeadlineReached(), KeyboardInterrupt)  # the runner stops on it as on Ctrl-C


def test_a_job_that_ignores_the_deadline_is_ended_after_the_grace(tmp_path):
    """A job stuck where the alarm cannot reach it (here: SIGALRM blocked) is ended grace seconds later: its
    status says ``killed`` and its process exits with 124."""
    status = tmp_path / "job_status.json"
    code = (
        "import signal, time; from pathlib import Path; from sparse_eval.launcher.sweep import deadline_alarm\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])\n"
        f"with deadline_alarm((time.time() + 0.2, 0.5), Path({str(status)!r}), {{'job_num': 3}}):\n"
        "    time.sleep(30)\n"
    )
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 124, res.stderr[-2000:]
    assert time.monotonic() - t0 < 20
    rec = json.loads(status.read_text())
    assert (rec["job_num"], rec["status"], rec["reason"]) == (3, "killed", "deadline")


def test_sweep_report_counts_stopped_jobs_and_exits_124(tmp_path):
    from omegaconf import OmegaConf

    from sparse_eval.launcher import sweep
    from sparse_eval.results.store import write_json

    for num, status in enumerate(["ok", "stopped", "not started"]):
        write_json(tmp_path / str(num) / sweep.JOB_STATUS, {"job_num": num, "status": status, "overrides": []})
    # a job process ended by the watchdog, whose status the launcher wrote (joblib stops all its workers then)
    rets = sweep.DeadlineJoblibLauncher._returns_after_kill(tmp_path, [["a=1"], ["a=2"], ["a=3"], ["a=4"]], 0)
    assert [r.return_value["status"] for r in rets] == ["ok", "stopped", "not started", "killed"]
    assert json.loads((tmp_path / sweep.LAUNCHER_FAILURES / "3.json").read_text())["status"] == "killed"
    cfg = OmegaConf.create(
        {"hydra": {"sweep": {"dir": str(tmp_path)}, "sweeper": {"params": None}, "overrides": {"task": ["a=1,2,3,4"]}}}
    )
    sweep.SweepReport().on_multirun_end(cfg)
    report = sweep.last_report()
    assert (report["jobs"], report["ok"], report["failed"], report["stopped"], report["missing"]) == (4, 1, 0, 3, 0)
    assert sweep.exit_status() == 124
    write_json(tmp_path / "4" / sweep.JOB_STATUS, {"job_num": 4, "status": "failed", "overrides": []})
    sweep.SweepReport().on_multirun_end(cfg)
    assert sweep.exit_status() == 1  # a failure wins over the deadline
    sweep._LAST_REPORT = None


def test_deadline_file_is_written_at_launch_and_removed_without_one(tmp_path):
    from sparse_eval.launcher import sweep

    at = sweep.write_deadline(tmp_path, 100, 30)
    rec = json.loads((tmp_path / sweep.DEADLINE_FILE).read_text())
    assert rec["deadline_at"] == at and abs(at - time.time() - 100) < 5 and rec["grace_s"] == 30
    assert sweep.write_deadline(tmp_path, None, 30) is None and not (tmp_path / sweep.DEADLINE_FILE).exists()
    with pytest.raises(ValueError):
        sweep.write_deadline(tmp_path, 0, 30)


# -- GPUs: one job per GPU, or several per GPU ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "visible, n_jobs, per_gpu",
    [("0", 4, 4), ("0", 1, 1), ("0,1", 2, 1), ("0,1", 4, 2), ("0,1", 3, 2), ("0,1,2,3", 8, 2), ("", 3, 3)],
)
def test_jobs_per_gpu(monkeypatch, visible, n_jobs, per_gpu):
    from sparse_eval.launcher.sweep import jobs_per_gpu

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert jobs_per_gpu(n_jobs) == per_gpu


def test_gpu_slots_spread_processes_over_gpus_and_cap_each(tmp_path):
    """Two GPUs, two slots each (n_jobs=4): four job processes take GPUs 0, 1, 0, 1; a fifth waits until one ends
    and then takes its GPU."""
    code = (
        "import sys, time; from sparse_eval.launcher.sweep import claim_gpus; "
        f"print(claim_gpus(1, lock_dir={str(tmp_path)!r}, poll_s=0.1, slots=2), flush=True); "
        "time.sleep(float(sys.argv[1]))"
    )
    env = _env(CUDA_VISIBLE_DEVICES="0,1")

    def start(life_s: str) -> subprocess.Popen:
        cmd = [sys.executable, "-c", code, life_s]
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)

    holders, got = [], []
    try:
        for _ in range(4):
            p = start("60")
            holders.append(p)
            got.append(p.stdout.readline().strip())
        assert got == ["['0']", "['1']", "['0']", "['1']"]
        fifth = start("0")
        holders.append(fifth)
        time.sleep(3)
        assert fifth.poll() is None  # all four slots are taken: it waits
        holders[1].kill()  # a process on GPU 1 ends
        holders[1].wait()
        assert fifth.stdout.readline().strip() == "['1']"
        fifth.wait(timeout=60)
    finally:
        for p in holders:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_a_bad_deadline_is_refused_before_any_job(tmp_path):
    res = _sweep(
        ["hydra/launcher=local_gpus", "hydra.launcher.deadline_s=-5", "method=full,topk", "preflight=false"],
        tmp_path / "runs",
        tmp_path / "sweep",
        timeout=300,
    )
    assert res.returncode == 2 and "hydra.launcher.deadline_s=-5: give a number" in res.stderr, res.stderr[-2000:]
    assert not (tmp_path / "runs").exists() and not list(tmp_path.glob("sweep/*/job_status.json"))
