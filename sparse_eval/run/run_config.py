"""A run's config composed and checked before anything runs, and frozen: ``RunConfig``, built once from Hydra's
config by ``run_config`` at the launcher, is what the ``Experiment`` and everything below it take (never the raw
config).  Here too: the methods it asks for (``method_configs``: ``method`` or the ``compare`` list, each composed
from ``conf/method/`` by Hydra so its schema checks it, one per seed), a method against the model
(``check_method``) and ``eval.batch_size``."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any, Mapping

from ..attention.plugin import check_sparse_layers, layer_plan
from ..config import CONF_DIR, EvalConfig, LoggerConfig, PathsConfig, to_plain
from ..methods import Method, MethodConfig, build_method, compare_names
from ..methods.base import resolve_dense_layers
from ..identity.seeds import DETERMINISTIC_SEED, run_seeds
from ..methods import make_config
from ..models.loading import ModelConfig
from ..verdicts.claims import claims_record

log = logging.getLogger("sparse_eval")


def method_options(name: str) -> dict[str, Any]:
    """The options of the method config ``conf/method/<name>.yaml``, composed by Hydra (so its schema checks
    them; used for the methods listed in ``compare``)."""
    return methods_options([name])[0]


def methods_options(names: list[str]) -> list[dict[str, Any]]:
    """``method_options`` of several names in one composition (each under its own key of ``method``: the same
    options, composed once instead of once per name, about 0.2 s each)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.errors import MissingConfigException

    from ..config import register_configs

    register_configs()
    overrides = [f"+method@method._m{i}={name}" for i, name in enumerate(names)]
    try:
        if GlobalHydra.instance().is_initialized():  # inside the Hydra app (or a test's initialize context)
            cfg = compose(config_name="config", overrides=overrides)
        else:
            with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
                cfg = compose(config_name="config", overrides=overrides)
    except MissingConfigException:
        valid = sorted(p.stem for p in (CONF_DIR / "method").glob("*.yaml"))
        name = next((n for n in names if not (CONF_DIR / "method" / f"{n}.yaml").is_file()), names[0])
        raise ValueError(f"no method config {name!r} (conf/method/{name}.yaml); valid: {valid}") from None
    return [to_plain(cfg.method[f"_m{i}"]) for i in range(len(names))]


def method_configs(cfg: Any) -> list[MethodConfig]:
    """The methods a run's config asks for, as config dataclasses, each built once to check its values before any
    work (a bad value fails at start, naming it): ``method``, or else every entry of ``compare`` (every registered
    method when it is null), one per seed of ``seed`` for a stochastic method, one for a deterministic one
    (``seeded_configs``)."""
    if cfg.method is not None:
        opts = [to_plain(cfg.method)]
    else:
        entries = [to_plain(e) for e in (cfg.compare if cfg.get("compare") is not None else compare_names())]
        names = [e if isinstance(e, str) else e["name"] for e in entries]
        opts = [
            o if isinstance(e, str) else o | {k: v for k, v in e.items() if k != "name"}
            for e, o in zip(entries, methods_options(names) if names else [])
        ]
    return [c for o in opts for c in seeded_configs(o, cfg.seed)]


def seeded_configs(options: Mapping[str, Any], seed: Any) -> list[Any]:
    """The method configs of one method's options for the run's ``seed``: one per seed for a stochastic method,
    one (seed ``DETERMINISTIC_SEED``) for a deterministic one.  Refuses ``method.seed`` (the run's seed is the
    top-level ``seed``).  Each config is built once here, so a bad value fails before anything runs."""
    seeds = run_seeds(seed)
    if options.get("seed") is not None:
        raise ValueError(
            f"method.seed={options['seed']!r}: a run's random draws come from the top-level seed; "
            f"drop method.seed and give seed={options['seed']!r} (or a list, e.g. seed=[0,1,2])"
        )
    base = make_config(options["name"], dict(options, seed=seeds[0]))
    method = build_method(base)
    if not method.stochastic:
        if seeds != [DETERMINISTIC_SEED]:
            log.info(
                "%s is deterministic: seed=%s reaches none of its draws; it runs once, filed under seed %d",
                base.name,
                seeds if len(seeds) > 1 else seeds[0],
                DETERMINISTIC_SEED,
            )
        return [dataclasses.replace(base, seed=DETERMINISTIC_SEED)]
    return [dataclasses.replace(base, seed=s) for s in seeds]


def check_method(
    method_cfg: MethodConfig, num_layers: int, context: int, sliding: dict[int, int] | list[int], model_name: str
) -> tuple[MethodConfig, Method]:
    """(the config with ``dense_layers`` resolved for a model of ``num_layers`` layers, the method built from it),
    checked against the model: its values against the depth and the context (``Method.validate``), and a sparse
    method left with no sparse layer by its dense layers or the sliding ones (``layer_plan``,
    ``check_sparse_layers``).  Shared by a run's start and the sweep's preflight."""
    resolved = dataclasses.replace(
        method_cfg, dense_layers=resolve_dense_layers(method_cfg.dense_layers, num_layers, sliding)
    )
    method = build_method(resolved)
    method.validate(num_layers=num_layers, context=context)
    dense, _ = layer_plan(method, num_layers, sliding)  # refuses one left no layer by sliding ones
    check_sparse_layers(method, num_layers, dense, model_name)  # and by its dense_layers
    return resolved, method


def check_batch_size(value: Any) -> int | str:
    if value == "auto":
        return "auto"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"eval.batch_size={value!r}: give an integer >= 1 or 'auto' (the largest batch that fits)")
    return value


@dataclass(frozen=True)
class RunConfig:
    """One run's config, typed, checked and frozen (``run_config``): what the ``Experiment`` takes."""

    model: ModelConfig
    task: dict[str, Any]  # the task's options (``conf/task/<name>``, composed and checked by its schema)
    methods: tuple[MethodConfig, ...]  # ``method_configs``: one per method and seed, each checked
    eval: EvalConfig
    paths: PathsConfig
    logger: LoggerConfig
    seed: Any  # ``seed``: an int, or a list of them (a stochastic method runs once per seed)
    protocol: str  # ``eval.protocol`` resolved: the task's default where it is null
    batch_size: int | str  # ``eval.batch_size`` checked: an int >= 1 or "auto"
    claims: tuple[dict[str, Any], ...]  # the claims declared for the run (``verdicts.claims``), checked


def _typed(node: Any, cls: type, key: str) -> Any:
    """The config node ``key`` as its schema's dataclass ``cls`` (a structured config's own object, or a plain
    mapping's fields); a field the schema lacks is refused, naming the valid ones."""
    from omegaconf import OmegaConf

    if isinstance(node, cls):
        return node
    if OmegaConf.is_config(node):
        obj = OmegaConf.to_object(node)
        if isinstance(obj, cls):
            return obj
        node = obj
    plain = dict(node or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(plain) - known)
    if unknown:
        raise ValueError(f"{key}.{unknown[0]}: no such {key} setting; valid: {sorted(known)}")
    return cls(**plain)


def run_config(cfg: Any) -> RunConfig:
    """Hydra's config of one run as a ``RunConfig``: every part typed and checked now (a bad value fails here,
    naming it, before a model loads), so nothing below the launcher reads the raw config."""
    from ..attention.plugin import PROTOCOLS
    from ..tasks import task_class

    task = to_plain(cfg.task)
    if not task:
        raise ValueError("no task given; e.g. task=wikitext")
    ev = _typed(cfg.eval, EvalConfig, "eval")
    protocol = ev.protocol or task_class(task["name"]).default_protocol
    if protocol not in PROTOCOLS:
        raise ValueError(f"eval.protocol={protocol!r}; valid: {list(PROTOCOLS)} (or null for the task's default)")
    if ev.prefill_chunk is not None and ev.prefill_chunk < 1:
        raise ValueError(f"eval.prefill_chunk={ev.prefill_chunk}: must be >= 1 or null")
    seed = to_plain(cfg.seed)
    return RunConfig(
        model=_typed(cfg.model, ModelConfig, "model"),
        task=task,
        methods=tuple(method_configs(cfg)),
        eval=ev,
        paths=_typed(cfg.paths, PathsConfig, "paths"),
        logger=_typed(cfg.logger, LoggerConfig, "logger"),
        seed=tuple(seed) if isinstance(seed, list) else seed,
        protocol=protocol,
        batch_size=check_batch_size(ev.batch_size),
        claims=tuple(claims_record(cfg)),
    )
