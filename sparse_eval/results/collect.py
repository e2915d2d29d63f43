"""Every run under a folder gathered into one tidy table (CSV and parquet).

    python -m sparse_eval.results.collect runs/                       # writes runs/results.csv and runs/results.parquet
    python -m sparse_eval.results.collect runs/ --wide                # every run's row (22 columns), not the compact
    python -m sparse_eval.results.collect runs/ruler --out /tmp/ruler  # /tmp/ruler.csv, /tmp/ruler.parquet
    python -m sparse_eval.results.collect runs/ --no-subtasks          # one row per run
    python -m sparse_eval.results.collect runs/ --full-at-least 30     # + rows over the subtasks full attention solves

It prints the table fitted to the terminal (``sparse_eval.results.terminal_table``: one row per configuration, its seeds
pooled) and writes every column to the files. One row per (model, method with its parameters, task with its
parameters, subtask, length, protocol, seed). Rows of runs that differ only in their seed (``seeds.seed_group``: the
same identity without the seed) also carry the scores pooled over those seeds (``pooled_*``, ``seed_*``): the mean
over seeds with its two-level interval over prompts and seeds (``sparse_eval.metrics.statistics``), and the paired
difference against full attention the same way. A run (``<runs_dir>/<task>/<model>/<method>-<hash>``: config.yaml,
samples.jsonl, summary.json, meta.json) gives one row per subtask and length found in its per-sample records (fields
``subtask`` -- or ``lm_eval_task`` -- and, for tasks with a ``length`` setting, ``length``), plus one row
``subtask = "all"`` with the task's own aggregate over all its samples when it has several subtasks.
Scores of a row are the task's own ``aggregate`` over that row's finished samples (e.g. perplexity =
exp(mean NLL), LongBench = mean of per-dataset means), so a subtask row equals what the task reports for that subtask.

Columns (see also docs/sweeps.md):

  model, model_path                  the loaded model's label and path (run identity; not the config's name when
                                     model.path was overridden under it), model_gguf_file, model_revision,
                                     model_dtype, model_fingerprint (sha256 of its files, else of its config),
                                     model_tokenizer (sha256 of its ids of the canary text: one file tokenized
                                     two ways is two models; None in records made before it was recorded)
  method, method_config              method name; "name-key=value-..." of its own parameters (store.method_label)
  run_name                           method_config + dense layers + the task's length + hash (status.run_name)
  method.<field>                     every method field (budget, K, L, page_size, alpha, beta, ...; NaN if absent)
  sink, local, dense_layers, gqa     the shared method fields (dense_layers as "0,16")
  sliding_layers                     dense | sparse: how layers with a sliding window ran (None: the model has none)
  task, task_config                  task name; its config as JSON (all fields)
  subtask, length                    from the per-sample records ("all": the whole run; length: the task's
                                     length setting, or the records' when they vary; "full>=X": with
                                     --full-at-least X, the run over only the subtasks on which full attention's
                                     complete run scores at least X, named in subset_subtasks)
  protocol, prefill_chunk,           evaluation settings (batch_invariant: the fixed-order kernels of
  batch_invariant                    ``sparse_eval.invariance``; None for runs made before the setting existed)
  fused_attention                    whether the sparse calls took the fused kernel (``eval.fused_attention``
                                     resolved: ``kernels.selected_attention``); False where it was not used
  seed                               the seed the run's method drew from (``seeds.effective_seed``)
  seed_group, stochastic             the hash of the run's identity without its seed; whether the method draws at
                                     random (``Method.stochastic``)
  metric, score                      the task's headline metric name and value for this row
  score_lo, score_hi                 its 95 % bootstrap interval over the row's samples (sparse_eval.metrics.statistics;
                                     None for a task whose samples are not units, e.g. lm_eval without documents)
  diff_vs_full, diff_lo, diff_hi,    the paired difference score − full attention's score over the samples both
  n_paired, significant              finished (same model, task config, protocol, subtask, length), its 95 % paired
                                     bootstrap interval, that number of shared samples, and whether the interval
                                     excludes 0 (None below 8 shared samples, and when either run is incomplete)
  seeds, seed_values                 the runs of the row's seed group (distinct seeds) and their seeds, "0,1,2",
                                     pooled below: the complete ones when some are complete, else all
  seeds_left_out, pooled             the group's seeds not complete while others are, left out of the pooling
                                     ("1,2"; None when none), and whether this row's run is pooled
  seed_std, seed_min, seed_max       spread of the per-seed scores (on the samples every seed finished)
  pooled_score, pooled_lo,           the mean over the seeds of the score, over the pooled_n samples every seed
  pooled_hi, pooled_n                finished, and its 95 % two-level bootstrap interval (prompts and seeds)
  pooled_diff, pooled_diff_lo,       the same for the paired difference against full attention, over the
  pooled_diff_hi, pooled_n_paired,   pooled_n_paired samples every seed and full attention finished;
  pooled_significant                 significant as above
  interval_omits_seeds               True for a stochastic method's row from a single seed: its intervals (own and
                                     pooled) leave out the seed-to-seed variation; False otherwise
  cost1, cost2, kv_bytes, est_error, mass, topk_recall, static_frac, empty_selections
                                     means over the row's samples (each sample's value is a mean over sparse
                                     layers, heads and query rows): Cost1 search/sampling FLOPs ratio, Cost2
                                     attended-key fraction, KV bytes read per row, relative L2 error of the
                                     attention output, dense attention mass on the kept keys, top-k recall of them
  samples, failed_samples            finished / errored sample records in the row; ``samples`` in the task's
                                     units (``Task.units``: lm-eval's documents, not its records' pieces)
  expected_samples, complete         the run's expected sample count (in those units); every one of them
                                     finished without an error
                                     (run-level: a run with a failed sample is not complete)
  state                              done / incomplete / running / failed / pending (sparse_eval.results.status)
  time_s                             sum of the row's per-sample times
  git_commit, git_dirty, sparse_eval_version, torch_version, transformers_version, python_version, hardware,
  started                            provenance from meta.json (the run's first start)
  git_diff_sha256, provenance_version
                                     the hash of a dirty checkout's difference from its commit, and the record's
                                     version (sparse_eval.identity.provenance; none before version 2)
  segments, git_commits, mixed_provenance
                                     the starts that wrote the run's samples (the first and each restart that added
                                     some: meta.json's ``resumes``), their commits in order (";"), and whether a
                                     restart ran other code, numeric libraries or device than the first
  run_dir, config_hash               where the row came from
  error                              why a run could not be read (state "unreadable": its config.yaml is torn or
                                     corrupt; the row has no score)

Exit status: 0 the table holds every run; 1 a run could not be read (its row says so) or there is no run; 2 the
folder does not exist or the table cannot be written.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from ..identity.seeds import effective_seed, seed_group
from ..method_facts import is_stochastic
from ..metrics.statistics import bootstrap_ci, paired_difference, seed_pooled_ci, seed_pooled_difference, seed_spread
from .status import run_state
from .store import (
    META_FILE,
    SAMPLES_FILE,
    SUMMARY_FILE,
    find_run_dirs,
    method_label,
    read_identity,
    read_json,
    read_samples,
)

SUBTASK_FIELDS = ("subtask", "lm_eval_task")
SINGLE_SEED_MARK = "†"
POOLED_COLUMNS = (
    "seeds",
    "seed_values",
    "seed_std",
    "seed_min",
    "seed_max",
    "pooled_score",
    "pooled_lo",
    "pooled_hi",
    "pooled_n",
    "pooled_diff",
    "pooled_diff_lo",
    "pooled_diff_hi",
    "pooled_n_paired",
    "pooled_significant",
    "interval_omits_seeds",
    "seeds_left_out",
)
MEAN_FIELDS = ("cost1", "cost2", "kv_bytes", "est_error", "mass", "topk_recall", "static_frac", "empty_selections")
LEAD_COLUMNS = [
    "model",
    "method",
    "method_config",
    "run_name",
    "task",
    "subtask",
    "length",
    "protocol",
    "metric",
    "score",
    "score_lo",
    "score_hi",
    "samples",
    "diff_vs_full",
    "diff_lo",
    "diff_hi",
    "n_paired",
    "significant",
    "seed",
    *(c for c in POOLED_COLUMNS if c != "seed_values"),
    "pooled",
    "cost1",
    "cost2",
    "est_error",
    "failed_samples",
    "expected_samples",
    "complete",
    "state",
]


def _task(task_cfg: dict[str, Any]):
    """The task, for its ``aggregate`` and ``score_terms`` (None when it is unknown here); built from its config
    alone, without looking for its data."""
    try:
        from ..tasks.base import task_class

        cls = task_class(task_cfg["name"])
        task = cls.__new__(cls)  # no ``validate``: it looks for the task's data, which scoring needs not
        task.config, task.data_dir = cls.config_class(**task_cfg), None
        return task
    except Exception:  # noqa: BLE001 - an unknown/renamed task or option: fall back to the mean of `score`
        return None


def _terms(task: Any, ok: list[dict[str, Any]]):
    """The row's per-sample score terms (``Task.score_terms``), or None (unknown task, records it cannot read)."""
    if task is None or not ok:
        return None
    try:
        return task.score_terms(ok)
    except Exception:  # noqa: BLE001 - records of an older task version: no interval
        return None


def _mean(values: list[Any]) -> float | None:
    vals = [float(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
    return sum(vals) / len(vals) if vals else None


def _subtask(rec: dict[str, Any]) -> Any:
    for key in SUBTASK_FIELDS:
        if rec.get(key) is not None:
            return rec[key]
    return None


def _segment_key(seg: dict[str, Any]) -> tuple:
    """What of a start's provenance can change the samples it writes: the code (commit and difference), the
    numeric libraries and the device."""
    git, ver, hw = seg.get("git") or {}, seg.get("versions") or {}, seg.get("hardware") or {}
    return (
        git.get("commit"),
        git.get("diff_sha256"),
        *(ver.get(k) for k in ("torch", "transformers", "triton", "numba")),
        hw.get("gpu") or hw.get("cpu") or hw.get("machine"),
    )


def _provenance(meta: dict[str, Any]) -> dict[str, Any]:
    """The first start's provenance, and over it and every restart that added samples (meta.json's
    ``resumes``): their number, their commits in order, and whether any wrote with other code, libraries or
    device than the first."""
    git = meta.get("git") or {}
    ver = meta.get("versions") or {}
    hw = meta.get("hardware") or {}
    resumes = [r for r in meta.get("resumes") or [] if isinstance(r, dict)]
    commits = list(dict.fromkeys(str((s.get("git") or {}).get("commit")) for s in [meta, *resumes]))
    return {
        "git_commit": git.get("commit"),
        "git_dirty": git.get("dirty"),
        "git_diff_sha256": git.get("diff_sha256"),
        "provenance_version": git.get("version"),
        "sparse_eval_version": ver.get("sparse_eval"),
        "torch_version": ver.get("torch"),
        "transformers_version": ver.get("transformers"),
        "python_version": ver.get("python"),
        "hardware": hw.get("gpu") or hw.get("cpu") or hw.get("machine"),
        "started": meta.get("started"),
        "segments": 1 + len(resumes),
        "git_commits": ";".join(commits),
        "mixed_provenance": any(_segment_key(r) != _segment_key(meta) for r in resumes),
    }


def run_rows(run_dir: Path, by_subtask: bool = True, recent_s: float = 300.0) -> list[dict[str, Any]]:
    """The table rows of one run directory."""
    identity = read_identity(run_dir)
    if not identity or not isinstance(identity.get("method"), dict) or not isinstance(identity.get("task"), dict):
        return [unreadable_row(run_dir, recent_s)]
    method, task_cfg = identity["method"], identity["task"]
    model, ev = identity.get("model") or {}, identity.get("eval") or {}
    summary = read_json(run_dir / SUMMARY_FILE) or {}
    meta = read_json(run_dir / META_FILE) or {}
    state = run_state(run_dir, recent_s=recent_s)
    records = list(read_samples(run_dir / SAMPLES_FILE).values())
    task = _task(task_cfg)
    aggregate, metric = (task.aggregate, task.metric) if task is not None else (None, None)
    metric = metric or summary.get("metric") or "score"
    base: dict[str, Any] = {
        # the model as loaded (run identity; model.name of an overridden path is recorded in given_name)
        "model": model.get("name"),
        "model_path": model.get("path"),
        "model_gguf_file": model.get("gguf_file"),
        "model_revision": model.get("revision"),
        "model_dtype": model.get("dtype"),
        "model_fingerprint": (model.get("fingerprint") or {}).get("files_sha256")
        or (model.get("fingerprint") or {}).get("config_sha256"),
        # the tokenizer's behaviour (its ids of the canary text); None in records made before it was recorded
        "model_tokenizer": ((model.get("fingerprint") or {}).get("tokenizer") or {}).get("canary_sha256"),
        "method": method.get("name"),
        "method_config": method_label(method),
        "run_name": state["config"],
        **{
            f"method.{k}": v
            for k, v in method.items()
            if k not in ("name", "sink", "local", "dense_layers", "gqa", "sliding_layers")
            and not isinstance(v, (dict, list))
        },
        "sink": method.get("sink"),
        "local": method.get("local"),
        "dense_layers": ",".join(str(x) for x in method.get("dense_layers") or []) or None,
        "gqa": method.get("gqa"),
        "sliding_layers": method.get("sliding_layers"),
        "task": task_cfg.get("name"),
        "task_config": json.dumps(task_cfg, sort_keys=True, default=str),
        "protocol": ev.get("protocol"),
        "prefill_chunk": ev.get("prefill_chunk"),
        "batch_invariant": ev.get("batch_invariant"),
        "fused_attention": bool(ev.get("fused_attention", False)),
        "seed": effective_seed(identity),
        "seed_group": seed_group(identity),
        "stochastic": summary["stochastic"] if "stochastic" in summary else is_stochastic(method),
        "metric": metric,
        "expected_samples": state["expected"],
        "complete": state["complete"],
        "state": state["state"],
        # what the run found wrong with its own measurement (summary.json ``warnings``, e.g. lm-eval generations
        # that never stopped); None: nothing, or a run without a summary yet
        "warnings": " | ".join(summary.get("warnings") or []) or None,
        **_provenance(meta),
        "run_dir": str(run_dir),
        "config_hash": run_dir.name.rsplit("-", 1)[-1],
    }
    task_length = task_cfg.get("length")
    has_length = "length" in task_cfg  # a task whose length is an experimental setting (RULER, kv_retrieval)

    def row(recs: list[dict[str, Any]], subtask: Any, length: Any) -> dict[str, Any]:
        ok = [r for r in recs if r.get("status") == "ok"]
        score = None
        if aggregate is not None and ok:
            try:
                score = aggregate(ok).get(metric)
            except Exception:  # noqa: BLE001 - records of an older task version: mean of the per-sample score
                score = None
        if score is None and ok:
            score = _mean([r.get("score") for r in ok])
        out = dict(
            base,
            subtask=subtask,
            length=length,
            score=score,
            samples=task.units(ok) if task is not None else len(ok),  # lm-eval: documents, not its pieces
            failed_samples=len(recs) - len(ok),
            time_s=sum(float(r.get("time_s") or 0.0) for r in recs),
        )
        if task is not None and isinstance(out["expected_samples"], int):
            out["expected_samples"] = task.expected_units(out["expected_samples"], ok)
        for key in MEAN_FIELDS:
            out[key] = _mean([r.get(key) for r in ok])
        terms = _terms(task, ok)
        ci = bootstrap_ci(terms) if terms is not None else {}
        out["score_lo"], out["score_hi"] = ci.get("lo"), ci.get("hi")
        out["_terms"] = terms  # for the paired differences (``collect``); not a column
        return out

    if not records:
        return [dict(row([], None, task_length), score=summary.get("score"))]
    groups: dict[tuple[Any, Any], list[dict[str, Any]]] = {}
    for r in records:
        length = r.get("length", task_length) if has_length else task_length
        groups.setdefault((_subtask(r), length), []).append(r)
    keys = sorted(groups, key=lambda k: (str(k[0]), str(k[1])))
    subtasks = {k[0] for k in keys}
    rows = []
    if by_subtask and (len(keys) > 1 or keys[0][0] is not None):
        rows += [row(groups[k], k[0], k[1]) for k in keys]
    if not rows or len(subtasks) > 1 or not by_subtask:
        lengths = {k[1] for k in keys}
        for length in sorted(lengths, key=str):
            recs = [r for k in keys if k[1] == length for r in groups[k]]
            rows.append(row(recs, "all" if len(subtasks) > 1 else next(iter(subtasks)), length))
            if len(subtasks) > 1:  # the row of a set of this length's subtasks (``add_subset_rows``); not a column

                def subset(names: set[str], label: str, length: Any = length) -> dict[str, Any]:
                    out = row(
                        [r for k in keys if k[1] == length and str(k[0]) in names for r in groups[k]], label, length
                    )
                    # expects its subtasks' share of the run's samples (every subtask runs the same count), and is
                    # complete when those all finished (the run may still lack samples of other subtasks)
                    share = len({str(s) for s in subtasks} & names) / len(subtasks)
                    if isinstance(out.get("expected_samples"), (int, float)):
                        out["expected_samples"] = round(out["expected_samples"] * share)
                        out["complete"] = out["samples"] >= out["expected_samples"] and not out["failed_samples"]
                    return out

                rows[-1]["_subset"] = subset
    return rows


def unreadable_row(run_dir: Path, recent_s: float = 300.0) -> dict[str, Any]:
    """The row of a run whose config.yaml cannot be read: where it is, state ``unreadable`` and why; no score (its
    samples cannot be tied to a method and task)."""
    state = run_state(run_dir, recent_s=recent_s)
    print(f"warning: {run_dir}: {state['error'] or 'config.yaml cannot be read'}", file=sys.stderr)
    return {
        "model": run_dir.parent.name,
        "method": run_dir.name.split("-", 1)[0],
        "method_config": run_dir.name.rsplit("-", 1)[0],
        "run_name": run_dir.name,
        "task": run_dir.parent.parent.name,
        "subtask": None,
        "length": None,
        "seed": None,
        "score": None,
        "samples": state["written"],
        "expected_samples": state["expected"],
        "state": state["state"],
        "error": state["error"],
        "run_dir": str(run_dir),
        "config_hash": run_dir.name.rsplit("-", 1)[-1],
    }


SUBSET_PREFIX = "full>="  # subtask label of the rows over the subtasks full attention scores at least X on


def subset_label(at_least: float) -> str:
    return f"{SUBSET_PREFIX}{at_least:g}"


def is_subset_label(subtask: Any) -> bool:
    return isinstance(subtask, str) and subtask.startswith(SUBSET_PREFIX)


def add_subset_rows(rows: list[dict[str, Any]], at_least: float) -> None:
    """Per comparison (``PAIR_KEYS`` but the subtask: same model, task config, evaluation and length), the subtasks
    on which full attention's complete run scores at least ``at_least`` (its subtask rows), and for every run of that
    comparison with several subtasks one more row over those subtasks' samples only: subtask
    ``full>=<at_least>``, ``subset_subtasks`` naming them, expecting those subtasks' share of the run's samples and
    complete when they all finished.  Its score, interval, seed pooling and paired difference against full
    attention are computed as for any row (the task's own aggregate over those samples).  A
    comparison whose full attention run is incomplete gets no such row (the subtasks it solves are not known), nor
    one where it reaches ``at_least`` on no subtask; a warning says so."""
    from ..method_facts import is_dense

    keys = [k for k in PAIR_KEYS if k != "subtask"]
    solved: dict[tuple, list[str] | None] = {}
    for r in rows:
        if not is_dense(r.get("method")) or r.get("subtask") in (None, "all") or r.get("score") is None:
            continue
        key = tuple(str(r.get(k)) for k in keys)
        names = solved.setdefault(key, [])
        if names is not None and not r.get("complete"):
            solved[key] = None  # an incomplete reference: which subtasks it solves is not known
        elif names is not None and r["score"] >= at_least:
            names.append(str(r["subtask"]))
    label = subset_label(at_least)
    warned: set[tuple] = set()
    for r in list(rows):
        build = r.get("_subset")
        if build is None:
            continue
        key = tuple(str(r.get(k)) for k in keys)
        names = solved.get(key)
        if not names:
            if key not in warned:
                warned.add(key)
                why = "is incomplete" if key in solved else "scores below it on every subtask (or was not run)"
                print(
                    f"warning: no {label} rows for {r.get('model')} / {r.get('task')} at length {r.get('length')}: "
                    f"full attention {why}",
                    file=sys.stderr,
                )
            continue
        sub = build(set(names), label)
        sub["subset_subtasks"] = ",".join(sorted(names))
        rows.append(sub)


def collect(
    root: Path | None,
    by_subtask: bool = True,
    recent_s: float = 300.0,
    full_at_least: float | None = None,
    run_dirs: list[Path] | None = None,
):
    """A pandas DataFrame of every run under ``root`` (see the module docstring for the columns), or of the runs
    ``run_dirs`` (a sweep's: ``sweep.SweepReport``), paired and pooled among themselves."""
    import pandas as pd

    rows = []
    for run_dir in find_run_dirs(root) if run_dirs is None else [Path(d) for d in run_dirs]:
        rows.extend(run_rows(run_dir, by_subtask=by_subtask, recent_s=recent_s))
    if full_at_least is not None:
        add_subset_rows(rows, full_at_least)
    for r in rows:
        r.pop("_subset", None)
    add_seed_pooling(rows)
    add_paired_differences(rows)
    df = pd.DataFrame(rows)
    if df.empty:
        return df
    lead = [c for c in LEAD_COLUMNS if c in df.columns]
    method_cols = sorted(c for c in df.columns if c.startswith("method."))
    rest = [c for c in df.columns if c not in lead and c not in method_cols]
    df = df[lead + method_cols + rest]
    return df.sort_values(
        ["task", "model", "method", "method_config", "subtask", "length"],
        na_position="first",
        key=_sort_key,
    ).reset_index(drop=True)


def _sort_key(col: Any) -> Any:
    """The table's order: lengths as numbers (4K before 16K), every other column as text."""
    import pandas as pd

    return pd.to_numeric(col, errors="coerce") if col.name == "length" else col.astype(str)


# the rows a method is compared with full attention on: same model as loaded, task config, evaluation, subtask, length
PAIR_KEYS = (
    "model",
    "model_path",
    "model_gguf_file",
    "model_fingerprint",
    "model_tokenizer",
    "task_config",
    "protocol",
    "prefill_chunk",
    "batch_invariant",
    "subtask",
    "length",
)


def _references(rows: list[dict[str, Any]]) -> dict[tuple, dict[str, Any]]:
    """Full attention's row per ``PAIR_KEYS`` (the first found; full attention has no randomness): the rows of the
    dense reference method (``Method.dense``)."""
    from ..method_facts import is_dense  # torch-free for the shipped methods

    refs: dict[tuple, dict[str, Any]] = {}
    for r in rows:
        if is_dense(r.get("method")) and r.get("_terms") is not None:
            refs.setdefault(tuple(str(r.get(k)) for k in PAIR_KEYS), r)
    return refs


def add_paired_differences(rows: list[dict[str, Any]]) -> None:
    """Per row, its paired difference against full attention's row on the same samples (``PAIR_KEYS``; seed
    ignored, full attention has no randomness): ``diff_vs_full`` = score − full's score over the samples both
    finished, its 95 % paired-bootstrap interval ``diff_lo``/``diff_hi``, ``n_paired`` (those samples), and
    ``significant`` (the interval excludes 0; None without a reference, below ``MIN_SIGNIFICANCE_N`` shared samples,
    or when this run or the reference is incomplete).  Consumes each row's private ``_terms``."""
    refs = _references(rows)
    pairs = [(r, refs.get(tuple(str(r.get(k)) for k in PAIR_KEYS))) for r in rows]
    for r, ref in pairs:  # every row's terms are read before any is consumed
        terms = r.get("_terms")
        d = paired_difference(terms, ref["_terms"]) if terms is not None and ref is not None else {}
        if d and not (r.get("complete") and ref.get("complete")):
            d["significant"] = None  # no claim from an incomplete run (or reference)
        r["_diff"] = d
    for r in rows:
        r.pop("_terms", None)
        d = r.pop("_diff")
        r["diff_vs_full"], r["diff_lo"], r["diff_hi"] = d.get("diff"), d.get("lo"), d.get("hi")
        r["n_paired"], r["significant"] = d.get("n"), d.get("significant")


def seed_order(row: dict[str, Any]) -> tuple:
    """Sort key of a configuration's runs: integer seeds in order, then any other.  The order in which seeds are
    pooled decides which run each bootstrap seed draw picks, so every pooling sorts its runs by it."""
    seed = row.get("seed")
    return (0, seed, "") if isinstance(seed, int) else (1, 0, str(seed))


def add_seed_pooling(rows: list[dict[str, Any]]) -> None:
    """The ``POOLED_COLUMNS`` of every row, over the rows of its seed group: the rows of runs that differ only in
    their seed (same ``seed_group``), of the same subtask and length.  Two runs of one group with the same seed (runs
    made before the seed reached the methods, which drew from one ``method.seed``) are one seed: the one with the
    most finished samples counts, and a warning names the others.  Needs each row's private ``_terms`` (left for
    ``add_paired_differences``)."""
    refs = _references(rows)
    warned: set[str] = set()
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r.get("seed_group"), str(r.get("subtask")), str(r.get("length"))), []).append(r)
    for members in groups.values():
        by_seed: dict[Any, dict[str, Any]] = {}
        for r in sorted(members, key=lambda r: -(r.get("samples") or 0)):
            kept = by_seed.setdefault(str(r.get("seed")), r)
            if kept is not r and r.get("run_dir") not in warned:
                warned.add(r.get("run_dir"))
                print(
                    f"warning: {r.get('run_dir')} repeats seed {r.get('seed')} of {kept.get('run_dir')} (the same "
                    "draws); pooled as one seed",
                    file=sys.stderr,
                )
        every = sorted(by_seed.values(), key=seed_order)
        # seeds still running or cut short are left out while others are complete: the pooled row then stands
        # for the complete seeds (comparable), not for the few samples every seed has so far
        done = [r for r in every if r.get("complete")]
        runs = done if done else every
        left_out = [r for r in every if not r.get("complete")] if done else []
        stochastic = runs[0].get("stochastic")
        out: dict[str, Any] = {c: None for c in POOLED_COLUMNS}
        out["seeds"] = len(runs)
        out["seed_values"] = ",".join(str(r.get("seed")) for r in runs)
        out["seeds_left_out"] = ",".join(str(r.get("seed")) for r in left_out) or None
        out["interval_omits_seeds"] = None if stochastic is None else bool(stochastic and len(runs) == 1)
        terms = [r.get("_terms") for r in runs]
        if all(t is not None for t in terms):
            ci = seed_pooled_ci(terms)
            spread = seed_spread(ci["per_seed"])
            out.update(
                seed_std=spread["std"],
                seed_min=spread["min"],
                seed_max=spread["max"],
                pooled_score=ci["score"],
                pooled_lo=ci["lo"],
                pooled_hi=ci["hi"],
                pooled_n=ci["n"],
            )
            ref = refs.get(tuple(str(runs[0].get(k)) for k in PAIR_KEYS))
            if ref is not None:
                d = seed_pooled_difference(terms, ref["_terms"])
                claim = all(r.get("complete") for r in runs) and ref.get("complete")
                out.update(
                    pooled_diff=d["diff"],
                    pooled_diff_lo=d["lo"],
                    pooled_diff_hi=d["hi"],
                    pooled_n_paired=d["n"],
                    pooled_significant=d["significant"] if claim else None,
                )
        for r in members:
            r.update(out)
            r["pooled"] = not any(r is u for u in left_out)


def write_table(df, out: Path) -> list[Path]:
    """``<out>.csv`` and, when pyarrow is installed, ``<out>.parquet``."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    written = [out.with_suffix(".csv")]
    df.to_csv(written[0], index=False)
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        print("note: pyarrow is not installed; wrote CSV only (pip install pyarrow for parquet)", file=sys.stderr)
        return written
    table = df.copy()
    for col in table.columns:  # parquet needs one type per column: mixed objects become strings
        if table[col].dtype == object:
            kinds = {type(v) for v in table[col].dropna()}
            if len(kinds) > 1 or kinds - {str, bool}:
                table[col] = table[col].map(
                    lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
                )
    table.to_parquet(out.with_suffix(".parquet"), index=False)
    written.append(out.with_suffix(".parquet"))
    return written


def print_wide(df) -> None:
    """``--wide``: one row per run (and subtask, length) with its own and its seed-pooled numbers, 22 columns."""
    import pandas as pd

    show = [
        c
        for c in (
            "model",
            "run_name",
            "task",
            "subtask",
            "length",
            "protocol",
            "seed",
            "score",
            "score_lo",
            "score_hi",
            "n_paired",
            "diff_vs_full",
            "seeds",
            "pooled_score",
            "pooled_lo",
            "pooled_hi",
            "cost1",
            "cost2",
            "est_error",
            "samples",
            "failed_samples",
            "state",
        )
        if c in df.columns
    ]
    view = df[show].copy()
    if "interval_omits_seeds" in df.columns:  # a stochastic method's single seed: its intervals omit seeds
        view["seeds"] = [
            f"{n} {SINGLE_SEED_MARK}" if flag is True else n for n, flag in zip(df["seeds"], df["interval_omits_seeds"])
        ]
    with pd.option_context("display.max_rows", 200, "display.width", 250, "display.max_colwidth", 40):
        print(view.to_string(index=False, float_format=lambda x: f"{x:.4g}"))
    if (df.get("interval_omits_seeds") == True).any():  # noqa: E712 - a column of True / False / None
        print(
            f"{SINGLE_SEED_MARK} one seed of a stochastic method: its intervals omit the seed-to-seed variation "
            "(run it with seed=[0,1,2])"
        )
    if (df["state"] != "done").any():
        print(
            "rows of runs not done (incomplete, failed, running, pending) are over the samples they finished and "
            "are never marked significant"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_eval.results.collect", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a runs folder (paths.runs_dir) or any folder below it")
    ap.add_argument(
        "--out",
        metavar="X",
        help="where to write the table, without a suffix: writes X.csv and X.parquet "
        "(parquet when pyarrow is installed; default <dir>/results)",
    )
    ap.add_argument("--no-subtasks", action="store_true", help="one row per run (and length), no subtask rows")
    ap.add_argument(
        "--full-at-least",
        type=float,
        metavar="X",
        help="also a row per run over only the subtasks on which full attention scores at least X, on the task's "
        "own scale (RULER: 0-100) (subtask 'full>=X'; subset_subtasks names them), with intervals and paired "
        "differences as any row",
    )
    ap.add_argument("--recent", type=float, default=300.0, help="seconds within which a run counts as running")
    ap.add_argument("--quiet", action="store_true", help="do not print the table")
    ap.add_argument(
        "--wide",
        action="store_true",
        help="print one row per run with its own and its seed-pooled numbers (22 columns, wider than a terminal) "
        "instead of one row per configuration fitted to the terminal; the CSV holds every column",
    )
    args = ap.parse_args(argv)
    root = Path(args.dir)
    if not root.exists():
        print(f"error: {root} does not exist", file=sys.stderr)
        return 2
    if args.full_at_least is not None and args.no_subtasks:
        print(
            "error: --full-at-least needs the subtask rows (full attention's score per subtask); drop --no-subtasks",
            file=sys.stderr,
        )
        return 2
    df = collect(root, by_subtask=not args.no_subtasks, recent_s=args.recent, full_at_least=args.full_at_least)
    if df.empty:
        print(f"no runs under {root}", file=sys.stderr)
        return 1
    if not args.quiet and args.wide:
        print_wide(df)
    elif not args.quiet:
        from .terminal_table import format_compact

        print(format_compact(df))
    out = Path(args.out) if args.out else root / "results"
    try:
        paths = write_table(df, out)
    except OSError as exc:  # a read-only store: the table above was read; write it elsewhere
        print(
            f"error: cannot write {exc.filename or out} ({exc.strerror or exc}); give --out <writable path>",
            file=sys.stderr,
        )
        return 2
    print(f"{len(df)} rows from {df['run_dir'].nunique()} runs, every column -> " + ", ".join(str(p) for p in paths))
    if "warnings" in df:  # a score the run itself flags: said beside the table, not only in its summary.json
        for run_dir, text in df.dropna(subset=["warnings"]).groupby("run_dir")["warnings"].first().items():
            print(f"warning: {run_dir}: {text}", file=sys.stderr)
    bad = df[df["state"] == "unreadable"]["run_dir"].unique() if "state" in df else []
    if len(bad):  # the table lacks those runs' results: say so, and not with exit status 0
        print(
            f"error: {len(bad)} of {df['run_dir'].nunique()} runs could not be read (config.yaml); their rows say "
            f"state=unreadable and carry no score: {', '.join(bad)}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
