"""The papers' tables and figures from collected results.

    python -m sparse_eval.report <collected table (.csv/.parquet) or runs folder> [--out DIR]

``load_results(path)`` reads either into one DataFrame (``sparse_eval.results.collect``'s layout); ``build_tables`` and
``build_figures`` make what the data allows and say what they skipped and why.  See ``docs/analysis.md``.
"""

from __future__ import annotations

from .figures import FIGURES, build_figures
from .load import load_results, normalize
from .tables import TABLES, Table, build_tables, to_latex, to_markdown


def write_report(path, out, full_at_least: float | None = None) -> dict:
    """Loads ``path`` (or a list of paths, reported together), writes every table (Markdown, LaTeX, CSV) and figure
    (PNG, PDF) under ``out`` plus ``report.md`` (all tables, the figure list, and what was skipped); returns what was
    made and skipped.  ``full_at_least``: runs folders are collected with ``collect --full-at-least`` (the rows over
    the subtasks full attention solves)."""
    from pathlib import Path

    out = Path(out)
    df = load_results(path, full_at_least=full_at_least)  # first: a bad path must not leave an output folder behind
    (out / "tables").mkdir(parents=True, exist_ok=True)
    tables, t_skipped = build_tables(df)
    written = []
    for t in tables:
        for suffix, text in ((".md", to_markdown(t)), (".tex", to_latex(t))):
            p = out / "tables" / f"{t.name}{suffix}"
            p.write_text(text, encoding="utf-8")
            written.append(p)
        p = out / "tables" / f"{t.name}.csv"
        t.frame().to_csv(p, index=False)
        written.append(p)
    figs, f_skipped = build_figures(df, out / "figures")
    shown = ", ".join(map(str, path)) if isinstance(path, (list, tuple)) else str(path)
    lines = [
        f"# Report: {shown}",
        "",
        f"{len(df)} result rows, {df['model'].nunique()} model(s), "
        f"{df['task'].nunique()} task(s): {', '.join(sorted(map(str, df['task'].unique())))}.",
        "",
    ]
    lines += [to_markdown(t) for t in tables]
    lines += ["## Figures", ""] + [f"- `{p.relative_to(out)}`" for p in figs if p.suffix == ".png"]
    if t_skipped or f_skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- table `{k}`: {v}" for k, v in t_skipped.items()]
        lines += [f"- figure `{k}`: {v}" for k, v in f_skipped.items()]
    (out / "report.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {
        "data": df,
        "tables": tables,
        "figures": figs,
        "files": written,
        "skipped_tables": t_skipped,
        "skipped_figures": f_skipped,
        "report": out / "report.md",
    }


__all__ = [
    "FIGURES",
    "TABLES",
    "Table",
    "build_figures",
    "build_tables",
    "load_results",
    "normalize",
    "to_latex",
    "to_markdown",
    "write_report",
]
