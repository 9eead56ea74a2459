"""Engine outputs as OpenAI's response objects: whole answers, stream chunks, logprobs, usage.

One Render per HTTP request, which may hold several engine requests (a completions call with a list of
prompts): the choices of prompt p are numbered p * n + i, as OpenAI does. Completions and chat differ only
in how a choice holds its text (`text`, or a `message` / `delta` with a role), its logprobs (the legacy
{tokens, token_logprobs, top_logprobs, text_offset}, or `content: [{token, logprob, bytes, top_logprobs}]`)
and the object names; the bookkeeping (which choices have finished, usage) is shared.

finish_reason is the engine's: "stop" (EOS, a stop string or token, the end of a grammar), "length"
(max_tokens or the context), "abort" (ended by the gRPC Abort RPC).

Extra fields beyond OpenAI's, each present only when it has something to say:
    warnings            (top level; streaming: the first chunk) what of a JSON Schema is approximated or not
                        enforced ("keyword: what happens"), RequestOutput.warnings
    choices[].schema_violations   how a finished output breaks the parts of its schema that were not
                        enforced (CompletionOutput.schema_violations); streaming: on the chunk that finishes it
    choices[].token_ids, prompt_token_ids   with return_token_ids (vLLM's extra)

Chat requests with tools (sidecar/tool_calls.py's ToolPlan) get the model's tool-call text parsed out of each
choice: `message.tool_calls` and finish_reason "tool_calls" whole, `delta.tool_calls` streamed. A choice that
max_tokens cut inside a call says "length": whole, its text is the content and no call is returned (vLLM's
Hermes parser does the same); streamed, the call's deltas already sent stay incomplete (as OpenAI's do).

Logprobs are the model's raw ones (runtime/sample/sampler.py); a token's text is the token decoded alone,
its bytes that text's UTF-8 (a token that is part of a character decodes to U+FFFD, as in vLLM).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from pagedserve.runtime.outputs import CompletionOutput, RequestOutput

# JSON has no -Infinity: a token the model gives no chance is reported at this floor (vLLM's choice too).
LOGPROB_FLOOR = -9999.0


def usage(outs: list[RequestOutput | None]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outs if o is not None)
    completion = sum(len(c.token_ids) for o in outs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outs if o is not None)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class RenderOptions:
    n: int = 1
    num_prompts: int = 1
    return_token_ids: bool = False
    logprobs: int | None = None  # top logprobs per token (0: the chosen token's only); None: no logprobs
    token_text: Callable[[int], str] = str  # a token id decoded alone
    echo: list[str] | None = None  # completions: each prompt's text, put before its choices' text
    tool_plan: Any = None  # chat: sidecar/tool_calls.ToolPlan when the request has tools (calls parsed out)
    warnings: list[str] = field(default_factory=list)  # the request's own (tools' schemas), before the engine's


def _lp(value: float) -> float:
    return max(float(value), LOGPROB_FLOOR)


class Render:
    OBJECT = ""
    CHUNK_OBJECT = ""

    def __init__(self, request_id: str, model: str, opts: RenderOptions) -> None:
        self.request_id, self.model, self.opts = request_id, model, opts
        self.created = int(time.time())
        self._finished: set[int] = set()
        self._warned = False
        self._offset: dict[int, int] = {}  # completions' text_offset, per choice

    @property
    def num_choices(self) -> int:
        return self.opts.n * self.opts.num_prompts

    def _head(self, obj: str) -> dict:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model}

    # what differs between completions and chat
    def _choice(self, index: int, c: CompletionOutput, text: str) -> dict:
        raise NotImplementedError

    def _delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        raise NotImplementedError

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        raise NotImplementedError

    def start(self) -> list[dict]:
        """Chunks before any token (chat: each choice's role; completions with echo: each prompt's text)."""
        return []

    # shared
    def _top(self, token_id: int, entry: dict[int, float]) -> tuple[float, list[tuple[int, float]]]:
        """The chosen token's logprob and the top-k (most likely first; it is among them when it ranks)."""
        k = self.opts.logprobs or 0
        top = sorted(entry.items(), key=lambda kv: (-kv[1], kv[0]))[:k]
        return _lp(entry[token_id]), [(t, _lp(v)) for t, v in top]

    def _extras(self, choice: dict, c: CompletionOutput, token_ids: list[int]) -> dict:
        if self.opts.logprobs is not None:
            entries = (c.logprobs or [])[-len(token_ids):] if token_ids else []
            choice["logprobs"] = self._logprobs(choice["index"], token_ids, entries)
        if self.opts.return_token_ids:
            choice["token_ids"] = list(token_ids)
        if c.schema_violations:
            choice["schema_violations"] = list(c.schema_violations)
        return choice

    def whole(self, outs: list[RequestOutput | None]) -> dict:
        """The non-streaming answer from each prompt's last output."""
        choices = []
        warnings: list[str] = list(self.opts.warnings)
        for p, out in enumerate(outs):
            by_index = {c.index: c for c in out.outputs} if out is not None else {}
            warnings += [w for w in (out.warnings if out is not None else []) if w not in warnings]
            for i in range(self.opts.n):
                c = by_index.get(i) or CompletionOutput(index=i, text="", token_ids=[], cumulative_logprob=0.0,
                                                        logprobs=None)
                index = p * self.opts.n + i
                echo = self.opts.echo[p] if self.opts.echo else ""
                self._offset[index] = len(echo)
                choice = self._choice(index, c, echo + c.text)
                choice["finish_reason"] = choice["finish_reason"] or "abort"
                choices.append(self._extras(choice, c, list(c.token_ids)))
        body = {**self._head(self.OBJECT), "choices": choices, "usage": usage(outs)}
        if warnings:
            body["warnings"] = warnings
        if self.opts.return_token_ids:
            body["prompt_token_ids"] = [list(o.prompt_token_ids) if o is not None else [] for o in outs]
            if len(outs) == 1:
                body["prompt_token_ids"] = body["prompt_token_ids"][0]
        return body

    def deltas(self, prompt: int, out: RequestOutput) -> list[dict]:
        """This output's new text per choice, each choice's finish_reason once; its logprobs and token ids on
        the choice's first chunk, its schema violations on the last."""
        chunks = []
        asked = self.opts.return_token_ids or self.opts.logprobs is not None
        for c in out.outputs:
            index = prompt * self.opts.n + c.index
            if index in self._finished:
                continue
            choices = self._stream_choices(index, c)
            if not choices and asked and c.new_token_ids:
                choices = [self._delta(index, "", None)]
            if choices:
                ids = list(c.new_token_ids)
                if self.opts.logprobs is not None:
                    entries = (c.logprobs or [])[-len(ids):] if ids else []
                    choices[0]["logprobs"] = self._logprobs(index, ids, entries)
                if self.opts.return_token_ids:
                    choices[0]["token_ids"] = ids
                    for choice in choices[1:]:
                        choice["token_ids"] = []
                if c.schema_violations and c.finish_reason:
                    choices[-1]["schema_violations"] = list(c.schema_violations)
                new = [self._chunk(choice) for choice in choices]
                warnings = [*self.opts.warnings, *(w for w in out.warnings if w not in self.opts.warnings)]
                if warnings and not self._warned:
                    new[0]["warnings"] = warnings
                    self._warned = True
                chunks += new
            if c.finish_reason:
                self._finished.add(index)
        return chunks

    def _stream_choices(self, index: int, c: CompletionOutput) -> list[dict]:
        """The stream choices (one a chunk) of a choice's new output: its text and, once, its finish_reason."""
        if c.new_text or c.finish_reason:
            return [self._delta(index, c.new_text, c.finish_reason)]
        return []

    def unfinished(self) -> list[dict]:
        """Final chunks of the choices an abort left without a finish_reason."""
        left = [i for i in range(self.num_choices) if i not in self._finished]
        self._finished.update(left)
        return [self._chunk(self._delta(i, "", "abort")) for i in left]

    def usage_chunk(self, outs: list[RequestOutput | None]) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [], "usage": usage(outs)}

    def _chunk(self, choice: dict) -> dict:
        return {**self._head(self.CHUNK_OBJECT), "choices": [choice]}


class CompletionRender(Render):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def _choice(self, index: int, c: CompletionOutput, text: str) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": c.finish_reason}

    def _delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        """OpenAI's legacy shape; text_offset counts characters from the start of the choice's text."""
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = self._offset.get(index, 0)
        for t, entry in zip(token_ids, entries):
            lp, top = self._top(t, entry)
            text = self.opts.token_text(t)
            tokens.append(text)
            token_lps.append(lp)
            entry_top: dict[str, float] = {}
            for tt, v in top:  # tokens that decode alike (parts of a character) share a key: the likeliest's
                entry_top.setdefault(self.opts.token_text(tt), v)
            tops.append(entry_top)
            offsets.append(offset)
            offset += len(text)
        self._offset[index] = offset
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def start(self) -> list[dict]:
        if not self.opts.echo:
            return []
        chunks = []
        for index in range(self.num_choices):
            text = self.opts.echo[index // self.opts.n]
            self._offset[index] = len(text)
            chunks.append(self._chunk(self._delta(index, text, None)))
        return chunks


class ChatRender(Render):
    OBJECT = "chat.completion"
    CHUNK_OBJECT = "chat.completion.chunk"

    def __init__(self, request_id: str, model: str, opts: RenderOptions) -> None:
        super().__init__(request_id, model, opts)
        self._parsers: dict[int, Any] = {}  # per choice: its tool-call parser (requests with tools)

    def _parser(self, index: int):
        if self.opts.tool_plan is None:
            return None
        if index not in self._parsers:
            self._parsers[index] = self.opts.tool_plan.parser()
        return self._parsers[index]

    def _choice(self, index: int, c: CompletionOutput, text: str) -> dict:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        reason = c.finish_reason
        parser = self._parser(index)
        if parser is not None:  # the model's tool-call text as OpenAI's tool_calls
            content, calls = parser.parse(text)
            if reason == "length" and parser.ended_in_call:  # max_tokens cut a call: no call, the text
                content, calls = text, []
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            reason = self.opts.tool_plan.finish_reason(reason, calls, parser.ended_in_call)
        return {"index": index, "message": message, "logprobs": None, "finish_reason": reason}

    def _delta(self, index: int, text: str, finish_reason: str | None) -> dict:
        return {"index": index, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}

    def _stream_choices(self, index: int, c: CompletionOutput) -> list[dict]:
        parser = self._parser(index)
        if parser is None:
            return super()._stream_choices(index, c)
        deltas = parser.feed(c.new_text) if c.new_text else []
        if c.finish_reason:
            deltas += parser.finish()
        choices = [{"index": index, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if c.finish_reason:
            reason = self.opts.tool_plan.finish_reason(c.finish_reason, parser.tool_calls, parser.ended_in_call)
            choices.append({"index": index, "delta": {}, "logprobs": None, "finish_reason": reason})
        return choices

    def _entry(self, token_id: int, logprob: float) -> dict:
        text = self.opts.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8", "replace"))}

    def _logprobs(self, index: int, token_ids: list[int], entries: list[dict[int, float]]) -> dict:
        content = []
        for t, entry in zip(token_ids, entries):
            lp, top = self._top(t, entry)
            content.append({**self._entry(t, lp), "top_logprobs": [self._entry(tt, v) for tt, v in top]})
        return {"content": content, "refusal": None}

    def start(self) -> list[dict]:
        return [self._chunk({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}) for i in range(self.num_choices)]
