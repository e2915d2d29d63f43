"""A rough time estimate of a run on the CPU: over an hour, the run is refused at start unless
``eval.allow_long=true`` (``check_long``; then it only warns).

Per sample: the forward pass's matmul FLOPs, 2·P·T (P parameters, T tokens of the sample) + 2·layers·hidden·T²
(causal qKᵀ and softmax·V), divided by the float32 matmul rate measured on this CPU at start.  The sparse methods'
own work (selection, the estimation error's dense reference) is not counted and the machine's load changes the
measured rate: a rough figure, meant to tell minutes from hours.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import torch

from .models.placement import main_device

WARN_S = 3600.0


def cpu_matmul_rate(seconds: float = 0.2, n: int = 512) -> float:
    """FLOP/s of an n×n float32 matmul on this CPU (best of repeated timings over ``seconds``)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    a @ b
    best, t_end = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < t_end:
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def sample_tokens(sample: Any) -> int:
    d = sample.data
    ids = d.get("input_ids")
    return len(ids) if ids is not None else int(d.get("context_len") or d.get("prompt_tokens") or 0)


def forward_flops(model: Any, tokens: Sequence[int]) -> float:
    """Matmul FLOPs of one forward pass over each of ``tokens`` (sequence lengths), summed."""
    cfg = model.config.get_text_config()
    params = sum(p.numel() for p in model.parameters())
    return sum(2.0 * params * t + 2.0 * cfg.num_hidden_layers * cfg.hidden_size * t**2 for t in tokens)


def cpu_estimate(model: Any, samples: Sequence[Any], runs: int) -> tuple[float, str] | None:
    """(seconds, what it is based on) for ``runs`` method runs over ``samples`` when the model is on the CPU."""
    if main_device(model).type != "cpu" or not samples:
        return None
    flops = forward_flops(model, [sample_tokens(s) for s in samples])
    if flops <= 0:
        return None
    rate = cpu_matmul_rate()
    per = flops / len(samples) / rate
    return per * len(samples) * runs, (
        f"{len(samples)} samples x {runs} run(s) x ~{per:.1f} s: forward FLOPs over "
        f"this CPU's matmul rate measured now ({rate / 1e9:.0f} GFLOP/s); a rough figure: "
        f"the machine's load and the methods' own work change it"
    )


def warn_if_long(model: Any, samples: Sequence[Any], runs: int, log: Any) -> float | None:
    est = cpu_estimate(model, samples, runs)
    if est is None or est[0] < WARN_S:
        return None if est is None else est[0]
    log.warning(
        "this will take roughly %.1f h on this CPU (%s). It is meant for a GPU; on a CPU lower "
        "task.num_samples / task.length.",
        est[0] / 3600,
        est[1],
    )
    return est[0]


def remaining_samples(exp: Any, methods: Sequence[Any]) -> list[list[Any]]:
    """Per method, the samples it still has to run (those not yet in its run directory's samples.jsonl; with
    ``eval.rerun_failed`` the failed ones too): a re-run on saved results costs nothing."""
    from .store import SAMPLES_FILE, read_samples

    samples = exp.samples()
    rerun = bool(exp.cfg.eval.get("rerun_failed", False))
    out: list[list[Any]] = []
    for m in methods:
        _, run_dir = exp.run_dir(m)
        done = read_samples(run_dir / SAMPLES_FILE)
        out.append([s for s in samples if s.id not in done or (rerun and done[s.id].get("status") != "ok")])
    return out


def check_long(exp: Any, methods: Sequence[Any], log: Any) -> float | None:
    """At start, on the CPU: the rough time of the samples still to run; over ``WARN_S`` it refuses the run
    (ValueError, before anything is written) unless ``eval.allow_long=true``, which only warns."""
    todo = [t for t in remaining_samples(exp, methods) if t]
    if not todo:
        return None
    same = all([s.id for s in t] == [s.id for s in todo[0]] for t in todo)
    est = (
        cpu_estimate(exp.model, todo[0], len(todo))
        if same
        else cpu_estimate(exp.model, [s for t in todo for s in t], 1)
    )
    if est is None or est[0] < WARN_S:
        return None if est is None else est[0]
    if bool(exp.cfg.eval.get("allow_long", False)):
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
