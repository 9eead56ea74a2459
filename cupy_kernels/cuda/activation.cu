// SwiGLU activation: x [T, 2I] = [gate | up] -> silu(gate) * up, [T, I]. float32 math, one rounding.
// x rows may be strided (stride in elements); out is contiguous. grid = (T, ceil(I / blockDim)): rows on
// grid.x, whose limit (2^31 - 1) no batch reaches.
template <typename T>
__global__ void silu_and_mul_kernel(T* __restrict__ out, const T* __restrict__ x, long long x_stride,
                                    int inter) {
    const long long row = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= inter) return;
    const float g = to_float(x[row * x_stride + i]);
    const float u = to_float(x[row * x_stride + inter + i]);
    // exp(-g) overflows to inf for very negative g: g / inf = -0, the limit of silu.
    out[row * (long long)inter + i] = from_float<T>(g / (1.f + expf(-g)) * u);
}

// x [T, N] (row stride in elements) -> out [T, N] float32, contiguous: the logits' one conversion (float16
// storage to the sampler's float32) into a buffer of the caller's, instead of an allocating astype.
template <typename T>
__global__ void to_float32_kernel(float* __restrict__ out, const T* __restrict__ x, long long x_stride, int n) {
    const long long row = blockIdx.x;
    const int i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[row * (long long)n + i] = to_float(x[row * x_stride + i]);
}
