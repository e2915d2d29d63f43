"""Oracle sampling (MagicPIG §3.2, Definition 3.1, eq. 4–5).

B indices are drawn i.i.d. from the true attention distribution w and the output is the mean of their
values, ō = Σ_{i∈S} (f_i / B) v_i with S the unique draws and f_i their counts (eq. 5).  With static keys
(sink + local) the static part is exact and the draws estimate the rest:

    ô = Σ_{i∈static} w_i v_i + W_c · Σ_{i∈S} (f_i / B) v_i,        W_c = Σ_{i∉static} w_i,

which the shared attention computes as softmax(s + b) with b_i = log Z_c + log f_i − log B − s_i on sampled
keys (Z_c = Σ_{i∉static} e^{s_i}).  The computation cost is |S| (Theorem 3.3: E|S| ≤ 1 + B·(1 − max_i w_i)).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionContext, Method, MethodConfig, Selection
from .random import finish, key_hash, mix, start
from .registry import register


@dataclass
class OracleConfig(MethodConfig):
    name: str = "oracle"
    # sampling budget B: ratio of the context (float) or number of draws (int) (MagicPIG Table 5: 0.1)
    budget: Any = 0.1


@register
class OracleSampling(Method):
    """Draws by inverse CDF with counter-based uniforms of (seed, layer, sample id, head, query position, draw):
    a sample draws the same in any batch, and different samples draw independently.

    Cost1 = 0.5: the exact distribution w needs the full qKᵀ (MagicPIG §5.1).
    """

    name = "oracle"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "oracle sampling: budget i.i.d. draws from the true attention, importance-weighted (MagicPIG eq. 4-5)"
    config_class = OracleConfig
    stochastic = True  # i.i.d. draws from config.seed
    display_name = "Oracle sampling"
    budget_field = "budget"
    headline_options = ("budget",)
    supported_gqa = ("query_head",)

    def __init__(self, config: OracleConfig):
        super().__init__(config)
        # per (layer seed, heads, device): [the batch's row seeds, the state after (seed, rows, head), draw hashes]
        self._draw_cache: dict[tuple, list] = {}

    @classmethod
    def contract_configs(cls):
        """B = 8 draws in a small static window (the end-to-end checks' config), and the defaults."""
        return [{"budget": 8, "local": 8}, {}]

    @classmethod
    def keep_all_options(cls, n):
        """None: a sampled key is weighted by its share of the draws f_i / B (eq. 5), a random estimate of its
        attention w_i, so no budget makes the output exact."""
        return None

    def select(self, ctx: AttentionContext) -> Selection:
        draws = self.budget_tokens(ctx)  # [B, 1, Q, 1]
        s = ctx.scores.masked_fill(ctx.not_candidates, float("-inf"))  # [B, Hq, Q, N]
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # log Z_c  (-inf when no candidate)
        has = torch.isfinite(lse)
        w = torch.exp(s - torch.where(has, lse, torch.zeros_like(lse))).to(torch.float64)
        cdf = w.cumsum(-1)
        b, hq, ql, n = s.shape
        bmax = self.budget_host_bound(n)  # host-side bound: no device sync
        if bmax == 0:
            empty = torch.zeros_like(s, dtype=torch.bool)
            return Selection(keep=empty, stats={"draws": torch.zeros(b, hq, ql, device=s.device)})
        # a draw is a pure function of (seed, layer, sample, head, query position, draw index): the row's
        # context size n_valid identifies its query position.  ``random.uniforms(seed, rows, head, n_valid, j)``,
        # composed from parts kept between calls (the same values, a third of the operations per call)
        prefix, jh = self._draw_parts(ctx, hq, bmax)  # [B or 1, Hq, 1, 1], [1, 1, 1, Bmax]
        j = torch.arange(bmax, device=s.device).view(1, 1, 1, bmax)
        u = finish(mix(mix(prefix, ctx.n_valid.view(-1, 1, ql, 1)), jh, hashed=True))  # [B, Hq, Q, Bmax]
        x = u * cdf[..., -1:]
        idx = torch.searchsorted(cdf.contiguous(), x.contiguous(), right=True).clamp_max(n - 1)
        take = (j < draws).to(torch.float32).expand(b, hq, ql, bmax) * has.to(torch.float32)
        counts = torch.zeros_like(s).scatter_add_(-1, idx, take)  # f_i
        keep = counts > 0
        log_b = torch.log(draws.clamp_min(1).to(torch.float32))
        bias = lse + torch.log(counts.clamp_min(1.0)) - log_b - s.nan_to_num(0.0, neginf=0.0)
        bias = torch.where(keep, bias, torch.zeros_like(bias))  # static keys keep their exact logits
        return Selection(keep=keep, bias=bias, stats={"draws": draws.squeeze(-1).float().expand(b, hq, ql)})

    def _draw_parts(self, ctx: AttentionContext, hq: int, bmax: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the uniforms' state after (seed, rows, head), ``key_hash`` of the draw indices 0..bmax-1), kept from the
        last call of the layer while its seed, the batch's row seeds (the same tensor: the engine makes one per
        batch, and it is held here, so identity is safe), the head count and the device stay."""
        dev = ctx.scores.device
        cache = self._draw_cache
        key = (ctx.generator_seed, hq, str(dev))
        hit = cache.get(key)
        if hit is None or hit[0] is not ctx.row_seeds:
            rows = (
                ctx.row_seeds.view(-1, 1, 1, 1)
                if ctx.row_seeds is not None
                else torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
            )
            head = torch.arange(hq, device=dev).view(1, hq, 1, 1)
            hit = cache[key] = [ctx.row_seeds, mix(mix(start(ctx.generator_seed), rows), head), None]
        jh = hit[2]
        if jh is None or jh.shape[-1] < bmax:  # room for growth: a ratio budget grows with the context
            jh = hit[2] = key_hash(torch.arange(max(bmax, 2 * (0 if jh is None else jh.shape[-1])), device=dev))
        return hit[1], jh[:bmax].view(1, 1, 1, bmax)

    def cost1(self, ctx, sel):
        return 0.5
