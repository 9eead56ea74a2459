"""StructuredOutputsParams: the one constraint a request's output must follow (vLLM's names).

Exactly one of these is set:

    json         a JSON Schema, as a dict or a JSON string      {"type": "object", ...}
    regex        a regular expression the whole output matches  r"\\d{4}-\\d{2}-\\d{2}"
    choice       the output is exactly one of these strings     ["yes", "no"]
    grammar      a Lark grammar (llguidance's dialect) or GBNF  'start: "a"+'
    json_object  True: any JSON object

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
from dataclasses import dataclass, field
from typing import Any

# Longest constraint text accepted (schema, regex, grammar, or all choices together), in characters.
MAX_CONSTRAINT_CHARS = 256 * 1024
# llguidance's error messages can quote a whole grammar; this much is enough to find the mistake.
MAX_ERROR_CHARS = 200
# Defaults of the JSON Schema compiler (a schema's own "x-guidance" key overrides them).
JSON_COMPILE_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


def _quote(message: str) -> str:
    message = " ".join(message.split())  # llguidance's messages span lines (a caret under the error)
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


@dataclass
class StructuredOutputsParams:
    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # The llguidance grammar the constraint compiles to; set by validation, the compile cache's key.
    grammar_text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        given = [name for name in _FIELDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs must set exactly one of json, regex, choice, grammar or "
                             f"json_object, got {', '.join(given) if given else 'none'}")
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
            try:
                grammar = llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_COMPILE_DEFAULTS)
            except ValueError as e:
                raise ValueError(f"{fname} is not a valid JSON Schema: {_quote(str(e))}") from None
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

    @staticmethod
    def _check_size(fname: str, text: str) -> None:
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"{fname} is {len(text)} characters; the limit is {MAX_CONSTRAINT_CHARS}")
