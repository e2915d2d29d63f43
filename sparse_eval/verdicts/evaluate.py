"""Verdicts of declared claims, recomputed from the records: equivalent / non-inferior / better / worse / inferior /
undecided, each with its margin, interval and Monte Carlo error.

    python -m sparse_eval.verdicts experiments/ruler_smollm2_8k            # print its verdicts
    python -m sparse_eval.verdicts experiments/ruler_smollm2_8k --write    # + verdicts.json and the README section
    python -m sparse_eval.verdicts --all --write                           # every experiments/*/claims.yaml + summary
    python -m sparse_eval.verdicts --all --check                           # exit 1 where a written section is stale
    python -m sparse_eval.verdicts runs/ruler                              # a runs folder: the claims its runs declared

A folder of ``experiments/`` declares its claims in ``claims.yaml`` (``sparse_eval.verdicts.claims.ClaimsFile``; for the
records made before claims could be declared with the experiment, after the runs: post hoc, and every table says
so).  Its records (``records``: the run archive, ``root``: the runs folder inside it) are unpacked into a temporary
folder and read as ``collect`` reads them; each claim selects its two configurations by collect's
``method_config`` and ``where`` (subtask, length, task), pools each over its complete seeds and tests the paired
difference with ``sparse_eval.metrics.statistics`` (``seed_pooled_draws``, ``tost_interval``, ``claim_verdict``).  A
``descriptive`` entry computes a ratio from an analysis table without a test (MagicPIG's error against the budget).

``--write`` writes ``verdicts.json`` (the numbers, rounded, and the sha256 of the claims file and of each record
file they came from) and the folder README's section between ``<!-- verdicts:begin -->`` and
``<!-- verdicts:end -->``; with ``--all``, also ``experiments/README.md``'s summary table between
``<!-- verdicts-summary:begin -->`` and ``<!-- verdicts-summary:end -->`` (made from the folders' verdicts.json;
``--summary-only`` rewrites just that).  Text outside the markers is left as it is.  ``tests/verdicts/test_verdicts.py``
checks that the committed sections are what this writes.

A runs folder (``paths.runs_dir``) holds no claims.yaml: the claims are those its runs recorded in summary.json
(declared in the experiment config before the runs, ``conf/experiment/*.yaml``'s ``claims:``); the verdicts are
printed.

Exit status: 0; 1 ``--check`` found a stale section or verdicts.json; 2 bad input (no claims, a claim that selects
no run or several configurations).
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import hashlib
import json
import math
import sys
import tarfile
import tempfile
import textwrap
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .claims import ClaimConfig, ClaimsFile, DescriptiveConfig, as_claim, load_claims_file
from ..metrics.statistics import N_BOOT, _interval, claim_verdict, seed_pooled_draws, tost_interval

CLAIMS_FILE = "claims.yaml"
VERDICTS_FILE = "verdicts.json"
BEGIN, END = "<!-- verdicts:begin -->", "<!-- verdicts:end -->"
SUMMARY_BEGIN, SUMMARY_END = "<!-- verdicts-summary:begin -->", "<!-- verdicts-summary:end -->"
EXPERIMENTS = Path(__file__).resolve().parents[2] / "experiments"
# folders whose records are withdrawn (Gemma-3-270M run with a mis-tokenized model): never in a generated table
WITHDRAWN = (
    "ruler_gemma3_16k",
    "magicpig_kl_gemma3_16k",
    "magicpig_heavy_keys",
    "geometry_gemma3_16k_passages",
    "error_vs_budget_gemma3_16k_passages",
    "gemma3_ruler_16k",
)
VERSION = 2  # of the computation and of verdicts.json's layout: a change that moves a number bumps it
COMPARISON_KEYS = ("model", "task", "subtask", "length")  # shown where a claim's comparisons differ
MINUS = "\u2212"


class ClaimError(ValueError):
    """A claim that selects no run, or several configurations, or runs that cannot be paired."""


# -- records ------------------------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@contextlib.contextmanager
def records_root(folder: Path, spec: ClaimsFile) -> Iterator[Path]:
    """The runs folder the claims are tested on: ``records`` (an archive, unpacked into a temporary folder, only
    ``root`` of it; or a folder) under ``folder``, then ``root`` inside it."""
    src = folder / str(spec.records)
    if not src.exists():
        raise ClaimError(f"{folder / CLAIMS_FILE}: records {spec.records!r} not found in {folder}")
    if src.is_dir():
        yield src / spec.root if spec.root else src
        return
    root = str(spec.root or "").strip("/")
    with tempfile.TemporaryDirectory(prefix="verdicts-") as tmp, tarfile.open(src) as tar:
        members = [m for m in tar.getmembers() if not root or _norm(m.name).startswith(root + "/")]
        if not members:
            raise ClaimError(f"{src}: no member under {root!r}")
        extract(tar, tmp, members)
        yield Path(tmp) / root if root else Path(tmp)


def extract(tar: tarfile.TarFile, dest: Any, members: list[tarfile.TarInfo] | None = None) -> None:
    """Unpack ``members`` (all when None) of a run archive under ``dest``, with tarfile's "data" filter where this
    Python has it (3.10.12+: no links out of ``dest``, no device files)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, members=members, filter="data")
    else:  # pragma: no cover - an older Python: the archives are this repository's own
        tar.extractall(dest, members=members)


def _norm(name: str) -> str:
    return name[2:] if name.startswith("./") else name


def gather_rows(root: Path, subsets: set[float]) -> list[dict[str, Any]]:
    """collect's rows of every run under ``root`` (per subtask, "all", and ``full>=X`` for each X in ``subsets``),
    each with its private ``_terms`` (the per-sample score terms)."""
    from ..results.collect import add_subset_rows, run_rows
    from ..results.store import find_run_dirs

    rows: list[dict[str, Any]] = []
    for d in find_run_dirs(root):
        rows.extend(run_rows(d, by_subtask=True))
    for x in sorted(subsets):
        add_subset_rows(rows, x)
    for r in rows:
        r.pop("_subset", None)
    return [r for r in rows if r.get("_terms") is not None and r.get("state") != "unreadable"]


def _subset_levels(claims: list[ClaimConfig]) -> set[float]:
    from ..results.collect import SUBSET_PREFIX, is_subset_label

    out = set()
    for c in claims:
        sub = c.where.get("subtask")
        if is_subset_label(sub):
            out.add(float(str(sub)[len(SUBSET_PREFIX) :]))
    return out


# -- one claim ----------------------------------------------------------------------------------------------


def _matches(row: dict[str, Any], pattern: str, where: dict[str, Any]) -> bool:
    if not fnmatch.fnmatchcase(str(row.get("method_config")), pattern):
        return False
    return all(_same(row.get(k), v) for k, v in where.items())


def _same(value: Any, wanted: Any) -> bool:
    if isinstance(wanted, (int, float)) and not isinstance(wanted, bool):
        try:
            return float(value) == float(wanted)
        except (TypeError, ValueError):
            return False
    return str(value) == str(wanted)


def _pair_key(row: dict[str, Any]) -> tuple:
    from ..results.collect import PAIR_KEYS

    return tuple(str(row.get(k)) for k in ("task", *PAIR_KEYS))


def _side(rows: list[dict[str, Any]], what: str, claim: ClaimConfig) -> list[dict[str, Any]]:
    """The runs of one configuration a claim pools: one seed group, one run per seed (the one with the most
    samples), the complete ones when some are (as ``collect`` pools them), in seed order."""
    from ..results.collect import seed_order

    groups = sorted({str(r.get("seed_group")) for r in rows})
    if len(groups) != 1:
        names = sorted({str(r.get("method_config")) for r in rows})
        raise ClaimError(
            f"claim {claim.name!r}: {what} matches {len(groups)} configurations ({'; '.join(names)}); narrow the "
            "pattern or `where` to one configuration (its runs may differ only in their seed)"
        )
    by_seed: dict[str, dict[str, Any]] = {}
    for r in sorted(rows, key=lambda r: -(r.get("samples") or 0)):
        by_seed.setdefault(str(r.get("seed")), r)
    every = sorted(by_seed.values(), key=seed_order)
    done = [r for r in every if r.get("complete")]
    return done or every


def _higher_is_better(row: dict[str, Any]) -> bool:
    from ..results.collect import _task

    try:
        task = _task(json.loads(row.get("task_config") or "{}"))
    except (TypeError, ValueError):
        task = None
    return bool(getattr(task, "higher_is_better", True))


def evaluate_claim(claim: ClaimConfig, rows: list[dict[str, Any]], n_boot: int, seed: int) -> list[dict[str, Any]]:
    """The claim's results, one per comparison its A rows fall in (model, task config, evaluation, subtask,
    length: ``collect``'s pairing), in the rows' order of length and subtask."""
    a_rows = [r for r in rows if _matches(r, claim.a, claim.where)]
    if not a_rows:
        raise ClaimError(
            f"claim {claim.name!r}: a={claim.a!r} with where={dict(claim.where)} matches no row; the method_config "
            f"values here: {sorted({str(r.get('method_config')) for r in rows})}"
        )
    by_key: dict[tuple, list[dict[str, Any]]] = {}
    for r in a_rows:
        by_key.setdefault(_pair_key(r), []).append(r)
    out = []
    for key, a_group in sorted(by_key.items(), key=lambda kv: (str(kv[1][0].get("length")), kv[0])):
        b_group = [r for r in rows if _pair_key(r) == key and _matches(r, claim.b, claim.where)]
        if not b_group:
            raise ClaimError(
                f"claim {claim.name!r}: b={claim.b!r} matches no run paired with {claim.a!r} (same model, task "
                f"config, evaluation, subtask {a_group[0].get('subtask')!r}, length {a_group[0].get('length')!r})"
            )
        out.append(_test(claim, _side(a_group, "a", claim), _side(b_group, "b", claim), n_boot, seed))
    return out


def _test(claim: ClaimConfig, a: list[dict], b: list[dict], n_boot: int, seed: int) -> dict[str, Any]:
    if a[0].get("seed_group") == b[0].get("seed_group"):
        raise ClaimError(f"claim {claim.name!r}: a and b select the same configuration")
    d = seed_pooled_draws([r["_terms"] for r in a], [r["_terms"] for r in b], n_boot=n_boot, seed=seed)
    res: dict[str, Any] = {
        "name": claim.name,
        "test": claim.test,
        "margin": claim.margin,
        "scale": claim.scale,
        "alpha": claim.alpha,
        "note": claim.note,
        "summary": claim.summary,
        "post_hoc": claim.post_hoc,
        "comparison": {k: _plain(a[0].get(k)) for k in COMPARISON_KEYS},
        "a": {"method_config": a[0].get("method_config"), "seeds": [_plain(r.get("seed")) for r in a]},
        "b": {"method_config": b[0].get("method_config"), "seeds": [_plain(r.get("seed")) for r in b]},
        "complete": all(r.get("complete") for r in a + b),
        "n": len(d["ids"]),
        "n_boot": n_boot,
        "seed": seed,
        "higher_is_better": _higher_is_better(a[0]),
    }
    if not d["ids"]:
        return dict(res, verdict="undecided", why="no sample both configurations finished")
    ref = b[0]["_terms"].subset(d["ids"])
    if ref.transform == "exp":  # perplexity: the denominators are the tokens scored (a window's predictions)
        res["tokens"] = int(ref.den.sum())
    f = claim.score_factor
    if claim.scale == "absolute":
        draws = f * (d["theta_a"] - d["theta_b"])
        point = f * (d["score_a"] - d["score_b"])
    else:
        draws = d["theta_a"] / d["theta_b"] - 1.0
        point = d["score_a"] / d["score_b"] - 1.0
    ti = tost_interval(draws, claim.alpha)
    lo95, hi95 = _interval(np.asarray(draws, dtype=np.float64), 0.95)
    if res["higher_is_better"]:
        oriented, errors = (ti["lo"], ti["hi"]), (ti["lo_mc"], ti["hi_mc"])
    else:  # lower is better (perplexity): d > 0 must mean A is better
        oriented, errors = (-ti["hi"], -ti["lo"]), (ti["hi_mc"], ti["lo_mc"])
    verdict = claim_verdict(*oriented, test=claim.test, margin=claim.margin, mc_error=errors)
    if not res["complete"]:
        verdict, res["why"] = "undecided", "a run is incomplete"
    return dict(
        res,
        score_a=_round(f * d["score_a"]),
        score_b=_round(f * d["score_b"]),
        diff=_round(point),
        lo=_round(ti["lo"]),
        hi=_round(ti["hi"]),
        lo_mc=_round(ti["lo_mc"]),
        hi_mc=_round(ti["hi_mc"]),
        level=ti["level"],
        ci95=[_round(lo95), _round(hi95)],
        verdict=verdict,
    )


def _plain(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    if hasattr(v, "item"):
        v = v.item()
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return v


def _round(x: Any, digits: int = 6) -> Any:
    """A number as verdicts.json keeps it: 6 significant digits (the last bits of a sum vary with the BLAS)."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{float(x):.{digits}g}")


# -- descriptive ratios (an analysis table, no test) --------------------------------------------------------


def ratio_at_equal_cost2(table: Any, layer: str, numerator: str, denominator: str, min_cost2: float | None = None):
    """[(cost2, ratio)]: at each measured Cost2 of ``denominator``'s points in ``layer`` of an error_vs_budget
    table, ``numerator``'s error interpolated linearly in log Cost2 over its own points, divided by
    ``denominator``'s error there; only where the numerator's points bracket that Cost2 (no extrapolation) and,
    with ``min_cost2``, from that Cost2 on."""
    d = table[table["layer"].astype(str) == str(layer)]
    num = d[d["method"] == numerator].sort_values("cost2")
    den = d[d["method"] == denominator].sort_values("cost2")
    num = num[num["cost2"] > 0]
    x, y = np.log(num["cost2"].to_numpy(dtype=float)), num["error"].to_numpy(dtype=float)
    out = []
    for c, e in zip(den["cost2"].to_numpy(dtype=float), den["error"].to_numpy(dtype=float)):
        if not (len(x) and x[0] <= math.log(c) <= x[-1]) or e <= 0 or (min_cost2 is not None and c < min_cost2):
            continue
        out.append((float(c), float(np.interp(math.log(c), x, y) / e)))
    return out


def _range(points: list[tuple[float, float]]) -> dict[str, Any]:
    return {
        "points": len(points),
        "min": _round(min(r for _, r in points), 4),
        "max": _round(max(r for _, r in points), 4),
    }


def evaluate_descriptive(desc: DescriptiveConfig, folder: Path) -> dict[str, Any]:
    import pandas as pd

    table = pd.read_csv(folder / desc.file)
    layers = {}
    for layer in desc.layers:
        whole = ratio_at_equal_cost2(table, layer, desc.numerator, desc.denominator)
        part = ratio_at_equal_cost2(table, layer, desc.numerator, desc.denominator, desc.min_cost2)
        if not whole or (desc.min_cost2 is not None and not part):
            raise ClaimError(
                f"{folder / desc.file}: no {desc.denominator} point of layer {layer} inside the {desc.numerator} "
                "curve's Cost2 range (from min_cost2 on)"
            )
        layers[str(layer)] = {
            **_range(whole),
            "from_min_cost2": None if desc.min_cost2 is None else _range(part),
        }
    first = layers[str(desc.layers[0])]
    decide = first["from_min_cost2"] or first
    above = decide["min"] > 1
    below = decide["max"] < 1
    if above or below:
        direction = "in the paper's direction" if above == desc.paper_above_one else "against the paper's direction"
    else:
        direction = "mixed"
    passages = int(table["passages"].max()) if "passages" in table else 1
    return {
        "name": desc.name,
        "kind": desc.kind,
        "file": desc.file,
        "numerator": desc.numerator,
        "denominator": desc.denominator,
        "min_cost2": desc.min_cost2,
        "paper": desc.paper,
        "summary": desc.summary,
        "passages": passages,
        "layers": layers,
        "verdict": direction,
    }


# -- a folder -----------------------------------------------------------------------------------------------


def compute_folder(folder: Path) -> dict[str, Any]:
    """verdicts.json's content for an experiments folder: its claims.yaml tested on its records."""
    folder = Path(folder)
    spec, claims = load_claims_file(folder / CLAIMS_FILE)
    inputs = {CLAIMS_FILE: sha256_file(folder / CLAIMS_FILE)}
    results: list[dict[str, Any]] = []
    if claims:
        if not spec.records:
            raise ClaimError(f"{folder / CLAIMS_FILE}: claims but no `records` to test them on")
        inputs[str(spec.records)] = sha256_file(folder / spec.records) if (folder / spec.records).is_file() else None
        with records_root(folder, spec) as root:
            rows = gather_rows(root, _subset_levels(claims))
            for c in claims:
                results.extend(evaluate_claim(c, rows, spec.n_boot, spec.seed))
    descriptive = []
    for d in spec.descriptive:
        inputs[d.file] = sha256_file(folder / d.file)
        descriptive.append(evaluate_descriptive(d, folder))
    return {
        "version": VERSION,
        "folder": folder.name,
        "item": spec.item,
        "model": spec.model,
        "post_hoc": spec.post_hoc,
        "declared": spec.declared,
        "order": spec.order,
        "records": spec.records,
        "root": spec.root,
        "n_boot": spec.n_boot,
        "seed": spec.seed,
        "inputs": inputs,
        "claims": results,
        "descriptive": descriptive,
    }


def inputs_now(folder: Path, data: dict[str, Any]) -> dict[str, Any]:
    """The sha256 of the files a verdicts.json names as its inputs, as they are now (None: gone)."""
    return {name: sha256_file(folder / name) if (folder / name).is_file() else None for name in data["inputs"]}


# -- text ---------------------------------------------------------------------------------------------------


def _num(x: float | None, scale: str = "absolute", sign: bool = True) -> str:
    if x is None:
        return "–"
    if scale == "relative":
        s = f"{100 * x:+.2f} %" if sign else f"{100 * x:.2f} %"
    else:
        s = f"{x:+.2f}" if sign else f"{x:.2f}"
    return s.replace("-", MINUS)


def _score(x: float | None) -> str:
    if x is None:
        return "–"
    return (f"{x:.2f}" if abs(x) < 1000 else f"{x:.0f}").replace("-", MINUS)


def test_text(r: dict[str, Any], post_hoc: bool) -> str:
    """The test and its margin, "(post hoc)" where the margin was declared after the runs (the claim's own
    ``post_hoc`` when it has one, else its file's)."""
    if r.get("post_hoc") is not None:
        post_hoc = r["post_hoc"]
    m = r.get("margin")
    unit = (lambda v: f"{100 * v:g} %") if r["scale"] == "relative" else (lambda v: f"{v:g}")
    if r["test"] == "equivalence":
        text = f"equivalence ±{unit(m)}"
    elif r["test"] == "non_inferiority":
        text = f"non-inferiority {MINUS}{unit(m)}"
    else:
        text = "superiority"
    return text + (" (post hoc)" if post_hoc and m is not None else "")


test_text.__test__ = False  # a function of the package, not a pytest test


def _n_text(r: dict[str, Any]) -> str:
    a, b = len(r["a"]["seeds"]), len(r["b"]["seeds"])
    n = f"{r['n']:,}"
    if r.get("tokens"):
        n += f" ({r['tokens']:,} tokens)"
    if a == 1 and b == 1:
        return n
    return f"{n} × {a} / {b} seeds"


def _where_text(r: dict[str, Any]) -> str:
    c = r["comparison"]
    parts = []
    if c.get("subtask") not in (None, "all"):
        parts.append(str(c["subtask"]))
    if c.get("length") is not None:
        parts.append(f"{int(c['length']):,} tokens")
    return ", ".join(parts) or "all"


def _interval_text(r: dict[str, Any]) -> str:
    return f"[{_num(r.get('lo'), r['scale'])}, {_num(r.get('hi'), r['scale'])}]"


def _mc_text(r: dict[str, Any]) -> str:
    """The end points' Monte Carlo errors, three decimals (relative differences in %)."""
    if r.get("lo_mc") is None:
        return "–"
    k, unit = (100.0, " %") if r["scale"] == "relative" else (1.0, "")
    return f"±{k * r['lo_mc']:.3f}{unit}, ±{k * r['hi_mc']:.3f}{unit}"


def _verdict_text(r: dict[str, Any]) -> str:
    v = f"**{r['verdict']}**"
    return v + (f" ({r['why']})" if r.get("why") else "")


def _ratio_text(d: dict[str, Any]) -> str:
    """Per layer, the range of the ratio (from ``min_cost2`` on, when given, with the whole range after it)."""
    parts = []
    for layer, v in d["layers"].items():
        name = "mean of layers" if layer == "mean" else f"layer {layer}"
        text = f"{name} {v['min']:.2f}–{v['max']:.2f}"
        part = v.get("from_min_cost2")
        if part:
            text = (
                f"{name} {part['min']:.2f}–{part['max']:.2f} from Cost2 {d['min_cost2']:g} on "
                f"({v['min']:.2f}–{v['max']:.2f} over all {v['points']} points)"
            )
        parts.append(text)
    return "; ".join(parts)


def folder_section(data: dict[str, Any]) -> str:
    """The folder README's generated section (between the markers, markers excluded)."""
    when = (
        f"**declared after the runs (post hoc)**, {data['declared']}"
        if data["post_hoc"]
        else f"declared before the runs, {data['declared']}"
    )
    if not data["post_hoc"] and any(r.get("post_hoc") for r in data["claims"]):
        when += "; those marked (post hoc) were declared after their runs"
    command = f"`python -m sparse_eval.verdicts experiments/{data['folder']} --write`"
    if data["claims"]:
        intro = [
            f"**Verdicts** (generated from the records by {command}; claims and margins in `claims.yaml`, {when})."
        ]
    else:  # a ratio of an analysis table: no test, no margin
        intro = [
            f"**What the measurement says about the paper's claim** (generated by {command} from the table named "
            f"below; what is compared is declared in `claims.yaml`, {data['declared']})."
        ]
    if data["claims"]:
        alpha = sorted({r["alpha"] for r in data["claims"]})
        levels = ", ".join(f"{100 * (1 - 2 * a):g} %" for a in alpha)
        intro[0] += (
            f" Each claim tests the paired difference A − B over the prompts both finished (a configuration run "
            f"over several seeds is pooled over them: two-level bootstrap), {data['n_boot']:,} bootstrap "
            f"replicates (seed {data['seed']}): its {levels} interval (α = {', '.join(f'{a:g}' for a in alpha)} "
            "per side) with each end point's Monte Carlo error. Verdict "
            "(`sparse_eval.metrics.statistics.claim_verdict`): "
            "equivalent when the interval lies inside ±margin, better / worse when it lies wholly above / below 0, "
            "otherwise undecided; undecided also when an end point that decides lies within its Monte Carlo error "
            "of 0 or of the margin. Better / worse are one-sided tests at α each: a difference whose 95 % interval "
            "reaches 0 can be better or worse here."
        )
        if any(r["scale"] == "relative" for r in data["claims"]):
            intro[0] += (
                " Relative differences (perplexity) are A / B − 1, and lower perplexity is better, so a positive "
                "difference is worse."
            )
    lines = [_wrap(intro[0])]
    if data["claims"]:
        lines += [
            "",
            "| claim | rows | test, margin | n (× seeds A / B) | A | B | A − B | 90 % CI | MC error (lo, hi) "
            "| 95 % CI | verdict |",
            "|---|---|---|---:|---:|---:|---:|---|---|---|---|",
        ]
        for r in data["claims"]:
            note = f" ({r['note']})" if r.get("note") else ""
            ci95 = r.get("ci95") or [None, None]
            lines.append(
                f"| {r['name']}{note} | {_where_text(r)} | {test_text(r, data['post_hoc'])} | {_n_text(r)} | "
                f"{_score(r.get('score_a'))} | {_score(r.get('score_b'))} | {_num(r.get('diff'), r['scale'])} | "
                f"{_interval_text(r)} | {_mc_text(r)} | [{_num(ci95[0], r['scale'])}, {_num(ci95[1], r['scale'])}] "
                f"| {_verdict_text(r)} |"
            )
    for d in data["descriptive"]:
        lines += [
            "",
            _wrap(
                f"*{d['name']}* (descriptive, no test: from `{d['file']}`, {d['passages']} passage"
                f"{'s' if d['passages'] != 1 else ''}; {_name(d['numerator'])}'s error interpolated linearly in log "
                f"Cost2 at each measured Cost2 of {_name(d['denominator'])}, divided by {_name(d['denominator'])}'s "
                "error there): "
                f"{_ratio_text(d)}. The paper: {d['paper']}; here **{d['verdict']}**."
            ),
        ]
    return "\n".join(lines)


METHOD_NAMES = {"topk": "TopK", "oracle": "oracle sampling", "magicpig": "MagicPIG"}  # error_vs_budget.csv's


def _name(method: str) -> str:
    return METHOD_NAMES.get(method, method)


def _wrap(text: str) -> str:
    """A paragraph wrapped as the READMEs are (116 columns)."""
    return textwrap.fill(text, width=116, break_long_words=False, break_on_hyphens=False)


def summary_section(folders: list[dict[str, Any]]) -> str:
    """experiments/README.md's generated summary table (markers excluded): every summary claim of every folder."""
    intro = (
        "Generated by `python -m sparse_eval.verdicts --all --write` from each folder's `claims.yaml` and records "
        "(numbers in its `verdicts.json`; the folder's README has every claim with its 95 % interval). **Margins "
        "marked post hoc were declared after the runs.** A − B: the paired difference over the prompts both "
        "finished (× seeds: pooled over a stochastic configuration's seeds, two-level bootstrap), its 90 % "
        "interval (TOST at α = 0.05) and each end point's Monte Carlo error; verdict by "
        "`sparse_eval.metrics.statistics.claim_verdict` (equivalent: the interval inside ±margin; better / worse: "
        "wholly "
        "above / below 0; undecided otherwise, or when a deciding end point is within its Monte Carlo error of 0 "
        "or the margin; better / worse are one-sided tests at 5 % each, so a difference whose 95 % interval "
        "reaches 0 can be better or worse here). Perplexity: relative difference, lower is better."
    )
    lines = [
        _wrap(intro),
        "",
        "| paper item | folder | model, context | claim | rows | test, margin | n (× seeds A / B) | A − B [90 % CI] "
        "| MC error (lo, hi) | verdict |",
        "|---|---|---|---|---|---|---:|---|---|---|",
    ]
    for data in sorted(folders, key=lambda d: (d["order"], d["folder"])):
        if data["folder"] in WITHDRAWN:
            continue
        first = True
        for r in data["claims"]:
            if not r.get("summary", True):
                continue
            head = f"{data['item']} | `{data['folder']}/` | {data['model']}" if first else " | | "
            first = False
            note = f" ({r['note']})" if r.get("note") else ""
            lines.append(
                f"| {head} | {r['name']}{note} | {_where_text(r)} | {test_text(r, data['post_hoc'])} | "
                f"{_n_text(r)} | {_num(r.get('diff'), r['scale'])} {_interval_text(r)} | {_mc_text(r)} | "
                f"{_verdict_text(r)} |"
            )
        for d in data["descriptive"]:
            if not d.get("summary", True):
                continue
            head = f"{data['item']} | `{data['folder']}/` | {data['model']}" if first else " | | "
            first = False
            lines.append(
                f"| {head} | {d['name']} (paper: {d['paper']}) | {d['passages']} passage"
                f"{'s' if d['passages'] != 1 else ''} | descriptive, no test | – | {_ratio_text(d)} | – | "
                f"**{d['verdict']}** |"
            )
    return "\n".join(lines)


def replace_section(text: str, begin: str, end: str, body: str, where: str) -> str:
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise ClaimError(f"{where}: needs one {begin} line followed by one {end} line")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def section_of(text: str, begin: str, end: str) -> str | None:
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def claim_folders(experiments: Path = EXPERIMENTS) -> list[Path]:
    return sorted(d for d in experiments.iterdir() if (d / CLAIMS_FILE).is_file() and d.name not in WITHDRAWN)


def read_verdicts(folder: Path) -> dict[str, Any] | None:
    p = Path(folder) / VERDICTS_FILE
    return json.loads(p.read_text(encoding="utf-8")) if p.is_file() else None


def dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


# -- a runs folder (claims declared with the experiment, recorded in each run's summary.json) ----------------


def declared_claims(root: Path) -> list[ClaimConfig]:
    """The claims the runs under ``root`` recorded (summary.json ``claims``), each once."""
    from ..results.store import SUMMARY_FILE, find_run_dirs, read_json

    seen: dict[str, ClaimConfig] = {}
    for d in find_run_dirs(root):
        for c in (read_json(d / SUMMARY_FILE) or {}).get("claims") or []:
            claim = as_claim(c, where=f"{d}/summary.json")
            key = json.dumps(c, sort_keys=True, default=str)
            seen.setdefault(key, claim)
    return list(seen.values())


def print_results(results: list[dict[str, Any]], post_hoc: bool) -> None:
    for r in results:
        ci95 = r.get("ci95") or [None, None]
        print(
            f"{r['name']} [{_where_text(r)}] {test_text(r, post_hoc)}: n {_n_text(r)}, A − B "
            f"{_num(r.get('diff'), r['scale'])} {_interval_text(r)} ({100 * r.get('level', 0.9):g} %; MC error "
            f"{_mc_text(r)}; 95 % [{_num(ci95[0], r['scale'])}, {_num(ci95[1], r['scale'])}]) -> {r['verdict']}"
            + (f" ({r['why']})" if r.get("why") else "")
        )


# -- command line -------------------------------------------------------------------------------------------


def _write_folder(folder: Path, data: dict[str, Any]) -> list[Path]:
    written = []
    p = folder / VERDICTS_FILE
    if not p.is_file() or p.read_text(encoding="utf-8") != dump(data):
        p.write_text(dump(data), encoding="utf-8")
        written.append(p)
    readme = folder / "README.md"
    text = readme.read_text(encoding="utf-8")
    new = replace_section(text, BEGIN, END, folder_section(data), str(readme))
    if new != text:
        readme.write_text(new, encoding="utf-8")
        written.append(readme)
    return written


def _check_folder(folder: Path, data: dict[str, Any]) -> list[str]:
    stale = []
    old = read_verdicts(folder)
    if old is None or _comparable(old) != _comparable(data):
        stale.append(f"{folder / VERDICTS_FILE}: differs from the records' verdicts")
    text = (folder / "README.md").read_text(encoding="utf-8")
    if section_of(text, BEGIN, END) != folder_section(data):
        stale.append(f"{folder / 'README.md'}: its verdicts section is not what the records give")
    return stale


def _comparable(data: dict[str, Any]) -> str:
    """verdicts.json as the tables show it (numbers rounded as printed): what a check compares."""
    return json.dumps(
        {"section": folder_section(data), "inputs": data.get("inputs"), "version": data.get("version")},
        sort_keys=True,
    )


class _UsageError(Exception):
    """A folder the command cannot use (exit status 2, one line)."""


def _verdicts_of_folder(folder: Path, write: bool, check: bool, stale: list[str]) -> None:
    """Prints one folder's verdicts; writes them (``write``) or adds what is stale to ``stale`` (``check``)."""
    if not folder.is_dir():
        raise _UsageError(f"{folder} is not a folder")
    if folder.name in WITHDRAWN:
        print(f"skip {folder}: its records are withdrawn", file=sys.stderr)
        return
    if not (folder / CLAIMS_FILE).is_file():
        claims = declared_claims(folder)
        if not claims:
            raise _UsageError(f"{folder}: no {CLAIMS_FILE} and no run that recorded claims")
        rows = gather_rows(folder, _subset_levels(claims))
        results = [r for c in claims for r in evaluate_claim(c, rows, N_BOOT, 0)]
        print(f"== {folder} (claims declared with the experiment, before the runs)")
        print_results(results, post_hoc=False)
        return
    data = compute_folder(folder)
    print(f"== {folder}" + (" (claims declared after the runs: post hoc)" if data["post_hoc"] else ""))
    print_results(data["claims"], data["post_hoc"])
    for d in data["descriptive"]:
        print(f"{d['name']}: {_ratio_text(d)} -> {d['verdict']}")
    if write:
        for p in _write_folder(folder, data):
            print(f"wrote {p}")
    elif check:
        stale += _check_folder(folder, data)


def _summary_table(experiments: Path, check: bool, write: bool, stale: list[str]) -> None:
    """experiments/README.md's summary table from the folders' verdicts.json: checked or written."""
    folders = claim_folders(experiments)
    datas = [read_verdicts(f) for f in folders]
    missing = [str(f) for f, d in zip(folders, datas) if d is None]
    if missing:
        raise _UsageError(f"no {VERDICTS_FILE} in {', '.join(missing)}: run with --write first")
    readme = experiments / "README.md"
    text = readme.read_text(encoding="utf-8")
    body = summary_section([d for d in datas if d is not None])
    if check:
        if section_of(text, SUMMARY_BEGIN, SUMMARY_END) != body:
            stale.append(f"{readme}: its summary table is not what the folders' verdicts give")
    elif write:
        new = replace_section(text, SUMMARY_BEGIN, SUMMARY_END, body, str(readme))
        if new != text:
            readme.write_text(new, encoding="utf-8")
            print(f"wrote {readme}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_eval.verdicts", description=__doc__.split("\n\n")[0])
    ap.add_argument("folders", nargs="*", help="experiments folders with a claims.yaml, or a runs folder")
    ap.add_argument("--all", action="store_true", help="every experiments/*/claims.yaml, and the summary table")
    ap.add_argument("--write", action="store_true", help="write verdicts.json and the README sections")
    ap.add_argument("--check", action="store_true", help="exit 1 where a written section or verdicts.json is stale")
    ap.add_argument(
        "--summary-only",
        action="store_true",
        help="only experiments/README.md's summary table, from the folders' verdicts.json (no recomputation)",
    )
    ap.add_argument("--experiments", default=str(EXPERIMENTS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    experiments = Path(args.experiments)
    if args.write and args.check:
        print("error: --write or --check, not both", file=sys.stderr)
        return 2
    folders = claim_folders(experiments) if (args.all or args.summary_only) else [Path(f) for f in args.folders]
    if not folders and not args.summary_only:
        print("error: give a folder with a claims.yaml (or a runs folder), or --all", file=sys.stderr)
        return 2
    stale: list[str] = []
    try:
        for folder in [] if args.summary_only else folders:
            _verdicts_of_folder(folder, args.write, args.check, stale)
        if args.all or args.summary_only:
            _summary_table(experiments, args.check, args.write or args.summary_only, stale)
    except _UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ClaimError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # a bad claims.yaml
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for s in stale:
        print(f"stale: {s}", file=sys.stderr)
    if stale:
        print("run `python -m sparse_eval.verdicts --all --write` and commit what it writes", file=sys.stderr)
        return 1
    return 0
