"""Fast kernels of the system path, each beside its torch reference (``*_reference``).

Modules (imported on first use, so ``import kernels`` costs nothing):

* ``kernels.sparse_decode`` -- decode attention over selected token indices (Triton split-K + torch reference)
* ``kernels.ds``            -- Double Sparsity: label cache (16/8/4-bit), label scores, top-k, attention
* ``kernels.quest``         -- Quest: page min/max metadata, page scores, top pages, attention
* ``kernels.magicpig``      -- MagicPIG GPU part: SimHash projections packed into K-bit codes; eq. 10
* ``kernels.magicpig_cpu``  -- MagicPIG CPU part (numba): bucketed hash tables, collision sampling,
  sparse attention with the −log u correction returning (output, log-sum-exp)
* ``kernels.merge``         -- ``merge_by_lse``: exact merge of two partial attention outputs
* ``kernels.offload``       -- DS-Offload: gather selected KV rows from pinned host memory into a GPU buffer
* ``kernels.topk``          -- row-wise top-k without sorting (radix select), per-row budgets on the device

Each public function takes ``backend="auto" | "triton"/"numba" | "torch"`` (see ``kernels._common``).

Naming note: Hugging Face ships an unrelated PyPI package also imported as ``kernels``; transformers probes
for it (``is_kernels_available``) with a version check that this package fails (it has no ``__version__`` and
is distributed as ``sparse_eval``), so the probe answers False.  Keep this module free of a ``__version__``
and of heavy imports.
"""

from __future__ import annotations

import importlib

_SUBMODULES = ("sparse_decode", "ds", "quest", "magicpig", "magicpig_cpu", "merge", "offload", "topk")

__all__ = [*_SUBMODULES, "merge_by_lse"]


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "merge_by_lse":
        from .merge import merge_by_lse

        return merge_by_lse
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
