"""Triton kernels of ``kernels.topk`` (imported lazily: see ``kernels._common``).

A radix select spread over many programs per row: every kernel runs on a grid (rows, tiles of BLOCK_N) and
reads its tile once, so a row of 16K–128K scores is worked on by 8–64 programs at a time.

    pass p = 0 .. 32/BITS − 1   ``_hist``:  histogram of digit p of the keys that match the prefix found by the
                                 passes before it (atomically added into H[p, row])
    then                         ``_count``: per tile, #keys > thr and #finite keys == thr (thr = the k-th key)
    then                         ``_write``: the positions above thr and the first ties, in position order

Each program of pass p advances the prefix state stored by pass p − 1 by one digit, from the histogram of pass
p − 1 (``_state``), and tile 0 stores the result for pass p + 1; so no pass needs a separate "find the digit"
launch, and no program re-derives every digit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import as_rows, next_pow2, on_tensor_device


@triton.jit
def _keys(x):
    """fp32 -> uint32 with the same order (−inf smallest): flip all bits of negatives, the sign bit of the rest."""
    u = x.to(tl.uint32, bitcast=True)
    return tl.where((u >> 31) == 1, u ^ 0xFFFFFFFF, u | 0x80000000)


@triton.jit
def _budget(CNT, row, N, K_MAX, HAS_CNT: tl.constexpr):
    """k of the row: min(count[row], k_max, N) (the invariant of ``_digit_step`` needs k ≤ N)."""
    k = tl.minimum(K_MAX, N)
    if HAS_CNT:
        k = tl.minimum(tl.load(CNT + row).to(tl.int32), k)
    return tl.maximum(k, 0)


@triton.jit
def _digit_step(H, row, rows, prefix, k_rem, P: tl.constexpr, BITS: tl.constexpr):
    """One digit of the k-th largest key from the histogram of pass P: the largest d with #(keys matching the
    prefix with digit ≥ d) ≥ k_rem (counts fall as d grows; d = 0 qualifies because at least k_rem keys match
    the prefix); k_rem then drops by the keys with a larger digit (it stays the rank of the k-th key among the
    keys that share the longer prefix)."""
    R: tl.constexpr = 1 << BITS
    digits = tl.arange(0, R)
    h = tl.load(H + (P * rows + row) * R + digits)  # [R]
    ge = tl.cumsum(h, 0, reverse=True)  # [R] #keys with digit >= d
    best = tl.sum((ge >= k_rem).to(tl.int32), 0) - 1
    k_rem -= tl.sum(tl.where(digits > best, h, 0), 0)
    return prefix | (best.to(tl.uint32) << (32 - BITS * (P + 1))), k_rem


@triton.jit
def _state(H, ST, row, rows, k, P: tl.constexpr, BITS: tl.constexpr):
    """(prefix, k_rem) after the digits of passes 0..P−1: the state stored by pass P−1 (``ST[P−1]``, or the start
    (0, k) for P − 1 = 0) advanced by the histogram of pass P−1.  One step, not P: the chain of dependent loads
    of recomputing every digit in every program measured as a large part of each pass."""
    if P == 1:
        prefix = tl.zeros([], tl.uint32)
        k_rem = k
    else:
        prefix = tl.load(ST + ((P - 1) * rows + row) * 2).to(tl.uint32, bitcast=True)
        k_rem = tl.load(ST + ((P - 1) * rows + row) * 2 + 1)
    return _digit_step(H, row, rows, prefix, k_rem, P - 1, BITS)


@triton.jit
def _hist(
    S,
    CNT,
    H,
    ST,
    stride_s,
    N,
    K_MAX,
    rows,
    PASS: tl.constexpr,
    HAS_CNT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """Pass PASS: the histogram of digit PASS of the tile's keys that match the prefix of the earlier digits,
    added into H[PASS, row]; tile 0 stores that prefix state in ST[PASS] for the next pass.  ATOMIC: one global
    atomic per matching key instead of a tile histogram (cheaper once few keys match the prefix)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    R: tl.constexpr = 1 << BITS
    o = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = o < N
    key = _keys(tl.load(S + row.to(tl.int64) * stride_s + o, mask=inside, other=0.0))
    SHIFT: tl.constexpr = 32 - BITS * (PASS + 1)
    match = inside
    if PASS > 0:
        k = _budget(CNT, row, N, K_MAX, HAS_CNT)
        prefix, k_rem = _state(H, ST, row, rows, k, PASS, BITS)
        match = match & ((key >> (SHIFT + BITS)) == (prefix >> (SHIFT + BITS)))
        if tile == 0:
            tl.store(ST + (PASS * rows + row) * 2, prefix.to(tl.int32, bitcast=True))
            tl.store(ST + (PASS * rows + row) * 2 + 1, k_rem)
    digit = ((key >> SHIFT) & (R - 1)).to(tl.int32)
    if ATOMIC:
        tl.atomic_add(H + (PASS * rows + row) * R + digit, tl.full([BLOCK_N], 1, tl.int32), mask=match, sem="relaxed")
    else:
        h = tl.histogram(digit, R, mask=match)  # [R]
        tl.atomic_add(H + (PASS * rows + row) * R + tl.arange(0, R), h, mask=h > 0, sem="relaxed")


@triton.jit
def _count(
    S,
    CNT,
    H,
    ST,
    G,
    stride_s,
    N,
    K_MAX,
    rows,
    tiles,
    PASSES: tl.constexpr,
    HAS_CNT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """G[0, row, tile] = #keys > thr, G[1, row, tile] = #finite keys == thr, in the tile (thr: the k-th key)."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    o = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(S + row.to(tl.int64) * stride_s + o, mask=o < N, other=float("-inf"))
    k = _budget(CNT, row, N, K_MAX, HAS_CNT)
    thr, _ = _state(H, ST, row, rows, k, PASSES, BITS)
    key = _keys(x)
    inside = (o < N) & (x > float("-inf"))
    n_gt = tl.sum(((key > thr) & inside).to(tl.int32), 0)
    n_eq = tl.sum(((key == thr) & inside).to(tl.int32), 0)
    tl.store(G + row * tiles + tile, n_gt)
    tl.store(G + (rows + row) * tiles + tile, n_eq)


@triton.jit
def _write(
    S,
    CNT,
    H,
    ST,
    G,
    OUT,
    stride_s,
    stride_o,
    N,
    K_MAX,
    rows,
    tiles,
    PASSES: tl.constexpr,
    HAS_CNT: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    TILES_P2: tl.constexpr,
    PAD: tl.constexpr,
):
    """The tile's positions with key > thr, and its finite ties while fewer than k − #(> thr) were taken by the
    tiles before it, at slots after those tiles' (exclusive prefix sums of G); then −1 in this program's share
    [tile·PAD, (tile+1)·PAD) of the slots beyond the row's total."""
    row = tl.program_id(0)
    tile = tl.program_id(1)
    o = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    x = tl.load(S + row.to(tl.int64) * stride_s + o, mask=o < N, other=float("-inf"))
    t = tl.arange(0, TILES_P2)
    gt = tl.load(G + row * tiles + t, mask=t < tiles, other=0)  # [TILES_P2]
    eq = tl.load(G + (rows + row) * tiles + t, mask=t < tiles, other=0)
    k = _budget(CNT, row, N, K_MAX, HAS_CNT)
    thr, _ = _state(H, ST, row, rows, k, PASSES, BITS)
    ties = k - tl.sum(gt, 0)  # ties to take in the whole row
    gt_before = tl.sum(tl.where(t < tile, gt, 0), 0)
    eq_before = tl.sum(tl.where(t < tile, eq, 0), 0)
    written = gt_before + tl.minimum(eq_before, ties)
    total = tl.sum(gt, 0) + tl.minimum(tl.sum(eq, 0), ties)
    key = _keys(x)
    inside = (o < N) & (x > float("-inf"))
    is_eq = (key == thr) & inside
    eq_rank = eq_before + tl.cumsum(is_eq.to(tl.int32), 0) - 1
    take = ((key > thr) & inside) | (is_eq & (eq_rank < ties))
    slot = written + tl.cumsum(take.to(tl.int32), 0) - 1
    out = OUT + row.to(tl.int64) * stride_o
    tl.store(out + slot, o, mask=take)
    s = tile * PAD + tl.arange(0, PAD)
    tl.store(out + s, tl.full([PAD], -1, tl.int32), mask=(s >= total) & (s < K_MAX))


@on_tensor_device
def select(
    scores: torch.Tensor, k_max: int, count, *, radix_bits: int, block_n: int, num_warps: int, atomic_from: int
) -> torch.Tensor:
    s2, lead = as_rows(scores)
    rows, n = s2.shape
    out = torch.empty((rows, k_max), dtype=torch.int32, device=scores.device)
    if rows == 0:
        return out.view(*lead, k_max)
    has_cnt = count is not None
    cnt = count.reshape(-1).to(device=scores.device, dtype=torch.int32).contiguous() if has_cnt else out
    block_n = min(block_n, max(16, next_pow2(n)))
    tiles = triton.cdiv(n, block_n)
    passes = 32 // radix_bits
    hist = torch.zeros((passes, rows, 1 << radix_bits), dtype=torch.int32, device=scores.device)
    state = torch.empty((passes, rows, 2), dtype=torch.int32, device=scores.device)  # [p] = (prefix, k_rem)
    g = torch.empty((2, rows, tiles), dtype=torch.int32, device=scores.device)
    grid = (rows, tiles)
    common = dict(HAS_CNT=has_cnt, BITS=radix_bits, BLOCK_N=block_n, num_warps=num_warps)
    for p in range(passes):
        _hist[grid](s2, cnt, hist, state, s2.stride(0), n, k_max, rows, PASS=p, ATOMIC=p >= atomic_from, **common)
    _count[grid](s2, cnt, hist, state, g, s2.stride(0), n, k_max, rows, tiles, PASSES=passes, **common)
    _write[grid](
        s2,
        cnt,
        hist,
        state,
        g,
        out,
        s2.stride(0),
        out.stride(0),
        n,
        k_max,
        rows,
        tiles,
        PASSES=passes,
        TILES_P2=next_pow2(tiles),
        PAD=next_pow2(triton.cdiv(k_max, tiles)),
        **common,
    )
    return out.view(*lead, k_max)


@triton.jit
def _kth_value(H, ST, CNT, OUT, N, rows, PASSES: tl.constexpr, BITS: tl.constexpr):
    """OUT[row] = the float whose order-preserving key is the k-th largest key (k = count[row]): ``_keys`` inverted
    (a set sign bit was a non-negative float: clear it; else all bits were flipped)."""
    row = tl.program_id(0)
    k = _budget(CNT, row, N, N, True)
    thr, _ = _state(H, ST, row, rows, k, PASSES, BITS)
    u = tl.where((thr >> 31) == 1, thr ^ 0x80000000, thr ^ 0xFFFFFFFF)
    tl.store(OUT + row, u.to(tl.float32, bitcast=True))


@on_tensor_device
def kth_largest(scores: torch.Tensor, count: torch.Tensor, *, radix_bits: int, block_n: int) -> torch.Tensor:
    s2, lead = as_rows(scores)
    rows, n = s2.shape
    out = torch.empty(rows, dtype=torch.float32, device=scores.device)
    if rows == 0 or n == 0:
        return out.fill_(float("-inf")).view(lead)
    cnt = count.reshape(-1).to(device=scores.device, dtype=torch.int32).contiguous()
    block_n = min(block_n, max(16, next_pow2(n)))
    tiles = triton.cdiv(n, block_n)
    passes = 32 // radix_bits
    hist = torch.zeros((passes, rows, 1 << radix_bits), dtype=torch.int32, device=scores.device)
    state = torch.empty((passes, rows, 2), dtype=torch.int32, device=scores.device)
    for p in range(passes):
        _hist[(rows, tiles)](
            s2,
            cnt,
            hist,
            state,
            s2.stride(0),
            n,
            n,
            rows,
            PASS=p,
            HAS_CNT=True,
            BITS=radix_bits,
            BLOCK_N=block_n,
            ATOMIC=p >= 2,
            num_warps=4,
        )
    _kth_value[(rows,)](hist, state, cnt, out, n, rows, PASSES=passes, BITS=radix_bits, num_warps=1)
    return out.view(lead)
