"""attention_kernel alone, several versions interleaved rep by rep (same machine state for each):

    python kernel_only.py MOD1,MOD2 THREADS REPS

MOD*: module names importable from $KMODS (default /tmp/kmods), copies of kernels/_nb_magicpig.py (e.g. the
version before and after a change).  Cases: rows in L2 (N = 256), in L3 (N = 4096), from DRAM (N = 98,304,
5 %: a 0.5 GB streaming pass before each call); bf16, 32 query heads, 8 KV heads, d = 128; median and best."""
import importlib, os, statistics, sys, time

import numpy as np
import torch
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]))
from kernels import magicpig_cpu as mc
sys.path.insert(0, os.environ.get('KMODS', '/tmp/kmods'))
mods = [importlib.import_module(p) for p in sys.argv[1].split(",")]
import numba
th = int(sys.argv[2]) if len(sys.argv) > 2 else 1
numba.set_num_threads(th)
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 15
HQ, HKV, D = 32, 8, 128
rng = np.random.default_rng(0)
buf = np.ones(int(0.5e9) // 4, np.float32)
table = mc.logu_table(10, 150, 2)
def case(n, s, b=1):
    k = torch.randn(b, HKV, n, D).to(torch.bfloat16).view(torch.uint16).numpy()
    v = torch.randn(b, HKV, n, D).to(torch.bfloat16).view(torch.uint16).numpy()
    q = rng.standard_normal((b, HQ, D)).astype(np.float32)
    mean = torch.from_numpy(k.view(np.int16)).view(torch.bfloat16).float().mean(2).numpy()
    sets = [np.sort(np.argsort(rng.random((b, HQ, n)), -1)[..., :s], -1).astype(np.int32) for _ in range(4)]
    cnt = np.full((b, HQ), s, np.int32)
    return q, k, v, sets, cnt, mean
def timeit_all(c, flush, correct=True, pf=None):
    q, k, v, sets, cnt, mean = c
    b = q.shape[0]
    out = np.empty((b, HQ, D), np.float32); lse = np.empty((b, HQ), np.float32); bad = np.zeros(1, np.int64)
    ts = [[] for _ in mods]
    with numba.parallel_chunksize(1):
        for r in range(reps + 2):
            for mi, m in enumerate(mods):
                if flush: m.stream_read_kernel(buf)
                ix = sets[r % 4]
                p = m.PREFETCH_ROWS if pf is None else pf
                t = time.perf_counter()
                # session 6's arguments: rows with early V prefetch, the cache's N, V's column in its rows
                extra = (m.PREFETCH_V_EARLY_MAX, k.shape[2], 0) if hasattr(m, "PREFETCH_V_EARLY_MAX") else ()
                m.attention_kernel(q, k, v, ix, cnt, mean, 0.088, table, correct, p, *extra, out, lse, bad)
                ts[mi].append((time.perf_counter() - t) * 1e3)
    return [(statistics.median(t[2:]), min(t[2:])) for t in ts]
cases = {"L2 N=256 S=256": (case(256, 256), False), "hot N=4096 S=1024": (case(4096, 1024), False), "cold N=98304 S=4915": (case(98304, 4915), True)}
for name, (c, fl) in cases.items():
    b = c[0].shape[0]; s = c[3][0].shape[2]
    nbytes = b * HQ * s * (2 * D * 2 + 4)
    for corr in (True, False):
        for i, (med, mn) in enumerate(timeit_all(c, fl, corr)):
            print(f"{name:20s} corr={int(corr)} mod{i}: median {med:7.3f} ms  min {mn:7.3f} ms  {nbytes/med/1e6:5.2f} GB/s (best {nbytes/mn/1e6:5.2f})  ({med*1e6/(b*HQ*s):.1f} ns/key)", flush=True)
