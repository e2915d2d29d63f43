"""``python -m sparse_eval.analysis <name> [model=<conf/model name>] [model.<field>=...] [paths.data_dir=...]
[<option>=<value> ...]``

Overrides use Hydra's ``key=value`` syntax (values are YAML: ``budgets=[0.01,0.1]``, ``layers=null``,
``center=false``).  ``model=`` picks ``conf/model/<name>.yaml`` exactly as ``python -m sparse_eval`` does and
``model.path=`` / ``model.dtype=`` / ``model.device=`` ... override its fields; ``paths.data_dir=`` (or the
``SPARSE_EVAL_DATA_DIR`` variable) is where ``text=local`` reads WikiText-2.  Every other key is an option of
the analysis (listed by ``python -m sparse_eval.analysis <name> --help``).
"""

from __future__ import annotations

import dataclasses
import importlib
import os
import sys
from typing import Any

from . import ANALYSES
from .common import build_options, model_config, parse_value


def parse(argv: list[str]) -> tuple[str, Any, Any]:
    if not argv or argv[0] in ("-h", "--help"):
        raise SystemExit(__doc__ + "\nanalyses: " + ", ".join(ANALYSES))
    name, rest = argv[0], argv[1:]
    if name not in ANALYSES:
        raise ValueError(f"unknown analysis {name!r}; valid: {list(ANALYSES)}")
    mod = importlib.import_module(ANALYSES[name][0])
    cls = getattr(mod, ANALYSES[name][1])
    if any(a in ("-h", "--help") for a in rest):
        lines = [f"python -m sparse_eval.analysis {name} model=<name> [option=value ...]", "", "options (default):"]
        for f in dataclasses.fields(cls):
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            lines.append(f"  {f.name}={default!r}")
        raise SystemExit("\n".join(lines) + "\n\n" + (mod.__doc__ or ""))
    model_name, model_over, opts = "stories260k", {}, {}
    data_dir = os.environ.get("SPARSE_EVAL_DATA_DIR")
    for arg in rest:
        if "=" not in arg:
            raise ValueError(f"argument {arg!r}: expected key=value (e.g. model=stories260k, length=512)")
        key, val = arg.split("=", 1)
        key = key.lstrip("+")
        if key == "model":
            model_name = val
        elif key.startswith("model."):
            model_over[key[len("model."):]] = parse_value(val)
        elif key == "paths.data_dir":
            data_dir = val
        else:
            opts[key] = parse_value(val)
    if "data_dir" in {f.name for f in dataclasses.fields(cls)} and "data_dir" not in opts:
        opts["data_dir"] = data_dir
    return name, model_config(model_name, model_over), build_options(cls, opts)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        name, model_cfg, opts = parse(argv)
        opts.validate()
        mod = importlib.import_module(ANALYSES[name][0])
        result = mod.run(model_cfg, opts)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = result["out"]
    table = result.get("table")
    if table is None:
        table = result.get("summary")
        if table is not None:
            table = table[table["layer"] == "mean"]
    if table is not None:
        with_pd = table.to_string(index=False, float_format=lambda x: f"{x:.4g}")
        print(with_pd)
    print(f"\nwrote {out}:")
    for p in sorted(out.iterdir()):
        print(f"  {p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
