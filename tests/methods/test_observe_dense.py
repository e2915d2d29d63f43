"""The session's hooks for a method whose state follows the rows that run dense (``Method.observes_dense``,
``observe_dense``, ``AttentionContext.sparse_rows``), checked with a method defined here (not registered: it records
what the session hands it, and selects like TopK).

* protocol A: every dense call of a layer the method runs in reaches ``observe_dense`` (the prompt's rows, the
  layer's state, the call's valid keys), a layer in ``dense_layers`` never does, and the decode steps' ``select``
  sees the state the prompt's calls left;
* protocol B with a per-row phase (a batch whose rows' contexts end at different columns): ``ctx.sparse_rows`` is
  the engine's question mask over the call's rows; every other call's is None;
* a method that does not set ``observes_dense`` is never observed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine, GenerationRequest
from sparse_eval.methods import Method, MethodConfig, Selection


@dataclass
class _Config(MethodConfig):
    name: str = "observer_probe"
    sink: int = 1
    local: int = 4


class _Observer(Method):
    """Keeps the candidate keys of the highest score; records the session's calls."""

    name = "observer_probe"
    config_class = _Config
    observes_dense = True

    def __init__(self, config):
        super().__init__(config)
        self.observed: list[tuple[int, tuple, tuple, tuple]] = []  # (layer, q shape, k shape, valid shape)
        self.sparse_rows: list[tuple[int, int, torch.Tensor | None]] = []  # (layer, Q, ctx.sparse_rows)

    def observe_dense(self, state, q, k, valid, scaling, layer_idx):
        assert valid.dtype == torch.bool and valid.shape == (q.shape[0], 1, q.shape[2], k.shape[2])
        self.observed.append((layer_idx, tuple(q.shape), tuple(k.shape), tuple(valid.shape)))
        state["observed_rows"] = state.get("observed_rows", 0) + q.shape[2]

    def select(self, ctx):
        self.sparse_rows.append((ctx.layer_idx, ctx.q.shape[2], ctx.sparse_rows, ctx.state.get("observed_rows")))
        score = ctx.scores.masked_fill(ctx.not_candidates, float("-inf"))
        top = score.argmax(-1, keepdim=True)
        return Selection(keep=torch.zeros_like(ctx.scores, dtype=torch.bool).scatter_(-1, top, True) & ctx.candidates)


class _Plain(_Observer):
    observes_dense = False


def _prompts(lengths, seed=3):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 500, (n - 1,), generator=g).tolist() for n in lengths]


@torch.inference_mode()
def test_protocol_a_observes_the_dense_prompt_in_the_methods_layers_only(stories):
    model, tok = stories
    method = _Observer(_Config(dense_layers=[0, 2]))
    session = attach(model, method, Runtime("A"))
    try:
        [p] = _prompts([30])
        Engine(model, tok, session).generate_batch([GenerationRequest(p, max_new_tokens=3)])
    finally:
        detach(model)
    layers = model.config.num_hidden_layers
    sparse_layers = [i for i in range(layers) if i not in (0, 2)]
    assert sorted(o[0] for o in method.observed) == sparse_layers  # one prompt call per layer the method runs in
    for layer, qs, ks, vs in method.observed:
        assert qs[2] == 30 and ks[2] == 30 and vs == (1, 1, 30, 30)
    # the decode steps (2: the third token comes from the second step's logits) see the prompt's rows in the state
    assert [(layer, q, rows) for layer, q, _, rows in method.sparse_rows] == [
        (layer, 1, 30) for _ in range(2) for layer in sparse_layers
    ]
    assert all(sr is None for _, _, sr, _ in method.sparse_rows)


@torch.inference_mode()
def test_protocol_b_hands_the_per_row_phase_to_the_method(stories):
    model, tok = stories
    method = _Observer(_Config(dense_layers=[0]))
    session = attach(model, method, Runtime("B"))
    lengths, contexts = [24, 30], [20, 22]
    reqs = [GenerationRequest(p, max_new_tokens=2, context_len=c) for p, c in zip(_prompts(lengths), contexts)]
    try:
        Engine(model, tok, session).generate_batch(reqs)
    finally:
        detach(model)
    # left padding: row 0 starts at column 6; contexts end at columns 26 and 22, so the call over columns 22..29 has
    # row 0 in its context for 4 columns and row 1 in its question throughout
    t = max(lengths)
    ends = [t - n + c for n, c in zip(lengths, contexts)]
    split = min(ends)
    question = torch.tensor([[col >= e for col in range(split, t)] for e in ends])
    per_row = [(layer, q, sr) for layer, q, sr, _ in method.sparse_rows if sr is not None]
    assert [layer for layer, _, _ in per_row] == list(range(1, model.config.num_hidden_layers))
    for _, q, sr in per_row:
        assert q == t - split and sr.shape == (2, 1, t - split, 1)
        assert torch.equal(sr[:, 0, :, 0], question)
    assert all(q == 1 for _, q, sr, _ in method.sparse_rows if sr is None)  # the decode step: every row sparse
    assert sorted({o[0] for o in method.observed}) == list(range(1, model.config.num_hidden_layers))
    assert all(o[1][2] == split for o in method.observed)  # the dense context call: the columns before the split


@torch.inference_mode()
def test_a_method_that_does_not_ask_is_not_observed(stories):
    model, tok = stories
    method = _Plain(_Config(dense_layers=[0]))
    session = attach(model, method, Runtime("A"))
    try:
        Engine(model, tok, session).generate_batch([GenerationRequest(_prompts([25])[0], max_new_tokens=2)])
    finally:
        detach(model)
    assert method.observed == [] and method.sparse_rows
    assert all(rows is None for *_, rows in method.sparse_rows)
