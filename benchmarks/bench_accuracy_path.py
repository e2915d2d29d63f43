"""Accuracy-path speed: decode wall time of each method relative to full attention, same model and inputs.

The accuracy path is what `python -m sparse_eval` runs (the shared masked attention of ``methods/core.py`` plus
each method's selection).  For every method this prefills one context densely (protocol A), then times
``--steps`` greedy decode steps with the method attached, with the estimation error on (the default of a run)
and off.  The timed steps are the steady state: the first decode step after the prefill, in which a method
builds its index over the prefilled keys (MagicPIG's hash tables, Quest's page bounds, DS's label cache; once
per batch in a run), runs untimed before them and is timed on its own (``first_step_ms``).  The same prefilled
cache (a ``SparseCache``, which appends in place) is reused for every method (cropped back after each), and full
attention is timed in the same process as the baseline, as is stock transformers (sdpa, no plug-in, its own
``DynamicCache``, prefilled once more: method ``stock``).  Medians over ``--repeats``.
With ``--profile``, one more pass of ``--steps`` steady steps per method runs under torch.profiler and gives,
per step, the GPU's busy time (the sum of its kernels' and copies' durations: what the step would take if nothing
but the device's work remained, i.e. the floor of a CUDA-graph capture that keeps the same kernels), the number
of kernels and copies launched, the host syncs (``SYNC_EVENTS``: ``.item()``/``bool()`` of a tensor,
``torch.equal``, ``nonzero``, an explicit synchronize) and the kernels that take the most time.  The dense
prefill of the batch is timed too (``prefill_ms``, stock sdpa, ``--prefill-chunk`` tokens per forward, median over
``--repeats``): with the per-step times it is what ``benchmarks/project_ruler_hours.py`` projects a RULER
evaluation's GPU-hours from.
With ``--capture`` (GPU only), each plug-in method's steady step is also captured once in a CUDA graph and
replayed (``captured_ms_per_step``): the same kernels without the host's launch work, the measured counterpart of
the profile's GPU busy time; a step that waits for the device cannot be captured and is reported with the reason.
With ``--batch-invariant`` the prefill and every plug-in method's steps run inside ``batch_invariant()``, the mode a
run evaluates in by default (``eval.batch_invariant``: fixed-order products and reductions, so a record does not
depend on its batch); stock transformers is timed outside it either way.
With ``--fused both`` (the default) every plug-in method that declares ``Method.fused_attention`` is timed twice in
the same round-robin, with ``eval.fused_attention=on`` (its attention over the selection and the statistics from
``kernels.selected_attention``: rows labelled ``name [fused]``) and ``off`` (the torch ops of ``methods.core``), and the
ratios to full attention are printed for both; ``--fused on`` / ``off`` times one of them.  Without CUDA the fused
variants run only in Triton's interpreter (``TRITON_INTERPRET=1``) and are otherwise skipped.  With ``--time-limit``
a repeat (or the profile) that would end past the limit is not started and the record holds the repeats done: at the
8B shape, batch 8, 16K, ``--fused both``, a call cut at 320 s on an H200 had finished 3 repeats of the default methods.

    python benchmarks/bench_accuracy_path.py --model stories260k --context 448 --out experiments/accuracy_path_speed
    python benchmarks/bench_accuracy_path.py --model llama3_8b_random --context 16384 --out $OUT   # GPU machine
    python benchmarks/bench_accuracy_path.py --model llama3_8b_random --context 16384 --batch 8 --batch-invariant \
        --fused both --repeats 5 --out $OUT    # fused on and off in one process, the mode a run uses
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache  # noqa: E402
from sparse_eval.kernels._common import triton_available, triton_interpret  # noqa: E402
from sparse_eval.methods import build_method, make_config  # noqa: E402
from sparse_eval.models.inspection import head_shape  # noqa: E402
from sparse_eval.identity.provenance import hardware, versions  # noqa: E402
from sparse_eval.run.run_config import method_options  # noqa: E402
from sparse_eval.spans import PREFIX as SPAN_PREFIX  # noqa: E402
from sparse_eval.system.models import random_model  # noqa: E402


def build_model(name: str, device: torch.device, dtype: torch.dtype, layers: int | None):
    from transformers import AutoModelForCausalLM

    if name == "stories260k":
        model = AutoModelForCausalLM.from_pretrained(REPO / "sparse_eval/models/stories260K", dtype=dtype)
        return model.to(device).eval()
    if name == "llama3_8b_random":  # the system path's Llama-3.1-8B shape (sparse_eval/system/models.py)
        return random_model("llama3_1_8b", device, dtype, num_layers=layers or None, seed=0)
    raise ValueError(f"--model {name!r}; valid: stories260k, llama3_8b_random")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _crop(cache, prefill_len: int) -> None:
    """Back to the ``prefill_len`` prefilled tokens (the cache is shared by every method and repetition)."""
    extra = cache.get_seq_length() - prefill_len
    if extra > 0:
        cache.crop(-extra)  # transformers 5: a negative count removes that many tokens


def _prefill(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """Last position's logits after feeding ``ids`` [B, N] into ``cache`` ``chunk`` tokens at a time (the same cache
    as one pass: attention is causal; a chunk bounds the MLP's [B, chunk, d_ff] activations, which at batch 8 x 16K
    do not fit an 80 GB card in one pass)."""
    logits = None
    for start in range(0, ids.shape[1], chunk or ids.shape[1]):
        part = ids[:, start : start + (chunk or ids.shape[1])]
        logits = model(input_ids=part, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1]
    return logits


def _step(model, cache, tok: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=tok, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache)).logits[:, -1]
    return logits.argmax(-1, keepdim=True)


@torch.inference_mode()
def time_first_step(model, cache, prefill_len: int, first_token: torch.Tensor, device) -> float:
    """ms of the first decode step after the prefill: the step in which a method builds its index over the
    prefilled keys (MagicPIG's hash tables, Quest's page bounds, DS's label cache), once per batch in a run."""
    _crop(cache, prefill_len)
    sync(device)
    t0 = time.perf_counter()
    _step(model, cache, first_token)
    sync(device)
    return (time.perf_counter() - t0) * 1000.0


@torch.inference_mode()
def time_decode(model, cache, prefill_len: int, first_token: torch.Tensor, steps: int, device, around=None) -> float:
    """ms per decode step in the steady state, greedy: from a cache holding ``prefill_len`` tokens, one untimed
    first step (which builds the method's index, ``time_first_step``), then ``steps`` timed steps, inside the
    context manager ``around`` if given (e.g. a profiler, so that it sees the steady steps only)."""
    _crop(cache, prefill_len)
    tok = _step(model, cache, first_token)
    sync(device)
    with around if around is not None else contextlib.nullcontext():
        t0 = time.perf_counter()
        for _ in range(steps):
            tok = _step(model, cache, tok)
        sync(device)
        ms = (time.perf_counter() - t0) * 1000.0 / steps
    return ms


# what waits for the device: a tensor read on the host (``.item()``, ``bool()``, ``int()``), ``torch.equal``, a
# data-dependent shape (``nonzero``), an explicit synchronize; counted where no enclosing event already counted it
SYNC_EVENTS = (
    "aten::_local_scalar_dense",
    "aten::is_nonzero",
    "aten::equal",
    "aten::nonzero",
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
)


def _aten_parent(e) -> bool:
    """Whether an enclosing event is an aten operator (the event is then part of it, not a call of its own)."""
    return e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::")


def _host_syncs(events) -> int:
    """Sync events (``SYNC_EVENTS``) with no sync event among their ancestors."""
    count = 0
    for e in events:
        if e.name not in SYNC_EVENTS:
            continue
        parent = e.cpu_parent
        while parent is not None and parent.name not in SYNC_EVENTS:
            parent = parent.cpu_parent
        count += parent is None
    return count


def _span_ms(events, cuda: bool, steps: int) -> dict[str, float]:
    """ms per step inside each of the accuracy path's spans (``sparse_eval.spans``: prepare, masks, scores,
    select, attend, stats, error, record), summed over layers: on a GPU the device time of the kernels launched
    inside the span, on a CPU the host time spent in it."""
    out: dict[str, float] = {}
    for e in events:
        if e.name.startswith(SPAN_PREFIX) and e.device_type == torch.autograd.DeviceType.CPU:
            us = e.device_time_total if cuda else e.cpu_time_total
            key = e.name[len(SPAN_PREFIX) :]
            out[key] = out.get(key, 0.0) + us / 1e3 / steps
    return dict(sorted(out.items()))


def device_work(events) -> list:
    """The kernels and copies of a profile: its device events without the spans' own ranges.  A span
    (``record_function``) is mirrored on the device timeline as an annotation from the first to the last kernel
    launched inside it; counted as work, it would count those kernels twice, and the gaps between them."""
    return [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith(SPAN_PREFIX)]


def profile_methods(
    model, cache, stock_cache, args, first, device, methods, mode=lambda method: contextlib.nullcontext()
) -> dict[tuple[str, bool], dict]:
    """Per (method, error on): one profiled pass of ``--steps`` steps (after a 1-step warm-up), reduced to per-step
    figures: wall ms (under the profiler), GPU busy ms, kernels and copies launched, host syncs, and the ten
    kernels with the most device time (name, ms per step, launches per step).  On a CPU: the host syncs a GPU
    would see (the same calls) and the aten operators per step, no device figures."""
    cuda = device.type == "cuda"
    out: dict[tuple[str, bool], dict] = {}
    for name, method, fused in methods:
        for err in (False,) if method is None else (True, False):
            if method is not None:
                attach(model, method, Runtime(protocol="A", compute_error=err, fused_attention=fused))
            c = stock_cache if method is None else cache
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
            prof = torch.profiler.profile(activities=acts)
            with mode(method):
                time_decode(model, c, args.context, first, 1, device)
                wall = time_decode(model, c, args.context, first, args.steps, device, around=prof)
            if method is not None:
                detach(model)
            events = list(prof.events())
            syncs = _host_syncs(events) / args.steps
            spans = _span_ms(events, cuda, args.steps)
            if not cuda:
                ops = [e for e in events if e.name.startswith("aten::") and not _aten_parent(e)]
                out[(name, err)] = {
                    "profiled_ms_per_step": wall,
                    "host_syncs_per_step": syncs,
                    "aten_ops_per_step": len(ops) / args.steps,
                    "span_host_ms_per_step": spans,
                }
                continue
            dev = device_work(events)
            per_kernel: dict[str, list[float]] = {}
            for e in dev:
                per_kernel.setdefault(e.name, []).append(e.time_range.elapsed_us() / 1e3)
            top = sorted(per_kernel.items(), key=lambda kv: -sum(kv[1]))[:10]
            out[(name, err)] = {
                "profiled_ms_per_step": wall,
                "gpu_busy_ms": sum(e.time_range.elapsed_us() for e in dev) / 1e3 / args.steps,
                "kernels_per_step": len(dev) / args.steps,
                "host_syncs_per_step": syncs,
                "span_gpu_ms_per_step": spans,
                "top_kernels": [
                    {"name": k[:120], "ms_per_step": sum(v) / args.steps, "launches_per_step": len(v) / args.steps}
                    for k, v in top
                ],
            }
    return out


def _end_generator_capture() -> None:
    """After a capture that failed midway: the default CUDA generator back to eager use.  ``capture_end`` raises
    before it ends the generator's capture, which leaves it marked as capturing, so that any later random draw
    outside a graph fails ("Offset increment outside graph capture").  Its state replaced by a clone of itself (same
    seed and offset, not capturing) ends that."""
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    gen.graphsafe_set_state(gen.clone_state())


@torch.inference_mode()
def time_captured(model, cache, prefill_len: int, first_token: torch.Tensor, steps: int) -> float | str:
    """ms per steady decode step replayed from a CUDA graph (``torch.cuda.CUDAGraph``): the step with the host's
    launch work removed, the same kernels as the eager step.  From a cache of ``prefill_len`` tokens: the first
    step (the method's index), two warm-up steps on a side stream (as capture requires), one step captured, then
    ``steps`` replays timed.  Each replay redoes the captured step (the same cache slot, the same context length),
    which is what a step at that length costs.  A step that cannot be captured (a host sync, a host-to-device copy
    of a host value) gives the reason as a string instead of a time."""
    _crop(cache, prefill_len)
    tok = _step(model, cache, first_token)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    synced = None
    with torch.cuda.stream(side):
        tok = _step(model, cache, tok)
        # the second warm-up step under CUDA's sync detector: a step that waits for the device is reported here,
        # before any capture starts (a capture that fails midway leaves the CUDA generator marked as capturing)
        torch.cuda.set_sync_debug_mode("error")
        try:
            tok = _step(model, cache, tok)
        except RuntimeError as exc:
            synced = exc
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    if synced is not None:
        return f"not capturable: waits for the device: {str(synced).splitlines()[0][:200]}"
    graph = torch.cuda.CUDAGraph()
    static_tok = tok.clone()
    try:
        with torch.cuda.graph(graph):
            _step(model, cache, static_tok)
        torch.cuda.synchronize()
    except Exception as exc:  # noqa: BLE001 - the reason is the result
        torch.cuda.synchronize()
        _end_generator_capture()
        return f"not capturable: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    graph.replay()  # untimed: the first replay uploads the graph
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        graph.replay()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1000.0 / steps
    del graph
    return ms


def capture_methods(
    model, cache, args, first, methods, mode=lambda method: contextlib.nullcontext()
) -> dict[tuple[str, bool], dict]:
    """Per (method, error on), plug-in methods only: ``time_captured``'s ms per step (median over ``--repeats``)
    or why the step could not be captured."""
    out: dict[tuple[str, bool], dict] = {}
    for name, method, fused in methods:
        if method is None:
            continue
        for err in (True, False):
            attach(model, method, Runtime(protocol="A", compute_error=err, fused_attention=fused))
            results = []
            try:
                with mode(method):
                    for _ in range(max(1, args.repeats)):
                        results.append(time_captured(model, cache, args.context, first, args.steps))
                        if isinstance(results[-1], str):
                            break
            finally:
                detach(model)
            times = [r for r in results if not isinstance(r, str)]
            out[(name, err)] = (
                {"captured_ms_per_step": statistics.median(times)}
                if len(times) == len(results)
                else {"captured": results[-1]}
            )
            print(f"captured {name:16s} error={'on ' if err else 'off'} {out[(name, err)]}")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="stories260k")
    ap.add_argument("--context", type=int, default=448)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=None, help="override the number of layers (random models)")
    ap.add_argument(
        "--methods",
        default="stock,full,topk,oracle,magicpig,quest,double_sparsity",
        help="conf/method names; 'stock' = transformers' own attention, no plug-in",
    )
    ap.add_argument("--dtype", default="auto")
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=4096,
        help="prefill this many tokens per forward (0: all at once); bounds the MLP's activations",
    )
    ap.add_argument("--profile", action="store_true", help="also profile --steps steps per method (GPU busy time)")
    ap.add_argument(
        "--capture",
        action="store_true",
        help="also time each plug-in method's steady step replayed from a CUDA graph (GPU only; a step that "
        "cannot be captured says why)",
    )
    ap.add_argument(
        "--batch-invariant",
        action="store_true",
        help="time the plug-in's methods and the prefill inside batch_invariant() (a run's default mode); "
        "stock transformers stays outside it",
    )
    ap.add_argument(
        "--fused",
        choices=("both", "on", "off"),
        default="both",
        help="eval.fused_attention of the plug-in's sparse methods: time each method with the fused kernel and "
        "without (both, rows 'name [fused]'), or one of them; a method without Method.fused_attention runs off",
    )
    ap.add_argument(
        "--time-limit",
        type=float,
        default=0.0,
        help="seconds (0: none): start no repeat, profile or capture that would end past it, and write the record "
        "with the repeats done (``repeats_done``), so a call with a hard limit still leaves its figures",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    from sparse_eval.invariance import batch_invariant

    def mode(method=True):
        """The evaluation mode a plug-in method (and the prefill) is timed in; ``None``: stock, always plain."""
        return batch_invariant() if args.batch_invariant and method is not None else contextlib.nullcontext()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.capture and device.type != "cuda":
        raise SystemExit("--capture needs a CUDA device (CUDA graphs): run it on a GPU machine, or leave it out")
    dtype = {
        "auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
    }[args.dtype]
    model = build_model(args.model, device, dtype, args.layers)
    n_layers = model.config.num_hidden_layers
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (args.batch, args.context), generator=g).to(device)
    prefill_ms = []
    for _ in range(max(1, args.repeats)):
        cache = make_cache(model)
        sync(device)
        t0 = time.perf_counter()
        with torch.inference_mode(), mode():
            logits = _prefill(model, ids, cache, args.prefill_chunk)
        sync(device)
        prefill_ms.append((time.perf_counter() - t0) * 1000.0)
    first = logits.argmax(-1, keepdim=True)
    print(
        f"prefill {args.batch} x {args.context}: {statistics.median(prefill_ms):.1f} ms (median of {len(prefill_ms)})"
    )
    # stock transformers decodes from its own DynamicCache (a copy of the whole cache per step); the plug-in's
    # methods from a SparseCache (appends in place)
    stock_cache = None
    if "stock" in args.methods.split(","):
        from transformers.cache_utils import DynamicCache

        stock_cache = DynamicCache()
        with torch.inference_mode():
            _prefill(model, ids, stock_cache, args.prefill_chunk)

    # (label, method, eval.fused_attention): the fused variant of a method that declares the capability is a
    # method of its own in the round-robin ("name [fused]")
    settings = {"both": ("off", "on"), "on": ("on",), "off": ("off",)}[args.fused]
    fused_runs = device.type == "cuda" or triton_interpret()
    if "on" in settings and not (fused_runs and triton_available()):
        print("fused variants skipped: they need CUDA (or TRITON_INTERPRET=1) and triton")
        settings = ("off",)
    methods = []
    for name in [m for m in args.methods.split(",") if m]:
        if name == "stock":
            methods.append((name, None, "off"))
            continue
        opts = method_options(name)
        opts["dense_layers"] = [i for i in opts.get("dense_layers", []) if isinstance(i, str) or i < n_layers] or [0]
        if opts["name"] == "magicpig" and n_layers < 16:
            opts["dense_layers"] = [0, n_layers // 2]
        if opts["name"] == "double_sparsity" and args.model != "stories260k":
            # a random-weight model has no calibration file: give every head channels 0..d-1 in order
            shape = head_shape(model.config)
            opts["channels"] = [list(range(shape.head_dim))] * shape.heads
        try:
            method = build_method(make_config(opts["name"], opts))
            method.setup(model, args.model)
        except (ValueError, TypeError, FileNotFoundError) as exc:
            print(f"skip {name}: {exc}")
            continue
        for fused in settings if (method.fused_attention and not method.dense) else ("off",):
            methods.append((f"{name} [fused]" if fused == "on" else name, method, fused))

    # round-robin over methods, so drift of the machine does not favour whichever ran first
    times: dict[tuple[str, bool], list[float]] = {}
    first_times: dict[tuple[str, bool], list[float]] = {}
    stats: dict[tuple[str, bool], dict] = {}
    repeats_done, rep_s = 0, 0.0
    for rep in range(args.repeats):
        elapsed = time.perf_counter() - started
        if args.time_limit and rep > 0 and elapsed + rep_s > args.time_limit:
            print(f"--time-limit {args.time_limit:g} s: stopping after {rep} repeats ({elapsed:.0f} s)")
            break
        t_rep = time.perf_counter()
        for name, method, fused in methods:
            for err in (False,) if method is None else (True, False):
                rt = Runtime(protocol="A", compute_error=err, fused_attention=fused)
                session = None if method is None else attach(model, method, rt)
                c = stock_cache if method is None else cache
                with mode(method):
                    if rep == 0:
                        time_decode(model, c, args.context, first, 2, device)  # warm-up
                    if session is not None:
                        session.recorder.reset()
                    ms = time_decode(model, c, args.context, first, args.steps, device)
                    first_ms = time_first_step(model, c, args.context, first, device)
                times.setdefault((name, err), []).append(ms)
                first_times.setdefault((name, err), []).append(first_ms)
                # each measurement as it is taken: a run stopped at a time limit still shows what it measured
                print(f"  repeat {rep} {name:24s} error={'on ' if err else 'off'} {ms:9.3f} ms/step", flush=True)
                stats[(name, err)] = session.recorder.summary() if session is not None else {}
                if session is not None:
                    detach(model)
        repeats_done, rep_s = rep + 1, time.perf_counter() - t_rep

    def in_time(what: str) -> bool:
        """Whether ``what`` (about one repeat's time) still ends within --time-limit."""
        ok = not args.time_limit or time.perf_counter() - started + rep_s <= args.time_limit
        if not ok:
            print(f"--time-limit {args.time_limit:g} s: {what} skipped")
        return ok

    profiles = (
        profile_methods(model, cache, stock_cache, args, first, device, methods, mode)
        if args.profile and in_time("--profile")
        else {}
    )
    captured = (
        capture_methods(model, cache, args, first, methods, mode) if args.capture and in_time("--capture") else {}
    )
    rows = []
    fused_of = {label: fused == "on" for label, _, fused in methods}
    for (name, err), ts in times.items():
        summ = stats[(name, err)]
        rows.append(
            {
                "method": name,
                "fused_attention": fused_of[name],
                "est_error_on": err,
                "ms_per_step": statistics.median(ts),
                "all_ms": ts,
                "first_step_ms": statistics.median(first_times[(name, err)]),
                "cost2": summ.get("cost2"),
                "est_error": summ.get("est_error"),
                "mass": summ.get("mass"),
                **profiles.get((name, err), {}),
                **captured.get((name, err), {}),
            }
        )
        print(
            f"{name:24s} error={'on ' if err else 'off'} {statistics.median(ts):9.3f} ms/step  "
            f"first step {statistics.median(first_times[(name, err)]):9.3f} ms  cost2={summ.get('cost2')}"
        )
    base = {r["est_error_on"]: r["ms_per_step"] for r in rows if r["method"] == "full"}
    busy = {r["est_error_on"]: r.get("gpu_busy_ms") for r in rows if r["method"] == "full"}
    cap = {r["est_error_on"]: r.get("captured_ms_per_step") for r in rows if r["method"] == "full"}
    for r in rows:
        r["ratio_vs_full"] = r["ms_per_step"] / base[r["est_error_on"]] if base else None
        if r.get("gpu_busy_ms") is not None and busy.get(r["est_error_on"]):
            r["busy_ratio_vs_full"] = r["gpu_busy_ms"] / busy[r["est_error_on"]]
        if r.get("captured_ms_per_step") is not None and cap.get(r["est_error_on"]):
            r["captured_ratio_vs_full"] = r["captured_ms_per_step"] / cap[r["est_error_on"]]
    if captured:
        print("\nmethod           error  ms/step  captured ms/step  captured / full's captured")
        for r in rows:
            if r["method"] != "stock":
                c = r.get("captured_ms_per_step")
                ratio = r.get("captured_ratio_vs_full") or float("nan")
                tail = f"{c:16.2f}  {ratio:26.2f}" if c else r.get("captured", "")
                print(f"{r['method']:16s} {'on ' if r['est_error_on'] else 'off'}  {r['ms_per_step']:8.2f}  {tail}")
    if profiles:
        print("\nmethod           error  ms/step  GPU busy ms/step  busy / full's busy  kernels (CPU: ops)  syncs/step")
        for r in rows:
            if "host_syncs_per_step" in r:
                print(
                    f"{r['method']:16s} {'on ' if r['est_error_on'] else 'off'}  {r['ms_per_step']:8.2f}  "
                    f"{r.get('gpu_busy_ms') or float('nan'):16.2f}  "
                    f"{r.get('busy_ratio_vs_full') or float('nan'):18.2f}  "
                    f"{r.get('kernels_per_step') or r.get('aten_ops_per_step'):12.0f}  {r['host_syncs_per_step']:15.1f}"
                )
    if profiles:
        key = "span_gpu_ms_per_step" if device.type == "cuda" else "span_host_ms_per_step"
        names = sorted({k for r in rows for k in (r.get(key) or {})})
        what = "GPU busy ms per step" if device.type == "cuda" else "host ms per step"
        print(f"\nwhere the time goes ({what}; 'model': the rest of the step, the layers' own work)")
        print(f"{'method':16s} error  " + "".join(f"{n:>9s}" for n in names) + f"{'model':>9s}")
        for r in rows:
            sp = r.get(key)
            if sp is None:
                continue
            total = r.get("gpu_busy_ms") if device.type == "cuda" else r.get("profiled_ms_per_step")
            rest = (total or 0.0) - sum(sp.values())
            cells = "".join(f"{sp.get(n, 0.0):9.2f}" for n in names)
            print(f"{r['method']:16s} {'on ' if r['est_error_on'] else 'off'}    {cells}{rest:9.2f}")
    inv = "batch-invariant mode" if args.batch_invariant else "stock kernels"
    print(f"\nmethod                    ratio vs full (error on / off; medians of {repeats_done}, {inv})")
    for name in dict.fromkeys(r["method"] for r in rows):
        on = next((r for r in rows if r["method"] == name and r["est_error_on"]), None)
        off = next((r for r in rows if r["method"] == name and not r["est_error_on"]), None)
        print(
            f"{name:24s}  {on['ratio_vs_full']:.2f}x / {off['ratio_vs_full']:.2f}x"
            if on
            else f"{name:24s}  - / {off['ratio_vs_full']:.2f}x"
        )
    labels = {r["method"] for r in rows}
    pairs = [n for n in dict.fromkeys(r["method"] for r in rows) if f"{n} [fused]" in labels]
    if pairs:
        print("\nmethod            fused / unfused ms per step (error on / off)")
        for name in pairs:
            cells = []
            for err in (True, False):
                a = next(r for r in rows if r["method"] == f"{name} [fused]" and r["est_error_on"] == err)
                b = next(r for r in rows if r["method"] == name and r["est_error_on"] == err)
                cells.append(f"{a['ms_per_step'] / b['ms_per_step']:.2f}x")
            print(f"{name:16s}  {' / '.join(cells)}")
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "args": vars(args),
        "device": str(device),
        "dtype": str(dtype),
        "hardware": hardware(),
        "versions": versions(),
        "batch_invariant": args.batch_invariant,
        "fused": args.fused,
        "repeats_done": repeats_done,
        "prefill_ms": statistics.median(prefill_ms),
        "prefill_all_ms": prefill_ms,
        "prefill_chunk": args.prefill_chunk,
        "rows": rows,
    }
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"accuracy_path_{args.model}_{args.context}_b{args.batch}.json").write_text(
            json.dumps(record, indent=2) + "\n"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
