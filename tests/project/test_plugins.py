"""Registries fill themselves (sparse_eval.discovery): a module dropped into a package registers itself, and a
user's method registers from the user's own package (``SPARSE_EVAL_PLUGINS`` or an entry point) and is selected
with ``method=<name>`` like a shipped one."""

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sparse_eval import discovery
from sparse_eval.methods import METHODS, attend
from sparse_eval.methods import registry as method_registry

REPO = Path(__file__).resolve().parents[2]
PLUGINS = REPO / "tests" / "fixtures" / "plugins"  # holds the package sparse_eval_tiny_plugin


def _env(**extra):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(PLUGINS), os.environ.get("PYTHONPATH", "")])
    return env


def test_a_module_dropped_into_a_package_registers_itself(tmp_path, monkeypatch):
    pkg = tmp_path / "droppkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("FOUND = []\n")
    (pkg / "base.py").write_text("raise AssertionError('skipped modules are not imported')\n")
    (pkg / "_private.py").write_text("raise AssertionError('private modules are not imported')\n")
    (pkg / "newmethod.py").write_text("from . import FOUND\nFOUND.append('newmethod')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert discovery.import_package_modules("droppkg", skip=("base",)) == ["newmethod"]
    assert sys.modules["droppkg"].FOUND == ["newmethod"]
    for m in [m for m in sys.modules if m == "droppkg" or m.startswith("droppkg.")]:
        monkeypatch.delitem(sys.modules, m)


def test_shipped_modules_are_registered_without_an_import_list():
    from sparse_eval.system.layers import SYSTEM_LAYERS
    from sparse_eval.tasks import TASKS

    methods = {p.stem for p in (REPO / "sparse_eval" / "methods").glob("*.py")}
    # every module of the folder that defines a method class registered it (random.py: counter-based draws)
    assert {cls.__module__.rsplit(".", 1)[1] for cls in METHODS.values()} <= methods
    assert {"full", "topk", "oracle", "magicpig", "quest", "double_sparsity"} <= set(METHODS)
    assert {"full", "double_sparsity", "quest", "magicpig"} <= set(SYSTEM_LAYERS)
    assert {"wikitext", "ruler", "kv_retrieval", "longbench", "lm_eval"} <= set(TASKS)


def test_a_methods_rules_are_exported_from_one_place():
    """What a method of one's own needs comes from ``sparse_eval.methods`` and is what the shipped methods use: the
    token budget (TopK, oracle sampling, Quest, DS), the k highest keys with ties by index, the counter-based draws."""
    import torch

    import sparse_eval.methods as api
    from sparse_eval.methods import base, quest, topk
    from sparse_eval.methods import random as draws

    assert api.resolve_budget is base.resolve_budget and api.token_budget is quest.token_budget
    assert api.topk_mask is topk.topk_mask and api.uniforms is draws.uniforms
    # a budgeted method names its budget's field; the base checks it at start and resolves it per row
    for name in ("topk", "oracle", "quest", "double_sparsity", "h2o", "snapkv"):
        cls = api.METHODS[name]
        assert cls.budget_field and cls.budget_tokens is base.Method.budget_tokens, name
    rules = {"resolve_budget", "token_budget", "budget_bound", "check_budget", "topk_mask", "uniforms"}
    assert rules <= set(api.__all__)
    score = torch.tensor([[1.0, 3.0, 3.0, 2.0, float("-inf")]])
    k = api.resolve_budget(0.5, torch.tensor([4]))  # ⌊0.5 · 4⌋ = 2 keys of the row's 4 valid ones
    assert api.topk_mask(score, k.view(1, 1)).tolist() == [[False, True, True, False, False]]
    u = api.uniforms(0, torch.arange(3))
    assert u.dtype == torch.float64 and torch.equal(u, api.uniforms(0, torch.arange(3))) and ((u > 0) & (u < 1)).all()


def test_plugin_from_the_environment_variable_runs_end_to_end(tmp_path):
    """``SPARSE_EVAL_PLUGINS=pkg.module``: the method registers, ``method=<name>`` selects it with its dataclass's
    defaults (no YAML of its own), its options are overridable and checked, and the run records it."""
    env = _env(SPARSE_EVAL_PLUGINS="sparse_eval_tiny_plugin.strided")
    cmd = [
        sys.executable,
        "-m",
        "sparse_eval",
        "method=strided",
        "method.stride=3",
        "task.num_samples=1",
        "task.window=256",
        f"paths.runs_dir={tmp_path}",
    ]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    (summary,) = tmp_path.glob("wikitext/stories260k/strided-*/summary.json")
    s = json.loads(summary.read_text())
    assert s["method"] == "strided" and s["method_config"]["stride"] == 3 and s["failed"] == 0
    assert 0 < s["cost2"] < 1 and s["cost1"] == 0 and s["est_error"] > 0
    bad = subprocess.run(
        cmd[:4] + ["method.stride=oops", f"paths.runs_dir={tmp_path}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2 and "stride" in bad.stderr  # the dataclass is its schema
    # the user's own YAML (defaults: strided_schema, stride: 4), from the user's package on Hydra's search path
    own = subprocess.run(
        cmd[:3] + ["hydra.searchpath=[pkg://sparse_eval_tiny_plugin.conf]", "method=strided_4", *cmd[5:]],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert own.returncode == 0, own.stderr[-3000:]
    assert len(list(tmp_path.glob("wikitext/stories260k/strided-stride=4-*/summary.json"))) == 1


def test_a_plugin_that_cannot_be_imported_is_named(tmp_path):
    env = _env(SPARSE_EVAL_PLUGINS="sparse_eval_tiny_plugin.absent")
    res = subprocess.run(
        [sys.executable, "-c", "import sparse_eval.methods"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode != 0
    assert "plugin SPARSE_EVAL_PLUGINS=sparse_eval_tiny_plugin.absent could not be imported" in res.stderr


@pytest.fixture
def clean_registry(monkeypatch):
    """Methods registered in the test are dropped afterwards (the registry is the process's)."""
    monkeypatch.syspath_prepend(str(PLUGINS))
    monkeypatch.setattr(discovery, "_loaded", set())
    before = dict(METHODS)
    yield
    for name in set(METHODS) - set(before):
        del method_registry.METHODS[name]
    for m in [m for m in sys.modules if m.startswith("sparse_eval_tiny_plugin")]:
        del sys.modules[m]


def test_entry_points_register_a_module_or_a_class(clean_registry, monkeypatch):
    from sparse_eval.methods import Method, register

    eps = [
        importlib.metadata.EntryPoint("strided", "sparse_eval_tiny_plugin.strided", discovery.ENTRY_POINT_GROUP),
        importlib.metadata.EntryPoint(
            "every_key", "sparse_eval_tiny_plugin.unregistered:EveryKey", discovery.ENTRY_POINT_GROUP
        ),
    ]
    monkeypatch.setattr(discovery, "_entry_points", lambda: eps)
    got = discovery.load_plugins()
    assert discovery.load_plugins() == []  # each once
    for obj in got:  # what ``sparse_eval.methods`` does with them at import
        if isinstance(obj, type) and issubclass(obj, Method) and METHODS.get(obj.name) is not obj:
            register(obj)
    assert {"strided", "every_key"} <= set(METHODS)
    import torch

    q, k = torch.randn(1, 2, 1, 8), torch.randn(1, 2, 300, 8)
    _, stats = attend("every_key", q, k, k, sink=4, local=8)
    assert float(stats["cost2"].min()) == 1.0
    _, stats = attend("strided", q, k, k, sink=0, local=0, stride=2)
    assert float(stats["cost2"].mean()) == pytest.approx(0.5)
