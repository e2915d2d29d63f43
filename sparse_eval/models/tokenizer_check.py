"""The tokenizer gate: a GGUF checkpoint's tokenizer, as transformers builds it, checked at load against an
independent reference built from the GGUF's own vocabulary, on a fixed canary text; and the tokenizer's behaviour
as part of a run's identity (``tokenizer_identity``: the ids of the canary text).

Why: transformers 5.17 builds Gemma 3's GGUF tokenizer as a Unigram model over the GGUF scores, which for Gemma 3
are BPE merge ranks; "That is a carrying number." became 12 pieces instead of 6 and RULER's essays 1.84x as many
tokens, with no error.  The same file under another transformers version is another model, so the check runs at
every load and the canary's ids enter the run's identity (runs made under different tokenizations never pool).

The references, per the GGUF's ``tokenizer.ggml.model`` (the vocabulary types of llama.cpp's ``llama-vocab``):

* ``llama`` (SentencePiece BPE: Llama 2, Gemma, Mistral): a SentencePiece ``ModelProto`` of type BPE made from the
  GGUF's pieces, scores and token types (SentencePiece merges the pair whose merged piece scores highest), with
  ``tokenizer.ggml.add_space_prefix`` as its dummy prefix, whitespace escaped to ``▁`` and byte fallback when the
  vocabulary has byte tokens; encoded by the ``sentencepiece`` library.
* ``gpt2`` (byte-level BPE: SmolLM2, Qwen2.5, Llama 3): a ``tokenizers`` BPE over the GGUF's vocabulary and merges,
  after the pre-tokenizer split that ``tokenizer.ggml.pre`` names (``PRE_TOKENIZER_SPLITS``: the expressions of
  llama.cpp's ``llama-vocab.cpp``) and the byte-level map.  An unknown ``pre`` is checked on the canary's words
  alone (``CANARY_WORDS``: letters and single spaces, which every listed split treats alike) and says so.
* anything else (``bert``, ``t5``, ...): no reference here; the run records ``"reference": "none"`` with a warning.

The GGUF's key-value section is read by ``read_gguf_metadata`` (below), not ``gguf.GGUFReader``, which also maps
every tensor and builds every field part: 14 s against well under 1 s on Gemma 3's 262,144-piece vocabulary.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from pathlib import Path
from typing import Any

log = logging.getLogger("sparse_eval")

# The canary: words, a contraction, digits, a hyphen, commas, a period; single spaces only (the references agree
# with the tokenizers they stand for on runs of single spaces; whitespace runs are vocabulary-specific pieces).
CANARY = "That is a carrying number. The special magic number for quiet-river is 7341, isn't it?"
CANARY_WORDS = "That is a carrying number The special magic number for quiet river is it"

# llama.cpp's pre-tokenizer splits per ``tokenizer.ggml.pre`` (llama-vocab.cpp), applied in order
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "default": (_GPT2,),
    "gpt2": (_GPT2,),
    "smollm": (r"\p{N}", _GPT2),
    "starcoder": (r"\p{N}", _GPT2),
    "qwen2": (_QWEN2,),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
}

TOKENIZER_FIX = (
    "install a transformers that builds it right (pip install 'transformers>=5.25'), or give "
    "model.tokenizer=<hub id or folder of the model's own tokenizer>"
)


class TokenizerMismatch(ValueError):
    """The tokenizer transformers built segments the canary text unlike the checkpoint's own vocabulary."""


# -- the GGUF's key-value section -----------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


def read_gguf_metadata(path: str | Path, prefix: str = "tokenizer.") -> dict[str, Any]:
    """The key-value pairs of a GGUF file (format v2/v3: magic ``GGUF``, version, tensor count, key count, then
    per key its name, value type and value) whose key starts with ``prefix``; numeric arrays as numpy arrays,
    string arrays as lists.  Stops before the tensor descriptions."""
    import numpy as np

    with open(path, "rb") as f:
        head = f.read(24)
        if head[:4] != b"GGUF" or len(head) < 24:
            raise ValueError(f"{path}: not a GGUF file (magic {head[:4]!r})")
        version, _, n_kv = struct.unpack("<IQQ", head[4:])
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version}; versions 2 and 3 are read")

        def read(fmt: str) -> Any:
            size = struct.calcsize(fmt)
            return struct.unpack(fmt, f.read(size))[0]

        def string() -> str:
            return f.read(read("<Q")).decode("utf-8", errors="replace")

        def value(kind: int) -> Any:
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                sub, n = read("<I"), read("<Q")
                if sub == _STRING:
                    return [string() for _ in range(n)]
                if sub in _NUMPY:
                    dt = np.dtype(_NUMPY[sub])
                    return np.frombuffer(f.read(dt.itemsize * n), dtype=dt)
                return [value(sub) for _ in range(n)]
            return read(_SCALARS[kind])

        out: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            v = value(read("<I"))
            if key.startswith(prefix):
                out[key] = v
        return out


# -- the references -------------------------------------------------------------------------------------------


def _sentencepiece_bpe(meta: dict[str, Any]) -> Any:
    """A SentencePiece BPE processor over the GGUF's pieces, scores and token types (SentencePiece's piece types
    1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte are the GGUF's token types)."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb

    tokens = meta["tokenizer.ggml.tokens"]
    scores = meta.get("tokenizer.ggml.scores")
    types = meta.get("tokenizer.ggml.token_type")
    if scores is None or types is None:
        raise ValueError("the GGUF has no tokenizer.ggml.scores/token_type for its SentencePiece vocabulary")
    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(tokens)
    m.trainer_spec.byte_fallback = bool((types == 6).any())
    m.trainer_spec.unk_id = int(meta.get("tokenizer.ggml.unknown_token_id", 0))
    m.trainer_spec.bos_id = m.trainer_spec.eos_id = m.trainer_spec.pad_id = -1
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for piece, score, kind in zip(tokens, scores.tolist(), types.tolist()):
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, float(score), int(kind)
    return spm.SentencePieceProcessor(model_proto=m.SerializeToString())


def _byte_level_bpe(meta: dict[str, Any], splits: tuple[str, ...]) -> Any:
    """A ``tokenizers`` byte-level BPE over the GGUF's vocabulary and merges, after ``splits``."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    if not merges:
        raise ValueError("the GGUF has no tokenizer.ggml.merges for its byte-level BPE vocabulary")
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, ignore_merges=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return tok


def gguf_reference(gguf_path: str | Path) -> tuple[str, str | None, list[int] | None]:
    """(reference name, the text it checks, its ids of that text) for a GGUF's tokenizer; (``"none"``, None,
    None) for a vocabulary type without a reference here."""
    meta = read_gguf_metadata(gguf_path)
    kind = meta.get("tokenizer.ggml.model")
    if kind == "llama":
        sp = _sentencepiece_bpe(meta)
        return "sentencepiece-bpe", CANARY, list(sp.encode(CANARY))
    if kind == "gpt2":
        pre = meta.get("tokenizer.ggml.pre", "default")
        if pre in PRE_TOKENIZER_SPLITS:
            tok = _byte_level_bpe(meta, PRE_TOKENIZER_SPLITS[pre])
            return f"byte-level-bpe(pre={pre})", CANARY, tok.encode(CANARY, add_special_tokens=False).ids
        tok = _byte_level_bpe(meta, (_GPT2,))
        return (
            f"byte-level-bpe(pre={pre} unknown: words only)",
            CANARY_WORDS,
            tok.encode(CANARY_WORDS, add_special_tokens=False).ids,
        )
    return "none", None, None


# -- the gate and the identity ---------------------------------------------------------------------------------


def canary_ids(tokenizer: Any, text: str = CANARY) -> list[int]:
    """The tokenizer's ids of ``text`` without special tokens."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _pieces(tokenizer: Any, ids: list[int], limit: int = 14) -> str:
    toks = tokenizer.convert_ids_to_tokens(ids[:limit])
    return " ".join(str(t) for t in toks) + (" …" if len(ids) > limit else "")


def check_gguf_tokenizer(tokenizer: Any, gguf_path: str | Path, model_name: str) -> str:
    """Refuse (``TokenizerMismatch``, one line naming the tokenizer and the fix) a tokenizer that segments the
    canary text unlike the GGUF's own vocabulary; returns the reference's name (``"none"`` when there is none
    for this vocabulary type, with a warning)."""
    import transformers

    reference, text, want = gguf_reference(gguf_path)
    if text is None:
        log.warning(
            "model %s: no reference tokenizer for this GGUF's vocabulary type; its tokenizer is not checked",
            model_name,
        )
        return reference
    got = canary_ids(tokenizer, text)
    if got != want:
        raise TokenizerMismatch(
            f"model {model_name}: the tokenizer transformers {transformers.__version__} builds from "
            f"{Path(gguf_path).name} ({type(tokenizer).__name__}) splits the canary {text!r} into {len(got)} pieces "
            f"({_pieces(tokenizer, got)}), the GGUF's own vocabulary ({reference}) into {len(want)} "
            f"({_pieces(tokenizer, want)}); fix: {TOKENIZER_FIX}"
        )
    return reference


def tokenizer_identity(tokenizer: Any, reference: str) -> dict[str, Any]:
    """The tokenizer's part of a run's identity: the sha256 of its ids of ``CANARY`` (and of the special tokens
    it adds, BOS/EOS), the ids' count, and the reference it was checked against (``"none"``; ``"off"`` when
    ``model.check_tokenizer=false``; ``"not gguf"`` for a checkpoint with its own tokenizer files)."""
    ids = canary_ids(tokenizer)
    with_special = list(tokenizer(CANARY)["input_ids"])
    digest = hashlib.sha256(repr((ids, with_special)).encode()).hexdigest()
    return {"canary_sha256": digest, "canary_tokens": len(ids), "checked_against": reference}
