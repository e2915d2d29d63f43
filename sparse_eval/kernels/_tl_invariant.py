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

from ._common import on_tensor_device, triton_interpret

_TL = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) per input dtype: fixed for every shape (row invariance needs it)
_MM_CONFIG = {
    torch.bfloat16: (128, 128, 64, 8, 3),
    torch.float16: (128, 128, 64, 8, 3),
    torch.float32: (64, 64, 32, 4, 3),
    torch.float64: (16, 16, 16, 4, 2),
}
ROW_BLOCK = 1024  # entries per tile of the row kernels


def _trips(n: int, block: int = ROW_BLOCK) -> dict:
    """Loop form of a row kernel: runtime trip counts on the GPU; a constexpr one under the interpreter."""
    interp = triton_interpret()
    return {"INTERP": interp, "NT": triton.cdiv(n, block) if interp else 1}


@triton.jit
def _bmm_step(
    t, k0, a_ptrs, b_ptrs, sak, sbk, mmask, nmask, acc, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, F64: tl.constexpr
):
    kk = k0 + t * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = kk >= 0  # the front tile reaches below index 0
    a = tl.load(a_ptrs + t * BLOCK_K * sak, mask=mmask[:, None] & kmask[None, :], other=0.0)
    b = tl.load(b_ptrs + t * BLOCK_K * sbk, mask=kmask[:, None] & nmask[None, :], other=0.0)
    if F64:
        acc += tl.sum(a[:, :, None] * b[None, :, :], axis=1)
    elif IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _bmm_kernel(
    A,
    B,
    C,
    M,
    N,
    K,
    sab,
    sam,
    sak,
    sbb,
    sbk,
    sbn,
    scb,
    scm,
    scn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    IEEE: tl.constexpr,
    F64: tl.constexpr,
    OUT: tl.constexpr,
    INTERP: tl.constexpr,
    NT: tl.constexpr,
):
    # tiles in groups of GROUP_M row tiles (L2 reuse of b's columns); the grouping decides only which program
    # computes a tile, never how
    pid = tl.program_id(0)
    bat = tl.program_id(1).to(tl.int64)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_n)) % size_m
    pid_n = (pid % (GROUP_M * num_n)) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = offs_m < M
    nmask = offs_n < N
    n_tiles = tl.cdiv(K, BLOCK_K)
    k0 = K - n_tiles * BLOCK_K  # <= 0: tiles are laid from the end of K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    a_ptrs = A + bat * sab + offs_m.to(tl.int64)[:, None] * sam + offs_k[None, :] * sak
    b_ptrs = B + bat * sbb + offs_k[:, None] * sbk + offs_n.to(tl.int64)[None, :] * sbn
    if F64:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float64)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    # the interpreter (numpy >= 2.4) cannot take tensor loop bounds: a constexpr trip count there
    for t in range(0, NT if INTERP else n_tiles):
        acc = _bmm_step(t, k0, a_ptrs, b_ptrs, sak, sbk, mmask, nmask, acc, BLOCK_K, IEEE, F64)
    c = C + bat * scb + offs_m.to(tl.int64)[:, None] * scm + offs_n.to(tl.int64)[None, :] * scn
    tl.store(c, acc.to(OUT), mask=mmask[:, None] & nmask[None, :])


@on_tensor_device
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
    bm, bn, bk, warps, stages = _MM_CONFIG[dt]
    grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn), bt)
    _bmm_kernel[grid](
        a,
        b,
        out,
        m,
        n,
        k,
        *a.stride()[:3],
        *b.stride()[:3],
        *out.stride()[:3],
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        GROUP_M=8,
        IEEE=dt == torch.float32,
        F64=dt == torch.float64,
        OUT=_TL[out_dtype],
        INTERP=triton_interpret(),
        NT=triton.cdiv(k, bk) if triton_interpret() else 1,
        num_warps=warps,
        num_stages=stages,
    )
    return out


@triton.jit
def _load_tile(base, start, t, BLOCK: tl.constexpr, other, F64: tl.constexpr):
    offs = start + t * BLOCK + tl.arange(0, BLOCK)
    mask = offs >= 0
    x = tl.load(base + tl.where(mask, offs, 0), mask=mask, other=other)
    if F64:
        x = x.to(tl.float64)
    else:
        x = x.to(tl.float32)
    return x, offs, mask


@triton.jit
def _sum_step(base, start, t, acc, BLOCK: tl.constexpr, SQUARE: tl.constexpr, F64: tl.constexpr):
    x, _, _ = _load_tile(base, start, t, BLOCK, 0.0, F64)
    if SQUARE:
        x = x * x
    return acc + tl.sum(x, axis=0)


@triton.jit
def _row_sum_kernel(
    X, OUT, n, sx, SQUARE: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, NT: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    base = X + row * sx
    n_tiles = tl.cdiv(n, BLOCK)
    start = n - n_tiles * BLOCK
    if F64:
        acc = tl.zeros([1], dtype=tl.float64)
    else:
        acc = tl.zeros([1], dtype=tl.float32)
    for t in range(0, NT if INTERP else n_tiles):  # a constexpr trip count under the interpreter
        acc = _sum_step(base, start, t, acc, BLOCK, SQUARE, F64)
    tl.store(OUT + row + tl.arange(0, 1), acc)


@on_tensor_device
def row_sum(x: torch.Tensor, square: bool) -> torch.Tensor:
    """x [R, n] -> [R] (float32; float64 for float64): end-aligned tile sums, left to right."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    f64 = x.dtype == torch.float64
    r, n = x.shape
    out = torch.empty(r, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if r:
        _row_sum_kernel[(r,)](x, out, n, x.stride(0), SQUARE=square, F64=f64, BLOCK=ROW_BLOCK, **_trips(n), num_warps=4)
    return out


@triton.jit
def _max_step(base, start, t, m, BLOCK: tl.constexpr, F64: tl.constexpr):
    x, _, _ = _load_tile(base, start, t, BLOCK, float("-inf"), F64)
    return tl.maximum(m, tl.max(x, axis=0))


@triton.jit
def _sum_exp_step(base, start, t, m, s, BLOCK: tl.constexpr, F64: tl.constexpr):
    x, _, mask = _load_tile(base, start, t, BLOCK, float("-inf"), F64)
    return s + tl.sum(tl.where(mask, tl.exp(x - m), 0.0), axis=0)


@triton.jit
def _softmax_out_step(base, obase, start, t, m, s, BLOCK: tl.constexpr, LOG: tl.constexpr, F64: tl.constexpr):
    x, offs, mask = _load_tile(base, start, t, BLOCK, float("-inf"), F64)
    if LOG:
        y = (x - m) - tl.log(s)
    else:
        y = tl.exp(x - m) / s
    tl.store(obase + tl.where(mask, offs, 0), y, mask=mask)


@triton.jit
def _softmax_kernel(
    X, OUT, n, sx, so, LOG: tl.constexpr, F64: tl.constexpr, BLOCK: tl.constexpr, INTERP: tl.constexpr, NT: tl.constexpr
):
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
    for t in range(0, NT if INTERP else n_tiles):  # a constexpr trip count under the interpreter
        m = _max_step(base, start, t, m, BLOCK, F64)
    for t in range(0, NT if INTERP else n_tiles):
        s = _sum_exp_step(base, start, t, m, s, BLOCK, F64)
    for t in range(0, NT if INTERP else n_tiles):
        _softmax_out_step(base, obase, start, t, m, s, BLOCK, LOG, F64)


@on_tensor_device
def softmax(x: torch.Tensor, log: bool) -> torch.Tensor:
    """x [R, n] -> softmax or log-softmax of each row (float32; float64 for float64)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    f64 = x.dtype == torch.float64
    r, n = x.shape
    out = torch.empty(r, n, dtype=torch.float64 if f64 else torch.float32, device=x.device)
    if r and n:
        _softmax_kernel[(r,)](
            x, out, n, x.stride(0), out.stride(0), LOG=log, F64=f64, BLOCK=ROW_BLOCK, **_trips(n), num_warps=4
        )
    return out


@triton.jit
def _attention_kernel(
    Q,
    K,
    V,
    O,
    START,
    QL,
    N,
    scale,
    WINDOW,
    sqb,
    sqh,
    sqm,
    sqd,
    skb,
    skh,
    skn,
    skd,
    svb,
    svh,
    svn,
    svd,
    sob,
    soh,
    som,
    sod,
    HKV: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
    INTERP: tl.constexpr,
    NT: tl.constexpr,
):
    # program (block of rows, batch row b, KV head hk); the rows r = g·QL + i are query row i of query head
    # hk·G + g, so the G heads of a KV group share each K/V tile (decode: one tile load for G rows)
    pid_m = tl.program_id(0)
    b = (tl.program_id(1) // HKV).to(tl.int64)
    hk = (tl.program_id(1) % HKV).to(tl.int64)
    start = tl.load(START + b).to(tl.int32)  # the row's first key (left padding before it)
    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_r < G * QL
    qi = offs_r % QL
    head = hk * G + (offs_r // QL).to(tl.int64)
    offs_d = tl.arange(0, D)
    qcol = N - QL + qi  # the key column of each query row (causal: keys <= qcol)
    q = tl.load(
        Q + b * sqb + head[:, None] * sqh + qi.to(tl.int64)[:, None] * sqm + offs_d[None, :] * sqd,
        mask=rmask[:, None],
        other=0.0,
    )
    # the keys this block's rows may attend: tiles laid from the row's first key (``start``)
    first_q = tl.min(tl.where(rmask, qcol, N), axis=0)
    last_q = tl.max(tl.where(rmask, qcol, 0), axis=0)
    lo = tl.where(WINDOW > 0, tl.maximum(start, first_q - WINDOW + 1), start)
    t0 = (lo - start) // BLOCK_N
    t1 = tl.cdiv(last_q + 1 - start, BLOCK_N)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    kbase = K + b * skb + hk * skh
    vbase = V + b * svb + hk * svh
    # the interpreter cannot take tensor loop bounds: every tile there, those outside [t0, t1) masked
    for t in range(0 if INTERP else t0, NT if INTERP else t1):
        offs_n = start + t * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = (offs_n >= 0) & (offs_n < N) & (t >= t0) & (t < t1)  # a tile outside [t0, t1) changes nothing
        nn = tl.where(nmask, offs_n, 0).to(tl.int64)
        k = tl.load(kbase + nn[None, :] * skn + offs_d[:, None] * skd, mask=nmask[None, :], other=0.0)  # [D, BLOCK_N]
        if IEEE:
            s = tl.dot(q, k, input_precision="ieee") * scale
        else:
            s = tl.dot(q, k) * scale
        ok = nmask[None, :] & (offs_n[None, :] >= start) & (offs_n[None, :] <= qcol[:, None])
        ok = ok & ((WINDOW <= 0) | (offs_n[None, :] > qcol[:, None] - WINDOW))
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN, exact zeros
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(vbase + nn[:, None] * svn + offs_d[None, :] * svd, mask=nmask[:, None], other=0.0)  # [BLOCK_N, D]
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    out = tl.where(l_i[:, None] > 0, acc / tl.where(l_i > 0, l_i, 1.0)[:, None], 0.0)
    tl.store(
        O + b * sob + head[:, None] * soh + qi.to(tl.int64)[:, None] * som + offs_d[None, :] * sod,
        out.to(O.dtype.element_ty),
        mask=rmask[:, None],
    )


ATTN_BLOCK_M = 64
ATTN_BLOCK_N = 64


@on_tensor_device
def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor, scale: float, window: int = 0
) -> torch.Tensor:
    """Causal attention of q [B, Hq, Q, D] (the last Q positions) over k/v [B, Hkv, N, D], each row's keys from
    ``start[b]`` (left padding before), within a sliding ``window`` (0: none); -> [B, Hq, Q, D] in q's dtype.
    Online softmax over key tiles laid from the row's first key, so a row's order of additions depends only on its
    own positions; a tile outside a row's range leaves its state exactly as it was."""
    b, hq, ql, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    dp = max(16, 1 << (d - 1).bit_length())
    if dp != d:  # tl.dot needs a power of two >= 16: zero columns add nothing
        q, k, v = (torch.nn.functional.pad(x, (0, dp - d)) for x in (q, k, v))
    out = torch.empty(b, hq, ql, dp, dtype=q.dtype, device=q.device)
    if out.numel():
        grid = (triton.cdiv((hq // hkv) * ql, ATTN_BLOCK_M), b * hkv)
        _attention_kernel[grid](
            q,
            k,
            v,
            out,
            start.to(torch.int32).contiguous(),
            ql,
            n,
            float(scale),
            int(window or 0),
            *q.stride(),
            *k.stride(),
            *v.stride(),
            *out.stride(),
            HKV=hkv,
            G=hq // hkv,
            D=dp,
            BLOCK_M=ATTN_BLOCK_M,
            BLOCK_N=ATTN_BLOCK_N,
            IEEE=q.dtype == torch.float32,
            **_trips(n, ATTN_BLOCK_N),
            num_warps=4,
        )
    return out[..., :d] if dp != d else out
