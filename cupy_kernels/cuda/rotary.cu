// Rotary position embedding, "neox" / rotate-half layout (ops.apply_rotary): the first and second
// halves of each head are the (real, imaginary) parts.
//   out[:half] = x1 * cos - x2 * sin,  out[half:] = x2 * cos + x1 * sin
// Products and sums are rounded separately (__fmul_rn / __fadd_rn forbid fusing them into an FMA),
// as numpy does, so float16 outputs match the reference bit for bit in almost every element.
//
// x [T, heads, D] with token / head strides in elements (a view of the fused qkv projection);
// cos, sin [T, D / 2] float32; out [T, heads, D] contiguous. One CTA per token.
template <typename T>
__global__ void rotary_kernel(T* __restrict__ out, const T* __restrict__ x, long long stride_token,
                              long long stride_head, const float* __restrict__ cos,
                              const float* __restrict__ sin, int num_heads, int head_dim) {
    const long long token = blockIdx.x;
    const int half = head_dim / 2;
    const T* src = x + token * stride_token;
    T* dst = out + token * (long long)num_heads * head_dim;
    const float* c_row = cos + token * half;
    const float* s_row = sin + token * half;
    for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
        const int h = i / half;
        const int d = i % half;
        const float x1 = to_float(src[h * stride_head + d]);
        const float x2 = to_float(src[h * stride_head + d + half]);
        const float c = c_row[d];
        const float s = s_row[d];
        dst[h * head_dim + d] = from_float<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s)));
        dst[h * head_dim + d + half] = from_float<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s)));
    }
}

// cos and sin [T, D / 2] float32 of positions [T] (int64) x inv_freq [D / 2] (float64): the product, cos and sin in
// float64 and one rounding to float32, as ops.rope_cos_sin (and CuPy's float64 cos/sin before this kernel) do.
// Written into buffers of their own, so a captured forward allocates nothing. One CTA per token.
extern "C" __global__ void rope_cos_sin_kernel(float* __restrict__ cos_out, float* __restrict__ sin_out,
                                               const long long* __restrict__ positions,
                                               const double* __restrict__ inv_freq, int half) {
    const long long token = blockIdx.x;
    const double p = (double)positions[token];
    for (int d = threadIdx.x; d < half; d += blockDim.x) {
        const double f = p * inv_freq[d];
        cos_out[token * half + d] = (float)cos(f);
        sin_out[token * half + d] = (float)sin(f);
    }
}
