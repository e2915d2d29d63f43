"""The results store: one directory per run, derived from its identity (so a re-launch finds its own results).

A run's identity (``runner.Experiment.identity``) is everything that can change its result: the model as loaded
(``models.loading.model_identity``: source, revision, GGUF file, dtype, config and file sha256s), the method's
config, the sha256 of the files the method reads (``inputs``), the task, the evaluation settings and the seed.
``<model>`` below is the loaded model's label (``models.loading.model_label``), not a key of the identity.

    <runs_dir>/<task>/<model>/<method>-<key=value...>-<hash>/
        config.yaml      the run's identity (what the hash is of)
        meta.json        git commit, library versions, hardware, command line, start time
        samples.jsonl    one JSON line per finished sample, appended and flushed as it finishes
        summary.json     the run's metrics, costs and settings (+ per-layer / per-head aggregates)
        summary.csv      the same as one flat row
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from .methods.base import MethodConfig

PACKAGE_DIR = Path(__file__).resolve().parent


def config_hash(obj: Any) -> str:
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "_".join(_short(x) for x in v)
    return str(v).replace("/", "_")


def method_label(method: dict[str, Any]) -> str:
    """name plus the method's own parameters (not the shared sink/local/dense/gqa/seed), e.g. ``magicpig-K=10-L=150``."""
    base = {f.name for f in dataclasses.fields(MethodConfig)}
    parts = [f"{k}={_short(v)}" for k, v in method.items() if k not in base and v is not None and not isinstance(v, dict)]
    return "-".join([method["name"], *parts])


def run_dir_for(runs_dir: str | Path, identity: dict[str, Any]) -> Path:
    """identity: everything that decides the results (model as loaded, method, its inputs, task, eval, seed)."""
    label = method_label(identity["method"])
    name = f"{label}-{config_hash(identity)}"
    return Path(runs_dir).expanduser() / _short(identity["task"]["name"]) / _short(identity["model"]["name"]) / name


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


def finite(obj: Any) -> Any:
    """NaN/inf never reach a result file: they become null (the caller flags where)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


class SampleLog:
    """Append-only JSONL of finished samples; tolerant of a last line cut short by a kill."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        if path.exists():
            good, bad = [], 0
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                    good.append(line)
                    self.records[rec["id"]] = rec
                except (json.JSONDecodeError, KeyError, TypeError):
                    bad += 1
            if bad:  # rewrite without the torn line(s) so appends stay valid JSONL
                tmp = path.with_suffix(".tmp")
                tmp.write_text("".join(line + "\n" for line in good), encoding="utf-8")
                os.replace(tmp, path)

    def done(self, sample_id: str, rerun_failed: bool = False) -> bool:
        rec = self.records.get(sample_id)
        return rec is not None and not (rerun_failed and rec.get("status") != "ok")

    def drop_failed(self) -> None:
        failed = [k for k, r in self.records.items() if r.get("status") != "ok"]
        if not failed:
            return
        for k in failed:
            del self.records[k]
        self.rewrite(self.records.values())

    def rewrite(self, records: Iterable[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in records), encoding="utf-8")
        os.replace(tmp, self.path)

    def append(self, record: dict[str, Any]) -> None:
        record = finite(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, sort_keys=True) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.records[record["id"]] = record


def write_summary(run_dir: Path, summary: dict[str, Any]) -> None:
    import pandas as pd

    summary = finite(summary)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    flat = {k: v for k, v in _flatten(summary).items() if "per_layer" not in k}
    pd.DataFrame([flat]).to_csv(run_dir / "summary.csv", index=False)


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        elif isinstance(v, (list, tuple)):
            out[key] = json.dumps(v)
        else:
            out[key] = v
    return out
