"""The batch-invariant mode's products at decode shapes: the fixed-order Triton GEMM (``kernels.invariant.bmm``)
against cuBLAS (``torch.matmul``), and the same kernel under other tile shapes.

    python benchmarks/bench_invariant_gemm.py --out DIR            # GPU: Llama-3.1-8B layer products at 8 rows
    python benchmarks/bench_invariant_gemm.py --rows 8 --context 16384 --reps 20 --out DIR

In the batch-invariant mode (``eval.batch_invariant``, a run's default) every product of the model runs in
``_tl_invariant._bmm_kernel`` with one tile shape per dtype (``_MM_CONFIG``), whatever the shape.  A decode step's
products have few rows (the batch): per shape this times cuBLAS, the shipped tile shape and a few others, says
whether each candidate's output is bit for bit the shipped one's, and whether a row computed alone equals that row
in the batch.  A candidate with the shipped bits may be chosen by the row count M (small tiles for decode) without a
row's result depending on its batch; one with other bits (another BLOCK_K, a split of K) only by (N, K).
Shapes: the 8B layer's q/o (K 4096, N 4096), k/v (4096, 1024), gate/up (4096, 14336) and down (14336, 4096)
projections at ``--rows`` rows, Double Sparsity's label scores (256 query rows of 16 channels against ``--context``
keys, float32), and the q/o projection in float32.  Medians of ``--reps`` CUDA-event timings after ``--warmup`` calls.
Without CUDA it runs small shapes in Triton's interpreter (a check of the script, no timing worth reading).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from _kernel_bench_util import hardware, print_table, time_cpu, time_cuda, write_json  # noqa: E402

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages[, split of K]): the shipped one first
CANDIDATES = {
    torch.bfloat16: [
        (128, 128, 64, 8, 3),
        (16, 64, 64, 4, 4),
        (16, 128, 64, 4, 4),
        (32, 64, 64, 4, 4),
        (64, 64, 64, 4, 3),
        # narrower column tiles: more programs than the 132 SMs at N = 4096 (64 at BLOCK_N 64), the same BLOCK_K
        (16, 32, 64, 4, 4),
        (16, 32, 64, 2, 6),
        (16, 16, 64, 2, 6),
        (16, 64, 64, 4, 4, 4),
        (16, 64, 64, 4, 4, 8),
        (16, 128, 64, 4, 4, 4),
    ],
    torch.float32: [
        (64, 64, 32, 4, 3),
        (16, 64, 16, 4, 3),
        (16, 128, 16, 4, 3),
        (32, 64, 32, 4, 3),
        (16, 256, 16, 4, 3),
        (16, 128, 32, 4, 3),
        (16, 256, 32, 4, 3),
    ],
}


def split_bmm(tli, a: torch.Tensor, b: torch.Tensor, split: int, out_dtype: torch.dtype) -> torch.Tensor:
    """a [1, M, K] @ b [1, K, N] with K cut into ``split`` equal pieces: the pieces' float32 products in one launch
    of the fixed-order kernel (the pieces as its batch entries), then added in piece order (a fixed split and a
    fixed order: a row's sums never depend on M)."""
    _, m, k = a.shape
    piece = k // split
    av = a.as_strided((split, m, piece), (piece, a.stride(1), a.stride(2)))
    bv = b.as_strided((split, piece, b.shape[2]), (piece * b.stride(1), b.stride(1), b.stride(2)))
    parts = tli.bmm(av, bv, torch.float32)  # [split, M, N]
    acc = parts[0]
    for s in range(1, split):
        acc = acc + parts[s]
    return acc.to(out_dtype)[None]


def product(tli, a: torch.Tensor, b: torch.Tensor, cfg: tuple, dtype: torch.dtype) -> torch.Tensor:
    """The fixed-order product under tile shape ``cfg`` (set as the dtype's configuration by the caller)."""
    split = cfg[5] if len(cfg) > 5 else 1
    return tli.bmm(a, b, dtype) if split == 1 else split_bmm(tli, a, b, split, dtype)


def shapes(rows: int, context: int, small: bool) -> list[dict]:
    """(name, batch entries, M, K, N, dtype) of a decode step's products."""
    if small:
        return [
            dict(name="proj", bt=1, m=rows, k=256, n=96, dtype=torch.bfloat16),
            dict(name="ds_labels", bt=4, m=1, k=16, n=80, dtype=torch.float32),
        ]
    return [
        dict(name="q/o proj", bt=1, m=rows, k=4096, n=4096, dtype=torch.bfloat16),
        dict(name="k/v proj", bt=1, m=rows, k=4096, n=1024, dtype=torch.bfloat16),
        dict(name="gate/up proj", bt=1, m=rows, k=4096, n=14336, dtype=torch.bfloat16),
        dict(name="down proj", bt=1, m=rows, k=14336, n=4096, dtype=torch.bfloat16),
        dict(name="DS label scores", bt=rows * 32, m=1, k=16, n=context, dtype=torch.float32),
        # a float32 product of many K tiles: whether BLOCK_K (16 against 32) changes the bits where K spans tiles
        dict(name="fp32 q/o proj", bt=1, m=rows, k=4096, n=4096, dtype=torch.float32),
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8, help="rows of a decode product (the batch)")
    ap.add_argument("--context", type=int, default=16384, help="keys of DS's label-score product")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    from sparse_eval.kernels import _tl_invariant as tli

    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    timer = time_cuda if cuda else time_cpu
    reps, warmup = (args.reps, args.warmup) if cuda else (1, 0)
    gen = torch.Generator(device="cpu").manual_seed(0)
    rows = []
    shipped = dict(tli._MM_CONFIG)
    try:
        for s in shapes(args.rows, args.context, small=not cuda):
            a = torch.randn(s["bt"], s["m"], s["k"], generator=gen).to(dev, s["dtype"])
            b = torch.randn(s["bt"], s["k"], s["n"], generator=gen).to(dev, s["dtype"])
            base = {"shape": s["name"], "bt": s["bt"], "m": s["m"], "k": s["k"], "n": s["n"], "dtype": str(s["dtype"])}
            t = timer(lambda: torch.matmul(a, b), warmup, reps)["median_ms"]
            rows.append({**base, "kernel": "torch.matmul (cuBLAS)" if cuda else "torch.matmul", "ms": t})
            ref = None
            for cfg in CANDIDATES[s["dtype"]]:
                if len(cfg) > 5 and (s["bt"] != 1 or s["k"] % cfg[5]):
                    continue
                tli._MM_CONFIG[s["dtype"]] = cfg[:5]
                out = product(tli, a, b, cfg, s["dtype"])
                one = product(tli, a[:, :1].contiguous(), b, cfg, s["dtype"])  # the first row alone
                ref = out if ref is None else ref
                t = timer(lambda cfg=cfg: product(tli, a, b, cfg, s["dtype"]), warmup, reps)["median_ms"]
                label = f"invariant {cfg}" + (" shipped" if cfg == shipped[s["dtype"]] else "")
                rows.append(
                    {
                        **base,
                        "kernel": label,
                        "ms": t,
                        "same_as_shipped": bool(torch.equal(out, ref)),
                        "row_alone_same": bool(torch.equal(out[:, :1], one)),
                    }
                )
    finally:
        tli._MM_CONFIG.clear()
        tli._MM_CONFIG.update(shipped)
    for r in rows:
        first = next(x for x in rows if x["shape"] == r["shape"])
        r["x_cublas"] = r["ms"] / first["ms"]
    print_table(
        rows,
        [
            ("shape", "shape", ""),
            ("kernel", "kernel (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)", ""),
            ("ms", "ms", ".4f"),
            ("x_cublas", "x cuBLAS", ".2f"),
            ("same_as_shipped", "bitwise = shipped", ""),
            ("row_alone_same", "row 0 alone = in batch", ""),
        ],
    )
    if args.out:
        cmd = "bench_invariant_gemm.py " + " ".join(sys.argv[1:] if argv is None else argv)
        payload = {"command": cmd, "hardware": hardware(), "args": {k: str(v) for k, v in vars(args).items()}}
        path = write_json(args.out, f"invariant_gemm_rows{args.rows}.json", {**payload, "rows": rows})
        print(f"-> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
