"""Small constant tensors made once per device and kept (``made_once``), so that a hot path does not launch the
kernels that build them in every call.  A leaf module (torch only), importable from anywhere without cycles."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch


def made_once(fn: Callable[..., torch.Tensor | Any]) -> Callable[..., Any]:
    """Keep ``fn(*args, device)``'s result per argument tuple (its last argument a ``torch.device``), made outside
    inference mode (usable anywhere).  A call during a CUDA graph capture on that device is computed afresh and not
    kept: what a capture makes holds its values only once the graph replays."""
    kept = functools.lru_cache(maxsize=64)(fn)

    @functools.wraps(fn)
    def get(*args: Any) -> Any:
        device = args[-1]
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return fn(*args)
        with torch.inference_mode(False):
            return kept(*args)

    get.cache_clear = kept.cache_clear  # type: ignore[attr-defined]
    get.cache_info = kept.cache_info  # type: ignore[attr-defined]
    return get
