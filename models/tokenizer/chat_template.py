"""Rendering a Hugging Face chat template (a Jinja string) the way transformers renders it.

Chat templates come from model repositories, so they are untrusted code: they run in Jinja's
immutable sandbox, with the same environment transformers builds (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape), so a
template renders here byte for byte as it does in `tokenizer.apply_chat_template`.

    text = render_chat_template(template, messages, add_generation_prompt=True,
                                bos_token="<s>", eos_token="</s>")
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names under which a message's reasoning arrives. transformers copies it to `thinking` and
# `reasoning_content` before rendering, because templates read one or the other.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    # Templates call this to reject a conversation ("roles must alternate ...").
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Jinja's own `tojson` escapes <, >, & and ' for HTML; a prompt must keep them as written.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _DictFactory:
    """`dict(...)` and `dict.fromkeys(...)` for templates, without handing them the `dict` type."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _SafeNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, so a template cannot plant dunder attributes."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - same trick as Jinja's Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _SafeNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _SafeNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template cannot set the attribute {name!r} on a namespace")


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers uses it to mask assistant tokens.

    We only need templates that use it to compile and render, so the block renders its body.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Any) -> str:
        return caller()


@lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string (compiling costs milliseconds; rendering microseconds)."""
    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a str, got {type(template).__name__}")
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _SafeNamespace
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers does: keys whose value is None are dropped (many templates print "None"
    # for them but handle a missing key), and reasoning is offered under every name templates read.
    prepared = {key: value for key, value in message.items() if value is not None}
    reasoning = next((prepared[key] for key in _REASONING_FIELDS if key in prepared), None)
    if reasoning is not None:
        prepared = {"thinking": reasoning, **prepared, "reasoning_content": reasoning}
    return prepared


def render_chat_template(
    template: str,
    messages: list[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    bos_token: str | None = None,
    eos_token: str | None = None,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **extra: Any,
) -> str:
    """Render `messages` with `template`; `extra` reaches the template as further variables.

    A template that raises (`raise_exception(...)`, an undefined name used wrongly, a type error
    in its expressions) becomes a ValueError carrying the template's message.
    """
    compiled = compile_chat_template(template)
    variables: dict[str, Any] = {}
    # transformers passes only the special tokens that are set; a missing one stays undefined.
    if bos_token is not None:
        variables["bos_token"] = bos_token
    if eos_token is not None:
        variables["eos_token"] = eos_token
    variables.update(extra)
    try:
        return compiled.render(
            messages=[_prepare_message(message) for message in messages],
            tools=tools,
            documents=documents,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as exc:
        raise ValueError(f"chat template error: {exc.message}") from exc
    except Exception as exc:  # the template is code; its failures are a bad request, not our crash
        raise ValueError(f"chat template error: {type(exc).__name__}: {exc}") from exc
