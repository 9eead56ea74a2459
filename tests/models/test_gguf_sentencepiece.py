"""A Gemma GGUF file's SentencePiece ("llama") vocabulary as a `tokenizers` BPE (models/tokenizer/gguf_tokenizer.py).

The oracle is transformers' own GGUF tokenizer (5.25, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`): its ids
for texts in many scripts, and its renderings of Gemma 3's chat template, are committed in
tests/data/goldens/gemma3-270m_tokenizer.json by scripts/make_gemma3_tokenizer_golden.py. A tiny vocabulary built
here checks the pieces (space respelling, file-order merges, byte fallback, flags) without the 250 MB package.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import tokenizers

from pagedserve.models.loading import packaged
from pagedserve.models.tokenizer.gguf_tokenizer import (
    _merges_from_scores,
    _merges_in_vocab_order,
    load_gguf_tokenizer,
    tokenizer_from_gguf_metadata,
)
from pagedserve.models.tokenizer.tokenizer import Tokenizer

GOLDEN = Path(__file__).parent.parent / "data" / "goldens" / "gemma3-270m_tokenizer.json"
SP = "\u2581"


# -- a tiny Gemma-shaped vocabulary ------------------------------------------------------------------------

def _tiny_gemma_metadata(**overrides) -> dict:
    """Gemma's layout in miniature: specials first, a user-defined newline, byte tokens, a run of two spaces
    stored with real spaces (as Gemma files do), then pieces listed best merge first."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>", "\n"]
    types = [3, 3, 3, 3, 3, 3, 3, 4]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    tokens += ["  ", SP, "h", "e", "l", "o", "w", "r", "d", "he", "ll", "hell", "hello", f"{SP}w", "or", "ld",
               f"{SP}wor", f"{SP}world", "é"]
    types += [1] * (len(tokens) - len(types))
    metadata = {
        "general.architecture": "gemma3", "tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [-1000.0] * len(tokens),  # Gemma's scores do not follow its merge order
        "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 2, "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3, "tokenizer.ggml.padding_token_id": 0,
        "tokenizer.ggml.add_bos_token": True, "tokenizer.ggml.add_eos_token": False,
        "tokenizer.ggml.add_space_prefix": False,
    }
    metadata.update(overrides)
    return metadata


def test_tiny_vocabulary_merges_spaces_and_byte_fallback():
    meta = _tiny_gemma_metadata()
    tok = tokenizer_from_gguf_metadata(meta, "tiny.gguf")
    index = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    ids = tok.encode("hello world")
    assert ids == [2, index["hello"], index[f"{SP}world"]]  # BOS, merges reach whole words, no prefix space
    # two spaces: the respelled "  " token (stored with spaces, looked up as two marks); "é" is a piece; "ñ" and
    # "Q" are not, so their UTF-8 bytes are spelled by the <0xNN> tokens.
    ids = tok.encode("he  é\nñQ", add_special_tokens=False)
    assert [tok.id_to_token(i) for i in ids] == ["he", SP * 2, "é", "\n", "<0xC3>", "<0xB1>", "<0x51>"]
    assert tok.decode(ids) == "he  é\nñQ"
    assert tok.encode("<start_of_turn>hello", add_special_tokens=False) == [5, index["hello"]]
    assert tok.decode([2, 5, index["hello"]]) == "hello"  # specials skipped
    assert tok.bos_token == "<bos>" and tok.eos_token_ids == (1,) and tok.add_bos_token


def test_add_bos_and_add_eos_flags_are_the_files():
    tok = tokenizer_from_gguf_metadata(_tiny_gemma_metadata(**{"tokenizer.ggml.add_bos_token": False,
                                                                "tokenizer.ggml.add_eos_token": True}))
    ids = tok.encode("hello")
    assert ids[0] != 2 and ids[-1] == 1


def test_merges_in_vocab_order_are_the_scored_merges_with_position_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc", "ca", "cab", "b"]  # "b" twice: its last position counts
    want = _merges_from_scores(tokens, [-i for i in range(len(tokens))])
    assert _merges_in_vocab_order(tokens) == want
    assert want[:3] == [("a", "b"), ("b", "c"), ("ab", "c")]


def test_phi3_sentencepiece_stays_refused():
    meta = _tiny_gemma_metadata(**{"general.architecture": "phi3"})
    with pytest.raises(ValueError, match="phi3"):
        tokenizer_from_gguf_metadata(meta, "phi.gguf")


# -- the packaged Gemma 3 270M against transformers ----------------------------------------------------------

@pytest.fixture(scope="module")
def golden() -> dict:
    return json.loads(GOLDEN.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def gemma_tokenizer(golden) -> Tokenizer:
    model = packaged.PACKAGED_MODELS["gemma3-270m"]
    if importlib.util.find_spec(model.package) is None:  # CI installs it; a clear failure, not a skip
        pytest.fail(f"the packaged model is not installed: {model.install}")
    path, digest = packaged.resolve(model)
    assert digest == golden["gguf_sha256"]
    return load_gguf_tokenizer(path)


@pytest.mark.slow
def test_ids_and_decoding_match_transformers(gemma_tokenizer, golden):
    tok = gemma_tokenizer
    assert len(golden["cases"]) >= 10
    byte_tokens = 0
    for case in golden["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text
        assert tok.encode(text, add_special_tokens=False) == case["ids_no_special"], text
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"], text
        assert tok.decode(case["ids"], skip_special_tokens=False) == "<bos>" + text  # exact round trip
        byte_tokens += sum(tok.id_to_token(i).startswith("<0x") for i in case["ids"])
    assert byte_tokens > 0  # the byte fallback was exercised


@pytest.mark.slow
def test_the_cached_backend_gives_the_same_ids(gemma_tokenizer, golden):
    """The conversion cache keeps the backend as tokenizer.json (loader.py): reading it back changes nothing."""
    tok = gemma_tokenizer
    again = Tokenizer(tokenizers.Tokenizer.from_str(tok.backend.to_str()), bos_token=tok.bos_token,
                      eos_token=tok.eos_token, unk_token=tok.unk_token, pad_token=tok.pad_token)
    for case in golden["cases"]:
        assert again.encode(case["text"]) == case["ids"]


@pytest.mark.slow
def test_gemma_chat_template_renders_as_transformers(gemma_tokenizer, golden):
    tok = gemma_tokenizer
    assert tok.chat_template is None  # the base model's file carries none
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    tok.chat_template = golden["chat_template"]  # Gemma 3's instruction-tuned template
    try:
        for case in golden["chat"]:
            args = (case["messages"], case["add_generation_prompt"])
            assert tok.apply_chat_template(*args) == case["text"]
            assert tok.apply_chat_template(*args, tokenize=True) == case["ids"]
    finally:
        tok.chat_template = None
