"""What the code below the launcher needs of a run, typed: ``RunSpec``, built once by ``Experiment.spec`` after the
model loads (the eval settings as the ``config.EvalConfig`` dataclass), so that batching (``batching``), the memory
checks (``memory``) and the time estimate (``estimate``) take it, never the raw Hydra config or the ``Experiment``.
Imports: ``config`` only."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from ..config import EvalConfig


@dataclass(frozen=True)
class RunSpec:
    model: Any  # the loaded model (torch.nn.Module: its device, or its device map, is the run's)
    task: Any  # the task (``tasks.base.Task``): its requests, whether it batches
    protocol: str  # A | B | S, resolved (``eval.protocol``, else the task's default)
    batch_size: int | str  # ``eval.batch_size`` checked: an int >= 1 or "auto"
    eval: EvalConfig  # every eval setting, typed
    samples: Callable[[], list[Any]]  # the task's samples (made once and kept by the experiment)
    run_dir: Callable[[Any], tuple[dict[str, Any], Path]]  # a method or its config -> (identity, run directory)
