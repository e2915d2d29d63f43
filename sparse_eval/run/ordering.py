"""The order a run processes its samples in, chosen so that a run cut short has scored an unbiased subset.

A run can stop before its last sample (killed, out of time, a device lost).  Its finished samples are then a
prefix of the processing order, and its score is over that prefix: the order must make every prefix look like
the whole task.  Sorting by prompt length (the longest first, to pack batches with little padding) does the
opposite: a partial run holds the longest prompts, unevenly spread over the subtasks.  The order here is:

1. **Within a stratum** (a subtask: ``sample.data["subtask"]``, or ``lm_eval_task``; one stratum when a task has
   none), samples go in a fixed pseudo-random order: by the sha256 of their id.  It depends on nothing but the
   ids, so every method and seed of a task processes the same samples first and two partial runs overlap as much
   as they can (the paired comparisons use the samples both finished).
2. **Across strata**, samples are interleaved in proportion to the strata's sizes: the k-th sample (k = 0, 1, ...)
   of a stratum of n_g samples is placed at (k + 1/2) / n_g, ties broken by the strata's order of first appearance.
   Every prefix of m samples then holds each stratum's share m · n_g / N to within one sample.
3. **Length locality** (batched runs only): consecutive windows of ``ORDER_WINDOW_BATCHES`` batches are each
   sorted by prompt length (longest first; under protocol S with ``prefill_chunk`` first by the length modulo the
   chunk, which a batch must share), so a batch still holds prompts of similar length.  A partial run deviates
   from the strata's shares by at most one window.

The order is a function of the task's whole sample set (a resumed run continues the same order, skipping what
is done), not of the method, the seed or the batch size.  It does not change any sample's record.
"""

from __future__ import annotations

import hashlib
from typing import Any, Callable, Sequence

ORDER_WINDOW_BATCHES = 2  # batches per window sorted by length (3. above)
STRATUM_FIELDS = ("subtask", "lm_eval_task")


def sample_stratum(sample: Any) -> Any:
    """A sample's stratum: its subtask (``subtask`` or ``lm_eval_task`` in its data), None when it has none."""
    data = getattr(sample, "data", None) or {}
    for key in STRATUM_FIELDS:
        if data.get(key) is not None:
            return data[key]
    return None


def _id_key(sample_id: str) -> bytes:
    return hashlib.sha256(str(sample_id).encode()).digest()


def stratified_order(ids: Sequence[str], strata: Sequence[Any]) -> list[int]:
    """Positions into ``ids`` in processing order (steps 1 and 2 of the module docstring)."""
    first: dict[Any, int] = {}
    members: dict[Any, list[int]] = {}
    for pos, g in enumerate(strata):
        first.setdefault(g, len(first))
        members.setdefault(g, []).append(pos)
    keyed = []
    for g, pos in members.items():
        pos = sorted(pos, key=lambda p: _id_key(ids[p]))
        n = len(pos)
        keyed += [((k + 0.5) / n, first[g], p) for k, p in enumerate(pos)]
    return [p for _, _, p in sorted(keyed)]


def length_windows(items: list[Any], window: int, key: Callable[[Any], Any]) -> list[Any]:
    """``items`` with each consecutive run of ``window`` items sorted by ``key`` (step 3)."""
    if window <= 1:
        return list(items)
    out: list[Any] = []
    for i in range(0, len(items), window):
        out += sorted(items[i : i + window], key=key)
    return out
