"""Host-part time of MagicPIG's static step on the CPU early and late in a long generation (the overflow list grows
by one key per step).  Usage: python long_gen_hostpart.py REPO CONTEXT BATCH NEW_TOKENS (REPO: the checkout to import)."""
import sys, time, statistics
repo = sys.argv[1]
sys.path.insert(0, repo)
import torch
from sparse_eval.system.models import random_model
from sparse_eval.system import decode
from sparse_eval.methods.registry import build_method
import sparse_eval.system.layers as L
ctx, batch, new = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
model = random_model("llama3_1_8b", "cpu", torch.bfloat16, num_layers=2)
method = build_method({"name": "magicpig", "K": 10, "L": 150, "dense_layers": [0]})
method.setup(model, "llama3_1_8b")
ids = torch.randint(0, 1000, (1, ctx), generator=torch.Generator().manual_seed(0))
orig = L.MagicPIGLayer._host_part
times = []
def hp(self, session, scaling):
    t = time.perf_counter(); r = orig(self, session, scaling); times.append(time.perf_counter() - t); return r
L.MagicPIGLayer._host_part = hp
t0 = time.perf_counter()
res = decode(model, method, ids, new, repeat_batch=batch, cuda_graph=True)
q = len(times) // 4
print(repo, f"steps {new}: host part median ms: first quarter {1e3*statistics.median(times[:q]):.2f}, last quarter "
      f"{1e3*statistics.median(times[-q:]):.2f}; wall {time.perf_counter()-t0:.0f} s; tokens[0][-5:] {res.tokens[0, -5:].tolist()}")
