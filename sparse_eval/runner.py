"""Running model × method × task: every run is a pure function of its config (so sweeps can skip and resume)."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from .attention.plugin import PROTOCOLS, Runtime, attach, detach
from .config import to_plain
from .engine import Engine
from .estimate import warn_if_long
from .methods import build_method, make_config
from .methods.base import resolve_dense_layers
from .models.loading import ModelConfig, load_model, max_context
from .results import SampleLog, provenance, run_dir_for, write_summary
from .status import RunsDirError, check_writable, clear_failure, run_lock, run_state, write_failure, write_progress
from .tasks import build_task

log = logging.getLogger("sparse_eval")

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"
PACKAGE_CONF_DIR = Path(__file__).resolve().parent / "conf"
RECORD_STATS = ("cost1", "cost2", "static_frac", "error")


def method_options(name: str) -> dict[str, Any]:
    """The options of ``conf/method/<name>.yaml`` (used for the methods listed in ``compare``)."""
    for base in (CONF_DIR, PACKAGE_CONF_DIR):
        path = base / "method" / f"{name}.yaml"
        if path.exists():
            node = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
            node.pop("defaults", None)
            return node
    raise ValueError(f"no config file conf/method/{name}.yaml; valid: {sorted(p.stem for p in (CONF_DIR / 'method').glob('*.yaml'))}")


class Experiment:
    """Loads the model and the task's samples once; runs one or several methods over them."""

    def __init__(self, cfg: Any):
        self.cfg = cfg
        self.model_cfg = ModelConfig(**to_plain(cfg.model))
        self.task_opts = to_plain(cfg.task)
        if not self.task_opts:
            raise ValueError("no task given; e.g. task=wikitext")
        self.task = build_task(self.task_opts, data_dir=cfg.paths.data_dir)
        self.protocol = cfg.eval.protocol or self.task.default_protocol
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"eval.protocol={self.protocol!r}; valid: {list(PROTOCOLS)} (or null for the task's default)")
        if cfg.eval.prefill_chunk is not None and cfg.eval.prefill_chunk < 1:
            raise ValueError(f"eval.prefill_chunk={cfg.eval.prefill_chunk}: must be >= 1 or null")
        self.model = self.tokenizer = None
        self._samples = None

    def method_configs(self) -> list[dict[str, Any]]:
        if self.cfg.method is not None:
            opts = [to_plain(self.cfg.method)]
        else:
            opts = []
            for entry in self.cfg.compare:
                entry = to_plain(entry)
                if isinstance(entry, str):
                    opts.append(method_options(entry))
                else:
                    opts.append(method_options(entry["name"]) | entry)
        # validate every method before any work: a bad value fails at start, naming it
        return [dataclasses.asdict(build_method(make_config(o["name"], o)).config) for o in opts]

    def load(self) -> None:
        if self.model is None:
            self.model, self.tokenizer = load_model(self.model_cfg)
            self.context = max_context(self.model_cfg, self.model)
            self.num_layers = self.model.config.get_text_config().num_hidden_layers

    def samples(self):
        if self._samples is None:
            self.load()
            self._samples = self.task.samples(self.tokenizer, self.context)
        return self._samples

    def preflight(self, method_opts: dict[str, Any]) -> dict[str, Any]:
        """Everything that can fail before a run has started, checked before anything is written to its run dir:
        the model (path, weights, dtype, device), the method against the model (dense layers vs depth, budgets vs
        context, DS's calibration file), the task's data and lengths vs the context.  Returns the method's
        options with ``dense_layers`` resolved for this model (as recorded in the run's config and summary)."""
        self.load()
        opts = dict(method_opts, dense_layers=resolve_dense_layers(method_opts["dense_layers"], self.num_layers))
        method = build_method(make_config(opts["name"], opts))
        method.validate(num_layers=self.num_layers, context=self.context)
        method.setup(self.model, self.model_cfg.name)
        self.samples()
        return opts

    def identity(self, method: dict[str, Any]) -> dict[str, Any]:
        ev = self.cfg.eval
        return {
            "model": dataclasses.asdict(self.model_cfg) | {"how_to_get": None},
            "method": method,
            "task": self.task_opts,
            "eval": {"protocol": self.protocol, "compute_error": ev.compute_error, "prefill_chunk": ev.prefill_chunk},
            "seed": self.cfg.seed,
        }

    def run_method(self, method_opts: dict[str, Any]) -> dict[str, Any]:
        from tqdm.auto import tqdm

        identity = self.identity(method_opts)
        run_dir = run_dir_for(self.cfg.paths.runs_dir, identity)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(identity)), encoding="utf-8")
        if not (run_dir / "meta.json").exists():
            (run_dir / "meta.json").write_text(json.dumps(provenance(), indent=2) + "\n", encoding="utf-8")
        samples_log = SampleLog(run_dir / "samples.jsonl")
        if self.cfg.eval.rerun_failed:
            samples_log.drop_failed()
        samples = self.samples()
        todo = [s for s in samples if not samples_log.done(s.id)]
        write_progress(run_dir, len(samples), len(samples) - len(todo))  # for `python -m sparse_eval.status`
        method = build_method(make_config(method_opts["name"], method_opts))
        method.validate(num_layers=self.num_layers, context=self.context)
        method.setup(self.model, self.model_cfg.name)
        self._provenance = method.provenance()
        torch.manual_seed(self.cfg.seed)
        session = attach(self.model, method, Runtime(self.protocol, self.cfg.eval.compute_error, self.cfg.eval.query_chunk))
        engine = Engine(self.model, self.tokenizer, session, self.cfg.eval.prefill_chunk)
        logger = _Logger(self.cfg.logger, run_dir, identity)
        try:
            for sample in tqdm(todo, desc=short_label(method_opts), disable=not todo, leave=False):
                session.recorder.reset()
                t0 = time.perf_counter()
                try:
                    rec = self.task.run(sample, engine)
                    rec = {"id": sample.id, "status": "ok", **rec, **_stats_fields(session.recorder.summary())}
                except Exception as exc:  # one failing sample is recorded and the run goes on
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    log.warning("sample %s failed: %r", sample.id, exc)
                    rec = {"id": sample.id, "status": "error", "error": repr(exc),
                           "traceback": traceback.format_exc(limit=8)}
                rec["time_s"] = time.perf_counter() - t0
                samples_log.append(rec)
                logger.log_sample(rec)
        finally:
            detach(self.model)
        records = [samples_log.records[s.id] for s in samples if s.id in samples_log.records]
        summary = self.summarize(run_dir, identity, records)
        write_summary(run_dir, summary)
        logger.finish(summary)
        return summary

    def summarize(self, run_dir: Path, identity: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
        ok = [r for r in records if r.get("status") == "ok"]
        metrics = self.task.aggregate(ok)
        out: dict[str, Any] = {
            "run_dir": str(run_dir),
            "model": identity["model"]["name"],
            "method": identity["method"]["name"],
            "method_config": identity["method"],
            "method_provenance": getattr(self, "_provenance", {}),
            "task": identity["task"]["name"],
            "task_config": identity["task"],
            "protocol": self.protocol,
            "dense_layers": identity["method"].get("dense_layers"),
            "sink": identity["method"].get("sink"),
            "local": identity["method"].get("local"),
            "prefill_chunk": self.cfg.eval.prefill_chunk,
            "metric": self.task.metric,
            "score": metrics.get(self.task.metric),
            "metrics": metrics,
            "samples": len(ok),
            "failed": len(records) - len(ok),
            "expected_samples": len(self.samples()),
            "time_s": sum(r.get("time_s", 0.0) for r in records),
        }
        for key in ("cost1", "cost2", "static_frac", "est_error", "empty_selections"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            out[key] = sum(vals) / len(vals) if vals else None
        for key in ("cost1", "cost2", "est_error"):
            layers: dict[str, list[float]] = {}
            for r in ok:
                for l, v in (r.get(f"{key}_per_layer") or {}).items():
                    layers.setdefault(str(l), []).append(v)
            out[f"{key}_per_layer"] = {l: sum(v) / len(v) for l, v in sorted(layers.items(), key=lambda x: int(x[0]))}
        return out


def _stats_fields(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: stats.get(k) for k in RECORD_STATS}
    out["est_error"] = out.pop("error")
    out["empty_selections"] = stats.get("empty_selections", 0.0)
    out["sparse_rows"] = stats.get("sparse_rows", 0.0)
    for key in ("cost1", "cost2", "error"):
        out[f"{key if key != 'error' else 'est_error'}_per_layer"] = stats.get(f"{key}_per_layer", {})
    for key, val in stats.items():  # method extras (e.g. draws, pages)
        if key not in out and not key.endswith(("_per_layer", "_per_layer_head")) and key not in ("sparse_layers",) \
                and key not in RECORD_STATS:
            out[f"m_{key}"] = val
    return out


class _Logger:
    """Optional wandb logging (off by default; ``logger=wandb`` with ``logger.mode=offline`` touches no network)."""

    def __init__(self, cfg: Any, run_dir: Path, identity: dict[str, Any]):
        self.run = None
        if cfg.name == "none":
            return
        if cfg.name != "wandb":
            raise ValueError(f"logger.name={cfg.name!r}; valid: ['none', 'wandb']")
        import wandb

        self.run = wandb.init(project=cfg.project, mode=cfg.mode, dir=str(run_dir), config=identity,
                              name=run_dir.name)

    def log_sample(self, rec: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.run.finish()


def short_config(method: dict[str, Any]) -> str:
    """The method's headline options, e.g. ``K=10, L=150`` (the summary table's config column)."""
    return ", ".join(f"{k}={v}" for k, v in method.items() if k in ("budget", "K", "L", "page_size", "alpha", "beta"))


def short_label(method: dict[str, Any]) -> str:
    """The progress bar's label: the method and its headline options, e.g. ``magicpig K=10, L=150``."""
    return f"{method['name']} {short_config(method)}".strip()


def format_table(summaries: list[dict[str, Any]]) -> str:
    import pandas as pd

    rows = []
    for s in summaries:
        m = s["method_config"]
        rows.append({
            "method": s["method"],
            "config": short_config(m),
            s["metric"]: s["score"],
            "Cost1": s["cost1"],
            "Cost2": s["cost2"],
            "static": s["static_frac"],
            "est_error": s["est_error"],
            "samples": s["samples"],
            "failed": s["failed"],
            "time_s": s["time_s"],
        })
    df = pd.DataFrame(rows)
    return df.to_string(index=False, float_format=lambda x: f"{x:.4g}" if not math.isnan(x) else "-", na_rep="-")


def run(cfg: Any) -> list[dict[str, Any]]:
    exp = Experiment(cfg)
    methods = [exp.preflight(m) for m in exp.method_configs()]  # a run that cannot start writes nothing
    warn_if_long(exp.model, exp.samples(), len(methods), log)
    summaries = []
    for m in methods:
        run_dir = run_dir_for(cfg.paths.runs_dir, exp.identity(m))
        unwritable = check_writable(run_dir)
        if unwritable:  # a read-only store: a finished run is read back, anything else is refused
            if run_state(run_dir)["state"] == "done" and not cfg.eval.rerun_failed:
                summaries.append(json.loads((run_dir / "summary.json").read_text(encoding="utf-8")))
                continue
            raise RunsDirError(f"paths.runs_dir={cfg.paths.runs_dir}: cannot write {unwritable}; give a writable "
                               f"folder, e.g. paths.runs_dir=runs")
        try:
            with run_lock(run_dir):  # one process per run dir: a duplicate job waits, then finds the samples done
                clear_failure(run_dir)
                summaries.append(exp.run_method(m))
        except KeyboardInterrupt as exc:  # nothing to record: the run resumes at its next sample
            exc.run_dir = str(run_dir)  # type: ignore[attr-defined]
            raise
        except Exception as exc:  # recorded in the run dir (failed.json) for sweeps and `sparse_eval.status`
            try:
                write_failure(run_dir, exc)
            except OSError as werr:  # the store went away or read-only: the run's own error is what matters
                log.warning("could not record the failure in %s: %s", run_dir, werr)
            try:
                exc.run_dir = str(run_dir)  # type: ignore[attr-defined]
            except AttributeError:
                pass
            raise
    if cfg.print_table:
        first = summaries[0]
        print(f"\nmodel={first['model']} task={first['task']} protocol={first['protocol']} "
              f"({first['samples']} samples; Cost1/Cost2/static/est_error: means over sparse layers, heads and query rows)")
        print(format_table(summaries))
        print(f"results: {Path(first['run_dir']).parent}")
    return summaries
