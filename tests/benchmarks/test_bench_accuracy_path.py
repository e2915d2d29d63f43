"""benchmarks/bench_accuracy_path.py on the shipped model: the record it writes, and that --batch-invariant times the
plug-in's methods in the batch-invariant mode (and stock transformers outside it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import bench_accuracy_path as bench  # noqa: E402


def _run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / ("inv" if extra else "plain")
    argv = ["--model", "stories260k", "--context", "64", "--batch", "2", "--steps", "2", "--repeats", "1"]
    methods = ["--methods", "stock,full,topk", "--fused", "off"]
    assert bench.main([*argv, *methods, "--profile", "--out", str(out), *extra]) == 0
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
        # where the time goes: the accuracy path's spans (sparse_eval.spans), the error's only when it is on
        spans = {(r["method"], r["est_error_on"]): r["span_host_ms_per_step"] for r in rec["rows"]}
        assert spans[("stock", False)] == {}
        every = {"prepare", "masks", "scores", "select", "attend", "stats", "record", "error"}
        assert set(spans[("topk", True)]) == every
        assert "error" not in spans[("topk", False)] and "select" in spans[("topk", False)]
        assert set(spans[("full", True)]) == {"attend", "record"}


@pytest.mark.slow  # 70 s on 2 cores (the kernel in the interpreter); fused vs unfused: test_method_contract
def test_fused_both_times_each_method_with_and_without_the_kernel(tmp_path, monkeypatch):
    """``--fused both`` (the default): a method that declares ``Method.fused_attention`` is timed with the fused kernel
    (row ``name [fused]``) and without, in one process and one round-robin, each with its ratio to full attention;
    full attention (dense) and stock once.  Without CUDA the kernel runs in Triton's interpreter (splits of 64 keys
    here, for speed)."""
    pytest.importorskip("triton")
    import os

    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("no CUDA and no TRITON_INTERPRET=1")
        from sparse_eval.kernels import selected_attention

        monkeypatch.setattr(selected_attention, "SPLIT", 64)
    argv = ["--model", "stories260k", "--context", "48", "--batch", "2", "--steps", "1", "--repeats", "1"]
    assert bench.main([*argv, "--methods", "stock,full,topk", "--batch-invariant", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "accuracy_path_stories260k_48_b2.json").read_text())
    assert rec["fused"] == "both" and rec["batch_invariant"] is True
    rows = {(r["method"], r["est_error_on"]): r for r in rec["rows"]}
    assert set(rows) == {("stock", False)} | {(m, e) for m in ("full", "topk", "topk [fused]") for e in (True, False)}
    assert rows[("topk [fused]", True)]["fused_attention"] and not rows[("topk", True)]["fused_attention"]
    assert not rows[("full", True)]["fused_attention"]  # a dense method makes no sparse call
    for err in (True, False):  # the same selections: the same kept share; est_error to fp32 rounding
        a, b = rows[("topk [fused]", err)], rows[("topk", err)]
        assert a["cost2"] == pytest.approx(b["cost2"]) and a["ratio_vs_full"] > 0
    assert rows[("topk [fused]", True)]["est_error"] == pytest.approx(rows[("topk", True)]["est_error"], rel=1e-4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_capture_without_a_gpu_is_refused_at_start(tmp_path):
    with pytest.raises(SystemExit, match="--capture needs a CUDA device"):
        bench.main(["--capture", "--methods", "full", "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())  # refused before anything ran or was written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (CUDA graphs)")
def test_a_step_without_host_syncs_is_captured_and_one_with_them_says_why(tmp_path):
    """On the GPU: every plug-in method whose steady step waits for the device less than once per step (the
    profiler's census; the benchmark's own closing sync is a fraction of one) replays from a CUDA graph, and a
    method whose step waits (MagicPIG's gathered pairs) is reported as not capturable, with the reason."""
    argv = ["--model", "stories260k", "--context", "256", "--batch", "2", "--steps", "4", "--repeats", "1"]
    methods = "full,topk,oracle,quest,double_sparsity,magicpig"
    assert bench.main([*argv, "--methods", methods, "--profile", "--capture", "--out", str(tmp_path)]) == 0
    rec = json.loads((tmp_path / "accuracy_path_stories260k_256_b2.json").read_text())
    for r in rec["rows"]:
        if r["host_syncs_per_step"] < 1:
            assert r.get("captured_ms_per_step", 0) > 0, r
        else:
            assert r["captured"].startswith("not capturable"), r
    # nothing left behind by a step that could not be captured: the CUDA generator draws outside a graph again
    # (a capture that fails midway leaves it marked as capturing, and the next draw fails)
    torch.randn(3, device="cuda")


def test_time_limit_writes_the_repeats_it_finished(tmp_path, capsys):
    """--time-limit: a repeat that would end past the limit does not start, the profile is skipped likewise, and the
    record holds the repeats done (so a device call with a hard limit still leaves its figures)."""
    out = tmp_path / "limited"
    argv = ["--model", "stories260k", "--context", "64", "--batch", "1", "--steps", "2", "--repeats", "4"]
    extra = ["--methods", "full,topk", "--fused", "off", "--profile", "--time-limit", "0.001", "--out", str(out)]
    assert bench.main([*argv, *extra]) == 0
    rec = json.loads((out / "accuracy_path_stories260k_64_b1.json").read_text())
    assert rec["repeats_done"] == 1 and rec["args"]["repeats"] == 4
    assert all(len(r["all_ms"]) == 1 and "aten_ops_per_step" not in r for r in rec["rows"])  # no profile
    text = capsys.readouterr().out
    assert "stopping after 1 repeats" in text and "--profile skipped" in text and "medians of 1" in text


def test_device_work_leaves_out_the_spans_device_ranges():
    """A span's device-side range (its kernels' first start to last end) is not work of its own: counted, it would
    count its kernels twice (as the first profiles on an H100 did: busy time above the step's wall time)."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    events = [
        SimpleNamespace(name=f"{bench.SPAN_PREFIX}select", device_type=cuda),
        SimpleNamespace(name="_mask_split", device_type=cuda),
        SimpleNamespace(name="Memcpy DtoD (Device -> Device)", device_type=cuda),
        SimpleNamespace(name=f"{bench.SPAN_PREFIX}select", device_type=cpu),
        SimpleNamespace(name="aten::mm", device_type=cpu),
    ]
    assert [e.name for e in bench.device_work(events)] == ["_mask_split", "Memcpy DtoD (Device -> Device)"]


def test_invariant_gemm_bench_runs_its_candidates_and_restores_the_shipped_config(tmp_path):
    """benchmarks/bench_invariant_gemm.py (small shapes in the interpreter without a GPU): every candidate tile shape
    gives the product, the record is written, and the shipped configuration is back afterwards."""
    import bench_invariant_gemm as gemm

    from sparse_eval.kernels import _tl_invariant as tli

    shipped = dict(tli._MM_CONFIG)
    assert gemm.main(["--out", str(tmp_path)]) == 0
    assert tli._MM_CONFIG == shipped
    rec = json.loads((tmp_path / "invariant_gemm_rows8.json").read_text())
    kernels = [r for r in rec["rows"] if r["kernel"].startswith("invariant")]
    assert len(kernels) == sum(len(v) for v in gemm.CANDIDATES.values())
    assert sum("shipped" in r["kernel"] for r in kernels) == 2
