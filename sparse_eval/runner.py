"""Running model × method × task: every run is a pure function of its config (so sweeps can skip and resume)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .attention.plugin import PROTOCOLS, Runtime, attach, check_sparse_layers, detach, layer_plan
from .config import CONF_DIR, to_plain  # noqa: F401 (CONF_DIR re-exported)
from .engine import Engine
from .estimate import check_long
from .fingerprint import file_sha256
from .memory import auto_batch_cap, check_batch
from .methods import MethodConfig, build_method, compare_names, make_config
from .methods.base import resolve_dense_layers
from .models.inspection import sliding_layers
from .models.loading import ModelConfig, load_model, max_context, model_identity
from .ordering import ORDER_WINDOW_BATCHES, length_windows, sample_stratum, stratified_order
from .overlap import check_method as check_calibration_overlap
from .results_table import (INCOMPLETE_MARK, NO_VALUE, SINGLE_SEED_MARK,  # noqa: F401 (re-exported)
                            format_table, plural, pool_seeds, print_results, reuse_note, short_config)
from .seeds import DETERMINISTIC_SEED, is_stochastic, run_seeds, seeded_configs
from .statistics import bootstrap_ci
from .status import run_state
from .store import (SAMPLES_FILE, SUMMARY_FILE, RunsDirError, SampleLog, check_writable, clear_failure, record_start,
                    run_dir_for, run_lock, write_failure, write_progress, write_summary)
from .tasks import build_task

log = logging.getLogger("sparse_eval")

RECORD_STATS = ("cost1", "cost2", "kv_bytes", "static_frac", "est_error", "mass", "topk_recall")
EMPTY_SELECTION_WARN = 0.05  # a run whose rows select no key of their own more often than this is flagged
AUTO_BATCH_START = 128  # eval.batch_size=auto tries min(samples, this) first, then halves on out-of-memory


def method_options(name: str) -> dict[str, Any]:
    """The options of the method config ``conf/method/<name>.yaml``, composed by Hydra (so its schema checks
    them; used for the methods listed in ``compare``)."""
    return methods_options([name])[0]


def methods_options(names: list[str]) -> list[dict[str, Any]]:
    """``method_options`` of several names in one composition (each under its own key of ``method``: the same
    options, composed once instead of once per name, about 0.2 s each)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    from .config import register_configs

    register_configs()
    overrides = [f"+method@method._m{i}={name}" for i, name in enumerate(names)]
    try:
        if GlobalHydra.instance().is_initialized():  # inside the Hydra app (or a test's initialize context)
            cfg = compose(config_name="config", overrides=overrides)
        else:
            with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
                cfg = compose(config_name="config", overrides=overrides)
    except MissingConfigException:
        valid = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
        name = next((n for n in names if not (CONF_DIR / "method" / f"{n}.yaml").is_file()), names[0])
        raise ValueError(f"no method config {name!r} (conf/method/{name}.yaml); valid: {valid}") from None
    return [to_plain(cfg.method[f"_m{i}"]) for i in range(len(names))]


def is_out_of_memory(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc)))


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
        self.batch_size = check_batch_size(cfg.eval.get("batch_size", 1))
        self.model = self.tokenizer = None
        self._samples = None

    def method_configs(self) -> list[MethodConfig]:
        """The methods to run, as config dataclasses, each validated before any work (a bad value fails at start,
        naming it): one per seed of ``seed`` for a stochastic method, one for a deterministic one
        (``seeds.seeded_configs``)."""
        if self.cfg.method is not None:
            opts = [to_plain(self.cfg.method)]
        else:
            entries = [to_plain(e) for e in (self.cfg.compare if self.cfg.get("compare") is not None
                                             else compare_names())]
            names = [e if isinstance(e, str) else e["name"] for e in entries]
            opts = [o if isinstance(e, str) else o | {k: v for k, v in e.items() if k != "name"}
                    for e, o in zip(entries, methods_options(names) if names else [])]
        return [c for o in opts for c in seeded_configs(o, self.cfg.seed)]

    def load(self) -> None:
        if self.model is None:
            self.model, self.tokenizer = load_model(self.model_cfg)
            self.context = max_context(self.model_cfg, self.model)
            self.num_layers = self.model.config.get_text_config().num_hidden_layers
            self.model_identity = model_identity(self.model_cfg, self.model, to_plain(self.cfg.paths))
            self.sliding = sliding_layers(self.model)  # {layer: window} of the layers that attend within a window

    def samples(self):
        if self._samples is None:
            self.load()
            self._samples = self.task.samples(self.tokenizer, self.context)
        return self._samples

    def preflight(self, method_cfg: MethodConfig) -> MethodConfig:
        """Everything that can fail before a run has started, checked before anything is written to its run dir:
        the model (path, weights, dtype, device), the method against the model (dense layers vs depth, budgets vs
        context, DS's calibration file), the task's data and lengths vs the context.  Returns the method's
        config with ``dense_layers`` resolved for this model (as recorded in the run's config and summary)."""
        self.load()
        resolved = dataclasses.replace(method_cfg, dense_layers=resolve_dense_layers(method_cfg.dense_layers,
                                                                                     self.num_layers))
        method = build_method(resolved)
        method.validate(num_layers=self.num_layers, context=self.context)
        dense, _ = layer_plan(method, self.num_layers, self.sliding)  # refuses one left no layer by sliding ones
        check_sparse_layers(method, self.num_layers, dense, self.model_cfg.name)  # and by its dense_layers
        method.setup(self.model, self.model_cfg.name)
        # calibration text (DS's channels) disjoint from the evaluated text, by content (sparse_eval.overlap)
        check_calibration_overlap(method, self.task, self.samples(), self.tokenizer)
        return resolved

    def identity(self, method: MethodConfig | dict[str, Any]) -> dict[str, Any]:
        """Everything that decides a run's results (its directory's hash): the model as loaded
        (``model_identity``: source, revision, GGUF file, dtype, config and file fingerprints; ``name`` is only
        the label), the method's config and the sha256 of what it reads from outside it (``inputs``:
        ``Method.external_inputs``, e.g. Double Sparsity's calibration file), the task, the sha256 of the local
        data files its samples were built from (``data``: RULER's essays and QA files, WikiText-2, LongBench files,
        published key-value records), the evaluation settings and the seed the method drew from (``method.seed``,
        set from the run's ``seed`` by ``method_configs``; recorded as ``seed`` and in the method).
        ``sliding_layers`` enters only for a model that has sliding layers: elsewhere it cannot change a result (and
        the runs made before it existed keep their directories)."""
        ev = self.cfg.eval
        if dataclasses.is_dataclass(method):
            method = dataclasses.asdict(method)
        if method.get("seed") is None:  # options not from method_configs(): the seed it would give them
            method = dict(method, seed=run_seeds(self.cfg.seed)[0] if is_stochastic(method) else DETERMINISTIC_SEED)
        self.load()
        if not self.sliding:
            method = {k: v for k, v in method.items() if k != "sliding_layers"}
        model = self.model_identity
        inputs = build_method(make_config(method["name"], method)).external_inputs(self.model_cfg.name)
        self.samples()  # the task's data files are known once its samples are built
        task = {k: v for k, v in self.task_opts.items() if not (v is None and k in self.task.identity_when_set)}
        ident = {
            "model": model,
            "method": method,
            "inputs": inputs,
            "task": task,
            "eval": {"protocol": self.protocol, "compute_error": ev.compute_error, "prefill_chunk": ev.prefill_chunk,
                     "batch_invariant": ev.batch_invariant},
            "seed": method["seed"],
        }
        if self.task.read_files:  # only tasks that read local data files: other runs keep their directories
            ident["data"] = {name: file_sha256(p) for name, p in sorted(self.task.read_files.items())}
        return ident

    def run_dir(self, method_cfg: MethodConfig) -> tuple[dict[str, Any], Path]:
        """(identity, run directory) of one method's run: the one place both are computed."""
        identity = self.identity(method_cfg)
        return identity, run_dir_for(self.cfg.paths.runs_dir, identity)

    def run_method(self, method_cfg: MethodConfig, run_dir: Path | None = None) -> dict[str, Any]:
        if run_dir is None:
            identity, run_dir = self.run_dir(method_cfg)
        else:
            identity = self.identity(method_cfg)
        method = build_method(method_cfg)
        record_start(run_dir, identity)
        samples_log = SampleLog(run_dir / SAMPLES_FILE)
        if self.cfg.eval.rerun_failed:
            samples_log.drop_failed()
        samples = self.samples()
        todo = [s for s in samples if not samples_log.done(s.id)]
        write_progress(run_dir, len(samples), len(samples) - len(todo))  # for `python -m sparse_eval.status`
        method.validate(num_layers=self.num_layers, context=self.context)
        method.setup(self.model, self.model_cfg.name)
        if method.external_inputs(self.model_cfg.name) != identity["inputs"]:
            raise RuntimeError(f"{run_dir}: a file the method reads changed after the run was named "
                               f"({identity['inputs']}); run again to file the results under the new contents")
        self._provenance = method.provenance()
        torch.manual_seed(method_cfg.seed)
        session = attach(self.model, method, Runtime(self.protocol, self.cfg.eval.compute_error, self.cfg.eval.query_chunk,
                                                     batch_invariant=self.cfg.eval.batch_invariant))
        engine = Engine(self.model, self.tokenizer, session, self.cfg.eval.prefill_chunk)
        logger = _Logger(self.cfg.logger, run_dir, identity)
        batcher = _Batcher(self, session, engine, todo)
        label = short_label(identity['method'])
        try:
            with tqdm(total=len(samples), initial=len(samples) - len(todo), desc=label, unit="sample",
                      disable=not todo, leave=False, dynamic_ncols=True) as bar:
                for recs in batcher:
                    for rec in recs:
                        samples_log.append(rec)
                        logger.log_sample(rec)
                    bar.update(len(recs))
                    bar.set_postfix(batch=batcher.size, refresh=False)
        finally:
            detach(self.model)
        self._batch_used = batcher.used
        records = [samples_log.records[s.id] for s in samples if s.id in samples_log.records]
        summary = self.summarize(run_dir, identity, records)
        write_summary(run_dir, summary)
        logger.finish(summary)
        return summary

    def sliding_dense_layers(self, method: dict[str, Any]) -> list[int]:
        """The layers a run of ``method`` (its recorded config) left dense because they attend within a sliding
        window (``attention.plugin.layer_plan``; [] for a model without sliding layers)."""
        if not self.sliding:
            return []
        return layer_plan(build_method(make_config(method["name"], method)), self.num_layers, self.sliding)[1]

    def summarize(self, run_dir: Path, identity: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
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
            "sliding_dense_layers": self.sliding_dense_layers(identity["method"]),
            "sink": identity["method"].get("sink"),
            "local": identity["method"].get("local"),
            "prefill_chunk": self.cfg.eval.prefill_chunk,
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
            "stochastic": build_method(make_config(identity["method"]["name"], identity["method"])).stochastic,
            "time_s": sum(r.get("time_s", 0.0) for r in records),
        }
        for key in (*RECORD_STATS, "empty_selections"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            out[key] = sum(vals) / len(vals) if vals else None
        empty, rows = (sum(r.get(k) or 0.0 for r in ok) for k in ("empty_selections", "sparse_rows"))
        out["empty_selection_rate"] = empty / rows if rows else None
        out["warnings"] = []
        if rows and empty / rows > EMPTY_SELECTION_WARN:
            msg = (f"{run_dir.name}: the method selected no key of its own in {empty / rows:.1%} of its "
                   f"{int(rows)} sparse rows (> {EMPTY_SELECTION_WARN:.0%}); those rows attend only to the static keys")
            log.warning(msg)
            out["warnings"].append(msg)
        for key in ("cost1", "cost2", "est_error"):
            layers: dict[str, list[float]] = {}
            for r in ok:
                for l, v in (r.get(f"{key}_per_layer") or {}).items():
                    layers.setdefault(str(l), []).append(v)
            out[f"{key}_per_layer"] = {l: sum(v) / len(v) for l, v in sorted(layers.items(), key=lambda x: int(x[0]))}
        return out


def score_interval(task: Any, records: list[dict[str, Any]], seed: int = 0) -> dict[str, Any] | None:
    """The score's 95 % bootstrap interval over the finished samples (``sparse_eval.statistics``): {lo, hi, n,
    level, n_boot}; None where the task's samples are not units an interval can be drawn over."""
    terms = task.score_terms(records)
    if terms is None:
        return None
    ci = bootstrap_ci(terms, seed=seed)
    return {k: ci[k] for k in ("lo", "hi", "n", "level", "n_boot")}


def check_batch_size(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"eval.batch_size={value!r}: give an integer >= 1 or 'auto' (the largest batch that fits)")
    return value


class _Batcher:
    """Yields the records of the samples still to run, batch by batch, in the order of ``sparse_eval.ordering``
    (subtasks interleaved so that a partial run is an unbiased subset; within windows of a few batches, samples of
    similar prompt length together; under protocol S with ``prefill_chunk`` only samples whose lengths agree modulo
    the chunk share a batch, so each row sees its own chunk boundaries).  ``auto`` halves the batch on
    out-of-memory; a batch that fails otherwise is rerun one sample at a time, so a failing sample is recorded
    alone and the rest go on."""

    def __init__(self, exp: Experiment, session: Any, engine: Engine, todo: list[Any]):
        self.exp, self.session, self.engine = exp, session, engine
        self.task = exp.task
        want = exp.batch_size
        self.auto = want == "auto"
        batched = self.task.batched and len(todo) > 1
        self.size = 1 if not batched else min(len(todo), AUTO_BATCH_START) if self.auto else want
        if self.auto:  # on the CPU: no larger than the rows that fit the host memory (sparse_eval.memory)
            self.size = auto_batch_cap(exp, session.method.config, todo, self.size)
        self.used: int | None = None
        self.todo = self._order(todo)

    def _order(self, todo: list[Any]) -> list[Any]:
        """``todo`` in the task's processing order (``ordering``: computed over all the task's samples, so a
        resumed run continues the same order), then sorted by length within windows of batches."""
        everything = self.exp.samples()
        want = {s.id for s in todo}
        ranked = [everything[i] for i in stratified_order([s.id for s in everything],
                                                          [sample_stratum(s) for s in everything])]
        order = [s for s in ranked if s.id in want]
        if self.size == 1:
            return order
        lengths = {s.id: len(self.task.request(s).input_ids) for s in order}
        chunk = self.exp.cfg.eval.prefill_chunk
        group = (lambda n: n % chunk) if chunk and self.exp.protocol == "S" else (lambda n: 0)
        return length_windows(order, self.size * ORDER_WINDOW_BATCHES,
                              key=lambda s: (group(lengths[s.id]), -lengths[s.id]))

    def __iter__(self):
        i = 0
        while i < len(self.todo):
            batch = self._take(i)
            try:
                recs = self._run(batch)
            except Exception as exc:  # noqa: BLE001 - recorded per sample below
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                if self.auto and len(batch) > 1 and is_out_of_memory(exc):
                    self._free()
                    self.size = max(1, len(batch) // 2)
                    log.warning("batch of %d out of memory; trying %d", len(batch), self.size)
                    continue
                if len(batch) == 1:
                    recs = [self._failed(batch[0], exc)]
                else:
                    log.warning("batch of %d failed (%r); running its samples one at a time", len(batch), exc)
                    self._free()
                    recs = []
                    for s in batch:
                        try:
                            recs += self._run([s])
                        except Exception as exc1:  # noqa: BLE001
                            if isinstance(exc1, (KeyboardInterrupt, SystemExit)):
                                raise
                            recs.append(self._failed(s, exc1))
                if any(r.get("oom") for r in recs):  # not the samples' fault: stop, keeping what finished
                    yield [r for r in recs if not r.get("oom")]
                    raise RuntimeError(
                        f"out of memory running one sample alone (eval.batch_size={self.exp.batch_size}); the run "
                        "stopped with its finished samples kept. Free the device (other processes?) or shorten the "
                        "task, then run the same command to resume") from exc
            self.used = max(self.used or 0, len(batch))
            i += len(batch)
            yield recs

    def _take(self, i: int) -> list[Any]:
        """The next batch: up to ``size`` samples, cut where the prefill chunks of a sparse phase would not
        coincide with the rows' own (``Engine`` lays them from the first row's start, or under protocol B from the
        first context end)."""
        batch = self.todo[i:i + self.size]
        chunk = self.exp.cfg.eval.prefill_chunk
        if not chunk or len(batch) == 1:
            return batch
        reqs = [self.task.request(s) for s in batch]
        if self.exp.protocol == "S":  # never mix chunk alignments in one batch
            r = len(reqs[0].input_ids) % chunk
            n = 1
            while n < len(batch) and len(reqs[n].input_ids) % chunk == r:
                n += 1
            return batch[:n]
        if self.exp.protocol == "B":  # a question longer than a chunk is split at its own boundaries: alone
            long = [len(q.input_ids) - (q.context_len or 0) > chunk for q in reqs]
            if long[0]:
                return batch[:1]
            n = 1
            while n < len(batch) and not long[n]:
                n += 1
            return batch[:n]
        return batch

    def _free(self) -> None:
        self.session.recorder.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _run(self, batch: list[Any]) -> list[dict[str, Any]]:
        """The records of one batch: the task's fields and each row's own statistics; ``time_s`` is the
        batch's wall time shared equally by its samples."""
        self.session.recorder.reset()
        t0 = time.perf_counter()
        recs = self.task.run_batch(batch, self.engine)
        dt = (time.perf_counter() - t0) / len(batch)
        rows = self.session.recorder.batch_rows()
        out = []
        for i, (sample, rec) in enumerate(zip(batch, recs)):
            stats = self.session.recorder.summary(row=i if rows == len(batch) else None)
            out.append({"id": sample.id, "status": "ok", **rec, **_stats_fields(stats), "time_s": dt})
        return out

    @staticmethod
    def _failed(sample: Any, exc: BaseException) -> dict[str, Any]:
        if is_out_of_memory(exc):  # a property of the machine's state, not of the sample: never recorded
            return {"id": sample.id, "oom": True}
        log.warning("sample %s failed: %r", sample.id, exc)
        return {"id": sample.id, "status": "error", "error": repr(exc), "traceback": traceback.format_exc(limit=8),
                "time_s": 0.0}


def _stats_fields(stats: dict[str, Any]) -> dict[str, Any]:
    out = {k: stats.get(k) for k in RECORD_STATS}
    out["empty_selections"] = stats.get("empty_selections", 0.0)
    out["sparse_rows"] = stats.get("sparse_rows", 0.0)
    for key in ("cost1", "cost2", "est_error"):
        out[f"{key}_per_layer"] = stats.get(f"{key}_per_layer", {})
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


def short_label(method: dict[str, Any]) -> str:
    """The progress bar's label: the method and its headline options, e.g. ``magicpig K=10, L=150``."""
    return f"{method['name']} {short_config(method)}".strip()


def _reused(run_dir: Path) -> tuple[int, int]:
    """(samples already written when the run (re)started, samples expected), from its progress.json."""
    from .store import PROGRESS_FILE, read_json

    p = read_json(run_dir / PROGRESS_FILE) or {}
    return int(p.get("done_at_start") or 0), int(p.get("expected_samples") or 0)


def run(cfg: Any, use_cache: bool = True) -> list[dict[str, Any]]:
    """Run every method of ``cfg`` (or read back the finished ones) and print the table; returns the summaries.
    A launch whose runs all finished before is answered from the launch cache (``sparse_eval.launch``) without
    loading the model; ``use_cache=False`` skips that lookup (the caller made it).  After a launch whose every
    run finished, its cache entry is written."""
    from . import launch
    from .fingerprint import recording
    from .tasks.base import HUB_READS

    if use_cache:
        hit = launch.reuse(cfg)
        if hit is not None:
            return hit
    started_ns, hub_reads = time.time_ns(), HUB_READS[0]
    with recording() as files:
        summaries, identities = _run(cfg)
    launch.record(cfg, identities, summaries, files, HUB_READS[0] - hub_reads, started_ns)
    return summaries


def _run(cfg: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``run`` the normal way: loads the model and the samples, runs or reads back each method's run; returns
    (summaries, identities)."""
    exp = Experiment(cfg)
    methods = [exp.preflight(m) for m in exp.method_configs()]  # a run that cannot start writes nothing
    check_batch(exp, methods, exp.samples())  # memory (MagicPIG's tables; on the CPU, the batch): refused here
    check_long(exp, methods, log)  # on the CPU, over an hour: refused unless eval.allow_long=true
    summaries, identities = [], []
    reused: list[tuple[int, int]] = []  # per run: (samples already saved at its start, expected)
    for m in methods:
        identity, run_dir = exp.run_dir(m)
        identities.append(identity)
        unwritable = check_writable(run_dir)
        if unwritable:  # a read-only store: a finished run is read back, anything else is refused
            state = run_state(run_dir)["state"]
            if state == "done" or (state == "incomplete" and not cfg.eval.rerun_failed):
                summaries.append(json.loads((run_dir / SUMMARY_FILE).read_text(encoding="utf-8")))
                reused.append((summaries[-1]["samples"], summaries[-1]["samples"]))
                continue
            raise RunsDirError(f"paths.runs_dir={cfg.paths.runs_dir}: cannot write {unwritable}; give a writable "
                               f"folder, e.g. paths.runs_dir=runs")
        try:
            with run_lock(run_dir):  # one process per run dir: a duplicate job waits, then finds the samples done
                clear_failure(run_dir)
                summaries.append(exp.run_method(m, run_dir))
            reused.append(_reused(run_dir))
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
        print_results(exp.task, summaries, reused)
    return summaries, identities
