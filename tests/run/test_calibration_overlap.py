"""Calibration text never overlaps evaluated text (issue 26, part 3).

* the content fingerprint (``identity.overlap``) finds a shared passage across WikiText's tokenized (<unk>) and
  raw releases and across tokenizers, and finds none between the validation and test splits;
* a wikitext run whose Double Sparsity calibration was made from the test split is refused at start, with a
  message naming the file, its text, the task and the fix; one calibrated on validation text runs; a file with
  no fingerprint is refused for want of one; RULER's prompts are checked the same way;
* ``calibrate`` reads WikiText-2 validation by default (local copy, else the hub's validation split) and refuses
  the old test-split choices;
* the shipped calibration files say which text and how many tokens they were computed from (WikiText-2
  validation), their fingerprint is that text's, and it shares nothing with the WikiText-2 test split.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sparse_eval.config import register_configs
from sparse_eval.identity.overlap import (
    KEEP_ONE_IN,
    MIN_SHARED,
    SHINGLE_WORDS,
    CalibrationOverlapError,
    CalibrationText,
    check_method,
    fingerprint,
    shared_shingles,
    shingle_hashes,
    words,
)
from sparse_eval.config import CONF_DIR
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "sparse_eval" / "calibration"
TEST_HEAD = REPO / "sparse_eval" / "data" / "wikitext2_test_head.txt"
register_configs()


@pytest.fixture(autouse=True)
def _private_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSE_EVAL_CALIBRATION_DIR", str(tmp_path / "user_calibration"))


def _calibration_file(stories, text: str, path: Path, origin: str) -> Path:
    """A stories260K calibration on the first 8 x 128 tokens of ``text`` (about 260 words)."""
    from sparse_eval.calibrate import calibrate, write

    model, tok = stories
    return write(
        calibrate(
            model, tok, text, model_name="stories260k", data_origin=origin, block_size=128, num_blocks=8, command="test"
        ),
        path,
    )


def _config(tmp_path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(
            config_name="config",
            overrides=[f"paths.runs_dir={tmp_path / 'runs'}", "task.window=256", "task.num_samples=4", *overrides],
        )


def _experiment(tmp_path, *overrides) -> Experiment:
    return Experiment(run_config(_config(tmp_path, *overrides)))


# -- the fingerprint ---------------------------------------------------------------------------------------


def test_words_are_normalised_across_releases_and_tokenizers():
    assert words(
        "Robert <unk> is an English film , television and theatre actor . He had a guest @-@ starring role ; 1 @,@ 000"
    ) == words("robert is an English film, television and theatre actor. He had a guest-starring role; 1,000")


def test_fingerprint_finds_shared_text_across_releases_and_none_between_splits(shared_data):
    raw_test = (shared_data / "wikitext-2-raw" / "wiki.test.raw").read_text(encoding="utf-8")
    tok_test = (shared_data / "wikitext-2-tokenized" / "test.txt").read_text(encoding="utf-8")
    valid = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")
    fp = fingerprint(tok_test[:200_000])  # the tokenized release, rare words as <unk>
    assert fp["shingle_words"] == SHINGLE_WORDS and fp["keep_one_in"] == KEEP_ONE_IN
    assert 0 < fp["kept"] < fp["shingles"] / 8
    # against the raw release of the same text: most sampled shingles found; against validation: none
    assert shared_shingles(fp, [raw_test]) > fp["kept"] / 3
    assert shared_shingles(fingerprint(valid), [raw_test]) == 0
    # a single copied paragraph (~150 words) inside unrelated text is found
    paragraph = " ".join(raw_test[300_000:].split()[:150])
    assert shared_shingles(fp, [valid[:50_000] + paragraph + valid[50_000:100_000]]) == 0
    fp_para = fingerprint(valid[:100_000] + paragraph)
    assert shared_shingles(fp_para, [raw_test]) >= MIN_SHARED


# -- the refusal -------------------------------------------------------------------------------------------


def test_wikitext_run_refuses_a_calibration_on_its_test_split(tmp_path, stories):
    from sparse_eval.launcher.runner import run

    cal = _calibration_file(
        stories, TEST_HEAD.read_text(encoding="utf-8"), tmp_path / "on_test.json", "file:wikitext2_test_head.txt"
    )
    exp = _experiment(tmp_path, "method=double_sparsity", f"method.channels_file={cal}")
    with pytest.raises(CalibrationOverlapError) as err:
        exp.preflight(exp.method_configs()[0])
    msg = str(err.value)
    for part in (
        str(cal),
        "file:wikitext2_test_head.txt (1,024 tokens)",
        "task=wikitext",
        "disjoint",
        "python -m sparse_eval.calibrate model=stories260k",
        "method.channels_file",
        "channel_type=random",
    ):
        assert part in msg, part
    with pytest.raises(CalibrationOverlapError):  # the whole run: nothing is written
        run(_config(tmp_path, "method=double_sparsity", f"method.channels_file={cal}"))
    assert not (tmp_path / "runs" / "wikitext").exists()


def test_a_calibration_on_validation_text_runs(tmp_path, stories, shared_data):
    valid = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")
    cal = _calibration_file(stories, valid[:60_000], tmp_path / "on_valid.json", "file:valid.txt")
    exp = _experiment(tmp_path, "method=double_sparsity", f"method.channels_file={cal}")
    m = exp.preflight(exp.method_configs()[0]).config
    from sparse_eval.methods import build_method

    method = build_method(m)
    method.setup(exp.model, "stories260k")
    assert check_method(method, exp.task, exp.samples(), exp.tokenizer) == {"checked": True, "shared": 0}
    assert method.provenance()["calibration_text"] == "file:valid.txt (1,024 tokens)"


def test_a_calibration_file_without_fingerprint_is_refused(tmp_path, stories, shared_data):
    valid = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")
    cal = _calibration_file(stories, valid[:60_000], tmp_path / "old.json", "file:valid.txt")
    data = json.loads(cal.read_text())
    del data["calibration"]["text_fingerprint"]  # as written before fingerprints existed
    cal.write_text(json.dumps(data))
    exp = _experiment(tmp_path, "method=double_sparsity", f"method.channels_file={cal}")
    with pytest.raises(
        CalibrationOverlapError,
        match=r"records no fingerprint.*task=wikitext.*python -m sparse_eval\."
        r"calibrate model=stories260k",
    ):
        exp.preflight(exp.method_configs()[0])


def test_ruler_prompts_are_checked_too(stories, shared_data):
    """The same check on another task: RULER's essay haystack against a calibration on the essays (refused) and
    on WikiText-2 validation (passes).  Only the samples are built (no model run)."""
    from sparse_eval.tasks import build_task

    tok = stories[1]
    task = build_task(
        {"name": "ruler", "length": 4096, "subtasks": ["niah_single_2"], "num_samples": 2}, data_dir=str(shared_data)
    )
    samples = task.samples(tok, 8192)
    essays = json.loads((shared_data / "paul-graham-essays" / "PaulGrahamEssays.json").read_text())["text"]
    valid = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")

    class Calibrated:
        def __init__(self, text):
            self.fp = fingerprint(text)

        def calibration_text(self):
            return CalibrationText("file essays.json", "Paul Graham essays", self.fp, "recalibrate")

    with pytest.raises(
        CalibrationOverlapError,
        match=r"file essays\.json was calibrated on Paul Graham essays.*"
        r"task=ruler.*Fix: recalibrate",
    ):
        check_method(Calibrated(essays[:30_000]), task, samples, tok)
    assert check_method(Calibrated(valid[:100_000]), task, samples, tok) == {"checked": True, "shared": 0}


def test_two_shared_shingles_refuse_a_run_and_one_does_not():
    """The boundary: the texts overlap when they share at least ``MIN_SHARED`` = 2 kept shingles (the module's
    rule).  Evaluated passages cut from the calibration text so that they hold exactly 1, 2 and 3 of its kept
    shingles: 1 passes (an isolated common sentence), 2 and 3 refuse the run."""
    import random

    assert MIN_SHARED == 2
    rng = random.Random(0)
    cal_words = [f"w{rng.randrange(10**9)}" for _ in range(3000)]
    # the start of every kept shingle of the calibration text, each shingle hashed alone
    kept = [
        i
        for i in range(len(cal_words) - SHINGLE_WORDS + 1)
        if shingle_hashes([" ".join(cal_words[i : i + SHINGLE_WORDS])])[0].size
    ]
    assert len(kept) > 100  # about 1 in KEEP_ONE_IN

    class Calibrated:
        def calibration_text(self):
            return CalibrationText("cal.json", "random words", fingerprint(" ".join(cal_words)), "recalibrate")

    class Evaluates:
        name, config = "wikitext", type("C", (), {"name": "wikitext"})()

        def __init__(self, text):
            self.text = text

        def evaluated_texts(self, samples, tokenizer):
            return [self.text]

    for j, m in ((10, 1), (20, 2), (30, 3)):
        # from the j-th kept shingle's first word to the (j+m-1)-th's last: exactly m kept shingles inside
        passage = " ".join(cal_words[kept[j] : kept[j + m - 1] + SHINGLE_WORDS])
        if m < MIN_SHARED:
            assert check_method(Calibrated(), Evaluates(passage), [], None) == {"checked": True, "shared": m}
        else:
            with pytest.raises(CalibrationOverlapError, match=rf"\({m} of its {len(kept)} sampled 13-word shingles"):
                check_method(Calibrated(), Evaluates(passage), [], None)


def test_methods_without_calibration_and_tasks_without_text_are_not_refused(tmp_path, caplog):
    from sparse_eval.methods import build_method, make_config

    class NoText:
        name, config = "lm_eval", type("C", (), {"name": "lm_eval"})()

        def evaluated_texts(self, samples, tokenizer):
            return None

    assert check_method(build_method(make_config("topk", {})), NoText(), [], None) is None

    class Calibrated:
        def calibration_text(self):
            return CalibrationText("file x.json", "some text", fingerprint("a b c " * 20), "recalibrate")

    with caplog.at_level(logging.WARNING, logger="sparse_eval"):
        assert check_method(Calibrated(), NoText(), [], None) == {"checked": False, "shared": None}
    assert "task=lm_eval gives no evaluated text" in caplog.text and "file x.json" in caplog.text


# -- calibrate's default text --------------------------------------------------------------------------------


def test_calibrate_defaults_to_wikitext2_validation(shared_data, monkeypatch):
    from sparse_eval.calibrate import LOCAL_VALIDATION, VALIDATION, load_text
    from sparse_eval.tasks.base import DataNotFoundError

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="calibrate")
    assert (cfg.data, cfg.source, cfg.num_blocks, cfg.block_size) == (VALIDATION, "auto", 256, 512)
    text, info = load_text(cfg.data, str(shared_data))
    assert text == (shared_data / LOCAL_VALIDATION).read_text(encoding="utf-8")
    assert (info["dataset"], info["split"], info["origin"]) == ("WikiText-2", "validation", f"local:{LOCAL_VALIDATION}")

    # without a local copy: the hub's validation split through datasets
    import datasets

    calls = []

    def fake_load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return {"text": [" = A = \n", "", " b c \n"]}

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    text, info = load_text(VALIDATION, None)
    assert calls == [(("Salesforce/wikitext", "wikitext-2-raw-v1"), {"split": "validation"})]
    assert text == " = A = \n\n\n\n\n b c \n" and info["split"] == "validation" and info["origin"].startswith("hub:")
    with pytest.raises(FileNotFoundError, match="source=local"):
        load_text(VALIDATION, None, source="local")

    def offline(*args, **kwargs):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataNotFoundError, match=r"wikitext-2-tokenized/valid\.txt.*data=<path>"):
        load_text(VALIDATION, None)
    for old in ("bundled", "local"):  # the old choices were the test split
        with pytest.raises(ValueError, match=rf"data='{old}'.*test.*data={VALIDATION}"):
            load_text(old, str(shared_data))


# -- the shipped files ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["stories260k", "smollm2_135m"])
def test_shipped_files_record_their_validation_text(name, shared_data):
    cal = json.loads((SHIPPED / f"{name}.json").read_text())["calibration"]
    assert cal["command"] == f"python -m sparse_eval.calibrate model={name}"
    assert (cal["text"]["dataset"], cal["text"]["split"]) == ("WikiText-2", "validation")
    assert cal["data"] == cal["text"]["origin"] == "local:wikitext-2-tokenized/valid.txt"
    assert cal["tokens"] == cal["blocks"] * cal["block_size"] == 256 * 512
    fp = cal["text_fingerprint"]
    assert fp["kept"] > 1000
    # disjoint from everything the wikitext task can evaluate: the test split, raw and tokenized, and the head
    for f in ("wikitext-2-raw/wiki.test.raw", "wikitext-2-tokenized/test.txt"):
        assert shared_shingles(fp, [(shared_data / f).read_text(encoding="utf-8")]) == 0, f
    assert shared_shingles(fp, [TEST_HEAD.read_text(encoding="utf-8")]) == 0
    # and it is the validation text's: its sampled shingles are found there
    valid = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")
    assert shared_shingles(fp, [valid]) == fp["kept"]


def test_shipped_stories_fingerprint_is_its_recorded_text(stories, shared_data):
    """Recomputed from the validation file: the first 131,072 stories260K tokens decode to the recorded text."""
    import hashlib

    cal = json.loads((SHIPPED / "stories260k.json").read_text())["calibration"]
    text = (shared_data / "wikitext-2-tokenized" / "valid.txt").read_text(encoding="utf-8")
    assert hashlib.sha256(text.encode("utf-8")).hexdigest() == cal["data_sha256"]
    tok = stories[1]
    used = tok.decode(
        tok(text, add_special_tokens=True, verbose=False)["input_ids"][: cal["tokens"]], skip_special_tokens=True
    )
    assert hashlib.sha256(used.encode("utf-8")).hexdigest() == cal["text"]["decoded_sha256"]
    assert fingerprint(used) == cal["text_fingerprint"]


def test_default_run_passes_the_check_with_the_shipped_calibration(tmp_path):
    exp = _experiment(tmp_path, "method=double_sparsity")
    exp.preflight(exp.method_configs()[0])  # the default task (the bundled test head) against the shipped file
