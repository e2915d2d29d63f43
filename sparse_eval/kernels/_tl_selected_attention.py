"""Triton kernels of ``kernels.selected_attention`` (imported lazily: see ``kernels._common``).

Two launches per call, whatever the batch:

* ``_mask_split`` (mask form) / ``_index_split`` (index form): one program per (batch row, KV head, block of the
  group's query rows, split); a split is ``SPLIT`` keys (mask form, laid from the *end* of the key axis, so left
  padding only adds splits and tiles at the front) or ``SPLIT`` entries of the index list (index form, laid from its
  start).  Each program runs an online softmax over its split in tiles of BLOCK_N keys, for the selected logits
  s + b and (``DENSE``) for the dense logits s in the same pass over V, and writes unnormalised partials.
* ``_merge``: one program per query row merges the row's splits *sequentially*, split 0 first.  A split that holds
  no key of the row (left padding; a shorter index list) has the partial (−inf, 0, 0) and merges as an exact no-op,
  so a row's result is bit for bit the same alone and in any batch.

Scores are in log2 units inside (``exp2``); the outputs are in natural units.  Under the interpreter (and for
float32 caches) tiles are float32 and products IEEE float32 (``input_precision="ieee"``, as in
``_tl_sparse_decode``); on the GPU 16-bit V tiles go to the tensor cores with P rounded to their dtype.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._tl_sparse_decode import _online

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


# Triton compiles a variant per divisibility-by-16 of each integer argument.  The key count and the strides over rows
# (which hold N and the cache's capacity) differ between a row alone and the same row in a padded batch, and another
# variant may lay out a tile's loads, and with them the order of a tile's sums, differently: those arguments are not
# specialised, so every launch runs the same code (the innermost strides, the same in both, stay specialised)
_MASK_UNSPECIALISED = [
    "L", "QL", "HQ", "HKV", "n_splits", "sqb", "sqh", "sqt", "skb", "skh", "svb", "svh",
    "s_kb", "s_kh", "s_kg", "s_kt", "s_bb", "s_bh", "s_bg", "s_bt", "s_sb", "s_sh", "s_sg", "s_st",
    "s_vb", "s_vh", "s_vg", "s_vt", "s_tb", "s_th", "s_tg", "s_tt",
]  # fmt: skip
_INDEX_UNSPECIALISED = [
    "S", "HQ", "HI", "n_splits", "sqb", "sqh", "skb", "skh", "svb", "svh", "s_ib", "s_ih", "s_cb", "s_ch",
    "s_bb", "s_bh", "s_sb", "s_sh",
]  # fmt: skip


@triton.jit(do_not_specialize=_MASK_UNSPECIALISED)
def _mask_split(
    Q,
    K,
    V,
    KEEP,
    BIAS,
    SC,
    VAL,
    KTH,
    PM,
    PL,
    PA,
    PMD,
    PLD,
    PLK,
    PAD,
    PCNT,
    L,
    QL,
    HQ,
    HKV,
    n_splits,
    qk_scale,
    sqb,
    sqh,
    sqt,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    s_kb,
    s_kh,
    s_kg,
    s_kt,
    s_kn,
    s_bb,
    s_bh,
    s_bg,
    s_bt,
    s_bn,
    s_sb,
    s_sh,
    s_sg,
    s_st,
    s_sn,
    s_vb,
    s_vh,
    s_vg,
    s_vt,
    s_vn,
    s_tb,
    s_th,
    s_tg,
    s_tt,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SC: tl.constexpr,
    HAS_VAL: tl.constexpr,
    HAS_KTH: tl.constexpr,
    DENSE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Rows r = g·QL + t of KV head hk (query head hk·G + g, query row t); the per-row tensors (keep, bias, scores,
    valid, kth) are addressed through strides over (b, hk, g, t[, n]), so a [B, Hkv, ...] selection shared by a
    group is read in place (stride 0 over g).  Split j covers the keys [L − (j+1)·SPLIT, L − j·SPLIT)."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    n_rb = tl.cdiv(G * QL, BLOCK_R)
    rb = pid % n_rb
    hk = (pid // n_rb) % HKV
    b = (pid // n_rb) // HKV
    b64 = b.to(tl.int64)
    hk64 = hk.to(tl.int64)
    r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = r < G * QL
    g = (r // QL).to(tl.int64)
    t = (r % QL).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    keep_row = b64 * s_kb + hk64 * s_kh + g * s_kg + t * s_kt  # [R]
    bias_row = b64 * s_bb + hk64 * s_bh + g * s_bg + t * s_bt
    sc_row = b64 * s_sb + hk64 * s_sh + g * s_sg + t * s_st
    val_row = b64 * s_vb + hk64 * s_vh + g * s_vg + t * s_vt
    if HAS_SC:
        q = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)  # unused
    else:
        q = tl.load(
            Q + b64 * sqb + (hk64 * G + g)[:, None] * sqh + t[:, None] * sqt + offs_d[None, :],
            mask=rmask[:, None] & dmask[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        else:
            q = q.to(K.dtype.element_ty)
    if HAS_KTH:
        kth = tl.load(KTH + b64 * s_tb + hk64 * s_th + g * s_tg + t * s_tt, mask=rmask, other=float("inf"))
    else:
        kth = tl.zeros([BLOCK_R], tl.float32)
    k_base = K + b64 * skb + hk64 * skh
    v_base = V + b64 * svb + hk64 * svh

    m_s = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_s = tl.zeros([BLOCK_R], tl.float32)
    acc_s = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    m_d = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_d = tl.zeros([BLOCK_R], tl.float32)
    l_k = tl.zeros([BLOCK_R], tl.float32)
    acc_d = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n_keep = tl.zeros([BLOCK_R], tl.int32)
    hits = tl.zeros([BLOCK_R], tl.int32)

    lo = L - (j + 1) * SPLIT  # may be < 0 for the front split
    for it in range(0, SPLIT // BLOCK_N):  # a constexpr trip count (the interpreter needs one)
        offs = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = offs >= 0
        m2 = rmask[:, None] & inb[None, :]
        offs64 = tl.where(inb, offs, 0).to(tl.int64)
        keep = tl.load(KEEP + keep_row[:, None] + offs64[None, :] * s_kn, mask=m2, other=0) != 0  # [R, BN]
        if HAS_SC:
            ok = m2  # refined below from the scores (−inf: not valid)
        elif HAS_VAL:
            ok = tl.load(VAL + val_row[:, None] + offs64[None, :] * s_vn, mask=m2, other=0) != 0
        else:
            ok = m2
        if DENSE:
            pre = keep | ok
        else:
            pre = keep
        # a tile no row needs leaves every state exactly as it is: skipped (the front split's tiles below key 0,
        # and, without DENSE, tiles with no selected key)
        if tl.max(tl.max(pre.to(tl.int32), 1), 0) > 0:
            if HAS_SC:
                s = tl.load(SC + sc_row[:, None] + offs64[None, :] * s_sn, mask=m2, other=float("-inf"))
                ok = s > float("-inf")
            if DENSE:
                need = keep | ok
            else:
                need = keep
            # keys whose V (and K) row some row of the block reads; no other row is loaded (a padding key's row
            # may hold anything, and it must not enter as 0 · inf)
            lanes = tl.max(need.to(tl.int32), 0) > 0  # [BN]
            if HAS_SC:
                s2 = s * 1.4426950408889634
            else:
                kt = tl.load(
                    k_base + offs64[:, None] * skn + offs_d[None, :], mask=lanes[:, None] & dmask[None, :], other=0.0
                )
                if UPCAST:
                    s2 = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee") * qk_scale
                else:
                    s2 = tl.dot(q, tl.trans(kt)) * qk_scale
                s2 = tl.where(ok, s2, float("-inf"))
                s = s2  # (hits need the caller's scores: HAS_KTH requires HAS_SC)
            vt = tl.load(
                v_base + offs64[:, None] * svn + offs_d[None, :], mask=lanes[:, None] & dmask[None, :], other=0.0
            )
            if UPCAST:
                vt = vt.to(tl.float32)
            if HAS_BIAS:
                bias = tl.load(BIAS + bias_row[:, None] + offs64[None, :] * s_bn, mask=m2 & keep, other=0.0)
                if HAS_SC:
                    lg = (s + bias) * 1.4426950408889634
                else:
                    lg = s2 + bias * 1.4426950408889634
            else:
                lg = s2
            lg = tl.where(keep, lg, float("-inf"))
            m_s, _, _, _, l_s, acc_s = _online(m_s, l_s, acc_s, lg, vt, UPCAST)
            n_keep += tl.sum(keep.to(tl.int32), 1)
            if DENSE:
                sd = tl.where(ok, s2, float("-inf"))
                m_d, _, alpha_d, p_d, l_d, acc_d = _online(m_d, l_d, acc_d, sd, vt, UPCAST)
                l_k = l_k * alpha_d + tl.sum(tl.where(keep, p_d, 0.0), 1)
            if HAS_KTH:
                hits += tl.sum((keep & (s >= kth[:, None])).to(tl.int32), 1)

    prow = ((b64 * HQ + hk64 * G + g) * QL + t) * n_splits + j
    tl.store(PM + prow, m_s, mask=rmask)
    tl.store(PL + prow, l_s, mask=rmask)
    tl.store(PA + prow[:, None] * BLOCK_D + offs_d[None, :], acc_s, mask=rmask[:, None])
    tl.store(PCNT + prow * 2, n_keep, mask=rmask)
    tl.store(PCNT + prow * 2 + 1, hits, mask=rmask)
    if DENSE:
        tl.store(PMD + prow, m_d, mask=rmask)
        tl.store(PLD + prow, l_d, mask=rmask)
        tl.store(PLK + prow, l_k, mask=rmask)
        tl.store(PAD + prow[:, None] * BLOCK_D + offs_d[None, :], acc_d, mask=rmask[:, None])


@triton.jit(do_not_specialize=_INDEX_UNSPECIALISED)
def _index_split(
    Q,
    K,
    V,
    IDX,
    CNT,
    BIAS,
    SC,
    PM,
    PL,
    PA,
    PCNT,
    S,
    HQ,
    HI,
    n_splits,
    qk_scale,
    sqb,
    sqh,
    skb,
    skh,
    skn,
    svb,
    svh,
    svn,
    s_ib,
    s_ih,
    s_in,
    s_cb,
    s_ch,
    s_bb,
    s_bh,
    s_bn,
    s_sb,
    s_sh,
    s_sn,
    QPI: tl.constexpr,
    G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_CNT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_SC: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Decode over index lists: program (b, index row hi, split j); index row hi serves the QPI = Hq / Hi query heads
    hi·QPI .. (hi+1)·QPI − 1 (KV head hi·QPI // G).  Split j covers the list entries [j·SPLIT, (j+1)·SPLIT) below
    the row's count; entries < 0 are padding.  The bias is per list entry and query head ([B, Hq, S]); scores, when
    given, are read at the listed keys ([B, Hq, N])."""
    pid = tl.program_id(0)
    j = tl.program_id(1)
    b64 = (pid // HI).to(tl.int64)
    hi = (pid % HI).to(tl.int64)
    h0 = hi * QPI
    kvh = h0 // G
    r = tl.arange(0, BLOCK_R)
    rmask = r < QPI
    heads = h0 + r
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    if HAS_SC:
        q = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)  # unused
    else:
        q = tl.load(
            Q + b64 * sqb + heads[:, None] * sqh + offs_d[None, :], mask=rmask[:, None] & dmask[None, :], other=0.0
        )
        if UPCAST:
            q = q.to(tl.float32)
        else:
            q = q.to(K.dtype.element_ty)
    n_valid = S
    if HAS_CNT:
        n_valid = tl.minimum(tl.load(CNT + b64 * s_cb + hi * s_ch).to(tl.int32), S)
    k_base = K + b64 * skb + kvh * skh
    v_base = V + b64 * svb + kvh * svh
    i_base = IDX + b64 * s_ib + hi * s_ih
    m_s = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_s = tl.zeros([BLOCK_R], tl.float32)
    acc_s = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    n_keep = tl.zeros([BLOCK_R], tl.int32)
    lo = j * SPLIT
    for it in range(0, SPLIT // BLOCK_N):
        offs = lo + it * BLOCK_N + tl.arange(0, BLOCK_N)
        inb = offs < n_valid
        if tl.max(inb.to(tl.int32), 0) > 0:  # entries beyond the row's count leave the state exactly as it is
            ids = tl.load(i_base + offs.to(tl.int64) * s_in, mask=inb, other=-1)
            sel = ids >= 0
            rows = tl.where(sel, ids, 0).to(tl.int64)
            m2 = rmask[:, None] & sel[None, :]
            vt = tl.load(v_base + rows[:, None] * svn + offs_d[None, :], mask=sel[:, None] & dmask[None, :], other=0.0)
            if UPCAST:
                vt = vt.to(tl.float32)
            if HAS_SC:
                s = tl.load(SC + b64 * s_sb + heads[:, None] * s_sh + rows[None, :] * s_sn, mask=m2, other=0.0)
                s2 = s * 1.4426950408889634
            else:
                kt = tl.load(
                    k_base + rows[:, None] * skn + offs_d[None, :], mask=sel[:, None] & dmask[None, :], other=0.0
                )
                if UPCAST:
                    s2 = tl.dot(q, tl.trans(kt.to(tl.float32)), input_precision="ieee") * qk_scale
                else:
                    s2 = tl.dot(q, tl.trans(kt)) * qk_scale
                s = s2
            if HAS_BIAS:
                bias = tl.load(
                    BIAS + b64 * s_bb + heads[:, None] * s_bh + offs.to(tl.int64)[None, :] * s_bn, mask=m2, other=0.0
                )
                if HAS_SC:
                    lg = (s + bias) * 1.4426950408889634
                else:
                    lg = s2 + bias * 1.4426950408889634
            else:
                lg = s2
            lg = tl.where(m2, lg, float("-inf"))
            m_s, _, _, _, l_s, acc_s = _online(m_s, l_s, acc_s, lg, vt, UPCAST)
            n_keep += tl.sum(m2.to(tl.int32), 1)
    prow = (b64 * HQ + heads) * n_splits + j
    tl.store(PM + prow, m_s, mask=rmask)
    tl.store(PL + prow, l_s, mask=rmask)
    tl.store(PA + prow[:, None] * BLOCK_D + offs_d[None, :], acc_s, mask=rmask[:, None])
    tl.store(PCNT + prow * 2, n_keep, mask=rmask)
    tl.store(PCNT + prow * 2 + 1, tl.zeros([BLOCK_R], tl.int32), mask=rmask)


@triton.jit
def _merge_step(M, Lsum, A, m_j, l_j, a_j):
    m_new = tl.maximum(M, m_j)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    s_old = tl.exp2(M - m_use)
    s_new = tl.exp2(m_j - m_use)
    return m_new, m_use, s_old, s_new, Lsum * s_old + l_j * s_new, A * s_old + a_j * s_new


@triton.jit(do_not_specialize=["n_splits"])
def _merge(
    PM,
    PL,
    PA,
    PMD,
    PLD,
    PLK,
    PAD,
    PCNT,
    O,
    LSE,
    OD,
    LSED,
    MASS,
    ERR,
    CNT,
    n_splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DENSE: tl.constexpr,
    INTERP: tl.constexpr,
    NS: tl.constexpr,
):
    """Row (b, hq, t): its splits merged one after the other, split 0 first; then o = A / Σ, lse, and with DENSE
    the dense output, its lse, the kept mass Σ_keep e^{s} / Σ_valid e^{s} and ‖ô − o‖ / ‖o‖ of the two outputs as
    stored (rounded to the output dtype, as the torch path compares them)."""
    row = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    dmask = offs_d < D
    M = tl.full([1], float("-inf"), tl.float32)
    Ls = tl.zeros([1], tl.float32)
    A = tl.zeros([BLOCK_D], tl.float32)
    Md = tl.full([1], float("-inf"), tl.float32)
    Ld = tl.zeros([1], tl.float32)
    Lk = tl.zeros([1], tl.float32)
    Ad = tl.zeros([BLOCK_D], tl.float32)
    cnt = tl.zeros([1], tl.int32)
    hits = tl.zeros([1], tl.int32)
    mu = tl.zeros([1], tl.float32)
    mud = tl.zeros([1], tl.float32)
    one = tl.arange(0, 1)
    # the interpreter (numpy >= 2.4) cannot take tensor loop bounds: a constexpr trip count there
    for jj in range(0, NS if INTERP else n_splits):
        p = row * n_splits + jj  # split p's partials merged into the running state
        M, mu, _, _, Ls, A = _merge_step(
            M, Ls, A, tl.load(PM + p + one), tl.load(PL + p + one), tl.load(PA + p * BLOCK_D + offs_d)
        )
        cnt += tl.load(PCNT + p * 2 + one)
        hits += tl.load(PCNT + p * 2 + 1 + one)
        if DENSE:
            m_j = tl.load(PMD + p + one)
            Md, mud, s_old, s_new, Ld, Ad = _merge_step(
                Md, Ld, Ad, m_j, tl.load(PLD + p + one), tl.load(PAD + p * BLOCK_D + offs_d)
            )
            Lk = Lk * s_old + tl.load(PLK + p + one) * s_new
    has = Ls > 0
    o = A / tl.where(has, Ls, 1.0)
    o_st = o.to(O.dtype.element_ty)
    tl.store(O + row * D + offs_d, o_st, mask=dmask)
    tl.store(LSE + row + one, tl.where(has, (mu + tl.log2(tl.where(has, Ls, 1.0))) * 0.6931471805599453, float("-inf")))
    tl.store(CNT + row * 2 + one, cnt)
    tl.store(CNT + row * 2 + 1 + one, hits)
    if DENSE:
        hasd = Ld > 0
        od = Ad / tl.where(hasd, Ld, 1.0)
        od_st = od.to(O.dtype.element_ty)
        tl.store(OD + row * D + offs_d, od_st, mask=dmask)
        lsed = tl.where(hasd, (mud + tl.log2(tl.where(hasd, Ld, 1.0))) * 0.6931471805599453, float("-inf"))
        tl.store(LSED + row + one, lsed)
        tl.store(MASS + row + one, tl.where(hasd, Lk / tl.where(hasd, Ld, 1.0), 0.0))
        diff = tl.where(dmask, o_st.to(tl.float32) - od_st.to(tl.float32), 0.0)
        ref = tl.where(dmask, od_st.to(tl.float32), 0.0)
        num = tl.sqrt(tl.sum(diff * diff, 0))
        den = tl.sqrt(tl.sum(ref * ref, 0))
        err = tl.where(den > 0, num / tl.maximum(den, 1e-30), 0.0)
        tl.store(ERR + row + one, tl.zeros([1], tl.float32) + err)
