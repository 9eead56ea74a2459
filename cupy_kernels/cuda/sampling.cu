// On-device sampling helpers.
//
// argmax_rows: the index of the largest value of each row of logits [B, V] (float32 or float16), the
// first one on ties and the first NaN if there is one, exactly numpy.argmax's rule. One CTA per row;
// the winner is picked by (value, index) comparisons, which are exact, so the result is bitwise
// reproducible and does not depend on the block size.

__device__ __forceinline__ bool argmax_better(float a, long long ia, float b, long long ib) {
    const bool a_nan = a != a;
    const bool b_nan = b != b;
    if (a_nan || b_nan) return a_nan && (!b_nan || ia < ib);
    return a > b || (a == b && ia < ib);
}

template <typename T>
__global__ void argmax_rows_kernel(long long* __restrict__ out, const T* __restrict__ logits, long long stride,
                                   int vocab) {
    __shared__ float best_v[32];
    __shared__ long long best_i[32];
    const long long row = blockIdx.x;
    const T* x = logits + row * stride;
    float v = neg_inf();
    long long idx = 0x7fffffffffffffffLL;  // loses every tie: any real index is smaller
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float xi = to_float(x[i]);
        if (argmax_better(xi, i, v, idx)) {
            v = xi;
            idx = i;
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
        const long long oi = __shfl_xor_sync(0xffffffffu, idx, offset);
        if (argmax_better(ov, oi, v, idx)) {
            v = ov;
            idx = oi;
        }
    }
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    if (lane == 0) {
        best_v[warp] = v;
        best_i[warp] = idx;
    }
    __syncthreads();
    if (warp == 0) {
        const int num_warps = (blockDim.x + 31) >> 5;
        v = lane < num_warps ? best_v[lane] : neg_inf();
        idx = lane < num_warps ? best_i[lane] : 0x7fffffffffffffffLL;
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, offset);
            const long long oi = __shfl_xor_sync(0xffffffffu, idx, offset);
            if (argmax_better(ov, oi, v, idx)) {
                v = ov;
                idx = oi;
            }
        }
        if (lane == 0) out[row] = idx;
    }
}
