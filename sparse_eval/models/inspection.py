"""What a loaded transformers model says about its attention layers, read without attaching anything: its
self-attention modules (``attention_modules``), the layers that attend within a sliding window of their own
(``sliding_layers``), every layer's window (``layer_windows``) and the smallest window any layer sees
(``attention_window``); and, from its config alone, its layer and head counts and head dimension
(``head_shape``), the one place these are read.

Used by the attention plug-in (``attention.plugin``), the runs, the system path and the methods that read a model
(Double Sparsity's calibration); no project imports.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class HeadShape:
    """A model's layer count, query heads, KV heads and head dimension."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int


def head_shape(config: Any) -> HeadShape:
    """The layer and head counts and head dimension of a model's ``config`` (its text sub-config where it has one,
    ``get_text_config()``): KV heads default to the query heads where ``num_key_value_heads`` is absent or None,
    and the head dimension to ``hidden_size // num_attention_heads`` where ``head_dim`` is."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(cfg.num_attention_heads)
    return HeadShape(
        layers=int(cfg.num_hidden_layers),
        heads=heads,
        kv_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(cfg, "head_dim", None) or cfg.hidden_size // heads),
    )


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention modules of a decoder (Llama, Mistral, Qwen2/3, ...): they carry ``layer_idx`` and
    ``num_key_value_groups`` and are called through the attention interface."""
    mods = [
        m
        for m in model.modules()
        if hasattr(m, "layer_idx") and hasattr(m, "num_key_value_groups") and hasattr(m, "scaling")
    ]
    if not mods:
        raise ValueError(f"found no attention modules with layer_idx/num_key_value_groups in {type(model).__name__}")
    return mods


def sliding_layers(model: torch.nn.Module) -> dict[int, int]:
    """{layer index: window} of the layers that attend within a sliding window of their own (window: the keys a
    query row may see, itself included).

    A layer slides where the model declares it per layer: ``config.layer_types[i] == "sliding_attention"``
    (Gemma 3: 5 of every 6 layers, 512 keys; Qwen2 with ``use_sliding_window``) or an attention module carrying a
    ``sliding_window``.  A config with one ``sliding_window`` for all layers and no layer types (Mistral-7B-v0.1,
    4096) declares no sliding layers: its layers are all alike and run as the method says (the window still
    applies through the mask; ``attention_window`` covers it)."""
    cfg = model.config.get_text_config()
    types = getattr(cfg, "layer_types", None)
    window = getattr(cfg, "sliding_window", None)
    out: dict[int, int] = {}
    for m in attention_modules(model):
        i = m.layer_idx
        w = getattr(m, "sliding_window", None)
        if w is None and types is not None and i < len(types) and types[i] == "sliding_attention":
            w = window
        if w is not None:
            out[i] = int(w)
    return dict(sorted(out.items()))


def layer_windows(model: torch.nn.Module) -> dict[int, int]:
    """{layer index: window} of every layer that attends within a window (the keys a query row may see, itself
    included): the sliding layers (``sliding_layers``) and, where a config sets one ``sliding_window`` and no layer
    types (Mistral-7B-v0.1, 4096), every layer.  A layer missing here sees every earlier key."""
    cfg = model.config.get_text_config()
    out = dict(sliding_layers(model))
    if getattr(cfg, "layer_types", None) is None and getattr(cfg, "sliding_window", None) is not None:
        for m in attention_modules(model):
            out.setdefault(m.layer_idx, int(cfg.sliding_window))
    return dict(sorted(out.items()))


def attention_window(model: torch.nn.Module) -> int | None:
    """The smallest window any layer of ``model`` attends within (None: every layer sees every earlier key): a
    sliding layer's (``sliding_layers``) or the one ``sliding_window`` a config without layer types sets for all
    (``layer_windows``)."""
    windows = list(layer_windows(model).values())
    return min(windows) if windows else None
