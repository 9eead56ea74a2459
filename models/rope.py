"""Rotary embeddings: frequencies (plain, llama3, linear and LongRoPE scaling) and a step's cos/sin.

    plain     inv_freq[i] = theta ** (-2i / D)
    llama3    long wavelengths stretched by `factor`, short ones kept, the band between interpolated
    linear    inv_freq / factor (Gemma 3's global layers in the larger models)
    longrope  Phi-3: inv_freq / short_factor[i] for a sequence of at most original_max_position_embeddings
              tokens, / long_factor[i] past it; cos and sin times attention_factor

LongRoPE picks its factors by sequence length, as transformers does (the length is the largest position
+ 1 of the forward): here the length is each sequence's own context length this step (`seq_lens`), so a
sequence's choice never depends on the rest of the batch. A whole prompt past the pretraining length is
rotated with the long factors, as transformers' one forward over it; a sequence that crosses the length
while decoding keeps its earlier keys as they were rotated, as transformers' KV-cached generation does.

Not yet right (the batch carries no prompt lengths, the prefix cache no factor choice): a long prompt cut
into chunks rotates its chunks that end within the pretraining length with the short factors, and a
prefix-cache hit may hand a short prompt keys a long one rotated with the long factors (or the reverse).
Both need a prompt longer than original_max_position_embeddings (4,096 in Phi-3-128k).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .config import ModelConfig


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

    `cos_sin(batch)` gives the step's cos and sin [T, D/2]; for LongRoPE each token's row comes from its
    sequence's factors (short or long), chosen on the device from the batch's metadata: no read-back, so the
    step stays capturable in a CUDA graph.
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
        cos, sin = ops.rope_cos_sin(self.inv_freq, batch.positions)
        if self.long_inv_freq is None:
            return cos, sin
        xp = self.backend.xp
        cos_l, sin_l = ops.rope_cos_sin(self.long_inv_freq, batch.positions)
        # each token's sequence: the number of sequence starts at or before it, minus one
        qsl = batch.query_start_loc
        seq = xp.searchsorted(qsl[1:], xp.arange(batch.num_tokens, dtype=qsl.dtype), side="right")
        long = (batch.seq_lens > self.original_max)[seq][:, None]
        f = np.float32(self.attention_factor)
        return xp.where(long, cos_l, cos) * f, xp.where(long, sin_l, sin) * f
