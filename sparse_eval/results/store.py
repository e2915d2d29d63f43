"""The run store: one directory per run, derived from its identity (so a re-launch finds its own results), and
every file in it -- its layout, writing and reading, the lock, progress and failure records.

A run's identity (``experiment.Experiment.identity``) is everything that can change its result: the model as loaded
(``models.loading.model_identity``: source, revision, GGUF file, dtype, config and file sha256s), the method's
config, the sha256 of the files the method reads (``inputs``), the task, the evaluation settings and the seed.
``<model>`` below is the loaded model's label (``models.loading.model_label``), not a key of the identity.

    <runs_dir>/<task>/<model>/<method>-<key=value...>-<hash>/
        config.yaml      the run's identity (what the hash is of)
        meta.json        git commit, library versions, hardware, command line, start time (``provenance``), and
                         the same for each restart that added samples (``resumes``); each of these segments
                         also holds the run's sample count when it started and when it stopped (``done_at_start``,
                         ``done_at_end``; none at the end of a process that was killed)
        samples.jsonl    one JSON line per finished sample, appended and flushed as it finishes
        summary.json     the run's metrics, costs and settings (+ per-layer / per-head aggregates)
        summary.csv      the same as one flat row
        progress.json    written when a run (re)starts: expected sample count, start time, host, pid, Slurm job id
        failed.json      written when the run raised (error, traceback, host, Slurm job id); removed when it restarts
        .lock            held (flock) while a process runs it, so two jobs never append to one samples.jsonl

``python -m sparse_eval.results.status`` reads these files into a run's state; ``python -m
sparse_eval.results.collect`` into a table.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import math
import os
import re
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Iterable, Iterator

from ..identity.fingerprint import config_hash

log = logging.getLogger("sparse_eval")

CONFIG_FILE = "config.yaml"
META_FILE = "meta.json"
SAMPLES_FILE = "samples.jsonl"
SUMMARY_FILE = "summary.json"
SUMMARY_CSV = "summary.csv"
PROGRESS_FILE = "progress.json"
FAILED_FILE = "failed.json"
LOCK_FILE = ".lock"
# the fields every method config shares (``methods.base.MethodConfig``; a test keeps them equal), left out of a
# run's label: spelled out here so that ``status`` and ``collect`` import no torch
BASE_METHOD_FIELDS = ("name", "sink", "local", "dense_layers", "sliding_layers", "gqa", "seed")


# -- layout ----------------------------------------------------------------------------------------------------


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (list, tuple)):
        return "_".join(_short(x) for x in v)
    return str(v).replace("/", "_")


def method_label(method: dict[str, Any]) -> str:
    """name plus the method's own parameters (not the shared sink/local/dense/gqa/seed), e.g.
    ``magicpig-K=10-L=150``."""
    base = set(BASE_METHOD_FIELDS)
    parts = [
        f"{k}={_short(v)}" for k, v in method.items() if k not in base and v is not None and not isinstance(v, dict)
    ]
    return "-".join([method["name"], *parts])


def run_dir_for(runs_dir: str | Path, identity: dict[str, Any]) -> Path:
    """identity: everything that decides the results (model as loaded, method, its inputs, task, eval, seed)."""
    label = method_label(identity["method"])
    name = f"{label}-{config_hash(identity)}"
    return Path(runs_dir).expanduser() / _short(identity["task"]["name"]) / _short(identity["model"]["name"]) / name


def is_run_dir(path: Path) -> bool:
    return (path / CONFIG_FILE).is_file() and ((path / META_FILE).is_file() or (path / PROGRESS_FILE).is_file())


def find_run_dirs(root: Path) -> list[Path]:
    """Every run directory under ``root`` (or ``root`` itself), skipping Hydra's own output folders."""
    root = Path(root)
    if is_run_dir(root):
        return [root]
    out = []
    for dirpath, dirnames, _ in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".hydra", ".submitit", "wandb"))
        p = Path(dirpath)
        if is_run_dir(p):
            out.append(p)
            dirnames[:] = []
    return out


class RunsDirError(ValueError):
    """``paths.runs_dir`` (or a run dir below it) cannot be written."""


def check_writable(run_dir: Path) -> str | None:
    """None when ``run_dir`` exists and is writable or could be created (it then exists); else the reason, naming
    the path, e.g. ``/proc/runs (No such file or directory)``."""
    run_dir = Path(run_dir)
    if run_dir.is_dir():
        return None if os.access(run_dir, os.W_OK) else f"{run_dir} (read-only)"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"{exc.filename or run_dir} ({exc.strerror or exc})"
    return None


def check_runs_dir(runs_dir: Any) -> None:
    """Refuse a ``paths.runs_dir`` that cannot be written, before the model loads (``runner.run`` calls it once the
    launch cache has not answered; ``preflight`` for each job of a sweep): a file is created and removed in the
    folder, or in its nearest existing parent when it does not exist yet, so nothing is left behind.  Raises
    ``RunsDirError`` (one line: the path, why, the fix)."""
    import tempfile

    path = Path(str(runs_dir)).expanduser()
    probe = next((p for p in (path, *path.parents) if p.exists()), None)
    if probe is None:
        return
    try:
        if not probe.is_dir():
            raise NotADirectoryError(20, "not a directory", str(probe))
        fd, name = tempfile.mkstemp(prefix=".write_probe-", dir=probe)
        os.close(fd)
        os.unlink(name)
    except OSError as exc:
        where = "" if probe == path else f" at {probe}"
        read = (
            f" (python -m sparse_eval.results.collect {runs_dir} --out <writable path> reads the finished runs there)"
            if probe == path
            else ""
        )
        raise RunsDirError(
            f"paths.runs_dir={runs_dir}: cannot write {path} ({exc.strerror or exc}{where}); give a writable folder, "
            f"e.g. paths.runs_dir=runs{read}"
        ) from None


# -- JSON files ------------------------------------------------------------------------------------------------


def finite(obj: Any) -> Any:
    """NaN/inf never reach a result file: they become null (the caller flags where)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def write_json(path: Path, obj: Any) -> None:
    """``obj`` as indented JSON, written whole or not at all (a temporary file renamed over ``path``); the folder
    is created when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n")


def _write_atomic(path: Path, text: str) -> None:
    """``text`` into ``path`` through a temporary file renamed over it; a failed write (a full disk) removes its
    temporary file instead of leaving it behind."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


TMP_PATTERNS = (".*.*.tmp", "samples.tmp")  # ``_write_atomic``'s and ``SampleLog``'s temporary files
STALE_TMP_S = 60.0


def remove_stale_tmp(run_dir: Path) -> list[Path]:
    """Remove the temporary files a killed or failed write left in ``run_dir`` (``.<file>.<pid>.tmp`` of a process
    that is gone from this host, or older than ``STALE_TMP_S``; ``samples.tmp``).  Called by the process that holds
    the run's lock, when the run (re)starts.  Returns what it removed."""
    gone = []
    now = time.time()
    for pattern in TMP_PATTERNS:
        for f in Path(run_dir).glob(pattern):
            pid = f.name.rsplit(".", 2)[-2] if f.name.startswith(".") else ""
            try:
                old = now - f.stat().st_mtime > STALE_TMP_S
            except OSError:
                continue
            if f.name == "samples.tmp" or old or (pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))):
                with contextlib.suppress(OSError):
                    f.unlink()
                    gone.append(f)
    return gone


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by another user
        return True
    return True


def read_json(path: Path) -> Any:
    """The JSON in ``path``; None when it is missing, unreadable or torn."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


# -- writing a run ---------------------------------------------------------------------------------------------


def record_start(run_dir: Path, identity: dict[str, Any]) -> bool:
    """``config.yaml`` (the identity) and, at a run's first start, ``meta.json`` (its provenance).  True when this
    call wrote meta.json (the run's first start), False when it was there (a restart)."""
    from omegaconf import OmegaConf

    from ..identity.provenance import provenance

    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(run_dir / CONFIG_FILE, OmegaConf.to_yaml(OmegaConf.create(identity)))
    if (run_dir / META_FILE).exists():
        return False
    write_json(run_dir / META_FILE, provenance())
    return True


def record_resume(run_dir: Path, done_at_start: int) -> None:
    """A restart that adds samples to a run holding ``done_at_start`` of them (0 when the processes before it
    stopped before their first sample): this process's provenance (git commit and the hash of a dirty tree's
    difference, versions, hardware, command line, start time) appended to ``meta.json``'s ``resumes``, so that a
    run whose samples were written by different code, libraries or hardware says so (``collect``'s ``segments``
    and ``mixed_provenance``)."""
    from ..identity.provenance import provenance

    path = Path(run_dir) / META_FILE
    meta = read_json(path) or {}
    meta.setdefault("resumes", []).append({"done_at_start": int(done_at_start), **provenance()})
    write_json(path, meta)


def record_segment(run_dir: Path, done_at_start: int, first: bool) -> None:
    """A process about to add samples to a run that holds ``done_at_start`` of them, under the run's lock: its
    segment of the run.  At the run's first start (``first``: ``record_start`` wrote meta.json) the count joins
    meta.json's own provenance; any later start is a restart (``record_resume``), whatever it found."""
    if not first:
        record_resume(run_dir, done_at_start)
        return
    path = Path(run_dir) / META_FILE
    meta = read_json(path) or {}
    meta["done_at_start"] = int(done_at_start)
    write_json(path, meta)


def record_segment_end(run_dir: Path, done_at_end: int) -> None:
    """The end (finished, interrupted or failed) of the process that ``record_segment`` recorded last: the run's
    sample count then, as its segment's ``done_at_end``.  With every segment's counts on record, the next one
    starts where the last one stopped and the last one stops at the samples the run holds
    (tests/verdicts/test_experiments_record.py checks this of every archived run), so a segment missing from meta.json
    shows.  A write that fails is logged, not raised: it must not hide the run's own error."""
    path = Path(run_dir) / META_FILE
    try:
        meta = read_json(path) or {}
        resumes = meta.get("resumes") or []
        (resumes[-1] if resumes else meta)["done_at_end"] = int(done_at_end)
        write_json(path, meta)
    except OSError as exc:
        log.warning("could not record the end of this segment in %s: %s", path, exc)


def slurm_job_id() -> str | None:
    """This process's Slurm job as squeue names it: ``<array job>_<task>`` for an array task, else the job id."""
    env = os.environ
    if env.get("SLURM_ARRAY_JOB_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env.get('SLURM_ARRAY_TASK_ID')}"
    return env.get("SLURM_JOB_ID")


def _where() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "slurm_job_id": slurm_job_id(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_progress(run_dir: Path, expected_samples: int, already_done: int) -> None:
    """At the start (or restart) of a run: how many samples it will have in all and how many were already there."""
    write_json(
        Path(run_dir) / PROGRESS_FILE, {"expected_samples": expected_samples, "done_at_start": already_done, **_where()}
    )


def write_failure(run_dir: Path, exc: BaseException, extra: dict[str, Any] | None = None) -> Path:
    path = Path(run_dir) / FAILED_FILE
    write_json(
        path,
        {
            "error": f"{type(exc).__name__}: {exc}",
            "type": type(exc).__name__,
            "traceback": "".join(traceback.format_exception(exc)[-12:]),
            **_where(),
            **(extra or {}),
        },
    )
    return path


def clear_failure(run_dir: Path) -> None:
    """At a run's (re)start, under its lock: drop the failure record and the temporary files a failed or killed
    write left (``remove_stale_tmp``)."""
    with contextlib.suppress(FileNotFoundError):
        (Path(run_dir) / FAILED_FILE).unlink()
    remove_stale_tmp(run_dir)


class SampleLog:
    """Append-only JSONL of finished samples.  A line that is not a sample's record (a last line cut short by a kill,
    a line garbled on disk) is reported, line number and file, with ``log.warning``; the sample it belonged to (its
    id, when the line still shows one) is dropped, so the run computes it again, and the file is rewritten without
    them so appends stay valid JSONL (``corrupt``: the lines, as ``parse_samples`` gives them)."""

    def __init__(self, path: Path):
        self.path = path
        self.records: dict[str, dict[str, Any]] = {}
        self.corrupt: list[tuple[int, str, bool]] = []
        if path.exists():
            self.records, self.corrupt = parse_samples(path.read_text(encoding="utf-8"))
            for number, line, cut_short in self.corrupt:
                sid = corrupt_line_id(line)
                log.warning(
                    "%s line %d is not a sample record (%s): %.80r; %s",
                    path,
                    number,
                    "cut short" if cut_short else "corrupt",
                    line,
                    f"sample {sid} is computed again" if sid else "it names no sample, nothing to compute again",
                )
            if self.corrupt:  # rewrite without the bad lines (and their samples' records) so appends stay valid JSONL
                self.rewrite(self.records.values())

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
    """``summary.json`` and ``summary.csv`` (one flat row, without the per-layer aggregates)."""
    import pandas as pd

    summary = finite(summary)
    write_json(Path(run_dir) / SUMMARY_FILE, summary)
    flat = {k: v for k, v in _flatten(summary).items() if "per_layer" not in k}
    pd.DataFrame([flat]).to_csv(Path(run_dir) / SUMMARY_CSV, index=False)


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


# -- the lock --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def run_lock(run_dir: Path, wait_log_s: float = 60.0) -> Iterator[None]:
    """Exclusive lock on a run directory for the time a process runs it (waits while another one holds it).

    Two jobs of the same config (a duplicated sweep point, a sweep relaunched while its first launch still runs)
    then never write the same samples twice: the second waits and finds the samples done.  Where the file
    system refuses locks (some network mounts) it runs without one.
    """
    import fcntl

    Path(run_dir).mkdir(parents=True, exist_ok=True)
    fd = os.open(Path(run_dir) / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    locked = False
    try:
        t0 = last = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = True
                break
            except BlockingIOError:
                if time.monotonic() - last >= wait_log_s:
                    last = time.monotonic()
                    log.warning(
                        "run dir %s is locked by another process (%s); waiting (%.0f s so far)",
                        run_dir,
                        _lock_owner(fd),
                        last - t0,
                    )
                time.sleep(1.0)
            except OSError as exc:
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning("no file locks on %s (%s); running without", run_dir, exc)
                    break
                raise
        if locked:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(_where()).encode(), 0)
        yield
    finally:
        if locked:
            fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _lock_owner(fd: int) -> str:
    try:
        return os.pread(fd, 512, 0).decode(errors="replace") or "?"
    except OSError:
        return "?"


def lock_held(run_dir: Path) -> bool:
    """True when some process holds the run's lock right now (checked without taking it for long)."""
    import fcntl

    path = Path(run_dir) / LOCK_FILE
    if not path.exists():
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


# -- reading a run ---------------------------------------------------------------------------------------------


def read_identity(run_dir: Path) -> dict[str, Any] | None:
    """``config.yaml`` as a dict; None when it is missing, torn or not a run's config."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.to_container(OmegaConf.load(Path(run_dir) / CONFIG_FILE), resolve=False)  # type: ignore[return-value]
    except Exception:  # noqa: BLE001 - a torn or foreign file: the caller falls back (directory name, skip)
        return None


_ID_IN_LINE = re.compile(r'"id":\s*"((?:[^"\\]|\\.)*)"')


def corrupt_line_id(line: str) -> str | None:
    """The sample id a corrupt line of samples.jsonl still shows (``"id": "..."``), or None."""
    m = _ID_IN_LINE.search(line)
    if not m:
        return None
    try:
        return json.loads(f'"{m.group(1)}"')
    except json.JSONDecodeError:
        return None


def parse_samples(text: str) -> tuple[dict[str, dict[str, Any]], list[tuple[int, str, bool]]]:
    """samples.jsonl's text as ({id: record}, [(line number from 1, line, cut short)] of the lines that are not a
    record; cut short: the last line, without its newline, as a kill in the middle of a write leaves it).  The last
    record of an id wins; a sample whose id a bad line shows has no record (its record cannot be trusted: the run
    computes it again)."""
    records: dict[str, dict[str, Any]] = {}
    corrupt: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            records[rec["id"]] = rec
        except (json.JSONDecodeError, KeyError, TypeError):
            corrupt.append((number, line, number == len(lines) and not text.endswith("\n")))
    for _, line, _ in corrupt:
        records.pop(corrupt_line_id(line), None)
    return records, corrupt


def read_samples_checked(path: Path) -> tuple[dict[str, dict[str, Any]], list[tuple[int, str, bool]]]:
    """``parse_samples`` of the file (nothing when it cannot be read)."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return {}, []
    return parse_samples(text)


def read_samples(path: Path) -> dict[str, dict[str, Any]]:
    """samples.jsonl as {id: record}, as ``SampleLog`` reads it (``parse_samples``: corrupt lines and the samples they
    name left out)."""
    return read_samples_checked(path)[0]
