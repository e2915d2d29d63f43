"""Double Sparsity's figures: key-value retrieval accuracy vs sparsity level and length (Fig. 4, and its variant on
one RULER needle subtask), perplexity vs token and channel sparsity (Fig. 1, and Fig. 9's grid)."""

from __future__ import annotations

import math
from pathlib import Path

from ...methods import is_dense
from ...methods.double_sparsity import DoubleSparsity
from ..load import method_level, param, point_label, reference_rows, run_rows
from ..tables import Skip, ds_levels
from .plotting import (
    MARKERS,
    error_bars,
    frac_ticks,
    full_line,
    interval_note,
    n_text,
    panels,
    plain_log_axis,
    save,
    score_points,
    setting_text,
    wikitext_text,
)


def _retrieval_label(r) -> str:
    """Legend label of a kv-retrieval run: the method and its point label (``load.point_label``: 'DS 1/16' where
    token = channel sparsity, else the method's config)."""
    lab = point_label(r)
    return r["method_name"] if lab == "–" else f"{r['method_name']} {lab}"


def ds_fig4_retrieval(df, out: Path) -> list[Path]:
    """DS Fig. 4: key-value retrieval ("Lost in the Middle" JSON) accuracy by sparsity level and by length."""
    runs = run_rows(df, "kv_retrieval")
    if runs.empty:
        raise Skip("no kv_retrieval runs")
    return _retrieval_by_sparsity(runs, out, "ds_fig4_retrieval", "Key-value retrieval (DS Fig. 4)")


# RULER's one-needle subtasks: the "fewer keys" variant of DS Fig. 4 (one needle in an essay haystack)
NIAH_VARIANT_SUBTASKS = ("niah_single_1", "niah_single_2", "niah_single_3")


def ds_fig4_niah(df, out: Path) -> list[Path]:
    """DS Fig. 4's variant on one RULER needle subtask: the runs of that subtask alone (a run of several subtasks
    is not this figure), by sparsity level and by length.  For models whose full attention retrieves too little
    from the key-value JSON for the sparsity curve to have room to fall."""
    runs = run_rows(df, "ruler")
    runs = runs[runs["subtask"].isin(NIAH_VARIANT_SUBTASKS)]
    if runs.empty:
        raise Skip(f"no RULER runs of one of {', '.join(NIAH_VARIANT_SUBTASKS)} alone")
    subtasks = sorted(runs["subtask"].unique())
    if len(subtasks) > 1:
        raise Skip(f"RULER runs of several single-needle subtasks ({', '.join(subtasks)}): one figure is one subtask")
    return _retrieval_by_sparsity(
        runs, out, "ds_fig4_niah", f"One-needle retrieval, RULER {subtasks[0]} (DS Fig. 4's variant)"
    )


def _retrieval_by_sparsity(runs, out: Path, stem: str, title: str) -> list[Path]:
    """(a) accuracy by sparsity level, one line per method and length; (b) by length, one line per config."""
    runs = runs.copy()
    runs["level"] = [method_level(r) for _, r in runs.iterrows()]  # the method's (``Method.level``)
    runs["label"] = [_retrieval_label(r) for _, r in runs.iterrows()]
    lengths = sorted(runs["length"].dropna().unique())
    fig, axes = panels(2, 5.6, 4.4)
    # (a) vs sparsity level, one line per method and context length; level 1 = full attention (as DS Table 2)
    ax = axes[0]
    drawn = False
    keys = lengths or [None]
    for j, L in enumerate(keys):
        a = runs if L is None else runs[runs["length"] == L]
        f = reference_rows(a)
        fs = f["score"].mean() if not f.empty else None
        fp = score_points(f.assign(level=1.0), "level") if not f.empty else None  # full's point, with its interval
        dodge = 2 ** (0.08 * (j - (len(keys) - 1) / 2))
        sparse = a[a["level"].notna()]
        for name, dd in sparse.groupby("method_name"):
            m = score_points(dd, "level").sort_index(ascending=False)
            xs, ys, los, his = [1 / x for x in m.index], list(m["score"]), list(m["lo"]), list(m["hi"])
            if fs is not None:
                xs, ys = [1.0] + xs, [fs] + ys
                los, his = [fp["lo"].iloc[0]] + los, [fp["hi"].iloc[0]] + his
            ax.plot(
                [x * dodge for x in xs],
                ys,
                marker=MARKERS.get(name, "o"),
                color=f"C{j}",
                ls=("-", "--", "-.")[j % 3] if name == DoubleSparsity.display_name else ":",
                markersize=max(4.0, 8.0 - 1.5 * j),
                zorder=2 + j,
                label=f"{name}, {int(L)} tokens" if L is not None else name,
            )
            drawn |= error_bars(ax, [x * dodge for x in xs], ys, los, his, color=f"C{j}", zorder=1.5 + j)
        if sparse.empty and fs is not None:
            ax.plot(
                [dodge],
                [fs],
                marker=MARKERS["Full"],
                color=f"C{j}",
                ls="none",
                label=f"Full, {int(L)} tokens" if L is not None else "Full",
            )
            drawn |= error_bars(ax, [dodge], [fs], fp["lo"], fp["hi"], color=f"C{j}")
    ax.set_xscale("log", base=2)
    frac_ticks(ax)
    ax.set_xlabel("sparsity level (share of the keys attended; 1 = full attention)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"(a) by sparsity level; {n_text(runs)}", fontsize=9)
    ax.grid(alpha=0.3, which="major")
    ax.legend(fontsize=7)
    # (b) vs context length, one line per method config (Full first, then DS by level)
    ax = axes[1]
    if len(lengths) >= 2:
        order = sorted(
            runs.groupby("label"),
            key=lambda kv: (
                not is_dense(kv[1]["method"].iloc[0]),
                -(kv[1]["level"].dropna().mean() if kv[1]["level"].notna().any() else 2),
            ),
        )
        for i, (lab, dd) in enumerate(order):
            m = score_points(dd, "length")
            if len(m) >= 2:
                name = dd["method_name"].iloc[0]
                full = is_dense(dd["method"].iloc[0])
                dodge = 2 ** (0.03 * (i - (len(order) - 1) / 2))
                ax.plot(
                    [x * dodge for x in m.index],
                    m["score"],
                    marker=MARKERS.get(name, "o"),
                    color="black" if full else f"C{i}",
                    ls="--" if full else "-",
                    markersize=max(3.0, 9.0 - 1.0 * i),
                    zorder=2 + i,
                    label=lab,
                )
                drawn |= error_bars(
                    ax,
                    [x * dodge for x in m.index],
                    m["score"],
                    m["lo"],
                    m["hi"],
                    color="black" if full else f"C{i}",
                    zorder=1.5 + i,
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [str(int(x)) for x in lengths])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, "one context length only", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("context length (prompt tokens)")
    ax.set_ylabel("retrieval accuracy (%)")
    ax.set_ylim(-3, 103)
    ax.set_title(f"(b) by context length; {n_text(runs)}", fontsize=9)
    ax.grid(alpha=0.3, which="both")
    fig.text(
        0.5,
        -0.02,
        "Points of different lines are shifted slightly sideways so that equal values stay visible.",
        ha="center",
        fontsize=7,
    )
    interval_note(fig, drawn, y=-0.04)
    models = ", ".join(sorted(runs["model"].unique()))
    fig.suptitle(f"{title} — {models}; {setting_text(runs)}", fontsize=10)
    return save(fig, out, stem)


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
    fig, axes = panels(len(models), 5.4, 4.0)
    shapes = {"qk": "o", "q": "s", "k": "^", "random": "D"}
    drawn = False
    for ax, model in zip(axes, models):
        d = ds[ds["model"] == model]
        diag = d[
            [
                t is not None and c is not None and math.isclose(t, min(c, 1.0), rel_tol=1e-6)
                for t, c in zip(d["tok"], d["chan"])
            ]
        ]
        groups = sorted(diag.groupby(["ctype", "offload"]), key=lambda kv: (kv[0][0] != "qk", kv[0]))
        for i, ((ct, off), dd) in enumerate(groups):
            m = score_points(dd, "tok").sort_index(ascending=False)
            seeds = dd["seed"].nunique()
            lab = f"{DoubleSparsity.display({'offload': off})}, {ct} channels" + (
                f" (mean of {seeds} seeds)" if ct == "random" and seeds > 1 else ""
            )
            if len(m) == 1:
                lab += f" (1/{1 / m.index[0]:g} only)"
            line = ax.plot(
                [1 / x for x in m.index],
                m["score"],
                marker=shapes.get(ct, "o"),
                ls="-" if len(m) > 1 else "none",
                markersize=max(4.0, 9.0 - 1.5 * i),
                mfc="none" if i else None,
                zorder=3 + i,
                label=lab,
            )
            drawn |= error_bars(
                ax, [1 / x for x in m.index], m["score"], m["lo"], m["hi"], color=line[0].get_color(), zorder=2.5 + i
            )
        full = reference_rows(runs[runs["model"] == model])
        drawn |= full_line(ax, full)
        ax.set_xscale("log", base=2)
        frac_ticks(ax)
        ax.set_yscale("log")
        plain_log_axis(ax.yaxis)
        ax.set_xlabel("sparsity level (token = channel sparsity)")
        ax.set_ylabel("WikiText-2 perplexity (log scale, lower is better)")
        ax.set_title(f"{model}; {wikitext_text(d)}", fontsize=9)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Perplexity vs sparsity level (DS Table 2 / Fig. 1) — {setting_text(ds)}", fontsize=10)
    interval_note(fig, drawn)
    paths += save(fig, out, "ds_fig1_ppl_sparsity")
    # Fig. 9: token x channel grid of the qk channels (the paper's), when present
    qk = ds[(ds["ctype"] == "qk") & ~ds["offload"]]
    grids = [
        m for m in models if qk[qk["model"] == m]["tok"].nunique() >= 2 and qk[qk["model"] == m]["chan"].nunique() >= 2
    ]
    if grids:
        import numpy as np

        fig, axes = panels(len(grids), 5.4, 4.6)
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
            ax.set_title(f"{model}; qk channels; {wikitext_text(d)}", fontsize=9)
            cb = fig.colorbar(im, ax=ax, label="WikiText-2 perplexity")
            plain_log_axis(cb.ax.yaxis)
        fig.suptitle(
            f"Perplexity by token and channel sparsity (DS Fig. 9) — {setting_text(qk)}; empty cells: not run",
            fontsize=10,
        )
        paths += save(fig, out, "ds_fig9_ppl_grid")
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


def _lognorm(mat):
    import numpy as np
    from matplotlib.colors import LogNorm

    v = mat[np.isfinite(mat)]
    return LogNorm(vmin=v.min(), vmax=v.max()) if len(v) and v.min() > 0 and v.max() > v.min() else None
