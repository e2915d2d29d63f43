"""The tokenizer gate (``sparse_eval.models.tokenizer_check``): a GGUF's tokenizer as transformers builds it is
checked against a reference built from the GGUF's own vocabulary; a mis-built one (transformers 5.17's Unigram over
Gemma 3's BPE scores) is refused at load with the fix; the tokenizer's behaviour is part of the run identity."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from sparse_eval.models.tokenizer_check import (
    CANARY,
    CANARY_WORDS,
    TokenizerMismatch,
    canary_ids,
    check_gguf_tokenizer,
    gguf_reference,
    read_gguf_metadata,
    tokenizer_identity,
)

DATA = Path(os.environ.get("SPARSE_EVAL_DATA_DIR", Path(__file__).resolve().parents[2] / "shared" / "data"))
LLAMA2_SPM = DATA / "llama2-tokenizer" / "tokenizer.model"
MODELS = Path(os.environ.get("SPARSE_EVAL_MODELS_DIR", Path.home() / ".cache" / "sparse_eval" / "models"))
GEMMA = MODELS / "gemma3-270m" / "gemma-3-270m-q4_k_m.gguf"
SMOLLM2 = MODELS / "smollm2-135m-instruct" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gguf(path: Path, tokens, *, model: str, scores=None, types=None, merges=None, pre=None, space_prefix=None):
    """A GGUF holding a tokenizer and a one-layer Llama's hyper-parameters (no tensors)."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(8)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if scores is not None:
        w.add_token_scores(scores)
    if types is not None:
        w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if space_prefix is not None:
        w.add_add_space_prefix(space_prefix)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def llama2_gguf(tmp_path_factory):
    """Llama 2's SentencePiece BPE vocabulary (32,000 pieces) written into a GGUF as llama.cpp's converter
    writes it: pieces, scores, piece types, add_space_prefix."""
    if not LLAMA2_SPM.is_file():
        pytest.skip(f"{LLAMA2_SPM} absent (shared data)")
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    m.ParseFromString(LLAMA2_SPM.read_bytes())
    pieces = list(m.pieces)
    path = tmp_path_factory.mktemp("llama2") / "llama2-tokenizer.gguf"
    return _gguf(
        path,
        [p.piece for p in pieces],
        model="llama",
        scores=[p.score for p in pieces],
        types=[p.type for p in pieces],
        space_prefix=True,
    )


def test_the_gguf_reader_reads_what_the_writer_wrote(tmp_path):
    tokens = ["<unk>", "<s>", "</s>", "a"]
    path = _gguf(tmp_path / "t.gguf", tokens, model="llama", scores=[0.0, 0.0, 0.0, -1.5], types=[2, 3, 3, 1])
    meta = read_gguf_metadata(path)
    assert meta["tokenizer.ggml.model"] == "llama"
    assert meta["tokenizer.ggml.tokens"] == ["<unk>", "<s>", "</s>", "a"]
    assert meta["tokenizer.ggml.scores"].tolist() == [0.0, 0.0, 0.0, -1.5]
    assert meta["tokenizer.ggml.token_type"].tolist() == [2, 3, 3, 1]
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and "general.architecture" not in meta
    (tmp_path / "bad.gguf").write_bytes(b"GGML" + bytes(40))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_metadata(tmp_path / "bad.gguf")


def test_the_sentencepiece_reference_is_the_original_model(llama2_gguf):
    """Rebuilt from the GGUF's pieces, scores and types, the reference segments as Llama 2's own
    ``tokenizer.model`` does."""
    import sentencepiece as spm

    reference, text, ids = gguf_reference(llama2_gguf)
    own = spm.SentencePieceProcessor(model_file=str(LLAMA2_SPM))
    assert (reference, text) == ("sentencepiece-bpe", CANARY)
    assert ids == own.encode(CANARY)
    assert own.id_to_piece(ids[:5]) == ["▁That", "▁is", "▁a", "▁carrying", "▁number"]


@pytest.fixture(scope="module")
def llama2_transformers(llama2_gguf):
    """The tokenizer transformers builds from that GGUF."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama2_gguf.parent), gguf_file=llama2_gguf.name)


def test_transformers_tokenizer_of_the_gguf_passes_the_gate(llama2_gguf, llama2_transformers):
    tok = llama2_transformers
    assert check_gguf_tokenizer(tok, llama2_gguf, "llama2-tokenizer") == "sentencepiece-bpe"
    ident = tokenizer_identity(tok, "sentencepiece-bpe")
    assert ident["canary_tokens"] == len(canary_ids(tok)) == 26 and ident["checked_against"] == "sentencepiece-bpe"


def _unigram_over_scores(gguf_path: Path):
    """The tokenizer transformers 5.17 built from Gemma 3's GGUF: a Unigram model over the GGUF's scores, which
    for a SentencePiece BPE vocabulary are merge ranks, not log probabilities."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    meta = read_gguf_metadata(gguf_path)
    vocab = list(zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.scores"].tolist()))
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_unigram_over_bpe_scores_is_refused_with_the_fix(llama2_gguf, llama2_transformers):
    wrong = _unigram_over_scores(llama2_gguf)
    with pytest.raises(TokenizerMismatch) as err:
        check_gguf_tokenizer(wrong, llama2_gguf, "llama2-tokenizer")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("model llama2-tokenizer: the tokenizer transformers")
    assert "transformers>=5.25" in msg and "model.tokenizer=" in msg and llama2_gguf.name in msg
    # the identity tells the two tokenizations apart, so their runs never share a directory or pool
    right = llama2_transformers
    assert tokenizer_identity(wrong, "off")["canary_sha256"] != tokenizer_identity(right, "off")["canary_sha256"]


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A small byte-level BPE trained here with the GPT-2 split, written into a GGUF (vocabulary, merges,
    pre "gpt2"), and the trained tokenizer itself."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    text = (DATA / "wikitext-2-raw" / "wikitext-test.txt") if (DATA / "wikitext-2-raw").is_dir() else None
    corpus = text.read_text(encoding="utf-8")[:200_000].splitlines() if text else [CANARY * 3] * 50
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    model = __import__("json").loads(tok.to_str())["model"]
    vocab = sorted(model["vocab"].items(), key=lambda kv: kv[1])
    merges = [" ".join(m) if isinstance(m, list) else m for m in model["merges"]]
    path = tmp_path_factory.mktemp("bpe") / "bpe.gguf"
    _gguf(path, [t for t, _ in vocab], model="gpt2", merges=merges, types=[1] * len(vocab), pre="gpt2")
    return path, tok


def test_the_byte_level_reference_is_the_trained_tokenizer(byte_level):
    path, tok = byte_level
    reference, text, ids = gguf_reference(path)
    assert (reference, text) == ("byte-level-bpe(pre=gpt2)", CANARY)
    assert ids == tok.encode(CANARY).ids


def test_an_unknown_pre_tokenizer_is_checked_on_words_alone(byte_level, tmp_path):
    path, tok = byte_level
    meta = read_gguf_metadata(path)
    other = _gguf(
        tmp_path / "other.gguf",
        meta["tokenizer.ggml.tokens"],
        model="gpt2",
        merges=meta["tokenizer.ggml.merges"],
        pre="some-new-pre",
    )
    reference, text, ids = gguf_reference(other)
    assert reference.startswith("byte-level-bpe(pre=some-new-pre unknown") and text == CANARY_WORDS
    assert ids == tok.encode(CANARY_WORDS).ids


def test_a_vocabulary_type_without_reference_is_named(tmp_path, caplog):
    path = _gguf(tmp_path / "bert.gguf", ["[UNK]", "[CLS]", "[SEP]", "a"], model="bert", types=[2, 3, 3, 1])
    assert gguf_reference(path) == ("none", None, None)
    assert check_gguf_tokenizer(object(), path, "bert-like") == "none"
    assert "not checked" in caplog.text


# -- at load: the run's model ------------------------------------------------------------------------------------


def test_load_tokenizer_refuses_a_bad_model_tokenizer_in_one_line(tmp_path):
    from sparse_eval.models.loading import ModelConfig, load_tokenizer

    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(ModelConfig(tokenizer=str(tmp_path / "nowhere")))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"model.tokenizer={str(tmp_path / 'nowhere')!r}")


def test_the_shipped_model_records_its_tokenizer_in_the_identity(tmp_path, monkeypatch):
    """A checkpoint with its own tokenizer files: not a GGUF, so nothing to check against, but its behaviour
    enters the identity; model.tokenizer and model.check_tokenizer enter only when set."""
    import torch

    from sparse_eval.models.loading import ModelConfig, load_model, model_identity

    monkeypatch.setenv("SPARSE_EVAL_CACHE_DIR", str(tmp_path / "cache"))
    cfg = ModelConfig(device="cpu")
    model, tok = load_model(cfg)
    ident = model_identity(cfg, model, tokenizer=tok)
    assert ident["fingerprint"]["tokenizer"]["checked_against"] == "not gguf"
    assert "tokenizer" not in ident and "check_tokenizer" not in ident
    assert isinstance(next(model.parameters()), torch.Tensor)


@pytest.mark.slow
@pytest.mark.parametrize("path", [GEMMA, SMOLLM2], ids=["gemma3_270m", "smollm2_135m"])
def test_the_real_ggufs_pass_the_gate_with_the_pinned_transformers(path):
    """Gemma 3 (SentencePiece BPE; refused under transformers 5.17: 43 pieces instead of 26) and SmolLM2
    (byte-level BPE, pre smollm) under the transformers this package pins."""
    if not path.is_file():
        pytest.skip(f"{path} absent (scripts/get_gemma3_270m.sh, scripts/get_smollm2.sh)")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    reference = check_gguf_tokenizer(tok, path, path.stem)
    assert reference in ("sentencepiece-bpe", "byte-level-bpe(pre=smollm)")
    pieces = tok.convert_ids_to_tokens(canary_ids(tok))[:6]
    assert [p.lstrip("▁Ġ") for p in pieces] == ["That", "is", "a", "carrying", "number", "."]
