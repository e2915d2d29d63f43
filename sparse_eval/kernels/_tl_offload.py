"""Triton kernel of ``kernels.offload.gather_rows``: one program per (sequence, selection head, block of rows).

Rows are moved as raw 16/32-bit words (bf16 is loaded through an int16 view), so the Triton interpreter and the
GPU move the same bits.  Row offsets are 64-bit: a host cache of a large batch exceeds 2^31 elements.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, on_tensor_device


@triton.jit
def _gather_rows_kernel(
    SRC,
    IDX,
    DST,
    HS,
    S,
    G,
    s_sb,
    s_sh,
    s_sn,
    i_sb,
    i_sh,
    d_sb,
    d_sh,
    d_ss,
    D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HS).to(tl.int64)
    h = (pid % HS).to(tl.int64)
    offs_s = tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < S
    dmask = offs_d < D
    ids = tl.load(IDX + b * i_sb + h * i_sh + offs_s, mask=smask, other=-1).to(tl.int64)
    ok = smask & (ids >= 0)
    src = SRC + b * s_sb + (h // G) * s_sh + ids[:, None] * s_sn + offs_d[None, :]
    rows = tl.load(src, mask=ok[:, None] & dmask[None, :], other=0)
    dst = DST + b * d_sb + h * d_sh + offs_s[:, None].to(tl.int64) * d_ss + offs_d[None, :]
    tl.store(dst, rows, mask=ok[:, None] & dmask[None, :])


_WORD = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


@on_tensor_device
def gather_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, g: int) -> None:
    word = _WORD.get(src.dtype, src.dtype)
    s, d = src.view(word), dst.view(word)
    b, hs, n_sel = idx.shape
    if n_sel == 0 or b * hs == 0:
        return
    idx = idx if idx.dtype in (torch.int32, torch.int64) else idx.to(torch.int32)
    block_d = next_pow2(src.shape[-1])
    block_s = max(1, min(64, 8192 // block_d))
    grid = (b * hs, triton.cdiv(n_sel, block_s))
    _gather_rows_kernel[grid](
        s,
        idx,
        d,
        hs,
        n_sel,
        g,
        *s.stride()[:3],
        *idx.stride()[:2],
        *d.stride()[:3],
        D=src.shape[-1],
        BLOCK_S=block_s,
        BLOCK_D=block_d,
    )


@triton.jit
def _put_rows_kernel(
    SRC,
    DST,
    POS,
    H,
    T,
    N,
    s_sb,
    s_sh,
    s_st,
    d_sb,
    d_sh,
    d_sn,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // H).to(tl.int64)
    h = (pid % H).to(tl.int64)
    offs_t = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, BLOCK_D)
    pos = tl.load(POS).to(tl.int64)
    row = pos + offs_t
    ok = (offs_t < T) & (row < N) & (row >= 0)
    m = ok[:, None] & (offs_d < D)[None, :]
    x = tl.load(SRC + b * s_sb + h * s_sh + offs_t[:, None].to(tl.int64) * s_st + offs_d[None, :], mask=m, other=0)
    tl.store(DST + b * d_sb + h * d_sh + row[:, None] * d_sn + offs_d[None, :], x, mask=m)


@on_tensor_device
def put_rows(src: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor) -> None:
    word = _WORD.get(src.dtype, src.dtype)
    s, d = src.view(word), dst.view(word)
    b, h, t, dim = src.shape
    if t == 0 or b * h == 0:
        return
    block_d = next_pow2(dim)
    block_t = max(1, min(64, 8192 // block_d, next_pow2(t)))
    grid = (b * h, triton.cdiv(t, block_t))
    _put_rows_kernel[grid](
        s,
        d,
        pos.reshape(1),
        h,
        t,
        dst.shape[2],
        *s.stride()[:3],
        *d.stride()[:3],
        D=dim,
        BLOCK_T=block_t,
        BLOCK_D=block_d,
    )
