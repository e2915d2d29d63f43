"""Triton kernel of ``kernels.topk`` (imported lazily: see ``kernels._common``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2, triton_interpret


@triton.jit
def _keys(x):
    """fp32 -> uint32 with the same order (−inf smallest): flip all bits of negatives, the sign bit of the rest."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _count_ge(base, n0, N, offs, cand, cnt):
    """cnt[j] += #{keys of the tile at n0 that are >= cand[j]}."""
    o = n0 + offs
    x = tl.load(base + o, mask=o < N, other=float("-inf"))
    ge = (_keys(x)[:, None] >= cand[None, :]) & (o < N)[:, None]
    return cnt + tl.sum(ge.to(tl.int32), 0)


@triton.jit
def _count_gt(base, n0, N, offs, thr, n_gt):
    o = n0 + offs
    x = tl.load(base + o, mask=o < N, other=float("-inf"))
    return n_gt + tl.sum(((_keys(x) > thr) & (o < N)).to(tl.int32), 0)


@triton.jit
def _select_tile(base, out, n0, N, offs, thr, ties, written, seen_eq):
    """Writes the tile's positions above the threshold, and its ties while fewer than ``ties`` were taken, after
    the ``written`` already taken (a running prefix sum); −inf never."""
    o = n0 + offs
    x = tl.load(base + o, mask=o < N, other=float("-inf"))
    key = _keys(x)
    inside = (o < N) & (x > float("-inf"))
    eq = (key == thr) & inside
    eq_rank = seen_eq + tl.cumsum(eq.to(tl.int32), 0) - 1
    take = ((key > thr) & inside) | (eq & (eq_rank < ties))
    slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
    tl.store(out + slot, o, mask=take)
    return written + tl.sum(take.to(tl.int32), 0), seen_eq + tl.sum(eq.to(tl.int32), 0)


@triton.jit
def _topk_select(
    S, CNT, OUT, stride_s, stride_o, N, K_MAX,
    HAS_CNT: tl.constexpr, RADIX_BITS: tl.constexpr, BLOCK_N: tl.constexpr, INTERP: tl.constexpr,
    N_TILES: tl.constexpr, K_TILES: tl.constexpr,
):
    # every loop over the row has two forms: a constexpr trip count under the interpreter (it cannot take tensor
    # loop bounds), a runtime bound compiled; the bodies are the helpers above
    row = tl.program_id(0).to(tl.int64)
    base = S + row * stride_s
    if HAS_CNT:
        k = tl.minimum(tl.load(CNT + row).to(tl.int32), K_MAX)
    else:
        k = K_MAX
    R: tl.constexpr = 1 << RADIX_BITS
    offs = tl.arange(0, BLOCK_N)
    digits = tl.arange(0, R).to(tl.uint32)
    # the k-th largest key: a prefix of the answer, RADIX_BITS bits per pass from the top; invariant: at least k
    # keys are >= prefix (0 at the start)
    prefix = tl.zeros([], tl.uint32)
    for p in tl.static_range(32 // RADIX_BITS):
        shift = 32 - RADIX_BITS * (p + 1)
        cand = prefix | (digits << shift)  # [R]
        cnt = tl.zeros([R], tl.int32)
        if INTERP:
            for it in range(0, N_TILES):
                cnt = _count_ge(base, it * BLOCK_N, N, offs, cand, cnt)
        else:
            for n0 in range(0, N, BLOCK_N):
                cnt = _count_ge(base, n0, N, offs, cand, cnt)
        best = tl.sum((cnt >= k).to(tl.int32), 0) - 1  # counts fall with the digit; digit 0 always qualifies
        prefix = prefix | (best.to(tl.uint32) << shift)
    thr = prefix  # the k-th largest key
    n_gt = tl.zeros([], tl.int32)
    if INTERP:
        for it in range(0, N_TILES):
            n_gt = _count_gt(base, it * BLOCK_N, N, offs, thr, n_gt)
    else:
        for n0 in range(0, N, BLOCK_N):
            n_gt = _count_gt(base, n0, N, offs, thr, n_gt)
    ties = k - n_gt
    out = OUT + row * stride_o
    written = tl.zeros([], tl.int32)
    seen_eq = tl.zeros([], tl.int32)
    if INTERP:
        for it in range(0, N_TILES):
            written, seen_eq = _select_tile(base, out, it * BLOCK_N, N, offs, thr, ties, written, seen_eq)
    else:
        for n0 in range(0, N, BLOCK_N):
            written, seen_eq = _select_tile(base, out, n0, N, offs, thr, ties, written, seen_eq)
    # −1 in the unused slots
    pad = tl.full([BLOCK_N], -1, tl.int32)
    if INTERP:
        for it in range(0, K_TILES):
            o = it * BLOCK_N + offs
            tl.store(out + o, pad, mask=(o >= written) & (o < K_MAX))
    else:
        for p0 in range(0, K_MAX, BLOCK_N):
            o = p0 + offs
            tl.store(out + o, pad, mask=(o >= written) & (o < K_MAX))


def select(scores: torch.Tensor, k_max: int, count, *, radix_bits: int, block_n: int, num_warps: int) -> torch.Tensor:
    lead = scores.shape[:-1]
    n = scores.shape[-1]
    s2 = scores.reshape(-1, n)
    if s2.stride(-1) != 1:
        s2 = s2.contiguous()
    rows = s2.shape[0]
    out = torch.empty((rows, k_max), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out.view(*lead, k_max)
    cnt = count.reshape(-1).to(device=scores.device, dtype=torch.int32).contiguous() if count is not None else out
    interp = triton_interpret()
    block_n = min(block_n, max(16, next_pow2(n)))
    _topk_select[(rows,)](
        s2, cnt, out, s2.stride(0), out.stride(0), n, k_max,
        HAS_CNT=count is not None, RADIX_BITS=radix_bits, BLOCK_N=block_n, INTERP=interp,
        N_TILES=triton.cdiv(n, block_n) if interp else 0, K_TILES=triton.cdiv(k_max, block_n) if interp else 0,
        num_warps=num_warps,
    )
    return out.view(*lead, k_max)
