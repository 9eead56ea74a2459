"""Rotary embeddings: frequencies (plain, llama3, linear and LongRoPE scaling) and a step's cos/sin.

    plain     inv_freq[i] = theta ** (-2i / D)
    llama3    long wavelengths stretched by `factor`, short ones kept, the band between interpolated
    linear    inv_freq / factor (Gemma 3's global layers in the larger models)
    longrope  Phi-3: inv_freq / short_factor[i] for a sequence of at most original_max_position_embeddings
              tokens, / long_factor[i] past it; cos and sin times attention_factor

LongRoPE picks its factors by sequence length, as transformers does (the length of a forward is its largest
position + 1). Here a token at position p of a sequence whose prompt has P tokens takes the long factors iff
max(P, p + 1) > original_max_position_embeddings (M): every token of a prompt past M, in one chunk or many (as
transformers' one forward over the prompt), and every token generated at a position >= M (as its cached
generation, one forward of length p + 1 per token). The choice depends on the sequence alone, never on the rest
of the batch or on how the scheduler cut it: a chunked prompt, a recompute after preemption and a speculative
verify step rotate each token as the plain run does. The batch carries P (`ForwardBatch.prompt_lens`; without
it seq_len stands in, the same for decodes: CUDA decode graphs carry none) and the choice is made on the device.

A cached block's keys thus depend on P > M besides its tokens: for a LongRoPE model (`longrope_threshold`) the
prefix cache roots its block hashes in that flag too (runtime/core/prefix_caching.py, `prefix_key`).

Where transformers differs: a sequence whose prompt fits in M and whose generation crosses it keeps its first M
keys as they were rotated (short), while transformers' Phi-3 generate drops its cache at the crossing and
prefills the whole sequence again with the long factors. vLLM picks one set for all sequences, by max_model_len.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .config import ModelConfig


def longrope_threshold(config: ModelConfig) -> int | None:
    """original_max_position_embeddings of a LongRoPE model: past it a prompt takes the long factors (None:
    the model's rope does not depend on the prompt's length)."""
    scaling = config.rope_scaling
    if scaling is None or scaling.get("rope_type") != "longrope":
        return None
    return int(scaling["original_max_position_embeddings"])


def plain_inv_freq(theta: float, dim: int) -> np.ndarray:
    return 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))


def rope_inv_freq(config: ModelConfig, freq_factors: np.ndarray | None = None, theta: float | None = None,
                  scaling: dict[str, Any] | None | str = "config") -> np.ndarray:
    """inv_freq [head_dim / 2] in float64 (LongRoPE: its short-sequence frequencies).

    `freq_factors` are the per-frequency divisors that llama.cpp stores in GGUF files as rope_freqs
    (an alternative spelling of llama3 scaling). `theta` and `scaling` default to the config's. LongRoPE's
    factors of a GGUF file (its rope_factors_short / rope_factors_long tensors) come in `scaling`
    (RotaryEmbedding puts them there).
    """
    dim = config.head_dim
    inv_freq = plain_inv_freq(config.rope_theta if theta is None else theta, dim)
    scaling = config.rope_scaling if scaling == "config" else scaling
    kind = scaling.get("rope_type") if scaling is not None else None
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths (low frequencies) are stretched by `factor`, short ones are left alone, and
        # the band between is interpolated smoothly.
        scaled = np.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        inv_freq = np.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "longrope":
        inv_freq = inv_freq / _factors(scaling, "short_factor", dim)
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return inv_freq


def _factors(scaling: dict[str, Any], key: str, dim: int) -> np.ndarray:
    if scaling.get(key) is None:
        raise ValueError(f"longrope rope scaling without its {key} (a GGUF file holds them as rope_factors_"
                         f"{key.split('_')[0]} tensors)")
    f = np.asarray(scaling[key], dtype=np.float64)
    if f.shape != (dim // 2,):
        raise ValueError(f"longrope {key} has {f.size} entries, expected head_dim / 2 = {dim // 2}")
    return f


class RotaryEmbedding:
    """One rope of a model (Gemma 3 has two: its global and its local layers'), on the backend's device.

    `cos_sin(batch)` gives the step's cos and sin [T, D/2]; for LongRoPE each token's row comes from the short
    or the long factors, chosen on the device from the batch's metadata (the module docstring's rule): no
    read-back, so the step stays capturable in a CUDA graph.
    """

    def __init__(self, config: ModelConfig, backend: Any, freq_factors: np.ndarray | None = None,
                 theta: float | None = None, scaling: dict[str, Any] | None | str = "config",
                 file_factors: dict[str, np.ndarray] | None = None) -> None:
        """`file_factors`: LongRoPE's {"short_factor": ..., "long_factor": ...} read from a GGUF file's tensors,
        for a config whose rope_scaling leaves them None."""
        self.backend = backend
        scaling = config.rope_scaling if scaling == "config" else scaling
        if scaling is not None and scaling.get("rope_type") == "longrope" and file_factors:
            scaling = {**scaling, **{k: v for k, v in file_factors.items() if scaling.get(k) is None}}
        put = backend.asarray if backend.is_gpu else (lambda a: a)  # float64 on the device: cos/sin computed there
        self.inv_freq = put(rope_inv_freq(config, freq_factors, theta, scaling))
        self.long_inv_freq = None
        if scaling is not None and scaling.get("rope_type") == "longrope":
            base = plain_inv_freq(config.rope_theta if theta is None else theta, config.head_dim)
            self.long_inv_freq = put(base / _factors(scaling, "long_factor", config.head_dim))
            self.original_max = int(scaling["original_max_position_embeddings"])
            self.attention_factor = float(scaling["attention_factor"])

    def cos_sin(self, batch: Any) -> tuple[Any, Any]:
        ops = self.backend.ops
        ws = getattr(batch, "workspace", None)  # a decode graph's buffers: one pair per rope (Gemma 3 has two)
        if ws is not None and self.long_inv_freq is None:
            shape, key = (batch.positions.shape[0], self.inv_freq.shape[0]), f"{id(self):x}"
            return ops.rope_cos_sin(self.inv_freq, batch.positions, out=(
                ws.take(f"rope_cos@{key}", shape, np.float32), ws.take(f"rope_sin@{key}", shape, np.float32)))
        cos, sin = ops.rope_cos_sin(self.inv_freq, batch.positions)
        if self.long_inv_freq is None:
            return cos, sin
        xp = self.backend.xp
        cos_l, sin_l = ops.rope_cos_sin(self.long_inv_freq, batch.positions)
        # each token's sequence: the number of sequence starts at or before it, minus one
        qsl = batch.query_start_loc
        seq = xp.searchsorted(qsl[1:], xp.arange(batch.num_tokens, dtype=qsl.dtype), side="right")
        # long iff max(prompt length, position + 1) > M; seq_len stands in for a batch without prompt lengths
        lens = batch.seq_lens if batch.prompt_lens is None else batch.prompt_lens
        long = ((lens > self.original_max)[seq] | (batch.positions >= self.original_max))[:, None]
        f = np.float32(self.attention_factor)
        return xp.where(long, cos_l, cos) * f, xp.where(long, sin_l, sin) * f
