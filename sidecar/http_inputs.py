"""The HTTP API's checks of what a request carries, before anything is allocated: the same limits as the gRPC
path (max_prompt_chars per text and per conversation, max_chat_messages, max_waiting_requests prompts), and
text JSON can carry but a tokenizer cannot take (a lone surrogate). Each failure is an ApiError naming the field.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from pagedserve.runtime.engine.async_engine import LONG_PROMPT_CHARS, AsyncEngine

from .http_messages import ChatMessage
from .http_models import ApiError
from .servicer import CHAT_ROLES


class Inputs:
    def __init__(self, max_prompt_chars: int, max_chat_messages: int) -> None:
        self.max_prompt_chars, self.max_chat_messages = max_prompt_chars, max_chat_messages

    def check_text(self, text: str, field: str) -> None:
        check_unicode(text, field)
        if len(text) > self.max_prompt_chars:
            raise ApiError(400, f"{field} is {len(text)} characters; the limit is {self.max_prompt_chars}",
                           field, "invalid_value")

    def completion_prompts(self, prompt, engine: AsyncEngine) -> list[str | list[int]]:
        prompts = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        if len(prompts) > engine.max_waiting_requests:
            raise ApiError(400, f"prompt holds {len(prompts)} prompts; the limit is {engine.max_waiting_requests} "
                           f"(max_waiting_requests)", "prompt", "invalid_value")
        for i, p in enumerate(prompts):
            field = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
            if not p:
                raise ApiError(400, f"{field} is empty", field, "invalid_value")
            if isinstance(p, str):
                self.check_text(p, field)
        return prompts  # token ids: the engine checks their range and length before copying them

    def chat_messages(self, messages: list[ChatMessage]) -> list[dict[str, Any]]:
        """The conversation for the chat template: role and content, and the tool turns' fields (an assistant's
        tool_calls, a tool result's tool_call_id and name), which the template renders."""
        if len(messages) > self.max_chat_messages:
            raise ApiError(400, f"messages has {len(messages)} messages; the limit is {self.max_chat_messages}",
                           "messages", "invalid_value")
        out, total = [], 0
        for i, m in enumerate(messages):
            role = m.template_role  # developer: OpenAI's newer name for system
            if role not in CHAT_ROLES:  # the models' roles are the chat templates'; kept in step with gRPC's
                raise ApiError(400, f"messages[{i}].role {m.role[:40]!r} is not one of {list(CHAT_ROLES)}",
                               f"messages[{i}].role", "invalid_value")
            tool_calls = getattr(m, "tool_calls", None)
            if m.content is None and not tool_calls:
                raise ApiError(400, f"messages[{i}]: an assistant message needs content or tool_calls",
                               f"messages[{i}].content", "invalid_value")
            text = m.text()
            self.check_text(text, f"messages[{i}].content")
            total += len(text)
            message: dict[str, Any] = {"role": role, "content": text}
            if tool_calls:
                calls = [c.model_dump() for c in tool_calls]
                for j, c in enumerate(calls):
                    self.check_text(c["function"]["arguments"], f"messages[{i}].tool_calls[{j}].function.arguments")
                    total += len(c["function"]["arguments"])
                message["tool_calls"] = calls
                if m.content is None:
                    message["content"] = None
            for key in ("tool_call_id", "name"):  # rendered by templates: text like the content
                value = getattr(m, key, None)
                if value is not None:
                    self.check_text(value, f"messages[{i}].{key}")
                    total += len(value)
                    message[key] = value
            out.append(message)
        if total > self.max_prompt_chars:  # the rendered conversation is one prompt
            raise ApiError(400, f"messages hold {total} characters in all; the limit is {self.max_prompt_chars}",
                           "messages", "invalid_value")
        return out


async def maybe_off_loop(size: int, fn: Callable, *args: Any) -> Any:
    """fn(*args), in a worker thread when the input is long (tokenizing it takes long enough to stall streams)."""
    return await asyncio.to_thread(fn, *args) if size > LONG_PROMPT_CHARS else fn(*args)


def check_unicode(text: str, field: str) -> None:
    """JSON may carry a lone surrogate ("\\ud800"), which no tokenizer takes; gRPC's UTF-8 strings cannot."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ApiError(400, f"{field} is not valid Unicode: {e.reason} at character {e.start}", field,
                       "invalid_value") from None

