"""Named spans of the accuracy path's sparse attention call (``sparse_eval::<name>``), seen by torch.profiler only.

``span(name)`` is a ``torch.profiler.record_function`` range while a profiler records and a no-op otherwise (one
flag read per call), so a run pays nothing for it.  ``benchmarks/bench_accuracy_path.py --profile`` sums the device
time of the kernels launched inside each span: where a method's step spends its time (the index, the selection,
the shared attention, the estimation error, the statistics), the rest being the model's own layers.
"""

from __future__ import annotations

import contextlib

import torch

PREFIX = "sparse_eval::"
_NO_SPAN = contextlib.nullcontext()


def span(name: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``PREFIX + name`` while torch.profiler records, else a shared no-op context."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(PREFIX + name)
    return _NO_SPAN
