"""MagicPIG's figures (arXiv 2410.16179): TopK retrieval vs aggregation (Fig. 1), oracle sampling vs TopK
(Fig. 6c), key centering (Fig. 9a), MagicPIG vs TopK against measured Cost2 (Fig. 9b/c)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from ...methods.magicpig import MagicPIG
from ...methods.oracle import OracleSampling
from ...methods.topk import TopK
from ..load import param, reference_rows, run_rows, subtask_rows
from ..tables import Skip
from .plotting import (
    COLORS,
    MARKERS,
    annotate_spread,
    error_bars,
    full_line,
    interval_note,
    len_label,
    n_text,
    panels,
    plain_log_x,
    save,
    score_label,
    score_limits,
    score_points,
    setting_text,
)

NIAH_PREFIX = "niah"


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
    fig, axes = panels(len(keys))
    drawn = False
    for ax, (model, length) in zip(axes, keys):
        d = g[(g["model"] == model) & (g["length"] == length)]
        for i, (grp, dd) in enumerate(sorted(d.groupby("group"), key=lambda x: x[0])):
            dd = dd.assign(budget=[param(r, "budget") for _, r in dd.iterrows()])
            m = score_points(dd, "budget")
            ax.plot(m.index, m["score"], marker="o", color=f"C{i}", label=f"TopK: {grp}")
            drawn |= error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=f"C{i}")
            f = full[(full["model"] == model) & (full["length"] == length) & (full["group"] == grp)]
            drawn |= full_line(ax, f, f"Full: {grp}", f"C{i}")
        ax.set_xscale("log")
        plain_log_x(ax)
        ax.set_xlabel("TopK budget (fraction of the context's keys, log scale)")
        ax.set_ylabel("RULER score (0-100)")
        ax.set_ylim(-2, 102)
        ax.set_title(f"{model}, RULER {len_label(length)}; {n_text(d)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(
        f"TopK on retrieval (niah) vs aggregation (cwe, fwe) (MagicPIG Fig. 1) — {setting_text(topk)}", fontsize=10
    )
    interval_note(fig, drawn)
    return save(fig, out, "fig1_topk_retrieval_vs_aggregation")


def fig6c_oracle_vs_topk(df, out: Path) -> list[Path]:
    runs = run_rows(df)
    d = runs[runs["method"].isin([TopK.name, OracleSampling.name])]
    both = [k for k, g in d.groupby(["model", "task", "length"], dropna=False) if g["method"].nunique() == 2]
    if not both:
        raise Skip("needs topk and oracle runs of the same model, task and length")
    fig, axes = panels(len(both))
    drawn = False
    for ax, (model, task, length) in zip(axes, both):
        g = d[
            (d["model"] == model)
            & (d["task"] == task)
            & ((d["length"] == length) if length == length else d["length"].isna())
        ]
        notes: list[tuple[float, float, str]] = []
        for cls in (TopK, OracleSampling):
            name = cls.display_name
            dm = g[g["method"] == cls.name]
            dm = dm.assign(budget=[param(r, "budget") for _, r in dm.iterrows()])
            m = score_points(dm, "budget", cost2=("cost2", "mean"))
            ax.plot(m.index, m["score"], marker=MARKERS[name], color=COLORS[name], label=name)
            drawn |= error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=COLORS[name])
            if cls is OracleSampling:
                notes = [(b, r.score, f"Cost2 {r.cost2:.3g}") for b, r in m.iterrows()]
        f = reference_rows(runs[(runs["model"] == model) & (runs["task"] == task)])
        if length == length:
            f = f[f["length"] == length]
        drawn |= full_line(ax, f)
        metric = g["metric"].iloc[0]
        ax.set_xscale("log")
        plain_log_x(ax)
        ax.set_xlabel("budget (fraction of the context: keys kept / draws, log scale)")
        ax.set_ylabel(score_label(task, metric))
        score_limits(ax, task)
        annotate_spread(ax, notes, fontsize=6)
        ax.set_title(f"{model}, {task} {len_label(length)}; {n_text(g)}".strip(), fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.suptitle(f"Oracle sampling vs TopK downstream (MagicPIG Fig. 6c) — {setting_text(d)}", fontsize=10)
    interval_note(fig, drawn)
    return save(fig, out, "fig6c_oracle_vs_topk")


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
    fig, axes = panels(len(keys))
    drawn = False
    for ax, (model, task, length, K) in zip(axes, keys):
        rows = mp[(mp["model"] == model) & (mp["task"] == task) & (mp["K"] == K)]
        if length == length:
            rows = rows[rows["length"] == length]
        s = sub[sub["run_dir"].isin(rows["run_dir"])] if "run_dir" in sub else sub.iloc[0:0]
        series = []
        if task == "ruler" and not s.empty:
            s = _group_score(
                s, lambda x: "niah (mean of niah_*)" if x.startswith(NIAH_PREFIX) else (x if x == "fwe" else None)
            )
            for grp, dd in s.groupby("group"):
                series.append((grp, dd.merge(rows[["run_dir", "L", "center"]], on="run_dir")))
        if not series:
            series = [(f"{task} score", rows)]
        for i, (grp, dd) in enumerate(series):
            for center, ls in ((True, "-"), (False, ":")):
                m = score_points(dd[dd["center"] == center], "L")
                # later series drawn smaller on top, so that equal scores stay visible
                drawn |= error_bars(ax, m.index, m["score"], m["lo"], m["hi"], color=f"C{i}", zorder=1.5 + i)
                ax.plot(
                    m.index,
                    m["score"],
                    ls=ls,
                    marker="o" if center else "X",
                    color=f"C{i}",
                    markersize=max(3.0, 10.0 - 3.0 * i),
                    zorder=2 + i,
                    mfc="none" if center else f"C{i}",
                    label=f"{grp}, {'centered' if center else 'no centering'}",
                )
        ax.set_xlabel(f"L (hash tables), K = {int(K)}")
        ax.set_ylabel(score_label(task))
        score_limits(ax, task)
        if rows["L"].nunique() == 1:
            ax.set_xticks([float(rows["L"].iloc[0])])
        ax.set_title(f"{model}, {task} {len_label(length)}; {n_text(s if not s.empty else rows)}".strip(), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"Importance of key centering (MagicPIG Fig. 9a) — {setting_text(mp)}", fontsize=10)
    interval_note(fig, drawn)
    return save(fig, out, "fig9a_centering")


def fig9bc_magicpig_vs_topk(df, out: Path) -> list[Path]:
    sub = subtask_rows(df, "ruler")
    d = sub[sub["method"].isin([TopK.name, MagicPIG.name]) & sub["subtask"].isin(["cwe", "fwe"])]
    if d.empty or d["method"].nunique() < 2:
        raise Skip("needs RULER runs of both topk and magicpig with the cwe / fwe subtasks")
    keys = sorted({(m, l, s) for m, l, s in zip(d["model"], d["length"], d["subtask"])}, key=str)
    fig, axes = panels(len(keys))
    drawn = False
    for ax, (model, length, st) in zip(axes, keys):
        g = d[(d["model"] == model) & (d["length"] == length) & (d["subtask"] == st)]
        t = score_points(g[g["method"] == TopK.name], "config", cost2=("cost2", "mean")).sort_values("cost2")
        ax.plot(t["cost2"], t["score"], marker="o", color=COLORS["TopK"], label="TopK (exact)")
        drawn |= error_bars(ax, t["cost2"], t["score"], t["lo"], t["hi"], color=COLORS["TopK"])
        mp = score_points(g[g["method"] == MagicPIG.name], "config", cost2=("cost2", "mean"))
        ax.scatter(mp["cost2"], mp["score"], marker="^", color=COLORS["MagicPIG"], zorder=3, label="MagicPIG (K, L)")
        drawn |= error_bars(ax, mp["cost2"], mp["score"], mp["lo"], mp["hi"], color=COLORS["MagicPIG"])
        f = reference_rows(sub[(sub["model"] == model) & (sub["length"] == length) & (sub["subtask"] == st)])
        drawn |= full_line(ax, f)
        ax.set_xscale("log")
        plain_log_x(ax)
        ax.set_xlabel("measured Cost2 (fraction of keys attended, log scale)")
        ax.set_ylabel(f"RULER {st} score (0-100)")
        ax.set_ylim(-3, 103)
        annotate_spread(ax, [(r.cost2, r.score, str(cfg)) for cfg, r in mp.iterrows()])
        ax.set_title(f"{model}, RULER {len_label(length)}: {st.upper()}; {n_text(g)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    fig.suptitle(f"MagicPIG vs TopK on aggregation tasks (MagicPIG Fig. 9b/c) — {setting_text(d)}", fontsize=10)
    interval_note(fig, drawn)
    return save(fig, out, "fig9bc_magicpig_vs_topk")
