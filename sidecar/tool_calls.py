"""Tool calling for the OpenAI-compatible chat API: a request's tools and tool_choice checked into a ToolPlan.

Interface (what the chat endpoint calls; everything raises ValueError naming the field, answered 400):

    plan = plan_tools(body.tools, body.tool_choice, body.parallel_tool_calls)   # before anything is allocated;
                              # up to ~0.25 s for 128 new tools (compiling them): call it off the event loop
    plan.mode                 "none" | "auto" | "required" | "function" (a named function)
    plan.template_tools       the tools for the chat template (None: no tools in the prompt); render with
                              tokenize_chat(messages, tools=plan.template_tools): a template without a tools
                              branch gets the Hermes block (models/tokenizer/chat_template.py)
    plan.structured_outputs   StructuredOutputsParams for SamplingParams: required/function, a grammar forcing
                              `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, so the arguments
                              always parse and match the tool's schema (it cannot be combined with
                              response_format / structured_outputs); auto, the same grammar behind a lazy
                              trigger: text is free until the model writes `<tool_call>`, then only a valid call
                              (more with parallel_tool_calls) and the end (a request's own response_format /
                              structured_outputs takes its place: plan.forces_calls is False)
    plan.warnings             "tools[i].function.parameters: keyword: what" for schema parts only approximated
    plan.parser()             a fresh ToolCallParser per choice (None for "none")
    plan.finish_reason(reason, tool_calls, parser.ended_in_call)   "tool_calls" for auto/required replies that
                              called tools; "length" when max_tokens cut a call (the reply is then its text:
                              parser.ended_in_call, what ChatRender checks, as vLLM's Hermes parser does)

    parser.parse(text) -> (content, tool_calls)      a whole reply; content None when only tools were called
    parser.feed(delta) -> [delta, ...]               streaming: OpenAI `delta` dicts for chunks, in order
    parser.finish()    -> [delta, ...]               end of stream: what was held back
    parser.tool_calls                                the calls so far, in the non-streaming shape
    parser.ended_in_call                             after parse/finish: the text ended inside a call or its marker

The parser (its formats, shapes and streaming) is sidecar/tool_parser.py; the schema checks and the grammar,
through llguidance and cached, sidecar/tool_grammar.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.runtime.structured_outputs_params import StructuredOutputsParams

from .tool_grammar import check_parameters, grammar
from .tool_parser import ToolCallParser

__all__ = ["MAX_TOOLS", "ToolCallParser", "ToolPlan", "plan_tools"]

# OpenAI's limits: at most 128 tools; names of letters, digits, underscores and dashes, up to 64.
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
CHOICES = ("none", "auto", "required")
# A function without parameters takes none (OpenAI: "omitting parameters defines an empty parameter list").
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    mode: str
    tools: list[dict] = field(default_factory=list)
    names: tuple[str, ...] = ()
    parallel_tool_calls: bool = True
    function_name: str | None = None  # the named function of tool_choice {"type": "function", ...}
    structured_outputs: StructuredOutputsParams | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def forces_calls(self) -> bool:
        """The reply is nothing but calls (required, a named function)."""
        return self.mode in ("required", "function")

    @property
    def template_tools(self) -> list[dict] | None:
        return self.tools if self.mode != "none" and self.tools else None

    def parser(self) -> ToolCallParser | None:
        if self.mode == "none":
            return None
        names = (self.function_name,) if self.mode == "function" else self.names
        single = not self.parallel_tool_calls or self.mode == "function"
        return ToolCallParser(names, max_calls=1 if single else None)

    def finish_reason(self, reason: str | None, tool_calls: list[dict], ended_in_call: bool = False) -> str | None:
        """OpenAI's finish_reason: "tool_calls" whenever an auto or required reply returns calls (stopped by
        itself, or max_tokens reached just after a call: vLLM's rule); "length" when max_tokens cut a call
        (ended_in_call: the reply is then returned as its text, without tool_calls); a named function's reply
        keeps "stop" (as OpenAI's does)."""
        if reason == "length" and ended_in_call:
            return reason
        if tool_calls and reason in ("stop", "length") and self.mode in ("auto", "required"):
            return "tool_calls"
        return reason


def plan_tools(tools: Any, tool_choice: Any = None, parallel_tool_calls: Any = None) -> ToolPlan:
    """Validate a request's tools, tool_choice and parallel_tool_calls; the plan for it (module docstring)."""
    if tools is None:
        tools = []
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of {{'type': 'function', 'function': {{...}}}} objects, "
                         f"got {type(tools).__name__}")
    if len(tools) > MAX_TOOLS:
        raise ValueError(f"tools has {len(tools)} tools; the limit is {MAX_TOOLS}")
    if parallel_tool_calls is None:
        parallel_tool_calls = True
    if not isinstance(parallel_tool_calls, bool):
        raise ValueError(f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}")
    checked, names, params, warnings = [], [], [], []
    for i, tool in enumerate(tools):
        tool, parameters, strict = _check_tool(tool, i)
        name = tool["function"]["name"]
        if name in names:
            raise ValueError(f"tools[{i}].function.name {name!r} repeats tools[{names.index(name)}]'s")
        warnings += check_parameters(parameters, strict, i)
        checked.append(tool)
        names.append(name)
        params.append((parameters, strict))
    mode, named = _check_choice(tool_choice, names)
    plan = ToolPlan(mode, checked, tuple(names), parallel_tool_calls, warnings=warnings)
    if mode == "function":
        parameters, strict = params[names.index(named)]
        plan.function_name = named
        plan.structured_outputs = grammar([(named, parameters, strict)], parallel=False)
    elif mode in ("required", "auto"):
        plan.structured_outputs = grammar([(n, p, s) for n, (p, s) in zip(names, params)],
                                           parallel=parallel_tool_calls, lazy=mode == "auto")
    if mode == "none":
        plan.warnings = []
    return plan


def _check_tool(tool: Any, i: int) -> tuple[dict, dict, bool]:
    where = f"tools[{i}]"
    if not isinstance(tool, dict):
        raise ValueError(f"{where} must be an object {{'type': 'function', 'function': {{...}}}}, "
                         f"got {type(tool).__name__}")
    if tool.get("type", "function") != "function":
        raise ValueError(f"{where}.type must be 'function', got {str(tool.get('type'))[:40]!r}")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ValueError(f"{where}.function must be an object with a name, got {type(function).__name__}")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ValueError(f"{where}.function.name must be 1-64 letters, digits, underscores or dashes, "
                         f"got {str(name)[:80]!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ValueError(f"{where}.function.description must be a str, got {type(description).__name__}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ValueError(f"{where}.function.strict must be a bool, got {strict!r}")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = NO_PARAMETERS
    elif not isinstance(parameters, dict):
        raise ValueError(f"{where}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}")
    elif parameters.get("type", "object") != "object":
        raise ValueError(f"{where}.function.parameters must describe an object (\"type\": \"object\"), "
                         f"got \"type\": {json.dumps(parameters.get('type'))[:40]}")
    kept = {key: function[key] for key in ("name", "description", "parameters", "strict")
            if function.get(key) is not None}
    return {"type": "function", "function": kept}, parameters, bool(strict)



def _check_choice(tool_choice: Any, names: list[str]) -> tuple[str, str | None]:
    if tool_choice is None:
        return ("auto" if names else "none"), None
    if isinstance(tool_choice, str):
        if tool_choice not in CHOICES:
            raise ValueError(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                             f"'function': {{'name': ...}}}}, got {tool_choice[:40]!r}")
        if tool_choice != "none" and not names:
            raise ValueError(f"tool_choice {tool_choice!r} needs tools, and none were given")
        return tool_choice, None
    if not isinstance(tool_choice, dict):
        raise ValueError(f"tool_choice must be a string or an object, got {type(tool_choice).__name__}")
    if tool_choice.get("type") != "function":
        raise ValueError(f"tool_choice.type must be 'function', got {str(tool_choice.get('type'))[:40]!r}")
    function = tool_choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise ValueError("tool_choice.function.name must be the name of one of the tools")
    if name not in names:
        raise ValueError(f"tool_choice.function.name {name[:80]!r} is not one of the tools "
                         f"({', '.join(names[:8]) or 'none given'}{', ...' if len(names) > 8 else ''})")
    return "function", name
