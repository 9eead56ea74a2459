"""Python client of the pagedserve sidecar: `PagedServeClient` (blocking) and `AsyncPagedServeClient`.

    from pagedserve.sidecar.client import PagedServeClient

    with PagedServeClient() as client:              # $PAGEDSERVE_SOCKET or /run/pagedserve/pagedserve.sock
        print(client.generate_text("The capital of France is", max_tokens=8, temperature=0))
        stream = client.generate("Once upon a time", max_tokens=64)
        for chunk in stream:                        # chunks arrive as they are generated
            print(chunk.text, end="", flush=True)
        print(stream.usage)                         # token counts and timings, once the stream ended

Sampling keyword arguments are the fields of `SamplingParams` in protos/pagedserve/v1/generation.proto
(vLLM's names: n, temperature, top_p, top_k, max_tokens, stop, seed, logprobs, ...). The client checks
only their names (an unknown one raises TypeError before anything is sent); their values are checked by
the server, which answers INVALID_ARGUMENT with a message naming the field. Leaving one out (or passing
None) means the server's default. Guided decoding takes one of `json_schema=` (a dict or a JSON string),
`regex=`, `choice=` (a list), `grammar=` (Lark or GBNF) or `json_object=True`.

Every failed call raises `PagedServeError(code, message)`, never a raw grpc.RpcError. Stopping early
(breaking out of the loop over a stream and dropping it, `stream.close()`, leaving a `with` block over
it) cancels the RPC, and the server then aborts the request and frees its KV cache blocks.

This module holds the two clients; what they send is built in client_requests.py, what comes back is in
client_types.py, and the streams of a generation in client_streams.py. Import everything from here.
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .client_requests import (_CHANNEL_OPTIONS, DEFAULT_GENERATE_TIMEOUT_S, DEFAULT_TIMEOUT_S, ChatMessage, Prompt,
                              _chat, _generate_request, _timeout, _token_ids, _tokenize_request, resolve_target)
from .client_streams import AsyncGenerateStream, GenerateStream
from .client_types import (Admission, GenerationChunk, ModelInfo, PagedServeError, ServerStats, TokenLogprob,
                           TopLogprob, Usage, _error, _from_message, _health_status, _texts)
from .pb import generation_pb2 as pb
from .pb import generation_pb2_grpc as pb_grpc

# Importable from here too, as before the client was split into client_types, client_requests and client_streams.
from .client_requests import CONSTRAINT_KWARGS, DEFAULT_SOCKET, SAMPLING_FIELDS, SOCKET_ENV, _sampling  # noqa: F401
from .client_types import PROMPT_TOKENS_HEADER, REQUEST_ID_HEADER, message_dataclass  # noqa: F401

__all__ = [
    "Admission",
    "AsyncGenerateStream",
    "AsyncPagedServeClient",
    "GenerateStream",
    "GenerationChunk",
    "ModelInfo",
    "PagedServeClient",
    "PagedServeError",
    "ServerStats",
    "TokenLogprob",
    "TopLogprob",
    "Usage",
    "resolve_target",
]


# -- the clients ----------------------------------------------------------------------------------


class _Base:
    def __init__(self, target: str | os.PathLike[str] | None, timeout: float | None,
                 generate_timeout: float | None, wait_for_ready: bool) -> None:
        self.target = resolve_target(target)
        self.timeout = timeout
        self.generate_timeout = generate_timeout
        # False: a call to a server that is not up fails at once with UNAVAILABLE. True: it waits
        # (within its timeout) for the server to come up, e.g. in a script started with the service.
        self.wait_for_ready = wait_for_ready

    def _kw(self, timeout: float | None, generate: bool = False) -> dict[str, Any]:
        default = self.generate_timeout if generate else self.timeout
        return {"timeout": _timeout(timeout, default), "wait_for_ready": self.wait_for_ready}


class PagedServeClient(_Base):
    """A blocking client. `target`: a unix socket path, "unix:///path", or "host:port"; None reads
    $PAGEDSERVE_SOCKET, else /run/pagedserve/pagedserve.sock.

    `timeout` (seconds) bounds each small call, `generate_timeout` a whole generation; None means no
    limit. Each method's `timeout=` overrides them for one call (float("inf") = no limit).
    """

    def __init__(self, target: str | os.PathLike[str] | None = None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 generate_timeout: float | None = DEFAULT_GENERATE_TIMEOUT_S, wait_for_ready: bool = False,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(target, timeout, generate_timeout, wait_for_ready)
        self._channel = grpc.insecure_channel(self.target, options=[*_CHANNEL_OPTIONS, *options])
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return method(request, **self._kw(timeout))
        except grpc.RpcError as e:
            raise _error(e) from None

    # generation

    def generate(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                 **sampling: Any) -> GenerateStream:
        """Stream the continuation of `prompt` (text, or token ids used as is). `priority=` (an int, lower first)
        ranks it under the server's --scheduling-policy priority or fair; the rest are sampling fields."""
        req, want_logprobs = _generate_request("generate", prompt, None, request_id, sampling)
        return GenerateStream(self._stub.Generate(req, **self._kw(timeout, generate=True)), want_logprobs, request_id)

    def generate_text(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                      **sampling: Any) -> str | list[str]:
        """The whole generated text: a str, or, when n > 1 is passed, a list of n texts by sample index."""
        with self.generate(prompt, request_id=request_id, timeout=timeout, **sampling) as stream:
            return _texts(stream, sampling.get("n"))

    def chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, request_id: str = "",
             timeout: float | None = None, **sampling: Any) -> GenerateStream:
        """Stream the reply to a conversation ([{"role": "user", "content": "Hi"}, ...]), rendered by
        the model's chat template on the server."""
        req, want_logprobs = _generate_request("chat", None, _chat(messages, add_generation_prompt), request_id,
                                               sampling)
        return GenerateStream(self._stub.Generate(req, **self._kw(timeout, generate=True)), want_logprobs, request_id)

    def chat_text(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                  request_id: str = "", timeout: float | None = None, **sampling: Any) -> str | list[str]:
        """The whole reply: a str, or, when n > 1 is passed, a list of n texts by sample index."""
        with self.chat(messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                       timeout=timeout, **sampling) as stream:
            return _texts(stream, sampling.get("n"))

    def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        """Abort a running or waiting request; False if no such request (unknown or finished)."""
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout).found

    # tokenizer

    def tokenize(self, prompt: str | Sequence[ChatMessage], *, add_special_tokens: bool | None = None,
                 add_generation_prompt: bool = True, timeout: float | None = None) -> list[int]:
        """Token ids of a text, or of a conversation rendered by the chat template. add_special_tokens
        None: the server's default (true for text, false for a conversation)."""
        req = _tokenize_request(prompt, add_special_tokens, add_generation_prompt)
        return list(self._unary(self._stub.Tokenize, req, timeout).token_ids)

    def detokenize(self, token_ids: Iterable[int], *, skip_special_tokens: bool | None = None,
                   timeout: float | None = None) -> str:
        req = pb.DetokenizeRequest(token_ids=_token_ids(token_ids), skip_special_tokens=skip_special_tokens)
        return self._unary(self._stub.Detokenize, req, timeout).text

    # server

    def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return _from_message(ModelInfo, self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    def server_stats(self, *, timeout: float | None = None) -> ServerStats:
        return _from_message(ServerStats, self._unary(self._stub.GetServerStats, pb.GetServerStatsRequest(), timeout))

    def health(self, service: str = "", *, timeout: float | None = None) -> str:
        """grpc.health.v1 status: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN" or "UNKNOWN". `service`
        "" is the whole server, "pagedserve.v1.Generation" the generation service."""
        return _health_status(self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout))

    def close(self) -> None:
        """Close the channel; RPCs still running are cancelled."""
        self._channel.close()

    def __enter__(self) -> PagedServeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncPagedServeClient(_Base):
    """The asyncio client (grpc.aio); same arguments and methods as PagedServeClient, awaited, except
    `generate` and `chat`, which return an AsyncGenerateStream at once (`async for` over it). Create it
    inside the event loop that uses it."""

    def __init__(self, target: str | os.PathLike[str] | None = None, *, timeout: float | None = DEFAULT_TIMEOUT_S,
                 generate_timeout: float | None = DEFAULT_GENERATE_TIMEOUT_S, wait_for_ready: bool = False,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        super().__init__(target, timeout, generate_timeout, wait_for_ready)
        self._channel = grpc.aio.insecure_channel(self.target, options=[*_CHANNEL_OPTIONS, *options])
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    async def _unary(self, method: Any, request: Any, timeout: float | None) -> Any:
        try:
            return await method(request, **self._kw(timeout))
        except grpc.RpcError as e:
            raise _error(e) from None

    def generate(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                 **sampling: Any) -> AsyncGenerateStream:
        req, want_logprobs = _generate_request("generate", prompt, None, request_id, sampling)
        return AsyncGenerateStream(self._stub.Generate(req, **self._kw(timeout, generate=True)), want_logprobs,
                                   request_id)

    async def generate_text(self, prompt: Prompt, *, request_id: str = "", timeout: float | None = None,
                            **sampling: Any) -> str | list[str]:
        async with self.generate(prompt, request_id=request_id, timeout=timeout, **sampling) as stream:
            return _texts([c async for c in stream], sampling.get("n"))

    def chat(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True, request_id: str = "",
             timeout: float | None = None, **sampling: Any) -> AsyncGenerateStream:
        req, want_logprobs = _generate_request("chat", None, _chat(messages, add_generation_prompt), request_id,
                                               sampling)
        return AsyncGenerateStream(self._stub.Generate(req, **self._kw(timeout, generate=True)), want_logprobs,
                                   request_id)

    async def chat_text(self, messages: Sequence[ChatMessage], *, add_generation_prompt: bool = True,
                        request_id: str = "", timeout: float | None = None, **sampling: Any) -> str | list[str]:
        async with self.chat(messages, add_generation_prompt=add_generation_prompt, request_id=request_id,
                             timeout=timeout, **sampling) as stream:
            return _texts([c async for c in stream], sampling.get("n"))

    async def abort(self, request_id: str, *, timeout: float | None = None) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).found

    async def tokenize(self, prompt: str | Sequence[ChatMessage], *, add_special_tokens: bool | None = None,
                       add_generation_prompt: bool = True, timeout: float | None = None) -> list[int]:
        req = _tokenize_request(prompt, add_special_tokens, add_generation_prompt)
        return list((await self._unary(self._stub.Tokenize, req, timeout)).token_ids)

    async def detokenize(self, token_ids: Iterable[int], *, skip_special_tokens: bool | None = None,
                         timeout: float | None = None) -> str:
        req = pb.DetokenizeRequest(token_ids=_token_ids(token_ids), skip_special_tokens=skip_special_tokens)
        return (await self._unary(self._stub.Detokenize, req, timeout)).text

    async def model_info(self, *, timeout: float | None = None) -> ModelInfo:
        return _from_message(ModelInfo, await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout))

    async def server_stats(self, *, timeout: float | None = None) -> ServerStats:
        msg = await self._unary(self._stub.GetServerStats, pb.GetServerStatsRequest(), timeout)
        return _from_message(ServerStats, msg)

    async def health(self, service: str = "", *, timeout: float | None = None) -> str:
        req = health_pb2.HealthCheckRequest(service=service)
        return _health_status(await self._unary(self._health.Check, req, timeout))

    async def close(self) -> None:
        await self._channel.close()

    async def __aenter__(self) -> AsyncPagedServeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
