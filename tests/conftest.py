"""Shared fixtures: the shipped model, tiny random-weight models, the shared data folder."""

from __future__ import annotations

import os
from pathlib import Path

# Without a GPU, Triton kernels run in its interpreter; the variable must be set before triton is first
# imported by any test module, so it is set here rather than in the kernel tests.
if not Path("/dev/nvidia0").exists() and not Path("/dev/nvidiactl").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
STORIES_DIR = REPO / "sparse_eval" / "models" / "stories260K"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.exists():
        pytest.skip(f"shared data folder {SHARED_DATA} not present")
    return SHARED_DATA


@pytest.fixture(scope="session")
def stories():
    """(model, tokenizer) of the shipped stories260K, fp32 on CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import sparse_eval.attention.plugin  # noqa: F401

    tok = AutoTokenizer.from_pretrained(STORIES_DIR)
    tok.pad_token, tok.padding_side = tok.eos_token, "left"
    model = AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval()
    return model, tok


def tiny_model(kind: str = "llama", layers: int = 3, seed: int = 0):
    """A random-weight model of the given architecture with GQA (4 query heads, 2 KV heads)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    import sparse_eval.attention.plugin  # noqa: F401

    common = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[kind]
    torch.manual_seed(seed)
    return model_cls(cfg_cls(**common)).eval()


def tiny_qwen2():
    """A random-weight Qwen2 (8 query / 2 KV heads, q/k/v biases), the non-Llama GQA case of the method tests."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).eval()


def attach_generate(model, method, ids, mask, new=5, model_name="test", runtime=None):
    """Greedy ``model.generate`` with ``method`` attached (set up for ``model_name``); returns (output, session)."""
    from sparse_eval.attention.plugin import attach, detach

    method.setup(model, model_name)
    session = attach(model, method, runtime)
    try:
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
    finally:
        detach(model)
    return out, session


def jsonl_records(path) -> list[dict]:
    """Every line of a run's ``samples.jsonl`` as a record (a JSON object with an ``id``), in file order.  A line
    that is not one (torn, two records run together, a stray value) fails the calling test with an assertion that
    names the line: a store that wrote a bad line gave a wrong result, which a test must report as such, not as the
    ``JSONDecodeError`` of its own reading."""
    import json

    records, bad = [], []
    for i, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            bad.append(f"line {i} ({e.msg} at column {e.colno}): {line[:80]!r}{'...' if len(line) > 80 else ''}")
            continue
        if not isinstance(rec, dict) or "id" not in rec:
            bad.append(f"line {i} is not a record with an id: {line[:80]!r}")
            continue
        records.append(rec)
    assert not bad, f"{path}: {len(bad)} of its lines are not sample records: " + "; ".join(bad)
    return records


def records_by_id(path, drop=("time_s",)) -> dict[str, dict]:
    """``jsonl_records`` as {id: record without the ``drop`` fields}; one record per id is asserted (a resumed run
    must not write a sample twice)."""
    recs = jsonl_records(path)
    ids = [r["id"] for r in recs]
    dup = sorted({i for i in ids if ids.count(i) > 1})
    assert not dup, f"{path}: samples recorded more than once: {dup}"
    return {r["id"]: {k: v for k, v in r.items() if k not in drop} for r in recs}
