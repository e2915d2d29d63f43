"""Row-pipelined look-up vs the current kernel, cold caches (throwaway experiment on the dev box)."""
import time, sys, numpy as np, torch, numba
from numba import njit, prange
import kernels.magicpig_cpu as kmc
import kernels.magicpig as kmp
from kernels._nb_magicpig import _prefetch, _cttz64, sample_kernel
from sparse_eval.system.layers import _tile

@njit(parallel=True, cache=False)
def piped(perm, offsets, qcodes, m, nthreads, out_idx, out_cnt):
    """Per thread, a 3-stage pipeline over its rows: offsets of row j+2 prefetched, buckets of row j+1 prefetched
    (its offsets read), row j counted."""
    b_, hkv, l_, n = perm.shape
    hq = qcodes.shape[1]
    g = hq // hkv
    rows = b_ * hq
    nb = offsets.shape[3] - 1
    nwords = (n + 63) // 64
    for c in prange(nthreads):
        cnt = np.zeros(n, np.uint16)
        bitmap = np.zeros(nwords, np.uint64)
        lo_b = np.zeros((2, l_), np.int64)
        hi_b = np.zeros((2, l_), np.int64)
        my = (rows - c + nthreads - 1) // nthreads  # rows c, c + T, ...
        for j in range(-2, my):
            r2 = c + (j + 2) * nthreads  # stage 1: offsets of row j + 2
            if j + 2 < my:
                b = r2 // hq
                h = r2 % hq
                t = h // g
                for l in range(l_):
                    code = qcodes[b, h, l]
                    if code >= 0 and code < nb:
                        _prefetch(offsets, b, t, l, code)
            if 0 <= j + 1 < my:  # stage 2: bounds of row j + 1, its buckets prefetched
                r1 = c + (j + 1) * nthreads
                b = r1 // hq
                h = r1 % hq
                t = h // g
                s = (j + 1) & 1
                for l in range(l_):
                    code = qcodes[b, h, l]
                    if code >= 0 and code < nb:
                        lo = np.int64(offsets[b, t, l, code])
                        hi = np.int64(offsets[b, t, l, code + 1])
                        for p in range(lo, min(hi, lo + 128), 16):
                            _prefetch(perm, b, t, l, p)
                    else:
                        lo = hi = 0
                    lo_b[s, l] = lo
                    hi_b[s, l] = hi
            if j >= 0:  # stage 3: count row j
                r = c + j * nthreads
                b = r // hq
                h = r % hq
                t = h // g
                s = j & 1
                found = 0
                touched = 0
                for l in range(l_):
                    touched += hi_b[s, l] - lo_b[s, l]
                    for p in range(lo_b[s, l], hi_b[s, l]):
                        key = np.uint64(perm[b, t, l, p])
                        k2 = cnt[key] + np.uint16(1)
                        cnt[key] = k2
                        hit = np.uint64(k2 == m)
                        bitmap[np.int64(key >> np.uint64(6))] |= hit << (key & np.uint64(63))
                        found += np.int64(hit)
                if touched * 32 < n:
                    for l in range(l_):
                        for p in range(lo_b[s, l], hi_b[s, l]):
                            cnt[np.uint64(perm[b, t, l, p])] = 0
                else:
                    for i in range(n):
                        cnt[i] = 0
                jj = 0
                for w in range(nwords):
                    word = bitmap[w]
                    while word:
                        out_idx[b, h, jj] = w * 64 + np.int64(_cttz64(word))
                        jj += 1
                        word &= word - np.uint64(1)
                    bitmap[w] = 0
                out_cnt[b, h] = found

B, hkv, g, n, d = 1, 8, 4, int(sys.argv[1]), 128
rep = int(sys.argv[2]); K, L = int(sys.argv[3]), int(sys.argv[4])
gen = torch.Generator().manual_seed(0)
k = torch.randn(B, hkv, n, d, generator=gen)
w = kmp.random_projections(d, K, L, seed=0)
kc = kmp.hash_codes(k, w, K, L, backend="torch")
tables = kmc.build_tables(kc, K)
perm = _tile(tables.perm, rep, pin=False).numpy(); offsets = _tile(tables.offsets, rep, pin=False).numpy()
qcs = [kmp.hash_codes(torch.randn(B * rep, hkv * g, d, generator=gen), w, K, L, backend="torch").to(torch.int32).numpy() for _ in range(16)]
junk = np.ones(64 * 2**20, np.float32)
rows = B * rep * hkv * g
th = 2
o1 = np.empty((B * rep, hkv * g, n), np.int32); c1 = np.empty((B * rep, hkv * g), np.int32)
o2 = np.empty_like(o1); c2 = np.empty_like(c1)
sample_kernel(perm, offsets, qcs[0], 2, th, True, o1, c1); piped(perm, offsets, qcs[0], 2, th, o2, c2)
res = {"current": [], "piped": []}
for qc in qcs[1:]:
    for name in (("current", "piped") if len(res["current"]) % 2 == 0 else ("piped", "current")):
        junk.sum()
        t0 = time.perf_counter()
        if name == "current": sample_kernel(perm, offsets, qc, 2, th, True, o1, c1)
        else: piped(perm, offsets, qc, 2, th, o2, c2)
        res[name].append(time.perf_counter() - t0)
    assert (c1 == c2).all() and all((o1[b, h, :c1[b, h]] == o2[b, h, :c1[b, h]]).all() for b in range(c1.shape[0]) for h in range(c1.shape[1]))
m1, m2 = np.median(res["current"]), np.median(res["piped"])
print(f"n {n} (K,L)=({K},{L}) rows {rows}: current {m1*1e6/rows*th:.1f}, piped {m2*1e6/rows*th:.1f} us/row-thread (cold) -> {m1/m2:.2f}x; same samples")
