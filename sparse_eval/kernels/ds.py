"""Double Sparsity (arXiv 2408.07092), decode step, Algorithm 1:

    Q_label = Q[C]                       (line 3: the r = α·d calibrated channels C of the head)
    ŝ       = Q_label · K_labelᵀ          (line 4: label scores over the contiguous label cache)
    i       = argtopk(ŝ, k)               (line 5: k = β·S tokens)
    y       = softmax(Q K[i]ᵀ / √d) V[i]  (lines 6–7: ``kernels.sparse_decode.attention``)

The label cache (§4.2) holds the C channels of every key, contiguous per head, at 16 bits (fp16/bf16 values),
or 8/4 bits: integer codes with a per-token scale and zero point, x̂ = code·scale + zero (min–max over the
token's r channels), 4-bit codes packed two per byte (channel 2j in the low nibble, 2j+1 in the high one).

Shapes: B batch, Hq query heads, Hkv KV heads, Hl label heads (Hl = Hkv: channels per KV head; Hl = Hq: channels
per query head, label l built from KV head l // (Hq/Hkv)), N tokens, r label channels, D head dim.

Head sharing of the selection (``gqa``): "query_head" (each query head its own top-k, the paper's MHA setting)
or "kv_head" (one top-k per KV group on the summed label scores, so each selected row is read once for the G
query heads of the group).  With Hl = Hkv the group sum is computed inside the kernel from the summed query
labels (Σ_j q_j)·k̂, which equals Σ_j q_j·k̂ exactly in real arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import sparse_decode
from ._common import check_heads, resolve_gpu_backend

__all__ = [
    "LabelCache",
    "build_label_cache",
    "quantize_labels",
    "dequantize_labels",
    "gather_query_channels",
    "label_channels",
    "pseudo_quantize",
    "query_labels",
    "query_labels_reference",
    "append_labels",
    "append_labels_reference",
    "label_scores",
    "label_scores_reference",
    "TOPK_IMPLS",
    "topk_indices",
    "decode",
    "decode_reference",
]

LABEL_BITS = (4, 8, 16)
GQA_MODES = ("query_head", "kv_head")


@dataclass
class LabelCache:
    """labels: 16-bit [B, Hl, N, r] fp16/bf16; 8-bit uint8 [B, Hl, N, r]; 4-bit uint8 [B, Hl, N, r/2].
    scale, zero: [B, Hl, N] (8/4-bit only)."""

    labels: torch.Tensor
    bits: int
    r: int
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        b, hl, n = self.labels.shape[:3]
        return b, hl, n

    def nbytes(self) -> int:
        t = self.labels.numel() * self.labels.element_size()
        for x in (self.scale, self.zero):
            if x is not None:
                t += x.numel() * x.element_size()
        return t


def _check_bits(bits: int) -> None:
    if bits not in LABEL_BITS:
        raise ValueError(f"label bits={bits!r}: valid values are {list(LABEL_BITS)}")


def quantize_labels(
    x: torch.Tensor, bits: int = 16, *, dtype: torch.dtype | None = None, scale_dtype: torch.dtype = torch.float16
) -> LabelCache:
    """x [B, Hl, N, r] float -> LabelCache.  16 bits: x in ``dtype`` (default x's dtype if 16-bit, else fp16).
    8/4 bits: per-token min–max, scale = (max − min)·(1/(2^bits − 1)), zero = min, code = round((x − zero)/scale)."""
    _check_bits(bits)
    if x.dim() != 4:
        raise ValueError(f"labels: expected [B, Hl, N, r], got {tuple(x.shape)}")
    r = x.shape[-1]
    if bits == 16:
        dt = dtype or (x.dtype if x.dtype in (torch.float16, torch.bfloat16) else torch.float16)
        if dt not in (torch.float16, torch.bfloat16):
            raise ValueError(f"16-bit labels: dtype={dt} is not one of [torch.float16, torch.bfloat16]")
        return LabelCache(labels=x.to(dt).contiguous(), bits=16, r=r)
    if bits == 4 and r % 2:
        raise ValueError(f"4-bit labels pack two channels per byte: r={r} must be even")
    xf = x.float()
    lo = xf.amin(-1)
    hi = xf.amax(-1)
    levels = (1 << bits) - 1
    # × (1/levels), not ÷ levels: torch divides by a scalar exactly on the CPU but by its reciprocal on CUDA, so
    # the product is the one formula that rounds the same everywhere (and in the one-launch kernel)
    scale = ((hi - lo) * (1.0 / levels)).to(scale_dtype)
    zero = lo.to(scale_dtype)
    s32 = scale.float()
    codes = (
        torch.where(
            s32.unsqueeze(-1) > 0,
            torch.round((xf - zero.float().unsqueeze(-1)) / s32.clamp_min(1e-30).unsqueeze(-1)),
            torch.zeros_like(xf),
        )
        .clamp(0, levels)
        .to(torch.uint8)
    )
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return LabelCache(labels=codes.contiguous(), bits=bits, r=r, scale=scale.contiguous(), zero=zero.contiguous())


def dequantize_labels(cache: LabelCache) -> torch.Tensor:
    """LabelCache -> float32 [B, Hl, N, r]."""
    if cache.bits == 16:
        return cache.labels.float()
    codes = cache.labels
    if cache.bits == 4:
        lo = (codes & 15).float()
        hi = (codes >> 4).float()
        codes_f = torch.stack((lo, hi), dim=-1).flatten(-2)
    else:
        codes_f = codes.float()
    return codes_f * cache.scale.float().unsqueeze(-1) + cache.zero.float().unsqueeze(-1)


def _label_to_kv(hl: int, hkv: int) -> torch.Tensor:
    if hl % hkv:
        raise ValueError(
            f"label heads ({hl}) must be a multiple of KV heads ({hkv}): give channels per KV head "
            f"[Hkv, r] or per query head [Hq, r]"
        )
    return torch.arange(hl) // (hl // hkv)


def build_label_cache(
    k: torch.Tensor,
    channels: torch.Tensor,
    bits: int = 16,
    *,
    dtype: torch.dtype | None = None,
    scale_dtype: torch.dtype = torch.float16,
) -> LabelCache:
    """k [B, Hkv, N, D], channels [Hl, r] (long, the calibrated channel ids per label head) -> LabelCache.
    Label head l holds k[:, l // (Hl/Hkv), :, channels[l]]."""
    if k.dim() != 4 or channels.dim() != 2:
        raise ValueError(
            f"expected k [B, Hkv, N, D] and channels [Hl, r]; got {tuple(k.shape)}, {tuple(channels.shape)}"
        )
    b, hkv, n, d = k.shape
    hl, r = channels.shape
    if channels.numel() and (int(channels.min()) < 0 or int(channels.max()) >= d):
        raise ValueError(f"channels must lie in [0, {d}); got range [{int(channels.min())}, {int(channels.max())}]")
    x = label_channels(k, channels.to(k.device), _label_to_kv(hl, hkv).to(k.device))
    return quantize_labels(x, bits, dtype=dtype, scale_dtype=scale_dtype)


def label_channels(k: torch.Tensor, channels: torch.Tensor, kv_of: torch.Tensor) -> torch.Tensor:
    """k [B, Hkv, T, D] -> x [B, Hl, T, r]: label head l takes channels[l] of KV head kv_of[l] (all on k's
    device; no checks, so nothing synchronises)."""
    b, _, t, _ = k.shape
    hl, r = channels.shape
    return torch.gather(k[:, kv_of], -1, channels.long().view(1, hl, 1, r).expand(b, hl, t, r))


def gather_query_channels(q: torch.Tensor, channels: torch.Tensor) -> torch.Tensor:
    """q [B, Hq, D], channels [Hl, r] -> q_label [B, Hq, r] float32 (query head h uses label head h // (Hq/Hl))."""
    b, hq, d = q.shape
    hl, r = channels.shape
    if hq % hl:
        raise ValueError(f"query heads ({hq}) must be a multiple of label heads ({hl})")
    ch = channels.to(q.device).long().repeat_interleave(hq // hl, dim=0)  # [Hq, r]
    return torch.gather(q.float(), -1, ch.unsqueeze(0).expand(b, hq, r))


def pseudo_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Asymmetric min/max quantization over the last dim, 2^bits − 1 levels, dequantized (fp32); a constant vector
    is returned unchanged.  DS quantizes the query's label channels like this (``methods.double_sparsity``)."""
    x = x.float()
    if bits >= 16:
        return x
    levels = 2**bits - 1
    lo = x.amin(-1, keepdim=True)
    hi = x.amax(-1, keepdim=True)
    rng = hi - lo
    rng = torch.where(rng > 0, rng, torch.ones_like(rng))
    scale = levels / rng  # torch evaluates this as rng.reciprocal() * levels (the one-launch kernel does the same)
    return torch.round((x - lo) * scale).clamp(0, levels) / scale + lo


def query_labels_reference(q: torch.Tensor, q_channels: torch.Tensor, bits: int, quantize: bool = True) -> torch.Tensor:
    """q [B, Hq, D], q_channels [Hq, r] (the label channels of each query head) -> q_label [B, Hq, r] float32,
    pseudo-quantized to ``bits`` when ``quantize`` (Alg. 1 line 3 with the label cache's precision)."""
    b, hq, _ = q.shape
    ql = torch.gather(q, -1, q_channels.to(q.device).long().unsqueeze(0).expand(b, hq, q_channels.shape[1])).float()
    return pseudo_quantize(ql, bits) if quantize else ql


def query_labels(
    q: torch.Tensor, q_channels: torch.Tensor, bits: int, quantize: bool = True, *, backend: str = "auto"
) -> torch.Tensor:
    """``query_labels_reference`` in one launch on CUDA (bit-identical)."""
    if q.dim() != 3 or q_channels.dim() != 2 or q_channels.shape[0] != q.shape[1]:
        raise ValueError(
            f"expected q [B, Hq, D] and q_channels [Hq, r]; got {tuple(q.shape)}, {tuple(q_channels.shape)}"
        )
    if resolve_gpu_backend(backend, q, q_channels) == "torch":
        return query_labels_reference(q, q_channels, bits, quantize)
    from . import _tl_labels

    return _tl_labels.query_labels(q, q_channels, bits, quantize)


def append_labels_reference(
    k_new: torch.Tensor,
    channels: torch.Tensor,
    kv_of: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    pos: torch.Tensor,
    bits: int,
) -> None:
    """The labels of one step's keys k_new [B, Hkv, 1, D] (label head l: KV head kv_of[l], channels[l]) quantized as
    ``quantize_labels`` and written at position pos (long [1], on the device) of a preallocated cache: codes
    [B, Hl, cap, r or r/2], scale / zero [B, Hl, cap] (8/4-bit).  In place."""
    new = quantize_labels(
        label_channels(k_new, channels, kv_of),
        bits,
        dtype=codes.dtype if bits == 16 else None,
        scale_dtype=scale.dtype if scale is not None else torch.float16,
    )
    codes.index_copy_(2, pos, new.labels)
    if bits != 16:
        scale.index_copy_(2, pos, new.scale)
        zero.index_copy_(2, pos, new.zero)


def append_labels(
    k_new: torch.Tensor,
    channels: torch.Tensor,
    kv_of: torch.Tensor,
    codes: torch.Tensor,
    scale: torch.Tensor | None,
    zero: torch.Tensor | None,
    pos: torch.Tensor,
    bits: int,
    *,
    backend: str = "auto",
) -> None:
    """``append_labels_reference`` in one launch on CUDA (bit-identical codes, scales and zeros)."""
    _check_bits(bits)
    if k_new.dim() != 4 or k_new.shape[2] != 1:
        raise ValueError(f"k_new {tuple(k_new.shape)}: expected one step's keys [B, Hkv, 1, D]")
    if (bits == 16) != (scale is None):
        raise ValueError(f"label bits={bits}: scale and zero are needed exactly for 8/4-bit labels")
    if resolve_gpu_backend(backend, k_new, codes, pos) == "torch":
        return append_labels_reference(k_new, channels, kv_of, codes, scale, zero, pos, bits)
    from . import _tl_labels

    _tl_labels.append_labels(k_new, channels, kv_of, codes, scale, zero, pos, bits)


def _check_scores_args(q_label: torch.Tensor, cache: LabelCache, lengths):
    b, hl, n = cache.shape
    if q_label.dim() != 3 or q_label.shape[0] != b or q_label.shape[2] != cache.r:
        raise ValueError(f"q_label {tuple(q_label.shape)}: expected [B={b}, Hq, r={cache.r}]")
    hq = q_label.shape[1]
    if hq % hl:
        raise ValueError(f"query heads ({hq}) must be a multiple of label heads ({hl})")
    if lengths is not None and tuple(lengths.shape) != (b,):
        raise ValueError(f"lengths {tuple(lengths.shape)}: expected [B={b}]")
    return b, hq, hl, n


def label_scores_reference(
    q_label: torch.Tensor, cache: LabelCache, *, reduce: bool = False, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """ŝ = q_label · k̂_labelᵀ (Alg. 1 line 4).  q_label [B, Hq, r]; returns float32 [B, Hq, N], or with
    ``reduce`` [B, Hl, N] summed over the query heads of each label head.  Tokens at positions ≥ lengths[b]
    score −inf."""
    b, hq, hl, n = _check_scores_args(q_label, cache, lengths)
    lab = dequantize_labels(cache)  # [B, Hl, N, r]
    qpl = hq // hl
    s = torch.einsum("bljr,blnr->bljn", q_label.float().view(b, hl, qpl, cache.r), lab)  # [B, Hl, QPL, N]
    s = s.sum(2) if reduce else s.reshape(b, hq, n)
    if lengths is not None:
        s = s.masked_fill(
            torch.arange(n, device=s.device).view(1, 1, n) >= lengths.to(s.device).view(b, 1, 1), float("-inf")
        )
    return s


def label_scores(
    q_label: torch.Tensor,
    cache: LabelCache,
    *,
    reduce: bool = False,
    lengths: torch.Tensor | None = None,
    backend: str = "auto",
    block_n: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Label scores (see ``label_scores_reference``); Triton on CUDA."""
    _check_scores_args(q_label, cache, lengths)
    which = resolve_gpu_backend(backend, q_label, cache.labels)
    if which == "torch":
        return label_scores_reference(q_label, cache, reduce=reduce, lengths=lengths)
    from . import _tl_scores

    return _tl_scores.label_scores(q_label, cache, reduce=reduce, lengths=lengths, block_n=block_n, num_warps=num_warps)


TOPK_IMPLS = ("radix", "torch")


def topk_indices(scores: torch.Tensor, k: int, *, backend: str = "auto", topk: str = "radix") -> torch.Tensor:
    """Top-k positions per row of scores [..., N] as int32 [..., min(k, N)], in no particular order; positions
    whose score is −inf (beyond a row's length) are returned as −1 (padding).  ``topk="radix"``: the sort-free
    radix select of ``kernels.topk`` where ``backend`` resolves to Triton (CUDA fp32 scores), ``torch.topk``
    otherwise; ``topk="torch"``: always ``torch.topk``."""
    if k < 1:
        raise ValueError(f"top-k size k={k}: must be >= 1")
    if topk not in TOPK_IMPLS:
        raise ValueError(f"topk={topk!r}: valid values are {list(TOPK_IMPLS)}")
    k = min(int(k), scores.shape[-1])
    if topk == "radix" and scores.dtype == torch.float32 and resolve_gpu_backend(backend, scores) == "triton":
        from . import topk as ktopk

        return ktopk.select(scores, k, backend="triton")
    vals, ids = torch.topk(scores, k, dim=-1, sorted=False)
    return torch.where(vals > float("-inf"), ids, torch.full_like(ids, -1)).to(torch.int32)


def _select(q, cache, channels, hkv, budget, gqa, lengths, backend, topk):
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa={gqa!r}: valid values are {list(GQA_MODES)}")
    b, hq, _ = q.shape
    g = check_heads(hq, hkv)
    hl = cache.shape[1]
    if hl not in (hkv, hq):
        raise ValueError(f"label heads ({hl}) must equal KV heads ({hkv}) or query heads ({hq})")
    q_label = gather_query_channels(q, channels)  # [B, Hq, r]
    if gqa == "kv_head" and hl == hkv:
        # (Σ_j q_j)·k̂ = Σ_j q_j·k̂: one row per label head
        scores = label_scores(q_label.view(b, hkv, g, -1).sum(2), cache, lengths=lengths, backend=backend)
    else:
        scores = label_scores(q_label, cache, lengths=lengths, backend=backend)  # [B, Hq, N]
        if gqa == "kv_head":
            scores = scores.view(b, hkv, g, -1).sum(2)
    return topk_indices(scores, budget, backend=backend, topk=topk)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LabelCache,
    channels: torch.Tensor,
    budget: int,
    *,
    gqa: str = "query_head",
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
    backend: str = "auto",
    topk: str = "radix",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Double Sparsity decode step.  q [B, Hq, D]; k, v [B, Hkv, N, D]; cache over the same N tokens;
    channels [Hl, r]; budget = k (tokens per selection); ``topk`` as in ``topk_indices``.  Returns (o [B, Hq, D],
    lse [B, Hq], idx [B, Hq or Hkv, budget] int32)."""
    idx = _select(q, cache, channels, k.shape[1], budget, gqa, lengths, backend, topk)
    o, lse = sparse_decode.attention(q, k, v, idx, scaling=scaling, backend=backend)
    return o, lse, idx


def decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cache: LabelCache,
    channels: torch.Tensor,
    budget: int,
    *,
    gqa: str = "query_head",
    scaling: float | None = None,
    lengths: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return decode(
        q, k, v, cache, channels, budget, gqa=gqa, scaling=scaling, lengths=lengths, backend="torch", topk="torch"
    )
