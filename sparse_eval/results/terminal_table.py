"""The collected table as a terminal reads it: one row per configuration (its seeds pooled), a few columns, no wider
than the terminal.

``collect``'s table (``sparse_eval.results.collect``) has a hundred columns, all in ``results.csv``; ``python -m
sparse_eval.results.collect`` prints this view of it (``--wide``: the long view of every run), and so does a multirun at
its end over the runs of its jobs (``sweep.SweepReport``).  Per configuration (``seed_group``: runs that differ only in
their seed) and length (the row over all subtasks; one per subtask in ``results.csv``): the method with its headline
options (``Method.headline_options``, as the run's own table), the score pooled over the seeds with its 95 % interval,
the paired difference against full attention with its interval (``*``: it excludes 0), the samples, Cost2, the
estimation error and the state.  Columns whose value is one for every row (the task, the model, the protocol, the
samples, the state) go to a header line; a table still too wide loses its least needed columns, then its method labels
are shortened, and a note says which.
"""

from __future__ import annotations

import math
import shutil
import textwrap
from typing import Any

NO_VALUE = "–"
SINGLE_SEED_MARK = "†"
INCOMPLETE_MARK = "!"
DEFAULT_WIDTH = 120  # when the output is not a terminal (a pipe, a file, a log) and COLUMNS is unset
# dropped in this order while the table is wider than the terminal
OPTIONAL = ("est_error", "Cost2", "seeds")


def terminal_width() -> int:
    return shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns


def _num(v: Any) -> float | None:
    if v is None or isinstance(v, bool):
        return None
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _blank(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v == ""


def _interval(score: Any, lo: Any, hi: Any, sign: bool = False) -> str:
    """``119.5 [95.86, 166.2]``; a difference ``+0.178 [-0.353, 0.56]`` (as the run's own table writes them)."""
    s, l, h = _num(score), _num(lo), _num(hi)
    if s is None:
        return NO_VALUE
    head, g = (f"{s:+.3g}", ".3g") if sign else (f"{s:.4g}", ".4g")
    return head if l is None or h is None else f"{head} [{l:{g}}, {h:{g}}]"


def method_text(row: dict[str, Any]) -> str:
    """``magicpig K=10, L=150``: the method and its headline options (torch-free: ``method_facts``)."""
    from ..method_facts import headline_options

    name = row.get("method")
    values = {k: row.get(f"method.{k}", row.get(k)) for k in headline_options(name)}  # sink, local: own columns
    opts = [f"{k}={_fmt(v)}" for k, v in values.items() if not _blank(v)]
    return f"{name} {', '.join(opts)}".strip()


def _fmt(v: Any) -> str:
    """An option's value as its run wrote it: 10, not 10.0 (a column with gaps is float); 0.06; text as is."""
    if isinstance(v, float) and v.is_integer():
        return str(int(v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def configurations(df) -> list[dict[str, Any]]:
    """One row per configuration and length of ``collect``'s table (and per subtask for a run of one subtask, or
    ``full>=X`` subset): its seeds' rows pooled.  A run's rows per subtask are left to ``results.csv`` and ``--wide``
    where it has a row over all of them."""
    from ..method_facts import is_dense

    records = df.to_dict("records")
    whole = {r.get("run_dir") for r in records if r.get("subtask") == "all"}  # runs with a row over all subtasks
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        if r.get("run_dir") in whole and r.get("subtask") != "all" and not str(r.get("subtask")).startswith("full>="):
            continue  # a subtask's row: in results.csv and --wide

        key = (r.get("seed_group") or r.get("run_dir"), str(r.get("subtask")), str(r.get("length")))
        groups.setdefault(key, []).append(r)
    out = []
    for rows in groups.values():
        r = rows[0]
        pooled = not _blank(r.get("pooled_score"))
        states = sorted({str(x.get("state")) for x in rows})
        samples = r.get("pooled_n") if pooled else r.get("samples")
        expected = r.get("expected_samples")
        n = NO_VALUE if _blank(samples) else str(int(samples))
        if not all(x.get("complete") for x in rows if x.get("pooled", True)) and not _blank(expected):
            n = f"{n}/{int(expected)} {INCOMPLETE_MARK}"
        dense = is_dense(r.get("method"))
        diff = ("pooled_diff", "pooled_diff_lo", "pooled_diff_hi") if pooled else ("diff_vs_full", "diff_lo", "diff_hi")
        significant = r.get("pooled_significant") if pooled else r.get("significant")
        vs = NO_VALUE if dense else _interval(*(r.get(k) for k in diff), sign=True)
        seeds = str(r.get("seed_values") or r.get("seed")) if r.get("stochastic") else NO_VALUE
        mark = f" {SINGLE_SEED_MARK}" if r.get("interval_omits_seeds") is True else ""  # on the score it concerns
        out.append(
            {
                "task": r.get("task"),
                "model": r.get("model"),
                "protocol": r.get("protocol"),
                "subtask": None if _blank(r.get("subtask")) else r.get("subtask"),
                "length": None if _blank(r.get("length")) else int(float(r["length"])),
                "method": method_text(r),
                "seeds": seeds,
                "metric": r.get("metric") or "score",
                "score": (
                    _interval(*(r.get(k) for k in ("pooled_score", "pooled_lo", "pooled_hi")))
                    if pooled
                    else _interval(r.get("score"), r.get("score_lo"), r.get("score_hi"))
                )
                + mark,
                "vs full": vs + (" *" if significant is True and vs != NO_VALUE else ""),
                "n": n,
                "Cost2": _num(r.get("cost2")),
                "est_error": _num(r.get("est_error")),
                "state": ",".join(states),
                "_key": r.get("config_hash") or r.get("run_dir"),
            }
        )
    labels: dict[tuple, int] = {}
    for c in out:  # two configurations that show the same label: their config hashes tell them apart
        k = (c["task"], c["model"], c["protocol"], c["subtask"], c["length"], c["method"])
        labels[k] = labels.get(k, 0) + 1
    for c in out:
        if labels[(c["task"], c["model"], c["protocol"], c["subtask"], c["length"], c["method"])] > 1:
            c["method"] += f" #{str(c['_key'])[:6]}"
    return out


def format_compact(df, width: int | None = None) -> str:
    """``collect``'s table as ``configurations`` rows, one block per task, model and protocol, no line wider than
    ``width`` (default: the terminal's)."""
    import pandas as pd

    width = width or terminal_width()
    rows = configurations(df)
    if not rows:
        return "(no runs)"
    blocks: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        blocks.setdefault((str(r["task"]), str(r["model"]), str(r["protocol"])), []).append(r)
    out, dropped = [], set()
    for block in blocks.values():
        text, gone = _block(pd.DataFrame(block).drop(columns="_key"), width)
        out += ["", text] if out else [text]
        dropped.update(gone)
    notes = []
    if any(SINGLE_SEED_MARK in str(r["score"]) for r in rows):
        notes.append(f"{SINGLE_SEED_MARK} one seed of a stochastic method: its interval omits the seed variation")
    if any(INCOMPLETE_MARK in r["n"] for r in rows):
        notes.append(f"{INCOMPLETE_MARK} not complete: over the samples it finished, never marked significant")
    notes.append(
        "vs full: paired difference with full attention, * where its interval excludes 0; a configuration's seeds "
        "pooled" + (f"; left out for the width: {', '.join(c for c in OPTIONAL if c in dropped)}" if dropped else "")
    )
    return "\n".join(out + [line for note in notes for line in textwrap.wrap(note, width, subsequent_indent="  ")])


def _block(table, width: int) -> tuple[str, list[str]]:
    """One task, model and protocol: a header line with the values every row shares, then the rows."""
    header = []
    for col in ("task", "model", "protocol", "subtask", "length", "n", "state"):  # one value for every row: said
        if table[col].isna().all():  # once, above the rows (none, or every run's row over all subtasks: not at all)
            table = table.drop(columns=col)
        elif table[col].nunique(dropna=False) == 1:
            if not (col == "subtask" and table[col].iloc[0] == "all"):
                header.append(f"{col}={table[col].iloc[0]}")
            table = table.drop(columns=col)
    if not table["seeds"].str.contains(",").any():  # no configuration run over several seeds
        table = table.drop(columns="seeds")
    metrics = sorted({str(m) for m in table.pop("metric")})
    table = table.rename(columns={"score": f"{metrics[0]} [95% CI]" if len(metrics) == 1 else "score [95% CI]"})
    table = table.rename(columns={"vs full": "vs full [95% CI]"})
    dropped: list[str] = []
    text = render(table)
    for col in OPTIONAL:
        if max(len(line) for line in text.splitlines()) <= width:
            break
        if col in table.columns:
            table = table.drop(columns=col)
            dropped.append(col)
            text = render(table)
    over = max(len(line) for line in text.splitlines()) - width
    if over > 0:  # the method labels, shortened to what fits (the full label is in results.csv's method_config)
        keep = max(12, int(table["method"].str.len().max()) - over)
        table["method"] = [_shorten(m, keep) for m in table["method"]]
        text = render(table)
    head = textwrap.wrap(" ".join(header), width) if header else []
    return "\n".join(head + [text]), dropped


def _shorten(label: str, keep: int) -> str:
    """``label`` in ``keep`` characters, its ``#<config hash>`` kept (it tells two same-looking labels apart)."""
    if len(label) <= keep:
        return label
    base, sep, tag = label.rpartition(" #")
    if not sep:
        base, tag = label, ""
    tail = f" #{tag}" if tag else ""
    return base[: max(1, keep - len(tail) - 1)] + "…" + tail


def render(table) -> str:
    """Text columns left-aligned, numbers right-aligned (4 significant digits), a dash for a missing value."""
    cols = list(table.columns)
    cells = [[_cell(v) for v in table[c]] for c in cols]
    numeric = [all(isinstance(v, (int, float)) or _blank(v) for v in table[c]) for c in cols]
    widths = [max([len(str(c))] + [len(v) for v in col]) for c, col in zip(cols, cells)]
    lines = []
    for i in range(-1, len(table)):
        parts = []
        for j, c in enumerate(cols):
            v = str(c) if i < 0 else cells[j][i]
            parts.append(v.rjust(widths[j]) if numeric[j] else v.ljust(widths[j]))
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def _cell(v: Any) -> str:
    if _blank(v):
        return NO_VALUE
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)
