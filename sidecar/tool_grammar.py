"""What llguidance makes of a request's tools: each parameters schema checked (with the parts it only
approximates, as warnings), and the grammar that forces a reply to be tool calls (tool_choice "required" or a
named function; for "auto", lazily: once the model opens a call). Both are cached by text, since clients send
the same tools with every request."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any, Callable

from pagedserve.runtime.structured_outputs_params import (
    JSON_COMPILE_DEFAULTS,
    JSON_LENIENT,
    JSON_STRICT_OVERRIDES,
    StructuredOutputsParams,
)

from .tool_parser import END, TAG


class _Compiled:
    """A small LRU of what llguidance made of a text (keyed by its SHA-256, so big schemas cost no memory twice).

    Validating 128 tools' schemas and their grammar takes about 0.25 s on one core (the HTTP layer runs it off
    the event loop), so each distinct text is compiled once. Failures are not kept.
    """

    def __init__(self, size: int) -> None:
        self.size, self._items, self._lock = size, OrderedDict(), threading.Lock()

    def get(self, text: str, build: Callable[[], Any], field: str, where: str) -> Any:
        """build()'s value for `text`, cached; its ValueError names `where` instead of `field`."""
        key = hashlib.sha256(text.encode()).digest()
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        try:
            value = build()
        except ValueError as e:
            raise ValueError(str(e).replace(field, where, 1)) from None
        with self._lock:
            self._items[key] = value
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return value


_PARAMETERS = _Compiled(1024)  # a schema's warnings (StructuredOutputsParams.warnings)
_GRAMMARS = _Compiled(64)  # the StructuredOutputsParams of a tool-call grammar (never changed once built)


def check_parameters(parameters: dict, strict: bool, i: int) -> list[str]:
    """tools[i]'s parameters schema compiled: ValueError naming the field, or the warnings for what is only
    approximated."""
    where = f"tools[{i}].function.parameters"
    text = json.dumps(parameters)
    warnings = _PARAMETERS.get(f"{strict}:{text}", lambda: StructuredOutputsParams(json=text, strict=strict).warnings,
                               "structured_outputs.json", where)
    return [f"{where}: {w}" for w in warnings]


def grammar(tools: list[tuple[str, dict, bool]], parallel: bool, lazy: bool = False) -> StructuredOutputsParams:
    """A Lark grammar (llguidance's dialect) for one call, or one or more when parallel, of these tools
    (name, parameters, strict).

    Each tool's arguments are their own `%json` document, so `$ref`s inside a parameters schema resolve
    as they do alone; the name and the braces around are literals written the way the fallback prompt
    shows them (compact JSON, ", " and ": ").

    lazy (tool_choice "auto"): any text is free until the model writes the `<tool_call>` marker; llguidance's
    lazy lexeme `opened` ends at the marker's first occurrence, and from there only a call of these tools can
    follow, then (parallel) more calls, whitespace between and after, and the end of the reply: no text after
    a call. A reply without the marker is its own, as if unconstrained.
    """
    rules = []
    for k, (name, parameters, strict) in enumerate(tools):
        own = parameters.get("x-guidance") if isinstance(parameters.get("x-guidance"), dict) else {}
        guidance = ({**JSON_COMPILE_DEFAULTS, **own, **JSON_STRICT_OVERRIDES} if strict
                    else {**JSON_LENIENT, **own})
        head = json.dumps(f'{{"name": "{name}", "arguments": ')
        schema = json.dumps({**parameters, "x-guidance": guidance})
        rules.append(f'call_{k}: {head} args_{k} "}}"\nargs_{k}: %json {schema}')
    calls = " | ".join(f"call_{k}" for k in range(len(tools)))
    body = f'body: "\\n" ({calls}) "\\n{END}"'
    if lazy:
        more = "(GAP? call)* GAP?" if parallel else "GAP?"
        start = [f"%llguidance {{}}\nstart: TEXT | opened body {more}", f'opened[lazy]: TEXT "{TAG}"',
                 "TEXT: /(.|\\n)*/", "GAP: /[ \\t\\r\\n]{1,4}/"]
    else:
        start = ['start: call ("\\n" call)*' if parallel else "start: call"]
    text = "\n".join([*start, f'call: "{TAG}" body', body, *rules])
    return _GRAMMARS.get(text, lambda: StructuredOutputsParams(grammar=text), "structured_outputs.grammar",
                         "tools (the tool-call grammar)")
