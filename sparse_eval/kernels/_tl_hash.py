"""Triton kernel of ``kernels.magicpig.hash_codes``: x [M, D] × W [D, K·L] → K-bit codes [M, L], fused.

Program (block of rows, block of tables): for each bit j < K, one [BLOCK_M, D] × [D, BLOCK_L] product over
the columns l·K + j of W, its sign shifted into bit j.  The product runs in IEEE fp32 (no tf32) so that signs
agree with the fp32 torch reference except for projections within rounding of zero.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, next_pow2, on_tensor_device


@triton.jit
def _simhash_kernel(
    X,
    W,
    OUT,
    M,
    L,
    stride_xm,
    stride_wd,
    stride_wc,
    stride_om,
    D: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    offs_d = tl.arange(0, BLOCK_D)
    mmask = offs_m < M
    lmask = offs_l < L
    dmask = offs_d < D
    x = tl.load(
        X + offs_m[:, None].to(tl.int64) * stride_xm + offs_d[None, :], mask=mmask[:, None] & dmask[None, :], other=0.0
    ).to(tl.float32)
    code = tl.zeros([BLOCK_M, BLOCK_L], tl.int32)
    for j in range(0, K):
        cols = offs_l * K + j
        w = tl.load(
            W + offs_d[:, None] * stride_wd + cols[None, :] * stride_wc, mask=dmask[:, None] & lmask[None, :], other=0.0
        ).to(tl.float32)
        proj = tl.dot(x, w, input_precision="ieee")  # [BLOCK_M, BLOCK_L]
        code = code | ((proj > 0).to(tl.int32) << j)
    tl.store(
        OUT + offs_m[:, None].to(tl.int64) * stride_om + offs_l[None, :], code, mask=mmask[:, None] & lmask[None, :]
    )


@on_tensor_device
def hash_codes(x, w, k_bits, n_tables, *, block_m=None, block_l=None):
    x2, lead = as_rows(x)
    m, d = x2.shape
    out = torch.empty((m, n_tables), dtype=torch.int32, device=x.device)
    if m == 0:
        return out.view(*lead, n_tables)
    block_d = max(16, next_pow2(d))
    block_m = block_m or (64 if m >= 64 else max(16, next_pow2(m)))
    block_l = block_l or 32
    grid = (triton.cdiv(m, block_m), triton.cdiv(n_tables, block_l))
    # ptxas (sm_90, D 128): a 64 × 32 tile spills heavily at 4 warps (fp32 FMA dot), none at 8
    warps = 8 if block_m * block_l >= 2048 else 4
    _simhash_kernel[grid](
        x2,
        w,
        out,
        m,
        n_tables,
        x2.stride(0),
        *w.stride()[:2],
        out.stride(0),
        D=d,
        K=k_bits,
        BLOCK_M=block_m,
        BLOCK_D=block_d,
        BLOCK_L=block_l,
        num_warps=warps,
    )
    return out.view(*lead, n_tables)
