"""``python -m sparse_eval [overrides]``: the Hydra app.  No arguments: the default experiment (offline).

Single run: bad input (a ValueError / FileNotFoundError naming the bad value) prints one line and exits with 2.
Multirun (``-m``): every job runs through ``sweep.run_job``, which records a job's error (``failed.json`` in its
run dir, ``job_status.json`` in its Hydra output folder) instead of stopping the sweep; at the end the
``SweepReport`` callback prints how many jobs failed and the process exits with 1 if any did.
"""

from __future__ import annotations

import sys

import hydra

from . import sweep
from .config import register_configs
from .runner import CONF_DIR, run

register_configs()


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg):
    if sweep.is_multirun():
        return sweep.run_job(cfg)
    try:
        run(cfg)
    except (ValueError, FileNotFoundError) as exc:  # bad input: one clear line, exit status 2
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
    sys.exit(sweep.exit_status())
