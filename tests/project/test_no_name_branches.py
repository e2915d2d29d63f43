"""Generic code asks a method (or a system layer) what it is, never its name (issue 27: "a name-branch count of zero
outside registries").

The package's syntax trees are searched for
* a comparison with the string literal of a registered method or system-layer name: ``x == "magicpig"``,
  ``name != 'full'``, ``m in ("topk", "oracle")``, ``s.startswith("magicpig")``, ``df["method"].isin(["topk"])``;
* ``isinstance(x, C)`` with a registered method or layer class C (or a subclass of one, e.g. ``DSOffloadLayer``),
  outside the module that defines C;
* a module constant bound to such a literal (``REFERENCE = "full"``), the way to compare with it unseen.

A method's own module and the system layers' modules may name themselves; the registries hold the names by
design.  Code specific to one paper's table or figure (``report/tables.py``, ``report/figures/``) selects that
method's runs by its class's ``name`` attribute (``MagicPIG.name``), which this search does not flag: such a line
names the class it depends on, and renaming the method moves it.

Strings equal to a method name that are not a method name (a channel type "random", a benchmark label) are not
flagged unless compared as above; ``EXPECTED_HITS`` lists any such comparison with the reason it is not a
method's name (empty today).
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from sparse_eval.methods import METHODS
from sparse_eval.system.layers import SYSTEM_LAYERS

PACKAGE = Path(__file__).resolve().parents[2] / "sparse_eval"
REGISTRIES = {"methods/registry.py", "system/layers/registry.py", "tasks/base.py", "discovery.py"}
# (file relative to the package, the literal) -> why this comparison is not about a method's name
EXPECTED_HITS: dict[tuple[str, str], str] = {}


def _module_file(cls: type) -> str:
    return Path(inspect.getfile(cls)).resolve().relative_to(PACKAGE).as_posix()


def _classes() -> dict[str, str]:
    """Registered method and layer classes and their subclasses defined in the package: name -> defining file."""
    out: dict[str, str] = {}
    todo = list(METHODS.values()) + list(SYSTEM_LAYERS.values())
    while todo:
        cls = todo.pop()
        try:
            out[cls.__name__] = _module_file(cls)
        except ValueError:  # a user's plugin outside the package
            continue
        todo += cls.__subclasses__()
    return out


def _names() -> set[str]:
    layers = {getattr(c, "kind", None) for c in SYSTEM_LAYERS.values()} | set(SYSTEM_LAYERS)
    layers |= {getattr(s, "kind", None) for c in SYSTEM_LAYERS.values() for s in c.__subclasses__()}
    return (set(METHODS) | layers) - {None}


def _own_files() -> set[str]:
    """The methods' own modules and every module of the system layers: they may name themselves."""
    own = {_module_file(c) for c in METHODS.values() if c.__module__.startswith("sparse_eval.")}
    return own | {p.relative_to(PACKAGE).as_posix() for p in (PACKAGE / "system" / "layers").glob("*.py")}


def _strings(node: ast.AST) -> list[str]:
    """The string constants of a literal or of a tuple / list / set of literals."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def name_branches(tree: ast.AST, names: set[str], classes: dict[str, str], path: str) -> list[tuple[int, str]]:
    hits = []
    for node in getattr(tree, "body", []):  # module constants
        value = getattr(node, "value", None) if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
        if isinstance(value, ast.Constant) and value.value in names:  # a plain string, not a table of names
            hits.append((node.lineno, f"constant {value.value!r}"))
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                hits += [(node.lineno, s) for s in _strings(side) if s in names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("startswith", "endswith", "isin")
        ):
            hits += [(node.lineno, s) for a in node.args for s in _strings(a) if s in names]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "isinstance"
            and len(node.args) == 2
        ):
            kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            for k in kinds:
                name = k.attr if isinstance(k, ast.Attribute) else k.id if isinstance(k, ast.Name) else None
                if name in classes and classes[name] != path:
                    hits.append((node.lineno, f"isinstance(..., {name})"))
    return hits


def test_generic_code_never_branches_on_a_method_name():
    names, classes, own = _names(), _classes(), _own_files()
    assert {"full", "topk", "magicpig", "double_sparsity", "ds_offload"} <= names  # the search knows the names
    found = {}
    for p in sorted(PACKAGE.rglob("*.py")):
        rel = p.relative_to(PACKAGE).as_posix()
        if rel in own or rel in REGISTRIES:
            continue
        for line, what in name_branches(ast.parse(p.read_text(), rel), names, classes, rel):
            if (rel, what) not in EXPECTED_HITS:
                found.setdefault(rel, []).append(f"line {line}: {what}")
    assert not found, f"generic code branching on a method's name (ask the method class instead): {found}"


def test_the_search_finds_the_forms_it_looks_for():
    src = """
if method == "magicpig": pass
if r["method"] != "full": pass
if name in ("topk", "oracle"): pass
if name.startswith("magicpig"): pass
d = df[df["method"].isin(["quest"])]
if isinstance(layer, DSOffloadLayer): pass
if channel_type == "qk" or ct == "random": pass
x = {"magicpig": 1}
REFERENCE = "full"
"""
    names = {"magicpig", "full", "topk", "oracle", "quest"}
    hits = name_branches(ast.parse(src), names, {"DSOffloadLayer": "system/layers/ds.py"}, "report/x.py")
    assert sorted(h[1] for h in hits) == sorted(
        [
            "magicpig",
            "full",
            "topk",
            "oracle",
            "magicpig",
            "quest",
            "isinstance(..., DSOffloadLayer)",
            "constant 'full'",
        ]
    )
