"""Quest: page bound, page selection against brute force, incremental metadata, padding, GQA, generate()."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import attach_generate, tiny_qwen2
from sparse_eval.methods import attend, build_method, make_config
from sparse_eval.methods.quest import build_pages, page_bound, page_budget, page_ids

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "sparse_eval" / "models" / "stories260K"


def brute_pages(k: torch.Tensor, start: int, n: int, ps: int):
    """Per page (from key ``start``): list of (first, last+1, kmin [H, D], kmax [H, D]) by explicit loops."""
    out = []
    for a in range(start, n, ps):
        b = min(n, a + ps)
        out.append((a, b, k[:, a:b].amin(1), k[:, a:b].amax(1)))
    return out


def brute_bound(q: torch.Tensor, mn: torch.Tensor, mx: torch.Tensor) -> float:
    return float(sum(max(float(q[c]) * float(mn[c]), float(q[c]) * float(mx[c])) for c in range(q.shape[0])))


def brute_quest_keep(q, k, ps, pages_wanted, sink, local, gqa="query_head"):
    """q [Hq, D] one decode row, k [Hkv, N, D] -> bool [Hq, N] keys kept (pages chosen + static)."""
    hq, hkv, n = q.shape[0], k.shape[0], k.shape[1]
    g = hq // hkv
    static = torch.zeros(n, dtype=torch.bool)
    static[: min(sink, n)] = True
    if local:
        static[max(0, n - local) :] = True
    pages = brute_pages(k, 0, n, ps)
    bounds = torch.full((hq, len(pages)), -math.inf, dtype=torch.float64)
    for h in range(hq):
        for p, (a, b, mn, mx) in enumerate(pages):
            if (~static[a:b]).any():
                bounds[h, p] = brute_bound(q[h], mn[h // g], mx[h // g])
    if gqa == "kv_head":
        for kv in range(hkv):
            s = bounds[kv * g : (kv + 1) * g]
            s = torch.where(torch.isfinite(s), s, torch.zeros_like(s)).sum(0)
            s = torch.where(torch.isfinite(bounds[kv * g]), s, torch.full_like(s, -math.inf))
            bounds[kv * g : (kv + 1) * g] = s
    keep = static.clone().unsqueeze(0).repeat(hq, 1)
    for h in range(hq):
        order = torch.argsort(bounds[h], descending=True)
        chosen = [int(p) for p in order[:pages_wanted] if math.isfinite(float(bounds[h, p]))]
        for p in chosen:
            a, b = pages[p][0], pages[p][1]
            keep[h, a:b] = True
    return keep


@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
@pytest.mark.parametrize("sink,local", [(0, 0), (4, 20)])
def test_page_selection_equals_brute_force(gqa, sink, local):
    torch.manual_seed(0)
    hq, hkv, n, d, ps = 8, 4, 203, 8, 16
    q = torch.randn(1, hq, 1, d, dtype=torch.float64)
    k = torch.randn(1, hkv, n, d, dtype=torch.float64)
    v = torch.randn(1, hkv, n, d, dtype=torch.float64)
    budget = 48  # 3 pages
    _, st = attend("quest", q, k, v, budget=budget, page_size=ps, sink=sink, local=local, gqa=gqa)
    expected = brute_quest_keep(q[0, :, 0], k[0], ps, budget // ps, sink, local, gqa)
    assert torch.equal(st["keep"][0, :, 0], expected)
    assert torch.all(st["pages"] == 3)
    if gqa == "kv_head":  # one page set per KV group
        keep = st["keep"][0, :, 0].view(hkv, hq // hkv, n)
        assert torch.all(keep == keep[:, :1])


def test_bound_never_below_true_page_max():
    torch.manual_seed(1)
    for trial in range(5):
        hq, hkv, n, d, ps = 4, 2, 157, 16, [8, 16, 32, 5, 64][trial]
        q = torch.randn(1, hq, 3, d) * (trial + 1)
        k = torch.randn(1, hkv, n, d) + torch.randn(1, hkv, 1, d) * 3
        first = torch.tensor([0])
        pid = page_ids(first, n, ps)
        num_pages = -(-n // ps)
        kmin, kmax = build_pages(k, pid, num_pages)
        u = page_bound(q, kmin, kmax)  # [1, Hq, 3, P]
        s = torch.einsum("bhqd,bhnd->bhqn", q, k.repeat_interleave(hq // hkv, 1))
        for p in range(num_pages):
            true_max = s[..., p * ps : (p + 1) * ps].amax(-1)
            assert torch.all(u[..., p] >= true_max - 1e-4), (trial, p)
        # the bound is attained when the page holds one key
        kmin1, kmax1 = build_pages(k[:, :, :1], pid[:, :1], 1)
        assert torch.allclose(page_bound(q, kmin1, kmax1)[..., 0], s[..., 0], atol=1e-5)


def test_incremental_metadata_equals_from_scratch():
    """Decode key by key (batch with left padding): the state's page min/max equal a from-scratch build."""
    torch.manual_seed(2)
    hq, hkv, d, ps = 4, 2, 8, 16
    pad = [0, 7]
    n0, steps = 30, 40
    k_all = torch.randn(2, hkv, n0 + steps, d)
    v_all = torch.randn(2, hkv, n0 + steps, d)
    state: dict = {}
    for n in range(n0, n0 + steps + 1):
        q = torch.randn(2, hq, 1, d)
        mask = torch.ones(2, 1, 1, n, dtype=torch.bool)
        for b, p in enumerate(pad):
            mask[b, ..., :p] = False
        attend(
            "quest", q, k_all[:, :, :n], v_all[:, :, :n], attention_mask=mask, state=state, budget=16, sink=0, local=0
        )
        st = state["quest"]
        first = torch.tensor(pad)
        pid = page_ids(first, n, ps)
        num_pages = max(-(-(n - p) // ps) for p in pad)
        kmin, kmax = build_pages(k_all[:, :, :n], pid, num_pages)
        assert st["n"] == n
        assert torch.equal(st["kmin"], kmin) and torch.equal(st["kmax"], kmax)
        # and the pages really start at each row's first valid key
        for b, p in enumerate(pad):
            for page, (a, e, mn, mx) in enumerate(brute_pages(k_all[b, :, :n], p, n, ps)):
                assert torch.equal(st["kmin"][b, :, page], mn) and torch.equal(st["kmax"][b, :, page], mx)


def test_budget_below_one_page_uses_one_page_and_says_so():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    for budget in (8, 0.01):  # 8 tokens < 16; 0.01 * 300 = 3 tokens
        _, st = attend("quest", q, k, v, budget=budget, page_size=16, sink=0, local=0)
        assert torch.all(st["pages"] == 1) and torch.all(st["one_page_floor"] == 1)
        assert torch.all(st["keep"].sum(-1) == 16)
    _, st = attend("quest", q, k, v, budget=40, page_size=16, sink=0, local=0)  # floor(40/16) = 2, no floor
    assert torch.all(st["pages"] == 2) and torch.all(st["one_page_floor"] == 0)
    # Cost1 = pages scored / context keys (here every page: ceil(300/16) = 19)
    assert torch.allclose(st["cost1"], torch.full_like(st["cost1"], 19 / 300))
    with pytest.raises(ValueError, match="page_size"):
        build_method(make_config("quest", {"page_size": 0}))


def test_min_pages_reproduces_the_quest_repo_minimum_of_three_pages():
    torch.manual_seed(3)
    q, k, v = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 300, 8), torch.randn(1, 2, 300, 8)
    # the Quest repo keeps max(3, budget // page) pages (evaluation/quest_attention.py:56)
    for budget, pages in ((8, 3), (40, 3), (80, 5)):
        _, st = attend("quest", q, k, v, budget=budget, page_size=16, sink=0, local=0, min_pages=3)
        assert torch.all(st["pages"] == pages) and torch.all(st["keep"].sum(-1) == 16 * pages)
        assert torch.all(st["one_page_floor"] == float(budget // 16 < 3))
    with pytest.raises(ValueError, match=r"method.min_pages=0"):
        build_method(make_config("quest", {"min_pages": 0}))
    with pytest.raises(ValueError, match="budget"):
        build_method(make_config("quest", {"budget": 1.5}))


def test_page_budget_rounds_down_in_both_forms():
    """Pages = max(min_pages, ⌊tokens / page_size⌋), on the host (an int) and per row on the device (a tensor)."""
    tokens = [0, 15, 16, 17, 31, 32, 47, 60, 63, 64]
    want = [max(1, t // 16) for t in tokens]  # 1, 1, 1, 1, 1, 2, 2, 3, 3, 4
    assert [page_budget(t, 16) for t in tokens] == want
    assert page_budget(torch.tensor(tokens), 16).tolist() == want
    assert page_budget(torch.tensor(tokens), 16, min_pages=3).tolist() == [max(3, t // 16) for t in tokens]


def test_each_rows_page_budget_rounds_down_below_the_batchs_bound():
    """A ratio budget in a left-padded batch: each row selects ⌊⌊r·n_b⌋ / page_size⌋ pages of its own n_b valid keys,
    fewer than the batch's longest row (whose count bounds the top-k), and exactly brute force's pages."""
    torch.manual_seed(4)
    hq, hkv, n, d, ps, r = 4, 2, 203, 8, 16, 0.3
    pads = [0, 19, 53, 90]  # n_b = 203, 184, 150, 113: ⌊0.3·n_b⌋ = 60, 55, 45, 33 tokens -> 3, 3, 2, 2 pages
    b = len(pads)
    q = torch.randn(b, hq, 1, d, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, dtype=torch.float64)
    mask = torch.ones(b, 1, 1, n, dtype=torch.bool)
    for i, p in enumerate(pads):
        mask[i, ..., :p] = False
    _, st = attend("quest", q, k, v, attention_mask=mask, budget=r, page_size=ps, sink=0, local=0)
    for i, p in enumerate(pads):
        pages = max(1, int(r * (n - p)) // ps)
        assert st["pages"][i, :, 0].tolist() == [pages] * hq, (
            f"row {i} ({n - p} keys): {st['pages'][i, :, 0].tolist()} pages"
        )
        expected = brute_quest_keep(q[i, :, 0], k[i, :, p:], ps, pages, 0, 0)
        assert torch.equal(st["keep"][i, :, 0, p:], expected) and not st["keep"][i, :, 0, :p].any(), f"row {i}"
    assert st["pages"][:, :, 0].tolist() != [[3] * hq] * b  # the rows' budgets differ: not the batch's bound for all


@pytest.mark.parametrize("q_len", [1, 9])
def test_left_padded_batch_equals_rows_alone(q_len):
    torch.manual_seed(4)
    hq, hkv, d = 8, 4, 8
    lens = [70, 93]
    n = max(lens)
    qs = [torch.randn(1, hq, q_len, d) for _ in lens]
    ks = [torch.randn(1, hkv, m, d) for m in lens]
    vs = [torch.randn(1, hkv, m, d) for m in lens]
    kb, vb = torch.zeros(2, hkv, n, d), torch.zeros(2, hkv, n, d)
    mask = torch.zeros(2, 1, q_len, n, dtype=torch.bool)
    for b, m in enumerate(lens):
        kb[b, :, n - m :], vb[b, :, n - m :] = ks[b], vs[b]
        for r in range(q_len):  # causal, bottom-right aligned, after the padding
            mask[b, 0, r, n - m : n - q_len + r + 1] = True
    opts = dict(budget=0.2, page_size=16, sink=4, local=8)
    out, st = attend("quest", torch.cat(qs), kb, vb, attention_mask=mask, **opts)
    for b, m in enumerate(lens):
        o1, s1 = attend("quest", qs[b], ks[b], vs[b], **opts)
        assert torch.allclose(out[b], o1[0], atol=1e-6)
        assert torch.equal(st["keep"][b, ..., n - m :], s1["keep"][0])


def test_query_block_rows_equal_decode_rows():
    """Protocol S: a row in a block selects what one decode step over the keys up to it selects."""
    torch.manual_seed(5)
    hq, hkv, d, n, ql = 4, 2, 8, 120, 40
    q, k, v = torch.randn(1, hq, ql, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    opts = dict(budget=32, page_size=16, sink=2, local=4)
    out, st = attend("quest", q, k, v, **opts)
    for r in range(ql):
        m = n - ql + r + 1
        o1, s1 = attend("quest", q[:, :, r : r + 1], k[:, :, :m], v[:, :, :m], **opts)
        assert torch.allclose(out[:, :, r], o1[:, :, 0], atol=1e-6), r
        assert torch.equal(st["keep"][0, :, r, :m], s1["keep"][0, :, 0])


def test_update_pages_false_is_magicpig_parity():
    torch.manual_seed(6)
    hq, hkv, d, ps = 4, 2, 8, 16
    k_all, v_all = torch.randn(1, hkv, 140, d), torch.randn(1, hkv, 140, d)
    state: dict = {}
    for n in range(100, 141):
        q = torch.randn(1, hq, 1, d)
        _, st = attend(
            "quest",
            q,
            k_all[:, :, :n],
            v_all[:, :, :n],
            state=state,
            budget=16,
            page_size=ps,
            sink=0,
            local=20,
            update_pages=False,
        )
        # pages frozen over the 99 prefilled keys minus the local window: floor(79 / 16) = 4 pages = 64 keys
        assert state["quest"]["kmin"].shape[2] == 4
        assert torch.all(st["keep"][0, :, 0, 64:n])  # every key after the frozen pages is attended
        assert torch.all(st["keep"][0, :, 0, :64].sum(-1) == 16)  # one page chosen among the frozen ones


# -- inside model.generate -------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["stories", "qwen2"])
def test_generate_runs(which):
    from transformers import AutoModelForCausalLM

    if which == "stories":
        model = AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()
        vocab = 512
    else:
        model = tiny_qwen2()
        vocab = 128
    torch.manual_seed(7)
    ids = torch.randint(3, vocab, (2, 90))
    mask = torch.ones_like(ids)
    mask[1, :13] = 0  # left padding in row 1
    method = build_method(make_config("quest", {"budget": 32, "page_size": 16, "sink": 4, "local": 16}))
    out, session = attach_generate(model, method, ids, mask, new=6)
    assert out.sequences.shape == (2, 96)
    assert all(torch.isfinite(s).all() for s in out.logits)
    summ = session.recorder.summary()
    assert summ["sparse_rows"] > 0 and summ["cost2"] < 1
    assert 0 < summ["cost1"] < 0.1  # ≈ 1/16 of the context


def test_query_chunks_equal_one_block_with_long_left_padding():
    """Protocol S in query blocks: a row whose padding fills the first block still gets its pages right."""
    from sparse_eval.methods.core import key_validity, sparse_attention

    torch.manual_seed(8)
    hq, hkv, d, n = 4, 2, 8, 80
    q, k, v = torch.randn(2, hq, n, d), torch.randn(2, hkv, n, d), torch.randn(2, hkv, n, d)
    pad = torch.zeros(2, n, dtype=torch.bool)
    pad[1, :37] = True  # row 1: 37 padding positions > one 16-row block
    causal = key_validity(None, 2, n, n, q.device)
    valid = causal & ~pad.view(2, 1, 1, n)
    method = build_method(make_config("quest", {"budget": 16, "page_size": 8, "sink": 1, "local": 4}))
    outs = [
        sparse_attention(method, q, k, v, valid, d**-0.5, {}, 3, compute_error=False, query_chunk=c, keep_masks=True)
        for c in (16, 1000)
    ]
    rows = valid.any(-1).view(2, 1, n, 1)
    assert torch.allclose(outs[0][0] * rows, outs[1][0] * rows, atol=1e-6)
    assert torch.equal(outs[0][1]["keep"], outs[1][1]["keep"])
