"""The launcher: what ``python -m sparse_eval`` does around the runs.

``runner`` (one launch: the launch cache, then each method's run under its lock, failures recorded, the table
printed), ``launch_cache`` (a relaunch whose runs are all finished answered from their saved results before any
model loads), ``sweep`` (a multirun's jobs: the launchers' callbacks, the deadline, the combined table at the end)
and ``preflight`` (every job of a sweep checked before any starts).

May import everything below it: ``run``, ``results``, ``models``, ``tasks``, ``verdicts.claims``, the ground floor
(``config``, ``fingerprint``, ``hydra_support``, ...), ``cli`` (exit codes); nothing
imports the launcher but ``__main__`` and the Hydra configs (``conf/config.yaml``'s callbacks)."""
