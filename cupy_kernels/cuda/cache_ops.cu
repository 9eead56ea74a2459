// Paged KV cache writes and copy-on-write block copies.

// key/value [T, KV, D] (token and head strides given in elements, dims contiguous) -> the caches'
// slot `slot_mapping[t]` ([num_slots, KV, D] when flattened). Slot -1 means "do not write" (padding,
// or a token whose K/V is already cached); slots outside the cache are skipped as well (the host
// checks them when it has slot_mapping in host memory).
template <typename T>
__global__ void reshape_and_cache_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                         long long k_stride_token, long long k_stride_head,
                                         long long v_stride_token, long long v_stride_head,
                                         T* __restrict__ k_cache, T* __restrict__ v_cache,
                                         const long long* __restrict__ slot_mapping, long long num_slots,
                                         int num_kv_heads, int head_dim) {
    const long long token = blockIdx.x;
    const long long slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;
    const int n = num_kv_heads * head_dim;
    T* k_dst = k_cache + slot * n;
    T* v_dst = v_cache + slot * n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const int h = i / head_dim;
        const int d = i % head_dim;
        k_dst[i] = key[token * k_stride_token + h * k_stride_head + d];
        v_dst[i] = value[token * v_stride_token + h * v_stride_head + d];
    }
}

// Copy whole blocks src -> dst in every layer with one launch. cache_ptrs holds the base addresses of
// all caches (layer 0 K, layer 0 V, layer 1 K, ...); block_mapping is [num_pairs, 2] (src, dst).
// grid = (num_pairs, num_caches). The CTAs of one launch run in any order, so a block that is both a
// source and a destination of one call (a fork's copy X -> Y, then X freed by a preemption and taken
// by a later copy-on-write Z -> X) cannot be copied directly. The host then makes two launches through
// a scratch buffer [num_pairs, num_caches, block_bytes], which gives numpy's "read every source, then
// write every destination" semantics:
//   phase 0  direct:  cache[src] -> cache[dst]       (no block is both; one launch)
//   phase 1  gather:  cache[src] -> scratch[pair]
//   phase 2  scatter: scratch[pair] -> cache[dst]    (ordered after phase 1 on the same stream)
extern "C" __global__ void copy_blocks_kernel(const unsigned long long* __restrict__ cache_ptrs,
                                              const long long* __restrict__ block_mapping,
                                              long long block_bytes, unsigned char* __restrict__ scratch,
                                              int phase) {
    unsigned char* base = reinterpret_cast<unsigned char*>(cache_ptrs[blockIdx.y]);
    const long long src = block_mapping[2 * blockIdx.x];
    const long long dst = block_mapping[2 * blockIdx.x + 1];
    unsigned char* staged = scratch + ((long long)blockIdx.x * gridDim.y + blockIdx.y) * block_bytes;
    const unsigned char* s = phase == 2 ? staged : base + src * block_bytes;
    unsigned char* t = phase == 1 ? staged : base + dst * block_bytes;
    if (block_bytes % 16 == 0) {  // the usual case: D * itemsize is a multiple of 16
        const long long n = block_bytes / 16;
        for (long long i = threadIdx.x; i < n; i += blockDim.x)
            reinterpret_cast<uint4*>(t)[i] = reinterpret_cast<const uint4*>(s)[i];
    } else {
        for (long long i = threadIdx.x; i < block_bytes; i += blockDim.x) t[i] = s[i];
    }
}

// One (token, kv head) row of D values of type T into a cache row of element type KV (kv_types.cuh), converted as it
// is written, by the 32 lanes of one warp: 16-bit values rounded (kv_encode); fp8 rows scaled by s = max|x| / the
// format's largest finite value (a row of zeros: s = 0, divided by 1), their codes then the scale's 4 bytes.
template <typename T, typename KV>
__device__ __forceinline__ void write_kv_row(const T* __restrict__ src, KV* __restrict__ cache, long long row,
                                             int head_dim) {
    const int lane = threadIdx.x;
    if constexpr (KVType<KV>::SCALED) {
        unsigned char* dst = reinterpret_cast<unsigned char*>(cache) + row * (head_dim + 4);
        float amax = 0.f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(to_float(src[d])));
        amax = warp_max(amax);
        const float scale = amax / KVType<KV>::MAX;  // IEEE division (no fast math), as numpy's
        const float safe = scale > 0.f ? scale : 1.f;
        for (int d = lane; d < head_dim; d += 32) dst[d] = (unsigned char)float_to_fp8<KV>(to_float(src[d]) / safe);
        if (lane == 0) *reinterpret_cast<float*>(dst + head_dim) = scale;  // rows start on 4 bytes (D even)
    } else {
        unsigned short* dst = reinterpret_cast<unsigned short*>(cache) + row * head_dim;
        for (int d = lane; d < head_dim; d += 32) dst[d] = (unsigned short)kv_encode<KV>(to_float(src[d]));
    }
}

// reshape_and_cache_kernel into caches of another element type than key/value's (kv_cache_dtype bfloat16 or fp8 for
// a float16 model): grid (tokens, kv heads), one warp each. Same slot rules.
template <typename T, typename KV>
__global__ void reshape_and_cache_kv_kernel(const T* __restrict__ key, const T* __restrict__ value,
                                            long long k_stride_token, long long k_stride_head,
                                            long long v_stride_token, long long v_stride_head,
                                            KV* __restrict__ k_cache, KV* __restrict__ v_cache,
                                            const long long* __restrict__ slot_mapping, long long num_slots,
                                            int num_kv_heads, int head_dim) {
    const long long token = blockIdx.x;
    const int head = blockIdx.y;
    const long long slot = slot_mapping[token];
    if (slot < 0 || slot >= num_slots) return;
    const long long row = slot * num_kv_heads + head;
    write_kv_row<T, KV>(key + token * k_stride_token + head * k_stride_head, k_cache, row, head_dim);
    write_kv_row<T, KV>(value + token * v_stride_token + head * v_stride_head, v_cache, row, head_dim);
}
