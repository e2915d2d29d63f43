"""collect's score intervals and paired differences against full attention, on recorded RULER runs, and the
report's interval table."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from sparse_eval.collect import add_paired_differences, collect
from sparse_eval.statistics import ScoreTerms

RUNS = Path(__file__).resolve().parents[1] / "experiments" / "ruler_smollm2_intervals" / "runs_8k.tar.gz"


def _terms(vals, ids=None):
    ids = ids or [f"s{i}" for i in range(len(vals))]
    return ScoreTerms(ids, vals, [1.0] * len(vals), [0] * len(vals))


def test_pairs_only_rows_of_the_same_setting():
    base = {"model": "m", "task_config": "{}", "protocol": "A", "subtask": "all", "length": 8}
    rows = [
        dict(base, method="full", _terms=_terms([1.0, 0.0, 1.0, 1.0])),
        dict(base, method="topk", _terms=_terms([1.0, 0.0, 0.0, 1.0])),
        dict(base, method="topk", length=16, _terms=_terms([1.0, 1.0])),
    ]  # no full run at length 16
    add_paired_differences(rows)
    assert rows[0]["diff_vs_full"] == 0 and rows[0]["significant"] is None  # 4 samples: too few to claim either way
    assert rows[1]["diff_vs_full"] == pytest.approx(-0.25) and rows[1]["n_paired"] == 4
    assert rows[2]["diff_vs_full"] is None and rows[2]["significant"] is None
    assert all("_terms" not in r for r in rows)


def test_collect_and_report_on_recorded_runs(tmp_path):
    with tarfile.open(RUNS) as tar:
        tar.extractall(tmp_path, filter="data")
    df = collect(tmp_path)
    whole = df[df["subtask"] == "all"].set_index("method")
    assert set(whole.index) == {"full", "topk", "oracle", "magicpig", "quest", "double_sparsity"}
    assert (whole["samples"] == 130).all()
    assert ((whole["score_lo"] <= whole["score"]) & (whole["score"] <= whole["score_hi"])).all()
    assert whole.loc["full", "diff_vs_full"] == 0
    # Quest's loss at 8K is recorded as significant; TopK's is not (experiments/ruler_smollm2_intervals)
    assert whole.loc["quest", "diff_hi"] < 0 and bool(whole.loc["quest", "significant"])
    assert whole.loc["topk", "diff_lo"] < 0 < whole.loc["topk", "diff_hi"]
    # the paired interval of a method close to full is narrower than its own score interval
    assert (whole.loc["topk", "diff_hi"] - whole.loc["topk", "diff_lo"]) < (
        whole.loc["topk", "score_hi"] - whole.loc["topk", "score_lo"]
    )
    sub = df[(df["subtask"] == "niah_single_1") & (df["method"] == "full")]
    assert len(sub) == 1 and sub["samples"].iloc[0] == 10

    from sparse_eval.report.tables import score_intervals, to_markdown

    md = to_markdown(score_intervals(df))
    quest = next(line for line in md.splitlines() if "| Quest " in line)
    assert "130" in quest and " *" in quest and "95% CI" in md
