"""lm-evaluation-harness tasks on the patched model: the scores are lm-eval's own.

The runner attaches the method (``attention.plugin.attach``) and hands ``Task.run`` an ``Engine``; this task
wraps ``engine.model``/``engine.tokenizer`` in lm-eval's ``HFLM`` and calls ``lm_eval.simple_evaluate`` with a
``TaskManager``.  One ``Sample`` is one lm-eval task (or group) named in ``task.tasks``: ``run`` evaluates the
whole lm-eval task (``limit`` documents per lm-eval task) and returns its metrics plus one record per document
(``docs``: target, raw and filtered prediction, metric values), while the session recorder (reset by the runner
before every Sample) collects the method's Cost1/Cost2/estimation error over every attention call of that run.

Which calls are sparse (MagicPIG Table 1 setting, protocol A): ``generate_until`` tasks go through
``HFLM.generate_until -> model.generate`` with the model's own ``DynamicCache`` -- the prompt is prefilled
densely and every generated token attends sparsely (the plug-in attaches the method state to any cache layer).
Log-likelihood tasks only run teacher-forced prefill forwards, so under protocol A a decode-only method leaves
them unchanged (protocol S makes every position sparse).  Protocol B needs a context/question split that lm-eval
prompts do not have and is refused.

MagicPIG Table 1 tasks: ``gsm8k_cot`` (GSM8K-CoT, 8-shot), ``mmlu_flan_cot_fewshot`` (MMLU flan CoT, 4-shot),
``coqa`` (0-shot); "Avg." is the plain mean of the three task scores (our ``score``).  The paper kept the first 4
and the last 24 tokens (not 64) static for these tasks: ``method.local=24`` (``conf/experiment/lmeval_magicpig``).

Offline variants (``task.offline``): ``gsm8k_cot_local`` and ``mmlu_flan_cot_fewshot_local`` (+ one
``mmlu_flan_cot_fewshot_<subject>_local`` per subject) include lm-eval's own task YAMLs of the installed
version (prompts, few-shot exemplars, regex filters, metrics) and only swap the data for files under
``paths.data_dir``; the YAMLs are written at run time from the templates in ``lm_eval_configs/`` into a work
directory (data paths must be absolute).  CoQA exists only on the hub; under transformers >= 5 lm-eval's own
``coqa`` cannot be imported (its metric module is gone from transformers) and ``coqa_compat`` -- the same task
with the metric re-implemented here -- runs instead.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import difflib
import functools
import hashlib
import json
import logging
import math
import os
import re
import shutil
import socket
import string
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlparse

from .base import Sample, Task, TaskConfig, register_task

log = logging.getLogger("sparse_eval")

CONFIG_DIR = Path(__file__).resolve().parent / "lm_eval_configs"
PAPER_TASKS = ("gsm8k_cot", "mmlu_flan_cot_fewshot", "coqa")  # MagicPIG Table 1
UNSTOPPED_WARN = 0.5  # a run's share of generations without a stop sequence above which its summary warns
OFFLINE_CHOICES = ("auto", "true", "false")
# the headline metric of each task ("<metric>,<filter>" as lm-eval names result keys); the paper does not
# say which it read: strict-match is gsm8k_cot's first filter (assumed); CoQA's values look like f1 (assumed)
PRIMARY_METRICS = {
    "gsm8k_cot": "exact_match,strict-match",
    "mmlu_flan_cot_fewshot": "exact_match,get-answer",
    "coqa": "f1,none",
}
GSM8K_FILE = "gsm8k/test.jsonl"
MMLU_DIR = "mmlu/data"
WORK_FORMAT = 1  # bump when the generated files change shape


@dataclass
class LmEvalConfig(TaskConfig):
    name: str = "lm_eval"
    # lm-eval task or group names, one Sample each (MagicPIG Table 1 by default)
    tasks: list[str] = field(default_factory=lambda: list(PAPER_TASKS))
    num_fewshot: int | None = None  # null: each task's own (gsm8k_cot 8, mmlu_flan_cot_fewshot 4, coqa 0)
    # documents per lm-eval task (a group applies it to each subtask); < 1: a fraction; null: all.
    # ``num_samples`` is the same knob under the runner's common name (set one of them).
    limit: float | None = None
    # 1: no padding; > 1 left-pads generation batches (the plug-in sees the padding mask): in the batch-invariant
    # mode a document's generation and the run's statistics are the same at any size (each row counted until it
    # stops); log-likelihood batches are right-padded, so keep 1 for those tasks
    batch_size: int = 1
    max_length: int | None = None  # context window HFLM truncates to; null: the model's context
    gen_kwargs: Any = None  # overrides of every generate_until task's generation_kwargs: mapping or "k=v,k2=v2"
    include_path: Any = None  # extra folder(s) of lm-eval task YAMLs (a str or a list)
    include_defaults: bool | None = None  # index lm-eval's ~15k built-in tasks; null: only when a name needs it
    offline: str = "auto"  # auto: local variants when paths.data_dir has the data and the hub is unreachable
    primary_metric: dict[str, str] = field(default_factory=lambda: dict(PRIMARY_METRICS))
    apply_chat_template: bool = False  # lm-eval's defaults (plain few-shot prompts)
    fewshot_as_multiturn: bool = True
    system_instruction: str | None = None
    bootstrap_iters: int = 100000  # lm-eval's default (stderr of non-mean metrics); 0 skips stderrs
    log_inputs: bool = False  # also store each document and its full prompt in the per-document records
    work_dir: str | None = None  # where the generated offline YAMLs/data go; null: <tmp>/sparse_eval_lm_eval/<hash>
    verbosity: str = "WARNING"  # level of the lm_eval logger during a run
    # 1: each requested task is one sample.  n > 1: each task's documents (after ``limit``) are cut into n
    # contiguous pieces, one sample each, so that an interrupted run resumes at the next piece; the task's score
    # is then the mean over every piece's documents (its headline must be a mean over documents, and its
    # few-shot examples must not depend on which documents run: lm-eval's first_n sampler; both checked)
    shards: int = 1


# --------------------------------------------------------------------------------------------------------
# CoQA (lm-eval coqa v3.0) prompt and metric, for transformers >= 5 (see lm_eval_configs/coqa_compat.yaml)
# --------------------------------------------------------------------------------------------------------
def coqa_doc_to_text(doc: dict[str, Any]) -> str:
    """story, then each earlier turn "Q: q\\n\\nA: a\\n\\n", then "Q: <last question>\\n\\nA:"."""
    questions = list(doc["questions"]["input_text"])
    answers = list(doc["answers"]["input_text"])[:-1]  # the last answer is the target
    parts = [doc["story"], "\n\n"]
    for i, q in enumerate(questions):
        parts.append(f"Q: {q}\n\n")
        parts.append(f"A: {answers[i]}\n\n" if i < len(answers) else "A:")
    for a in answers[len(questions) :]:  # more answers than questions (never in CoQA): lm-eval's zip_longest
        parts.append(f"Q: None\n\nA: {a}\n\n")
    return "".join(parts)


def coqa_doc_to_target(doc: dict[str, Any]) -> list[str]:
    """Gold answers of the last turn: the main one, then the additional annotators' (case-insensitive unique)."""
    turn = len(doc["questions"]["input_text"])
    golds = [doc["answers"]["input_text"][turn - 1]]
    for extra in (doc.get("additional_answers") or {}).values():
        alt = extra["input_text"][turn - 1]
        if alt.lower() not in (g.lower() for g in golds):
            golds.append(alt)
    return golds


_ARTICLES = re.compile(r"\b(a|an|the)\b", re.UNICODE)
_PUNCT = frozenset(string.punctuation)


def squad_normalize(text: str) -> str:
    """SQuAD answer normalization: lower case, drop punctuation, drop articles a/an/the, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCT)
    return " ".join(_ARTICLES.sub(" ", text).split())


def squad_exact(gold: str, pred: str) -> int:
    return int(squad_normalize(gold) == squad_normalize(pred))


def squad_f1(gold: str, pred: str) -> float:
    """Token-overlap F1 of the normalized answers (an empty side scores 1 only against another empty side)."""
    g, p = squad_normalize(gold).split(), squad_normalize(pred).split()
    if not g or not p:
        return float(g == p)
    same = sum((collections.Counter(g) & collections.Counter(p)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(g)
    return 2 * precision * recall / (precision + recall)


def coqa_scores(golds: list[str], pred: str) -> dict[str, float]:
    """em/f1 of CoQA: with n > 1 gold answers, the mean over i of the max over the other n - 1 answers."""
    if len(golds) > 1:
        rest = [golds[:i] + golds[i + 1 :] for i in range(len(golds))]
        em = sum(max(squad_exact(a, pred) for a in r) for r in rest)
        f1 = sum(max(squad_f1(a, pred) for a in r) for r in rest)
    else:
        em = max(squad_exact(a, pred) for a in golds)
        f1 = max(squad_f1(a, pred) for a in golds)
    n = max(1, len(golds))
    return {"em": em / n, "f1": f1 / n}


def coqa_process_results(doc: dict[str, Any], results: list[str]) -> dict[str, float]:
    pred = results[0].strip().split("\n")[0]  # the first line of the answer
    return coqa_scores(coqa_doc_to_target(doc), pred)


def _squad_metrics_available() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformers.data.metrics.squad_metrics") is not None
    except ModuleNotFoundError:
        return False


# --------------------------------------------------------------------------------------------------------
# Offline variants: YAMLs written from templates into a work directory
# --------------------------------------------------------------------------------------------------------
def _lm_eval_tasks_dir() -> Path:
    import lm_eval

    return Path(lm_eval.__file__).resolve().parent / "tasks"


def _official_mmlu_subjects() -> list[dict[str, str]]:
    """[{task, subject, tag, file}] of lm-eval's mmlu/flan_cot_fewshot subject YAMLs (installed version)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    out = []
    for f in sorted((_lm_eval_tasks_dir() / "mmlu" / "flan_cot_fewshot").glob("mmlu_*.yaml")):
        cfg = yaml.load(f.read_text(encoding="utf-8"), Loader=loader)
        out.append({"task": cfg["task"], "subject": cfg["dataset_name"], "tag": cfg["tag"], "file": str(f)})
    if not out:
        raise FileNotFoundError(
            f"no mmlu/flan_cot_fewshot task files in the installed lm-eval ({_lm_eval_tasks_dir()})"
        )
    return out


def _fill(node: Any, values: dict[str, Any]) -> Any:
    """Replace ``${name}`` string leaves of a loaded template by ``values[name]`` (any type)."""
    if isinstance(node, dict):
        return {k: _fill(v, values) for k, v in node.items()}
    if isinstance(node, list):
        return [_fill(v, values) for v in node]
    if isinstance(node, str):
        m = re.fullmatch(r"\$\{(\w+)\}", node)
        if m:
            return values[m.group(1)]
        return string.Template(node).substitute(values) if "${" in node else node
    return node


def _template(name: str) -> dict[str, Any]:
    import yaml

    return yaml.safe_load((CONFIG_DIR / name).read_text(encoding="utf-8"))


def _write_yaml(path: Path, cfg: dict[str, Any], note: str) -> None:
    import yaml

    path.write_text(f"# {note}\n" + yaml.safe_dump(cfg, sort_keys=False, allow_unicode=True), encoding="utf-8")


def gsm8k_available(data_dir: Path | None) -> bool:
    return data_dir is not None and (data_dir / GSM8K_FILE).is_file()


def mmlu_available(data_dir: Path | None) -> bool:
    return data_dir is not None and (data_dir / MMLU_DIR / "test").is_dir()


def _mmlu_rows(path: Path, subject: str) -> list[dict[str, Any]]:
    """hendrycks/test CSV (no header: question, A, B, C, D, answer letter) -> cais/mmlu rows."""
    rows = []
    with open(path, encoding="utf-8", newline="") as f:
        for i, rec in enumerate(csv.reader(f)):
            if len(rec) != 6 or rec[5].strip() not in ("A", "B", "C", "D"):
                raise ValueError(f"{path}, row {i + 1}: expected question,A,B,C,D,answer(A-D); got {rec!r}")
            rows.append(
                {"question": rec[0], "subject": subject, "choices": rec[1:5], "answer": "ABCD".index(rec[5].strip())}
            )
    return rows


def _work_key(data_dir: Path | None, parts: tuple[str, ...]) -> str:
    import lm_eval

    h = hashlib.sha256()
    h.update(f"{WORK_FORMAT}|{getattr(lm_eval, '__version__', '?')}|{_lm_eval_tasks_dir()}|{data_dir}|{parts}".encode())
    for f in sorted(CONFIG_DIR.glob("*.yaml")):
        h.update(f.read_bytes())
    sources = {"gsm8k": (GSM8K_FILE,), "mmlu": (f"{MMLU_DIR}/test", f"{MMLU_DIR}/val")}
    if data_dir is not None:
        for rel in (r for part in parts for r in sources[part]):
            p = data_dir / rel
            files = sorted(p.iterdir()) if p.is_dir() else [p] if p.exists() else []
            for f in files:
                st = f.stat()
                h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:16]


def build_work_dir(data_dir: Path | None, root: Path | None = None, parts: tuple[str, ...] = ("gsm8k", "mmlu")) -> Path:
    """Writes the offline task YAMLs of ``parts`` (gsm8k: gsm8k_cot_local; mmlu: the 57 subjects, converted to
    the cais/mmlu schema, and their group) for ``data_dir``, plus coqa_compat.  A finished directory with the
    same key (parts, data files, templates, lm-eval version) is reused."""
    unknown = set(parts) - {"gsm8k", "mmlu"}
    if unknown:
        raise ValueError(f"parts={sorted(unknown)}; valid: ['gsm8k', 'mmlu']")
    parts = tuple(sorted(set(parts)))
    root = Path(root).expanduser() if root else Path(tempfile.gettempdir()) / "sparse_eval_lm_eval"
    target = root / _work_key(data_dir, parts)
    if (target / ".complete").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=root))
    try:
        _populate(tmp, target, data_dir, parts)
        (tmp / ".complete").write_text("ok\n")
        try:
            os.rename(tmp, target)
        except OSError:  # a concurrent run finished first (or a stale unfinished dir): keep a complete one
            if (target / ".complete").exists():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def _populate(tmp: Path, final: Path, data_dir: Path | None, parts: tuple[str, ...]) -> None:
    cache_dir = str(final / "hf_datasets_cache")  # the Arrow cache of these local files stays with them
    tasks_dir = _lm_eval_tasks_dir()
    shutil.copy(CONFIG_DIR / "coqa_compat.yaml", tmp / "coqa_compat.yaml")
    if "gsm8k" in parts and gsm8k_available(data_dir):
        cfg = _fill(
            _template("gsm8k_cot_local.yaml"),
            {
                "official": str(tasks_dir / "gsm8k" / "gsm8k-cot.yaml"),
                "test": str((data_dir / GSM8K_FILE).resolve()),
                "cache_dir": cache_dir,
            },
        )
        _write_yaml(
            tmp / "gsm8k_cot_local.yaml", cfg, "generated by sparse_eval from lm_eval_configs/gsm8k_cot_local.yaml"
        )
    if "mmlu" in parts and mmlu_available(data_dir):
        sub = tmp / "mmlu_flan_cot_fewshot_local"
        (sub / "data").mkdir(parents=True)
        missing = []
        template = _template("mmlu_flan_cot_fewshot_local_subject.yaml")
        for s in _official_mmlu_subjects():
            files = {}
            for split, folder in (("test", "test"), ("validation", "val")):
                src = data_dir / MMLU_DIR / folder / f"{s['subject']}_{folder}.csv"
                if not src.is_file():
                    if split == "test":
                        missing.append(str(src))
                    continue
                dst = sub / "data" / f"{s['subject']}_{folder}.jsonl"
                dst.write_text(
                    "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in _mmlu_rows(src, s["subject"])),
                    encoding="utf-8",
                )
                files[split] = str(final / dst.relative_to(tmp))
            if "test" not in files:
                continue
            cfg = _fill(
                template,
                {
                    "official": s["file"],
                    "task": f"{s['task']}_local",
                    "tag": f"{s['tag']}_local",
                    "test": files["test"],
                    "validation": files.get("validation"),
                    "cache_dir": cache_dir,
                },
            )
            if "validation" not in files:
                del cfg["dataset_kwargs"]["data_files"]["validation"]
                cfg["validation_split"] = None
            _write_yaml(
                sub / f"{s['task']}_local.yaml",
                cfg,
                "generated by sparse_eval from lm_eval_configs/mmlu_flan_cot_fewshot_local_subject.yaml",
            )
        if missing:
            raise FileNotFoundError(
                f"paths.data_dir has an incomplete MMLU: missing {missing[:3]}"
                f"{' ...' if len(missing) > 3 else ''} ({len(missing)} files)"
            )
        shutil.copy(CONFIG_DIR / "_mmlu_flan_cot_fewshot_local.yaml", sub / "_mmlu_flan_cot_fewshot_local.yaml")


@functools.lru_cache(maxsize=None)
def _subject_names() -> tuple[tuple[str, str], ...]:
    return tuple((s["task"], f"{s['task']}_local") for s in _official_mmlu_subjects())


def local_names(subjects: bool = True) -> dict[str, str]:
    """official lm-eval name -> its offline variant (the MMLU group, and with ``subjects`` its 57 subjects)."""
    names = {"gsm8k_cot": "gsm8k_cot_local", "mmlu_flan_cot_fewshot": "mmlu_flan_cot_fewshot_local"}
    return names | dict(_subject_names()) if subjects else names


def _data_part(name: str) -> str | None:
    """Which file set of ``paths.data_dir`` a task with an offline variant reads ("gsm8k" or "mmlu"), by its
    official or ``_local`` name (the MMLU group and its subjects); None for any other task."""
    if name in ("gsm8k_cot", "gsm8k_cot_local"):
        return "gsm8k"
    return "mmlu" if name.startswith("mmlu_flan_cot_fewshot") else None


def _missing_local_message(
    name: str, part: str, data_dir: Path | None, explicit: bool, forced: bool, local: str | None = None
) -> str:
    """Why task ``name`` cannot run from ``paths.data_dir`` and what to do (the one wording of that refusal)."""
    want = GSM8K_FILE if part == "gsm8k" else f"{MMLU_DIR}/test/*.csv"
    why = (
        "it was asked for by name"
        if explicit
        else "task.offline=true"
        if forced
        else "the Hugging Face hub is unreachable"
    )
    variant = f"the offline variant {local!r}" if local else "its offline variant"
    return (
        f"task {name!r}: {variant} needs {want} under paths.data_dir ({data_dir or 'unset'}) ({why}); set "
        "paths.data_dir (or SPARSE_EVAL_DATA_DIR) to a folder with it, or task.offline=false with hub access"
    )


_HUB_REACHABLE: dict[str, bool] = {}


def hub_reachable(timeout: float = 3.0) -> bool:
    """False under HF_HUB_OFFLINE / HF_DATASETS_OFFLINE, else whether a TCP connection to the hub opens."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in ("1", "true", "yes", "on"):
            return False
    url = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    if url not in _HUB_REACHABLE:
        parsed = urlparse(url)
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
        try:
            socket.create_connection((parsed.hostname or "huggingface.co", port), timeout=timeout).close()
            _HUB_REACHABLE[url] = True
        except OSError:
            _HUB_REACHABLE[url] = False
    return _HUB_REACHABLE[url]


def _offline_mode(value: Any) -> str:
    v = str(value).strip().lower()
    v = {"1": "true", "yes": "true", "on": "true", "0": "false", "no": "false", "off": "false"}.get(v, v)
    if v not in OFFLINE_CHOICES:
        raise ValueError(f"task.offline={value!r}; valid: {list(OFFLINE_CHOICES)}")
    return v


def _plain(obj: Any) -> Any:
    """numpy scalars, tuples and other non-JSON values -> JSON types (NaN stays NaN; the log maps it to null)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if isinstance(obj, (str, bool, int, float)) or obj is None:
        return obj
    if hasattr(obj, "item"):  # numpy / torch scalars
        try:
            return obj.item()
        except (ValueError, TypeError):
            pass
    return str(obj)


# --------------------------------------------------------------------------------------------------------
# The task
# --------------------------------------------------------------------------------------------------------
class _RowsUntilStop:
    """Forward hooks around one ``model.generate`` of an lm-eval batch: each decode pass counts only the rows not
    yet done, i.e. whose generated tokens so far contain none of the stop sequences (lm-eval's own criteria,
    ``MultiTokenEOSCriteria``, applied per row) and no EOS.  A row done after token j is not counted in the pass
    that reads token j: the pass a batch of one never makes.  context: long [B, T], the padded prompts (only their
    count is used)."""

    def __init__(self, tokenizer: Any, stop: list[str], context: Any, session: Any, model: Any):
        from lm_eval.models.utils_hf import stop_sequences_criteria

        # lm-eval's criteria look back over the generated tokens only: given those alone (initial length 0), they
        # read what they would read after the prompt, without the prompt copied in every step
        self.criteria = stop_sequences_criteria(tokenizer, stop, 0, context.shape[0])
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if eos is None:
            eos = getattr(tokenizer, "eos_token_id", None)
        self.eos = {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]) if e is not None}
        self.session = session
        self.done = [False] * context.shape[0]
        self.generated: list[Any] = []
        self.prompt_passed = False
        self._counting: contextlib.ExitStack | None = None

    def before(self, module: Any, args: tuple, kwargs: dict[str, Any]) -> None:
        import torch

        if not self.prompt_passed:  # the prompt's pass (counted by the plug-in's own rules)
            self.prompt_passed = True
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None or ids.dim() != 2 or ids.shape[1] != 1 or ids.shape[0] != len(self.done):
            return  # not a decode pass of this batch
        self.generated.append(ids)
        for i, tok in enumerate(ids[:, 0].tolist()):
            self.done[i] = self.done[i] or tok in self.eos
        generated = torch.cat(self.generated, 1)  # [B, steps so far]
        for crit in self.criteria:
            crit(generated, None)
            self.done = [d or c for d, c in zip(self.done, crit.done_tracker)]
        live = torch.tensor([not d for d in self.done], dtype=torch.bool, device=ids.device)[:, None]  # [B, 1]
        self._counting = contextlib.ExitStack()
        self._counting.enter_context(self.session.counting(live))

    def after(self, *_: Any) -> None:
        if self._counting is not None:
            self._counting.close()
            self._counting = None


@register_task
class LmEval(Task):
    name = "lm_eval"
    summary = "lm-evaluation-harness generation tasks (task.tasks=[...]) scored by lm-eval itself (MagicPIG Table 1)"
    num_samples_means = "the first N documents of each lm-eval task (its --limit)"
    config_class = LmEvalConfig
    default_protocol = "A"
    metric = "score"  # the mean of the tasks' headline metrics (MagicPIG Table 1 "Avg.")
    higher_is_better = True

    def validate(self) -> None:
        super().validate()
        c = self.config
        if isinstance(c.tasks, str) or not c.tasks or not all(isinstance(t, str) and t for t in c.tasks):
            raise ValueError(
                f"task.tasks={c.tasks!r}: must be a non-empty list of lm-eval task names, e.g. {list(PAPER_TASKS)}"
            )
        if len(set(c.tasks)) != len(c.tasks):
            raise ValueError(f"task.tasks={list(c.tasks)} names a task twice")
        if c.limit is not None and c.num_samples is not None and float(c.limit) != float(c.num_samples):
            raise ValueError(f"task.limit={c.limit} and task.num_samples={c.num_samples} disagree; set one of them")
        lim = self.limit
        if lim is not None and lim <= 0:
            raise ValueError(f"task.limit={lim}: must be > 0 (< 1: a fraction of each task's documents) or null (all)")
        if c.num_fewshot is not None and c.num_fewshot < 0:
            raise ValueError(f"task.num_fewshot={c.num_fewshot}: must be >= 0 or null (the task's default)")
        if c.batch_size < 1:
            raise ValueError(f"task.batch_size={c.batch_size}: must be >= 1")
        if c.max_length is not None and c.max_length < 2:
            raise ValueError(f"task.max_length={c.max_length}: must be >= 2 or null (the model's context)")
        if isinstance(c.shards, bool) or not isinstance(c.shards, int) or c.shards < 1:
            raise ValueError(f"task.shards={c.shards!r}: must be an integer >= 1 (1: one sample per task)")
        if c.bootstrap_iters < 0:
            raise ValueError(f"task.bootstrap_iters={c.bootstrap_iters}: must be >= 0")
        if c.gen_kwargs is not None and not isinstance(c.gen_kwargs, (str, dict)):
            raise ValueError(f"task.gen_kwargs={c.gen_kwargs!r}: a mapping or a 'key=value,key2=value2' string")
        pm = c.primary_metric
        if pm is not None and (
            not isinstance(pm, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in pm.items())
        ):
            raise ValueError(f"task.primary_metric={pm!r}: a mapping task name -> '<metric>,<filter>' (or '<metric>')")
        if logging.getLevelName(str(c.verbosity).upper()) not in (10, 20, 30, 40, 50):
            raise ValueError(f"task.verbosity={c.verbosity!r}; valid: DEBUG, INFO, WARNING, ERROR, CRITICAL")
        self.offline = _offline_mode(c.offline)
        self.include_paths = self._include_paths()
        self._check_local_data()
        self._manager = None
        self._max_length: int | None = c.max_length
        self.resolved: dict[str, dict[str, Any]] = {}

    def _check_local_data(self) -> None:
        """At start, before the model loads: a GSM8K or MMLU task that will run from ``paths.data_dir`` (asked for
        by its ``_local`` name, ``task.offline=true``, or ``auto`` with the hub unreachable) whose data is not there
        is refused, as ``_resolve`` would refuse it after loading the model.  A task of ``task.include_path`` may
        share the name: those are left to ``_resolve``."""
        if self.include_paths:
            return
        for name in self.config.tasks:
            part = _data_part(name)
            if part is None:
                continue
            if (gsm8k_available if part == "gsm8k" else mmlu_available)(self.data_dir):
                continue
            explicit = name.endswith("_local")
            if explicit or self.offline == "true" or (self.offline == "auto" and not hub_reachable()):
                raise FileNotFoundError(
                    _missing_local_message(name, part, self.data_dir, explicit, self.offline == "true")
                )

    @property
    def limit(self) -> float | None:
        c = self.config
        lim = c.limit if c.limit is not None else c.num_samples
        if lim is None:
            return None
        lim = float(lim)
        return int(lim) if lim >= 1 and lim.is_integer() else lim

    def _include_paths(self) -> list[Path]:
        raw = self.config.include_path
        if raw is None:
            return []
        items = [raw] if isinstance(raw, (str, os.PathLike)) else list(raw)
        paths = []
        for p in items:
            path = Path(str(p)).expanduser().resolve()
            if not path.exists():
                raise FileNotFoundError(f"task.include_path: {path} does not exist")
            paths.append(path)
        return paths

    # -- name resolution ---------------------------------------------------------------------------------
    def _resolve(self) -> None:
        """Maps each requested name to the lm-eval task that runs (official, offline variant or compat) and
        builds the TaskManager; every bad name or missing data set fails here, before any evaluation."""
        try:
            from lm_eval.tasks import TaskManager
        except ModuleNotFoundError as exc:
            raise ModuleNotFoundError(f"task=lm_eval needs lm-eval: pip install 'lm-eval==0.4.13' ({exc})") from None

        variants = local_names(subjects=any(n.startswith("mmlu_flan_cot_fewshot_") for n in self.config.tasks))
        local_set = set(variants.values())
        parts = tuple(
            sorted(
                {
                    ("gsm8k" if n.startswith("gsm8k") else "mmlu")
                    for n in self.config.tasks
                    if n in variants or n in local_set
                }
            )
        )
        self.work_dir = build_work_dir(
            self.data_dir, Path(self.config.work_dir) if self.config.work_dir else None, parts
        )
        user = (
            TaskManager(include_path=[str(p) for p in self.include_paths], include_defaults=False)
            if self.include_paths
            else None
        )
        user_names = set(user.all_tasks) if user else set()
        generated = TaskManager(include_path=str(self.work_dir), include_defaults=False)
        have_local = set(generated.all_tasks)
        compat = not _squad_metrics_available()
        hub = None  # decided lazily: only names with a local variant or CoQA need it

        def hub_ok() -> bool:
            nonlocal hub
            if hub is None:
                hub = hub_reachable()
            return hub

        resolved: dict[str, dict[str, Any]] = {}
        need_defaults: list[str] = []
        for name in self.config.tasks:
            if name in user_names:
                resolved[name] = {"lm_eval_task": name, "source": "include_path"}
            elif name in local_set or name in variants:
                local = name if name in local_set else variants[name]
                use_local = name in local_set or self.offline == "true" or (self.offline == "auto" and not hub_ok())
                if use_local:
                    if local not in have_local:
                        raise FileNotFoundError(
                            _missing_local_message(
                                name,
                                _data_part(local),
                                self.data_dir,
                                name in local_set,
                                self.offline == "true",
                                local,
                            )
                        )
                    resolved[name] = {"lm_eval_task": local, "source": f"local:{self.data_dir}"}
                else:
                    resolved[name] = {"lm_eval_task": name, "source": "hub"}
                    need_defaults.append(name)
            elif name in ("coqa", "coqa_compat"):
                if self.offline == "true" or (self.offline == "auto" and not hub_ok()):
                    raise ValueError(
                        f"task {name!r} needs the Hugging Face hub (data set EleutherAI/coqa) and there is no offline "
                        "copy; the hub is "
                        f"{'switched off (task.offline=true)' if self.offline == 'true' else 'unreachable'}. "
                        f"Drop it from task.tasks or run where the hub is reachable (offline tasks here: "
                        f"{sorted(have_local & {'gsm8k_cot_local', 'mmlu_flan_cot_fewshot_local'})})"
                    )
                task = "coqa_compat" if (compat or name == "coqa_compat") else "coqa"
                resolved[name] = {"lm_eval_task": task, "source": "hub"}
                if task == "coqa":
                    need_defaults.append(name)
            else:
                need_defaults.append(name)
                resolved[name] = {"lm_eval_task": name, "source": "hub"}
        include_defaults = self.config.include_defaults
        if include_defaults is None:
            include_defaults = bool(need_defaults)
        manager = TaskManager(
            include_path=[str(p) for p in [self.work_dir, *self.include_paths]], include_defaults=include_defaults
        )
        known = set(manager.all_tasks)
        unknown = [n for n, r in resolved.items() if r["lm_eval_task"] not in known]
        if unknown:
            main = sorted({*PAPER_TASKS, "gsm8k_cot_local", "mmlu_flan_cot_fewshot_local", "coqa_compat"})
            hints = {n: difflib.get_close_matches(n, list(known), n=5, cutoff=0.6) for n in unknown}
            hint = "; ".join(f"{n!r}: did you mean {h}" for n, h in hints.items() if h)
            raise ValueError(
                f"unknown lm-eval task(s) {unknown}; the MagicPIG tasks and their variants are {main}"
                f"{' (the built-in index was not loaded: task.include_defaults=false)' if not include_defaults else ''}"
                f"{'; ' + hint if hint else ''}; `lm-eval ls tasks` lists all "
                f"{len(known) if include_defaults else ''} tasks"
            )
        self._manager = manager
        self.resolved = resolved

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:
        if self._max_length is None:
            self._max_length = int(max_context)
        elif self._max_length > max_context:
            raise ValueError(f"task.max_length={self._max_length} exceeds the model's context ({max_context} tokens)")
        self._resolve()
        if self.config.shards == 1:
            return [Sample(id=name, data=dict(self.resolved[name])) for name in self.config.tasks]
        return [s for name in self.config.tasks for s in self._shards(name)]

    def _shards(self, name: str) -> list[Sample]:
        """``task.shards`` samples of requested task ``name``: piece k of n holds documents
        [k·N/n, (k+1)·N/n) of each of its lm-eval tasks (N: that task's documents after ``limit``), passed to
        lm-eval as ``samples`` (its document indices) instead of ``limit``."""
        from lm_eval.evaluator_utils import get_sample_size

        entry = self.resolved[name]
        leaves: dict[str, int] = {}
        for leaf, task in self._manager.load([entry["lm_eval_task"]])["tasks"].items():  # the leaf tasks, flat
            cfg = task.config
            shots = self.config.num_fewshot if self.config.num_fewshot is not None else cfg.num_fewshot
            few = cfg.fewshot_config
            sampler = (few.get("sampler") if isinstance(few, dict) else getattr(few, "sampler", None)) or "default"
            if shots and sampler != "first_n":
                raise ValueError(
                    f"task.shards={self.config.shards}: {leaf!r} draws its {shots} few-shot examples with the "
                    f"{sampler!r} sampler, which depends on the documents run before; set task.shards=1"
                )
            docs = len(task.eval_docs)
            leaves[leaf] = min(docs, int(get_sample_size(task, self.limit) or docs))  # a limit past the end: all
        n = self.config.shards
        few = {leaf: m for leaf, m in leaves.items() if m < n}
        if few:  # a piece would hold none of such a task's documents, and lm-eval runs all of a task it is not given
            leaf, m = min(few.items(), key=lambda kv: kv[1])
            raise ValueError(
                f"task.shards={n}: {name!r} has {len(few)} lm-eval task(s) with fewer documents than pieces "
                f"({leaf!r}: {m}); set task.shards <= {min(leaves.values())}"
            )
        return [
            Sample(
                id=f"{name}#{k + 1}of{n}",
                data={
                    **entry,
                    "requested": name,
                    "doc_ids": {leaf: list(range(m * k // n, m * (k + 1) // n)) for leaf, m in sorted(leaves.items())},
                },
            )
            for k in range(n)
        ]

    # -- one lm-eval task --------------------------------------------------------------------------------
    def _lm(self, engine: Any) -> Any:
        from lm_eval.models.huggingface import HFLM

        session = engine.session
        task = self

        class _PatchedLM(HFLM):
            def get_model_info(self) -> dict[str, Any]:  # HFLM's asks the hub for a sha; the instance has none
                return {
                    "model_num_parameters": sum(p.numel() for p in self._model.parameters()),
                    "model_dtype": str(self._model.dtype),
                }

            def _model_generate(self, context, max_length: int, stop: list[str], **generation_kwargs):
                """HFLM's generation, with each row's statistics counted only until the row is done (lm-eval's
                stop sequences, or EOS): a batch runs until its last row is done, so without this a row's
                Cost2 and error would include steps that lm-eval then cuts off, and depend on its companions.
                Each batch's rows are then archived (``StatsRecorder.archive_rows``), so that the sample's
                statistics are the same however lm-eval batched its documents."""
                rows = _RowsUntilStop(self.tokenizer, stop, context, session, self._model)
                handles = (
                    self._model.register_forward_pre_hook(rows.before, with_kwargs=True),
                    self._model.register_forward_hook(rows.after),
                )
                try:
                    out = super()._model_generate(context, max_length, stop, **generation_kwargs)
                    new = out[:, context.shape[1] :]  # [B, generated]
                    texts = self.tokenizer.batch_decode(new, skip_special_tokens=False)
                    stopped = [
                        any(s in text for s in stop) or bool(rows.eos & set(ids))
                        for text, ids in zip(texts, new.tolist())
                    ]
                    task.generations["rows"] += len(stopped)
                    task.generations["unstopped"] += stopped.count(False)
                    return out
                finally:
                    for h in handles:
                        h.remove()
                    rows.after()
                    session.recorder.archive_rows()  # rows of lm-eval's batches pooled in float64: batch-free

        lm = _PatchedLM(
            pretrained=engine.model,
            tokenizer=engine.tokenizer,
            batch_size=self.config.batch_size,
            max_length=self._max_length,
            device=str(engine.device),
        )
        # HFLM takes a given model's ``device`` (its first parameter's: on meta where ``model.device_map`` offloads
        # it); its inputs go where the engine's do (``placement.main_device``)
        lm._device = engine.device
        return lm

    def _primary(self, requested: str, task: str, entry: dict[str, Any]) -> str | None:
        """The result key of the headline metric: ``task.primary_metric`` of the requested name, the lm-eval
        task or its base name ("<metric>,<filter>", or a bare "<metric>": its first filter); unlisted tasks: the
        first metric lm-eval reported.  A listed metric lm-eval did not report gives None (and a warning)."""
        table = self.config.primary_metric or {}
        base = re.sub(r"_(local|compat)$", "", task)
        reported = [
            k
            for k, v in entry.items()
            if "," in k and "_stderr" not in k and isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        for key in (requested, task, base):
            if key in table:
                want = str(table[key])
                found = (
                    [want]
                    if want in reported
                    else []
                    if "," in want
                    else [k for k in reported if k.split(",")[0] == want]
                )
                if found:
                    return found[0]
                log.warning(
                    "task.primary_metric[%r]=%r is not among lm-eval's results for %r: %s; score left empty",
                    key,
                    want,
                    task,
                    reported,
                )
                return None
        return reported[0] if reported else None

    def run(self, sample: Sample, engine: Any) -> dict[str, Any]:
        import lm_eval
        from lm_eval import simple_evaluate

        if engine.protocol == "B":
            raise ValueError(
                "task=lm_eval supports eval.protocol A (dense prompt prefill, sparse decode) or S "
                "(everything sparse); B needs a context/question split that lm-eval prompts lack"
            )
        if self._manager is None:
            self._resolve()
        task_name = sample.data["lm_eval_task"]
        self.generations = {"rows": 0, "unstopped": 0}  # counted by the patched HFLM's _model_generate
        doc_ids = sample.data.get("doc_ids")  # a piece of the task's documents (task.shards > 1), else None
        requested = sample.data.get("requested", sample.id)
        c = self.config
        seed = int(c.seed)
        lm_logger = logging.getLogger("lm_eval")
        old_level = lm_logger.level
        lm_logger.setLevel(str(c.verbosity).upper())
        # the run's meta.json already records versions, hardware and the commit; lm-eval's add_env_info shells out
        # to pip, nvidia-smi, ... (torch.utils.collect_env), seconds per call, and its get_git_commit_hash runs git
        # in the working directory (printing git's "fatal: not a git repository" outside one), so both are skipped
        import lm_eval.evaluator as lm_evaluator

        skip_env = contextlib.ExitStack()
        for name, stub in (("add_env_info", lambda results: None), ("get_git_commit_hash", lambda: None)):
            if hasattr(lm_evaluator, name):
                skip_env.enter_context(mock.patch.object(lm_evaluator, name, stub))
        try:
            # the engine's batch-invariant kernels (lm-eval left-pads generation batches, as the engine does; its
            # log-likelihood batches are right-padded, which task.batch_size=1, the default, avoids)
            with skip_env, engine.invariant():
                out = simple_evaluate(
                    model=self._lm(engine),
                    tasks=[task_name],
                    num_fewshot=c.num_fewshot,
                    limit=None if doc_ids else self.limit,
                    samples=doc_ids,
                    bootstrap_iters=c.bootstrap_iters,
                    log_samples=True,
                    gen_kwargs=c.gen_kwargs or None,
                    task_manager=self._manager,
                    apply_chat_template=c.apply_chat_template,
                    fewshot_as_multiturn=c.fewshot_as_multiturn,
                    system_instruction=c.system_instruction,
                    # lm-eval's own seeds (0, 1234, 1234, 1234) for task.seed = 0
                    random_seed=seed,
                    numpy_random_seed=1234 + seed,
                    torch_random_seed=1234 + seed,
                    fewshot_random_seed=1234 + seed,
                )
        finally:
            lm_logger.setLevel(old_level)
        results = _plain(out["results"])
        entry = results.get(task_name, {})
        primary = self._primary(requested, task_name, entry)
        score = entry.get(primary) if primary else None
        docs = []
        for sub, rows in (out.get("samples") or {}).items():
            for row in rows:
                docs.append(self._doc_record(sub, row))
        piece = (
            {"requested": requested, "doc_ranges": {t: [ids[0], ids[-1] + 1] for t, ids in doc_ids.items()}}
            if doc_ids
            else {}
        )
        return {
            "lm_eval_task": task_name,
            **piece,
            "source": sample.data.get("source"),
            "score": score if isinstance(score, (int, float)) and not isinstance(score, bool) else None,
            "primary_metric": primary,
            "results": results,
            "n_samples": _plain(out.get("n-samples", {})),
            "n_shot": _plain(out.get("n-shot", {})),
            "versions": _plain(out.get("versions", {})),
            "higher_is_better": _plain(out.get("higher_is_better", {})),
            "group_subtasks": _plain(out.get("group_subtasks", {})),
            "documents": len({(d["task"], d["doc_id"]) for d in docs}),
            # generate_until requests, and those whose generation contains none of lm-eval's stop sequences (EOS
            # included): they ran to the length limit, and the filter reads an answer that may run on or be cut
            "generations": self.generations["rows"],
            "unstopped_generations": self.generations["unstopped"],
            "docs": docs,
            "lm_eval": {
                "version": getattr(lm_eval, "__version__", None),
                "limit": self.limit,
                "max_length": self._max_length,
                "batch_size": c.batch_size,
                "gen_kwargs": _plain(c.gen_kwargs),
                "num_fewshot": c.num_fewshot,
                "seed": seed,
            },
        }

    def _doc_record(self, task: str, row: dict[str, Any]) -> dict[str, Any]:
        """One document under one filter: its target, the raw generation(s), the filtered answer, the metrics."""
        metric_names = row.get("metrics") or []
        resps = row.get("resps") or []
        rec = {
            "task": task,
            "doc_id": _plain(row.get("doc_id")),
            "filter": row.get("filter"),
            "target": _plain(row.get("target")),
            # generate_until: one string per document; loglikelihood: [(logprob, is_greedy)] per choice
            "response": _plain(resps[0][0] if len(resps) == 1 and len(resps[0]) == 1 else resps),
            "filtered": _plain(row.get("filtered_resps")),
            "metrics": {m: _plain(row.get(m)) for m in metric_names if m in row},
            "doc_hash": row.get("doc_hash"),
            "prompt_hash": row.get("prompt_hash"),
        }
        if self.config.log_inputs:
            args = row.get("arguments") or []
            rec["prompt"] = _plain(args[0][0] if args and isinstance(args[0], (list, tuple)) else args)
            rec["doc"] = _plain(row.get("doc"))
        return rec

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """``score``: the plain mean of the tasks' headline metrics (MagicPIG Table 1 "Avg."); one entry per task
        with its headline metric, and ``<task>/<metric,filter>`` for every metric lm-eval reported for it."""
        out: dict[str, Any] = {}
        scores = []
        pieces: dict[str, list[dict[str, Any]]] = {}
        for r in records:
            if r.get("requested") is not None:  # a piece of a task (task.shards > 1): pooled below
                pieces.setdefault(r["requested"], []).append(r)
                continue
            name = r["id"]
            out[name] = r.get("score")
            if isinstance(r.get("score"), (int, float)) and math.isfinite(r["score"]):
                scores.append(r["score"])
            for key, val in (r.get("results") or {}).get(r.get("lm_eval_task"), {}).items():
                if "," in key and isinstance(val, (int, float)) and not isinstance(val, bool):
                    out[f"{name}/{key}"] = val
        for name, recs in pieces.items():
            values = [v for r in recs for v in (_headline_values(r) or [None])]
            score = None if not values or None in values else sum(values) / len(values)
            if score is None:
                log.warning(
                    "%s: a piece has no score, or its headline is not a mean over documents: pieces not pooled", name
                )
            out[name] = score
            out[f"{name}/documents"] = len(values)
            out[f"{name}/pieces"] = len(recs)
            if score is not None:
                scores.append(score)
        out["score"] = sum(scores) / len(scores) if scores else None
        out["tasks"] = len(scores)
        return out

    def summary_warnings(self, records: list[dict[str, Any]]) -> list[str]:
        """More than ``UNSTOPPED_WARN`` of the run's generations ran to the length limit without any of lm-eval's
        stop sequences (EOS included): the model does not end its answers where the task expects, so the filter
        reads answers that run on (or are cut off) and the score measures the format, not the method."""
        rows = sum(r.get("generations") or 0 for r in records)
        unstopped = sum(r.get("unstopped_generations") or 0 for r in records)
        if not rows or unstopped / rows <= UNSTOPPED_WARN:
            return []
        return [
            f"{unstopped} of {rows} generations ran to the length limit without a stop sequence (lm-eval's `until` "
            f"and EOS): the answers its filter reads run on; try task.apply_chat_template=true for an instruct "
            f"model, or give the stop sequences with task.gen_kwargs (until=...), declared before the scored run"
        ]

    def units(self, records: list[dict[str, Any]]) -> int:
        """Documents: a record is a requested task, or a piece of one (``task.shards``), holding many (its
        ``documents``; from its per-document records when a record lacks the count)."""
        return sum(_documents(r) for r in records)

    def expected_units(self, expected: int, records: list[dict[str, Any]]) -> int:
        """The documents of a run of ``expected`` records: exact once every record finished; before, each missing
        record counted at the finished ones' mean (a task's pieces hold equal shares of its documents, to one);
        ``expected`` itself while none finished."""
        if not records:
            return expected
        done = self.units(records)
        return done + round((expected - len(records)) * done / len(records)) if expected > len(records) else done

    def score_terms(self, records: list[dict[str, Any]]):
        """Per document: the headline metric of each document under the headline filter, one bootstrap group per
        lm-eval task (the score is the mean of the tasks' means).  None when a task's headline is not the mean of
        its documents' values (then no interval is claimed)."""
        from ..metrics.statistics import ScoreTerms

        ids, vals, groups = [], [], []
        group_of: dict[str, int] = {}
        for r in (r for r in records if r.get("score") is not None):
            name = r.get("requested") or r["id"]  # a task's pieces (task.shards > 1) form one group
            g = group_of.setdefault(name, len(group_of))
            docs = _headline_docs(r)
            if docs is None:
                return None
            ids += [f"{name}/{i}" for i, _ in docs]
            vals += [v for _, v in docs]
            groups += [g] * len(docs)
        return ScoreTerms(ids, vals, [1.0] * len(ids), groups)


def _documents(r: dict[str, Any]) -> int:
    """The documents one record scored: its ``documents``, else those of its per-document records; a record
    with neither (one written without them) counts as one."""
    n = r.get("documents")
    if isinstance(n, int) and not isinstance(n, bool):
        return n
    return len({(d.get("task"), d.get("doc_id")) for d in r.get("docs") or []}) or 1


def _headline_docs(r: dict[str, Any]) -> list[tuple[str, float]] | None:
    """("<lm-eval task>/<doc id>", value) of a record's documents under its headline metric and filter; None when
    the record's score is not their mean (a headline that is not a mean over documents)."""
    if r.get("score") is None:
        return None
    metric, _, filt = str(r.get("primary_metric") or "").partition(",")
    docs = [
        (f"{d['task']}/{d['doc_id']}", float(d["metrics"][metric]))
        for d in r.get("docs") or []
        if d.get("filter") == filt and isinstance(d.get("metrics", {}).get(metric), (int, float))
    ]
    if not docs or abs(sum(v for _, v in docs) / len(docs) - float(r["score"])) > 1e-9:
        return None
    return docs


def _headline_values(r: dict[str, Any]) -> list[float] | None:
    docs = _headline_docs(r)
    return None if docs is None else [v for _, v in docs]
