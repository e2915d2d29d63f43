"""Estimation error against the budget (MagicPIG Fig. 3, Fig. 4, Fig. 6a/b; Theorem 3.3).

    python -m sparse_eval.analysis analysis=error_vs_budget model=stories260k \
        [analysis.length=512 analysis.num_queries=4 ...]

On real text (a WikiText-2 passage of ``length`` tokens), the attention inputs of every layer are captured
(post-RoPE q, K, V) and, for the last ``num_queries`` query rows (each a decoding step over the densely
prefilled prefix), each method is run through ``sparse_eval.methods.attend`` on exactly those tensors:

* relative error ‖ô − o‖/‖o‖ (``stats["est_error"]``, o = exact attention) per layer, mean over query heads and rows;
* TopK (eq. 3) and oracle sampling (Def. 3.1, eq. 4–5) over ``budgets`` (a ratio of the context: keys kept by
  TopK, i.i.d. draws B for oracle sampling; each with ``repeats`` seeds for the sampling methods);
* MagicPIG (eq. 10–11) over ``magicpig`` (K, L) pairs; its x-value is the measured Cost2 (kept keys / context);
* oracle sampling's unique-sample count |S| against Theorem 3.3's bound 1 + B·ε, ε = 1 − max_i w_i, with w the
  attention over the keys the sampler draws from.

Static keys: ``sink`` and ``local`` default to 0, the pure estimators of §3 (Fig. 3, 4 and 6 have no static
keys); set ``sink=4 local=64`` for the methods as deployed (§5.1).  Layers are all layers by default (the
method's ``dense_layers`` do not apply to a single captured step), except those that attend within a window
shorter than the passage (Gemma 3's sliding layers: ``common.full_context_layers``).

Resumable: each passage's records are appended to ``error_records.partial.jsonl`` in the output folder as soon as
they are measured, under a key of the model and the options other than ``out`` and ``passages`` (passage p is the
same window whatever the count).  The same command, stopped (a deadline, Ctrl-C) and run again, measures only the
passages not yet there.  The finished files replace the partial one (the commits its passages were measured at are in
the JSON's provenance, ``passage_git``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from ..methods import attend
from ..methods.core import key_validity, scores_gqa, static_keys
from ..methods.magicpig import MagicPIG
from ..methods.oracle import OracleSampling
from ..methods.topk import TopK
from ..models.loading import model_identity
from . import common
from .capture import capture_qkv, model_shape

DEFAULT_BUDGETS = [0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0]
DEFAULT_KL = [[10, 75], [10, 150], [10, 300], [9, 120], [8, 75], [8, 90], [7, 35], [7, 150]]
METHOD_NAMES = (TopK.name, OracleSampling.name, MagicPIG.name)


@dataclass
class ErrorOptions(common.TextOptions):
    length: int | None = None  # context (tokens, BOS included); null: min(model context, 16384) (paper: 16K)
    passages: int = 1  # consecutive non-overlapping windows of the text; means and 95 % bands over them
    num_queries: int = 4  # decoding steps: the passage's last query rows
    layers: Any = None  # null: every layer that sees the whole context; an int or a list (negative from the end)
    methods: list[str] = field(default_factory=lambda: list(METHOD_NAMES))
    budgets: list[float] = field(default_factory=lambda: list(DEFAULT_BUDGETS))  # ratio of the context, (0, 1]
    magicpig: list[list[int]] = field(default_factory=lambda: [list(x) for x in DEFAULT_KL])  # (K, L) pairs
    min_collisions: int = 2  # MagicPIG eq. 10
    center: bool = True  # MagicPIG §4.3 key centering
    repeats: int = 3  # seeds for oracle sampling and MagicPIG
    sink: int = 0
    local: int = 0
    plot_layers: Any = None  # layers drawn one panel each (Fig. 6a/b); null: ~1/3 and ~3/5 of the depth (8B: 11, 19)
    seed: int = 0

    def validate(self) -> None:
        bad = [m for m in self.methods if m not in METHOD_NAMES]
        if bad or not self.methods:
            raise ValueError(f"methods={self.methods!r}: valid entries {list(METHOD_NAMES)}")
        badb = [b for b in self.budgets if isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 1]
        if badb or not self.budgets:
            raise ValueError(f"budgets={self.budgets!r}: each a ratio of the context in (0, 1]")
        for kl in self.magicpig:
            if not (isinstance(kl, (list, tuple)) and len(kl) == 2 and all(isinstance(x, int) and x >= 1 for x in kl)):
                raise ValueError(
                    f"magicpig={self.magicpig!r}: give a list of [K, L] pairs of positive ints, e.g. [[10,150],[8,75]]"
                )
        if self.num_queries < 1 or self.repeats < 1 or self.passages < 1:
            raise ValueError(
                f"num_queries={self.num_queries}, repeats={self.repeats}, passages={self.passages}: each must be >= 1"
            )
        if self.sink < 0 or self.local < 0:
            raise ValueError(f"sink={self.sink}, local={self.local}: must be >= 0")


def oracle_bound(
    q: torch.Tensor, k: torch.Tensor, scaling: float, sink: int, local: int, draws: torch.Tensor
) -> torch.Tensor:
    """Theorem 3.3: 1 + B·ε per row, ε = 1 − max_i w_i over the non-static keys the sampler draws from.
    q [B, Hq, Q, D], k [B, Hkv, N, D], draws [B, 1, Q, 1] -> [B, Hq, Q]."""
    b, _, ql, _ = q.shape
    valid = key_validity(None, b, ql, k.shape[2], q.device)
    static, _ = static_keys(valid, sink, local)
    cand = valid & ~static
    s = scores_gqa(q, k, scaling).masked_fill(~cand, float("-inf"))
    w = torch.softmax(s.double(), -1).nan_to_num(0.0)
    eps = 1.0 - w.amax(-1)
    return (1.0 + draws.squeeze(-1).double() * eps).float()


def measure(
    model: Any,
    tokenizer: Any,
    context: int,
    opts: ErrorOptions,
    progress: bool = False,
    done: dict[int, list[dict[str, Any]]] | None = None,
    on_passage: Callable[[int, list[dict[str, Any]]], None] | None = None,
) -> list[dict[str, Any]]:
    """Returns one record per (layer, method, setting, seed): error, cost2 and (oracle) unique count and bound.
    ``progress``: progress bars for the passage's forward and then every (layer, method, setting, seed), with the
    time left.  ``done``: passages measured before (their records, as ``on_passage`` got them), not measured again;
    ``on_passage(p, records)`` is called after each passage measured here."""
    opts.validate()
    shape = model_shape(model)
    length = min(context, 16384) if opts.length is None else int(opts.length)
    if not 2 <= length <= context:
        raise ValueError(f"length={length}: must lie in [2, {context}] (the model's context)")
    layers = common.full_context_layers(model, opts.layers, shape["num_layers"], length)
    if opts.num_queries >= length:
        raise ValueError(f"num_queries={opts.num_queries} must be smaller than length={length}")
    text, origin = opts.load_text()
    ids = common.token_windows(tokenizer, text, length, opts.passages)  # [passages, length]
    n_min = length - opts.num_queries + 1  # keys of the first query row
    seeds = [opts.seed + r for r in range(opts.repeats)]
    kept = [b for b in opts.budgets if not (math.floor(float(b) * (n_min - opts.sink - opts.local)) < 1 and b < 1.0)]
    per_layer = len(kept) * ((TopK.name in opts.methods) + len(seeds) * (OracleSampling.name in opts.methods)) + len(
        opts.magicpig
    ) * len(seeds) * (MagicPIG.name in opts.methods)
    records: list[dict[str, Any]] = []
    for p in range(opts.passages):
        if done and p in done:
            records += [dict(r) for r in done[p]]
            continue
        part = _measure_passage(
            model,
            ids[p : p + 1],
            layers,
            n_min,
            seeds,
            per_layer,
            opts,
            progress,
            f" (passage {p + 1}/{opts.passages})" if opts.passages > 1 else "",
        )
        part = [dict(r, passage=p) for r in part]
        if on_passage is not None:
            on_passage(p, part)
        records += part
    for r in records:
        r["length"] = length
        r["text"] = origin
    return records


def _measure_passage(model, ids, layers, n_min, seeds, per_layer, opts, progress, tag) -> list[dict[str, Any]]:
    """One passage's records (ids [1, length]): every layer, method, setting and seed."""
    with common.progress(1, f"error_vs_budget: {ids.shape[1]}-token forward{tag}", "forward", progress) as fwd:
        cap = capture_qkv(model, ids, layers=layers, query_rows=opts.num_queries)
        fwd.update()
    # the estimates' own bar: its rate (and so the time left) is not skewed by the forward's one long step
    bar = common.progress(len(layers) * per_layer, "error_vs_budget", "estimate", progress)
    common_opts = {"sink": opts.sink, "local": opts.local}
    records: list[dict[str, Any]] = []
    for li, l in enumerate(layers):
        bar.set_description(f"error_vs_budget: layer {l} ({li + 1}/{len(layers)}){tag}")
        c = cap[l]
        q, k, v = c.q, c.k, c.v
        dev_k = dict(layer_idx=l, scaling=c.scaling)

        def run(method, seed=None, **kw):
            o = dict(common_opts, **kw)
            if seed is not None:
                o["seed"] = seed
            _, st = attend(method, q, k, v, **dev_k, **o)
            bar.update()
            return st

        for b in opts.budgets:
            b = float(b)
            if math.floor(b * (n_min - opts.sink - opts.local)) < 1 and b < 1.0:
                continue  # fewer than one key of budget at this length
            if TopK.name in opts.methods:
                st = run(TopK.name, budget=b)
                records.append(_record(l, TopK.name, st, budget=b))
            if OracleSampling.name in opts.methods:
                for s in seeds:
                    st = run(OracleSampling.name, seed=s, budget=b)
                    keep = st["keep"]
                    b_, _, ql, n = keep.shape
                    valid = key_validity(None, b_, ql, n, keep.device)
                    stat, nval = static_keys(valid, opts.sink, opts.local)
                    unique = (keep & ~stat).sum(-1).float()  # [B, Hq, Q]
                    draws = torch.floor(nval.double() * b).long()
                    bound = oracle_bound(q, k, c.scaling, opts.sink, opts.local, draws)
                    records.append(
                        _record(
                            l,
                            OracleSampling.name,
                            st,
                            budget=b,
                            seed=s,
                            unique=float(unique.mean()),
                            bound=float(bound.mean()),
                            draws=float(draws.float().mean()),
                            unique_le_bound=float((unique <= bound + 1e-6).float().mean()),
                        )
                    )
        if MagicPIG.name in opts.methods:
            for K, L in opts.magicpig:
                for s in seeds:
                    st = run(
                        MagicPIG.name,
                        seed=s,
                        K=int(K),
                        L=int(L),
                        min_collisions=opts.min_collisions,
                        center=opts.center,
                    )
                    records.append(_record(l, MagicPIG.name, st, K=int(K), L=int(L), seed=s))
    bar.close()
    return records


def _record(layer: int, method: str, st: dict[str, Any], **extra: Any) -> dict[str, Any]:
    rows = st["rows"]
    w = rows.float()
    tot = float(w.sum().clamp_min(1))
    mean = lambda x: float((x.float() * w).sum() / tot)  # noqa: E731
    rec = {
        "layer": layer,
        "method": method,
        "budget": None,
        "K": None,
        "L": None,
        "seed": None,
        "error": mean(st["est_error"]),
        "error_max": float(st["est_error"][rows].max()) if rows.any() else float("nan"),
        "cost2": mean(st["cost2"]),
        "static_frac": mean(st["static_frac"]),
    }
    rec.update(extra)
    return rec


def summarize(records: list[dict[str, Any]]):
    """One row per (layer, method, budget | K, L), plus 'mean' layer rows (mean over layers): each value the mean
    over seeds within a passage, then over passages; ``error_lo``/``error_hi`` the 95 % bootstrap band of the
    error over passages (``common.passage_band``; equal to the error for one passage), ``passages`` their count."""
    import pandas as pd

    df = pd.DataFrame(records)
    if "passage" not in df:
        df["passage"] = 0
    keys = ["method", "budget", "K", "L"]
    val = [
        c
        for c in ("error", "error_max", "cost2", "static_frac", "unique", "bound", "draws", "unique_le_bound")
        if c in df
    ]
    per = df.groupby(["passage", "layer", *keys], dropna=False)[val].mean().reset_index()  # mean over seeds
    return pd.DataFrame(common.layer_rows_with_bands(per, keys, val, ["error"]))  # layers in order, then "mean"


def _default_plot_layers(layers: list[int], num_layers: int) -> list[int]:
    """Two layers at about 1/3 and 3/5 of the depth (Llama-3.1-8B: 11 and 19, as Fig. 6a/b)."""
    want = sorted({round(num_layers * 11 / 32), round(num_layers * 19 / 32)})
    return [min(layers, key=lambda l: abs(l - w)) for w in want] if layers else []


def figures(summary, out: Path, model_name: str, opts: ErrorOptions, num_layers: int) -> list[Path]:
    import matplotlib.pyplot as plt

    from ..report.figures.plotting import annotate_spread, plain_log_x

    paths: list[Path] = []
    layers = sorted(x for x in summary["layer"].unique() if x != "mean")
    length = opts.length
    settings = f"{model_name}, context {summary.attrs.get('length', length)} tokens, last {opts.num_queries} query rows"
    n_passages = int(summary["passages"].max()) if "passages" in summary and len(summary) else 1
    banded = n_passages > 1 and "error_lo" in summary
    if banded:
        settings += f", {n_passages} passages (band: 95 % bootstrap over passages)"
    if opts.sink or opts.local:
        settings += f", sink {opts.sink} + local {opts.local} static"
    plot_layers = (
        common.pick_layers(opts.plot_layers, num_layers)
        if opts.plot_layers is not None
        else _default_plot_layers(layers, num_layers)
    )
    plot_layers = [l for l in plot_layers if l in layers]
    panels = ["mean", *plot_layers]

    # Fig. 3 / 6a-b: TopK vs oracle sampling (vs MagicPIG at its measured Cost2)
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4), constrained_layout=True, squeeze=False)
    for ax, layer in zip(axes[0], panels):
        d = summary[summary["layer"] == layer]
        for method, style, label in (
            (TopK.name, dict(color="C0", marker="o"), "TopK (x = keys kept)"),
            (OracleSampling.name, dict(color="C1", marker="s"), "oracle sampling (x = draws B)"),
        ):
            dm = d[d["method"] == method].sort_values("budget")
            if len(dm):
                ax.plot(dm["budget"], dm["error"], label=label, ms=4, **style)
                if banded:
                    ax.fill_between(dm["budget"], dm["error_lo"], dm["error_hi"], color=style["color"], alpha=0.2, lw=0)
        dm = d[d["method"] == MagicPIG.name]
        if len(dm):
            ax.scatter(
                dm["cost2"], dm["error"], color="C2", marker="^", zorder=3, label="MagicPIG (x = measured Cost2)"
            )
            if banded:
                ax.errorbar(
                    dm["cost2"],
                    dm["error"],
                    yerr=[dm["error"] - dm["error_lo"], dm["error_hi"] - dm["error"]],
                    fmt="none",
                    ecolor="C2",
                    alpha=0.6,
                )
        ax.set_xscale("log")
        plain_log_x(ax)
        if len(dm):
            annotate_spread(ax, [(r.cost2, r.error, f"({int(r.K)},{int(r.L)})") for _, r in dm.iterrows()])
        ax.set_xlabel("budget (fraction of the context)")
        ax.set_ylabel("relative error ‖ô − o‖ / ‖o‖")
        ax.set_title("mean over layers" if layer == "mean" else f"layer {layer}", fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"Attention estimation error vs budget (MagicPIG Fig. 3, 6a/b) — {settings}", fontsize=10)
    paths += common.save_figure(fig, out, "fig6_error_vs_budget")

    # Fig. 4: TopK error per layer
    d = summary[(summary["method"] == TopK.name) & (summary["layer"] != "mean")]
    if len(d):
        fig, ax = plt.subplots(figsize=(7, 4.2), constrained_layout=True)
        cmap = plt.get_cmap("viridis")
        for i, l in enumerate(layers):
            dl = d[d["layer"] == l].sort_values("budget")
            ax.plot(
                dl["budget"], dl["error"], marker="o", ms=3, color=cmap(i / max(len(layers) - 1, 1)), label=f"layer {l}"
            )
        ax.set_xscale("log")
        ax.set_xlabel("TopK budget (fraction of the context kept)")
        ax.set_ylabel("relative error ‖ô − o‖ / ‖o‖")
        ax.grid(alpha=0.3, which="both")
        h, lab = ax.get_legend_handles_labels()
        step = max(1, math.ceil(len(h) / 12))
        ax.legend(h[::step], lab[::step], fontsize=7, ncol=2)
        ax.set_title(f"TopK estimation error per layer (MagicPIG Fig. 4)\n{settings}", fontsize=10)
        paths += common.save_figure(fig, out, "fig4_topk_error_per_layer")

    # Theorem 3.3: unique samples vs budget
    d = summary[summary["method"] == OracleSampling.name]
    if len(d) and "unique" in d:
        fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4), constrained_layout=True, squeeze=False)
        for ax, layer in zip(axes[0], panels):
            dl = d[d["layer"] == layer].sort_values("draws")
            ax.plot(dl["draws"], dl["unique"], marker="o", ms=4, label="measured E|S| (unique keys)")
            ax.plot(dl["draws"], dl["bound"], ls="--", label="Theorem 3.3 bound 1 + Bε")
            ax.plot(dl["draws"], dl["draws"], ls=":", color="grey", label="B (draws)")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("sampling budget B (draws per row)")
            ax.set_ylabel("keys attended per row")
            ax.set_title("mean over layers" if layer == "mean" else f"layer {layer}", fontsize=10)
            ax.grid(alpha=0.3, which="both")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"Oracle sampling: unique samples vs budget (MagicPIG Theorem 3.3) — {settings}", fontsize=10)
        paths += common.save_figure(fig, out, "thm33_oracle_unique_samples")
    return paths


PARTIAL = "error_records.partial.jsonl"


def resume_key(model_cfg: Any, opts: ErrorOptions, model: Any, tokenizer: Any) -> str:
    """What a passage's records depend on: the model as loaded (``models.loading.model_identity``: its files'
    fingerprint, the dtype it runs in, its tokenizer's behaviour; not the config's ``dtype=auto``, which is bfloat16 on
    a GPU and float32 on a CPU) and every option but ``out`` and ``passages``."""
    o = {k: v for k, v in dataclasses.asdict(opts).items() if k not in ("out", "passages")}
    ident = model_identity(model_cfg, model, tokenizer=tokenizer)
    blob = json.dumps({"model": ident, "options": o}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def read_partial(path: Path, key: str) -> tuple[dict[int, list[dict[str, Any]]], list[Any]]:
    """(the passages ``path`` holds under ``key``, the distinct ``git`` entries they were measured at); a line of
    other options is refused (another output folder is the fix); a line cut short (the process killed mid-write) is
    dropped and its passage measured again."""
    done: dict[int, list[dict[str, Any]]] = {}
    gits: list[Any] = []
    if not path.is_file():
        return done, gits
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            continue
        if entry.get("key") != key:
            raise ValueError(
                f"{path}:{i} holds passages measured with other options or another model (its files, the dtype it "
                "ran in or its tokenizer); give analysis.out another folder, or delete that file to start over"
            )
        done[int(entry["passage"])] = entry["records"]
        if entry.get("git") not in gits:
            gits.append(entry.get("git"))
    return done, gits


def run(model_cfg, opts: ErrorOptions) -> dict[str, Any]:
    opts.validate()
    started = common.provenance(model_cfg, opts)
    out = common.out_dir(opts.out, "error_vs_budget", model_cfg.name)
    model, tok, context = common.load(model_cfg)
    key, partial = resume_key(model_cfg, opts, model, tok), out / PARTIAL
    done, gits = read_partial(partial, key)

    def save(p: int, recs: list[dict[str, Any]]) -> None:
        line = {"key": key, "passage": p, "git": started["git"], "records": common.jsonable(recs)}
        cut = partial.is_file() and partial.stat().st_size and not partial.read_bytes().endswith(b"\n")
        with partial.open("a", encoding="utf-8") as f:
            f.write(("\n" if cut else "") + json.dumps(line) + "\n")  # after a line cut short: a line of its own
            f.flush()

    if done:
        print(f"error_vs_budget: {len(done)} passage(s) already measured in {partial}; measuring the rest", flush=True)
    records = measure(model, tok, context, opts, progress=True, done=done, on_passage=save)
    import pandas as pd

    pd.DataFrame(records).to_csv(out / "error_records.csv", index=False)
    summary = summarize(records)
    summary.attrs["length"] = records[0]["length"] if records else opts.length
    summary.to_csv(out / "error_vs_budget.csv", index=False)
    prov = common.finished(started, records[0]["text"] if records else None)
    prov["resumed_passages"] = sorted(p for p in done if p < opts.passages)
    prov["passage_git"] = gits + [g for g in [started["git"]] if g not in gits]
    common.write_json(out / "error_vs_budget.json", {"provenance": prov, "records": records})
    paths = figures(summary, out, model_cfg.name, opts, model_shape(model)["num_layers"])
    if all(p < opts.passages for p in done):
        partial.unlink(missing_ok=True)  # everything is in the finished files now
    return {
        "out": out,
        "summary": summary,
        "table_file": out / "error_vs_budget.csv",
        "records": records,
        "figures": paths,
    }


def summary(result: dict[str, Any]):
    """Mean over layers of each method's error and attended fraction per budget (TopK, oracle) or (K, L)
    (MagicPIG); every layer and column is in ``result["table_file"]``."""
    s = result["summary"]
    cols = [c for c in ("method", "budget", "K", "L", "error", "cost2") if c in s]
    return s[s["layer"] == "mean"][cols]
