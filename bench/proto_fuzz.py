"""Hypothesis strategies for pagedserve.v1 requests, built from the proto descriptors.

Every field of a message gets a strategy from its type, so a field added to the proto is fuzzed
without touching this file:

    int32 / int64 / uint32   the extremes (0, +-1, +-2^31, 2^63 - 1, ...) and the sizes that matter to the
                             server (20/21 logprobs, the vocabulary, max_model_len), then any value
    double / float           NaN, +-inf, +-0, +-1e308, 1e-300, 1e-5, then any float
    bool                     both
    string                   empty, a NUL, a huge string (past max_prompt_chars), then any text
    message                  the same, recursively (depth-limited)
    repeated                 usually a few values, sometimes none, sometimes very many
    optional / oneof         unset as often as set; at most one member of a oneof

Half the Generate requests are drawn "mild" instead (ints in [1, 6], floats in [0.05, 1], known roles), so
that many are accepted and exercise the engine's every stage, not only the validation.

A few fields by name get values that hit their meaning: token ids (in and out of the vocabulary),
chat roles (the known ones, empty, random), request ids (a handful shared by many requests, so
duplicates in flight happen, and ones with '#' or past the length limit).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st

from pagedserve.sidecar.pb import generation_pb2 as pb


@dataclass(frozen=True)
class FuzzShape:
    """Sizes of the server under test, to aim values at its limits."""

    vocab_size: int
    max_model_len: int
    max_prompt_chars: int


def _ints(lo: int, hi: int, shape: FuzzShape) -> st.SearchStrategy[int]:
    special = [0, 1, -1, 2, 16, 20, 21, 255, 256, 257, shape.vocab_size - 1, shape.vocab_size,
               shape.max_model_len - 1, shape.max_model_len, 2**31 - 1, -(2**31), 2**32 - 1, 2**63 - 1, -(2**63)]
    special = sorted({v for v in special if lo <= v <= hi})
    return st.one_of(st.sampled_from(special), st.integers(max(lo, -3), min(hi, 40)), st.integers(lo, hi))


def _floats() -> st.SearchStrategy[float]:
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e-300, 1e-6, 1e-5, 2e-5, 0.5, 1.0, 1.5, 2.0, -2.0, 2.5,
               1e308, -1e308, 5e-324]
    return st.one_of(st.sampled_from(special), st.floats(-3, 3), st.floats(allow_nan=True, allow_infinity=True))


def _strings(shape: FuzzShape) -> st.SearchStrategy[str]:
    # Built once and shared: thousands of drawn requests refer to the same few huge strings.
    huge = ["\u00e9" * n for n in (shape.max_prompt_chars, shape.max_prompt_chars + 1, 3 * shape.max_prompt_chars)]
    normal = st.one_of(st.sampled_from(["", "\x00", "\ufffd", "a" * 1001, "<|im_start|>", "\n\n"]),
                       st.text(max_size=40))
    return st.integers(0, 49).flatmap(lambda k: st.sampled_from(huge) if k == 0 else normal)


def _token_ids(shape: FuzzShape) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, shape.vocab_size - 1), _ints(-(2**31), 2**31 - 1, shape))


_INT_RANGES = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_SINT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_SFIXED32: (-(2**31), 2**31 - 1), FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
    FieldDescriptor.TYPE_FIXED32: (0, 2**32 - 1), FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_SINT64: (-(2**63), 2**63 - 1), FieldDescriptor.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT64: (0, 2**64 - 1), FieldDescriptor.TYPE_FIXED64: (0, 2**64 - 1),
}


def _scalar(f: FieldDescriptor, shape: FuzzShape, depth: int, mild: bool) -> st.SearchStrategy[Any]:
    name = f.name
    if mild and f.type != FieldDescriptor.TYPE_MESSAGE:
        # Plausible values, so that many requests are accepted and run through the engine's every stage.
        if name in ("ids", "token_ids", "stop_token_ids") and f.type in _INT_RANGES:
            return st.integers(0, shape.vocab_size - 1)
        if name == "role":
            return st.sampled_from(["system", "user", "assistant"])
        if name == "request_id":
            return st.integers(0, 9).flatmap(lambda k: st.sampled_from(["dup", "dup-2"]) if k == 0 else st.just(""))
        if f.type in _INT_RANGES:
            lo, hi = _INT_RANGES[f.type]
            return st.integers(max(lo, 1), min(hi, 6))
        if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
            return st.floats(0.05, 1.0)
        if f.type == FieldDescriptor.TYPE_STRING:
            return st.text(min_size=1, max_size=24)
    if name in ("ids", "token_ids", "stop_token_ids") and f.type in _INT_RANGES:
        return _token_ids(shape)
    if name == "role":
        return st.one_of(st.sampled_from(["system", "user", "assistant", "tool", "", "wizard", "USER"]),
                         st.text(max_size=8))
    if name == "request_id":
        return st.one_of(st.sampled_from(["", "dup", "dup", "dup-2", "a#b", "x" * 300]), st.text(max_size=12))
    if f.type in _INT_RANGES:
        return _ints(*_INT_RANGES[f.type], shape)
    if f.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return _floats()
    if f.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if f.type == FieldDescriptor.TYPE_STRING:
        return _strings(shape)
    if f.type == FieldDescriptor.TYPE_BYTES:
        return st.binary(max_size=64)
    if f.type == FieldDescriptor.TYPE_ENUM:
        return st.sampled_from([v.number for v in f.enum_type.values] + [999])
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        return message_strategy(f.message_type, shape, depth + 1, mild)
    raise TypeError(f"no strategy for field {f.full_name} of type {f.type}")


def _field(f: FieldDescriptor, shape: FuzzShape, depth: int, mild: bool) -> st.SearchStrategy[Any]:
    if _is_map(f):  # map<K, V>: a dict of fuzzed keys and values (and, not mild, one with a key per vocab id)
        key, value = (_scalar(f.message_type.fields_by_name[n], shape, depth, mild) for n in ("key", "value"))
        small = st.dictionaries(key, value, max_size=4 if mild else 6)
        if mild:
            return small
        return st.one_of(small, small, value.map(lambda v: dict.fromkeys(range(2 * shape.vocab_size), v)))
    one = _scalar(f, shape, depth, mild)
    if not _repeated(f):
        return one
    if mild:
        return st.lists(one, min_size=0 if f.name.startswith("stop") else 1, max_size=4)
    # Very many values, to cross every count limit: ids past max_model_len, stops past their count,
    # chat messages past their count (empty ones: a list of huge ones would not fit in memory here).
    if f.type == FieldDescriptor.TYPE_MESSAGE:
        many = st.just(None).map(lambda _: [_message_class(f.message_type)() for _ in range(1100)])
    elif f.type == FieldDescriptor.TYPE_STRING:
        many = st.text(min_size=1, max_size=3).map(lambda v: [v] * 100)
    else:
        many = one.map(lambda v: [v] * (3 * shape.max_model_len))
    return st.one_of(st.lists(one, max_size=6), st.lists(one, max_size=6), many)


def message_strategy(desc: Descriptor, shape: FuzzShape, depth: int = 0, mild: bool = False) -> st.SearchStrategy[Any]:
    """Messages of type `desc` with every field unset or fuzzed; one member (or none) per oneof.
    mild: plausible values instead of extremes (ints in [1, 6], floats in [0.05, 1], known roles)."""
    if depth > 3:
        return st.just(None)
    # proto3 `optional` fields sit in a synthetic oneof of their own: they are plain unset-or-set fields.
    real = [o for o in desc.oneofs if not (len(o.fields) == 1 and o.name == "_" + o.fields[0].name)]
    in_oneof = {f.name for o in real for f in o.fields}
    # Mild: only fields with presence (proto3 `optional`, sub-messages) may be left unset.
    always = {f.name for f in desc.fields if f.name in in_oneof or (mild and not _has_presence(f))}
    fields = {f.name: _field(f, shape, depth, mild) if f.name in always
              else st.one_of(st.none(), _field(f, shape, depth, mild)) for f in desc.fields}
    # Mild: a member of every oneof is set (Hypothesis favours the first choice, so None would dominate).
    oneofs = {o.name: st.sampled_from(([] if mild else [None]) + [f.name for f in o.fields]) for o in real}
    cls = _message_class(desc)

    def build(values: dict[str, Any], chosen: dict[str, str | None]) -> Any:
        msg = cls()
        skip = {f.name for o in real for f in o.fields if f.name != chosen[o.name]}
        for f in desc.fields:
            v = values[f.name]
            if v is None or f.name in skip:
                continue
            if _is_map(f):
                getattr(msg, f.name).update(v)
            elif _repeated(f):
                target = getattr(msg, f.name)
                if f.type == FieldDescriptor.TYPE_MESSAGE:
                    for item in v:
                        if item is not None:
                            target.add().CopyFrom(item)
                else:
                    target.extend(v)
            elif f.type == FieldDescriptor.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(v)
                getattr(msg, f.name).SetInParent()  # set even when empty (an empty prompt is a case too)
            else:
                setattr(msg, f.name, v)
        return msg

    return st.builds(build, st.fixed_dictionaries(fields), st.fixed_dictionaries(oneofs))


def _repeated(f: FieldDescriptor) -> bool:
    if hasattr(f, "is_repeated"):  # protobuf >= 5.29: `label` is deprecated, then gone
        return f.is_repeated
    return f.label == FieldDescriptor.LABEL_REPEATED


def _is_map(f: FieldDescriptor) -> bool:
    return f.type == FieldDescriptor.TYPE_MESSAGE and f.message_type.GetOptions().map_entry


def _has_presence(f: FieldDescriptor) -> bool:
    return bool(getattr(f, "has_presence", False)) and not _repeated(f)


def _message_class(desc: Descriptor) -> type:
    from google.protobuf import message_factory

    return message_factory.GetMessageClass(desc)


def requests(shape: FuzzShape) -> st.SearchStrategy[tuple[str, Any]]:
    """(rpc name, request message): mostly Generate (extreme and plausible), some Tokenize and Detokenize."""
    return st.one_of(
        message_strategy(pb.GenerateRequest.DESCRIPTOR, shape).map(lambda m: ("Generate", m)),
        message_strategy(pb.GenerateRequest.DESCRIPTOR, shape, mild=True).map(lambda m: ("Generate", m)),
        message_strategy(pb.GenerateRequest.DESCRIPTOR, shape, mild=True).map(lambda m: ("Generate", m)),
        message_strategy(pb.TokenizeRequest.DESCRIPTOR, shape).map(lambda m: ("Tokenize", m)),
        message_strategy(pb.DetokenizeRequest.DESCRIPTOR, shape).map(lambda m: ("Detokenize", m)),
    )


def draw_requests(shape: FuzzShape, n: int, seed: int = 0, chunk: int = 500):
    """n requests drawn by Hypothesis (generation only: no shrinking, no example database), yielded in
    chunks so that only a chunk's messages are held at once."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    for k, start in enumerate(range(0, n, chunk)):
        drawn: list[tuple[str, Any]] = []

        @hseed(seed * 100_003 + k)
        @settings(max_examples=min(chunk, n - start), database=None, deadline=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(requests(shape))
        def collect(item: tuple[str, Any]) -> None:
            drawn.append(item)

        collect()
        yield drawn
