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

Sparse layers: those MagicPIG makes sparse on this model (``dense_layers``, default [0, mid], and layers with a
sliding window of their own left dense, as ``sliding_layers=dense``); ``layers`` overrides.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..methods import attend, build_method, make_config
from ..methods.core import key_validity, static_keys
from ..methods.magicpig import MagicPIG, collision_probability, sampling_probability
from . import common
from .capture import capture_qkv, model_shape


@dataclass
class MagicPIGKLOptions:
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
    text: str = "bundled"
    text_path: str | None = None
    data_dir: str | None = None
    out: str | None = None

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
        for name in ("passages", "num_queries", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)}: must be >= 1")
        if self.sink < 0 or self.local < 0:
            raise ValueError(f"sink={self.sink}, local={self.local}: must be >= 0")


def sparse_layers(model: Any, num_layers: int) -> list[int]:
    """The layers MagicPIG (its defaults) runs sparse on ``model``: not its dense layers, not a sliding-window layer."""
    from ..models.inspection import sliding_layers

    dense = build_method(make_config(MagicPIG.name, {})).dense_layer_set(num_layers)
    sliding = set(sliding_layers(model))
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


def measure(
    model: Any, tokenizer: Any, context: int, opts: MagicPIGKLOptions, progress: bool = False
) -> list[dict[str, Any]]:
    """One record per K: the chosen L, its expected Cost2, and the method's measured Cost2 and est_error."""
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
    text, origin = common.load_text(opts.text, opts.data_dir, opts.text_path)
    ids = common.token_windows(tokenizer, text, length, opts.passages)  # [P, length]
    caps = []
    with common.progress(opts.passages, "magicpig_kl: forwards", "passage", progress) as bar:
        for p in range(opts.passages):
            cap = capture_qkv(model, ids[p : p + 1], layers=layers, query_rows=opts.num_queries)
            caps += [cap[l] for l in layers]
            bar.update()
    ps = [bit_agreement(c.q, c.k, opts.sink, opts.local) for c in caps]
    static_frac = float(torch.stack([(st / ((~p.isnan()).sum(-1) + st)).mean() for p, st in ps]).mean())
    if static_frac >= opts.target_cost2:
        raise ValueError(
            f"target_cost2={opts.target_cost2}: the static keys (sink {opts.sink} + local {opts.local}) "
            f"are already {static_frac:.3f} of a {length}-token row; give a longer analysis.length or a "
            f"higher target"
        )
    records = []
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
            "length": length,
            "passages": opts.passages,
            "layers": list(layers),
            "text": origin,
        }
        if L is not None:
            rec["expected_cost2"] = expected_cost2(ps, K, L, opts.min_collisions)
            runs = []
            for seed in range(opts.repeats):
                c2, err = [], []
                for c in caps:
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
                    c2.append(float(st["cost2"].float().mean()))
                    err.append(float(st["est_error"].float().mean()))
                runs.append((sum(c2) / len(c2), sum(err) / len(err)))
            rec["measured_cost2"] = sum(r[0] for r in runs) / len(runs)
            rec["measured_cost2_sd"] = float(torch.tensor([r[0] for r in runs]).std()) if len(runs) > 1 else 0.0
            rec["est_error"] = sum(r[1] for r in runs) / len(runs)
        records.append(rec)
    return records


def figures(records: list[dict[str, Any]], out: Path, model_name: str, opts: MagicPIGKLOptions) -> list[Path]:
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


def run(model_cfg, opts: MagicPIGKLOptions) -> dict[str, Any]:
    import pandas as pd

    opts.validate()
    started = common.provenance(model_cfg, opts)
    model, tok, context = common.load(model_cfg)
    records = measure(model, tok, context, opts, progress=True)
    out = common.out_dir(opts.out, "magicpig_kl", model_cfg.name)
    table = pd.DataFrame(records)
    table.to_csv(out / "magicpig_kl.csv", index=False)
    common.write_json(
        out / "magicpig_kl.json",
        {"provenance": common.finished(started, records[0]["text"] if records else None), "records": records},
    )
    paths = figures(records, out, model_cfg.name, opts)
    return {"out": out, "table": table, "table_file": out / "magicpig_kl.csv", "records": records, "figures": paths}


def summary(result: dict[str, Any]):
    """Per K: the chosen L, expected and measured Cost2, est_error."""
    return result["table"][["K", "L", "expected_cost2", "measured_cost2", "est_error"]]
