"""Key-value retrieval task ("Lost in the Middle" format): prompt round trip, placement, generation, scoring."""

from __future__ import annotations

import gzip
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import yaml

from sparse_eval.tasks import build_task
from sparse_eval.tasks.kv_retrieval import (
    TEMPLATE,
    format_kv_records,
    generate_records,
    is_correct,
    move_gold,
)

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "sparse_eval" / "models" / "stories260K"
CONF_DIR = REPO / "conf"
DATA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "data"
PUBLISHED = DATA_DIR / "lost-in-the-middle" / "kv_retrieval_data" / "kv-retrieval-75_keys.jsonl.gz"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR, local_files_only=True)


def task(**opts):
    return build_task({"name": "kv_retrieval", **opts}, data_dir=str(DATA_DIR) if DATA_DIR.is_dir() else None)


def test_records_are_valid_json_in_order():
    recs = generate_records(random.Random(0), 7)
    parsed = json.loads(format_kv_records(recs))
    assert list(parsed.items()) == recs  # a JSON object with the pairs in prompt order
    assert format_kv_records(recs).count("\n") == 6  # one pair per line
    flat = [x for kv in recs for x in kv]
    assert len(set(flat)) == len(flat)  # every key and value distinct
    for x in flat:
        assert len(x) == 36 and x[14] == "4"  # UUID4 text


def test_config_default_template_is_the_paper_prompt():
    conf = yaml.safe_load((CONF_DIR / "task" / "kv_retrieval.yaml").read_text())
    assert conf["template"] == TEMPLATE
    p = TEMPLATE.format(formatted_kv_records="{}", key="K")
    assert p.startswith("Extract the value corresponding to the specified key in the JSON object below.")
    assert p.endswith('Key: "K"\nCorresponding value:')


def test_accuracy_rule():
    v = "8bc3e90d-e044-4923-9a5d-7bf48917ed39"
    assert is_correct(f'The value is "{v}".', v)
    assert is_correct(v.upper(), v)  # case-insensitive
    assert not is_correct(v[:-1], v)


def test_move_gold_keeps_the_others_in_order():
    recs = [(f"k{i}", f"v{i}") for i in range(6)]
    for gold in range(6):
        for pos in range(6):
            out = move_gold(recs, gold, pos)
            assert out[pos] == recs[gold]
            assert [r for r in out if r != recs[gold]] == [r for r in recs if r != recs[gold]]


def test_generated_is_seeded_and_placed(tok):
    a = task(num_keys=4, num_samples=3, gold_position=[0, 3, -2], max_new_tokens=4).samples(tok, 512)
    b = task(num_keys=4, num_samples=3, gold_position=[0, 3, -2], max_new_tokens=4).samples(tok, 512)
    c = task(num_keys=4, num_samples=3, gold_position=[0, 3, -2], max_new_tokens=4, seed=1).samples(tok, 512)
    assert [s.data["input_ids"] for s in a] == [s.data["input_ids"] for s in b]
    assert [s.data["value"] for s in a] != [s.data["value"] for s in c]
    assert len(a) == 9 and len({s.id for s in a}) == 9
    for s in a:
        d = s.data
        text = tok.decode(d["input_ids"], skip_special_tokens=True)
        obj = json.loads(text[text.index("{") : text.rindex("}") + 1])
        keys = list(obj)
        assert keys[d["gold_position"]] == d["key"] and obj[d["key"]] == d["value"]
        assert text.endswith(f'Key: "{d["key"]}"\nCorresponding value:')
    assert Counter(s.data["gold_position"] for s in a) == {0: 3, 3: 3, 2: 3}  # -2 of 4 pairs is index 2


def test_all_and_uniform_positions(tok):
    all_pos = task(num_keys=3, num_samples=2, gold_position="all").samples(tok, 512)
    assert sorted(s.data["gold_position"] for s in all_pos) == [0, 0, 1, 1, 2, 2]
    uni = task(num_keys=3, num_samples=30, gold_position="uniform").samples(tok, 512)
    counts = Counter(s.data["gold_position"] for s in uni)
    assert set(counts) <= {0, 1, 2} and len(counts) == 3  # P(a position never drawn in 30) < 3 * (2/3)^30 ~ 1e-5


def test_length_mode_fills_as_many_pairs_as_fit(tok):
    t = task(num_keys=None, length=300, num_samples=2, gold_position=0, max_new_tokens=8)
    samples = t.samples(tok, 512)
    for i, s in enumerate(samples):
        n = s.data["num_keys"]
        assert len(s.data["input_ids"]) <= 300
        recs = t.fit_records(i, tok, False)
        assert len(recs) == n >= 2
        one_more = generate_records(random.Random(99), 1, {x for kv in recs for x in kv})
        longer = t.render(recs + one_more, recs[0][0], tok, False)[1]
        assert len(longer) > 300  # n + 1 pairs would not fit


def test_protocol_b_split_is_before_the_question(tok):
    (s,) = task(num_keys=3, num_samples=1, gold_position=1).samples(tok, 512)
    d = s.data
    context = tok.decode(d["input_ids"][: d["context_len"]], skip_special_tokens=True)
    question = tok.decode(d["input_ids"][d["context_len"] :], skip_special_tokens=True)
    assert context.rstrip().endswith("}") and d["key"] in question and "Corresponding value:" in question


def test_bad_config_is_refused(tok):
    with pytest.raises(ValueError, match="gold_position"):
        task(gold_position="middle")
    with pytest.raises(ValueError, match="gold_position"):
        task(gold_position=True)
    with pytest.raises(ValueError, match="give one"):
        task(num_keys=10, length=100)
    with pytest.raises(ValueError, match="original"):
        task(gold_position="original")
    with pytest.raises(ValueError, match="source"):
        task(source="web")
    with pytest.raises(ValueError, match="outside"):
        task(num_keys=3, num_samples=1, gold_position=5).samples(tok, 512)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        task(num_keys=40, num_samples=1).samples(tok, 512)  # 40 UUID pairs do not fit in 512 tokens


@pytest.mark.skipif(not PUBLISHED.is_file(), reason="shared data absent")
def test_published_file(tok):
    t = task(source="published", num_keys=75, num_samples=3, gold_position="original")
    rows = [json.loads(line) for line in gzip.open(PUBLISHED, "rt").read().splitlines()[:3]]
    ex = t.published_examples()
    assert len(ex) == 3
    for e, row in zip(ex, rows):
        assert len(e["records"]) == 75 and e["records"][e["gold_index"]] == (row["key"], row["value"])
    # the paper's placement: gold popped and re-inserted at the index, the rest in file order
    moved = move_gold(ex[0]["records"], ex[0]["gold_index"], 24)
    assert moved[24] == (rows[0]["key"], rows[0]["value"])
    with pytest.raises(FileNotFoundError, match="available"):
        task(source="published", num_keys=300).published_path()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        t.samples(tok, 512)  # 75 pairs are far beyond stories260K's 512 tokens


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
                "task=kv_retrieval",
                "task.num_keys=2",
                "task.num_samples=1",
                "task.gold_position=[0,1]",
                "task.max_new_tokens=6",
                "method=topk",
                "eval.protocol=B",
                f"paths.runs_dir={tmp_path}",
                "print_table=false",
            ],
        )
    summaries = run(cfg)
    assert [s["method"] for s in summaries] == ["topk"]
    for s in summaries:
        assert s["samples"] == 2 and s["failed"] == 0 and s["protocol"] == "B"
        assert s["metric"] == "accuracy" and s["score"] in (0.0, 50.0, 100.0)
        assert set(s["metrics"]["accuracy_by_position"]) == {"0", "1"}
        recs = [json.loads(l) for l in (Path(s["run_dir"]) / "samples.jsonl").read_text().splitlines()]
        for r in recs:
            assert r["score"] == (100.0 if is_correct(r["prediction"], r["value"]) else 0.0)
            assert r["generated_tokens"] <= 6
