"""Triton kernels for the selection scores: Double Sparsity label scores and Quest page scores.

One program per (sequence, label/KV head, block of tokens/pages) reads its tile of the label cache (or of the
page min/max keys) once and scores it against every query head mapped to that head, either storing each row or
summing them (GQA selection shared per KV group).  Loads are cast to float32 right after ``tl.load``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, on_tensor_device, unit_last


@triton.jit
def _label_scores_kernel(
    QL,
    LAB,
    SC,
    ZE,
    LEN,
    OUT,
    stride_qb,
    stride_qh,
    stride_lb,
    stride_lh,
    stride_ln,
    stride_sb,
    stride_sh,
    stride_ob,
    stride_oh,
    HL,
    N,
    QPL: tl.constexpr,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BITS: tl.constexpr,
    REDUCE: tl.constexpr,
    HAS_LEN: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HL).to(tl.int64)
    lh = pid % HL
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    lab_base = LAB + b * stride_lb + lh * stride_lh + offs_n[:, None] * stride_ln
    if BITS == 4:
        rmask = offs_r < R // 2
        byte = tl.load(lab_base + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0)
        lo = (byte & 15).to(tl.float32)
        hi = ((byte >> 4) & 15).to(tl.float32)
    else:
        rmask = offs_r < R
        lab = tl.load(lab_base + offs_r[None, :], mask=nmask[:, None] & rmask[None, :], other=0).to(tl.float32)
    if BITS != 16:
        sc = tl.load(SC + b * stride_sb + lh * stride_sh + offs_n, mask=nmask, other=0.0).to(tl.float32)
        ze = tl.load(ZE + b * stride_sb + lh * stride_sh + offs_n, mask=nmask, other=0.0).to(tl.float32)
    keep = nmask
    if HAS_LEN:
        keep = keep & (offs_n < tl.load(LEN + b))
    acc = tl.zeros([BLOCK_N], tl.float32)
    for j in range(0, QPL):
        h = lh * QPL + j
        q_base = QL + b * stride_qb + h * stride_qh
        if BITS == 4:
            qe = tl.load(q_base + 2 * offs_r, mask=rmask, other=0.0).to(tl.float32)
            qo = tl.load(q_base + 2 * offs_r + 1, mask=rmask, other=0.0).to(tl.float32)
            s = tl.sum(lo * qe[None, :] + hi * qo[None, :], 1)
            qsum = tl.sum(qe, 0) + tl.sum(qo, 0)
        else:
            qv = tl.load(q_base + offs_r, mask=rmask, other=0.0).to(tl.float32)
            s = tl.sum(lab * qv[None, :], 1)
            qsum = tl.sum(qv, 0)
        if BITS != 16:
            s = s * sc + ze * qsum  # Σ_c q_c (code_c·scale + zero)
        if REDUCE:
            acc += s
        else:
            s = tl.where(keep, s, float("-inf"))
            tl.store(OUT + b * stride_ob + h * stride_oh + offs_n, s, mask=nmask)
    if REDUCE:
        acc = tl.where(keep, acc, float("-inf"))
        tl.store(OUT + b * stride_ob + lh * stride_oh + offs_n, acc, mask=nmask)


@on_tensor_device
def label_scores(q_label, cache, *, reduce, lengths, block_n, num_warps):
    b, hl, n = cache.shape
    hq = q_label.shape[1]
    qpl = hq // hl
    dev = q_label.device
    ql = q_label.float()
    if reduce and qpl > 1:  # Σ_j q_j·k̂ = (Σ_j q_j)·k̂: one dot product per token instead of QPL
        ql = ql.view(b, hl, qpl, -1).sum(2)
        qpl = 1
    ql = ql.contiguous()
    lab = cache.labels if cache.labels.stride(-1) == 1 else cache.labels.contiguous()
    if cache.bits == 16:
        sc = ze = ql  # unused
        s_strides = (0, 0)
    else:
        sc = cache.scale if cache.scale.stride(-1) == 1 else cache.scale.contiguous()
        ze = cache.zero if cache.zero.stride(-1) == 1 else cache.zero.contiguous()
        if sc.stride() != ze.stride():
            sc, ze = sc.contiguous(), ze.contiguous()
        s_strides = (sc.stride(0), sc.stride(1))
    out = torch.empty((b, hl if reduce else hq, n), dtype=torch.float32, device=dev)
    lens = lengths.to(device=dev, dtype=torch.int32).contiguous() if lengths is not None else ql
    width = cache.r // 2 if cache.bits == 4 else cache.r
    block_n = block_n or 512  # H200 sweep (bench_kernels.py's label tuning): 512-1024 x 4 warps best
    extra = {"num_warps": num_warps} if num_warps else {}
    _label_scores_kernel[(b * hl, triton.cdiv(n, block_n))](
        ql,
        lab,
        sc,
        ze,
        lens,
        out,
        *ql.stride()[:2],
        *lab.stride()[:3],
        s_strides[0],
        s_strides[1],
        *out.stride()[:2],
        hl,
        n,
        QPL=qpl,
        R=cache.r,
        BLOCK_R=max(2, next_pow2(width)),
        BITS=cache.bits,
        REDUCE=bool(reduce),
        HAS_LEN=lengths is not None,
        BLOCK_N=block_n,
        **extra,
    )
    return out


@triton.jit
def _page_scores_kernel(
    Q,
    KMIN,
    KMAX,
    NP,
    OUT,
    stride_qb,
    stride_qh,
    stride_mb,
    stride_mh,
    stride_mp,
    stride_xb,
    stride_xh,
    stride_xp,
    stride_ob,
    stride_oh,
    HKV,
    P,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    REDUCE: tl.constexpr,
    HAS_NP: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HKV).to(tl.int64)
    kvh = pid % HKV
    offs_p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    pmask = offs_p < P
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    m2 = pmask[:, None] & dmask[None, :]
    kmin = tl.load(
        KMIN + b * stride_mb + kvh * stride_mh + offs_p[:, None] * stride_mp + offs_d[None, :], mask=m2, other=0.0
    ).to(tl.float32)
    kmax = tl.load(
        KMAX + b * stride_xb + kvh * stride_xh + offs_p[:, None] * stride_xp + offs_d[None, :], mask=m2, other=0.0
    ).to(tl.float32)
    keep = pmask
    if HAS_NP:
        keep = keep & (offs_p < tl.load(NP + b))
    acc = tl.zeros([BLOCK_P], tl.float32)
    for j in range(0, G):
        h = kvh * G + j
        qv = tl.load(Q + b * stride_qb + h * stride_qh + offs_d, mask=dmask, other=0.0).to(tl.float32)
        s = tl.sum(tl.maximum(kmin * qv[None, :], kmax * qv[None, :]), 1)  # Σ_d max(q_d kmin_d, q_d kmax_d)
        if REDUCE:
            acc += s
        else:
            s = tl.where(keep, s, float("-inf"))
            tl.store(OUT + b * stride_ob + h * stride_oh + offs_p, s, mask=pmask)
    if REDUCE:
        acc = tl.where(keep, acc, float("-inf"))
        tl.store(OUT + b * stride_ob + kvh * stride_oh + offs_p, acc, mask=pmask)


@on_tensor_device
def page_scores(q, kmin, kmax, *, reduce, n_pages, block_p, num_warps):
    b, hq, d = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    g = hq // hkv
    dev = q.device
    q, kmin, kmax = unit_last(q, kmin, kmax)
    out = torch.empty((b, hkv if reduce else hq, p), dtype=torch.float32, device=dev)
    npg = n_pages.to(device=dev, dtype=torch.int32).contiguous() if n_pages is not None else out
    block_d = max(16, next_pow2(d))
    block_p = block_p or (32 if block_d <= 128 else 16)
    extra = {"num_warps": num_warps} if num_warps else {}
    _page_scores_kernel[(b * hkv, triton.cdiv(p, block_p))](
        q,
        kmin,
        kmax,
        npg,
        out,
        *q.stride()[:2],
        *kmin.stride()[:3],
        *kmax.stride()[:3],
        *out.stride()[:2],
        hkv,
        p,
        G=g,
        D=d,
        BLOCK_D=block_d,
        REDUCE=bool(reduce),
        HAS_NP=n_pages is not None,
        BLOCK_P=block_p,
        **extra,
    )
    return out
