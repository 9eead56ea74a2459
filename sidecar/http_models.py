"""The OpenAI-compatible HTTP API's request bodies (pydantic) and its error shape.

Field names and defaults follow OpenAI's Completions and Chat Completions APIs, plus vLLM's extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
return_token_ids, structured_outputs). Types are checked here, strictly as OpenAI types them (pydantic's
strict mode: no `true` for an int, no "2" for a number; an int is a number, 2.0 an int, as in JSON Schema);
ranges are SamplingParams' own checks and the engine's limits (one ValueError naming the field, answered
400). Unknown top-level fields are ignored, as OpenAI's SDKs send new ones before servers know them; known
fields this server does not implement are refused by name (`unsupported`), never ignored. Nested objects
this server reads (response_format, structured_outputs, stream_options, messages: http_messages.py) refuse
unknown keys, so a typo is not silently a request without its constraint.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from .http_messages import ChatMessage


def _integral(value: Any) -> Any:
    """2.0 as 2: JSON Schema (and so the OpenAPI document) counts a number with no fraction as an integer."""
    return int(value) if type(value) is float and value.is_integer() else value


# An integer, strictly (not true, not "2", not 2.5), as JSON Schema's `integer` (2.0 is one).
Int = Annotated[int, BeforeValidator(_integral)]


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable",
             403: "permission_error"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # e.g. Retry-After on a 429

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False
    include_obfuscation: bool | None = None  # OpenAI's padding of stream events against size analysis: none here


class JsonSchemaFormat(_Strict):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type json_schema needs json_schema.schema")
        return self


class StructuredOutputsBody(_Strict):
    """vLLM's extra body field: exactly one of json, regex, choice, grammar, json_object (checked by
    runtime's StructuredOutputsParams, which names the field), and strict for json."""

    json_: dict | bool | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    strict: bool = False

    def params_kwargs(self) -> dict[str, Any]:
        return {"json": self.json_, "regex": self.regex, "choice": self.choice, "grammar": self.grammar,
                "json_object": self.json_object, "strict": self.strict}


class FunctionDef(BaseModel):
    """OpenAI's function definition; its name and parameters are checked by sidecar/tool_calls.plan_tools."""

    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class _Common(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)

    model: str | None = None
    n: Int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    return_token_ids: bool = False  # vLLM's extra: the prompt's and each choice's token ids in the answer
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None
    priority: Int = 0  # vLLM's extra: lower runs first under --scheduling-policy priority or fair

    SAMPLING: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "min_tokens", "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "stop_token_ids")
    # Known OpenAI fields this server does not implement: refused by name when set to anything but "off".
    UNSUPPORTED: ClassVar[tuple[str, ...]] = ()
    # Fields whose values are checked beyond their types (ranges, limits, unsupported): the OpenAPI document's
    # x-checked-by-server. The sampling fields are SamplingParams'.
    CHECKED: ClassVar[tuple[str, ...]] = SAMPLING + ("stop", "logit_bias", "max_tokens", "response_format",
                                                     "structured_outputs")

    def unsupported(self) -> str | None:
        """The first field set that this server does not implement over HTTP, or None."""
        for name in self.UNSUPPORTED:
            value = (self.model_extra or {}).get(name, getattr(self, name, None))
            if value not in (None, False, {}, [], ["text"]):  # ["text"]: modalities asking for text only
                return name
        return None

    def check(self) -> None:
        """Checks across fields (ApiError naming the field); none here."""

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keywords of the fields the client set (the rest keep SamplingParams' defaults).
        logit_bias keys are token ids as strings (JSON's object keys): a key that is not one is refused."""
        kwargs = {name: getattr(self, name) for name in self.SAMPLING if getattr(self, name) is not None}
        if self.stop is not None:
            kwargs["stop"] = self.stop
        if self.logit_bias:
            bias = {}
            for key, value in self.logit_bias.items():
                if not re.fullmatch(r"\d{1,9}", key.strip()):
                    raise ValueError(f"logit_bias keys must be token ids (\"123\"), got {key[:40]!r}")
                bias[int(key)] = value
            kwargs["logit_bias"] = bias
        return kwargs


class CompletionRequest(_Common):
    """POST /v1/completions. prompt: a string, a list of token ids, or a list of either (several prompts:
    the choices of prompt i are indexed i * n .. i * n + n - 1, as OpenAI does)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)  # extras kept: unsupported()

    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Int | None = 16
    echo: bool = False
    best_of: Int | None = None
    logprobs: Int | None = None  # how many top logprobs per token (0: the chosen token's only)

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("suffix",)
    CHECKED = _Common.CHECKED + UNSUPPORTED + ("prompt", "best_of", "logprobs", "echo")

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.best_of is not None:
            kwargs["best_of"] = self.best_of
        if self.logprobs is not None:
            kwargs["logprobs"] = self.logprobs
        return kwargs


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions. max_completion_tokens is OpenAI's newer name for max_tokens; unset, a
    reply may fill the rest of the context (max_model_len less the prompt), as in vLLM."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None
    max_completion_tokens: Int | None = None
    add_generation_prompt: bool = True
    logprobs: bool = False
    top_logprobs: Int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    UNSUPPORTED: ClassVar[tuple[str, ...]] = ("audio", "modalities", "prediction", "web_search_options")
    CHECKED = _Common.CHECKED + UNSUPPORTED + ("messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                               "tools", "tool_choice", "parallel_tool_calls")

    def check(self) -> None:
        """Checks across fields, as ApiError naming the field (a pydantic validator could not name it). tools,
        tool_choice and parallel_tool_calls are checked together by sidecar/tool_calls.plan_tools."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs", "invalid_value")

    def tools_raw(self) -> tuple[list[dict] | None, Any]:
        """tools and tool_choice as the JSON they came as (what plan_tools reads)."""
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return tools, choice

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = super().sampling_kwargs()
        if self.logprobs:
            kwargs["logprobs"] = self.top_logprobs or 0
        return kwargs

