"""benchmarks/bench_accuracy_path.py on the shipped model: the record it writes, and that --batch-invariant times the
plug-in's methods in the batch-invariant mode (and stock transformers outside it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_accuracy_path as bench  # noqa: E402


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / ("inv" if extra else "plain")
    argv = ["--model", "stories260k", "--context", "64", "--batch", "2", "--steps", "2", "--repeats", "1"]
    assert bench.main([*argv, "--methods", "stock,full,topk", "--profile", "--out", str(out), *extra]) == 0
    return json.loads((out / "accuracy_path_stories260k_64_b2.json").read_text())


def test_batch_invariant_times_the_methods_in_that_mode_and_stock_outside_it(tmp_path):
    plain, inv = _run(tmp_path), _run(tmp_path, "--batch-invariant")
    assert plain["batch_invariant"] is False and inv["batch_invariant"] is True
    ops = {
        (rec["batch_invariant"], r["method"], r["est_error_on"]): r["aten_ops_per_step"]
        for rec in (plain, inv)
        for r in rec["rows"]
    }
    # the invariant kernels replace the products and reductions: other operators per step for the methods
    assert ops[(True, "full", True)] != ops[(False, "full", True)]
    assert ops[(True, "topk", False)] != ops[(False, "topk", False)]
    assert ops[(True, "stock", False)] == ops[(False, "stock", False)]  # stock is always plain
    for rec in (plain, inv):
        assert {r["method"] for r in rec["rows"]} == {"stock", "full", "topk"}
        assert all(r["ms_per_step"] > 0 and r["first_step_ms"] > 0 for r in rec["rows"])
