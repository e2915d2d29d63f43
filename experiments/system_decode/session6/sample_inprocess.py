"""Why MagicPIG's sampling phase of the end-to-end step (~2 ms per layer at 16K, batch 14, (10,150)) costs more
than the look-up kernel measured alone: the decode of ``profile_system_decode.py --phases`` with timers around
``magicpig_cpu.sample`` (the wrapper) and the numba kernel inside it, then the kernel on the last layer's tables and
codes in the same process, repeated (caches warm) and after a 4 GB streaming read (caches cold).

    python experiments/system_decode/session6/sample_inprocess.py [batch] [context]
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
import kernels.magicpig_cpu as kmc  # noqa: E402
from benchmarks.bench_system_decode import method_config  # noqa: E402
from kernels import _nb_magicpig as nbm  # noqa: E402
from sparse_eval.methods.registry import build_method  # noqa: E402
from sparse_eval.system import decode  # noqa: E402
from sparse_eval.system.models import random_model  # noqa: E402

batch = int(sys.argv[1]) if len(sys.argv) > 1 else 14
ctx = int(sys.argv[2]) if len(sys.argv) > 2 else 16384
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = random_model("llama3_1_8b", dev, torch.bfloat16)
n_layers = model.config.num_hidden_layers
cfg = method_config("magicpig_10_150", n_layers, 8, 128)
method = build_method(cfg)
ids = torch.randint(0, 32000, (1, ctx), generator=torch.Generator().manual_seed(0)).to(dev)

times = {"wrapper": [], "kernel": [], "kernel_threads": []}
last = {}
orig_sample, orig_kernel = kmc.sample, nbm.sample_kernel


def kernel(*a):
    t = time.perf_counter()
    r = orig_kernel(*a)
    times["kernel"].append(time.perf_counter() - t)
    times["kernel_threads"].append(a[4])
    return r


def sample(tables, q_codes, *a, **kw):
    last["tables"], last["q_codes"] = tables, q_codes.clone()
    t = time.perf_counter()
    r = orig_sample(tables, q_codes, *a, **kw)
    times["wrapper"].append(time.perf_counter() - t)
    return r


kmc.sample, nbm.sample_kernel = sample, kernel
res = decode(model, method, ids, 6, repeat_batch=batch, phase_times=True)
steps = res.stats["phase_steps"]
print(f"B={batch} N={ctx}: phase ms per step", {k: round(v / steps, 2) for k, v in res.stats["phase_ms"].items()})
per_step = n_layers - len(cfg["dense_layers"])  # sparse layers: one look-up each per step
for name in ("wrapper", "kernel"):
    xs = times[name][-steps * per_step:]
    print(f"  {name}: {1e3 * sum(xs) / steps:.2f} ms per step, median {1e3 * statistics.median(xs):.3f} ms per call "
          f"({len(xs)} calls)")
print(f"  threads passed to the kernel: {sorted(set(times['kernel_threads']))}")
kmc.sample, nbm.sample_kernel = orig_sample, orig_kernel
tb, qc = last["tables"], last["q_codes"]
p, o, q = tb.perm.numpy(), tb.offsets.numpy(), qc.numpy()
b, hq = q.shape[:2]
n = p.shape[-1]
out, c = np.empty((b, hq, n), np.int32), np.empty((b, hq), np.int32)
buf = np.ones(int(4e9) // 4, np.float32)
th = times["kernel_threads"][-1]
for mode in ("warm", "cold", "warm", "cold"):
    ts = []
    for _ in range(7):
        if mode == "cold":
            nbm.stream_read_kernel(buf)
        t = time.perf_counter()
        nbm.sample_kernel(p, o, q, 2, th, True, out, c)
        ts.append(time.perf_counter() - t)
    print(f"  kernel alone on the last layer's tables, {mode}: {1e3 * statistics.median(ts[1:]):.3f} ms "
          f"(mean sampled {c.mean():.0f} of {n})")
tiny = np.ones(4096, np.float32)
for gap in (0.0, 0.005):  # a parallel region's fixed cost with the threads spinning, and after a 5 ms pause
    ts = []
    for _ in range(21):
        time.sleep(gap)
        t = time.perf_counter()
        nbm.stream_read_kernel(tiny)
        ts.append(time.perf_counter() - t)
    print(f"  empty parallel region after a {gap * 1e3:.0f} ms pause: {1e6 * statistics.median(ts[1:]):.0f} us")
