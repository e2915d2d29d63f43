"""Causality of every registered method under the sparse protocols.

Changing the tokens after position t must leave every output at positions <= t unchanged: exactly for the
deterministic methods, and for the stochastic ones with the same seed (their draws are per call and row, so a
row's draws cannot depend on later rows either).  The test iterates over the registry, so a method added later
is checked without touching this file.  Protocol S: the whole window is one sparse prefill.  Protocol B: a dense
context prefill followed by a sparse question.
"""

from __future__ import annotations

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache
from sparse_eval.methods import METHODS, build_method, make_config

WINDOW = 160  # tokens of the window
CUT = 100  # tokens after this position are replaced
CONTEXT = 40  # protocol B: the dense context (the question, positions CONTEXT.., is sparse)
# small static set so that rows before CUT already choose among many keys of their own
STATIC = {"sink": 2, "local": 8}


def _method(name: str):
    opts = {"dense_layers": [0]}
    cls = METHODS[name].config_class
    fields = cls.__dataclass_fields__
    if fields["sink"].default or fields["local"].default:  # methods without static keys keep their setting (DS)
        opts |= STATIC
    return build_method(make_config(name, opts))


def _logits(model, method, ids: torch.Tensor, protocol: str) -> torch.Tensor:
    """Logits [T, V] of every position of ids [1, T] with ``method`` attached under ``protocol``."""
    method.setup(model, "stories260k")
    session = attach(model, method, Runtime(protocol=protocol, compute_error=False))
    try:
        with torch.no_grad():
            if protocol == "S":
                with session.phase("sparse"):
                    return model(input_ids=ids, use_cache=False).logits[0]
            cache = make_cache(model)
            kw = cache_kwargs(model, cache) | {"use_cache": True}
            with session.phase("dense"):
                head = model(input_ids=ids[:, :CONTEXT], **kw).logits[0]
            with session.phase("sparse"):
                tail = model(input_ids=ids[:, CONTEXT:], **kw).logits[0]
            return torch.cat([head, tail])
    finally:
        detach(model)


@pytest.mark.parametrize("protocol", ["S", "B"])
@pytest.mark.parametrize("name", sorted(METHODS))
def test_changing_later_tokens_leaves_earlier_outputs_unchanged(stories, name, protocol):
    model, _ = stories
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, WINDOW), generator=gen)
    other = ids.clone()
    other[:, CUT + 1:] = torch.randint(3, vocab, (1, WINDOW - CUT - 1), generator=gen)
    a = _logits(model, _method(name), ids, protocol)
    b = _logits(model, _method(name), other, protocol)
    assert not torch.equal(a[CUT + 1:], b[CUT + 1:])  # the change is seen after the cut
    diff = (a[:CUT + 1] - b[:CUT + 1]).abs().max().item()
    assert diff == 0.0, f"{name} under protocol {protocol}: logits at positions <= {CUT} moved by {diff:.3g}"
