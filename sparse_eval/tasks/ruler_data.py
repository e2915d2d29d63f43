"""RULER's 13 synthetic tasks (Hsieh et al., "RULER: What's the Real Context Size of Your Long-Context Language
Models?", 2024), generated locally with the model's own tokenizer.  Written from the definitions in NVIDIA/RULER
(``scripts/synthetic.yaml``, ``scripts/data/synthetic/{constants,niah,variable_tracking,common_words_extraction,
freq_words_extraction,qa}.py``, ``scripts/data/prepare.py``); no code of theirs is used, and neither nemo nor
nltk is needed.

Prompt = [model chat template around] task template (context and query filled in) + answer prefix.  The
answer prefix goes after the chat template's assistant header, as ``prepare.py`` appends it to the model
template.  Every prompt is sized to the target ``length``:

    len(prompt token ids, BOS and chat tokens included) + tokens_to_generate <= length          (fit rule)

and the haystack (essay words, noise sentences, distractor needles, list words, coded words, documents) is as
large as fits: RULER binary-searches the haystack size on one probe example, keeps that size for every sample
and drops it by a fixed step (500 essay words, 25 sentences, 10 documents) when a sample overshoots.  We search
the probe the same way, then every sample on its own: its size ``n`` fits, and either the room left is under
one step's worth of tokens or ``fill_tolerance(length)`` (max(32, 0.05% of the length)), or ``n + step`` was
seen not to fit (``step`` = 1 unit, except fwe, whose grid is RULER's ``max_len // 32`` words).  The search is a
secant search on token counts started from the probe's line (qa: from each sample's own estimate from cached
per-document counts), with all samples of a subtask tokenized together in batches: about one full
tokenization per sample, never dozens.  RULER counts tokens without BOS (``tokenizer.tokenize``) while the model then
gets BOS; we count the ids the model actually gets, so prompt + generation never exceeds ``length``.

Per subtask (``SUBTASKS``; RULER's ``synthetic.yaml``) -- kind, haystack, needle key/value types, counts:

    niah_single_1    niah  noise   words/numbers   k=1 v=1 q=1        niah_multikey_1  niah essay  words/numbers k=4
    niah_single_2    niah  essay   words/numbers   k=1 v=1 q=1        niah_multikey_2  niah needle words/numbers
    niah_single_3    niah  essay   words/uuids     k=1 v=1 q=1        niah_multikey_3  niah needle uuids/uuids
    niah_multivalue  niah  essay   words/numbers   v=4                niah_multiquery  niah essay  words/numbers q=4
    vt   variable tracking, noise haystack, 1 chain of 4 hops, one in-context example (at most 500 tokens)
    cwe  common words: 10 words x30 among others x3 (x6/x1 and a smaller example below length 4096), 1 example
    fwe  frequent coded words: 6-letter words with Zipf(alpha=2) counts, vocabulary length // 50, top-3 asked
    qa_1 SQuAD v2 dev (answerable questions, in file order) among distractor paragraphs (same article first)
    qa_2 HotpotQA distractor dev among distractor paragraphs

``tokens_to_generate``: niah 128, vt 30, cwe 120, fwe 50, qa 32.  Metric: ``string_match_all`` except qa
(``string_match_part``), see ``sparse_eval.metrics.ruler``.

Where we differ from NVIDIA/RULER (none of it changes what a sample asks; each is noted where it is done):
  * sentence splitting of the essay (for needle depths) is a rule-based splitter instead of nltk punkt;
  * the constant-seed shuffles (``random.Random(seed).shuffle``) of needles / word lists are per-sample shuffles;
  * cwe above 8,166 distinct words (wonderwords' nouns+adjectives+verbs; reached only past ~96K tokens with
    Llama-3-like tokenizers) adds adjective-noun compounds instead of RULER's ``english_words.json``;
  * the MagicPIG repo vendored an older RULER: the same templates except vt's answer prefix ("assgined") and
    vt's noise joined with spaces, and a linear (500-word / 25-sentence) size search instead of the binary one.
    ``niah_single_1``'s haystack was called "repeat" there (the same sentence as "noise"); ``repeat`` is
    accepted as a name for ``noise``.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import math
import random
import re
import string
import uuid
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Generator, Sequence

import numpy as np

# ------------------------------------------------------------------------------------------------------------
# Facts from RULER: task templates, answer prefixes, generation lengths, metrics (scripts/data/synthetic/
# constants.py, scripts/eval/synthetic/constants.py), and the subtask table (scripts/synthetic.yaml).
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    tokens_to_generate: int
    template: str  # fields: {context}, {query} and per kind {type_needle_v} / {num_v}
    answer_prefix: str
    metric: str


KINDS: dict[str, Kind] = {
    "niah": Kind(
        128,
        "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the {type_needle_v} afterwards.\n{context}\nWhat are all the special magic "
        "{type_needle_v} for {query} mentioned in the provided text?",
        " The special magic {type_needle_v} for {query} mentioned in the provided text are",
        "string_match_all",
    ),
    "variable_tracking": Kind(
        30,
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables are "
        "assigned the value {query}, they are: ",
        "string_match_all",
    ),
    "common_words_extraction": Kind(
        120,
        "Below is a numbered list of words. In these words, some appear more often than others. Memorize the "
        "ones that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?",
        " Answer: The top 10 words that appear most often in the list are:",
        "string_match_all",
    ),
    "freq_words_extraction": Kind(
        50,
        "Read the following coded text and track the frequency of each coded word. Find the three most "
        "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the "
        "dots '....'. What are the three most frequently appeared words in the above coded text?",
        " Answer: According to the coded text above, the three most frequently appeared words are:",
        "string_match_all",
    ),
    "qa": Kind(
        32,
        "Answer the question based on the given documents. Only give me the answer and do not output any other "
        "words.\n\nThe following are given documents.\n\n{context}\n\nAnswer the question based on the given "
        "documents. Only give me the answer and do not output any other words.\n\nQuestion: {query}",
        " Answer:",
        "string_match_part",
    ),
}


@dataclass(frozen=True)
class Spec:
    kind: str
    args: dict[str, Any]


def _niah(haystack: str, k: str, v: str, num_k: int = 1, num_v: int = 1, num_q: int = 1) -> Spec:
    return Spec("niah", dict(haystack=haystack, type_k=k, type_v=v, num_k=num_k, num_v=num_v, num_q=num_q))


SUBTASKS: dict[str, Spec] = {
    "niah_single_1": _niah("noise", "words", "numbers"),
    "niah_single_2": _niah("essay", "words", "numbers"),
    "niah_single_3": _niah("essay", "words", "uuids"),
    "niah_multikey_1": _niah("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": _niah("needle", "words", "numbers"),
    "niah_multikey_3": _niah("needle", "uuids", "uuids"),
    "niah_multivalue": _niah("essay", "words", "numbers", num_v=4),
    "niah_multiquery": _niah("essay", "words", "numbers", num_q=4),
    "vt": Spec("variable_tracking", dict(haystack="noise", num_chains=1, num_hops=4)),
    "cwe": Spec("common_words_extraction", dict(freq_cw=30, freq_ucw=3, num_cw=10, num_fewshot=1)),
    "fwe": Spec("freq_words_extraction", dict(alpha=2.0, coded_wordlen=6, vocab_size=-1)),
    "qa_1": Spec("qa", dict(dataset="squad")),
    "qa_2": Spec("qa", dict(dataset="hotpotqa")),
}
SUBTASK_NAMES: tuple[str, ...] = tuple(SUBTASKS)
HAYSTACKS = ("essay", "noise", "needle")
HAYSTACK_ALIASES = {"repeat": "noise"}  # the MagicPIG-vendored RULER's name for the noise haystack

NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
DOCUMENT = "Document {i}:\n{document}"
# needle depths (percent): np.round(np.linspace(0, 100, 40)).astype(int); Python's round is also half-to-even
DEPTHS = [int(round(i * 100 / 39)) for i in range(40)]
# a sample's prompt may stop short of the budget by less than one haystack step or FILL_TOLERANCE tokens, the
# larger of 32 and 0.05% of the length (RULER itself keeps the probe example's size for every sample and drops
# 500 essay words / 25 sentences / 10 documents when one overshoots)
FILL_TOLERANCE_MIN, FILL_TOLERANCE_FRACTION = 32, 0.0005


def fill_tolerance(length: int) -> float:
    return max(FILL_TOLERANCE_MIN, FILL_TOLERANCE_FRACTION * length)


VT_ICL_MAX_TOKENS = 500  # the in-context example of vt is sized to at most 500 tokens (no template, no BOS)
CWE_SMALL_BELOW = 4096  # below this length cwe uses x6 / x1 repeats and a 20-word example (else 30/3, 40 words)

ESSAY_FILE = "paul-graham-essays/PaulGrahamEssays.json"
SQUAD_FILE = "squad-v2-dev-half/dev-v2.0.json"
HOTPOTQA_FILE = "hotpotqa-dev-sample/hotpotqa_100.json"
HUB = {
    "squad": ("rajpurkar/squad_v2", None, "validation"),
    "hotpotqa": ("hotpotqa/hotpot_qa", "distractor", "validation"),
}


def tokens_to_generate(subtask: str) -> int:
    return KINDS[SUBTASKS[subtask].kind].tokens_to_generate


def metric_name(subtask: str) -> str:
    return KINDS[SUBTASKS[subtask].kind].metric


def check_subtasks(names: Sequence[str]) -> list[str]:
    names = list(names)
    bad = [n for n in names if n not in SUBTASKS]
    if bad:
        raise ValueError(f"unknown RULER subtask(s) {bad}; valid: {list(SUBTASK_NAMES)}")
    if not names:
        raise ValueError(f"task.subtasks is empty; valid: {list(SUBTASK_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"task.subtasks lists a subtask twice: {names}")
    return names


def haystack_of(subtask: str, override: str | None) -> str | None:
    """The haystack a niah subtask uses: RULER's, or ``override`` in place of the essay haystack."""
    spec = SUBTASKS[subtask]
    if spec.kind != "niah":
        return spec.args.get("haystack")
    h = spec.args["haystack"]
    return override if (h == "essay" and override) else h


def sample_seed(seed: int, subtask: str, index: int) -> int:
    """A sample's random stream depends only on (seed, subtask, index): stable whatever else is generated."""
    return int.from_bytes(hashlib.sha256(f"ruler/{seed}/{subtask}/{index}".encode()).digest()[:8], "little")


# ------------------------------------------------------------------------------------------------------------
# Resources: word lists (wonderwords' bundled lists), the essay haystack, the QA data sets.
# ------------------------------------------------------------------------------------------------------------


@lru_cache(maxsize=None)
def wonderwords_list(kind: str) -> tuple[str, ...]:
    """wonderwords' bundled ``{noun,adjective,verb}list.txt`` (what RULER reads through wonderwords)."""
    try:
        from importlib.resources import files

        text = (files("wonderwords") / "assets" / f"{kind}list.txt").read_text(encoding="utf-8")
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "RULER needs the word lists of the `wonderwords` package: pip install wonderwords"
        ) from None
    return tuple(w.strip() for w in text.splitlines() if w.strip())


@lru_cache(maxsize=None)
def niah_word_parts() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """RULER's needle "words" are ``f"{adjective}-{noun}"`` drawn uniformly from all such pairs; drawing the
    adjective and the noun uniformly from the deduplicated lists is the same distribution without building
    the 6.2M-entry list."""
    return tuple(sorted(set(wonderwords_list("adjective")))), tuple(sorted(set(wonderwords_list("noun"))))


@lru_cache(maxsize=None)
def cwe_words() -> tuple[str, ...]:
    return tuple(sorted(set(wonderwords_list("noun") + wonderwords_list("adjective") + wonderwords_list("verb"))))


_ABBREV = {
    "mr.",
    "mrs.",
    "ms.",
    "dr.",
    "prof.",
    "sr.",
    "jr.",
    "st.",
    "vs.",
    "etc.",
    "inc.",
    "ltd.",
    "co.",
    "corp.",
    "no.",
    "fig.",
    "al.",
    "approx.",
    "cf.",
    "ed.",
    "eds.",
    "vol.",
    "p.",
    "pp.",
    "mt.",
    "gen.",
}
_BOUNDARY = re.compile(r"[.!?][\"')\]]* (?=[\"'(\[]?[A-Z0-9])")
_INITIALS = re.compile(r"(?:[A-Za-z]\.)+")


def sentence_ends(words: Sequence[str]) -> list[int]:
    """Word indices after which a sentence ends (exclusive ends, the last one ``len(words)``).  A rule-based
    stand-in for nltk's punkt (RULER's ``sent_tokenize``): a sentence ends at a word ending in . ! or ?
    (closing quotes/brackets allowed) followed by a word starting with a capital, a digit or an opening
    quote/bracket, unless the word is a common abbreviation or initials (``U.S.``, ``J.``)."""
    text = " ".join(words)
    spaces = np.flatnonzero(np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32) == ord(" "))
    ends = []
    for m in _BOUNDARY.finditer(text):
        space = m.end() - 1
        start = text.rfind(" ", 0, m.start()) + 1
        word = text[start:space].rstrip("\"')]")
        if word.lower() in _ABBREV or _INITIALS.fullmatch(word):
            continue
        ends.append(int(np.searchsorted(spaces, space)) + 1)  # words before this space
    if not ends or ends[-1] != len(words):
        ends.append(len(words))
    return ends


class Essay:
    """RULER's essay haystack: the essays with whitespace runs collapsed, split on single spaces into words;
    ``n`` units = the first ``n`` words (the list repeated when ``n`` exceeds it)."""

    def __init__(self, text: str):
        self.words = re.sub(r"\s+", " ", text).split(" ")
        self.ends = sentence_ends(self.words)

    def sentences(self, n: int) -> list[str]:
        words, ends = self.words, self.ends
        if n > len(words):
            reps = -(-n // len(words))
            words = (self.words * reps)[:n]
            ends = sentence_ends(words)
        else:
            ends = ends[: bisect.bisect_left(ends, n)] + [n]
        # RULER splits " ".join(words[:n]).strip(); empty words (from leading whitespace) vanish in the join
        out, start = [], 0
        for e in ends:
            if e > start:
                s = " ".join(words[start:e]).strip()
                if s:
                    out.append(s)
            start = e
        return out


@lru_cache(maxsize=4)
def load_essay(path: str) -> Essay:
    p = Path(path)
    text = p.read_text(encoding="utf-8")
    if p.suffix == ".json":
        text = json.loads(text)["text"]
    return Essay(text)


def read_squad(data: dict[str, Any]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_squad``: documents = sorted unique paragraphs; one item per answerable question, in file
    order, with its paragraph and the other paragraphs of the same article (the first distractors)."""
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        article = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            own = index[p["context"]]
            for q in p["qas"]:
                if not q.get("is_impossible", not q["answers"]):
                    qas.append(
                        {
                            "query": q["question"],
                            "outputs": [a["text"] for a in q["answers"]],
                            "context": [own],
                            "more_context": [i for i in article if i != own],
                        }
                    )
    return qas, docs


def read_hotpotqa(data: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """RULER's ``read_hotpotqa``: documents = sorted unique ``title\\nparagraph``; each question's own 10
    paragraphs (gold + HotpotQA's distractors) are always in its context."""

    def doc(t: str, p: Sequence[str]) -> str:
        return f"{t}\n{''.join(p)}"

    docs = sorted({doc(t, p) for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[doc(t, p)] for t, p in d["context"]],
            "more_context": [],
        }
        for d in data
    ]
    return qas, docs


def _squad_from_hub(rows: Any) -> dict[str, Any]:
    """Rows of the hub's ``squad_v2`` (id, title, context, question, answers{text}) in the official schema."""
    articles: dict[str, dict[str, Any]] = {}
    for r in rows:
        art = articles.setdefault(r["title"], {"title": r["title"], "paragraphs": []})
        if not art["paragraphs"] or art["paragraphs"][-1]["context"] != r["context"]:
            art["paragraphs"].append({"context": r["context"], "qas": []})
        texts = list(r["answers"]["text"])
        art["paragraphs"][-1]["qas"].append(
            {"question": r["question"], "answers": [{"text": t} for t in texts], "is_impossible": not texts}
        )
    return {"data": list(articles.values())}


def _hotpot_from_hub(rows: Any) -> list[dict[str, Any]]:
    return [
        {
            "question": r["question"],
            "answer": r["answer"],
            "context": [[t, list(s)] for t, s in zip(r["context"]["title"], r["context"]["sentences"])],
        }
        for r in rows
    ]


@lru_cache(maxsize=4)
def _load_qa_file(dataset: str, path: str) -> tuple[list, list, str]:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    qas, docs = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
    return qas, docs, path


def _qa_local(dataset: str, path: str | None, data_dir: Path | None) -> Path | None:
    """Where ``load_qa`` looks for ``dataset``'s file: ``task.<dataset>_path``, else under ``paths.data_dir``."""
    if path:
        return Path(path).expanduser()
    return data_dir / (SQUAD_FILE if dataset == "squad" else HOTPOTQA_FILE) if data_dir else None


def _qa_missing(dataset: str, local: Path | None) -> FileNotFoundError:
    opt = "squad_path" if dataset == "squad" else "hotpotqa_path"
    return FileNotFoundError(
        f"RULER {dataset} data not found at {local if local else '(paths.data_dir unset)'}; set task.{opt} "
        f"or paths.data_dir (with {SQUAD_FILE if dataset == 'squad' else HOTPOTQA_FILE}), or task.qa_source=hub"
    )


def _qa_hub(dataset: str, local: Path | None) -> tuple[str, Any, str, tuple[str, Any, str]]:
    """(hub id, config, split, (what, expected, fix)) for a QA set: the last three are ``from_hub``'s message."""
    hub_id, cfg, split = HUB[dataset]
    sub = "qa_1" if dataset == "squad" else "qa_2"
    what = f"RULER {sub} ({dataset})"
    expected = local if local is not None else f"<paths.data_dir>/{SQUAD_FILE if dataset == 'squad' else HOTPOTQA_FILE}"
    opt = "squad_path" if dataset == "squad" else "hotpotqa_path"
    fix = f"or task.{opt}=<that JSON file>, or leave {sub} out of task.subtasks"
    return hub_id, cfg, split, (what, expected, fix)


def check_qa(
    subtasks: Sequence[str], squad_path: str | None, hotpotqa_path: str | None, data_dir: Path | None, source: str
) -> None:
    """Refuse at start a QA subtask whose data ``load_qa`` could not get: its file is missing where it must be
    local (``task.qa_source=local``, or a ``task.*_path`` given), or it would come from the hub and ``datasets``
    is not installed.  (Whether the hub answers is only known when it is asked.)"""
    import importlib.util

    from .base import DataNotFoundError

    for name in subtasks:
        if SUBTASKS[name].kind != "qa":
            continue
        dataset = SUBTASKS[name].args["dataset"]
        path = squad_path if dataset == "squad" else hotpotqa_path
        local = _qa_local(dataset, path, data_dir)
        if source in ("auto", "local") and local is not None and local.exists():
            continue
        if source == "local" or (path and source == "auto"):
            raise _qa_missing(dataset, local)
        if importlib.util.find_spec("datasets") is None:
            hub_id, _, _, (what, expected, fix) = _qa_hub(dataset, local)
            raise DataNotFoundError(
                f"{what}: no local copy (expected {expected}) and the hub ({hub_id}) needs the `datasets` package, "
                f"which is not installed. Put the file there or set paths.data_dir=<folder holding it>; {fix}"
            )


def load_qa(dataset: str, path: str | None, data_dir: Path | None, source: str) -> tuple[list, list, str]:
    """(qas, docs, origin).  ``source``: auto (``path``, else the file under ``paths.data_dir``, else the hub),
    local, hub."""
    local = _qa_local(dataset, path, data_dir)
    if source in ("auto", "local") and local is not None and local.exists():
        return _load_qa_file(dataset, str(local))
    elif source == "local" or (path and source == "auto"):
        raise _qa_missing(dataset, local)
    else:
        from .base import from_hub

        hub_id, cfg, split, (what, expected, fix) = _qa_hub(dataset, local)
        with from_hub(what, hub_id, expected, fix):
            import datasets

            rows = datasets.load_dataset(hub_id, cfg, split=split)
        data = _squad_from_hub(rows) if dataset == "squad" else _hotpot_from_hub(rows)
        origin = f"hub:{hub_id}" + (f"/{cfg}" if cfg else "") + f":{split}"
    qas, docs = read_squad(data) if dataset == "squad" else read_hotpotqa(data)
    return qas, docs, origin


# ------------------------------------------------------------------------------------------------------------
# Prompt assembly and tokenization.
# ------------------------------------------------------------------------------------------------------------


@dataclass
class Parts:
    """One prompt before the model template: the final user turn is ``pre + context + post``; ``before`` is
    text placed ahead of that turn (cwe's worked example, already templated)."""

    pre: str
    context: str
    post: str
    answer_prefix: str
    before: str = ""


def _squash(text: str) -> str:  # RULER's --remove_newline_tab
    return " ".join(text.replace("\n", " ").replace("\t", " ").strip().split())


class Prompter:
    """Wraps a user turn in the tokenizer's chat template (``apply_chat_template``, generation prompt on) or
    leaves it plain, appends the answer prefix, tokenizes.

    Plain prompts are tokenized with the tokenizer's special tokens (BOS), as RULER's HF model wrapper does
    (``tokenizer(prompt)``).  Templated prompts spell their special tokens, so they are tokenized without
    adding any, and BOS is prepended only where the tokenizer normally adds one and the template did not.
    """

    SENTINEL = "\u0000RULER-USER-TURN\u0000"

    def __init__(self, tokenizer: Any, chat_template: bool, remove_newline_tab: bool = False):
        self.tok = tokenizer
        self.remove_newline_tab = remove_newline_tab
        self.chat = bool(chat_template and getattr(tokenizer, "chat_template", None))
        self.fast = bool(getattr(tokenizer, "is_fast", False))
        self.bos = getattr(tokenizer, "bos_token_id", None)
        probe = tokenizer("a", add_special_tokens=True)["input_ids"]
        self.adds_bos = self.bos is not None and bool(probe) and probe[0] == self.bos
        self.head = self.tail = ""
        self.trim = False
        if self.chat:
            rendered = self._render(f" {self.SENTINEL} ")
            i = rendered.index(self.SENTINEL)
            j = i + len(self.SENTINEL)
            self.trim = not (rendered[i - 1 : i] == " " and rendered[j : j + 1] == " ")
            self.head, self.tail = (rendered[:i], rendered[j:]) if self.trim else (rendered[: i - 1], rendered[j + 1 :])
            check = "Check: the template\nkeeps the text."
            if self._render(check) != self.head + check + self.tail:
                raise ValueError(
                    "the tokenizer's chat template does not keep a user message verbatim; use task.chat_template=false"
                )
        self.backend = self._backend()

    def _render(self, user: str) -> str:
        return self.tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )

    def wrap(self, user: str) -> tuple[str, int]:
        """(templated turn, offset of the user text in it)."""
        if not self.chat:
            return user, 0
        if self.trim:
            lead = len(user) - len(user.lstrip())
            return self.head + user.strip() + self.tail, len(self.head) - lead
        return self.head + user + self.tail, len(self.head)

    def assemble(self, parts: Parts) -> tuple[str, int]:
        """(full prompt text, character offset where the question part starts: the text after the context)."""
        user = parts.pre + parts.context + parts.post
        prefix = parts.answer_prefix
        if self.remove_newline_tab:
            user, post = _squash(user), _squash(parts.post)
            q_in_user = len(user) - len(post) if post and user.endswith(post) else len(user)
            prefix = (" " if prefix.startswith(" ") else "") + _squash(prefix) + (" " if prefix.endswith(" ") else "")
        else:
            q_in_user = len(parts.pre) + len(parts.context)
        turn, offset = self.wrap(user)
        text = parts.before + turn + prefix
        return text, len(parts.before) + offset + q_in_user

    def _backend(self) -> Any:
        """The Rust tokenizer when it gives the same ids as the Python wrapper (then batches run on all cores
        and nothing is converted to Python lists until a prompt is kept), else None."""
        be = getattr(self.tok, "backend_tokenizer", None) if self.fast else None
        if be is None:
            return None
        probe = "Check: 12 words.\nWhat are\tthey?  " + self.head + "Done" + self.tail
        for add in (True, False):
            if be.encode(probe, add_special_tokens=add).ids != list(
                self.tok(probe, add_special_tokens=add)["input_ids"]
            ):
                return None
        return be

    def encode(self, texts: list[str]) -> list[Any]:
        """Encodings of full prompts (opaque; ``count`` and ``finish`` read them)."""
        add = not self.chat
        if self.backend is not None:
            return self.backend.encode_batch(texts, add_special_tokens=add)
        return [list(self.tok(t, add_special_tokens=add, verbose=False)["input_ids"]) for t in texts]

    def count(self, enc: Any) -> int:
        """Prompt tokens, BOS included."""
        if self.backend is not None:
            return len(enc) + (1 if self.chat and self.adds_bos and self._needs_bos(enc.ids) else 0)
        return len(enc) + (1 if self._needs_bos(enc) else 0)

    def finish(self, enc: Any, text: str, q: int) -> tuple[np.ndarray, int]:
        """(token ids as int32, context length = tokens before the one holding character ``q``)."""
        ids = enc.ids if self.backend is not None else enc
        extra = 1 if self._needs_bos(ids) else 0
        arr = np.empty(len(ids) + extra, dtype=np.int32)
        if extra:
            arr[0] = self.bos
        arr[extra:] = ids
        if self.backend is not None:
            ctx = None
            for c in range(q, len(text)):  # the first question character that a token covers
                ctx = enc.char_to_token(c)
                if ctx is not None:
                    break
            ctx = len(ids) if ctx is None else ctx
        else:
            pre = self.tok(text[:q], add_special_tokens=not self.chat, verbose=False)["input_ids"]
            ctx = len(pre)
        return arr, max(1, min(ctx + extra, len(arr) - 1))

    def encode_one(self, text: str, q: int) -> tuple[np.ndarray, int]:
        return self.finish(self.encode([text])[0], text, q)

    def _needs_bos(self, ids: Sequence[int]) -> bool:
        return self.chat and self.adds_bos and (not ids or ids[0] != self.bos)

    def count_plain(self, text: str) -> int:
        """Tokens of a text without special tokens (RULER's ``text_to_tokens``), for the vt example's budget."""
        return len(self.tok(text, add_special_tokens=False, verbose=False)["input_ids"])

    def count_many(self, texts: Sequence[str]) -> list[int]:
        """Tokens of each text alone, without special tokens (batched)."""
        if self.backend is not None:
            return [len(e) for e in self.backend.encode_batch(list(texts), add_special_tokens=False)]
        return [self.count_plain(t) for t in texts]


# ------------------------------------------------------------------------------------------------------------
# The size search.
# ------------------------------------------------------------------------------------------------------------


class TooShort(Exception):
    def __init__(self, units: int, tokens: int):
        super().__init__(units, tokens)
        self.units, self.tokens = units, tokens


def largest_fit(
    budget: int,
    lo: int,
    step: int,
    start: int | None = None,
    slope: float | None = None,
    prove: bool = True,
    tol: float = 0.0,
) -> Generator[int, int, tuple[int, int, float]]:
    """A coroutine: yields haystack sizes ``n`` on the grid ``lo + k*step`` (k >= 0), is sent their token count,
    and returns ``(n, count(n), slope)``: the largest size that fits, ``count(n) <= budget``.

    ``prove=True`` (the probe): also ``count(n + step) > budget`` was seen (local maximality: counts grow with
    ``n`` up to tokenization noise).  ``prove=False`` (each sample, started near the probe's size with the
    probe's tokens-per-unit ``slope``): a fitting ``n`` is also accepted when the room left is under one step's
    worth of tokens at the given slope or under ``tol`` tokens (``budget - count(n) < max(slope * step, tol)``):
    RULER's per-sample rule (keep the probe's size unless the sample overshoots) made tighter.
    Secant steps on (n, count); bisection once the secant stalls.
    Raises ``TooShort`` when ``lo`` does not fit."""
    seen: dict[int, int] = {}
    order: list[int] = []
    accept_unit = (slope or 0.0) * step  # the given tokens per step decide acceptance (the running secant moves)

    def align(n: float) -> int:
        return lo + max(0, math.floor((n - lo) / step)) * step

    if slope is None:  # two points first: the smallest haystack, then `start` (or 16 steps up)
        t0 = yield lo
        seen[lo] = t0
        order.append(lo)
        if t0 > budget:
            raise TooShort(lo, t0)
        n = align(start) if start is not None and align(start) > lo else lo + 16 * step
    else:
        n = align(start if start is not None else lo)
    for it in range(200):
        if n not in seen:
            seen[n] = yield n
            order.append(n)
        over = [m for m in seen if seen[m] > budget]
        bad = min(over) if over else None
        fits = [m for m in seen if seen[m] <= budget and (bad is None or m < bad)]
        good = max(fits) if fits else None
        # slope: secant through the bracket, else through the two latest points
        pts = (good, bad) if good is not None and bad is not None else tuple(order[-2:])
        if len(pts) == 2 and pts[0] != pts[1]:
            s = (seen[pts[1]] - seen[pts[0]]) / (pts[1] - pts[0])
            if s > 0:
                slope = s
        unit = max(slope or 1.0, 1e-6) * step
        if good is not None and (
            (bad is not None and bad - good <= step) or (not prove and budget - seen[good] < max(accept_unit, tol))
        ):
            if lo in seen and good > lo:  # report the mean tokens per unit over the whole range searched
                slope = (seen[good] - seen[lo]) / (good - lo)
            return good, seen[good], slope or 1.0
        if good is None:  # everything tried is too long: go down
            if bad == lo:
                raise TooShort(lo, seen[lo])
            n = max(lo, min(bad - step, align(bad - math.ceil((seen[bad] - budget) / unit) * step)))
        elif bad is None:  # everything tried fits: go up (at least one step)
            n = good + max(1, math.floor((budget - seen[good]) / unit)) * step
        else:
            k_max = (bad - good) // step - 1
            k = math.floor((budget - seen[good]) / unit)
            if it >= 8:  # the secant stalls on very uneven counts: bisect
                k = max(1, k_max // 2)
            n = good + min(max(1, k), k_max) * step
    raise RuntimeError("RULER size search did not converge")  # pragma: no cover


# ------------------------------------------------------------------------------------------------------------
# The subtask generators: draw(rng) makes every random choice that does not depend on the haystack size;
# compose(state, n) builds the prompt parts for n haystack units (its own size-dependent draws come from a
# seed drawn in draw(), so compose is a pure function of (state, n)).
# ------------------------------------------------------------------------------------------------------------


@dataclass
class State:
    answers: list[str]
    seed: int
    lo: int
    extra: dict[str, Any] = field(default_factory=dict)


class Generator_:
    unit = "units"

    def __init__(self, name: str, length: int, resources: "Resources"):
        self.name = name
        self.spec = SUBTASKS[name]
        self.kind = KINDS[self.spec.kind]
        self.length = length
        self.res = resources
        self.step = 1
        self.start: int | None = None

    def draw(self, rng: random.Random, index: int) -> State:  # pragma: no cover - abstract
        raise NotImplementedError

    def compose(self, state: State, n: int) -> Parts:  # pragma: no cover - abstract
        raise NotImplementedError

    def prepare(self, prompter: Prompter) -> None:
        """Per-subtask work that needs the tokenizer (vt's in-context example)."""


def _random_value(rng: random.Random, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        adjs, nouns = niah_word_parts()
        return f"{rng.choice(adjs)}-{rng.choice(nouns)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"needle type {kind!r}; valid: ['numbers', 'words', 'uuids']")


class NIAH(Generator_):
    def __init__(self, name, length, resources):
        super().__init__(name, length, resources)
        a = self.spec.args
        self.haystack = haystack_of(name, resources.haystack)
        self.unit = {"essay": "essay words", "noise": "noise sentences", "needle": "distractor needles"}[self.haystack]
        self.num_k = max(a["num_k"], a["num_q"])  # RULER: num_needle_k = max(num_needle_k, num_needle_q)
        self.singular = a["num_q"] * a["num_v"] == 1
        tmpl, prefix = self.kind.template, self.kind.answer_prefix
        type_v = a["type_v"]
        if self.singular:  # RULER's edits of the template for a single answer

            def fix(s: str) -> str:
                return s.replace("Some", "A").replace("are all", "is").replace("are", "is").replace("answers", "answer")

            tmpl, prefix = fix(tmpl), fix(prefix)
            type_v = type_v[:-1]
        self.template, self.prefix, self.type_v_text = tmpl, prefix, type_v
        self.essay = resources.essay() if self.haystack == "essay" else None

    def draw(self, rng, index):
        a = self.spec.args
        keys, values, needles = [], [], []
        for _ in range(self.num_k):
            keys.append(_random_value(rng, a["type_k"]))
            vals = [_random_value(rng, a["type_v"]) for _ in range(a["num_v"])]
            needles += [NEEDLE.format(type_needle_v=a["type_v"], key=keys[-1], value=v) for v in vals]
            values.append(vals)
        rng.shuffle(needles)
        depths = rng.sample(DEPTHS, len(needles)) if self.haystack == "essay" else []
        picked = rng.sample(range(self.num_k), a["num_q"])
        queries = [keys[i] for i in picked]
        answers = [v for i in picked for v in values[i]]
        query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
        lo = 1 if self.haystack == "essay" else len(needles)
        return State(
            answers, rng.getrandbits(64), lo, dict(needles=needles, depths=depths, query=query, keys=set(keys))
        )

    def compose(self, state, n):
        x = state.extra
        needles = x["needles"]
        r = random.Random(state.seed)
        if self.haystack == "essay":
            sents = self.essay.sentences(n)
            cuts = [0] + sorted(int(len(sents) * (d / 100)) for d in x["depths"]) + [len(sents)]
            pieces = []
            for i in range(1, len(cuts)):
                pieces.append(" ".join(sents[cuts[i - 1] : cuts[i]]))
                if i - 1 < len(needles):
                    pieces.append(needles[i - 1])
            context = " ".join(pieces)
        else:
            if self.haystack == "noise":
                lines = [NOISE] * n
            else:
                a = self.spec.args
                lines = []
                while len(lines) < n:
                    key = _random_value(r, a["type_k"])
                    if key in x["keys"]:  # a distractor must not reuse an asked key (RULER leaves this to chance)
                        continue
                    lines.append(NEEDLE.format(type_needle_v=a["type_v"], key=key, value=_random_value(r, a["type_v"])))
            for pos, needle in zip(sorted(r.sample(range(n), len(needles)), reverse=True), needles):
                lines.insert(pos, needle)
            context = "\n".join(lines)
        pre, post = self.template.split("{context}")
        fmt = dict(type_needle_v=self.type_v_text, query=x["query"])
        return Parts(pre.format(**fmt), context, post.format(**fmt), self.prefix.format(**fmt))


class VariableTracking(Generator_):
    unit = "noise sentences"

    def __init__(self, name, length, resources):
        super().__init__(name, length, resources)
        self.hops = self.spec.args["num_hops"]
        self.chains = self.spec.args["num_chains"]
        self.icl: str | None = None

    def _chains(self, rng: random.Random, icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        letters = 3 if icl else 5
        hops = min(10, self.hops) if icl else self.hops
        names: list[str] = []
        while len(names) < (hops + 1) * self.chains:
            v = "".join(rng.choices(string.ascii_uppercase, k=letters))
            if v not in names and v != "VAR":
                names.append(v)
        groups, chains = [], []
        for i in range(0, len(names), hops + 1):
            vs = names[i : i + hops + 1]
            groups.append(vs)
            value = "12345" if icl else str(rng.randint(10000, 99998))  # np.random.randint(10000, 99999)
            chains.append([f"VAR {vs[0]} = {value}"] + [f"VAR {vs[j + 1]} = VAR {vs[j]} " for j in range(hops)])
        return groups, chains

    def _context(self, r: random.Random, chains: list[list[str]], n: int) -> str:
        lines = [NOISE] * n
        for chain in chains:
            pos = sorted(r.sample(range(len(lines)), len(chain)))
            for j, (p, link) in enumerate(zip(pos, chain)):
                lines.insert(p + j, link)
        return "\n".join(lines).replace(". \n", ".\n")

    def _text(self, value: str, context: str, hops: int) -> tuple[str, str, str]:
        pre, post = self.kind.template.split("{context}")
        fmt = dict(query=value, num_v=hops + 1)
        return pre.format(**fmt), post.format(**fmt), self.kind.answer_prefix.format(**fmt)

    def prepare(self, prompter):
        """RULER's in-context example: a vt prompt without model template, 3-letter names, value 12345, as
        much noise as fits in 500 tokens, followed by its answer; randomized for each sample."""
        rng = random.Random(sample_seed(self.res.seed, self.name, -1))
        groups, chains = self._chains(rng, icl=True)
        seed = rng.getrandbits(64)
        hops = min(10, self.hops)

        def text(n: int) -> str:
            ctx = self._context(random.Random(seed), chains, n)
            pre, post, prefix = self._text("12345", ctx, hops)
            return pre + ctx + post + prefix

        search = largest_fit(VT_ICL_MAX_TOKENS, lo=hops + 1, step=1)
        try:
            n = next(search)
            while True:
                n = search.send(prompter.count_plain(text(n)))
        except StopIteration as stop:
            n = stop.value[0]
        except TooShort:  # pragma: no cover - a 500-token budget always holds the bare example
            n = hops + 1
        self.icl = text(n) + " " + " ".join(groups[0]) + "\n"

    def _randomize_icl(self, rng: random.Random) -> str:
        icl = self.icl
        for name in icl.strip().split()[-(min(10, self.hops) + 1) :]:
            new = name
            while new == name or new == "VAR":
                new = "".join(rng.choices(string.ascii_uppercase, k=len(name)))
            icl = re.sub(rf"\b{name}\b", new, icl)
        return icl.replace("12345", str(rng.randint(10000, 99998)))

    def draw(self, rng, index):
        icl = self._randomize_icl(rng)
        groups, chains = self._chains(rng, icl=False)
        value = chains[0][0].split("=")[-1].strip()
        return State(list(groups[0]), rng.getrandbits(64), self.hops + 1, dict(icl=icl, chains=chains, value=value))

    def compose(self, state, n):
        x = state.extra
        ctx = self._context(random.Random(state.seed), x["chains"], n)
        pre, post, prefix = self._text(x["value"], ctx, self.hops)
        # RULER puts the example inside the user turn, before the task text, followed by a newline
        return Parts(x["icl"] + "\n" + pre, ctx, post, prefix)


class CommonWords(Generator_):
    unit = "distinct words"

    def __init__(self, name, length, resources):
        super().__init__(name, length, resources)
        a = self.spec.args
        self.num_cw = a["num_cw"]
        small = length < CWE_SMALL_BELOW
        self.fewshot_args = (20, 3, 1) if small else (40, 10, 3)
        self.main_repeats = (6, 1) if small else (a["freq_cw"], a["freq_ucw"])
        self.prompter: Prompter | None = None

    def prepare(self, prompter):
        self.prompter = prompter

    def _example(self, r: random.Random, common: list[str], num_words: int, rep_c: int, rep_u: int) -> str:
        """RULER's ``get_example``: ``num_words`` distinct words, the first ``num_cw`` repeated ``rep_c`` times and
        the others ``rep_u`` times, shuffled, written ``1. w 2. w ...``.  The common words are drawn apart
        (``draw``), the others uniformly from the rest: the same law as one uniform sample of ``num_words``."""
        words = cwe_words()
        taken = set(common)
        rest = [w for w in words if w not in taken]
        need = num_words - len(common)
        if need <= len(rest):
            uncommon = r.sample(rest, need)
        else:  # RULER switches to its own english_words.json here; we add adjective-noun compounds
            uncommon = r.sample(rest, len(rest))
            adjs, nouns = niah_word_parts()
            have = set(words)
            while len(uncommon) < need:
                w = f"{r.choice(adjs)}-{r.choice(nouns)}"
                if w not in have:
                    have.add(w)
                    uncommon.append(w)
        items = common * rep_c + uncommon * rep_u
        r.shuffle(items)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))

    def draw(self, rng, index):
        shots = []
        for _ in range(self.spec.args["num_fewshot"]):
            n, rc, ru = self.fewshot_args
            common = rng.sample(cwe_words(), self.num_cw)
            shots.append((self._example(rng, common, n, rc, ru), common))
        common = rng.sample(cwe_words(), self.num_cw)
        return State(common, rng.getrandbits(64), self.num_cw, dict(shots=shots))

    def compose(self, state, n):
        pre, post = self.kind.template.split("{context}")
        before = []
        for ctx, common in state.extra["shots"]:  # each example: the full templated prompt + its answer
            turn, _ = self.prompter.wrap(pre + ctx + post)
            before.append(
                turn + self.kind.answer_prefix + " " + " ".join(f"{i + 1}. {w}" for i, w in enumerate(common))
            )
        ctx = self._example(random.Random(state.seed), list(state.answers), n, *self.main_repeats)
        return Parts(pre, ctx, post, self.kind.answer_prefix, before="\n".join(before) + "\n")


def zeta(s: float) -> float:
    """Riemann zeta for s > 1 (Euler-Maclaurin with 64 terms; error < 1e-14 for s >= 1.5)."""
    if s <= 1:
        raise ValueError(f"fwe alpha={s}: the Zipf law needs alpha > 1")
    n = 64
    return (
        sum(k**-s for k in range(1, n))
        + n ** (1 - s) / (s - 1)
        + 0.5 * n**-s
        + s * n ** (-s - 1) / 12
        - s * (s + 1) * (s + 2) * n ** (-s - 3) / 720
    )


class FreqWords(Generator_):
    unit = "coded words"

    def __init__(self, name, length, resources):
        super().__init__(name, length, resources)
        a = self.spec.args
        self.alpha, self.wordlen = a["alpha"], a["coded_wordlen"]
        max_len = length - self.kind.tokens_to_generate
        self.vocab_size = max(4, max_len // 50) if a["vocab_size"] == -1 else a["vocab_size"]
        # RULER's search: start at max_len // coded_wordlen words, move by max_len // 32 words
        self.start = max(1, max_len // self.wordlen)
        self.step = max(1, max_len // 32)
        self.lo = (self.start - 1) % self.step + 1
        self.z = zeta(self.alpha)

    def draw(self, rng, index):
        vocab: set[str] = set()
        while len(vocab) < self.vocab_size:
            vocab.add("".join(rng.choices(string.ascii_lowercase, k=self.wordlen)))
        vocab_l = sorted(vocab)
        rng.shuffle(vocab_l)
        vocab_l[0] = "..."  # the top-ranked word is noise
        return State(vocab_l[1:4], rng.getrandbits(64), self.lo, dict(vocab=vocab_l))

    def compose(self, state, n):
        vocab = state.extra["vocab"]
        words = []
        for k, w in enumerate(vocab, start=1):
            words += [w] * int(n * (k**-self.alpha) / self.z)
        random.Random(state.seed).shuffle(words)
        pre, post = self.kind.template.split("{context}")
        return Parts(pre, " ".join(words), post, self.kind.answer_prefix)


class QA(Generator_):
    unit = "documents"

    def __init__(self, name, length, resources):
        super().__init__(name, length, resources)
        self.qas, self.docs, self.origin = resources.qa(self.spec.args["dataset"])

    def draw(self, rng, index):
        if index >= len(self.qas):
            raise ValueError(
                f"RULER {self.name}: sample {index} asked but {self.origin} has {len(self.qas)} "
                f"questions; lower task.num_samples or use the full data set (task.qa_source=hub)"
            )
        q = self.qas[index]  # RULER takes the questions in file order
        return State(list(q["outputs"]), rng.getrandbits(64), max(1, len(q["context"])), dict(qa=q))

    def _chosen(self, state: State, n: int) -> list[int]:
        """RULER's document choice for ``n`` documents: the question's own, then the other paragraphs of its
        article, then random others; all documents (repeated) once ``n`` reaches their number; shuffled."""
        q = state.extra["qa"]
        r = random.Random(state.seed)
        cur, more = list(q["context"]), list(q["more_context"])
        if n < len(self.docs):
            if n - len(cur) > len(more):
                taken = set(cur + more)
                pool = [i for i in range(len(self.docs)) if i not in taken]
                chosen = cur + more + r.sample(pool, max(0, n - len(cur) - len(more)))
            else:
                chosen = cur + r.sample(more, n - len(cur))
        else:
            chosen = (list(range(len(self.docs))) * -(-n // len(self.docs)))[:n]
        r.shuffle(chosen)
        return chosen

    def compose(self, state, n):
        q = state.extra["qa"]
        docs = [self.docs[i] for i in self._chosen(state, n)]
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        pre, post = self.kind.template.split("{context}")
        return Parts(pre, context, post.format(query=q["query"]), self.kind.answer_prefix)

    def prepare(self, prompter):
        """Token counts of every document alone, for ``estimate`` (one batch)."""
        self.doc_tokens = prompter.count_many(self.docs)
        self.per_doc = prompter.count_plain("\n\nDocument 10:\n")

    def estimate(self, state: State, n: int) -> float:
        """The haystack's tokens for ``n`` documents, up to a constant: sum of the documents' own counts plus
        a per-document header (the samples differ by which documents they hold, so their sizes do too)."""
        return sum(self.doc_tokens[i] for i in self._chosen(state, n)) + self.per_doc * n


GENERATORS = {
    "niah": NIAH,
    "variable_tracking": VariableTracking,
    "common_words_extraction": CommonWords,
    "freq_words_extraction": FreqWords,
    "qa": QA,
}


# ------------------------------------------------------------------------------------------------------------
# Resources and the driver.
# ------------------------------------------------------------------------------------------------------------


def needs_essay(subtasks: Sequence[str], haystack: str | None) -> list[str]:
    return [s for s in subtasks if haystack_of(s, haystack) == "essay"]


def essay_location(essay_path: str | None, data_dir: Path | None) -> Path | None:
    if essay_path:
        return Path(essay_path).expanduser()
    return data_dir / ESSAY_FILE if data_dir else None


def check_essay(subtasks: Sequence[str], haystack: str | None, essay_path: str | None, data_dir: Path | None) -> None:
    users = needs_essay(subtasks, haystack)
    if not users:
        return
    where = essay_location(essay_path, data_dir)
    if where is None or not where.exists():
        raise FileNotFoundError(
            f"RULER's essay haystack (Paul Graham essays, used by {users}) was not found: "
            f"{'looked at ' + str(where) if where else 'paths.data_dir and task.essay_path are unset'}. "
            f"Set paths.data_dir to a folder holding {ESSAY_FILE} (or task.essay_path to that JSON file), or run "
            f"with task.haystack=noise to use RULER's noise haystack instead (those subtasks then differ from "
            f"RULER's), or leave them out of task.subtasks."
        )


@dataclass
class Resources:
    seed: int
    haystack: str | None
    essay_path: str | None
    data_dir: Path | None
    squad_path: str | None = None
    hotpotqa_path: str | None = None
    qa_source: str = "auto"
    _qa: dict[str, tuple] = field(default_factory=dict)
    files: dict[str, Path] = field(default_factory=dict)  # the local files read (name -> path)

    def essay(self) -> Essay:
        where = essay_location(self.essay_path, self.data_dir)
        if where is None or not where.exists():
            check_essay(["niah_single_2"], None, self.essay_path, self.data_dir)
        self.files["essays"] = Path(where)
        return load_essay(str(where))

    def qa(self, dataset: str) -> tuple[list, list, str]:
        if dataset not in self._qa:
            path = self.squad_path if dataset == "squad" else self.hotpotqa_path
            self._qa[dataset] = load_qa(dataset, path, self.data_dir, self.qa_source)
        origin = Path(self._qa[dataset][2])
        if origin.is_file():
            self.files[dataset] = origin
        return self._qa[dataset]


@dataclass
class Generated:
    """One generated RULER sample."""

    subtask: str
    index: int
    input_ids: np.ndarray  # int32 [prompt_tokens]
    context_len: int  # tokens before the question part (protocol B's dense prefix)
    answers: list[str]
    units: int  # haystack size (essay words, noise sentences, needles, distinct words, coded words, documents)
    unit: str
    step: int
    step_tokens: float  # the probe's tokens per size step
    text: str | None = None


def generate(
    subtask: str,
    num_samples: int,
    length: int,
    prompter: Prompter,
    resources: Resources,
    keep_text: bool = False,
    batch: int = 64,
    indices: Sequence[int] | None = None,
    prove: bool = False,
) -> list[Generated]:
    """The samples ``indices`` (default ``range(num_samples)``) of one subtask, each sized to ``length``;
    ``prove``: every sample's size is shown maximal (``n + step`` tokenized and over), else the room left is
    under one step's tokens or ``fill_tolerance(length)``, or ``n + step`` was seen over (``largest_fit``)."""
    gen = GENERATORS[SUBTASKS[subtask].kind](subtask, length, resources)
    gen.prepare(prompter)
    budget = length - gen.kind.tokens_to_generate
    indices = list(range(num_samples)) if indices is None else list(indices)
    states = [gen.draw(random.Random(sample_seed(resources.seed, subtask, i)), i) for i in indices]
    # the probe is always sample 0, so that a sample depends only on (seed, subtask, index, length, tokenizer)
    probe_state = states[0] if indices[0] == 0 else gen.draw(random.Random(sample_seed(resources.seed, subtask, 0)), 0)

    def too_short(exc: TooShort) -> ValueError:
        return ValueError(
            f"task.length={length} is too short for RULER {subtask}: with the smallest haystack ({exc.units} "
            f"{gen.unit}) the prompt has {exc.tokens} tokens, and {gen.kind.tokens_to_generate} more are generated; "
            f"use a larger task.length or leave {subtask} out of task.subtasks"
        )

    def build(state: State, n: int) -> tuple[str, int]:
        return prompter.assemble(gen.compose(state, n))

    def run(searches: list, states: list[State]) -> list[tuple[int, np.ndarray, int, str]]:
        """Drives the size searches of several samples together, tokenizing each round as one batch."""
        best: dict[int, tuple[int, np.ndarray, int, str]] = {}  # the largest fitting size seen: (n, ids, ctx, text)
        results: dict[int, tuple[int, int]] = {}
        try:
            pending = {i: next(sr) for i, sr in enumerate(searches)}
            while pending:
                items = list(pending.items())
                for at in range(0, len(items), batch):
                    chunk = items[at : at + batch]
                    built = [build(states[i], n) for i, n in chunk]
                    encs = prompter.encode([t for t, _ in built])
                    for (i, n), (text, q), enc in zip(chunk, built, encs):
                        count = prompter.count(enc)
                        if count <= budget and (i not in best or n > best[i][0]):
                            best[i] = (n, *prompter.finish(enc, text, q), text if keep_text else "")
                        try:
                            pending[i] = searches[i].send(count)
                        except StopIteration as stop:
                            results[i] = stop.value
                            del pending[i]
                    del built, encs
        except TooShort as exc:
            raise too_short(exc) from None
        out = []
        for i, state in enumerate(states):
            n, count, slope = results[i]
            if best[i][0] != n:  # a larger size fitted but a smaller one was chosen (tokenization noise)
                text, q = build(state, n)
                best[i] = (n, *prompter.encode_one(text, q), text if keep_text else "")
            _, ids, ctx, text = best[i]
            assert len(ids) == count <= budget
            out.append((n, ids, ctx, text, slope))
        return out

    # the probe: the first sample searched from the smallest haystack, as RULER searches one example
    tol = 0.0 if prove else fill_tolerance(length)
    ((n0, ids0, _, _, slope),) = run(
        [largest_fit(budget, probe_state.lo, gen.step, start=gen.start, prove=prove, tol=tol)], [probe_state]
    )
    # every sample: started where the probe's line leaves a room mid-way into the accepted [0, max(step, tol))
    # (so that most samples fit at once: one tokenization), with the probe's slope, all tokenized together
    unit = slope * gen.step
    margin = max(0.0, max(unit, tol) - unit) / 2  # aim mid-way into the accepted room [0, max(unit, tol))
    starts = [n0 + math.floor((budget - margin - len(ids0)) / unit) * gen.step] * len(states)
    if hasattr(gen, "estimate"):  # samples whose haystack units differ in size (qa): start from each one's own
        base = len(ids0) - gen.estimate(probe_state, n0)  # estimate, calibrated on the probe
        starts = [
            _largest_estimate(lambda n, st=st: base + gen.estimate(st, n), budget - margin, st.lo, gen.step, n0)
            for st in states
        ]
    found = run(
        [
            largest_fit(budget, s.lo, gen.step, start=max(n, s.lo), slope=slope, prove=prove, tol=tol)
            for s, n in zip(states, starts)
        ],
        states,
    )
    return [
        Generated(
            subtask,
            idx,
            ids,
            ctx,
            list(st.answers),
            n,
            gen.unit,
            gen.step,
            slope * gen.step,
            text if keep_text else None,
        )
        for idx, st, (n, ids, ctx, text, _) in zip(indices, states, found)
    ]


def _largest_estimate(est: Callable[[int], float], target: float, lo: int, step: int, hint: int) -> int:
    """Largest grid size whose estimated count is <= target (estimates are cheap: bracket, then bisect)."""
    lo_k, hi_k = 0, max(1, (hint - lo) // step)
    while est(lo + hi_k * step) <= target:
        lo_k, hi_k = hi_k, hi_k * 2
    if est(lo + lo_k * step) > target:
        return lo
    while hi_k - lo_k > 1:
        mid = (lo_k + hi_k) // 2
        lo_k, hi_k = (mid, hi_k) if est(lo + mid * step) <= target else (lo_k, mid)
    return lo + lo_k * step


def compose_text(
    subtask: str, index: int, n: int, length: int, prompter: Prompter, resources: Resources
) -> tuple[str, int]:
    """The prompt text (and question offset) of sample ``index`` with ``n`` haystack units -- for checks."""
    gen = GENERATORS[SUBTASKS[subtask].kind](subtask, length, resources)
    gen.prepare(prompter)
    state = gen.draw(random.Random(sample_seed(resources.seed, subtask, index)), index)
    return prompter.assemble(gen.compose(state, n))
