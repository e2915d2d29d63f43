"""The run's config typed, checked and frozen once (``run.run_config.run_config``): what the Experiment takes."""

from __future__ import annotations

import dataclasses

import pytest
from omegaconf import OmegaConf

from sparse_eval.config import EvalConfig, PathsConfig
from sparse_eval.models.loading import ModelConfig
from sparse_eval.run.experiment import Experiment
from sparse_eval.run.run_config import RunConfig, run_config
from tests.helpers import cfg_for


def test_run_config_is_typed_and_frozen(tmp_path):
    run = run_config(cfg_for(tmp_path, "method=magicpig", "seed=[0,1]", "eval.batch_size=2"))
    assert isinstance(run.model, ModelConfig) and isinstance(run.eval, EvalConfig)
    assert isinstance(run.paths, PathsConfig) and run.paths.runs_dir == str(tmp_path)
    assert [m.seed for m in run.methods] == [0, 1]  # one per seed of a stochastic method
    assert run.seed == (0, 1) and run.batch_size == 2
    assert run.protocol == "S"  # the default task (wikitext) says S where eval.protocol is null
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 3


def test_run_config_refuses_what_cannot_run_before_a_model_loads(tmp_path):
    with pytest.raises(ValueError, match="eval.protocol='X'"):
        run_config(cfg_for(tmp_path, "eval.protocol=X"))
    with pytest.raises(ValueError, match="eval.batch_size=0"):
        run_config(cfg_for(tmp_path, "eval.batch_size=0"))
    with pytest.raises(ValueError, match="eval.prefill_chunk=0"):
        run_config(cfg_for(tmp_path, "eval.prefill_chunk=0"))
    plain = OmegaConf.to_container(cfg_for(tmp_path), resolve=True)
    plain["eval"]["batch_invariantt"] = False  # a plain mapping has no schema to stop it: this does
    with pytest.raises(ValueError, match="eval.batch_invariantt: no such eval setting"):
        run_config(OmegaConf.create(plain))


def test_the_experiment_takes_only_the_run_config(tmp_path):
    cfg = cfg_for(tmp_path, "method=full", "task.num_samples=1")
    with pytest.raises(TypeError, match="run_config"):
        Experiment(cfg)
    exp = Experiment(run_config(cfg))
    assert isinstance(exp.run, RunConfig) and not hasattr(exp, "cfg")
