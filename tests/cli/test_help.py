"""``python -m sparse_eval --help`` explains itself: every registered method and task with its one line, the presets
named as such, the options that matter and the quick try (``task.num_samples``), made from the registries."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _help() -> str:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run(
        [sys.executable, "-m", "sparse_eval", "--help"], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stderr[-2000:]
    return res.stdout


def test_help_lists_every_registered_method_and_task_with_its_line():
    from sparse_eval.methods import METHODS
    from sparse_eval.tasks import TASKS

    text = _help()
    methods = text.split("== Methods", 1)[1].split("==", 2)[1]
    listed = re.findall(r"^  (\w+) {2,}(.+)$", methods, flags=re.M)
    assert {name for name, _ in listed} == set(METHODS), listed  # the 9 methods, no preset among them
    for name, cls in METHODS.items():
        assert cls.summary, f"{name}: Method.summary is empty"
        assert re.search(rf"^  {name} +{re.escape(cls.summary[:40])}", text, flags=re.M), name
    assert "Presets (method=PRESET" in text and "magicpig: magicpig_k10_l100" in text
    for name, cls in TASKS.items():
        assert cls.summary and re.search(rf"^  {name} +{re.escape(cls.summary[:40])}", text, flags=re.M), name
    assert "wikitext: wikitext_head (the default)" in text
    for option in ("model=NAME", "method=NAME", "task=NAME", "task.num_samples=N", "seed=S", "eval.batch_size=N"):
        assert re.search(rf"^  {re.escape(option)} ", text, flags=re.M), option
    for option in ("paths.runs_dir=DIR", "-m a=x,y", "+experiment=NAME"):
        assert option in text, option
    assert "--limit" in text and "ruler         the first N samples of each subtask (default 50)" in text
    assert "\nmodel:\n  name: stories260k" in text  # every option's value follows
    assert "_schema" not in text.split("== Every option", 1)[0]


def test_method_facts_read_from_source_match_the_registry():
    """The help reads the shipped methods' summaries from their source (no torch): they must be the classes'."""
    from sparse_eval.method_facts import shipped_class_facts
    from sparse_eval.methods import METHODS

    for name, cls in METHODS.items():
        if cls.__module__.startswith("sparse_eval.methods."):
            facts = shipped_class_facts()[name]
            assert facts.get("summary") == cls.summary and tuple(facts.get("headline_options", ())) == tuple(
                cls.headline_options
            ), name


def test_a_limited_run_is_its_own_run_never_pooled_or_paired_with_another_limit(tmp_path):
    """``task.num_samples=N`` (the quick try) is part of the run's identity: a run of 1 sample gets its own run
    directory, its summary records N, and ``collect`` neither pairs it with full attention's run of 2 samples nor
    pools it with the 2-sample run of the same method."""
    from hydra import compose, initialize_config_dir

    from sparse_eval.results.collect import collect
    from sparse_eval.config import CONF_DIR, register_configs
    from sparse_eval.launcher.runner import run

    register_configs()

    def one(*overrides):
        with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
            cfg = compose(
                config_name="config",
                overrides=[f"paths.runs_dir={tmp_path / 'runs'}", "task.window=64", "print_table=false", *overrides],
            )
        (summary,) = run(cfg)
        return summary

    full2 = one("method=full", "task.num_samples=2")
    topk2 = one("method=topk", "task.num_samples=2")
    topk1 = one("method=topk", "task.num_samples=1")
    assert topk1["run_dir"] != topk2["run_dir"]
    assert topk1["task_config"]["num_samples"] == 1 and topk1["expected_samples"] == 1 and topk1["complete"]
    df = collect(tmp_path / "runs", by_subtask=False).set_index("run_dir")
    assert df.loc[topk2["run_dir"], "n_paired"] == 2  # paired with full attention's run of the same N
    assert df.loc[topk1["run_dir"]].isna()["diff_vs_full"]  # no full attention run of N = 1: no pair
    assert df.loc[topk1["run_dir"], "seed_group"] != df.loc[topk2["run_dir"], "seed_group"]  # never pooled
    assert df.loc[full2["run_dir"], "samples"] == 2
