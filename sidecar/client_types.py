"""What the sidecar's client hands back: results as frozen dataclasses, and PagedServeError for every failure.

ModelInfo, ServerStats and Usage are made from their protobuf messages (`message_dataclass`), so each holds
exactly the fields of its message in protos/pagedserve/v1/generation.proto, where they are documented: a
field added there reaches the client with no edit here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, TypeVar

import grpc
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from grpc_health.v1 import health_pb2

from .pb import generation_pb2 as pb

# Generate's response headers (gRPC initial metadata), sent as soon as the server admits a request, before
# any generation. The id is binary metadata (UTF-8 bytes): a client may choose any id, not only one that is
# a valid ASCII header value.
REQUEST_ID_HEADER = "pagedserve-request-id-bin"
PROMPT_TOKENS_HEADER = "pagedserve-prompt-tokens"


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
    `warnings` (the stream's first chunk only): what of the JSON Schema is approximated or not enforced;
    `schema_violations` (a sample's last chunk): how its output breaks that schema (empty: it conforms).
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    warnings: tuple[str, ...] = ()
    schema_violations: tuple[str, ...] = ()

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


# Scalar protobuf types -> the Python type of the dataclass field.
_PY_TYPES = {FieldDescriptor.CPPTYPE_INT32: int, FieldDescriptor.CPPTYPE_INT64: int,
             FieldDescriptor.CPPTYPE_UINT32: int, FieldDescriptor.CPPTYPE_UINT64: int,
             FieldDescriptor.CPPTYPE_DOUBLE: float, FieldDescriptor.CPPTYPE_FLOAT: float,
             FieldDescriptor.CPPTYPE_BOOL: bool, FieldDescriptor.CPPTYPE_STRING: str}


def message_dataclass(descriptor: Descriptor, doc: str) -> type:
    """A frozen dataclass with the scalar fields of a message, in its order, each defaulting to the proto's
    default (0, 0.0, "", False). `_from_message` fills it from a message."""
    specs = []
    for f in descriptor.fields:
        if f.cpp_type not in _PY_TYPES or f.is_repeated:
            raise TypeError(f"{descriptor.name}.{f.name}: only scalar fields map to a client dataclass")
        specs.append((f.name, _PY_TYPES[f.cpp_type], dataclasses.field(default=f.default_value)))
    listing = "\n".join(f"    {name}: {tp.__name__}" for name, tp, _ in specs)
    cls = dataclasses.make_dataclass(descriptor.name, specs, frozen=True, namespace={"__module__": __name__})
    cls.__doc__ = f"{doc}\n\nFields (protos/pagedserve/v1/generation.proto, message {descriptor.name}):\n{listing}"
    return cls


Usage = message_dataclass(pb.Usage.DESCRIPTOR,
                          "Token counts and timings (seconds) of a whole request; completion_tokens sums all samples.")
ModelInfo = message_dataclass(pb.ModelInfo.DESCRIPTOR, "The served model and what it runs on.")
ServerStats = message_dataclass(
    pb.ServerStats.DESCRIPTOR,
    "The engine's figures (runtime/outputs.py EngineStats, sidecar/stats_schema.py) and the server's uptime.")

_D = TypeVar("_D")


def _from_message(cls: type[_D], msg: Any) -> _D:
    # The dataclasses are made from the messages (message_dataclass): the same fields, by name.
    return cls(**{f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)})  # type: ignore[arg-type]


def _chunk(c: pb.Chunk, want_logprobs: bool) -> GenerationChunk:
    logprobs = None
    if want_logprobs or c.logprobs:
        logprobs = [TokenLogprob(t.token_id, t.logprob, [TopLogprob(x.token_id, x.logprob) for x in t.top_logprobs])
                    for t in c.logprobs]
    which = c.WhichOneof("stop_reason")
    return GenerationChunk(
        index=c.index, text=c.text, token_ids=list(c.token_ids), logprobs=logprobs,
        finish_reason=c.finish_reason or None,
        stop_reason=getattr(c, which) if which else None,
        warnings=tuple(c.warnings), schema_violations=tuple(c.schema_violations))


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


