"""Before/after of the MagicPIG table look-up kernel (sample_kernel), interleaved call by call, medians."""
import sys, time, statistics, importlib
import numpy as np, torch
sys.path.insert(0, "/tmp/kmods")
old, new = importlib.import_module("nb_old"), importlib.import_module("nb_new")
import numba
from kernels import magicpig_cpu as kmc
b, n, threads, K, L = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
numba.set_num_threads(threads)
hkv, hq = 8, 32
g = torch.Generator().manual_seed(0)
codes = torch.randint(0, 1 << K, (b, hkv, n, L), generator=g, dtype=torch.int32)
tables = kmc.build_tables(codes, K)
perm, offs = tables.perm.numpy(), tables.offsets.numpy()
res = {"old": [], "new": []}
for rep in range(15):
    key = codes[:, :, rep, :].repeat_interleave(4, 1)
    q = torch.randint(0, 1 << K, (b, hq, L), generator=g, dtype=torch.int32)
    q = torch.where(torch.rand(b, hq, L, generator=g) < 0.5, key, q).numpy()
    outs = {}
    for name, mod in (("old", old), ("new", new)):
        out = np.empty((b, hq, n), np.int32); cnt = np.empty((b, hq), np.int32)
        t0 = time.perf_counter(); mod.sample_kernel(perm, offs, q, 2, threads, True, out, cnt); t = time.perf_counter() - t0
        if rep >= 2:
            res[name].append(t)
        outs[name] = (out, cnt)
    assert np.array_equal(outs["old"][1], outs["new"][1])
    for i in range(b):
        for h in range(hq):
            c = outs["old"][1][i, h]
            assert np.array_equal(outs["old"][0][i, h, :c], outs["new"][0][i, h, :c])
rows = b * hq
mo, mn = statistics.median(res["old"]), statistics.median(res["new"])
print(f"B={b} N={n} K={K} L={L} threads={threads}: old {mo*1e3:.2f} ms ({mo*1e6/rows:.1f} us/row), new {mn*1e3:.2f} ms ({mn*1e6/rows:.1f} us/row), x{mo/mn:.2f}")
