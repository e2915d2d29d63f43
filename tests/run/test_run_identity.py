"""A run's identity is what was loaded and read, not the names in its config.

* the model: a ``model.path`` overridden under a shipped config's name is filed under what was loaded, and
  replacing the weights in place gives another run directory;
* Double Sparsity's calibration file: rewriting it gives another run directory;
* ``calibrate`` writes to the user's folder (never into the package), prints the file, and the method finds it
  there before the shipped file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sparse_eval.config import register_configs
from sparse_eval.config import CONF_DIR
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config
from sparse_eval.results.store import run_dir_for

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "sparse_eval" / "models" / "stories260K"
SHIPPED_CAL = REPO / "sparse_eval" / "calibration" / "stories260k.json"
register_configs()


@pytest.fixture(autouse=True)
def _private_folders(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("SPARSE_EVAL_CALIBRATION_DIR", str(tmp_path / "user_calibration"))


def _cfg(tmp_path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(
            config_name="config",
            overrides=[f"paths.runs_dir={tmp_path / 'runs'}", "task.window=64", "task.num_samples=1", *overrides],
        )


def _run_dir(cfg) -> Path:
    exp = Experiment(run_config(cfg))
    return run_dir_for(cfg.paths.runs_dir, exp.identity(exp.method_configs()[0]))


def test_overridden_model_path_is_filed_under_what_was_loaded(tmp_path):
    other = tmp_path / "OtherModel"
    shutil.copytree(STORIES, other)
    shipped = _run_dir(_cfg(tmp_path, "method=full"))
    assert shipped.parent.name == "stories260k"
    cfg = _cfg(tmp_path, "method=full", f"model.path={other}")  # model.name is still stories260k
    exp = Experiment(run_config(cfg))
    ident = exp.identity(exp.method_configs()[0])
    assert ident["model"]["name"] == "OtherModel" and ident["model"]["given_name"] == "stories260k"
    assert ident["model"]["path"] == str(other)
    assert run_dir_for(cfg.paths.runs_dir, ident).parent.name == "OtherModel"
    # the same bytes: the same fingerprint; new weights in place under the same name and path: a new run
    assert (
        ident["model"]["fingerprint"]
        == Experiment(run_config(_cfg(tmp_path, "method=full"))).identity({"name": "full"})["model"]["fingerprint"]
    )
    named = _run_dir(_cfg(tmp_path, "method=full", f"model.path={other}", "model.name=mine"))
    assert named.parent.name == "mine"
    import torch
    from safetensors.torch import load_file, save_file

    w = load_file(other / "model.safetensors")
    key = sorted(w)[0]
    w[key] = w[key] + 0.01
    save_file(w, other / "model.safetensors", metadata={"format": "pt"})
    changed = _run_dir(_cfg(tmp_path, "method=full", f"model.path={other}", "model.name=mine"))
    assert changed.parent == named.parent and changed != named
    assert torch.is_tensor(w[key])


def test_rewritten_calibration_file_gives_a_new_run(tmp_path):
    cal = tmp_path / "cal.json"
    shutil.copy(SHIPPED_CAL, cal)
    overrides = ("method=double_sparsity", f"method.channels_file={cal}")
    before = _run_dir(_cfg(tmp_path, *overrides))
    assert _run_dir(_cfg(tmp_path, *overrides)) == before  # unchanged file: the run is found again
    data = json.loads(cal.read_text())
    head = data["channels"]["qk"][2][0]
    head[0], head[1] = head[1], head[0]
    cal.write_text(json.dumps(data))
    after = _run_dir(_cfg(tmp_path, *overrides))
    assert after != before and after.parent == before.parent


def test_calibrate_writes_to_the_user_folder_which_the_method_reads_first(tmp_path, monkeypatch, capsys):
    import sparse_eval.calibrate as calibrate
    from sparse_eval.methods.double_sparsity import default_channels_file

    # whatever the code under test does, the package's own files are never written by this test
    monkeypatch.setattr(calibrate, "CALIBRATION_DIR", tmp_path / "package_calibration", raising=False)
    text = tmp_path / "tiny.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She loved to play outside. " * 8)
    assert default_channels_file("stories260k") == SHIPPED_CAL
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="calibrate", overrides=[f"data={text}", "block_size=32"])
    out = calibrate.run(cfg)
    expected = tmp_path / "user_calibration" / "stories260k.json"
    assert out == expected and expected.is_file()
    assert str(expected.resolve()) in capsys.readouterr().out
    assert default_channels_file("stories260k") == expected  # the user's file before the shipped one
    cfg = _cfg(tmp_path, "method=double_sparsity")
    exp = Experiment(run_config(cfg))
    from sparse_eval.identity.fingerprint import file_sha256

    assert exp.identity(exp.method_configs()[0])["inputs"] == {"channels_file_sha256": file_sha256(expected)}


def test_collect_labels_rows_by_the_loaded_model(tmp_path):
    from sparse_eval.results.collect import collect
    from sparse_eval.launcher.runner import run

    other = tmp_path / "OtherModel"
    shutil.copytree(STORIES, other)
    (summary,) = run(_cfg(tmp_path, "method=full", f"model.path={other}", "print_table=false"))
    assert summary["model"] == "OtherModel" and summary["model_identity"]["given_name"] == "stories260k"
    df = collect(tmp_path / "runs")
    assert set(df["model"]) == {"OtherModel"} and set(df["model_path"]) == {str(other)}
    assert df["model_fingerprint"].notna().all()


def test_a_shipped_config_with_interpolated_path_keeps_its_name(tmp_path):
    from sparse_eval.models.loading import ModelConfig, model_label

    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    paths = {"models_dir": str(tmp_path / "models")}
    own = ModelConfig(name="smollm2_135m", path=f"{tmp_path}/models/smollm2-135m-instruct", gguf_file=gguf)
    assert model_label(own, paths) == "smollm2_135m"
    other = ModelConfig(name="smollm2_135m", path=str(tmp_path / "elsewhere"), gguf_file=gguf)
    assert model_label(other, paths) == "elsewhere-SmolLM2-135M-Instruct.Q4_1"
    assert model_label(ModelConfig(name="my_label", path=str(tmp_path / "elsewhere")), paths) == "my_label"


def test_task_data_files_are_part_of_the_identity(tmp_path):
    """A WikiText-2 file rewritten in place gives another run directory; the bundled text reads no data file."""
    data = tmp_path / "data" / "wikitext-2-raw"
    data.mkdir(parents=True)
    text = (REPO / "sparse_eval" / "data" / "wikitext2_test_head.txt").read_text()
    (data / "wikitext-test.txt").write_text(text)
    over = [
        "method=full",
        "task=wikitext",
        "task.window=64",
        "task.num_samples=1",
        f"paths.data_dir={tmp_path / 'data'}",
    ]
    exp = Experiment(run_config(_cfg(tmp_path, *over)))
    ident = exp.identity(exp.method_configs()[0])
    assert list(ident["data"]) == ["text"]
    first = _run_dir(_cfg(tmp_path, *over))
    (data / "wikitext-test.txt").write_text(text.replace(" the ", " a "))
    assert _run_dir(_cfg(tmp_path, *over)) != first
    bundled = Experiment(run_config(_cfg(tmp_path, "method=full")))
    assert "data" not in bundled.identity(bundled.method_configs()[0])
