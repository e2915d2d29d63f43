"""Start-up: ``python -m sparse_eval --help``, ``sparse_eval.results.status`` and ``sparse_eval.results.collect``
import neither torch nor transformers (checked with ``-X importtime`` in a fresh interpreter)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers")


def heavy_imports(*args: str, cwd: Path = REPO) -> tuple[list[str], subprocess.CompletedProcess]:
    """The torch / transformers modules a fresh ``python -X importtime <args>`` imported, and its result."""
    env = dict(
        os.environ, HF_HUB_OFFLINE="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    )
    res = subprocess.run(
        [sys.executable, "-X", "importtime", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )
    names = [line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if line.startswith("import time:")]
    return [n for n in names if n.split(".")[0] in HEAVY], res


@pytest.mark.parametrize(
    "args",
    [
        ["-m", "sparse_eval", "--help"],
        ["-m", "sparse_eval.results.status", "{runs}"],
        ["-m", "sparse_eval.results.collect", "{runs}", "--quiet"],
    ],
    ids=["help", "status", "collect"],
)
def test_no_torch_at_start_up(tmp_path, args):
    runs = tmp_path / "runs"
    runs.mkdir()
    heavy, res = heavy_imports(*[a.format(runs=runs) for a in args], cwd=tmp_path)
    assert not heavy, f"{' '.join(args)} imported {heavy[:5]}"
    if args[-1] == "--help":
        assert res.returncode == 0 and "method:" in res.stdout, res.stderr[-2000:]


def test_status_reads_runs_without_torch(tmp_path):
    """A run directory written by a run (label from the method's own fields) is listed without torch."""
    from sparse_eval.results.store import record_start, run_dir_for, write_progress

    ident = {
        "model": {"name": "m"},
        "task": {"name": "wikitext"},
        "seed": 0,
        "method": {
            "name": "topk",
            "budget": 0.06,
            "sink": 4,
            "local": 64,
            "dense_layers": [0, 1],
            "sliding_layers": "dense",
            "gqa": "query_head",
            "seed": 0,
        },
    }
    d = run_dir_for(tmp_path / "runs", ident)
    record_start(d, ident)
    write_progress(d, 4, 0)
    heavy, res = heavy_imports("-m", "sparse_eval.results.status", str(tmp_path / "runs"), cwd=tmp_path)
    assert not heavy and res.returncode == 0 and "topk-budget=0.06" in res.stdout, res.stderr[-2000:]


def test_base_method_fields_match_the_method_config():
    """``store`` spells out the shared method fields (so it need not import the methods); they must stay equal."""
    from sparse_eval.methods.base import MethodConfig
    from sparse_eval.results.store import BASE_METHOD_FIELDS

    assert BASE_METHOD_FIELDS == tuple(f.name for f in dataclasses.fields(MethodConfig)), (
        "update store.BASE_METHOD_FIELDS to the fields of methods.base.MethodConfig"
    )


def test_static_dense_flags_match_the_registry():
    """``method_facts`` reads the shipped methods' ``dense`` from their source: it must agree with the classes."""
    from sparse_eval.method_facts import shipped_dense_flags
    from sparse_eval.methods import METHODS

    shipped = {name: cls.dense for name, cls in METHODS.items() if cls.__module__.startswith("sparse_eval.methods.")}
    assert shipped_dense_flags() == shipped  # (a user's plugin method, registered by other tests, is not shipped)
