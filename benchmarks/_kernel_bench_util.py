"""Helpers shared by bench_kernels.py and bench_cpu_attention.py: hardware record, timing, output files.

No dependency on sparse_eval (the GPU machine has no hydra/omegaconf).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch


def cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def physical_cores() -> int | None:
    """Distinct (physical id, core id) pairs of /proc/cpuinfo (None if unreadable)."""
    try:
        pairs, phys, core = set(), None, None
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("physical id"):
                    phys = line.split(":")[1].strip()
                elif line.startswith("core id"):
                    core = line.split(":")[1].strip()
                elif not line.strip():
                    if core is not None:
                        pairs.add((phys, core))
                    phys = core = None
        return len(pairs) or None
    except OSError:
        return None


def l3_bytes() -> int | None:
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    best = None
    for idx in base.glob("index*"):
        try:
            if (idx / "level").read_text().strip() == "3":
                txt = (idx / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(txt[-1], 1)
                best = int(txt.rstrip("KMG")) * mult
        except (OSError, ValueError):
            continue
    return best


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_model": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "physical_cores": physical_cores(),
        "l3_bytes_per_socket": l3_bytes(),
        "torch_threads": torch.get_num_threads(),
    }
    try:
        info["torch_cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    except Exception:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(
            gpu_name=p.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_bytes=p.total_memory,
            gpu_sms=p.multi_processor_count,
            cuda=torch.version.cuda,
        )
    for mod in ("triton", "numba"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:
            info[mod] = None
    return info


def time_cpu(
    fn: Callable[[], Any], warmup: int, reps: int, before: Callable[[], Any] | None = None
) -> dict[str, float]:
    """Median / min / max wall time in ms of ``fn`` (``before`` runs untimed ahead of each call, e.g. a cache
    flush)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    ts = []
    for _ in range(reps):
        if before:
            before()
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "reps": reps}


def time_cuda(
    fn: Callable[[], Any], warmup: int, reps: int, before: Callable[[], Any] | None = None
) -> dict[str, float]:
    """Median / min / max in ms with CUDA events around each call (``before`` runs untimed ahead of it)."""
    for _ in range(warmup):
        if before:
            before()
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        if before:
            before()
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return {"median_ms": statistics.median(ts), "min_ms": min(ts), "max_ms": max(ts), "reps": reps}


def write_json(out: Path, name: str, payload: Any) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / name
    path.write_text(json.dumps(payload, indent=1, default=str))
    return path


def print_table(rows: list[dict[str, Any]], cols: list[tuple[str, str, str]]) -> str:
    """cols: (key, header, format).  Returns and prints a plain-text table."""
    head = [h for _, h, _ in cols]
    body = []
    for r in rows:
        line = []
        for key, _, fmt in cols:
            val = r.get(key)
            line.append("-" if val is None else (format(val, fmt) if fmt else str(val)))
        body.append(line)
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    text = "  ".join(h.rjust(w) for h, w in zip(head, widths)) + "\n"
    text += "\n".join("  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body)
    print(text)
    return text
