"""H2O (Zhang et al., NeurIPS 2023, "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language
Models", arXiv 2306.14048): a KV-cache eviction policy that keeps the keys with the largest *accumulated* attention
(the heavy hitters) and a window of the most recent keys, and evicts the rest for good.

Per query row t of a batch row and head (Algorithm 1, greedy H2 eviction, as we read it: F_score(T) = Σ_{s∈T} o_s,
the attention each key has received so far, o_i normalised over the kept set S_{i-1}; the paper was not re-read for
this module), with the harness's static keys (sink + local window, added by ``core``).  Authors' code:
``FMInference/H2O`` at ac75c2a, the lm-eval simulation at 1603343 (HEAD replaced ``local_heavy_hitter_mask`` by a mask
from the column sums of every row, later ones included, which is not causal)::

    candidates_t = valid, non-static keys not yet evicted                       (the cache minus its recent window)
    heavy_t      = the ⌊heavy · n_t⌋ candidates of the largest score            (``heavy`` an int: that many)
    keep_t       = heavy_t ∪ sink ∪ local window                                 (what row t attends, b = 0)
    evicted     ∪= candidates_t \\ heavy_t                                      (never attended again)
    score       += p_t                                                          (row t's attention, see ``scores``)

``scores`` says which attention row is accumulated: ``kept`` (default), the attention row t computes over its kept
keys, Algorithm 1's o_i over S_{i-1} and what both cache implementations of the authors add
(``h2o_hf/utils_real_drop/modify_llama.py:505-509,317-326``, ``H2OKVCache_LayerWise._update_hh_score`` fed the
softmax over the evicted cache; ``h2o_hf/utils_hh/modify_llama.py:116-127``); ``full``, the full attention row over
every valid key, as the authors' lm-eval simulation ``local_heavy_hitter_mask`` does
(``h2o_hf/utils_lm_eval/modify_llama.py:43,50`` at 1603343: ``tmp_attn_index`` = softmax of the unmasked row).
Evicted keys keep no score and never return (``accumulated_attention_score * mask_bottom_index``, ibid. :51; the
real-drop cache drops their K/V, :279-285).  ``window_competes`` says which keys compete for the heavy slots: false
(default), the keys outside the static window, as the authors' caches pick ``hh_size`` keys among the non-recent
ones (``utils_real_drop/modify_llama.py:271-272``, ``utils_hh/modify_llama.py:146-157``); true, every key not yet
evicted but the row's own, as the simulation's top-k runs over all of them before the recent band is OR-ed in
(``utils_lm_eval/modify_llama.py:44,135-144`` at 1603343), so a key evicted from the heavy set while inside the window
is still attended until it leaves it.

Checked against the authors' code on random tensors (float32, 4 heads, no padding; all keep masks identical):
``scores=full window_competes=true sink=0 heavy=hb−1 local=recent+1`` gives ``local_heavy_hitter_mask`` + the
band of ``LlamaAttention_heavy_hitter.forward`` (their ``heavy_budget`` hb counts the query's own key: top hb−1 plus
the key itself, :44-47) at every position (protocol S); the defaults with ``heavy=hh_size local=recent_size+1`` give
``H2OKVCache_LayerWise`` after a dense prompt and at every decode step (protocol A).

Which form each protocol gets (the session decides which rows are sparse; the method follows its rows):

* **A** (dense prefill, sparse decode) = the authors' real-drop cache: the prompt runs dense and its rows' full
  attention is summed per key (``observe_dense``: ``_update_hh_score`` at prefill sums the prompt's attention over
  the query rows, :321-322); the first decode row keeps the top heavy keys of that sum among the non-recent ones
  (``keep_topk`` over ``hh_score[:, :seq_len - recent_size]``, :271-272) and every later step adds the new row's
  attention over the kept keys and evicts the lowest-scoring key that is not recent (:299-313; here: the one key
  that left the window competes with the heavy set).
* **B** (dense context, sparse question and generation): the context as A's prompt, then the recursion above per
  question row and per generated token.
* **S** (every row sparse, teacher-forced) = the simulation's per-position loop (``local_heavy_hitter_mask``,
  :41-51): from the first row on, each row keeps the top heavy keys of the score accumulated by the rows before it,
  and a key not kept is evicted (rows with no more candidates than the budget evict nothing).  With ``scores=full
  window_competes=true`` it is the simulation's mask exactly (above); the defaults accumulate Algorithm 1's kept-set
  attention and protect the window, as the caches do.  The loop is over positions only, vectorised
  over batch rows, heads and keys; a row's selection depends on its own earlier rows alone (causal), and the state
  is per batch row (records do not depend on the batch).

State, in the layer's ``ctx.state["h2o"]`` (kept across calls and decode steps; the cache resets it):
``score`` float32 [B, Hq, N] (accumulated attention per query head and key column, 0 once evicted) and ``alive``
bool [B, Hq, N] (not evicted).  A call with more key columns than the state extends it (new keys: score 0, alive);
a call with fewer, or another batch or head count, starts afresh.  Rows of a per-row phase that run dense
(``ctx.sparse_rows`` False) are treated as ``observe_dense`` treats a dense call: their full row is accumulated
and nothing is evicted, so a row's state is the same in any batch.  The accumulation is one row at a time, in the
rows' order, in every path (dense, per-row phase, sparse), so chunked prefill and batching do not change its
rounding.

Settings (docs/fidelity.md, H2O):
* ``heavy`` = 0.1: heavy hitters as a ratio of each row's context n (``base.token_budget``: ⌊0.1·n⌋) or an int
  (the real-drop cache's ``hh_size``).  The authors' ``--heavy_ratio 0.1 --recent_ratio 0.1``
  (``h2o_hf/scripts/lm_eval/h2o.sh:9``, ``run_lm_eval_harness.py:34-35``, 20 % of the KV cache in all,
  split evenly; ``run_text_generation.py:106-107``); they fix ``int(ratio·L)`` once per sequence
  (``utils_lm_eval/modify_llama.py:131``: L the whole request; ``utils_hh/modify_llama.py:129``: the prompt), which
  under S would look at the tokens after a row.
* ``local`` = 64: the recent window, the query's own key included (the authors' ``recent_size`` + 1: their cache
  keeps ``recent_size`` keys before the new one is appended, :276,478).  A fixed count here (the shared static
  window of every method); the authors' ``recent_ratio`` scales it with the sequence.
* ``sink`` = 0: the authors keep no attention sinks (``H2OKVCache_LayerWise`` keeps heavy + recent only,
  :271-277).
* ``dense_layers`` = []: the authors replace every layer's attention (``convert_kvcache_llama_heavy_recent``,
  ``utils_lm_eval/modify_llama.py:170-178`` at 1603343; ``H2OLlamaForCausalLM``,
  ``utils_real_drop/modify_llama.py:544-549``).
* ``gqa`` = query_head: scores and selection per query head (the authors' ``hh_score`` is [heads, keys], :322);
  ``kv_head`` ranks by the score summed over the KV group and evicts per group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .base import AttentionContext, Method, MethodConfig, Selection
from .core import masked_softmax, scores_gqa
from .labels import budget_label
from .registry import register
from .topk import topk_mask

SCORES = ("kept", "full")
NEG_INF = float("-inf")


@dataclass
class H2OConfig(MethodConfig):
    name: str = "h2o"
    sink: int = 0  # the authors keep no attention sinks
    local: int = 64  # the recent window, the query's own key included (the authors' recent_size + 1)
    dense_layers: list[Any] = field(default_factory=list)  # the authors' policy runs in every layer
    # heavy hitters: a ratio of each row's context in (0, 1] (float) or a number of tokens (int, the authors' hh_size)
    heavy: Any = 0.1
    # the attention row accumulated per key: "kept" (Algorithm 1, the authors' KV caches) or "full" (their lm-eval
    # simulation, local_heavy_hitter_mask)
    scores: str = "kept"
    # whether the static keys (the recent window, sinks) compete for the heavy slots too, as in the authors' lm-eval
    # simulation (its top-k runs over every key not yet evicted, the recent band is OR-ed in after); false: the heavy
    # hitters are chosen among the keys outside the window, as their KV caches do
    window_competes: bool = False


@register
class H2O(Method):
    """Heavy hitters by accumulated attention + the recent window; a key not kept is evicted for good."""

    name = "h2o"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "heavy hitters by accumulated attention + the recent window; an evicted key is gone (H2O)"
    config_class = H2OConfig
    display_name = "H2O"
    budget_field = "heavy"
    headline_options = ("heavy", "local")
    observes_dense = True  # the dense prompt's (A) or context's (B) attention seeds the scores

    @classmethod
    def contract_configs(cls):
        """A token budget in a small window (the end-to-end checks' config), a ratio with a sink, per-group
        selection and full-row scores, and the defaults."""
        return [{"heavy": 8, "local": 8}, {"heavy": 0.1, "sink": 2, "local": 8, "gqa": "kv_head", "scores": "full"}, {}]

    @classmethod
    def keep_all_options(cls, n):
        """heavy = 1.0: ⌊1.0·n⌋ = n heavy keys, so no candidate is ever evicted."""
        return {"heavy": 1.0}

    @property
    def index_reads_keys(self) -> bool:  # type: ignore[override]
        """``full`` scores need every valid key's K row (the full qKᵀ); ``kept`` reads the kept keys' K and V only."""
        return self.config.scores == "full"

    def validate(self, num_layers=None, context=None):
        super().validate(num_layers, context)
        if self.config.scores not in SCORES:
            raise ValueError(
                f"method.scores={self.config.scores!r}; valid: {list(SCORES)} (kept: the attention over "
                "the kept keys, Algorithm 1 and the authors' caches; full: the full row, their lm-eval "
                "simulation)"
            )

    # -- state ------------------------------------------------------------------------------------------------------
    @staticmethod
    def _state(
        state: dict[str, Any], b: int, hq: int, n: int, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(score float32 [B, Hq, N], alive bool [B, Hq, N]) of the layer, extended to ``n`` key columns."""
        st = state.get("h2o")
        if st is not None:
            score, alive = st["score"], st["alive"]
            if score.shape[:2] == (b, hq) and score.shape[2] <= n and score.device == device:
                extra = n - score.shape[2]
                if extra:
                    score = torch.cat([score, score.new_zeros(b, hq, extra)], -1)
                    alive = torch.cat([alive, alive.new_ones(b, hq, extra)], -1)
                return score, alive
        return torch.zeros(b, hq, n, dtype=torch.float32, device=device), torch.ones(
            b, hq, n, dtype=torch.bool, device=device
        )

    @staticmethod
    def _accumulate(score: torch.Tensor, alive: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        """score [B, Hq, N] + one attention row p [B, Hq, N]; evicted keys hold 0 (ibid. :50-51)."""
        return (score + p).masked_fill_(~alive, 0.0)

    def observe_dense(self, state, q, k, valid, scaling, layer_idx):
        """A dense call's rows (A's prompt, B's context): each row's full attention (q [B, Hq, Q, D] against the
        layer's keys k [B, Hkv, N, D], valid [B, 1, Q, N]) added to the scores row by row; nothing is evicted (the
        rows attended every key).  The real-drop cache's prefill: ``hh_score`` = the prompt's attention summed over
        its rows (``utils_real_drop/modify_llama.py:321-322``)."""
        b, hq, ql, _ = q.shape
        n = k.shape[2]
        score, alive = self._state(state, b, hq, n, q.device)
        step = max(1, (1 << 24) // max(1, b * hq * n))  # rows per block of scores
        for s0 in range(0, ql, step):
            vb = valid[:, :, s0 : s0 + step]  # [B, 1, Qb, N]
            s = scores_gqa(q[:, :, s0 : s0 + step], k, scaling).masked_fill(~vb, NEG_INF)  # [B, Hq, Qb, N] fp32
            p = masked_softmax(s, vb)  # the full rows (zeros for a row with no valid key: padding)
            for i in range(p.shape[2]):
                score = self._accumulate(score, alive, p[:, :, i])
        state["h2o"] = {"score": score, "alive": alive}

    # -- selection --------------------------------------------------------------------------------------------------
    def select(self, ctx: AttentionContext) -> Selection:
        c = self.config
        b, hq, ql, n = ctx.scores.shape
        score, alive = self._state(ctx.state, b, hq, n, ctx.scores.device)
        budget = self.budget_tokens(ctx)  # long [B, 1, Q, 1]
        kmax = self.budget_host_bound(n)
        cand, static, valid = ctx.candidates, ctx.static, ctx.valid  # bool [B, 1, Q, N]
        fallback = c.sink == 0 and c.local == 0 and c.scores == "kept"  # the core's newest-key fallback can apply
        # bool [B, 1, Q, N]: each row's own key (the core's fallback; the key that enters the cache after the row)
        newest = valid & (valid.cumsum(-1) == ctx.n_valid) if (fallback or c.window_competes) else None
        dense_rows = None if ctx.sparse_rows is None else ~ctx.sparse_rows  # bool [B, 1, Q, 1]
        # the full rows, for ``full`` scores and for the rows of a per-row phase that run dense (as observe_dense)
        p_full = masked_softmax(ctx.scores, valid) if (c.scores == "full" or dense_rows is not None) else None
        chosen_rows = []
        if c.window_competes:  # every valid key but the row's own (it enters the cache after the row)
            cand = valid & ~newest
        for i in range(ql):  # query positions in order: row i sees the state rows < i left
            live = cand[:, :, i] & alive  # [B, Hq, N]: the keys that compete for the heavy slots
            rank = score if c.gqa == "query_head" else ctx.group_sum(score)
            chosen = topk_mask(rank.masked_fill(~live, NEG_INF), budget[:, :, i], kmax) & live  # [B, Hq, N]
            if dense_rows is not None:  # a row still in its dense context keeps every key and evicts nothing
                chosen = torch.where(dense_rows[:, :, i], live, chosen)
            alive = alive & ~(live & ~chosen)  # the competitors not kept leave the heavy set for good
            if c.scores == "full":
                p = p_full[:, :, i]
            else:
                keep = chosen | static[:, :, i]  # what the core attends: own | static (+ its fallback)
                if fallback:
                    keep = keep | (~keep.any(-1, keepdim=True) & newest[:, :, i])
                p = masked_softmax(ctx.scores[:, :, i], keep)  # [B, Hq, N]: row i's attention over its kept keys
                if dense_rows is not None:
                    p = torch.where(dense_rows[:, :, i], p_full[:, :, i], p)
            score = self._accumulate(score, alive, p)
            chosen_rows.append(chosen)
        ctx.state["h2o"] = {"score": score, "alive": alive}
        return Selection(keep=torch.stack(chosen_rows, dim=2))  # [B, Hq, Q, N]

    # -- costs ------------------------------------------------------------------------------------------------------
    def cost1(self, ctx, sel):
        """``kept``: 0, the scores come from the attention over the kept keys already computed (and a top-k over the
        scores of the keys in the cache); ``full``: 0.5, the full qKᵀ of every row, as TopK."""
        return 0.5 if self.config.scores == "full" else 0.0

    def index_bytes(self, ctx, sel):
        if self.config.scores == "full":
            return super().index_bytes(ctx, sel)  # every valid key's K row
        return 0.0  # the scores are the cache's own bookkeeping: the kept keys' K and V rows are all it reads

    @classmethod
    def index_memory(cls, params, shape, n, sparse_layers, building_rows=False):
        """The scores (float32) and the evicted flags (bool) of every query head and key."""
        return {"scores": sparse_layers * shape.heads * n * (4 + 1)}

    @classmethod
    def label(cls, params):
        """ "<heavy> heavy + <window> recent" (the authors' heavy and recent budgets), and the scores if full rows."""
        text = f"{budget_label(params.get('heavy'))} heavy + {params.get('local')} recent"
        return text + (", full-row scores" if params.get("scores") == "full" else "")
