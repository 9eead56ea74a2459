"""Layers the families beyond the Llama block compose (models/qwen3.py, models/gemma3.py), written on the op layer.

    qk_norm            Qwen3, Gemma 3: RMSNorm of every query and key head over head_dim, before rotary. The
                       kernel sets' rms_norm normalises the rows of a 2-D array whatever their width, so a
                       [T * heads, D] view of the heads is all it takes: no kernel of its own.
    gelu_tanh_and_mul  Gemma 3's gated MLP: gelu_tanh(gate) * up, the tanh approximation of GELU
                       (transformers' gelu_pytorch_tanh), on the backend's array module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .llama import LayerWeights


@dataclass
class QKNormLayerWeights(LayerWeights):
    q_norm: Any = None  # [head_dim], shared by every query head
    k_norm: Any = None  # [head_dim], shared by every key head


def qk_norm(backend: Any, qkv: Any, q_norm: Any, k_norm: Any, num_heads: int, num_kv_heads: int, head_dim: int,
            eps: float) -> Any:
    """qkv [T, (H + 2 KV) D] with each of its H query and KV key heads RMS-normed over D (in place, and
    returned); the values are left alone."""
    ops, xp = backend.ops, backend.xp
    t, q_size = qkv.shape[0], num_heads * head_dim
    for start, heads, weight in ((0, num_heads, q_norm), (q_size, num_kv_heads, k_norm)):
        rows = xp.ascontiguousarray(qkv[:, start:start + heads * head_dim]).reshape(t * heads, head_dim)
        qkv[:, start:start + heads * head_dim] = ops.rms_norm(rows, weight, eps).reshape(t, heads * head_dim)
    return qkv


_GELU_C = float(np.sqrt(2.0 / np.pi))


def gelu_tanh_and_mul(xp: Any, x: Any) -> Any:
    """x [T, 2I] = [gate | up] -> 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) * up, [T, I], computed in
    float32 (g^3 of a float16 gate could overflow)."""
    half = x.shape[-1] // 2
    gate = x[:, :half].astype(np.float32)
    up = x[:, half:]
    inner = gate * gate
    inner *= np.float32(0.044715)
    inner += np.float32(1.0)
    inner *= gate
    inner *= np.float32(_GELU_C)
    out = xp.tanh(inner, out=inner)
    out += np.float32(1.0)
    out *= gate
    out *= np.float32(0.5)
    out *= up
    return out.astype(x.dtype, copy=False)
