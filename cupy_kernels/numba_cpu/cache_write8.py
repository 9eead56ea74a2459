"""The numba set's cache write into 8-bit KV pools (kv_cache_dtype int8, fp8_e4m3, fp8_e5m2): rotary_and_cache with
the rotated key and the value scaled and rounded as they are stored, each row followed by its float32 scale
(kv_layout.py), the same bits as the numpy reference (reference/kv_convert.py):

    s = max|x| / 127 (int8), / 448 (e4m3), / 57344 (e5m2), in float32; a row of zeros: s = 0, divided by 1
    int8: rint(x / s), half to even, clipped to [-127, 127]
    fp8:  x / s rounded to nearest even by integer ops on its float32 bits (ml_dtypes' conversion: past the
          largest finite value e4m3fn gives NaN and e5m2 infinity, as ml_dtypes does; a NaN stays a NaN)

Plain integer and float32 arithmetic only (no rint libcall, no float16): the same code on the AVX-512, AVX2 and
baseline paths. One serial pass over the step's tokens, as cache_write16.py's.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from ..kv_layout import layout_of_array
from .attention_ir import address
from .numerics import rotate
from .setup import JIT_EXACT, numba

KINDS = ("int8", "fp8_e4m3", "fp8_e5m2")
_MAX = (127.0, 448.0, 57344.0)  # the largest stored magnitude: the scale maps a row's largest onto it


@intrinsic
def float32_bits(typingctx, x):
    """A float32's bits as an int64 (0 .. 2^32 - 1)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.zext(builder.bitcast(args[0], ir.IntType(32)), ir.IntType(64))

    return types.int64(x), codegen


@numba.njit(inline="always", **JIT_EXACT)
def _shift_rne(m, shift):
    """m >> shift, rounded to nearest, ties to even (0 < shift < 63)."""
    return (m + (1 << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift


@numba.njit(inline="always", **JIT_EXACT)
def to_fp8(x, mant, bias, e4m3):
    """float32 x as fp8 bits (0 .. 255) with `mant` mantissa bits and exponent `bias`: round to nearest even."""
    u = float32_bits(x)
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    if a > 0x7F800000:  # NaN
        return sign | (0x7F if e4m3 else 0x7E)
    if a == 0x7F800000:  # infinity: e4m3fn has none (NaN)
        return sign | (0x7F if e4m3 else 0x7C)
    e = (a >> 23) - 127 + bias  # the fp8 exponent field before rounding
    if e >= 1:
        code = _shift_rne(a, 23 - mant) - ((127 - bias) << mant)
    elif (a >> 23) == 0:  # a float32 subnormal: far below half of fp8's smallest
        code = 0
    else:  # an fp8 subnormal: the mantissa with its implicit bit, shifted down (it may round up to the smallest normal)
        code = _shift_rne((a & 0x7FFFFF) | 0x800000, min(23 - mant + 1 - e, 62))
    if e4m3 and code > 0x7E:  # past 448 (after rounding): NaN, e4m3fn's only value above
        return sign | 0x7F
    if not e4m3 and code > 0x7B:  # past 57344: infinity
        return sign | 0x7C
    return sign | code


@numba.njit(inline="always", **JIT_EXACT)
def _rint(y):
    """y (float32, |y| < 2^22) rounded to an integer, half to even: adding and taking away 1.5 * 2^23 leaves y's
    integer part rounded by the float32 addition itself (no SSE4.1 round instruction on baseline code)."""
    big = np.float32(12582912.0)
    return (y + big) - big


@numba.njit(inline="always", **JIT_EXACT)
def _write_row(src, cache, b, r, h, head_dim, kind):
    """src[:head_dim] (float32) scaled and rounded into cache[b, r, h] (int8), its scale's bytes after it."""
    amax = np.float32(0.0)
    for d in range(head_dim):
        a = abs(src[d])
        if a > amax or a != a:  # a NaN stays (numpy's max propagates it)
            amax = a
    scale = amax / np.float32(_MAX[kind])
    safe = scale if scale > 0 else np.float32(1.0)
    for d in range(head_dim):
        y = src[d] / safe
        if kind == 0:
            q = min(max(_rint(y), np.float32(-127.0)), np.float32(127.0))
            cache[b, r, h, d] = np.int8(np.int64(q))
        elif kind == 1:
            cache[b, r, h, d] = to_fp8(y, 3, 7, True)
        else:
            cache[b, r, h, d] = to_fp8(y, 2, 15, False)
    bits = float32_bits(scale)
    for i in range(4):
        cache[b, r, h, head_dim + i] = (bits >> (8 * i)) & 0xFF  # little-endian, as numpy's view


@numba.njit(**JIT_EXACT)
def _rotary_and_cache8(qkv, num_heads, num_kv_heads, cos, sin, k_bytes, v_bytes, slot_mapping, out, kind):
    """cache_write._rotary_and_cache's serial pass with its key and value rows scaled and rounded as they are
    stored (kind: 0 int8, 1 fp8_e4m3, 2 fp8_e5m2)."""
    head_dim = k_bytes.shape[3] - 4
    half = head_dim // 2
    k_start = num_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim
    block_size = k_bytes.shape[1]
    src, cs, sn = address(qkv), address(cos), address(sin)
    key = np.empty(head_dim, dtype=np.float32)
    q_out, k_out = address(out), address(key)
    width, cs_width = qkv.shape[1], cos.shape[1]
    for t in range(qkv.shape[0]):
        for h in range(num_heads):
            rotate(src, t * width + h * head_dim, cs, sn, t * cs_width, q_out, (t * num_heads + h) * head_dim, half)
        slot = slot_mapping[t]
        if slot < 0:
            continue
        b, r = slot // block_size, slot % block_size
        for h in range(num_kv_heads):
            rotate(src, t * width + k_start + h * head_dim, cs, sn, t * cs_width, k_out, 0, half)
            _write_row(key, k_bytes, b, r, h, head_dim, kind)
            a = v_start + h * head_dim
            _write_row(qkv[t, a:a + head_dim], v_bytes, b, r, h, head_dim, kind)


def takes(k_cache, v_cache) -> bool:
    """Whether this kernel writes these caches: one 8-bit dtype, C-contiguous and writable."""
    if k_cache.dtype != v_cache.dtype or k_cache.dtype.itemsize != 1 or not (k_cache.flags.carray
                                                                              and v_cache.flags.carray):
        return False
    try:
        return layout_of_array(k_cache) in KINDS
    except ValueError:
        return False


def rotary_and_cache8(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping, out) -> None:
    """Run the kernel over shapes cache_write.rotary_and_cache has checked."""
    kind = KINDS.index(layout_of_array(k_cache))
    as_bytes = (lambda c: c if c.dtype == np.int8 else c.view(np.int8))  # noqa: E731  (fp8's bits)
    _rotary_and_cache8(qkv, np.int64(num_heads), np.int64(num_kv_heads), cos, sin, as_bytes(k_cache),
                       as_bytes(v_cache), slot_mapping, out, np.int64(kind))


def warm_up() -> None:
    """Compile (or load from the cache) the kernel: one signature serves the three 8-bit dtypes."""
    f32 = np.zeros((1, 6 * 2), np.float32)
    cache = np.zeros((1, 1, 1, 2 + 4), np.int8)
    rotary_and_cache8(f32, 4, 1, np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32), cache, cache.copy(),
                      np.zeros(1, np.int64), np.empty((1, 4, 2), np.float32))
