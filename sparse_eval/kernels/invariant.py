"""Batch-invariant arithmetic: matrix products and row reductions whose result for one row depends only on that
row's own values and on its length counted from its *end*.

A padded batch changes two things about a row: how many other rows share each kernel launch (cuBLAS, torch's
reductions and MKL pick their algorithm, tiles and splits from the shapes), and, under left padding, where the
row's real entries sit along the key axis.  Both change the order of floating-point additions, hence the last
bits of a score, hence (through top-k ties, collision thresholds and greedy argmaxes) whole records.  Every
function here fixes that order:

* **rows never mix**: a row's result uses only that row's entries, and the reduction schedule of a row depends
  only on constants (tile sizes) and on the reduced length;
* **end alignment**: along the reduced axis, tiles are laid from the *last* entry backwards, so left padding only
  adds tiles (or tree leaves) at the front that hold the operation's neutral element (0 for sums, −inf for a
  max); adding an exact 0 changes nothing, and a tile of zeros contributes an exact 0.  A left-padded key axis
  (every row's keys end at the last column) is therefore reduced in the same order alone and in any batch.

Two implementations of each function, both with this property (they agree with each other only to rounding):

* ``*_reference`` (torch, every device; the CPU path): sums are pairwise trees of elementwise additions over the
  row end-aligned in a power-of-two length (``tree_sum``); products go through torch/MKL in fixed-size pieces:
  rows and columns padded to multiples of ``MKL_BLOCK`` (MKL's per-element result is independent of the other
  rows and columns from 16 of them on, and differs below: measured, ``tests/checks/test_invariance.py``), and the
  reduced axis cut into end-aligned tiles of ``K_TILE`` entries (within one MKL k-block, where leading zeros change
  nothing; a longer reduction is blocked from its start), the tiles' partial products then summed by ``tree_sum``;
* Triton kernels (``_tl_invariant``, CUDA): one fixed tile configuration per dtype for every shape, no split-K,
  the K loop and the row loops over end-aligned tiles.

``backend="auto"`` picks Triton for CUDA tensors (where triton is installed) and the reference otherwise.  The
aten operator overrides of ``sparse_eval.invariance`` call these.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._common import next_pow2, resolve_gpu_backend

__all__ = [
    "MKL_BLOCK",
    "K_TILE",
    "acc_dtype",
    "tree_sum",
    "bmm",
    "bmm_reference",
    "row_sum",
    "row_sum_reference",
    "softmax",
    "softmax_reference",
    "cumsum_reference",
]

MKL_BLOCK = 16  # rows/columns of an MKL product are padded to a multiple of this (at least this many)
K_TILE = 128  # reduced-axis tile of the reference product (within one MKL k-block)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of a reduction: float64 for float64, float32 for every other floating dtype."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# -- reference (torch) -------------------------------------------------------------------------------------------


def tree_sum(x: torch.Tensor, align: str = "end") -> torch.Tensor:
    """Σ over the last dim of x [..., n] as a pairwise tree of elementwise additions.  ``align="end"``: the row is
    left-padded with zeros to the next power of two P, then level by level x ← x[..., 0::2] + x[..., 1::2]; entry i
    sits at offset n − 1 − i from the end in every layout, so with leading zeros (left padding) the same pairs are
    added in the same order and the extra subtrees add exact zeros.  ``align="start"``: padded on the right, so
    trailing zeros (keys after a query's own position) change nothing.  Returns [...] in x's dtype."""
    n = x.shape[-1]
    if n == 0:
        return x.new_zeros(x.shape[:-1])
    p = next_pow2(n)
    if p != n:
        x = F.pad(x, (p - n, 0) if align == "end" else (0, p - n))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def row_sum_reference(x: torch.Tensor, square: bool = False) -> torch.Tensor:
    """x [R, n] -> [R] in ``acc_dtype``: Σ_i x_i (or Σ_i x_i² with ``square``) by ``tree_sum``."""
    x = x.to(acc_dtype(x.dtype))
    return tree_sum(x * x if square else x)


def softmax_reference(x: torch.Tensor, log: bool = False, align: str = "end") -> torch.Tensor:
    """Softmax (or log-softmax) over the last dim of x [R, n], in ``acc_dtype``: m = max (exact in any order),
    e = exp(x − m), Σ e by ``tree_sum`` (``align`` as there).  A row of −inf gives NaN, as torch's softmax does."""
    x = x.to(acc_dtype(x.dtype))
    m = x.amax(-1, keepdim=True)
    z = x - m
    s = tree_sum(torch.exp(z), align).unsqueeze(-1)
    return z - torch.log(s) if log else torch.exp(z) / s


def cumsum_reference(x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sums over the last dim of x [..., n] (a Hillis–Steele scan, in x's dtype): at step d
    (1, 2, 4, …) x_i ← x_i + x_{i−d}, with 0 before the row.  The sums that make up entry i are laid out
    relative to i itself, so leading zeros (left padding) and trailing entries change nothing."""
    n = x.shape[-1]
    d = 1
    while d < n:
        x = x + F.pad(x[..., :-d], (d, 0))
        d *= 2
    return x


def _pad_to(x: torch.Tensor, dim: int, mult: int, front: bool = False) -> torch.Tensor:
    size = x.shape[dim]
    target = max(mult, -(-size // mult) * mult)
    if target == size:
        return x
    pad = [0, 0] * (x.dim() - (dim % x.dim()) - 1) + ([target - size, 0] if front else [0, target - size])
    return F.pad(x, pad)


def _tiled_product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype, align: str = "end") -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N]: M and N zero-padded to multiples of ``MKL_BLOCK`` (at least one).  A reduction of
    at most ``K_TILE`` entries is one MKL problem (leading zeros, i.e. left padding, change nothing within it);
    a longer one is left-padded to a multiple of ``K_TILE`` (``align="start"``: right-padded), each tile's product is
    one MKL problem ([M', K_TILE] @ [K_TILE, N']), and the tiles' partial products are summed by ``tree_sum``.  The
    products are ``torch.bmm(..., out=)`` (aten ``bmm.out``), so this can serve as the override of aten ``bmm``."""
    bt, m, k = a.shape
    n = b.shape[2]
    acc = acc_dtype(torch.promote_types(a.dtype, b.dtype))
    if k == 0 or bt == 0 or m == 0 or n == 0:
        return torch.zeros(bt, m, n, dtype=out_dtype, device=a.device)
    a = _pad_to(a.to(acc), 1, MKL_BLOCK)  # [Bt, M', K]
    b = _pad_to(b.to(acc), 2, MKL_BLOCK)  # [Bt, K, N']
    mp, np_ = a.shape[1], b.shape[2]
    if k <= K_TILE:
        out = torch.empty(bt, mp, np_, dtype=acc, device=a.device)
        torch.bmm(a, b, out=out)
        return out[:, :m, :n].to(out_dtype)
    a = _pad_to(a, 2, K_TILE, front=align == "end")  # [Bt, M', K']
    b = _pad_to(b, 1, K_TILE, front=align == "end")  # [Bt, K', N']
    nk = a.shape[2] // K_TILE
    at = a.view(bt, mp, nk, K_TILE).transpose(1, 2).reshape(bt * nk, mp, K_TILE)
    part = torch.empty(bt * nk, mp, np_, dtype=acc, device=a.device)
    torch.bmm(at, b.reshape(bt * nk, K_TILE, np_), out=part)
    total = tree_sum(part.view(bt, nk, mp, np_).permute(0, 2, 3, 1), align)  # [Bt, M', N']: Σ over the tiles
    return total[:, :m, :n].to(out_dtype)


def _weight_product(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """a [M, K] @ b [K, N] where K is a model dimension (a weight's rows), the same in every batch: M and N padded to
    multiples of ``MKL_BLOCK`` (at least one) and one MKL product; MKL gives a row the same bits whatever the other
    rows from 16 rows on (measured), and K needs no tiling since nothing pads it."""
    m, k = a.shape
    n = b.shape[1]
    acc = acc_dtype(torch.promote_types(a.dtype, b.dtype))
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    a = _pad_to(a.to(acc), 0, MKL_BLOCK)
    b = _pad_to(b.to(acc), 1, MKL_BLOCK)
    out = torch.empty(a.shape[0], b.shape[1], dtype=acc, device=a.device)
    torch.mm(a, b, out=out)
    return out[:m, :n].to(out_dtype)


def bmm_reference(
    a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, align: str = "end"
) -> torch.Tensor:
    """a [Bt, M, K] @ b [Bt, K, N] -> [Bt, M, N] in ``out_dtype`` (default a's dtype), accumulated in
    ``acc_dtype`` (``_tiled_product``: K may be a key axis, padded on the left).  A ``b`` broadcast over the batch
    (stride 0: ``matmul`` of a non-contiguous activation with a weight) is a weight product (``mm_reference``), the
    batch folded into its rows, so a row's result is the one ``mm_reference`` gives it and ``b`` is not copied."""
    out_dtype = out_dtype or a.dtype
    bt, m, k = a.shape
    if bt > 1 and b.stride(0) == 0:
        return _weight_product(a.reshape(bt * m, k), b[0], out_dtype).view(bt, m, b.shape[2])
    return _tiled_product(a, b, out_dtype, align)


def mm_reference(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """a [M, K] @ b [K, N] -> [M, N], a row's result independent of M.  A 2-D product is taken as a product with a
    model's weight (linear layers, projections): its reduction axis K is a model dimension, never padded, so it is
    not tiled (``_weight_product``).  Reductions over keys, whose length the batch pads, are batched products
    (``bmm_reference``) or sums."""
    return _weight_product(a, b, out_dtype or a.dtype)


# -- dispatch -----------------------------------------------------------------------------------------------------


def bmm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Batch-invariant a [Bt, M, K] @ b [Bt, K, N] (any strides) -> [Bt, M, N] in ``out_dtype`` (default a's)."""
    if a.dim() != 3 or b.dim() != 3 or a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"bmm: expected a [Bt, M, K] and b [Bt, K, N]; got {tuple(a.shape)} and {tuple(b.shape)}")
    if resolve_gpu_backend(backend, a, b) == "triton":
        from . import _tl_invariant

        return _tl_invariant.bmm(a, b, out_dtype or a.dtype)
    return bmm_reference(a, b, out_dtype)


def mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype | None = None, backend: str = "auto") -> torch.Tensor:
    """Batch-invariant a [M, K] @ b [K, N] -> [M, N] (a row's result does not depend on M)."""
    if resolve_gpu_backend(backend, a, b) == "triton":
        from . import _tl_invariant

        return _tl_invariant.bmm(a.unsqueeze(0), b.unsqueeze(0), out_dtype or a.dtype)[0]
    return mm_reference(a, b, out_dtype)


def row_sum(x: torch.Tensor, square: bool = False, backend: str = "auto") -> torch.Tensor:
    """x [R, n] -> [R] in ``acc_dtype``: the end-aligned sum of each row (of squares with ``square``)."""
    if resolve_gpu_backend(backend, x) == "triton":
        from . import _tl_invariant

        return _tl_invariant.row_sum(x, square)
    return row_sum_reference(x, square)


def softmax(x: torch.Tensor, log: bool = False, backend: str = "auto") -> torch.Tensor:
    """x [R, n] -> softmax (or log-softmax) over each row, in ``acc_dtype``, end-aligned sums."""
    if resolve_gpu_backend(backend, x) == "triton":
        from . import _tl_invariant

        return _tl_invariant.softmax(x, log)
    return softmax_reference(x, log)


def attention_mask(start: torch.Tensor, q_len: int, n: int, window: int = 0, rows: slice = slice(None)) -> torch.Tensor:
    """bool [B, 1, Q', N]: key c is visible to query row i (at column N − Q + i; ``rows`` selects Q' of the Q rows)
    when start[b] <= c <= N − Q + i and, with a sliding ``window``, c > N − Q + i − window."""
    cols = torch.arange(n, device=start.device)
    qcol = (torch.arange(q_len, device=start.device) + (n - q_len))[rows]
    ok = (cols[None, :] <= qcol[:, None])[None, None] & (cols[None, None, None, :] >= start.view(-1, 1, 1, 1))
    if window:
        ok = ok & (cols[None, :] > qcol[:, None] - window)[None, None]
    return ok


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    window: int = 0,
    element_budget: int = 1 << 26,
) -> torch.Tensor:
    """``attention``'s torch form, laid out from each row's first key like the kernel: every row's keys are moved to
    column 0 (its left padding to the end), then scores by ``bmm_reference`` (fp32), softmax over the visible keys
    by ``softmax_reference`` and probabilities (in v's dtype) times V by ``bmm_reference``, both start-aligned, so
    a query's result does not depend on the padding before its row nor on how many keys follow its own position
    (a chunked prefill).  A row with no visible key gives zeros.  q [B, Hq, Q, D], k/v [B, Hkv, N, D] ->
    [B, Hq, Q, D] in q's dtype.  Query rows in blocks of at most ``element_budget`` scores (rows are independent:
    the blocks change nothing)."""
    b, hq, ql, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    cols = torch.arange(n, device=k.device)
    src = (cols[None, :] + start.view(-1, 1)).clamp_max(n - 1)  # [B, N]: row-relative column j reads start + j
    gather = src[:, None, :, None].expand(b, hkv, n, d)
    kt = k.gather(2, gather).reshape(b * hkv, n, d).transpose(1, 2)
    vv = v.gather(2, gather).reshape(b * hkv, n, d)
    step = max(1, element_budget // max(1, b * hq * n))
    outs = []
    for s0 in range(0, ql, step):
        qc = q[:, :, s0 : s0 + step]
        r = qc.shape[2]
        s = bmm_reference(qc.reshape(b * hkv, g * r, d), kt, torch.float32).reshape(b, hq, r, n) * scale
        qrel = (torch.arange(s0, s0 + r, device=k.device) + (n - ql))[None, :] - start.view(-1, 1)  # [B, r]
        keep = cols[None, None, :] <= qrel[:, :, None]  # [B, r, N]: causal, in the row's own columns
        if window:
            keep = keep & (cols[None, None, :] > qrel[:, :, None] - window)
        keep = keep[:, None]  # [B, 1, r, N]
        s = s.masked_fill(~keep, float("-inf"))
        p = softmax_reference(s.reshape(-1, n), align="start").view(b, hq, r, n).masked_fill(~keep, 0.0).nan_to_num(0.0)
        o = bmm_reference(p.to(v.dtype).reshape(b * hkv, g * r, n), vv, align="start")
        outs.append(o.reshape(b, hq, r, d))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(q.dtype)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    scale: float,
    window: int = 0,
    backend: str = "auto",
) -> torch.Tensor:
    """Batch-invariant causal attention, each row's keys from ``start[b]`` (long [B]; the left padding before it),
    within a sliding ``window`` (0: none): q [B, Hq, Q, D] (the last Q positions), k/v [B, Hkv, N, D] (GQA) ->
    [B, Hq, Q, D].  Triton: online softmax over key tiles laid from the row's first key (``_tl_invariant``)."""
    if resolve_gpu_backend(backend, q, k, v) == "triton":
        from . import _tl_invariant

        return _tl_invariant.attention(q, k, v, start, scale, window)
    return attention_reference(q, k, v, start, scale, window)
