"""Triton kernel of ``kernels.merge.attend_and_merge``: attention over two key parts, merged by log-sum-exp with a
partial output over other keys, in one launch (MagicPIG's GPU part: sink + local window, joined with the CPU's
sampled part).

Program (row b, KV head): its G query heads [G, D] against all N1 + N2 keys in blocks of BLOCK_N (online
softmax: running max m, sum l, accumulator), then lse = m + log l, and the merge

    lse' = log(e^lse + e^lse_other),   o' = e^(lse − lse') o + e^(lse_other − lse') o_other

with an empty other part (lse_other = −inf) contributing nothing, whatever its o.

The products are elementwise in IEEE fp32 rather than ``_tl_sparse_decode._sparse_decode_split``'s ``tl.dot`` (which
pads the query rows to 16 and runs P·V in the cache dtype), so that the result matches the fp32 torch reference
to rounding; the work is a few query rows against ~70 keys (the two were not timed against each other).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, on_tensor_device, triton_interpret, unit_last


@triton.jit
def _attend_block(
    q, k_base, v_base, stride_kn, stride_vn, start, n_part, offs_d, dmask, scale, m_i, l_i, acc, BLOCK_N: tl.constexpr
):
    offs_n = start + tl.arange(0, BLOCK_N)
    nmask = offs_n < n_part
    kv_mask = nmask[:, None] & dmask[None, :]
    k = tl.load(k_base + offs_n[:, None].to(tl.int64) * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0).to(
        tl.float32
    )  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_base + offs_n[:, None].to(tl.int64) * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0).to(
        tl.float32
    )
    s = tl.sum(q[:, None, :] * k[None, :, :], 2) * scale  # [G, BLOCK_N], IEEE fp32 (no tf32)
    s = tl.where(nmask[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)
    alpha = tl.exp(m_i - m_safe)
    p = tl.exp(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], 1)
    return m_new, l_i, acc


@triton.jit
def _attend_merge_kernel(
    Q,
    K1,
    V1,
    K2,
    V2,
    OO,
    LO,
    OUT,
    LSE,
    stride_qb,
    stride_qh,
    stride_k1b,
    stride_k1h,
    stride_k1n,
    stride_v1b,
    stride_v1h,
    stride_v1n,
    stride_k2b,
    stride_k2h,
    stride_k2n,
    stride_v2b,
    stride_v2h,
    stride_v2n,
    stride_ob,
    stride_oh,
    stride_lb,
    HKV,
    N1,
    N2,
    scale,
    G: tl.constexpr,
    G_P2: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERP: tl.constexpr,
    IT1: tl.constexpr,
    IT2: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    offs_g = tl.arange(0, G_P2)
    gmask = offs_g < G
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    heads = kvh * G + offs_g
    qm = gmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)
    m_i = tl.full([G_P2], float("-inf"), tl.float32)
    l_i = tl.zeros([G_P2], tl.float32)
    acc = tl.zeros([G_P2, BLOCK_D], tl.float32)
    k1 = K1 + b * stride_k1b + kvh * stride_k1h
    v1 = V1 + b * stride_v1b + kvh * stride_v1h
    k2 = K2 + b * stride_k2b + kvh * stride_k2h
    v2 = V2 + b * stride_v2b + kvh * stride_v2h
    # the interpreter takes no tensor loop bounds: constexpr trip counts, masked tails
    for it in range(0, IT1 if INTERP else N1, 1 if INTERP else BLOCK_N):
        start = it * BLOCK_N if INTERP else it
        m_i, l_i, acc = _attend_block(
            q, k1, v1, stride_k1n, stride_v1n, start, N1, offs_d, dmask, scale, m_i, l_i, acc, BLOCK_N
        )
    for it in range(0, IT2 if INTERP else N2, 1 if INTERP else BLOCK_N):
        start = it * BLOCK_N if INTERP else it
        m_i, l_i, acc = _attend_block(
            q, k2, v2, stride_k2n, stride_v2n, start, N2, offs_d, dmask, scale, m_i, l_i, acc, BLOCK_N
        )
    lse = m_i + tl.log(l_i)  # N1 + N2 ≥ 1: finite
    o = acc / l_i[:, None]
    lo = tl.load(LO + b * stride_lb + heads, mask=gmask, other=float("-inf")).to(tl.float32)
    oo = tl.load(OO + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], mask=qm, other=0.0).to(tl.float32)
    top = tl.maximum(lse, lo)
    w1 = tl.exp(lse - top)
    w2 = tl.exp(lo - top)  # 0 for an empty other part
    tot = w1 + w2
    out = (w1 / tot)[:, None] * o + tl.where((w2 > 0)[:, None], (w2 / tot)[:, None] * oo, 0.0)
    tl.store(OUT + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :], out, mask=qm)
    tl.store(LSE + b * stride_lb + heads, top + tl.log(tot), mask=gmask)


@on_tensor_device
def attend_and_merge(
    q, k1, v1, k2, v2, o_other, lse_other, scaling: float, block_n: int = 16, num_warps: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    b, hq, d = q.shape
    hkv = k1.shape[1]
    g = hq // hkv
    q, k1c, v1c, k2c, v2c = unit_last(q, k1, v1, k2, v2)
    oo = o_other.to(device=q.device, dtype=torch.float32).contiguous()
    lo = lse_other.to(device=q.device, dtype=torch.float32).contiguous()
    out = torch.empty((b, hq, d), dtype=torch.float32, device=q.device)
    lse = torch.empty((b, hq), dtype=torch.float32, device=q.device)
    n1, n2 = k1.shape[2], k2.shape[2]
    interp = triton_interpret()
    _attend_merge_kernel[(b * hkv,)](
        q,
        k1c,
        v1c,
        k2c,
        v2c,
        oo,
        lo,
        out,
        lse,
        *q.stride()[:2],
        *k1c.stride()[:3],
        *v1c.stride()[:3],
        *k2c.stride()[:3],
        *v2c.stride()[:3],
        *out.stride()[:2],
        lse.stride(0),
        hkv,
        n1,
        n2,
        scaling,
        G=g,
        G_P2=max(2, next_pow2(g)),
        D=d,
        BLOCK_D=max(16, next_pow2(d)),
        BLOCK_N=block_n,
        INTERP=interp,
        IT1=triton.cdiv(n1, block_n) if interp else 0,
        IT2=triton.cdiv(n2, block_n) if interp else 0,
        num_warps=num_warps,
    )
    return out, lse
