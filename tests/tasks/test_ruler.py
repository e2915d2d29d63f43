"""RULER: generation (fit rule, answers in the context, determinism, chat template), metrics, config errors, and an
end-to-end run through the runner with the shipped model."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from sparse_eval.metrics.ruler import corpus_score, metric_fn, postprocess_pred, string_match_all, string_match_part
from sparse_eval.tasks import ruler_data as rd
from sparse_eval.tasks.ruler import Ruler, RulerConfig

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"
STORIES_DIR = REPO / "sparse_eval" / "models" / "stories260K"
SMOL_DIR = Path("~/.cache/sparse_eval/models/smollm2-135m-instruct").expanduser()
SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
needs_data = pytest.mark.skipif(not DATA.exists(), reason=f"shared data folder {DATA} not present")

# retrieval subtasks: every reference is written in the context
IN_CONTEXT = [s for s in rd.SUBTASK_NAMES if s != "qa_2"]  # HotpotQA answers may be e.g. "yes"


@pytest.fixture(scope="module")
def stories_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(STORIES_DIR)


def _llama_tok():
    if not (DATA / "llama2-tokenizer" / "tokenizer.model").exists():
        pytest.skip("llama2 tokenizer not in the shared data")
    try:
        import google.protobuf  # noqa: F401
    except ModuleNotFoundError:
        pytest.skip("transformers needs protobuf to read a SentencePiece tokenizer.model")
    from transformers import LlamaTokenizer

    return LlamaTokenizer.from_pretrained(str(DATA / "llama2-tokenizer"))


def _smol_tok():
    if not (SMOL_DIR / SMOL_GGUF).exists():
        pytest.skip(f"SmolLM2 GGUF not at {SMOL_DIR} (scripts/get_smollm2.sh)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(SMOL_DIR), gguf_file=SMOL_GGUF)


# the tokenizers under test and two lengths each that every subtask fits (stories260K's 512-token vocabulary
# spends ~2.5x the tokens of Llama's on the same text: cwe's worked example alone is ~5.3K tokens above 4096);
# one length of each is below RULER's cwe switch at 4096 where the tokenizer allows
TOKENIZERS = {
    "stories": (None, (6144, 8192)),
    "llama2": (_llama_tok, (2048, 4096)),
    "smollm2": (_smol_tok, (2048, 4096)),
}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tok_case(request, stories_tok):
    load, lengths = TOKENIZERS[request.param]
    return request.param, (stories_tok if load is None else load()), lengths


def _resources(seed=42, haystack=None):
    return rd.Resources(seed=seed, haystack=haystack, essay_path=None, data_dir=DATA)


def _fits_and_is_full(g: rd.Generated, length: int, prompter: rd.Prompter, res: rd.Resources) -> None:
    budget = length - rd.tokens_to_generate(g.subtask)
    count = len(g.input_ids)
    assert count <= budget, (g.subtask, count, budget)
    room = budget - count
    if room >= max(g.step_tokens, rd.fill_tolerance(length)):  # else: the next larger haystack must not fit
        text, _ = rd.compose_text(g.subtask, g.index, g.units + g.step, length, prompter, res)
        assert len(prompter.encode_one(text, 0)[0]) > budget, (g.subtask, g.units, room)


@needs_data
def test_every_subtask_fits_its_length(tok_case):
    """Each prompt + tokens_to_generate fits the length, as full as RULER's rule makes it; the ids are exactly
    the tokenization of the prompt text; the context/question split is where the template puts it; the
    references are in the context."""
    name, tok, lengths = tok_case
    res = _resources()
    for chat in [True] if getattr(tok, "chat_template", None) else [False]:  # plain prompts: the other tokenizers
        prompter = rd.Prompter(tok, chat_template=chat)
        for length in lengths:
            for sub in rd.SUBTASK_NAMES:
                gens = rd.generate(sub, 2, length, prompter, res, keep_text=True)
                for g in gens:
                    _fits_and_is_full(g, length, prompter, res)
                    ids = list(tok(g.text, add_special_tokens=not chat, verbose=False)["input_ids"])
                    if chat and prompter.adds_bos and ids[0] != tok.bos_token_id:
                        ids = [tok.bos_token_id, *ids]
                    assert g.input_ids.tolist() == ids, (name, sub)
                    assert 0 < g.context_len < len(ids)
                    question = tok.decode(g.input_ids[g.context_len :].tolist())
                    context = tok.decode(g.input_ids[: g.context_len].tolist())
                    marker = {
                        "niah": "special magic",
                        "variable_tracking": "Find all variables",
                        "common_words_extraction": "most common words",
                        "freq_words_extraction": "Do not provide",
                        "qa": "Question:",
                    }[rd.SUBTASKS[sub].kind]
                    assert marker in question and rd.NOISE not in question, (name, sub, question[:200])
                    if sub in IN_CONTEXT:
                        for ref in g.answers:
                            assert ref in context, (name, sub, ref)
                    if chat:  # the answer prefix follows the assistant header (RULER finds it by its first 10 chars)
                        after = g.text[g.text.rindex(prompter.tail) + len(prompter.tail) :]
                        assert after.startswith(rd.KINDS[rd.SUBTASKS[sub].kind].answer_prefix[:10]), (sub, after)


def test_prompter_chat_template_wraps_and_keeps_bos(stories_tok):
    """A Llama-3-style template (BOS text, trimmed content): the user turn is wrapped, the answer prefix follows
    the assistant header, BOS is not doubled; and a template without BOS text gets the tokenizer's BOS."""
    tok = copy.deepcopy(stories_tok)
    tok.chat_template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}"
        "<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    p = rd.Prompter(tok, chat_template=True)
    assert p.chat and p.trim and p.head == "<s><|user|>\n" and p.tail == "<|end|>\n<|assistant|>\n"
    text, q = p.assemble(rd.Parts(" Intro\n", "CONTEXT", "\nQuestion?", " Answer:"))
    assert text == "<s><|user|>\nIntro\nCONTEXT\nQuestion?<|end|>\n<|assistant|>\n Answer:"
    assert text[q:].startswith("\nQuestion?")
    ids, ctx = p.encode_one(text, q)
    assert ids.tolist() == tok(text, add_special_tokens=False)["input_ids"] and ids[0] == tok.bos_token_id
    assert "Question" not in tok.decode(ids[:ctx].tolist()) and "CONTEXT" in tok.decode(ids[:ctx].tolist())
    tok.chat_template = tok.chat_template.replace("{{ bos_token }}", "")
    p2 = rd.Prompter(tok, chat_template=True)
    ids2, _ = p2.encode_one(text[3:], q - 3)
    assert ids2[0] == tok.bos_token_id and ids2.tolist()[1:] == tok(text[3:], add_special_tokens=False)["input_ids"]
    assert not rd.Prompter(tok, chat_template=False).chat


@needs_data
def test_cwe_example_is_a_templated_turn(stories_tok):
    """RULER's cwe example is the whole templated prompt plus its answer, before the real prompt."""
    tok = copy.deepcopy(stories_tok)
    tok.chat_template = "{% for m in messages %}[U]{{ m['content'] }}[/U]{% endfor %}[A]"
    p = rd.Prompter(tok, chat_template=True)
    text, q = rd.compose_text("cwe", 0, 30, 6144, p, _resources())
    assert text.count("[U]Below is a numbered list") == 2 and text.count("[/U][A] Answer: The top 10 words") == 2
    assert text.index("1. ", text.index("[A] Answer")) > 0 and text[q:].startswith("\nQuestion: What are the 10")


@needs_data
def test_determinism_and_sample_independence(stories_tok):
    p = rd.Prompter(stories_tok, chat_template=False)
    for sub in ("niah_multikey_2", "vt", "cwe", "qa_1", "niah_single_3"):
        a = rd.generate(sub, 3, 6144, p, _resources(seed=42))
        b = rd.generate(sub, 3, 6144, p, _resources(seed=42))
        assert [g.input_ids.tolist() for g in a] == [g.input_ids.tolist() for g in b]
        assert [g.answers for g in a] == [g.answers for g in b]
        # sample 2 alone is the same as sample 2 of three: a sample depends on (seed, subtask, index) only
        (c,) = rd.generate(sub, 1, 6144, p, _resources(seed=42), indices=[2])
        assert c.input_ids.tolist() == a[2].input_ids.tolist() and c.answers == a[2].answers
        d = rd.generate(sub, 3, 6144, p, _resources(seed=7))
        assert [g.input_ids.tolist() for g in d] != [g.input_ids.tolist() for g in a]


def test_official_metric_values():
    """RULER's string_match_all / string_match_part on hand-written predictions (values worked out by hand)."""
    refs = [["1234567"], ["7654321"], ["111", "222", "333", "444"], ["ABC-def"]]
    preds = ["The special magic number is 1234567.", "I do not know", "111, 333 and 999", "abc-DEF!"]
    assert [string_match_all(p, r) for p, r in zip(preds, refs)] == [100.0, 0.0, 50.0, 100.0]
    assert corpus_score("string_match_all", preds, refs) == 62.5  # (100 + 0 + 50 + 100) / 4
    qa_refs = [["Paris", "France"], ["1066"], ["yes"]]
    qa_preds = ["It is in france.", "in 1067", "YES"]
    assert [string_match_part(p, r) for p, r in zip(qa_preds, qa_refs)] == [100.0, 0.0, 100.0]
    assert corpus_score("string_match_part", qa_preds, qa_refs) == 66.67  # rounded to 2 decimals as RULER
    assert postprocess_pred("  answer\x00 is\t here \n") == "answer\n is\n here"
    with pytest.raises(ValueError, match="valid"):
        corpus_score("exact", preds, refs)


def test_config_errors_name_the_valid_values(tmp_path):
    with pytest.raises(ValueError, match=r"niah_single_9.*valid: \['niah_single_1'"):
        Ruler(RulerConfig(subtasks=["niah_single_1", "niah_single_9"], haystack="noise"), data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="task.haystack='hay'"):
        Ruler(RulerConfig(subtasks=["vt"], haystack="hay"), data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="qa_source"):
        Ruler(RulerConfig(subtasks=["vt"], qa_source="web"), data_dir=str(tmp_path))
    task = Ruler(RulerConfig(subtasks=["niah_single_1"], length=1024), data_dir=str(tmp_path))
    with pytest.raises(ValueError, match="exceeds the model's context"):
        task.samples(None, max_context=512)


def test_missing_qa_data_is_refused_when_the_task_is_built(tmp_path, monkeypatch):
    """A QA subtask whose data cannot come is refused at start (before a model loads or samples are generated):
    a local file that must be there is not, or the hub would be asked without ``datasets`` installed."""
    from sparse_eval.tasks.base import DataNotFoundError

    with pytest.raises(FileNotFoundError, match=r"squad data not found.*task\.squad_path"):
        Ruler(RulerConfig(subtasks=["vt", "qa_1"], qa_source="local"), data_dir=str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"hotpotqa data not found at .*nowhere\.json"):
        Ruler(RulerConfig(subtasks=["qa_2"], hotpotqa_path=str(tmp_path / "nowhere.json")), data_dir=str(tmp_path))
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "datasets" else real(name, *a))
    with pytest.raises(DataNotFoundError, match=r"qa_2 \(hotpotqa\).*needs the `datasets` package.*qa_2 out of"):
        Ruler(RulerConfig(subtasks=["niah_single_1", "qa_2"], haystack="noise"), data_dir=str(tmp_path))
    # a local file is enough without datasets; subtasks without QA never look
    (tmp_path / rd.HOTPOTQA_FILE).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / rd.HOTPOTQA_FILE).write_text("[]")
    Ruler(RulerConfig(subtasks=["qa_2"]), data_dir=str(tmp_path))
    Ruler(RulerConfig(subtasks=["vt"]), data_dir=None)


def test_missing_essays_say_so_and_offer_the_noise_haystack(tmp_path, stories_tok):
    with pytest.raises(FileNotFoundError, match=r"Paul Graham essays.*task\.haystack=noise"):
        Ruler(RulerConfig(subtasks=["niah_single_1", "niah_single_2"]), data_dir=str(tmp_path))
    task = Ruler(
        RulerConfig(subtasks=["niah_single_2", "niah_multiquery"], haystack="repeat", num_samples=1, length=1024),
        data_dir=str(tmp_path),
    )
    samples = task.samples(stories_tok, max_context=1024)
    assert [s.id for s in samples] == ["niah_single_2-0000", "niah_multiquery-0000"]
    text = stories_tok.decode(samples[0].data["input_ids"].tolist())
    assert "The grass is green." in text


def test_too_short_length_is_explained(stories_tok):
    task = Ruler(RulerConfig(subtasks=["vt"], num_samples=1, length=512), data_dir=None)
    with pytest.raises(ValueError, match=r"too short for RULER vt.*smallest haystack"):
        task.samples(stories_tok, max_context=512)


def test_size_search_is_exact_on_a_known_count():
    """largest_fit against a brute-force answer on an uneven, almost-linear count."""

    def count(n):
        return 40 + 3 * n + (n * 7919) % 5  # noise 0..4 around a line

    def drive(search):
        try:
            n = next(search)
            while True:
                n = search.send(count(n))
        except StopIteration as stop:
            return stop.value

    for budget in (100, 997, 5000):
        n, c, _ = drive(rd.largest_fit(budget, lo=2, step=1))
        assert c == count(n) <= budget < count(n + 1)
        n, c, _ = drive(rd.largest_fit(budget, lo=2, step=3, start=50, slope=2.0))
        assert count(n) <= budget < count(n + 3) and (n - 2) % 3 == 0
        n, c, _ = drive(rd.largest_fit(budget, lo=2, step=1, start=10, slope=3.0, prove=False, tol=20))
        assert count(n) <= budget and (budget - count(n) < 20 or count(n + 1) > budget)
    with pytest.raises(rd.TooShort):
        drive(rd.largest_fit(45, lo=2, step=1))


def test_helpers():
    assert abs(rd.zeta(2.0) - math.pi**2 / 6) < 1e-12
    assert abs(rd.zeta(3.0) - 1.2020569031595942) < 1e-12
    words = "He met Mr. Smith in the U.S. today. Then they left! Did they? yes they did. 42 is a number.".split(" ")
    ends = rd.sentence_ends(words)
    sents = [" ".join(words[a:b]) for a, b in zip([0] + ends[:-1], ends)]
    assert sents == [
        "He met Mr. Smith in the U.S. today.",
        "Then they left!",
        "Did they? yes they did.",
        "42 is a number.",
    ]
    assert rd.DEPTHS[:4] == [0, 3, 5, 8] and rd.DEPTHS[-1] == 100 and len(rd.DEPTHS) == 40


@needs_data
def test_hub_rows_convert_to_the_official_schema():
    """The hub's squad_v2 / hotpot_qa rows, converted back, read the same as the official JSON files."""
    squad = json.loads((DATA / rd.SQUAD_FILE).read_text())
    squad["data"] = squad["data"][:2]
    rows = [
        {
            "title": a["title"],
            "context": p["context"],
            "question": q["question"],
            "answers": {"text": [x["text"] for x in q["answers"]]},
        }
        for a in squad["data"]
        for p in a["paragraphs"]
        for q in p["qas"]
    ]
    assert rd.read_squad(rd._squad_from_hub(rows)) == rd.read_squad(squad)
    hot = json.loads((DATA / rd.HOTPOTQA_FILE).read_text())[:5]
    rows = [
        {
            "question": d["question"],
            "answer": d["answer"],
            "context": {"title": [t for t, _ in d["context"]], "sentences": [s for _, s in d["context"]]},
        }
        for d in hot
    ]
    assert rd.read_hotpotqa(rd._hotpot_from_hub(rows)) == rd.read_hotpotqa(hot)


def test_end_to_end_through_the_runner(tmp_path, request):
    """task=ruler with the shipped model: 2 subtasks x 1 sample at 512 tokens (no data files needed), under the
    default protocol A and under B."""
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import CONF_DIR, register_configs
    from sparse_eval.launcher.runner import run

    register_configs()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 260K-parameter model: more threads only wait on each other (on a busy machine, a lot)
    request.addfinalizer(lambda: torch.set_num_threads(threads))
    over = [
        f"paths.runs_dir={tmp_path}",
        "task=ruler",
        "method=full",
        "task.length=512",
        "task.num_samples=1",
        "task.subtasks=[niah_single_1,fwe]",
        "eval.compute_error=false",
        "print_table=false",
    ]
    for protocol in ("null", "B"):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(config_name="config", overrides=[*over, f"eval.protocol={protocol}"])
        (summary,) = run(cfg)
        assert summary["failed"] == 0 and summary["samples"] == 2
        assert summary["protocol"] == ("A" if protocol == "null" else "B")
        m = summary["metrics"]
        assert list(m["subtask_scores"]) == ["niah_single_1", "fwe"] and m["length"] == 512
        assert summary["score"] == pytest.approx(sum(m["subtask_scores"].values()) / 2)
        recs = [json.loads(x) for x in (Path(summary["run_dir"]) / "samples.jsonl").read_text().splitlines()]
        assert [r["id"] for r in recs] == ["niah_single_1-0000", "fwe-0000"]
        for r in recs:
            gen = rd.tokens_to_generate(r["subtask"])
            assert r["prompt_tokens"] + gen <= 512 and r["length"] == 512
            assert 0 <= r["score"] <= 100 and r["generated_tokens"] <= gen
            assert r["score"] == metric_fn(rd.metric_name(r["subtask"]))(r["prediction"], r["reference"])
            assert set(r) >= {"subtask", "length", "prompt_tokens", "prediction", "reference", "score"}
