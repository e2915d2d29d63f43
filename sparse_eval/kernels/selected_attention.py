"""Attention over a selection with a per-key logit correction, and the dense statistics of the same pass: the
accuracy path's attention step (``methods.core.sparse_attention``) in one kernel.

For query row (b, h, t) with KV head g(h) = h // G (G = Hq / Hkv), scores s_i = q·k_i · scaling (or the caller's
``scores``, −inf where a key is not valid), the kept set S (``keep``: a boolean mask, static keys included) and the
per-key additive log-weights b_i (``bias``; e.g. MagicPIG eq. 11's b_i = −log u_i, oracle sampling's
log Z_c + log f_i − log B − s_i; 0 for a method that only picks keys):

    ô   = Σ_{i∈S} softmax_S(s + b)_i v_i              lse = log Σ_{i∈S} e^{s_i + b_i}      (MagicPIG eq. 11 form)

and with ``dense=True``, over the valid keys V of the row, in the same pass over the keys (one read of V):

    o    = Σ_{i∈V} softmax_V(s)_i v_i                 (the estimation error's dense reference)
    mass = Σ_{i∈S} e^{s_i} / Σ_{i∈V} e^{s_i}          (attention mass captured)
    est_error = ‖ô − o‖₂ / ‖o‖₂                        (both as stored, in the output dtype)
    hits = |{i ∈ S : s_i ≥ kth}|                       (``kth``: the k-th largest score, k = |S|: top-k recall's
                                                         numerator, ``core.kept_mass_and_recall``)

plus ``kept`` = |S| per row.  The index form (``attention_indexed``) takes a list of key positions per row instead of a
mask (decode, one query row), the bias per list entry.

**Batch invariance.**  The Triton kernels split a row's keys into splits of a fixed size ``SPLIT`` (not a number of
splits chosen from the batch), laid from the end of the key axis (the mask form: left padding only adds splits
before a row's keys) or from the start of the index list, and merge a row's splits one after the other in a fixed
order.  A row's reduction order therefore depends only on its own length: its outputs are bit for bit the same
alone and inside any batch (``tests/kernels/test_kernels_triton.py``).

``backend="auto"``: Triton for CUDA tensors, the torch reference otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._common import check_heads, next_pow2, on_tensor_device, resolve_gpu_backend, triton_interpret, unit_last

__all__ = [
    "SPLIT",
    "Result",
    "attention",
    "attention_reference",
    "attention_indexed",
    "attention_indexed_reference",
]

SPLIT = 1024  # keys (mask form) or list entries (index form) per split: fixed, so a row's reduction order is its own
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class Result:
    """Per query row [B, Hq, Q] (decode calls with q [B, Hq, D]: [B, Hq]); o / o_dense [..., D] in ``out_dtype``."""

    o: torch.Tensor
    lse: torch.Tensor  # float32, −inf where nothing is kept
    kept: torch.Tensor  # int32: |S|
    o_dense: torch.Tensor | None = None
    lse_dense: torch.Tensor | None = None
    mass: torch.Tensor | None = None  # float32
    est_error: torch.Tensor | None = None  # float32
    hits: torch.Tensor | None = None  # int32 (with ``kth``)


# -- shapes ------------------------------------------------------------------------------------------------------


def _as_rows(x: torch.Tensor | None, b: int, hq: int, hkv: int, ql: int, n: int, what: str) -> torch.Tensor | None:
    """A per-row tensor [B', H', Q', N] (B' ∈ {1, B}, H' ∈ {1, Hkv, Hq}, Q' ∈ {1, Q}) as a [B, Hkv, G, Q, N] view
    (stride 0 over the broadcast dims: a selection shared by a KV group is read in place)."""
    if x is None:
        return None
    g = hq // hkv
    if x.dim() != 4 or x.shape[0] not in (1, b) or x.shape[1] not in (1, hkv, hq) or x.shape[2] not in (1, ql):
        raise ValueError(
            f"{what} {tuple(x.shape)}: expected [B, H, Q, N] with B in (1, {b}), H in (1, Hkv={hkv}, Hq={hq}), "
            f"Q in (1, {ql}), N={n}"
        )
    if x.shape[3] != n:
        raise ValueError(f"{what} {tuple(x.shape)}: its last dim must be the key count N={n}")
    if x.shape[1] == hq and hq != hkv:
        x5 = x.unflatten(1, (hkv, g))
    else:
        x5 = x.unsqueeze(2)
    return x5.expand(b, hkv, g, ql, n)


def _check(q, k, v):
    if k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"expected k, v [B, Hkv, N, D]; got k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.dim() not in (3, 4) or q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {tuple(q.shape)}: expected [B, Hq, D] or [B, Hq, Q, D] matching k {tuple(k.shape)}")
    return check_heads(q.shape[1], k.shape[1])


def _squeeze(res: Result, decode: bool) -> Result:
    if not decode:
        return res
    return Result(
        *(None if x is None else x.squeeze(2) for x in (getattr(res, f) for f in Result.__dataclass_fields__))
    )


# -- reference (torch) -------------------------------------------------------------------------------------------


def attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    scaling: float | None = None,
    bias: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    dense: bool = False,
    kth: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> Result:
    """Plain torch, fp32: dense scores, masked softmax, weighted sums (the module docstring's formulas).

    q [B, Hq, Q, D] or [B, Hq, D] (decode); k, v [B, Hkv, N, D]; keep bool, bias float, scores float32 [B, H, Q, N]
    (H = Hq, or Hkv for one selection per KV group; Q and B may be 1 to broadcast; a 3-D q takes [B, H, N]);
    valid bool [B, 1, Q, N] (only without ``scores``; None: every key); kth float32 [B, Hq, Q] (with ``scores``)."""
    g = _check(q, k, v)
    decode = q.dim() == 3
    if decode:
        q = q.unsqueeze(2)
        keep, bias, scores, valid = (None if x is None else x.unsqueeze(-2) for x in (keep, bias, scores, valid))
        kth = None if kth is None else kth.unsqueeze(-1)
    b, hq, ql, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    out_dtype = out_dtype or q.dtype

    def rows(x, what):  # [B, Hq, Q, N]
        return None if x is None else _as_rows(x, b, hq, hkv, ql, n, what).reshape(b, hq, ql, n)

    kk = k.float().repeat_interleave(g, 1)
    vv = v.float().repeat_interleave(g, 1)
    if scores is None:
        s = torch.matmul(q.float(), kk.transpose(-1, -2)) * scaling
        if valid is not None:
            s = s.masked_fill(~rows(valid, "valid"), float("-inf"))
    else:
        s = rows(scores.float(), "scores")
    keep = rows(keep, "keep")
    logits = s if bias is None else s + torch.where(keep, rows(bias.float(), "bias"), torch.zeros_like(s))
    lg = logits.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(lg, -1)
    p = torch.exp(lg - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.matmul(p, vv).to(out_dtype)
    res = Result(o=o, lse=lse, kept=keep.sum(-1, dtype=torch.int32))
    if dense:
        lse_d = torch.logsumexp(s, -1)
        pd = torch.exp(s - torch.where(torch.isfinite(lse_d), lse_d, torch.zeros_like(lse_d)).unsqueeze(-1))
        od = torch.matmul(pd, vv).to(out_dtype)
        num = (o.float() - od.float()).norm(dim=-1)
        den = od.float().norm(dim=-1)
        res.o_dense, res.lse_dense = od, lse_d
        res.mass = (pd * keep).sum(-1)
        res.est_error = torch.where(den > 0, num / den.clamp_min(1e-30), torch.zeros_like(num))
        if kth is not None:
            res.hits = (keep & (s >= kth.unsqueeze(-1))).sum(-1, dtype=torch.int32)
    return _squeeze(res, decode)


# -- dispatch ----------------------------------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    keep: torch.Tensor,
    *,
    scaling: float | None = None,
    bias: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
    dense: bool = False,
    kth: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    split: int | None = None,
) -> Result:
    """The selected attention and, with ``dense``, the dense statistics of the same pass (module docstring).
    Arguments as ``attention_reference``.  With ``scores`` given the kernel reads them instead of K (the exact values
    the selection was made from); ``kth`` needs ``scores`` and ``dense``.  ``split``: keys per split of the
    Triton kernel (a multiple of 64; None: ``SPLIT``, read at the call, so that tests under the interpreter may set a
    smaller one; the bits depend on it)."""
    _check(q, k, v)
    if kth is not None and (scores is None or not dense):
        raise ValueError("kth (top-k recall's threshold) needs scores= and dense=True")
    if scores is not None and valid is not None:
        raise ValueError("give valid= or scores= (−inf where not valid), not both")
    if keep.dtype != torch.bool:
        raise ValueError(f"keep: expected a bool mask, got {keep.dtype}")
    args = dict(scaling=scaling, bias=bias, scores=scores, valid=valid, dense=dense, kth=kth, out_dtype=out_dtype)
    if resolve_gpu_backend(backend, q, k, v, keep) == "torch":
        return attention_reference(q, k, v, keep, **args)
    if k.dtype not in DTYPES or q.dtype not in DTYPES:
        raise ValueError(f"selected_attention (triton): dtypes {q.dtype}/{k.dtype}; valid: {list(DTYPES)}")
    return _run_mask(q, k, v, keep, **args, split=_check_split(split))


# -- Triton launchers --------------------------------------------------------------------------------------------


def _check_split(split: int | None) -> int:
    if split is None:
        split = SPLIT
    if isinstance(split, bool) or not isinstance(split, int) or split < 64 or split % 64:
        raise ValueError(f"split={split!r}: a multiple of 64 keys (default {SPLIT})")
    return split


def _strides(x: torch.Tensor | None, n: int) -> tuple[int, ...]:
    return (0,) * n if x is None else tuple(x.stride())


def _block_n(k: torch.Tensor, small: bool = False) -> int:
    """64 keys per tile for 16-bit tiles on the GPU and under the interpreter (fewer steps there); 32 for float32
    tiles on the GPU (IEEE products on the FMA units, as in ``_tl_sparse_decode``) and with ``small`` (the index
    form's q·k: 64 spills at sm_90, ``_aot_check``).  At 8 warps every default configuration compiles for sm_90
    without spilling."""
    if triton_interpret():
        return 64
    return 32 if small or k.dtype == torch.float32 else 64


def _u8(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.view(torch.uint8)


# each split's partial state, in the kernels' argument order: running max, sum and weighted values of the kept keys,
# the same three over every valid key and the kept keys' sum under the dense max (``dense``), and the two counts
PARTIALS = ("PM", "PL", "PA", "PMD", "PLD", "PLK", "PAD", "PCNT")
PARTIALS_SPARSE = ("PM", "PL", "PA", "PCNT")  # the index form's (no dense statistics)


def _partials(rows: int, splits: int, block_d: int, dense: bool, dev) -> dict[str, torch.Tensor]:
    n = rows * splits
    f = dict(dtype=torch.float32, device=dev)
    out = {
        "PM": torch.empty(n, **f),
        "PL": torch.empty(n, **f),
        "PA": torch.empty(n, block_d, **f),
        "PCNT": torch.empty(n, 2, dtype=torch.int32, device=dev),
    }
    out.update(
        {
            "PMD": torch.empty(n, **f),
            "PLD": torch.empty(n, **f),
            "PLK": torch.empty(n, **f),
            "PAD": torch.empty(n, block_d, **f),
        }
        if dense
        else {"PMD": out["PM"], "PLD": out["PL"], "PLK": out["PL"], "PAD": out["PA"]}
    )
    return out


def _empty_state(part: dict[str, torch.Tensor]) -> None:
    """Every split's partials the empty state (no key): m = −inf, the sums and counts 0."""
    for name, t in part.items():
        if name in ("PM", "PMD"):
            t.fill_(float("-inf"))
        else:
            t.zero_()


def _merge(tl_mod, part, rows, splits, d, block_d, dense, out_dtype, dev) -> Result:
    o = torch.empty(rows, d, dtype=out_dtype, device=dev)
    lse = torch.empty(rows, dtype=torch.float32, device=dev)
    cnt = torch.empty(rows, 2, dtype=torch.int32, device=dev)
    od = torch.empty(rows, d, dtype=out_dtype, device=dev) if dense else o
    lsed, mass, err = (torch.empty(rows, dtype=torch.float32, device=dev) for _ in range(3)) if dense else (lse,) * 3
    interp = triton_interpret()
    tl_mod._merge[(rows,)](
        *(part[x] for x in PARTIALS),
        o,
        lse,
        od,
        lsed,
        mass,
        err,
        cnt,
        splits,
        D=d,
        BLOCK_D=block_d,
        DENSE=dense,
        INTERP=interp,
        NS=splits if interp else 0,
        num_warps=4,
    )
    res = Result(o=o, lse=lse, kept=cnt[:, 0])
    if dense:
        res.o_dense, res.lse_dense, res.mass, res.est_error, res.hits = od, lsed, mass, err, cnt[:, 1]
    return res


@on_tensor_device
def _run_mask(q, k, v, keep, *, scaling, bias, scores, valid, dense, kth, out_dtype, split) -> Result:
    from . import _tl_selected_attention as tlm

    decode = q.dim() == 3
    if decode:
        q = q.unsqueeze(2)
        keep, bias, scores, valid = (None if x is None else x.unsqueeze(-2) for x in (keep, bias, scores, valid))
        kth = None if kth is None else kth.unsqueeze(-1)
    b, hq, ql, d = q.shape
    hkv, n = k.shape[1], k.shape[2]
    g = hq // hkv
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    out_dtype = out_dtype or q.dtype
    dev = q.device
    q, k, v = unit_last(q, k, v)
    keep5 = _as_rows(_u8(keep), b, hq, hkv, ql, n, "keep")
    bias5 = _as_rows(None if bias is None else bias.float(), b, hq, hkv, ql, n, "bias")
    sc5 = _as_rows(None if scores is None else scores.float(), b, hq, hkv, ql, n, "scores")
    val5 = _as_rows(_u8(valid), b, hq, hkv, ql, n, "valid")
    kth4 = None if kth is None else kth.float().reshape(b, hq, ql).unflatten(1, (hkv, g))
    rows = b * hq * ql
    block_d = max(16, next_pow2(d))
    splits = max(1, -(-n // split))
    part = _partials(rows, splits, block_d, dense, dev)
    upcast = triton_interpret() or k.dtype == torch.float32 or k.dtype != q.dtype
    block_r = max(16, min(64, next_pow2(g * ql)))
    n_rb = -(-(g * ql) // block_r)
    if rows and n:
        dummy = part["PM"]
        tlm._mask_split[(b * hkv * n_rb, splits)](
            q,
            k,
            v,
            keep5,
            dummy if bias5 is None else bias5,
            dummy if sc5 is None else sc5,
            dummy if val5 is None else val5,
            dummy if kth4 is None else kth4,
            *(part[x] for x in PARTIALS),
            n,
            ql,
            hq,
            hkv,
            splits,
            scaling * tlm.LOG2E,
            *q.stride()[:3],
            *k.stride()[:3],
            *v.stride()[:3],
            *keep5.stride(),
            *_strides(bias5, 5),
            *_strides(sc5, 5),
            *_strides(val5, 5),
            *_strides(kth4, 4),
            G=g,
            D=d,
            BLOCK_D=block_d,
            BLOCK_R=block_r,
            BLOCK_N=_block_n(k),
            SPLIT=split,
            HAS_BIAS=bias5 is not None,
            HAS_SC=sc5 is not None,
            HAS_VAL=val5 is not None,
            HAS_KTH=kth4 is not None,
            DENSE=dense,
            UPCAST=upcast,
            num_warps=8,
        )
    elif rows:  # no keys: every partial is the empty state
        _empty_state(part)
    res = _merge(tlm, part, rows, splits, d, block_d, dense, out_dtype, dev)
    shape = (b, hq, ql)
    res = Result(
        *(
            None if x is None else x.reshape(*shape, *x.shape[1:])
            for x in (getattr(res, f) for f in Result.__dataclass_fields__)
        )
    )
    if dense and kth is None:
        res.hits = None
    return _squeeze(res, decode)


# -- the index form ----------------------------------------------------------------------------------------------


def _check_idx(q, k, v, idx, count, bias, scores):
    g = _check(q, k, v)
    if q.dim() != 3:
        raise ValueError(f"attention_indexed is a decode kernel: q [B, Hq, D], got {tuple(q.shape)}")
    b, hq, _ = q.shape
    if idx.dim() != 3 or idx.shape[0] != b or idx.shape[1] not in (hq, k.shape[1]):
        raise ValueError(f"idx {tuple(idx.shape)}: expected [B, Hq or Hkv, S] with B={b}, Hq={hq}, Hkv={k.shape[1]}")
    if idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"idx dtype {idx.dtype}: expected torch.int32 or torch.int64")
    if count is not None and tuple(count.shape) != tuple(idx.shape[:2]):
        raise ValueError(f"count {tuple(count.shape)}: expected {tuple(idx.shape[:2])} (one per index row)")
    if bias is not None and tuple(bias.shape) != (b, hq, idx.shape[2]):
        raise ValueError(f"bias {tuple(bias.shape)}: expected [B, Hq, S] = {(b, hq, idx.shape[2])} (per list entry)")
    if scores is not None and tuple(scores.shape) != (b, hq, k.shape[2]):
        raise ValueError(f"scores {tuple(scores.shape)}: expected [B, Hq, N] = {(b, hq, k.shape[2])}")
    return g


def attention_indexed_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    scaling: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> Result:
    """Decode over index lists (plain torch): q [B, Hq, D]; idx [B, Hq or Hkv, S] (entries < 0 and entries at or
    beyond ``count`` [B, Hq or Hkv] are padding; a repeated position counts once per entry, attention over the
    multiset); bias [B, Hq, S] per entry; scores [B, Hq, N] read at the listed keys instead of q·k.  Result per
    [B, Hq] (no dense statistics: a list does not cover the row's keys)."""
    g = _check_idx(q, k, v, idx, count, bias, scores)
    b, hq, d = q.shape
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    if idx.shape[1] != hq:
        idx = idx.repeat_interleave(g, 1)
        count = None if count is None else count.repeat_interleave(g, 1)
    s_len = idx.shape[2]
    sel = idx >= 0
    if count is not None:
        sel = sel & (torch.arange(s_len, device=idx.device) < count.unsqueeze(-1).to(idx.device))
    safe = torch.where(sel, idx, torch.zeros_like(idx)).long()
    bi = torch.arange(b, device=q.device).view(b, 1, 1)
    hi = (torch.arange(hq, device=q.device) // g).view(1, hq, 1)
    if scores is None:
        s = torch.einsum("bhsd,bhd->bhs", k[bi, hi, safe].float(), q.float()) * scaling
    else:
        s = scores.float().gather(-1, safe)
    if bias is not None:
        s = s + bias.float()
    s = s.masked_fill(~sel, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse)).unsqueeze(-1))
    o = torch.einsum("bhs,bhsd->bhd", p, v[bi, hi, safe].float()).to(out_dtype or q.dtype)
    return Result(o=o, lse=lse, kept=sel.sum(-1, dtype=torch.int32))


def attention_indexed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    idx: torch.Tensor,
    *,
    count: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    scaling: float | None = None,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    split: int | None = None,
) -> Result:
    """Decode attention over index lists with a per-entry logit correction (``attention_indexed_reference``); splits
    of ``SPLIT`` list entries from the list's start, merged in order: batch-invariant."""
    _check_idx(q, k, v, idx, count, bias, scores)
    args = dict(count=count, bias=bias, scores=scores, scaling=scaling, out_dtype=out_dtype)
    if resolve_gpu_backend(backend, q, k, v, idx) == "torch":
        return attention_indexed_reference(q, k, v, idx, **args)
    if k.dtype not in DTYPES or q.dtype not in DTYPES:
        raise ValueError(f"attention_indexed (triton): dtypes {q.dtype}/{k.dtype}; valid: {list(DTYPES)}")
    return _run_index(q, k, v, idx, **args, split=_check_split(split))


@on_tensor_device
def _run_index(q, k, v, idx, *, count, bias, scores, scaling, out_dtype, split) -> Result:
    from . import _tl_selected_attention as tlm

    b, hq, d = q.shape
    hkv = k.shape[1]
    g = hq // hkv
    hi = idx.shape[1]
    qpi = hq // hi
    s_len = idx.shape[2]
    scaling = 1.0 / math.sqrt(d) if scaling is None else float(scaling)
    out_dtype = out_dtype or q.dtype
    dev = q.device
    q, k, v = unit_last(q, k, v)
    rows = b * hq
    block_d = max(16, next_pow2(d))
    splits = max(1, -(-s_len // split))
    part = _partials(rows, splits, block_d, False, dev)
    upcast = triton_interpret() or k.dtype == torch.float32 or k.dtype != q.dtype
    cnt = None if count is None else count.to(device=dev, dtype=torch.int32)
    bias = None if bias is None else bias.float()
    scores = None if scores is None else scores.float()
    if rows and s_len:
        dummy = part["PM"]
        tlm._index_split[(b * hi, splits)](
            q,
            k,
            v,
            idx,
            dummy if cnt is None else cnt,
            dummy if bias is None else bias,
            dummy if scores is None else scores,
            *(part[x] for x in PARTIALS_SPARSE),
            s_len,
            hq,
            hi,
            splits,
            scaling * tlm.LOG2E,
            *q.stride()[:2],
            *k.stride()[:3],
            *v.stride()[:3],
            *idx.stride(),
            *_strides(cnt, 2),
            *_strides(bias, 3),
            *_strides(scores, 3),
            QPI=qpi,
            G=g,
            D=d,
            BLOCK_D=block_d,
            BLOCK_R=max(16, next_pow2(qpi)),
            BLOCK_N=_block_n(k, small=scores is None),
            SPLIT=split,
            HAS_CNT=cnt is not None,
            HAS_BIAS=bias is not None,
            HAS_SC=scores is not None,
            UPCAST=upcast,
            num_warps=8,
        )
    elif rows:
        _empty_state(part)
    res = _merge(tlm, part, rows, splits, d, block_d, False, out_dtype, dev)
    return Result(o=res.o.view(b, hq, d), lse=res.lse.view(b, hq), kept=res.kept.reshape(b, hq))
