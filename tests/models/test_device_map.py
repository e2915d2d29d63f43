"""``model.device_map``: a model placed over several devices by accelerate gives the records it gives on one device,
bit for bit, for every registered method (``sparse_eval.models.placement``).

On the CPU, accelerate installs its dispatch hooks (``AlignDevicesHook``: each placed module's inputs moved to its
execution device, offloaded weights loaded for each call and dropped after it) only for a map of more than one
device or with ``disk`` in it (a map of ``cpu`` alone loads the model plainly); the map here puts every other layer
on disk, so the run goes through the hooks and through weights that live on ``meta`` between calls.  On a GPU
(``-m gpu``), half the layers on the GPU and half on the CPU (offloaded: run on the GPU), and on two GPUs half on
each (skipped with fewer), records equal the one-GPU run's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine, GenerationRequest, LoglikelihoodRequest
from sparse_eval.methods import METHODS, build_method, make_config
from sparse_eval.models.loading import ModelConfig, load_model, model_identity, resolve_placement
from sparse_eval.models.placement import device_map_of, main_device

# every registered method under the configs it declares for the end-to-end checks (small budgets for short prompts)
CONFIGS = {
    f"{name}-{i}": (name, opts)
    for name in sorted(METHODS)
    for i, opts in enumerate(METHODS[name].model_contract_configs())
}
LAYERS = 5  # the shipped stories260K


def _map(layer_device, rest: str | int = "cpu") -> dict:
    """{module: device} of stories260K: the layers by ``layer_device(i)``, embeddings (tied to the head), final norm,
    rotary embedding and head on ``rest``."""
    dm = {"model.embed_tokens": rest, "model.rotary_emb": rest}
    dm |= {f"model.layers.{i}": layer_device(i) for i in range(LAYERS)}
    return dm | {"model.norm": rest, "lm_head": rest}


def _prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        [1] + torch.randint(3, 500, (int(m) - 1,), generator=g).tolist()
        for m in torch.randint(24, 60, (n,), generator=g)
    ]


@torch.inference_mode()
def _records(model, tok, config: str) -> list:
    """Per request: the result and the recorder's whole summary of its row; generation under protocol A (the
    decode steps sparse) and under protocol B (the question rows sparse: a per-row phase where the rows' contexts end
    at different columns), teacher-forced NLL under protocol S in prefill chunks of 16, in padded batches of 3."""
    name, opts = CONFIGS[config]
    prompts = _prompts(6, seed=3)
    out = []
    for protocol, chunk, reqs in (
        ("A", None, [GenerationRequest(p, max_new_tokens=4, key=f"g{i}") for i, p in enumerate(prompts)]),
        ("B", None, [GenerationRequest(p, 3, len(p) - 3 - i, key=f"q{i}") for i, p in enumerate(prompts[:3])]),
        ("S", 16, [LoglikelihoodRequest(p, key=f"w{i}") for i, p in enumerate(prompts[:3])]),
    ):
        method = build_method(make_config(name, dict(opts)))
        method.setup(model, "stories260k")
        session = attach(model, method, Runtime(protocol))
        engine = Engine(model, tok, session, chunk)
        try:
            for s0 in range(0, len(reqs), 3):
                session.recorder.reset()
                for i, r in enumerate(engine.run_batch(reqs[s0 : s0 + 3])):
                    out.append((dataclasses.astuple(r), session.recorder.summary(row=i)))
        finally:
            detach(model)
    return out


def _hooked(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(getattr(m, "_hf_hook", None)).__name__ == "AlignDevicesHook"]


# -- start-time checks ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields,says",
    [
        (dict(device="cpu", device_map="auto"), "model.device='cpu' and model.device_map are both set"),
        (dict(device_map="everywhere"), "valid: ['auto', 'balanced', 'balanced_low_0', 'sequential']"),
        (dict(device_map={"model.layers.0": "tpu"}), "model.device_map['model.layers.0']='tpu' is not a device"),
        (dict(device_map={"model.layers.0": 7 if not torch.cuda.is_available() else 99}), "is not a device here"),
        (dict(device_map={"model.layers.0": "disk"}), "give model.offload_folder=DIR"),
        (dict(max_memory={"cpu": "1GiB"}), "model.max_memory is only read with model.device_map"),
        (dict(device_map="auto", max_memory="10GiB"), "model.max_memory='10GiB': give {device: size}"),
        (dict(device_map="auto", max_memory={"cpu": -1}), "model.max_memory['cpu']=-1"),
        (dict(device_map="auto", max_memory={"tpu": "1GiB"}), "a model.max_memory key='tpu' is not a device here"),
    ],
)
def test_a_bad_placement_is_refused_at_start_in_one_line(fields, says):
    with pytest.raises(ValueError) as err:
        resolve_placement(ModelConfig(**fields))
    assert says in str(err.value) and "\n" not in str(err.value)


def test_the_defaults_change_nothing():
    """Every ``conf/model/*.yaml`` composes with the three fields unset (the schema's defaults): the model loads on
    ``model.device`` as before, nothing is handed to accelerate.  A map's devices are normalised to accelerate's
    form (a GPU index, "cpu" or "disk")."""
    from hydra import compose, initialize_config_dir

    from sparse_eval.config import CONF_DIR, register_configs, to_plain

    register_configs()
    names = sorted(f.stem for f in (CONF_DIR / "model").glob("*.yaml"))
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        for name in names:
            m = ModelConfig(**to_plain(compose(config_name="config", overrides=[f"model={name}"]).model))
            assert (m.device_map, m.max_memory, m.offload_folder) == (None, None, None), name
    assert resolve_placement(ModelConfig(device="cpu")) == (torch.device("cpu"), None, None)
    gpu = torch.cuda.is_available()
    dev, dm, mem = resolve_placement(
        ModelConfig(device_map={"model.layers.0": "cuda:0" if gpu else "CPU", "lm_head": "cpu"}, max_memory={"cpu": 9})
    )
    assert dm == {"model.layers.0": 0 if gpu else "cpu", "lm_head": "cpu"} and mem == {"cpu": 9}
    assert dev == torch.device("cuda:0" if gpu else "cpu")


# -- on the CPU: through accelerate's hooks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def placed(tmp_path_factory):
    """(plain model, model over a cpu/disk map, tokenizer, the map's config), stories260K in fp32 on the CPU."""
    folder = tmp_path_factory.mktemp("offload")
    plain_cfg = ModelConfig(device="cpu", dtype="float32")
    map_cfg = ModelConfig(
        dtype="float32", device_map=_map(lambda i: "disk" if i % 2 else "cpu"), offload_folder=str(folder)
    )
    plain, tok = load_model(plain_cfg)
    mapped, _ = load_model(map_cfg)
    return plain, mapped, tok, plain_cfg, map_cfg


def test_a_map_goes_through_accelerates_hooks_and_is_no_part_of_the_identity(placed):
    """The map installs ``AlignDevicesHook``s on every placed module (the layers on disk keep their weights on meta
    between calls); the engine's device is the embeddings'; the run's identity is the one of the model on one device
    (the map, its memory bounds and its offload folder enter none of it)."""
    plain, mapped, tok, plain_cfg, map_cfg = placed
    hooked = _hooked(mapped)
    assert {f"model.layers.{i}" for i in range(LAYERS)} <= set(hooked) and "lm_head" in hooked
    assert mapped.model.layers[1].self_attn.q_proj.weight.device.type == "meta"
    assert device_map_of(mapped)["model.layers.1"] == "disk" and device_map_of(plain) is None
    assert main_device(mapped) == torch.device("cpu")
    auto = dataclasses.replace(plain_cfg, device="auto")  # a map leaves model.device at auto
    assert model_identity(map_cfg, mapped, tokenizer=tok) == model_identity(auto, plain, tokenizer=tok)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_records_over_a_device_map_are_those_on_one_device(placed, config):
    """Every registered method (its end-to-end configs; DS-Offload predicts from an offloaded layer's input norm):
    tokens, NLL and every recorded statistic, per layer and head too, bit for bit the plain model's."""
    plain, mapped, tok, *_ = placed
    want = _records(plain, tok, config)
    got = _records(mapped, tok, config)
    assert any(s["sparse_rows"] for _, s in want) or CONFIGS[config][0] == "full"
    assert got == want


def test_a_run_over_a_map_files_its_records_where_the_one_device_run_does(tmp_path):
    """End to end through the runner: ``model.device_map`` on the command line gives the run directory (identity)
    of the run without it, and the same records (wall times apart)."""
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config

    over = (
        "method=topk",
        "method.budget=8",
        "method.local=8",
        "task=kv_retrieval",
        "task.num_keys=2",
        "task.num_samples=2",
        "task.max_new_tokens=4",
        "model.dtype=float32",
        "print_table=false",
    )
    dm = "{" + ",".join(f"{k}:{v}" for k, v in _map(lambda i: "disk" if i >= 3 else "cpu").items()) + "}"
    runs = {}
    for label, extra in (("one", ()), ("map", (f"model.device_map={dm}", f"model.offload_folder={tmp_path / 'off'}"))):
        exp = Experiment(run_config(cfg_for(tmp_path / label, *over, *extra)))
        summary = exp.run_method(make_config("topk", {"budget": 8, "local": 8}))
        assert summary["samples"] == 2
        lines = Path(summary["run_dir"], "samples.jsonl").read_text().splitlines()
        runs[label] = (
            Path(summary["run_dir"]).name,
            [{k: v for k, v in json.loads(x).items() if k != "time_s"} for x in lines],
        )
        if label == "map":
            assert _hooked(exp.model) and summary["device_map"]["model.layers.4"] == "disk"
    assert runs["map"] == runs["one"]


def test_an_lm_eval_task_over_a_map_gives_the_one_device_records(tmp_path):
    """lm-eval's own generation loop (``task=lm_eval``: HFLM over the engine's model, inputs on the engine's device)
    over the same map: the toy task's records equal the one-device run's."""
    from helpers import run_toy_folder

    dm = "{" + ",".join(f"{k}:{v}" for k, v in _map(lambda i: "disk" if i % 2 else "cpu").items()) + "}"
    over = ("task.tasks=[toy_story]", "task.limit=2", "compare=[{name:topk,budget:0.1,local:8}]", "model.dtype=float32")
    runs = {}
    for label, extra in (("one", ()), ("map", (f"model.device_map={dm}", f"model.offload_folder={tmp_path / 'off'}"))):
        (summary,) = run_toy_folder(tmp_path / label, *over, *extra)
        lines = Path(summary["run_dir"], "samples.jsonl").read_text().splitlines()
        runs[label] = [{k: v for k, v in json.loads(x).items() if k not in ("time_s", "run_dir")} for x in lines]
        assert summary["samples"] == 1 and runs[label][0]["sparse_rows"] > 0
    assert runs["map"] == runs["one"]


def test_a_random_checkpoint_of_70b_width_loads_over_a_map(tmp_path):
    """``system.models.write_checkpoint`` (what ``benchmarks/bench_device_map.py`` runs at Llama-3.1-70B's width):
    a folder the accuracy path loads like any model, here narrowed to CPU size, over a cpu/disk map, giving the
    logits of the same checkpoint on one device."""
    from sparse_eval.system.models import SHAPES, write_checkpoint

    assert SHAPES["llama3_1_70b"]["hidden_size"] == 8192 and SHAPES["llama3_1_70b"]["num_hidden_layers"] == 80
    narrow = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)
    ckpt = write_checkpoint(tmp_path / "ckpt", "llama3_1_70b", num_layers=2, dtype=torch.float32, overrides=narrow)
    dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk"}
    dm |= {"model.norm": "disk", "lm_head": "cpu"}
    one, tok = load_model(ModelConfig(name="r70", path=str(ckpt), device="cpu"))
    mapped, _ = load_model(ModelConfig(name="r70", path=str(ckpt), device_map=dm, offload_folder=str(tmp_path / "o")))
    assert "model.layers.1" in _hooked(mapped) and mapped.config.hidden_size == 64
    ids = torch.tensor([tok("Once upon a time")["input_ids"]])
    with torch.inference_mode():
        assert torch.equal(mapped(input_ids=ids).logits, one(input_ids=ids).logits)


# -- on the GPU ------------------------------------------------------------------------------------------------------


def _gpu_records(map_cfg: ModelConfig | None) -> dict:
    model, tok = load_model(map_cfg or ModelConfig(dtype="bfloat16"))
    try:
        return {c: _records(model, tok, c) for c in CONFIGS}
    finally:
        del model
        torch.cuda.empty_cache()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_the_layers_on_the_gpu_and_half_on_the_cpu_give_the_one_gpu_records():
    """bf16 on cuda:0 against layers 0-2 on the GPU and 3-4 offloaded to the CPU (accelerate runs them on the GPU,
    their weights brought for each call): every method's records identical."""
    one = _gpu_records(None)
    half = _gpu_records(ModelConfig(dtype="bfloat16", device_map=_map(lambda i: 0 if i < 3 else "cpu", rest=0)))
    assert half == one


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_layers_over_two_gpus_give_the_one_gpu_records():
    """Layers 0-2 (and the embeddings) on cuda:0, layers 3-4, the final norm and the head on cuda:1: each layer's
    method state, masks and kernels on its own GPU, the records those of one GPU."""
    one = _gpu_records(None)
    dm = _map(lambda i: 0 if i < 3 else 1, rest=0) | {"model.norm": 1}
    two = _gpu_records(ModelConfig(dtype="bfloat16", device_map=dm))
    assert two == one


def test_load_model_asks_for_no_hub_kernels(monkeypatch):
    """transformers >= 5.2x kernelizes a model placed on a GPU at load (a device map) with kernels fetched from the
    hub when `kernels` is installed: the H200 run of the half-GPU test above failed offline on 'kernels-community/
    rotary', and such kernels are not checked for batch invariance.  load_model passes use_kernels=False."""
    import transformers

    from sparse_eval.models.loading import ModelConfig, load_model

    seen = {}
    real = transformers.AutoModelForCausalLM.from_pretrained

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", spy)
    model, _ = load_model(ModelConfig(device="cpu"))
    assert seen.get("use_kernels") is False and not getattr(model, "use_kernels", False)
