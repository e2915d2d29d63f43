"""Triton kernels of ``kernels.sparse_decode`` (imported lazily: see ``kernels._common``).

Under the interpreter (and for float32 caches) every load is cast to float32 right after ``tl.load``: the
interpreter's bf16 ``tl.dot`` is wrong.  Compiled for the GPU, the bf16/fp16 K/V tiles go to the tensor cores as
they are (an fp32 copy of a [64, 128] tile doubles the registers and made ptxas spill at sm_90), with P cast to
the cache dtype for P·V as flash attention does; scores, softmax state and the accumulator are float32.  Float32
tiles multiply in IEEE float32 (``input_precision="ieee"``), not in Triton's default TF32.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import next_pow2, on_tensor_device, split_plan, triton_interpret, unit_last

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


@triton.jit
def _online(m_i, l_i, acc, lg, v, UPCAST: tl.constexpr):
    """One online-softmax step: lg [R, BN] logits (log2 units, −inf = not attended), v [BN, BD]."""
    m_new = tl.maximum(m_i, tl.max(lg, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(lg - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if UPCAST:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, m_use, alpha, p, l_i, acc


@triton.jit
def _sparse_decode_split(
    Q,
    K,
    V,
    IDX,
    CNT,
    PACC,
    PM,
    PL,
    O,
    LSE,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    stride_ib,
    stride_ih,
    stride_cb,
    stride_ch,
    HQ,
    HI,
    S,
    split_len,
    n_splits,
    qk_scale,
    QPI: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_CNT: tl.constexpr,
    SINGLE: tl.constexpr,
    INTERP: tl.constexpr,
    N_ITER: tl.constexpr,
    UPCAST: tl.constexpr,
    DENSE: tl.constexpr,
):
    pid = tl.program_id(0)
    sid = tl.program_id(1)
    b = pid // HI
    hi = pid % HI
    h0 = hi * QPI  # first query head served by this program
    kvh = h0 // G
    b64 = b.to(tl.int64)

    offs_q = tl.arange(0, BLOCK_Q)
    offs_d = tl.arange(0, BLOCK_D)
    qmask = offs_q < QPI
    dmask = offs_d < D
    q_ptrs = Q + b64 * stride_qb + (h0 + offs_q)[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=qmask[:, None] & dmask[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    else:
        q = q.to(K.dtype.element_ty)

    n_valid = S
    if HAS_CNT:
        n_valid = tl.minimum(tl.load(CNT + b64 * stride_cb + hi * stride_ch).to(tl.int32), S)
    start = sid * split_len
    end = tl.minimum(start + split_len, n_valid)

    m_i = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q], tl.float32)
    acc = tl.zeros([BLOCK_Q, BLOCK_D], tl.float32)
    k_base = K + b64 * stride_kb + kvh * stride_kh
    v_base = V + b64 * stride_vb + kvh * stride_vh
    i_base = IDX + b64 * stride_ib + hi * stride_ih
    # the interpreter (numpy >= 2.4) cannot take tensor loop bounds: a constexpr trip count, masked tails
    for it in range(0 if INTERP else start, N_ITER if INTERP else end, 1 if INTERP else BLOCK_N):
        # one online-softmax step over BLOCK_N gathered rows (scores in log2 units).  UPCAST: K/V tiles in float32
        # (the interpreter, fp32 caches); else the cache dtype goes to the tensor cores, P in that dtype for P·V (the
        # flash-attention practice), accumulation in float32.  DENSE: the rows are the positions n0 .. n0+BLOCK_N−1
        # themselves (no index list), valid below ``end``
        offs_n = (start + it * BLOCK_N if INTERP else it) + tl.arange(0, BLOCK_N)
        if DENSE:
            valid = offs_n < end
            rows = tl.where(valid, offs_n, 0).to(tl.int64)
        else:
            ids = tl.load(i_base + offs_n, mask=offs_n < end, other=-1)
            valid = ids >= 0
            rows = tl.where(valid, ids, 0).to(tl.int64)
        kv_mask = valid[:, None] & dmask[None, :]
        kt = tl.load(k_base + rows[:, None] * stride_kn + offs_d[None, :], mask=kv_mask, other=0.0)
        vt = tl.load(v_base + rows[:, None] * stride_vn + offs_d[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
        # scaled after the product: q and k enter the product exactly (same dtype).  Float32 tiles (UPCAST) multiply in
        # IEEE float32: Triton's default for them on the GPU is TF32 (10-bit mantissa, ~1e-3 relative error per score),
        # which on an fp32 model moves label-score near-ties and so the selected keys away from the torch reference
        if UPCAST:
            s = tl.dot(q, tl.trans(kt), input_precision="ieee") * qk_scale  # [BLOCK_Q, BLOCK_N], log2 units
        else:
            s = tl.dot(q, tl.trans(kt)) * qk_scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_i, _, _, _, l_i, acc = _online(m_i, l_i, acc, s, vt, UPCAST)

    heads = h0 + offs_q
    if SINGLE:
        has = l_i > 0
        l_safe = tl.where(has, l_i, 1.0)
        o = acc / l_safe[:, None]
        lse = tl.where(has, (m_i + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
        o_ptrs = O + (b64 * HQ + heads)[:, None] * D + offs_d[None, :]
        tl.store(o_ptrs, o.to(O.dtype.element_ty), mask=qmask[:, None] & dmask[None, :])
        tl.store(LSE + b64 * HQ + heads, lse, mask=qmask)
    else:
        prow = (b64 * HQ + heads) * n_splits + sid
        tl.store(PACC + prow[:, None] * BLOCK_D + offs_d[None, :], acc, mask=qmask[:, None])
        tl.store(PM + prow, m_i, mask=qmask)
        tl.store(PL + prow, l_i, mask=qmask)


@triton.jit
def _sparse_decode_reduce(
    PACC,
    PM,
    PL,
    O,
    LSE,
    n_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # b * HQ + h
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    smask = offs_s < n_splits
    m = tl.load(PM + row * n_splits + offs_s, mask=smask, other=float("-inf"))
    l = tl.load(PL + row * n_splits + offs_s, mask=smask, other=0.0)
    m_max = tl.max(m, 0)
    m_use = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m - m_use)
    l_tot = tl.sum(w * l, 0)
    acc = tl.load(PACC + (row * n_splits + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=smask[:, None], other=0.0)
    o = tl.sum(w[:, None] * acc, 0)
    has = l_tot > 0
    l_safe = tl.where(has, l_tot, 1.0)
    o = o / l_safe
    lse = tl.where(has, (m_use + tl.log2(l_safe)) * 0.6931471805599453, float("-inf"))
    dmask = offs_d < D
    tl.store(O + row * D + offs_d, o.to(O.dtype.element_ty), mask=dmask)
    tl.store(LSE + row, lse)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few splits, to exercise the reduction


@on_tensor_device
def run(q, k, v, idx, *, scaling, count, out_dtype, block_n, num_splits, num_warps, num_stages, lengths=None):
    """Sparse attention over ``idx``; or, with ``idx=None``, dense attention over the first ``lengths[b]``
    positions of each row (one program per KV head serving its G query heads)."""
    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    dense = idx is None
    hi = hkv if dense else idx.shape[1]
    qpi = hq // hi
    s_len = k.shape[2] if dense else idx.shape[2]
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    out_dtype = out_dtype or q.dtype
    dev = q.device
    q, k, v = unit_last(q, k, v)
    if not dense:
        (idx,) = unit_last(idx)
    o = torch.empty((b, hq, d), dtype=out_dtype, device=dev)
    lse = torch.empty((b, hq), dtype=torch.float32, device=dev)
    if s_len == 0 or b == 0:
        o.zero_()
        lse.fill_(float("-inf"))
        return o, lse
    block_d = max(16, next_pow2(d))
    block_q = max(16, next_pow2(qpi))
    upcast = triton_interpret() or k.dtype == torch.float32 or k.dtype != q.dtype
    # ptxas (sm_90, D 128): 16-bit tiles at BLOCK_N 64 fit 4 warps without spilling (~248 registers); float32
    # tiles (IEEE products on the FMA units) fit 8 warps at BLOCK_N 32 and spill at 64
    fp32_tiles_on_gpu = upcast and not triton_interpret()
    block_n = block_n or (32 if block_d > 128 or fp32_tiles_on_gpu else 64)
    if num_splits is None:
        splits, per = split_plan(b * hi, s_len, block_n, _sm_count(dev))
    else:
        splits = max(1, min(int(num_splits), -(-s_len // block_n)))
        per = -(-(-(-s_len // splits)) // block_n) * block_n
        splits = -(-s_len // per)
    if dense:  # the row lengths act as the per-row count, the same for every KV head of a row
        cnt = lengths.to(device=dev, dtype=torch.int32).contiguous().view(b, 1).expand(b, hi)
        idx = cnt  # unused by the DENSE kernel
    else:
        cnt = count.to(device=dev, dtype=torch.int32).contiguous() if count is not None else idx
    extra = {"num_warps": num_warps or (8 if fp32_tiles_on_gpu else 4)}
    if num_stages is not None:
        extra["num_stages"] = num_stages
    single = splits == 1
    interp = triton_interpret()
    if single:
        pacc = pm = pl = lse  # unused
    else:
        pacc = torch.empty((b * hq * splits, block_d), dtype=torch.float32, device=dev)
        pm = torch.empty((b * hq * splits,), dtype=torch.float32, device=dev)
        pl = torch.empty((b * hq * splits,), dtype=torch.float32, device=dev)
    _sparse_decode_split[(b * hi, splits)](
        q,
        k,
        v,
        idx,
        cnt,
        pacc,
        pm,
        pl,
        o,
        lse,
        *q.stride()[:2],
        *k.stride()[:3],
        *v.stride()[:3],
        0 if dense else idx.stride(0),
        0 if dense else idx.stride(1),
        *cnt.stride()[:2],
        hq,
        hi,
        s_len,
        per,
        splits,
        scaling * LOG2E,
        QPI=qpi,
        G=g,
        D=d,
        BLOCK_D=block_d,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        HAS_CNT=dense or count is not None,
        SINGLE=single,
        INTERP=interp,
        N_ITER=per // block_n if interp else 0,
        UPCAST=upcast,
        DENSE=dense,
        **extra,
    )
    if not single:
        _sparse_decode_reduce[(b * hq,)](
            pacc,
            pm,
            pl,
            o,
            lse,
            splits,
            D=d,
            BLOCK_D=block_d,
            BLOCK_S=max(2, next_pow2(splits)),
        )
    return o, lse
