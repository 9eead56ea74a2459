"""The numba set's cache write into 16-bit KV pools (kv_cache_dtype bfloat16 or float16): rotary_and_cache with
the rotated key and the value rounded as they are stored, the same bits as the numpy reference (reference/
kv_convert.py: bfloat16 rounded to nearest even by integer ops on the float32 bits, here in LLVM IR; float16 by
the F16C conversion, round to nearest even as numpy's). One serial pass over the step's tokens (the float32
kernel's threads and non-temporal whole-line stores are for float32 rows: cache_write.py). Not on baseline x86-64
code, where the reference writes both: without F16C, LLVM lowers the float16 branch's fptrunc to a runtime helper
(__truncsfhf2) that numba's JIT does not link, and the compiled kernel crashes (CI's forced-baseline run found it).
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import types
from numba.extending import intrinsic

from .attention_ir import address
from .numerics import rotate
from .setup import CODE_PATH, JIT_EXACT, numba

_U16 = np.dtype(np.uint16)
_F16 = np.dtype(np.float16)


@intrinsic
def to_bf16_bits(typingctx, x):
    """float32 -> bfloat16 bits (uint16), round to nearest even; a NaN stays a quiet NaN (kv_convert's rule)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        u = builder.bitcast(args[0], i32)
        high = builder.lshr(u, ir.Constant(i32, 16))
        rounded = builder.lshr(builder.add(builder.add(u, ir.Constant(i32, 0x7FFF)),
                                           builder.and_(high, ir.Constant(i32, 1))), ir.Constant(i32, 16))
        nan = builder.icmp_unsigned(">", builder.and_(u, ir.Constant(i32, 0x7FFFFFFF)), ir.Constant(i32, 0x7F800000))
        bits = builder.select(nan, builder.or_(high, ir.Constant(i32, 0x40)), rounded)
        return builder.trunc(bits, ir.IntType(16))

    return types.uint16(x), codegen


@intrinsic
def to_f16_bits(typingctx, x):
    """float32 -> float16 bits (uint16), round to nearest even (VCVTPS2PH)."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.uint16(x), codegen


@numba.njit(**JIT_EXACT)
def _rotary_and_cache16(qkv, num_heads, num_kv_heads, cos, sin, k_bits, v_bits, slot_mapping, out, bf16):
    """cache_write._rotary_and_cache's serial pass with its key and value rounded to 16 bits as they are stored."""
    head_dim = k_bits.shape[3]
    half = head_dim // 2
    k_start = num_heads * head_dim
    v_start = k_start + num_kv_heads * head_dim
    block_size = k_bits.shape[1]
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
            a = v_start + h * head_dim
            if bf16:
                for d in range(head_dim):
                    k_bits[b, r, h, d] = to_bf16_bits(key[d])
                    v_bits[b, r, h, d] = to_bf16_bits(qkv[t, a + d])
            else:
                for d in range(head_dim):
                    k_bits[b, r, h, d] = to_f16_bits(key[d])
                    v_bits[b, r, h, d] = to_f16_bits(qkv[t, a + d])


def takes(k_cache, v_cache) -> bool:
    """Whether this kernel writes these caches: one 16-bit dtype, C-contiguous and writable, not on baseline code."""
    return (CODE_PATH != "baseline" and k_cache.dtype == v_cache.dtype and k_cache.dtype in (_U16, _F16)
            and k_cache.flags.carray and v_cache.flags.carray)


def rotary_and_cache16(qkv, num_heads, num_kv_heads, cos, sin, k_cache, v_cache, slot_mapping, out) -> None:
    """Run the kernel over shapes cache_write.rotary_and_cache has checked."""
    bits = (lambda c: c if c.dtype == _U16 else c.view(np.uint16))  # noqa: E731  (float16's bits: numba has no float16)
    _rotary_and_cache16(qkv, np.int64(num_heads), np.int64(num_kv_heads), cos, sin, bits(k_cache), bits(v_cache),
                        slot_mapping, out, k_cache.dtype == _U16)


def warm_up() -> None:
    """Compile (or load from the cache) the kernel: one signature serves both 16-bit dtypes (none on baseline)."""
    if CODE_PATH == "baseline":
        return
    f32 = np.zeros((1, 6 * 2), np.float32)
    cache = np.zeros((1, 1, 1, 2), np.uint16)
    rotary_and_cache16(f32, 4, 1, np.ones((1, 1), np.float32), np.zeros((1, 1), np.float32), cache, cache.copy(),
                       np.zeros(1, np.int64), np.empty((1, 4, 2), np.float32))
