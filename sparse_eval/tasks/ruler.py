"""RULER (Hsieh et al., 2024): 13 synthetic long-context tasks generated locally with the model's tokenizer
(``ruler_data``), scored with RULER's metrics (``sparse_eval.metrics.ruler``), as the MagicPIG paper's Table 3
(Llama-3.1-8B-Instruct; 16K/32K/64K/96K; 50 samples per task; average over the 13 tasks per length).

One run is one ``length``; sweep lengths with Hydra multirun (``task.length=16384,32768,65536,98304``).

Settings that change results, with their defaults:
  ``length``: prompt tokens + the task's ``tokens_to_generate`` <= length (RULER's ``max_seq_length``);
  ``num_samples=50`` (MagicPIG's ``config_tasks.sh``; RULER's own default is 500);
  ``seed=42`` (RULER's ``--random_seed``); sample ``i`` of a subtask depends only on (seed, subtask, i) and
      the length and tokenizer it is sized for;
  ``chat_template=true``: the prompt is wrapped as one user turn in the tokenizer's own chat template
      (generation prompt on) and the answer prefix follows the assistant header.  The MagicPIG repo ran
      Llama-3.1-8B-Instruct with RULER's ``meta-chat-3`` model template, i.e. the model's chat format written
      by hand (its string lacks the leading ``<`` of ``<|begin_of_text|>`` and has spaces around the task; the
      tokenizer adds BOS); the tokenizer's template is the faithful form of that (it also writes Llama-3.1's
      default system header with its knowledge/today dates, which meta-chat-3 did not).  A tokenizer without
      a chat template (base models, the shipped stories260K) gets RULER's ``base`` template (the plain
      prompt) and the samples record ``chat_template: false``.  ``chat_template=false``: always plain.
  ``haystack=null``: RULER's haystack per subtask; ``noise`` (alias ``repeat``) or ``needle`` replaces the
      essay haystack of niah_single_2/3, niah_multikey_1, niah_multivalue, niah_multiquery (not comparable to
      published numbers; for machines without the essays).
  ``remove_newline_tab=false``: RULER's option of the same name (applied to the task text, not the template).
Greedy decoding (``Engine.generate``), stopping at EOS or after ``tokens_to_generate`` tokens; no stop words
(RULER's default ``STOP_WORDS=""``).

Data (``paths.data_dir`` or the ``*_path`` options): the Paul Graham essays RULER downloads; SQuAD v2 dev
(``qa_1``; the shared copy holds its first 16 of 35 articles: the same first 50 questions as RULER's file, with
fewer distractor paragraphs); HotpotQA distractor dev (``qa_2``; the shared copy is a 100-question sample, not
RULER's first questions).  ``qa_source=hub`` (or ``auto`` without local files) loads the full dev sets with
``datasets`` (``rajpurkar/squad_v2``, ``hotpotqa/hotpot_qa``/distractor).

Score of a sample: RULER's metric in [0, 100]; a subtask's score: mean over its samples; the headline
``score``: mean over the subtasks run (RULER's summary lists the per-task scores; papers report their mean).
Protocol A by default (MagicPIG); under B the context (everything up to the end of the haystack) is
prefilled dense and the question, answer prefix and generation are sparse.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from ..metrics.ruler import metric_fn, postprocess_pred
from ..generation.requests import GenerationRequest, GenerationResult
from .base import Sample, Task, TaskConfig, register_task
from . import ruler_data as rd

log = logging.getLogger("sparse_eval")

QA_SOURCES = ("auto", "local", "hub")


@dataclass
class RulerConfig(TaskConfig):
    name: str = "ruler"
    num_samples: int | None = 50  # per subtask (MagicPIG: 50)
    seed: int = 42  # RULER's --random_seed
    length: int = 16384  # RULER's max_seq_length: prompt + tokens_to_generate (paper: 16K, 32K, 64K, 96K)
    subtasks: list[str] = field(default_factory=lambda: list(rd.SUBTASK_NAMES))
    chat_template: bool = True  # the tokenizer's chat template when it has one (MagicPIG: the model's chat format)
    haystack: str | None = None  # null: RULER's; noise|needle|essay replaces the essay haystack
    essay_path: str | None = None  # PaulGrahamEssays.json ({"text": ...}) or a .txt; default paths.data_dir/...
    squad_path: str | None = None  # SQuAD v2 dev JSON (official schema); default paths.data_dir/squad-v2-dev-half/
    hotpotqa_path: str | None = None  # HotpotQA distractor dev JSON; default paths.data_dir/hotpotqa-dev-sample/
    qa_source: str = "auto"  # auto: local file, else the hub (datasets); local; hub
    remove_newline_tab: bool = False
    # a cap on the tokens generated per sample; null: RULER's own per-subtask count (``tokens_to_generate``: 128 for
    # NIAH, 30 VT, 120 CWE, 50 FWE, 32 QA), which the papers use.  Prompts are built as for RULER's count either
    # way.  For smoke runs that test the plumbing, not the scores (a capped answer can score lower)
    max_new_tokens: int | None = None


@register_task
class Ruler(Task):
    name = "ruler"
    summary = "the 13 RULER tasks, generated locally at task.length with the model's tokenizer (MagicPIG Table 3)"
    num_samples_means = "the first N samples of each subtask"
    config_class = RulerConfig
    default_protocol = "A"
    metric = "score"
    identity_when_set = ("max_new_tokens",)

    def validate(self) -> None:
        super().validate()
        c = self.config
        if self.config.num_samples is None:
            raise ValueError("task.num_samples=null: RULER generates samples; give a number (MagicPIG: 50)")
        if c.length < 64:
            raise ValueError(f"task.length={c.length}: must be >= 64 tokens (RULER: 4096 ... 131072)")
        c.subtasks = rd.check_subtasks(c.subtasks)
        if c.haystack is not None:
            h = rd.HAYSTACK_ALIASES.get(c.haystack, c.haystack)
            if h not in rd.HAYSTACKS:
                raise ValueError(
                    f"task.haystack={c.haystack!r}; valid: null, {list(rd.HAYSTACKS)} (or {list(rd.HAYSTACK_ALIASES)})"
                )
            c.haystack = None if h == "essay" else h
        if c.qa_source not in QA_SOURCES:
            raise ValueError(f"task.qa_source={c.qa_source!r}; valid: {list(QA_SOURCES)}")
        if c.max_new_tokens is not None and (isinstance(c.max_new_tokens, bool) or c.max_new_tokens < 1):
            raise ValueError(
                f"task.max_new_tokens={c.max_new_tokens}: give a count >= 1, or null for RULER's own "
                "per-subtask count (the papers' setting)"
            )
        rd.check_essay(c.subtasks, c.haystack, c.essay_path, self.data_dir)
        rd.check_qa(c.subtasks, c.squad_path, c.hotpotqa_path, self.data_dir, c.qa_source)

    def resources(self) -> rd.Resources:
        c = self.config
        return rd.Resources(
            seed=c.seed,
            haystack=c.haystack,
            essay_path=c.essay_path,
            data_dir=self.data_dir,
            squad_path=c.squad_path,
            hotpotqa_path=c.hotpotqa_path,
            qa_source=c.qa_source,
        )

    def generate(self, tokenizer: Any, keep_text: bool = False) -> list[rd.Generated]:
        c = self.config
        prompter = rd.Prompter(tokenizer, c.chat_template, c.remove_newline_tab)
        if c.chat_template and not prompter.chat:
            log.warning("ruler: the tokenizer has no chat template; using RULER's plain (base) prompt")
        res = self.resources()
        out = []
        log.info(
            "ruler: generating %d sample%s of %d subtask%s at %d tokens with the model's tokenizer",
            c.num_samples,
            "" if c.num_samples == 1 else "s",
            len(c.subtasks),
            "" if len(c.subtasks) == 1 else "s",
            c.length,
        )
        for sub in c.subtasks:
            t0 = time.perf_counter()
            out += rd.generate(sub, c.num_samples, c.length, prompter, res, keep_text=keep_text)
            log.info(
                "ruler: %s: %d sample%s at %d tokens in %.1f s",
                sub,
                c.num_samples,
                "" if c.num_samples == 1 else "s",
                c.length,
                time.perf_counter() - t0,
            )
        self.chat_applied = prompter.chat
        for name, path in res.files.items():
            self.record_file(name, path)
        return out

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:
        c = self.config
        if c.length > max_context:
            raise ValueError(
                f"task.length={c.length} exceeds the model's context ({max_context} tokens); "
                f"use task.length <= {max_context}"
            )
        return [
            Sample(
                id=f"{g.subtask}-{g.index:04d}",
                data={
                    "subtask": g.subtask,
                    "input_ids": g.input_ids,
                    "context_len": g.context_len,
                    "answers": g.answers,
                    "units": g.units,
                    "chat_template": self.chat_applied,
                },
            )
            for g in self.generate(tokenizer)
        ]

    def request(self, sample: Sample) -> GenerationRequest:
        d = sample.data
        n = rd.tokens_to_generate(d["subtask"])
        if self.config.max_new_tokens is not None:
            n = min(n, self.config.max_new_tokens)
        return GenerationRequest(d["input_ids"], max_new_tokens=n, context_len=d["context_len"], key=sample.id)

    def score(self, sample: Sample, res: GenerationResult) -> dict[str, Any]:
        d = sample.data
        sub = d["subtask"]
        ids = d["input_ids"]
        pred = postprocess_pred(res.text)
        return {
            "subtask": sub,
            "length": self.config.length,
            "prompt_tokens": int(len(ids)),
            "context_tokens": int(d["context_len"]),
            "haystack_units": d["units"],
            "chat_template": d["chat_template"],
            "prediction": pred,
            "reference": list(d["answers"]),
            "generated_tokens": len(res.tokens),
            "stopped_by": res.stopped_by,
            "score": metric_fn(rd.metric_name(sub))(pred, d["answers"]),
        }

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        by: dict[str, list[float]] = {}
        nulls: dict[str, int] = {}
        for r in records:
            if r.get("score") is None:
                continue
            by.setdefault(r["subtask"], []).append(r["score"])
            nulls[r["subtask"]] = nulls.get(r["subtask"], 0) + (r.get("prediction", "") == "")
        order = [s for s in self.config.subtasks if s in by] + sorted(set(by) - set(self.config.subtasks))
        per = {s: sum(by[s]) / len(by[s]) for s in order}
        return {
            "score": sum(per.values()) / len(per) if per else None,
            "length": self.config.length,
            "subtask_scores": per,
            "subtask_samples": {s: len(by[s]) for s in order},
            "nulls": {s: nulls[s] for s in order},
            "subtasks_missing": [s for s in self.config.subtasks if s not in by],
        }

    def score_terms(self, records: list[dict[str, Any]]):
        """The mean of the subtasks' means: one bootstrap group per subtask (each keeps its sample count)."""
        from ..metrics.statistics import ScoreTerms

        return ScoreTerms.mean_of_subtask_means(records, self.config.subtasks)
