"""The method interface: a sparse-attention method is its *selection* and its *logit correction*.

Every method in this package answers one question per attention call: given the query rows, the keys in
the cache and the static keys (sink + local window), which keys enter the output and with what additive
correction to their logits?  The attention over that selection is shared (`sparse_eval.methods.core`):

    o = softmax( s + b  over the kept keys ) · V          s = q Kᵀ · scaling   (MagicPIG eq. 11 form)

* TopK, Quest and Double Sparsity only pick keys (b = 0).
* MagicPIG picks by SimHash collisions and corrects with b = −log u (eq. 10–11).
* Oracle sampling picks i.i.d. draws from the true attention and weights by counts (eq. 4–5), which is the
  same form with b chosen so that softmax(s + b) puts mass f_i / B on sampled key i.

A method may also keep an index across decoding steps (Quest page bounds, DS label cache, MagicPIG hash
codes); that index lives in a per-layer ``state`` dict owned by the cache layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Iterable, Mapping

import torch

from .labels import budget_label, budget_level

GQA_MODES = ("query_head", "kv_head")
SLIDING_LAYERS = ("dense", "sparse")


@dataclass
class MethodConfig:
    """Fields every method has.  Defaults are the MagicPIG paper's baseline settings (§5.1)."""

    name: str = "full"
    # keys kept exactly, never searched or sampled: the first `sink` and the last `local` keys of each row
    sink: int = 4
    local: int = 64
    # layers that always run dense attention (MagicPIG: [first, mid], the first and the middle layer, i.e. {0, 16}
    # of a 32-layer Llama; Quest/TopK/oracle in the MagicPIG repo: [0, 1]).  Entries: a layer index (negative: from
    # the end) or a word resolved per model by ``resolve_dense_layers`` over the layers that attend over the whole
    # context (all layers but sliding-window ones): first, mid, last
    dense_layers: list[Any] = field(default_factory=lambda: [0, 1])
    # layers that attend within a sliding window of their own (Gemma 3: 5 of every 6, 512 keys) keep it either way;
    # "dense": they run dense attention over their window, "sparse": the method runs in them, within the window.
    # A method field beside dense_layers (not an eval setting): it says in which layers the method runs
    # (``models.inspection.sliding_layers`` finds them, ``attention.plugin.layer_plan`` applies it on both paths)
    sliding_layers: str = "dense"
    # selection per query head (paper setting for all methods) or shared per KV group
    gqa: str = "query_head"
    # seed of the method's own randomness (sampling, random projections).  In a run the runner sets it from the
    # top-level ``seed`` (``identity.seeds``; ``method.seed`` is refused there); None elsewhere (``attend()``,
    # the system path) means 0
    seed: int | None = None


@dataclass
class Selection:
    """What a method returns for a block of query rows.

    keep: bool [B, Hq, Q, N]: keys that enter the output (static keys are added by the core).
    bias: float [B, Hq, Q, N] or None: additive correction of the logits of kept keys.
    stats: extra per-row statistics ([B, Hq, Q] tensors or python scalars) the method wants recorded.
    """

    keep: torch.Tensor
    bias: torch.Tensor | None = None
    stats: dict[str, Any] = field(default_factory=dict)


class CacheTrackedState(dict):
    """A layer's method state that its cache layer drops (replaces by an empty one) whenever keys are removed or
    rows reordered: reset, crop, batch selection (``attention.plugin.SparseLayer``).  A method holding an index in
    such a state knows on the host that the keys it indexed are still the cache's first ``n``, so it may skip
    comparing them on the device (a host sync).  A plain dict (a cache that does not drop it, e.g. the
    ``DynamicCache`` that ``generate`` makes) gives no such guarantee."""


@dataclass
class AttentionContext:
    """Everything a method may look at when it selects keys for a block of query rows.

    Shapes: B batch, Hq query heads, Hkv KV heads, G = Hq // Hkv, Q query rows, N keys, D head dim.
    """

    q: torch.Tensor  # [B, Hq, Q, D]
    k: torch.Tensor  # [B, Hkv, N, D]
    v: torch.Tensor  # [B, Hkv, N, D]
    scores: torch.Tensor  # [B, Hq, Q, N] float32, q kᵀ · scaling, -inf where not valid
    valid: torch.Tensor  # [B, 1, Q, N] bool: causal and not padding
    static: torch.Tensor  # [B, 1, Q, N] bool: sink + local keys (subset of valid)
    n_valid: torch.Tensor  # [B, 1, Q, 1] long: number of valid keys of each row (the context size n)
    scaling: float
    layer_idx: int
    state: dict[str, Any]
    generator_seed: int  # from (method seed, layer): the same for every call of a layer
    # long [B]: each row's own seed (its sample id), so that a row's draws do not depend on its batch; None: 0
    row_seeds: torch.Tensor | None = None
    # the session's per-layer (hidden_states, position_embeddings) of the current pass (DS-Offload)
    layer_inputs: dict[int, tuple] | None = None
    query_offset: int = 0  # index of the first row of this block among the call's query rows
    # bool [B, 1, Q, N]: ``candidates`` and its complement when the caller has them (they are the same for every
    # layer of a forward pass); else computed here, once per context
    candidate_mask: torch.Tensor | None = None
    not_candidate_mask: torch.Tensor | None = None
    # bool [B, 1, Q, 1]: the rows whose sparse output the session uses; None: every row.  A call of a per-row phase
    # (protocol B, a padded batch whose rows' contexts end at different columns) runs the method over every row and
    # keeps the dense output where this is False: a method whose state follows the rows (``observes_dense``) treats
    # those rows as it treats the rows ``observe_dense`` is given
    sparse_rows: torch.Tensor | None = None
    # the query rows are generated tokens that extend a finished prompt (decode steps), not prompt rows: every
    # sparse call under protocol A, and under S and B the engine's decode steps (``SparseSession.generation``).
    # A method whose rule differs between a prompt and its continuation reads it; False outside a session
    generating: bool = False

    @property
    def groups(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def state_tracks_cache(self) -> bool:
        """Whether ``state`` is dropped with any removal of keys (``CacheTrackedState``): an index over the first
        ``n`` keys built in an earlier call still matches them, no device comparison needed."""
        return isinstance(self.state, CacheTrackedState)

    @property
    def candidates(self) -> torch.Tensor:
        """bool [B, 1, Q, N]: keys a method may choose (valid and not static)."""
        if self.candidate_mask is None:
            self.candidate_mask = self.valid & ~self.static
        return self.candidate_mask

    @property
    def not_candidates(self) -> torch.Tensor:
        """bool [B, 1, Q, N]: ~candidates (keys a method must not choose)."""
        if self.not_candidate_mask is None:
            self.not_candidate_mask = ~self.candidates
        return self.not_candidate_mask

    def expand_kv(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, ...] -> [B, Hq, ...] (each KV head repeated for its G query heads)."""
        return x.repeat_interleave(self.groups, dim=1)

    def group_sum(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Hq, ...] -> [B, Hq, ...]: sum over the query heads of each KV group, broadcast back."""
        b, hq = x.shape[:2]
        g = self.groups
        summed = x.reshape(b, hq // g, g, *x.shape[2:]).sum(2, keepdim=True)
        return summed.expand(b, hq // g, g, *x.shape[2:]).reshape(x.shape)


def token_budget(budget: float | int, n: Any) -> Any:
    """The token-budget rule of TopK, oracle sampling, Quest and DS, in one place for every path.

    A float is a ratio of the row's context size n (the number of valid keys): the count is ⌊ratio·n⌋ (float64
    product, then truncation, as the MagicPIG reference code takes int(ratio·n)).  An int is a number of tokens.
    ``n`` is a Python int (host form, an int back) or a tensor (device form, a long tensor shaped like ``n``).
    """
    if torch.is_tensor(n):
        if isinstance(budget, float):
            return torch.floor(n.to(torch.float64) * budget).to(torch.long)
        return torch.full_like(n, int(budget), dtype=torch.long)
    return int(n * budget) if isinstance(budget, float) else int(budget)


def resolve_budget(budget: float | int, n: torch.Tensor, what: str = "budget") -> torch.Tensor:
    """``token_budget`` per row, for a checked budget (float: a ratio in (0, 1]; int: a token count >= 1).
    Returns a long tensor shaped like ``n``."""
    check_budget(budget, what)
    return token_budget(budget, n)


def budget_bound(budget: float | int, n: int) -> int:
    """The largest count ``resolve_budget`` can give for rows of at most ``n`` keys, capped at ``n``, from Python
    numbers only (so selecting needs no device-to-host synchronisation)."""
    return min(n, token_budget(budget, n))


def check_budget(budget: object, what: str = "budget", context: int | None = None) -> None:
    """Start-time check of a budget value: raises ValueError naming the parameter and the valid values."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(
            f"{what}={budget!r}: give a ratio of the context in (0, 1] (a float) or a token count >= 1 (an int)"
        )
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"{what}={budget!r}: a ratio must lie in (0, 1] (write an int for a token count)")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"{what}={budget!r}: a token count must be >= 1")
    if isinstance(budget, int) and context is not None and budget > context:
        raise ValueError(f"{what}={budget!r} is larger than the context ({context} tokens)")


DENSE_LAYER_WORDS = ("first", "mid", "last")


def _dense_layer_error(spec: Any, detail: str) -> ValueError:
    return ValueError(
        f"method.dense_layers={list(spec)}: {detail}; give layer indices (negative: from the end) or "
        f"the words {list(DENSE_LAYER_WORDS)} (of the layers that attend over the whole context; mid = the middle "
        f"one), e.g. method.dense_layers=[first,mid]"
    )


def check_dense_layers(spec: Any) -> None:
    """Start-time check of ``dense_layers`` before the model's depth is known."""
    if isinstance(spec, (str, int)) or spec is None:
        raise _dense_layer_error([spec], "not a list")
    bad = [x for x in spec if isinstance(x, bool) or not (isinstance(x, int) or x in DENSE_LAYER_WORDS)]
    if bad:
        raise _dense_layer_error(spec, f"{bad} not a layer index or word")


def whole_context_layers(num_layers: int, sliding: Iterable[int] = ()) -> list[int]:
    """The layers of a model with ``num_layers`` layers that attend over the whole context: all but the
    ``sliding`` ones (``models.inspection.sliding_layers``); all of them when every layer slides."""
    slide = set(sliding)
    return [i for i in range(num_layers) if i not in slide] or list(range(num_layers))


def resolve_dense_layers(spec: Any, num_layers: int, sliding: Iterable[int] = ()) -> list[int]:
    """The dense layers of a model with ``num_layers`` layers, sorted, as non-negative indices.

    The words count the layers that attend over the whole context (``whole_context_layers``: every layer of a
    model without sliding-window layers): ``first`` is the first of them, ``mid`` the middle one (index
    n // 2 of the n of them: layer 16 of a 32-layer Llama, MagicPIG §5.1's "first and middle layer"), ``last``
    the last.  On Gemma-3-270M (18 layers, whole-context layers 5, 11, 17) [first, mid] is {5, 11}: the paper's
    rule keeps two layers that see the whole context dense, not layers 0 and 9, which slide and are dense anyway.
    An integer is a layer index as written (negative: from the end).  Raises ValueError naming an index out of
    range.
    """
    check_dense_layers(spec)
    full = whole_context_layers(num_layers, sliding)
    words = {"first": full[0], "mid": full[len(full) // 2], "last": full[-1]}
    out = []
    for x in spec:
        i = words[x] if isinstance(x, str) else int(x)
        if i < 0:
            i += num_layers
        if not 0 <= i < num_layers:
            raise _dense_layer_error(
                spec, f"{x} out of range for a model with {num_layers} layers (valid {-num_layers}..{num_layers - 1})"
            )
        out.append(i)
    return sorted(set(out))


class Method:
    """Base class.  Subclasses set ``name`` and ``config_class`` and implement ``select``."""

    name: ClassVar[str] = ""
    config_class: ClassVar[type[MethodConfig]] = MethodConfig
    # methods that compute no selection at all (full attention) run stock sdpa everywhere
    dense: ClassVar[bool] = False
    # a method that never needs the exact scores of all keys to select (MagicPIG, Quest, DS) can say so;
    # the core then still computes them for the estimation error, but that is measurement, not method cost
    supported_gqa: ClassVar[tuple[str, ...]] = GQA_MODES
    # a method whose index must know which keys each query row may attend sets this; ``prepare`` then also gets
    # ``valid``: bool [B, 1, Q, N] (causal and not padding; row Q-1 is the call's last query row)
    prepare_with_valid: ClassVar[bool] = False
    # whether ``index_bytes`` already reads every valid key's K (exact scoring): the kept keys' K rows are then
    # not read a second time, only their V rows (``core.kv_bytes_read``)
    index_reads_keys: ClassVar[bool] = True
    # whether the method draws at random (from ``config.seed``): its records then depend on the seed, and a run
    # over several seeds (``seed=[0,1,2]``) runs it once per seed (``sparse_eval.identity.seeds``).  A method whose
    # randomness depends on its options overrides this with a property (Double Sparsity's random channels), so
    # generic code asks an instance (``build_method(config).stochastic``), never the class or the method's name
    stochastic: ClassVar[bool] = False
    # one line for ``python -m sparse_eval --help``: what the method keeps (and whose paper it is); "" = the first
    # sentence of the class docstring
    summary: ClassVar[str] = ""
    # the report's name of the method (tables, legends), e.g. "TopK"; "" = ``name``
    display_name: ClassVar[str] = ""
    # the config field of the method's token budget (float: a ratio of the row's valid keys, int: tokens;
    # ``token_budget``'s rule), if it has one.  A budgeted method gets from here its start-time check (``validate``:
    # ``check_budget``, against the context unless ``budget_may_exceed_context``), its per-row count
    # (``budget_tokens``) and that count's host-side bound (``budget_host_bound``); the report's config label and
    # sparsity level of a run read it too (``label``, ``level``)
    budget_field: ClassVar[str | None] = None
    # an int budget larger than the context is valid (SnapKV: the prompt is then kept whole)
    budget_may_exceed_context: ClassVar[bool] = False
    # the options a reader tells this method's configs apart by (the printed table's config column, progress bars)
    headline_options: ClassVar[tuple[str, ...]] = ()
    # parts of ``index_memory`` allocated once per run, whatever its batch, on the host first (MagicPIG's projections)
    shared_index_parts: ClassVar[tuple[str, ...]] = ()
    # whether the options alone can make one row's index larger than any device (MagicPIG's L hash tables of every
    # key): ``memory.check_index_fits`` then refuses such a setting at start (``index_too_large`` says why)
    index_may_not_fit: ClassVar[bool] = False
    # a method whose selection is its static keys alone (StreamingLLM: attention sinks + a recent window): a row
    # that keeps none of its candidates is the method, not an empty selection (``core`` counts no ``empty`` row)
    selects_static_only: ClassVar[bool] = False
    # a method whose state needs the attention of the rows that run dense in the layers it runs in (the prompt under
    # protocol A, the context under B: e.g. scores accumulated over the dense prompt, as an eviction policy that keeps
    # the keys the prompt attended most) sets this; the session then calls ``observe_dense`` on each such call
    observes_dense: ClassVar[bool] = False
    # whether the method's selections may go through the fused attention kernel (``kernels.selected_attention``,
    # ``eval.fused_attention``): its Selection's keep mask and bias (any [B, Hq, Q, N] mask, a finite bias on kept keys)
    # are all the shared attention reads, and nothing of the method looks at the probabilities.  A method that
    # declares it is checked by the contract suite with the fused path on (``test_method_contract``); off by default,
    # so a new method opts in once that passes
    fused_attention: ClassVar[bool] = False

    def __init__(self, config: MethodConfig):
        if config.seed is None:  # outside a run (attend(), the system path): seed 0
            config.seed = 0
        self.config = config
        self.validate()

    # -- what the contract suite checks (tests/methods/test_method_contract.py) ----------------------------------------
    @classmethod
    def contract_configs(cls) -> list[dict[str, Any]]:
        """The option sets the contract suite checks this method under (config fields over the defaults), on
        synthetic tensors of ~100 keys: causal masks, left padding, several query rows.  List every option that
        changes how the method selects or weights keys; each must run without a model's files (no calibration).
        Default: the defaults, [{}]."""
        return [{}]

    @classmethod
    def model_contract_configs(cls) -> list[dict[str, Any]]:
        """The configs the contract's end-to-end checks run on the shipped test model (stories260K, 5 layers,
        prompts of 20-160 tokens): causality under protocols S and B, batch invariance, resume after a kill.  Each
        costs seconds to a minute of CI, so: few, with budgets and a static window small enough that the method
        selects within short prompts.  Default: the first of ``contract_configs``."""
        return cls.contract_configs()[:1]

    @classmethod
    def system_contract_configs(cls) -> dict[str, dict[str, Any]]:
        """For a method with a system layer (``sparse_eval.system.layers``): labelled configs (each with its
        ``name``) whose greedy tokens the system path must reproduce from the accuracy path on the test model's
        260-token prompts, eagerly and with the static step of ``cuda_graph=true`` (tests/system/test_system.py); chosen
        so that they differ from full attention's tokens (equality is then not trivial).  Default: none."""
        return {}

    @classmethod
    def static_step_contract_configs(cls) -> dict[str, dict[str, Any]]:
        """Further labelled configs the static step alone is checked under (its device-side budgets and fallbacks),
        besides ``system_contract_configs``.  Default: none."""
        return {}

    @classmethod
    def paper_configs(cls) -> dict[str, dict[str, Any]]:
        """Labelled option sets (over the defaults) that the real-model batch-invariance check
        (``sparse_eval.checks.batch_invariance``, on the GPU in ``tests/checks/test_invariance.py``) runs at the paper's
        settings on RULER prompts of 2-4K tokens.  Default: the defaults alone, labelled with the method's name."""
        return {cls.name: {}}

    @classmethod
    def keep_all_options(cls, n: int) -> dict[str, Any] | None:
        """Options under which the method keeps every valid key of any row of at most ``n`` keys, with no logit
        correction, so that its output must equal full attention's (the contract's exactness check).  None: the
        method has no such budget (say why in the override's docstring).  Default: None."""
        return None

    def contract_weights(
        self,
        s: torch.Tensor,
        p_hat: torch.Tensor,
        keep: torch.Tensor,
        static: torch.Tensor,
        valid: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
    ) -> torch.Tensor | None:
        """For a method whose selections carry a logit correction (``Selection.bias``): the per-key weights its
        formula gives, which the contract suite (``test_per_key_weights_are_the_methods_formula``) compares with the
        weights its output carries (the output over one-hot values V = I, p̂).  Write it from the paper, not by
        calling the method's own code (the check is only as good as that independence).  Arguments, on the suite's
        synthetic block (float64; B batch rows, Hq query heads over Hkv KV heads, Q query rows, N keys):
        s [B, Hq, Q, N] the logits q·kᵀ/√d (−inf where not valid); p_hat [B, Hq, Q, N] the weights the method's
        output carries (for a formula that needs the realised draws, as sampling's counts f_i = p̂_i·B/W_c);
        keep bool [B, Hq, Q, N] the kept keys; static bool [B, 1, Q, N] the sink and local keys; valid bool
        [B, 1, Q, N] (causal, left padding); q [B, Hq, Q, D], k [B, Hkv, N, D].  Returns [B, Hq, Q, N], 0 off
        ``keep``.  The suite's own formulas for the shipped methods (its ``WEIGHTS``) take precedence.  Default:
        None (no formula: the suite refuses a method whose selections carry a bias)."""
        return None

    # -- configuration -------------------------------------------------------------------------
    def validate(self, num_layers: int | None = None, context: int | None = None) -> None:
        c = self.config
        if c.sink < 0:
            raise ValueError(f"method.sink={c.sink}: must be >= 0")
        if c.local < 0:
            raise ValueError(f"method.local={c.local}: must be >= 0")
        if c.gqa not in self.supported_gqa:
            raise ValueError(
                f"method.gqa={c.gqa!r} is not supported by method {self.name!r}; valid: {list(self.supported_gqa)}"
            )
        check_dense_layers(c.dense_layers)
        if self.budget_field is not None:
            within = None if self.budget_may_exceed_context else context
            check_budget(getattr(c, self.budget_field), f"method.{self.budget_field}", within)
        if c.sliding_layers not in SLIDING_LAYERS:
            raise ValueError(
                f"method.sliding_layers={c.sliding_layers!r}; valid: {list(SLIDING_LAYERS)} (dense: layers "
                "with a sliding window attend densely within it; sparse: the method runs there too)"
            )
        if num_layers is not None:
            resolve_dense_layers(c.dense_layers, num_layers)

    def budget_tokens(self, ctx: AttentionContext) -> torch.Tensor:
        """Each row's budget in keys, long [B, 1, Q, 1]: ``token_budget`` of the row's valid keys (``budget_field``)."""
        return resolve_budget(getattr(self.config, self.budget_field), ctx.n_valid, f"method.{self.budget_field}")

    def budget_host_bound(self, n: int) -> int:
        """The largest ``budget_tokens`` of rows of at most ``n`` keys, from Python numbers (no device sync)."""
        return budget_bound(getattr(self.config, self.budget_field), n)

    def dense_layer_set(self, num_layers: int, sliding: Iterable[int] = ()) -> set[int]:
        """The layers this method leaves dense in a model of ``num_layers`` layers whose sliding-window layers are
        ``sliding`` (``dense_layers`` resolved: ``resolve_dense_layers``)."""
        return set(resolve_dense_layers(self.config.dense_layers, num_layers, sliding))

    def describe(self) -> str:
        return self.name

    def setup(self, model: Any, model_name: str) -> None:
        """Called once by the runner before the method is attached to ``model`` (e.g. Double Sparsity loads
        the model's calibrated channels here).  Default: nothing."""

    def external_inputs(self, model_name: str) -> dict[str, Any]:
        """The content fingerprints (sha256) of everything the method will read from outside its config for
        ``model_name`` (calibration files, data files), {what: sha256}.  They enter the run's identity, so a
        changed file gives a new run directory instead of reusing results made with the old one.  Default: none."""
        return {}

    def provenance(self) -> dict[str, Any]:
        """What the method loaded in ``setup`` that decides its results (recorded in the run summary)."""
        return {}

    def calibration_text(self) -> Any:
        """After ``setup``: the text the loaded state was computed from, an ``identity.overlap.CalibrationText``
        (file, dataset and split, content fingerprint), which the runner checks against the task's evaluated
        text before a run starts.  Default: None (the method learned nothing from text)."""
        return None

    # -- per-layer index ------------------------------------------------------------------------
    def prepare(
        self, state: dict[str, Any], k: torch.Tensor, v: torch.Tensor, layer_idx: int, module: Any = None, **kwargs: Any
    ) -> None:
        """Bring the method's per-layer index up to date with the keys k [B, Hkv, N, D] (called once per
        attention call before any selection; with ``prepare_with_valid`` also ``valid=`` bool [B, 1, Q, N]).
        Default: nothing to index."""

    def observe_dense(
        self,
        state: dict[str, Any],
        q: torch.Tensor,
        k: torch.Tensor,
        valid: torch.Tensor,
        scaling: float,
        layer_idx: int,
    ) -> None:
        """With ``observes_dense``: called by the session for every attention call that runs dense in a layer the
        method runs in (a layer outside ``dense_layers`` that is dense only because of the protocol or phase), after
        the dense attention, with the call's query rows q [B, Hq, Q, D], the layer's keys k [B, Hkv, N, D] (the whole
        cache, as ``select`` sees them), valid bool [B, 1, Q, N] (causal and not padding) and the layer's ``state``
        (the dict ``select`` gets as ``ctx.state``).  Never called for a layer in ``dense_layers``.
        Default: nothing."""

    # -- selection ------------------------------------------------------------------------------
    def select(self, ctx: AttentionContext) -> Selection:  # pragma: no cover - abstract
        raise NotImplementedError

    def cost1(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor | float:
        """Search/sampling FLOPs to find the keys, as a fraction of full attention's qKᵀ + softmax·V
        (4·n·d FLOPs per query row and head).  Override per method."""
        return 0.0

    def index_bytes(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor | float:
        """Bytes the method's system reads to *find* the keys of each query-head row (the kept keys' K/V rows are
        added by ``core.kv_bytes_read``): [B, Hq, Q] or [B, 1, Q] tensor, or a float for every row.

        Default, exact scoring (full attention, TopK, oracle sampling): every valid key's K row, n_valid·D·e bytes
        (e = the cache dtype's element size); ``index_reads_keys`` is then True.  Counted per query-head row, as if
        each head read its own selection (the G heads of a KV group sharing reads is not deducted)."""
        return ctx.n_valid.squeeze(-1).to(torch.float32) * (ctx.k.shape[-1] * ctx.k.element_size())

    # -- what the memory estimate asks (``sparse_eval.run.memory``), from a config ``params`` --------------------------
    @classmethod
    def index_memory(
        cls, params: Mapping[str, Any], shape: Any, n: int, sparse_layers: int, building_rows: bool = False
    ) -> dict[str, int]:
        """Bytes of one row's method index over ``n`` keys in ``sparse_layers`` layers, by part, on the accuracy
        path; ``shape`` the model's sizes (``memory.Shape``: layers, heads, kv_heads, head_dim), ``building_rows``
        whether a call's rows build the index (protocols S and B).  Default: no index."""
        return {}

    @classmethod
    def index_too_large(cls, params: Mapping[str, Any], need: str) -> str:
        """The start-time refusal of a setting whose index cannot fit (``index_may_not_fit``); ``need`` says what
        one sample needs against what is available."""
        return f"method={cls.name}: its index {need}"

    # -- what the report asks, from a run's config ``params`` ({field: value}; fields an old table lacks absent) --
    @classmethod
    def display(cls, params: Mapping[str, Any]) -> str:
        """The method's name in tables and legends for a run with config ``params`` (a variant may differ)."""
        return cls.display_name or cls.name

    @classmethod
    def label(cls, params: Mapping[str, Any]) -> str | None:
        """The run's config in the paper's notation (e.g. MagicPIG's (K,L)); default: the budget, for a method with
        ``budget_field``.  None: the report writes the run's whole method config."""
        return budget_label(params.get(cls.budget_field)) if cls.budget_field else None

    @classmethod
    def level(cls, params: Mapping[str, Any], context: float | None) -> float | None:
        """The run's sparsity level (the share of a row's keys its config selects, static keys not counted) for the
        figures that plot against it; ``context``: the keys of an average row (an int budget's denominator), None
        when unknown.  Default: the budget (``budget_level``); None for a method without one."""
        return budget_level(params.get(cls.budget_field), context) if cls.budget_field else None

    @classmethod
    def point_label(cls, params: Mapping[str, Any], context: float | None) -> str | None:
        """A short label of the run's point in a figure where ``label`` is too long (Double Sparsity at token =
        channel sparsity: its level, 1/16); None: ``label``."""
        return None


def log_or_neg_inf(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 0, torch.log(x.clamp_min(torch.finfo(x.dtype).tiny)), torch.full_like(x, -math.inf))
