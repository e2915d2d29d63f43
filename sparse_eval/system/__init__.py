"""The system path: the same methods as the accuracy path, with their KV caches where their systems keep them
and the kernels of ``kernels/`` doing the work (see ``decoder`` and ``layers``)."""

from .decoder import SYSTEM_METHODS, DecodeResult, SystemSession, build_layers, decode

__all__ = ["SYSTEM_METHODS", "DecodeResult", "SystemSession", "build_layers", "decode"]
