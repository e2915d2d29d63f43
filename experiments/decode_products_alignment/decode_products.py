"""The two products of the accuracy path's decode step (``methods/core.py``), timed in several formulations.

q·Kᵀ (scores) and P·V (weighted values) for one query token per head, GQA (32 query / 8 KV heads, d = 128),
bf16 K/V: cuBLAS picks its kernel from the shapes, and a G·Q = 4-row product with a 16K-long reduction (P·V) or
output (q·Kᵀ) can land on a slow one.  Prints the median of CUDA-event-timed calls per formulation, and checks
that each formulation gives the reference's values.

    python experiments/decode_products_alignment/decode_products.py [N ...]    # on the GPU machine
"""

import statistics
import sys

import torch


def timed(fn, reps=50, warm=5):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _padded_rows(x, dtype):
    """x [..., N] -> the same values in ``dtype``, as a view of a buffer whose rows are padded to a multiple of 8
    elements (16-byte aligned rows for 16-bit types)."""
    n = x.shape[-1]
    buf = torch.zeros((*x.shape[:-1], n + (-n) % 8), dtype=dtype, device=x.device)
    buf[..., :n] = x
    return buf[..., :n]


def main():
    dev = torch.device("cuda")
    b, hq, hkv, ql, d = 1, 32, 8, 1, 128
    g = hq // hkv
    for n in [int(a) for a in sys.argv[1:]] or (4096, 16384, 65536):
        q = torch.randn(b, hq, ql, d, device=dev, dtype=torch.bfloat16)
        k = torch.randn(b, hkv, n, d, device=dev, dtype=torch.bfloat16)
        v = torch.randn(b, hkv, n, d, device=dev, dtype=torch.bfloat16)
        p = torch.softmax(torch.randn(b, hq, ql, n, device=dev), -1)
        qs = q.reshape(b, hkv, g * ql, d)
        ps = p.reshape(b, hkv, g * ql, n)
        c = 16
        scores = {
            "broadcast over the group": lambda: torch.matmul(
                q.reshape(b, hkv, g, ql, d), k.unsqueeze(2).transpose(-1, -2)
            ).reshape(b, hq, ql, n),
            "G*Q rows @ K^T": lambda: torch.matmul(qs, k.transpose(-1, -2)).reshape(b, hq, ql, n),
            "(K @ (G*Q rows)^T)^T": lambda: (
                torch.matmul(k, qs.transpose(-1, -2)).transpose(-1, -2).reshape(b, hq, ql, n)
            ),
        }
        values = {
            "broadcast over the group": lambda: torch.matmul(
                p.reshape(b, hkv, g, ql, n).to(v.dtype), v.unsqueeze(2)
            ).reshape(b, hq, ql, d),
            "G*Q rows @ V": lambda: torch.matmul(ps.to(v.dtype), v).reshape(b, hq, ql, d),
            "(V^T @ (G*Q rows)^T)^T": lambda: (
                torch.matmul(v.transpose(-1, -2), ps.to(v.dtype).transpose(-1, -2))
                .transpose(-1, -2)
                .reshape(b, hq, ql, d)
            ),
            "G*Q rows (padded to 8) @ V": lambda: (_padded_rows(ps, v.dtype) @ v).reshape(b, hq, ql, d),
        }
        if n % c == 0:  # the reduction split into c chunks (another summation order)
            values[f"split-K by hand ({c} chunks)"] = lambda: (
                torch.matmul(
                    ps.to(v.dtype).view(b, hkv, g * ql, c, n // c).transpose(2, 3), v.view(b, hkv, c, n // c, d)
                )
                .sum(2, dtype=torch.float32)
                .to(v.dtype)
                .reshape(b, hq, ql, d)
            )
        bias = torch.zeros(b, hq, ql, n, device=dev, dtype=torch.bfloat16)
        bias[..., ::3] = float("-inf")
        fused = {  # for scale: the whole masked softmax · V in one call, against the unfused step of the core
            "core: scores, mask, softmax, P V": lambda: torch.matmul(
                torch.softmax((torch.matmul(qs, k.transpose(-1, -2)).float() + bias.reshape(b, hkv, g * ql, n)), -1).to(
                    v.dtype
                ),
                v,
            ),
            "sdpa, bias mask, enable_gqa": lambda: torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=bias, enable_gqa=True
            ),
        }
        for name, fn in fused.items():
            print(f"N={n:6d} {'fused':6s} {name:28s} {timed(fn) * 1e3:8.1f} us", flush=True)
        for what, fns in (("q K^T", scores), ("P V", values)):
            ref = list(fns.values())[0]().float()
            for name, fn in fns.items():
                err = float((fn().float() - ref).norm() / ref.norm())
                print(f"N={n:6d} {what:6s} {name:28s} {timed(fn) * 1e3:8.1f} us  rel diff {err:.1e}", flush=True)
    print(torch.__version__, torch.cuda.get_device_name(), file=sys.stderr)


if __name__ == "__main__":
    main()
