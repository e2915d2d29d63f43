"""Attention geometry (MagicPIG §3.1, Fig. 2, Fig. 5, App. C Fig. 10 and 11), per layer and head.

    python -m sparse_eval.analysis analysis=geometry model=stories260k \
        [analysis.num_sentences=50 analysis.sentence_len=128 ...]

What is measured (keys and queries post-RoPE, exactly as attention uses them; K/V per KV head):

* Fig. 5a, ``sink_cos``: the key of the first token, k_sink = k_0, for ``num_random`` inputs whose tokens are
  drawn uniformly from the vocabulary (special tokens excluded; no BOS, so the first token itself is random);
  the mutual cosine similarity of the ``num_random`` vectors (mean and minimum over the pairs).  The paper: 32
  inputs, minimum > 0.99.
* Fig. 5b, ``kavg_cos``: k_avg = (1/n) Σ_i k_i over all n positions of a text window (BOS first, as the model
  reads text), for ``num_sentences`` windows of ``sentence_len`` tokens of WikiText-2; mutual cosine similarity
  (mean, minimum).  The paper: 50 sentences, > 0.9.
* Fig. 5c, ``sink_avg_cos``: cos(k_sink, k_avg) of each window, averaged over the windows (``lo``/``hi``: the 95 %
  bootstrap band over the windows of the mean over KV heads).  The paper: −0.9 … −0.8.
* Fig. 2a/b, ``top_mass``: for the last ``num_queries`` query rows of each of ``passages`` consecutive passages of
  ``length`` tokens (mean over them, ``_lo``/``_hi`` their 95 % bootstrap band), the share
  of the attention mass w = softmax(q Kᵀ/√d) held by the top x % of the row's keys (x in ``fractions``; the count
  is ceil(x·n), at least 1), with the sink, and without it (the first ``sink_tokens`` keys dropped and w
  renormalized over the rest, Fig. 2b).  Mean over query rows (and heads, for the per-layer curve).  A layer that
  attends within a window (Gemma 3's sliding layers) is measured over the keys it attends (``window``).
* Fig. 11, ``value_norms``: ‖v_i‖ by position i, mean over the windows and KV heads.
* Fig. 10, ``score_spread``: in one decoding step (the first passage's last query row), the spread over the keys i of
  s_i = q·k_i/√d and of log‖v_i − o‖ with o the exact attention output: standard deviation and range
  (max − min) per query head (a sliding layer: over its window).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from ..kernels import invariant as kinv
from ..methods.core import masked_softmax, scores_gqa
from . import common
from ..models.inspection import layer_windows
from .capture import capture_qkv, model_shape

DEFAULT_FRACTIONS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]


@dataclass
class GeometryOptions(common.TextOptions):
    num_random: int = 32  # Fig. 5a: inputs of random tokens (paper: 32)
    random_len: int = 16  # tokens per random input (k_0 depends on the first token only: causal, RoPE(0) = I)
    num_sentences: int = 50  # Fig. 5b: text windows (paper: 50 sentences)
    sentence_len: int = 128  # tokens per window, BOS included
    length: int | None = None  # passage for Fig. 2 / 10; null: min(model context, 4096)
    passages: int = 1  # Fig. 2: consecutive passages of `length` tokens; mean and 95 % band over them
    num_queries: int = 16  # last query rows of the passage used for Fig. 2 (Fig. 10 uses the last one)
    fractions: list[float] = field(default_factory=lambda: list(DEFAULT_FRACTIONS))  # top-x of the keys (0, 1]
    sink_tokens: int = 1  # keys dropped for "without the sink" (Fig. 2b)
    spread_layer: int | None = None  # layer drawn in Fig. 10b; null: the middle layer
    batch: int = 8  # windows per forward
    seed: int = 0

    def validate(self) -> None:
        for name in ("num_random", "random_len", "num_sentences", "num_queries", "batch", "passages"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")
        if self.num_random < 2 or self.num_sentences < 2:
            raise ValueError("num_random and num_sentences must be >= 2 (cosine similarity between pairs)")
        if self.sentence_len < 2:
            raise ValueError(f"sentence_len={self.sentence_len}: must be >= 2")
        bad = [f for f in self.fractions if not isinstance(f, (int, float)) or not 0 < f <= 1]
        if bad or not self.fractions:
            raise ValueError(f"fractions={self.fractions!r}: each must lie in (0, 1]")
        if self.sink_tokens < 1:
            raise ValueError(f"sink_tokens={self.sink_tokens}: must be >= 1")


# -- the measures (pure tensor functions; tests compare them with brute force) ---------------------------------


def pairwise_cos(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, ..., D] -> (mean, min) over the N(N−1)/2 pairs of the cosine similarity, each [...]."""
    n = x.shape[0]
    if n < 2:
        raise ValueError("pairwise_cos needs at least 2 vectors")
    u = torch.nn.functional.normalize(x.double(), dim=-1)
    gram = torch.einsum("i...d,j...d->...ij", u, u)  # [..., N, N]
    iu = torch.triu_indices(n, n, offset=1)
    pairs = gram[..., iu[0], iu[1]]  # [..., P]
    return pairs.mean(-1).float(), pairs.amin(-1).float()


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=-1).float()


def attended_keys(q_len: int, kv_len: int, window: int | None, device: Any = None) -> torch.Tensor:
    """bool [1, 1, Q, N]: the keys each of the last Q query rows attends: the earlier ones and, in a layer that
    attends within a window (``models.inspection.layer_windows``), only the last ``window`` of them, itself included
    (``kernels.invariant.attention_mask``, the rule of transformers' ``sliding_window_overlay``)."""
    return kinv.attention_mask(torch.zeros(1, dtype=torch.long, device=device), q_len, kv_len, window or 0)


def attention_probs(q: torch.Tensor, k: torch.Tensor, scaling: float, window: int | None = None) -> torch.Tensor:
    """Exact attention weights of query rows aligned to the last Q keys, over the keys they attend
    (``attended_keys``: causal, within ``window`` in a sliding layer): [B, Hq, Q, N] fp32, 0 on the others."""
    valid = attended_keys(q.shape[2], k.shape[2], window, q.device)
    s = scores_gqa(q, k, scaling).masked_fill(~valid, float("-inf"))
    return masked_softmax(s, valid.expand_as(s))


def top_mass(p: torch.Tensor, valid: torch.Tensor, fractions: Sequence[float]) -> torch.Tensor:
    """p [..., N] probabilities (0 on invalid keys), valid bool [..., N] (broadcastable).  For each fraction x:
    the sum of the ceil(x·n) largest p of the row (n = its valid keys, count at least 1).  Returns [..., F]."""
    valid = valid.expand_as(p)
    n = valid.sum(-1, keepdim=True)  # [..., 1]
    srt = p.masked_fill(~valid, -1.0).sort(-1, descending=True).values.clamp_min(0.0)
    csum = srt.double().cumsum(-1)
    out = []
    for x in fractions:
        cnt = torch.ceil(n.double() * float(x) - 1e-9).clamp(min=1).long().clamp(max=p.shape[-1])
        out.append(csum.gather(-1, cnt - 1))
    return torch.cat(out, -1).float()


def drop_sink(p: torch.Tensor, valid: torch.Tensor, sink_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Removes the first ``sink_tokens`` keys and renormalizes the rest (Fig. 2b)."""
    q = p[..., sink_tokens:]
    v = valid.expand_as(p)[..., sink_tokens:]
    z = q.sum(-1, keepdim=True)
    return q / z.clamp_min(torch.finfo(q.dtype).tiny), v


def score_spread(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> dict[str, torch.Tensor]:
    """One decoding step: q [B, Hq, 1, D] with all N keys.  Per query head, over the keys i: std and range of
    s_i = q·k_i·scaling and of log‖v_i − o‖ (o = softmax(s)·V).  Returns tensors [B, Hq] plus the series
    ``scores`` and ``log_dev`` [B, Hq, N]."""
    g = q.shape[1] // k.shape[1]
    s = scores_gqa(q, k, scaling)[:, :, 0].double()  # [B, Hq, N]
    w = torch.softmax(s, -1)
    vv = v.repeat_interleave(g, 1).double()  # [B, Hq, N, D]
    o = torch.einsum("bhn,bhnd->bhd", w, vv)
    dev = torch.log((vv - o[:, :, None]).norm(dim=-1).clamp_min(1e-30))  # [B, Hq, N]
    return {
        "score_std": s.std(-1).float(),
        "score_range": (s.amax(-1) - s.amin(-1)).float(),
        "logdev_std": dev.std(-1).float(),
        "logdev_range": (dev.amax(-1) - dev.amin(-1)).float(),
        "scores": s.float(),
        "log_dev": dev.float(),
    }


# -- the run --------------------------------------------------------------------------------------------------


def _batched(model, ids: torch.Tensor, batch: int, query_rows: int):
    """Captures every layer for ``ids`` [N, T] in batches; yields {layer: LayerQKV} per batch."""
    for start in range(0, ids.shape[0], batch):
        yield capture_qkv(model, ids[start : start + batch], query_rows=query_rows)


def measure(model: Any, tokenizer: Any, context: int, opts: GeometryOptions, show: bool = True) -> dict[str, Any]:
    """Runs every measure; returns the raw numbers (lists nested [layer][head][...]).  ``show``: a progress bar
    over its steps (the forwards, then the per-layer measures of the passage), with the time left."""
    opts.validate()
    shape = model_shape(model)
    nl = shape["num_layers"]
    text, origin = opts.load_text()
    if opts.sentence_len > context:
        raise ValueError(f"sentence_len={opts.sentence_len} exceeds the model's context ({context})")
    length = min(context, 4096) if opts.length is None else int(opts.length)
    if not 2 <= length <= context:
        raise ValueError(f"length={length}: must lie in [2, {context}] (the model's context)")
    if opts.num_queries >= length:
        raise ValueError(f"num_queries={opts.num_queries} must be smaller than length={length}")
    if opts.sink_tokens >= length - opts.num_queries + 1:
        raise ValueError(f"sink_tokens={opts.sink_tokens} leaves no key for the first query row")

    # Fig. 5a: k_0 across inputs of random tokens
    rnd = common.random_tokens(tokenizer, shape["vocab_size"], opts.num_random, opts.random_len, opts.seed)
    win = common.token_windows(tokenizer, text, opts.sentence_len, opts.num_sentences)
    steps = -(-rnd.shape[0] // opts.batch) + -(-win.shape[0] // opts.batch) + opts.passages * (1 + nl)
    bar = common.progress(steps, "geometry: random inputs", show=show)
    k0: dict[int, list[torch.Tensor]] = {}
    for cap in _batched(model, rnd, opts.batch, 1):
        for l, c in cap.items():
            k0.setdefault(l, []).append(c.k[:, :, 0])  # [b, Hkv, D]
        bar.update()
    sink_mean, sink_min = zip(*(pairwise_cos(torch.cat(k0[l])) for l in range(nl)))

    # Fig. 5b/5c and Fig. 11: text windows
    bar.set_description("geometry: text windows")
    kavg: dict[int, list[torch.Tensor]] = {}
    ksink: dict[int, list[torch.Tensor]] = {}
    vnorm: dict[int, torch.Tensor] = {}
    for cap in _batched(model, win, opts.batch, 1):
        bar.update()
        for l, c in cap.items():
            kavg.setdefault(l, []).append(c.k.mean(2))  # [b, Hkv, D]
            ksink.setdefault(l, []).append(c.k[:, :, 0])
            norms = c.v.norm(dim=-1).sum(0)  # [Hkv, T]
            vnorm[l] = vnorm[l] + norms if l in vnorm else norms
    avg_mean, avg_min = zip(*(pairwise_cos(torch.cat(kavg[l])) for l in range(nl)))
    sink_avg_win = [cosine(torch.cat(ksink[l]), torch.cat(kavg[l])) for l in range(nl)]  # [W, Hkv]
    sink_avg = [x.mean(0) for x in sink_avg_win]  # [Hkv]
    sink_avg_band = [common.passage_band(x.mean(1).tolist())[1:3] for x in sink_avg_win]  # over windows
    vnorm = {l: vnorm[l] / opts.num_sentences for l in vnorm}

    # Fig. 2 and Fig. 10: `passages` passages of `length` tokens (after the windows used above when the text allows)
    try:
        passages = common.token_windows(
            tokenizer,
            text,
            length,
            opts.passages,
            skip=(opts.num_sentences * (opts.sentence_len - 1)) // max(length - 1, 1) + 1,
        )
    except ValueError:
        passages = common.token_windows(tokenizer, text, length, opts.passages)
    fr = [float(f) for f in opts.fractions]
    windows = layer_windows(model)  # {layer: window}: Fig. 2 and 10 over the keys such a layer attends
    mass_p, mass_ns_p, mass_head_p, mass_ns_head_p = [], [], [], []  # [P][L][F], [P][L][Hq][F]
    spread = []
    for pi in range(opts.passages):
        tag = f" {pi + 1}/{opts.passages}" if opts.passages > 1 else ""
        bar.set_description(f"geometry: {length}-token passage{tag}")
        cap = capture_qkv(model, passages[pi : pi + 1], query_rows=opts.num_queries)
        bar.update()
        bar.set_description(f"geometry: per layer{tag}")
        mass, mass_ns, mass_head, mass_ns_head = [], [], [], []
        for l in range(nl):
            bar.update()
            c, w = cap[l], windows.get(l)
            p = attention_probs(c.q, c.k, c.scaling, w)  # [1, Hq, Q, N]
            valid = attended_keys(c.q.shape[2], c.k.shape[2], w, p.device)  # [1, 1, Q, N]
            m = top_mass(p, valid, fr)  # [1, Hq, Q, F]
            pn, vn = drop_sink(p, valid, opts.sink_tokens)
            mn = top_mass(pn, vn, fr)
            mass_head.append(m[0].mean(1))  # [Hq, F]
            mass_ns_head.append(mn[0].mean(1))
            mass.append(m[0].mean((0, 1)))  # [F]
            mass_ns.append(mn[0].mean((0, 1)))
            if pi == 0:  # Fig. 10: one decoding step, the first passage's last query row
                seen = slice(None) if w is None else slice(max(0, c.k.shape[2] - w), None)  # the row's window
                spread.append(score_spread(c.q[:, :, -1:], c.k[:, :, seen], c.v[:, :, seen], c.scaling))
        mass_p.append(torch.stack(mass))
        mass_ns_p.append(torch.stack(mass_ns))
        mass_head_p.append(torch.stack(mass_head))
        mass_ns_head_p.append(torch.stack(mass_ns_head))
        del cap
    bar.close()

    def band(per_passage: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """[P][L, F] -> [mean, lo, hi], each [L][F]: over the passages (``common.passage_band``)."""
        x = torch.stack(per_passage).double()  # [P, L, F]
        cells = [[common.passage_band(x[:, l, f].tolist()) for f in range(x.shape[2])] for l in range(x.shape[1])]
        return [[torch.tensor([c[i] for c in row]) for row in cells] for i in range(3)]

    mass, mass_lo, mass_hi = band(mass_p)
    mass_ns, mass_ns_lo, mass_ns_hi = band(mass_ns_p)
    mass_head = list(torch.stack(mass_head_p).mean(0))  # [L][Hq, F]
    mass_ns_head = list(torch.stack(mass_ns_head_p).mean(0))
    spread_layer = nl // 2 if opts.spread_layer is None else common.pick_layers(opts.spread_layer, nl)[0]

    return {
        "model_shape": shape,
        "text": origin,
        "length": length,
        "window": [windows.get(l) for l in range(nl)],  # [L]: a sliding layer's window (None: the whole passage)
        "fractions": fr,
        "sink_cos": {"mean": list(sink_mean), "min": list(sink_min)},  # [L][Hkv]
        "kavg_cos": {"mean": list(avg_mean), "min": list(avg_min)},
        "sink_avg_cos": {
            "mean": sink_avg,  # [L][Hkv]
            "lo": [b[0] for b in sink_avg_band],
            "hi": [b[1] for b in sink_avg_band],
        },  # [L], over windows
        "passages": opts.passages,
        "top_mass": {
            "with_sink": mass,
            "without_sink": mass_ns,  # [L][F]: mean over passages
            "with_sink_lo": mass_lo,
            "with_sink_hi": mass_hi,  # [L][F]: 95 % band over passages
            "without_sink_lo": mass_ns_lo,
            "without_sink_hi": mass_ns_hi,
            "with_sink_per_head": mass_head,
            "without_sink_per_head": mass_ns_head,
        },  # [L][Hq][F]
        "value_norms": {
            "mean": [vnorm[l].mean(0) for l in range(nl)],  # [L][T]
            "per_head": [vnorm[l] for l in range(nl)],
        },
        "score_spread": {
            key: [s[key][0] for s in spread] for key in ("score_std", "score_range", "logdev_std", "logdev_range")
        },
        "score_spread_example": {
            "layer": spread_layer,
            "head": 0,
            "scores": spread[spread_layer]["scores"][0, 0],
            "log_dev": spread[spread_layer]["log_dev"][0, 0],
        },
    }


def per_layer_table(res: dict[str, Any]):
    """One row per layer: the headline numbers of each figure."""
    import pandas as pd

    fr = res["fractions"]
    rows = []
    windows = res.get("window") or [None] * len(res["sink_cos"]["min"])  # records made before windows: all keys
    for l in range(len(res["sink_cos"]["min"])):
        vn = torch.as_tensor(res["value_norms"]["mean"][l])
        row = {
            "layer": l,
            "window": windows[l],  # keys attended in Fig. 2 / 10 (None: all)
            "sink_cos_min": float(torch.as_tensor(res["sink_cos"]["min"][l]).min()),
            "sink_cos_mean": float(torch.as_tensor(res["sink_cos"]["mean"][l]).mean()),
            "kavg_cos_min": float(torch.as_tensor(res["kavg_cos"]["min"][l]).min()),
            "kavg_cos_mean": float(torch.as_tensor(res["kavg_cos"]["mean"][l]).mean()),
            "sink_avg_cos_mean": float(torch.as_tensor(res["sink_avg_cos"]["mean"][l]).mean()),
            "sink_avg_cos_lo": float(res["sink_avg_cos"]["lo"][l]),  # 95 % band over the windows
            "sink_avg_cos_hi": float(res["sink_avg_cos"]["hi"][l]),
            "v0_norm_over_median": float(vn[0] / vn[1:].median()) if vn.numel() > 1 else float("nan"),
            "score_std": float(torch.as_tensor(res["score_spread"]["score_std"][l]).mean()),
            "logdev_std": float(torch.as_tensor(res["score_spread"]["logdev_std"][l]).mean()),
            "score_range": float(torch.as_tensor(res["score_spread"]["score_range"][l]).mean()),
            "logdev_range": float(torch.as_tensor(res["score_spread"]["logdev_range"][l]).mean()),
        }
        for i, x in enumerate(fr):
            row[f"top{x * 100:g}%_mass"] = float(torch.as_tensor(res["top_mass"]["with_sink"][l])[i])
            row[f"top{x * 100:g}%_mass_no_sink"] = float(torch.as_tensor(res["top_mass"]["without_sink"][l])[i])
            for end in ("lo", "hi"):  # 95 % band over the passages
                row[f"top{x * 100:g}%_mass_{end}"] = float(torch.as_tensor(res["top_mass"][f"with_sink_{end}"][l])[i])
                row[f"top{x * 100:g}%_mass_no_sink_{end}"] = float(
                    torch.as_tensor(res["top_mass"][f"without_sink_{end}"][l])[i]
                )
        rows.append(row)
    return pd.DataFrame(rows)


def _np(x):
    return torch.as_tensor(x).detach().cpu().numpy()


# -- figures --------------------------------------------------------------------------------------------------


def _title(res: dict[str, Any], model_name: str, what: str) -> str:
    return f"{what} — {model_name}"


def _fig5_key_geometry(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Fig. 5: three heatmaps, layer × KV head (k_sink, k_avg and their cosine)."""
    import matplotlib.pyplot as plt
    import numpy as np

    nl = len(res["sink_cos"]["min"])
    panels = [
        (
            _np(torch.stack([torch.as_tensor(x) for x in res["sink_cos"]["min"]])),
            f"(a) k_sink across {opts.num_random} random inputs\n(min pairwise cos)",
        ),
        (
            _np(torch.stack([torch.as_tensor(x) for x in res["kavg_cos"]["min"]])),
            f"(b) k_avg across {opts.num_sentences} text windows\n(min pairwise cos)",
        ),
        (
            _np(torch.stack([torch.as_tensor(x) for x in res["sink_avg_cos"]["mean"]])),
            "(c) cos(k_sink, k_avg)\n(mean over windows)",
        ),
    ]
    hkv = panels[0][0].shape[1]
    fig, axes = plt.subplots(1, 3, figsize=(4.2 * 3, 0.35 * nl + 2.4), constrained_layout=True)
    for ax, (mat, title) in zip(axes, panels):
        im = ax.imshow(mat, cmap="RdBu_r", vmin=-1, vmax=1, aspect="auto", interpolation="nearest")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("KV head")
        ax.set_ylabel("layer")
        ax.set_xticks(range(hkv)) if hkv <= 16 else None
        ax.set_yticks(range(nl)) if nl <= 40 else None
        if mat.size <= 120:
            for (i, j), val in np.ndenumerate(mat):
                ax.text(
                    j,
                    i,
                    f"{val:.2f}",
                    ha="center",
                    va="center",
                    fontsize=7,
                    color="white" if abs(val) > 0.6 else "black",
                )
    fig.colorbar(im, ax=axes, shrink=0.8, label="cosine similarity")
    fig.suptitle(
        _title(res, model_name, "Key geometry (MagicPIG Fig. 5)")
        + f"; windows of {opts.sentence_len} tokens, keys post-RoPE",
        fontsize=11,
    )
    return common.save_figure(fig, out, "fig5_key_geometry")


def _fig2_top_mass(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Fig. 2a/b: the top-x % mass per layer, with and without the sink."""
    import matplotlib.pyplot as plt
    import numpy as np

    nl = len(res["sink_cos"]["min"])
    cmap = plt.get_cmap("viridis")
    fr = np.array(res["fractions"]) * 100
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True, sharey=True)
    for ax, key, title in (
        (axes[0], "with_sink", "(a) all keys"),
        (axes[1], "without_sink", f"(b) without the sink (first {opts.sink_tokens} key(s) dropped)"),
    ):
        for l in range(nl):
            ax.plot(
                fr, _np((res["top_mass"][key][l])), marker="o", ms=3, color=cmap(l / max(nl - 1, 1)), label=f"layer {l}"
            )
        ax.plot(fr, fr / 100, ls=":", color="grey", lw=1, label="uniform attention (x %)")
        ax.set_xscale("log")
        ax.set_xlabel("top keys used (% of the context, log scale)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("share of attention mass covered")
    axes[0].set_ylim(0, 1.02)
    handles, labels = axes[0].get_legend_handles_labels()
    if nl > 12:  # keep the legend readable: every k-th layer
        step = math.ceil(nl / 12)
        keep = [i for i in range(nl) if i % step == 0] + [nl]
        handles, labels = [handles[i] for i in keep], [labels[i] for i in keep]
    axes[1].legend(handles, labels, fontsize=7, loc="lower right", ncol=2)
    fig.suptitle(
        _title(res, model_name, "Attention long tail (MagicPIG Fig. 2a/b)")
        + f"; last {opts.num_queries} query rows of "
        + (
            f"{res['passages']} passages of {res['length']} tokens, mean over passages and heads"
            if res.get("passages", 1) > 1
            else f"a {res['length']}-token passage, mean over heads"
        ),
        fontsize=11,
    )
    return common.save_figure(fig, out, "fig2_top_mass")


def _fig2_5c_bands(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Per layer with bands: the smallest top-x % mass (Fig. 2, over passages) and cos(k_sink, k_avg) (Fig. 5c,
    over the text windows)."""
    import matplotlib.pyplot as plt
    import numpy as np

    nl = len(res["sink_cos"]["min"])
    layers = np.arange(nl)
    # the text windows)
    layers = np.arange(nl)
    tm = res["top_mass"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for key, label, color in (("with_sink", "all keys", "C0"), ("without_sink", "without the sink", "C1")):
        mid = np.array([float(torch.as_tensor(tm[key][l])[0]) for l in range(nl)])
        lo = np.array([float(torch.as_tensor(tm[f"{key}_lo"][l])[0]) for l in range(nl)])
        hi = np.array([float(torch.as_tensor(tm[f"{key}_hi"][l])[0]) for l in range(nl)])
        axes[0].plot(layers, mid, marker="o", ms=3, color=color, label=label)
        axes[0].fill_between(layers, lo, hi, color=color, alpha=0.2, lw=0)
    axes[0].set_ylim(0, 1.02)
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel(f"attention mass of the top {res['fractions'][0] * 100:g} % of keys")
    axes[0].set_title(
        f"(Fig. 2) mean over {res['passages']} passage(s) of {res['length']} tokens, 95 % band", fontsize=10
    )
    axes[0].legend(fontsize=8)
    sc = res["sink_avg_cos"]
    mid = np.array([float(torch.as_tensor(sc["mean"][l]).mean()) for l in range(nl)])
    axes[1].plot(layers, mid, marker="o", ms=3, color="C2")
    axes[1].fill_between(
        layers, np.array(sc["lo"], dtype=float), np.array(sc["hi"], dtype=float), color="C2", alpha=0.2, lw=0
    )
    axes[1].axhline(0, color="grey", lw=0.8)
    axes[1].set_ylim(-1.02, 1.02)
    axes[1].set_xlabel("layer")
    axes[1].set_ylabel("cos(k_sink, k_avg), mean over KV heads")
    axes[1].set_title(
        f"(Fig. 5c) mean over {opts.num_sentences} windows of {opts.sentence_len} tokens, 95 % band", fontsize=10
    )
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(_title(res, model_name, "Per layer, with bands (MagicPIG Fig. 2, 5c)"), fontsize=11)
    return common.save_figure(fig, out, "fig2_5c_per_layer_bands")


def _fig10_score_spread(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Fig. 10: the spread of q·k/√d against log‖v − o‖."""
    import matplotlib.pyplot as plt
    import numpy as np

    nl = len(res["sink_cos"]["min"])
    layers = np.arange(nl)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    ss = res["score_spread"]
    w = 0.38
    axes[0].bar(
        layers - w / 2,
        [float(torch.as_tensor(ss["score_range"][l]).mean()) for l in range(nl)],
        w,
        label=r"$q k_i^T/\sqrt{d}$",
    )
    axes[0].bar(
        layers + w / 2,
        [float(torch.as_tensor(ss["logdev_range"][l]).mean()) for l in range(nl)],
        w,
        label=r"$\log\|v_i - o\|$",
    )
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("range over the keys (max − min), mean over heads")
    axes[0].set_title("(a) spread in one decoding step, per layer", fontsize=10)
    axes[0].legend(fontsize=8)
    axes[0].set_xticks(layers) if nl <= 40 else None
    ex = res["score_spread_example"]
    s = _np((ex["scores"]))
    d = _np((ex["log_dev"]))
    axes[1].plot(s - s.mean(), lw=0.8, label=r"$q k_i^T/\sqrt{d}$ (minus its mean)")
    axes[1].plot(d - d.mean(), lw=0.8, label=r"$\log\|v_i - o\|$ (minus its mean)")
    axes[1].set_xlabel("key position i")
    axes[1].set_ylabel("value − mean over keys (nats)")
    axes[1].set_title(f"(b) layer {ex['layer']}, head {ex['head']}, last query of the passage", fontsize=10)
    axes[1].legend(fontsize=8)
    fig.suptitle(
        _title(res, model_name, "Score vs value-deviation spread (MagicPIG Fig. 10)")
        + f"; {res['length']}-token passage",
        fontsize=11,
    )
    return common.save_figure(fig, out, "fig10_score_spread")


def _fig11_value_norms(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Fig. 11: value norms by position."""
    import matplotlib.pyplot as plt
    import numpy as np

    nl = len(res["sink_cos"]["min"])
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(8, 4), constrained_layout=True)
    for l in range(nl):
        ax.plot(_np((res["value_norms"]["mean"][l])), lw=0.9, color=cmap(l / max(nl - 1, 1)), label=f"layer {l}")
    ax.set_xlabel("token position i (0 = sink)")
    ax.set_ylabel(r"$\|v_i\|$ (mean over windows and KV heads)")
    allv = np.concatenate([_np((x)) for x in res["value_norms"]["mean"]])
    if allv.min() > 0 and allv.max() / allv.min() > 10:
        ax.set_yscale("log")
    ax.grid(alpha=0.3, which="both")
    handles, labels = ax.get_legend_handles_labels()
    if nl > 12:
        step = math.ceil(nl / 12)
        handles, labels = handles[::step], labels[::step]
    ax.legend(handles, labels, fontsize=7, ncol=2)
    ax.set_title(
        _title(res, model_name, "Value norms by position (MagicPIG Fig. 11)")
        + f"\n{opts.num_sentences} windows of {opts.sentence_len} tokens",
        fontsize=10,
    )
    return common.save_figure(fig, out, "fig11_value_norms")


FIGURES = (_fig5_key_geometry, _fig2_top_mass, _fig2_5c_bands, _fig10_score_spread, _fig11_value_norms)


def figures(res: dict[str, Any], out: Path, model_name: str, opts: GeometryOptions) -> list[Path]:
    """Every figure of the geometry analysis (``FIGURES``), written under ``out``; their paths."""
    return [p for fig in FIGURES for p in fig(res, out, model_name, opts)]


def summary(result: dict[str, Any]):
    """The headline numbers over layers (the full per-layer table, one column per figure quantity and top-x
    fraction, is ``result["table_file"]``): sink and mean-key cosines, the first value's norm, score spread, and
    the attention mass of the smallest top-x fraction with and without the sink."""
    fr = result["result"]["fractions"][0]
    cols = [
        "sink_cos_min",
        "kavg_cos_mean",
        "v0_norm_over_median",
        "score_std",
        "logdev_std",
        f"top{fr * 100:g}%_mass",
        f"top{fr * 100:g}%_mass_no_sink",
    ]
    return common.layer_summary(result["table"], cols)


def run(model_cfg, opts: GeometryOptions) -> dict[str, Any]:
    """Loads the model, measures, writes geometry.json, geometry_per_layer.csv and the figures."""
    return common.run_measured("geometry", model_cfg, opts, measure, per_layer_table, figures)
