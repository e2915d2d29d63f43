"""``python -m sparse_eval.results.collect`` prints a table that fits the terminal: one row per configuration (seeds
pooled), one block per task, model and protocol, the least needed columns left out and the labels shortened when it
must; ``--wide`` prints the long view of every run, and ``results.csv`` holds every column."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparse_eval.results import collect

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "results" / "runs"


@pytest.mark.parametrize("columns", [80, 120])
def test_collect_fits_the_terminal(tmp_path, monkeypatch, capsys, columns):
    monkeypatch.setenv("COLUMNS", str(columns))
    assert collect.main([str(FIXTURE), "--out", str(tmp_path / "table")]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line) for line in lines[:-1]) <= columns, max(lines[:-1], key=len)  # the last: the files' paths
    assert "task=ruler model=llama3_1_8b_instruct protocol=A" in out and "magicpig K=10, L=120" in out
    assert "vs full [95% CI]" in out and "-30.5 [-31.1, -30] *" in out  # oracle 0.02 against full, significant
    assert "every column ->" in lines[-1]


def test_compact_rows_are_configurations_with_their_seeds_pooled(tmp_path, monkeypatch, capsys):
    """Three seeds of one configuration are one row, with the seed-pooled score and its seeds listed."""
    import pandas as pd

    from sparse_eval.results.terminal_table import format_compact

    base = {
        "task": "wikitext",
        "model": "m",
        "protocol": "S",
        "subtask": None,
        "length": None,
        "metric": "ppl",
        "stochastic": True,
        "interval_omits_seeds": False,
        "expected_samples": 4,
        "samples": 4,
        "complete": True,
        "state": "done",
        "method": "magicpig",
        "method.K": 10.0,
        "method.L": 150.0,
        "seed_group": "g",
        "seed_values": "0,1,2",
        "pooled_score": 120.0,
        "pooled_lo": 110.0,
        "pooled_hi": 130.0,
        "pooled_n": 4,
        "pooled_diff": 0.5,
        "pooled_diff_lo": 0.1,
        "pooled_diff_hi": 0.9,
        "pooled_significant": True,
        "cost2": 0.4,
        "est_error": 0.03,
    }
    df = pd.DataFrame([dict(base, seed=s, run_dir=f"r{s}", config_hash=f"h{s}", score=119 + s) for s in range(3)])
    text = format_compact(df, width=100)
    assert text.count("magicpig K=10, L=150") == 1 and "0,1,2" in text
    assert "120 [110, 130]" in text and "+0.5 [0.1, 0.9] *" in text


def test_wide_prints_every_run(tmp_path, capsys):
    assert collect.main([str(FIXTURE), "--out", str(tmp_path / "table"), "--wide"]) == 0
    out = capsys.readouterr().out
    assert "run_name" in out.splitlines()[0] and max(len(line) for line in out.splitlines()) > 200
