"""MagicPIG (arXiv 2410.16179), the GPU part and the shared math.

SimHash codes (§4.3 "Hash function selection"): W [D, K·L] holds K·L random hyperplanes; for a vector x the
code of table l is the K-bit integer

    code_l(x) = Σ_{j<K} [x · W[:, l·K + j] > 0] · 2^j         (column l·K + j of W = bit j of table l)

Queries are hashed as they are; keys are hashed after centering (§4.3 "Data pre-processing":
k̄_i = k_i − mean_i k_i).  ``hash_codes`` is one Triton kernel (projection + sign + bit packing) for
x [..., D] → codes [..., L] int32; it serves the per-step query codes (q [B, Hq, D]) and the key codes at table
build.

Sampling probability (eq. 10), with p_i = 1 − arccos(cos(q, k̄_i))/π (eq. 11) and a = p^K:

    u_i = P[key i collides with q in ≥ m of the L tables] = 1 − Σ_{j<m} C(L, j) a^j (1 − a)^{L−j}

m = ``min_collisions`` = 2 in the paper (u = 1 − (1−a)^L − L a (1−a)^{L−1}).  The attention logit of a sampled
key is q·k_i/√d − log u_i (eq. 11).  u has one home, ``sparse_eval.simhash_probability.log_sampling_probability``
(float64, in log space, without cancellation); ``collision_probability`` and ``collision_probability_from_cos``
are its forms in a and in cos, and the CPU kernel tabulates it (``magicpig_cpu.logu_table``).

Collision counts (Alg. 1 line 2): c_i = #{l < L : code_l(q) = code_l(k̄_i)}; key i is sampled when
c_i ≥ m.  ``collision_counts`` is the one home of that count for the accuracy path
(``methods.magicpig``) on every backend: a Triton kernel that reads each key's codes once for all G·Q query
rows of its KV group, and the chunked torch reference; both return the same integers.
"""

from __future__ import annotations


import torch

from ..simhash_probability import collision_probability as bit_agreement, log_sampling_probability
from ._common import check_heads, resolve_gpu_backend

__all__ = [
    "collision_counts",
    "collision_counts_reference",
    "hash_codes",
    "hash_codes_reference",
    "random_projections",
    "center_keys",
    "collision_probability",
    "collision_probability_from_cos",
]


def _check_kl(k_bits: int, n_tables: int) -> None:
    if not 1 <= int(k_bits) <= 16:
        raise ValueError(f"K={k_bits}: bits per table must lie in [1, 16] (codes are stored as uint16)")
    if int(n_tables) < 1:
        raise ValueError(f"L={n_tables}: the number of tables must be >= 1")


def random_projections(
    d: int, k_bits: int, n_tables: int, *, seed: int = 0, device=None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """W [D, K·L] with i.i.d. N(0, 1) entries (SimHash hyperplanes), from a fixed seed."""
    _check_kl(k_bits, n_tables)
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randn(d, k_bits * n_tables, generator=gen).to(device=device, dtype=dtype)


def center_keys(k: torch.Tensor, dim: int = -2) -> tuple[torch.Tensor, torch.Tensor]:
    """(k − mean, mean) over the token dimension (float32)."""
    mean = k.float().mean(dim=dim, keepdim=True)
    return k.float() - mean, mean.squeeze(dim)


def hash_codes_reference(x: torch.Tensor, w: torch.Tensor, k_bits: int, n_tables: int) -> torch.Tensor:
    """x [..., D], W [D, K·L] -> int32 codes [..., L] (see the module docstring)."""
    _check_kl(k_bits, n_tables)
    if w.dim() != 2 or w.shape[0] != x.shape[-1] or w.shape[1] != k_bits * n_tables:
        raise ValueError(f"W {tuple(w.shape)}: expected [D={x.shape[-1]}, K·L={k_bits * n_tables}]")
    proj = x.float() @ w.float()  # [..., K·L]
    bits = (proj > 0).view(*x.shape[:-1], n_tables, k_bits).to(torch.int32)
    weights = 1 << torch.arange(k_bits, device=x.device, dtype=torch.int32)
    return (bits * weights).sum(-1, dtype=torch.int32)


def hash_codes(
    x: torch.Tensor,
    w: torch.Tensor,
    k_bits: int,
    n_tables: int,
    *,
    backend: str = "auto",
    block_m: int | None = None,
    block_l: int | None = None,
) -> torch.Tensor:
    """SimHash codes; Triton on CUDA (one kernel: projections, signs, bit packing)."""
    _check_kl(k_bits, n_tables)
    if w.dim() != 2 or w.shape[0] != x.shape[-1] or w.shape[1] != k_bits * n_tables:
        raise ValueError(f"W {tuple(w.shape)}: expected [D={x.shape[-1]}, K·L={k_bits * n_tables}]")
    if resolve_gpu_backend(backend, x, w) == "torch":
        return hash_codes_reference(x, w, k_bits, n_tables)
    from . import _tl_hash

    return _tl_hash.hash_codes(x, w, k_bits, n_tables, block_m=block_m, block_l=block_l)


def collision_probability(a: torch.Tensor, n_tables: int, min_collisions: int = 2) -> torch.Tensor:
    """u = P[Binomial(L, a) ≥ m] in float64, a = p^K (eq. 10 for m = 2): ``log_sampling_probability`` with K = 1."""
    m = int(min_collisions)
    n = int(n_tables)
    if not 1 <= m <= n:
        raise ValueError(f"min_collisions={min_collisions}: must lie in [1, L={n_tables}]")
    return torch.exp(log_sampling_probability(a.double(), 1, n, m))


def collision_probability_from_cos(
    cos: torch.Tensor, k_bits: int, n_tables: int, min_collisions: int = 2
) -> torch.Tensor:
    """u_i from cos(q, k̄_i): p = 1 − arccos(cos)/π (eq. 11), u = P[Binomial(L, p^K) ≥ m] by
    ``log_sampling_probability``."""
    return torch.exp(log_sampling_probability(bit_agreement(cos), int(k_bits), int(n_tables), int(min_collisions)))


def _check_codes(q_codes: torch.Tensor, k_codes: torch.Tensor) -> None:
    if q_codes.dim() != 4 or k_codes.dim() != 4:
        raise ValueError(
            f"q_codes {tuple(q_codes.shape)}, k_codes {tuple(k_codes.shape)}: expected [B, Hq, Q, L] and [B, Hkv, N, L]"
        )
    if q_codes.shape[0] != k_codes.shape[0] or q_codes.shape[3] != k_codes.shape[3]:
        raise ValueError(f"q_codes {tuple(q_codes.shape)}, k_codes {tuple(k_codes.shape)}: batch and L must agree")
    if q_codes.dtype.is_floating_point or k_codes.dtype.is_floating_point:
        raise ValueError(f"codes must be integers, got {q_codes.dtype} and {k_codes.dtype}")
    if q_codes.shape[3] > torch.iinfo(torch.int16).max:
        raise ValueError(f"L={q_codes.shape[3]}: counts are int16, so at most {torch.iinfo(torch.int16).max} tables")
    check_heads(q_codes.shape[1], k_codes.shape[1])


def collision_counts_reference(
    q_codes: torch.Tensor, k_codes: torch.Tensor, element_budget: int = 1 << 26
) -> torch.Tensor:
    """Number of tables in which each key's code equals the query's (Alg. 1 line 2), in torch.

    q_codes [B, Hq, Q, L], k_codes [B, Hkv, N, L] (query head h reads KV head h // G) -> int16 [B, Hq, Q, N].
    Never materialises more than ``element_budget`` (query, key, table) comparisons: keys (and, if needed, query
    rows) are taken in chunks.
    """
    _check_codes(q_codes, k_codes)
    b, hq, ql, nt = q_codes.shape
    hkv, n = k_codes.shape[1], k_codes.shape[2]
    g = hq // hkv
    qg = q_codes.reshape(b, hkv, g * ql, 1, nt)
    out = torch.empty(b, hkv, g * ql, n, dtype=torch.int16, device=q_codes.device)
    rows = g * ql
    row_step = max(1, min(rows, element_budget // max(1, b * hkv * nt)))
    for r0 in range(0, rows, row_step):
        qr = qg[:, :, r0 : r0 + row_step]
        per_key = b * hkv * qr.shape[2] * nt
        key_step = max(1, element_budget // per_key)
        for s in range(0, n, key_step):
            kk = k_codes[:, :, None, s : s + key_step, :]  # [B, Hkv, 1, n', L]
            eq = qr == kk  # [B, Hkv, rows, n', L] bool
            if nt <= 255:  # summed as uint8 in place: a sum into int16 first copies the whole comparison to int16
                out[:, :, r0 : r0 + row_step, s : s + key_step] = eq.view(torch.uint8).sum(-1, dtype=torch.uint8)
            else:
                out[:, :, r0 : r0 + row_step, s : s + key_step] = eq.sum(-1, dtype=torch.int16)
    return out.reshape(b, hq, ql, n)


def collision_counts(
    q_codes: torch.Tensor, k_codes: torch.Tensor, *, backend: str = "auto", element_budget: int = 1 << 26
) -> torch.Tensor:
    """``collision_counts_reference``'s counts, int16 [B, Hq, Q, N]; Triton on CUDA (each key block's codes read
    once for the G·Q query rows of its KV group, no comparison tensor in memory).  ``element_budget`` bounds the
    torch path's memory only; the counts are the same integers on every backend."""
    _check_codes(q_codes, k_codes)
    if resolve_gpu_backend(backend, q_codes, k_codes) == "torch":
        return collision_counts_reference(q_codes, k_codes, element_budget)
    from . import _tl_collisions

    return _tl_collisions.collision_counts(q_codes, k_codes)
