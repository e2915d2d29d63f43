"""Exact merge of two partial attention outputs by their log-sum-exp.

If ``o_j = Σ_{i∈S_j} e^{l_i} v_i / Z_j`` with ``lse_j = log Z_j = log Σ_{i∈S_j} e^{l_i}`` over disjoint key sets
S_1, S_2 (l_i the final logits, including any correction such as MagicPIG's −log u_i), then attention over
S_1 ∪ S_2 is

    lse = log(e^{lse_1} + e^{lse_2}),     o = e^{lse_1 − lse} o_1 + e^{lse_2 − lse} o_2.

This is how MagicPIG joins the CPU part (sampled keys) with the GPU part (sink + local window).  An empty part
has ``lse = −inf`` (and any finite ``o``); two empty parts give ``o = 0, lse = −inf``.
"""

from __future__ import annotations

import torch


def merge_by_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o1, o2 [..., D]; lse1, lse2 [...] (natural log).  Returns (o [..., D] float32, lse [...] float32)."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(
            f"merge_by_lse: expected o [..., D] and lse [...] of matching shapes; got o1 {tuple(o1.shape)}, "
            f"lse1 {tuple(lse1.shape)}, o2 {tuple(o2.shape)}, lse2 {tuple(lse2.shape)}"
        )
    l1, l2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(l1, l2)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w1 = torch.where(finite, torch.exp(l1 - safe), torch.zeros_like(lse))
    w2 = torch.where(finite, torch.exp(l2 - safe), torch.zeros_like(lse))
    # an empty part (weight 0) may carry any o, even NaN: it must not reach the result
    zero = torch.zeros((), dtype=torch.float32, device=o1.device)
    o = torch.where((w1 > 0).unsqueeze(-1), w1.unsqueeze(-1) * o1.float(), zero) + torch.where(
        (w2 > 0).unsqueeze(-1), w2.unsqueeze(-1) * o2.float(), zero
    )
    return o, lse


def attend_and_merge_reference(
    q: torch.Tensor,
    k1: torch.Tensor,
    v1: torch.Tensor,
    k2: torch.Tensor,
    v2: torch.Tensor,
    o_other: torch.Tensor,
    lse_other: torch.Tensor,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of q over the keys of two parts (k1, v1) and (k2, v2) -- MagicPIG's static keys: the sink
    and the local window, weight 1 (u = 1) -- merged by ``merge_by_lse`` with a partial output over other keys.
    q [B, Hq, D]; k1, v1 [B, Hkv, N1, D]; k2, v2 [B, Hkv, N2, D] (N1 + N2 ≥ 1; GQA: query head h reads KV head
    h // (Hq / Hkv)); o_other [B, Hq, D], lse_other [B, Hq].  Returns (o [B, Hq, D] float32, lse [B, Hq] float32)."""
    b, hq, d = q.shape
    hkv = k1.shape[1]
    g = hq // hkv
    ks = torch.cat([k1, k2], 2).float()  # [B, Hkv, N, D]
    vs = torch.cat([v1, v2], 2).float()
    s = torch.einsum("bhgd,bhnd->bhgn", q.view(b, hkv, g, d).float(), ks) * scaling
    lse = torch.logsumexp(s, -1)  # [B, Hkv, G]
    o = torch.einsum("bhgn,bhnd->bhgd", torch.softmax(s, -1), vs)
    return merge_by_lse(o.reshape(b, hq, d), lse.reshape(b, hq), o_other, lse_other)


def attend_and_merge(
    q: torch.Tensor,
    k1: torch.Tensor,
    v1: torch.Tensor,
    k2: torch.Tensor,
    v2: torch.Tensor,
    o_other: torch.Tensor,
    lse_other: torch.Tensor,
    scaling: float,
    *,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """``attend_and_merge_reference`` in one Triton launch on CUDA (one program per (row, KV head) for its query
    heads; the key parts may be strided views, e.g. a window of a larger buffer)."""
    from ._common import check_heads, resolve_gpu_backend

    b, hq, d = q.shape
    for name, k, v in (("k1", k1, v1), ("k2", k2, v2)):
        if k.dim() != 4 or v.shape != k.shape or k.shape[0] != b or k.shape[3] != d or k.shape[1] != k1.shape[1]:
            raise ValueError(
                f"{name}: expected [B={b}, Hkv, N, D={d}] with its values alike; got keys "
                f"{tuple(k.shape)}, values {tuple(v.shape)}"
            )
    check_heads(hq, k1.shape[1])
    if k1.shape[2] + k2.shape[2] < 1:
        raise ValueError("attend_and_merge: the two key parts are empty (N1 + N2 = 0)")
    if tuple(o_other.shape) != (b, hq, d) or tuple(lse_other.shape) != (b, hq):
        raise ValueError(
            f"o_other {tuple(o_other.shape)} / lse_other {tuple(lse_other.shape)}: expected "
            f"[{b}, {hq}, {d}] / [{b}, {hq}]"
        )
    if resolve_gpu_backend(backend, q, k1, k2, o_other) == "torch":
        return attend_and_merge_reference(q, k1, v1, k2, v2, o_other, lse_other, scaling)
    from . import _tl_merge

    return _tl_merge.attend_and_merge(q, k1, v1, k2, v2, o_other, lse_other, float(scaling))
