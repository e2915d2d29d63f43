"""The launch cache (``sparse_eval.launcher.launch_cache``): a relaunch whose runs all finished is answered from their
saved results without loading the model or making samples; anything changed, missing or unfinished takes the normal
path."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from sparse_eval.launcher import launch_cache, runner
from sparse_eval.run import experiment
from sparse_eval.config import CONF_DIR, register_configs
from sparse_eval.results.store import SAMPLES_FILE, SUMMARY_FILE

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "sparse_eval" / "models" / "stories260K"
SHIPPED_CAL = REPO / "sparse_eval" / "calibration" / "stories260k.json"
register_configs()


@pytest.fixture(autouse=True)
def _private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture()
def setup(tmp_path):
    """A private copy of the model and of DS's calibration file (so the tests may touch them), and a config."""
    model, cal = tmp_path / "model", tmp_path / "cal" / "cal.json"  # folders the launch does not write to
    shutil.copytree(STORIES, model)
    cal.parent.mkdir()
    shutil.copy(SHIPPED_CAL, cal)

    def cfg(*overrides):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            return compose(
                config_name="config",
                overrides=[
                    f"paths.runs_dir={tmp_path / 'runs'}",
                    "task.window=64",
                    "task.num_samples=2",
                    "model.name=mine",
                    f"model.path={model}",
                    "~method",
                    "compare=[full,{name: double_sparsity, channels_file: " + str(cal) + "}]",
                    *overrides,
                ],
            )

    return model, cal, cfg


def _entries(cfg):
    return sorted(Path(cfg.paths.runs_dir, launch_cache.LAUNCH_DIR).glob("*.json"))


def _forbid_loading(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("the model was loaded for a finished launch")

    monkeypatch.setattr(experiment.Experiment, "__init__", refuse)


def _loads(monkeypatch):
    """Counts the Experiments made (each is a normal-path launch)."""
    made = []
    orig = experiment.Experiment.__init__
    monkeypatch.setattr(experiment.Experiment, "__init__", lambda self, cfg: made.append(1) or orig(self, cfg))
    return made


def test_finished_launch_is_answered_without_loading(setup, monkeypatch, capsys):
    _, _, cfg = setup
    first = runner.run(cfg())
    (entry,) = _entries(cfg())
    rec = json.loads(entry.read_text())
    assert rec["run_dirs"] == [s["run_dir"] for s in first]
    paths = {f["path"] for f in rec["files"]}
    assert any(p.endswith("model.safetensors") for p in paths) and any(p.endswith("cal.json") for p in paths)
    assert all({"path", "size", "mtime_ns"} <= set(f) for f in rec["files"])
    normal = capsys.readouterr().out
    _forbid_loading(monkeypatch)
    again = runner.run(cfg())
    out = capsys.readouterr().out
    assert [s["run_dir"] for s in again] == [s["run_dir"] for s in first]
    assert [s["score"] for s in again] == [s["score"] for s in first]
    assert "all results were already saved there: reused, nothing recomputed" in out
    table = lambda text: [l for l in text.splitlines() if l.split()[:1] in (["full"], ["double_sparsity"])]
    assert table(out) == table(normal)  # the same rows as the first launch printed
    assert runner.run(cfg("print_table=false")) == again  # output-only settings share the entry


@pytest.mark.parametrize(
    "change", ["model_file", "calibration_file", "run_dir_deleted", "incomplete", "failed", "config"]
)
def test_anything_changed_takes_the_normal_path(setup, monkeypatch, change):
    model, cal, cfg = setup
    first = runner.run(cfg())
    run_dir = Path(first[1]["run_dir"])  # double_sparsity's
    overrides = []
    if change == "model_file":  # the same size, one byte changed: the fingerprint differs, a new run directory
        f = model / "model.safetensors"
        data = bytearray(f.read_bytes())
        data[-1] ^= 1
        f.write_bytes(bytes(data))
    elif change == "calibration_file":
        cal.write_text(cal.read_text() + " ")  # same channels, new bytes: a new run directory
    elif change == "run_dir_deleted":
        shutil.rmtree(run_dir)
    elif change == "incomplete":  # a sample ended in an error: the relaunch retries it
        recs = [json.loads(l) for l in (run_dir / SAMPLES_FILE).read_text().splitlines()]
        recs[0] = {"id": recs[0]["id"], "status": "error", "error": "boom", "time_s": 0.0}
        (run_dir / SAMPLES_FILE).write_text("".join(json.dumps(r) + "\n" for r in recs))
        os.utime(run_dir / SUMMARY_FILE)
        from sparse_eval.results.status import run_state

        assert run_state(run_dir)["state"] == "incomplete"
    elif change == "failed":
        (run_dir / "failed.json").write_text(json.dumps({"error": "RuntimeError: x"}))
    elif change == "config":
        overrides = ["eval.query_chunk=256"]  # no result changes, but the key does: a miss, never a wrong skip
    made = _loads(monkeypatch)
    again = runner.run(cfg(*overrides))
    assert made, "a changed launch was answered from the cache"
    if change in ("calibration_file", "model_file"):
        assert again[-1]["run_dir"] != str(run_dir)
    else:
        assert [s["run_dir"] for s in again] == [s["run_dir"] for s in first]
    assert all(s["complete"] for s in again)
    made.clear()
    runner.run(cfg(*overrides))  # the normal path wrote a fresh entry: now answered at once
    assert not made


def test_moved_mtimes_with_the_same_content_still_hit(setup, monkeypatch):
    """A copy that moves every mtime (a checkout, a sync to another machine) but keeps the bytes: the recorded
    sha256 of each file and the entry names of each folder decide, and the launch is still answered at once."""
    model, cal, cfg = setup
    first = runner.run(cfg())
    (entry,) = _entries(cfg())
    rec = json.loads(entry.read_text())
    assert all("sha256" in f for f in rec["files"]) and all("listing" in d for d in rec["dirs"] if not d.get("absent"))
    for p in [*model.iterdir(), model, cal, cal.parent]:
        st = p.stat()
        os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _forbid_loading(monkeypatch)
    assert [s["run_dir"] for s in runner.run(cfg())] == [s["run_dir"] for s in first]


def test_a_file_added_to_a_watched_folder_is_a_miss(setup, monkeypatch):
    model, cal, cfg = setup
    runner.run(cfg())
    (cal.parent / "other.json").write_text("{}")  # the folder's listing changed
    made = _loads(monkeypatch)
    runner.run(cfg())
    assert made


def test_no_entry_without_files_to_stamp():
    """A hub model (no local files) or an input that is not a fingerprinted file: never cached."""
    files = {"/m/model.safetensors": {"size": 1, "mtime_ns": 1, "sha256": "a"}}
    local = {"model": {"fingerprint": {"files_sha256": "x"}}, "inputs": {"channels_file_sha256": "a"}}
    assert launch_cache.cacheable([local], files, 0) is None
    assert launch_cache.cacheable([{"model": {"fingerprint": {"hub_commit": "abc"}}}], files, 0)
    assert launch_cache.cacheable([dict(local, inputs={"channels_file_sha256": "missing"})], files, 0)
    assert launch_cache.cacheable([local], files, 1)  # data fetched from the hub
    assert launch_cache.launch_key({"logger": {"name": "wandb"}, "paths": {}}) is None
    assert launch_cache.launch_key({"model": {"trust_remote_code": True}, "paths": {}}) is None


def test_unwritable_entry_and_torn_entry_are_misses(setup, monkeypatch):
    _, _, cfg = setup
    runner.run(cfg())
    (entry,) = _entries(cfg())
    entry.write_text("{torn")
    made = _loads(monkeypatch)
    runner.run(cfg())
    assert made and json.loads(entry.read_text())["key"] == entry.stem  # rewritten whole


def test_a_calibration_file_appearing_in_the_user_folder_is_a_miss(tmp_path, monkeypatch):
    """Double Sparsity reads the user's calibration folder before the shipped file: a file written there (by
    ``calibrate``) after the launch gives a new run, never the cached one."""
    user = tmp_path / "user_calibration"  # absent at the first launch
    monkeypatch.setenv("SPARSE_EVAL_CALIBRATION_DIR", str(user))

    def cfg():
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            return compose(
                config_name="config",
                overrides=[
                    f"paths.runs_dir={tmp_path / 'runs'}",
                    "task.window=64",
                    "task.num_samples=1",
                    "method=double_sparsity",
                ],
            )

    (first,) = runner.run(cfg())
    assert _entries(cfg())
    user.mkdir()
    (user / "stories260k.json").write_text(SHIPPED_CAL.read_text() + " ")
    made = _loads(monkeypatch)
    (again,) = runner.run(cfg())
    assert made and again["run_dir"] != first["run_dir"]


def test_the_key_covers_the_whole_package():
    """The source hashed is the package's, not the launcher wing's folder (where this module lives since the house
    moved it: until then an edit to a method or a task left every finished launch cached)."""
    import sparse_eval

    assert launch_cache.PACKAGE_DIR == Path(sparse_eval.__file__).resolve().parent
    assert all((launch_cache.PACKAGE_DIR / d).is_dir() for d in launch_cache.OUTPUT_ONLY_SOURCES)


def test_an_edit_of_the_report_code_keeps_the_key_any_other_edit_changes_it(tmp_path, monkeypatch):
    """The report only reads finished results (never imported by a run): editing it must not send every finished
    launch down the normal path (on the H200 that cost a model load, 49 s, per finished job)."""
    pkg, conf = tmp_path / "sparse_eval", tmp_path / "conf"
    (pkg / "report").mkdir(parents=True)
    conf.mkdir()
    (pkg / "engine.py").write_text("x = 1\n")
    (pkg / "report" / "tables.py").write_text("t = 1\n")
    (conf / "config.yaml").write_text("a: 1\n")
    monkeypatch.setattr(launch_cache, "PACKAGE_DIR", pkg)
    monkeypatch.setattr(launch_cache, "CONF_DIR", conf)

    def key():
        monkeypatch.setattr(launch_cache, "_SOURCE_SHA", None)
        return launch_cache.source_sha256()

    first = key()
    (pkg / "report" / "tables.py").write_text("t = 2\n")
    assert key() == first
    (pkg / "engine.py").write_text("x = 2\n")
    second = key()
    assert second != first
    (conf / "config.yaml").write_text("a: 2\n")
    assert key() != second
