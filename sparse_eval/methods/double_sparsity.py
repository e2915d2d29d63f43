"""Double Sparsity (Yang et al., 2024): token selection by a few offline-calibrated channels.

Algorithm 1 (DS Decode), per query head, with C the head's r = α·d calibrated channels:

    Q_label = Q[C]                     (r channels of the query)                         line 3
    ŝ       = Q_label · K_labelᵀ       (K_label: the label cache, K[:, C], [S, r])        line 4
    i       = argtopk(ŝ, k),  k = β·S                                                     line 5
    y       = softmax(Q·K[i]ᵀ / √d) · V[i]                                                lines 6-7

* Channels (§4.1, offline calibration): per layer and query head, channels ranked by the mean |q_c·k_c| of
  each token with itself ("qk" outliers; "q" / "k" variants: mean |q_c| / |k_c|), written by
  ``python -m sparse_eval.calibrate model=<name>`` to the user calibration folder (``calibration_dirs``)
  (``channels_file`` overrides; ``channels`` passes them directly).  ``channel_type=random`` (DS Table 3's
  random-channel baseline) needs no calibration: for each layer and KV head, r channels drawn uniformly at
  random without replacement (the first r of a permutation of the d channels from a generator seeded by
  (``seed``, layer)), shared by the query heads of that KV head.  The calibration file records the text it was
  computed from (dataset, split, tokens, a content fingerprint: ``calibration_text``); a run whose task evaluates
  text that overlaps it is refused at start (``sparse_eval.identity.overlap``).  The statistic is taken on the keys and
  queries *after* RoPE for "qk", as the authors' calibration did, and the channels index the post-RoPE cache
  at decode, as the authors' simulation and kernels did (their label cache is cut from the rotated keys).
* Label cache (§4.2): K[:, C] per query head, kept in the layer's ``state`` and appended as keys arrive;
  quantized to ``label_bits`` (default 4, §4.2: "we can store the label cache in 4-bit"; 16 = not quantized).
  The quantizer is the authors' simulation's: per token, asymmetric min/max over the r label channels,
  2^bits − 1 levels, dequantized.  The authors' simulation quantizes the query label the same way
  (``quantize_query``, default true).  Their conversion helper drops ``label_bits`` when it recurses, so their
  runs always used 4 bits whatever was asked; here the setting is honoured, for any width 1..8 (their quantizer is
  defined for any width and their CLI exposes it, ``--q_bits``; the paper reports 4 only).
* Defaults.  α = 1/4, β = 1/16 (``alpha=0.25, beta=0.0625``).  The paper's "1/16 channel sparsity" is the
  label cache's size relative to the K cache, α·label_bits/16: the authors' plot code computes channel
  sparsity as group_factor·16/bits, their README runs group_factor 4 (α = 1/4) with 4-bit labels, and §4.2
  says a 4-bit label cache is 1/16 of the K cache — all α = 1/4.  Token sparsity 1/16 is β = 1/16.
  A float β is a ratio of the row's context n (k = floor(β·n), at least 1 token; the row's
  ``one_token_floor`` says when the floor acted); an int β is the authors' absolute ``heavy_const`` (with it,
  rows whose context is at most heavy_const are dense, as in the authors' perplexity runs).
* Sink / local: DS keeps none (its top-k is over all keys), so ``sink=0, local=0`` by default; set them to
  compare with the other methods' static keys.  Dense layers [0, 1], as the authors' HF simulation.
* Protocol: the authors' perplexity ran every position sparse (protocol S, the wikitext task's default).
* GQA: ``query_head`` (default; the authors repeat K per query head) or ``kv_head`` (label scores summed over
  the query heads of a KV group, one token set per group).
* DS-Offload simulation (§5.1, ``offload=true``): layer l's token set is chosen with an approximate query from
  layer l−1's input passed through layer l's query projection and RoPE at the current positions (the real
  system prefetches those tokens while layer l−1 runs).  ``offload_input``: ``residual`` (default; the
  authors' simulation feeds the previous layer's residual-stream input, un-normalized, to q_proj; here it is
  recovered from the stored attention input h = RMSNorm(x)·w as h / w = x / rms(x), a positive per-token
  multiple of x, which selects the same tokens for a bias-free q_proj) or ``attn_input`` (layer l−1's
  attention input h itself).  Layer 0, and any layer whose predecessor's input was not recorded, uses its own
  query (row stat ``offload_own_query`` = 1).  ``offload_recall`` = fraction of the tokens plain DS would pick
  that the predicted query picked too.

Cost1 = α/2 (r/(2d) measured): the label scores are r of the d channels of qKᵀ, half of full attention's
FLOPs.  Cost2 (kept / context) is measured by the core.
"""

from __future__ import annotations

import json
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sparse_eval.kernels.ds import (
    pseudo_quantize,
)  # the query-label quantization, shared with the system path's kernels

from .base import AttentionContext, Method, MethodConfig, Selection, token_budget
from .labels import budget_label, budget_level, count_label, fraction_label
from .registry import register
from .topk import topk_mask

CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"  # the shipped files
CALIBRATION_ENV = "SPARSE_EVAL_CALIBRATION_DIR"
CALIBRATED_TYPES = ("qk", "q", "k")  # read from the calibration file
CHANNEL_TYPES = CALIBRATED_TYPES + ("random",)  # random: drawn from the run's seed, no file
OFFLOAD_INPUTS = ("residual", "attn_input")
LABEL_BITS = (1, 2, 3, 4, 5, 6, 7, 8, 16)


def _layer_seed(seed: int, layer_idx: int) -> int:
    """A 63-bit seed mixed from (seed, layer) (splitmix64 finalizer), so that nearby seeds and layers differ."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + (int(layer_idx) + 1) * 0xD1B54A32D192ED03) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (x ^ (x >> 31)) >> 1


def calibration_command(model_name: str) -> str:
    return f"python -m sparse_eval.calibrate model={model_name}"


def user_calibration_dir() -> Path:
    """Where ``python -m sparse_eval.calibrate`` writes by default: ``$SPARSE_EVAL_CALIBRATION_DIR``, else
    ``$XDG_DATA_HOME/sparse_eval/calibration``, else ``~/.local/share/sparse_eval/calibration``."""
    env = os.environ.get(CALIBRATION_ENV)
    if env:
        return Path(env).expanduser()
    return (
        Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share").expanduser()
        / "sparse_eval"
        / "calibration"
    )


def calibration_dirs() -> list[Path]:
    """The folders searched for ``<model.name>.json``, in order: the user's (``user_calibration_dir``, what
    ``calibrate`` wrote), then the files shipped with the package (``sparse_eval/calibration/``)."""
    return [user_calibration_dir(), CALIBRATION_DIR]


def default_channels_file(model_name: str) -> Path:
    """The first ``<model_name>.json`` of ``calibration_dirs()``; when there is none, the user folder's path
    (where ``calibrate`` would write it)."""
    for d in calibration_dirs():
        if (d / f"{model_name}.json").is_file():
            return d / f"{model_name}.json"
    return user_calibration_dir() / f"{model_name}.json"


def calibration_description(cal: dict[str, Any]) -> str:
    """One line saying which text a calibration file's ``calibration`` record was computed from."""
    text = cal.get("text") or {}
    what = " ".join(str(text[k]) for k in ("dataset", "split") if text.get(k))
    origin = text.get("origin") or cal.get("data") or "text of unknown origin"
    tokens = cal.get("tokens")
    return f"{what + ' from ' if what else ''}{origin}{f' ({tokens:,} tokens)' if isinstance(tokens, int) else ''}"


@dataclass
class DoubleSparsityConfig(MethodConfig):
    name: str = "double_sparsity"
    sink: int = 0  # DS keeps no static keys
    local: int = 0
    # channel ratio α: r = floor(α·d) label channels (at least 1; row stat ``one_channel_floor``)
    alpha: float = 0.25
    # token ratio β of the context (float) or absolute token count (int, the authors' heavy_const)
    beta: Any = 0.0625
    # bits of the label cache (1..8, or 16 = not quantized); paper §4.2: 4.  Every width 1..8 is valid on purpose
    # (an ablation of the labels' precision): the simulation quantizes to 2^bits − 1 levels as the authors'
    # pseudo_quantize does for any width, and their CLI exposes it (--q_bits, default 2).  The system path's
    # kernels pack 4, 8 or 16 bits only (``python -m sparse_eval.system`` refuses the others)
    label_bits: int = 4
    # quantize the query label too (authors' HF simulation)
    quantize_query: bool = True
    # which channels: calibrated qk (paper's choice, Table 3), q or k outliers, or random (Table 3's baseline:
    # uniform per layer and KV head, drawn from ``seed``)
    channel_type: str = "qk"
    # calibration file; null: <model.name>.json of calibration_dirs() (the user's folder, then the shipped files)
    channels_file: str | None = None
    # channels given directly (attend() API, tests): [layer][head][channels, best first] or [head][channels]
    channels: Any = None
    # DS-Offload simulation (§5.1): predict layer l's tokens from layer l-1's input
    offload: bool = False
    offload_input: str = "residual"


def load_channels(path: Path, channel_type: str, rewrite: str = "") -> tuple[torch.Tensor, dict[str, Any]]:
    """Reads a calibration file; returns (channel order long [L, H, d], the file's metadata).  ``rewrite``: the
    command that writes the file again, named when the file is corrupt."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not isinstance(data.get("channels", {}), dict):
            raise ValueError("not a calibration file (no 'channels' mapping)")
    except (ValueError, UnicodeDecodeError) as exc:  # json.JSONDecodeError is a ValueError
        raise ValueError(
            f"calibration file {path} is corrupt ({exc}); write it again with:  "
            f"{rewrite or 'python -m sparse_eval.calibrate model=<name>'}"
        ) from None
    chans = data.get("channels", {})
    if channel_type not in chans:
        if channel_type == "random":
            raise ValueError("method.channel_type='random' draws its channels from the run's seed; it reads no file")
        raise ValueError(
            f"method.channel_type={channel_type!r} is not in {path} (it has {sorted(chans)}); "
            f"valid: {list(CHANNEL_TYPES)}"
        )
    meta = {k: v for k, v in data.items() if k not in ("channels", "scores")}
    return torch.tensor(chans[channel_type], dtype=torch.long), meta


@register
class DoubleSparsity(Method):
    """Double Sparsity with a label cache and optional DS-Offload prediction (see the module docstring).

    Row statistics: ``channels`` (r), ``one_channel_floor``, ``one_token_floor``, and with ``offload``:
    ``offload_own_query``, ``offload_recall``.
    """

    name = "double_sparsity"
    fused_attention = True  # a keep mask (and bias) only: kernels.selected_attention serves it
    summary = "the top beta·n keys by label scores over alpha·d calibrated channels (Double Sparsity)"
    config_class = DoubleSparsityConfig
    index_reads_keys = False
    display_name = "DS"
    budget_field = "beta"  # the token budget (the report's label and level are DS's own: ``label``, ``level``)
    headline_options = ("alpha", "beta")

    @property
    def stochastic(self) -> bool:  # type: ignore[override]
        """Random channels (``channel_type=random``) are drawn from config.seed; calibrated ones are fixed."""
        return self.config.channel_type == "random"

    def __init__(self, config: DoubleSparsityConfig):
        super().__init__(config)
        self._channels: torch.Tensor | None = None  # long [L, H, ≥r] or [H, ≥r] (every layer)
        # (layer, Hq, Hkv, D, device) -> (channels [Hq, r] on the device, floored); emptied when channels are set
        self._layer_channel_cache: dict[tuple, tuple[torch.Tensor, bool]] = {}
        self._channels_source: str | None = None
        self._calibration: dict[str, Any] | None = None  # the loaded file's "calibration" record (setup)
        self._model_name = ""
        self._random: dict[tuple[int, int, int], torch.Tensor] = {}  # (layer, Hkv, d) -> long [Hkv, d]
        self._model = None
        self._attn: dict[int, Any] = {}
        self._norm_w: dict[int, torch.Tensor] = {}
        self._norm_w_on: dict[tuple[int, str], torch.Tensor] = {}  # (layer, device) -> its norm weight there
        if config.channels is not None and config.channel_type != "random":
            self._channels = self._as_channels(config.channels)
            self._channels_source = "method.channels"
        elif config.channel_type == "random":
            self._channels_source = f"random (seed {config.seed}, per layer and KV head)"

    # -- configuration -------------------------------------------------------------------------
    @classmethod
    def contract_configs(cls):
        """Random channels (Table 3's baseline: no calibration file) throughout: β = 8 tokens (the end-to-end checks'
        config), the same with DS-Offload's prediction (in a model: from layer l−1's input; on bare tensors it falls
        back to the layer's own query), and a ratio β per KV group with unquantized labels."""
        plain = {"beta": 8, "channel_type": "random"}
        return [
            plain,
            plain | {"offload": True},
            {"beta": 0.1, "channel_type": "random", "gqa": "kv_head", "label_bits": 16, "quantize_query": False},
        ]

    @classmethod
    def model_contract_configs(cls):
        """Plain DS and DS-Offload: the prediction from the previous layer's input only exists in a model."""
        return cls.contract_configs()[:2]

    @classmethod
    def paper_configs(cls):
        """The paper's defaults, and DS-Offload (the next layer's keys predicted and prefetched: a second path)."""
        return {cls.name: {}, f"{cls.name}-offload": {"offload": True}}

    @classmethod
    def system_contract_configs(cls):
        """The label cache (calibrated channels), DS-Offload's predicted prefetch, and it from layer l−1's attention
        input."""
        return {
            "ds": dict(name=cls.name, beta=0.02),
            "ds_offload": dict(name=cls.name, beta=0.02, offload=True),
            "ds_offload_attn_input": dict(
                name=cls.name, beta=0.05, offload=True, offload_input="attn_input", dense_layers=[0]
            ),
        }

    @classmethod
    def static_step_contract_configs(cls):
        """Label scores per KV group in 8 bits, a token count, a budget that grows while decoding (β·n crosses 7
        while n runs over 261..276: budget(n) < budget(capacity) = k_cap in the first steps), and DS-Offload with
        no dense layer (layer 0 has no predecessor: its own query)."""
        return {
            "ds_kv_head_8bit": dict(name=cls.name, beta=0.03, gqa="kv_head", label_bits=8, dense_layers=[0]),
            "ds_token_budget": dict(name=cls.name, beta=7, dense_layers=[1]),
            "ds_budget_grows": dict(name=cls.name, beta=0.0266, gqa="kv_head", label_bits=8, dense_layers=[0]),
            "ds_offload_own_query": dict(name=cls.name, beta=0.05, offload=True, dense_layers=[]),
        }

    @classmethod
    def keep_all_options(cls, n):
        """β = 1.0: ⌊1.0·n⌋ = n tokens, every key."""
        return {"beta": 1.0}

    def validate(self, num_layers=None, context=None):
        super().validate(num_layers, context)
        c = self.config
        if isinstance(c.alpha, bool) or not isinstance(c.alpha, (int, float)) or not 0.0 < float(c.alpha) <= 1.0:
            raise ValueError(f"method.alpha={c.alpha!r}: the channel ratio must lie in (0, 1] (paper default 1/4)")
        if c.label_bits not in LABEL_BITS:
            raise ValueError(f"method.label_bits={c.label_bits!r}; valid: {list(LABEL_BITS)} (16 = not quantized)")
        if c.channel_type not in CHANNEL_TYPES:
            raise ValueError(f"method.channel_type={c.channel_type!r}; valid: {list(CHANNEL_TYPES)}")
        if c.channel_type == "random" and (c.channels is not None or c.channels_file):
            raise ValueError(
                "method.channel_type='random' draws its channels from the run's seed: drop method.channels "
                "/ method.channels_file (or pick a calibrated type: qk, q, k)"
            )
        if c.offload_input not in OFFLOAD_INPUTS:
            raise ValueError(f"method.offload_input={c.offload_input!r}; valid: {list(OFFLOAD_INPUTS)}")
        if not isinstance(c.offload, bool) or not isinstance(c.quantize_query, bool):
            raise ValueError(
                f"method.offload={c.offload!r} / method.quantize_query={c.quantize_query!r}: must be true or false"
            )

    def describe(self) -> str:
        c = self.config
        return f"double_sparsity(alpha={c.alpha}, beta={c.beta}, bits={c.label_bits}{', offload' if c.offload else ''})"

    # -- the report's view of a run's config ---------------------------------------------------------
    @classmethod
    def display(cls, params):
        return "DS-Offload" if params.get("offload") else cls.display_name

    @classmethod
    def index_memory(cls, params, shape, n, sparse_layers, building_rows=False):
        """The label cache: r = α·d channels of every key per query head, float32, and its scores (×2)."""
        alpha = params.get("alpha", 0.25)
        r = max(1, int(alpha * shape.head_dim)) if isinstance(alpha, float) else int(alpha)
        return {"label cache": sparse_layers * shape.heads * n * r * 4 * 2}

    @classmethod
    def label(cls, params):
        """ "α=…, β=…, b-bit, <channels>"."""
        a, b = params.get("alpha"), params.get("beta")
        bits, ch = count_label(params.get("label_bits")), params.get("channel_type")
        return f"α={a:g}, β={budget_label(b)}, {bits}-bit, {ch}"

    @classmethod
    def levels(cls, params, context: float | None) -> tuple[float | None, float | None]:
        """(token sparsity, channel sparsity) of a config.  token: β as a ratio of the context (an int β, the
        authors' heavy_const, over ``context``, the keys of an average row); channel: α · label_bits / 16, the
        label cache's size relative to the K cache (DS §4.2)."""
        a, bits = params.get("alpha"), params.get("label_bits")
        chan = None if a is None or bits is None else float(a) * float(bits) / 16.0
        return budget_level(params.get("beta"), context), chan

    @classmethod
    def level(cls, params, context):
        return cls.levels(params, context)[0]

    @classmethod
    def point_label(cls, params, context):
        """At token = channel sparsity (the paper's "1/16 sparsity"): the level, with the channel type unless qk."""
        tok, chan = cls.levels(params, context)
        if tok is None or chan is None or not math.isclose(tok, min(chan, 1.0), rel_tol=1e-6):
            return None
        ct = params.get("channel_type")
        return fraction_label(tok) + ("" if ct in (None, "qk") else f" {ct}")

    @staticmethod
    def _as_channels(ch: Any) -> torch.Tensor:
        t = torch.as_tensor(ch, dtype=torch.long) if not torch.is_tensor(ch) else ch.long()
        if t.dim() not in (2, 3):
            raise ValueError(
                f"method.channels: expected [layer][head][channels] or [head][channels], got shape {tuple(t.shape)}"
            )
        return t

    def channels_path(self, model_name: str) -> Path | None:
        """The calibration file ``setup`` reads for ``model_name`` (None when the channels need no file)."""
        if self.config.channels is not None or self.config.channel_type == "random":
            return None
        return (
            Path(self.config.channels_file).expanduser()
            if self.config.channels_file
            else default_channels_file(model_name)
        )

    def external_inputs(self, model_name: str) -> dict[str, Any]:
        """The calibration file's sha256 (``missing`` when absent: ``setup`` then refuses, naming the command)."""
        from ..identity.fingerprint import file_sha256

        path = self.channels_path(model_name)
        if path is None:
            return {}
        return {"channels_file_sha256": file_sha256(path) if path.is_file() else "missing"}

    def provenance(self) -> dict[str, Any]:
        """The channel file (path and sha256) or ``method.channels`` the run used."""
        import hashlib

        src = self._channels_source
        out: dict[str, Any] = {"channels_source": src}
        if src and Path(src).exists():
            out["channels_sha256"] = hashlib.sha256(Path(src).read_bytes()).hexdigest()
        if self._calibration is not None:
            out["calibration_text"] = calibration_description(self._calibration)
        return out

    def calibration_text(self):
        """The text the loaded calibration file was computed from, with its content fingerprint (None for
        channels given directly or drawn at random)."""
        from ..identity.overlap import CalibrationText

        if self._calibration is None or self._channels_source is None:
            return None
        cal, path = self._calibration, self._channels_source
        fix = (
            f"calibrate on text the run does not evaluate: {calibration_command(self._model_name)} (WikiText-2 "
            f"validation; add data=<text file> for another) writes the file method=double_sparsity reads first; "
            f"or point method.channels_file at such a file, or use method.channel_type=random"
        )
        return CalibrationText(
            label=f"method=double_sparsity's calibration file {path}",
            description=calibration_description(cal),
            fingerprint=cal.get("text_fingerprint"),
            fix=fix,
        )

    def setup(self, model: Any, model_name: str) -> None:
        """Loads the model's calibrated channels (unless given directly) and, for offload, finds each layer's
        attention module and input norm."""
        from ..models.inspection import attention_modules, head_shape
        from ..models.placement import offloaded_tensor

        shape = head_shape(model.config)
        num_layers, hq, hkv, head_dim = shape.layers, shape.heads, shape.kv_heads, shape.head_dim
        if self.config.channels is None and self.config.channel_type != "random":
            path = self.channels_path(model_name)
            if not path.exists():
                raise FileNotFoundError(
                    f"Double Sparsity needs offline-calibrated channels for model {model_name!r} and found no file at "
                    f"{path}. Make one with:  {calibration_command(model_name)}  (or point method.channels_file at one)"
                )
            rewrite = calibration_command(model_name) + (
                "" if path == default_channels_file(model_name) else f" output={path}"
            )
            chans, meta = load_channels(path, self.config.channel_type, rewrite)
            m = meta.get("model", {})
            got = (m.get("num_layers"), m.get("head_dim"))
            if got != (num_layers, head_dim) or chans.shape[0] != num_layers or chans.shape[1] not in (hq, hkv):
                raise ValueError(
                    f"{path} was calibrated for model {m.get('name')!r} ({m.get('num_layers')} layers, head_dim "
                    f"{m.get('head_dim')}, {chans.shape[1]} heads) but {model_name!r} has {num_layers} layers, "
                    f"head_dim {head_dim}, {hq} query / {hkv} KV heads; recalibrate: {calibration_command(model_name)}"
                )
            self._channels = chans
            self._layer_channel_cache.clear()
            self._channels_source = str(path)
            self._calibration = meta.get("calibration") if isinstance(meta.get("calibration"), dict) else {}
            self._model_name = model_name
        self._model = model
        self._attn = {m.layer_idx: m for m in attention_modules(model)}
        self._norm_w, self._norm_w_on = {}, {}
        if self.config.offload and self.config.offload_input == "residual":
            parents, names = {}, {}
            for name, mod in model.named_modules():
                names[id(mod)] = name
                for child_name, child in mod.named_children():
                    parents[id(child)] = mod
            for idx, attn in self._attn.items():
                norm = getattr(parents.get(id(attn)), "input_layernorm", None)
                w = getattr(norm, "weight", None)
                if w is None:
                    raise ValueError(
                        "method.offload_input='residual' needs each decoder layer's input_layernorm weight "
                        f"(layer {idx} has none); use method.offload_input=attn_input"
                    )
                # a layer offloaded by ``model.device_map`` keeps its weights on meta between calls: its hook's copy
                self._norm_w[idx] = offloaded_tensor(model, f"{names[id(norm)]}.weight")

    # -- channels and labels -------------------------------------------------------------------
    def random_channels(self, layer_idx: int, hkv: int, d: int) -> torch.Tensor:
        """long [Hkv, d]: for each KV head of the layer a uniform random permutation of the d channels (its first r
        are a uniform random r-subset), from a CPU generator seeded by (method.seed, layer): reproducible, and
        independent of the device and of the other layers."""
        key = (int(layer_idx), int(hkv), int(d))
        if key not in self._random:
            gen = torch.Generator(device="cpu").manual_seed(_layer_seed(self.config.seed, layer_idx))
            self._random[key] = torch.stack([torch.randperm(d, generator=gen) for _ in range(hkv)])
        return self._random[key]

    def _layer_channels(self, layer_idx: int, hq: int, hkv: int, d: int, device) -> tuple[torch.Tensor, bool]:
        """long [Hq, r] channels of one layer (query head h), and whether r was floored up to 1; made (checked and
        moved to ``device``) once per layer and shape, then the same tensor every call (no per-step host reads or
        copies)."""
        key = (layer_idx, hq, hkv, d, str(device))
        made = self._layer_channel_cache.get(key)
        if made is None:
            made = self._layer_channel_cache[key] = self._make_layer_channels(layer_idx, hq, hkv, d, device)
        return made

    def _make_layer_channels(self, layer_idx: int, hq: int, hkv: int, d: int, device) -> tuple[torch.Tensor, bool]:
        if self.config.channel_type == "random":
            ch = self.random_channels(layer_idx, hkv, d)
        elif self._channels is None:
            raise ValueError(
                "Double Sparsity has no channels: give method.channels, or run it through the runner, which loads "
                "sparse_eval/calibration/<model>.json (make it with: python -m sparse_eval.calibrate model=<name>)"
            )
        else:
            ch = self._channels
        if ch.dim() == 3:
            if layer_idx >= ch.shape[0]:
                raise ValueError(f"method.channels has {ch.shape[0]} layers; layer {layer_idx} was asked for")
            ch = ch[layer_idx]
        raw = math.floor(float(self.config.alpha) * d + 1e-9)
        r = max(1, raw)
        if ch.shape[-1] < r:
            raise ValueError(
                f"method.channels gives {ch.shape[-1]} channels per head, alpha={self.config.alpha} needs {r}"
            )
        if ch.shape[0] == hkv and hkv != hq:  # per KV head ("k" outliers): each query head uses its group's
            ch = ch.repeat_interleave(hq // hkv, 0)
        if ch.shape[0] != hq:
            raise ValueError(f"method.channels has {ch.shape[0]} heads; the layer has {hq} query / {hkv} KV heads")
        ch = ch[:, :r]
        if int(ch.max()) >= d or int(ch.min()) < 0:
            raise ValueError(f"method.channels: channel indices must lie in 0..{d - 1}")
        return ch.to(device), raw < 1

    def label_channels(self, layer_idx: int, hq: int, hkv: int, d: int) -> torch.Tensor:
        """long [Hl, r] on the host: the channels of one layer per label head.  Per KV head (Hl = Hkv, one label row
        per KV head, as a GQA system stores them) when the channels were given per KV head, else per query head
        (Hl = Hq, the layout of ``select``)."""
        per_query, _ = self._layer_channels(layer_idx, hq, hkv, d, "cpu")
        given = self._channels
        if given is not None and hkv != hq:
            ch = given[layer_idx] if given.dim() == 3 else given
            if ch.shape[0] == hkv:
                return ch[:, : per_query.shape[1]].long()
        return per_query.long()

    def _labels(self, x: torch.Tensor, ch: torch.Tensor, groups: int) -> torch.Tensor:
        """x [B, H, N, D] (H = Hkv for keys, Hq for queries), ch [Hq, r] -> fp32 [B, Hq, N, r]."""
        if x.shape[1] != ch.shape[0]:
            x = x.repeat_interleave(groups, 1)
        idx = ch.view(1, ch.shape[0], 1, ch.shape[1]).expand(x.shape[0], -1, x.shape[2], -1)
        return x.gather(-1, idx).float()

    def _label_cache(self, ctx: AttentionContext, ch: torch.Tensor) -> torch.Tensor:
        """The label cache ``state['ds']['labels']`` fp32 [B, Hq, N, r] (a view of ``state['ds']['buf']``, which has
        room to grow), brought up to date with the keys: only the
        keys that arrived since the last call are labelled (and quantized) and appended (§4.2).  It is rebuilt
        from scratch if the cache no longer matches (fewer keys, other batch, channels or bits)."""
        k = ctx.k
        b, hkv, n, d = k.shape
        bits = self.config.label_bits
        st = ctx.state.get("ds")
        fresh = (
            st is None
            or st["n"] > n
            or st["batch"] != b
            or st["bits"] != bits
            # the same channels object (``_layer_channels`` caches it) needs no device comparison
            or (st["channels"] is not ch and not torch.equal(st["channels"], ch))
            # a state its cache drops with any removal of keys still covers them; else compare on the device
            or (not ctx.state_tracks_cache and st["n"] > 0 and not torch.equal(st["last_key"], k[:, :, st["n"] - 1]))
        )
        if fresh:
            buf = pseudo_quantize(self._labels(k, ch, ctx.groups), bits)
        else:
            buf = st["buf"]
            if st["n"] < n:  # append in place; the buffer grows geometrically (no copy of the whole cache per step)
                if n > buf.shape[2]:
                    grown = buf.new_empty(b, buf.shape[1], max(n, 2 * buf.shape[2]), buf.shape[3])
                    grown[:, :, : st["n"]] = buf[:, :, : st["n"]]
                    buf = grown
                buf[:, :, st["n"] : n] = pseudo_quantize(self._labels(k[:, :, st["n"] :], ch, ctx.groups), bits)
        labels = buf[:, :, :n]
        ctx.state["ds"] = {
            "n": n,
            "batch": b,
            "bits": bits,
            "channels": ch,
            "buf": buf,
            "labels": labels,
            "last_key": k[:, :, n - 1].clone() if n else None,
        }
        return labels

    # -- offload prediction --------------------------------------------------------------------
    def _predicted_query(self, ctx: AttentionContext) -> torch.Tensor | None:
        """Layer l's approximate query from layer l-1's input (DS-Offload §5.1), [B, Hq, Q, D]; None if unknown."""
        layer = ctx.layer_idx
        inputs = ctx.layer_inputs
        if layer == 0 or inputs is None:
            return None
        prev = inputs.get(layer - 1)
        cur = inputs.get(layer)
        attn = self._attn.get(layer)
        if prev is None or cur is None or attn is None:
            return None
        h = prev[0]
        pos = cur[1] if cur[1] is not None else prev[1]
        b, hq, ql, d = ctx.q.shape
        start = ctx.query_offset
        if pos is None or h.shape[0] != b or h.shape[1] < start + ql:
            return None
        # layer l-1's input is on its own device: layer l's query is predicted where layer l runs
        dev = ctx.q.device
        cos, sin = pos[0][:, start : start + ql].to(dev), pos[1][:, start : start + ql].to(dev)
        return self.predict_query(attn, layer, h[:, start : start + ql].to(dev), cos, sin, d)

    def predict_query(
        self, attn: Any, layer_idx: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
    ) -> torch.Tensor | None:
        """DS-Offload's query prediction (§5.1), the one rule both paths use: layer ``layer_idx``'s approximate query
        q̂ = RoPE(q_proj(h)) from h [B, Q, H], layer ``layer_idx − 1``'s attention input (``offload_input`` =
        "attn_input"), or that layer's residual stream divided by its input norm's weight ("residual"); with a
        per-head query norm (Qwen3) before RoPE.  ``attn`` is layer ``layer_idx``'s attention module, cos/sin
        [B, Q, D] the positions' rotary embedding.  Returns [B, Hq, Q, D], or None if the model's module has no
        ``apply_rotary_pos_emb``."""
        rope = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
        if rope is None:
            return None
        if self.config.offload_input == "residual":
            if layer_idx - 1 not in self._norm_w:
                raise ValueError(
                    "DS-Offload with offload_input='residual' needs method.setup(model, ...) first (it "
                    "finds each layer's input norm)"
                )
            w = self._norm_w[layer_idx - 1]
            if w.device != h.device:  # an offloaded layer's weight (kept on the host): copied once per device
                key = (layer_idx - 1, str(h.device))
                w = self._norm_w_on.get(key)
                if w is None:
                    w = self._norm_w_on[key] = self._norm_w[layer_idx - 1].to(h.device)
            h = h / torch.where(w == 0, torch.ones_like(w), w).to(h.dtype)
        b, ql = h.shape[:2]
        q = attn.q_proj(h).view(b, ql, -1, head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3-style per-head query norm before RoPE
            q = attn.q_norm(q)
        q = q.transpose(1, 2)
        q, _ = rope(q, q, cos, sin)
        return q

    @property
    def has_input_norms(self) -> bool:
        """Whether ``setup`` found the layers' input norms (what ``offload_input='residual'`` divides by)."""
        return bool(self._norm_w)

    # -- selection -----------------------------------------------------------------------------
    def _select_with(self, ctx, q, ch, labels, want, kmax=None):
        ql_lab = self._labels(q, ch, ctx.groups)  # [B, Hq, Q, r]
        if self.config.quantize_query:
            ql_lab = pseudo_quantize(ql_lab, self.config.label_bits)
        s_hat = torch.matmul(ql_lab, labels.transpose(-1, -2))  # [B, Hq, Q, N]   (Algorithm 1 line 4)
        if self.config.gqa == "kv_head":
            s_hat = ctx.group_sum(s_hat.masked_fill(~ctx.valid, 0.0))
        s_hat = s_hat.masked_fill(ctx.not_candidates, float("-inf"))
        return topk_mask(s_hat, want, kmax), s_hat  # line 5

    def select(self, ctx: AttentionContext) -> Selection:
        b, hq, ql, d = ctx.q.shape
        ch, ch_floor = self._layer_channels(ctx.layer_idx, hq, ctx.k.shape[1], d, ctx.q.device)
        labels = self._label_cache(ctx, ch)
        tokens = self.budget_tokens(ctx)  # [B, 1, Q, 1]
        tok_floor = (tokens < 1) & (ctx.n_valid > 0)
        want = tokens.clamp_min(1)
        stats: dict[str, Any] = {
            "channels": torch.full((b, hq, ql), float(ch.shape[1]), device=ctx.q.device),
            "one_channel_floor": torch.full((b, hq, ql), float(ch_floor), device=ctx.q.device),
            "one_token_floor": tok_floor.squeeze(-1).float().expand(b, hq, ql).clone(),
        }
        kmax = max(1, token_budget(self.config.beta, ctx.k.shape[2]))  # host bound on want: no device sync
        if not self.config.offload:
            keep, _ = self._select_with(ctx, ctx.q, ch, labels, want, kmax)
            return Selection(keep=keep, stats=stats)
        own, _ = self._select_with(ctx, ctx.q, ch, labels, want, kmax)
        qp = self._predicted_query(ctx)
        if qp is None:
            keep = own
            stats["offload_own_query"] = torch.ones(b, hq, ql, device=ctx.q.device)
        else:
            keep, _ = self._select_with(ctx, qp.to(ctx.q.dtype), ch, labels, want, kmax)
            stats["offload_own_query"] = torch.zeros(b, hq, ql, device=ctx.q.device)
        n_own = own.sum(-1).float()
        stats["offload_recall"] = torch.where(
            n_own > 0, (own & keep).sum(-1).float() / n_own.clamp_min(1), torch.ones_like(n_own)
        )
        return Selection(keep=keep, stats=stats)

    def cost1(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor:
        """α/2 measured: r label channels out of d, on the qKᵀ half of full attention."""
        return sel.stats["channels"] / (2.0 * ctx.q.shape[-1])

    def index_bytes(self, ctx: AttentionContext, sel: Selection) -> torch.Tensor:
        """The label cache of every valid key: n_valid · r · label_bits / 8 bytes per query-head row (the label
        values only; a quantizer's per-token min/scale is not counted).  With ``offload`` the labels are read
        once, for the predicted query (the own query's selection is only measured for ``offload_recall``).  The
        chosen tokens' K and V are added by the core."""
        return ctx.n_valid.squeeze(-1).to(torch.float32) * sel.stats["channels"] * (self.config.label_bits / 8.0)
