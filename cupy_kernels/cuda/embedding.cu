// Embedding lookup: out[t] = table[ids[t]], table [V, hidden] (row stride in elements), ids [T] int64, out
// [T, hidden] contiguous. Ids are checked before (on the host, or trusted as device metadata that was). One CTA
// per token; a copy, so the bits are the table's.
template <typename T>
__global__ void embedding_kernel(T* __restrict__ out, const T* __restrict__ table, long long table_stride,
                                 const long long* __restrict__ ids, int hidden) {
    const long long token = blockIdx.x;
    const T* src = table + ids[token] * table_stride;
    T* dst = out + token * (long long)hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) dst[i] = src[i];
}
