// RMSNorm, optionally fused with the residual add that precedes it in every Llama block.
//
// One CTA per row. Math in float32, rounding where ops.add_rms_norm / ops.rms_norm round:
//   residual = T(x + residual)                         (written back in place: the next residual)
//   normed   = T(residual / sqrt(mean(residual^2) + eps) * weight)
// The sum of squares is reduced in a fixed order (per-thread strided sums, then butterflies; the
// block size depends on the hidden size only), so a row's result does not depend on the batch.
// residual_out may be the residual itself (the in-place update): each element is read and then
// written by the same thread, so no __restrict__ on either.

#define PS_NORM_MAX_WARPS 32

template <typename T>
__global__ void add_rms_norm_kernel(T* __restrict__ normed, T* residual_out, const T* __restrict__ x,
                                    long long x_stride, const T* residual, long long r_stride,
                                    const T* __restrict__ weight, int hidden, float eps, int has_residual) {
    __shared__ float partial[PS_NORM_MAX_WARPS];
    __shared__ float denom_s;
    const long long row = blockIdx.x;
    const T* x_row = x + row * x_stride;
    T* res_row = residual_out + row * r_stride;  // used only when has_residual

    float ss = 0.f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = to_float(x_row[i]);
        if (has_residual) {
            const T sum = from_float<T>(v + to_float(residual[row * r_stride + i]));
            res_row[i] = sum;
            v = to_float(sum);
        }
        ss = fmaf(v, v, ss);
    }
    ss = warp_sum(ss);
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        const int num_warps = (blockDim.x + 31) >> 5;
        float t = lane < num_warps ? partial[lane] : 0.f;
        t = warp_sum(t);
        if (lane == 0) denom_s = sqrtf(t / (float)hidden + eps);
    }
    __syncthreads();
    const float denom = denom_s;
    T* out_row = normed + row * (long long)hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        const float v = has_residual ? to_float(res_row[i]) : to_float(x_row[i]);
        out_row[i] = from_float<T>(v / denom * to_float(weight[i]));
    }
}
