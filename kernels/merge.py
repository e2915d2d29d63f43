"""Exact merge of two partial attention outputs by their log-sum-exp.

If ``o_j = Σ_{i∈S_j} e^{l_i} v_i / Z_j`` with ``lse_j = log Z_j = log Σ_{i∈S_j} e^{l_i}`` over disjoint key sets
S_1, S_2 (l_i the final logits, including any correction such as MagicPIG's −log u_i), then attention over
S_1 ∪ S_2 is

    lse = log(e^{lse_1} + e^{lse_2}),     o = e^{lse_1 − lse} o_1 + e^{lse_2 − lse} o_2.

This is how MagicPIG joins the CPU part (sampled keys) with the GPU part (sink + local window).  An empty part
has ``lse = −inf`` (and any finite ``o``); two empty parts give ``o = 0, lse = −inf``.
"""

from __future__ import annotations

import torch


def merge_by_lse(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o1, o2 [..., D]; lse1, lse2 [...] (natural log).  Returns (o [..., D] float32, lse [...] float32)."""
    if o1.shape != o2.shape or lse1.shape != lse2.shape or o1.shape[:-1] != lse1.shape:
        raise ValueError(
            f"merge_by_lse: expected o [..., D] and lse [...] of matching shapes; got o1 {tuple(o1.shape)}, "
            f"lse1 {tuple(lse1.shape)}, o2 {tuple(o2.shape)}, lse2 {tuple(lse2.shape)}"
        )
    l1, l2 = lse1.float(), lse2.float()
    lse = torch.logaddexp(l1, l2)
    finite = torch.isfinite(lse)
    safe = torch.where(finite, lse, torch.zeros_like(lse))
    w1 = torch.where(finite, torch.exp(l1 - safe), torch.zeros_like(lse))
    w2 = torch.where(finite, torch.exp(l2 - safe), torch.zeros_like(lse))
    # an empty part (weight 0) may carry any o, even NaN: it must not reach the result
    zero = torch.zeros((), dtype=torch.float32, device=o1.device)
    o = torch.where((w1 > 0).unsqueeze(-1), w1.unsqueeze(-1) * o1.float(), zero) + torch.where(
        (w2 > 0).unsqueeze(-1), w2.unsqueeze(-1) * o2.float(), zero
    )
    return o, lse
