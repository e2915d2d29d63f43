"""Running model × method × task, as ``python -m sparse_eval`` and each multirun job do: every run is a pure
function of its config (so sweeps can skip and resume).

``run(cfg)`` answers a launch whose runs all finished from the launch cache (``launch_cache``) without
importing torch or loading the model; otherwise it checks every method before any run starts (``Experiment``,
``sparse_eval.run.experiment``: the model, the data, memory and time on the CPU), runs or reads back each method's run
under its run dir's lock, records a failure in the run dir, and prints the table (``results.results_table``).

The parts: ``run_config`` (the config's methods composed and checked), ``experiment`` (one run's work),
``batching`` (order, batches, out-of-memory), ``wandb_logger``, ``results_table`` and ``statistics`` (the table
and the intervals).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from . import launch_cache
from ..identity.fingerprint import recording
from ..results.results_table import print_results
from ..results.status import run_state
from ..results.store import (
    PROGRESS_FILE,
    SUMMARY_FILE,
    RunsDirError,
    check_runs_dir,
    check_writable,
    clear_failure,
    read_json,
    run_lock,
    write_failure,
)

log = logging.getLogger("sparse_eval")


def _reused(run_dir: Path) -> tuple[int, int]:
    """(samples already written when the run (re)started, samples expected), from its progress.json."""
    p = read_json(run_dir / PROGRESS_FILE) or {}
    return int(p.get("done_at_start") or 0), int(p.get("expected_samples") or 0)


def run(cfg: Any, use_cache: bool = True) -> list[dict[str, Any]]:
    """Run every method of ``cfg`` (or read back the finished ones) and print the table; returns the summaries.
    A launch whose runs all finished before is answered from the launch cache (``launch_cache``) without
    loading the model; ``use_cache=False`` skips that lookup (the caller made it).  After a launch whose every
    run finished, its cache entry is written."""
    from ..verdicts.claims import check_claims

    check_claims(cfg)  # a claim that cannot be tested is refused before anything runs (also when cached)
    if use_cache:
        hit = launch_cache.reuse(cfg)
        if hit is not None:
            return hit
    from ..tasks.base import HUB_READS  # the tasks (and torch) only once the cache did not answer

    check_runs_dir(cfg.paths.runs_dir)  # a runs folder that cannot be written: refused before the model loads

    started_ns, hub_reads = time.time_ns(), HUB_READS[0]
    with recording() as files:
        summaries, identities = _run(cfg)
    launch_cache.record(cfg, identities, summaries, files, HUB_READS[0] - hub_reads, started_ns)
    return summaries


def _run(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``run`` the normal way: loads the model and the samples, runs or reads back each method's run; returns
    (summaries, identities)."""
    from ..run.estimate import check_long
    from ..run.experiment import Experiment
    from ..run.memory import check_batch
    from ..run.run_config import run_config

    exp = Experiment(run_config(cfg))  # the config typed and checked once: nothing below reads it raw
    methods = [exp.preflight(m) for m in exp.method_configs()]  # a run that cannot start writes nothing
    spec = exp.spec()
    check_batch(spec, [m.config for m in methods], exp.samples())  # memory (MagicPIG's tables; on the CPU, the batch)
    check_long(spec, methods, log)  # on the CPU, over an hour: refused unless eval.allow_long=true
    summaries, identities = [], []
    reused: list[tuple[int, int]] = []  # per run: (samples already saved at its start, expected)
    for m in methods:
        identity, run_dir = exp.run_dir(m)
        identities.append(identity)
        unwritable = check_writable(run_dir)
        if unwritable:  # a read-only store: a finished run is read back, anything else is refused
            state = run_state(run_dir)["state"]
            if state == "done" or (state == "incomplete" and not cfg.eval.rerun_failed):
                summaries.append(json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8")))
                reused.append((summaries[-1]["samples"], summaries[-1]["samples"]))
                continue
            raise RunsDirError(
                f"paths.runs_dir={cfg.paths.runs_dir}: cannot write {unwritable}; give a writable "
                f"folder, e.g. paths.runs_dir=runs"
            )
        try:
            with run_lock(run_dir):  # one process per run dir: a duplicate job waits, then finds the samples done
                clear_failure(run_dir)
                summaries.append(exp.run_method(m, run_dir, identity))
            reused.append(_reused(run_dir))
        except KeyboardInterrupt as exc:  # nothing to record: the run resumes at its next sample
            exc.run_dir = str(run_dir)  # type: ignore[attr-defined]
            raise
        except Exception as exc:  # recorded in the run dir (failed.json) for sweeps and `sparse_eval.results.status`
            try:
                write_failure(run_dir, exc)
            except OSError as werr:  # the store went away or read-only: the run's own error is what matters
                log.warning("could not record the failure in %s: %s", run_dir, werr)
            try:
                exc.run_dir = str(run_dir)  # type: ignore[attr-defined]
            except AttributeError:
                pass
            raise
    if cfg.print_table:
        print_results(exp.task, summaries, reused)
    return summaries, identities
