"""MagicPIG (arXiv 2410.16179), the CPU part (§4.4: hash tables and the sampled attention live in CPU memory).

1. ``build_tables``: for each sequence b, KV head and table l, the keys sorted by their K-bit code (a stable
   counting sort) with bucket offsets — bucket c of table l is ``perm[b, h, l, offsets[b, h, l, c] :
   offsets[b, h, l, c + 1]]`` (the authors' "bucket index lists").  Memory: 4·L·(N + 2^K + 1) bytes per head.
2. ``sample``: the query's L codes (computed on the GPU, ``kernels.magicpig.hash_codes``) select one bucket per
   table; a key is sampled when it lies in at least ``min_collisions`` (= 2, §4.3) of the query's buckets.
   Only those L buckets are read.
3. ``attention``: over the sampled keys S (eq. 11),

       l_i = q·k_i · scaling − log u_i,   u_i from eq. 10 with p_i = 1 − arccos(cos(q, k̄_i))/π,
       o   = Σ_{i∈S} e^{l_i − lse} v_i,  lse = log Σ_{i∈S} e^{l_i},

   where k̄_i = k_i − mean (the keys were hashed centred, §4.3) and q·k_i uses the stored (uncentred) keys so
   that ``lse`` is on the same scale as a GPU partial over the static keys (sink + local window, u = 1):
   ``kernels.merge.merge_by_lse`` then gives the exact attention over the union.

KV storage is bf16 (or fp16, or fp32) [B, Hkv, N, D]; accumulation is fp32, u in fp64.  GQA: query head h uses
KV head h // (Hq / Hkv) and its tables.  Threads: ``set_num_threads`` (numba's pool; default all cores).
Backends: "numba" (default where installed), "torch" (the ``*_reference`` functions, always available).
"""

from __future__ import annotations

import functools
import math
import os
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from ._common import check_heads, numba_available, resolve_cpu_backend
from .magicpig import _check_kl, collision_probability_from_cos

__all__ = [
    "HashTables",
    "build_tables",
    "build_tables_reference",
    "sample",
    "sample_reference",
    "attention",
    "attention_reference",
    "sample_and_attend",
    "set_num_threads",
    "get_num_threads",
    "cpu_features",
]


# ----------------------------------------------------------------------------------------------- runtime
def _nb():
    from . import _nb_magicpig

    return _nb_magicpig


def set_num_threads(n: int) -> None:
    """Threads of the numba kernels (1 .. NUMBA_NUM_THREADS, which defaults to the core count)."""
    if not numba_available():
        torch.set_num_threads(int(n))
        return
    import numba

    top = numba.config.NUMBA_NUM_THREADS
    if not 1 <= int(n) <= top:
        raise ValueError(f"threads={n}: valid values are 1..{top} (NUMBA_NUM_THREADS)")
    numba.set_num_threads(int(n))


def get_num_threads() -> int:
    if not numba_available():
        return torch.get_num_threads()
    import numba

    return numba.get_num_threads()


def cpu_features() -> dict:
    """What the JIT will target on this machine (read at run time): CPU name, core count, vector extensions."""
    info: dict = {"logical_cpus": os.cpu_count(), "numba": numba_available(), "torch_cpu_capability": None}
    try:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:  # pragma: no cover
        pass
    model = None
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:  # pragma: no cover - not Linux
        pass
    info["cpu_model"] = model
    if numba_available():
        import numba
        from llvmlite import binding as llvm

        feats = {f[1:] for f in llvm.get_host_cpu_features().flatten().split(",") if f.startswith("+")}
        info["llvm_cpu_name"] = llvm.get_host_cpu_name()
        info["avx2"] = "avx2" in feats
        info["avx512f"] = "avx512f" in feats
        info["avx512bf16"] = "avx512bf16" in feats
        info["amx_bf16"] = "amx-bf16" in feats
        info["numba_threads"] = numba.get_num_threads()
        info["numba_max_threads"] = numba.config.NUMBA_NUM_THREADS
    return info


_warned = False


def _backend(backend: str) -> str:
    global _warned
    which = resolve_cpu_backend(backend)
    if backend == "auto" and which == "torch" and not _warned:
        warnings.warn(
            "numba is not installed: MagicPIG CPU kernels fall back to slow torch code (pip install numba)",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned = True
    return which


# ----------------------------------------------------------------------------------------------- tables
@dataclass
class HashTables:
    """perm int32 [B, Hkv, L, N]; offsets int32 [B, Hkv, L, 2^K + 1]; codes uint16 [B, Hkv, L, N] or None."""

    perm: torch.Tensor
    offsets: torch.Tensor
    k_bits: int
    n_tables: int
    codes: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        b, h, _, n = self.perm.shape
        return b, h, n

    def nbytes(self) -> int:
        t = self.perm.numel() * 4 + self.offsets.numel() * 4
        return t + (self.codes.numel() * 2 if self.codes is not None else 0)

    def key_codes(self) -> torch.Tensor:
        """int32 [B, Hkv, N, L]: each key's code per table (from ``codes`` or recovered from the buckets)."""
        if self.codes is not None:
            return self.codes.to(torch.int32).permute(0, 1, 3, 2)
        b, h, l_, n = self.perm.shape
        pos = torch.arange(n, dtype=torch.int32).expand(b, h, l_, n).contiguous()
        bucket = (torch.searchsorted(self.offsets.contiguous(), pos, right=True) - 1).to(torch.int32)
        codes = torch.empty_like(bucket)
        codes.scatter_(-1, self.perm.long(), bucket)
        return codes.permute(0, 1, 3, 2)


def _codes_to_u16(codes: torch.Tensor, k_bits: int) -> np.ndarray:
    if codes.dim() != 4:
        raise ValueError(f"key codes: expected [B, Hkv, N, L], got {tuple(codes.shape)}")
    if codes.is_floating_point() or codes.dtype == torch.bool:
        raise ValueError(f"key codes must be integers, got {codes.dtype}")
    c = codes.detach().cpu()
    if c.numel():
        lo, hi = int(c.min()), int(c.max())
        if lo < 0 or hi >= (1 << k_bits):
            raise ValueError(f"key codes must lie in [0, 2^K = {1 << k_bits}); got range [{lo}, {hi}]")
    return c.permute(0, 1, 3, 2).to(torch.int32).numpy().astype(np.uint16)  # [B, Hkv, L, N], contiguous


def build_tables_reference(codes: torch.Tensor, k_bits: int, *, keep_codes: bool = False) -> HashTables:
    """codes [B, Hkv, N, L] (key codes, e.g. ``hash_codes(k − mean, W, K, L)``) -> HashTables (torch sort)."""
    _check_kl(k_bits, codes.shape[-1] if codes.dim() == 4 else 1)
    ct = torch.from_numpy(_codes_to_u16(codes, k_bits).astype(np.int32))  # [B, Hkv, L, N]
    sorted_codes, perm = torch.sort(ct, dim=-1, stable=True)
    bounds = torch.arange((1 << k_bits) + 1, dtype=torch.int32).expand(*ct.shape[:3], -1).contiguous()
    offsets = torch.searchsorted(sorted_codes.contiguous(), bounds, right=False).to(torch.int32)
    return HashTables(
        perm=perm.to(torch.int32),
        offsets=offsets,
        k_bits=k_bits,
        n_tables=ct.shape[2],
        codes=ct.to(torch.int32).to(torch.uint16) if keep_codes else None,
    )


def build_tables(codes: torch.Tensor, k_bits: int, *, keep_codes: bool = False, backend: str = "auto") -> HashTables:
    """Bucketed hash tables of the keys' codes (see the module docstring).  codes [B, Hkv, N, L] int."""
    if codes.dim() != 4:
        raise ValueError(f"key codes: expected [B, Hkv, N, L], got {tuple(codes.shape)}")
    _check_kl(k_bits, codes.shape[-1])
    if _backend(backend) == "torch":
        return build_tables_reference(codes, k_bits, keep_codes=keep_codes)
    ct = _codes_to_u16(codes, k_bits)
    b, h, l_, n = ct.shape
    perm = np.empty((b, h, l_, n), np.int32)
    offsets = np.empty((b, h, l_, (1 << k_bits) + 1), np.int32)
    _nb().build_kernel(ct, perm, offsets)
    return HashTables(
        perm=torch.from_numpy(perm),
        offsets=torch.from_numpy(offsets),
        k_bits=k_bits,
        n_tables=l_,
        codes=torch.from_numpy(ct.view(np.int16)).view(torch.uint16) if keep_codes else None,
    )


# ----------------------------------------------------------------------------------------------- sampling
def _check_qcodes(tables: HashTables, q_codes: torch.Tensor, min_collisions: int) -> None:
    b, hkv, _ = tables.shape
    if q_codes.dim() != 3 or q_codes.shape[0] != b or q_codes.shape[2] != tables.n_tables:
        raise ValueError(f"q_codes {tuple(q_codes.shape)}: expected [B={b}, Hq, L={tables.n_tables}]")
    check_heads(q_codes.shape[1], hkv)
    if not 1 <= int(min_collisions) <= tables.n_tables:
        raise ValueError(f"min_collisions={min_collisions}: must lie in [1, L={tables.n_tables}]")


def _pad_rows(rows: list[torch.Tensor], b: int, hq: int) -> tuple[torch.Tensor, torch.Tensor]:
    count = torch.tensor([len(r) for r in rows], dtype=torch.int32).view(b, hq)
    width = int(count.max()) if rows else 0
    idx = torch.full((b * hq, width), -1, dtype=torch.int32)
    for i, r in enumerate(rows):
        idx[i, : len(r)] = r.to(torch.int32)
    return idx.view(b, hq, width), count


def sample_reference(
    key_codes: torch.Tensor, q_codes: torch.Tensor, min_collisions: int = 2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Brute force (no tables): key i of KV head h // G is sampled for query row (b, h) when
    #{l : key_codes[b, h//G, i, l] == q_codes[b, h, l]} ≥ min_collisions.
    key_codes [B, Hkv, N, L]; q_codes [B, Hq, L].  Returns (idx int32 [B, Hq, S] ascending, −1 padded;
    count int32 [B, Hq])."""
    b, hkv, n, l_ = key_codes.shape
    hq = q_codes.shape[1]
    g = check_heads(hq, hkv)
    if q_codes.shape != (b, hq, l_):
        raise ValueError(f"q_codes {tuple(q_codes.shape)}: expected [B={b}, Hq, L={l_}]")
    rows = []
    kc = key_codes.long()
    qc = q_codes.long()
    for bi in range(b):
        for h in range(hq):
            coll = (kc[bi, h // g] == qc[bi, h].view(1, l_)).sum(-1)
            rows.append(torch.nonzero(coll >= min_collisions).flatten())
    return _pad_rows(rows, b, hq)


_SCRATCH = threading.local()


def _scratch(size: int) -> np.ndarray:
    """A per-thread int32 buffer of at least ``size`` entries, kept between calls: the look-up writes a few entries
    per row into [B, Hq, N] slots, and a fresh array would page-fault (and, on huge pages, zero) every call."""
    buf = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.size < size:
        buf = _SCRATCH.buf = np.empty(size, np.int32)
    return buf[:size]


def _extra_hits_reference(q_codes: np.ndarray, extra: np.ndarray, min_collisions: int) -> list[list[np.ndarray]]:
    """For each query row, the ascending e whose codes extra[b, h // G, e] equal the row's in ≥ m tables."""
    b, hq, _ = q_codes.shape
    g = hq // extra.shape[1]
    eq = (q_codes.reshape(b, extra.shape[1], g, 1, -1) == extra[:, :, None]).sum(-1)  # [B, Hkv, G, E]
    hit = eq.reshape(b, hq, -1) >= min_collisions
    return [[np.nonzero(hit[bi, h])[0] for h in range(hq)] for bi in range(b)]


def sample(
    tables: HashTables,
    q_codes: torch.Tensor,
    min_collisions: int = 2,
    *,
    sort: bool = True,
    backend: str = "auto",
    index_offset: int = 0,
    extra_codes: torch.Tensor | None = None,
    extra_offset: int = 0,
    extra_count: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample set of each query row from the tables (see ``sample_reference`` for the rule).
    q_codes [B, Hq, L] int (codes outside [0, 2^K) match nothing).  Returns (idx int32 [B, Hq, S_max],
    −1 padded, ascending when ``sort``; count int32 [B, Hq]).

    A cache that grew after its tables were built: ``extra_codes`` [B, Hkv, E, L] are the codes of E further keys,
    matched by brute force with the same rule; a row's hits among them follow its table hits, as
    ``extra_offset + e`` in ascending e (and are counted).  ``extra_count``: only the first ``extra_count`` of the E
    (a preallocated buffer filled as keys arrive: read in place, no copy per call; None: all E).
    ``index_offset`` is added to the table hits (e.g. the
    sink tokens before the tables' first key).  All of this happens in the kernels: no pass of numpy or torch over
    the [B, Hq, S] result."""
    _check_qcodes(tables, q_codes, min_collisions)
    b, hkv, n = tables.shape
    hq = q_codes.shape[1]
    qc = q_codes.detach().cpu().to(torch.int32).contiguous()
    if extra_codes is not None and (
        extra_codes.dim() != 4 or tuple(extra_codes.shape[:2]) != (b, hkv) or extra_codes.shape[3] != tables.n_tables
    ):
        raise ValueError(f"extra_codes {tuple(extra_codes.shape)}: expected [B={b}, Hkv={hkv}, E, L={tables.n_tables}]")
    n_extra = 0 if extra_codes is None else extra_codes.shape[2]
    if extra_count is not None:
        if not 0 <= int(extra_count) <= n_extra:
            raise ValueError(f"extra_count={extra_count}: must lie in [0, E={n_extra}] (the extra_codes given)")
        n_extra = int(extra_count)
    if _backend(backend) == "torch":
        idx, cnt = sample_reference(tables.key_codes(), qc, min_collisions)
        if not index_offset and not n_extra:
            return idx, cnt
        hits = (
            _extra_hits_reference(
                qc.numpy(), extra_codes[:, :, :n_extra].detach().cpu().to(torch.int32).numpy(), int(min_collisions)
            )
            if n_extra
            else None
        )
        rows = [
            torch.cat(
                [idx[bi, h, : cnt[bi, h]] + index_offset]
                + ([torch.from_numpy(hits[bi][h]).to(torch.int32) + extra_offset] if n_extra else [])
            )
            for bi in range(b)
            for h in range(hq)
        ]
        return _pad_rows(rows, b, hq)
    nb = _nb()
    out = _scratch(b * hq * max(n, 1)).reshape(b, hq, max(n, 1))
    cnt = np.empty((b, hq), np.int32)
    threads = nb.get_threads()
    nb.sample_kernel(
        tables.perm.numpy(), tables.offsets.numpy(), qc.numpy(), int(min_collisions), threads, bool(sort), out, cnt
    )
    hit_cnt = np.zeros((b, hq), np.int32)
    hit_idx = np.empty((b, hq, max(n_extra, 1)), np.int32)
    if n_extra:
        ex = extra_codes.detach().cpu().to(torch.int32).contiguous().numpy()
        nb.extra_hits_kernel(qc.numpy(), ex, n_extra, int(min_collisions), hit_idx, hit_cnt)
    total = cnt + hit_cnt
    idx = np.empty((b, hq, int(total.max()) if total.size else 0), np.int32)
    nb.finish_rows_kernel(out, cnt, int(index_offset), hit_idx, hit_cnt, int(extra_offset), idx)
    return torch.from_numpy(idx), torch.from_numpy(total)


# ----------------------------------------------------------------------------------------------- attention
def _check_attn(q, k, v, idx, count, k_mean):
    if q.dim() != 3 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B, Hq, D] and k, v [B, Hkv, N, D]; got q {tuple(q.shape)}, "
            f"k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    b, hq, d = q.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} disagree on batch or head dim")
    check_heads(hq, k.shape[1])
    if idx.dim() != 3 or tuple(idx.shape[:2]) != (b, hq):
        raise ValueError(f"idx {tuple(idx.shape)}: expected [B={b}, Hq={hq}, S]")
    if count is not None and tuple(count.shape) != (b, hq):
        raise ValueError(f"count {tuple(count.shape)}: expected [B={b}, Hq={hq}]")
    if k_mean is not None and tuple(k_mean.shape) != (b, k.shape[1], d):
        raise ValueError(f"k_mean {tuple(k_mean.shape)}: expected [B={b}, Hkv={k.shape[1]}, D={d}]")
    if k.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"KV dtype {k.dtype}: valid are [torch.bfloat16, torch.float16, torch.float32]")


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor | None = None,
    *,
    k_bits: int,
    n_tables: int,
    min_collisions: int = 2,
    scaling: float | None = None,
    k_mean: torch.Tensor | None = None,
    correct: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch gather + matmul with the −log u correction (eq. 11).  q [B, Hq, D]; k, v [B, Hkv, N, D];
    idx [B, Hq, S] (−1 = padding); count [B, Hq] optional; k_mean [B, Hkv, D] (the mean the keys were centred
    by before hashing; None = no centring).  ``correct=False`` drops −log u (plain attention over idx).
    Returns (o [B, Hq, D] float32, lse [B, Hq] float32)."""
    _check_attn(q, k, v, idx, count, k_mean)
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    s_len = idx.shape[2]
    valid = idx >= 0
    if count is not None:
        valid = valid & (torch.arange(s_len) < count.unsqueeze(-1))
    safe = torch.where(valid, idx, torch.zeros_like(idx)).long()
    bi = torch.arange(b).view(b, 1, 1)
    hi = (torch.arange(hq) // g).view(1, hq, 1)
    ks = k[bi, hi, safe].float()  # [B, Hq, S, D]
    vs = v[bi, hi, safe].float()
    qf = q.float()
    dot = torch.einsum("bhsd,bhd->bhs", ks, qf)
    logits = dot * scaling
    if correct:
        mean = torch.zeros(b, hkv, d) if k_mean is None else k_mean.float()
        kc = ks - mean.repeat_interleave(g, dim=1).unsqueeze(2)
        den = qf.norm(dim=-1, keepdim=True) * kc.norm(dim=-1)
        cos = torch.where(den > 0, torch.einsum("bhsd,bhd->bhs", kc, qf) / den.clamp_min(1e-30), torch.zeros_like(den))
        u = collision_probability_from_cos(cos, k_bits, n_tables, min_collisions)
        logits = logits - torch.log(u.clamp_min(1e-300)).float()
    logits = logits.masked_fill(~valid, float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    p = torch.exp(logits - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.einsum("bhs,bhsd->bhd", p, vs)
    return o, lse


LOGU_NODES = 1 << 16


@functools.lru_cache(maxsize=64)
def logu_table(k_bits: int, n_tables: int, min_collisions: int, nodes: int = LOGU_NODES) -> np.ndarray:
    """log u (eq. 10) at p = j / nodes, j = 0..nodes, float64, from ``simhash_probability.log_sampling_probability``;
    the kernel interpolates linearly in p (p itself from the exact arccos, eq. 11).  With 2^16 intervals the
    interpolation error of log u is < 1e-7 for p ≥ 0.2 (|d² log u / dp²| ≲ mK/p²), far below bf16 rounding;
    log u(0) = −inf is stored as log(1e-300)."""
    from ..simhash_probability import log_sampling_probability

    p = torch.arange(nodes + 1, dtype=torch.float64) / nodes
    return log_sampling_probability(p, k_bits, n_tables, min_collisions).clamp_min(math.log(1e-300)).numpy()


def _rows_view(x: torch.Tensor) -> torch.Tensor:
    """A C-contiguous [B, H, N', D] view (N' ≥ N) for a cache that is a token slice of a larger preallocated
    one (x[:, :, :N] of a [B, H, Nmax, D] buffer), so the kernel reads it in place with unit inner strides;
    other layouts are copied."""
    if x.is_contiguous():
        return x
    b, h, n, d = x.shape
    st = x.stride()
    if st[3] == 1 and st[2] == d and st[1] % d == 0 and st[0] == h * st[1] and st[1] // d >= n:
        rows = st[1] // d
        need = (x.storage_offset() + b * st[0]) * x.element_size()
        if need <= x.untyped_storage().nbytes():
            return torch.as_strided(x, (b, h, rows, d), (h * rows * d, rows * d, d, 1))
    return x.contiguous()


def _kv_numpy(x: torch.Tensor) -> np.ndarray:
    x = _rows_view(x)
    if x.dtype == torch.bfloat16:
        return x.view(torch.uint16).numpy()
    if x.dtype == torch.float16:
        return x.view(torch.int16).numpy()
    return x.numpy()


def _side_by_side(k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The [B, H, N', 2·D] buffer (N' ≥ N) of which k and v are the halves, ``kv[..., 0, :]`` and ``kv[..., 1, :]``
    of a C-contiguous [B, H, N', 2, D] cache (a token's K and V in one 512-byte row at D = 128 in bf16), else None."""
    b, h, n, d = k.shape
    st = k.stride()
    if (
        v.stride() != st
        or v.dtype != k.dtype
        or st[3] != 1
        or st[2] != 2 * d
        or st[1] % (2 * d)
        or st[0] != h * st[1]
        or v.data_ptr() != k.data_ptr() + d * k.element_size()
    ):
        return None
    rows = st[1] // (2 * d)
    if rows < n or (k.storage_offset() + b * st[0]) * k.element_size() > k.untyped_storage().nbytes():
        return None
    return torch.as_strided(k, (b, h, rows, 2 * d), (h * rows * 2 * d, rows * 2 * d, 2 * d, 1))


def _kv_arrays(k: torch.Tensor, v: torch.Tensor) -> tuple[np.ndarray, np.ndarray, int]:
    """(K rows, V rows, column of V in its rows) for the kernel, read in place where the layout allows: separate
    caches (or token slices of larger ones), or K and V side by side in one buffer."""
    kv = _side_by_side(k, v)
    if kv is not None:
        a = _kv_numpy(kv)
        return a, a, k.shape[3]
    return _kv_numpy(k), _kv_numpy(v), 0


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    count: torch.Tensor | None = None,
    *,
    k_bits: int,
    n_tables: int,
    min_collisions: int = 2,
    scaling: float | None = None,
    k_mean: torch.Tensor | None = None,
    correct: bool = True,
    backend: str = "auto",
    prefetch: int | None = None,
    prefetch_v_early: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled attention on CPU (see ``attention_reference`` for the arguments).  k, v: CPU tensors, last dim
    contiguous; read in place when contiguous, token slices of larger preallocated caches, or the two halves of one
    [B, Hkv, N, 2, D] cache (a token's K and V side by side: one 512-byte read per key at D = 128 in bf16; a bare
    gather of such rows ran 1.05–1.14x as fast as two separate 256-byte reads on the H200 machine's Xeon), else
    copied.  ``prefetch``: software-prefetch distance in gathered rows (None: the default, 0: off);
    ``prefetch_v_early``: rows with at most
    this many sampled keys request their V rows together with the K rows, in the kernel's first pass (None: the
    default, ``PREFETCH_V_EARLY_MAX`` of the numba module; 0: no row).  Neither changes the result."""
    _check_attn(q, k, v, idx, count, k_mean)
    _check_kl(k_bits, n_tables)
    if not 1 <= int(min_collisions) <= int(n_tables):
        raise ValueError(f"min_collisions={min_collisions}: must lie in [1, L={n_tables}]")
    if k.is_cuda or v.is_cuda:
        raise ValueError("magicpig_cpu.attention reads the KV cache from CPU memory; got CUDA tensors")
    if _backend(backend) == "torch":
        return attention_reference(
            q,
            k,
            v,
            idx,
            count,
            k_bits=k_bits,
            n_tables=n_tables,
            min_collisions=min_collisions,
            scaling=scaling,
            k_mean=k_mean,
            correct=correct,
        )
    b, hq, d = q.shape
    hkv = k.shape[1]
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    # plain numpy from here on: torch CPU ops would wake torch's OpenMP pool, whose spinning threads then
    # compete with the kernel's
    qn = q.detach().cpu().float().contiguous().numpy()
    ixn = idx.detach().cpu().numpy().astype(np.int32, copy=False)
    if count is None:  # every entry >= 0 is used: move them to the front of their row (order kept)
        valid = ixn >= 0
        cn = valid.sum(-1, dtype=np.int32)
        if (~valid[..., :-1] & valid[..., 1:]).any():
            ixn = np.take_along_axis(ixn, np.argsort(~valid, axis=-1, kind="stable"), -1)
    else:
        cn = np.clip(count.detach().cpu().numpy().astype(np.int32), 0, ixn.shape[2])
    ixn = np.ascontiguousarray(ixn)
    cn = np.ascontiguousarray(cn)
    mean = np.zeros((b, hkv, d), np.float32) if k_mean is None else k_mean.detach().cpu().float().contiguous().numpy()
    out = np.empty((b, hq, d), np.float32)
    lse = np.empty((b, hq), np.float32)
    table = logu_table(int(k_bits), int(n_tables), int(min_collisions))
    nb = _nb()
    pf = nb.PREFETCH_ROWS if prefetch is None else int(prefetch)
    if pf < 0:
        raise ValueError(f"prefetch={prefetch}: must be >= 0 (0 turns software prefetch off)")
    v_early = nb.PREFETCH_V_EARLY_MAX if prefetch_v_early is None else int(prefetch_v_early)
    if v_early < 0:
        raise ValueError(f"prefetch_v_early={prefetch_v_early}: must be >= 0 (a row length; 0: no row)")
    bad = np.zeros(1, np.int64)
    import numba

    with numba.parallel_chunksize(1):  # rows (query heads) handed out one at a time: sample sizes differ by head
        ka, va, v_col = _kv_arrays(k, v)
        nb.attention_kernel(
            qn, ka, va, ixn, cn, mean, scaling, table, bool(correct), pf, v_early, k.shape[2], v_col, out, lse, bad
        )
    if bad[0]:
        raise ValueError(f"idx: the first count entries of each row must lie in [0, N={k.shape[2]})")
    return torch.from_numpy(out), torch.from_numpy(lse)


def sample_and_attend(
    tables: HashTables,
    q_codes: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    min_collisions: int = 2,
    scaling: float | None = None,
    k_mean: torch.Tensor | None = None,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sample`` then ``attention``: (o [B, Hq, D] f32, lse [B, Hq] f32, count [B, Hq] int32)."""
    idx, cnt = sample(tables, q_codes, min_collisions, backend=backend)
    o, lse = attention(
        q,
        k,
        v,
        idx,
        cnt,
        k_bits=tables.k_bits,
        n_tables=tables.n_tables,
        min_collisions=min_collisions,
        scaling=scaling,
        k_mean=k_mean,
        backend=backend,
    )
    return o, lse, cnt
