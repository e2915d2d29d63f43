"""The package, tests, scripts and benchmarks pass ``ruff check`` with the rules of pyproject.toml ([tool.ruff.lint]:
syntax errors and pyflakes).  ruff is in the test extra, so CI runs this check."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    proc = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", "sparse_eval", "tests",
                           "scripts", "benchmarks"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
