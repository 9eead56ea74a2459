"""Cost-aware chunking's arithmetic (the scheduler's docstring says the policy): what a prefill chunk of n
tokens after `context` computed ones costs in tokens, and the largest chunk a budget fits."""

from __future__ import annotations

import math


def keys_per_token(model_config, attention_cost: float = 1.0) -> float:
    """How many keys one token's attention must cover to cost what its weight matmuls do: the model's matmul
    FLOPs per token over its attention FLOPs per key (cost-aware chunking's K), over what an attention FLOP
    costs against a matmul FLOP with the kernels that run them (KernelSet.attention_cost)."""
    return model_config.matmul_flops_per_token / model_config.attention_flops_per_key / attention_cost


def attention_cost(n: int, context: int, keys_per_token: float) -> float:
    """What a chunk of n tokens after `context` computed ones costs beyond its n tokens: the i-th token attends
    to context + i keys (itself included), each key 1 / keys_per_token of a token."""
    return (n * context + n * (n + 1) / 2) / keys_per_token


def chunk_within(budget: int, context: int, remaining: int, keys_per_token: float) -> int:
    """The most tokens, from 1 to `remaining`, of a prefill chunk after `context` computed tokens whose cost
    n + attention_cost(n, context, keys_per_token) fits `budget`."""
    if remaining <= 1:
        return remaining

    def cost(n: int) -> float:
        return n + attention_cost(n, context, keys_per_token)

    # The root of n^2 / (2K) + n (1 + (context + 0.5) / K) = budget, in the form that does not cancel.
    b = 1 + (context + 0.5) / keys_per_token
    n = int(2 * budget / (b + math.sqrt(b * b + 2 * budget / keys_per_token)))
    n = max(1, min(n, remaining))
    while n > 1 and cost(n) > budget:
        n -= 1
    while n < remaining and cost(n + 1) <= budget:
        n += 1
    return n
