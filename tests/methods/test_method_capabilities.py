"""What generic code asks a method instead of its name (issue 27): capabilities, its report view and its memory
model, with the base class's defaults for a method that declares nothing."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from sparse_eval.methods import (
    METHODS,
    AttentionContext,
    Method,
    MethodConfig,
    Selection,
    attend,
    compare_names,
    is_dense,
)


@dataclass
class _NoneConfig(MethodConfig):
    name: str = "keeps_nothing"


class _KeepsNothing(Method):
    """Selects no candidate key: only the static keys enter the output."""

    name = "keeps_nothing"
    config_class = _NoneConfig

    def select(self, ctx: AttentionContext) -> Selection:
        return Selection(keep=torch.zeros_like(ctx.scores, dtype=torch.bool))  # [B, Hq, Q, N]


class _StaticOnly(_KeepsNothing):
    selects_static_only = True


def test_rows_of_a_static_only_method_are_not_empty_selections():
    """The core counts a row that keeps none of its candidates as an empty selection, unless the method declares
    that its selection is its static keys (StreamingLLM's sink + window)."""
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 300, 8)
    cfg = dict(sink=4, local=16, dense_layers=[])
    _, plain = attend(_KeepsNothing(_NoneConfig(**cfg)), q, k, k)
    _, static = attend(_StaticOnly(_NoneConfig(**cfg)), q, k, k)
    assert bool(plain["empty"].all()) and not bool(static["empty"].any())
    assert torch.equal(plain["cost2"], static["cost2"])  # the same keys either way


def test_report_view_defaults_and_the_budget():
    params = {"budget": 0.05}
    assert _KeepsNothing.display(params) == "keeps_nothing" and _KeepsNothing.label(params) is None
    assert _KeepsNothing.level(params, 100.0) is None and _KeepsNothing.point_label(params, 100.0) is None
    topk = METHODS["topk"]
    assert topk.display(params) == "TopK" and topk.label(params) == "0.05" and topk.level(params, None) == 0.05
    assert topk.label({"budget": 512}) == "512 tok" and topk.level({"budget": 512}, 2048.0) == 0.25
    assert topk.level({"budget": 512}, None) is None  # a token count without the row's size has no level
    ds = METHODS["double_sparsity"]
    assert ds.display({"offload": True}) == "DS-Offload" and ds.display({}) == "DS"
    assert (
        ds.point_label({"alpha": 0.25, "label_bits": 4, "beta": 0.0625, "channel_type": "random"}, None)
        == "1/16 random"
    )


def test_memory_model_defaults():
    assert _KeepsNothing.index_memory({}, None, 1000, 3) == {} and not _KeepsNothing.index_may_not_fit
    assert METHODS["magicpig"].shared_index_parts == ("projections",)


def test_the_dense_reference_leads_the_comparison():
    names = compare_names()
    assert names[0] == "full" and is_dense("full") and set(names) == set(METHODS)
    assert not is_dense("topk") and not is_dense("no_such_method") and not is_dense(None)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_labels_its_own_defaults(name):
    """Every registered method gives the report a display name and a label from its config's defaults."""
    import dataclasses

    cls = METHODS[name]
    params = dataclasses.asdict(cls.config_class())
    assert isinstance(cls.display(params), str) and cls.display(params)
    lab = cls.label(params)
    assert lab is None or isinstance(lab, str)
