"""Quest: query-aware page selection by a per-page upper bound of q·k (Tang et al., ICML 2024).

The keys of a row are split into pages of ``page_size`` tokens, counted from the row's first valid key (so
left padding never shifts the pages).  For page p and channel c Quest keeps the element-wise minimum and
maximum key, m_{p,c} = min_{i∈p} k_{i,c} and M_{p,c} = max_{i∈p} k_{i,c}, and scores the page by

    U_p(q) = Σ_c max(q_c · m_{p,c}, q_c · M_{p,c})  ≥  max_{i∈p} q·k_i                       (Quest §3.2)

(each term bounds q_c·k_{i,c} from above for every key of the page, so the sum bounds every q·k_i).  The top
``floor(budget_tokens / page_size)`` pages by U_p are attended exactly, together with the static sink/local
keys, which the MagicPIG paper's Quest baseline keeps besides the budget (MagicPIG §5.1: 4 initial tokens,
local 64).  Computed as U = q⁺·Mᵀ + q⁻·mᵀ with q⁺ = max(q, 0), q⁻ = min(q, 0) (same value, two matmuls).

Budget (``budget``): a ratio of the row's context (float; MagicPIG's configs (page, ratio) = (16, 0.04),
(32, 0.06), (64, 0.08)) or a token count (int; the Quest paper's token budgets 256 … 4096).  Pages selected =
max(floor(budget_tokens / page_size), ``min_pages``); the paper states no minimum, so ``min_pages=1`` (the
default) only keeps a row from selecting nothing; the Quest repo keeps max(3, budget // page) pages
(``evaluation/quest_attention.py`` line 56): ``min_pages=3`` reproduces it.  Rows where the floor applied are
counted by the ``one_page_floor`` statistic (budget below ``min_pages`` pages).

The page metadata lives in the layer's ``state`` and is updated incrementally while decoding: the last,
partial page's min/max absorbs the new keys and new pages are appended (``update_pages=True``, Quest's own
behaviour).  ``update_pages=False`` reproduces the MagicPIG repo's Quest baseline (pages built once from the
keys present at the first sparse call, i.e. after prefill, whole pages only, left of the local window; every
later key is always attended).  It is a parity option for protocol A, not the Quest algorithm.

When a block of query rows is scored at once (protocol S: prefill sparse too), the page holding a row's
newest valid key is bounded over that page's keys up to the row only (prefix min/max), so future keys never
enter a row's selection.  In decode (one row, newest key last) this is the page's stored metadata.

Cost1 (MagicPIG §5.1: 1/page_size for Quest) is measured per row as pages scored / context keys: scoring a
page takes two d-vectors (m and M), i.e. the FLOPs of ~one key's q·k and p·v, out of full attention's n.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from .base import AttentionContext, Method, MethodConfig, Selection, token_budget
from .labels import budget_label, count_label
from .registry import register
from .topk import topk_mask


@dataclass
class QuestConfig(MethodConfig):
    name: str = "quest"
    # tokens per page (Quest default and MagicPIG Table 3: 16)
    page_size: int = 16
    # ratio of the context (float) or tokens (int); pages selected = floor(budget_tokens / page_size), min 1
    budget: Any = 0.04
    # True: page min/max follow the generated keys (Quest).  False: MagicPIG-repo parity (pages frozen at the
    # first sparse call, later keys always attended); protocol A only.
    update_pages: bool = True
    # at least this many pages per row (paper: no minimum stated, 1 keeps a row from selecting nothing; the Quest
    # repo: 3, evaluation/quest_attention.py:56)
    min_pages: int = 1


def first_valid_key(valid: torch.Tensor) -> torch.Tensor:
    """valid bool [B, 1, Q, N] -> long [B]: index of each row's first valid key (N if none)."""
    anyv = valid[:, 0].any(1)  # [B, N]
    n = anyv.shape[-1]
    idx = torch.arange(n, device=valid.device).expand_as(anyv)
    return torch.where(anyv, idx, torch.full_like(idx, n)).amin(-1)


def page_ids(first: torch.Tensor, n: int, page_size: int) -> torch.Tensor:
    """long [B, N]: page of each key counted from the row's first valid key; -1 before it."""
    j = torch.arange(n, device=first.device).unsqueeze(0)  # [1, N]
    rel = j - first.unsqueeze(1)
    return torch.where(rel >= 0, torch.div(rel, page_size, rounding_mode="floor"), torch.full_like(rel, -1))


def build_pages(k: torch.Tensor, pid: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From-scratch page metadata.  k [B, Hkv, N, D], pid [B, N] (-1 = no page) ->
    (kmin, kmax) [B, Hkv, P, D] in k's dtype; a page without keys holds +inf / -inf."""
    b, h, _, d = k.shape
    kmin = torch.full((b, h, num_pages, d), float("inf"), dtype=k.dtype, device=k.device)
    kmax = torch.full((b, h, num_pages, d), float("-inf"), dtype=k.dtype, device=k.device)
    return _absorb(kmin, kmax, k, pid)


def _absorb(kmin, kmax, k, pid):
    """Fold keys k [B, Hkv, n, D] with pages pid [B, n] into (kmin, kmax) [B, Hkv, P, D], in place (scatter
    min/max).  A key outside every page (pid < 0 or ≥ P) is folded into page 0 as +inf / −inf, which leaves it as
    it is: no scratch page, so no copy of the tables."""
    b, h, p, d = kmin.shape
    if k.shape[2] == 0 or p == 0:
        return kmin, kmax
    inside = (pid >= 0) & (pid < p)  # [B, n]
    idx = torch.where(inside, pid, torch.zeros_like(pid)).view(b, 1, -1, 1).expand(b, h, k.shape[2], d)
    inside = inside.view(b, 1, -1, 1)
    kmin.scatter_reduce_(2, idx, torch.where(inside, k, float("inf")), "amin")
    kmax.scatter_reduce_(2, idx, torch.where(inside, k, float("-inf")), "amax")
    return kmin, kmax


def page_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """U[b, h, q, p] = Σ_c max(q_c m_{p,c}, q_c M_{p,c}) for q [B, Hq, Q, D] and kmin/kmax [B, Hkv, P, D]
    (query head h reads KV head h // G).  Empty pages (±inf) give -inf.  Returns fp32 [B, Hq, Q, P]."""
    b, hq, ql, d = q.shape
    hkv = kmin.shape[1]
    empty = ~torch.isfinite(kmin).all(-1)  # [B, Hkv, P]
    mn = torch.where(torch.isfinite(kmin), kmin, torch.zeros_like(kmin)).float()
    mx = torch.where(torch.isfinite(kmax), kmax, torch.zeros_like(kmax)).float()
    qg = q.float().reshape(b, hkv, (hq // hkv) * ql, d)  # a group's heads as G·Q rows (no copies of M, m)
    u = torch.matmul(qg.clamp_min(0), mx.transpose(-1, -2)) + torch.matmul(
        qg.clamp_max(0), mn.transpose(-1, -2)
    )  # [B, Hkv, G·Q, P]
    u = u.masked_fill(empty.view(b, hkv, 1, -1), float("-inf"))
    return u.reshape(b, hq, ql, -1)


def row_bound(q: torch.Tensor, rmin: torch.Tensor, rmax: torch.Tensor) -> torch.Tensor:
    """Per-row bound: q [B, Hq, Q, D], rmin/rmax [B, Hkv, Q, D] (one page per row) -> [B, Hq, Q]."""
    b, hq, ql, d = q.shape
    hkv = rmin.shape[1]
    qg = q.float().reshape(b, hkv, hq // hkv, ql, d)
    mn = torch.where(torch.isfinite(rmin), rmin, torch.zeros_like(rmin)).float().unsqueeze(2)
    mx = torch.where(torch.isfinite(rmax), rmax, torch.zeros_like(rmax)).float().unsqueeze(2)
    return torch.maximum(qg * mn, qg * mx).sum(-1).reshape(b, hq, ql)


def prefix_page_minmax(k: torch.Tensor, first: torch.Tensor, last: torch.Tensor, page_size: int):
    """min/max over the keys from the start of the page holding key ``last`` up to ``last`` (inclusive).

    k [B, Hkv, N, D], first [B] (first valid key), last [B, Q] (each row's newest valid key, >= first).
    Returns (rmin, rmax) [B, Hkv, Q, D].  Done by gathering each row's page into an aligned
    [B, Hkv, Q, page_size, D] block and taking a masked min/max (cheap: page_size keys per row).
    """
    b, h, n, d = k.shape
    start = first.unsqueeze(1) + torch.div(last - first.unsqueeze(1), page_size, rounding_mode="floor") * page_size
    off = torch.arange(page_size, device=k.device)
    pos = start.unsqueeze(-1) + off  # [B, Q, ps]
    inside = pos <= last.unsqueeze(-1)
    g = k.gather(2, pos.clamp(0, n - 1).reshape(b, 1, -1, 1).expand(b, h, -1, d)).reshape(b, h, *pos.shape[1:], d)
    m = inside.view(b, 1, *inside.shape[1:], 1)
    rmin = torch.where(m, g, torch.full_like(g, float("inf"))).amin(3)
    rmax = torch.where(m, g, torch.full_like(g, float("-inf"))).amax(3)
    return rmin, rmax


def page_budget(tokens: Any, page_size: int, min_pages: int = 1) -> Any:
    """Pages a row selects for a budget of ``tokens`` (``base.token_budget``): max(min_pages, ⌊tokens / page_size⌋),
    the rule of both paths.  Host form: an int; device form: a long tensor."""
    if torch.is_tensor(tokens):
        return torch.div(tokens, page_size, rounding_mode="floor").clamp_min(min_pages)
    return max(min_pages, tokens // page_size)


@register
class Quest(Method):
    """Quest page selection.  Per-row statistics: ``pages`` (pages selected), ``pages_scored`` (pages with at
    least one candidate key), ``one_page_floor`` (1 where the budget was below ``min_pages`` pages and
    ``min_pages`` were used).
    """

    name = "quest"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "the pages whose min/max keys bound q·k highest, within the budget (Quest)"
    config_class = QuestConfig
    index_reads_keys = False
    display_name = "Quest"
    budget_field = "budget"
    headline_options = ("page_size", "budget")

    @classmethod
    def contract_configs(cls):
        """Pages of 4 in a small static window (the end-to-end checks' config), pages of 8 selected per KV group
        with the Quest repo's floor of 3 pages, and the defaults (pages of 16)."""
        return [
            {"page_size": 4, "budget": 8, "local": 8},
            {"page_size": 8, "budget": 0.1, "gqa": "kv_head", "min_pages": 3},
            {},
        ]

    @classmethod
    def system_contract_configs(cls):
        """A ratio budget over pages of 8, and a token count over pages of 4 per KV group."""
        return {
            "quest": dict(name=cls.name, budget=0.1, page_size=8, local=16, dense_layers=[0]),
            "quest_kv_head_tokens": dict(
                name=cls.name, gqa="kv_head", budget=40, page_size=4, sink=2, local=8, dense_layers=[0]
            ),
        }

    @classmethod
    def static_step_contract_configs(cls):
        """A budget that grows while decoding: pages of 4, ⌊0.105·n⌋ // 4 grows from 6 to 7 pages at n = 267 (n runs
        over 261..276), so the device count is below k_cap = 7 in the first steps; a sink and a local window that do
        not end on page boundaries."""
        return {"quest_budget_grows": dict(name=cls.name, budget=0.105, page_size=4, sink=5, local=7, dense_layers=[1])}

    @classmethod
    def keep_all_options(cls, n):
        """At least n pages: every page of a row of n keys (the last one partial), so every candidate."""
        return {"budget": 1.0, "min_pages": n}

    def validate(self, num_layers=None, context=None):
        super().validate(num_layers, context)
        ps = self.config.page_size
        if isinstance(ps, bool) or not isinstance(ps, int) or ps < 1:
            raise ValueError(f"method.page_size={ps!r}: must be an int >= 1 (Quest default 16; MagicPIG 16, 32, 64)")
        mp = self.config.min_pages
        if isinstance(mp, bool) or not isinstance(mp, int) or mp < 1:
            raise ValueError(
                f"method.min_pages={mp!r}: must be an int >= 1 (default 1; the Quest repo's evaluation: 3)"
            )
        if not isinstance(self.config.update_pages, bool):
            raise ValueError(f"method.update_pages={self.config.update_pages!r}: must be true or false")

    def describe(self) -> str:
        return f"quest(page={self.config.page_size}, budget={self.config.budget})"

    @classmethod
    def index_memory(cls, params, shape, n, sparse_layers, building_rows=False):
        """Page bounds: a min and a max key (float32) per page of every KV head."""
        page = max(1, int(params.get("page_size", 16)))
        return {"page bounds": sparse_layers * shape.kv_heads * math.ceil(n / page) * 2 * shape.head_dim * 4}

    @classmethod
    def label(cls, params):
        """(page size, budget), as MagicPIG's tables write Quest's configs."""
        return f"({count_label(params.get('page_size'))},{budget_label(params.get('budget'))})"

    # -- page metadata ---------------------------------------------------------------------------
    def _update_pages(self, ctx: AttentionContext, first: torch.Tensor) -> dict[str, Any]:
        """Brings ``ctx.state['quest']`` up to date with all keys (once per attention call); ``first`` [B] is
        each row's first valid key."""
        ps = self.config.page_size
        k = ctx.k
        b, hkv, n, d = k.shape
        st = ctx.state.get("quest")
        fresh = (
            st is None
            or st["n"] > n
            or st["batch"] != b
            or st["page_size"] != ps
            or st["kmin"].shape[-1] != d
            # a state its cache drops with any removal of keys still covers them; else compare on the device
            or (
                not ctx.state_tracks_cache
                and (
                    not torch.equal(st["first"], first)
                    or (st["n"] > 0 and not torch.equal(st["last_key"], k[:, :, st["n"] - 1]))
                )
            )
        )
        # the rows' earliest first valid key, on the host: read once when the pages are built (a host sync), then
        # kept, so that the page count needs no sync in later calls
        first_min = (int(first.min()) if b else 0) if fresh else st["first_min"]

        def _stored(**pages: Any) -> dict[str, Any]:  # this call's state: what the next call compares against
            ctx.state["quest"] = {"n": n, "batch": b, "page_size": ps, "first": first, "first_min": first_min, **pages}
            return ctx.state["quest"]

        if not self.config.update_pages:
            if fresh:
                # MagicPIG parity: pages over the keys present before this (first sparse) call, whole pages only,
                # left of the local window; the remainder and all later keys are always attended.
                before = n - ctx.q.shape[2]
                whole = torch.div((before - self.config.local - first).clamp_min(0), ps, rounding_mode="floor")
                pages = int(whole.max().item()) if b else 0
                pid = page_ids(first, n, ps)
                pid = torch.where((pid >= 0) & (pid < whole.unsqueeze(1)), pid, torch.full_like(pid, -1))
                kmin, kmax = build_pages(k, pid, pages)
                st = _stored(kmin=kmin, kmax=kmax, frozen_end=first + whole * ps, last_key=k[:, :, n - 1].clone())
            return st
        pages = (max(0, n - first_min) + ps - 1) // ps if b else 0  # max over rows of ⌈(n − first) / ps⌉
        if fresh:
            pid = page_ids(first, n, ps)
            kmin, kmax = build_pages(k, pid, pages)
            bufs = (kmin, kmax)
        else:
            bufs = st["bufs"]  # [B, Hkv, capacity, D]: pages not yet begun hold +inf / -inf
            if pages > bufs[0].shape[2]:  # room for twice as many pages, so growing by one is O(1) amortised
                cap = max(pages, 2 * bufs[0].shape[2])
                grown = (
                    bufs[0].new_full((b, hkv, cap, d), float("inf")),
                    bufs[1].new_full((b, hkv, cap, d), float("-inf")),
                )
                for g, o in zip(grown, bufs):
                    g[:, :, : o.shape[2]] = o
                bufs = grown
            kmin, kmax = bufs[0][:, :, :pages], bufs[1][:, :, :pages]
            old = st["n"]
            pid_new = page_ids(first, n, ps)[:, old:]
            kmin, kmax = _absorb(kmin, kmax, k[:, :, old:], pid_new)  # the new keys, the last partial page included
        last_key = k[:, :, n - 1].clone() if n else None
        return _stored(kmin=kmin, kmax=kmax, bufs=bufs, frozen_end=None, last_key=last_key)

    # -- selection -------------------------------------------------------------------------------
    def select(self, ctx: AttentionContext) -> Selection:
        cfg = self.config
        ps = cfg.page_size
        b, hq, ql, n = ctx.scores.shape
        first = first_valid_key(ctx.valid)
        st = ctx.state.get("quest")
        if ctx.query_offset == 0 or st is None:
            st = self._update_pages(ctx, first)
        else:
            # a later query block may be the first to show a row's first valid key (left padding longer than a
            # block): rows whose start was unknown take it now and the pages are rebuilt
            known = first < n
            if bool((known & (first != st["first"])).any()):
                st = self._update_pages(ctx, torch.where(known, first, st["first"]))
        first = st["first"]
        kmin, kmax = st["kmin"], st["kmax"]
        num_pages = kmin.shape[2]
        dev = ctx.q.device

        pid = page_ids(first, n, ps)  # [B, N]
        if st["frozen_end"] is not None:  # parity mode: pages only inside the frozen region of each row
            inside = torch.arange(n, device=dev).view(1, n) < st["frozen_end"].view(b, 1)
            pid = torch.where(inside, pid, torch.full_like(pid, -1))
        cand = ctx.candidates  # [B, 1, Q, N]
        in_page = (pid >= 0).view(b, 1, 1, n)
        # pages that hold at least one candidate key of the row: [B, 1, Q, P]
        target = torch.where(pid >= 0, pid, torch.full_like(pid, num_pages)).view(b, 1, 1, n).expand(b, 1, ql, n)
        cand_pages = (
            torch.zeros(b, 1, ql, num_pages + 1, device=dev).scatter_add_(-1, target, (cand & in_page).float())[
                ..., :num_pages
            ]
            > 0
        )

        u = page_bound(ctx.q, kmin, kmax)  # [B, Hq, Q, P]
        if ql > 1 and num_pages > 0:
            # the page holding each row's newest valid key: bound over its keys up to the row only
            last = torch.where(ctx.valid[:, 0], torch.arange(n, device=dev), torch.full((1,), -1, device=dev)).amax(-1)
            has = last >= first.unsqueeze(1)  # [B, Q]
            lastc = torch.where(has, last, first.unsqueeze(1).clamp_max(n - 1))
            rmin, rmax = prefix_page_minmax(ctx.k, first.clamp_max(n - 1), lastc, ps)
            own = row_bound(ctx.q, rmin, rmax)  # [B, Hq, Q]
            lp = torch.div(lastc - first.unsqueeze(1), ps, rounding_mode="floor").clamp(0, num_pages - 1)  # [B, Q]
            fix = has & (lp < num_pages)
            if st["frozen_end"] is not None:
                fix = fix & (lastc < st["frozen_end"].unsqueeze(1))
            lp_idx = lp.view(b, 1, ql, 1).expand(b, hq, ql, 1)
            cur = u.gather(-1, lp_idx).squeeze(-1)
            u = u.scatter(-1, lp_idx, torch.where(fix.view(b, 1, ql), own, cur).unsqueeze(-1))
        if cfg.gqa == "kv_head":
            u = ctx.group_sum(torch.where(cand_pages, u, torch.zeros_like(u)))
        u = u.masked_fill(~cand_pages, float("-inf"))

        tokens = self.budget_tokens(ctx)  # [B, 1, Q, 1]
        floor = (tokens < cfg.min_pages * ps) & (ctx.n_valid > 0)
        want = page_budget(tokens, ps, cfg.min_pages)
        # host bound on the rows' page budgets (no device sync): the budget at n keys, n ≥ every row's n_valid
        chosen = topk_mask(u, want, page_budget(token_budget(cfg.budget, n), ps, cfg.min_pages))  # [B, Hq, Q, P]
        # key j is kept if its page is chosen (and it is a candidate)
        chosen_ext = torch.cat([chosen, torch.zeros_like(chosen[..., :1])], -1)
        keep = chosen_ext.gather(-1, target.expand(b, hq, ql, n)) & cand
        if st["frozen_end"] is not None:  # parity: keys after the frozen pages are always attended
            later = torch.arange(n, device=dev).view(1, n) >= st["frozen_end"].view(b, 1)
            keep = keep | (later.view(b, 1, 1, n) & cand)
        scored = cand_pages.sum(-1).float()  # [B, 1, Q]
        stats = {
            "pages": chosen.sum(-1).float(),
            "pages_scored": scored.expand(b, hq, ql).clone(),
            "one_page_floor": floor.squeeze(-1).float().expand(b, hq, ql).clone(),
        }
        return Selection(keep=keep, stats=stats)

    def cost1(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor:
        """Pages scored / context keys, per row (≈ 1 / page_size)."""
        nv = ctx.n_valid.squeeze(-1).clamp_min(1).float()  # [B, 1, Q]
        return sel.stats["pages_scored"] / nv

    def index_bytes(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor:
        """Each scored page's min and max vectors: pages_scored · 2 · D · e bytes per query-head row (the metadata is
        kept in the cache dtype, element size e); the chosen pages' K and V are added by the core."""
        return sel.stats["pages_scored"] * (2.0 * ctx.k.shape[-1] * ctx.k.element_size())
