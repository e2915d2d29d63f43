"""The plotting notebooks execute top to bottom (on the results fixture / the shipped model) and are stored
without outputs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

REPO = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((REPO / "notebooks").glob("*.ipynb"))
FIXTURE = REPO / "tests" / "fixtures" / "results" / "runs"


def test_notebooks_exist_and_are_stored_without_outputs():
    assert {p.name for p in NOTEBOOKS} >= {"results_overview.ipynb", "attention_analyses.ipynb"}
    for p in NOTEBOOKS:
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{p.name} is stored with outputs"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path, tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSE_EVAL_RESULTS", str(FIXTURE))
    monkeypatch.setenv("SPARSE_EVAL_REPORT_OUT", str(tmp_path / "report"))
    monkeypatch.setenv("SPARSE_EVAL_ANALYSIS_OUT", str(tmp_path / "analysis"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    )
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.get("output_type") == "error"]
    assert not errors


@pytest.mark.slow
def test_results_overview_runs_on_any_runs_folder(tmp_path, monkeypatch):
    """On real results of any task (here two WikiText runs of the shipped model: no RULER, no paper table), not only
    on the fixture's MagicPIG RULER runs: it used to stop with StopIteration looking for MagicPIG Table 3."""
    import subprocess
    import sys

    env = dict(os.environ, SPARSE_EVAL_RUNS_DIR=str(tmp_path / "runs"), HF_HUB_OFFLINE="1", WANDB_MODE="disabled")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    subprocess.run(
        [sys.executable, "-m", "sparse_eval", "-m", "method=full,topk", "task.num_samples=2", "task.window=64"],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=600,
    )
    monkeypatch.setenv("SPARSE_EVAL_RESULTS", str(tmp_path / "runs"))
    monkeypatch.setenv("SPARSE_EVAL_REPORT_OUT", str(tmp_path / "report"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    path = REPO / "notebooks" / "results_overview.ipynb"
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()  # raises CellExecutionError on the first failing cell
