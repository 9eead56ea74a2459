"""Building the tokenizer a GGUF file describes in its metadata.

A GGUF carries no tokenizer.json: it stores the vocabulary (`tokenizer.ggml.tokens`), the BPE merges,
token types and special-token ids under llama.cpp's key names. We rebuild a `tokenizers.Tokenizer`
from them that gives the SAME ids as transformers' GGUF loader (`AutoTokenizer.from_pretrained(dir,
gguf_file=...)`), because the reference outputs our tests check against come from transformers.

Two tokenizer models are supported:

    tokenizer.ggml.model = "gpt2"   byte-level BPE (SmolLM2, Llama 3, Qwen2, ...). The text is split with
                                    a regex chosen by `tokenizer.ggml.pre` when transformers knows that
                                    name, otherwise with GPT-2's own regex, and no prefix space is added
                                    whatever `add_space_prefix` says. SmolLM2's "smollm" is such a name:
                                    " 2024" stays one piece before BPE (its vocabulary has no multi-digit
                                    tokens, so the ids still end up one per digit).
    tokenizer.ggml.model = "llama"  SentencePiece-style BPE with byte fallback ("\u2581" for spaces, one
                                    prepended to the text). Merges come from the file, or are rebuilt
                                    from the token scores when the file has none.
      ... of Gemma (1, 2, 3)        the same BPE with byte fallback, built as transformers' GGUF loader
                                    builds Gemma's: every space becomes "\u2581" (a normalizer; no prefix
                                    space is added), tokens that are runs of spaces are respelled as runs
                                    of "\u2581", and the merges, which Gemma files do not carry, are rebuilt
                                    in the order the tokens appear in the file (Gemma's scores do not
                                    follow its merge order). Byte tokens "<0xNN>" spell what no merge
                                    reaches; the decoder turns them back into bytes.

Token types mark what must never be cut into pieces: CONTROL (3) tokens become special added tokens,
USER_DEFINED (4) tokens plain added tokens.

Reading metadata: pass the file the weight loader already opened (gguf_metadata.read_gguf, or a
`gguf.GGUFReader`), or nothing, in which case loading/gguf_metadata.py parses only the metadata block
(GGUFReader builds numpy views for every one of the ~100k vocabulary strings, which takes seconds; this
takes tens of milliseconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from ..loading.gguf_metadata import GGUFFile, read_gguf_metadata
from .pre_split import SPLIT_BY_PRE
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    import gguf

TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Metadata the tokenizer needs; the rest of a GGUF's metadata is about the model.
_TOKENIZER_PREFIX = "tokenizer."
_ARCHITECTURE_KEY = "general.architecture"

# Architectures whose "llama" (SentencePiece) vocabulary is Gemma's (see `_gemma_backend`).
_GEMMA_ARCHS = frozenset({"gemma", "gemma2", "gemma3"})
# Phi-3's vocabulary transformers builds differently again (a normalizer-made prefix space). Not reproduced here.
_UNSUPPORTED_SENTENCEPIECE_ARCHS = frozenset({"phi3"})
_SPACE_MARK = "\u2581"


@lru_cache(maxsize=1)
def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's byte alphabet: every byte as a printable character (spaces become "Ġ", newlines "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def _metadata_from_reader(reader: GGUFFile | gguf.GGUFReader) -> dict[str, Any]:
    """The tokenizer keys of an already opened file (gguf_metadata.GGUFFile or a gguf.GGUFReader), as plain values."""
    if isinstance(reader, GGUFFile):
        return reader.metadata
    return {
        key: field.contents()
        for key, field in reader.fields.items()
        if key.startswith(_TOKENIZER_PREFIX) or key == _ARCHITECTURE_KEY
    }


# -- building the backend ---------------------------------------------------------------------------------


def _split_merges(merges: Sequence[str], source: str) -> list[tuple[str, str]]:
    pairs = []
    for index, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2:
            raise ValueError(
                f"{source}: tokenizer.ggml.merges[{index}] = {merge!r} is not two tokens joined by a space"
            )
        pairs.append((parts[0], parts[1]))
    return pairs


def _merges_from_scores(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two known tokens,
    best-scored token first; ties go to the shorter left piece, then the shorter right one.

    This is the order transformers derives (`generate_merges`), which SentencePiece files without a
    merge list need; stable sorts keep the order of equal entries, as there.
    """
    rank = {token: index for index, token in enumerate(tokens)}
    candidates: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores)).items():
        splits = [
            (token[:cut], token[cut:])
            for cut in range(1, len(token))
            if token[:cut] in rank and token[cut:] in rank
        ]
        splits.sort(key=lambda pair: (rank[pair[0]], rank[pair[1]]))
        candidates.extend((left, right, score) for left, right in splits)
    candidates.sort(key=lambda c: (c[2], len(c[0]), len(c[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def _merges_in_vocab_order(tokens: Sequence[str]) -> list[tuple[str, str]]:
    """`_merges_from_scores` with every token scored by its position (earlier is better), without the sort:
    merges come token by token in file order, a token's own splits longer left piece first. (A token listed
    twice counts at its last position, as there.)"""
    rank = {token: index for index, token in enumerate(tokens)}
    return [
        (token[:cut], token[cut:])
        for token in sorted(rank, key=rank.__getitem__)
        for cut in range(len(token) - 1, 0, -1)
        if token[:cut] in rank and token[cut:] in rank
    ]


def _merges(metadata: Mapping[str, Any], source: str) -> list[tuple[str, str]]:
    if "tokenizer.ggml.merges" in metadata:
        return _split_merges(metadata["tokenizer.ggml.merges"], source)
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        raise ValueError(f"{source}: has neither tokenizer.ggml.merges nor tokenizer.ggml.scores to build merges from")
    tokens = metadata["tokenizer.ggml.tokens"]
    if len(scores) != len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.scores has {len(scores)} entries for {len(tokens)} tokens")
    return _merges_from_scores(tokens, scores)


def _byte_level_backend(metadata: Mapping[str, Any], source: str) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Byte-level BPE. Returns the backend and, per id, the vocabulary key its token is stored under."""
    spelling = _byte_to_unicode()
    alphabet = frozenset(spelling.values())
    # Tokens are normally stored already spelled in the byte alphabet; one that is not (raw text such as
    # "<｜end▁of▁sentence｜>") is respelled from its UTF-8 bytes, as transformers does.
    keys = [
        token if alphabet.issuperset(token) else "".join(spelling[b] for b in token.encode("utf-8"))
        for token in metadata["tokenizer.ggml.tokens"]
    ]
    vocab = {key: index for index, key in enumerate(keys)}
    bpe = models.BPE(
        vocab=vocab,
        merges=_merges(metadata, source),
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = tokenizers.Tokenizer(bpe)
    split = SPLIT_BY_PRE.get(metadata.get("tokenizer.ggml.pre", ""))
    if split is None:
        # GPT-2's regex, no prefix space: what transformers' GPT2Tokenizer does for an unknown `pre`,
        # whatever `tokenizer.ggml.add_space_prefix` says.
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    backend.decoder = decoders.ByteLevel()
    return backend, keys


def _sentencepiece_backend(metadata: Mapping[str, Any], source: str) -> tuple[tokenizers.Tokenizer, list[str]]:
    """SentencePiece-style BPE with byte fallback, as transformers' LlamaTokenizer (non-legacy) builds it."""
    tokens = list(metadata["tokenizer.ggml.tokens"])
    bpe = models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=_merges(metadata, source),
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    )
    backend = tokenizers.Tokenizer(bpe)
    backend.normalizer = None
    # "first": one "\u2581" before the text, none before text that follows a special token.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1, right=0),
        ]
    )
    return backend, tokens


def _gemma_backend(metadata: Mapping[str, Any], source: str) -> tuple[tokenizers.Tokenizer, list[str]]:
    """Gemma's SentencePiece BPE, as transformers' GGUF loader builds it (`gemma_tokenizer` there).

    The file stores a token of two or more spaces with real spaces, while the text reaches the model with
    every space already "\u2581": such tokens are respelled first, so that the merges rebuilt from the
    vocabulary can reach them. Merges rank by the merged token's position in the file (earlier first).
    """
    tokens = [_SPACE_MARK * len(t) if t and " " in t and not t.strip() else t
              for t in metadata["tokenizer.ggml.tokens"]]
    if "tokenizer.ggml.merges" in metadata:
        merges = _split_merges(metadata["tokenizer.ggml.merges"], source)
    else:
        merges = _merges_in_vocab_order(tokens)
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    backend = tokenizers.Tokenizer(models.BPE(
        vocab={token: index for index, token in enumerate(tokens)},
        merges=merges,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
        dropout=None,
    ))
    backend.normalizer = normalizers.Replace(" ", _SPACE_MARK)
    # What transformers' GemmaTokenizer installs; after the normalizer no " " is left, so it splits nothing.
    backend.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    backend.decoder = decoders.Sequence([decoders.Replace(_SPACE_MARK, " "), decoders.ByteFallback(), decoders.Fuse()])
    return backend, tokens


def _add_marked_tokens(
    backend: tokenizers.Tokenizer,
    metadata: Mapping[str, Any],
    keys: Sequence[str],
    default_specials: Sequence[str],
    named: Sequence[str],
    control_in_alphabet_only: bool,
    source: str,
) -> None:
    """Register the tokens that must be matched whole, in the order transformers does (the last add wins
    when a token is added twice, so the order decides which ones count as special).

    Unlike transformers, a token whose string is not in the vocabulary is never added: it would get an
    id past the model's embedding.
    """
    tokens = metadata["tokenizer.ggml.tokens"]
    vocab_keys = set(keys)
    defaults = [AddedToken(t, special=True) for t in default_specials if t in vocab_keys]
    if defaults:
        backend.add_special_tokens(defaults)

    token_types = metadata.get("tokenizer.ggml.token_type") or []
    if token_types and len(token_types) != len(tokens):
        raise ValueError(f"{source}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens")
    alphabet = frozenset(_byte_to_unicode().values())
    control = [
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types)
        # In a byte-level vocabulary a control token outside the byte alphabet is a llama.cpp mislabel.
        if token_type == TOKEN_TYPE_CONTROL and (not control_in_alphabet_only or alphabet.issuperset(token))
    ]
    if control:
        backend.add_special_tokens(control)
    user_defined = [
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types)
        if token_type == TOKEN_TYPE_USER_DEFINED and token in vocab_keys
    ]
    if user_defined:
        backend.add_tokens(user_defined)

    already = {t.content for t in backend.get_added_tokens_decoder().values()}
    late = [AddedToken(t, special=True) for t in dict.fromkeys(named) if t not in already and t in vocab_keys]
    if late:
        backend.add_special_tokens(late)


def _named_token(metadata: Mapping[str, Any], key: str, keys: Sequence[str], source: str) -> str | None:
    token_id = metadata.get(key)
    if token_id is None:
        return None
    if not isinstance(token_id, int) or not 0 <= token_id < len(keys):
        raise ValueError(f"{source}: {key} = {token_id!r} is not an id of its {len(keys)} tokens")
    return keys[token_id]


def load_gguf_tokenizer(path: str | Path, reader: GGUFFile | gguf.GGUFReader | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file, built from its metadata (`reader`, the file the weight loader already
    opened, saves parsing it again).

    Raises ValueError naming the file for a missing/corrupt file, missing tokenizer keys, or a
    tokenizer model other than "gpt2" and "llama" (or a "llama" vocabulary of Phi-3).
    """
    source = str(path)
    metadata = _metadata_from_reader(reader) if reader is not None else read_gguf_metadata(path)
    return tokenizer_from_gguf_metadata(metadata, source)


def tokenizer_from_gguf_metadata(metadata: Mapping[str, Any], source: str = "<gguf metadata>") -> Tokenizer:
    """Build the Tokenizer from GGUF metadata already read into plain values (`source` names it in errors)."""
    model = metadata.get("tokenizer.ggml.model")
    if model is None:
        raise ValueError(f"{source}: has no tokenizer.ggml.model, so it describes no tokenizer")
    tokens = metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not isinstance(tokens[0], str):
        raise ValueError(f"{source}: tokenizer.ggml.tokens is missing or not a list of strings")
    architecture = metadata.get(_ARCHITECTURE_KEY)

    if model == "gpt2":
        backend, keys = _byte_level_backend(metadata, source)
        default_specials = ["<|endoftext|>"]  # GPT2Tokenizer's default bos/eos/unk
        add_bos_default = False
    elif model == "llama":
        if architecture in _UNSUPPORTED_SENTENCEPIECE_ARCHS:
            raise ValueError(
                f"{source}: a SentencePiece ('llama') tokenizer for architecture {architecture!r} is not supported "
                "(transformers builds Phi-3's vocabulary differently)"
            )
        if architecture in _GEMMA_ARCHS:
            backend, keys = _gemma_backend(metadata, source)
            default_specials = ["<mask>"]  # GemmaTokenizer's one default the file does not name
        else:
            backend, keys = _sentencepiece_backend(metadata, source)
            default_specials = ["<unk>", "<s>", "</s>"]  # LlamaTokenizer's defaults
        # Older files have no flag, and llama.cpp adds BOS to a SentencePiece vocabulary unless told not to.
        add_bos_default = True
    else:
        raise ValueError(
            f"{source}: tokenizer.ggml.model {model!r} is not supported (supported: 'gpt2', 'llama')"
        )

    names = {
        field: _named_token(metadata, f"tokenizer.ggml.{key}", keys, source)
        for field, key in (
            ("bos_token", "bos_token_id"),
            ("eos_token", "eos_token_id"),
            ("unk_token", "unknown_token_id"),
            ("pad_token", "padding_token_id"),
        )
    }
    _add_marked_tokens(
        backend,
        metadata,
        keys,
        default_specials,
        [name for name in names.values() if name is not None],
        control_in_alphabet_only=(model == "gpt2"),
        source=source,
    )
    chat_template = metadata.get("tokenizer.chat_template")
    if chat_template is not None and not isinstance(chat_template, str):
        raise ValueError(f"{source}: tokenizer.chat_template is not a string")
    # llama.cpp also stops on EOT/EOM tokens (end of turn), which chat models emit instead of EOS.
    extra_eos = [
        metadata[key]
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if isinstance(metadata.get(key), int) and 0 <= metadata[key] < len(keys)
    ]
    return Tokenizer(
        backend,
        **names,
        add_bos_token=bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos_default)),
        add_eos_token=bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        chat_template=chat_template,
        extra_eos_token_ids=extra_eos,
    )
