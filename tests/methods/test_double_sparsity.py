"""Double Sparsity: label scores and top-k against brute force, label bits, calibration, offload, generate()."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import attach_generate, tiny_qwen2
from sparse_eval.methods import attend, build_method, make_config
from sparse_eval.methods.double_sparsity import default_channels_file

REPO = Path(__file__).resolve().parents[2]
MODEL_DIR = REPO / "sparse_eval" / "models" / "stories260K"
CONF_DIR = REPO / "conf"


def ref_quantize(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Reference label quantizer written out per vector: 2^bits - 1 levels between the vector's min and max."""
    if bits == 16:
        return x.double()
    out = torch.empty(x.shape, dtype=torch.float64)
    flat, o = x.reshape(-1, x.shape[-1]).double(), out.view(-1, x.shape[-1])
    levels = 2**bits - 1
    for i, row in enumerate(flat):
        lo, hi = float(row.min()), float(row.max())
        step = (hi - lo) / levels if hi > lo else 1.0 / levels
        o[i] = torch.round((row - lo) / step).clamp(0, levels) * step + lo
    return out


def brute_ds_keep(q, k, channels, r, k_tokens, bits, quantize_query=True, gqa="query_head"):
    """q [Hq, D] one decode row, k [Hkv, N, D], channels [Hq, ≥r] -> bool [Hq, N] (no static keys)."""
    hq, hkv, n = q.shape[0], k.shape[0], k.shape[1]
    g = hq // hkv
    scores = torch.zeros(hq, n, dtype=torch.float64)
    for h in range(hq):
        c = channels[h][:r]
        ql = q[h, c].unsqueeze(0)
        ql = ref_quantize(ql, bits)[0] if quantize_query else ql[0].double()
        kl = ref_quantize(k[h // g][:, c], bits)
        scores[h] = kl @ ql
    if gqa == "kv_head":
        scores = scores.view(hkv, g, n).sum(1, keepdim=True).expand(hkv, g, n).reshape(hq, n)
    keep = torch.zeros(hq, n, dtype=torch.bool)
    keep.scatter_(1, scores.topk(k_tokens, dim=1).indices, True)
    return keep


@pytest.fixture(scope="module")
def stories():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval(), AutoTokenizer.from_pretrained(MODEL_DIR)


def random_channels(layers, heads, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.stack([torch.randperm(d, generator=g) for _ in range(heads)]) for _ in range(layers)])


@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("gqa", ["query_head", "kv_head"])
def test_selection_equals_topk_of_label_scores(bits, gqa):
    torch.manual_seed(0)
    hq, hkv, n, d = 8, 2, 250, 16
    q, k, v = torch.randn(1, hq, 1, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    ch = random_channels(1, hq, d)[0]
    _, st = attend("double_sparsity", q, k, v, channels=ch.tolist(), alpha=0.25, beta=0.08, label_bits=bits, gqa=gqa)
    expected = brute_ds_keep(q[0, :, 0], k[0], ch, 4, int(0.08 * n), bits, gqa=gqa)
    assert torch.equal(st["keep"][0, :, 0], expected)
    assert torch.all(st["channels"] == 4)
    assert torch.allclose(st["cost1"], torch.full_like(st["cost1"], 4 / 32))  # α/2 = r / (2d)
    assert torch.allclose(st["cost2"], torch.full_like(st["cost2"], 20 / n))


def test_all_channels_unquantized_is_exact_topk():
    """α = 1, 16 bits: the label scores are the true scores, so DS picks TopK's keys."""
    torch.manual_seed(1)
    q, k, v = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 180, 8), torch.randn(2, 2, 180, 8)
    ch = random_channels(1, 4, 8)[0]
    _, s_ds = attend("double_sparsity", q, k, v, channels=ch, alpha=1.0, beta=0.1, label_bits=16, quantize_query=False)
    _, s_tk = attend("topk", q, k, v, budget=0.1, sink=0, local=0)
    assert torch.equal(s_ds["keep"], s_tk["keep"])


def test_label_bits_are_honoured():
    """Three keys built so that the top label differs at 4, 8 and 16 bits (q = e_0 reads channel 0)."""
    k = torch.tensor([[0.5, 0.0, 1.0], [0.501, 0.0, 1.02], [0.49, 0.0, 1.615]]).view(1, 1, 3, 3)
    v = torch.randn(1, 1, 3, 3)
    q = torch.tensor([1.0, 0.0, 0.0]).view(1, 1, 1, 3)
    picked, labels = {}, {}
    for bits in (4, 8, 16):
        state: dict = {}
        _, st = attend(
            "double_sparsity", q, k, v, state=state, channels=[[0, 1, 2]], alpha=1.0, beta=1, label_bits=bits
        )
        picked[bits] = int(st["indices"][0][0])
        labels[bits] = state["ds"]["labels"].clone()
        assert torch.allclose(labels[bits][0, 0].double(), ref_quantize(k[0, 0], bits), atol=1e-6)
    assert picked == {4: 2, 8: 0, 16: 1}
    assert torch.equal(labels[16], k.float())  # 16 bits: the label cache holds the keys' channels unquantized
    assert not torch.equal(labels[4], labels[8]) and not torch.equal(labels[8], labels[16])
    with pytest.raises(ValueError, match="label_bits"):
        build_method(make_config("double_sparsity", {"label_bits": 12}))


def test_label_cache_grows_incrementally():
    torch.manual_seed(2)
    hq, hkv, d = 4, 2, 16
    ch = random_channels(1, hq, d)[0]
    k_all, v_all = torch.randn(1, hkv, 80, d), torch.randn(1, hkv, 80, d)
    state: dict = {}
    for n in range(40, 81, 7):
        attend("double_sparsity", torch.randn(1, hq, 1, d), k_all[:, :, :n], v_all[:, :, :n], state=state, channels=ch)
        fresh: dict = {}
        attend("double_sparsity", torch.randn(1, hq, 1, d), k_all[:, :, :n], v_all[:, :, :n], state=fresh, channels=ch)
        assert state["ds"]["n"] == n and torch.equal(state["ds"]["labels"], fresh["ds"]["labels"])


@pytest.mark.parametrize("q_len", [1, 7])
def test_left_padded_batch_equals_rows_alone(q_len):
    torch.manual_seed(3)
    hq, hkv, d = 8, 4, 16
    lens = [64, 97]
    n = max(lens)
    ch = random_channels(1, hq, d)[0]
    qs = [torch.randn(1, hq, q_len, d) for _ in lens]
    ks = [torch.randn(1, hkv, m, d) for m in lens]
    vs = [torch.randn(1, hkv, m, d) for m in lens]
    kb, vb = torch.randn(2, hkv, n, d) * 50, torch.randn(2, hkv, n, d)  # padding holds garbage
    mask = torch.zeros(2, 1, q_len, n, dtype=torch.bool)
    for b, m in enumerate(lens):
        kb[b, :, n - m :], vb[b, :, n - m :] = ks[b], vs[b]
        for r in range(q_len):
            mask[b, 0, r, n - m : n - q_len + r + 1] = True
    for gqa in ("query_head", "kv_head"):
        out, st = attend("double_sparsity", torch.cat(qs), kb, vb, attention_mask=mask, channels=ch, gqa=gqa, beta=0.1)
        for b, m in enumerate(lens):
            o1, s1 = attend("double_sparsity", qs[b], ks[b], vs[b], channels=ch, gqa=gqa, beta=0.1)
            assert torch.allclose(out[b], o1[0], atol=1e-6)
            assert torch.equal(st["keep"][b, ..., n - m :], s1["keep"][0])
            assert not st["keep"][b, ..., : n - m].any()


# -- random channels (DS Table 3's baseline) -----------------------------------------------------------------


def test_random_channels_reproducible_uniform_and_exact():
    """channel_type=random: r = α·d channels per layer and KV head, drawn from method.seed (same seed: same
    channels; another seed or layer: others), shared by the KV head's query heads, and the selection equals the
    brute-force top-k of the (quantized) label scores over exactly those channels."""
    hq, hkv, d, n = 8, 2, 32, 300

    def draw(seed, layer):
        m = build_method(make_config("double_sparsity", {"channel_type": "random", "seed": seed, "alpha": 0.25}))
        m.validate(context=n)
        ch, _ = m._layer_channels(layer, hq, hkv, d, "cpu")
        return m, ch

    m0, ch0 = draw(0, 3)
    assert ch0.shape == (hq, 8)  # r = floor(0.25 * 32)
    assert all(len(set(row.tolist())) == 8 and 0 <= int(row.min()) and int(row.max()) < d for row in ch0)
    g = hq // hkv
    for h in range(hq):  # one draw per KV head, shared inside the group
        assert torch.equal(ch0[h], ch0[(h // g) * g])
    assert not torch.equal(ch0[0], ch0[g])  # the two KV heads drew differently
    assert torch.equal(draw(0, 3)[1], ch0)  # reproducible for a seed
    assert not torch.equal(draw(1, 3)[1], ch0)  # another seed, other channels
    assert not torch.equal(draw(0, 4)[1], ch0)  # another layer, other channels
    # the draw is a uniform subset: over many seeds every channel is picked about r/d = 1/4 of the time
    counts = torch.zeros(d)
    for seed in range(400):
        counts.index_add_(0, draw(seed, 0)[1][0], torch.ones(8))
    assert torch.all((counts / 400 - 0.25).abs() < 0.1), counts / 400
    # the accuracy path selects the top-k of the label scores over those channels (brute force)
    torch.manual_seed(5)
    q, k, v = torch.randn(1, hq, 1, d), torch.randn(1, hkv, n, d), torch.randn(1, hkv, n, d)
    for bits in (16, 4):
        _, st = attend(
            "double_sparsity",
            q,
            k,
            v,
            layer_idx=3,
            channel_type="random",
            seed=0,
            alpha=0.25,
            beta=0.05,
            label_bits=bits,
        )
        expected = brute_ds_keep(q[0, :, 0], k[0], ch0, 8, int(0.05 * n), bits)
        assert torch.equal(st["keep"][0, :, 0], expected)
        assert torch.all(st["channels"] == 8)
    # no calibration file needed; a file or explicit channels alongside random are refused
    with pytest.raises(ValueError, match="random"):
        build_method(make_config("double_sparsity", {"channel_type": "random", "channels_file": "x.json"})).validate()


def test_random_channels_run_through_setup_without_a_file(stories):
    model = stories[0]
    m = build_method(make_config("double_sparsity", {"channel_type": "random", "seed": 7, "beta": 0.1}))
    m.setup(model, "no-calibration-for-this-name")  # would raise FileNotFoundError for a calibrated type
    assert m.provenance()["channels_source"].startswith("random (seed 7")
    torch.manual_seed(6)
    ids = torch.randint(3, 512, (1, 60))
    out, session = attach_generate(model, m, ids, torch.ones_like(ids), model_name="stories260k")
    assert all(torch.isfinite(s).all() for s in out.logits)
    assert session.recorder.summary()["sparse_rows"] > 0


def test_refuses_without_calibration_and_names_the_command(tmp_path, stories):
    model = stories[0]
    method = build_method(make_config("double_sparsity", {}))
    with pytest.raises(FileNotFoundError, match=r"python -m sparse_eval\.calibrate model=no-such-model"):
        method.setup(model, "no-such-model")
    method = build_method(make_config("double_sparsity", {"channels_file": str(tmp_path / "missing.json")}))
    with pytest.raises(FileNotFoundError, match=r"python -m sparse_eval\.calibrate model=stories260k"):
        method.setup(model, "stories260k")
    # attend() without channels: also refuses, naming the command
    q, k = torch.randn(1, 8, 1, 8), torch.randn(1, 4, 20, 8)
    with pytest.raises(ValueError, match=r"python -m sparse_eval\.calibrate"):
        attend("double_sparsity", q, k, k)
    # the shipped calibration loads
    assert default_channels_file("stories260k").exists()
    build_method(make_config("double_sparsity", {})).setup(model, "stories260k")


# -- calibration -----------------------------------------------------------------------------------------

TINY_TEXT = (
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park. "
    "One day, she saw a big, red ball. She wanted to play with it. "
) * 3


def test_calibration_is_deterministic_and_matches_brute_force(stories):
    from sparse_eval.calibrate import calibrate, dumps

    model, tok = stories
    runs = [
        dumps(calibrate(model, tok, TINY_TEXT, model_name="stories260k", block_size=32, command="test"))
        for _ in range(2)
    ]
    assert runs[0] == runs[1]
    res = json.loads(runs[0])
    assert res["model"]["name"] == "stories260k" and res["calibration"]["tokens"] == res["calibration"]["blocks"] * 32
    # independent recomputation of layer 0's mean |q∘k| (after RoPE) and |q| (before RoPE)
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ids = torch.tensor(tok(TINY_TEXT)["input_ids"][: res["calibration"]["tokens"]]).view(-1, 32)
    layer = model.model.layers[0]
    sums_qk, sums_q = 0, 0
    with torch.no_grad():
        for row in ids:
            x = model.model.embed_tokens(row.view(1, -1))
            h = layer.input_layernorm(x)
            pos = torch.arange(32).view(1, -1)
            cos, sin = model.model.rotary_emb(h, pos)
            q = layer.self_attn.q_proj(h).view(1, 32, 8, 8).transpose(1, 2)
            k = layer.self_attn.k_proj(h).view(1, 32, 4, 8).transpose(1, 2)
            qr, kr = apply_rotary_pos_emb(q, k, cos, sin)
            sums_qk = sums_qk + (qr * kr.repeat_interleave(2, 1)).abs().double().sum((0, 2))
            sums_q = sums_q + q.abs().double().sum((0, 2))
    mean_qk = sums_qk / ids.numel()
    assert torch.allclose(torch.tensor(res["scores"]["qk"][0], dtype=torch.float64), mean_qk, rtol=1e-4)
    assert torch.allclose(torch.tensor(res["scores"]["q"][0], dtype=torch.float64), sums_q / ids.numel(), rtol=1e-4)
    for kind, heads in (("qk", 8), ("q", 8), ("k", 4)):
        ch = torch.tensor(res["channels"][kind])
        assert ch.shape == (5, heads, 8)
        assert torch.all(ch.sort(-1).values == torch.arange(8))  # permutations
        sc = torch.tensor(res["scores"][kind]).gather(-1, ch)
        assert torch.all(sc[..., :-1] >= sc[..., 1:])  # best first


def test_calibrate_hydra_app(tmp_path):
    """The Hydra app composes from conf/calibrate.yaml and writes a file the method can load."""
    from hydra import compose, initialize_config_dir

    from sparse_eval.calibrate import run

    text = tmp_path / "tiny.txt"
    text.write_text(TINY_TEXT, encoding="utf-8")
    out = tmp_path / "cal.json"
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="calibrate", overrides=[f"data={text}", "block_size=32", f"output={out}"])
    run(cfg, command="python -m sparse_eval.calibrate ...")
    res = json.loads(out.read_text())
    assert res["calibration"]["data"] == "file:tiny.txt" and res["calibration"]["block_size"] == 32
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        bad = compose(config_name="calibrate", overrides=["rope=sideways"])
    with pytest.raises(ValueError, match="rope"):
        run(bad)


# -- offload and generate ----------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["stories", "qwen2"])
@pytest.mark.parametrize("offload", [False, True])
def test_generate_runs(which, offload, stories):
    if which == "stories":
        model, vocab, name, opts = stories[0], 512, "stories260k", {}
    else:
        model, vocab, name = tiny_qwen2(), 128, "tiny-qwen2"
        opts = {"channels": random_channels(4, 8, 8).tolist()}
    torch.manual_seed(4)
    ids = torch.randint(3, vocab, (2, 70))
    mask = torch.ones_like(ids)
    mask[0, :9] = 0
    method = build_method(make_config("double_sparsity", {"beta": 0.1, "offload": offload, **opts}))
    out, session = attach_generate(model, method, ids, mask, model_name=name)
    assert out.sequences.shape == (2, 75)
    assert all(torch.isfinite(s).all() for s in out.logits)
    summ = session.recorder.summary()
    assert summ["sparse_rows"] > 0 and summ["cost2"] < 0.2
    if offload:  # layers 2.. are predicted from their predecessor (recorded even though layer 1 is dense)
        assert all(v == 0.0 for v in summ["offload_own_query_per_layer"].values())
        assert 0.0 <= summ["offload_recall"] <= 1.0


@pytest.mark.parametrize("offload_input", ["residual", "attn_input"])
def test_offload_predicts_from_previous_layer(stories, offload_input):
    """The approximate query of layer l is layer l's q_proj + RoPE applied to layer l-1's input: the residual
    stream x (up to a positive per-token scale) or the normalized attention input."""
    from sparse_eval.attention.plugin import Runtime, attach, detach
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    model = stories[0]
    method = build_method(
        make_config(
            "double_sparsity", {"offload": True, "offload_input": offload_input, "dense_layers": [], "beta": 0.1}
        )
    )
    method.setup(model, "stories260k")
    seen: dict[int, torch.Tensor] = {}
    residual: dict[int, torch.Tensor] = {}
    orig = method._predicted_query

    def spy(ctx):
        q = orig(ctx)
        seen[ctx.layer_idx] = None if q is None else q.clone()
        return q

    method._predicted_query = spy
    hooks = [
        layer.register_forward_pre_hook(
            lambda m, a, kw, i=i: residual.__setitem__(i, (kw.get("hidden_states", a[0] if a else None))),
            with_kwargs=True,
        )
        for i, layer in enumerate(model.model.layers)
    ]
    session = attach(model, method, Runtime(protocol="S"))
    try:
        ids = torch.randint(3, 512, (1, 40))
        with torch.no_grad():
            model(input_ids=ids)
    finally:
        detach(model)
        for hk in hooks:
            hk.remove()
    assert seen[0] is None  # layer 0 has no predecessor: own query
    summ = session.recorder.summary()
    assert summ["offload_own_query_per_layer"][0] == 1.0
    assert all(summ["offload_own_query_per_layer"][l] == 0.0 for l in range(1, 5))
    pos = torch.arange(40).view(1, -1)
    for l in range(1, 5):
        x = residual[l - 1]
        inp = x if offload_input == "residual" else model.model.layers[l - 1].input_layernorm(x)
        attn = model.model.layers[l].self_attn
        with torch.no_grad():
            q = attn.q_proj(inp).view(1, 40, 8, 8).transpose(1, 2)
            cos, sin = model.model.rotary_emb(q, pos)
            q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        got = seen[l]
        if offload_input == "residual":  # same direction per token (positive scale 1 / rms(x))
            ratio = got.norm(dim=-1) / q.norm(dim=-1)  # [1, H, T]
            assert torch.allclose(got, q * ratio.unsqueeze(-1), atol=1e-5)
            assert torch.allclose(ratio, ratio[:, :1], rtol=1e-4)  # one scale per token, for every head
        else:
            assert torch.allclose(got, q, atol=1e-5)
