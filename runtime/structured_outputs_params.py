"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names).

Exactly one of these is set:

    json         a JSON Schema, as a dict or a JSON string      {"type": "object", ...}
    regex        a regular expression the whole output matches  r"\\d{4}-\\d{2}-\\d{2}"
    choice       the output is exactly one of these strings     ["yes", "no"]
    grammar      a Lark grammar (llguidance's dialect) or GBNF  'start: "a"+'
    json_object  True: any JSON object

and, for json / json_object, ``strict`` (OpenAI's ``json_schema.strict``; default False).

JSON Schemas are compiled leniently by default: what llguidance cannot enforce exactly is approximated
or left unenforced, never refused, and each such case is kept in ``warnings`` ("keyword: what happens"),
which the engine logs and the outputs carry (RequestOutput.warnings, the sidecar's first chunk):

    format "url" (unknown)            ignored: any string (JSON Schema 2020-12: format is an annotation)
    oneOf                             approximated as anyOf (a value matching two branches gets through)
    not, dependencies, if/then/else,  not enforced
    uniqueItems, contains, ...
    min/maxProperties on optional keys  not enforced
    patternProperties that also match   not enforced, where the schemas recurse (llguidance cannot
      a declared property                 intersect circular references: runtime/structured_output/
                                          schema_rewrite.py, which first tries an exact rewrite)

An output of such a schema is checked against the whole schema once it finishes (schema_check.py) and a
violation is reported on it (CompletionOutput.schema_violations), never passed as valid. ``strict=True``
refuses such a schema instead, naming the keyword. A schema that is wrong (an unknown type, a missing
$ref) is refused either way.

Validation happens here, at construction, without the model's tokenizer (a fraction of a millisecond
for the grammars people write): a bad schema, regex or grammar raises ValueError naming the field and
quoting llguidance's own message, so the sidecar answers INVALID_ARGUMENT before the request takes any
KV block. The llguidance grammar built on the way is kept (``grammar_text``) for the engine's compiler
(runtime/structured_output/grammar_compiler.py), which builds the token-level matcher off the step loop.

JSON formatting: outputs are compact JSON with Python's separators (``", "`` and ``": "``) and no other
whitespace. llguidance's default lets whitespace go anywhere, and a sampling model can then fill
max_tokens with newlines; a schema may still ask for that through its ``"x-guidance"`` key.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from .structured_output.schema_share import shared_schema_text

# Longest constraint text accepted (schema, regex, grammar, or all choices together), in characters.
MAX_CONSTRAINT_CHARS = 256 * 1024
# llguidance's error messages can quote a whole grammar; this much is enough to find the mistake.
MAX_ERROR_CHARS = 200
# Defaults of the JSON Schema compiler (a schema's own "x-guidance" key overrides them).
JSON_COMPILE_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Lenient by default (unknown formats, unimplemented keywords and oneOf become warnings); strict overrides
# the schema's own "x-guidance" so that nothing is approximated.
JSON_LENIENT = {**JSON_COMPILE_DEFAULTS, "lenient": True, "coerce_one_of": True}
JSON_STRICT_OVERRIDES = {"lenient": False, "coerce_one_of": False}
# llguidance's refusals of recursive intersections, which runtime/structured_output/schema_rewrite.py works around.
RECURSIVE_INTERSECTION = ("circular references with sibling keys are not supported",
                          "Schema intersection stack level exceeded")
# At most this many warnings are kept (and sent) per constraint.
MAX_WARNINGS = 16

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _quote(message: str) -> str:
    message = " ".join(message.split())  # llguidance's messages span lines (a caret under the error)
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


def unenforced_keywords(message: str, schema_text: str) -> list[tuple[str, str]]:
    """(keyword, what happens to it) for one of llguidance's leniency messages (the warnings of a lenient
    compile, the error of a strict one); [] when the message is about something else (a broken schema)."""
    m = re.match(r"Unknown format: (.*)", message)
    if m:
        return [("format", f"{m.group(1)[:40]!r} is not a known format; not checked")]
    m = re.match(r"Unimplemented keys: (\[.*\])", message)
    if m:
        try:
            keys = [str(k) for k in json.loads(m.group(1))]
        except ValueError:
            keys = [m.group(1)]
        return [(k[:40], "not enforced") for k in keys]
    if message.startswith("oneOf"):
        return [("oneOf", "approximated as anyOf (a value matching several branches is not refused)")]
    if message.startswith("patternProperties beside"):
        return [("patternProperties", "not enforced where a pattern also matches a declared property that recurses")]
    if message.startswith("min/maxProperties"):
        found = [k for k in ("minProperties", "maxProperties") if f'"{k}"' in schema_text]
        return [(k, "not enforced where some properties are optional") for k in found or ["minProperties"]]
    return []


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # True: refuse a JSON Schema with anything that is not enforced exactly (OpenAI's json_schema.strict).
    strict: bool = False
    # What of a JSON Schema is approximated or not enforced, "keyword: what happens" (lenient compile only).
    warnings: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    # The parsed JSON Schema when something of it was not enforced exactly: finished outputs are checked
    # against it (runtime/structured_output/schema_check.py). None otherwise.
    check_schema: dict | bool | None = field(default=None, init=False, repr=False, compare=False)
    # The llguidance grammar the constraint compiles to; set by validation, the compile cache's key.
    grammar_text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if not isinstance(self.strict, bool):
            raise ValueError(f"structured_outputs.strict must be a bool, got {self.strict!r}")
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {', '.join(given) if given else 'none'}")
        if self.strict and given[0] not in ("json", "json_object"):
            raise ValueError(f"structured_outputs.strict applies to json and json_object only, not {given[0]} "
                             f"(always enforced exactly)")
        self.grammar_text = self._build(given[0])

    @property
    def kind(self) -> str:
        return next(name for name in _FIELDS if getattr(self, name) not in (None, False))

    def _build(self, kind: str) -> str:
        import llguidance as llg

        fname = f"structured_outputs.{kind}"
        value = getattr(self, kind)
        if kind == "json_object":
            if value is not True:
                raise ValueError(f"{fname} must be True or None, got {value!r}")
            schema: Any = {"type": "object"}
            kind = "json"
        elif kind == "json":
            schema = value
        if kind == "json":
            if isinstance(schema, str):
                self._check_size(fname, schema)
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{fname} is not valid JSON: {_quote(str(e))}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError(f"{fname} must be a JSON Schema (an object), got {type(schema).__name__}")
            text = json.dumps(schema)
            self._check_size(fname, text)
            shared = shared_schema_text(schema, text)  # exact, and a smaller grammar (schema_share.py)
            for source in ([shared] if shared else []) + [text]:
                try:
                    if self.strict:
                        grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_COMPILE_DEFAULTS,
                                                                         overrides=JSON_STRICT_OVERRIDES)
                    else:
                        grammar = llg.LLMatcher.grammar_from_json_schema(source, defaults=JSON_LENIENT)
                except ValueError as e:
                    if source is not text:  # the shared form refused: the schema as written decides
                        continue
                    raise ValueError(f"{fname} is not a valid JSON Schema: {_quote(str(e))}") from None
                is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
                if not is_error:  # else the schema as written (its own error, or it compiles after all)
                    break
            if is_error and any(m in messages[0] for m in RECURSIVE_INTERSECTION):
                grammar, is_error, messages = self._recompile_circular(schema, grammar, messages)
            if is_error:
                named = unenforced_keywords(messages[0], text)
                if named:  # strict: what a lenient compile would have approximated
                    keys = ", ".join(k for k, _ in named)
                    why = "strict" if self.strict else "its x-guidance turns leniency off"
                    raise ValueError(f"{fname} uses {keys}, which cannot be enforced exactly ({why}): "
                                     f"{_quote(messages[0])}")
                raise ValueError(f"{fname} is not a valid JSON Schema: {_quote(messages[0])}")
            for message in messages:
                for keyword, what in unenforced_keywords(message, text) or [("schema", _quote(message))]:
                    warning = f"{keyword}: {what}"
                    if warning not in self.warnings and len(self.warnings) < MAX_WARNINGS:
                        self.warnings.append(warning)
            if self.warnings:
                self.check_schema = schema
            return grammar
        elif kind == "choice":
            if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple)) or not value:
                raise ValueError(f"{fname} must be a non-empty list of strings, got {value!r}")
            for i, c in enumerate(value):
                if not isinstance(c, str) or not c:
                    raise ValueError(f"{fname}[{i}] must be a non-empty string, got {c!r}")
            self.choice = list(value)
            self._check_size(fname, "".join(value))
            grammar = llg.grammar_from("choice", json.dumps(self.choice))
        else:  # regex, grammar
            if not isinstance(value, str) or not value:
                raise ValueError(f"{fname} must be a non-empty string, got {value!r}")
            self._check_size(fname, value)
            try:
                grammar = llg.grammar_from("regex" if kind == "regex" else "grammar", value)
            except ValueError as e:  # GBNF that does not convert to Lark
                raise ValueError(f"{fname} is not a valid grammar: {_quote(str(e))}") from None
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, None)
        if is_error:
            what = {"json": "JSON Schema", "regex": "regular expression"}.get(kind, "grammar")
            raise ValueError(f"{fname} is not a valid {what}: {_quote(messages[0])}")
        return grammar

    def _recompile_circular(self, schema: Any, grammar: str, messages: list[str]) -> tuple[str, bool, list[str]]:
        """llguidance refused to intersect recursive schemas: try again on schema_rewrite's forms of the schema,
        the exact one first, then the one without overlapping patternProperties (lenient only: strict refuses,
        naming patternProperties, when that is what it would have taken)."""
        import llguidance as llg

        from .structured_output.schema_rewrite import drop_overlapping_pattern_properties, flatten_all_of

        options = (dict(defaults=JSON_COMPILE_DEFAULTS, overrides=JSON_STRICT_OVERRIDES) if self.strict
                   else dict(defaults=JSON_LENIENT))

        def compile_(candidate: Any) -> tuple[str, bool, list[str]] | None:
            try:
                g = llg.LLMatcher.grammar_from_json_schema(json.dumps(candidate), **options)
            except ValueError:
                return None
            is_error, found = llg.LLMatcher.validate_grammar_with_warnings(g, None)
            return None if is_error else (g, False, found)

        exact = flatten_all_of(schema)
        done = compile_(exact)
        if done is not None:
            return done
        loose, dropped = drop_overlapping_pattern_properties(exact)
        done = compile_(loose) if dropped else None
        if done is None:
            return grammar, True, messages
        if self.strict:
            return grammar, True, [f"patternProperties beside a declared property that recurses: {messages[0]}"]
        self.warnings.append(f"patternProperties: not enforced on {dropped} object(s) where a pattern also matches "
                             f"a declared property (llguidance cannot intersect recursive schemas)")
        return done

    @staticmethod
    def _check_size(fname: str, text: str) -> None:
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{fname} is {len(text)} characters; the limit is {MAX_CONSTRAINT_CHARS}")
