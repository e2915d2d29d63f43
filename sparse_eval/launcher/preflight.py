"""Checks made before a multirun sweep runs (``SweepPreflight``, a Hydra callback in ``conf/config.yaml``); a single
run checks its runs folder before its model loads the same way (``store.check_runs_dir``, called by ``runner.run``).

A sweep is checked once, before the launcher starts a job (or submits one to Slurm): each job's runs folder can be
written, each distinct model is found and its config read (not its weights: ``models.loading.load_config``), each
job's config is composed and checked as a single run checks it at start (the task and its data, the protocol, the
batch size, every method's options, its dense layers against the model's depth, its budgets against the context,
the task's length against the context, and, for jobs run on this machine, MagicPIG's tables against this machine's
memory).  If any job would fail there, nothing is launched: one message groups the jobs by error, names the fix,
and the process exits with status 2.  ``preflight=false`` launches without the check (each job then fails alone,
recorded in its ``job_status.json``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

PREFLIGHT_KEY = "preflight"


# -- the sweep ---------------------------------------------------------------------------------------------------


def _local_launcher(config: DictConfig) -> bool:
    """Whether the sweep's jobs run on this machine (basic, joblib or submitit's local launcher)."""
    target = str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "")
    return "Slurm" not in target


def _model_info(model_cfg: Any, cache: dict) -> Any:
    """(config, device) of a model config, read once per distinct config (the model's config file, not its
    weights); raises the single run's error."""
    from ..models.loading import load_config, resolve_dtype, resolve_placement

    key = tuple(sorted((k, str(v)) for k, v in dataclasses.asdict(model_cfg).items()))
    if key not in cache:
        try:
            device, _, _ = resolve_placement(model_cfg)  # model.device, or model.device_map's checked
            resolve_dtype(model_cfg.dtype, device)
            cache[key] = (load_config(model_cfg), device)
        except (ValueError, FileNotFoundError, ImportError) as exc:
            cache[key] = exc
    got = cache[key]
    if isinstance(got, Exception):
        raise got
    return got


CHECKED = (ValueError, FileNotFoundError, ImportError)  # what a run refuses at start with (one line, exit status 2)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def job_errors(cfg: Any, models: dict, local: bool) -> list[str]:
    """The errors a job's run would stop at before starting: its model's (``_model_info``) and its config's
    (``check_job``), one line each; [] when it can start."""
    from ..config import to_plain
    from ..models.loading import ModelConfig
    from ..results.store import check_runs_dir

    errors = []
    try:
        check_runs_dir(cfg.paths.runs_dir)
    except CHECKED as exc:
        errors.append(_first_line(exc))
    try:
        _model_info(ModelConfig(**to_plain(cfg.model)), models)
    except CHECKED as exc:
        errors.append(_first_line(exc))
    try:
        check_job(cfg, models, local, model_checked=not errors)
    except CHECKED as exc:
        errors.append(_first_line(exc))
    return errors


def check_job(cfg: Any, models: dict, local: bool, model_checked: bool = True) -> None:
    """Everything a job's run checks at its start that needs neither the model's weights nor its tokenizer;
    raises the single run's error (ValueError / FileNotFoundError).  Without a readable model config
    (``model_checked`` false) only what does not depend on the model."""
    from ..run.experiment import Experiment
    from ..run.memory import Shape, check_index_fits
    from ..run.run_config import check_method, run_config

    exp = Experiment(run_config(cfg))  # the task (options, data files), protocol, prefill chunk, batch size
    methods = exp.method_configs()  # every method's options
    if not model_checked:
        return
    config, device = _model_info(exp.model_cfg, models)
    text = config.get_text_config()
    num_layers = int(text.num_hidden_layers)
    context = int(exp.model_cfg.max_context or getattr(text, "max_position_embeddings", 4096))
    types = getattr(text, "layer_types", None) or []
    sliding = {i: int(getattr(text, "sliding_window", 0) or 0) for i, t in enumerate(types) if t == "sliding_attention"}
    length = exp.task_opts.get("length") or exp.task_opts.get("window")
    if isinstance(length, int) and length > context:
        key = "task.length" if "length" in exp.task_opts else "task.window"
        raise ValueError(f"{key}={length} exceeds the model's context ({context} tokens); use {key} <= {context}")
    for m in methods:
        resolved, _ = check_method(m, num_layers, context, sliding, exp.model_cfg.name)
        if local:  # the jobs run here: MagicPIG's tables against this machine's memory
            n = int(length) if isinstance(length, int) else context
            check_index_fits(resolved, Shape.from_config(config), n, device, building_rows=exp.protocol in ("S", "B"))


def check_sweep(config: DictConfig) -> list[tuple[str, list[int], int]]:
    """Checks every job of the sweep ``config`` describes; returns [(error, job numbers, jobs)] grouped by error
    ([] when every job can start)."""
    from hydra import compose
    from hydra.core.global_hydra import GlobalHydra

    from .launch_cache import lookup
    from .sweep import sweep_jobs

    jobs = sweep_jobs(OmegaConf.select(config, "hydra.sweeper.params"), list(config.hydra.overrides.task))
    local = _local_launcher(config)
    models: dict = {}
    errors: dict[str, list[int]] = {}
    if not GlobalHydra.instance().is_initialized():  # pragma: no cover - the callback runs inside the Hydra app
        return []
    for num, job in enumerate(jobs):
        try:
            cfg = compose(config_name="config", overrides=list(job))
            if lookup(cfg) is not None:  # finished, inputs unchanged: the job is answered from its saved results
                continue
            found = job_errors(cfg, models, local)
        except Exception as exc:  # noqa: BLE001 - a composition error of one job (Hydra's, OmegaConf's)
            found = [f"{type(exc).__name__}: {_first_line(exc)}"]
        for err in found:
            errors.setdefault(err, []).append(num)
    return [(err, nums, len(jobs)) for err, nums in errors.items()]


def sweep_message(problems: list[tuple[str, list[int], int]]) -> str:
    """One message for the jobs that cannot start: each error once, with the jobs it concerns."""
    total = problems[0][2]
    bad = len({n for _, nums, _ in problems for n in nums})
    parts = []
    for err, nums, _ in problems:
        which = (
            f"all {total} jobs"
            if len(nums) == total
            else ("job " if len(nums) == 1 else "jobs ")
            + ",".join(f"#{n}" for n in nums[:12])
            + (" ..." if len(nums) > 12 else "")
        )
        parts.append(f"{which}: {err}")
    return (
        f"{bad} of the sweep's {total} jobs cannot start, so none was launched -- "
        + " | ".join(parts)
        + " (fix the config, or add preflight=false to launch anyway)"
    )


class SweepPreflight(Callback):
    """Before a multirun launches: ``check_sweep``; any job that cannot start stops the whole sweep with one
    ``error:`` line and exit status 2 (nothing written under ``paths.runs_dir``)."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        from ..cli import EXIT_USAGE, fail
        from .sweep import launcher_problem

        problem = launcher_problem(config)  # the launcher's own options (a deadline), even with preflight=false
        if problem:
            fail(problem, EXIT_USAGE)
        if not bool(OmegaConf.select(config, PREFLIGHT_KEY, default=True)):
            return
        problems = check_sweep(config)
        if problems:
            fail(sweep_message(problems), EXIT_USAGE)
