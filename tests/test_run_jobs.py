"""scripts/run_jobs.py: a pool of commands with a deadline (the reproduction's runner on one GPU)."""

import json
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_pool_runs_in_order_and_interrupts_at_the_deadline(tmp_path):
    jobs = tmp_path / "jobs.tsv"
    marker = tmp_path / "interrupted"
    jobs.write_text(
        "\n".join(
            [
                "# a comment",
                "ok\techo done",
                "bad\texit 3",
                f"slow\ttrap 'touch {marker}; exit 130' INT; sleep 30 & wait",
                "late\tsleep 30",
                "never\techo never",
            ]
        )
        + "\n"
    )
    res = subprocess.run(
        [
            sys.executable,
            str(REPO / "scripts/run_jobs.py"),
            str(jobs),
            "--workers",
            "2",
            "--deadline",
            "3",
            "--grace",
            "5",
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 1, res.stdout + res.stderr  # a job failed
    done = {d["name"]: d for d in json.loads((tmp_path / "logs" / "jobs.json").read_text())}
    assert done["ok"]["status"] == "ok" and (tmp_path / "logs" / "ok.log").read_text() == "done\n"
    assert done["bad"]["status"] == "failed" and done["bad"]["rc"] == 3
    assert done["slow"]["status"] == "interrupted" and marker.exists()  # SIGINT reached the job's shell
    assert done["late"]["status"] == "interrupted"
    assert done["never"]["status"] == "not started"


def test_bad_jobs_file_names_the_line(tmp_path):
    jobs = tmp_path / "jobs.tsv"
    jobs.write_text("just a command\n")
    res = subprocess.run(
        [sys.executable, str(REPO / "scripts/run_jobs.py"), str(jobs)], capture_output=True, text=True, timeout=60
    )
    assert res.returncode != 0 and "jobs.tsv:1: expected NAME<TAB>COMMAND" in res.stderr


def test_jobs_get_sigint_back_when_the_pool_was_started_with_it_ignored(tmp_path):
    """A pool started in the background of a script (SIGINT ignored, inherited) still interrupts its jobs cleanly:
    each job starts with SIGINT at its default action, so its shell's trap runs at the deadline."""
    marker = tmp_path / "interrupted"
    jobs = tmp_path / "jobs.tsv"
    jobs.write_text(f"slow\ttrap 'touch {marker}; exit 130' INT; sleep 30 & wait\n")
    cmd = [
        sys.executable,
        str(REPO / "scripts/run_jobs.py"),
        str(jobs),
        "--deadline",
        "2",
        "--grace",
        "5",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=60, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)
    )
    done = {d["name"]: d for d in json.loads((tmp_path / "logs" / "jobs.json").read_text())}
    assert done["slow"]["status"] == "interrupted" and marker.exists(), res.stdout + res.stderr
