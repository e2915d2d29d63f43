"""Decode attention over selected token indices (one query token per sequence), GQA and batch > 1.

For query head h of sequence b, with KV head g(h) = h // G (G = Hq / Hkv) and selected indices
I = {idx[b, h', t] : t < count[b, h'], idx ≥ 0} (h' = h, or h's KV head when the selection is shared per
KV group):

    s_t = q[b,h]·k[b,g(h),I_t] · scaling
    lse = log Σ_t e^{s_t}                       (natural log; −inf when I is empty)
    o   = Σ_t e^{s_t − lse} v[b,g(h),I_t]        (0 when I is empty)

Repeated indices count once per occurrence (attention over the multiset).  This is the attention step of
Double Sparsity (Alg. 1, lines 6–7, over the top-k tokens) and of Quest (over the tokens of the top pages);
``lse`` lets a partial output be merged exactly with another one (``kernels.merge.merge_by_lse``).

The Triton path is a split-K ("flash-decoding") kernel: programs over (b, index head, split of the index
list), each running an online softmax over BLOCK_N gathered rows at a time and writing an unnormalised partial
(acc, m, l); a second kernel reduces the splits.  When the selection is shared per KV group one program
serves all G query heads of the group, so each selected K/V row is read once.
"""

from __future__ import annotations

import math

import torch

from ._common import check_heads, resolve_gpu_backend, split_plan

__all__ = ["attention", "attention_reference", "dense_attention", "dense_attention_reference", "split_plan"]


def _check_qkv(q, k, v) -> int:
    """Shapes of a decode call: q [B, Hq, D], k, v [B, Hkv, N, D] of one dtype; returns G = Hq / Hkv."""
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape or v.dtype != k.dtype:
        raise ValueError(
            f"expected q [B, Hq, D] and k, v [B, Hkv, N, D] of one dtype; got q {tuple(q.shape)}, k {tuple(k.shape)} "
            f"{k.dtype}, v {tuple(v.shape)} {v.dtype}"
        )
    b, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    return check_heads(hq, k.shape[1])


def _check(q, k, v, idx, count):
    g = _check_qkv(q, k, v)
    b, hq, _ = q.shape
    if idx.dim() != 3 or idx.shape[0] != b or idx.shape[1] not in (hq, k.shape[1]):
        raise ValueError(
            f"idx {tuple(idx.shape)}: expected [B, Hq, S] (one selection per query head) or [B, Hkv, S] (shared "
            f"per KV group) with B={b}, Hq={hq}, Hkv={k.shape[1]}"
        )
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx dtype {idx.dtype}: expected torch.int32 or torch.int64")
    if count is not None and tuple(count.shape) != tuple(idx.shape[:2]):
        raise ValueError(f"count {tuple(count.shape)}: expected {tuple(idx.shape[:2])} (one per index row)")
    return g


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    scaling: float | None = None,
    count: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch: gather the selected rows, fp32 softmax, weighted sum.  See the module docstring."""
    g = _check(q, k, v, idx, count)
    b, hq, d = q.shape
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    if idx.shape[1] != hq:  # shared per KV group -> one row per query head
        idx = idx.repeat_interleave(g, dim=1)
        count = None if count is None else count.repeat_interleave(g, dim=1)
    s_len = idx.shape[2]
    valid = idx >= 0
    if count is not None:
        valid = valid & (torch.arange(s_len, device=idx.device) < count.unsqueeze(-1).to(idx.device))
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    bi = torch.arange(b, device=q.device).view(b, 1, 1)
    hi = (torch.arange(hq, device=q.device) // g).view(1, hq, 1)
    ks = k[bi, hi, safe].float()  # [B, Hq, S, D]
    vs = v[bi, hi, safe].float()
    s = torch.einsum("bhsd,bhd->bhs", ks, q.float()) * scaling
    s = s.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf for empty rows
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.einsum("bhs,bhsd->bhd", p, vs)
    return o.to(out_dtype or q.dtype), lse


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    scaling: float | None = None,
    count: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sparse decode attention.  q [B, Hq, D]; k, v [B, Hkv, N, D] (last dim contiguous; any other strides,
    e.g. a [B, N, Hkv, D] cache passed as ``k.transpose(1, 2)``); idx [B, Hq or Hkv, S] int32/int64, entries
    < 0 are padding; count [B, Hq or Hkv] optional (only the first count entries of a row are read).

    Returns (o [B, Hq, D] in ``out_dtype`` (default q's dtype), lse [B, Hq] float32)."""
    _check(q, k, v, idx, count)
    which = resolve_gpu_backend(backend, q, k, v, idx)
    if which == "torch":
        return attention_reference(q, k, v, idx, scaling=scaling, count=count, out_dtype=out_dtype)
    from . import _tl_sparse_decode

    return _tl_sparse_decode.run(
        q,
        k,
        v,
        idx,
        scaling=scaling,
        count=count,
        out_dtype=out_dtype,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
    )


def _check_dense(q, k, v, lengths):
    _check_qkv(q, k, v)
    b = q.shape[0]
    if lengths.dim() != 1 or lengths.shape[0] != b:
        raise ValueError(f"lengths {tuple(lengths.shape)}: expected [B={b}] (keys per row)")


def dense_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scaling: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode attention of row b over its first ``lengths[b]`` keys of a preallocated cache: ``attention_reference``
    with idx = 0 .. N−1 and count = lengths."""
    _check_dense(q, k, v, lengths)
    b, _, n, _ = k.shape
    idx = torch.arange(n, device=k.device, dtype=torch.int64).expand(b, k.shape[1], n)
    count = lengths.to(k.device).view(b, 1).expand(b, k.shape[1])
    return attention_reference(q, k, v, idx, scaling=scaling, count=count, out_dtype=out_dtype)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    lengths: torch.Tensor,
    *,
    scaling: float | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    block_n: int | None = None,
    num_splits: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense split-K decode attention over a preallocated cache k, v [B, Hkv, N, D] whose row b holds
    ``lengths[b]`` (int [B], on the device) valid keys.  Shapes depend on N only, never on the lengths, so one CUDA
    graph serves every step (the system path's captured decode).  Returns (o [B, Hq, D], lse [B, Hq] float32)."""
    _check_dense(q, k, v, lengths)
    which = resolve_gpu_backend(backend, q, k, v, lengths)
    if which == "torch":
        return dense_attention_reference(q, k, v, lengths, scaling=scaling, out_dtype=out_dtype)
    from . import _tl_sparse_decode

    return _tl_sparse_decode.run(
        q,
        k,
        v,
        None,
        scaling=scaling,
        count=None,
        out_dtype=out_dtype,
        block_n=block_n,
        num_splits=num_splits,
        num_warps=num_warps,
        num_stages=num_stages,
        lengths=lengths,
    )
