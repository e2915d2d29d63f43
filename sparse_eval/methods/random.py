"""Counter-based random numbers that do not depend on batch composition.

A padded batch must give each row the same draws as the row run alone, so draws are a pure function of
(seed, head, the row's context size, draw index) rather than of a generator's position.
"""

from __future__ import annotations

import torch

_M = 0x45D9F3B
_MASK = 0xFFFFFFFF


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mixing function on int64 tensors (values stay < 2^63, so nothing overflows)."""
    x = x & _MASK
    x = ((x ^ (x >> 16)) * _M) & _MASK
    x = ((x ^ (x >> 16)) * _M) & _MASK
    return x ^ (x >> 16)


def uniforms(seed: int, *keys: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 values, one per element of the broadcast of ``keys`` (int64 tensors)."""
    x = torch.as_tensor(seed & _MASK, dtype=torch.int64)
    for k in keys:
        x = hash32(x * 0x9E3779B1 + hash32(k.to(torch.int64) + 0x632BE5AB))
    x = hash32(x)
    return (x.to(torch.float64) + 0.5) / 4294967296.0
