"""GPU probe: the invariant kernels in bf16 (rows at other places in a tile, padding) and their speed vs stock."""

import time
import torch
import torch.nn.functional as F
from sparse_eval.kernels import invariant as kinv

torch.manual_seed(0)
dev = "cuda"
a = torch.randn(1, 300, 576, device=dev, dtype=torch.bfloat16)
w = torch.randn(1, 576, 1536, device=dev, dtype=torch.bfloat16)
full = kinv.bmm(a, w)
print("bmm bf16 vs torch max", (full.float() - torch.bmm(a, w).float()).abs().max().item())
print(
    "bmm rows shifted in tile equal:",
    all(
        torch.equal(kinv.bmm(a[:, s : s + n], w), full[:, s : s + n])
        for s, n in ((5, 10), (1, 1), (37, 200), (63, 2), (64, 64))
    ),
)
print(
    "bmm K left-padded equal:",
    torch.equal(
        kinv.bmm(F.pad(a, (100, 0)), torch.cat([torch.randn(1, 100, 1536, device=dev, dtype=torch.bfloat16), w], 1)),
        full,
    ),
)
s32 = kinv.bmm(a, w, out_dtype=torch.float32)
print("bmm bf16->fp32 rows shifted equal:", torch.equal(kinv.bmm(a[:, 7:19], w, out_dtype=torch.float32), s32[:, 7:19]))
b, hq, hkv, n, d = 4, 9, 3, 2000, 64
q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16) for h in (hq, hkv, hkv))
start = torch.tensor([0, 37, 500, 1999], device=dev)
out = kinv.attention(q, k, v, start, 0.125)
ref = kinv.attention_reference(q.float(), k.float(), v.float(), start, 0.125)
print("attention bf16 vs fp32 reference max", (out.float() - ref).abs().max().item())
ok = True
for r in (1, 2):
    s = int(start[r])
    alone = kinv.attention(q[r : r + 1, :, s:], k[r : r + 1, :, s:], v[r : r + 1, :, s:], start[:1] * 0, 0.125)
    ok &= torch.equal(alone[0], out[r, :, s:])
print("attention prefill alone == batched (any padding):", ok)
dec = kinv.attention(q[:, :, -1:], k, v, start, 0.125)
print("decode == prefill last row:", torch.equal(dec[:, :, 0], out[:, :, -1]))
x = torch.randn(1000, 4096, device=dev)
print("row_sum shifted/padded:", torch.equal(kinv.row_sum(F.pad(x, (333, 0))[5:9]), kinv.row_sum(x)[5:9]))


def t(f, n=20):
    f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e3


x = torch.randn(128 * 4096, 576, device=dev, dtype=torch.bfloat16)
wt = torch.randn(576, 1536, device=dev, dtype=torch.bfloat16)
print(
    f"prefill linear [524288x576]@[576x1536]: cublas {t(lambda: x @ wt):.2f} ms, "
    f"invariant {t(lambda: kinv.mm(x, wt)):.2f} ms"
)
xd = torch.randn(128, 576, device=dev, dtype=torch.bfloat16)
print(
    f"decode linear [128x576]@[576x1536]: cublas {t(lambda: xd @ wt):.3f} ms, "
    f"invariant {t(lambda: kinv.mm(xd, wt)):.3f} ms"
)
q, k, v = (torch.randn(16, h, 4096, 64, device=dev, dtype=torch.bfloat16) for h in (9, 3, 3))
st = torch.zeros(16, dtype=torch.long, device=dev)
print(
    "prefill attention 16x4096: sdpa "
    f"{t(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), 5):.2f} ms, "
    f"invariant {t(lambda: kinv.attention(q, k, v, st, 0.125), 5):.2f} ms"
)
qd = q[:, :, -1:]
print(
    f"decode attention 16x4096: sdpa {t(lambda: F.scaled_dot_product_attention(qd, k, v, enable_gqa=True)):.3f} ms, "
    f"invariant {t(lambda: kinv.attention(qd, k, v, st, 0.125)):.3f} ms"
)
