"""The attention plug-in inside real models: parity with stock sdpa, padding, protocols, architectures."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from sparse_eval.attention.plugin import Runtime, attach, detach, make_cache
from sparse_eval.generation.engine import Engine
from sparse_eval.methods import build_method, make_config


def method(name, **opts):
    return build_method(make_config(name, opts))


@torch.inference_mode()
def test_full_equals_stock_sdpa_on_shipped_model(stories):
    model, tok = stories
    ids = tok(
        ["Once upon a time, there was a little dog who", "Tom and Lily went to the park"],
        return_tensors="pt",
        padding=True,
    )
    kw = dict(
        max_new_tokens=24,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=tok.pad_token_id,
    )
    model.set_attn_implementation("sdpa")
    ref = model.generate(**ids, **kw)
    attach(model, method("full"))
    try:
        out = model.generate(**ids, **kw)
    finally:
        detach(model)
        model.set_attn_implementation("sdpa")
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,opts", [("topk", {"budget": 0.3}), ("oracle", {"budget": 0.5})])
@torch.inference_mode()
def test_padded_batch_equals_rows_alone(name, opts):
    model = tiny_model("llama")
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :9] = 0
    attach(model, method(name, sink=2, local=4, dense_layers=[0], **opts))
    kw = dict(max_new_tokens=8, do_sample=False, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    batched = model.generate(ids, attention_mask=mask, **kw)
    alone = model.generate(ids[1:, 9:], **kw)
    detach(model)
    assert torch.equal(batched.sequences[1, -8:], alone.sequences[0, -8:])
    for a, b in zip(batched.logits, alone.logits):
        torch.testing.assert_close(a[1], b[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2"])
@torch.inference_mode()
def test_generate_on_architectures_with_custom_cache(kind):
    model = tiny_model(kind)
    session = attach(model, method("topk", budget=0.25, sink=1, local=2, dense_layers=[0]))
    ids = torch.randint(3, 256, (1, 30))
    out = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, cache=make_cache(model))
    s = session.recorder.summary()
    detach(model)
    assert out.shape[1] == 36
    # decode steps 2..6 each run layers 1 and 2 sparse (step 1 is the prefill's last logits), 4 heads each
    assert s["sparse_rows"] == 5 * 2 * 4
    assert s["sparse_layers"] == [1, 2] and 0 < s["cost2"] < 1


@pytest.mark.parametrize("protocol", ["A", "B", "S"])
@torch.inference_mode()
def test_protocols_make_the_right_positions_sparse(protocol):
    model = tiny_model("llama", layers=2)
    session = attach(model, method("topk", budget=0.5, sink=1, local=1, dense_layers=[0]), Runtime(protocol=protocol))
    engine = Engine(model, tokenizer=_NoTok(), session=session)
    prompt = list(range(5, 35))  # 30 tokens: 20 context + 10 question
    res = engine.generate(prompt, max_new_tokens=5, context_len=20, stop_token_ids=[])
    rows = session.recorder.summary()["sparse_rows"] / 4  # per head, one sparse layer
    new = len(res.tokens)
    assert new == 5
    expected = {"A": new - 1, "B": 10 + new - 1, "S": 30 + new - 1}[protocol]
    assert rows == expected
    detach(model)


@torch.inference_mode()
def test_dense_layers_are_exact_and_checked():
    model = tiny_model("llama", layers=3)
    with pytest.raises(ValueError, match="dense_layers"):
        attach(model, method("topk", dense_layers=[0, 7]))
    session = attach(model, method("topk", budget=0.1, dense_layers=[0, 1, 2]), Runtime(protocol="S"))
    ids = torch.randint(3, 256, (1, 20))
    logits = model(ids).logits
    detach(model)
    model.set_attn_implementation("sdpa")
    torch.testing.assert_close(logits, model(ids).logits)
    assert session.recorder.summary()["sparse_rows"] == 0


@torch.inference_mode()
def test_chunked_prefill_matches_single_pass():
    model = tiny_model("llama", layers=2)
    session = attach(model, method("full"))
    ids = list(range(3, 60))
    one = Engine(model, _NoTok(), session).nll(ids)
    chunked = Engine(model, _NoTok(), session, prefill_chunk=16).nll(ids)
    detach(model)
    assert one[1] == chunked[1] and abs(one[0] - chunked[0]) < 1e-3


class _NoTok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_pass_masks_are_shared_by_the_layers_of_a_pass_only():
    """The decode masks are computed once per forward pass (same mask object and shapes), again for a new mask
    object of the same shapes, and not at all for passes longer than query_chunk (made per block by the core)."""
    from sparse_eval.attention.plugin import SparseSession

    session = SparseSession(build_method(make_config("topk", {"budget": 0.5})), Runtime(query_chunk=4), 2, 2)
    first = session._masks(None, 1, 1, 10, "cpu")
    assert session._masks(None, 1, 1, 10, "cpu") is first
    assert session._masks(None, 1, 1, 11, "cpu") is not first
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    mask[..., :3] = False  # left padding
    padded = session._masks(mask, 1, 1, 10, "cpu")
    assert padded is not first and session._masks(mask, 1, 1, 10, "cpu") is padded
    other = mask.clone()
    other[..., :5] = False
    again = session._masks(other, 1, 1, 10, "cpu")
    assert again is not padded and int(again.n_valid) == 5 and int(padded.n_valid) == 7
    assert session._masks(None, 1, 5, 10, "cpu") is None


@pytest.mark.parametrize("protocol", ["A", "B"])
@torch.inference_mode()
def test_full_records_per_pass_sums_as_per_layer(protocol):
    """Full attention's statistics, computed once per forward pass and added by every layer, equal those computed
    layer by layer (padded batch, rows stopping at different steps, protocol B's per-row phase)."""
    from sparse_eval.attention.plugin import SparseSession
    from sparse_eval.generation.engine import GenerationRequest

    model = tiny_model("llama", layers=3)
    g = torch.Generator().manual_seed(3)
    reqs = [
        GenerationRequest(
            torch.randint(3, 256, (n,), generator=g).tolist(), max_new_tokens=m, context_len=c, stop_token_ids=[]
        )
        for n, m, c in ((30, 6, 20), (22, 3, 15), (27, 5, 10))
    ]
    tables = []
    for memo in (True, False):
        session = attach(model, method("full", sink=2, local=3, dense_layers=[0]), Runtime(protocol=protocol))
        if not memo:
            session._full_sums = lambda *a, _s=session: (_s._full_memo.clear(), SparseSession._full_sums(_s, *a))[1]
        Engine(model, _NoTok(), session).generate_batch(reqs)
        tables.append(session.recorder._stacked)
        detach(model)
    assert tables[0].keys() == tables[1].keys() == {1, 2}
    for layer in tables[0]:
        assert tables[0][layer].keys() == tables[1][layer].keys()
        for entry, sums in tables[0][layer].items():
            assert torch.equal(sums, tables[1][layer][entry])


def test_full_sums_are_shared_by_the_layers_of_a_pass_only():
    from sparse_eval.attention.plugin import SparseSession

    session = SparseSession(build_method(make_config("full", {"sink": 1, "local": 2})), Runtime(), 2, 2)
    first = session._full_sums(None, 1, 2, 1, 10, 64, None, "cpu")
    assert session._full_sums(None, 1, 2, 1, 10, 64, None, "cpu") is first
    assert session._full_sums(None, 1, 2, 1, 11, 64, None, "cpu") is not first
    mask = torch.ones(1, 1, 1, 10, dtype=torch.bool)
    mask[..., :3] = False
    padded = session._full_sums(mask, 1, 2, 1, 10, 64, None, "cpu")
    assert session._full_sums(mask, 1, 2, 1, 10, 64, None, "cpu") is padded
    other = mask.clone()
    assert session._full_sums(other, 1, 2, 1, 10, 64, None, "cpu") is not padded
    with session.counting(torch.zeros(1, 1, dtype=torch.bool)):
        none = session._full_sums(mask, 1, 2, 1, 10, 64, None, "cpu")
    assert none is not padded and float(none[1][0].sum()) == 0.0  # no counted row
    keys, sums = padded
    assert keys[0] == "empty" and float(sums[0].sum()) == 2.0  # one row, two heads


def test_recorder_summary_sees_calls_added_after_an_earlier_summary():
    from sparse_eval.attention.recorder import StatsRecorder

    rec = StatsRecorder(2, 2)
    st = {"rows": torch.ones(1, 2, 1, dtype=torch.bool), "cost2": torch.full((1, 2, 1), 0.5)}
    rec.add(1, st)
    assert rec.summary(row=0)["cost2"] == 0.5 and rec.summary()["sparse_rows"] == 2
    rec.add(1, {**st, "cost2": torch.full((1, 2, 1), 1.0)})
    assert rec.summary(row=0)["cost2"] == 0.75 and rec.summary()["sparse_rows"] == 4
    rec.reset()
    assert rec.summary()["sparse_rows"] == 0


def test_sparse_cache_appends_in_place_and_holds_what_a_dynamic_cache_holds():
    """SparseLayer writes a step's keys into buffers with room to grow (no copy of the whole cache per step); its
    keys and values equal a DynamicCache's through appends, chunks, crops, batch selection and reordering."""
    from transformers.cache_utils import DynamicCache

    from sparse_eval.attention.plugin import SparseCache

    ours, ref = SparseCache(1), DynamicCache()
    g = torch.Generator().manual_seed(0)
    layer = ours.layers[0]

    def append(q: int, b: int = 2):
        k, v = torch.randn(2, b, 3, q, 8, generator=g)
        a, r = ours.update(k, v, 0), ref.update(k, v, 0)
        assert torch.equal(a[0], r[0]) and torch.equal(a[1], r[1])

    append(100)
    buf = layer._kbuf
    for _ in range(5):
        append(1)
    assert layer._kbuf is buf and layer.keys.data_ptr() == buf.data_ptr()  # decode steps wrote in place
    append(700)  # a prefill chunk larger than the room left: new buffers, then in place again
    append(1)
    buf = layer._kbuf
    ours.crop(-7)
    ref.crop(-7)
    append(1)
    assert layer._kbuf is buf  # a crop keeps the buffers: the next step writes over the removed positions
    ours.reorder_cache(torch.tensor([1, 0]))
    ref.reorder_cache(torch.tensor([1, 0]))
    append(2)
    ours.batch_select_indices(torch.tensor([1]))
    ref.batch_select_indices(torch.tensor([1]))
    append(1, b=1)
    assert ours.get_seq_length() == ref.get_seq_length() == 100 + 5 + 700 + 1 - 7 + 1 + 2 + 1


def test_recorder_archive_pools_rows_whatever_their_batching():
    """Rows recorded in one batch of 3 or in batches of 1 and 2 (archived between batches, as lm-eval's
    generation batches are) give the same summary; per-row summaries are refused after archiving."""
    from sparse_eval.attention.recorder import StatsRecorder

    g = torch.Generator().manual_seed(0)
    steps = [torch.rand(3, 2, 1, generator=g) * 10 ** torch.randint(-3, 3, (3, 2, 1), generator=g) for _ in range(5)]

    def call(rec, rows):
        for x in steps:
            rec.add(0, {"rows": torch.ones_like(x[rows], dtype=torch.bool), "cost2": x[rows], "est_error": x[rows] / 7})

    one = StatsRecorder(1, 2)
    call(one, slice(0, 3))
    split = StatsRecorder(1, 2)
    call(split, slice(0, 1))
    split.archive_rows()
    call(split, slice(1, 3))
    split.archive_rows()
    assert split.batch_rows() is None
    a, b = one.summary(), split.summary()
    assert a["sparse_rows"] == b["sparse_rows"] == 3 * 2 * len(steps)
    assert a["cost2"] == b["cost2"] and a["est_error"] == b["est_error"]
    with pytest.raises(ValueError, match="archive_rows"):
        split.summary(row=0)


def test_registration_is_explicit_and_idempotent():
    """Importing the plug-in registers nothing; ``register()`` (called by ``attach``) registers
    the attention function and its mask under ``ATTENTION_NAME``, and again changes nothing."""
    import subprocess
    import sys

    from transformers import AttentionInterface, AttentionMaskInterface

    from sparse_eval.attention.plugin import ATTENTION_NAME, register, sparse_eval_attention

    code = (
        "from transformers import AttentionInterface, AttentionMaskInterface\n"
        "import sparse_eval.attention.plugin as p\n"
        "assert p.ATTENTION_NAME not in AttentionInterface() and p.ATTENTION_NAME not in AttentionMaskInterface()\n"
        "p.register(); p.register()\n"
        "assert AttentionInterface()[p.ATTENTION_NAME] is p.sparse_eval_attention\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    register()
    register()
    assert AttentionInterface()[ATTENTION_NAME] is sparse_eval_attention and ATTENTION_NAME in AttentionMaskInterface()
