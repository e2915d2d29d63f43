"""Where a result came from: git commit, library versions and hardware, written to each run's ``meta.json``.

``git_commit()`` (``version`` 2) says whether the checkout differs from its commit and, when it does, identifies
the difference: ``diff_sha256`` is the sha256 of ``git diff HEAD --binary`` (staged and unstaged changes of
tracked files) followed by the path and sha256 of every untracked file git does not ignore, so two runs with the
same commit and the same ``diff_sha256`` ran the same code.  ``changed`` lists the paths (the first
``MAX_CHANGED``).  Records written before version 2 (no ``version`` key) counted only tracked changes as dirty
and carry no hash.
"""

from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent
PROVENANCE_VERSION = 2  # the ``version`` of ``git_commit()``'s record (1: no key, no diff hash)
MAX_CHANGED = 100  # changed paths listed in the record (all of them enter the hash)


def _git(where: Path, *args: str, text: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(where), *args], capture_output=True, text=text, timeout=60)


def _file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:  # unreadable (a socket, a broken link): its name and the reason still enter the hash
        return f"unreadable: {type(exc).__name__}"
    return h.hexdigest()


def git_commit(where: Path | str = PACKAGE_DIR) -> dict[str, Any]:
    """{version, commit, dirty, and when dirty: diff_sha256, changed, changed_count} of the git checkout holding
    ``where`` (default: this package); {"commit": None} outside git."""
    where = Path(where)
    if where.is_file():
        where = where.parent
    try:
        root = _git(where, "rev-parse", "--show-toplevel")
        if root.returncode:
            return {"commit": None}
        top = Path(root.stdout.strip())
        sha = _git(top, "rev-parse", "HEAD").stdout.strip()
        diff = _git(top, "diff", "HEAD", "--binary", "--no-color", "--no-ext-diff", text=False).stdout
        tracked = [p for p in _git(top, "diff", "HEAD", "--name-only", "-z").stdout.split("\0") if p]
        untracked = sorted(
            p for p in _git(top, "ls-files", "--others", "--exclude-standard", "-z").stdout.split("\0") if p
        )
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}
    out: dict[str, Any] = {
        "version": PROVENANCE_VERSION,
        "commit": sha or None,
        "dirty": bool(tracked or untracked or diff),
    }
    if out["dirty"]:
        h = hashlib.sha256(diff)
        for p in untracked:
            h.update(f"\0untracked\0{p}\0{_file_sha256(top / p)}".encode("utf-8"))
        changed = sorted(set(tracked) | set(untracked))
        out.update(diff_sha256=h.hexdigest(), changed=changed[:MAX_CHANGED], changed_count=len(changed))
    return out


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if hasattr(os, "sched_getaffinity"):
        info["affinity"] = len(os.sched_getaffinity(0))
    try:
        info["loadavg_1_5_15"] = list(os.getloadavg())
    except OSError:
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in (
        "sparse_eval",
        "torch",
        "transformers",
        "hydra-core",
        "omegaconf",
        "datasets",
        "lm_eval",
        "triton",
        "numba",
    ):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance() -> dict[str, Any]:
    return {
        "git": git_commit(),
        "versions": versions(),
        "hardware": hardware(),
        "argv": sys.argv,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
