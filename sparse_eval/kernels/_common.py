"""Backend choice and launch helpers (``split_plan``) shared by the kernel modules.

GPU kernels are written in Triton and run on CUDA tensors; under ``TRITON_INTERPRET=1`` the same kernels run
on CPU tensors through Triton's interpreter (slow, for tests only).  CPU kernels are numba.  Every public
function takes ``backend=``:

* ``"auto"``   -- the fast path where it can run (Triton for CUDA tensors, numba for CPU tensors where the
  module has a numba kernel), the torch reference otherwise;
* ``"triton"`` / ``"numba"`` -- that path or a clear error;
* ``"torch"``  -- the ``*_reference`` function.

Nothing here imports triton or numba at module import: the kernel modules are imported by ``import
transformers`` probes (see the package docstring) and by the accuracy path, which need neither.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from typing import Any, Callable, Iterable

import torch

BACKENDS = ("auto", "triton", "numba", "torch")


def triton_interpret() -> bool:
    """True when Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1`` at kernel definition)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=None)
def module_available(name: str) -> bool:
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
    except Exception:  # pragma: no cover - a broken install counts as absent
        return False
    return True


def triton_available() -> bool:
    return module_available("triton")


def numba_available() -> bool:
    return module_available("numba")


def check_backend(backend: str, allowed: Iterable[str]) -> None:
    allowed = tuple(allowed)
    if backend not in allowed:
        raise ValueError(f"backend={backend!r}: valid values are {list(allowed)}")


def resolve_gpu_backend(backend: str, *tensors: torch.Tensor) -> str:
    """'triton' or 'torch' for a GPU-kernel module (Triton kernel + torch reference)."""
    check_backend(backend, ("auto", "triton", "torch"))
    on_cuda = all(t.is_cuda for t in tensors if t is not None)
    if backend == "auto":
        return "triton" if on_cuda and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' needs the triton package (pip install triton)")
        if not on_cuda and not triton_interpret():
            raise RuntimeError(
                "backend='triton' on CPU tensors needs the Triton interpreter: set TRITON_INTERPRET=1 before the "
                "first kernel call (or move the tensors to CUDA)"
            )
    return backend


def on_tensor_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run a Triton launcher on the CUDA device of its first CUDA tensor argument.  Triton launches on the *current*
    CUDA device, not on its arguments' one; a model spread over GPUs (``model.device_map``) calls a layer's kernels
    with tensors on that layer's GPU while the current device is another.  Where they agree (one GPU) this only
    reads the current device."""

    @functools.wraps(fn)
    def launch(*args: Any, **kwargs: Any) -> Any:
        for t in (*args, *kwargs.values()):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                if t.device.index != torch.cuda.current_device():
                    with torch.cuda.device(t.device):
                        return fn(*args, **kwargs)
                break
        return fn(*args, **kwargs)

    return launch


def resolve_cpu_backend(backend: str) -> str:
    """'numba' or 'torch' for a CPU-kernel module."""
    check_backend(backend, ("auto", "numba", "torch"))
    if backend == "auto":
        return "numba" if numba_available() else "torch"
    if backend == "numba" and not numba_available():
        raise RuntimeError("backend='numba' needs the numba package (pip install numba)")
    return backend


def unit_last(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Each tensor with a unit last stride, as the kernels index their last dim (a copy only where it has not)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in ts)


def as_rows(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """x [..., D] -> (x2 [M, D] with a unit last stride, the leading shape) for a kernel over rows."""
    return unit_last(x.reshape(-1, x.shape[-1]))[0], tuple(x.shape[:-1])


def next_pow2(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def check_heads(hq: int, hkv: int, what: str = "query heads") -> int:
    if hkv <= 0 or hq % hkv:
        raise ValueError(f"{what} ({hq}) must be a positive multiple of KV heads ({hkv})")
    return hq // hkv


def advise_huge_pages(t: torch.Tensor) -> bool:
    """Ask Linux to back ``t``'s memory with transparent huge pages (``madvise(MADV_HUGEPAGE)`` over the 4 KiB
    pages it spans entirely).  It takes effect for pages not yet touched, so call it right after allocating.
    Random row gathers over a large host cache miss the TLB on nearly every row with 4 KiB pages.  Returns whether
    the advice was taken: False (nothing changed) off Linux, for a CUDA or empty tensor, for one spanning no whole
    page, or when the kernel refuses it."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux") or t.is_cuda or t.numel() == 0:
        return False
    page = 4096
    start = (t.data_ptr() + page - 1) // page * page
    end = (t.data_ptr() + t.numel() * t.element_size()) // page * page
    if end <= start:
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    madv_hugepage = 14
    return libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), madv_hugepage) == 0


def split_plan(rows: int, s_len: int, block_n: int, n_sm: int = 132, waves: int = 4) -> tuple[int, int]:
    """(number of splits, tokens per split): enough programs to fill ``waves`` × SMs, each a whole number of
    BLOCK_N tiles."""
    blocks = max(1, -(-s_len // block_n))
    want = max(1, -(-(waves * n_sm) // max(rows, 1)))
    splits = min(blocks, want)
    per = -(-blocks // splits) * block_n
    return -(-s_len // per) if s_len else 1, per
