"""Same-process comparison of the MagicPIG table look-up before session 5's changes (commit 72e1f54) and the
repository's kernel, alternating calls, median of 8 after one warm-up each.  `lookup_reset.txt` was taken at
b55a9e9 (the counters cleared sequentially instead of re-walking the row's buckets), `lookup_session5.txt` after
the branch-free count as well.

    PYTHONPATH=. python experiments/kernels/cpu/session5_local/lookup_reset.py 1 2

Session 6: the output arrays are allocated once per kernel; before, a fresh [B, 32, N] array per call put its page
faults inside the timed call (on the H200 machine's Xeon that took (10,150) at B = 14 from 0.40 to 0.84 ms,
``../session6/lookup_threads_xeon.txt``), which is in ``../session6/lookup_reset_xeon.txt``.

Where there is no git history (the GPU machine gets a copy of the working tree), point LOOKUP_BEFORE_SRC at a copy of
that commit's ``kernels/_nb_magicpig.py`` (``git show 72e1f54:kernels/_nb_magicpig.py > before.py``).
"""
import os
import sys
import time
from pathlib import Path

import numba
import numpy as np
import torch

import kernels.magicpig_cpu as kmc
from kernels import _nb_magicpig as nbm


def _kernel_before():
    """sample_kernel as of commit 72e1f54, taken from git (run inside the repository) and compiled beside the
    current one."""
    import subprocess
    import tempfile

    if os.environ.get("LOOKUP_BEFORE_SRC"):
        src = Path(os.environ["LOOKUP_BEFORE_SRC"]).read_text()
    else:
        src = subprocess.run(["git", "show", "72e1f54:kernels/_nb_magicpig.py"], capture_output=True, text=True,
                             check=True, cwd=Path(__file__).parent).stdout
    start = src.index("@njit(parallel=True, cache=True)\ndef sample_kernel(")
    body = src[start:src.index("@njit(fastmath=_FAST", start)]
    mod = Path(tempfile.mkdtemp()) / "_lookup_before.py"
    mod.write_text("import numpy as np\nfrom numba import njit, prange\n"
                   "from kernels._nb_magicpig import _cttz64, _prefetch\n\n" + body.replace("cache=True", "cache=False"))
    sys.path.insert(0, str(mod.parent))
    return __import__("_lookup_before").sample_kernel


sample_kernel_before = _kernel_before()

for th in (int(x) for x in sys.argv[1:] or ["1"]):
    numba.set_num_threads(th)
    for b, n, k, l_ in ((14, 16384, 10, 150), (14, 16384, 8, 75), (4, 32768, 10, 150), (4, 98304, 10, 150)):
        g = torch.Generator().manual_seed(0)
        tables = kmc.build_tables(torch.randint(0, 1 << k, (b, 8, n, l_), generator=g, dtype=torch.int32), k)
        p, o = tables.perm.numpy(), tables.offsets.numpy()
        qn = torch.randint(0, 1 << k, (b, 32, l_), generator=g, dtype=torch.int32).numpy()
        ts = {"before": [], "after": []}
        outs = {}
        bufs = {name: (np.empty((b, 32, n), np.int32), np.empty((b, 32), np.int32)) for name in ts}
        for r in range(9):
            for name, f in (("before", sample_kernel_before), ("after", nbm.sample_kernel)):
                out, c = bufs[name]  # kept between calls: a fresh array page-faults inside the timed call
                t = time.perf_counter()
                f(p, o, qn, 2, th, True, out, c)
                ts[name].append(time.perf_counter() - t)
                outs[name] = [out[i, h, :c[i, h]].tolist() for i in range(b) for h in range(32)]
        assert outs["before"] == outs["after"]
        med = {k2: sorted(v[1:])[4] * 1e3 for k2, v in ts.items()}
        print(f"threads {th}  B={b} N={n} (K,L)=({k},{l_}): before {med['before']:.2f} ms, after {med['after']:.2f} ms, "
              f"{med['before'] / med['after']:.2f}x; same output")
