"""The system path: the same methods as the accuracy path, with their KV caches where their systems keep them
and the kernels of ``sparse_eval.kernels`` doing the work.

``layers`` (one cache layer per method, registered by method name), ``session`` (the layers of one generation
attached to a model), ``capture`` (the static step in CUDA graphs) and ``decoding`` (``decode``: prefill, greedy steps,
timings)."""

from .decoding import DecodeOptions, DecodeResult, decode
from .layers import SYSTEM_LAYERS, register_layer
from .session import SystemSession, build_layers

__all__ = [
    "SYSTEM_LAYERS",
    "DecodeOptions",
    "DecodeResult",
    "SystemSession",
    "build_layers",
    "decode",
    "register_layer",
]
