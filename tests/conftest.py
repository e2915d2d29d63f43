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


# -- what the default run leaves to `-m slow` -----------------------------------------------------------------------
# Per-method variants of a check whose path is shared: the default run keeps the variants that exercise each distinct
# piece of method state (MagicPIG's tables and seeds, H2O's eviction, Double Sparsity's labels, Quest's pages, TopK's
# ties, oracle sampling's draws) and `-m slow` runs the rest. Each entry: test function -> parameter ids kept in the
# default run (every other id of it is marked slow), with what covers the moved ones.
DEFAULT_VARIANTS = {
    # the resume machinery is the runner's (also tests/launcher/test_runner.py::test_resume_after_interrupted_run);
    # the kept methods carry state across a kill (hash tables, eviction, labels)
    "test_a_run_killed_in_a_batch_resumes_to_the_records_of_an_unbroken_run": {
        "magicpig-0",
        "h2o-0",
        "double_sparsity-0",
    },
    # the fixed-order kernels are shared (tests/checks/test_invariance.py's kernel tests); every method under
    # protocol A, protocols B and S through MagicPIG (sampled selections) and TopK (ties)
    "test_records_do_not_depend_on_the_batch": {
        "A-None-double_sparsity-0",
        "A-None-full-0",
        "A-None-h2o-0",
        "A-None-magicpig-0",
        "A-None-oracle-0",
        "A-None-quest-0",
        "A-None-snapkv-0",
        "A-None-streaming_llm-0",
        "A-None-topk-0",
        "B-None-magicpig-0",
        "S-16-magicpig-0",
        "S-16-topk-0",
    },
    # the dispatch hooks and the per-layer device of method state: the methods that keep state on a layer's device
    "test_records_over_a_device_map_are_those_on_one_device": {
        "magicpig-0",
        "quest-0",
        "h2o-0",
        "oracle-0",
        "double_sparsity-0",
    },
    # the system path's static step: one configuration per method family (the rest vary an option of the same kernel)
    "test_static_step_gives_the_same_tokens": {"full", "magicpig", "quest", "ds", "ds_offload"},
    "test_same_tokens_as_accuracy_path": {"magicpig", "quest", "ds", "ds_offload"},
    # two halves of a batch decoding in turn: the row bookkeeping is the session's, the same for every method
    "test_interleaved_halves_decode_each_rows_own_tokens": {"magicpig"},
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        keep = DEFAULT_VARIANTS.get(getattr(item, "originalname", item.name))
        callspec = getattr(item, "callspec", None)
        if keep is not None and callspec is not None and callspec.id not in keep:
            item.add_marker(pytest.mark.slow)
