"""Helpers more than one test module uses (``from helpers import ...``; ``tests/`` is on the path through its
``conftest.py``): a composed Hydra config, a tiny random-weight Gemma 3 with sliding layers, a toy lm-eval task."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir

from sparse_eval.config import CONF_DIR, register_configs

register_configs()
WINDOW = 8  # the sliding window of tiny_gemma3's sliding layers
TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]


def cfg_for(tmp_path, *overrides):
    """The composed ``config`` with its runs under ``tmp_path`` and ``overrides`` added."""
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"paths.runs_dir={tmp_path}", *overrides])


def tiny_gemma3(window: int = WINDOW, vocab: int = 128):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        query_pre_attn_scalar=16,
        sliding_window=window,
        layer_types=TYPES,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    return Gemma3ForCausalLM(cfg).eval()


# three TinyStories-style prompts, long enough (~80-100 tokens of the 512-token vocabulary) that a small TopK
# budget plus sink/local keeps far fewer keys than the prompt has
TOY_DOCS = [
    {
        "story": "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. One "
        "day, she saw a big, red ball. She wanted to play with it, but it was too high. Lily asked her mom for help. "
        "Her mom said yes and they played together all day. At the end of the day, Lily was very happy. She said "
        "thank you to her mom and went to",
        "answer": "bed",
    },
    {
        "story": "Tom had a small dog named Max. Max liked to run and jump in the garden. One sunny day, Tom and Max "
        "went to the lake. They saw a duck swimming in the water. Max wanted to catch the duck, but Tom said no. The "
        "duck flew away and Max was sad. Tom gave Max a big hug and they went",
        "answer": "home",
    },
    {
        "story": "Sue found a shiny box under her bed. She opened it and saw a tiny bird inside. The bird was cold and "
        "hungry. Sue gave it some bread and water. The bird ate the bread and sang a happy song. Sue smiled and "
        "said the bird could stay with her. Every morning the bird sang for",
        "answer": "Sue",
    },
]


def toy_task(folder: Path) -> Path:
    """A generate_until task over TOY_DOCS: greedy, until '.', 12 new tokens, exact_match (lm-eval metric)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "toy.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in TOY_DOCS), encoding="utf-8")
    (folder / "toy_story.yaml").write_text(
        "task: toy_story\n"
        "dataset_path: json\n"
        f"dataset_kwargs: {{data_files: {{test: {json.dumps(str(data))}}}, "
        f"cache_dir: {json.dumps(str(folder / 'cache'))}}}\n"
        "test_split: test\n"
        "output_type: generate_until\n"
        "doc_to_text: '{{story}}'\n"
        "doc_to_target: ' {{answer}}'\n"
        "generation_kwargs: {until: ['.'], max_gen_toks: 12, do_sample: false}\n"
        "metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true, ignore_case: true}]\n"
        "metadata: {version: 1.0}\n",
        encoding="utf-8",
    )
    return folder


def run_toy_folder(tmp: Path, *overrides: str) -> list[dict]:
    """The runner's summaries for a composed lm_eval config over the toy task folder under ``tmp`` (8 new tokens,
    no bootstrap), with ``overrides`` added."""
    from sparse_eval.launcher.runner import run

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            config_name="config",
            overrides=[
                "task=lm_eval",
                f"task.include_path={toy_task(tmp / 'tasks')}",
                "task.bootstrap_iters=0",
                "task.gen_kwargs={max_gen_toks:8}",
                f"task.work_dir={tmp / 'work'}",
                f"paths.runs_dir={tmp / 'runs'}",
                "print_table=false",
                *overrides,
            ],
        )
    return run(cfg)
