"""Structured-config schemas (Hydra ConfigStore), so a wrong key or value fails at start.

``conf/`` mirrors the code: ``conf/model`` -> ``models.loading.ModelConfig``, ``conf/method/<name>`` -> the
method's config dataclass (registered here as ``<name>_schema``), ``conf/task/<name>`` -> the task's.  A registered
method with no ``conf/method/<name>.yaml`` (a user's plugin, ``sparse_eval.discovery``) is stored here under its
name with its dataclass's defaults, so ``method=<name>`` selects it all the same.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from .verdicts.claims import ClaimConfig
from .hydra_support import CONF_DIR, register_resolvers
from .models.loading import ModelConfig


@dataclass
class EvalConfig:
    protocol: str | None = None  # A | B | S; null: the task's default (S for perplexity, A for generation)
    compute_error: bool = True  # estimation error ‖ô − o‖/‖o‖ against dense attention, every sparse call
    prefill_chunk: int | None = None  # tokens per prefill forward (MagicPIG's RULER runs used 1024); null: one pass
    query_chunk: int = 512  # query rows per block in the sparse path (memory only; does not change results)
    # at every (re)start, run again the samples that ended in an error (finished samples are kept); false keeps
    # the errors as they are (the run then stays `incomplete`)
    rerun_failed: bool = True
    # fixed-order kernels (``sparse_eval.invariance``): a sample's record is bit for bit the same at any batch size,
    # with any companions and padding, on the CPU as on the GPU; false: stock kernels (faster; records then move in
    # the last bits, and greedy tokens and selections with them).  Part of the run's identity
    batch_invariant: bool = True
    # the sparse calls' attention over the selection and its statistics (kept keys, kept mass, est_error's dense
    # reference, top-k recall) from one batch-invariant Triton kernel (``kernels.selected_attention``) instead of the
    # torch ops of ``methods.core``: auto (on CUDA for a method that declares ``Method.fused_attention``; off on the
    # CPU, whose records stay bit for bit as before), on (refused where it cannot run), off.  It changes the last
    # bits of outputs and statistics, so where it is used the run's identity says so (``eval.fused_attention: true``).
    # Default off until the kernel's records are checked on a GPU against the unfused ones (issue 51: pytest -m gpu,
    # the greedy predictions of RULER-4K's 650 samples); built and tested in Triton's interpreter only
    fused_attention: str = "off"
    # samples per padded batch (a sample's record is the same in any batch with ``batch_invariant``, and then an int
    # is halved on out-of-memory too); ``auto``: the largest that fits, from min(samples, 128) halving on
    # out-of-memory (the size used is in the summary)
    batch_size: Any = 1
    # on the CPU, a run whose rough time estimate (``sparse_eval.run.estimate``) exceeds an hour is refused unless this
    # is true (it then only warns)
    allow_long: bool = False


@dataclass
class PathsConfig:
    data_dir: str | None = None  # folder with wikitext-2-raw/, paul-graham-essays/, ... (tests: ../shared/data)
    runs_dir: str = "runs"  # each run writes runs_dir/<task>/<model>/<method>-<hash>/
    models_dir: str = "~/.cache/sparse_eval/models"  # where conf/model files look for downloaded checkpoints


@dataclass
class LoggerConfig:
    name: str = "none"  # none | wandb
    mode: str = "offline"  # wandb mode when name=wandb: offline (no network) | online | disabled
    project: str = "sparse_eval"


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = None  # one method (``method=NAME``); null: run every method in ``compare``
    task: Any = None
    # methods run when ``method`` is null: config names from conf/method/ or {name: ..., option: value} mappings;
    # null: every registered method with its own config (``methods.compare_names``: full attention first)
    compare: list[Any] | None = None
    eval: EvalConfig = field(default_factory=EvalConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    # the one seed of a run's random draws (``identity.seeds``): the method's (MagicPIG's projections, oracle
    # sampling's draws, DS's random channels), not the task's prompts (``task.seed``).  A list (e.g. [0, 1, 2])
    # runs each stochastic method once per seed; a deterministic method runs once (filed under seed 0)
    seed: Any = 0
    print_table: bool = True
    # multirun (-m): check every job's config, model and data before launching any (``sparse_eval.launcher.preflight``);
    # false launches without the check
    preflight: bool = True
    # what the experiment claims, declared before its runs (``verdicts.claims``): each a comparison, its test
    # (equivalence, non-inferiority, superiority) and margin; checked at start, recorded in every run's
    # summary.json, tested by ``python -m sparse_eval.verdicts``
    claims: list[ClaimConfig] = field(default_factory=list)


def register_configs(methods: bool = True) -> None:
    """The schemas in Hydra's ConfigStore.  ``methods=False`` leaves out the methods' (their modules import torch):
    enough to compose a config that names no method (``--help``)."""
    from .tasks import TASKS

    register_resolvers()
    if not OmegaConf.has_resolver("sparse_eval_help"):  # ``--help``'s text (conf/config.yaml: hydra.help.template)
        from .cli.help_text import app_help

        OmegaConf.register_new_resolver("sparse_eval_help", app_help)
    cs = ConfigStore.instance()
    cs.store(name="config_schema", node=Config)
    cs.store(group="model", name="model_schema", node=ModelConfig)
    cs.store(group="logger", name="logger_schema", node=LoggerConfig)
    if methods:
        from .methods import METHODS

        for name, cls in METHODS.items():
            cs.store(group="method", name=f"{name}_schema", node=cls.config_class)
            if not (CONF_DIR / "method" / f"{name}.yaml").is_file():  # a plugin's method: its defaults as its config
                cs.store(group="method", name=name, node=cls.config_class(name=name))
    for name, cls in TASKS.items():
        cs.store(group="task", name=f"{name}_schema", node=cls.config_class)


def to_plain(node: Any) -> Any:
    if isinstance(node, DictConfig):
        return OmegaConf.to_container(node, resolve=True)
    if dataclasses.is_dataclass(node):
        return dataclasses.asdict(node)
    return node
