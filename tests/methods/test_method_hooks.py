"""``AttentionContext.generating``: whether a sparse call's rows are generated tokens after a finished prompt (every
sparse call under protocol A; under S and B the engine's decode steps, which it runs inside
``SparseSession.generation()``), checked with a method of this file that keeps every key and records what it was
shown (not registered: the registry-driven suites do not see it).  The dense-call hook (``observes_dense``) has its
own test, tests/methods/test_observe_dense.py."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_model
from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine
from sparse_eval.methods.base import Method, MethodConfig, Selection


class _Recorder(Method):
    name = "_generating_recorder"

    def __init__(self, config):
        super().__init__(config)
        self.selected: list[tuple[int, int, bool]] = []  # (layer, rows, generating)

    def select(self, ctx):
        self.selected.append((ctx.layer_idx, ctx.q.shape[2], ctx.generating))
        return Selection(keep=ctx.valid.expand_as(ctx.scores))


class _NoTok:
    eos_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


@pytest.mark.parametrize("chunk", [None, 8])
@pytest.mark.parametrize("protocol", ["A", "B", "S"])
@torch.inference_mode()
def test_generated_rows_are_marked(protocol, chunk):
    """A 30-token prompt (20 context + 10 question), 4 generated tokens, layer 0 dense: the sparse prompt rows (B:
    the 10 of the question, S: all 30, in any chunking) are not marked as generated, the decode steps are (under A:
    all its sparse calls)."""
    model = tiny_model("llama", layers=3)
    method = _Recorder(MethodConfig(name="_generating_recorder", dense_layers=[0]))
    session = attach(model, method, Runtime(protocol=protocol))
    try:
        res = Engine(model, _NoTok(), session, chunk).generate(
            list(range(5, 35)), max_new_tokens=4, context_len=20, stop_token_ids=[]
        )
    finally:
        detach(model)
    assert len(res.tokens) == 4
    sparse_prompt_rows = {"A": 0, "B": 10, "S": 30}[protocol]
    for layer in (1, 2):
        prompt = [r for l, r, g in method.selected if l == layer and not g]
        gen = [r for l, r, g in method.selected if l == layer and g]
        assert sum(prompt) == sparse_prompt_rows
        assert gen == [1] * 3  # 3 decode steps (the 4th token comes from the last one's logits)
    assert 0 not in {l for l, _, _ in method.selected}


@torch.inference_mode()
def test_a_forward_outside_the_decode_loop_is_not_generating():
    """Under S a plain forward (not the engine's decode step) is a prompt, even of one row; under A every sparse call
    is a generated row; ``session.generation()`` marks its passes and is restored on exit."""
    model = tiny_model("llama", layers=2)
    ids = torch.arange(5, 17)[None]
    for protocol, expected in (("S", False), ("A", True)):
        method = _Recorder(MethodConfig(name="_generating_recorder", dense_layers=[0]))
        session = attach(model, method, Runtime(protocol=protocol))
        try:
            model(input_ids=ids[:, :1])
            with session.generation():
                assert session.generating()
                model(input_ids=ids[:, :1])
            assert session.generating() == expected
        finally:
            detach(model)
        assert [g for _, _, g in method.selected] == [expected, True]
