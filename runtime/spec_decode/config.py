"""SpeculativeConfig: how (and whether) the engine speculates, validated in one place.

vLLM's names and its two simplest methods:

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    {"model": "/path/to/draft", "num_speculative_tokens": 4}          method "draft" is implied
    {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_max_tree_depth": 24}   suffix_proposer.py

A draft model must share the target's vocabulary (same vocab_size). `"model": None` with method
"draft" and `draft_num_layers=N` builds a self-draft: the target's own embedding, first N layers, final
norm and lm_head (no second checkpoint needed).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Mapping

METHODS = ("ngram", "draft", "suffix")
LOOKUP_METHODS = ("ngram", "suffix")  # drafts looked up in token history: free to propose, one-hot


@dataclass
class SpeculativeConfig:
    method: str = "ngram"  # "ngram" (prompt lookup) | "draft" (a smaller model proposes) | "suffix" (suffix trees)
    num_speculative_tokens: int = 4  # k: drafts proposed per step and verified in one target forward
    prompt_lookup_max: int = 4  # ngram: longest suffix n-gram searched for in the sequence
    prompt_lookup_min: int = 2  # ngram: shortest n-gram that counts as a match
    model: str | None = None  # draft: a GGUF file or HF directory with the target's vocabulary
    draft_num_layers: int | None = None  # draft without a model: the target's first N layers
    # suffix (vLLM's names): depth of the suffix trees (longest match and draft), requests whose outputs the
    # global tree keeps (0: none, only the request's own tokens), drafts per matched token, and the lowest
    # estimated probability of a draft token (the product of count ratios along the path).
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # Adaptive k (runtime/spec_decode/policy.py): a sequence's k starts at num_speculative_tokens, doubles after a
    # verify step that accepted all its drafts, halves after one that did not, never past this cap.
    # None: 3 * num_speculative_tokens (at most 16) for ngram, whose extra drafts cost no lookup time,
    # num_speculative_tokens (no growth) for a draft model, whose every draft is one more draft step.
    max_num_speculative_tokens: int | None = None
    # Switching off where speculation loses. None: a sequence verifies drafts on a step only when the
    # tokens they are expected to add exceed what the extra rows cost, both measured (spec_policy.py).
    # A number in [0, 1] instead: speculate while the sequence's estimated acceptance rate is at least
    # this; 0 speculates always (tests; a device where a verify step costs no more than a decode).
    min_acceptance_rate: float | None = None
    # A draft model's sequence that stopped drafting tries again after this many steps (the wait doubles,
    # up to 8x, after each try that accepts nothing). N-gram needs no probes: its proposals are checked
    # against the generated tokens while it is off.
    probe_interval: int = 16

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"speculative_config.{name} must be {want}, got {getattr(self, name)!r}")

        def positive_int(name: str, allow_none: bool = False) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise bad(name, "a positive integer")

        if self.method not in METHODS:
            raise bad("method", "'ngram', 'suffix' or 'draft'")
        positive_int("num_speculative_tokens")
        if self.num_speculative_tokens > 16:
            raise bad("num_speculative_tokens", "at most 16")
        positive_int("prompt_lookup_max")
        positive_int("prompt_lookup_min")
        positive_int("probe_interval")
        positive_int("max_num_speculative_tokens", allow_none=True)
        if self.max_num_speculative_tokens is None:
            k = self.num_speculative_tokens
            self.max_num_speculative_tokens = min(16, max(k, 3 * k)) if self.method in LOOKUP_METHODS else k
        if not self.num_speculative_tokens <= self.max_num_speculative_tokens <= 16:
            raise bad("max_num_speculative_tokens", f"in [num_speculative_tokens ({self.num_speculative_tokens}), 16]")
        positive_int("draft_num_layers", allow_none=True)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        rate = self.min_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float))
                                 or not 0.0 <= rate <= 1.0):
            raise bad("min_acceptance_rate", "None or a number in [0, 1]")
        if self.model is not None and not isinstance(self.model, str):
            raise bad("model", "a path (str)")
        if self.method in LOOKUP_METHODS and (self.model is not None or self.draft_num_layers is not None):
            raise ValueError(f"speculative_config.model / draft_num_layers need method 'draft', not {self.method!r}")
        positive_int("suffix_decoding_max_tree_depth")
        if self.suffix_decoding_max_tree_depth > 256:  # work per token and per proposal grows with it
            raise bad("suffix_decoding_max_tree_depth", "at most 256")
        n = self.suffix_decoding_max_cached_requests
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise bad("suffix_decoding_max_cached_requests", "a non-negative integer")
        f = self.suffix_decoding_max_spec_factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0:
            raise bad("suffix_decoding_max_spec_factor", "a positive number")
        prob = self.suffix_decoding_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0.0 <= prob <= 1.0:
            raise bad("suffix_decoding_min_token_prob", "a number in [0, 1]")
        if self.method == "draft" and (self.model is None) == (self.draft_num_layers is None):
            raise ValueError("speculative_config with method 'draft' needs exactly one of model (a draft "
                             "checkpoint) or draft_num_layers (a self-draft from the target's first layers)")

    @classmethod
    def from_value(cls, value: SpeculativeConfig | Mapping[str, Any] | None) -> SpeculativeConfig | None:
        """None, a SpeculativeConfig, or a dict in vLLM's spelling (a 'model' without 'method' means 'draft')."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"speculative_config must be a dict or None, got {value!r}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s) {unknown}; known: {sorted(known)}")
        kwargs = dict(value)
        if "method" not in kwargs:
            kwargs["method"] = "draft" if kwargs.get("model") is not None or kwargs.get("draft_num_layers") else "ngram"
        return cls(**kwargs)
