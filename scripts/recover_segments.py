"""Recover, from a run archive's job logs, the restarts that meta.json did not record, and add them to it.

Before meta.json recorded each restart (``resumes``, 9e5e30d) a resumed run named only its first start's commit.
The runs of experiments/ruler_smollm2_4k and experiments/ruler_smollm2_8k were resumed over many device calls,
some at other commits.  Their archives keep every call's job logs (``scripts/run_jobs.py``, since removed: one log
per job, and ``jobs.json`` with the commands), and each folder's README and the commit messages say at which commit
each call ran.  This script reads, for every job log of every call in order:

* the run's progress bars (``<method label>: ... n/650 [...]``): the first count is the samples the process found,
  the last (or the ``stopped with n/650`` line of an interrupted run) where it stopped, the run folder named by
  that line or by the label and the job's seed;
* the time of the log's last line before the bar (the task's sample generation, which the run's start follows).

A process whose run already had a meta.json is a restart: its segment is added to meta.json's ``resumes`` with
its counts, the time, the call's commit (from the README and history, given below per call), and where a run
began in the same call (one machine and one checkout per call) that first start's ``git`` (its diff hash),
versions and hardware; otherwise the record says these are not recoverable.  Each added segment carries
``recovered`` (``source``: "recovered from git history/README") naming where each of its values came from.  The
restarts recorded by the runs themselves (since 9e5e30d) are matched against the logs (same count, within 10 s)
and kept as they are; the script stops when the logs and the records disagree, when a count does not continue
the run's last, or when a run's segments do not end at its samples.

    python scripts/recover_segments.py experiments/ruler_smollm2_8k/runs.tar.gz r8
    python scripts/recover_segments.py experiments/ruler_smollm2_4k/runs.tar.gz r4 [--dry-run]
"""

from __future__ import annotations

import argparse
import datetime as dt
import io
import json
import re
import sys
import tarfile
from pathlib import Path
from typing import Any

SOURCE = "recovered from git history/README"
TS = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+\]")
BAR = re.compile(
    r"^(?P<label>[^:\r\n]+?):\s+\d+%\|[^|]*\|\s*(?P<n>\d+)/(?P<tot>\d+) \[(?P<el>[^<\]]*)<(?P<left>[^,\]]*)"
)
STOP = re.compile(r"interrupted: (\S+) stopped with (\d+)/(\d+)")
STATIC_HARDWARE = ("platform", "machine", "cpu", "cpu_count", "torch_threads", "affinity", "gpu", "gpu_count")

R8_README = "experiments/ruler_smollm2_8k/README.md, 'Hardware and date' (which commit wrote which samples)"
R4_README = "experiments/ruler_smollm2_4k/README.md, 'Hardware and date'"
# per archive: its runs folder, and its calls in the order they ran: (log folder or glob, commit, where the commit
# is stated).  A call whose runs began there also has the commit in their own meta.json (checked below).
CALLS: dict[str, dict[str, Any]] = {
    "r8": {
        "runs": "runs/b32",
        "calls": [
            *(
                (
                    f"logs/2026-12-03_c{i}/*.log",
                    "8673c2d2c744bc982fa0eaa0dfe7d67aa6c6c891",
                    f"{R8_README}: 8673c2d (calls 1-3); commit 7c2264f ('... pytest -m gpu at 8673c2d')",
                )
                for i in (1, 2, 3)
            ),
            *(
                (
                    f"logs/2026-12-03_c{i}/*.log",
                    "1464ab5254eb5714b5d99ccca989b3bdd49a24ea",
                    f"{R8_README}: 1464ab5 (calls 4-5); commit ea23895 ('... over two device calls at 1464ab5')",
                )
                for i in (4, 5)
            ),
            ("logs/c7/*.log", "30558b5536f01f47cddcd098b9fd5409d63e9c95", f"{R8_README}: 30558b5 (call 6)"),
            *(
                (f"logs/c{i}/*.log", "7350abc23eb4f679a35290d7f937ec9628ec19bb", f"{R8_README}: 7350abc (calls 7-8)")
                for i in (8, 9)
            ),
            *(
                (f"logs/c{i}/*.log", "9f9991482d12cf44117c414cc1d154a480316f1c", f"{R8_README}: 9f99914 (calls 9-10)")
                for i in (10, 11)
            ),
        ],
    },
    "r4": {
        "runs": "runs/b64",
        "skip_jobs": ("r4b16_",),  # runs/b16: its MagicPIG run stayed at its first 64 samples, not resumed
        "calls": [
            ("logs/r4*.log", "c60f7dae2ec4a127c3b3fe957d0ea7b425b502c0", "the first session's first starts"),
            *(
                (
                    f"logs/resume_c{i}/*.log",
                    "869376fc5c829b3e6d05ac816ed130b19a2d082e",
                    f"{R4_README}: resumed at 5cf8a80's code, 'the resumed records' meta names commit 869376f "
                    "with that file changed' (5cf8a80's one change, uncommitted on the device); commit 0c606e6 "
                    "('... RULER-4K replication resumed')",
                )
                for i in (1, 2, 3)
            ),
            # the second session's first call: its logs were overwritten by the next call's (same log folder)
            ("unlogged 2026-12-02T08:17:00/2026-12-02T08:24:00", "06c65a7c995a9cf3c896bb5445c3899b9abd6eb6", ""),
            (
                "logs/c2026-12-02/*.log",
                "06c65a7c995a9cf3c896bb5445c3899b9abd6eb6",
                f"{R4_README}: 'The second "
                "session's runs ... ran at commit 06c65a7'; commit d7d73f9 (the session's record)",
            ),
            *(
                (
                    f"logs/third_session_c{i}/*.log",
                    "253f9d92fb0b216b8a80c5593eaf5aa6f06cf8d0",
                    f"{R4_README}: 'The "
                    "third session's ... ran at commit 253f9d9 + this folder's jobs.tsv lines (247b07a; the package "
                    "identical)'; commit 9822950 (the session's record)",
                )
                for i in (1, 2, 3)
            ),
            *(
                (
                    f"logs/fourth_session_c{i}/*.log",
                    "ceffd1a8b7f48a6dee8c0d39aa2a333f42e3b426",
                    f"{R4_README}: 'The fourth session (commit ceffd1a; ...)'; commit ac777b9 (the session's record)",
                )
                for i in (1, 2)
            ),
        ],
    },
}


def _time(text: str) -> dt.datetime:
    return dt.datetime.strptime(text[:19].replace("T", " "), "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.timezone.utc)


def bars(text: str) -> list[dict[str, Any]]:
    """The run progress bars of one job log, in order: label, first and last count, the time of the last log line
    before the bar, whether it is the log's first bar, and (when it stopped early) the count and run folder hash
    of its 'interrupted' line."""
    out: list[dict[str, Any]] = []
    last_ts, cur = None, None
    for piece in re.split(r"[\r\n]", text):
        piece = piece.strip()
        m = TS.match(piece)
        if m:
            last_ts = m.group(1)
        b = BAR.match(piece)
        if b and not b["label"].startswith(("Converting", "Loading")):
            if b["el"].strip() == "00:00" and b["left"].strip() == "?":  # a new bar (tqdm's first refresh)
                cur = {"label": b["label"], "initial": int(b["n"]), "last": int(b["n"]), "ts": last_ts}
                cur["first_in_log"] = not out
                out.append(cur)
            elif cur is not None:
                cur["last"] = int(b["n"])
        s = STOP.search(piece)
        if s and cur is not None:
            cur["last"], cur["dir_hash"] = int(s.group(2)), s.group(1).rsplit("-", 1)[-1]
    return out


def _label(method: dict[str, Any]) -> str:
    from sparse_eval.results.results_table import short_label

    return short_label(method)


def recover(archive: Path, key: str, dry_run: bool = False) -> list[str]:
    import yaml

    spec = CALLS[key]
    with tarfile.open(archive) as tar:
        members = tar.getmembers()
        data = {m.name: tar.extractfile(m).read() for m in members if m.isfile()}
        fmt = tar.format
    root = spec["runs"].rstrip("/") + "/"
    runs: dict[str, dict[str, Any]] = {}
    for name in data:
        if name.startswith(root) and name.endswith("/config.yaml") and name.replace("config.yaml", "meta.json") in data:
            folder = name.rsplit("/", 1)[0]
            cfg = yaml.safe_load(data[name])
            runs[folder] = {
                "cfg": cfg,
                "meta": json.loads(data[folder + "/meta.json"]),
                "samples": sum(1 for line in data.get(folder + "/samples.jsonl", b"").splitlines() if line.strip()),
                "label": _label(cfg["method"]),
                "count": 0,
                "segments": [],
            }
    notes: list[str] = []
    for pattern, commit, commit_source in spec["calls"]:
        if pattern.startswith("unlogged "):  # its runs' counts are known again at their next bar
            lo, hi = (_time(t) for t in pattern.split(" ", 1)[1].split("/"))
            for folder, run in runs.items():
                if lo <= _time(run["meta"]["started"]) <= hi:
                    run["count"] = None
                    run["segments"].append({"first": True})
            notes.append(
                f"{pattern}: the runs begun then wrote their first samples in a call whose logs were not kept; "
                "a restart between it and the next logged call would not show"
            )
            continue
        folder_glob = re.compile("^" + re.escape(pattern).replace(r"\*", "[^/]*") + "$")
        logs = sorted(n for n in data if folder_glob.match(n))
        if not logs:
            raise SystemExit(f"{archive}: no logs match {pattern}")
        log_dir = logs[0].rsplit("/", 1)[0]
        jobs = json.loads(data.get(log_dir + "/jobs.json", b"[]"))
        commands = {j["name"]: j["command"] for j in jobs}
        starts = []  # (run folder, meta) of the runs that began in this call: this call's checkout and machine
        events = []
        for log in logs:
            job = log.rsplit("/", 1)[1][: -len(".log")]
            if job.startswith(spec.get("skip_jobs", ())):
                continue
            seed = re.search(r"_s(\d+)$", job)
            for b in bars(data[log].decode("utf-8", "replace")):
                if b.get("dir_hash"):
                    cands = [f for f in runs if f.endswith("-" + b["dir_hash"])]
                else:
                    cands = [
                        f
                        for f, r in sorted(runs.items(), key=lambda kv: kv[1]["cfg"].get("seed", 0))
                        if r["label"] == b["label"]
                        and (seed is None or r["cfg"].get("seed") == int(seed.group(1)))
                        and (r["count"] is None or r["count"] == b["initial"] and r["count"] < r["samples"])
                    ]
                if not cands:
                    raise SystemExit(f"{log}: no run for the bar {b}")
                folder = cands[0]
                run = runs[folder]
                if run["label"] != b["label"] or run["count"] not in (None, b["initial"]):
                    raise SystemExit(f"{log}: {b} does not continue {folder} at {run['count']}")
                started = _time(run["meta"]["started"])
                ts = _time(b["ts"]) if b["ts"] else None
                first = b["initial"] == 0 and ts is not None and -5 <= (started - ts).total_seconds() <= 900
                if b["initial"] == 0 and not first and ts is not None and started > ts:
                    notes.append(f"{log}: {folder} began and stopped at 0 before its record's first start; skipped")
                    continue
                if first:
                    starts.append(folder)
                events.append((folder, b, log, job, first))
                run["count"] = b["last"]
        ref = [runs[f]["meta"] for f in starts]
        gits = {json.dumps(m["git"], sort_keys=True) for m in ref}
        if len(gits) > 1:
            raise SystemExit(f"{pattern}: the runs begun in this call name different trees: {gits}")
        if ref and ref[0]["git"].get("commit") != commit:
            raise SystemExit(f"{pattern}: the runs begun here name {ref[0]['git'].get('commit')}, not {commit}")
        for folder, b, log, job, first in events:
            run = runs[folder]
            if first:
                run["segments"].append({"first": True})
                continue
            seg: dict[str, Any] = {
                "done_at_start": b["initial"],
                "done_at_end": b["last"],
                "started": _time(b["ts"]).strftime("%Y-%m-%dT%H:%M:%S+0000") if b["first_in_log"] else None,
                "_log": log,
            }
            recorded = [
                r
                for r in run["meta"].get("resumes") or []
                if r.get("done_at_start") == b["initial"]
                and seg["started"]
                and abs((_time(r["started"]) - _time(seg["started"])).total_seconds()) <= 10
            ]
            if recorded:
                run["segments"].append({"recorded": recorded[0]})
                continue
            how = {
                "source": SOURCE,
                "commit": commit_source,
                "counts": f"{log}: the run's progress bar, its first count (the samples found) and where it stopped",
                "started": (
                    f"{log}: the time of the log's last line before the run's progress bar (the samples' "
                    "generation, which the restart follows by seconds)"
                    if seg["started"]
                    else "not recoverable: the log's process ran another run first"
                ),
            }
            git: dict[str, Any] = {"commit": commit}
            if ref:
                git = dict(ref[0]["git"])
                seg["versions"] = ref[0].get("versions")
                seg["hardware"] = {k: v for k, v in (ref[0].get("hardware") or {}).items() if k in STATIC_HARDWARE}
                how["git_versions_hardware"] = (
                    f"those of the first start of {starts[0].rsplit('/', 1)[1]} in the same call (one machine and "
                    "one checkout per call; its load average left out)"
                )
            else:
                how["git_versions_hardware"] = (
                    "not recoverable: no run began in this call, so no record of its checkout (the hash of its "
                    "difference from the commit), libraries or machine exists"
                )
            seg["git"] = git
            if job in commands:
                seg["command"] = commands[job]
                how["command"] = f"{log.rsplit('/', 1)[0]}/jobs.json"
            seg["recovered"] = how
            run["segments"].append(seg)
    out = []
    for folder, run in sorted(runs.items()):
        recorded = run["meta"].get("resumes") or []
        matched = [s["recorded"] for s in run["segments"] if "recorded" in s]
        if len(matched) != len(recorded):
            raise SystemExit(f"{folder}: the logs show {len(matched)} of its {len(recorded)} recorded restarts")
        if run["count"] is None:  # finished in the unlogged call: no later process wrote to it
            notes.append(f"{folder}: no logged process after the unlogged call; nothing to add")
        elif run["count"] != run["samples"]:
            raise SystemExit(f"{folder}: the logs end at {run['count']} samples, the run holds {run['samples']}")
        added = [s for s in run["segments"] if "recovered" in s]
        if not added:
            continue
        resumes = []
        for s in run["segments"]:
            if "first" in s:
                continue
            if "recorded" in s:
                resumes.append(s["recorded"])
            else:
                resumes.append({key: v for key, v in s.items() if not key.startswith("_")})
        run["meta"]["resumes"] = resumes
        data[folder + "/meta.json"] = (json.dumps(run["meta"], indent=2, sort_keys=True) + "\n").encode()
        out.append(
            f"{folder.rsplit('/', 1)[1]}: "
            + ", ".join(
                f"{s['done_at_start']}->{s['done_at_end']} at {s['git']['commit'][:7]}"
                f"{'' if s['git'].get('diff_sha256') else ' (tree not on record)'} [{s['_log'].split('/')[1]}]"
                for s in added
            )
        )
    if not dry_run and out:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz", format=fmt) as tar:
            for m in members:
                if m.isfile():
                    body = data[m.name]
                    m.size = len(body)
                    tar.addfile(m, io.BytesIO(body))
                else:
                    tar.addfile(m)
        archive.write_bytes(buf.getvalue())
    return notes + out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("archive", type=Path)
    ap.add_argument("key", choices=sorted(CALLS))
    ap.add_argument("--dry-run", action="store_true", help="print what would be added, write nothing")
    args = ap.parse_args(argv)
    for line in recover(args.archive, args.key, args.dry_run):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
