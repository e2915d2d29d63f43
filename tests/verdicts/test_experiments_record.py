"""experiments/ is a record: one folder per claim, each with a README, and every citation of it resolves."""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CITES = re.compile(r"experiments/[A-Za-z0-9_./*|-]*[A-Za-z0-9_*]")
SOURCES = ["README.md", "docs", "sparse_eval", "kernels", "benchmarks", "notebooks", "experiments"]


def _texts():
    for name in SOURCES:
        p = ROOT / name
        files = [p] if p.is_file() else [f for f in p.rglob("*") if f.suffix in (".md", ".py", ".ipynb", ".sh")]
        for f in files:
            yield f, f.read_text(encoding="utf-8", errors="replace")


def test_every_claim_folder_has_a_readme():
    folders = [d for d in (ROOT / "experiments").iterdir() if d.is_dir()]
    assert folders
    assert [d.name for d in folders if not (d / "README.md").exists()] == []


def test_citations_of_experiments_resolve():
    missing = []
    for f, text in _texts():
        for m in CITES.finditer(text):
            cited = m.group(0).rstrip(".")
            if cited.endswith("/<name>") or "<" in cited:
                continue
            # `a.json|png` names two files; `*` a pattern
            stem, _, alts = cited.partition("|")
            paths = [stem] + [re.sub(r"[^./]+$", a, stem) for a in alts.split("|") if a]
            for c in paths:
                if not list(ROOT.glob(c)):
                    missing.append(f"{f.relative_to(ROOT)}: {c}")
    assert missing == []


# -- provenance: every record is from a clean tree or carries the hash of its difference ---------------------

LEGACY_HEADING = "## Legacy provenance"


@functools.lru_cache(maxsize=None)
def _archived_runs() -> tuple[tuple[str, str, dict, dict, int], ...]:
    """(archive, run folder inside it, meta.json, progress.json, lines of samples.jsonl) of every run folder (one
    with a meta.json) inside the run archives under experiments/, each archive read once for the tests below.  A
    run's samples.jsonl holds one line per sample (``store.SampleLog`` appends a sample once; a rerun rewrites
    the file without the failed ones first)."""
    import json
    import tarfile

    out = []
    for f in sorted((ROOT / "experiments").rglob("*")):
        if not f.name.endswith((".tar.gz", ".tgz", ".tar")):
            continue
        runs: dict[str, dict] = {}
        with tarfile.open(f) as tar:
            for m in tar.getmembers():
                folder, _, name = m.name.rpartition("/")
                if m.isfile() and name in ("meta.json", "progress.json", "samples.jsonl"):
                    data = tar.extractfile(m).read()
                    runs.setdefault(folder, {})[name] = (
                        sum(1 for line in data.splitlines() if line.strip())
                        if name == "samples.jsonl"
                        else json.loads(data)
                    )
        rel = str(f.relative_to(ROOT))
        for folder, files in sorted(runs.items()):
            if "meta.json" in files:
                out.append(
                    (rel, folder, files["meta.json"], files.get("progress.json") or {}, files.get("samples.jsonl", 0))
                )
    return tuple(out)


def _git_records():
    """(file, label, git provenance dict) of every run record under experiments/: the ``git`` entries of JSON
    files, the meta.json files inside run archives, the rows of collected tables (results*.csv)."""
    import csv
    import json

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("git"), dict) and "commit" in node["git"]:
                yield node["git"]
            for v in node.values():
                yield from walk(v)
        elif isinstance(node, list):
            for v in node:
                yield from walk(v)

    def flag(v):
        return {"True": True, "False": False, "": None}.get(v, v)

    for f in sorted((ROOT / "experiments").rglob("*")):
        rel = str(f.relative_to(ROOT))
        if f.suffix == ".json":
            for git in walk(json.loads(f.read_text(encoding="utf-8"))):
                yield rel, rel, git
        elif f.name.endswith((".tar.gz", ".tgz", ".tar")):
            for archive, folder, meta, _, _ in _archived_runs():
                if archive == rel:
                    yield rel, f"{rel}:{folder}/meta.json", meta.get("git") or {}
        elif f.suffix == ".csv":
            with open(f, newline="", encoding="utf-8") as fh:
                for i, row in enumerate(csv.DictReader(fh)):
                    if "git_dirty" in row:
                        version = row.get("provenance_version") or None
                        yield (
                            rel,
                            f"{rel} row {i + 1}",
                            {
                                "commit": row.get("git_commit"),
                                "dirty": flag(row["git_dirty"]),
                                "diff_sha256": row.get("git_diff_sha256") or None,
                                "version": int(float(version)) if version else None,
                            },
                        )


def _legacy_listed() -> set[str]:
    text = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    assert LEGACY_HEADING in text, f"experiments/README.md has no '{LEGACY_HEADING}' section"
    section = text.split(LEGACY_HEADING, 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(experiments/[^`]+)` \|", section, flags=re.M))  # the table's first column


def test_run_records_are_clean_or_carry_a_diff_hash():
    """Records made since provenance version 2 come from a clean tree or carry ``diff_sha256``; the older ones
    (no version, mostly dirty without a hash) cannot be fixed after the fact and are listed as legacy in
    experiments/README.md, so a new record without the hash cannot be added unnoticed."""
    from sparse_eval.identity.provenance import PROVENANCE_VERSION

    records = list(_git_records())
    assert records, "found no provenance records under experiments/"
    bad, legacy = [], set()
    for file, label, git in records:
        version = git.get("version")
        if version is None:
            legacy.add(file)
        elif version > PROVENANCE_VERSION:
            bad.append(f"{label}: provenance version {version} is newer than this code's {PROVENANCE_VERSION}")
        elif git.get("dirty") is not False and not re.fullmatch(r"[0-9a-f]{64}", str(git.get("diff_sha256"))):
            bad.append(f"{label}: from a dirty tree (commit {git.get('commit')}) without diff_sha256")
    assert bad == [], "re-run from a clean checkout, or with sparse_eval.identity.provenance recording the diff hash"
    listed = _legacy_listed()
    assert sorted(legacy - listed) == [], (
        f"legacy records (no provenance version) not listed under '{LEGACY_HEADING}' in experiments/README.md"
    )
    assert sorted(listed - legacy) == [], (
        f"listed under '{LEGACY_HEADING}' but holding no legacy record: drop them from the list"
    )


# -- provenance: a run resumed at another commit names every segment -------------------------------------------

RECOVERED_SOURCE = "recovered from git history/README"


def _segment_problems(meta: dict, progress: dict, samples: int) -> list[str]:
    """What a run's meta.json misses of the processes that wrote its samples (its segments: the first start, then
    ``resumes``).  (1) A last start that found some but not all of the samples (progress.json) is a resume: one
    of ``resumes`` starts there.  (2) Where segments record their counts at the end (``done_at_end``, written
    since the segments were counted both ways), the next one starts at most where the last stopped (less after a
    rerun of failed samples) and the last stops at the samples the run holds: a segment left out breaks the
    chain.  (3) A segment recovered after the fact names its source and a commit, or why it has none."""
    problems = []
    resumes = [r for r in meta.get("resumes") or [] if isinstance(r, dict)]
    found, expected = progress.get("done_at_start"), progress.get("expected_samples")
    if isinstance(found, int) and isinstance(expected, int) and 0 < found < expected:
        if found not in [r.get("done_at_start") for r in resumes]:
            problems.append(f"its last start resumed at {found} of {expected} samples; no segment starts there")
    segments = [meta, *resumes]
    if any("done_at_end" in s for s in segments):
        for i, (last, nxt) in enumerate(zip(segments, segments[1:])):
            end, start = last.get("done_at_end"), nxt.get("done_at_start")
            if end is not None and (start is None or start > end):
                problems.append(f"segment {i + 1} starts at {start} after segment {i} stopped at {end}")
        if segments[-1].get("done_at_end") not in (None, samples):
            problems.append(f"the last segment stops at {segments[-1]['done_at_end']} of {samples} samples")
    for i, r in enumerate(resumes, 1):
        if "recovered" not in r:
            continue
        how, commit = r["recovered"], (r.get("git") or {}).get("commit")
        if how.get("source") != RECOVERED_SOURCE:
            problems.append(f"segment {i} is recovered without naming its source ({RECOVERED_SOURCE!r})")
        if not (re.fullmatch(r"[0-9a-f]{40}", str(commit)) or (commit is None and how.get("commit"))):
            problems.append(f"segment {i} is recovered without a commit or the reason it has none")
    return problems


def test_resumed_runs_carry_their_segments():
    """Every archived run names every process that wrote its samples (``store.record_segment``): the runs resumed
    before meta.json recorded restarts carry them recovered from the history (experiments/ruler_smollm2_4k,
    experiments/ruler_smollm2_8k)."""
    runs = _archived_runs()
    assert runs, "found no run archives under experiments/"
    bad = [
        f"{archive}:{folder}: {p}"
        for archive, folder, meta, progress, samples in runs
        for p in _segment_problems(meta, progress, samples)
    ]
    assert bad == []


def test_a_segment_left_out_is_found():
    git = {"commit": "a" * 40, "dirty": False}
    first = {"git": git, "done_at_start": 0, "done_at_end": 2}
    whole = {**first, "resumes": [{"git": git, "done_at_start": 2, "done_at_end": 5}]}
    assert _segment_problems(whole, {"done_at_start": 2, "expected_samples": 5}, 5) == []
    assert _segment_problems(first, {"done_at_start": 2, "expected_samples": 5}, 5) == [
        "its last start resumed at 2 of 5 samples; no segment starts there",
        "the last segment stops at 2 of 5 samples",
    ]
    gap = {**first, "resumes": [{"git": git, "done_at_start": 3, "done_at_end": 5}]}  # 2 -> 3 unrecorded
    assert _segment_problems(gap, {}, 5) == ["segment 1 starts at 3 after segment 0 stopped at 2"]
    old = {"git": git, "resumes": [{"git": git, "done_at_start": 3}]}  # from before the counts at the end: (1) only
    assert _segment_problems(old, {"done_at_start": 5, "expected_samples": 5}, 5) == []
    unsourced = {"git": git, "resumes": [{"git": {"commit": None}, "done_at_start": 3, "recovered": {}}]}
    assert len(_segment_problems(unsourced, {}, 5)) == 2
    why = {"source": RECOVERED_SOURCE, "commit": "not recoverable: ..."}
    assert _segment_problems({**unsourced, "resumes": [{**unsourced["resumes"][0], "recovered": why}]}, {}, 5) == []
