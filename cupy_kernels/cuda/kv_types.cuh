// KV cache element types (kv_cache_dtype, cupy_kernels/kv_layout.py) for the attention kernels and the cache write:
// what a cache row holds and how a value is converted, in registers, as it is read or written.
//
//   KV           array dtype (CuPy)   a (slot, kv head) row                   a value read as
//   f16          float16              D halves                                 cvt.f32.f16
//   bf16         uint16               D bfloat16s (float32's high halves)      bits << 16 (exact)
//   kv_fp8e4m3   uint8 (no fp8 dtype  D fp8 codes, then the row's float32      code -> binary16 bits -> float32
//   kv_fp8e5m2   in CuPy: the op      scale s = max|x| / 448 (e4m3) or         (exact, ml_dtypes' values),
//                names the kind)      / 57344 (e5m2): D + 4 bytes              times s (__fmul_rn: one rounding)
//
// Writing rounds as the numpy reference (reference/kv_convert.py) does, bit for bit: bfloat16 to nearest even by
// integer ops on the float32 bits (a NaN stays a quiet NaN); fp8 x / s (IEEE division) to nearest even by integer
// ops, past the largest finite value NaN (e4m3fn, which has no infinities) or infinity (e5m2), as ml_dtypes does.
// Plain integer and float code: the same on the GPU and in the host emulation (which compiles this file as it is).

struct __align__(1) kv_fp8e4m3 {
    unsigned char bits;
};
struct __align__(1) kv_fp8e5m2 {
    unsigned char bits;
};

template <typename KV> struct KVType;
template <> struct KVType<f16> {
    static constexpr int BYTES = 2, MANT = 0, BIAS = 0;
    static constexpr bool SCALED = false, HALF = true;
};
template <> struct KVType<bf16> {
    static constexpr int BYTES = 2, MANT = 0, BIAS = 0;
    static constexpr bool SCALED = false, HALF = false;
};
template <> struct KVType<kv_fp8e4m3> {
    static constexpr int BYTES = 1, MANT = 3, BIAS = 7;
    static constexpr bool SCALED = true, HALF = false;
    static constexpr float MAX = 448.f;
};
template <> struct KVType<kv_fp8e5m2> {
    static constexpr int BYTES = 1, MANT = 2, BIAS = 15;
    static constexpr bool SCALED = true, HALF = false;
    static constexpr float MAX = 57344.f;
};

// Bytes of one (slot, kv head) row in the cache: D values, and a scaled type's float32 scale.
template <typename KV, int HEAD_DIM>
__device__ __forceinline__ constexpr int kv_row_bytes() {
    return HEAD_DIM * KVType<KV>::BYTES + (KVType<KV>::SCALED ? 4 : 0);
}

// An fp8 code (0..255) as float32 divided by fp8_unit: the code moved into a binary16 and widened (cvt.f32.f16,
// exact, subnormals included): e5m2 is binary16's high byte (unit 1); e4m3fn's magnitude shifted into binary16's
// exponent and mantissa reads 2^-8 of its value (unit 256), and its 0x7F is NaN. The unit is folded into the row's
// scale (s * 256 is exact), so a value read is (h * 256) * s = the code's value times s, rounded once, as the
// reference's float32 product: few registers in the attention loop.
template <typename KV>
__device__ __forceinline__ float fp8_unit() {
    return KVType<KV>::MANT == 3 ? 256.f : 1.f;
}
template <typename KV>
__device__ __forceinline__ float fp8_half_value(unsigned int code) {
    if constexpr (KVType<KV>::MANT == 2) {
        return h2f((unsigned short)(code << 8));
    } else {
        const float h = h2f((unsigned short)(((code & 0x7fu) << 7) | ((code & 0x80u) << 8)));
        return (code & 0x7fu) == 0x7fu ? __uint_as_float(0x7fc00000u) : h;
    }
}
// m >> shift rounded to nearest, ties to even (0 < shift < 32; m < 2^31).
__device__ __forceinline__ unsigned int kv_shift_rne(unsigned int m, int shift) {
    return (m + (1u << (shift - 1)) - 1u + ((m >> shift) & 1u)) >> shift;
}

// float32 -> fp8 code, round to nearest even (ml_dtypes' conversion, overflow and NaN included).
template <typename KV>
__device__ __forceinline__ unsigned int float_to_fp8(float x) {
    constexpr int MANT = KVType<KV>::MANT, BIAS = KVType<KV>::BIAS;
    constexpr bool E4M3 = MANT == 3;
    const unsigned int u = __float_as_uint(x);
    const unsigned int sign = (u >> 24) & 0x80u;
    const unsigned int a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | (E4M3 ? 0x7fu : 0x7eu);  // NaN
    if (a == 0x7f800000u) return sign | (E4M3 ? 0x7fu : 0x7cu);  // infinity (e4m3fn: NaN)
    const int e = (int)(a >> 23) - 127 + BIAS;  // the fp8 exponent field before rounding
    unsigned int code;
    if (e >= 1) {
        code = kv_shift_rne(a, 23 - MANT) - ((unsigned int)(127 - BIAS) << MANT);
    } else if ((a >> 23) == 0) {
        code = 0;  // a float32 subnormal: far below half the smallest fp8 subnormal
    } else {
        const int shift = 23 - MANT + 1 - e;
        code = shift > 31 ? 0u : kv_shift_rne((a & 0x7fffffu) | 0x800000u, shift);
    }
    if (E4M3 && code > 0x7eu) return sign | 0x7fu;
    if (!E4M3 && code > 0x7bu) return sign | 0x7cu;
    return sign | code;
}

// float32 -> bfloat16 bits, round to nearest even; a NaN stays a quiet NaN with its high bits (kv_convert's rule).
__device__ __forceinline__ unsigned int kv_float_to_bf16(float f) {
    const unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

// One value stored as KV (16-bit: its bits; fp8: its code), unscaled.
template <typename KV>
__device__ __forceinline__ unsigned int kv_encode(float x) {
    if constexpr (KVType<KV>::SCALED) return float_to_fp8<KV>(x);
    else if constexpr (KVType<KV>::HALF) return f2h(x);
    else return kv_float_to_bf16(x);
}

// The shared-memory tile of PS_TILE_N key rows: 16-bit rows padded by 8 values (conflict-free 16-byte reads), fp8
// rows of D codes and the scale's 4 bytes padded to D + 16 (8-byte reads of the codes stay aligned).
template <typename KV, int HEAD_DIM>
__device__ __forceinline__ constexpr int kv_tile_pitch() {
    return KVType<KV>::SCALED ? HEAD_DIM + 16 : (HEAD_DIM + 8) * 2;
}

// Two consecutive 16-bit values (low one first) as floats.
template <typename KV>
__device__ __forceinline__ float2 kv_pair16(unsigned int v) {
    return pair_to_float2<KV>(v);
}

// Values d, d + 1 of tile row `row`, converted (and scaled: fp8).
template <typename KV, int HEAD_DIM>
__device__ __forceinline__ float2 kv_tile_pair(const unsigned char* tile, int row, int d) {
    const unsigned char* p = tile + row * kv_tile_pitch<KV, HEAD_DIM>();
    if constexpr (KVType<KV>::SCALED) {
        const float s = *reinterpret_cast<const float*>(p + HEAD_DIM) * fp8_unit<KV>();
        const unsigned int two = *reinterpret_cast<const unsigned short*>(p + d);
        return float2{__fmul_rn(fp8_half_value<KV>(two & 0xffu), s), __fmul_rn(fp8_half_value<KV>(two >> 8), s)};
    } else {
        return kv_pair16<KV>(*reinterpret_cast<const unsigned int*>(p + 2 * d));
    }
}

// Values d .. d + N - 1 of tile row `row` (d a multiple of N; N = kv_run<KV>(): 8 16-bit values from one 16-byte
// read, 4 fp8 codes from one 4-byte read, converted and scaled: fewer values live in registers than 8 would keep).
template <typename KV>
__device__ __forceinline__ constexpr int kv_run() {
    return KVType<KV>::SCALED ? 4 : 8;
}
template <typename KV, int HEAD_DIM>
__device__ __forceinline__ void kv_tile_run(const unsigned char* tile, int row, int d, float (&k)[kv_run<KV>()]) {
    const unsigned char* p = tile + row * kv_tile_pitch<KV, HEAD_DIM>();
    if constexpr (KVType<KV>::SCALED) {
        const float s = *reinterpret_cast<const float*>(p + HEAD_DIM) * fp8_unit<KV>();
        const unsigned int raw = *reinterpret_cast<const unsigned int*>(p + d);
#pragma unroll
        for (int i = 0; i < 4; ++i) k[i] = __fmul_rn(fp8_half_value<KV>((raw >> (8 * i)) & 0xffu), s);
    } else {
        const uint4 raw = *reinterpret_cast<const uint4*>(p + 2 * d);
        const unsigned int w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = kv_pair16<KV>(w[i]);
            k[2 * i] = f.x;
            k[2 * i + 1] = f.y;
        }
    }
}
