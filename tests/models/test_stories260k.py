"""Tests for the shipped stories260K HF conversion (scripts/convert_stories260k.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO_ROOT / "sparse_eval" / "models" / "stories260K"
SCRIPT = REPO_ROOT / "scripts" / "convert_stories260k.py"
SRC_DIR = Path(__file__).resolve().parents[2].parent / "shared/data/stories260K"

EXPECTED_PREFIX = "Once upon a time, there was a little girl named Lily. She loved to play outside in the park."


def _load_script():
    name = "convert_stories260k"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # needed for dataclasses inside the module
    spec.loader.exec_module(module)
    return module


def test_greedy_sample_from_bos(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert MODEL_DIR.is_dir(), f"missing converted model at {MODEL_DIR}"
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)

    assert tokenizer("Once upon a time")["input_ids"][0] == tokenizer.bos_token_id == 1
    with torch.no_grad():
        out = model.generate(
            torch.tensor([[1]]),
            attention_mask=torch.ones(1, 1, dtype=torch.long),
            max_new_tokens=40,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
        )
    text = tokenizer.decode(out[0], skip_special_tokens=True)
    assert text.startswith(EXPECTED_PREFIX), text


@pytest.mark.skipif(not SRC_DIR.is_dir(), reason=f"llama2.c source files not available at {SRC_DIR}")
def test_reconversion_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    conv = _load_script()
    conv.convert(SRC_DIR, tmp_path, n_sample_tokens=8, log=lambda *a, **k: None)

    shipped = load_file(MODEL_DIR / "model.safetensors")
    fresh = load_file(tmp_path / "model.safetensors")
    assert shipped.keys() == fresh.keys()
    for name, tensor in shipped.items():
        other = fresh[name]
        assert tensor.dtype == other.dtype == torch.float32, name
        assert tensor.shape == other.shape, name
        # bit-identical, not merely close
        assert torch.equal(tensor.view(torch.int32), other.view(torch.int32)), name
