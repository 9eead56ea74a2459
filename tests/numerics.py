"""The suite's float tolerances, derived once from float32 rounding.

Two float32 evaluations of the same math that differ only in the order of their sums (another
OpenBLAS kernel or blocking, another thread count, a padded batch, a prompt cut into other chunks,
another CPU model) differ by their rounding errors, nothing more. One rounding is off by at most
u = 2**-24 of the value. A sum of n terms rounded in some order is off by at most about n * u * scale,
and in practice by about sqrt(n) * u * scale: the roundings behave like independent signs (the
probabilistic error bound; Higham & Mary, SIAM J. Sci. Comput. 41(5), 2019), scale being the size of
the result.

A transformer adds `depth` layers of such reductions (projections of length n = hidden or
intermediate size) to its residual stream; RMSNorm rescales every layer's input, so each layer's error
is relative to the stream's size and the layers' errors add up like one more random walk:
sqrt(depth * n) * u * scale for one evaluation, sqrt(2) times that for the difference of two. We allow
SIGMAS times that, a tail no honest run reaches, with scale = the largest magnitude of the values
compared. A real bug (a wrong position, block, mask or row) moves values by a fair part of their scale,
orders of magnitude above these tolerances.

Where a test's claim is about tokens (greedy choices, sampled ids), it asserts the tokens exactly and
compares the floats behind them with these tolerances.
"""

from __future__ import annotations

import math

import numpy as np

U32 = 2.0 ** -24  # float32 unit roundoff
SIGMAS = 8.0


def f32_tol(scale: float, reduction_len: int, depth: int = 1) -> float:
    """Absolute tolerance between two float32 evaluations of values of magnitude <= `scale` that each
    went through `depth` chained reductions of length `reduction_len`."""
    return SIGMAS * math.sqrt(2.0 * depth * max(reduction_len, 1)) * U32 * float(scale)


def model_tol(config, scale: float) -> float:
    """Tolerance for a whole forward pass of `config` (logits, or K/V of any layer), values of
    magnitude <= `scale`: depth = the number of layers, n = the longest projection."""
    n = max(config.hidden_size, config.intermediate_size, config.num_attention_heads * config.head_dim)
    return f32_tol(scale, n, depth=config.num_hidden_layers)


def max_abs(a) -> float:
    return float(np.abs(np.asarray(a, dtype=np.float64)).max()) if np.size(a) else 0.0


def assert_close_model(actual, desired, config, err_msg: str = "") -> None:
    """Two float32 forward passes of `config` agree to float32 rounding."""
    np.testing.assert_allclose(actual, desired, rtol=0, atol=model_tol(config, max_abs(desired)),
                               err_msg=err_msg)


def assert_close_reduction(actual, desired, reduction_len: int, err_msg: str = "") -> None:
    """One float32 reduction of `reduction_len` terms (a log-sum-exp over the vocabulary, say) agrees."""
    np.testing.assert_allclose(actual, desired, rtol=0, atol=f32_tol(max_abs(desired), reduction_len),
                               err_msg=err_msg)


# Unit roundoff of the KV cache's storage dtypes (cupy_kernels/kv_layout.py): a stored value is its float32 rounded
# to nearest, off by at most u of itself (8 significand bits for bfloat16, 11 for float16).
# int8: a value is off by at most half a step, 1/254 of its row's largest (kv_convert.int8_rows), not of itself.
# fp8 (scaled so a row's largest is the format's largest): 4 and 3 significand bits, plus, near zero, half the
# smallest subnormal of the scaled row (KV_SUBNORMAL, a share of the row's largest).
KV_UNIT_ROUNDOFF = {"float32": U32, "bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "int8": 1.0 / 254,
                    "fp8_e4m3": 2.0 ** -4, "fp8_e5m2": 2.0 ** -3}
KV_SUBNORMAL = {"fp8_e4m3": 2.0 ** -10 / 448, "fp8_e5m2": 2.0 ** -17 / 57344}


def kv_storage_tol(kv_cache_dtype: str, q, k, v, scale: float) -> float:
    """Absolute bound on how far attention over K/V stored in `kv_cache_dtype` may fall from attention over the same
    K/V in float32 (q [.., D] the scaled-by-`scale` queries' rows, k and v the keys and values read), worst case:
    each stored value is off by at most u |x|, so a score moves by at most ds = u max(|q| . |k_j|) scale; a softmax
    weight exp(s_j) / sum exp(s_i) then moves by at most a factor exp(+-2 ds), so the weighted sum of V rows moves
    by at most (exp(2 ds) - 1) max|v|, and V's own rounding adds u max|v|. Plus the float32 evaluations' own
    rounding, sqrt(keys + D) float32 roundings of the scale of the largest term (f32_tol)."""
    u = KV_UNIT_ROUNDOFF[kv_cache_dtype]
    qa = np.abs(np.asarray(q, np.float64)).reshape(-1, np.shape(q)[-1])
    ka = np.abs(np.asarray(k, np.float64)).reshape(-1, np.shape(k)[-1])
    if kv_cache_dtype == "int8":  # each value's error bound is its row's largest, not itself
        ka = np.broadcast_to(ka.max(axis=1, keepdims=True), ka.shape)
    if kv_cache_dtype in KV_SUBNORMAL:  # u |x| + the subnormal step's half of the row's largest
        ka = ka + ka.max(axis=1, keepdims=True) * (KV_SUBNORMAL[kv_cache_dtype] / u)
    ds = u * float((qa @ ka.T).max()) * abs(scale)
    v_scale = max_abs(v)
    return (math.expm1(2 * ds) + u) * v_scale + f32_tol(max(v_scale, 1.0), ka.shape[0] + ka.shape[1])
