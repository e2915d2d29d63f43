"""The results table a run prints (``python -m sparse_eval``): one row per method config, pooled over seeds, and
the note on what was reused.  Free of torch and transformers, so a relaunch whose runs are all finished prints it
without loading either (``sparse_eval.launcher.launch_cache``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from ..method_facts import is_stochastic
from .store import SAMPLES_FILE, read_samples

NO_VALUE = "–"  # a table cell without a value (full attention's own "vs full", a statistic a run did not have)


def short_config(method: dict[str, Any]) -> str:
    """The method options a reader tells configs apart by (the method's ``headline_options``), e.g. ``K=10, L=150``."""
    from ..methods import METHODS

    cls = METHODS.get(method.get("name"))
    keys = cls.headline_options if cls is not None else ()
    return ", ".join(f"{k}={v}" for k, v in method.items() if k in keys)


def _interval_text(ci: dict[str, Any] | None) -> str | None:
    """``[lo, hi]`` of a summary's ``score_ci`` (4 significant digits), None without one."""
    if not ci or ci.get("lo") is None or ci.get("hi") is None:
        return None
    return f"[{ci['lo']:.4g}, {ci['hi']:.4g}]"


def pool_seeds(task: Any, summaries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The printed table's rows: one per method config of this call, over its seeds (``seed=[0,1,2]`` runs a
    stochastic method once per seed).  Each row has the mean over seeds of the score on the samples every seed
    finished with its two-level interval over prompts and seeds (``statistics.seed_pooled_ci``), the per-seed
    spread, and, when full attention is among them, the paired difference against it on the samples both finished
    (``vs_full``, with ``n``; ``significant`` only between complete runs).  ``collect`` records the same for any
    set of runs."""
    from ..methods import is_dense
    from ..metrics.statistics import seed_pooled_ci, seed_pooled_difference, seed_spread

    def finished(summary: dict[str, Any]) -> list[dict[str, Any]]:
        recs = read_samples(Path(summary["run_dir"]) / SAMPLES_FILE).values()
        return [r for r in recs if r.get("status") == "ok"]

    def terms(summary: dict[str, Any]):
        return task.score_terms(finished(summary))

    groups: dict[str, list[dict[str, Any]]] = {}
    for s in summaries:
        key = json.dumps({k: v for k, v in s["method_config"].items() if k != "seed"}, sort_keys=True, default=str)
        groups.setdefault(key, []).append(s)
    full = next((g for g in groups.values() if is_dense(g[0]["method"])), None)
    ref = terms(full[0]) if full else None
    rows = []
    for group in groups.values():
        ts = [terms(s) for s in group]
        complete = all(s.get("complete", s["failed"] == 0 and s["samples"] >= s["expected_samples"]) for s in group)
        row = {
            "summaries": group,
            "method": group[0]["method"],
            "method_config": group[0]["method_config"],
            "metric": group[0]["metric"],
            "seeds": [s.get("seed") for s in group],
            "stochastic": bool(
                group[0]["stochastic"] if "stochastic" in group[0] else is_stochastic(group[0]["method_config"])
            ),
            "complete": complete,
            # in the task's units (``Task.units``: lm-eval's documents), as ``samples`` below
            "expected_samples": task.expected_units(group[0]["expected_samples"], finished(group[0])),
            "failed": sum(s["failed"] for s in group),
            "time_s": sum(s["time_s"] for s in group),
            "ci": None,
            "spread": None,
            "vs_full": None,
        }
        for key in ("cost1", "cost2", "static_frac", "est_error"):
            vals = [s[key] for s in group if s.get(key) is not None]
            row[key] = sum(vals) / len(vals) if vals else None
        if all(t is not None for t in ts):
            row["ci"] = seed_pooled_ci(ts)
            row["spread"] = seed_spread(row["ci"].get("per_seed") or [])
            if ref is not None and group is not full:
                d = seed_pooled_difference(ts, ref)
                if not (complete and full[0].get("complete", True)):
                    d["significant"] = None  # no claim from an incomplete run (or reference)
                row["vs_full"] = d
        score = row["ci"]["score"] if row["ci"] else group[0]["score"]
        row["score"], row["samples"] = score, row["ci"]["n"] if row["ci"] else task.units(finished(group[0]))
        rows.append(row)
    return rows


def _difference_text(d: dict[str, Any] | None) -> str | None:
    """``+d [lo, hi]`` with `` *`` when the interval excludes 0."""
    if not d or d.get("diff") is None or d.get("lo") is None:
        return None
    return f"{d['diff']:+.3g} [{d['lo']:.3g}, {d['hi']:.3g}]{' *' if d.get('significant') else ''}"


SINGLE_SEED_MARK, INCOMPLETE_MARK = "†", "!"


def _seeds_text(row: dict[str, Any]) -> str:
    """Deterministic: "–"; a stochastic method: its seed count (``†`` for one: the interval omits the seed
    variation) and the standard deviation of its per-seed scores."""
    if not row["stochastic"]:
        return NO_VALUE
    n = len(row["seeds"])
    if n == 1:
        return f"1 {SINGLE_SEED_MARK}"
    std = (row.get("spread") or {}).get("std")
    return f"{n} (sd {std:.3g})" if std is not None else str(n)


def format_table(rows: list[dict[str, Any]]) -> str:
    """The rows of ``pool_seeds`` as a table."""
    import pandas as pd

    out = []
    for r in rows:
        vs = r.get("vs_full")
        out.append(
            {
                "method": r["method"],
                "config": short_config(r["method_config"]),
                r["metric"]: r["score"],
                "95% CI": _interval_text(r.get("ci")),
                **(
                    {"vs full [95% CI]": _difference_text(vs), "n_paired": vs.get("n") if vs else None}
                    if any(x.get("vs_full") for x in rows)
                    else {}
                ),
                "seeds": _seeds_text(r),
                "Cost1": r["cost1"],
                "Cost2": r["cost2"],
                "static": r["static_frac"],
                "est_error": r["est_error"],
                "samples": r["samples"]
                if r["complete"]
                else f"{r['samples']}/{r['expected_samples']} {INCOMPLETE_MARK}",
                "failed": r["failed"],
                "time_s": r["time_s"],
            }
        )
    df = pd.DataFrame(out)
    if "vs full [95% CI]" in df:  # full attention's own row (and a row without a difference): a dash, not None
        df["vs full [95% CI]"] = df["vs full [95% CI]"].map(lambda v: NO_VALUE if v is None else v)
    if "n_paired" in df:
        df["n_paired"] = [str(int(v)) if v is not None and v == v else NO_VALUE for v in df["n_paired"]]
    text = df.to_string(
        index=False, float_format=lambda x: f"{x:.4g}" if not math.isnan(x) else NO_VALUE, na_rep=NO_VALUE
    )
    notes = []
    if any(r["stochastic"] and len(r["seeds"]) == 1 for r in rows):
        notes.append(
            f"{SINGLE_SEED_MARK} one seed of a stochastic method: its interval omits the seed-to-seed "
            "variation (seed=[0,1,2] runs it over three seeds)"
        )
    if any(not r["complete"] for r in rows):
        notes.append(
            f"{INCOMPLETE_MARK} incomplete (failed or missing samples): scored over the samples it finished, "
            "compared over the samples both finished (n_paired), never marked significant; the same command "
            "retries the failed samples"
        )
    return "\n".join([text, *notes])


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def reuse_note(summaries: list[dict[str, Any]], reused: list[tuple[int, int]]) -> str:
    """What a run took from saved results: `` (reused the saved results of full, topk: nothing recomputed)``, or
    which runs resumed where; "" when everything was computed now.  ``reused``: per summary, (samples already
    written at its start, samples expected)."""
    whole = [s["method"] for s, (done, exp) in zip(summaries, reused) if exp and done >= exp]
    part = [
        f"{s['method']} at sample {done + 1} of {exp}"
        for s, (done, exp) in zip(summaries, reused)
        if exp and 0 < done < exp
    ]
    notes = []
    if whole:
        notes.append(
            (
                "all results were already saved there: reused, nothing recomputed"
                if len(whole) == len(summaries)
                else f"reused the saved results of {', '.join(whole)}"
            )
        )
    if part:
        notes.append(f"resumed {', '.join(part)}")
    return f" ({'; '.join(notes)})" if notes else ""


def print_results(task: Any, summaries: list[dict[str, Any]], reused: list[tuple[int, int]]) -> None:
    """The header line, the table (``pool_seeds``, ``format_table``) and where the results are, with what was
    reused (``reuse_note``)."""
    first = summaries[0]
    print(
        f"\nmodel={first['model']} task={first['task']} protocol={first['protocol']} "
        f"({plural(first['expected_samples'], 'sample')}; 95% CI: percentile bootstrap over samples, and over seeds "
        f"for a stochastic method run with several (two-level); vs full: paired difference with full attention on "
        f"the n_paired samples both finished, * where its interval excludes 0 (claimed from 8 samples); seeds: "
        f"a stochastic method's seeds and the sd of its per-seed scores; Cost1/Cost2/static/est_error: means "
        f"over sparse layers, heads and query rows)"
    )
    print(format_table(pool_seeds(task, summaries)))
    print(f"results: {Path(first['run_dir']).parent}{reuse_note(summaries, reused)}")


def short_label(method: dict[str, Any]) -> str:
    """The progress bar's label: the method and its headline options, e.g. ``magicpig K=10, L=150``."""
    return f"{method['name']} {short_config(method)}".strip()
