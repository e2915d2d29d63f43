"""Host syncs of the accuracy path's steady decode step (issue 28: a step to capture must not wait for the device).

A method's index lives in the cache layer's ``CacheTrackedState``, which ``SparseLayer`` drops whenever its keys
change other than by appending, so Quest, DS and MagicPIG need not compare their indexed keys on the device; their
budgets' top-k take a host bound. The test counts the calls that would wait for a GPU (``.item()``, ``int()``,
``bool()`` of a tensor, ``torch.equal``, ``nonzero``, ``tolist``) made directly by sparse_eval's code in steady steps
of a left-padded batch (transformers' own mask preparation is not ours to count)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, SparseCache, attach, cache_kwargs, detach, make_cache
from sparse_eval.methods import METHODS as REGISTRY
from sparse_eval.methods import build_method, make_config
from sparse_eval.methods.base import CacheTrackedState
from sparse_eval.run.run_config import method_options

STORIES = Path(__file__).resolve().parents[2] / "sparse_eval" / "models" / "stories260K"
PACKAGE = str(Path(__file__).resolve().parents[2] / "sparse_eval")
METHODS = sorted(REGISTRY)  # every registered method, a user's plugin included
TENSOR_READS = ("item", "__bool__", "__int__", "__float__", "__index__", "tolist", "nonzero")


@pytest.fixture
def sync_sites(monkeypatch):
    """Records (file:line) of every device-reading call whose direct caller is sparse_eval's code."""
    sites: list[str] = []

    def counted(fn):
        def wrapper(*args, **kwargs):
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(PACKAGE):
                sites.append(f"{caller.f_code.co_filename[len(PACKAGE) + 1 :]}:{caller.f_lineno}")
            return fn(*args, **kwargs)

        return wrapper

    for name in TENSOR_READS:
        monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name)))
    monkeypatch.setattr(torch, "equal", counted(torch.equal))
    monkeypatch.setattr(torch, "nonzero", counted(torch.nonzero))
    return sites


def test_sparse_layer_drops_the_state_on_every_change_but_an_append():
    cache = SparseCache(1)
    layer = cache.layers[0]
    k, v = torch.randn(2, 1, 5, 4), torch.randn(2, 1, 5, 4)
    cache.update(k, v, 0)
    assert isinstance(layer.method_state, CacheTrackedState)
    layer.method_state["x"] = 1
    cache.update(k[:, :, :1], v[:, :, :1], 0)
    assert layer.method_state == {"x": 1}  # an append keeps the index (it is extended incrementally)
    for change in (
        lambda: cache.crop(-2),
        lambda: cache.reorder_cache(torch.tensor([1, 0])),
        lambda: cache.batch_select_indices(torch.tensor([0, 1])),
        lambda: cache.reset(),
    ):
        layer.method_state["x"] = 1
        change()
        assert layer.method_state == {} and isinstance(layer.method_state, CacheTrackedState)


def _stories_method(model, name: str, dense_bias: bool = False):
    """``conf/method/<name>.yaml`` on stories260K with layer 0 dense; ``dense_bias``: MagicPIG's −log u for every
    candidate (``dense_bias_elements``), which needs no gather of the sampled pairs."""
    opts = method_options(name)
    opts["dense_layers"] = [0]
    method = build_method(make_config(opts["name"], opts))
    method.setup(model, "stories260k")
    if dense_bias:
        method.dense_bias_elements = 1 << 40
    return method


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", METHODS)
def test_steady_decode_step_has_no_host_sync(stories, name, sync_sites):
    model = stories
    n_layers = model.config.num_hidden_layers
    method = _stories_method(model, name, dense_bias=name == "magicpig")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=g)
    mask = torch.ones(2, 96, dtype=torch.long)
    mask[1, :17] = 0  # left padding: rows with different first keys
    cache = make_cache(model)
    steps = 3

    def step(tok):
        nonlocal mask
        mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
        out = model(input_ids=tok, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache))
        return out.logits[:, -1].argmax(-1, keepdim=True)

    with torch.inference_mode():
        logits = model(input_ids=ids, attention_mask=mask, use_cache=True, **cache_kwargs(model, cache)).logits
        attach(model, method, Runtime(protocol="A", compute_error=True))
        try:
            tok = step(logits[:, -1].argmax(-1, keepdim=True))  # the first step builds the index
            sync_sites.clear()
            for _ in range(steps):  # the steady steps extend it
                tok = step(tok)
        finally:
            detach(model)
    assert sync_sites == [], f"{name}: steady steps wait for the device at {sorted(set(sync_sites))}"
    assert cache.get_seq_length() == 96 + 1 + steps and n_layers > 1


def test_magicpig_sampled_bias_is_its_one_sync_per_sparse_layer(stories, sync_sites):
    """By default MagicPIG computes −log u on the sampled pairs only: one ``nonzero`` per sparse layer and step
    (``dense_bias_elements`` trades it for ~60 times the eq. 10 work)."""
    model = stories
    method = _stories_method(model, "magicpig")
    ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0))
    cache = make_cache(model)

    def step(tok):
        return model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)

    with torch.inference_mode():
        tok = step(ids)
        attach(model, method, Runtime(protocol="A", compute_error=False))
        try:
            tok = step(tok)  # builds the index
            sync_sites.clear()
            step(tok)
        finally:
            detach(model)
    assert len(sync_sites) == model.config.num_hidden_layers - 1  # one per sparse layer
    assert len(set(sync_sites)) == 1 and sync_sites[0].startswith("methods/magicpig.py")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", METHODS)
def test_steady_decode_step_has_no_cuda_sync(name):
    """The same on the GPU, where it matters, with CUDA's own sync detector: any synchronising call in a steady step
    (ours, transformers' or torch's) raises. MagicPIG with ``dense_bias_elements`` (its sampled bias syncs)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(STORIES, dtype=torch.bfloat16).cuda().eval()
    method = _stories_method(model, name, dense_bias=name == "magicpig")
    ids = torch.randint(3, model.config.vocab_size, (2, 96), generator=torch.Generator().manual_seed(0)).cuda()
    cache = make_cache(model)

    def step(tok):
        return model(input_ids=tok, use_cache=True, **cache_kwargs(model, cache)).logits[:, -1].argmax(-1, keepdim=True)

    with torch.inference_mode():
        tok = step(ids)
        attach(model, method, Runtime(protocol="A", compute_error=True))
        try:
            tok = step(tok)  # builds the index
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                for _ in range(3):
                    tok = step(tok)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        finally:
            detach(model)


@pytest.mark.parametrize(
    "name, options",
    [
        ("quest", dict(budget=16, sink=0, local=0)),
        ("double_sparsity", dict(channels=[[0, 1, 2, 3]] * 4, alpha=0.5, beta=0.2)),
        ("magicpig", dict(K=4, L=12, sink=2, local=4)),
    ],
)
def test_a_plain_state_still_notices_other_keys(name, options):
    """Without the cache's guarantee (a plain dict, e.g. ``generate``'s own DynamicCache) an index is checked on
    the device: other keys with more of them than indexed are re-indexed, as a fresh state would be."""
    from sparse_eval.methods import attend

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, n = 4, 2, 8, 60
    k1, k2 = torch.randn(2, 1, hkv, n + 1, d, generator=g)
    v = torch.randn(1, hkv, n + 1, d, generator=g)
    q1, q2 = torch.randn(2, 1, hq, 1, d, generator=g)
    method = build_method(make_config(name, options))
    plain: dict = {}
    attend(method, q1, k1[:, :, :n], v[:, :, :n], state=plain)  # an index over other keys
    _, reused = attend(method, q2, k2, v, state=plain)
    _, fresh = attend(method, q2, k2, v, state={})
    assert torch.equal(reused["keep"], fresh["keep"])
