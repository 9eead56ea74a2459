"""Rendering a Hugging Face chat template (a Jinja string) the way transformers renders it.

Chat templates come from model repositories, so they are untrusted code: they run in Jinja's
immutable sandbox, with the same environment transformers builds (trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that does not HTML-escape), so a
template renders here byte for byte as it does in `tokenizer.apply_chat_template`.

    text = render_chat_template(template, messages, add_generation_prompt=True,
                                bos_token="<s>", eos_token="</s>", tools=None)

Tools (OpenAI's `tools` list) and tool turns (an assistant message with `tool_calls`, a `tool` message with
the result) render in the template's own way when it has a tools branch (it reads `tools`, as Qwen2.5's
and Llama 3.1's do). A template without one (SmolLM2's, most small models') gets what vLLM and
transformers users give such models, the Hermes/Qwen format, written into plain messages:

    system     <its own text, if any>\n\n# Tools ... <tools>{one tool as JSON per line}</tools> ...
               answer with <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
    assistant  <content>\n<tool_call>\n{"name": "f", "arguments": {...}}\n</tool_call>   (tool_calls)
    user       <tool_response>\n<result>\n</tool_response>                              (tool turns)

so every family gets tools (sidecar/tool_parser.py parses that format out of the reply).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
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


def _environment() -> ImmutableSandboxedEnvironment:
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
    return env


@lru_cache(maxsize=64)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string (compiling costs milliseconds; rendering microseconds)."""
    if not isinstance(template, str):
        raise ValueError(f"chat_template must be a str, got {type(template).__name__}")
    try:
        return _environment().from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc


@lru_cache(maxsize=64)
def template_supports_tools(template: str) -> bool:
    """True when the template has its own tools branch: it reads the `tools` variable.

    transformers and vLLM hand `tools` to every template; one that never reads it would silently drop
    them, so such templates get the Hermes-format fallback instead (`tool_conversation`).
    """
    compile_chat_template(template)  # a template that does not compile fails here, with its message
    return "tools" in jinja2.meta.find_undeclared_variables(_environment().parse(template))


def _prepare_message(message: Mapping[str, Any]) -> dict[str, Any]:
    # As transformers does: keys whose value is None are dropped (many templates print "None"
    # for them but handle a missing key), and reasoning is offered under every name templates read.
    prepared = {key: value for key, value in message.items() if value is not None}
    reasoning = next((prepared[key] for key in _REASONING_FIELDS if key in prepared), None)
    if reasoning is not None:
        prepared = {"thinking": reasoning, **prepared, "reasoning_content": reasoning}
    return prepared


# The fallback's instructions: the Hermes/Qwen2.5 tool format, which sidecar/tool_parser.py parses.
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to help with the user's request.\n\n"
    "The functions you can call are listed as JSON signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTIONS = (
    "\n</tools>\n\nTo call a function, answer with a JSON object holding its name and arguments within "
    "<tool_call></tool_call> XML tags, one per call:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
)


def tools_system_text(tools: list[Mapping[str, Any]]) -> str:
    """The system-prompt block that lists `tools` (OpenAI's tool objects) for a template without tools."""
    lines = "".join("\n" + json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PREAMBLE + lines + TOOLS_INSTRUCTIONS


def format_tool_call(name: str, arguments: Any) -> str:
    """One call as the fallback format writes it (and as the tool-call grammar forces it)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


def _text(content: Any, where: str) -> str:
    # OpenAI's content: a string, null (an assistant turn that only calls tools), or a list of text parts.
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"{where}.content[{j}] must be a {{'type': 'text', 'text': str}} part")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}.content must be a str, got {type(content).__name__}")


def _arguments(value: Any, where: str) -> Any:
    # OpenAI sends arguments as a JSON string; templates (and transformers' convention) want the object.
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value  # what the model wrote, kept as written
    if isinstance(value, Mapping):
        return dict(value)
    raise ValueError(f"{where}.arguments must be a JSON string, got {type(value).__name__}")


def _calls(message: Mapping[str, Any], index: int) -> list[tuple[str, Any]]:
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if not isinstance(calls, list):
        raise ValueError(f"messages[{index}].tool_calls must be a list, got {type(calls).__name__}")
    if message.get("role") != "assistant" and calls:
        raise ValueError(f"messages[{index}].tool_calls is only allowed on assistant messages")
    out = []
    for j, call in enumerate(calls):
        where = f"messages[{index}].tool_calls[{j}].function"
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping):
            raise ValueError(f"{where} must be an object with name and arguments")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"{where}.name must be a non-empty str")
        out.append((name, _arguments(function.get("arguments", "{}"), where)))
    return out


def tool_conversation(
    template: str, messages: list[Mapping[str, Any]], tools: list[Mapping[str, Any]] | None
) -> tuple[list[dict[str, Any]], list[dict] | None]:
    """(messages, tools) as `template` should see them.

    With a tools branch (`template_supports_tools`): the messages as given, each call's arguments
    decoded to an object, and the tools. Without one: plain {role, content: str} messages in the
    Hermes format (the module docstring's picture) and no tools. Malformed tool turns raise ValueError
    naming the field (`messages[2].tool_calls[0].function.name`).
    """
    native = template_supports_tools(template)
    if tools is not None and not isinstance(tools, list):
        raise ValueError(f"tools must be a list, got {type(tools).__name__}")
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ValueError(f"messages[{index}] must be a dict, got {type(message).__name__}")
        calls = _calls(message, index)
        if native:
            prepared = dict(message)
            if calls:
                prepared["tool_calls"] = [
                    {**call, "function": {**call["function"], "arguments": arguments}}
                    for call, (_, arguments) in zip(message["tool_calls"], calls)
                ]
            out.append(prepared)
            continue
        content = _text(message.get("content"), f"messages[{index}]")
        if message.get("role") == "tool":
            response = f"<tool_response>\n{content}\n</tool_response>"
            if index > 0 and messages[index - 1].get("role") == "tool":  # one user turn for a batch of results
                out[-1]["content"] += "\n" + response
            else:
                out.append({"role": "user", "content": response})
            continue
        for name, arguments in calls:
            content += ("\n" if content else "") + format_tool_call(name, arguments)
        out.append({"role": message.get("role"), "content": content})
    if native:
        return out, tools or None
    if not tools:
        return out, None
    block = tools_system_text(tools)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
    else:
        out.insert(0, {"role": "system", "content": block})
    return out, None


def _has_tool_turns(messages: list[Mapping[str, Any]]) -> bool:
    return any(isinstance(m, Mapping) and (m.get("role") == "tool" or m.get("tool_calls")) for m in messages)


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

    `tools` (OpenAI's tool objects) and tool turns in `messages` go through `tool_conversation`: to the
    template's own tools branch, or written in the Hermes format for a template without one.

    A template that raises (`raise_exception(...)`, an undefined name used wrongly, a type error
    in its expressions) becomes a ValueError carrying the template's message.
    """
    compiled = compile_chat_template(template)
    if tools or _has_tool_turns(messages):
        messages, tools = tool_conversation(template, messages, tools or None)
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
