"""Tasks: each module registers one task class."""

from __future__ import annotations

import importlib

from .base import TASKS, Sample, Task, TaskConfig, build_task, register_task, task_class

for _mod in ("wikitext", "ruler", "kv_retrieval", "longbench", "lm_eval_task"):
    try:
        importlib.import_module(f"{__name__}.{_mod}")
    except ModuleNotFoundError as _e:  # only while a task module is absent
        if _e.name != f"{__name__}.{_mod}":
            raise

__all__ = ["TASKS", "Sample", "Task", "TaskConfig", "build_task", "register_task", "task_class"]
