"""Gathering selected KV rows from a cache that lives in pinned CPU memory (DS-Offload, DS paper §5.1 / §6.2).

    dst[b, h, s, :] = src[b, h // G, idx[b, h, s], :]      (idx < 0: the row is left as it was)

src [B, Hkv, N, D] is a pinned host tensor; idx [B, Hs, S] (Hs = Hkv, or Hq with G = Hq / Hkv query heads per
KV head) and dst [B, Hs, S, D] are on the GPU.  On CUDA the Triton kernel reads the host rows directly over
PCIe (pinned memory is mapped into the GPU's address space under unified virtual addressing), so no host
thread takes part and the copy can run on a side stream while the GPU computes another layer.  Only the
selected rows cross the bus.

``gather_rows_reference`` is plain torch indexing (any device); it is the oracle of the tests and the path on
machines without CUDA.
"""

from __future__ import annotations

import torch

from ._common import check_heads, resolve_gpu_backend

__all__ = ["gather_rows", "gather_rows_reference", "pinned_empty", "put_rows", "put_rows_reference", "unpin_all"]


def _check(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> int:
    if src.dim() != 4 or idx.dim() != 3 or dst.dim() != 4:
        raise ValueError(
            f"expected src [B, Hkv, N, D], idx [B, Hs, S], dst [B, Hs, S, D]; got {tuple(src.shape)}, "
            f"{tuple(idx.shape)}, {tuple(dst.shape)}"
        )
    b, hkv, _, d = src.shape
    if idx.shape[0] != b or tuple(dst.shape) != (b, idx.shape[1], idx.shape[2], d):
        raise ValueError(f"idx {tuple(idx.shape)} / dst {tuple(dst.shape)} do not match src {tuple(src.shape)}")
    if dst.dtype != src.dtype:
        raise ValueError(f"dst dtype {dst.dtype} != src dtype {src.dtype}")
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("src and dst need a contiguous last dimension")
    return check_heads(idx.shape[1], hkv, "selection heads")


def gather_rows_reference(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
    """Torch indexing on src's device, the result copied into dst (rows with idx < 0 untouched)."""
    g = _check(src, idx, dst)
    b, hs, s = idx.shape
    ix = idx.to(src.device).long()
    ok = ix >= 0
    bi = torch.arange(b, device=src.device).view(b, 1, 1).expand(b, hs, s)
    hi = (torch.arange(hs, device=src.device) // g).view(1, hs, 1).expand(b, hs, s)
    rows = src[bi[ok], hi[ok], ix[ok]]  # [M, D]
    dst[ok.to(dst.device)] = rows.to(dst.device)
    return dst


def _is_pinned(x: torch.Tensor) -> bool:
    return x.is_pinned() or any(p <= x.data_ptr() < p + t.numel() * t.element_size() for p, t in _PINNED.items())


def _backend(backend: str, host: torch.Tensor, *gpu: torch.Tensor) -> str:
    """ "triton" or "torch" for a kernel between the ``gpu`` tensors and the cache ``host``: "auto" takes Triton when
    the ``gpu`` tensors are CUDA tensors and ``host`` is pinned (or on the GPU)."""
    if backend == "auto" and not (all(x.is_cuda for x in gpu) and (host.is_cuda or _is_pinned(host))):
        return "torch"
    return resolve_gpu_backend(backend, *gpu)


def gather_rows(src: torch.Tensor, idx: torch.Tensor, dst: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """See the module docstring.  backend: "auto" (Triton when idx and dst are CUDA tensors and src is pinned),
    "triton", "torch"."""
    g = _check(src, idx, dst)
    if _backend(backend, src, idx, dst) == "torch":
        return gather_rows_reference(src, idx, dst)
    from . import _tl_offload

    _tl_offload.gather_rows(src, idx, dst, g)
    return dst


def _check_put(src: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor) -> None:
    if src.dim() != 4 or dst.dim() != 4 or src.shape[:2] != dst.shape[:2] or src.shape[3] != dst.shape[3]:
        raise ValueError(
            f"expected src [B, Hkv, T, D] and dst [B, Hkv, N, D]; got {tuple(src.shape)}, {tuple(dst.shape)}"
        )
    if src.dtype != dst.dtype:
        raise ValueError(f"src dtype {src.dtype} != dst dtype {dst.dtype}")
    if pos.numel() != 1 or pos.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"pos: expected one int32/int64 position, got {pos.dtype} {tuple(pos.shape)}")
    if src.stride(-1) != 1 or dst.stride(-1) != 1:
        raise ValueError("src and dst need a contiguous last dimension")


def put_rows_reference(src: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """dst[:, :, pos + t] = src[:, :, t] for t < T, by torch indexing (reads ``pos`` on the host)."""
    _check_put(src, dst, pos)
    p = int(pos.reshape(()).item())
    if p < 0 or p + src.shape[2] > dst.shape[2]:
        raise IndexError(f"pos {p} + {src.shape[2]} rows is outside the cache's {dst.shape[2]} rows")
    dst[:, :, p : p + src.shape[2]] = src.to(dst.device)
    return dst


def put_rows(src: torch.Tensor, dst: torch.Tensor, pos: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``put_rows_reference`` with ``pos`` [1] read on the device: on CUDA one Triton launch writes the rows of a
    GPU tensor ``src`` straight into the pinned host cache ``dst`` (mapped under unified virtual addressing), so a
    static decode step can store its new token at a device-side position and be captured in a CUDA graph (no host
    value, no host thread).  Positions past the cache are not written.  backend: "auto" (Triton when src and pos
    are CUDA tensors and dst is pinned or on the GPU), "triton", "torch"."""
    _check_put(src, dst, pos)
    if _backend(backend, dst, src, pos) == "torch":
        return put_rows_reference(src, dst, pos)
    from . import _tl_offload

    _tl_offload.put_rows(src, dst, pos)
    return dst


_PINNED: dict[int, torch.Tensor] = {}


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor, page-locked when CUDA is available (plain CPU memory otherwise).

    The memory is allocated pageable at its exact size and then registered with ``cudaHostRegister``:
    ``torch.empty(..., pin_memory=True)`` rounds every block up to a power of two, which for a cache of
    tens of GB can ask for twice the machine's memory.  The tensor stays registered (and referenced here)
    until ``unpin_all``."""
    t = torch.empty(shape, dtype=dtype)
    if torch.cuda.is_available() and t.numel():
        nbytes = t.numel() * t.element_size()
        err = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(getattr(err, "value", err)) != 0:
            raise RuntimeError(
                f"cudaHostRegister of {nbytes / 2**30:.1f} GiB failed ({err}): not enough lockable "
                f"host memory for the offloaded cache"
            )
        _PINNED[t.data_ptr()] = t
    return t


def unpin_all() -> None:
    """Unregister (and drop the references to) every tensor ``pinned_empty`` registered.  Synchronises the
    device first: no copy may still be reading them."""
    if not _PINNED:
        return
    torch.cuda.synchronize()
    for ptr in list(_PINNED):
        torch.cuda.cudart().cudaHostUnregister(ptr)
        del _PINNED[ptr]
