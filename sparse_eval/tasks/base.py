"""The task interface: a task makes samples and scores one sample with an ``Engine``.

A task is one class with ``@register_task`` and one config file in ``conf/task/``; the runner never changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from ..engine import Engine


class DataNotFoundError(FileNotFoundError):
    """A task's data is neither where ``paths.data_dir`` points nor reachable on the hub; says where to put it."""


_HUB_MODULES = ("datasets", "huggingface_hub", "requests", "urllib3", "fsspec", "aiohttp", "httpx")


@contextlib.contextmanager
def from_hub(what: str, hub: str, expected: Path | str | None, fix: str = "") -> Iterator[None]:
    """Wraps a hub download of ``what``: a failure (no network, no ``datasets``, an unknown id) becomes one
    ``DataNotFoundError`` naming the local file expected under ``paths.data_dir`` and the alternatives ``fix``."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only the hub's own errors are translated, others re-raised
        hub_error = isinstance(exc, (ImportError, OSError)) or type(exc).__module__.split(".")[0] in _HUB_MODULES
        if not hub_error:
            raise
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        where = (f"expected {expected}" if expected is not None
                 else "paths.data_dir is unset (env SPARSE_EVAL_DATA_DIR)")
        raise DataNotFoundError(
            f"{what}: no local copy ({where}) and the hub ({hub}) failed: {reason}. Put the file there or set "
            f"paths.data_dir=<folder holding it>" + (f"; {fix}" if fix else "")) from None


@dataclass
class TaskConfig:
    name: str = ""
    num_samples: int | None = None  # None: all the task has
    seed: int = 0


@dataclass
class Sample:
    """One unit of evaluation.  ``id`` must be stable across runs (it is the resume key)."""

    id: str
    data: dict[str, Any] = field(default_factory=dict)


class Task:
    name: ClassVar[str] = ""
    config_class: ClassVar[type[TaskConfig]] = TaskConfig
    default_protocol: ClassVar[str] = "A"
    metric: ClassVar[str] = "score"  # the headline number of the summary table
    higher_is_better: ClassVar[bool] = True

    def __init__(self, config: TaskConfig, data_dir: str | None = None):
        self.config = config
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.validate()

    def validate(self) -> None:
        n = self.config.num_samples
        if n is not None and n < 1:
            raise ValueError(f"task.num_samples={n}: must be >= 1 or null (all)")

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:  # pragma: no cover - abstract
        raise NotImplementedError

    def run(self, sample: Sample, engine: "Engine") -> dict[str, Any]:  # pragma: no cover - abstract
        """Score one sample; returns at least the fields the task's ``aggregate`` reads."""
        raise NotImplementedError

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Task metric(s) over the finished samples, as the benchmark averages them."""
        scores = [r["score"] for r in records if r.get("score") is not None]
        return {self.metric: sum(scores) / len(scores) if scores else None}


TASKS: dict[str, type[Task]] = {}


def register_task(cls: type[Task]) -> type[Task]:
    TASKS[cls.name] = cls
    return cls


def task_class(name: str) -> type[Task]:
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; valid tasks: {sorted(TASKS)}") from None


def build_task(options: Mapping[str, Any], data_dir: str | None = None) -> Task:
    cls = task_class(options["name"])
    fields = {f.name for f in dataclasses.fields(cls.config_class)}
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown option(s) {unknown} for task {options['name']!r}; valid options: {sorted(fields)}")
    return cls(cls.config_class(**dict(options)), data_dir=data_dir)
