"""Layers that attend within a sliding window (Gemma 3): they keep their window, and ``method.sliding_layers`` says
whether they run dense (default) or sparse.  A tiny random-weight Gemma 3 text model: 4 layers, layers 0 and 2
sliding with an 8-key window, 1 and 3 full."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from helpers import WINDOW, tiny_gemma3
from sparse_eval.attention.plugin import Runtime, attach, detach, layer_plan, make_cache
from sparse_eval.models.inspection import attention_window, layer_windows, sliding_layers
from sparse_eval.config import register_configs
from sparse_eval.methods import build_method, make_config
from sparse_eval.results.store import run_dir_for
from sparse_eval.config import CONF_DIR
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config
from sparse_eval.launcher.runner import run

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "sparse_eval" / "models" / "stories260K"
register_configs()


def method(name, **opts):
    return build_method(make_config(name, opts))


def logits(model, ids, meth=None, runtime=None):
    """Teacher-forced logits [B, T, V]: stock sdpa without ``meth``, else through the plug-in."""
    model.set_attn_implementation("sdpa")
    session = None
    if meth is not None:
        session = attach(model, meth, runtime)
    try:
        with torch.no_grad():
            return model(ids).logits, session
    finally:
        detach(model)
        model.set_attn_implementation("sdpa")


IDS = torch.randint(3, 128, (2, 30), generator=torch.Generator().manual_seed(1))  # 30 keys > the 8-key window


def test_sliding_layers_found_from_the_config():
    model = tiny_gemma3()
    assert sliding_layers(model) == {0: WINDOW, 2: WINDOW} == layer_windows(model)
    assert attention_window(model) == WINDOW
    from conftest import tiny_model

    assert sliding_layers(tiny_model("llama")) == {} and attention_window(tiny_model("llama")) is None
    # Mistral's one window for every layer: no sliding layers (all layers alike), but the window is the model's
    assert sliding_layers(tiny_model("mistral")) == {} and attention_window(tiny_model("mistral")) == 4096
    n = tiny_model("mistral").config.num_hidden_layers
    assert (
        layer_windows(tiny_model("mistral")) == dict.fromkeys(range(n), 4096)
        and layer_windows(tiny_model("llama")) == {}
    )


def test_full_through_the_plugin_equals_stock_logits_exactly():
    model = tiny_gemma3()
    ref, _ = logits(model, IDS)
    out, _ = logits(model, IDS, method("full"))
    assert torch.equal(ref, out)
    # and in generate past the window, with the plug-in's cache (every key kept, the mask applies the window)
    # against stock's (sliding layers keep only their window): the same tokens, logits to float rounding
    kw = dict(max_new_tokens=6, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        stock = model.generate(IDS, **kw)
        attach(model, method("full"))
        try:
            mine = model.generate(IDS, cache=make_cache(model), **kw)
        finally:
            detach(model)
    assert torch.equal(stock.sequences, mine.sequences)
    for a, b in zip(stock.logits, mine.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_dense_sliding_layers_are_the_sliding_layers_made_dense():
    model = tiny_gemma3()
    s_ = Runtime(protocol="S")
    dense_mode, session = logits(model, IDS, method("topk", budget=2, sink=1, local=2, dense_layers=[1]), s_)
    assert session.sliding_dense_layers == [0, 2] and session.dense_layers == {0, 1, 2}
    assert session.recorder.summary()["sparse_layers"] == [3]
    # the same as naming the sliding layers in dense_layers and making sliding layers sparse
    listed, session = logits(
        model, IDS, method("topk", budget=2, sink=1, local=2, dense_layers=[0, 1, 2], sliding_layers="sparse"), s_
    )
    assert session.sliding_dense_layers == [] and torch.equal(dense_mode, listed)
    stock, _ = logits(model, IDS)
    assert not torch.allclose(dense_mode, stock, atol=1e-3)  # layer 3 is really sparse


def test_sparse_sliding_layers_keep_their_window():
    model = tiny_gemma3()
    topk_all = method("topk", budget=1.0, sink=1, local=2, dense_layers=[], sliding_layers="sparse")
    seen: dict[int, int] = {}
    select = topk_all.select

    def spy(ctx):  # the most keys a row of each layer may see
        seen[ctx.layer_idx] = max(seen.get(ctx.layer_idx, 0), int(ctx.valid.sum(-1).max()))
        return select(ctx)

    topk_all.select = spy
    out, session = logits(model, IDS, topk_all, Runtime(protocol="S"))
    assert session.recorder.summary()["sparse_layers"] == [0, 1, 2, 3]
    assert seen == {0: WINDOW, 1: IDS.shape[1], 2: WINDOW, 3: IDS.shape[1]}
    # every key the window allows, and only those: the windowed model's logits (and not the unwindowed one's)
    stock, _ = logits(model, IDS)
    torch.testing.assert_close(out, stock, rtol=1e-4, atol=1e-4)
    wide = tiny_gemma3(window=1024)
    wide.load_state_dict(model.state_dict())
    unwindowed, _ = logits(wide, IDS)
    assert not torch.allclose(unwindowed, stock, atol=1e-3)


class _Tok:
    pad_token_id = 0


def _stock_nll(model, window: list[int]) -> float:
    """The model's own ``labels=`` loss of a window alone (stock sdpa: its sliding layers keep their window), summed."""
    model.set_attn_implementation("sdpa")
    ids = torch.tensor([window])
    with torch.no_grad():
        return float(model(input_ids=ids, labels=ids).loss) * (len(window) - 1)


@pytest.mark.parametrize("chunk", [None, 7])
@pytest.mark.parametrize("invariant", [True, False], ids=["batch_invariant", "stock_sdpa"])
@pytest.mark.parametrize("meth", ["full", "topk_keep_all"])
def test_every_dense_path_attends_within_the_sliding_window(meth, invariant, chunk):
    """The engine's dense attention, batch-invariant (the invariant kernel, each row from its first key) or stock
    sdpa, whole or in prefill chunks, for full attention and for the dense sliding layers of a sparse method (TopK
    keeping every key elsewhere): a left-padded batch of windows longer than the 8-key window gets each window's own
    stock NLL, which attends within the window, and not the NLL of the same weights without a window."""
    from sparse_eval.generation.engine import Engine, LoglikelihoodRequest

    model = tiny_gemma3()
    wide = tiny_gemma3(window=1024)
    wide.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(7)
    windows = [[1] + torch.randint(3, 128, (n - 1,), generator=gen).tolist() for n in (30, 19)]
    refs = [_stock_nll(model, w) for w in windows]
    unwindowed = [_stock_nll(wide, w) for w in windows]
    assert all(abs(a - b) > 0.05 for a, b in zip(refs, unwindowed))  # the window matters here (by 0.09 and 0.4)
    m = method("full") if meth == "full" else method("topk", budget=1.0, sink=1, local=2, dense_layers=[])
    session = attach(model, m, Runtime(protocol="S", batch_invariant=invariant, compute_error=False))
    try:
        got = Engine(model, _Tok(), session, chunk).nll_batch([LoglikelihoodRequest(w) for w in windows])
    finally:
        detach(model)
    assert meth == "full" or session.sliding_dense_layers == [0, 2]
    for r, ref, far in zip(got, refs, unwindowed):
        assert abs(r.nll_sum - ref) < 1e-3, (  # float noise: ~1e-5; the window moves these NLLs by 0.09 and 0.4
            f"NLL {r.nll_sum:.6f}: the window's stock NLL is {ref:.6f}, without the sliding window {far:.6f}"
        )


def test_batch_invariant_dense_attention_without_row_starts_keeps_the_window():
    """Inside ``batch_invariant()`` with no row starts from the engine (a model called directly), dense attention
    goes through the mask (``core.dense_attention``): the logits are the windowed model's."""
    from sparse_eval.invariance import batch_invariant

    model = tiny_gemma3()
    stock, _ = logits(model, IDS)
    attach(model, method("full"))
    try:
        with torch.no_grad(), batch_invariant():
            out = model(IDS).logits
    finally:
        detach(model)
        model.set_attn_implementation("sdpa")
    torch.testing.assert_close(out, stock, rtol=1e-4, atol=1e-4)
    wide = tiny_gemma3(window=1024)
    wide.load_state_dict(model.state_dict())
    unwindowed, _ = logits(wide, IDS)
    assert not torch.allclose(unwindowed, stock, rtol=1e-4, atol=1e-4)  # the window matters here


def test_a_method_left_with_no_sparse_layer_is_refused():
    model = tiny_gemma3()
    with pytest.raises(ValueError, match=r"would run in no layer.*method.sliding_layers=sparse"):
        attach(model, method("topk", dense_layers=[1, 3]))
    assert layer_plan(method("topk", dense_layers=[1, 3], sliding_layers="sparse"), 4, sliding_layers(model)) == (
        {1, 3},
        [],
    )
    with pytest.raises(ValueError, match=r"method.sliding_layers='both'; valid: \['dense', 'sparse'\]"):
        method("topk", sliding_layers="both")


def test_the_system_path_refuses_a_window_it_cannot_apply():
    from sparse_eval.system.session import build_layers

    model = tiny_gemma3()
    with pytest.raises(ValueError, match=r"8-token sliding window.*9 tokens"):
        build_layers(model, method("full"), 9)
    layers = build_layers(model, method("quest", page_size=2, budget=2, sink=1, local=1, dense_layers=[1]), 8)
    assert [type(x).__name__ for x in layers][:3] == ["FullLayer"] * 3 and type(layers[3]).__name__ != "FullLayer"


def _tiny_gemma_dir(tmp_path) -> Path:
    """The tiny Gemma 3 saved with stories260K's tokenizer, as a local checkpoint the runner can load."""
    d = tmp_path / "tiny_gemma3"
    tiny_gemma3(vocab=512).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(STORIES / f, d / f)
    return d


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(
            config_name="config",
            overrides=[
                f"paths.runs_dir={tmp_path / 'runs'}",
                "task.window=32",
                "task.num_samples=1",
                "print_table=false",
                *overrides,
            ],
        )


def test_the_setting_is_in_the_run_identity_and_the_summary(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    d = _tiny_gemma_dir(tmp_path)
    over = (f"model.path={d}", "model.name=tiny_gemma3", "method=topk", "method.budget=2", "method.dense_layers=[1]")
    dense = run(_cfg(tmp_path, *over))[0]
    sparse = run(_cfg(tmp_path, *over, "method.sliding_layers=sparse"))[0]
    assert dense["run_dir"] != sparse["run_dir"]
    assert dense["method_config"]["sliding_layers"] == "dense" and dense["sliding_dense_layers"] == [0, 2]
    assert sparse["method_config"]["sliding_layers"] == "sparse" and sparse["sliding_dense_layers"] == []
    assert dense["cost2_per_layer"].keys() == {"3"} and sparse["cost2_per_layer"].keys() == {"0", "2", "3"}
    # a model without sliding layers: the setting cannot change a result and stays out of its identity
    exp = Experiment(run_config(_cfg(tmp_path, "method=topk", "method.sliding_layers=sparse")))
    ident = exp.identity(exp.method_configs()[0])
    assert "sliding_layers" not in ident["method"]
    assert run_dir_for(tmp_path, ident) == run_dir_for(
        tmp_path,
        Experiment(run_config(_cfg(tmp_path, "method=topk"))).identity(
            Experiment(run_config(_cfg(tmp_path, "method=topk"))).method_configs()[0]
        ),
    )
