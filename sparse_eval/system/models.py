"""Models of real shape with random weights, so that the system path's speed can be measured without
downloading weights (the decode cost of a transformer does not depend on the values of its weights; what the
sparse methods select does, so accuracy is never measured on these)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Llama-3.1-8B(-Instruct) config.json: 32 layers, 32 query / 8 KV heads of dim 128, llama3 RoPE scaling
_LLAMA3_1_8B: dict[str, Any] = dict(
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
)
SHAPES: dict[str, dict[str, Any]] = {
    "llama3_1_8b": _LLAMA3_1_8B,
    # Llama-3.1-70B(-Instruct) config.json (MagicPIG Table 4/5): 80 layers, 64 query / 8 KV heads of dim 128, width
    # 8192, the 8B's vocabulary and RoPE; ~141 GB in bf16, more than one GPU: run it over several with
    # ``model.device_map`` (``write_checkpoint``; ``num_layers`` gives a shallower stand-in of the same width)
    "llama3_1_70b": {
        **_LLAMA3_1_8B,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
    },
    # Llama-2-7B: 32 layers, 32 heads (no GQA), 4K context (the Double Sparsity paper's system model)
    "llama2_7b": {
        **_LLAMA3_1_8B,
        "vocab_size": 32000,
        "intermediate_size": 11008,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    },
}


def random_model(
    shape: str,
    device: str | torch.device = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    *,
    num_layers: int | None = None,
    seed: int = 0,
    overrides: dict[str, Any] | None = None,
) -> Any:
    """A ``LlamaForCausalLM`` of ``shape`` (a key of ``SHAPES``) with transformers' random initialisation,
    built directly on ``device`` in ``dtype``; ``num_layers`` truncates it (for smoke tests, or a shallower stand-in
    of a model too large to build); ``overrides``: other config fields (e.g. smaller widths for a CPU test)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}; valid: {sorted(SHAPES)}")
    kw = dict(SHAPES[shape]) | dict(overrides or {})
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


# the shipped tokenizer a random checkpoint is written with (its 512 ids are valid ids of any shape here; generated ids
# beyond them decode to nothing)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_checkpoint(
    out_dir: str | Path,
    shape: str,
    *,
    num_layers: int | None = None,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    device: str | torch.device = "cpu",
    overrides: dict[str, Any] | None = None,
    max_shard_size: str = "5GB",
) -> Path:
    """Writes ``random_model(shape, ...)`` (built on ``device``, e.g. a GPU, which is faster) as a checkpoint folder
    (config.json, safetensors shards, generation config) with the shipped stories260K's tokenizer, so that the
    accuracy path loads it like any model (``python -m sparse_eval model.path=OUT_DIR model.name=NAME
    model.device_map=balanced``; ``benchmarks/bench_device_map.py``).  A random model of 70B shape does not fit one
    GPU either; ``num_layers`` writes a shallower stand-in of the same width (16 of its 80 layers: ~32 GB in bf16).
    Returns the folder."""
    import shutil

    from ..models.loading import BUILTIN_DIR

    out = Path(out_dir).expanduser()
    model = random_model(shape, device, dtype, num_layers=num_layers, seed=seed, overrides=overrides)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, max_shard_size=max_shard_size)
    for name in TOKENIZER_FILES:
        shutil.copyfile(BUILTIN_DIR / "stories260K" / name, out / name)
    del model
    return out
