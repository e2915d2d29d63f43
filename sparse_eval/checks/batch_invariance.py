"""Batch invariance on a real model: every registered method's records at batch 50, in batches of 7 and alone.

    python -m sparse_eval.checks.batch_invariance --out records.json      # see experiments/batch_invariance_h200/

The model is SmolLM2-135M-Instruct when its GGUF is where ``conf/model/smollm2_135m.yaml`` looks (else the shipped
stories260K), on CUDA when there is one, in its default dtype (bf16 on CUDA).  The samples are RULER prompts at two
lengths mixed in one pool, so every batch is left-padded.  For each registered method (the configs its
``paper_configs`` declares: its paper defaults; DS also with DS-Offload's predicted keys) the pool runs with
``eval.batch_invariant`` on as one batch of 50, in batches of 7 and, for ``--alone`` samples, one at a time; a
sample's record (greedy tokens, stop reason, its score and every recorded statistic, per layer and head) must be the
same in all three.  With ``--fast-path`` the same comparison is made with the stock kernels for a few methods, to
show what the mode removes.  ``tests/checks/test_invariance.py`` runs it on the GPU (``gpu`` marker)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import time
from pathlib import Path
from typing import Any

import torch

STATS = (
    "cost1",
    "cost2",
    "kv_bytes",
    "static_frac",
    "est_error",
    "mass",
    "topk_recall",
    "sparse_rows",
    "empty_selections",
)


def method_runs() -> list[tuple[str, str, dict[str, Any]]]:
    """(label, method, options): every registered method under the configs it declares (``Method.paper_configs``:
    its paper defaults; DS also offloaded), full attention first."""
    from ..methods import METHODS, compare_names

    return [
        (label, name, dict(opts)) for name in compare_names() for label, opts in METHODS[name].paper_configs().items()
    ]


SUBTASKS = ("niah_single_1", "niah_single_2", "niah_multikey_1", "niah_multivalue", "vt")
SHORT_SUBTASKS = ("niah_single_1", "niah_single_2")  # the ones that fit a 512-token context (stories260K)


def _model_config(name: str, device: str):
    from omegaconf import OmegaConf

    from ..models.loading import MODEL_CONF_DIR, ModelConfig

    raw = OmegaConf.to_container(OmegaConf.load(MODEL_CONF_DIR / f"{name}.yaml"))
    raw.pop("defaults", None)
    models_dir = os.path.expanduser(os.environ.get("SPARSE_EVAL_MODELS_DIR", "~/.cache/sparse_eval/models"))
    raw["path"] = str(raw["path"]).replace("${paths.models_dir}", models_dir)
    raw["device"] = device
    return ModelConfig(**raw)


def default_model() -> str:
    """smollm2_135m when its GGUF is on this machine, else the shipped stories260k."""
    cfg = _model_config("smollm2_135m", "cpu")
    return "smollm2_135m" if (Path(cfg.path) / cfg.gguf_file).exists() else "stories260k"


def _samples(tokenizer, context: int, lengths, per_length: int, data_dir: str | None, max_new_tokens: int):
    from ..tasks import build_task
    from ..tasks.ruler_data import essay_location

    pool = []
    subtasks = SUBTASKS if min(lengths) >= 1024 else SHORT_SUBTASKS
    per_sub = max(1, -(-per_length // len(subtasks)))
    options: dict[str, Any] = {"name": "ruler", "num_samples": per_sub, "subtasks": list(subtasks)}
    essays = essay_location(None, Path(data_dir) if data_dir else None)
    if essays is None or not essays.exists():
        # no Paul Graham essays on this machine: every subtask on RULER's noise haystack (the check compares a
        # method's records across batch sizes, which needs real prompts of several lengths, not RULER's essays)
        options["haystack"] = "noise"
    for length in lengths:
        task = build_task(options | {"length": length}, data_dir=data_dir)
        samples = task.samples(tokenizer, context)[:per_length]
        for s in samples:
            s = dataclasses.replace(s, id=f"{length}:{s.id}")  # ids repeat across lengths
            req = task.request(s)
            req = dataclasses.replace(req, max_new_tokens=min(req.max_new_tokens, max_new_tokens), key=s.id)
            pool.append((task, s, req))
    return pool


def _records(session, engine, pool, size: int) -> list[dict[str, Any]]:
    out = []
    for s0 in range(0, len(pool), size):
        batch = pool[s0 : s0 + size]
        session.recorder.reset()
        results = engine.run_batch([req for _, _, req in batch])
        for i, ((task, sample, _), res) in enumerate(zip(batch, results)):
            stats = session.recorder.summary(row=i)
            rec = {
                "id": sample.id,
                "tokens": res.tokens,
                "stopped_by": res.stopped_by,
                "score": task.score(sample, res).get("score"),
            }
            rec |= {k: stats.get(k) for k in STATS}
            rec["per_layer_head"] = {k: stats.get(f"{k}_per_layer_head") for k in ("est_error", "cost2")}
            out.append(rec)
    return out


def _compare(ref: list[dict], other: list[dict], label: str) -> list[dict]:
    bad = []
    by_id = {r["id"]: r for r in ref}
    for r in other:
        want = by_id[r["id"]]
        diff = sorted(k for k in want if want[k] != r[k])
        if diff:
            bad.append({"id": r["id"], "run": label, "fields": diff, "tokens_identical": want["tokens"] == r["tokens"]})
    return bad


def run_check(
    device: str | None = None,
    out: Path | None = None,
    model: str | None = None,
    lengths: tuple[int, ...] | None = None,
    per_length: int = 25,
    alone: int = 10,
    max_new_tokens: int = 32,
    data_dir: str | None = None,
    methods: tuple[str, ...] | None = None,
    fast_path: tuple[str, ...] = ("full", "magicpig"),
    fused: str = "off",
) -> dict[str, Any]:
    """Runs the comparison; returns (and writes to ``out``) a JSON report with ``all_identical``.

    ``fused`` is ``eval.fused_attention`` for every run (off | on | auto).  Other than off, each method's pool also
    runs once with it off, and the report gives per method how many samples' greedy tokens the fused kernel left
    unchanged (``unfused_identical_tokens``: issue 51's "records close to the pre-fusion records"), and, as the
    yardstick of that count, how many the unfused path leaves unchanged when it runs outside the batch-invariant
    mode (``plain_identical_tokens``: the same arithmetic in the stock kernels' summation order)."""
    from ..attention.plugin import Runtime, attach, detach
    from ..generation.engine import Engine
    from ..methods import build_method, make_config
    from ..models.loading import load_model, max_context
    from ..identity.provenance import provenance

    runs = method_runs()
    if methods and set(methods) - {r[0] for r in runs}:
        raise ValueError(
            f"--methods {sorted(set(methods) - {r[0] for r in runs})}: not a label of the check; valid: "
            f"{[r[0] for r in runs]}"
        )
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    model = model or default_model()
    data_dir = data_dir or os.environ.get("SPARSE_EVAL_DATA_DIR")
    mcfg = _model_config(model, device)
    t0 = time.perf_counter()
    lm, tok = load_model(mcfg)
    context = max_context(mcfg, lm)
    lengths = lengths or ((2048, 4096) if context >= 4096 else (480, 512))
    pool = _samples(tok, context, lengths, per_length, data_dir, max_new_tokens)
    n = len(pool)
    alone_ids = sorted({round(i * (n - 1) / max(1, alone - 1)) for i in range(alone)}) if alone else []
    report: dict[str, Any] = {
        "model": model,
        "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor(),
        "dtype": str(next(lm.parameters()).dtype),
        "torch": torch.__version__,
        "lengths": list(lengths),
        "samples": n,
        "alone": len(alone_ids),
        "max_new_tokens": max_new_tokens,
        "fused_attention": fused,
        "subtasks": sorted({s.data.get("subtask", "") for _, s, _ in pool}),
        "haystack": (pool[0][0].config.haystack or "RULER's per subtask") if pool else None,
        "setup_s": round(time.perf_counter() - t0, 1),
        "methods": {},
        "mismatches": [],
        "fast_path": {},
        "provenance": provenance(),
    }

    def run(label, name, opts, invariant, sizes, fused_mode=fused):
        method = build_method(make_config(name, opts))
        method.setup(lm, model)
        session = attach(lm, method, Runtime("A", batch_invariant=invariant, fused_attention=fused_mode))
        engine = Engine(lm, tok, session)
        res = {}
        try:
            for size in sizes:
                t = time.perf_counter()
                sub = pool if size != 1 else [pool[i] for i in alone_ids]
                res[size] = (_records(session, engine, sub, size), time.perf_counter() - t)
        finally:
            detach(lm)
        return res

    def save():  # after every method: a run cut short keeps what it measured
        report["all_identical"] = not report["mismatches"] and bool(report["methods"])
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=1) + "\n")

    for label, name, opts in runs:
        if methods and label not in methods:
            continue
        res = run(label, name, opts, True, (n, 7, 1))
        ref = res[n][0]
        bad = _compare(ref, res[7][0], "batch 7") + _compare(ref, res[1][0], "alone")
        report["mismatches"] += [dict(b, method=label) for b in bad]
        scores = [r["score"] for r in ref if r["score"] is not None]
        report["methods"][label] = {
            "identical": not bad,
            "mismatched_samples": len({b["id"] for b in bad}),
            "score": sum(scores) / len(scores) if scores else None,
            "seconds": {
                f"batch {n}": round(res[n][1], 1),
                "batch 7": round(res[7][1], 1),
                f"alone ({len(alone_ids)})": round(res[1][1], 1),
            },
        }
        if fused != "off":
            unfused = {r["id"]: r["tokens"] for r in run(label, name, opts, True, (n,), "off")[n][0]}
            report["methods"][label]["unfused_identical_tokens"] = sum(unfused[r["id"]] == r["tokens"] for r in ref)
            # the yardstick: the same unfused path outside the batch-invariant mode (stock kernels: the same
            # arithmetic in another summation order), i.e. how many greedy sequences a rounding-level change of the
            # attention's inputs leaves unchanged for this method on this model
            plain = run(label, name, opts, False, (n,), "off")[n][0]
            report["methods"][label]["plain_identical_tokens"] = sum(unfused[r["id"]] == r["tokens"] for r in plain)
        print(
            f"{label}: {'identical' if not bad else f'{len(bad)} mismatches'} {report['methods'][label]['seconds']}",
            flush=True,
        )
        save()
    for label, name, opts in runs:
        if label not in fast_path or (methods and label not in methods):
            continue
        res = run(label, name, opts, False, (n, 1))
        by_id = {r["id"]: r for r in res[n][0]}
        same_tokens = sum(by_id[r["id"]]["tokens"] == r["tokens"] for r in res[1][0])
        same_record = sum(not _compare([by_id[r["id"]]], [r], "") for r in res[1][0])
        report["fast_path"][label] = {
            "alone": len(res[1][0]),
            "identical_tokens": same_tokens,
            "identical_records": same_record,
        }
        print(
            f"fast path {label}: {same_tokens}/{len(res[1][0])} identical tokens, {same_record} identical records",
            flush=True,
        )
        save()
    save()
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m sparse_eval.checks.batch_invariance",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", type=Path, required=True, help="the JSON report to write")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when present)")
    p.add_argument("--model", default=None, help="smollm2_135m | stories260k (default: SmolLM2 when present)")
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="RULER lengths in the pool")
    p.add_argument("--per-length", type=int, default=25, help="samples per length (default 25: a pool of 50)")
    p.add_argument("--alone", type=int, default=10, help="samples also run one at a time (default 10)")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--data-dir", default=None, help="paths.data_dir (default: $SPARSE_EVAL_DATA_DIR)")
    p.add_argument("--methods", nargs="+", default=None, help="a subset of the labels")
    p.add_argument("--fast-path", nargs="*", default=["full", "magicpig"], help="methods also run without the mode")
    p.add_argument(
        "--fused",
        choices=("off", "on", "auto"),
        default="off",
        help="eval.fused_attention for every run; other than off, also compares greedy tokens with it off",
    )
    a = p.parse_args(argv)
    rep = run_check(
        a.device,
        a.out,
        a.model,
        tuple(a.lengths) if a.lengths else None,
        a.per_length,
        a.alone,
        a.max_new_tokens,
        a.data_dir,
        tuple(a.methods) if a.methods else None,
        tuple(a.fast_path),
        a.fused,
    )
    print(f"all identical: {rep['all_identical']} ({a.out})")
    return 0 if rep["all_identical"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
