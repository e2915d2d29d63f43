"""``provenance.git_commit``: a dirty checkout is identified by the hash of its difference from the commit."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from sparse_eval.identity.provenance import PROVENANCE_VERSION, git_commit

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(repo, *args):
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args], check=True, capture_output=True
    )


def test_clean_tree_has_no_hash_and_every_change_moves_it(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / "a.py").write_text("x = 1\n")
    (repo / ".gitignore").write_text("ignored/\n")
    _git(repo, "add", "a.py", ".gitignore")
    _git(repo, "commit", "-q", "-m", "one")
    clean = git_commit(repo / "a.py")
    assert clean["version"] == PROVENANCE_VERSION and re.fullmatch(r"[0-9a-f]{40}", clean["commit"])
    assert clean["dirty"] is False and "diff_sha256" not in clean

    (repo / "ignored").mkdir()
    (repo / "ignored" / "big.bin").write_bytes(b"\0" * 100)  # ignored files are not a difference
    assert git_commit(repo) == clean

    (repo / "a.py").write_text("x = 2\n")
    one = git_commit(repo)
    assert one["dirty"] is True and re.fullmatch(r"[0-9a-f]{64}", one["diff_sha256"])
    assert one["changed"] == ["a.py"] and one["changed_count"] == 1 and one["commit"] == clean["commit"]
    assert git_commit(repo) == one  # the same difference, the same hash
    _git(repo, "add", "a.py")  # staged or not: the same difference from the commit
    assert git_commit(repo)["diff_sha256"] == one["diff_sha256"]

    (repo / "a.py").write_text("x = 3\n")
    assert git_commit(repo)["diff_sha256"] != one["diff_sha256"]
    (repo / "a.py").write_text("x = 2\n")
    (repo / "new.py").write_text("y = 1\n")  # an untracked file that git does not ignore
    two = git_commit(repo)
    assert two["diff_sha256"] != one["diff_sha256"] and two["changed"] == ["a.py", "new.py"]
    (repo / "new.py").write_text("y = 2\n")  # its content, not only its name
    assert git_commit(repo)["diff_sha256"] != two["diff_sha256"]

    (repo / "a.py").write_text("x = 1\n")
    (repo / "new.py").unlink()
    _git(repo, "reset", "-q")
    assert git_commit(repo) == clean


def test_outside_git(tmp_path):
    assert git_commit(tmp_path) == {"commit": None}
