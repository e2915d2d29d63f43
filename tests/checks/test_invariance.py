"""Batch invariance: a sample's record is bit for bit the same alone, in a batch of 7 and in a batch of 50, for
every registered method and protocol (``sparse_eval.invariance``, ``sparse_eval.kernels.invariant``).

The kernels' property (a row's reduction order depends only on its own length counted from its end) is checked
directly, for the torch references (the CPU path) and for the Triton kernels (under Triton's interpreter here; on
the GPU by ``test_records_do_not_depend_on_the_batch_on_the_gpu``), then end to end on the shipped model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from sparse_eval import invariance
from sparse_eval.attention.plugin import Runtime, attach, detach
from sparse_eval.generation.engine import Engine, GenerationRequest, LoglikelihoodRequest
from sparse_eval.invariance import InvarianceViolation, batch_invariant, checker, deterministic_topk
from sparse_eval.checks.batch_invariance import STATS  # the statistics every invariance check compares
from sparse_eval.kernels import invariant as kinv
from sparse_eval.kernels._common import triton_available
from sparse_eval.methods import METHODS, build_method, make_config

# every registered method under the configs it declares for the end-to-end checks (``Method.model_contract_configs``:
# small budgets and static windows, so that it selects within short prompts), e.g. "double_sparsity-1" (DS-Offload)
CONFIGS = {
    f"{name}-{i}": (name, opts)
    for name in sorted(METHODS)
    for i, opts in enumerate(METHODS[name].model_contract_configs())
}


# -- the property the CPU reference relies on: MKL's products, measured ------------------------------------------


def test_mkl_rows_and_columns_from_16_on_do_not_depend_on_the_others():
    """MKL gives a row (column) of a product the same bits whatever the other rows (columns) once there are at least
    16 of them, and different bits below that (``kernels.invariant.MKL_BLOCK``); and within a reduction of at most
    ``K_TILE`` entries, leading zeros change nothing (``K_TILE``)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 300, generator=g), torch.randn(300, 96, generator=g)
    full = torch.mm(a, b)
    for m in (16, 32, 48):
        for off in (0, 5, 16):
            assert torch.equal(torch.mm(a[off : off + m], b), full[off : off + m])
    for n in (16, 32, 80):
        assert torch.equal(torch.mm(a[:16], b[:, :n].contiguous()), full[:16, :n])
    k = kinv.K_TILE
    a2, b2 = torch.randn(4, 16, k - 40, generator=g), torch.randn(4, k - 40, 16, generator=g)
    ref = torch.bmm(a2, b2)
    for p in (1, 7, 40):
        assert torch.equal(torch.bmm(F.pad(a2, (p, 0)), torch.cat([torch.randn(4, p, 16, generator=g), b2], 1)), ref)


# -- kernels: torch references -------------------------------------------------------------------------------------


def _left_pad(x: torch.Tensor, p: int, value: float = 0.0) -> torch.Tensor:
    return F.pad(x, (p, 0), value=value)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_reductions_are_end_aligned(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(6, 300, generator=g, dtype=dtype)
    s = kinv.row_sum_reference(x)
    torch.testing.assert_close(s, x.sum(-1), rtol=1e-5, atol=1e-5)
    sm = kinv.softmax_reference(x)
    torch.testing.assert_close(sm, torch.softmax(x, -1), rtol=1e-5, atol=1e-7)
    cs = kinv.cumsum_reference(x)
    torch.testing.assert_close(cs, x.cumsum(-1), rtol=1e-5, atol=1e-4)
    for p in (1, 13, 212, 700):
        assert torch.equal(kinv.row_sum_reference(_left_pad(x, p)), s)
        assert torch.equal(kinv.row_sum_reference(x[2:5]), s[2:5])
        assert torch.equal(kinv.softmax_reference(_left_pad(x, p, float("-inf")))[:, p:], sm)
        assert torch.equal(kinv.cumsum_reference(_left_pad(x, p))[:, p:], cs)
        assert torch.equal(kinv.cumsum_reference(F.pad(x, (0, p))[..., :300]), cs)  # later entries change nothing


def test_reference_softmax_is_finite_and_exact_for_logits_above_88():
    """exp overflows float32 above 88.7: the reference softmax (the CPU path, and so every softmax inside
    ``batch_invariant()`` and the invariant attention) subtracts each row's max first, so rows of large logits give
    the float64 softmax, finite, and so does the log form; a row of −inf stays NaN as torch's."""
    x = torch.tensor([[100.0, 99.0, 90.0, -5.0], [1000.0, 1000.0, 999.0, 0.0], [89.0, 0.0, 0.0, 0.0]])
    want = torch.softmax(x.double(), -1)
    for got in (kinv.softmax_reference(x), kinv.softmax(x, backend="torch")):
        assert torch.isfinite(got).all(), got
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-12)
    log = kinv.softmax_reference(x, log=True)
    assert torch.isfinite(log).all(), log
    torch.testing.assert_close(log.double(), torch.log_softmax(x.double(), -1), rtol=1e-6, atol=1e-5)
    assert torch.isnan(kinv.softmax_reference(torch.full((1, 3), float("-inf")))).all()
    # the invariant attention over scores far above 88 (q·k/√d ≈ 400): the float64 attention, finite
    g = torch.Generator().manual_seed(0)
    q = 40 * torch.randn(1, 2, 3, 8, generator=g)
    k, v = 3 * torch.randn(1, 1, 6, 8, generator=g), torch.randn(1, 1, 6, 8, generator=g)
    out = kinv.attention(q, k, v, torch.tensor([0]), 1 / 8**0.5, backend="torch")
    s = (q.double() @ k.double().transpose(-1, -2)) / 8**0.5
    assert s.max() > 88
    s = s.masked_fill(~torch.ones(3, 6, dtype=torch.bool).tril(3), float("-inf"))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), torch.softmax(s, -1) @ v.double(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_products_do_not_depend_on_the_batch_or_the_padding(dtype):
    g = torch.Generator().manual_seed(2)
    a = torch.randn(5, 3, 300, generator=g, dtype=dtype)  # 3 rows, K = 300 (a key axis)
    b = torch.randn(5, 300, 24, generator=g, dtype=dtype)
    full = kinv.bmm_reference(a, b)
    torch.testing.assert_close(full, torch.bmm(a, b), rtol=1e-5, atol=1e-4)
    assert torch.equal(kinv.bmm_reference(a[1:3], b[1:3]), full[1:3])
    assert torch.equal(kinv.bmm_reference(a[:, 1:], b), full[:, 1:])
    for p in (1, 100, 300):  # left padding of the reduced axis: zeros in a, anything finite in b
        garbage = torch.randn(5, p, 24, generator=g, dtype=dtype)
        assert torch.equal(kinv.bmm_reference(_left_pad(a, p), torch.cat([garbage, b], 1)), full)
    w = torch.randn(300, 40, generator=g, dtype=dtype)  # a weight: rows of an activation never mix
    x = torch.randn(37, 300, generator=g, dtype=dtype)
    y = kinv.mm_reference(x, w)
    for rows in ((0, 1), (3, 10), (20, 37)):
        assert torch.equal(kinv.mm_reference(x[rows[0] : rows[1]], w), y[rows[0] : rows[1]])
    # a weight broadcast over a batch (matmul of a non-contiguous activation) gives the rows of the mm
    xb = x[:36].view(4, 9, 300)
    assert torch.equal(kinv.bmm_reference(xb, w.expand(4, 300, 40)), y[:36].view(4, 9, 40))


# -- kernels: Triton (interpreter without a GPU) -------------------------------------------------------------------

needs_triton = pytest.mark.skipif(not triton_available(), reason="triton not installed")


def _triton_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_triton_kernels_are_row_and_end_aligned(dtype):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and Triton's interpreter is off")
    dev = _triton_device()
    g = torch.Generator().manual_seed(3)
    a = torch.randn(3, 5, 70, generator=g, dtype=dtype).to(dev)
    b = torch.randn(3, 70, 20, generator=g, dtype=dtype).to(dev)
    c = kinv.bmm(a, b, backend="triton")
    torch.testing.assert_close(c.cpu(), torch.bmm(a.cpu(), b.cpu()), rtol=1e-5, atol=1e-4)
    assert torch.equal(kinv.bmm(a[1:], b[1:], backend="triton"), c[1:])
    # rows keep their place in the tile here: the interpreter's tl.dot (numpy) depends on it, the GPU's does not
    # (``test_records_do_not_depend_on_the_batch_on_the_gpu``)
    assert torch.equal(kinv.bmm(a[:, :3], b, backend="triton"), c[:, :3])
    pad = torch.randn(3, 45, 20, generator=g, dtype=dtype).to(dev)
    assert torch.equal(kinv.bmm(F.pad(a, (45, 0)), torch.cat([pad, b], 1), backend="triton"), c)
    x = torch.randn(4, 1500, generator=g, dtype=dtype).to(dev)
    s = kinv.row_sum(x, backend="triton")
    torch.testing.assert_close(s.cpu(), x.cpu().sum(-1).to(s.dtype), rtol=1e-5, atol=1e-4)
    assert torch.equal(kinv.row_sum(F.pad(x, (700, 0))[1:3], backend="triton"), s[1:3])
    sm = kinv.softmax(x, backend="triton")
    torch.testing.assert_close(sm.cpu(), torch.softmax(x.cpu(), -1).to(sm.dtype), rtol=1e-5, atol=1e-7)
    assert torch.equal(kinv.softmax(F.pad(x, (700, 0), value=float("-inf")), backend="triton")[:, 700:], sm)
    lsm = kinv.softmax(x, log=True, backend="triton")
    torch.testing.assert_close(lsm.cpu(), torch.log_softmax(x.cpu(), -1).to(lsm.dtype), rtol=1e-5, atol=1e-5)


@needs_triton
@pytest.mark.parametrize("window", [0, 20])
def test_triton_attention_is_the_rows_own(window):
    """The dense attention kernel against its reference and sdpa, and a row's output alone = in a left-padded batch
    (prefill: padding by a multiple of the 64-row tile, which keeps each row's place in it, see above; decode: any
    padding)."""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and Triton's interpreter is off")
    dev = _triton_device()
    g = torch.Generator().manual_seed(6)
    b, hq, hkv, n, d = 3, 4, 2, 150, 8
    q, k, v = (torch.randn(b, h, n, d, generator=g).to(dev) for h in (hq, hkv, hkv))
    start = torch.tensor([0, 64, 37], device=dev)
    out = kinv.attention(q, k, v, start, 0.3, window, backend="triton")
    ref = kinv.attention_reference(q.cpu(), k.cpu(), v.cpu(), start.cpu(), 0.3, window)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[2, :, :37].cpu(), torch.zeros_like(out[2, :, :37].cpu()))  # padding rows: zeros
    mask = kinv.attention_mask(start, n, n, window).cpu()[1:2].expand(1, hq, n, n)
    sd = F.scaled_dot_product_attention(
        q[1:2].cpu(),
        k[1:2].cpu().repeat_interleave(2, 1),
        v[1:2].cpu().repeat_interleave(2, 1),
        attn_mask=mask,
        scale=0.3,
    )
    torch.testing.assert_close(out[1:2, :, 64:].cpu(), sd[:, :, 64:], rtol=1e-5, atol=1e-5)
    alone = kinv.attention(q[1:2, :, 64:], k[1:2, :, 64:], v[1:2, :, 64:], start[:1] * 0, 0.3, window, backend="triton")
    assert torch.equal(alone[0], out[1, :, 64:])
    step = kinv.attention(q[:, :, -1:], k, v, start, 0.3, window, backend="triton")  # decode: one row per sample
    for r in (1, 2):
        s = int(start[r])
        one = kinv.attention(
            q[r : r + 1, :, -1:], k[r : r + 1, :, s:], v[r : r + 1, :, s:], start[:1] * 0, 0.3, window, backend="triton"
        )
        assert torch.equal(one[0], step[r])


# -- the aten overrides -----------------------------------------------------------------------------------------------


def test_overrides_compute_what_torch_computes():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 130, generator=g)
    w = torch.randn(20, 130, generator=g)
    bias = torch.randn(20, generator=g)
    ops = {
        "sum": lambda t: t.sum(-1),
        "sum_all": lambda t: t.sum(),
        "sum_dims": lambda t: t.sum((0, 2), keepdim=True),
        "mean": lambda t: t.mean(-1),
        "mean_mid": lambda t: t.mean(1),
        "softmax": lambda t: torch.softmax(t, 1),
        "log_softmax": lambda t: torch.log_softmax(t, -1),
        "logsumexp": lambda t: torch.logsumexp(t, -1),
        "norm": lambda t: t.norm(dim=-1),
        "cumsum": lambda t: t.cumsum(1),
        "linear": lambda t: F.linear(t, w, bias),
        "bmm": lambda t: t @ t.transpose(1, 2),
        "einsum": lambda t: torch.einsum("bqn,bkn->bqk", t, t),
        "double": lambda t: t.double().sum(-1),
        "int_sum": lambda t: (t > 0).sum(-1),
        "silu": F.silu,
        "log1p": lambda t: torch.log1p(t.abs()),
    }
    ref = {k: f(x) for k, f in ops.items()}
    with batch_invariant():
        assert invariance.enabled()
        got = {k: f(x) for k, f in ops.items()}
    assert not invariance.enabled()
    for k in ops:
        assert got[k].dtype == ref[k].dtype and got[k].shape == ref[k].shape, k
        torch.testing.assert_close(got[k], ref[k], rtol=1e-5, atol=1e-5, msg=k)


def test_topk_and_sort_break_ties_by_position_whatever_the_padding():
    x = torch.tensor([[1.0, 3.0, 2.0, 3.0, 3.0, 0.5, 2.0]])
    vals, idx = deterministic_topk(x, 4)
    assert idx.tolist() == [[1, 3, 4, 2]] and vals.tolist() == [[3.0, 3.0, 3.0, 2.0]]
    _, idx_small = deterministic_topk(x, 3, largest=False)
    assert idx_small.tolist() == [[5, 0, 2]]
    for p in (1, 9):
        _, idx_p = deterministic_topk(F.pad(x, (p, 0), value=float("-inf")), 4)
        assert (idx_p - p).tolist() == idx.tolist()
    with batch_invariant():
        assert x.topk(4).indices.tolist() == [[1, 3, 4, 2]]
        assert torch.sort(x, descending=True).indices.tolist() == [[1, 3, 4, 2, 6, 0, 5]]


def test_cpu_pointwise_functions_do_not_depend_on_where_an_element_sits():
    """silu, sigmoid, log1p, ... round differently in the SIMD loop and its scalar remainder on the CPU; inside the
    mode an element's value is the same at any offset of any tensor."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70000, generator=g)
    with batch_invariant():
        for f in (
            F.silu,
            torch.sigmoid,
            lambda t: torch.log1p(t.abs()),
            lambda t: F.gelu(t, approximate="tanh"),
            F.softplus,
            lambda t: t.abs().pow(0.37),
            torch.exp,
        ):
            y = f(x)
            for off, n in ((3, 100), (17, 45), (0, 7), (5, 33333), (11, 40001)):
                assert torch.equal(f(x[off : off + n].clone()), y[off : off + n])


def test_the_checker_catches_order_dependent_operators():
    x = torch.rand(3, 40)
    idx = torch.tensor([0, 1, 0])
    with batch_invariant(), checker():
        x.sum(-1), torch.softmax(x, -1), x.amax(-1), x.argmax(-1)  # routed or exact
        torch.zeros(2, 40).index_add_(0, idx, torch.ones(3, 40))  # integral values: exact in any order
        for bad in (
            lambda: x.prod(-1),
            lambda: torch.zeros(2, 40).index_add_(0, idx, x),
            lambda: F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]),
            lambda: F.layer_norm(x, (40,)),
            lambda: x.var(-1),
        ):
            with pytest.raises(InvarianceViolation, match="batch-invariant"):
                bad()


# -- end to end ----------------------------------------------------------------------------------------------------


def _prompts(n: int, seed: int, lo: int = 20, hi: int = 64, multiple: int | None = None):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (n,), generator=g).tolist()
    if multiple:  # lengths that agree modulo the prefill chunk (protocol S batches only such rows)
        lengths = [hi - multiple * (x % 3) for x in lengths]
    return [[1] + torch.randint(3, 500, (m - 1,), generator=g).tolist() for m in lengths]


def _engine(model, tok, config, protocol, chunk=None, invariant=True):
    method = build_method(make_config(*CONFIGS[config]))
    method.setup(model, "stories260k")
    if hasattr(method, "element_budget"):  # small chunks: chunk boundaries must not depend on the batch either
        method.element_budget = 1 << 16
    session = attach(model, method, Runtime(protocol, batch_invariant=invariant))
    return session, Engine(model, tok, session, chunk)


def _records(session, engine, requests, size, check=False):
    """Per request: (tokens or NLL, stop reason, recorder statistics), run in batches of ``size``."""
    out = []
    for s0 in range(0, len(requests), size):
        batch = requests[s0 : s0 + size]
        session.recorder.reset()
        if check:
            with checker():
                res = engine.run_batch(batch)
        else:
            res = engine.run_batch(batch)
        for i, r in enumerate(res):
            stats = session.recorder.summary(row=i)
            what = (r.tokens, r.stopped_by) if hasattr(r, "stopped_by") else (r.nll_sum, r.tokens)
            out.append((what, {k: stats.get(k) for k in STATS}, stats.get("est_error_per_layer_head")))
    return out


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("protocol,chunk", [("A", None), ("B", None), ("S", 16)])
@torch.inference_mode()
def test_records_do_not_depend_on_the_batch(stories, config, protocol, chunk):
    """Generation and NLL records in one batch (30 prompts of 20-63 tokens, left-padded), in batches of 7 and
    alone are identical to the bit (the batched run under the checker: no order-dependent operator on the path).
    The GPU check below runs the same comparison at batch 50."""
    model, tok = stories
    prompts = _prompts(30, seed=7, multiple=chunk)
    gen = [
        GenerationRequest(p, max_new_tokens=3 + i % 4, context_len=len(p) - 4 - i % 5, key=f"g{i}")
        for i, p in enumerate(prompts)
    ]
    nll = [LoglikelihoodRequest(p, key=f"w{i}") for i, p in enumerate(prompts[:21])]
    session, engine = _engine(model, tok, config, protocol, chunk)
    try:
        for reqs in (gen, nll):
            whole = _records(session, engine, reqs, len(reqs), check=reqs is gen)
            b7 = _records(session, engine, reqs, 7)
            assert b7 == whole
            for i in (0, 13, len(reqs) - 1):
                assert _records(session, engine, [reqs[i]], 1) == [whole[i]]
            if reqs is gen:  # the comparison covered sparse calls (under A: the decode steps)
                assert sum(rec[1]["sparse_rows"] or 0 for rec in whole) > 0
    finally:
        detach(model)


@pytest.mark.parametrize("config", ["full-0", "magicpig-0"])
@torch.inference_mode()
def test_a_chunked_prefill_gives_the_records_it_gives_alone(stories, config):
    """Protocol A with ``prefill_chunk`` (the RULER experiments' 1024): chunk boundaries are laid from the longest
    row's first token, so a row alone and in a batch is cut elsewhere; dense attention laid from each row's first
    key gives its queries the same results either way."""
    model, tok = stories
    prompts = _prompts(9, seed=9, lo=20, hi=70)
    reqs = [GenerationRequest(p, max_new_tokens=4, key=f"c{i}") for i, p in enumerate(prompts)]
    session, engine = _engine(model, tok, config, "A", chunk=16)
    try:
        batch = _records(session, engine, reqs, 9)
        for i in (0, 4, 8):
            assert _records(session, engine, [reqs[i]], 1) == [batch[i]]
    finally:
        detach(model)


@torch.inference_mode()
def test_the_fast_path_stays_close(stories):
    """``batch_invariant=False`` (stock kernels, sdpa): the same records up to rounding."""
    model, tok = stories
    prompts = _prompts(9, seed=8)
    reqs = [GenerationRequest(p, max_new_tokens=4, key=f"f{i}") for i, p in enumerate(prompts)]
    session, engine = _engine(model, tok, "topk-0", "A", invariant=False)
    try:
        fast = _records(session, engine, reqs, 9)
    finally:
        detach(model)
    session, engine = _engine(model, tok, "topk-0", "A")
    try:
        inv = _records(session, engine, reqs, 9)
    finally:
        detach(model)
    for (wa, sa, _), (wb, sb, _) in zip(fast, inv):
        assert wa == wb
        for k in STATS:
            assert sa[k] == pytest.approx(sb[k], rel=1e-4, abs=1e-6), k


# -- on the GPU: a real model, RULER samples of several lengths ------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_records_do_not_depend_on_the_batch_on_the_gpu(tmp_path):
    """Every registered method on SmolLM2-135M-Instruct (when its GGUF is on the machine; else the shipped model),
    bf16, RULER samples at two lengths mixed in one pool (so batches are padded): records at batch 1, 7 and 50 are
    identical.  Writes ``$SPARSE_EVAL_INVARIANCE_OUT`` (a JSON summary) when that variable is set."""
    from sparse_eval.checks.batch_invariance import run_check

    out = os.environ.get("SPARSE_EVAL_INVARIANCE_OUT")
    report = run_check(device="cuda", out=Path(out) if out else tmp_path / "invariance.json")
    assert report["all_identical"], json.dumps(report["mismatches"], indent=1)[:4000]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fused_records_do_not_depend_on_the_batch_on_the_gpu(tmp_path):
    """The same check with ``eval.fused_attention=auto`` (the kernel of ``kernels.selected_attention`` for every
    method that declares it): records at batch 1, 7 and 50 identical.

    It prints, per method, how many of the 50 greedy predictions the fused kernel leaves as the unfused path makes
    them, beside how many a change of summation order alone leaves (the stock kernels, unfused, outside the mode).
    On this 260K-parameter model in bf16 the summation order alone changes up to 38 of the 50 (Double Sparsity on an
    H100, 2026-12-06; full attention 19), so such a count measures the model's sensitivity more than the kernel: issue
    51's "≥ 97 % of the unfused path's predictions" is a measurement on RULER-4K with a real model, not an assertion
    here."""
    from sparse_eval.checks.batch_invariance import run_check

    report = run_check(device="cuda", out=tmp_path / "fused.json", fused="auto", fast_path=())
    n, methods = report["samples"], report["methods"]
    unchanged = {label: f"{m['unfused_identical_tokens']}/{n}" for label, m in methods.items()}
    yardstick = {label: f"{m['plain_identical_tokens']}/{n}" for label, m in methods.items()}
    print("greedy tokens the fused kernel left unchanged, per method:", unchanged)  # every method's, before asserting
    print("... and the stock kernels' summation order (unfused, outside the mode):", yardstick)
    assert report["all_identical"], json.dumps(report["mismatches"], indent=1)[:4000]


def test_the_real_model_check_covers_every_registered_method(tmp_path):
    """The check the GPU test runs (``sparse_eval.checks.batch_invariance``) takes its runs from the registry: every
    registered method under its ``paper_configs`` (a method added as one file is checked with no list to edit).  Two
    of them run here on the shipped model on the CPU (every method's CPU invariance: the tests above); an unknown
    label is refused."""
    from sparse_eval.checks.batch_invariance import method_runs, run_check

    labels = [label for label, _, _ in method_runs()]
    assert {name for _, name, _ in method_runs()} == set(METHODS)
    assert "double_sparsity-offload" in labels and labels[0] == "full"
    report = run_check(
        device="cpu",
        out=tmp_path / "invariance.json",
        model="stories260k",
        per_length=1,
        alone=1,
        max_new_tokens=3,
        methods=("snapkv", "h2o"),
        fast_path=(),
        fused="auto",  # off on the CPU: the comparison with the unfused run must then find every sample unchanged
    )
    assert list(report["methods"]) == ["h2o", "snapkv"]
    assert report["all_identical"], json.dumps(report["mismatches"], indent=1)[:4000]
    assert all(m["unfused_identical_tokens"] == report["samples"] for m in report["methods"].values())
    assert all(0 <= m["plain_identical_tokens"] <= report["samples"] for m in report["methods"].values())
    with pytest.raises(ValueError, match="not a label of the check"):
        run_check(device="cpu", out=tmp_path / "x.json", model="stories260k", methods=("nope",))
