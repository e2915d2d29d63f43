"""Cache layers of the system path: each layer owns its KV storage *and* the attention over it.

The accuracy path (``attention.plugin``) keeps every key on one device and computes dense scores to check
each selection; the system path stores keys where the method's system stores them and touches only what the
method reads.  One module per method, each registering its layer under the method's name (``registry``); every
module of this folder is imported here (``sparse_eval.discovery``), so a new layer is one new module:

* ``full.FullLayer``: KV cache on the GPU, dense sdpa decode (the baseline; also every method's dense layers,
  and the storage the other layers extend).
* ``ds.DSLayer``: KV cache on the GPU plus a contiguous, quantized label cache (DS §4.2); ``ds.DSOffloadLayer``
  (``method.offload``): KV cache in pinned CPU memory, layer l's tokens predicted from layer l−1's input and
  gathered over PCIe on a side stream (DS §5.1).
* ``quest.QuestLayer``: KV cache on the GPU plus per-page min/max keys.
* ``magicpig.MagicPIGLayer``: KV cache and hash tables in CPU memory, sink and local window on the GPU, the two
  parts merged by log-sum-exp (MagicPIG §4.4, eq. 11).

Each reproduces the selection of its ``sparse_eval.methods`` class (``tests/system/test_system.py`` checks the greedy
tokens against the accuracy path).  Every layer also decodes with a ``base.StaticStep`` (shapes fixed by the cache
capacity; the position, row lengths and budgets on the device), the step the decoder captures in a CUDA graph.

All layers implement transformers' cache-layer interface (``update`` returns the call's new keys only; the
layer's ``attend`` reads its own storage), prefill densely in one call (protocol A: the prompt is dense,
generated tokens are sparse) and then decode one token per call.  Shapes: B batch, Hq / Hkv query / KV heads,
N tokens, D head dim, T tokens of the call.
"""

from ...discovery import import_package_modules
from .base import StaticStep
from .registry import SYSTEM_LAYERS, LayerOptions, build_layer, layer_class, register_layer

# every module of this folder registers its layer (``@register_layer``): a new layer is one new module here
import_package_modules(__name__, skip=("base", "registry"))

# the built-in layers by name, for callers that import them so (registration needs none of this)
from .ds import DSLayer, DSOffloadLayer  # noqa: E402
from .full import FullLayer  # noqa: E402
from .magicpig import MagicPIGLayer  # noqa: E402
from .quest import QuestLayer  # noqa: E402

__all__ = [
    "FullLayer",
    "DSLayer",
    "DSOffloadLayer",
    "MagicPIGLayer",
    "QuestLayer",
    "StaticStep",
    "SYSTEM_LAYERS",
    "LayerOptions",
    "build_layer",
    "layer_class",
    "register_layer",
]
