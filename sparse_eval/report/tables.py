"""The papers' tables in their own layout, from a results table (``load.load_results``).

Rows are model × method × config (× setting when a table mixes protocols or static keys); columns are the
paper's (tasks or lengths), then Avg, Cost1, Cost2, Cost_total = Cost1 + Cost2 (MagicPIG §5.1).  Where the model
and config match a row of the paper (``paper.py``), a cell shows ``ours (paper, ours − paper)``; the CSV has
``<col>``, ``<col>_paper`` and ``<col>_diff`` columns.  A table whose data is absent is skipped with the reason.

Costs are the measured means over a row's runs (Cost1: search FLOPs ratio, Cost2: attended-key fraction incl.
static keys); the paper's Cost2 of MagicPIG is measured too, its Quest/TopK Cost1 are nominal.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..results.collect import SUBSET_PREFIX
from ..methods.double_sparsity import DoubleSparsity
from ..methods.magicpig import MagicPIG, sampling_probability
from . import paper as P
from .load import (
    config_label,
    cut_short,
    is_reference,
    keys_per_row,
    method_display,
    method_params,
    reference_rows,
    run_rows,
    subset_rows,
    subtask_rows,
)

KEY_COLS = ["Model", "Method", "Config"]
PARAM_NAMES = (
    "K",
    "L",
    "page_size",
    "budget",
    "offload",
    "channel_type",
    "center",
    "min_collisions",
    "mips",
    "alpha",
    "beta",
    "label_bits",
)
LM_EVAL_COLUMNS = (("gsm8k", "GSM"), ("coqa", "COQA"), ("mmlu", "MMLU"))
LONGBENCH_COLUMNS = {
    "qasper": "QaS",
    "repobench-p": "RbP",
    "lcc": "LCC",
    "passage_retrieval_en": "PrE",
    "trec": "TrC",
    "triviaqa": "TrQ",
}
RULER_LENGTHS = {16384: "16K", 32768: "32K", 65536: "64K", 98304: "96K"}
PAPER_RULER_LENGTH = 16384  # MagicPIG Tables 12 and 13
COST_COLS = ["Cost1", "Cost2", "Cost_total"]
MAGICPIG_70B = "llama3_1_70b_instruct"


class Skip(Exception):
    """A table that cannot be made from the data present (the message says why)."""


@dataclass
class Table:
    name: str  # file stem
    title: str
    caption: str
    key_cols: list[str]
    value_cols: list[str]
    rows: list[dict[str, Any]]  # key cols + value cols (floats / None)
    paper: list[dict[str, float | None]] = field(default_factory=list)  # per row: col -> paper value
    paper_source: list[str | None] = field(default_factory=list)  # per row: the paper table matched
    digits: dict[str, int] = field(default_factory=dict)  # decimals per column (default 1)

    def frame(self):
        """Plain numbers: key cols, each value col, and <col>_paper / <col>_diff where a paper value exists."""
        import pandas as pd

        recs = []
        for i, r in enumerate(self.rows):
            rec = {k: r.get(k) for k in self.key_cols}
            for c in self.value_cols:
                rec[c] = r.get(c)
                pv = self.paper[i].get(c) if self.paper else None
                if any(p.get(c) is not None for p in self.paper):
                    rec[f"{c}_paper"] = pv
                    rec[f"{c}_diff"] = None if pv is None or r.get(c) is None else r[c] - pv
            if any(self.paper_source):
                rec["paper_source"] = self.paper_source[i]
            recs.append(rec)
        return pd.DataFrame(recs)


# -- helpers --------------------------------------------------------------------------------------------------


def _params(row: Any) -> dict[str, Any]:
    from .load import param

    out = {}
    for name in PARAM_NAMES:
        v = param(row, name)
        if v is not None:
            out[name] = v
    return out


def _group_cols(d) -> list[str]:
    cols = ["model", "method", "method_name", "config"]
    if d["setting"].nunique(dropna=False) > 1:
        cols.append("setting")
    return cols


def _mean(vals) -> float | None:
    vals = [float(v) for v in vals if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _natural(text: Any) -> tuple:
    """Sort key that orders the numbers inside a label by value: (7,120) before (10,120), 0.05 before 0.1."""
    import re

    parts = re.split(r"(\d+(?:\.\d+)?)", str(text))
    return tuple((0, float(x)) if i % 2 else (1, x) for i, x in enumerate(parts) if x)


def _sort_key(r: dict[str, Any]):
    order = {"Full": 0, "MagicPIG": 1, "Quest": 2, "TopK": 3, "Oracle sampling": 4, "DS": 5, "DS-Offload": 6}
    return (str(r["Model"]), order.get(r["Method"], 9), _natural(r["Config"]))


def _build(
    values,
    costs,
    d,
    name: str,
    title: str,
    caption: str,
    columns: list[str],
    paper_tables: list[str],
    avg: bool = True,
    digits: dict[str, int] | None = None,
    with_costs: bool = True,
) -> Table:
    """values: DataFrame with group cols + 'col' + 'score'; costs: DataFrame with group cols + cost1/cost2."""
    gcols = _group_cols(d)
    rows, papers, sources = [], [], []
    incomplete = False
    for key, grp in values.groupby(gcols, dropna=False, sort=False):
        key = dict(zip(gcols, key if isinstance(key, tuple) else (key,)))
        row: dict[str, Any] = {"Model": key["model"], "Method": key["method_name"], "Config": key["config"]}
        short = _incomplete(grp)
        if short:  # a run cut short: its average is over the samples it finished, not the task's
            per = {c: _incomplete(grp[grp["col"] == c]) for c in columns if (grp["col"] == c).any()}
            if any(v is None for v in per.values()):  # the row's other columns are complete: name the short ones
                short = ", ".join(f"{c} {v}" for c, v in per.items() if v)
            row["Config"] = f"{row['Config']} (incomplete: {short})"
            incomplete = True
        if "setting" in key:
            row["Setting"] = key["setting"]
        for col in columns:
            row[col] = _mean(grp.loc[grp["col"] == col, "score"])
        present = [row[c] for c in columns if row[c] is not None]
        if avg:
            row["Avg"] = sum(present) / len(present) if present else None
        if with_costs:
            cm = costs
            for k, v in key.items():
                cm = cm[(cm[k] == v) | (cm[k].isna() & (v is None or (isinstance(v, float) and math.isnan(v))))]
            c1, c2 = _mean(cm["cost1"]), _mean(cm["cost2"])
            row["Cost1"], row["Cost2"] = c1, c2
            row["Cost_total"] = None if c2 is None else (c1 or 0.0) + c2
        first = grp.iloc[0]
        pr = None
        for t in paper_tables:
            pr = P.lookup(t, key["model"], key["method"], _params(first))
            if pr is not None:
                break
        pv = dict(pr.values) if pr else {}
        if avg and pv.get("Avg") is not None and any(pv.get(c) is not None and row[c] is None for c in columns):
            pv["Avg"] = None  # the paper averages columns this row lacks: not comparable
        rows.append(row)
        papers.append(pv)
        sources.append(pr.table if pr else None)
    if not rows:
        raise Skip("no rows")
    order = sorted(range(len(rows)), key=lambda i: _sort_key(rows[i]))
    value_cols = [c for c in columns if any(rows[i][c] is not None for i in order)]
    value_cols += (["Avg"] if avg else []) + (COST_COLS if with_costs else [])
    key_cols = KEY_COLS + (["Setting"] if "setting" in gcols else [])
    if "setting" not in gcols:
        caption += f" Setting of every row: {d['setting'].iloc[0]}."
    if avg and any(papers):
        caption += " The paper's Avg is compared only where the row has every column the paper averaged."
    if incomplete:
        caption += (
            " Rows marked incomplete are over the samples their runs finished (n of the expected): not "
            "comparable with complete rows."
        )
    caption += _left_out_note(d)
    dg = {"Cost1": 3, "Cost2": 3, "Cost_total": 3}
    dg.update(digits or {})
    return Table(
        name,
        title,
        caption,
        key_cols,
        value_cols,
        [rows[i] for i in order],
        [papers[i] for i in order],
        [sources[i] for i in order],
        dg,
    )


def _left_out_note(d) -> str:
    """The seeds ``collect`` left out of their configuration (not complete while others are), named for a
    caption; "" when none."""
    if "seeds_left_out" not in d.columns:
        return ""
    named = []
    for _, r in d[d["seeds_left_out"].map(_present)].drop_duplicates(["model", "method_name", "config"]).iterrows():
        left = r["seeds_left_out"]
        left = int(left) if isinstance(left, float) and left.is_integer() else left
        named.append(f"{r['method_name']} {r['config']} seed {left}")
    if not named:
        return ""
    return f" Left out while not complete (the rows are over the complete seeds): {'; '.join(named)}."


def score_scale(task: Any) -> float:
    """The factor a task's scores are shown with: lm-eval's metrics are fractions (exact match, accuracy, F1),
    shown in % as MagicPIG Table 1 shows them; every other task's scores as recorded."""
    return 100.0 if task == "lm_eval" else 1.0


def _incomplete(grp) -> str | None:
    """ "n/N" when runs of the group scored fewer samples than they expected (cut short, or samples that failed)."""
    short = grp[cut_short(grp)]
    if short.empty:
        return None
    return f"{int(short['samples'].sum())}/{int(short['expected_samples'].sum())}"


def _with_col(d, col_of: Callable[[Any], str | None], scale: float = 1.0):
    d = d.copy()
    if {"run_dir", "subtask", "expected_samples"} <= set(d.columns):
        # a run's row per subtask (an lm-eval task, a LongBench dataset) expects its share of the run's samples
        # (every subtask runs the same count), so that a complete run is not marked incomplete
        subtasks = d.groupby("run_dir")["subtask"].transform("nunique").clip(lower=1)
        d["expected_samples"] = d["expected_samples"] / subtasks
    d["col"] = [col_of(r) for _, r in d.iterrows()]
    d = d[d["col"].notna()]
    d["score"] = d["score"] * scale
    return d


# -- MagicPIG tables ------------------------------------------------------------------------------------------


def magicpig_table1(df) -> Table:
    """lm-eval-harness (GSM8K-CoT, CoQA, MMLU-Flan-CoT); lm-eval's fractions shown as %."""
    sub = subtask_rows(df, "lm_eval")
    if sub.empty:
        raise Skip("no lm_eval runs with per-task rows (task=lm_eval, tasks gsm8k_cot / coqa / mmlu_flan_cot_fewshot)")

    def col(r):
        name = str(r["subtask"]).lower()
        return next((lab for pre, lab in LM_EVAL_COLUMNS if name.startswith(pre)), None)

    vals = _with_col(sub, col, score_scale("lm_eval"))
    if vals.empty:
        raise Skip("lm_eval runs have none of gsm8k*, coqa*, mmlu* tasks")
    costs = run_rows(df, "lm_eval")
    ran = "; ".join(
        f"{lab}: {', '.join(sorted(set(vals.loc[vals['col'] == lab, 'subtask'])))}"
        for _, lab in LM_EVAL_COLUMNS
        if (vals["col"] == lab).any()
    )
    return _build(
        vals,
        costs,
        sub,
        "magicpig_table1_lm_eval",
        "MagicPIG Table 1: lm-eval-harness",
        "Scores in % (lm-eval's headline metric ×100: GSM8K-CoT exact match, CoQA F1, MMLU-Flan-CoT exact "
        f"match); Avg over the columns present; costs measured over the decode steps. lm-eval tasks run: {ran}. "
        "n counts documents (a run's records are pieces of them: task.shards).",
        ["GSM", "COQA", "MMLU"],
        ["MagicPIG Table 1"],
    )


def magicpig_table2(df) -> Table:
    sub = subtask_rows(df, "longbench")
    if sub.empty:
        raise Skip("no longbench runs")
    vals = _with_col(sub, lambda r: LONGBENCH_COLUMNS.get(str(r["subtask"]), str(r["subtask"])))
    cols = [c for c in LONGBENCH_COLUMNS.values()] + sorted(set(vals["col"]) - set(LONGBENCH_COLUMNS.values()))
    return _build(
        vals,
        run_rows(df, "longbench"),
        sub,
        "magicpig_table2_longbench",
        "MagicPIG Table 2: LongBench",
        "LongBench scores (0-100, LongBench's metric per dataset); Avg over the datasets present.",
        cols,
        ["MagicPIG Table 2"],
    )


def _length_label(n: Any) -> str | None:
    if n is None or (isinstance(n, float) and math.isnan(n)):
        return None
    n = int(n)
    return RULER_LENGTHS.get(n, f"{n / 1024:g}K")


def _ruler(df, name: str, title: str, models_in: Callable[[str], bool], paper_tables: list[str]) -> Table:
    runs = run_rows(df, "ruler")
    runs = runs[np.array([models_in(m) for m in runs["model"]], dtype=bool)]
    if runs.empty:
        if name.startswith("magicpig_table5"):
            others = sorted(set(run_rows(df, "ruler")["model"].dropna()))
            raise Skip(
                f"no ruler runs of {MAGICPIG_70B} (Table 5 is the 70B model"
                + (f"; ruler runs exist of: {', '.join(others)}, which Table 3 shows)" if others else ")")
            )
        raise Skip("no ruler runs")
    vals = _with_col(runs, lambda r: _length_label(r["length"]))
    labels = sorted(set(vals["col"]), key=lambda s: float(s[:-1]))
    cols = [c for c in RULER_LENGTHS.values()] + [c for c in labels if c not in RULER_LENGTHS.values()]
    cols = sorted(cols, key=lambda s: float(s[:-1]))
    return _build(
        vals,
        runs,
        runs,
        name,
        title,
        "RULER: mean over the subtasks run of RULER's score (0-100), one column per context length; Avg over "
        "the lengths present; costs: mean over the lengths' runs.",
        cols,
        paper_tables,
    )


def magicpig_table3(df) -> Table:
    return _ruler(
        df,
        "magicpig_table3_ruler",
        "MagicPIG Table 3: RULER by context length",
        lambda m: m != MAGICPIG_70B,
        ["MagicPIG Table 3"],
    )


def magicpig_table5(df) -> Table:
    return _ruler(
        df,
        "magicpig_table5_ruler_70b",
        "MagicPIG Table 5: RULER, Llama-3.1-70B-Instruct",
        lambda m: m == MAGICPIG_70B,
        ["MagicPIG Table 5"],
    )


def _magicpig_kl(
    df, name: str, title: str, keep: Callable[[int, int], bool], paper_table: str, with_score: bool
) -> Table:
    """Tables 9 (Cost2 by (K, L)) and 12 / 13 (RULER score and Cost2 by (K, L)).  Rows are model × task × length ×
    config × setting: Cost2 depends on the context length.  Tables 12 and 13 are RULER 16K in the paper; they take
    the RULER lengths present (16K alone when there is 16K data) and say so in the title; the paper's numbers are
    put beside ours only at 16K."""
    from .load import param

    runs = run_rows(df)
    runs = runs[runs["method"] == MagicPIG.name]
    if with_score:
        runs = runs[runs["task"] == "ruler"]
        if (runs["length"] == PAPER_RULER_LENGTH).any():
            runs = runs[runs["length"] == PAPER_RULER_LENGTH]
    if runs.empty:
        raise Skip("no magicpig runs" + (" on RULER" if with_score else ""))
    runs = runs[np.array([keep(param(r, "K"), param(r, "L")) for _, r in runs.iterrows()], dtype=bool)]
    if runs.empty:
        raise Skip("no magicpig runs with the table's (K, L)")

    rows, papers, sources = [], [], []
    gcols = ["model", "task", "length", "config", "setting"]
    for key, grp in runs.groupby(gcols, dropna=False, sort=False):
        first = grp.iloc[0]
        K, L, mc = param(first, "K"), param(first, "L"), param(first, "min_collisions") or 2
        length = key[2]
        row = {
            "Model": key[0],
            "Task": key[1],
            "Length": _length_label(length) or "–",
            "Config": key[3],
            "Setting": key[4],
            "Cost2": _mean(grp["cost2"]),
            "u(p=1/2)": float(sampling_probability(0.5, int(K), int(L), int(mc))),
        }
        if with_score:
            row["Score"] = _mean(grp["score"])
        pr = P.lookup(paper_table, key[0], MagicPIG.name, _params(first))
        pv = dict(pr.values) if pr else {}
        if with_score:  # the paper's RULER numbers are 16K ones
            pv = {"Score": pv.get("16K"), "Cost2": pv.get("Cost2")} if length == PAPER_RULER_LENGTH else {}
            pr = pr if pv else None
        rows.append(row)
        papers.append(pv)
        sources.append(pr.table if pr else None)
    order = sorted(
        range(len(rows)),
        key=lambda i: (rows[i]["Model"], rows[i]["Task"], _natural(rows[i]["Length"]), _natural(rows[i]["Config"])),
    )
    vals = (["Score"] if with_score else []) + ["Cost2", "u(p=1/2)"]
    caption = (
        "Cost2 measured (mean over the runs; static keys included), u(p=1/2): eq. 10's sampling "
        "probability of a key orthogonal to the query (p = 1/2), the paper's analytic estimate of Cost2."
    )
    if with_score:
        lengths = sorted({int(x) for x in runs["length"].dropna()})
        here = "/".join(_length_label(x) for x in lengths)
        if lengths != [PAPER_RULER_LENGTH]:
            title = f"{title} (the paper: RULER 16K; here: RULER {here})"
            caption = (
                f"Score: RULER's score (0-100), mean over the subtasks run, at {here} tokens: the paper's 16K "
                "was not run, so its numbers are not put beside these. "
            ) + caption
        else:
            title = f"{title} (RULER 16K)"
            caption = "Score: RULER's score (0-100) at 16K, mean over the subtasks run. " + caption
    return Table(
        name,
        title,
        caption,
        ["Model", "Task", "Length", "Config", "Setting"],
        vals,
        [rows[i] for i in order],
        [papers[i] for i in order],
        [sources[i] for i in order],
        {"Cost2": 4, "u(p=1/2)": 4, "Score": 1},
    )


def magicpig_table9(df) -> Table:
    return _magicpig_kl(
        df,
        "magicpig_table9_cost_by_KL",
        "MagicPIG Table 9: Cost2 by (K, L)",
        lambda k, l: True,
        "MagicPIG Table 9",
        with_score=False,
    )


def magicpig_table12(df) -> Table:
    return _magicpig_kl(
        df,
        "magicpig_table12_equal_cost",
        "MagicPIG Table 12: RULER at about equal cost",
        lambda k, l: (k, l) in {(10, 240), (9, 120), (8, 65), (7, 35)},
        "MagicPIG Table 12",
        True,
    )


def magicpig_table13(df) -> Table:
    return _magicpig_kl(
        df,
        "magicpig_table13_L120",
        "MagicPIG Table 13: RULER with L = 120",
        lambda k, l: l == 120,
        "MagicPIG Table 13",
        True,
    )


# -- Double Sparsity tables -----------------------------------------------------------------------------------


def _level_label(x: float | None) -> str | None:
    """A sparsity level as the paper writes it: 1, 1/2, 1/4, ... (other values as a decimal)."""
    if x is None or not x > 0:
        return None
    inv = 1.0 / x
    if abs(inv - round(inv)) < 1e-6 * inv:
        return "1" if round(inv) == 1 else f"1/{round(inv)}"
    return f"{x:.3g}"


def ds_levels(row: Any) -> tuple[float | None, float | None]:
    """(token sparsity, channel sparsity) of a Double Sparsity row (``DoubleSparsity.levels``): an int β (the
    authors' heavy_const) counts over the keys of an average row (``load.keys_per_row``: W / 2 for WikiText-2
    windows of W tokens, else the length)."""
    return DoubleSparsity.levels(method_params(row), keys_per_row(row))


def ds_table2(df) -> Table:
    runs = run_rows(df, "wikitext")
    ds = runs[runs["method"] == DoubleSparsity.name]
    if ds.empty:
        raise Skip("no double_sparsity runs on wikitext")
    from .load import param

    recs, short = [], []
    for i, r in ds.iterrows():
        tok, chan = ds_levels(r)
        lab = _level_label(tok)
        cut = _incomplete(ds.loc[[i]])
        if cut:
            short.append(f"{r['model']} {param(r, 'channel_type')} at {lab}: {cut}")
        same = tok is not None and chan is not None and math.isclose(min(chan, 1.0), tok, rel_tol=1e-6)

        recs.append(
            {
                "model": r["model"],
                "Variant": r["method_name"],
                "Channels": param(r, "channel_type"),
                "Channel sparsity": "= token" if same else f"{_level_label(chan)}",
                "col": lab,
                "score": r["score"],
                "offload": bool(param(r, "offload")),
                "setting": r["setting"],
            }
        )
    import pandas as pd

    d = pd.DataFrame(recs)
    full = reference_rows(runs)
    rows, papers, sources = [], [], []
    cols = ["1"] + sorted({c for c in d["col"] if c and c != "1"}, key=lambda s: -_frac(s))
    for key, grp in d.groupby(["model", "Variant", "Channels", "Channel sparsity", "setting"], sort=False):
        row = {"Model": key[0], "Variant": key[1], "Channels": key[2], "Channel sparsity": key[3], "Setting": key[4]}
        for c in cols:
            row[c] = _mean(grp.loc[grp["col"] == c, "score"])
        f = full[full["model"] == key[0]]
        if row["1"] is None and not f.empty:
            row["1"] = _mean(f["score"])  # level 1 = the dense model
        pr = (
            P.lookup(
                "DS Table 2",
                key[0],
                DoubleSparsity.name,
                {"offload": bool(grp["offload"].iloc[0]), "channel_type": key[2]},
            )
            if key[3] == "= token"
            else None
        )
        rows.append(row)
        papers.append(dict(pr.values) if pr else {})
        sources.append(pr.table if pr else None)
    ch_order = {"qk": 0, "q": 1, "k": 2, "random": 3}
    order = sorted(
        range(len(rows)),
        key=lambda i: (
            str(rows[i]["Model"]),
            str(rows[i]["Variant"]),
            ch_order.get(rows[i]["Channels"], 9),
            str(rows[i]["Channel sparsity"]),
            str(rows[i]["Setting"]),
        ),
    )
    rows, papers, sources = [rows[i] for i in order], [papers[i] for i in order], [sources[i] for i in order]
    value_cols = [c for c in cols if any(r[c] is not None for r in rows)]
    return Table(
        "ds_table2_ppl_by_sparsity",
        "Double Sparsity Table 2: WikiText-2 perplexity by sparsity level",
        "Columns: token sparsity level (β as a ratio of the context; an absolute β over a W-token window counts "
        "as β / (W/2)); 'Channel sparsity' = α·label_bits/16 (the label cache's share of the K cache), '= token' "
        "when equal to the column's level as in the paper; column 1 = full attention.  Paper values are "
        "compared only for qk channels with channel = token sparsity."
        + (
            f" Incomplete runs, over the windows they finished (n of the expected): {'; '.join(short)}."
            if short
            else ""
        ),
        ["Model", "Variant", "Channels", "Channel sparsity", "Setting"],
        value_cols,
        rows,
        papers,
        sources,
        {c: 2 for c in value_cols},
    )


def _frac(s: str) -> float:
    if s == "1":
        return 1.0
    if s.startswith("1/"):
        return 1.0 / float(s[2:])
    try:
        return float(s)
    except ValueError:
        return 0.0


def ds_table3(df) -> Table:
    from .load import param

    runs = run_rows(df, "wikitext")
    not_off = [not param(r, "offload") for _, r in runs.iterrows()]
    ds = runs[(runs["method"] == DoubleSparsity.name).to_numpy() & np.array(not_off, dtype=bool)]
    sel = []
    for _, r in ds.iterrows():
        tok, chan = ds_levels(r)
        if (
            tok is not None
            and chan is not None
            and math.isclose(tok, 1 / 16, rel_tol=1e-6)
            and math.isclose(chan, 1 / 16, rel_tol=1e-6)
        ):
            sel.append(r)
    if not sel:
        raise Skip("no double_sparsity wikitext runs at token and channel sparsity 1/16")
    full = reference_rows(runs)
    rows, papers, sources = [], [], []
    seeds: dict[str, set] = {}
    for model in sorted({r["model"] for r in sel}):
        row: dict[str, Any] = {"Model": model}
        f = full[full["model"] == model]
        row["Original"] = _mean(f["score"]) if not f.empty else None
        for ct in ("random", "q", "k", "qk"):
            these = [r for r in sel if r["model"] == model and param(r, "channel_type") == ct]
            row[ct] = _mean([r["score"] for r in these])
            if ct == "random" and these:
                seeds[model] = {param(r, "seed") for r in these}
        pr = P.lookup("DS Table 3", model, DoubleSparsity.name, {})
        rows.append(row)
        papers.append(dict(pr.values) if pr else {})
        sources.append(pr.table if pr else None)
    cols = [c for c in P.DS_T3_COLS if any(r[c] is not None for r in rows)]
    caption = (
        "WikiText-2 perplexity with token and channel sparsity 1/16 by the channel type: random channels, or "
        "the calibrated q / k / qk outliers; Original = full attention."
    )
    if seeds:
        caption += (
            " random: r = α·d channels drawn uniformly per layer and KV head from the run's seed, "
            + "; ".join(
                f"{m}: mean over {len(v)} seed(s) ({', '.join(str(x) for x in sorted(v, key=str))})"
                for m, v in sorted(seeds.items())
            )
            + "."
        )
    missing = [c for c in ("random", "q", "k", "qk") if c not in cols]
    if missing:
        caption += f" No runs of: {', '.join(missing)}."
    return Table(
        "ds_table3_channel_types",
        "Double Sparsity Table 3: outlier channel types at sparsity 1/16",
        caption,
        ["Model"],
        cols,
        rows,
        papers,
        sources,
        {c: 2 for c in cols},
    )


def _interval(lo: Any, hi: Any, digits: int = 1) -> str | None:
    if (
        lo is None
        or hi is None
        or (isinstance(lo, float) and math.isnan(lo))
        or (isinstance(hi, float) and math.isnan(hi))
    ):
        return None
    return f"[{lo:.{digits}f}, {hi:.{digits}f}]"


def _kib(v: Any) -> float | None:
    """Bytes -> KiB; None for a missing value (results collected before ``kv_bytes`` was recorded)."""
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return None
    return float(v) / 1024.0


def _present(v: Any) -> bool:
    return v is not None and not (isinstance(v, float) and math.isnan(v))


def _task_label(r: Any) -> Any:
    """The task; for lm_eval, which lm-eval task the run scored (one per run: ``task.tasks`` of one entry), since
    runs of different lm-eval tasks are otherwise alike in every column."""
    task, sub = r.get("task"), r.get("subtask")
    if task == "lm_eval" and isinstance(sub, str) and sub not in ("", "all"):
        return f"lm_eval: {sub}"
    return task


def _seeds_cell(r: Any, stochastic: Any, scale: float = 1.0) -> str:
    """ "–" for a deterministic method; a stochastic one's seed count and the range of its per-seed scores, or
    "1 †" for a single seed (its interval omits the seed variation); and the seeds left out of the pooling
    because they are not complete while the others are."""
    if stochastic is not True:
        return "–"
    n = int(r.get("seeds") or 1)
    left = r.get("seeds_left_out")
    if isinstance(left, float) and _present(left) and left.is_integer():
        left = int(left)  # one seed, read back from a CSV column with gaps
    more = f" (+ seed {left} incomplete)" if _present(left) and str(left) else ""
    if n == 1:
        return f"1 †{more}"
    lo, hi = r.get("seed_min"), r.get("seed_max")
    return (f"{n}: {lo * scale:.1f}–{hi * scale:.1f}" if _present(lo) and _present(hi) else str(n)) + more


def score_intervals(df, runs=None, name: str = "score_intervals", title: str | None = None, note: str = "") -> Table:
    """One row per configuration (the runs that differ only in their seed, ``collect``'s ``seed_group``, as one):
    its score with n and the 95 % interval over prompts and seeds, its seeds and the range of their scores, and its
    paired difference against full attention over the samples both finished (``collect``'s ``pooled_*``; a table
    collected before those existed: each run's own ``score_lo``/``score_hi``, ``diff_*``).  ``*`` marks a
    difference whose interval excludes 0; a run that is not complete is marked and never starred.  ``runs``: the
    rows to tabulate (default: the whole runs' rows), ``note`` added to the caption."""
    runs = run_rows(df) if runs is None else runs
    if "score_lo" not in runs.columns or runs["score_lo"].isna().all():
        raise Skip("no run has a score interval (results collected before intervals were recorded)")
    pooled = "pooled_score" in runs.columns and "seed_group" in runs.columns
    groups = (
        runs.groupby(["seed_group", "length"], dropna=False, sort=False)
        if pooled
        else runs.groupby(runs.index, sort=False)
    )
    rows, single, short_rows = [], False, False
    for _, grp in groups:
        r = grp.iloc[0]
        g = (lambda k, plain=None: r.get(k)) if pooled else (lambda k, plain=None: r.get(plain or k))
        score, lo, hi = g("pooled_score", "score"), g("pooled_lo", "score_lo"), g("pooled_hi", "score_hi")
        n = g("pooled_n", "samples")
        diff, sig = g("pooled_diff", "diff_vs_full"), g("pooled_significant", "significant")
        dlo, dhi, npair = (
            g("pooled_diff_lo", "diff_lo"),
            g("pooled_diff_hi", "diff_hi"),
            g("pooled_n_paired", "n_paired"),
        )
        pct = score_scale(r.get("task"))
        score, lo, hi, diff, dlo, dhi = (v * pct if _present(v) else v for v in (score, lo, hi, diff, dlo, dhi))
        has_diff = not is_reference(r) and _present(diff)
        stochastic = _num_bool(r.get("stochastic")) if "stochastic" in runs.columns else None
        single |= stochastic is True and int(r.get("seeds") or 1) == 1
        config = config_label(r)
        cut = _incomplete(grp)
        if cut:
            config, short_rows = f"{config} (incomplete: {cut})", True
        rows.append(
            {
                "Model": r.get("model"),
                "Task": _task_label(r),
                "Length": _length_label(r.get("length")) or r.get("length"),
                "Method": method_display(r),
                "Config": config,
                "n": n if _present(n) else None,
                "Score": score,
                "95% CI": _interval(lo, hi),
                "Seeds": _seeds_cell(r, stochastic, pct) if pooled else None,
                "Δ vs full": f"{diff:+.1f}{' *' if _num_bool(sig) is True and not cut else ''}" if has_diff else None,
                "Δ 95% CI": _interval(dlo, dhi) if has_diff else None,
                "n paired": npair if has_diff and _present(npair) else None,
                "Cost2": _mean(grp["cost2"]),
                "KV KiB/row": _kib(_mean(grp["kv_bytes"])) if "kv_bytes" in grp.columns else None,
            }
        )
    rows.sort(
        key=lambda x: (
            str(x["Model"]),
            str(x["Task"]),
            _natural(x["Length"]),
            x["Δ vs full"] is not None,
            _natural(x["Method"]),
            _natural(x["Config"]),
        )
    )
    caption = (
        "Score: the task's metric over n samples with its 95 % percentile-bootstrap interval (samples resampled "
        "within each subtask). A stochastic method run over several seeds (Seeds: their number and the range "
        "of their scores) is scored by the mean over its seeds on the samples every seed finished (over its "
        "complete seeds while others are not complete: those are named and left out), and its "
        "interval is a two-level bootstrap over prompts and seeds (sparse_eval.metrics.statistics). Δ vs full: the "
        "score minus full attention's on the n paired samples both finished, with its 95 % paired bootstrap "
        "interval (over seeds too); * marks a difference whose interval excludes 0 (significant at the 5 % "
        "level). KV KiB/row: the KV-cache bytes the method's system reads per sparse layer, query head and step "
        "(kept keys' K and V plus the method's index: all keys' K to score for full/TopK/oracle, page min/max "
        "for Quest, labels for DS, bucket ids for MagicPIG; GQA sharing not deducted), in KiB."
    )
    if any(str(x["Task"]).startswith("lm_eval") for x in rows):
        caption += " lm_eval rows: lm-eval's headline metric in % (×100), n in documents."
    if single:
        caption += " 1 †: a single seed of a stochastic method: its interval omits the seed-to-seed variation."
    if short_rows:
        caption += (
            " Rows marked incomplete are over the samples their runs finished (n of the expected; failed or "
            "missing samples): not comparable with complete rows, and never marked significant."
        )
    value_cols = (
        ["n", "Score", "95% CI"]
        + (["Seeds"] if pooled else [])
        + ["Δ vs full", "Δ 95% CI", "n paired", "Cost2", "KV KiB/row"]
    )
    return Table(
        name,
        title or "Scores with 95 % intervals and paired differences against full attention",
        caption + note,
        ["Model", "Task", "Length", "Method", "Config"],
        value_cols,
        rows,
        digits={"n": 0, "n paired": 0, "Score": 1, "Cost2": 3, "KV KiB/row": 1},
    )


def scores_where_full_solves(df) -> Table:
    """``score_intervals`` over ``collect --full-at-least X``'s rows: each configuration scored on only the
    subtasks on which full attention's complete run reaches X (issue: report a weak model's solvable subtasks
    apart), with the same intervals and paired differences."""
    sub = subset_rows(df)
    if sub.empty:
        raise Skip("no rows over the subtasks full attention solves (collect with --full-at-least X makes them)")
    which = sorted(
        {
            f"{m} at {_length_label(ln) or ln}: {st}"
            for m, ln, st in zip(sub["model"], sub["length"], sub.get("subset_subtasks", [None] * len(sub)))
        },
        key=str,
    )
    labels = sorted(set(sub["subtask"]))
    note = (
        f" Only the subtasks on which full attention's complete run scores at least "
        f"{', '.join(x[len(SUBSET_PREFIX) :] for x in labels)}: {'; '.join(which)}. Their n counts those subtasks' "
        "samples; a row is complete when those all finished, whatever the run's other subtasks."
    )
    return score_intervals(
        df,
        runs=sub,
        name="scores_where_full_solves",
        title="Scores on the subtasks full attention solves, with 95 % intervals and paired differences",
        note=note,
    )


def _num_bool(v: Any) -> Any:
    """True / False from a bool or its CSV form ("True"), else None."""
    if isinstance(v, (bool, np.bool_)):
        return bool(v)
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return None


TABLES: dict[str, Callable[[Any], Table]] = {
    "score_intervals": score_intervals,
    "scores_where_full_solves": scores_where_full_solves,
    "magicpig_table1": magicpig_table1,
    "magicpig_table2": magicpig_table2,
    "magicpig_table3": magicpig_table3,
    "magicpig_table5": magicpig_table5,
    "magicpig_table9": magicpig_table9,
    "magicpig_table12": magicpig_table12,
    "magicpig_table13": magicpig_table13,
    "ds_table2": ds_table2,
    "ds_table3": ds_table3,
}


def build_tables(df) -> tuple[list[Table], dict[str, str]]:
    """Every table the data allows; returns (tables, {skipped table: reason})."""
    made, skipped = [], {}
    for name, fn in TABLES.items():
        try:
            made.append(fn(df))
        except Skip as exc:
            skipped[name] = str(exc)
    return made, skipped


# -- writers --------------------------------------------------------------------------------------------------


def _fmt(v: Any, digits: int) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"{v:.{digits}f}"
    return str(v)


def cells(t: Table) -> list[list[str]]:
    """Display strings: 'ours (paper, ours − paper)' where the paper has the cell."""
    out = []
    for i, r in enumerate(t.rows):
        line = [_fmt(r.get(k), 0) for k in t.key_cols]
        for c in t.value_cols:
            dg = t.digits.get(c, 1)
            ours = r.get(c)
            pv = t.paper[i].get(c) if t.paper else None
            s = _fmt(ours, dg)
            if pv is not None:
                diff = "" if ours is None else f", {ours - pv:+.{dg}f}"
                s = f"{s} ({_fmt(pv, dg)}{diff})"
            line.append(s)
        out.append(line)
    return out


def display_frame(t: Table):
    """The table as display strings (``cells``), one column per key and value column, in order."""
    import pandas as pd

    return pd.DataFrame(cells(t), columns=t.key_cols + t.value_cols)


def to_markdown(t: Table) -> str:
    """A Markdown section: title, caption, and the table by ``DataFrame.to_markdown`` (GitHub pipes; key columns
    left-aligned, value columns right-aligned)."""
    lines = [f"### {t.title}", "", t.caption, ""]
    if any(t.paper_source):
        lines += ["Cells: ours (paper, ours − paper) where the paper reports the same model and config.", ""]
    esc = lambda s: str(s).replace("|", "\\|")  # noqa: E731  (a literal pipe would end the cell)
    frame = display_frame(t).map(esc).rename(columns=esc)
    align = ["left"] * len(t.key_cols) + ["right"] * len(t.value_cols)
    lines.append(frame.to_markdown(index=False, tablefmt="pipe", colalign=align, disable_numparse=True))
    return "\n".join(lines) + "\n"


# characters LaTeX's text mode lacks (pandas' escape="latex" covers & % $ # _ { } ~ ^ and the backslash)
_TEX_SYMBOLS = {"α": r"$\alpha$", "β": r"$\beta$", "–": "--", "−": "-", "≥": r"$\geq$"}
_TEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\^{}",
}


def _tex_symbols(s: str) -> str:
    return "".join(_TEX_SYMBOLS.get(ch, ch) for ch in s)


def _tex_caption(s: str) -> str:
    """The caption, which ``Styler.to_latex`` writes as given: special characters escaped as pandas does for cells."""
    return _tex_symbols("".join(_TEX_SPECIAL.get(ch, ch) for ch in s))


def to_latex(t: Table) -> str:
    """A ``table`` float (booktabs rules) by ``Styler.to_latex``: caption and label from the table, key columns
    left-aligned, value columns right-aligned, cells and header escaped by pandas."""
    caption = f"{_tex_caption(t.title)}. {_tex_caption(t.caption)}" + (
        " Cells: ours (paper, ours $-$ paper)." if any(t.paper_source) else ""
    )
    styler = (
        display_frame(t)
        .style.hide(axis="index")
        .format(escape="latex")
        .format_index(escape="latex", axis=1)
        .set_table_styles([{"selector": "small", "props": ":;"}], overwrite=True)
    )
    tex = styler.to_latex(
        column_format="l" * len(t.key_cols) + "r" * len(t.value_cols),
        position="t",
        position_float="centering",
        hrules=True,
        label=f"tab:{t.name}",
        caption=caption,
    )
    return _tex_symbols(tex)
