"""benchmarks/project_ruler_hours.py: the step-time fit and where it writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import project_ruler_hours as proj  # noqa: E402


def _record(path: Path, context: int, steps: dict[str, float]) -> Path:
    rows = [{"method": m, "est_error_on": True, "ms_per_step": t, "first_step_ms": 2 * t} for m, t in steps.items()]
    rec = {"args": {"batch": 8, "context": context}, "prefill_ms": context / 10.0, "rows": rows, "device": "cpu"}
    path.write_text(json.dumps(rec))
    return path


def test_a_step_that_falls_with_the_context_is_projected_flat_at_the_largest(tmp_path, capsys):
    a = _record(tmp_path / "a.json", 8192, {"full": 20.0, "quest": 120.0})
    b = _record(tmp_path / "b.json", 16384, {"full": 30.0, "quest": 100.0})
    _, recs = proj.load([a, b])
    assert proj.fit_step(recs, "quest") == (120.0, 0.0)
    assert "quest: ms_per_step falls with the context" in capsys.readouterr().out
    a_full, b_full = proj.fit_step(recs, "full")
    assert abs(a_full + b_full * 8192 - 20.0) < 1e-6 and abs(a_full + b_full * 16384 - 30.0) < 1e-6


def test_out_may_be_a_folder(tmp_path):
    a = _record(tmp_path / "a.json", 8192, {"full": 20.0})
    b = _record(tmp_path / "b.json", 16384, {"full": 30.0})
    out = tmp_path / "o"
    out.mkdir()
    assert proj.main([str(a), str(b), "--out", str(out)]) == 0
    rec = json.loads((out / "table3_projection.json").read_text())
    assert rec["batch"] == 8 and rec["rows"][0]["row"] == "full" and rec["rows"][0]["total_hours"] > 0
