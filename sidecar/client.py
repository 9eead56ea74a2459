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
"""

from __future__ import annotations

import asyncio
import json
import math
import operator
import os
from dataclasses import dataclass, fields
from typing import Any, Iterable, Mapping, Sequence, TypeVar, Union

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from .pb import generation_pb2 as pb
from .pb import generation_pb2_grpc as pb_grpc

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

DEFAULT_SOCKET = "/run/pagedserve/pagedserve.sock"
SOCKET_ENV = "PAGEDSERVE_SOCKET"
# A long generation on a CPU can take minutes; the small calls should answer at once.
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = 10.0
# gRPC's default 4 MiB receive limit is about 800k token ids; a tokenized book should still fit.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
# Read from the proto, so fields added to it later are accepted without touching this file.
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
# Guided decoding, as plain keywords: generate(prompt, json_schema={...}) (or regex=, choice=, ...).
CONSTRAINT_KWARGS = frozenset(f.name for f in pb.StructuredOutputs.DESCRIPTOR.fields)

# Generate's response headers (gRPC initial metadata), sent as soon as the server admits a request, before
# any generation. The id is binary metadata (UTF-8 bytes): a client may choose any id, not only one that is
# a valid ASCII header value.
REQUEST_ID_HEADER = "pagedserve-request-id-bin"
PROMPT_TOKENS_HEADER = "pagedserve-prompt-tokens"

Prompt = Union[str, Sequence[int]]
ChatMessage = Mapping[str, str]  # {"role": ..., "content": ...}, as in the OpenAI API


class PagedServeError(Exception):
    """A call failed. `code` is the gRPC status (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, UNAVAILABLE,
    DEADLINE_EXCEEDED, CANCELLED, ...) and `message` the server's (or gRPC's) explanation."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


def _error(e: grpc.RpcError) -> PagedServeError:
    code = e.code() if callable(getattr(e, "code", None)) else None
    details = e.details() if callable(getattr(e, "details", None)) else None
    return PagedServeError(code or grpc.StatusCode.UNKNOWN, details or str(e))


# -- what comes back ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's logprob and the top alternatives at its position (most likely first)."""

    token_id: int
    logprob: float
    top_logprobs: list[TopLogprob]


@dataclass(frozen=True)
class GenerationChunk:
    """New output of one sample: deltas, so concatenating `text` (or `token_ids`) gives the whole.

    `logprobs` has one entry per token id when the request asked for logprobs, else it is None.
    `finish_reason` is None until the sample's last chunk, then "stop", "length" or "abort";
    `stop_reason` then says which stop token id (int) or stop string (str) ended it (None for EOS).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class Admission:
    """Generate's response headers: the server checked the request and handed it to the engine. They come
    before any chunk, at once, however long the first chunk takes (best_of > n: until every sample is done)."""

    request_id: str
    prompt_tokens: int


def _admission(metadata: Any) -> Admission | None:
    values = dict(metadata or ())
    if REQUEST_ID_HEADER not in values:  # refused: the call ended with a status and no headers of ours
        return None
    rid = values[REQUEST_ID_HEADER]
    return Admission(rid.decode() if isinstance(rid, bytes) else rid, int(values.get(PROMPT_TOKENS_HEADER, 0)))


@dataclass(frozen=True)
class Usage:
    """Token counts and timings (seconds) of a whole request; completion_tokens sums all samples."""

    request_id: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    queue_time_s: float
    ttft_s: float
    e2e_s: float


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    dtype: str
    backend: str
    num_kv_blocks: int
    kernels: str
    blas_kernel: str
    blas_threads: int
    numba_code_path: str


@dataclass(frozen=True)
class ServerStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    kv_utilization: float
    prefix_cache_hit_rate: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    num_preemptions: int
    uptime_s: float
    # Disaggregated prefill/decode counters (0 on a colocated instance that nobody uses as a target).
    kv_blocks_sent: int = 0
    kv_blocks_received: int = 0
    remote_prefills: int = 0
    local_prefill_fallbacks: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    kv_transfer_s: float = 0.0
    spec_method: str = ""  # speculative decoding: "" when off
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_mean_accepted_length: float = 0.0


_D = TypeVar("_D")


def _from_message(cls: type[_D], msg: Any) -> _D:
    # The dataclasses mirror the messages field by field (a test keeps them in step).
    return cls(**{f.name: getattr(msg, f.name) for f in fields(cls)})  # type: ignore[arg-type]


def _chunk(c: pb.Chunk, want_logprobs: bool) -> GenerationChunk:
    logprobs = None
    if want_logprobs or c.logprobs:
        logprobs = [TokenLogprob(t.token_id, t.logprob, [TopLogprob(x.token_id, x.logprob) for x in t.top_logprobs])
                    for t in c.logprobs]
    which = c.WhichOneof("stop_reason")
    return GenerationChunk(
        index=c.index, text=c.text, token_ids=list(c.token_ids), logprobs=logprobs,
        finish_reason=c.finish_reason or None,
        stop_reason=getattr(c, which) if which else None)


# -- what goes out --------------------------------------------------------------------------------


def resolve_target(target: str | os.PathLike[str] | None = None) -> str:
    """The gRPC target for `target`: None -> $PAGEDSERVE_SOCKET, else /run/pagedserve/pagedserve.sock.

    A value with a scheme ("unix:///run/x.sock", "unix:/run/x.sock", "dns:...", "ipv4:...") is used
    as is; one containing "/" or no ":" is a socket path; anything else is "host:port".
    """
    if target is None:
        target = os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
    target = os.fspath(target)
    if not target:
        raise ValueError("target must be a socket path or host:port, got ''")
    if target.startswith(("unix:", "unix-abstract:", "dns:", "ipv4:", "ipv6:", "vsock:")):
        return target
    if "/" in target or ":" not in target:
        return "unix:" + os.path.abspath(os.path.expanduser(target))
    return target


def _structured_outputs(values: dict[str, Any]) -> pb.StructuredOutputs | None:
    """Pops the constraint keywords (json_schema=, regex=, choice=, grammar=, json_object=, or
    structured_outputs= as a message or a dict of them) into one StructuredOutputs message. More than one
    is sent as given: the server answers INVALID_ARGUMENT, as it does for every bad value."""
    given = {k: values.pop(k) for k in CONSTRAINT_KWARGS if k in values}
    so = values.pop("structured_outputs", None)
    if isinstance(so, pb.StructuredOutputs):
        if given:
            raise TypeError(f"pass structured_outputs or {', '.join(given)}, not both")
        return so
    if isinstance(so, Mapping):
        so = dict(so)
        if "json" in so:  # vLLM's name
            so["json_schema"] = so.pop("json")
        given = {**so, **given}
    elif so is not None:
        raise TypeError(f"structured_outputs must be a StructuredOutputs message or a dict, got {type(so).__name__}")
    if not given:
        return None
    if len(given) > 1:  # a oneof keeps only the last; say so here rather than send something else
        raise ValueError(f"structured outputs take exactly one constraint, got {', '.join(sorted(given))}")
    (kind, value), = given.items()
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value)
    if kind == "choice":
        if isinstance(value, str):
            raise TypeError("choice must be a list of strings, not one string")
        value = pb.Choice(options=list(value))
    try:
        return pb.StructuredOutputs(**{kind: value})
    except (TypeError, ValueError) as e:
        raise TypeError(f"{kind}: {e}") from None


def _sampling(caller: str, kwargs: dict[str, Any]) -> tuple[pb.SamplingParams, bool]:
    """The SamplingParams message for `kwargs`, and whether logprobs were asked for."""
    unknown = sorted(set(kwargs) - SAMPLING_FIELDS - CONSTRAINT_KWARGS)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"sampling parameters are: {', '.join(sorted(SAMPLING_FIELDS | CONSTRAINT_KWARGS))}")
    values = {k: v for k, v in kwargs.items() if v is not None}
    if isinstance(values.get("stop"), str):  # SamplingParams takes one stop string too
        values["stop"] = [values["stop"]]
    structured = _structured_outputs(values)
    if structured is not None:
        values["structured_outputs"] = structured
    return pb.SamplingParams(**values), "logprobs" in values


def _token_ids(ids: Iterable[Any]) -> list[int]:
    # operator.index takes ints and numpy integers but refuses 1.5 instead of truncating it.
    return [operator.index(t) for t in ids]


def _chat(messages: Sequence[ChatMessage], add_generation_prompt: bool | None) -> pb.ChatMessages:
    if isinstance(messages, (str, bytes)) or isinstance(messages, Mapping):
        raise TypeError("messages must be a list of {'role': ..., 'content': ...} dicts")
    out = []
    for i, m in enumerate(messages):
        try:
            out.append(pb.ChatMessage(role=m["role"], content=m["content"]))
        except (KeyError, TypeError):
            raise TypeError(f"messages[{i}] must be a dict with 'role' and 'content' strings, got {m!r}") from None
    return pb.ChatMessages(messages=out, add_generation_prompt=add_generation_prompt)


def _generate_request(caller: str, prompt: Prompt | None, chat: pb.ChatMessages | None, request_id: str,
                      sampling: dict[str, Any]) -> tuple[pb.GenerateRequest, bool]:
    params, want_logprobs = _sampling(caller, sampling)
    req = pb.GenerateRequest(request_id=request_id or "", sampling=params)
    if chat is not None:
        req.chat.CopyFrom(chat)
    elif isinstance(prompt, str):
        req.text = prompt
    elif isinstance(prompt, (bytes, bytearray)) or prompt is None:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
    else:
        req.token_ids.ids.extend(_token_ids(prompt))
    return req, want_logprobs


def _tokenize_request(prompt: str | Sequence[ChatMessage], add_special_tokens: bool | None,
                      add_generation_prompt: bool) -> pb.TokenizeRequest:
    req = pb.TokenizeRequest(add_special_tokens=add_special_tokens)
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.chat.CopyFrom(_chat(prompt, add_generation_prompt))
    return req


def _texts(chunks: Iterable[GenerationChunk], n: int | None) -> str | list[str]:
    # The rule: the return type follows the n that was asked for, never what came back.
    texts = [""] * max(n or 1, 1)
    for c in chunks:
        if c.index < len(texts):
            texts[c.index] += c.text
    return texts if n is not None and n > 1 else texts[0]


def _health_status(resp: health_pb2.HealthCheckResponse) -> str:
    try:
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    except ValueError:  # a status newer than this client
        return "UNKNOWN"


def _timeout(timeout: float | None, default: float | None) -> float | None:
    t = default if timeout is None else timeout
    return None if t is None or math.isinf(t) else t


# -- the streams ----------------------------------------------------------------------------------


class GenerateStream:
    """The chunks of one Generate RPC, as they arrive. After the last chunk, `usage` holds the request's
    token counts and timings and `request_id` its id. `close()` (or leaving a `with` block, or dropping
    the stream before its end) cancels the RPC."""

    def __init__(self, call: Any, want_logprobs: bool, request_id: str) -> None:
        self._call = call
        self._want_logprobs = want_logprobs
        self._done = False
        self.request_id: str | None = request_id or None
        self.usage: Usage | None = None
        self._admission: Admission | None = None

    def __iter__(self) -> GenerateStream:
        return self

    def admitted(self) -> Admission:
        """Wait for the response headers, which the server sends as soon as it admitted the request (before
        generating anything). Raises PagedServeError if it refused the request (INVALID_ARGUMENT, ...).
        Needs a server that sends them (this version on): an older one sends its headers with the first
        chunk, and this then waits for the end of a stream nobody reads."""
        if self._admission is None:
            admission = _admission(self._call.initial_metadata())
            if admission is None:
                raise PagedServeError(self._call.code(), self._call.details() or "no response headers")
            self._admission = admission
            self.request_id = admission.request_id
        return self._admission

    def __next__(self) -> GenerationChunk:
        while not self._done:
            try:
                resp = next(self._call)
            except StopIteration:
                self._done = True
                break
            except grpc.RpcError as e:
                cancelled_by_us = self._done
                self._done = True
                if cancelled_by_us:
                    break
                raise _error(e) from None
            kind = resp.WhichOneof("kind")
            if kind == "chunk":
                return _chunk(resp.chunk, self._want_logprobs)
            if kind == "usage":
                self.usage = _from_message(Usage, resp.usage)
                self.request_id = self.usage.request_id
            # Anything else is a kind added to the proto after this client: skip it.
        raise StopIteration

    def close(self) -> None:
        """Cancel the RPC if it is still running (the server aborts the request). Idempotent."""
        if not self._done:
            self._done = True
            self._call.cancel()

    cancel = close

    def __enter__(self) -> GenerateStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown, channel already closed: nothing left to cancel
            pass


class AsyncGenerateStream:
    """The asyncio twin of GenerateStream: `async for chunk in stream`, then `stream.usage`.
    `await stream.aclose()` (or leaving an `async with` block, or dropping it) cancels the RPC."""

    def __init__(self, call: Any, want_logprobs: bool, request_id: str) -> None:
        self._call = call
        self._want_logprobs = want_logprobs
        self._done = False
        self.request_id: str | None = request_id or None
        self.usage: Usage | None = None
        self._admission: Admission | None = None

    def __aiter__(self) -> AsyncGenerateStream:
        return self

    async def admitted(self) -> Admission:
        """Wait for the response headers (see GenerateStream.admitted)."""
        if self._admission is None:
            admission = _admission(await self._call.initial_metadata())
            if admission is None:
                raise PagedServeError(await self._call.code(), await self._call.details() or "no response headers")
            self._admission = admission
            self.request_id = admission.request_id
        return self._admission

    async def __anext__(self) -> GenerationChunk:
        while not self._done:
            try:
                resp = await self._call.read()
            except grpc.RpcError as e:
                cancelled_by_us = self._done
                self._done = True
                if cancelled_by_us:
                    break
                raise _error(e) from None
            except asyncio.CancelledError:
                if self._done:  # cancel() ran while this read was waiting
                    break
                self.cancel()  # our task is being cancelled: take the RPC down with it
                raise
            if resp is grpc.aio.EOF:
                self._done = True
                break
            kind = resp.WhichOneof("kind")
            if kind == "chunk":
                return _chunk(resp.chunk, self._want_logprobs)
            if kind == "usage":
                self.usage = _from_message(Usage, resp.usage)
                self.request_id = self.usage.request_id
        raise StopAsyncIteration

    def cancel(self) -> None:
        """Cancel the RPC if it is still running (the server aborts the request). Idempotent."""
        if not self._done:
            self._done = True
            self._call.cancel()

    async def aclose(self) -> None:
        self.cancel()

    async def __aenter__(self) -> AsyncGenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.cancel()

    def __del__(self) -> None:
        try:
            self.cancel()
        except Exception:  # the event loop or channel is already gone
            pass


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
        """Stream the continuation of `prompt` (text, or token ids used as is)."""
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
