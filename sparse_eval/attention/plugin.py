"""Attaching a method to a transformers model: AttentionInterface + mask function + a per-layer method state.

* One attention function, registered by ``register()`` as ``"sparse_eval"`` in transformers' ``AttentionInterface``,
  together with transformers' own ``sdpa_mask`` under the same name, so padding always arrives as a mask
  (``models.loading.load_model`` calls it before the model is built, ``attach`` before it switches a model to it).
* ``attach(model, method, ...)`` stores a ``SparseSession`` on each attention module (an instance attribute,
  no class is patched) and a forward pre-hook that hands the module the cache object of the current call.
* The method's index (hash codes, page bounds, label cache) lives in the cache layer: ``SparseCache`` builds
  ``SparseLayer``s that own a ``method_state`` (``CacheTrackedState``) and drop it whenever their keys change
  other than by appending (reset, crop, reordering, batch selection).  Any other cache (e.g. the ``DynamicCache``
  that ``generate`` makes by itself) gets a plain dict attached, and the methods then check their index against
  the keys on the device.

Which calls are sparse (the evaluation protocol, recorded with every result):
  A: the prompt is prefilled densely, sparsity starts at the first generated token (q_len == 1);
  B: the context is prefilled densely and the question and the generation are sparse (the engine marks the
     context phase with ``session.phase("dense")`` and the rest with ``session.phase("sparse")``);
  S: every query position attends sparsely, prefill included.
Each sparse call says whether its rows are generated tokens after a finished prompt (``AttentionContext.generating``:
protocol A's sparse calls, and the engine's decode steps, which it runs inside ``session.generation()``).
Layers in ``method.dense_layers`` are always dense, and so are the layers that attend within a sliding window of
their own (``models.inspection.sliding_layers``) unless ``method.sliding_layers="sparse"`` (``layer_plan``).  A
sliding layer keeps its window either way: transformers' mask brings it, and the sparse path selects only among the
keys it allows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from .. import invariance
from ..kernels import invariant as kinv
from ..methods.base import CacheTrackedState, Method
from ..methods.core import (
    PassMasks,
    dense_attention,
    fused_attention_used,
    key_validity,
    pass_masks,
    sparse_attention,
    static_keys,
)
from ..models.inspection import attention_modules, head_shape, sliding_layers
from ..spans import span
from .recorder import StatsRecorder

ATTENTION_NAME = "sparse_eval"
PROTOCOLS = ("A", "B", "S")
_SESSION_ATTR = "_sparse_eval_session"
_CACHE_ATTR = "_sparse_eval_cache"
_STATE_ATTR = "method_state"


@dataclass
class Runtime:
    """Settings of a session that are not the method's own (all recorded with results)."""

    protocol: str = "A"
    compute_error: bool = True
    query_chunk: int = 512  # query rows per block in the sparse path (memory bound, not a result-changing knob)
    # the engine runs each batch inside ``invariance.batch_invariant()``: a sample's record is bit for bit the one
    # it gets alone or in any other batch (fixed-order kernels; dense attention by ``core.dense_attention``)
    batch_invariant: bool = True
    # ``eval.fused_attention``: auto | on | off.  The sparse calls' attention and statistics from one Triton kernel
    # (``kernels.selected_attention``) where ``core.fused_attention_used`` says so for the layer's device and dtype
    # (auto: on CUDA for a method that declares ``Method.fused_attention``; off on the CPU); off by default until
    # checked on a GPU (``config.EvalConfig.fused_attention``)
    fused_attention: str = "off"


_GROW_TOKENS = 256  # spare tokens a SparseLayer's K/V buffers get when they are (re)allocated


class SparseLayer(DynamicLayer):
    """A dynamic cache layer that also owns the method's per-layer index, ``method_state``
    (a ``CacheTrackedState``): any change of the keys other than ``update``'s append (crop, reset, beam reordering,
    batch selection or repetition, in whichever transformers version makes them) replaces ``self.keys`` and with
    it drops the state, so an index found in it covers keys that are still the cache's first ones."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.__dict__["_appending"] = False
        self.method_state: dict[str, Any] = CacheTrackedState()
        super().__init__(*args, **kwargs)

    @property
    def keys(self) -> Any:
        return self.__dict__.get("_keys")

    @keys.setter
    def keys(self, value: Any) -> None:
        self.__dict__["_keys"] = value
        if not self.__dict__.get("_appending", False):
            self.method_state = CacheTrackedState()  # the index covered keys that are gone: rebuild on the next call

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        """Appends ``key_states`` / ``value_states`` [B, H, q, D] and returns the keys and values so far, as views
        [B, H, n, D] of buffers with room to grow: a step writes its q tokens in place instead of copying the whole
        cache (``DynamicLayer``'s ``torch.cat``, which copies every layer's K and V every step).  The views hold the
        same values a concatenation would.  A crop keeps the buffers (the next append writes over the removed
        positions, as in a static cache, so a tensor returned before the crop may see them change); reordering or
        selecting rows leaves tensors the buffers no longer back, and the next append copies them into new ones."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.__dict__["_appending"] = True
        try:
            self._append(key_states, value_states)
        finally:
            self.__dict__["_appending"] = False
        return self.keys, self.values

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        d = self.__dict__
        kb, vb = d.get("_kbuf"), d.get("_vbuf")
        old_k, old_v = self.keys, self.values
        n0 = old_k.shape[-2] if old_k is not None and old_k.dim() == 4 else 0
        n1 = n0 + k.shape[-2]
        backed = (  # the cache so far is a prefix of the buffers (after appends, or a crop of them)
            kb is not None
            and old_k is not None
            and old_v is not None
            and old_k.data_ptr() == kb.data_ptr()
            and old_v.data_ptr() == vb.data_ptr()
            and old_k.stride() == kb.stride()
            and old_v.stride() == vb.stride()
            and kb.shape[:2] == k.shape[:2]
            and kb.shape[3] == k.shape[3]
            and vb.shape[3] == v.shape[3]
            and kb.dtype == k.dtype
            and vb.dtype == v.dtype
            and kb.device == k.device
        )
        if not backed or n1 > kb.shape[2]:
            cap = n1 + max(_GROW_TOKENS, k.shape[-2])  # room for the next steps (or the next chunk of a prefill)
            nkb = k.new_empty(k.shape[0], k.shape[1], cap, k.shape[3])
            nvb = v.new_empty(v.shape[0], v.shape[1], cap, v.shape[3])
            if n0:
                nkb[:, :, :n0] = old_k
                nvb[:, :, :n0] = old_v
            kb, vb = d["_kbuf"], d["_vbuf"] = nkb, nvb
        kb[:, :, n0:n1] = k
        vb[:, :, n0:n1] = v
        self.keys, self.values = kb[:, :, :n1], vb[:, :, :n1]

    def reset(self) -> None:
        super().reset()
        self.method_state = CacheTrackedState()
        for name in ("_kbuf", "_vbuf"):
            self.__dict__.pop(name, None)


class SparseCache(Cache):
    """A cache of ``SparseLayer``s, one per decoder layer."""

    def __init__(self, num_layers: int):
        super().__init__(layers=[SparseLayer() for _ in range(num_layers)])


def make_cache(model: torch.nn.Module) -> SparseCache:
    return SparseCache(model.config.get_text_config().num_hidden_layers)


def cache_kwargs(model: torch.nn.Module, cache: Any) -> dict[str, Any]:
    """The forward keyword that takes a cache: ``cache`` from transformers 5.24, ``past_key_values`` before
    (an unknown keyword would be swallowed by ``**kwargs`` and the model would silently make its own cache)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _layer_state(cache: Any, layer_idx: int) -> dict[str, Any]:
    if cache is None or not hasattr(cache, "layers") or layer_idx >= len(cache.layers):
        return {}  # no cache: every call indexes from scratch (teacher-forced perplexity)
    layer = cache.layers[layer_idx]
    state = getattr(layer, _STATE_ATTR, None)
    if state is None:
        state = {}
        setattr(layer, _STATE_ATTR, state)
    return state


def layer_plan(method: Method, num_layers: int, sliding: dict[int, int] | list[int]) -> tuple[set[int], list[int]]:
    """(the layers ``method`` leaves dense, those of them dense only because they slide) in a model of
    ``num_layers`` layers whose sliding layers are ``sliding`` (``sliding_layers``).  The dense layers are
    ``method.dense_layers`` resolved, plus, with ``method.sliding_layers="dense"``, every sliding layer.  Raises
    ValueError for a sparse method that would be left with no sparse layer because of its sliding layers."""
    dense = method.dense_layer_set(num_layers, sliding)
    slide_dense = sorted(set(sliding) - dense) if method.config.sliding_layers == "dense" else []
    both = dense | set(slide_dense)
    if not method.dense and slide_dense and len(both) >= num_layers:
        raise ValueError(
            f"method {method.name!r} would run in no layer: layers {sorted(dense)} are method.dense_layers and "
            f"{slide_dense} attend within a sliding window (method.sliding_layers='dense'); set "
            f"method.sliding_layers=sparse to run the method in the sliding layers too, within their window"
        )
    return both, slide_dense


def check_sparse_layers(
    method: Any, num_layers: int, dense: set[int] | Sequence[int], model_name: str = "the model"
) -> None:
    """Refuses a sparse method whose dense layers (``method.dense_layers`` resolved, plus sliding layers left
    dense) cover every layer of the model: it would run in no layer and report full attention's results as its
    own, with no Cost1, Cost2 or estimation error."""
    if method.dense or len(set(dense)) < num_layers:
        return
    listed = method.config.dense_layers
    raise ValueError(
        f"method.dense_layers={list(listed)} leaves no sparse layer: all {num_layers} layers of {model_name} would run "
        f"dense, so method={method.name} would compute full attention; leave at least one layer out (e.g. "
        f"method.dense_layers=[0,1]), or use method=full"
    )


class SparseSession:
    """A method attached to one model, with its protocol and the statistics of the calls it served."""

    def __init__(
        self, method: Method, runtime: Runtime, num_layers: int, num_heads: int, sliding: dict[int, int] | None = None
    ):
        if runtime.protocol not in PROTOCOLS:
            raise ValueError(f"protocol={runtime.protocol!r}; valid: {list(PROTOCOLS)}")
        method.validate(num_layers=num_layers)
        self.method = method
        self.runtime = runtime
        self.num_layers = num_layers
        # the layers always dense: method.dense_layers and, with sliding_layers="dense", the sliding layers
        self.dense_layers, self.sliding_dense_layers = layer_plan(method, num_layers, sliding or {})
        self.recorder = StatsRecorder(num_layers, num_heads)
        self._phase: str | torch.Tensor | None = None
        self._counted: torch.Tensor | None = None  # bool [B, Q] of the current pass: query rows whose stats count
        self._fused_memo: dict[tuple, bool] = {}  # ``fused``: per (device, dtype)
        self._generating = False  # inside ``generation()``: the passes are decode steps after a finished prompt
        self.row_seeds: torch.Tensor | None = None  # long [B]: each row's seed (its sample id), for sampling methods
        self.row_starts: torch.Tensor | None = None  # long [B]: each row's first column (left padding), from the engine
        self.layer_inputs: dict[int, tuple] = {}  # per layer: (hidden_states, position_embeddings) of the last call
        self._mask_memo: tuple | None = None  # (attention mask, shapes, PassMasks) of the last call
        self._full_memo: dict[tuple, tuple] = {}  # full attention's recorded sums of the current pass (``_full_sums``)
        # (id, device) -> (tensor, its copy there): the engine's per-batch tensors on the devices of a model placed over
        # several (``model.device_map``; ``_on``)
        self._moved: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    # -- protocol ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase(self, name: str | torch.Tensor | None) -> Iterator[None]:
        """Force the calls inside to be ``"dense"`` or ``"sparse"`` (protocol B's context/question split), or,
        with a bool tensor [B, Q] over the pass's query rows, sparse where True and dense elsewhere (a padded
        batch whose rows' contexts end at different columns)."""
        if not torch.is_tensor(name) and name not in (None, "dense", "sparse"):
            raise ValueError(f"phase={name!r}; valid: None, 'dense', 'sparse' or a bool tensor [B, Q]")
        old, self._phase = self._phase, name
        try:
            yield
        finally:
            self._phase = old

    @contextlib.contextmanager
    def counting(self, rows: torch.Tensor | None) -> Iterator[None]:
        """Record statistics only for the query rows where ``rows`` (bool [B, Q] of the passes inside) is True:
        a batch's padding, a row's dense context and the rows that stopped generating are not counted."""
        old, self._counted = self._counted, rows
        try:
            yield
        finally:
            self._counted = old

    @contextlib.contextmanager
    def generation(self) -> Iterator[None]:
        """The passes inside are generated tokens that extend a finished prompt (the engine's decode steps), which
        a method reads as ``AttentionContext.generating``; under protocol A every sparse call is one anyway."""
        old, self._generating = self._generating, True
        try:
            yield
        finally:
            self._generating = old

    def generating(self) -> bool:
        """Whether the current pass's sparse rows are generated tokens (``generation()``, or protocol A, whose
        sparse calls are exactly its decode steps)."""
        return self._generating or self.runtime.protocol == "A"

    def _on(self, t: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
        """``t`` (a tensor the engine made on its device for the whole batch: row seeds and starts, the counted rows,
        a per-row phase) on ``device``, a layer's own: ``t`` itself on one device; for a model placed over several
        (``model.device_map``) a copy made once per tensor and device (the memo holds ``t``, so an identity match
        cannot be a later tensor that reuses a freed one's id), so that every layer's work stays on its device."""
        if t is None or t.device == device:
            return t
        key = (id(t), str(device))
        hit = self._moved.get(key)
        if hit is not None and hit[0] is t:
            return hit[1]
        if len(self._moved) >= 32:
            self._moved.clear()
        moved = t.to(device)
        self._moved[key] = (t, moved)
        return moved

    def _count_mask(
        self, b: int, q_len: int, sparse_rows: torch.Tensor | None, device: torch.device | None = None
    ) -> torch.Tensor | None:
        """bool [B, 1, Q] of the rows to record (None: all), on ``device`` (None: where the engine made it)."""
        w = self._counted if device is None else self._on(self._counted, device)
        if w is not None and tuple(w.shape) != (b, q_len):
            raise ValueError(f"counting mask {tuple(w.shape)} does not match the pass's query rows {(b, q_len)}")
        if sparse_rows is not None:
            w = sparse_rows if w is None else w & sparse_rows
        return None if w is None else w[:, None, :]

    def is_sparse(self, layer_idx: int, q_len: int) -> bool | torch.Tensor:
        """True, False, or bool [B, Q] (a per-row phase)."""
        if layer_idx in self.dense_layers:
            return False
        if self._phase is not None:
            return self._phase if torch.is_tensor(self._phase) else self._phase == "sparse"
        if self.runtime.protocol == "S":
            return True
        return q_len == 1  # A (and B without an explicit context/question split)

    # -- the attention call -----------------------------------------------------------------------
    def _masks(self, attention_mask, b: int, q_len: int, kv_len: int, device) -> PassMasks | None:
        """``pass_masks`` of ``key_validity``, computed once per forward pass: the layers of one pass get the same
        mask object and shapes.  The memo holds the mask itself, so the identity test cannot match a later mask
        that reuses a freed one's id.  Only for passes of at most ``query_chunk`` rows (decoding): a long
        prefill's [B, 1, Q, N] masks are made per block of rows by the core instead."""
        c = self.method.config
        if q_len > self.runtime.query_chunk:
            return None
        key = (b, q_len, kv_len, str(device), c.sink, c.local)
        memo = self._mask_memo
        if memo is not None and memo[0] is attention_mask and memo[1] == key:
            return memo[2]
        masks = pass_masks(key_validity(attention_mask, b, q_len, kv_len, device), c.sink, c.local)
        self._mask_memo = (attention_mask, key, masks)
        return masks

    def _full_sums(
        self,
        attention_mask,
        b: int,
        hq: int,
        q_len: int,
        kv_len: int,
        key_bytes: int,
        per_row: torch.Tensor | None,
        device,
    ) -> tuple[tuple[str, ...], torch.Tensor]:
        """``StatsRecorder.full_sums`` of a full-attention call, computed once per forward pass: they depend only on
        the pass's mask, counted rows, phase and shapes, so the layers of one pass reuse them (a layer with a
        mask of its own, e.g. a sliding window, gets its own entry).  The memo holds the objects it tests by
        identity, so a later tensor that reuses a freed one's id cannot match."""
        c = self.method.config
        shapes = (b, hq, q_len, kv_len, key_bytes, str(device), c.sink, c.local)
        objs = (attention_mask, self._on(self._counted, device), per_row)
        key = (shapes, *(id(o) for o in objs))
        hit = self._full_memo.get(key)
        if hit is not None and all(a is o for a, o in zip(hit[0], objs)):
            return hit[1]
        if len(self._full_memo) >= 8 or any(k[0] != shapes for k in self._full_memo):
            self._full_memo.clear()
        valid = key_validity(attention_mask, b, q_len, kv_len, device)
        static, n_valid = static_keys(valid, c.sink, c.local)
        counted = self._count_mask(b, q_len, per_row, device)
        sums = self.recorder.full_sums(static, n_valid, hq, counted, key_bytes=key_bytes)
        self._full_memo[key] = (objs, sums)
        return sums

    def fused(self, query: torch.Tensor) -> bool:
        """Whether this session's sparse calls on ``query``'s device and dtype take the fused kernel
        (``core.fused_attention_used`` for ``Runtime.fused_attention``), decided once per (device, dtype)."""
        key = (query.device, query.dtype)
        memo = self._fused_memo
        if key not in memo:
            memo[key] = fused_attention_used(self.runtime.fused_attention, self.method, query.device, query.dtype)
        return memo[key]

    def attention(self, module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        """One layer's attention call.  Everything it makes, reads or keeps (the layer's method state, masks, the
        recorder's sums of this layer) is on the layer's own device, ``query.device``: the engine's per-batch
        tensors are brought there (``_on``), so a model placed over several devices computes what it does on one."""
        layer_idx = module.layer_idx
        b, hq, q_len, d = query.shape
        dev = query.device
        scaling = module.scaling if scaling is None else scaling
        sparse = self.is_sparse(layer_idx, q_len)
        per_row = self._on(sparse, dev) if torch.is_tensor(sparse) else None  # bool [B, Q]
        starts = self._on(self.row_starts, dev)
        if per_row is None and not sparse:
            out = dense_call(module, query, key, value, attention_mask, scaling, dropout, starts, **kwargs)
            if self.method.observes_dense and layer_idx not in self.dense_layers:
                masks = self._masks(attention_mask, b, q_len, key.shape[2], query.device)
                valid = (
                    masks.valid
                    if masks is not None
                    else key_validity(attention_mask, b, q_len, key.shape[2], query.device)
                )
                state = _layer_state(getattr(module, _CACHE_ATTR, None), layer_idx)
                self.method.observe_dense(state, query, key, valid, scaling, layer_idx)
            return out
        if self.method.dense:  # dense attention; the recorded statistics depend only on the pass's masks
            with span("attend"):
                out = dense_call(module, query, key, value, attention_mask, scaling, dropout, starts, **kwargs)
            with span("record"):
                self.recorder.add_sums(
                    layer_idx,
                    *self._full_sums(
                        attention_mask, b, hq, q_len, key.shape[2], 2 * d * key.element_size(), per_row, query.device
                    ),
                )
            return out
        counted = self._count_mask(b, q_len, per_row, dev)
        with span("masks"):
            masks = self._masks(attention_mask, b, q_len, key.shape[2], query.device)
            valid = (
                masks.valid if masks is not None else key_validity(attention_mask, b, q_len, key.shape[2], query.device)
            )
        if per_row is not None:
            dense, _ = dense_call(module, query, key, value, attention_mask, scaling, dropout, starts, **kwargs)
        state = _layer_state(getattr(module, _CACHE_ATTR, None), layer_idx)
        seeds = self._on(self.row_seeds, dev) if self.row_seeds is not None and self.row_seeds.shape[0] == b else None
        out, stats = sparse_attention(
            self.method,
            query,
            key,
            value,
            valid,
            scaling,
            state,
            layer_idx,
            compute_error=self.runtime.compute_error,
            query_chunk=self.runtime.query_chunk,
            masks=masks,
            row_seeds=seeds,
            layer_inputs=self.layer_inputs,
            sparse_rows=per_row,
            generating=self.generating(),
            fused=self.fused(query),
        )
        with span("record"):
            self.recorder.add(layer_idx, stats, counted)
        out = out.transpose(1, 2)  # [B, Q, Hq, D]
        if per_row is not None:  # rows still in their (dense) context keep the dense output
            out = torch.where(per_row[:, :, None, None], out, dense)
        return out.contiguous(), None


def dense_call(module, query, key, value, attention_mask, scaling=None, dropout=0.0, starts=None, **kwargs):
    """Dense attention in the attention interface's form ([B, Q, Hq, D], None): stock sdpa, or inside
    ``invariance.batch_invariant()`` (sdpa's kernels split keys by batch and length) the invariant kernel
    ``kernels.invariant.attention`` when each row's first key is known (``starts`` long [B], the engine's left
    padding; causal, with the layer's sliding window), else ``core.dense_attention`` over the mask."""
    if not invariance.enabled():
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scaling = module.scaling if scaling is None else scaling
    b, _, q_len, _ = query.shape
    if starts is not None and starts.shape[0] == b:
        window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None) or 0
        out = kinv.attention(query, key, value, starts, scaling, int(window))
    else:
        valid = key_validity(attention_mask, b, q_len, key.shape[2], query.device)
        out = dense_attention(query, key, value, valid, scaling)
    return out.transpose(1, 2).contiguous(), None


def sparse_eval_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered attention function: the module's session decides; no session means dense attention
    (``dense_call``)."""
    session: SparseSession | None = getattr(module, _SESSION_ATTR, None)
    if session is None:
        return dense_call(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    return session.attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def register() -> None:
    """Registers ``sparse_eval_attention`` as ``ATTENTION_NAME`` in transformers' ``AttentionInterface`` and its
    ``sdpa_mask`` under the same name in ``AttentionMaskInterface``.  Idempotent (the same function under the same
    name); importing this module registers nothing."""
    AttentionInterface.register(ATTENTION_NAME, sparse_eval_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)


def _grab_cache(module, args, kwargs):
    setattr(module, _CACHE_ATTR, kwargs.get("cache", kwargs.get("past_key_values")))
    session = getattr(module, _SESSION_ATTR, None)
    if session is not None and "hidden_states" in kwargs:
        session.layer_inputs[module.layer_idx] = (kwargs["hidden_states"], kwargs.get("position_embeddings"))


def attach(model: torch.nn.Module, method: Method, runtime: Runtime | None = None) -> SparseSession:
    """Route ``model``'s attention through ``method``.  Returns the session (statistics, phases)."""
    detach(model)
    register()
    shape = head_shape(model.config)
    session = SparseSession(method, runtime or Runtime(), shape.layers, shape.heads, sliding_layers(model))
    session.modules = attention_modules(model)
    for m in session.modules:
        setattr(m, _SESSION_ATTR, session)
        if not method.dense:  # only a sparse call reads the cache's index and the layer inputs
            m._sparse_eval_hook = m.register_forward_pre_hook(_grab_cache, with_kwargs=True)
    model.set_attn_implementation(ATTENTION_NAME)
    return session


def detach(model: torch.nn.Module) -> None:
    """Undo ``attach`` (the model keeps the registered name, which without a session is stock sdpa)."""
    for m in model.modules():
        hook = getattr(m, "_sparse_eval_hook", None)
        if hook is not None:
            hook.remove()
            del m._sparse_eval_hook
        for attr in (_SESSION_ATTR, _CACHE_ATTR):
            if hasattr(m, attr):
                delattr(m, attr)
