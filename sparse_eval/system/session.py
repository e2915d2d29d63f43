"""The system path's session: the cache layers of one generation attached to a transformers model.

``build_layers`` makes one cache layer per decoder layer (the method's dense layers get a ``FullLayer``, the others
the layer registered under the method's name, ``layers.registry``); ``SystemSession`` holds them with DS-Offload's
side stream and buffers and the run's counters; ``attach`` routes the model's attention through a session.  The
model code is transformers' own (linear layers, norms, RoPE, on the GPU); only the attention and the KV cache
differ between methods.

Which method runs where:

| method | KV cache | per decode step |
|---|---|---|
| ``full`` | GPU | dense sdpa |
| ``double_sparsity`` | GPU (+ label cache) | label scores → top-k → sparse attention (Triton) |
| ``double_sparsity`` with ``offload: true`` | pinned CPU (+ label cache on GPU) | layer l's tokens predicted during layer l−1 and gathered over PCIe on a side stream |
| ``magicpig`` | CPU (+ hash tables) | codes on GPU; sampling + sampled attention on CPU (numba); sink/local on GPU; LSE merge |
| ``quest`` | GPU (+ page min/max) | page bounds → top pages → attention over their tokens + sink/local (Triton) |
"""  # noqa: E501

from __future__ import annotations

import collections
import contextlib
import time
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from ..attention.plugin import layer_plan
from ..models.inspection import attention_modules, attention_window, head_shape, sliding_layers
from ..methods.base import Method
from ..methods import is_dense
from .layers import FullLayer, LayerOptions, build_layer, layer_class

ATTENTION_NAME = "sparse_eval_system"
_ATTR = "_sparse_eval_system"


class SystemCache(Cache):
    """transformers ``Cache`` over the system layers (one per decoder layer)."""

    def __init__(self, layers: list[FullLayer]):
        super().__init__(layers=layers)


def _system_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    session: SystemSession | None = getattr(module, _ATTR, None)
    if session is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    return session.attention(module, query, key, value, module.scaling if scaling is None else scaling)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The system layers need no mask: prefill is causal over the prompt alone, decode attends to every key.
    (Padding is not supported: ``decode`` takes equal-length prompts.)"""
    return None


AttentionInterface.register(ATTENTION_NAME, _system_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def build_layers(
    model: Any,
    method: Method,
    capacity: int,
    *,
    label_scale_dtype: torch.dtype | None = None,
    backend_gpu: str = "auto",
    backend_cpu: str = "auto",
    topk: str = "radix",
) -> list[FullLayer]:
    """One cache layer per decoder layer for ``method`` (set up already: DS has its channels); ``topk`` the
    top-k of DS and Quest ("radix": ``kernels.topk`` on CUDA; "torch": ``torch.topk``).  ``label_scale_dtype``
    (DS's label scales): float16 on CUDA, float32 on the CPU by default.

    The layers attend to every key they hold (no mask), so a model whose layers attend within a sliding window
    (``attention_window``) is refused when ``capacity`` exceeds the window; within it the window changes nothing,
    and the sliding layers are dense or the method's as ``method.sliding_layers`` says (``layer_plan``, as on the
    accuracy path)."""
    layer_class(method.name)  # refuses a method without a system path, naming the valid ones
    shape = head_shape(model.config)
    n_layers, hq, hkv, d = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
    method.validate(num_layers=n_layers)
    window = attention_window(model)
    if window is not None and capacity > window:
        raise ValueError(
            f"{type(model).__name__} attends within a {window}-token sliding window, which the system "
            f"path's cache layers do not apply: {capacity} tokens (prompt + new tokens) exceed it; "
            f"run at most {window} tokens here, or use the accuracy path (python -m sparse_eval)"
        )
    dense = set(range(n_layers)) if is_dense(method.name) else layer_plan(method, n_layers, sliding_layers(model))[0]
    if label_scale_dtype is None:
        label_scale_dtype = torch.float16 if next(model.parameters()).is_cuda else torch.float32
    opts = LayerOptions(
        capacity=capacity,
        hq=hq,
        hkv=hkv,
        d=d,
        label_scale_dtype=label_scale_dtype,
        backend_gpu=backend_gpu,
        backend_cpu=backend_cpu,
        topk=topk,
    )
    return [
        FullLayer(i, capacity, backend=backend_gpu) if i in dense else build_layer(i, method, opts)
        for i in range(n_layers)
    ]


class PhaseTimes:
    """Host wall time of named phases of the decode steps (``session.phase(name)`` brackets one), for breaking a
    step down.  Each bracket synchronises the GPU at both ends, so the phases are the work they enclose, and the
    steps run slower than untimed ones: timings for throughput come from runs without it."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.ms: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.ms[name] += 1e3 * (time.perf_counter() - t)


def _no_phase(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


class SystemSession:
    """The layers of one generation, the side stream and buffers of DS-Offload, and per-run counters."""

    def __init__(self, model: Any, method: Method, layers: list[FullLayer], phase_times: PhaseTimes | None = None):
        self.phase = phase_times if phase_times is not None else _no_phase  # phase(name): a context manager
        self.model = model
        self.method = method
        self.cache = SystemCache(layers)
        self.layers = layers
        self.modules = {m.layer_idx: m for m in attention_modules(model)}
        # each layer's input of the current decode step (hidden states [B, 1, H], position embeddings), kept when a
        # layer is ``prefetched`` (DS-Offload predicts its keys from the previous layer's input); others keep none
        self.inputs: dict[int, tuple] = {}
        self.stats: collections.Counter = collections.Counter()
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        prefetch = any(x.prefetched for x in layers)  # a layer's keys chosen and gathered during the previous one
        self.keeps_inputs = prefetch
        cuda = next(model.parameters()).is_cuda
        self.side_stream = torch.cuda.Stream() if prefetch and cuda else None
        self.cuda = cuda
        self.pieces = None  # a ``capture.Pieces`` while a static step is captured in pieces
        for kind in dict.fromkeys(type(x) for x in layers):
            kind.check_ready(method)

    # -- attention --------------------------------------------------------------------------------------
    def attention(self, module, q, k, v, scaling):
        i = module.layer_idx
        layer = self.layers[i]
        if q.shape[2] == 1 and i + 1 < len(self.layers) and self.layers[i + 1].prefetched:
            self.layers[i + 1].prefetch(self, i)  # issue layer i+1's gather first, so it overlaps this layer's work
        out = layer.attend(self, module, q, k, v, scaling)
        return out.transpose(1, 2).contiguous(), None

    def cut(self, host_part) -> None:
        """Where a static step waits on the host (MagicPIG's CPU part): the GPU work enqueued so far must have
        finished (its copies to the host landed), then ``host_part()`` runs, then the step goes on.  While the step
        is being captured in pieces, this ends the current piece there (``capture.Pieces.cut``)."""
        if self.pieces is not None:
            self.pieces.cut(host_part)
            return
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        host_part()

    def buffer(self, layer_idx: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple:
        """Views [B, Hs, S, D] into one of two GPU buffers (layer parity picks it): layer l+1's gather fills
        one while layer l reads the other."""
        slot = layer_idx % 2
        buf = self._buffers.get(slot)
        layer = self.layers[layer_idx]
        if (
            buf is None
            or buf[0].shape[0] < shape[0]
            or buf[0].shape[1] < shape[1]
            or buf[0].shape[2] < shape[2]
            or buf[0].dtype != dtype
        ):
            full = (shape[0], shape[1], max(shape[2], layer.budget(layer.capacity) + 1), shape[3])
            if buf is not None and self.side_stream is not None:
                torch.cuda.current_stream(device).wait_stream(self.side_stream)
            buf = (torch.empty(full, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device))
            self._buffers[slot] = buf
        return buf[0][: shape[0], : shape[1], : shape[2]], buf[1][: shape[0], : shape[1], : shape[2]]

    def nbytes(self) -> dict[str, int]:
        tot = {"gpu": 0, "cpu": 0}
        for layer in self.layers:
            for key, val in layer.nbytes().items():
                tot[key] += val
        for a, b in self._buffers.values():
            tot["gpu"] += 2 * a.numel() * a.element_size()
        return tot


def _grab_inputs(module, args, kwargs):
    """Keep a layer's input for DS-Offload's prediction: decode steps only.  The prefill's would pin [B, T, H]
    hidden states of every layer (26 GB at 96K for Llama-3.1-8B) until the first decode step replaced them, and a
    captured decode tiles its caches before that step."""
    session = getattr(module, _ATTR, None)
    if session is None or not session.keeps_inputs:
        return
    h = kwargs.get("hidden_states")
    if h is not None and h.shape[1] == 1:
        session.inputs[module.layer_idx] = (h, kwargs.get("position_embeddings"))


def use(model: Any, session: SystemSession) -> None:
    """Point the attached model's attention modules at ``session`` (one of several decoding the same model)."""
    for m in session.modules.values():
        setattr(m, _ATTR, session)


def attach(model: Any, session: SystemSession) -> None:
    detach(model)
    for m in session.modules.values():
        setattr(m, _ATTR, session)
        m._sparse_eval_system_hook = m.register_forward_pre_hook(_grab_inputs, with_kwargs=True)
    model._sparse_eval_system_prev = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)


def detach(model: Any) -> None:
    for m in model.modules():
        hook = getattr(m, "_sparse_eval_system_hook", None)
        if hook is not None:
            hook.remove()
            del m._sparse_eval_system_hook
        if hasattr(m, _ATTR):
            delattr(m, _ATTR)
    prev = getattr(model, "_sparse_eval_system_prev", None)
    if prev is not None:
        model.set_attn_implementation(prev)
        del model._sparse_eval_system_prev
