"""``python -m sparse_eval.analysis analysis=<name> [model=<conf/model name>] [analysis.<option>=<value> ...]``

A Hydra app like ``python -m sparse_eval``: ``conf/analysis.yaml`` composes ``conf/model/<name>.yaml`` and
``conf/analysis/<name>.yaml`` (the analysis's options with their defaults, checked against its options dataclass,
registered here as ``<name>_schema``), so an unknown option or a value of the wrong type fails at start.
``paths.data_dir=`` (or ``SPARSE_EVAL_DATA_DIR``) is where ``analysis.text=local`` reads WikiText-2.

The analysis writes its raw numbers (JSON + CSV) and figures to ``analysis.out``; the command prints a short
summary (means over layers of the headline numbers) and the files written, the per-layer table among them.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ..config import CONF_DIR, PathsConfig, register_configs, to_plain
from ..models.loading import ModelConfig
from . import ANALYSES


@dataclass
class AnalysisAppConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    analysis: Any = None  # conf/analysis/<name>.yaml: the options of one analysis
    paths: PathsConfig = field(default_factory=PathsConfig)


def options_class(name: str) -> type:
    module, cls = ANALYSES[name]
    return getattr(importlib.import_module(module), cls)


def register_analysis_configs() -> None:
    register_configs()
    cs = ConfigStore.instance()
    cs.store(name="analysis_app_schema", node=AnalysisAppConfig)
    for name in ANALYSES:
        cs.store(group="analysis", name=f"{name}_schema", node=options_class(name))


def analysis_of(cfg: Any) -> tuple[str, Any]:
    """(analysis name, its options dataclass) of a composed config."""
    opts = OmegaConf.to_object(cfg.analysis)
    for name in ANALYSES:
        if type(opts) is options_class(name):
            return name, opts
    raise ValueError(f"analysis: {type(opts).__name__} is not an analysis; valid: analysis={list(ANALYSES)}")


def run(cfg: Any) -> dict[str, Any]:
    """Runs the analysis a composed config names; returns its result (``out``, tables, figures) with ``name``."""
    name, opts = analysis_of(cfg)
    opts.validate()
    model_cfg = ModelConfig(**to_plain(cfg.model))
    result = importlib.import_module(ANALYSES[name][0]).run(model_cfg, opts)
    return dict(result, name=name)


def summary(result: dict[str, Any]) -> str:
    """A few lines: the analysis's headline numbers (its module's ``summary``), the file with the full table,
    and every file written."""
    import pandas as pd

    module = importlib.import_module(ANALYSES[result["name"]][0])
    head = module.summary(result)
    out: Path = result["out"]
    full = pd.read_csv(result["table_file"])
    lines = [
        head.to_string(index=False, float_format=lambda x: f"{x:.4g}"),
        "",
        f"full table ({len(full)} rows x {len(full.columns)} columns): {result['table_file']}",
        "",
        f"wrote {out}:",
    ]
    lines += [f"  {p.name}" for p in sorted(out.iterdir())]
    return "\n".join(lines)


register_analysis_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="analysis")
def main(cfg) -> None:
    from ..cli import EXIT_USAGE, fail

    try:
        result = run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc), EXIT_USAGE)  # one line, exit status 2, nothing left under paths.runs_dir
    print(summary(result))


if __name__ == "__main__":
    from ..cli import hydra_entry

    hydra_entry(main)  # Hydra's errors as one line, exit status 2 (sparse_eval.cli)
