"""Tools in chat templates: a template's own tools branch gets the tools, a template without one (SmolLM2's,
the tiny checkpoints') gets the Hermes block and its tool turns written as text."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
import pytest

from pagedserve.models.tokenizer.chat_template import (
    compile_chat_template,
    format_tool_call,
    render_chat_template,
    template_supports_tools,
    tool_conversation,
    tools_system_text,
)
from pagedserve.models.tokenizer.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

DATA = Path(__file__).resolve().parents[1] / "data"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
# A conversation with a tool round trip, as the openai client sends it (arguments as a JSON string).
ROUND_TRIP = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "21C"},
]
# The shape of Qwen2.5's template: it reads `tools` and each call's arguments as an object.
NATIVE = (
    "{% if tools %}[{% for t in tools %}{{ t.function.name }};{% endfor %}]{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content if m.content is defined else '' }}"
    "{% for c in m.tool_calls or [] %}({{ c.function.name }} {{ c.function.arguments.city }}){% endfor %}{% endfor %}"
)


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


def test_which_templates_have_a_tools_branch(smol) -> None:
    assert not template_supports_tools(smol.chat_template)  # SmolLM2-135M-Instruct: none
    assert not template_supports_tools(load_hf_tokenizer(DATA / "tiny-qwen2").chat_template)
    assert not template_supports_tools(load_hf_tokenizer(DATA / "tiny-llama").chat_template)
    assert template_supports_tools(NATIVE)
    assert not template_supports_tools("{% set tools = 1 %}{{ tools }}")  # its own variable, not the caller's
    with pytest.raises(ValueError, match="does not compile"):
        template_supports_tools("{% for %}")


def test_smollm2_gets_the_hermes_block_and_text_tool_turns(smol) -> None:
    text = smol.apply_chat_template(ROUND_TRIP, tools=[WEATHER])
    block = tools_system_text([WEATHER])
    assert f"<tools>\n{json.dumps(WEATHER)}\n</tools>" in block and "<tool_call>" in block
    assert text == (
        f"<|im_start|>system\n{block}<|im_end|>\n"  # replaces SmolLM2's default system prompt
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids = smol.apply_chat_template(ROUND_TRIP, tools=[WEATHER], tokenize=True)
    assert smol.decode(ids, skip_special_tokens=False) == text


def test_a_system_message_keeps_its_text_before_the_block(smol) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = smol.apply_chat_template(messages, tools=[WEATHER])
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert text.count("<|im_start|>system") == 1


def test_without_tools_nothing_changes(smol) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert smol.apply_chat_template(messages, tools=None) == smol.apply_chat_template(messages)
    assert smol.apply_chat_template(messages, tools=[]) == smol.apply_chat_template(messages)
    assert tool_conversation(smol.chat_template, messages, None) == ([{"role": "user", "content": "Hi"}], None)


def test_tool_turns_without_tools_still_render_on_a_template_that_refuses_the_tool_role() -> None:
    # tiny-qwen2's template raises on any role but system/user/assistant: tool results become user turns.
    qwen = load_hf_tokenizer(DATA / "tiny-qwen2")
    with pytest.raises(jinja2.exceptions.TemplateError, match="Unknown role: tool"):  # the template itself
        compile_chat_template(qwen.chat_template).render(messages=[{"role": "tool", "content": "18C"}])
    text = qwen.apply_chat_template(ROUND_TRIP)  # tool_choice "none": no tools block, the turns as text
    assert "# Tools" not in text and "<|im_start|>tool" not in text
    assert "<tool_response>\n18C\n</tool_response>" in text
    assert format_tool_call("get_weather", {"city": "Rome"}) in text


def test_a_template_with_a_tools_branch_gets_the_tools_and_decoded_arguments() -> None:
    text = render_chat_template(NATIVE, ROUND_TRIP[:2], tools=[WEATHER])
    assert text == "[get_weather;]<user>Weather in Paris and Rome?<assistant>(get_weather Paris)(get_weather Rome)"
    messages, tools = tool_conversation(NATIVE, ROUND_TRIP, [WEATHER])
    assert tools == [WEATHER] and messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert ROUND_TRIP[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'  # the caller's: untouched
    assert messages[2] == ROUND_TRIP[2]


@pytest.mark.parametrize(("message", "match"), [
    ({"role": "assistant", "tool_calls": {"a": 1}}, r"messages\[1\]\.tool_calls must be a list"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.name must be a non-empty str"),
    ({"role": "assistant", "tool_calls": [{"type": "function"}]}, r"messages\[1\]\.tool_calls\[0\]\.function must be"),
    ({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]},
     r"messages\[1\]\.tool_calls\[0\]\.function\.arguments must be a JSON string"),
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
     r"messages\[1\]\.tool_calls is only allowed on assistant messages"),
    ({"role": "tool", "content": [{"type": "image_url"}]}, r"messages\[1\]\.content\[0\] must be a"),
])
def test_malformed_tool_turns_name_the_field(smol, message, match) -> None:
    with pytest.raises(ValueError, match=match):
        render_chat_template(smol.chat_template, [{"role": "user", "content": "Hi"}, message], tools=[WEATHER])


def test_content_parts_are_joined() -> None:
    parts = [{"type": "text", "text": "18"}, {"type": "text", "text": "C"}]
    messages, _ = tool_conversation("{{ messages }}", [{"role": "tool", "content": parts}], None)
    assert messages == [{"role": "user", "content": "<tool_response>\n18C\n</tool_response>"}]


def test_an_assistant_turn_with_only_tool_calls_passes_validation(smol) -> None:
    # content None is allowed only beside tool_calls; a plain turn still needs its text.
    assert "<tool_call>" in smol.apply_chat_template(ROUND_TRIP[:2])
    with pytest.raises(ValueError, match=r"messages\[1\]\.content must be a str"):
        smol.apply_chat_template([ROUND_TRIP[0], {"role": "assistant", "content": None}])


def test_arguments_that_are_not_json_are_kept_as_written(smol) -> None:
    broken = [ROUND_TRIP[0], {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{city: Paris"}}]}]
    text = smol.apply_chat_template(broken)
    assert 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": "{city: Paris"}\n</tool_call>' in text


def test_gemma3_template_gets_the_fallback_and_keeps_its_turns_alternating() -> None:
    # Gemma 3's own template (from the packaged 270M, committed with the tokenizer goldens) has no tools branch,
    # folds the system message into the first user turn and refuses turns that do not alternate.
    template = json.loads((DATA / "goldens" / "gemma3-270m_tokenizer.json").read_text())["chat_template"]
    assert not template_supports_tools(template)
    text = render_chat_template(template, [{"role": "system", "content": "Be brief."}] + ROUND_TRIP, tools=[WEATHER],
                                bos_token="<bos>")
    assert text.startswith(f"<bos><start_of_turn>user\nBe brief.\n\n{tools_system_text([WEATHER])}\n\nWeather in Paris")
    assert "<start_of_turn>model\n" + format_tool_call("get_weather", {"city": "Paris"}) + "\n" in text
    assert text.endswith("<start_of_turn>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n21C\n"
                         "</tool_response><end_of_turn>\n<start_of_turn>model\n")
