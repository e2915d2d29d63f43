"""Hydra multirun machinery: the job function, the sweep report, GPU slots for local launchers, and submitit
launchers that survive a job dying.

* ``run_job(cfg)`` runs one sweep job (the runner's ``run``) and never raises for the job's own errors: a bad
  model path, a bad value or a crash is written to ``failed.json`` in the run directory (by the runner) and to
  ``job_status.json`` in the job's Hydra output folder, and the sweep goes on.
* ``SweepReport`` (a Hydra callback, in ``conf/config.yaml``) counts the jobs at the end of a sweep, writes
  ``sweep_status.json`` in the sweep folder, logs the failures, prints one table of every run the jobs wrote
  (``print_sweep_table``; ``print_table=false``: none), and makes ``python -m sparse_eval -m ...`` exit
  with status 1 when any job failed (``exit_status``).
* Local parallel launchers (``hydra/launcher=local_gpus`` (joblib) or ``submitit_tolerant_local``): each job
  process claims a GPU of its own, or a share of one (``claim_gpus``: lock files per GPU, ``ceil(n_jobs / GPUs)``
  slots per GPU under joblib), and narrows ``CUDA_VISIBLE_DEVICES`` before CUDA starts.  (Plain ``submitit_local``
  gives every job the same GPUs 0..gpus_per_node-1.)
* A deadline (``hydra/launcher=local_gpus hydra.launcher.deadline_s=S``, ``DeadlineJoblibLauncher``): S seconds
  after the launch every running job stops as on Ctrl-C (``DeadlineReached``, raised by SIGALRM in the job's main
  thread: its finished samples kept) and the jobs not yet started are skipped; a job still running
  ``grace_s`` later is killed.  The sweep exits with 124; the same command resumes it.
* ``TolerantSlurmLauncher`` / ``TolerantLocalLauncher`` (``hydra/launcher=slurm`` / ``submitit_tolerant_local``;
  registered with Hydra by ``hydra_plugins/sparse_eval_launcher``): hydra-submitit-launcher's launchers, except
  that a job that dies without a result (killed, out of memory, too many timeouts, a vanished job on a cluster
  without accounting) is recorded as failed instead of aborting the sweep.  Timeouts and preemptions are
  requeued by submitit (``max_num_timeout``) and the requeued job resumes at its first unfinished sample.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import socket
import subprocess
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Sequence

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from ..cli import EXIT_DEADLINE
from ..results.store import read_json, slurm_job_id, write_json

log = logging.getLogger("sparse_eval")

JOB_STATUS = "job_status.json"  # in each job's Hydra output folder (${hydra.sweep.dir}/${hydra.sweep.subdir})
SWEEP_STATUS = "sweep_status.json"  # in the sweep folder
LAUNCHER_FAILURES = "launcher_failures"  # folder in the sweep folder: jobs that died without writing a status
GPU_LOCK_DIR = Path(os.environ.get("SPARSE_EVAL_GPU_LOCK_DIR", "/tmp/sparse_eval_gpu_locks"))
GPUS_PER_JOB_ENV = "SPARSE_EVAL_GPUS_PER_JOB"  # GPUs each local job process claims (see claim_gpus)
DEADLINE_FILE = "deadline.json"  # in the sweep folder: when the jobs of a sweep with a deadline stop
STOPPED = ("stopped", "not started", "killed")  # job statuses of a sweep stopped at its deadline (not failures)
_LAST_REPORT: dict[str, Any] | None = None


class DeadlineReached(KeyboardInterrupt):
    """The sweep's deadline (``hydra.launcher.deadline_s``), raised in the job's main thread: the run stops as on
    Ctrl-C (its finished samples kept; the same command resumes it)."""


# -- the job -----------------------------------------------------------------------------------------------------


def is_multirun() -> bool:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    return HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN


def run_job(cfg: DictConfig) -> dict[str, Any]:
    """One multirun job.  Returns its record (also written to ``job_status.json``); errors are recorded, not raised."""
    from hydra.core.hydra_config import HydraConfig

    from .runner import run  # the launch cache first: a finished job is answered without loading its model

    hc = HydraConfig.get()
    out_dir = Path(hc.runtime.output_dir)
    record: dict[str, Any] = {
        "job_num": hc.job.num,
        "overrides": list(hc.overrides.task),
        "output_dir": str(out_dir),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": slurm_job_id(),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    deadline = job_deadline(hc)
    if deadline is not None and time.time() >= deadline[0]:
        record.update(status="not started", reason="deadline", time_s=0.0)
        write_json(out_dir / JOB_STATUS, record)
        log.warning("job %s not started: the sweep's deadline has passed", hc.job.num)
        return record
    t0 = time.perf_counter()
    try:
        with deadline_alarm(deadline, out_dir / JOB_STATUS, record):
            per_job, slots = os.environ.get(GPUS_PER_JOB_ENV), 1  # GPUS_PER_JOB_ENV: set by TolerantLocalLauncher
            if per_job is None and "joblib" in str(OmegaConf.select(hc, "launcher._target_", default="")).lower():
                per_job, slots = "1", jobs_per_gpu(OmegaConf.select(hc, "launcher.n_jobs", default=1))
            if per_job and int(per_job) > 0:
                record["gpus"] = claim_gpus(int(per_job), slots=slots)
            summaries = run(cfg)
        record.update(
            status="ok",
            run_dirs=[s["run_dir"] for s in summaries],
            results=[
                {
                    k: s.get(k)
                    for k in (
                        "method",
                        "task",
                        "metric",
                        "score",
                        "cost1",
                        "cost2",
                        "samples",
                        "failed",
                        "expected_samples",
                    )
                }
                for s in summaries
            ],
        )
    except DeadlineReached as exc:  # the run stopped as on Ctrl-C: its samples are kept, a relaunch resumes it
        run_dir = getattr(exc, "run_dir", None)
        record.update(status="stopped" if run_dir else "not started", reason="deadline", run_dirs=[run_dir])
        if run_dir:
            from ..results.status import run_state

            st = run_state(Path(run_dir))
            record["samples_written"], record["expected_samples"] = st["written"], st["expected"]
            log.warning(
                "job %s stopped at the deadline: %s with %s/%s samples written; the same command resumes it",
                hc.job.num,
                run_dir,
                st["written"],
                "?" if st["expected"] is None else st["expected"],
            )
        else:
            log.warning("job %s stopped at the deadline before its run started", hc.job.num)
    except Exception as exc:  # noqa: BLE001 - a job's error is recorded and the sweep goes on
        record.update(
            status="failed",
            error=f"{type(exc).__name__}: {exc}",
            run_dirs=[getattr(exc, "run_dir", None)],
            traceback="".join(traceback.format_exception(exc)[-12:]),
        )
        log.error("job %s failed: %s: %s", hc.job.num, type(exc).__name__, exc)
    record["time_s"] = time.perf_counter() - t0
    write_json(out_dir / JOB_STATUS, record)
    return record


# -- the deadline ------------------------------------------------------------------------------------------------


def write_deadline(sweep_dir: Path, deadline_s: float | None, grace_s: float | None) -> float | None:
    """At launch: ``<sweep dir>/deadline.json`` says when the sweep's jobs stop (``deadline_s`` seconds from now;
    removed when there is none, so a relaunch into the same folder without one is not stopped by an old one)."""
    path = Path(sweep_dir) / DEADLINE_FILE
    if deadline_s is None:
        path.unlink(missing_ok=True)
        return None
    if float(deadline_s) <= 0 or (grace_s is not None and float(grace_s) < 0):
        raise ValueError(f"hydra.launcher.deadline_s={deadline_s}, grace_s={grace_s}: give a positive deadline")
    at = time.time() + float(deadline_s)
    write_json(
        path,
        {
            "deadline_s": float(deadline_s),
            "grace_s": None if grace_s is None else float(grace_s),
            "deadline_at": at,
            "deadline": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(at)),
        },
    )
    return at


def launcher_problem(config: DictConfig) -> str | None:
    """What is wrong with the launcher's deadline options (``hydra.launcher.deadline_s`` / ``grace_s``), checked
    before any job is launched; None when nothing is."""
    launcher = OmegaConf.select(config, "hydra.launcher", default=None)
    if launcher is None or "deadline_s" not in launcher:
        return None
    for key, least in (("deadline_s", 0.0), ("grace_s", 0.0)):
        value = launcher.get(key)
        if value is None:
            continue
        try:
            ok = float(value) > least if key == "deadline_s" else float(value) >= least
        except (TypeError, ValueError):
            ok = False
        if not ok:
            what = "seconds after the launch, > 0" if key == "deadline_s" else "seconds, >= 0"
            return f"hydra.launcher.{key}={value}: give a number of {what} (or null for none)"
    return None


def job_deadline(hc: Any) -> tuple[float, float | None] | None:
    """(deadline as a Unix time, grace in seconds) of this job's sweep, or None: only a launcher with a
    ``deadline_s`` (``hydra/launcher=local_gpus``) sets one, written by it at launch into the sweep folder."""
    if OmegaConf.select(hc, "launcher.deadline_s", default=None) is None:
        return None
    rec = read_json(Path(str(hc.sweep.dir)) / DEADLINE_FILE)
    if not rec or rec.get("deadline_at") is None:
        return None
    return float(rec["deadline_at"]), rec.get("grace_s")


def _raise_deadline(signum: int, frame: Any) -> None:
    raise DeadlineReached()


@contextlib.contextmanager
def deadline_alarm(deadline: tuple[float, float | None] | None, status_path: Path, record: dict[str, Any]):
    """Within the block, ``DeadlineReached`` is raised in this (main) thread at the deadline (SIGALRM).  A job that
    has not returned ``grace`` seconds later (stuck in a long native call) has its status written as ``killed``
    and its process ended (``os._exit(124)``): what it wrote is kept; the launcher records the lost process."""
    if deadline is None:
        yield
        return
    if threading.current_thread() is not threading.main_thread():
        log.warning("the deadline applies only to jobs run in a process's main thread; this job has none")
        yield
        return
    at, grace = deadline

    def kill() -> None:
        write_json(status_path, {**record, "status": "killed", "reason": "deadline", "time_s": None})
        log.error("job %s: still running %s s after the deadline; its process is ended", record["job_num"], grace)
        logging.shutdown()
        os._exit(EXIT_DEADLINE)

    old = signal.signal(signal.SIGALRM, _raise_deadline)
    signal.setitimer(signal.ITIMER_REAL, max(at - time.time(), 1e-3))
    watchdog = None
    if grace is not None:
        watchdog = threading.Timer(max(at + float(grace) - time.time(), 0.0), kill)
        watchdog.daemon = True
        watchdog.start()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        if watchdog is not None:
            watchdog.cancel()


# -- GPUs for local parallel launchers ---------------------------------------------------------------------------

_CLAIMED: tuple[list[int], list[str]] | None = None  # (lock fds, devices) held for the life of this process


def visible_gpus() -> list[str]:
    """The GPUs this process may use, without starting CUDA (which would freeze CUDA_VISIBLE_DEVICES)."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return [d.strip() for d in env.split(",") if d.strip() and d.strip() != "-1"]
    proc = Path("/proc/driver/nvidia/gpus")
    if proc.is_dir():
        return [str(i) for i in range(len(list(proc.iterdir())))]
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
        return [str(i) for i, line in enumerate(l for l in out.splitlines() if l.startswith("GPU "))]
    except (OSError, subprocess.SubprocessError):
        return []


def gpu_count() -> int:
    return len(visible_gpus())


def jobs_per_gpu(n_jobs: Any) -> int:
    """GPU slots a joblib job process may claim per GPU: the launcher's ``n_jobs`` processes spread evenly over the
    visible GPUs (``ceil(n_jobs / GPUs)``: n_jobs = GPUs is one job per GPU; n_jobs = 4 on one GPU, four on it)."""
    try:
        n = int(n_jobs)
    except (TypeError, ValueError):
        return 1
    if n < 0:  # joblib: -1 = all CPUs, -2 = all but one, ...
        import joblib

        n = joblib.cpu_count() + 1 + n
    return max(1, math.ceil(max(n, 1) / max(gpu_count(), 1)))


def claim_gpus(n: int = 1, lock_dir: Path | None = None, poll_s: float = 2.0, slots: int = 1) -> list[str] | None:
    """Take ``n`` of the visible GPUs for this process (lock files) and narrow CUDA_VISIBLE_DEVICES.

    Processes of local parallel launchers (joblib workers, submitit_local jobs) on one machine share the GPUs:
    each GPU has ``slots`` lock files (``gpu-<dev>.lock``, ``gpu-<dev>.<k>.lock``), so at most ``slots`` processes
    use it, and a process takes a free slot, every GPU's first slot before any second one (so the processes spread
    over the GPUs); it waits while all are taken.  The claim
    lasts as long as the process (joblib reuses a worker for several jobs: the same GPUs again).  Nothing happens
    when at most ``n`` GPUs are visible (every job uses them).
    """
    global _CLAIMED
    import fcntl

    if _CLAIMED is not None:
        return _CLAIMED[1]
    gpus = visible_gpus()
    if len(gpus) <= n:
        return None
    lock_dir = Path(lock_dir or GPU_LOCK_DIR)
    lock_dir.mkdir(parents=True, exist_ok=True)
    names = [(dev, f"gpu-{dev}.lock" if k == 0 else f"gpu-{dev}.{k}.lock") for k in range(slots) for dev in gpus]
    t0 = last_log = time.monotonic()
    while True:
        fds, got = [], []
        for dev, name in names:  # slot-major: the first free slot is on a GPU with the fewest processes
            if dev in got:
                continue
            fd = os.open(lock_dir / name, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            fds.append(fd)
            got.append(dev)
            if len(got) == n:
                break
        if len(got) == n:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(got)
            _CLAIMED = (fds, got)
            log.info("job process %d uses GPU(s) %s", os.getpid(), ",".join(got))
            return got
        for fd in fds:
            os.close(fd)  # closing releases the lock
        if time.monotonic() - last_log > 60:
            last_log = time.monotonic()
            log.warning("waiting for %d free GPU(s) of %s (%.0f s)", n, gpus, last_log - t0)
        time.sleep(poll_s)


if not OmegaConf.has_resolver("sparse_eval.gpu_count"):
    # ``${sparse_eval.gpu_count:}``: the number of visible GPUs (at least 1), e.g. joblib's n_jobs
    OmegaConf.register_new_resolver("sparse_eval.gpu_count", lambda: max(1, gpu_count()))


# -- the sweep report --------------------------------------------------------------------------------------------


def sweep_jobs(params: dict[str, Any] | None, overrides: Sequence[str]) -> list[list[str]]:
    """The jobs (override lists) Hydra's basic sweeper makes of ``hydra.sweeper.params`` and command-line
    ``overrides`` (the command line wins over a param of the same key), in launch order."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    lines = [f"{k}={v}" for k, v in (params or {}).items()] + list(overrides)
    return BasicSweeper.split_arguments(OverridesParser.create().parse_overrides(lines), None)[0]


def expected_jobs(config: DictConfig) -> int | None:
    """Number of jobs the basic sweeper makes of ``hydra.sweeper.params`` and the command line (None: unknown)."""
    try:
        return len(sweep_jobs(OmegaConf.select(config, "hydra.sweeper.params"), list(config.hydra.overrides.task)))
    except Exception:  # noqa: BLE001 - another sweeper (optuna, ...) or an unparsable value
        return None


def collect_job_records(sweep_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in sorted(sweep_dir.rglob(JOB_STATUS)):
        if ".submitit" in path.parts:
            continue
        rec = read_json(path)
        if rec is not None:
            records.append(rec)
    seen = {r.get("job_num") for r in records}
    for path in sorted((sweep_dir / LAUNCHER_FAILURES).glob("*.json")):
        rec = read_json(path)
        if rec is not None and rec.get("job_num") not in seen:
            records.append(rec)
    return sorted(records, key=lambda r: (r.get("job_num") is None, r.get("job_num")))


class SweepReport(Callback):
    """At the end of a multirun: ``sweep_status.json`` + a summary line; failures make the process exit with 1."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        global _LAST_REPORT
        sweep_dir = Path(str(config.hydra.sweep.dir))
        records = collect_job_records(sweep_dir)
        expected = expected_jobs(config)
        ok = [r for r in records if r.get("status") == "ok"]
        stopped = [r for r in records if r.get("status") in STOPPED]
        failed = [r for r in records if r.get("status") != "ok" and r.get("status") not in STOPPED]
        missing = max(0, expected - len(records)) if expected is not None else 0
        report = {
            "sweep_dir": str(sweep_dir),
            "jobs": expected if expected is not None else len(records),
            "ok": len(ok),
            "failed": len(failed),
            "stopped": len(stopped),
            "missing": missing,
            "failures": [
                {k: r.get(k) for k in ("job_num", "overrides", "error", "run_dirs", "output_dir")} for r in failed
            ],
            "stopped_jobs": [
                {k: r.get(k) for k in ("job_num", "overrides", "status", "run_dirs", "samples_written")}
                for r in stopped
            ],
            "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
        write_json(sweep_dir / SWEEP_STATUS, report)
        for r in failed:
            log.error("failed job #%s (%s): %s", r.get("job_num"), " ".join(r.get("overrides") or []), r.get("error"))
        line = (
            f"sweep: {report['jobs']} jobs, {len(ok)} ok, {len(failed)} failed"
            + (f", {missing} without a status" if missing else "")
            + (
                f", {len(stopped)} stopped at the deadline "
                f"({sum(r.get('status') != 'not started' for r in stopped)} interrupted, "
                f"{sum(r.get('status') == 'not started' for r in stopped)} not started; "
                f"the same command resumes them)"
                if stopped
                else ""
            )
            + f"  ({sweep_dir / SWEEP_STATUS})"
        )
        (log.error if failed or missing else log.warning if stopped else log.info)(line)
        if bool(OmegaConf.select(config, "print_table", default=True)):
            print_sweep_table(records)
        _LAST_REPORT = report


def print_sweep_table(records: list[dict[str, Any]]) -> None:
    """One table of every run the sweep's jobs wrote, after each job's own: ``collect`` over their run dirs, with full
    attention's runs of the same task, model and settings found beside them (so a sweep of one method is compared
    too), printed as ``results.terminal_table`` fits it to the terminal."""
    from ..results.collect import PAIR_KEYS, collect
    from ..results.terminal_table import format_compact
    from ..method_facts import is_dense
    from ..results.store import is_run_dir, read_identity

    dirs = list(dict.fromkeys(str(d) for r in records for d in r.get("run_dirs") or [] if d and Path(d).is_dir()))
    if not dirs:
        return
    beside = {p for d in dirs for p in Path(d).parent.iterdir() if str(p) not in dirs and is_run_dir(p)}
    refs = [str(p) for p in sorted(beside) if is_dense(((read_identity(p) or {}).get("method") or {}).get("name"))]
    try:
        df = collect(None, by_subtask=True, run_dirs=[Path(d) for d in dirs + refs])
    except Exception as exc:  # noqa: BLE001 - the sweep's own report (its status, its exit code) comes first
        log.warning("could not make the sweep's table: %s: %s", type(exc).__name__, exc)
        return
    if df.empty:
        return
    key = df[[k for k in PAIR_KEYS if k in df.columns]].astype(str).apply(tuple, axis=1)
    ours = df["run_dir"].isin(dirs)
    df = df[ours | key.isin(set(key[ours]))]  # the references that pair with one of the sweep's runs
    extra = df["run_dir"].nunique() - len(dirs)
    runs, them = (f"{len(dirs)} runs", "them") if len(dirs) > 1 else ("run", "it")
    found = f", with the full-attention run{'s' if extra > 1 else ''} found beside {them}" if extra > 0 else ""
    print(f"\nthe sweep's {runs}{found} (every run there: python -m sparse_eval.results.collect <runs_dir>)")
    print(format_compact(df))


def last_report() -> dict[str, Any] | None:
    return _LAST_REPORT


def exit_status() -> int:
    """1 when the last sweep of this process had a failed (or silent) job; else 124 when its deadline stopped
    some job (``EXIT_DEADLINE``: the same command resumes them); else 0."""
    r = _LAST_REPORT
    if r is None:
        return 0
    if r["failed"] or r["missing"]:
        return 1
    return EXIT_DEADLINE if r.get("stopped") else 0


# -- submitit launchers that record dead jobs instead of aborting ------------------------------------------------

try:  # hydra-submitit-launcher is optional (extra "slurm")
    from hydra_plugins.hydra_submitit_launcher import submitit_launcher as _sl
except ImportError:  # pragma: no cover - without the plugin these launchers do not exist
    _sl = None


# states of a job that may still run (or run again) and write its result; any other state is final
_LIVE_STATES = {
    "PENDING",
    "RUNNING",
    "COMPLETING",
    "CONFIGURING",
    "REQUEUED",
    "REQUEUE_FED",
    "REQUEUE_HOLD",
    "RESIZING",
    "SUSPENDED",
    "STOPPED",
    "SIGNALING",
    "STAGE_OUT",
    "RESV_DEL_HOLD",
    "SPECIAL_EXIT",
}


def job_record(job_id: str) -> dict[str, str]:
    """The controller's record of a job (``scontrol show job -o``: JobState, Reason, ExitCode, Restarts, ...), kept
    for a while after it ended (slurm.conf MinJobAge); {} when the controller has none or cannot be asked."""
    try:
        out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return {}
    line = out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    return dict(kv.split("=", 1) for kv in line.split() if "=" in kv)


def _queue_state(job_id: str) -> str | None:
    """The job's state: ``squeue``'s, else (a job squeue does not list) the controller's record if that says the
    job may still run; None when it has ended or is unknown to Slurm, "UNKNOWN" when squeue fails."""
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return "UNKNOWN"
    if out.returncode != 0 and "Invalid job id" not in out.stderr:
        return "UNKNOWN"
    if out.returncode == 0 and out.stdout.strip():
        return out.stdout.strip().splitlines()[0]
    state = job_record(job_id).get("JobState")
    return state if state in _LIVE_STATES else None


def wait_for_result(job: Any, poll_s: float = 2.0, grace_s: float | None = None) -> Any:
    """``job.results()[0]``, but a job gone from the Slurm queue without a result raises instead of waiting forever
    (without accounting, submitit cannot tell a vanished job from a running one).  ``grace_s``: how long a job may
    be out of the queue before its result file must exist (default 60 s, env SPARSE_EVAL_SUBMITIT_GRACE_S)."""
    if grace_s is None:
        grace_s = float(os.environ.get("SPARSE_EVAL_SUBMITIT_GRACE_S", 60))
    gone_since = None
    last_check = 0.0
    while not job.paths.result_pickle.exists():
        now = time.monotonic()
        if job.__class__.__name__ == "SlurmJob":
            if now - last_check >= min(15.0, grace_s / 2):
                last_check = now
                state = _queue_state(job.job_id)
                gone_since = (gone_since or now) if state is None else None
            if gone_since is not None and now - gone_since > grace_s:
                rec = job_record(job.job_id)
                said = ", ".join(
                    f"{k}={rec[k]}" for k in ("JobState", "Reason", "ExitCode", "Restarts", "RunTime") if k in rec
                )
                raise RuntimeError(
                    f"Slurm job {job.job_id} left the queue without a result (killed, out of memory, "
                    f"or cancelled; Slurm: {said or 'no record'}); its log: {job.paths.stderr}"
                )
        elif job.done():
            break
        time.sleep(poll_s)
    return job.results()[0]


def _spread_local_gpus(params: dict[str, Any]) -> None:
    """submitit's local executor gives every job the same GPUs (0..gpus_per_node-1).  Instead, show each job all
    GPUs of this process and let it claim ``gpus_per_node`` of them (``claim_gpus`` in ``run_job``)."""
    per_job = params.get("gpus_per_node") or 0
    gpus = visible_gpus()
    if not per_job or len(gpus) <= per_job:
        return
    try:
        params["visible_gpus"] = [int(g) for g in gpus]
    except ValueError:  # GPU UUIDs in CUDA_VISIBLE_DEVICES: leave submitit's assignment alone
        return
    params["gpus_per_node"] = len(gpus)
    os.environ[GPUS_PER_JOB_ENV] = str(per_job)  # the job processes inherit this environment


if _sl is not None:

    class _Tolerant:
        """Mixin over hydra-submitit-launcher's launchers: the sweep survives a job that died without a result."""

        _EXECUTOR: str

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            import submitit
            from hydra.core.singleton import Singleton
            from hydra.core.utils import JobReturn, JobStatus, filter_overrides

            params = dict(self.params)  # type: ignore[attr-defined]
            cluster = self._EXECUTOR
            init = {"folder": params.pop("submitit_folder")}
            if "max_num_timeout" in params:
                init[f"{cluster}_max_num_timeout"] = params.pop("max_num_timeout")
            executor = submitit.AutoExecutor(cluster=cluster, **init)
            if cluster == "local":
                _spread_local_gpus(params)
            shared = set(OmegaConf.structured(_sl.BaseQueueConf).keys())
            executor.update_parameters(**{(k if k in shared else f"{cluster}_{k}"): v for k, v in params.items()})
            sweep_dir = Path(str(self.config.hydra.sweep.dir))  # type: ignore[attr-defined]
            sweep_dir.mkdir(parents=True, exist_ok=True)
            log.info("submitit '%s' sweep of %d jobs; output dir %s", cluster, len(job_overrides), sweep_dir)
            nums = [initial_job_idx + i for i in range(len(job_overrides))]
            for num, ov in zip(nums, job_overrides):
                log.info("\t#%d : %s", num, " ".join(filter_overrides(ov)))
            state = Singleton.get_state()
            jobs = executor.map_array(
                self,
                [list(o) for o in job_overrides],
                ["hydra.sweep.dir"] * len(nums),
                nums,
                [f"job_id_for_{n}" for n in nums],
                [state] * len(nums),
            )
            returns = []
            for num, ov, job in zip(nums, job_overrides, jobs):
                try:
                    returns.append(wait_for_result(job))
                except Exception as exc:  # noqa: BLE001 - the job died; record it and collect the others
                    rec = {
                        "job_num": num,
                        "overrides": list(ov),
                        "status": "failed",
                        "slurm_job_id": job.job_id,
                        "error": (
                            f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}"
                        ),
                        "log": str(job.paths.stderr),
                    }
                    write_json(sweep_dir / LAUNCHER_FAILURES / f"{num}.json", rec)
                    log.error("job #%d (%s) died: %s", num, job.job_id, rec["error"])
                    ret = JobReturn(overrides=list(ov), status=JobStatus.COMPLETED)  # recorded: the sweep goes on
                    ret.return_value = rec
                    returns.append(ret)
            return returns

    # Hydra only instantiates launchers defined in the ``hydra_plugins`` namespace package: the configs point at
    # ``hydra_plugins.sparse_eval_launcher.launchers.{SlurmLauncher,LocalLauncher}``, thin subclasses of these.
    class TolerantSlurmLauncher(_Tolerant, _sl.SlurmLauncher):
        pass

    class TolerantLocalLauncher(_Tolerant, _sl.LocalLauncher):
        pass


# -- joblib with a deadline --------------------------------------------------------------------------------------

try:  # hydra-joblib-launcher is optional (extra "slurm")
    from hydra_plugins.hydra_joblib_launcher.joblib_launcher import JoblibLauncher as _JoblibLauncher
except ImportError:  # pragma: no cover - without the plugin hydra/launcher=local_gpus does not exist
    _JoblibLauncher = None

if _JoblibLauncher is not None:

    class DeadlineJoblibLauncher(_JoblibLauncher):
        """hydra-joblib-launcher's launcher (``n_jobs`` job processes at a time, loky) with a deadline:
        ``deadline_s`` seconds after the launch every running job stops as on Ctrl-C and the jobs not started are
        skipped (``run_job``); a job process still running ``grace_s`` seconds later is ended.  The remaining
        options go to ``joblib.Parallel`` as in the plugin."""

        def __init__(self, deadline_s: float | None = None, grace_s: float | None = 30.0, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.deadline_s, self.grace_s = deadline_s, grace_s

        def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[Any]:
            sweep_dir = Path(str(self.config.hydra.sweep.dir))
            sweep_dir.mkdir(parents=True, exist_ok=True)
            at = write_deadline(sweep_dir, self.deadline_s, self.grace_s)
            if at is not None:
                log.info(
                    "deadline: jobs stop at %s (in %s s; killed %s s later)",
                    time.strftime("%H:%M:%S", time.localtime(at)),
                    self.deadline_s,
                    self.grace_s,
                )
            try:
                return super().launch(job_overrides, initial_job_idx)
            except Exception as exc:  # noqa: BLE001 - a job process ended after the deadline: joblib gave up
                if at is None or time.time() < at:
                    raise
                log.error("the sweep stopped at its deadline with a job process ended (%s)", type(exc).__name__)
                return self._returns_after_kill(sweep_dir, job_overrides, initial_job_idx)

        @staticmethod
        def _returns_after_kill(
            sweep_dir: Path, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
        ) -> list[Any]:
            """joblib stops every worker when one dies: each job's own status where it wrote one, else ``killed``
            (in ``launcher_failures/``, which ``SweepReport`` reads as well)."""
            from hydra.core.utils import JobReturn, JobStatus

            have = {r.get("job_num"): r for r in collect_job_records(sweep_dir)}
            returns = []
            for i, ov in enumerate(job_overrides):
                num = initial_job_idx + i
                rec = have.get(num)
                if rec is None:
                    rec = {"job_num": num, "overrides": list(ov), "status": "killed", "reason": "deadline"}
                    write_json(sweep_dir / LAUNCHER_FAILURES / f"{num}.json", rec)
                ret = JobReturn(overrides=list(ov), status=JobStatus.COMPLETED)
                ret.return_value = rec
                returns.append(ret)
            return returns
