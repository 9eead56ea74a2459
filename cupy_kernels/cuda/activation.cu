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
