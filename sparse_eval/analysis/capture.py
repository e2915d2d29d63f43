"""Capturing what each attention layer sees: q, K, V as the model uses them (keys and queries after RoPE).

A second attention function, ``"sparse_eval_capture"``, is registered in transformers' ``AttentionInterface``
(with transformers' ``sdpa_mask`` under the same name, so padding would arrive as a mask).  It records
``query [B, Hq, T, D]``, ``key``/``value [B, Hkv, T, D]`` (exactly the tensors handed to attention: RoPE applied,
K/V not repeated for GQA) and the module's scaling, then runs stock sdpa, so the model's outputs are unchanged.
``capture_qkv`` switches a model to it for one forward and back to what it used before.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from ..models.inspection import head_shape
from ..models.placement import main_device

CAPTURE_NAME = "sparse_eval_capture"
_STORE_ATTR = "_sparse_eval_capture"


@dataclass
class LayerQKV:
    """One layer's attention inputs for one forward (float32 unless ``dtype`` was given)."""

    layer: int
    q: torch.Tensor  # [B, Hq, Tq, D]  (Tq = the last ``query_rows`` positions, or all T)
    k: torch.Tensor  # [B, Hkv, T, D]  post-RoPE
    v: torch.Tensor  # [B, Hkv, T, D]
    scaling: float

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]


class _Store:
    def __init__(self, query_rows: int | None, dtype: torch.dtype | None, device: str | None):
        self.query_rows = query_rows
        self.dtype = dtype
        self.device = device
        self.layers: dict[int, LayerQKV] = {}


def _capture_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    store: _Store | None = getattr(module, _STORE_ATTR, None)
    scaling = module.scaling if scaling is None else scaling
    if store is not None:
        q = query if store.query_rows is None else query[:, :, -store.query_rows :]

        def keep(x: torch.Tensor) -> torch.Tensor:
            x = x.detach()
            if store.device is not None:
                x = x.to(store.device)
            return x.to(store.dtype) if store.dtype is not None else x

        store.layers[module.layer_idx] = LayerQKV(module.layer_idx, keep(q), keep(key), keep(value), float(scaling))
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


AttentionInterface.register(CAPTURE_NAME, _capture_attention)
AttentionMaskInterface.register(CAPTURE_NAME, sdpa_mask)


@contextlib.contextmanager
def capturing(
    model: torch.nn.Module,
    layers: Sequence[int] | None = None,
    query_rows: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    device: str | None = "cpu",
) -> Iterator[_Store]:
    """Inside the block, every forward of ``model`` records the attention inputs of ``layers`` (all: None)."""
    from ..models.inspection import attention_modules

    mods = attention_modules(model)
    wanted = None if layers is None else {int(i) for i in layers}
    store = _Store(query_rows, dtype, device)
    previous = model.config._attn_implementation
    for m in mods:
        if wanted is None or m.layer_idx in wanted:
            setattr(m, _STORE_ATTR, store)
    model.set_attn_implementation(CAPTURE_NAME)
    try:
        yield store
    finally:
        model.set_attn_implementation(previous)
        for m in mods:
            if hasattr(m, _STORE_ATTR):
                delattr(m, _STORE_ATTR)


@torch.inference_mode()
def capture_qkv(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    layers: Sequence[int] | None = None,
    query_rows: int | None = None,
    dtype: torch.dtype | None = torch.float32,
    device: str | None = "cpu",
) -> dict[int, LayerQKV]:
    """One forward of ``input_ids`` [B, T] (no cache, no padding); returns {layer: LayerQKV}.

    The query rows kept are the last ``query_rows`` positions (None: all): the query of the last position with
    all T keys is exactly a decoding step over a densely prefilled cache of T − 1 tokens plus the new one.
    """
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    dev = main_device(model)
    with capturing(model, layers, query_rows, dtype, device) as store:
        model(input_ids=ids.to(dev), use_cache=False)
    if not store.layers:
        raise RuntimeError("no attention call was captured; is this a decoder model that uses the AttentionInterface?")
    return dict(sorted(store.layers.items()))


@torch.inference_mode()
def capture_layer_inputs(model: torch.nn.Module, input_ids: torch.Tensor) -> dict[int, dict[str, torch.Tensor]]:
    """Per decoder layer: ``hidden`` (its residual-stream input x_l [B, T, H]) and ``attn_input`` (the
    attention module's input h_l = input_layernorm(x_l)), float32 on the CPU."""
    from ..models.inspection import attention_modules

    mods = sorted(attention_modules(model), key=lambda m: m.layer_idx)
    parents = decoder_layers(model)
    out: dict[int, dict[str, torch.Tensor]] = {}
    handles = []

    def layer_hook(idx):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            out.setdefault(idx, {})["hidden"] = x.detach().float().cpu()

        return hook

    def attn_hook(module, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        out.setdefault(module.layer_idx, {})["attn_input"] = h.detach().float().cpu()

    for idx, parent in enumerate(parents):
        handles.append(parent.register_forward_pre_hook(layer_hook(idx), with_kwargs=True))
    for m in mods:
        handles.append(m.register_forward_pre_hook(attn_hook, with_kwargs=True))
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    try:
        model(input_ids=ids.to(main_device(model)), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(out.items()))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers (the parents of the attention modules), in layer order."""
    from ..models.inspection import attention_modules

    mods = {id(m): m for m in attention_modules(model)}
    found = {}
    for mod in model.modules():
        for child in mod.children():
            if id(child) in mods:
                found[child.layer_idx] = mod
    return [found[i] for i in sorted(found)]


def model_shape(model: Any) -> dict[str, int]:
    cfg = model.config.get_text_config()
    shape = head_shape(cfg)
    return {
        "num_layers": shape.layers,
        "num_heads": shape.heads,
        "num_kv_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "vocab_size": cfg.vocab_size,
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
    }
