"""H2O and SnapKV: the keys each row keeps, exactly, against the authors' algorithms written out here from their code
(plain float64 torch, one sequence and one head at a time, none of the package's helpers), on small random tensors.

* H2O, the real-drop KV cache (``FMInference/H2O``, ``h2o_hf/utils_real_drop/modify_llama.py``,
  ``H2OKVCache_LayerWise``): after each forward, the rows' attention over the cache is summed into ``hh_score`` per
  head and key (``_update_hh_score``); once the cache holds more than ``hh_size + recent_size`` keys it keeps the
  ``hh_size`` keys of the largest score among all but the last ``recent_size`` and the last ``recent_size``
  (``__call__``).  Protocol A: the prompt is one dense forward, then one token per step; protocol S: one token per
  step from the first.  The package's defaults with ``heavy=hh_size``, ``local=recent_size + 1``.
* H2O, the lm-eval simulation (``h2o_hf/utils_lm_eval/modify_llama.py`` at 1603343, ``local_heavy_hitter_mask`` and
  the band of ``LlamaAttention_heavy_hitter.forward``), which ``scores=full window_competes=true sink=0
  heavy=hb-1 local=recent+1`` reproduces (sparse_eval/methods/h2o.py).
* SnapKV (``FasterDecoding/SnapKV``, ``snapkv/monkeypatch/snapkv_utils.py``, ``SnapKVCluster.update_kv``): the last
  ``window_size`` prompt queries' causal softmax over the prompt keys, summed over those rows for the keys before the
  window, pooled along the keys (kernel ``kernel_size``, stride 1, padding ``kernel_size // 2``), the top
  ``max_capacity_prompt - window_size`` of the pooled votes kept with the window's keys; a prompt shorter than
  ``max_capacity_prompt`` is kept whole.  Generated keys are appended to the compressed cache.

Max pooling makes runs of equal pooled votes, whose order at the k-th place ``topk`` leaves to the kernel: there the
check is that exactly k prefix keys are kept, every key whose pooled vote is above the k-th largest and none below
it; average pooling (no ties) is checked key for key.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sparse_eval.methods import attend, build_method, make_config, sparse_attention

HQ, HKV, D = 4, 2, 16
G = HQ // HKV
PAD = 5  # left padding of batch row 1


def _tensors(seed: int, b: int, t: int):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D] float64 (peaked rows), and the causal key masks bool [B, 1, T, T] with
    batch row 1 left-padded by ``PAD``."""
    g = torch.Generator().manual_seed(seed)
    q = 2.0 * torch.randn(b, HQ, t, D, generator=g, dtype=torch.float64)
    k = torch.randn(b, HKV, t, D, generator=g, dtype=torch.float64)
    v = torch.randn(b, HKV, t, D, generator=g, dtype=torch.float64)
    valid = torch.ones(t, t, dtype=torch.bool).tril().view(1, 1, t, t).repeat(b, 1, 1, 1)
    if b > 1:
        valid[1, :, :, :PAD] = False
        valid[1, :, :PAD, :] = False  # the padding's own query rows see nothing
    return q, k, v, valid


def _one_sequence(q, k, row: int, head: int):
    """The unpadded tokens of batch row ``row``, query head ``head`` and the KV head it reads: q, k [T', D]."""
    first = PAD if row == 1 else 0
    return q[row, head, first:], k[row, head // G, first:]


def _softmax_row(q_row: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    return torch.softmax(keys @ q_row / math.sqrt(D), -1)


# -- H2O: the authors' real-drop cache --------------------------------------------------------------------------------


def authors_h2o_cache(q: torch.Tensor, k: torch.Tensor, prompt: int, hh_size: int, recent_size: int) -> list:
    """``H2OKVCache_LayerWise`` driven as ``H2OLlamaAttention.forward`` drives it, for one head of one sequence
    (q, k [T, D]): a dense forward over the first ``prompt`` tokens, then one token per forward.  Returns, for every
    position t >= prompt, the sorted list of the key positions its query attends (the cache before it + its own)."""
    t_all = q.shape[0]
    cache: list[int] = []  # positions of the keys in the cache, in cache order
    score: dict[int, float] = {}  # hh_score of each cached key

    def evict():
        nonlocal cache
        if len(cache) <= hh_size + recent_size:  # ``seq_len <= self.cache_size``: nothing dropped
            return
        older = cache[: len(cache) - recent_size]  # ``hh_score[:, :seq_len - self.recent_size]``
        heavy = sorted(older, key=lambda j: -score[j])[:hh_size]  # ``torch.topk(..., self.hh_size)``
        cache = sorted(heavy) + cache[len(cache) - recent_size :]
        for j in list(score):
            if j not in cache:
                del score[j]

    # prefill: causal dense attention of the prompt rows, summed over the rows (``_update_hh_score``, first call)
    for i in range(prompt):
        p = _softmax_row(q[i], k[: i + 1])
        for j in range(i + 1):
            score[j] = score.get(j, 0.0) + float(p[j])
    cache = list(range(prompt))
    evict()
    attended = []
    for t in range(prompt, t_all):
        keys = cache + [t]  # the cache with the new token's key appended (``torch.cat([past_key_value[0], ...])``)
        attended.append(sorted(keys))
        p = _softmax_row(q[t], k[keys])  # the row's attention over the cache (what ``self.kv_cache`` is given)
        for j, pj in zip(keys, p.tolist()):
            score[j] = score.get(j, 0.0) + pj
        cache = keys
        evict()
    return attended


def _h2o(opts):
    return build_method(make_config("h2o", opts))


def _kept(keep_row: torch.Tensor, first: int) -> list[int]:
    """The kept key positions of one row, counted from the row's first real token."""
    return [j - first for j in torch.nonzero(keep_row).flatten().tolist()]


HH, RECENT = 5, 4  # the authors' hh_size and recent_size
H2O_DEFAULTS = {"heavy": HH, "local": RECENT + 1}  # sink 0, scores kept, window_competes false: the defaults


def test_h2o_defaults_are_the_authors_real_drop_cache_under_protocol_a():
    """A dense prompt observed (``observe_dense``), then decode steps one key at a time: every step keeps exactly the
    keys of the authors' cache plus its own, for every query head of both batch rows (row 1 left-padded)."""
    b, t, prompt = 2, 40, 24
    q, k, v, valid = _tensors(seed=11, b=b, t=t)
    method = _h2o(H2O_DEFAULTS)
    state: dict = {}
    method.observe_dense(state, q[:, :, :prompt], k[:, :, :prompt], valid[:, :, :prompt, :prompt], 1 / math.sqrt(D), 0)
    got = {}
    for s in range(prompt, t):
        _, st = attend(
            method,
            q[:, :, s : s + 1],
            k[:, :, : s + 1],
            v[:, :, : s + 1],
            attention_mask=valid[:, :, s : s + 1, : s + 1],
            state=state,
        )
        got[s] = st["keep"][:, :, 0]  # [B, Hq, s + 1]
    for row in range(b):
        first = PAD if row else 0
        for h in range(HQ):
            qs, ks = _one_sequence(q, k, row, h)
            want = authors_h2o_cache(qs, ks, prompt - first, HH, RECENT)
            for s in range(prompt, t):
                assert _kept(got[s][row, h], first) == want[s - prompt], (
                    f"H2O under A, batch row {row}, head {h}, position {s}: kept {_kept(got[s][row, h], first)}, "
                    f"the authors' cache attends {want[s - prompt]}"
                )


def test_h2o_defaults_are_the_authors_real_drop_cache_token_by_token_under_protocol_s():
    """Every row sparse in one call (protocol S): row t keeps exactly what the authors' cache, fed one token per
    forward from the first, attends at t."""
    b, t = 2, 36
    q, k, v, valid = _tensors(seed=12, b=b, t=t)
    _, st = attend(_h2o(H2O_DEFAULTS), q, k, v, attention_mask=valid)
    keep = st["keep"]  # [B, Hq, T, T]
    for row in range(b):
        first = PAD if row else 0
        for h in range(HQ):
            qs, ks = _one_sequence(q, k, row, h)
            want = authors_h2o_cache(qs, ks, 1, HH, RECENT)  # a one-token "prompt", then one token per step
            got = [_kept(keep[row, h, s], first) for s in range(first + 1, t)]
            for s, (g_, w_) in enumerate(zip(got, want), start=1):
                assert g_ == w_, f"H2O under S, batch row {row}, head {h}, token {s}: kept {g_}, authors' {w_}"


def authors_h2o_simulation(q: torch.Tensor, k: torch.Tensor, heavy_budget: int, recent_budget: int) -> torch.Tensor:
    """``local_heavy_hitter_mask`` + the band of ``LlamaAttention_heavy_hitter.forward`` (utils_lm_eval at 1603343)
    for one head of one sequence, q, k [T, D]: bool [T, T], the keys each row attends."""
    t_all = q.shape[0]
    s = q @ k.T / math.sqrt(D)
    s = s.masked_fill(~torch.ones(t_all, t_all, dtype=torch.bool).tril(), torch.finfo(s.dtype).min)
    attn = torch.softmax(s, -1)
    acc = attn[:heavy_budget].sum(0)
    acc[heavy_budget:] = 0
    mask = torch.zeros(t_all, t_all, dtype=torch.bool)
    mask[:heavy_budget, :heavy_budget] = True
    for i in range(heavy_budget, t_all):
        top = acc.topk(heavy_budget - 1).indices
        row = torch.zeros(t_all, dtype=torch.bool)
        row[top] = True
        row[i] = True
        mask[i] = row
        acc = (acc + attn[i]) * row
    band = torch.ones(t_all, t_all, dtype=torch.bool).triu(diagonal=-recent_budget)
    return (mask | band).tril()


def test_h2o_full_scores_with_competing_window_are_the_authors_lm_eval_simulation():
    """``scores=full window_competes=true sink=0 heavy=hb-1 local=recent+1`` under protocol S keeps, at every
    position, the keys of the authors' lm-eval simulation with heavy budget hb and recent budget ``recent``."""
    b, t, hb, recent = 2, 36, 6, 3
    q, k, v, valid = _tensors(seed=13, b=b, t=t)
    opts = {"scores": "full", "window_competes": True, "sink": 0, "heavy": hb - 1, "local": recent + 1}
    _, st = attend(_h2o(opts), q, k, v, attention_mask=valid)
    for row in range(b):
        first = PAD if row else 0
        for h in range(HQ):
            want = authors_h2o_simulation(*_one_sequence(q, k, row, h), hb, recent)
            got = st["keep"][row, h, first:, first:]
            bad = (got != want).any(-1).nonzero().flatten().tolist()
            assert not bad, f"H2O simulation, batch row {row}, head {h}: rows {bad} differ (first: {bad[:1]})"


# -- SnapKV -----------------------------------------------------------------------------------------------------------


def authors_snapkv(q: torch.Tensor, k: torch.Tensor, capacity: int, window: int, kernel: int, pooling: str):
    """``SnapKVCluster.update_kv`` for one head of one prompt, q, k [L, D]: (pooled votes [L - window] of the prefix
    keys, or None when the prompt is kept whole; the number of prefix keys kept)."""
    length = q.shape[0]
    if length < capacity:  # ``if q_len < self.max_capacity_prompt``: the prompt is kept whole
        return None, length - window
    w = q[-window:] @ k.T / math.sqrt(D)  # [window, L]
    causal = torch.full((window, window), torch.finfo(w.dtype).min, dtype=w.dtype)
    cond = torch.arange(window)
    causal.masked_fill_(cond < (cond + 1).view(window, 1), 0)
    w[:, -window:] += causal
    votes = torch.softmax(w, -1)[:, :-window].sum(0)  # [L - window]
    pool = F.avg_pool1d if pooling == "avgpool" else F.max_pool1d
    pooled = pool(votes[None], kernel_size=kernel, padding=kernel // 2, stride=1)[0]
    return pooled, capacity - window


def _check_snapkv_row(got: torch.Tensor, q, k, length: int, opts: dict, where: str, tol: float = 1e-6):
    """got bool [L + 1 + extra]: one row's kept keys after a prompt of ``length`` tokens (position ``length`` is the
    first one after the prompt; later positions generated).  The prefix keys kept are the top pooled votes of the
    authors' ``update_kv`` on that prompt (ties at the k-th place: either way); the window's keys and every key
    after the prompt are kept."""
    cap, win = opts["max_capacity_prompt"], opts["window_size"]
    pooled, picks = authors_snapkv(q[:length], k[:length], cap, win, opts["kernel_size"], opts["pooling"])
    assert got[length - win :].all(), f"{where}: the window's keys and the keys after the prompt are not all kept"
    prefix = got[: length - win]
    if pooled is None:
        assert prefix.all(), f"{where}: a prompt shorter than the capacity is kept whole"
        return
    assert int(prefix.sum()) == picks, f"{where}: {int(prefix.sum())} prefix keys kept, the authors keep {picks}"
    kth = pooled.topk(picks).values[-1]
    above, below = pooled > kth + tol, pooled < kth - tol
    assert prefix[above].all() and not prefix[below].any(), (
        f"{where}: kept {torch.nonzero(prefix).flatten().tolist()}, the authors' top-{picks} of the pooled votes are "
        f"{sorted(pooled.topk(picks).indices.tolist())} (k-th vote {float(kth):.6g})"
    )
    if opts["pooling"] == "avgpool":  # no ties: the very same keys
        assert sorted(torch.nonzero(prefix).flatten().tolist()) == sorted(pooled.topk(picks).indices.tolist()), where


SNAPKV_CASES = [
    pytest.param({"max_capacity_prompt": 16, "window_size": 4, "kernel_size": 7, "pooling": "maxpool"}, id="max7"),
    pytest.param({"max_capacity_prompt": 20, "window_size": 6, "kernel_size": 5, "pooling": "avgpool"}, id="avg5"),
]


@pytest.mark.parametrize("opts", SNAPKV_CASES)
def test_snapkv_first_generated_rows_keep_the_authors_update_kv_selection(opts):
    """Protocol A: a dense prompt observed, then generated rows: the first selects as ``update_kv`` on the prompt,
    the next keeps that selection and every generated key; both batch rows, every query head."""
    b, t, prompt = 2, 44, 41
    q, k, v, valid = _tensors(seed=21, b=b, t=t)
    method = build_method(make_config("snapkv", opts))
    state: dict = {}
    method.observe_dense(state, q[:, :, :prompt], k[:, :, :prompt], valid[:, :, :prompt, :prompt], 1 / math.sqrt(D), 0)
    for s in range(prompt, t):
        _, st = sparse_attention(
            method,
            q[:, :, s : s + 1],
            k[:, :, : s + 1],
            v[:, :, : s + 1],
            valid[:, :, s : s + 1, : s + 1],
            1 / math.sqrt(D),
            state,
            0,
            keep_masks=True,
            generating=True,
        )
        for row in range(b):
            first = PAD if row else 0
            for h in range(HQ):
                qs, ks = _one_sequence(q, k, row, h)
                got = st["keep"][row, h, 0, first:]
                assert not st["keep"][row, h, 0, :first].any()
                _check_snapkv_row(got, qs, ks, prompt - first, opts, f"SnapKV A, row {row}, head {h}, step {s}")


@pytest.mark.parametrize("opts", SNAPKV_CASES)
def test_snapkv_every_prompt_row_under_protocol_s_keeps_update_kv_of_its_own_prefix(opts):
    """Protocol S (every row sparse, one call): row t keeps what ``update_kv`` keeps of the prompt of the t tokens
    before it (its window: the w queries before it, not its own) plus its own key."""
    b, t = 2, 40
    q, k, v, valid = _tensors(seed=22, b=b, t=t)
    _, st = attend(build_method(make_config("snapkv", opts)), q, k, v, attention_mask=valid)
    for row in range(b):
        first = PAD if row else 0
        for h in range(HQ):
            qs, ks = _one_sequence(q, k, row, h)
            for s in range(first + opts["window_size"], t):
                got = st["keep"][row, h, s, first : s + 1]
                _check_snapkv_row(got, qs, ks, s - first, opts, f"SnapKV S, row {row}, head {h}, position {s}")
