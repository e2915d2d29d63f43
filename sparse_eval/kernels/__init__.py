"""Fast kernels of the system path, each beside its torch reference (``*_reference``).

Modules (imported on first use, so ``import sparse_eval.kernels`` costs nothing):

* ``sparse_decode`` -- decode attention over selected token indices (Triton split-K + torch reference)
* ``ds``            -- Double Sparsity: label cache (16/8/4-bit), label scores, top-k, attention
* ``quest``         -- Quest: page min/max metadata, page scores, top pages, attention
* ``magicpig``      -- MagicPIG GPU part: SimHash projections packed into K-bit codes; eq. 10
* ``magicpig_cpu``  -- MagicPIG CPU part (numba): bucketed hash tables, collision sampling,
  sparse attention with the −log u correction returning (output, log-sum-exp)
* ``merge``         -- ``merge_by_lse``: exact merge of two partial attention outputs
* ``offload``       -- DS-Offload: gather selected KV rows from pinned host memory into a GPU buffer
* ``topk``          -- row-wise top-k without sorting (radix select), per-row budgets on the device; the k-th
  largest score (top-k recall's threshold)
* ``selected_attention`` -- the accuracy path's attention over a selection with a logit correction, and the dense
  statistics (kept mass, est_error, recall hits) of the same pass; batch-invariant (fixed split size)

Each public function takes ``backend="auto" | "triton"/"numba" | "torch"`` (see ``_common``).  Keep this module
free of heavy imports.
"""

from __future__ import annotations

import importlib

_SUBMODULES = (
    "sparse_decode",
    "ds",
    "quest",
    "magicpig",
    "magicpig_cpu",
    "merge",
    "offload",
    "topk",
    "selected_attention",
)

__all__ = [*_SUBMODULES, "merge_by_lse"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "merge_by_lse":
        from .merge import merge_by_lse

        return merge_by_lse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
