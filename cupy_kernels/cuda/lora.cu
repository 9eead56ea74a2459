// Batched LoRA (Punica's shrink and expand) over per-row adapter slots: the CUDA side of
// cupy_kernels/reference/lora.py. One CTA per row; a row whose slot is -1 (the base model) returns at once.
// The slots are read from a device buffer, so a captured graph replays whatever the step wrote there.
//
//   shrink:  t[row, r]  = sum_k A[slot, r, k] * x[row, k]           (float32 t; a warp per r, lanes over k)
//   expand:  y[row, o] += scale[slot] * sum_r B[slot, r, o] * t[row, r]   (threads over o, r in order;
//            B is [rank, n_out]: a warp reads 32 consecutive outputs of one rank row)
//
// Each row's sums run in an order fixed by the shapes alone (lane-strided partial sums, then butterflies),
// so a row's result does not depend on the batch.

template <typename T>
__global__ void lora_shrink_kernel(float* __restrict__ t, const T* __restrict__ x, long long x_stride,
                                   const T* __restrict__ a, const int* __restrict__ slots, int n_in, int rank) {
    const long long row = blockIdx.x;
    const int s = slots[row];
    if (s < 0) {  // a base row: its t row is zeros (the whole CTA returns: no barrier follows)
        for (int r = threadIdx.x; r < rank; r += blockDim.x) t[row * rank + r] = 0.f;
        return;
    }
    const int warp = threadIdx.x >> 5;
    const int lane = threadIdx.x & 31;
    const int num_warps = blockDim.x >> 5;
    const T* x_row = x + row * x_stride;
    for (int r = warp; r < rank; r += num_warps) {
        const T* a_row = a + ((long long)s * rank + r) * n_in;
        float acc = 0.f;
        for (int k = lane; k < n_in; k += 32) acc = fmaf(to_float(a_row[k]), to_float(x_row[k]), acc);
        acc = warp_sum(acc);
        if (lane == 0) t[row * rank + r] = acc;
    }
}

template <typename T>
__global__ void lora_expand_kernel(T* y, long long y_stride, const float* __restrict__ t, const T* __restrict__ b,
                                   const float* __restrict__ scale, const int* __restrict__ slots, int n_out,
                                   int rank) {
    const long long row = blockIdx.x;
    const int s = slots[row];
    if (s < 0) return;
    const float sc = scale[s];
    const float* t_row = t + row * rank;
    T* y_row = y + row * y_stride;
    for (int o = threadIdx.x; o < n_out; o += blockDim.x) {
        const T* b_col = b + (long long)s * rank * n_out + o;
        float acc = 0.f;
        for (int r = 0; r < rank; ++r) acc = fmaf(to_float(b_col[(long long)r * n_out]), t_row[r], acc);
        y_row[o] = from_float<T>(to_float(y_row[o]) + sc * acc);
    }
}
