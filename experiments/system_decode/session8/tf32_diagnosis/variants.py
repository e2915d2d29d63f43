"""Which piece of DS-Offload's static step differs on the GPU: the stories model decoded in nine variants, each
compared with the accuracy path, per row (session 8's diagnosis; run from the repository root, needs the tests'
helpers).  Usage: python experiments/system_decode/session8/tf32_diagnosis/variants.py"""
import contextlib
import os
import sys

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import torch  # noqa: E402
from conftest import STORIES_DIR  # noqa: E402
from test_system import _accuracy_tokens, _system  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

import kernels.offload as koff  # noqa: E402
import sparse_eval.attention.plugin  # noqa: E402,F401
import sparse_eval.system.decoder as dec  # noqa: E402
import sparse_eval.system.layers as L  # noqa: E402
from sparse_eval.tasks.wikitext import BUNDLED  # noqa: E402

dev = "cuda" if torch.cuda.is_available() else "cpu"
tok = AutoTokenizer.from_pretrained(STORIES_DIR)
model = AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval().to(dev)
text = BUNDLED.read_text(encoding="utf-8")
prompts = [tok(text[:4000])["input_ids"][:260], tok(text[4000:8000])["input_ids"][:260]]
cfgs = {"ds_offload": dict(name="double_sparsity", beta=0.02, offload=True),
        "own": dict(name="double_sparsity", beta=0.05, offload=True, dense_layers=[]),
        "attn_input": dict(name="double_sparsity", beta=0.05, offload=True, offload_input="attn_input",
                           dense_layers=[0])}
orig_static, orig_gather, orig_put = dec._decode_static, L.DSOffloadLayer._side_gather, koff.put_rows


@contextlib.contextmanager
def no_capture():  # the static step, run eagerly on the device
    dec._decode_static = lambda runs, steps, cuda: orig_static(runs, steps, False)
    try:
        yield
    finally:
        dec._decode_static = orig_static


@contextlib.contextmanager
def sync_gather():  # the predicted rows gathered on the compute stream
    def g(self, session, ids, bk, bv, record):
        koff.gather_rows(self.keys, ids, bk)
        koff.gather_rows(self.values, ids, bv)
    L.DSOffloadLayer._side_gather = g
    try:
        yield
    finally:
        L.DSOffloadLayer._side_gather = orig_gather


@contextlib.contextmanager
def ref_put():  # the new token written by torch indexing
    koff.put_rows = lambda s, d, p, backend="auto": koff.put_rows_reference(s, d, p)
    try:
        yield
    finally:
        koff.put_rows = orig_put


@contextlib.contextmanager
def torch_gather():
    og = koff.gather_rows
    koff.gather_rows = lambda src, ids, dst, **k: og(src, ids, dst, backend="torch")
    try:
        yield
    finally:
        koff.gather_rows = og


for name, cfg in cfgs.items():
    acc = [_accuracy_tokens(model, tok, cfg, torch.tensor(p, device=dev)) for p in prompts]
    variants = {"eager": ({}, []), "graph": (dict(cuda_graph=True), []),
                "graph_torchtopk": (dict(cuda_graph=True, topk="torch"), []),
                "graph_syncgather": (dict(cuda_graph=True), [sync_gather]),
                "static_nocap": (dict(cuda_graph=True), [no_capture]),
                "static_nocap_refput": (dict(cuda_graph=True), [no_capture, ref_put]),
                "static_nocap_sync": (dict(cuda_graph=True), [no_capture, sync_gather]),
                "static_nocap_sync_refput_torchgather": (dict(cuda_graph=True),
                                                         [no_capture, sync_gather, ref_put, torch_gather]),
                "static_nocap_torchtopk_sync_refput": (dict(cuda_graph=True, topk="torch"),
                                                       [no_capture, sync_gather, ref_put])}
    for vname, (kw, ctxs) in variants.items():
        with contextlib.ExitStack() as es:
            for c in ctxs:
                es.enter_context(c())
            got = _system(model, cfg, prompts, label_scale_dtype=torch.float32, **kw)
        res = []
        for r in range(2):
            g = got.tokens[r].tolist()
            first = next((i for i in range(len(g)) if g[i] != acc[r][i]), None)
            res.append("ok" if first is None else f"diff@{first}")
        print(f"{name:12s} {vname:40s} {res}", flush=True)
