"""Sparse-attention methods: one class each behind ``Method`` (selection + logit correction) and a registry.

Every module of this package is imported here and registers its method; then the user's plugins are imported
(``sparse_eval.discovery``).

Public API for studying a method on captured tensors::

    out, stats = sparse_eval.methods.attend("topk", q, k, v, budget=0.05)

The runner's attention plug-in calls the same ``sparse_attention`` function.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ..discovery import import_package_modules, load_plugins
from .base import (
    AttentionContext,
    Method,
    MethodConfig,
    Selection,
    budget_bound,
    check_budget,
    resolve_budget,
    token_budget,
)
from .core import key_validity, sparse_attention
from .registry import METHODS, build_method, compare_names, is_dense, make_config, method_class, register

# every module of this folder registers its method (``@register``): a new method is one new module here
INFRASTRUCTURE = ("base", "core", "registry", "labels")
import_package_modules(__name__, skip=INFRASTRUCTURE)

# the rules a method of one's own needs, each in its one home: the token budget, the k highest keys (ties by index),
# the counter-based uniforms (a draw that depends on its keys, not on the batch)
from .random import uniforms  # noqa: E402
from .topk import topk_mask  # noqa: E402


def attend(
    method: str | Method,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    layer_idx: int = 0,
    state: dict[str, Any] | None = None,
    compute_error: bool = True,
    fused: bool = False,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """Run one decode step of ``method`` over a given cache.

    q: [B, Hq, 1, D] (also [B, Hq, Q, D]: Q rows aligned to the last Q keys, causally), k/v: [B, Hkv, N, D].
    ``options`` are the method's config fields (budget, K, L, page_size, ...).  ``dense_layers`` does not
    apply here: the step is always run sparse.  ``state`` may be passed in to keep the method's index across
    calls (e.g. growing k by one key per step); a fresh one is built otherwise.

    Returns ``(output [B, Hq, Q, D], stats)``; stats has per-row ``cost1``, ``cost2``, ``static_frac``,
    ``est_error`` (‖ô − o‖/‖o‖ against dense attention on the same q, K, V), ``keep`` (bool [B, Hq, Q, N], the
    keys that entered the output), ``indices`` (for B = Q = 1: a list per head of kept key positions) and the
    method's own extras.  ``fused``: the attention and its statistics from the fused kernel
    (``kernels.selected_attention``; on CPU tensors it needs ``TRITON_INTERPRET=1``).
    """
    if not isinstance(method, Method):
        method = build_method(make_config(method, options))
    elif options:
        raise ValueError("pass options either in the Method's config or as keyword arguments, not both")
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(
            f"expected q [B, Hq, Q, D] and k, v [B, Hkv, N, D]; got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of KV heads ({k.shape[1]})")
    b, _, ql, d = q.shape
    n = k.shape[2]
    method.validate(context=n)
    scaling = 1.0 / math.sqrt(d) if scaling is None else scaling
    valid = key_validity(attention_mask, b, ql, n, q.device)
    out, stats = sparse_attention(
        method,
        q,
        k,
        v,
        valid,
        scaling,
        {} if state is None else state,
        layer_idx,
        compute_error=compute_error,
        keep_masks=True,
        fused=fused,
    )
    if b == 1 and ql == 1:
        stats["indices"] = [torch.nonzero(stats["keep"][0, h, 0]).flatten() for h in range(q.shape[1])]
    return out, stats


__all__ = [
    "AttentionContext",
    "METHODS",
    "Method",
    "MethodConfig",
    "Selection",
    "attend",
    "budget_bound",
    "build_method",
    "check_budget",
    "compare_names",
    "is_dense",
    "make_config",
    "method_class",
    "register",
    "resolve_budget",
    "sparse_attention",
    "token_budget",
    "topk_mask",
    "uniforms",
]


# the user's methods last (``sparse_eval.discovery``: the ``sparse_eval.methods`` entry points and
# ``SPARSE_EVAL_PLUGINS``), so that a plugin may import anything above from ``sparse_eval.methods``
for _obj in load_plugins():
    if isinstance(_obj, type) and issubclass(_obj, Method) and METHODS.get(_obj.name) is not _obj:
        register(_obj)
