"""``python -m sparse_eval --help``: what the command does, its methods and tasks with one line each, the options
that matter, then every option with its default.

The text is Hydra's app help template (``hydra.help.template`` in ``conf/config.yaml`` reads the resolver
``sparse_eval_help``, registered by ``config.register_configs``), made here at each ``--help`` from what the code
holds: the methods from their classes (``method_facts.method_summaries``: the registry's methods, read from the
shipped modules' source without importing torch, or from the registry itself once a plugin is configured), the
tasks from the task registry (``Task.summary``, ``Task.num_samples_means``), the presets, models and experiments
from the files of ``conf/``.  A method or task added to its registry appears without an edit here.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..hydra_support import CONF_DIR

WIDTH = 116  # the help's lines wrap at this width


def _yaml(path: Path) -> dict[str, Any]:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _base(path: Path, names: list[str]) -> str | None:
    """The registered name a preset configures: its ``name`` field, else that of the config its ``defaults`` extend
    (the first entry that is neither a schema nor ``_self_``), followed until a registered name."""
    seen: set[Path] = set()
    while path not in seen:
        seen.add(path)
        data = _yaml(path)
        if data.get("name") in names:
            return data["name"]
        extends = [e for e in data.get("defaults") or [] if isinstance(e, str) and e != "_self_"]
        parent = next((e for e in extends if not e.endswith("_schema")), None)
        if parent is None:
            return None
        if parent in names:
            return parent
        path = path.with_name(f"{parent}.yaml")
    return None


def _wrap(text: str, indent: str, first: str = "") -> list[str]:
    import textwrap

    return textwrap.wrap(text, WIDTH, initial_indent=first or indent, subsequent_indent=indent) or [first]


def _rows(items: dict[str, str], indent: str = "  ", width: int | None = None) -> list[str]:
    """``name   description`` rows, the descriptions aligned (at ``width``, else after the longest name) and wrapped."""
    width = width or max((len(k) for k in items), default=0) + 2
    out = []
    for name, text in items.items():
        out += _wrap(text, indent + " " * width, first=f"{indent}{name:<{width}}")
    return out


def _presets(group: str, names: list[str]) -> dict[str, list[str]]:
    """{base config: [presets]} of ``conf/<group>/``: the yaml files that are not a registered name."""
    out: dict[str, list[str]] = {}
    for path in sorted((CONF_DIR / group).glob("*.yaml")):
        if path.stem not in names:
            out.setdefault(_base(path, names) or "other", []).append(path.stem)
    return out


def _default_choice(group: str) -> str | None:
    for entry in _yaml(CONF_DIR / "config.yaml").get("defaults") or []:
        if isinstance(entry, dict) and group in entry:
            return entry[group]
    return None


def methods_section() -> list[str]:
    from ..method_facts import method_summaries

    summaries = method_summaries()
    lines = ["== Methods (method=NAME; with no method=, every one of them, full attention first) =="]
    lines += _rows(summaries)
    lines += [
        "",
        *_wrap(
            "Their options: method.<field>=VALUE (e.g. method.budget=0.1, method.K=9 method.L=120); each method's "
            "fields and paper defaults are in conf/method/<name>.yaml.",
            "  ",
        ),
        "  Presets (method=PRESET: a method with some options set, conf/method/PRESET.yaml):",
    ]
    for base, presets in _presets("method", list(summaries)).items():
        lines += _wrap(", ".join(presets), "      ", first=f"    {base}: ")
    return lines


def tasks_section() -> list[str]:
    from ..tasks import TASKS

    default = _default_choice("task")
    lines = ["== Tasks (task=NAME) =="]
    lines += _rows({name: cls.summary or name for name, cls in sorted(TASKS.items())})
    presets = _presets("task", list(TASKS))
    if presets:
        lines.append("  Presets (task=PRESET: a task with some options set, conf/task/PRESET.yaml):")
        for base, names in presets.items():
            named = [f"{n} (the default)" if n == default else n for n in names]
            lines += _wrap(", ".join(named), "      ", first=f"    {base}: ")
    return lines


def limit_rows() -> list[str]:
    """What ``task.num_samples=N`` (the quick try, lm-eval's ``--limit``) keeps, per task."""
    from ..tasks import TASKS

    per_task = {}
    for name, cls in sorted(TASKS.items()):
        field = {f.name: f for f in dataclasses.fields(cls.config_class)}.get("num_samples")
        default = field.default if field is not None else None
        per_task[name] = cls.num_samples_means + (f" (default {default})" if default is not None else "")
    return _rows(per_task, indent=" " * 25)


def options_section() -> list[str]:
    models = sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml"))
    default_model = _default_choice("model")
    experiments = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))
    opts = {
        "model=NAME": "one of: "
        + ", ".join(f"{m} (the default)" if m == default_model else m for m in models)
        + "; or model.path=DIR|HUB_ID (model.gguf_file=FILE for a GGUF)",
        "method=NAME": "one method (above) instead of all of them; method.<field>=VALUE sets its options",
        "task=NAME": "the task (above); task.<field>=VALUE its options (task.length=4096, task.subtasks=[...])",
        "seed=S": "the seed of a method's random draws (MagicPIG, oracle sampling); seed=[0,1,2] runs a stochastic "
        "method once per seed and pools them; the prompts stay fixed (task.seed)",
        "eval.batch_size=N": "samples per padded batch, or auto (the largest that fits); records are the same at "
        "any batch size",
        "eval.protocol=A|B|S": "which positions run sparse (A: decoding only; B: question and decoding; S: every "
        "position); default: the task's",
        "paths.runs_dir=DIR": "where runs are written (default runs, env SPARSE_EVAL_RUNS_DIR)",
        "paths.data_dir=DIR": "the local data sets (env SPARSE_EVAL_DATA_DIR); the default run needs none",
        "-m a=x,y b=z,w": "a multirun: one job per combination (e.g. -m method=topk method.budget=0.02,0.1), "
        "every job checked before any starts, one table of all their runs at the end",
        "+experiment=NAME": "a paper experiment, with -m: " + ", ".join(experiments) + " (smoke/NAME: a minute on a "
        "CPU)",
    }
    limit = {
        "task.num_samples=N": "a quick try, like lm-eval's --limit: only the first N samples. N is part of the run's "
        "identity: a run of N samples has its own run directory and is never pooled or paired with a run of "
        "another N. Per task:"
    }
    first = ("model=NAME", "method=NAME", "task=NAME")
    return [
        "== Options that matter ==",
        *_rows({k: v for k, v in opts.items() if k in first}, width=21),
        *_rows(limit, width=21),
        *limit_rows(),
        *_rows({k: v for k, v in opts.items() if k not in first}, width=21),
    ]


def app_help() -> str:
    """The whole help text (Hydra substitutes ``$CONFIG``: the composed config with every option's value)."""
    lines = [
        *_wrap(
            "python -m sparse_eval [key=value ...]: evaluate sparse attention methods for LLM decoding, model x "
            "method x task. Each run prints its score with a 95 % interval, the paired difference against full "
            "attention, Cost1/Cost2 and the estimation error. With no arguments: the shipped stories260K model, "
            "WikiText-2 perplexity over 4 windows, every method below, offline (about 30 s on a CPU).",
            "",
        ),
        "",
        *methods_section(),
        "",
        *tasks_section(),
        "",
        *options_section(),
        "",
        "== Then ==",
        *_rows(
            {
                "python -m sparse_eval.results.status runs/": "each run's state (done, incomplete, running, failed, "
                "pending)",
                "python -m sparse_eval.results.collect runs/": "every run in one table fitted to the terminal (--wide: "
                "the long view; runs/results.csv: every column)",
                "python -m sparse_eval.verdicts": "the papers' claims tested on the committed records",
                "python -m sparse_eval.report runs/": "the papers' tables and figures",
            }
        ),
        "",
        "== Every option and its value (key=value; Hydra's own: --hydra-help) ==",
        "$CONFIG",
    ]
    return "\n".join(line.replace("$", "$$") if line != "$CONFIG" else line for line in lines) + "\n"
