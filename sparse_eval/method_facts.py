"""What ``status`` and ``collect`` need to know about a method, without importing the methods (they import torch).

The one fact they ask is whether a run's method is the dense reference (``Method.dense``: full attention).  The
registry answers it once the methods are imported; before that, the shipped methods' class bodies are read from
their source (``name = "..."`` and ``dense = True`` at class level, by ``ast``), which gives the same answer in a
few milliseconds.  A name no shipped module declares (a user's method from ``SPARSE_EVAL_PLUGINS`` or an entry
point) is asked of the registry, importing the methods then.
"""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from typing import Any

METHODS_DIR = Path(__file__).resolve().parent / "methods"


@functools.lru_cache(maxsize=1)
def shipped_dense_flags() -> dict[str, bool]:
    """{name: dense} of every class in ``sparse_eval/methods/*.py`` that assigns a string ``name`` in its body."""
    flags: dict[str, bool] = {}
    for path in sorted(METHODS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs = {}
            for stmt in node.body:
                if (
                    isinstance(stmt, ast.Assign)
                    and len(stmt.targets) == 1
                    and isinstance(stmt.targets[0], ast.Name)
                    and isinstance(stmt.value, ast.Constant)
                ):
                    attrs[stmt.targets[0].id] = stmt.value.value
            if isinstance(attrs.get("name"), str) and attrs["name"]:
                flags[attrs["name"]] = attrs.get("dense") is True
    return flags


def is_dense(name: Any) -> bool:
    """``methods.registry.is_dense`` (whether ``name`` is the dense reference), torch-free for the shipped methods."""
    if "sparse_eval.methods" not in sys.modules and isinstance(name, str) and name in shipped_dense_flags():
        return shipped_dense_flags()[name]
    from .methods import is_dense as registry_is_dense

    return registry_is_dense(name)
