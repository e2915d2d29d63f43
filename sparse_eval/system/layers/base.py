"""What every system cache layer shares: the static-step position (``StaticStep``), host memory and transfers,
and the top-k choice of the selecting layers.

Shapes: B batch, Hq / Hkv query / KV heads, N tokens, D head dim, T tokens of the call.
"""

from __future__ import annotations

from typing import Any

import torch

import sparse_eval.kernels._common as kcommon
import sparse_eval.kernels.ds as kds
import sparse_eval.kernels.offload as koff

from ...methods.base import token_budget


def _query_len(args: tuple, kwargs: dict) -> int:
    """transformers < 5.24 passes ``cache_position`` (a tensor), later versions ``query_length`` (an int)."""
    x = args[0] if args else next(iter(kwargs.values()))
    return int(x.shape[0]) if torch.is_tensor(x) else int(x)


class StaticStep:
    """The device-side position of a static-shape decode step (the system path's CUDA-graph mode).

    In this mode no shape depends on the number of tokens: each layer writes the new key at ``pos`` of its
    preallocated cache and attends over its whole capacity with per-row ``lengths`` masking, and budgets are
    counts on the device.  One decode step can then be captured once in a CUDA graph and replayed; ``advance``
    (part of the captured step) moves the position on.  On the CPU the same step simply runs eagerly.
    """

    def __init__(self, n: int, batch: int, device: torch.device | str):
        self.pos = torch.tensor([n], dtype=torch.long, device=device)  # [1] position of the token being decoded
        self.lengths = torch.full((batch,), n + 1, dtype=torch.int32, device=device)  # [B] keys per row, incl. it
        self._budgets: dict[Any, torch.Tensor] = {}

    def budget(self, beta: float | int) -> torch.Tensor:
        """[B] int32 token budget per row: max(1, min(n, ``token_budget(β, n)``)), the rule's device form.  Made
        once per step and shared by the layers."""
        got = self._budgets.get(beta)
        if got is None:
            n = self.lengths.long()
            got = torch.minimum(token_budget(beta, n), n).clamp_min(1).to(torch.int32)
            self._budgets[beta] = got
        return got

    def budget_rows(self, beta: float | int, heads: int) -> torch.Tensor:
        """``budget`` expanded to [B, heads] int32, contiguous (one per selection row), made once per step."""
        key = (beta, heads)
        got = self._budgets.get(key)
        if got is None:
            got = self.budget(beta).view(-1, 1).expand(-1, heads).contiguous()
            self._budgets[key] = got
        return got

    def advance(self) -> None:
        self.pos += 1
        self.lengths += 1
        self._budgets.clear()


def host_token_major(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    b, h, n, d = shape
    return koff.pinned_empty((n, b, h, d), dtype).permute(1, 2, 0, 3)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A pageable host cache on transparent huge pages where Linux allows it: the CPU kernels gather random rows
    of it, and with 4 KiB pages nearly every row misses the TLB (MagicPIG's attention on the H200 machine's Xeon:
    6.2–6.5 against 7.1–7.3 ms in two of three alternating rounds, equal in the third;
    experiments/magicpig_cpu_attention/huge_pages_ab.txt)."""
    out = torch.empty(shape, dtype=dtype)
    kcommon.advise_huge_pages(out)
    return out


def tile(x: torch.Tensor, times: int, pin: bool = True) -> torch.Tensor:
    if times == 1:
        return x
    shape = (x.shape[0] * times, *x.shape[1:])
    if x.is_cuda:
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
    else:
        out = host_token_major(shape, x.dtype) if pin else host_empty(shape, x.dtype)
    for i in range(times):
        out[i * x.shape[0] : (i + 1) * x.shape[0]].copy_(x)
    return out


def check_topk(topk: str) -> str:
    if topk not in kds.TOPK_IMPLS:
        raise ValueError(f"topk={topk!r}: valid values are {list(kds.TOPK_IMPLS)}")
    return topk


class SelectsTopK:
    """DS and Quest layers: ``topk`` "radix" (``kernels.topk`` where the backend resolves to Triton) or "torch"."""

    def _topk_backend(self) -> str:
        """The backend of ``kernels.topk.select`` ("torch": its reference, a sorted ``torch.topk``)."""
        return self.backend if self.topk == "radix" else "torch"


def to_device(dev: torch.device, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Copies of host tensors on ``dev``, through page-locked memory without a wait (a copy from pageable memory
    would block until the stream reaches it)."""
    if dev.type != "cuda":
        return xs
    return tuple(x.pin_memory().to(dev, non_blocking=True) for x in xs)


def to_host_async(*xs: torch.Tensor) -> tuple:
    """Start copies of ``xs`` to the host (into page-locked memory when they are on the GPU); ``wait_host`` returns
    them once they have landed.  One wait for all of them rather than one each, and the stream may go on with other
    work meanwhile."""
    if not xs or not xs[0].is_cuda:
        return tuple(x.cpu() for x in xs), None
    out = tuple(x.to("cpu", non_blocking=True) for x in xs)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(xs[0].device))
    return out, done


def wait_host(started: tuple) -> tuple[torch.Tensor, ...]:
    out, done = started
    if done is not None:
        done.synchronize()
    return out


def to_host(*xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """CPU copies of ``xs``, waited for (see ``to_host_async``)."""
    return wait_host(to_host_async(*xs))
