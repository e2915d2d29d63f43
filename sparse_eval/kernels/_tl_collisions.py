"""Triton kernel of ``kernels.magicpig.collision_counts``: per query row and key, the number of the L tables in
which their K-bit codes are equal.

Program (batch b, KV head h, block of BLOCK_N keys, block of BLOCK_R query rows of that KV group, the G·Q rows
g·Q + t of query heads h·G + g): the tables are taken BLOCK_LC at a time; each [BLOCK_N, BLOCK_LC] tile of key
codes is loaded once and compared with the [BLOCK_R, BLOCK_LC] query codes as one [BLOCK_R, BLOCK_N, BLOCK_LC]
equality, summed over the tables into an int32 [BLOCK_R, BLOCK_N] accumulator.  At decode (G·Q ≤ BLOCK_R) every
key code is read once per step, whatever G; nothing of size N·L·G·Q is written.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, on_tensor_device


@triton.jit
def _collision_kernel(
    QC,
    KC,
    OUT,
    N,
    ROWS,
    QL,
    sqb,
    sqh,
    sqt,
    sql,
    skb,
    skh,
    skn,
    skl,
    HKV: tl.constexpr,
    G: tl.constexpr,
    L: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_LC: tl.constexpr,
    L_PAD: tl.constexpr,
):
    pid_bh = tl.program_id(1)
    b = (pid_bh // HKV).to(tl.int64)
    h = (pid_bh % HKV).to(tl.int64)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    nmask = offs_n < N
    rmask = offs_r < ROWS
    # row r of the group = query head h·G + r // Q, query position r % Q
    qhead = h * G + (offs_r // QL).to(tl.int64)
    qrow = QC + b * sqb + qhead * sqh + (offs_r % QL).to(tl.int64) * sqt  # [BLOCK_R] pointers
    krow = KC + b * skb + h * skh + offs_n.to(tl.int64) * skn  # [BLOCK_N] pointers
    acc = tl.zeros([BLOCK_R, BLOCK_N], tl.int32)
    for l0 in range(0, L_PAD, BLOCK_LC):
        offs_l = l0 + tl.arange(0, BLOCK_LC)
        lmask = offs_l < L
        kc = tl.load(krow[:, None] + offs_l[None, :] * skl, mask=nmask[:, None] & lmask[None, :], other=0)
        qc = tl.load(qrow[:, None] + offs_l[None, :] * sql, mask=rmask[:, None] & lmask[None, :], other=0)
        eq = (qc[:, None, :] == kc[None, :, :]) & lmask[None, None, :]  # [BLOCK_R, BLOCK_N, BLOCK_LC]
        acc += tl.sum(eq.to(tl.int32), axis=2)
    out = OUT + ((b * HKV + h) * ROWS) * N + offs_r[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(out, acc.to(tl.int16), mask=rmask[:, None] & nmask[None, :])


@on_tensor_device
def collision_counts(
    q_codes: torch.Tensor, k_codes: torch.Tensor, *, block_n: int | None = None, block_r: int | None = None
) -> torch.Tensor:
    b, hq, ql, n_tables = q_codes.shape
    hkv, n = k_codes.shape[1], k_codes.shape[2]
    g = hq // hkv
    rows = g * ql
    out = torch.empty((b, hkv, rows, n), dtype=torch.int16, device=q_codes.device)
    if out.numel() == 0:
        return out.view(b, hq, ql, n)
    block_r = block_r or min(16, max(2, next_pow2(rows)))
    block_n = block_n or 64
    # the [BLOCK_R, BLOCK_N, BLOCK_LC] comparison holds ~8K elements (32 registers a thread at 8 warps)
    block_lc = max(2, min(next_pow2(n_tables), 8192 // (block_r * block_n)))
    l_pad = triton.cdiv(n_tables, block_lc) * block_lc
    grid = (triton.cdiv(n, block_n), b * hkv, triton.cdiv(rows, block_r))
    _collision_kernel[grid](
        q_codes,
        k_codes,
        out,
        n,
        rows,
        ql,
        *q_codes.stride(),
        *k_codes.stride(),
        HKV=hkv,
        G=g,
        L=n_tables,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_LC=block_lc,
        L_PAD=l_pad,
        num_warps=8,
    )
    return out.view(b, hq, ql, n)
