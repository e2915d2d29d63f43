"""Content fingerprints of the files a run reads (weights, calibration channels, data): sha256, cached.

Hashing a multi-GB checkpoint on every run would cost minutes, so a file's sha256 is kept in
``<user cache>/sha256.json`` under its absolute path with its size and modification time: a file rewritten in
place (new size or mtime) is hashed again.  ``SPARSE_EVAL_CACHE_DIR`` sets the cache folder (default
``$XDG_CACHE_HOME/sparse_eval``, else ``~/.cache/sparse_eval``); an unwritable cache only costs the re-hash.

``recording()`` collects every file fingerprinted while it is open, with its size, mtime and sha256: the launch
cache (``launcher.launch_cache``) keeps them to tell, without loading anything, that a run's inputs are unchanged.

``config_hash(obj)``: the short hash of a run's identity (its directory's name ends with it).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Iterator

CACHE_ENV = "SPARSE_EVAL_CACHE_DIR"
_RECORDINGS: list[dict[str, dict[str, object]]] = []  # open ``recording()`` blocks, innermost last


@contextlib.contextmanager
def recording() -> Iterator[dict[str, dict[str, object]]]:
    """Within the block: {absolute path: {size, mtime_ns, sha256}} of every file ``file_sha256`` fingerprinted
    (the stamp the digest was taken or cached under)."""
    seen: dict[str, dict[str, object]] = {}
    _RECORDINGS.append(seen)
    try:
        yield seen
    finally:
        _RECORDINGS.remove(seen)


def _note(path: str, size: int, mtime_ns: int, digest: str) -> None:
    for seen in _RECORDINGS:
        seen[path] = {"size": size, "mtime_ns": mtime_ns, "sha256": digest}


def user_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache").expanduser() / "sparse_eval"


def _cache_file() -> Path:
    return user_cache_dir() / "sha256.json"


def _read_cache() -> dict[str, list]:
    try:
        return json.loads(_cache_file().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _write_cache(cache: dict[str, list]) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cache, sort_keys=True), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        pass


def file_sha256(path: str | Path) -> str:
    """sha256 (hex) of a file's bytes, from the cache when its (path, size, mtime) is unchanged."""
    p = Path(path).expanduser().resolve()
    st = p.stat()
    key, stamp = str(p), [st.st_size, st.st_mtime_ns]
    cache = _read_cache()
    hit = cache.get(key)
    if hit and hit[:2] == stamp:
        _note(key, *stamp, hit[2])
        return hit[2]
    h = hashlib.sha256()
    with open(p, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    digest = h.hexdigest()
    cache = _read_cache()  # re-read: another process may have added entries meanwhile
    cache[key] = [*stamp, digest]
    _write_cache(cache)
    _note(key, *stamp, digest)
    return digest


def files_sha256(paths: Iterable[str | Path]) -> dict[str, str]:
    """{file name: sha256} of several files (sorted by name)."""
    return {Path(p).name: file_sha256(p) for p in sorted(paths, key=lambda p: Path(p).name)}


def combined_sha256(parts: dict[str, str]) -> str:
    """One sha256 of a {name: sha256} mapping (order-independent)."""
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def config_hash(obj: Any) -> str:
    """The first 10 hex digits of the sha256 of ``obj`` as sorted JSON: a run directory's name ends with it (the run's
    identity), and ``seeds.seed_group`` is it over an identity without its seed."""
    blob = json.dumps(obj, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:10]
