"""``hydra/launcher=slurm`` (and ``submitit_tolerant_local``), ``hydra/launcher=local_gpus``: see
``sparse_eval.launcher.sweep`` for what they add to hydra-submitit-launcher's and hydra-joblib-launcher's launchers.  Each is
absent (nothing to register) when its plugin is not installed."""

from sparse_eval.launcher import sweep as _sweep

if hasattr(_sweep, "TolerantSlurmLauncher"):

    class SlurmLauncher(_sweep.TolerantSlurmLauncher):
        pass

    class LocalLauncher(_sweep.TolerantLocalLauncher):
        pass


if hasattr(_sweep, "DeadlineJoblibLauncher"):

    class JoblibLauncher(_sweep.DeadlineJoblibLauncher):
        pass
