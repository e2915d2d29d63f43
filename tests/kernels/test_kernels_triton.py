"""Triton kernels (kernels.sparse_decode, kernels.ds, kernels.quest, kernels.magicpig) against their torch
references.

Without CUDA the kernels run in Triton's CPU interpreter: TRITON_INTERPRET=1 is set here, before any kernel is
defined (the kernel modules are imported lazily, on the first ``backend="triton"`` call).  With CUDA the same
tests run the compiled kernels on the GPU, and the ``gpu``-marked tests add larger shapes.  Skips cleanly
without triton.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from sparse_eval.kernels import ds, magicpig, quest, sparse_decode, topk  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# tl.dot runs in tf32 on the GPU (bf16 inputs are exact in tf32, probabilities are not): looser there
TOL = 2e-3 if DEV == "cuda" else 2e-5


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32):
    return torch.randn(*shape, generator=gen).to(device=DEV, dtype=dtype)


def assert_same_topk(sel: torch.Tensor, ref_sel: torch.Tensor, ref_scores: torch.Tensor, tol: float) -> None:
    """Selections [..., k] (−1 = none) agree as sets, up to near-ties: any key in one and not the other must
    score within ``tol`` of the k-th best reference score of its row."""
    sel, ref_sel, ref_scores = sel.cpu(), ref_sel.cpu(), ref_scores.cpu()
    assert sel.shape == ref_sel.shape
    rows_a = sel.reshape(-1, sel.shape[-1])
    rows_b = ref_sel.reshape(-1, sel.shape[-1])
    scores = ref_scores.reshape(-1, ref_scores.shape[-1])
    for a, b, s in zip(rows_a, rows_b, scores):
        sa = {int(x) for x in a if x >= 0}
        sb = {int(x) for x in b if x >= 0}
        assert len(sa) == len(a[a >= 0]), "duplicate selection"
        if sa == sb:
            continue
        kth = torch.sort(s[list(sb)]).values[0] if sb else float("-inf")
        for x in sa ^ sb:
            assert abs(float(s[x]) - float(kth)) <= tol * max(1.0, abs(float(kth))), (x, float(s[x]), float(kth))


# ----------------------------------------------------------------------------------------- sparse decode
@pytest.mark.parametrize(
    "b,hq,hkv,n,d,s,shared,dtype",
    [
        (2, 8, 2, 300, 64, 50, False, torch.float32),  # per-query-head selection, GQA 4
        (2, 8, 2, 300, 64, 70, True, torch.bfloat16),  # shared per KV group
        (1, 4, 4, 200, 32, 33, False, torch.float16),  # MHA
        (3, 6, 1, 150, 48, 40, True, torch.float32),  # MQA, head dim not a power of two
    ],
)
def test_sparse_decode_matches_reference(b, hq, hkv, n, d, s, shared, dtype):
    gen = _gen(hash((b, hq, hkv, n, d, s, shared)) & 0xFFFF)
    q = _randn(b, hq, d, gen=gen, dtype=dtype)
    k = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    v = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    hi = hkv if shared else hq
    idx = torch.randint(0, n, (b, hi, s), generator=gen, dtype=torch.int32)
    idx[:, :, -5:] = -1  # padding
    idx[0, 0, :] = -1  # an empty row
    idx = idx.to(DEV)
    count = torch.randint(0, s + 1, (b, hi), generator=gen).to(DEV)
    for cnt, splits in ((None, None), (None, 1), (count, 3)):  # auto split plan, one program per row, 3 splits
        o, lse = sparse_decode.attention(
            q, k, v, idx, count=cnt, backend="triton", num_splits=splits, out_dtype=torch.float32, block_n=16
        )
        o_ref, lse_ref = sparse_decode.attention_reference(q, k, v, idx, count=cnt, out_dtype=torch.float32)
        assert torch.isfinite(o).all()
        assert torch.equal(torch.isinf(lse), torch.isinf(lse_ref))
        fin = torch.isfinite(lse_ref)
        assert torch.allclose(lse[fin], lse_ref[fin], atol=TOL * 10, rtol=TOL)
        assert _rel(o, o_ref) < TOL * 10
        assert (o[~fin] == 0).all()  # empty rows: o = 0, lse = -inf


def test_sparse_decode_strided_cache_and_default_dtype():
    """A [B, N, Hkv, D] cache passed as a transposed view; output in q's dtype."""
    gen = _gen(7)
    b, hq, hkv, n, d, s = 2, 4, 2, 120, 32, 24
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    k = _randn(b, n, hkv, d, gen=gen, dtype=torch.bfloat16).transpose(1, 2)
    v = _randn(b, n, hkv, d, gen=gen, dtype=torch.bfloat16).transpose(1, 2)
    idx = torch.randint(0, n, (b, hq, s), generator=gen).to(DEV)  # int64 indices
    o, lse = sparse_decode.attention(q, k, v, idx, backend="triton")
    o_ref, lse_ref = sparse_decode.attention_reference(q, k.contiguous(), v.contiguous(), idx)
    assert o.dtype == torch.bfloat16
    assert _rel(o.float(), o_ref.float()) < 1e-2  # both rounded to bf16 at the end
    assert torch.allclose(lse, lse_ref, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("b,hq,hkv,n,d,dtype", [(3, 8, 2, 300, 64, torch.bfloat16), (2, 4, 4, 130, 48, torch.float32)])
def test_dense_decode_over_row_lengths_matches_sdpa(b, hq, hkv, n, d, dtype):
    """Dense attention over the first lengths[b] keys of a preallocated cache equals sdpa over those keys alone
    (rows of different lengths, one of them the whole capacity, one a single key)."""
    gen = _gen(11 + n)
    q = _randn(b, hq, d, gen=gen, dtype=dtype)
    k = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    v = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    lengths = torch.tensor([n, 1, n // 3][:b], dtype=torch.int32, device=DEV)
    for splits in (None, 1, 3):
        o, lse = sparse_decode.dense_attention(
            q, k, v, lengths, backend="triton", num_splits=splits, block_n=16, out_dtype=torch.float32
        )
        for i, m in enumerate(lengths.tolist()):
            g = hq // hkv
            kk = k[i, :, :m].float().repeat_interleave(g, 0)
            vv = v[i, :, :m].float().repeat_interleave(g, 0)
            ref = torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], kk, vv)[:, 0]
            s = torch.einsum("hd,hnd->hn", q[i].float(), kk) / d**0.5
            assert _rel(o[i], ref) < TOL * 10
            assert torch.allclose(lse[i], torch.logsumexp(s, -1), atol=TOL * 10, rtol=TOL)
    o_ref, lse_ref = sparse_decode.dense_attention_reference(q, k, v, lengths, out_dtype=torch.float32)
    assert _rel(o, o_ref) < TOL * 10


def test_dense_decode_rejects_bad_lengths():
    q = torch.zeros(2, 4, 8)
    k = torch.zeros(2, 2, 10, 8)
    with pytest.raises(ValueError, match="lengths"):
        sparse_decode.dense_attention(q, k, k, torch.ones(3, dtype=torch.int32))


def test_sparse_decode_rejects_bad_shapes():
    q = torch.zeros(1, 4, 8)
    k = torch.zeros(1, 2, 10, 8)
    with pytest.raises(ValueError, match="idx"):
        sparse_decode.attention(q, k, k, torch.zeros(1, 3, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match="dtype"):
        sparse_decode.attention(q, k, k, torch.zeros(1, 4, 5))
    with pytest.raises(ValueError, match="backend"):
        sparse_decode.attention(q, k, k, torch.zeros(1, 4, 5, dtype=torch.int32), backend="cuda")


# ----------------------------------------------------------------------------------------- Double Sparsity
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("per_query_head_labels", [False, True])
def test_label_scores_match_reference(bits, per_query_head_labels):
    gen = _gen(bits * 10 + per_query_head_labels)
    b, hq, hkv, n, d, r = 2, 8, 2, 200, 64, 8
    hl = hq if per_query_head_labels else hkv
    k = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    channels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(hl)])
    cache = ds.build_label_cache(k, channels, bits)
    q_label = ds.gather_query_channels(q, channels)
    lengths = torch.tensor([n, n - 37], device=DEV)
    for reduce in (False, True):
        got = ds.label_scores(q_label, cache, reduce=reduce, lengths=lengths, backend="triton", block_n=128)
        ref = ds.label_scores_reference(q_label, cache, reduce=reduce, lengths=lengths)
        assert got.shape == ref.shape == (b, hl if reduce else hq, n)
        fin = torch.isfinite(ref)
        assert torch.equal(fin, torch.isfinite(got))
        assert fin.sum() == (2 * n - 37) * got.shape[1]
        assert torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("bits,scale_dtype", [(4, torch.float16), (4, torch.float32), (8, torch.float16), (16, None)])
def test_append_and_query_labels_are_bit_identical(bits, scale_dtype):
    """One-launch label work of a decode step (the new key's labels written at a device position; the query's
    pseudo-quantized label channels) equals its torch reference exactly, including a constant key row."""
    gen = _gen(bits)
    b, hkv, hq, d, r, cap = 2, 2, 8, 32, 8, 12
    k_new = _randn(b, hkv, 1, d, gen=gen, dtype=torch.bfloat16)
    k_new[1, 0] = 0.5  # max == min: scale 0, codes 0
    channels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(hkv * 2)]).to(DEV)  # Hl = 2·Hkv
    kv_of = (torch.arange(hkv * 2) // 2).to(DEV)
    pos = torch.tensor([5], device=DEV)
    width = r // 2 if bits == 4 else r
    dt = torch.bfloat16 if bits == 16 else torch.uint8
    caches = []
    for backend in ("triton", "torch"):
        codes = torch.zeros(b, 2 * hkv, cap, width, dtype=dt, device=DEV)
        sc = None if bits == 16 else torch.zeros(b, 2 * hkv, cap, dtype=scale_dtype, device=DEV)
        ze = None if bits == 16 else torch.zeros_like(sc)
        ds.append_labels(k_new, channels, kv_of, codes, sc, ze, pos, bits, backend=backend)
        caches.append((codes, sc, ze))
    for got, ref in zip(caches[0], caches[1]):
        if ref is not None:
            assert torch.equal(got, ref)
    assert caches[0][0][:, :, 5].abs().sum() > 0 and caches[0][0][:, :, 4].abs().sum() == 0
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    q[0, 3] = 1.0  # a constant label row
    q_ch = channels.repeat_interleave(hq // (2 * hkv), 0)
    for quant in (True, False):
        got = ds.query_labels(q, q_ch, bits, quant, backend="triton")
        assert torch.equal(got, ds.query_labels_reference(q, q_ch, bits, quant))


def _values_of(scores, sel):
    """Per row, the sorted scores of the selected positions (−1 = none), and the positions as a set."""
    rows_s = scores.reshape(-1, scores.shape[-1]).cpu()
    out = []
    for s, row in zip(rows_s, sel.reshape(-1, sel.shape[-1]).cpu()):
        ids = row[row >= 0]
        assert len(set(ids.tolist())) == len(ids), "duplicate selection"
        k = len(ids)
        assert (row[:k] >= 0).all() and (row[k:] == -1).all(), "selections first, then −1 padding"
        out.append(sorted(s[ids.long()].tolist()))
    return out


@pytest.mark.parametrize("radix_bits, atomic_from", [(4, 2), (8, 2), (8, 99)])
def test_topk_select_matches_sorted_topk(radix_bits, atomic_from):
    """The radix-select top-k picks keys of exactly the same scores as torch.topk (equal sets up to ties), per-row
    budgets from a device tensor, −inf never picked, ties broken towards lower positions across tiles, positions
    in increasing order, −1 padding (also with more slots than scores)."""
    gen = _gen(5)
    s = torch.randn(2, 3, 150, generator=gen)
    s[0, 0] = torch.round(s[0, 0] * 2) / 2  # many ties at the threshold
    s[0, 1, :20] = 0.0  # +0.0 / −0.0 and equal values
    s[0, 1, 20:40] = -0.0
    s[1, :, 100:] = float("-inf")  # masked tail
    s = s.to(DEV)
    count = torch.randint(1, 30, (2, 3), generator=gen)
    count[1, 2] = 140  # more than the finite scores: 100 picked
    count = count.to(DEV)
    for k_max, cnt in ((25, None), (200, None), (150, count)):
        got = topk.select(
            s,
            k_max,
            cnt,
            backend="triton",
            radix_bits=radix_bits,
            block_n=64,  # 3 tiles per row
            atomic_from=atomic_from,
        )  # per-key atomics from that pass on, or tile histograms only
        ref = topk.select_reference(s, k_max, cnt)
        assert got.shape == ref.shape == (2, 3, k_max) and got.dtype == torch.int32
        assert _values_of(s, got) == _values_of(s, ref)
        for row in got.reshape(-1, k_max).cpu():
            ids = row[row >= 0]
            assert (ids[1:] > ids[:-1]).all(), "positions in increasing order"
    assert int((got[1, 2] >= 0).sum()) == 100
    tie_row = got[0, 0][: int(count[0, 0])].cpu()
    thr = s[0, 0].cpu()[tie_row.long()].min()
    at_thr = (s[0, 0].cpu() == thr).nonzero().flatten()
    taken = sorted(int(i) for i in tie_row if s[0, 0, int(i)] == thr)
    assert taken == at_thr[: len(taken)].tolist()  # the lowest positions among the ties
    with pytest.raises(ValueError, match="count"):
        topk.select(s, 5, torch.ones(3, dtype=torch.int32, device=DEV))


@pytest.mark.parametrize("bits", [8, 4])
def test_label_quantization_round_trip(bits):
    """Dequantised labels are within half a quantisation step (+ fp16 rounding of scale/zero) of the input."""
    gen = _gen(bits)
    x = torch.randn(2, 3, 50, 16, generator=gen)
    cache = ds.quantize_labels(x, bits)
    assert cache.labels.dtype == torch.uint8
    assert cache.labels.shape[-1] == (8 if bits == 4 else 16)
    y = ds.dequantize_labels(cache)
    step = cache.scale.float().unsqueeze(-1)
    assert ((y - x).abs() <= 0.5 * step + 2e-2 * x.abs().amax(-1, keepdim=True)).all()
    assert cache.nbytes() < x.numel() * 2  # smaller than a 16-bit cache
    with pytest.raises(ValueError, match="bits"):
        ds.quantize_labels(x, 3)
    with pytest.raises(ValueError, match="even"):
        ds.quantize_labels(x[..., :5], 4)


@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
@pytest.mark.parametrize("bits", [16, 4])
def test_ds_decode_selects_reference_keys(gqa, bits):
    gen = _gen(hash((gqa, bits)) & 0xFFFF)
    b, hq, hkv, n, d, r, budget = 2, 8, 2, 256, 64, 8, 32
    k = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    v = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    channels = torch.stack([torch.randperm(d, generator=gen)[:r] for _ in range(hkv)])
    cache = ds.build_label_cache(k, channels, bits)
    o, lse, idx = ds.decode(q, k, v, cache, channels, budget, gqa=gqa, backend="triton")
    o_ref, lse_ref, idx_ref = ds.decode_reference(q, k, v, cache, channels, budget, gqa=gqa)
    q_label = ds.gather_query_channels(q, channels)
    scores = ds.label_scores_reference(q_label, cache, reduce=gqa == "kv_head")
    assert idx.shape == idx_ref.shape == (b, hkv if gqa == "kv_head" else hq, budget)
    assert_same_topk(idx, idx_ref, scores, 1e-4)
    # attention over the kernel's own selection equals the reference attention over it
    o2, lse2 = sparse_decode.attention_reference(q, k, v, idx, out_dtype=torch.float32)
    assert _rel(o.float(), o2) < 1e-2
    assert torch.allclose(lse, lse2, atol=1e-3, rtol=1e-4)


# ----------------------------------------------------------------------------------------- Quest
def test_page_metadata_bounds_every_key():
    gen = _gen(3)
    k = torch.randn(2, 3, 45, 16, generator=gen).to(torch.bfloat16)
    kmin, kmax = quest.page_metadata(k, 8)
    assert kmin.shape == (2, 3, 6, 16)
    for p in range(6):
        page = k[:, :, p * 8 : (p + 1) * 8]
        assert torch.equal(kmin[:, :, p], page.amin(2))
        assert torch.equal(kmax[:, :, p], page.amax(2))
    # U(P) is an upper bound of q·k over the page (Quest §3.3)
    q = torch.randn(2, 6, 16, generator=gen)
    u = quest.page_scores_reference(q, kmin, kmax)
    s = torch.einsum("bhd,bhnd->bhn", q, k.float().repeat_interleave(2, 1))
    for p in range(6):
        assert (s[:, :, p * 8 : (p + 1) * 8].amax(-1) <= u[:, :, p] + 1e-4).all()


@pytest.mark.parametrize("reduce", [False, True])
def test_page_scores_match_reference(reduce):
    gen = _gen(11 + reduce)
    b, hq, hkv, n, d, ps = 2, 8, 2, 300, 64, 16
    k = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    kmin, kmax = quest.page_metadata(k, ps)
    n_pages = torch.tensor([19, 10], device=DEV)
    got = quest.page_scores(q, kmin, kmax, reduce=reduce, n_pages=n_pages, backend="triton", block_p=8)
    ref = quest.page_scores_reference(q, kmin, kmax, reduce=reduce, n_pages=n_pages)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(got))
    assert torch.allclose(got[fin], ref[fin], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
def test_quest_decode_selects_reference_pages(gqa):
    gen = _gen(5 if gqa == "kv_head" else 6)
    b, hq, hkv, n, d, ps, n_sel = 2, 8, 2, 200, 32, 16, 4  # 13 pages, the last partial
    k = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    v = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    kmin, kmax = quest.page_metadata(k, ps)
    o, lse, idx = quest.decode(q, k, v, kmin, kmax, ps, n_sel, gqa=gqa, backend="triton")
    o_ref, lse_ref, idx_ref = quest.decode_reference(q, k, v, kmin, kmax, ps, n_sel, gqa=gqa)
    scores = quest.page_scores_reference(q, kmin, kmax, reduce=gqa == "kv_head")
    pages = torch.where(idx[..., ::ps] >= 0, idx[..., ::ps] // ps, -1)
    pages_ref = torch.where(idx_ref[..., ::ps] >= 0, idx_ref[..., ::ps] // ps, -1)
    assert_same_topk(pages, pages_ref, scores, 1e-4)
    assert ((idx >= -1) & (idx < n)).all()
    o2, lse2 = sparse_decode.attention_reference(q, k, v, idx, out_dtype=torch.float32)
    assert _rel(o.float(), o2) < 1e-2
    assert torch.allclose(lse, lse2, atol=1e-3, rtol=1e-4)


def test_pages_to_tokens_masks_partial_page():
    pages = torch.tensor([[[2, 0, -1]]])
    tok = quest.pages_to_tokens(pages, 4, 10)
    assert tok.tolist() == [[[8, 9, -1, -1, 0, 1, 2, 3, -1, -1, -1, -1]]]


# ----------------------------------------------------------------------------------------- MagicPIG (GPU part)
@pytest.mark.parametrize("k_bits,n_tables,d", [(10, 20, 64), (4, 37, 48), (16, 3, 128)])
def test_hash_codes_match_reference(k_bits, n_tables, d):
    gen = _gen(k_bits * 100 + n_tables)
    w = magicpig.random_projections(d, k_bits, n_tables, seed=k_bits).to(DEV)
    x = _randn(3, 5, d, gen=gen)
    got = magicpig.hash_codes(x, w, k_bits, n_tables, backend="triton")
    ref = magicpig.hash_codes_reference(x, w, k_bits, n_tables)
    assert got.shape == (3, 5, n_tables) and got.dtype == torch.int32
    assert int(got.min()) >= 0 and int(got.max()) < (1 << k_bits)
    if not torch.equal(got, ref):  # only a projection within rounding of zero may flip its bit
        proj = (x.double() @ w.double()).view(3, 5, n_tables, k_bits)
        bits_diff = ((got ^ ref).unsqueeze(-1) >> torch.arange(k_bits, device=DEV)) & 1
        assert (proj.abs()[bits_diff.bool()] < 1e-4).all()


def test_hash_codes_bit_layout():
    """Bit j of table l is the sign of x · W[:, l·K + j]."""
    d, k_bits, n_tables = 16, 3, 2
    w = torch.zeros(d, k_bits * n_tables)
    w[0, 0] = 1.0  # table 0, bit 0: +x0
    w[1, 2] = -1.0  # table 0, bit 2: -x1
    w[2, 4] = 1.0  # table 1, bit 1: +x2
    x = torch.zeros(1, d)
    x[0, 0], x[0, 1], x[0, 2] = 1.0, -1.0, 1.0
    ref = magicpig.hash_codes_reference(x, w, k_bits, n_tables)
    assert ref.tolist() == [[0b101, 0b010]]
    got = magicpig.hash_codes(x.to(DEV), w.to(DEV), k_bits, n_tables, backend="triton")
    assert got.cpu().tolist() == [[0b101, 0b010]]


def _codes_with_collisions(b, hq, hkv, ql, n, n_tables, k_bits, gen, dtype=torch.int16):
    """Random K-bit codes where about half of each key's tables copy its group's first query row (so the counts
    span 0..L, not only the few chance collisions of K = 10)."""
    qc = torch.randint(0, 1 << k_bits, (b, hq, ql, n_tables), generator=gen).to(dtype)
    kc = torch.randint(0, 1 << k_bits, (b, hkv, n, n_tables), generator=gen).to(torch.int16)
    g = hq // hkv
    copy = torch.rand(b, hkv, n, n_tables, generator=gen) < 0.5
    src = qc[:, ::g, :1].to(torch.int16).expand(b, hkv, n, n_tables)
    kc = torch.where(copy, src, kc)
    return qc.to(DEV), kc.to(DEV)


@pytest.mark.parametrize(
    "b,hq,hkv,ql,n,n_tables,k_bits,qdtype",
    [
        (2, 4, 2, 1, 70, 150, 10, torch.int16),  # decode, G = 2, L = 150, N not a multiple of the block
        (1, 8, 2, 3, 33, 150, 10, torch.int16),  # G = 4, Q = 3: 12 rows
        (2, 6, 2, 2, 129, 20, 3, torch.int32),  # int32 query codes (hash_codes), G·Q = 6 (not a power of 2)
        (1, 2, 2, 1, 5, 1, 1, torch.int16),  # L = 1, N < a block
        (1, 32, 1, 1, 40, 9, 2, torch.int16),  # G = 32: rows in two blocks
    ],
)
def test_collision_counts_match_reference(b, hq, hkv, ql, n, n_tables, k_bits, qdtype):
    qc, kc = _codes_with_collisions(b, hq, hkv, ql, n, n_tables, k_bits, _gen(n * 7 + hq), qdtype)
    got = magicpig.collision_counts(qc, kc, backend="triton")
    ref = magicpig.collision_counts_reference(qc, kc)
    assert got.dtype == torch.int16 and got.shape == (b, hq, ql, n)
    assert torch.equal(got, ref)
    assert int(ref.max()) > n_tables // 3  # the planted collisions are counted
    brute = (qc.reshape(b, hkv, hq // hkv * ql, 1, n_tables).long() == kc[:, :, None].long()).sum(-1)
    assert torch.equal(got.long(), brute.reshape(b, hq, ql, n))


def test_collision_counts_strided_key_codes():
    """The index's codes are a prefix view of a larger buffer ([:, :, :n] of the capacity): strides honoured."""
    qc, kc = _codes_with_collisions(2, 4, 2, 1, 100, 30, 4, _gen(3))
    view = kc[:, :, :61]
    assert not view.is_contiguous()
    assert torch.equal(
        magicpig.collision_counts(qc, view, backend="triton"), magicpig.collision_counts_reference(qc, view)
    )


def test_collision_counts_rejects_bad_shapes():
    qc = torch.zeros(1, 3, 1, 8, dtype=torch.int16)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        magicpig.collision_counts(qc, torch.zeros(1, 2, 4, 8, dtype=torch.int16), backend="torch")
    with pytest.raises(ValueError, match="L must agree"):
        magicpig.collision_counts(qc, torch.zeros(1, 3, 4, 7, dtype=torch.int16), backend="torch")
    with pytest.raises(ValueError, match="backend"):
        magicpig.collision_counts(qc, torch.zeros(1, 3, 4, 8, dtype=torch.int16), backend="cuda")


# ----------------------------------------------------------------------------------------- GPU sizes
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_llama_shape_ds_and_quest():
    """Llama-3.1-8B attention shape (32 q heads, 8 KV heads, d = 128, bf16), 8K context, α = β = 1/16."""
    gen = _gen(0)
    b, hq, hkv, n, d = 4, 32, 8, 8192, 128
    k = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    v = _randn(b, hkv, n, d, gen=gen, dtype=torch.bfloat16)
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    channels = torch.stack([torch.randperm(d, generator=gen)[: d // 16] for _ in range(hkv)])
    for bits in (16, 8, 4):
        cache = ds.build_label_cache(k, channels, bits)
        for gqa in ("query_head", "kv_head"):
            o, lse, idx = ds.decode(q, k, v, cache, channels, n // 16, gqa=gqa)
            o2, lse2 = sparse_decode.attention_reference(q, k, v, idx, out_dtype=torch.float32)
            assert _rel(o.float(), o2) < 1e-2
            assert torch.allclose(lse, lse2, atol=1e-2, rtol=1e-3)
    kmin, kmax = quest.page_metadata(k, 16)
    o, lse, idx = quest.decode(q, k, v, kmin, kmax, 16, n // 16 // 16)
    o2, lse2 = sparse_decode.attention_reference(q, k, v, idx, out_dtype=torch.float32)
    assert _rel(o.float(), o2) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_llama_shape_collision_counts():
    """Llama-3.1-8B's heads (32 query, 8 KV) at (K, L) = (10, 150), 16K keys (a prefix view of a larger index),
    batch 8, decode and a 5-row call: the kernel's counts equal the reference's."""
    for ql in (1, 5):
        qc, kc = _codes_with_collisions(8, 32, 8, ql, 16384 + 40, 150, 10, _gen(ql))
        view = kc[:, :, : 16384 + 17]
        got = magicpig.collision_counts(qc, view, backend="triton")
        assert torch.equal(got, magicpig.collision_counts_reference(qc, view))


def test_kernels_compile_for_hopper_without_spills():
    """Ahead-of-time compile of the default launch configurations for sm_90 (no GPU needed): catches errors the
    interpreter cannot see, and register spills (python -m sparse_eval.kernels._aot_check)."""
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run(
        [sys.executable, "-m", "sparse_eval.kernels._aot_check"],
        cwd=Path(__file__).resolve().parents[2],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_attend_and_merge_matches_reference():
    """The fused static-keys attention + LSE merge (MagicPIG's GPU part) equals attention over the concatenated
    parts merged by ``merge_by_lse``: GQA, a window that is a strided view of a larger buffer, parts longer than a
    block, an empty first part, and an empty other part whose o is NaN (it must not leak)."""
    from sparse_eval.kernels import merge

    gen = _gen(21)
    b, hq, hkv, d = 2, 8, 2, 64
    q = _randn(b, hq, d, gen=gen, dtype=torch.bfloat16)
    sink_k, sink_v = (_randn(b, hkv, 4, d, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    buf_k, buf_v = (_randn(b, hkv, 90, d, gen=gen, dtype=torch.bfloat16) for _ in range(2))
    o_other = _randn(b, hq, d, gen=gen)
    lse_other = _randn(b, hq, gen=gen) * 3
    lse_other[1, 2:] = float("-inf")  # no sampled keys for these rows
    o_other[1, 2:] = float("nan")
    for k1, v1, k2, v2 in (
        (sink_k, sink_v, buf_k[:, :, 7:77], buf_v[:, :, 7:77]),
        (sink_k[:, :, :0], sink_v[:, :, :0], buf_k[:, :, 3:20], buf_v[:, :, 3:20]),
        (sink_k, sink_v, buf_k[:, :, :0], buf_v[:, :, :0]),
    ):
        got_o, got_l = merge.attend_and_merge(q, k1, v1, k2, v2, o_other, lse_other, 0.125, backend="triton")
        ref_o, ref_l = merge.attend_and_merge_reference(q, k1, v1, k2, v2, o_other, lse_other, 0.125)
        assert torch.isfinite(got_o).all() and torch.isfinite(got_l).all()
        torch.testing.assert_close(got_o.cpu(), ref_o.cpu(), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_l.cpu(), ref_l.cpu(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="empty"):
        merge.attend_and_merge(
            q, sink_k[:, :, :0], sink_v[:, :, :0], buf_k[:, :, :0], buf_v[:, :, :0], o_other, lse_other, 0.125
        )


# ----------------------------------------------------------------------------------------- selected attention
def _selected_inputs(b, hq, hkv, ql, n, d, dtype, gen, pads=None, shared=False, density=0.15):
    """q, k, v, valid [B, 1, Q, N] (causal, bottom-right; row i left-padded by pads[i]), fp32 scores (−inf where
    not valid), keep ⊆ valid [B, Hq or Hkv, Q, N] (a key always kept per row) and a bias."""
    q = _randn(b, hq, ql, d, gen=gen, dtype=dtype)
    k = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    v = _randn(b, hkv, n, d, gen=gen, dtype=dtype)
    rows = torch.arange(ql).view(ql, 1) + (n - ql)
    valid = (torch.arange(n).view(1, n) <= rows).view(1, 1, ql, n).repeat(b, 1, 1, 1)
    for i, p in enumerate(pads or []):
        valid[i, :, :, :p] = False
    valid = valid.to(DEV)
    g = hq // hkv
    s = (q.float() @ k.float().repeat_interleave(g, 1).transpose(-1, -2)) / d**0.5
    s = s.masked_fill(~valid, float("-inf"))
    hs = hkv if shared else hq
    keep = (torch.rand(b, hs, ql, n, generator=gen) < density).to(DEV) & valid
    keep[..., -1] = True  # the newest key (valid for every row)
    bias = (torch.randn(b, hq, ql, n, generator=gen) * 2).to(DEV)
    return q, k, v, valid, s, keep, bias


@pytest.mark.parametrize(
    "dtype,shared,ql,with_scores,dense,with_bias",
    [
        (torch.float32, False, 1, True, True, True),  # the accuracy path's decode call (error on)
        (torch.float32, False, 1, True, False, True),  # error off
        (torch.float32, True, 3, True, True, False),  # one selection per KV group, 3 query rows
        (torch.float32, False, 2, False, True, True),  # q·k taken in the kernel, over a valid mask
        (torch.bfloat16, False, 1, False, False, False),
    ],
)
def test_selected_attention_matches_reference(dtype, shared, ql, with_scores, dense, with_bias):
    """The fused attention over a selection with a logit correction, and the dense statistics of the same pass (kept
    mass, est_error, top-k recall hits, the dense output), against the torch reference: rows over several splits
    (``split=64``), a left-padded row, GQA 4."""
    from sparse_eval.kernels import selected_attention as sa
    from sparse_eval.kernels import topk as tk

    gen = _gen(31 + ql)
    b, hq, hkv, n, d = 2, 8, 2, 200, 32
    q, k, v, valid, s, keep, bias = _selected_inputs(b, hq, hkv, ql, n, d, dtype, gen, pads=[0, 37], shared=shared)
    kw = dict(bias=bias if with_bias else None, dense=dense)
    kw.update(scores=s) if with_scores else kw.update(valid=valid)
    if with_scores and dense:
        kept = keep.expand(b, hq, ql, n) if not shared else keep.repeat_interleave(hq // hkv, 1)
        kw["kth"] = tk.kth_largest(s, kept.sum(-1), backend="triton")
        assert torch.equal(kw["kth"], tk.kth_largest_reference(s, kept.sum(-1)))
    got = sa.attention(q, k, v, keep, backend="triton", split=64, **kw)
    ref = sa.attention_reference(q, k, v, keep, **kw)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert got.o.dtype == dtype and got.o.shape == (b, hq, ql, d)
    assert _rel(got.o.float(), ref.o.float()) < tol
    assert torch.allclose(got.lse, ref.lse, atol=1e-4, rtol=1e-5)
    assert torch.equal(got.kept, ref.kept)
    if dense:
        assert _rel(got.o_dense.float(), ref.o_dense.float()) < tol
        assert torch.allclose(got.lse_dense, ref.lse_dense, atol=1e-4, rtol=1e-5)
        assert torch.allclose(got.mass, ref.mass, atol=1e-6, rtol=1e-5)
        assert torch.allclose(got.est_error, ref.est_error, atol=1e-5, rtol=1e-4 if dtype == torch.float32 else 3e-2)
        if "kth" in kw:
            assert torch.equal(got.hits, ref.hits)
    else:
        assert got.o_dense is None and got.mass is None and got.est_error is None


def _left_padded_batch(alone: list[tuple], n: int) -> list[torch.Tensor]:
    """Rows made alone by ``_selected_inputs`` (batch 1, each its own key count) left-padded to n keys and stacked:
    K and V padded with 7.0 (it would show if a padding key entered), valid and keep with False, scores with −inf,
    the bias with 3.0."""
    fills = {1: 7.0, 2: 7.0, 3: False, 4: float("-inf"), 5: False, 6: 3.0}
    out = []
    for j in range(7):
        xs = [a[j] for a in alone]
        if j in (1, 2):  # [1, Hkv, m, D]
            xs = [torch.nn.functional.pad(x, (0, 0, n - x.shape[2], 0), value=fills[j]) for x in xs]
        elif j >= 3:  # [1, H, Q, m]
            xs = [torch.nn.functional.pad(x, (n - x.shape[-1], 0), value=fills[j]) for x in xs]
        out.append(torch.cat(xs, 0))
    return out


@pytest.mark.parametrize("with_scores", [True, False])
def test_selected_attention_is_batch_invariant(with_scores):
    """Row i computed alone (its own key count) and inside a left-padded batch of 4 is bit for bit the same: output,
    lse, dense output, mass, est_error, hits; splits of a fixed size laid from the end of the keys, merged in order.
    The padding keys hold values that would show if they entered (7.0)."""
    from sparse_eval.kernels import selected_attention as sa
    from sparse_eval.kernels import topk as tk

    gen = _gen(41)
    lengths = [130, 200, 77, 191]
    alone = [_selected_inputs(1, 8, 2, 1, m, 32, torch.float32, gen) for m in lengths]
    batch = _left_padded_batch(alone, max(lengths))

    def run(q, k, v, valid, s, keep, bias):
        kw = dict(bias=bias, dense=True)
        if with_scores:
            kw.update(scores=s, kth=tk.kth_largest(s, keep.sum(-1), backend="triton"))
        else:
            kw.update(valid=valid)
        return sa.attention(q, k, v, keep, backend="triton", split=64, **kw)

    together = run(*batch)
    for i in range(len(lengths)):
        one = run(*alone[i])
        for f in ("o", "lse", "kept", "o_dense", "lse_dense", "mass", "est_error") + (("hits",) if with_scores else ()):
            assert torch.equal(getattr(one, f)[0], getattr(together, f)[i]), (i, f)


def test_selected_attention_indexed_matches_reference_and_is_batch_invariant():
    """The index form: per-entry bias, per-query-head and per-group lists, counts, −1 padding, scores read at the
    listed keys; a row alone and in a batch with longer lists (more splits) gives the same bits."""
    from sparse_eval.kernels import selected_attention as sa

    gen = _gen(43)
    b, hq, hkv, n, d = 3, 8, 2, 150, 32
    q = _randn(b, hq, d, gen=gen)
    k = _randn(b, hkv, n, d, gen=gen)
    v = _randn(b, hkv, n, d, gen=gen)
    s = (q[:, :, None] @ k.repeat_interleave(4, 1).transpose(-1, -2))[:, :, 0] / d**0.5
    for shared in (False, True):
        hi = hkv if shared else hq
        idx = torch.randint(0, n, (b, hi, 140), generator=gen, dtype=torch.int32)
        idx[:, :, -9:] = -1
        count = torch.randint(40, 140, (b, hi), generator=gen, dtype=torch.int32)
        count[0, 0] = 0  # an empty row
        idx, count = idx.to(DEV), count.to(DEV)
        bias = _randn(b, hq, 140, gen=gen)
        for scores in (None, s):
            kw = dict(count=count, bias=bias, scores=scores)
            got = sa.attention_indexed(q, k, v, idx, backend="triton", split=64, **kw)
            ref = sa.attention_indexed_reference(q, k, v, idx, **kw)
            assert _rel(got.o, ref.o) < 2e-5 and torch.equal(got.kept, ref.kept)
            fin = torch.isfinite(ref.lse)
            assert torch.equal(fin, torch.isfinite(got.lse)) and torch.allclose(got.lse[fin], ref.lse[fin], atol=1e-4)
            # row 1 alone, its list cut at its longest count (fewer splits): the same bits
            m = int(count[1].max())
            one = sa.attention_indexed(
                q[1:2],
                k[1:2],
                v[1:2],
                idx[1:2, :, :m],
                backend="triton",
                split=64,
                count=count[1:2],
                bias=bias[1:2, :, :m],
                scores=None if scores is None else scores[1:2],
            )
            assert torch.equal(one.o[0], got.o[1]) and torch.equal(one.lse[0], got.lse[1])


def test_kth_largest_matches_the_sorted_row():
    """Top-k recall's threshold without a sort: ties, −inf tails, count 1 and count = every finite key."""
    gen = _gen(47)
    s = torch.randn(3, 4, 300, generator=gen)
    s[0, 0] = torch.round(s[0, 0] * 2) / 2
    s[1, :, 250:] = float("-inf")
    count = torch.randint(1, 250, (3, 4), generator=gen)
    count[0, 1], count[1, 2] = 1, 250
    s, count = s.to(DEV), count.to(DEV)
    assert torch.equal(topk.kth_largest(s, count, backend="triton"), topk.kth_largest_reference(s, count))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("with_scores", [True, False])
def test_gpu_selected_attention_llama_shape(with_scores):
    """Llama-3.1-8B attention shape, bf16, the default split (1,024 keys): close to the reference, and row i alone
    (its own length, 3-9K keys) bit for bit the same as inside a left-padded batch of 4 (compiled kernels; lengths
    alone and in the batch that differ in divisibility by 16)."""
    from sparse_eval.kernels import selected_attention as sa

    gen = _gen(53)
    hq, hkv, d = 32, 8, 128
    # alone, rows 0 and 3 have key counts divisible by 16 and the batch's (9,000) is not: Triton would compile another
    # variant for them if those arguments were specialised
    lengths = [4096, 9000, 3100, 8192]
    alone = [_selected_inputs(1, hq, hkv, 1, m, d, torch.bfloat16, gen, density=0.03) for m in lengths]
    batch = _left_padded_batch(alone, max(lengths))

    def run(q, k, v, valid, s, keep, bias):
        kw = dict(bias=bias, dense=True)
        if with_scores:
            kw.update(scores=s, kth=topk.kth_largest(s, keep.sum(-1)))
        else:
            kw.update(valid=valid)
        return sa.attention(q, k, v, keep, **kw), kw

    together, kw = run(*batch)
    ref = sa.attention_reference(*batch[:3], batch[5], **kw)
    assert _rel(together.o.float(), ref.o.float()) < 2e-2 and _rel(together.o_dense.float(), ref.o_dense.float()) < 2e-2
    assert torch.allclose(together.mass, ref.mass, atol=2e-3) and torch.equal(together.kept, ref.kept)
    if with_scores:
        assert torch.equal(together.hits, ref.hits)
    for i in range(4):
        one, _ = run(*alone[i])
        for f in ("o", "lse", "kept", "o_dense", "lse_dense", "mass", "est_error"):
            assert torch.equal(getattr(one, f)[0], getattr(together, f)[i]), (i, f)
