"""Recursive schemas llguidance will not intersect (issue #40): the exact rewrite keeps their meaning, the
lenient fallback says what it left unenforced, strict names it, and what cannot be rewritten is refused."""

from __future__ import annotations

import jsonschema
import pytest

from pagedserve.runtime.structured_output.schema_rewrite import (
    drop_overlapping_pattern_properties,
    flatten_all_of,
)
from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams as SO


def _node(kids_items: dict) -> dict:
    return {"type": "object", "properties": {"name": {"type": "string"},
                                             "kids": {"type": "array", "items": kids_items}}}


# A tree whose children are refs with a redundant `type` beside them: llguidance refuses it as written.
TYPED_REF = {"definitions": {"node": _node({"$ref": "#/definitions/node", "type": "object"})},
             "$ref": "#/definitions/node"}
NODE = {"type": "object", "additionalProperties": False, "required": ["name"],
        "properties": {"name": {"type": "string"}, "kids": {"type": "array", "items": {"$ref": "#/definitions/ref"}}}}
REF = {"type": "object", "additionalProperties": False,
       "properties": {"id": {"type": "string"}, "node": {"$ref": "#/definitions/node"}}}
EITHER = {"anyOf": [{"$ref": "#/definitions/node"}, {"$ref": "#/definitions/ref"}]}
# patternProperties whose pattern also matches the declared, recursive "kids" (as the Washington Post ANS
# schemas' credits do): llguidance intersects the two and gives up.
OVERLAP = {"definitions": {"node": NODE, "ref": REF}, "type": "object",
           "properties": {"kids": {"type": "array", "items": EITHER}},
           "patternProperties": {"^k": {"type": "array", "items": EITHER}}}
# A refinement of the recursive definition itself: no finite rewrite; refused.
REFINED = {"definitions": {"node": _node({"allOf": [{"$ref": "#/definitions/node"},
                                                    {"properties": {"name": {"maxLength": 4}}}]})},
           "$ref": "#/definitions/node"}

INSTANCES = [
    {}, {"name": "a"}, {"name": 3}, {"name": "a", "kids": [{"name": "b"}, {"name": "c", "kids": []}]},
    {"name": "a", "kids": [1]}, {"name": "a", "kids": [{"name": 2}]}, {"id": "x"}, {"id": "x", "extra": 1},
    {"id": "much too long", "node": {"name": "n"}}, {"id": "x", "node": {"name": "n", "kids": [{"id": "y"}]}},
    {"kids": [{"id": "y"}], "kx": [{"name": "n"}]}, {"kx": [5]}, [], "text", 7, None,
]


def _same_verdicts(a: dict, b: dict) -> None:
    va, vb = jsonschema.Draft7Validator(a), jsonschema.Draft7Validator(b)
    for instance in INSTANCES:
        assert va.is_valid(instance) == vb.is_valid(instance), instance


def test_a_redundant_type_beside_a_recursive_ref_is_dropped_exactly():
    rewritten = flatten_all_of(TYPED_REF)
    assert rewritten["definitions"]["node"]["properties"]["kids"]["items"] == {"$ref": "#/definitions/node"}
    _same_verdicts(TYPED_REF, rewritten)
    for strict in (False, True):  # exact: accepted either way, nothing to warn about or to check
        params = SO(json=TYPED_REF, strict=strict)
        assert params.warnings == [] and params.check_schema is None


def test_all_of_over_object_schemas_is_written_out_as_their_intersection():
    schema = {"definitions": {"node": NODE, "ref": REF}, "type": "object",
              "properties": {"sel": {"allOf": [{"$ref": "#/definitions/ref"},
                                               {"properties": {"id": {"maxLength": 8}}, "required": ["id"]}]}}}
    sel = flatten_all_of(schema)["properties"]["sel"]
    assert "allOf" not in sel and sel["additionalProperties"] is False and sel["required"] == ["id"]
    assert sel["properties"]["id"] == {"allOf": [{"type": "string"}, {"maxLength": 8}]}
    for instance in INSTANCES:  # the rewritten member means what the allOf meant
        expect = jsonschema.Draft7Validator({"definitions": schema["definitions"],
                                             **schema["properties"]["sel"]}).is_valid(instance)
        assert jsonschema.Draft7Validator({"definitions": schema["definitions"], **sel}).is_valid(instance) == expect


def test_a_member_it_cannot_read_leaves_the_all_of_alone():
    schema = {"allOf": [{"type": "object", "patternProperties": {"^a": {"type": "string"}}},
                        {"properties": {"b": {"type": "integer"}}}]}
    assert flatten_all_of(schema) == schema
    assert drop_overlapping_pattern_properties(schema) == (schema, 0)  # no declared key matches "^a"


def test_overlapping_pattern_properties_are_left_unenforced_leniently_and_checked():
    params = SO(json=OVERLAP)
    assert [w.split(":")[0] for w in params.warnings] == ["patternProperties"], params.warnings
    assert params.check_schema == OVERLAP  # finished outputs are checked against the schema as written
    with pytest.raises(ValueError, match=r"structured_outputs\.json uses patternProperties, which cannot be "
                                         r"enforced exactly \(strict\)"):
        SO(json=OVERLAP, strict=True)


def test_a_recursive_refinement_is_refused_either_way_with_llguidances_reason():
    for strict in (False, True):
        with pytest.raises(ValueError, match=r"structured_outputs\.json is not a valid JSON Schema: circular "
                                             r"references with sibling keys"):
            SO(json=REFINED, strict=strict)
