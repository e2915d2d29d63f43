"""Analyses of attention on captured tensors, one module each, one command each:

    # MagicPIG Fig. 2, 5, 10, 11
    python -m sparse_eval.analysis analysis=geometry        model=<name> [analysis.<option>=...]
    # MagicPIG Fig. 3, 4, 6a/b, Thm 3.3
    python -m sparse_eval.analysis analysis=error_vs_budget model=<name> [analysis.<option>=...]
    # DS Fig. 7b, Fig. 8
    python -m sparse_eval.analysis analysis=ds_checks       model=<name> [analysis.<option>=...]
    # MagicPIG (K, L) for a target Cost2
    python -m sparse_eval.analysis analysis=magicpig_kl     model=<name> [analysis.<option>=...]

Each writes the raw numbers (JSON + CSV) and PNG/PDF figures to ``analysis.out=`` (default
``analysis/<name>/<model>``); its options are ``conf/analysis/<name>.yaml``.
See ``docs/analysis.md``.
"""

from __future__ import annotations

ANALYSES = {
    "geometry": ("sparse_eval.analysis.geometry", "GeometryOptions"),
    "error_vs_budget": ("sparse_eval.analysis.error_vs_budget", "ErrorOptions"),
    "ds_checks": ("sparse_eval.analysis.ds_checks", "DSCheckOptions"),
    "magicpig_kl": ("sparse_eval.analysis.magicpig_kl", "MagicPIGKLOptions"),
}

__all__ = ["ANALYSES"]
