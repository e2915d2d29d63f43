"""task=lm_eval: the lm-eval bridge end to end on the shipped model, the offline GSM8K/MMLU variants, CoQA's
metric, and the errors.  Skipped when lm-eval is not installed; nothing here needs the network."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import pytest

pytest.importorskip("lm_eval")

from helpers import TOY_DOCS, run_toy_folder, toy_task  # noqa: E402
from sparse_eval.tasks import build_task  # noqa: E402
from sparse_eval.tasks import lm_eval_task as le  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
needs_gsm8k = pytest.mark.skipif(not (DATA_DIR / "gsm8k" / "test.jsonl").is_file(), reason=f"no GSM8K under {DATA_DIR}")
needs_mmlu = pytest.mark.skipif(not (DATA_DIR / "mmlu" / "data" / "test").is_dir(), reason=f"no MMLU under {DATA_DIR}")

HAVE_GSM8K = (DATA_DIR / "gsm8k" / "test.jsonl").is_file()
LIMIT = 2  # documents per lm-eval task


@pytest.fixture(scope="module")
def lm_runs(tmp_path_factory):
    """One runner call (composed Hydra config) with full and a small-budget TopK on the toy task and, when the
    shared data is there, the offline GSM8K-CoT (LIMIT documents, 8 new tokens each: the model cannot solve it)."""
    summaries = run_toy_folder(
        tmp_path_factory.mktemp("lm_eval"),
        f"task.tasks=[toy_story{',gsm8k_cot' if HAVE_GSM8K else ''}]",
        "task.offline=true",
        f"task.limit={LIMIT}",
        f"paths.data_dir={DATA_DIR}",
        "task.log_inputs=true",
        "compare=[full,{name:topk,budget:0.1,local:8}]",
    )
    return {s["method"]: s for s in summaries}


def _records(summary):
    lines = (Path(summary["run_dir"]) / "samples.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["id"]: r for r in map(json.loads, lines)}


def test_bridge_full_and_topk_through_runner(lm_runs):
    for method in ("full", "topk"):
        s = lm_runs[method]
        assert s["failed"] == 0 and s["samples"] == 1 + HAVE_GSM8K and s["protocol"] == "A"
        rec = _records(s)["toy_story"]
        assert rec["status"] == "ok" and rec["lm_eval_task"] == "toy_story" and rec["source"] == "include_path"
        res = rec["results"]["toy_story"]
        assert "exact_match,none" in res and 0.0 <= res["exact_match,none"] <= 1.0
        assert rec["score"] == res["exact_match,none"] == s["metrics"]["toy_story"]
        docs = rec["docs"]
        assert sorted(d["doc_id"] for d in docs) == list(range(LIMIT))
        for d in docs:
            assert isinstance(d["response"], str) and d["target"] == " " + TOY_DOCS[d["doc_id"]]["answer"]
            assert d["metrics"]["exact_match"] in (0.0, 1.0)
            assert d["prompt"] == TOY_DOCS[d["doc_id"]]["story"]  # log_inputs=true
        # lm-eval's aggregate is the mean of its own per-document scores
        assert res["exact_match,none"] == pytest.approx(sum(d["metrics"]["exact_match"] for d in docs) / len(docs))
        assert rec["sparse_rows"] > 0  # generated tokens went through the attention plug-in
    full, topk = lm_runs["full"], lm_runs["topk"]
    assert full["cost2"] == pytest.approx(1.0) and full["est_error"] == pytest.approx(0.0)
    # TopK keeps sink 4 + local 8 + 10% of ~100 prompt keys: decode steps attended to a fraction of the cache
    assert 0 < topk["cost2"] < 0.5
    assert topk["est_error"] is not None and topk["est_error"] > 0
    assert set(topk["cost2_per_layer"]) == {"2", "3", "4"}  # stories260K has 5 layers, {0, 1} dense


def test_full_method_matches_stock_model(lm_runs):
    """The 'full' run's generations are exactly lm-eval's generations of the unpatched (sdpa) model."""
    import lm_eval
    import lm_eval.evaluator
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from sparse_eval.models.loading import ModelConfig, load_model

    model, tok = load_model(ModelConfig())
    folder = Path(lm_runs["full"]["task_config"]["include_path"])
    with mock.patch.object(lm_eval.evaluator, "add_env_info", lambda results: None):  # slow and irrelevant here
        out = lm_eval.simple_evaluate(
            model=HFLM(pretrained=model, tokenizer=tok, batch_size=1, max_length=512),
            tasks=["toy_story"],
            task_manager=TaskManager(include_path=str(folder), include_defaults=False),
            bootstrap_iters=0,
            log_samples=True,
            limit=LIMIT,
            gen_kwargs={"max_gen_toks": 8},
        )
    stock = {r["doc_id"]: r["resps"][0][0] for r in out["samples"]["toy_story"]}
    ours = {d["doc_id"]: d["response"] for d in _records(lm_runs["full"])["toy_story"]["docs"]}
    assert ours == stock


def _toy_run(tmp: Path, *extra: str) -> dict:
    return run_toy_folder(tmp, "task.tasks=[toy_story]", "method=topk", "method.budget=0.1", "method.local=8", *extra)[
        0
    ]


def test_shards_split_a_task_into_resumable_pieces_with_the_same_documents(tmp_path):
    whole = _toy_run(tmp_path / "one")
    cut = _toy_run(tmp_path / "three", "task.shards=2", "task.limit=10")  # a limit past the 3 documents: all
    assert whole["samples"] == 1 and cut["samples"] == 2 and cut["failed"] == 0
    pieces = _records(cut)
    assert sorted(pieces) == ["toy_story#1of2", "toy_story#2of2"]
    assert pieces["toy_story#1of2"]["doc_ranges"] == {"toy_story": [0, 1]}  # 3 documents: [0, 1) and [1, 3)
    assert pieces["toy_story#2of2"]["doc_ranges"] == {"toy_story": [1, 3]}

    def docs(recs):
        return {d["doc_id"]: (d["response"], d["metrics"]) for r in recs for d in r["docs"]}

    # the same documents, generations and metrics as the task run whole, and the same score and interval terms
    assert docs(pieces.values()) == docs(_records(whole).values()) and len(docs(pieces.values())) == 3
    assert cut["metrics"]["toy_story"] == pytest.approx(whole["metrics"]["toy_story"])
    assert cut["metrics"]["toy_story/documents"] == 3 and cut["metrics"]["toy_story/pieces"] == 2
    task = build_task(dict(cut["task_config"]))
    a, b = task.score_terms(list(pieces.values())), task.score_terms(list(_records(whole).values()))
    assert sorted(a.ids) == sorted(b.ids) and a.score() == pytest.approx(b.score())
    assert "requested" not in _records(whole)["toy_story"]  # one piece: the record as before


@needs_gsm8k
def test_shards_of_gsm8k_cot_give_its_documents_unchanged(lm_runs, tmp_path):
    # 8-shot CoT with lm-eval's first_n sampler: each document's prompt does not depend on its piece
    cut = _toy_run(
        tmp_path,
        "task.tasks=[gsm8k_cot]",
        "task.shards=2",
        "task.offline=true",
        f"task.limit={LIMIT}",
        f"paths.data_dir={DATA_DIR}",
        "task.log_inputs=true",
    )
    pieces = _records(cut)
    assert sorted(pieces) == ["gsm8k_cot#1of2", "gsm8k_cot#2of2"]
    whole = _records(lm_runs["topk"])["gsm8k_cot"]

    def docs(recs):
        return {d["doc_id"]: (d["prompt"], d["response"], d["metrics"]) for r in recs for d in r["docs"]}

    assert docs(pieces.values()) == docs([whole]) and sorted(docs([whole])) == list(range(LIMIT))
    assert cut["metrics"]["gsm8k_cot"] == pytest.approx(whole["score"])


def test_shards_refuse_more_pieces_than_a_task_has_documents(tmp_path):
    # a piece without documents of a task would make lm-eval run all of that task's documents
    task = build_task(
        {
            "name": "lm_eval",
            "tasks": ["toy_story"],
            "include_path": str(toy_task(tmp_path / "tasks")),
            "shards": 4,
            "work_dir": str(tmp_path),
        }
    )
    with pytest.raises(ValueError, match=r"task.shards=4: 'toy_story' .*'toy_story': 3\); set task.shards <= 3"):
        task.samples(None, 512)


def test_shards_refuse_a_few_shot_sampler_that_depends_on_the_documents_run(tmp_path):
    folder = toy_task(tmp_path / "tasks")
    yaml = folder / "toy_story.yaml"
    yaml.write_text(yaml.read_text() + "num_fewshot: 1\nfewshot_split: test\n", encoding="utf-8")
    task = build_task(
        {"name": "lm_eval", "tasks": ["toy_story"], "include_path": str(folder), "shards": 2, "work_dir": str(tmp_path)}
    )
    with pytest.raises(ValueError, match="sampler.*task.shards=1"):
        task.samples(None, 512)


@needs_gsm8k
def test_offline_gsm8k_end_to_end(lm_runs):
    for method, s in lm_runs.items():
        rec = _records(s)["gsm8k_cot"]
        assert rec["status"] == "ok" and rec["lm_eval_task"] == "gsm8k_cot_local" and rec["source"].startswith("local:")
        res = rec["results"]["gsm8k_cot_local"]
        assert rec["primary_metric"] == "exact_match,strict-match" and rec["score"] == res["exact_match,strict-match"]
        assert rec["n_shot"] == {"gsm8k_cot_local": 8} and rec["documents"] == LIMIT
        assert sorted((d["doc_id"], d["filter"]) for d in rec["docs"]) == sorted(
            (i, f) for i in range(LIMIT) for f in ("strict-match", "flexible-extract")
        )
        assert all(d["prompt"].endswith("\nA:") for d in rec["docs"])
        assert rec["cost2"] is not None and (rec["cost2"] < 1) == (method == "topk")
        # the run's score is the plain mean of the task scores (MagicPIG Table 1 "Avg.")
        assert s["score"] == pytest.approx((s["metrics"]["toy_story"] + s["metrics"]["gsm8k_cot"]) / 2)


def test_protocol_b_is_refused():
    task = build_task({"name": "lm_eval", "tasks": ["toy"]})

    class Eng:
        protocol = "B"

    from sparse_eval.tasks.base import Sample

    with pytest.raises(ValueError, match="protocol"):
        task.run(Sample(id="toy", data={"lm_eval_task": "toy"}), Eng())


# ---------------------------------------------------------------------------------------------- offline data
@needs_gsm8k
def test_offline_gsm8k_builds_official_requests(tmp_path):
    task = build_task(
        {"name": "lm_eval", "tasks": ["gsm8k_cot"], "offline": True, "num_samples": 2, "work_dir": str(tmp_path)},
        data_dir=str(DATA_DIR),
    )
    (sample,) = task.samples(None, 4096)
    assert sample.id == "gsm8k_cot" and sample.data["lm_eval_task"] == "gsm8k_cot_local" and task.limit == 2
    loaded = task._manager.load(["gsm8k_cot_local"])
    (lt,) = loaded["tasks"].values()
    lt.set_fewshot_seed(1234)
    lt.build_all_requests(limit=task.limit)
    rows = [json.loads(x) for x in (DATA_DIR / "gsm8k" / "test.jsonl").read_text(encoding="utf-8").splitlines()[:2]]
    assert len(lt.instances) == 2
    for inst in lt.instances:
        prompt, gen = inst.args
        row = rows[inst.doc_id]
        assert prompt.endswith(f"Q: {row['question']}\nA:")
        assert prompt.count("The answer is") == 8  # the 8 fixed chain-of-thought exemplars
        assert "Q:" in gen["until"] and gen["do_sample"] is False
        assert lt.doc_to_target(inst.doc) == row["answer"].split("####")[-1].strip()
    assert [f.name for f in lt._filters] == ["strict-match", "flexible-extract"]


def _load(path):
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(path, resolve_func=False)


DATA_KEYS = {"task", "tag", "dataset_path", "dataset_name", "dataset_kwargs"}


@needs_gsm8k
@needs_mmlu
def test_local_variants_keep_the_official_task(tmp_path):
    """Merged local configs equal lm-eval's own ones except for the task name and the data source."""
    work = le.build_work_dir(DATA_DIR, tmp_path)
    tasks = le._lm_eval_tasks_dir()
    ours, theirs = _load(work / "gsm8k_cot_local.yaml"), _load(tasks / "gsm8k" / "gsm8k-cot.yaml")
    assert {k: v for k, v in ours.items() if k not in DATA_KEYS} == {
        k: v for k, v in theirs.items() if k not in DATA_KEYS
    }
    assert Path(ours["dataset_kwargs"]["data_files"]["test"]) == (DATA_DIR / "gsm8k" / "test.jsonl").resolve()
    subjects = le._official_mmlu_subjects()
    assert len(subjects) == 57
    for s in subjects:
        mine = _load(work / "mmlu_flan_cot_fewshot_local" / f"{s['task']}_local.yaml")
        off = _load(s["file"])
        assert {k: v for k, v in mine.items() if k not in DATA_KEYS} == {
            k: v for k, v in off.items() if k not in DATA_KEYS
        }
        assert mine["tag"] == off["tag"] + "_local"
    # the group: the official tree with every name suffixed (same aggregation)
    group = _load(work / "mmlu_flan_cot_fewshot_local" / "_mmlu_flan_cot_fewshot_local.yaml")
    official = _load(tasks / "mmlu" / "flan_cot_fewshot" / "_mmlu.yaml")
    assert group["aggregate_metric_list"] == official["aggregate_metric_list"]
    assert [t["task"] for t in group["task"]] == [[n + "_local" for n in t["task"]] for t in official["task"]]
    assert [t["aggregate_metric_list"] for t in group["task"]] == [t["aggregate_metric_list"] for t in official["task"]]
    # the work directory is reused as long as its inputs are unchanged
    assert le.build_work_dir(DATA_DIR, tmp_path) == work


@needs_mmlu
def test_offline_mmlu_subject_rows_and_prompt(tmp_path):
    import csv

    work = le.build_work_dir(DATA_DIR, tmp_path)
    src = DATA_DIR / "mmlu" / "data" / "test" / "abstract_algebra_test.csv"
    with open(src, encoding="utf-8", newline="") as f:
        rows = list(csv.reader(f))
    conv = [
        json.loads(x)
        for x in (work / "mmlu_flan_cot_fewshot_local" / "data" / "abstract_algebra_test.jsonl")
        .read_text(encoding="utf-8")
        .splitlines()
    ]
    assert len(conv) == len(rows)
    assert all(
        c["question"] == r[0] and c["choices"] == r[1:5] and "ABCD"[c["answer"]] == r[5] for c, r in zip(conv, rows)
    )
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(work), include_defaults=False)
    assert "mmlu_flan_cot_fewshot_local" in tm.all_groups
    (lt,) = tm.load(["mmlu_flan_cot_fewshot_abstract_algebra_local"])["tasks"].values()
    lt.set_fewshot_seed(1234)
    lt.build_all_requests(limit=1)
    (inst,) = lt.instances
    q, a, b, c, d, ans = rows[0]
    assert inst.args[0].endswith(f"Q: {q.strip()}\n(A) {a} (B) {b} (C) {c} (D) {d}\nA: Let's think step by step.")
    assert inst.args[0].startswith("The following are multiple choice questions (with answers) about abstract algebra.")
    assert inst.args[0].count("The answer is") == 4  # num_fewshot 4 of the fixed CoT exemplars
    assert lt.doc_to_target(inst.doc) == f"({ans})"


# ------------------------------------------------------------------------------------------------- errors
def test_unknown_task_name_lists_real_ones(tmp_path):
    task = build_task({"name": "lm_eval", "tasks": ["gsm8k_cto"], "include_defaults": False, "work_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="unknown lm-eval task") as err:
        task.samples(None, 512)
    for name in ("gsm8k_cot", "mmlu_flan_cot_fewshot", "coqa", "gsm8k_cot_local", "mmlu_flan_cot_fewshot_local"):
        assert repr(name) in str(err.value)


def test_coqa_offline_is_a_clear_error(tmp_path):
    task = build_task({"name": "lm_eval", "tasks": ["coqa"], "offline": "true", "work_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="needs the Hugging Face hub"):
        task.samples(None, 512)


@pytest.mark.parametrize(
    "tasks, offline, want",
    [
        (["gsm8k_cot"], True, r"gsm8k/test\.jsonl .*task\.offline=true"),
        (["mmlu_flan_cot_fewshot_local"], "auto", r"mmlu/data/test/\*\.csv .*asked for by name"),
    ],
)
def test_offline_without_data_is_refused_when_the_task_is_built(tmp_path, tasks, offline, want):
    # at start (Task.validate), before a model is loaded: not after it, when the samples are made
    with pytest.raises(FileNotFoundError, match=want):
        build_task(
            {"name": "lm_eval", "tasks": tasks, "offline": offline, "work_dir": str(tmp_path)},
            data_dir=str(tmp_path / "empty"),
        )


@pytest.mark.parametrize(
    "opts, bad",
    [
        ({"offline": "sometimes"}, "task.offline"),
        ({"tasks": []}, "task.tasks"),
        ({"tasks": "gsm8k_cot"}, "task.tasks"),
        ({"limit": 0}, "task.limit"),
        ({"batch_size": 0}, "task.batch_size"),
        ({"limit": 5, "num_samples": 3}, "disagree"),
        ({"num_fewshot": -1}, "task.num_fewshot"),
        ({"shards": 0}, "task.shards"),
        ({"bogus": 1}, "bogus"),
        ({"primary_metric": {"x": 1}}, "primary_metric"),
    ],
)
def test_bad_options(opts, bad):
    with pytest.raises(ValueError, match=bad):
        build_task({"name": "lm_eval", **opts})


def test_primary_metric_choice(caplog):
    task = build_task({"name": "lm_eval", "tasks": ["t"]})
    entry = {
        "alias": "x",
        "exact_match,strict-match": 0.25,
        "exact_match_stderr,strict-match": 0.1,
        "exact_match,flexible-extract": 0.5,
        "f1,none": 0.75,
    }
    assert task._primary("gsm8k_cot", "gsm8k_cot_local", entry) == "exact_match,strict-match"
    assert task._primary("gsm8k_cot_local", "gsm8k_cot_local", entry) == "exact_match,strict-match"  # base name
    assert task._primary("coqa", "coqa_compat", entry) == "f1,none"
    assert task._primary("other", "other", {"alias": "o", "acc,none": 0.3, "acc_stderr,none": 0.1}) == "acc,none"
    task.config.primary_metric = {"mine": "exact_match", "bad": "exact_match,none"}
    assert task._primary("mine", "mine", entry) == "exact_match,strict-match"  # bare metric: its first filter
    assert task._primary("bad", "bad", entry) is None and "not among" in caplog.text  # no silent substitution


@needs_gsm8k
@needs_mmlu
def test_compose_default_config():
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import register_configs, to_plain

    register_configs()
    with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
        cfg = compose(config_name="config", overrides=["task=lm_eval", "task.offline=true", "task.limit=2"])
    assert list(cfg.task.tasks) == list(le.PAPER_TASKS) and cfg.task.batch_size == 1
    task = build_task(to_plain(cfg.task), data_dir=str(DATA_DIR))
    assert task.offline == "true" and task.limit == 2
    with pytest.raises(FileNotFoundError, match="paths.data_dir"):  # offline, and no data: refused at start
        build_task(to_plain(cfg.task))


# -------------------------------------------------------------------------------------------- CoQA metric
def test_squad_metric_properties():
    assert le.squad_normalize("  The  Cat, sat!  ") == "cat sat"
    assert le.squad_exact("The cat.", "cat") == 1 and le.squad_exact("cat", "dog") == 0
    # "cat sat" vs "cat sat on mat": 2 common tokens, precision 2/4, recall 2/2
    assert le.squad_f1("The cat sat.", "cat sat on the mat") == pytest.approx(2 * 0.5 * 1.0 / 1.5)
    assert le.squad_f1("a b c", "c b a") == 1.0 and le.squad_f1("x", "y") == 0.0
    assert le.squad_f1("", "") == 1.0 and le.squad_f1("the", "cat") == 0.0  # 'the' normalizes to nothing
    for g, p in [("red ball in the park", "a red ball"), ("two", "two two three"), ("Lily and Tom", "Tom")]:
        assert le.squad_f1(g, p) == pytest.approx(le.squad_f1(p, g))
    # one gold: the plain scores; several: mean over leave-one-out maxima
    assert le.coqa_scores(["white"], "White.") == {"em": 1.0, "f1": 1.0}
    assert le.coqa_scores(["x", "y"], "x")["em"] == pytest.approx(0.5)
    assert le.coqa_scores(["a b", "a b", "c"], "a b")["em"] == pytest.approx(1.0)


COQA_DOC = {
    "story": "Lily had a red ball.",
    "questions": {"input_text": ["What did Lily have?", "What color?"]},
    "answers": {"input_text": ["a ball", "red"]},
    "additional_answers": {"0": {"input_text": ["ball", "Red"]}, "1": {"input_text": ["x", "bright red"]}},
}


def test_coqa_prompt_and_targets():
    assert (
        le.coqa_doc_to_text(COQA_DOC)
        == "Lily had a red ball.\n\nQ: What did Lily have?\n\nA: a ball\n\nQ: What color?\n\nA:"
    )
    assert le.coqa_doc_to_target(COQA_DOC) == ["red", "bright red"]  # "Red" duplicates "red" case-insensitively
    assert le.coqa_process_results(COQA_DOC, [" red\nQ: next"]) == le.coqa_scores(["red", "bright red"], "red")
    from lm_eval.tasks._yaml_loader import load_yaml

    # coqa_compat is lm-eval's coqa apart from the name and the three functions, which resolve to ours
    ours = load_yaml(le.CONFIG_DIR / "coqa_compat.yaml", resolve_func=True)
    official = load_yaml(le._lm_eval_tasks_dir() / "coqa" / "default.yaml", resolve_func=False)
    funcs = {"task", "doc_to_text", "doc_to_target", "process_results"}
    assert {k: v for k, v in ours.items() if k not in funcs} == {k: v for k, v in official.items() if k not in funcs}
    assert ours["doc_to_text"] is le.coqa_doc_to_text and ours["process_results"] is le.coqa_process_results
    assert ours["doc_to_target"] is le.coqa_doc_to_target and ours["task"] == "coqa_compat"


@pytest.mark.skipif(
    le._squad_metrics_available() is False, reason="transformers >= 5 has no squad_metrics to compare with"
)
def test_coqa_matches_lm_eval_utils():  # pragma: no cover - transformers 4.x only
    from lm_eval.tasks.coqa import utils

    assert utils.doc_to_text(COQA_DOC) == le.coqa_doc_to_text(COQA_DOC)
    assert utils.doc_to_target(COQA_DOC) == le.coqa_doc_to_target(COQA_DOC)
    for pred in ("red", "bright red car", "blue", ""):
        assert utils.process_results(COQA_DOC, [pred]) == pytest.approx(le.coqa_process_results(COQA_DOC, [pred]))


def test_generation_records_do_not_depend_on_the_batch_size(tmp_path):
    """lm-eval left-pads its generation batches; in the batch-invariant mode (the default) a sparse method's
    documents get the same generations and the run the same statistics at task.batch_size 1 and 3 (the three toy
    prompts differ in length, so the batch of 3 is padded)."""
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import register_configs
    from sparse_eval.launcher.runner import run

    tasks = toy_task(tmp_path / "tasks")
    register_configs()
    recs = {}
    for bs in (1, 3):
        with initialize_config_dir(version_base="1.3", config_dir=str(REPO / "conf")):
            cfg = compose(
                config_name="config",
                overrides=[
                    "task=lm_eval",
                    "task.tasks=[toy_story]",
                    f"task.include_path={tasks}",
                    "task.bootstrap_iters=0",
                    "task.offline=true",
                    f"task.batch_size={bs}",
                    f"task.work_dir={tmp_path / f'work{bs}'}",
                    f"paths.runs_dir={tmp_path / f'runs{bs}'}",
                    "print_table=false",
                    "method=topk",
                    "method.budget=0.1",
                    "method.local=8",
                ],
            )
        (summary,) = run(cfg)
        recs[bs] = _records(summary)["toy_story"]
    assert recs[1]["lm_eval"]["batch_size"] == 1 and recs[3]["lm_eval"]["batch_size"] == 3
    assert recs[1]["docs"] == recs[3]["docs"] and len(recs[1]["docs"]) == len(TOY_DOCS)
    for key in ("score", "cost2", "est_error"):
        assert recs[1][key] == recs[3][key], key
    assert recs[1]["cost2"] < 1


def test_report_shows_lm_eval_scores_in_percent_under_their_lm_eval_task(tmp_path):
    from sparse_eval.report import load_results
    from sparse_eval.report.tables import score_intervals

    _toy_run(tmp_path, "task.shards=2")
    df = load_results(tmp_path / "runs")
    t = score_intervals(df)
    (row,) = t.rows
    (pooled,) = df.loc[df["subtask"] == "toy_story", "pooled_score"]
    assert row["Task"] == "lm_eval: toy_story" and row["n"] == 3  # n in documents, not in pieces
    assert row["Score"] == pytest.approx(100 * pooled)  # lm-eval's fraction shown in %, as Table 1 shows it
    assert "in % (×100)" in t.caption


def test_generations_without_a_stop_sequence_are_counted_and_warned(tmp_path, capsys):
    """A generation that contains none of lm-eval's stop sequences (nor EOS) ran to the length limit: each record
    counts them, and a run where most did says so in its summary's warnings (Qwen2.5-Coder on MMLU flan-CoT without
    its chat template: the answers ran on and full attention scored 0)."""
    never, always = "task.gen_kwargs='max_gen_toks=8,until=@@@'", "task.gen_kwargs='max_gen_toks=8,until=a'"
    counts, warned = {}, {}
    for name, gen in (("never", never), ("always", always)):
        (s,) = run_toy_folder(tmp_path / name, "task.tasks=[toy_story]", "task.offline=true", gen, "method=full")
        rec = _records(s)["toy_story"]
        counts[name] = (rec["generations"], rec["unstopped_generations"])
        warned[name] = [w for w in s["warnings"] if "without a stop sequence" in w]
    assert counts == {"never": (len(TOY_DOCS), len(TOY_DOCS)), "always": (len(TOY_DOCS), 0)}
    assert len(warned["never"]) == 1 and "task.apply_chat_template=true" in warned["never"][0]
    assert warned["always"] == []
    # collect says it beside the table and keeps it in a column
    from sparse_eval.results.collect import main as collect_main

    capsys.readouterr()
    assert collect_main([str(tmp_path / "never" / "runs"), "--quiet"]) == 0
    assert "without a stop sequence" in capsys.readouterr().err
    assert collect_main([str(tmp_path / "always" / "runs"), "--quiet"]) == 0
    assert "warning" not in capsys.readouterr().err
