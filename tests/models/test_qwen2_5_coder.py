"""Qwen2.5-Coder-1.5B-Instruct (``model=qwen2_5_coder_1_5b``, the Q4_K_M GGUF of ``scripts/get_qwen2_5_coder_1_5b.sh``)
loaded through the package equals stock transformers.

Stock: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=..., attn_implementation="sdpa")`` in float32.  The
package: ``load_model`` of ``conf/model/qwen2_5_coder_1_5b.yaml`` with the plug-in attached under full attention,
once as a plain call (dense attention is stock sdpa: the same logits) and once inside ``batch_invariant()`` as the
engine runs it (fixed-order kernels: the logits to float rounding).  On a chat-templated question and a RULER
niah_single_1 prompt of 1K tokens: the prompt's logits at every position, and the greedy tokens after it.

Measured on the 2-core dev machine, 2026-12-05, on the same question and a 1,910-token RULER prompt, 32 greedy
tokens: the plain plug-in's logits equal stock's bit for bit; the invariant kernels' differ by at most 8.5e-5
(question) and 5.6e-4 (RULER; logits up to 30), every position's argmax and every greedy token the same.

The model is ~7 GiB in float32 and is loaded twice (one after the other, ~2-3 min each on that machine), so the
test is ``slow`` (5 min 54 s there, 11 GiB peak); it skips when the GGUF is not where the conf looks.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest
import torch

from conftest import SHARED_DATA

NAME = "qwen2_5_coder_1_5b"
MODELS_DIR = Path(os.environ.get("SPARSE_EVAL_MODELS_DIR", "~/.cache/sparse_eval/models")).expanduser()
QUESTION = "Write a Python function that returns the n-th Fibonacci number, then explain it in one sentence."
NEW_TOKENS = 12


def _conf() -> dict:
    from sparse_eval.models.loading import named_config

    return named_config(NAME, {"models_dir": str(MODELS_DIR)})


def _gguf() -> Path:
    c = _conf()
    return Path(c["path"]) / c["gguf_file"]


def _data_dir() -> Path | None:
    d = os.environ.get("SPARSE_EVAL_DATA_DIR")
    d = Path(d) if d else SHARED_DATA
    return d if (d / "paul-graham-essays").exists() else None


def test_conf_names_the_file_the_script_writes():
    """The conf's directory and file under paths.models_dir are where the script puts them by default."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "get_qwen2_5_coder_1_5b.sh").read_text()
    c = _conf()
    assert f"$HOME/.cache/sparse_eval/models/{Path(c['path']).name}" in script
    assert f"name={c['gguf_file']}" in script
    assert c["max_context"] == 32768 and "get_qwen2_5_coder_1_5b.sh" in c["how_to_get"]


def test_a_missing_gguf_is_refused_naming_the_script(tmp_path):
    from sparse_eval.models.loading import ModelConfig, resolve_path

    cfg = ModelConfig(**{**_conf(), "path": str(tmp_path / "qwen2.5-coder-1.5b-instruct")})
    with pytest.raises(FileNotFoundError, match="scripts/get_qwen2_5_coder_1_5b.sh"):
        resolve_path(cfg)


def _prompts(tok) -> dict[str, torch.Tensor]:
    ids = tok.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, return_tensors="pt", return_dict=True
    )["input_ids"]
    out = {"question": ids}
    data = _data_dir()
    if data is not None:
        from sparse_eval.tasks import ruler_data as rd

        res = rd.Resources(seed=42, haystack=None, essay_path=None, data_dir=data)
        g = rd.generate("niah_single_1", 1, 1024, rd.Prompter(tok, chat_template=True), res)[0]
        out["ruler_1k"] = torch.as_tensor(g.input_ids, dtype=torch.long)[None]
        out["answer"] = g.answers[0]
    return out


@torch.inference_mode()
def _run(model, tok, ids: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits at every position [T, V] and the greedy tokens after it."""
    logits = model(ids).logits[0].float()
    gen = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        pad_token_id=tok.pad_token_id,
    )
    return logits, gen[0, ids.shape[1] :].tolist()


@pytest.mark.slow
def test_package_load_and_full_attention_equal_stock_sdpa():
    gguf = _gguf()
    if not gguf.exists():
        pytest.skip(f"{gguf} not present (scripts/get_qwen2_5_coder_1_5b.sh)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sparse_eval.attention.plugin import Runtime, attach, detach
    from sparse_eval.invariance import batch_invariant
    from sparse_eval.methods import build_method, make_config
    from sparse_eval.models.loading import ModelConfig, load_model, max_context

    # stock first, freed before the package's copy is loaded (two float32 copies would take ~14 GiB)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    stock = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, attn_implementation="sdpa", dtype=torch.float32
    ).eval()
    prompts = _prompts(tok)
    answer = prompts.pop("answer", None)
    ref = {name: _run(stock, tok, ids) for name, ids in prompts.items()}
    del stock
    gc.collect()

    c = _conf()
    cfg = ModelConfig(**{**c, "device": "cpu"})
    model, ptok = load_model(cfg)
    text = model.config.get_text_config()
    assert (text.model_type, text.num_hidden_layers, text.num_attention_heads, text.num_key_value_heads) == (
        "qwen2",
        28,
        12,
        2,
    )
    assert text.hidden_size // text.num_attention_heads == 128 and text.rope_parameters["rope_theta"] == 1e6
    assert max_context(cfg, model) == 32768 and model.dtype == torch.float32
    assert not text.tie_word_embeddings  # the GGUF's own output.weight (Q6_K), not the embedding
    assert {k: v.tolist() for k, v in _prompts(ptok).items() if k != "answer"} == {
        k: v.tolist() for k, v in prompts.items()
    }
    for invariant in (False, True):
        for name, ids in prompts.items():
            session = attach(model, build_method(make_config("full", {})), Runtime(protocol="A"))
            try:
                if invariant:
                    session.row_starts = torch.zeros(1, dtype=torch.long)  # as the engine sets them
                    with batch_invariant(True):
                        logits, tokens = _run(model, ptok, ids)
                else:
                    logits, tokens = _run(model, ptok, ids)
            finally:
                detach(model)
                model.set_attn_implementation("sdpa")
            ref_logits, ref_tokens = ref[name]
            assert tokens == ref_tokens, (name, invariant, ptok.decode(tokens), ptok.decode(ref_tokens))
            assert torch.equal(logits.argmax(-1), ref_logits.argmax(-1)), (name, invariant)
            tol = 2e-3 if invariant else 1e-5  # measured: 5.6e-4 and 0 (logits up to 30)
            torch.testing.assert_close(logits, ref_logits, rtol=0, atol=tol, msg=lambda m: f"{name} {invariant}: {m}")
    if answer is not None:  # the model finds the needle (it does at 1K and 2K on this prompt)
        assert answer in ptok.decode(ref["ruler_1k"][1])
