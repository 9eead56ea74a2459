"""The op layer: every piece of math the model does, as one function each.

These numpy functions are the reference. A CuPy implementation of an op takes the same arguments and
returns the same result (within float16 tolerance) so models/ never changes when the backend does; each
CUDA kernel is tested against the function here. Shapes use T = tokens in the flat batch, H = query
heads, KV = key/value heads, D = head dim.
"""

from __future__ import annotations

import numpy as np


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of `table` [V, hidden] for `ids` [T] -> [T, hidden]."""
    return table[ids]


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """x [T, in] @ weight.T where weight is [out, in] (the Hugging Face layout) -> [T, out].

    The transpose is a view: BLAS reads the weight in place, nothing is copied.
    """
    out = x @ weight.T
    if bias is not None:
        out += bias
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Root-mean-square norm over the last axis, computed in float32."""
    x32 = x.astype(np.float32, copy=False)
    var = np.mean(x32 * x32, axis=-1, keepdims=True)
    return (x32 / np.sqrt(var + eps)).astype(x.dtype, copy=False) * weight


def add_rms_norm(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """residual += x, then rms_norm(residual). Returns (normed, residual).

    Fusing the add with the norm saves one pass over the activations on the GPU; with no residual yet
    (the first layer) `x` itself becomes the residual.
    """
    residual = x if residual is None else x + residual
    return rms_norm(residual, weight, eps), residual


def rope_cos_sin(inv_freq: np.ndarray, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin [T, D/2] of positions x inv_freq, computed in float64 for accuracy at long positions."""
    freqs = positions.astype(np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    return np.cos(freqs).astype(np.float32), np.sin(freqs).astype(np.float32)


def apply_rotary(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate x [T, heads, D] by position ("neox" / rotate-half layout, as Hugging Face Llama does).

    The first and second halves of each head form the (real, imaginary) pairs.
    """
    half = x.shape[-1] // 2
    c = cos[:, None, :]
    s = sin[:, None, :]
    x1 = x[..., :half]
    x2 = x[..., half:]
    out = np.empty_like(x)
    out[..., :half] = x1 * c - x2 * s
    out[..., half:] = x2 * c + x1 * s
    return out


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    gate = x[:, :half]
    up = x[:, half:]
    with np.errstate(over="ignore"):  # exp(-gate) -> inf for very negative gate gives silu = -0, as it should
        return gate / (1.0 + np.exp(-gate)) * up
