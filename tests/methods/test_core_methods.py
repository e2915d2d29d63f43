"""The shared sparse attention and the reference methods (TopK, oracle sampling) against brute force.  (Every method's
weights, costs, est_error and full attention at a keep-all budget: ``test_method_contract``.)"""

from __future__ import annotations

import math
import os

import pytest
import torch

from sparse_eval.methods import attend, build_method, make_config
from sparse_eval.methods.base import resolve_budget
from sparse_eval.methods.core import (
    _keys_times_rows,
    _values_split8,
    key_validity,
    masked_softmax,
    scores_gqa,
    static_keys,
    weighted_values,
)


def rand_qkv(b=1, hq=4, hkv=2, n=200, d=16, q_len=1, seed=0, peaked=1.0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, q_len, d, generator=g) * peaked
    k = torch.randn(b, hkv, n, d, generator=g)
    v = torch.randn(b, hkv, n, d, generator=g)
    return q, k, v


def dense_reference(q, k, v, valid=None):
    g = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ kk.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if valid is not None:
        s = s.masked_fill(~valid, float("-inf"))
    return torch.softmax(s, -1) @ vv, s


@pytest.mark.parametrize("budget", [0.1, 17])
@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
def test_topk_matches_brute_force(budget, gqa):
    q, k, v = rand_qkv(n=300, seed=3)
    sink, local = 4, 16
    out, st = attend("topk", q, k, v, budget=budget, sink=sink, local=local, gqa=gqa)
    _, s = dense_reference(q, k, v)
    n = k.shape[2]
    kcount = int(budget * n) if isinstance(budget, float) else budget
    probs = torch.softmax(s, -1)
    g = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):
        if gqa == "query_head":
            score = s[0, h, 0]
        else:
            grp = h // g
            score = probs[0, grp * g : (grp + 1) * g, 0].sum(0)
        cand = list(range(sink, n - local))
        best = sorted(cand, key=lambda i: -float(score[i]))[:kcount]
        expect = set(best) | set(range(sink)) | set(range(n - local, n))
        assert set(st["indices"][h].tolist()) == expect
        # output = softmax over the kept keys, exactly
        idx = torch.tensor(sorted(expect))
        w = torch.softmax(s[0, h, 0, idx], -1)
        torch.testing.assert_close(out[0, h, 0], w @ v[0, h // g, idx], rtol=1e-5, atol=1e-6)
    assert torch.allclose(st["cost2"], torch.full_like(st["cost2"], (kcount + sink + local) / n))
    assert torch.all(st["cost1"] == 0.5)


def test_budget_semantics_and_errors():
    n = torch.tensor([[[[100]]]])
    assert int(resolve_budget(0.05, n)) == 5
    assert int(resolve_budget(7, n)) == 7
    assert int(resolve_budget(1.0, n)) == 100
    for bad in (0, -3, 0.0, 1.5, -0.1, "x", True):
        with pytest.raises(ValueError, match="budget"):
            build_method(make_config("topk", {"budget": bad}))
    with pytest.raises(ValueError, match="larger than the context"):
        q, k, v = rand_qkv(n=50)
        attend("topk", q, k, v, budget=51)
    with pytest.raises(ValueError, match="unknown method 'nope'.*valid methods"):
        attend("nope", *rand_qkv())
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['bogus'\]"):
        attend("topk", *rand_qkv(), bogus=1)
    with pytest.raises(ValueError, match="dense_layers"):
        build_method(make_config("topk", {"dense_layers": [0, 9]})).validate(num_layers=4)


def test_oracle_sampling_is_unbiased():
    """Theorem 3.2: E[ô] = o.  Average over independent seeds converges to dense attention."""
    q, k, v = rand_qkv(n=64, hq=2, hkv=1, seed=1, peaked=2.0)
    ref, _ = dense_reference(q, k, v)
    outs = torch.stack(
        [attend("oracle", q, k, v, budget=8, sink=0, local=0, seed=s, compute_error=False)[0] for s in range(600)]
    )
    mean, sd = outs.mean(0), outs.std(0)
    # each coordinate within 5 standard errors of the truth
    assert torch.all((mean - ref).abs() <= 5 * sd / math.sqrt(outs.shape[0]) + 1e-6)
    # and far from a biased estimator: TopK with the same budget is off by much more than the sampling noise
    topk, _ = attend("topk", q, k, v, budget=8, sink=0, local=0)
    assert (topk - ref).norm() > 3 * (mean - ref).norm()


def test_oracle_unique_count_eq14_and_theorem_33():
    """E|S| = n − Σ (1 − w_i)^B (eq. 14) ≤ 1 + B·ε with ε = 1 − max w (Theorem 3.3)."""
    q, k, v = rand_qkv(n=80, hq=1, hkv=1, seed=2, peaked=3.0)
    _, s = dense_reference(q, k, v)
    w = torch.softmax(s[0, 0, 0].double(), -1)
    budget = 20
    expected = float(len(w) - ((1 - w) ** budget).sum())
    bound = 1 + budget * float(1 - w.max())
    counts = []
    for seed in range(400):
        _, st = attend("oracle", q, k, v, budget=budget, sink=0, local=0, seed=seed, compute_error=False)
        counts.append(int(st["keep"].sum()))
    c = torch.tensor(counts, dtype=torch.float64)
    assert abs(c.mean() - expected) <= 5 * c.std() / math.sqrt(len(c))
    assert expected <= bound
    assert c.mean() <= bound + 5 * c.std() / math.sqrt(len(c))


def test_nothing_selected_falls_back_without_nan():
    q, k, v = rand_qkv(n=30)
    out, st = attend("topk", q, k, v, budget=0.01, sink=0, local=0)  # floor(0.3) = 0 keys
    assert torch.isfinite(out).all()
    assert st["empty"].all()
    g = q.shape[1] // k.shape[1]
    for h in range(q.shape[1]):  # falls back to the newest key
        torch.testing.assert_close(out[0, h, 0], v[0, h // g, -1])


def test_static_keys_skip_left_padding():
    valid = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool).view(1, 1, 1, 10)
    static, n = static_keys(valid, sink=2, local=3)
    assert static[0, 0, 0].nonzero().flatten().tolist() == [3, 4, 7, 8, 9]
    assert int(n) == 7


def test_key_validity_shapes():
    v = key_validity(None, 2, 3, 5, "cpu")
    assert v.shape == (2, 1, 3, 5)
    assert v[0, 0].int().tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    float_mask = torch.zeros(1, 1, 1, 4)
    float_mask[..., 0] = torch.finfo(torch.float32).min
    assert key_validity(float_mask, 1, 1, 4, "cpu")[0, 0, 0].tolist() == [False, True, True, True]


def test_padded_batch_equals_rows_alone_for_attend():
    q, k, v = rand_qkv(b=1, n=60, seed=5)
    pad = 7
    kp = torch.cat([torch.randn(1, 2, pad, 16), k], 2)
    vp = torch.cat([torch.randn(1, 2, pad, 16), v], 2)
    mask = torch.ones(1, 1, 1, 60 + pad, dtype=torch.bool)
    mask[..., :pad] = False
    for name, opts in [("topk", {"budget": 0.2}), ("oracle", {"budget": 0.3})]:
        a, sa = attend(name, q, k, v, sink=2, local=4, **opts)
        b, sb = attend(name, q, kp, vp, attention_mask=mask, sink=2, local=4, **opts)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        assert torch.equal(sa["keep"], sb["keep"][..., pad:]) and not sb["keep"][..., :pad].any()


@pytest.mark.parametrize("ql,n", [(1, 13), (3, 16), (2, 40)])
def test_grouped_products_equal_repeated_kv(ql, n):
    """scores_gqa / weighted_values (a KV group's heads as rows of one product) against K and V repeated per query
    head, and the CUDA formulations (K · rowsᵀ; the reduction split at a multiple of 8) against the plain ones."""
    g = torch.Generator().manual_seed(3)
    b, hq, hkv, d = 2, 6, 2, 8
    q = torch.randn(b, hq, ql, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, hkv, n, d, generator=g, dtype=torch.float64)
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    s = scores_gqa(q, k, 0.5)
    torch.testing.assert_close(s, (q @ kr.transpose(-1, -2)).float() * 0.5)
    p = torch.softmax(s, -1)
    torch.testing.assert_close(weighted_values(p, v), p.double() @ vr)
    qg = q.reshape(b, hkv, hq // hkv * ql, d)
    torch.testing.assert_close(_keys_times_rows(qg, k), qg @ k.transpose(-1, -2))
    pg = p.reshape(b, hkv, hq // hkv * ql, n)
    torch.testing.assert_close(_values_split8(pg, v), pg.double() @ v)
    # in bf16 the split sums its two parts in fp32: within a bf16 rounding of the one-product value
    vb = v.to(torch.bfloat16)
    torch.testing.assert_close(
        _values_split8(pg, vb).float(), (pg.to(torch.bfloat16) @ vb).float(), rtol=1e-2, atol=1e-2
    )


def test_masked_softmax_keeps_nan_and_zeroes_empty_rows():
    x = torch.tensor([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [float("nan"), 0.0, 0.0]])
    keep = torch.tensor([[True, False, True], [False, False, False], [True, True, False]])
    p = masked_softmax(x, keep)
    torch.testing.assert_close(p[0], torch.tensor([1 / (1 + math.e**2), 0.0, math.e**2 / (1 + math.e**2)]))
    assert torch.equal(p[1], torch.zeros(3))  # nothing kept: zeros, not NaN
    assert bool(torch.isnan(p[2, :2]).all()) and p[2, 2] == 0  # a NaN among kept logits is not hidden


def test_oracle_kept_draw_parts_give_the_draws_of_a_fresh_method():
    """Oracle sampling keeps the uniforms' (seed, rows, head) state and the draw-index hashes between calls; a
    method reused over batches with other row seeds, other layers and a budget that grows with the context
    selects exactly what a fresh method selects (whose draws are ``random.uniforms`` of every key)."""
    from sparse_eval.methods.core import sparse_attention

    reused = build_method(make_config("oracle", {"budget": 0.1, "sink": 1, "local": 2}))
    batches: dict[tuple, torch.Tensor] = {}
    for call, (b, n, seeds, layer) in enumerate(
        [(2, 40, [3, 9], 0), (2, 41, [3, 9], 0), (2, 60, [3, 9], 0), (3, 60, [5, 6, 7], 0), (2, 50, None, 1)]
    ):
        q, k, v = rand_qkv(b=b, n=n, hq=4, hkv=2, seed=call)
        valid = torch.ones(b, 1, 1, n, dtype=torch.bool)
        # one tensor per batch, as the engine makes (the method keeps its parts while it is the same tensor)
        rows = None if seeds is None else batches.setdefault(tuple(seeds), torch.tensor(seeds))
        fresh = build_method(make_config("oracle", {"budget": 0.1, "sink": 1, "local": 2}))
        outs = [
            sparse_attention(m, q, k, v, valid, 0.125, {}, layer, keep_masks=True, row_seeds=rows)
            for m in (reused, fresh)
        ]
        assert torch.equal(outs[0][1]["keep"], outs[1][1]["keep"]) and torch.equal(outs[0][0], outs[1][0]), call


# -- eval.fused_attention: the setting, its resolution, and the kernel inside a model --------------------------------


def test_fused_attention_setting_resolves_per_method_device_and_dtype(monkeypatch):
    """auto: on for CUDA when the method declares the capability, off on the CPU (so CPU records stay the torch
    path's); on: refused where it cannot run (no capability, a dtype the kernel does not take, a CPU outside
    Triton's interpreter); off: never; a dense method makes no sparse call."""
    from sparse_eval.methods.base import Method
    from sparse_eval.methods.core import fused_attention_used

    topk, full = build_method(make_config("topk", {})), build_method(make_config("full", {}))

    class NoCapability(Method):
        name = "no_capability"

    plain = NoCapability(make_config("topk", {}))
    f32 = torch.float32
    assert not fused_attention_used("auto", topk, "cpu", f32)
    assert not fused_attention_used("off", topk, "cuda", f32) and not fused_attention_used("on", full, "cuda", f32)
    with pytest.raises(ValueError, match="valid"):
        fused_attention_used("yes", topk, "cpu", f32)
    pytest.importorskip("triton")
    assert fused_attention_used("auto", topk, "cuda", torch.bfloat16)
    assert not fused_attention_used("auto", plain, "cuda", f32) and not fused_attention_used(
        "auto", topk, "cuda", torch.float64
    )
    with pytest.raises(ValueError, match="does not declare"):
        fused_attention_used("on", plain, "cuda", f32)
    with pytest.raises(ValueError, match="float64"):
        fused_attention_used("on", topk, "cuda", torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="not CUDA"):
        fused_attention_used("on", topk, "cpu", f32)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_attention_used("on", topk, "cpu", f32)


def test_fused_attention_in_a_model_decodes_as_the_torch_path(stories, monkeypatch):
    """The setting through the plug-in: stories260K decoding under protocol A inside the batch-invariant mode, a
    left-padded batch of 2, MagicPIG (a selection with a logit correction), with ``eval.fused_attention=on`` (Triton's
    interpreter on the CPU, with splits of 64 keys) and ``off``: the same greedy tokens and the same recorded
    statistics to fp32 rounding; ``auto`` on the CPU is ``off`` bit for bit."""
    pytest.importorskip("triton")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("no CUDA and no TRITON_INTERPRET=1")
        from sparse_eval.kernels import selected_attention

        monkeypatch.setattr(selected_attention, "SPLIT", 64)
    from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache
    from sparse_eval.invariance import batch_invariant

    model, tok = stories
    enc = tok(["Once upon a time there was a little dog who", "The sun"], return_tensors="pt", padding=True)
    name, opts = "magicpig", dict(K=4, L=20, sink=2, local=4, dense_layers=[0])

    def decode(setting):
        method = build_method(make_config(name, opts))
        session = attach(model, method, Runtime(protocol="A", fused_attention=setting))
        try:
            cache = make_cache(model)
            ids, mask, toks = enc["input_ids"], enc["attention_mask"], []
            with torch.no_grad(), batch_invariant():
                for _ in range(2):  # the dense prefill (protocol A), then a sparse step
                    out = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
                    ids = out.logits[:, -1].argmax(-1, keepdim=True)
                    mask = torch.cat([mask, torch.ones_like(ids)], 1)
                    toks.append(ids)
            return torch.cat(toks, 1), session.recorder.summary()
        finally:
            detach(model)

    (t_off, s_off), (t_on, s_on), (t_auto, s_auto) = decode("off"), decode("on"), decode("auto")
    assert torch.equal(t_on, t_off) and torch.equal(t_auto, t_off) and s_auto == s_off
    assert s_on.keys() == s_off.keys()
    for key, val in s_off.items():
        if isinstance(val, float):
            assert s_on[key] == pytest.approx(val, rel=1e-4, abs=1e-6), key


def test_fused_attention_enters_the_identity_only_where_it_runs(tmp_path, monkeypatch):
    """A run's identity says ``eval.fused_attention: true`` where the kernel runs (here: ``on`` under Triton's
    interpreter), and nothing where it does not (``auto`` on the CPU, ``off``, a dense method): those runs keep the
    directories they had before the setting existed."""
    pytest.importorskip("triton")
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import CONF_DIR, register_configs
    from sparse_eval.run.experiment import Experiment
    from sparse_eval.run.run_config import run_config

    register_configs()
    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    def ident(*overrides):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(
                config_name="config",
                overrides=[f"paths.runs_dir={tmp_path / 'runs'}", "task.window=64", "task.num_samples=1", *overrides],
            )
        exp = Experiment(run_config(cfg))
        return exp.identity(exp.method_configs()[0])["eval"]

    before = {"protocol", "compute_error", "prefill_chunk", "batch_invariant"}
    assert set(ident("method=topk")) == before  # auto on the CPU
    assert set(ident("method=topk", "eval.fused_attention=off")) == before
    assert set(ident("method=full", "eval.fused_attention=on")) == before
    assert ident("method=topk", "eval.fused_attention=on")["fused_attention"] is True


def test_score_product_at_an_aligned_key_length_is_exact_for_the_real_keys():
    """The CUDA score product (outside the batch-invariant mode) takes rows · Kᵀ over the cache's keys rounded up to
    a multiple of 16 where its buffer has room (a view, no copy): the real keys' scores are those of the product over
    the N keys alone, spare rows full of NaN never leak into them, and a cache without room falls back (None)."""
    from sparse_eval.methods.core import _cuda_scores, _rows_times_aligned_keys, aligned_keys

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    buf = torch.full((2, 2, 64, 16), float("nan"), device=dev)  # a SparseLayer-like buffer: room past N
    qg = torch.randn(2, 2, 8, 16, device=dev)
    for n in (16, 37, 50):
        buf[:, :, :n] = torch.randn(2, 2, n, 16, device=dev)
        k = buf[:, :, :n]
        ka = aligned_keys(k)
        assert ka.shape[2] == -(-n // 16) * 16 and ka.data_ptr() == k.data_ptr()
        got = _rows_times_aligned_keys(qg, k)
        want = torch.matmul(qg, k.transpose(-1, -2))
        assert got.shape == want.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(_cuda_scores(qg, k), want, rtol=1e-6, atol=1e-5)
    tight = torch.randn(2, 2, 37, 16, device=dev)  # no room past N: (K · rowsᵀ)ᵀ
    assert aligned_keys(tight) is None and _rows_times_aligned_keys(qg, tight) is None
    assert aligned_keys(tight[:, :, :32]) is not None  # 32 is aligned already: itself
    torch.testing.assert_close(_cuda_scores(qg, tight), torch.matmul(qg, tight.transpose(-1, -2)), rtol=1e-6, atol=1e-5)
    assert aligned_keys(buf[:, :, :60]) is not None  # 64 rows: the buffer's whole capacity
    short = torch.randn(2, 2, 70, 16, device=dev)[:, :, :68]  # 80 rows would run past the last head's 70
    assert aligned_keys(short) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_scores_at_an_aligned_key_length():
    """On the GPU, bf16, the Llama-3.1-8B decode shape at misaligned lengths: ``scores_gqa`` (stock mode) takes the
    aligned product over a buffer with room and agrees with float64 scores; NaN in the spare rows never shows."""
    from sparse_eval.methods.core import aligned_keys, scores_gqa

    buf = torch.full((2, 8, 16384 + 256, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
    q = torch.randn(2, 32, 1, 128, device="cuda", dtype=torch.bfloat16)
    for n in (16384, 16389, 16399):
        buf[:, :, :n] = torch.randn(2, 8, n, 128, device="cuda", dtype=torch.bfloat16)
        k = buf[:, :, :n]
        assert aligned_keys(k) is not None
        got = scores_gqa(q, k, 128**-0.5)
        want = (q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) * 128**-0.5
        assert got.shape == (2, 32, 1, n) and torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)
