"""Engine outputs as OpenAI's response objects: whole answers, stream chunks, usage.

One Render per request. Completions and chat differ only in how a choice holds its text (`text`, or a
`message` / `delta` with a role) and in the object names; the bookkeeping (which choices have finished,
usage) is shared. finish_reason is the engine's: "stop" (EOS, a stop string or token), "length"
(max_tokens or the context), "abort" (ended by the gRPC Abort RPC).
"""

from __future__ import annotations

import time

from pagedserve.runtime.outputs import CompletionOutput, RequestOutput


def usage(out: RequestOutput | None) -> dict:
    prompt = len(out.prompt_token_ids) if out is not None else 0
    completion = sum(len(c.token_ids) for c in out.outputs) if out is not None else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Render:
    OBJECT = ""
    CHUNK_OBJECT = ""

    def __init__(self, request_id: str, model: str, return_token_ids: bool = False) -> None:
        self.request_id, self.model, self.return_token_ids = request_id, model, return_token_ids
        self.created = int(time.time())
        self._finished: set[int] = set()

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # what differs between completions and chat
    def _choice(self, c: CompletionOutput) -> dict:
        raise NotImplementedError

    def _delta(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        raise NotImplementedError

    def start(self, n: int) -> list[dict]:
        """Chunks before any token (chat: each choice's role)."""
        return []

    # shared
    def whole(self, out: RequestOutput | None, n: int) -> dict:
        """The non-streaming answer from the request's last output."""
        by_index = {c.index: c for c in out.outputs} if out is not None else {}
        choices = []
        for i in range(n):
            c = by_index.get(i) or CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=0.0,
                                                    logprobs=None)
            choice = self._choice(c)
            choice["finish_reason"] = c.finish_reason or "abort"
            choices.append(choice)
        body = {**self._head(self.OBJECT), "choices": choices, "usage": usage(out)}
        if self.return_token_ids and out is not None:
            body["prompt_token_ids"] = list(out.prompt_token_ids)
        return body

    def deltas(self, out: RequestOutput) -> list[dict]:
        """This output's new text per choice, each choice's finish_reason once."""
        chunks = []
        for c in out.outputs:
            if c.index in self._finished:
                continue
            if c.new_text or c.finish_reason or (self.return_token_ids and c.new_token_ids):
                chunks.append(self._chunk(self._delta(c.index, c.new_text, c.new_token_ids, c.finish_reason)))
            if c.finish_reason:
                self._finished.add(c.index)
        return chunks

    def unfinished(self, n: int) -> list[dict]:
        """Final chunks of the choices an abort left without a finish_reason."""
        left = [i for i in range(n) if i not in self._finished]
        self._finished.update(left)
        return [self._chunk(self._delta(i, "", [], "abort")) for i in left]

    def usage_chunk(self, out: RequestOutput | None) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [], "usage": usage(out)}

    def _chunk(self, choice: dict) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [choice]}


class CompletionRender(Render):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def _choice(self, c: CompletionOutput) -> dict:
        choice = {"index": c.index, "text": c.text, "logprobs": None, "finish_reason": c.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _delta(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice


class ChatRender(Render):
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"

    def _choice(self, c: CompletionOutput) -> dict:
        choice = {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": None,
                  "finish_reason": c.finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(c.token_ids)
        return choice

    def _delta(self, index: int, text: str, token_ids: list[int], finish_reason: str | None) -> dict:
        choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                  "finish_reason": finish_reason}
        if self.return_token_ids:
            choice["token_ids"] = list(token_ids)
        return choice

    def start(self, n: int) -> list[dict]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(n)]
