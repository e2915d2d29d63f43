"""experiments/ is a record: one folder per claim, each with a README, and every citation of it resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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


def _git_records():
    """(file, label, git provenance dict) of every run record under experiments/: the ``git`` entries of JSON
    files, the meta.json files inside run archives, the rows of collected tables (results*.csv)."""
    import csv
    import json
    import tarfile

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
            with tarfile.open(f) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith("meta.json"):
                        yield rel, f"{rel}:{m.name}", json.load(tar.extractfile(m)).get("git") or {}
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
    from sparse_eval.provenance import PROVENANCE_VERSION

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
    assert bad == [], "re-run from a clean checkout, or with sparse_eval.provenance recording the diff hash"
    listed = _legacy_listed()
    assert sorted(legacy - listed) == [], (
        f"legacy records (no provenance version) not listed under '{LEGACY_HEADING}' in experiments/README.md"
    )
    assert sorted(listed - legacy) == [], (
        f"listed under '{LEGACY_HEADING}' but holding no legacy record: drop them from the list"
    )
