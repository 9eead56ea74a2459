"""What the sidecar's client sends: the target it dials, its timeouts, and the request messages built from a
prompt (text or token ids), a conversation, and sampling keywords checked against the proto's field names."""

from __future__ import annotations

import json
import math
import operator
import os
from typing import Any, Iterable, Mapping, Sequence, Union

from .pb import generation_pb2 as pb

DEFAULT_SOCKET = "/run/pagedserve/pagedserve.sock"
SOCKET_ENV = "PAGEDSERVE_SOCKET"
# A long generation on a CPU can take minutes; the small calls should answer at once.
DEFAULT_GENERATE_TIMEOUT_S = 600.0
DEFAULT_TIMEOUT_S = 10.0
# gRPC's default 4 MiB receive limit is about 800k token ids; a tokenized book should still fit.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
# Read from the proto, so fields added to it later are accepted without touching this file.
SAMPLING_FIELDS = frozenset(f.name for f in pb.SamplingParams.DESCRIPTOR.fields)
# Guided decoding, as plain keywords: generate(prompt, json_schema={...}) (or regex=, choice=, ...), and
# strict=True (refuse a JSON Schema that cannot be enforced exactly instead of approximating it).
CONSTRAINT_KWARGS = frozenset(f.name for f in pb.StructuredOutputs.DESCRIPTOR.fields)
OPTION_KWARGS = frozenset({"strict"})  # StructuredOutputs fields that are options, not constraints

Prompt = Union[str, Sequence[int]]
ChatMessage = Mapping[str, str]  # {"role": ..., "content": ...}, as in the OpenAI API


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
    options = {k: given.pop(k) for k in OPTION_KWARGS if k in given}
    if not given:
        if options:
            raise ValueError(f"{', '.join(sorted(options))} needs a constraint (json_schema=, regex=, ...)")
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
        return pb.StructuredOutputs(**{kind: value}, **options)
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
    sampling = dict(sampling)
    priority = sampling.pop("priority", 0)  # not a sampling field: the request's (vLLM's priority, lower first)
    lora_name = sampling.pop("lora_name", None) or ""  # the LoRA adapter to run with (GenerateRequest.lora_name)
    params, want_logprobs = _sampling(caller, sampling)
    req = pb.GenerateRequest(request_id=request_id or "", sampling=params, priority=priority, lora_name=lora_name)
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


def _timeout(timeout: float | None, default: float | None) -> float | None:
    t = default if timeout is None else timeout
    return None if t is None or math.isinf(t) else t

