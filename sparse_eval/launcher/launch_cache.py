"""The launch cache: a relaunch whose runs are all finished is answered from their saved results at once, before
the model is loaded or the task's samples are made.

A run's directory is named by its identity (``experiment.Experiment.identity``), which needs the loaded model (its
file fingerprints, dtype, depth) and the data files the task read while building samples: deciding that a run is
finished the normal way costs a model load and the samples.  After a launch whose every run finished, this module
writes ``<runs_dir>/.launch/<key>.json`` holding the run directories it produced and every file whose content
entered an identity (the model's files, the task's data files, a method's external inputs such as Double
Sparsity's calibration file: whatever ``fingerprint.file_sha256`` hashed during the launch), each with its size
and mtime, plus the folders those files lie in, ``paths.data_dir`` and its subfolders, and Double Sparsity's
calibration folders, stamped or marked absent (a file added there could change which files are read).

``key`` is the sha256 of what else decides the identities: the whole composed config (less the output-only
``print_table``), the package's source and ``conf/`` (any edit there is a new key, but for ``sparse_eval/report/``,
which only reads results and is never imported by a run), the versions of Python and the
libraries that load the model, the environment variables that say where inputs are looked for, and, where
``model.dtype=auto`` picks by device, whether CUDA is available.  A relaunch reuses the entry only when every recorded
file and folder is unchanged (its recorded size and mtime, or, where the mtime moved as a copy or checkout moves it,
its recorded sha256 (a file) or entry names (a folder)) and every run directory is ``done`` (``status.run_state``);
anything else (a changed or missing file, a deleted run directory, an incomplete, failed or running run, an
unreadable entry) takes the normal path, which finds the same results by
their identity.  Being conservative costs a cache miss, never a wrong skip.

No entry is written for a model from the hub (no local files to stamp), a method input without a file, data the
task fetched from the hub, ``logger`` other than ``none`` (a relaunch logs again), remote model code
(``model.trust_remote_code``: files the fingerprints do not cover), or a tokenizer given by ``model.tokenizer``
(its files are not fingerprinted; its behaviour is, in the identity, but only once it is loaded).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Iterable

from ..hydra_support import CONF_DIR
from ..results.store import SUMMARY_FILE, read_json, write_json

log = logging.getLogger("sparse_eval")

LAUNCH_DIR = ".launch"  # under paths.runs_dir
ENTRY_VERSION = 1
OUTPUT_ONLY_KEYS = ("print_table", "hydra")  # settings that change what is printed, never a result
PACKAGE_DIR = Path(__file__).resolve().parents[1]  # sparse_eval/, whose every module may compute a result
# package folders that only read finished results (tables and figures) and are never imported by a run: an edit
# there changes no result, so it leaves finished launches cached
OUTPUT_ONLY_SOURCES = ("report",)
VERSIONED = (
    "torch",
    "transformers",
    "tokenizers",
    "sentencepiece",
    "safetensors",
    "gguf",
    "numpy",
    "hydra-core",
    "omegaconf",
)
GPU_NODES = ("/dev/nvidiactl", "/dev/nvidia0", "/proc/driver/nvidia", "/dev/kfd", "/dev/dxg")
# environment that decides where inputs are looked for (Double Sparsity's user calibration folder first)
ENV_KEYS = ("SPARSE_EVAL_CALIBRATION_DIR", "XDG_DATA_HOME", "HOME")
_SOURCE_SHA: str | None = None


# -- the key ---------------------------------------------------------------------------------------------------


def source_sha256() -> str:
    """sha256 of every file of the package and of ``conf/`` (paths and contents; ``__pycache__`` and the
    output-only ``OUTPUT_ONLY_SOURCES`` left out): the version of the code that computes identities and results,
    and of the configs ``compare`` names."""
    global _SOURCE_SHA
    if _SOURCE_SHA is None:
        h = hashlib.sha256()
        skipped = [PACKAGE_DIR / d for d in OUTPUT_ONLY_SOURCES]
        for root in (PACKAGE_DIR, CONF_DIR):
            for p in sorted(root.rglob("*")):
                if "__pycache__" in p.parts or not p.is_file() or any(p.is_relative_to(d) for d in skipped):
                    continue
                h.update(str(p.relative_to(root.parent)).encode() + b"\0")
                h.update(hashlib.sha256(p.read_bytes()).digest())
        _SOURCE_SHA = h.hexdigest()
    return _SOURCE_SHA


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def cuda_available() -> bool:
    """Whether ``model.device=auto`` picks CUDA here; without a GPU driver on the machine, answered without
    importing torch."""
    if not any(os.path.exists(p) for p in GPU_NODES):
        return False
    import torch

    return bool(torch.cuda.is_available())


def launch_key(plain: dict[str, Any]) -> str | None:
    """The cache key of a composed config (``OmegaConf.to_container(cfg, resolve=True)``); None when the launch
    is not cached (see the module docstring)."""
    logger = plain.get("logger") or {}
    model = plain.get("model") or {}
    if logger.get("name", "none") != "none" or model.get("trust_remote_code") or model.get("tokenizer"):
        return None
    config = {k: v for k, v in plain.items() if k not in OUTPUT_ONLY_KEYS}
    if not config.get("claims"):  # no claims declared: the key of the launches made before ``claims`` existed
        config.pop("claims", None)
    parts: dict[str, Any] = {
        "entry_version": ENTRY_VERSION,
        "config": config,
        "source": source_sha256(),
        "versions": _versions(),
        "env": {k: os.environ.get(k) for k in ENV_KEYS},
    }
    if model.get("dtype", "auto") == "auto" and model.get("device", "auto") == "auto":
        parts["cuda"] = cuda_available()
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def plain_config(cfg: Any) -> dict[str, Any] | None:
    """The composed config as plain data, interpolations resolved; None when it cannot be (no cache then)."""
    from omegaconf import DictConfig, OmegaConf

    if not isinstance(cfg, DictConfig):
        return None
    try:
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - an interpolation that only resolves inside Hydra: no cache, not an error
        return None


def entry_path(runs_dir: str | Path, key: str) -> Path:
    return Path(runs_dir).expanduser() / LAUNCH_DIR / f"{key}.json"


# -- stamps ----------------------------------------------------------------------------------------------------


def _stamp(path: str | Path) -> dict[str, Any] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _sha256(path: str | Path) -> str | None:
    """The file's sha256 (``fingerprint.file_sha256``: hashed once per new mtime, then cached), None if unreadable."""
    from ..identity.fingerprint import file_sha256

    try:
        return file_sha256(path)
    except OSError:
        return None


def _listing(path: str | Path) -> str | None:
    """sha256 of a folder's sorted entry names: what decides which files a launch finds there."""
    try:
        names = sorted(os.listdir(path))
    except OSError:
        return None
    return hashlib.sha256("\0".join(names).encode()).hexdigest()


def _same_content(s: dict[str, Any], now: dict[str, Any]) -> bool:
    """A file or folder whose mtime moved (a copy, a checkout, a sync to another machine) but whose content did
    not: a file of the recorded size and sha256, a folder with the recorded entry names."""
    if "sha256" in s:
        return now["size"] == s["size"] and _sha256(s["path"]) == s["sha256"]
    if "listing" in s:
        return _listing(s["path"]) == s["listing"]
    return False


def _unchanged(stamps: Iterable[dict[str, Any]]) -> str | None:
    """None when every stamp matches the file or folder now (one stamped ``absent`` must still be absent); else
    the first that does not.  Size and mtime are the fast test; where they moved, the content recorded beside
    them (a file's sha256, a folder's listing) decides."""
    for s in stamps:
        now = _stamp(s["path"])
        if s.get("absent"):
            if now is not None:
                return s["path"]
        elif now is None:
            return s["path"]
        elif (now["size"], now["mtime_ns"]) != (s["size"], s["mtime_ns"]) and not _same_content(s, now):
            return s["path"]
    return None


def search_dirs() -> list[str]:
    """Folders searched for inputs by name, where a file appearing changes what a run reads: Double Sparsity's
    calibration folders (the user's before the shipped one)."""
    from ..methods.double_sparsity import calibration_dirs

    return [str(d) for d in calibration_dirs()]


def watched_dirs(files: Iterable[str], data_dir: str | None) -> list[str]:
    """The folders whose listing could change which files a launch reads: each fingerprinted file's folder, and
    ``paths.data_dir`` with its subfolders (a task prefers a local file over the hub, or one candidate over
    another, when it appears)."""
    dirs = {str(Path(f).parent) for f in files}
    if data_dir:
        root = Path(data_dir).expanduser().resolve()
        if root.is_dir():
            dirs.add(str(root))
            dirs.update(str(d) for d in root.iterdir() if d.is_dir())
    return sorted(dirs)


# -- reuse -----------------------------------------------------------------------------------------------------


def finished(run_dirs: list[str]) -> list[dict[str, Any]] | None:
    """The saved summaries of ``run_dirs`` when every one is ``done``; None otherwise."""
    from ..results.status import run_state

    out = []
    for d in run_dirs:
        if run_state(Path(d))["state"] != "done":
            return None
        summary = read_json(Path(d) / SUMMARY_FILE)
        if not isinstance(summary, dict) or summary.get("run_dir") != d:
            return None
        out.append(summary)
    return out


def lookup(cfg: Any) -> list[dict[str, Any]] | None:
    """The summaries of a launch whose runs are all finished and whose inputs are unchanged (the launch cache);
    None when the launch must run the normal way."""
    plain = plain_config(cfg)
    key = launch_key(plain) if plain is not None else None
    if key is None:
        return None
    path = entry_path(plain["paths"]["runs_dir"], key)
    entry = read_json(path)
    if not isinstance(entry, dict) or entry.get("key") != key or not entry.get("run_dirs"):
        return None
    changed = _unchanged([*entry.get("files", []), *entry.get("dirs", [])])
    if changed is not None:
        log.info("launch cache: %s changed since %s; running the normal way", changed, path.name)
        return None
    summaries = finished(entry["run_dirs"])
    if summaries is None:
        log.info("launch cache: a run of %s is not done; running the normal way", path.name)
    return summaries


def reuse(cfg: Any) -> list[dict[str, Any]] | None:
    """``lookup``, and on a hit the table a normal relaunch prints (unless ``print_table=false``)."""
    summaries = lookup(cfg)
    if summaries is None:
        return None
    if cfg.get("print_table", True):
        from ..config import to_plain
        from ..results.results_table import print_results
        from ..tasks import build_task

        task = build_task(to_plain(cfg.task), data_dir=cfg.paths.data_dir)
        print_results(task, summaries, [(s["samples"], s["samples"]) for s in summaries])
    return summaries


# -- record ----------------------------------------------------------------------------------------------------


def cacheable(identities: list[dict[str, Any]], files: dict[str, dict[str, Any]], hub_reads: int) -> str | None:
    """None when a launch with these run identities, whose fingerprinted ``files`` are known, can be cached;
    else why not."""
    if hub_reads:
        return "the task read data from the hub"
    digests = {f["sha256"] for f in files.values()}
    for ident in identities:
        if "files_sha256" not in (ident.get("model") or {}).get("fingerprint", {}):
            return "the model has no local files"
        for what in ("inputs", "data"):
            for name, sha in (ident.get(what) or {}).items():
                if sha not in digests:
                    return f"{what} {name} is not a file fingerprinted in this launch"
    return None


def record(
    cfg: Any,
    identities: list[dict[str, Any]],
    summaries: list[dict[str, Any]],
    files: dict[str, dict[str, Any]],
    hub_reads: int = 0,
    started_ns: int | None = None,
) -> Path | None:
    """After a launch whose every run finished: its cache entry (written whole: a temporary file renamed), or None
    where it cannot be cached or the runs dir cannot be written.  ``files``: what ``fingerprint.recording``
    collected during the launch; ``started_ns``: when it started (``time.time_ns()``): a file or watched folder
    modified since then, or changed since it was fingerprinted, leaves the launch unrecorded."""
    plain = plain_config(cfg)
    key = launch_key(plain) if plain is not None else None
    if key is None or not summaries:
        return None
    why = cacheable(identities, files, hub_reads)
    if why is not None:
        log.info("launch cache: not recorded (%s)", why)
        return None
    run_dirs = [s["run_dir"] for s in summaries]
    if finished(run_dirs) is None:  # a run with failed samples: the next launch retries them
        return None
    stamps = [
        dict(path=p, size=f["size"], mtime_ns=f["mtime_ns"], sha256=f["sha256"]) for p, f in sorted(files.items())
    ]
    dirs = [s for s in (_stamp(d) for d in watched_dirs(files, plain["paths"].get("data_dir"))) if s]
    dirs += [_stamp(d) or {"path": d, "absent": True} for d in search_dirs() if d not in {x["path"] for x in dirs}]
    for d in dirs:
        if not d.get("absent"):
            d["listing"] = _listing(d["path"])
    changed = _unchanged(stamps)
    moved = [s["path"] for s in stamps + dirs if started_ns is not None and s.get("mtime_ns", 0) >= started_ns]
    if changed is not None or moved:
        log.info("launch cache: not recorded (%s changed during the launch)", changed or moved[0])
        return None
    entry = {
        "key": key,
        "version": ENTRY_VERSION,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "run_dirs": run_dirs,
        "files": stamps,
        "dirs": dirs,
    }
    path = entry_path(plain["paths"]["runs_dir"], key)
    try:
        write_json(path, entry)
    except OSError as exc:  # a read-only store: the next launch only takes the normal path
        log.info("launch cache: could not write %s (%s)", path, exc)
        return None
    return path
