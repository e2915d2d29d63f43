"""Per-kernel GPU times of ``kernels.topk.select`` (torch.profiler / CUPTI), against ``torch.topk``.

    python benchmarks/profile_topk.py --out $OUT/topk_profile

Rows are label-score-like [B, 8, N] fp32 (randn), k = N/16.  For each shape and launch configuration it prints
the CUDA time per call of each kernel (histogram passes, count, write, the histogram memset) so the cost of a
select can be placed, and writes the table to ``profile_topk.txt`` under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparse_eval.kernels import topk  # noqa: E402


def kernel_times(fn, calls: int) -> list[tuple[str, float, int]]:
    """(kernel name, µs per call, launches per call) from CUPTI, sorted by time."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    out = []
    for ev in prof.key_averages():
        if ev.device_type == torch.autograd.DeviceType.CUDA and ev.count:
            t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0.0)
            out.append((ev.key[:60], t / calls, ev.count // calls))
    return sorted(out, key=lambda x: -x[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="32x16384,45x16384,22x32768,7x98304,4x131072", help="BxN, comma-separated")
    ap.add_argument("--calls", type=int, default=20)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    lines = [f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}"]
    for shape in a.shapes.split(","):
        b, n = (int(x) for x in shape.split("x"))
        s = torch.randn(b, 8, n, generator=gen, device=dev)
        k = max(1, n // 16)
        cfgs = [("torch.topk", lambda: torch.topk(s, k, dim=-1, sorted=False))]
        for rb, bn, nw, af in (
            (8, 2048, 4, 2),
            (8, 2048, 4, 9),
            (8, 4096, 4, 2),
            (8, 4096, 8, 2),
            (8, 8192, 8, 2),
            (4, 4096, 4, 4),
            (8, 2048, 4, 1),
        ):
            cfgs.append(
                (
                    f"radix bits={rb} block_n={bn} warps={nw} atomic_from={af}",
                    lambda rb=rb, bn=bn, nw=nw, af=af: topk.select(
                        s, k, radix_bits=rb, block_n=bn, num_warps=nw, atomic_from=af
                    ),
                )
            )
        for name, fn in cfgs:
            rows = kernel_times(fn, a.calls)
            total = sum(t for _, t, _ in rows)
            lines.append(f"\nB={b} N={n} k={k}  {name}: {total:.1f} us of kernels per call")
            lines += [f"   {t:8.1f} us  x{c}  {key}" for key, t, c in rows]
    text = "\n".join(lines)
    print(text)
    (a.out / "profile_topk.txt").write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
