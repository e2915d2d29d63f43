"""The contract every registered method meets, driven by the registry (``sparse_eval.methods.METHODS``, so a method
registered at import, a user's included, is checked with no test of its own), with the configs each method declares
(``Method.contract_configs``, ``model_contract_configs``, ``keep_all_options``).  Every number is checked against an
independent computation here (float64, plain torch):

* per-key weights, with static keys present: the output over V = I *is* the attention row, p̂ = softmax(s + b) over
  the kept keys; it must be the method's formula: softmax(s) over the kept keys for a method that only picks keys,
  oracle sampling's w_i on static keys and W_c·f_i/B on sampled ones (MagicPIG eq. 4-5), MagicPIG's e^{s_i}/u_i with
  u_i of eq. 10 from the hash codes (eq. 11);
* est_error = ‖ô − o‖₂/‖o‖₂ and the attention mass against dense attention by softmax in float64;
* Cost1 and Cost2 in [0, 1], Cost2 = kept keys / valid keys per row, the static keys (sink + local) always kept;
* a budget that keeps every key gives full attention's output (where the method has one: ``keep_all_options``);
* causality under protocols S and B on the shipped 5-layer model (changing later tokens moves no earlier logit);
* the engine's NLL under full attention is the model's own ``labels=`` loss;
* resume after a kill: a generation run killed in its second batch, started again, gives every record of a run never
  killed (a planted per-batch sampling seed in ``Engine`` is caught: oracle sampling's records move).

Elsewhere, registry-driven too: batch invariance (``test_invariance.test_records_do_not_depend_on_the_batch``, over
``model_contract_configs``), the system path's token parity (``test_system``, over the system-layer registry), the
store's side of resuming (``test_runner.test_resume_after_interrupted_run``, ``test_batching``).
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch

from sparse_eval.attention.plugin import Runtime, attach, cache_kwargs, detach, make_cache
from sparse_eval.generation.engine import Engine, LoglikelihoodRequest
from sparse_eval.methods import METHODS, Method, MethodConfig, Selection, attend, build_method, make_config

CASES = [
    pytest.param(name, opts, id=f"{name}-{i}")
    for name in sorted(METHODS)
    for i, opts in enumerate(METHODS[name].contract_configs())
]
MODEL_CASES = [
    pytest.param(name, opts, id=f"{name}-{i}")
    for name in sorted(METHODS)
    for i, opts in enumerate(METHODS[name].model_contract_configs())
]

# synthetic decode/prefill block: B rows (row 1 left-padded), Q query rows aligned to the last Q keys, GQA 4:2; N = D
# so that V = I (one-hot values) makes the output row the attention probabilities themselves
B, HQ, HKV, QL, N = 2, 4, 2, 3, 96
D = N
PAD = 11  # left padding of batch row 1
SINK, LOCAL = 2, 4  # static keys forced on for the weights check


def _block(seed: int, identity_values: bool) -> tuple[torch.Tensor, ...]:
    """q [B, Hq, Q, D], k/v [B, Hkv, N, D] float64, valid bool [B, 1, Q, N] (causal, bottom-right; row 1 padded)."""
    g = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(B, HQ, QL, D, generator=g, dtype=torch.float64)  # peaked rows
    k = torch.randn(B, HKV, N, D, generator=g, dtype=torch.float64)
    if identity_values:
        v = torch.eye(N, dtype=torch.float64).expand(B, HKV, N, D).clone()
    else:
        v = torch.randn(B, HKV, N, D, generator=g, dtype=torch.float64)
    rows = torch.arange(QL).view(QL, 1) + (N - QL)
    valid = (torch.arange(N).view(1, N) <= rows).view(1, 1, QL, N).repeat(B, 1, 1, 1)
    valid[1, :, :, :PAD] = False
    return q, k, v, valid


def _scores(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """s = q kᵀ / √d in float64, [B, Hq, Q, N], −inf where not valid."""
    s = q @ k.repeat_interleave(HQ // HKV, 1).transpose(-1, -2) / math.sqrt(q.shape[-1])
    return s.masked_fill(~valid, -math.inf)


def _static(valid: torch.Tensor, sink: int, local: int) -> torch.Tensor:
    """bool [B, 1, Q, N]: the first ``sink`` and the last ``local`` valid keys of each row, by listing them."""
    out = torch.zeros_like(valid)
    for b in range(valid.shape[0]):
        for t in range(valid.shape[2]):
            idx = torch.nonzero(valid[b, 0, t]).flatten().tolist()
            for i in idx[:sink] + (idx[-local:] if local else []):
                out[b, 0, t, i] = True
    return out


def _run(name: str, opts: dict, q, k, v, valid):
    """attend() under ``opts``; returns (output, stats, whether the method's selections carried a logit bias)."""
    method = build_method(make_config(name, opts))
    select, biased = method.select, []

    def spy(ctx):
        sel = select(ctx)
        biased.append(sel.bias is not None)
        return sel

    method.select = spy
    out, st = attend(method, q, k, v, attention_mask=valid)
    return out, st, any(biased)


def _softmax_over(logits: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    return torch.softmax(logits.masked_fill(~keep, -math.inf), -1).masked_fill(~keep, 0.0)


# -- the independent weight formulas of the methods that correct logits ----------------------------------------------


def _draws(budget, n: int) -> int:
    """B of a row with n valid keys: a ratio of n (truncated) or a count."""
    return int(math.floor(n * budget)) if isinstance(budget, float) else int(budget)


def _oracle_weights(method, s, p_hat, keep, static, valid, q, k):
    """MagicPIG eq. 4-5 with exact static keys: ô = Σ_static w_i v_i + W_c Σ_{i∈S} (f_i/B) v_i, w = softmax(s) over
    the valid keys, W_c = 1 − Σ_static w_i.  The counts f_i are read off p̂ and must be positive integers summing to B
    (the draws); the static keys must carry their exact w_i."""
    w = _softmax_over(s, valid.expand_as(s))
    sampled = keep & ~static
    w_c = (w * ~static).sum(-1, keepdim=True)  # [B, Hq, Q, 1]
    n_valid = valid.sum(-1)  # [B, 1, Q]
    expected = torch.where(static.expand_as(s), w, torch.zeros_like(w))
    for b in range(B):
        for h in range(HQ):
            for t in range(QL):
                draws = _draws(method.config.budget, int(n_valid[b, 0, t]))
                idx = torch.nonzero(sampled[b, h, t]).flatten()
                if idx.numel() == 0:
                    continue
                f = p_hat[b, h, t, idx] * draws / w_c[b, h, t]
                counts = f.round()
                assert torch.allclose(f, counts, atol=1e-3), f"draw counts f_i not integers: {f.tolist()}"
                assert counts.min() >= 1 and int(counts.sum()) == draws, (counts.tolist(), draws)
                expected[b, h, t, idx] = w_c[b, h, t] * counts / draws
    return expected


def _upper_tail(r: torch.Tensor, n: int, m: int) -> torch.Tensor:
    """P[Binomial(n, r) ≥ m] for r [N], the terms j = m..n summed in float64 (no cancellation)."""
    j = torch.arange(m, n + 1, dtype=torch.float64)
    coef = torch.tensor([float(math.comb(n, int(x))) for x in j], dtype=torch.float64)
    return (coef * r[:, None] ** j * (1 - r[:, None]) ** (n - j)).sum(-1)


def _magicpig_weights(method, s, p_hat, keep, static, valid, q, k):
    """MagicPIG eq. 8-11 written out per row: k̄_i = k_i − μ (μ: the mean of the row's candidate keys; eq. 8 appends
    √(r² − |k̄_i|²), r = max |k̄_i|), table l's code = the signs of K projections, key i sampled when its code equals
    the query's in ≥ min_collisions of the L tables; u_i = P[Binomial(L, p_i^K) ≥ min_collisions] with
    p_i = 1 − arccos(cos(q, k̄_i))/π (eq. 10); weights ∝ e^{s_i}/u_i on sampled keys and e^{s_i} on static ones
    (eq. 11).  The sampled set is compared too, except for keys with a projection within 1e-4 of a hyperplane
    (float32 rounding may put them on either side)."""
    c = method.config
    cand = valid & ~static  # [B, 1, Q, N]
    w = method.projection(0, D + 1 if c.mips else D).double()  # [D(+1), L·K]
    logits = s.clone()
    for b in range(B):
        for t in range(QL):
            m = cand[b, 0, t]
            for hk in range(HKV):
                kk = k[b, hk]  # [N, D]
                kbar = kk - kk[m].mean(0) if c.center else kk
                if c.mips:
                    norms = kbar.norm(dim=-1)
                    r = norms[m].max()
                    kbar = torch.cat([kbar, (r**2 - norms**2).clamp_min(0).sqrt()[:, None]], -1)
                proj = kbar @ w  # [N, L·K]
                for h in range(hk * HQ // HKV, (hk + 1) * HQ // HKV):
                    qv = q[b, h, t]
                    qproj = qv @ w[:D]
                    same = ((proj > 0) == (qproj > 0)).view(N, c.L, c.K).all(-1).sum(-1)  # collisions per key
                    want = m & (same >= c.min_collisions)
                    sure = ((proj.abs() > 1e-4).all(-1)) & (qproj.abs() > 1e-4).all()
                    assert torch.equal(keep[b, h, t][sure & m], want[sure & m]), (b, h, t)
                    cos = (kbar[:, :D] @ qv) / (kbar.norm(dim=-1) * qv.norm())
                    p = 1 - torch.arccos(cos.clamp(-1, 1)) / math.pi
                    u = _upper_tail(p**c.K, c.L, c.min_collisions)
                    picked = keep[b, h, t] & m
                    logits[b, h, t, picked] = s[b, h, t, picked] - torch.log(u[picked])
    return _softmax_over(logits, keep)


# the shipped methods' formulas, written here; a method of a plugin gives its own (``Method.contract_weights``)
WEIGHTS = {"oracle": _oracle_weights, "magicpig": _magicpig_weights}


def _expected_weights(name: str, opts: dict, s, p_hat, keep, static, valid, q, k) -> torch.Tensor:
    """The weights of the method's formula: the suite's ``WEIGHTS`` for a shipped method, else the class's
    ``contract_weights`` (a plugin's hook)."""
    method = build_method(make_config(name, opts))
    if name in WEIGHTS:
        return WEIGHTS[name](method, s, p_hat, keep, static, valid, q, k)
    expected = method.contract_weights(s, p_hat, keep, static, valid, q, k)
    assert expected is not None, (
        f"{name} corrects its logits (Selection.bias): give its weight formula as {type(method).__name__}."
        "contract_weights (sparse_eval/methods/base.py), or in this suite's WEIGHTS for a shipped method"
    )
    assert expected.shape == s.shape, f"{name}.contract_weights: shape {tuple(expected.shape)}, want {tuple(s.shape)}"
    return expected


# -- on synthetic tensors ----------------------------------------------------------------------------------------------


def _check_weights(name: str, opts: dict) -> None:
    q, k, v, valid = _block(seed=1, identity_values=True)
    opts = opts | {"sink": SINK, "local": LOCAL}
    p_hat, st, biased = _run(name, opts, q, k, v, valid)  # [B, Hq, Q, N]: the output over V = I
    keep = st["keep"]
    s = _scores(q, k, valid)
    static = _static(valid, SINK, LOCAL)
    assert not (keep & ~valid).any() and (keep | ~static).all()  # kept: valid keys only, every static key
    assert torch.equal(p_hat == 0, ~keep)
    torch.testing.assert_close(p_hat.sum(-1), torch.ones(B, HQ, QL, dtype=p_hat.dtype), rtol=0, atol=1e-5)  # fp32 p
    if not biased:
        expected = _softmax_over(s, keep)
    else:
        expected = _expected_weights(name, opts, s, p_hat, keep, static, valid, q, k)
    torch.testing.assert_close(p_hat, expected, rtol=1e-4, atol=1e-7)  # p̂: fp32 scores and softmax


@pytest.mark.parametrize("name,opts", CASES)
def test_per_key_weights_are_the_methods_formula(name, opts):
    """With static keys present, each kept key carries exactly the weight of the method's formula, every other key
    none; a method whose selections carry a logit bias needs its formula: in ``WEIGHTS`` for a shipped method, its
    class's ``contract_weights`` for a plugin's."""
    _check_weights(name, opts)


@dataclasses.dataclass
class _HalvedOddConfig(MethodConfig):
    name: str = "halved_odd_keys"
    factor: float = 0.5


class _HalvedOdd(Method):
    """A plugin-like method: keeps every valid key and multiplies the weight of odd-numbered keys by ``factor``
    (logit bias log factor).  ``formula`` says what its ``contract_weights`` returns: the right formula, a wrong one
    (the bias forgotten) or none."""

    name = "halved_odd_keys"
    config_class = _HalvedOddConfig
    formula = "right"

    def select(self, ctx):
        n = ctx.scores.shape[-1]
        odd = (torch.arange(n, device=ctx.scores.device) % 2 == 1).expand_as(ctx.scores)
        bias = torch.where(odd, math.log(self.config.factor), 0.0).to(ctx.scores.dtype)
        return Selection(keep=ctx.valid.expand_as(ctx.scores), bias=bias)

    def contract_weights(self, s, p_hat, keep, static, valid, q, k):
        if self.formula == "none":
            return None
        odd = torch.arange(s.shape[-1]) % 2 == 1
        logits = s + (math.log(self.config.factor) * odd if self.formula == "right" else 0.0)
        return torch.softmax(logits.masked_fill(~keep, -math.inf), -1).masked_fill(~keep, 0.0)


@pytest.mark.parametrize("formula", ["right", "wrong", "none"])
def test_a_plugin_method_gives_its_weight_formula_on_its_class(monkeypatch, formula):
    """A method not shipped here (registered by a plugin) whose selections carry a bias is checked against its
    class's ``contract_weights``: passes with the right formula, fails with a wrong one, and is refused without."""
    cls = type(f"_HalvedOdd_{formula}", (_HalvedOdd,), {"formula": formula})
    monkeypatch.setitem(METHODS, cls.name, cls)
    if formula == "right":
        _check_weights(cls.name, {})
        return
    with pytest.raises(AssertionError, match="contract_weights" if formula == "none" else "Tensor-likes are not close"):
        _check_weights(cls.name, {})


@pytest.mark.parametrize("name,opts", CASES)
def test_est_error_and_mass_against_dense_attention(name, opts):
    """est_error = ‖ô − o‖₂ / ‖o‖₂ and mass = Σ_{i∈keep} softmax(s)_i per row, o by softmax in float64."""
    q, k, v, valid = _block(seed=2, identity_values=False)
    out, st, _ = _run(name, opts, q, k, v, valid)
    s = _scores(q, k, valid)
    p = _softmax_over(s, valid.expand_as(s))
    o = p @ v.repeat_interleave(HQ // HKV, 1)  # [B, Hq, Q, D]
    err = (out - o).norm(dim=-1) / o.norm(dim=-1)
    assert torch.isfinite(st["est_error"]).all()
    torch.testing.assert_close(st["est_error"].double(), err, rtol=1e-4, atol=1e-5)  # the core's o: fp32 scores
    torch.testing.assert_close(st["mass"].double(), (p * st["keep"]).sum(-1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name,opts", CASES)
def test_costs_lie_in_0_1_and_cost2_counts_the_kept_keys(name, opts):
    """Cost1, Cost2 in [0, 1]; Cost2 = |keep| / n_valid and static_frac = |static| / n_valid per row, n_valid and the
    static keys (the first ``sink`` and last ``local`` valid keys) counted here from the mask."""
    q, k, v, valid = _block(seed=3, identity_values=False)
    _, st, _ = _run(name, opts, q, k, v, valid)
    cfg = make_config(name, opts)
    static = _static(valid, cfg.sink, cfg.local)
    n_valid = valid.sum(-1).double()  # [B, 1, Q]
    keep = st["keep"]
    for what in ("cost1", "cost2"):
        assert ((st[what] >= 0) & (st[what] <= 1)).all(), what
    assert (keep | ~static).all() and not (keep & ~valid).any()
    torch.testing.assert_close(st["cost2"].double(), keep.sum(-1) / n_valid, rtol=1e-6, atol=0)
    torch.testing.assert_close(
        st["static_frac"].double(), (static.sum(-1) / n_valid).expand(B, HQ, QL), rtol=1e-6, atol=0
    )


@pytest.mark.parametrize("name,opts", CASES)
def test_a_budget_that_keeps_every_key_gives_full_attention(name, opts):
    """Under ``keep_all_options(n)`` every valid key is kept and the output is dense attention's."""
    extra = METHODS[name].keep_all_options(N)
    if extra is None:
        doc = (METHODS[name].keep_all_options.__doc__ or "").split("\n\n")[0]
        pytest.skip(f"{name} has no budget that keeps every key: {' '.join(doc.split())}")
    q, k, v, valid = _block(seed=4, identity_values=False)
    out, st, _ = _run(name, opts | extra, q, k, v, valid)
    s = _scores(q, k, valid)
    o = _softmax_over(s, valid.expand_as(s)) @ v.repeat_interleave(HQ // HKV, 1)
    assert torch.equal(st["keep"], valid.expand(B, HQ, QL, N))
    torch.testing.assert_close(out, o, rtol=1e-4, atol=1e-6)
    assert (st["cost2"] == 1).all() and (st["est_error"] < 1e-5).all()


# one config per method for the fused check: the kernel reads only the selection (mask, bias), whatever made it, and
# each check costs seconds in Triton's interpreter
FUSED_CASES = [pytest.param(name, METHODS[name].contract_configs()[0], id=f"{name}-0") for name in sorted(METHODS)]


@pytest.mark.parametrize("name,opts", FUSED_CASES)
def test_the_fused_attention_agrees_with_the_torch_path(name, opts, monkeypatch):
    """A method that declares ``fused_attention``: the same synthetic block (float32: the kernel's dtypes) through the
    fused kernel (``kernels.selected_attention``, Triton's interpreter on the CPU, there with splits of 64 keys: two
    per row) keeps the same keys, and gives the torch path's output and statistics to fp32 rounding (est_error, kept
    mass, top-k recall, costs)."""
    pytest.importorskip("triton")
    if not METHODS[name].fused_attention:
        pytest.skip(f"{name} does not declare Method.fused_attention")
    if not torch.cuda.is_available():
        if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
            pytest.skip("no CUDA and no TRITON_INTERPRET=1")
        from sparse_eval.kernels import selected_attention

        monkeypatch.setattr(selected_attention, "SPLIT", 64)
    q, k, v, valid = (x.float() if x.is_floating_point() else x for x in _block(seed=5, identity_values=False))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    q, k, v, valid = (x.to(dev) for x in (q, k, v, valid))
    runs = []
    for fused in (False, True):
        method = build_method(make_config(name, opts))
        runs.append(attend(method, q, k, v, attention_mask=valid, fused=fused))
    (out, st), (out_f, st_f) = runs
    assert torch.equal(st["keep"], st_f["keep"])
    torch.testing.assert_close(out_f, out, rtol=1e-4, atol=1e-5)
    for what in ("cost1", "cost2", "kv_bytes", "static_frac", "empty", "rows", "topk_recall"):
        assert torch.equal(st_f[what], st[what]), what
    for what in ("est_error", "mass"):
        torch.testing.assert_close(st_f[what], st[what], rtol=1e-4, atol=1e-5)


# -- on the shipped model ------------------------------------------------------------------------------------------


WINDOW = 160  # tokens of the window
CUT = 100  # tokens after this position are replaced
CONTEXT = 40  # protocol B: the dense context (the question, positions CONTEXT.., is sparse)


def _logits(model, method, ids: torch.Tensor, protocol: str) -> torch.Tensor:
    """Logits [T, V] of every position of ids [1, T] with ``method`` attached under ``protocol``."""
    method.setup(model, "stories260k")
    session = attach(model, method, Runtime(protocol=protocol, compute_error=False))
    try:
        with torch.no_grad():
            if protocol == "S":
                with session.phase("sparse"):
                    return model(input_ids=ids, use_cache=False).logits[0]
            cache = make_cache(model)
            kw = cache_kwargs(model, cache) | {"use_cache": True}
            with session.phase("dense"):
                head = model(input_ids=ids[:, :CONTEXT], **kw).logits[0]
            with session.phase("sparse"):
                tail = model(input_ids=ids[:, CONTEXT:], **kw).logits[0]
            return torch.cat([head, tail])
    finally:
        detach(model)


@pytest.mark.parametrize("protocol", ["S", "B"])
@pytest.mark.parametrize("name,opts", MODEL_CASES)
def test_changing_later_tokens_leaves_earlier_outputs_unchanged(stories, name, opts, protocol):
    """Causality: changing the tokens after position CUT leaves every logit at positions <= CUT unchanged, exactly
    (a stochastic method with the same seed: its draws are per call and row).  Protocol S: the whole window is one
    sparse prefill; protocol B: a dense context prefill, then a sparse question.  Layers after the first are sparse."""
    model, _ = stories
    gen = torch.Generator().manual_seed(1)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (1, WINDOW), generator=gen)
    other = ids.clone()
    other[:, CUT + 1 :] = torch.randint(3, vocab, (1, WINDOW - CUT - 1), generator=gen)
    opts = {"dense_layers": [0]} | opts
    a = _logits(model, build_method(make_config(name, opts)), ids, protocol)
    b = _logits(model, build_method(make_config(name, opts)), other, protocol)
    assert not torch.equal(a[CUT + 1 :], b[CUT + 1 :])  # the change is seen after the cut
    diff = (a[: CUT + 1] - b[: CUT + 1]).abs().max().item()
    assert diff == 0.0, f"{name} under protocol {protocol}: logits at positions <= {CUT} moved by {diff:.3g}"


@torch.inference_mode()
def test_nll_is_the_models_own_loss_under_full_attention(stories):
    """Engine's teacher-forced NLL sum of a window, in a left-padded batch and in prefill chunks, equals the model's
    own ``labels=`` loss (transformers: the mean over the len − 1 predicted tokens) times len − 1."""
    model, tok = stories
    gen = torch.Generator().manual_seed(5)
    windows = [[1] + torch.randint(3, model.config.vocab_size, (n - 1,), generator=gen).tolist() for n in (70, 45)]
    refs = []
    for w in windows:
        ids = torch.tensor([w])
        refs.append(float(model(input_ids=ids, labels=ids).loss) * (len(w) - 1))
    session = attach(model, build_method(make_config("full", {})), Runtime(protocol="S"))
    try:
        for chunk in (None, 16):
            got = Engine(model, tok, session, chunk).nll_batch([LoglikelihoodRequest(w) for w in windows])
            assert [r.tokens for r in got] == [len(w) - 1 for w in windows]
            for r, ref in zip(got, refs):
                assert r.nll_sum == pytest.approx(ref, rel=1e-5), chunk
    finally:
        detach(model)


@pytest.mark.parametrize("name,opts", MODEL_CASES)
def test_a_run_killed_in_a_batch_resumes_to_the_records_of_an_unbroken_run(tmp_path, monkeypatch, name, opts):
    """Resume after a kill: a key-value retrieval run on the shipped model (generation, so whatever a method keeps
    between decode steps is exercised) killed while its second batch is scored keeps only its first batch; the same run
    started again finishes the rest, and every record equals that of a run never killed (wall times apart)."""
    from pathlib import Path

    from conftest import records_by_id
    from helpers import cfg_for

    from sparse_eval.run.experiment import Experiment

    from sparse_eval.run.run_config import run_config

    over = (
        "method=full",
        "task=kv_retrieval",
        "task.num_keys=2",
        "task.num_samples=3",
        "task.max_new_tokens=6",
        "eval.batch_size=2",
        "print_table=false",
    )

    def records(run_dir):  # one record per sample, every line a record: else an assertion names what is wrong
        return records_by_id(Path(run_dir, "samples.jsonl"))

    killed = Experiment(run_config(cfg_for(tmp_path / "killed", *over)))
    score, scored = killed.task.score, []

    def dying(sample, result):
        if len(scored) == 2:  # the first sample of the second batch
            raise KeyboardInterrupt
        scored.append(sample.id)
        return score(sample, result)

    monkeypatch.setattr(killed.task, "score", dying)
    with pytest.raises(KeyboardInterrupt):
        killed.run_method(make_config(name, opts))
    _, run_dir = killed.run_dir(make_config(name, opts))
    assert len(records(run_dir)) == 2  # the first batch is stored; nothing of the killed one
    monkeypatch.undo()

    resumed = Experiment(run_config(cfg_for(tmp_path / "killed", *over)))
    assert resumed.run_method(make_config(name, opts))["samples"] == 3
    unbroken = Experiment(run_config(cfg_for(tmp_path / "unbroken", *over)))
    unbroken.run_method(make_config(name, opts))
    _, ref_dir = unbroken.run_dir(make_config(name, opts))
    got, want = records(run_dir), records(ref_dir)
    assert sorted(got) == sorted(want) and len(want) == 3
    for key in want:
        assert got[key] == want[key], (key, sorted(k for k in want[key] if got[key].get(k) != want[key][k]))
