"""What every command line of the package does with errors: one line saying what to fix, and one meaning per exit code.

    0    success
    1    a failure while running (a crash after the run started; a multirun with failed jobs)
    2    bad configuration or input, found before anything was written: a Hydra error (unknown key, group or
         option), a bad value, missing data or model weights, a corrupt calibration file, an unwritable runs dir
    124  a multirun stopped at its deadline (``hydra/launcher=local_gpus hydra.launcher.deadline_s=S``): what
         finished is kept, the same command resumes it
    130  interrupted (Ctrl-C): the run keeps what it wrote and resumes when the same command runs again
    143  terminated (SIGTERM, what Slurm and ``timeout`` send): as Ctrl-C

``hydra_entry(main)`` runs a ``@hydra.main`` function under these rules.  ``HYDRA_FULL_ERROR=1`` set by the user
still shows Hydra's full traceback.  A refused command (exit status 2) leaves nothing under ``paths.runs_dir``:
the output folder Hydra made for it (``.hydra/<time>``: its log and config copies) is removed again
(``forget_hydra_output``), and so are the folders made only to hold it.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import sys
from pathlib import Path
from typing import Any, Callable

from ..hydra_support import CONF_DIR, MADE

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143
EXIT_DEADLINE = 124  # a multirun stopped at its deadline (as ``timeout``); the same command resumes it
SCHEMA_SUFFIX = "_schema"
_APP_STARTED = False  # set by ``check_choices`` when Hydra has called the app: an OSError before it is Hydra's


class Terminated(KeyboardInterrupt):
    """SIGTERM (Slurm's time limit or preemption, ``timeout``, ``kill``), raised in the main thread so a run stops
    as it does on Ctrl-C: what it wrote is kept and the same command resumes it."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated()


def fail(message: str, code: int = EXIT_USAGE) -> None:
    print(f"error: {message}", file=sys.stderr)
    if code == EXIT_USAGE:
        forget_hydra_output()
    sys.exit(code)


def forget_hydra_output() -> None:
    """Remove the output folder Hydra made for this single run (``hydra.run.dir``: its log and config copies) and
    the folders ``hydra_support.writable_or_tmp`` made only to hold it, when they are empty: a refused command leaves
    nothing under ``paths.runs_dir``."""
    import logging

    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        if not HydraConfig.initialized() or HydraConfig.get().mode != RunMode.RUN:
            return
        out = Path(HydraConfig.get().runtime.output_dir)
    except Exception:  # noqa: BLE001 - no Hydra output folder to forget
        return
    for h in list(logging.root.handlers):  # the job's log file lies in that folder
        name = getattr(h, "baseFilename", None)
        if name and Path(name).is_relative_to(out):
            logging.root.removeHandler(h)
            h.close()
    if out.is_dir() and out.parent.name == ".hydra":
        shutil.rmtree(out, ignore_errors=True)
    for d in sorted(MADE, key=lambda p: len(p.parts), reverse=True):
        try:
            d.rmdir()  # only when empty
        except OSError:
            pass


def _yaml_choices(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_choices() -> None:
    """Refuse a structured-config schema picked as a config (``method=topk_schema``): schemas are the types the
    yaml files of a group are checked against, not choices."""
    from hydra.core.hydra_config import HydraConfig

    global _APP_STARTED
    _APP_STARTED = True
    if not HydraConfig.initialized():
        return
    for group, choice in HydraConfig.get().runtime.choices.items():
        if choice and str(choice).endswith(SCHEMA_SUFFIX) and "/" not in group and group != "hydra":
            raise ValueError(f"{group}={choice} is a config schema, not a {group}; valid: {_yaml_choices(group)}")


def check_compare(cfg: Any) -> None:
    """Refuse ``compare=[...]`` given on the command line while a method is chosen (``method=``, or pinned by an
    ``+experiment``): only the chosen method would run and the list would be ignored without a word."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized() or cfg.get("method") is None:
        return
    given = [o for o in HydraConfig.get().overrides.task if o.split("=", 1)[0].lstrip("+") == "compare"]
    if given:
        choice = HydraConfig.get().runtime.choices.get("method")
        raise ValueError(
            f"{given[0]} is ignored while method={choice} is chosen (an +experiment may pin it); "
            "add ~method to run the compare list, or drop compare="
        )


def names_a_method(argv: list[str]) -> bool:
    """Whether a command line may compose a method config (so the methods' schemas must be registered first): an
    argument that mentions ``method`` or ``experiment``, or another primary config (``--config-name``, ...).
    Guessing yes only costs importing torch; a wrong no fails composition with one error line."""
    return any(
        "method" in a or "experiment" in a or a.startswith(("-cn", "-cp", "-cd", "--config", "--info")) for a in argv
    )


def _argv_overrides() -> list[str]:
    return [a for a in sys.argv[1:] if not a.startswith("-")]


def hydra_message(exc: BaseException) -> str:
    """One or two lines for a Hydra / OmegaConf error, with the fix where we know it."""
    msg = str(exc).strip()
    cause = exc.__cause__
    cause_line = str(cause).strip().splitlines()[0] if cause is not None and str(cause).strip() else ""
    if "not in struct" in (msg + cause_line) and "Could not override 'method." in msg:
        key = msg.split("'")[1]
        if not any(a.split("=")[0].lstrip("+~") == "method" for a in _argv_overrides()):
            return (
                f"{key}: no method chosen (without method=, every method in `compare` runs); add method=NAME, "
                f"valid: {_yaml_choices('method')}"
            )
    missing = re.search(r"Could not (?:find|load) '([\w./-]+)'", msg)
    group = re.search(r"Available options in '([\w./-]+)'", msg)
    if missing and group and missing.group(1).startswith(group.group(1) + "/"):
        return missing_config_message(msg, group.group(1), missing.group(1)[len(group.group(1)) + 1 :])
    lines = [l for l in msg.splitlines() if l.strip() and not l.strip().endswith(SCHEMA_SUFFIX)]
    if cause_line and cause_line not in msg:
        lines.append(cause_line)
    return "\n".join(lines)


def missing_config_message(msg: str, group: str, name: str) -> str:
    """One line for Hydra's "Could not find '<group>/<name>'" and its option listing: every option of the group,
    those in subfolders too (``smoke/ruler_magicpig``, which Hydra's listing leaves out), without the schemas, and
    the closest names."""
    import difflib

    listed = []
    for line in msg.split("Available options in", 1)[1].splitlines()[1:]:
        if not line.startswith(("\t", " ")):
            break  # Hydra's "Config search path:" follows
        listed.append(line.strip())
    folder = CONF_DIR / group
    nested = (
        [p.relative_to(folder).with_suffix("").as_posix() for p in folder.rglob("*.yaml")] if folder.is_dir() else []
    )
    options = sorted(
        {o for o in listed + nested if o and not o.endswith(SCHEMA_SUFFIX)}, key=lambda o: (o.count("/"), o)
    )
    guess = difflib.get_close_matches(name, options, n=2, cutoff=0.6)
    base = name[: -len("_smoke")] if name.endswith("_smoke") else name
    if name.endswith("_smoke") and f"smoke/{base}" in options:  # the smoke variants live in a subfolder
        guess = [f"smoke/{base}"] + [g for g in guess if g != f"smoke/{base}"]
    hint = f"; did you mean {' or '.join(guess)}?" if guess else ""
    return f"Could not find '{group}/{name}'; valid {group} options: {', '.join(options)}{hint}"


def interrupted(exc: KeyboardInterrupt) -> None:
    """Ctrl-C or SIGTERM (``Terminated``): where the run stopped and how to resume it; exit status 130 or 143."""
    what = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
    code = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
    run_dir = getattr(exc, "run_dir", None)
    if run_dir is None:
        print(f"\n{what} before a run started; nothing was written", file=sys.stderr)
        forget_hydra_output()
    else:
        from ..results.status import run_state

        s = run_state(Path(run_dir))
        exp = "?" if s["expected"] is None else s["expected"]
        print(
            f"\n{what}: {run_dir} stopped with {s['written']}/{exp} samples written; run the same command "
            f"again to resume at the next sample",
            file=sys.stderr,
        )
    sys.exit(code)


def print_help(main: Callable[[], Any]) -> None:
    """Hydra's ``--help`` without the structured-config schemas among a group's options (``method: ...,
    topk_schema, ...``): they are the types the yaml files are checked against, not choices."""
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            main()
        except SystemExit:
            pass
    lines = []
    for line in buf.getvalue().splitlines(keepends=True):
        m = re.match(r"([\w/]+): (.*)$", line.rstrip("\n"))
        if m and ("," in m.group(2) or m.group(2).endswith(SCHEMA_SUFFIX)):
            opts = [o for o in m.group(2).split(", ") if not o.endswith(SCHEMA_SUFFIX)]
            line = f"{m.group(1)}: {', '.join(opts)}\n"
        lines.append(line)
    sys.stdout.write("".join(lines))


def hydra_entry(main: Callable[[], Any]) -> None:
    """Run a ``@hydra.main`` function: Hydra's own errors (composition, overrides, its output folder) as one
    ``error:`` line and exit status 2; Ctrl-C as where the run stopped and exit status 130, SIGTERM the same with
    exit status 143."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    user_full = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"  # Hydra re-raises instead of printing a stripped traceback and exit(1)
    if "--help" in sys.argv[1:] or "-h" in sys.argv[1:]:
        print_help(main)
        return
    if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):  # SIGTERM ends a run as Ctrl-C does
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        main()
    except KeyboardInterrupt as exc:
        interrupted(exc)
    except (HydraException, OmegaConfBaseException) as exc:
        if user_full:
            raise
        fail(hydra_message(exc))
    except OSError as exc:
        if user_full or _APP_STARTED:
            raise
        # Hydra could not create its output folder (hydra.run.dir / hydra.sweep.dir, under paths.runs_dir)
        fail(
            f"cannot write {exc.filename or 'Hydra output folder'} ({exc.strerror or exc}); give a writable folder, "
            f"e.g. paths.runs_dir=runs"
        )
