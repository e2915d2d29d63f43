"""The new user's path, second round (issue 30): the batch sized to the host memory on the CPU (with a mocked
memory limit), long CPU runs asking for a flag, progress bars on the long silences, the all-dense and label-bit
settings, an unreadable run in status and collect, Hydra's folder and stray temporary files, SIGTERM, and the
output's wording.  (The bad inputs of the issue are rows of the tables in ``tests/project/test_user_path.py``.)"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from sparse_eval.run import memory
from sparse_eval.config import register_configs
from sparse_eval.config import CONF_DIR
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import run_config
from sparse_eval.launcher.runner import run

REPO = Path(__file__).resolve().parents[2]
STORIES = REPO / "sparse_eval" / "models" / "stories260K"
register_configs()


def cfg_for(tmp_path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"paths.runs_dir={tmp_path / 'runs'}", *overrides])


def files_under(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


# -- 1. the batch against the host memory (mocked), long runs ---------------------------------------------------


def _mock_memory(monkeypatch, available: float) -> None:
    monkeypatch.setattr(memory, "host_memory_available", lambda: float(available))


def _per_row(exp: Experiment) -> float:
    (m,) = exp.method_configs()
    m = exp.preflight(m).config
    return memory.run_row_bytes(exp.spec(), m, exp.samples())[0]


def test_auto_batch_is_sized_to_the_host_memory_on_the_cpu(tmp_path, monkeypatch):
    """With room for 2 rows (a mocked MemAvailable), ``auto`` starts at 2, not at min(samples, 128): on the CPU
    there is no out-of-memory error to halve on, the kernel kills the process."""
    exp = Experiment(
        run_config(cfg_for(tmp_path, "method=topk", "task.num_samples=5", "task.window=64", "eval.batch_size=auto"))
    )
    per_row = _per_row(exp)
    _mock_memory(monkeypatch, 2.5 * per_row / memory.HOST_FRACTION)
    sizes = []
    orig = exp.task.run_batch

    def spy(samples, engine):
        sizes.append(len(samples))
        return orig(samples, engine)

    monkeypatch.setattr(exp.task, "run_batch", spy)
    (m,) = exp.method_configs()
    summary = exp.run_method(exp.preflight(m))
    m = summary["method_config"]
    assert sizes == [2, 2, 1] and summary["batch_size"] == 2 and summary["samples"] == 5
    # plenty of memory: the usual start, min(samples, 128)
    _mock_memory(monkeypatch, 1e15)
    assert memory.auto_batch_cap(exp.spec(), m, exp.samples(), 5) == 5


def test_a_run_whose_one_row_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    _mock_memory(monkeypatch, 1 << 20)  # 1 MiB available
    with pytest.raises(
        ValueError,
        match=r"one sample of 64 tokens needs ~.* this machine has 1 MiB available .*; "
        r"lower task.length or run it on a GPU",
    ):
        run(cfg_for(tmp_path, "method=topk", "task.num_samples=2", "task.window=64", "eval.batch_size=auto"))
    assert files_under(tmp_path / "runs") == []


def test_an_explicit_batch_that_does_not_fit_names_the_one_that_does(tmp_path, monkeypatch):
    exp = Experiment(run_config(cfg_for(tmp_path, "method=topk", "task.num_samples=4", "task.window=64")))
    _mock_memory(monkeypatch, 2.5 * _per_row(exp) / memory.HOST_FRACTION)
    with pytest.raises(
        ValueError, match=r"eval.batch_size=4: 4 rows .* give eval.batch_size=2 or eval.batch_size=auto"
    ):
        run(cfg_for(tmp_path, "method=topk", "task.num_samples=4", "task.window=64", "eval.batch_size=4"))
    assert files_under(tmp_path / "runs") == []
    (s,) = run(cfg_for(tmp_path, "method=topk", "task.num_samples=4", "task.window=64", "eval.batch_size=2"))
    assert s["batch_size"] == 2 and s["samples"] == 4


def test_the_estimate_covers_the_measured_peaks_and_caps_the_readme_batch():
    """The per-row estimate (``memory.row_bytes``) against the peaks measured on SmolLM2-135M-Instruct, RULER 4K
    (memory's docstring), and what it makes of the README's batched RULER 8K command on this 24 GB machine: a few
    rows (about 17), not 128."""
    shape = memory.Shape(layers=30, heads=9, kv_heads=3, head_dim=64, hidden=576, intermediate=1536, vocab=49152)
    measured = {"full": 403, "topk": 559, "magicpig": 685}  # MiB per row
    methods = {
        "full": {"name": "full"},
        "topk": {"name": "topk", "dense_layers": [0, 1]},
        "magicpig": {"name": "magicpig", "K": 10, "L": 150, "dense_layers": [0, "mid"]},
    }
    for name, m in methods.items():
        est = sum(memory.row_bytes(shape, m, prompt=3962, new_tokens=128).values()) * memory.SAFETY / 2**20
        assert measured[name] <= est <= 2 * measured[name], (name, est)
    per_row = sum(memory.row_bytes(shape, methods["full"], prompt=8064, new_tokens=128).values()) * memory.SAFETY
    assert 8 <= int(memory.HOST_FRACTION * 21 * 2**30 // per_row) <= 32


def test_host_memory_is_read_within_the_cgroup_limit(monkeypatch):
    monkeypatch.setattr(memory, "_cgroup_room", lambda: 3.0 * 2**30)
    assert memory.host_memory_available() <= 3.0 * 2**30
    monkeypatch.setattr(memory, "_cgroup_room", lambda: None)
    assert memory.host_memory_available() > 0


def test_a_long_cpu_run_asks_for_the_flag_and_a_finished_one_does_not(tmp_path, monkeypatch, caplog):
    from sparse_eval.run import estimate

    monkeypatch.setattr(estimate, "model_flop_rate", lambda m, invariant=False: 1e3)  # 1 sample would take hours
    args = ("method=full", "task.num_samples=1", "task.window=64")
    with pytest.raises(ValueError, match=r"this run would take roughly .* h on this CPU .* add eval.allow_long=true"):
        run(cfg_for(tmp_path, *args))
    assert files_under(tmp_path / "runs") == []
    with caplog.at_level(logging.WARNING, logger="sparse_eval"):
        (s,) = run(cfg_for(tmp_path, *args, "eval.allow_long=true"))
    assert s["samples"] == 1 and "eval.allow_long=true" in caplog.text
    (again,) = run(cfg_for(tmp_path, *args))  # saved results: nothing left to run, nothing to ask
    assert again["run_dir"] == s["run_dir"]


def test_readme_keeps_gpu_commands_apart_from_the_cpu_ones():
    """The GPU command (with the README's other times, in docs/speed.md since issue 52) says so, and that such a run
    is refused on a CPU."""
    speed = (REPO / "docs" / "speed.md").read_text(encoding="utf-8")
    assert "Everything above runs on a CPU" not in speed
    line = next(l for l in speed.splitlines() if "eval.batch_size=auto" in l and l.startswith("python"))
    assert "GPU" in line and "refused" in speed.split(line, 1)[1][:600]


# -- 2. progress bars with the time left --------------------------------------------------------------------------


def test_calibration_shows_a_progress_bar(stories, capsys):
    from sparse_eval.calibrate import calibrate
    from sparse_eval.tasks.wikitext import BUNDLED

    model, tok = stories
    calibrate(
        model,
        tok,
        BUNDLED.read_text(encoding="utf-8"),
        model_name="stories260k",
        block_size=64,
        num_blocks=3,
        progress=True,
    )
    err = capsys.readouterr().err
    assert "calibration forwards" in err and "/3 [" in err and "<" in err  # [elapsed<left]


def test_analyses_show_progress_bars(stories, capsys):
    from sparse_eval.analysis import error_vs_budget, geometry

    model, tok = stories
    geometry.measure(
        model,
        tok,
        512,
        geometry.GeometryOptions(num_random=4, num_sentences=4, sentence_len=32, length=96, num_queries=2, batch=2),
    )
    err = capsys.readouterr().err
    assert "geometry: random inputs" in err and "/10 [" in err  # 2 + 2 batches, the passage, 5 layers
    opts = error_vs_budget.ErrorOptions(length=96, num_queries=2, budgets=[0.1, 0.5], magicpig=[[4, 20]], repeats=2)
    error_vs_budget.measure(model, tok, 512, opts, progress=True)
    err = capsys.readouterr().err
    # the forward, then 5 layers x (2 budgets x (TopK + 2 oracle seeds) + 1 (K, L) x 2 seeds)
    assert "error_vs_budget: 96-token forward" in err and f"/{5 * (2 * 3 + 2)} [" in err


# -- 4. settings that mean nothing ---------------------------------------------------------------------------------


def test_label_bits_3_is_valid_on_the_accuracy_path_and_refused_by_the_system_path(tmp_path):
    """Any width 1..8 is a label precision the simulation honours (2^bits - 1 levels, as the authors'
    quantizer); the system path's kernels pack 4, 8 or 16 bits and say so."""
    from sparse_eval.kernels.ds import pseudo_quantize
    from sparse_eval.methods import build_method, make_config

    build_method(make_config("double_sparsity", {"label_bits": 3})).validate(num_layers=5, context=512)
    x = torch.randn(4, 16)
    q = pseudo_quantize(x, 3)
    assert all(len(torch.unique(row)) <= 8 for row in q) and (q - x).abs().max() < (x.max() - x.min())
    (s,) = run(
        cfg_for(tmp_path, "method=double_sparsity", "method.label_bits=3", "task.num_samples=1", "task.window=64")
    )
    assert s["method_config"]["label_bits"] == 3 and s["samples"] == 1

    from sparse_eval.system.__main__ import run as system_run

    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="system", overrides=["method=double_sparsity", "method.label_bits=3"])
    with pytest.raises(ValueError, match=r"method.label_bits=3: the system path's label cache packs \[4, 8, 16\]"):
        system_run(cfg)


# -- 5. an unreadable run --------------------------------------------------------------------------------------------


def test_status_and_collect_flag_a_run_whose_config_cannot_be_read(tmp_path, capsys):
    from sparse_eval.results import collect, status

    (a,) = run(cfg_for(tmp_path, "method=full", "task.num_samples=1", "task.window=64"))
    (b,) = run(cfg_for(tmp_path, "method=topk", "task.num_samples=1", "task.window=64"))
    (Path(b["run_dir"]) / "config.yaml").write_text("method: {name: topk\n  budget: [", encoding="utf-8")
    runs = tmp_path / "runs"
    assert status.main([str(runs)]) == 0
    out = capsys.readouterr().out
    assert "1 done" in out and "1 unreadable" in out
    assert f"unreadable: {b['run_dir']}: config.yaml cannot be read" in out and "run the command that made it" in out
    assert collect.main([str(runs), "--quiet"]) == 1  # a table missing a run does not exit 0
    err = capsys.readouterr().err
    assert "1 of 2 runs could not be read" in err and b["run_dir"] in err
    import pandas as pd

    df = pd.read_csv(runs / "results.csv")
    bad = df[df.run_dir == b["run_dir"]]
    assert list(bad.state) == ["unreadable"] and bad.score.isna().all() and "config.yaml" in bad.error.iloc[0]
    assert list(df[df.run_dir == a["run_dir"]].state) == ["done"]
    # the command that made it rewrites config.yaml and keeps the samples
    (again,) = run(cfg_for(tmp_path, "method=topk", "task.num_samples=1", "task.window=64"))
    assert again["run_dir"] == b["run_dir"] and status.run_state(Path(b["run_dir"]))["state"] == "done"


def test_collect_help_names_both_files(capsys):
    from sparse_eval.results import collect

    with pytest.raises(SystemExit):
        collect.main(["--help"])
    assert re.search(r"X\.csv\s+and\s+X\.parquet", capsys.readouterr().out)


# -- 7. temporary files, SIGTERM ---------------------------------------------------------------------------------


def test_a_failed_write_leaves_no_temporary_file_and_a_rerun_removes_stale_ones(tmp_path, monkeypatch):
    import errno

    from sparse_eval.results import store

    real = Path.write_text

    def disk_full(self, *a, **k):
        if self.name.endswith(".tmp"):
            real(self, "")  # the file exists, empty, when the disk fills
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError):
        store.write_json(tmp_path / "failed.json", {"error": "x"})
    assert list(tmp_path.glob(".*.tmp")) == []
    monkeypatch.setattr(Path, "write_text", real)

    args = ("method=full", "task.num_samples=1", "task.window=64")
    exp = Experiment(run_config(cfg_for(tmp_path, *args)))
    (m,) = exp.method_configs()
    _, run_dir = exp.run_dir(exp.preflight(m))
    run_dir.mkdir(parents=True)
    dead = run_dir / ".failed.json.999999999.tmp"  # left by a process that is gone (pid out of range)
    dead.write_text("")
    ours = run_dir / f".other.json.{os.getpid()}.tmp"  # this process's, fresh: being written, kept
    ours.write_text("")
    (s,) = run(cfg_for(tmp_path, *args))
    assert Path(s["run_dir"]) == run_dir and not dead.exists() and ours.exists()
    ours.unlink()
    assert [p.name for p in run_dir.iterdir() if p.name.endswith(".tmp")] == []


def test_sigterm_stops_a_run_like_ctrl_c(tmp_path, monkeypatch, capsys):
    import sparse_eval.run.experiment as experiment
    from sparse_eval import cli

    previous = signal.signal(signal.SIGTERM, cli._on_sigterm)  # as hydra_entry installs it
    try:
        orig = experiment.Experiment.run_method

        def slurm_time_limit(self, m, run_dir=None, identity=None):
            os.kill(os.getpid(), signal.SIGTERM)
            return orig(self, m, run_dir, identity)

        monkeypatch.setattr(experiment.Experiment, "run_method", slurm_time_limit)
        with pytest.raises(cli.Terminated) as err:
            run(cfg_for(tmp_path, "method=full", "task.num_samples=2", "task.window=64"))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert err.value.run_dir and not (Path(err.value.run_dir) / "failed.json").exists()
    with pytest.raises(SystemExit) as ex:
        cli.interrupted(err.value)
    assert ex.value.code == cli.EXIT_TERMINATED == 143
    msg = capsys.readouterr().err
    assert "terminated (SIGTERM)" in msg and err.value.run_dir in msg and "resume" in msg


def test_hydra_entry_handles_sigterm(monkeypatch):
    from sparse_eval import cli

    seen = []
    monkeypatch.setattr(cli.sys, "argv", ["x"])
    previous = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        cli.hydra_entry(lambda: seen.append(signal.getsignal(signal.SIGTERM)))
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert seen == [cli._on_sigterm]


def test_a_refusal_removes_the_hydra_folder_it_made(tmp_path, monkeypatch):
    """In-process: what ``fail`` undoes for a refused single run (Hydra's ``.hydra/<time>`` folder and the runs
    folder made only to hold it)."""
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from sparse_eval import cli, hydra_support

    runs = tmp_path / "runs"
    hydra_support.writable_or_tmp(str(runs))
    out = runs / ".hydra" / "2026-12-02_00-00-00-000000"
    (out / ".hydra").mkdir(parents=True)
    (out / "__main__.log").write_text("")

    class FakeHydra:
        mode = RunMode.RUN

        class runtime:
            output_dir = str(out)

    monkeypatch.setattr(HydraConfig, "initialized", staticmethod(lambda: True))
    monkeypatch.setattr(HydraConfig, "get", staticmethod(lambda: FakeHydra))
    with pytest.raises(SystemExit) as ex:
        cli.fail("bad value", cli.EXIT_USAGE)
    assert ex.value.code == 2 and not runs.exists()


# -- 8. the output's wording, the warnings ---------------------------------------------------------------------


def test_table_wording_and_reuse(tmp_path, capsys):
    args = ("method=full", "task.num_samples=1", "task.window=64")
    run(cfg_for(tmp_path, *args))
    out = capsys.readouterr().out
    assert "(1 sample;" in out and "None" not in out
    row = next(l for l in out.splitlines() if l.strip().startswith("full"))
    assert "–" in row  # full attention's own "vs full"
    assert "reused" not in out
    run(cfg_for(tmp_path, *args))
    assert "all results were already saved there: reused, nothing recomputed" in capsys.readouterr().out


def test_reuse_note_tells_reused_from_resumed():
    from sparse_eval.results.results_table import reuse_note

    s = [{"method": "full"}, {"method": "topk"}]
    assert reuse_note(s, [(0, 4), (0, 4)]) == ""
    assert reuse_note(s, [(4, 4), (2, 4)]) == " (reused the saved results of full; resumed topk at sample 3 of 4)"


def test_bpe_clean_up_warning_is_silenced_without_changing_the_text(tmp_path):
    """A BPE tokenizer configured with clean_up_tokenization_spaces=True makes transformers warn at every run's
    first decode (it ignores the setting for BPE): the loaded tokenizer has it off, and decodes the same text."""
    from transformers import AutoTokenizer

    from sparse_eval.models.loading import ModelConfig, load_model

    model_dir = tmp_path / "stories"
    shutil.copytree(STORIES, model_dir)
    tc = json.loads((model_dir / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps(dict(tc, clean_up_tokenization_spaces=True)))
    raw = AutoTokenizer.from_pretrained(model_dir)
    assert raw.clean_up_tokenization_spaces is True  # the setting that warns
    _, tok = load_model(ModelConfig(name="tiny", path=str(model_dir), device="cpu"))
    assert tok.clean_up_tokenization_spaces is False
    ids = tok("Hello , world . It is ( said ) so !")["input_ids"]
    assert tok.decode(ids) == raw.decode(ids)


def test_system_prompts_do_not_warn_about_indexing_errors(stories):
    from transformers import AutoTokenizer

    from sparse_eval.system.__main__ import _prompts
    from sparse_eval.tasks.wikitext import BUNDLED

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    logging.getLogger("transformers").addHandler(handler)
    try:
        tok = AutoTokenizer.from_pretrained(STORIES)
        _prompts(tok, 64, 2)
        assert not [r for r in records if "indexing errors" in r]
        tok(BUNDLED.read_text(encoding="utf-8"))  # the same text the plain way: the warning the user saw
        assert [r for r in records if "indexing errors" in r]
    finally:
        logging.getLogger("transformers").removeHandler(handler)


# -- 9. the README's times and their conditions -------------------------------------------------------------------


def test_readme_times_state_their_conditions():
    """The README's time of the first run, and the times of the commands its details moved to docs/ with (issue 52),
    each with its machine's load."""
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    record = (REPO / "experiments" / "default_run" / "README.md").read_text(encoding="utf-8")
    docs = "\n".join((REPO / "docs" / f"{p}.md").read_text(encoding="utf-8") for p in ("speed", "methods", "analysis"))
    for text in (readme, record, docs):
        assert re.search(r"\bload\s+(average\s+)?of\s+[0-9]", text) and "101" in text  # the loaded machine's figure too
    for cmd in (
        "python -m sparse_eval.calibrate model=smollm2_135m",
        "analysis=geometry model=smollm2_135m",
        "analysis=error_vs_budget model=smollm2_135m",
        "analysis=ds_checks model=smollm2_135m",
    ):
        line = next(l for l in docs.splitlines() if cmd in l)
        assert re.search(r"\d+ (s|min)\b", line), line
