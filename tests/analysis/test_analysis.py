"""Analyses on the shipped stories260K at tiny sizes: brute-force references and real properties."""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch

from sparse_eval.analysis import common, ds_checks, error_vs_budget, geometry
from sparse_eval.analysis import __main__ as app
from sparse_eval.analysis.capture import capture_qkv, decoder_layers


def test_pairwise_cos_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 7, generator=g)  # [N, heads, D]
    mean, mn = geometry.pairwise_cos(x)
    for h in range(3):
        vals = [
            float(torch.dot(x[i, h], x[j, h]) / (x[i, h].norm() * x[j, h].norm()))
            for i, j in itertools.combinations(range(5), 2)
        ]
        assert mean[h] == pytest.approx(sum(vals) / len(vals), abs=1e-6)
        assert mn[h] == pytest.approx(min(vals), abs=1e-6)


def test_top_mass_brute_force_and_monotone():
    g = torch.Generator().manual_seed(1)
    p = torch.softmax(torch.randn(2, 3, 4, 10, generator=g) * 3, -1)
    valid = torch.ones(1, 1, 4, 10, dtype=torch.bool)
    valid[..., 0, 8:] = False  # a row with 8 keys
    p = p.masked_fill(~valid, 0.0)
    p = p / p.sum(-1, keepdim=True)
    fr = [0.1, 0.25, 0.5, 1.0]
    m = geometry.top_mass(p, valid, fr)
    for b, h, r in itertools.product(range(2), range(3), range(4)):
        row = p[b, h, r][valid[0, 0, r]]
        srt = sorted(row.tolist(), reverse=True)
        for i, x in enumerate(fr):
            k = max(1, math.ceil(x * len(srt) - 1e-9))
            assert m[b, h, r, i] == pytest.approx(sum(srt[:k]), abs=1e-5)
    assert (m[..., 1:] >= m[..., :-1] - 1e-6).all()
    assert torch.allclose(m[..., -1], torch.ones_like(m[..., -1]), atol=1e-5)


def test_capture_keeps_outputs_and_gives_post_rope_keys(stories):
    model, tok = stories
    ids = torch.tensor([[1, 45, 300, 22, 17, 99, 250, 3]])
    with torch.no_grad():
        ref = model(ids).logits
    cap = capture_qkv(model, ids)
    with torch.no_grad():
        again = model(ids).logits
    assert torch.equal(ref, again)  # the model is switched back
    assert sorted(cap) == list(range(model.config.num_hidden_layers))
    c = cap[1]
    assert c.q.shape == (1, 8, 8, 8) and c.k.shape == (1, 4, 8, 8)
    # pre-RoPE keys of the same layer: equal at position 0 (RoPE(0) = I), same norms elsewhere, rotated
    from sparse_eval.analysis.capture import capture_layer_inputs

    h = capture_layer_inputs(model, ids)[1]["attn_input"]
    attn = decoder_layers(model)[1].self_attn
    with torch.no_grad():
        k_pre = attn.k_proj(h).view(1, 8, 4, 8).transpose(1, 2)
    assert torch.allclose(c.k[:, :, 0], k_pre[:, :, 0], atol=1e-5)
    assert torch.allclose(c.k.norm(dim=-1), k_pre.norm(dim=-1), atol=1e-4)
    assert not torch.allclose(c.k[:, :, 3:], k_pre[:, :, 3:], atol=1e-3)


def test_geometry_measures(stories):
    model, tok = stories
    opts = geometry.GeometryOptions(
        num_random=4,
        random_len=3,
        num_sentences=3,
        sentence_len=16,
        length=48,
        num_queries=3,
        fractions=[0.05, 0.2, 0.5, 1.0],
        batch=4,
    )
    res = geometry.measure(model, tok, 512, opts)
    # k_sink across random inputs equals a brute-force recomputation from captured keys
    rnd = common.random_tokens(tok, model.config.vocab_size, 4, 3, 0)
    k0 = [capture_qkv(model, rnd[i : i + 1])[2].k[0, :, 0] for i in range(4)]  # layer 2, [Hkv, D] each
    for h in range(k0[0].shape[0]):
        vals = [
            float(torch.nn.functional.cosine_similarity(k0[i][h], k0[j][h], dim=0))
            for i, j in itertools.combinations(range(4), 2)
        ]
        assert float(res["sink_cos"]["min"][2][h]) == pytest.approx(min(vals), abs=1e-5)
        assert float(res["sink_cos"]["mean"][2][h]) == pytest.approx(sum(vals) / len(vals), abs=1e-5)
    for key in ("with_sink", "without_sink"):
        for layer in res["top_mass"][key]:
            m = torch.as_tensor(layer)
            assert (m[1:] >= m[:-1] - 1e-6).all() and m[-1] == pytest.approx(1.0, abs=1e-5)
    ss = res["score_spread"]
    assert all((torch.as_tensor(x) >= 0).all() for x in ss["score_range"])
    table = geometry.per_layer_table(res)
    assert len(table) == model.config.num_hidden_layers
    assert ((table["sink_cos_min"] <= table["sink_cos_mean"] + 1e-6) & (table["kavg_cos_min"] <= 1 + 1e-6)).all()


def test_geometry_over_passages(stories):
    """passages=N: Fig. 2's top-x% mass is the mean over N passages of each passage's own value (a one-passage
    run on that window), with a band over them; cos(k_sink, k_avg) has a band over the windows."""
    import unittest.mock as mock

    model, tok = stories
    kw = dict(
        num_random=2,
        random_len=2,
        num_sentences=4,
        sentence_len=16,
        length=40,
        num_queries=2,
        fractions=[0.05, 0.5, 1.0],
    )
    res = geometry.measure(model, tok, 512, geometry.GeometryOptions(**kw, passages=3), show=False)
    text, _ = common.load_text("bundled")
    windows = common.token_windows
    singles = []
    for p in range(3):

        def one(tok_, text_, length, count, add_bos=True, skip=0, p=p):
            if length == 40:  # the passages: window p of the three-passage run
                return windows(tok_, text_, length, 3, add_bos, skip)[p : p + 1]
            return windows(tok_, text_, length, count, add_bos, skip)

        with mock.patch.object(common, "token_windows", one):
            singles.append(geometry.measure(model, tok, 512, geometry.GeometryOptions(**kw), show=False))
    for l in (0, 3):
        per = torch.stack([torch.as_tensor(r["top_mass"]["with_sink"][l]).double() for r in singles])  # [3, F]
        assert torch.allclose(torch.as_tensor(res["top_mass"]["with_sink"][l]).double(), per.mean(0), atol=1e-12)
        lo, hi = (torch.as_tensor(res["top_mass"][f"with_sink_{e}"][l]) for e in ("lo", "hi"))
        assert (lo <= per.mean(0) + 1e-12).all() and (per.mean(0) <= hi + 1e-12).all()
        assert (lo >= per.min(0).values - 1e-12).all() and (hi <= per.max(0).values + 1e-12).all()
        assert res["sink_avg_cos"]["lo"][l] <= float(torch.as_tensor(res["sink_avg_cos"]["mean"][l]).mean()) + 1e-9
    table = geometry.per_layer_table(res)
    assert {"sink_avg_cos_lo", "top5%_mass_lo", "top5%_mass_no_sink_hi"} <= set(table.columns)


def test_geometry_figures_written(stories, tmp_path):
    model, tok = stories
    opts = geometry.GeometryOptions(
        num_random=2, random_len=2, num_sentences=2, sentence_len=8, length=24, num_queries=2, fractions=[0.5, 1.0]
    )
    res = geometry.measure(model, tok, 512, opts)
    paths = geometry.figures(res, tmp_path, "stories260k", opts)
    pngs = [p for p in paths if p.suffix == ".png"]
    assert len(pngs) == 5 and all(p.stat().st_size > 10_000 for p in pngs)
    assert all(p.exists() for p in paths if p.suffix == ".pdf")


def test_error_vs_budget(stories, tmp_path):
    model, tok = stories
    opts = error_vs_budget.ErrorOptions(
        length=64, num_queries=2, layers=[1, 3], budgets=[0.1, 0.5, 1.0], magicpig=[[4, 8]], repeats=2
    )
    recs = error_vs_budget.measure(model, tok, 512, opts)
    topk = {(r["layer"], r["budget"]): r for r in recs if r["method"] == "topk"}
    for layer in (1, 3):
        assert topk[(layer, 1.0)]["error"] < 1e-5  # every key kept: exact
        assert topk[(layer, 1.0)]["cost2"] == pytest.approx(1.0)
        assert topk[(layer, 0.1)]["error"] >= topk[(layer, 0.5)]["error"] - 1e-6
    oracle = [r for r in recs if r["method"] == "oracle"]
    assert oracle and all(r["unique"] <= r["draws"] + 1e-9 for r in oracle)
    # Theorem 3.3 bounds E|S|: the mean over rows, seeds and layers stays under the mean bound
    assert sum(r["unique"] for r in oracle) <= sum(r["bound"] for r in oracle) + 1e-6
    mp = [r for r in recs if r["method"] == "magicpig"]
    assert len(mp) == 4 and all(0 < r["cost2"] <= 1 for r in mp)
    summary = error_vs_budget.summarize(recs)
    assert set(summary["layer"]) == {1, 3, "mean"}
    paths = error_vs_budget.figures(summary, tmp_path, "stories260k", opts, 5)
    assert {p.name for p in paths if p.suffix == ".png"} == {
        "fig6_error_vs_budget.png",
        "fig4_topk_error_per_layer.png",
        "thm33_oracle_unique_samples.png",
    }
    assert all(p.stat().st_size > 10_000 for p in paths)


def test_error_vs_budget_over_passages(stories, tmp_path):
    """passages=N measures N consecutive windows; passage p's records are those of a one-passage run on window p
    alone; the summary's error is the mean over passages (of the mean over seeds) and its band the percentile
    bootstrap of that mean over the passages."""
    import numpy as np

    from sparse_eval.analysis import common
    from sparse_eval.metrics.statistics import N_BOOT

    model, tok = stories
    opts = error_vs_budget.ErrorOptions(
        length=48,
        num_queries=2,
        layers=[2],
        budgets=[0.1, 1.0],
        magicpig=[[4, 8]],
        repeats=2,
        passages=3,
        methods=["topk", "oracle"],
    )
    recs = error_vs_budget.measure(model, tok, 512, opts)
    assert sorted({r["passage"] for r in recs}) == [0, 1, 2]
    text, _ = common.load_text("bundled")
    ids = common.token_windows(tok, text, 48, 3)
    one = error_vs_budget.ErrorOptions(**{**opts.__dict__, "passages": 1})
    import unittest.mock as mock

    with mock.patch.object(common, "token_windows", lambda *a, **k: ids[2:3]):
        alone = error_vs_budget.measure(model, tok, 512, one)
    third = [r for r in recs if r["passage"] == 2]
    assert [r["error"] for r in third] == [r["error"] for r in alone]
    summary = error_vs_budget.summarize(recs)
    row = summary[(summary["layer"] == 2) & (summary["method"] == "oracle") & (summary["budget"] == 0.1)].iloc[0]
    per = [
        np.mean([r["error"] for r in recs if r["passage"] == p and r["method"] == "oracle" and r["budget"] == 0.1])
        for p in range(3)
    ]
    assert row["error"] == pytest.approx(np.mean(per)) and row["passages"] == 3
    rng = np.random.default_rng(0)  # the bootstrap by hand: resample the 3 passages, 2000 times
    means = rng.multinomial(3, [1 / 3] * 3, size=N_BOOT) @ np.array(per) / 3
    assert (row["error_lo"], row["error_hi"]) == pytest.approx(tuple(np.quantile(means, [0.025, 0.975])))
    assert row["error_lo"] <= row["error"] <= row["error_hi"]
    paths = error_vs_budget.figures(summary, tmp_path, "stories260k", opts, 5)
    assert any(p.name == "fig6_error_vs_budget.png" for p in paths)


def test_ds_online_scores_brute_force():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 3, 5, generator=g)
    k = torch.randn(1, 2, 7, 5, generator=g)
    s = ds_checks.online_scores(q, k, "qk")
    for h, r, c in itertools.product(range(4), range(3), range(5)):
        t = 7 - 3 + r  # key index of the row
        want = sum(abs(float(q[0, h, r, c] * k[0, h // 2, j, c])) for j in range(t + 1)) / (t + 1)
        assert float(s[0, h, r, c]) == pytest.approx(want, rel=1e-5)
    rank = ds_checks.rank_channels(torch.tensor([[0.1, 0.9, 0.5, 0.3]]))
    assert rank.tolist() == [[1, 2, 3, 0]]
    ov = ds_checks.topk_overlap(rank, torch.tensor([[[0.1, 0.9, 0.5, 0.3]]]), [0.25, 0.5, 1.0])
    assert torch.allclose(ov, torch.ones_like(ov))  # identical rankings overlap fully
    ov = ds_checks.topk_overlap(rank, torch.tensor([[[0.9, 0.1, 0.3, 0.5]]]), [0.25, 0.5, 1.0])
    assert ov[0, 0].tolist() == [0.0, 0.0, 1.0]


def test_ds_checks_measure(stories):
    model, tok = stories
    opts = ds_checks.DSCheckOptions(
        block_size=48, calib_blocks=1, online_blocks=1, num_queries=4, hidden_blocks=1, ratios=[0.25, 0.5, 1.0]
    )
    res = ds_checks.measure(model, tok, 512, opts)
    m = torch.as_tensor(res["overlap_mean"])
    assert ((m >= 0) & (m <= 1)).all() and m[-1] == pytest.approx(1.0)
    sim = res["layer_similarity"]
    assert len(sim["hidden_cos"]) == model.config.num_hidden_layers - 1
    assert all(-1 <= x <= 1 for x in sim["hidden_cos"] + sim["query_cos"])


def _compose(overrides):
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import CONF_DIR

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="analysis", overrides=overrides)


def test_app_composes_each_analysis_with_its_defaults():
    for name in ("geometry", "error_vs_budget", "ds_checks"):
        cfg = _compose([f"analysis={name}", "paths.data_dir=/data"])
        got, opts = app.analysis_of(cfg)
        assert got == name
        defaults = type(opts)()
        defaults.data_dir = "/data"  # from paths.data_dir
        assert opts == defaults  # conf/analysis/<name>.yaml holds the dataclass's defaults
    _, opts = app.analysis_of(
        _compose(["analysis=error_vs_budget", "analysis.budgets=[0.1,0.5]", "analysis.layers=[1,3]"])
    )
    assert opts.budgets == [0.1, 0.5] and opts.layers == [1, 3]


def test_app_errors_name_the_bad_value():
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="bogus"):
        _compose(["analysis=geometry", "analysis.bogus=1"])
    with pytest.raises(ConfigCompositionException, match="ds_checks"):  # lists the valid analyses
        _compose(["analysis=nope"])
    with pytest.raises(ConfigCompositionException, match="not_a_model"):
        _compose(["model=not_a_model"])
    with pytest.raises(ValueError, match="budgets"):
        app.run(_compose(["analysis=error_vs_budget", "analysis.budgets=[0,2]"]))


def test_app_prints_a_summary_and_names_the_full_table(tmp_path):
    cfg = _compose(
        [
            "analysis=geometry",
            "analysis.num_random=2",
            "analysis.random_len=2",
            "analysis.num_sentences=2",
            "analysis.sentence_len=8",
            "analysis.length=24",
            "analysis.num_queries=2",
            "analysis.fractions=[0.5,1.0]",
            f"analysis.out={tmp_path}",
        ]
    )
    res = app.run(cfg)
    text = app.summary(res)
    full = tmp_path / "geometry_per_layer.csv"
    assert res["table_file"] == full and full.exists()
    lines = text.splitlines()
    assert f"full table (5 rows x {len(res['table'].columns)} columns): {full}" in lines
    head = lines[0].split()
    assert head == ["quantity", "mean", "min", "max"]  # one row per headline quantity, not a column per quantity
    assert "top50%_mass" in text and "top100%_mass" not in text
    sink_min = res["table"]["sink_cos_min"]
    row = next(line.split() for line in lines if line.split()[:1] == ["sink_cos_min"])
    assert float(row[2]) == pytest.approx(float(sink_min.min()), rel=1e-3, abs=1e-4)


def test_magicpig_kl_expectation_and_search(stories, tmp_path):
    """The expected Cost2 of (K, L) is eq. 10 summed by hand; the chosen L is the smallest reaching the target; the
    method's measured Cost2 at that (K, L) is recorded beside it."""
    import math

    from sparse_eval.analysis import magicpig_kl as mk

    model, tok = stories
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(1, 4, 2, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g)
    p, n_static = mk.bit_agreement(q, k, sink=2, local=4)
    # by hand: row r (of 2, the last rows of 40 keys) has 39 + r keys, 2 + 4 static, the rest candidates
    kc = k[0].double() - k[0, :, 2:35].double().mean(1, keepdim=True)  # μ over the first row's candidates
    cos = torch.nn.functional.cosine_similarity(q[0, 0, 1].double()[None], kc[0, 2:36], dim=-1)
    want = 1 - torch.arccos(cos) / math.pi
    assert torch.allclose(p[0, 1, 2:36], want) and p[0, 1, :2].isnan().all() and p[0, 1, 36:].isnan().all()
    u = lambda x: sum(math.comb(6, j) * x ** (3 * j) * (1 - x**3) ** (6 - j) for j in range(2, 7))  # K=3, L=6
    rows = [(6 + sum(u(float(x)) for x in p[h, r][~p[h, r].isnan()])) / (39 + r) for h in range(4) for r in range(2)]
    assert mk.expected_cost2([(p, n_static)], 3, 6, 2) == pytest.approx(sum(rows) / 8, rel=1e-9)
    target = mk.expected_cost2([(p, n_static)], 3, 6, 2)
    assert mk.smallest_L([(p, n_static)], 3, target, 2, 50) == 6
    opts = mk.MagicPIGKLOptions(
        Ks=[4], length=200, layers=[2], target_cost2=0.5, sink=2, local=8, repeats=1, pairs=[[3, 6]]
    )
    res = mk.measure(model, tok, 512, opts)
    (rec,) = res["records"]
    assert rec["L"] is not None and rec["expected_cost2"] >= 0.5 and 0 < rec["measured_cost2"] <= 1
    assert 0 < rec["measured_mass"] <= 1 and 0 < rec["expected_mass"] <= 1
    assert [(r["K"], r["L"], r["chosen"]) for r in res["top_keys"]] == [(4, rec["L"], True), (3, 6, False)]
    table = mk.top_keys_table(res["top_keys"])
    assert table["layer"].tolist() == [2, "mean", 2, "mean"] and (table["passages"] == 1).all()
    assert [p.name for p in mk.top_keys_figure(table, tmp_path, "stories260k", 200)] == [
        "magicpig_top_keys.png",
        "magicpig_top_keys.pdf",
    ]
    with pytest.raises(ValueError, match="static keys"):
        mk.measure(model, tok, 512, mk.MagicPIGKLOptions(length=64, layers=[2], target_cost2=0.02))


def test_magicpig_top_keys_by_hand():
    """top_keys: the attention's mass on the static keys, its expected mass under eq. 10 and the heaviest
    candidate keys' p and u, each summed by hand from softmax(q·k·scaling) and p."""
    import math

    from sparse_eval.analysis import magicpig_kl as mk
    from sparse_eval.analysis.capture import LayerQKV

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(1, 2, 2, 8, generator=g), 2 * torch.randn(1, 1, 30, 8, generator=g)
    c = LayerQKV(layer=0, q=q, k=k, v=torch.zeros_like(k), scaling=0.5)
    p, _ = mk.bit_agreement(q, k, sink=1, local=2)
    u = lambda x: sum(math.comb(6, j) * x ** (3 * j) * (1 - x**3) ** (6 - j) for j in range(2, 7))  # K=3, L=6
    got = mk.top_keys(c, p, 3, 6, 2, top_frac=0.1)
    kc = k[0, 0].double() - k[0, 0, ~p[0, 0].isnan()].double().mean(0)  # k − μ, μ over the first row's candidates
    static, expected, top_p, top_u, top_cos, sampled = [], [], [], [], [], []
    for h in range(2):
        for r in range(2):
            n = 29 + r  # row r of the last 2 rows sees keys 0 .. 28 + r
            w = torch.softmax(0.5 * (k[0, 0, :n].double() @ q[0, h, r].double()), 0)
            cand = ~p[h, r, :n].isnan()
            static.append(float(w[~cand].sum()))
            expected.append(static[-1] + sum(float(w[i]) * u(float(p[h, r, i])) for i in range(n) if cand[i]))
            heavy = sorted((i for i in range(n) if cand[i]), key=lambda i: -float(w[i]))[:3]  # ceil(0.1 · 26)
            top_p.append(sum(float(p[h, r, i]) for i in heavy) / 3)
            top_u.append(sum(u(float(p[h, r, i])) for i in heavy) / 3)
            top_cos.append(sum(float(torch.cosine_similarity(q[0, h, r].double(), kc[i], 0)) for i in heavy) / 3)
            sampled.append(sum(float(w[i]) * u(float(p[h, r, i])) for i in heavy) / sum(float(w[i]) for i in heavy))
    assert got["top_keys"] == 3
    for key, want in (
        ("static_mass", static),
        ("expected_mass", expected),
        ("top_p", top_p),
        ("top_u", top_u),
        ("top_cos", top_cos),
        ("top_mass_sampled", sampled),
    ):
        assert got[key] == pytest.approx(sum(want) / 4, rel=1e-6), key  # scores in fp32 there


def test_analysis_provenance_is_taken_before_measuring(monkeypatch, tmp_path):
    """An analysis names the commit its run started at: a commit made while it measures (the tree changing under
    a long run) is not credited to it; the record also says when it finished."""
    import sparse_eval.identity.provenance as prov

    head = {"commit": "a" * 40, "dirty": False}
    monkeypatch.setattr(prov, "git_commit", lambda *a, **k: dict(head))
    model_cfg = common.ModelConfig(device="cpu", dtype="float32")

    def measure(model, tok, context, opts):
        head["commit"] = "b" * 40  # a commit lands while the analysis measures
        return {"text": "bundled", "per_layer": []}

    monkeypatch.setattr(common, "load", lambda cfg: (None, None, 512))
    opts = geometry.GeometryOptions(out=str(tmp_path))
    res = common.run_measured(
        "probe", model_cfg, opts, measure, lambda r: __import__("pandas").DataFrame(), lambda *a: []
    )
    assert res["result"]["provenance"]["git"]["commit"] == "a" * 40
    assert res["result"]["provenance"]["text"] == "bundled" and "finished" in res["result"]["provenance"]


# -- models whose layers attend within a sliding window of their own (Gemma 3) -------------------------------


def test_attention_probs_are_the_model_s_own_in_sliding_and_full_layers():
    """On a tiny Gemma 3 (layers 0 and 2 slide over 8 keys), the weights the analyses compute from captured q, K
    equal transformers' eager attention weights, the window included; without the window they would not."""
    from helpers import WINDOW, tiny_gemma3

    from sparse_eval.models.inspection import sliding_layers

    model = tiny_gemma3()
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(4))  # 30 keys > the window
    cap = capture_qkv(model, ids, query_rows=3)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        ref = model(ids, output_attentions=True).attentions  # [L] of [1, Hq, 30, 30]
    windows = sliding_layers(model)
    assert windows == {0: WINDOW, 2: WINDOW}
    for layer, c in cap.items():
        p = geometry.attention_probs(c.q, c.k, c.scaling, windows.get(layer))
        torch.testing.assert_close(p, ref[layer][:, :, -3:].float(), rtol=1e-4, atol=1e-6)
    p0 = geometry.attention_probs(cap[0].q, cap[0].k, cap[0].scaling)  # the whole context: not the layer's weights
    assert not torch.allclose(p0, ref[0][:, :, -3:].float(), atol=1e-3)


def test_geometry_measures_a_sliding_layer_over_its_window(stories):
    from helpers import WINDOW, tiny_gemma3

    _, tok = stories
    model = tiny_gemma3(vocab=tok.vocab_size)
    opts = geometry.GeometryOptions(
        num_random=2, random_len=3, num_sentences=2, sentence_len=16, length=40, num_queries=3, fractions=[0.125, 1.0]
    )
    res = geometry.measure(model, tok, 256, opts)
    assert res["window"] == [WINDOW, None, WINDOW, None]
    assert res["score_spread_example"]["layer"] == 2 and len(res["score_spread_example"]["scores"]) == WINDOW
    table = geometry.per_layer_table(res)
    assert table["window"].tolist()[::2] == [WINDOW, WINDOW] and table["window"].isna().tolist()[1::2] == [True, True]


def test_estimates_are_refused_on_a_sliding_layer(stories):
    """error_vs_budget and magicpig_kl measure estimators over the whole context: by default only on the layers
    that see it; a sliding-window layer named explicitly is refused with the layers to pick instead.  A context no
    longer than the window is seen whole by every layer."""
    from helpers import tiny_gemma3

    from sparse_eval.analysis import magicpig_kl as mk

    _, tok = stories
    model = tiny_gemma3(vocab=tok.vocab_size)
    opts = error_vs_budget.ErrorOptions(length=40, num_queries=2, budgets=[0.5, 1.0], magicpig=[], methods=["topk"])
    assert {r["layer"] for r in error_vs_budget.measure(model, tok, 256, opts)} == {1, 3}
    bad = error_vs_budget.ErrorOptions(length=40, num_queries=2, layers=[0, 1], budgets=[1.0], methods=["topk"])
    with pytest.raises(
        ValueError, match=r"layer 0 attends within a window of 8 keys, shorter than the 40-token context.*\[1, 3\]"
    ):
        error_vs_budget.measure(model, tok, 256, bad)
    with pytest.raises(ValueError, match=r"layer 2 attends within a window of 8 keys"):
        mk.measure(model, tok, 256, mk.MagicPIGKLOptions(Ks=[4], length=120, layers=[2], sink=2, local=8))
    assert common.full_context_layers(model, None, 4, 8) == [0, 1, 2, 3]  # 8 keys: within every window
    # Mistral-7B-v0.1's one window for every layer (4096): all layers up to it, none beyond
    from conftest import tiny_model

    mistral = tiny_model("mistral")
    n = mistral.config.num_hidden_layers
    assert common.full_context_layers(mistral, None, n, 4096) == list(range(n))
    with pytest.raises(ValueError, match="every layer attends within a window of 4096 keys"):
        common.full_context_layers(mistral, None, n, 4097)


def test_error_vs_budget_resumes_where_it_stopped(stories, tmp_path, monkeypatch):
    """A run stopped after its first passage keeps it (``error_records.partial.jsonl``; a line cut short by the kill
    is dropped); the same command measures only the rest and gives the records of a run never stopped; the finished
    files replace the partial one, and a partial file of other options is refused."""
    model, tok = stories
    model_cfg = common.ModelConfig(device="cpu", dtype="float32")
    monkeypatch.setattr(common, "load", lambda cfg: (model, tok, 512))
    monkeypatch.setattr(error_vs_budget, "figures", lambda *a, **k: [])
    base = dict(length=48, num_queries=2, layers=[2], budgets=[0.1, 1.0], repeats=1, methods=["topk", "oracle"])
    whole = error_vs_budget.run(model_cfg, error_vs_budget.ErrorOptions(**base, passages=2, out=str(tmp_path / "a")))
    real, calls = error_vs_budget._measure_passage, []

    def stop_at_second(*a, **k):
        calls.append(a[8])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*a, **k)

    opts = error_vs_budget.ErrorOptions(**base, passages=2, out=str(tmp_path / "b"))
    monkeypatch.setattr(error_vs_budget, "_measure_passage", stop_at_second)
    with pytest.raises(KeyboardInterrupt):
        error_vs_budget.run(model_cfg, opts)
    partial = tmp_path / "b" / error_vs_budget.PARTIAL
    assert len(partial.read_text().splitlines()) == 1
    # killed while writing the second passage: a line cut short
    partial.write_text(partial.read_text() + '{"key": "a line cut sh')
    calls.clear()
    monkeypatch.setattr(error_vs_budget, "_measure_passage", lambda *a, **k: calls.append(a[8]) or real(*a, **k))
    resumed = error_vs_budget.run(model_cfg, opts)
    assert calls == [" (passage 2/2)"]
    plain = lambda recs: json.loads(json.dumps(common.jsonable(recs)))  # noqa: E731
    assert plain(resumed["records"]) == plain(whole["records"])
    assert not partial.exists() and (tmp_path / "b" / "error_vs_budget.csv").is_file()
    partial.write_text(json.dumps({"key": "other", "passage": 0, "records": []}) + "\n")
    with pytest.raises(ValueError, match="other options"):
        error_vs_budget.run(model_cfg, opts)


def test_error_vs_budget_refuses_to_resume_passages_of_another_dtype(stories, tmp_path, monkeypatch):
    """``dtype=auto`` is float32 on a CPU and bfloat16 on a GPU: passages measured in one are not resumed in the
    other (the key is the model as loaded, not its config)."""
    import copy

    model, tok = stories
    model_cfg = common.ModelConfig(device="cpu")
    monkeypatch.setattr(error_vs_budget, "figures", lambda *a, **k: [])
    opts = error_vs_budget.ErrorOptions(
        length=48,
        num_queries=2,
        layers=[2],
        budgets=[1.0],
        repeats=1,
        methods=["topk"],
        passages=2,
        out=str(tmp_path / "c"),
    )
    real = error_vs_budget._measure_passage

    class Stop(Exception):
        pass

    def stop_at_second(*a, **k):
        if "2/2" in a[8]:
            raise Stop
        return real(*a, **k)

    monkeypatch.setattr(common, "load", lambda cfg: (model, tok, 512))
    monkeypatch.setattr(error_vs_budget, "_measure_passage", stop_at_second)
    with pytest.raises(Stop):
        error_vs_budget.run(model_cfg, opts)
    assert (tmp_path / "c" / error_vs_budget.PARTIAL).is_file()
    half = copy.deepcopy(model).to(torch.bfloat16)
    monkeypatch.setattr(common, "load", lambda cfg: (half, tok, 512))
    with pytest.raises(ValueError, match="the dtype it ran in"):
        error_vs_budget.run(model_cfg, opts)
