"""The results table the report reads: a collected table (``python -m sparse_eval.results.collect``) or a folder
of runs.

``load_results(path)`` returns one pandas DataFrame in ``sparse_eval.results.collect``'s layout (one row per model ×
method with its parameters × task × subtask × length × protocol; ``subtask`` "all" = the whole run when it has
several subtasks, None when it has none) plus a few derived columns the tables and figures use:

  method_name  display name, the method's (``Method.display``): Full, TopK, Oracle sampling, MagicPIG, Quest, DS,
               DS-Offload
  config       the paper's config notation, the method's (``Method.label``): (K,L) for MagicPIG, (page size,
               budget) for Quest, the budget for TopK / oracle sampling, "α=…, β=…, b-bit, <channels>" for Double
               Sparsity, "–" for Full
  cost_total   cost1 + cost2 (MagicPIG §5.1)
  setting      protocol, static keys and dense layers, e.g. "A, sink 4 + local 64, dense 0,16"
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..results.collect import is_subset_label
from ..methods import METHODS, is_dense

TABLE_SUFFIXES = (".csv", ".parquet", ".pq")


def load_results(path: str | Path | list | tuple, full_at_least: float | None = None):
    """A collected CSV/parquet file, a folder holding ``results.csv``/``results.parquet`` and no runs, or a
    folder of runs (collected here with ``sparse_eval.results.collect.collect``, with ``full_at_least`` as
    ``collect --full-at-least``); or a list of those, whose rows are concatenated (e.g. two sweeps collected
    apart).  ``full_at_least`` with an already collected table is refused (collect it with the option)."""
    import pandas as pd

    if isinstance(path, (list, tuple)):
        if not path:
            raise ValueError("no results given")
        if len(path) == 1:
            return load_results(path[0], full_at_least)
        frames = [load_results(p, full_at_least) for p in path]
        return pd.concat(frames, ignore_index=True, sort=False)
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist: give a collected table (.csv/.parquet) or a runs folder")
    if p.is_file():
        if p.suffix not in TABLE_SUFFIXES:
            raise ValueError(f"{p}: not a collected table; valid suffixes: {list(TABLE_SUFFIXES)} (or a runs folder)")
        if full_at_least is not None:
            raise ValueError(
                f"{p} is already collected: --full-at-least applies to a runs folder; give the runs folder, or "
                f"collect it with `python -m sparse_eval.results.collect <runs> --full-at-least {full_at_least:g}`"
            )
        df = pd.read_csv(p) if p.suffix == ".csv" else pd.read_parquet(p)
    else:
        from ..results.collect import collect
        from ..results.store import find_run_dirs

        if find_run_dirs(p):
            df = collect(p, full_at_least=full_at_least)
        else:
            tables = [p / f"results{s}" for s in (".parquet", ".csv")]
            found = [t for t in tables if t.exists()]
            if not found:
                raise ValueError(
                    f"{p} holds no run directories (config.yaml + samples.jsonl) and no results.csv/parquet"
                )
            return load_results(found[0], full_at_least)
    if df.empty:
        raise ValueError(f"{p}: the results table is empty")
    return normalize(df)


def _num(v: Any) -> Any:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    if isinstance(v, str):
        low = v.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        try:
            f = float(v)
        except ValueError:
            return v
        return int(f) if f.is_integer() and "." not in v else f
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return v  # keep floats as floats (a float budget is a ratio, an int a token count)
    return v


def param(row: Any, name: str) -> Any:
    """A method parameter of a row (``method.<name>`` column), None when absent."""
    return _num(row.get(f"method.{name}")) if hasattr(row, "get") else None


def method_params(row: Any) -> dict[str, Any]:
    """A row's method config {field: value} from its ``method.<field>`` columns and the static-key counts every
    method shares (``sink``, ``local``: columns of their own in ``collect``'s table); missing values left out."""
    items = list(row.items()) if hasattr(row, "items") else []
    out = {str(k)[len("method.") :]: _num(v) for k, v in items if str(k).startswith("method.")}
    out.update({k: _num(v) for k, v in items if k in ("sink", "local") and f"method.{k}" not in out})
    return {k: v for k, v in out.items() if v is not None}


def keys_per_row(row: Any) -> float | None:
    """The keys of an average row of a run, the denominator of a budget given as a token count: half the window
    for perplexity windows (a causal window of W tokens has W / 2 keys per row on average), else the task's
    length; None when the row has neither."""
    tc = task_config(row)
    if tc.get("window"):
        return tc["window"] / 2.0
    n = _num(row.get("length")) if hasattr(row, "get") else None
    return float(n) if n else None


def _method(row: Any):
    """The registered class of a row's method, None for a method this process does not know (a user's plugin
    that is not loaded): the report then writes its name and config as they are."""
    return METHODS.get(row["method"])


def config_label(row: Any) -> str:
    cls = _method(row)
    lab = cls.label(method_params(row)) if cls is not None else None
    return lab if lab is not None else str(row.get("method_config", row["method"]))


def method_display(row: Any) -> str:
    cls = _method(row)
    return cls.display(method_params(row)) if cls is not None else row["method"]


def is_reference(row: Any) -> bool:
    """Whether the row's method is the dense reference (full attention): ``Method.dense``."""
    return is_dense(row["method"])


def reference_rows(df):
    """The rows of the dense reference (``is_reference``)."""
    return df[df["method"].map(is_dense).astype(bool)]


def method_level(row: Any) -> float | None:
    """The row's sparsity level by its method (``Method.level``), None for a method without one."""
    cls = _method(row)
    return cls.level(method_params(row), keys_per_row(row)) if cls is not None else None


def point_label(row: Any) -> str:
    """A figure point's label: the method's short form (``Method.point_label``) or its config label."""
    cls = _method(row)
    lab = cls.point_label(method_params(row), keys_per_row(row)) if cls is not None else None
    return lab if lab is not None else str(row["config"])


def setting_label(row: Any) -> str:
    parts = [str(row.get("protocol") or "?")]
    sink, local = _num(row.get("sink")), _num(row.get("local"))
    if not is_reference(row):
        parts.append(f"sink {sink} + local {local}" if (sink or local) else "no static keys")
        dl = row.get("dense_layers")
        parts.append(f"dense {dl}" if isinstance(dl, str) and dl else "no dense layers")
    return ", ".join(parts)


def normalize(df):
    """Types and derived columns on a table in ``sparse_eval.results.collect``'s layout, without the runs ``collect``
    left out of their configuration's seed pooling (seeds not complete while others are: ``seeds_left_out``); the
    tables name those seeds."""
    import pandas as pd

    df = df.copy()
    missing = [c for c in ("model", "method", "task", "score") if c not in df.columns]
    if missing:
        raise ValueError(f"the results table lacks column(s) {missing}; expected sparse_eval.results.collect's layout")
    for col in ("subtask", "length", "protocol", "cost1", "cost2", "est_error", "dense_layers", "sink", "local"):
        if col not in df.columns:
            df[col] = None
    df["subtask"] = df["subtask"].map(
        lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
    )
    df["length"] = pd.to_numeric(df["length"], errors="coerce")
    for col in ("score", "cost1", "cost2", "est_error"):
        df[col] = pd.to_numeric(df[col], errors="coerce")
    df["dense_layers"] = df["dense_layers"].map(
        lambda v: None if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
    )
    if "pooled" in df.columns:  # runs left out of their configuration's seed pooling (``collect``'s ``pooled``)
        df = df[df["pooled"].map(lambda v: str(v).lower() != "false")].copy()
    df["method_name"] = [method_display(r) for _, r in df.iterrows()]
    df["config"] = [config_label(r) for _, r in df.iterrows()]
    df["cost_total"] = df["cost1"].fillna(0) + df["cost2"]
    df["setting"] = [setting_label(r) for _, r in df.iterrows()]
    return df


def task_config(row: Any) -> dict[str, Any]:
    tc = row.get("task_config")
    if isinstance(tc, dict):
        return tc
    if isinstance(tc, str):
        try:
            return json.loads(tc)
        except json.JSONDecodeError:
            return {}
    return {}


def _subset(d):
    """Which rows are ``collect --full-at-least``'s rows over a set of subtasks (a boolean Series)."""
    return d["subtask"].map(is_subset_label).astype(bool)


def run_rows(df, task: str | None = None):
    """The rows that stand for whole runs (subtask "all" or None; a run with a single subtask has only that
    subtask's row, which then stands for the run), optionally of one task."""
    d = df if task is None else df[df["task"] == task]
    d = d[~_subset(d)]
    whole = d["subtask"].isna() | (d["subtask"] == "all")
    if "run_dir" not in d.columns:
        return d[whole]
    covered = set(d.loc[whole, "run_dir"])
    single = ~whole & ~d["run_dir"].isin(covered)
    counts = d[single].groupby(["run_dir", "length"], dropna=False)["subtask"].transform("count")
    single_ok = single.copy()
    single_ok[single] = (counts == 1).values
    return d[whole | single_ok]


def subtask_rows(df, task: str | None = None):
    d = df if task is None else df[df["task"] == task]
    return d[d["subtask"].notna() & (d["subtask"] != "all") & ~_subset(d)]


def subset_rows(df, task: str | None = None):
    """``collect --full-at-least X``'s rows: each run over only the subtasks full attention scores at least X on."""
    d = df if task is None else df[df["task"] == task]
    return d[_subset(d)]


def cut_short(d):
    """Which rows are of runs that finished fewer samples than they expect (a boolean Series; all False when the
    table does not say)."""
    import pandas as pd

    if "samples" not in d or "expected_samples" not in d:
        return pd.Series(False, index=d.index)
    return (d["samples"] < d["expected_samples"]).fillna(False)
