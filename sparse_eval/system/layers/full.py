"""The dense layer: a preallocated KV cache and full attention.  It is ``method=full``'s layer, every method's
dense layers, and the storage every other system layer extends."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

import sparse_eval.kernels.sparse_decode as ksd

from .base import StaticStep, _query_len, host_empty, host_token_major, tile
from .registry import LayerOptions, register_layer


@register_layer("full")
class FullLayer(CacheLayerMixin):
    """Preallocated KV cache (``capacity`` tokens) on ``kv_device``; dense attention."""

    kind = "full"
    is_sliding = False
    is_compileable = False
    # a layer whose keys are chosen and gathered while the previous layer computes (DS-Offload §5.1): the session
    # then keeps each layer's decode input (``session.inputs``), opens a side stream, and calls ``prefetch`` on this
    # layer before the previous one attends; what the layer keeps until its own decode is its own state
    prefetched = False

    def __init__(
        self,
        layer_idx: int,
        capacity: int,
        kv_device: torch.device | str | None = None,
        pin: bool = True,
        backend: str = "auto",
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.capacity = int(capacity)
        self.kv_device = None if kv_device is None else torch.device(kv_device)
        self.pin = pin  # a CPU cache in pinned memory (needed where the GPU reads it directly)
        self.backend = backend
        self.n = 0
        self.static: StaticStep | None = None  # set by the session for static-shape (CUDA-graph) decoding

    # -- transformers' cache-layer interface -------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        b, hkv, _, d = key_states.shape
        self.device = key_states.device
        dev = self.kv_device or key_states.device
        shape = (b, hkv, self.capacity, d)
        if dev.type == "cpu" and self.pin:
            # token-major in host memory ([N, B, Hkv, D] seen as [B, Hkv, N, D]): one step's rows are one
            # contiguous block, so the device-to-host copy of a new token is a single asynchronous DMA
            self.keys = host_token_major(shape, key_states.dtype)
            self.values = host_token_major(shape, value_states.dtype)
        elif dev.type == "cpu":
            self.keys = host_empty(shape, key_states.dtype)
            self.values = host_empty(shape, value_states.dtype)
        else:
            self.keys = torch.empty(shape, dtype=key_states.dtype, device=dev)
            self.values = torch.empty(shape, dtype=value_states.dtype, device=dev)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.static is not None:  # static step: the new token goes to the device-side position
            self.keys.index_copy_(2, self.static.pos, key_states)
            self.values.index_copy_(2, self.static.pos, value_states)
            return key_states, value_states
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        t = key_states.shape[2]
        if self.n + t > self.capacity:
            raise ValueError(
                f"layer {self.layer_idx}: {self.n} + {t} tokens exceed the cache capacity {self.capacity} "
                f"(prompt length + max_new_tokens)"
            )
        self.keys[:, :, self.n : self.n + t].copy_(key_states, non_blocking=True)
        self.values[:, :, self.n : self.n + t].copy_(value_states, non_blocking=True)
        self.n += t
        return key_states, value_states

    def get_seq_length(self, *args: Any) -> int:
        return self.n

    def get_mask_sizes(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        return self.n + _query_len(args, kwargs), 0

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.n = 0

    def prefetch(self, session, prev_idx: int) -> None:
        """Called on a decode step of a ``prefetched`` layer before layer ``prev_idx`` (= this one − 1) attends: start
        choosing and gathering this layer's keys.  Default: nothing (only prefetched layers are called)."""

    def release(self) -> None:
        """Drop what the layer keeps between steps beyond its cache (at the end of a decode).  Default: nothing."""

    def nbytes(self) -> dict[str, int]:
        """Bytes this layer holds, by device kind ("gpu" / "cpu")."""
        out = {"gpu": 0, "cpu": 0}
        if self.is_initialized:
            for t in (self.keys, self.values):
                out["gpu" if t.is_cuda else "cpu"] += t.numel() * t.element_size()
        return out

    def repeat_batch(self, times: int) -> None:
        """Tile the stored rows ``times`` over the batch (a benchmark's way to fill a large batch from one
        prefill: the per-row work of decoding is the same as with distinct rows)."""
        self.keys = tile(self.keys, times, self.pin)
        self.values = tile(self.values, times, self.pin)

    # -- attention ------------------------------------------------------------------------------------
    def attend(
        self, session: Any, module: Any, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scaling: float
    ) -> torch.Tensor:
        """q [B, Hq, T, D] -> [B, Hq, T, D]."""
        if q.shape[2] > 1:
            return self.prefill(session, module, q, k_new, v_new, scaling)
        return self.decode(session, module, q, k_new, v_new, scaling)

    def prefill(self, session, module, q, k_new, v_new, scaling):
        if self.n != q.shape[2]:
            raise ValueError(
                f"the system path prefills the prompt in one call from an empty cache (layer "
                f"{self.layer_idx} holds {self.n - q.shape[2]} earlier tokens); chunked prefill is not "
                f"supported"
            )
        g = q.shape[1] // k_new.shape[1]
        k, v = (k_new.repeat_interleave(g, 1), v_new.repeat_interleave(g, 1)) if g > 1 else (k_new, v_new)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:  # whole capacity, masked to each row's length (split-K Triton on CUDA)
            o, _ = ksd.dense_attention(
                q[:, :, 0], self.keys, self.values, self.static.lengths, scaling=scaling, backend=self.backend
            )
            return o.unsqueeze(2)
        n = self.n
        b, hq, _, d = q.shape
        hkv = self.keys.shape[1]
        # GQA decode as a G-row query per KV head (non-causal, so exact): sdpa's flash kernel then reads the
        # (strided) cache slice in place, with no repeated or copied K/V
        out = F.scaled_dot_product_attention(
            q.reshape(b, hkv, hq // hkv, d), self.keys[:, :, :n], self.values[:, :, :n], scale=scaling
        )
        return out.reshape(b, hq, 1, d)

    # -- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_method(cls, layer_idx: int, method: Any, opts: LayerOptions) -> "FullLayer":
        """The layer of a sparse layer of ``method`` (here: every layer of ``method=full``)."""
        return cls(layer_idx, opts.capacity, backend=opts.backend_gpu)

    # -- what generic code asks a layer kind (the session, ``system.plan``), from the method's config ---------
    @classmethod
    def variant(cls, cfg: dict[str, Any]) -> type:
        """The layer class ``from_method`` builds for method config ``cfg`` (DS-Offload for DS with offload)."""
        return cls

    @classmethod
    def check_options(cls, cfg: dict[str, Any]) -> None:
        """Refuse, at start, a method option the system path cannot run (raises ValueError).  Default: none."""

    @classmethod
    def check_ready(cls, method: Any) -> None:
        """Refuse a session whose ``method`` is not set up as this layer needs (raises ValueError).  Default: none."""

    @classmethod
    def row_bytes(cls, cfg: dict[str, Any], n: int, steps: int, hkv: int, d: int) -> tuple[int, int]:
        """(GPU bytes, host bytes) of one row's caches in one layer of this kind, at ``n`` tokens after ``steps``
        decode steps, ``hkv`` KV heads of dim ``d``, bf16: the KV cache, 2 · hkv · d · 2 · n, on the GPU."""
        return 2 * hkv * d * 2 * n, 0
