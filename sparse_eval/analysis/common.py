"""Shared pieces of the analyses: options, model and text loading, output files and figures."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from ..models.loading import ModelConfig, load_model, max_context

REPO_CONF = Path(__file__).resolve().parents[2] / "conf"
TEXT_SOURCES = ("bundled", "local")


# -- options ------------------------------------------------------------------------------------------------


def model_config(name: str = "stories260k", overrides: Mapping[str, Any] | None = None) -> ModelConfig:
    """``conf/model/<name>.yaml`` (as ``python -m sparse_eval model=<name>`` reads it) with ``overrides``."""
    from omegaconf import OmegaConf

    path = REPO_CONF / "model" / f"{name}.yaml"
    if not path.exists():
        valid = sorted(p.stem for p in (REPO_CONF / "model").glob("*.yaml"))
        raise ValueError(f"model={name!r}: no conf/model/{name}.yaml; valid: {valid}")
    from ..config import PathsConfig

    # resolve ${paths.*} as the app does (e.g. SmolLM2's path under paths.models_dir)
    root = OmegaConf.create({"paths": dataclasses.asdict(PathsConfig()), "model": OmegaConf.load(path)})
    node = OmegaConf.to_container(root, resolve=True)["model"]
    node.pop("defaults", None)
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    node = {k: v for k, v in node.items() if k in fields}
    for key, val in (overrides or {}).items():
        if key not in fields:
            raise ValueError(f"model.{key}: unknown model option; valid: {sorted(fields)}")
        node[key] = val
    return ModelConfig(**node)


@dataclass
class TextOptions:
    """What every analysis reads and where it writes: its text (``load_text``) and its output folder."""

    text: str = "bundled"  # bundled | local (paths.data_dir); text_path overrides
    text_path: str | None = None
    data_dir: str | None = None  # paths.data_dir
    out: str | None = None  # output folder; null: analysis/<name>/<model>

    def load_text(self) -> tuple[str, str]:
        return load_text(self.text, self.data_dir, self.text_path)


# -- model and text -----------------------------------------------------------------------------------------


def load(model: ModelConfig) -> tuple[Any, Any, int]:
    """(model in eval mode, tokenizer, usable context)."""
    m, tok = load_model(model)
    return m, tok, max_context(model, m)


def load_text(source: str = "bundled", data_dir: str | None = None, path: str | None = None) -> tuple[str, str]:
    """Analysis text: ``path`` if given; ``bundled`` (the WikiText-2 head shipped in the package) or ``local``
    (``paths.data_dir``/wikitext-2-raw/wikitext-test.txt), read as the wikitext task reads them.
    Returns (text, where it came from)."""
    from ..tasks.wikitext import WikitextConfig
    from ..tasks.wikitext import load_text as wikitext_text

    if not path and source not in TEXT_SOURCES:
        raise ValueError(f"text={source!r}; valid: {list(TEXT_SOURCES)} (or text_path=<file>)")
    return wikitext_text(WikitextConfig(source=source, path=path), Path(data_dir).expanduser() if data_dir else None)


def token_windows(
    tokenizer: Any, text: str, length: int, count: int, add_bos: bool = True, skip: int = 0
) -> torch.Tensor:
    """``count`` consecutive non-overlapping windows of ``length`` tokens of ``text`` (after the first ``skip``
    windows), each starting with BOS when the tokenizer has one and ``add_bos``: long [count, length]."""
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    bos = tokenizer.bos_token_id if add_bos else None
    body = length - (1 if bos is not None else 0)
    if body < 1:
        raise ValueError(f"window length {length} is too short")
    need = (skip + count) * body
    if len(ids) < need:
        raise ValueError(
            f"the text has {len(ids)} tokens; {count} windows of {length} tokens (after skipping {skip}) need {need}: "
            "use fewer/shorter windows or a longer text (text=local with paths.data_dir, or text_path=<file>)"
        )
    rows = []
    for i in range(skip, skip + count):
        chunk = ids[i * body : (i + 1) * body]
        rows.append(([bos] if bos is not None else []) + chunk)
    return torch.tensor(rows, dtype=torch.long)


def passage_band(values: Any, seed: int = 0) -> tuple[float, float, float, int]:
    """(mean, lo, hi, n) of per-passage values: the mean and its 95 % percentile-bootstrap interval over the
    passages (``statistics.bootstrap_ci``, passages resampled); one passage: lo = hi = the value."""
    import numpy as np

    from ..metrics.statistics import ScoreTerms, bootstrap_ci

    v = np.asarray(list(values), dtype=np.float64)
    v = v[np.isfinite(v)]
    if v.size == 0:
        return math.nan, math.nan, math.nan, 0
    ci = bootstrap_ci(ScoreTerms([str(i) for i in range(v.size)], v, np.ones_like(v), np.zeros(v.size)), seed=seed)
    return float(ci["score"]), float(ci["lo"]), float(ci["hi"]), int(v.size)


def layer_rows_with_bands(per: Any, keys: list[str], values: list[str], bands: list[str]) -> list[dict[str, Any]]:
    """``per`` (a DataFrame, one row per passage × layer × ``keys``) -> one row per (layer, *keys), plus a 'mean'
    layer row per ``keys`` (the mean over layers within each passage): each of ``values`` the mean over passages,
    and for each column in ``bands`` its 95 % bootstrap band over passages (``passage_band``) as ``<col>_lo`` /
    ``<col>_hi``, with ``passages`` their count.  Rows in order of first appearance, the 'mean' rows last."""
    import pandas as pd

    per_mean = per.groupby(["passage", *keys], dropna=False)[values].mean().reset_index()  # mean over layers
    per_mean.insert(1, "layer", "mean")
    both = pd.concat([per[["passage", "layer", *keys, *values]].astype({"layer": object}), per_mean], ignore_index=True)
    rows = []
    for (layer, *key), g in both.groupby(["layer", *keys], dropna=False, sort=False):
        row = dict(zip(["layer", *keys], [layer, *key]))
        row.update(g[values].mean().to_dict())
        for col in bands:
            _, row[f"{col}_lo"], row[f"{col}_hi"], row["passages"] = passage_band(g[col])
        rows.append(row)
    return rows


def random_tokens(tokenizer: Any, vocab_size: int, count: int, length: int, seed: int) -> torch.Tensor:
    """``count`` sequences of ``length`` tokens drawn uniformly from the vocabulary minus special tokens."""
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    allowed = torch.tensor([i for i in range(vocab_size) if i not in special], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(len(allowed), (count, length), generator=g)
    return allowed[idx]


def pick_layers(spec: Any, num_layers: int) -> list[int]:
    """``null``/``all`` -> every layer; an int or a list of ints (negative counts from the end)."""
    if spec is None or spec == "all":
        return list(range(num_layers))
    items = [spec] if isinstance(spec, int) else list(spec)
    out = []
    for i in items:
        if not isinstance(i, int) or not -num_layers <= i < num_layers:
            raise ValueError(
                f"layers={spec!r}: {i!r} is not a layer of this model (valid 0..{num_layers - 1}, or negative)"
            )
        out.append(i % num_layers)
    return sorted(set(out))


def full_context_layers(model: Any, spec: Any, num_layers: int, length: int) -> list[int]:
    """The layers an estimate over a whole ``length``-token context is measured on: ``spec`` (``pick_layers``;
    ``null``/``all``: every layer that sees such a context).  A layer that attends within a window shorter than
    ``length`` (``models.inspection.layer_windows``: Gemma 3's sliding layers, 512 keys) never sees most of the
    keys an estimator would sample from, so naming one is refused rather than measured over keys it never sees."""
    from ..models.inspection import layer_windows

    short = {l: w for l, w in layer_windows(model).items() if w < length}
    full = [l for l in range(num_layers) if l not in short]
    if spec is None or spec == "all":
        if not full:
            raise ValueError(
                f"length={length}: every layer attends within a window of {min(short.values())} keys, shorter than "
                f"the context; use a length of at most {min(short.values())}"
            )
        return full
    layers = pick_layers(spec, num_layers)
    bad = [l for l in layers if l in short]
    if bad:
        raise ValueError(
            f"layers={spec!r}: layer {bad[0]} attends within a window of {short[bad[0]]} keys, shorter than the "
            f"{length}-token context; pick among the layers that see it {full}, or layers=null for all of them"
        )
    return layers


# -- output -------------------------------------------------------------------------------------------------


def out_dir(path: str | None, analysis: str, model_name: str) -> Path:
    p = Path(path).expanduser() if path else Path("analysis") / analysis / model_name
    p.mkdir(parents=True, exist_ok=True)
    return p


def jsonable(obj: Any) -> Any:
    if torch.is_tensor(obj):
        return jsonable(obj.tolist())
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if dataclasses.is_dataclass(obj):
        return jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "item") and callable(obj.item):
        return jsonable(obj.item())
    return obj


def write_json(path: Path, obj: Any) -> Path:
    path.write_text(json.dumps(jsonable(obj), indent=1) + "\n", encoding="utf-8")
    return path


def provenance(model: ModelConfig, options: Any, text_origin: str | None = None) -> dict[str, Any]:
    """What made an analysis's numbers: model, options, text, the package's commit (and whether the tree was
    dirty) and versions, taken when it is called: call it before measuring (``started``), so that a change to the
    tree while an analysis runs is not credited to it, then ``finished(prov, text)``."""
    from ..identity.provenance import git_commit, versions

    return {
        "model": dataclasses.asdict(model),
        "options": dataclasses.asdict(options),
        "text": text_origin,
        "git": git_commit(),
        "versions": versions(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def finished(prov: dict[str, Any], text_origin: str | None) -> dict[str, Any]:
    """``prov`` (taken at the start) with the text the analysis read and the time it finished."""
    return dict(prov, text=text_origin, finished=time.strftime("%Y-%m-%dT%H:%M:%S%z"))


def save_figure(fig: Any, out: Path, stem: str) -> list[Path]:
    """Writes ``stem``.png (150 dpi) and ``stem``.pdf; returns both paths."""
    import matplotlib.pyplot as plt

    paths = [out / f"{stem}.png", out / f"{stem}.pdf"]
    fig.savefig(paths[0], dpi=150, bbox_inches="tight")
    fig.savefig(paths[1], bbox_inches="tight")
    plt.close(fig)
    return paths


def run_measured(
    name: str, model_cfg: ModelConfig, opts: Any, measure: Any, per_layer_table: Any, figures: Any
) -> dict[str, Any]:
    """The shape every per-layer analysis run takes: load the model, ``measure``, write ``<name>.json`` (with
    provenance) and ``<name>_per_layer.csv``, draw the figures."""
    opts.validate()
    started = provenance(model_cfg, opts)
    model, tok, context = load(model_cfg)
    res = measure(model, tok, context, opts)
    out = out_dir(opts.out, name, model_cfg.name)
    res["provenance"] = finished(started, res["text"])
    write_json(out / f"{name}.json", res)
    table = per_layer_table(res)
    table.to_csv(out / f"{name}_per_layer.csv", index=False)
    paths = figures(res, out, model_cfg.name, opts)
    return {"out": out, "table": table, "table_file": out / f"{name}_per_layer.csv", "figures": paths, "result": res}


def layer_summary(table: Any, columns: list[str]) -> Any:
    """Mean, min and max over the layers of a per-layer table's ``columns``: one row per column."""
    import pandas as pd

    cols = [c for c in columns if c in table]
    stats = table[cols].agg(["mean", "min", "max"]).T
    return pd.DataFrame(
        {"quantity": cols, "mean": stats["mean"].values, "min": stats["min"].values, "max": stats["max"].values}
    )


def progress(total: int, desc: str, unit: str = "step", show: bool = True):
    """A progress bar (stderr) with the rate and the time left, for an analysis's steps."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=not show, leave=False, dynamic_ncols=True)
