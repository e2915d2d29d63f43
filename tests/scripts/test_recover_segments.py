"""``scripts/recover_segments.py``: a job log's progress bars read back as the samples a run found and where it
stopped (the records it recovered are checked in tests/verdicts/test_experiments_record.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("recover_segments", ROOT / "scripts" / "recover_segments.py")
recover_segments = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recover_segments)


def test_a_job_log_gives_each_run_its_counts_and_time():
    log = (
        "[2026-12-02 05:06:30,980][sparse_eval][INFO] - ruler: qa_2: 50 samples at 4096 tokens in 0.4 s\n"
        "Loading weights: 100%|##########| 272/272 [00:00<00:00, 36386.13it/s]\n"
        "magicpig K=10, L=150:  39%|###9      | 256/650 [00:00<?, ?sample/s]\r"
        "magicpig K=10, L=150:  49%|####9     | 320/650 [01:11<06:07,  1.11s/sample]\r"
        "magicpig K=10, L=150: 100%|##########| 650/650 [06:19<00:00,  1.00sample/s, batch=64]\n"
        "magicpig K=10, L=150:   0%|          | 0/650 [00:00<?, ?sample/s]\r"
        "magicpig K=10, L=150:  10%|9         | 64/650 [00:46<07:02,  1.39sample/s]\n"
        "interrupted: /root/runs/b64/ruler/m/magicpig-K=10-3aca772f36 stopped with 64/650 samples written; run ...\n"
    )
    first, second = recover_segments.bars(log)
    assert (first["label"], first["initial"], first["last"]) == ("magicpig K=10, L=150", 256, 650)
    assert first["ts"] == "2026-12-02 05:06:30" and first["first_in_log"] and "dir_hash" not in first
    assert (second["initial"], second["last"], second["dir_hash"], second["first_in_log"]) == (
        0,
        64,
        "3aca772f36",
        False,
    )
