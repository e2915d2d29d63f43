"""Which stage of the look-up costs the cold 25 us per row (throwaway experiment on the dev box)."""
import time, sys, numpy as np, torch, numba
from numba import njit, prange
import kernels.magicpig_cpu as kmc
import kernels.magicpig as kmp
from kernels._nb_magicpig import _prefetch, _cttz64
from sparse_eval.system.layers import _tile

@njit(parallel=True)
def variant(perm, offsets, qcodes, m, nthreads, mode, out_idx, out_cnt):
    # mode bits: 1 prefetch stage1, 2 prefetch buckets, 4 count, 8 clear+scan
    b_, hkv, l_, n = perm.shape
    hq = qcodes.shape[1]
    g = hq // hkv
    rows = b_ * hq
    nb = offsets.shape[3] - 1
    nwords = (n + 63) // 64
    for c in prange(nthreads):
        cnt = np.zeros(n, np.uint16)
        bitmap = np.zeros(nwords, np.uint64)
        lo_b = np.empty(l_, np.int64)
        hi_b = np.empty(l_, np.int64)
        for r in range(c, rows, nthreads):
            b = r // hq
            h = r % hq
            t = h // g
            found = 0
            if mode & 1:
                for l in range(l_):
                    code = qcodes[b, h, l]
                    _prefetch(offsets, b, t, l, code)
            for l in range(l_):
                code = qcodes[b, h, l]
                lo = np.int64(offsets[b, t, l, code])
                hi = np.int64(offsets[b, t, l, code + 1])
                if mode & 2:
                    for p in range(lo, min(hi, lo + 128), 16):
                        _prefetch(perm, b, t, l, p)
                lo_b[l] = lo
                hi_b[l] = hi
            if mode & 4:
                for l in range(l_):
                    for p in range(lo_b[l], hi_b[l]):
                        key = np.uint64(perm[b, t, l, p])
                        k2 = cnt[key] + np.uint16(1)
                        cnt[key] = k2
                        hit = np.uint64(k2 == m)
                        bitmap[np.int64(key >> np.uint64(6))] |= hit << (key & np.uint64(63))
                        found += np.int64(hit)
            else:
                s = 0
                for l in range(l_):
                    s += hi_b[l] - lo_b[l]
                found = s
            if mode & 8:
                for i in range(n):
                    cnt[i] = 0
                j = 0
                for w in range(nwords):
                    word = bitmap[w]
                    while word:
                        out_idx[b, h, j] = w * 64 + np.int64(_cttz64(word))
                        j += 1
                        word &= word - np.uint64(1)
                    bitmap[w] = 0
            out_cnt[b, h] = found

B, hkv, g, n, d = 1, 8, 4, int(sys.argv[1]), 128
rep = int(sys.argv[2])
K, L = 10, 150
gen = torch.Generator().manual_seed(0)
k = torch.randn(B, hkv, n, d, generator=gen)
w = kmp.random_projections(d, K, L, seed=0)
kc = kmp.hash_codes(k, w, K, L, backend="torch")
tables = kmc.build_tables(kc, K)
perm = _tile(tables.perm, rep, pin=False).numpy(); offsets = _tile(tables.offsets, rep, pin=False).numpy()
qcs = [kmp.hash_codes(torch.randn(B * rep, hkv * g, d, generator=gen), w, K, L, backend="torch").to(torch.int32).numpy() for _ in range(12)]
junk = np.ones(64 * 2**20, np.float32)
rows = B * rep * hkv * g
out = np.empty((B * rep, hkv * g, n), np.int32); cnt = np.empty((B * rep, hkv * g), np.int32)
th = 2
for mode in (0, 1, 2, 3, 4, 5, 6, 7, 15, 12, 8):
    variant(perm, offsets, qcs[0], 2, th, mode, out, cnt)
    cold = []
    for qc in qcs[1:]:
        junk.sum()
        t0 = time.perf_counter(); variant(perm, offsets, qc, 2, th, mode, out, cnt); cold.append(time.perf_counter() - t0)
    print(f"n {n} mode {mode:2d} (pf_off {mode&1}, pf_bucket {bool(mode&2)}, count {bool(mode&4)}, clear+scan {bool(mode&8)}): cold {np.median(cold)*1e6/rows*th:.1f} us/row-thread")
