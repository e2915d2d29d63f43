"""Loading a causal LM and its tokenizer: a hub id, a local directory, a GGUF file, or the shipped model; and
what identifies the loaded model in a run (``model_identity``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch

log = logging.getLogger("sparse_eval")

BUILTIN_DIR = Path(__file__).resolve().parent
MODEL_CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"
# files of a local checkpoint that decide its outputs (weights, architecture, tokenizer)
MODEL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "*.safetensors",
    "*.bin",
)
BUILTIN_PREFIX = "builtin:"
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype besides auto (torch dtypes of the same names)
# where the model is placed over several devices: no part of a run's identity (``model_identity``)
PLACEMENT_FIELDS = ("device_map", "max_memory", "offload_folder")


@dataclass
class ModelConfig:
    """`conf/model/*.yaml`.  ``path``: a hub id, a local directory, or ``builtin:stories260K``."""

    name: str = "stories260k"
    path: str = "builtin:stories260K"
    gguf_file: str | None = None  # file name inside ``path`` (a directory) for GGUF checkpoints
    dtype: str = "auto"  # auto (bfloat16 on CUDA, float32 on CPU) | float32 | bfloat16 | float16
    device: str = "auto"  # auto (cuda when present) | cpu | cuda | cuda:N
    max_context: int | None = None  # defaults to the model's max_position_embeddings
    revision: str | None = None
    trust_remote_code: bool = False
    how_to_get: str = ""  # shown when a local path is missing
    # the tokenizer from elsewhere (a hub id or a local folder) instead of the checkpoint's own (e.g. the model's
    # own tokenizer for a GGUF whose tokenizer this transformers builds wrong); None: the checkpoint's
    tokenizer: str | None = None
    # check a GGUF's tokenizer against its own vocabulary at load (``tokenizer_check``); false runs it unchecked
    # and records "checked_against": "off" in the run's identity
    check_tokenizer: bool = True
    # the model over several devices (``models.placement``; a model larger than one GPU, e.g. Llama-3.1-70B): an
    # accelerate strategy (auto | balanced | balanced_low_0 | sequential) or an explicit {module name: device} map
    # (device: N or cuda:N, cpu, disk; cpu/disk hold offloaded weights run on the map's first GPU); null: the whole
    # model on ``device`` (which must then stay auto).  ``max_memory`` bounds a strategy per device ({0: 70GiB,
    # cpu: 200GiB}); ``offload_folder`` keeps the weights of modules mapped to disk.  None of the three enters a
    # run's identity: the records are those of the model on one device (docs/device_map.md)
    device_map: Any = None
    max_memory: Any = None
    offload_folder: str | None = None


def resolve_device(device: str) -> "torch.device":
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    valid = ["auto", "cpu"] + (["cuda", "cuda:N"] if torch.cuda.is_available() else [])
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise ValueError(
            f"model.device={device!r} is not a device this package runs on; valid here: {valid} "
            f"(auto: CUDA when present, else the CPU)"
        )
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"model.device={device!r} but CUDA is not available; valid here: 'auto', 'cpu'")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(
            f"model.device={device!r}: this machine has {torch.cuda.device_count()} CUDA device(s); "
            f"valid here: cuda:0..cuda:{torch.cuda.device_count() - 1}"
        )
    return dev


def resolve_placement(cfg: ModelConfig) -> tuple["torch.device", Any, Any]:
    """(the device that decides ``dtype=auto`` and holds the model's inputs, the checked device map or None, its
    max_memory or None): ``model.device`` resolved (``resolve_device``) without a map; with ``model.device_map``
    (``placement.check_device_map``) cuda:0 when the map computes on a GPU, else the CPU.  Raises the one-line
    ValueError of a bad value or of ``model.device`` and ``model.device_map`` both set."""
    import torch

    from .placement import check_device_map, map_uses_cuda

    device_map, max_memory = check_device_map(cfg.device, cfg.device_map, cfg.max_memory, cfg.offload_folder)
    if device_map is None:
        return resolve_device(cfg.device), None, None
    return torch.device("cuda:0" if map_uses_cuda(device_map) else "cpu"), device_map, max_memory


def resolve_dtype(dtype: str, device: "torch.device") -> "torch.dtype":
    import torch

    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype={dtype!r}; valid: {['auto', *DTYPES]}")
    return getattr(torch, dtype)


def resolve_path(cfg: ModelConfig) -> str:
    """A local directory or a hub id; refuses a missing local path with a message that says how to get it."""
    p = cfg.path
    if p.startswith(BUILTIN_PREFIX):
        local = BUILTIN_DIR / p[len(BUILTIN_PREFIX) :]
        if not (local / "config.json").exists():
            valid = sorted(d.name for d in BUILTIN_DIR.iterdir() if (d / "config.json").exists())
            raise FileNotFoundError(f"model.path={p!r}: no shipped model there; shipped models: {valid}")
        return str(local)
    local = Path(p).expanduser()
    if local.exists() or p.startswith((".", "/", "~")):
        target = local / cfg.gguf_file if cfg.gguf_file else local
        if not target.exists():
            hint = f" To get it: {cfg.how_to_get}" if cfg.how_to_get else ""
            raise FileNotFoundError(f"model.path: {target} does not exist.{hint}")
        if not cfg.gguf_file and local.is_dir() and not (local / "config.json").is_file():
            ggufs = sorted(f.name for f in local.glob("*.gguf"))
            fix = (
                f"give model.gguf_file={ggufs[0]}" + (f" (one of {ggufs})" if len(ggufs) > 1 else "")
                if ggufs
                else "give a folder holding a checkpoint (config.json, weights, tokenizer), a hub id, or "
                "model=NAME of conf/model"
            )
            raise FileNotFoundError(f"model.path={p!r} is not a model checkpoint: {local} has no config.json; {fix}")
        return str(local)
    return p  # a hub id


def _load_error(cfg: ModelConfig, exc: BaseException, what: str = "the model") -> FileNotFoundError:
    """One line for a checkpoint that transformers could not load, naming ``model.path`` and how to get it."""
    reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
    hint = cfg.how_to_get or (
        f"Download it once (huggingface-cli download {cfg.path} --local-dir DIR) and set "
        f"model.path=DIR, or check the hub id"
    )
    return FileNotFoundError(f"model.path={cfg.path!r}: cannot load {what} ({reason}). {hint}")


def load_config(cfg: ModelConfig) -> Any:
    """The model's config (``AutoConfig``) alone, without its weights: what a sweep's preflight checks jobs
    against.  Raises the one-line error ``load_model`` raises for a path it cannot load."""
    from transformers import AutoConfig

    path = resolve_path(cfg)
    kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except (OSError, ValueError) as exc:
        raise _load_error(cfg, exc, "its config") from None


def quiet_bpe_cleanup(tokenizer: Any) -> None:
    """transformers ignores ``clean_up_tokenization_spaces=True`` for a BPE tokenizer (the clean-up is meant for
    WordPiece and would strip spaces before punctuation) and warns at the first decode of every run; set it to
    False there, which decodes the same text without the warning.  Other tokenizers are left as they are."""
    try:
        bpe = type(tokenizer.backend_tokenizer.model).__name__ == "BPE"
    except AttributeError:  # a slow (Python) tokenizer: it applies the clean-up and does not warn
        return
    forced = getattr(tokenizer, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
    if bpe and not forced and getattr(tokenizer, "clean_up_tokenization_spaces", False):
        tokenizer.clean_up_tokenization_spaces = False


# the attribute of a loaded tokenizer that says what ``load_model`` checked it against (``tokenizer_identity``)
TOKENIZER_CHECK_ATTR = "sparse_eval_checked_against"


def load_tokenizer(cfg: ModelConfig) -> Any:
    """The run's tokenizer: ``model.tokenizer`` when given, else the checkpoint's own; a GGUF checkpoint's is
    checked against the GGUF's own vocabulary (``tokenizer_check.check_gguf_tokenizer``: a tokenizer that
    segments the canary text otherwise is refused with the fix) unless ``model.check_tokenizer=false``.  What it
    was checked against is kept on the tokenizer (``TOKENIZER_CHECK_ATTR``) for the run's identity."""
    from transformers import AutoTokenizer

    from .tokenizer_check import check_gguf_tokenizer

    path = resolve_path(cfg)
    kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code}
    source = path
    if cfg.tokenizer:
        source = str(Path(cfg.tokenizer).expanduser()) if Path(cfg.tokenizer).expanduser().exists() else cfg.tokenizer
        kw = {"trust_remote_code": cfg.trust_remote_code}
    elif cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kw)
    except (OSError, ValueError) as exc:  # not on disk, not on the hub, or no tokenizer there: one line
        if cfg.tokenizer:
            reason = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            raise FileNotFoundError(
                f"model.tokenizer={cfg.tokenizer!r}: cannot load a tokenizer there ({reason}); give a hub id or a "
                f"folder holding tokenizer files, or drop model.tokenizer to use the checkpoint's own"
            ) from None
        raise _load_error(cfg, exc, "the model" if isinstance(exc, OSError) else "its tokenizer") from None
    if not cfg.gguf_file:
        checked = "not gguf"
    elif not cfg.check_tokenizer:
        checked = "off"
        log.warning("model.check_tokenizer=false: the tokenizer of %s is not checked against its GGUF", cfg.name)
    else:
        t0 = time.perf_counter()
        log.info("checking the tokenizer against the vocabulary of %s (a canary text, both ways)", cfg.gguf_file)
        checked = check_gguf_tokenizer(tokenizer, Path(path) / cfg.gguf_file, cfg.name)
        log.info("tokenizer checked in %.1f s", time.perf_counter() - t0)
    setattr(tokenizer, TOKENIZER_CHECK_ATTR, checked)
    return tokenizer


def load_model(cfg: ModelConfig, attn_implementation: str = "sdpa") -> tuple[Any, Any]:
    """Returns (model in eval mode on its device, or dispatched over ``model.device_map``'s devices by
    accelerate, tokenizer (``load_tokenizer``: checked before the weights load))."""
    from transformers import AutoModelForCausalLM

    device, device_map, max_memory = resolve_placement(cfg)
    dtype = resolve_dtype(cfg.dtype, device)
    path = resolve_path(cfg)
    # no hub kernels: transformers >= 5.2x swaps layers (RoPE, activations) for kernels fetched from the hub when the
    # `kernels` package is installed and the model is placed on a GPU at load (a device map), which needs the network
    # and runs kernels this package has not checked for batch invariance
    kw: dict[str, Any] = {"revision": cfg.revision, "trust_remote_code": cfg.trust_remote_code, "use_kernels": False}
    if cfg.gguf_file:
        kw["gguf_file"] = cfg.gguf_file
    if device_map is not None:
        kw["device_map"] = device_map
        if max_memory is not None:
            kw["max_memory"] = max_memory
        if cfg.offload_folder:
            kw["offload_folder"] = str(Path(cfg.offload_folder).expanduser())
    t0 = time.perf_counter()
    log.info(
        "loading the model %s from %s%s (%s, on %s)",
        cfg.name,
        path,
        f"/{cfg.gguf_file}: the GGUF is dequantised" if cfg.gguf_file else "",
        dtype if isinstance(dtype, str) else str(dtype).replace("torch.", ""),
        device_map if device_map is not None else device,
    )
    tokenizer = load_tokenizer(cfg)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation, **kw)
    except (OSError, ValueError) as exc:  # not on disk, not on the hub, not a causal LM: one line naming model.path
        if device_map is not None and "offload" in str(exc):  # a strategy that spilled modules to disk
            raise ValueError(
                f"model.device_map={cfg.device_map!r} does not fit the devices' memory without disk offload; give "
                f"model.offload_folder=DIR, or raise model.max_memory ({str(exc).strip().splitlines()[0][:160]})"
            ) from None
        raise _load_error(cfg, exc) from None
    quiet_bpe_cleanup(tokenizer)
    if device_map is None:
        model.to(device)
    model.eval()
    log.info("model loaded in %.1f s", time.perf_counter() - t0)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return model, tokenizer


def max_context(cfg: ModelConfig, model: Any) -> int:
    if cfg.max_context:
        return int(cfg.max_context)
    return int(getattr(model.config.get_text_config(), "max_position_embeddings", 4096))


# -- run identity ---------------------------------------------------------------------------------------------


def named_config(name: str, paths: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """The ``conf/model/<name>.yaml`` a model name refers to (None when the name is a free label), its
    interpolations (``${paths.models_dir}``) resolved against ``paths``."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    path = MODEL_CONF_DIR / f"{name}.yaml"
    if not path.is_file():
        return None
    node = OmegaConf.load(path)
    try:
        node = OmegaConf.to_container(OmegaConf.create({"paths": dict(paths or {}), "model": node}), resolve=True)[
            "model"
        ]
    except OmegaConfBaseException:
        node = OmegaConf.to_container(node, resolve=False)
    node.pop("defaults", None)
    return node


def model_label(cfg: ModelConfig, paths: dict[str, Any] | None = None) -> str:
    """The name results are filed under.  ``model.name`` when it is a free label or when ``model.path`` and
    ``model.gguf_file`` are those of ``conf/model/<name>.yaml``; a ``path`` (or GGUF file) overridden under a
    shipped config's name is recorded as what was loaded: the label is made from the path's last part and the
    GGUF file's stem (e.g. ``model.path=/m/SmolLM2 model.gguf_file=q8.gguf`` under ``model=stories260k`` files
    its results under ``SmolLM2-q8``), with a warning."""
    conf = named_config(cfg.name, paths)
    if conf is None or (conf.get("path"), conf.get("gguf_file")) == (cfg.path, cfg.gguf_file):
        return cfg.name
    base = cfg.path[len(BUILTIN_PREFIX) :] if cfg.path.startswith(BUILTIN_PREFIX) else cfg.path
    label = Path(base.rstrip("/")).name or base
    if cfg.gguf_file:
        label += f"-{Path(cfg.gguf_file).stem}"
    label = label.replace("/", "_")
    log.warning(
        "model.path=%s%s is not what conf/model/%s.yaml loads (%s); results are filed under model %r "
        "(set model.name to choose another label)",
        cfg.path,
        f" model.gguf_file={cfg.gguf_file}" if cfg.gguf_file else "",
        cfg.name,
        conf.get("path"),
        label,
    )
    return label


def model_files(cfg: ModelConfig) -> list[Path]:
    """The local files the model is loaded from (the GGUF file alone, which holds config and tokenizer; else the
    checkpoint folder's ``MODEL_FILE_PATTERNS``); [] for a hub id."""
    path = resolve_path(cfg)
    local = Path(path)
    if not local.exists():
        return []
    if cfg.gguf_file:
        return [local / cfg.gguf_file]
    if local.is_file():
        return [local]
    return sorted({f for pat in MODEL_FILE_PATTERNS for f in local.glob(pat) if f.is_file()})


_VOLATILE_CONFIG_KEYS = ("transformers_version", "dtype", "torch_dtype", "attn_implementation", "use_cache")


def config_fingerprint(model: Any) -> str:
    """sha256 of the loaded model's architecture config (without paths, dtype, the attention implementation and
    the transformers version, which do not change the weights' function)."""
    d = model.config.to_dict()
    d = {k: v for k, v in d.items() if not k.startswith("_") and k not in _VOLATILE_CONFIG_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


def model_identity(
    cfg: ModelConfig, model: Any, paths: dict[str, Any] | None = None, tokenizer: Any = None
) -> dict[str, Any]:
    """What identifies the loaded model in a run's identity (its run directory's hash and its records): the
    path or hub id, revision, GGUF file and the dtype actually used, the fingerprint of its config and, when it
    is local, of its files (sha256 each, cached by path, size and mtime: ``sparse_eval.identity.fingerprint``); for a
    hub id the hub's commit of the files when transformers reports it; and the tokenizer's behaviour
    (``tokenizer_check.tokenizer_identity``: its ids of the canary text, and what it was checked against), since
    one file under two transformers versions can tokenize two ways.  ``name`` is the label results are filed
    under (``model_label``; ``paths``: the run's ``paths`` config, for the model configs' interpolations).
    ``model.tokenizer`` and ``model.check_tokenizer`` enter only when set away from their defaults.  Where the model
    is placed (``model.device``, ``model.device_map``, ``model.max_memory``, ``model.offload_folder``) does not
    enter beyond ``device`` as configured: a map's records are those of the model on one device
    (``models.placement``; ``tests/models/test_device_map.py``), as a batch's are those of its samples alone."""
    from ..identity.fingerprint import combined_sha256, files_sha256
    from .tokenizer_check import tokenizer_identity

    out = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("how_to_get", *PLACEMENT_FIELDS)}
    for key, default in (("tokenizer", None), ("check_tokenizer", True)):
        if out.get(key) == default:
            out.pop(key)
    out["name"] = model_label(cfg, paths)
    if out["name"] != cfg.name:
        out["given_name"] = cfg.name
    out["dtype"] = str(next(model.parameters()).dtype).replace("torch.", "")
    fp: dict[str, Any] = {"config_sha256": config_fingerprint(model)}
    files = model_files(cfg)
    if files:
        fp["files_sha256"] = combined_sha256(files_sha256(files))
    else:
        fp["hub_commit"] = getattr(model.config, "_commit_hash", None)
    if tokenizer is not None:
        fp["tokenizer"] = tokenizer_identity(tokenizer, getattr(tokenizer, TOKENIZER_CHECK_ATTR, "not checked"))
    out["fingerprint"] = fp
    return out
