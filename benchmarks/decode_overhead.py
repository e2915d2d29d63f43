"""Per-step overhead of the accuracy path's decode: aten ops and ms per greedy step through the plug-in, per method,
beside stock transformers sdpa on the same cache; and the harness's batched generation loop (``Engine``) beside
``model.generate`` at the same batch.

    python benchmarks/decode_overhead.py --model stories260k --context 448 --methods full,topk,quest
    python benchmarks/decode_overhead.py --model llama3_8b_random --layers 2 --dense-layers 0 --context 1024 \
        --loop-batch 0

``ops/step`` counts the top-level ``aten::`` ops the CPU profiler records per decode step (those not called from
inside another aten op: the calls Python makes, close to the kernels a GPU step launches).  ``ms/step``: median over
``--repeats`` of ``--steps`` steps, no profiler.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_accuracy_path import build_model, time_decode  # noqa: E402
from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache  # noqa: E402
from sparse_eval.methods import build_method, make_config  # noqa: E402
from sparse_eval.models.inspection import head_shape  # noqa: E402
from sparse_eval.run.run_config import method_options  # noqa: E402


def make_method(name: str, model, model_name: str, dense_layers: list[int] | None = None):
    opts = method_options(name)
    n_layers = model.config.num_hidden_layers
    opts["dense_layers"] = [i for i in opts.get("dense_layers", []) if isinstance(i, str) or i < n_layers] or [0]
    if dense_layers is not None:
        opts["dense_layers"] = dense_layers
    if name == "double_sparsity" and model_name != "stories260k":
        shape = head_shape(model.config)
        opts["channels"] = [list(range(shape.head_dim))] * shape.heads
    method = build_method(make_config(name, opts))
    method.setup(model, model_name)
    return method


def _op_names(prof) -> collections.Counter:
    """The top-level aten ops of a profile (not called from inside another aten op), by name."""

    def top(e):
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        return p is None

    return collections.Counter(e.name for e in prof.events() if e.name.startswith("aten::") and top(e))


def _top_level_ops(prof) -> int:
    return sum(_op_names(prof).values())


def count_ops(model, cache, context, first, steps, device) -> tuple[float, collections.Counter]:
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
    time_decode(model, cache, context, first, steps, device, around=prof)  # the steady steps only
    names = _op_names(prof)
    return sum(names.values()) / steps, names


def step_times(model, cache, context, first, steps, repeats, device) -> float:
    time_decode(model, cache, context, first, 2, device)
    return statistics.median(time_decode(model, cache, context, first, steps, device) for _ in range(repeats))


def loop_vs_generate(
    model, batch: int, prompt: int, new: int, repeats: int, device, invariant: bool = True
) -> dict[str, float]:
    """ms per generated step: ``Engine.generate_batch`` with full attention attached vs ``model.generate`` (sdpa);
    ``invariant``: the Engine's batch-invariant evaluation mode (``Runtime.batch_invariant``, a run's default)."""
    from sparse_eval.generation.engine import Engine, GenerationRequest

    g = torch.Generator().manual_seed(1)
    lens = [prompt - 3 * i for i in range(batch)]  # ragged, left padded
    prompts = [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lens]
    reqs = [GenerationRequest(p, max_new_tokens=new, stop_token_ids=[], key=str(i)) for i, p in enumerate(prompts)]

    class _Tok:
        pad_token_id = 0

        def decode(self, ids, skip_special_tokens=True):
            return " ".join(map(str, ids))

    session = attach(model, make_method("full", model, ""), Runtime(protocol="A", batch_invariant=invariant))
    engine = Engine(model, _Tok(), session)
    engine.generate_batch(reqs[:2])
    ops = {}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.generate_batch(reqs)
    ops["engine_ops_per_token"] = _top_level_ops(prof) / new
    t_engine = []
    for _ in range(repeats):
        session.recorder.reset()
        t0 = time.perf_counter()
        engine.generate_batch(reqs)
        t_engine.append((time.perf_counter() - t0) * 1000 / new)
    detach(model)
    model.set_attn_implementation("sdpa")
    ids = torch.zeros(batch, max(lens), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, -len(p) :] = torch.tensor(p)
        mask[i, -len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    t_gen = []
    with torch.inference_mode():
        model.generate(input_ids=ids[:2], attention_mask=mask[:2], **kw)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            model.generate(input_ids=ids, attention_mask=mask, **kw)
        ops["generate_ops_per_token"] = _top_level_ops(prof) / new
        for _ in range(repeats):
            t0 = time.perf_counter()
            model.generate(input_ids=ids, attention_mask=mask, **kw)
            t_gen.append((time.perf_counter() - t0) * 1000 / new)
    return {"engine_ms_per_step": statistics.median(t_engine), "generate_ms_per_step": statistics.median(t_gen), **ops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--methods", default="full,topk,quest,double_sparsity,oracle")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--error", choices=("on", "off"), default="on")
    ap.add_argument(
        "--dense-layers",
        default=None,
        help="comma-separated dense layers for every method (default: each method's config, capped to the model)",
    )
    ap.add_argument("--top", type=int, default=0, help="print the N most frequent ops per method")
    ap.add_argument("--loop-batch", type=int, default=16, help="batch of the Engine-vs-generate comparison (0: skip)")
    ap.add_argument("--loop-prompt", type=int, default=128)
    ap.add_argument("--loop-new", type=int, default=32)
    ap.add_argument(
        "--loop-invariance",
        choices=("on", "off", "both"),
        default="both",
        help="the Engine's batch-invariant mode in the comparison (on: a run's default; stock generate has none)",
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = build_model(args.model, device, torch.bfloat16 if device.type == "cuda" else torch.float32, args.layers)
    ids = torch.randint(3, model.config.vocab_size, (1, args.context), generator=torch.Generator().manual_seed(0)).to(
        device
    )
    cache = make_cache(model)
    with torch.inference_mode():
        first = (
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)
        )
    print(f"{args.model} layers={model.config.num_hidden_layers} context={args.context} est_error={args.error}")
    print(f"{'method':18s} {'aten ops/step':>14s} {'ms/step':>9s}")
    rows = [("stock sdpa", None)] + [(m, m) for m in args.methods.split(",") if m]
    for label, name in rows:
        if name is None:
            detach(model)
            model.set_attn_implementation("sdpa")
        else:
            dense = [int(i) for i in args.dense_layers.split(",")] if args.dense_layers else None
            attach(
                model,
                make_method(name, model, args.model, dense),
                Runtime(protocol="A", compute_error=args.error == "on"),
            )
        ms = step_times(model, cache, args.context, first, args.steps, args.repeats, device)
        ops, names = count_ops(model, cache, args.context, first, 4, device)
        print(f"{label:18s} {ops:14.0f} {ms:9.3f}", flush=True)
        if args.top:
            for op, n in names.most_common(args.top):
                print(f"    {n / 4:8.1f} {op}")
        detach(model)
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.loop_invariance] if args.loop_batch else ()
    for inv in modes:
        r = loop_vs_generate(model, args.loop_batch, args.loop_prompt, args.loop_new, args.repeats, device, inv)
        print(
            f"batch {args.loop_batch}, prompt ~{args.loop_prompt}, {args.loop_new} new tokens, invariance "
            f"{'on ' if inv else 'off'}: Engine (full) "
            f"{r['engine_ms_per_step']:.2f} ms/step, model.generate {r['generate_ms_per_step']:.2f} ms/step "
            f"(generate / Engine = {r['generate_ms_per_step'] / r['engine_ms_per_step']:.2f}x); aten ops per token "
            f"(prefill included): Engine {r['engine_ops_per_token']:.0f}, generate {r['generate_ops_per_token']:.0f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
