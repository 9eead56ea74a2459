"""The HTTP API strict where OpenAI is strict, and its OpenAPI document (#60): /openapi.json is FastAPI's
document of the same pydantic models, served open with --api-key; the developer role; text parts only; and
fuzzing from the document (schemathesis's generator; hypothesis-jsonschema 0.23.1 no longer runs on this
hypothesis): bodies it accepts never get a 5xx and every 4xx is OpenAI's error object; bodies with a field
of the wrong type all get a 400 naming the field.

Every body these tests send is also checked against the document when the test ends (tests/sidecar/conftest.py)."""

from __future__ import annotations

import copy
import functools
import json
import urllib.error
import urllib.request

import jsonschema
import pytest
import schemathesis
from schemathesis import GenerationMode
from http_helpers import Sent, body_schema, check_sent, http_address, openapi_document, send
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from server_proc import ServerProcess, client_for, wait_idle

KEY = "openapi-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
USER = [{"role": "user", "content": "hi"}]
ROUTES = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("http_openapi"), "--max-model-len", "256", "--max-prompt-chars",
                        "2000", "--max-chat-messages", "8", "--http-port", "0", "--api-key", KEY)
    srv.wait_serving()
    srv.http = http_address(srv)
    yield srv
    assert srv.stop() == 0, srv.log()


def get(server, path: str, headers: dict | None = None) -> tuple[int, str, bytes]:
    req = urllib.request.Request(server.http + path, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers.get("content-type", ""), resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read()


def post(server, path: str, body) -> tuple[int, dict]:
    return send(server.http + path, body, headers=AUTH)


# -- the document ---------------------------------------------------------------------------------------------

def test_the_document_is_served_open_and_is_the_models(server):
    status, kind, raw = get(server, "/openapi.json")  # no key: the document is open, as vLLM's is
    assert status == 200 and kind.startswith("application/json")
    assert json.loads(raw) == openapi_document()
    status, kind, raw = get(server, "/docs")
    assert status == 200 and kind.startswith("text/html") and b"/openapi.json" in raw
    assert get(server, "/v1/models")[0] == 401  # the API itself still needs the key
    assert get(server, "/v1/models", AUTH)[0] == 200


def test_the_document_shows_the_strict_types_and_openai_errors():
    doc = openapi_document()
    schemas = doc["components"]["schemas"]
    completion = schemas["CompletionRequest"]["properties"]
    assert completion["max_tokens"]["anyOf"] == [{"type": "integer"}, {"type": "null"}]
    assert completion["stream"]["type"] == "boolean" and completion["n"]["type"] == "integer"
    assert completion["temperature"]["anyOf"] == [{"type": "number"}, {"type": "null"}]
    roles = schemas["ChatCompletionRequest"]["properties"]["messages"]["items"]["discriminator"]["mapping"]
    assert sorted(roles) == ["assistant", "developer", "system", "tool", "user"]
    for name in ("SystemMessage", "DeveloperMessage", "UserMessage", "ToolMessage"):
        assert "content" in schemas[name]["required"] and schemas[name]["additionalProperties"] is False
    assert "tool_call_id" in schemas["ToolMessage"]["required"]
    parts = schemas["UserMessage"]["properties"]["content"]["oneOf"][1]["items"]
    assert parts == {"$ref": "#/components/schemas/TextPart"}  # text parts only
    assert schemas["TextPart"]["properties"]["type"]["const"] == "text"
    assert set(schemas["Error"]["required"]) == {"message", "type", "param", "code"}
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert {"400", "401", "404", "413", "429", "503"} <= set(responses) and "422" not in responses
        for status in ("400", "401", "404", "413", "429", "503"):
            ref = responses[status]["content"]["application/json"]["schema"]["$ref"]
            assert ref == "#/components/schemas/ErrorResponse"
    assert "HTTPValidationError" not in schemas
    assert doc["paths"]["/v1/completions"]["post"]["security"] == [{"bearer": []}]
    # What the server refuses for its type, the document refuses too.
    completions = jsonschema.Draft202012Validator(body_schema(doc, "/v1/completions"))
    for bad in ({"prompt": "hi", "max_tokens": True}, {"prompt": "hi", "stream": "yes"}, {"prompt": "hi", "n": "2"},
                {"prompt": "hi", "temperature": "0.5"}, {}):
        assert not completions.is_valid(bad), bad
    assert completions.is_valid({"prompt": "hi", "temperature": 1, "future_field": 1})
    chat = jsonschema.Draft202012Validator(body_schema(doc, "/v1/chat/completions"))
    for bad in ([{"role": "user"}], [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
                [{"role": "tool", "content": "x"}], [{"role": "wizard", "content": "x"}]):
        assert not chat.is_valid({"messages": bad}), bad
    assert chat.is_valid({"messages": [{"role": "developer", "content": "Be brief."}, *USER]})


def test_the_body_check_catches_a_disagreement():
    ok = {"prompt": "hi"}
    assert check_sent([Sent("/v1/completions", ok, 200), Sent("/v1/completions", {**ok, "n": "2"}, 400, "n"),
                       Sent("/v1/completions", {**ok, "temperature": -1}, 400, "temperature"),
                       Sent("/v1/completions", {**ok, "model": "gpt-4o"}, 404, "model")]) == []
    assert len(check_sent([Sent("/v1/completions", {**ok, "n": "2"}, 200)])) == 1  # taken, but refused by the doc
    assert len(check_sent([Sent("/v1/completions", {**ok, "user": "u"}, 400, "user")])) == 1  # no check documented
    assert len(check_sent([Sent("/v1/completions", {**ok, "n": 2.0}, 400, "n", "invalid_type")])) == 1  # a type


# -- strict where OpenAI is strict ----------------------------------------------------------------------------

def test_the_developer_role_is_a_system_turn(server):
    system = post(server, "/tokenize", {"messages": [{"role": "system", "content": "Be brief."}, *USER]})
    developer = post(server, "/tokenize", {"messages": [{"role": "developer", "content": "Be brief."}, *USER]})
    assert system[0] == developer[0] == 200, developer
    assert developer[1]["tokens"] == system[1]["tokens"]
    status, body = post(server, "/v1/chat/completions", {"messages": [{"role": "developer", "content": "Be brief."},
                                                                      *USER], "max_tokens": 2})
    assert status == 200 and body["usage"]["prompt_tokens"] == system[1]["count"], body


def test_integers_are_numbers_and_unknown_top_level_fields_are_ignored(server):
    status, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2.0, "temperature": 1,
                                                    "top_p": 1, "a_field_from_the_future": {"x": 1}})
    assert status == 200 and body["usage"]["completion_tokens"] <= 2, body


def test_text_parts_are_joined_and_other_parts_refused_by_name(server):
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    joined = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Hello there"}]})
    split = post(server, "/tokenize", {"messages": [{"role": "user", "content": parts}]})
    assert joined[0] == split[0] == 200 and joined[1]["tokens"] == split[1]["tokens"]
    for part in ({"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
                 {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                 {"type": "file", "file": {"file_id": "file-1"}}):
        messages = [{"role": "user", "content": [parts[0], part]}]
        status, err = post(server, "/v1/chat/completions", {"messages": messages})
        assert status == 400 and err["error"]["param"] == "messages[0].content[1].type", err
        assert f"text-only: {part['type']} content parts" in err["error"]["message"]


def test_assistant_turns_may_omit_content_when_they_call_tools(server):
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    turns = [*USER, {"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "call_1",
                                                                   "content": "done"}]
    assert post(server, "/tokenize", {"messages": turns})[0] == 200
    status, err = post(server, "/tokenize", {"messages": [*USER, {"role": "assistant", "content": None}]})
    assert status == 400 and err["error"]["param"] == "messages[1].content", err


# -- fuzzing from the document --------------------------------------------------------------------------------

FUZZ_EXAMPLES = 60  # per route (half as many refused ones): about 30 s in all on 2 busy cores


@functools.cache
def fuzz_document() -> dict:
    """The document with generation kept cheap and answers telling: 1 to 4 new tokens, always set (unset is the
    rest of the context), n and best_of at most 3, token ids mostly in the vocabulary, and no model (another
    name is a 404) nor unknown fields (ignored by the server: generating them only costs time)."""
    doc = copy.deepcopy(openapi_document())
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        schema = doc["components"]["schemas"][name]
        for field, top in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 3), ("best_of", 3)):
            if field in schema["properties"]:
                schema["properties"][field] = {"type": "integer", "minimum": 1, "maximum": top}
        schema["required"] = [*schema.get("required", []), "max_tokens"]
    schemas = doc["components"]["schemas"]
    schemas["DetokenizeRequest"]["properties"]["tokens"]["items"] = {"type": "integer", "minimum": 0,
                                                                     "maximum": 600}
    for schema in schemas.values():
        schema.get("properties", {}).pop("model", None)
        if "properties" in schema:
            schema["additionalProperties"] = False
    return doc


def assert_openai_answer(path: str, body, status: int, answer) -> None:
    assert status < 500, (path, body, status, answer)
    if status >= 400:
        assert isinstance(answer, dict) and set(answer) == {"error"}, (path, body, answer)
        err = answer["error"]
        assert set(err) == {"message", "type", "param", "code"} and isinstance(err["message"], str), err
        assert err["type"] and (err["param"] is None or isinstance(err["param"], str)), err


def fuzz_send(server, path: str, body) -> tuple[int, object]:
    """POST (bytes as they are), reading a stream whole: (status, the answer, or a stream's events)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(server.http + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json", **AUTH})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if not resp.headers.get("content-type", "").startswith("text/event-stream"):
        return status, json.loads(raw)
    events = [json.loads(line[6:]) for line in raw.decode().splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    failed = [e for e in events if "error" in e and e["error"].get("code") == "internal_error"]
    return (500 if failed else status), failed or events


@pytest.mark.slow
@pytest.mark.parametrize("path", ROUTES)
def test_bodies_the_document_accepts_never_get_a_5xx(server, path):
    operation = schemathesis.openapi.from_dict(fuzz_document())[path]["POST"]
    seen: list[int] = []

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy())
    def check(case):
        status, answer = fuzz_send(server, path, case.body)
        assert_openai_answer(path, case.body, status, answer)
        param = answer["error"]["param"] if status >= 400 else None
        code = answer["error"]["code"] if status >= 400 else None
        assert check_sent([Sent(path, case.body, status, param, code)]) == []  # a 400: a value the server checks
        seen.append(status)

    check()
    assert len(seen) >= FUZZ_EXAMPLES // 2
    with client_for(server) as c:
        assert wait_idle(c).kv_blocks_used == 0


@pytest.mark.slow
@pytest.mark.parametrize("path", ROUTES)
def test_bodies_the_document_refuses_get_a_400(server, path):
    """schemathesis's negative mode: bodies that break the document (a wrong type, a missing field, a value out
    of an enum); the server refuses each with a 400 in OpenAI's shape."""
    operation = schemathesis.openapi.from_dict(openapi_document())[path]["POST"]
    validator = jsonschema.Draft202012Validator(body_schema(openapi_document(), path))
    seen: list[int] = []

    @settings(max_examples=FUZZ_EXAMPLES // 2, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(GenerationMode.NEGATIVE))
    def check(case):
        assume(isinstance(case.body, bytes) or not validator.is_valid(case.body))  # not a header made invalid
        status, answer = fuzz_send(server, path, case.body)
        assert_openai_answer(path, case.body, status, answer)
        assert status == 400, (case.body, answer)
        seen.append(status)

    check()
    assert len(seen) >= FUZZ_EXAMPLES // 4


BASE = {"/v1/completions": {"prompt": "hi", "max_tokens": 1}, "/v1/chat/completions": {"messages": USER,
                                                                                      "max_tokens": 1},
        "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1]}}
JSON_TYPES = {"integer": (int,), "number": (int, float), "boolean": (bool,), "string": (str,), "null": (type(None),)}


def scalar_fields(path: str) -> dict[str, set[str]]:
    """The route's top-level fields typed as scalars in the document, with their JSON types."""
    out = {}
    for name, prop in body_schema(openapi_document(), path)["properties"].items():
        kinds = {p.get("type") for p in prop.get("anyOf", [prop])}
        if kinds <= set(JSON_TYPES) and None not in kinds:
            out[name] = kinds
    return out


def wrong_value(kinds: set[str]):
    """A JSON value of a type none of `kinds` admits (an integral float counts as an integer in JSON Schema,
    so only fractional ones are drawn)."""
    options = [st.lists(st.integers(0, 9), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(), max_size=1)]
    if "boolean" not in kinds:
        options.append(st.booleans())
    if "string" not in kinds:
        options.append(st.text(max_size=5))
    if "number" not in kinds:
        options.append(st.floats(allow_nan=False, allow_infinity=False).filter(lambda x: not x.is_integer()))
    if not kinds & {"integer", "number"}:
        options.append(st.integers())
    if "null" not in kinds:
        options.append(st.none())
    return st.one_of(options)


@pytest.mark.parametrize("path", ROUTES)
def test_a_field_of_the_wrong_type_is_a_400_naming_it(server, path):
    fields = scalar_fields(path)
    nested = {"/v1/chat/completions": [(("messages", 0, "content"), {"string", "array"}, "messages[0].content"),
                                       (("messages", 0, "name"), {"string", "null"}, "messages[0].name")],
              "/detokenize": [(("tokens", 0), {"integer"}, "tokens[0]")]}
    targets = [((name,), kinds, name) for name, kinds in sorted(fields.items())] + nested.get(path, [])
    assert len(targets) >= 2
    validator = jsonschema.Draft202012Validator(body_schema(openapi_document(), path))

    @settings(max_examples=25, deadline=None, database=None)
    @given(st.data())
    def check(data):
        where, kinds, param = data.draw(st.sampled_from(targets))
        value = data.draw(wrong_value(kinds).filter(lambda v: not (isinstance(v, list) and "array" in kinds)))
        body = copy.deepcopy(BASE[path])
        parent = body
        for key in where[:-1]:
            parent = parent[key]
        parent[where[-1]] = value
        assert not validator.is_valid(body), body  # the document refuses it ...
        status, answer = post(server, path, body)
        assert status == 400 and answer["error"]["param"] == param, (body, answer)  # ... and so does the server

    check()
