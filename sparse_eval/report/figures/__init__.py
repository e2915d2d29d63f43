"""The papers' figures from a results table (``load.load_results``), PNG and PDF.

  fig1_topk_retrieval_vs_aggregation   MagicPIG Fig. 1: TopK accuracy vs budget, niah vs cwe / fwe (RULER)
  fig6c_oracle_vs_topk                 MagicPIG Fig. 6c: oracle sampling vs TopK downstream, by budget
  fig9a_centering                      MagicPIG Fig. 9a: MagicPIG with / without key centering, fixed K, by L
  fig9bc_magicpig_vs_topk              MagicPIG Fig. 9b/c: MagicPIG vs TopK on CWE / FWE against measured Cost2
  ds_fig4_retrieval                    DS Fig. 4: key-value retrieval accuracy vs sparsity level and vs length
  ds_fig4_niah                         DS Fig. 4's variant: one RULER needle subtask run alone, the same two panels
  ds_fig1_ppl_sparsity                 DS Fig. 1 / 9: perplexity vs token and channel sparsity
  pareto_<task>                        every method: score against measured Cost2, with the Pareto front

Each function returns the written paths or raises ``tables.Skip`` with the reason.

One module per figure family: ``magicpig`` (the MagicPIG paper's), ``ds`` (Double Sparsity's), ``tradeoff`` (the
Pareto figures of every method); ``plotting`` holds what they share (markers and colours, panels, axes, interval
bars, ``save``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from ..tables import Skip
from .ds import ds_fig1_ppl, ds_fig4_niah, ds_fig4_retrieval, ppl_grid
from .magicpig import fig1_topk, fig6c_oracle_vs_topk, fig9a_centering, fig9bc_magicpig_vs_topk
from .plotting import INTERVAL_NOTE
from .tradeoff import pareto

__all__ = [
    "FIGURES",
    "INTERVAL_NOTE",
    "build_figures",
    "ds_fig1_ppl",
    "ds_fig4_niah",
    "ds_fig4_retrieval",
    "fig1_topk",
    "fig6c_oracle_vs_topk",
    "fig9a_centering",
    "fig9bc_magicpig_vs_topk",
    "pareto",
    "ppl_grid",
]


FIGURES: dict[str, Callable[[Any, Path], list[Path]]] = {
    "fig1_topk_retrieval_vs_aggregation": fig1_topk,
    "fig6c_oracle_vs_topk": fig6c_oracle_vs_topk,
    "fig9a_centering": fig9a_centering,
    "fig9bc_magicpig_vs_topk": fig9bc_magicpig_vs_topk,
    "ds_fig4_retrieval": ds_fig4_retrieval,
    "ds_fig4_niah": ds_fig4_niah,
    "ds_fig1_ppl_sparsity": ds_fig1_ppl,
    "pareto": pareto,
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
