"""The one seed of a run: what it feeds, which methods it runs several times, and which runs differ only in it.

**One knob.**  The top-level ``seed`` of a run (``python -m sparse_eval ... seed=1``) is the only seed a run's
random draws come from.  The runner copies it into the method's config (``MethodConfig.seed``) before the method
is built; giving ``method.seed`` in a run is refused, so the two cannot disagree.  It feeds:

* the method's own draws: MagicPIG's SimHash projections (per layer group), oracle sampling's draws (counter-based
  uniforms of (seed, layer, sample id, head, query position, draw)), Double Sparsity's channels under
  ``channel_type=random`` (per layer and KV head);
* torch's global generator (``torch.manual_seed``), which no shipped method or task draws from.

It does **not** feed the benchmark's prompts.  The samples a task builds (RULER's generated haystacks and needles,
key-value retrieval's generated pairs and gold positions, lm-eval's few-shot examples) are the benchmark: they are
fixed by the task's own ``task.seed`` (RULER's ``--random_seed`` 42, key-value retrieval 0, lm-eval 0), a field of
the task config, so every method and every method seed is scored on the same prompts and comparisons between them
stay paired.  Nor does it feed the bootstrap intervals (``sparse_eval.metrics.statistics``: a fixed generator, so an
interval is a function of the records alone).  Decoding is greedy; no task samples while it evaluates.

**Which methods it runs several times.**  ``seed`` is an int or a list of ints.  A *stochastic* method (one whose
``Method.stochastic`` is true: MagicPIG, oracle sampling, Double Sparsity with random channels) runs once per
seed, each a run of its own.  A deterministic method's records do not depend on the seed: it runs once, filed
under seed 0 (``DETERMINISTIC_SEED``) whatever ``seed`` says, so a sweep over seeds never recomputes it and its
run keeps one directory.  The run's configs per seed are built by ``run.run_config.seeded_configs``; whether a
recorded method is stochastic, ``method_facts.is_stochastic``.

**Which runs differ only in their seed.**  ``seed_group(identity)``: the hash of a run's identity without its
seed, so ``collect`` pools exactly the runs that agree in everything else (model as loaded, method config,
method inputs, task config, data files, evaluation settings).
"""

from __future__ import annotations

from typing import Any, Mapping

from .fingerprint import config_hash

DETERMINISTIC_SEED = 0


def run_seeds(value: Any) -> list[int]:
    """The seeds of ``seed`` (an int >= 0 or a non-empty list of distinct ones), as a list."""
    vals = list(value) if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig" else [value]
    bad = [v for v in vals if isinstance(v, bool) or not isinstance(v, int) or v < 0]
    if not vals or bad or len(set(vals)) != len(vals):
        raise ValueError(
            f"seed={value!r}: give an integer >= 0 or a list of distinct ones, e.g. seed=1 or "
            "seed=[0,1,2] (a stochastic method runs once per seed, a deterministic one once)"
        )
    return [int(v) for v in vals]


def effective_seed(identity: Mapping[str, Any]) -> Any:
    """The seed a recorded run's method drew from: ``method.seed`` (equal to the top-level seed in runs made since
    the two were joined; in older runs the one the draws used), else the top-level ``seed``."""
    method = identity.get("method") or {}
    return method.get("seed") if method.get("seed") is not None else identity.get("seed")


def seedless(identity: Mapping[str, Any]) -> dict[str, Any]:
    """A run's identity without its seed (top-level and the method's)."""
    out = {k: v for k, v in identity.items() if k != "seed"}
    if isinstance(out.get("method"), Mapping):
        out["method"] = {k: v for k, v in out["method"].items() if k != "seed"}
    return out


def seed_group(identity: Mapping[str, Any]) -> str:
    """The hash of ``seedless(identity)``: runs with one value differ at most in their seed."""
    return config_hash(seedless(identity))
