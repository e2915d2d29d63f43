"""Top-k recall and attention mass captured of a kept set (``kept_mass_and_recall``), against brute force."""

from __future__ import annotations

import pytest
import torch

from sparse_eval.methods import attend
from sparse_eval.methods.core import kept_mass_and_recall, masked_softmax


def _qkv(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, 4, 1, 16, generator=g) * 2,
        torch.randn(1, 2, n, 16, generator=g),
        torch.randn(1, 2, n, 16, generator=g),
    )


def test_brute_force_on_a_small_row():
    scores = torch.tensor([[[[3.0, 1.0, 2.0, 0.0, float("-inf")]]]])
    valid = torch.isfinite(scores)
    p = masked_softmax(scores, valid)
    keep = torch.tensor([[[[True, False, False, True, False]]]])  # the best and the worst valid key
    mass, recall = kept_mass_and_recall(scores, p, keep)
    e = torch.exp(torch.tensor([3.0, 1.0, 2.0, 0.0]))
    assert float(mass) == pytest.approx(float((e[0] + e[3]) / e.sum()), rel=1e-6)
    assert float(recall) == pytest.approx(0.5)  # top-2 is {0, 2}; kept {0, 3}
    nothing = torch.zeros_like(keep)
    assert float(kept_mass_and_recall(scores, p, nothing)[1]) == 0.0


def test_topk_has_recall_one_and_the_largest_mass():
    """Without static keys TopK's kept set is the exact top-|keep| set; oracle sampling keeps at most `budget`
    distinct keys, so it captures no more mass.  With sink and local keys kept, TopK's recall drops below 1."""
    q, k, v = _qkv()
    _, top = attend("topk", q, k, v, budget=0.1, sink=0, local=0)
    assert torch.all(top["topk_recall"] == 1.0)
    _, ora = attend("oracle", q, k, v, budget=0.1, sink=0, local=0)
    assert float(ora["topk_recall"].mean()) < 1.0
    assert torch.all(ora["mass"] <= top["mass"] + 1e-6)
    _, static = attend("topk", q, k, v, budget=0.1, sink=4, local=16)
    assert float(static["topk_recall"].mean()) < 1.0 and torch.all(static["mass"] >= top["mass"] - 1e-6)
    _, quest = attend("quest", q, k, v, budget=0.1, sink=4, local=16, page_size=16)
    assert torch.all((quest["mass"] >= 0) & (quest["mass"] <= 1 + 1e-6))
    _, full = attend("full", q, k, v)
    assert torch.allclose(full["mass"], torch.ones_like(full["mass"])) and torch.all(full["topk_recall"] == 1.0)
