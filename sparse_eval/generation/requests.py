"""What a task asks of the model for one sample (a generation or a log-likelihood) and what it gets back: plain
data, free of torch, so tasks (and the schemas built from their configs) import without it.  ``engine.Engine``
runs them."""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Sequence


@dataclass
class GenerationRequest:
    """Greedy generation of one sample.  ``context_len``: under protocol B, the first ``context_len`` prompt
    tokens are the context (dense) and the rest is the question (sparse); ignored under A and S.
    ``key`` (the sample id) seeds the row's own randomness (oracle sampling)."""

    input_ids: Sequence[int]
    max_new_tokens: int
    context_len: int | None = None
    stop_token_ids: Sequence[int] | None = None
    stop_strings: Sequence[str] | None = None
    key: str = ""


@dataclass
class LoglikelihoodRequest:
    """Teacher-forced next-token NLL over ``input_ids`` (a perplexity window)."""

    input_ids: Sequence[int]
    key: str = ""


@dataclass
class GenerationResult:
    tokens: list[int]
    text: str
    stopped_by: str  # "eos", "stop_string", "max_new_tokens"


@dataclass
class LoglikelihoodResult:
    nll_sum: float  # Σ_t −log p(x_{t+1} | x_{≤t}) over the window
    tokens: int  # predicted tokens (len − 1)


def row_seed(key: str) -> int:
    """The 31-bit seed of a sample's randomness, from its id (stable across runs, batches and processes)."""
    return zlib.crc32(key.encode("utf-8")) & 0x7FFFFFFF
