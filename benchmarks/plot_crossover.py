"""The capacity crossover of benchmark 3 (issue: kernels and the system path) as one figure: at one context, the
batches that full attention on the GPU fits or fails (OOM) next to the batches the offloaded methods serve from
host memory, with their throughput and where their caches live.  Reads records written by
``bench_system_decode.py`` (e.g. runs with ``name@B`` batches past the GPU's capacity).

    python benchmarks/plot_crossover.py --context 98304 --out experiments/offload_capacity_96k/crossover_96k.png \
        experiments/system_decode_throughput/system_decode.json experiments/offload_capacity_96k/crossover_96k*.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

GiB = 1 << 30


def load(paths: list[Path], context: int) -> list[dict]:
    """Records at ``context`` of full attention (eager and captured) and the offloaded methods, by method then
    batch, each with the file's host description."""
    out = []
    for p in paths:
        data = json.loads(p.read_text())
        hw = data["meta"]["hardware"]
        host = f"{hw.get('logical_cpus')} CPUs, {hw.get('gpu_count', 1)} GPU(s)"
        for r in data["records"]:
            if r.get("context") != context or "skipped" in r:
                continue
            if r["method"].startswith(("full", "ds_offload", "magicpig")) and ("tokens_per_s" in r or "error" in r):
                out.append(dict(r, host=host, file=p.name))
    return sorted(out, key=lambda r: (not r["method"].startswith("full"), r["method"], r["batch"]))


def plot(records: list[dict], context: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.8))
    floor = 1.0
    for i, r in enumerate(records):
        ok = "tokens_per_s" in r
        colour = "tab:blue" if r["method"].startswith("full") else "tab:orange"
        ax.bar(
            i,
            r["tokens_per_s"] if ok else floor * 2,
            color=colour if ok else "white",
            edgecolor=colour,
            hatch=None if ok else "//",
        )
        if ok:
            mem = r.get("memory", {})
            text = (
                f"{r['tokens_per_s']:.0f} tok/s\nGPU cache {mem.get('cache_gpu', 0) / GiB:.0f} GiB\n"
                f"host cache {mem.get('cache_cpu', 0) / GiB:.0f} GiB"
            )
            ax.annotate(text, (i, r["tokens_per_s"]), ha="center", va="bottom", fontsize=6)
        else:
            ax.annotate("OOM" if "OOM" in r["error"] else "error", (i, floor * 2), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(records)))
    ax.set_xticklabels([f"{r['method']}\nB={r['batch']}" for r in records], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylim(floor, max(r.get("tokens_per_s", floor) for r in records) * 8)
    ax.set_ylabel("throughput (generated tokens/s, whole batch)")
    ax.grid(axis="y", alpha=0.3)
    ax.set_title(
        f"capacity at {context // 1024}K context: full attention on the GPU (blue; hatched = out of GPU "
        f"memory) vs KV cache in host memory (orange)",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--context", type=int, default=98304)
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    records = load(a.files, a.context)
    if not records:
        print(f"no records at context {a.context} in {[str(f) for f in a.files]}")
        return 1
    for r in records:
        print(
            f"{r['method']:>16s} B={r['batch']:>2d}  "
            + (f"{r['tokens_per_s']:8.1f} tok/s" if "tokens_per_s" in r else r["error"][:60])
            + f"  ({r['host']}, {r['file']})"
        )
    plot(records, a.context, a.out)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
