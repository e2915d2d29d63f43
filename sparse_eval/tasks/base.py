"""The task interface: a task makes samples, says what model work one sample needs (``request``: a generation
or a log-likelihood) and scores the result (``score``), so the runner can run many samples as one batch.

A task whose samples are not one request each (lm-eval: one sample is a whole lm-eval task) implements ``run``
instead and is run one sample at a time.  A task is one class with ``@register_task`` and one config file in
``conf/task/``; the runner never changes.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from ..generation.engine import Engine, GenerationRequest, LoglikelihoodRequest
    from ..metrics.statistics import ScoreTerms


class DataNotFoundError(FileNotFoundError):
    """A task's data is neither where ``paths.data_dir`` points nor reachable on the hub; says where to put it."""


_HUB_MODULES = ("datasets", "huggingface_hub", "requests", "urllib3", "fsspec", "aiohttp", "httpx")
HUB_READS = [0]  # how many times this process fetched task data from the hub (``from_hub``; the launch cache)


@contextlib.contextmanager
def from_hub(what: str, hub: str, expected: Path | str | None, fix: str = "") -> Iterator[None]:
    """Wraps a hub download of ``what``: a failure (no network, no ``datasets``, an unknown id) becomes one
    ``DataNotFoundError`` naming the local file expected under ``paths.data_dir`` and the alternatives ``fix``.
    Counted in ``HUB_READS``: a launch that read hub data is not cached (``sparse_eval.launcher.launch_cache``)."""
    HUB_READS[0] += 1
    try:
        yield
    except Exception as exc:  # noqa: BLE001 - only the hub's own errors are translated, others re-raised
        hub_error = isinstance(exc, (ImportError, OSError)) or type(exc).__module__.split(".")[0] in _HUB_MODULES
        if not hub_error:
            raise
        reason = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
        where = f"expected {expected}" if expected is not None else "paths.data_dir is unset (env SPARSE_EVAL_DATA_DIR)"
        raise DataNotFoundError(
            f"{what}: no local copy ({where}) and the hub ({hub}) failed: {reason}. Put the file there or set "
            f"paths.data_dir=<folder holding it>" + (f"; {fix}" if fix else "")
        ) from None


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
    # one line for ``python -m sparse_eval --help``: what the task measures (and which paper item it serves)
    summary: ClassVar[str] = ""
    # what ``task.num_samples=N`` keeps, for the help's quick-try line (a run's identity holds the number)
    num_samples_means: ClassVar[str] = "the first N samples"
    metric: ClassVar[str] = "score"  # the headline number of the summary table
    higher_is_better: ClassVar[bool] = True
    # config fields added after runs were archived that enter a run's identity only when set (not None), so the
    # runs made before them keep their directories (a None there is the behaviour those runs had)
    identity_when_set: ClassVar[tuple[str, ...]] = ()

    def __init__(self, config: TaskConfig, data_dir: str | None = None):
        self.config = config
        self.data_dir = Path(data_dir).expanduser() if data_dir else None
        self.read_files: dict[str, Path] = {}  # local data files samples() read: their sha256 identify the run
        self.validate()

    def record_file(self, name: str, path: str | Path) -> None:
        """Note a local file ``samples()`` read: its sha256 enters the run's identity (a data file rewritten in
        place gives a new run directory, not the old results)."""
        self.read_files[name] = Path(path).expanduser().resolve()

    def validate(self) -> None:
        n = self.config.num_samples
        if n is not None and n < 1:
            raise ValueError(f"task.num_samples={n}: must be >= 1 or null (all)")

    def samples(self, tokenizer: Any, max_context: int) -> list[Sample]:  # pragma: no cover - abstract
        raise NotImplementedError

    def request(self, sample: Sample) -> "GenerationRequest | LoglikelihoodRequest":
        """The model work of one sample (its ``key`` is the sample id)."""
        raise NotImplementedError(f"task {self.name!r} has no per-sample request; it implements run()")

    def score(self, sample: Sample, result: Any) -> dict[str, Any]:
        """The record of one sample from its request's result: at least the fields ``aggregate`` reads."""
        raise NotImplementedError

    @property
    def batched(self) -> bool:
        """Whether samples run as batches (the task implements ``request``/``score``)."""
        return type(self).request is not Task.request

    def run(self, sample: Sample, engine: "Engine") -> dict[str, Any]:
        """Score one sample alone."""
        return self.score(sample, engine.run_batch([self.request(sample)])[0])

    def run_batch(self, samples: list[Sample], engine: "Engine") -> list[dict[str, Any]]:
        """Score samples as one padded batch (a batch of one is ``run``)."""
        if len(samples) == 1:
            return [self.run(samples[0], engine)]
        results = engine.run_batch([self.request(s) for s in samples])
        return [self.score(s, r) for s, r in zip(samples, results)]

    def aggregate(self, records: list[dict[str, Any]]) -> dict[str, Any]:
        """Task metric(s) over the finished samples, as the benchmark averages them."""
        scores = [r["score"] for r in records if r.get("score") is not None]
        return {self.metric: sum(scores) / len(scores) if scores else None}

    def units(self, records: list[dict[str, Any]]) -> int:
        """How many scored units the finished sample records hold: what a results table's ``samples`` counts
        (``collect``, ``results_table``) and the score's interval resamples.  One per record, unless a task's
        record holds several (lm-eval's: the documents of a task or of a piece of one)."""
        return len(records)

    def expected_units(self, expected: int, records: list[dict[str, Any]]) -> int:
        """The units of a run of ``expected`` sample records, ``records`` being those it finished (in ``units``'s
        count): ``expected`` when a record is one unit."""
        return expected

    def summary_warnings(self, records: list[dict[str, Any]]) -> list[str]:
        """What the finished sample records say is wrong with the measurement itself (a run's summary.json
        ``warnings``, also logged): none by default."""
        return []

    def score_terms(self, records: list[dict[str, Any]]) -> "ScoreTerms | None":
        """The per-sample terms of the headline score (``sparse_eval.metrics.statistics``), from which its confidence
        interval and paired differences are bootstrapped; ``terms.score()`` equals ``aggregate``'s.  The default:
        the plain mean of ``score``.  None: the task's samples are not exchangeable units (no interval)."""
        from ..metrics.statistics import ScoreTerms

        scored = [r for r in records if r.get("score") is not None]
        return ScoreTerms(
            [r["id"] for r in scored], [r["score"] for r in scored], [1.0] * len(scored), [0] * len(scored)
        )

    def evaluated_texts(self, samples: list[Sample], tokenizer: Any) -> list[str] | None:
        """The text the run evaluates, which calibration text must not overlap (``sparse_eval.identity.overlap``): by
        default each sample's request decoded with the model's tokenizer (WikiText's windows, the RULER,
        LongBench and key-value prompts with their haystacks).  None: the task cannot say (lm_eval, whose prompts
        lm-eval builds), and the check is skipped with a warning."""
        if not self.batched:
            return None
        return tokenizer.batch_decode([list(self.request(s).input_ids) for s in samples], skip_special_tokens=True)


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
