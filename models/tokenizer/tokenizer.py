"""The tokenizer the engine talks to: ids in, ids out, and chat prompts.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend, `.backend`) and adds what a model's
metadata says about it: its BOS/EOS tokens, whether encoding adds BOS, every id that ends a
generation, and the chat template. Two loaders build one:

    tok = load_hf_tokenizer("path/to/hf_model_dir")      # tokenizer.json + configs
    tok = load_gguf_tokenizer("model.gguf")              # metadata of a GGUF file
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True)

Behaviour follows transformers, which the model's reference outputs come from: special tokens
written inline in a text are matched as special tokens, BOS is added only when the model says so,
and a rendered chat prompt is tokenized without adding special tokens again (the template already
wrote them).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tokenizers
from tokenizers import AddedToken, processors

from .chat_template import render_chat_template

if TYPE_CHECKING:
    import gguf

    from ..loading.gguf_metadata import GGUFFile

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# A text the probe for "does the backend's post-processor add BOS?" encodes. Any non-empty text works.
_PROBE_TEXT = "a"


# Longer texts are encoded through encode_batch, which lets other threads (the sidecar's event loop)
# run while it works: a 1M-character prompt takes seconds.
LONG_TEXT_CHARS = 16_384


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the model metadata that says how to use it.

    add_bos_token / add_eos_token: True or False install a post-processor that adds (or does not add)
    them, as transformers does when a config states the flag; None keeps the backend's own
    post-processor (a tokenizer.json that adds BOS itself), and the attribute then reports what it does.
    The backend is owned from here on: its post-processor may be replaced.
    """

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        clean_up_tokenization_spaces: bool = False,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.chat_template = chat_template
        self.clean_up_tokenization_spaces = clean_up_tokenization_spaces
        self.bos_token_id = self._named_token_id("bos_token", bos_token)
        self.eos_token_id = self._named_token_id("eos_token", eos_token)
        self.unk_token_id = self._named_token_id("unk_token", unk_token)
        self.pad_token_id = self._named_token_id("pad_token", pad_token)

        if add_bos_token is not None or add_eos_token is not None:
            self._install_post_processor(bool(add_bos_token), bool(add_eos_token))
        probe = backend.encode(_PROBE_TEXT, add_special_tokens=True).ids
        plain = backend.encode(_PROBE_TEXT, add_special_tokens=False).ids
        self.add_bos_token = len(probe) > len(plain) and probe[0] == self.bos_token_id
        self.add_eos_token = len(probe) > len(plain) and probe[-1] == self.eos_token_id

        added = backend.get_added_tokens_decoder()
        self._special_ids = tuple(sorted(i for i, token in added.items() if token.special))

        eos_ids = [self.eos_token_id] if self.eos_token_id is not None else []
        eos_ids += [int(i) for i in extra_eos_token_ids]
        # Every id that ends a generation, the tokenizer's own EOS first; dict.fromkeys drops repeats in order.
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))

    def _named_token_id(self, field: str, token: str | None) -> int | None:
        if token is None:
            return None
        token_id = self.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{field} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    def _install_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        # The same template transformers' update_post_processor builds; a flag without its token is dropped.
        add_bos = add_bos and self.bos_token is not None
        add_eos = add_eos and self.eos_token is not None
        single = " ".join(
            [f"{self.bos_token}:0"] * add_bos + ["$A:0"] + [f"{self.eos_token}:0"] * add_eos
        )
        pair = " ".join(
            [single] + [f"{self.bos_token}:1"] * add_bos + ["$B:1"] + [f"{self.eos_token}:1"] * add_eos
        )
        special_tokens = [(self.bos_token, self.bos_token_id)] * add_bos
        special_tokens += [(self.eos_token, self.eos_token_id)] * add_eos
        self.backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special_tokens
        )

    # -- vocabulary ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce, added tokens included (the model's embedding may be larger)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def all_special_ids(self) -> list[int]:
        """Ids of the tokens marked special: the ones `decode(..., skip_special_tokens=True)` drops."""
        return list(self._special_ids)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    # -- text <-> ids ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Special tokens written in the text (`<|im_start|>`) become their ids."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        if len(text) > LONG_TEXT_CHARS:  # the same ids; encode_batch releases the GIL, encode holds it
            return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`. Ids past the vocabulary (a model's padded embedding rows) decode to nothing."""
        try:
            text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        except (OverflowError, TypeError) as exc:  # a negative id, or not an int at all
            raise ValueError(f"ids must be non-negative ints: {exc}") from exc
        if self.clean_up_tokenization_spaces and not isinstance(self.backend.model, tokenizers.models.BPE):
            # transformers skips this clean-up for BPE models, where it would eat real spaces.
            text = _clean_up_tokenization(text)
        return text

    # -- chat ------------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
    ) -> str | list[int]:
        """The prompt text (or its ids) for a conversation, rendered with the model's chat template; `tools`
        (OpenAI's tool objects) reach it as chat_template.render_chat_template describes."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template, so chat messages cannot be turned into a prompt")
        validate_chat_messages(messages)
        special = {"unk_token": self.unk_token, "pad_token": self.pad_token}
        prompt = render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            tools=tools,
            **{name: value for name, value in special.items() if value is not None},
        )
        if not tokenize:
            return prompt
        # transformers tokenizes the rendered prompt with add_special_tokens=False: a template that wants
        # BOS writes `{{ bos_token }}`, and adding it again would double it.
        return self.encode(prompt, add_special_tokens=False)

    def __repr__(self) -> str:
        return (
            f"Tokenizer(vocab_size={self.vocab_size}, bos_token={self.bos_token!r}, eos_token={self.eos_token!r}, "
            f"eos_token_ids={self.eos_token_ids}, add_bos_token={self.add_bos_token})"
        )


def validate_chat_messages(messages: Any) -> None:
    """Raise ValueError naming the message and field unless `messages` is a usable conversation."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise ValueError(f"messages[{index}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        content = message.get("content")
        if content is None and role == "assistant" and message.get("tool_calls"):
            continue  # an assistant turn that only called tools (the template renders its tool_calls)
        if not isinstance(content, str):
            raise ValueError(f"messages[{index}].content must be a str, got {type(content).__name__}")


def _clean_up_tokenization(text: str) -> str:
    for before, after in (
        (" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
        (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re"),
    ):  # fmt: skip
        text = text.replace(before, after)
    return text


# -- loading a Hugging Face model directory ----------------------------------------------------------

_NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot be read: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: is not valid JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError(f"{path}: must hold a JSON object, found {type(value).__name__}")
    return value


def _read_optional_json(path: Path) -> dict[str, Any]:
    return _read_json(path) if path.is_file() else {}


def _named_token(value: Any, path: Path, field: str) -> AddedToken | None:
    """A config's `bos_token` etc.: a string, or a serialized AddedToken `{"content": ...}`."""
    if value is None:
        return None
    if isinstance(value, str):
        return AddedToken(value, special=True)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return AddedToken(
            value["content"],
            single_word=bool(value.get("single_word", False)),
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            normalized=bool(value.get("normalized", False)),
            special=True,
        )
    raise ValueError(f"{path}: {field} must be a string or an object with a 'content' string, got {value!r}")


def _eos_ids(config: Mapping[str, Any], path: Path) -> list[int]:
    value = config.get("eos_token_id")
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise ValueError(f"{path}: eos_token_id must be a non-negative int or a list of them, got {value!r}")
    return list(values)


def _chat_template_from_config(value: Any, path: Path) -> str | None:
    if value is None or isinstance(value, str):
        return value
    # Older configs hold several named templates: [{"name": "default", "template": "..."}, ...].
    if isinstance(value, list) and all(isinstance(t, Mapping) for t in value):
        named = {t.get("name"): t.get("template") for t in value}
        template = named.get("default")
        if template is None or isinstance(template, str):
            return template
    raise ValueError(f"{path}: chat_template must be a string or a list of {{name, template}} objects")


def load_hf_tokenizer(model_dir: str | Path) -> Tokenizer:
    """Load the tokenizer of a Hugging Face model directory.

    Reads tokenizer.json (required), tokenizer_config.json and special_tokens_map.json (token names,
    chat_template), chat_template.jinja (wins over the config's template, as in
    transformers), and the eos_token_id of generation_config.json and config.json (an int or a list).
    Whether encode() adds BOS/EOS is decided by tokenizer.json's post-processor (see below).
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise ValueError(f"{root}: is not a directory")
    tokenizer_file = root / "tokenizer.json"
    if not tokenizer_file.is_file():
        raise ValueError(f"{tokenizer_file}: missing; a Hugging Face model directory needs a tokenizer.json")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # the Rust side raises a bare Exception for bad JSON or an unknown schema
        raise ValueError(f"{tokenizer_file}: cannot be parsed as a tokenizers file: {exc}") from exc

    config_file = root / "tokenizer_config.json"
    config = _read_optional_json(config_file)
    special_map_file = root / "special_tokens_map.json"
    special_map = _read_optional_json(special_map_file)

    names: dict[str, AddedToken | None] = {}
    for field in _NAMED_TOKENS:
        if config.get(field) is not None:
            names[field] = _named_token(config[field], config_file, field)
        else:  # older repositories keep the names only in special_tokens_map.json
            names[field] = _named_token(special_map.get(field), special_map_file, field)
    # As transformers does, a named token the backend does not already match whole becomes a special
    # added token, so it is never cut into pieces (and gets an id if the vocabulary lacks it).
    added = {token.content for token in backend.get_added_tokens_decoder().values()}
    missing = [token for token in names.values() if token is not None and token.content not in added]
    if missing:
        backend.add_special_tokens(missing)

    for field in ("add_bos_token", "add_eos_token"):
        if config.get(field) is not None and not isinstance(config[field], bool):
            raise ValueError(f"{config_file}: {field} must be true or false, got {config[field]!r}")
    template_file = root / "chat_template.jinja"
    if template_file.is_file():
        try:
            chat_template: str | None = template_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{template_file}: cannot be read: {exc}") from exc
    else:
        chat_template = _chat_template_from_config(config.get("chat_template"), config_file)

    generation_config_file = root / "generation_config.json"
    model_config_file = root / "config.json"
    extra_eos = _eos_ids(_read_optional_json(generation_config_file), generation_config_file)
    extra_eos += _eos_ids(_read_optional_json(model_config_file), model_config_file)

    cleanup = config.get("clean_up_tokenization_spaces", False)
    # BOS/EOS come from tokenizer.json's post-processor: transformers drops the config's add_bos_token /
    # add_eos_token whenever a tokenizer.json exists, and our reference ids come from transformers.
    tokenizer = Tokenizer(
        backend,
        **{field: (token.content if token is not None else None) for field, token in names.items()},
        add_bos_token=None,
        add_eos_token=None,
        chat_template=chat_template,
        extra_eos_token_ids=extra_eos,
        clean_up_tokenization_spaces=bool(cleanup),
    )
    for field in ("add_bos_token", "add_eos_token"):
        if config.get(field) is not None and config[field] != getattr(tokenizer, field):
            warnings.warn(
                f"{config_file}: {field} is {config[field]} but tokenizer.json's post-processor does "
                f"{'not ' if config[field] else ''}add it; following tokenizer.json, as transformers does",
                stacklevel=2,
            )
    return tokenizer


def load_gguf_tokenizer(path: str | Path, reader: GGUFFile | gguf.GGUFReader | None = None) -> Tokenizer:
    """Build the tokenizer a GGUF file describes (see `gguf_tokenizer.load_gguf_tokenizer`)."""
    # Imported here: gguf_tokenizer imports this module for `Tokenizer`.
    from .gguf_tokenizer import load_gguf_tokenizer as _load

    return _load(path, reader)
