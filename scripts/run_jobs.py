"""Run a list of shell commands as a pool of concurrent processes on one machine, with a deadline.

For many small evaluation runs on one GPU (a 135M model uses a fraction of an H200: several runs side by side
fill it), where a Hydra launcher would run one job per GPU.  Each line of the jobs file is ``NAME<TAB>COMMAND``
(blank lines and ``#`` comments skipped); jobs start in file order as slots free up.  At the deadline every
running job gets SIGINT (a run of ``python -m sparse_eval`` stops cleanly, its finished samples kept, and the same
command resumes it), then SIGKILL after ``--grace`` seconds.  Each job's output goes to ``LOG_DIR/NAME.log``;
``LOG_DIR/jobs.json`` records each job's command, exit status and wall time.

    python scripts/run_jobs.py jobs.tsv --workers 6 --deadline 540 --log-dir logs
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def read_jobs(path: Path) -> list[tuple[str, str]]:
    jobs = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        name, sep, cmd = line.partition("\t")
        if not sep or not name.strip() or not cmd.strip():
            raise SystemExit(f"{path}:{n}: expected NAME<TAB>COMMAND, got {line!r}")
        jobs.append((name.strip(), cmd.strip()))
    names = [j[0] for j in jobs]
    dup = sorted({x for x in names if names.count(x) > 1})
    if dup:
        raise SystemExit(f"{path}: duplicate job names {dup}: each job needs its own log")
    return jobs


def _default_sigint() -> None:
    """In the job's process before its command starts: SIGINT back to its default action.  A pool started in the
    background of a non-interactive shell (``python scripts/run_jobs.py ... &``, nohup) has SIGINT ignored, which its
    jobs would inherit; a shell cannot trap a signal ignored on entry, so the deadline's SIGINT would then stop
    nothing until SIGKILL.  (Popen's ``restore_signals`` restores SIGPIPE and SIGXFSZ only.)"""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run(jobs: list[tuple[str, str]], workers: int, deadline: float, grace: float, log_dir: Path) -> list[dict]:
    log_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    pending = list(jobs)
    running: dict[str, tuple[subprocess.Popen, float, object]] = {}
    done: list[dict] = []
    stopping = False

    def finish(name: str, rc: int | None, status: str) -> None:
        proc, start, fh = running.pop(name)
        fh.close()
        cmd = next(c for n, c in jobs if n == name)
        done.append(
            {
                "name": name,
                "command": cmd,
                "rc": rc,
                "status": status,
                "start_s": round(start - t0, 1),
                "wall_s": round(time.monotonic() - start, 1),
            }
        )
        print(f"[{time.monotonic() - t0:7.1f} s] {name}: {status} (rc {rc}, {done[-1]['wall_s']} s)", flush=True)

    while pending or running:
        now = time.monotonic() - t0
        if not stopping and now >= deadline:
            stopping = True
            print(
                f"[{now:7.1f} s] deadline: interrupting {sorted(running)}; not started: {[n for n, _ in pending]}",
                flush=True,
            )
            for proc, _, _ in running.values():
                os.killpg(proc.pid, signal.SIGINT)
            for name, cmd in pending:
                done.append({"name": name, "command": cmd, "rc": None, "status": "not started"})
            pending = []
            kill_at = time.monotonic() + grace
        if stopping and running and time.monotonic() >= kill_at:
            for proc, _, _ in running.values():
                os.killpg(proc.pid, signal.SIGKILL)
        while not stopping and pending and len(running) < workers:
            name, cmd = pending.pop(0)
            fh = open(log_dir / f"{name}.log", "w")
            proc = subprocess.Popen(
                cmd,
                shell=True,
                stdout=fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_default_sigint,
            )
            running[name] = (proc, time.monotonic(), fh)
            print(f"[{time.monotonic() - t0:7.1f} s] {name}: started", flush=True)
        for name in list(running):
            rc = running[name][0].poll()
            if rc is not None:
                finish(name, rc, "interrupted" if stopping else ("ok" if rc == 0 else "failed"))
        time.sleep(0.5)
    (log_dir / "jobs.json").write_text(json.dumps(done, indent=2) + "\n")
    return done


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("jobs", type=Path, help="file of NAME<TAB>COMMAND lines")
    ap.add_argument("--workers", type=int, default=4, help="jobs at a time (default 4)")
    ap.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which jobs are interrupted")
    ap.add_argument("--grace", type=float, default=30.0, help="seconds between SIGINT and SIGKILL (default 30)")
    ap.add_argument("--log-dir", type=Path, default=Path("job_logs"))
    args = ap.parse_args(argv)
    if args.workers < 1:
        raise SystemExit(f"--workers {args.workers}: must be at least 1")
    done = run(read_jobs(args.jobs), args.workers, args.deadline, args.grace, args.log_dir)
    bad = [d["name"] for d in done if d["status"] == "failed"]
    print(
        f"{sum(d['status'] == 'ok' for d in done)} ok, {len(bad)} failed {bad}, "
        f"{sum(d['status'] in ('interrupted', 'not started') for d in done)} interrupted or not started"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
