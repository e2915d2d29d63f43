"""SnapKV (Li et al., 2024, arXiv 2404.14469, "SnapKV: LLM Knows What You are Looking for Before Generation"): the
queries at the end of the prompt (the *observation window*) vote for the prompt keys they attend to; each head keeps
the keys with the most votes, clustered by a 1-D pooling, beside the window's own keys, and decodes over those alone.

The paper's abstract (the pattern each head attends to "can be obtained from an 'observation' window located at the
end of the prompts"; SnapKV compresses "by selecting clustered important KV positions for each attention head") is made
precise by the authors' code, which is what was read here (the paper's body was not available to this work; every
formula below is cited from the code): ``FasterDecoding/SnapKV`` at ``e216ddc``,
``snapkv/monkeypatch/snapkv_utils.py`` (``SnapKVCluster.update_kv``, lines 38-70), whose LongBench configs reproduce
the paper's LongBench results ("You should be able to reproduce the results shown on our report",
SnapKV's ``LongBench/README.md`` in its experiments folder).  For a prompt of L tokens, window w, capacity C, kernel
k, per head:

    W   = softmax_rows(Q[L-w:] Kᵀ/√d, causal)          [w, L]   the window's attention rows   (lines 45-54)
    v_j = Σ_{i ∈ window} W[i, j]          j < L - w      [L - w]  votes of the prefix keys      (line 55)
    c   = pool_k(v)  (max or average, stride 1, padding k//2)      clustering                   (lines 56-61)
    I   = top_{C - w}(c)                                            prefix keys kept             (line 62)
    kept keys = I ∪ {L-w, …, L-1}  (the window's own keys)                                      (lines 64-69)

and a prompt of L <= C tokens is kept whole (line 42; at L = C the top C - w of L - w prefix keys are all of them).
The prefill itself is dense (the compressed keys go to the cache only: ``llama_hijack_4_37.py:84-87``, the attention at
``:126`` uses the whole prompt); every generated token attends to the kept keys and to all generated keys (``:88-89``
append them to the compressed cache).  The selection is per query head: the KV heads are repeated before
``update_kv`` (``llama_hijack_4_37.py:75-77``, ``mistral_hijack_4_37.py:95-98``, "[SnapKV] move to ahead"), so each
query head of a GQA model (Mistral-7B: 32 query heads over 8 KV heads) keeps its own keys: ``gqa=query_head``
(``kv_head``: the group's votes summed, one selection per KV head; not the authors').

Here the kept set is a ``Selection`` over the whole cache (nothing is evicted; ``core`` attends over the kept keys
with b = 0, and the static ``sink``/``local`` keys, 0 by default as the authors keep none, are added by it):

* the capacity is the shared budget rule (``base.token_budget``): ``max_capacity_prompt`` an int (tokens, the authors')
  or a float ratio r of the prompt (C = ⌊r·L⌋); the prefix keys kept are C − w (none when C <= w);
* the window is its own field (``window_size``), not the shared ``local`` keys: it is both the queries that vote and
  the keys kept with them, and once tokens are generated the kept tail (the window + every generated key) outgrows any
  fixed ``local``;
* a row's *prompt* is every key before it: for a row at position t with n valid keys, L = n − 1 (its own key excluded),
  the window is the w rows t−w … t−1, the prefix the keys before t−w (ranked among the row's valid keys, so left
  padding is never prefix or window), and it keeps I ∪ {t−w, …, t} (the window's keys and its own).

When the selection is made, per protocol (the rows' queries reach the method through ``Method.observe_dense`` for
dense calls and ``select`` for sparse ones, a per-row phase's dense rows (``ctx.sparse_rows`` False) included; the
last w of them are kept per layer and per batch row in ``ctx.state``):

* **A** (dense prefill, sparse decoding: the authors' setting): the first generated row (t = L) selects with the
  prompt's last w queries as ``update_kv`` does (checked against a copy of it: the same keys up to top-k ties); the
  selection is then frozen in the layer's state and every later generated row keeps it plus every key after the
  prompt (``AttentionContext.generating``).  Chunked prefill
  (``eval.prefill_chunk``) changes nothing: the window's queries are kept across the chunks' calls.
* **S** (every row sparse): each prompt row t applies the rule above to its own prefix: the window is the w rows
  before it, so no row's selection depends on a later token (causal), and a chunk boundary changes only which call a
  window row arrived in (its queries are kept across calls): the same rule, with the float rounding that chunking
  gives every method's sparse path (stories260K, 3 prompts, chunks of 16 and 5 vs one pass: the same tokens, NLL
  sums within 7e-5; TopK's within 5e-5).  Generated rows (the engine's decode steps) then keep the selection of the
  first one, frozen, as under A.  A row among the first w of a sequence has an empty prefix and keeps every key.
* **B** (dense context, sparse question and decoding): the question's rows apply the per-row rule (their windows
  reach back into the dense context, whose last queries were observed); the generated rows freeze as under A.
* Rows whose window queries the layer never saw (``attend()`` on captured tensors whose first query row is not the
  sequence's) vote with the window rows it did see (none: all votes 0, ties broken by position).  Outside the engine,
  a sparse one-row call under S or B (``model.generate``) counts as a prompt row: the window slides with it.

Departures from the authors' arithmetic (none changes the rule): the votes are summed in float32 (the authors cast the
softmax to the model dtype first, ``snapkv_utils.py:54``); pooling adds (or takes the max of) the k shifted vote rows in
a fixed order and divides by k (``avg_pool1d``'s count_include_pad default), and zero votes pad both ends of the prefix
(the same as ``max_pool1d``'s −inf padding, votes being >= 0); top-k ties are broken by position in the
batch-invariant mode.  Cost1 = 0 and index_bytes = 0: the votes are the prompt's own attention rows, computed once by
the dense prefill under A (a one-time selection at the prompt's end); under S and B the per-row vote (w rows' scores
over the row's keys) is not charged.  Settings and their sources: docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from .base import AttentionContext, Method, MethodConfig, Selection, token_budget
from .core import masked_softmax, scores_gqa
from .labels import budget_label, budget_level, count_label
from .registry import register
from .topk import topk_mask

POOLINGS = ("maxpool", "avgpool")


@dataclass
class SnapKVConfig(MethodConfig):
    name: str = "snapkv"
    # the authors' max_capacity_prompt: keys a compressed prompt keeps, window included (int: tokens, 1024/2048/4096
    # in the repo's LongBench configs; float: a ratio of the row's prompt, through ``base.token_budget``)
    max_capacity_prompt: Any = 1024
    window_size: int = 32  # observation window: the prompt's last queries, whose keys are kept (LongBench configs: 32)
    kernel_size: int = 7  # pooling kernel along the key axis, odd (LongBench configs: 7; init_snapkv's default: 5)
    pooling: str = "maxpool"  # maxpool | avgpool (LongBench configs: maxpool; init_snapkv's default: avgpool)
    sink: int = 0  # the authors keep no static keys besides the window
    local: int = 0
    dense_layers: list[Any] = field(default_factory=list)  # every layer compresses (init_snapkv in every attention)


@register
class SnapKV(Method):
    """Keeps, per query head, the ``max_capacity_prompt − window_size`` prefix keys with the most pooled votes of the
    observation window, the window's keys and everything after it (generated tokens)."""

    name = "snapkv"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "the prompt keys the last window_size queries vote for, chosen once at the first token (SnapKV)"
    config_class = SnapKVConfig
    display_name = "SnapKV"
    budget_field = "max_capacity_prompt"
    budget_may_exceed_context = True  # a prompt shorter than the capacity is kept whole
    headline_options = ("max_capacity_prompt", "window_size")
    observes_dense = True  # protocol A's and B's dense prompt rows carry the window's queries
    index_reads_keys = False  # decoding reads the kept keys' K and V only

    @classmethod
    def contract_configs(cls):
        """A token capacity that compresses the 96-key synthetic rows (max pooling, the defaults' k = 7), a ratio with
        average pooling and one selection per KV group, and the defaults (1024 tokens: rows that short keep all)."""
        return [
            {"max_capacity_prompt": 40, "window_size": 8},
            {"max_capacity_prompt": 0.3, "window_size": 4, "kernel_size": 5, "pooling": "avgpool", "gqa": "kv_head"},
            {},
        ]

    @classmethod
    def model_contract_configs(cls):
        """16 tokens of capacity, a window of 4: the 20-160-token test prompts are compressed."""
        return [{"max_capacity_prompt": 16, "window_size": 4}]

    @classmethod
    def keep_all_options(cls, n):
        """max_capacity_prompt = 1.0: C = L, so the C − w top prefix keys are the whole prefix."""
        return {"max_capacity_prompt": 1.0}

    def validate(self, num_layers=None, context=None):
        super().validate(num_layers, context)
        c = self.config
        if isinstance(c.window_size, bool) or not isinstance(c.window_size, int) or c.window_size < 1:
            raise ValueError(f"method.window_size={c.window_size!r}: an int >= 1 (the observation window's queries)")
        if isinstance(c.max_capacity_prompt, int) and c.max_capacity_prompt <= c.window_size:
            # the authors assert max_capacity_prompt - window_size > 0 (snapkv_utils.py:27)
            raise ValueError(
                f"method.max_capacity_prompt={c.max_capacity_prompt} must exceed method.window_size="
                f"{c.window_size} (it counts the window's keys too)"
            )
        if (
            isinstance(c.kernel_size, bool)
            or not isinstance(c.kernel_size, int)
            or c.kernel_size < 1
            or c.kernel_size % 2 == 0
        ):
            raise ValueError(
                f"method.kernel_size={c.kernel_size!r}: an odd int >= 1 (padding kernel_size // 2 keeps "
                "one pooled vote per key only for odd kernels)"
            )
        if c.pooling not in POOLINGS:
            raise ValueError(f"method.pooling={c.pooling!r}; valid: {list(POOLINGS)}")

    # -- the observation window's queries, per layer (ctx.state) ------------------------------------------------------
    def _remember(self, state: dict[str, Any], q: torch.Tensor, valid: torch.Tensor) -> None:
        """Keep the last ``window_size`` prompt rows: q [B, Hq, R, D] and their key masks valid bool [B, 1, R, N]."""
        w = self.config.window_size
        b, hq, _, d = q.shape
        n = valid.shape[-1]
        old_q, old_v = state.get("snapkv_q"), state.get("snapkv_valid")
        if old_q is None or old_q.shape[0] != b:
            old_q, old_v = q.new_zeros(b, hq, 0, d), valid.new_zeros(b, 1, 0, n)
        elif old_v.shape[-1] < n:  # keys added since: after every remembered row, so not valid for it
            old_v = torch.cat([old_v, old_v.new_zeros(*old_v.shape[:-1], n - old_v.shape[-1])], -1)
        state["snapkv_q"] = torch.cat([old_q, q[:, :, -w:]], 2)[:, :, -w:]  # [B, Hq, <= w, D]
        state["snapkv_valid"] = torch.cat([old_v, valid[:, :, -w:]], 2)[:, :, -w:]  # [B, 1, <= w, N]
        state.pop("snapkv_frozen", None)  # a longer prompt: the next generated row selects anew

    def _window(self, state: dict[str, Any], q: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The w rows before the call: queries [B, Hq, w, D] and key masks bool [B, 1, w, N] (rows never seen: zero
        queries with no valid key, which vote nothing)."""
        w = self.config.window_size
        b, hq, _, d = q.shape
        old_q, old_v = state.get("snapkv_q"), state.get("snapkv_valid")
        if old_q is None or old_q.shape[0] != b:
            return q.new_zeros(b, hq, w, d), torch.zeros(b, 1, w, n, dtype=torch.bool, device=q.device)
        if old_v.shape[-1] < n:
            old_v = torch.cat([old_v, old_v.new_zeros(*old_v.shape[:-1], n - old_v.shape[-1])], -1)
        missing = w - old_q.shape[2]
        if missing:
            old_q = torch.cat([old_q.new_zeros(b, hq, missing, d), old_q], 2)
            old_v = torch.cat([old_v.new_zeros(b, 1, missing, n), old_v], 2)
        return old_q.to(q.dtype), old_v[..., :n]

    def observe_dense(self, state, q, k, valid, scaling, layer_idx):
        """A dense prompt call (protocols A and B): its last ``window_size`` rows may be the observation window."""
        r = min(self.config.window_size, q.shape[2])
        self._remember(state, q[:, :, -r:], valid[:, :, -r:])

    # -- selection -----------------------------------------------------------------------------------------------------
    def select(self, ctx: AttentionContext) -> Selection:
        if ctx.generating:
            return Selection(keep=self._generated(ctx))
        keep = self._prompt_rows(ctx, ctx.q, ctx.scores, ctx.valid, ctx.n_valid)
        self._remember(ctx.state, ctx.q, ctx.valid)
        return Selection(keep=keep)

    def _prompt_rows(
        self, ctx: AttentionContext, q: torch.Tensor, scores: torch.Tensor, valid: torch.Tensor, n_valid: torch.Tensor
    ) -> torch.Tensor:
        """bool [B, Hq, Q, N]: each row's SnapKV selection of its own prompt (the keys before it).  q [B, Hq, Q, D],
        scores [B, Hq, Q, N] (−inf where not valid), valid bool [B, 1, Q, N], n_valid long [B, 1, Q, 1]."""
        c = self.config
        w = c.window_size
        b, hq, ql, _ = q.shape
        n = ctx.k.shape[2]
        cap = c.max_capacity_prompt
        if (isinstance(cap, int) and cap >= n - 1) or (isinstance(cap, float) and cap >= 1.0):
            return valid.expand(b, hq, ql, n)  # every row's prompt (at most n - 1 keys) fits: kept whole (line 42)
        prompt = n_valid - 1  # [B, 1, Q, 1]: L, the keys before the row
        picks = (token_budget(cap, prompt) - w).clamp_min(0)  # [B, 1, Q, 1]: C − w prefix keys (line 62)
        rank = valid.cumsum(-1)  # [B, 1, Q, N]: 1-based rank among the row's valid keys; its own key has rank L + 1
        window = valid & (rank > prompt - w)  # the window's keys t−w … t−1 and the row's own key t
        prefix = valid & ~window  # keys before t−w
        kmax = max(0, min(n, token_budget(cap, n) - w))  # host bound of picks
        if kmax == 0:
            return window.expand(b, hq, ql, n)
        # the w rows before the block (kept across calls) and the block's rows: row r's window is rows r … r+w−1
        wq, wv = self._window(ctx.state, q, n)  # [B, Hq, w, D], [B, 1, w, N]
        ws = scores_gqa(wq, ctx.k, ctx.scaling).masked_fill(~wv, float("-inf"))  # [B, Hq, w, N]
        probs = masked_softmax(torch.cat([ws, scores], 2), torch.cat([wv, valid], 2))  # [B, Hq, w+Q, N] rows' attention
        votes = probs[:, :, 0:ql].clone()  # [B, Hq, Q, N]: Σ over the window rows t−w … t−1 (line 55)
        for i in range(1, w):
            votes += probs[:, :, i : i + ql]
        if c.gqa == "kv_head":
            votes = ctx.group_sum(votes)
        votes = votes.masked_fill(~prefix, 0.0)  # only the prefix votes (line 55: columns :-window_size)
        pooled = self._pool(votes).masked_fill(~prefix, float("-inf"))  # [B, Hq, Q, N] (lines 56-61)
        return topk_mask(pooled, picks, kmax) | window  # lines 62-69

    def _pool(self, x: torch.Tensor) -> torch.Tensor:
        """1-D pooling along the key axis, stride 1, padding kernel_size // 2 with zeros (x >= 0, 0 outside the
        prefix): the max, or the sum over the kernel / kernel_size (``avg_pool1d``, count_include_pad)."""
        h = self.config.kernel_size // 2
        out = x.clone()
        for d in range(1, h + 1):
            left = F.pad(x[..., :-d], (d, 0))  # x[j − d]
            right = F.pad(x[..., d:], (0, d))  # x[j + d]
            if self.config.pooling == "maxpool":
                out = torch.maximum(torch.maximum(out, left), right)
            else:
                out = out + left + right
        return out if self.config.pooling == "maxpool" else out / self.config.kernel_size

    def _generated(self, ctx: AttentionContext) -> torch.Tensor:
        """bool [B, Hq, Q, N] for generated rows: the first one's selection (a prompt row's, with the prompt's last
        window), frozen in the layer's state, plus every key the first one could not see (the generated ones)."""
        b, hq, ql, _ = ctx.q.shape
        n = ctx.k.shape[2]
        frozen = ctx.state.get("snapkv_frozen")
        if frozen is None or frozen[0].shape[0] != b:
            keep0 = self._prompt_rows(
                ctx, ctx.q[:, :, :1], ctx.scores[:, :, :1], ctx.valid[:, :, :1], ctx.n_valid[:, :, :1]
            )  # [B, Hq, 1, N]
            frozen = (keep0, ctx.valid[:, :, :1])  # the selection and the keys the first generated row saw
            ctx.state["snapkv_frozen"] = frozen
        keep0, seen = frozen
        if keep0.shape[-1] < n:
            pad = n - keep0.shape[-1]
            keep0 = torch.cat([keep0, keep0.new_zeros(*keep0.shape[:-1], pad)], -1)
            seen = torch.cat([seen, seen.new_zeros(*seen.shape[:-1], pad)], -1)
        return ctx.valid & (keep0[..., :n] | ~seen[..., :n])  # [B, Hq, Q, N]

    def index_bytes(self, ctx, sel):
        return 0.0  # the selection is fixed at the prompt's end: decoding reads the kept keys' K and V only

    # -- what the memory estimate and the report ask -------------------------------------------------------------------
    @classmethod
    def index_memory(cls, params, shape, n, sparse_layers, building_rows=False):
        """Per sparse layer: the window's queries (float32 at most) and key masks, and the frozen selection."""
        w = int(params.get("window_size", 32))
        return {
            "observation window": sparse_layers * (shape.heads * w * shape.head_dim * 4 + w * n),
            "selection": sparse_layers * (shape.heads + 1) * n,
        }

    @classmethod
    def label(cls, params):
        """ "<capacity> cap, window <w>, <pooling> <k>", the authors' max_capacity_prompt, window_size, pooling."""
        return (
            f"{budget_label(params.get('max_capacity_prompt'))} cap, window "
            f"{count_label(params.get('window_size'))}, {params.get('pooling')} "
            f"{count_label(params.get('kernel_size'))}"
        )

    @classmethod
    def level(cls, params, context):
        """The capacity's share of an average row, at most 1 (a prompt shorter than it is kept whole)."""
        lv = budget_level(params.get("max_capacity_prompt"), context)
        return None if lv is None else min(1.0, lv)
