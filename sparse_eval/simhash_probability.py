"""MagicPIG's sampling probability (arXiv 2410.16179, eq. 10 and 11), float64, importing only the leaf module
``device_constants``: the one home of u, used by the method (``methods.magicpig``) and the kernels
(``kernels.magicpig``, ``kernels.magicpig_cpu``).

With p = 1 − arccos(cos(q, k̄))/π the per-bit agreement of SimHash (``collision_probability``), each of the L tables
of K bits collides with probability p^K, so a key is sampled (at least ``min_collisions`` colliding tables) with

    u = P[Binomial(L, p^K) ≥ min_collisions]          (= eq. 10 for min_collisions = 2)

``log_sampling_probability`` computes log u in log space without cancellation; ``sampling_probability`` is u.
"""

from __future__ import annotations

import functools
import math

import torch

from .device_constants import made_once


@functools.lru_cache(maxsize=None)
def upper_terms(m: int, L: int, tol: float = 1e-20) -> int:
    """Terms j = m, m+1, … of the upper tail needed when the pmf decreases from j = m (mode ≤ m): there
    pmf(j+1)/pmf(j) < (m+1)/(j+1), so pmf(m+T)/pmf(m) < (m+1)^T m!/(m+T)!; stop once that is below ``tol``."""
    t = 1
    while t < L - m + 1 and t * math.log(m + 1) + math.lgamma(m + 1) - math.lgamma(m + t + 1) > math.log(tol):
        t += 1
    return min(t + 1, L - m + 1)


def log_sampling_probability(
    p: torch.Tensor, K: int, L: int, min_collisions: int, element_budget: int = 1 << 24
) -> torch.Tensor:
    """log u, u = P[Binomial(L, p^K) ≥ min_collisions] (eq. 10 for min_collisions = 2), elementwise in float64.

    Exact in log space without cancellation: when the binomial's mode (⌊(L+1)·p^K⌋) exceeds m, u ≥ 1/2 and
    u = 1 − P[X < m] (m terms); otherwise the pmf decreases from j = m and the upper tail is summed over the
    terms that matter (relative error < 1e-20, ``upper_terms``), so tiny u stays exact.  p = 1 gives 0, p = 0
    gives −inf (clamp p first where −inf must not occur).  At most ``element_budget`` (element, term) pairs
    exist at once.
    """
    p = p.to(torch.float64).clamp(0.0, 1.0)
    m = int(min_collisions)
    if m <= 0:
        return torch.zeros_like(p)
    if m > L:
        return torch.full_like(p, -math.inf)
    lo, hi = _pmf_terms(L, m, p.device)

    def log_pmf(terms: tuple[torch.Tensor, ...], log_r: torch.Tensor, log_1mr: torch.Tensor) -> torch.Tensor:
        log_c, j, rest, j_pos, rest_pos = terms  # each [J]
        fail = torch.where(rest_pos, rest * log_1mr, 0.0)  # 0·(−inf) := 0
        return log_c + torch.where(j_pos, j * log_r, 0.0) + fail  # [M, J]

    flat = p.reshape(-1)
    step = max(1, element_budget // (m + hi[1].numel()))
    parts = []
    for s in range(0, flat.numel(), step):
        pc = flat[s : s + step, None]
        log_r = K * torch.log(pc)  # log p^K (−inf at p = 0)
        log_1mr = torch.log1p(-torch.exp(log_r))  # log(1 − p^K) (−inf at p = 1)
        upper = torch.logsumexp(log_pmf(hi, log_r, log_1mr), dim=-1)
        lower = torch.logsumexp(log_pmf(lo, log_r, log_1mr), dim=-1).clamp_max(0.0)
        complement = torch.log(-torch.expm1(lower))  # log(1 − P[X < m])
        big = torch.floor((L + 1) * torch.exp(log_r[:, 0])) > m
        parts.append(torch.where(big, complement, upper).clamp_max(0.0))
    out = parts[0] if len(parts) == 1 else torch.cat(parts)
    return out.reshape(p.shape)


@made_once
def _pmf_terms(L: int, m: int, device: torch.device) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The binomial pmf's per-term constants, made once per (L, m, device): for the lower terms j = 0..m−1 and
    the upper terms j = m..m+T−1 (``upper_terms``), (log C(L, j), j, L − j, j > 0, L − j > 0), float64 [J]
    (a step then launches only the terms' products with log p^K and log(1 − p^K))."""
    out = []
    for j in (
        torch.arange(0, m, dtype=torch.float64, device=device),
        torch.arange(m, m + upper_terms(m, L), dtype=torch.float64, device=device),
    ):
        log_c = math.lgamma(L + 1) - torch.lgamma(j + 1) - torch.lgamma(L - j + 1)
        rest = L - j
        out.append((log_c, j, rest, j > 0, rest > 0))
    return out[0], out[1]


def sampling_probability(p: torch.Tensor | float, K: int, L: int, min_collisions: int = 2) -> torch.Tensor:
    """u(p) = P[key sampled] for per-table bit agreement p (eq. 10 generalised), float64."""
    return torch.exp(log_sampling_probability(torch.as_tensor(p, dtype=torch.float64), K, L, min_collisions))


def collision_probability(cos: torch.Tensor) -> torch.Tensor:
    """SimHash per-bit agreement p = 1 − arccos(cos)/π (eq. 10), float64."""
    return 1.0 - torch.arccos(cos.to(torch.float64).clamp(-1.0, 1.0)) / math.pi
