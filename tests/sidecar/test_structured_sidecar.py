"""Structured outputs through the sidecar: the proto message, the client's keywords, the CLI flags, and
INVALID_ARGUMENT for bad constraints with the server carrying on."""

from __future__ import annotations

import json
import re

import grpc
import pytest
from server_proc import ServerProcess, client_for, wait_idle

from pagedserve.sidecar import cli
from pagedserve.sidecar.client import PagedServeError, _sampling
from pagedserve.sidecar.pb import generation_pb2 as pb
from pagedserve.sidecar.servicer import sampling_params_from_proto

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["id", "tags", "ok"], "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tags": {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 6}},
    "ok": {"type": "boolean"}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = ServerProcess(tmp_path_factory.mktemp("srv"), "--max-model-len", "512")
    srv.wait_serving()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_client_keywords_build_the_message_and_the_servicer_reads_it():
    msg, _ = _sampling("generate", {"json_schema": SCHEMA, "temperature": 1.0})
    assert json.loads(msg.structured_outputs.json_schema) == SCHEMA
    params = sampling_params_from_proto(msg)
    assert params.structured_outputs.kind == "json" and json.loads(params.structured_outputs.json) == SCHEMA
    msg, _ = _sampling("generate", {"choice": ["a", "b"]})
    assert list(msg.structured_outputs.choice.options) == ["a", "b"]
    assert sampling_params_from_proto(msg).structured_outputs.choice == ["a", "b"]
    msg, _ = _sampling("generate", {"structured_outputs": {"json": {"type": "object"}}})
    assert sampling_params_from_proto(msg).structured_outputs.kind == "json"
    msg, _ = _sampling("generate", {"json_object": True})
    assert sampling_params_from_proto(msg).structured_outputs.kind == "json_object"
    with pytest.raises(ValueError, match="exactly one constraint, got choice, regex"):
        _sampling("generate", {"regex": "a", "choice": ["b"]})
    with pytest.raises(ValueError, match="structured_outputs is set but has no constraint"):
        sampling_params_from_proto(pb.SamplingParams(structured_outputs=pb.StructuredOutputs()))


def test_generate_with_a_schema_streams_valid_json(server):
    with client_for(server) as c:
        stream = c.generate([5, 6, 7], json_schema=SCHEMA, temperature=1.0, seed=3, n=2, max_tokens=64)
        chunks = list(stream)
        texts = ["".join(ch.text for ch in chunks if ch.index == i) for i in range(2)]
        for i, text in enumerate(texts):
            value = json.loads(text)
            assert set(value) == {"id", "tags", "ok"} and 0 <= value["id"] <= 999
            assert [ch.finish_reason for ch in chunks if ch.index == i][-1] == "stop"
        assert len([ch for ch in chunks if ch.index == 0]) > 2  # streamed, not sent whole at the end


@pytest.mark.parametrize("kwargs, needle", [
    (dict(json_schema='{"type": "nope"}'), "structured_outputs.json is not a valid JSON Schema: Invalid type: nope"),
    (dict(regex="[0-9"), "structured_outputs.regex is not a valid regular expression"),
    (dict(grammar="start: missing_rule"), "structured_outputs.grammar is not a valid grammar: at 1(8): unknown"),
    (dict(choice=[""]), "structured_outputs.choice[0] must be a non-empty string"),
    (dict(json_object=False), "structured_outputs.json_object must be true"),
])
def test_bad_constraints_are_invalid_argument_and_the_next_request_is_fine(server, kwargs, needle):
    with client_for(server) as c:
        with pytest.raises(PagedServeError) as e:
            list(c.generate([5, 6], max_tokens=4, **kwargs))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and needle in e.value.message, e.value.message
        text = c.generate_text([5, 6], regex="[0-9]{3}", temperature=1.0, seed=1, max_tokens=8)
        assert re.fullmatch("[0-9]{3}", text)
        assert wait_idle(c).kv_blocks_used == 0


def test_cli_flags(server, tmp_path, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "ab" | "cd"\n')
    base = ["generate", "--prompt", "x", "--socket", server.socket, "--temperature", "1", "--max-tokens", "64"]
    for flags, check in [(["--json-schema", str(schema)], lambda t: set(json.loads(t)) == {"id", "tags", "ok"}),
                         (["--regex", "[a-c]{4}"], lambda t: re.fullmatch("[a-c]{4}", t)),
                         (["--choice", "red,green"], lambda t: t in ("red", "green")),
                         (["--grammar", str(grammar)], lambda t: t in ("ab", "cd"))]:
        assert cli.main(base + flags) == 0
        out = capsys.readouterr().out.rstrip("\n")
        assert check(out), (flags, out)
    assert cli.main(base + ["--regex", "(("]) == 2
    assert "INVALID_ARGUMENT: structured_outputs.regex" in capsys.readouterr().err
    assert cli.main(base + ["--grammar", str(tmp_path / "missing.lark")]) == 2
    assert "--grammar: cannot read" in capsys.readouterr().err


def test_unenforced_keyword_warns_on_the_first_chunk_and_a_violation_is_flagged(server):
    broken = {"type": "string", "enum": ["yes"], "not": {"const": "yes"}}  # the grammar allows only "yes"
    with client_for(server) as c:
        chunks = list(c.generate([5, 6, 7], json_schema=broken, temperature=1.0, seed=3, n=2, max_tokens=16))
        assert chunks[0].warnings == ("not: not enforced",) and all(ch.warnings == () for ch in chunks[1:])
        for i in range(2):
            mine = [ch for ch in chunks if ch.index == i]
            assert "".join(ch.text for ch in mine) == '"yes"' and mine[-1].finish_reason == "stop"
            assert mine[-1].schema_violations == ("$: 'yes' should not be valid under {'const': 'yes'}",)
            assert all(ch.schema_violations == () for ch in mine[:-1])
        exact = list(c.generate([5, 6], json_schema=SCHEMA, temperature=1.0, seed=3, max_tokens=64))
        assert all(ch.warnings == () and ch.schema_violations == () for ch in exact)

        strict = pb.StructuredOutputs(json_schema=json.dumps(broken), strict=True)
        with pytest.raises(PagedServeError) as e:
            list(c.generate([5, 6], max_tokens=4, structured_outputs=strict))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT, e.value
        assert "structured_outputs.json uses not, which cannot be enforced exactly (strict)" in e.value.message
        with pytest.raises(PagedServeError) as e:  # the same, as plain keywords
            list(c.generate([5, 6], max_tokens=4, json_schema=broken, strict=True))
        assert "cannot be enforced exactly (strict)" in e.value.message
        with pytest.raises(PagedServeError) as e:
            list(c.generate([5, 6], max_tokens=4, structured_outputs=pb.StructuredOutputs(regex="a", strict=True)))
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "structured_outputs.strict" in e.value.message
        with pytest.raises(ValueError, match="strict needs a constraint"):
            list(c.generate([5, 6], max_tokens=4, strict=True))
        assert wait_idle(c).kv_blocks_used == 0
