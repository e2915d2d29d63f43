"""The state of every run under a folder: done / incomplete / running / failed / pending / unreadable, and the run-dir
files that say so.

    python -m sparse_eval.results.status runs/                 # one line per run (config), then the totals
    python -m sparse_eval.results.status runs/ --state failed  # only the failed ones, with their error
    python -m sparse_eval.results.status runs/ --json

A run directory (``store.run_dir_for``: ``<runs_dir>/<task>/<model>/<method-params>-<hash>``) holds, besides the
results (``samples.jsonl``, ``summary.json``), three small files the runner writes through ``store``:

    progress.json   written when a run (re)starts: expected sample count, start time, host, pid, Slurm job id
    failed.json     written when the run raised (error, traceback, host, Slurm job id); removed when it restarts
    .lock           held (flock) while a process runs it, so two jobs never append to one samples.jsonl

States (the first that applies):

    unreadable  config.yaml (the run's identity) cannot be read: the run cannot be named, resumed or tabulated;
              the command that made it rewrites it at its start (keeping the samples), else remove the directory
    failed    failed.json exists: the run stopped with an error (a sample's own error does not fail the run; it
              is a record with status "error" in samples.jsonl, counted in ``errors``)
    done      summary.json is newer than the last sample and every expected sample finished without an error
    incomplete  as done, but some samples ended in an error, or samples.jsonl has a line that is not a sample record
              (corrupt; ``store.parse_samples``): its scores are over the samples it finished.  The same
              command runs the failed samples again (``eval.rerun_failed``, on by default), reports a corrupt line
              (file, line number) and computes its sample again, and keeps the others
    running   the lock is held by a live process, or, when the run was started on another host (e.g. a Slurm
              node, whose lock this host may not see), samples.jsonl / progress.json changed in the last
              ``--recent`` seconds (default 300); a run started on this host whose lock nobody holds is not running
    pending   expected samples not yet written and nobody working on it: interrupted, queued, or not started

A relaunch of the same config resumes a pending (or failed) run at its first unfinished sample, and retries an
incomplete run's failed samples.  ``complete`` (in ``run_state``, ``collect`` and the summary): every expected
sample finished without an error (a finished run is then done, never incomplete).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from .store import (
    CONFIG_FILE,
    FAILED_FILE,
    PROGRESS_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    find_run_dirs,
    lock_held,
    method_label,
    read_identity,
    read_json,
    read_samples_checked,
)

STATES = ("done", "incomplete", "running", "failed", "pending", "unreadable")
UNREADABLE_FIX = (
    "config.yaml cannot be read (torn or corrupt): the run cannot be named, resumed or tabulated; run the "
    "command that made it again (it rewrites config.yaml and keeps the samples) or remove the directory"
)
DEFAULT_RECENT_S = 300.0


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def run_name(identity: dict[str, Any] | None, run_dir: Path) -> str:
    """A run's readable name: the method with its own parameters (``store.method_label``), its dense layers (and
    ``sliding=sparse`` where sliding layers ran sparse), the task's length when it has one (RULER, kv_retrieval),
    then the config hash, e.g.
    ``magicpig-K=10-L=150-dense=0,2-length=4096-1a2b3c4d5e``: runs that differ in those show different names."""
    if not identity or not isinstance(identity.get("method"), dict):
        return run_dir.name
    from ..method_facts import is_dense  # torch-free for the shipped methods

    method, task = identity["method"], identity.get("task") or {}
    parts = [method_label(method)]
    layers = not is_dense(method.get("name"))  # the dense reference has no dense / sparse layers to tell apart
    if layers and method.get("dense_layers") is not None:
        parts.append("dense=" + ",".join(str(x) for x in method["dense_layers"]))
    if layers and method.get("sliding_layers") == "sparse":
        parts.append("sliding=sparse")
    if task.get("length") is not None:
        parts.append(f"length={task['length']}")
    return "-".join(parts + [run_dir.name.rsplit("-", 1)[-1]])


def corrupt_note(corrupt: list[tuple[int, str]]) -> str:
    """What ``status`` says of a run whose samples.jsonl has lines that are not records (``store.parse_samples``)."""
    numbers = ", ".join(str(n) for n, _ in corrupt[:10]) + (" ..." if len(corrupt) > 10 else "")
    return (
        f"{SAMPLES_FILE} line{'s' if len(corrupt) > 1 else ''} {numbers} {'are' if len(corrupt) > 1 else 'is'} not a "
        "sample record (corrupt): the run is not complete; the same command reports them and computes their samples "
        "again"
    )


def _holder_gone(progress: dict[str, Any]) -> bool:
    """The run was last started on this host and nobody here holds its lock: the process that ran it ended (or was
    killed), so recent writes do not mean it still runs.  (A holder on another host is only known by its writes.)"""
    return bool(progress) and progress.get("host") == socket.gethostname()


def run_state(run_dir: Path, now: float | None = None, recent_s: float = DEFAULT_RECENT_S) -> dict[str, Any]:
    """The state of one run directory and its counts (see the module docstring)."""
    run_dir = Path(run_dir)
    now = time.time() if now is None else now
    records, bad = read_samples_checked(run_dir / SAMPLES_FILE)
    # lines that are not records, but a last line cut short (a write a kill interrupted: no finished sample's record)
    corrupt = [(number, line) for number, line, cut_short in bad if not cut_short]
    summary = read_json(run_dir / SUMMARY_FILE) or {}
    progress = read_json(run_dir / PROGRESS_FILE) or {}
    failed = read_json(run_dir / FAILED_FILE)
    expected = progress.get("expected_samples", summary.get("expected_samples"))
    written = len(records)
    errors = sum(1 for r in records.values() if r.get("status") != "ok")
    t_samples, t_summary = _mtime(run_dir / SAMPLES_FILE), _mtime(run_dir / SUMMARY_FILE)
    t_progress, t_failed = _mtime(run_dir / PROGRESS_FILE), _mtime(run_dir / FAILED_FILE)
    last = max([t for t in (t_samples, t_summary, t_progress, t_failed, _mtime(run_dir / CONFIG_FILE)) if t] or [0])
    held = lock_held(run_dir)
    all_written = expected is not None and written >= expected
    identity = read_identity(run_dir)
    readable = (
        isinstance(identity, dict)
        and isinstance(identity.get("method"), dict)
        and isinstance(identity.get("task"), dict)
    )
    if not readable and not held:
        state = "unreadable"
    elif failed is not None and not held and (t_failed or 0) >= max(t_samples or 0, t_progress or 0):
        state = "failed"
    elif all_written and t_summary is not None and t_summary >= (t_samples or 0) and not held:
        state = "incomplete" if errors or corrupt else "done"
    elif held or (now - max(t_samples or 0, t_progress or 0) < recent_s and not _holder_gone(progress)):
        state = "running"
    else:
        state = "pending"
    return {
        "state": state,
        "run_dir": str(run_dir),
        "task": run_dir.parent.parent.name,
        "model": run_dir.parent.name,
        "config": run_name(identity if readable else None, run_dir),
        "written": written,
        "expected": expected,
        "errors": errors,
        "complete": expected is not None and written - errors >= expected and not corrupt,
        "corrupt_lines": [number for number, _ in corrupt],
        "age_s": now - last if last else None,
        "error": (failed or {}).get("error")
        if state == "failed"
        else UNREADABLE_FIX
        if state == "unreadable"
        else corrupt_note(corrupt)
        if corrupt
        else None,
        "host": progress.get("host"),
        "slurm_job_id": progress.get("slurm_job_id"),
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
        rows.append(
            (
                s["state"],
                f"{s['written']}/{exp}",
                str(s["errors"]),
                _age(s["age_s"]),
                s["task"],
                s["model"],
                s["config"],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
    for s in states:
        if s["error"]:
            lines.append(f"{s['state']}: {s['run_dir']}: {s['error'].splitlines()[0][:300]}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_eval.results.status", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "dir",
        nargs="?",
        default=os.environ.get("SPARSE_EVAL_RUNS_DIR", "runs"),
        help="a runs folder (paths.runs_dir), any folder below it, or one run directory",
    )
    ap.add_argument(
        "--recent",
        type=float,
        default=DEFAULT_RECENT_S,
        help="a run modified within this many seconds counts as running (default %(default)s)",
    )
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
        print(
            f"{sum(totals.values())} runs: "
            + ", ".join(f"{v} {k}" for k, v in totals.items() if k != "unreadable" or v)
            + f"  ({root})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
