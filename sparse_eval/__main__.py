"""``python -m sparse_eval [overrides]``: the Hydra app.  No arguments: the default experiment (offline)."""

from __future__ import annotations

import sys

import hydra

from .config import register_configs
from .runner import CONF_DIR, run

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg) -> None:
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, exit status 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
