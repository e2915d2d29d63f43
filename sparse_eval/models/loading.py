"""Loading a causal LM and its tokenizer: a hub id, a local directory, a GGUF file, or the shipped model."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BUILTIN_DIR = Path(__file__).resolve().parent
BUILTIN_PREFIX = "builtin:"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    """`conf/model/*.yaml`.  ``path``: a hub id, a local directory, or ``builtin:stories260K``."""

    name: str = "stories260k"
    path: str = "builtin:stories260K"
    gguf_file: str | None = None  # file name inside ``path`` (a directory) for GGUF checkpoints
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when present) | cpu | cuda | cuda:N
    max_context: int | None = None  # defaults to the model's max_position_embeddings
    revision: str | None = None
    trust_remote_code: bool = False
    how_to_get: str = ""  # shown when a local path is missing


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} but CUDA is not available; valid here: 'auto', 'cpu'")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"model.dtype={dtype!r}; valid: {['auto', *DTYPES]}") from None


def resolve_path(cfg: ModelConfig) -> str:
    """A local directory or a hub id; refuses a missing local path with a message that says how to get it."""
    p = cfg.path
    if p.startswith(BUILTIN_PREFIX):
        local = BUILTIN_DIR / p[len(BUILTIN_PREFIX):]
        if not (local / "config.json").exists():
            valid = sorted(d.name for d in BUILTIN_DIR.iterdir() if (d / "config.json").exists())
            raise FileNotFoundError(f"model.path={p!r}: no shipped model there; shipped models: {valid}")
        return str(local)
    local = Path(p).expanduser()
    if local.exists() or p.startswith((".", "/", "~")):
        target = local / cfg.gguf_file if cfg.gguf_file else local
        if not target.exists():
            hint = f" To get it: {cfg.how_to_get}" if cfg.how_to_get else ""
            raise FileNotFoundError(f"model.path: {target} does not exist.{hint}")
        return str(local)
    return p  # a hub id


def load_model(cfg: ModelConfig, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """Returns (model in eval mode on its device, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..attention import plugin  # noqa: F401  (registers the attention function before the model is built)

    device = resolve_device(cfg.device)
    dtype = resolve_dtype(cfg.dtype, device)
    path = resolve_path(cfg)
    kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, **kw)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kw)
    except OSError as exc:  # not on disk and not reachable on the hub: say how to get it instead of a traceback
        reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        hint = cfg.how_to_get or (f"Download it once (huggingface-cli download {cfg.path} --local-dir DIR) and set "
                                  f"model.path=DIR, or check the hub id")
        raise FileNotFoundError(f"model.path={cfg.path!r}: cannot load the model ({reason}). {hint}") from None
    model.to(device).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def max_context(cfg: ModelConfig, model: Any) -> int:
    if cfg.max_context:
        return int(cfg.max_context)
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", 4096))
