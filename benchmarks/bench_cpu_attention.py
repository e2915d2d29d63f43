"""MagicPIG CPU part: achieved memory bandwidth of the sampled attention and of the hash-table look-up.

Measures, in one run on one machine:

1. the DRAM streaming-read bandwidth (a parallel float32 sum over a ``--stream-gb`` buffer, ≥ 1 GB, numba, the
   same threads as the kernels) -- the ceiling;
2. ``kernels.magicpig_cpu.attention`` (numba) over sampled index sets at MagicPIG densities, Llama-3.1-8B
   attention shape (32 query heads, 8 KV heads, d = 128, bf16 KV): bytes moved = the gathered K and V rows +
   the indices; achieved GB/s as a fraction of (1) (goal ≥ 70 %), and the speedup over plain torch gather +
   matmul on the same CPU (goal ≥ 5×), with and without the −log u correction;
3. ``kernels.magicpig_cpu.sample`` (table look-up, ≥ 2 collisions) for (K, L) configurations: bytes = the
   bucket entries and offsets read; and the table build time.

Each timed call is preceded (untimed) by a pass over the streaming buffer, so gathered rows come from DRAM and
not from the last-level cache; index sets rotate between repetitions.  Medians over ``--reps``.

    python benchmarks/bench_cpu_attention.py --quick --out /tmp/cpu_bench          # smoke check, any machine
    python benchmarks/bench_cpu_attention.py --out $OUT/cpu                          # GPU machine's CPU
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kernel_bench_util import hardware, print_table, time_cpu, write_json  # noqa: E402

from sparse_eval.kernels import magicpig_cpu, sparse_decode  # noqa: E402

HQ, HKV, D = 32, 8, 128


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="folder for results.json and plots")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke check of the script")
    ap.add_argument("--threads", type=int, default=None, help="numba and torch threads (default: all)")
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None, help="offloaded keys per sequence")
    ap.add_argument(
        "--densities",
        type=float,
        nargs="+",
        default=None,
        help="sampled fraction of the keys per query head (MagicPIG Table 9: 0.5–5 %%)",
    )
    ap.add_argument("--kl", type=str, nargs="+", default=None, help="(K,L) pairs for the look-up, e.g. 10,150")
    ap.add_argument("--stream-gb", type=float, default=None, help="streaming-read buffer (GB, >= 1)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--no-sweeps", action="store_true", help="skip the thread and prefetch sweeps")
    ap.add_argument(
        "--prefetch-ab",
        action="store_true",
        help="also time, for every (B, N, density), the attention "
        "with the V rows prefetched in its last pass and together with the K rows in its first "
        "(prefetch_v_early), and the gather of the same rows without arithmetic (the access pattern's "
        "ceiling), also with K and V side by side per token, alternating, in this "
        "run, on caches on transparent huge pages as the system path allocates them",
    )
    ap.add_argument(
        "--huge-pages-ab",
        action="store_true",
        help="also time the attention of the last (B, N, density) "
        "with the K/V cache on default pages and on transparent huge pages, alternating, in this run",
    )
    a = ap.parse_args(argv)
    q = a.quick
    a.batches = a.batches or ([1] if q else [1, 4])
    a.contexts = a.contexts or ([8192] if q else [32768, 98304])
    a.densities = a.densities or ([0.05] if q else [0.02, 0.05])
    a.kl = [tuple(int(x) for x in s.split(",")) for s in (a.kl or (["8,75"] if q else ["10,150", "8,75"]))]
    a.stream_gb = a.stream_gb or (1.0 if q else 4.0)
    a.reps = a.reps or (3 if q else 10)
    if a.stream_gb < 1.0:
        ap.error("--stream-gb must be >= 1 (the ceiling needs a working set far beyond the caches)")
    return a


def stream_bandwidth(buf: np.ndarray, nb, warmup: int, reps: int) -> dict:
    t = time_cpu(lambda: nb.stream_read_kernel(buf), warmup, reps)
    gbs = buf.nbytes / (t["median_ms"] * 1e-3) / 1e9
    tt = torch.from_numpy(buf)
    t2 = time_cpu(lambda: tt.sum(), 1, max(3, reps // 2))
    return {
        "bytes": buf.nbytes,
        "numba_sum": t,
        "gbps": gbs,
        "torch_sum_gbps": buf.nbytes / (t2["median_ms"] * 1e-3) / 1e9,
    }


def random_index_sets(b: int, n: int, s: int, sets: int, gen: torch.Generator) -> list[torch.Tensor]:
    out = []
    for _ in range(sets):
        r = torch.rand(b * HQ, n, generator=gen)
        idx = torch.topk(r, s, dim=-1).indices.sort(-1).values.to(torch.int32)
        out.append(idx.view(b, HQ, s).contiguous())
    return out


def bench_attention(args, b, n, dens, flush, stream_gbps, gen, rows, sweep=False):
    s = max(1, int(round(dens * n)))
    k = torch.randn(b, HKV, n, D, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, HKV, n, D, generator=gen).to(torch.bfloat16)
    q = torch.randn(b, HQ, D, generator=gen)
    mean = k.float().mean(2)
    sets = random_index_sets(b, n, s, 4, gen)
    cnt = torch.full((b, HQ), s, dtype=torch.int32)
    nbytes = b * HQ * s * (2 * D * 2 + 4)
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]

    def run_numba(correct=True, prefetch=None):
        return lambda: magicpig_cpu.attention(
            q, k, v, nxt(), cnt, k_bits=10, n_tables=150, k_mean=mean, correct=correct, prefetch=prefetch
        )

    res = {}
    res["numba"] = time_cpu(run_numba(True), args.warmup, args.reps, flush)
    res["numba_nocorr"] = time_cpu(run_numba(False), args.warmup, args.reps, flush)
    treps = max(2, args.reps // 3)
    res["torch_gather_matmul"] = time_cpu(
        lambda: sparse_decode.attention_reference(q, k, v, nxt(), out_dtype=torch.float32), 1, treps, flush
    )
    res["torch_with_correction"] = time_cpu(
        lambda: magicpig_cpu.attention_reference(q, k, v, nxt(), cnt, k_bits=10, n_tables=150, k_mean=mean),
        1,
        treps,
        flush,
    )
    base = {
        "kind": "attention",
        "batch": b,
        "context": n,
        "density": dens,
        "selected_per_head": s,
        "bytes": nbytes,
        "stream_gbps": stream_gbps,
        "threads": magicpig_cpu.get_num_threads(),
    }
    for name, t in res.items():
        gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
        rows.append({**base, "impl": name, **t, "gbps": gbps, "frac_of_stream": gbps / stream_gbps})
    num = res["numba"]["median_ms"]
    summary = {
        **base,
        "impl": "summary",
        "numba_ms": num,
        "gbps": nbytes / (num * 1e-3) / 1e9,
        "frac_of_stream": nbytes / (num * 1e-3) / 1e9 / stream_gbps,
        "speedup_vs_torch_gather_matmul": res["torch_gather_matmul"]["median_ms"] / num,
        "speedup_vs_torch_with_correction": res["torch_with_correction"]["median_ms"] / num,
        "correction_cost_ms": num - res["numba_nocorr"]["median_ms"],
    }
    summary["goal_bandwidth_70pct"] = summary["frac_of_stream"] >= 0.70
    summary["goal_speedup_5x"] = summary["speedup_vs_torch_gather_matmul"] >= 5.0
    rows.append(summary)
    if sweep:
        for pf in (0, 4, 8, 16, 32):
            t = time_cpu(run_numba(True, pf), 1, args.reps, flush)
            gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
            rows.append(
                {
                    **base,
                    "kind": "prefetch_sweep",
                    "impl": "numba",
                    "prefetch": pf,
                    **t,
                    "gbps": gbps,
                    "frac_of_stream": gbps / stream_gbps,
                }
            )
        top = magicpig_cpu.get_num_threads()
        th = sorted({1, 2, 4, 8, 16, 32, 64, top} & set(range(1, top + 1)))
        for n_th in th:
            magicpig_cpu.set_num_threads(n_th)
            t = time_cpu(run_numba(True), 1, args.reps, flush)
            gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
            rows.append(
                {
                    **base,
                    "kind": "thread_sweep",
                    "impl": "numba",
                    "threads": n_th,
                    **t,
                    "gbps": gbps,
                    "frac_of_stream": gbps / stream_gbps,
                }
            )
        magicpig_cpu.set_num_threads(top)
    return summary


def _queries(b: int, n: int, dens: float, gen: torch.Generator):
    """(S, q [B, Hq, D], four index sets [B, Hq, S], count [B, Hq], bytes a call gathers) of an A/B config."""
    s = max(1, int(round(dens * n)))
    q = torch.randn(b, HQ, D, generator=gen)
    sets = random_index_sets(b, n, s, 4, gen)
    cnt = torch.full((b, HQ), s, dtype=torch.int32)
    return s, q, sets, cnt, b * HQ * s * (2 * D * 2 + 4)


def huge_pages_ab(args, b, n, dens, flush, stream_gbps, gen, rows, rounds: int = 3) -> None:
    """Attention over a K/V cache allocated plainly (torch.empty) and over one advised onto transparent huge pages
    before its first touch (``kernels._common.advise_huge_pages``), alternating, ``rounds`` times each."""
    from sparse_eval.kernels._common import advise_huge_pages

    s, q, sets, cnt, nbytes = _queries(b, n, dens, gen)
    src = torch.randn(b, HKV, n, D, generator=gen).to(torch.bfloat16)
    for r in range(rounds):
        for huge in (False, True):
            k = torch.empty(b, HKV, n, D, dtype=torch.bfloat16)
            v = torch.empty_like(k)
            advised = huge and advise_huge_pages(k) and advise_huge_pages(v)
            k.copy_(src)
            v.copy_(src)
            mean = k.float().mean(2)
            state = {"i": r}

            def run():
                state["i"] = (state["i"] + 1) % len(sets)
                return magicpig_cpu.attention(
                    q,
                    k,  # noqa: F821 (deleted after use)
                    v,  # noqa: F821
                    sets[state["i"]],
                    cnt,
                    k_bits=10,
                    n_tables=150,  # noqa: F821
                    k_mean=mean,
                )  # (k, v: deleted after the timing below, not before)

            t = time_cpu(run, 1, args.reps, flush)
            gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
            rows.append(
                {
                    "kind": "huge_pages_ab",
                    "impl": "numba",
                    "batch": b,
                    "context": n,
                    "density": dens,
                    "huge_pages": huge,
                    "advised": bool(advised),
                    "round": r,
                    **t,
                    "gbps": gbps,
                    "frac_of_stream": gbps / stream_gbps,
                    "anon_huge_kb": _anon_huge_kb(),
                }
            )
            del k, v


def prefetch_ab(args, b, n, dens, flush, stream_gbps, gen, rows, rounds: int = 3) -> None:
    """Same process, alternating ``rounds`` times:

    * the attention with its V rows prefetched in pass (4) only, in pass (1) with the K rows (``prefetch_v_early``),
      by the default rule, and by the default rule over K and V side by side in one buffer [B, Hkv, N, 2, D] (the
      system path's MagicPIG cache);
    * ``gather_read_kernel``: the same K and V rows read and summed, nothing else (what this access pattern allows
      on this machine), from separate buffers and side by side (one 512-byte read per sampled key instead of two of
      256 at unrelated places).

    Bytes as in ``bench_attention``; the caches on transparent huge pages."""
    import numba

    from sparse_eval.kernels import _nb_magicpig as nbm
    from sparse_eval.kernels._common import advise_huge_pages

    s, q, sets, cnt, nbytes = _queries(b, n, dens, gen)
    k = torch.empty(b, HKV, n, D, dtype=torch.bfloat16)
    v = torch.empty_like(k)
    kv = torch.empty(b, HKV, n, 2, D, dtype=torch.bfloat16)
    advised = advise_huge_pages(k) and advise_huge_pages(v) and advise_huge_pages(kv)
    k.copy_(torch.randn(b, HKV, n, D, generator=gen))
    v.copy_(torch.randn(b, HKV, n, D, generator=gen))
    kv[..., 0, :], kv[..., 1, :] = k, v
    kv2 = kv.view(b, HKV, n, 2 * D)  # a token's K and V: one 512-byte row
    mean = k.float().mean(2)
    state = {"i": 0}

    def nxt():
        state["i"] = (state["i"] + 1) % len(sets)
        return sets[state["i"]]

    def attend(kk, vv, early):
        return lambda: magicpig_cpu.attention(
            q, kk, vv, nxt(), cnt, k_bits=10, n_tables=150, k_mean=mean, prefetch_v_early=early
        )

    def gather(kk, vv):
        kn, vn = kk.view(torch.uint16).numpy(), vv.view(torch.uint16).numpy()

        def run():
            with numba.parallel_chunksize(1):
                nbm.gather_read_kernel(kn, vn, nxt().numpy(), cnt.numpy(), nbm.PREFETCH_ROWS)

        return run

    variants = {
        "attention_v_in_pass4": attend(k, v, 0),
        "attention_v_early": attend(k, v, 1 << 30),
        "attention": attend(k, v, None),
        "attention_kv_side_by_side": attend(kv[..., 0, :], kv[..., 1, :], None),
        "gather_read": gather(k, v),
        "gather_read_kv_side_by_side": gather(kv2, kv2.new_empty(b, HKV, n, 0)),
    }
    for r in range(rounds):
        for name, fn in variants.items():
            t = time_cpu(fn, 1, args.reps, flush)
            gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
            rows.append(
                {
                    "kind": "prefetch_ab",
                    "impl": name,
                    "batch": b,
                    "context": n,
                    "density": dens,
                    "selected_per_head": s,
                    "huge_pages": bool(advised),
                    "round": r,
                    **t,
                    "gbps": gbps,
                    "frac_of_stream": gbps / stream_gbps,
                }
            )


def _anon_huge_kb() -> int | None:
    try:
        return int(next(x for x in open("/proc/meminfo") if x.startswith("AnonHugePages")).split()[1])
    except (OSError, StopIteration):
        return None


def bench_lookup(args, b, n, k_bits, n_tables, flush, stream_gbps, gen, rows):
    codes = torch.randint(0, 1 << k_bits, (b, HKV, n, n_tables), generator=gen, dtype=torch.int32)
    t_build = time_cpu(lambda: magicpig_cpu.build_tables(codes, k_bits), 1, max(2, args.reps // 3))
    tables = magicpig_cpu.build_tables(codes, k_bits)
    qsets = [torch.randint(0, 1 << k_bits, (b, HQ, n_tables), generator=gen, dtype=torch.int32) for _ in range(4)]
    # bytes the look-up reads: the query's bucket of every table (int32 entries) and two offsets per bucket
    entries = []
    for qc in qsets:
        off = tables.offsets.long()  # [B, Hkv, L, 2^K + 1]
        kvh = (torch.arange(HQ) // (HQ // HKV)).view(1, HQ, 1).expand(b, HQ, n_tables)
        bi = torch.arange(b).view(b, 1, 1).expand(b, HQ, n_tables)
        li = torch.arange(n_tables).view(1, 1, n_tables).expand(b, HQ, n_tables)
        size = off[bi, kvh, li, qc.long() + 1] - off[bi, kvh, li, qc.long()]
        entries.append(int(size.sum()))
    nbytes = int(np.mean(entries)) * 4 + b * HQ * n_tables * 8
    state = {"i": 0}

    def run():
        state["i"] = (state["i"] + 1) % len(qsets)
        return magicpig_cpu.sample(tables, qsets[state["i"]], 2)

    t = time_cpu(run, args.warmup, args.reps, flush)
    _, cnt = magicpig_cpu.sample(tables, qsets[0], 2)
    gbps = nbytes / (t["median_ms"] * 1e-3) / 1e9
    row = {
        "kind": "lookup",
        "impl": "numba",
        "batch": b,
        "context": n,
        "K": k_bits,
        "L": n_tables,
        "bytes": nbytes,
        **t,
        "gbps": gbps,
        "frac_of_stream": gbps / stream_gbps,
        "density": float(cnt.float().mean()) / n,
        "build_ms": t_build["median_ms"],
        "table_bytes": tables.nbytes(),
        "threads": magicpig_cpu.get_num_threads(),
        "stream_gbps": stream_gbps,
    }
    rows.append(row)
    return row


def plot(rows, stream_gbps, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    ax = axes[0]
    att = [r for r in rows if r["kind"] == "attention" and r["impl"] in ("numba", "torch_gather_matmul")]
    labels = sorted({(r["batch"], r["context"], r["density"]) for r in att})
    x = np.arange(len(labels))
    for j, impl in enumerate(("numba", "torch_gather_matmul")):
        vals = [
            next((r["gbps"] for r in att if r["impl"] == impl and (r["batch"], r["context"], r["density"]) == lab), 0.0)
            for lab in labels
        ]
        ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=impl)
    ax.axhline(stream_gbps, color="k", ls="--", label=f"stream read {stream_gbps:.0f} GB/s")
    ax.axhline(0.7 * stream_gbps, color="gray", ls=":", label="70 % goal")
    ax.set_xticks(x, [f"B{b} N{n // 1024}K {d:.0%}" for b, n, d in labels], rotation=30, fontsize=8)
    ax.set_ylabel("GB/s (gathered K+V rows + indices)")
    ax.set_title("sampled attention")
    ax.legend(fontsize=7)
    ax = axes[1]
    lk = [r for r in rows if r["kind"] == "lookup"]
    ax.bar(np.arange(len(lk)), [r["gbps"] for r in lk])
    ax.axhline(stream_gbps, color="k", ls="--")
    ax.set_xticks(
        np.arange(len(lk)),
        [f"B{r['batch']} N{r['context'] // 1024}K K{r['K']} L{r['L']}" for r in lk],
        rotation=30,
        fontsize=8,
    )
    ax.set_ylabel("GB/s (bucket entries + offsets)")
    ax.set_title("table look-up (>= 2 collisions)")
    ax = axes[2]
    th = [r for r in rows if r["kind"] == "thread_sweep"]
    if th:
        ax.plot([r["threads"] for r in th], [r["gbps"] for r in th], "o-", label="attention")
        ax.axhline(stream_gbps, color="k", ls="--")
        ax.set_xlabel("threads")
        ax.set_ylabel("GB/s")
    ax.set_title("thread sweep")
    fig.tight_layout()
    path = out / "cpu_attention.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    from sparse_eval.kernels import _nb_magicpig as nb  # numba is required for this benchmark

    threads = args.threads or magicpig_cpu.get_num_threads()
    magicpig_cpu.set_num_threads(threads)
    torch.set_num_threads(threads)
    hw = hardware()
    hw["magicpig_cpu_features"] = magicpig_cpu.cpu_features()
    gen = torch.Generator().manual_seed(0)

    buf = np.ones(int(args.stream_gb * 1e9) // 4, np.float32)
    stream = stream_bandwidth(buf, nb, args.warmup, args.reps)
    sg = stream["gbps"]
    print(
        f"stream read: {sg:.1f} GB/s over {buf.nbytes / 1e9:.1f} GB ({threads} threads; torch sum "
        f"{stream['torch_sum_gbps']:.1f} GB/s)"
    )

    def flush():
        nb.stream_read_kernel(buf)

    rows: list[dict] = []
    summaries = []
    for b in args.batches:
        for n in args.contexts:
            for i, dens in enumerate(args.densities):
                sweep = (
                    not args.no_sweeps
                    and b == args.batches[-1]
                    and n == args.contexts[-1]
                    and i == len(args.densities) - 1
                )
                summaries.append(bench_attention(args, b, n, dens, flush, sg, gen, rows, sweep=sweep))
                if args.prefetch_ab:
                    prefetch_ab(args, b, n, dens, flush, sg, gen, rows)
            for k_bits, n_tables in args.kl:
                bench_lookup(args, b, n, k_bits, n_tables, flush, sg, gen, rows)

    if args.huge_pages_ab:
        huge_pages_ab(args, args.batches[-1], args.contexts[-1], args.densities[-1], flush, sg, gen, rows)
    payload = {"hardware": hw, "stream": stream, "args": {k: str(v) for k, v in vars(args).items()}, "records": rows}
    for r in rows:
        r["hardware"] = {
            "cpu_model": hw.get("cpu_model"),
            "logical_cpus": hw.get("logical_cpus"),
            "gpu_name": hw.get("gpu_name"),
        }
    path = write_json(args.out, "cpu_attention.json", payload)
    png = plot(rows, sg, args.out)
    print("\nsampled attention (numba, bf16 KV, K=10 L=150 correction):")
    table = print_table(
        summaries,
        [
            ("batch", "B", ""),
            ("context", "N", ""),
            ("density", "dens", ".3f"),
            ("selected_per_head", "S", ""),
            ("numba_ms", "ms", ".3f"),
            ("gbps", "GB/s", ".1f"),
            ("frac_of_stream", "of stream", ".2f"),
            ("speedup_vs_torch_gather_matmul", "x torch", ".1f"),
            ("speedup_vs_torch_with_correction", "x torch+u", ".1f"),
            ("correction_cost_ms", "u cost ms", ".3f"),
        ],
    )
    print("\ntable look-up (numba, random codes, >= 2 collisions):")
    table += "\n" + print_table(
        [r for r in rows if r["kind"] == "lookup"],
        [
            ("batch", "B", ""),
            ("context", "N", ""),
            ("K", "K", ""),
            ("L", "L", ""),
            ("density", "dens", ".4f"),
            ("median_ms", "ms", ".3f"),
            ("gbps", "GB/s", ".1f"),
            ("frac_of_stream", "of stream", ".2f"),
            ("build_ms", "build ms", ".1f"),
        ],
    )
    ab = [r for r in rows if r["kind"] == "huge_pages_ab"]
    if ab:
        print("\nK/V cache on default pages vs transparent huge pages (last attention config, alternating):")
        table += "\n" + print_table(
            ab,
            [
                ("round", "round", ""),
                ("huge_pages", "huge pages", ""),
                ("advised", "madvise ok", ""),
                ("median_ms", "ms", ".3f"),
                ("gbps", "GB/s", ".1f"),
                ("frac_of_stream", "of stream", ".2f"),
                ("anon_huge_kb", "AnonHugePages kB", ""),
            ],
        )
    pab = [r for r in rows if r["kind"] == "prefetch_ab"]
    if pab:
        print(
            "\nV rows prefetched in pass 4 vs with the K rows, and the bare gather; K, V apart or side by side "
            "(alternating):"
        )
        table += "\n" + print_table(
            pab,
            [
                ("batch", "B", ""),
                ("context", "N", ""),
                ("density", "dens", ".3f"),
                ("round", "round", ""),
                ("impl", "variant", ""),
                ("median_ms", "ms", ".3f"),
                ("gbps", "GB/s", ".1f"),
                ("frac_of_stream", "of stream", ".2f"),
            ],
        )
    sweeps = [r for r in rows if r["kind"] in ("thread_sweep", "prefetch_sweep")]
    if sweeps:
        print("\nsweeps (last attention config):")
        table += "\n" + print_table(
            sweeps,
            [
                ("kind", "sweep", ""),
                ("threads", "threads", ""),
                ("prefetch", "prefetch", ""),
                ("median_ms", "ms", ".3f"),
                ("gbps", "GB/s", ".1f"),
                ("frac_of_stream", "of stream", ".2f"),
            ],
        )
    (args.out / "cpu_attention.txt").write_text(f"stream read {sg:.1f} GB/s\n" + table + "\n")
    print(f"\nwrote {path}" + (f" and {png}" if png else ""))
    return payload


if __name__ == "__main__":
    main()
