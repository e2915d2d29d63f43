"""Batched evaluation: chunked protocol-B contexts give a sample the tokens and statistics it gets alone, for every
method; rows that stopped and padding are not counted; resume after a kill in the middle of a batch; batch sizes.
(Records at batch 50, 7 and 1 under protocols A, B and S, bit for bit: ``test_invariance``.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import jsonl_records
from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine, GenerationRequest, LoglikelihoodRequest
from sparse_eval.methods import METHODS, build_method, make_config

# every registered method under the configs it declares for the end-to-end checks (``Method.model_contract_configs``:
# small budgets and static windows, so that it selects within these short prompts)
CONFIGS = {
    f"{name}-{i}": (name, opts)
    for name in sorted(METHODS)
    for i, opts in enumerate(METHODS[name].model_contract_configs())
}
STATS = ("cost1", "cost2", "kv_bytes", "static_frac", "est_error", "sparse_rows", "empty_selections")


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [[1] + torch.randint(3, 512, (n - 1,), generator=g).tolist() for n in lengths]


def _engine(model, tok, config, protocol, chunk=None):
    method = build_method(make_config(*CONFIGS[config]))
    method.setup(model, "stories260k")
    session = attach(model, method, Runtime(protocol))
    return session, Engine(model, tok, session, chunk)


def _rows(session, engine, requests):
    """(results, per-row recorder summaries) of one batch."""
    session.recorder.reset()
    res = engine.run_batch(requests)
    return res, [session.recorder.summary(row=i) for i in range(len(requests))]


def _assert_same_stats(a, b):
    for key in STATS:
        if a.get(key) is None or b.get(key) is None:
            assert a.get(key) == b.get(key), key
        else:
            assert a[key] == pytest.approx(b[key], rel=1e-5, abs=1e-5), key
    assert a["cost2_per_layer"].keys() == b["cost2_per_layer"].keys()
    for extra in set(a) - set(STATS):
        if isinstance(a[extra], float):
            assert a[extra] == pytest.approx(b[extra], rel=1e-5, abs=1e-5), extra


@pytest.mark.slow
@pytest.mark.parametrize("config", list(CONFIGS))
@torch.inference_mode()
def test_chunked_contexts_give_the_record_a_row_gets_alone(stories, config):
    """Protocol B with contexts prefilled densely in chunks of 16 and one sparse question call: each row of a batch
    gets the tokens and statistics it gets alone."""
    model, tok = stories
    prompts = _prompts([37, 52, 29])
    reqs = [
        GenerationRequest(p, max_new_tokens=6 + 2 * i, context_len=len(p) - 5 - i, key=f"s{i}")
        for i, p in enumerate(prompts)
    ]
    session, engine = _engine(model, tok, config, "B", 16)
    try:
        batch, batch_stats = _rows(session, engine, reqs)
        for i, r in enumerate(reqs):
            (alone,), (alone_stats,) = _rows(session, engine, [r])
            assert batch[i].tokens == alone.tokens and batch[i].stopped_by == alone.stopped_by
            assert batch_stats[i]["sparse_rows"] > 0
            _assert_same_stats(batch_stats[i], alone_stats)
    finally:
        detach(model)


@torch.inference_mode()
def test_stopped_rows_and_padding_are_not_counted(stories):
    """A row's sparse rows are exactly its own decode steps (padding, other rows and steps after it stopped
    excluded)."""
    model, tok = stories
    reqs = [
        GenerationRequest(p, max_new_tokens=n, key=str(n), stop_token_ids=[])
        for p, n in zip(_prompts([30, 50]), (2, 9))
    ]
    session, engine = _engine(model, tok, "topk-0", "A")
    try:
        _, stats = _rows(session, engine, reqs)
    finally:
        detach(model)
    heads, sparse_layers = 8, 3  # dense_layers [0, 1] of 5
    # max_new_tokens n: n - 1 decode passes after the prefill (the last token is not fed back)
    assert [s["sparse_rows"] for s in stats] == [1 * heads * sparse_layers, 8 * heads * sparse_layers]


@torch.inference_mode()
def test_oracle_draws_follow_the_sample_id(stories):
    """The same prompt under two sample ids draws differently; under one id it draws the same in any batch."""
    model, tok = stories
    (p,) = _prompts([60], seed=3)
    session, engine = _engine(model, tok, "oracle-0", "S")
    try:
        _, stats = _rows(
            session,
            engine,
            [LoglikelihoodRequest(p, key="a"), LoglikelihoodRequest(p, key="b"), LoglikelihoodRequest(p, key="a")],
        )
    finally:
        detach(model)
    assert stats[0]["est_error"] == stats[2]["est_error"]
    assert stats[0]["est_error"] != stats[1]["est_error"]


def test_resume_after_kill_in_the_middle_of_a_batch(tmp_path, monkeypatch):
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config

    over = ("method=oracle", "task.num_samples=6", "task.window=64", "eval.batch_size=4")
    exp = Experiment(run_config(cfg_for(tmp_path, *over)))
    orig = exp.task.score
    scored = []

    def dying(sample, result):
        if len(scored) == 5:  # the second sample of the second batch
            raise KeyboardInterrupt
        scored.append(sample.id)
        return orig(sample, result)

    monkeypatch.setattr(exp.task, "score", dying)
    with pytest.raises(KeyboardInterrupt):
        exp.run_method(exp.method_configs()[0])
    _, run_dir = exp.run_dir(exp.method_configs()[0])
    first = [r["id"] for r in jsonl_records(Path(run_dir, "samples.jsonl"))]
    assert len(first) == 4  # the first batch is stored; nothing of the killed batch is

    exp2 = Experiment(run_config(cfg_for(tmp_path, *over)))
    summary = exp2.run_method(exp2.method_configs()[0])
    ids = [r["id"] for r in jsonl_records(Path(run_dir, "samples.jsonl"))]
    assert sorted(ids) == [f"w{i:05d}" for i in range(6)]  # no sample lost or duplicated
    assert summary["samples"] == 6 and summary["batch_size"] == 2

    # the same run at batch 1 gives the same records
    one = Experiment(run_config(cfg_for(tmp_path / "one", *over[:-1])))
    s1 = one.run_method(one.method_configs()[0])
    assert s1["score"] == pytest.approx(summary["score"], rel=1e-5)
    assert s1["est_error"] == pytest.approx(summary["est_error"], rel=1e-5)


def test_batch_size_is_checked_at_start(tmp_path):
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config

    for bad in ("0", "many"):
        with pytest.raises(ValueError, match="eval.batch_size"):
            Experiment(run_config(cfg_for(tmp_path, "method=full", f"eval.batch_size={bad}")))


def test_out_of_memory_alone_stops_the_run_without_recording_a_failure(tmp_path, monkeypatch):
    """A sample out of memory even alone (another process took the GPU, say) is not a failed sample: the run
    stops with an error, the samples that finished are kept, and the same command resumes the rest."""
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config
    from sparse_eval.results.store import SAMPLES_FILE, read_samples

    cfg = cfg_for(tmp_path, "method=topk", "task.num_samples=4", "task.window=64", "eval.batch_size=2")
    exp = Experiment(run_config(cfg))
    orig = exp.task.run_batch

    def full_device(samples, engine):
        if samples[0].id == exp.samples()[2].id or (len(samples) > 1 and exp.samples()[2] in samples):
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return orig(samples, engine)

    monkeypatch.setattr(exp.task, "run_batch", full_device)
    _, run_dir = exp.run_dir(exp.method_configs()[0])
    with pytest.raises(RuntimeError, match="out of memory running one sample alone"):
        exp.run_method(exp.method_configs()[0], run_dir)
    recs = read_samples(run_dir / SAMPLES_FILE)
    assert all(r["status"] == "ok" for r in recs.values()) and exp.samples()[2].id not in recs
    assert len(recs) >= 2
    monkeypatch.setattr(exp.task, "run_batch", orig)
    summary = exp.run_method(exp.method_configs()[0], run_dir)
    assert summary["samples"] == 4 and summary["failed"] == 0


def _room_for_two_rows(exp, monkeypatch) -> list[int]:
    """``exp``'s task runs a batch of at most 2 rows; a larger one raises out-of-memory.  Returns the list that the
    size of every batch tried is appended to."""
    orig, sizes = exp.task.run_batch, []

    def small_memory(samples, engine):
        sizes.append(len(samples))
        if len(samples) > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return orig(samples, engine)

    monkeypatch.setattr(exp.task, "run_batch", small_memory)
    return sizes


def test_auto_batch_halves_on_out_of_memory(tmp_path, monkeypatch):
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config

    exp = Experiment(
        run_config(cfg_for(tmp_path, "method=topk", "task.num_samples=5", "task.window=64", "eval.batch_size=auto"))
    )
    sizes = _room_for_two_rows(exp, monkeypatch)
    summary = exp.run_method(exp.method_configs()[0])
    assert sizes == [5, 2, 2, 1] and summary["batch_size"] == 2
    assert summary["samples"] == 5 and summary["failed"] == 0


@pytest.mark.parametrize("invariant", [True, False])
def test_a_fixed_batch_halves_on_out_of_memory_only_where_records_do_not_depend_on_it(tmp_path, monkeypatch, invariant):
    """eval.batch_size=4 out of memory: batch-invariant, the batch is halved and the smaller size kept (a GPU shared
    with other jobs must not send every batch through one-at-a-time), the records those of an unhindered run; in the
    plain mode, where a record depends on its batch, the failing batch runs one sample at a time as before."""
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config
    from sparse_eval.results.store import SAMPLES_FILE, read_samples

    args = ["method=topk", "task.num_samples=5", "task.window=64", "eval.batch_size=4"]
    args.append(f"eval.batch_invariant={str(invariant).lower()}")
    exp = Experiment(run_config(cfg_for(tmp_path / "a", *args)))
    sizes = _room_for_two_rows(exp, monkeypatch)
    _, run_dir = exp.run_dir(exp.method_configs()[0])
    summary = exp.run_method(exp.method_configs()[0], run_dir)
    assert summary["samples"] == 5 and summary["failed"] == 0
    assert sizes == ([4, 2, 2, 1] if invariant else [4, 1, 1, 1, 1, 1])
    if invariant:
        ref = Experiment(run_config(cfg_for(tmp_path / "b", *args)))
        _, ref_dir = ref.run_dir(ref.method_configs()[0])
        ref.run_method(ref.method_configs()[0], ref_dir)
        got, want = read_samples(run_dir / SAMPLES_FILE), read_samples(ref_dir / SAMPLES_FILE)
        drop = ("time_s", "batch")
        assert {k: {f: v for f, v in r.items() if f not in drop} for k, r in got.items()} == {
            k: {f: v for f, v in r.items() if f not in drop} for k, r in want.items()
        }
