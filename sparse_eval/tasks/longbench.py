"""LongBench (Bai et al., ACL 2024), the six datasets of MagicPIG Table 2: qasper, repobench-p, lcc,
passage_retrieval_en, trec, triviaqa -- with LongBench's own protocol (THUDM/LongBench ``pred.py``/``eval.py``):

1. prompt = ``dataset2prompt[d].format(context=..., input=...)`` (``PROMPTS`` below);
2. tokenize it with the tokenizer's special tokens; if longer than ``max_length`` tokens, keep the first and the
   last ``int(max_length/2)`` tokens, decoding each half with ``skip_special_tokens=True`` and joining the text
   ("truncate in the middle, since the left and right side may contain crucial instructions");
3. chat models get their chat template, except on trec, triviaqa, samsum, lsht, lcc, repobench-p
   (``no_chat_subtasks``: "chat models are better off without build prompts on these tasks");
4. greedy decoding of at most ``dataset2maxlen[d]`` new tokens (``MAX_NEW_TOKENS``), stopping at EOS;
5. score (``sparse_eval.metrics.longbench``): for trec/triviaqa/samsum/lsht only the first line of the
   prediction is scored; the max over the ground truths; dataset score = 100 * mean over its samples.

The headline number is the unweighted mean over the subtasks (MagicPIG Table 2 "Avg").

``max_length``: LongBench sets it per model (``model2maxlen``: 3500 for 4K models, 7500 for 8K, 15500 for 16K,
31500 for 32K; Double Sparsity's fork used 120000 for Llama-3.1-8B-Instruct).  The default here (null) is the
model's context minus the subtask's generation length; set ``task.max_length`` to match a published setting.
If the final (templated) prompt plus the generation still exceeds the model's context, its token ids are
middle-truncated once more to fit and the sample records ``fit_truncated``.

Protocol B (context dense, question sparse) needs a context/question split; we take the split of Quest's and
Double Sparsity's LongBench runs: the question is the text from the last marker (``QUESTION_MARKERS``) or at
most the last 100 characters of the final prompt, whichever is shorter.

Data sources (``source``):
  ``local``: ``data_path`` (a folder of ``<name>.jsonl``, or LongBench's ``data.zip``), else
             ``paths.data_dir/longbench/<name>.jsonl``; for triviaqa also ``paths.data_dir/longbench-triviaqa/
             triviaqa.json`` -- 200 LongBench TriviaQA items whose few-shot ``context`` was dropped: the
             prompt then has an empty example block, so scores are NOT comparable to published ones (each sample
             records ``context_missing``).
  ``hub``: the official files: ``data.zip`` of the hub dataset ``hub_id`` (THUDM/LongBench) through
           ``huggingface_hub``; its loading script no longer runs under ``datasets>=4``
           (``load_dataset("THUDM/LongBench", name, split="test")`` is the route for ``datasets<4``).  A
           parquet mirror (e.g. ``hub_id=Xnhyacinth/LongBench``) is read with ``datasets.load_dataset``.
  ``auto``: local when found, else hub.
"""

from __future__ import annotations

import gzip
import io
import json
import logging
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..metrics.longbench import DATASET_METRIC, score_sample
from ..generation.requests import GenerationRequest, GenerationResult
from .base import Sample, Task, TaskConfig, register_task
from .prompting import CHAT_MODES, context_split, encode, middle_truncate, render_chat, use_chat

log = logging.getLogger("sparse_eval")

# LongBench config/dataset2prompt.json (the six subtasks)
PROMPTS = {
    "qasper": (
        "You are given a scientific article and a question. Answer the question as concisely as you can, using a "
        "single phrase or sentence if possible. If the question cannot be answered based on the information in the "
        'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
        '"unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on '
        "the above article as concisely as you can, using a single phrase or sentence if possible. If the question "
        'cannot be answered based on the information in the article, write "unanswerable". If the question is a '
        'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
        "Question: {input}\n\nAnswer:"
    ),
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        'the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
        "etc.\n\nThe answer is: "
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
}
# LongBench config/dataset2maxlen.json
MAX_NEW_TOKENS = {"qasper": 128, "repobench-p": 64, "lcc": 64, "passage_retrieval_en": 32, "trec": 64, "triviaqa": 32}
SUBTASKS = tuple(PROMPTS)  # MagicPIG Table 2 order: QaS, RbP, LCC, PrE, TrC, TrQ
# pred.py: "chat models are better off without build prompts on these tasks"
NO_CHAT = ["trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"]
# Quest / Double Sparsity LongBench pred.py: where the "question" (decoded sparsely under protocol B) starts
QUESTION_MARKERS = {"qasper": "Question:", "triviaqa": "Answer the question"}
QUESTION_MAX_CHARS = 100
SOURCES = ("auto", "local", "hub")
HUB_ID = "THUDM/LongBench"
SHARED_TRIVIAQA = "longbench-triviaqa/triviaqa.json"


@dataclass
class LongBenchConfig(TaskConfig):
    name: str = "longbench"
    subtasks: list[str] = field(default_factory=lambda: list(SUBTASKS))
    # num_samples (TaskConfig): the first N samples of EACH subtask; null: all (200 per dataset in LongBench)
    source: str = "auto"  # auto | local | hub
    data_path: str | None = None  # folder with <name>.jsonl (official format) or LongBench's data.zip
    hub_id: str = HUB_ID
    max_length: int | None = None  # prompt tokens kept by middle truncation; null: model context - max_new_tokens
    max_new_tokens: int | None = None  # null: LongBench's dataset2maxlen per subtask
    chat_template: str = "auto"  # auto | none | always (see tasks/prompting.py)
    no_chat_subtasks: list[str] = field(default_factory=lambda: list(NO_CHAT))


def _read_jsonl(fh: Any) -> list[dict[str, Any]]:
    return [json.loads(line) for line in fh if line.strip()]


def _from_zip(path: Path, name: str) -> list[dict[str, Any]] | None:
    with zipfile.ZipFile(path) as zf:
        for member in (f"data/{name}.jsonl", f"{name}.jsonl"):
            if member in zf.namelist():
                with zf.open(member) as fh:
                    return _read_jsonl(io.TextIOWrapper(fh, encoding="utf-8"))
    return None


def _read_local_file(path: Path, name: str) -> list[dict[str, Any]] | None:
    if path.suffix == ".zip":
        return _from_zip(path, name)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as fh:
        return _read_jsonl(fh)


def _shared_triviaqa(path: Path) -> list[dict[str, Any]]:
    """The offline TriviaQA copy: LongBench items with ``input`` and ``answers`` only (few-shot context dropped)."""
    rows = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, r in enumerate(rows):
        out.append(
            {
                "input": r["input"],
                "context": "",
                "answers": list(r["answers"]),
                "length": None,
                "dataset": "triviaqa",
                "language": "en",
                "all_classes": None,
                "_id": f"shared-{i:04d}",
                "context_missing": True,
            }
        )
    return out


def load_local(name: str, data_path: str | None, data_dir: Path | None) -> tuple[list[dict[str, Any]], str] | None:
    """Rows of one LongBench dataset from local files, or None when there are none."""
    candidates: list[Path] = []
    if data_path:
        p = Path(data_path).expanduser()
        if not p.exists():
            raise FileNotFoundError(f"task.data_path: {p} does not exist")
        if p.is_dir():
            candidates += [p / f"{name}.jsonl", p / f"{name}.jsonl.gz", p / "data" / f"{name}.jsonl", p / "data.zip"]
        else:
            candidates.append(p)
    if data_dir is not None:
        candidates += [data_dir / "longbench" / f"{name}.jsonl", data_dir / "longbench" / "data.zip"]
    for c in candidates:
        if c.is_file():
            rows = _read_local_file(c, name)
            if rows is not None:
                return rows, str(c)
    if name == "triviaqa" and data_dir is not None and (data_dir / SHARED_TRIVIAQA).is_file():
        path = data_dir / SHARED_TRIVIAQA
        log.warning(
            "longbench/triviaqa: reading %s, whose few-shot context was dropped: scores are not "
            "comparable to published LongBench TriviaQA numbers",
            path,
        )
        return _shared_triviaqa(path), str(path)
    return None


def load_hub(name: str, hub_id: str) -> tuple[list[dict[str, Any]], str]:
    """The official jsonl files from the hub repo's data.zip; a parquet mirror through ``datasets``."""
    from huggingface_hub import errors, hf_hub_download

    from .base import from_hub

    # only "the repo has no data.zip" falls through to datasets (not "offline and not cached")
    no_such_file = getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)
    expected, fix = f"<paths.data_dir>/longbench/{name}.jsonl", "or task.data_path=<a folder of <name>.jsonl files>"
    with from_hub(f"longbench/{name}", hub_id, expected, fix):
        try:
            zpath = hf_hub_download(repo_id=hub_id, filename="data.zip", repo_type="dataset")
        except no_such_file:
            zpath = None
    if zpath is not None:
        rows = _from_zip(Path(zpath), name)
        if rows is None:
            raise ValueError(f"{hub_id}/data.zip has no data/{name}.jsonl")
        return rows, f"hub:{hub_id}/data.zip:{name}"
    with from_hub(f"longbench/{name}", hub_id, expected, fix):
        import datasets

        ds = datasets.load_dataset(hub_id, name, split="test")
    return [dict(r) for r in ds], f"hub:{hub_id}:{name}"


@register_task
class LongBench(Task):
    name = "longbench"
    summary = "LongBench datasets with their prompts, truncation, chat rule and metrics (MagicPIG Table 2)"
    num_samples_means = "the first N samples of each dataset"
    config_class = LongBenchConfig
    default_protocol = "A"  # MagicPIG Table 2: prompt prefilled densely, sparse decoding
    metric = "score"

    def validate(self) -> None:
        super().validate()
        c = self.config
        if not c.subtasks:
            raise ValueError(f"task.subtasks is empty; valid: {list(SUBTASKS)}")
        bad = [s for s in c.subtasks if s not in PROMPTS]
        if bad:
            raise ValueError(f"unknown LongBench subtask(s) {bad}; valid: {list(SUBTASKS)}")
        if len(set(c.subtasks)) != len(c.subtasks):
            raise ValueError(f"task.subtasks={list(c.subtasks)} lists a subtask twice")
        if c.source not in SOURCES:
            raise ValueError(f"task.source={c.source!r}; valid: {list(SOURCES)}")
        if c.chat_template not in CHAT_MODES:
            raise ValueError(f"task.chat_template={c.chat_template!r}; valid: {list(CHAT_MODES)}")
        if c.max_length is not None and c.max_length < 2:
            raise ValueError(f"task.max_length={c.max_length}: must be >= 2 or null")
        if c.max_new_tokens is not None and c.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens={c.max_new_tokens}: must be >= 1 or null")

    def load_rows(self, name: str) -> tuple[list[dict[str, Any]], str]:
        c = self.config
        if c.source in ("auto", "local"):
            found = load_local(name, c.data_path, self.data_dir)
            if found is not None:
                self.record_file(name, found[1])
                return found
            if c.source == "local":
                where = [x for x in (c.data_path, self.data_dir and str(self.data_dir / "longbench")) if x]
                raise FileNotFoundError(
                    f"task.source=local: no {name}.jsonl (or data.zip) in "
                    f"{where or 'nothing (data_path and paths.data_dir unset)'}; "
                    f"get LongBench's data.zip from https://huggingface.co/datasets/{c.hub_id} or use task.source=hub"
                )
        log.info("longbench/%s: no local file; loading from the hub (%s)", name, c.hub_id)
        return load_hub(name, c.hub_id)

    def build_prompt(self, name: str, row: dict[str, Any], tokenizer: Any, max_context: int) -> dict[str, Any]:
        c = self.config
        max_new = c.max_new_tokens or MAX_NEW_TOKENS[name]
        if max_new >= max_context:
            raise ValueError(
                f"max_new_tokens={max_new} leaves no room for a prompt in the model's {max_context}-token context"
            )
        max_length = c.max_length if c.max_length is not None else max_context - max_new
        prompt = PROMPTS[name].format(context=row.get("context") or "", input=row.get("input") or "")
        ids = encode(tokenizer, prompt, templated=False)
        raw_tokens = len(ids)
        cut = middle_truncate(ids, max_length)
        if cut is not None:
            head, tail = cut
            prompt = tokenizer.decode(head, skip_special_tokens=True) + tokenizer.decode(tail, skip_special_tokens=True)
        templated = name not in c.no_chat_subtasks and use_chat(tokenizer, c.chat_template)
        text = render_chat(tokenizer, prompt) if templated else prompt
        ids = encode(tokenizer, text, templated)
        # protocol B split (Quest/DS rule): from the last marker, or the last QUESTION_MAX_CHARS characters
        q_pos = len(text) - QUESTION_MAX_CHARS
        marker = QUESTION_MARKERS.get(name)
        if marker and marker in text:
            q_pos = max(q_pos, text.rfind(marker))
        context_len = context_split(tokenizer, text, max(q_pos, 0), templated, ids)
        fit_cut = middle_truncate(ids, max_context - max_new)
        if fit_cut is not None:  # the question sits in the kept tail
            question_tokens = len(ids) - context_len
            ids = fit_cut[0] + fit_cut[1]
            context_len = max(1, len(ids) - question_tokens)
        return {
            "input_ids": ids,
            "context_len": context_len,
            "max_new_tokens": max_new,
            "answers": list(row["answers"]),
            "all_classes": row.get("all_classes"),
            "length": row.get("length"),
            "raw_tokens": raw_tokens,
            "truncated": cut is not None,
            "fit_truncated": fit_cut is not None,
            "chat_template": templated,
            "context_missing": bool(row.get("context_missing", False)),
        }

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:
        out: list[Sample] = []
        n = self.config.num_samples
        for name in self.config.subtasks:
            rows, origin = self.load_rows(name)
            if not rows:
                raise ValueError(f"LongBench {name}: no rows in {origin}")
            rows = rows if n is None else rows[:n]
            for i, row in enumerate(rows):
                data = self.build_prompt(name, row, tokenizer, max_context)
                data.update(subtask=name, source=origin)
                out.append(Sample(id=f"{name}/{i:04d}-{row.get('_id') or ''}".rstrip("-"), data=data))
        return out

    def request(self, sample: Sample) -> GenerationRequest:
        d = sample.data
        return GenerationRequest(
            d["input_ids"], max_new_tokens=d["max_new_tokens"], context_len=d["context_len"], key=sample.id
        )

    def score(self, sample: Sample, gen: GenerationResult) -> dict[str, Any]:
        d = sample.data
        score = 100.0 * score_sample(d["subtask"], gen.text, d["answers"], d["all_classes"])
        return {
            "subtask": d["subtask"],
            "score": score,
            "prediction": gen.text,
            "answers": d["answers"][:20],
            "generated_tokens": len(gen.tokens),
            "stopped_by": gen.stopped_by,
            "prompt_tokens": len(d["input_ids"]),
            "context_len": d["context_len"],
            "raw_tokens": d["raw_tokens"],
            "truncated": d["truncated"],
            "fit_truncated": d["fit_truncated"],
            "chat_template": d["chat_template"],
            "context_missing": d["context_missing"],
            "source": d["source"],
        }

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        per: dict[str, list[float]] = {}
        for r in records:
            if r.get("score") is not None:
                per.setdefault(r["subtask"], []).append(r["score"])
        subtask_scores = {s: sum(v) / len(v) for s, v in per.items()}
        order = [s for s in self.config.subtasks if s in subtask_scores]
        out: dict[str, Any] = {
            "score": sum(subtask_scores[s] for s in order) / len(order) if order else None,
            "subtask_scores": {s: subtask_scores[s] for s in order},
            "subtask_samples": {s: len(per[s]) for s in order},
            "metric_per_subtask": {s: DATASET_METRIC[s] for s in order},
        }
        missing = sorted({r["subtask"] for r in records if r.get("context_missing")})
        if missing:
            out["context_missing"] = missing
        return out

    def score_terms(self, records: list[dict[str, Any]]):
        """The mean of the subtasks' means: one bootstrap group per subtask (each keeps its sample count)."""
        from ..metrics.statistics import ScoreTerms

        return ScoreTerms.mean_of_subtask_means(records, self.config.subtasks)
