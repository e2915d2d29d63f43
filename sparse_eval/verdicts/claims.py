"""What an experiment claims, declared before its runs: the comparison, the test and its margin.

An experiment config (``conf/experiment/*.yaml``) lists its claims under ``claims:``; each is checked at start (a
wrong key or value refuses the run with one line, exit status 2: ``check_claims``) and recorded in every run's
``summary.json`` (``claims``), so the margin a verdict uses is the one the runs were made under.  For the records
made before this existed, the claims are declared afterwards in ``experiments/<folder>/claims.yaml``
(``ClaimsFile``), and every table made from them says so (post hoc).  ``python -m sparse_eval.verdicts`` tests
them (``sparse_eval.metrics.statistics.claim_verdict``).

A claim, e.g.::

    claims:
      - name: MagicPIG (10, 150) ≈ full
        test: equivalence          # equivalence | non_inferiority | superiority
        a: magicpig-K=10-L=150-*   # collect's method_config (shell pattern) of the configuration tested
        b: full                    # the reference's
        margin: 2                  # on the score's scale × score_factor (RULER: points of 0-100)
        where: {subtask: all}      # collect's rows: subtask ("all", a subtask, "full>=30"), length, task

``scale: relative`` tests A / B − 1 instead of A − B (perplexity: ``margin: 0.01`` is 1 %).  ``alpha`` is each
one-sided test's level (the (1 − 2α) interval decides).  A claim whose rows differ in model, task config or
length (a sweep over lengths) gets one verdict per such comparison.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from omegaconf import MISSING, DictConfig, ListConfig, OmegaConf

from ..metrics.statistics import ALPHA, N_BOOT, TESTS

SCALES = ("absolute", "relative")
WHERE_KEYS = ("task", "subtask", "length")  # collect's columns a claim may select rows by


@dataclass
class ClaimConfig:
    name: str = MISSING  # what is claimed, as tables show it, e.g. "MagicPIG (10, 150) ≈ full"
    test: str = "equivalence"  # equivalence | non_inferiority | superiority (sparse_eval.metrics.statistics)
    a: str = MISSING  # the configuration tested: a shell pattern of collect's method_config
    b: str = "full"  # the reference configuration: a pattern of method_config
    margin: Optional[float] = None  # > 0 for equivalence / non_inferiority, on the tested scale; none for superiority
    scale: str = "absolute"  # absolute: A − B; relative: A / B − 1 (margin 0.01 = 1 %)
    alpha: float = ALPHA  # each one-sided test's level: the (1 − 2α) interval decides
    score_factor: float = 1.0  # the score is multiplied by this first (lm-eval's fractions: 100, in points)
    where: dict[str, Any] = field(default_factory=dict)  # collect's rows: task, subtask, length
    note: Optional[str] = None  # a caveat printed with the verdict (e.g. a floor effect)
    summary: bool = True  # listed in experiments/README.md's summary table (false: the folder's README only)
    # true: this claim was declared after its runs, in a file whose other claims were declared before (``post_hoc``
    # of the file otherwise); tables mark it "(post hoc)"
    post_hoc: Optional[bool] = None


@dataclass
class DescriptiveConfig:
    """A measured ratio without a test, computed from an analysis table (``kind``)."""

    name: str = MISSING
    kind: str = "error_ratio_at_equal_cost2"  # the only kind: error_vs_budget.csv's curves compared at equal Cost2
    file: str = "error_vs_budget.csv"
    numerator: str = "topk"  # the method whose curve is interpolated (linearly in log Cost2)
    denominator: str = "oracle"  # the method at whose measured Cost2 points the ratio is taken
    layers: list[str] = field(default_factory=lambda: ["mean"])  # the first decides the direction
    min_cost2: Optional[float] = None  # only points from this Cost2 on (besides the whole range)
    paper: str = MISSING  # the paper's claim, e.g. "oracle sampling's error up to 4× below TopK's (ratio > 1)"
    paper_above_one: bool = True  # the paper's direction: the ratio above 1
    summary: bool = True


@dataclass
class ClaimsFile:
    """``experiments/<folder>/claims.yaml``: the claims tested on a folder's committed records."""

    item: str = MISSING  # the paper's table or figure, as the summary table names it
    model: str = MISSING  # model and context, e.g. "SmolLM2-135M, 8K"
    post_hoc: bool = MISSING  # true: declared after the runs (every table says so)
    declared: str = MISSING  # when and by whom the margins were declared, e.g. "2026-12-05, issue 49"
    records: Optional[str] = None  # the run archive (e.g. runs.tar.gz) or folder, relative to the folder
    root: Optional[str] = None  # the runs folder inside it (e.g. runs/b32); none: all of it
    order: int = 100  # the folder's place in the summary table
    n_boot: int = N_BOOT
    seed: int = 0
    defaults: dict[str, Any] = field(default_factory=dict)  # fields every claim below starts from
    claims: list[Any] = field(default_factory=list)  # ClaimConfig fields (over ``defaults``)
    descriptive: list[DescriptiveConfig] = field(default_factory=list)


def check_claim(c: ClaimConfig, where: str = "claims") -> None:
    """Refuse a claim whose values cannot be tested (ValueError, one line naming the field)."""
    label = f"{where} ({c.name})" if c.name else where
    if not str(c.name).strip():
        raise ValueError(f"{where}: a claim needs a name")
    if c.test not in TESTS:
        raise ValueError(f"{label}.test={c.test!r}; valid: {list(TESTS)}")
    for key in ("a", "b"):
        if not str(getattr(c, key)).strip():
            raise ValueError(f"{label}.{key} is empty; give a pattern of collect's method_config, e.g. 'full'")
    if c.test == "superiority":
        if c.margin is not None:
            raise ValueError(f"{label}: a superiority claim has no margin (margin={c.margin}); drop it")
    elif c.margin is None or not math.isfinite(c.margin) or c.margin <= 0:
        raise ValueError(f"{label}.margin={c.margin}: an {c.test} claim needs a finite margin > 0")
    if c.scale not in SCALES:
        raise ValueError(f"{label}.scale={c.scale!r}; valid: {list(SCALES)}")
    if c.scale == "relative" and c.margin is not None and c.margin >= 1:
        raise ValueError(f"{label}.margin={c.margin}: a relative margin is a fraction (0.01 = 1 %), below 1")
    if not 0 < c.alpha < 0.5:
        raise ValueError(f"{label}.alpha={c.alpha}: must be in (0, 0.5) (0.05: the 90 % interval decides)")
    if not (math.isfinite(c.score_factor) and c.score_factor > 0):
        raise ValueError(f"{label}.score_factor={c.score_factor}: must be > 0")
    bad = sorted(set(c.where) - set(WHERE_KEYS))
    if bad:
        raise ValueError(f"{label}.where has {bad}; valid keys: {list(WHERE_KEYS)}")


def as_claim(node: Any, defaults: Any = None, where: str = "claims") -> ClaimConfig:
    """A ClaimConfig from a mapping (over ``defaults``), its keys and types checked by the schema, its values by
    ``check_claim``."""
    base = OmegaConf.structured(ClaimConfig)
    try:
        merged = OmegaConf.merge(base, OmegaConf.create(_plain(defaults) or {}), OmegaConf.create(_plain(node)))
        claim = OmegaConf.to_object(merged)
    except Exception as exc:  # noqa: BLE001 - OmegaConf's key/type errors: one line naming the field
        raise ValueError(f"{where}: {str(exc).splitlines()[0]}") from exc
    check_claim(claim, where)
    return claim


def _plain(node: Any) -> Any:
    if isinstance(node, (DictConfig, ListConfig)):
        return OmegaConf.to_container(node, resolve=True)
    return node


def check_claims(cfg: Any) -> list[ClaimConfig]:
    """The claims of a run's config (``claims``), checked (ValueError on a bad one, two with one name); [] when
    there are none."""
    node = cfg.get("claims") if hasattr(cfg, "get") else None
    claims = [as_claim(c, where=f"claims[{i}]") for i, c in enumerate(_plain(node) or [])]
    names = [c.name for c in claims]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"claims: two claims named {dup[0]!r}; give each its own name")
    for c in claims:
        if c.post_hoc is not None:
            raise ValueError(
                f"claims ({c.name}).post_hoc={c.post_hoc}: an experiment's claims are declared before its runs; "
                "mark a claim post hoc in the experiments folder's claims.yaml"
            )
    return claims


def claims_record(cfg: Any) -> list[dict[str, Any]]:
    """The claims as plain data for a run's summary.json (``claims``)."""
    import dataclasses

    return [{k: v for k, v in dataclasses.asdict(c).items() if k != "post_hoc"} for c in check_claims(cfg)]


def load_claims_file(path: Any) -> tuple[ClaimsFile, list[ClaimConfig]]:
    """``claims.yaml`` read and checked: (the file's settings, its claims over ``defaults``)."""
    from pathlib import Path

    path = Path(path)
    try:
        raw = OmegaConf.load(path)
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(ClaimsFile), raw))
    except Exception as exc:  # noqa: BLE001 - a missing or wrong key: one line
        raise ValueError(f"{path}: {str(exc).splitlines()[0]}") from exc
    if spec.n_boot < 1000:
        raise ValueError(f"{path}: n_boot={spec.n_boot}; use at least 1000 (default {N_BOOT})")
    claims = [as_claim(c, spec.defaults, where=f"{path.name}: claims[{i}]") for i, c in enumerate(spec.claims)]
    names = [c.name for c in claims] + [d.name for d in spec.descriptive]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"{path}: two claims named {dup[0]!r}; give each its own name")
    for d in spec.descriptive:
        if d.kind != "error_ratio_at_equal_cost2":
            raise ValueError(f"{path}: descriptive {d.name!r}: kind={d.kind!r}; valid: ['error_ratio_at_equal_cost2']")
    return spec, claims
