"""The op layer: every piece of math the model does, as one function each.

These numpy functions are the reference. The numba (numba_ops.py) and CUDA (cuda_ops.py) versions of an
op take the same arguments and return the same result (within float32 / float16 rounding), and models/
reaches whichever the backend chose through `backend.ops` (kernel_set.py), so it never changes when the
backend does; each compiled kernel is tested against the function here. Shapes use T = tokens in the flat batch,
H = query heads, KV = key/value heads, D = head dim.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def embedding(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of `table` [V, hidden] for `ids` [T] -> [T, hidden]."""
    return table[ids]


def linear(x: np.ndarray, weight_t: np.ndarray, bias: np.ndarray | None = None, quant=None) -> np.ndarray:
    """x [T, in] @ weight_t [in, out] -> [T, out].

    Weights are stored transposed from the Hugging Face [out, in] layout, once at load: on the CPU,
    OpenBLAS runs the small-M matmuls of decode steps 10-30% faster on an [in, out] operand.
    `quant` (a quant.QuantWeight) is the same weight as the GGUF file's blocks, of which weight_t is the
    exact dequantization; the reference reads weight_t, a compiled set may read the blocks instead.
    """
    out = x @ weight_t
    if bias is not None:
        out += bias
    return out


def pack_weight(w, gated: bool = False) -> None:
    """The form linear wants a [out, in] matmul weight (or a list of [out_i, in] parts, stacked by rows) in,
    when it is not the [in, out] array: None here (and in the CUDA set); the numba set packs column panels
    (numba_gemm.py). gated: the weight is a gate_up ([gate, up]) that only linear_silu_and_mul multiplies
    (the numba set then interleaves the two)."""
    return None


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """Root-mean-square norm over the last axis, computed in float32."""
    x32 = x.astype(np.float32, copy=False)
    # einsum gives the row sums of squares without a [T, hidden] temporary.
    scale = np.einsum("ij,ij->i", x32, x32)[:, None]
    scale /= x32.shape[-1]
    scale += eps
    np.sqrt(scale, out=scale)
    out = x32 / scale
    out *= weight
    return out.astype(x.dtype, copy=False)


def add_rms_norm(
    x: np.ndarray, residual: np.ndarray | None, weight: np.ndarray, eps: float
) -> tuple[np.ndarray, np.ndarray]:
    """residual += x, then rms_norm(residual). Returns (normed, residual).

    Fusing the add with the norm saves one pass over the activations on the GPU; with no residual yet
    (the first layer) `x` itself becomes the residual.
    """
    if residual is None:
        residual = x
    else:
        residual += x  # the residual stream is owned by the forward pass: updating it in place is safe
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
    lo, hi = out[..., :half], out[..., half:]
    np.multiply(x1, c, out=lo)
    lo -= x2 * s
    np.multiply(x2, c, out=hi)
    hi += x1 * s
    return out


def silu_and_mul(x: np.ndarray) -> np.ndarray:
    """x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]."""
    half = x.shape[-1] // 2
    gate = x[:, :half]
    up = x[:, half:]
    out = np.negative(gate)
    with np.errstate(over="ignore"):  # exp(-gate) -> inf for very negative gate gives silu = -0, as it should
        np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


def linear_silu_and_mul(x: np.ndarray, weight_t, quant=None) -> np.ndarray:
    """silu_and_mul(linear(x, weight_t)): a gated MLP's up projection, weight_t its fused [gate | up] weight
    (pack_weight(..., gated=True)'s, where a set packs one; the numba set applies the SiLU in its GEMM)."""
    return silu_and_mul(linear(x, weight_t, quant=quant))


def linear_add(x: np.ndarray, weight_t, residual: np.ndarray, quant=None) -> np.ndarray:
    """residual += linear(x, weight_t), in place; returns residual (a decoder layer's add after o_proj or down:
    the bits of add_rms_norm's add)."""
    residual += linear(x, weight_t, quant=quant)
    return residual


# Rows per chunk of logsumexp_rows's full-vocabulary temporaries on the CPU: a few rows of V float32 stay in L2.
_CPU_ROW_CHUNK = 4


def logsumexp_rows(x: Any, row_max: Any = None, xp: Any = np) -> Any:
    """log(sum(exp(x), axis=1)) of a [B, V] float32 array, stably: the sampler's log-normaliser (a chosen
    token's logprob is its logit minus this). row_max: x.max(axis=1) when the caller has it (saves a pass).
    xp: numpy here, cupy for the CUDA set (cuda_ops.logsumexp_rows)."""
    m = x.max(axis=1) if row_max is None else row_max
    s = xp.empty_like(m)
    num_rows = x.shape[0]
    chunk = _CPU_ROW_CHUNK if xp is np else max(num_rows, 1)
    buf = xp.empty((min(chunk, num_rows), x.shape[1]), dtype=x.dtype)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        b = buf[: stop - start]
        xp.subtract(x[start:stop], m[start:stop, None], out=b)
        xp.exp(b, out=b)
        s[start:stop] = b.sum(axis=1)
    return m + xp.log(s)
