"""Key-value retrieval in the format of Liu et al., "Lost in the Middle" (TACL 2024), the synthetic retrieval family
the Double Sparsity paper reports (DS §6.1.3, Fig. 4: accuracy against sparsity level and context length).

A sample is a JSON object of ``n`` random UUID -> UUID pairs and one key whose value the model must write:

    prompt  = template.format(formatted_kv_records=<JSON>, key=<key>)
    <JSON>  = '{"k1": "v1",\\n "k2": "v2",\\n ... "kn": "vn"}'   (one pair a line, as the paper formats it)
    correct = value.lower() in prediction.lower()              (the paper's evaluate_kv_responses rule)
    score   = 100 * correct; accuracy = mean score (0-100, like the other tasks)

The gold pair's position in the JSON is the experimental variable (the "lost in the middle" curve):
``gold_position`` is a 0-based index (negative counts from the end), a list of indices (every example is run
at each one; the paper used 0/24/49/74 for 75 keys and 0/34/69/104/139 for 140), ``"uniform"`` (a seeded
uniform index per example), ``"all"`` (every index 0..n-1) or, for the published files, ``"original"`` (the
file's own order).  As in the paper, moving the gold pair pops it and re-inserts it at the index; the other
pairs keep their order.

Sources: ``generated`` (fresh UUIDs from ``seed``: ``num_keys`` pairs, or, with ``length``, as many pairs as
fit in ``length`` prompt tokens with this tokenizer, template and chat template) or ``published``
(``paths.data_dir/lost-in-the-middle/kv_retrieval_data/kv-retrieval-<num_keys>_keys.jsonl.gz``, 500 rows each
for 75 and 140 keys, or ``data_path``).  Generation: greedy, ``max_new_tokens`` = 100 (the paper's scripts).
Chat models get their chat template (the paper wrapped chat models in their conversation format).
Under protocol B the context is everything before the question line (``Key: "..."``).
"""

from __future__ import annotations

import gzip
import json
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..generation.requests import GenerationRequest, GenerationResult
from .base import Sample, Task, TaskConfig, register_task
from .prompting import CHAT_MODES, context_split, encode, render_chat, use_chat

# The paper's key-value retrieval prompt (Liu et al. 2024, Fig. "Example of the key-value retrieval task").
TEMPLATE = (
    "Extract the value corresponding to the specified key in the JSON object below.\n\n"
    "JSON data:\n{formatted_kv_records}\n\n"
    'Key: "{key}"\n'
    "Corresponding value:"
)
PUBLISHED_DIR = "lost-in-the-middle/kv_retrieval_data"
PUBLISHED_NAME = "kv-retrieval-{n}_keys.jsonl.gz"
SOURCES = ("generated", "published")
POSITION_WORDS = ("uniform", "all", "original")
GENERATED_DEFAULT_EXAMPLES = 500  # num_samples: null with source=generated (the size of the published files)


@dataclass
class KVRetrievalConfig(TaskConfig):
    name: str = "kv_retrieval"
    source: str = "generated"  # generated | published
    num_keys: int | None = 75  # pairs per prompt (published: which file, 75 | 140)
    length: int | None = None  # generated only: target prompt tokens, filled with as many pairs as fit (num_keys: null)
    gold_position: Any = "uniform"  # int | list of ints | uniform | all | original (published)
    # num_samples (TaskConfig): examples (each run at every listed gold position); null: all rows / 500 generated
    data_path: str | None = None  # published: the jsonl(.gz) file (default: under paths.data_dir)
    template: str = TEMPLATE
    max_new_tokens: int = 100
    chat_template: str = "auto"  # auto | none | always (see tasks/prompting.py)


def format_kv_records(records: list[tuple[str, str]]) -> str:
    """'{"k1": "v1",\\n "k2": "v2"}': one pair per line, a space before each pair after the first."""
    return "{" + ",\n ".join(f'"{k}": "{v}"' for k, v in records) + "}"


def is_correct(prediction: str, value: str) -> bool:
    """The paper's accuracy rule: the gold value occurs in the model's answer (case-insensitive)."""
    return value.lower() in prediction.lower()


def make_uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def generate_records(rng: random.Random, n: int, taken: set[str] | None = None) -> list[tuple[str, str]]:
    """n (key, value) pairs of fresh random UUIDs, all distinct."""
    taken = set() if taken is None else taken
    out = []
    while len(out) < n:
        k, v = make_uuid(rng), make_uuid(rng)
        if k in taken or v in taken or k == v:
            continue
        taken.update((k, v))
        out.append((k, v))
    return out


def move_gold(records: list[tuple[str, str]], gold_index: int, position: int) -> list[tuple[str, str]]:
    """The paper's placement: pop the gold pair and insert it at ``position`` (0-based, in the final list)."""
    out = list(records)
    pair = out.pop(gold_index)
    out.insert(position, pair)
    return out


@register_task
class KVRetrieval(Task):
    name = "kv_retrieval"
    summary = "lost-in-the-middle key-value retrieval, exact match (DS Fig. 4)"
    num_samples_means = "the first N examples (each at every listed gold position)"
    config_class = KVRetrievalConfig
    default_protocol = "A"
    metric = "accuracy"

    def validate(self) -> None:
        super().validate()
        c = self.config
        if c.source not in SOURCES:
            raise ValueError(f"task.source={c.source!r}; valid: {list(SOURCES)}")
        if c.chat_template not in CHAT_MODES:
            raise ValueError(f"task.chat_template={c.chat_template!r}; valid: {list(CHAT_MODES)}")
        if c.max_new_tokens < 1:
            raise ValueError(f"task.max_new_tokens={c.max_new_tokens}: must be >= 1")
        for field_name in ("{formatted_kv_records}", "{key}"):
            if field_name not in c.template:
                raise ValueError(f"task.template must contain {field_name}")
        if c.source == "published":
            if c.length is not None:
                raise ValueError(
                    "task.length applies to source=generated only (the published files have fixed key counts)"
                )
            if c.num_keys is None and not c.data_path:
                raise ValueError("task.source=published needs task.num_keys (75 or 140) or task.data_path")
        else:
            if c.length is not None and c.num_keys is not None:
                raise ValueError(
                    f"task.length={c.length} and task.num_keys={c.num_keys}: give one (set the other to null)"
                )
            if c.length is None and c.num_keys is None:
                raise ValueError("task.source=generated needs task.num_keys or task.length")
            if c.num_keys is not None and c.num_keys < 2:
                raise ValueError(
                    f"task.num_keys={c.num_keys}: must be >= 2 (the paper's prompt needs at least 2 pairs)"
                )
            if c.length is not None and c.length < 1:
                raise ValueError(f"task.length={c.length}: must be >= 1")
            if c.gold_position == "original":
                raise ValueError(
                    "task.gold_position=original applies to source=published only; "
                    f"valid here: an index, a list of indices, {list(POSITION_WORDS[:2])}"
                )
        gp = c.gold_position
        if isinstance(gp, str):
            if gp not in POSITION_WORDS:
                raise ValueError(
                    f"task.gold_position={gp!r}; valid: an int index, a list of ints, {list(POSITION_WORDS)}"
                )
        elif isinstance(gp, bool) or not (
            isinstance(gp, int)
            or (
                isinstance(gp, (list, tuple)) and gp and all(isinstance(x, int) and not isinstance(x, bool) for x in gp)
            )
        ):
            raise ValueError(
                f"task.gold_position={gp!r}; valid: an int index, a non-empty list of ints, {list(POSITION_WORDS)}"
            )

    # ---- data -------------------------------------------------------------------------------------------
    def published_path(self) -> Path:
        c = self.config
        if c.data_path:
            p = Path(c.data_path).expanduser()
            if not p.is_file():
                raise FileNotFoundError(f"task.data_path: {p} does not exist")
            return p
        if self.data_dir is None:
            raise FileNotFoundError(
                "task.source=published needs paths.data_dir (a folder holding "
                f"{PUBLISHED_DIR}/) or task.data_path; get the files from nelson-liu/lost-in-the-middle"
            )
        p = self.data_dir / PUBLISHED_DIR / PUBLISHED_NAME.format(n=c.num_keys)
        if not p.is_file():
            have = (
                sorted(x.name for x in (self.data_dir / PUBLISHED_DIR).glob("*.jsonl.gz"))
                if (self.data_dir / PUBLISHED_DIR).is_dir()
                else []
            )
            raise FileNotFoundError(f"task.num_keys={c.num_keys}: no {p}; available: {have or 'none'}")
        return p

    def published_examples(self) -> list[dict[str, Any]]:
        path = self.published_path()
        self.record_file("kv_records", path)
        n = self.config.num_samples
        out = []
        with gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8") as fh:
            for line in fh:
                if not line.strip():
                    continue
                row = json.loads(line)
                records = [tuple(r) for r in row["ordered_kv_records"]]
                gold = records.index((row["key"], row["value"]))
                out.append({"records": records, "gold_index": gold, "origin": str(path)})
                if n is not None and len(out) >= n:
                    break
        return out

    def positions(self, i: int, n: int, gold_index: int) -> list[int]:
        gp = self.config.gold_position
        if gp == "original":
            return [gold_index]
        if gp == "uniform":
            return [random.Random(f"kv-position-{self.config.seed}-{i}").randrange(n)]
        if gp == "all":
            return list(range(n))
        out = []
        for p in [gp] if isinstance(gp, int) else list(gp):
            if not -n <= p < n:
                raise ValueError(f"task.gold_position={p} is outside the {n} pairs of the prompt; valid: {-n}..{n - 1}")
            out.append(p % n)
        return out

    def render(
        self, records: list[tuple[str, str]], key: str, tokenizer: Any, templated: bool
    ) -> tuple[str, list[int]]:
        prompt = self.config.template.format(formatted_kv_records=format_kv_records(records), key=key)
        text = render_chat(tokenizer, prompt) if templated else prompt
        return text, encode(tokenizer, text, templated)

    def fit_records(self, i: int, tokenizer: Any, templated: bool) -> list[tuple[str, str]]:
        """``length`` mode: the most pairs whose prompt has at most ``length`` tokens (>= 2 pairs)."""
        rng = random.Random(f"kv-records-{self.config.seed}-{i}")
        pool = generate_records(rng, 2)
        taken = {x for kv in pool for x in kv}

        def tokens(n: int) -> int:
            while len(pool) < n:
                pool.extend(generate_records(rng, n - len(pool), taken))
            return len(self.render(pool[:n], pool[0][0], tokenizer, templated)[1])

        target = self.config.length
        if tokens(2) > target:
            raise ValueError(f"task.length={target}: even 2 pairs need {tokens(2)} prompt tokens")
        lo, hi = 2, 4
        while tokens(hi) <= target:  # grow until it no longer fits
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # largest n with tokens(n) <= target
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if tokens(mid) <= target else (lo, mid)
        return pool[:lo]

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:
        c = self.config
        templated = use_chat(tokenizer, c.chat_template)
        if c.length is not None and c.length + c.max_new_tokens > max_context:
            raise ValueError(
                f"task.length={c.length} + max_new_tokens={c.max_new_tokens} exceeds the model's "
                f"context ({max_context} tokens)"
            )
        if c.source == "published":
            examples = self.published_examples()
        else:
            count = c.num_samples if c.num_samples is not None else GENERATED_DEFAULT_EXAMPLES
            examples = []
            for i in range(count):
                if c.length is not None:
                    records = self.fit_records(i, tokenizer, templated)
                else:
                    records = generate_records(random.Random(f"kv-records-{c.seed}-{i}"), c.num_keys)
                examples.append({"records": records, "gold_index": 0, "origin": "generated"})
        q_start = c.template.rfind("\n", 0, c.template.index("{key}")) + 1  # the question line of the template
        out = []
        for i, ex in enumerate(examples):
            records, gold_index = ex["records"], ex["gold_index"]
            key, value = records[gold_index]
            n = len(records)
            for pos in self.positions(i, n, gold_index):
                ordered = move_gold(records, gold_index, pos)
                text, ids = self.render(ordered, key, tokenizer, templated)
                if len(ids) + c.max_new_tokens > max_context:
                    raise ValueError(
                        f"kv_retrieval example {i}: {n} pairs make a {len(ids)}-token prompt, which with "
                        f"max_new_tokens={c.max_new_tokens} exceeds the model's context ({max_context}); use fewer "
                        "task.num_keys or task.length"
                    )
                question = c.template[q_start:].format(formatted_kv_records="", key=key)
                split = text.rfind(question)
                context_len = context_split(tokenizer, text, split, templated, ids) if split > 0 else len(ids) - 1
                out.append(
                    Sample(
                        id=f"n{n}-e{i:04d}-g{pos:04d}",
                        data={
                            "input_ids": ids,
                            "context_len": context_len,
                            "value": value,
                            "key": key,
                            "num_keys": n,
                            "gold_position": pos,
                            "source": ex["origin"],
                            "chat_template": templated,
                        },
                    )
                )
        return out

    # ---- scoring ----------------------------------------------------------------------------------------
    def request(self, sample: Sample) -> GenerationRequest:
        d = sample.data
        return GenerationRequest(
            d["input_ids"], max_new_tokens=self.config.max_new_tokens, context_len=d["context_len"], key=sample.id
        )

    def score(self, sample: Sample, gen: GenerationResult) -> dict[str, Any]:
        d = sample.data
        correct = is_correct(gen.text, d["value"])
        return {
            "score": 100.0 if correct else 0.0,
            "correct": correct,
            "prediction": gen.text,
            "value": d["value"],
            "num_keys": d["num_keys"],
            "gold_position": d["gold_position"],
            "prompt_tokens": len(d["input_ids"]),
            "context_len": d["context_len"],
            "generated_tokens": len(gen.tokens),
            "stopped_by": gen.stopped_by,
            "chat_template": d["chat_template"],
        }

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        scored = [r for r in records if r.get("score") is not None]
        if not scored:
            return {"accuracy": None}
        by_pos: dict[int, list[float]] = {}
        for r in scored:
            by_pos.setdefault(int(r["gold_position"]), []).append(r["score"])
        keys = [r["num_keys"] for r in scored]
        return {
            "accuracy": sum(r["score"] for r in scored) / len(scored),
            "accuracy_by_position": {str(p): sum(v) / len(v) for p, v in sorted(by_pos.items())},
            "num_keys_mean": sum(keys) / len(keys),
            "prompt_tokens_mean": sum(r["prompt_tokens"] for r in scored) / len(scored),
        }
