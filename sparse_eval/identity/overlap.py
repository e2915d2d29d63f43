"""Calibration text against evaluated text: a content fingerprint, and the check that refuses a run where they overlap.

A method that learned something offline (Double Sparsity's calibrated channels) must not have learned it from the
text the run evaluates.  The calibration file records a fingerprint of the text it was computed from; the task
gives the text it evaluates (``Task.evaluated_texts``); a run whose two texts share a passage is refused before
it starts (``check_method``, called by the runner's preflight).

What "overlap" means.  The two texts may come from different files (WikiText's tokenized release with ``<unk>``
against the raw one), be read through different tokenizers, or be split differently (calibration blocks,
perplexity windows, prompts), so they are compared as normalised words, not as token ids or bytes:

* normalise: Unicode NFKC, lower case, the WikiText placeholder ``<unk>`` dropped, then the words are the maximal
  runs of letters and digits (punctuation, ``@-@`` and white space only separate words);
* shingles: every run of ``SHINGLE_WORDS`` = 13 consecutive words of one text (13-grams are the usual unit of
  contamination checks: in WikiText-2, validation and test share none of them, while a shared passage shares
  all of its own);
* each word is hashed (blake2b, 64 bits), a shingle's hash is the polynomial of its words' hashes mod 2^64 passed
  through the splitmix64 finaliser, and only the shingles whose hash is 0 mod ``KEEP_ONE_IN`` = 16 are kept
  (the same ones on both sides, so the kept sets intersect exactly where the texts do);
* the two texts overlap when they share at least ``MIN_SHARED`` = 2 kept shingles.  A shared passage of w words
  holds w − 12 shingles, about (w − 12)/16 of them kept: one of 100 words is found with probability 0.97, one of
  200 words (less than a 512-token window) with probability 0.9999, while an isolated common sentence (a title,
  a quotation) is not enough to refuse a run.

The fingerprint of 131,072 calibration tokens is a few thousand 8-byte hashes (tens of KB in the file).  The
evaluated side is hashed once per run (about a second per million words).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

log = logging.getLogger("sparse_eval")

SCHEME = "sparse_eval.overlap.shingles/1"  # a format name (calibration files carry it), not the path
SHINGLE_WORDS = 13
KEEP_ONE_IN = 16
MIN_SHARED = 2
_WORD = re.compile(r"[^\W_]+")
_P = np.uint64(0x100000001B3)  # odd multiplier of the polynomial shingle hash


class CalibrationOverlapError(ValueError):
    """A method's calibration text shares content with the text the run evaluates (or cannot be checked)."""


@dataclass
class CalibrationText:
    """What a method's loaded state was computed from: ``label`` names it (a file), ``description`` says which
    text (dataset, split, tokens), ``fingerprint`` is ``fingerprint()``'s record of that text (None when the file
    has none), ``fix`` is how to get a disjoint one."""

    label: str
    description: str
    fingerprint: dict[str, Any] | None
    fix: str


def words(text: str) -> list[str]:
    """The normalised words of ``text`` (NFKC, lower case, ``<unk>`` dropped, runs of letters and digits)."""
    return _WORD.findall(unicodedata.normalize("NFKC", text).replace("<unk>", " ").lower())


def _word_hashes(ws: list[str], cache: dict[str, int]) -> np.ndarray:
    out = np.empty(len(ws), dtype=np.uint64)
    for i, w in enumerate(ws):
        h = cache.get(w)
        if h is None:
            h = cache[w] = int.from_bytes(hashlib.blake2b(w.encode("utf-8"), digest_size=8).digest(), "little")
        out[i] = h
    return out


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser (so that the low bits that choose the kept shingles are well spread)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shingle_hashes(
    texts: Iterable[str], shingle_words: int = SHINGLE_WORDS, keep_one_in: int = KEEP_ONE_IN
) -> tuple[np.ndarray, int, int]:
    """The kept shingle hashes of ``texts`` (shingles never span two texts): (sorted unique uint64 array,
    number of words, number of shingles)."""
    if shingle_words < 1 or keep_one_in < 1:
        raise ValueError(f"shingle_words={shingle_words}, keep_one_in={keep_one_in}: both must be >= 1")
    cache: dict[str, int] = {}
    kept, n_words, n_shingles = [], 0, 0
    for text in texts:
        w = _word_hashes(words(text), cache)
        n_words += len(w)
        m = len(w) - shingle_words + 1
        if m <= 0:
            continue
        h = np.zeros(m, dtype=np.uint64)
        with np.errstate(over="ignore"):
            for i in range(shingle_words):
                h = h * _P + w[i : i + m]
            h = _mix(h)
        n_shingles += m
        kept.append(h[h % np.uint64(keep_one_in) == 0])
    arr = np.unique(np.concatenate(kept)) if kept else np.empty(0, dtype=np.uint64)
    return arr, n_words, n_shingles


def fingerprint(text: str) -> dict[str, Any]:
    """The content fingerprint of ``text`` as a calibration file records it (JSON-ready)."""
    hashes, n_words, n_shingles = shingle_hashes([text])
    return {
        "scheme": SCHEME,
        "about": (
            f"sparse_eval.overlap: {SHINGLE_WORDS}-word shingles of the NFKC-lowercased words (letter/digit "
            f"runs, <unk> dropped), blake2b-64 word hashes, one shingle in {KEEP_ONE_IN} kept by hash"
        ),
        "shingle_words": SHINGLE_WORDS,
        "keep_one_in": KEEP_ONE_IN,
        "words": n_words,
        "shingles": n_shingles,
        "kept": int(hashes.size),
        "hashes_b64": base64.b64encode(hashes.astype("<u8").tobytes()).decode("ascii"),
    }


def fingerprint_hashes(fp: dict[str, Any]) -> np.ndarray:
    """The kept hashes stored in a fingerprint record."""
    return np.frombuffer(base64.b64decode(fp["hashes_b64"]), dtype="<u8").astype(np.uint64)


def shared_shingles(fp: dict[str, Any], texts: Iterable[str]) -> int:
    """How many of the fingerprint's kept shingles occur in ``texts``."""
    other, _, _ = shingle_hashes(texts, fp["shingle_words"], fp["keep_one_in"])
    return int(np.intersect1d(fingerprint_hashes(fp), other, assume_unique=True).size)


def _evaluated(task: Any, samples: list[Any], tokenizer: Any, fp: dict[str, Any]) -> np.ndarray | None:
    """The task's evaluated text as kept shingles, computed once per task, samples and settings."""
    key = (id(samples), len(samples), fp["shingle_words"], fp["keep_one_in"])
    cache = task.__dict__.setdefault("_overlap_cache", {})
    if key not in cache:
        texts = task.evaluated_texts(samples, tokenizer)
        cache[key] = None if texts is None else shingle_hashes(texts, fp["shingle_words"], fp["keep_one_in"])[0]
    return cache[key]


def check_method(method: Any, task: Any, samples: list[Any], tokenizer: Any) -> dict[str, Any] | None:
    """Refuses (``CalibrationOverlapError``) a run whose method was calibrated on text that the task evaluates,
    or whose calibration file records no fingerprint to check it by.  Returns None for a method with no
    calibration text, else {"checked": bool, "shared": int | None} (a task that cannot give its evaluated text,
    lm_eval, is not checked: a warning says so)."""
    cal = method.calibration_text()
    if cal is None:
        return None
    task_name = task.config.name or task.name
    fp = cal.fingerprint
    if fp is None or fp.get("scheme") != SCHEME:
        got = "no fingerprint of its text" if fp is None else f"a fingerprint of another scheme ({fp.get('scheme')!r})"
        raise CalibrationOverlapError(
            f"{cal.label} ({cal.description}) records {got}, so whether it overlaps the text task={task_name} "
            f"evaluates cannot be checked; make it again: {cal.fix}"
        )
    evaluated = _evaluated(task, samples, tokenizer, fp)
    if evaluated is None:
        log.warning(
            "task=%s gives no evaluated text: %s was not checked against it (see sparse_eval.identity.overlap)",
            task_name,
            cal.label,
        )
        return {"checked": False, "shared": None}
    shared = int(np.intersect1d(fingerprint_hashes(fp), evaluated, assume_unique=True).size)
    if shared >= MIN_SHARED:
        raise CalibrationOverlapError(
            f"{cal.label} was calibrated on {cal.description}, which shares text with what task={task_name} "
            f"evaluates ({shared} of its {fp['kept']} sampled {fp['shingle_words']}-word shingles, about "
            f"{shared * fp['keep_one_in']} words in common): calibration text must be disjoint from evaluated text. "
            f"Fix: {cal.fix}"
        )
    return {"checked": True, "shared": shared}
