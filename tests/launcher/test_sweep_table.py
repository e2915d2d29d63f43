"""A multirun ends with one table of all its jobs' runs (``sweep.SweepReport``), not only each job's own."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _multirun(tmp_path, *args):
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        WANDB_MODE="disabled",
        SPARSE_EVAL_RUNS_DIR=str(tmp_path / "runs"),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    res = subprocess.run(
        [sys.executable, "-m", "sparse_eval", "-m", *args, "task.num_samples=2", "task.window=64"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout


def test_a_multirun_ends_with_one_table_of_its_runs(tmp_path, capsys):
    from sparse_eval.launcher.sweep import print_sweep_table

    out = _multirun(tmp_path, "method=full,topk")
    combined = out.split("the sweep's 2 runs", 1)[1]  # after both jobs' own tables
    assert "full " in combined and "topk budget=0.06" in combined and "vs full [95% CI]" in combined
    # a sweep of one method is compared with the full-attention run found beside its runs
    topk = [str(p) for p in (tmp_path / "runs").glob("wikitext/*/topk-*")]
    print_sweep_table([{"status": "ok", "run_dirs": topk}])
    combined = capsys.readouterr().out.split("the sweep's run, with the full-attention run found beside it")[1]
    assert "topk budget=0.06" in combined and "+0 [0, 0]" in combined and "\nfull " in combined
