"""Exact TopK attention: the keys with the highest true scores q·k (MagicPIG eq. 3)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionContext, Method, MethodConfig, Selection
from .registry import register


@dataclass
class TopKConfig(MethodConfig):
    name: str = "topk"
    # ratio of the context in (0, 1] (float) or a number of tokens (int); keys chosen besides the static ones
    # (MagicPIG Table 5: 0.06)
    budget: Any = 0.06


def topk_mask(score: torch.Tensor, k: torch.Tensor, kmax: int | None = None) -> torch.Tensor:
    """bool mask of the k[...] highest finite entries of ``score`` along the last dim (k broadcasts).
    ``kmax``: an upper bound of k known on the host (avoids a device sync)."""
    if kmax is None:
        kmax = int(k.max().item()) if k.numel() else 0
    kmax = min(kmax, score.shape[-1])
    mask = torch.zeros(score.shape, dtype=torch.bool, device=score.device)
    if kmax <= 0:
        return mask
    vals, idx = score.topk(kmax, dim=-1)
    rank = torch.arange(kmax, device=score.device)
    take = (rank < k) & torch.isfinite(vals)
    return mask.scatter_(-1, idx, take)


@register
class TopK(Method):
    """Keeps the ``budget`` candidate keys with the largest q·k of each query head (or, with
    ``gqa=kv_head``, the largest attention probability summed over the KV group's query heads).

    Cost1 = 0.5: finding the exact top keys needs the full qKᵀ, half of full attention's FLOPs (MagicPIG §5.1).
    """

    name = "topk"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "the budget keys with the largest q·k, exact (MagicPIG eq. 3)"
    config_class = TopKConfig
    display_name = "TopK"
    budget_field = "budget"
    headline_options = ("budget",)

    @classmethod
    def contract_configs(cls):
        """A token budget in a small static window (the end-to-end checks' config), a ratio with per-group
        selection, and the defaults."""
        return [{"budget": 8, "local": 8}, {"budget": 0.1, "sink": 2, "local": 8, "gqa": "kv_head"}, {}]

    @classmethod
    def keep_all_options(cls, n):
        """budget = 1.0: ⌊1.0·n⌋ = n keys, every candidate."""
        return {"budget": 1.0}

    def select(self, ctx: AttentionContext) -> Selection:
        k = self.budget_tokens(ctx)  # [B, 1, Q, 1]
        score = ctx.scores.masked_fill(ctx.not_candidates, float("-inf"))
        if self.config.gqa == "kv_head":
            score = ctx.group_sum(torch.softmax(ctx.scores, -1).nan_to_num(0.0)).masked_fill(
                ctx.not_candidates, float("-inf")
            )
        return Selection(keep=topk_mask(score, k, self.budget_host_bound(score.shape[-1])))

    def cost1(self, ctx, sel):
        return 0.5
