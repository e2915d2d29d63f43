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


def start(seed: int) -> torch.Tensor:
    """The state before any key: ``seed``'s low 32 bits (an int64 scalar tensor)."""
    return torch.as_tensor(seed & _MASK, dtype=torch.int64)


def key_hash(k: torch.Tensor) -> torch.Tensor:
    """A key's own hash, the part of ``mix`` that does not depend on the state (it may be computed once and kept)."""
    return hash32(k.to(torch.int64) + 0x632BE5AB)


def mix(x: torch.Tensor, k: torch.Tensor, hashed: bool = False) -> torch.Tensor:
    """Fold key ``k`` (int64; ``hashed``: already ``key_hash(k)``) into the state ``x`` (broadcasting)."""
    return hash32(x * 0x9E3779B1 + (k if hashed else key_hash(k)))


def finish(x: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 values from a state."""
    return (hash32(x).to(torch.float64) + 0.5) / 4294967296.0


def uniforms(seed: int, *keys: torch.Tensor) -> torch.Tensor:
    """U(0, 1) float64 values, one per element of the broadcast of ``keys`` (int64 tensors): ``finish`` of the
    keys ``mix``-ed in order into ``start(seed)``.  A caller whose leading keys repeat between calls may keep the
    state after them, and the hashes of a repeating key, and compose the same values from those parts."""
    x = start(seed)
    for k in keys:
        x = mix(x, k)
    return finish(x)
