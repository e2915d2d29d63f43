"""``models.inspection.head_shape``: the layer and head counts and head dimension, read in one place."""

from __future__ import annotations

from types import SimpleNamespace

from sparse_eval.run.memory import Shape
from sparse_eval.models.inspection import HeadShape, head_shape


def test_head_shape_defaults_kv_heads_and_head_dim():
    """No ``num_key_value_heads`` (or None): as many KV heads as query heads; no ``head_dim``: hidden // heads."""
    cfg = SimpleNamespace(num_hidden_layers=3, num_attention_heads=4, hidden_size=64)
    assert head_shape(cfg) == HeadShape(layers=3, heads=4, kv_heads=4, head_dim=16)
    cfg = SimpleNamespace(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=None, head_dim=None, hidden_size=64
    )
    assert head_shape(cfg) == HeadShape(layers=3, heads=4, kv_heads=4, head_dim=16)
    cfg = SimpleNamespace(
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, head_dim=32, hidden_size=64
    )
    assert head_shape(cfg) == HeadShape(layers=2, heads=8, kv_heads=2, head_dim=32)


def test_head_shape_reads_the_text_config():
    """A composite config (Gemma 3 with a vision tower) is read through ``get_text_config()``."""
    from transformers import Gemma3Config, Gemma3TextConfig

    text = Gemma3TextConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
    )
    cfg = Gemma3Config(text_config=text.to_dict())
    assert head_shape(cfg) == HeadShape(layers=2, heads=4, kv_heads=1, head_dim=16)
    assert head_shape(cfg) == head_shape(text)
    s = Shape.from_config(cfg)
    assert (s.layers, s.heads, s.kv_heads, s.head_dim) == (2, 4, 1, 16)
