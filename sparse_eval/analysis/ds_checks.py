"""Double Sparsity calibration checks (DS §4.1 + App. A Fig. 7b; §5.2 + App. B.2 Fig. 8).

    python -m sparse_eval.analysis analysis=ds_checks model=stories260k [analysis.ratios=[0.0625,0.125,0.25,0.5] ...]

* Channel overlap (Fig. 7b): the offline outlier channels of each layer and query head come from calibration
  text, ranked as ``sparse_eval.calibrate`` ranks them (``channel_statistics``: mean over tokens of |q_c·k_c| of
  each token with its own key, post-RoPE, for ``qk``; |q_c| / |k_c| for ``q`` / ``k``).  The online outliers of
  one decoding step t are the channels c with the largest S_c = (1/t) Σ_{j≤t} |q_{t,c} k_{j,c}| (the terms of
  A = Σ_c Q_c K_c that step actually sums; |q_{t,c}| for ``q``; mean_j |k_{j,c}| for ``k``) on *different*
  text (the windows after the calibration windows).  For a channel ratio ρ the overlap is
  |top_r(offline) ∩ top_r(online)| / r with r = max(1, round(ρ·d)), averaged over steps, heads and layers
  (ratios giving the same r are merged; the reported ratio is r/d).
  A random channel set overlaps ρ on average (drawn as a reference).  The paper: 0.95 once ρ > 0.25.
* Consecutive-layer similarity (Fig. 8): cosine similarity per token between the residual-stream inputs of
  layers l and l+1 (the "embeddings" DS-Offload feeds to the next layer's query projection), mean over tokens;
  also the similarity of what DS-Offload actually predicts, per query head: q̂_{l+1} = W_q^{l+1}·norm^{l+1}(x_l)
  against the true q_{l+1} = W_q^{l+1}·norm^{l+1}(x_{l+1}) (before RoPE; RoPE rotates both alike, so the cosine
  is the same after it).  The paper (Llama-2-7B): > 0.9 except the first two and the last layer pairs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from . import common
from .capture import capture_layer_inputs, capture_qkv, decoder_layers, model_shape

CHANNEL_TYPES = ("qk", "q", "k")
DEFAULT_RATIOS = [0.03125, 0.0625, 0.125, 0.25, 0.375, 0.5, 0.75, 1.0]


@dataclass
class DSCheckOptions(common.TextOptions):
    channel_type: str = "qk"  # qk (the paper's choice) | q | k
    ratios: list[float] = field(default_factory=lambda: list(DEFAULT_RATIOS))  # channel ratio r/d
    block_size: int | None = None  # calibration / online window (tokens); null: min(context, 512) (authors: 512)
    calib_blocks: int = 4  # calibration windows (authors: 256 blocks of Pile validation text)
    online_blocks: int = 2  # held-out windows decoded "online"
    num_queries: int = 32  # decoding steps per online window (its last query rows)
    hidden_blocks: int = 2  # windows for Fig. 8
    rope: str = "authors"  # calibrate.py's setting: qk after RoPE, q/k before (authors' script)
    seed: int = 0

    def validate(self) -> None:
        if self.channel_type not in CHANNEL_TYPES:
            raise ValueError(f"channel_type={self.channel_type!r}; valid: {list(CHANNEL_TYPES)}")
        bad = [r for r in self.ratios if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 < r <= 1]
        if bad or not self.ratios:
            raise ValueError(f"ratios={self.ratios!r}: each a channel ratio in (0, 1]")
        for name in ("calib_blocks", "online_blocks", "num_queries", "hidden_blocks"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r}: must be >= 1")


# -- channel ranking ------------------------------------------------------------------------------------------


def rank_channels(score: torch.Tensor) -> torch.Tensor:
    """[..., D] -> channel indices by decreasing score, ties by lower index (as ``sparse_eval.calibrate``)."""
    return torch.sort(score, dim=-1, descending=True, stable=True).indices


def offline_scores(
    model: Any, blocks: torch.Tensor, channel_type: str, rope: str = "authors", progress: bool = False
) -> torch.Tensor:
    """Calibration statistic [L, H, D] (H = query heads for qk/q, KV heads for k), by calibrate.py's code."""
    from ..calibrate import channel_statistics

    stats = channel_statistics(model, [b.unsqueeze(0) for b in blocks], rope, progress=progress)
    return stats[channel_type].float()


def online_scores(q: torch.Tensor, k: torch.Tensor, channel_type: str) -> torch.Tensor:
    """Per decoding step: q [B, Hq, Q, D] (rows aligned to the last Q keys), k [B, Hkv, N, D] (post-RoPE).

    qk: S[b, h, t, c] = mean_{j ≤ t} |q_{t,c} k_{j,c}|   -> [B, Hq, Q, D]
    q:  |q_{t,c}|                                      -> [B, Hq, Q, D]
    k:  mean_{j ≤ t} |k_{j,c}|                          -> [B, Hkv, Q, D]
    """
    b, hq, ql, d = q.shape
    n = k.shape[2]
    g = hq // k.shape[1]
    ak = k.abs().double()
    csum = ak.cumsum(2)  # [B, Hkv, N, D]
    rows = torch.arange(n - ql, n, device=k.device)  # key index of each query row
    mean_k = csum[:, :, rows] / (rows + 1).view(1, 1, ql, 1).double()  # [B, Hkv, Q, D]
    if channel_type == "k":
        return mean_k.float()
    if channel_type == "q":
        return q.abs().float()
    return (q.abs().double() * mean_k.repeat_interleave(g, 1)).float()


def topk_overlap(offline_rank: torch.Tensor, online_score: torch.Tensor, ratios: Sequence[float]) -> torch.Tensor:
    """offline_rank long [H, D] (best first), online_score [..., H, D] -> overlap [..., H, F] for each ratio."""
    d = offline_rank.shape[-1]
    on_rank = rank_channels(online_score)
    out = []
    for rho in ratios:
        r = max(1, int(round(float(rho) * d)))
        off = torch.zeros(offline_rank.shape, dtype=torch.bool).scatter_(-1, offline_rank[..., :r], True)
        on = torch.zeros(on_rank.shape, dtype=torch.bool).scatter_(-1, on_rank[..., :r], True)
        out.append((off & on).sum(-1).float() / r)
    return torch.stack(out, -1)


# -- Fig. 8 ---------------------------------------------------------------------------------------------------


def layer_similarity(model: Any, ids: torch.Tensor) -> dict[str, list[float]]:
    """Mean over tokens of cos(x_l, x_{l+1}) (residual inputs) and of cos(q̂_{l+1}, q_{l+1}) (mean over heads),
    for l = 0 … L−2; also the same without the first token (the attention sink's huge activations)."""
    inputs = capture_layer_inputs(model, ids)
    layers = decoder_layers(model)
    nl = len(layers)
    hid, hid_ns, qcos, qcos_ns = [], [], [], []
    with torch.inference_mode():
        for l in range(nl - 1):
            x0, x1 = inputs[l]["hidden"], inputs[l + 1]["hidden"]  # [B, T, H]
            c = torch.nn.functional.cosine_similarity(x0.double(), x1.double(), dim=-1)  # [B, T]
            hid.append(float(c.mean()))
            hid_ns.append(float(c[:, 1:].mean()) if c.shape[1] > 1 else float("nan"))
            nxt = layers[l + 1]
            attn = nxt.self_attn
            dev = next(model.parameters()).device
            dt = next(model.parameters()).dtype
            norm = nxt.input_layernorm
            q_pred = attn.q_proj(norm(x0.to(dev, dt))).float().cpu()
            q_true = attn.q_proj(inputs[l + 1]["attn_input"].to(dev, dt)).float().cpu()
            hd = model_shape(model)["head_dim"]
            qp = q_pred.view(*q_pred.shape[:2], -1, hd)
            qt = q_true.view(*q_true.shape[:2], -1, hd)
            cq = torch.nn.functional.cosine_similarity(qp.double(), qt.double(), dim=-1)  # [B, T, Hq]
            qcos.append(float(cq.mean()))
            qcos_ns.append(float(cq[:, 1:].mean()) if cq.shape[1] > 1 else float("nan"))
    return {"hidden_cos": hid, "hidden_cos_no_first": hid_ns, "query_cos": qcos, "query_cos_no_first": qcos_ns}


# -- the run --------------------------------------------------------------------------------------------------


def measure(model: Any, tokenizer: Any, context: int, opts: DSCheckOptions, show: bool = True) -> dict[str, Any]:
    """The checks' raw numbers; ``show``: progress bars (calibration forwards, then the online windows and the
    layer similarity) with the time left."""
    opts.validate()
    shape = model_shape(model)
    block = min(context, 512) if opts.block_size is None else int(opts.block_size)
    if not 2 <= block <= context:
        raise ValueError(f"block_size={block}: must lie in [2, {context}]")
    if opts.num_queries >= block:
        raise ValueError(f"num_queries={opts.num_queries} must be smaller than block_size={block}")
    text, origin = opts.load_text()
    calib = common.token_windows(tokenizer, text, block, opts.calib_blocks)
    online = common.token_windows(tokenizer, text, block, opts.online_blocks, skip=opts.calib_blocks)
    off = offline_scores(model, calib, opts.channel_type, opts.rope, progress=show)  # [L, H, D]
    off_rank = rank_channels(off)
    d = shape["head_dim"]  # ratios as the channel counts they give (r = max(1, round(ρ·d))), duplicates merged
    ratios = sorted({max(1, int(round(float(r) * d))) / d for r in opts.ratios})
    acc: dict[int, torch.Tensor] = {}
    bar = common.progress(online.shape[0] + 1, "ds_checks: online windows", "window", show)
    for i in range(online.shape[0]):
        bar.update()
        pre_rope = opts.rope == "before" or (opts.rope == "authors" and opts.channel_type in ("q", "k"))
        if pre_rope:  # the side of RoPE the calibration statistic was taken on
            cap = _pre_rope_qk(model, online[i : i + 1], opts.num_queries)
        else:
            cap = {l: (c.q, c.k) for l, c in capture_qkv(model, online[i : i + 1], query_rows=opts.num_queries).items()}
        for l, (q, k) in cap.items():
            s = online_scores(q, k, opts.channel_type)[0].transpose(0, 1)  # [Q, H, D]
            ov = topk_overlap(off_rank[l], s, ratios).mean(0)  # [H, F]
            acc[l] = acc[l] + ov if l in acc else ov
    overlap = {l: acc[l] / online.shape[0] for l in sorted(acc)}  # [H, F]
    hidden = (
        common.token_windows(tokenizer, text, block, opts.hidden_blocks, skip=opts.calib_blocks + opts.online_blocks)
        if _enough(tokenizer, text, block, opts.calib_blocks + opts.online_blocks + opts.hidden_blocks)
        else online
    )
    bar.set_description("ds_checks: layer similarity")
    sim = layer_similarity(model, hidden)
    bar.update()
    bar.close()
    return {
        "model_shape": shape,
        "text": origin,
        "block_size": block,
        "ratios": ratios,
        "channel_type": opts.channel_type,
        "overlap_per_layer_head": [overlap[l] for l in range(shape["num_layers"])],  # [L][H][F]
        "overlap_per_layer": [overlap[l].mean(0) for l in range(shape["num_layers"])],  # [L][F]
        "overlap_mean": torch.stack([overlap[l].mean(0) for l in overlap]).mean(0),  # [F]
        "channels": [int(round(r * d)) for r in ratios],
        "random_overlap": ratios,  # expected overlap of a random set of r channels: r / d
        "layer_similarity": sim,
    }


def _enough(tokenizer, text, block, count) -> bool:
    n = len(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return n >= count * (block - 1)


def _pre_rope_qk(model, ids: torch.Tensor, rows: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: q (last ``rows`` rows) and k before RoPE (q_proj / k_proj outputs, + q_norm / k_norm where the
    model has them), [B, H, T, D] float32."""
    inputs = capture_layer_inputs(model, ids)
    dev, dt = next(model.parameters()).device, next(model.parameters()).dtype
    out = {}
    with torch.inference_mode():
        for layer, dec in enumerate(decoder_layers(model)):
            attn = dec.self_attn
            h = inputs[layer]["attn_input"]
            d = attn.head_dim
            q = attn.q_proj(h.to(dev, dt)).view(*h.shape[:2], -1, d)
            k = attn.k_proj(h.to(dev, dt)).view(*h.shape[:2], -1, d)
            if hasattr(attn, "q_norm"):
                q = attn.q_norm(q)
            if hasattr(attn, "k_norm"):
                k = attn.k_norm(k)
            q, k = q.transpose(1, 2).float().cpu(), k.transpose(1, 2).float().cpu()
            out[layer] = (q[:, :, -rows:], k)
    return out


def per_layer_table(res: dict[str, Any]):
    import pandas as pd

    rows = []
    sim = res["layer_similarity"]
    nl = len(res["overlap_per_layer"])
    for l in range(nl):
        row = {"layer": l}
        for i, r in enumerate(res["ratios"]):
            row[f"overlap@{r:g}"] = float(torch.as_tensor(res["overlap_per_layer"][l])[i])
        if l < nl - 1:
            row["hidden_cos_to_next"] = sim["hidden_cos"][l]
            row["hidden_cos_to_next_no_first"] = sim["hidden_cos_no_first"][l]
            row["pred_query_cos_next"] = sim["query_cos"][l]
        rows.append(row)
    return pd.DataFrame(rows)


def _np(x):
    return torch.as_tensor(x).detach().cpu().numpy()


def figures(res: dict[str, Any], out: Path, model_name: str, opts: DSCheckOptions) -> list[Path]:
    import matplotlib.pyplot as plt
    import numpy as np

    paths: list[Path] = []
    ratios = np.array(res["ratios"])
    nl = len(res["overlap_per_layer"])
    fig, ax = plt.subplots(figsize=(7, 4.3), constrained_layout=True)
    cmap = plt.get_cmap("viridis")
    for l in range(nl):
        ax.plot(
            ratios,
            _np((res["overlap_per_layer"][l])),
            lw=0.8,
            alpha=0.6,
            color=cmap(l / max(nl - 1, 1)),
            label=f"layer {l}" if nl <= 12 else None,
        )
    ax.plot(ratios, _np((res["overlap_mean"])), color="black", lw=2, marker="o", label="mean over layers")
    ax.plot(ratios, res["random_overlap"], ls=":", color="grey", label="random channels (= ratio)")
    ax.axhline(0.95, ls="--", color="C3", lw=0.8, label="0.95 (paper, ratio > 0.25)")
    ax.set_xlabel("channel ratio r / d (top channels compared)")
    ax.set_ylabel("overlap of offline and online outlier channels")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(
        f"DS offline vs online outlier channels (DS Fig. 7b) — {model_name}\n"
        f"{opts.channel_type} channels; calibration {opts.calib_blocks}×{res['block_size']} tokens, "
        f"online {opts.online_blocks}×{opts.num_queries} decoding steps",
        fontsize=10,
    )
    paths += common.save_figure(fig, out, "ds_fig7b_channel_overlap")

    sim = res["layer_similarity"]
    pairs = [f"{l}-{l + 1}" for l in range(nl - 1)]
    x = np.arange(nl - 1)
    fig, ax = plt.subplots(figsize=(max(6, 0.35 * nl + 3), 4.2), constrained_layout=True)
    w = 0.38
    ax.bar(x - w / 2, sim["hidden_cos"], w, label="hidden states x_l vs x_{l+1}")
    ax.bar(x + w / 2, sim["query_cos"], w, label="DS-Offload query: W_q norm(x_l) vs q_{l+1} (mean over heads)")
    ax.axhline(0.9, ls="--", color="C3", lw=0.8, label="0.9 (paper: most pairs above)")
    ax.set_xticks(x)
    ax.set_xticklabels(pairs, rotation=90 if nl > 16 else 0, fontsize=8)
    ax.set_xlabel("layer pair")
    ax.set_ylabel("cosine similarity (mean over tokens)")
    lo = min(0.0, float(np.nanmin(sim["hidden_cos"] + sim["query_cos"])))
    ax.set_ylim(lo, 1.05)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(
        f"Similarity of consecutive layers (DS Fig. 8) — {model_name}\n"
        f"{opts.hidden_blocks}×{res['block_size']}-token windows",
        fontsize=10,
    )
    paths += common.save_figure(fig, out, "ds_fig8_layer_similarity")
    return paths


def summary(result: dict[str, Any]):
    """Channel overlap at each ratio and the layer-to-layer similarities, over layers (per layer:
    ``result["table_file"]``)."""
    table = result["table"]
    return common.layer_summary(table, [c for c in table.columns if c != "layer"])


def run(model_cfg, opts: DSCheckOptions) -> dict[str, Any]:
    return common.run_measured("ds_checks", model_cfg, opts, measure, per_layer_table, figures)
