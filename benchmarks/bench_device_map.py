"""A model larger than one GPU through ``model.device_map`` (issue 50 §3): the records of a run over several GPUs are
those of the same model on one GPU, for every registered method.

A random-weight model of Llama-3.1-70B's width (``--layers`` of its 80 layers: a shallower stand-in that still fits
one GPU, so that the one-GPU run exists to compare with; ``sparse_eval.system.models.write_checkpoint``) is written
once as a checkpoint folder with the shipped stories260K tokenizer, then run through the runner (the accuracy path's
``Experiment``, as ``python -m sparse_eval`` runs it) twice: on one GPU (``model.device=auto``) and over
``--device-map`` (e.g. ``balanced``: the layers split over the visible GPUs; ``model.max_memory`` from
``--max-memory``), each into its own runs folder.  Every registered method runs under the configs its end-to-end
checks declare (``Method.model_contract_configs``: small budgets for short prompts), on generated key-value
retrieval prompts (protocol A: sparse decode steps).  Both runs must file each method under the same run directory
(the map is no part of a run's identity) with the same records (every field but wall times).

    # 2 GPUs (the issue's run): 16 layers of 70B width (~32 GB bf16 checkpoint), one GPU vs balanced over both
    python benchmarks/bench_device_map.py --out /tmp/device_map_70b
    # full depth, 80 layers (~141 GB: GPUs and disk to match), over the map only (no one-GPU run to compare)
    python benchmarks/bench_device_map.py --out /tmp/device_map_70b_full --layers 80 --no-baseline
    # the script itself on a CPU in seconds (a narrow model, every other layer offloaded to disk)
    python benchmarks/bench_device_map.py --out /tmp/device_map_smoke --smoke

Writes ``device_map.json`` under ``--out`` (identical or not, the differing runs, the resolved map, per-run times,
hardware); exit status 1 when a record differs.  The same run by hand: ``python -m sparse_eval model.path=OUT/checkpoint
model.name=llama3_1_70b_random_l16 model.device_map=balanced method=... task=kv_retrieval ...``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# a CPU-sized model of the same architecture (--smoke)
SMOKE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=8192,
)


def parse_args(argv=None):
    from sparse_eval.system.models import SHAPES

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder of the checkpoint, the two runs folders and the report")
    ap.add_argument("--shape", default="llama3_1_70b", choices=sorted(SHAPES))
    ap.add_argument("--layers", type=int, default=16, help="decoder layers of the stand-in (70B: 80)")
    ap.add_argument(
        "--device-map",
        default="balanced",
        help="model.device_map: auto | balanced | balanced_low_0 | sequential, or a JSON {module: device} map",
    )
    ap.add_argument("--max-memory", default=None, help='model.max_memory as JSON, e.g. {"0": "40GiB", "1": "40GiB"}')
    ap.add_argument("--methods", default="all", help="comma-separated registered method names, or all")
    ap.add_argument("--samples", type=int, default=4, help="key-value retrieval prompts")
    ap.add_argument("--keys", type=int, default=40, help="key-value pairs per prompt (~30 tokens each)")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--batch-size", default="2", help="eval.batch_size (records do not depend on it)")
    ap.add_argument("--no-baseline", action="store_true", help="only the run over the map (a model no GPU holds)")
    ap.add_argument("--smoke", action="store_true", help="a narrow model on the CPU, layers alternately on disk")
    ap.add_argument("--seed", type=int, default=0, help="the random weights' seed")
    return ap.parse_args(argv)


def _override(value) -> str:
    """A Hydra override value of a dict ({a: b, ...}) or a plain string."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{v}" for k, v in value.items()) + "}"
    return str(value)


def _methods(names: str) -> list[tuple[str, dict]]:
    from sparse_eval.methods import METHODS

    chosen = sorted(METHODS) if names == "all" else names.split(",")
    bad = [n for n in chosen if n not in METHODS]
    if bad:
        raise SystemExit(f"--methods: {bad} not registered; valid: {sorted(METHODS)}")
    return [(n, dict(opts)) for n in chosen for opts in METHODS[n].model_contract_configs()]


def _run(label: str, overrides: list[str], methods: list[tuple[str, dict]]) -> dict:
    """Runs every method into one runs folder; returns {run dir name: seconds} and the resolved map."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from sparse_eval.config import CONF_DIR, register_configs
    from sparse_eval.run.experiment import Experiment
    from sparse_eval.run.run_config import run_config
    from sparse_eval.methods import make_config
    from sparse_eval.models.placement import device_map_of

    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF_DIR)):
        cfg = compose(config_name="config", overrides=overrides)
    exp = Experiment(run_config(cfg))
    t0 = time.perf_counter()
    exp.load()
    out = {"load_s": time.perf_counter() - t0, "device_map": device_map_of(exp.model), "runs": {}}
    for name, opts in methods:
        t0 = time.perf_counter()
        summary = exp.run_method(exp.preflight(make_config(name, opts)))
        out["runs"][Path(summary["run_dir"]).name] = {
            "method": name,
            "options": opts,
            "seconds": time.perf_counter() - t0,
            "samples": summary["samples"],
            "score": summary["score"],
        }
        print(f"[{label}] {name} {opts}: {out['runs'][Path(summary['run_dir']).name]['seconds']:.1f} s", flush=True)
    del exp
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def _records(runs_dir: Path) -> dict[str, dict[str, dict]]:
    """{run dir name: {sample id: record without its wall time}}."""
    out = {}
    for f in sorted(runs_dir.rglob("samples.jsonl")):
        recs = (json.loads(x) for x in f.read_text().splitlines() if x.strip())
        out[f.parent.name] = {str(r["id"]): {k: v for k, v in r.items() if k != "time_s"} for r in recs}
    return out


def main(argv=None) -> int:
    from sparse_eval.system.models import write_checkpoint

    args = parse_args(argv)
    out = Path(args.out).expanduser()
    ckpt = out / "checkpoint"
    name = f"{args.shape}_random_l{args.layers}" + ("_smoke" if args.smoke else "")
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        write_checkpoint(
            ckpt,
            args.shape,
            num_layers=args.layers,
            dtype=torch.float32 if args.smoke else torch.bfloat16,
            seed=args.seed,
            device="cuda:0" if torch.cuda.is_available() and not args.smoke else "cpu",
            overrides=SMOKE if args.smoke else None,
        )
        print(f"wrote {ckpt} in {time.perf_counter() - t0:.0f} s", flush=True)
    dm = args.device_map
    if dm.strip().startswith("{"):
        dm = json.loads(dm)
    mapped = [f"model.device_map={_override(dm)}"]
    if args.max_memory:
        mapped.append(f"model.max_memory={_override(json.loads(args.max_memory))}")
    if args.smoke:  # the CPU: every other layer on disk (a map of cpu alone installs no hooks)
        dm = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "model.norm": "cpu", "lm_head": "cpu"}
        dm |= {f"model.layers.{i}": "disk" if i % 2 else "cpu" for i in range(args.layers)}
        mapped = [f"model.device_map={_override(dm)}", f"model.offload_folder={out / 'offload'}"]
    common = [
        f"model.path={ckpt}",
        f"model.name={name}",
        f"model.dtype={'float32' if args.smoke else 'bfloat16'}",
        "model.max_context=4096",
        "task=kv_retrieval",
        f"task.num_keys={args.keys}",
        f"task.num_samples={args.samples}",
        f"task.max_new_tokens={args.new_tokens}",
        "task.chat_template=none",
        f"eval.batch_size={args.batch_size}",
        "print_table=false",
    ]
    methods = _methods(args.methods)
    report: dict = {"command": " ".join(sys.argv), "shape": args.shape, "layers": args.layers, "model": name}
    if not args.no_baseline:
        report["one_device"] = _run("one device", [*common, f"paths.runs_dir={out / 'runs_one'}"], methods)
    report["device_map_run"] = _run("device map", [*common, *mapped, f"paths.runs_dir={out / 'runs_map'}"], methods)
    if not args.no_baseline:
        one, two = _records(out / "runs_one"), _records(out / "runs_map")
        diffs = sorted(set(one) ^ set(two)) + [r for r in sorted(set(one) & set(two)) if one[r] != two[r]]
        report["identical"] = not diffs and bool(one)
        report["differing_runs"] = diffs
        report["records"] = sum(len(v) for v in one.values())
    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from _kernel_bench_util import hardware

        report["hardware"] = hardware()
    except Exception as exc:  # noqa: BLE001 - the report without it
        report["hardware"] = repr(exc)
    (out / "device_map.json").write_text(json.dumps(report, indent=1, default=str))
    print(json.dumps({k: report.get(k) for k in ("identical", "differing_runs", "records")}, default=str))
    print(f"map: {report['device_map_run']['device_map']}")
    return 0 if report.get("identical", True) else 1


if __name__ == "__main__":
    sys.exit(main())
