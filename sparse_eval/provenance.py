"""Where a result came from: git commit, library versions and hardware, written to each run's ``meta.json``."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

PACKAGE_DIR = Path(__file__).resolve().parent


def git_commit() -> dict[str, Any]:
    try:
        root = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "--show-toplevel"], capture_output=True, text=True, timeout=10)
        if root.returncode:
            return {"commit": None}
        sha = subprocess.run(["git", "-C", str(PACKAGE_DIR), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(PACKAGE_DIR), "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10).stdout.strip()
        return {"commit": sha or None, "dirty": bool(dirty)}
    except (OSError, subprocess.SubprocessError):
        return {"commit": None}


def hardware() -> dict[str, Any]:
    import torch

    info: dict[str, Any] = {"platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
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
    for pkg in ("sparse_eval", "torch", "transformers", "hydra-core", "omegaconf", "datasets", "lm_eval", "triton", "numba"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def provenance() -> dict[str, Any]:
    return {"git": git_commit(), "versions": versions(), "hardware": hardware(), "argv": sys.argv,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
