"""Triton kernels of ``kernels.invariant``: one fixed tile configuration per dtype, whatever the shapes, so that a
row's result never depends on the other rows of a launch, and every reduced axis tiled from its end.

* ``_bmm_kernel``: program (row tile, column tile, batch entry) computes a [BLOCK_M, BLOCK_N] tile of
  a[b] @ b[b] with one accumulator (float32; float64 for float64 inputs), looping over K in end-aligned tiles
  (the first, partial tile is the front one, masked below index 0): no split-K, no atomics.  bf16/fp16 take
  ``tl.dot`` (tensor cores), float32 ``tl.dot`` with ``input_precision="ieee"`` (no TF32), float64 an explicit
  product-and-sum.
* ``_row_sum_kernel``: one program per row, Σ over end-aligned tiles of BLOCK entries, left to right (the leading
  tiles of a padded row are zeros: the accumulator stays an exact 0 until the row's own entries).
* ``_softmax_kernel``: one program per row: the max (exact), Σ exp(x − max) over end-aligned tiles, the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) per input dtype: fixed for every shape (row invariance needs it)
_MM_CONFIG = {
    torch.bfloat16: (64, 64, 64, 4),
    torch.float16: (64, 64, 64, 4),
    torch.float32: (64, 64, 32, 4),
    torch.float64: (16, 16, 16, 4),
}
ROW_BLOCK = 1024  # entries per tile of the row kernels


@triton.jit
def _bmm_kernel(
    A, B, C, M, N, K,
    sab, sam, sak, sbb, sbk, sbn, scb, scm, scn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr, F64: tl.constexpr, OUT: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    bat = tl.program_id(2).to(tl.int64)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    a_rows = A + bat * sab + offs_m.to(tl.int64)[:, None] * sam
    b_cols = B + bat * sbb + offs_n.to(tl.int64)[None, :] * sbn
    n_tiles = tl.cdiv(K, BLOCK_K)
    k0 = K - n_tiles * BLOCK_K  # <= 0: the front tile reaches below index 0 (masked)
    if F64:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(0, n_tiles):
        offs_k = k0 + t * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = offs_k >= 0
        kk = tl.where(kmask, offs_k, 0).to(tl.int64)
        a = tl.load(a_rows + kk[None, :] * sak, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(b_cols + kk[:, None] * sbk, mask=kmask[:, None] & nmask[None, :], other=0.0)
        if F64:
            acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
        elif IEEE:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
    c = C + bat * scb + offs_m.to(tl.int64)[:, None] * scm + offs_n.to(tl.int64)[None, :] * scn
    tl.store(c, acc.to(OUT), mask=mmask[:, None] & nmask[None, :])


def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N] (any strides; a stride-0 batch dim is read in place)."""
    dt = torch.promote_types(a.dtype, b.dtype)
    if dt not in _MM_CONFIG:
        raise TypeError(f"invariant bmm: unsupported dtype {dt}; valid: {sorted(str(d) for d in _MM_CONFIG)}")
    a, b = a.to(dt), b.to(dt)
    bt, m, k = a.shape
    n = b.shape[2]
    out = torch.empty(bt, m, n, dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    bm, bn, bk, warps = _MM_CONFIG[dt]
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), bt)
    _bmm_kernel[grid](
        a, b, out, m, n, k,
        a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=dt == torch.float32, F64=dt == torch.float64,
        OUT=_TL[out_dtype], num_warps=warps,
    )
    return out


@triton.jit
def _row_sum_kernel(X, OUT, n, sx, SQUARE: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * sx
    n_tiles = tl.cdiv(n, BLOCK)
    start = n - n_tiles * BLOCK
    if F64:
        acc = tl.zeros([1], dtype=tl.float64)
    else:
        acc = tl.zeros([1], dtype=tl.float32)
    for t in range(0, n_tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs >= 0
        x = tl.load(base + tl.where(mask, offs, 0), mask=mask, other=0.0)
        if F64:
            x = x.to(tl.float64)
        else:
            x = x.to(tl.float32)
        if SQUARE:
            x = x * x
        acc += tl.sum(x, axis=0)
    tl.store(OUT + row + tl.arange(0, 1), acc)


def row_sum(x: torch.Tensor, square: bool) -> torch.Tensor:
    """x [R, n] -> [R] (float32; float64 for float64): end-aligned tile sums, left to right."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    f64 = x.dtype == torch.float64
    r, n = x.shape
    out = torch.empty(r, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if r:
        _row_sum_kernel[(r,)](x, out, n, x.stride(0), SQUARE=square, F64=f64, BLOCK=ROW_BLOCK, num_warps=4)
    return out


@triton.jit
def _softmax_kernel(X, OUT, n, sx, so, LOG: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * sx
    obase = OUT + row * so
    n_tiles = tl.cdiv(n, BLOCK)
    start = n - n_tiles * BLOCK
    if F64:
        m = tl.full([1], float("-inf"), dtype=tl.float64)
        s = tl.zeros([1], dtype=tl.float64)
    else:
        m = tl.full([1], float("-inf"), dtype=tl.float32)
        s = tl.zeros([1], dtype=tl.float32)
    for t in range(0, n_tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs >= 0
        x = tl.load(base + tl.where(mask, offs, 0), mask=mask, other=float("-inf")).to(m.dtype)
        m = tl.maximum(m, tl.max(x, axis=0))
    for t in range(0, n_tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs >= 0
        x = tl.load(base + tl.where(mask, offs, 0), mask=mask, other=float("-inf")).to(m.dtype)
        s += tl.sum(tl.where(mask, tl.exp(x - m), 0.0), axis=0)
    for t in range(0, n_tiles):
        offs = start + t * BLOCK + tl.arange(0, BLOCK)
        mask = offs >= 0
        x = tl.load(base + tl.where(mask, offs, 0), mask=mask, other=float("-inf")).to(m.dtype)
        if LOG:
            y = (x - m) - tl.log(s)
        else:
            y = tl.exp(x - m) / s
        tl.store(obase + tl.where(mask, offs, 0), y, mask=mask)


def softmax(x: torch.Tensor, log: bool) -> torch.Tensor:
    """x [R, n] -> softmax or log-softmax of each row (float32; float64 for float64)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    f64 = x.dtype == torch.float64
    r, n = x.shape
    out = torch.empty(r, n, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if r and n:
        _softmax_kernel[(r,)](x, out, n, x.stride(0), out.stride(0), LOG=log, F64=f64, BLOCK=ROW_BLOCK, num_warps=4)
    return out
