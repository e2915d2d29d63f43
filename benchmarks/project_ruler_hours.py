"""Projected GPU-hours of MagicPIG Table 3 (RULER, 13 tasks x 50 samples per length) on the accuracy path.

Reads ``bench_accuracy_path.py`` records of one model shape at one batch size and two or more contexts (e.g. the
Llama-3.1-8B shape at 16K and 32K on an H200), fits per method the decode step ``t(n) = a + b n`` (least squares:
the step reads the whole cache, so it is linear in the context n) and the dense prefill of the batch
``p(n) = c n + d n^2`` (linear layers plus the attention's quadratic part), and projects for each row of Table 3
and each length of the table:

    hours = sum over the 13 subtasks of ceil(50 / B) batches x (p(n) + f(n) + (tokens_to_generate(subtask) - 1) x t(n))

where f(n) is the first decode step after the prefill (``first_step_ms``: the step in which a method builds its
index over the prefilled keys, once per batch), fitted like t(n); records without it take f = t.

with the estimation error on (a run's default).  Upper bound on decoding: every row is taken to generate the
subtask's full ``tokens_to_generate`` (RULER stops at EOS earlier).  Rows whose (K, L) or (page, budget) was not
benchmarked take the measured row of the same method (printed beside them).  Lengths beyond the measured
contexts are extrapolations of these fits.

    python benchmarks/project_ruler_hours.py experiments/accuracy_path_speed/accuracy_path_llama3_8b_random_*_b8.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparse_eval.tasks import ruler_data as rd  # noqa: E402

# MagicPIG Table 3: the rows (conf/method names) and lengths; experiments' conf/experiment/ruler_magicpig.yaml
TABLE3_ROWS = [
    "full",
    "magicpig_k10_l150",
    "magicpig_k9_l120",
    "magicpig_k8_l75",
    "quest_p16_4pct",
    "quest_p32_6pct",
    "quest_p64_8pct",
]
TABLE3_LENGTHS = [16384, 32768, 65536, 98304]
SAMPLES_PER_TASK = 50


def device_name(recs: dict[int, dict]) -> str:
    r = next(iter(recs.values()))
    hw = r.get("hardware", {})
    return hw.get("gpu") or hw.get("cuda_device") or r.get("device") or hw.get("cpu") or "?"


def load(paths: list[Path]) -> tuple[int, dict[int, dict]]:
    recs = {}
    batches = set()
    for p in paths:
        r = json.loads(p.read_text())
        if "args" not in r or "prefill_ms" not in r:
            raise SystemExit(f"{p}: not a bench_accuracy_path.py record with prefill_ms (re-run the benchmark)")
        batches.add(r["args"]["batch"])
        recs[int(r["args"]["context"])] = r
    if len(batches) != 1:
        raise SystemExit(f"records at batch sizes {sorted(batches)}: give records of one batch size")
    if len(recs) < 2:
        raise SystemExit(f"records at {len(recs)} context(s): give at least two contexts to fit against")
    return batches.pop(), recs


def fit_step(recs: dict[int, dict], method: str, key: str = "ms_per_step") -> tuple[float, float] | None:
    """(a, b) of ``key`` = a + b·n over the contexts n, error on; ``first_step_ms`` falls back to ``ms_per_step``
    in records made before it was measured.  A step reads the whole cache, so its time cannot fall as the context
    grows: where the measured times do (the repeats' noise exceeds the growth), the fit is flat at the largest
    measured time (b = 0) and a line says so."""
    pts = [
        (n, row.get(key, row["ms_per_step"]))
        for n, r in recs.items()
        for row in r["rows"]
        if row["method"] == method and row["est_error_on"]
    ]
    if len(pts) < 2:
        return None
    n, t = np.array(pts, dtype=float).T
    b, a = np.polyfit(n, t, 1)
    if b < 0:
        print(
            f"{method}: {key} falls with the context ({', '.join(f'{x:.1f}' for x in t)} ms at "
            f"{', '.join(str(int(x)) for x in n)}): projected flat at {t.max():.1f} ms"
        )
        return float(t.max()), 0.0
    return float(a), float(b)


def fit_prefill(recs: dict[int, dict]) -> tuple[float, float]:
    n = np.array(sorted(recs), dtype=float)
    p = np.array([recs[int(x)]["prefill_ms"] for x in n])
    (c, d), *_ = np.linalg.lstsq(np.stack([n, n * n], 1), p, rcond=None)
    return float(c), float(d)


def measured_name(row: str, available: set[str]) -> str | None:
    """The benchmarked method a Table 3 row is projected from: itself, else its method's default config."""
    if row in available:
        return row
    base = row.split("_")[0]
    return base if base in available else None


def project(batch: int, recs: dict[int, dict]) -> list[dict]:
    available = {row["method"] for r in recs.values() for row in r["rows"] if row["est_error_on"]}
    c, d = fit_prefill(recs)
    batches = math.ceil(SAMPLES_PER_TASK / batch)
    fits: dict[str, tuple] = {}
    out = []
    for row in TABLE3_ROWS:
        used = measured_name(row, available)
        if used and used not in fits:  # rows measured as the same method share its fits (fitted, and noted, once)
            fits[used] = (fit_step(recs, used), fit_step(recs, used, "first_step_ms"))
        fit = fits[used][0] if used else None
        if fit is None:
            out.append({"row": row, "measured_as": None})
            continue
        a, b = fit
        fa, fb = fits[used][1]
        hours = {}
        for n in TABLE3_LENGTHS:
            prefill_s = (c * n + d * n * n) / 1000.0
            step_s = (a + b * n) / 1000.0
            first_s = (fa + fb * n) / 1000.0
            total = sum(
                batches * (prefill_s + first_s + (rd.tokens_to_generate(s) - 1) * step_s) for s in rd.SUBTASK_NAMES
            )
            hours[n] = total / 3600.0
        out.append(
            {
                "row": row,
                "measured_as": used,
                "step_ms_16k": a + b * 16384,
                "first_step_ms_16k": fa + fb * 16384,
                "hours": hours,
                "total_hours": sum(hours.values()),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("records", nargs="+", type=Path, help="bench_accuracy_path.py JSON records (one batch size)")
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="write the projection as JSON here (a folder: its table3_projection.json)",
    )
    args = ap.parse_args(argv)
    batch, recs = load(args.records)
    rows = project(batch, recs)
    c, d = fit_prefill(recs)
    print(f"batch {batch}; measured contexts {sorted(recs)}; prefill fit p(n) = {c:.3g} n + {d:.3g} n^2 ms")
    head = "".join(f"{n // 1024:>7d}K" for n in TABLE3_LENGTHS)
    dev = device_name(recs)
    print(f"{'Table 3 row':20s} {'measured as':18s}{head}   total (hours on {dev})")
    for r in rows:
        if r["measured_as"] is None:
            print(f"{r['row']:20s} not benchmarked")
            continue
        cells = "".join(f"{r['hours'][n]:8.2f}" for n in TABLE3_LENGTHS)
        print(f"{r['row']:20s} {r['measured_as']:18s}{cells}   {r['total_hours']:.1f}")
    total = sum(r.get("total_hours", 0.0) for r in rows)
    print(f"all rows: {total:.1f} hours on {dev} at batch {batch}")
    if args.out:
        out = args.out / "table3_projection.json" if args.out.is_dir() else args.out
        out.write_text(
            json.dumps(
                {
                    "device": dev,
                    "batch": batch,
                    "contexts": sorted(recs),
                    "prefill_fit_ms": [c, d],
                    "rows": rows,
                    "total_hours": total,
                },
                indent=2,
            )
            + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
