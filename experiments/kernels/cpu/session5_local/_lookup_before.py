"""The table look-up kernel before session 5's counter reset change (commit 72e1f54), for lookup_reset.py."""
import numpy as np
from numba import njit, prange

from kernels._nb_magicpig import _cttz64, _prefetch


@njit(parallel=True, cache=False)
def sample_kernel_before(perm, offsets, qcodes, m, nthreads, do_sort, out_idx, out_cnt):
    """For each query row (b, h): count, per key of KV head h // G, the tables whose bucket of the query's code
    holds it; a key enters the sample when its count reaches m.  Reads only the query's L buckets.
    perm/offsets as built by ``build_kernel``; qcodes [B, Hq, L] int32; out_idx [B, Hq, N] int32 (first
    out_cnt[b, h] entries written: ascending when do_sort, else in discovery order); out_cnt [B, Hq] int32.
    Ascending order comes from a per-thread bitmap of sampled keys scanned word by word (no comparison sort).

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
            lo_w = nwords
            hi_w = -1
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
            for l in range(l_):  # stage 3: count
                for p in range(lo_b[l], hi_b[l]):
                    key = np.uint64(perm[b, t, l, p])
                    k2 = cnt[key] + np.uint16(1)
                    cnt[key] = k2
                    if k2 == m:
                        if do_sort:
                            w = np.int64(key >> np.uint64(6))
                            bitmap[w] |= np.uint64(1) << (key & np.uint64(63))
                            lo_w = min(lo_w, w)
                            hi_w = max(hi_w, w)
                        else:
                            out_idx[b, h, found] = np.int32(key)
                        found += 1
            for l in range(l_):  # reset the counters the row touched
                for p in range(lo_b[l], hi_b[l]):
                    cnt[np.uint64(perm[b, t, l, p])] = 0
            if do_sort:
                j = 0
                for w in range(lo_w, hi_w + 1):
                    word = bitmap[w]
                    while word:
                        out_idx[b, h, j] = w * 64 + np.int64(_cttz64(word))
                        j += 1
                        word &= word - np.uint64(1)
                    bitmap[w] = 0
            out_cnt[b, h] = found
