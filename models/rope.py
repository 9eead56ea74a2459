"""Rotary embedding frequencies, including Llama 3's frequency-dependent scaling."""

from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def rope_inv_freq(config: ModelConfig, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """inv_freq [head_dim / 2] in float64.

    `freq_factors` are the per-frequency divisors that llama.cpp stores in GGUF files as rope_freqs
    (an alternative spelling of llama3 scaling).
    """
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    scaling = config.rope_scaling
    if scaling is not None and scaling.get("rope_type") == "llama3":
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
    if freq_factors is not None:
        inv_freq = inv_freq / freq_factors.astype(np.float64)
    return inv_freq
