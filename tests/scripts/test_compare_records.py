"""``scripts/compare_records.py``: two runs folders' records compared, provenance and times aside."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("compare_records", ROOT / "scripts" / "compare_records.py")
compare_records = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_records)

RUN = Path("ruler") / "m" / "magicpig-K=10-abc"


def _write(root: Path, preds: list[str], meta: dict | None = None) -> Path:
    d = root / RUN
    d.mkdir(parents=True)
    (d / "config.yaml").write_text("method: {name: magicpig}\n")
    lines = [json.dumps({"id": f"s{i}", "prediction": p, "time_s": 0.1 * i}) for i, p in enumerate(preds)]
    (d / "samples.jsonl").write_text("\n".join(lines) + "\n")
    (d / "meta.json").write_text(json.dumps(meta or {"git": {"commit": "a"}, "started": "t"}))
    return root


def test_identical_records_pass_whatever_their_provenance(tmp_path):
    a = _write(tmp_path / "a", ["x", "y"])
    b = _write(tmp_path / "b", ["x", "y"], {"git": {"commit": "b"}, "started": "u", "resumes": [{"done_at_start": 1}]})
    assert compare_records.compare(a, b) == ([], 1, 2)


def test_a_changed_record_is_reported(tmp_path):
    a = _write(tmp_path / "a", ["x", "y"])
    b = _write(tmp_path / "b", ["x", "z"])
    diffs, _, _ = compare_records.compare(a, b)
    assert diffs == [f"{RUN}: samples.jsonl differs (1 of 2 records)"]


def test_a_partial_rerun_is_compared_on_the_samples_both_finished(tmp_path):
    a = _write(tmp_path / "a", ["x", "y", "w"])
    b = _write(tmp_path / "b", ["x", "y"])
    assert compare_records.compare(a, b)[0] == [f"{RUN}: samples.jsonl differs"]  # whole runs: not the same
    assert compare_records.compare(a, b, shared_samples=True) == ([], 1, 2)
    c = _write(tmp_path / "c", ["x", "q"])
    assert compare_records.compare(a, c, shared_samples=True)[0] == [f"{RUN}: samples.jsonl differs (1 of 2 records)"]
    assert compare_records.main([str(a), str(c), "--shared-samples"]) == 1
