"""JSON Schemas with what llguidance cannot enforce exactly (issue #40): accepted by default with a warning
naming the keyword, refused under strict naming it, and a finished output checked against the whole schema
(a violation flagged on the output, never passed as valid)."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

import engine_helpers
from structured_schemas import SCHEMAS

from pagedserve.runtime.sampling_params import SamplingParams
from pagedserve.runtime.structured_output.schema_check import MAX_VIOLATIONS, violations
from pagedserve.runtime.structured_outputs_params import MAX_WARNINGS, StructuredOutputsParams as SO
from pagedserve.sidecar.pb import generation_pb2 as pb
from pagedserve.sidecar.servicer import structured_outputs_from_proto

make_engine = functools.partial(engine_helpers.make_engine, max_num_batched_tokens=256, num_kv_blocks=256)

OPT = {"a": {"type": "string", "maxLength": 4}, "b": {"type": "integer"}}  # both optional

# The reasons real-world schemas were refused before #40, each with the keyword a warning must name.
REFUSED_BEFORE = {
    "format url": ({"type": "object", "properties": {"home": {"type": "string", "format": "url"}}}, "format", "url"),
    "format topic": ({"type": "string", "format": "topic"}, "format", "topic"),
    "format date-type": ({"type": "string", "format": "date-type"}, "format", "date-type"),
    "oneOf": ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              "oneOf", "anyOf"),
    "not": ({"type": "object", "properties": OPT, "not": {"required": ["a", "b"]}}, "not", "not enforced"),
    "dependencies": ({"type": "object", "properties": OPT, "dependencies": {"a": ["b"]}}, "dependencies", ""),
    "minProperties": ({"type": "object", "properties": OPT, "minProperties": 1}, "minProperties", "optional"),
    "maxProperties": ({"type": "object", "properties": OPT, "maxProperties": 1}, "maxProperties", "optional"),
}


@pytest.mark.parametrize("name", list(REFUSED_BEFORE))
def test_lenient_accepts_and_warns_naming_the_keyword(name):
    schema, keyword, detail = REFUSED_BEFORE[name]
    params = SO(json=schema)
    assert any(w.startswith(f"{keyword}: ") and detail in w for w in params.warnings), params.warnings
    assert params.check_schema == schema  # its outputs will be checked against the whole schema
    assert structured_outputs_from_proto(pb.StructuredOutputs(json_schema=json.dumps(schema))).warnings == \
        params.warnings


@pytest.mark.parametrize("name", list(REFUSED_BEFORE))
def test_strict_refuses_naming_the_keyword(name):
    schema, keyword, _ = REFUSED_BEFORE[name]
    with pytest.raises(ValueError, match=rf"structured_outputs\.json uses {keyword}\b.*cannot be enforced "
                                         rf"exactly \(strict\)") as e:
        SO(json=schema, strict=True)
    assert len(str(e.value)) < 320
    with pytest.raises(ValueError, match=rf"uses {keyword}\b"):  # the wire's strict flag
        structured_outputs_from_proto(pb.StructuredOutputs(json_schema=json.dumps(schema), strict=True))


def test_strict_keeps_a_schemas_own_x_guidance_from_loosening_it():
    schema = {"type": "string", "format": "url", "x-guidance": {"lenient": True}}
    with pytest.raises(ValueError, match="uses format"):
        SO(json=schema, strict=True)


def test_exactly_enforced_schemas_carry_no_warning():
    for name, schema in SCHEMAS.items():  # known formats, anyOf, $ref, patterns: all enforced
        params = SO(json=schema)
        assert params.warnings == [] and params.check_schema is None, name
        assert SO(json=schema, strict=True).warnings == [], name  # strict takes them as they are
    assert SO(json_object=True, strict=True).warnings == []
    disjoint = {"oneOf": [{"type": "string"}, {"type": "integer"}]}  # llguidance enforces this oneOf exactly
    assert SO(json=disjoint).warnings == [] and SO(json=disjoint, strict=True).warnings == []


def test_a_broken_schema_is_refused_either_way():
    for strict in (False, True):
        with pytest.raises(ValueError, match="is not a valid JSON Schema: Invalid type: strin"):
            SO(json={"type": "strin"}, strict=strict)


def test_strict_is_a_bool_and_for_json_only():
    with pytest.raises(ValueError, match=r"structured_outputs\.strict must be a bool"):
        SO(json={"type": "object"}, strict="yes")
    with pytest.raises(ValueError, match=r"structured_outputs\.strict applies to json and json_object only"):
        SO(regex="a+", strict=True)
    with pytest.raises(ValueError, match=r"structured_outputs\.strict applies"):
        structured_outputs_from_proto(pb.StructuredOutputs(choice=pb.Choice(options=["a"]), strict=True))
    assert SO(regex="a+", strict=False).kind == "regex"


def test_warnings_are_deduplicated_and_bounded():
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string", "format": f"fmt{i}"} for i in range(40)}}
    params = SO(json=schema)
    assert len(params.warnings) == MAX_WARNINGS and len(set(params.warnings)) == MAX_WARNINGS
    twice = {"type": "array", "items": {"type": "string", "format": "url"}, "contains": {"format": "url"}}
    assert SO(json=twice).warnings.count("format: 'url' is not a known format; not checked") == 1


# -- the finished output against the whole schema ---------------------------------------------------


def test_violations_name_the_path_and_the_rule():
    dep = SO(json=REFUSED_BEFORE["dependencies"][0])
    assert violations(dep, '{"a": "x"}') == ["$: 'b' is a dependency of 'a'"]  # draft-07's keyword, read
    assert violations(dep, '{"a": "x", "b": 1}') == []
    one_of = SO(json=REFUSED_BEFORE["oneOf"][0])
    assert violations(one_of, '{"a": "x", "b": 1}')[0].startswith("$: ")  # matches both branches
    assert violations(one_of, '{"a": "x"}') == []
    fmt = SO(json={"type": "string", "format": "url"})
    assert violations(fmt, '"not a url at all"') == []  # an unknown format is an annotation
    nested = SO(json={"type": "object", "properties": {"xs": {"type": "array", "uniqueItems": True}}})
    assert violations(nested, '{"xs": [1, 1]}') == ["$['xs']: [1, 1] has non-unique elements"]
    assert violations(nested, '{"xs": [1,').pop().startswith("not valid JSON: ")
    many = SO(json={"type": "array", "items": {"type": "integer", "not": {"type": "integer"}}})
    assert len(violations(many, json.dumps(list(range(20))))) == MAX_VIOLATIONS
    assert violations(SO(json=SCHEMAS["person"]), "{}") == []  # enforced exactly: nothing to check
    assert violations(None, "x") == []


def test_a_broken_not_is_flagged_on_the_output(tiny):
    engine = make_engine(tiny)
    broken = {"type": "string", "enum": ["yes"], "not": {"const": "yes"}}  # "yes" is all the grammar allows
    kept = {"type": "string", "enum": ["yes"], "not": {"const": "no"}}
    for rid, schema in (("broken", broken), ("kept", kept)):
        engine.add_request(rid, [5, 6, 7], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=16,
                                                          structured_outputs=SO(json=schema)))
    engine.add_request("exact", [5, 6], SamplingParams(max_tokens=16, structured_outputs=SO(json={"enum": ["ok"]})))
    seen = []  # every output, streamed deltas too: a sample's last one carries its check
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        seen.extend(engine.step())
    out = {o.request_id: o for o in seen if o.finished}
    for o in seen:
        assert o.warnings == ([] if o.request_id == "exact" else ["not: not enforced"])
        for c in o.outputs:
            if c.finish_reason == "stop":
                assert bool(c.schema_violations) == (o.request_id == "broken"), (o.request_id, c)
    for rid in ("broken", "kept"):
        assert out[rid].warnings == ["not: not enforced"]
        for c in out[rid].outputs:
            assert c.text == '"yes"' and c.finish_reason == "stop", c
    assert all(c.schema_violations == ["$: 'yes' should not be valid under {'const': 'yes'}"]
               for c in out["broken"].outputs)
    assert all(c.schema_violations == [] for c in out["kept"].outputs)
    assert out["exact"].warnings == [] and out["exact"].outputs[0].schema_violations == []
    assert engine.kv_manager.usage().num_used_blocks == 0


def test_bench_corpus_mode(tmp_path):
    """bench/structured.py --corpus: per dataset the shares compiled (lenient, strict) and valid, and timings."""
    corpus = tmp_path / "corpus"
    (corpus / "issue40").mkdir(parents=True)
    (corpus / "house").mkdir()
    for name, (schema, *_) in REFUSED_BEFORE.items():
        (corpus / "issue40" / f"{name.replace(' ', '_')}.json").write_text(json.dumps(schema))
    (corpus / "issue40" / "broken.json").write_text('{"type": "strin"}')
    for name in list(SCHEMAS)[:3]:
        (corpus / "house" / f"{name}.json").write_text(json.dumps(SCHEMAS[name]))
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run([sys.executable, str(root / "bench" / "structured.py"), "--quick", "--corpus", str(corpus),
                           "--model", str(root / "tests" / "data" / "tiny-llama"), "--out-dir", str(tmp_path / "out"),
                           "--max-tokens", "24"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    assert record == json.loads((tmp_path / "out" / "structured_corpus.json").read_text())
    issue, house = record["results"]["issue40"], record["results"]["house"]
    assert (issue["schemas"], issue["compiled"], issue["strict_accepted_share"]) == (9, 8, 0.0)
    assert issue["refusals"] == {"is not a valid JSON Schema: Invalid type: strin": 1}
    assert set(issue["approximated_keywords"]) == {"format", "oneOf", "not", "dependencies", "minProperties",
                                                   "maxProperties"}
    assert house["compiled_share"] == house["strict_accepted_share"] == 1.0 and house["with_warnings"] == 0
    for row in (issue, house):
        assert row["invalid_unflagged"] == 0 and 0 < row["compile_ms_p50"] <= row["compile_ms_p99"]
        assert row["mask_us_per_token"] > 0
    assert record["summary"]["schemas"] == 12 and record["summary"]["invalid_unflagged"] == 0


def test_compile_logs_the_keywords_and_prepares_the_check_off_the_step(tiny):
    from structlog.testing import capture_logs

    engine = make_engine(tiny)
    params = SO(json=REFUSED_BEFORE["dependencies"][0])
    with capture_logs() as logs:
        engine.structured.compile(params).result(timeout=30)
        engine.structured.compile(SO(json=SCHEMAS["person"])).result(timeout=30)  # exact: no line
    lines = [e for e in logs if e["event"] == "structured_outputs.not_enforced_exactly"]
    assert len(lines) == 1 and lines[0]["keywords"] == ["dependencies"] and lines[0]["log_level"] == "warning"
    engine.structured.compiler._pool.submit(lambda: None).result(timeout=30)  # one worker, in order: prepared
    assert "_schema_validator" in params.__dict__


def test_a_schema_jsonschema_cannot_apply_flags_the_output_unchecked():
    params = SO(json={"type": "string", "pattern": r"^\p{L}+$", "not": {"const": "x"}})  # llguidance's regex
    assert params.warnings == ["not: not enforced"]
    (flag,) = violations(params, '"abc"')
    assert flag.startswith("not checked against the schema: error: bad escape")


def test_a_schema_may_turn_leniency_off_itself():
    with pytest.raises(ValueError, match=r"uses not, which cannot be enforced exactly \(its x-guidance turns"):
        SO(json={"type": "string", "not": {"const": "x"}, "x-guidance": {"lenient": False}})
