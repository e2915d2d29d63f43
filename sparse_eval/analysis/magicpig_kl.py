"""MagicPIG's (K, L) for a target Cost2 on a given model: the paper tuned (K, L) for head dimension 128 (Llama),
where (10, 150) attends about 2 % of the keys (MagicPIG Table 9); a model with other heads needs its own.

    python -m sparse_eval.analysis analysis=magicpig_kl model=gemma3_270m analysis.length=16384 \
        analysis.target_cost2=0.02

On real text (``passages`` windows of ``length`` tokens; the last ``num_queries`` rows of each, every sparse
layer and query head), for each K in ``Ks`` the smallest L ≤ ``max_L`` whose *expected* Cost2 reaches
``target_cost2``:

    E[Cost2] = ( |static| + Σ_{i ∉ static} u_i ) / n,    u_i = P[Binomial(L, p_i^K) ≥ min_collisions]      (eq. 10)
    p_i = 1 − arccos(cos(q, k_i − μ)) / π,    μ = the mean of the non-static keys (§4.3 centering)

(``methods.magicpig.sampling_probability`` / ``collision_probability``: the method's own eq. 10).  E[Cost2] grows
with L for a fixed K, so the search is a bisection.  Each chosen (K, L) then runs through the method itself
(``methods.attend``, seeds 0 … ``repeats`` − 1) on the same tensors: its measured Cost2 and est_error beside
the expectation, so the choice rests on what the method does, not only on the formula.

Which keys a (K, L) samples (``top_keys``, for the chosen pairs and the ``pairs`` given, by default the paper's
Table 3 settings): with w_i the layer's own attention weights over the row's keys,

    E[kept mass] = Σ_{i ∈ static} w_i + Σ_{i ∉ static} w_i u_i

beside the method's measured kept mass (``kept_mass_and_recall``), and over the ``top_frac`` candidate keys of
largest w_i (the keys that carry the attention): their mean cos(q, k_i − μ), p_i, u_i and share of the mass.
An estimator that samples its heavy keys with u_i ≪ 1 divides their few hits by u_i (eq. 11) and has a large
variance; one that samples them with u_i ≈ 1 does not.

Sparse layers: those MagicPIG makes sparse on this model (``dense_layers``, default [first, mid], and layers with a
sliding window of their own left dense, as ``sliding_layers=dense``); ``layers`` overrides.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..methods import attend, build_method, make_config
from ..methods.core import key_validity, static_keys
from ..methods.magicpig import MagicPIG, collision_probability, sampling_probability
from . import common
from .capture import capture_qkv, model_shape
from .geometry import attention_probs


@dataclass
class MagicPIGKLOptions(common.TextOptions):
    target_cost2: float = 0.02  # the paper's (10, 150) on Llama-3.1-8B: about 2 % (Table 9)
    Ks: list[int] = field(default_factory=lambda: [6, 7, 8, 9, 10, 11, 12])
    max_L: int = 600
    min_collisions: int = 2  # eq. 10
    sink: int = 4  # MagicPIG's static keys (§5.1)
    local: int = 64
    length: int | None = None  # context (tokens, BOS included); null: min(model context, 16384)
    passages: int = 1
    num_queries: int = 4  # the last query rows of each passage (decoding steps)
    layers: Any = None  # null: the layers MagicPIG makes sparse on this model
    repeats: int = 2  # hash seeds of the check through the method
    pairs: list[list[int]] = field(default_factory=lambda: [[10, 150], [9, 120], [8, 75]])  # also checked (Table 3)
    top_frac: float = 0.01  # the heaviest candidate keys of a row (by attention weight) whose sampling is reported

    def validate(self) -> None:
        if not 0 < self.target_cost2 < 1:
            raise ValueError(f"target_cost2={self.target_cost2}: a fraction of the keys in (0, 1), e.g. 0.02")
        bad = [k for k in self.Ks if isinstance(k, bool) or not isinstance(k, int) or k < 1]
        if bad or not self.Ks:
            raise ValueError(f"Ks={self.Ks!r}: a list of positive ints (hash bits per table), e.g. [8, 9, 10]")
        if self.max_L < self.min_collisions or self.min_collisions < 1:
            raise ValueError(
                f"max_L={self.max_L}, min_collisions={self.min_collisions}: need 1 <= min_collisions <= max_L"
            )
        for kl in self.pairs:
            if not (isinstance(kl, (list, tuple)) and len(kl) == 2 and all(isinstance(x, int) and x >= 1 for x in kl)):
                raise ValueError(
                    f"pairs={self.pairs!r}: a list of [K, L] pairs of positive ints, e.g. [[10,150],[8,75]]"
                )
        if not 0 < self.top_frac <= 1:
            raise ValueError(f"top_frac={self.top_frac}: a fraction of the candidate keys in (0, 1], e.g. 0.01")
        for name in ("passages", "num_queries", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.sink < 0 or self.local < 0:
            raise ValueError(f"sink={self.sink}, local={self.local}: must be >= 0")


def sparse_layers(model: Any, num_layers: int) -> list[int]:
    """The layers MagicPIG (its defaults) runs sparse on ``model``: not its dense layers, not a sliding-window layer."""
    from ..models.inspection import sliding_layers

    sliding = set(sliding_layers(model))
    dense = build_method(make_config(MagicPIG.name, {})).dense_layer_set(num_layers, sliding)
    return [l for l in range(num_layers) if l not in dense and l not in sliding]


def bit_agreement(q: torch.Tensor, k: torch.Tensor, sink: int, local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p_i (eq. 10) of every (query head, row, candidate key) and the static count per row.
    q [1, Hq, Q, D], k [1, Hkv, N, D] -> p float64 [Hq, Q, N] (NaN where not a candidate), static [Q]."""
    _, hq, ql, _ = q.shape
    hkv, n = k.shape[1], k.shape[2]
    valid = key_validity(None, 1, ql, n, q.device)  # [1, 1, Q, N]
    static, _ = static_keys(valid, sink, local)
    cand = (valid & ~static)[0, 0]  # [Q, N]
    first = cand[0]  # the first row's candidates: the prompt's non-static keys (μ as the authors, cache_ref.py:239)
    kk = k[0].double()  # [Hkv, N, D]
    mu = kk[:, first].mean(1, keepdim=True) if first.any() else torch.zeros_like(kk[:, :1])
    kc = (kk - mu).repeat_interleave(hq // hkv, 0)  # [Hq, N, D]
    cos = torch.einsum("hqd,hnd->hqn", q[0].double(), kc) / (
        q[0].double().norm(dim=-1)[..., None] * kc.norm(dim=-1)[:, None, :]
    ).clamp_min(1e-30)
    p = collision_probability(cos).masked_fill(~cand[None], float("nan"))
    return p, static[0, 0].sum(-1).double()


def expected_cost2(ps: list[tuple[torch.Tensor, torch.Tensor]], K: int, L: int, m: int) -> float:
    """Mean over (layer, passage) steps, heads and rows of (|static| + Σ u_i) / n."""
    vals = []
    for p, n_static in ps:
        u = sampling_probability(p.nan_to_num(0.5), K, L, m).masked_fill(p.isnan(), 0.0)  # [Hq, Q, N]
        n = (~p.isnan()).sum(-1) + n_static  # [Hq, Q]: keys of each row
        vals.append(((u.sum(-1) + n_static) / n.clamp_min(1)).mean())
    return float(torch.stack(vals).mean())


def top_keys(c: Any, p: torch.Tensor, K: int, L: int, m: int, top_frac: float) -> dict[str, float]:
    """How (K, L) samples the keys that carry one captured step's attention (means over query heads and rows).
    c: a capture (q [1, Hq, Q, D], k [1, Hkv, N, D], scaling), p [Hq, Q, N] from ``bit_agreement`` (NaN where not
    a candidate).  w = ``geometry.attention_probs`` over the row's causal keys (the layer's own weights: a
    full-context layer), u = eq. 10.  Returns static_mass Σ_static w, expected_mass Σ_static w + Σ_cand w·u, and
    over the ceil(top_frac · candidates) candidates of largest w: top_mass Σ w, top_cos, top_p, top_u (means) and
    top_mass_sampled Σ w·u / Σ w (the share of their mass sampled in expectation)."""
    w = attention_probs(c.q, c.k, c.scaling)[0].double()  # [Hq, Q, N], 0 on keys the row does not attend
    cand = ~p.isnan()
    u = sampling_probability(p.nan_to_num(0.5), K, L, m).masked_fill(~cand, 0.0)
    static_mass = (w * ~cand).sum(-1)  # [Hq, Q]: the attended keys that are not candidates are the static ones
    t = max(1, math.ceil(top_frac * int(cand.sum(-1).min())))
    top = w.masked_fill(~cand, -1.0).topk(t, dim=-1).indices  # [Hq, Q, t]
    wt, pt, ut = w.gather(-1, top), p.gather(-1, top), u.gather(-1, top)
    cos = torch.cos((1.0 - pt) * math.pi)  # p = 1 − arccos(cos)/π
    return {
        "static_mass": float(static_mass.mean()),
        "expected_mass": float((static_mass + (w * u).sum(-1)).mean()),
        "top_keys": t,
        "top_mass": float(wt.sum(-1).mean()),
        "top_cos": float(cos.mean()),
        "top_p": float(pt.mean()),
        "top_u": float(ut.mean()),
        "top_mass_sampled": float(((wt * ut).sum(-1) / wt.sum(-1).clamp_min(1e-300)).mean()),
    }


def smallest_L(ps, K: int, target: float, m: int, max_L: int) -> int | None:
    """The smallest L in [m, max_L] with E[Cost2] ≥ target (E grows with L); None when max_L does not reach it."""
    lo, hi = m, max_L
    if expected_cost2(ps, K, hi, m) < target:
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if expected_cost2(ps, K, mid, m) >= target:
            hi = mid
        else:
            lo = mid + 1
    return lo


def check(caps: list[Any], ps: list[tuple[torch.Tensor, torch.Tensor]], K: int, L: int, opts: MagicPIGKLOptions):
    """(K, L) on every captured step (``caps[i]`` with ``ps[i]`` from ``bit_agreement``): one dict per step with
    the method's measured cost2, est_error and kept mass (``methods.attend``, means over seeds 0 … repeats − 1)
    beside ``top_keys``'s eq.-10 terms."""
    rows = []
    for c, (p, _) in zip(caps, ps):
        got = []
        for seed in range(opts.repeats):
            _, st = attend(
                MagicPIG.name,
                c.q,
                c.k,
                c.v,
                scaling=c.scaling,
                layer_idx=c.layer,
                K=K,
                L=L,
                min_collisions=opts.min_collisions,
                sink=opts.sink,
                local=opts.local,
                seed=seed,
            )
            got.append([float(st[x].float().mean()) for x in ("cost2", "est_error", "mass")])
        mean = torch.tensor(got, dtype=torch.float64).mean(0).tolist()
        rows.append(
            {
                "layer": c.layer,
                "cost2": mean[0],
                "est_error": mean[1],
                "measured_mass": mean[2],
                "cost2_by_seed": [g[0] for g in got],
                **top_keys(c, p, K, L, opts.min_collisions, opts.top_frac),
            }
        )
    return rows


def measure(model: Any, tokenizer: Any, context: int, opts: MagicPIGKLOptions, progress: bool = False) -> dict:
    """``records``: one per K (the chosen L, its expected Cost2, the method's measured Cost2, est_error and kept
    mass); ``top_keys``: one per (K, L, layer, passage) for the chosen pairs and ``pairs`` (``check``)."""
    opts.validate()
    nl = model_shape(model)["num_layers"]
    length = min(context, 16384) if opts.length is None else int(opts.length)
    if not opts.num_queries < length <= context:
        raise ValueError(f"length={length}: must lie in ({opts.num_queries}, {context}] (the model's context)")
    if opts.layers is not None:
        layers = common.full_context_layers(model, opts.layers, nl, length)
    else:
        layers = sparse_layers(model, nl)
    if not layers:
        raise ValueError("no sparse layer on this model for MagicPIG's defaults: give analysis.layers=[...]")
    text, origin = opts.load_text()
    ids = common.token_windows(tokenizer, text, length, opts.passages)  # [P, length]
    caps, passage = [], []
    with common.progress(opts.passages, "magicpig_kl: forwards", "passage", progress) as bar:
        for p in range(opts.passages):
            cap = capture_qkv(model, ids[p : p + 1], layers=layers, query_rows=opts.num_queries)
            caps += [cap[l] for l in layers]
            passage += [p] * len(layers)
            bar.update()
    ps = [bit_agreement(c.q, c.k, opts.sink, opts.local) for c in caps]
    static_frac = float(torch.stack([(st / ((~p.isnan()).sum(-1) + st)).mean() for p, st in ps]).mean())
    if static_frac >= opts.target_cost2:
        raise ValueError(
            f"target_cost2={opts.target_cost2}: the static keys (sink {opts.sink} + local {opts.local}) "
            f"are already {static_frac:.3f} of a {length}-token row; give a longer analysis.length or a "
            f"higher target"
        )
    common_fields = {"length": length, "passages": opts.passages, "text": origin}
    records, per_step = [], []
    chosen = []
    for K in opts.Ks:
        L = smallest_L(ps, K, opts.target_cost2, opts.min_collisions, opts.max_L)
        rec = {
            "K": K,
            "L": L,
            "target_cost2": opts.target_cost2,
            "static_frac": static_frac,
            "expected_cost2": None,
            "measured_cost2": None,
            "measured_cost2_sd": None,
            "est_error": None,
            "expected_mass": None,
            "measured_mass": None,
            **common_fields,
            "layers": list(layers),
        }
        if L is not None:
            chosen.append((K, L))
            rows = check(caps, ps, K, L, opts)
            per_step += [dict(r, K=K, L=L, chosen=True, passage=pp) for r, pp in zip(rows, passage)]
            by_seed = torch.tensor([r["cost2_by_seed"] for r in rows], dtype=torch.float64).mean(0)  # [repeats]
            rec["expected_cost2"] = expected_cost2(ps, K, L, opts.min_collisions)
            rec["measured_cost2"] = float(by_seed.mean())
            rec["measured_cost2_sd"] = float(by_seed.std()) if len(by_seed) > 1 else 0.0
            for key in ("est_error", "expected_mass", "measured_mass"):
                rec[key] = sum(r[key] for r in rows) / len(rows)
        records.append(rec)
    for K, L in opts.pairs:
        if (K, L) not in chosen:
            rows = check(caps, ps, K, L, opts)
            per_step += [dict(r, K=K, L=L, chosen=False, passage=pp) for r, pp in zip(rows, passage)]
    for r in per_step:
        r.pop("cost2_by_seed")
        r.update(common_fields)
    return {"records": records, "top_keys": per_step}


def top_keys_table(per_step: list[dict[str, Any]]):
    """One row per (K, L, layer) and a 'mean' layer row per (K, L): each column's mean over passages (and, for
    the 'mean' rows, over layers), with the 95 % bootstrap band of top_mass_sampled and expected_mass over
    passages (``common.passage_band``)."""
    import pandas as pd

    df = pd.DataFrame(per_step)
    if df.empty:
        return df
    val = ["cost2", "est_error", "static_mass", "expected_mass", "measured_mass", "top_mass", "top_cos", "top_p"]
    val += ["top_u", "top_mass_sampled"]
    keys = ["K", "L", "chosen"]
    rows = common.layer_rows_with_bands(df, keys, val, ["top_mass_sampled", "expected_mass"])
    order = {kl: i for i, kl in enumerate(dict.fromkeys(zip(df["K"], df["L"])))}  # pairs as checked
    rows.sort(key=lambda r: (order[(r["K"], r["L"])], r["layer"] == "mean"))  # each pair: its layers, then 'mean'
    table = pd.DataFrame(rows)
    return table[[*keys, *table.columns.drop(keys)]]  # K, L, chosen, layer, ...


def figures(records: list[dict[str, Any]], out: Path, model_name: str, opts: MagicPIGKLOptions) -> list[Path]:
    """L against K, and expected against measured Cost2 (the chosen pairs)."""
    import matplotlib.pyplot as plt

    got = [r for r in records if r["L"] is not None]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8), constrained_layout=True)
    axes[0].plot([r["K"] for r in got], [r["L"] for r in got], marker="o")
    axes[0].set_xlabel("K (bits per table)")
    axes[0].set_ylabel(f"smallest L with E[Cost2] ≥ {opts.target_cost2:g}")
    axes[0].set_yscale("log")
    axes[1].plot([r["K"] for r in got], [r["expected_cost2"] for r in got], marker="o", label="expected (eq. 10)")
    axes[1].plot([r["K"] for r in got], [r["measured_cost2"] for r in got], marker="s", label="measured (the method)")
    axes[1].axhline(opts.target_cost2, color="grey", ls=":", label="target")
    axes[1].set_xlabel("K (bits per table)")
    axes[1].set_ylabel("Cost2 (keys attended / context)")
    axes[1].legend(fontsize=8)
    for ax in axes:
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(
        f"MagicPIG (K, L) for Cost2 {opts.target_cost2:g} — {model_name}, "
        f"{opts.passages} passage(s) of {records[0]['length'] if records else opts.length} tokens",
        fontsize=10,
    )
    return common.save_figure(fig, out, "magicpig_kl")


def top_keys_figure(table: Any, out: Path, model_name: str, length: int | None) -> list[Path]:
    """Per layer, for every pair checked: the share of the heaviest keys' mass that eq. 10 samples (left), and the
    expected kept mass against the method's measured one (right; the diagonal is agreement)."""
    import matplotlib.pyplot as plt

    if table.empty:
        return []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), constrained_layout=True)
    for i, ((K, L), g) in enumerate(table.groupby(["K", "L"], sort=False)):
        layers = g[g["layer"] != "mean"]
        label = f"({K}, {L}): Cost2 {g[g['layer'] == 'mean']['cost2'].iloc[0]:.3f}"
        axes[0].plot(
            layers["layer"].astype(int), layers["top_mass_sampled"], marker="o", ms=3, color=f"C{i}", label=label
        )
        axes[1].scatter(layers["expected_mass"], layers["measured_mass"], s=10, color=f"C{i}")
    axes[0].set_xlabel("layer")
    axes[0].set_ylabel("Σ w·u / Σ w over the top keys (eq. 10)")
    axes[0].set_ylim(0, 1)
    axes[0].legend(fontsize=7)
    axes[0].set_title("share of the heaviest keys' attention mass sampled", fontsize=10)
    lo = float(min(table["expected_mass"].min(), table["measured_mass"].min()))
    axes[1].plot([lo, 1], [lo, 1], color="grey", ls=":")
    axes[1].set_xlabel("expected kept mass (eq. 10)")
    axes[1].set_ylabel("measured kept mass (the method)")
    axes[1].set_title("kept attention mass per layer", fontsize=10)
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.suptitle(
        f"MagicPIG's sampling of the keys that carry the attention — {model_name}, {length} tokens", fontsize=10
    )
    return common.save_figure(fig, out, "magicpig_top_keys")


def run(model_cfg, opts: MagicPIGKLOptions) -> dict[str, Any]:
    import pandas as pd

    opts.validate()
    started = common.provenance(model_cfg, opts)
    model, tok, context = common.load(model_cfg)
    res = measure(model, tok, context, opts, progress=True)
    records = res["records"]
    out = common.out_dir(opts.out, "magicpig_kl", model_cfg.name)
    table = pd.DataFrame(records)
    table.to_csv(out / "magicpig_kl.csv", index=False)
    top = top_keys_table(res["top_keys"])
    top.to_csv(out / "magicpig_top_keys.csv", index=False)
    common.write_json(
        out / "magicpig_kl.json",
        {"provenance": common.finished(started, records[0]["text"] if records else None), **res},
    )
    paths = figures(records, out, model_cfg.name, opts)
    paths += top_keys_figure(top, out, model_cfg.name, records[0]["length"] if records else opts.length)
    return {
        "out": out,
        "table": table,
        "top_keys": top,
        "table_file": out / "magicpig_kl.csv",
        "records": records,
        "figures": paths,
    }


def summary(result: dict[str, Any]):
    """Per pair checked (the chosen ones first): its expected Cost2 (chosen pairs), measured Cost2, est_error,
    expected and measured kept mass, and how its heaviest keys are sampled; means over layers (every K in
    ``magicpig_kl.csv``, every layer in ``magicpig_top_keys.csv``)."""
    table, top = result["table"], result["top_keys"]
    cols = ["K", "L", "expected_cost2", "measured_cost2", "est_error", "expected_mass", "measured_mass"]
    if top.empty:
        return table[cols]
    top = top[top["layer"] == "mean"]
    top = top[
        ["K", "L", "cost2", "est_error", "expected_mass", "measured_mass", "top_mass", "top_u", "top_mass_sampled"]
    ]
    chosen = table.dropna(subset=["L"]).astype({"L": int})[["K", "L", "expected_cost2"]]
    return chosen.merge(top, on=["K", "L"], how="right")
