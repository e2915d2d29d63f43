"""What a new user hit (issue 52), each checked: a read-only runs folder refused before the model loads, a corrupt
line of samples.jsonl reported and its sample recomputed (and ``status`` not calling the run complete), and the
setup of a run saying what it does."""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sparse_eval.config import CONF_DIR, register_configs
from sparse_eval.runner import run

register_configs()


def cfg_for(runs: Path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"paths.runs_dir={runs}", *overrides])


# -- a runs folder that cannot be written: refused before the model loads -----------------------------------------


def _no_load(monkeypatch):
    import sparse_eval.experiment as experiment

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
    assert "paths.runs_dir=runs" in msg and f"python -m sparse_eval.collect {store}" in msg and "\n" not in msg
    assert list(store.iterdir()) == []


def test_a_runs_folder_that_cannot_be_made_is_refused_before_the_model_loads(monkeypatch):
    _no_load(monkeypatch)
    with pytest.raises(ValueError, match=r"^paths.runs_dir=/proc/runs: cannot write /proc/runs \(.* at /proc\); give"):
        run(cfg_for(Path("/proc/runs"), "method=full", "task.num_samples=1", "task.window=64"))
