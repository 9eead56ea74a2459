"""Tool calling over the HTTP chat API (#36), through the official `openai` client against a live server on the
tiny model: "required" and a named function (the grammar forces the call, so its arguments parse and match the
schema), "auto" (the model's tool-call text parsed out; the tiny model is made to write one by a choice
constraint), "none", tool turns in the input, whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from http_helpers import http_address, recording_openai
from server_proc import ServerProcess

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                  "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["Europe/Paris", "Asia/Tokyo"]}},
               "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER_PARAMS}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME_PARAMS}}]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def oai(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("http_tools"), "--max-model-len", "2048", "--http-port", "0")
    srv.wait_serving()
    with recording_openai(http_address(srv) + "/v1", "x", max_retries=0, timeout=60) as client:
        yield client
    assert srv.stop() == 0, srv.log()


def check_calls(calls, names=tuple(SCHEMAS)) -> None:
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def streamed_calls(chunks) -> dict[int, dict]:
    """Stream deltas joined as OpenAI's clients join them: per call index, name once, arguments appended."""
    calls: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.choices:
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or d.id
                if d.function and d.function.name:
                    call["name"] = d.function.name
                if d.function and d.function.arguments:
                    call["arguments"] += d.function.arguments
    return calls


def test_required_forces_valid_calls_whole_and_streamed(oai):
    kw = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200,
              temperature=1.0, seed=5, parallel_tool_calls=False)
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    check_calls(choice.message.tool_calls)
    assert len(choice.message.tool_calls) == 1  # parallel_tool_calls false
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    calls = streamed_calls(chunks)
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls]
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["tool_calls"]


def test_a_named_function_is_the_one_called(oai):
    choice = oai.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                         tool_choice={"type": "function", "function": {"name": "get_time"}},
                                         temperature=1.0, seed=2).choices[0]
    check_calls(choice.message.tool_calls, names=("get_time",))
    assert len(choice.message.tool_calls) == 1 and choice.finish_reason == "stop"  # as OpenAI's named calls end


def test_auto_parses_the_models_call_out_of_its_text(oai):
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    kw = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=80,
              temperature=0, extra_body={"structured_outputs": {"choice": [text]}})
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris",
                                                                                           "unit": "celsius"}
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    [streamed] = streamed_calls(chunks).values()
    assert streamed["name"] == "get_weather"
    assert json.loads(streamed["arguments"]) == json.loads(call.function.arguments)
    assert not "".join(c.delta.content or "" for ch in chunks for c in ch.choices)
    # The same text with tool_choice "none": no parsing, the text is the content.
    plain = oai.chat.completions.create(**{**kw, "tool_choice": "none"}).choices[0]
    assert plain.message.content == text and not plain.message.tool_calls and plain.finish_reason == "stop"


def test_auto_call_cut_by_max_tokens_is_no_call(oai):
    # max_tokens cuts the call inside its arguments: whole, the reply is its text with no tool_calls (as vLLM's
    # Hermes parser answers) and "length"; streamed, the call's deltas already sent are incomplete and the
    # stream ends "length" (as OpenAI's do). On main the cut call came back whole as a call, arguments broken.
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    kw = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=50,
              temperature=0, extra_body={"structured_outputs": {"choice": [text]}})
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls, choice
    assert text.startswith(choice.message.content) and '"arguments": {"' in choice.message.content
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    [streamed] = streamed_calls(chunks).values()
    assert streamed["name"] == "get_weather" and streamed["arguments"] and streamed["arguments"] in text
    assert [c.finish_reason for ch in chunks for c in ch.choices if c.finish_reason] == ["length"]


def test_auto_with_response_format_keeps_the_requests_constraint(oai):
    # A request's own constraint takes the place of the auto tool-call grammar (required refuses the pair).
    kw = dict(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=20, temperature=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object", "properties": {
        "ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}}
    choice = oai.chat.completions.create(tool_choice="auto", response_format=fmt, **kw).choices[0]
    assert choice.finish_reason == "stop" and json.loads(choice.message.content) in ({"ok": True}, {"ok": False})
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        oai.chat.completions.create(tool_choice="required", response_format=fmt, **kw)


def test_tools_reach_the_prompt_unless_none(oai):
    def prompt_tokens(**kw) -> int:
        out = oai.chat.completions.create(model="tiny-llama", messages=MESSAGES, max_tokens=1, **kw)
        return out.usage.prompt_tokens
    bare = prompt_tokens()
    assert prompt_tokens(tools=TOOLS, tool_choice="none") == bare
    assert prompt_tokens(tools=TOOLS) > bare + 50  # the tools' signatures and instructions


def test_tool_turns_in_the_input_are_rendered(oai):
    turns = MESSAGES + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees, sunny"}]
    short = oai.chat.completions.create(model="tiny-llama", messages=MESSAGES, tools=TOOLS, max_tokens=1)
    out = oai.chat.completions.create(model="tiny-llama", messages=turns, tools=TOOLS, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert out.usage.prompt_tokens > short.usage.prompt_tokens + 20 and out.choices[0].finish_reason == "length"
