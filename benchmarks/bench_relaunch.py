"""Relaunch of finished runs: wall time of the default experiment re-run on saved results and of a 7-job multirun
relaunch (median of ``--repeats``), and each multirun job's own time after imports (``job_status.json`` time_s).

    SPARSE_EVAL_DATA_DIR=... python benchmarks/bench_relaunch.py --runs-dir /tmp/relaunch_runs \
        [--repeats 3] [--repo DIR]

The first launch of each command (which computes the runs, or finds them the normal way) is made once before the
timed ones and not counted.  See experiments/relaunch_skip/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MULTIRUN_METHODS = "full,topk,oracle,magicpig,quest,double_sparsity,quest_p16_4pct"


CPU_S: list[float] = []  # user + system CPU seconds of each timed command (the machine may be shared)


def timed(cmd: list[str], env: dict[str, str], repo: Path = REPO) -> tuple[float, subprocess.CompletedProcess]:
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    res = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    dt = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU_S.append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr[-2000:]}")
    return dt, res


def job_times(runs_dir: Path) -> list[float]:
    """time_s of each job of the newest multirun under ``runs_dir``."""
    sweeps = sorted((runs_dir / ".hydra").glob("multirun-*"))
    return [json.loads(p.read_text())["time_s"] for p in sorted(sweeps[-1].glob("*/job_status.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs-dir", required=True, type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=MULTIRUN_METHODS, help="the multirun's method list")
    ap.add_argument(
        "--repo",
        type=Path,
        default=REPO,
        help="the checkout to launch from (e.g. an older commit unpacked with git archive)",
    )
    ap.add_argument("--only", choices=["default", "multirun"], help="time one of the two commands")
    args = ap.parse_args()
    env = dict(
        os.environ,
        SPARSE_EVAL_RUNS_DIR=str(args.runs_dir),
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONPATH=str(args.repo.resolve()),
    )
    py = [sys.executable, "-m", "sparse_eval"]
    commands = {"default": py, "multirun": py + ["-m", f"method={args.methods}"]}
    out = {}
    for name, cmd in commands.items():
        if args.only and name != args.only:
            continue
        first, _ = timed(cmd, env, args.repo)
        times, jobs = [], []
        CPU_S.clear()
        for _ in range(args.repeats):
            dt, res = timed(cmd, env, args.repo)
            times.append(dt)
            if name == "multirun":
                jobs.append(job_times(args.runs_dir))
        out[name] = {
            "command": " ".join(["python", "-m", "sparse_eval", *cmd[3:]]),
            "repo": str(args.repo),
            "first_launch_s": round(first, 2),
            "relaunch_s": [round(t, 2) for t in times],
            "median_s": round(statistics.median(times), 2),
            "cpu_s": [round(c, 2) for c in CPU_S],
            "median_cpu_s": round(statistics.median(CPU_S), 2),
        }
        if jobs:
            out[name]["job_s_after_imports"] = [[round(t, 3) for t in j] for j in jobs]
            out[name]["max_job_s"] = round(max(max(j) for j in jobs), 3)
        if name == "default":
            out[name]["reuse_line"] = next((l for l in res.stdout.splitlines() if l.startswith("results:")), "")
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
