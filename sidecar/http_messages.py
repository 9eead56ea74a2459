"""Chat messages of the HTTP API (pydantic, strict), one model per role as OpenAI's API types them.

    system, developer   content (developer: OpenAI's newer name for system; the template sees "system")
    user                content: a string or a list of text parts
    assistant           content, or tool_calls, or both; unknown keys ignored (clients send back the
                        message they were answered, with refusal, annotations, audio)
    tool                content and tool_call_id

A content part other than text (image_url, input_audio, file) is refused by name: this server's models are
text-only. Unknown keys in the other messages and in parts are refused, as OpenAI refuses them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator
from pydantic_core import PydanticCustomError

# OpenAI's content part types a text-only model cannot read: refused by name (http_errors maps the error).
NON_TEXT_PARTS = ("image_url", "input_audio", "file")
TEXT_ONLY = "text_only"  # the pydantic error type of such a part


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if kind in NON_TEXT_PARTS:
            raise PydanticCustomError(TEXT_ONLY, "this model is text-only: {kind} content parts are not supported",
                                      {"kind": kind})
        return value


def _content_kind(value: Any) -> str | None:
    return "Text" if isinstance(value, str) else "Parts" if isinstance(value, list) else None


# A string or a list of parts: told apart by the value's type, so an error names only the branch it is in.
Content = Annotated[Union[Annotated[str, Tag("Text")], Annotated[list[TextPart], Tag("Parts")]],
                    Discriminator(_content_kind, custom_error_type="content_type",
                                  custom_error_message="content must be a string or a list of text parts")]


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str
    arguments: str


class ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    content: Content
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @property
    def template_role(self) -> str:
        return self.role  # type: ignore[attr-defined]


class SystemMessage(_Message):
    role: Literal["system"]


class DeveloperMessage(_Message):
    """OpenAI's name for system instructions since its o1 models: the chat template sees a system turn."""

    role: Literal["developer"]

    @property
    def template_role(self) -> str:
        return "system"


class UserMessage(_Message):
    role: Literal["user"]


class AssistantMessage(_Message):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["assistant"]
    content: Content | None = None
    tool_calls: list[ToolCall] | None = None  # the tools it called (one of the two is needed: http_inputs)


class ToolMessage(_Message):
    role: Literal["tool"]
    tool_call_id: str  # the call it answers


ROLES = ("system", "developer", "user", "assistant", "tool")

ChatMessage = Annotated[Union[SystemMessage, DeveloperMessage, UserMessage, AssistantMessage, ToolMessage],
                        Field(discriminator="role")]
