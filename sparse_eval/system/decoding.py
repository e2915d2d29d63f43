"""``decode``: prefill a prompt batch densely, then greedy steps through the system layers, timing every step.

Eager steps run the layers' Python per step; with ``DecodeOptions.cuda_graph`` the steps have static shapes and
are captured (``capture``).  ``interleave=2`` decodes the batch as two independent halves whose captured pieces
replay interleaved (``capture.replay_interleaved``).
"""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import sparse_eval.kernels.offload as koff
from sparse_eval.kernels.ds import TOPK_IMPLS

from ..attention.plugin import cache_kwargs
from ..methods.base import Method
from .capture import StaticRun, replay_interleaved
from .session import PhaseTimes, SystemSession, attach, build_layers, detach


@dataclass(frozen=True)
class DecodeOptions:
    """How ``decode`` runs (none of it changes the tokens, up to ties of the top-k).

    * ``repeat_batch``: tile the cache over the batch (B·repeat rows) after the first decode step (the prefill
      and that step, which builds MagicPIG's tables, run at batch B; the step's time is in ``step_ms[0]``).
    * ``cuda_graph``: decode with static shapes (preallocated capacity, device-side positions and budgets; see
      ``capture.StaticRun``), captured once in a CUDA graph on the GPU (MagicPIG in pieces around its CPU parts,
      after one eager step that builds its tables).  The cache is then tiled right after the prefill (MagicPIG:
      after that step), and ``stats["graph_capture_ms"]`` holds the capture time.
    * ``interleave``: 2 splits the rows into two independent decodes (``_halves``: two sessions, each with its
      own caches, prefill and capture) whose steps run interleaved (``capture.replay_interleaved``): with a step
      in pieces (MagicPIG) the GPU runs one half's pieces while the host runs the other half's CPU parts.  Needs
      ``cuda_graph``; the tokens are those of the rows decoded alone.  ``prefill_ms`` and the first step's time
      are the two halves' summed.
    * ``label_scale_dtype``, ``backend_gpu``, ``backend_cpu``, ``topk``: the layers' (``session.build_layers``).
    * ``phase_times``: time the phases the layers bracket (``session.PhaseTimes``; MagicPIG's GPU part, codes to
      the host, CPU sampling, CPU attention, merge) over the steps after the first; ``stats["phase_ms"]`` holds
      their totals and ``stats["phase_steps"]`` the number of steps.  The steps synchronise at every bracket: use
      it for breakdowns, not for throughput.  Eager steps only.
    """

    repeat_batch: int = 1
    cuda_graph: bool = False
    interleave: int = 1
    label_scale_dtype: torch.dtype | None = None
    backend_gpu: str = "auto"
    backend_cpu: str = "auto"
    topk: str = "radix"
    phase_times: bool = False

    def __post_init__(self) -> None:
        if self.topk not in TOPK_IMPLS:
            raise ValueError(f"topk={self.topk!r}: valid values are {list(TOPK_IMPLS)}")
        if self.interleave not in (1, 2):
            raise ValueError(
                f"interleave={self.interleave!r}: valid values are 1 (one decode) and 2 (two halves interleaved)"
            )
        if self.interleave == 2 and not self.cuda_graph:
            raise ValueError(
                "interleave=2 interleaves the captured steps of two halves of the batch: it needs cuda_graph=true"
            )
        if self.cuda_graph and self.phase_times:
            raise ValueError(
                "phase_times=true times eager steps; a captured step (cuda_graph=true) has no host-side "
                "phases. Valid: one of them"
            )


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # long [B, new]
    prefill_ms: float
    step_ms: list[float]  # one per decode step (the forward that turns token t into logits of t+1)
    batch: int
    context: int
    stats: dict[str, Any] = field(default_factory=dict)  # counters; graph_capture_ms
    memory: dict[str, int] = field(default_factory=dict)  # bytes: gpu_peak, cache_gpu, cache_cpu


class _Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def _memory(sessions: list[SystemSession], dev: torch.device) -> dict[str, int]:
    """Bytes of the sessions' caches on the GPU and in CPU memory, and the GPU's peak allocation of the run."""
    mems = [session.nbytes() for session in sessions]
    out = {"cache_gpu": sum(m["gpu"] for m in mems), "cache_cpu": sum(m["cpu"] for m in mems)}
    if dev.type == "cuda":
        out["gpu_peak"] = int(torch.cuda.max_memory_allocated(dev))
    return out


def _decode_static(runs: list[StaticRun], steps: int, cuda: bool) -> tuple[list[float], dict[str, float]]:
    """``steps`` greedy decode steps of every run (each its own rows): the first eager, the second captured (in
    pieces it also decodes: its time, capture included, is that step's), the rest replayed.  Two runs whose steps
    are in pieces replay interleaved (``capture.replay_interleaved``); otherwise the runs replay one after the other.
    Returns (ms per step, all runs together; extra timings: ``graph_capture_ms`` summed over the runs,
    ``graph_pieces`` of one run's step, and for steps in pieces the host's ms per replayed step spent waiting for
    the pieces (``host_wait_ms_per_step``) and in the host parts (``host_part_ms_per_step``))."""
    if steps < 1:
        return [], {}
    extra: dict[str, float] = {}
    timer = _Timer(cuda)
    timer.mark()
    for run in runs:
        run.warm()
    timer.mark()
    ms = timer.intervals_ms()
    left = steps - 1
    if left and cuda:
        for run in runs:
            got = run.capture()
            extra["graph_capture_ms"] = extra.get("graph_capture_ms", 0.0) + got["graph_capture_ms"]
            if "graph_pieces" in got:
                extra["graph_pieces"] = got["graph_pieces"]
        if all(run.pieces is not None for run in runs):  # the capturing step decoded: timed with its capture
            ms.append(extra["graph_capture_ms"])
            left -= 1
    interleaved = len(runs) == 2 and all(run.pieces is not None for run in runs)
    timer = _Timer(cuda)
    timer.mark()
    for _ in range(left):
        if interleaved:
            replay_interleaved([run.pieces for run in runs])
            for run in runs:
                run.out.append(run.ids.clone())
        else:
            for run in runs:
                run.replay()
        timer.mark()
    ms += timer.intervals_ms()
    chains = [run.pieces for run in runs if run.pieces is not None]
    if chains and left:  # where the host's time went in the replayed steps: waiting for the GPU, or host parts
        extra["host_wait_ms_per_step"] = 1e3 * sum(c.wait_s for c in chains) / left
        extra["host_part_ms_per_step"] = 1e3 * sum(c.host_s for c in chains) / left
    return ms, extra


def _halves(input_ids: torch.Tensor, repeat_batch: int, interleave: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of each interleaved decode, as (prompts, repeat_batch): the prompts split in two, or, for one prompt
    tiled (a throughput run), the tiling split in two."""
    if interleave == 1:
        return [(input_ids, repeat_batch)]
    b = input_ids.shape[0]
    if b >= 2 and repeat_batch == 1:
        return [(input_ids[: b // 2], 1), (input_ids[b // 2 :], 1)]
    if b == 1 and repeat_batch >= 2:
        return [(input_ids, repeat_batch // 2), (input_ids, repeat_batch - repeat_batch // 2)]
    raise ValueError(
        f"interleave=2 splits the rows in two: it needs batch >= 2 with repeat_batch = 1, or batch 1 "
        f"with repeat_batch >= 2; got batch {b}, repeat_batch {repeat_batch}"
    )


@torch.inference_mode()
def decode(
    model: Any, method: Method, input_ids: torch.Tensor, max_new_tokens: int, options: DecodeOptions | None = None
) -> DecodeResult:
    """Prefill ``input_ids`` [B, T] (equal lengths, no padding) densely, then ``max_new_tokens`` greedy steps with
    ``method`` (no stop token: every row decodes the same number of steps, as a throughput run does), run as
    ``options`` say (``DecodeOptions``).  ``method`` must be set up for the model (``method.setup(model, name)``)
    where it needs it (Double Sparsity)."""
    opts = DecodeOptions() if options is None else options
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    repeat_batch = opts.repeat_batch
    halves = _halves(input_ids, repeat_batch, opts.interleave)
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    b, t = input_ids.shape
    phases = PhaseTimes(cuda) if opts.phase_times else None
    sessions: list[SystemSession] = []
    runs: list[StaticRun] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    def open_session(phase_times: PhaseTimes | None = None) -> tuple[SystemSession, dict[str, Any]]:
        """A session with its own layers, attached to the model; and the model's cache arguments for it."""
        session = SystemSession(
            model,
            method,
            build_layers(
                model,
                method,
                t + max_new_tokens,
                label_scale_dtype=opts.label_scale_dtype,
                backend_gpu=opts.backend_gpu,
                backend_cpu=opts.backend_cpu,
                topk=opts.topk,
            ),
            phase_times,
        )
        sessions.append(session)
        attach(model, session)
        return session, cache_kwargs(model, session.cache)

    try:
        if opts.cuda_graph:
            prefill_ms, first_ms, firsts = 0.0, [], []
            for ids_h, rep_h in halves:
                session, kw = open_session()
                got_ms, first, nxt = _prefill_for_static(model, session, kw, ids_h.to(dev), rep_h, max_new_tokens, cuda)
                prefill_ms += got_ms[0]
                first_ms = [a + c for a, c in zip(first_ms, got_ms[1:])] if first_ms else got_ms[1:]
                firsts.append(first)
                runs.append(StaticRun(model, session, kw, nxt, cuda))
            steps, extra = _decode_static(runs, max_new_tokens - len(firsts[0]), cuda)
            tokens = torch.cat([torch.cat([*first, *run.out], 1) for first, run in zip(firsts, runs)], 0)
            stats = collections.Counter()
            for session in sessions:
                stats.update(session.stats)
            return DecodeResult(
                tokens=tokens.cpu(),
                prefill_ms=prefill_ms,
                step_ms=first_ms + steps,
                batch=b * repeat_batch,
                context=t,
                stats=dict(stats, **extra),
                memory=_memory(sessions, dev),
            )
        session, kw = open_session(phases)
        timer = _Timer(cuda)
        timer.mark()
        logits = model(input_ids=input_ids.to(dev), use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
        timer.mark()
        prefill_ms = timer.intervals_ms()[0]
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        out = [nxt]
        timer = _Timer(cuda)
        timer.mark()
        for step in range(max_new_tokens - 1):
            logits = model(input_ids=nxt, use_cache=True, **kw).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if step == 0 and repeat_batch > 1:
                # tile after the first step, so that per-row index builds (MagicPIG's tables) run once
                out = _tile_rows(session, out, repeat_batch)
                nxt = out[-1]
            if step == 0 and phases is not None:  # the first step builds MagicPIG's tables: not a steady step
                phases.ms.clear()
            timer.mark()
        steps = timer.intervals_ms()
        if phases is not None:
            session.stats["phase_ms"] = dict(phases.ms)
            session.stats["phase_steps"] = max(0, max_new_tokens - 2)
        return DecodeResult(
            tokens=torch.cat(out, 1).cpu(),
            prefill_ms=prefill_ms,
            step_ms=steps,
            batch=b * repeat_batch,
            context=t,
            stats=dict(session.stats),
            memory=_memory(sessions, dev),
        )
    finally:
        for run in runs:
            run.close()
        detach(model)
        for session in sessions:
            for layer in session.layers:
                layer.release()
            session.layers.clear()
            session.inputs.clear()
        koff.unpin_all()


def _prefill_for_static(
    model: Any,
    session: SystemSession,
    kw: dict[str, Any],
    input_ids: torch.Tensor,
    repeat_batch: int,
    max_new_tokens: int,
    cuda: bool,
) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    """The prefill of one static decode, then (for layers that build at their first step: MagicPIG's tables) one
    eager step at batch B, then the tiling.  Returns (ms of the prefill and of that step, the tokens so far [B', 1]
    each, the next input [B', 1])."""
    timer = _Timer(cuda)
    timer.mark()
    logits = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
    timer.mark()
    nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
    first = [nxt]
    if max_new_tokens > 1 and any(getattr(layer, "builds_at_first_step", False) for layer in session.layers):
        nxt = model(input_ids=nxt, use_cache=True, **kw).logits[:, -1].argmax(-1, keepdim=True)
        timer.mark()
        first.append(nxt)
    ms = timer.intervals_ms()
    if repeat_batch > 1:
        if cuda:  # the prefill's activations are freed: hand their blocks back before the tiled cache
            torch.cuda.empty_cache()
        first = _tile_rows(session, first, repeat_batch)
        nxt = first[-1]
    return ms, first, nxt


def _tile_rows(session: SystemSession, tokens: list[torch.Tensor], times: int) -> list[torch.Tensor]:
    """Tile every layer's cache ``times`` over the batch (``FullLayer.repeat_batch``) and the tokens so far with
    it."""
    for layer in session.layers:
        layer.repeat_batch(times)
    return [x.repeat(times, 1) for x in tokens]
