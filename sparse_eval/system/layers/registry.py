"""Method name -> system cache layer.  Adding a method to the system path is one new module here with a
``@register_layer``ed layer class (a ``from_method`` classmethod building the layer of one sparse decoder layer)
plus the method's config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

SYSTEM_LAYERS: dict[str, type] = {}


@dataclass(frozen=True)
class LayerOptions:
    """What a layer is built with besides its method: the model's shape, the cache capacity and the kernels."""

    capacity: int  # tokens: prompt length + new tokens
    hq: int  # query heads
    hkv: int  # KV heads
    d: int  # head dim
    label_scale_dtype: torch.dtype = torch.float32  # DS label cache's per-token scale and zero
    backend_gpu: str = "auto"
    backend_cpu: str = "auto"
    topk: str = "radix"  # DS / Quest top-k: "radix" (kernels.topk on CUDA) or "torch"


def register_layer(method_name: str):
    """Class decorator: the system layer of ``method_name`` (a name of ``sparse_eval.methods.METHODS``)."""

    def add(cls: type) -> type:
        if method_name in SYSTEM_LAYERS and SYSTEM_LAYERS[method_name] is not cls:
            raise ValueError(f"system layer for method {method_name!r} registered twice")
        if not callable(getattr(cls, "from_method", None)):
            raise TypeError(f"{cls.__name__} needs a from_method(layer_idx, method, opts) classmethod")
        SYSTEM_LAYERS[method_name] = cls
        return cls

    return add


def layer_class(method_name: str) -> type:
    try:
        return SYSTEM_LAYERS[method_name]
    except KeyError:
        raise ValueError(
            f"method {method_name!r} has no system path; valid: {list(SYSTEM_LAYERS)} (double_sparsity "
            f"with method.offload=true is DS-Offload)"
        ) from None


def build_layer(layer_idx: int, method: Any, opts: LayerOptions) -> Any:
    """The system layer of sparse decoder layer ``layer_idx`` for ``method``."""
    return layer_class(method.name).from_method(layer_idx, method, opts)
