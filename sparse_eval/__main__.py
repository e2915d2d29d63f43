"""``python -m sparse_eval [overrides]``: the Hydra app.  No arguments: the default experiment (offline).

Exit status (``sparse_eval.cli``): 0 success; 1 a failure while running (or a multirun with failed jobs); 2 bad
configuration or input (Hydra errors, bad values, missing data or weights, an unwritable runs dir), reported as one
``error:`` line before anything is written; 130 interrupted (the run resumes when the same command runs again).
Multirun (``-m``): every job runs through ``sweep.run_job``, which records a job's error (``failed.json`` in its
run dir, ``job_status.json`` in its Hydra output folder) instead of stopping the sweep; at the end the
``SweepReport`` callback prints how many jobs failed and the process exits with 1 if any did (else with 124 if the
launcher's deadline stopped some: ``hydra/launcher=local_gpus hydra.launcher.deadline_s=S``).
"""

from __future__ import annotations

import sys

import hydra

from .launcher import sweep
from .cli import EXIT_FAILED, EXIT_USAGE, check_choices, check_compare, fail, hydra_entry, names_a_method
from .config import CONF_DIR, register_configs
from .launcher.runner import run  # torch-free until a run starts: the launch cache answers a finished launch first

# the methods' schemas import torch: registered unless the command line cannot compose a method (``--help``,
# the default experiment, whose ``compare`` list is composed later), so those start without torch
register_configs(methods=names_a_method(sys.argv[1:]))


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg):
    try:
        check_choices()
        check_compare(cfg)
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)
    if sweep.is_multirun():
        return sweep.run_job(cfg)
    try:
        run(cfg)
    except (ValueError, FileNotFoundError, ImportError) as exc:  # bad input or a missing optional package: one line
        run_dir = getattr(exc, "run_dir", None)  # set when the run had started: a failure while running
        if run_dir:
            fail(f"{exc} (recorded in {run_dir}/failed.json)", EXIT_FAILED)
        fail(str(exc), EXIT_USAGE)


if __name__ == "__main__":
    hydra_entry(main)
    sys.exit(sweep.exit_status())
