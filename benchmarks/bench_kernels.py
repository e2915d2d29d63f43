"""GPU attention-operator benchmark: Double Sparsity and Quest decode kernels vs dense sdpa decode.

Llama-3.1-8B attention shape (32 query heads, 8 KV heads, head dim 128, bf16), one query token per sequence,
batch 4–32 × context 2K–16K and batch 1–4 × 32K–128K.  Double Sparsity at α = β = 1/16 (r = 8 label channels
per KV head, top N/16 tokens; labels 16/8/4-bit; selection per query head or shared per KV group), Quest at
(page size, token fraction) budgets.  The baseline is ``torch.nn.functional.scaled_dot_product_attention`` on
the same q, K, V (DS paper §6.2.2).  Records per shape: median time (CUDA events; eager launches and a CUDA
graph replay of the whole step), the bytes each step must move at least (label cache / page bounds + gathered
K/V rows; dense: all K/V), achieved GB/s, speedup over sdpa, the time of each stage (scores, top-k,
attention), and the device-to-device copy bandwidth measured in the same run.  Inputs rotate among enough
copies that every timed step reads from HBM, not L2.

    python benchmarks/bench_kernels.py --out $OUT/kernels              # GPU machine
    python benchmarks/bench_kernels.py --quick --out /tmp/kb           # CPU smoke check (torch references)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _kernel_bench_util import hardware, print_table, time_cpu, time_cuda, write_json  # noqa: E402

from sparse_eval.kernels import ds, quest, sparse_decode  # noqa: E402

HQ, HKV, D = 32, 8, 128
G = HQ // HKV


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, few repetitions (smoke check)")
    ap.add_argument("--backend", default="auto", choices=["auto", "triton", "torch"])
    ap.add_argument("--batches", type=int, nargs="+", default=None)
    ap.add_argument("--contexts", type=int, nargs="+", default=None)
    ap.add_argument("--long-batches", type=int, nargs="+", default=None)
    ap.add_argument("--long-contexts", type=int, nargs="+", default=None)
    ap.add_argument("--alpha", type=float, default=1 / 16, help="DS channel ratio r / d")
    ap.add_argument("--beta", type=float, default=1 / 16, help="DS token ratio k / N")
    ap.add_argument("--label-bits", type=int, nargs="+", default=None)
    ap.add_argument("--gqa", nargs="+", default=["kv_head", "query_head"], choices=["kv_head", "query_head"])
    ap.add_argument(
        "--quest",
        type=str,
        nargs="+",
        default=None,
        help="Quest budgets 'page_size,token_fraction' (MagicPIG Table 3: 16,0.04 32,0.06 64,0.08)",
    )
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--no-graph", action="store_true", help="time eager launches only")
    ap.add_argument("--rotate-bytes", type=float, default=4e8, help="inputs rotate until they exceed this")
    ap.add_argument("--no-tune", action="store_true", help="skip the launch-configuration sweep of the attention")
    ap.add_argument("--no-tune-labels", action="store_true", help="skip the sweep of the label-score kernel's settings")
    ap.add_argument("--no-tune-topk", action="store_true", help="skip the sweep of the top-k kernel's settings")
    a = ap.parse_args(argv)
    q = a.quick
    a.batches = a.batches or ([2] if q else [4, 8, 16, 32])
    a.contexts = a.contexts or ([512] if q else [2048, 4096, 8192, 16384])
    a.long_batches = a.long_batches or ([] if q else [1, 4])
    a.long_contexts = a.long_contexts or ([] if q else [32768, 65536, 131072])
    a.label_bits = a.label_bits or ([4] if q else [16, 8, 4])
    a.quest = [
        (int(p), float(f))
        for p, f in (
            s.split(",") for s in (a.quest or (["16,0.0625"] if q else ["16,0.0625", "16,0.04", "32,0.06", "64,0.08"]))
        )
    ]
    a.reps = a.reps or (3 if q else 50)
    a.warmup = a.warmup or (1 if q else 10)
    return a


class Timer:
    def __init__(self, device, args):
        self.device = device
        self.args = args
        self.graph = device.type == "cuda" and not args.no_graph

    def eager(self, fns):
        """fns: one callable per rotated input set; each timed call takes the next one."""
        state = {"i": 0}

        def step():
            state["i"] = (state["i"] + 1) % len(fns)
            fns[state["i"]]()

        t = time_cuda if self.device.type == "cuda" else time_cpu
        return t(step, self.args.warmup, self.args.reps)

    def graphed(self, fns):
        if not self.graph:
            return None
        graphs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for f in fns:  # warm-up on a side stream (allocations, autotuning) before capture
                f()
        torch.cuda.current_stream().wait_stream(stream)
        for f in fns:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                f()
            graphs.append(g)
        return self.eager([g.replay for g in graphs])


def copy_bandwidth(device) -> dict | None:
    if device.type != "cuda":
        return None
    x = torch.empty(int(2e9) // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    t = time_cuda(lambda: y.copy_(x), 3, 20)
    return {
        "bytes_read_plus_written": 2 * x.numel() * 2,
        "median_ms": t["median_ms"],
        "gbps": 2 * x.numel() * 2 / (t["median_ms"] * 1e-3) / 1e9,
    }


def sdpa_decode(q, k, v):
    """q [B, Hq, D] -> [B, Hq, D] through sdpa with enable_gqa (no repeated K/V)."""
    return F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True).squeeze(2)


def make_inputs(b, n, args, device, gen):
    dt = torch.bfloat16
    kv_bytes = b * HKV * n * D * 2 * 2
    copies = 1 if device.type != "cuda" else max(1, min(8, math.ceil(args.rotate_bytes / kv_bytes)))
    r = max(1, round(args.alpha * D))
    sets = []
    for _ in range(copies):  # drawn on the device (fast), never zeros
        k = torch.randn(b, HKV, n, D, generator=gen, device=device, dtype=torch.float32).to(dt)
        v = torch.randn(b, HKV, n, D, generator=gen, device=device, dtype=torch.float32).to(dt)
        q = torch.randn(b, HQ, D, generator=gen, device=device, dtype=torch.float32).to(dt)
        channels = torch.stack([torch.randperm(D, generator=gen, device=device)[:r] for _ in range(HKV)])
        sets.append({"q": q, "k": k, "v": v, "channels": channels})
    return sets, kv_bytes


def rel_err(a, b):
    a, b = a.float(), b.float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def bench_shape(b, n, args, device, timer, gen, rows):
    sets, kv_bytes = make_inputs(b, n, args, device, gen)
    be = args.backend
    base = {"batch": b, "context": n, "hq": HQ, "hkv": HKV, "d": D, "dtype": "bfloat16", "copies": len(sets)}
    out = []

    def record(name, fns, nbytes, extra=None, stages=None):
        t = timer.eager(fns)
        rec = {**base, "impl": name, "eager": t, "ms": t["median_ms"], "bytes": nbytes, **(extra or {})}
        tg = timer.graphed(fns)
        if tg is not None:
            rec["graph"] = tg
            rec["ms_graph"] = tg["median_ms"]
        best = min(rec["ms"], rec.get("ms_graph", float("inf")))
        rec["ms_best"] = best
        rec["gbps"] = nbytes / (best * 1e-3) / 1e9
        if stages:
            rec["stages_ms"] = {k: timer.eager(v)["median_ms"] for k, v in stages.items()}
            graphed = {k: timer.graphed(v) for k, v in stages.items()}
            if all(g is not None for g in graphed.values()):  # without launch overhead
                rec["stages_graph_ms"] = {k: g["median_ms"] for k, g in graphed.items()}
        out.append(rec)
        return rec

    dense = record("sdpa", [lambda s=s: sdpa_decode(s["q"], s["k"], s["v"]) for s in sets], kv_bytes)
    # the dense decode of the system path: Triton split-K over a preallocated cache with per-row lengths (what a
    # captured step runs), and sdpa on a [:, :, :n] slice of a preallocated cache, as the eager FullLayer calls it
    lengths = torch.full((b,), n, dtype=torch.int32, device=device)
    rec = record(
        "dense_triton",
        [lambda s=s: sparse_decode.dense_attention(s["q"], s["k"], s["v"], lengths, backend=be) for s in sets[:1]],
        kv_bytes,
    )
    rec["speedup_vs_sdpa"] = dense["ms_best"] / rec["ms_best"]
    rec = record(
        "dense_triton_w8",
        [
            lambda s=s: sparse_decode.dense_attention(s["q"], s["k"], s["v"], lengths, backend=be, num_warps=8)
            for s in sets[:1]
        ],
        kv_bytes,
    )
    rec["speedup_vs_sdpa"] = dense["ms_best"] / rec["ms_best"]
    padded = []
    for s in sets[:1]:
        kp = torch.empty(b, HKV, n + 64, D, dtype=s["k"].dtype, device=device)
        vp = torch.empty_like(kp)
        kp[:, :, :n] = s["k"]
        vp[:, :, :n] = s["v"]
        padded.append((s["q"].view(b, HKV, G, D), kp[:, :, :n], vp[:, :, :n]))
    rec = record("sdpa_slice_of_capacity", [lambda p=p: F.scaled_dot_product_attention(*p) for p in padded], kv_bytes)
    rec["speedup_vs_sdpa"] = dense["ms_best"] / rec["ms_best"]
    del padded
    s0 = sets[0]
    budget = max(1, round(args.beta * n))
    # the floor of any selection method at this budget: sdpa over `budget` contiguous keys per KV head, i.e. the
    # attention DS ends with, without finding the keys (no label scores, no top-k) and without gathering them.
    # Copies rotate until they exceed --rotate-bytes, so these reads come from HBM as well.
    sel_bytes = b * HKV * budget * D * 2 * 2
    n_sel_copies = 1 if device.type != "cuda" else max(1, min(64, math.ceil(args.rotate_bytes / sel_bytes)))
    sel_sets = [
        (
            sets[i % len(sets)]["q"],
            torch.randn(b, HKV, budget, D, generator=gen, device=device).to(s0["k"].dtype),
            torch.randn(b, HKV, budget, D, generator=gen, device=device).to(s0["v"].dtype),
        )
        for i in range(n_sel_copies)
    ]
    floor = record(
        "floor_sdpa_budget_keys",
        [lambda s=s: sdpa_decode(*s) for s in sel_sets],
        sel_bytes,
        {"budget": budget, "copies": n_sel_copies},
    )
    floor["speedup_vs_sdpa"] = dense["ms_best"] / floor["ms_best"]
    del sel_sets
    r = s0["channels"].shape[1]
    for bits in args.label_bits:
        caches = [ds.build_label_cache(s["k"], s["channels"], bits) for s in sets]
        label_bytes = caches[0].nbytes()
        for gqa in args.gqa:
            hi = HKV if gqa == "kv_head" else HQ
            gathered = b * hi * budget * D * 2 * 2
            fns = [
                lambda s=s, c=c, gqa=gqa: ds.decode(
                    s["q"], s["k"], s["v"], c, s["channels"], budget, gqa=gqa, backend=be
                )
                for s, c in zip(sets, caches)
            ]
            # stages on precomputed inputs
            ql = ds.gather_query_channels(s0["q"], s0["channels"])
            qs = ql.view(b, HKV, G, r).sum(2) if gqa == "kv_head" else ql
            scores = ds.label_scores(qs, caches[0], backend=be)
            idx = ds.topk_indices(scores, budget, backend=be)
            stages = {
                "label_scores": [lambda: ds.label_scores(qs, caches[0], backend=be)],
                "topk": [lambda: ds.topk_indices(scores, budget, backend=be)],  # kernels.topk's radix select on CUDA
                "topk_torch": [lambda: ds.topk_indices(scores, budget, topk="torch")],  # torch.topk
                "topk_sorted": [lambda: torch.topk(scores, budget, dim=-1, sorted=True)],
                "attention": [lambda: sparse_decode.attention(s0["q"], s0["k"], s0["v"], idx, backend=be)],
            }
            o, lse, sel = ds.decode(s0["q"], s0["k"], s0["v"], caches[0], s0["channels"], budget, gqa=gqa, backend=be)
            o_ref, _ = sparse_decode.attention_reference(s0["q"], s0["k"], s0["v"], sel, out_dtype=torch.float32)
            rec = record(
                f"ds_{bits}bit_{gqa}",
                fns,
                label_bytes + gathered,
                {
                    "label_bits": bits,
                    "gqa": gqa,
                    "alpha": r / D,
                    "beta": budget / n,
                    "budget": budget,
                    "label_bytes": label_bytes,
                    "gathered_bytes": gathered,
                    "rel_err_vs_reference": rel_err(o, o_ref),
                },
                stages,
            )
            rec["speedup_vs_sdpa"] = dense["ms_best"] / rec["ms_best"]
            rec["goal_12x"] = rec["speedup_vs_sdpa"] >= 12.0
            if gqa == "kv_head":  # bound with a free top-k and gather: these label scores + the floor above
                st = rec.get("stages_graph_ms") or rec["stages_ms"]
                rec["bound_ms"] = st["label_scores"] + floor["ms_best"]
                rec["bound_speedup_vs_sdpa"] = dense["ms_best"] / rec["bound_ms"]
            if device.type == "cuda" and be != "torch":  # the same step with torch.topk
                fns_t = [
                    lambda s=s, c=c, gqa=gqa: ds.decode(
                        s["q"], s["k"], s["v"], c, s["channels"], budget, gqa=gqa, backend=be, topk="torch"
                    )
                    for s, c in zip(sets, caches)
                ]
                rec_t = record(
                    f"ds_{bits}bit_{gqa}_torch_topk",
                    fns_t,
                    label_bytes + gathered,
                    {
                        "label_bits": bits,
                        "gqa": gqa,
                        "alpha": r / D,
                        "beta": budget / n,
                        "budget": budget,
                        "topk": "torch",
                    },
                )
                rec_t["speedup_vs_sdpa"] = dense["ms_best"] / rec_t["ms_best"]
    for ps, frac in args.quest:
        n_sel = max(1, round(frac * n / ps))
        meta = [quest.page_metadata(s["k"], ps) for s in sets]
        p = meta[0][0].shape[2]
        meta_bytes = 2 * b * HKV * p * D * 2
        for gqa in args.gqa:
            hi = HKV if gqa == "kv_head" else HQ
            gathered = b * hi * min(n, n_sel * ps) * D * 2 * 2
            fns = [
                lambda s=s, m=m, gqa=gqa: quest.decode(
                    s["q"], s["k"], s["v"], m[0], m[1], ps, n_sel, gqa=gqa, backend=be
                )
                for s, m in zip(sets, meta)
            ]
            pscores = quest.page_scores(s0["q"], *meta[0], reduce=gqa == "kv_head", backend=be)
            pages = quest.top_pages(pscores, n_sel)
            tok = quest.pages_to_tokens(pages, ps, n)
            stages = {
                "page_scores": [lambda g=gqa: quest.page_scores(s0["q"], *meta[0], reduce=g == "kv_head", backend=be)],
                "topk": [lambda: quest.top_pages(pscores, n_sel)],
                "expand": [lambda: quest.pages_to_tokens(pages, ps, n)],
                "attention": [lambda: sparse_decode.attention(s0["q"], s0["k"], s0["v"], tok, backend=be)],
            }
            o, lse, sel = quest.decode(s0["q"], s0["k"], s0["v"], *meta[0], ps, n_sel, gqa=gqa, backend=be)
            o_ref, _ = sparse_decode.attention_reference(s0["q"], s0["k"], s0["v"], sel, out_dtype=torch.float32)
            rec = record(
                f"quest_p{ps}_{frac:g}_{gqa}",
                fns,
                meta_bytes + gathered,
                {
                    "page_size": ps,
                    "token_fraction": frac,
                    "pages_selected": n_sel,
                    "gqa": gqa,
                    "meta_bytes": meta_bytes,
                    "gathered_bytes": gathered,
                    "rel_err_vs_reference": rel_err(o, o_ref),
                },
                stages,
            )
            rec["speedup_vs_sdpa"] = dense["ms_best"] / rec["ms_best"]
    rows.extend(out)
    del sets
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


TUNE_CONFIGS = [  # (BLOCK_N, num_warps, num_stages, split multiplier)
    (64, 4, None, 1),
    (64, 4, 2, 1),
    (64, 4, 4, 1),
    (64, 8, 3, 1),
    (32, 4, 3, 1),
    (32, 4, 2, 1),
    (128, 8, 3, 1),
    (16, 4, 3, 1),
    (64, 4, None, 2),
    (64, 4, None, 0.5),
]


def tune_attention(b, n, args, device, gen, rows):
    """Time ``sparse_decode.attention`` alone over N/16 random indices (shared per KV group, and per query head)
    for several launch configurations: data for choosing the defaults on this GPU."""
    sets, _ = make_inputs(b, n, args, device, gen)
    s_len = max(1, round(args.beta * n))
    for hi, mode in ((HKV, "kv_head"), (HQ, "query_head")):
        idxs = [
            torch.stack([torch.randperm(n, device=device, generator=gen)[:s_len] for _ in range(b * hi)])
            .view(b, hi, s_len)
            .to(torch.int32)
            for _ in sets
        ]
        nbytes = b * hi * s_len * D * 2 * 2
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        base_splits, _ = sparse_decode.split_plan(b * hi, s_len, 64, sms)
        for bn, nw, ns, mult in TUNE_CONFIGS:
            splits = max(1, int(round(base_splits * mult)))
            fns = [
                lambda s=s, ix=ix: sparse_decode.attention(
                    s["q"],
                    s["k"],
                    s["v"],
                    ix,
                    block_n=bn,
                    num_warps=nw,
                    num_stages=ns,
                    num_splits=splits if mult != 1 else None,
                )
                for s, ix in zip(sets, idxs)
            ]
            try:
                t = (time_cuda if device.type == "cuda" else time_cpu)(
                    lambda: [f() for f in fns], args.warmup, args.reps
                )
            except Exception as e:  # a configuration the compiler rejects: record and go on
                rows.append(
                    {
                        "kind": "tune",
                        "batch": b,
                        "context": n,
                        "gqa": mode,
                        "block_n": bn,
                        "num_warps": nw,
                        "num_stages": ns,
                        "split_mult": mult,
                        "error": str(e)[:300],
                    }
                )
                continue
            ms = t["median_ms"] / len(fns)
            rows.append(
                {
                    "kind": "tune",
                    "batch": b,
                    "context": n,
                    "gqa": mode,
                    "block_n": bn,
                    "num_warps": nw,
                    "num_stages": ns,
                    "split_mult": mult,
                    "splits": splits if mult != 1 else base_splits,
                    "ms": ms,
                    "bytes": nbytes,
                    "gbps": nbytes / (ms * 1e-3) / 1e9,
                }
            )
    del sets


def time_graph_per_call(fn, args, calls: int = 20) -> float:
    """ms per call of ``fn`` from a CUDA graph of ``calls`` back-to-back calls (no launch gaps), median of reps."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    return time_cuda(g.replay, 3, args.reps)["median_ms"] / calls


LABEL_SHAPES = [  # (B, N, r, bits): the end-to-end DS run (α = 1/4, 4-bit) at 16K, and the kernel benchmark's
    (45, 16384, 32, 4),
    (32, 16384, 8, 4),
    (7, 98304, 32, 4),
]
LABEL_CONFIGS = [(bn, nw) for bn in (128, 256, 512, 1024, 2048) for nw in (2, 4, 8)]


def tune_label_scores(args, device, gen, rows):
    """Time ``kernels.ds.label_scores`` (GQA-summed, with row lengths, as the captured DS step calls it) for
    several BLOCK_N / warps, as GB/s of the label cache read."""
    for b, n, r, bits in LABEL_SHAPES:
        x = torch.randn(b, HKV, n, r, generator=gen, device=device)
        cache = ds.quantize_labels(x, bits)
        ql = torch.randn(b, HQ, r, generator=gen, device=device)
        lengths = torch.full((b,), n - 5, dtype=torch.int32, device=device)
        nbytes = cache.nbytes() + b * HKV * n * 4
        for bn, nw in LABEL_CONFIGS:
            try:
                ms = time_graph_per_call(
                    lambda: ds.label_scores(
                        ql,
                        cache,  # noqa: F821 (deleted after use)
                        reduce=True,
                        lengths=lengths,
                        block_n=bn,  # noqa: F821 (deleted after use)
                        num_warps=nw,
                    ),
                    args,
                )
            except Exception as e:  # a configuration the compiler rejects: recorded
                rows.append(
                    {
                        "kind": "label_tune",
                        "batch": b,
                        "context": n,
                        "r": r,
                        "bits": bits,
                        "block_n": bn,
                        "num_warps": nw,
                        "error": str(e)[:300],
                    }
                )
                continue
            rows.append(
                {
                    "kind": "label_tune",
                    "batch": b,
                    "context": n,
                    "r": r,
                    "bits": bits,
                    "block_n": bn,
                    "num_warps": nw,
                    "ms": ms,
                    "bytes": nbytes,
                    "gbps": nbytes / (ms * 1e-3) / 1e9,
                }
            )
        del x, cache


TOPK_CONFIGS = [(8, 2048, 4, 2), (8, 2048, 4, 99), (8, 4096, 4, 2), (8, 1024, 4, 2), (8, 2048, 8, 2), (4, 2048, 4, 4)]
# (radix bits, BLOCK_N, warps, first pass counted by per-key atomics; 99 = tile histograms in every pass).  A
# one-program-per-row layout (commit 1d25a96) is slower at every shape on the H200.
TOPK_SHAPES = ((32, 16384), (45, 16384), (16, 16384), (22, 32768), (7, 98304), (4, 131072))


def tune_topk(b, n, args, device, gen, rows):
    """Time ``kernels.topk.select`` on label-score-like rows [B, Hkv, N] (k = β·N) for several radix widths and
    launch shapes, against ``torch.topk`` on the same rows (CUDA-graph replays)."""
    from sparse_eval.kernels import topk

    scores = torch.randn(b, HKV, n, generator=gen, device=device)
    k = max(1, round(args.beta * n))
    timer = Timer(device, args)

    def timed(fn):  # graphed (as in a captured step: several launches, no launch overhead) where possible
        t = timer.graphed([fn]) or timer.eager([fn])
        return t["median_ms"]

    rows.append(
        {
            "kind": "topk_tune",
            "batch": b,
            "context": n,
            "impl": "torch.topk",
            "ms": timed(lambda: torch.topk(scores, k, dim=-1, sorted=False)),
        }
    )
    for rb, bn, nw, af in TOPK_CONFIGS:
        cfg = {"radix_bits": rb, "block_n": bn, "num_warps": nw, "atomic_from": af}
        try:
            ms = timed(lambda: topk.select(scores, k, radix_bits=rb, block_n=bn, num_warps=nw, atomic_from=af))
        except Exception as e:  # a configuration the compiler rejects: recorded
            rows.append({"kind": "topk_tune", "batch": b, "context": n, **cfg, "error": str(e)[:300]})
            continue
        rows.append({"kind": "topk_tune", "batch": b, "context": n, "impl": "kernels.topk", **cfg, "ms": ms})


def plot(rows, out: Path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    impls = sorted({r["impl"] for r in rows if r["impl"] != "sdpa"})
    batches = sorted({r["batch"] for r in rows})
    fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 4.2), squeeze=False)
    for ax, b in zip(axes[0], batches):
        for impl in impls:
            pts = sorted((r["context"], r["speedup_vs_sdpa"]) for r in rows if r["batch"] == b and r["impl"] == impl)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=impl, ms=3)
        ax.axhline(12, color="gray", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_title(f"batch {b}")
        ax.set_xlabel("context")
        ax.set_ylabel("speedup vs sdpa decode")
    axes[0][-1].legend(fontsize=6)
    fig.tight_layout()
    path = out / "kernels_speedup.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def main(argv=None):
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.quick:
        print("no CUDA device: running the CPU smoke check (--quick sizes)")
        args = parse_args(list(argv or sys.argv[1:]) + ["--quick"])
    timer = Timer(device, args)
    hw = hardware()
    bw = copy_bandwidth(device)
    if bw:
        print(f"device-to-device copy: {bw['gbps']:.0f} GB/s (read + write)")
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    shapes = [(b, n) for b in args.batches for n in args.contexts] + [
        (b, n) for b in args.long_batches for n in args.long_contexts
    ]
    for b, n in shapes:
        try:
            bench_shape(b, n, args, device, timer, gen, rows)
        except torch.cuda.OutOfMemoryError as e:  # pragma: no cover - GPU only
            print(f"B={b} N={n}: out of memory ({e}); skipped")
            torch.cuda.empty_cache()
        print(f"done B={b} N={n}", flush=True)
    tune_rows: list[dict] = []
    if device.type == "cuda" and not args.no_tune and args.backend != "torch":
        for b, n in ((32, 16384), (1, 131072)) if not args.quick else ((2, 4096),):
            tune_attention(b, n, args, device, gen, tune_rows)
    if device.type == "cuda" and args.backend != "torch" and not args.no_tune_labels:
        tune_label_scores(args, device, gen, tune_rows)
    if device.type == "cuda" and args.backend != "torch" and not args.no_tune_topk:
        for b, n in TOPK_SHAPES if not args.quick else ((2, 4096),):
            tune_topk(b, n, args, device, gen, tune_rows)
    topk_rows = [r for r in tune_rows if r.get("kind") == "topk_tune"]
    label_rows = [r for r in tune_rows if r.get("kind") == "label_tune"]
    tune_rows = [r for r in tune_rows if r.get("kind") not in ("topk_tune", "label_tune")]
    for r in rows + tune_rows:
        r["hardware"] = {
            "gpu_name": hw.get("gpu_name"),
            "cpu_model": hw.get("cpu_model"),
            "logical_cpus": hw.get("logical_cpus"),
        }
        r["copy_gbps"] = bw["gbps"] if bw else None
        if bw and "gbps" in r:
            r["frac_of_copy_bw"] = r["gbps"] / bw["gbps"]
    payload = {
        "hardware": hw,
        "copy_bandwidth": bw,
        "args": {k: str(v) for k, v in vars(args).items()},
        "records": rows,
        "tune": tune_rows,
        "topk_tune": topk_rows,
        "label_tune": label_rows,
    }
    path = write_json(args.out, "kernels.json", payload)
    png = plot(rows, args.out)
    table = print_table(
        rows,
        [
            ("batch", "B", ""),
            ("context", "N", ""),
            ("impl", "impl", ""),
            ("ms", "eager ms", ".4f"),
            ("ms_graph", "graph ms", ".4f"),
            ("gbps", "GB/s", ".0f"),
            ("speedup_vs_sdpa", "x sdpa", ".2f"),
            ("rel_err_vs_reference", "rel err", ".1e"),
            ("bound_speedup_vs_sdpa", "bound x sdpa", ".2f"),
        ],
    )
    stage_rows = [
        {"batch": r["batch"], "context": r["context"], "impl": r["impl"], **r["stages_graph_ms"]}
        for r in rows
        if r.get("stages_graph_ms") and r["impl"].startswith("ds_")
    ]
    shape = [("batch", "B", ""), ("context", "N", "")]
    sections = [
        (
            stage_rows,
            "DS stages, CUDA-graph timed (topk: kernels.topk; topk_torch: torch.topk):",
            shape
            + [
                ("impl", "impl", ""),
                ("label_scores", "scores ms", ".4f"),
                ("topk", "topk ms", ".4f"),
                ("topk_torch", "torch.topk ms", ".4f"),
                ("topk_sorted", "sorted ms", ".4f"),
                ("attention", "attention ms", ".4f"),
            ],
        ),
        (
            label_rows,
            "label scores (GQA-summed, row lengths) by launch configuration, CUDA-graph timed:",
            shape
            + [
                ("r", "r", ""),
                ("bits", "bits", ""),
                ("block_n", "BLOCK_N", ""),
                ("num_warps", "warps", ""),
                ("ms", "ms", ".4f"),
                ("gbps", "GB/s", ".0f"),
            ],
        ),
        (
            topk_rows,
            "top-k of N/16 per row, rows [B, 8, N] fp32:",
            shape
            + [
                ("impl", "impl", ""),
                ("radix_bits", "radix bits", ""),
                ("block_n", "BLOCK_N", ""),
                ("num_warps", "warps", ""),
                ("atomic_from", "atomics from pass", ""),
                ("ms", "ms", ".4f"),
            ],
        ),
        (
            tune_rows,
            "sparse attention launch configurations (N/16 random indices):",
            shape
            + [
                ("gqa", "selection", ""),
                ("block_n", "BLOCK_N", ""),
                ("num_warps", "warps", ""),
                ("num_stages", "stages", ""),
                ("splits", "splits", ""),
                ("ms", "ms", ".4f"),
                ("gbps", "GB/s", ".0f"),
            ],
        ),
    ]
    for sec_rows, title, cols in sections:
        if sec_rows:
            print("\n" + title)
            table += "\n" + print_table(sec_rows, cols)
    (args.out / "kernels.txt").write_text(table + "\n")
    best = {}
    for r in rows:
        if "speedup_vs_sdpa" in r:
            key = r["impl"].split("_")[0]
            if key not in best or r["speedup_vs_sdpa"] > best[key]["speedup_vs_sdpa"]:
                best[key] = r
    for key, r in best.items():
        print(f"best {key}: {r['impl']} at B={r['batch']} N={r['context']}: {r['speedup_vs_sdpa']:.2f}x sdpa")
    print(f"wrote {path}" + (f" and {png}" if png else ""))
    return payload


if __name__ == "__main__":
    main()
