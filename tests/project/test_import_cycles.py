"""No import cycle inside the package: the graph of ``sparse_eval`` modules built from every import statement of
every module (at module level and inside functions, ``if TYPE_CHECKING`` blocks included), read with ``ast``.

A function-level import is fine where it keeps start-up light (``python -m sparse_eval --help`` imports no torch:
``tests/cli/test_startup_imports.py``), as long as it closes no cycle.  Importing ``a.b.c`` also runs the
``__init__`` of ``a`` and ``a.b``; those implicit edges are left out (a package that imports its own submodules,
e.g. ``methods/__init__`` registering every method, would otherwise form a cycle with each of them), and so are
``importlib.import_module`` calls (the registries' discovery, ``kernels``' lazy attributes).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_eval"


def modules() -> dict[str, tuple[Path, bool]]:
    """{dotted name: (file, is a package's __init__)} of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported package module: line of the first import of it}}."""
    mods = modules()

    def owner(name: str) -> str | None:  # the longest prefix of ``name`` that is a module of the package
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, dict[str, int]] = {}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        deps: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [owner(a.name) for a in node.names if a.name.split(".")[0] == "sparse_eval"]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] != "sparse_eval":
                    continue
                # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module
                targets = [f"{source}.{a.name}" if f"{source}.{a.name}" in mods else owner(source) for a in node.names]
            for t in targets:
                if t is not None and t != name:
                    deps.setdefault(t, node.lineno)
        graph[name] = deps
    return graph


def find_cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One cycle [a, b, ..., a] of the graph, or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: finished
    path: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        path.append(v)
        for w in sorted(graph.get(v, {})):
            if state.get(w) == 1:
                return path[path.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        path.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_graph_sees_function_level_imports():
    graph = import_graph()
    assert "sparse_eval.cli" in graph["sparse_eval.__main__"]  # module level
    # inside ``_run`` (lazy: a cache hit needs no torch)
    assert "sparse_eval.run.experiment" in graph["sparse_eval.launcher.runner"]
    assert find_cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == ["a", "b", "c", "a"]


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, (
        "import cycle: "
        + " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(cycle, cycle[1:]))
        + f" -> {cycle[-1]}"
    )


def wing(module: str) -> str:
    """The wing a module belongs to: its top-level folder of the package, or the top-level module itself."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_runs_back_up_between_wings():
    """The wings (``sparse_eval/<folder>/`` or a top-level module) stand on floors: a wing imports only wings below
    it, so no two wings import each other, even through others (``docs/layout.md``)."""
    graph = import_graph()
    wings: dict[str, dict[str, int]] = {}
    for mod, deps in graph.items():
        for dep, line in deps.items():
            if wing(dep) != wing(mod):
                wings.setdefault(wing(mod), {}).setdefault(wing(dep), line)
    cycle = find_cycle(wings)
    assert cycle is None, "wings that import each other: " + " -> ".join(cycle)
