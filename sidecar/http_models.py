"""The OpenAI-compatible HTTP API's request bodies (pydantic) and its error shape.

Field names and defaults follow OpenAI's Completions and Chat Completions APIs, plus vLLM's extras
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens,
return_token_ids). Types are checked here; ranges are SamplingParams' own checks (one ValueError naming
the field, answered 400). Unknown fields are ignored, as OpenAI's SDKs send new ones before servers know
them; known fields this server does not implement yet are refused by name (`unsupported`), never ignored.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field


class ApiError(Exception):
    """An answer in OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
             429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as vLLM does
    return_token_ids: bool = False  # vLLM's extra: the prompt's and each choice's token ids in the answer

    # Known OpenAI fields not served yet: refused by name when set to anything but their "off" value.
    logprobs: Any = None
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict | None = None
    tools: list | None = None
    tool_choice: Any = None

    SAMPLING: ClassVar[tuple[str, ...]] = (
        "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
        "seed", "min_tokens", "ignore_eos", "skip_special_tokens", "stop_token_ids")

    def unsupported(self) -> str | None:
        """The first field set that this server does not implement over HTTP yet, or None."""
        for name in ("logprobs", "logit_bias", "best_of", "response_format", "tools", "tool_choice", "echo",
                     "suffix", "top_logprobs"):
            value = getattr(self, name, None)
            off = value is None or value is False or value == {} or value == [] or (name == "best_of" and value == 1)
            if not off:
                return name
        return None

    def sampling_kwargs(self) -> dict[str, Any]:
        """SamplingParams keywords of the fields the client set (the rest keep SamplingParams' defaults)."""
        kwargs = {name: getattr(self, name) for name in self.SAMPLING if getattr(self, name) is not None}
        if self.stop is not None:
            kwargs["stop"] = self.stop
        return kwargs


class CompletionRequest(_Common):
    """POST /v1/completions. prompt: a string, a list of token ids, or a one-element list of either."""

    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    suffix: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Common):
    """POST /v1/chat/completions. max_completion_tokens is OpenAI's newer name for max_tokens; unset, a
    reply may fill the rest of the context (max_model_len less the prompt), as in vLLM."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    add_generation_prompt: bool = True
    top_logprobs: int | None = None
