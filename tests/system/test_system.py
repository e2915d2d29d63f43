"""The system path (``sparse_eval.system``): same tokens as the accuracy path on the shipped model, eager and with
the static-shape step of ``cuda_graph=true``, the offload gather kernel against torch indexing, clear errors for
what it does not support.  ``gpu``-marked tests run the same checks with the Triton kernels, a pinned host cache
and the step captured in a CUDA graph on CUDA."""

from __future__ import annotations

import re
import time

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine
from sparse_eval.methods import METHODS
from sparse_eval.methods.registry import build_method
from sparse_eval.system import DecodeOptions, decode
from sparse_eval.system.layers import SYSTEM_LAYERS

NEW = 16
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def prompts(stories):
    from sparse_eval.tasks.wikitext import BUNDLED  # the WikiText-2 head shipped in the package

    _, tok = stories
    text = BUNDLED.read_text(encoding="utf-8")
    return [tok(text[:4000])["input_ids"][:260], tok(text[4000:8000])["input_ids"][:260]]


def _accuracy_tokens(model, tok, cfg, ids):
    m = build_method(cfg)
    m.setup(model, "stories260k")
    session = attach(model, m, Runtime(protocol="A", compute_error=False))
    try:
        return Engine(model, tok, session).generate(ids, NEW, stop_token_ids=[]).tokens
    finally:
        detach(model)


def _system(model, cfg, ids, **kw):
    m = build_method(cfg)
    m.setup(model, "stories260k")
    return decode(model, m, torch.tensor(ids), NEW, DecodeOptions(**kw))


def _labelled(hook: str) -> dict[str, dict]:
    """The labelled configs ``hook`` (a ``Method`` classmethod) gives for every method with a system layer."""
    out: dict[str, dict] = {}
    for name in SYSTEM_LAYERS:
        for label, cfg in getattr(METHODS[name], hook)().items():
            assert label not in out and cfg["name"] == name, (label, cfg)
            out[label] = cfg
    return out


# every method with a system layer, under the configs it declares (``Method.system_contract_configs``: tokens that
# differ from full attention on these prompts, so that equality is not trivial) ...
CONFIGS = _labelled("system_contract_configs")
# ... and for the static step those and its own edge cases (``Method.static_step_contract_configs``)
GRAPH_CONFIGS = CONFIGS | _labelled("static_step_contract_configs")


@pytest.fixture(scope="module")
def full_tokens(stories, prompts):
    """Full attention's greedy tokens of prompt 0 on the accuracy path."""
    model, tok = stories
    return _accuracy_tokens(model, tok, dict(name="full"), prompts[0])


def test_full_equals_accuracy_path(stories, prompts):
    model, tok = stories
    ref = _accuracy_tokens(model, tok, dict(name="full"), prompts[0])
    got = _system(model, dict(name="full"), [prompts[0]], backend_gpu="torch")
    assert got.tokens[0].tolist() == ref
    assert len(got.step_ms) == NEW - 1 and got.batch == 1 and got.context == len(prompts[0])


def test_every_system_layer_is_covered():
    """Each method with a system layer declares configs for the parity checks below."""
    for name in SYSTEM_LAYERS:
        assert name in {cfg["name"] for cfg in GRAPH_CONFIGS.values()}, name


@pytest.mark.parametrize("which", sorted(CONFIGS))
def test_same_tokens_as_accuracy_path(stories, prompts, full_tokens, which):
    """Greedy tokens of the system layers (label cache, predicted prefetch, hash tables + CPU kernel + LSE merge)
    equal the accuracy path's for the same method and seed, for each row of a batch, and differ from full
    attention's (so the check can fail)."""
    model, tok = stories
    cfg = CONFIGS[which]
    got = _system(model, cfg, prompts, backend_gpu="torch")
    for row, ids in enumerate(prompts):
        ref = _accuracy_tokens(model, tok, cfg, ids)
        assert got.tokens[row].tolist() == ref, f"row {row}"
    assert got.tokens[0].tolist() != full_tokens
    if cfg.get("offload"):
        # dense predecessor layers: every sparse layer used a predicted query, no own-query fallback
        assert got.stats.get("offload_own_query", 0) == 0
    if "sampled" in got.stats:  # a sampling layer sampled some of its candidates
        assert 0 < got.stats["sampled"] < got.stats["candidates"]


def test_phase_times_break_down_the_magicpig_steps(stories, prompts):
    """decode(phase_times=True) times MagicPIG's phases over the steps after the first (the table build), they fit
    inside the steps they were taken in, and the tokens are those of an untimed decode; a captured step refuses it."""
    model, _ = stories
    cfg = CONFIGS["magicpig"]
    plain = _system(model, cfg, [prompts[0]], backend_gpu="torch")
    timed = _system(model, cfg, [prompts[0]], backend_gpu="torch", phase_times=True)
    assert timed.tokens.tolist() == plain.tokens.tolist()
    ms = timed.stats["phase_ms"]
    assert set(ms) == {
        "magicpig_codes_to_host",
        "magicpig_cpu_sample",
        "magicpig_cpu_attention",
        "magicpig_static_attention_merge",
    }
    assert timed.stats["phase_steps"] == NEW - 2
    assert all(v > 0 for v in ms.values()) and sum(ms.values()) < sum(timed.step_ms[1:])
    assert "phase_ms" not in plain.stats
    with pytest.raises(ValueError, match="phase_times=true times eager steps"):
        _system(model, CONFIGS["ds"], [prompts[0][:80]], cuda_graph=True, phase_times=True)


def test_ds_offload_first_layer_falls_back_to_own_query(stories, prompts):
    model, tok = stories
    cfg = dict(name="double_sparsity", beta=0.05, offload=True, dense_layers=[])
    got = _system(model, cfg, [prompts[0]], backend_gpu="torch")
    assert got.stats["offload_own_query"] == NEW - 1  # layer 0 has no predecessor, once per decode step
    assert got.tokens[0].tolist() == _accuracy_tokens(model, tok, cfg, prompts[0])


def test_repeat_batch_tiles_rows(stories, prompts):
    model, _ = stories
    cfg = CONFIGS["magicpig"]
    one = _system(model, cfg, [prompts[0]], backend_gpu="torch")
    three = _system(model, cfg, [prompts[0]], backend_gpu="torch", repeat_batch=3)
    assert three.batch == 3 and three.tokens.shape == (3, NEW)
    for row in range(3):
        assert three.tokens[row].tolist() == one.tokens[0].tolist()


# a registered method without a system layer (None when every method has one)
NO_SYSTEM_PATH = next((name for name in sorted(METHODS) if name not in SYSTEM_LAYERS), None)


def test_a_method_without_a_system_path_fails_naming_the_valid_ones(stories, prompts):
    if NO_SYSTEM_PATH is None:
        pytest.skip("every registered method has a system layer")
    model, _ = stories
    with pytest.raises(ValueError, match=re.escape(f"has no system path; valid: {list(SYSTEM_LAYERS)}")):
        _system(model, dict(name=NO_SYSTEM_PATH), [prompts[0][:80]])


@pytest.mark.parametrize(
    "cfg, match",
    [
        (dict(name="quest", update_pages=False), "update_pages=false"),
        (dict(name="magicpig", u_offset=1e-4, dense_layers=[0]), "u_offset"),
        (dict(name="magicpig", mips=True, dense_layers=[0]), "mips"),
        (dict(name="double_sparsity", sink=4), "sink=4"),
        (dict(name="double_sparsity", label_bits=2), "label bits=2"),
    ],
)
def test_unsupported_settings_fail_clearly(stories, prompts, cfg, match):
    model, _ = stories
    with pytest.raises(ValueError, match=match):
        _system(model, cfg, [prompts[0][:80]])


def test_capacity_and_input_errors(stories, prompts):
    model, _ = stories
    with pytest.raises(ValueError, match="max_new_tokens=0"):
        decode(model, build_method(dict(name="full")), torch.tensor([prompts[0]]), 0)
    with pytest.raises(ValueError, match="expected \\[B, T\\]"):
        decode(model, build_method(dict(name="full")), torch.tensor(prompts[0]), 4)


@pytest.mark.parametrize("which", sorted(GRAPH_CONFIGS))
def test_static_step_gives_the_same_tokens(stories, prompts, full_tokens, which):
    """The static-shape step of ``cuda_graph=true`` (write at a device position, attend over the capacity with
    length masks, device-side budgets, top-k_cap then ``count``) decodes the same tokens as the eager layers, and
    so as the accuracy path, on every row, with either top-k (a sparse method's tokens differing from full
    attention's); with repeat_batch the tiled rows repeat the first row."""
    model, tok = stories
    cfg = GRAPH_CONFIGS[which]
    dense = METHODS[cfg["name"]].dense
    eager = _system(model, cfg, prompts, backend_gpu="torch")
    static = _system(model, cfg, prompts, backend_gpu="torch", cuda_graph=True)
    assert static.tokens.tolist() == eager.tokens.tolist()
    if not dense:  # the sorted torch.topk of k_cap, first budget(n) kept
        by_sort = _system(model, cfg, prompts, backend_gpu="torch", cuda_graph=True, topk="torch")
        assert by_sort.tokens.tolist() == eager.tokens.tolist()
    assert len(static.step_ms) == NEW - 1
    assert static.tokens[0].tolist() == _accuracy_tokens(model, tok, cfg, prompts[0])
    assert (static.tokens[0].tolist() == full_tokens) == dense
    if "sampled" in eager.stats:  # every static step sampled, as the eager ones did
        assert static.stats["sampled"] == eager.stats["sampled"] > 0
        assert static.stats["candidates"] == eager.stats["candidates"]
        # one timed host part per sparse layer and static step (all but the prefill's token and the eager first step)
        sparse = model.config.num_hidden_layers - len(cfg["dense_layers"])
        assert static.stats["host_parts"] == (NEW - 2) * sparse
        assert static.stats["host_sample_ms"] > 0 and static.stats["host_attention_ms"] > 0
    if cfg.get("offload"):  # the same layers predicted or fell back to their own query (layer 0 when it is sparse)
        assert static.stats.get("offload_own_query", 0) == eager.stats.get("offload_own_query", 0)
        assert (static.stats.get("offload_own_query", 0) > 0) == (0 not in build_method(cfg).config.dense_layers)
    tiled = _system(model, cfg, [prompts[1]], backend_gpu="torch", cuda_graph=True, repeat_batch=2)
    assert tiled.tokens.tolist() == [eager.tokens[1].tolist()] * 2


@pytest.mark.slow  # 30-40 s in the Triton interpreter; each kernel's CPU check: tests/kernels/test_kernels_triton.py
@pytest.mark.skipif(CUDA, reason="CPU model in the interpreter; on CUDA: test_gpu_system_path_matches_accuracy_path")
def test_magicpig_with_the_triton_kernels(stories, prompts):
    """MagicPIG's GPU part through its Triton kernels (query and overflow-key codes; the static keys' attention
    merged with the CPU part in one launch; the interpreter without CUDA) decodes the accuracy path's tokens."""
    pytest.importorskip("triton")
    model, tok = stories
    cfg = CONFIGS["magicpig"]
    got = _system(model, cfg, [prompts[0]], backend_gpu="triton")
    assert got.tokens[0].tolist() == _accuracy_tokens(model, tok, cfg, prompts[0])
    assert 0 < got.stats["sampled"] < got.stats["candidates"]


@pytest.mark.slow  # 30-40 s in the Triton interpreter; each kernel's CPU check: tests/kernels/test_kernels_triton.py
@pytest.mark.skipif(CUDA, reason="CPU model in the interpreter; on CUDA: test_gpu_cuda_graph_matches_accuracy_path")
def test_static_step_with_the_triton_kernels(stories, prompts):
    """The static DS step through the Triton kernels (label append and scores, the radix top-k with the device
    budgets as counts, attention over the capacity; in the interpreter without CUDA, so few steps) decodes the
    tokens of the eager torch layers on both rows; a bad ``topk`` fails naming the valid ones."""
    pytest.importorskip("triton")
    from sparse_eval.methods.base import budget_bound

    model, _ = stories
    m = build_method(GRAPH_CONFIGS["ds_budget_grows"])  # 4 new tokens: n = 261..264
    m.setup(model, "stories260k")
    ids = torch.tensor(prompts)
    assert [max(1, budget_bound(0.0266, n)) for n in (261, 264)] == [6, 7] and ids.shape[1] == 260
    eager = decode(model, m, ids, 4, DecodeOptions(backend_gpu="torch"))
    radix = decode(
        model, m, ids, 4, DecodeOptions(backend_gpu="triton", cuda_graph=True, label_scale_dtype=torch.float32)
    )
    assert radix.tokens.tolist() == eager.tokens.tolist()
    with pytest.raises(ValueError, match="topk='heap': valid values are \\['radix', 'torch'\\]"):
        DecodeOptions(topk="heap")


@pytest.mark.parametrize(
    "gqa, budget, ps, sink, local, backend",
    [
        ("query_head", 0.105, 4, 5, 7, "torch"),  # 6 pages up to n = 266, then 7 = k_cap
        ("kv_head", 0.1194, 16, 4, 16, "torch"),  # 1 page up to n = 268, then 2 = k_cap
        ("query_head", 40, 8, 0, 0, "torch"),  # a token count: 5 pages, no static keys
        ("kv_head", 0.5, 8, 3, 300, "torch"),  # the local window covers the whole context: no candidates
        pytest.param(  # page scores, radix top-k, attention: Triton (interpreter on CPU; slow: about 16 s)
            "query_head", 0.105, 4, 5, 7, "triton", marks=pytest.mark.slow
        ),
        ("kv_head", 0.1194, 16, 4, 16, "triton"),  # the same kernels (interpreter on CPU), about 6 s
    ],
)
def test_static_quest_layer_equals_the_eager_layer(gqa, budget, ps, sink, local, backend):
    """Layer level, on random keys: the static Quest step (page bounds folded in at the device position, every
    page of the capacity scored, a device count of pages in k_cap slots, fixed sink/local slots) attends the same
    keys as the eager step at every length, so its outputs agree to float rounding."""
    from sparse_eval.system.layers import QuestLayer, StaticStep

    if backend == "triton":
        pytest.importorskip("triton")
    dev = "cuda" if CUDA and backend == "triton" else "cpu"
    gen = torch.Generator().manual_seed(3)
    # 16 steps; 10 where Triton is interpreted on the CPU: enough to cross the page counts above (n = 271)
    b, hq, hkv, d, t, steps = 2, 4, 2, 16, 261, 10 if backend == "triton" and dev == "cpu" else 16
    k = torch.randn(b, hkv, t + steps, d, generator=gen).to(dev)
    v = torch.randn(b, hkv, t + steps, d, generator=gen).to(dev)
    q = torch.randn(b, hq, steps, d, generator=gen).to(dev)
    kw = dict(page_size=ps, budget=budget, sink=sink, local=local, gqa=gqa, backend=backend)
    eager, static = QuestLayer(0, t + steps, **kw), QuestLayer(0, t + steps, **kw)
    for layer in (eager, static):
        layer.update(k[:, :, :t], v[:, :, :t])
    st = StaticStep(t, b, dev)
    static.static = st
    for j in range(steps):
        kn, vn, qj = k[:, :, t + j : t + j + 1], v[:, :, t + j : t + j + 1], q[:, :, j : j + 1]
        eager.update(kn, vn)
        static.update(kn, vn)
        o_e = eager.decode(None, None, qj, kn, vn, d**-0.5)
        o_s = static.decode(None, None, qj, kn, vn, d**-0.5)
        assert torch.allclose(o_s, o_e, atol=1e-5, rtol=1e-5), j
        st.advance()
    assert torch.equal(static.kmin, eager.kmin) and torch.equal(static.kmax, eager.kmax)


def test_token_budget_rule_host_and_device_forms():
    """``methods.base.token_budget``, the one budget rule: ⌊β·n⌋ for a ratio (exactly, checked with fractions of the
    float's exact value, except where β·n rounds to an integer in float64), β for a count; its host form (ints) and
    device form (tensors) agree, and the static step's budgets are max(1, min(n, rule)) per row."""
    from fractions import Fraction

    from sparse_eval.methods.base import budget_bound, token_budget
    from sparse_eval.system.layers import StaticStep

    betas = (0.0625, 0.1, 0.0266, 0.3, 1.0, 3, 50)
    ns = torch.arange(0, 3000)
    for beta in betas:
        dev = token_budget(beta, ns)
        assert dev.dtype == torch.long and dev.tolist() == [token_budget(beta, int(n)) for n in ns]
        for n in (0, 1, 7, 261, 264, 2999):
            if isinstance(beta, int):
                assert token_budget(beta, n) == beta
            elif float(n * beta) != Fraction(n) * Fraction(beta):  # β·n not exact in float64: the product rounds
                assert token_budget(beta, n) in (int(Fraction(n) * Fraction(beta)), int(n * beta))
            else:
                assert token_budget(beta, n) == int(Fraction(n) * Fraction(beta))
            assert budget_bound(beta, n) == min(n, token_budget(beta, n))
    assert [token_budget(0.1, n) for n in (9, 10, 19, 20)] == [0, 1, 1, 2]
    st = StaticStep(5, 3, "cpu")
    for _ in range(200):
        n = int(st.lengths[0])
        for beta in betas:
            assert st.budget(beta).tolist() == [max(1, min(n, token_budget(beta, n)))] * 3, (beta, n)
        st.advance()
    assert int(st.pos) == 205


def test_pieces_run_each_host_part_after_its_piece_has_finished(monkeypatch):
    """``capture.Pieces`` with the CUDA graph API recorded instead of run: capturing a step with two host parts gives
    three pieces in one pool, each run once right after its capture; a replay runs them in capture order with each host
    part after a wait for its piece (its copies to the host); ``abort`` ends an open capture."""
    from sparse_eval.system import capture

    events = []

    class Graph:
        made = 0

        def __init__(self):
            Graph.made += 1
            self.i = Graph.made

        def capture_begin(self, pool=None):
            events.append(("begin", self.i, pool))

        def capture_end(self):
            events.append(("end", self.i))

        def replay(self):
            events.append(("replay", self.i))

    class Stream:
        def synchronize(self):
            events.append(("wait",))

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: "pool")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    pieces = capture.Pieces()
    pieces.begin()
    pieces.cut(lambda: events.append(("host", "a")))
    pieces.cut(lambda: events.append(("host", "b")))
    pieces.end()
    assert events == [
        ("begin", 1, "pool"),
        ("end", 1),
        ("replay", 1),
        ("wait",),
        ("host", "a"),
        ("begin", 2, "pool"),
        ("end", 2),
        ("replay", 2),
        ("wait",),
        ("host", "b"),
        ("begin", 3, "pool"),
        ("end", 3),
        ("replay", 3),
    ]
    events.clear()
    pieces.replay()
    assert events == [("replay", 1), ("wait",), ("host", "a"), ("replay", 2), ("wait",), ("host", "b"), ("replay", 3)]
    events.clear()
    other = capture.Pieces()
    other.begin()
    other.abort()
    other.abort()  # nothing open any more: no second capture_end
    assert events == [("begin", 4, "pool"), ("end", 4)]


def test_interleaved_replay_runs_one_halfs_host_part_while_the_other_halfs_piece_runs(monkeypatch):
    """``capture.replay_interleaved`` with the graph API recorded: the GPU queue is A0 B0 A1 B1 A2 B2; each host part
    waits for its own piece only (the event recorded right after it) and is followed at once by its chain's next piece,
    so A's host part i runs while B's piece i is queued and B's while A's piece i + 1 is."""
    from sparse_eval.system import capture

    log = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            log.append(("replay", self.name))

    class Event:
        def __init__(self, after):
            self.after = after

        def synchronize(self):
            log.append(("wait", self.after))

    class Stream:
        def record_event(self):
            return Event(next(e[1] for e in reversed(log) if e[0] == "replay"))

    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a: Stream())
    chains = []
    for c in "AB":
        p = capture.Pieces.__new__(capture.Pieces)
        p.graphs = [Graph(f"{c}{i}") for i in range(3)]
        p.hosts = [lambda c=c, i=i: (time.sleep(0.01), log.append(("host", f"{c}{i}"))) for i in range(2)] + [None]
        p.wait_s = p.host_s = 0.0
        chains.append(p)
    capture.replay_interleaved(chains)
    assert all(p.host_s >= 0.02 and p.wait_s < p.host_s for p in chains)  # each chain's host parts timed as its own
    assert log == [
        ("replay", "A0"),
        ("replay", "B0"),
        ("wait", "A0"),
        ("host", "A0"),
        ("replay", "A1"),
        ("wait", "B0"),
        ("host", "B0"),
        ("replay", "B1"),
        ("wait", "A1"),
        ("host", "A1"),
        ("replay", "A2"),
        ("wait", "B1"),
        ("host", "B1"),
        ("replay", "B2"),
    ]
    chains[1].graphs.pop()
    with pytest.raises(ValueError, match=r"interleaved chains have \[3, 2\] pieces"):
        capture.replay_interleaved(chains)


@pytest.mark.parametrize("which", ["magicpig", "ds_offload"])
def test_interleaved_halves_decode_each_rows_own_tokens(stories, prompts, which):
    """``interleave=2`` decodes the two halves of the rows as two sessions (their own caches, tables, prefill and
    static steps): each row gets the tokens it gets in one decode, split by prompts or by tiling; MagicPIG samples
    as many keys in all.  Bad combinations fail with the valid ones."""
    model, _ = stories
    cfg = GRAPH_CONFIGS[which]
    eager = _system(model, cfg, prompts, backend_gpu="torch")
    got = _system(model, cfg, prompts, backend_gpu="torch", cuda_graph=True, interleave=2)
    assert got.tokens.tolist() == eager.tokens.tolist()
    assert len(got.step_ms) == NEW - 1 and got.batch == 2
    if which == "magicpig":
        assert got.stats["sampled"] == eager.stats["sampled"] > 0
    tiled = _system(model, cfg, [prompts[1]], backend_gpu="torch", cuda_graph=True, repeat_batch=3, interleave=2)
    assert tiled.tokens.tolist() == [eager.tokens[1].tolist()] * 3 and tiled.batch == 3
    with pytest.raises(ValueError, match="interleave=2 .* needs cuda_graph=true"):
        _system(model, cfg, prompts, interleave=2)
    with pytest.raises(ValueError, match="interleave=3: valid values are 1"):
        _system(model, cfg, prompts, cuda_graph=True, interleave=3)
    with pytest.raises(ValueError, match="got batch 2, repeat_batch 2"):
        _system(model, cfg, prompts, cuda_graph=True, interleave=2, repeat_batch=2)


@pytest.mark.parametrize("which", ["ds_offload", "ds", "magicpig"])
def test_prefill_inputs_are_not_kept(stories, prompts, which, monkeypatch):
    """Only DS-Offload keeps layer inputs (for its prediction), and only decode steps' [B, 1, H] ones: when a captured
    decode tiles its caches right after the prefill, no layer's [B, T, H] prefill input is still referenced (at
    96K on Llama-3.1-8B those were 26 GB on the GPU)."""
    from sparse_eval.system import decoding

    seen = []
    prefill = decoding._prefill_for_static

    def spy(model, session, *args, **kwargs):
        got = prefill(model, session, *args, **kwargs)
        seen.append({i: h.shape[1] for i, (h, _) in session.inputs.items()})
        return got

    monkeypatch.setattr(decoding, "_prefill_for_static", spy)
    model, _ = stories
    got = _system(model, GRAPH_CONFIGS[which], [prompts[0]], backend_gpu="torch", cuda_graph=True, repeat_batch=2)
    assert seen == [{}]  # (MagicPIG's first, eager step ran before its tiling: it keeps nothing either)
    if which == "ds_offload":  # the decode steps still had their inputs: every layer after the first predicted
        assert got.stats.get("offload_own_query", 0) == 0


def test_cuda_graph_refuses_what_it_cannot_run(stories, prompts):
    model, _ = stories
    # MagicPIG's static step needs a full local window after the sink (sink 4 + local 64 > 40 + 1 tokens)
    with pytest.raises(ValueError, match="n = 41, local = 64, sink = 4: decode with cuda_graph=false"):
        _system(model, CONFIGS["magicpig_default"], [prompts[0][:40]], cuda_graph=True)


def test_offload_gather_matches_indexing():
    """kernels.offload.gather_rows (Triton, in the interpreter without CUDA) == torch indexing, with −1 padding,
    GQA (selection per query head) and bf16 rows moved bit for bit."""
    pytest.importorskip("triton")
    from sparse_eval.kernels import offload

    gen = torch.Generator().manual_seed(0)
    src = torch.randn(2, 2, 40, 16, generator=gen).to(torch.bfloat16)
    for hs in (2, 4):
        idx = torch.randint(-1, 40, (2, hs, 9), generator=gen, dtype=torch.int32)
        ref = offload.gather_rows_reference(src, idx, torch.zeros(2, hs, 9, 16, dtype=torch.bfloat16))
        dev = "cuda" if CUDA else "cpu"
        s = src.pin_memory() if CUDA else src
        got = offload.gather_rows(
            s, idx.to(dev), torch.zeros(2, hs, 9, 16, dtype=torch.bfloat16, device=dev), backend="triton"
        )
        assert torch.equal(got.cpu(), ref)
        assert ref[idx < 0].abs().sum() == 0 and ref[idx >= 0].abs().sum() > 0


def test_offload_put_rows_matches_indexing():
    """kernels.offload.put_rows (Triton, in the interpreter without CUDA) writes a step's rows at a position read on
    the device, into a token-major host cache as the offloaded layers hold it, exactly as torch indexing does;
    rows past the cache are dropped (the reference refuses them)."""
    pytest.importorskip("triton")
    from sparse_eval.kernels import offload

    gen = torch.Generator().manual_seed(1)
    dev = "cuda" if CUDA else "cpu"
    for t in (1, 3):
        src = torch.randn(2, 3, t, 16, generator=gen).to(torch.bfloat16)
        host = torch.zeros(40, 2, 3, 16, dtype=torch.bfloat16)  # [N, B, Hkv, D]
        host = host.pin_memory() if CUDA else host
        got = offload.put_rows(src.to(dev), host.permute(1, 2, 0, 3), torch.tensor([7], device=dev), backend="triton")
        ref = offload.put_rows_reference(src, torch.zeros(2, 3, 40, 16, dtype=torch.bfloat16), torch.tensor([7]))
        if CUDA:
            torch.cuda.synchronize()
        assert torch.equal(got.cpu(), ref) and ref[:, :, 7 : 7 + t].abs().sum() > 0
    edge = torch.zeros(2, 3, 40, 16, dtype=torch.bfloat16)
    edge = edge.pin_memory() if CUDA else edge
    offload.put_rows(src.to(dev), edge, torch.tensor([38], device=dev), backend="triton")  # 3 rows from 38: 2 fit
    if CUDA:
        torch.cuda.synchronize()
    assert torch.equal(edge[:, :, 38:], src[:, :, :2]) and edge[:, :, :38].abs().sum() == 0
    with pytest.raises(IndexError, match="pos 38 \\+ 3 rows is outside the cache's 40 rows"):
        offload.put_rows_reference(src, torch.zeros(2, 3, 40, 16, dtype=torch.bfloat16), torch.tensor([38]))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("which", ["full", "ds", "ds_offload", "magicpig", "quest"])
def test_gpu_system_path_matches_accuracy_path(stories, prompts, which):
    """On CUDA (Triton kernels, pinned host cache read by the GPU, numba CPU part), fp32 model: the same
    tokens as the accuracy path on the same device, on both rows (the Triton attention multiplies fp32 tiles in
    IEEE fp32: with TF32, Triton's default, row 1 of ds_offload took another key at a label-score near-tie)."""
    model, tok = stories
    model = model.to("cuda")
    try:
        cfg = dict(name="full") if which == "full" else CONFIGS[which]
        got = _system(model, cfg, prompts, label_scale_dtype=torch.float32)
        for row, ids in enumerate(prompts):
            ref = _accuracy_tokens(model, tok, cfg, torch.tensor(ids, device="cuda"))
            assert got.tokens[row].tolist() == ref, f"row {row}"
        assert got.memory["gpu_peak"] > 0
    finally:
        model.to("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize(
    "which",
    [
        "full",
        "ds",
        "ds_kv_head_8bit",
        "ds_budget_grows",
        "quest",
        "quest_budget_grows",
        "magicpig",
        "magicpig_default",
        "ds_offload",
        "ds_offload_own_query",
    ],
)
def test_gpu_cuda_graph_matches_accuracy_path(stories, prompts, which):
    """On CUDA the static step is captured once and replayed (MagicPIG's in pieces, one more than its sparse
    layers): still the accuracy path's tokens, on both rows; and with the rows in two halves whose steps run
    interleaved (``interleave=2``)."""
    model, tok = stories
    model = model.to("cuda")
    try:
        cfg = GRAPH_CONFIGS[which]
        got = _system(model, cfg, prompts, label_scale_dtype=torch.float32, cuda_graph=True)
        assert got.stats["graph_capture_ms"] > 0
        if which.startswith("magicpig"):
            sparse = model.config.num_hidden_layers - len(cfg["dense_layers"])
            assert got.stats["graph_pieces"] == sparse + 1
        for row, ids in enumerate(prompts):
            ref = _accuracy_tokens(model, tok, cfg, torch.tensor(ids, device="cuda"))
            assert got.tokens[row].tolist() == ref, f"row {row}"
        if which.startswith(("magicpig", "ds_offload")):  # two halves, their pieces interleaved
            halves = _system(model, cfg, prompts, label_scale_dtype=torch.float32, cuda_graph=True, interleave=2)
            assert halves.tokens.tolist() == got.tokens.tolist()
    finally:
        model.to("cpu")


def _cli(runs, *args):
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        [sys.executable, "-m", "sparse_eval.system", *args, f"paths.runs_dir={runs}"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_cli_decodes_and_checks_against_accuracy_path(tmp_path):
    out = tmp_path / "rec.json"
    res = _cli(
        tmp_path,
        "method=magicpig",
        "method.dense_layers=[0]",
        "method.K=10",
        "method.L=20",
        "method.local=16",
        "context=128",
        "new_tokens=6",
        "batch=2",
        "phase_times=true",
        f"output={out}",
    )
    assert res.returncode == 0, res.stderr
    assert "accuracy path: 2/2 rows and 12/12 tokens identical" in res.stdout
    assert "phases, ms per step over the 4 steps after the first" in res.stdout and "magicpig_cpu_sample" in res.stdout
    import json

    rec = json.loads(out.read_text())
    assert rec["batch"] == 2 and rec["tokens_per_s"] > 0 and rec["memory_bytes"]["cache_cpu"] > 0
    assert rec["method"]["K"] == 10 and rec["method"]["L"] == 20


def test_cli_static_step(tmp_path):
    out = tmp_path / "rec.json"
    res = _cli(
        tmp_path,
        "method=double_sparsity",
        "method.beta=0.05",
        "cuda_graph=true",
        "context=128",
        "new_tokens=5",
        f"output={out}",
    )
    assert res.returncode == 0, res.stderr
    assert "static step" in res.stdout and "accuracy path: 1/1 rows and 5/5 tokens identical" in res.stdout
    res = _cli(
        tmp_path, "method=double_sparsity", "method.offload=true", "cuda_graph=true", "context=128", "new_tokens=5"
    )
    assert res.returncode == 0, res.stderr
    assert "static step" in res.stdout and "accuracy path: 1/1 rows and 5/5 tokens identical" in res.stdout
    res = _cli(tmp_path, "method=magicpig", "method.dense_layers=[0]", "cuda_graph=true", "context=40", "new_tokens=3")
    assert res.returncode == 2 and "n = 41, local = 64, sink = 4: decode with cuda_graph=false" in res.stderr


def test_cli_rejects_a_method_without_system_path(tmp_path):
    if NO_SYSTEM_PATH is None:
        pytest.skip("every registered method has a system layer")
    res = _cli(tmp_path, f"method={NO_SYSTEM_PATH}", "new_tokens=2")
    assert res.returncode == 2
    assert f"method={NO_SYSTEM_PATH!r} has no system path; valid: {list(SYSTEM_LAYERS)}" in res.stderr


@pytest.mark.parametrize("backend_cpu", ["auto", "torch"])
def test_magicpig_layer_sample_equals_brute_force(backend_cpu):
    """The MagicPIG layer's sample set -- hash tables of the keys before the local window at the first step, plus
    the overflow list of keys that left the window since -- equals brute-force collision counting over all those
    keys' codes (eq. 10's rule), as cache positions, valid entries first and ascending, for GQA rows."""
    import contextlib
    import types

    import sparse_eval.kernels.magicpig as kmp
    import sparse_eval.kernels.magicpig_cpu as kmc
    from sparse_eval.system.layers import MagicPIGLayer

    k_bits, n_tables, m, sink = 3, 6, 2, 2  # few bits: many collisions, so the overflow keys get sampled too
    method = build_method(
        dict(name="magicpig", K=k_bits, L=n_tables, min_collisions=m, sink=sink, local=4, dense_layers=[0])
    )
    layer = MagicPIGLayer(1, 64, method, backend_gpu="torch", backend_cpu=backend_cpu)
    gen = torch.Generator().manual_seed(0)
    layer.update(torch.randn(2, 2, 30, 16, generator=gen), torch.randn(2, 2, 30, 16, generator=gen))
    session = types.SimpleNamespace(
        stats=__import__("collections").Counter(), phase=lambda name: contextlib.nullcontext()
    )
    for _ in range(7):
        kn, vn = torch.randn(2, 2, 1, 16, generator=gen), torch.randn(2, 2, 1, 16, generator=gen)
        layer.update(kn, vn)
        layer.decode(session, None, torch.randn(2, 4, 1, 16, generator=gen), kn, vn, 0.25)
    assert layer.n_over == 6 and layer.cand_end == layer.table_end + 6  # the first step built the tables
    q_codes = kmp.hash_codes(torch.randn(2, 4, 16, generator=gen), layer.w, k_bits, n_tables, backend="torch")
    idx, cnt = layer._sample(q_codes)
    keys = layer.keys[:, :, sink : layer.cand_end].float() - layer.mean[:, :, None]
    ref_idx, ref_cnt = kmc.sample_reference(
        kmp.hash_codes(keys, layer.w, k_bits, n_tables, backend="torch"), q_codes, m
    )
    assert cnt.tolist() == ref_cnt.tolist()
    for b in range(2):
        for h in range(4):
            c = int(cnt[b, h])
            assert idx[b, h, :c].tolist() == (ref_idx[b, h, :c] + sink).tolist()
            assert (idx[b, h, c:] == -1).all()
    assert (idx >= layer.table_end).any() and ((idx >= 0) & (idx < layer.table_end)).any()


def test_system_layers_are_registered_by_method_name():
    """Each method with a system path has one layer class registered under its name (``methods.METHODS``' names),
    with a ``from_method``; a second class for a name, or one without ``from_method``, is refused; an unknown name
    lists the valid ones."""
    from sparse_eval.system.layers import layer_class, register_layer

    assert SYSTEM_LAYERS and set(SYSTEM_LAYERS) <= set(METHODS)
    for name, cls in SYSTEM_LAYERS.items():
        assert layer_class(name) is cls and callable(cls.from_method)
    first, other = list(SYSTEM_LAYERS)[0], list(SYSTEM_LAYERS.values())[-1]
    with pytest.raises(ValueError, match="registered twice"):
        register_layer(first)(type("Other", (other,), {}))
    with pytest.raises(TypeError, match="from_method"):
        register_layer("no_such_method")(object)
    with pytest.raises(
        ValueError, match=re.escape(f"method 'no_such_method' has no system path; valid: {list(SYSTEM_LAYERS)}")
    ):
        layer_class("no_such_method")
    assert "no_such_method" not in SYSTEM_LAYERS
