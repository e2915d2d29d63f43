"""What ``status``, ``collect`` and ``python -m sparse_eval --help`` need to know about a method, without importing
the methods (they import torch).

The facts they ask: whether a run's method is the dense reference (``Method.dense``: full attention), the options
its configs are told apart by (``headline_options``: ``collect``'s config column) and its one-line ``summary``
(``--help``).  The registry answers once the methods are imported; before that, the shipped methods' class bodies
are read from their source (class-level assignments of literals such as ``name = "..."``, ``dense = True``, by
``ast``), which gives the same answer in a few milliseconds (``tests/cli/test_startup_imports.py`` checks that they
agree).  A name no shipped module declares (a user's method from ``SPARSE_EVAL_PLUGINS`` or an entry point) is
asked of the registry, importing the methods then; so is the help's list while a plugin is configured.

``is_stochastic`` (whether a recorded method config draws at random) depends on the config (Double Sparsity's
random channels), so it builds the method, importing the methods (``collect`` asks it only of a record whose summary
lacks the ``stochastic`` field)."""

from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path
from typing import Any, Mapping

METHODS_DIR = Path(__file__).resolve().parent / "methods"


@functools.lru_cache(maxsize=1)
def shipped_class_facts() -> dict[str, dict[str, Any]]:
    """{name: {attribute: value}} of every class in ``sparse_eval/methods/*.py`` that assigns a string ``name`` in
    its body: the class-level assignments of literals (``dense``, ``summary``, ``headline_options``, ...)."""
    facts: dict[str, dict[str, Any]] = {}
    for path in sorted(METHODS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef):
                continue
            attrs: dict[str, Any] = {}
            for stmt in node.body:
                if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
                    try:
                        attrs[stmt.targets[0].id] = ast.literal_eval(stmt.value)
                    except ValueError:  # not a literal (a class, a call): not a fact this module reads
                        pass
            if isinstance(attrs.get("name"), str) and attrs["name"]:
                facts[attrs["name"]] = attrs
    return facts


@functools.lru_cache(maxsize=1)
def shipped_dense_flags() -> dict[str, bool]:
    """{name: dense} of every shipped method (``shipped_class_facts``)."""
    return {name: attrs.get("dense") is True for name, attrs in shipped_class_facts().items()}


def _plugins_configured() -> bool:
    """Whether a user's methods may be registered besides the shipped ones (``sparse_eval.discovery``)."""
    from .discovery import _entry_points, plugin_modules

    return bool(plugin_modules() or _entry_points())


def method_summaries() -> dict[str, str]:
    """{name: one line} of every registered method (``Method.summary``, else its docstring's first sentence), in
    ``methods.compare_names``'s order (the dense reference first, then by name): from the shipped modules' source
    when no plugin is configured (no torch), else from the registry."""
    if "sparse_eval.methods" in sys.modules or _plugins_configured():
        from .methods import METHODS, compare_names

        return {name: METHODS[name].summary or _first_sentence(METHODS[name].__doc__) for name in compare_names()}
    facts = shipped_class_facts()
    order = sorted(facts, key=lambda name: (facts[name].get("dense") is not True, name))
    return {name: facts[name].get("summary") or "" for name in order}


def _first_sentence(doc: str | None) -> str:
    text = " ".join((doc or "").split())
    return text.split(". ", 1)[0].rstrip(".")


def is_dense(name: Any) -> bool:
    """``methods.registry.is_dense`` (whether ``name`` is the dense reference), torch-free for the shipped methods."""
    if "sparse_eval.methods" not in sys.modules and isinstance(name, str) and name in shipped_dense_flags():
        return shipped_dense_flags()[name]
    from .methods import is_dense as registry_is_dense

    return registry_is_dense(name)


def headline_options(name: Any) -> tuple[str, ...]:
    """``Method.headline_options`` of ``name`` (the options a reader tells its configs apart by: the printed table's
    config column), torch-free for the shipped methods; () for a name no registered method has."""
    if "sparse_eval.methods" not in sys.modules and isinstance(name, str) and name in shipped_class_facts():
        return tuple(shipped_class_facts()[name].get("headline_options") or ())
    from .methods import METHODS

    cls = METHODS.get(name) if isinstance(name, str) else None
    return tuple(cls.headline_options) if cls is not None else ()


def is_stochastic(method: Mapping[str, Any]) -> bool | None:
    """Whether a recorded method config draws at random (``Method.stochastic``); None when it cannot be built here
    (an unknown method or an option of an older version)."""
    from .methods import build_method, make_config

    try:
        return bool(build_method(make_config(method["name"], {k: v for k, v in method.items()})).stochastic)
    except Exception:  # noqa: BLE001 - a record of another version: unknown
        return None
