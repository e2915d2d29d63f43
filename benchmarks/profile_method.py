"""Where a method's accuracy path spends its time: torch.profiler over a few decode steps.

python benchmarks/profile_method.py --model llama3_8b_random --context 16384 --method magicpig
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_accuracy_path import build_model, time_decode  # noqa: E402
from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache  # noqa: E402
from sparse_eval.methods import build_method, make_config  # noqa: E402
from sparse_eval.models.inspection import head_shape  # noqa: E402
from sparse_eval.run.run_config import method_options  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--method", default="magicpig", help="one method or a comma-separated list (one model load)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--error", action="store_true")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, args.layers)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context)).to(device)
    cache = make_cache(model)
    with torch.inference_mode():
        first = (
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        )
    for name in [m for m in args.method.split(",") if m]:
        profile_one(name, model, cache, first, args, device)


def profile_one(name, model, cache, first, args, device) -> None:
    opts = method_options(name)
    n_layers = model.config.num_hidden_layers
    opts["dense_layers"] = [i for i in opts.get("dense_layers", []) if isinstance(i, str) or i < n_layers] or [0]
    if name == "double_sparsity":
        shape = head_shape(model.config)
        opts["channels"] = [list(range(shape.head_dim))] * shape.heads
    method = build_method(make_config(name, opts))
    method.setup(model, args.model)
    attach(model, method, Runtime(protocol="A", compute_error=args.error))
    time_decode(model, cache, args.context, first, 2, device)
    acts = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else []
    )
    prof = torch.profiler.profile(activities=acts)
    ms = time_decode(model, cache, args.context, first, args.steps, device, around=prof)  # the steady steps only
    detach(model)
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    line = f"{name}: {ms:.2f} ms/step"
    if device.type == "cuda":  # device-side work per step: kernels (and copies/memsets) and how many launches
        dev = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = sum(e.time_range.elapsed_us() for e in dev) / 1e3 / args.steps
        line += f"; GPU busy {busy:.2f} ms/step in {len(dev) / args.steps:.0f} kernels/copies per step"
    print(line)
    print(prof.key_averages().table(sort_by=key, row_limit=args.rows))


if __name__ == "__main__":
    main()
