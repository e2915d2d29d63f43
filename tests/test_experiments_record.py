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
