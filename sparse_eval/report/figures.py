"""The papers' figures from a results table (``load.load_results``), PNG and PDF.

  fig1_topk_retrieval_vs_aggregation   MagicPIG Fig. 1: TopK accuracy vs budget, niah vs cwe / fwe (RULER)
  fig6c_oracle_vs_topk                 MagicPIG Fig. 6c: oracle sampling vs TopK downstream, by budget
  fig9a_centering                      MagicPIG Fig. 9a: MagicPIG with / without key centering, fixed K, by L
  fig9bc_magicpig_vs_topk              MagicPIG Fig. 9b/c: MagicPIG vs TopK on CWE / FWE against measured Cost2
  ds_fig4_retrieval                    DS Fig. 4: key-value retrieval accuracy vs sparsity level and vs length
  ds_fig1_ppl_sparsity                 DS Fig. 1 / 9: perplexity vs token and channel sparsity
  pareto_<task>                        every method: score against measured Cost2, with the Pareto front

Each function returns the written paths or raises ``tables.Skip`` with the reason.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable

from ..methods import is_dense
from ..methods.double_sparsity import DoubleSparsity
from ..methods.magicpig import MagicPIG
from ..methods.oracle import OracleSampling
from ..methods.topk import TopK
from .load import method_level, param, point_label, reference_rows, run_rows, subtask_rows
from .tables import Skip, ds_levels

NIAH_PREFIX = "niah"
MARKERS = {"Full": "*", "TopK": "o", "Oracle sampling": "s", "MagicPIG": "^", "Quest": "D", "DS": "v",
           "DS-Offload": "P"}
COLORS = {"Full": "black", "TopK": "C0", "Oracle sampling": "C1", "MagicPIG": "C2", "Quest": "C3", "DS": "C4",
          "DS-Offload": "C5"}


def _save(fig, out: Path, stem: str) -> list[Path]:
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    title = fig._suptitle  # a title wider than the panels would widen the figure: wrapped to their width
    if title is not None:
        import textwrap

        width = max(60, int(fig.get_figwidth() * 72 / (title.get_fontsize() * 0.55)))
        title.set_text("\n".join(textwrap.wrap(title.get_text(), width)))
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def _panels(n: int, w: float = 4.6, h: float = 3.8):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(w * n, h), constrained_layout=True, squeeze=False)
    return fig, list(axes[0])


def _len_label(n: Any) -> str:
    return "" if n is None or (isinstance(n, float) and math.isnan(n)) else f"{int(n) // 1024}K" if int(n) >= 1024 else str(int(n))


def _setting_text(d) -> str:
    s = sorted({str(x) for x in d["setting"].dropna()})
    if len(s) == 1:
        return s[0]
    protos = sorted({str(x) for x in d["protocol"].dropna()}) if "protocol" in d else []
    return f"protocol {'/'.join(protos)}; static keys and dense layers per method (see the tables)"


def _frac_ticks(ax) -> None:
    """x axis in 1/x notation (x = 2, 4, 8, ...)."""
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "1" if v == 1 else f"1/{v:g}"))


PERCENT_TASKS = {"ruler": "RULER score (0-100)", "kv_retrieval": "retrieval accuracy (%)",
                 "longbench": "LongBench score (0-100)"}


def _score_label(task: str, metric: str | None = None) -> str:
    """The y-axis label of a task's score, with its unit."""
    if task in PERCENT_TASKS:
        return PERCENT_TASKS[task]
    if task == "wikitext" or metric in ("ppl", "perplexity"):
        return "WikiText-2 perplexity (lower is better)"
    if task == "lm_eval":
        return "lm-eval headline metric (0-1)"
    return f"{task} {metric or 'score'}"


def _score_limits(ax, task: str) -> None:
    if task in PERCENT_TASKS:
        ax.set_ylim(-3, 103)
    elif task == "lm_eval":
        ax.set_ylim(-0.03, 1.03)


def _n_text(d) -> str:
    """How many samples stand behind each point (the 'samples' column: per row of the results table)."""
    if "samples" not in d or d["samples"].dropna().empty:
        return ""
    if "task" in d and set(d["task"].dropna()) == {"lm_eval"}:
        from .load import task_config

        lims = sorted({task_config(r).get("limit") or task_config(r).get("num_samples") for _, r in d.iterrows()} - {None})
        return f"{'/'.join(f'{x:g}' for x in lims)} document(s) per lm-eval task" if lims else ""
    lo, hi = int(d["samples"].min()), int(d["samples"].max())
    return f"n = {lo} sample{'s' if hi > 1 else ''} per point" if lo == hi else f"n = {lo}-{hi} samples per point"


INTERVAL_NOTE = ("Error bars (and the shaded band of a Full line): 95 % bootstrap interval of a single run's score (collect's score_lo / "
                 "score_hi); a point that averages several runs has none.")


def _score_points(d, by, **extra):
    """Points of ``d`` grouped by ``by``: mean ``score`` (and ``extra`` aggregations, pandas named-aggregation
    form) with ``lo``/``hi``, the 95 % interval of the score (``score_lo``/``score_hi``) where exactly one row
    stands behind the point, NaN otherwise (several runs' mean has no interval of its own) or when the columns
    are absent.  Sorted by ``by``."""
    import numpy as np

    aggs = dict(score=("score", "mean"), n_rows=("score", "size"), **extra)
    has = "score_lo" in d.columns and "score_hi" in d.columns
    if has:
        aggs.update(lo=("score_lo", "first"), hi=("score_hi", "first"))
    m = d.groupby(by).agg(**aggs).sort_index()
    if not has:
        m["lo"], m["hi"] = np.nan, np.nan
    single = m["n_rows"] == 1
    m["lo"], m["hi"] = m["lo"].where(single), m["hi"].where(single)
    return m


def _error_bars(ax, x, y, lo, hi, color: Any = None, zorder: float = 2.5) -> bool:
    """Vertical 95 % interval bars [lo, hi] at the points (x, y); points without both ends get none.  Returns
    whether any bar was drawn."""
    import numpy as np

    x, y, lo, hi = (np.asarray(list(a), dtype=float) for a in (x, y, lo, hi))
    ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(lo) & np.isfinite(hi)
    if not ok.any():
        return False
    yerr = np.vstack([np.clip(y[ok] - lo[ok], 0, None), np.clip(hi[ok] - y[ok], 0, None)])
    ax.errorbar(x[ok], y[ok], yerr=yerr, fmt="none", ecolor=color, elinewidth=0.8, capsize=2.5, alpha=0.85,
                zorder=zorder)
    return True


def _full_line(ax, f, label: str = "Full", color: Any = "black") -> bool:
    """Full attention's score as a dashed line over its runs ``f`` (mean), with its 95 % interval as a band when
    one run stands behind it.  Returns whether a band was drawn."""
    if f.empty:
        return False
    ax.axhline(f["score"].mean(), color=color, ls="--", lw=0.9, label=label)
    if len(f) == 1 and "score_lo" in f.columns and "score_hi" in f.columns:
        lo, hi = f["score_lo"].iloc[0], f["score_hi"].iloc[0]
        if lo == lo and hi == hi and lo is not None and hi is not None:
            ax.axhspan(float(lo), float(hi), color=color, alpha=0.08, lw=0)
            return True
    return False


def _interval_note(fig, drawn: bool, y: float = -0.02) -> None:
    """The figure's footnote on its error bars, when it has any."""
    if drawn:  # wrapped to the figure's width (a wider line would widen the saved figure)
        import textwrap

        width = max(60, int(fig.get_figwidth() * 72 / (7 * 0.55)))
        fig.text(0.5, y, "\n".join(textwrap.wrap(INTERVAL_NOTE, width)), ha="center", va="top", fontsize=7)


def _plain_log_axis(axis) -> None:
    """Plain numbers (120, not 1.2×10²) on a log axis; minor ticks labelled too when it spans under a decade
    (else such an axis would have no label at all)."""
    from matplotlib.ticker import FuncFormatter, LogLocator

    lo, hi = sorted(axis.axes.get_ylim() if axis.axis_name == "y" else axis.axes.get_xlim())
    fmt = FuncFormatter(lambda v, _: f"{v:.0f}" if v >= 100 else f"{v:.3g}")
    axis.set_major_formatter(fmt)
    if lo > 0 and hi / lo < 10:
        axis.set_minor_locator(LogLocator(subs=(1.0, 1.2, 1.4, 1.6, 1.8, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0)))
        axis.set_minor_formatter(fmt)
    else:
        import math as _m

        def minor(v, _):
            mant = round(v / 10 ** _m.floor(_m.log10(v) + 1e-9), 6) if v > 0 else 0
            return fmt(v, _) if mant in (2.0, 5.0) else ""

        axis.set_minor_formatter(FuncFormatter(minor))


def _plain_log_x(ax) -> None:
    """Plain numbers on a log x axis (0.1, 0.2, 0.3, 0.5, 1 — not 10⁻¹, 2×10⁻¹).  Minor ticks are labelled only
    where they fit: 2, 3, 5 within 1.5 decades, 2 and 5 within 2.5, none beyond (their labels would collide).
    Call after the data are plotted (it reads the limits)."""
    import math as _m

    from matplotlib.ticker import FuncFormatter

    lo, hi = sorted(ax.get_xlim())
    span = _m.log10(hi / lo) if lo > 0 and hi > 0 else 99.0
    shown = (2.0, 3.0, 5.0) if span <= 1.5 else (2.0, 5.0) if span <= 2.5 else ()

    def minor(v, _):
        if v <= 0:
            return ""
        mant = round(v / 10 ** _m.floor(_m.log10(v) + 1e-9), 6)
        return f"{v:g}" if mant in shown else ""

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(FuncFormatter(minor))
    ax.tick_params(axis="x", which="minor", labelsize=7)


def _annotate_spread(ax, points: list[tuple[float, float, str]], fontsize: float = 6) -> None:
    """Labels beside their points (right, or left where the right would leave the axes), each moved up or down
    (3, -9, 11, -17, ... points) until its box overlaps no earlier label and stays inside the axes.  Call after
    the axes' scales and limits are set."""
    fig = ax.figure
    px = fig.dpi / 72.0
    frame = ax.get_window_extent()
    placed: list[tuple[float, float, float, float]] = []
    step = fontsize * 1.25
    for x, y, text in sorted(points, key=lambda t: (t[0], -t[1])):
        X, Y = ax.transData.transform((x, y))
        w, h = len(text) * fontsize * 0.62 * px, fontsize * 1.15 * px
        left = X + 4 * px + w > frame.x1
        x0 = X - 4 * px - w if left else X + 4 * px
        dy = 3.0
        for k in range(16):
            dy = 3 + (k + 1) // 2 * step * (1 if k % 2 == 1 else -1) if k else 3
            box = (x0, Y + dy * px, x0 + w, Y + dy * px + h)
            inside = frame.y0 <= box[1] and box[3] <= frame.y1
            if inside and not any(box[0] < b[2] and b[0] < box[2] and box[1] < b[3] and b[1] < box[3] for b in placed):
                break
        placed.append(box)
        moved = dy != 3  # a moved label gets a thin leader line to its point
        ax.annotate(text, (x, y), fontsize=fontsize, xytext=(-4 if left else 4, dy), textcoords="offset points",
                    ha="right" if left else "left",
                    arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5", shrinkA=0, shrinkB=2) if moved else None)


def _value_text(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else f"{v:g}" if isinstance(v, float) else str(v)


def _distinct_labels(rows: list[Any], labels: list[str]) -> list[str]:
    """Labels shared by several points get the method options that tell those points apart (e.g. ``seed=1``)."""
    out = list(labels)
    for lab in {l for l in labels if labels.count(l) > 1}:
        idx = [i for i, l in enumerate(labels) if l == lab]
        keys = sorted({k for i in idx for k in rows[i].index if str(k).startswith("method.")})
        differ = [k for k in keys if len({str(rows[i].get(k)) for i in idx}) > 1]
        for i in idx:
            extra = ", ".join(f"{k.split('.', 1)[1]}={_value_text(rows[i].get(k))}" for k in differ)
            out[i] = f"{lab} {extra}".strip()
    return out


def _group_score(d, group: Callable[[str], str | None]):
    """Subtask rows -> mean score per (run_dir or config, group label)."""
    d = d.copy()
    d["group"] = [group(str(s)) for s in d["subtask"]]
    return d[d["group"].notna()]


def _ruler_group(s: str) -> str | None:
    if s.startswith(NIAH_PREFIX):
        return "niah (mean of niah_*)"
    return s if s in ("cwe", "fwe") else None


def fig1_topk(df, out: Path) -> list[Path]:
    sub = subtask_rows(df, "ruler")
    topk = sub[sub["method"] == TopK.name]
    if topk.empty or topk["config"].nunique() < 2:
        raise Skip("needs RULER runs of topk at two or more budgets")
    g = _group_score(topk, _ruler_group)
    if g.empty:
        raise Skip("topk RULER runs have no niah_*, cwe or fwe subtask")
    full = _group_score(reference_rows(sub), _ruler_group)
    keys = sorted(g.groupby(["model", "length"]).groups.keys(), key=str)
    fig, axes = _panels(len(keys))
    drawn = False
    for ax, (model, length) in zip(axes, keys):
        d = g[(g["model"] == model) & (g["length"] == length)]
        for i, (grp, dd) in enumerate(sorted(d.groupby("group"), key=lambda x: x[0])):
            dd = dd.assign(budget=[param(r, "budget") for _, r in dd.iterrows()])
            m = _score_points(dd, "budget")
            ax.plot(m.index, m["score"], marker="o", color=f"C{i}", label=f"TopK: {grp}")
            drawn |= _error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=f"C{i}")
            f = full[(full["model"] == model) & (full["length"] == length) & (full["group"] == grp)]
            drawn |= _full_line(ax, f, f"Full: {grp}", f"C{i}")
        ax.set_xscale("log")
        _plain_log_x(ax)
        ax.set_xlabel("TopK budget (fraction of the context's keys, log scale)")
        ax.set_ylabel("RULER score (0-100)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{model}, RULER {_len_label(length)}; {_n_text(d)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"TopK on retrieval (niah) vs aggregation (cwe, fwe) (MagicPIG Fig. 1) — {_setting_text(topk)}",
                 fontsize=10)
    _interval_note(fig, drawn)
    return _save(fig, out, "fig1_topk_retrieval_vs_aggregation")


def fig6c_oracle_vs_topk(df, out: Path) -> list[Path]:
    runs = run_rows(df)
    d = runs[runs["method"].isin([TopK.name, OracleSampling.name])]
    both = [k for k, g in d.groupby(["model", "task", "length"], dropna=False) if g["method"].nunique() == 2]
    if not both:
        raise Skip("needs topk and oracle runs of the same model, task and length")
    fig, axes = _panels(len(both))
    drawn = False
    for ax, (model, task, length) in zip(axes, both):
        g = d[(d["model"] == model) & (d["task"] == task) & ((d["length"] == length) if length == length else d["length"].isna())]
        notes: list[tuple[float, float, str]] = []
        for cls in (TopK, OracleSampling):
            name = cls.display_name
            dm = g[g["method"] == cls.name]
            dm = dm.assign(budget=[param(r, "budget") for _, r in dm.iterrows()])
            m = _score_points(dm, "budget", cost2=("cost2", "mean"))
            ax.plot(m.index, m["score"], marker=MARKERS[name], color=COLORS[name], label=name)
            drawn |= _error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=COLORS[name])
            if cls is OracleSampling:
                notes = [(b, r.score, f"Cost2 {r.cost2:.3g}") for b, r in m.iterrows()]
        f = reference_rows(runs[(runs["model"] == model) & (runs["task"] == task)])
        if length == length:
            f = f[f["length"] == length]
        drawn |= _full_line(ax, f)
        metric = g["metric"].iloc[0]
        ax.set_xscale("log")
        _plain_log_x(ax)
        ax.set_xlabel("budget (fraction of the context: keys kept / draws, log scale)")
        ax.set_ylabel(_score_label(task, metric))
        _score_limits(ax, task)
        _annotate_spread(ax, notes, fontsize=6)
        ax.set_title(f"{model}, {task} {_len_label(length)}; {_n_text(g)}".strip(), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Oracle sampling vs TopK downstream (MagicPIG Fig. 6c) — {_setting_text(d)}", fontsize=10)
    _interval_note(fig, drawn)
    return _save(fig, out, "fig6c_oracle_vs_topk")


def fig9a_centering(df, out: Path) -> list[Path]:
    runs = run_rows(df)
    mp = runs[runs["method"] == MagicPIG.name].copy()
    if mp.empty:
        raise Skip("no magicpig runs")
    mp["K"] = [param(r, "K") for _, r in mp.iterrows()]
    mp["L"] = [param(r, "L") for _, r in mp.iterrows()]
    mp["center"] = [param(r, "center") is not False for _, r in mp.iterrows()]
    keys = [k for k, g in mp.groupby(["model", "task", "length", "K"], dropna=False) if g["center"].nunique() == 2]
    if not keys:
        raise Skip("needs magicpig runs with center=true and center=false at the same K (model, task, length)")
    sub = subtask_rows(df)
    fig, axes = _panels(len(keys))
    drawn = False
    for ax, (model, task, length, K) in zip(axes, keys):
        rows = mp[(mp["model"] == model) & (mp["task"] == task) & (mp["K"] == K)]
        if length == length:
            rows = rows[rows["length"] == length]
        s = sub[sub["run_dir"].isin(rows["run_dir"])] if "run_dir" in sub else sub.iloc[0:0]
        series = []
        if task == "ruler" and not s.empty:
            s = _group_score(s, lambda x: "niah (mean of niah_*)" if x.startswith(NIAH_PREFIX) else (x if x == "fwe" else None))
            for grp, dd in s.groupby("group"):
                series.append((grp, dd.merge(rows[["run_dir", "L", "center"]], on="run_dir")))
        if not series:
            series = [(f"{task} score", rows)]
        for i, (grp, dd) in enumerate(series):
            for center, ls in ((True, "-"), (False, ":")):
                m = _score_points(dd[dd["center"] == center], "L")
                # later series drawn smaller on top, so that equal scores stay visible
                drawn |= _error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=f"C{i}", zorder=1.5 + i)
                ax.plot(m.index, m["score"], ls=ls, marker="o" if center else "X", color=f"C{i}",
                        markersize=max(3.0, 10.0 - 3.0 * i), zorder=2 + i, mfc="none" if center else f"C{i}",
                        label=f"{grp}, {'centered' if center else 'no centering'}")
        ax.set_xlabel(f"L (hash tables), K = {int(K)}")
        ax.set_ylabel(_score_label(task))
        _score_limits(ax, task)
        if rows["L"].nunique() == 1:
            ax.set_xticks([float(rows["L"].iloc[0])])
        ax.set_title(f"{model}, {task} {_len_label(length)}; {_n_text(s if not s.empty else rows)}".strip(), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Importance of key centering (MagicPIG Fig. 9a) — {_setting_text(mp)}", fontsize=10)
    _interval_note(fig, drawn)
    return _save(fig, out, "fig9a_centering")


def fig9bc_magicpig_vs_topk(df, out: Path) -> list[Path]:
    sub = subtask_rows(df, "ruler")
    d = sub[sub["method"].isin([TopK.name, MagicPIG.name]) & sub["subtask"].isin(["cwe", "fwe"])]
    if d.empty or d["method"].nunique() < 2:
        raise Skip("needs RULER runs of both topk and magicpig with the cwe / fwe subtasks")
    keys = sorted({(m, l, s) for m, l, s in zip(d["model"], d["length"], d["subtask"])}, key=str)
    fig, axes = _panels(len(keys))
    drawn = False
    for ax, (model, length, st) in zip(axes, keys):
        g = d[(d["model"] == model) & (d["length"] == length) & (d["subtask"] == st)]
        t = _score_points(g[g["method"] == TopK.name], "config", cost2=("cost2", "mean")).sort_values("cost2")
        ax.plot(t["cost2"], t["score"], marker="o", color=COLORS["TopK"], label="TopK (exact)")
        drawn |= _error_bars(ax, t["cost2"], t["score"], t["lo"], t["hi"], color=COLORS["TopK"])
        mp = _score_points(g[g["method"] == MagicPIG.name], "config", cost2=("cost2", "mean"))
        ax.scatter(mp["cost2"], mp["score"], marker="^", color=COLORS["MagicPIG"], zorder=3, label="MagicPIG (K, L)")
        drawn |= _error_bars(ax, mp["cost2"], mp["score"], mp["lo"], mp["hi"], color=COLORS["MagicPIG"])
        f = reference_rows(sub[(sub["model"] == model) & (sub["length"] == length) & (sub["subtask"] == st)])
        drawn |= _full_line(ax, f)
        ax.set_xscale("log")
        _plain_log_x(ax)
        ax.set_xlabel("measured Cost2 (fraction of keys attended, log scale)")
        ax.set_ylabel(f"RULER {st} score (0-100)")
        ax.set_ylim(-3, 103)
        _annotate_spread(ax, [(r.cost2, r.score, str(cfg)) for cfg, r in mp.iterrows()])
        ax.set_title(f"{model}, RULER {_len_label(length)}: {st.upper()}; {_n_text(g)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"MagicPIG vs TopK on aggregation tasks (MagicPIG Fig. 9b/c) — {_setting_text(d)}", fontsize=10)
    _interval_note(fig, drawn)
    return _save(fig, out, "fig9bc_magicpig_vs_topk")


def _retrieval_label(r) -> str:
    """Legend label of a kv-retrieval run: the method and its point label (``load.point_label``: 'DS 1/16' where
    token = channel sparsity, else the method's config)."""
    lab = point_label(r)
    return r["method_name"] if lab == "–" else f"{r['method_name']} {lab}"


def ds_fig4_retrieval(df, out: Path) -> list[Path]:
    runs = run_rows(df, "kv_retrieval")
    if runs.empty:
        raise Skip("no kv_retrieval runs")
    runs = runs.copy()
    runs["level"] = [method_level(r) for _, r in runs.iterrows()]  # the method's (``Method.level``)
    runs["label"] = [_retrieval_label(r) for _, r in runs.iterrows()]
    lengths = sorted(runs["length"].dropna().unique())
    fig, axes = _panels(2, 5.6, 4.4)
    # (a) vs sparsity level, one line per method and context length; level 1 = full attention (as DS Table 2)
    ax = axes[0]
    drawn = False
    keys = lengths or [None]
    for j, L in enumerate(keys):
        a = runs if L is None else runs[runs["length"] == L]
        f = reference_rows(a)
        fs = f["score"].mean() if not f.empty else None
        fp = _score_points(f.assign(level=1.0), "level") if not f.empty else None  # full's point, with its interval
        dodge = 2 ** (0.08 * (j - (len(keys) - 1) / 2))
        sparse = a[a["level"].notna()]
        for name, dd in sparse.groupby("method_name"):
            m = _score_points(dd, "level").sort_index(ascending=False)
            xs, ys, los, his = [1 / x for x in m.index], list(m["score"]), list(m["lo"]), list(m["hi"])
            if fs is not None:
                xs, ys = [1.0] + xs, [fs] + ys
                los, his = [fp["lo"].iloc[0]] + los, [fp["hi"].iloc[0]] + his
            ax.plot([x * dodge for x in xs], ys, marker=MARKERS.get(name, "o"), color=f"C{j}",
                    ls=("-", "--", "-.")[j % 3] if name == DoubleSparsity.display_name else ":",
                    markersize=max(4.0, 8.0 - 1.5 * j), zorder=2 + j,
                    label=f"{name}, {int(L)} tokens" if L is not None else name)
            drawn |= _error_bars(ax, [x * dodge for x in xs], ys, los, his, color=f"C{j}", zorder=1.5 + j)
        if sparse.empty and fs is not None:
            ax.plot([dodge], [fs], marker=MARKERS["Full"], color=f"C{j}", ls="none",
                    label=f"Full, {int(L)} tokens" if L is not None else "Full")
            drawn |= _error_bars(ax, [dodge], [fs], fp["lo"], fp["hi"], color=f"C{j}")
    ax.set_xscale("log", base=2)
    _frac_ticks(ax)
    ax.set_xlabel("sparsity level (share of the keys attended; 1 = full attention)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"(a) by sparsity level; {_n_text(runs)}", fontsize=9)
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=7)
    # (b) vs context length, one line per method config (Full first, then DS by level)
    ax = axes[1]
    if len(lengths) >= 2:
        order = sorted(runs.groupby("label"), key=lambda kv: (not is_dense(kv[1]["method"].iloc[0]),
                                                                -(kv[1]["level"].dropna().mean() if kv[1]["level"].notna().any() else 2)))
        for i, (lab, dd) in enumerate(order):
            m = _score_points(dd, "length")
            if len(m) >= 2:
                name = dd["method_name"].iloc[0]
                full = is_dense(dd["method"].iloc[0])
                dodge = 2 ** (0.03 * (i - (len(order) - 1) / 2))
                ax.plot([x * dodge for x in m.index], m["score"], marker=MARKERS.get(name, "o"),
                        color="black" if full else f"C{i}", ls="--" if full else "-",
                        markersize=max(3.0, 9.0 - 1.0 * i), zorder=2 + i, label=lab)
                drawn |= _error_bars(ax, [x * dodge for x in m.index], m["score"], m["lo"], m["hi"],
                                     color="black" if full else f"C{i}", zorder=1.5 + i)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(int(x)) for x in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "one context length only", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"(b) by context length; {_n_text(runs)}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.text(0.5, -0.02, "Points of different lines are shifted slightly sideways so that equal values stay visible.",
             ha="center", fontsize=7)
    _interval_note(fig, drawn, y=-0.04)
    models = ", ".join(sorted(runs["model"].unique()))
    fig.suptitle(f"Key-value retrieval (DS Fig. 4) — {models}; {_setting_text(runs)}", fontsize=10)
    return _save(fig, out, "ds_fig4_retrieval")


def ds_fig1_ppl(df, out: Path) -> list[Path]:
    runs = run_rows(df, "wikitext")
    ds = runs[runs["method"] == DoubleSparsity.name].copy()
    if ds.empty:
        raise Skip("no double_sparsity runs on wikitext")
    lv = [ds_levels(r) for _, r in ds.iterrows()]
    ds["tok"], ds["chan"] = [x[0] for x in lv], [x[1] for x in lv]
    ds["ctype"] = [param(r, "channel_type") for _, r in ds.iterrows()]
    ds["offload"] = [bool(param(r, "offload")) for _, r in ds.iterrows()]
    ds["seed"] = [param(r, "seed") for _, r in ds.iterrows()]
    paths: list[Path] = []
    models = sorted(ds["model"].unique())
    fig, axes = _panels(len(models), 5.4, 4.0)
    shapes = {"qk": "o", "q": "s", "k": "^", "random": "D"}
    drawn = False
    for ax, model in zip(axes, models):
        d = ds[ds["model"] == model]
        diag = d[[t is not None and c is not None and math.isclose(t, min(c, 1.0), rel_tol=1e-6) for t, c in zip(d["tok"], d["chan"])]]
        groups = sorted(diag.groupby(["ctype", "offload"]), key=lambda kv: (kv[0][0] != "qk", kv[0]))
        for i, ((ct, off), dd) in enumerate(groups):
            m = _score_points(dd, "tok").sort_index(ascending=False)
            seeds = dd["seed"].nunique()
            lab = f"{DoubleSparsity.display({'offload': off})}, {ct} channels" + (
                f" (mean of {seeds} seeds)" if ct == "random" and seeds > 1 else "")
            if len(m) == 1:
                lab += f" (1/{1 / m.index[0]:g} only)"
            line = ax.plot([1 / x for x in m.index], m["score"], marker=shapes.get(ct, "o"), ls="-" if len(m) > 1 else "none",
                           markersize=max(4.0, 9.0 - 1.5 * i), mfc="none" if i else None, zorder=3 + i, label=lab)
            drawn |= _error_bars(ax, [1 / x for x in m.index], m["score"], m["lo"], m["hi"],
                                 color=line[0].get_color(), zorder=2.5 + i)
        full = reference_rows(runs[runs["model"] == model])
        drawn |= _full_line(ax, full)
        ax.set_xscale("log", base=2)
        _frac_ticks(ax)
        ax.set_yscale("log")
        _plain_log_axis(ax.yaxis)
        ax.set_xlabel("sparsity level (token = channel sparsity)")
        ax.set_ylabel("WikiText-2 perplexity (log scale, lower is better)")
        ax.set_title(f"{model}; {_wikitext_text(d)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Perplexity vs sparsity level (DS Table 2 / Fig. 1) — {_setting_text(ds)}", fontsize=10)
    _interval_note(fig, drawn)
    paths += _save(fig, out, "ds_fig1_ppl_sparsity")
    # Fig. 9: token x channel grid of the qk channels (the paper's), when present
    qk = ds[(ds["ctype"] == "qk") & ~ds["offload"]]
    grids = [m for m in models if qk[qk["model"] == m]["tok"].nunique() >= 2 and qk[qk["model"] == m]["chan"].nunique() >= 2]
    if grids:
        import numpy as np

        fig, axes = _panels(len(grids), 5.4, 4.6)
        for ax, model in zip(axes, grids):
            d = qk[qk["model"] == model]
            toks, chans, mat = ppl_grid(d)
            norm = _lognorm(mat)
            im = ax.imshow(mat, cmap="viridis_r", aspect="auto", norm=norm)
            ax.set_xticks(range(len(toks)), [_frac_label(t) for t in toks])
            ax.set_yticks(range(len(chans)), [_frac_label(c) for c in chans])
            ax.set_xlabel("token sparsity (β, share of the context's keys)")
            ax.set_ylabel("channel sparsity (α·bits/16, label cache / K cache)")
            for (i, j), v in np.ndenumerate(mat):
                if v == v:
                    dark = (norm(v) if norm is not None else 0.5) > 0.5  # viridis_r: high values are dark
                    ax.text(j, i, f"{v:.3g}", ha="center", va="center", fontsize=8, color="white" if dark else "black")
            ax.set_title(f"{model}; qk channels; {_wikitext_text(d)}", fontsize=9)
            cb = fig.colorbar(im, ax=ax, label="WikiText-2 perplexity")
            _plain_log_axis(cb.ax.yaxis)
        fig.suptitle(f"Perplexity by token and channel sparsity (DS Fig. 9) — {_setting_text(qk)}; empty cells: not run",
                     fontsize=10)
        paths += _save(fig, out, "ds_fig9_ppl_grid")
    return paths


def ppl_grid(d):
    """DS Fig. 9's grid of one model's runs (columns tok, chan, score): (token levels, channel levels, mean ppl
    [channel, token], NaN where not run), levels from dense to sparse."""
    import numpy as np

    toks = sorted(d["tok"].dropna().unique(), reverse=True)
    chans = sorted(d["chan"].dropna().unique(), reverse=True)
    mat = np.full((len(chans), len(toks)), np.nan)
    for i, c in enumerate(chans):
        for j, t in enumerate(toks):
            v = d[(d["tok"] == t) & (d["chan"] == c)]["score"]
            if len(v):
                mat[i, j] = v.mean()
    return toks, chans, mat


def _frac_label(x: float) -> str:
    inv = 1.0 / x
    return "1" if abs(inv - 1) < 1e-9 else (f"1/{round(inv)}" if abs(inv - round(inv)) < 1e-6 * inv else f"{x:.3g}")


def _wikitext_text(d) -> str:
    """'N windows of W tokens' of WikiText-2 runs (from the task config), for titles."""
    from .load import task_config

    wins = sorted({task_config(r).get("window") for _, r in d.iterrows()} - {None})
    n = sorted({int(x) for x in d["samples"].dropna()}) if "samples" in d else []
    if not wins:
        return _n_text(d)
    return f"{'/'.join(map(str, n)) or '?'} window(s) of {'/'.join(map(str, wins))} tokens"


def _lognorm(mat):
    import numpy as np
    from matplotlib.colors import LogNorm

    v = mat[np.isfinite(mat)]
    return LogNorm(vmin=v.min(), vmax=v.max()) if len(v) and v.min() > 0 and v.max() > v.min() else None


def pareto(df, out: Path) -> list[Path]:
    runs = run_rows(df)
    runs = runs[runs["cost2"].notna() & runs["score"].notna()]
    if runs.empty:
        raise Skip("no runs with a score and a measured Cost2")
    paths: list[Path] = []
    for (task, model), d in runs.groupby(["task", "model"]):
        d = d.copy()
        # one panel per context length and, for runs of a single subtask (an lm-eval task, a LongBench set), per subtask
        d["panel_sub"] = [None if not isinstance(st, str) or st == "all" else st for st in d["subtask"]]
        keys = sorted({(None if ln != ln else ln, st) for ln, st in zip(d["length"], d["panel_sub"])},
                      key=lambda k: (k[0] or 0, str(k[1])))
        fig, axes = _panels(len(keys), 5.6, 4.4)
        drawn = False
        metric = str(d["metric"].iloc[0])
        lower = metric in ("ppl", "perplexity")
        for ax, (length, sub) in zip(axes, keys):
            g = d[(d["length"] == length) if length is not None else d["length"].isna()]
            g = g[(g["panel_sub"] == sub) if sub is not None else g["panel_sub"].isna()]
            # the same config run twice (e.g. in two collected sweeps) with the same result: one point
            g = g.drop_duplicates(subset=["method_name", "config", "setting", "cost2", "score"])
            labels = []
            for name, dd in g.groupby("method_name"):
                ax.scatter(dd["cost2"], dd["score"], marker=MARKERS.get(name, "o"), color=COLORS.get(name), label=name,
                           s=30, zorder=3)
                if "score_lo" in dd.columns and "score_hi" in dd.columns:  # one run per point
                    drawn |= _error_bars(ax, dd["cost2"], dd["score"], dd["score_lo"], dd["score_hi"], color=COLORS.get(name))
                if len(dd) <= 12:
                    rows = [r for _, r in dd.iterrows() if r["config"] != "–"]
                    texts = _distinct_labels(rows, [_short_config(r) for r in rows])
                    labels += [(r["cost2"], r["score"], t) for r, t in zip(rows, texts)]
            pts = sorted(zip(g["cost2"], g["score"]))
            front, best = [], None
            for c, s_ in pts:  # cheapest first: keep points better than every cheaper one
                if best is None or (s_ < best if lower else s_ > best):
                    front.append((c, s_))
                    best = s_
            if front:
                front.append((pts[-1][0], front[-1][1]))  # the best score stays reachable up to the dearest point
                ax.step([c for c, _ in front], [s_ for _, s_ in front], where="post", color="grey", lw=1, ls="--",
                        label="Pareto front", zorder=2)
            ax.set_xscale("log")
            _plain_log_x(ax)
            ax.set_xlabel("measured Cost2 (fraction of keys attended, log scale)")
            ylab = _score_label(task, metric)
            ax.set_ylabel(ylab + ("" if lower or "better" in ylab else ", higher is better"))
            _score_limits(ax, task)
            if lower:  # perplexities span decades when a method breaks down
                ax.set_yscale("log")
                _plain_log_axis(ax.yaxis)
                ax.set_ylabel(ylab.replace("(lower", "(log scale, lower"))
            _annotate_spread(ax, labels, fontsize=6)
            head = " ".join(x for x in (task, str(sub) if sub else "", _len_label(length)) if x)
            extra = _wikitext_text(g) if task == "wikitext" else _n_text(g)
            ax.set_title(f"{head}; {extra}" if extra else head, fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(f"Accuracy vs attention cost, every method — {model}, {task}; {_setting_text(d)}", fontsize=10)
        _interval_note(fig, drawn)
        paths += _save(fig, out, f"pareto_{task}_{model}")
    return paths


def _short_config(r) -> str:
    """A point's label: the method's short form (``Method.point_label``: DS at token = channel sparsity as its
    level, 1/16), else its config."""
    return point_label(r)


FIGURES: dict[str, Callable[[Any, Path], list[Path]]] = {
    "fig1_topk_retrieval_vs_aggregation": fig1_topk, "fig6c_oracle_vs_topk": fig6c_oracle_vs_topk,
    "fig9a_centering": fig9a_centering, "fig9bc_magicpig_vs_topk": fig9bc_magicpig_vs_topk,
    "ds_fig4_retrieval": ds_fig4_retrieval, "ds_fig1_ppl_sparsity": ds_fig1_ppl, "pareto": pareto,
}


def build_figures(df, out: Path) -> tuple[list[Path], dict[str, str]]:
    made: list[Path] = []
    skipped: dict[str, str] = {}
    for name, fn in FIGURES.items():
        try:
            made += fn(df, Path(out))
        except Skip as exc:
            skipped[name] = str(exc)
    return made, skipped
