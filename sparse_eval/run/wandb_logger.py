"""Optional wandb logging of a run (``logger=wandb``); off by default (``logger=none``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class WandbLogger:
    """Optional wandb logging (off by default; ``logger=wandb`` with ``logger.mode=offline`` touches no network)."""

    def __init__(self, cfg: Any, run_dir: Path, identity: dict[str, Any]):
        self.run = None
        if cfg.name == "none":
            return
        if cfg.name != "wandb":
            raise ValueError(f"logger.name={cfg.name!r}; valid: ['none', 'wandb']")
        import wandb

        self.run = wandb.init(project=cfg.project, mode=cfg.mode, dir=str(run_dir), config=identity, name=run_dir.name)

    def log_sample(self, rec: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in rec.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})

    def finish(self, summary: dict[str, Any]) -> None:
        if self.run is not None:
            self.run.summary.update({k: v for k, v in summary.items() if isinstance(v, (int, float, str))})
            self.run.finish()
