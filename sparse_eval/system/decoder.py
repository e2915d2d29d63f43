"""The system decode path: a transformers model whose attention runs through the layers of ``system.layers``.

``attach(model, method)`` builds one cache layer per decoder layer (the method's dense layers get a
``FullLayer``) and routes the model's attention through them; ``decode`` prefills a prompt batch densely and
generates greedily, timing every step.  The model code is transformers' own (linear layers, norms, RoPE, on
the GPU); only the attention and the KV cache differ between methods.

Which method runs where:

| method | KV cache | per decode step |
|---|---|---|
| ``full`` | GPU | dense sdpa |
| ``double_sparsity`` | GPU (+ label cache) | label scores → top-k → sparse attention (Triton) |
| ``double_sparsity`` with ``offload: true`` | pinned CPU (+ label cache on GPU) | layer l's tokens predicted during layer l−1 and gathered over PCIe on a side stream |
| ``magicpig`` | CPU (+ hash tables) | codes on GPU; sampling + sampled attention on CPU (numba); sink/local on GPU; LSE merge |
| ``quest`` | GPU (+ page min/max) | page bounds → top pages → attention over their tokens + sink/local (Triton) |

With ``cuda_graph=True`` (every method) every decode step has static shapes (``layers.StaticStep``: device-side
position, row lengths and budgets), so one step is captured in a CUDA graph and replayed; eager steps are bound by
Python and kernel launches at these model sizes.  MagicPIG's step waits on the host in each sparse layer (its CPU
part), so it is captured in pieces cut there (``_Pieces``): one graph from each layer's CPU part to the next,
replayed in order with the CPU parts between them.  DS-Offload's
static step (the predicted rows gathered from pinned host memory on a side stream, the new token written there by
a kernel at the device-side position) has no host part and is captured whole.  ``interleave=2`` decodes the batch
as two independent halves whose pieces replay interleaved (``_replay_interleaved``), so that the GPU runs one
half's pieces while the host runs the other half's CPU parts.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kernels.offload as koff
from kernels.ds import TOPK_IMPLS

from ..attention.plugin import attention_modules, cache_kwargs
from ..methods.base import Method
from .layers import DSLayer, DSOffloadLayer, FullLayer, MagicPIGLayer, QuestLayer, StaticStep, rope_function

ATTENTION_NAME = "sparse_eval_system"
SYSTEM_METHODS = ("full", "double_sparsity", "magicpig", "quest")
_ATTR = "_sparse_eval_system"


class SystemCache(Cache):
    """transformers ``Cache`` over the system layers (one per decoder layer)."""

    def __init__(self, layers: list[FullLayer]):
        super().__init__(layers=layers)


def _system_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    session: SystemSession | None = getattr(module, _ATTR, None)
    if session is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    return session.attention(module, query, key, value, module.scaling if scaling is None else scaling)


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """The system layers need no mask: prefill is causal over the prompt alone, decode attends to every key.
    (Padding is not supported: ``decode`` takes equal-length prompts.)"""
    return None


AttentionInterface.register(ATTENTION_NAME, _system_attention)
AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)


def _layer_channels(method: Any, layer_idx: int, hq: int, hkv: int, d: int) -> torch.Tensor:
    """DS channels of one layer as [Hl, r]: per KV head when the method was given channels per KV head (one label
    row per KV head, as a GQA system stores them), else per query head (the accuracy path's layout)."""
    raw = method._channels
    r = max(1, int(float(method.config.alpha) * d + 1e-9))
    if raw is not None:
        ch = raw[layer_idx] if raw.dim() == 3 else raw
        if ch.shape[0] == hkv and hkv != hq:
            return ch[:, :r].long()
    ch, _ = method._layer_channels(layer_idx, hq, hkv, d, "cpu")
    return ch.long()


def build_layers(model: Any, method: Method, capacity: int, *, label_scale_dtype: torch.dtype | None = None,
                 backend_gpu: str = "auto", backend_cpu: str = "auto", topk: str = "radix") -> list[FullLayer]:
    """One cache layer per decoder layer for ``method`` (set up already: DS has its channels); ``topk`` the
    top-k of DS and Quest ("radix": ``kernels.topk`` on CUDA; "torch": ``torch.topk``)."""
    name = method.name
    if name not in SYSTEM_METHODS:
        raise ValueError(f"method {name!r} has no system path; valid: {list(SYSTEM_METHODS)} (double_sparsity with "
                         f"method.offload=true is DS-Offload)")
    cfg = model.config.get_text_config()
    n_layers, hq = cfg.num_hidden_layers, cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or hq
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // hq
    method.validate(num_layers=n_layers)
    dense = method.dense_layer_set(n_layers) if name != "full" else set(range(n_layers))
    on_cuda = next(model.parameters()).is_cuda
    if label_scale_dtype is None:
        label_scale_dtype = torch.float16 if on_cuda else torch.float32
    layers: list[FullLayer] = []
    for i in range(n_layers):
        if i in dense:
            layers.append(FullLayer(i, capacity, backend=backend_gpu))
        elif name == "double_sparsity":
            c = method.config
            if c.sink or c.local:
                raise ValueError(f"method.sink={c.sink}, method.local={c.local}: the DS system layers keep no static "
                                 f"keys (the paper's setting); set both to 0")
            cls = DSOffloadLayer if c.offload else DSLayer
            layers.append(cls(i, capacity, _layer_channels(method, i, hq, hkv, d), hq=hq, beta=c.beta, bits=c.label_bits,
                              quantize_query=c.quantize_query, gqa=c.gqa, scale_dtype=label_scale_dtype,
                              backend=backend_gpu, topk=topk))
        elif name == "quest":
            c = method.config
            if not c.update_pages:
                raise ValueError("method.update_pages=false (the MagicPIG repo's frozen pages) has no system path; "
                                 "valid: true (Quest's own incremental pages)")
            layers.append(QuestLayer(i, capacity, page_size=c.page_size, budget=c.budget, sink=c.sink, local=c.local,
                                     gqa=c.gqa, backend=backend_gpu, topk=topk))
        else:
            layers.append(MagicPIGLayer(i, capacity, method, backend_gpu=backend_gpu, backend_cpu=backend_cpu))
    return layers


class PhaseTimes:
    """Host wall time of named phases of the decode steps (``session.phase(name)`` brackets one), for breaking a
    step down.  Each bracket synchronises the GPU at both ends, so the phases are the work they enclose, and the
    steps run slower than untimed ones: timings for throughput come from runs without it."""

    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.ms: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def __call__(self, name: str):
        if self.cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        try:
            yield
        finally:
            if self.cuda:
                torch.cuda.synchronize()
            self.ms[name] += 1e3 * (time.perf_counter() - t)


def _no_phase(name: str) -> contextlib.nullcontext:
    return contextlib.nullcontext()


class SystemSession:
    """The layers of one generation, the side stream and buffers of DS-Offload, and per-run counters."""

    def __init__(self, model: Any, method: Method, layers: list[FullLayer], phase_times: PhaseTimes | None = None):
        self.phase = phase_times if phase_times is not None else _no_phase  # phase(name): a context manager
        self.model = model
        self.method = method
        self.cache = SystemCache(layers)
        self.layers = layers
        self.modules = {m.layer_idx: m for m in attention_modules(model)}
        # each layer's input of the current decode step (hidden states [B, 1, H], position embeddings), kept for
        # DS-Offload's prediction of the next layer's keys (``_predict``); other methods keep none
        self.inputs: dict[int, tuple] = {}
        self.pending: dict[int, dict] = {}
        self.stats: collections.Counter = collections.Counter()
        self._buffers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        offload = any(isinstance(x, DSOffloadLayer) for x in layers)
        self.keeps_inputs = offload
        cuda = next(model.parameters()).is_cuda
        self.side_stream = torch.cuda.Stream() if offload and cuda else None
        self.cuda = cuda
        self.pieces: _Pieces | None = None  # set while a static step is captured in pieces
        self.offload_input = getattr(method.config, "offload_input", "attn_input")
        self.norm_w = getattr(method, "_norm_w", {}) if offload else {}
        if offload and self.offload_input == "residual" and not self.norm_w:
            raise ValueError("DS-Offload with offload_input='residual' needs method.setup(model, ...) first (it finds "
                             "each layer's input norm)")

    # -- attention --------------------------------------------------------------------------------------
    def attention(self, module, q, k, v, scaling):
        i = module.layer_idx
        layer = self.layers[i]
        if q.shape[2] == 1 and i + 1 < len(self.layers) and isinstance(self.layers[i + 1], DSOffloadLayer):
            self._predict(i)  # issue layer i+1's gather first, so it overlaps this layer's work
        out = layer.attend(self, module, q, k, v, scaling)
        return out.transpose(1, 2).contiguous(), None

    def _predict(self, i: int) -> None:
        """Layer i+1's approximate query from layer i's input (DS-Offload §5.1, as ``DoubleSparsity`` predicts it in
        the accuracy path), then its top keys' gather."""
        got = self.inputs.get(i)
        attn = self.modules[i + 1]
        rope = rope_function(attn)
        if got is None or got[1] is None or rope is None:
            return  # the layer falls back to its own query
        h, (cos, sin) = got
        if self.offload_input == "residual":
            w = self.norm_w[i]
            h = h / torch.where(w == 0, torch.ones_like(w), w).to(h.dtype)
        b = h.shape[0]
        d = self.layers[i + 1].keys.shape[-1]
        qp = attn.q_proj(h[:, -1:]).view(b, 1, -1, d)
        if hasattr(attn, "q_norm"):
            qp = attn.q_norm(qp)
        qp = qp.transpose(1, 2)
        qp, _ = rope(qp, qp, cos[:, -1:], sin[:, -1:])
        self.pending[i + 1] = self.layers[i + 1].predict(self, qp[:, :, 0])

    def cut(self, host_part) -> None:
        """Where a static step waits on the host (MagicPIG's CPU part): the GPU work enqueued so far must have
        finished (its copies to the host landed), then ``host_part()`` runs, then the step goes on.  While the step
        is being captured in pieces, this ends the current piece there (``_Pieces.cut``)."""
        if self.pieces is not None:
            self.pieces.cut(host_part)
            return
        if self.cuda:
            torch.cuda.current_stream().synchronize()
        host_part()

    def buffer(self, layer_idx: int, shape: tuple[int, ...], dtype: torch.dtype, device) -> tuple:
        """Views [B, Hs, S, D] into one of two GPU buffers (layer parity picks it): layer l+1's gather fills
        one while layer l reads the other."""
        slot = layer_idx % 2
        buf = self._buffers.get(slot)
        layer = self.layers[layer_idx]
        if buf is None or buf[0].shape[0] < shape[0] or buf[0].shape[1] < shape[1] or buf[0].shape[2] < shape[2] \
                or buf[0].dtype != dtype:
            full = (shape[0], shape[1], max(shape[2], layer.budget(layer.capacity) + 1), shape[3])
            if buf is not None and self.side_stream is not None:
                torch.cuda.current_stream(device).wait_stream(self.side_stream)
            buf = (torch.empty(full, dtype=dtype, device=device), torch.empty(full, dtype=dtype, device=device))
            self._buffers[slot] = buf
        return buf[0][: shape[0], : shape[1], : shape[2]], buf[1][: shape[0], : shape[1], : shape[2]]

    def nbytes(self) -> dict[str, int]:
        tot = {"gpu": 0, "cpu": 0}
        for layer in self.layers:
            for key, val in layer.nbytes().items():
                tot[key] += val
        for a, b in self._buffers.values():
            tot["gpu"] += 2 * a.numel() * a.element_size()
        return tot


def _grab_inputs(module, args, kwargs):
    """Keep a layer's input for DS-Offload's prediction: decode steps only.  The prefill's would pin [B, T, H]
    hidden states of every layer (26 GB at 96K for Llama-3.1-8B) until the first decode step replaced them, and a
    captured decode tiles its caches before that step."""
    session = getattr(module, _ATTR, None)
    if session is None or not session.keeps_inputs:
        return
    h = kwargs.get("hidden_states")
    if h is not None and h.shape[1] == 1:
        session.inputs[module.layer_idx] = (h, kwargs.get("position_embeddings"))


def use(model: Any, session: SystemSession) -> None:
    """Point the attached model's attention modules at ``session`` (one of several decoding the same model)."""
    for m in session.modules.values():
        setattr(m, _ATTR, session)


def attach(model: Any, session: SystemSession) -> None:
    detach(model)
    for m in session.modules.values():
        setattr(m, _ATTR, session)
        m._sparse_eval_system_hook = m.register_forward_pre_hook(_grab_inputs, with_kwargs=True)
    model._sparse_eval_system_prev = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)


def detach(model: Any) -> None:
    for m in model.modules():
        hook = getattr(m, "_sparse_eval_system_hook", None)
        if hook is not None:
            hook.remove()
            del m._sparse_eval_system_hook
        if hasattr(m, _ATTR):
            delattr(m, _ATTR)
    prev = getattr(model, "_sparse_eval_system_prev", None)
    if prev is not None:
        model.set_attn_implementation(prev)
        del model._sparse_eval_system_prev


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # long [B, new]
    prefill_ms: float
    step_ms: list[float]  # one per decode step (the forward that turns token t into logits of t+1)
    batch: int
    context: int
    stats: dict[str, Any] = field(default_factory=dict)  # counters; graph_capture_ms
    memory: dict[str, int] = field(default_factory=dict)  # bytes: gpu_peak, cache_gpu, cache_cpu


class _Timer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.marks.append(e)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [1e3 * (b - a) for a, b in zip(self.marks, self.marks[1:])]


def _memory(sessions: list[SystemSession], dev: torch.device) -> dict[str, int]:
    """Bytes of the sessions' caches on the GPU and in CPU memory, and the GPU's peak allocation of the run."""
    mems = [session.nbytes() for session in sessions]
    out = {"cache_gpu": sum(m["gpu"] for m in mems), "cache_cpu": sum(m["cpu"] for m in mems)}
    if dev.type == "cuda":
        out["gpu_peak"] = int(torch.cuda.max_memory_allocated(dev))
    return out


class _Pieces:
    """A decode step captured as a chain of CUDA graphs cut where it waits on the host.

    ``begin``, then the step's Python code runs as usual: its GPU work is recorded into the current piece until a
    layer calls ``SystemSession.cut(host_part)``; ``cut`` ends that piece, replays it at once (so the step's data
    exist), waits for it, runs ``host_part`` and begins the next piece; ``end`` closes the last one.  The capturing
    step therefore also decodes one token.  ``replay`` runs a later step: each piece, then (after its copies to the
    host have landed) its host part.  All pieces share one memory pool and always replay in capture order, so a
    tensor that one piece makes and the next reads keeps its address."""

    def __init__(self):
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.hosts: list[Any] = []
        self._g: torch.cuda.CUDAGraph | None = None
        # host seconds over the replays: waiting for a piece to finish, and running the host parts
        self.wait_s = self.host_s = 0.0

    def begin(self) -> None:
        self._g = torch.cuda.CUDAGraph()
        self._g.capture_begin(pool=self.pool)

    def cut(self, host_part) -> None:
        self._close(host_part)
        torch.cuda.current_stream().synchronize()
        host_part()
        self.begin()

    def end(self) -> None:
        self._close(None)

    def abort(self) -> None:
        """Leave capture mode after an error inside a piece (the stream would refuse all later work)."""
        g, self._g = self._g, None
        if g is not None:
            try:
                g.capture_end()
            except RuntimeError:  # the capture was invalidated by the error itself
                pass

    def _close(self, host_part) -> None:
        g, self._g = self._g, None
        g.capture_end()
        self.graphs.append(g)
        self.hosts.append(host_part)
        g.replay()

    def replay(self) -> None:
        stream = torch.cuda.current_stream()
        for g, host_part in zip(self.graphs, self.hosts):
            g.replay()
            if host_part is not None:
                self._host(stream.synchronize, host_part)

    def _host(self, wait, host_part) -> None:
        t0 = time.perf_counter()
        wait()
        t1 = time.perf_counter()
        host_part()
        self.wait_s += t1 - t0
        self.host_s += time.perf_counter() - t1


def _replay_interleaved(chains: list[_Pieces]) -> None:
    """One step of several independent decodes (disjoint rows, each captured in pieces), interleaved so that the
    GPU runs one chain's piece while the host runs another's host part.  Chain c's piece i + 1 is enqueued as soon
    as its host part i has run, and that host part waits only for its own piece i (an event recorded after it), so
    with two chains A and B the GPU runs A0 B0 A1 B1 ... while the host runs A's part i during B's piece i and B's
    part i during A's piece i + 1.  Every chain has the same number of pieces (same model and method)."""
    n = len(chains[0].graphs)
    if any(len(c.graphs) != n for c in chains):
        raise ValueError(f"interleaved chains have {[len(c.graphs) for c in chains]} pieces: must be equal")
    stream = torch.cuda.current_stream()
    done = []
    for c in chains:
        c.graphs[0].replay()
        done.append(stream.record_event())
    for i in range(n - 1):
        for k, c in enumerate(chains):
            c._host(done[k].synchronize, c.hosts[i])
            c.graphs[i + 1].replay()
            done[k] = stream.record_event()


class _StaticRun:
    """The static-shape decode steps (``layers.StaticStep``) of one session: ``warm`` runs the first step eagerly (on
    CUDA on a side stream, as graph capture wants: Triton compiles there), ``capture`` records the next one (a whole
    CUDA graph, not run; or, for a step with host parts such as MagicPIG's, ``_Pieces``, which also decodes),
    ``replay`` runs a later one.  On the CPU every step runs the same static code eagerly.  ``out`` holds the tokens
    [B, 1] of the steps run; ``close`` hands the layers back to eager decoding."""

    def __init__(self, model: Any, session: SystemSession, kw: dict[str, Any], nxt: torch.Tensor, cuda: bool):
        self.model, self.session, self.cuda = model, session, cuda
        self.st = StaticStep(session.layers[0].n, nxt.shape[0], nxt.device)
        for layer in session.layers:
            layer.static = self.st
        self.ids = nxt.clone()  # [B, 1] static input of every step
        self.fkw = dict(kw, position_ids=self.st.pos.view(1, 1), use_cache=True, logits_to_keep=1)
        if "cache_position" in inspect.signature(model.forward).parameters:  # transformers < 5.24
            self.fkw["cache_position"] = self.st.pos
        self.out: list[torch.Tensor] = []
        self.pieces: _Pieces | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.in_pieces = cuda and any(getattr(layer, "cuts_step", False) for layer in session.layers)

    def step(self) -> None:
        use(self.model, self.session)  # the attention modules decode with this session's layers
        logits = self.model(input_ids=self.ids, **self.fkw).logits[:, -1]
        self.ids.copy_(logits.argmax(-1, keepdim=True))
        self.st.advance()

    def warm(self) -> None:
        if self.cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                self.step()
            torch.cuda.current_stream().wait_stream(side)
        else:
            self.step()
        self.out.append(self.ids.clone())

    def capture(self) -> dict[str, float]:
        """Capture the next step (CUDA only); returns ``graph_capture_ms`` (and ``graph_pieces``).  In pieces, the
        capturing step decodes a token (in ``out``); a whole graph is recorded without running."""
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if self.in_pieces:
            pieces = _Pieces()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            self.session.pieces = pieces
            try:
                with torch.cuda.stream(side):
                    pieces.begin()
                    self.step()  # recorded piece by piece, each piece run once right after its capture
                    pieces.end()
            except BaseException:
                pieces.abort()
                raise
            finally:
                self.session.pieces = None
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            self.pieces = pieces
            self.out.append(self.ids.clone())
            return {"graph_capture_ms": 1e3 * (time.perf_counter() - t0), "graph_pieces": len(pieces.graphs)}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()  # recorded, not run
        torch.cuda.synchronize()
        return {"graph_capture_ms": 1e3 * (time.perf_counter() - t0)}

    def replay(self) -> None:
        if self.pieces is not None:
            self.pieces.replay()
        elif self.graph is not None:
            self.graph.replay()
        else:
            self.step()
        self.out.append(self.ids.clone())

    def close(self) -> None:
        for layer in self.session.layers:
            layer.static = None
            layer.n += len(self.out)


def _decode_static(runs: list[_StaticRun], steps: int, cuda: bool) -> tuple[list[float], dict[str, float]]:
    """``steps`` greedy decode steps of every run (each its own rows): the first eager, the second captured (in
    pieces it also decodes: its time, capture included, is that step's), the rest replayed.  Two runs whose steps
    are in pieces replay interleaved (``_replay_interleaved``); otherwise the runs replay one after the other.
    Returns (ms per step, all runs together; extra timings: ``graph_capture_ms`` summed over the runs,
    ``graph_pieces`` of one run's step, and for steps in pieces the host's ms per replayed step spent waiting for
    the pieces (``host_wait_ms_per_step``) and in the host parts (``host_part_ms_per_step``))."""
    if steps < 1:
        return [], {}
    extra: dict[str, float] = {}
    timer = _Timer(cuda)
    timer.mark()
    for run in runs:
        run.warm()
    timer.mark()
    ms = timer.intervals_ms()
    left = steps - 1
    if left and cuda:
        for run in runs:
            got = run.capture()
            extra["graph_capture_ms"] = extra.get("graph_capture_ms", 0.0) + got["graph_capture_ms"]
            if "graph_pieces" in got:
                extra["graph_pieces"] = got["graph_pieces"]
        if all(run.pieces is not None for run in runs):  # the capturing step decoded: timed with its capture
            ms.append(extra["graph_capture_ms"])
            left -= 1
    interleaved = len(runs) == 2 and all(run.pieces is not None for run in runs)
    timer = _Timer(cuda)
    timer.mark()
    for _ in range(left):
        if interleaved:
            _replay_interleaved([run.pieces for run in runs])
            for run in runs:
                run.out.append(run.ids.clone())
        else:
            for run in runs:
                run.replay()
        timer.mark()
    ms += timer.intervals_ms()
    chains = [run.pieces for run in runs if run.pieces is not None]
    if chains and left:  # where the host's time went in the replayed steps: waiting for the GPU, or host parts
        extra["host_wait_ms_per_step"] = 1e3 * sum(c.wait_s for c in chains) / left
        extra["host_part_ms_per_step"] = 1e3 * sum(c.host_s for c in chains) / left
    return ms, extra


def _halves(input_ids: torch.Tensor, repeat_batch: int, interleave: int) -> list[tuple[torch.Tensor, int]]:
    """The rows of each interleaved decode, as (prompts, repeat_batch): the prompts split in two, or, for one prompt
    tiled (a throughput run), the tiling split in two."""
    if interleave == 1:
        return [(input_ids, repeat_batch)]
    b = input_ids.shape[0]
    if b >= 2 and repeat_batch == 1:
        return [(input_ids[: b // 2], 1), (input_ids[b // 2:], 1)]
    if b == 1 and repeat_batch >= 2:
        return [(input_ids, repeat_batch // 2), (input_ids, repeat_batch - repeat_batch // 2)]
    raise ValueError(f"interleave=2 splits the rows in two: it needs batch >= 2 with repeat_batch = 1, or batch 1 "
                     f"with repeat_batch >= 2; got batch {b}, repeat_batch {repeat_batch}")


@torch.inference_mode()
def decode(model: Any, method: Method, input_ids: torch.Tensor, max_new_tokens: int, *, repeat_batch: int = 1,
           cuda_graph: bool = False, label_scale_dtype: torch.dtype | None = None, backend_gpu: str = "auto",
           backend_cpu: str = "auto", topk: str = "radix", phase_times: bool = False,
           interleave: int = 1) -> DecodeResult:
    """Prefill ``input_ids`` [B, T] (equal lengths, no padding) densely, then ``max_new_tokens`` greedy steps with
    ``method`` (no stop token: every row decodes the same number of steps, as a throughput run does).
    ``repeat_batch`` tiles the cache over the batch (B·repeat rows) after the first decode step (the prefill
    and that step, which builds MagicPIG's tables, run at batch B; the step's time is in ``step_ms[0]``).  ``method`` must
    be set up for the model (``method.setup(model, name)``) where it needs it (Double Sparsity).

    ``cuda_graph``: decode with static shapes (preallocated capacity, device-side positions and budgets; see
    ``_StaticRun``), captured once in a CUDA graph on the GPU (MagicPIG in pieces around its CPU parts, after
    one eager step that builds its tables).  The cache is then tiled right after the prefill (MagicPIG: after that
    step), and ``stats["graph_capture_ms"]`` holds the capture time.
    ``interleave``: 2 splits the rows into two independent decodes (``_halves``: two sessions, each with its own
    caches, prefill and capture) whose steps run interleaved (``_replay_interleaved``): with a step in pieces
    (MagicPIG) the GPU runs one half's pieces while the host runs the other half's CPU parts.  Needs
    ``cuda_graph``; the tokens are those of the rows decoded alone.  ``prefill_ms`` and the first step's time are
    the two halves' summed.
    ``topk``: see ``build_layers``.
    ``phase_times``: time the phases the layers bracket (``PhaseTimes``; MagicPIG's GPU part, codes to the host,
    CPU sampling, CPU attention, merge) over the steps after the first; ``stats["phase_ms"]`` holds their totals
    and ``stats["phase_steps"]`` the number of steps.  The steps synchronise at every bracket: use it for
    breakdowns, not for throughput.  Eager steps only."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids: expected [B, T], got shape {tuple(input_ids.shape)}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: must be >= 1")
    if topk not in TOPK_IMPLS:
        raise ValueError(f"topk={topk!r}: valid values are {list(TOPK_IMPLS)}")
    if interleave not in (1, 2):
        raise ValueError(f"interleave={interleave!r}: valid values are 1 (one decode) and 2 (two halves interleaved)")
    if interleave == 2 and not cuda_graph:
        raise ValueError("interleave=2 interleaves the captured steps of two halves of the batch: it needs "
                         "cuda_graph=true")
    if cuda_graph and phase_times:
        raise ValueError("phase_times=true times eager steps; a captured step (cuda_graph=true) has no host-side "
                         "phases. Valid: one of them")
    halves = _halves(input_ids, repeat_batch, interleave)
    dev = next(model.parameters()).device
    cuda = dev.type == "cuda"
    b, t = input_ids.shape
    phases = PhaseTimes(cuda) if phase_times else None
    sessions: list[SystemSession] = []
    runs: list[_StaticRun] = []
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)

    def open_session(phase_times: PhaseTimes | None = None) -> tuple[SystemSession, dict[str, Any]]:
        """A session with its own layers, attached to the model; and the model's cache arguments for it."""
        session = SystemSession(model, method, build_layers(
            model, method, t + max_new_tokens, label_scale_dtype=label_scale_dtype, backend_gpu=backend_gpu,
            backend_cpu=backend_cpu, topk=topk), phase_times)
        sessions.append(session)
        attach(model, session)
        return session, cache_kwargs(model, session.cache)

    try:
        if cuda_graph:
            prefill_ms, first_ms, firsts = 0.0, [], []
            for ids_h, rep_h in halves:
                session, kw = open_session()
                got_ms, first, nxt = _prefill_for_static(model, session, kw, ids_h.to(dev), rep_h, max_new_tokens,
                                                         cuda)
                prefill_ms += got_ms[0]
                first_ms = [a + c for a, c in zip(first_ms, got_ms[1:])] if first_ms else got_ms[1:]
                firsts.append(first)
                runs.append(_StaticRun(model, session, kw, nxt, cuda))
            steps, extra = _decode_static(runs, max_new_tokens - len(firsts[0]), cuda)
            tokens = torch.cat([torch.cat([*first, *run.out], 1) for first, run in zip(firsts, runs)], 0)
            stats = collections.Counter()
            for session in sessions:
                stats.update(session.stats)
            return DecodeResult(tokens=tokens.cpu(), prefill_ms=prefill_ms, step_ms=first_ms + steps,
                                batch=b * repeat_batch, context=t, stats=dict(stats, **extra),
                                memory=_memory(sessions, dev))
        session, kw = open_session(phases)
        timer = _Timer(cuda)
        timer.mark()
        logits = model(input_ids=input_ids.to(dev), use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
        timer.mark()
        prefill_ms = timer.intervals_ms()[0]
        nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
        out = [nxt]
        timer = _Timer(cuda)
        timer.mark()
        for step in range(max_new_tokens - 1):
            logits = model(input_ids=nxt, use_cache=True, **kw).logits[:, -1]
            nxt = logits.argmax(-1, keepdim=True)
            out.append(nxt)
            if step == 0 and repeat_batch > 1:
                # tile after the first step, so that per-row index builds (MagicPIG's tables) run once
                out = _tile_rows(session, out, repeat_batch)
                nxt = out[-1]
            if step == 0 and phases is not None:  # the first step builds MagicPIG's tables: not a steady step
                phases.ms.clear()
            timer.mark()
        steps = timer.intervals_ms()
        if phases is not None:
            session.stats["phase_ms"] = dict(phases.ms)
            session.stats["phase_steps"] = max(0, max_new_tokens - 2)
        return DecodeResult(tokens=torch.cat(out, 1).cpu(), prefill_ms=prefill_ms, step_ms=steps,
                            batch=b * repeat_batch, context=t, stats=dict(session.stats),
                            memory=_memory(sessions, dev))
    finally:
        for run in runs:
            run.close()
        detach(model)
        for session in sessions:
            session.layers.clear()
            session.pending.clear()
            session.inputs.clear()
        koff.unpin_all()


def _prefill_for_static(model: Any, session: SystemSession, kw: dict[str, Any], input_ids: torch.Tensor,
                        repeat_batch: int, max_new_tokens: int, cuda: bool
                        ) -> tuple[list[float], list[torch.Tensor], torch.Tensor]:
    """The prefill of one static decode, then (for layers that build at their first step: MagicPIG's tables) one
    eager step at batch B, then the tiling.  Returns (ms of the prefill and of that step, the tokens so far [B', 1]
    each, the next input [B', 1])."""
    timer = _Timer(cuda)
    timer.mark()
    logits = model(input_ids=input_ids, use_cache=True, logits_to_keep=1, **kw).logits[:, -1]
    timer.mark()
    nxt = logits.argmax(-1, keepdim=True)  # [B, 1]
    first = [nxt]
    if max_new_tokens > 1 and any(getattr(layer, "builds_at_first_step", False) for layer in session.layers):
        nxt = model(input_ids=nxt, use_cache=True, **kw).logits[:, -1].argmax(-1, keepdim=True)
        timer.mark()
        first.append(nxt)
    ms = timer.intervals_ms()
    if repeat_batch > 1:
        if cuda:  # the prefill's activations are freed: hand their blocks back before the tiled cache
            torch.cuda.empty_cache()
        first = _tile_rows(session, first, repeat_batch)
        nxt = first[-1]
    return ms, first, nxt


def _tile_rows(session: SystemSession, tokens: list[torch.Tensor], times: int) -> list[torch.Tensor]:
    """Tile every layer's cache ``times`` over the batch (``FullLayer.repeat_batch``) and the tokens so far with
    it."""
    for layer in session.layers:
        layer.repeat_batch(times)
    return [x.repeat(times, 1) for x in tokens]
