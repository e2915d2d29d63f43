"""Is setting A better than setting B?  The paired difference of two configurations, each pooled over its seeds.

``collect`` compares every run with full attention.  This compares two chosen configurations of the same task and
model, for instance MagicPIG (9, 120) seeds 0–2 against (10, 150) seeds 0–2:

    python -m sparse_eval.results.contrast runs/b64 --a 'magicpig-K=9-*' --b 'magicpig-K=10-*'
    python -m sparse_eval.results.contrast runs/fused --a 'topk-*' --b 'topk-*' --b-dir runs/unfused
 ``--a`` and ``--b`` are shell patterns matched against run directory names (``<method>-<settings>-<hash>``) below the
runs folder; each must select the runs of ONE configuration (one ``seed_group``: runs that differ only in their seed),
and both must be of one task config.  The difference θ_A − θ_B, on the samples every run of both finished, gets the
two-level paired interval of ``statistics.seed_pooled_contrast`` (prompts resampled once for both sides, each side's
seeds resampled).  A run that has not scored all its task's samples is named incomplete, and the difference is then
given no significance, as in ``collect``.  ``--b-dir`` takes B's runs from another runs folder: one configuration
on two paths (the fused kernels against the unfused ones, a refactor), for which it also counts, per seed, the
samples whose predictions are the same.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
from pathlib import Path
from typing import Any

from .collect import PAIR_KEYS, run_rows, seed_order
from ..metrics.statistics import N_BOOT, seed_pooled_contrast
from .store import SAMPLES_FILE, find_run_dirs


def _runs(root: Path, pattern: str) -> list[Path]:
    """The run directories below ``root`` whose name matches ``pattern``."""
    return [d for d in find_run_dirs(root) if fnmatch.fnmatch(d.name, pattern)]


def _overall(run_dir: Path) -> dict[str, Any]:
    rows = run_rows(run_dir, by_subtask=False)
    if len(rows) != 1 or rows[0].get("_terms") is None:
        raise SystemExit(f"error: {run_dir}: no per-sample score terms (unreadable run, or a task without intervals)")
    return rows[0]


def _side(root: Path, pattern: str, flag: str) -> list[dict[str, Any]]:
    dirs = _runs(root, pattern)
    if not dirs:
        raise SystemExit(
            f"error: {flag} {pattern!r} matches no run directory below {root}; give a pattern of run "
            "directory names, e.g. 'magicpig-K=9-*'"
        )
    rows = sorted((_overall(d) for d in dirs), key=seed_order)  # as collect pools them
    groups = sorted({str(r.get("seed_group")) for r in rows})
    if len(groups) != 1:
        names = ", ".join(d.name for d in dirs)
        raise SystemExit(
            f"error: {flag} {pattern!r} matches runs of {len(groups)} configurations ({names}); "
            "narrow the pattern to one configuration (its runs may differ only in their seed)"
        )
    seeds = [r.get("seed") for r in rows]
    if len(set(map(str, seeds))) != len(seeds):
        raise SystemExit(f"error: {flag} {pattern!r} matches two runs of one seed ({seeds}); keep one of each")
    return rows


def same_predictions(ra: list[dict[str, Any]], rb: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per seed both sides ran: of the samples both finished, how many have the same ``prediction`` (the generated
    text of a generation task); [] where the records hold no prediction.  Two paths that should agree (the fused
    kernel against the unfused one, a refactor) are judged by this as well as by the score's difference."""
    from .store import read_samples

    out = []
    by_seed = {str(r.get("seed")): r for r in rb}
    for r in ra:
        other = by_seed.get(str(r.get("seed")))
        if other is None:
            continue
        sa, sb = (read_samples(Path(x["run_dir"]) / SAMPLES_FILE) for x in (r, other))
        shared = [
            i
            for i in sa.keys() & sb.keys()
            if sa[i].get("status") == sb[i].get("status") == "ok" and "prediction" in sa[i] and "prediction" in sb[i]
        ]
        if shared:
            same = sum(sa[i]["prediction"] == sb[i]["prediction"] for i in shared)
            out.append({"seed": r.get("seed"), "same": same, "n": len(shared)})
    return out


def contrast(root: Path, a: str, b: str, b_root: Path | None = None) -> dict[str, Any]:
    """The contrast's numbers (``seed_pooled_contrast``) with the two sides' labels, seeds and completeness, and
    how many predictions the two sides share (``same_predictions``).  B's runs come from ``b_root`` when given (two
    runs folders of one configuration, e.g. the fused and the unfused path)."""
    ra, rb = _side(root, a, "--a"), _side(b_root or root, b, "--b")
    for k in ("task", *PAIR_KEYS):  # what ``collect`` requires of a pair (model, task config, protocol, ...)
        if ra[0].get(k) != rb[0].get(k):
            raise SystemExit(
                f"error: --a and --b differ in {k} ({ra[0].get(k)!r} vs {rb[0].get(k)!r}); a contrast "
                "pairs the same prompts of one task and model"
            )
    d = seed_pooled_contrast([r["_terms"] for r in ra], [r["_terms"] for r in rb])
    complete = all(r.get("complete") for r in ra + rb)
    if not complete:
        d["significant"] = None
    return dict(
        d,
        a=ra[0].get("method_config") or ra[0].get("method"),
        b=rb[0].get("method_config") or rb[0].get("method"),
        a_seeds=[r.get("seed") for r in ra],
        b_seeds=[r.get("seed") for r in rb],
        incomplete=[r["run_dir"] for r in ra + rb if not r.get("complete")],
        same_predictions=same_predictions(ra, rb),
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparse_eval.results.contrast", description=__doc__.split("\n\n")[0])
    ap.add_argument("dir", help="a runs folder (paths.runs_dir) or any folder below it")
    ap.add_argument("--a", required=True, help="run directory name pattern of configuration A, e.g. 'magicpig-K=9-*'")
    ap.add_argument("--b", required=True, help="run directory name pattern of configuration B (the reference)")
    ap.add_argument("--b-dir", help="the runs folder of B's runs (default: the same folder as A's)")
    args = ap.parse_args(argv)
    root = Path(args.dir)
    b_root = Path(args.b_dir) if args.b_dir else None
    for folder in (root, b_root):
        if folder is not None and not folder.is_dir():
            print(f"error: {folder} is not a folder; give a runs folder (paths.runs_dir)", file=sys.stderr)
            return 2
    c = contrast(root, args.a, args.b, b_root)
    if c["diff"] is None:
        print(f"no sample that every run of both configurations finished ({args.a!r}, {args.b!r})", file=sys.stderr)
        return 1
    sig = {True: "significant", False: "not significant", None: "no claim (incomplete runs or too few samples)"}
    print(f"A: {c['a']} (seeds {c['a_seeds']})\nB: {c['b']} (seeds {c['b_seeds']})")
    print(
        f"A − B = {c['diff']:+.2f} [{c['lo']:+.2f}, {c['hi']:+.2f}] (95 %, two-level paired bootstrap over "
        f"{c['n']} prompts and the seeds, {N_BOOT:,} replicates; Monte Carlo error of the ends ±{c['lo_mc']:.3f}, "
        f"±{c['hi_mc']:.3f}): {sig[c['significant']]}"
    )
    for p in c["same_predictions"]:
        print(f"same prediction, seed {p['seed']}: {p['same']} of {p['n']} samples ({100 * p['same'] / p['n']:.1f} %)")
    for run in c["incomplete"]:
        print(f"incomplete: {run}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
