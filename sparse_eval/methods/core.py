"""The one attention over a selection that every sparse method shares.

    s_i  = q·k_i · scaling                                  (scores, fp32)
    keep = method keys ∪ static keys (sink + local)
    ô    = Σ_{i∈keep} softmax_i(s_i + b_i) v_i               (MagicPIG eq. 11 with b = −log u; b = 0 to pick)

and, on the same q, K, V, the dense output o = softmax(s) V for the estimation error ‖ô − o‖ / ‖o‖.

This is the accuracy path: it is written for clarity and exactness (dense scores, boolean masks), which also
lets every method's selection be checked against brute force.  The kernels in ``kernels/`` are the fast path.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import AttentionContext, Method, Selection

NEG_INF = float("-inf")


def key_validity(attention_mask: torch.Tensor | None, batch: int, q_len: int, kv_len: int, device) -> torch.Tensor:
    """bool [B, 1, Q, N]: which keys each query row may attend (causal and not padding).

    ``attention_mask`` is what transformers passes to an attention function: None (purely causal, no padding;
    the query rows are the last Q positions, i.e. bottom-right aligned), a bool mask (True = attend) or a
    float additive mask (0 = attend, very negative = masked), each [B, 1, Q, ≥N].
    """
    if attention_mask is None:
        rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
        cols = torch.arange(kv_len, device=device).unsqueeze(0)
        return (cols <= rows).view(1, 1, q_len, kv_len).expand(batch, 1, q_len, kv_len)
    m = attention_mask[..., :kv_len]
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2 if m.is_floating_point() else m != 0
    if m.shape[1] != 1:
        m = m[:, :1]
    return m.expand(batch, 1, q_len, kv_len)


def static_keys(valid: torch.Tensor, sink: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sink and local window, counted among each row's *valid* keys (so left padding is never a sink).

    valid: bool [B, 1, Q, N].  Returns (static bool [B, 1, Q, N], n_valid long [B, 1, Q, 1]).
    """
    rank = valid.cumsum(-1)  # 1-based rank of each valid key within its row
    n_valid = rank[..., -1:]
    static = valid & ((rank <= sink) | (rank > n_valid - local))
    return static, n_valid


def scores_gqa(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, Hq, Q, D], k [B, Hkv, N, D] -> fp32 scores [B, Hq, Q, N] without repeating K."""
    b, hq, ql, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, ql, d)
    s = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2))  # [B, Hkv, G, Q, N]
    return s.reshape(b, hq, ql, k.shape[2]).float() * scaling


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [B, Hq, Q, N] (fp32 probabilities), v [B, Hkv, N, D] -> [B, Hq, Q, D] in v's dtype."""
    b, hq, ql, n = p.shape
    hkv = v.shape[1]
    pg = p.reshape(b, hkv, hq // hkv, ql, n).to(v.dtype)
    return torch.matmul(pg, v.unsqueeze(2)).reshape(b, hq, ql, v.shape[-1])


def masked_softmax(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over kept entries; rows with nothing kept give all zeros (never NaN)."""
    x = logits.masked_fill(~keep, NEG_INF)
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(x - m)
    z = e.sum(-1, keepdim=True)
    return e / z.clamp_min(torch.finfo(e.dtype).tiny)


def sparse_attention(
    method: Method,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    state: dict[str, Any],
    layer_idx: int,
    compute_error: bool = True,
    query_chunk: int = 512,
    keep_masks: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One attention call of a sparse layer.

    q [B, Hq, Q, D], k/v [B, Hkv, N, D] (the whole cache of this layer, un-repeated), valid bool [B, 1, Q, N].
    Returns the output [B, Hq, Q, D] (q's dtype) and per-row statistics, each [B, Hq, Q]:
    ``cost1``, ``cost2`` (kept keys / valid keys), ``static_frac``, ``error`` (if computed), ``empty``
    (the method kept no key of its own), ``rows`` (row has at least one valid key), plus the method's
    own extras; with ``keep_masks`` also ``keep`` bool [B, Hq, Q, N].
    """
    cfg = method.config
    if method.prepare_with_valid:  # keys valid for the last query row: left padding is the only invalid key
        method.prepare(state, k, v, layer_idx, valid=valid[:, 0, -1])
    else:
        method.prepare(state, k, v, layer_idx)
    step = state.get("_calls", 0)
    state["_calls"] = step + 1
    b, hq, ql, _ = q.shape
    outs, stats_chunks = [], []
    for start in range(0, ql, query_chunk):
        stop = min(ql, start + query_chunk)
        qc, vc = q[:, :, start:stop], valid[:, :, start:stop]
        scores = scores_gqa(qc, k, scaling).masked_fill(~vc, NEG_INF)
        static, n_valid = static_keys(vc, cfg.sink, cfg.local)
        ctx = AttentionContext(
            q=qc, k=k, v=v, scores=scores, valid=vc, static=static, n_valid=n_valid, scaling=scaling,
            layer_idx=layer_idx, state=state, generator_seed=hash((cfg.seed, layer_idx, step)) & 0x7FFFFFFF,
            query_offset=start,
        )
        sel: Selection = method.select(ctx)
        own = sel.keep & ctx.candidates
        empty = ~own.any(-1)  # [B, Hq, Q]
        keep = own | static
        if cfg.sink == 0 and cfg.local == 0:
            # nothing at all (no static keys configured and nothing picked): fall back to the newest valid key.
            # With a sink or a local window every row with a valid key keeps at least that static key.
            nothing = ~keep.any(-1, keepdim=True) & (n_valid > 0)
            keep = keep | (nothing & vc & (vc.cumsum(-1) == n_valid))
        logits = scores if sel.bias is None else scores + torch.where(keep, sel.bias, torch.zeros_like(scores))
        p = masked_softmax(logits, keep)
        out = weighted_values(p, v)
        rows = (n_valid > 0).squeeze(-1).expand(b, hq, stop - start)
        nv = n_valid.squeeze(-1).clamp_min(1).float()
        st: dict[str, torch.Tensor] = {
            "rows": rows,
            "cost2": keep.sum(-1).float() / nv,
            "static_frac": static.sum(-1).float().expand(b, hq, -1) / nv,
            "empty": empty & rows,
        }
        c1 = method.cost1(ctx, sel)
        st["cost1"] = torch.full((b, hq, stop - start), float(c1), device=q.device) \
            if not torch.is_tensor(c1) or c1.dim() == 0 else c1.float().expand(b, hq, stop - start)
        if compute_error:
            dense = weighted_values(masked_softmax(scores, vc), v).float()
            num = (out.float() - dense).norm(dim=-1)
            den = dense.norm(dim=-1)
            st["error"] = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
        for key, val in sel.stats.items():
            st[key] = val
        if keep_masks:
            st["keep"] = keep
        outs.append(out)
        stats_chunks.append(st)
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    if len(stats_chunks) == 1:
        stats = stats_chunks[0]
    else:
        stats = {key: torch.cat([s[key] for s in stats_chunks], dim=2) for key in stats_chunks[0]}
    return out.to(q.dtype), stats
