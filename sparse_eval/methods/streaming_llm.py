"""StreamingLLM (Xiao et al., 2023, "Efficient Streaming Language Models with Attention Sinks"): each query attends
to the first keys of the sequence (the attention sinks) and a window of the most recent keys, nothing else
(§3.2, Fig. 1d: the rolling KV cache with attention sinks).

In this harness those are exactly the static keys every method keeps (``sink`` first keys + ``local`` last keys of
each row, added by ``core``), so the method selects no key of its own and its attention is

    ô = Σ_{i ∈ sink ∪ window} softmax_i(q·k_i/√d) v_i,   b = 0

Its Cost2 is the static fraction, Cost1 = 0 (no search), and it reads the K and V rows of the kept keys only.
``sink`` is the authors' ``start_size``; ``local`` counts the query's own key, so it is their ``recent_size`` + 1
(the authors' cache holds ``recent_size`` keys before the query's own is appended); with ``sink=0 local=0`` a row
keeps only its newest key (``core``'s fallback).  Settings and the one departure (keys keep their original
positions; the authors' ``enable_pos_shift`` re-positions them within the cache): docs/fidelity.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .base import AttentionContext, Method, MethodConfig, Selection
from .registry import register


@dataclass
class StreamingLLMConfig(MethodConfig):
    name: str = "streaming_llm"
    sink: int = 4  # attention sinks: the authors' start_size (4 in the paper and kv_cache.py)
    local: int = 64  # the recent window, the query's own key included (the authors' recent_size + 1)
    dense_layers: list[Any] = field(default_factory=list)  # the authors' cache is every layer's


@register
class StreamingLLM(Method):
    """Attention sinks + a recent window: the static keys alone (``selects_static_only``)."""

    name = "streaming_llm"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "attention sinks + the recent window, nothing else (StreamingLLM)"
    config_class = StreamingLLMConfig
    display_name = "StreamingLLM"
    selects_static_only = True  # a row keeping no candidate is the method, not an empty selection
    index_reads_keys = False  # no index: the kept keys' K and V rows are all it reads

    @classmethod
    def keep_all_options(cls, n):
        """local = n: the recent window covers every key of a row of at most n keys."""
        return {"local": n}

    def select(self, ctx: AttentionContext) -> Selection:
        return Selection(keep=ctx.static.expand_as(ctx.scores))  # [B, Hq, Q, N]: the static keys, nothing else

    def index_bytes(self, ctx, sel):
        return 0.0  # nothing read to find the keys: they are the first and the last of the row

    @classmethod
    def label(cls, params):
        """ "<sinks> sink + <window> recent", the authors' start_size + recent_size."""
        return f"{params.get('sink')} sink + {params.get('local')} recent"
