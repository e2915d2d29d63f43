"""MagicPIG: LSH (SimHash) sampling with importance correction (MagicPIG, arXiv 2410.16179, §4.3, Algorithm 1).

For one query head with query q and keys k_1..k_n (the static sink/local keys excluded):

* Hashing (§4.3 "Hash function selection"; Alg. 1 line 1).  K·L Gaussian hyperplanes W ∈ R^{d×(K·L)}; table l of
  a vector x is the K-bit integer of the signs of x·W[:, lK:(l+1)K].  Keys are hashed once (the index), the
  query at every step.
* Centering (§4.3 "Data pre-processing").  Keys are hashed as k̄_i = k_i − μ, μ = the mean of the keys being
  hashed (here: of the non-static, non-padding keys when the table is built).  Softmax is translation invariant,
  so the output is unchanged; only which keys collide (and u) changes.  ``center=False`` is the ablation of
  §5.3 / Fig. 9a.
  The index is built on a layer's first sparse call (after the dense prefill under protocols A/B; on the prefill
  call itself under protocol S) and extended by one key per decoding step with μ kept fixed: the mean of the
  non-static keys of that call's last row (the authors: of the prompt's keys after the dense prefill).  Within a
  call of several query rows that builds the index (protocol S's prefill, protocol B's question) row t hashes
  with its own prefix mean μ_t over the non-static keys at or before its position, so no row depends on later
  tokens (``select``).  That call then compares Q·N·K·L projections with thresholds instead of hashing N keys
  once: on the 2-core CPU a 512-token protocol-S window of stories260K takes ~10x the time it took with one μ.
* Optional MIPS transform (eq. 8): r = max_i |k̄_i|, q̄ = [q, 0], k̄_i = [k̄_i, √(r² − |k̄_i|²)], so that the
  angle tracks the inner product.  Off by default: the paper's experiments do not use it.
* Sampling (§4.3, eq. 10).  Key i is sampled when its code equals the query's in at least ``min_collisions``
  of the L tables (the paper: "at least two hash tables"; ``min_collisions=1`` is the textbook LSH rule).
  With p_i = 1 − θ_i/π (θ_i the angle between q and k̄_i) each table collides independently with probability
  p_i^K, so

      u_i = P[Binomial(L, p_i^K) ≥ min_collisions]          (= eq. 10 for min_collisions = 2)

* Estimate (eq. 9, eq. 11): ô = softmax over S ∪ static of (q·k_i/√d − log u_i) · v, with b = 0 for static keys;
  the shared core (``core.sparse_attention``) computes it from ``Selection(keep=S, bias=−log u)``.

Costs as the paper counts them (§5.1, Table 1): Cost1 = 0 (hashing runs beside the linear layers); the query's
projection, 2·d·K·L FLOPs, is reported per row as ``proj_cost`` = 2·d·K·L / (4·n·d) (a fraction of full
attention's 4·n·d FLOPs) and ``sampled`` = |S|.  Cost2 (|S ∪ static| / n) is measured by the core.

Differences from the authors' RULER reference code (``evaluations/RULER/pred/cache_ref.py``), read for facts:
* it draws one projection matrix per KV head, shared by every 16 layers; here one matrix per layer group
  (``projection_group`` consecutive layers) is shared by all heads, as §4.4 says ("all heads can share the same
  random projectors").  Each head's sampling law is the same either way.
* its static set is sink + the last 64 *prompt* keys + every generated key; here the local window slides (the
  last ``local`` keys), and keys leaving it are hashed and sampled like the others.
* it uses −log(u + 1e-4) (``u_offset=1e-4``); eq. 11 and the default here use −log u.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ..device_constants import made_once
from ..kernels.magicpig import collision_counts  # Alg. 1 line 2: the one count, Triton on CUDA
from ..simhash_probability import (
    upper_terms,
    collision_probability,
    log_sampling_probability,  # eq. 10
    sampling_probability,
)
from .base import AttentionContext, CacheTrackedState, Method, MethodConfig, Selection
from .core import static_keys
from .labels import count_label
from .registry import register

_STATE_KEY = "magicpig"
ID_BYTES = 4  # one key id in a hash bucket (``index_bytes``)
_MAX_K = 62  # codes are packed into int64
_P_MIN = 1e-300  # a sampled key has p > 0; the clamp only keeps log u finite against rounding
# start-time check of (K, L, min_collisions): a key at cosine REFERENCE_COS with its query (p = 2/3 per bit,
# more aligned than almost every key of a real head) must be sampled with probability >= MIN_SAMPLING_PROBABILITY
# (eq. 10); below it practically every selection is empty, whatever the context.  Paper configs give 0.74-0.90.
REFERENCE_COS = 0.5
MIN_SAMPLING_PROBABILITY = 1e-6


@dataclass
class MagicPIGConfig(MethodConfig):
    name: str = "magicpig"
    # bits per hash table (SimHash hyperplanes per table); paper configs (K, L): (10,150) RULER/LongBench,
    # (10,220) and (8,90) lm-eval, (9,120), (8,75)
    K: int = 10
    # number of hash tables
    L: int = 150
    # a key is sampled when it collides with the query in >= this many tables (eq. 10: 2; 1: textbook LSH)
    min_collisions: int = 2
    # center the keys by the mean of the non-static keys before hashing (§4.3); false: the Fig. 9a ablation
    center: bool = True
    # eq. 8 simple-LSH transform for maximum inner product search (the paper's experiments do not use it)
    mips: bool = False
    # consecutive layers sharing one random projection matrix (1: a matrix per layer; the authors' code: 16)
    projection_group: int = 1
    # bias = −log(u + u_offset); eq. 11: 0; the authors' RULER code: 1e-4 (caps 1/u at 10^4)
    u_offset: float = 0.0
    sink: int = 4
    local: int = 64
    # MagicPIG keeps the first and the middle layer dense (§5.1: 0 and 16 of a 32-layer Llama); on a model with
    # sliding-window layers, the first and the middle of the layers that see the whole context (docs/fidelity.md)
    dense_layers: list[Any] = field(default_factory=lambda: ["first", "mid"])
    gqa: str = "query_head"


# -- analytic quantities ---------------------------------------------------------------------------


def expected_sampling_rate(K: int, L: int, min_collisions: int = 2, p: float = 0.5) -> float:
    """Expected fraction of sampled keys (the analytic Cost2 of the non-static keys) when every key has bit
    agreement p with the query; p = 0.5 is a key orthogonal to the query (random centered keys in high
    dimension).  E.g. (10,150) → 1.0 %; MagicPIG Table 9 measures 2 % on Llama-3.1-8B (real keys spread around
    p = 0.5, and u is convex there, so the mean of u exceeds u(0.5))."""
    return float(sampling_probability(p, K, L, min_collisions))


def hash_table_bytes(num_layers: int, num_kv_heads: int, L: int, n: int) -> int:
    """Memory of the authors' CPU hash tables: every key appears once in each of the L tables of each layer and
    KV head, as a uint16 index up to 65,536 keys and uint32 above (MagicPIG Table 8 / issue #12:
    32 layers × 8 KV heads × 150 tables × 98,304 keys × 4 B = 14.06 GiB for Llama-3.1-8B at 96K)."""
    width = 2 if n <= 65536 else 4
    return int(num_layers) * int(num_kv_heads) * int(L) * int(n) * width


def check_sampling_reachable(K: int, L: int, min_collisions: int) -> None:
    """Refuses (K, L, min_collisions) under which eq. 10 gives a key at cosine ``REFERENCE_COS`` with its query
    a sampling probability below ``MIN_SAMPLING_PROBABILITY``: such a run would report a score with (almost)
    every selection empty.  The message names the largest K that passes at this L."""
    p = float(collision_probability(torch.tensor(REFERENCE_COS)))
    u = float(sampling_probability(p, K, L, min_collisions))
    if u >= MIN_SAMPLING_PROBABILITY:
        return
    ok = [
        k
        for k in range(1, _MAX_K + 1)
        if float(sampling_probability(p, k, L, min_collisions)) >= MIN_SAMPLING_PROBABILITY
    ]
    valid = f"K <= {max(ok)} at L={L}" if ok else f"no K at L={L}"
    raise ValueError(
        f"method.K={K} with method.L={L}, method.min_collisions={min_collisions}: a key at cosine {REFERENCE_COS} "
        f"with its query is sampled with probability {u:.3g} (eq. 10, below {MIN_SAMPLING_PROBABILITY:g}), so "
        f"practically every selection would be empty; valid: {valid} (the paper: K 8-10, L 75-220); lower "
        f"method.K, raise method.L or lower method.min_collisions"
    )


def code_dtype(K: int) -> torch.dtype:
    """Smallest signed integer type that holds a K-bit code."""
    return torch.int16 if K <= 15 else torch.int32 if K <= 31 else torch.int64


def pack_signs(proj: torch.Tensor, K: int, L: int) -> torch.Tensor:
    """proj [..., L·K] (projections, table-major) -> codes [..., L]: bit b of table l is proj[..., l·K + b] > 0."""
    dt = code_dtype(K)  # K-bit sums never overflow it
    bits = (proj > 0).reshape(*proj.shape[:-1], L, K).to(dt)
    return (bits * _bit_values(K, proj.device)).sum(-1, dtype=dt)


@made_once
def _bit_values(K: int, device: torch.device) -> torch.Tensor:
    """[2^0, …, 2^(K−1)] in ``code_dtype(K)``, made once per (K, device) (not a few launches per hash)."""
    return torch.pow(2, torch.arange(K, device=device, dtype=torch.int64)).to(code_dtype(K))


def _mix_seed(seed: int, group: int) -> int:
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(group) * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    x ^= x >> 31
    return x & 0x7FFFFFFFFFFFFFFF


@register
class MagicPIG(Method):
    """LSH sampling + importance-weighted attention (MagicPIG §4.3, Algorithm 1); see the module docstring."""

    name = "magicpig"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "keys that collide with q in SimHash tables (K bits, L tables), importance-weighted (MagicPIG)"
    config_class = MagicPIGConfig
    stochastic = True  # SimHash projections drawn from config.seed
    index_reads_keys = False
    display_name = "MagicPIG"
    headline_options = ("K", "L")
    shared_index_parts = ("projections",)  # one set of matrices for the whole batch
    index_may_not_fit = True  # L tables of every key: method.L=100000000 fits no machine
    supported_gqa = ("query_head",)  # the query's hash codes are per query head
    prepare_with_valid = True
    # comparisons materialised at once (memory only; does not change results)
    element_budget: int = 1 << 26
    # ``kernels.magicpig.collision_counts`` backend: "auto" (Triton on CUDA, torch otherwise); same integers on each
    collision_backend: str = "auto"
    # (row, key, eq. 10 term) elements up to which a call with the index's μ (decoding) computes −log u for every
    # candidate key with no host sync (``_bias_dense``, e.g. for a captured step); above it, or when rows have their
    # own μ_t, only for the sampled pairs (``_bias_sampled``: one host sync, eq. 10 on ~1/60 of the elements).  The
    # same values either way (within 1e-6 relative, tested).  Off by default: eq. 10 has 33 terms per element at
    # (10, 150), so the dense bias evaluates it ~60 times as often (sparse_eval/kernels/README.md)
    dense_bias_elements: int = 0

    def __init__(self, config: MagicPIGConfig):
        super().__init__(config)
        self._proj: dict[tuple, torch.Tensor] = {}

    @classmethod
    def contract_configs(cls):
        """A small (K, L) in a small static window (the end-to-end checks' config), the textbook rule without
        centering under the eq. 8 transform, and the defaults (K, L) = (10, 150)."""
        return [
            {"K": 4, "L": 20, "local": 8, "dense_layers": [0]},
            {"K": 3, "L": 12, "min_collisions": 1, "center": False, "mips": True},
            {},
        ]

    @classmethod
    def system_contract_configs(cls):
        """A small (K, L) in a small static window (hash tables, CPU kernel and LSE merge), and the defaults."""
        return {
            "magicpig": dict(name=cls.name, K=10, L=20, local=16, dense_layers=[0]),
            "magicpig_default": dict(name=cls.name, dense_layers=[0, 2]),
        }

    @classmethod
    def keep_all_options(cls, n):
        """None: a sampled key's logit is corrected by −log u_i (eq. 11) with u_i < 1 its sampling probability
        (eq. 10), so even with every key sampled the weights are ∝ e^{s_i} / u_i, not the true attention."""
        return None

    def validate(self, num_layers=None, context=None):
        super().validate(num_layers, context)
        c = self.config
        for what, val, lo in (
            ("K", c.K, 1),
            ("L", c.L, 1),
            ("min_collisions", c.min_collisions, 1),
            ("projection_group", c.projection_group, 1),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"method.{what}={val!r}: must be an integer >= {lo}")
        if c.K > _MAX_K:
            raise ValueError(
                f"method.K={c.K}: a table's code must fit a 64-bit integer; valid: 1..{_MAX_K} "
                f"(the paper: 8-10); lower method.K"
            )
        if c.min_collisions > c.L:
            raise ValueError(
                f"method.min_collisions={c.min_collisions} > method.L={c.L}: a key can collide in at most L tables, "
                f"so none would ever be sampled; valid: 1..{c.L} (eq. 10: 2), or raise method.L"
            )
        check_sampling_reachable(c.K, c.L, c.min_collisions)
        for what in ("center", "mips"):
            if not isinstance(getattr(c, what), bool):
                raise ValueError(f"method.{what}={getattr(c, what)!r}: must be true or false")
        if isinstance(c.u_offset, bool) or not isinstance(c.u_offset, (int, float)) or not c.u_offset >= 0:
            raise ValueError(f"method.u_offset={c.u_offset!r}: must be a number >= 0 (eq. 11: 0; authors' code: 1e-4)")

    def describe(self) -> str:
        c = self.config
        return f"magicpig(K={c.K},L={c.L},min_collisions={c.min_collisions})"

    @classmethod
    def index_memory(cls, params, shape, n, sparse_layers, building_rows=False):
        """Hash codes (L codes of every key, grown geometrically: ×2), the projection matrices, the hashing of the
        query and of one chunk of keys (at least one key's K·L projections, float32 and bool) and, where the rows
        build the tables, the comparison of every key with every table (eq. 10)."""
        K, L = int(params.get("K", 10)), int(params.get("L", 150))
        code = 2 if K <= 15 else 4 if K <= 31 else 8
        dim = shape.head_dim + (1 if params.get("mips") else 0)
        groups = math.ceil(shape.layers / max(1, int(params.get("projection_group", 1) or 1)))
        out = {
            "hash codes": sparse_layers * shape.kv_heads * n * L * code * 2,
            "projections": groups * dim * K * L * 4,
            "hashing": shape.heads * L * code + 8 * shape.kv_heads * K * L,
        }
        if building_rows:
            out["build"] = shape.kv_heads * n * K * L
        return out

    @classmethod
    def index_too_large(cls, params, need):
        return (
            f"method.L={params.get('L')} with method.K={params.get('K')}: MagicPIG's tables {need}; lower "
            f"method.L (the paper: 75-300) or method.K"
        )

    @classmethod
    def label(cls, params):
        """(K,L) as the paper's tables write it, with what departs from eq. 10's defaults (no centering, another
        collision threshold, MIPS)."""
        lab = f"({count_label(params.get('K'))},{count_label(params.get('L'))})"
        extra = []
        if params.get("center") is False:
            extra.append("no centering")
        mc = params.get("min_collisions")
        if mc not in (None, 2):
            extra.append(f"≥{mc} coll.")
        if params.get("mips"):
            extra.append("MIPS")
        return lab + (" " + ", ".join(extra) if extra else "")

    # -- random projections -----------------------------------------------------------------------
    def projection(self, layer_idx: int, dim: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """W [dim, L·K] float32 (table-major columns), N(0, 1) entries drawn on the CPU from a generator seeded by
        (config.seed, layer_idx // projection_group), then moved to ``device``: reproducible and independent of
        the batch."""
        c = self.config
        group = int(layer_idx) // c.projection_group
        key = (group, dim, str(device))
        w = self._proj.get(key)
        if w is None:
            gen = torch.Generator(device="cpu").manual_seed(_mix_seed(c.seed, group))
            w = torch.randn(dim, c.L * c.K, generator=gen, dtype=torch.float32).to(device)
            self._proj[key] = w
        return w

    def _chunk(self, per_item: int) -> int:
        """Items per chunk so that a chunk holds about ``element_budget`` elements."""
        return max(1, self.element_budget // max(1, per_item))

    def _hash(
        self, x: torch.Tensor, mean: torch.Tensor | None, r: torch.Tensor | None, w: torch.Tensor
    ) -> torch.Tensor:
        """Codes [B', H, n, L] of x [B', H, n, D] (keys in any dtype, or queries), taken in chunks along n:
        x − mean (centering, ``mean`` [B', H, D]), then with ``r`` [B', H] (eq. 8) the extra coordinate
        √(r² − |x − μ|²) (clamped at 0 for a later key longer than r), projected on W and packed."""
        c = self.config
        b, h, n, _ = x.shape
        step = self._chunk(8 * b * h * c.K * c.L)
        if n <= step:  # one chunk (a decode step's query and new key)
            return self._hash_chunk(x, mean, r, w)
        out = torch.empty(b, h, n, c.L, dtype=code_dtype(c.K), device=x.device)
        for s in range(0, n, step):
            out[:, :, s : s + step] = self._hash_chunk(x[:, :, s : s + step], mean, r, w)
        return out

    def _hash_chunk(
        self, x: torch.Tensor, mean: torch.Tensor | None, r: torch.Tensor | None, w: torch.Tensor
    ) -> torch.Tensor:
        """``_hash`` of one chunk x [B', H, n', D] -> codes [B', H, n', L]."""
        c = self.config
        xs = x.float()
        if mean is not None:
            xs = xs - mean[:, :, None]
        if r is not None:
            extra = (r[:, :, None] ** 2 - xs.pow(2).sum(-1)).clamp_min(0.0).sqrt()
            xs = torch.cat([xs, extra.unsqueeze(-1)], dim=-1)
        return pack_signs(torch.matmul(xs, w), c.K, c.L)

    def _fix_center(self, k: torch.Tensor, wts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """μ [B', H, D] (mean of the keys with weight 1 in wts [B', N], in float64; zeros without centering) and
        r [B', H] (max |k − μ| over them, eq. 8) for k [B', H, N, D].  The sum runs over chunks of keys of a fixed
        size laid from the last key back (end-aligned, like every reduction of the batch-invariant mode: a row's
        partial sums do not depend on the batch or on its left padding, whose chunks add exact zeros), and over
        groups of batch rows sized for memory (rows are independent)."""
        c = self.config
        b, h, n, d = k.shape
        step = self._chunk(2 * h * d)  # keys per chunk: independent of the batch
        rows = max(1, self._chunk(2 * h * d * min(n, step)))
        first = n - -(-n // step) * step  # <= 0: the front chunk reaches below key 0
        mean = torch.zeros(b, h, d, dtype=torch.float64, device=k.device)
        if c.center:
            for r0 in range(0, b, rows):
                for s0 in range(first, n, step):
                    lo = max(0, s0)
                    mean[r0 : r0 + rows] += torch.einsum(
                        "bn,bhnd->bhd",
                        wts[r0 : r0 + rows, lo : s0 + step],
                        k[r0 : r0 + rows, :, lo : s0 + step].double(),
                    )
            mean /= wts.sum(-1)[:, None, None]
        mean = mean.float()
        r = torch.zeros(b, h, dtype=torch.float32, device=k.device)
        if c.mips:
            for s0 in range(0, n, step):
                norms = (k[:, :, s0 : s0 + step].float() - mean[:, :, None]).norm(dim=-1)
                norms = norms.masked_fill(wts[:, None, s0 : s0 + step] == 0, 0.0)
                r = torch.maximum(r, norms.amax(-1))
        return mean, r

    def key_mean(self, k: torch.Tensor) -> torch.Tensor:
        """μ [B, H, D] float32 of the candidate keys k [B, H, N, D] (§4.3 centering, as ``prepare`` fixes it: float64
        sum, then float32; zeros without ``center``): the one centering rule, also the system path's."""
        ones = torch.ones(k.shape[0], k.shape[2], dtype=torch.float64, device=k.device)
        return self._fix_center(k, ones)[0]

    # -- index ------------------------------------------------------------------------------------
    def prepare(
        self,
        state: dict[str, Any],
        k: torch.Tensor,
        v: torch.Tensor,
        layer_idx: int,
        module: Any = None,
        valid: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> None:
        """Hash codes of the keys, kept in ``state["magicpig"]``:

        codes [B, Hkv, capacity, L] (K-bit integers), n (keys indexed), mean [B, Hkv, D] (centering μ),
        r [B, Hkv] (eq. 8 radius), built [B] (row's μ fixed).  A row's μ is fixed at the first call in which the
        row has a non-static valid key (normally the first sparse call after prefill): the mean of those keys,
        padding excluded.  Later keys are hashed incrementally with that μ; a cache with fewer keys than indexed
        (or different first/last indexed keys, a new batch or device) is re-indexed from scratch.
        """
        c = self.config
        b, hkv, n, d = k.shape
        dev = k.device
        if n == 0:
            return
        rows = 1 if valid is None or valid.dim() == 2 else valid.shape[2]  # query rows of this call
        if valid is None:
            valid = torch.ones(b, n, dtype=torch.bool, device=dev)
        elif valid.dim() == 4:  # [B, 1, Q, N] -> the last row's keys: left padding is the only invalid key
            valid = valid[:, 0, -1]
        dim = d + 1 if c.mips else d
        w = self.projection(layer_idx, dim, dev)
        sig = (c.K, c.L, c.center, c.mips, c.sink, c.local, c.seed, int(layer_idx) // c.projection_group)
        st = state.get(_STATE_KEY)
        if st is not None and not self._reusable(st, k, sig, isinstance(state, CacheTrackedState)):
            st = None
        if st is None:
            st = {
                "n": 0,
                "b": b,
                "hkv": hkv,
                "d": d,
                "device": str(dev),
                "sig": sig,
                "codes": torch.empty(b, hkv, max(n, 16), c.L, dtype=code_dtype(c.K), device=dev),
                "mean": torch.zeros(b, hkv, d, dtype=torch.float32, device=dev),
                "r": torch.zeros(b, hkv, dtype=torch.float32, device=dev),
                "built": torch.zeros(b, dtype=torch.bool, device=dev),
            }
            state[_STATE_KEY] = st
        done = st["n"]
        if n > st["codes"].shape[2]:  # grow geometrically, so appending one key is O(1) amortised
            grown = torch.empty(b, hkv, max(n, 2 * st["codes"].shape[2]), c.L, dtype=st["codes"].dtype, device=dev)
            grown[:, :, :done] = st["codes"][:, :, :done]
            st["codes"] = grown
        # rows whose table is built now: the first call with a non-static valid key fixes μ (and r).  Once every
        # row is built (known on the host), nothing is left to check: no device sync per call after that.
        idx = None
        st["row_center"] = None
        if not st.get("all_built", False):
            static, _ = static_keys(valid[:, None, None, :], c.sink, c.local)
            cand = (valid & ~static[:, 0, 0]).to(torch.float64)  # [B, N]: the keys being hashed, padding excluded
            new_rows = (cand.sum(-1) > 0) & ~st["built"]
            idx = torch.nonzero(new_rows).flatten() if bool(new_rows.any()) else None
            if idx is not None:
                st["mean"][idx], st["r"][idx] = self._fix_center(k[idx], cand[idx])
                st["built"][idx] = True
                st["all_built"] = bool(st["built"].all())
                if rows > 1 and (c.center or c.mips):  # this call's rows hash with their own prefix μ (select)
                    st["row_center"] = idx
        r = st["r"] if c.mips else None
        if n > done:  # incremental: hash the keys added since the last call (rows built now are redone below)
            old = None if idx is None else torch.nonzero(~new_rows).flatten()
            if old is None:
                st["codes"][:, :, done:n] = self._hash(k[:, :, done:n], st["mean"], r, w)
            elif old.numel():
                st["codes"][old, :, done:n] = self._hash(
                    k[old, :, done:n], st["mean"][old], None if r is None else r[old], w
                )
        if idx is not None:  # (re)hash every key of the rows whose μ was just fixed
            st["codes"][idx, :, :n] = self._hash(k[idx], st["mean"][idx], None if r is None else r[idx], w)
        st["n"] = n
        if n:
            # a copy of the first and last indexed keys [B, Hkv, 2, D], to recognise a different cache of the same
            # length (stacked: a list index would copy [0, n-1] to the device each call, a host sync)
            st["ends"] = torch.stack((k[:, :, 0], k[:, :, n - 1]), 2)

    @staticmethod
    def _reusable(st: dict[str, Any], k: torch.Tensor, sig: tuple, tracked: bool = False) -> bool:
        """Whether the index in ``st`` still covers the first keys of ``k``.  ``tracked``: the state is a
        ``CacheTrackedState``, dropped by its cache with any removal of keys, so the indexed keys need no device
        comparison (a host sync); otherwise the first and last indexed keys are compared."""
        b, hkv, n, d = k.shape
        if (st["b"], st["hkv"], st["d"], st["device"], st["sig"]) != (b, hkv, d, str(k.device), sig) or n < st["n"]:
            return False
        if st["n"] == 0 or tracked:
            return True
        ends = torch.stack((k[:, :, 0], k[:, :, st["n"] - 1]), 2)
        return ends.dtype == st["ends"].dtype and torch.equal(ends, st["ends"])

    # -- causal centering of a call that builds the index ------------------------------------------
    def _row_centers(self, ctx: AttentionContext, st: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """Per query row: μ_t [B, Hkv, Q, D] = the mean of the row's own non-static valid keys (its candidates,
        all at or before its position), as a masked product (no loop over rows), and r_t [B, Hkv, Q] = max over
        them of |k_i − μ_t| (eq. 8).  Batch rows whose μ was fixed by an earlier call keep it."""
        c = self.config
        k = ctx.k
        b, hkv, n, d = k.shape
        ql = ctx.q.shape[2]
        cand = ctx.candidates[:, 0].to(torch.float64)  # [B, Q, N]
        count = cand.sum(-1).clamp_min(1.0)[:, None, :, None]  # [B, 1, Q, 1]
        kd = k.double()
        if c.center:
            mean = torch.einsum("bqn,bhnd->bhqd", cand, kd) / count  # [B, Hkv, Q, D]
        else:
            mean = torch.zeros(b, hkv, ql, d, dtype=torch.float64, device=k.device)
        r = torch.zeros(b, hkv, ql, dtype=torch.float64, device=k.device)
        if c.mips:  # |k_i − μ_t|² = |k_i|² − 2 k_i·μ_t + |μ_t|²
            sq = (
                kd.pow(2).sum(-1)[:, :, None, :]
                - 2 * torch.einsum("bhnd,bhqd->bhqn", kd, mean)
                + mean.pow(2).sum(-1)[..., None]
            ).clamp_min(0.0)
            r = sq.masked_fill(cand[:, None] == 0, 0.0).amax(-1).sqrt()
        mean, r = mean.float(), r.float()
        old = torch.ones(b, dtype=torch.bool, device=k.device)
        old[st["row_center"]] = False
        if bool(old.any()):
            mean[old] = st["mean"][old][:, :, None].expand(-1, -1, ql, -1)
            r[old] = st["r"][old][:, :, None].expand(-1, -1, ql)
        return mean, r

    def _row_counts(
        self, ctx: AttentionContext, q_codes: torch.Tensor, mean: torch.Tensor, r: torch.Tensor, w: torch.Tensor
    ) -> torch.Tensor:
        """Collision counts [B, Hq, Q, N] when key i is hashed for row t as k_i − μ_t (with mips: and the extra
        coordinate of r_t): bit j of table l is k_i·w_j > μ_t·w_j (+ the extra coordinate's term), so the keys'
        projections are taken once and each row only shifts the thresholds.  Keys that are not a candidate of any
        row of a block are skipped (they cannot be sampled)."""
        c = self.config
        k = ctx.k
        b, hkv, n, d = k.shape
        hq, ql = q_codes.shape[1], q_codes.shape[2]
        g = hq // hkv
        proj = torch.matmul(k.float(), w[:d])  # [B, Hkv, N, L·K]
        thresh = torch.matmul(mean, w[:d])  # [B, Hkv, Q, L·K]
        # codes packed by a product with 2^j in float32 (exact up to 24 bits: the same integers in any summation
        # order, so the stock kernel, ``matmul(out=)``, serves in the batch-invariant mode too), else as integers
        as_float = c.K <= 24
        pow2 = torch.pow(2.0, torch.arange(c.K, device=k.device, dtype=torch.float32))
        qg = q_codes.reshape(b, hkv, g, ql, c.L)
        if as_float:
            qg = qg.float()
        cand_any = ctx.candidates[:, 0]  # [B, Q, N]
        counts = torch.zeros(b, hkv, g, ql, n, dtype=torch.int16, device=k.device)
        row_step = max(1, (self.element_budget // 4) // max(1, b * hkv * n * c.L * c.K))
        for r0 in range(0, ql, row_step):
            r1 = min(ql, r0 + row_step)
            used = torch.nonzero(cand_any[:, r0:r1].any(1).any(0)).flatten()
            if used.numel() == 0:
                continue
            m = int(used.max()) + 1  # keys beyond the block's last candidate are never sampled for it
            p = proj[:, :, None, :m]  # [B, Hkv, 1, m, L·K]
            if c.mips:
                kk = k[:, :, :m].float()
                sq = (kk[:, :, None] - mean[:, :, r0:r1, None]).pow(2).sum(-1)  # [B, Hkv, r, m]
                extra = (r[:, :, r0:r1, None] ** 2 - sq).clamp_min(0.0).sqrt()
                p = p + extra[..., None] * w[d]
            # bit j: (k_i − μ_t)·w_j > 0, [B, Hkv, r, m, L·K]
            if as_float:  # the comparison written as 0.0/1.0 directly (cheaper than a bool tensor cast afterwards)
                above = torch.gt(p, thresh[:, :, r0:r1, None], out=p.new_empty(b, hkv, r1 - r0, m, c.L * c.K))
                bits = above.view(*above.shape[:-1], c.L, c.K)
                codes = torch.matmul(bits, pow2, out=bits.new_empty(bits.shape[:-1]))  # [B, Hkv, r, m, L]
            else:
                codes = pack_signs(torch.gt(p, thresh[:, :, r0:r1, None]), c.K, c.L)
            eq = qg[:, :, :, r0:r1, None, :] == codes[:, :, None]  # [B, Hkv, G, r, m, L]
            counts[:, :, :, r0:r1, :m] = eq.sum(-1, dtype=torch.int16)
        return counts.reshape(b, hq, ql, n)

    # -- eq. 10 correction ---------------------------------------------------------------------------
    def _neg_log_u(self, cos: torch.Tensor) -> torch.Tensor:
        """−log(u + u_offset) (eq. 11's bias, float32) from cos(q, k̄_i) (float64): p = 1 − arccos(cos)/π, u by
        eq. 10 (``log_sampling_probability``)."""
        c = self.config
        p = collision_probability(cos).clamp_min(_P_MIN)
        log_u = log_sampling_probability(p, c.K, c.L, c.min_collisions, self.element_budget // 8)
        if c.u_offset > 0:
            log_u = torch.logaddexp(log_u, torch.full_like(log_u, math.log(c.u_offset)))
        return (-log_u).to(torch.float32)

    @staticmethod
    def _cos(dot: torch.Tensor, knorm: torch.Tensor, qnorm: torch.Tensor) -> torch.Tensor:
        """cos(q, k̄) in float64; a zero vector gives 0 (p = 1/2)."""
        den = knorm * qnorm
        return torch.where(den > 0, dot / den.clamp_min(1e-300), torch.zeros_like(den))

    def _bias_sampled(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        mean_rows: torch.Tensor,
        r_rows: torch.Tensor,
        keep: torch.Tensor,
        g: int,
    ) -> torch.Tensor:
        """bias [B, Hq, Q, N] float32: −log u_i (eq. 11) on the sampled (row, key) pairs only, 0 elsewhere.
        mean_rows [B, Hkv, Q, D] and r_rows [B, Hkv, Q] are each row's μ_t and r_t.  One host sync (the pairs'
        count), then chunks of pairs."""
        c = self.config
        b, hq, ql, d = q.shape
        bias = torch.zeros(b, hq, ql, k.shape[2], dtype=torch.float32, device=q.device)
        bi, hi, qi, ni = torch.nonzero(keep, as_tuple=True)  # the sampled (row, key) pairs only
        step = self._chunk(4 * (d + max(1, c.L - c.min_collisions + 1)))
        for s in range(0, bi.numel(), step):
            bs, hs, qs, ns = bi[s : s + step], hi[s : s + step] // g, qi[s : s + step], ni[s : s + step]
            # eq. 10 on the hashed vectors: cos(q, k̄_i), k̄_i the centered (with mips: transformed) key, float64
            kr = k[bs, hs, ns].double() - mean_rows[bs, hs, qs].double()  # [M, D]
            qr = q[bs, hi[s : s + step], qs].double()
            knorm = kr.norm(dim=-1)
            if c.mips:
                knorm = torch.maximum(knorm, r_rows[bs, hs, qs].double())
            cos = self._cos((kr * qr).sum(-1), knorm, qr.norm(dim=-1))
            bias[bs, hi[s : s + step], qs, ns] = self._neg_log_u(cos)  # eq. 11: s_i − log u_i
        return bias

    def _bias_dense(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        mean: torch.Tensor,
        r: torch.Tensor | None,
        keep: torch.Tensor,
        terms: int,
    ) -> torch.Tensor:
        """``_bias_sampled``'s values for rows sharing the index's μ [B, Hkv, D] (and r [B, Hkv] under eq. 8):
        −log u_i computed for every (row, key) from cos(q, k_i − μ) = q·(k_i − μ) / (|q| |k_i − μ|) in float64
        (one product per KV group), then kept where ``keep``.  No host sync and no loop over pairs; keys in chunks of
        at most ``element_budget`` (row, key, eq. 10 term) elements."""
        b, hq, ql, d = q.shape
        hkv, n = k.shape[1], k.shape[2]
        rows = hq // hkv * ql
        qg = q.double().reshape(b, hkv, rows, d)  # query head h·G + g, row t -> row g·Q + t of KV head h
        qnorm = qg.norm(dim=-1)[..., None]  # [B, Hkv, R, 1]
        keep_g = keep.reshape(b, hkv, rows, n)
        mu = mean.double()[:, :, None]  # [B, Hkv, 1, D]
        bias = torch.empty(b, hkv, rows, n, dtype=torch.float32, device=q.device)
        step = max(1, min(self._chunk(b * hq * ql * terms), self._chunk(b * hkv * d)))
        for s in range(0, n, step):
            kr = k[:, :, s : s + step].double() - mu  # [B, Hkv, n', D]
            knorm = kr.norm(dim=-1)
            if r is not None:
                knorm = torch.maximum(knorm, r.double()[:, :, None])
            cos = self._cos(torch.matmul(qg, kr.transpose(-1, -2)), knorm[:, :, None], qnorm)  # [B, Hkv, R, n']
            bias[..., s : s + step] = torch.where(keep_g[..., s : s + step], self._neg_log_u(cos), 0.0)
        return bias.reshape(b, hq, ql, n)

    # -- selection --------------------------------------------------------------------------------
    def select(self, ctx: AttentionContext) -> Selection:
        """Alg. 1 lines 1-3 for a block of query rows.  In the call that builds the index (the sparse prefill of
        protocol S, the sparse question of protocol B) each row t hashes the keys centered by its own prefix
        mean μ_t (``_row_centers``), so nothing a row sees depends on later tokens; later calls (decoding) use
        the μ fixed at the end of that call (the authors: after the dense prefill, from the prompt's keys)."""
        c = self.config
        st = ctx.state[_STATE_KEY]
        q, k = ctx.q, ctx.k
        b, hq, ql, d = q.shape
        n = k.shape[2]
        w = self.projection(ctx.layer_idx, d + 1 if c.mips else d, q.device)
        # Alg. 1 line 1: the query's codes (q̄ = [q, 0] under eq. 8, so only the first d rows of W matter)
        q_codes = self._hash(q, None, None, w[:d])  # [B, Hq, Q, L]
        if st.get("row_center") is not None:
            mean_rows, r_rows = self._row_centers(ctx, st)  # [B, Hkv, Q, D], [B, Hkv, Q]
            counts = self._row_counts(ctx, q_codes, mean_rows, r_rows, w)
        else:
            mean_rows, r_rows = st["mean"][:, :, None].expand(-1, -1, ql, -1), st["r"][:, :, None].expand(-1, -1, ql)
            counts = collision_counts(
                q_codes, st["codes"][:, :, :n], backend=self.collision_backend, element_budget=self.element_budget
            )  # [B, Hq, Q, N] int16
        keep = (counts >= c.min_collisions) & ctx.candidates
        terms = c.min_collisions + upper_terms(c.min_collisions, c.L)  # eq. 10's terms per (row, key)
        if st.get("row_center") is None and b * hq * ql * n * terms <= self.dense_bias_elements:
            bias = self._bias_dense(q, k, st["mean"], st["r"] if c.mips else None, keep, terms)
        else:
            bias = self._bias_sampled(q, k, mean_rows, r_rows, keep, ctx.groups)
        n_rows = ctx.n_valid.squeeze(-1).clamp_min(1).to(torch.float32)  # [B, 1, Q]
        dim = d + 1 if c.mips else d
        stats = {
            "sampled": keep.sum(-1).to(torch.float32),
            # Σ_i c_i over the indexed (candidate) keys, c_i = tables in which key i shares the query's code: the
            # bucket entries the CPU look-up reads in the query's L buckets
            "collisions": counts.masked_fill(ctx.not_candidates, 0).sum(-1, dtype=torch.float32),
            # the query's K·L projections, 2·dim·K·L FLOPs, as a fraction of full attention (4·n·d)
            "proj_cost": (2.0 * dim * c.K * c.L / (4.0 * d * n_rows)).expand(b, hq, ql),
        }
        return Selection(keep=keep, bias=bias, stats=stats)

    def cost1(self, ctx, sel):
        """0, as the paper counts it (Table 1): hashing is not attention work; see ``proj_cost`` in the stats."""
        return 0.0

    def index_bytes(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor:
        """The CPU look-up's reads: the key ids in the query's bucket of each of the L tables, one 4-byte id per
        (table, colliding key), i.e. ``collisions`` · 4 bytes per query-head row (keys are indexed once they
        leave the static set, so only candidate keys count).  The sampled keys' K and V are added by the core."""
        return sel.stats["collisions"] * float(ID_BYTES)
