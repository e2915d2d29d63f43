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

PREFETCH_ROWS = 16  # default distance: gathered rows requested ahead of use (≈ DRAM latency / time per row;
# the best of 0/4/8/16/32 in the 16-thread prefetch sweep on the H200 host, experiments/magicpig_cpu_attention)
PREFETCH_V_EARLY_MAX = 512  # default of attention(prefetch_v_early=): rows of at most this many keys get their V
# rows requested in pass (1) with the K rows.  On the H200 host's Xeon (16 threads,
# experiments/magicpig_cpu_attention/gather_ceiling.txt) that was 1.07-1.15x faster at 328 keys per row, about equal
# at 819, and 0.83-0.98x at 1,966-4,915
# reassociation lets LLVM vectorise the float32 reductions over the head dim; no 'nnan'/'ninf' (the code
# relies on -inf and on exact comparisons)
_FAST = {"reassoc", "contract", "nsz"}


@intrinsic
def _bits_as_float(typingctx, x):
    """Reinterpret a 32-bit integer as float32, a 64-bit one as float64 (LLVM bitcast)."""
    if isinstance(x, types.Integer) and x.bitwidth in (32, 64):
        wide = x.bitwidth == 64
        sig = (types.float64 if wide else types.float32)(x)

        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], ir.DoubleType() if wide else ir.FloatType())

        return sig, codegen
    return None


@intrinsic
def _prefetch(typingctx, arr, i0, i1, i2, i3):
    """Software prefetch (read, into L2 and beyond: prefetcht1) of &arr[i0, i1, i2, i3] for a 4-D array.  L2
    rather than L1 (prefetcht0): the faster of the two in a row-gather loop on a development machine (figures not
    kept)."""
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
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])
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
            return _bits_as_float(np.uint32(np.uint32(x) << np.uint32(16)))

        return impl
    if x == types.int16:  # float16 bits

        def impl(x):
            h = np.uint32(np.uint16(x))
            sign = np.uint32((h & np.uint32(0x8000)) << np.uint32(16))
            e = np.uint32((h >> np.uint32(10)) & np.uint32(0x1F))
            mant = np.uint32(h & np.uint32(0x3FF))
            normal = _bits_as_float(np.uint32(sign | ((e + np.uint32(112)) << np.uint32(23)) | (mant << np.uint32(13))))
            special = _bits_as_float(np.uint32(sign | np.uint32(0x7F800000) | (mant << np.uint32(13))))
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


# arccos on [-1, 1] without a libm call, so that the per-key correction loop vectorises: asin(s) = s + s·z·P(z)
# on [0, 1/2] (z = s²), P a degree-11 least-squares fit at Chebyshev nodes (max |error| of acos over [-1, 1]
# 4.4e-16, i.e. float64 rounding); |c| > 1/2 uses acos(|c|) = 2·asin(√((1 − |c|)/2)).  Branch-free (both halves
# computed, then selected).
_ASIN_P = (
    0.16666666666666646,
    0.07500000000021978,
    0.04464285710146497,
    0.030381947490254527,
    0.022372043664706378,
    0.017355334434132383,
    0.013928781847841392,
    0.011882032645784928,
    0.0077714397645414456,
    0.016129764409156828,
    -0.010908304349000406,
    0.028285381520428275,
)


@njit(fastmath=_FAST, inline="always")
def _acos(c):
    """arccos of a float64 in [-1, 1] (NaN in, NaN out)."""
    a = abs(c)
    big = a > 0.5
    zb = 0.5 - 0.5 * a
    z = zb if big else a * a
    s = math.sqrt(zb) if big else a
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11 = _ASIN_P
    p = c11
    p = p * z + c10
    p = p * z + c9
    p = p * z + c8
    p = p * z + c7
    p = p * z + c6
    p = p * z + c5
    p = p * z + c4
    p = p * z + c3
    p = p * z + c2
    p = p * z + c1
    p = p * z + c0
    asn = s + s * z * p
    r = 2.0 * asn if big else 0.5 * math.pi - asn
    return math.pi - r if c < 0.0 else r


# e^x for the softmax weights, also without a libm call (vectorised over keys): x = n·ln 2 + r, |r| ≤ ln 2 / 2
# (Cody–Waite split of ln 2: n·_LN2_HI is exact), e^r by its Taylor polynomial to r^12 (relative error 2e-16 on
# that interval), 2^n from the exponent bits.
_LOG2E = 1.0 / math.log(2.0)
_LN2_HI = math.ldexp(math.floor(math.ldexp(math.log(2.0), 32)), -32)  # ln 2 to 32 bits
_LN2_LO = math.log(2.0) - _LN2_HI
_EXP_C = tuple(1.0 / math.factorial(i) for i in range(13))


@njit(fastmath=_FAST, inline="always")
def _exp_nonpos(x):
    """e^x for a float64 x ≤ 0: x < −708 (incl. −inf) gives 0 (e^−708 is far below float32's range), NaN
    gives NaN."""
    ok = x >= -708.0
    n = math.floor(x * _LOG2E + 0.5) if ok else 0.0
    r = (x - n * _LN2_HI) - n * _LN2_LO
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12 = _EXP_C
    p = c12
    p = p * r + c11
    p = p * r + c10
    p = p * r + c9
    p = p * r + c8
    p = p * r + c7
    p = p * r + c6
    p = p * r + c5
    p = p * r + c4
    p = p * r + c3
    p = p * r + c2
    p = p * r + c1
    p = p * r + c0
    scale = _bits_as_float(np.uint64(np.int64(n) + 1023) << np.uint64(52))  # 2^n, n in [-1021, 0]
    return p * scale if ok else (x if x != x else 0.0)


@njit(parallel=True, fastmath=_FAST, cache=True)
def attention_kernel(q, k, v, idx, count, mean, scaling, logu, correct, pf, v_early_max, n_keys, v_col, out, lse, bad):
    """q [B, Hq, D] f32; k, v [B, Hkv, ≥ n_keys, ≥ D] (uint16 bf16 bits / int16 fp16 bits / f32): key i's K is
    k[b, t, i, :D] and its V v[b, t, i, v_col:v_col + D] (v_col = D with k and v one buffer holding a token's K and V
    side by side; else 0); idx [B, Hq, S] int32;
    count [B, Hq] int32; mean [B, Hkv, D] f32; logu [T + 1] f64: log u at p = j / T (eq. 10, linear
    interpolation between nodes); out [B, Hq, D] f32; lse [B, Hq] f32.

    Per query row, four passes, each over the S sampled keys (dots, ccs, xs [S]: thread-local scratch):
    (1) the gathered K rows give q·k and ‖k − mean‖² (direct form: two reductions per key; the expansion
        ‖k‖² − 2k·mean + ‖mean‖² needs three), four keys per step so q[d] and mean[d] are loaded once for four
        rows (the d-loop is vectorised over the head dim; one row at a time it was load bound);
    (2) eq. 11's p · T for all keys, vectorised over keys (no libm call: ``_acos``), then the log u table
        look-up (a gather) and the max in a scalar loop;
    (3) the softmax weights e^(l − max), vectorised over keys (``_exp_nonpos``);
    (4) the gathered V rows, four per step (o[d] loaded and stored once per four rows instead of per row).
    Passes (1) and (4) gather each row once, the rows ``pf`` positions ahead requested with a software prefetch
    (pf = 0: none); the last S mod 4 keys go through one-row loops.  A row of at most ``v_early_max`` keys also
    has its V rows prefetched in pass (1), with the K rows (pass (4) then finds them in cache, and pass (1) keeps
    twice the misses in flight), and its first ``pf`` rows requested before the loop.  A row with an index outside
    [0, n_keys) is not computed (o = 0, lse = NaN) and sets bad[0] = 1."""
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
        ok = True
        for j in range(n):
            if np.uint64(idx[b, h, j]) >= np.uint64(n_keys):  # negative entries wrap to huge unsigned values
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
        qn = math.sqrt(np.float64(qn2))
        dots = np.empty(max(n, 1), np.float32)  # [S] q·k, then the logits, then the softmax weights
        ccs = np.empty(max(n, 1), np.float32)  # [S] ‖k − mean‖²
        xs = np.empty(max(n, 1), np.float64)  # [S] p · T (eq. 11)
        n4 = n - n % 4
        v_early = pf > 0 and n <= v_early_max
        if v_early:  # the rows before the prefetch distance
            for jp in range(min(pf, n)):
                ia = np.uint64(idx[b, h, jp])
                for d0 in range(0, d_, kstep):
                    _prefetch(k, b, t, ia, d0)
                for d0 in range(0, d_, vstep):
                    _prefetch(v, b, t, ia, v_col + d0)
        for j0 in range(0, n4, 4):  # (1) K rows, four keys per step (q[d], mean[d] loaded once for the four)
            if pf > 0:
                for jp in range(j0 + pf, min(j0 + pf + 4, n)):
                    ia = np.uint64(idx[b, h, jp])
                    for d0 in range(0, d_, kstep):
                        _prefetch(k, b, t, ia, d0)
                    if v_early:
                        for d0 in range(0, d_, vstep):
                            _prefetch(v, b, t, ia, v_col + d0)
            i0 = np.uint64(idx[b, h, j0])  # unsigned: no negative-index wraparound code in the row loops
            i1 = np.uint64(idx[b, h, j0 + 1])
            i2 = np.uint64(idx[b, h, j0 + 2])
            i3 = np.uint64(idx[b, h, j0 + 3])
            s0 = s1 = s2 = s3 = np.float32(0.0)
            c0 = c1 = c2 = c3 = np.float32(0.0)
            for d in range(d_):  # direct 4-D indexing: a row view here would cost atomic refcounts per key
                qd = qv[d]
                md = mu[d]
                k0 = _to_f32(k[b, t, i0, d])
                k1 = _to_f32(k[b, t, i1, d])
                k2 = _to_f32(k[b, t, i2, d])
                k3 = _to_f32(k[b, t, i3, d])
                s0 += qd * k0
                s1 += qd * k1
                s2 += qd * k2
                s3 += qd * k3
                e0 = k0 - md
                e1 = k1 - md
                e2 = k2 - md
                e3 = k3 - md
                c0 += e0 * e0
                c1 += e1 * e1
                c2 += e2 * e2
                c3 += e3 * e3
            dots[j0] = s0
            dots[j0 + 1] = s1
            dots[j0 + 2] = s2
            dots[j0 + 3] = s3
            ccs[j0] = c0
            ccs[j0 + 1] = c1
            ccs[j0 + 2] = c2
            ccs[j0 + 3] = c3
        for j in range(n4, n):  # the last n % 4 keys (already prefetched by the loop above)
            i = np.uint64(idx[b, h, j])
            dot = np.float32(0.0)
            cc = np.float32(0.0)
            for d in range(d_):
                kf = _to_f32(k[b, t, i, d])
                dot += qv[d] * kf
                c = kf - mu[d]
                cc += c * c
            dots[j] = dot
            ccs[j] = cc
        mx = -3.0e38
        if correct:  # (2) logits = q·k · scaling − log u  (eq. 11)
            for j in range(n):  # vectorised over keys: p · T per key
                den = qn * math.sqrt(np.float64(ccs[j]))
                cosv = (np.float64(dots[j]) - np.float64(qmu)) / den if den > 0 else 0.0
                cosv = min(1.0, max(-1.0, cosv))
                xs[j] = (1.0 - _acos(cosv) / math.pi) * nt
            for j in range(n):  # table look-up (a gather) and the running max: scalar
                x = xs[j]
                jj = min(max(int(x), 0), nt - 1)
                lg = np.float32(dots[j] * scaling - (logu[jj] + (x - jj) * (logu[jj + 1] - logu[jj])))
                dots[j] = lg
                if lg > mx:
                    mx = lg
        else:
            for j in range(n):
                lg = np.float32(dots[j] * scaling)
                dots[j] = lg
                if lg > mx:
                    mx = lg
        logits = dots
        o = out[b, h]
        for d in range(d_):
            o[d] = 0.0
        if n == 0:
            lse[b, h] = -np.inf
            continue
        ssum = 0.0
        w = dots  # [S] logits -> softmax weights e^(l - max), float32, in place
        for j in range(n):  # vectorised over keys
            wj = np.float32(_exp_nonpos(np.float64(logits[j]) - mx))
            w[j] = wj
            ssum += wj
        for j0 in range(0, n4, 4):  # (3) V rows, four keys per step: one load and store of o[d] per four rows
            if pf > 0:
                for jp in range(j0 + pf, min(j0 + pf + 4, n)):
                    ia = np.uint64(idx[b, h, jp])
                    for d0 in range(0, d_, vstep):
                        _prefetch(v, b, t, ia, v_col + d0)
            i0 = np.uint64(idx[b, h, j0])
            i1 = np.uint64(idx[b, h, j0 + 1])
            i2 = np.uint64(idx[b, h, j0 + 2])
            i3 = np.uint64(idx[b, h, j0 + 3])
            w0 = w[j0]
            w1 = w[j0 + 1]
            w2 = w[j0 + 2]
            w3 = w[j0 + 3]
            for d in range(d_):
                o[d] += (w0 * _to_f32(v[b, t, i0, v_col + d]) + w1 * _to_f32(v[b, t, i1, v_col + d])) + (
                    w2 * _to_f32(v[b, t, i2, v_col + d]) + w3 * _to_f32(v[b, t, i3, v_col + d])
                )
        for j in range(n4, n):
            i = np.uint64(idx[b, h, j])
            wj = w[j]
            for d in range(d_):
                o[d] += wj * _to_f32(v[b, t, i, v_col + d])
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
    Ascending order comes from a per-thread bitmap of sampled keys scanned word by word (no comparison sort).
    The counters are reset after each row by a sequential clear, unless the row touched under 1/32 of them (then
    one by one): at (10,150) and (8,75) a row touches 1/7 to 1/3 of the keys, where the clear is cheaper.

    The L buckets of a row are random places in memory (tables of MBs per head), and each bucket's place is read
    from ``offsets`` first: a chain of two cache misses per table.  So a row runs in stages over its L tables --
    prefetch the L offset pairs, then read them and prefetch the first lines of the L buckets, then count -- and
    the misses of different tables overlap instead of following one another.  No array views in the loops
    (their reference counts are atomic)."""
    b_, hkv, l_, n = perm.shape
    hq = qcodes.shape[1]
    g = hq // hkv
    rows = b_ * hq
    nb = offsets.shape[3] - 1
    nwords = (n + 63) // 64
    for c in prange(nthreads):
        cnt = np.zeros(n, np.uint16)  # per-thread collision counters, reset after each row
        bitmap = np.zeros(nwords, np.uint64)  # per-thread set of sampled keys, cleared by the scan
        lo_b = np.empty(l_, np.int64)  # per-thread bucket bounds of the row's L tables (empty: lo = hi)
        hi_b = np.empty(l_, np.int64)
        for r in range(c, rows, nthreads):
            b = r // hq
            h = r % hq
            t = h // g
            found = 0
            touched = 0
            for l in range(l_):  # stage 1: the offset pairs
                code = qcodes[b, h, l]
                if code >= 0 and code < nb:
                    _prefetch(offsets, b, t, l, code)
            for l in range(l_):  # stage 2: bucket bounds, and the buckets' first lines
                code = qcodes[b, h, l]
                if code >= 0 and code < nb:
                    lo = np.int64(offsets[b, t, l, code])
                    hi = np.int64(offsets[b, t, l, code + 1])
                    for p in range(lo, min(hi, lo + 128), 16):  # its lines (64 B = 16 entries), up to 8
                        _prefetch(perm, b, t, l, p)
                else:
                    lo = hi = 0
                lo_b[l] = lo
                hi_b[l] = hi
                touched += hi - lo
            for l in range(l_):  # stage 3: count
                for p in range(lo_b[l], hi_b[l]):
                    key = np.uint64(perm[b, t, l, p])
                    k2 = cnt[key] + np.uint16(1)
                    cnt[key] = k2
                    if do_sort:  # branch-free: whether this entry completes a key's m-th collision is unpredictable
                        hit = np.uint64(k2 == m)
                        bitmap[np.int64(key >> np.uint64(6))] |= hit << (key & np.uint64(63))
                        found += np.int64(hit)
                    elif k2 == m:
                        out_idx[b, h, found] = np.int32(key)
                        found += 1
            if touched * 32 < n:  # reset the counters the row touched, one by one
                for l in range(l_):
                    for p in range(lo_b[l], hi_b[l]):
                        cnt[np.uint64(perm[b, t, l, p])] = 0
            else:  # or all of them, sequentially (vectorised): a 1.15-1.3x faster look-up at (10,150), (8,75)
                for i in range(n):
                    cnt[i] = 0
            if do_sort:
                j = 0
                for w in range(nwords):
                    word = bitmap[w]
                    while word:
                        out_idx[b, h, j] = w * 64 + np.int64(_cttz64(word))
                        j += 1
                        word &= word - np.uint64(1)
                    bitmap[w] = 0
            out_cnt[b, h] = found


@njit(parallel=True, cache=True)
def extra_hits_kernel(qcodes, extra, n_extra, m, hit_idx, hit_cnt):
    """Keys outside the tables, by brute force: for each query row (b, h), the e in [0, n_extra) whose codes
    extra[b, h // G, e] equal the row's qcodes[b, h] in at least m of the L tables, ascending, into
    hit_idx[b, h, :hit_cnt[b, h]].  qcodes [B, Hq, L] int32; extra [B, Hkv, ≥ n_extra, L] int32 (a buffer filled up
    to n_extra); hit_idx [B, Hq, ≥ n_extra] int32; hit_cnt [B, Hq] int32."""
    b_, hq, l_ = qcodes.shape
    g = hq // extra.shape[1]
    for r in prange(b_ * hq):
        b = r // hq
        h = r % hq
        t = h // g
        found = 0
        for e in range(n_extra):
            eq = 0
            for l in range(l_):
                eq += np.int32(extra[b, t, e, l] == qcodes[b, h, l])
            if eq >= m:
                hit_idx[b, h, found] = e
                found += 1
        hit_cnt[b, h] = found


@njit(parallel=True, cache=True)
def finish_rows_kernel(rows, cnt, offset, hit_idx, hit_cnt, extra_offset, out):
    """out[b, h] = the first cnt[b, h] entries of rows[b, h] plus ``offset``, then the hit_cnt[b, h] entries of
    hit_idx[b, h] plus ``extra_offset``, then −1 to the width of out.  rows [B, Hq, ≥ max cnt], hit_idx
    [B, Hq, E] int32; out [B, Hq, W] int32 with W ≥ max(cnt + hit_cnt)."""
    b_, hq, w = out.shape
    for r in prange(b_ * hq):
        b = r // hq
        h = r % hq
        n = cnt[b, h]
        for j in range(n):
            out[b, h, j] = rows[b, h, j] + offset
        ne = hit_cnt[b, h]
        for j in range(ne):
            out[b, h, n + j] = hit_idx[b, h, j] + extra_offset
        for j in range(n + ne, w):
            out[b, h, j] = -1


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
        partial[c] = _sum_f32(x[lo : min(n, lo + per)])
    return partial.sum()


@njit(parallel=True, cache=True)
def gather_read_kernel(k, v, idx, count, pf):
    """The memory traffic of ``attention_kernel`` without its arithmetic (the benchmark's ceiling for this access
    pattern): per query row, the count[b, h] indexed rows of k and then of v for its KV head, the rows ``pf`` ahead
    prefetched; each row's 16-bit words summed into an integer.  k, v [B, Hkv, N, D_k], [B, Hkv, N, D_v]
    uint16/int16 (D_v = 0 skips v: e.g. k holding a token's K and V side by side, D_k = 2·D); idx [B, Hq, S]
    int32 (entries assumed in [0, N)); count [B, Hq] int32.  Returns the total."""
    b_, hq, _ = idx.shape
    g = hq // k.shape[1]
    acc = np.zeros(b_ * hq, np.int64)
    for r in prange(b_ * hq):
        b = r // hq
        h = r % hq
        t = h // g
        n = count[b, h]
        s = np.int64(0)
        for arr in (k, v):
            d_ = arr.shape[3]
            if d_ == 0:
                continue
            step = max(1, 64 // arr.itemsize)
            for j in range(n):
                if pf > 0 and j + pf < n:
                    ia = np.uint64(idx[b, h, j + pf])
                    for d0 in range(0, d_, step):
                        _prefetch(arr, b, t, ia, d0)
                i = np.uint64(idx[b, h, j])
                rs = np.int32(0)  # up to 2 * 128 16-bit words fit an int32 sum
                for d in range(d_):
                    rs += np.int32(arr[b, t, i, d])
                s += rs
        acc[r] = s
    return acc.sum()


def set_threads(n: int) -> None:
    numba.set_num_threads(n)


def get_threads() -> int:
    return numba.get_num_threads()
