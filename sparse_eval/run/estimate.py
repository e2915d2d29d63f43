"""A rough time estimate of a run on the CPU: over an hour, the run is refused at start unless
``eval.allow_long=true`` (``check_long``; then it only warns).

Per sample: the prompt's forward pass, 2·P·T (P parameters, T prompt tokens) + 2·layers·hidden·T² (causal qKᵀ and
softmax·V), plus each generated token's forward over the prompt, 2·P + 4·layers·hidden·T per token (the task's
``max_new_tokens`` for the sample: an upper bound, a sample may stop early); divided by the FLOP rate of this
model's own forward pass measured at start on this CPU in the run's kernel mode (``model_flop_rate``: the
batch-invariant kernels, the dispatch hooks and a small model's per-layer overhead are in it, which a bare matmul
rate missed).  The sparse methods' own work (selection, the estimation error's dense reference) is not counted and
the machine's load changes the measured rate: a rough figure, meant to tell minutes from hours.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ..models.placement import main_device
from .run_spec import RunSpec

WARN_S = 3600.0


PROBE_TOKENS = 128


def model_flop_rate(model: Any, batch_invariant: bool = False, tokens: int = PROBE_TOKENS) -> float:
    """FLOP/s of this model's own forward pass over ``tokens`` tokens on this CPU, in the run's kernel mode
    (``batch_invariant``): the faster of two passes, the first also warming up."""
    from ..invariance import batch_invariant as invariant_kernels

    cfg = model.config.get_text_config()
    limit = getattr(cfg, "max_position_embeddings", None) or tokens
    t = max(1, min(tokens, int(limit)))
    ids = torch.zeros(1, t, dtype=torch.long, device=main_device(model))
    best = float("inf")
    with torch.no_grad(), invariant_kernels(batch_invariant):
        for _ in range(2):
            t0 = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            best = min(best, time.perf_counter() - t0)
    return forward_flops(model, [t]) / best


def sample_tokens(sample: Any) -> int:
    d = sample.data
    ids = d.get("input_ids")
    return len(ids) if ids is not None else int(d.get("context_len") or d.get("prompt_tokens") or 0)


def forward_flops(model: Any, tokens: Sequence[int], new_tokens: Sequence[int] | None = None) -> float:
    """Matmul FLOPs of one forward pass over each of ``tokens`` (sequence lengths), summed, plus, per sequence,
    ``new_tokens`` generated tokens each attending over it (2·P + 4·layers·hidden·T each)."""
    cfg = model.config.get_text_config()
    params = sum(p.numel() for p in model.parameters())
    lh = cfg.num_hidden_layers * cfg.hidden_size
    new = new_tokens if new_tokens is not None else [0] * len(tokens)
    return sum(2.0 * params * t + 2.0 * lh * t**2 + g * (2.0 * params + 4.0 * lh * t) for t, g in zip(tokens, new))


def new_tokens_of(sample: Any, request: Callable[[Any], Any] | None) -> int:
    """The tokens the task asks to generate for ``sample`` (its request's ``max_new_tokens``; 0 for a scoring
    request or without a task)."""
    if request is None:
        return 0
    try:
        req = request(sample)
    except NotImplementedError:  # a task that runs itself (lm_eval): its generation lengths are its own
        return 0
    return int(getattr(req, "max_new_tokens", 0) or 0)


def cpu_estimate(
    model: Any,
    samples: Sequence[Any],
    runs: int,
    batch_invariant: bool = False,
    request: Callable[[Any], Any] | None = None,
) -> tuple[float, str] | None:
    """(seconds, what it is based on) for ``runs`` method runs over ``samples`` when the model is on the CPU;
    ``request``: the task's ``request`` (for the tokens each sample generates)."""
    if main_device(model).type != "cpu" or not samples:
        return None
    flops = forward_flops(model, [sample_tokens(s) for s in samples], [new_tokens_of(s, request) for s in samples])
    if flops <= 0:
        return None
    rate = model_flop_rate(model, batch_invariant)
    per = flops / len(samples) / rate
    mode = "batch-invariant" if batch_invariant else "plain"
    return per * len(samples) * runs, (
        f"{len(samples)} samples x {runs} run(s) x ~{per:.1f} s: forward FLOPs (prompt and generated tokens) over "
        f"this model's forward rate on this CPU measured now ({rate / 1e9:.0f} GFLOP/s, {mode} kernels); a rough "
        f"figure: the machine's load and the methods' own work change it"
    )


def warn_if_long(
    model: Any, samples: Sequence[Any], runs: int, log: Any, batch_invariant: bool = False
) -> float | None:
    est = cpu_estimate(model, samples, runs, batch_invariant)
    if est is None or est[0] < WARN_S:
        return None if est is None else est[0]
    log.warning(
        "this will take roughly %.1f h on this CPU (%s). It is meant for a GPU; on a CPU lower "
        "task.num_samples / task.length.",
        est[0] / 3600,
        est[1],
    )
    return est[0]


def remaining_samples(spec: RunSpec, methods: Sequence[Any]) -> list[list[Any]]:
    """Per method, the samples it still has to run (those not yet in its run directory's samples.jsonl; with
    ``eval.rerun_failed`` the failed ones too): a re-run on saved results costs nothing."""
    from ..results.store import SAMPLES_FILE, read_samples

    samples = spec.samples()
    rerun = spec.eval.rerun_failed
    out: list[list[Any]] = []
    for m in methods:
        _, run_dir = spec.run_dir(m)
        done = read_samples(run_dir / SAMPLES_FILE)
        out.append([s for s in samples if s.id not in done or (rerun and done[s.id].get("status") != "ok")])
    return out


def check_long(spec: RunSpec, methods: Sequence[Any], log: Any) -> float | None:
    """At start, on the CPU: the rough time of the samples still to run; over ``WARN_S`` it refuses the run
    (ValueError, before anything is written) unless ``eval.allow_long=true``, which only warns."""
    todo = [t for t in remaining_samples(spec, methods) if t]
    if not todo:
        return None
    same = all([s.id for s in t] == [s.id for s in todo[0]] for t in todo)
    invariant, request = spec.eval.batch_invariant, spec.task.request
    est = (
        cpu_estimate(spec.model, todo[0], len(todo), invariant, request)
        if same
        else cpu_estimate(spec.model, [s for t in todo for s in t], 1, invariant, request)
    )
    if est is None or est[0] < WARN_S:
        return None if est is None else est[0]
    if spec.eval.allow_long:
        log.warning(
            "this will take roughly %.1f h on this CPU (%s); running it as eval.allow_long=true asks.",
            est[0] / 3600,
            est[1],
        )
        return est[0]
    raise ValueError(
        f"this run would take roughly {est[0] / 3600:.1f} h on this CPU ({est[1]}); it is meant for a "
        f"GPU: lower task.num_samples / task.length, or add eval.allow_long=true to run it anyway"
    )
