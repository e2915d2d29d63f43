"""Compile the Triton kernels for sm_90 (H100/H200) without a GPU and report registers and spills.

    python -m sparse_eval.kernels._aot_check            # exit code 1 if a kernel fails to compile or spills

Uses Triton's ahead-of-time path (``ASTSource`` + ``triton.compile`` for a ``GPUTarget``) and the ``ptxas``
shipped in Triton's NVIDIA backend, so compile errors that the CPU interpreter cannot see (types, layouts,
unsupported ops) and register spills of the default launch configurations show up on any machine.  Must run
without ``TRITON_INTERPRET`` (the kernels must be JIT functions).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def _configs():
    from . import (
        _tl_collisions,
        _tl_hash,
        _tl_labels,
        _tl_merge,
        _tl_scores,
        _tl_selected_attention,
        _tl_sparse_decode,
        _tl_topk,
    )

    sd = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "IDX": "*i32",
        "CNT": "*i32",
        "PACC": "*fp32",
        "PM": "*fp32",
        "PL": "*fp32",
        "O": "*bf16",
        "LSE": "*fp32",
    }
    sd32 = {**sd, "Q": "*fp32", "K": "*fp32", "V": "*fp32", "O": "*fp32", "IDX": "*i64"}
    base = dict(G=4, D=128, BLOCK_D=128, BLOCK_Q=16, BLOCK_N=64, INTERP=False, N_ITER=0, DENSE=False)
    out = []
    for qpi, cnt, single in ((4, False, False), (1, True, True)):
        out.append(
            (
                _tl_sparse_decode._sparse_decode_split,
                sd,
                dict(base, QPI=qpi, HAS_CNT=cnt, SINGLE=single, UPCAST=False),
                ("qk_scale",),
                4,
            )
        )
    # dense over row lengths (the captured full step) at its default 4 warps: ptxas spills 128 B there; measured on
    # the H200 it runs at 0.97x sdpa's speed (16K) and 8 warps (no spill) is no faster (experiments/ds_kernel_speed)
    out.append(
        (
            _tl_sparse_decode._sparse_decode_split,
            sd,
            dict(base, QPI=4, HAS_CNT=True, SINGLE=False, UPCAST=False, DENSE=True),
            ("qk_scale",),
            4,
            256,
        )
    )
    # float32 tiles multiply in IEEE fp32 (FMA, no tensor cores): BLOCK_N 32 at 8 warps
    out.append(
        (
            _tl_sparse_decode._sparse_decode_split,
            sd32,
            dict(base, QPI=4, HAS_CNT=False, SINGLE=False, UPCAST=True, BLOCK_N=32),
            ("qk_scale",),
            8,
        )
    )
    out.append(
        (
            _tl_sparse_decode._sparse_decode_reduce,
            {"PACC": "*fp32", "PM": "*fp32", "PL": "*fp32", "O": "*bf16", "LSE": "*fp32"},
            dict(D=128, BLOCK_D=128, BLOCK_S=4),
            (),
            4,
        )
    )
    lab = {"QL": "*fp32", "SC": "*fp16", "ZE": "*fp16", "LEN": "*i32", "OUT": "*fp32"}
    for bits, lt in ((16, "*bf16"), (8, "*u8"), (4, "*u8")):
        out.append(
            (
                _tl_scores._label_scores_kernel,
                {**lab, "LAB": lt},
                dict(
                    QPL=4,
                    R=8,
                    BLOCK_R=4 if bits == 4 else 8,
                    BITS=bits,
                    REDUCE=bits == 4,
                    HAS_LEN=bits == 8,
                    BLOCK_N=256,
                ),
                (),
                4,
            )
        )
    out.append(
        (
            _tl_scores._page_scores_kernel,
            {"Q": "*bf16", "KMIN": "*bf16", "KMAX": "*bf16", "NP": "*i32", "OUT": "*fp32"},
            dict(G=4, D=128, BLOCK_D=128, REDUCE=True, HAS_NP=False, BLOCK_P=32),
            (),
            4,
        )
    )
    out.append(
        (
            _tl_hash._simhash_kernel,
            {"X": "*bf16", "W": "*fp32", "OUT": "*i32"},
            dict(D=128, K=10, BLOCK_M=64, BLOCK_D=128, BLOCK_L=32),
            (),
            8,
        )
    )
    # collision counts: decode (G·Q = 4 rows of int16 codes) and a block of 16 rows with int32 query codes
    for rows_block, qt in ((4, "*i16"), (16, "*i32")):
        out.append(
            (
                _tl_collisions._collision_kernel,
                {"QC": qt, "KC": "*i16", "OUT": "*i16"},
                dict(
                    HKV=8,
                    G=4,
                    L=150,
                    BLOCK_N=64,
                    BLOCK_R=rows_block,
                    BLOCK_LC=8192 // (64 * rows_block),
                    L_PAD=-(-150 // (8192 // (64 * rows_block))) * (8192 // (64 * rows_block)),
                ),
                (),
                8,
            )
        )
    for bits, codes, sc in ((4, "*u8", "*fp16"), (8, "*u8", "*fp32"), (16, "*bf16", "*fp16")):
        out.append(
            (
                _tl_labels._append_labels_kernel,
                {"K": "*bf16", "CH": "*i32", "KVOF": "*i64", "CODES": codes, "SC": sc, "ZE": sc, "POS": "*i64"},
                dict(R=32, BLOCK_R=16 if bits == 4 else 32, BITS=bits),
                (),
                1,
            )
        )
    out.append(
        (
            _tl_labels._query_labels_kernel,
            {"Q": "*bf16", "QCH": "*i32", "OUT": "*fp32"},
            dict(R=32, BLOCK_R=32, BITS=4, QUANT=True),
            (),
            1,
        )
    )
    out.append(
        (
            _tl_merge._attend_merge_kernel,
            {
                "Q": "*bf16",
                "K1": "*bf16",
                "V1": "*bf16",
                "K2": "*bf16",
                "V2": "*bf16",
                "OO": "*fp32",
                "LO": "*fp32",
                "OUT": "*fp32",
                "LSE": "*fp32",
                "scale": "fp32",
            },
            dict(G=4, G_P2=4, D=128, BLOCK_D=128, BLOCK_N=16, INTERP=False, IT1=0, IT2=0),
            (),
            4,
        )
    )
    tk = {"S": "*fp32", "CNT": "*i32", "H": "*i32", "ST": "*i32", "G": "*i32", "OUT": "*i32"}
    for rb, cnt in ((8, True), (4, False)):
        c = dict(HAS_CNT=cnt, BITS=rb, BLOCK_N=2048)
        for p in (0, 1, 2, 32 // rb - 1):
            out.append((_tl_topk._hist, tk, dict(c, PASS=p, ATOMIC=p >= 2), (), 4))
        out.append((_tl_topk._count, tk, dict(c, PASSES=32 // rb), (), 4))
        out.append((_tl_topk._write, tk, dict(c, PASSES=32 // rb, TILES_P2=64, PAD=256), (), 4))
    out.append((_tl_topk._kth_value, tk, dict(PASSES=4, BITS=8), (), 1))
    # the accuracy path's fused attention (kernels.selected_attention) at the Llama-3.1-8B shape: G = 4, D = 128
    sa = {
        "Q": "*bf16",
        "K": "*bf16",
        "V": "*bf16",
        "KEEP": "*u8",
        "VAL": "*u8",
        "IDX": "*i32",
        "CNT": "*i32",
        "PCNT": "*i32",
    }
    sa32 = {**sa, "Q": "*fp32", "K": "*fp32", "V": "*fp32"}
    fl = ("BIAS", "SC", "KTH", "PM", "PL", "PA", "PMD", "PLD", "PLK", "PAD")
    sa.update({n: "*fp32" for n in fl})
    sa32.update({n: "*fp32" for n in fl})
    mbase = dict(G=4, D=128, BLOCK_D=128, BLOCK_R=16, BLOCK_N=64, SPLIT=1024, HAS_VAL=False)
    for ptrs, extra, warps in (
        (sa, dict(HAS_BIAS=True, HAS_SC=True, HAS_KTH=True, DENSE=True, UPCAST=False), 8),  # the wired form
        (sa, dict(HAS_BIAS=True, HAS_SC=True, HAS_KTH=False, DENSE=False, UPCAST=False), 8),  # error off
        (sa, dict(HAS_BIAS=False, HAS_SC=False, HAS_KTH=False, DENSE=True, UPCAST=False), 8),  # q·k in the kernel
        (sa32, dict(HAS_BIAS=True, HAS_SC=True, HAS_KTH=True, DENSE=True, UPCAST=True, BLOCK_N=32), 8),
        # a block of 64 query rows (a sparse prefill's G·Q rows): 255 registers, no spill
        (sa, dict(HAS_BIAS=True, HAS_SC=True, HAS_KTH=True, DENSE=True, UPCAST=False, BLOCK_R=64), 8),
    ):
        out.append((_tl_selected_attention._mask_split, ptrs, dict(mbase, **extra), ("qk_scale",), warps))
    # index form: BLOCK_N 32 where q·k is taken in the kernel (64 spills there), 64 where the scores are read
    ibase = dict(G=4, D=128, BLOCK_D=128, BLOCK_R=16, SPLIT=1024, HAS_CNT=True, UPCAST=False)
    for qpi, sc in ((4, False), (1, False), (4, True), (1, True)):
        out.append(
            (
                _tl_selected_attention._index_split,
                sa,
                dict(ibase, QPI=qpi, HAS_BIAS=True, HAS_SC=sc, BLOCK_N=64 if sc else 32),
                ("qk_scale",),
                8,
            )
        )
    merge_ptrs = {n: "*fp32" for n in ("PM", "PL", "PA", "PMD", "PLD", "PLK", "PAD", "LSE", "LSED", "MASS", "ERR")}
    merge_ptrs.update({"PCNT": "*i32", "CNT": "*i32", "O": "*bf16", "OD": "*bf16"})
    for dense in (True, False):
        out.append(
            (
                _tl_selected_attention._merge,
                merge_ptrs,
                dict(D=128, BLOCK_D=128, DENSE=dense, INTERP=False, NS=0),
                (),
                4,
            )
        )
    return out


_SHOWN = ("QPI", "BITS", "UPCAST", "REDUCE", "K", "DENSE", "PASS", "HAS_SC")  # the constexprs a report line names


def main() -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the AOT check compiles JIT functions")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    bad = 0
    for fn, ptrs, consts, floats, warps, *allow in _configs():
        allowed_spill = allow[0] if allow else 0  # bytes of spill stores accepted (measured harmless)
        sig = {n: ("constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32")) for n in fn.arg_names}
        name = f"{fn.__name__}{ {k: v for k, v in consts.items() if k in _SHOWN} }"
        try:
            k = triton.compile(
                ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options={"num_warps": warps}
            )
        except Exception as e:  # noqa: BLE001 - report every failure
            print(f"FAIL {name}: {type(e).__name__}: {str(e)[:800]}")
            bad += 1
            continue
        info = ""
        if os.path.exists(ptxas):
            with tempfile.TemporaryDirectory() as d:
                src = os.path.join(d, "k.ptx")
                with open(src, "w") as fh:
                    fh.write(k.asm["ptx"])
                r = subprocess.run(
                    [ptxas, "-v", "--gpu-name=sm_90a", src, "-o", os.path.join(d, "k.cubin")],
                    capture_output=True,
                    text=True,
                )
                info = " | ".join(
                    line.split("info    :")[-1].strip()
                    for line in r.stderr.splitlines()
                    if "registers" in line or "spill" in line
                )
                if r.returncode != 0:
                    print(f"FAIL {name}: ptxas: {r.stderr[-800:]}")
                    bad += 1
                    continue
                import re

                spilled = re.search(r"(\d+) bytes spill stores", info)
                if spilled is None or int(spilled.group(1)) > allowed_spill:
                    print(f"SPILL {name} (num_warps={warps}): {info}")
                    bad += 1
                    continue
        print(f"ok   {name} (num_warps={warps}, shared {k.metadata.shared} B): {info}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
