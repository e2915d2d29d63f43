"""Memory a run needs, estimated before it starts: the batch ``eval.batch_size=auto`` may take on the CPU, and the
settings whose tables cannot fit at all.

On a GPU, ``auto`` starts at min(samples, 128) rows and halves on CUDA's out-of-memory error.  On the CPU there is
no such error to catch: the kernel kills the process (exit 137, no message) long before an allocation fails.  So
on the CPU the batch is sized up front, from an estimate of the bytes one row needs against the memory this
machine has available (``host_memory_available``: MemAvailable, within the cgroup's limit), and a run that cannot
fit even one row, or an explicit ``eval.batch_size`` that does not fit, is refused before anything is written.
A MagicPIG setting whose hash tables and projections cannot fit one row in the memory of the model's device
(e.g. ``method.L=100000000``) is refused on any device.

Bytes of one row (one sample of a padded batch) on the accuracy path, ``N`` = prompt + generated tokens, ``T`` =
tokens per prefill forward (``eval.prefill_chunk`` or the whole prompt), e = the model dtype's element size:

    KV cache               layers · 2 · Hkv · D · N · e
    forward activations    T · (4·hidden + Hq·D + 2·Hkv·D + 4·intermediate) · 4
    attention mask         T · N                                    (bool)
    logits                 T · vocab · 4 · 2 for a log-likelihood (logits and log-softmax); vocab · 4 otherwise
    layer inputs           layers · T · hidden · e                  (sparse methods keep each layer's input)
    sparse blocks          Hq · Q · N · 4 · 8                       (Q query rows per sparse call: min(query_chunk,
                                                                     T) while the prompt is sparse, else 1)
    method index           the method's own estimate (``Method.index_memory``), e.g. MagicPIG: sparse layers ·
                           Hkv · N · L · code bytes · 2 (the codes, grown geometrically) and, where rows build the
                           index (protocols S, B), Hkv · N · K·L bytes; Quest: sparse layers · Hkv · ⌈N/page⌉ · 2 ·
                           D · 4; DS: sparse layers · Hq · N · r · 4 · 2

times ``SAFETY``.  Measured peaks (VmHWM above the loaded model, 2026-12-02) of SmolLM2-135M-Instruct on RULER
niah_single_1 at 4K (3,962 prompt tokens + 128 generated, noise haystack), fp32 on the 2-core dev machine, against
this estimate: full attention 299 MiB (one row) and 403 MiB per row (4 rows), estimate 439; TopK 559 MiB, estimate
780; MagicPIG (10,150) 558 MiB (one row) and 685 MiB per row (2 rows), estimate 1,035.  A run plans with
``HOST_FRACTION`` of the available memory, leaving the rest to the machine's other processes.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from ..methods.registry import METHODS, is_dense
from .run_spec import RunSpec

log = logging.getLogger("sparse_eval")

GiB = float(1 << 30)
SAFETY = 1.3  # the estimate's margin over the measured peaks (see the module docstring)
HOST_FRACTION = 0.8  # of the available host memory a run plans to use
SPARSE_BLOCK_TENSORS = 8  # float32 [Hq, Q, N] tensors alive in one sparse call (scores, keep, bias, softmax, error)


def _cgroup_room() -> float | None:
    """Bytes the cgroup of this process may still allocate (v2 memory.max − memory.current, or v1), None without
    a limit."""
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            lim = Path(limit).read_text().strip()
            used = float(Path(usage).read_text().strip())
        except (OSError, ValueError):
            continue
        if lim == "max" or not lim.isdigit() or float(lim) >= 1 << 60:
            return None
        return max(0.0, float(lim) - used)
    return None


def host_memory_available() -> float:
    """Bytes this process may still allocate on the host: /proc/meminfo's MemAvailable, within the cgroup's
    limit when there is one (16 GiB where neither can be read)."""
    avail = None
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                avail = float(line.split()[1]) * 1024
                break
    except OSError:
        pass
    room = _cgroup_room()
    if avail is None and room is None:
        return 16.0 * GiB
    return min(x for x in (avail, room) if x is not None)


def device_memory_available(device: Any) -> float:
    """Free bytes of ``device`` (a torch device): the GPU's free memory, or the host's."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        free, _ = torch.cuda.mem_get_info(dev)
        return float(free)
    return host_memory_available()


def gb(x: float) -> str:
    return f"{x / GiB:.1f} GiB" if x >= 0.1 * GiB else f"{x / (1 << 20):.0f} MiB"


@dataclass
class Shape:
    """What the estimate needs of a model: its text config's sizes and the element size of its dtype."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    elem: int = 4

    @classmethod
    def from_config(cls, config: Any, elem: int = 4) -> "Shape":
        from ..models.inspection import head_shape

        cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
        hs = head_shape(cfg)
        hidden = int(cfg.hidden_size)
        return cls(
            layers=hs.layers,
            heads=hs.heads,
            kv_heads=hs.kv_heads,
            head_dim=hs.head_dim,
            hidden=hidden,
            intermediate=int(getattr(cfg, "intermediate_size", None) or 4 * hidden),
            vocab=int(getattr(cfg, "vocab_size", 0) or 0),
            elem=int(elem),
        )

    @classmethod
    def of(cls, model: Any) -> "Shape":
        p = next(model.parameters())
        return cls.from_config(model.config, p.element_size())


def _plain(method: Any) -> dict[str, Any]:
    return dataclasses.asdict(method) if dataclasses.is_dataclass(method) else dict(method)


def _sparse_layers(method: dict[str, Any], layers: int) -> int:
    from ..methods.base import resolve_dense_layers

    if is_dense(method.get("name")):
        return 0
    try:
        return layers - len(resolve_dense_layers(method.get("dense_layers", []), layers))
    except ValueError:
        return layers


def index_bytes(method: Any, shape: Shape, n: int, building_rows: bool = False) -> dict[str, int]:
    """Bytes of one row's method index over ``n`` keys (all sparse layers), by part: the method's own estimate
    (``Method.index_memory``; its ``shared_index_parts``, e.g. MagicPIG's projections, are allocated once per
    run)."""
    m = _plain(method)
    cls = METHODS.get(m.get("name"))
    if cls is None:
        return {}
    return cls.index_memory(m, shape, n, _sparse_layers(m, shape.layers), building_rows=building_rows)


def _shared_parts(method: dict[str, Any]) -> tuple[str, ...]:
    cls = METHODS.get(method.get("name"))
    return cls.shared_index_parts if cls is not None else ()


def row_bytes(
    shape: Shape,
    method: Any,
    *,
    prompt: int,
    new_tokens: int = 0,
    loglik: bool = False,
    protocol: str = "A",
    query_chunk: int = 512,
    prefill_chunk: int | None = None,
) -> dict[str, int]:
    """The estimate of one row's bytes on the accuracy path, by part (see the module docstring; ``SAFETY`` not
    applied)."""
    m = _plain(method)
    n = int(prompt) + int(new_tokens)
    t = min(int(prompt), int(prefill_chunk)) if prefill_chunk else int(prompt)
    dense_method = is_dense(m.get("name"))
    s = shape
    parts = {
        "KV cache": s.layers * 2 * s.kv_heads * s.head_dim * n * s.elem,
        "activations": t * (4 * s.hidden + s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 4 * s.intermediate) * 4,
        "attention mask": t * n,
        "logits": (t * s.vocab * 4 * 2) if loglik else s.vocab * 4,
    }
    if not dense_method:
        prompt_sparse = protocol in ("S", "B")
        q = min(int(query_chunk), t) if prompt_sparse else 1
        parts["layer inputs"] = s.layers * t * s.hidden * s.elem
        parts["sparse blocks"] = s.heads * q * n * 4 * SPARSE_BLOCK_TENSORS
        idx = index_bytes(m, s, n, building_rows=prompt_sparse)
        parts.update({k: v for k, v in idx.items() if k not in _shared_parts(m)})  # shared: ``fixed_bytes``
    return {k: int(v) for k, v in parts.items()}


def fixed_bytes(shape: Shape, method: Any) -> int:
    """Bytes a run allocates once, whatever its batch: the method's shared index parts (MagicPIG's projection
    matrices)."""
    m = _plain(method)
    return int(sum(v for k, v in index_bytes(m, shape, 0).items() if k in _shared_parts(m)))


# -- a run's samples ---------------------------------------------------------------------------------------------


def _work(task: Any, sample: Any) -> tuple[int, int, bool]:
    """(prompt tokens, new tokens, log-likelihood?) of one sample."""
    from ..generation.engine import LoglikelihoodRequest
    from .estimate import sample_tokens

    try:
        req = task.request(sample)
    except NotImplementedError:  # a task that runs its own requests (lm-eval): its prompt, generation unknown
        return sample_tokens(sample), 0, False
    return len(req.input_ids), int(getattr(req, "max_new_tokens", 0) or 0), isinstance(req, LoglikelihoodRequest)


def run_row_bytes(spec: RunSpec, method: Any, samples: Sequence[Any]) -> tuple[float, int]:
    """(estimated bytes of the largest row among ``samples``, with ``SAFETY``; its tokens) for the run's model,
    protocol and settings."""
    shape = Shape.of(spec.model)
    ev = spec.eval
    best, tokens = 0.0, 0
    seen: set[tuple[int, int, bool]] = set()
    for s in samples:
        work = _work(spec.task, s)
        if work in seen:
            continue
        seen.add(work)
        parts = row_bytes(
            shape,
            method,
            prompt=work[0],
            new_tokens=work[1],
            loglik=work[2],
            protocol=spec.protocol,
            query_chunk=int(ev.query_chunk),
            prefill_chunk=ev.prefill_chunk,
        )
        total = sum(parts.values()) * SAFETY
        if total > best:
            best, tokens = total, work[0] + work[1]
    return best, tokens


def _device(spec: RunSpec):
    """The run's device: the model's (``model.device_map``: its input embeddings' execution device)."""
    from ..models.placement import main_device

    return main_device(spec.model)


def check_index_fits(method: Any, shape: Shape, n: int, device: Any, building_rows: bool = False) -> None:
    """Refuses a setting of a method whose index can outgrow any device by its options (``Method.index_may_not_fit``:
    MagicPIG) when the index of one row of ``n`` keys (``index_bytes``: MagicPIG's hash codes, projections drawn
    on the host, the hashing of one key) cannot fit the free memory of ``device`` (and its shared parts the
    host's), e.g. ``method.L=100000000``.  Other methods' indexes grow with the batch only (``row_bytes``)."""
    import torch

    m = _plain(method)
    cls = METHODS.get(m.get("name"))
    if cls is None or not cls.index_may_not_fit:
        return
    parts = index_bytes(m, shape, n, building_rows=building_rows)
    need = sum(parts.values())
    shared = sum(v for k, v in parts.items() if k in cls.shared_index_parts)
    dev = torch.device(device)
    room = device_memory_available(dev)
    if need > room or shared > host_memory_available():
        where = "this machine's" if dev.type == "cpu" else f"{dev}'s"
        detail = ", ".join(f"{k} {gb(v)}" for k, v in parts.items() if v >= 1 << 20)
        raise ValueError(
            cls.index_too_large(
                m, f"for one sample of {n} tokens need ~{gb(need)} ({detail}), more than {where} {gb(room)} available"
            )
        )


def check_tables(spec: RunSpec, method: Any, samples: Sequence[Any]) -> None:
    """``check_index_fits`` for the longest of ``samples`` on the run's model and device."""
    cls = METHODS.get(_plain(method).get("name"))
    if cls is None or not cls.index_may_not_fit or not samples:
        return
    n = max(sum(_work(spec.task, s)[:2]) for s in samples)
    check_index_fits(method, Shape.of(spec.model), n, _device(spec), building_rows=spec.protocol in ("S", "B"))


def check_batch(spec: RunSpec, methods: Sequence[Any], samples: Sequence[Any]) -> None:
    """At start, on the CPU: refuses a run whose one row (its longest sample) does not fit the available host
    memory, or whose explicit ``eval.batch_size`` does not; names the batch that fits.  (On a GPU, ``auto``
    halves on out-of-memory instead.)"""
    for m in methods:
        check_tables(spec, m, samples)
    if _device(spec).type != "cpu" or not samples:
        return
    budget = HOST_FRACTION * host_memory_available()
    for m in methods:
        per_row, tokens = run_row_bytes(spec, m, samples)
        room = budget - fixed_bytes(Shape.of(spec.model), m)
        name = _plain(m).get("name")
        if per_row > room:
            raise ValueError(
                f"one sample of {tokens} tokens needs ~{gb(per_row)} of memory with method={name} (estimate: KV cache, "
                f"activations, the method's index); this machine has {gb(host_memory_available())} available (a run "
                f"plans with {HOST_FRACTION:.0%}); lower task.length or run it on a GPU"
            )
        want = spec.batch_size
        if isinstance(want, int) and want > 1 and spec.task.batched:
            rows = min(want, len(samples))
            if rows * per_row > room:
                fit = max(1, int(room // per_row))
                raise ValueError(
                    f"eval.batch_size={want}: {rows} rows of up to {tokens} tokens need ~{gb(rows * per_row)} with "
                    f"method={name} (~{gb(per_row)} per row); this machine has {gb(host_memory_available())} "
                    f"available; give eval.batch_size={fit} or eval.batch_size=auto (it sizes itself to the memory)"
                )


def auto_batch_cap(spec: RunSpec, method: Any, todo: Sequence[Any], size: int) -> int:
    """``eval.batch_size=auto``'s first batch on the CPU: ``size`` (min(samples, 128)) capped by the rows whose
    estimated memory fits ``HOST_FRACTION`` of the available host memory (at least 1); ``size`` elsewhere."""
    if size <= 1 or _device(spec).type != "cpu" or not todo:
        return size
    per_row, tokens = run_row_bytes(spec, method, todo)
    room = HOST_FRACTION * host_memory_available() - fixed_bytes(Shape.of(spec.model), method)
    fit = max(1, int(room // per_row)) if per_row > 0 else size
    if fit < size:
        log.info(
            "eval.batch_size=auto: %d rows (~%s each at %d tokens) fit in %s of the %s of host memory "
            "available; batches of %d",
            fit,
            gb(per_row),
            tokens,
            gb(room),
            gb(host_memory_available()),
            fit,
        )
    return min(size, fit)
