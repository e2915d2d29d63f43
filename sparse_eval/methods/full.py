"""Full (dense) attention: the reference every other method is measured against."""

from __future__ import annotations

from dataclasses import dataclass

from .base import AttentionContext, Method, MethodConfig, Selection
from .registry import register


@dataclass
class FullConfig(MethodConfig):
    name: str = "full"


@register
class Full(Method):
    """Attends every valid key.  In a model it runs stock ``scaled_dot_product_attention``; through
    ``attend`` (and in tests) it runs the shared sparse path with every key kept, which must agree."""

    name = "full"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "every key, with stock scaled_dot_product_attention: the reference every method is compared with"
    config_class = FullConfig
    dense = True
    display_name = "Full"

    @classmethod
    def label(cls, params):
        return "–"  # no config of its own

    @classmethod
    def static_step_contract_configs(cls):
        """Full attention's own static step (its eager decode: tests/system/test_system.py's full-attention test)."""
        return {"full": {"name": "full"}}

    @classmethod
    def keep_all_options(cls, n):
        """Every valid key, always."""
        return {}

    def select(self, ctx: AttentionContext) -> Selection:
        return Selection(keep=ctx.valid.expand_as(ctx.scores))

    def cost1(self, ctx, sel):
        return 0.0
