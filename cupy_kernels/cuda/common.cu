// Shared prelude for every pagedserve kernel module.
//
// cuda_ops.py prepends this file (after its #define lines) to each kernel family's source before
// handing the string to cupy.RawModule, and tests/cupy_kernels/test_nvcc_compile.py compiles the
// very same strings with nvcc. It holds no kernels, only helpers.
//
// No #include on purpose: NVRTC (what CuPy compiles with) finds CUDA headers only when CuPy can
// locate a toolkit, and cuda_fp16.h has moved between toolkit versions. Half precision is handled
// here with two PTX conversions instead, so the sources compile the same under NVRTC and nvcc.

// float16 storage: the bit pattern of an IEEE binary16 value. Arithmetic is always done in float32.
struct __align__(2) f16 {
    unsigned short bits;
};

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// Round to nearest even, as numpy's float32 -> float16 cast does.
__device__ __forceinline__ unsigned short f2h(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float to_float(f16 x) { return h2f(x.bits); }
__device__ __forceinline__ float to_float(float x) { return x; }

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ f16 from_float<f16>(float x) {
    f16 r;
    r.bits = f2h(x);
    return r;
}
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }

// Two packed halves (low half = lower address) <-> two floats.
__device__ __forceinline__ float2 half2_to_float2(unsigned int v) {
    float2 r;
    r.x = h2f((unsigned short)(v & 0xffffu));
    r.y = h2f((unsigned short)(v >> 16));
    return r;
}
__device__ __forceinline__ unsigned int float2_to_half2(float a, float b) {
    return (unsigned int)f2h(a) | ((unsigned int)f2h(b) << 16);
}

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Butterfly reductions: every lane ends with the same value, and the order of operations is fixed
// (it depends on nothing but the lane values), which keeps results reproducible bit for bit.
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}

// Asynchronous global -> shared copies (sm_80+). With src_bytes = 0 the 16 destination bytes are
// zero-filled and nothing is read: that is how keys past the context are masked without ever
// touching never-written cache slots.
__device__ __forceinline__ unsigned int smem_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
