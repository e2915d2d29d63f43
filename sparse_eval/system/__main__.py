"""``python -m sparse_eval.system``: decode with the system path and report its speed (conf/system.yaml).

The model is ``model=`` (any conf/model entry) or, with ``random_shape=``, random weights of a real shape; the
method is ``method=`` (full, double_sparsity [offload], magicpig, quest).  Each row's prompt is ``context`` tokens of
the shipped WikiText-2 head (random ids for random weights).  Prints the median ms per decode step, tokens/s,
cache memory on GPU and CPU and, for real models, whether the accuracy path decodes the same tokens.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.core.config_store import ConfigStore

from ..config import CONF_DIR, PathsConfig, register_configs, to_plain
from ..methods import build_method, make_config
from ..models.loading import ModelConfig


@dataclass
class SystemRunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    method: Any = None
    random_shape: str | None = None
    context: int = 256
    batch: int = 1
    repeat_batch: int = 1
    new_tokens: int = 32
    cuda_graph: bool = False
    interleave: int = 1
    topk: str = "radix"
    phase_times: bool = False
    compare_accuracy_path: bool = True
    output: str | None = None
    paths: PathsConfig = field(default_factory=PathsConfig)


register_configs()
ConfigStore.instance().store(name="system_schema", node=SystemRunConfig)


def _prompts(tok: Any, context: int, batch: int) -> torch.Tensor:
    """[batch, context] token ids: row i starts i·context tokens into the shipped WikiText-2 head."""
    from ..tasks.wikitext import BUNDLED

    ids = tok(BUNDLED.read_text(encoding="utf-8"), verbose=False)["input_ids"]  # one long text, cut into rows
    need = context * batch
    if len(ids) < need:
        raise ValueError(
            f"context={context} x batch={batch} needs {need} tokens; the shipped text has {len(ids)} "
            f"for this tokenizer (use fewer rows or a shorter context)"
        )
    return torch.tensor([ids[i * context : (i + 1) * context] for i in range(batch)])


def run(cfg: Any) -> dict[str, Any]:
    from ..models.loading import load_model, max_context, resolve_device
    from . import SYSTEM_LAYERS, DecodeOptions, decode
    from .layers import layer_class
    from .models import SHAPES, random_model

    for what in ("context", "batch", "repeat_batch", "new_tokens"):
        if int(cfg[what]) < 1:
            raise ValueError(f"{what}={cfg[what]}: must be >= 1")
    if cfg.model.get("device_map") is not None:
        raise ValueError(
            "model.device_map: the system path runs the model on one device (model.device); drop model.device_map "
            "(the accuracy path, python -m sparse_eval, places a model over several devices)"
        )
    opts = to_plain(cfg.method)
    if opts["name"] not in SYSTEM_LAYERS:
        raise ValueError(f"method={opts['name']!r} has no system path; valid: {list(SYSTEM_LAYERS)}")
    layer_class(opts["name"]).check_options(opts)  # what the system path's layer of the method cannot run
    method = build_method(make_config(opts["name"], opts))
    tok = None
    if cfg.random_shape:
        if cfg.random_shape not in SHAPES:
            raise ValueError(f"random_shape={cfg.random_shape!r}; valid: {sorted(SHAPES)}")
        dev = resolve_device(cfg.model.device)
        model = random_model(cfg.random_shape, dev, torch.bfloat16 if dev.type == "cuda" else torch.float32)
        ids = torch.randint(
            0, model.config.vocab_size, (cfg.batch, cfg.context), generator=torch.Generator().manual_seed(0)
        )
        name = cfg.random_shape
    else:
        model, tok = load_model(cfg.model)
        limit = max_context(cfg.model, model)
        if cfg.context + cfg.new_tokens > limit:
            raise ValueError(
                f"context={cfg.context} + new_tokens={cfg.new_tokens} exceeds {cfg.model.name}'s "
                f"context of {limit} tokens"
            )
        ids = _prompts(tok, cfg.context, cfg.batch)
        name = cfg.model.name
    method.setup(model, name)
    res = decode(
        model,
        method,
        ids,
        cfg.new_tokens,
        DecodeOptions(
            repeat_batch=cfg.repeat_batch,
            cuda_graph=cfg.cuda_graph,
            topk=cfg.topk,
            phase_times=cfg.phase_times,
            interleave=cfg.interleave,
        ),
    )
    steady = res.step_ms[2:] or res.step_ms  # the first steps include compilation and index builds
    med = statistics.median(steady)
    record: dict[str, Any] = {
        "model": name,
        "random_weights": bool(cfg.random_shape),
        "method": dataclass_dict(method.config),
        "context": cfg.context,
        "batch": res.batch,
        "new_tokens": cfg.new_tokens,
        "cuda_graph": cfg.cuda_graph,
        "interleave": cfg.interleave,
        "topk": cfg.topk,
        "phase_times": cfg.phase_times,
        "device": str(next(model.parameters()).device),
        "prefill_ms": res.prefill_ms,
        "ms_per_step_median": med,
        "tokens_per_s": res.batch * 1e3 / med,
        "memory_bytes": res.memory,
        "stats": res.stats,
    }
    if cfg.compare_accuracy_path and tok is not None:
        record["agreement_with_accuracy_path"] = _compare(model, tok, method, name, ids, res.tokens, cfg.new_tokens)
    return record


def dataclass_dict(c: Any) -> dict[str, Any]:
    import dataclasses

    out = dataclasses.asdict(c)
    if torch.is_tensor(out.get("channels")):
        out["channels"] = f"tensor{tuple(out['channels'].shape)}"
    return out


def _compare(model, tok, method, name, ids, tokens, new) -> dict[str, Any]:
    """Greedy decode of each row through the accuracy path (same method config and seed, protocol A)."""
    from ..attention.plugin import Runtime, attach, detach
    from ..generation.engine import Engine

    same_rows, same_tokens = 0, 0
    acc = build_method(method.config)
    acc.setup(model, name)
    session = attach(model, acc, Runtime(protocol="A", compute_error=False))
    try:
        eng = Engine(model, tok, session)
        for row in range(ids.shape[0]):
            ref = eng.generate(ids[row].tolist(), new, stop_token_ids=[]).tokens
            got = tokens[row].tolist()
            same_rows += ref == got
            same_tokens += sum(a == b for a, b in zip(ref, got))
    finally:
        detach(model)
    return {
        "rows_identical": same_rows,
        "rows": int(ids.shape[0]),
        "tokens_identical": same_tokens,
        "tokens": int(ids.shape[0]) * new,
    }


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="system")
def main(cfg) -> None:
    from ..cli import EXIT_USAGE, fail

    try:
        rec = run(cfg)
    except (ValueError, FileNotFoundError) as exc:
        fail(str(exc), EXIT_USAGE)  # one line, exit status 2
    m = rec["method"]["name"] + (" (offload)" if rec["method"].get("offload") else "")
    print(
        f"{rec['model']} on {rec['device']}, method {m}: context {rec['context']}, batch {rec['batch']}, "
        f"{rec['new_tokens']} new tokens" + (", static step (CUDA graph on GPU)" if rec["cuda_graph"] else "")
    )
    print(
        f"  prefill {rec['prefill_ms']:.1f} ms; decode {rec['ms_per_step_median']:.2f} ms/step (median), "
        f"{rec['tokens_per_s']:.1f} tokens/s"
    )
    mem = rec["memory_bytes"]
    print(
        f"  cache: {mem.get('cache_gpu', 0) / 2**20:.1f} MiB on the GPU, "
        f"{mem.get('cache_cpu', 0) / 2**20:.1f} MiB in CPU memory"
        + (f"; GPU peak {mem['gpu_peak'] / 2**30:.2f} GiB" if "gpu_peak" in mem else "")
    )
    phases = rec["stats"].get("phase_ms")
    if phases:
        n = max(1, rec["stats"]["phase_steps"])
        print(
            f"  phases, ms per step over the {n} steps after the first (the steps synchronise at each phase): "
            + ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(phases.items(), key=lambda kv: -kv[1]))
        )
    agree = rec.get("agreement_with_accuracy_path")
    if agree:
        print(
            f"  accuracy path: {agree['rows_identical']}/{agree['rows']} rows and {agree['tokens_identical']}/"
            f"{agree['tokens']} tokens identical"
        )
    if cfg.output:
        Path(cfg.output).write_text(json.dumps(rec, indent=1, default=str))
        print(f"  wrote {cfg.output}")


if __name__ == "__main__":
    from ..cli import hydra_entry

    hydra_entry(main)  # Hydra's errors as one line, exit status 2 (sparse_eval.cli)
