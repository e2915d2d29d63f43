"""End-to-end decode benchmark of the system path (issue: kernels and the system path, benchmark 3).

A model of Llama-3.1-8B's shape with random weights (bf16, on the GPU) decodes greedily through
``sparse_eval.system.decode`` with: full attention on the GPU (sdpa), Double Sparsity (KV on the GPU),
DS-Offload (KV in pinned CPU memory, next layer's rows prefetched on a side stream) and MagicPIG with its KV
cache and hash tables in CPU memory, (K, L) = (10, 150) and (8, 75).  For each context length and method the
batch is the largest that fits the machine's memory by the plan below (GPU for full / DS, host RAM for the
offloaded caches); the prompt is prefilled once at batch 1 (random token ids) and the prefilled cache is tiled
over the batch (each row then does exactly the work a distinct row would).  Timing: CUDA events around each
decode step; the first ``--warmup`` steps (Triton/numba compilation, MagicPIG's table build) are dropped;
median over the rest.

    python benchmarks/bench_system_decode.py --out experiments/system_decode_throughput  # the GPU machine
    python benchmarks/bench_system_decode.py --smoke                                     # 2 layers, 2K, any machine

Writes ``system_decode.json`` (records + hardware + command) and ``system_decode.png`` under ``--out``;
``--replot FILE`` redraws the figure of a written json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# large caches next to the prefill's freed activations fragment the default allocator (the 96K graph runs
# failed with 22 GiB reserved but unallocated); must be set before torch initialises CUDA
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _kernel_bench_util import hardware  # noqa: E402
from sparse_eval.methods.registry import build_method  # noqa: E402
from sparse_eval.system import DecodeOptions, decode  # noqa: E402
from sparse_eval.system.models import SHAPES, random_model  # noqa: E402
from sparse_eval.system.plan import host_memory_available, host_threads, plan_batch, weight_bytes  # noqa: E402

GiB = 1 << 30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3_1_8b", choices=sorted(SHAPES))
    ap.add_argument("--contexts", default="16384,32768,98304")
    ap.add_argument(
        "--methods",
        default="full,full_graph,ds,ds_graph,ds_offload,magicpig_10_150,magicpig_8_75",
        help="a _graph suffix decodes with static shapes captured in one CUDA graph (magicpig_K_L_graph "
        "in pieces cut at its CPU parts); a "
        "_torchtopk suffix (ds, quest) takes torch.topk instead of kernels.topk; a _halves suffix "
        "(with _graph) decodes the batch as two halves whose captured steps run interleaved (MagicPIG: "
        "one half's GPU pieces during the other's CPU parts; prefill_ms_batch1 is then the two "
        "prefills'); name@B runs batch B "
        "instead of the planned one (e.g. full_graph@10 past the GPU's capacity: an OOM is recorded)",
    )
    ap.add_argument("--steps", type=int, default=12, help="decode steps per run (warm-up included)")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--gpu-reserve-gib", type=float, default=24.0, help="GPU memory kept free of caches")
    ap.add_argument(
        "--cpu-budget-gib",
        type=float,
        default=None,
        help="host memory for offloaded caches (default: 60%% of MemAvailable)",
    )
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--batch", type=int, default=None, help="use this batch for every run instead of the plan")
    ap.add_argument("--time-budget-s", type=float, default=480.0, help="skip remaining runs after this")
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="numba threads of MagicPIG's CPU part (default: the cores this process may use)",
    )
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--smoke", action="store_true", help="2 layers, contexts 2K, batch 2 (checks the plumbing)")
    ap.add_argument("--replot", default=None, help="redraw the figure of this system_decode.json and exit")
    ap.add_argument(
        "--plan-only",
        action="store_true",
        help="print each run's planned batch (GPU and host bytes per row) for this machine and exit; "
        "needs no GPU (--gpu-gib gives the GPU's memory then)",
    )
    ap.add_argument("--gpu-gib", type=float, default=None, help="GPU memory for --plan-only without a GPU")
    ap.add_argument("--out", default=os.environ.get("OUT", "experiments/system_decode_throughput"))
    a = ap.parse_args(argv)
    if a.smoke:
        a.contexts, a.num_layers, a.batch, a.steps, a.warmup = "2048", 2, 2, 5, 2
    a.contexts = [int(x) for x in a.contexts.split(",")]
    a.methods = a.methods.split(",")
    for m in a.methods:
        forced = m.partition("@")[2]
        if "@" in m and not (forced.isdigit() and int(forced) > 0):
            ap.error(f"--methods: {m!r}: the batch after '@' must be a positive integer (e.g. full_graph@10)")
    return a


def method_config(name: str, num_layers: int, hkv: int, d: int, seed: int = 0) -> dict:
    """The method settings of the runs: the papers' defaults (MagicPIG §5.1: sink 4, local 64, layers {0, 16}
    dense; DS: α = 1/4 with 4-bit labels = 1/16 of the K cache, β = 1/16, layers {0, 1} dense) with, for DS, one
    label row and one top-k per KV head (``gqa: kv_head``: each selected row is read once for the 4 query heads
    of its group).  A random-weight model has no calibrated channels: DS uses random ones (the decode cost does
    not depend on which)."""
    if name == "full":
        return {"name": "full"}
    if name.startswith("magicpig"):
        _, k, l_ = name.split("_")
        dense = [0, 16] if num_layers > 16 else [0]
        return {"name": "magicpig", "K": int(k), "L": int(l_), "dense_layers": dense}
    if name in ("ds", "ds_offload"):
        gen = torch.Generator().manual_seed(seed)
        ch = torch.stack(
            [torch.stack([torch.randperm(d, generator=gen) for _ in range(hkv)]) for _ in range(num_layers)]
        )
        return {
            "name": "double_sparsity",
            "alpha": 0.25,
            "beta": 0.0625,
            "label_bits": 4,
            "gqa": "kv_head",
            "channels": ch,
            "offload": name == "ds_offload",
            "dense_layers": [0, 1] if num_layers > 2 else [0],
        }
    if name == "quest":  # MagicPIG §5.1's Quest baseline settings at β = 1/16: pages of 16, sink 4 + local 64
        return {"name": "quest", "page_size": 16, "budget": 0.0625, "dense_layers": [0, 1] if num_layers > 2 else [0]}
    raise ValueError(f"method {name!r}; valid: full, ds, ds_offload, quest, magicpig_<K>_<L>")


def bandwidths(dev) -> dict:
    """GPU device copy, pinned host-to-device copy and CPU streaming read, measured in this run."""
    out = {}
    if dev.type == "cuda":
        x = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        y = torch.empty_like(x)
        h = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
        for name, fn, nbytes in (
            ("gpu_copy_gbps", lambda: y.copy_(x), 2 << 30),
            ("h2d_pinned_gbps", lambda: y.copy_(h, non_blocking=True), 1 << 30),
        ):
            fn()
            torch.cuda.synchronize()
            ts = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                ts.append(a.elapsed_time(b))
            out[name] = nbytes / (statistics.median(ts) * 1e-3) / 1e9
        del x, y, h
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB, far beyond the L3 cache
    big.sum()
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        big.sum()
        ts.append(time.perf_counter() - t)
    out["cpu_stream_read_gbps_torch"] = big.numel() * 4 / statistics.median(ts) / 1e9
    return out


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if "tokens_per_s" in r]
    if not ok:
        return
    ctxs = sorted({r["context"] for r in ok})
    methods = list(dict.fromkeys(r["method"] for r in ok))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.8 / max(1, len(methods))
    for j, m in enumerate(methods):
        for ax, key in zip(axes, ("tokens_per_s", "ms_per_step")):
            xs, ys, labels = [], [], []
            for i, c in enumerate(ctxs):
                r = next((r for r in ok if r["method"] == m and r["context"] == c), None)
                if r:
                    xs.append(i + (j - (len(methods) - 1) / 2) * w)
                    ys.append(r[key])
                    labels.append(f"B={r['batch']}")
            bars = ax.bar(xs, ys, w, label=m)
            if key == "tokens_per_s":
                for bar, lab in zip(bars, labels):
                    ax.annotate(
                        lab,
                        (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        rotation=90,
                    )
    for ax, ylabel in zip(axes, ("throughput (generated tokens/s, whole batch)", "latency per decode step (ms)")):
        ax.set_yscale("log")  # MagicPIG's CPU part and full attention differ by 100x
        ax.set_xticks(range(len(ctxs)))
        ax.set_xticklabels([f"{c // 1024}K" for c in ctxs])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
    lo, hi = axes[0].get_ylim()
    axes[0].set_ylim(lo, hi * 3)  # room for the batch labels
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(
        handles,
        labels,
        loc="lower center",
        ncol=len(labels),
        fontsize=8,
        title="methods (_graph: the decode step captured once in a CUDA graph)",
        title_fontsize=8,
    )
    fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    fig.savefig(path, dpi=120)
    fig.savefig(path.with_suffix(".pdf"))
    plt.close(fig)


def _title(shape: str, gpu: str) -> str:
    return f"{shape} shape (random weights), bf16, greedy decode, {gpu}; batch = largest that fits (labelled)"


def print_plan(a, shape: dict, cpu_free: float, threads: int) -> int:
    """The planned batch of every (context, method) run on this machine, without building the model."""
    n_layers = a.num_layers or shape["num_hidden_layers"]
    weights = weight_bytes(shape, n_layers)
    if torch.cuda.is_available():
        gpu_total = torch.cuda.get_device_properties(0).total_memory
    elif a.gpu_gib:
        gpu_total = a.gpu_gib * GiB
    else:
        raise SystemExit("--plan-only without a GPU needs --gpu-gib (e.g. --gpu-gib 139 for an H200)")
    gpu_free = max(0.0, gpu_total - weights - a.gpu_reserve_gib * GiB)
    print(
        f"{a.shape} ({n_layers} layers, weights {weights / GiB:.1f} GiB); GPU {gpu_total / GiB:.0f} GiB, "
        f"{gpu_free / GiB:.1f} GiB for caches; host {cpu_free / GiB:.1f} GiB for caches; MagicPIG CPU threads "
        f"{threads}"
    )
    print(
        f"{'context':>8s} {'method':22s} {'batch':>5s} {'GPU MiB/row':>12s} {'host MiB/row':>13s} {'fit GPU':>8s} "
        f"{'fit host':>8s}"
    )
    for ctx in a.contexts:
        for spec in a.methods:
            name, _, forced = spec.partition("@")
            base = "_".join(p for p in name.split("_") if p not in ("graph", "torchtopk", "halves"))
            cfg = method_config(base, n_layers, shape["num_key_value_heads"], shape["head_dim"])
            batch, plan = plan_batch(cfg, ctx, a.steps, shape, n_layers, gpu_free, cpu_free, a.max_batch)
            batch = int(forced) if forced else (a.batch or batch)
            print(
                f"{ctx:8d} {name:22s} {batch:5d} {plan['gpu_bytes_per_row'] / 2**20:12.1f} "
                f"{plan['cpu_bytes_per_row'] / 2**20:13.1f} {plan['fit_gpu']:8d} {plan['fit_cpu']:8d}"
            )
    return 0


def main(argv=None) -> int:
    a = parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.replot:
        data = json.loads(Path(a.replot).read_text())
        gpu = data["meta"]["hardware"].get("gpu_name", "CPU")
        plot(data["records"], out / "system_decode.png", _title(data["meta"]["shape"], gpu))
        print(f"wrote {out / 'system_decode.png'}")
        return 0
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    threads = a.threads or host_threads()
    shape = SHAPES[a.shape]
    cpu_free = a.cpu_budget_gib * GiB if a.cpu_budget_gib else 0.6 * host_memory_available()
    if a.plan_only:
        return print_plan(a, shape, cpu_free, threads)
    import sparse_eval.kernels.magicpig_cpu as kmc

    kmc.set_num_threads(threads)
    t_start = time.time()
    model = random_model(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, num_layers=a.num_layers)
    n_layers = model.config.num_hidden_layers
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    gpu_total = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else 0
    gpu_free = max(0.0, gpu_total - weights - a.gpu_reserve_gib * GiB) if dev.type == "cuda" else 64 * GiB
    meta = {
        "magicpig_cpu_threads": threads,
        "command": "python " + " ".join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]),
        "hardware": hardware(),
        "bandwidths": bandwidths(dev),
        "shape": a.shape,
        "num_layers": n_layers,
        "weights_bytes": weights,
        "gpu_free_for_caches": gpu_free,
        "cpu_free_for_caches": cpu_free,
        "steps": a.steps,
        "warmup": a.warmup,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    print(json.dumps({k: v for k, v in meta.items() if k != "hardware"}, default=str), flush=True)
    records: list[dict] = []
    path = out / "system_decode.json"
    gen = torch.Generator().manual_seed(0)
    for ctx in a.contexts:
        ids = torch.randint(0, shape["vocab_size"], (1, ctx), generator=gen)
        for spec in a.methods:
            name, _, forced = spec.partition("@")  # name@B: this batch, whatever the plan says
            rec: dict = {"method": name, "context": ctx}
            if time.time() - t_start > a.time_budget_s:
                rec["skipped"] = f"time budget {a.time_budget_s:.0f} s spent"
                records.append(rec)
                continue
            parts = name.split("_")
            graph = "graph" in parts
            topk = "torch" if "torchtopk" in parts else "radix"
            interleave = 2 if "halves" in parts else 1
            base = "_".join(p for p in parts if p not in ("graph", "torchtopk", "halves"))
            cfg = method_config(base, n_layers, shape["num_key_value_heads"], shape["head_dim"])
            batch, plan = plan_batch(cfg, ctx, a.steps, shape, n_layers, gpu_free, cpu_free, a.max_batch)
            batch = int(forced) if forced else (a.batch or batch)
            rec.update(
                batch=batch,
                batch_forced=bool(forced or a.batch),
                plan=plan,
                cuda_graph=graph,
                topk=topk,
                interleave=interleave,
                method_config={k: v for k, v in cfg.items() if k != "channels"},
            )
            if batch < 1:
                rec["skipped"] = "does not fit one row"
                records.append(rec)
                continue
            try:
                method = build_method(cfg)
                method.setup(model, a.shape)
                t0 = time.time()
                res = decode(
                    model,
                    method,
                    ids,
                    a.steps,
                    DecodeOptions(repeat_batch=batch, cuda_graph=graph, topk=topk, interleave=interleave),
                )
                steps = res.step_ms[a.warmup :] or res.step_ms  # step_ms has steps - 1 entries
                med = statistics.median(steps)
                rec.update(
                    ms_per_step=med,
                    ms_min=min(steps),
                    ms_max=max(steps),
                    timed_steps=len(steps),
                    tokens_per_s=batch * 1e3 / med,
                    prefill_ms_batch1=res.prefill_ms,
                    first_steps_ms=res.step_ms[: a.warmup],
                    memory=res.memory,
                    wall_s=time.time() - t0,
                )
                if res.stats.get("sample_rows"):
                    rec["sampled_fraction_of_candidates"] = res.stats["sampled"] / max(1, res.stats["candidates"])
                for key in ("graph_capture_ms", "host_wait_ms_per_step", "host_part_ms_per_step"):
                    if key in res.stats:
                        rec[key] = res.stats[key]
                if res.stats.get("host_parts"):  # MagicPIG's static host parts, per layer: look-up, attention
                    for key in ("host_sample_ms", "host_attention_ms"):
                        rec[key + "_per_layer"] = res.stats[key] / res.stats["host_parts"]
                if "offload_own_query" in res.stats:
                    rec["offload_own_query_calls"] = res.stats["offload_own_query"]
            except torch.OutOfMemoryError as e:  # a plan that was too optimistic: recorded, the sweep goes on
                rec["error"] = f"OOM: {str(e).splitlines()[0]}"
            except Exception as e:  # noqa: BLE001 - recorded with the run, the sweep goes on
                rec["error"] = f"{type(e).__name__}: {e}"
            finally:
                method = res = None
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
            records.append(rec)
            print(json.dumps(rec, default=str), flush=True)
            path.write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=str))
    # the baseline of each context is the faster of full attention eager (sdpa) and captured (Triton split-K)
    full: dict[int, dict] = {}
    for r in records:
        if r["method"] in ("full", "full_graph") and "tokens_per_s" in r:
            if r["context"] not in full or r["tokens_per_s"] > full[r["context"]]["tokens_per_s"]:
                full[r["context"]] = r
    for r in records:
        if "tokens_per_s" in r and r["context"] in full:
            r["throughput_vs_full"] = r["tokens_per_s"] / full[r["context"]]["tokens_per_s"]
            r["full_baseline"] = full[r["context"]]["method"]
    path.write_text(json.dumps({"meta": meta, "records": records}, indent=1, default=str))
    gpu = meta["hardware"].get("gpu_name", "CPU")
    plot(records, out / "system_decode.png", _title(a.shape, gpu))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
