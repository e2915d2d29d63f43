"""Batch-invariant evaluation: a sample's record does not depend on its batch, its companions or their padding.

``batch_invariant()`` is a context manager (the engine holds it around every batch when ``eval.batch_invariant``
is on, the default).  Inside it, the aten operators whose floating-point result depends on how a kernel splits
its work are replaced, on the CPU and on CUDA, by the fixed-order kernels of ``sparse_eval.kernels.invariant``:

* products ``mm``, ``addmm``, ``bmm``, ``baddbmm``, ``mv``, ``dot`` (linear layers, q·kᵀ, p·V, einsums);
* reductions ``sum``, ``mean``, ``_softmax``, ``_log_softmax``, ``logsumexp``, ``linalg_vector_norm`` (RMSNorm,
  softmax over keys, the NLL, the estimation error's norms) and floating ``cumsum``;
* ``topk`` and ``sort``, whose tie order is otherwise the kernel's: equal values come in index order (stable), so
  the same keys are kept at a tie whatever the padding before them.

The rule they share (``kernels.invariant``): a row's reduction order depends only on the row's own length counted
from its end, never on the batch size, on the other rows, or on the leading padding.  With left padding every row's
keys end at the last column, so a row's scores, its selection and its output are bit for bit those it gets alone.
Exact operations need nothing (max, min, argmax, comparisons, gathers, integer sums).  Dense attention does not
use ``scaled_dot_product_attention`` in this mode (its kernels split keys by batch and length): the plug-in takes
``methods.core.dense_attention`` instead, through the same products and softmax.

``checker()`` is a ``TorchDispatchMode`` for tests: it raises ``InvarianceViolation`` on any floating-point
reduction or product that is not routed through an invariant kernel (a new method's ``torch.prod`` or
``index_add`` of fractions, say), so a code path can be audited on the CPU for the GPU too.

What stays variable: nothing measured on the CPU or the H200 (``tests/checks/test_invariance.py``,
``experiments/batch_invariance_h200``).  The cost is measured in ``benchmarks/bench_invariance.py``.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from typing import Any, Iterator, Sequence

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ..kernels import invariant as kinv

__all__ = ["batch_invariant", "enabled", "checker", "InvarianceViolation", "OVERRIDDEN", "deterministic_topk"]

_DEPTH = 0


def enabled() -> bool:
    """Whether the calling code runs inside ``batch_invariant()``."""
    return _DEPTH > 0


# -- shapes --------------------------------------------------------------------------------------------------------


def _dims(x: torch.Tensor, dim: Any) -> list[int]:
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return list(range(x.dim()))
    if isinstance(dim, int):
        dim = [dim]
    nd = max(x.dim(), 1)
    return sorted({d % nd for d in dim})


def _rows(x: torch.Tensor, dims: Sequence[int]) -> tuple[torch.Tensor, list[int], list[int]]:
    """(x as [R, n] with the reduced dims last, the kept shape, the keepdim shape)."""
    if x.dim() == 0:
        return x.reshape(1, 1), [], []
    kept = [d for d in range(x.dim()) if d not in dims]
    x2 = x.permute(*kept, *dims)
    n = math.prod(x.shape[d] for d in dims)
    x2 = x2.reshape(-1, n)
    keep_shape = [1 if d in dims else x.shape[d] for d in range(x.dim())]
    return x2, [x.shape[d] for d in kept], keep_shape


def _reduced(r: torch.Tensor, kept: list[int], keep_shape: list[int], keepdim: bool) -> torch.Tensor:
    return r.reshape(keep_shape if keepdim else kept)


def _is_float(t: torch.Tensor) -> bool:
    return t.is_floating_point()


# -- products ------------------------------------------------------------------------------------------------------


def _mm(a, b):
    return kinv.mm(a, b, out_dtype=a.dtype)


def _scaled_add(base, product, beta, alpha):
    """``beta · base + alpha · product`` as aten's addmm/baddbmm define it (``base`` ignored when beta = 0)."""
    out = product * alpha if alpha != 1 else product
    if beta == 0:
        return out
    return out + (base if beta == 1 else base * beta)


def _addmm(bias, a, b, *, beta=1, alpha=1):
    return _scaled_add(bias, kinv.mm(a, b, out_dtype=a.dtype), beta, alpha)


def _bmm(a, b):
    return kinv.bmm(a, b, out_dtype=a.dtype)


def _baddbmm(base, a, b, *, beta=1, alpha=1):
    return _scaled_add(base, kinv.bmm(a, b, out_dtype=a.dtype), beta, alpha)


def _mv(a, v):
    return kinv.mm(a, v.unsqueeze(1), out_dtype=a.dtype).squeeze(1)


def _dot(a, b):
    return kinv.row_sum((a * b).reshape(1, -1))[0].to(torch.promote_types(a.dtype, b.dtype))


# -- reductions ----------------------------------------------------------------------------------------------------


def _sum_dim(x, dim=None, keepdim=False, *, dtype=None):
    out_dtype = dtype or (x.dtype if _is_float(x) else torch.int64)
    if not out_dtype.is_floating_point:  # integer sums are exact in any order
        return _exact_sum(x, dim, keepdim, out_dtype)
    dims = _dims(x, dim)
    x2, kept, keep_shape = _rows(x.to(out_dtype) if not _is_float(x) else x, dims)
    return _reduced(kinv.row_sum(x2).to(out_dtype), kept, keep_shape, keepdim)


def _exact_sum(x, dim, keepdim, out_dtype):
    dims = _dims(x, dim)
    shape = (
        [1 if d in dims else s for d, s in enumerate(x.shape)]
        if keepdim
        else [s for d, s in enumerate(x.shape) if d not in dims]
    )
    out = torch.empty(shape, dtype=out_dtype, device=x.device)
    return torch.sum(x, dim=dims, keepdim=keepdim, dtype=out_dtype, out=out)


def _sum(x, *, dtype=None):
    return _sum_dim(x, None, False, dtype=dtype)


def _mean_dim(x, dim=None, keepdim=False, *, dtype=None):
    out_dtype = dtype or x.dtype
    if not out_dtype.is_floating_point:
        raise RuntimeError(f"mean(): could not infer output dtype from {x.dtype}; give a floating dtype")
    dims = _dims(x, dim)
    x2, kept, keep_shape = _rows(x.to(out_dtype), dims)
    n = x2.shape[1]
    r = kinv.row_sum(x2)
    return _reduced((r / n if n else r.new_full(r.shape, float("nan"))).to(out_dtype), kept, keep_shape, keepdim)


def _mean(x, *, dtype=None):
    return _mean_dim(x, None, False, dtype=dtype)


def _softmax_impl(x, dim, half_to_float, log):
    out_dtype = torch.float32 if half_to_float else x.dtype
    dim = dim % max(x.dim(), 1)
    moved = x.movedim(dim, -1) if x.dim() else x.reshape(1)
    shape = moved.shape
    y = kinv.softmax(moved.reshape(-1, shape[-1]), log=log).to(out_dtype).reshape(shape)
    return y.movedim(-1, dim).contiguous() if x.dim() else y.reshape(())


def _softmax(x, dim, half_to_float):
    return _softmax_impl(x, dim, half_to_float, log=False)


def _log_softmax(x, dim, half_to_float):
    return _softmax_impl(x, dim, half_to_float, log=True)


def _logsumexp(x, dim, keepdim=False):
    xf = x if _is_float(x) else x.to(torch.get_default_dtype())
    dims = _dims(xf, dim)
    m = xf.amax(dim=dims, keepdim=True)
    m = torch.where(torch.isinf(m), torch.zeros_like(m), m)
    x2, kept, keep_shape = _rows(torch.exp(xf - m), dims)
    s = kinv.row_sum(x2).to(xf.dtype).reshape(keep_shape)
    out = torch.log(s) + m
    return out if keepdim else out.reshape(kept)


def _vector_norm(x, ord=2, dim=None, keepdim=False, *, dtype=None):
    xf = x.to(dtype) if dtype is not None else x
    out_dtype = xf.dtype
    dims = _dims(xf, dim)
    a = xf.abs()
    if ord == float("inf"):
        return a.amax(dim=dims, keepdim=keepdim).to(out_dtype)
    if ord == float("-inf"):
        return a.amin(dim=dims, keepdim=keepdim).to(out_dtype)
    x2, kept, keep_shape = _rows(a, dims)
    if ord == 2:
        r = torch.sqrt(kinv.row_sum(x2, square=True))
    elif ord == 1:
        r = kinv.row_sum(x2)
    elif ord == 0:
        r = kinv.row_sum((x2 != 0).to(kinv.acc_dtype(out_dtype)))
    else:
        r = kinv.row_sum(x2.to(kinv.acc_dtype(out_dtype)) ** ord) ** (1.0 / ord)
    return _reduced(r.to(out_dtype), kept, keep_shape, keepdim)


def _cumsum(x, dim, *, dtype=None):
    out_dtype = dtype or (x.dtype if _is_float(x) else torch.int64)
    dim = dim % max(x.dim(), 1)
    if not out_dtype.is_floating_point:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
        return torch.cumsum(x, dim, dtype=out_dtype, out=out)
    y = kinv.cumsum_reference(x.to(out_dtype).movedim(dim, -1))
    return y.movedim(-1, dim).contiguous()


# -- order ---------------------------------------------------------------------------------------------------------


def deterministic_topk(
    x: torch.Tensor, k: int, dim: int = -1, largest: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(values, indices) of the k largest (smallest) entries along ``dim``, sorted, equal values in index order.

    Entries of at most 32 bits are ranked by one unique int64 key per entry (an order-preserving image of the
    value in the high 32 bits, the complement of the index in the low 32), so ``torch.topk`` over the keys has no
    ties to break its own way; wider types fall back to a stable sort."""
    dim = dim % max(x.dim(), 1)
    xm = x.movedim(dim, -1)
    n = xm.shape[-1]
    if x.dtype in (torch.float16, torch.bfloat16, torch.float32) or x.dtype in (
        torch.int8,
        torch.uint8,
        torch.int16,
        torch.int32,
        torch.bool,
    ):
        if x.is_floating_point():
            bits = xm.to(torch.float32).contiguous().view(torch.int32)
            key = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)
        else:
            key = xm.to(torch.int64)
        if not largest:
            key = -key - 1
        idx = torch.arange(n, device=x.device, dtype=torch.int64)
        composite = key * (1 << 32) + ((1 << 32) - 1 - idx)
        vals_buf = torch.empty(0, dtype=torch.int64, device=x.device)
        ind = torch.empty(0, dtype=torch.int64, device=x.device)
        torch.topk(composite, k, dim=-1, largest=True, sorted=True, out=(vals_buf, ind))
    else:
        vals_s = torch.empty(0, dtype=x.dtype, device=x.device)
        ind = torch.empty(0, dtype=torch.int64, device=x.device)
        torch.sort(xm, dim=-1, descending=largest, stable=True, out=(vals_s, ind))
        ind = ind[..., :k]
    vals = xm.gather(-1, ind)
    return vals.movedim(-1, dim).contiguous(), ind.movedim(-1, dim).contiguous()


def _topk(x, k, dim=-1, largest=True, sorted=True):
    return deterministic_topk(x, k, dim, largest)


def _sort(x, dim=-1, descending=False):
    vals = torch.empty(0, dtype=x.dtype, device=x.device)
    ind = torch.empty(0, dtype=torch.int64, device=x.device)
    return torch.sort(x, dim=dim, descending=descending, stable=True, out=(vals, ind))


# -- CPU pointwise functions ------------------------------------------------------------------------------------------
# torch's CPU kernels compute transcendental functions with SIMD code (Sleef) in the vectorised part of a loop and
# with scalar libm calls for the remainder of each thread's chunk; the two round differently in the last bit (silu,
# sigmoid, log1p, softplus, gelu-tanh, pow, sinh, ...: measured, ``tests/checks/test_invariance.py``), so an element's
# value depended on where the batch put it.  Inside ``batch_invariant()`` they run on one thread (one chunk) over the
# flattened operands padded to a multiple of 64 elements, so every element takes the vectorised loop.
CPU_POINTWISE = (
    "exp",
    "exp2",
    "expm1",
    "log",
    "log2",
    "log10",
    "log1p",
    "sin",
    "cos",
    "tan",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "tanh",
    "asinh",
    "acosh",
    "atanh",
    "sigmoid",
    "erf",
    "erfc",
    "erfinv",
    "lgamma",
    "digamma",
    "silu",
    "gelu",
    "mish",
    "elu",
    "softplus",
    "logit",
    "pow.Tensor_Scalar",
    "pow.Tensor_Tensor",
    "atan2",
    "logaddexp",
    "hypot",
)


def _cpu_pointwise(name: str):
    base, _, overload = name.partition(".")
    packet = getattr(torch.ops.aten, base)
    out_op = getattr(packet, f"{overload}_out" if overload else "out")

    def run(*args, **kwargs):
        tensors = [a for a in args if torch.is_tensor(a)]
        shape = torch.broadcast_shapes(*(t.shape for t in tensors))
        dtype = torch.result_type(*args[:2]) if len(tensors) > 1 or (len(args) > 1 and base == "pow") else args[0].dtype
        if not dtype.is_floating_point:
            dtype = torch.get_default_dtype()
        n = math.prod(shape)
        size = max(64, -(-n // 64) * 64)
        flat = []
        for a in args:
            if torch.is_tensor(a):
                f = a.broadcast_to(shape).reshape(-1)
                flat.append(torch.nn.functional.pad(f, (0, size - n), value=1) if size != n else f.contiguous())
            else:
                flat.append(a)
        out = torch.empty(size, dtype=dtype, device=tensors[0].device)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            out_op(*flat, **kwargs, out=out)
        finally:
            torch.set_num_threads(threads)
        return out[:n].view(shape)

    return run


# aten operator (overload) -> replacement; registered for CPU and CUDA inside ``batch_invariant()``
OVERRIDDEN: dict[str, Any] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "mv": _mv,
    "dot": _dot,
    "sum.dim_IntList": _sum_dim,
    "sum": _sum,
    "mean.dim": _mean_dim,
    "mean": _mean,
    "_softmax": _softmax,
    "_log_softmax": _log_softmax,
    "logsumexp": _logsumexp,
    "linalg_vector_norm": _vector_norm,
    "cumsum": _cumsum,
    "topk": _topk,
    "sort": _sort,
}


CPU_OVERRIDDEN: dict[str, Any] = {name: _cpu_pointwise(name) for name in CPU_POINTWISE}


def _registrations() -> list[tuple[str, Any, str]]:
    regs = [(op, fn, "CPU") for op, fn in {**OVERRIDDEN, **CPU_OVERRIDDEN}.items()]
    if torch.cuda.is_available():
        regs += [(op, fn, "CUDA") for op, fn in OVERRIDDEN.items()]
    return regs


@contextlib.contextmanager
def batch_invariant(on: bool = True) -> Iterator[None]:
    """Route the operators of ``OVERRIDDEN`` through the invariant kernels while the block runs (re-entrant;
    ``on=False`` changes nothing)."""
    global _DEPTH
    if not on or _DEPTH:
        _DEPTH += bool(on)
        try:
            yield
        finally:
            _DEPTH -= bool(on)
        return
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():  # "Overriding a previously registered kernel ..." for each one
            warnings.simplefilter("ignore")
            for op, fn, key in _registrations():
                lib.impl(op, fn, key)
        _DEPTH = 1
        yield
    finally:
        _DEPTH = 0
        lib._destroy()


# -- the checker ---------------------------------------------------------------------------------------------------


class InvarianceViolation(RuntimeError):
    """A floating-point reduction or product ran outside the invariant kernels."""


_EXACT_REDUCTIONS = {
    "amax",
    "amin",
    "max",
    "min",
    "argmax",
    "argmin",
    "any",
    "all",
    "aminmax",
    "count_nonzero",
    "_local_scalar_dense",
}
# the accumulating index and scatter operators: their order of accumulation is their kernel's, which changes nothing
# while every value they add is integral (a count), so they pass when it is
_INTEGRAL_OK = {
    "index_add",
    "index_add_",
    "scatter_add",
    "scatter_add_",
    "scatter_reduce",
    "scatter_reduce_",
    "index_put",
    "index_put_",
    "_index_put_impl_",
}
_ORDER_DEPENDENT = {  # not tagged as reductions, but sum in an order their kernel picks
    "cumprod",
    "logcumsumexp",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
    "convolution",
    "native_layer_norm",
    "native_group_norm",
    "native_batch_norm",
    "addbmm",
    "addmv",
    "_cdist_forward",
    "kthvalue",
    "median",
    "nanmedian",
    "mode",
    "histc",
    "_addmm_activation",
    "_int_mm",
    "_weight_int4pack_mm",
    "index_reduce",
    "embedding_bag",
    "_embedding_bag",
    "trace",
    "renorm",
    "vdot",
    "tensordot",
    "_fused_rms_norm",
    "scaled_dot_product_attention",
    *_INTEGRAL_OK,
}


def _op_name(func) -> tuple[str, str]:
    name = func._schema.name.split("::")[-1]
    return name, f"{name}.{func._overloadname}" if func._overloadname != "default" else name


def _floats(args, kwargs) -> list[torch.Tensor]:
    return [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if torch.is_tensor(a) and a.is_floating_point()]


class _Checker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        base, full = _op_name(func)
        if full in OVERRIDDEN or full in CPU_OVERRIDDEN or base in _EXACT_REDUCTIONS:
            return func(*args, **kwargs)
        floats = _floats(args, kwargs)
        if floats:
            if base in ("index_put", "index_put_", "_index_put_impl_"):
                accumulate = kwargs.get("accumulate", args[3] if len(args) > 3 else False)
                suspicious = bool(accumulate)
            elif base in ("scatter_reduce", "scatter_reduce_"):
                reduce = kwargs.get("reduce", args[4] if len(args) > 4 else "sum")
                suspicious = reduce in ("sum", "mean", "prod")
            else:
                suspicious = base in _ORDER_DEPENDENT or torch.Tag.reduction in func.tags
            if suspicious and base in _INTEGRAL_OK:
                suspicious = not all(bool(torch.equal(t, t.round())) for t in floats if t.numel())
            if suspicious:
                raise InvarianceViolation(
                    f"aten::{full} on floating-point tensors runs outside the batch-invariant kernels (its result "
                    f"depends on how its kernel splits the work); use an operator of sparse_eval.invariance.OVERRIDDEN "
                    f"or an exact one"
                )
        return func(*args, **kwargs)


@contextlib.contextmanager
def checker() -> Iterator[_Checker]:
    """Raise ``InvarianceViolation`` on any order-dependent floating-point operator run in the block (tests)."""
    mode = _Checker()
    with mode:
        yield mode
