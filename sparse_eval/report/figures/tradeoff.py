"""Every method's score against its measured Cost2, with the Pareto front (``pareto_<task>_<model>``)."""

from __future__ import annotations

from pathlib import Path

from ..load import cut_short, point_label, run_rows
from ..tables import Skip
from .plotting import (
    COLORS,
    MARKERS,
    annotate_spread,
    distinct_labels,
    error_bars,
    interval_note,
    len_label,
    n_text,
    panels,
    plain_log_axis,
    plain_log_x,
    save,
    score_label,
    score_limits,
    setting_text,
    wikitext_text,
)


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
        keys = sorted(
            {(None if ln != ln else ln, st) for ln, st in zip(d["length"], d["panel_sub"])},
            key=lambda k: (k[0] or 0, str(k[1])),
        )
        fig, axes = panels(len(keys), 5.6, 4.4)
        drawn = False
        metric = str(d["metric"].iloc[0])
        lower = metric in ("ppl", "perplexity")
        for ax, (length, sub) in zip(axes, keys):
            g = d[(d["length"] == length) if length is not None else d["length"].isna()]
            g = g[(g["panel_sub"] == sub) if sub is not None else g["panel_sub"].isna()]
            # the same config run twice (e.g. in two collected sweeps) with the same result: one point
            g = g.drop_duplicates(subset=["method_name", "config", "setting", "cost2", "score"])
            labels = []
            short = cut_short(g)
            for name, dd in g.groupby("method_name"):
                cut = short.loc[dd.index]
                for part, hollow in ((dd[~cut], False), (dd[cut], True)):
                    if part.empty:
                        continue
                    ax.scatter(  # an incomplete run: a hollow marker, left off the Pareto front
                        part["cost2"],
                        part["score"],
                        marker=MARKERS.get(name, "o"),
                        facecolors="none" if hollow else COLORS.get(name),
                        edgecolors=COLORS.get(name),
                        label=f"{name} (incomplete)" if hollow else name,
                        s=30,
                        zorder=3,
                    )
                if "score_lo" in dd.columns and "score_hi" in dd.columns:  # one run per point
                    drawn |= error_bars(
                        ax, dd["cost2"], dd["score"], dd["score_lo"], dd["score_hi"], color=COLORS.get(name)
                    )
                if len(dd) <= 12:
                    idx = [i for i, r in dd.iterrows() if r["config"] != "–"]
                    rows = [dd.loc[i] for i in idx]
                    texts = distinct_labels(rows, [_short_config(r) for r in rows])
                    texts = [t + (" (incomplete)" if short.loc[i] else "") for i, t in zip(idx, texts)]
                    labels += [(r["cost2"], r["score"], t) for r, t in zip(rows, texts)]
            pts = sorted(zip(g.loc[~short, "cost2"], g.loc[~short, "score"]))
            front, best = [], None
            for c, s_ in pts:  # cheapest first: keep points better than every cheaper one
                if best is None or (s_ < best if lower else s_ > best):
                    front.append((c, s_))
                    best = s_
            if front:
                front.append((pts[-1][0], front[-1][1]))  # the best score stays reachable up to the dearest point
                ax.step(
                    [c for c, _ in front],
                    [s_ for _, s_ in front],
                    where="post",
                    color="grey",
                    lw=1,
                    ls="--",
                    label="Pareto front",
                    zorder=2,
                )
            ax.set_xscale("log")
            plain_log_x(ax)
            ax.set_xlabel("measured Cost2 (fraction of keys attended, log scale)")
            ylab = score_label(task, metric)
            ax.set_ylabel(ylab + ("" if lower or "better" in ylab else ", higher is better"))
            score_limits(ax, task)
            if lower:  # perplexities span decades when a method breaks down
                ax.set_yscale("log")
                plain_log_axis(ax.yaxis)
                ax.set_ylabel(ylab.replace("(lower", "(log scale, lower"))
            annotate_spread(ax, labels, fontsize=6)
            head = " ".join(x for x in (task, str(sub) if sub else "", len_label(length)) if x)
            extra = wikitext_text(g) if task == "wikitext" else n_text(g)
            ax.set_title(f"{head}; {extra}" if extra else head, fontsize=9)
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
        fig.suptitle(f"Accuracy vs attention cost, every method — {model}, {task}; {setting_text(d)}", fontsize=10)
        interval_note(fig, drawn)
        paths += save(fig, out, f"pareto_{task}_{model}")
    return paths


def _short_config(r) -> str:
    """A point's label: the method's short form (``Method.point_label``: DS at token = channel sparsity as its
    level, 1/16), else its config."""
    return point_label(r)
