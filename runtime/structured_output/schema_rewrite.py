"""An exact rewrite of JSON Schema `allOf` over plain object schemas, for what llguidance cannot intersect.

llguidance intersects `allOf` members (and a `$ref` with sibling keys) itself, but not when the referenced
definition lies on a cycle of references ("circular references with sibling keys are not supported"):
the Washington Post ANS schemas refine a recursive `utils_reference` that way::

    {"allOf": [{"$ref": "#/definitions/utils_reference"},
               {"properties": {"referent": {"properties": {"type": {"enum": ["site"]}}}}}]}

When every member of such an `allOf` is an object schema made only of `type: "object"`, `properties`,
`required`, `additionalProperties` and annotations (a local `$ref` to one counts: its definition's
top level is copied, its own `$ref`s stay references), the intersection is written out here as one
object schema, which is exactly what the `allOf` means:

    key k allowed         when every member allows it (its `properties[k]`, else its `additionalProperties`)
    value of k            `{"allOf": [what each member says of k]}` (one member: that schema)
    additionalProperties  false if any member says false; else the members' schemas, all of them
    required              the union
    type                  "object" when a member says so (a member without `type` lets non-objects through)

Beside a `$ref`, `anyOf` or `oneOf`, llguidance intersects every sibling key too, which fails the same
way when the references are circular. Two kinds of sibling say nothing, and are dropped: annotations
(`description`, `title`, `$schema`, ...), and a `type` that every branch already declares (a `$ref` to
an object definition beside `"type": "object"`).

Anything else (`patternProperties`, `$ref` siblings, non-object types, a remote `$ref`) leaves the node
as it was. The rewrite is used only as a second try, after llguidance refused the schema as written, so a
schema that compiles today compiles to the same grammar; the finished output is still checked against the
schema as the user wrote it (schema_check.py).
"""

from __future__ import annotations

from typing import Any

_ANNOTATIONS = frozenset({"$schema", "$comment", "title", "description", "examples", "default", "deprecated",
                          "readOnly", "writeOnly"})
_OBJECT_KEYS = frozenset({"type", "properties", "required", "additionalProperties"}) | _ANNOTATIONS
_LITERALS = frozenset({"enum", "const", "default", "examples"})  # values that are data, not schemas


def _resolve(ref: Any, root: Any) -> Any:
    """The target of a local JSON pointer `#/a/b`, or None."""
    if not isinstance(ref, str) or not ref.startswith("#/"):
        return None
    node = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def _object_member(member: Any, root: Any) -> dict | None:
    """`member` as a plain object schema (a local `$ref` to one resolved), or None when it is anything else."""
    if isinstance(member, dict) and set(member) == {"$ref"}:
        member = _resolve(member["$ref"], root)
    if not isinstance(member, dict) or not set(member) <= _OBJECT_KEYS or member.get("type", "object") != "object":
        return None
    props, required = member.get("properties", {}), member.get("required", [])
    if not isinstance(props, dict) or not isinstance(required, list):
        return None
    return member


def _all(schemas: list[Any]) -> Any:
    """The conjunction of `schemas` (JSON Schema booleans folded in)."""
    if any(s is False for s in schemas):
        return False
    rest = [s for s in schemas if s is not True and s != {}]
    if not rest:
        return True
    return rest[0] if len(rest) == 1 else {"allOf": rest}


def _declared_types(node: Any, root: Any, seen: frozenset = frozenset()) -> set[str] | None:
    """The JSON types `node` admits, when it declares them (itself, through local $refs, or in every branch)."""
    if not isinstance(node, dict):
        return None
    if "$ref" in node:
        ref = node["$ref"]
        return None if ref in seen else _declared_types(_resolve(ref, root), root, seen | {ref})
    if "type" in node:
        t = node["type"]
        return {t} if isinstance(t, str) else set(t) if isinstance(t, list) and t else None
    for key in ("anyOf", "oneOf"):
        branches = node.get(key)
        if isinstance(branches, list) and branches:
            types = [_declared_types(b, root, seen) for b in branches]
            return None if any(t is None for t in types) else set().union(*types)
    return None


def _drop_silent_siblings(node: dict, root: Any) -> dict:
    combiners = [k for k in ("$ref", "anyOf", "oneOf") if k in node]
    if len(combiners) != 1 or node is root:
        return node
    out = {k: v for k, v in node.items() if k not in _ANNOTATIONS}
    t = out.get("type")
    if isinstance(t, str):
        allowed = {t, "integer"} if t == "number" else {t}
        types = _declared_types({combiners[0]: out[combiners[0]]}, root)
        if types is not None and types <= allowed:
            del out["type"]
    return out


def _intersect(members: list[dict], notes: dict) -> dict:
    keys: list[str] = []
    for m in members:
        keys += [k for k in m.get("properties", {}) if k not in keys]
    props = {}
    for k in keys:
        props[k] = _all([m["properties"][k] if k in m.get("properties", {}) else m.get("additionalProperties", True)
                         for m in members])
    out: dict[str, Any] = {k: v for k, v in notes.items() if k in _ANNOTATIONS}
    if any("type" in m for m in members):  # without one, a non-object passes every member, and the result
        out["type"] = "object"
    if props:
        out["properties"] = props
    required: list[str] = []
    for m in members:
        required += [r for r in m.get("required", []) if r not in required]
    if required:
        out["required"] = required
    extra = _all([m.get("additionalProperties", True) for m in members])
    if extra is not True:
        out["additionalProperties"] = extra
    return out


def flatten_all_of(schema: Any) -> Any:
    """A copy of `schema` with every `allOf` over plain object schemas written out as one object schema, and the
    silent siblings of `$ref`, `anyOf` and `oneOf` dropped."""
    root = schema

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = _drop_silent_siblings({k: (v if k in _LITERALS else walk(v)) for k, v in node.items()}, root)
        members = out.get("allOf")
        if not isinstance(members, list) or not members:
            return out
        own = {k: v for k, v in out.items() if k != "allOf"}
        parts = [_object_member(m, root) for m in members] + ([_object_member(own, root)] if own else [])
        if any(p is None for p in parts):
            return out
        return _intersect(parts, own)

    return walk(schema)


def drop_overlapping_pattern_properties(schema: Any) -> tuple[Any, int]:
    """A copy of `schema` without the `patternProperties` of objects where a pattern also matches a declared
    property (llguidance intersects the two schemas for that key, which fails when they recurse), and how
    many were dropped. Not exact: the keys those patterns governed are then held only by
    `additionalProperties` (the lenient compile reports it, and the output is checked against the schema)."""
    import re

    dropped = 0

    def overlaps(node: dict) -> bool:
        patterns, props = node.get("patternProperties"), node.get("properties")
        if not isinstance(patterns, dict) or not isinstance(props, dict):
            return False
        for pattern in patterns:
            try:
                if any(re.search(pattern, key) for key in props):
                    return True
            except (re.error, TypeError):
                return True  # a pattern Python cannot read: llguidance will intersect it with something
        return False

    def walk(node: Any) -> Any:
        nonlocal dropped
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: (v if k in _LITERALS else walk(v)) for k, v in node.items()}
        if overlaps(out):
            del out["patternProperties"]
            dropped += 1
        return out

    return walk(schema), dropped
