"""How many rows a decode batch can hold on a machine, and how many CPU threads MagicPIG's host part gets.

The system path keeps each method's caches where its paper puts them: full attention, Double Sparsity and Quest on
the GPU; DS-Offload's KV and MagicPIG's KV and hash tables in host memory (the dense layers and MagicPIG's static
sink/local rows stay on the GPU).  The largest batch is therefore bounded by GPU memory for the first group and
by host memory for the offloaded ones; this module computes the bytes per row of each and the batch that fits.
``benchmarks/bench_system_decode.py`` plans its runs with it (``--plan-only`` prints the plan without a GPU).

Bytes per row, context ``n`` = prompt + decode steps, ``hkv`` KV heads of dim ``d``, bf16: each dense layer's KV
cache, 2 · hkv · d · 2 · n, on the GPU, and in each sparse layer what its layer kind keeps where, by its own
``row_bytes`` (``system.layers``: Quest's page metadata, DS's label cache, MagicPIG's hash tables in host memory).
"""

from __future__ import annotations

import os
from typing import Any

GiB = 1 << 30


def host_memory_available() -> float:
    """MemAvailable of /proc/meminfo in bytes, within the cgroup's limit (16 GiB where neither can be read): the
    accuracy path's estimate reads the same (``sparse_eval.run.memory.host_memory_available``)."""
    from ..run.memory import host_memory_available as available

    return available()


def host_threads() -> int:
    """The CPU cores this process may run on (its affinity mask), the thread count of MagicPIG's host part."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 1


def weight_bytes(shape: dict[str, Any], num_layers: int | None = None, bytes_per_param: int = 2) -> int:
    """Parameter bytes of a Llama-architecture model of ``shape`` (``system.models.SHAPES``), counted on the meta
    device (nothing allocated)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = dict(shape)
    if num_layers is not None:
        kw["num_hidden_layers"] = int(num_layers)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**kw))
    return sum(p.numel() for p in model.parameters()) * bytes_per_param


def bytes_per_row(
    cfg: dict[str, Any], context: int, steps: int, shape: dict[str, Any], num_layers: int
) -> tuple[int, int]:
    """(GPU bytes, host bytes) of one row's caches for the method config ``cfg`` (with its ``name``) at ``context``
    prompt tokens plus ``steps`` decode steps: the dense layers' KV caches on the GPU (every layer of a dense method)
    and, in each sparse layer, what its layer kind keeps where (``FullLayer.row_bytes`` and its overrides)."""
    from ..methods import is_dense
    from .layers import FullLayer, layer_class

    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    n = context + steps
    dense = num_layers if is_dense(cfg["name"]) else len(set(cfg.get("dense_layers", [])))
    sparse = num_layers - dense
    gpu, cpu = dense * FullLayer.row_bytes(cfg, n, steps, hkv, d)[0], 0
    if sparse:
        g, c = layer_class(cfg["name"]).variant(cfg).row_bytes(cfg, n, steps, hkv, d)
        gpu, cpu = gpu + sparse * g, cpu + sparse * c
    return int(gpu), int(cpu)


def plan_batch(
    cfg: dict[str, Any],
    context: int,
    steps: int,
    shape: dict[str, Any],
    num_layers: int,
    gpu_free: float,
    cpu_free: float,
    max_batch: int,
) -> tuple[int, dict[str, int]]:
    """The largest batch (at most ``max_batch``) whose caches fit ``gpu_free`` and ``cpu_free`` bytes, with the
    bytes per row and the batch each memory alone would allow."""
    gpu, cpu = bytes_per_row(cfg, context, steps, shape, num_layers)
    b_gpu = int(gpu_free // gpu) if gpu else max_batch
    b_cpu = int(cpu_free // cpu) if cpu else max_batch
    return max(0, min(max_batch, b_gpu, b_cpu)), {
        "gpu_bytes_per_row": gpu,
        "cpu_bytes_per_row": cpu,
        "fit_gpu": b_gpu,
        "fit_cpu": b_cpu,
    }
