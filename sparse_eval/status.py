"""The state of every run under a folder: done / running / failed / pending, and the run-dir files that say so.

    python -m sparse_eval.status runs/                 # one line per run (config), then the totals
    python -m sparse_eval.status runs/ --state failed  # only the failed ones, with their error
    python -m sparse_eval.status runs/ --json

A run directory (``results.run_dir_for``: ``<runs_dir>/<task>/<model>/<method-params>-<hash>``) holds, besides the
results (``samples.jsonl``, ``summary.json``), three small files written by the runner through this module:

    progress.json   written when a run (re)starts: expected sample count, start time, host, pid, Slurm job id
    failed.json     written when the run raised (error, traceback, host, Slurm job id); removed when it restarts
    .lock           held (flock) while a process runs it, so two jobs never append to one samples.jsonl

States (the first that applies):

    failed    failed.json exists: the run stopped with an error (a sample's own error does not fail the run; it
              is a record with status "error" in samples.jsonl, counted in ``errors``)
    done      summary.json is newer than the last sample and every expected sample is written
    running   the lock is held by a live process, or, when the run was started on another host (e.g. a Slurm
              node, whose lock this host may not see), samples.jsonl / progress.json changed in the last
              ``--recent`` seconds (default 300); a run started on this host whose lock nobody holds is not running
    pending   expected samples not yet written and nobody working on it: interrupted, queued, or not started

A relaunch of the same config resumes a pending (or failed) run at its first unfinished sample.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import os
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

log = logging.getLogger("sparse_eval")

PROGRESS_FILE = "progress.json"
FAILED_FILE = "failed.json"
LOCK_FILE = ".lock"
STATES = ("done", "running", "failed", "pending")
DEFAULT_RECENT_S = 300.0


# -- writers (used by the runner) ------------------------------------------------------------------------------

class RunsDirError(ValueError):
    """``paths.runs_dir`` (or a run dir below it) cannot be written."""


def check_writable(run_dir: Path) -> str | None:
    """None when ``run_dir`` exists and is writable or could be created (it then exists); else the reason, naming
    the path, e.g. ``/proc/runs (No such file or directory)``."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        return None if os.access(run_dir, os.W_OK) else f"{run_dir} (read-only)"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{exc.filename or run_dir} ({exc.strerror or exc})"
    return None


def slurm_job_id() -> str | None:
    """This process's Slurm job as squeue names it: ``<array job>_<task>`` for an array task, else the job id."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    return env.get("SLURM_JOB_ID")


def _where() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "slurm_job_id": slurm_job_id(),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def write_progress(run_dir: Path, expected_samples: int, already_done: int) -> None:
    """At the start (or restart) of a run: how many samples it will have in all and how many were already there."""
    _write_json(Path(run_dir) / PROGRESS_FILE, {"expected_samples": expected_samples,
                                                "done_at_start": already_done, **_where()})


def write_failure(run_dir: Path, exc: BaseException, extra: dict[str, Any] | None = None) -> Path:
    path = Path(run_dir) / FAILED_FILE
    _write_json(path, {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                       "traceback": "".join(traceback.format_exception(exc)[-12:]), **_where(), **(extra or {})})
    return path


def clear_failure(run_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (Path(run_dir) / FAILED_FILE).unlink()


@contextlib.contextmanager
def run_lock(run_dir: Path, wait_log_s: float = 60.0) -> Iterator[None]:
    """Exclusive lock on a run directory for the time a process runs it (waits while another one holds it).

    Two jobs of the same config (a duplicated sweep point, a sweep relaunched while its first launch still runs)
    then never write the same samples twice: the second waits and finds the samples done.  Where the file
    system refuses locks (some network mounts) it runs without one.
    """
    import fcntl

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    locked = False
    try:
        t0 = last = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() - last >= wait_log_s:
                    last = time.monotonic()
                    log.warning("run dir %s is locked by another process (%s); waiting (%.0f s so far)",
                                run_dir, _lock_owner(fd), last - t0)
                time.sleep(1.0)
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("no file locks on %s (%s); running without", run_dir, exc)
                    break
                raise
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_where()).encode(), 0)
        yield
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _lock_owner(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace") or "?"
    except OSError:
        return "?"


def lock_held(run_dir: Path) -> bool:
    """True when some process holds the run's lock right now (checked without taking it for long)."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- readers ---------------------------------------------------------------------------------------------------

def is_run_dir(path: Path) -> bool:
    return (path / "config.yaml").is_file() and ((path / "meta.json").is_file() or (path / PROGRESS_FILE).is_file())


def find_run_dirs(root: Path) -> list[Path]:
    """Every run directory under ``root`` (or ``root`` itself), skipping Hydra's own output folders."""
    root = Path(root)
    if is_run_dir(root):
        return [root]
    out = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".hydra", ".submitit", "wandb"))
        p = Path(dirpath)
        if is_run_dir(p):
            out.append(p)
            dirnames[:] = []
    return out


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def read_samples(path: Path) -> dict[str, dict[str, Any]]:
    """samples.jsonl as {id: record}; the last record of an id wins (as ``results.SampleLog``); torn lines skipped."""
    out: dict[str, dict[str, Any]] = {}
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return out
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            out[rec["id"]] = rec
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return out


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def run_name(identity: dict[str, Any] | None, run_dir: Path) -> str:
    """A run's readable name: the method with its own parameters (``results.method_label``), its dense layers (and
    ``sliding=sparse`` where sliding layers ran sparse), the task's length when it has one (RULER, kv_retrieval),
    then the config hash, e.g.
    ``magicpig-K=10-L=150-dense=0,2-length=4096-1a2b3c4d5e``: runs that differ in those show different names."""
    from .results import method_label

    if not identity or not isinstance(identity.get("method"), dict):
        return run_dir.name
    method, task = identity["method"], identity.get("task") or {}
    parts = [method_label(method)]
    if method.get("name") != "full" and method.get("dense_layers") is not None:
        parts.append("dense=" + ",".join(str(x) for x in method["dense_layers"]))
    if method.get("name") != "full" and method.get("sliding_layers") == "sparse":
        parts.append("sliding=sparse")
    if task.get("length") is not None:
        parts.append(f"length={task['length']}")
    return "-".join(parts + [run_dir.name.rsplit("-", 1)[-1]])


def _read_identity(run_dir: Path) -> dict[str, Any] | None:
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a torn or foreign file: the directory's name stands in
        return None


def _holder_gone(progress: dict[str, Any]) -> bool:
    """The run was last started on this host and nobody here holds its lock: the process that ran it ended (or was
    killed), so recent writes do not mean it still runs.  (A holder on another host is only known by its writes.)"""
    return bool(progress) and progress.get("host") == socket.gethostname()


def run_state(run_dir: Path, now: float | None = None, recent_s: float = DEFAULT_RECENT_S) -> dict[str, Any]:
    """The state of one run directory and its counts (see the module docstring)."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    records = read_samples(run_dir / "samples.jsonl")
    summary = _read_json(run_dir / "summary.json") or {}
    progress = _read_json(run_dir / PROGRESS_FILE) or {}
    failed = _read_json(run_dir / FAILED_FILE)
    expected = progress.get("expected_samples", summary.get("expected_samples"))
    written = len(records)
    errors = sum(1 for r in records.values() if r.get("status") != "ok")
    t_samples, t_summary = _mtime(run_dir / "samples.jsonl"), _mtime(run_dir / "summary.json")
    t_progress, t_failed = _mtime(run_dir / PROGRESS_FILE), _mtime(run_dir / FAILED_FILE)
    last = max([t for t in (t_samples, t_summary, t_progress, t_failed, _mtime(run_dir / "config.yaml")) if t] or [0])
    held = lock_held(run_dir)
    complete = expected is not None and written >= expected
    if failed is not None and not held and (t_failed or 0) >= max(t_samples or 0, t_progress or 0):
        state = "failed"
    elif complete and t_summary is not None and t_summary >= (t_samples or 0) and not held:
        state = "done"
    elif held or (now - max(t_samples or 0, t_progress or 0) < recent_s and not _holder_gone(progress)):
        state = "running"
    else:
        state = "pending"
    return {
        "state": state, "run_dir": str(run_dir), "task": run_dir.parent.parent.name, "model": run_dir.parent.name,
        "config": run_name(_read_identity(run_dir), run_dir), "written": written, "expected": expected, "errors": errors,
        "age_s": now - last if last else None, "error": (failed or {}).get("error") if state == "failed" else None,
        "host": progress.get("host"), "slurm_job_id": progress.get("slurm_job_id"),
    }


def _age(s: float | None) -> str:
    if s is None:
        return "-"
    for unit, div in (("d", 86400), ("h", 3600), ("m", 60)):
        if s >= div:
            return f"{s / div:.1f}{unit}"
    return f"{s:.0f}s"


def format_states(states: list[dict[str, Any]]) -> str:
    rows = [("STATE", "SAMPLES", "ERR", "AGE", "TASK", "MODEL", "CONFIG")]
    for s in states:
        exp = "?" if s["expected"] is None else str(s["expected"])
        rows.append((s["state"], f"{s['written']}/{exp}", str(s["errors"]), _age(s["age_s"]), s["task"], s["model"],
                     s["config"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    for s in states:
        if s["error"]:
            lines.append(f"failed: {s['run_dir']}: {s['error'].splitlines()[0][:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_eval.status", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", nargs="?", default=os.environ.get("SPARSE_EVAL_RUNS_DIR", "runs"),
                    help="a runs folder (paths.runs_dir), any folder below it, or one run directory")
    ap.add_argument("--recent", type=float, default=DEFAULT_RECENT_S,
                    help="a run modified within this many seconds counts as running (default %(default)s)")
    ap.add_argument("--state", choices=STATES, action="append", help="show only these states (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object per run")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not root.exists():
        print(f"error: {root} does not exist", file=sys.stderr)
        return 2
    now = time.time()
    states = [run_state(d, now, args.recent) for d in find_run_dirs(root)]
    totals = {k: sum(1 for s in states if s["state"] == k) for k in STATES}
    if args.state:
        states = [s for s in states if s["state"] in args.state]
    if args.json:
        for s in states:
            print(json.dumps(s, sort_keys=True))
    else:
        if states:
            print(format_states(states))
        print(f"{sum(totals.values())} runs: " + ", ".join(f"{v} {k}" for k, v in totals.items()) + f"  ({root})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
