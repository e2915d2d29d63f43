"""The system path's batch planning (sparse_eval.system.plan): bytes per row, the batch each memory allows, threads."""

import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

from sparse_eval.system.models import SHAPES
from sparse_eval.system.plan import GiB, bytes_per_row, host_threads, plan_batch, weight_bytes

REPO = Path(__file__).resolve().parents[2]
SHAPE = dict(num_key_value_heads=2, head_dim=8, num_hidden_layers=4)


def test_full_attention_keeps_every_layer_kv_on_the_gpu():
    gpu, cpu = bytes_per_row({"name": "full"}, 100, 4, SHAPE, 4)
    assert (gpu, cpu) == (4 * 2 * 2 * 8 * 2 * 104, 0)


def test_magicpig_keeps_sparse_layers_and_tables_on_the_host():
    cfg = {"name": "magicpig", "K": 3, "L": 5, "dense_layers": [0]}
    gpu, cpu = bytes_per_row(cfg, 100, 4, SHAPE, 4)
    kv = 2 * 2 * 8 * 2 * 104
    assert cpu == 3 * kv + 3 * 2 * 5 * (4 * 104 + 4 * (2**3 + 1) + 2 * 104)
    assert gpu == kv + 3 * 2 * 2 * 8 * 2 * (64 + 4 + 4)  # the dense layer + sink/local/steps of the sparse ones


def test_batch_is_bounded_by_the_memory_each_method_uses():
    full = {"name": "full"}
    pig = {"name": "magicpig", "K": 10, "L": 150, "dense_layers": [0, 16]}
    shape, n = SHAPES["llama3_1_8b"], 32
    b_full, p_full = plan_batch(full, 98304, 12, shape, n, 100 * GiB, 1000 * GiB, 256)
    assert b_full == p_full["fit_gpu"] < p_full["fit_cpu"]
    small, p_small = plan_batch(pig, 98304, 12, shape, n, 100 * GiB, 100 * GiB, 256)
    big, _ = plan_batch(pig, 98304, 12, shape, n, 100 * GiB, 400 * GiB, 256)
    assert small == p_small["fit_cpu"] < p_small["fit_gpu"] and big > small
    assert plan_batch(full, 98304, 12, shape, n, 1.0, 1.0, 256)[0] == 0  # not one row: 0, never negative
    assert plan_batch(full, 10, 1, SHAPE, 4, 1e12, 1e12, 7)[0] == 7  # max_batch caps it


def test_each_layer_kind_places_its_own_caches():
    """Quest and DS keep their metadata beside a GPU KV cache; DS-Offload (``offload``) moves the KV cache to the
    host and keeps the label cache on the GPU: each by its layer kind's ``row_bytes``, not by name here."""
    kv = 2 * 2 * 8 * 2 * 104
    quest = {"name": "quest", "page_size": 16, "dense_layers": [0]}
    assert bytes_per_row(quest, 100, 4, SHAPE, 4) == (4 * kv + 3 * 2 * 2 * 8 * 2 * 7, 0)
    ds = {"name": "double_sparsity", "alpha": 0.25, "dense_layers": [0, 1]}
    labels = 2 * 104 * (2 // 2 + 4)  # r = 0.25 · 8 = 2 channels
    assert bytes_per_row(ds, 100, 4, SHAPE, 4) == (4 * kv + 2 * labels, 0)
    assert bytes_per_row({**ds, "offload": True}, 100, 4, SHAPE, 4) == (2 * kv + 2 * labels, 2 * kv)


def test_weight_bytes_of_the_llama_8b_shape():
    assert abs(weight_bytes(SHAPES["llama3_1_8b"]) / 2 - 8.03e9) < 0.01e9


def test_threads_are_the_cores_this_process_may_use():
    n = host_threads()
    assert 1 <= n <= (os.cpu_count() or 1)
    if hasattr(os, "sched_getaffinity"):
        assert n == len(os.sched_getaffinity(0))


def _bench():
    sys.path.insert(0, str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_system_decode", REPO / "benchmarks/bench_system_decode.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_plan_only_runs_without_a_gpu(capsys):
    bench = _bench()
    args = [
        "--plan-only",
        "--contexts",
        "98304",
        "--methods",
        "full_graph,magicpig_10_150_graph",
        "--cpu-budget-gib",
        "300",
    ]
    assert bench.main(args + ["--gpu-gib", "139"]) == 0
    out = capsys.readouterr().out
    rows = {l.split()[1]: int(l.split()[2]) for l in out.splitlines() if l.strip().startswith("98304")}
    assert rows["full_graph"] >= 1 and rows["magicpig_10_150_graph"] >= 1
    with pytest.raises(SystemExit, match="--gpu-gib"):
        bench.main(args)
