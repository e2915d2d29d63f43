"""How registries fill themselves: every module of a package is imported (a module registers what it defines with
its registry's decorator), and users' packages are imported from an entry-point group or an environment variable.

* ``import_package_modules(package, skip)``: the modules of one of our packages (``sparse_eval.methods``,
  ``sparse_eval.system.layers``, ``sparse_eval.tasks``), found with ``pkgutil.iter_modules``, in name order.  A
  module dropped into the folder registers itself; there is no import list to edit.
* ``load_plugins()``: a user's modules, registered without forking:
    - the entry-point group ``sparse_eval.methods`` of installed distributions (``importlib.metadata``), e.g. in
      the user's ``pyproject.toml``: ``[project.entry-points."sparse_eval.methods"] mine = "mypkg.mymethod"``
      (a module, or ``module:Class`` for a ``Method`` subclass, registered if its module did not);
    - ``SPARSE_EVAL_PLUGINS``: module names separated by commas, e.g. ``SPARSE_EVAL_PLUGINS=mypkg.mymethod``.
  A plugin module may register methods (``sparse_eval.methods.register``), system layers
  (``sparse_eval.system.layers.register_layer``) and tasks (``sparse_eval.tasks.register_task``).
"""

from __future__ import annotations

import importlib
import os
import pkgutil
from collections.abc import Iterable
from typing import Any

ENTRY_POINT_GROUP = "sparse_eval.methods"
PLUGINS_ENV = "SPARSE_EVAL_PLUGINS"

_loaded: set[str] = set()  # plugin sources already imported (an entry point's value or a module name)


def import_package_modules(package: str, skip: Iterable[str] = ()) -> list[str]:
    """Import every module of ``package`` (not its subpackages' modules) except ``skip`` and private ``_*``
    modules; returns their names.  An error inside a module is raised as is: a broken module is never skipped."""
    pkg = importlib.import_module(package)
    skip = set(skip)
    names = [
        m.name
        for m in pkgutil.iter_modules(pkg.__path__)
        if not m.ispkg and m.name not in skip and not m.name.startswith("_")
    ]
    for name in sorted(names):
        importlib.import_module(f"{package}.{name}")
    return sorted(names)


def plugin_modules() -> list[str]:
    """The module names given in ``SPARSE_EVAL_PLUGINS`` (comma-separated, blanks ignored)."""
    return [m.strip() for m in os.environ.get(PLUGINS_ENV, "").split(",") if m.strip()]


def _entry_points() -> list[Any]:
    from importlib.metadata import entry_points

    return list(entry_points(group=ENTRY_POINT_GROUP))


def load_plugins() -> list[Any]:
    """Import the user's plugins (entry points of ``ENTRY_POINT_GROUP``, then ``SPARSE_EVAL_PLUGINS``), each once;
    returns what each newly imported one gave (a module, or an entry point's ``module:attr`` object; the method
    registry registers a ``Method`` subclass among them).  A plugin that fails to import raises ImportError naming
    it and the fix."""
    got = []
    sources = [(f"entry point {ep.name} = {ep.value}", ep.value, ep) for ep in _entry_points()]
    sources += [(f"{PLUGINS_ENV}={m}", m, None) for m in plugin_modules()]
    for what, key, ep in sources:
        if key in _loaded:
            continue
        _loaded.add(key)
        try:
            got.append(ep.load() if ep is not None else importlib.import_module(key))
        except Exception as exc:  # noqa: BLE001 - any error inside the user's module: name the plugin
            raise ImportError(
                f"plugin {what} could not be imported: {type(exc).__name__}: {exc} (fix the module, or "
                f"remove it from {PLUGINS_ENV} / uninstall the package that declares it)"
            ) from exc
    return got
