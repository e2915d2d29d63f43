"""MagicPIG CPU kernels (kernels.magicpig_cpu: numba) against brute force and torch references, eq. 10, and the
exact LSE merge (kernels.merge).  The numba tests skip cleanly without numba; the torch paths always run."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sparse_eval.kernels import magicpig, magicpig_cpu, merge_by_lse, sparse_decode
from sparse_eval.kernels._common import numba_available

needs_numba = pytest.mark.skipif(not numba_available(), reason="numba not installed")
BACKENDS = ["torch", pytest.param("numba", marks=needs_numba)]
ROOT = Path(__file__).resolve().parents[2]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(seed, b=2, hq=8, hkv=2, n=1500, d=64, k_bits=6, n_tables=20, dtype=torch.bfloat16, shift=0.5):
    """Keys with a common offset (so centring matters), their codes after centring, query codes."""
    gen = _gen(seed)
    k = (torch.randn(b, hkv, n, d, generator=gen) + shift).to(dtype)
    v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
    q = torch.randn(b, hq, d, generator=gen).to(dtype)
    kc, mean = magicpig.center_keys(k)
    w = magicpig.random_projections(d, k_bits, n_tables, seed=seed)
    kcodes = magicpig.hash_codes_reference(kc, w, k_bits, n_tables)
    qcodes = magicpig.hash_codes_reference(q, w, k_bits, n_tables)
    return q, k, v, mean, kcodes, qcodes


# ----------------------------------------------------------------------------------------- eq. 10
def test_collision_probability_matches_binomial_tail_and_paper_form():
    n_tables = 150
    a = torch.tensor([0.0, 1e-12, 1e-8, 1e-5, 1e-3, 0.01, 0.3, 0.9, 1.0], dtype=torch.float64)
    for m in (1, 2, 3):
        u = magicpig.collision_probability(a, n_tables, m)
        # exact tail Σ_{j≥m} C(L, j) a^j (1-a)^(L-j) in high precision via lgamma, term by term
        exact = []
        for x in a.tolist():
            if x == 0.0:
                exact.append(0.0)
                continue
            if x == 1.0:
                exact.append(1.0)
                continue
            s = 0.0
            for j in range(m, n_tables + 1):
                s += math.exp(
                    math.lgamma(n_tables + 1)
                    - math.lgamma(j + 1)
                    - math.lgamma(n_tables - j + 1)
                    + j * math.log(x)
                    + (n_tables - j) * math.log1p(-x)
                )
            exact.append(s)
        exact = torch.tensor(exact, dtype=torch.float64)
        assert torch.allclose(u, exact, rtol=1e-9, atol=0.0), (m, u, exact)
    # the paper's closed form (eq. 10, m = 2) where it does not cancel
    a = torch.tensor([0.01, 0.05, 0.2], dtype=torch.float64)
    paper = 1 - (1 - a) ** n_tables - n_tables * a * (1 - a) ** (n_tables - 1)
    assert torch.allclose(magicpig.collision_probability(a, n_tables, 2), paper, rtol=1e-12)
    with pytest.raises(ValueError, match="min_collisions"):
        magicpig.collision_probability(a, 4, 5)


def test_sampling_rate_matches_eq10():
    """Empirical P[key sampled] over random hyperplanes ≈ u from eq. 10 at the pair's angle."""
    gen = _gen(1)
    d, k_bits, n_tables, trials = 32, 3, 12, 600
    q = torch.randn(d, generator=gen)
    x = torch.randn(d, generator=gen)
    x = x - (x @ q) / (q @ q) * q
    k = 0.8 * q / q.norm() + 0.6 * x / x.norm()  # cos = 0.8
    hits = 0
    for t in range(trials):
        w = torch.randn(d, k_bits * n_tables, generator=gen)
        qc = magicpig.hash_codes_reference(q.view(1, d), w, k_bits, n_tables)
        kc = magicpig.hash_codes_reference(k.view(1, d), w, k_bits, n_tables)
        hits += int((qc == kc).sum() >= 2)
    u = float(magicpig.collision_probability_from_cos(torch.tensor(0.8), k_bits, n_tables, 2))
    sd = math.sqrt(u * (1 - u) / trials)
    assert abs(hits / trials - u) < 5 * sd


# ----------------------------------------------------------------------------------------- tables + sampling
@pytest.mark.parametrize("backend", BACKENDS)
def test_tables_are_bucketed_sorts(backend):
    _, _, _, _, kcodes, _ = _problem(2, n=700)
    t = magicpig_cpu.build_tables(kcodes, 6, keep_codes=True, backend=backend)
    ref = magicpig_cpu.build_tables_reference(kcodes, 6)
    assert torch.equal(t.perm, ref.perm) and torch.equal(t.offsets, ref.offsets)
    assert t.perm.dtype == t.offsets.dtype == torch.int32 and t.codes.dtype == torch.uint16
    b, h, n, l_ = kcodes.shape
    assert t.offsets.shape == (b, h, l_, 65) and int(t.offsets[..., -1].min()) == n
    # every bucket holds exactly the keys with that code, ascending (stable sort)
    for c in (0, 17, 63):
        lo, hi = t.offsets[1, 0, 3, c], t.offsets[1, 0, 3, c + 1]
        keys = t.perm[1, 0, 3, lo:hi]
        assert torch.equal(keys, torch.nonzero(kcodes[1, 0, :, 3] == c).flatten().to(torch.int32))
    assert torch.equal(t.key_codes(), kcodes)
    assert torch.equal(ref.key_codes(), kcodes)  # recovered from the buckets
    assert t.nbytes() == 4 * b * h * l_ * (n + 65) + 2 * b * h * l_ * n


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("min_collisions", [1, 2, 3])
def test_sample_equals_brute_force(backend, min_collisions):
    _, _, _, _, kcodes, qcodes = _problem(3 + min_collisions)
    tables = magicpig_cpu.build_tables(kcodes, 6, backend=backend)
    idx, cnt = magicpig_cpu.sample(tables, qcodes, min_collisions, backend=backend)
    ref_idx, ref_cnt = magicpig_cpu.sample_reference(kcodes, qcodes, min_collisions)
    assert torch.equal(cnt, ref_cnt)
    assert torch.equal(idx, ref_idx)  # ascending, −1 padded
    assert int(cnt.min()) > 0 and int(cnt.max()) < kcodes.shape[2]  # a non-trivial sample


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_with_extra_keys_and_offsets_equals_brute_force(backend):
    """Keys beyond the tables (``extra_codes``, e.g. those that left the local window after the build) are matched
    by the same rule and follow each row's table hits, ascending, at extra_offset + e; index_offset shifts the table
    hits; the count covers both.  Against brute force over all the keys' codes at once."""
    _, _, _, _, kcodes, qcodes = _problem(21)
    n_tab, n_extra, off, e_off = 30, 10, 4, 1000
    tables = magicpig_cpu.build_tables(kcodes[:, :, :n_tab], 6, backend=backend)
    extra = kcodes[:, :, n_tab : n_tab + n_extra].contiguous()
    idx, cnt = magicpig_cpu.sample(
        tables, qcodes, 1, backend=backend, index_offset=off, extra_codes=extra, extra_offset=e_off
    )
    ref_idx, ref_cnt = magicpig_cpu.sample_reference(kcodes[:, :, : n_tab + n_extra], qcodes, 1)
    assert torch.equal(cnt, ref_cnt)
    shifted = torch.where(ref_idx < 0, ref_idx, torch.where(ref_idx < n_tab, ref_idx + off, ref_idx - n_tab + e_off))
    assert torch.equal(idx, shifted)
    assert bool((idx >= e_off).any()) and bool(((idx >= 0) & (idx < e_off)).any())  # hits of both kinds
    with pytest.raises(ValueError, match="extra_codes"):
        magicpig_cpu.sample(tables, qcodes, 1, backend=backend, extra_codes=extra[:, :1])
    # a preallocated buffer filled up to extra_count: what lies beyond is never read (there, keys that would match
    # every row of KV head 0 in every table)
    buf = torch.cat([extra, qcodes[:, :1, None].expand(-1, extra.shape[1], 3, -1)], 2).contiguous()
    got_idx, got_cnt = magicpig_cpu.sample(
        tables, qcodes, 1, backend=backend, index_offset=off, extra_codes=buf, extra_offset=e_off, extra_count=n_extra
    )
    assert torch.equal(got_cnt, cnt) and torch.equal(got_idx, idx)
    more_idx, more_cnt = magicpig_cpu.sample(tables, qcodes, 1, backend=backend, extra_codes=buf)
    assert bool((more_cnt > cnt).any())  # the buffer's tail does match when it is counted
    with pytest.raises(ValueError, match=r"extra_count=14: must lie in \[0, E=13\]"):
        magicpig_cpu.sample(tables, qcodes, 1, backend=backend, extra_codes=buf, extra_count=14)


@needs_numba
def test_sample_with_small_buckets_equals_brute_force():
    """Many bits per table: each row touches few counters, so the kernel resets them one by one (the other branch
    of its counter reset); rows that share a thread must not see each other's counts."""
    _, _, _, _, kcodes, qcodes = _problem(17, k_bits=10, n_tables=12)
    tables = magicpig_cpu.build_tables(kcodes, 10)
    before = magicpig_cpu.get_num_threads()
    magicpig_cpu.set_num_threads(1)  # every row of the batch on one thread, after one another
    try:
        idx, cnt = magicpig_cpu.sample(tables, qcodes, 2)
    finally:
        magicpig_cpu.set_num_threads(before)
    ref_idx, ref_cnt = magicpig_cpu.sample_reference(kcodes, qcodes, 2)
    assert torch.equal(cnt, ref_cnt) and torch.equal(idx, ref_idx)
    off = tables.offsets.long()
    touched = [
        sum(int(off[b, h // 4, l, qcodes[b, h, l] + 1] - off[b, h // 4, l, qcodes[b, h, l]]) for l in range(12))
        for b in range(2)
        for h in range(8)
    ]
    assert max(touched) * 32 < kcodes.shape[2] and int(cnt.max()) > 0  # every row resets one by one; a sample


@needs_numba
def test_sample_unsorted_is_same_set_and_bad_codes_match_nothing():
    _, _, _, _, kcodes, qcodes = _problem(9)
    tables = magicpig_cpu.build_tables(kcodes, 6)
    idx, cnt = magicpig_cpu.sample(tables, qcodes, 2)
    idx_u, cnt_u = magicpig_cpu.sample(tables, qcodes, 2, sort=False)
    assert torch.equal(cnt, cnt_u)
    assert torch.equal(
        torch.sort(torch.where(idx_u < 0, 1 << 30, idx_u), -1).values, torch.where(idx < 0, 1 << 30, idx)
    )
    bad = qcodes.clone()
    bad[0, 0] = -1  # out of range: no bucket
    bad[0, 1] = 64
    idx_b, cnt_b = magicpig_cpu.sample(tables, bad, 1)
    assert int(cnt_b[0, 0]) == 0 and int(cnt_b[0, 1]) == 0


def test_table_input_errors():
    with pytest.raises(ValueError, match="range"):
        magicpig_cpu.build_tables(torch.full((1, 1, 4, 2), 64), 6)
    with pytest.raises(ValueError, match="K=17"):
        magicpig_cpu.build_tables(torch.zeros(1, 1, 4, 2, dtype=torch.int32), 17)
    tables = magicpig_cpu.build_tables_reference(torch.zeros(1, 2, 4, 3, dtype=torch.int32), 2)
    with pytest.raises(ValueError, match="q_codes"):
        magicpig_cpu.sample(tables, torch.zeros(1, 4, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="multiple"):
        magicpig_cpu.sample(tables, torch.zeros(1, 3, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        magicpig_cpu.sample(tables, torch.zeros(1, 4, 3, dtype=torch.int32), backend="gpu")


# ----------------------------------------------------------------------------------------- attention
def _brute_attention(q, k, v, idx, cnt, mean, k_bits, n_tables, m, scaling):
    """Per-row loop in float64, straight from eq. 11."""
    b, hq, d = q.shape
    g = hq // k.shape[1]
    o = torch.zeros(b, hq, d, dtype=torch.float64)
    lse = torch.full((b, hq), float("-inf"), dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            ids = idx[bi, h, : int(cnt[bi, h])].long()
            if len(ids) == 0:
                continue
            ks = k[bi, h // g, ids].double()
            vs = v[bi, h // g, ids].double()
            qq = q[bi, h].double()
            kc = ks - mean[bi, h // g].double()
            cos = (kc @ qq) / (kc.norm(dim=-1) * qq.norm())
            u = magicpig.collision_probability_from_cos(cos, k_bits, n_tables, m)
            logit = ks @ qq * scaling - torch.log(u)
            lse[bi, h] = torch.logsumexp(logit, 0)
            o[bi, h] = torch.softmax(logit, 0) @ vs
    return o, lse


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_matches_eq11(backend):
    q, k, v, mean, kcodes, qcodes = _problem(4)
    tables = magicpig_cpu.build_tables_reference(kcodes, 6)
    idx, cnt = magicpig_cpu.sample(tables, qcodes, 2, backend="torch")
    cnt[1, 3] = 0  # an empty row: o = 0, lse = -inf
    o, lse = magicpig_cpu.attention(q, k, v, idx, cnt, k_bits=6, n_tables=20, k_mean=mean, backend=backend)
    o_ref, lse_ref = _brute_attention(q.float(), k, v, idx, cnt, mean, 6, 20, 2, 1 / 8)
    assert o.dtype == lse.dtype == torch.float32
    assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref)) and bool(torch.isinf(lse[1, 3]))
    fin = torch.isfinite(lse_ref)
    assert torch.allclose(lse[fin].double(), lse_ref[fin], atol=1e-4, rtol=1e-5)
    assert torch.allclose(o.double(), o_ref, atol=1e-4, rtol=1e-4)
    assert (o[1, 3] == 0).all()
    # the correction matters: without it the output differs
    o_plain, _ = magicpig_cpu.attention(
        q, k, v, idx, cnt, k_bits=6, n_tables=20, k_mean=mean, correct=False, backend=backend
    )
    assert float((o_plain - o).abs().max()) > 1e-3


# float16 keys: a fresh numba compile of the kernel (about 20 s), so its cases are slow checks; the float16/bfloat16
# widening is checked bit for bit by test_half_and_bfloat16_widening_is_exact in the default command
HALF_SLOW = pytest.param(torch.float16, marks=pytest.mark.slow)


@needs_numba
@pytest.mark.slow  # each dtype a fresh numba compile, as HALF_SLOW's comment says
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_attention_other_storage_dtypes(dtype):
    q, k, v, mean, kcodes, qcodes = _problem(5, dtype=dtype, n=600)
    idx, cnt = magicpig_cpu.sample_reference(kcodes, qcodes, 2)
    o, lse = magicpig_cpu.attention(q, k, v, idx, cnt, k_bits=6, n_tables=20, k_mean=mean)
    o_ref, lse_ref = magicpig_cpu.attention_reference(q, k, v, idx, cnt, k_bits=6, n_tables=20, k_mean=mean)
    assert torch.allclose(o, o_ref, atol=1e-4, rtol=1e-4)
    assert torch.allclose(lse, lse_ref, atol=1e-4, rtol=1e-5)


@needs_numba
def test_half_and_bfloat16_widening_is_exact():
    import numpy as np

    from sparse_eval.kernels import _nb_magicpig as nb

    bits = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    out = np.empty(bits.shape, np.float32)
    nb.to_f32_array(bits.view(np.int16), out)  # float16 bit patterns (normal, subnormal, ±0, inf, NaN)
    ref = bits.view(np.float16).astype(np.float32)
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(out[~np.isnan(ref)], ref[~np.isnan(ref)])
    nb.to_f32_array(bits, out)  # bfloat16 bit patterns
    ref = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(out[~np.isnan(ref)], ref[~np.isnan(ref)])


@needs_numba
def test_attention_padding_strides_threads_and_errors():
    q, k, v, mean, kcodes, qcodes = _problem(6, n=400)
    idx, cnt = magicpig_cpu.sample_reference(kcodes, qcodes, 2)
    # count omitted: every index >= 0 is used, wherever the padding sits
    shuffled = torch.cat([torch.full_like(idx[..., :3], -1), idx], -1)
    o1, l1 = magicpig_cpu.attention(q, k, v, shuffled, None, k_bits=6, n_tables=20, k_mean=mean)
    o2, l2 = magicpig_cpu.attention(q, k, v, idx, cnt, k_bits=6, n_tables=20, k_mean=mean)
    assert torch.allclose(o1, o2, atol=1e-6) and torch.allclose(l1, l2, atol=1e-6)
    # a slice of a larger preallocated cache is read in place; any thread count gives the same result
    big_k = torch.zeros(2, 2, 500, 64, dtype=k.dtype)
    big_v = torch.zeros_like(big_k)
    big_k[:, :, :400], big_v[:, :, :400] = k, v
    before = magicpig_cpu.get_num_threads()
    try:
        magicpig_cpu.set_num_threads(1)
        o3, l3 = magicpig_cpu.attention(
            q, big_k[:, :, :400], big_v[:, :, :400], idx, cnt, k_bits=6, n_tables=20, k_mean=mean, prefetch=0
        )
    finally:
        magicpig_cpu.set_num_threads(before)
    assert torch.allclose(o3, o2, atol=1e-6) and torch.allclose(l3, l2, atol=1e-6)
    bad = idx.clone()
    bad[0, 0, 0] = 400
    with pytest.raises(ValueError, match="N=400"):
        magicpig_cpu.attention(q, k, v, bad, cnt, k_bits=6, n_tables=20)
    with pytest.raises(ValueError, match="threads"):
        magicpig_cpu.set_num_threads(0)
    with pytest.raises(ValueError, match="KV dtype"):
        magicpig_cpu.attention(q, k.to(torch.float64), v.to(torch.float64), idx, cnt, k_bits=6, n_tables=20)


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, HALF_SLOW])
def test_attention_blocked_rows_with_remainders(dtype):
    """The numba kernel walks the keys four at a time plus a remainder loop: every count 0..9 (and a long row),
    head dims that are not multiples of the vector width, any prefetch distance, with and without −log u."""
    gen = _gen(11)
    b, hq, hkv, n = 2, 6, 2, 300
    for d in (40, 64):
        k = (torch.randn(b, hkv, n, d, generator=gen) + 0.3).to(dtype)
        v = torch.randn(b, hkv, n, d, generator=gen).to(dtype)
        q = torch.randn(b, hq, d, generator=gen)
        mean = k.float().mean(2)
        idx = torch.stack([torch.randperm(n, generator=gen)[:157] for _ in range(b * hq)]).view(b, hq, 157).int()
        cnt = torch.tensor([[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 13, 157]], dtype=torch.int32)
        for correct in (True, False):
            o_ref, l_ref = magicpig_cpu.attention_reference(
                q, k, v, idx, cnt, k_bits=8, n_tables=30, k_mean=mean, correct=correct
            )
            for pf, early in ((0, 0), (1, 0), (3, 0), (16, 0), (0, 1000), (3, 1000), (16, 1000), (16, 6)):
                o, lse = magicpig_cpu.attention(
                    q,
                    k,
                    v,
                    idx,
                    cnt,
                    k_bits=8,
                    n_tables=30,
                    k_mean=mean,
                    correct=correct,
                    prefetch=pf,
                    prefetch_v_early=early,
                )
                assert bool(torch.isinf(lse[0, 0])) and (o[0, 0] == 0).all()
                assert torch.allclose(o, o_ref, atol=1e-5, rtol=1e-4), (d, correct, pf)
                fin = torch.isfinite(l_ref)
                assert torch.equal(fin, torch.isfinite(lse))
                assert torch.allclose(lse[fin], l_ref[fin], atol=1e-5, rtol=1e-5), (d, correct, pf)


@needs_numba
def test_vectorisable_acos_and_exp_match_libm():
    import numpy as np

    from sparse_eval.kernels import _nb_magicpig as nb

    for c in np.concatenate([np.linspace(-1.0, 1.0, 20001), [0.5, -0.5, np.nextafter(0.5, 1), 1e-300, -0.0]]):
        assert abs(nb._acos(float(c)) - math.acos(c)) <= 1e-15, c
    assert math.isnan(nb._acos(float("nan")))
    for x in np.concatenate([-np.geomspace(1e-12, 708.0, 4001), [0.0, -0.0, -0.5 * math.log(2), -707.9]]):
        assert abs(nb._exp_nonpos(float(x)) / math.exp(x) - 1.0) <= 4e-16 * (1.0 + abs(x)), x
    assert nb._exp_nonpos(-709.0) == 0.0 and nb._exp_nonpos(float("-inf")) == 0.0
    assert math.isnan(nb._exp_nonpos(float("nan")))


def test_cpu_features_reports_the_machine():
    info = magicpig_cpu.cpu_features()
    assert info["logical_cpus"] >= 1
    if numba_available():
        assert isinstance(info["avx512f"], bool) and info["numba_threads"] >= 1


# ----------------------------------------------------------------------------------------- LSE merge
def test_merge_two_halves_equals_union():
    gen = _gen(8)
    b, hq, hkv, n, d = 2, 8, 2, 300, 32
    q = torch.randn(b, hq, d, generator=gen)
    k = torch.randn(b, hkv, n, d, generator=gen)
    v = torch.randn(b, hkv, n, d, generator=gen)
    union = torch.stack([torch.randperm(n, generator=gen)[:60] for _ in range(b * hq)]).view(b, hq, 60)
    o, lse = sparse_decode.attention_reference(q, k, v, union, out_dtype=torch.float32)
    o1, l1 = sparse_decode.attention_reference(q, k, v, union[..., :25], out_dtype=torch.float32)
    o2, l2 = sparse_decode.attention_reference(q, k, v, union[..., 25:], out_dtype=torch.float32)
    om, lm = merge_by_lse(o1, l1, o2, l2)
    assert torch.allclose(om, o, atol=1e-5) and torch.allclose(lm, lse, atol=1e-5)
    # an empty part (lse = -inf, o = NaN even) leaves the other unchanged; two empty parts give 0 / -inf
    inf = torch.full_like(l1, float("-inf"))
    om, lm = merge_by_lse(o1, l1, torch.full_like(o1, float("nan")), inf)
    assert torch.allclose(om, o1) and torch.equal(lm, l1)
    om, lm = merge_by_lse(o1, inf, o2, inf)
    assert (om == 0).all() and torch.isinf(lm).all()
    with pytest.raises(ValueError, match="merge_by_lse"):
        merge_by_lse(o1, l1[..., :1], o2, l2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_magicpig_cpu_part_merges_with_static_gpu_part(backend):
    """MagicPIG's split (§4.4): sampled keys on the CPU with −log u, sink + local keys (u = 1) elsewhere;
    the LSE merge equals one softmax over both parts' logits (eq. 11 with u = 1 for static keys)."""
    q, k, v, mean, kcodes, qcodes = _problem(7, n=800)
    b, hq, d = q.shape
    static = torch.cat([torch.arange(4), torch.arange(800 - 64, 800)])  # sink 4, local 64
    cand = torch.ones(800, dtype=torch.bool)
    cand[static] = False
    off = torch.nonzero(cand).flatten()  # offloaded keys: tables are over these only
    tables = magicpig_cpu.build_tables(kcodes[:, :, off], 6, backend=backend)
    idx, cnt = magicpig_cpu.sample(tables, qcodes, 2, backend=backend)
    k_off, v_off = k[:, :, off].contiguous(), v[:, :, off].contiguous()
    o_cpu, l_cpu = magicpig_cpu.attention(
        q, k_off, v_off, idx, cnt, k_bits=6, n_tables=20, k_mean=mean, backend=backend
    )
    st = static.view(1, 1, -1).expand(b, hq, -1).to(torch.int32)
    o_gpu, l_gpu = sparse_decode.attention_reference(q.float(), k, v, st, out_dtype=torch.float32)
    o, lse = merge_by_lse(o_cpu, l_cpu, o_gpu, l_gpu)
    o_ref, lse_ref = _brute_attention(q.float(), k_off, v_off, idx, cnt, mean, 6, 20, 2, d**-0.5)
    # union by hand: concatenate logits (static keys with u = 1)
    g = hq // k.shape[1]
    for bi in range(b):
        for h in range(hq):
            ids = off[idx[bi, h, : int(cnt[bi, h])].long()]
            ks, vs = k[bi, h // g].double(), v[bi, h // g].double()
            qq = q[bi, h].double()
            kc = ks[ids] - mean[bi, h // g].double()
            u = magicpig.collision_probability_from_cos((kc @ qq) / (kc.norm(dim=-1) * qq.norm()), 6, 20, 2)
            logits = torch.cat([ks[ids] @ qq * d**-0.5 - torch.log(u), ks[static] @ qq * d**-0.5])
            rows = torch.cat([ids, static])
            assert torch.allclose(o[bi, h].double(), torch.softmax(logits, 0) @ vs[rows], atol=1e-4)
            assert abs(float(lse[bi, h]) - float(torch.logsumexp(logits, 0))) < 1e-4
    assert torch.allclose(l_cpu.double(), lse_ref, atol=1e-4)


# ----------------------------------------------------------------------------------------- packaging
def test_import_is_light():
    """``import sparse_eval.kernels`` and its public modules pull in neither triton nor numba."""
    code = (
        "import sys, sparse_eval.kernels, sparse_eval.kernels.ds, sparse_eval.kernels.quest, "
        "sparse_eval.kernels.magicpig, sparse_eval.kernels.magicpig_cpu, sparse_eval.kernels.merge\n"
        "assert 'triton' not in sys.modules and 'numba' not in sys.modules, "
        "sorted(m for m in sys.modules if m in ('triton','numba'))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]


def test_installed_top_level_names():
    """The distribution installs the top-level import names ``sparse_eval`` and ``hydra_plugins`` only: no
    ``kernels`` (the name of Hugging Face's kernel-hub package, which transformers imports when present) and no
    ``benchmarks`` (found by setuptools with pyproject's own package selection)."""
    tomllib = pytest.importorskip("tomllib")

    from setuptools import find_namespace_packages, find_packages

    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    finder = find_namespace_packages if find.get("namespaces", True) else find_packages  # setuptools' default
    top = {p.split(".")[0] for p in finder(str(ROOT), include=find["include"], exclude=find.get("exclude", ()))}
    assert top == {"sparse_eval", "hydra_plugins"}, top
    assert not (ROOT / "kernels").exists() and not (ROOT / "benchmarks" / "__init__.py").exists()


def test_torch_fallback_without_numba(monkeypatch):
    """backend='auto' without numba: the torch path, same results, one RuntimeWarning."""
    import sparse_eval.kernels._common as common

    _, _, _, _, kcodes, qcodes = _problem(10, n=300)
    ref = magicpig_cpu.sample_reference(kcodes, qcodes, 2)
    monkeypatch.setattr(common, "numba_available", lambda: False)
    monkeypatch.setattr(magicpig_cpu, "_warned", False)
    with pytest.warns(RuntimeWarning, match="numba"):
        tables = magicpig_cpu.build_tables(kcodes, 6)
    idx, cnt = magicpig_cpu.sample(tables, qcodes, 2)
    assert torch.equal(idx, ref[0]) and torch.equal(cnt, ref[1])
    with pytest.raises(RuntimeError, match="numba"):
        magicpig_cpu.sample(tables, qcodes, 2, backend="numba")


@pytest.mark.skipif(
    not Path("/sys/kernel/mm/transparent_hugepage/enabled").exists(), reason="no transparent huge pages on this system"
)
def test_advise_huge_pages_on_an_untouched_host_tensor():
    """madvise(MADV_HUGEPAGE) is accepted for a fresh host tensor, leaves its contents usable, and is refused for
    tensors spanning no whole page (and for CUDA tensors, without a call)."""
    from sparse_eval.kernels._common import advise_huge_pages

    t = torch.empty(1 << 22, dtype=torch.bfloat16)  # 8 MiB, not touched yet
    assert advise_huge_pages(t)
    t.copy_(torch.arange(1 << 22, dtype=torch.float32))
    assert float(t[12345]) == 12352.0 and float(t[0]) == 0.0  # bf16 rounding of 12345
    assert not advise_huge_pages(torch.empty(8, dtype=torch.float32))
    assert not advise_huge_pages(torch.empty(0))


@needs_numba
def test_gather_read_kernel_sums_exactly_the_gathered_rows():
    """The benchmark's access-pattern ceiling reads the same rows as the attention: its total equals the sum of the
    16-bit words of the first count[b, h] indexed K and V rows of each query head's KV head, for any prefetch."""
    from sparse_eval.kernels import _nb_magicpig as nbm

    gen = _gen(5)
    b, hq, hkv, n, d = 2, 4, 2, 50, 24
    k = torch.randint(0, 1 << 16, (b, hkv, n, d), generator=gen, dtype=torch.int32).to(torch.uint16)
    v = torch.randint(0, 1 << 16, (b, hkv, n, d), generator=gen, dtype=torch.int32).to(torch.uint16)
    idx = torch.stack([torch.randperm(n, generator=gen)[:9] for _ in range(b * hq)]).view(b, hq, 9).int()
    cnt = torch.tensor([[0, 1, 5, 9], [9, 3, 2, 7]], dtype=torch.int32)
    want = 0
    for bi in range(b):
        for h in range(hq):
            rows = idx[bi, h, : cnt[bi, h]].long()
            t = h // (hq // hkv)
            want += int(k[bi, t, rows].long().sum()) + int(v[bi, t, rows].long().sum())
    kv = torch.cat([k, v], -1)  # a token's K and V side by side, read as one row (the second array empty)
    for pf in (0, 2, 16):
        got = nbm.gather_read_kernel(k.numpy(), v.numpy(), idx.numpy(), cnt.numpy(), pf)
        assert int(got) == want, pf
        got = nbm.gather_read_kernel(kv.numpy(), kv[..., :0].contiguous().numpy(), idx.numpy(), cnt.numpy(), pf)
        assert int(got) == want, pf


@needs_numba
@pytest.mark.parametrize("dtype", [torch.bfloat16, HALF_SLOW])
def test_attention_reads_k_and_v_side_by_side_in_place(dtype):
    """K and V as the two halves of one [B, Hkv, N', 2, D] cache (N' > N: a token slice) are read in place, with the
    same result as separate caches, and an index in [N, N') is rejected like any other outside [0, N)."""
    import numpy as np

    gen = _gen(13)
    b, hq, hkv, n, cap, d = 2, 8, 2, 90, 120, 64
    kv = torch.randn(b, hkv, cap, 2, d, generator=gen).to(dtype)
    k, v = kv[:, :, :n, 0], kv[:, :, :n, 1]
    q = torch.randn(b, hq, d, generator=gen)
    mean = k.float().mean(2)
    idx = torch.stack([torch.randperm(n, generator=gen)[:40] for _ in range(b * hq)]).view(b, hq, 40).int()
    cnt = torch.randint(0, 41, (b, hq), generator=gen, dtype=torch.int32)
    ka, va, v_col = magicpig_cpu._kv_arrays(k, v)
    assert v_col == d and ka is va and np.shares_memory(ka, kv.view(torch.int16).numpy())
    o1, l1 = magicpig_cpu.attention(q, k, v, idx, cnt, k_bits=8, n_tables=30, k_mean=mean)
    o2, l2 = magicpig_cpu.attention(q, k.contiguous(), v.contiguous(), idx, cnt, k_bits=8, n_tables=30, k_mean=mean)
    assert torch.equal(o1, o2) and torch.equal(torch.isfinite(l1), torch.isfinite(l2))
    fin = torch.isfinite(l1)
    assert torch.equal(l1[fin], l2[fin])
    o_ref, l_ref = magicpig_cpu.attention_reference(q, k, v, idx, cnt, k_bits=8, n_tables=30, k_mean=mean)
    assert torch.allclose(o1, o_ref, atol=1e-5, rtol=1e-4) and torch.allclose(l1[fin], l_ref[fin], atol=1e-5)
    assert magicpig_cpu._side_by_side(k, kv[:, :, :n, 0]) is None  # not the two halves of one buffer
    bad = idx.clone()
    bad[1, 2, 0] = n + 5  # inside the buffer, outside the cache's N
    cnt_bad = cnt.clone()
    cnt_bad[1, 2] = 40
    with pytest.raises(ValueError, match=f"N={n}"):
        magicpig_cpu.attention(q, k, v, bad, cnt_bad, k_bits=8, n_tables=30, k_mean=mean)
