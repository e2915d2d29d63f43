"""LongBench task: metrics on hand-computed cases, middle truncation, loading, the chat-template rule, end to end."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

import pytest

from sparse_eval.metrics import longbench as M
from sparse_eval.tasks import build_task
from sparse_eval.tasks.longbench import MAX_NEW_TOKENS, PROMPTS, SUBTASKS
from sparse_eval.tasks.prompting import middle_truncate

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "longbench"
MODEL_DIR = REPO / "sparse_eval" / "models" / "stories260K"
CONF_DIR = REPO / "conf"
DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
OFFICIAL_KEYS = {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


def task(**opts):
    return build_task({"name": "longbench", "data_path": str(FIXTURES), **opts}, data_dir=None)


# ---- metrics (values computed by hand from LongBench's definitions) --------------------------------------
def test_qa_f1_hand_cases():
    # pred -> "cat sat on mat" (4 tokens), gold -> "cat on mat" (3): common 3, P = 3/4, R = 1, F1 = 6/7
    assert M.qa_f1("The cat sat on the mat.", "a cat on mat") == pytest.approx(6 / 7)
    # multiset overlap: {x:1, y:1} -> P = R = 2/3
    assert M.qa_f1("x x y", "x y y") == pytest.approx(2 / 3)
    assert M.qa_f1("Paris!", "paris") == 1.0  # case and punctuation are normalised away
    assert M.qa_f1("London", "Paris") == 0.0
    assert M.qa_f1("the", "Paris") == 0.0  # only an article: empty after normalisation
    assert M.normalize_answer("  The  U.S.A.,  an Answer ") == "usa answer"


def test_retrieval_hand_cases():
    assert M.retrieval("Paragraph 2", "Paragraph 2") == 1.0
    assert M.retrieval("Paragraph 2 or Paragraph 12", "Paragraph 2") == 0.5  # integers [2, 12]: one right of two
    assert M.retrieval("Paragraph 20", "Paragraph 2") == 0.0  # whole integers, not substrings
    assert M.retrieval("I do not know", "Paragraph 2") == 0.0  # no integer at all
    with pytest.raises(ValueError, match="Paragraph"):
        M.retrieval("1", "unknown")


def test_classification_hand_cases():
    classes = ["City", "Number", "Other number"]
    # "Number" is a proper substring of the gold "Other number": removed -> list [Other number] -> 1
    assert M.classification("Other number", "Other number", all_classes=classes) == 1.0
    # two classes named, gold among them -> 1/2
    assert M.classification("City or Other number", "City", all_classes=classes) == 0.5
    assert M.classification("Date", "City", all_classes=classes) == 0.0
    # LongBench removes while iterating: after removing "num" the list shifts and "number" is skipped, so it
    # stays: [number, Other number] -> 1/2 (a clean filter would give 1)
    assert M.classification("Other number", "Other number", all_classes=["num", "number", "Other number"]) == 0.5


def test_code_sim_hand_cases():
    assert M.first_code_line("\n# comment\n    return a * b\nfoo") == "    return a * b"
    assert M.first_code_line("```python\n// x\n") == ""
    assert M.code_sim("    return a * b", "    return a * b") == 1.0
    assert M.code_sim("", "x") == 0.0
    # difflib: "abc" matches, ratio = 2*3/8 = 0.75 -> fuzz 75
    assert M.code_sim("abcd", "abce") == 0.75
    # "itt" + "n" match: 2*4/13 = 0.615.. -> round -> 62
    assert M.code_sim("kitten", "sitting") == 0.62
    assert M.fuzz_ratio("", "") == 100  # fuzzywuzzy checks equality before emptiness


def test_score_sample_first_line_and_max_over_answers():
    classes = ["City", "Date"]
    # trec: only the first line (after leading newlines) is scored
    assert M.score_sample("trec", "\nCity\nQuestion: When?\nType: Date", ["City"], classes) == 1.0
    assert M.score_sample("triviaqa", "Paris\nLondon", ["London"]) == 0.0
    assert M.score_sample("triviaqa", "Paris", ["London", "paris"]) == 1.0  # max over the ground truths
    assert M.score_sample("lcc", "\n# c\nreturn x", ["return x"]) == 1.0  # code: first non-comment line
    with pytest.raises(ValueError, match="qasper"):
        M.score_sample("gov_report", "x", ["y"])


def test_code_sim_matches_fuzzywuzzy_when_installed():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    import fuzzywuzzy.fuzz as fz

    if fz.SequenceMatcher.__module__ != "difflib":
        pytest.skip("fuzzywuzzy uses python-Levenshtein here, not LongBench's difflib path")
    rng = random.Random(0)
    for _ in range(500):
        a = "".join(rng.choice(string.ascii_lowercase + " ()") for _ in range(rng.randint(0, 60)))
        b = "".join(rng.choice(string.ascii_lowercase + " ()") for _ in range(rng.randint(0, 60)))
        assert M.fuzz_ratio(a, b) == fuzz.ratio(a, b)


# ---- truncation --------------------------------------------------------------------------------------------
def test_middle_truncate_keeps_head_and_tail():
    ids = list(range(10))
    assert middle_truncate(ids, 10) is None
    assert middle_truncate(ids, 4) == ([0, 1], [8, 9])
    assert middle_truncate(ids, 5) == ([0, 1], [8, 9])  # int(5/2) = 2 each side
    with pytest.raises(ValueError):
        middle_truncate(ids, 1)


def test_prompt_truncation_keeps_instruction_and_question(tok):
    t = task(subtasks=["qasper"], num_samples=1, max_length=40)
    (s,) = t.samples(tok, 512)
    d = s.data
    assert d["truncated"] and d["raw_tokens"] > 40
    text = tok.decode(d["input_ids"], skip_special_tokens=True)
    assert text.startswith("You are given a scientific")  # head of the instruction
    assert text.endswith("Answer:")  # tail: the question survives
    assert "TinyStories corpus, which" not in text  # the middle of the article is gone
    assert abs(len(d["input_ids"]) - 41) <= 3  # 20 + 20 tokens + BOS, up to re-tokenisation at the seam


def test_default_max_length_is_context_minus_generation(tok):
    # context 100, lcc generates up to 64 tokens: the prompt keeps at most 100 - 64 = 36 tokens
    (s,) = task(subtasks=["lcc"], num_samples=1).samples(tok, 100)
    assert s.data["truncated"] and s.data["raw_tokens"] > 36
    assert len(s.data["input_ids"]) <= 36 and s.data["max_new_tokens"] == MAX_NEW_TOKENS["lcc"]


# ---- loading, validation -----------------------------------------------------------------------------------
def test_fixtures_are_in_official_format_and_load():
    for name in SUBTASKS:
        rows = [json.loads(l) for l in (FIXTURES / f"{name}.jsonl").read_text(encoding="utf-8").splitlines()]
        assert rows and all(set(r) == OFFICIAL_KEYS and r["dataset"] == name for r in rows)
        assert all(isinstance(r["answers"], list) and r["answers"] for r in rows)
    assert all(len(r["all_classes"]) == 50 for r in map(json.loads, (FIXTURES / "trec.jsonl").open()))


def test_samples_from_fixtures(tok):
    t = task(num_samples=2, max_length=100)
    samples = t.samples(tok, 512)
    assert len(samples) == 2 * len(SUBTASKS)
    assert len({s.id for s in samples}) == len(samples)
    assert [s.id for s in samples] == [s.id for s in task(num_samples=2, max_length=100).samples(tok, 512)]
    for s in samples:
        d = s.data
        assert d["max_new_tokens"] == MAX_NEW_TOKENS[d["subtask"]]
        assert 1 <= d["context_len"] < len(d["input_ids"])
        assert d["input_ids"][0] == tok.bos_token_id
        assert d["source"].endswith(f"{d['subtask']}.jsonl")


def test_unknown_subtask_lists_the_real_ones():
    with pytest.raises(ValueError) as e:
        task(subtasks=["qasper", "narrative_qa"])
    msg = str(e.value)
    assert "narrative_qa" in msg and all(s in msg for s in SUBTASKS)
    with pytest.raises(ValueError, match="source"):
        task(source="web")
    with pytest.raises(ValueError, match="chat_template"):
        task(chat_template="yes")
    with pytest.raises(ValueError, match="unknown option"):
        build_task({"name": "longbench", "subtask": ["qasper"]})


def test_local_source_missing_file_is_a_clear_error(tmp_path, tok):
    t = build_task({"name": "longbench", "source": "local", "subtasks": ["lcc"], "data_path": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="lcc.jsonl"):
        t.samples(tok, 512)


def test_data_zip_is_read(tmp_path, tok):
    import zipfile

    with zipfile.ZipFile(tmp_path / "data.zip", "w") as zf:
        zf.write(FIXTURES / "trec.jsonl", "data/trec.jsonl")
    t = build_task(
        {"name": "longbench", "source": "local", "subtasks": ["trec"], "data_path": str(tmp_path / "data.zip")}
    )
    assert len(t.samples(tok, 512)) == 2


@pytest.mark.skipif(not (DATA_DIR / "longbench-triviaqa" / "triviaqa.json").is_file(), reason="shared data absent")
def test_shared_triviaqa_without_context(tok):
    t = build_task(
        {"name": "longbench", "subtasks": ["triviaqa"], "num_samples": 3, "source": "local"}, data_dir=str(DATA_DIR)
    )
    samples = t.samples(tok, 512)
    assert len(samples) == 3
    for s in samples:
        assert s.data["context_missing"] and s.data["answers"]
        text = tok.decode(s.data["input_ids"], skip_special_tokens=True)
        assert text.rstrip().endswith("Answer:")
    assert t.aggregate([{"subtask": "triviaqa", "score": 50.0, "context_missing": True}])["context_missing"] == [
        "triviaqa"
    ]


def test_chat_template_rule(tok):
    import copy

    chat_tok = copy.deepcopy(tok)
    chat_tok.chat_template = "{% for m in messages %}<|user|>{{ m['content'] }}<|end|>{% endfor %}<|assistant|>"
    t = task(subtasks=["qasper", "trec"], num_samples=1, max_length=200)
    by = {s.data["subtask"]: s for s in t.samples(chat_tok, 512)}
    assert by["qasper"].data["chat_template"] is True  # QA tasks get the template
    assert by["trec"].data["chat_template"] is False  # LongBench's no-chat list
    assert chat_tok.decode(by["qasper"].data["input_ids"], skip_special_tokens=True).endswith("<|assistant|>")
    plain = task(subtasks=["qasper"], num_samples=1, max_length=200, chat_template="none").samples(chat_tok, 512)
    assert plain[0].data["chat_template"] is False
    assert task(subtasks=["qasper"], num_samples=1).samples(tok, 512)[0].data["chat_template"] is False  # no template
    with pytest.raises(ValueError, match="no chat template"):
        task(subtasks=["qasper"], num_samples=1, chat_template="always").samples(tok, 512)


def test_aggregate_is_mean_of_subtask_means():
    t = task(subtasks=["trec", "lcc"])
    recs = [{"subtask": "trec", "score": 100.0}, {"subtask": "trec", "score": 0.0}, {"subtask": "lcc", "score": 20.0}]
    out = t.aggregate(recs)
    assert out["subtask_scores"] == {"trec": 50.0, "lcc": 20.0}
    assert out["score"] == pytest.approx(35.0)
    assert out["metric_per_subtask"] == {"trec": "classification", "lcc": "code_sim"}


def test_prompts_format_every_subtask():
    for name, p in PROMPTS.items():
        text = p.format(context="CTX", input="INP")
        assert "CTX" in text and ("INP" in text or name == "lcc")


# ---- end to end ---------------------------------------------------------------------------------------------
def test_end_to_end_runner(tmp_path, monkeypatch):
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import register_configs
    from sparse_eval.launcher.runner import run

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(
            config_name="config",
            overrides=[
                "task=longbench",
                f"task.data_path={FIXTURES}",
                "task.subtasks=[trec,passage_retrieval_en]",
                "task.num_samples=1",
                "task.max_length=48",
                "task.max_new_tokens=4",
                "method=full",
                f"paths.runs_dir={tmp_path}",
                "print_table=false",
            ],
        )
    (summary,) = run(cfg)
    assert summary["samples"] == 2 and summary["failed"] == 0
    assert summary["metric"] == "score" and 0.0 <= summary["score"] <= 100.0
    assert set(summary["metrics"]["subtask_scores"]) == {"trec", "passage_retrieval_en"}
    recs = [json.loads(l) for l in (Path(summary["run_dir"]) / "samples.jsonl").read_text().splitlines()]
    assert all(r["generated_tokens"] <= 4 and r["truncated"] for r in recs)
    # each record's score is LongBench's score of its own prediction
    for r in recs:
        classes = json.loads((FIXTURES / "trec.jsonl").read_text().splitlines()[0])["all_classes"]
        assert r["score"] == 100 * M.score_sample(r["subtask"], r["prediction"], r["answers"], classes)
