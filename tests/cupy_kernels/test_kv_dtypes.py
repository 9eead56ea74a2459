"""KV cache dtypes on the CPU kernel sets (cupy_kernels/kv_layout.py): bfloat16 rounding by integer ops against
hand-worked bits, 16-bit cache writes and attention against the numpy reference, the bound of storage rounding
against float32 K/V (tests/numerics.kv_storage_tol), and the layout's refusals."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.cupy_kernels import kernel_set
from pagedserve.cupy_kernels.kv_layout import (KV_CACHE_DTYPES, check_kv_cache_dtype, kv_cache_layout,
                                                layout_of_array, normalize_kv_cache_dtype)
from pagedserve.cupy_kernels.reference import ops, paged_attention as ref
from pagedserve.cupy_kernels.reference.kv_convert import bf16_bits_to_float32, decode, encode, float32_to_bf16_bits
from tests.numerics import KV_UNIT_ROUNDOFF, f32_tol, kv_storage_tol
from tests.paged_batches import make_batch

SIXTEEN = ("bfloat16", "float16")
REDUCED = (*SIXTEEN, "int8", "fp8_e4m3", "fp8_e5m2")


def _bits(values):
    return np.array(values, dtype=np.uint32).view(np.float32)


def test_bf16_rounds_to_nearest_even_by_its_bits():
    x = _bits([0x3F800000, 0x3F808000, 0x3F818000, 0x3F808001, 0x3F80FFFF, 0x80000000, 0x7F7FFFFF, 0x7F800000,
               0xFF800000, 0x00000001, 0x7F7F7FFF])
    want = [0x3F80, 0x3F80, 0x3F82, 0x3F81, 0x3F81, 0x8000, 0x7F80, 0x7F80, 0xFF80, 0x0000, 0x7F7F]
    # (1 + 2^-8 is a tie: to the even 1.0; 1 + 3 * 2^-8 a tie: up to the even; past the largest: infinity)
    np.testing.assert_array_equal(float32_to_bf16_bits(x), np.array(want, dtype=np.uint16))
    nan = float32_to_bf16_bits(_bits([0x7F800001, 0xFFC00000]))
    assert np.isnan(bf16_bits_to_float32(nan)).all()  # a NaN whose payload sat in the low bits stays a NaN


def test_bf16_is_the_nearest_of_its_two_neighbours():
    x = np.random.default_rng(0).standard_normal(20000).astype(np.float32) * 100
    y = bf16_bits_to_float32(float32_to_bf16_bits(x))
    down = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)  # truncation, toward zero
    up = ((x.view(np.uint32) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    err = np.abs(y.astype(np.float64) - x)
    assert (err <= np.minimum(np.abs(down - x.astype(np.float64)), np.abs(up - x.astype(np.float64)))).all()
    assert (err <= KV_UNIT_ROUNDOFF["bfloat16"] * np.abs(x)).all()


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_layout_names_storage_and_bytes(dtype):
    layout = kv_cache_layout(dtype, np.float32)
    assert layout.element_bytes == 2 and layout.scale_granularity is None
    assert layout_of_array(np.zeros(1, layout.storage)) == dtype
    assert kv_cache_layout("auto", np.float32).dtype == "float32"
    assert kv_cache_layout("auto", np.float16).dtype == "float16"
    assert normalize_kv_cache_dtype("fp8") == "fp8_e4m3" and "fp8_e5m2" in KV_CACHE_DTYPES


@pytest.mark.parametrize("bad", ["bf16", "fp4", "", None, 16])
def test_unknown_dtype_names_the_value_and_the_choices(bad):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, bfloat16.*got"):
        normalize_kv_cache_dtype(bad)


def test_refusals_name_the_value_and_what_the_set_runs():
    numpy_set = kernel_set.numpy_kernels()
    for dtype in ("int8", "fp8_e4m3", "fp8", "fp8_e5m2"):
        with pytest.raises(ValueError, match=r"kv_cache_dtype '(int8|fp8.*)'.*some kernel set; choose one of auto, "
                                             r"float32, bfloat16, float16$"):
            check_kv_cache_dtype(kv_cache_layout(dtype, np.float32), "some", ("float32", "bfloat16", "float16"), 64)
    assert kernel_set.CPU_KV_CACHE_DTYPES == numpy_set.kv_cache_dtypes  # the numba set runs every one now
    with pytest.raises(ValueError, match="'bfloat16'.*cuda kernel set; choose one of auto, float16"):
        check_kv_cache_dtype(kv_cache_layout("bfloat16", np.float16), "cuda", ("float16",), 64)
    with pytest.raises(ValueError, match="needs an even head_dim, the model's is 7"):
        check_kv_cache_dtype(kv_cache_layout("float16", np.float32), "numpy", numpy_set.kv_cache_dtypes, 7)
    for dtype in ("auto", "float32", *REDUCED):
        check_kv_cache_dtype(kv_cache_layout(dtype, np.float32), "numpy", numpy_set.kv_cache_dtypes, 64)


def _cpu_sets():
    """The numpy reference's cache writes and the numba set's (cache_write.py: its 16-bit rotary_and_cache is
    cache_write16.py's kernel; reshape_and_cache takes the reference's)."""
    sets = [("numpy", ref.reshape_and_cache, ref.rotary_and_cache, ref.paged_attention)]
    if kernel_set.numba_code_path() is not None:
        from pagedserve.cupy_kernels.numba_cpu import attention, cache_write

        sets.append(("numba", cache_write.reshape_and_cache, cache_write.rotary_and_cache, attention.paged_attention))
    return sets


@pytest.mark.parametrize("dtype", REDUCED)
def test_cache_write_converts_on_write(dtype):
    rng = np.random.default_rng(1)
    storage = kv_cache_layout(dtype, np.float32).storage
    num_heads, kv, d, bs = 4, 2, 16, 8
    qkv = rng.standard_normal((5, (num_heads + 2 * kv) * d)).astype(np.float32)
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, d, 2) / d)), np.arange(5))
    slots = np.array([3, -1, 9, 17, 0], dtype=np.int64)
    want_k, want_v = np.zeros((4, bs, kv, d), np.float32), np.zeros((4, bs, kv, d), np.float32)
    want_q = ref.rotary_and_cache(qkv, num_heads, kv, cos, sin, want_k, want_v, slots)
    row = kv_cache_layout(dtype, np.float32).row_elements(d)
    for name, write, rotary_write, _ in _cpu_sets():
        k, v = np.zeros((4, bs, kv, row), storage), np.zeros((4, bs, kv, row), storage)
        q = rotary_write(qkv, num_heads, kv, cos, sin, k, v, slots)
        np.testing.assert_array_equal(q, want_q, err_msg=name)
        np.testing.assert_array_equal(k, encode(want_k, storage), err_msg=name)  # the float32 rotation, then rounded
        np.testing.assert_array_equal(v, encode(want_v, storage), err_msg=name)
        k2, v2 = np.zeros_like(k), np.zeros_like(v)
        key, value = want_k.reshape(-1, kv, d)[slots.clip(0)], want_v.reshape(-1, kv, d)[slots.clip(0)]
        write(key, value, k2, v2, slots)
        np.testing.assert_array_equal(k2, k, err_msg=name)
        np.testing.assert_array_equal(v2, v, err_msg=name)


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_cache_write_rounds_special_values_as_the_reference(dtype):
    """Ties, NaN, infinities, values past float16's range, a subnormal and -0 through every set's rotary_and_cache
    (numba: cache_write16.py's IR rounding) give the reference's bits."""
    storage = kv_cache_layout(dtype, np.float32).storage
    rng = np.random.default_rng(6)
    nh, kv, d = 2, 1, 16
    qkv = (rng.standard_normal((6, (nh + 2 * kv) * d)) * 1e3).astype(np.float32)
    qkv[0, -3:] = [np.nan, np.inf, 7e4]
    qkv[1, -4:] = _bits([0x3F808000, 0x3F818000, 0x00000001, 0x80000000])
    cos, sin = ops.rope_cos_sin(1.0 / (10000.0 ** (np.arange(0, d, 2) / d)), np.arange(6))
    slots = np.arange(6, dtype=np.int64)
    want = [np.zeros((2, 4, kv, d), storage) for _ in range(2)]
    ref.rotary_and_cache(qkv, nh, kv, cos, sin, *want, slots)
    for name, _, rotary_write, _ in _cpu_sets():
        got = [np.zeros((2, 4, kv, d), storage) for _ in range(2)]
        rotary_write(qkv, nh, kv, cos, sin, *got, slots)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16), err_msg=name)


@pytest.mark.parametrize("dtype", REDUCED)
@pytest.mark.parametrize("window", [None, 12])
def test_attention_reads_reduced_caches(dtype, window):
    rng = np.random.default_rng(2)
    storage = kv_cache_layout(dtype, np.float32).storage
    seqs = [(37, 37), (20, 1), (45, 6), (9, 1), (64, 1)]
    q, k, v, qsl, lens, tables = make_batch(rng, seqs, num_kv=2, group=2, head_dim=32, block_size=8)
    k16, v16 = encode(k, storage), encode(v, storage)
    scale = 32 ** -0.5
    # The same stored values decoded to float32: the reference over the stored form gives its bits.
    exact = ref.paged_attention(q, decode(k16), decode(v16), qsl, lens, tables, scale, sliding_window=window)
    out = ref.paged_attention(q, k16, v16, qsl, lens, tables, scale, sliding_window=window)
    np.testing.assert_array_equal(out, exact)
    # Against float32 K/V: within the bound storage rounding allows, and not equal (the rounding is real).
    f32 = ref.paged_attention(q, k, v, qsl, lens, tables, scale, sliding_window=window)
    tol = kv_storage_tol(dtype, q, k, v, scale)
    assert np.abs(exact - f32).max() <= tol
    assert np.abs(exact - f32).max() > 0


@pytest.mark.parametrize("dtype", SIXTEEN)
def test_copy_blocks_moves_16_bit_blocks_whole(dtype):
    storage = kv_cache_layout(dtype, np.float32).storage
    rng = np.random.default_rng(3)
    pair = tuple(encode(rng.standard_normal((4, 8, 2, 16)).astype(np.float32), storage) for _ in range(2))
    before = [a.copy() for a in pair]
    ref.copy_blocks([pair], [(1, 3)])
    for a, b in zip(pair, before):
        np.testing.assert_array_equal(a[3], b[1])
        np.testing.assert_array_equal(a[:3], b[:3])


@pytest.mark.slow
@pytest.mark.skipif(kernel_set.numba_code_path() is None, reason="numba is not installed")
@pytest.mark.parametrize("dtype", REDUCED)
def test_numba_loop_nest_reads_reduced_caches(dtype):
    """numba_cpu/attention16.py and attention8.py: the loop nest converting 16- or 8-bit K/V (and an 8-bit row's
    scale) as it loads them gives the reference's result over the same values decoded within float32 rounding,
    and for 16-bit caches the float32 loop nest's bits; a decode-only step over long contexts (the loop nest,
    several chunks on the threads) and a mixed one with a sliding window; head_dim 32 (the vector runs) and 24
    (key by key)."""
    from pagedserve.cupy_kernels.numba_cpu import attention, attention8
    from pagedserve.cupy_kernels.numba_cpu.setup import CODE_PATH

    # float16 on baseline code (no F16C) is read by the reference (attention16.py): no loop-nest bits to compare
    loop_nest = not (dtype == "float16" and CODE_PATH == "baseline")
    storage = kv_cache_layout(dtype, np.float32).storage
    for seed, seqs, window, d in ((4, [(300, 1), (20, 1), (129, 1), (64, 1)] * 4, None, 32),
                                  (5, [(37, 5), (20, 1), (45, 6), (9, 1), (64, 1)], 12, 32),
                                  (6, [(37, 5), (21, 1), (64, 1)], None, 24)):
        if d != 32 and dtype in SIXTEEN:
            continue
        q, k, v, qsl, lens, tables = make_batch(np.random.default_rng(seed), seqs, num_kv=2, group=2, head_dim=d,
                                                block_size=8)
        k16, v16 = encode(k, storage), encode(v, storage)
        scale = d ** -0.5
        if dtype not in SIXTEEN:  # the loop nest, not the reference, takes them
            assert attention8.kind_of(k16, v16) == dtype
        got = attention.paged_attention(q, k16, v16, qsl, lens, tables, scale, sliding_window=window)
        f32 = attention.paged_attention(q, decode(k16), decode(v16), qsl, lens, tables, scale, sliding_window=window)
        if loop_nest and dtype in SIXTEEN:
            np.testing.assert_array_equal(got, f32)
        want = ref.paged_attention(q, decode(k16), decode(v16), qsl, lens, tables, scale, sliding_window=window)
        tol = f32_tol(np.abs(want).max(), max(lens) + 32)
        assert np.abs(got - want).max() <= tol
        assert np.abs(f32 - want).max() <= tol
        # and the rounding is real: the result is not the float32 K/V's
        assert np.abs(got - ref.paged_attention(q, k, v, qsl, lens, tables, scale, sliding_window=window)).max() > tol


@pytest.mark.skipif(kernel_set.numba_code_path() is None, reason="numba is not installed")
@pytest.mark.parametrize("dtype", ("fp8_e4m3", "fp8_e5m2"))
def test_numba_fp8_conversions_are_ml_dtypes(dtype):
    """The numba set's fp8 rounding (cache_write8.to_fp8, integer ops on the float32 bits) gives ml_dtypes' bits for
    normal, subnormal, tied, overflowing and special values; its decoding (attention_ir.fp8_to_float32) gives
    ml_dtypes' value of every one of the 256 codes (NaNs as NaNs)."""
    import numba

    from pagedserve.cupy_kernels.numba_cpu import attention_ir, cache_write8

    storage = kv_cache_layout(dtype, np.float32).storage
    mant, bias, e4m3 = (3, 7, True) if dtype == "fp8_e4m3" else (2, 15, False)
    to_float32 = attention_ir.SCALED_TO_FLOAT32[dtype]

    @numba.njit
    def round_and_back(x, codes):
        out = np.empty(x.shape[0], np.int64)
        for i in range(x.shape[0]):
            out[i] = cache_write8.to_fp8(x[i], mant, bias, e4m3)
        back = np.empty(codes.shape[0], np.float32)
        for i in range(codes.shape[0]):
            back[i] = to_float32(codes[i], np.float32(1.0))
        return out, back

    rng = np.random.default_rng(9)
    x = np.concatenate([(rng.standard_normal(50000) * 10.0 ** rng.uniform(-12, 6, 50000)).astype(np.float32),
                        rng.integers(0, 2 ** 32, 50000, dtype=np.uint64).astype(np.uint32).view(np.float32),
                        np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 448, 464, 465, 480, 57344, 61440, 61439,
                                  2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -17, 1e-45], np.float32)])
    codes = np.arange(256, dtype=np.uint8)
    got, back = round_and_back(x, codes.view(np.int8))
    with np.errstate(all="ignore"):
        want = x.astype(storage).view(np.uint8)
    np.testing.assert_array_equal(got.astype(np.uint8), want)
    values = codes.view(storage).astype(np.float32)
    np.testing.assert_array_equal(back, values)  # (assert_array_equal takes NaN for NaN, -0 apart from +0 not)
    np.testing.assert_array_equal(np.signbit(back), np.signbit(values))


def test_int8_rows_keep_their_scale_and_half_a_step():
    rng = np.random.default_rng(7)
    x = (rng.standard_normal((50, 3, 32)) * rng.uniform(0.01, 100, (50, 3, 1))).astype(np.float32)
    x[0, 0] = 0.0  # a row of zeros: scale 0, decoded to zeros
    rows = encode(x, np.dtype(np.int8))
    assert rows.dtype == np.int8 and rows.shape == (50, 3, 36)
    scale = np.ascontiguousarray(rows[..., 32:]).view(np.float32)[..., 0]
    np.testing.assert_allclose(scale, np.abs(x).max(-1) / 127, rtol=1e-6)
    assert np.abs(rows[..., :32]).max() == 127  # each row's largest takes the whole range
    err = np.abs(decode(rows) - x)
    assert (err <= np.abs(x).max(-1, keepdims=True) * KV_UNIT_ROUNDOFF["int8"] * (1 + 1e-5)).all()
    np.testing.assert_array_equal(decode(rows)[0, 0], 0.0)


@pytest.mark.parametrize("dtype,u", [("fp8_e4m3", 2.0 ** -4), ("fp8_e5m2", 2.0 ** -3)])
def test_fp8_rows_scale_to_the_formats_largest(dtype, u):
    import ml_dtypes

    rng = np.random.default_rng(8)
    x = (rng.standard_normal((40, 2, 32)) * rng.uniform(0.01, 100, (40, 2, 1))).astype(np.float32)
    storage = kv_cache_layout(dtype, np.float32).storage
    rows = encode(x, storage)
    assert rows.dtype == storage and rows.shape == (40, 2, 36)
    top = float(ml_dtypes.finfo(storage).max)
    assert np.abs(rows[..., :32].astype(np.float32)).max(-1).min() == top  # each row's largest is the format's
    err = np.abs(decode(rows) - x)
    sub = np.abs(x).max(-1, keepdims=True) * float(ml_dtypes.finfo(storage).smallest_subnormal) / top / 2
    assert (err <= u * np.abs(x) * (1 + 1e-6) + sub).all()
