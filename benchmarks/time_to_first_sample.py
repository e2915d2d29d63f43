"""Time from launching ``python -m sparse_eval [overrides]`` in a fresh runs folder to its first sample written (the
first line of a ``samples.jsonl``); the process is then stopped.  Median of ``--repeats``.

    python benchmarks/time_to_first_sample.py [--repo DIR] [--repeats 3] [overrides...]

``--repo``: the checkout to launch from (default: this one), e.g. an older commit unpacked with ``git archive``.
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def first_sample_s(repo: Path, overrides: list[str], timeout: float = 600.0) -> float:
    """Seconds from launch to the first sample written (the process's CPU seconds are added to ``CPU_S``)."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        return _first_sample_s(repo, overrides, timeout)
    finally:
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        CPU_S.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)


CPU_S: list[float] = []


def _first_sample_s(repo: Path, overrides: list[str], timeout: float) -> float:
    with tempfile.TemporaryDirectory() as runs:
        env = dict(
            os.environ, SPARSE_EVAL_RUNS_DIR=runs, HF_HUB_OFFLINE="1", WANDB_MODE="disabled", PYTHONPATH=str(repo)
        )
        t0 = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "sparse_eval", *overrides],
            cwd=repo,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            while time.perf_counter() - t0 < timeout:
                if any(p.stat().st_size > 0 for p in Path(runs).rglob("samples.jsonl")):
                    return time.perf_counter() - t0
                if proc.poll() is not None:
                    raise SystemExit(f"the run ended ({proc.returncode}) before writing a sample")
                time.sleep(0.05)
            raise SystemExit(f"no sample within {timeout} s")
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--repeats", type=int, default=3)
    args, overrides = ap.parse_known_args()
    times = [first_sample_s(args.repo.resolve(), overrides) for _ in range(args.repeats)]
    print(
        f"time to first sample: median {statistics.median(times):.2f} s of {[round(t, 2) for t in times]}; CPU "
        f"(user + system, to the process's end) median {statistics.median(CPU_S):.2f} s of "
        f"{[round(c, 2) for c in CPU_S]} ({args.repo})"
    )


if __name__ == "__main__":
    main()
