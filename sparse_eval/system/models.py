"""Models of real shape with random weights, so that the system path's speed can be measured without
downloading weights (the decode cost of a transformer does not depend on the values of its weights; what the
sparse methods select does, so accuracy is never measured on these)."""

from __future__ import annotations

from typing import Any

import torch

# Llama-3.1-8B(-Instruct) config.json: 32 layers, 32 query / 8 KV heads of dim 128, llama3 RoPE scaling
SHAPES: dict[str, dict[str, Any]] = {
    "llama3_1_8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        tie_word_embeddings=False,
    ),
    # Llama-2-7B: 32 layers, 32 heads (no GQA), 4K context (the Double Sparsity paper's system model)
    "llama2_7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        head_dim=128,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
    ),
}


def random_model(
    shape: str,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_layers: int | None = None,
    seed: int = 0,
) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` (a key of ``SHAPES``) with transformers' random initialisation,
    built directly on ``device`` in ``dtype``; ``num_layers`` truncates it (for smoke tests)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}; valid: {sorted(SHAPES)}")
    kw = dict(SHAPES[shape])
    if num_layers is not None:
        kw["num_hidden_layers"] = int(num_layers)
    cfg = LlamaConfig(**kw)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()
