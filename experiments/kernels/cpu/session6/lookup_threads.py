"""Where the MagicPIG table look-up's time goes as threads are added (issue 5): ``sample_kernel`` at 1, 2, 4, 8 and
16 threads, with the output slots reused between calls (as ``magicpig_cpu.sample`` does) and fresh each call, and
``magicpig_cpu.sample`` itself (the wrapper the system path calls); median of 7 after one warm-up, µs per row and
per thread = ms · threads / rows.

    PYTHONPATH=. python experiments/kernels/cpu/session6/lookup_threads.py [max_threads]
"""
import sys
import time

import numba
import numpy as np
import torch

import kernels.magicpig_cpu as kmc
from kernels import _nb_magicpig as nbm

top = int(sys.argv[1]) if len(sys.argv) > 1 else numba.config.NUMBA_NUM_THREADS
HQ, HKV = 32, 8


def med(f, reps=7):
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return sorted(ts)[reps // 2] * 1e3


for b, n, k, l_ in ((14, 16384, 10, 150), (14, 16384, 8, 75), (4, 32768, 10, 150), (4, 98304, 10, 150)):
    g = torch.Generator().manual_seed(0)
    tables = kmc.build_tables(torch.randint(0, 1 << k, (b, HKV, n, l_), generator=g, dtype=torch.int32), k)
    p, o = tables.perm.numpy(), tables.offsets.numpy()
    qc = torch.randint(0, 1 << k, (b, HQ, l_), generator=g, dtype=torch.int32)
    qn = qc.numpy()
    rows = b * HQ
    out, c = np.empty((b, HQ, n), np.int32), np.empty((b, HQ), np.int32)
    for th in [t for t in (1, 2, 4, 8, 16, 32) if t <= top]:
        numba.set_num_threads(th)
        reused = med(lambda: nbm.sample_kernel(p, o, qn, 2, th, True, out, c))

        def fresh():
            nbm.sample_kernel(p, o, qn, 2, th, True, np.empty((b, HQ, n), np.int32), np.empty((b, HQ), np.int32))

        fr = med(fresh)
        wrapped = med(lambda: kmc.sample(tables, qc, 2))
        print(f"B={b} N={n} (K,L)=({k},{l_}) threads {th:2d}: kernel {reused:.3f} ms "
              f"({reused * 1e3 * th / rows:.1f} us/row/thread), fresh output {fr:.3f} ms, sample() {wrapped:.3f} ms; "
              f"mean sampled {c.mean():.0f} of {n}", flush=True)
print(f"numba threading layer: {numba.threading_layer()}; cpu_features: {kmc.cpu_features()}")
