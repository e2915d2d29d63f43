"""What the report's figures share: one marker and colour per method, panels, axes (log scales in plain numbers,
1/x ticks, score labels and limits), 95 % interval bars and the footnote on them, labels spread beside their points,
and ``save`` (PNG and PDF)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

MARKERS = {
    "Full": "*",
    "TopK": "o",
    "Oracle sampling": "s",
    "MagicPIG": "^",
    "Quest": "D",
    "DS": "v",
    "DS-Offload": "P",
}
COLORS = {
    "Full": "black",
    "TopK": "C0",
    "Oracle sampling": "C1",
    "MagicPIG": "C2",
    "Quest": "C3",
    "DS": "C4",
    "DS-Offload": "C5",
}


def save(fig, out: Path, stem: str) -> list[Path]:
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


def panels(n: int, w: float = 4.6, h: float = 3.8):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, n, figsize=(w * n, h), constrained_layout=True, squeeze=False)
    return fig, list(axes[0])


def len_label(n: Any) -> str:
    return (
        ""
        if n is None or (isinstance(n, float) and math.isnan(n))
        else f"{int(n) // 1024}K"
        if int(n) >= 1024
        else str(int(n))
    )


def setting_text(d) -> str:
    s = sorted({str(x) for x in d["setting"].dropna()})
    if len(s) == 1:
        return s[0]
    protos = sorted({str(x) for x in d["protocol"].dropna()}) if "protocol" in d else []
    return f"protocol {'/'.join(protos)}; static keys and dense layers per method (see the tables)"


def frac_ticks(ax) -> None:
    """x axis in 1/x notation (x = 2, 4, 8, ...)."""
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: "1" if v == 1 else f"1/{v:g}"))


PERCENT_TASKS = {
    "ruler": "RULER score (0-100)",
    "kv_retrieval": "retrieval accuracy (%)",
    "longbench": "LongBench score (0-100)",
}


def score_label(task: str, metric: str | None = None) -> str:
    """The y-axis label of a task's score, with its unit."""
    if task in PERCENT_TASKS:
        return PERCENT_TASKS[task]
    if task == "wikitext" or metric in ("ppl", "perplexity"):
        return "WikiText-2 perplexity (lower is better)"
    if task == "lm_eval":
        return "lm-eval headline metric (0-1)"
    return f"{task} {metric or 'score'}"


def score_limits(ax, task: str) -> None:
    if task in PERCENT_TASKS:
        ax.set_ylim(-3, 103)
    elif task == "lm_eval":
        ax.set_ylim(-0.03, 1.03)


def n_text(d) -> str:
    """How many samples stand behind each point (the 'samples' column: per row of the results table)."""
    if "samples" not in d or d["samples"].dropna().empty:
        return ""
    if "task" in d and set(d["task"].dropna()) == {"lm_eval"}:
        from ..load import cut_short, task_config

        done = d[~cut_short(d)]
        if "pooled_n" in done and not done["pooled_n"].dropna().empty:  # documents, not lm-eval's per-task limit
            lo, hi = int(done["pooled_n"].min()), int(done["pooled_n"].max())
            return f"n = {lo}{'' if lo == hi else f'-{hi}'} documents per complete point"

        lims = sorted(
            {task_config(r).get("limit") or task_config(r).get("num_samples") for _, r in d.iterrows()} - {None}
        )
        return f"{'/'.join(f'{x:g}' for x in lims)} document(s) per lm-eval task" if lims else ""
    lo, hi = int(d["samples"].min()), int(d["samples"].max())
    return f"n = {lo} sample{'s' if hi > 1 else ''} per point" if lo == hi else f"n = {lo}-{hi} samples per point"


INTERVAL_NOTE = (
    "Error bars (and the shaded band of a Full line): 95 % bootstrap interval of a single run's score "
    "(collect's score_lo / score_hi); a point that averages several runs has none."
)


def score_points(d, by, **extra):
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


def error_bars(ax, x, y, lo, hi, color: Any = None, zorder: float = 2.5) -> bool:
    """Vertical 95 % interval bars [lo, hi] at the points (x, y); points without both ends get none.  Returns
    whether any bar was drawn."""
    import numpy as np

    x, y, lo, hi = (np.asarray(list(a), dtype=float) for a in (x, y, lo, hi))
    ok = np.isfinite(x) & np.isfinite(y) & np.isfinite(lo) & np.isfinite(hi)
    if not ok.any():
        return False
    yerr = np.vstack([np.clip(y[ok] - lo[ok], 0, None), np.clip(hi[ok] - y[ok], 0, None)])
    ax.errorbar(
        x[ok], y[ok], yerr=yerr, fmt="none", ecolor=color, elinewidth=0.8, capsize=2.5, alpha=0.85, zorder=zorder
    )
    return True


def full_line(ax, f, label: str = "Full", color: Any = "black") -> bool:
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


def interval_note(fig, drawn: bool, y: float = -0.02) -> None:
    """The figure's footnote on its error bars, when it has any."""
    if drawn:  # wrapped to the figure's width (a wider line would widen the saved figure)
        import textwrap

        width = max(60, int(fig.get_figwidth() * 72 / (7 * 0.55)))
        fig.text(0.5, y, "\n".join(textwrap.wrap(INTERVAL_NOTE, width)), ha="center", va="top", fontsize=7)


def plain_log_axis(axis) -> None:
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


def plain_log_x(ax) -> None:
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


def annotate_spread(ax, points: list[tuple[float, float, str]], fontsize: float = 6) -> None:
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
        ax.annotate(
            text,
            (x, y),
            fontsize=fontsize,
            xytext=(-4 if left else 4, dy),
            textcoords="offset points",
            ha="right" if left else "left",
            arrowprops=dict(arrowstyle="-", lw=0.4, color="0.5", shrinkA=0, shrinkB=2) if moved else None,
        )


def value_text(v: Any) -> str:
    return str(int(v)) if isinstance(v, float) and v.is_integer() else f"{v:g}" if isinstance(v, float) else str(v)


def distinct_labels(rows: list[Any], labels: list[str]) -> list[str]:
    """Labels shared by several points get the method options that tell those points apart (e.g. ``seed=1``)."""
    out = list(labels)
    for lab in {l for l in labels if labels.count(l) > 1}:
        idx = [i for i, l in enumerate(labels) if l == lab]
        keys = sorted({k for i in idx for k in rows[i].index if str(k).startswith("method.")})
        differ = [k for k in keys if len({str(rows[i].get(k)) for i in idx}) > 1]
        for i in idx:
            extra = ", ".join(f"{k.split('.', 1)[1]}={value_text(rows[i].get(k))}" for k in differ)
            out[i] = f"{lab} {extra}".strip()
    return out


def wikitext_text(d) -> str:
    """'N windows of W tokens' of WikiText-2 runs (from the task config), for titles."""
    from ..load import task_config

    wins = sorted({task_config(r).get("window") for _, r in d.iterrows()} - {None})
    n = sorted({int(x) for x in d["samples"].dropna()}) if "samples" in d else []
    if not wins:
        return n_text(d)
    return f"{'/'.join(map(str, n)) or '?'} window(s) of {'/'.join(map(str, wins))} tokens"
