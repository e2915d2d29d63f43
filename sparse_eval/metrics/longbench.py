"""LongBench's per-answer metrics (THUDM/LongBench ``metrics.py`` / ``eval.py``), written from their definitions.

Every function returns a value in [0, 1] for one (prediction, ground truth) pair; a sample's score is the max over
its ground truths, and a dataset's score is ``100 * mean`` over samples (LongBench rounds it to 2 decimals; we
keep full precision).

* ``qa_f1``: SQuAD-style token F1 after ``normalize_answer`` (lower-case, drop ASCII punctuation, drop the
  articles a/an/the, collapse whitespace): ``P = |common| / |pred|``, ``R = |common| / |gold|``,
  ``F1 = 2PR / (P + R)`` with multiset ``common``; 0 when nothing is shared.
* ``retrieval``: the gold paragraph number ``n`` is read from ``"Paragraph n"``; score = (# integers in the
  prediction equal to ``n``) / (# integers in the prediction), 0 when the prediction has no integer.
* ``classification``: the class names occurring as substrings of the prediction form a match list; a match that
  is a proper substring of the gold class is removed (with LongBench's in-place removal while iterating, which
  skips the element after each removal -- kept on purpose, it changes scores); score = 1/len(list) when the
  gold class is in the list, else 0.
* ``code_sim``: the first line of the prediction (leading newlines stripped) that contains none of ```, ``#``,
  ``//`` (empty when none), compared with ``fuzzywuzzy.fuzz.ratio / 100``.  LongBench's requirements install
  ``fuzzywuzzy`` without ``python-Levenshtein``, so ``fuzz.ratio`` runs on ``difflib.SequenceMatcher``:
  ``round(100 * SequenceMatcher(None, a, b).ratio())`` (Python ``round``), 100 when ``a == b``, 0 when either
  is empty.  We implement exactly that (no dependency); with python-Levenshtein installed fuzzywuzzy would
  instead use the Indel ratio, which can differ.
"""

from __future__ import annotations

import difflib
import re
import string
from collections import Counter
from typing import Callable, Sequence

_PUNCT = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(s: str) -> str:
    """lower -> remove punctuation -> remove articles -> collapse whitespace (LongBench's order)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def token_f1(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, ground_truth: str, **_: object) -> float:
    return token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def retrieval(prediction: str, ground_truth: str, **_: object) -> float:
    found = re.findall(r"Paragraph (\d+)", ground_truth)
    if not found:
        raise ValueError(f"passage retrieval answer {ground_truth!r} has no 'Paragraph <n>'")
    gold = found[0]
    numbers = re.findall(r"\d+", prediction)
    if not numbers:
        return 0.0
    return sum(n == gold for n in numbers) / len(numbers)


def classification(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None, **_: object) -> float:
    if not all_classes:
        raise ValueError("classification score needs all_classes (the sample's class list)")
    matches = [c for c in all_classes if c in prediction]
    # LongBench removes while iterating over the same list: after a removal the next element is skipped.
    i = 0
    while i < len(matches):
        term = matches[i]
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
        i += 1
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy 0.18 ``fuzz.ratio`` on its pure-Python (difflib) path."""
    if a == b:
        return 100
    if not a or not b:
        return 0
    return int(round(100 * difflib.SequenceMatcher(None, a, b).ratio()))


def first_code_line(prediction: str) -> str:
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def code_sim(prediction: str, ground_truth: str, **_: object) -> float:
    return fuzz_ratio(first_code_line(prediction), ground_truth) / 100


METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1,
    "retrieval": retrieval,
    "classification": classification,
    "code_sim": code_sim,
}

# LongBench eval.py: dataset -> metric (the subtasks this harness runs; others would need rouge/jieba)
DATASET_METRIC = {
    "narrativeqa": "qa_f1",
    "qasper": "qa_f1",
    "multifieldqa_en": "qa_f1",
    "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1",
    "musique": "qa_f1",
    "triviaqa": "qa_f1",
    "trec": "classification",
    "passage_retrieval_en": "retrieval",
    "lcc": "code_sim",
    "repobench-p": "code_sim",
}

# eval.py: the few-shot datasets whose prediction is cut to its first line before scoring
FIRST_LINE_DATASETS = ("trec", "triviaqa", "samsum", "lsht")


def postprocess(dataset: str, prediction: str) -> str:
    if dataset in FIRST_LINE_DATASETS:
        return prediction.lstrip("\n").split("\n")[0]
    return prediction


def score_sample(
    dataset: str, prediction: str, answers: Sequence[str], all_classes: Sequence[str] | None = None
) -> float:
    """LongBench ``scorer`` for one sample: post-process, then the max over the ground truths, in [0, 1]."""
    try:
        metric = METRICS[DATASET_METRIC[dataset]]
    except KeyError:
        raise ValueError(f"no metric for LongBench dataset {dataset!r}; known: {sorted(DATASET_METRIC)}") from None
    pred = postprocess(dataset, prediction)
    best = 0.0
    for gt in answers:
        best = max(best, metric(pred, gt, all_classes=all_classes))
    return float(best)
