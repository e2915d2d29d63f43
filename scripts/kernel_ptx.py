"""Whether a change to the Triton kernels changes the code a GPU runs, checked without a GPU.

    python scripts/kernel_ptx.py record specs.json [PYTEST ARGS]   # the launches the kernel tests make
    python scripts/kernel_ptx.py digest specs.json before.json     # each launch compiled for sm_90: PTX sha256
    python scripts/kernel_ptx.py diff before.json after.json       # exit 1 where a launch's PTX differs

``record`` runs pytest (default: ``tests/kernels``) under Triton's interpreter and writes every distinct launch
of a top-level kernel: its module and name, each argument's Triton type (a pointer's element type, an integer's
width) or constexpr value, and the launch's warps and stages.  ``digest`` compiles each launch ahead of time for
sm_90 (H100/H200) with ``INTERP=False`` (the GPU's loop form) and hashes its PTX with the debug lines (``.loc``,
``.file``, debug sections and the ``$L__tmpN:`` scope labels only they name) left out, so that moving code between
lines or files, or inlining a helper, does not count.  A refactor whose ``diff`` is empty gives the GPU the same
instructions: its records stay bit-identical there without a GPU run.
The launches are the tests' shapes, not every shape a run makes; integers are typed by value, without Triton's
specialisation of 1 and of multiples of 16 (the same for both sides of a diff).
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
import sys
from pathlib import Path

_TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16",
    "torch.float16": "fp16",
    "torch.float32": "fp32",
    "torch.float64": "fp64",
    "torch.int8": "i8",
    "torch.uint8": "u8",
    "torch.int16": "i16",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.bool": "i1",
}


def _constexpr_names(fn) -> set[str]:
    import inspect

    out = set()
    for name, p in inspect.signature(fn).parameters.items():
        ann = p.annotation
        if ann is not inspect.Parameter.empty and "constexpr" in str(ann):
            out.add(name)
    return out


def _describe(value) -> object:
    """A constexpr's value as JSON (a Triton dtype as its name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return {"repr": str(value)}


def _type_of(value) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return "*" + _TORCH_TO_TRITON[str(value.dtype)]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"an argument of type {type(value).__name__}")


class _Recorder:
    def __init__(self) -> None:
        self.launches: dict[str, dict] = {}

    def pytest_configure(self, config) -> None:  # noqa: ARG002 - pytest's hook
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        recorder = self

        def run(self, *args, grid, warmup, **kwargs):
            recorder.add(self, args, kwargs)
            return original(self, *args, grid=grid, warmup=warmup, **kwargs)

        InterpretedFunction.run = run

    def add(self, kernel, args, kwargs) -> None:
        fn = kernel.fn
        consts = _constexpr_names(fn)
        bound = dict(zip(kernel.arg_names, args))
        bound.update({k: v for k, v in kwargs.items() if k in kernel.arg_names})
        sig, cvals = {}, {}
        for name in kernel.arg_names:
            if name not in bound:  # a default
                continue
            v = bound[name]
            if name in consts:
                sig[name] = "constexpr"
                cvals[name] = _describe(v)
            else:
                sig[name] = _type_of(v)
                if sig[name] == "constexpr":
                    cvals[name] = None
        launch = {
            "module": fn.__module__,
            "name": fn.__name__,
            "signature": sig,
            "constexprs": cvals,
            "num_warps": kwargs.get("num_warps", 4),
            "num_stages": kwargs.get("num_stages", 3),
        }
        key = json.dumps(launch, sort_keys=True)
        self.launches.setdefault(hashlib.sha256(key.encode()).hexdigest()[:16], launch)


def record(out: Path, pytest_args: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"
    import pytest

    rec = _Recorder()
    rc = pytest.main(["-q", "-p", "no:cacheprovider", *(pytest_args or ["tests/kernels"])], plugins=[rec])
    out.write_text(json.dumps(dict(sorted(rec.launches.items())), indent=1) + "\n", encoding="utf-8")
    print(f"{len(rec.launches)} distinct launches -> {out} (pytest exit {rc})")
    return int(rc)


_DEBUG = re.compile(r"^\s*(\.loc|\.file|//)")
_SCOPE_LABEL = re.compile(r"^(\$L__tmp\d+):$")


def _ptx_digest(ptx: str) -> str:
    keep, in_debug = [], False
    for line in ptx.splitlines():
        if line.lstrip().startswith(".section") and ".debug" in line:
            in_debug = True
            continue
        if in_debug:
            if line.strip() == "}":
                in_debug = False
            continue
        if not _DEBUG.match(line):
            keep.append(line)
    # the scope labels LLVM places for the debug sections ($L__tmpN: where an inlined helper's lines begin and end):
    # left out where no kept line names them, so inlining a helper by hand does not count
    named = set(re.findall(r"\$L__tmp\d+\b(?!:)", "\n".join(keep)))
    keep = [line for line in keep if not ((m := _SCOPE_LABEL.match(line)) and m.group(1) not in named)]
    return hashlib.sha256("\n".join(keep).encode()).hexdigest()


def digest(specs: Path, out: Path) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: digest compiles JIT functions")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    launches = json.loads(specs.read_text(encoding="utf-8"))
    result, bad = {}, 0
    for key, launch in launches.items():
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        consts = {}
        for name, v in launch["constexprs"].items():
            if isinstance(v, dict):  # a Triton dtype, by its name (fp32, bf16, ...)
                v = triton.language.dtype(v["repr"])
            consts[name] = v
        if "INTERP" in consts:
            consts["INTERP"] = False  # the GPU's loop form
        sig = {n: launch["signature"].get(n, "constexpr") for n in fn.arg_names if n in launch["signature"]}
        label = f"{launch['module'].split('.')[-1]}.{launch['name']}"
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts),
                target=target,
                options={"num_warps": launch["num_warps"], "num_stages": launch["num_stages"]},
            )
            result[key] = {"kernel": label, "ptx_sha256": _ptx_digest(k.asm["ptx"])}
        except Exception as e:  # noqa: BLE001 - every failure reported
            result[key] = {"kernel": label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
            bad += 1
        print(f"{label:48s} {result[key].get('ptx_sha256', result[key].get('error'))[:80]}", flush=True)
    out.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    print(f"{len(result)} launches compiled for sm_90, {bad} failed -> {out}")
    return 1 if bad else 0


def diff(a: Path, b: Path) -> int:
    da, db = (json.loads(p.read_text(encoding="utf-8")) for p in (a, b))
    changed = [k for k in sorted(set(da) | set(db)) if da.get(k) != db.get(k)]
    for k in changed:
        print(f"{(da.get(k) or db.get(k))['kernel']:48s} {k}: {da.get(k)} -> {db.get(k)}")
    same = len(set(da) & set(db)) - len([k for k in changed if k in da and k in db])
    print(f"{same} launches give the same PTX, {len(changed)} differ")
    return 1 if changed else 0


def main(argv: list[str]) -> int:
    if len(argv) >= 2 and argv[0] == "record":
        return record(Path(argv[1]), argv[2:])
    if len(argv) == 3 and argv[0] == "digest":
        return digest(Path(argv[1]), Path(argv[2]))
    if len(argv) == 3 and argv[0] == "diff":
        return diff(Path(argv[1]), Path(argv[2]))
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
