"""The run store's files (``sparse_eval.results.store``): JSON written whole or not at all and read back tolerantly, a
run's start record, its summary, failure records, and finding run directories."""

from __future__ import annotations

import json

from sparse_eval.results import store


def test_json_written_whole_and_read_tolerantly(tmp_path):
    path = tmp_path / "sub" / "x.json"
    store.write_json(path, {"b": 1.5, "a": [1, 2]})
    assert store.read_json(path) == {"a": [1, 2], "b": 1.5}
    assert [p.name for p in path.parent.iterdir()] == ["x.json"]  # no temporary file left behind
    path.write_text('{"a": ', encoding="utf-8")  # torn by a kill
    assert store.read_json(path) is None
    assert store.read_json(tmp_path / "missing.json") is None


def test_record_start_keeps_the_first_provenance(tmp_path):
    run_dir = tmp_path / "task" / "model" / "full-abc"
    identity = {"method": {"name": "full"}, "task": {"name": "wikitext"}, "model": {"name": "m"}}
    store.record_start(run_dir, identity)
    meta = store.read_json(run_dir / store.META_FILE)
    assert {"git", "versions", "hardware", "argv", "started"} <= set(meta)
    (run_dir / store.META_FILE).write_text(json.dumps({"started": "first"}), encoding="utf-8")
    store.record_start(run_dir, identity)
    assert store.read_json(run_dir / store.META_FILE) == {"started": "first"}
    assert store.read_identity(run_dir) == identity
    assert store.find_run_dirs(tmp_path) == [run_dir]


def test_a_restart_from_other_code_is_flagged(tmp_path):
    from sparse_eval.results.collect import _provenance

    run_dir = tmp_path / "task" / "model" / "full-abc"
    store.record_start(run_dir, {"method": {"name": "full"}, "task": {"name": "wikitext"}, "model": {"name": "m"}})
    store.record_resume(run_dir, 448)
    meta = store.read_json(run_dir / store.META_FILE)
    assert meta["resumes"][0]["done_at_start"] == 448
    same = _provenance(meta)
    assert (same["segments"], same["mixed_provenance"]) == (2, False)
    assert same["git_commits"] == str(meta["git"]["commit"])
    meta["resumes"][0]["git"] = {"commit": "b" * 40, "dirty": False}
    other = _provenance(meta)
    assert other["mixed_provenance"] is True
    assert other["git_commits"] == f"{meta['git']['commit']};{'b' * 40}"
    meta["resumes"][0] = {**meta["resumes"][0], "git": meta["git"], "versions": {**meta["versions"], "torch": "0"}}
    assert _provenance(meta)["mixed_provenance"] is True  # another torch
    assert _provenance({"git": {"commit": "a"}})["segments"] == 1  # a record from before resumes were kept


def test_each_segment_records_where_it_started_and_stopped(tmp_path):
    """The first start and every restart with samples to write (one that found none included: the process before
    it stopped before its first sample) is a segment of meta.json with its counts at start and at end."""
    run_dir = tmp_path / "task" / "model" / "full-abc"
    identity = {"method": {"name": "full"}, "task": {"name": "wikitext"}, "model": {"name": "m"}}
    assert store.record_start(run_dir, identity) is True
    store.record_segment(run_dir, 0, first=True)
    store.record_segment_end(run_dir, 0)  # stopped before its first sample
    assert store.record_start(run_dir, identity) is False
    store.record_segment(run_dir, 0, first=False)
    store.record_segment_end(run_dir, 3)
    store.record_segment(run_dir, 3, first=False)  # then killed: no end on record
    meta = store.read_json(run_dir / store.META_FILE)
    assert (meta["done_at_start"], meta["done_at_end"]) == (0, 0)
    assert [(r["done_at_start"], r.get("done_at_end")) for r in meta["resumes"]] == [(0, 3), (3, None)]
    assert {"git", "versions", "hardware", "argv", "started"} <= set(meta["resumes"][1])


def test_summary_failure_and_progress_files(tmp_path):
    store.write_summary(tmp_path, {"score": float("nan"), "metrics": {"ppl": 2.0}, "per_layer": {"cost1": [0.1]}})
    assert store.read_json(tmp_path / store.SUMMARY_FILE)["score"] is None  # NaN never reaches a result file
    csv = (tmp_path / store.SUMMARY_CSV).read_text(encoding="utf-8").splitlines()[0].split(",")
    assert "metrics.ppl" in csv and not any("per_layer" in c for c in csv)
    store.write_progress(tmp_path, expected_samples=5, already_done=2)
    progress = store.read_json(tmp_path / store.PROGRESS_FILE)
    assert (progress["expected_samples"], progress["done_at_start"]) == (5, 2) and progress["host"]
    try:
        raise ValueError("bad value")
    except ValueError as exc:
        store.write_failure(tmp_path, exc)
    assert store.read_json(tmp_path / store.FAILED_FILE)["error"] == "ValueError: bad value"
    store.clear_failure(tmp_path)
    store.clear_failure(tmp_path)  # nothing to clear: no error
    assert not (tmp_path / store.FAILED_FILE).exists()
