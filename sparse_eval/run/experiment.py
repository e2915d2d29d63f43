"""One run's work: ``Experiment``, given the run's frozen ``RunConfig`` (``run_config``), loads the model and the
task's samples once, checks each method against them (``preflight``: the one place a run's Method is built, validated
and set up), names each run (``identity``, ``run_dir``), runs a method over the samples its run dir lacks
(``run_method``) and summarizes the records (``summarize``)."""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from ..attention.plugin import Runtime, attach, detach, layer_plan
from ..generation.engine import Engine
from ..identity.fingerprint import file_sha256
from ..methods import Method, MethodConfig, build_method, make_config
from ..methods.core import fused_attention_used
from ..models.inspection import sliding_layers
from ..models.loading import load_model, max_context, model_identity
from ..models.placement import device_map_of
from ..identity.overlap import check_method as check_calibration_overlap
from ..results.results_table import short_label
from ..identity.seeds import DETERMINISTIC_SEED, run_seeds
from ..method_facts import is_stochastic
from ..metrics.statistics import score_interval
from ..results.store import (
    SAMPLES_FILE,
    SampleLog,
    record_segment,
    record_segment_end,
    record_start,
    run_dir_for,
    write_progress,
    write_summary,
)
from ..tasks import build_task
from .wandb_logger import WandbLogger
from .batching import RECORD_STATS, Batcher
from .estimate import sample_tokens
from .run_config import RunConfig, check_method
from .run_spec import RunSpec

log = logging.getLogger("sparse_eval")

EMPTY_SELECTION_WARN = 0.05  # a run whose rows select no key of their own more often than this is flagged


class Experiment:
    """Loads the model and the task's samples once; runs one or several methods over them."""

    def __init__(self, run: RunConfig):
        if not isinstance(run, RunConfig):
            raise TypeError(
                f"Experiment takes a RunConfig, not {type(run).__name__}: build it from Hydra's config with "
                "sparse_eval.run.run_config.run_config(cfg)"
            )
        self.run = run
        self.model_cfg = run.model
        self.task_opts = run.task
        self.task = build_task(self.task_opts, data_dir=run.paths.data_dir)
        self.protocol = run.protocol
        self.batch_size = run.batch_size
        self.claims = list(run.claims)  # checked by ``run_config``; recorded in the summary
        self.model = self.tokenizer = None
        self._samples = None

    def method_configs(self) -> list[MethodConfig]:
        """The methods to run, as config dataclasses (``run_config.method_configs``)."""
        return list(self.run.methods)

    def load(self) -> None:
        if self.model is None:
            self.model, self.tokenizer = load_model(self.model_cfg)
            self.context = max_context(self.model_cfg, self.model)
            self.num_layers = self.model.config.get_text_config().num_hidden_layers
            self.model_identity = model_identity(
                self.model_cfg, self.model, dataclasses.asdict(self.run.paths), tokenizer=self.tokenizer
            )
            self.sliding = sliding_layers(self.model)  # {layer: window} of the layers that attend within a window

    def spec(self) -> RunSpec:
        """The typed ``RunSpec`` that batching, the memory checks and the time estimate take (the model loaded)."""
        self.load()
        return RunSpec(
            model=self.model,
            task=self.task,
            protocol=self.protocol,
            batch_size=self.batch_size,
            eval=self.run.eval,
            samples=self.samples,
            run_dir=self.run_dir,
        )

    def samples(self):
        if self._samples is None:
            self.load()
            t0 = time.perf_counter()
            self._samples = self.task.samples(self.tokenizer, self.context)
            log.info("task %s: %d samples made in %.1f s", self.task.name, len(self._samples), time.perf_counter() - t0)
        return self._samples

    def preflight(self, method_cfg: MethodConfig) -> Method:
        """Everything that can fail before a run has started, checked before anything is written to its run dir:
        the model (path, weights, dtype, device), the method against the model (dense layers vs depth, budgets vs
        context, DS's calibration file), the task's data and lengths vs the context.  Returns the method, built
        once for the run from its config with ``dense_layers`` resolved for this model (``method.config``, as
        recorded in the run's config and summary) and set up on the model: the run uses this object."""
        self.load()
        _, method = check_method(method_cfg, self.num_layers, self.context, self.sliding, self.model_cfg.name)
        method.setup(self.model, self.model_cfg.name)
        self.fused_attention(method)  # eval.fused_attention=on where it cannot run: refused now
        # calibration text (DS's channels) disjoint from the evaluated text, by content (sparse_eval.identity.overlap)
        check_calibration_overlap(method, self.task, self.samples(), self.tokenizer)
        return method

    def identity(self, method: Method | MethodConfig | dict[str, Any]) -> dict[str, Any]:
        """Everything that decides a run's results (its directory's hash): the model as loaded
        (``model_identity``: source, revision, GGUF file, dtype, config and file fingerprints; ``name`` is only
        the label), the method's config and the sha256 of what it reads from outside it (``inputs``:
        ``Method.external_inputs``, e.g. Double Sparsity's calibration file), the task, the sha256 of the local
        data files its samples were built from (``data``: RULER's essays and QA files, WikiText-2, LongBench files,
        published key-value records), the evaluation settings and the seed the method drew from (``method.seed``,
        set from the run's ``seed`` by ``method_configs``; recorded as ``seed`` and in the method).
        ``sliding_layers`` enters only for a model that has sliding layers: elsewhere it cannot change a result (and
        the runs made before it existed keep their directories)."""
        ev = self.run.eval
        built = method if isinstance(method, Method) else None  # a run's method (``preflight``): not built again
        if built is not None:
            method = built.config
        if dataclasses.is_dataclass(method):
            method = dataclasses.asdict(method)
        if method.get("seed") is None:  # options not from method_configs(): the seed it would give them
            method = dict(method, seed=run_seeds(self.run.seed)[0] if is_stochastic(method) else DETERMINISTIC_SEED)
        self.load()
        if not self.sliding:
            method = {k: v for k, v in method.items() if k != "sliding_layers"}
        model = self.model_identity
        built = built or build_method(make_config(method["name"], method))
        inputs = built.external_inputs(self.model_cfg.name)
        self.samples()  # the task's data files are known once its samples are built
        task = {k: v for k, v in self.task_opts.items() if not (v is None and k in self.task.identity_when_set)}
        ident = {
            "model": model,
            "method": method,
            "inputs": inputs,
            "task": task,
            "eval": {
                "protocol": self.protocol,
                "compute_error": ev.compute_error,
                "prefill_chunk": ev.prefill_chunk,
                "batch_invariant": ev.batch_invariant,
            },
            "seed": method["seed"],
        }
        if self.fused_attention(built):  # only where the kernel runs: every other run keeps its directory
            ident["eval"]["fused_attention"] = True
        if self.task.read_files:  # only tasks that read local data files: other runs keep their directories
            ident["data"] = {name: file_sha256(p) for name, p in sorted(self.task.read_files.items())}
        return ident

    def fused_attention(self, method: Method) -> bool:
        """Whether ``method``'s sparse calls take the fused kernel on this model's device and dtype
        (``eval.fused_attention`` resolved by ``core.fused_attention_used``; raises for ``on`` where it cannot run)."""
        self.load()
        setting = self.run.eval.fused_attention
        return fused_attention_used(setting, method, self.model.device, self.model.dtype)

    def run_dir(self, method: Method | MethodConfig) -> tuple[dict[str, Any], Path]:
        """(identity, run directory) of one method's run: the one place both are computed."""
        identity = self.identity(method)
        return identity, run_dir_for(self.run.paths.runs_dir, identity)

    def run_method(
        self, method: Method | MethodConfig, run_dir: Path | None = None, identity: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        """Run ``method`` (built, checked and set up by ``preflight``) over the samples its run dir lacks;
        returns the run's summary.  ``run_dir`` and ``identity``: as ``run_dir`` gives them (computed when not
        given).  A config instead of a method (a caller that skipped ``preflight``) is built as it is, checked
        against the model and set up here."""
        if not isinstance(method, Method):
            self.load()
            method = build_method(method)
            method.validate(num_layers=self.num_layers, context=self.context)
            method.setup(self.model, self.model_cfg.name)
        if run_dir is None or identity is None:
            identity, run_dir = self.run_dir(method)
        method_cfg = method.config
        first_start = record_start(run_dir, identity)
        samples_log = SampleLog(run_dir / SAMPLES_FILE)
        if self.run.eval.rerun_failed:
            samples_log.drop_failed()
        samples = self.samples()
        todo = [s for s in samples if not samples_log.done(s.id)]
        write_progress(run_dir, len(samples), len(samples) - len(todo))  # for `python -m sparse_eval.results.status`
        if method.external_inputs(self.model_cfg.name) != identity["inputs"]:
            raise RuntimeError(
                f"{run_dir}: a file the method reads changed after the run was named "
                f"({identity['inputs']}); run again to file the results under the new contents"
            )
        if todo:  # this process's segment of the run: the samples to come may be written by other code than before
            record_segment(run_dir, len(samples) - len(todo), first=first_start)
        self._provenance = method.provenance()
        torch.manual_seed(method_cfg.seed)
        spec = self.spec()
        ev = spec.eval
        session = attach(
            self.model,
            method,
            Runtime(
                self.protocol,
                ev.compute_error,
                ev.query_chunk,
                batch_invariant=ev.batch_invariant,
                fused_attention=ev.fused_attention,
            ),
        )
        engine = Engine(self.model, self.tokenizer, session, ev.prefill_chunk)
        logger = WandbLogger(self.run.logger, run_dir, identity)
        batcher = Batcher(spec, session, engine, todo)
        label = short_label(identity["method"])
        if todo:  # the bar below moves when a batch finishes: on a CPU the first one can take minutes
            longest = max((sample_tokens(s) for s in todo), default=0)
            log.info("%s: running %d of %d samples (%d tokens the longest)", label, len(todo), len(samples), longest)
        try:
            with tqdm(
                total=len(samples),
                initial=len(samples) - len(todo),
                desc=label,
                unit="sample",
                disable=not todo,
                leave=False,
                dynamic_ncols=True,
            ) as bar:
                for recs in batcher:
                    for rec in recs:
                        samples_log.append(rec)
                        logger.log_sample(rec)
                    bar.update(len(recs))
                    bar.set_postfix(batch=batcher.size, refresh=False)
        finally:
            detach(self.model)
            if todo:
                record_segment_end(run_dir, sum(s.id in samples_log.records for s in samples))
        self._batch_used = batcher.used
        records = [samples_log.records[s.id] for s in samples if s.id in samples_log.records]
        summary = self.summarize(run_dir, identity, records, method)
        write_summary(run_dir, summary)
        logger.finish(summary)
        return summary

    def sliding_dense_layers(self, method: Method) -> list[int]:
        """The layers a run of ``method`` left dense because they attend within a sliding window
        (``attention.plugin.layer_plan``; [] for a model without sliding layers)."""
        if not self.sliding:
            return []
        return layer_plan(method, self.num_layers, self.sliding)[1]

    def summarize(
        self, run_dir: Path, identity: dict[str, Any], records: list[dict[str, Any]], method: Method
    ) -> dict[str, Any]:
        """The run's summary (summary.json) from the sample records of ``method``'s run."""
        ok = [r for r in records if r.get("status") == "ok"]
        metrics = self.task.aggregate(ok)
        out: dict[str, Any] = {
            "run_dir": str(run_dir),
            "model": identity["model"]["name"],
            "model_identity": identity["model"],
            "inputs": identity.get("inputs", {}),
            "method": identity["method"]["name"],
            "method_config": identity["method"],
            "method_provenance": getattr(self, "_provenance", {}),
            "task": identity["task"]["name"],
            "task_config": identity["task"],
            "protocol": self.protocol,
            "dense_layers": identity["method"].get("dense_layers"),
            "sliding_layers": identity["method"].get("sliding_layers"),
            "sliding_dense_layers": self.sliding_dense_layers(method),
            # the layers the method ran in: every layer but its dense ones and the sliding ones left dense
            "sparse_layers": []
            if method.dense
            else sorted(set(range(self.num_layers)) - layer_plan(method, self.num_layers, self.sliding)[0]),
            "sink": identity["method"].get("sink"),
            "local": identity["method"].get("local"),
            "prefill_chunk": self.run.eval.prefill_chunk,
            "batch_size": getattr(self, "_batch_used", None),
            "metric": self.task.metric,
            "score": metrics.get(self.task.metric),
            "score_ci": score_interval(self.task, ok),
            "metrics": metrics,
            "samples": len(ok),
            "failed": len(records) - len(ok),
            "expected_samples": len(self.samples()),
            # every expected sample finished without an error (a run with failed samples is not complete)
            "complete": len(ok) >= len(self.samples()),
            "seed": identity["seed"],
            "stochastic": method.stochastic,
            "time_s": sum(r.get("time_s", 0.0) for r in records),
            # the experiment's claims as declared for this run (``verdicts.claims``): the margins its verdicts use
            "claims": getattr(self, "claims", []),
        }
        placed = device_map_of(self.model) if self.model is not None else None
        if placed:  # where the model was placed (``model.device_map``): how it ran, not what it computed (no identity)
            out["device_map"] = placed
        for key in (*RECORD_STATS, "empty_selections"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            out[key] = sum(vals) / len(vals) if vals else None
        empty, rows = (sum(r.get(k) or 0.0 for r in ok) for k in ("empty_selections", "sparse_rows"))
        out["empty_selection_rate"] = empty / rows if rows else None
        out["warnings"] = []
        if rows and empty / rows > EMPTY_SELECTION_WARN:
            msg = (
                f"{run_dir.name}: the method selected no key of its own in {empty / rows:.1%} of its "
                f"{int(rows)} sparse rows (> {EMPTY_SELECTION_WARN:.0%}); those rows attend only to the static keys"
            )
            log.warning(msg)
            out["warnings"].append(msg)
        for msg in self.task.summary_warnings(ok):
            log.warning("%s: %s", run_dir.name, msg)
            out["warnings"].append(f"{run_dir.name}: {msg}")
        for key in ("cost1", "cost2", "est_error"):
            layers: dict[str, list[float]] = {}
            for r in ok:
                for l, v in (r.get(f"{key}_per_layer") or {}).items():
                    layers.setdefault(str(l), []).append(v)
            out[f"{key}_per_layer"] = {l: sum(v) / len(v) for l, v in sorted(layers.items(), key=lambda x: int(x[0]))}
        return out
