"""WikiText-2 perplexity (raw test split): non-overlapping windows, loss over all tokens, exp(mean NLL).

This is the Double Sparsity paper's language-modelling measurement (DS Table 2), which ran every query
position sparse: the task's default protocol is therefore S (under A a teacher-forced window never decodes,
so a decode-only method would leave perplexity unchanged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..generation.requests import LoglikelihoodRequest, LoglikelihoodResult
from .base import Sample, Task, TaskConfig, from_hub, register_task

BUNDLED = Path(__file__).resolve().parents[1] / "data" / "wikitext2_test_head.txt"
LOCAL_NAME = "wikitext-2-raw/wikitext-test.txt"  # under paths.data_dir: "\n\n".join(rows), CRLF line ends
HUB_ID, HUB_CONFIG = "Salesforce/wikitext", "wikitext-2-raw-v1"
SOURCES = ("auto", "bundled", "local", "hub")


@dataclass
class WikitextConfig(TaskConfig):
    name: str = "wikitext"
    # auto: paths.data_dir if it has the file, else the hub; bundled: the 47 KB head shipped in the package;
    # local: paths.data_dir (or ``path``); hub: datasets.load_dataset(Salesforce/wikitext, wikitext-2-raw-v1)
    source: str = "auto"
    path: str | None = None  # explicit text file (overrides source)
    window: int = 4096  # tokens per window (DS: 4096); clipped to the model's context with a warning
    add_bos: bool = True  # tokenize the joined text once with the tokenizer's special tokens (BOS first)


def load_text(cfg: WikitextConfig, data_dir: Path | None) -> tuple[str, str]:
    """Returns (text, where it came from)."""
    if cfg.source not in SOURCES:
        raise ValueError(f"task.source={cfg.source!r}; valid: {list(SOURCES)}")
    if cfg.path:
        p = Path(cfg.path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"task.path: {p} does not exist")
        return p.read_text(encoding="utf-8").replace("\r\n", "\n"), str(p)
    if cfg.source == "bundled":
        return BUNDLED.read_text(encoding="utf-8"), f"bundled:{BUNDLED.name}"
    local = data_dir / LOCAL_NAME if data_dir else None
    if cfg.source in ("auto", "local") and local is not None and local.exists():
        with open(local, encoding="utf-8", newline="") as f:
            return f.read().replace("\r\n", "\n"), str(local)
    if cfg.source == "local":
        raise FileNotFoundError(
            f"task.source=local but {local if local else 'paths.data_dir (unset)'} has no {LOCAL_NAME}; "
            "set paths.data_dir to a folder holding it, or use task.source=hub / bundled"
        )
    with from_hub(
        "task=wikitext",
        f"{HUB_ID}/{HUB_CONFIG}",
        (data_dir / LOCAL_NAME) if data_dir else f"<paths.data_dir>/{LOCAL_NAME}",
        "or task=wikitext_head for the 47 KB head shipped in the package",
    ):
        import datasets

        ds = datasets.load_dataset(HUB_ID, HUB_CONFIG, split="test")
    return "\n\n".join(ds["text"]), f"hub:{HUB_ID}/{HUB_CONFIG}"


@register_task
class Wikitext(Task):
    name = "wikitext"
    summary = "WikiText-2 test perplexity over non-overlapping task.window-token windows (DS Table 2)"
    num_samples_means = "the first N windows"
    config_class = WikitextConfig
    default_protocol = "S"
    metric = "ppl"
    higher_is_better = False

    def validate(self) -> None:
        super().validate()
        if self.config.window < 2:
            raise ValueError(f"task.window={self.config.window}: must be >= 2")
        if self.config.source not in SOURCES:
            raise ValueError(f"task.source={self.config.source!r}; valid: {list(SOURCES)}")

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:
        text, origin = load_text(self.config, self.data_dir)
        if Path(origin).is_file():
            self.record_file("text", origin)
        window = self.config.window
        if window > max_context:
            raise ValueError(f"task.window={window} exceeds the model's context ({max_context} tokens)")
        ids = tokenizer(text, add_special_tokens=self.config.add_bos, verbose=False)["input_ids"]
        n = len(ids) // window
        if n == 0:
            raise ValueError(f"the text ({len(ids)} tokens) is shorter than one window ({window})")
        count = n if self.config.num_samples is None else min(n, self.config.num_samples)
        return [
            Sample(id=f"w{i:05d}", data={"input_ids": ids[i * window : (i + 1) * window], "source": origin})
            for i in range(count)
        ]

    def request(self, sample: Sample) -> LoglikelihoodRequest:
        return LoglikelihoodRequest(sample.data["input_ids"], key=sample.id)

    def score(self, sample: Sample, result: LoglikelihoodResult) -> dict[str, Any]:
        nll, count = result.nll_sum, result.tokens
        return {
            "nll_sum": nll,
            "tokens": count,
            "score": math.exp(nll / count),
            "prompt_tokens": len(sample.data["input_ids"]),
        }

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        tokens = sum(r["tokens"] for r in records)
        if not tokens:
            return {"ppl": None, "tokens": 0}
        return {"ppl": math.exp(sum(r["nll_sum"] for r in records) / tokens), "tokens": tokens}

    def score_terms(self, records: list[dict[str, Any]]):
        """Perplexity exp(Σ NLL / Σ tokens) over windows: the bootstrap resamples windows."""
        from ..metrics.statistics import ScoreTerms

        return ScoreTerms(
            [r["id"] for r in records],
            [r["nll_sum"] for r in records],
            [r["tokens"] for r in records],
            [0] * len(records),
            transform="exp",
        )
