"""benchmarks/bench_eval_throughput.py at CPU size: methods through the runner, batched, beside stock generate."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_eval_throughput as bench  # noqa: E402

# stories260K's 512-token context fits RULER's fwe (and the niah_single tasks), not all 13
CPU_SIZE = [
    "--model",
    "stories260k",
    "--samples",
    "2",
    "--length",
    "512",
    "--subtasks",
    "fwe",
    "--haystack",
    "noise",
    "--batch-size",
    "2",
]


def _check(out, methods):
    res = json.loads((out / "eval_throughput.json").read_text())
    assert [r["method"] for r in res["methods"]] == list(methods)
    for r in res["methods"]:
        assert r["samples"] == 2 and r["failed"] == 0 and r["batch_size"] == 2
        assert r["wall_s"] > 0 and r["samples_per_s"] == r["samples"] / r["wall_s"]
    assert res["baseline"]["samples"] == 2 and res["baseline"]["batch_size"] == 2 and res["baseline"]["wall_s"] > 0
    assert res["task"]["total_samples"] == 2 and res["provenance"]["versions"]
    md = (out / "eval_throughput.md").read_text()
    assert "| stock generate (sdpa) |" in md and "samples/s" in md
    return res


def test_throughput_benchmark_runs_at_cpu_size(tmp_path):
    bench.main([*CPU_SIZE, "--methods", "full,topk", "--out", str(tmp_path)])
    _check(tmp_path, ["full", "topk"])


@pytest.mark.slow
def test_throughput_benchmark_six_methods(tmp_path):
    bench.main([*CPU_SIZE, "--out", str(tmp_path)])
    res = _check(tmp_path, bench.METHODS)
    magicpig = next(r for r in res["methods"] if r["method"] == "magicpig")
    summary = json.loads((Path(magicpig["run_dir"]) / "summary.json").read_text())
    assert summary["dense_layers"] == [0, 2]  # MagicPIG's [0, mid] resolved for the 5-layer model
