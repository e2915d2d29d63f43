"""End-to-end evaluation throughput: RULER through the harness's own runner, batched, per method, beside stock
transformers ``generate`` at the same batch and prompt length in the same process.

Default: RULER at 8K on SmolLM2-135M-Instruct, the 13 tasks x 50 samples, the six methods at their paper
defaults (``conf/method/<name>.yaml``), ``eval.batch_size=auto``.  Each method is one ``Experiment.run_method``
(prefill, decode, scoring, records written), timed from the call to its return; the RULER samples are generated
once before (timed apart).  The baseline runs ``model.generate`` (sdpa, greedy, left padding) over the same
prompts in batches of the size full attention used, each batch to its longest ``tokens_to_generate``.

    python benchmarks/bench_eval_throughput.py --gguf /path/SmolLM2-135M-Instruct.Q4_1.gguf --data-dir ../shared/data \
        --out experiments/eval_throughput
    python benchmarks/bench_eval_throughput.py --model stories260k --samples 2 --length 256 --haystack noise \
        --out /tmp/bench            # CPU smoke size

Writes ``<out>/eval_throughput.json`` and ``<out>/eval_throughput.md`` (samples/s, batch used, wall time per
method and for the baseline, with the command and the hardware) and prints the table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparse_eval.config import register_configs  # noqa: E402
from sparse_eval.identity.provenance import provenance  # noqa: E402
from sparse_eval.config import CONF_DIR  # noqa: E402
from sparse_eval.run.experiment import Experiment  # noqa: E402
from sparse_eval.run.run_config import run_config  # noqa: E402
from sparse_eval.results.results_table import short_config  # noqa: E402
from sparse_eval.run.run_config import method_options  # noqa: E402
from sparse_eval.methods import make_config  # noqa: E402
from sparse_eval.tasks import ruler_data as rd  # noqa: E402

METHODS = ("full", "topk", "oracle", "magicpig", "quest", "double_sparsity")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default="smollm2_135m", help="a conf/model name (default smollm2_135m)")
    p.add_argument("--gguf", default=None, help="the model's GGUF file (sets model.path to its folder)")
    p.add_argument("--length", type=int, default=8192, help="RULER task.length (default 8192)")
    p.add_argument("--samples", type=int, default=50, help="samples per RULER task (default 50)")
    p.add_argument("--subtasks", default=None, help="comma-separated RULER tasks (default: all 13)")
    p.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated conf/method names (default {','.join(METHODS)})"
    )
    p.add_argument("--batch-size", default="auto", help="eval.batch_size: an int or auto (default auto)")
    p.add_argument("--haystack", default=None, help="RULER task.haystack (noise needs no data)")
    p.add_argument("--data-dir", default=None, help="paths.data_dir (essays, SQuAD, HotpotQA)")
    p.add_argument("--no-baseline", action="store_true", help="skip the stock generate baseline")
    p.add_argument(
        "--invariance",
        choices=("on", "off", "both"),
        default="on",
        help="eval.batch_invariant: on (the default mode), off, or both (each method off, then on: the "
        "cost of the batch-invariant kernels, measured in one process)",
    )
    p.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    p.add_argument("--out", required=True, help="output folder (JSON, markdown, the runs)")
    return p.parse_args(argv)


def compose_config(args: argparse.Namespace, runs_dir: Path) -> Any:
    from hydra import compose, initialize_config_dir

    register_configs()
    over = [
        f"model={args.model}",
        "task=ruler",
        f"task.length={args.length}",
        f"task.num_samples={args.samples}",
        f"eval.batch_size={args.batch_size}",
        f"paths.runs_dir={runs_dir}",
        "print_table=false",
    ]
    if args.gguf:
        g = Path(args.gguf).expanduser().resolve()
        over += [f"model.path={g.parent}", f"model.gguf_file={g.name}"]
    if args.subtasks:
        over.append(f"task.subtasks=[{args.subtasks}]")
    if args.haystack:
        over.append(f"task.haystack={args.haystack}")
    if args.data_dir:
        over.append(f"paths.data_dir={Path(args.data_dir).expanduser().resolve()}")
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        return compose(config_name="config", overrides=over + list(args.override))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def stock_generate(exp: Experiment, batch: int) -> dict[str, Any]:
    """Stock ``model.generate`` (sdpa, greedy) over the run's prompts in batches of ``batch``, longest first."""
    model, tok = exp.model, exp.tokenizer
    model.set_attn_implementation("sdpa")
    samples = sorted(exp.samples(), key=lambda s: -len(s.data["input_ids"]))
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    dev = next(model.parameters()).device
    tokens = 0
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(samples), batch):
        rows = samples[i : i + batch]
        t = max(len(s.data["input_ids"]) for s in rows)
        ids = torch.full((len(rows), t), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), t), dtype=torch.long)
        for j, s in enumerate(rows):
            x = s.data["input_ids"]
            ids[j, t - len(x) :] = torch.as_tensor(x)
            mask[j, t - len(x) :] = 1
        new = max(rd.tokens_to_generate(s.data["subtask"]) for s in rows)
        out = model.generate(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=new, do_sample=False, pad_token_id=pad
        )
        tokens += int((out[:, t:] != pad).sum())
    _sync()
    wall = time.perf_counter() - t0
    return {
        "method": "stock generate (sdpa)",
        "config": "",
        "samples": len(samples),
        "batch_size": batch,
        "wall_s": wall,
        "samples_per_s": len(samples) / wall,
        "generated_tokens": tokens,
        "score": None,
    }


@torch.inference_mode()
def warmup(exp: Experiment, mcfg: Any) -> None:
    """One small batch of ``mcfg`` through the engine in the experiment's current mode, nothing recorded."""
    from sparse_eval.attention.plugin import Runtime, attach, detach
    from sparse_eval.generation.engine import Engine
    from sparse_eval.methods import build_method

    method = build_method(mcfg)
    method.setup(exp.model, exp.model_cfg.name)
    session = attach(exp.model, method, Runtime(exp.protocol, batch_invariant=exp.run.eval.batch_invariant))
    try:
        engine = Engine(exp.model, exp.tokenizer, session, exp.run.eval.prefill_chunk)
        engine.run_batch([exp.task.request(s) for s in exp.samples()[:2]])
    finally:
        detach(exp.model)


def run(args: argparse.Namespace) -> dict[str, Any]:
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    runs_dir = out / f"runs-{time.strftime('%Y%m%d-%H%M%S')}"  # fresh: nothing is resumed or skipped
    cfg = compose_config(args, runs_dir)
    exp = Experiment(run_config(cfg))
    t0 = time.perf_counter()
    samples = exp.samples()
    gen_s = time.perf_counter() - t0
    rows = []
    modes = {"on": (True,), "off": (False,), "both": (False, True)}[args.invariance]
    names = [m.strip() for m in args.methods.split(",") if m.strip()]
    warmed = set()
    for name in names:
        opts = method_options(name)
        mcfg = exp.preflight(
            make_config(opts["name"], opts)
        ).config  # dense layers resolved for this model, as a run does
        for invariant in modes:
            # the run's config is frozen: this mode's copy (the identity, and so the run dir, follow it)
            exp.run = dataclasses.replace(exp.run, eval=dataclasses.replace(exp.run.eval, batch_invariant=invariant))
            if invariant not in warmed:  # Triton compiles the invariant kernels at their first use: not timed
                warmup(exp, mcfg)
                warmed.add(invariant)
            _, run_dir = exp.run_dir(mcfg)
            _sync()
            t1 = time.perf_counter()
            summary = exp.run_method(mcfg, run_dir)
            _sync()
            wall = time.perf_counter() - t1
            rows.append(
                {
                    "method": name,
                    "config": short_config(dataclasses.asdict(mcfg)),
                    "batch_invariant": invariant,
                    "samples": summary["samples"],
                    "failed": summary["failed"],
                    "batch_size": summary["batch_size"],
                    "wall_s": wall,
                    "samples_per_s": summary["samples"] / wall,
                    "score": summary["score"],
                    "est_error": summary["est_error"],
                    "run_dir": summary["run_dir"],
                }
            )
            print(
                f"{name} (batch_invariant={invariant}): {summary['samples']} samples in {wall:.1f} s "
                f"(batch {summary['batch_size']}), score {summary['score']}",
                flush=True,
            )
    baseline = None
    if not args.no_baseline:
        full = next((r for r in rows if r["method"] == "full"), None)
        batch = (full or rows[0])["batch_size"] if rows else (int(args.batch_size) if args.batch_size != "auto" else 1)
        baseline = stock_generate(exp, int(batch or 1))
    dev = next(exp.model.parameters()).device
    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
        "model": cfg.model.name,
        "dtype": str(next(exp.model.parameters()).dtype),
        "device": str(dev),
        "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
        "task": {
            "name": "ruler",
            "length": args.length,
            "samples_per_task": args.samples,
            "subtasks": list(exp.task.config.subtasks),
            "haystack": args.haystack,
            "total_samples": len(samples),
        },
        "batch_size_arg": args.batch_size,
        "sample_generation_s": gen_s,
        "methods": rows,
        "baseline": baseline,
        "invariance": args.invariance,
        "total_wall_s": {str(m): sum(r["wall_s"] for r in rows if r["batch_invariant"] == m) for m in modes},
        "provenance": provenance(),
    }
    (out / "eval_throughput.json").write_text(json.dumps(result, indent=2, default=str) + "\n", encoding="utf-8")
    md = markdown(result)
    (out / "eval_throughput.md").write_text(md, encoding="utf-8")
    print(md)
    return result


def markdown(r: dict[str, Any]) -> str:
    t = r["task"]
    lines = [
        f"# RULER throughput: {r['model']} at {t['length']} tokens, {t['total_samples']} samples "
        f"({len(t['subtasks'])} tasks x {t['samples_per_task']})",
        "",
        f"`{r['command']}`",
        "",
        f"device: {r['gpu'] or r['device']}, dtype {r['dtype']}; eval.batch_size={r['batch_size_arg']}; "
        f"RULER sample generation {r['sample_generation_s']:.1f} s (not included)",
        "",
        "| method | config | batch_invariant | samples | batch | wall s | samples/s | score | est_error |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda x, f: "-" if x is None else format(x, f)  # noqa: E731
    for row in r["methods"] + ([r["baseline"]] if r["baseline"] else []):
        lines.append(
            f"| {row['method']} | {row['config']} | {row.get('batch_invariant', '-')} | {row['samples']} | "
            f"{row['batch_size']} | {row['wall_s']:.1f} | {row['samples_per_s']:.3g} | "
            f"{fmt(row.get('score'), '.1f')} | {fmt(row.get('est_error'), '.3g')} |"
        )
    totals = r["total_wall_s"]
    lines += ["", "total wall: " + ", ".join(f"batch_invariant={m}: {t:.1f} s" for m, t in totals.items())]
    if len(totals) == 2:
        lines.append(
            "wall time with the batch-invariant kernels against without, per method: "
            + ", ".join(
                f"{a['method']} {b['wall_s'] / a['wall_s']:.2f}x"
                for a, b in zip(r["methods"][0::2], r["methods"][1::2])
            )
            + f"; all {totals['True'] / totals['False']:.2f}x"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
