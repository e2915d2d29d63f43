"""Quest's system layer: KV cache on the GPU plus per-page min/max keys; per step: page bounds, top pages, attention
over their tokens and the static keys (``kernels.quest``, ``kernels.sparse_decode``)."""

from __future__ import annotations

from typing import Any

import torch

import sparse_eval.kernels.quest as kqu
import sparse_eval.kernels.sparse_decode as ksd
import sparse_eval.kernels.topk as ktopk

from ...methods.base import token_budget
from ...methods.quest import page_budget
from .base import SelectsTopK, check_topk
from .full import FullLayer
from .registry import LayerOptions, register_layer


@register_layer("quest")
class QuestLayer(SelectsTopK, FullLayer):
    """Quest decode over a GPU KV cache: per-page min/max keys kept as keys arrive, page bounds U_p(q)
    (``kernels.quest.page_scores``), the top pages' tokens plus the static sink/local keys attended
    (``kernels.sparse_decode``).  Same selection as ``methods.quest`` with ``update_pages=true`` (Quest's own
    behaviour): only pages holding a candidate (non-static) key compete, and the budget is
    max(1, floor(budget_tokens / page_size)) pages.  ``topk`` as in ``DSLayer``.  With a ``StaticStep`` the new
    key is folded into its page at the device position, and the decode runs over every page of the capacity
    (``_decode_static``)."""

    kind = "quest"

    def __init__(
        self,
        layer_idx: int,
        capacity: int,
        *,
        page_size: int,
        budget: float | int,
        sink: int,
        local: int,
        gqa: str = "query_head",
        backend: str = "auto",
        topk: str = "radix",
    ):
        super().__init__(layer_idx, capacity, backend=backend)
        if gqa not in kqu.GQA_MODES:
            raise ValueError(f"gqa={gqa!r}: valid values are {list(kqu.GQA_MODES)}")
        self.topk = check_topk(topk)
        self.ps, self.budget_cfg, self.sink, self.local, self.gqa = page_size, budget, sink, local, gqa
        self.kmin = self.kmax = None

    def update(self, key_states, value_states, *args, **kwargs):
        out = super().update(key_states, value_states, *args, **kwargs)
        t = key_states.shape[2]
        if self.kmin is None:  # prefill: pages of the prompt, room for the rest
            b, hkv, _, d = key_states.shape
            cap = -(-self.capacity // self.ps)
            big = torch.finfo(key_states.dtype).max
            self.kmin = key_states.new_full((b, hkv, cap, d), big)
            self.kmax = key_states.new_full((b, hkv, cap, d), -big)
            lo, hi = kqu.page_metadata(key_states, self.ps)
            self.kmin[:, :, : lo.shape[2]] = lo
            self.kmax[:, :, : hi.shape[2]] = hi
        elif self.static is not None:  # static step: the page of the device position
            p = torch.div(self.static.pos, self.ps, rounding_mode="floor")  # [1]
            self.kmin.index_copy_(2, p, torch.minimum(self.kmin.index_select(2, p), key_states))
            self.kmax.index_copy_(2, p, torch.maximum(self.kmax.index_select(2, p), key_states))
        else:
            for j in range(t):  # fold each new key into its page (the last, partial one or a new one)
                p = (self.n - t + j) // self.ps
                torch.minimum(self.kmin[:, :, p], key_states[:, :, j], out=self.kmin[:, :, p])
                torch.maximum(self.kmax[:, :, p], key_states[:, :, j], out=self.kmax[:, :, p])
        return out

    def repeat_batch(self, times: int) -> None:
        super().repeat_batch(times)
        self.kmin = self.kmin.repeat(times, 1, 1, 1)
        self.kmax = self.kmax.repeat(times, 1, 1, 1)

    def _want(self, n):
        """Pages to select for n keys: ``page_budget(token_budget(budget, n), page_size)``, the accuracy path's
        page count (an int budget is not capped at n).  n: an int, or a device tensor (then a long tensor)."""
        return page_budget(token_budget(self.budget_cfg, n), self.ps)

    def _candidate_tokens(self, chosen: torch.Tensor, limit: int, c_lo: Any, c_hi: Any) -> torch.Tensor:
        """The tokens of the chosen pages [B, Hs, P'] (−1 padded) below ``limit`` that are candidates, in
        [c_lo, c_hi) (ints, or device tensors): [B, Hs, P'·page_size], −1 elsewhere."""
        tok = kqu.pages_to_tokens(chosen, self.ps, limit)
        return torch.where((tok >= c_lo) & (tok < c_hi), tok, torch.full_like(tok, -1))

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static(q, scaling)
        n, ps = self.n, self.ps
        q3 = q[:, :, 0]
        b = q3.shape[0]
        pages = -(-n // ps)
        u = kqu.page_scores(
            q3, self.kmin[:, :, :pages], self.kmax[:, :, :pages], reduce=self.gqa == "kv_head", backend=self.backend
        )  # [B, Hs, P]
        c_lo, c_hi = self.sink, n - self.local  # candidate keys [c_lo, c_hi)
        p_lo, p_hi = (c_lo // ps, -(-c_hi // ps)) if c_hi > c_lo else (0, 0)
        pid = torch.arange(pages, device=q.device)
        u = u.masked_fill((pid < p_lo) | (pid >= p_hi), float("-inf"))
        want = self._want(n)
        chosen = kqu.top_pages(u, want, backend=self.backend, topk=self.topk)  # [B, Hs, want]
        tok = self._candidate_tokens(chosen, n, c_lo, c_hi)  # [B, Hs, want·ps]
        static = torch.cat(
            [
                torch.arange(min(self.sink, n), device=q.device, dtype=tok.dtype),
                torch.arange(max(self.sink, n - self.local), n, device=q.device, dtype=tok.dtype),
            ]
        )
        static = static.expand(b, tok.shape[1], -1)
        idx = torch.cat([tok, static], -1)
        o, _ = ksd.attention(q3, self.keys[:, :, :n], self.values[:, :, :n], idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)

    def _decode_static(self, q, scaling):
        """``decode`` with shapes fixed by the capacity: bounds of every page of the capacity, those outside the
        candidate pages (from the device-side length) at −inf; the top ``_want(n)`` pages (a device count) in
        k_cap = ``_want(capacity)`` slots; their candidate tokens plus the sink and local keys (fixed slots, −1
        where a position does not exist yet).  The same keys as ``decode``'s, up to ties."""
        st, ps = self.static, self.ps
        q3 = q[:, :, 0]
        dev = q.device
        n = st.pos + 1  # [1] keys, the new one included (every row has the same length on this path)
        u = kqu.page_scores(q3, self.kmin, self.kmax, reduce=self.gqa == "kv_head", backend=self.backend)  # [B, Hs, P]
        c_lo, c_hi = self.sink, n - self.local  # candidate keys [c_lo, c_hi)
        pid = torch.arange(u.shape[-1], device=dev)
        p_hi = torch.where(c_hi > c_lo, torch.div(c_hi + ps - 1, ps, rounding_mode="floor"), 0)
        u = u.masked_fill((pid < c_lo // ps) | (pid >= p_hi), float("-inf"))
        k_cap = min(self._want(self.capacity), u.shape[-1])
        count = self._want(n).to(torch.int32).expand(u.shape[0], u.shape[1]).contiguous()  # [B, Hs]
        chosen = ktopk.select(u, k_cap, count, backend=self._topk_backend())  # [B, Hs, k_cap], −1 padded
        tok = self._candidate_tokens(chosen, self.capacity, c_lo, c_hi)  # [B, Hs, k_cap·ps]
        sink = torch.arange(self.sink, device=dev, dtype=tok.dtype)
        local = (n - self.local + torch.arange(self.local, device=dev)).to(tok.dtype)
        static = torch.cat([torch.where(sink < n, sink, -1), torch.where(local >= max(self.sink, 0), local, -1)])
        idx = torch.cat([tok, static.expand(tok.shape[0], tok.shape[1], -1)], -1)
        o, _ = ksd.attention(q3, self.keys, self.values, idx, scaling=scaling, backend=self.backend)
        return o.unsqueeze(2)

    @classmethod
    def row_bytes(cls, cfg, n, steps, hkv, d):
        """The KV cache plus the page metadata, 2 · hkv · d · 2 · ceil(n / page) (min and max per page), on the GPU."""
        gpu, cpu = super().row_bytes(cfg, n, steps, hkv, d)
        return gpu + 2 * hkv * d * 2 * (-(-n // cfg["page_size"])), cpu

    @classmethod
    def from_method(cls, layer_idx: int, method: Any, opts: LayerOptions) -> "QuestLayer":
        c = method.config
        if not c.update_pages:
            raise ValueError(
                "method.update_pages=false (the MagicPIG repo's frozen pages) has no system path; "
                "valid: true (Quest's own incremental pages)"
            )
        if c.min_pages != 1:
            raise ValueError(
                f"method.min_pages={c.min_pages} has no system path (its kernels keep at least one page); valid: 1"
            )
        return cls(
            layer_idx,
            opts.capacity,
            page_size=c.page_size,
            budget=c.budget,
            sink=c.sink,
            local=c.local,
            gqa=c.gqa,
            backend=opts.backend_gpu,
            topk=opts.topk,
        )
