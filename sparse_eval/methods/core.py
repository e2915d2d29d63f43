"""The one attention over a selection that every sparse method shares.

    s_i  = q·k_i · scaling                                  (scores, fp32)
    keep = method keys ∪ static keys (sink + local)
    ô    = Σ_{i∈keep} softmax_i(s_i + b_i) v_i               (MagicPIG eq. 11 with b = −log u; b = 0 to pick)

and, on the same q, K, V, the dense output o = softmax(s) V for the estimation error ‖ô − o‖ / ‖o‖.

This is the accuracy path: it is written for clarity and exactness (dense scores, boolean masks), which also
lets every method's selection be checked against brute force.  The kernels in ``kernels/`` are the fast path.

With ``fused`` (``eval.fused_attention``, resolved by ``fused_attention_used``) the attention over the selection and
the statistics from it (kept keys, and with the estimation error on the dense reference, kept mass and top-k recall)
come from one batch-invariant Triton pass over V (``kernels.selected_attention``), reading the same fp32 scores and
the same keep mask and bias, instead of the masked softmax, the two products over every key and the sort below.
Selections are unchanged (the methods' own code); outputs and statistics agree to fp32 rounding, not bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch

from .. import invariance
from ..kernels import invariant as kinv
from ..kernels._common import triton_available, triton_interpret
from ..spans import span
from .base import AttentionContext, Method, Selection

NEG_INF = float("-inf")
FUSED_SETTINGS = ("auto", "on", "off")
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the dtypes of ``kernels.selected_attention``


def fused_attention_used(setting: str, method: Method, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether ``method``'s sparse calls on ``device`` with a ``dtype`` cache take the fused kernel, for the setting
    ``eval.fused_attention``: ``off`` never; ``auto`` on a CUDA device when the method declares the capability
    (``Method.fused_attention``), the dtype is one the kernel takes and triton is installed, else not (the CPU keeps
    the torch path, bit for bit as before the setting existed); ``on`` as ``auto`` but a refusal (ValueError) where
    it cannot run: a method without the capability, another dtype, no triton, or a CPU device outside Triton's
    interpreter (``TRITON_INTERPRET=1``, tests).  A dense method (full attention) makes no sparse call: False.
    The result changes a run's bits, so it enters the run's identity (``Experiment.identity``)."""
    if setting not in FUSED_SETTINGS:
        raise ValueError(f"eval.fused_attention={setting!r}; valid: {list(FUSED_SETTINGS)}")
    if setting == "off" or method.dense:
        return False
    dev = torch.device(device)
    if setting == "auto":
        return bool(method.fused_attention and dev.type == "cuda" and dtype in FUSED_DTYPES and triton_available())
    why = None
    if not method.fused_attention:
        why = f"method {method.name!r} does not declare the capability (Method.fused_attention)"
    elif dtype not in FUSED_DTYPES:
        why = f"the kernel takes {[str(d) for d in FUSED_DTYPES]}, not {dtype}"
    elif not triton_available():
        why = "triton is not installed"
    elif dev.type != "cuda" and not triton_interpret():
        why = f"the device is {dev.type}, not CUDA (on the CPU the kernel only runs in Triton's interpreter, for tests)"
    if why:
        raise ValueError(f"eval.fused_attention=on: {why}; use eval.fused_attention=auto or off")
    return True


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


@dataclass
class PassMasks:
    """The masks of one forward pass's query rows, the same for all its layers (``pass_masks``); shapes [B, 1, Q, N]
    (key masks) and [B, 1, Q] (per row)."""

    valid: torch.Tensor  # bool: causal and not padding
    invalid: torch.Tensor  # bool: ~valid
    static: torch.Tensor  # bool: sink + local keys
    n_valid: torch.Tensor  # long [B, 1, Q, 1]
    candidates: torch.Tensor  # bool: valid and not static
    not_candidates: torch.Tensor  # bool: ~candidates
    rows: torch.Tensor  # bool [B, 1, Q]: the row has a valid key
    n_rows: torch.Tensor  # float [B, 1, Q]: max(n_valid, 1)
    static_frac: torch.Tensor  # float [B, 1, Q]: static keys / n_rows

    def rows_slice(self, start: int, stop: int) -> "PassMasks":
        return PassMasks(*(getattr(self, f.name)[:, :, start:stop] for f in fields(self)))


def pass_masks(valid: torch.Tensor, sink: int, local: int) -> PassMasks:
    """Everything the core and the methods derive from ``valid`` (bool [B, 1, Q, N]) alone."""
    static, n_valid = static_keys(valid, sink, local)
    candidates = valid & ~static
    n_rows = n_valid.squeeze(-1).clamp_min(1).float()
    return PassMasks(
        valid=valid,
        invalid=~valid,
        static=static,
        n_valid=n_valid,
        candidates=candidates,
        not_candidates=~candidates,
        rows=(n_valid > 0).squeeze(-1),
        n_rows=n_rows,
        static_frac=static.sum(-1).float() / n_rows,
    )


def scores_gqa(q: torch.Tensor, k: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, Hq, Q, D], k [B, Hkv, N, D] -> fp32 scores [B, Hq, Q, N] without repeating K.

    The G query heads of a KV group are stacked as G·Q rows of one product with that group's K.  (Broadcasting K
    over the G heads instead makes ``matmul`` expand and copy K G times.)  On CUDA the product is taken at a key
    length rounded up to a multiple of 16 where the cache has room (``_cuda_scores``), else as K · rowsᵀ."""
    b, hq, ql, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    qg = q.reshape(b, hkv, (hq // hkv) * ql, d)
    if invariance.enabled():  # fixed-order products, accumulated and returned in fp32 (not rounded to q's dtype)
        s = kinv.bmm(qg.reshape(b * hkv, -1, d), k.reshape(b * hkv, n, d).transpose(1, 2), out_dtype=torch.float32)
        return s.reshape(b, hq, ql, n) * scaling
    s = _cuda_scores(qg, k) if k.is_cuda else torch.matmul(qg, k.transpose(-1, -2))  # [B, Hkv, G·Q, N]
    return s.float().reshape(b, hq, ql, n) * scaling


ALIGN_KEYS = 16  # the score product's key length is rounded up to a multiple of this where the cache has room


def aligned_keys(k: torch.Tensor, mult: int = ALIGN_KEYS) -> torch.Tensor | None:
    """k [B, Hkv, N, D] as a view of N' = N rounded up to a multiple of ``mult`` keys, with k's own strides over the
    same memory (the spare rows a ``SparseLayer``'s buffer keeps past the cache's N keys), or None where k's storage
    ends before N' (nothing is copied, nothing read outside the storage).  The rows past N hold whatever the memory
    holds (old keys, uninitialised values, NaN): a product with them is only taken column by column."""
    b, h, n, d = k.shape
    n_al = -(-n // mult) * mult
    if n_al == n:
        return k
    if min(b, h, n, d) == 0:
        return None
    last = k.storage_offset() + sum((size - 1) * st for size, st in zip((b, h, n_al, d), k.stride()))
    if last >= k.untyped_storage().nbytes() // k.element_size():
        return None
    return k.as_strided((b, h, n_al, d), k.stride())


def _rows_times_aligned_keys(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """qg [B, Hkv, R, D] · kᵀ over ``aligned_keys(k)``, then its first N columns: [B, Hkv, R, N] (a view), or None when
    the cache has no room.  Column j of a product is q·k_j alone, so the real keys' scores are exact (no spare row
    enters them), and cuBLAS takes its kernel for an aligned length: rows · Kᵀ ran 30 µs at N = 16,384 and 90 µs at
    N = 16,389, (K · rowsᵀ)ᵀ 39 µs at both (H200, ``experiments/decode_products_alignment``)."""
    ka = aligned_keys(k)
    if ka is None:
        return None
    return torch.matmul(qg, ka.transpose(-1, -2))[..., : k.shape[2]]


def _cuda_scores(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """The CUDA score product outside the batch-invariant mode: rows · Kᵀ at an aligned key length where the cache
    has room past its N keys (``_rows_times_aligned_keys``), else as (K · rowsᵀ)ᵀ (``_keys_times_rows``)."""
    s = _rows_times_aligned_keys(qg, k)
    return _keys_times_rows(qg, k) if s is None else s


def _keys_times_rows(qg: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qg [B, Hkv, R, D] · kᵀ as (k · qgᵀ)ᵀ, [B, Hkv, R, N] (a transposed view).  cuBLAS's kernel for
    qg · kᵀ runs 2-3x slower when N is not a multiple of 8; this one does not (H200:
    ``experiments/decode_products_alignment``)."""
    return torch.matmul(k, qg.transpose(-1, -2)).transpose(-1, -2)


def weighted_values(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """p [B, Hq, Q, N] (fp32 probabilities), v [B, Hkv, N, D] -> [B, Hq, Q, D] in v's dtype (the G heads of a
    group as G·Q rows of one product with its V, as in ``scores_gqa``; on CUDA ``_values_split8``)."""
    b, hq, ql, n = p.shape
    hkv = v.shape[1]
    pg = p.reshape(b, hkv, (hq // hkv) * ql, n)
    # the split at a multiple of 8 depends on where a row's keys sit: not in the batch-invariant mode
    out = _values_split8(pg, v) if v.is_cuda and not invariance.enabled() else torch.matmul(pg.to(v.dtype), v)
    return out.reshape(b, hq, ql, v.shape[-1])


def _values_split8(pg: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """pg [B, Hkv, R, N] · v [B, Hkv, N, D] in v's dtype, the reduction split at the last multiple of 8: cuBLAS
    runs a 16-bit product whose reduction length is not a multiple of 8 5-20x slower (H200:
    ``experiments/decode_products_alignment``).  The ≤ 7 last keys are a second product, added in (at least) fp32."""
    n = pg.shape[-1]
    n8 = n - n % 8
    if n8 == n or n8 == 0:
        return torch.matmul(pg.to(v.dtype), v)
    head = torch.matmul(pg[..., :n8].to(v.dtype), v[:, :, :n8])
    tail = torch.matmul(pg[..., n8:].to(v.dtype), v[:, :, n8:])
    acc = torch.promote_types(v.dtype, torch.float32)
    return head.to(acc).add_(tail.to(acc)).to(v.dtype)


def dense_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    scaling: float,
    element_budget: int = 1 << 28,
) -> torch.Tensor:
    """Full attention o = softmax(q Kᵀ · scaling over the valid keys) V, [B, Hq, Q, D] in q's dtype, through
    ``scores_gqa``, ``masked_softmax`` and ``weighted_values`` (the batch-invariant mode's dense attention, in place
    of ``scaled_dot_product_attention``).  q [B, Hq, Q, D], k/v [B, Hkv, N, D], valid bool [B, 1, Q, N].  Query rows
    in blocks of at most ``element_budget`` scores (rows are independent: the blocks do not change results).  A row
    with no valid key gives zeros."""
    b, hq, ql, _ = q.shape
    n = k.shape[2]
    step = max(1, element_budget // max(1, b * hq * n))
    outs = []
    for s0 in range(0, ql, step):
        vc = valid[:, :, s0 : s0 + step]
        scores = scores_gqa(q[:, :, s0 : s0 + step], k, scaling)
        outs.append(weighted_values(masked_softmax(scores, vc), v))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)).to(q.dtype)


def masked_softmax(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """Softmax over kept entries; rows with nothing kept give all zeros (never NaN): torch's softmax over the
    masked logits, whose rows with nothing kept (all NaN there) are then zeroed with the other dropped entries
    (a NaN among kept logits still shows)."""
    dropped = ~keep
    return torch.softmax(logits.masked_fill(dropped, NEG_INF), dim=-1).masked_fill_(dropped, 0.0)


def kept_mass_and_recall(
    scores: torch.Tensor, p_dense: torch.Tensor, keep: torch.Tensor, kept: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two measures of how good a kept set is, per row [B, Hq, Q] (fp32):

    * attention mass captured: Σ_{i∈keep} softmax(s)_i, the dense attention's mass on the kept keys;
    * top-k recall: |keep ∩ T_k| / k with k = |keep| and T_k the k keys of the largest dense score s_i (ties at
      the k-th score count as in T_k, the ratio capped at 1).  1 means the kept set is the exact TopK set.

    scores [B, Hq, Q, N] fp32 (−inf where not valid), p_dense = masked_softmax(scores, valid), keep bool.
    Rows with nothing kept give 0 for both.  ``kept``: ``keep.sum(-1)`` (long) when the caller has it."""
    mass = (p_dense * keep).sum(-1)
    k = keep.sum(-1) if kept is None else kept  # [B, Hq, Q]
    ranked = scores.sort(dim=-1, descending=True).values
    kth = ranked.gather(-1, (k - 1).clamp_min(0).unsqueeze(-1))  # the k-th largest score
    hits = (keep & (scores >= kth)).sum(-1)
    recall = torch.where(k > 0, (hits.float() / k.clamp_min(1).float()).clamp_max(1.0), torch.zeros_like(mass))
    return mass, recall


def _fused_attention(q, k, v, scores, keep, bias, scaling, dense):
    """``kernels.selected_attention`` in the shared attention's place: (its Result, |keep| per row [B, Hq, Q]).  With
    ``dense`` (the estimation error on) the same pass gives the dense reference, the kept mass and the top-k recall's
    hits over the k-th largest score (k = |keep|, ``topk.kth_largest``: the radix search, no sort)."""
    from ..kernels import selected_attention, topk

    if dense:
        n_keep = keep.sum(-1)  # [B, Hq, Q]: the rank whose score is recall's threshold
        kth = topk.kth_largest(scores, n_keep, backend="triton")
        res = selected_attention.attention(
            q, k, v, keep, bias=bias, scores=scores, dense=True, kth=kth, scaling=scaling, backend="triton"
        )
        return res, n_keep
    res = selected_attention.attention(q, k, v, keep, bias=bias, scores=scores, scaling=scaling, backend="triton")
    return res, res.kept


def kv_bytes_read(
    method: Method, ctx: AttentionContext, sel: Selection, keep: torch.Tensor, kept: torch.Tensor | None = None
) -> torch.Tensor:
    """KV-cache bytes the method's system reads for each query-head row, fp32 [B, Hq, Q]:

        kv_bytes = index_bytes + |keep| · (2 if not index_reads_keys else 1) · D · e

    ``method.index_bytes`` is what the method reads to find its keys (exact scoring: n_valid·D·e; Quest: page
    min/max; DS: label cache; MagicPIG: hash-bucket ids); the kept keys (static ones included) add their V row,
    and their K row unless scoring already read it.  D = head dim, e = element size of the cache dtype.  Full
    attention: n_valid · 2 · D · e.  Per query-head row, as if each head read its own selection (GQA sharing is
    not deducted).  ``kept``: |keep| per row, ``keep.sum(-1)`` as fp32, when the caller has it."""
    b, hq, ql, _ = keep.shape
    d, e = ctx.k.shape[-1], ctx.k.element_size()
    rows_per_key = 1 if method.index_reads_keys else 2
    kept = (keep.sum(-1).to(torch.float32) if kept is None else kept) * float(rows_per_key * d * e)  # [B, Hq, Q]
    idx = method.index_bytes(ctx, sel)
    if not torch.is_tensor(idx):
        return kept + float(idx)
    return kept + idx.to(torch.float32).expand(b, hq, ql)


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
    masks: PassMasks | None = None,
    row_seeds: torch.Tensor | None = None,
    layer_inputs: dict[int, tuple] | None = None,
    sparse_rows: torch.Tensor | None = None,
    generating: bool = False,
    fused: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One attention call of a sparse layer.

    q [B, Hq, Q, D], k/v [B, Hkv, N, D] (the whole cache of this layer, un-repeated), valid bool [B, 1, Q, N].
    Returns the output [B, Hq, Q, D] (q's dtype) and per-row statistics, each [B, Hq, Q]:
    ``cost1``, ``cost2`` (kept keys / valid keys), ``kv_bytes`` (``kv_bytes_read``), ``static_frac``, ``est_error``,
    ``mass`` and ``topk_recall`` (``kept_mass_and_recall``; these three if ``compute_error``), ``empty``
    (the row had candidates and the method kept none of them), ``rows`` (row has at least one valid key), plus the
    method's own extras; with ``keep_masks`` also ``keep`` bool [B, Hq, Q, N].  ``masks``: ``pass_masks(valid, sink,
    local)`` when the caller has it already (the same for every layer of a pass).  ``row_seeds`` long [B]: each
    row's seed (its sample id; sampling methods draw from (method seed, layer, row seed), so a row draws the
    same in any batch).  ``layer_inputs``: the session's per-layer (hidden_states, position_embeddings) of the
    current pass (DS-Offload's prediction from the previous layer).  ``sparse_rows`` bool [B, Q]: the rows whose
    output the caller uses (a per-row phase; None: all), handed to the method as ``ctx.sparse_rows``.  ``generating``:
    the rows are generated tokens after a finished prompt (``AttentionContext.generating``).  ``fused``: the attention
    and its statistics from ``kernels.selected_attention`` (the caller resolves it: ``fused_attention_used``).
    """
    cfg = method.config
    with span("prepare"):  # the method's index over the keys (built once, then appended to)
        if method.prepare_with_valid:  # every row's valid keys: an index built in this call must stay causal
            method.prepare(state, k, v, layer_idx, valid=valid)
        else:
            method.prepare(state, k, v, layer_idx)
    b, hq, ql, _ = q.shape
    outs, stats_chunks = [], []
    for start in range(0, ql, query_chunk):
        stop = min(ql, start + query_chunk)
        if masks is None:  # per block of rows: [B, 1, Q, N] masks of a long prefill would not fit
            m = pass_masks(valid[:, :, start:stop], cfg.sink, cfg.local)
        else:
            m = masks if (start, stop) == (0, ql) else masks.rows_slice(start, stop)
        qc, vc, n_valid = q[:, :, start:stop], m.valid, m.n_valid
        with span("scores"):
            scores = scores_gqa(qc, k, scaling).masked_fill(m.invalid, NEG_INF)
        ctx = AttentionContext(
            q=qc,
            k=k,
            v=v,
            scores=scores,
            valid=vc,
            static=m.static,
            n_valid=n_valid,
            scaling=scaling,
            layer_idx=layer_idx,
            state=state,
            generator_seed=hash((cfg.seed, layer_idx)) & 0x7FFFFFFF,
            row_seeds=row_seeds,
            layer_inputs=layer_inputs,
            query_offset=start,
            candidate_mask=m.candidates,
            not_candidate_mask=m.not_candidates,
            sparse_rows=None if sparse_rows is None else sparse_rows[:, None, start:stop, None],
            generating=generating,
        )
        with span("select"):
            sel: Selection = method.select(ctx)
        with span("attend"):  # the kept keys (the method's and the static ones) and the one shared attention
            own = sel.keep & m.candidates
            # [B, Hq, Q]: the method kept none of the row's candidates (a row with no candidate, e.g. one whose
            # keys are all sink/local, cannot select any and is not counted; nor is any row of a method that
            # selects its static keys only)
            empty = ~own.any(-1) & m.candidates.any(-1)
            if method.selects_static_only:
                empty = torch.zeros_like(empty)
            keep = own | m.static
            if cfg.sink == 0 and cfg.local == 0:
                # nothing at all (no static keys configured and nothing picked): fall back to the newest valid
                # key.  With a sink or a local window every row with a valid key keeps at least that static key.
                nothing = ~keep.any(-1, keepdim=True) & (n_valid > 0)
                keep = keep | (nothing & vc & (vc.cumsum(-1) == n_valid))
            if fused:
                res, n_keep = _fused_attention(
                    q[:, :, start:stop], k, v, scores, keep, sel.bias, scaling, compute_error
                )
                out = res.o
            else:
                logits = scores if sel.bias is None else scores + torch.where(keep, sel.bias, torch.zeros_like(scores))
                p = masked_softmax(logits, keep)
                out = weighted_values(p, v)
        with span("stats"):  # the per-row costs and bytes read
            rows = m.rows.expand(b, hq, stop - start)
            if not fused:
                n_keep = keep.sum(-1)  # long [B, Hq, Q]
            n_keep_f = n_keep.float()
            st: dict[str, torch.Tensor] = {
                "rows": rows,
                "cost2": n_keep_f / m.n_rows,
                "static_frac": m.static_frac.expand(b, hq, -1),
                "empty": empty & rows,
            }
            c1 = method.cost1(ctx, sel)
            st["cost1"] = (
                torch.full((b, hq, stop - start), float(c1), device=q.device)
                if not torch.is_tensor(c1) or c1.dim() == 0
                else c1.float().expand(b, hq, stop - start)
            )
            st["kv_bytes"] = kv_bytes_read(method, ctx, sel, keep, kept=n_keep_f)
        if compute_error and fused:  # from the same pass as the output
            with span("error"):
                st["est_error"], st["mass"] = res.est_error, res.mass
                st["topk_recall"] = torch.where(
                    n_keep > 0,
                    (res.hits.float() / n_keep.clamp_min(1).float()).clamp_max(1.0),
                    torch.zeros_like(res.mass),
                )
        elif compute_error:
            with span("error"):
                # masked_softmax(scores, valid): scores are already -inf wherever a key is not valid
                p_dense = torch.softmax(scores, dim=-1).masked_fill_(m.invalid, 0.0)
                dense = weighted_values(p_dense, v).float()
                num = (out.float() - dense).norm(dim=-1)
                den = dense.norm(dim=-1)
                st["est_error"] = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
                st["mass"], st["topk_recall"] = kept_mass_and_recall(scores, p_dense, keep, kept=n_keep)
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
