"""KV bytes read per query-head row (``core.kv_bytes_read``, ``Method.index_bytes``), against brute force."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_eval.attention.recorder import StatsRecorder
from sparse_eval.methods import attend, build_method, make_config
from sparse_eval.methods.core import key_validity, static_keys

D = 16


def _qkv(n=200, q_rows=1, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, 4, q_rows, D, generator=g).to(dtype)
    k = torch.randn(1, 2, n, D, generator=g).to(dtype)
    v = torch.randn(1, 2, n, D, generator=g).to(dtype)
    return q, k, v


def _n_valid(q_rows, n):
    """[1, 1, Q] valid keys per row for causal rows aligned to the last Q keys."""
    return (torch.arange(q_rows) + (n - q_rows) + 1).view(1, 1, q_rows).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_full_reads_every_valid_key_and_value(dtype):
    n, ql = 120, 5
    q, k, v = _qkv(n, ql, dtype)
    e = k.element_size()
    _, st = attend("full", q, k, v)
    want = (_n_valid(ql, n) * 2 * D * e).expand(1, 4, ql)
    torch.testing.assert_close(st["kv_bytes"], want)


@pytest.mark.parametrize("name", ["topk", "oracle"])
def test_exact_scoring_reads_all_keys_then_kept_values(name):
    """TopK and oracle sampling score every valid key (n·D·e) and read the kept keys' V (|keep|·D·e)."""
    n, ql = 200, 3
    q, k, v = _qkv(n, ql, torch.float16, seed=1)
    e = 2
    _, st = attend(name, q, k, v, budget=0.1, sink=4, local=8)
    kept = st["keep"].sum(-1).float()
    want = _n_valid(ql, n) * D * e + kept * D * e
    torch.testing.assert_close(st["kv_bytes"], want.expand_as(kept))
    assert torch.all(st["kv_bytes"] < (_n_valid(ql, n) * 2 * D * e))


def test_quest_reads_scored_pages_min_max_and_kept_rows():
    n, ps = 200, 16
    q, k, v = _qkv(n, seed=2)
    sink, local = 4, 16
    _, st = attend("quest", q, k, v, budget=0.1, sink=sink, local=local, page_size=ps)
    # brute force: pages (from key 0) holding at least one candidate key (not in the sink or local window)
    cand = [i for i in range(n) if sink <= i < n - local]
    pages_scored = len({i // ps for i in cand})
    kept = st["keep"].sum(-1).float()
    want = pages_scored * 2 * D * 4 + kept * 2 * D * 4
    torch.testing.assert_close(st["kv_bytes"], want)


@pytest.mark.parametrize("bits", [4, 16])
def test_double_sparsity_reads_its_label_cache_and_kept_rows(bits):
    n = 160
    q, k, v = _qkv(n, seed=3)
    r = 4  # alpha = 0.25 of D = 16
    ch = [list(range(h, h + r)) for h in range(4)]
    _, st = attend("double_sparsity", q, k, v, channels=ch, alpha=0.25, beta=0.1, label_bits=bits)
    kept = st["keep"].sum(-1).float()
    want = n * r * bits / 8 + kept * 2 * D * 4
    torch.testing.assert_close(st["kv_bytes"], want)


def test_magicpig_reads_the_bucket_ids_of_its_collisions_and_sampled_rows():
    n, K, L = 150, 3, 10
    sink, local = 4, 8
    q, k, v = _qkv(n, seed=4)
    method = build_method(make_config("magicpig", dict(K=K, L=L, sink=sink, local=local, center=False)))
    _, st = attend(method, q, k, v)
    # brute force without centering: table l of x is the sign pattern of x·W[:, lK:(l+1)K]
    w = method.projection(0, D)
    qs = (q.float() @ w > 0).view(1, 4, 1, L, K)
    ks = (k.float() @ w > 0).view(1, 2, 1, n, L, K).repeat_interleave(2, 1)  # [1, Hq, 1, N, L, K]
    coll = (qs.unsqueeze(3) == ks).all(-1).sum(-1)  # [1, Hq, 1, N]
    cand = torch.zeros(n, dtype=torch.bool)
    cand[sink : n - local] = True
    total = (coll * cand).sum(-1).float()
    assert float(total.sum()) > 0
    torch.testing.assert_close(st["collisions"], total)
    kept = st["keep"].sum(-1).float()
    torch.testing.assert_close(st["kv_bytes"], total * 4 + kept * 2 * D * 4)


def test_kv_bytes_follow_each_rows_own_valid_keys_under_padding():
    """A left-padded row counts only its valid keys (the same bytes as the row alone)."""
    n, pad = 100, 30
    q, k, v = _qkv(n, seed=5)
    mask = torch.ones(1, 1, 1, n, dtype=torch.bool)
    mask[..., :pad] = False
    _, padded = attend("topk", q, k, v, attention_mask=mask, budget=10, sink=4, local=8)
    _, alone = attend("topk", q, k[:, :, pad:], v[:, :, pad:], budget=10, sink=4, local=8)
    torch.testing.assert_close(padded["kv_bytes"], alone["kv_bytes"])


def test_recorder_full_bytes_are_all_keys_and_values():
    n, ql = 50, 4
    valid = key_validity(None, 1, ql, n, "cpu")
    static, n_valid = static_keys(valid, 4, 8)
    rec = StatsRecorder(num_layers=2, num_heads=4)
    rec.add_full(1, static, n_valid, 4, key_bytes=2 * D * 2)
    want = float(_n_valid(ql, n).mean()) * 2 * D * 2
    assert rec.summary()["kv_bytes"] == pytest.approx(want)
    assert math.isclose(rec.summary(row=0)["kv_bytes_per_layer"][1], want, rel_tol=1e-6)
