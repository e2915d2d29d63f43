"""Hydra plugin package of sparse_eval: the fault-tolerant submitit launchers (code in ``sparse_eval.launcher.sweep``).

Hydra instantiates launchers only from the ``hydra_plugins`` namespace package; ``hydra_plugins`` itself has no
``__init__.py`` (a namespace shared with hydra-submitit-launcher and the other plugins).
"""
