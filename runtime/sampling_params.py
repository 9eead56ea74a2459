"""Per-request sampling parameters (names and defaults follow vLLM's SamplingParams).

Every field is validated in ``__post_init__``; a bad value raises ``ValueError`` naming the field
and the allowed range, so the sidecar can answer INVALID_ARGUMENT with that message as is.

A few values are normalised on the way in, as vLLM does:

* ``stop``: ``None`` -> ``[]``, a single string -> ``[string]``.
* ``stop_token_ids``: ``None`` -> ``[]``.
* ``top_k``: ``-1`` (the older "off" spelling) -> ``0``, so code downstream only tests ``top_k > 0``.
* greedy requests (``temperature < 1e-5``) get ``top_p=1``, ``top_k=0``, ``min_p=0``: those knobs
  cannot change an argmax, and resetting them keeps greedy rows out of the truncation code; and
  ``best_of=None`` (n > 1 greedy choices are copies of one run, so there is nothing to pick from).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Any

from .structured_outputs_params import StructuredOutputsParams

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS).
_SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs.
MAX_LOGPROBS = 20
# The samplers divide by min(temperature, MAX_TEMPERATURE): past it, logit / temperature rounds to 0 in float32 for
# any logit a model makes, so the distribution is already uniform over the allowed tokens. A larger finite
# temperature (1e308) cast to float32 would overflow to inf, and a masked -inf logit / inf is NaN.
MAX_TEMPERATURE = 1e20


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}.")


def _check_int(name: str, value: Any) -> None:
    # bool is a subclass of int; True as a token count is almost surely a caller bug.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}.")


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}.")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value!r}.")
    return value


@dataclass
class SamplingParams:
    """How to pick the next tokens of one request and when to stop.

    ``logprobs``: how many top log-probabilities to return per token besides the chosen token's
    (``0`` = the chosen token's only, ``None`` = none).

    ``n > 1`` (or ``best_of > 1``) at temperature 0 is served as copies of one greedy run: the engine computes
    a single sequence and returns its output as choices 0..n-1 (same text, tokens, logprobs, finish reason).
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # token id -> bias added to its raw logit before penalties and sampling (OpenAI's logit_bias, -100..100).
    logit_bias: dict[int, float] | None = None
    # Guided decoding: the output follows a JSON Schema, regex, choice or grammar (see that class).
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n)
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.best_of is not None:
            _check_int("best_of", self.best_of)
            if self.best_of < self.n:
                raise ValueError(
                    f"best_of must be greater than or equal to n, got n={self.n} and "
                    f"best_of={self.best_of}."
                )

        self.temperature = _as_float("temperature", self.temperature)
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative (>= 0), got {self.temperature}.")
        self.top_p = _as_float("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(
                f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}."
            )
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        self.repetition_penalty = _as_float("repetition_penalty", self.repetition_penalty)
        if self.repetition_penalty <= 0.0:
            raise ValueError(
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}."
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = _as_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}.")
            setattr(self, name, value)

        if self.seed is not None:
            _check_int("seed", self.seed)
            # np.random.default_rng rejects negative seeds; say so here, not deep in the engine.
            if self.seed < 0:
                raise ValueError(f"seed must be a non-negative int, got {self.seed}.")

        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}."
            )

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)

        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs)
            # The upper bound is the server's (EngineConfig.max_logprobs, default MAX_LOGPROBS).
            if self.logprobs < 0:
                raise ValueError(f"logprobs must be non-negative (>= 0), got {self.logprobs}.")

        self.logit_bias = self._normalise_logit_bias(self.logit_bias)

        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            _check_bool(name, getattr(self, name))
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}.")

        if self.temperature < _SAMPLING_EPS:
            # Greedy: n > 1 gives n copies of ONE greedy run (num_sequences); best_of picks among identical
            # copies, so it is dropped.
            self.best_of = None
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {stop!r}.")
        stop = list(stop)
        for i, s in enumerate(stop):
            if not isinstance(s, str):
                raise ValueError(f"stop[{i}] must be a string, got {s!r}.")
            if not s:
                raise ValueError(f"stop[{i}] must be a non-empty string.")
        return stop

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of ints, got {ids!r}.")
        ids = list(ids)
        for i, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(
                    f"stop_token_ids[{i}] must be a non-negative int, got {t!r}."
                )
        return ids

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None or (isinstance(bias, dict) and not bias):
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}.")
        out = {}
        for t, v in bias.items():
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise ValueError(f"logit_bias keys must be non-negative token ids, got {t!r}.")
            v = _as_float(f"logit_bias[{t}]", v)
            if not -100.0 <= v <= 100.0:
                raise ValueError(f"logit_bias[{t}] must be in [-100, 100], got {v}.")
            out[t] = v
        return out

    @classmethod
    def greedy(cls, **kwargs: Any) -> SamplingParams:
        """Greedy decoding (temperature 0); other fields as keyword arguments."""
        if "temperature" in kwargs:
            raise ValueError("greedy() sets temperature=0; do not pass temperature.")
        return cls(temperature=0.0, **kwargs)

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def num_sequences(self) -> int:
        """Sequences the engine runs for this request: best_of or n, but one for greedy (copied to n choices)."""
        return 1 if self.is_greedy else (self.best_of or self.n)

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY
