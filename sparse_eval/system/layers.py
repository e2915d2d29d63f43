"""Cache layers of the system path: each layer owns its KV storage *and* the attention over it.

The accuracy path (``attention.plugin``) keeps every key on one device and computes dense scores to check
each selection; the system path stores keys where the method's system stores them and touches only what the
method reads:

* ``FullLayer``: KV cache on the GPU, dense sdpa decode (the baseline; also every method's dense layers).
* ``DSLayer``: KV cache on the GPU plus a contiguous, quantized label cache (DS §4.2); per step: label scores,
  top-k, attention over the selected rows (``kernels.ds``, ``kernels.sparse_decode``).
* ``QuestLayer``: KV cache on the GPU plus per-page min/max keys; per step: page bounds, top pages, attention
  over their tokens and the static keys (``kernels.quest``, ``kernels.sparse_decode``).
* ``DSOffloadLayer``: KV cache in pinned CPU memory (token-major), label cache on the GPU; the tokens of layer l are predicted
  from layer l−1's input and gathered from host memory on a side CUDA stream into a double buffer while layer
  l−1 computes (DS §5.1); the current token's key joins the top-k exactly (see ``_include_new``).
* ``MagicPIGLayer``: KV cache and hash tables in CPU memory, sink and local window on the GPU; per step: the
  query's codes on the GPU, collision sampling and the −log u-corrected attention on the CPU (numba), the
  static keys on the GPU, both parts merged exactly by log-sum-exp (MagicPIG §4.4, eq. 11).

Each reproduces the selection of its ``sparse_eval.methods`` class (``tests/test_system.py`` checks the greedy
tokens against the accuracy path).

``FullLayer`` and ``DSLayer`` also decode with a ``StaticStep`` (shapes fixed by the cache capacity, the position,
row lengths and budgets on the device), the step the decoder captures in a CUDA graph.

All layers implement transformers' cache-layer interface (``update`` returns the call's new keys only; the
layer's ``attend`` reads its own storage), prefill densely in one call (protocol A: the prompt is dense,
generated tokens are sparse) and then decode one token per call.  Shapes: B batch, Hq / Hkv query / KV heads,
N tokens, D head dim, T tokens of the call.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers.cache_utils import CacheLayerMixin

import sparse_eval.kernels._common as kcommon
import sparse_eval.kernels.ds as kds
import sparse_eval.kernels.magicpig as kmp
import sparse_eval.kernels.magicpig_cpu as kmc
import sparse_eval.kernels.merge as kmerge
import sparse_eval.kernels.offload as koff
import sparse_eval.kernels.quest as kqu
import sparse_eval.kernels.sparse_decode as ksd
import sparse_eval.kernels.topk as ktopk

from ..methods.base import budget_bound


def _query_len(args: tuple, kwargs: dict) -> int:
    """transformers < 5.24 passes ``cache_position`` (a tensor), later versions ``query_length`` (an int)."""
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0]) if torch.is_tensor(x) else int(x)


class StaticStep:
    """The device-side position of a static-shape decode step (the system path's CUDA-graph mode).

    In this mode no shape depends on the number of tokens: each layer writes the new key at ``pos`` of its
    preallocated cache and attends over its whole capacity with per-row ``lengths`` masking, and budgets are
    counts on the device.  One decode step can then be captured once in a CUDA graph and replayed; ``advance``
    (part of the captured step) moves the position on.  On the CPU the same step simply runs eagerly.
    """

    def __init__(self, n: int, batch: int, device: torch.device | str):
        self.pos = torch.tensor([n], dtype=torch.long, device=device)  # [1] position of the token being decoded
        self.lengths = torch.full((batch,), n + 1, dtype=torch.int32, device=device)  # [B] keys per row, incl. it
        self._budgets: dict[Any, torch.Tensor] = {}

    def budget(self, beta: float | int) -> torch.Tensor:
        """[B] int32 token budget per row: max(1, min(n, ⌊β·n⌋)) for a ratio, max(1, min(n, β)) for a count --
        the same numbers as ``methods.base.budget_bound`` (float64 product, then truncation), computed on the
        device.  Made once per step and shared by the layers."""
        got = self._budgets.get(beta)
        if got is None:
            n = self.lengths.long()
            k = torch.floor(n.double() * beta).long() if isinstance(beta, float) else torch.full_like(n, int(beta))
            got = torch.minimum(k, n).clamp_min(1).to(torch.int32)
            self._budgets[beta] = got
        return got

    def budget_rows(self, beta: float | int, heads: int) -> torch.Tensor:
        """``budget`` expanded to [B, heads] int32, contiguous (one per selection row), made once per step."""
        key = (beta, heads)
        got = self._budgets.get(key)
        if got is None:
            got = self.budget(beta).view(-1, 1).expand(-1, heads).contiguous()
            self._budgets[key] = got
        return got

    def advance(self) -> None:
        self.pos += 1
        self.lengths += 1
        self._budgets.clear()


class FullLayer(CacheLayerMixin):
    """Preallocated KV cache (``capacity`` tokens) on ``kv_device``; dense attention."""

    kind = "full"
    is_sliding = False
    is_compileable = False

    def __init__(self, layer_idx: int, capacity: int, kv_device: torch.device | str | None = None, pin: bool = True,
                 backend: str = "auto"):
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
            self.keys = _host_token_major(shape, key_states.dtype)
            self.values = _host_token_major(shape, value_states.dtype)
        elif dev.type == "cpu":
            self.keys = _host_empty(shape, key_states.dtype)
            self.values = _host_empty(shape, value_states.dtype)
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
            raise ValueError(f"layer {self.layer_idx}: {self.n} + {t} tokens exceed the cache capacity {self.capacity} "
                             f"(prompt length + max_new_tokens)")
        self.keys[:, :, self.n:self.n + t].copy_(key_states, non_blocking=True)
        self.values[:, :, self.n:self.n + t].copy_(value_states, non_blocking=True)
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
        self.keys = _tile(self.keys, times, self.pin)
        self.values = _tile(self.values, times, self.pin)

    # -- attention ------------------------------------------------------------------------------------
    def attend(self, session: Any, module: Any, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
               scaling: float) -> torch.Tensor:
        """q [B, Hq, T, D] -> [B, Hq, T, D]."""
        if q.shape[2] > 1:
            return self.prefill(session, module, q, k_new, v_new, scaling)
        return self.decode(session, module, q, k_new, v_new, scaling)

    def prefill(self, session, module, q, k_new, v_new, scaling):
        if self.n != q.shape[2]:
            raise ValueError(f"the system path prefills the prompt in one call from an empty cache (layer "
                             f"{self.layer_idx} holds {self.n - q.shape[2]} earlier tokens); chunked prefill is not "
                             f"supported")
        g = q.shape[1] // k_new.shape[1]
        k, v = (k_new.repeat_interleave(g, 1), v_new.repeat_interleave(g, 1)) if g > 1 else (k_new, v_new)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling)

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:  # whole capacity, masked to each row's length (split-K Triton on CUDA)
            o, _ = ksd.dense_attention(q[:, :, 0], self.keys, self.values, self.static.lengths, scaling=scaling,
                                       backend=self.backend)
            return o.unsqueeze(2)
        n = self.n
        b, hq, _, d = q.shape
        hkv = self.keys.shape[1]
        # GQA decode as a G-row query per KV head (non-causal, so exact): sdpa's flash kernel then reads the
        # (strided) cache slice in place, with no repeated or copied K/V
        out = F.scaled_dot_product_attention(q.reshape(b, hkv, hq // hkv, d), self.keys[:, :, :n],
                                             self.values[:, :, :n], scale=scaling)
        return out.reshape(b, hq, 1, d)


def _host_token_major(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    b, h, n, d = shape
    return koff.pinned_empty((n, b, h, d), dtype).permute(1, 2, 0, 3)


def _host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A pageable host cache on transparent huge pages where Linux allows it: the CPU kernels gather random rows
    of it, and with 4 KiB pages nearly every row misses the TLB (MagicPIG's attention on the H200 machine's Xeon:
    6.2–6.5 against 7.1–7.3 ms in two of three alternating rounds, equal in the third;
    experiments/kernels/cpu/session5)."""
    out = torch.empty(shape, dtype=dtype)
    kcommon.advise_huge_pages(out)
    return out


def _tile(x: torch.Tensor, times: int, pin: bool = True) -> torch.Tensor:
    if times == 1:
        return x
    shape = (x.shape[0] * times, *x.shape[1:])
    if x.is_cuda:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        out = _host_token_major(shape, x.dtype) if pin else _host_empty(shape, x.dtype)
    for i in range(times):
        out[i * x.shape[0]:(i + 1) * x.shape[0]].copy_(x)
    return out


class _Labels:
    """A preallocated label cache (DS §4.2): 16-bit values, or 8/4-bit codes with a per-token scale and zero
    (``kernels.ds.LabelCache`` layout), filled as keys arrive.  The channel indices live on the compute device
    (checked once, on the host), so appending and scoring never synchronise with the GPU."""

    def __init__(self, channels: torch.Tensor, bits: int, scale_dtype: torch.dtype):
        self.channels = channels.long()  # [Hl, r], host
        self.bits = bits
        self.scale_dtype = scale_dtype
        self.n = 0
        self.codes = self.scale = self.zero = None
        self._dev: dict[str, torch.Tensor] = {}

    def device_index(self, hq: int, hkv: int, d: int, device) -> dict[str, torch.Tensor]:
        """kv_of [Hl] (the KV head of each label head), ch [Hl, r] and q_ch [Hq, r] (the channels of each query
        head's label head) on ``device``, made once."""
        if not self._dev:
            hl, r = self.channels.shape
            if hl % hkv or hq % hl:
                raise ValueError(f"DS channels for {hl} label heads: must be a multiple of the {hkv} KV heads and "
                                 f"divide the {hq} query heads")
            if self.channels.numel() and not (0 <= int(self.channels.min()) and int(self.channels.max()) < d):
                raise ValueError(f"DS channels must lie in [0, {d})")
            self._dev = {
                "kv_of": (torch.arange(hl) // (hl // hkv)).to(device),
                "ch": self.channels.to(device),
                "q_ch": self.channels.repeat_interleave(hq // hl, 0).to(device),
            }
        return self._dev

    def labels_of(self, k: torch.Tensor, hq: int) -> kds.LabelCache:
        """k [B, Hkv, T, D] -> the quantized labels of these T keys (``kernels.ds.build_label_cache`` with the
        channel indices already on the device)."""
        ix = self.device_index(hq, k.shape[1], k.shape[3], k.device)
        return kds.quantize_labels(kds.label_channels(k, ix["ch"], ix["kv_of"]), self.bits,
                                   scale_dtype=self.scale_dtype)

    def append(self, k: torch.Tensor, capacity: int, hq: int) -> None:
        new = self.labels_of(k, hq)
        if self.codes is None:
            b, hl, _ = new.shape
            self.codes = torch.empty((b, hl, capacity, new.labels.shape[-1]), dtype=new.labels.dtype, device=k.device)
            if new.scale is not None:
                self.scale = torch.empty((b, hl, capacity), dtype=new.scale.dtype, device=k.device)
                self.zero = torch.empty_like(self.scale)
        t = k.shape[2]
        self.codes[:, :, self.n:self.n + t] = new.labels
        if new.scale is not None:
            self.scale[:, :, self.n:self.n + t] = new.scale
            self.zero[:, :, self.n:self.n + t] = new.zero
        self.n += t

    def append_at(self, k: torch.Tensor, pos: torch.Tensor, hq: int, backend: str = "auto") -> None:
        """Write the labels of one step's keys k [B, Hkv, 1, D] at the device-side position pos [1]
        (``kernels.ds.append_labels``: one launch on CUDA)."""
        ix = self.device_index(hq, k.shape[1], k.shape[3], k.device)
        kds.append_labels(k, ix["ch"], ix["kv_of"], self.codes, self.scale, self.zero, pos, self.bits, backend=backend)

    def view(self, n: int) -> kds.LabelCache:
        return kds.LabelCache(labels=self.codes[:, :, :n], bits=self.bits, r=self.channels.shape[1],
                              scale=None if self.scale is None else self.scale[:, :, :n],
                              zero=None if self.zero is None else self.zero[:, :, :n])

    def repeat_batch(self, times: int) -> None:
        for name in ("codes", "scale", "zero"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x.repeat(times, *([1] * (x.dim() - 1))))


def _check_topk(topk: str) -> str:
    if topk not in kds.TOPK_IMPLS:
        raise ValueError(f"topk={topk!r}: valid values are {list(kds.TOPK_IMPLS)}")
    return topk


class _SelectsTopK:
    """DS and Quest layers: ``topk`` "radix" (``kernels.topk`` where the backend resolves to Triton) or "torch"."""

    def _topk_backend(self) -> str:
        """The backend of ``kernels.topk.select`` ("torch": its reference, a sorted ``torch.topk``)."""
        return self.backend if self.topk == "radix" else "torch"


class DSLayer(_SelectsTopK, FullLayer):
    """Double Sparsity decode (Algorithm 1) over a GPU KV cache.  ``channels`` long [Hl, r] (Hl = Hq: per query
    head, the calibrated "qk" channels; Hl = Hkv: per KV head), ``beta`` the token budget (ratio of the context
    or a token count), ``gqa`` "query_head" (a top-k per query head) or "kv_head" (one per KV group, label
    scores summed over the group); ``topk`` "radix" (``kernels.topk`` on CUDA, ``torch.topk`` elsewhere) or
    "torch" (always ``torch.topk``): the same keys up to ties."""

    kind = "double_sparsity"

    def __init__(self, layer_idx: int, capacity: int, channels: torch.Tensor, *, hq: int, beta: float | int, bits: int = 4,
                 quantize_query: bool = True, gqa: str = "query_head", scale_dtype: torch.dtype = torch.float16,
                 backend: str = "auto", kv_device=None, topk: str = "radix"):
        super().__init__(layer_idx, capacity, kv_device, backend=backend)
        if gqa not in kds.GQA_MODES:
            raise ValueError(f"gqa={gqa!r}: valid values are {list(kds.GQA_MODES)}")
        self.topk = _check_topk(topk)
        if bits not in kds.LABEL_BITS:
            raise ValueError(f"label bits={bits!r}: the system path's label cache supports {list(kds.LABEL_BITS)}")
        self.labels = _Labels(channels, bits, scale_dtype)
        self.hq = int(hq)
        self.beta, self.bits, self.quantize_query, self.gqa = beta, bits, quantize_query, gqa

    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        if self.static is not None:
            self.labels.append_at(key_states, self.static.pos, self.hq, self.backend)
        else:
            self.labels.append(key_states, self.capacity, self.hq)
        return out

    def repeat_batch(self, times: int) -> None:
        super().repeat_batch(times)
        self.labels.repeat_batch(times)

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        for t in (self.labels.codes, self.labels.scale, self.labels.zero):
            if t is not None:
                out["gpu" if t.is_cuda else "cpu"] += t.numel() * t.element_size()
        return out

    def budget(self, n: int) -> int:
        """k = floor(β·n) (at least 1) for a ratio, β for a token count, capped at n (``budget_bound``, the
        same count as the accuracy path's ``resolve_budget``, from Python numbers)."""
        return max(1, budget_bound(self.beta, n))

    def query_labels(self, q3: torch.Tensor) -> torch.Tensor:
        """q3 [B, Hq, D] -> q_label [B, Hq, r] fp32 (quantized like the keys' labels when ``quantize_query``)."""
        b, hq, d = q3.shape
        q_ch = self.labels.device_index(hq, self.keys.shape[1], d, q3.device)["q_ch"]
        return kds.query_labels(q3, q_ch, self.bits, self.quantize_query, backend=self.backend)

    def label_scores(self, q_label: torch.Tensor, n: int, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Scores of the first n keys: [B, Hq, n] (query_head) or [B, Hkv, n] (kv_head); positions at or beyond
        ``lengths[b]`` (when given) score −inf."""
        cache = self.labels.view(n)
        hkv = self.keys.shape[1]
        if self.gqa == "kv_head" and cache.shape[1] == hkv:  # Σ over the group inside the kernel
            return kds.label_scores(q_label, cache, reduce=True, lengths=lengths, backend=self.backend)
        s = kds.label_scores(q_label, cache, lengths=lengths, backend=self.backend)  # [B, Hq, n]
        if self.gqa == "kv_head":
            b, hq, _ = s.shape
            s = s.view(b, hkv, hq // hkv, n).sum(2)
        return s

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static(q, scaling)
        n = self.n
        q3 = q[:, :, 0]
        scores = self.label_scores(self.query_labels(q3), n)  # Alg. 1 line 4
        idx = kds.topk_indices(scores, self.budget(n), backend=self.backend, topk=self.topk)  # line 5
        o, _ = ksd.attention(q3, self.keys[:, :, :n], self.values[:, :, :n], idx, scaling=scaling,
                             backend=self.backend)  # lines 6-7
        return o.unsqueeze(2)

    def _decode_static(self, q, scaling):
        """Algorithm 1 with shapes fixed by the capacity: scores over every slot (−inf at and beyond each row's
        length); the top budget(n) of each row, with the budget a device tensor, written into k_cap =
        budget(capacity) slots; attention over the first budget(n) of them.  The same keys as the eager step's,
        up to ties.  Top-k: ``kernels.topk.select`` with the budgets as its per-row counts (with ``topk="torch"``
        its reference: a sorted ``torch.topk`` of k_cap, whose first budget(n) are the budget(n) best)."""
        st = self.static
        q3 = q[:, :, 0]
        scores = self.label_scores(self.query_labels(q3), self.capacity, st.lengths)  # line 4, [B, Hs, capacity]
        count = st.budget_rows(self.beta, scores.shape[1])  # [B, Hs]; all finite: budget ≤ n
        ids = ktopk.select(scores, self.budget(self.capacity), count, backend=self._topk_backend())  # line 5
        o, _ = ksd.attention(q3, self.keys, self.values, ids, count=count, scaling=scaling,
                             backend=self.backend)  # lines 6-7
        return o.unsqueeze(2)


class QuestLayer(_SelectsTopK, FullLayer):
    """Quest decode over a GPU KV cache: per-page min/max keys kept as keys arrive, page bounds U_p(q)
    (``kernels.quest.page_scores``), the top pages' tokens plus the static sink/local keys attended
    (``kernels.sparse_decode``).  Same selection as ``methods.quest`` with ``update_pages=true`` (Quest's own
    behaviour): only pages holding a candidate (non-static) key compete, and the budget is
    max(1, floor(budget_tokens / page_size)) pages.  ``topk`` as in ``DSLayer``.  With a ``StaticStep`` the new
    key is folded into its page at the device position, and the decode runs over every page of the capacity
    (``_decode_static``)."""

    kind = "quest"

    def __init__(self, layer_idx: int, capacity: int, *, page_size: int, budget: float | int, sink: int, local: int,
                 gqa: str = "query_head", backend: str = "auto", topk: str = "radix"):
        super().__init__(layer_idx, capacity, backend=backend)
        if gqa not in kqu.GQA_MODES:
            raise ValueError(f"gqa={gqa!r}: valid values are {list(kqu.GQA_MODES)}")
        self.topk = _check_topk(topk)
        self.ps, self.budget_cfg, self.sink, self.local, self.gqa = page_size, budget, sink, local, gqa
        self.kmin = self.kmax = None

    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        t = key_states.shape[2]
        if self.kmin is None:  # prefill: pages of the prompt, room for the rest
            b, hkv, _, d = key_states.shape
            cap = -(-self.capacity // self.ps)
            big = torch.finfo(key_states.dtype).max
            self.kmin = key_states.new_full((b, hkv, cap, d), big)
            self.kmax = key_states.new_full((b, hkv, cap, d), -big)
            lo, hi = kqu.page_metadata(key_states, self.ps)
            self.kmin[:, :, :lo.shape[2]] = lo
            self.kmax[:, :, :hi.shape[2]] = hi
        elif self.static is not None:  # static step: the page of the device position
            p = torch.div(self.static.pos, self.ps, rounding_mode="floor")  # [1]
            self.kmin.index_copy_(2, p, torch.minimum(self.kmin.index_select(2, p), key_states))
            self.kmax.index_copy_(2, p, torch.maximum(self.kmax.index_select(2, p), key_states))
        else:
            for j in range(t):  # fold each new key into its page (the last, partial one or a new one)
                p = (self.n - t + j) // self.ps
                torch.minimum(self.kmin[:, :, p], key_states[:, :, j], out=self.kmin[:, :, p])
                torch.maximum(self.kmax[:, :, p], key_states[:, :, j], out=self.kmax[:, :, p])
        return out

    def repeat_batch(self, times: int) -> None:
        super().repeat_batch(times)
        self.kmin = self.kmin.repeat(times, 1, 1, 1)
        self.kmax = self.kmax.repeat(times, 1, 1, 1)

    def _want(self, n):
        """Pages to select for n keys: max(1, floor(budget_tokens / page_size)), budget_tokens as
        ``resolve_budget`` (an int budget is not capped at n, the accuracy path's page count).  n: an int, or a
        device tensor (then the same numbers on the device: float64 product, then truncation)."""
        if torch.is_tensor(n):
            if isinstance(self.budget_cfg, int):
                return torch.full_like(n, max(1, self.budget_cfg // self.ps))
            tokens = torch.minimum(torch.floor(n.double() * self.budget_cfg).long(), n.long())
            return torch.div(tokens, self.ps, rounding_mode="floor").clamp_min(1)
        tokens = self.budget_cfg if isinstance(self.budget_cfg, int) else budget_bound(self.budget_cfg, n)
        return max(1, tokens // self.ps)

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static(q, scaling)
        n, ps = self.n, self.ps
        q3 = q[:, :, 0]
        b = q3.shape[0]
        pages = -(-n // ps)
        u = kqu.page_scores(q3, self.kmin[:, :, :pages], self.kmax[:, :, :pages], reduce=self.gqa == "kv_head",
                            backend=self.backend)  # [B, Hs, P]
        c_lo, c_hi = self.sink, n - self.local  # candidate keys [c_lo, c_hi)
        p_lo, p_hi = (c_lo // ps, -(-c_hi // ps)) if c_hi > c_lo else (0, 0)
        pid = torch.arange(pages, device=q.device)
        u = u.masked_fill((pid < p_lo) | (pid >= p_hi), float("-inf"))
        want = self._want(n)
        chosen = kqu.top_pages(u, want, backend=self.backend, topk=self.topk)  # [B, Hs, want]
        tok = kqu.pages_to_tokens(chosen, ps, n)  # [B, Hs, want·ps]
        tok = torch.where((tok >= c_lo) & (tok < c_hi), tok, torch.full_like(tok, -1))
        static = torch.cat([torch.arange(min(self.sink, n), device=q.device, dtype=tok.dtype),
                            torch.arange(max(self.sink, n - self.local), n, device=q.device, dtype=tok.dtype)])
        static = static.expand(b, tok.shape[1], -1)
        idx = torch.cat([tok, static], -1)
        o, _ = ksd.attention(q3, self.keys[:, :, :n], self.values[:, :, :n], idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)

    def _decode_static(self, q, scaling):
        """``decode`` with shapes fixed by the capacity: bounds of every page of the capacity, those outside the
        candidate pages (from the device-side length) at −inf; the top ``_want(n)`` pages (a device count) in
        k_cap = ``_want(capacity)`` slots; their candidate tokens plus the sink and local keys (fixed slots, −1
        where a position does not exist yet).  The same keys as ``decode``'s, up to ties."""
        st, ps = self.static, self.ps
        q3 = q[:, :, 0]
        dev = q.device
        n = st.pos + 1  # [1] keys, the new one included (every row has the same length on this path)
        u = kqu.page_scores(q3, self.kmin, self.kmax, reduce=self.gqa == "kv_head", backend=self.backend)  # [B, Hs, P]
        c_lo, c_hi = self.sink, n - self.local  # candidate keys [c_lo, c_hi)
        pid = torch.arange(u.shape[-1], device=dev)
        p_hi = torch.where(c_hi > c_lo, torch.div(c_hi + ps - 1, ps, rounding_mode="floor"), 0)
        u = u.masked_fill((pid < c_lo // ps) | (pid >= p_hi), float("-inf"))
        k_cap = min(self._want(self.capacity), u.shape[-1])
        count = self._want(n).to(torch.int32).expand(u.shape[0], u.shape[1]).contiguous()  # [B, Hs]
        chosen = ktopk.select(u, k_cap, count, backend=self._topk_backend())  # [B, Hs, k_cap], −1 padded
        tok = kqu.pages_to_tokens(chosen, ps, self.capacity)  # [B, Hs, k_cap·ps]
        tok = torch.where((tok >= c_lo) & (tok < c_hi), tok, torch.full_like(tok, -1))
        sink = torch.arange(self.sink, device=dev, dtype=tok.dtype)
        local = (n - self.local + torch.arange(self.local, device=dev)).to(tok.dtype)
        static = torch.cat([torch.where(sink < n, sink, -1), torch.where(local >= max(self.sink, 0), local, -1)])
        idx = torch.cat([tok, static.expand(tok.shape[0], tok.shape[1], -1)], -1)
        o, _ = ksd.attention(q3, self.keys, self.values, idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)


class DSOffloadLayer(DSLayer):
    """DS-Offload (DS §5.1): the KV cache in pinned host memory; the label cache on the GPU.  The session's
    ``predict`` (run while the previous layer computes) scores this layer's keys with an approximate query from
    the previous layer's input and gathers the top rows into a GPU buffer on a side stream."""

    kind = "ds_offload"

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["kv_device"] = "cpu"
        super().__init__(*args, **kwargs)

    def update(self, key_states, value_states, *args, **kwargs):
        # KV: device -> pinned host on the compute stream (a later gather on the side stream waits for it);
        # labels on the GPU
        if self.static is not None and key_states.is_cuda:
            # static step: the new token into the pinned host cache at the device-side position (one launch each,
            # capturable: no host value), its labels likewise
            koff.put_rows(key_states, self.keys, self.static.pos)
            koff.put_rows(value_states, self.values, self.static.pos)
            self.labels.append_at(key_states, self.static.pos, self.hq, self.backend)
            out = (key_states, value_states)
        else:
            out = super().update(key_states, value_states, *args, **kwargs)
        self._new = (key_states, value_states)
        return out

    def _side_gather(self, session, ids: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor,
                     record: bool) -> torch.cuda.Event | None:
        """Gather the host rows ``ids`` [B, Hs, S] into ``buf_k``/``buf_v`` [B, Hs, S, D], on the session's side
        stream when on CUDA (returns the event the compute stream waits for), else at once.  ``record``: tell
        the allocator that ``ids`` is used on the side stream (an eager step drops it before the wait; a static
        step keeps it until its decode has waited)."""
        stream = session.side_stream
        if stream is None:
            koff.gather_rows(self.keys, ids, buf_k)
            koff.gather_rows(self.values, ids, buf_v)
            return None
        stream.wait_stream(torch.cuda.current_stream(ids.device))
        with torch.cuda.stream(stream):
            koff.gather_rows(self.keys, ids, buf_k)
            koff.gather_rows(self.values, ids, buf_v)
            event = torch.cuda.Event()
            event.record(stream)
        if record:
            ids.record_stream(stream)
        return event

    def predict(self, session, q_pred: torch.Tensor) -> dict[str, Any]:
        """Top keys among the ``self.n`` stored ones for the predicted query q_pred [B, Hq, D], and their gather
        into the session's buffer (on the side stream when on CUDA).  Called before this step's key arrives."""
        if self.static is not None:
            return self._predict_static(session, q_pred)
        n_old = self.n
        k_tot = self.budget(n_old + 1)
        k_old = min(k_tot, n_old)
        ql = self.query_labels(q_pred)
        vals, ids = torch.topk(self.label_scores(ql, n_old), k_old, dim=-1, sorted=True)
        ids = ids.to(torch.int32)
        hs = ids.shape[1]
        buf_k, buf_v = session.buffer(self.layer_idx, (ids.shape[0], hs, k_tot + 1, self.keys.shape[-1]),
                                      self.keys.dtype, q_pred.device)
        event = self._side_gather(session, ids, buf_k[:, :, :k_old], buf_v[:, :, :k_old], record=True)
        return {"event": event, "buf_k": buf_k, "buf_v": buf_v, "vals": vals, "ql": ql, "k_tot": k_tot,
                "k_old": k_old, "n_old": n_old}

    def _predict_static(self, session, q_pred: torch.Tensor) -> dict[str, Any]:
        """``predict`` with static shapes: scores over the whole capacity, −inf from the stored keys' end
        (n_old = lengths − 1: this step's key has not arrived); the top k_old = min(budget(n_old + 1), n_old) of
        each row (device counts) by ``kernels.topk.select`` into k_cap = budget(capacity) slots, positions
        ascending and −1 padded; their rows gathered into the first k_cap slots of the buffer; the lowest selected
        score and its slot (the old key that a better new key displaces, as the k-th of the eager sorted
        top-k)."""
        st = self.static
        ql = self.query_labels(q_pred)
        n_old = st.lengths - 1  # [B]
        scores = self.label_scores(ql, self.capacity, n_old)  # [B, Hs, capacity]
        b, hs, _ = scores.shape
        k_tot = st.budget_rows(self.beta, hs)  # [B, Hs] budget(n_old + 1)
        k_old = torch.minimum(k_tot, n_old.view(-1, 1)).contiguous()
        k_cap = self.budget(self.capacity)
        ids = ktopk.select(scores, k_cap, k_old, backend=self._topk_backend())  # [B, Hs, k_cap]
        picked = scores.gather(-1, ids.clamp_min(0).long())
        kth, kth_slot = torch.where(ids >= 0, picked, torch.full_like(picked, float("inf"))).min(-1)  # [B, Hs]
        buf_k, buf_v = session.buffer(self.layer_idx, (b, hs, k_cap + 1, self.keys.shape[-1]), self.keys.dtype,
                                      q_pred.device)
        event = self._side_gather(session, ids, buf_k[:, :, :k_cap], buf_v[:, :, :k_cap], record=False)
        return {"event": event, "buf_k": buf_k, "buf_v": buf_v, "ids": ids, "kth": kth, "kth_slot": kth_slot,
                "ql": ql, "k_tot": k_tot, "k_old": k_old}

    def _new_score(self, ql: torch.Tensor, k_new: torch.Tensor) -> torch.Tensor:
        """The new key's label score under the predicted query ql [B, Hq, r]: [B, Hs]."""
        lab = kds.dequantize_labels(self.labels.labels_of(k_new, self.hq))  # [B, Hl, 1, r]
        b, hq, r = ql.shape
        hl = lab.shape[1]
        s_new = (ql.view(b, hl, hq // hl, r) * lab[:, :, 0].unsqueeze(2)).sum(-1).reshape(b, hq)
        if self.gqa == "kv_head":
            hkv = self.keys.shape[1]
            s_new = s_new.view(b, hkv, hq // hkv).sum(-1)
        return s_new

    def _include_new(self, p: dict[str, Any]) -> torch.Tensor:
        """Exact top-k over all n keys from the top-k of the n−1 old ones: the new key (scored with the same
        predicted query) enters iff the old keys did not fill the budget or it beats the k-th best old score; it
        then replaces that k-th key.  bool [B, Hs]."""
        s_new = self._new_score(p["ql"], self._new[0])
        if p["k_old"] < p["k_tot"]:
            return torch.ones_like(s_new, dtype=torch.bool)
        return s_new > p["vals"][..., -1]

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static_offload(session, q, k_new, v_new, scaling)
        p = session.pending.pop(self.layer_idx, None)
        q3 = q[:, :, 0]
        if p is None:  # no predecessor input (first layer): the layer's own query, gathered synchronously
            p = self._own(session, q3)
            session.stats["offload_own_query"] += 1
        elif p["event"] is not None:
            torch.cuda.current_stream(q.device).wait_event(p["event"])
        buf_k, buf_v, k_tot, k_old = p["buf_k"], p["buf_v"], p["k_tot"], p["k_old"]
        b, hs = buf_k.shape[:2]
        hkv = self.keys.shape[1]
        last = buf_k.shape[2] - 1
        buf_k[:, :, last] = k_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        buf_v[:, :, last] = v_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        inc = self._include_new(p)  # [B, Hs]
        idx = torch.arange(k_old + 1, device=q.device, dtype=torch.int32).expand(b, hs, k_old + 1).clone()
        idx[..., k_old] = torch.where(inc, last, -1)
        if k_old == k_tot:  # full budget: the new key displaces the k-th best old key
            idx[..., k_old - 1] = torch.where(inc, -1, k_old - 1)
        o, _ = ksd.attention(q3, buf_k, buf_v, idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)

    def _own(self, session, q3):
        self.n -= 1  # score the old keys only, as a prediction would
        try:
            p = self.predict(session, q3)
        finally:
            self.n += 1
        if p["event"] is not None:
            torch.cuda.current_stream(q3.device).wait_event(p["event"])
            p["event"] = None
        return p

    def _decode_static_offload(self, session, q, k_new, v_new, scaling):
        """``decode`` with static shapes: the buffer's k_cap gathered slots (−1 where a row selected fewer), the
        new key in the last slot if it enters the exact top-k of all n keys (it beats the lowest selected old
        score, or the old keys did not fill the budget), displacing that lowest one when the budget was full."""
        p = session.pending.pop(self.layer_idx, None)
        q3 = q[:, :, 0]
        if p is None:  # no predecessor input (first layer): the layer's own query (it scores the old keys only)
            p = self._predict_static(session, q3)
            session.stats["offload_own_query"] += 1
        if p["event"] is not None:
            torch.cuda.current_stream(q.device).wait_event(p["event"])
        buf_k, buf_v, ids = p["buf_k"], p["buf_v"], p["ids"]
        b, hs, slots = buf_k.shape[:3]
        last = slots - 1  # = k_cap
        hkv = self.keys.shape[1]
        buf_k[:, :, last] = k_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        buf_v[:, :, last] = v_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        full = p["k_old"] == p["k_tot"]  # [B, Hs]
        inc = ~full | (self._new_score(p["ql"], k_new) > p["kth"])
        slot = torch.arange(last, device=q.device, dtype=torch.int32).expand(b, hs, last)
        idx = torch.cat([torch.where(ids >= 0, slot, -1), torch.where(inc, last, -1).to(torch.int32).unsqueeze(-1)], -1)
        at = p["kth_slot"].unsqueeze(-1)  # [B, Hs, 1]
        idx.scatter_(-1, at, torch.where((inc & full).unsqueeze(-1), -1, idx.gather(-1, at)))
        o, _ = ksd.attention(q3, buf_k, buf_v, idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)


class MagicPIGLayer(FullLayer):
    """MagicPIG with its KV cache and hash tables in CPU memory (§4.4).

    ``method`` is the accuracy path's ``MagicPIG`` (its config and seeded projections are reused, so both paths
    hash with the same hyperplanes).  The keys a row may sample are the non-static ones (between the sink and
    the local window); μ (centering) is their mean at the first decode step, as in the accuracy path.  Keys
    leaving the local window later are hashed with that μ into an overflow list that is searched by brute force
    next to the tables (it holds at most the number of generated tokens, in a buffer preallocated for all of them).
    """

    kind = "magicpig"
    # a static step (``_decode_static``) has a host part in the middle: on CUDA the decoder captures the step in
    # pieces cut there (``SystemSession.cut``) and runs the host part between their replays
    cuts_step = True
    builds_at_first_step = True  # the first decode step (eager) fixes μ and builds the tables

    def __init__(self, layer_idx: int, capacity: int, method: Any, *, backend_gpu: str = "auto",
                 backend_cpu: str = "auto"):
        # the CPU kernel reads this cache; only one token per step crosses the bus, so it needs no pinning
        super().__init__(layer_idx, capacity, kv_device="cpu", pin=False)
        c = method.config
        if c.mips:
            raise ValueError("method.mips=true: the MagicPIG CPU kernel hashes centred keys without the eq. 8 "
                             "transform; the system path supports mips=false only")
        if c.u_offset:
            raise ValueError(f"method.u_offset={c.u_offset}: the MagicPIG CPU kernel implements eq. 11 (u_offset=0) only")
        self.method = method
        self.cfg = c
        self.backend_gpu, self.backend_cpu = backend_gpu, backend_cpu
        self.tables = None
        self.cand_end = 0  # keys [sink, cand_end) are candidates (in the tables or the overflow)
        self.table_end = 0
        self.ring = None  # static steps: the local window as a ring, and the host/device buffers (``_static_init``)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One host buffer [B, Hkv, capacity, 2, D] with a token's K and V side by side (keys and values are its two
        halves): the CPU kernel then reads one 512-byte row per sampled key (D = 128, bf16) instead of two 256-byte
        rows at unrelated places, 1.05–1.14x the gather bandwidth on the H200 machine's Xeon
        (experiments/kernels/cpu/session6)."""
        b, hkv, _, d = key_states.shape
        self.device = key_states.device
        self.kv = _host_empty((b, hkv, self.capacity, 2, d), key_states.dtype)
        self.keys, self.values = self.kv[..., 0, :], self.kv[..., 1, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.static is not None:  # static step: the new token reaches the host and the window in _decode_static
            return key_states, value_states
        first = not self.is_initialized
        t = key_states.shape[2]
        # one contiguous device-to-host copy each, then the strided write into the head-major host cache (the CPU
        # kernel wants head-major rows); a strided device-to-pageable copy would move row by row
        super().update(*_to_host(key_states, value_states))
        if first:  # prefill: the sink and the last `local` keys on the GPU, with room for the generated ones
            s = self.cfg.sink
            self.sink_k = key_states[:, :, :s].clone()
            self.sink_v = value_states[:, :, :s].clone()
            self.w0 = max(s, self.n - self.cfg.local)  # the GPU window holds positions [w0, n)
            m = self.n - self.w0
            b, hkv, _, d = key_states.shape
            self.win_k = torch.empty((b, hkv, m + self.capacity - self.n, d), dtype=key_states.dtype,
                                     device=key_states.device)
            self.win_v = torch.empty_like(self.win_k)
            self.win_k[:, :, :m] = key_states[:, :, self.w0:]
            self.win_v[:, :, :m] = value_states[:, :, self.w0:]
        else:
            m = self.n - t - self.w0
            self.win_k[:, :, m:m + t] = key_states
            self.win_v[:, :, m:m + t] = value_states
        return key_states, value_states

    def repeat_batch(self, times: int) -> None:
        self.kv = _tile(self.kv, times, pin=False)
        self.keys, self.values = self.kv[..., 0, :], self.kv[..., 1, :]
        for name in ("win_k", "win_v", "sink_k", "sink_v"):
            setattr(self, name, getattr(self, name).repeat(times, 1, 1, 1))
        if self.tables is not None:
            t = self.tables
            # on the huge pages the built tables have (numpy advises its large arrays), so that a tiled row is
            # looked up as fast as a distinct one would be
            self.tables = type(t)(perm=_tile(t.perm, times, pin=False), offsets=_tile(t.offsets, times, pin=False),
                                  k_bits=t.k_bits, n_tables=t.n_tables)
            self.mean = self.mean.repeat(times, 1, 1)
            self.mean_cpu = self.mean.cpu()
            self.over_codes = self.over_codes.repeat(times, 1, 1, 1)  # [B, Hkv, room, L], first n_over filled

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        for t in (getattr(self, "win_k", None), getattr(self, "win_v", None)):
            if t is not None:
                out["gpu" if t.is_cuda else "cpu"] += t.numel() * t.element_size()
        if self.tables is not None:
            out["cpu"] += self.tables.nbytes()
        return out

    def _window(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.win_k[:, :, lo - self.w0:hi - self.w0], self.win_v[:, :, lo - self.w0:hi - self.w0]

    def _build(self, n: int, dev: torch.device) -> None:
        """Fix μ over the candidates [sink, n − local) and build the tables (first decode step)."""
        c = self.cfg
        lo, hi = c.sink, max(c.sink, n - c.local)
        b, hkv, _, d = self.keys.shape
        self.w = self.method.projection(self.layer_idx, d, dev)
        if hi <= lo:
            return
        self.cand_end = self.table_end = hi
        self.mean = torch.zeros(b, hkv, d, dtype=torch.float32, device=dev)
        k_c = self.keys[:, :, lo:hi].to(dev, non_blocking=True)
        if c.center:
            self.mean = k_c.double().mean(2).float()  # as MagicPIG._fix_center (float64, then float32)
        codes = kmp.hash_codes(k_c.float() - self.mean[:, :, None], self.w, c.K, c.L, backend=self.backend_gpu)
        self.tables = kmc.build_tables(codes.cpu(), c.K, backend=self.backend_cpu)
        # codes of the keys that leave the window later: at most capacity − hi of them, written in place as they
        # come (a concatenation per step copied the whole list: quadratic in the generated tokens)
        self.over_codes = torch.empty(b, hkv, max(1, self.capacity - hi), c.L, dtype=torch.int32)
        self.n_over = 0
        self.mean_cpu = self.mean.cpu()

    def _append_overflow(self, codes: torch.Tensor) -> None:
        """codes [B, Hkv, e, L] of keys that left the window, after the ones stored."""
        e = codes.shape[2]
        if self.n_over + e > self.over_codes.shape[2]:
            raise RuntimeError(f"layer {self.layer_idx}: {self.n_over} + {e} overflow keys exceed the room for "
                               f"{self.over_codes.shape[2]} (capacity {self.capacity})")
        self.over_codes[:, :, self.n_over:self.n_over + e] = codes
        self.n_over += e

    def _overflow_keys(self, n: int) -> torch.Tensor | None:
        """The keys that left the local window since the last step, centred by μ: [B, Hkv, t, D] float32 on the
        GPU (None if none left)."""
        hi = max(self.cfg.sink, n - self.cfg.local)
        if hi <= self.cand_end:
            return None
        k, _ = self._window(self.cand_end, hi)
        self.cand_end = hi
        return k.float() - self.mean[:, :, None]

    def _codes_async(self, q3: torch.Tensor, k_over: torch.Tensor | None) -> tuple:
        """Start the SimHash codes of the query rows and of the keys leaving the window (one GPU launch) and the
        query rows in float32 on their way to the host; ``_codes_wait`` collects them."""
        c = self.cfg
        qf = q3.float()
        rows = [qf.reshape(-1, q3.shape[-1])] + ([] if k_over is None else [k_over.reshape(-1, q3.shape[-1])])
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        codes = kmp.hash_codes(x, self.w, c.K, c.L, backend=self.backend_gpu).to(torch.int32)
        return _to_host_async(codes, qf), tuple(q3.shape), None if k_over is None else tuple(k_over.shape)

    def _codes_wait(self, started: tuple) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(q codes int32 [B, Hq, L], key codes int32 [B, Hkv, t, L] or None, q float32 [B, Hq, D]) on the host."""
        (codes, q_host), q_shape, k_shape = _wait_host(started[0]), started[1], started[2]
        nq = q_shape[0] * q_shape[1]
        q_codes = codes[:nq].view(*q_shape[:2], self.cfg.L)
        over = None if k_shape is None else codes[nq:].view(*k_shape[:3], self.cfg.L)
        return q_codes, over, q_host

    def _sample(self, q_codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(idx int32 [B, Hq, S] cache positions, −1 padded; count int32 [B, Hq]) of the sampled keys: the tables'
        samples (ascending), then the overflow list's (ascending), placed by the look-up's own kernels (on the
        H200 machine's Xeon, numpy passes for the sink offset, the padding and the overflow hits took ~0.9 ms per
        layer at 16K × 14 rows, more than the look-up's 0.7 ms; experiments/system_decode/session6)."""
        c = self.cfg
        idx, cnt = kmc.sample(self.tables, q_codes, c.min_collisions, backend=self.backend_cpu, index_offset=c.sink,
                              extra_codes=self.over_codes if self.n_over else None, extra_offset=self.table_end,
                              extra_count=self.n_over)
        return idx.numpy(), cnt.numpy()

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static(session, q, k_new, v_new, scaling)
        c = self.cfg
        n = self.n
        q3 = q[:, :, 0]  # [B, Hq, D]
        b, hq, d = q3.shape
        phase = session.phase
        if self.tables is None:  # first step with a candidate key: fix μ, build the tables
            self._build(n, q.device)
        codes = None
        if self.tables is not None:
            # the query's codes (and the new overflow keys') on their way to the host first
            with phase("magicpig_codes_to_host"):
                codes = self._codes_async(q3, self._overflow_keys(n))
        # the static keys, attended on the GPU with weight 1 (u = 1): sink [0, sink) and window [max(sink, n - local), n)
        s_n = min(c.sink, n)
        wk, wv = self._window(max(c.sink, n - c.local), n)
        static = (self.sink_k[:, :, :s_n], self.sink_v[:, :, :s_n], wk, wv)
        if codes is None:  # no candidate keys yet: every key is static
            with phase("magicpig_gpu_attention_merge"):
                o, _ = kmerge.attend_and_merge(q3, *static, torch.zeros(b, hq, d, device=q.device),
                                               torch.full((b, hq), float("-inf"), device=q.device), scaling,
                                               backend=self.backend_gpu)
                return o.to(q.dtype).unsqueeze(2)
        # CPU part: sampling and the −log u-corrected attention (eq. 11)
        with phase("magicpig_codes_to_host"):
            q_codes, over, q_host = self._codes_wait(codes)
            if over is not None:
                self._append_overflow(over)
        with phase("magicpig_cpu_sample"):
            idx, cnt = self._sample(q_codes)
        session.stats["sampled"] += int(cnt.sum(dtype=np.int64))
        session.stats["sample_rows"] += cnt.size
        session.stats["candidates"] += (self.cand_end - c.sink) * cnt.size
        with phase("magicpig_cpu_attention"):
            o_c, lse_c = kmc.attention(q_host, self.keys, self.values, torch.from_numpy(idx), torch.from_numpy(cnt),
                                       k_bits=c.K, n_tables=c.L, min_collisions=c.min_collisions, scaling=scaling,
                                       k_mean=self.mean_cpu, backend=self.backend_cpu)
        with phase("magicpig_gpu_attention_merge"):
            # the static keys' attention merged with the CPU part by log-sum-exp, in one launch on CUDA
            o, _ = kmerge.attend_and_merge(q3, *static, *_to_device(q.device, o_c, lse_c), scaling,
                                           backend=self.backend_gpu)
            return o.to(q.dtype).unsqueeze(2)

    # -- static steps (the captured decode step) ------------------------------------------------------------
    def _static_init(self) -> None:
        """From the eager layout to the static one, after at least one eager step: the window [n − local, n) moves
        into a ring of ``local`` slots (position p in slot p mod local, so the key that leaves the window when
        position p arrives is the one p overwrites), and fixed host (page-locked) and device buffers carry each
        step's codes, query, new K/V and the CPU part's output across the host part."""
        c = self.cfg
        n = self.n
        if self.tables is None or n - c.local < c.sink:
            raise ValueError(f"layer {self.layer_idx}: a static MagicPIG step needs the tables built and a full local "
                             f"window after the sink (n − local ≥ sink); n = {n}, local = {c.local}, sink = {c.sink}: "
                             f"decode with cuda_graph=false for prompts this short")
        if self.cand_end != n - c.local:
            raise RuntimeError(f"layer {self.layer_idx}: candidates end at {self.cand_end}, expected n − local = "
                               f"{n - c.local}")
        wk, wv = self._window(n - c.local, n)  # [B, Hkv, local, D], positions n − local .. n − 1
        slots = torch.arange(n - c.local, n, device=wk.device) % c.local
        ring_k = torch.empty_like(wk)
        ring_v = torch.empty_like(wv)
        ring_k[:, :, slots] = wk
        ring_v[:, :, slots] = wv
        self.ring = (ring_k, ring_v)
        self.host_n = n  # the position the next static step writes (host side)
        self._static_bufs: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fixed buffer of this layer's static steps: on ``device``, or on the host (``device`` cpu), page-locked
        when the GPU is in use (a copy to or from pageable memory cannot be captured)."""
        got = self._static_bufs.get(name)
        if got is None:
            if device.type == "cpu":
                got = torch.empty(shape, dtype=dtype, pin_memory=self.mean.is_cuda)
            else:
                got = torch.empty(shape, dtype=dtype, device=device)
            self._static_bufs[name] = got
        return got

    def _decode_static(self, session, q, k_new, v_new, scaling):
        """One decode step with static shapes (all shapes fixed, no host value read on the GPU side): the GPU
        work before the host part (window ring, the SimHash codes of the query and of the key leaving the window,
        copies to the host), ``session.cut`` (the host part, ``_host_part``: new K/V into the host cache, the
        table sampling and the CPU attention of eq. 11), then the merge by log-sum-exp with the static keys."""
        if self.ring is None:
            self._static_init()
        c = self.cfg
        st = self.static
        q3 = q[:, :, 0]  # [B, Hq, D]
        b, hq, d = q3.shape
        hkv = k_new.shape[1]
        ring_k, ring_v = self.ring
        slot = torch.remainder(st.pos, c.local)  # [1] on the device
        leaving = ring_k.index_select(2, slot)  # [B, Hkv, 1, D] position pos − local: it leaves the window now
        ring_k.index_copy_(2, slot, k_new)
        ring_v.index_copy_(2, slot, v_new)
        x = torch.cat([q3.float().reshape(-1, d), (leaving[:, :, 0].float() - self.mean).reshape(-1, d)])
        codes = kmp.hash_codes(x, self.w, c.K, c.L, backend=self.backend_gpu).to(torch.int32)  # [B·Hq + B·Hkv, L]
        host = torch.device("cpu")
        h_codes = self._buf("codes", tuple(codes.shape), torch.int32, host)
        h_q = self._buf("q", (b, hq, d), torch.float32, host)
        h_kv = self._buf("kv", (b, hkv, 2, d), k_new.dtype, host)
        # contiguous on both sides, so each is one asynchronous copy into page-locked memory (capturable)
        h_codes.copy_(codes, non_blocking=True)
        h_q.copy_(q3.float().contiguous(), non_blocking=True)
        h_kv.copy_(torch.stack([k_new[:, :, 0], v_new[:, :, 0]], 2), non_blocking=True)  # [B, Hkv, 2, D]
        h_o = self._buf("o", (b, hq, d), torch.float32, host)
        h_lse = self._buf("lse", (b, hq), torch.float32, host)
        session.cut(lambda: self._host_part(session, scaling))
        d_o = self._buf("o_dev", (b, hq, d), torch.float32, q.device)
        d_lse = self._buf("lse_dev", (b, hq), torch.float32, q.device)
        d_o.copy_(h_o, non_blocking=True)
        d_lse.copy_(h_lse, non_blocking=True)
        o, _ = kmerge.attend_and_merge(q3, self.sink_k[:, :, :c.sink], self.sink_v[:, :, :c.sink], ring_k, ring_v,
                                       d_o, d_lse, scaling, backend=self.backend_gpu)
        return o.to(q.dtype).unsqueeze(2)

    def _host_part(self, session, scaling: float) -> None:
        """The host part of a static step, once its copies have landed (host-side state only; no GPU work): the
        new token's K and V into the host cache at ``host_n``, the leaving key's codes onto the overflow list,
        the sampling and the CPU attention, whose output and log-sum-exp go to the fixed host buffers."""
        c = self.cfg
        bufs = self._static_bufs
        n = self.host_n
        self.kv[:, :, n].copy_(bufs["kv"])
        b, hq, d = bufs["q"].shape
        nq = b * hq
        q_codes = bufs["codes"][:nq].view(b, hq, c.L)
        over = bufs["codes"][nq:].view(b, -1, 1, c.L)
        self._append_overflow(over)
        self.cand_end += 1  # position n − local left the window
        t0 = time.perf_counter()
        idx, cnt = self._sample(q_codes)
        t1 = time.perf_counter()
        session.stats["sampled"] += int(cnt.sum(dtype=np.int64))
        session.stats["sample_rows"] += cnt.size
        session.stats["candidates"] += (self.cand_end - c.sink) * cnt.size
        o_c, lse_c = kmc.attention(bufs["q"], self.keys, self.values, torch.from_numpy(idx), torch.from_numpy(cnt),
                                   k_bits=c.K, n_tables=c.L, min_collisions=c.min_collisions, scaling=scaling,
                                   k_mean=self.mean_cpu, backend=self.backend_cpu)
        t2 = time.perf_counter()
        bufs["o"].copy_(o_c)
        bufs["lse"].copy_(lse_c)
        self.host_n = n + 1
        # where the host parts' time goes (per-layer averages: stats / host_parts): the look-up, the attention
        session.stats["host_parts"] += 1
        session.stats["host_sample_ms"] += 1e3 * (t1 - t0)
        session.stats["host_attention_ms"] += 1e3 * (t2 - t1)


def _to_device(dev: torch.device, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of host tensors on ``dev``, through page-locked memory without a wait (a copy from pageable memory
    would block until the stream reaches it)."""
    if dev.type != "cuda":
        return xs
    return tuple(x.pin_memory().to(dev, non_blocking=True) for x in xs)


def _to_host_async(*xs: torch.Tensor) -> tuple:
    """Start copies of ``xs`` to the host (into page-locked memory when they are on the GPU); ``_wait_host`` returns
    them once they have landed.  One wait for all of them rather than one each, and the stream may go on with other
    work meanwhile."""
    if not xs or not xs[0].is_cuda:
        return tuple(x.cpu() for x in xs), None
    out = tuple(x.to("cpu", non_blocking=True) for x in xs)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(xs[0].device))
    return out, done


def _wait_host(started: tuple) -> tuple[torch.Tensor, ...]:
    out, done = started
    if done is not None:
        done.synchronize()
    return out


def _to_host(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CPU copies of ``xs``, waited for (see ``_to_host_async``)."""
    return _wait_host(_to_host_async(*xs))


def rope_function(attn_module: Any):
    """The modeling module's ``apply_rotary_pos_emb`` for an attention module (None if it has none)."""
    return getattr(sys.modules[type(attn_module).__module__], "apply_rotary_pos_emb", None)


__all__ = ["FullLayer", "DSLayer", "DSOffloadLayer", "MagicPIGLayer", "QuestLayer", "StaticStep", "rope_function"]
