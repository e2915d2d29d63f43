"""Compare every record of two runs folders, for a refactor that must not change results.

    python scripts/compare_records.py BEFORE_RUNS AFTER_RUNS [--shared-samples]

For each run directory present in both (matched by its path under the folder: task / model / method-params-hash),
it compares the sample records (``samples.jsonl``, by sample id), ``summary.json``, ``summary.csv``, ``meta.json``
and ``config.yaml``, ignoring what differs between two runs of the same code anyway: time fields (``time_s``,
``time``, ``started``), the run's own path, process and host, and the provenance (git commit, hardware, command
line, and each restart's: ``resumes``; where each segment started and stopped: ``done_at_start``,
``done_at_end``).  Runs present in one folder only are listed.  Exit status 0 when every
shared run's records are identical.

``--shared-samples`` compares only the samples both runs finished and skips the summaries, for a check that
re-runs the first part of a long run (interrupted, e.g. by ``hydra.launcher.deadline_s``) at other code or on
another machine; at least one sample must be shared.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path
from typing import Any

IGNORED = {
    "time_s",
    "time",
    "started",
    "run_dir",
    "pid",
    "host",
    "git",
    "hardware",
    "argv",
    "resumes",
    "done_at_start",
    "done_at_end",
}


def _strip(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _strip(v) for k, v in x.items() if k not in IGNORED}
    if isinstance(x, list):
        return [_strip(v) for v in x]
    return x


def _runs(root: Path) -> set[Path]:
    return {p.parent.relative_to(root) for p in root.rglob("samples.jsonl") if ".hydra" not in p.parts}


def _samples(path: Path) -> list[dict[str, Any]]:
    recs = [_strip(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return sorted(recs, key=lambda r: str(r.get("id")))


def _csv(path: Path) -> list[dict[str, str]]:
    return [{k: v for k, v in r.items() if k not in IGNORED} for r in csv.DictReader(io.StringIO(path.read_text()))]


def compare(before: Path, after: Path, shared_samples: bool = False) -> tuple[list[str], int, int]:
    """(differences, runs compared, sample records compared)."""
    a, b = _runs(before), _runs(after)
    diffs = [f"only in {before}: {r}" for r in sorted(a - b)] + [f"only in {after}: {r}" for r in sorted(b - a)]
    n = 0
    for run in sorted(a & b):
        x, y = before / run, after / run
        sa, sb = _samples(x / "samples.jsonl"), _samples(y / "samples.jsonl")
        if shared_samples:
            ids = {str(r.get("id")) for r in sa} & {str(r.get("id")) for r in sb}
            sa, sb = ([r for r in s if str(r.get("id")) in ids] for s in (sa, sb))
            if not ids:
                diffs.append(f"{run}: no sample finished in both")
        n += len(sa)
        if sa != sb:
            bad = sum(1 for r, t in zip(sa, sb) if r != t) if len(sa) == len(sb) else None
            diffs.append(f"{run}: samples.jsonl differs" + (f" ({bad} of {len(sa)} records)" if bad else ""))
        if shared_samples:
            if (x / "config.yaml").read_text() != (y / "config.yaml").read_text():
                diffs.append(f"{run}: config.yaml differs")
            continue
        for name in ("summary.json", "meta.json"):
            if (x / name).exists() or (y / name).exists():
                ja, jb = (_strip(json.loads((p / name).read_text())) if (p / name).exists() else {} for p in (x, y))
                if ja != jb:
                    keys = sorted(k for k in ja.keys() | jb.keys() if ja.get(k) != jb.get(k))
                    diffs.append(f"{run}: {name} differs in {keys}")
        if (x / "summary.csv").exists() and _csv(x / "summary.csv") != _csv(y / "summary.csv"):
            diffs.append(f"{run}: summary.csv differs")
        if (x / "config.yaml").read_text() != (y / "config.yaml").read_text():
            diffs.append(f"{run}: config.yaml differs")
    return diffs, len(a & b), n


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", type=Path)
    ap.add_argument("after", type=Path)
    ap.add_argument(
        "--shared-samples",
        action="store_true",
        help="compare only the samples both runs finished (a partial re-run), not the summaries",
    )
    args = ap.parse_args(argv)
    diffs, runs, samples = compare(args.before, args.after, shared_samples=args.shared_samples)
    for d in diffs:
        print(d)
    shared = [d for d in diffs if not d.startswith("only in")]
    print(
        f"{runs} runs in both, {samples} sample records compared: "
        f"{'identical' if not shared else f'{len(shared)} differences'}"
    )
    return 1 if shared else 0


if __name__ == "__main__":
    sys.exit(main())
