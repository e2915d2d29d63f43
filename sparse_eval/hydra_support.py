"""What the Hydra apps share below the config schemas (``config``) and the command-line rules (``cli``): the
``conf/`` folder and the ``writable_or_tmp`` resolver that ``conf/*.yaml`` name Hydra's output folder with.

No project imports, so ``config`` and ``cli`` both import it without importing each other.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the Hydra configs (``conf/``)
# folders ``writable_or_tmp`` created for Hydra's output (``cli.forget_hydra_output`` removes them on a refusal)
MADE: list[Path] = []


def writable_or_tmp(runs_dir: str) -> str:
    """Hydra's output folder for a single run: under ``runs_dir`` when it can be written, else under the temp dir
    (so a finished run can be printed from a read-only store, and an impossible ``runs_dir`` reaches the runner's
    one-line error instead of a Hydra traceback)."""
    path = Path(str(runs_dir)).expanduser()
    try:
        for d in (path / ".hydra", *(path / ".hydra").parents):
            if d.exists():
                break
            if d not in MADE:
                MADE.append(d)
        path.mkdir(parents=True, exist_ok=True)
        if os.access(path, os.W_OK):
            return str(path)
    except OSError:
        pass
    return str(Path(tempfile.gettempdir()) / "sparse_eval_hydra")


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    if not OmegaConf.has_resolver("writable_or_tmp"):
        OmegaConf.register_new_resolver("writable_or_tmp", writable_or_tmp)
