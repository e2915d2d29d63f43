"""MagicPIG's system layer (MagicPIG §4.4, eq. 11): KV cache and hash tables in CPU memory, sink and local window on
the GPU; per step: the query's codes on the GPU, collision sampling and the −log u-corrected attention on the CPU
(numba), the static keys on the GPU, both parts merged exactly by log-sum-exp."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

import sparse_eval.kernels.magicpig as kmp
import sparse_eval.kernels.magicpig_cpu as kmc
import sparse_eval.kernels.merge as kmerge

from .base import host_empty, tile, to_device, to_host, to_host_async, wait_host
from .full import FullLayer
from .registry import LayerOptions, register_layer


@register_layer("magicpig")
class MagicPIGLayer(FullLayer):
    """MagicPIG with its KV cache and hash tables in CPU memory (§4.4).

    ``method`` is the accuracy path's ``MagicPIG`` (its config and seeded projections are reused, so both paths
    hash with the same hyperplanes).  The keys a row may sample are the non-static ones (between the sink and
    the local window); μ (centering) is their mean at the first decode step, as in the accuracy path.  Keys
    leaving the local window later are hashed with that μ into an overflow list that is searched by brute force
    next to the tables (it holds at most the number of generated tokens, in a buffer preallocated for all of them).
    """

    kind = "magicpig"
    # a static step (``_decode_static``) has a host part in the middle: on CUDA the decoder captures the step in
    # pieces cut there (``SystemSession.cut``) and runs the host part between their replays
    cuts_step = True
    builds_at_first_step = True  # the first decode step (eager) fixes μ and builds the tables

    def __init__(
        self, layer_idx: int, capacity: int, method: Any, *, backend_gpu: str = "auto", backend_cpu: str = "auto"
    ):
        # the CPU kernel reads this cache; only one token per step crosses the bus, so it needs no pinning
        super().__init__(layer_idx, capacity, kv_device="cpu", pin=False)
        c = method.config
        if c.mips:
            raise ValueError(
                "method.mips=true: the MagicPIG CPU kernel hashes centred keys without the eq. 8 "
                "transform; the system path supports mips=false only"
            )
        if c.u_offset:
            raise ValueError(
                f"method.u_offset={c.u_offset}: the MagicPIG CPU kernel implements eq. 11 (u_offset=0) only"
            )
        self.method = method
        self.cfg = c
        self.backend_gpu, self.backend_cpu = backend_gpu, backend_cpu
        self.tables = None
        self.cand_end = 0  # keys [sink, cand_end) are candidates (in the tables or the overflow)
        self.table_end = 0
        self.ring = None  # static steps: the local window as a ring, and the host/device buffers (``_static_init``)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """One host buffer [B, Hkv, capacity, 2, D] with a token's K and V side by side (keys and values are its two
        halves): the CPU kernel then reads one 512-byte row per sampled key (D = 128, bf16) instead of two 256-byte
        rows at unrelated places, 1.05–1.14x the gather bandwidth on the H200 machine's Xeon
        (experiments/magicpig_cpu_attention/kv_side_by_side_gather.txt)."""
        b, hkv, _, d = key_states.shape
        self.device = key_states.device
        self.kv = host_empty((b, hkv, self.capacity, 2, d), key_states.dtype)
        self.keys, self.values = self.kv[..., 0, :], self.kv[..., 1, :]
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if self.static is not None:  # static step: the new token reaches the host and the window in _decode_static
            return key_states, value_states
        first = not self.is_initialized
        t = key_states.shape[2]
        # one contiguous device-to-host copy each, then the strided write into the head-major host cache (the CPU
        # kernel wants head-major rows); a strided device-to-pageable copy would move row by row
        super().update(*to_host(key_states, value_states))
        if first:  # prefill: the sink and the last `local` keys on the GPU, with room for the generated ones
            s = self.cfg.sink
            self.sink_k = key_states[:, :, :s].clone()
            self.sink_v = value_states[:, :, :s].clone()
            self.w0 = max(s, self.n - self.cfg.local)  # the GPU window holds positions [w0, n)
            m = self.n - self.w0
            b, hkv, _, d = key_states.shape
            self.win_k = torch.empty(
                (b, hkv, m + self.capacity - self.n, d), dtype=key_states.dtype, device=key_states.device
            )
            self.win_v = torch.empty_like(self.win_k)
            self.win_k[:, :, :m] = key_states[:, :, self.w0 :]
            self.win_v[:, :, :m] = value_states[:, :, self.w0 :]
        else:
            m = self.n - t - self.w0
            self.win_k[:, :, m : m + t] = key_states
            self.win_v[:, :, m : m + t] = value_states
        return key_states, value_states

    def repeat_batch(self, times: int) -> None:
        self.kv = tile(self.kv, times, pin=False)
        self.keys, self.values = self.kv[..., 0, :], self.kv[..., 1, :]
        for name in ("win_k", "win_v", "sink_k", "sink_v"):
            setattr(self, name, getattr(self, name).repeat(times, 1, 1, 1))
        if self.tables is not None:
            t = self.tables
            # on the huge pages the built tables have (numpy advises its large arrays), so that a tiled row is
            # looked up as fast as a distinct one would be
            self.tables = type(t)(
                perm=tile(t.perm, times, pin=False),
                offsets=tile(t.offsets, times, pin=False),
                k_bits=t.k_bits,
                n_tables=t.n_tables,
            )
            self.mean = self.mean.repeat(times, 1, 1)
            self.mean_cpu = self.mean.cpu()
            self.over_codes = self.over_codes.repeat(times, 1, 1, 1)  # [B, Hkv, room, L], first n_over filled

    def nbytes(self) -> dict[str, int]:
        out = super().nbytes()
        for t in (getattr(self, "win_k", None), getattr(self, "win_v", None)):
            if t is not None:
                out["gpu" if t.is_cuda else "cpu"] += t.numel() * t.element_size()
        if self.tables is not None:
            out["cpu"] += self.tables.nbytes()
        return out

    def _window(self, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.win_k[:, :, lo - self.w0 : hi - self.w0], self.win_v[:, :, lo - self.w0 : hi - self.w0]

    def _build(self, n: int, dev: torch.device) -> None:
        """Fix μ over the candidates [sink, n − local) and build the tables (first decode step)."""
        c = self.cfg
        lo, hi = c.sink, max(c.sink, n - c.local)
        b, hkv, _, d = self.keys.shape
        self.w = self.method.projection(self.layer_idx, d, dev)
        if hi <= lo:
            return
        self.cand_end = self.table_end = hi
        k_c = self.keys[:, :, lo:hi].to(dev, non_blocking=True)
        self.mean = self.method.key_mean(k_c)  # [B, Hkv, D] float32, the accuracy path's centering
        codes = kmp.hash_codes(k_c.float() - self.mean[:, :, None], self.w, c.K, c.L, backend=self.backend_gpu)
        self.tables = kmc.build_tables(codes.cpu(), c.K, backend=self.backend_cpu)
        # codes of the keys that leave the window later: at most capacity − hi of them, written in place as they
        # come (a concatenation per step copied the whole list: quadratic in the generated tokens)
        self.over_codes = torch.empty(b, hkv, max(1, self.capacity - hi), c.L, dtype=torch.int32)
        self.n_over = 0
        self.mean_cpu = self.mean.cpu()

    def _append_overflow(self, codes: torch.Tensor) -> None:
        """codes [B, Hkv, e, L] of keys that left the window, after the ones stored."""
        e = codes.shape[2]
        if self.n_over + e > self.over_codes.shape[2]:
            raise RuntimeError(
                f"layer {self.layer_idx}: {self.n_over} + {e} overflow keys exceed the room for "
                f"{self.over_codes.shape[2]} (capacity {self.capacity})"
            )
        self.over_codes[:, :, self.n_over : self.n_over + e] = codes
        self.n_over += e

    def _overflow_keys(self, n: int) -> torch.Tensor | None:
        """The keys that left the local window since the last step, centred by μ: [B, Hkv, t, D] float32 on the
        GPU (None if none left)."""
        hi = max(self.cfg.sink, n - self.cfg.local)
        if hi <= self.cand_end:
            return None
        k, _ = self._window(self.cand_end, hi)
        self.cand_end = hi
        return k.float() - self.mean[:, :, None]

    def _codes_async(self, q3: torch.Tensor, k_over: torch.Tensor | None) -> tuple:
        """Start the SimHash codes of the query rows and of the keys leaving the window (one GPU launch) and the
        query rows in float32 on their way to the host; ``_codes_wait`` collects them."""
        c = self.cfg
        qf = q3.float()
        rows = [qf.reshape(-1, q3.shape[-1])] + ([] if k_over is None else [k_over.reshape(-1, q3.shape[-1])])
        x = torch.cat(rows) if len(rows) > 1 else rows[0]
        codes = kmp.hash_codes(x, self.w, c.K, c.L, backend=self.backend_gpu).to(torch.int32)
        return to_host_async(codes, qf), tuple(q3.shape), None if k_over is None else tuple(k_over.shape)

    def _codes_wait(self, started: tuple) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(q codes int32 [B, Hq, L], key codes int32 [B, Hkv, t, L] or None, q float32 [B, Hq, D]) on the host."""
        (codes, q_host), q_shape, k_shape = wait_host(started[0]), started[1], started[2]
        nq = q_shape[0] * q_shape[1]
        q_codes = codes[:nq].view(*q_shape[:2], self.cfg.L)
        over = None if k_shape is None else codes[nq:].view(*k_shape[:3], self.cfg.L)
        return q_codes, over, q_host

    def _sample(self, q_codes: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(idx int32 [B, Hq, S] cache positions, −1 padded; count int32 [B, Hq]) of the sampled keys: the tables'
        samples (ascending), then the overflow list's (ascending), placed by the look-up's own kernels (on the
        H200 machine's Xeon, numpy passes for the sink offset, the padding and the overflow hits took ~0.9 ms per
        layer at 16K × 14 rows, more than the look-up's 0.7 ms)."""
        c = self.cfg
        idx, cnt = kmc.sample(
            self.tables,
            q_codes,
            c.min_collisions,
            backend=self.backend_cpu,
            index_offset=c.sink,
            extra_codes=self.over_codes if self.n_over else None,
            extra_offset=self.table_end,
            extra_count=self.n_over,
        )
        return idx.numpy(), cnt.numpy()

    def _count(self, session, cnt: np.ndarray) -> None:
        """The run's sampling counters for one step's counts cnt [B, Hq]: keys sampled, rows, candidate keys."""
        session.stats["sampled"] += int(cnt.sum(dtype=np.int64))
        session.stats["sample_rows"] += cnt.size
        session.stats["candidates"] += (self.cand_end - self.cfg.sink) * cnt.size

    def _cpu_attention(
        self, q_host: torch.Tensor, idx: np.ndarray, cnt: np.ndarray, scaling: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The −log u-corrected attention of eq. 11 over the sampled keys (``kernels.magicpig_cpu.attention``):
        q_host float32 [B, Hq, D] -> (o float32 [B, Hq, D], lse float32 [B, Hq])."""
        c = self.cfg
        return kmc.attention(
            q_host,
            self.keys,
            self.values,
            torch.from_numpy(idx),
            torch.from_numpy(cnt),
            k_bits=c.K,
            n_tables=c.L,
            min_collisions=c.min_collisions,
            scaling=scaling,
            k_mean=self.mean_cpu,
            backend=self.backend_cpu,
        )

    def decode(self, session, module, q, k_new, v_new, scaling):
        if self.static is not None:
            return self._decode_static(session, q, k_new, v_new, scaling)
        c = self.cfg
        n = self.n
        q3 = q[:, :, 0]  # [B, Hq, D]
        b, hq, d = q3.shape
        phase = session.phase
        if self.tables is None:  # first step with a candidate key: fix μ, build the tables
            self._build(n, q.device)
        codes = None
        if self.tables is not None:
            # the query's codes (and the new overflow keys') on their way to the host first
            with phase("magicpig_codes_to_host"):
                codes = self._codes_async(q3, self._overflow_keys(n))
        # the static keys, attended on the GPU with weight 1 (u = 1): sink [0, sink) and window
        # [max(sink, n - local), n)
        s_n = min(c.sink, n)
        wk, wv = self._window(max(c.sink, n - c.local), n)
        static = (self.sink_k[:, :, :s_n], self.sink_v[:, :, :s_n], wk, wv)
        if codes is None:  # no candidate keys yet: every key is static
            with phase("magicpig_static_attention_merge"):
                o, _ = kmerge.attend_and_merge(
                    q3,
                    *static,
                    torch.zeros(b, hq, d, device=q.device),
                    torch.full((b, hq), float("-inf"), device=q.device),
                    scaling,
                    backend=self.backend_gpu,
                )
                return o.to(q.dtype).unsqueeze(2)
        # CPU part: sampling and the −log u-corrected attention (eq. 11)
        with phase("magicpig_codes_to_host"):
            q_codes, over, q_host = self._codes_wait(codes)
            if over is not None:
                self._append_overflow(over)
        with phase("magicpig_cpu_sample"):
            idx, cnt = self._sample(q_codes)
        self._count(session, cnt)
        with phase("magicpig_cpu_attention"):
            o_c, lse_c = self._cpu_attention(q_host, idx, cnt, scaling)
        with phase("magicpig_static_attention_merge"):
            # the static keys' attention merged with the CPU part by log-sum-exp, in one launch on CUDA
            o, _ = kmerge.attend_and_merge(
                q3, *static, *to_device(q.device, o_c, lse_c), scaling, backend=self.backend_gpu
            )
            return o.to(q.dtype).unsqueeze(2)

    # -- static steps (the captured decode step) ------------------------------------------------------------
    def _static_init(self) -> None:
        """From the eager layout to the static one, after at least one eager step: the window [n − local, n) moves
        into a ring of ``local`` slots (position p in slot p mod local, so the key that leaves the window when
        position p arrives is the one p overwrites), and fixed host (page-locked) and device buffers carry each
        step's codes, query, new K/V and the CPU part's output across the host part."""
        c = self.cfg
        n = self.n
        if self.tables is None or n - c.local < c.sink:
            raise ValueError(
                f"layer {self.layer_idx}: a static MagicPIG step needs the tables built and a full local "
                f"window after the sink (n − local ≥ sink); n = {n}, local = {c.local}, sink = {c.sink}: "
                f"decode with cuda_graph=false for prompts this short"
            )
        if self.cand_end != n - c.local:
            raise RuntimeError(
                f"layer {self.layer_idx}: candidates end at {self.cand_end}, expected n − local = {n - c.local}"
            )
        wk, wv = self._window(n - c.local, n)  # [B, Hkv, local, D], positions n − local .. n − 1
        slots = torch.arange(n - c.local, n, device=wk.device) % c.local
        ring_k = torch.empty_like(wk)
        ring_v = torch.empty_like(wv)
        ring_k[:, :, slots] = wk
        ring_v[:, :, slots] = wv
        self.ring = (ring_k, ring_v)
        self.host_n = n  # the position the next static step writes (host side)
        self._static_bufs: dict[str, torch.Tensor] = {}

    def _buf(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A fixed buffer of this layer's static steps: on ``device``, or on the host (``device`` cpu), page-locked
        when the GPU is in use (a copy to or from pageable memory cannot be captured)."""
        got = self._static_bufs.get(name)
        if got is None:
            if device.type == "cpu":
                got = torch.empty(shape, dtype=dtype, pin_memory=self.mean.is_cuda)
            else:
                got = torch.empty(shape, dtype=dtype, device=device)
            self._static_bufs[name] = got
        return got

    def _decode_static(self, session, q, k_new, v_new, scaling):
        """One decode step with static shapes (all shapes fixed, no host value read on the GPU side): the GPU
        work before the host part (window ring, the SimHash codes of the query and of the key leaving the window,
        copies to the host), ``session.cut`` (the host part, ``_host_part``: new K/V into the host cache, the
        table sampling and the CPU attention of eq. 11), then the merge by log-sum-exp with the static keys."""
        if self.ring is None:
            self._static_init()
        c = self.cfg
        st = self.static
        q3 = q[:, :, 0]  # [B, Hq, D]
        b, hq, d = q3.shape
        hkv = k_new.shape[1]
        ring_k, ring_v = self.ring
        slot = torch.remainder(st.pos, c.local)  # [1] on the device
        leaving = ring_k.index_select(2, slot)  # [B, Hkv, 1, D] position pos − local: it leaves the window now
        ring_k.index_copy_(2, slot, k_new)
        ring_v.index_copy_(2, slot, v_new)
        x = torch.cat([q3.float().reshape(-1, d), (leaving[:, :, 0].float() - self.mean).reshape(-1, d)])
        codes = kmp.hash_codes(x, self.w, c.K, c.L, backend=self.backend_gpu).to(torch.int32)  # [B·Hq + B·Hkv, L]
        host = torch.device("cpu")
        h_codes = self._buf("codes", tuple(codes.shape), torch.int32, host)
        h_q = self._buf("q", (b, hq, d), torch.float32, host)
        h_kv = self._buf("kv", (b, hkv, 2, d), k_new.dtype, host)
        # contiguous on both sides, so each is one asynchronous copy into page-locked memory (capturable)
        h_codes.copy_(codes, non_blocking=True)
        h_q.copy_(q3.float().contiguous(), non_blocking=True)
        h_kv.copy_(torch.stack([k_new[:, :, 0], v_new[:, :, 0]], 2), non_blocking=True)  # [B, Hkv, 2, D]
        h_o = self._buf("o", (b, hq, d), torch.float32, host)
        h_lse = self._buf("lse", (b, hq), torch.float32, host)
        session.cut(lambda: self._host_part(session, scaling))
        d_o = self._buf("o_dev", (b, hq, d), torch.float32, q.device)
        d_lse = self._buf("lse_dev", (b, hq), torch.float32, q.device)
        d_o.copy_(h_o, non_blocking=True)
        d_lse.copy_(h_lse, non_blocking=True)
        o, _ = kmerge.attend_and_merge(
            q3,
            self.sink_k[:, :, : c.sink],
            self.sink_v[:, :, : c.sink],
            ring_k,
            ring_v,
            d_o,
            d_lse,
            scaling,
            backend=self.backend_gpu,
        )
        return o.to(q.dtype).unsqueeze(2)

    def _host_part(self, session, scaling: float) -> None:
        """The host part of a static step, once its copies have landed (host-side state only; no GPU work): the
        new token's K and V into the host cache at ``host_n``, the leaving key's codes onto the overflow list,
        the sampling and the CPU attention, whose output and log-sum-exp go to the fixed host buffers."""
        c = self.cfg
        bufs = self._static_bufs
        n = self.host_n
        self.kv[:, :, n].copy_(bufs["kv"])
        b, hq, d = bufs["q"].shape
        nq = b * hq
        q_codes = bufs["codes"][:nq].view(b, hq, c.L)
        over = bufs["codes"][nq:].view(b, -1, 1, c.L)
        self._append_overflow(over)
        self.cand_end += 1  # position n − local left the window
        t0 = time.perf_counter()
        idx, cnt = self._sample(q_codes)
        t1 = time.perf_counter()
        self._count(session, cnt)
        o_c, lse_c = self._cpu_attention(bufs["q"], idx, cnt, scaling)
        t2 = time.perf_counter()
        bufs["o"].copy_(o_c)
        bufs["lse"].copy_(lse_c)
        self.host_n = n + 1
        # where the host parts' time goes (per-layer averages: stats / host_parts): the look-up, the attention
        session.stats["host_parts"] += 1
        session.stats["host_sample_ms"] += 1e3 * (t1 - t0)
        session.stats["host_attention_ms"] += 1e3 * (t2 - t1)

    @classmethod
    def row_bytes(cls, cfg, n, steps, hkv, d):
        """The KV cache and the hash tables in host memory, the tables hkv · L · (4 n + 4 (2^K + 1) + 2 n) (key ids
        sorted by code, bucket offsets, codes); on the GPU the static rows, 2 · hkv · d · 2 · (local + steps +
        sink)."""
        kv, _ = super().row_bytes(cfg, n, steps, hkv, d)
        tables = hkv * cfg["L"] * (4 * n + 4 * ((1 << cfg["K"]) + 1) + 2 * n)
        return 2 * hkv * d * 2 * (cfg.get("local", 64) + steps + cfg.get("sink", 4)), kv + tables

    @classmethod
    def from_method(cls, layer_idx: int, method: Any, opts: LayerOptions) -> "MagicPIGLayer":
        return cls(layer_idx, opts.capacity, method, backend_gpu=opts.backend_gpu, backend_cpu=opts.backend_cpu)
