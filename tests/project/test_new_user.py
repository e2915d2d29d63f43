"""What a new user hit (issue 52), each checked: a read-only runs folder refused before the model loads, a corrupt
line of samples.jsonl reported and its sample recomputed (and ``status`` not calling the run complete), and the
setup of a run saying what it does."""

from __future__ import annotations

import json
import logging
import os
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sparse_eval.config import CONF_DIR, register_configs
from sparse_eval.launcher.runner import run

register_configs()


def cfg_for(runs: Path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"paths.runs_dir={runs}", *overrides])


# -- a runs folder that cannot be written: refused before the model loads -----------------------------------------


def _no_load(monkeypatch):
    import sparse_eval.run.experiment as experiment

    def load_model(*a, **k):
        raise AssertionError("the model was loaded before the runs folder was checked")

    monkeypatch.setattr(experiment, "load_model", load_model)


def test_a_read_only_runs_folder_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    store = tmp_path / "store"
    store.mkdir()
    real = tempfile.mkstemp

    def mkstemp(*a, dir=None, **k):  # a read-only folder (permissions do not stop root, so the write is refused)
        if dir is not None and Path(dir) == store:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*a, dir=dir, **k)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    _no_load(monkeypatch)
    with pytest.raises(ValueError) as err:
        run(cfg_for(store, "method=full", "task.num_samples=1", "task.window=64"))
    msg = str(err.value)
    assert msg.startswith(f"paths.runs_dir={store}: cannot write {store} (Permission denied)"), msg
    assert "paths.runs_dir=runs" in msg and f"python -m sparse_eval.results.collect {store}" in msg and "\n" not in msg
    assert list(store.iterdir()) == []


def test_a_runs_folder_that_cannot_be_made_is_refused_before_the_model_loads(monkeypatch):
    _no_load(monkeypatch)
    with pytest.raises(ValueError, match=r"^paths.runs_dir=/proc/runs: cannot write /proc/runs \(.* at /proc\); give"):
        run(cfg_for(Path("/proc/runs"), "method=full", "task.num_samples=1", "task.window=64"))


# -- a corrupt line of samples.jsonl: reported, its sample computed again, the run not called complete -----------


def test_a_corrupt_sample_line_is_reported_recomputed_and_not_complete(tmp_path, caplog):
    from sparse_eval.results.status import format_states, run_state
    from sparse_eval.results.store import SAMPLES_FILE

    args = ("method=full", "task.num_samples=2", "task.window=64", "print_table=false")
    (first,) = run(cfg_for(tmp_path / "runs", *args))
    run_dir = Path(first["run_dir"])
    log = run_dir / SAMPLES_FILE
    lines = log.read_text(encoding="utf-8").splitlines()
    assert run_state(run_dir)["state"] == "done"
    # a garbage line among the records (written behind the store's back: the file's time unchanged): the run is not
    # done nor complete, and status says which line
    stamp = log.stat()
    log.write_text("\n".join([lines[0], "garbage}{", lines[1]]) + "\n", encoding="utf-8")
    os.utime(log, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    state = run_state(run_dir)
    assert state["state"] == "incomplete" and not state["complete"] and state["corrupt_lines"] == [2]
    assert "samples.jsonl line 2 is not a sample record" in format_states([state])
    # ... and a record garbled in the middle (its id still readable): that sample is computed again, not dropped
    broken = lines[1][:20] + "\x00" + lines[1][40:]
    sid = json.loads(lines[1])["id"]
    log.write_text("\n".join([lines[0], "garbage}{", broken]) + "\n", encoding="utf-8")
    assert run_state(run_dir)["written"] == 1
    with caplog.at_level(logging.WARNING, logger="sparse_eval"):
        (again,) = run(cfg_for(tmp_path / "runs", *args))
    assert f"{log} line 2 is not a sample record (corrupt)" in caplog.text
    assert f"{log} line 3 is not a sample record (corrupt)" in caplog.text
    assert f"sample {sid} is computed again" in caplog.text
    progress = json.loads((run_dir / "progress.json").read_text())
    assert progress["done_at_start"] == 1 and again["samples"] == 2 and again["complete"]  # one computed again
    ids = [json.loads(line)["id"] for line in log.read_text(encoding="utf-8").splitlines()]
    assert ids == [json.loads(lines[0])["id"], sid]
    assert again["score"] == pytest.approx(first["score"], rel=0, abs=0)  # the same record, computed again
    assert run_state(run_dir)["state"] == "done"


# -- the setup says what it does: model load, tokenizer check, the task's samples, the run ------------------------


def test_the_setup_says_what_it_does(tmp_path, caplog):
    """A RULER sample on the CPU took minutes with nothing on the screen: each step of the setup is now a log line."""
    from sparse_eval.run.experiment import Experiment
    from sparse_eval.run.run_config import run_config

    ruler = ("task=ruler", "task.length=512", "task.haystack=noise", "task.subtasks=[niah_single_1]")
    with caplog.at_level(logging.INFO, logger="sparse_eval"):
        Experiment(run_config(cfg_for(tmp_path / "runs", *ruler, "task.num_samples=1", "method=full"))).samples()
        run(cfg_for(tmp_path / "runs", "method=full", "task.num_samples=1", "task.window=64", "print_table=false"))
    said = [r.getMessage() for r in caplog.records]
    steps = [
        "loading the model stories260k from ",
        "model loaded in ",
        "ruler: generating 1 sample of 1 subtask at 512 tokens with the model's tokenizer",
        "ruler: niah_single_1: 1 sample at 512 tokens in ",
        "task ruler: 1 samples made in ",
        "loading the model stories260k from ",
        "task wikitext: 1 samples made in ",
        "full: running 1 of 1 samples (64 tokens the longest)",
    ]
    at = [next((i for i, m in enumerate(said) if m.startswith(step)), None) for step in steps]
    assert None not in at, [s for s, i in zip(steps, at) if i is None]
    assert at[:5] == sorted(at[:5]) and at[5:] == sorted(at[5:]), said


@pytest.mark.slow  # loads the GGUF tokenizer (10-15 s); tests/models/test_tokenizer_check.py tests the check
def test_the_tokenizer_check_says_what_it_does(caplog):
    from sparse_eval.models.loading import ModelConfig, load_tokenizer

    gguf = Path("~/.cache/sparse_eval/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()
    if not gguf.exists():
        pytest.skip(f"{gguf} not present (scripts/get_smollm2.sh)")
    with caplog.at_level(logging.INFO, logger="sparse_eval"):
        load_tokenizer(ModelConfig(name="smollm2_135m", path=str(gguf.parent), gguf_file=gguf.name))
    assert f"checking the tokenizer against the vocabulary of {gguf.name}" in caplog.text
    assert "tokenizer checked in " in caplog.text
