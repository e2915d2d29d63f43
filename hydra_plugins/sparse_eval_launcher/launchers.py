"""``hydra/launcher=slurm`` (and ``submitit_tolerant_local``): see ``sparse_eval.sweep`` for what they add to
hydra-submitit-launcher's launchers.  Absent (nothing to register) when hydra-submitit-launcher is not installed."""

from sparse_eval import sweep as _sweep

if hasattr(_sweep, "TolerantSlurmLauncher"):

    class SlurmLauncher(_sweep.TolerantSlurmLauncher):
        pass

    class LocalLauncher(_sweep.TolerantLocalLauncher):
        pass
