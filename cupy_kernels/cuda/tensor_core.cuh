// Tensor-core helpers: bfloat16 storage (bf16, pair_to_float2, pack2) and the warp-level m16n8k16 mma (sm_80+).
//
// Prepended (after common.cu) to the modules that list it in modules.py's `preludes`; the host emulation
// (tests/cupy_kernels/_host_emulation.h) stands in for this whole file, with the same names.
//
// mma_m16n8k16<T>(d, a, b): d += A.B for one warp, T = f16 or bf16 inputs, fp32 accumulators, with the
// per-lane fragment layout of the PTX ISA (mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}...):
//   g = lane >> 2 (groupID), t = lane % 4 (threadID_in_group); a "pair" is two consecutive columns, the
//   lower one in the register's low 16 bits.
//   A 16x16, row-major: a[0] = A[g][2t..2t+1], a[1] = A[g+8][2t..], a[2] = A[g][2t+8..], a[3] = A[g+8][2t+8..]
//   B 16x8 (k x n), "col": b[0] = (B[2t][g], B[2t+1][g]), b[1] = (B[2t+8][g], B[2t+9][g])
//   C/D 16x8 fp32:        d[0], d[1] = D[g][2t], D[g][2t+1];  d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
// Every lane of the warp must call it together (it is .aligned).

// bfloat16 storage: the upper 16 bits of an IEEE binary32 value.
struct __align__(2) bf16 {
    unsigned short bits;
};

__device__ __forceinline__ float bf2f(unsigned short h) { return __int_as_float(((unsigned int)h) << 16); }

// Round to nearest even (sm_80+), as ml_dtypes' float32 -> bfloat16 cast does.
__device__ __forceinline__ unsigned short f2bf(float f) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float to_float(bf16 x) { return bf2f(x.bits); }
template <> __device__ __forceinline__ bf16 from_float<bf16>(float x) {
    bf16 r;
    r.bits = f2bf(x);
    return r;
}

// One register of two T (lo in the low half) <-> two floats.
template <typename T> __device__ __forceinline__ float2 pair_to_float2(unsigned int v);
template <> __device__ __forceinline__ float2 pair_to_float2<f16>(unsigned int v) { return half2_to_float2(v); }
template <> __device__ __forceinline__ float2 pair_to_float2<bf16>(unsigned int v) {
    float2 r;
    r.x = __int_as_float((int)(v << 16));
    r.y = __int_as_float((int)(v & 0xffff0000u));
    return r;
}
// Two floats -> one register of two T (lo in the low half).
template <typename T> __device__ __forceinline__ unsigned int pack2(float lo, float hi);
template <> __device__ __forceinline__ unsigned int pack2<f16>(float lo, float hi) { return float2_to_half2(lo, hi); }
template <> __device__ __forceinline__ unsigned int pack2<bf16>(float lo, float hi) {
    return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
}

template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]);

template <>
__device__ __forceinline__ void mma_m16n8k16<f16>(float (&d)[4], const unsigned int (&a)[4],
                                                  const unsigned int (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

template <>
__device__ __forceinline__ void mma_m16n8k16<bf16>(float (&d)[4], const unsigned int (&a)[4],
                                                   const unsigned int (&b)[2]) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// ldmatrix.sync.aligned.m8n8.x4.shared.b16: lanes 8i..8i+7 give the row addresses of matrix i; afterwards r[i] of
// lane (g, t) holds (M_i[g][2t], M_i[g][2t+1]): an mma B fragment when M_i is an n x k tile stored row-major
// (n rows), i.e. K[key][dim] read as B[k = dim][n = key] for S = Q K^T.
__device__ __forceinline__ void ldmatrix_x4(unsigned int (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row_addr)));
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: four 8x8 matrices of 16-bit values, transposed on the way.
// Lanes 8i..8i+7 give the addresses of rows 0..7 of matrix i (16 bytes each, 16-byte aligned); afterwards
// r[i] of lane (g, t) holds (M_i[2t][g], M_i[2t+1][g]): an mma B fragment when M_i is a k x n tile stored
// row-major (k rows), i.e. V[key][dim] read as B[k = key][n = dim].
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int (&r)[4], const void* row_addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(row_addr)));
}
