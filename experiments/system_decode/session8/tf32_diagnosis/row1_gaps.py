"""Row 1 of ds_offload: the system path against the accuracy path with each backend, and the smallest relative
gaps between the k-th and (k+1)-th label scores (and between the new key's score and the k-th) that the eager
DS-Offload layers met (session 8's diagnosis; run from the repository root, needs the tests' helpers).
Usage: python experiments/system_decode/session8/tf32_diagnosis/row1_gaps.py"""
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch  # noqa: E402
from conftest import STORIES_DIR  # noqa: E402
from test_system import _accuracy_tokens, _system  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import sparse_eval.attention.plugin  # noqa: E402,F401
import sparse_eval.system.layers as L  # noqa: E402
from sparse_eval.tasks.wikitext import BUNDLED  # noqa: E402

tok = AutoTokenizer.from_pretrained(STORIES_DIR)
text = BUNDLED.read_text(encoding="utf-8")
prompts = [tok(text[:4000])["input_ids"][:260], tok(text[4000:8000])["input_ids"][:260]]
cfg = dict(name="double_sparsity", beta=0.02, offload=True)
gaps = []
orig_predict, orig_inc = L.DSOffloadLayer.predict, L.DSOffloadLayer._include_new


def predict(self, session, q_pred):
    p = orig_predict(self, session, q_pred)
    if self.static is None:
        s = self.label_scores(p["ql"], p["n_old"])
        v = torch.topk(s, min(p["k_old"] + 1, s.shape[-1]), -1).values
        if v.shape[-1] > p["k_old"]:
            g = (v[..., p["k_old"] - 1] - v[..., p["k_old"]]).abs() / v[..., p["k_old"] - 1].abs().clamp_min(1e-9)
            gaps.append(("kth-vs-next", self.layer_idx, p["n_old"], g.min().item()))
    return p


def include(self, p):
    inc = orig_inc(self, p)
    s_new = self._new_score(p["ql"], self._new[0])
    g = (s_new - p["vals"][..., -1]).abs() / p["vals"][..., -1].abs().clamp_min(1e-9)
    gaps.append(("new-vs-kth", self.layer_idx, p["n_old"], g.min().item()))
    return inc


L.DSOffloadLayer.predict, L.DSOffloadLayer._include_new = predict, include
dev = "cuda" if torch.cuda.is_available() else "cpu"
model = AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval().to(dev)
acc = _accuracy_tokens(model, tok, cfg, torch.tensor(prompts[1], device=dev))
print(dev, "acc", acc)
for kw in [dict(), dict(backend_gpu="torch"), dict(topk="torch"), dict(label_scale_dtype=torch.float32),
           dict(label_scale_dtype=torch.float32, backend_gpu="torch")]:
    gaps.clear()
    got = _system(model, cfg, [prompts[1]], **kw).tokens[0].tolist()
    first = next((i for i in range(len(got)) if got[i] != acc[i]), None)
    print(dev, {k: str(v) for k, v in kw.items()}, "first diff", first, got if first is not None else "")
    if first is not None or kw.get("label_scale_dtype") is not None:
        print("   smallest relative gaps (kind, layer, n_old, gap):", sorted(gaps, key=lambda x: x[3])[:6])
