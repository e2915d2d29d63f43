"""Incomplete never passes for complete: a run with a failed sample is not done (status, collect, report), the
same command retries only the failed samples, samples run in a stratified order, and comparisons use only the
samples both runs finished."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import cfg_for

from sparse_eval.launcher.runner import run

OVER = ("task.num_samples=3", "task.window=64")


def _lines(run_dir) -> list[str]:
    return Path(run_dir, "samples.jsonl").read_text().splitlines()


def test_failed_sample_is_never_done_and_the_same_command_retries_only_it(tmp_path, monkeypatch):
    from sparse_eval.results.collect import collect
    from sparse_eval.report.tables import score_intervals, to_markdown
    from sparse_eval.results.status import run_state
    from sparse_eval.tasks.wikitext import Wikitext as WikiText

    (full,) = run(cfg_for(tmp_path, "method=full", *OVER))
    orig = WikiText.run
    seen: list[str] = []

    def flaky(self, sample, engine):
        seen.append(sample.id)
        if sample.id == "w00001":
            raise RuntimeError("boom")
        return orig(self, sample, engine)

    monkeypatch.setattr(WikiText, "run", flaky)
    (topk,) = run(cfg_for(tmp_path, "method=topk", *OVER))
    assert topk["failed"] == 1 and topk["samples"] == 2 and topk["complete"] is False
    state = run_state(Path(topk["run_dir"]))
    assert state["state"] == "incomplete" and state["complete"] is False
    assert run_state(Path(full["run_dir"]))["state"] == "done"

    df = collect(tmp_path)
    row = df[df.method == "topk"].iloc[0]
    assert row.state == "incomplete" and not row.complete and row.failed_samples == 1
    assert row.n_paired == 2  # compared with full attention on the 2 samples both finished
    assert row.significant is None or row.significant != row.significant  # no claim from an incomplete run
    assert row.pooled_significant is None or row.pooled_significant != row.pooled_significant
    md = to_markdown(score_intervals(df))
    line = next(x for x in md.splitlines() if "| TopK" in x)
    assert "incomplete: 2/3" in line and " *" not in line and "never marked significant" in md
    out = subprocess.run(
        [sys.executable, "-m", "sparse_eval.results.status", str(tmp_path)],
        cwd=Path(__file__).resolve().parents[2],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 done, 1 incomplete" in out.stdout, out.stdout

    # the same command: only the failed sample runs again; the finished ones are kept as they were
    kept = [x for x in _lines(topk["run_dir"]) if '"w00001"' not in x]
    seen.clear()
    monkeypatch.setattr(WikiText, "run", lambda self, s, e: seen.append(s.id) or orig(self, s, e))
    (again,) = run(cfg_for(tmp_path, "method=topk", *OVER))
    assert seen == ["w00001"]
    assert again["complete"] is True and again["failed"] == 0 and again["samples"] == 3
    assert _lines(topk["run_dir"])[:2] == kept
    assert run_state(Path(topk["run_dir"]))["state"] == "done"
    row = collect(tmp_path).query("method == 'topk'").iloc[0]
    assert row.complete and row.state == "done" and row.n_paired == 3


def test_keeping_the_errors_leaves_the_run_incomplete(tmp_path, monkeypatch):
    """eval.rerun_failed=false keeps a failed sample's error: the run is read back as incomplete, not rerun."""
    from sparse_eval.results.status import run_state
    from sparse_eval.tasks.wikitext import Wikitext as WikiText

    orig = WikiText.run

    def flaky(self, sample, engine):
        if sample.id == "w00002":
            raise RuntimeError("boom")
        return orig(self, sample, engine)

    monkeypatch.setattr(WikiText, "run", flaky)
    (first,) = run(cfg_for(tmp_path, "method=full", *OVER))
    monkeypatch.setattr(WikiText, "run", lambda *a: pytest.fail("a sample ran again"))
    (kept,) = run(cfg_for(tmp_path, "method=full", *OVER, "eval.rerun_failed=false"))
    assert kept["failed"] == 1 and not kept["complete"]
    assert run_state(Path(first["run_dir"]))["state"] == "incomplete"


def test_comparisons_use_only_the_samples_both_finished():
    from sparse_eval.results.collect import add_paired_differences
    from sparse_eval.metrics.statistics import ScoreTerms

    def terms(vals: dict[str, float]):
        return ScoreTerms(list(vals), list(vals.values()), [1.0] * len(vals), [0] * len(vals))

    base = {"model": "m", "task_config": "{}", "protocol": "A", "subtask": "all", "length": 8}
    ref = {f"s{i}": 100.0 for i in range(20)}
    worse = {f"s{i}": 0.0 for i in range(20) if i not in (3, 7)}  # finished 18 of 20
    rows = [
        dict(base, method="full", complete=True, _terms=terms(ref)),
        dict(base, method="topk", complete=True, _terms=terms(worse)),
        dict(base, method="quest", complete=False, _terms=terms(worse)),
    ]
    add_paired_differences(rows)
    assert rows[1]["n_paired"] == 18 and rows[1]["diff_vs_full"] == -100.0 and rows[1]["significant"] is True
    assert rows[2]["n_paired"] == 18 and rows[2]["diff_vs_full"] == -100.0 and rows[2]["significant"] is None


# -- the order samples run in -----------------------------------------------------------------------------------


def _shares_ok(order_strata: list, sizes: dict, slack: float) -> bool:
    total = sum(sizes.values())
    counts = dict.fromkeys(sizes, 0)
    for m, g in enumerate(order_strata, start=1):
        counts[g] += 1
        if any(abs(counts[h] - m * sizes[h] / total) > slack for h in sizes):
            return False
    return True


def test_every_prefix_of_the_order_holds_each_subtasks_share():
    from sparse_eval.run.ordering import stratified_order

    sizes = {f"t{k}": n for k, n in enumerate([50] * 10 + [20, 7, 1])}
    ids = [f"{g}-{i:04d}" for g, n in sizes.items() for i in range(n)]  # the task's order: subtask by subtask
    strata = [i.split("-")[0] for i in ids]
    order = stratified_order(ids, strata)
    assert sorted(order) == list(range(len(ids)))
    assert _shares_ok([strata[p] for p in order], sizes, slack=1.0)
    assert not _shares_ok(strata, sizes, slack=1.0)  # the task's own order is not
    # within a subtask the order is a fixed shuffle of the ids, not their index order
    t0 = [ids[p] for p in order if strata[p] == "t0"]
    assert t0 != sorted(t0) and stratified_order(ids, strata) == order


def test_batches_keep_the_strata_at_window_boundaries_and_length_inside():
    """The runner's order (``Batcher``): stratified at every window of ORDER_WINDOW_BATCHES batches, each window
    sorted by prompt length, longest first; a resumed run keeps the same order for what is left."""
    from sparse_eval.run.ordering import ORDER_WINDOW_BATCHES
    from sparse_eval.run.batching import Batcher

    sizes = {"a": 24, "b": 12, "c": 12}
    samples = [
        SimpleNamespace(id=f"{g}-{i:02d}", data={"subtask": g, "n": 100 + (7 * i + 3 * len(g)) % 41})
        for g, n in sizes.items()
        for i in range(n)
    ]
    task = SimpleNamespace(request=lambda s: SimpleNamespace(input_ids=[0] * s.data["n"]))
    spec = SimpleNamespace(samples=lambda: samples, eval=SimpleNamespace(prefill_chunk=None), protocol="A")
    b = Batcher.__new__(Batcher)
    b.spec, b.task, b.size = spec, task, 4
    order = b._order(samples)
    window = b.size * ORDER_WINDOW_BATCHES
    total = len(samples)
    for end in range(window, total + 1, window):
        prefix = [s.data["subtask"] for s in order[:end]]
        assert all(abs(prefix.count(g) - end * n / total) <= 1 for g, n in sizes.items()), end
        lengths = [s.data["n"] for s in order[end - window : end]]
        assert lengths == sorted(lengths, reverse=True)
    rest = b._order(samples[5:30])
    assert {s.id for s in rest} == {s.id for s in samples[5:30]}
