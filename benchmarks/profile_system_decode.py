"""Where a system-path decode step spends its time: torch.profiler over a few decode steps of one method, the
top kernels by GPU time and the top operators by CPU time (for finding what a step is bound by).

    python benchmarks/profile_system_decode.py --method ds --context 16384 --batch 48
    python benchmarks/profile_system_decode.py --methods ds --batches 45 --cuda-graph --steps 20   # captured step
    python benchmarks/profile_system_decode.py --methods magicpig_10_150 --batches 14 --phases --steps 8

With ``--cuda-graph`` the steps replay one CUDA graph; the kernels of the replays are listed like eager ones (the
prefill's kernels are in the same table: use many steps and read the decode kernels per step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_system_decode import method_config  # noqa: E402
from sparse_eval.methods.registry import build_method  # noqa: E402
from sparse_eval.system import DecodeOptions, decode  # noqa: E402
from sparse_eval.system.models import SHAPES, random_model  # noqa: E402


def _sync_debug(model, method, ids, batch) -> None:
    """Runs 3 decode steps with CUDA sync debugging on and prints each distinct synchronising call site."""
    import traceback
    import warnings

    seen: dict[str, int] = {}

    def show(message, category, filename, lineno, file=None, line=None):
        stack = "".join(traceback.format_stack(limit=8)[:-2])
        seen[stack] = seen.get(stack, 0) + 1

    old = warnings.showwarning
    warnings.showwarning = show
    warnings.simplefilter("always")
    torch.cuda.set_sync_debug_mode("warn")
    try:
        decode(model, method, ids, 4, DecodeOptions(repeat_batch=batch))
    finally:
        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
    for stack, count in sorted(seen.items(), key=lambda kv: -kv[1])[:6]:
        print(f"--- {count} synchronising calls from:\n{stack}")


def _phases(model, method, ids, batch, steps, label) -> None:
    """Untimed-phase run (for the step time) and a phase-timed run of the same decode; prints ms per step."""
    plain = decode(model, method, ids, steps, DecodeOptions(repeat_batch=batch))
    timed = decode(model, method, ids, steps, DecodeOptions(repeat_batch=batch, phase_times=True))
    n = timed.stats["phase_steps"]
    ms = {k: v / n for k, v in timed.stats["phase_ms"].items()}
    step_plain = statistics.median(plain.step_ms[1:])
    step_timed = statistics.median(timed.step_ms[1:])
    print(
        f"== {label}: ms per step (median of {len(plain.step_ms) - 1} steady steps) {step_plain:.1f} untimed, "
        f"{step_timed:.1f} with the phase brackets"
    )
    for k, v in sorted(ms.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v:8.2f} ms  {100 * v / step_timed:5.1f} %")
    rest = step_timed - sum(ms.values())
    print(f"  {'rest of the step (model, dense layers)':40s} {rest:8.2f} ms  {100 * rest / step_timed:5.1f} %")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="llama3_1_8b", choices=sorted(SHAPES))
    ap.add_argument("--methods", default="full,ds")
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--batches", default="8,48")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--num-layers", type=int, default=None)
    ap.add_argument("--rows", type=int, default=14)
    ap.add_argument("--cuda-graph", action="store_true", help="decode with the captured static step")
    ap.add_argument(
        "--phases",
        action="store_true",
        help="print the per-step wall time of the phases a layer brackets "
        "(MagicPIG: GPU part, codes to the host, CPU sampling, CPU attention, merge; decode(phase_times="
        "True)) and the rest of the step, instead of profiling",
    )
    ap.add_argument(
        "--sync-debug",
        action="store_true",
        help="print where a decode step synchronises with the GPU "
        "(torch.cuda.set_sync_debug_mode) instead of profiling",
    )
    a = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = random_model(a.shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, num_layers=a.num_layers)
    shape = SHAPES[a.shape]
    ids = torch.randint(0, shape["vocab_size"], (1, a.context), generator=torch.Generator().manual_seed(0))
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else []
    )
    for name in a.methods.split(","):
        for b in (int(x) for x in a.batches.split(",")):
            cfg = method_config(name, model.config.num_hidden_layers, shape["num_key_value_heads"], shape["head_dim"])
            m = build_method(cfg)
            m.setup(model, a.shape)
            decode(model, m, ids, 3, DecodeOptions(repeat_batch=b, cuda_graph=a.cuda_graph))  # warm-up (compilation)
            if a.sync_debug:
                _sync_debug(model, m, ids, b)
                continue
            if a.phases:
                _phases(model, m, ids, b, a.steps, f"{name} context {a.context} batch {b}")
                continue
            with torch.profiler.profile(activities=acts) as prof:
                res = decode(model, m, ids, a.steps, DecodeOptions(repeat_batch=b, cuda_graph=a.cuda_graph))
            print(f"== {name} context {a.context} batch {b}: step ms {[round(x, 2) for x in res.step_ms]}")
            key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=a.rows, max_name_column_width=60))
            if dev.type == "cuda":
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=60))
            torch.cuda.empty_cache() if dev.type == "cuda" else None
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
