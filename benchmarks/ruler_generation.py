"""RULER data generation speed: all 13 tasks x 50 samples at 16K tokens with a real tokenizer (Llama-2's
SentencePiece model through transformers' ``LlamaTokenizer``, offline).  Goal: under one minute on 2 cores.

Prints, per subtask, the time, the tokenized characters and how far the prompts stop short of the budget
(``length - tokens_to_generate - prompt_tokens``), checks every sample against the fit rule, and writes the
figures with the command, hardware, load average and versions to ``--out`` (``results_<length>.json`` and
``results_<length>.md``; ``experiments/ruler_generation/README.md`` is the written-up summary).

    python benchmarks/ruler_generation.py                       # 16384 tokens, 50 samples, all 13 tasks
    python benchmarks/ruler_generation.py --length 32768 --num-samples 10 --out /tmp/x
    taskset -c 0,1 python benchmarks/ruler_generation.py        # pin to 2 cores

Needs ``protobuf`` (transformers reads the SentencePiece model through it) and the shared data folder
(``--data-dir``, default ``$SPARSE_EVAL_DATA_DIR`` or ``../shared/data`` beside the checkout).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from sparse_eval.tasks import ruler_data as rd  # noqa: E402


def hardware() -> dict:
    from sparse_eval.identity.provenance import hardware as machine

    return machine()


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for pkg in ("transformers", "tokenizers", "sentencepiece", "protobuf", "wonderwords", "numpy"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def git_commit() -> str | None:
    import subprocess

    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        sha = sha.stdout.strip()
        return sha if len(sha) == 40 else None
    except (OSError, subprocess.SubprocessError):
        return None


def load_tokenizer(path: Path):
    from transformers import LlamaTokenizer

    try:
        import google.protobuf  # noqa: F401
    except ModuleNotFoundError:
        sys.exit(
            "this benchmark reads Llama-2's tokenizer.model through transformers, which needs protobuf: "
            "pip install protobuf"
        )
    return LlamaTokenizer.from_pretrained(str(path))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--length", type=int, default=16384)
    ap.add_argument("--num-samples", type=int, default=50)
    ap.add_argument("--subtasks", default=",".join(rd.SUBTASK_NAMES))
    ap.add_argument("--seed", type=int, default=42)
    default_data = os.environ.get("SPARSE_EVAL_DATA_DIR") or str(REPO.parent / "shared" / "data")
    ap.add_argument("--data-dir", default=default_data)
    ap.add_argument("--tokenizer", default=None, help="folder with tokenizer.model (default DATA_DIR/llama2-tokenizer)")
    ap.add_argument("--out", default=str(REPO / "experiments" / "ruler_generation"))
    args = ap.parse_args()

    data_dir = Path(args.data_dir)
    subtasks = rd.check_subtasks(args.subtasks.split(","))
    t_start = time.perf_counter()
    t0 = time.perf_counter()
    tok = load_tokenizer(Path(args.tokenizer) if args.tokenizer else data_dir / "llama2-tokenizer")
    t_tok = time.perf_counter() - t0
    prompter = rd.Prompter(tok, chat_template=False)  # Llama-2's tokenizer.model has no chat template
    res = rd.Resources(seed=args.seed, haystack=None, essay_path=None, data_dir=data_dir)

    # count what gets tokenized
    stats = {"calls": 0, "chars": 0}
    encode = prompter.encode

    def counting_encode(texts):
        stats["calls"] += 1
        stats["chars"] += sum(map(len, texts))
        return encode(texts)

    prompter.encode = counting_encode

    rows = []
    t_gen = time.perf_counter()
    for sub in subtasks:
        stats.update(calls=0, chars=0)
        t0 = time.perf_counter()
        gen = rd.generate(sub, args.num_samples, args.length, prompter, res)
        dt = time.perf_counter() - t0
        budget = args.length - rd.tokens_to_generate(sub)
        short = [budget - len(g.input_ids) for g in gen]
        assert min(short) >= 0, f"{sub}: a prompt exceeds the budget"
        rows.append(
            {
                "subtask": sub,
                "seconds": round(dt, 3),
                "samples": len(gen),
                "prompt_tokens_mean": round(statistics.mean(len(g.input_ids) for g in gen), 1),
                "tokens_left_min": min(short),
                "tokens_left_max": max(short),
                "tokens_left_mean": round(statistics.mean(short), 1),
                "step_tokens": round(gen[0].step_tokens, 1),
                "unit": gen[0].unit,
                "units_mean": round(statistics.mean(g.units for g in gen), 1),
                "tokenize_batches": stats["calls"],
                "tokenized_chars": stats["chars"],
                "tokenized_chars_per_sample": round(stats["chars"] / len(gen)),
            }
        )
        r = rows[-1]
        print(
            f"{sub:16s} {dt:6.2f} s  prompt {r['prompt_tokens_mean']:8.1f} tok  left {r['tokens_left_min']:4d}.."
            f"{r['tokens_left_max']:<5d} (step {r['step_tokens']:.0f} tok)  tokenized {stats['chars'] / 1e6:5.2f} MB "
            f"in {stats['calls']} batches",
            flush=True,
        )
    t_gen = time.perf_counter() - t_gen
    total = time.perf_counter() - t_start
    n = sum(r["samples"] for r in rows)
    print(
        f"\n{n} samples ({len(rows)} subtasks x {args.num_samples}) at {args.length} tokens: generation {t_gen:.1f} s "
        f"(+ tokenizer load {t_tok:.1f} s) = {total:.1f} s wall;  {t_gen / n * 1000:.0f} ms per sample"
    )

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    hw = hardware()
    result = {
        "command": " ".join(shlex.quote(a) for a in [sys.executable.rsplit("/", 1)[-1], *sys.argv]),
        "length": args.length,
        "num_samples": args.num_samples,
        "seed": args.seed,
        "tokenizer": "Llama-2 SentencePiece tokenizer.model via transformers LlamaTokenizer (no chat template)",
        "generation_seconds": round(t_gen, 2),
        "tokenizer_load_seconds": round(t_tok, 2),
        "total_seconds": round(total, 2),
        "ms_per_sample": round(t_gen / n * 1000, 1),
        "subtasks": rows,
        "hardware": hw,
        "versions": versions(),
        "git_commit": git_commit(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    stem = out / f"results_{args.length}"
    stem.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    lines = [
        "# RULER data generation speed",
        "",
        f"`{result['command']}`  ({result['when']}, commit {result['git_commit']})",
        "",
        f"Hardware: {hw.get('cpu')}, {hw.get('affinity')} usable cores of {hw.get('cpu_count')}; "
        f"load average at the end {hw.get('loadavg_1_5_15')}.",
        "",
        f"**{n} samples ({len(rows)} subtasks x {args.num_samples}) at {args.length} tokens: {t_gen:.1f} s** "
        f"(+ {t_tok:.1f} s to load the tokenizer; {t_gen / n * 1000:.0f} ms per sample).",
        "",
        "| subtask | s | prompt tokens (mean) | tokens left min..max | one step (tokens) | tokenized MB | batches |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['subtask']} | {r['seconds']:.2f} | {r['prompt_tokens_mean']:.0f} | {r['tokens_left_min']}.."
            f"{r['tokens_left_max']} | {r['step_tokens']:.0f} ({r['unit']}) | {r['tokenized_chars'] / 1e6:.2f} | "
            f"{r['tokenize_batches']} |"
        )
    lines += [
        "",
        "Tokens left = length - tokens_to_generate - prompt tokens (BOS included); a sample stops short by "
        "less than one haystack step or max(32, 0.05% of the length) tokens, or its next larger haystack was seen "
        "not to fit.",
        "",
    ]
    stem.with_suffix(".md").write_text("\n".join(lines), encoding="utf-8")
    print(f"wrote {stem}.json and {stem}.md")


if __name__ == "__main__":
    main()
