"""What one request may ask of the server, checked before anything is allocated for it.

SamplingParams checks that each value makes sense on its own (top_p in (0, 1], ...). These checks
compare a request with the server it was sent to: its limits (max_num_seqs, max_model_len, the KV
pool, the vocabulary) and the caps below, which bound what a single request can make the server
spend (memory per sample, CPU per token for stop strings, bytes in logs and maps for ids).

Every failure is a ValueError that names the field and the limit, so the sidecar can answer
INVALID_ARGUMENT with the message as is. The order matters: the cheap checks on the parameters run
before the prompt is tokenized, and nothing here allocates more than the request itself.

Why the KV check counts every sample: the samples of a request (n, best_of) fork from its prompt and
then run side by side, each needing its own blocks for its output:

    needed = full prompt blocks (shared)  +  samples x (blocks of prompt + max_tokens - shared)

A request that cannot fit the whole pool could never run; it is refused now rather than left to
preempt and be recomputed forever.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Sequence

from ..sampling_params import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """Caps on one request; the server's own sizes (max_num_seqs, max_model_len, KV pool) come on top."""

    max_logprobs: int = 20  # vLLM's default; each logprob costs a top-k over the vocabulary per token
    max_stop_strings: int = 64  # each is searched for in the new text of every token
    max_stop_string_chars: int = 1000
    max_stop_token_ids: int = 1024
    max_request_id_chars: int = 256
    max_cache_salt_chars: int = 1024

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "max_logprobs" else 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ServerShape:
    """The sizes of the engine a request is checked against."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int


def check_ids(limits: RequestLimits, request_id: object, cache_salt: object) -> None:
    if not isinstance(request_id, str) or not request_id or "#" in request_id:
        raise ValueError(f"request_id must be a non-empty string without '#', got {_short(request_id)}")
    if len(request_id) > limits.max_request_id_chars:
        raise ValueError(f"request_id is {len(request_id)} characters; the limit is {limits.max_request_id_chars}")
    if cache_salt is not None:
        if not isinstance(cache_salt, str):
            raise ValueError(f"cache_salt must be a string, got {_short(cache_salt)}")
        if len(cache_salt) > limits.max_cache_salt_chars:
            raise ValueError(f"cache_salt is {len(cache_salt)} characters; the limit is {limits.max_cache_salt_chars}")


def check_params(limits: RequestLimits, shape: ServerShape, params: SamplingParams) -> None:
    """The parameters against the server, before the prompt is even tokenized."""
    samples = params.num_sequences
    if params.n > shape.max_num_seqs:
        raise ValueError(f"n ({params.n}) exceeds max_num_seqs ({shape.max_num_seqs})")
    if samples > shape.max_num_seqs:
        raise ValueError(f"best_of ({samples}) exceeds max_num_seqs ({shape.max_num_seqs})")
    if params.logprobs is not None and params.logprobs > limits.max_logprobs:
        raise ValueError(f"logprobs must be in [0, {limits.max_logprobs}] (max_logprobs), got {params.logprobs}")
    if params.top_k > shape.vocab_size:
        raise ValueError(f"top_k ({params.top_k}) exceeds the vocabulary size ({shape.vocab_size})")
    if params.max_tokens >= shape.max_model_len:
        raise ValueError(f"max_tokens ({params.max_tokens}) plus the prompt exceeds max_model_len "
                         f"({shape.max_model_len})")
    if len(params.stop) > limits.max_stop_strings:
        raise ValueError(f"stop has {len(params.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(params.stop):
        if len(s) > limits.max_stop_string_chars:
            raise ValueError(f"stop[{i}] is {len(s)} characters; the limit is {limits.max_stop_string_chars}")
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise ValueError(f"stop_token_ids has {len(params.stop_token_ids)} ids; the limit is "
                         f"{limits.max_stop_token_ids}")
    bad = [t for t in params.stop_token_ids if t >= shape.vocab_size]
    if bad:
        raise ValueError(f"stop_token_ids must be in [0, {shape.vocab_size}); got {bad[:5]}")
    bad = [t for t in params.logit_bias or () if t >= shape.vocab_size]
    if bad:
        raise ValueError(f"logit_bias token ids must be in [0, {shape.vocab_size}); got {bad[:5]}")


def check_prompt_ids(shape: ServerShape, prompt: Sequence[object]) -> list[int]:
    """A token-id prompt: its length first (before a copy is made), then every id in the vocabulary."""
    if len(prompt) >= shape.max_model_len:
        raise ValueError(f"prompt ({len(prompt)} tokens) plus at least one output token exceeds max_model_len "
                         f"({shape.max_model_len})")
    ids = []
    for t in prompt:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))  # ints and numpy integers; not floats or strings
        except TypeError:
            raise ValueError(f"prompt token ids must be ints, got {_short(t)}") from None
    bad = [t for t in ids if not 0 <= t < shape.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids must be in [0, {shape.vocab_size}); got {bad[:5]}")
    return ids


def check_fits(shape: ServerShape, num_prompt_tokens: int, params: SamplingParams) -> None:
    """The tokenized prompt with every sample against max_model_len and the whole KV pool."""
    if num_prompt_tokens == 0:
        raise ValueError("prompt is empty")
    total = num_prompt_tokens + params.max_tokens
    if total > shape.max_model_len:
        raise ValueError(f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds "
                         f"max_model_len ({shape.max_model_len})")
    samples = params.num_sequences
    needed = kv_blocks_needed(num_prompt_tokens, params.max_tokens, samples, shape.block_size)
    if needed > shape.num_kv_blocks:
        what = "prompt plus max_tokens" if samples == 1 else f"prompt plus max_tokens for each of {samples} samples"
        raise ValueError(f"{what} needs {needed} KV blocks but the whole pool has {shape.num_kv_blocks}; "
                         f"lower max_tokens{'' if samples == 1 else ', n or best_of'} or enlarge the KV cache")


def kv_blocks_needed(num_prompt_tokens: int, max_tokens: int, samples: int, block_size: int) -> int:
    per_seq = -(-(num_prompt_tokens + max_tokens) // block_size)
    shared = num_prompt_tokens // block_size
    return shared + samples * (per_seq - shared)


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
