"""Tasks: each module registers one task class; every module of this folder is imported here
(``sparse_eval.discovery``), so a new task is one new module."""

from __future__ import annotations

from ..discovery import import_package_modules
from .base import TASKS, Sample, Task, TaskConfig, build_task, register_task, task_class

import_package_modules(__name__, skip=("base",))

__all__ = ["TASKS", "Sample", "Task", "TaskConfig", "build_task", "register_task", "task_class"]
