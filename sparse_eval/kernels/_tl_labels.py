"""Triton kernels of ``kernels.ds``'s per-step label work (imported lazily: see ``kernels._common``).

Each replaces a chain of small torch kernels of one decode step with one launch and reproduces its torch
reference bit for bit: IEEE divisions (``div_rn``), round-half-to-even written out, the same order of operations.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import on_tensor_device


@triton.jit
def _round_half_even(x):
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def _quantize(x, valid, s_ty, LEVELS: tl.constexpr):
    """Per-token min–max codes as ``kernels.ds.quantize_labels``: scale and zero rounded to the scale dtype first."""
    lo = tl.min(tl.where(valid, x, float("inf")), 0)
    hi = tl.max(tl.where(valid, x, float("-inf")), 0)
    scale = ((hi - lo) * (1.0 / LEVELS)).to(s_ty)
    zero = lo.to(s_ty)
    s32 = scale.to(tl.float32)
    z32 = zero.to(tl.float32)
    q = _round_half_even(tl.math.div_rn(x - z32, tl.maximum(s32, 1e-30)))
    q = tl.where(s32 > 0, q, 0.0)
    code = tl.minimum(tl.maximum(q, 0.0), LEVELS).to(tl.uint8)
    return code, scale, zero


@triton.jit
def _append_labels_kernel(
    K,
    CH,
    KVOF,
    CODES,
    SC,
    ZE,
    POS,
    stride_kb,
    stride_kh,
    stride_cb,
    stride_cl,
    stride_cn,
    stride_sb,
    stride_sl,
    HL,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BITS: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HL).to(tl.int64)
    lh = pid % HL
    pos = tl.load(POS).to(tl.int64)
    kvh = tl.load(KVOF + lh).to(tl.int64)
    k_base = K + b * stride_kb + kvh * stride_kh
    dst = CODES + b * stride_cb + lh * stride_cl + pos * stride_cn
    if BITS == 4:
        offs = tl.arange(0, BLOCK_R)  # pairs of channels (2j, 2j+1)
        valid = offs < R // 2
        ch_e = tl.load(CH + lh * R + 2 * offs, mask=valid, other=0).to(tl.int64)
        ch_o = tl.load(CH + lh * R + 2 * offs + 1, mask=valid, other=0).to(tl.int64)
        x_e = tl.load(k_base + ch_e, mask=valid, other=0.0).to(tl.float32)
        x_o = tl.load(k_base + ch_o, mask=valid, other=0.0).to(tl.float32)
        lo = tl.minimum(tl.min(tl.where(valid, x_e, float("inf")), 0), tl.min(tl.where(valid, x_o, float("inf")), 0))
        hi = tl.maximum(tl.max(tl.where(valid, x_e, float("-inf")), 0), tl.max(tl.where(valid, x_o, float("-inf")), 0))
        scale = ((hi - lo) * (1.0 / 15.0)).to(SC.dtype.element_ty)
        zero = lo.to(SC.dtype.element_ty)
        s32 = scale.to(tl.float32)
        z32 = zero.to(tl.float32)
        qe = tl.where(s32 > 0, _round_half_even(tl.math.div_rn(x_e - z32, tl.maximum(s32, 1e-30))), 0.0)
        qo = tl.where(s32 > 0, _round_half_even(tl.math.div_rn(x_o - z32, tl.maximum(s32, 1e-30))), 0.0)
        ce = tl.minimum(tl.maximum(qe, 0.0), 15.0).to(tl.uint8)
        co = tl.minimum(tl.maximum(qo, 0.0), 15.0).to(tl.uint8)
        tl.store(dst + offs, ce | (co << 4), mask=valid)
        tl.store(SC + b * stride_sb + lh * stride_sl + pos, scale)
        tl.store(ZE + b * stride_sb + lh * stride_sl + pos, zero)
    else:
        offs = tl.arange(0, BLOCK_R)
        valid = offs < R
        ch = tl.load(CH + lh * R + offs, mask=valid, other=0).to(tl.int64)
        x = tl.load(k_base + ch, mask=valid, other=0.0)
        if BITS == 16:
            tl.store(dst + offs, x.to(CODES.dtype.element_ty), mask=valid)
        else:
            code, scale, zero = _quantize(x.to(tl.float32), valid, SC.dtype.element_ty, 255.0)
            tl.store(dst + offs, code, mask=valid)
            tl.store(SC + b * stride_sb + lh * stride_sl + pos, scale)
            tl.store(ZE + b * stride_sb + lh * stride_sl + pos, zero)


@on_tensor_device
def append_labels(k_new, channels, kv_of, codes, scale, zero, pos, bits):
    b, hkv, _, d = k_new.shape
    hl, r = channels.shape
    k = k_new if k_new.stride(-1) == 1 else k_new.contiguous()
    ch = channels.to(torch.int32).contiguous() if channels.dtype != torch.int32 else channels.contiguous()
    sc = scale if scale is not None else codes
    ze = zero if zero is not None else codes
    block_r = max(2, triton.next_power_of_2(r // 2 if bits == 4 else r))
    _append_labels_kernel[(b * hl,)](
        k,
        ch,
        kv_of,
        codes,
        sc,
        ze,
        pos,
        *k.stride()[:2],
        *codes.stride()[:3],
        sc.stride(0) if scale is not None else 0,
        sc.stride(1) if scale is not None else 0,
        hl,
        R=r,
        BLOCK_R=block_r,
        BITS=bits,
        num_warps=1,
    )


@triton.jit
def _query_labels_kernel(
    Q,
    QCH,
    OUT,
    stride_qb,
    stride_qh,
    HQ,
    R: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BITS: tl.constexpr,
    QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    b = (pid // HQ).to(tl.int64)
    h = pid % HQ
    offs = tl.arange(0, BLOCK_R)
    valid = offs < R
    ch = tl.load(QCH + h * R + offs, mask=valid, other=0).to(tl.int64)
    x = tl.load(Q + b * stride_qb + h * stride_qh + ch, mask=valid, other=0.0).to(tl.float32)
    if QUANT:  # methods.double_sparsity.pseudo_quantize
        levels = tl.full([], (1 << BITS) - 1, tl.float32)
        lo = tl.min(tl.where(valid, x, float("inf")), 0)
        hi = tl.max(tl.where(valid, x, float("-inf")), 0)
        rng = hi - lo
        rng = tl.where(rng > 0, rng, 1.0)
        scale = tl.math.div_rn(1.0, rng) * levels  # torch evaluates ``levels / rng`` as rng.reciprocal() * levels
        c = tl.minimum(tl.maximum(_round_half_even((x - lo) * scale), 0.0), levels)
        x = tl.math.div_rn(c, scale) + lo
    tl.store(OUT + (b * HQ + h) * R + offs, x, mask=valid)


@on_tensor_device
def query_labels(q, q_channels, bits, quantize):
    b, hq, d = q.shape
    r = q_channels.shape[1]
    qq = q if q.stride(-1) == 1 else q.contiguous()
    ch = q_channels.to(torch.int32).contiguous() if q_channels.dtype != torch.int32 else q_channels.contiguous()
    out = torch.empty((b, hq, r), dtype=torch.float32, device=q.device)
    _query_labels_kernel[(b * hq,)](
        qq,
        ch,
        out,
        *qq.stride()[:2],
        hq,
        R=r,
        BLOCK_R=max(2, triton.next_power_of_2(r)),
        BITS=bits,
        QUANT=bool(quantize and bits < 16),
        num_warps=1,
    )
    return out
