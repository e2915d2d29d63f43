"""WikiText perplexity's windows: consecutive, non-overlapping slices of ``task.window`` tokens of the text tokenized
once (the last partial window dropped), each scored alone over its window - 1 predicted tokens (DS Table 2's
measurement, ``sparse_eval/tasks/wikitext.py``)."""

from __future__ import annotations

import math

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine
from sparse_eval.methods import build_method, make_config
from sparse_eval.tasks.base import build_task
from sparse_eval.tasks.wikitext import load_text


class _PositionTokenizer:
    """Word ``t<i>`` of the text is token i + 3, after BOS = 1 with special tokens: a token's id says its place."""

    def __call__(self, text, add_special_tokens=True, verbose=False):
        return {"input_ids": ([1] if add_special_tokens else []) + [int(w[1:]) + 3 for w in text.split()]}


def _task(tmp_path, words: int, **opts):
    path = tmp_path / "text.txt"
    path.write_text(" ".join(f"t{i}" for i in range(words)) + "\n", encoding="utf-8")
    return build_task({"name": "wikitext", "path": str(path), **opts})


def test_windows_are_consecutive_and_do_not_overlap(tmp_path):
    """101 tokens (BOS + 100 words) in windows of 16: 6 windows starting at tokens 0, 16, …, 80, each exactly the
    16 tokens from there; the last 5 tokens are in none."""
    samples = _task(tmp_path, 100, window=16).samples(_PositionTokenizer(), 4096)
    ids = [1] + [i + 3 for i in range(100)]
    assert [s.id for s in samples] == [f"w{i:05d}" for i in range(6)]
    starts = [ids.index(s.data["input_ids"][0]) for s in samples]
    assert starts == [0, 16, 32, 48, 64, 80], f"window starts {starts}: windows of 16 tokens must not overlap"
    for i, s in enumerate(samples):
        assert s.data["input_ids"] == ids[16 * i : 16 * (i + 1)], f"window {i}"
    assert sum(len(s.data["input_ids"]) for s in samples) == 96  # 6 × 16 of the 101 tokens: the 5 left are dropped
    # num_samples: the first windows; no BOS: the words alone; a window as long as the text: one
    assert [
        s.data["input_ids"] for s in _task(tmp_path, 100, window=16, num_samples=2).samples(_PositionTokenizer(), 4096)
    ] == [ids[:16], ids[16:32]]
    no_bos = _task(tmp_path, 100, window=25, add_bos=False).samples(_PositionTokenizer(), 4096)
    assert [s.data["input_ids"] for s in no_bos] == [ids[1 + 25 * i : 1 + 25 * (i + 1)] for i in range(4)]
    assert [s.data["input_ids"] for s in _task(tmp_path, 100, window=101).samples(_PositionTokenizer(), 4096)] == [ids]
    with pytest.raises(ValueError, match="shorter than one window"):
        _task(tmp_path, 100, window=102).samples(_PositionTokenizer(), 4096)


@torch.inference_mode()
def test_each_window_is_scored_alone_over_its_predicted_tokens(stories):
    """The bundled text through stories260K's tokenizer in windows of 32: the windows are the tokenized text's
    consecutive slices; under full attention each record is its window alone (the model's own ``labels=`` loss,
    no context carried over from the window before) over 31 predicted tokens, and the perplexity is
    exp(Σ NLL / Σ tokens) over them."""
    model, tok = stories
    task = build_task({"name": "wikitext", "source": "bundled", "window": 32, "num_samples": 3})
    samples = task.samples(tok, 512)
    text, _ = load_text(task.config, None)
    ids = tok(text, add_special_tokens=True, verbose=False)["input_ids"]
    assert [s.data["input_ids"] for s in samples] == [ids[32 * i : 32 * (i + 1)] for i in range(3)]
    session = attach(model, build_method(make_config("full", {})), Runtime(protocol="S"))
    try:
        results = Engine(model, tok, session).nll_batch([task.request(s) for s in samples])
    finally:
        detach(model)
    records = [task.score(s, r) for s, r in zip(samples, results)]
    for s, rec in zip(samples, records):
        window = torch.tensor([s.data["input_ids"]])
        own = float(model(input_ids=window, labels=window).loss) * 31
        assert rec["tokens"] == 31 and rec["prompt_tokens"] == 32, rec
        assert rec["nll_sum"] == pytest.approx(own, rel=1e-5), s.id
        assert rec["score"] == pytest.approx(math.exp(own / 31), rel=1e-5)
    agg = task.aggregate(records)
    assert agg["tokens"] == 93
    assert agg["ppl"] == pytest.approx(math.exp(sum(r["nll_sum"] for r in records) / 93), rel=1e-12)
