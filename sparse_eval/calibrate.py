"""Offline channel calibration for Double Sparsity (DS §4.1):  ``python -m sparse_eval.calibrate model=NAME``.

The model runs over calibration text in blocks of ``block_size`` tokens: the first ``num_blocks`` (default 256,
as the authors: 256 x 512-token blocks of Pile validation text).  The text is by default the WikiText-2
*validation* split (``data=wikitext2_validation``): ``paths.data_dir/wikitext-2-tokenized/valid.txt`` when the
folder has it (the tokenized release, rare words as ``<unk>``), else the hub's ``Salesforce/wikitext``
``wikitext-2-raw-v1`` validation split through ``datasets`` (``source=`` auto | local | hub picks); or any text file
(``data=<path>``).  Never the test split, which the wikitext task evaluates: a run whose evaluated text overlaps
the calibration text is refused (``identity.overlap``).  For every layer and head, the channels are ranked by
the mean over all tokens of

    qk:  |q_c · k_c|   of each token's query with its own key (the authors' "Method 1"; the paper's choice),
    q:   |q_c|         (per query head),          k:  |k_c|   (per KV head),

where, following the authors' calibration script, q and k are taken *after* RoPE for ``qk`` (the keys the
label cache is cut from are the rotated ones) and as the q_proj / k_proj outputs, *before* RoPE, for ``q`` and
``k`` (``rope=authors``; ``rope=after`` / ``rope=before`` take all three on one side).  With GQA each query head
is paired with its KV head for ``qk``.  Sums are accumulated in float64, ties keep the lower channel first, and
the file has no time stamp, so the output is a deterministic function of (model, text, settings).

The file (JSON) records the model's name and shape, the data (origin and sha256; ``text``: dataset, split,
variant, origin), the number of tokens and blocks, a content fingerprint of the text those tokens decode to
(``text_fingerprint``, ``sparse_eval.identity.overlap.fingerprint``), the settings, the command, and for each statistic
the channel order [layer][head][channel] (best first) and the mean values.  It is written to ``output`` or, by
default, to the user's calibration folder (``$SPARSE_EVAL_CALIBRATION_DIR``, else
``$XDG_DATA_HOME/sparse_eval/calibration``, else ``~/.local/share/sparse_eval/calibration``), never into the
installed package, and the path is printed.
``Method.setup`` of ``double_sparsity`` reads ``method.channels_file`` when given, else the first
``<model.name>.json`` of: the user's folder, then the files shipped in ``sparse_eval/calibration/``.  The file's
sha256 is part of the run's identity, so recalibrating gives new run directories.
"""

from __future__ import annotations

import hashlib
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore

from .config import CONF_DIR, PathsConfig, register_configs, to_plain
from .methods.double_sparsity import calibration_dirs, user_calibration_dir
from .models.inspection import head_shape
from .models.loading import ModelConfig, load_model, max_context
from .models.placement import main_device

FORMAT = "sparse_eval.double_sparsity.channels/1"
VALIDATION = "wikitext2_validation"  # the default calibration text
LOCAL_VALIDATION = "wikitext-2-tokenized/valid.txt"  # under paths.data_dir (the tokenized release, with <unk>)
SOURCES = ("auto", "local", "hub")
REMOVED_DATA = {  # earlier values of `data`: both were the WikiText-2 test split, which the wikitext task evaluates
    "bundled": "the WikiText-2 test head shipped in sparse_eval/data",
    "local": "paths.data_dir/wikitext-2-raw/wikitext-test.txt, the WikiText-2 test split",
}
ROPE_MODES = {  # which side of RoPE each statistic is taken on
    "authors": {"qk": "after", "q": "before", "k": "before"},
    "after": {"qk": "after", "q": "after", "k": "after"},
    "before": {"qk": "before", "q": "before", "k": "before"},
}


@dataclass
class CalibrateConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # wikitext2_validation (WikiText-2 validation, from paths.data_dir or the hub, see `source`) | a text file
    data: str = VALIDATION
    # for data=wikitext2_validation: auto (paths.data_dir/wikitext-2-tokenized/valid.txt if there, else the hub) |
    # local | hub (datasets: Salesforce/wikitext, wikitext-2-raw-v1, split validation)
    source: str = "auto"
    block_size: int = 512  # tokens per forward (authors: 512); at most the model's context
    num_blocks: int | None = 256  # the first blocks of the text (authors: 256); null: every whole block
    rope: str = "authors"  # authors (qk after RoPE, q/k before) | after | before
    output: str | None = None  # null: <user calibration folder>/<model.name>.json (see user_calibration_dir)
    paths: PathsConfig = field(default_factory=PathsConfig)


def load_text(data: str, data_dir: str | None, source: str = "auto") -> tuple[str, dict[str, Any]]:
    """Returns (text, where it came from: {dataset, split, variant, origin}).  ``data``: ``wikitext2_validation``
    (``source``: auto | local | hub) or the path of a text file."""
    from .tasks.base import from_hub
    from .tasks.wikitext import HUB_CONFIG, HUB_ID, WikitextConfig
    from .tasks.wikitext import load_text as wikitext_text

    if data in REMOVED_DATA:
        raise ValueError(
            f"data={data!r} ({REMOVED_DATA[data]}) is no longer a calibration text: the wikitext task "
            f"evaluates that split. Use data={VALIDATION} (the default) or data=<path of a text file>"
        )
    if data != VALIDATION:
        p = Path(data).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"data={data!r}: not {VALIDATION!r} nor an existing text file")
        return wikitext_text(WikitextConfig(path=str(p)), None)[0], {
            "dataset": None,
            "split": None,
            "origin": f"file:{p.name}",
        }
    if source not in SOURCES:
        raise ValueError(f"source={source!r}; valid: {list(SOURCES)}")
    local = Path(data_dir).expanduser() / LOCAL_VALIDATION if data_dir else None
    if source in ("auto", "local") and local is not None and local.is_file():
        return local.read_text(encoding="utf-8").replace("\r\n", "\n"), {
            "dataset": "WikiText-2",
            "split": "validation",
            "variant": "wikitext-2-v1 tokenized release (rare words as <unk>), pytorch/examples word_language_model",
            "origin": f"local:{LOCAL_VALIDATION}",
        }
    if source == "local":
        raise FileNotFoundError(
            f"source=local but {local if local else 'paths.data_dir (unset)'} is not a file; set "
            f"paths.data_dir to a folder holding {LOCAL_VALIDATION}, or use source=hub"
        )
    with from_hub(
        f"data={VALIDATION}",
        f"{HUB_ID}/{HUB_CONFIG} validation",
        local if local is not None else f"<paths.data_dir>/{LOCAL_VALIDATION}",
        "or calibrate on a text file: data=<path>",
    ):
        import datasets

        ds = datasets.load_dataset(HUB_ID, HUB_CONFIG, split="validation")
    return "\n\n".join(ds["text"]), {
        "dataset": "WikiText-2",
        "split": "validation",
        "variant": f"{HUB_CONFIG} (raw)",
        "origin": f"hub:{HUB_ID}/{HUB_CONFIG}:validation",
    }


def _rope_fn(attn: Any):
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(
            f"{type(attn).__name__}: its module has no apply_rotary_pos_emb; calibration supports RoPE models"
        )
    return fn


@torch.no_grad()
def channel_statistics(
    model: Any, blocks: list[torch.Tensor], rope: str = "authors", progress: bool = False
) -> dict[str, torch.Tensor]:
    """Mean |q∘k|, |q|, |k| per layer, head and channel over every token of ``blocks`` (each long [1, T]);
    ``progress``: a progress bar with the time left, one step per block.

    Returns {"qk": [L, Hq, D], "q": [L, Hq, D], "k": [L, Hkv, D]} (float64).
    """
    from tqdm.auto import tqdm

    from .models.inspection import attention_modules

    if rope not in ROPE_MODES:
        raise ValueError(f"rope={rope!r}; valid: {list(ROPE_MODES)}")
    side = ROPE_MODES[rope]
    mods = sorted(attention_modules(model), key=lambda m: m.layer_idx)
    sums: dict[int, dict[str, torch.Tensor]] = {}
    counts: dict[int, int] = {}

    def hook(mod, args, kwargs):
        h = kwargs.get("hidden_states", args[0] if args else None)
        pos = kwargs.get("position_embeddings")
        if pos is None:
            raise ValueError(f"{type(mod).__name__} got no position_embeddings; calibration needs a RoPE model")
        b, t, _ = h.shape
        d = mod.head_dim
        q = mod.q_proj(h).view(b, t, -1, d)
        k = mod.k_proj(h).view(b, t, -1, d)
        if hasattr(mod, "q_norm"):
            q = mod.q_norm(q)
        if hasattr(mod, "k_norm"):
            k = mod.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # [B, H, T, D]
        qr, kr = _rope_fn(mod)(q, k, *pos)
        pick = {"before": (q, k), "after": (qr, kr)}
        g = q.shape[1] // k.shape[1]
        qq, kk = pick[side["qk"]]
        stats = {
            "qk": (qq.double() * kk.double().repeat_interleave(g, 1)).abs().sum((0, 2)),
            "q": pick[side["q"]][0].double().abs().sum((0, 2)),
            "k": pick[side["k"]][1].double().abs().sum((0, 2)),
        }
        acc = sums.setdefault(mod.layer_idx, {})
        for key, val in stats.items():
            acc[key] = acc[key] + val if key in acc else val
        counts[mod.layer_idx] = counts.get(mod.layer_idx, 0) + b * t

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mods]
    try:
        device = main_device(model)  # the input embeddings' device (``model.device_map``: its first GPU)
        for ids in tqdm(
            blocks, desc="calibration forwards", unit="block", disable=not progress, leave=False, dynamic_ncols=True
        ):
            model(input_ids=ids.to(device), use_cache=False)
    finally:
        for hd in handles:
            hd.remove()
    layers = sorted(sums)
    dev = sums[layers[0]]["qk"].device  # each layer's sums are on its device (``model.device_map``): gathered here
    return {key: torch.stack([(sums[l][key] / counts[l]).to(dev) for l in layers]) for key in ("qk", "q", "k")}


def rank_channels(score: torch.Tensor) -> torch.Tensor:
    """[..., D] -> long [..., D]: channel indices by decreasing score (ties: lower index first)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def calibrate(
    model: Any,
    tokenizer: Any,
    text: str,
    *,
    model_name: str,
    model_path: str = "",
    data_origin: str = "",
    text_info: dict[str, Any] | None = None,
    block_size: int = 512,
    num_blocks: int | None = None,
    rope: str = "authors",
    command: str = "",
    progress: bool = False,
) -> dict[str, Any]:
    """Runs the calibration and returns the file's content (a JSON-ready dict).  ``text_info``: where ``text`` came
    from (dataset, split, variant, origin), recorded with a content fingerprint of the tokens used; ``progress``: a
    progress bar."""
    import transformers

    from .identity.overlap import fingerprint

    if block_size < 2:
        raise ValueError(f"block_size={block_size}: must be >= 2")
    if num_blocks is not None and num_blocks < 1:
        raise ValueError(f"num_blocks={num_blocks}: must be >= 1 or null (all)")
    ids = tokenizer(text, add_special_tokens=True, verbose=False)["input_ids"]
    total = len(ids) // block_size
    if total == 0:
        raise ValueError(f"the calibration text has {len(ids)} tokens, fewer than one block (block_size={block_size})")
    nb = total if num_blocks is None else min(total, num_blocks)
    t = torch.tensor(ids[: nb * block_size], dtype=torch.long)
    used = tokenizer.decode(t.tolist(), skip_special_tokens=True)  # the text the statistics saw
    blocks = [t[i * block_size : (i + 1) * block_size].unsqueeze(0) for i in range(nb)]
    scores = channel_statistics(model, blocks, rope, progress=progress)
    shape = head_shape(model.config)
    return {
        "format": FORMAT,
        "model": {
            "name": model_name,
            "path": model_path,
            "num_layers": shape.layers,
            "num_heads": shape.heads,
            "num_kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        },
        "calibration": {
            "command": command,
            "data": data_origin,
            "data_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "text": {
                **{"dataset": None, "split": None, "origin": data_origin},
                **(text_info or {}),
                "used": f"its first {nb * block_size} tokens (the whole text tokenized once, with the "
                f"tokenizer's special tokens)",
                "decoded_characters": len(used),
                "decoded_sha256": hashlib.sha256(used.encode("utf-8")).hexdigest(),
            },
            "tokens": nb * block_size,
            "blocks": nb,
            "block_size": block_size,
            "text_fingerprint": fingerprint(used),
            "rope": ROPE_MODES[rope] | {"mode": rope},
            "statistic": {
                "qk": "mean over tokens of |q_c * k_c| (token with itself), per query head",
                "q": "mean over tokens of |q_c|, per query head",
                "k": "mean over tokens of |k_c|, per KV head",
            },
            "software": {"torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
        },
        "channels": {key: rank_channels(val).tolist() for key, val in scores.items()},
        "scores": {
            key: [[[float(f"{x:.6g}") for x in head] for head in layer] for layer in val.tolist()]
            for key, val in scores.items()
        },
    }


def dumps(result: dict[str, Any]) -> str:
    """JSON with one line per head (innermost number lists inlined)."""
    text = json.dumps(result, indent=1)
    compact = re.sub(r"\[([^\[\]{}\"]*)\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    return (compact if json.loads(compact) == result else text) + "\n"


def write(result: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(result), encoding="utf-8")
    return path


def run(cfg: Any, command: str = "") -> Path:
    model_cfg = ModelConfig(**to_plain(cfg.model))
    if cfg.rope not in ROPE_MODES:
        raise ValueError(f"rope={cfg.rope!r}; valid: {list(ROPE_MODES)}")
    if cfg.source not in SOURCES:
        raise ValueError(f"source={cfg.source!r}; valid: {list(SOURCES)}")
    text, info = load_text(cfg.data, cfg.paths.data_dir, cfg.source)
    model, tokenizer = load_model(model_cfg)
    context = max_context(model_cfg, model)
    if cfg.block_size > context:
        raise ValueError(f"block_size={cfg.block_size} exceeds the model's context ({context} tokens)")
    result = calibrate(
        model,
        tokenizer,
        text,
        model_name=model_cfg.name,
        model_path=model_cfg.path,
        data_origin=info["origin"],
        text_info=info,
        block_size=cfg.block_size,
        num_blocks=cfg.num_blocks,
        rope=cfg.rope,
        command=command,
        progress=True,
    )
    out = Path(cfg.output).expanduser() if cfg.output else user_calibration_dir() / f"{model_cfg.name}.json"
    write(result, out)
    c = result["calibration"]
    what = " ".join(str(info[k]) for k in ("dataset", "split") if info.get(k))
    print(
        f"wrote {out.resolve()}: {result['model']['num_layers']} layers, {c['tokens']} tokens "
        f"({c['blocks']} x {c['block_size']}) of {what + ' ' if what else ''}{c['data']}"
    )
    if not cfg.output:
        print(
            f"method=double_sparsity model={model_cfg.name} reads it (search order: "
            f"{', '.join(str(d) for d in calibration_dirs())})"
        )
    return out


register_configs()
ConfigStore.instance().store(name="calibrate_schema", node=CalibrateConfig)


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="calibrate")
def main(cfg) -> None:
    from hydra.core.hydra_config import HydraConfig

    overrides = list(HydraConfig.get().overrides.task)
    command = " ".join(["python -m sparse_eval.calibrate", *overrides])
    from .cli import EXIT_USAGE, fail

    try:
        run(cfg, command)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc), EXIT_USAGE)  # one line, exit status 2, nothing left under paths.runs_dir


if __name__ == "__main__":
    from .cli import hydra_entry

    hydra_entry(main)  # Hydra's errors as one line, exit status 2 (sparse_eval.cli)
