"""Tests for SamplingParams: vLLM defaults, normalisation, and validation messages."""

from __future__ import annotations

import math

import pytest

from pagedserve.runtime.sampling_params import SamplingParams, SamplingType


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.best_of, p.temperature, p.top_p, p.top_k, p.min_p) == (1, None, 1.0, 1.0, 0, 0.0)
    assert (p.repetition_penalty, p.presence_penalty, p.frequency_penalty) == (1.0, 0.0, 0.0)
    assert (p.seed, p.max_tokens, p.min_tokens) == (None, 16, 0)
    assert p.stop == [] and p.stop_token_ids == []
    assert p.ignore_eos is False and p.logprobs is None
    assert p.skip_special_tokens is True and p.include_stop_str_in_output is False
    assert p.sampling_type == SamplingType.RANDOM and not p.is_greedy


def test_normalisation() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(2, 3)).stop_token_ids == [2, 3]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_sampling_type() -> None:
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=0.7, seed=1).sampling_type == SamplingType.RANDOM_SEED
    # Greedy wins over a seed: there is nothing to draw.
    assert SamplingParams(temperature=0.0, seed=1).sampling_type == SamplingType.GREEDY


def test_greedy_resets_truncation_knobs() -> None:
    p = SamplingParams(temperature=0.0, top_p=0.5, top_k=5, min_p=0.3)
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)
    g = SamplingParams.greedy(max_tokens=7, stop=["\n"])
    assert g.is_greedy and g.temperature == 0.0 and g.max_tokens == 7 and g.stop == ["\n"]
    with pytest.raises(ValueError, match="do not pass temperature"):
        SamplingParams.greedy(temperature=0.5)


def test_valid_edges_accepted() -> None:
    SamplingParams(top_p=1.0, min_p=1.0, min_tokens=16, max_tokens=16)
    SamplingParams(presence_penalty=-2, frequency_penalty=2, logprobs=20, seed=0)
    SamplingParams(n=2, best_of=2)
    SamplingParams(n=2, best_of=5, temperature=0.8)
    SamplingParams(top_k=1, logprobs=0, repetition_penalty=0.5)


@pytest.mark.parametrize(
    ("kwargs", "field", "fragment"),
    [
        ({"n": 0}, "n", "at least 1"),
        ({"n": 1.0}, "n", "must be an int"),
        ({"best_of": 1, "n": 2}, "best_of", "greater than or equal to n"),
        ({"best_of": "3"}, "best_of", "must be an int"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": math.nan}, "temperature", "finite"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"temperature": "1"}, "temperature", "number"),
        ({"temperature": True}, "temperature", "number"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "-1 or 0"),
        ({"top_k": 2.0}, "top_k", "must be an int"),
        ({"min_p": -0.01}, "min_p", "[0, 1]"),
        ({"min_p": 1.5}, "min_p", "[0, 1]"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "greater than zero"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty", "[-2, 2]"),
        ({"seed": 1.5}, "seed", "must be an int"),
        ({"seed": -1}, "seed", "non-negative"),
        ({"seed": True}, "seed", "must be an int"),
        ({"max_tokens": 0}, "max_tokens", "at least 1"),
        ({"max_tokens": None}, "max_tokens", "must be an int"),
        ({"min_tokens": -1}, "min_tokens", "[0, max_tokens=16]"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens", "[0, max_tokens=4]"),
        ({"stop": ""}, "stop[0]", "non-empty"),
        ({"stop": ["ok", ""]}, "stop[1]", "non-empty"),
        ({"stop": ["ok", 3]}, "stop[1]", "must be a string"),
        ({"stop": 3}, "stop", "string or a list"),
        ({"stop_token_ids": 3}, "stop_token_ids", "list of ints"),
        ({"stop_token_ids": [1, -1]}, "stop_token_ids[1]", "non-negative int"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0]", "non-negative int"),
        ({"logprobs": -1}, "logprobs", "non-negative"),
        ({"ignore_eos": 1}, "ignore_eos", "bool"),
        ({"skip_special_tokens": "yes"}, "skip_special_tokens", "bool"),
        ({"include_stop_str_in_output": None}, "include_stop_str_in_output", "bool"),
    ],
)
def test_invalid_values_name_the_field(kwargs: dict, field: str, fragment: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    message = str(err.value)
    assert message.startswith(field + " "), message
    assert fragment in message, message


def test_greedy_n_is_one_sequence_copied() -> None:
    """n > 1 at temperature 0 is accepted (OpenAI does): one greedy run, its output copied to the n choices."""
    p = SamplingParams(temperature=0.0, n=3, best_of=5)
    assert p.n == 3 and p.best_of is None and p.num_sequences == 1
    assert SamplingParams(temperature=0.7, n=2, best_of=4).num_sequences == 4
    assert SamplingParams(temperature=0.7, n=2).num_sequences == 2
