"""numba kernels of ``kernels.magicpig_cpu`` (imported lazily; JIT-compiled for the host CPU on first use and
cached on disk, so the machine's vector extensions are picked at run time).

KV rows arrive as raw 16-bit patterns or float32 and are widened to float32 in registers; the element type of
the array selects the conversion at compile time (``_to_f32`` overloads):

* uint16  -- bfloat16 bits: the float32 with those 16 bits on top (exact);
* int16   -- float16 bits (IEEE half: normal, subnormal, inf/NaN handled);
* float32 -- as is.
"""

from __future__ import annotations

import math

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

PREFETCH_ROWS = 8  # default distance: gathered rows requested ahead of use (≈ DRAM latency / time per row)
# reassociation lets LLVM vectorise the float32 reductions over the head dim; no 'nnan'/'ninf' (the code
# relies on -inf and on exact comparisons)
_FAST = {"reassoc", "contract", "nsz"}


@intrinsic
def _bits_as_f32(typingctx, x):
    """Reinterpret a 32-bit integer as float32 (LLVM bitcast)."""
    if isinstance(x, types.Integer) and x.bitwidth == 32:
        sig = types.float32(x)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.FloatType())

        return sig, codegen
    return None


@intrinsic
def _prefetch(typingctx, arr, i0, i1, i2, i3):
    """Software prefetch (read, keep in all cache levels) of &arr[i0, i1, i2, i3] for a 4-D array."""
    if not (isinstance(arr, types.Array) and arr.ndim == 4):
        return None
    sig = types.void(arr, i0, i1, i2, i3)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        inds = [context.cast(builder, a, t, types.intp) for a, t in zip(args[1:], signature.args[1:])]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, inds, wraparound=False, boundscheck=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _cttz64(typingctx, x):
    """Count trailing zeros of a uint64 (LLVM cttz)."""
    if x == types.uint64:
        sig = types.uint64(x)

        def codegen(context, builder, signature, args):
            return builder.cttz(args[0], ir.Constant(ir.IntType(1), 0))

        return sig, codegen
    return None


def _to_f32(x):  # pragma: no cover - replaced by the overloads in jitted code
    raise NotImplementedError


@overload(_to_f32, inline="always")
def _to_f32_impl(x):
    if x == types.uint16:  # bfloat16 bits

        def impl(x):
            return _bits_as_f32(np.uint32(np.uint32(x) << np.uint32(16)))

        return impl
    if x == types.int16:  # float16 bits

        def impl(x):
            h = np.uint32(np.uint16(x))
            sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
            e = np.uint32((h >> np.uint32(10)) & np.uint32(0x1F))
            mant = np.uint32(h & np.uint32(0x3FF))
            normal = _bits_as_f32(np.uint32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))))
            special = _bits_as_f32(np.uint32(sign | np.uint32(0x7F800000) | (mant << np.uint32(13))))
            sgn = np.float32(1.0) - np.float32(2.0) * np.float32(h >> np.uint32(15))
            sub = np.float32(mant) * np.float32(5.9604644775390625e-08) * sgn  # ±mant · 2^-24
            if e == 0:
                return sub
            if e == 31:
                return special
            return normal

        return impl
    if x == types.float32:

        def impl(x):
            return x

        return impl
    return None


@njit(cache=True)
def to_f32_array(x, out):
    """Test hook: widen a 1-D array with ``_to_f32``."""
    for i in range(x.shape[0]):
        out[i] = _to_f32(x[i])


@njit(parallel=True, fastmath=_FAST, cache=True)
def attention_kernel(q, k, v, idx, count, mean, scaling, logu, correct, pf, out, lse, bad):
    """q [B, Hq, D] f32; k, v [B, Hkv, N, D] (uint16 bf16 bits / int16 fp16 bits / f32); idx [B, Hq, S] int32;
    count [B, Hq] int32; mean [B, Hkv, D] f32; logu [T + 1] f64: log u at p = j / T (eq. 10, linear
    interpolation between nodes); out [B, Hq, D] f32; lse [B, Hq] f32.

    Two passes per query row: logits (K rows) then the weighted sum (V rows), each row gathered once, the row
    ``pf`` positions ahead requested with a software prefetch (pf = 0: none).  A row with an index outside
    [0, N) is not computed (o = 0, lse = NaN) and sets bad[0] = 1."""
    nt = logu.shape[0] - 1
    kstep = max(1, 64 // k.itemsize)
    vstep = max(1, 64 // v.itemsize)
    b_, hq, d_ = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    rows = b_ * hq
    for r in prange(rows):
        b = r // hq
        h = r % hq
        t = h // g
        n = count[b, h]
        n_keys = k.shape[2]
        ok = True
        for j in range(n):
            if np.uint64(idx[b, h, j]) >= n_keys:  # negative entries wrap to huge unsigned values
                ok = False
        if not ok:
            bad[0] = 1
            for d in range(d_):
                out[b, h, d] = 0.0
            lse[b, h] = np.nan
            continue
        qv = q[b, h]
        mu = mean[b, t]
        qn2 = np.float32(0.0)
        qmu = np.float32(0.0)
        for d in range(d_):
            qn2 += qv[d] * qv[d]
            qmu += qv[d] * mu[d]
        qn = math.sqrt(qn2)
        logits = np.empty(max(n, 1), np.float32)
        mx = -3.0e38
        for j in range(n):
            if pf > 0 and j + pf < n:
                ia = np.uint64(idx[b, h, j + pf])
                for d0 in range(0, d_, kstep):
                    _prefetch(k, b, t, ia, d0)
            i = np.uint64(idx[b, h, j])  # unsigned: no negative-index wraparound code in the row loops
            dot = np.float32(0.0)
            cc = np.float32(0.0)
            for d in range(d_):  # direct 4-D indexing: a row view here would cost atomic refcounts per key
                kf = _to_f32(k[b, t, i, d])
                dot += qv[d] * kf
                c = kf - mu[d]
                cc += c * c
            lg = dot * scaling
            if correct:
                den = qn * math.sqrt(cc)
                cosv = (dot - qmu) / den if den > 0 else 0.0
                cosv = min(1.0, max(-1.0, cosv))
                x = (1.0 - math.acos(cosv) / math.pi) * nt  # p · T  (eq. 11)
                jj = min(int(x), nt - 1)
                lg = lg - (logu[jj] + (x - jj) * (logu[jj + 1] - logu[jj]))
            logits[j] = lg
            if lg > mx:
                mx = lg
        o = out[b, h]
        for d in range(d_):
            o[d] = 0.0
        if n == 0:
            lse[b, h] = -np.inf
            continue
        ssum = 0.0
        for j in range(n):
            w = np.float32(math.exp(logits[j] - mx))
            ssum += w
            if pf > 0 and j + pf < n:
                ia = np.uint64(idx[b, h, j + pf])
                for d0 in range(0, d_, vstep):
                    _prefetch(v, b, t, ia, d0)
            i = np.uint64(idx[b, h, j])  # unsigned: no negative-index wraparound code in the row loops
            for d in range(d_):
                o[d] += w * _to_f32(v[b, t, i, d])
        inv = np.float32(1.0 / ssum)
        for d in range(d_):
            o[d] *= inv
        lse[b, h] = mx + math.log(ssum)


@njit(parallel=True, cache=True)
def build_kernel(codes, perm, offsets):
    """codes [B, Hkv, L, N] uint16 -> perm [B, Hkv, L, N] int32 (stable counting sort by code) and
    offsets [B, Hkv, L, 2^K + 1] int32 (bucket c = perm[..., offsets[c]:offsets[c+1]])."""
    b_, h_, l_, n = codes.shape
    nb = offsets.shape[3] - 1
    tasks = b_ * h_ * l_
    for task in prange(tasks):
        b = task // (h_ * l_)
        h = (task // l_) % h_
        l = task % l_
        cod = codes[b, h, l]
        off = offsets[b, h, l]
        for c in range(nb + 1):
            off[c] = 0
        for i in range(n):
            off[cod[i] + 1] += 1
        for c in range(nb):
            off[c + 1] += off[c]
        pos = off[:nb].copy()
        dst = perm[b, h, l]
        for i in range(n):
            c = cod[i]
            dst[pos[c]] = i
            pos[c] += 1


@njit(parallel=True, cache=True)
def sample_kernel(perm, offsets, qcodes, m, nthreads, do_sort, out_idx, out_cnt):
    """For each query row (b, h): count, per key of KV head h // G, the tables whose bucket of the query's code
    holds it; a key enters the sample when its count reaches m.  Reads only the query's L buckets.
    perm/offsets as built by ``build_kernel``; qcodes [B, Hq, L] int32; out_idx [B, Hq, N] int32 (first
    out_cnt[b, h] entries written: ascending when do_sort, else in discovery order); out_cnt [B, Hq] int32.
    Ascending order comes from a per-thread bitmap of sampled keys scanned word by word (no comparison sort)."""
    b_, hkv, l_, n = perm.shape
    hq = qcodes.shape[1]
    g = hq // hkv
    rows = b_ * hq
    nb = offsets.shape[3] - 1
    nwords = (n + 63) // 64
    for c in prange(nthreads):
        cnt = np.zeros(n, np.uint16)  # per-thread collision counters, reset after each row
        bitmap = np.zeros(nwords, np.uint64)  # per-thread set of sampled keys, cleared by the scan
        for r in range(c, rows, nthreads):
            b = r // hq
            h = r % hq
            t = h // g
            dst = out_idx[b, h]
            found = 0
            lo_w = nwords
            hi_w = -1
            for l in range(l_):
                code = qcodes[b, h, l]
                if code < 0 or code >= nb:
                    continue
                bucket = perm[b, t, l, offsets[b, t, l, code]:offsets[b, t, l, code + 1]]
                for p in range(bucket.shape[0]):
                    key = np.uint64(bucket[p])
                    k2 = cnt[key] + np.uint16(1)
                    cnt[key] = k2
                    if k2 == m:
                        if do_sort:
                            w = np.int64(key >> np.uint64(6))
                            bitmap[w] |= np.uint64(1) << (key & np.uint64(63))
                            lo_w = min(lo_w, w)
                            hi_w = max(hi_w, w)
                        else:
                            dst[found] = np.int32(key)
                        found += 1
            for l in range(l_):
                code = qcodes[b, h, l]
                if code < 0 or code >= nb:
                    continue
                bucket = perm[b, t, l, offsets[b, t, l, code]:offsets[b, t, l, code + 1]]
                for p in range(bucket.shape[0]):
                    cnt[np.uint64(bucket[p])] = 0
            if do_sort:
                j = 0
                for w in range(lo_w, hi_w + 1):
                    word = bitmap[w]
                    while word:
                        dst[j] = w * 64 + np.int64(_cttz64(word))
                        j += 1
                        word &= word - np.uint64(1)
                    bitmap[w] = 0
            out_cnt[b, h] = found


@njit(fastmath=_FAST, cache=True)
def _sum_f32(x):
    s = np.float32(0.0)
    for i in range(x.shape[0]):
        s += x[i]
    return s


@njit(parallel=True, cache=True)
def stream_read_kernel(x):
    """Sum of a large float32 array (the DRAM streaming-read bandwidth probe of the benchmark): contiguous
    chunks per task, each summed by a vectorised serial loop (loop indices from a slice's shape, so numba
    emits no negative-index code)."""
    nchunks = 4096
    n = x.shape[0]
    per = (n + nchunks - 1) // nchunks
    partial = np.zeros(nchunks, np.float32)
    for c in prange(nchunks):
        lo = min(n, c * per)
        partial[c] = _sum_f32(x[lo:min(n, lo + per)])
    return partial.sum()


def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def get_threads() -> int:
    return numba.get_num_threads()
