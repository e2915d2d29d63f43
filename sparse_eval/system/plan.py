"""How many rows a decode batch can hold on a machine, and how many CPU threads MagicPIG's host part gets.

The system path keeps each method's caches where its paper puts them: full attention, Double Sparsity and Quest on
the GPU; DS-Offload's KV and MagicPIG's KV and hash tables in host memory (the dense layers and MagicPIG's static
sink/local rows stay on the GPU).  The largest batch is therefore bounded by GPU memory for the first group and
by host memory for the offloaded ones; this module computes the bytes per row of each and the batch that fits.
``benchmarks/bench_system_decode.py`` plans its runs with it (``--plan-only`` prints the plan without a GPU).

Bytes per row, context ``n`` = prompt + decode steps, ``hkv`` KV heads of dim ``d``, bf16:
    KV per layer          2 · hkv · d · 2 · n
    Quest page metadata   2 · hkv · d · 2 · ceil(n / page)        (min and max per page, sparse layers)
    DS labels             hkv · n · (r / 2 + 4)                   (4-bit codes of r = α·d channels + fp16 scale/zero)
    MagicPIG tables       hkv · L · (4 n + 4 (2^K + 1) + 2 n)      (key ids sorted by code, bucket offsets, codes)
    MagicPIG GPU part     2 · hkv · d · 2 · (local + steps + sink) (the static rows, sparse layers)
"""

from __future__ import annotations

import os
from typing import Any

GiB = 1 << 30


def host_memory_available() -> float:
    """MemAvailable of /proc/meminfo in bytes, within the cgroup's limit (16 GiB where neither can be read): the
    accuracy path's estimate reads the same (``sparse_eval.memory.host_memory_available``)."""
    from ..memory import host_memory_available as available

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


def bytes_per_row(name: str, cfg: dict[str, Any], context: int, steps: int, shape: dict[str, Any],
                  num_layers: int) -> tuple[int, int]:
    """(GPU bytes, host bytes) of one row's caches for method ``name`` (full, ds, ds_offload, quest or
    magicpig_<K>_<L>) with settings ``cfg`` at ``context`` prompt tokens plus ``steps`` decode steps."""
    hkv, d = shape["num_key_value_heads"], shape["head_dim"]
    n = context + steps
    kv_layer = 2 * hkv * d * 2 * n
    dense = set(range(num_layers)) if name == "full" else set(cfg.get("dense_layers", []))
    sparse = num_layers - len(dense)
    on_gpu = name in ("full", "ds", "quest")
    gpu = num_layers * kv_layer if on_gpu else len(dense) * kv_layer
    cpu = 0 if on_gpu else sparse * kv_layer
    if name == "quest":
        gpu += sparse * 2 * hkv * d * 2 * (-(-n // cfg["page_size"]))
    if name in ("ds", "ds_offload"):
        r = int(cfg.get("alpha", 0.25) * d)
        gpu += sparse * hkv * n * (r // 2 + 4)
    if name.startswith("magicpig"):
        cpu += sparse * hkv * cfg["L"] * (4 * n + 4 * ((1 << cfg["K"]) + 1) + 2 * n)
        gpu += sparse * 2 * hkv * d * 2 * (cfg.get("local", 64) + steps + cfg.get("sink", 4))
    return int(gpu), int(cpu)


def plan_batch(name: str, cfg: dict[str, Any], context: int, steps: int, shape: dict[str, Any], num_layers: int,
               gpu_free: float, cpu_free: float, max_batch: int) -> tuple[int, dict[str, int]]:
    """The largest batch (at most ``max_batch``) whose caches fit ``gpu_free`` and ``cpu_free`` bytes, with the
    bytes per row and the batch each memory alone would allow."""
    gpu, cpu = bytes_per_row(name, cfg, context, steps, shape, num_layers)
    b_gpu = int(gpu_free // gpu) if gpu else max_batch
    b_cpu = int(cpu_free // cpu) if cpu else max_batch
    return max(0, min(max_batch, b_gpu, b_cpu)), {"gpu_bytes_per_row": gpu, "cpu_bytes_per_row": cpu,
                                                  "fit_gpu": b_gpu, "fit_cpu": b_cpu}
