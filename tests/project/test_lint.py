"""The package, tests, scripts and benchmarks pass ``ruff check`` with the rules of pyproject.toml ([tool.ruff.lint]:
syntax errors, pyflakes, lines of at most 120 characters, and in the package a function's complexity and statement
count) and are formatted as ``ruff format`` writes them.  ruff is in the test extra, so CI runs these checks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_ruff_check_is_clean():
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "check",
            "--output-format",
            "concise",
            "sparse_eval",
            "tests",
            "scripts",
            "benchmarks",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_ruff_format_leaves_every_file_unchanged():
    pytest.importorskip("ruff", reason="ruff is in the test extra: pip install -e '.[test]'")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "sparse_eval",
            "tests",
            "scripts",
            "benchmarks",
            "experiments",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, "run `ruff format .`:\n" + proc.stdout + proc.stderr
