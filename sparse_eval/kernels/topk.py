"""Row-wise top-k selection for the sparse decode step (Double Sparsity Alg. 1 line 5; Quest's top pages).

For each row r of scores [..., N] and its budget k_r (an int for all rows, or a device tensor [...]): the
positions of the k_r largest scores, in no particular order, written into an int32 row of ``k_max`` slots and
padded with −1.  Positions whose score is −inf (masked keys) are never selected, so a row with fewer finite
scores than k_r gets fewer entries.  Ties at the k_r-th value are broken towards lower positions in the Triton
kernel (``torch.topk`` in the reference breaks them in its own way: equal sets up to ties).

The Triton kernels avoid sorting.  They find the k-th largest score of a row exactly by a radix search over the
order-preserving uint32 image of the fp32 scores, ``radix_bits`` bits per pass from the top: each pass histograms
the next digit of the keys that share the prefix found so far, and the digit of the k-th key is the largest whose
count of keys at or above it reaches the rank still sought.  Then one pass counts, per tile, the keys above that
threshold and the ties, and a last pass writes the positions above it and the first ties, in position order, at
slots given by prefix sums over the tiles.  Every pass runs on a grid of (row, tile of ``block_n`` scores), so a
long row is spread over many programs.  Because k may be a device tensor and nothing depends on it on the host, a
step that uses this needs no synchronisation and can be captured in a CUDA graph with a budget that changes from
step to step.
"""

from __future__ import annotations

import torch

from ._common import resolve_gpu_backend

__all__ = ["select", "select_reference", "kth_largest", "kth_largest_reference"]


def _check(scores: torch.Tensor, k_max: int, count):
    if scores.dim() < 1 or scores.dtype != torch.float32:
        raise ValueError(f"scores: expected float32 [..., N], got {scores.dtype} {tuple(scores.shape)}")
    if k_max < 1:
        raise ValueError(f"k_max={k_max}: must be >= 1")
    if count is not None and tuple(count.shape) != tuple(scores.shape[:-1]):
        raise ValueError(f"count {tuple(count.shape)}: expected {tuple(scores.shape[:-1])} (one budget per row)")


def select_reference(scores: torch.Tensor, k_max: int, count: torch.Tensor | None = None) -> torch.Tensor:
    """torch.topk of min(k_max, N) (sorted), entries at rank ≥ count[r] or with score −inf set to −1, padded to
    k_max slots.  int32 [..., k_max]."""
    _check(scores, k_max, count)
    n = scores.shape[-1]
    k = min(k_max, n)
    vals, ids = torch.topk(scores, k, dim=-1, sorted=True)
    keep = vals > float("-inf")
    if count is not None:
        keep &= torch.arange(k, device=scores.device) < count.to(scores.device).unsqueeze(-1)
    out = torch.where(keep, ids, torch.full_like(ids, -1)).to(torch.int32)
    if k < k_max:
        out = torch.cat([out, out.new_full((*out.shape[:-1], k_max - k), -1)], -1)
    return out


def select(
    scores: torch.Tensor,
    k_max: int,
    count: torch.Tensor | None = None,
    *,
    backend: str = "auto",
    radix_bits: int = 8,
    block_n: int = 2048,
    num_warps: int = 4,
    atomic_from: int = 2,
) -> torch.Tensor:
    """Top-k positions per row (see the module docstring): scores float32 [..., N]; k_max the slots per row (the
    budget when ``count`` is None); count int [...] per-row budgets ≤ k_max on the device.  int32 [..., k_max],
    positions in increasing order, then −1.  ``radix_bits``: digit width of a pass (32/radix_bits histogram
    passes); ``block_n``: scores per program; passes from ``atomic_from`` on count with one global atomic per key
    that matches the prefix (few do by then) instead of a tile histogram."""
    _check(scores, k_max, count)
    which = resolve_gpu_backend(backend, scores, count)
    if which == "torch":
        return select_reference(scores, k_max, count)
    if radix_bits not in (4, 8):
        raise ValueError(f"radix_bits={radix_bits}: valid values are [4, 8]")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n={block_n}: must be a power of two >= 16")
    from . import _tl_topk

    return _tl_topk.select(
        scores, k_max, count, radix_bits=radix_bits, block_n=block_n, num_warps=num_warps, atomic_from=atomic_from
    )


def kth_largest_reference(scores: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """The count[r]-th largest entry of each row of scores float32 [..., N] (with multiplicity; −inf entries count
    as the smallest), float32 [...]: a descending sort read at count − 1 (clamped to [0, N − 1]; a row with count 0
    gives its largest entry).  Top-k recall's threshold (``methods.core.kept_mass_and_recall``)."""
    ranked = scores.sort(dim=-1, descending=True).values
    at = (count.to(device=scores.device, dtype=torch.long) - 1).clamp(0, max(0, scores.shape[-1] - 1))
    return ranked.gather(-1, at.unsqueeze(-1)).squeeze(-1)


def kth_largest(
    scores: torch.Tensor, count: torch.Tensor, *, backend: str = "auto", radix_bits: int = 8, block_n: int = 2048
) -> torch.Tensor:
    """``kth_largest_reference`` without sorting: the radix search of ``select`` (its histogram passes) and one
    kernel that turns the found key back into the float, so a budget on the device costs no host sync.  The value
    is exact (an order statistic: the same in any summation order, so batch-invariant).  A row with count 0 gives
    an unspecified value (no key is at rank 0)."""
    _check(scores, 1, count)
    which = resolve_gpu_backend(backend, scores, count)
    if which == "torch":
        return kth_largest_reference(scores, count)
    from . import _tl_topk

    return _tl_topk.kth_largest(scores, count, radix_bits=radix_bits, block_n=block_n)
