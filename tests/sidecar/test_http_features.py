"""The HTTP API's request features and error statuses (#36), through the official `openai` client (urllib
where the client cannot say it) against a live `pagedserve serve --http-port 0` on the tiny model: logprobs
in both of OpenAI's shapes, logit_bias, echo, best_of, lists of prompts, usage with cached tokens, structured
outputs (response_format, vLLM's structured_outputs) with the engine's warnings, /metrics, /tokenize,
/detokenize, 413 / 400 / 404, a disconnect of a multi-prompt stream, and greedy output equal over HTTP,
gRPC and the offline LLM."""

from __future__ import annotations

import json
import re
import socket
import urllib.error
import urllib.request

import jsonschema
import openai
import pytest
from engine_helpers import wait_until
from http_helpers import grpc_greedy_ids, http_address, recording_openai, send
from server_proc import TINY, ServerProcess, client_for

PROMPT = [3 + (j * 11) % 500 for j in range(12)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("http_features"), "--max-model-len", "512",
                        "--max-prompt-chars", "2000", "--http-port", "0")
    srv.wait_serving()
    srv.http = http_address(srv)
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def oai(server):
    with recording_openai(server.http + "/v1", max_retries=0, timeout=60) as client:
        yield client


def post(server, path: str, body, raw: bytes | None = None, headers: dict | None = None) -> tuple[int, dict]:
    return send(server.http + path, body, raw=raw, headers=headers)


def idle(server) -> None:
    with client_for(server) as c:
        total = c.model_info().num_kv_blocks
        wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0)(
            c.server_stats()), 30, "the engine to be idle with every KV block free")
        assert c.server_stats().kv_blocks_total == total


def test_completion_logprobs_legacy_shape_streaming_and_not(server, oai):
    kw = dict(model=None, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=3,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    kw.pop("model")
    whole = oai.completions.create(model="tiny-llama", **kw).choices[0]
    lp = whole.logprobs
    ids = whole.model_extra["token_ids"]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    with client_for(server) as c:  # the same logprobs the gRPC path reports for the same tokens
        grpc = [e for ch in c.generate(PROMPT, max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
                for e in ch.logprobs]
    assert [e.token_id for e in grpc] == ids
    assert lp.token_logprobs == pytest.approx([e.logprob for e in grpc], abs=1e-6)
    for i, top in enumerate(lp.top_logprobs):
        assert 1 <= len(top) <= 3 and all(v <= 0 for v in top.values())  # tokens decoding alike share a key
        assert max(top.values()) >= lp.token_logprobs[i] - 1e-6  # greedy: the chosen token is the most likely
    assert lp.text_offset[0] == 0
    assert all(b - a == len(t) for a, b, t in zip(lp.text_offset, lp.text_offset[1:], lp.tokens))
    chunks = list(oai.completions.create(model="tiny-llama", stream=True, **kw))
    streamed = [c.logprobs for ch in chunks for c in ch.choices if c.logprobs is not None]
    assert [t for s in streamed for t in s.token_logprobs] == lp.token_logprobs
    assert [o for s in streamed for o in s.text_offset] == lp.text_offset


def test_chat_logprobs_content_shape_streaming_and_not(oai):
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0,
              logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    whole = oai.chat.completions.create(**kw).choices[0]
    content = whole.logprobs.content
    assert len(content) == 6
    for e in content:
        assert e.bytes == list(e.token.encode()) and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].logprob == pytest.approx(e.logprob)  # greedy picks the most likely
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    streamed = [e for ch in chunks for c in ch.choices if c.logprobs for e in c.logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]
    plain = oai.chat.completions.create(**{**kw, "logprobs": False, "top_logprobs": None}).choices[0]
    assert plain.logprobs is None and plain.message.content == whole.message.content


def test_logit_bias_forces_and_bans_tokens(oai):
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0,
              extra_body={"ignore_eos": True, "return_token_ids": True})
    free = oai.completions.create(**kw).choices[0].model_extra["token_ids"]
    forced = oai.completions.create(logit_bias={"77": 100}, **kw).choices[0].model_extra["token_ids"]
    assert forced == [77] * 6
    banned = oai.completions.create(logit_bias={str(free[0]): -100}, **kw).choices[0].model_extra["token_ids"]
    assert banned[0] != free[0]


def test_echo_puts_the_prompt_before_the_text(oai):
    kw = dict(model="tiny-llama", prompt="Once upon", max_tokens=4, temperature=0, extra_body={"ignore_eos": True})
    plain = oai.completions.create(**kw).choices[0].text
    echoed = oai.completions.create(echo=True, **kw).choices[0].text
    assert echoed == "Once upon" + plain
    chunks = list(oai.completions.create(echo=True, stream=True, **kw))
    assert chunks[0].choices[0].text == "Once upon"
    assert "".join(c.text for ch in chunks for c in ch.choices) == echoed


def test_best_of_returns_n_of_the_samples(oai):
    out = oai.completions.create(model="tiny-llama", prompt=PROMPT, max_tokens=5, temperature=1.0, seed=3,
                                 best_of=3, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1] and out.usage.completion_tokens == 10
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny-llama", prompt="hi", best_of=1, n=2, temperature=1.0)
    assert err.value.param == "best_of"
    with pytest.raises(openai.BadRequestError) as err:
        oai.completions.create(model="tiny-llama", prompt="hi", best_of=3, temperature=1.0, stream=True)
    assert err.value.param == "best_of" and "cannot stream" in err.value.message


def test_a_list_of_prompts_indexes_choices_across_prompts(oai):
    prompts = ["The sky is", "Rivers run"]
    kw = dict(model="tiny-llama", max_tokens=5, temperature=0.8, seed=11, n=2, extra_body={"ignore_eos": True})
    both = oai.completions.create(prompt=prompts, **kw)
    assert sorted(c.index for c in both.choices) == [0, 1, 2, 3]
    texts = {c.index: c.text for c in both.choices}
    for p, prompt in enumerate(prompts):  # a seeded request's samples do not depend on what runs beside it
        alone = oai.completions.create(prompt=prompt, **kw)
        assert [c.text for c in sorted(alone.choices, key=lambda c: c.index)] == [texts[2 * p], texts[2 * p + 1]]
    assert both.usage.completion_tokens == 20
    chunks = list(oai.completions.create(prompt=prompts, stream=True, **kw))
    streamed = {i: "".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in range(4)}
    assert streamed == texts
    assert sorted(c.index for ch in chunks for c in ch.choices if c.finish_reason) == [0, 1, 2, 3]


def test_usage_counts_cached_prompt_tokens(oai):
    prompt = [5 + (j * 13) % 400 for j in range(70)]  # four full blocks of 16 to find cached the second time
    kw = dict(model="tiny-llama", prompt=prompt, max_tokens=2, temperature=0, stop=["zz", "qq"],
              presence_penalty=0.5, frequency_penalty=0.5, user="u1", extra_body={"min_p": 0.1, "top_k": 5})
    oai.completions.create(**kw)
    again = oai.completions.create(**kw).usage
    assert again.prompt_tokens == 70 and again.prompt_tokens_details.cached_tokens >= 64


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 6}},
    "ok": {"type": "boolean"}}}


def test_structured_outputs_follow_their_constraint(oai):
    msgs = [{"role": "user", "content": "json please"}]
    kw = dict(model="tiny-llama", messages=msgs, max_tokens=64, temperature=1.0, seed=3)
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA, "strict": True}}
    choice = oai.chat.completions.create(response_format=rf, **kw).choices[0]
    assert choice.finish_reason == "stop", choice
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert "warnings" not in out_extra(choice) and "schema_violations" not in out_extra(choice)
    choice = oai.chat.completions.create(response_format={"type": "json_object"}, **kw).choices[0]
    assert choice.finish_reason == "length" or isinstance(json.loads(choice.message.content), dict)
    out = oai.completions.create(model="tiny-llama", prompt="pick", max_tokens=10, temperature=1.0, seed=1,
                                 extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert out.choices[0].text in ("red", "green", "blue")
    out = oai.completions.create(model="tiny-llama", prompt="date", max_tokens=20, temperature=1.0, seed=1,
                                 extra_body={"structured_outputs": {"regex": r"\d{4}-\d{2}"}})
    assert re.fullmatch(r"\d{4}-\d{2}", out.choices[0].text), out.choices[0].text


def out_extra(obj) -> dict:
    return obj.model_extra or {}


def test_what_a_schema_does_not_enforce_comes_back_as_warnings_and_violations(oai):
    broken = {"type": "string", "enum": ["yes"], "not": {"const": "yes"}}  # the grammar allows only "yes"
    rf = {"type": "json_schema", "json_schema": {"name": "broken", "schema": broken}}
    kw = dict(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=1.0,
              seed=3, n=2, response_format=rf)
    out = oai.chat.completions.create(**kw)
    assert out_extra(out)["warnings"] == ["not: not enforced"]
    for choice in out.choices:
        assert choice.message.content == '"yes"' and choice.finish_reason == "stop"
        assert out_extra(choice)["schema_violations"] == ["$: 'yes' should not be valid under {'const': 'yes'}"]
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert [out_extra(ch)["warnings"] for ch in chunks if "warnings" in out_extra(ch)] == [["not: not enforced"]]
    flagged = [c for ch in chunks for c in ch.choices if "schema_violations" in out_extra(c)]
    assert sorted(c.index for c in flagged) == [0, 1] and all(c.finish_reason == "stop" for c in flagged)
    with pytest.raises(openai.BadRequestError) as err:  # strict refuses what it cannot enforce exactly
        oai.chat.completions.create(**{**kw, "response_format": {
            "type": "json_schema", "json_schema": {"name": "broken", "schema": broken, "strict": True}}})
    assert err.value.param == "response_format.json_schema.schema" and "strict" in err.value.message


def metric(server, name: str) -> float:
    with urllib.request.urlopen(server.http + "/metrics", timeout=30) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    m = re.search(rf"^{re.escape(name)} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_tokenize_and_detokenize(server, oai):
    before = metric(server, 'pagedserve_requests_total{interface="http",outcome="length"}')
    refused = metric(server, 'pagedserve_requests_total{interface="http",outcome="invalid_argument"}')
    oai.completions.create(model="tiny-llama", prompt=["hi", "ho"], max_tokens=2, extra_body={"ignore_eos": True})
    assert post(server, "/v1/completions", {"prompt": [1, 99999]})[0] == 400
    assert metric(server, 'pagedserve_requests_total{interface="http",outcome="length"}') == before + 2  # per prompt
    assert metric(server, 'pagedserve_requests_total{interface="http",outcome="invalid_argument"}') == refused + 1
    assert metric(server, "pagedserve_kv_cache_usage_perc") == 0.0 and metric(server, "pagedserve_memory_budget_bytes")
    status, body = post(server, "/tokenize", {"model": "tiny-llama", "prompt": "hello world"})
    with client_for(server) as c:
        assert status == 200 and body["tokens"] == c.tokenize("hello world") and body["count"] == len(body["tokens"])
    assert body["max_model_len"] == 512
    status, back = post(server, "/detokenize", {"model": "tiny-llama", "tokens": body["tokens"]})
    assert status == 200 and back == {"prompt": "hello world"}
    status, chat = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 200 and chat["count"] > 2
    whole = oai.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert whole.usage.prompt_tokens == chat["count"]
    for path, bad, param in [("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
                             ("/tokenize", {"prompt": "x" * 2001}, "prompt"),
                             ("/detokenize", {"tokens": [1, 512]}, "tokens"),
                             ("/detokenize", {"tokens": "abc"}, "tokens")]:
        status, err = post(server, path, bad)
        assert status == 400 and err["error"]["param"] == param, err
    assert post(server, "/tokenize", {"model": "gpt-4o", "prompt": "a"})[0] == 404


BAD_BODIES = [  # (path, body, the field the 400 names)
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias[5]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": [1]}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "logprobs": -1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": 1}, "echo"),
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt[1]"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 99999]]}, "prompt[1]"),
    ("/v1/completions", {"prompt": "hi", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, "stop[0]"),
    ("/v1/completions", {"prompt": "hi", "stop": ["x"] * 65}, "stop"),
    ("/v1/completions", {"prompt": "hi", "min_p": 2}, "min_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": 100000}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
    ("/v1/completions", {"prompt": "hi", "frequency_penalty": "lots"}, "frequency_penalty"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 512}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "wat"}}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"regex": "("}}, "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "structured_outputs": {"typo": 1}}, "structured_outputs.typo"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True,
                              "top_logprobs": 30}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 3}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "tool", "function": {"name": "f"}}]}, "tools[0].type"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice.function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "f"}}] * 2},
     "tools[1].function.name"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}]},
     "tools[0].function.parameters"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {"name": "f"}}],
                              "response_format": {"type": "json_object"}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "parallel_tool_calls": "maybe"},
     "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
     "messages[0].content[0].type"),
    # Strict where OpenAI is strict (#60): no coercion of types, a message per role.
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "hi", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 2.5}, "n"),
    ("/v1/completions", {"prompt": "hi", "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/completions", {"prompt": [1, True]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": "1"}}, "logit_bias[5]"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": None}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "developer"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "content": "18 degrees"}]}, "messages[0].tool_call_id"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "colour": "red"}]}, "messages[0].colour"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": 1}, "logprobs"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "hi", "add_special_tokens": "no"}, "add_special_tokens"),
    ("/detokenize", {"tokens": [True]}, "tokens[0]"),
    ("/detokenize", {"tokens": [1.5]}, "tokens[0]"),
]


@pytest.mark.parametrize("path,body,param", BAD_BODIES, ids=[str(i) for i in range(len(BAD_BODIES))])
def test_every_invalid_field_is_a_400_naming_it(server, path, body, param):
    status, err = post(server, path, body)
    assert status == 400 and err["error"]["type"] == "invalid_request_error", err
    assert err["error"]["param"] == param, err


def test_malformed_input_never_gets_a_500(server):
    raws = [b"", b"{", b"[]", b"null", b"\xff\xfe", b'{"prompt": 1e999}', b'{"prompt": {"a": 1}}',
            b'{"prompt": "hi", "n": 1e30}', b'{"prompt": "hi", "logit_bias": {"1": "x"}}',
            b'{"prompt": "hi", "max_tokens": -5}', b'{"prompt": [1.5, 2]}', b'{"messages": "hi"}',
            b'{"prompt": "hi", "stream_options": 3}', b'{"prompt": "hi", "temperature": NaN}']
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        for raw in raws:
            status, body = post(server, path, None, raw=raw)
            assert status < 500 and (status == 200 or "message" in body["error"]), (path, raw, status, body)
    assert post(server, "/v1/no-such-route", {})[0] == 404
    idle(server)


def test_an_oversized_body_is_413_before_it_is_parsed(server):
    limit = 4 * 2000 + (1 << 20)
    status, err = post(server, "/v1/completions", {"prompt": "x" * (limit + 10)})
    assert status == 413 and f"the limit is {limit} bytes" in err["error"]["message"], err
    # Chunked (no Content-Length): counted as it arrives, refused once past the limit.
    host, port = server.http.removeprefix("http://").rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        for _ in range(limit // len(chunk) + 2):
            try:
                s.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            except OSError:  # the server answered and closed: enough sent
                break
        else:
            s.sendall(b"0\r\n\r\n")
        reply = s.recv(65536)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert oai_ok(server)


def oai_ok(server) -> bool:
    status, body = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1})
    return status == 200 and body["choices"][0]["finish_reason"] in ("length", "stop")


def test_a_disconnect_mid_stream_of_several_prompts_frees_every_block(server, oai):
    with client_for(server) as c:
        free_at_start = c.server_stats().kv_blocks_used
        assert free_at_start == 0
        stream = oai.completions.create(model="tiny-llama", prompt=[[5, 6, 7], [8, 9, 10], [11, 12]], max_tokens=480,
                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
        seen = set()
        for i, chunk in enumerate(stream):
            seen.update(ch.index for ch in chunk.choices)
            if len(seen) == 3 or i == 200:
                break
        assert seen == {0, 1, 2}
        stream.close()
        wait_until(lambda: (lambda s: s.kv_blocks_used == 0 and s.num_running == 0)(c.server_stats()), 30,
                   "the three aborted requests to free their blocks")
    rid = chunk.id  # the three engine requests are <id>-0, -1, -2; each is aborted, none ran to its end

    def aborted() -> set[str]:
        lines = [json.loads(line) for line in server.log().splitlines() if '"request.aborted"' in line]
        return {e["request_id"] for e in lines if e.get("request_id", "").startswith(rid)}
    wait_until(lambda: len(aborted()) == 3, 30, "three request.aborted log lines")
    assert aborted() == {f"{rid}-{i}" for i in range(3)}


def test_greedy_output_is_the_same_over_http_grpc_and_offline(server, oai):
    from pagedserve.runtime.llm import LLM
    from pagedserve.runtime.sampling_params import SamplingParams

    prompt = [4 + (j * 17) % 480 for j in range(30)]
    http_ids = oai.completions.create(model="tiny-llama", prompt=prompt, max_tokens=20, temperature=0,
                                      extra_body={"ignore_eos": True, "return_token_ids": True}
                                      ).choices[0].model_extra["token_ids"]
    grpc_ids = grpc_greedy_ids(server, prompt, 20)
    with LLM(TINY, device="cpu", num_kv_blocks=64, seed=0) as llm:
        offline = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    assert http_ids == grpc_ids == list(offline[0].outputs[0].token_ids)
    assert len(http_ids) == 20


def test_greedy_n_is_n_copies_of_one_run_over_http_and_grpc(server, oai):
    """n > 1 at temperature 0 answers n identical choices (OpenAI accepts it), copies of one greedy run; usage
    counts n x the tokens, as OpenAI's does."""
    kw = dict(model="tiny-llama", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    one = oai.completions.create(**kw).choices[0].text
    whole = oai.completions.create(n=3, logprobs=2, **kw)
    assert [c.index for c in whole.choices] == [0, 1, 2] and {c.text for c in whole.choices} == {one}
    assert {c.finish_reason for c in whole.choices} == {"length"} and whole.usage.completion_tokens == 3 * 6
    assert all(c.logprobs.token_logprobs == whole.choices[0].logprobs.token_logprobs for c in whole.choices)
    chunks = list(oai.completions.create(n=3, stream=True, stream_options={"include_usage": True}, **kw))
    texts = {i: "".join(c.text for ch in chunks for c in ch.choices if c.index == i) for i in (0, 1, 2)}
    assert texts == {0: one, 1: one, 2: one} and chunks[-1].usage.completion_tokens == 18
    assert oai.completions.create(n=2, extra_body={"ignore_eos": True, "best_of": 4}, **{
        k: v for k, v in kw.items() if k != "extra_body"}).choices[1].text == one
    chat = oai.chat.completions.create(model="tiny-llama", messages=[{"role": "user", "content": "hi"}], n=2,
                                       max_tokens=5, temperature=0)
    assert len(chat.choices) == 2 and chat.choices[0].message.content == chat.choices[1].message.content
    with client_for(server) as c:
        stream = c.generate(PROMPT, n=3, max_tokens=6, temperature=0.0, ignore_eos=True)
        chunks = list(stream)
        ids = {i: [t for ch in chunks if ch.index == i for t in ch.token_ids] for i in (0, 1, 2)}
        assert ids[0] == ids[1] == ids[2] == grpc_greedy_ids(server, PROMPT, 6)
        assert stream.usage.completion_tokens == 18
        assert sorted(ch.index for ch in chunks if ch.finish_reason) == [0, 1, 2]
