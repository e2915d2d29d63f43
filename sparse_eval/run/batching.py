"""A run's samples in batches: the processing order (``sparse_eval.run.ordering``), the batch halved on out-of-memory
(``eval.batch_size=auto``, or any size in the batch-invariant mode), a failing batch rerun one sample at a time, and
each sample's record (the task's fields and the session's statistics)."""

from __future__ import annotations

import logging
import time
import traceback
from typing import Any

import torch

from .memory import auto_batch_cap
from .ordering import ORDER_WINDOW_BATCHES, length_windows, sample_stratum, stratified_order
from .run_spec import RunSpec

log = logging.getLogger("sparse_eval")

RECORD_STATS = ("cost1", "cost2", "kv_bytes", "static_frac", "est_error", "mass", "topk_recall")
AUTO_BATCH_START = 128  # eval.batch_size=auto tries min(samples, this) first, then halves on out-of-memory


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))
    )


class Batcher:
    """Yields the records of the samples still to run, batch by batch, in the order of ``sparse_eval.run.ordering``
    (subtasks interleaved so that a partial run is an unbiased subset; within windows of a few batches, samples of
    similar prompt length together; under protocol S with ``prefill_chunk`` only samples whose lengths agree modulo
    the chunk share a batch, so each row sees its own chunk boundaries).  On out-of-memory the batch is halved, and
    the smaller size kept for the rest of the run, when ``eval.batch_size=auto`` or when the run is batch-invariant
    (``eval.batch_invariant``: a record does not depend on its batch, so a smaller batch changes only the time; a
    GPU shared with other jobs otherwise sent every batch of a fixed size through one-at-a-time, 10x slower); a batch
    that fails otherwise, or out of memory at a fixed size in the plain mode, is rerun one sample at a time, so a
    failing sample is recorded alone and the rest go on."""

    def __init__(self, spec: RunSpec, session: Any, engine: Any, todo: list[Any]):
        self.spec, self.session, self.engine = spec, session, engine
        self.task = spec.task
        want = spec.batch_size
        self.auto = want == "auto"
        # a smaller batch after out-of-memory changes a record only where the kernels depend on the batch
        self.halve_on_oom = self.auto or spec.eval.batch_invariant
        batched = self.task.batched and len(todo) > 1
        self.size = 1 if not batched else min(len(todo), AUTO_BATCH_START) if self.auto else want
        if self.auto:  # on the CPU: no larger than the rows that fit the host memory (sparse_eval.run.memory)
            self.size = auto_batch_cap(spec, session.method.config, todo, self.size)
        self.used: int | None = None
        self.todo = self._order(todo)

    def _order(self, todo: list[Any]) -> list[Any]:
        """``todo`` in the task's processing order (``ordering``: computed over all the task's samples, so a
        resumed run continues the same order), then sorted by length within windows of batches."""
        everything = self.spec.samples()
        want = {s.id for s in todo}
        ranked = [
            everything[i] for i in stratified_order([s.id for s in everything], [sample_stratum(s) for s in everything])
        ]
        order = [s for s in ranked if s.id in want]
        if self.size == 1:
            return order
        lengths = {s.id: len(self.task.request(s).input_ids) for s in order}
        chunk = self.spec.eval.prefill_chunk
        group = (lambda n: n % chunk) if chunk and self.spec.protocol == "S" else (lambda n: 0)
        return length_windows(
            order, self.size * ORDER_WINDOW_BATCHES, key=lambda s: (group(lengths[s.id]), -lengths[s.id])
        )

    def __iter__(self):
        i = 0
        while i < len(self.todo):
            batch = self._take(i)
            try:
                recs = self._run(batch)
            except Exception as exc:  # noqa: BLE001 - recorded per sample below
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                if self.halve_on_oom and len(batch) > 1 and is_out_of_memory(exc):
                    self._free()
                    self.size = max(1, len(batch) // 2)
                    log.warning("batch of %d out of memory; trying %d", len(batch), self.size)
                    continue
                if len(batch) == 1:
                    recs = [self._failed(batch[0], exc)]
                else:
                    log.warning("batch of %d failed (%r); running its samples one at a time", len(batch), exc)
                    self._free()
                    recs = []
                    for s in batch:
                        try:
                            recs += self._run([s])
                        except Exception as exc1:  # noqa: BLE001
                            if isinstance(exc1, (KeyboardInterrupt, SystemExit)):
                                raise
                            recs.append(self._failed(s, exc1))
                if any(r.get("oom") for r in recs):  # not the samples' fault: stop, keeping what finished
                    yield [r for r in recs if not r.get("oom")]
                    raise RuntimeError(
                        f"out of memory running one sample alone (eval.batch_size={self.spec.batch_size}); the run "
                        "stopped with its finished samples kept. Free the device (other processes?) or shorten the "
                        "task, then run the same command to resume"
                    ) from exc
            self.used = max(self.used or 0, len(batch))
            i += len(batch)
            yield recs

    def _take(self, i: int) -> list[Any]:
        """The next batch: up to ``size`` samples, cut where the prefill chunks of a sparse phase would not
        coincide with the rows' own (``Engine`` lays them from the first row's start, or under protocol B from the
        first context end)."""
        batch = self.todo[i : i + self.size]
        chunk = self.spec.eval.prefill_chunk
        if not chunk or len(batch) == 1:
            return batch
        reqs = [self.task.request(s) for s in batch]
        if self.spec.protocol == "S":  # never mix chunk alignments in one batch
            r = len(reqs[0].input_ids) % chunk
            n = 1
            while n < len(batch) and len(reqs[n].input_ids) % chunk == r:
                n += 1
            return batch[:n]
        if self.spec.protocol == "B":  # a question longer than a chunk is split at its own boundaries: alone
            long = [len(q.input_ids) - (q.context_len or 0) > chunk for q in reqs]
            if long[0]:
                return batch[:1]
            n = 1
            while n < len(batch) and not long[n]:
                n += 1
            return batch[:n]
        return batch

    def _free(self) -> None:
        self.session.recorder.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _run(self, batch: list[Any]) -> list[dict[str, Any]]:
        """The records of one batch: the task's fields and each row's own statistics; ``time_s`` is the
        batch's wall time shared equally by its samples."""
        self.session.recorder.reset()
        t0 = time.perf_counter()
        recs = self.task.run_batch(batch, self.engine)
        dt = (time.perf_counter() - t0) / len(batch)
        rows = self.session.recorder.batch_rows()
        out = []
        for i, (sample, rec) in enumerate(zip(batch, recs)):
            stats = self.session.recorder.summary(row=i if rows == len(batch) else None)
            out.append({"id": sample.id, "status": "ok", **rec, **stats_fields(stats), "time_s": dt})
        return out

    @staticmethod
    def _failed(sample: Any, exc: BaseException) -> dict[str, Any]:
        if is_out_of_memory(exc):  # a property of the machine's state, not of the sample: never recorded
            return {"id": sample.id, "oom": True}
        log.warning("sample %s failed: %r", sample.id, exc)
        return {
            "id": sample.id,
            "status": "error",
            "error": repr(exc),
            "traceback": traceback.format_exc(limit=8),
            "time_s": 0.0,
        }


def stats_fields(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: stats.get(k) for k in RECORD_STATS}
    out["empty_selections"] = stats.get("empty_selections", 0.0)
    out["sparse_rows"] = stats.get("sparse_rows", 0.0)
    for key in ("cost1", "cost2", "est_error"):
        out[f"{key}_per_layer"] = stats.get(f"{key}_per_layer", {})
    for key, val in stats.items():  # method extras (e.g. draws, pages)
        if (
            key not in out
            and not key.endswith(("_per_layer", "_per_layer_head"))
            and key not in ("sparse_layers",)
            and key not in RECORD_STATS
        ):
            out[f"m_{key}"] = val
    return out
