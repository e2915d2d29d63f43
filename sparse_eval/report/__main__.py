"""python -m sparse_eval.report <collected table (.csv/.parquet) or runs folder> [more ...] [--out DIR]"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m sparse_eval.report",
        description="The MagicPIG / Double Sparsity tables and figures from collected results.",
    )
    ap.add_argument(
        "path",
        nargs="+",
        help="a table written by `python -m sparse_eval.results.collect` (.csv/.parquet) or "
        "a runs folder; several: their rows are reported together",
    )
    ap.add_argument("--out", help="output folder (default: <first path's folder>/report)")
    ap.add_argument(
        "--full-at-least",
        type=float,
        metavar="X",
        help="for a runs folder: also report each run on only the subtasks full attention scores at least X on "
        "(as `python -m sparse_eval.results.collect --full-at-least X`)",
    )
    args = ap.parse_args(argv)
    from . import write_report

    paths = [Path(p) for p in args.path]
    first = paths[0]
    out = Path(args.out) if args.out else (first.parent if first.is_file() else first) / "report"
    try:
        res = write_report(paths if len(paths) > 1 else first, out, full_at_least=args.full_at_least)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for t in res["tables"]:
        print(f"table  {t.name}: {len(t.rows)} rows")
    for p in res["figures"]:
        if p.suffix == ".png":
            print(f"figure {p.relative_to(out)}")
    for k, v in res["skipped_tables"].items():
        print(f"skipped table {k}: {v}")
    for k, v in res["skipped_figures"].items():
        print(f"skipped figure {k}: {v}")
    print(f"wrote {out} (report.md, tables/*.md|.tex|.csv, figures/*.png|.pdf)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
