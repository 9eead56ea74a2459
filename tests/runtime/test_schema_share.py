"""Repeated sub-schemas written once under $defs (issue #40's compile time): the rewrite means what the schema
meant (jsonschema's verdicts, llguidance's), shrinks the grammar, and stays away from what llguidance reads
eagerly (oneOf branches, allOf members, what such places refer to) and from what a JSON pointer reaches into."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance as llg
import pytest

from pagedserve.runtime.structured_output import schema_share
from pagedserve.runtime.structured_output.grammar_compiler import GrammarCompiler
from pagedserve.runtime.structured_output.schema_share import share_repeated_subschemas as share
from pagedserve.runtime.structured_outputs_params import JSON_LENIENT, StructuredOutputsParams as SO


def _obj(required: bool = False, **props: dict) -> dict:
    out = {"type": "object", "properties": props}
    return {**out, "required": sorted(props)} if required else out


RULE = {"type": "object", "allOf": [{"$ref": "#/$defs/rule"}]}
# detekt-1.22.0.json's shape: rule sets of rule objects, most of them the same allOf of a shared definition.
DETEKT = {"$defs": {"rule": _obj(active={"type": "boolean"}, excludes={"type": "array", "items": {"type": "string"}})},
          "type": "object",
          "properties": {f"set{i}": _obj(**{f"only{i}": {"type": "boolean"}},
                                         **{f"Rule{j}": RULE for j in range(12)},
                                         Own={"type": "object", "allOf": [{"$ref": "#/$defs/rule"}],
                                              "properties": {"limit": {"type": "integer"}}})
                         for i in range(6)}}

INSTANCES = [
    {}, {"set0": {}}, {"set0": {"only0": True, "Rule3": {"active": False, "excludes": ["a"]}}},
    {"set1": {"Rule0": {"excludes": [1]}}}, {"set2": {"Own": {"limit": 3, "active": True}}},
    {"set2": {"Own": {"limit": "3"}}}, {"set5": {"Rule11": "no"}}, {"set3": {"Rule1": {"other": {"x": [1]}}}},
    {"a": {"kind": "b", "n": 1}}, {"a": {"kind": "b", "n": "1"}}, {"a": {"kind": "c"}}, {"b": {"kind": "c"}},
    {"a": {"x": "s"}, "b": {"x": 2}}, {"c": {"x": "s", "y": {"x": 1}}}, [], 7, None,
]


@pytest.fixture
def share_small(monkeypatch):
    """Requests share the repeats of schemas of any size (by default only from MIN_CHARS of JSON text)."""
    monkeypatch.setattr(schema_share, "MIN_CHARS", 0)
    schema_share.clear_cache()
    yield
    schema_share.clear_cache()


def _same_verdicts(a: dict, b: dict) -> None:
    va, vb = jsonschema.Draft202012Validator(a), jsonschema.Draft202012Validator(b)
    for instance in INSTANCES:
        assert va.is_valid(instance) == vb.is_valid(instance), instance


def test_repeated_objects_are_written_once_and_mean_the_same():
    shared, n = share(DETEKT)
    assert n == 2  # the bare rule object and `Own`
    assert sorted(shared["$defs"]) == ["_shared0", "_shared1", "rule"]
    assert shared["$defs"]["_shared0"] == RULE
    assert shared["properties"]["set4"]["properties"]["Rule7"] == {"$ref": "#/$defs/_shared0"}
    assert shared["$defs"]["rule"] == DETEKT["$defs"]["rule"]  # allOf's member: llguidance intersects it
    assert json.dumps(DETEKT).count('"Rule7"') == 6 and DETEKT["properties"]["set0"]["properties"]["Rule0"] == RULE
    _same_verdicts(DETEKT, shared)
    assert share({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "string"}}})[1] == 0


def test_the_grammar_shrinks_and_accepts_the_same_texts(tiny, capfd, share_small):
    ll = GrammarCompiler(tiny.tokenizer, tiny.tokenizer.vocab_size).ll_tokenizer
    params = SO(json=DETEKT)
    assert "_shared0" in params.grammar_text and params.warnings == []
    sizes, verdicts = [], []
    for grammar in (llg.LLMatcher.grammar_from_json_schema(json.dumps(DETEKT), defaults=JSON_LENIENT),
                    params.grammar_text):
        capfd.readouterr()
        llg.LLMatcher(ll, grammar, log_level=2)  # its statistics go to stderr
        sizes.append(int(re.search(r"(\d+) non-terminals", capfd.readouterr().err).group(1)))
        seen = []
        for instance in INSTANCES:
            m = llg.LLMatcher(ll, grammar, log_level=0)
            ok = m.consume_tokens(ll.tokenize_str(json.dumps(instance))) and m.is_accepting()
            seen.append(ok)
        verdicts.append(seen)
    assert verdicts[0] == verdicts[1] and sum(verdicts[0]) >= 4, verdicts
    assert sizes[1] < sizes[0] / 2, sizes


def test_one_of_branches_stay_inline_so_one_of_stays_exact(share_small):
    b = _obj(True, kind={"const": "b"}, n={"type": "integer"})
    schema = _obj(a={"oneOf": [b, _obj(True, kind={"const": "c"})]}, b={"oneOf": [b, _obj(True, kind={"const": "d"})]})
    assert share(schema) == (schema, 0)  # a $ref branch would hide that the branches are disjoint
    assert SO(json=schema, strict=True).warnings == []


def test_beside_a_one_of_what_llguidance_intersects_stays_inline(share_small):
    s = _obj(x={"type": "array", "items": {"type": "string"}})
    one_of = {"oneOf": [{"type": "string"}, {"type": "integer"}]}
    a, b = {"allOf": [s, {"required": ["x"]}]}, {"allOf": [s, _obj(y={"type": "null"})]}
    members = _obj(a=a, b=b, z=one_of)
    assert share(members) == (members, 0)
    referred = {"$defs": {"base": _obj(p=s, q=s, z=one_of)}, "allOf": [{"$ref": "#/$defs/base"}], "required": ["p"]}
    assert share(referred) == (referred, 0)  # base is intersected: its insides are read eagerly
    lazily = {"$defs": {"base": _obj(p=s, q=s, z=one_of)}, "$ref": "#/$defs/base"}
    shared, n = share(lazily)
    assert n == 1 and shared["$defs"]["base"]["properties"]["q"] == {"$ref": "#/$defs/_shared0"}
    # Without a oneOf nothing is proved disjoint: a reference llguidance intersects is resolved, exactly.
    members = _obj(a=a, b=b)
    shared, n = share(members)
    assert n == 1 and shared["properties"]["b"]["allOf"][0] == {"$ref": "#/$defs/_shared0"}
    assert "_shared0" in SO(json=members, strict=True).grammar_text
    _same_verdicts(members, shared)


def test_pointers_identifiers_and_existing_definitions():
    s = _obj(x={"type": "string"}, y={"type": "integer"})
    pinned = _obj(a=s, b=s, c=s, d={"$ref": "#/properties/a/properties/y"})
    shared, n = share(pinned)
    assert n == 1 and shared["properties"]["a"] == s  # a pointer reaches into it: it stays where it is
    assert shared["properties"]["b"] == shared["properties"]["c"] == {"$ref": "#/$defs/_shared0"}
    _same_verdicts(pinned, shared)
    with_id = {**_obj(a=s, b={**s, "$id": "https://example.com/b"}), "definitions": {}}
    assert share(with_id) == (with_id, 0)
    defined = {"definitions": {"s": s}, **_obj(a=s, b=s)}
    shared, n = share(defined)
    assert n == 1 and "$defs" not in shared and shared["properties"]["a"] == {"$ref": "#/definitions/s"}
    _same_verdicts(defined, shared)


def test_a_rewrite_llguidance_refuses_falls_back_to_the_schema_as_written(share_small):
    # Unsatisfiable where it is optional: llguidance leaves the key out inline, but refuses a $ref to it.
    unsat = {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"],
             "allOf": [{"properties": {"x": {"type": "integer"}}}]}
    schema = _obj(a=unsat, b=unsat, c={"type": "string"})
    assert share(schema)[1] == 1
    params = SO(json=schema)
    assert "_shared" not in params.grammar_text and params.warnings == []
    _same_verdicts(schema, share(schema)[0])


def test_a_shared_form_llguidance_raises_on_falls_back_too(monkeypatch):
    # Whatever llguidance makes of the shared text (here it cannot even parse it), the schema as written decides.
    import pagedserve.runtime.structured_outputs_params as params_module

    monkeypatch.setattr(params_module, "shared_schema_text", lambda schema, text: '{not json')
    params = SO(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    assert '"a"' in params.grammar_text and "not json" not in params.grammar_text


def test_a_small_schema_is_compiled_as_written():
    text = json.dumps(DETEKT)
    assert len(text) < schema_share.MIN_CHARS and schema_share.shared_schema_text(DETEKT, text) is None
    assert "_shared" not in SO(json=DETEKT).grammar_text
    big = {**DETEKT, "description": "x" * schema_share.MIN_CHARS}
    assert '"_shared0"' in schema_share.shared_schema_text(big, json.dumps(big))


def test_the_answer_for_a_schema_text_is_kept(monkeypatch):
    big = {**DETEKT, "description": "x" * schema_share.MIN_CHARS}
    text, calls = json.dumps(big), []
    monkeypatch.setattr(schema_share, "share_repeated_subschemas", lambda s: calls.append(s) or share(s))
    schema_share.clear_cache()
    first = schema_share.shared_schema_text(big, text)
    assert schema_share.shared_schema_text(big, text) is first and len(calls) == 1
    for i in range(schema_share.CACHE_SIZE):  # bounded: the oldest goes first
        other = {**big, "title": str(i)}
        schema_share.shared_schema_text(other, json.dumps(other))
    assert schema_share.shared_schema_text(big, text) == first and len(calls) == 2 + schema_share.CACHE_SIZE
    schema_share.clear_cache()


@pytest.mark.parametrize("schema", [True, {}, {"$defs": []}, {"type": "string"}])
def test_nothing_to_share_returns_the_schema_itself(schema):
    assert share(schema)[0] is schema
