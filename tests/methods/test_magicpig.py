"""MagicPIG (arXiv 2410.16179 §4.3, eq. 8–11, Algorithm 1): sampling law, estimator, index, padding, models."""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch

from conftest import tiny_model
from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.methods import attend, build_method, make_config
from sparse_eval.methods.magicpig import (
    MagicPIG,
    collision_counts,
    expected_sampling_rate,
    hash_table_bytes,
    log_sampling_probability,
    pack_signs,
    sampling_probability,
)
from sparse_eval.simhash_probability import upper_terms


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one intra-op thread avoids OpenMP spin-waiting (10× less CPU on a busy box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def mp(**opts) -> MagicPIG:
    return build_method(make_config("magicpig", opts))


def binom_tail(r: float, L: int, m: int) -> float:
    """P[Binomial(L, r) >= m] by direct summation (independent of the implementation)."""
    return sum(math.comb(L, j) * r**j * (1 - r) ** (L - j) for j in range(m, L + 1))


def brute_u(q: torch.Tensor, kc: torch.Tensor, K: int, L: int, m: int) -> torch.Tensor:
    """u_i for one query q [D] and hashed keys kc [N, D'] (already centered/transformed), eq. 10 generalised,
    as a plain float64 sum of the binomial pmf (no log space)."""
    qq = torch.cat([q, q.new_zeros(kc.shape[-1] - q.shape[-1])]).double()
    cos = (kc.double() @ qq) / (kc.double().norm(dim=-1) * qq.norm())
    r = ((1 - torch.arccos(cos.clamp(-1, 1)) / math.pi) ** K)[:, None]
    j = torch.arange(m, L + 1, dtype=torch.float64)
    comb = torch.tensor([math.comb(L, int(i)) for i in j], dtype=torch.float64)
    return (comb * r**j * (1 - r) ** (L - j)).sum(-1)


# -- analytic pieces -------------------------------------------------------------------------------


def test_sampling_probability_is_eq10_and_the_binomial_tail():
    p = torch.linspace(0.0, 1.0, 41, dtype=torch.float64)
    for K, L in ((3, 10), (10, 150), (1, 5), (1, 150), (2, 300)):
        r = p**K
        eq10 = 1 - (1 - r) ** L - L * r * (1 - r) ** (L - 1)
        torch.testing.assert_close(sampling_probability(p, K, L, 2), eq10, rtol=1e-9, atol=1e-12)
        for m in (1, 3, 20, 60, L):  # the binomial's mode crosses m along p: both summation branches
            if m > L:
                continue
            ref = torch.tensor([binom_tail(float(x) ** K, L, m) for x in p], dtype=torch.float64)
            torch.testing.assert_close(sampling_probability(p, K, L, m), ref, rtol=1e-9, atol=1e-12)
    # tiny u stays exact in log space (1 − (…) would cancel to 0): leading term C(L, m) p^{Km}
    tiny = torch.tensor([1e-3, 1e-30, 1e-300], dtype=torch.float64)
    lu = log_sampling_probability(tiny, 10, 150, 2)
    assert torch.isfinite(lu).all()
    lead = math.log(math.comb(150, 2)) + 20 * torch.log(tiny)
    torch.testing.assert_close(lu, lead, rtol=1e-6, atol=1e-6)
    assert log_sampling_probability(torch.tensor([1.0]), 10, 150, 2).item() == 0.0
    assert log_sampling_probability(torch.tensor([0.9]), 10, 1, 2).item() == -math.inf  # m > L: never sampled


def _log_u_per_call(p, K, L, m, budget):
    """eq. 10's log u as it was computed before the pmf's constant terms were kept (every term per call):
    the reference that keeps a run's records the same bits."""
    p = p.to(torch.float64).clamp(0.0, 1.0)

    def log_pmf(j, log_r, log_1mr):
        log_c = math.lgamma(L + 1) - torch.lgamma(j + 1) - torch.lgamma(L - j + 1)
        rest = L - j
        fail = torch.where(rest > 0, rest * log_1mr, torch.zeros_like(log_1mr))
        return log_c + torch.where(j > 0, j * log_r, torch.zeros_like(log_r)) + fail

    j_lo = torch.arange(0, m, dtype=torch.float64)
    j_hi = torch.arange(m, m + upper_terms(m, L), dtype=torch.float64)
    flat = p.reshape(-1)
    out = torch.empty_like(flat)
    step = max(1, budget // (m + j_hi.numel()))
    for s in range(0, flat.numel(), step):
        pc = flat[s : s + step, None]
        log_r = K * torch.log(pc)
        log_1mr = torch.log1p(-torch.exp(log_r))
        upper = torch.logsumexp(log_pmf(j_hi, log_r, log_1mr), dim=-1)
        lower = torch.logsumexp(log_pmf(j_lo, log_r, log_1mr), dim=-1).clamp_max(0.0)
        complement = torch.log(-torch.expm1(lower))
        big = torch.floor((L + 1) * torch.exp(log_r[:, 0])) > m
        out[s : s + step] = torch.where(big, complement, upper).clamp_max(0.0)
    return out.reshape(p.shape)


def test_log_sampling_probability_keeps_its_bits():
    """The pmf's constants made once per (L, m) give the same float64 bits as computing them in every call, one
    chunk or many (records of runs made before stay reproducible)."""
    g = torch.Generator().manual_seed(0)
    u = torch.rand(400, generator=g, dtype=torch.float64)
    p = torch.cat([u, u**8, torch.tensor([0.0, 1.0, 1e-300, 0.5, 1 - 1e-12, 0.9], dtype=torch.float64)]).reshape(2, -1)
    for K, L, m in [(10, 150, 2), (8, 75, 2), (3, 12, 1), (10, 150, 5), (4, 8, 8)]:
        for budget in (1 << 24, 1000, 37):
            got = log_sampling_probability(p, K, L, m, budget)
            ref = _log_u_per_call(p, K, L, m, budget)
            assert got.shape == p.shape and torch.equal(got.isnan(), ref.isnan())
            assert torch.equal(got[~got.isnan()], ref[~ref.isnan()]), (K, L, m, budget)


def test_expected_sampling_rate_and_hash_table_memory():
    # (10,150) at p = 1/2: about 1 % of the keys
    assert expected_sampling_rate(10, 150) == pytest.approx(0.00968, rel=1e-3)
    rates = [expected_sampling_rate(10, L) for L in (75, 100, 120, 150, 200, 300)]
    assert rates == sorted(rates)
    # MagicPIG Table 9 (Llama-3.1-8B): 0.5/0.9/1.5/2/3/6 %: the measured rates sit above u(1/2) by 1.6–2.4×,
    # as they must when real p spreads around 1/2 (u is convex there); the analytic figure is the floor
    for analytic, measured in zip(rates, (0.005, 0.009, 0.015, 0.02, 0.03, 0.06)):
        assert 1.3 < measured / analytic < 2.6
    assert expected_sampling_rate(10, 150, 1) > expected_sampling_rate(10, 150, 2)
    # MagicPIG Table 8 / issue #12: (10,150) at 96K on Llama-3.1-8B (32 layers × 8 KV heads) → 14 GB (GiB)
    assert hash_table_bytes(32, 8, 150, 96 * 1024) / 2**30 == pytest.approx(14.06, abs=0.01)
    assert hash_table_bytes(1, 1, 1, 65536) == 2 * 65536 and hash_table_bytes(1, 1, 1, 65537) == 4 * 65537


def test_collision_counts_are_chunked_exactly():
    g = torch.Generator().manual_seed(0)
    qc = torch.randint(0, 4, (2, 4, 3, 7), generator=g, dtype=torch.int16)
    kc = torch.randint(0, 4, (2, 2, 50, 7), generator=g, dtype=torch.int16)
    ref = (qc.reshape(2, 2, 6, 1, 7) == kc[:, :, None]).sum(-1).reshape(2, 4, 3, 50)
    for budget in (1, 7, 100, 1 << 20):
        assert torch.equal(collision_counts(qc, kc, element_budget=budget).long(), ref)
    for L in (255, 256, 300):  # counts summed as uint8 up to L = 255, as int16 above: up to L, no wrap-around
        qc = torch.zeros(1, 2, 1, L, dtype=torch.int16)
        kc = torch.randint(0, 2, (1, 1, 9, L), generator=g, dtype=torch.int16)
        kc[0, 0, 0] = 0  # a key equal to the query in every table
        ref = (kc == 0).sum(-1).reshape(1, 1, 1, 9).expand(1, 2, 1, 9)
        assert torch.equal(collision_counts(qc, kc).long(), ref) and int(ref.max()) == L
    x = torch.tensor([[1.0, -1.0, 2.0, 0.0, -3.0, 5.0]])  # L=2 tables of K=3 bits, bit b = sign of column l·K+b
    assert pack_signs(x, 3, 2).tolist() == [[0b101, 0b100]]


# -- sampling law ----------------------------------------------------------------------------------


@pytest.mark.parametrize("K,L,m", [(2, 4, 1), (3, 8, 2), (2, 6, 3)])
def test_inclusion_frequency_matches_u(K, L, m):
    """Over projection seeds, key i is sampled with probability u_i (eq. 10 on the centered key)."""
    g = torch.Generator().manual_seed(K * 100 + L)
    n, d, seeds = 24, 8, 200
    q = torch.randn(1, 1, 1, d, generator=g)
    k = torch.randn(1, 1, n, d, generator=g) + 2.0  # off-center, so centering matters
    v = torch.randn(1, 1, n, d, generator=g)
    hits = torch.zeros(n)
    for s in range(seeds):
        _, st = attend("magicpig", q, k, v, K=K, L=L, min_collisions=m, sink=0, local=0, seed=s, compute_error=False)
        hits += st["keep"][0, 0, 0].float()
    u = brute_u(q[0, 0, 0], k[0, 0] - k[0, 0].mean(0), K, L, m)
    freq = hits.double() / seeds
    se = (u * (1 - u) / seeds).sqrt()
    assert (freq - u).abs().max() <= (4.5 * se + 1e-9).max(), (freq, u)
    assert ((freq - u).abs() <= 4.5 * se + 2.0 / seeds).all(), (freq, u)
    assert 0.05 < u.mean() < 0.95  # a test that can fail either way


def test_measured_cost2_matches_analytic_expectation():
    """(10,150) on random centered keys: mean sampled fraction = mean of u_i over the keys, within 4 s.e."""
    g = torch.Generator().manual_seed(7)
    hq, n, d, seeds = 4, 1024, 64, 12
    q = torch.randn(1, hq, 1, d, generator=g)
    k = torch.randn(1, hq, n, d, generator=g)
    v = torch.randn(1, hq, n, d, generator=g)
    kc = k[0] - k[0].mean(1, keepdim=True)
    expected = torch.stack([brute_u(q[0, h, 0], kc[h], 10, 150, 2) for h in range(hq)]).mean().item()
    per_seed = []
    for s in range(seeds):
        _, st = attend("magicpig", q, k, v, sink=0, local=0, seed=s, compute_error=False)
        torch.testing.assert_close(st["cost2"], st["sampled"] / n)  # no static keys: Cost2 = |S| / n
        assert torch.all(st["proj_cost"] == 2 * d * 10 * 150 / (4 * n * d))
        per_seed.append(st["cost2"].mean().item())
    x = torch.tensor(per_seed, dtype=torch.float64)
    se = x.std() / math.sqrt(seeds)
    assert abs(x.mean().item() - expected) < 4 * se + 1e-4, (x.mean().item(), expected, se)
    # d = 64 spreads p around 1/2, so the mean u exceeds u(1/2) (≈ 0.97 %); in high dimension it tends to it
    assert expected > expected_sampling_rate(10, 150)
    qh, kh = torch.randn(4096, generator=g), torch.randn(4000, 4096, generator=g)
    p = 1 - torch.arccos(torch.nn.functional.cosine_similarity(kh, qh[None], dim=-1).double()) / math.pi
    assert sampling_probability(p, 10, 150, 2).mean().item() == pytest.approx(expected_sampling_rate(10, 150), rel=0.1)


# -- the estimator ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "center,mips,u_offset", [(True, False, 0.0), (False, False, 0.0), (True, True, 0.0), (True, False, 1e-4)]
)
def test_output_is_eq11_over_the_returned_keep_set(center, mips, u_offset):
    g = torch.Generator().manual_seed(3)
    hq, hkv, n, d, K, L, sink, local = 4, 2, 200, 16, 3, 10, 4, 16
    q = torch.randn(1, hq, 1, d, generator=g)
    k = torch.randn(1, hkv, n, d, generator=g) * torch.linspace(0.5, 2.0, n)[:, None] + 1.0
    v = torch.randn(1, hkv, n, d, generator=g)
    out, st = attend("magicpig", q, k, v, K=K, L=L, sink=sink, local=local, center=center, mips=mips, u_offset=u_offset)
    static = torch.zeros(n, dtype=torch.bool)
    static[:sink] = static[n - local :] = True
    for h in range(hq):
        kh, vh, qh = k[0, h // 2], v[0, h // 2], q[0, h, 0]
        mu = kh[~static].mean(0) if center else torch.zeros(d)
        kc = kh - mu
        if mips:  # eq. 8 with r over the non-static keys
            r = kc[~static].norm(dim=-1).max()
            kc = torch.cat([kc, (r**2 - kc.pow(2).sum(-1)).clamp_min(0).sqrt()[:, None]], dim=-1)
        u = brute_u(qh, kc, K, L, 2)
        keep = st["keep"][0, h, 0]
        assert keep[static].all() and 0 < keep[~static].sum() < (~static).sum()
        logit = (kh @ qh).double() / math.sqrt(d) - torch.where(static, 0.0, torch.log(u + u_offset))
        w = torch.softmax(logit.masked_fill(~keep, -math.inf), 0)
        torch.testing.assert_close(out[0, h, 0].double(), w @ vh.double(), rtol=1e-4, atol=1e-5)
    assert st["cost1"].eq(0).all() and torch.isfinite(st["est_error"]).all()


def test_centering_makes_sampling_discriminative_on_a_narrow_cone():
    """Keys in a narrow cone (as real keys, Fig. 2c): without centering nearly all or nearly no keys collide,
    depending only on the cone's side; centered, sampling follows q·k."""
    g = torch.Generator().manual_seed(5)
    n, d = 600, 32
    e = torch.nn.functional.normalize(torch.randn(d, generator=g), dim=0)
    k = (8.0 * e + 0.5 * torch.randn(n, d, generator=g)).view(1, 1, n, d)
    v = torch.randn(1, 1, n, d, generator=g)
    opts = dict(K=6, L=30, sink=0, local=0)
    for side in (-1.0, 1.0):
        q = (side * e + 0.1 * torch.randn(d, generator=g)).view(1, 1, 1, d)
        _, off = attend("magicpig", q, k, v, center=False, **opts)
        _, on = attend("magicpig", q, k, v, center=True, **opts)
        frac_off, keep_on = off["keep"].float().mean().item(), on["keep"][0, 0, 0]
        assert frac_off < 0.01 if side < 0 else frac_off > 0.99
        assert 0.01 < keep_on.float().mean().item() < 0.5
        s = k[0, 0] @ q[0, 0, 0]
        assert s[keep_on].mean() > s.mean() + 0.5 * s.std()  # centered sampling prefers high-score keys
        assert not torch.equal(off["keep"], on["keep"])


def test_nothing_sampled_falls_back_to_static_keys_without_nan():
    g = torch.Generator().manual_seed(9)
    q, k, v = (
        torch.randn(1, 4, 1, 16, generator=g),
        torch.randn(1, 2, 120, 16, generator=g),
        torch.randn(1, 2, 120, 16, generator=g),
    )
    # one table of 20 bits: a key collides with probability p^20 (< 1e-2 here), so nothing is sampled
    out, st = attend("magicpig", q, k, v, K=20, L=1, min_collisions=1, sink=4, local=8)
    assert torch.isfinite(out).all() and torch.isfinite(st["est_error"]).all()
    assert st["empty"].all() and st["sampled"].eq(0).all()
    static = torch.zeros(120, dtype=torch.bool)
    static[:4] = static[-8:] = True
    assert torch.equal(st["keep"][0, :, 0], static.expand(4, -1))
    ref = torch.softmax(
        (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 4.0 + torch.where(static, 0.0, -math.inf), -1
    )
    torch.testing.assert_close(out, ref @ v.repeat_interleave(2, 1), rtol=1e-5, atol=1e-6)
    # no static keys either: the core falls back to the newest key, still finite
    out, st = attend("magicpig", q, k, v, K=20, L=1, min_collisions=1, sink=0, local=0)
    assert torch.isfinite(out).all() and st["empty"].all()


# -- the index -------------------------------------------------------------------------------------


def test_incremental_index_equals_rebuild():
    g = torch.Generator().manual_seed(11)
    hq, hkv, n0, n1, d = 4, 2, 100, 130, 16
    k = torch.randn(1, hkv, n1, d, generator=g) + 1.5
    v = torch.randn(1, hkv, n1, d, generator=g)
    qs = torch.randn(n1, 1, hq, 1, d, generator=g)
    opts = dict(K=4, L=12, sink=4, local=8)
    m = mp(**opts)
    state: dict = {}
    for t in range(n0, n1 + 1):  # built at n0, then one key per step
        attend(m, qs[t - 1], k[:, :, :t], v[:, :, :t], state=state)
    st = state["magicpig"]
    assert st["n"] == n1 and st["built"].all()
    mu = k[0, :, 4 : n0 - 8].mean(1)  # non-static keys at build time
    torch.testing.assert_close(st["mean"][0], mu)
    w = m.projection(0, d)
    ref_codes = pack_signs((k[0] - mu[:, None]) @ w, 4, 12)
    assert torch.equal(st["codes"][0, :, :n1], ref_codes)
    # the same selection as an index built at n0 and extended by 30 keys in one call
    jump: dict = {}
    attend(m, qs[n0 - 1], k[:, :, :n0], v[:, :, :n0], state=jump)
    _, a = attend(m, qs[-1], k, v, state=jump)
    _, b = attend(m, qs[-1], k, v, state=state)
    assert torch.equal(a["keep"], b["keep"]) and torch.equal(
        jump["magicpig"]["codes"][:, :, :n1], st["codes"][:, :, :n1]
    )
    # fewer keys than indexed (a cropped cache): rebuilt from scratch with the mean of that cache
    attend(m, qs[49], k[:, :, :50], v[:, :, :50], state=state)
    assert state["magicpig"]["n"] == 50
    torch.testing.assert_close(state["magicpig"]["mean"][0], k[0, :, 4:42].mean(1))
    # a different cache of the same length is re-indexed too
    k2 = k[:, :, :50].flip(2).contiguous()
    attend(m, qs[49], k2, v[:, :, :50], state=state)
    torch.testing.assert_close(state["magicpig"]["mean"][0], k2[0, :, 4:42].mean(1))


def test_left_padded_gqa_batch_equals_each_row_alone():
    g = torch.Generator().manual_seed(13)
    hq, hkv, d, n0, pad, steps = 8, 2, 16, 90, 23, 4
    opts = dict(K=4, L=16, sink=4, local=8, dense_layers=[])
    k = torch.randn(2, hkv, n0 + steps, d, generator=g) + 1.0
    k[1, :, :pad] = 50.0 * torch.randn(hkv, pad, d, generator=g)  # garbage padding must not enter the mean
    v = torch.randn(2, hkv, n0 + steps, d, generator=g)
    qs = torch.randn(steps, 2, hq, 1, d, generator=g)
    m = mp(**opts)
    batch_state, alone_states = {}, [{}, {}]
    for t in range(steps):
        n = n0 + t + 1
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        mask[1, ..., :pad] = False
        out, st = attend(m, qs[t], k[:, :, :n], v[:, :, :n], attention_mask=mask, state=batch_state)
        for row, start in ((0, 0), (1, pad)):
            o1, s1 = attend(
                m,
                qs[t, row : row + 1],
                k[row : row + 1, :, start:n],
                v[row : row + 1, :, start:n],
                state=alone_states[row],
            )
            assert torch.equal(st["keep"][row, :, :, start:], s1["keep"][0])
            assert not st["keep"][row, :, :, :start].any()
            torch.testing.assert_close(out[row], o1[0], rtol=1e-5, atol=1e-6)
            assert s1["sampled"].sum() > 0
            torch.testing.assert_close(st["cost2"][row], s1["cost2"][0])


def _recorded_selections(m: MagicPIG, calls) -> list:
    """The Selections ``m.select`` returns over a sequence of attend calls sharing one index."""
    rec, select = [], m.select
    m.select = lambda ctx: rec.append(select(ctx)) or rec[-1]
    state = {}
    for q, k, v, mask in calls:
        attend(m, q, k, v, attention_mask=mask, state=state, compute_error=False)
    return rec


@pytest.mark.parametrize(
    "opts",
    [
        dict(K=4, L=30),  # many sampled keys
        dict(K=10, L=150),  # the paper's (10, 150)
        dict(K=5, L=24, min_collisions=3, u_offset=1e-4, mips=True),
    ],
)
def test_decode_bias_without_pairs_loop_equals_sampled_pairs(opts):
    """Decoding (rows sharing the index's μ): the Selection of the dense −log u (every candidate key, no host sync)
    and of the Triton counts equals the sampled-pairs loop over the torch reference counts: keep and
    stats exactly, bias within 1e-6 relative; for one-row calls and a 3-row call, GQA, a left-padded row."""
    g = torch.Generator().manual_seed(21)
    b, hq, hkv, d, n0, pad = 2, 8, 2, 16, 120, 17
    k = torch.randn(b, hkv, n0 + 8, d, generator=g) + 0.5
    v = torch.randn(b, hkv, n0 + 8, d, generator=g)
    # queries near some keys, so that (10, 150) samples more than the rare chance collision
    near = k[:, :, torch.randint(0, n0, (hq // hkv,), generator=g)].reshape(b, hq, 1, d)
    calls = []
    for n, ql in ((n0, 1), (n0 + 1, 1), (n0 + 4, 3)):
        q = near.expand(b, hq, ql, d) + 0.3 * torch.randn(b, hq, ql, d, generator=g)
        mask = torch.ones(n, n, dtype=torch.bool).tril()[n - ql :].expand(b, 1, ql, n).clone()
        mask[1, ..., :pad] = False
        calls.append((q, k[:, :, :n], v[:, :, :n], mask))
    base = dict(sink=4, local=8, dense_layers=[], **opts)
    sampled_pairs = mp(**base)
    sampled_pairs.collision_backend, sampled_pairs.dense_bias_elements = "torch", 0
    dense = mp(**base)
    dense.dense_bias_elements = 1 << 40
    if importlib.util.find_spec("triton") is not None:  # the Triton kernel (in its interpreter without CUDA)
        dense.collision_backend = "triton"
    want, got = _recorded_selections(sampled_pairs, calls), _recorded_selections(dense, calls)
    assert len(want) == len(got) == 3
    for a, e in zip(got, want):
        assert torch.equal(a.keep, e.keep) and int(e.keep.sum()) > 0
        assert a.stats.keys() == e.stats.keys()
        for name in e.stats:
            assert torch.equal(a.stats[name], e.stats[name]), name
        assert torch.equal(a.bias == 0, e.bias == 0)  # −log u > 0 for every sampled key (u < 1)
        torch.testing.assert_close(a.bias, e.bias, rtol=1e-6, atol=0.0)


# -- configuration and models ----------------------------------------------------------------------


def test_config_validation_names_bad_values():
    assert mp().config.dense_layers == ["first", "mid"] and (mp().config.K, mp().config.L) == (10, 150)
    for bad, word in (
        ({"gqa": "kv_head"}, "gqa"),
        ({"K": 0}, "K"),
        ({"K": 63}, "K"),
        ({"L": 0}, "L"),
        ({"min_collisions": 0}, "min_collisions"),
        ({"projection_group": 0}, "projection_group"),
        ({"u_offset": -1.0}, "u_offset"),
    ):
        with pytest.raises(ValueError, match=word):
            mp(**bad)
    assert mp().dense_layer_set(32) == {0, 16} and mp().dense_layer_set(5) == {0, 2}
    with pytest.raises(ValueError, match="dense_layers"):
        mp(dense_layers=[0, 16]).validate(num_layers=5)


def test_projection_is_seeded_per_layer_group():
    a, b = mp(projection_group=2, seed=1), mp(projection_group=2, seed=1)
    assert torch.equal(a.projection(0, 8), b.projection(1, 8))  # layers 0, 1 share a matrix
    assert not torch.equal(a.projection(0, 8), a.projection(2, 8))
    assert not torch.equal(a.projection(0, 8), mp(projection_group=2, seed=2).projection(0, 8))
    assert a.projection(3, 8).shape == (8, 1500)


def test_hydra_config_file():
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import register_configs
    from sparse_eval.config import CONF_DIR

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=["method=magicpig", "method.dense_layers=[0,2]", "method.L=75"])
    c = cfg.method
    assert (c.name, c.K, c.L, c.min_collisions, c.center, c.mips, c.sink, c.local) == (
        "magicpig",
        10,
        75,
        2,
        True,
        False,
        4,
        64,
    )
    assert list(c.dense_layers) == [0, 2] and c.projection_group == 1 and c.u_offset == 0.0


@torch.inference_mode()
def test_generate_on_shipped_model(stories):
    model, tok = stories
    ids = tok(
        [
            "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
            "One day, she saw a big red ball and"
        ],
        return_tensors="pt",
    )
    session = attach(model, mp(K=4, L=20, sink=4, local=8, dense_layers=[0, 2]), Runtime(protocol="A"))
    try:
        out = model.generate(
            **ids,
            max_new_tokens=10,
            min_new_tokens=10,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
        )
    finally:
        detach(model)
        model.set_attn_implementation("sdpa")
    s = session.recorder.summary()
    assert out.sequences.shape[1] == ids["input_ids"].shape[1] + 10
    assert all(torch.isfinite(x).all() for x in out.logits)
    assert s["sparse_layers"] == [1, 3, 4] and s["sampled"] > 0 and 0 < s["cost2"] < 1 and s["cost1"] == 0


@torch.inference_mode()
def test_generate_on_random_qwen2_with_padding():
    model = tiny_model("qwen2", layers=3)
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :17] = 0
    session = attach(model, mp(K=5, L=24, sink=2, local=6, dense_layers=[0]))
    kw = dict(
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    try:
        batched = model.generate(ids, attention_mask=mask, **kw)
        alone = model.generate(ids[1:, 17:], **kw)
    finally:
        detach(model)
    s = session.recorder.summary()
    assert batched.sequences.shape == (2, 66)
    assert all(torch.isfinite(x).all() for x in batched.logits)
    assert s["sampled"] > 0 and s["empty_selections"] < s["sparse_rows"]
    assert torch.equal(batched.sequences[1, -6:], alone.sequences[0, -6:])
    for a, b in zip(batched.logits, alone.logits):
        torch.testing.assert_close(a[1], b[0], rtol=1e-4, atol=1e-4)


# -- settings that can never select a key, and runs that mostly do not -------------------------------------


@pytest.mark.parametrize(
    "opts, needle",
    [
        ({"K": 10, "L": 150, "min_collisions": 151}, r"min_collisions=151 > method.L=150.*valid: 1\.\.150"),
        ({"K": 8, "L": 1}, r"min_collisions=2 > method.L=1"),
        ({"K": 40, "L": 150}, r"method.K=40 .*valid: K <= 28 at L=150.*lower method.K"),
        ({"K": 62, "L": 10}, r"method.K=62 .*lower method.K"),
    ],
)
def test_impossible_settings_are_refused_at_start(opts, needle):
    with pytest.raises(ValueError, match=needle):
        build_method(make_config("magicpig", opts))


def test_paper_settings_pass_the_start_check():
    for k, l in ((10, 150), (10, 220), (8, 90), (9, 120), (8, 75)):
        build_method(make_config("magicpig", {"K": k, "L": l}))


def test_high_empty_selection_rate_warns_once_and_is_recorded(tmp_path, caplog):
    import logging

    from hydra import compose, initialize_config_dir

    from sparse_eval.config import CONF_DIR, register_configs
    from sparse_eval.launcher.runner import run

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            config_name="config",
            overrides=[
                f"paths.runs_dir={tmp_path}",
                "method=magicpig",
                "method.K=16",
                "method.L=20",
                "method.dense_layers=[0]",
                "task.window=96",
                "task.num_samples=1",
                "print_table=false",
                "eval.compute_error=false",
            ],
        )
    with caplog.at_level(logging.WARNING, logger="sparse_eval"):
        (summary,) = run(cfg)
    assert summary["empty_selection_rate"] > 0.05
    warned = [r for r in caplog.records if "selected no key of its own" in r.getMessage()]
    assert len(warned) == 1 and summary["warnings"] == [warned[0].getMessage()]
    import json
    from pathlib import Path

    assert json.loads((Path(summary["run_dir"]) / "summary.json").read_text())["warnings"] == summary["warnings"]


def test_sparse_prefill_rows_hash_with_their_own_prefix_mean():
    """Under a sparse prefill (several rows building the index) row t's keys are centered by the mean of its own
    non-static keys: the selection equals a brute-force loop that hashes every key with each row's μ_t."""
    from sparse_eval.methods.core import key_validity, pass_masks
    from sparse_eval.methods.magicpig import collision_counts

    torch.manual_seed(5)
    b, hq, hkv, n, d = 1, 4, 2, 40, 8
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d) + 2.0, torch.randn(b, hkv, n, d)
    opts = dict(K=4, L=20, sink=2, local=4)
    m = build_method(make_config("magicpig", opts))
    _, st = attend(m, q, k, v, compute_error=False)
    masks = pass_masks(key_validity(None, b, n, n, q.device), 2, 4)
    w = m.projection(0, d)
    q_codes = m._hash(q, None, None, w)
    for t in range(n):
        cand = masks.candidates[0, 0, t]  # [N]
        if not cand.any():
            assert not st["keep"][0, :, t].logical_and(cand).any()
            continue
        mu = k[0][:, cand].double().mean(1).float()  # [Hkv, D]
        codes = m._hash(k, mu[None], None, w)  # [1, Hkv, N, L]
        counts = collision_counts(q_codes[:, :, t : t + 1], codes)[0, :, 0]  # [Hq, N]
        want = (counts >= 2) & cand
        assert torch.equal(st["keep"][0, :, t] & cand, want), t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_made_once_terms_are_not_made_during_a_cuda_graph_capture():
    """eq. 10's constants and the code bit values are kept per device after their first use, but a first use
    inside a CUDA graph capture keeps nothing (what a capture makes is computed only when the graph replays)."""
    from sparse_eval.simhash_probability import _pmf_terms

    _pmf_terms.cache_clear()
    dev = torch.device("cuda")
    p = torch.linspace(0.01, 0.99, 257, dtype=torch.float64, device=dev)
    proj = torch.randn(3, 10 * 7, device=dev)
    ref_u, ref_codes = log_sampling_probability(p.cpu(), 7, 33, 2), pack_signs(proj.cpu(), 10, 7)
    _pmf_terms.cache_clear()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        captured_u, captured_codes = log_sampling_probability(p, 7, 33, 2), pack_signs(proj, 10, 7)
    assert _pmf_terms.cache_info().currsize == 0
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(captured_u.cpu(), ref_u, rtol=1e-12, atol=0)
    assert torch.equal(captured_codes.cpu(), ref_codes)
    eager_u, eager_codes = log_sampling_probability(p, 7, 33, 2), pack_signs(proj, 10, 7)  # kept from now on
    assert _pmf_terms.cache_info().currsize == 1
    torch.testing.assert_close(eager_u.cpu(), ref_u, rtol=1e-12, atol=0)
    assert torch.equal(eager_codes.cpu(), ref_codes)
