"""The finished output of a JSON Schema that was not enforced exactly, checked against the whole schema.

A lenient compile (structured_outputs_params.py) approximates or leaves out what llguidance cannot enforce
(oneOf as anyOf; not, dependencies, uniqueItems, ...), so a finished output may still break the schema.
`violations` says how, one "path: message" per error (at most MAX_VIOLATIONS, each at most MAX_ERROR_CHARS),
and the output processor puts them on the output (CompletionOutput.schema_violations): such an output is
never passed as valid. Unknown formats are annotations here too (no format checker), as JSON Schema 2020-12
has it. Outputs of exactly enforced schemas are not checked (check_schema is None).

The validator is `jsonschema` (the schema's "$schema" draft, else 2020-12 that also reads draft-07's
"dependencies"), built once per constraint. Without jsonschema installed the output is flagged as unchecked
rather than passed, and so is one whose schema jsonschema cannot apply (a pattern in Rust-only regex syntax):
the check never fails the step.
"""

from __future__ import annotations

import json
from typing import Any

from ..structured_outputs_params import MAX_ERROR_CHARS, StructuredOutputsParams

MAX_VIOLATIONS = 8
UNCHECKED = "not checked against the schema: the jsonschema package is not installed"


def _cut(message: str) -> str:
    message = " ".join(message.split())
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 3] + "..."


_default_cls: Any = None


def _validator(params: StructuredOutputsParams) -> Any:
    global _default_cls
    cached = params.__dict__.get("_schema_validator")  # built once per constraint (n samples share it)
    if cached is not None:
        return cached
    from jsonschema import Draft7Validator, Draft202012Validator, validators

    if _default_cls is None:
        _default_cls = validators.extend(Draft202012Validator,
                                         {"dependencies": Draft7Validator.VALIDATORS["dependencies"]})
    schema = params.check_schema
    cls = validators.validator_for(schema, default=_default_cls) if isinstance(schema, dict) else _default_cls
    validator = cls(schema)
    params.__dict__["_schema_validator"] = validator
    return validator


def prepare(params: StructuredOutputsParams) -> None:
    """Build the validator ahead (jsonschema's first import takes ~70 ms): the compiler's worker thread calls
    this beside the grammar compile, so the step that finishes the output does not pay it."""
    if params.check_schema is not None:
        try:
            _validator(params)
        except ImportError:
            pass


def violations(params: StructuredOutputsParams | None, text: str) -> list[str]:
    """How `text` (a finished output) breaks the schema of `params`; [] when it does not, or when the schema
    was enforced exactly (nothing to check)."""
    if params is None or params.check_schema is None:
        return []
    try:
        validator = _validator(params)
    except ImportError:
        return [UNCHECKED]
    except Exception as e:  # a schema jsonschema cannot build a validator for
        return [_cut(f"not checked against the schema: {type(e).__name__}: {e}")]
    try:
        value = json.loads(text)
    except ValueError as e:
        return [_cut(f"not valid JSON: {e}")]
    found = []
    try:
        for error in validator.iter_errors(value):
            path = "$" + "".join(f"[{p!r}]" if isinstance(p, str) else f"[{p}]" for p in error.absolute_path)
            found.append(_cut(f"{path}: {error.message}"))
            if len(found) >= MAX_VIOLATIONS:
                break
    except Exception as e:  # what Python's jsonschema cannot read (a Rust-only regex like \p{L}, a remote $ref)
        found.append(_cut(f"not checked against the schema: {type(e).__name__}: {e}"))
    return found
