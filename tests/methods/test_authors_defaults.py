"""The methods' defaults that are the papers' or the authors' settings (docs/fidelity.md, with the code read there),
pinned where a run takes them (``conf/method/<name>.yaml`` composed by Hydra) and where the Python API takes them
(the config dataclass: ``attend()``, plugins, ``make_config``); and the two agree except where a difference is
documented.  Values that are the harness's own choice (the shared static window ``local=64``, budgets) are not
authors' defaults and are pinned only by the agreement check."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from sparse_eval.config import CONF_DIR, register_configs
from sparse_eval.methods import METHODS, make_config

register_configs()
METHOD_DIR = Path(CONF_DIR) / "method"

# field -> the authors' value, with where it comes from
AUTHORS = {
    "streaming_llm": {
        "sink": 4,  # start_size=4: StartRecentKVCache (streaming_llm/kv_cache.py:26), run_streaming_llama.py
        "dense_layers": [],  # the cache is every layer's
    },
    "h2o": {
        "heavy": 0.1,  # --heavy_ratio 0.1 (h2o_hf/scripts/lm_eval/h2o.sh)
        "sink": 0,  # H2OKVCache_LayerWise keeps heavy + recent keys only
        "dense_layers": [],  # every attention module converted
        "scores": "kept",  # the real-drop cache accumulates the attention over the kept cache (_update_hh_score)
        "window_competes": False,  # the caches pick hh_size among the keys outside the recent window
        "gqa": "query_head",  # hh_score [heads, keys]
    },
    "snapkv": {
        "window_size": 32,  # LongBench configs ablation_c*_w32_k7_maxpool.json; init_snapkv's default
        "kernel_size": 7,  # ibid. (init_snapkv's fallback: 5)
        "pooling": "maxpool",  # ibid. (init_snapkv's fallback: avgpool)
        "sink": 0,  # update_kv keeps the selected prefix keys and the window only
        "local": 0,
        "dense_layers": [],  # init_snapkv in every attention module
        "gqa": "query_head",  # KV heads repeated before update_kv: one selection per query head
    },
    "quest": {
        "page_size": 16,  # chunk_size 16 (the paper, MagicPIG Table 3)
        "dense_layers": [0, 1],  # `q_len > 1 or self.layer_id < 2` runs dense (evaluation/quest_attention.py)
    },
    "magicpig": {
        "K": 10,  # (K, L) = (10, 150): RULER / LongBench (§5)
        "L": 150,
        "min_collisions": 2,  # sampled when colliding in >= 2 tables (eq. 10; cache_ref.py: `>= 2`)
        "center": True,  # keys centered before hashing (§4.3)
        "mips": False,  # eq. 8 not used in the experiments
        "sink": 4,  # sink 4 + local window 64 (§5.1)
        "local": 64,
        "dense_layers": ["first", "mid"],  # layers 0 and 16 of 32 (§5.1), counted over whole-context layers
    },
    "double_sparsity": {
        "label_bits": 4,  # 4-bit label cache (§4.2; the converter drops --q_bits, every module keeps 4)
        "quantize_query": True,  # pseudo_quantize of the query label too
        "channel_type": "qk",  # calibrated qk outlier channels (§4.1, Table 3)
        "sink": 0,  # no static keys
        "local": 0,
        "dense_layers": [0, 1],  # layer_idx < 2 dense (modify_llama.py)
    },
    "topk": {"dense_layers": [0, 1], "budget": 0.06},  # topk_cache.py: layer_idx >= 2 sparse; Table 5's 6 %
    "oracle": {"dense_layers": [0, 1], "budget": 0.1},  # oraclesampling_cache.py; Table 5's 10 % (Cost2 0.01)
}

# (method, field): dataclass default vs YAML value, documented differences
DIFFERENT = {
    # 1024 tokens: the authors' smallest LongBench capacity; the YAML's 0.25 is that share of a 4K prompt, so the
    # default experiment's 512-token windows are compressed (conf/method/snapkv.yaml, docs/fidelity.md SnapKV)
    ("snapkv", "max_capacity_prompt"): (1024, 0.25),
}


def _run_config(name: str) -> dict:
    """The method's options as a run composes them (conf/method/<name>.yaml over its dataclass schema)."""
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", overrides=[f"method={name}"])
    return OmegaConf.to_container(cfg.method, resolve=True)


@pytest.mark.parametrize("name", sorted(AUTHORS))
def test_authors_defaults_are_the_defaults_of_a_run_and_of_the_api(name):
    api = dataclasses.asdict(make_config(name, {}))
    run = _run_config(name)
    for field, want in AUTHORS[name].items():
        assert api[field] == want, f"{name}.{field}: the dataclass default is {api[field]!r}, the authors' {want!r}"
        assert run[field] == want, f"{name}.{field}: a run's default is {run[field]!r}, the authors' {want!r}"


@pytest.mark.parametrize("name", sorted(METHODS))
def test_the_yaml_and_the_dataclass_agree_but_where_documented(name):
    """Every option a method's YAML sets has the dataclass's default value (``attend()`` and a run then mean the
    same method), but the documented differences of ``DIFFERENT``."""
    path = METHOD_DIR / f"{name}.yaml"
    if not path.exists():
        pytest.skip(f"{name} has no YAML")
    api = dataclasses.asdict(make_config(name, {}))
    yml = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "defaults"}
    for field, value in yml.items():
        want = DIFFERENT.get((name, field), (value, value))
        assert (api[field], value) == want, f"{name}.{field}: dataclass {api[field]!r}, {path.name} {value!r}" + (
            "" if (name, field) not in DIFFERENT else f" (documented: {want})"
        )


def test_every_authors_setting_names_a_registered_method_and_field():
    for name, fields in AUTHORS.items():
        assert name in METHODS, name
        assert set(fields) <= {f.name for f in dataclasses.fields(METHODS[name].config_class)}, name
