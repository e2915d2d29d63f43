"""collect's score intervals and paired differences against full attention, on recorded RULER runs, and the
report's interval table."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from sparse_eval.results.collect import add_paired_differences, collect
from sparse_eval.metrics.statistics import ScoreTerms

RUNS = Path(__file__).resolve().parents[2] / "experiments" / "ruler_smollm2_intervals" / "runs_8k.tar.gz"


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


def test_rows_over_the_subtasks_full_attention_solves(tmp_path, capsys):
    """collect --full-at-least 30: one more row per run over only the subtasks on which full attention scores at
    least 30, scored, paired and reported like any row; the other rows and tables are unchanged."""
    with tarfile.open(RUNS) as tar:
        tar.extractall(tmp_path, filter="data")
    plain, df = collect(tmp_path), collect(tmp_path, full_at_least=30)
    full = df[(df["method"] == "full") & ~df["subtask"].isin(["all", "full>=30"])].set_index("subtask")
    solved = sorted(full.index[full["score"] >= 30])
    assert 1 < len(solved) < len(full)  # some subtasks, not all (niah_single_1 90 ... cwe 3 on this model)
    sub = df[df["subtask"] == "full>=30"].set_index("method")
    assert set(sub.index) == set(plain["method"]) and len(sub) == len(set(plain["method"]))
    assert (sub["subset_subtasks"] == ",".join(solved)).all()
    assert (sub["samples"] == 10 * len(solved)).all() and (sub["expected_samples"] == 10 * len(solved)).all()
    # RULER's aggregate is the mean over samples: with 10 samples per subtask, the mean of the solved subtasks'
    for method, r in sub.iterrows():
        parts = df[(df["method"] == method) & df["subtask"].isin(solved)]
        assert r["score"] == pytest.approx(parts["score"].mean())
        assert r["score_lo"] <= r["score"] <= r["score_hi"]
    assert sub.loc["full", "score"] >= 30 and sub.loc["full", "diff_vs_full"] == 0
    quest = df[(df["method"] == "quest")].set_index("subtask")
    assert sub.loc["quest", "diff_vs_full"] == pytest.approx(quest.loc["full>=30", "score"] - sub.loc["full", "score"])
    assert sub.loc["quest", "n_paired"] == 10 * len(solved)
    # every other row as without the option; the report's other tables do not see the new rows
    rest = df[df["subtask"] != "full>=30"].drop(columns=["subset_subtasks"]).reset_index(drop=True)
    cols = ["method", "subtask", "score", "score_lo", "score_hi", "diff_vs_full", "pooled_score", "samples"]
    assert rest[cols].equals(plain[cols])

    from sparse_eval.report.load import normalize
    from sparse_eval.report.tables import score_intervals, scores_where_full_solves, to_markdown

    assert to_markdown(score_intervals(normalize(df))) == to_markdown(score_intervals(normalize(plain)))
    md = to_markdown(scores_where_full_solves(normalize(df)))
    assert ",".join(solved) in md and "| Quest " in md
    table = [line for line in md.splitlines() if line.startswith("| smollm2")]
    assert len(table) == len(sub) and all(" 40 |" in line for line in table)  # n: the solved subtasks' samples


def test_no_rows_over_solved_subtasks_when_full_attention_is_incomplete(tmp_path, capsys):
    with tarfile.open(RUNS) as tar:
        tar.extractall(tmp_path, filter="data")
    (full_dir,) = [p for p in tmp_path.rglob("full-*") if p.is_dir()]
    samples = full_dir / "samples.jsonl"
    lines = samples.read_text().splitlines()
    samples.write_text("\n".join(lines[:-3]) + "\n")  # three samples lost: the run is incomplete
    df = collect(tmp_path, full_at_least=30)
    assert not (df["subtask"] == "full>=30").any()
    assert "full attention is incomplete" in capsys.readouterr().err


def test_report_of_a_runs_folder_takes_full_at_least_and_a_collected_table_refuses_it(tmp_path, capsys):
    from sparse_eval.report.__main__ import main as report_main

    runs = tmp_path / "runs"
    with tarfile.open(RUNS) as tar:
        tar.extractall(runs, filter="data")
    assert report_main([str(runs), "--out", str(tmp_path / "rep"), "--full-at-least", "30"]) == 0
    assert (tmp_path / "rep" / "tables" / "scores_where_full_solves.md").exists()
    collect(runs).to_csv(tmp_path / "results.csv", index=False)
    code = report_main([str(tmp_path / "results.csv"), "--out", str(tmp_path / "rep2"), "--full-at-least", "30"])
    assert code == 2 and not (tmp_path / "rep2").exists()
    assert "collect <runs> --full-at-least 30" in capsys.readouterr().err


LM_RUNS = Path(__file__).resolve().parents[2] / "experiments" / "lmeval_table1_smollm2" / "runs.tar.gz"


def test_lm_eval_rows_count_documents_not_pieces(tmp_path):
    """An lm-eval run's record is a piece of a task's documents (task.shards): collect's and the printed table's
    ``samples`` count the documents (GSM8K-CoT: 250 in 8 pieces), and so does ``expected_samples``, exactly once
    every piece finished and at the finished pieces' mean before, so that a run cut short still shows as such."""
    import json

    from sparse_eval.results.collect import _task, run_rows
    from sparse_eval.results.results_table import pool_seeds
    from sparse_eval.results.store import read_identity

    folder = "runs_lm/lm_eval/smollm2_135m/full-e41f22d7ad"  # full attention on GSM8K-CoT
    with tarfile.open(LM_RUNS) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.startswith(folder)], filter="data")
    run_dir = tmp_path / folder
    (row,) = run_rows(run_dir)
    assert (row["subtask"], row["samples"], row["expected_samples"], row["complete"]) == (
        "gsm8k_cot_local",
        250,
        250,
        True,
    )
    task = _task(read_identity(run_dir)["task"])
    summary = {**json.loads((run_dir / "summary.json").read_text()), "run_dir": str(run_dir)}
    (printed,) = pool_seeds(task, [summary])
    assert (printed["samples"], printed["expected_samples"]) == (250, 250)

    lines = (run_dir / "samples.jsonl").read_text().splitlines()
    (run_dir / "samples.jsonl").write_text("\n".join(lines[:6]) + "\n")  # 2 of the 8 pieces missing
    (short,) = run_rows(run_dir)
    done = sum(json.loads(line)["documents"] for line in lines[:6])
    assert short["samples"] == done < short["expected_samples"] == done + round(2 * done / 6)


def test_lengths_are_ordered_as_numbers(tmp_path):
    """The table's rows of one configuration run from the shortest context to the longest (4K before 16K), not in
    the text order of the lengths: the committed Qwen2.5-Coder-1.5B RULER runs at 4K-32K."""
    archive = Path(__file__).resolve().parents[2] / "experiments" / "ruler_qwen2_5_coder_1_5b" / "runs.tar.gz"
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, members=[m for m in tar.getmembers() if m.name.startswith("runs/q/ruler/")])
    df = collect(tmp_path / "runs" / "q")
    full = df[(df["method"] == "full") & (df["subtask"] == "all")]
    assert [int(x) for x in full["length"]] == [4096, 8192, 16384, 32768]
