"""Repeated sub-schemas of a JSON Schema written once, under `$defs`, and referenced: an exact rewrite that
makes llguidance's grammar smaller, so it compiles faster (issue #40).

llguidance builds a fresh piece of grammar for every sub-schema it meets inline, even when the same text
appears hundreds of times, while a `$ref` is built once and shared. SchemaStore's detekt-1.22.0.json has 266
rule objects, most of them the same `{"type": "object", "allOf": [{"$ref": "#/$defs/ruleProperties"}]}`:
written once, its grammar falls from 15,243 non-terminals to 5,367, and the token-level compile (LLMatcher)
from ~47 to ~21 ms, its validation from ~20 to ~13 ms with this rewrite's own ~4 ms (2 cores, best of 3).

    before   {"properties": {"a": S, "b": S}}           S: an object, array or combinator schema
    after    {"properties": {"a": {"$ref": "#/$defs/_shared0"}, "b": {"$ref": "#/$defs/_shared0"}},
              "$defs": {"_shared0": S}}

Replacing a sub-schema by a `$ref` to an identical copy in the same document changes nothing it means.
llguidance builds a reference met where a value is simply checked against it (a property's value, an
array's items, an `anyOf` branch) from the text it points to; where it intersects schemas (`allOf`, a `$ref`
beside other keywords) it resolves the reference first, which is exact too. The one place a reference costs
exactness is a `oneOf`: llguidance enforces it exactly only when it can prove its branches disjoint, and it
does not look through references to do so. So, in a schema with a `oneOf`, a sub-schema stays inline when
it lies below a node with `allOf` or `oneOf`, or with `$ref`, `anyOf`, `const` or `enum` beside other
keywords, or in what a reference from such a place points to (followed through the references found
there). In any schema, a sub-schema stays inline when it lies strictly inside what a local `$ref` points to
(a JSON pointer does not pass through a `$ref`), at the top of `$defs` / `definitions`, or when it holds
an identifier (`$id`, `$anchor`, `$dynamicRef`, ...); and nothing is shared when a sub-schema sets its own
base URI (`$id`, draft-04's `id`): relative references would move.

A repeated sub-schema equal to a top-level definition is pointed at that definition rather than copied.
Only objects, arrays and combinators are shared (a `{"type": "string"}` costs llguidance nothing to repeat),
and only in schemas of MIN_CHARS of JSON or more where at least MIN_SAVED of the sub-schemas would go:
finding the repeats costs 20-40 us per KB of JSON here, more than a small or barely repeating grammar saves. The
caller compiles the schema as written when llguidance refuses the rewrite (a reference to an unsatisfiable
schema is an error where the inline schema was left out; a recursive one may meet "circular references"),
and finished outputs are checked against the schema as the user wrote it (schema_check.py).
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from typing import Any
from urllib.parse import unquote

_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas", "dependencies")
_ONE = ("additionalProperties", "additionalItems", "items", "contains", "propertyNames", "not", "if", "then",
        "else", "unevaluatedProperties", "unevaluatedItems")
_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems", "items")
_DEFS = ("$defs", "definitions")
_SUBSCHEMA_KEYS = frozenset(_MAPS + _ONE + _LISTS)
# A sub-schema with one of these compiles to grammar rules (more than one lexeme): worth sharing.
_STRUCTURAL = frozenset({"properties", "patternProperties", "additionalProperties", "items", "prefixItems",
                         "allOf", "anyOf", "oneOf", "required"})
# Keys that give a sub-schema an identity of its own, or resolve against one.
_IDENTIFYING = frozenset({"$id", "$anchor", "$dynamicAnchor", "$recursiveAnchor", "$dynamicRef", "$recursiveRef"})
# What llguidance leaves out before it compiles a node (its META_AND_ANNOTATIONS).
_ANNOTATIONS = frozenset({"$anchor", "$defs", "definitions", "$schema", "$id", "id", "$comment", "title",
                          "description", "default", "readOnly", "writeOnly", "examples", "contentMediaType",
                          "contentEncoding"})
_APPLICATORS = frozenset({"$ref", "anyOf", "const", "enum", "allOf", "oneOf"})
_PLAIN_NAME = re.compile(r"[A-Za-z0-9_.-]+")
# Below this much JSON text, sharing saves llguidance at most ~1 ms, about what finding the repeats costs here.
MIN_CHARS = 16 * 1024
# Nor is a schema rewritten unless that may leave out this share of its sub-schemas (on JSONSchemaBench, a
# fifth or more gave llguidance's compile 9-60% less work, under a tenth about 1-3%, sometimes a few % more).
MIN_SAVED = 0.2
CACHE_SIZE = 32  # schema texts of MIN_CHARS .. 256 K characters: at most ~16 MB with their rewrites
_cache: OrderedDict[str, str | None] = OrderedDict()
_lock = threading.Lock()


def _children(node: dict) -> list[tuple[tuple, dict]]:
    """(where, sub-schema) for each sub-schema directly under `node`: where is (key,) or (key, name or index)."""
    out = []
    for k, v in node.items():
        if k in _MAPS and isinstance(v, dict):
            out += [((k, name), s) for name, s in v.items() if isinstance(s, dict)]
        elif k in _LISTS and isinstance(v, list):
            out += [((k, i), s) for i, s in enumerate(v) if isinstance(s, dict)]
        elif k in _ONE and isinstance(v, dict):
            out.append(((k,), v))
    return out


def _eager(node: dict) -> bool:
    """Whether llguidance reads the sub-schemas of `node` eagerly (intersects them, or proves them disjoint)."""
    if _APPLICATORS.isdisjoint(node):
        return False
    if "allOf" in node or "oneOf" in node:
        return True
    return sum(1 for k in node if k not in _ANNOTATIONS) > 1


def _step(where: tuple) -> str:
    """The JSON pointer step(s) of `where`: ("properties", "a/b") -> "/properties/a~1b"."""
    return "".join("/" + (p.replace("~", "~0").replace("/", "~1") if isinstance(p, str) and ("~" in p or "/" in p)
                          else str(p)) for p in where)


def _prefixes(pointer: str) -> list[str]:
    """"#/a/b" -> ["#", "#/a", "#/a/b"]."""
    parts = pointer.rstrip("/").split("/")
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _inside(pointer: str, targets: set[str]) -> bool:
    """Whether `pointer` is one of `targets` or below one."""
    if not targets:
        return False
    if pointer in targets:
        return True
    i = pointer.find("/")
    while i != -1:
        if pointer[:i] in targets:
            return True
        i = pointer.find("/", i + 1)
    return False


def _data(value: Any) -> Any:
    """A hashable stand-in for a value that is data (`enum`, `default`, ...): equal only when the JSON is."""
    kind = type(value)
    if kind is str:
        return value
    if kind in (int, float, bool) or value is None:
        return (kind.__name__, value)
    if kind is list and all(type(v) is str for v in value):
        return ("strings",) + tuple(value)
    return ("json", json.dumps(value, sort_keys=True))


class _Scan:
    """One pass over the sub-schemas: each one's pointer, whether it lies below an eager node, and a number
    that equal sub-schemas share (a JSON text per node would cost size x depth)."""

    def __init__(self, schema: dict) -> None:
        self.nodes: list[tuple[dict, str, bool, int]] = []  # (node, pointer, frozen, number), parents first
        self.number: dict[int, int] = {}  # id() of each sub-schema -> its number
        self.identifying: set[int] = set()  # numbers of sub-schemas holding an identifying key
        self.kids: dict[int, list[int]] = {}  # number -> the numbers of its direct sub-schemas
        self._table: dict[tuple, int] = {}
        self._visit(schema, "#", False)

    def _visit(self, node: dict, pointer: str, frozen: bool) -> int:
        if _SUBSCHEMA_KEYS.isdisjoint(node):  # a leaf (most are)
            n = self._table.setdefault(tuple(sorted([(k, v if type(v) is str else _data(v)) for k, v in node.items()])),
                                       len(self._table))
            self.nodes.append((node, pointer, frozen, n))
            self.number[id(node)] = n
            if n not in self.kids:
                self.kids[n] = []
                if not _IDENTIFYING.isdisjoint(node):
                    self.identifying.add(n)
            return n
        at = len(self.nodes)
        self.nodes.append((node, pointer, frozen, -1))
        below = frozen or _eager(node)
        parts, kids = [], []
        for k, v in node.items():
            if k in _MAPS and isinstance(v, dict):
                f = False if k in _DEFS else below
                sub: Any = ("map",) + tuple(sorted(
                    (name, self._visit(s, pointer + _step((k, name)), f) if isinstance(s, dict) else _data(s))
                    for name, s in v.items()))
                kids += [x[1] for x in sub[1:]]
            elif k in _LISTS and isinstance(v, list):
                sub = ("list",) + tuple(self._visit(s, f"{pointer}/{k}/{i}", below) if isinstance(s, dict)
                                        else _data(s) for i, s in enumerate(v))
                kids += sub[1:]
            elif k in _ONE and isinstance(v, dict):
                sub = self._visit(v, f"{pointer}/{k}", below)
                kids.append(sub)
            else:
                sub = _data(v)
            parts.append((k, sub))
        parts.sort()
        n = self._table.setdefault(tuple(parts), len(self._table))
        self.number[id(node)] = n
        self.nodes[at] = (node, pointer, frozen, n)
        if n not in self.kids:
            self.kids[n] = kids = [c for c in kids if type(c) is int]
            if not _IDENTIFYING.isdisjoint(node) or self.identifying and any(c in self.identifying for c in kids):
                self.identifying.add(n)
        return n


def shared_schema_text(schema: Any, text: str) -> str | None:
    """The JSON text of `schema` with its repeats shared, for llguidance; None when `text` (the schema's own
    JSON text) is shorter than MIN_CHARS or nothing is shared. The answers for the last CACHE_SIZE texts
    are kept: a client sends the same schema request after request, and each is validated."""
    if len(text) < MIN_CHARS:
        return None
    with _lock:
        if text in _cache:
            _cache.move_to_end(text)
            return _cache[text]
    shared, n = share_repeated_subschemas(schema)
    out = json.dumps(shared) if n else None
    with _lock:
        _cache[text] = out
        while len(_cache) > CACHE_SIZE:
            _cache.popitem(last=False)
    return out


def clear_cache() -> None:
    """Forget the answers kept (a benchmark timing cold validation calls this)."""
    with _lock:
        _cache.clear()


def share_repeated_subschemas(schema: Any) -> tuple[Any, int]:
    """A copy of `schema` with each sub-schema that occurs more than once where llguidance builds references
    lazily moved to `$defs` (or its `definitions`) and referenced, and how many were moved; `schema` itself
    when there is nothing to share."""
    if not isinstance(schema, dict):
        return schema, 0
    try:
        return _share(schema)
    except RecursionError:  # nested deeper than Python recurses: left as written
        return schema, 0


def _share(schema: dict) -> tuple[Any, int]:
    scan = _Scan(schema)
    nodes = scan.nodes
    seen: set[int] = set()
    if not any(key in seen or seen.add(key) for n, p, _, key in nodes if not _STRUCTURAL.isdisjoint(n)):
        return schema, 0  # no sub-schema worth sharing occurs twice (most schemas)
    if any(p != "#" and (isinstance(n.get("$id"), str) or isinstance(n.get("id"), str)) for n, p, *_ in nodes):
        return schema, 0
    refs = [(n, p, f, unquote(n["$ref"])) for n, p, f, _ in nodes
            if isinstance(n.get("$ref"), str) and n["$ref"].startswith("#")]
    pinned = {q for *_, t in refs for q in _prefixes(t)[:-1]}  # holds a reference's target strictly inside
    # Only a oneOf's proof of disjointness loses exactness by meeting a reference: without one, a reference
    # that llguidance intersects is resolved to what it would have read inline (or refused: see the caller).
    one_of = any("oneOf" in n for n, *_ in nodes)
    eager_targets = {t for n, p, f, t in refs if one_of and (f or _eager(n))}  # read eagerly,
    rest = [(p, t) for n, p, f, t in refs if t not in eager_targets]  # followed through references
    while rest:
        found = {t for p, t in rest if _inside(p, eager_targets)}
        if not found:
            break
        eager_targets |= found
        rest = [(p, t) for p, t in rest if t not in eager_targets]

    def lazy(pointer: str, frozen: bool) -> bool:
        return not (frozen and one_of) and pointer not in pinned and not _inside(pointer, eager_targets)

    top_defs = {"#" + _step((k, name)) for k in _DEFS if isinstance(schema.get(k), dict) for name in schema[k]}
    defined: dict[int, str] = {}  # a top-level definition -> its pointer
    counts: dict[int, int] = {}
    for n, p, f, key in nodes:
        if p in top_defs:
            if _PLAIN_NAME.fullmatch(p.rsplit("/", 1)[1]):
                defined.setdefault(key, p)
        elif p != "#" and not _STRUCTURAL.isdisjoint(n) and lazy(p, f):
            counts[key] = counts.get(key, 0) + 1
    repeated = {k for k, c in counts.items() if c > 1 and k not in scan.identifying}
    sizes: dict[int, int] = {}

    def size(key: int) -> int:  # sub-schemas in it, itself included
        if key not in sizes:
            sizes[key] = 1 + sum(size(c) for c in scan.kids[key])
        return sizes[key]

    if sum((counts[k] - 1) * size(k) for k in repeated) < MIN_SAVED * len(nodes):
        return schema, 0  # too little to matter to llguidance (an upper bound: nested repeats count twice)
    defs_key = "$defs" if "$defs" in schema or "definitions" not in schema else "definitions"
    if not isinstance(schema.get(defs_key, {}), dict):
        return schema, 0
    taken = set(schema.get(defs_key, {}))

    def write(chosen: set[int]) -> tuple[dict, dict[str, Any], dict[int, int]]:
        """The document with the sub-schemas numbered in `chosen` referenced, its new definitions, and how
        many references each number got."""
        new_defs: dict[str, Any] = {}
        pointers: dict[int, str] = {}
        uses: dict[int, int] = {}
        holds: dict[int, bool] = {}  # number -> whether it is chosen or holds one that is

        def holding(key: int) -> bool:
            if key not in holds:
                holds[key] = key in chosen or any(holding(c) for c in scan.kids[key])
            return holds[key]

        def pointer_for(key: int, node: dict) -> str:
            uses[key] = uses.get(key, 0) + 1
            if key in defined:
                return defined[key]
            if key not in pointers:
                name = next(f"_shared{i}" for i in range(len(taken) + len(new_defs) + 1)
                            if f"_shared{i}" not in taken and f"_shared{i}" not in new_defs)
                pointers[key] = "#" + _step((defs_key, name))
                new_defs[name] = None  # reserved; filled below (its own repeats shared too)
                new_defs[name] = rewrite(node, None, False)
            return pointers[key]

        def rewrite(node: dict, pointer: str | None, frozen: bool) -> dict:
            """pointer: where `node` is in the document (None inside a new definition: nothing points there,
            and every place it was copied from was checked)."""
            out = dict(node)
            eager = _eager(node)
            for where, child in _children(node):
                key = scan.number[id(child)]
                if not holding(key):
                    continue  # nothing to share below: the same object
                sub = None if pointer is None else pointer + _step(where)
                below = False if where[0] in _DEFS else frozen or eager
                if key in chosen and (lazy(sub, below) and sub not in top_defs if sub else not (below and one_of)):
                    new = {"$ref": pointer_for(key, child)}
                else:
                    new = rewrite(child, sub, below)
                if len(where) == 1:
                    out[where[0]] = new
                else:
                    k, name = where
                    if out[k] is node[k]:
                        out[k] = dict(out[k]) if isinstance(out[k], dict) else list(out[k])
                    out[k][name] = new
            return out

        return rewrite(schema, "#", False), new_defs, uses

    out, new_defs, uses = write(repeated)
    # A sub-schema repeated only inside one that is now written once is referenced once: leave it inline.
    kept = {k for k, n in uses.items() if n > 1 or k in defined}
    if kept != set(uses):
        out, new_defs, uses = write(kept)
    if not uses:
        return schema, 0
    if new_defs:
        out[defs_key] = {**out.get(defs_key, {}), **new_defs}
    return out, len(uses)
