"""Quest (ICML 2024), decode step: query-aware page selection.

For each page P of ``page_size`` consecutive keys the cache keeps the element-wise minimum and maximum key
(m_d = min_{i∈P} k_{i,d}, M_d = max_{i∈P} k_{i,d}).  The criticality of page P for query q is the upper bound
of q·k over the page's bounding box (Quest §3.3):

    U(P) = Σ_d max(q_d · m_d, q_d · M_d)

The top pages by U are selected and attention runs over all their tokens (here:
``kernels.sparse_decode.attention`` over the token indices expanded from the pages).

Shapes: q [B, Hq, D]; k [B, Hkv, N, D]; kmin/kmax [B, Hkv, P, D] with P = ceil(N / page_size) (the last page
may be partial).  Head sharing (``gqa``): "query_head" (each query head picks its own pages, the paper's
MHA setting) or "kv_head" (pages by the criticality summed over the G query heads of a KV group).
"""

from __future__ import annotations

import torch

from . import sparse_decode
from ._common import check_heads, resolve_gpu_backend

__all__ = [
    "page_metadata",
    "page_scores",
    "page_scores_reference",
    "top_pages",
    "pages_to_tokens",
    "decode",
    "decode_reference",
]

GQA_MODES = ("query_head", "kv_head")


def page_metadata(k: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k [B, Hkv, N, D] -> (kmin, kmax) [B, Hkv, ceil(N/page_size), D] in k's dtype (min/max are exact)."""
    if page_size < 1:
        raise ValueError(f"page_size={page_size}: must be >= 1")
    b, h, n, d = k.shape
    p = -(-n // page_size)
    pad = p * page_size - n
    if pad:
        big = torch.finfo(k.dtype).max
        kmin_src = torch.cat([k, k.new_full((b, h, pad, d), big)], dim=2)
        kmax_src = torch.cat([k, k.new_full((b, h, pad, d), -big)], dim=2)
    else:
        kmin_src = kmax_src = k
    kmin = kmin_src.view(b, h, p, page_size, d).amin(3)
    kmax = kmax_src.view(b, h, p, page_size, d).amax(3)
    return kmin.contiguous(), kmax.contiguous()


def _check(q, kmin, kmax, n_pages):
    if q.dim() != 3 or kmin.dim() != 4 or kmax.shape != kmin.shape:
        raise ValueError(
            f"expected q [B, Hq, D], kmin/kmax [B, Hkv, P, D]; got {tuple(q.shape)}, "
            f"{tuple(kmin.shape)}, {tuple(kmax.shape)}"
        )
    if q.shape[0] != kmin.shape[0] or q.shape[2] != kmin.shape[3]:
        raise ValueError(f"q {tuple(q.shape)} and kmin {tuple(kmin.shape)} disagree on batch or head dim")
    check_heads(q.shape[1], kmin.shape[1])
    if n_pages is not None and tuple(n_pages.shape) != (q.shape[0],):
        raise ValueError(f"n_pages {tuple(n_pages.shape)}: expected [B={q.shape[0]}]")


def page_scores_reference(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    reduce: bool = False,
    n_pages: torch.Tensor | None = None,
) -> torch.Tensor:
    """U(P) for every page: float32 [B, Hq, P], or [B, Hkv, P] summed over each KV group with ``reduce``.
    Pages at positions ≥ n_pages[b] score −inf."""
    _check(q, kmin, kmax, n_pages)
    b, hq, d = q.shape
    hkv, p = kmin.shape[1], kmin.shape[2]
    g = hq // hkv
    qg = q.float().view(b, hkv, g, 1, d)
    u = torch.maximum(qg * kmin.float().unsqueeze(2), qg * kmax.float().unsqueeze(2)).sum(-1)  # [B, Hkv, G, P]
    u = u.sum(2) if reduce else u.reshape(b, hq, p)
    if n_pages is not None:
        u = u.masked_fill(
            torch.arange(p, device=u.device).view(1, 1, p) >= n_pages.to(u.device).view(b, 1, 1), float("-inf")
        )
    return u


def page_scores(
    q: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    *,
    reduce: bool = False,
    n_pages: torch.Tensor | None = None,
    backend: str = "auto",
    block_p: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Page criticality (see ``page_scores_reference``); Triton on CUDA."""
    _check(q, kmin, kmax, n_pages)
    if resolve_gpu_backend(backend, q, kmin, kmax) == "torch":
        return page_scores_reference(q, kmin, kmax, reduce=reduce, n_pages=n_pages)
    from . import _tl_scores

    return _tl_scores.page_scores(q, kmin, kmax, reduce=reduce, n_pages=n_pages, block_p=block_p, num_warps=num_warps)


def top_pages(scores: torch.Tensor, n: int, *, backend: str = "auto", topk: str = "radix") -> torch.Tensor:
    """int32 [..., min(n, P)] page ids of the n highest scores (−1 where the score is −inf); ``backend`` and
    ``topk`` as in ``ds.topk_indices``."""
    from .ds import topk_indices

    return topk_indices(scores, n, backend=backend, topk=topk)


def pages_to_tokens(pages: torch.Tensor, page_size: int, n_tokens: int) -> torch.Tensor:
    """pages [..., S] (−1 = padding) -> token indices [..., S·page_size] int32 (−1 for padding and for the
    missing tail of a partial last page)."""
    offs = torch.arange(page_size, device=pages.device, dtype=torch.int32)
    tok = pages.to(torch.int32).unsqueeze(-1) * page_size + offs
    bad = (pages < 0).unsqueeze(-1) | (tok >= n_tokens)
    return torch.where(bad, torch.full_like(tok, -1), tok).flatten(-2)


def decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_size: int,
    n_select: int,
    *,
    gqa: str = "query_head",
    scaling: float | None = None,
    backend: str = "auto",
    topk: str = "radix",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One Quest decode step: score pages, keep the top ``n_select`` pages (``topk`` as in ``ds.topk_indices``),
    attend over their tokens.
    Returns (o [B, Hq, D], lse [B, Hq], token idx [B, Hq or Hkv, n_select·page_size] int32)."""
    if gqa not in GQA_MODES:
        raise ValueError(f"gqa={gqa!r}: valid values are {list(GQA_MODES)}")
    p_expected = -(-k.shape[2] // page_size)
    if kmin.shape[2] != p_expected:
        raise ValueError(
            f"kmin has {kmin.shape[2]} pages; {k.shape[2]} tokens at page_size={page_size} make {p_expected}"
        )
    scores = page_scores(q, kmin, kmax, reduce=gqa == "kv_head", backend=backend)
    pages = top_pages(scores, n_select, backend=backend, topk=topk)
    idx = pages_to_tokens(pages, page_size, k.shape[2])
    o, lse = sparse_decode.attention(q, k, v, idx, scaling=scaling, backend=backend)
    return o, lse, idx


def decode_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kmin: torch.Tensor,
    kmax: torch.Tensor,
    page_size: int,
    n_select: int,
    *,
    gqa: str = "query_head",
    scaling: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return decode(q, k, v, kmin, kmax, page_size, n_select, gqa=gqa, scaling=scaling, backend="torch", topk="torch")
