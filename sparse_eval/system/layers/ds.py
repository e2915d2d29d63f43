"""Double Sparsity's system layers (DS §4.2, Algorithm 1; DS-Offload §5.1).

* ``DSLayer``: KV cache on the GPU plus a contiguous, quantized label cache; per step: label scores, top-k,
  attention over the selected rows (``kernels.ds``, ``kernels.sparse_decode``).
* ``DSOffloadLayer``: KV cache in pinned CPU memory (token-major), label cache on the GPU; the tokens of layer l
  are predicted from layer l−1's input (``DoubleSparsity.predict_query``) and gathered from host memory on a
  side CUDA stream into a double buffer while layer l−1 computes; the current token's key joins the top-k exactly
  (see ``_include_new``).

Both select the keys of ``methods.double_sparsity`` (``tests/system/test_system.py``) and keep no static keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import sparse_eval.kernels.ds as kds
import sparse_eval.kernels.offload as koff
import sparse_eval.kernels.sparse_decode as ksd
import sparse_eval.kernels.topk as ktopk

from ...methods.base import budget_bound
from .base import SelectsTopK, check_topk
from .full import FullLayer
from .registry import LayerOptions, register_layer


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
                raise ValueError(
                    f"DS channels for {hl} label heads: must be a multiple of the {hkv} KV heads and "
                    f"divide the {hq} query heads"
                )
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
        return kds.quantize_labels(
            kds.label_channels(k, ix["ch"], ix["kv_of"]), self.bits, scale_dtype=self.scale_dtype
        )

    def append(self, k: torch.Tensor, capacity: int, hq: int) -> None:
        new = self.labels_of(k, hq)
        if self.codes is None:
            b, hl, _ = new.shape
            self.codes = torch.empty((b, hl, capacity, new.labels.shape[-1]), dtype=new.labels.dtype, device=k.device)
            if new.scale is not None:
                self.scale = torch.empty((b, hl, capacity), dtype=new.scale.dtype, device=k.device)
                self.zero = torch.empty_like(self.scale)
        t = k.shape[2]
        self.codes[:, :, self.n : self.n + t] = new.labels
        if new.scale is not None:
            self.scale[:, :, self.n : self.n + t] = new.scale
            self.zero[:, :, self.n : self.n + t] = new.zero
        self.n += t

    def append_at(self, k: torch.Tensor, pos: torch.Tensor, hq: int, backend: str = "auto") -> None:
        """Write the labels of one step's keys k [B, Hkv, 1, D] at the device-side position pos [1]
        (``kernels.ds.append_labels``: one launch on CUDA)."""
        ix = self.device_index(hq, k.shape[1], k.shape[3], k.device)
        kds.append_labels(k, ix["ch"], ix["kv_of"], self.codes, self.scale, self.zero, pos, self.bits, backend=backend)

    def view(self, n: int) -> kds.LabelCache:
        return kds.LabelCache(
            labels=self.codes[:, :, :n],
            bits=self.bits,
            r=self.channels.shape[1],
            scale=None if self.scale is None else self.scale[:, :, :n],
            zero=None if self.zero is None else self.zero[:, :, :n],
        )

    def repeat_batch(self, times: int) -> None:
        for name in ("codes", "scale", "zero"):
            x = getattr(self, name)
            if x is not None:
                setattr(self, name, x.repeat(times, *([1] * (x.dim() - 1))))


@register_layer("double_sparsity")
class DSLayer(SelectsTopK, FullLayer):
    """Double Sparsity decode (Algorithm 1) over a GPU KV cache.  ``channels`` long [Hl, r] (Hl = Hq: per query
    head, the calibrated "qk" channels; Hl = Hkv: per KV head), ``beta`` the token budget (ratio of the context
    or a token count), ``gqa`` "query_head" (a top-k per query head) or "kv_head" (one per KV group, label
    scores summed over the group); ``topk`` "radix" (``kernels.topk`` on CUDA, ``torch.topk`` elsewhere) or
    "torch" (always ``torch.topk``): the same keys up to ties."""

    kind = "double_sparsity"

    def __init__(
        self,
        layer_idx: int,
        capacity: int,
        channels: torch.Tensor,
        *,
        hq: int,
        beta: float | int,
        bits: int = 4,
        quantize_query: bool = True,
        gqa: str = "query_head",
        scale_dtype: torch.dtype = torch.float16,
        backend: str = "auto",
        kv_device=None,
        topk: str = "radix",
    ):
        super().__init__(layer_idx, capacity, kv_device, backend=backend)
        if gqa not in kds.GQA_MODES:
            raise ValueError(f"gqa={gqa!r}: valid values are {list(kds.GQA_MODES)}")
        self.topk = check_topk(topk)
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
        """max(1, ``budget_bound(β, n)``): the token budget (the accuracy path's count), capped at n, at least 1."""
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
        o, _ = ksd.attention(
            q3, self.keys[:, :, :n], self.values[:, :, :n], idx, scaling=scaling, backend=self.backend
        )  # lines 6-7
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
        o, _ = ksd.attention(
            q3, self.keys, self.values, ids, count=count, scaling=scaling, backend=self.backend
        )  # lines 6-7
        return o.unsqueeze(2)

    @classmethod
    def variant(cls, cfg):
        return DSOffloadLayer if cfg.get("offload") else DSLayer

    @classmethod
    def check_options(cls, cfg):
        if cfg.get("label_bits") not in kds.LABEL_BITS:
            raise ValueError(
                f"method.label_bits={cfg.get('label_bits')!r}: the system path's label cache packs "
                f"{list(kds.LABEL_BITS)} bits (the accuracy path, python -m sparse_eval, takes 1..8 and "
                f"16)"
            )

    @classmethod
    def label_bytes(cls, cfg: dict[str, Any], n: int, hkv: int, d: int) -> int:
        """The label cache of one row and layer: hkv · n · (r / 2 + 4), 4-bit codes of r = α·d channels and an fp16
        scale and zero."""
        r = int(cfg.get("alpha", 0.25) * d)
        return hkv * n * (r // 2 + 4)

    @classmethod
    def row_bytes(cls, cfg, n, steps, hkv, d):
        """The KV cache and the label cache, on the GPU."""
        gpu, cpu = super().row_bytes(cfg, n, steps, hkv, d)
        return gpu + cls.label_bytes(cfg, n, hkv, d), cpu

    @classmethod
    def from_method(cls, layer_idx: int, method: Any, opts: LayerOptions) -> "DSLayer":
        """A ``DSLayer``, or a ``DSOffloadLayer`` with ``method.offload``, with the layer's channels per label head
        (``DoubleSparsity.label_channels``)."""
        c = method.config
        if c.sink or c.local:
            raise ValueError(
                f"method.sink={c.sink}, method.local={c.local}: the DS system layers keep no static "
                f"keys (the paper's setting); set both to 0"
            )
        layer_cls = cls.variant({"offload": c.offload})
        return layer_cls(
            layer_idx,
            opts.capacity,
            method.label_channels(layer_idx, opts.hq, opts.hkv, opts.d),
            hq=opts.hq,
            beta=c.beta,
            bits=c.label_bits,
            quantize_query=c.quantize_query,
            gqa=c.gqa,
            scale_dtype=opts.label_scale_dtype,
            backend=opts.backend_gpu,
            topk=opts.topk,
        )


@dataclass
class Prefetch:
    """One layer's keys chosen with a predicted query and gathered into the session's buffer, kept by the layer from
    its ``prefetch`` (during the previous layer) until its own decode.  buf_k/buf_v [B, Hs, S, D] (the last slot left
    for the new key); ql [B, Hq, r] the predicted query's label channels; k_tot the budget over all n keys and k_old
    the old keys selected (ints eager, [B, Hs] device counts static)."""

    event: Any  # torch.cuda.Event the compute stream waits for (None: gathered at once, on the CPU)
    buf_k: torch.Tensor
    buf_v: torch.Tensor
    ql: torch.Tensor
    k_tot: Any
    k_old: Any
    vals: torch.Tensor | None = None  # eager: the k_old best old scores, sorted descending [B, Hs, k_old]
    n_old: int | None = None  # eager: the stored keys scored
    ids: torch.Tensor | None = None  # static: selected positions [B, Hs, k_cap], −1 padded
    kth: torch.Tensor | None = None  # static: the lowest selected score [B, Hs]
    kth_slot: torch.Tensor | None = None  # static: its slot [B, Hs]


class DSOffloadLayer(DSLayer):
    """DS-Offload (DS §5.1): the KV cache in pinned host memory; the label cache on the GPU.  Its ``prefetch`` (run
    while the previous layer computes) scores this layer's keys with an approximate query from the previous layer's
    input and gathers the top rows into a GPU buffer on a side stream; the layer keeps that ``Prefetch`` until its
    decode."""

    kind = "ds_offload"
    prefetched = True  # this layer's keys are predicted and gathered during the previous layer

    def prefetch(self, session, prev_idx: int) -> None:
        """This layer's approximate query from layer ``prev_idx``'s decode input (``DoubleSparsity.predict_query``,
        the accuracy path's rule), then its top keys' gather (``predict``).  Without that input (no position
        embeddings, or no rotary function in the model's module) nothing is kept and the decode uses its own
        query."""
        got = session.inputs.get(prev_idx)
        if got is None or got[1] is None:
            return
        h, (cos, sin) = got
        qp = session.method.predict_query(
            session.modules[self.layer_idx], self.layer_idx, h[:, -1:], cos[:, -1:], sin[:, -1:], self.keys.shape[-1]
        )
        if qp is not None:
            self.pending = self.predict(session, qp[:, :, 0])

    def release(self) -> None:
        self.pending = None

    def _take_pending(self) -> Prefetch | None:
        p, self.pending = self.pending, None
        return p

    @classmethod
    def check_ready(cls, method):
        if method.config.offload_input == "residual" and not method.has_input_norms:
            raise ValueError(
                "DS-Offload with offload_input='residual' needs method.setup(model, ...) first (it finds "
                "each layer's input norm)"
            )

    @classmethod
    def row_bytes(cls, cfg, n, steps, hkv, d):
        """The KV cache in pinned host memory, the label cache on the GPU."""
        kv, _ = FullLayer.row_bytes(cfg, n, steps, hkv, d)
        return cls.label_bytes(cfg, n, hkv, d), kv

    def __init__(self, *args: Any, **kwargs: Any):
        kwargs["kv_device"] = "cpu"
        super().__init__(*args, **kwargs)
        self.pending: Prefetch | None = None  # this step's keys, chosen during the previous layer

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

    def _side_gather(
        self, session, ids: torch.Tensor, buf_k: torch.Tensor, buf_v: torch.Tensor, record: bool
    ) -> torch.cuda.Event | None:
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

    def predict(self, session, q_pred: torch.Tensor) -> Prefetch:
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
        buf_k, buf_v = session.buffer(
            self.layer_idx, (ids.shape[0], hs, k_tot + 1, self.keys.shape[-1]), self.keys.dtype, q_pred.device
        )
        event = self._side_gather(session, ids, buf_k[:, :, :k_old], buf_v[:, :, :k_old], record=True)
        return Prefetch(event, buf_k, buf_v, ql, k_tot, k_old, vals=vals, n_old=n_old)

    def _predict_static(self, session, q_pred: torch.Tensor) -> Prefetch:
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
        buf_k, buf_v = session.buffer(
            self.layer_idx, (b, hs, k_cap + 1, self.keys.shape[-1]), self.keys.dtype, q_pred.device
        )
        event = self._side_gather(session, ids, buf_k[:, :, :k_cap], buf_v[:, :, :k_cap], record=False)
        return Prefetch(event, buf_k, buf_v, ql, k_tot, k_old, ids=ids, kth=kth, kth_slot=kth_slot)

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

    def _put_new(self, buf_k: torch.Tensor, buf_v: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor) -> int:
        """The new token's key and value [B, Hkv, 1, D] into the last slot of the gathered rows [B, Hs, S, D] (each
        KV head's for its selection heads); returns that slot."""
        hs, hkv = buf_k.shape[1], self.keys.shape[1]
        last = buf_k.shape[2] - 1
        buf_k[:, :, last] = k_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        buf_v[:, :, last] = v_new[:, :, 0].repeat_interleave(hs // hkv, 1)
        return last

    def _include_new(self, p: Prefetch) -> torch.Tensor:
        """Exact top-k over all n keys from the top-k of the n−1 old ones: the new key (scored with the same
        predicted query) enters iff the old keys did not fill the budget or it beats the k-th best old score; it
        then replaces that k-th key.  bool [B, Hs]."""
        s_new = self._new_score(p.ql, self._new[0])
        if p.k_old < p.k_tot:
            return torch.ones_like(s_new, dtype=torch.bool)
        return s_new > p.vals[..., -1]

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static_offload(session, q, k_new, v_new, scaling)
        p = self._take_pending()
        q3 = q[:, :, 0]
        if p is None:  # no predecessor input (first layer): the layer's own query, gathered synchronously
            p = self._own(session, q3)
            session.stats["offload_own_query"] += 1
        elif p.event is not None:
            torch.cuda.current_stream(q.device).wait_event(p.event)
        buf_k, buf_v, k_tot, k_old = p.buf_k, p.buf_v, p.k_tot, p.k_old
        b, hs = buf_k.shape[:2]
        last = self._put_new(buf_k, buf_v, k_new, v_new)
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
        if p.event is not None:
            torch.cuda.current_stream(q3.device).wait_event(p.event)
            p.event = None
        return p

    def _decode_static_offload(self, session, q, k_new, v_new, scaling):
        """``decode`` with static shapes: the buffer's k_cap gathered slots (−1 where a row selected fewer), the
        new key in the last slot if it enters the exact top-k of all n keys (it beats the lowest selected old
        score, or the old keys did not fill the budget), displacing that lowest one when the budget was full."""
        p = self._take_pending()
        q3 = q[:, :, 0]
        if p is None:  # no predecessor input (first layer): the layer's own query (it scores the old keys only)
            p = self._predict_static(session, q3)
            session.stats["offload_own_query"] += 1
        if p.event is not None:
            torch.cuda.current_stream(q.device).wait_event(p.event)
        buf_k, buf_v, ids = p.buf_k, p.buf_v, p.ids
        b, hs = buf_k.shape[:2]
        last = self._put_new(buf_k, buf_v, k_new, v_new)  # = k_cap
        full = p.k_old == p.k_tot  # [B, Hs]
        inc = ~full | (self._new_score(p.ql, k_new) > p.kth)
        slot = torch.arange(last, device=q.device, dtype=torch.int32).expand(b, hs, last)
        idx = torch.cat([torch.where(ids >= 0, slot, -1), torch.where(inc, last, -1).to(torch.int32).unsqueeze(-1)], -1)
        at = p.kth_slot.unsqueeze(-1)  # [B, Hs, 1]
        idx.scatter_(-1, at, torch.where((inc & full).unsqueeze(-1), -1, idx.gather(-1, at)))
        o, _ = ksd.attention(q3, buf_k, buf_v, idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)
