// Unified paged attention over a flat, variable-length batch (prefill chunks and decodes mixed).
//
// Layout contract (see paged_attention.py):
//   query   [T, H, D] float16 or bfloat16 (the template's T; f16 by default), rows may be strided (a view of
//           the fused qkv projection)
//   caches  [num_blocks, BLOCK_SIZE, KV, D] of the template's KV (T's by default; kv_types.cuh: bfloat16, or fp8
//           rows of D codes and their float32 scale, D + 4 bytes), C-contiguous
//   query_start_loc [B + 1], seq_lens [B], block_tables [B, stride] int32
//   out     [T, H, D] T (arithmetic in float32 whatever T is)
// Query row j of a sequence with n new tokens sits at position seq_len - n + j and sees keys 0..pos;
// with sliding_window = W > 0 only keys pos - W < key <= pos (0: no window).
//
// Work split (one CTA = 4 warps):
//   grid.x  query tiles. A tile holds BLOCK_Q = BLOCK_M / G consecutive query tokens of ONE sequence
//           times the G query heads that share a kv head, so BLOCK_M "rows" in all. Sequence s owns
//           tiles tile_start(s) .. with tile_start(s) = (query_start_loc[s] - s) / BLOCK_Q + s, found
//           by binary search (an upper bound on the tile count needs only T and B, never a device
//           read). Surplus tiles exit at once.
//   grid.y  kv heads. Each 32-key tile of K and V is read from the cache once per query-head group.
//   grid.z  partitions of PS_PARTITION_SIZE keys. Only single-token (decode) sequences are split;
//           they get ceil(seq_len / PS_PARTITION_SIZE) partitions, a function of their own length.
//           A split sequence writes an unnormalised partial (acc, max, sum) per partition, combined by
//           paged_attention_reduce_kernel. Everything else is done by partition 0 alone.
// prefill_elsewhere = 1: sequences with more than one new token are left to prefill_attention.cu (their tiles
// exit at once); the rest is unchanged.
// Sequence range: a launch computes the sequences [seq_begin, seq_end) only (tiles of the others exit
// at once) and indexes its partials by seq - seq_begin, so the host can bound the partial buffer
// ([seq_end - seq_begin, H, max_parts, D] float32) by launching a large batch of long decodes in
// several ranges. A row's arithmetic is the same whichever range computes it.
//
// Per 32-key tile: cp.async loads K and V into shared memory (keys past the tile's end are
// zero-filled, never read), scores S = Q.K (one lane per key, fp32, exact fixed order over D), an
// online-softmax update per row in base 2 (the scale is folded into Q as scale * log2(e)), and
// acc = acc * alpha + P.V. K of the next tile is prefetched while the softmax and P.V of this one run;
// V of the next tile while its scores are computed.
//
// Sliding window: a CTA's key walk starts at the 32-key tile (a multiple of PS_TILE_N: fixed positions) that
// holds the oldest key its first row sees; a split decode's partitions start at the one holding the oldest
// key of its window. Keys older than the first row's window are never read (their blocks may belong to
// another sequence by now): zero-filled like keys past the end, and masked for every row, as are the keys a
// later row's window has left. A leading tile a row sees
// nothing of is an exact no-op for it (m stays -inf, alpha = p = 0 on a zero acc), so where the walk starts
// never changes a row's bits.
//
// Batch invariance: every row's arithmetic (dot products over D in a fixed order, the warp reductions,
// the sequential P.V accumulation over keys, the partition split) depends only on that row's query,
// its position, its sequence's length and the cache contents, never on BLOCK_M or on which other
// rows or sequences share the launch. Key tiles beyond a row's position are exact no-ops for it
// (alpha = exp2(0) = 1, p = 0).

#ifndef PS_ATTN_THREADS
#error "cuda_ops.py defines PS_ATTN_THREADS, PS_TILE_N and PS_PARTITION_SIZE"
#endif

#define PS_ATTN_WARPS (PS_ATTN_THREADS / 32)
// At least 4 CTAs (16 warps) per SM: caps registers at 128 per thread. Left to itself ptxas picks
// 48-56 registers plus spills for the small tiles, or 255 registers for the largest.
#define PS_ATTN_MIN_BLOCKS 4

// Sequence owning query tile `tile`: the largest s with tile_start(s) <= tile.
__device__ __forceinline__ int find_sequence(const int* __restrict__ query_start_loc, int num_seqs, int block_q,
                                             int tile) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const int start = (query_start_loc[mid] - mid) / block_q + mid;
        if (start <= tile) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// Issue the cp.async copies of keys [t0, t0 + PS_TILE_N) of one kv head into a shared tile;
// keys >= k_end or < k_lo (older than every row's window) are zero-filled, never read.
template <int HEAD_DIM, int BLOCK_SIZE, typename T>
__device__ __forceinline__ void load_kv_tile(T (*dst)[HEAD_DIM + 8], const T* __restrict__ cache,
                                             const int* __restrict__ block_table, long long slot_stride,
                                             int kv_head, int k_lo, int t0, int k_end) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per key row
    for (int c = threadIdx.x; c < PS_TILE_N * CHUNKS; c += PS_ATTN_THREADS) {
        const int row = c / CHUNKS;
        const int col = (c % CHUNKS) * 8;
        const int key = t0 + row;
        const T* src = cache;  // not read when the key is masked
        int bytes = 0;
        if (key >= k_lo && key < k_end) {
            const long long block = block_table[key / BLOCK_SIZE];
            src = cache + (block * BLOCK_SIZE + key % BLOCK_SIZE) * slot_stride + (long long)kv_head * HEAD_DIM + col;
            bytes = 16;
        }
        cp_async_16(&dst[row][col], src, bytes);
    }
}

// An fp8 tile (kv_types.cuh): rows of D codes and their scale, D + 4 bytes at 4-byte (not 16-byte) boundaries in
// the cache, read by plain 4-byte loads (zeros for a masked key: scale 0) into rows of kv_tile_pitch bytes.
template <int HEAD_DIM, int BLOCK_SIZE, typename KV>
__device__ __forceinline__ void load_scaled_tile(unsigned char* dst, const KV* __restrict__ cache,
                                                 const int* __restrict__ block_table, int num_kv_heads, int kv_head,
                                                 int k_lo, int t0, int k_end) {
    constexpr int ROW = kv_row_bytes<KV, HEAD_DIM>();
    constexpr int WORDS = ROW / 4;
    const unsigned char* base = reinterpret_cast<const unsigned char*>(cache);
    for (int c = threadIdx.x; c < PS_TILE_N * WORDS; c += PS_ATTN_THREADS) {
        const int row = c / WORDS;
        const int col = (c % WORDS) * 4;
        const int key = t0 + row;
        unsigned int word = 0u;
        if (key >= k_lo && key < k_end) {
            const long long slot = (long long)block_table[key / BLOCK_SIZE] * BLOCK_SIZE + key % BLOCK_SIZE;
            word = *reinterpret_cast<const unsigned int*>(base + (slot * num_kv_heads + kv_head) * ROW + col);
        }
        *reinterpret_cast<unsigned int*>(dst + row * kv_tile_pitch<KV, HEAD_DIM>() + col) = word;
    }
}

// A K or V tile of keys [t0, t0 + PS_TILE_N) into shared memory: 16-bit rows by cp.async, fp8 rows as above.
template <int HEAD_DIM, int BLOCK_SIZE, typename KV>
__device__ __forceinline__ void load_tile(unsigned char* dst, const KV* __restrict__ cache,
                                          const int* __restrict__ block_table, int num_kv_heads, int kv_head,
                                          int k_lo, int t0, int k_end) {
    if constexpr (KVType<KV>::SCALED)
        load_scaled_tile<HEAD_DIM, BLOCK_SIZE, KV>(dst, cache, block_table, num_kv_heads, kv_head, k_lo, t0, k_end);
    else
        load_kv_tile<HEAD_DIM, BLOCK_SIZE, KV>(reinterpret_cast<KV (*)[HEAD_DIM + 8]>(dst), cache, block_table,
                                               (long long)num_kv_heads * HEAD_DIM, kv_head, k_lo, t0, k_end);
}

// Shared memory of one CTA. The tiles are dynamic (extern __shared__): the host launches with
// attention_shared_bytes(HEAD_DIM, BLOCK_M) bytes (modules.py, the same sum) and opts the kernel in where they and
// the static per-row arrays pass the 48 KB a launch gets without (head dim 256 at BLOCK_M 16: 52,288 + 320).
// Byte offsets, each a multiple of 16:
//   Q     float [BLOCK_M][HEAD_DIM]         the tile's queries, scale * log2(e) folded in
//   K, V  KV [PS_TILE_N][HEAD_DIM + 8]      one key tile each (+8 halves: conflict-free 16-byte reads; fp8 rows
//                                           of HEAD_DIM + 16 bytes fit in the same space: kv_tile_pitch)
//   P     float [BLOCK_M][PS_TILE_N + 1]    scores, then probabilities
// The five per-row arrays (5 x BLOCK_M x 4 bytes) stay static: in the dynamic buffer the compiler cannot tell
// them from the tiles, and BLOCK_M 32 at head dim 128 spilled 40 / 36 bytes (stores / loads) on sm_90, not 28 / 28.
template <int HEAD_DIM, int BLOCK_M>
struct AttentionSmem {
    static constexpr int Q = 0;
    static constexpr int K = Q + BLOCK_M * HEAD_DIM * 4;
    static constexpr int V = K + PS_TILE_N * (HEAD_DIM + 8) * 2;
    static constexpr int P = V + PS_TILE_N * (HEAD_DIM + 8) * 2;
    static constexpr int BYTES = P + BLOCK_M * (PS_TILE_N + 1) * 4;
    static_assert(K % 16 == 0 && V % 16 == 0 && P % 16 == 0, "16-byte aligned tiles");
};

#ifndef PS_HOST_EMULATION  // the host emulation brings its own: a per-launch buffer that checks `bytes`
// The launch's dynamic shared memory; `bytes` is what the kernel's layout needs (the host launched with as much).
__device__ __forceinline__ unsigned char* dynamic_shared_memory(int /*bytes*/) {
    extern __shared__ __align__(16) unsigned char ps_dynamic_smem[];
    return ps_dynamic_smem;
}
#endif

// KV: the caches' element type (kv_types.cuh; T's by default), converted to float32 in registers as each K row's
// values are read for the scores and each V pair for P.V (fp8: times the row's scale), never dequantized apart.
template <int HEAD_DIM, int BLOCK_SIZE, int BLOCK_M, typename T = f16, typename KV = T>
__global__ void __launch_bounds__(PS_ATTN_THREADS, PS_ATTN_MIN_BLOCKS)
paged_attention_kernel(T* __restrict__ out,                 // [T, H, D]
                       float* __restrict__ part_acc,        // [seq_end - seq_begin, H, max_parts, D]
                       float* __restrict__ part_ml,         // [seq_end - seq_begin, H, max_parts, 2]
                       const T* __restrict__ query, long long q_stride_token, long long q_stride_head,
                       const KV* __restrict__ k_cache, const KV* __restrict__ v_cache,
                       const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                       const int* __restrict__ block_tables, long long block_table_stride, int num_seqs,
                       int num_heads, int num_kv_heads, int block_q, int max_parts, float scale_log2,
                       int seq_begin, int seq_end, int sliding_window, int prefill_elsewhere) {
    static_assert(HEAD_DIM % 8 == 0 && HEAD_DIM <= 2 * PS_ATTN_THREADS, "unsupported head dim");
    static_assert(sizeof(T) == 2, "AttentionSmem (and the host's attention_shared_bytes) assume 2-byte storage");
    static_assert(BLOCK_M % PS_ATTN_WARPS == 0, "rows must split evenly over warps");
    constexpr int ROWS_PER_WARP = BLOCK_M / PS_ATTN_WARPS;           // softmax / score rows per warp
    constexpr int PAIRS = HEAD_DIM / 2;                              // output dims handled as pairs
    constexpr int ROW_GROUPS = PS_ATTN_THREADS / PAIRS;              // P.V: threads per output pair
    static_assert(BLOCK_M % ROW_GROUPS == 0, "rows must split evenly over P.V row groups");
    constexpr int ROWS_PER_THREAD = BLOCK_M / ROW_GROUPS;

    using Smem = AttentionSmem<HEAD_DIM, BLOCK_M>;
    unsigned char* smem = dynamic_shared_memory(Smem::BYTES);
    float (*q_s)[HEAD_DIM] = reinterpret_cast<float (*)[HEAD_DIM]>(smem + Smem::Q);
    unsigned char* k_s = smem + Smem::K;  // kv_tile_pitch<KV, HEAD_DIM>() bytes a key row
    unsigned char* v_s = smem + Smem::V;
    float (*p_s)[PS_TILE_N + 1] = reinterpret_cast<float (*)[PS_TILE_N + 1]>(smem + Smem::P);
    __shared__ float alpha_s[BLOCK_M];
    __shared__ float m_s[BLOCK_M];
    __shared__ float l_s[BLOCK_M];
    __shared__ int pos_s[BLOCK_M];  // the row's key limit (its position), -1 for padding rows
    __shared__ int lo_s[BLOCK_M];   // the row's oldest key (0 without a window)

    const int tid = threadIdx.x;
    const int warp = tid >> 5;
    const int lane = tid & 31;
    const int tile = blockIdx.x;
    const int kv_head = blockIdx.y;
    const int part = blockIdx.z;
    const int group = num_heads / num_kv_heads;

    const int seq = find_sequence(query_start_loc, num_seqs, block_q, tile);
    if (seq < seq_begin || seq >= seq_end) return;
    const int q_begin = query_start_loc[seq];
    const int num_q = query_start_loc[seq + 1] - q_begin;
    if (prefill_elsewhere && num_q > 1) return;  // prefill_attention_kernel (tensor cores) does these rows
    const int q0 = (tile - ((q_begin - seq) / block_q + seq)) * block_q;  // first local query
    if (q0 >= num_q) return;
    const int token0 = q_begin + q0;  // the tile's first token (one value live to the epilogue, not two)
    const int seq_len = seq_lens[seq];
    const int tile_q = min(block_q, num_q - q0);
    const int first_pos = seq_len - num_q + q0;
    const int kv_end = first_pos + tile_q;  // keys [0, kv_end) are needed by some row of this tile

    const int key_lo = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;  // the first row's oldest key
    const bool split = num_q == 1 && seq_len > PS_PARTITION_SIZE;
    const int first_part = split ? key_lo / PS_PARTITION_SIZE : 0;
    const int num_parts = split ? (seq_len + PS_PARTITION_SIZE - 1) / PS_PARTITION_SIZE - first_part : 1;
    if (part >= num_parts) return;
    const int k_begin = split ? (first_part + part) * PS_PARTITION_SIZE : key_lo / PS_TILE_N * PS_TILE_N;
    const int k_end = split ? min(k_begin + PS_PARTITION_SIZE, kv_end) : kv_end;
    const int num_kv_tiles = (k_end - k_begin + PS_TILE_N - 1) / PS_TILE_N;

    const int* block_table = block_tables + (long long)seq * block_table_stride;

    // Start fetching the first K and V tiles before anything else.
    load_tile<HEAD_DIM, BLOCK_SIZE, KV>(k_s, k_cache, block_table, num_kv_heads, kv_head, key_lo, k_begin, k_end);
    cp_async_commit();
    load_tile<HEAD_DIM, BLOCK_SIZE, KV>(v_s, v_cache, block_table, num_kv_heads, kv_head, key_lo, k_begin, k_end);
    cp_async_commit();

    // Rows: r = query_in_tile * group + head_in_group.
    for (int r = tid; r < BLOCK_M; r += PS_ATTN_THREADS) {
        const int qi = r / group;
        pos_s[r] = (qi < tile_q) ? first_pos + qi : -1;
        lo_s[r] = sliding_window > 0 ? max(0, first_pos + qi - sliding_window + 1) : 0;
    }
    for (int i = tid; i < BLOCK_M * HEAD_DIM; i += PS_ATTN_THREADS) {
        const int r = i / HEAD_DIM;
        const int d = i % HEAD_DIM;
        const int qi = r / group;
        float value = 0.f;
        if (qi < tile_q) {
            const long long token = token0 + qi;
            const long long head = (long long)kv_head * group + r % group;
            value = to_float(query[token * q_stride_token + head * q_stride_head + d]) * scale_log2;
        }
        q_s[r][d] = value;
    }

    float m_row[ROWS_PER_WARP];
    float l_row[ROWS_PER_WARP];
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i) {
        m_row[i] = neg_inf();
        l_row[i] = 0.f;
    }
    const int pair = tid % PAIRS;
    const int row_group = tid / PAIRS;
    float2 acc[ROWS_PER_THREAD];
#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
        acc[j].x = 0.f;
        acc[j].y = 0.f;
    }

    for (int it = 0; it < num_kv_tiles; ++it) {
        const int t0 = k_begin + it * PS_TILE_N;
        cp_async_wait<1>();  // this tile's K has landed (its V may still be in flight)
        __syncthreads();

        // Scores: lane = key, warp = rows warp, warp + 4, ...
        {
            float s[ROWS_PER_WARP];
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) s[i] = 0.f;
            constexpr int RUN = kv_run<KV>();  // values converted at once (8; 4 for fp8: fewer registers)
#pragma unroll
            for (int d = 0; d < HEAD_DIM; d += RUN) {
                float k[RUN];  // key `lane`'s values d .. d + RUN - 1, converted in registers
                kv_tile_run<KV, HEAD_DIM>(k_s, lane, d, k);
#pragma unroll
                for (int i = 0; i < ROWS_PER_WARP; ++i) {
                    const int r = warp + i * PS_ATTN_WARPS;
                    float x = s[i];
#pragma unroll
                    for (int j = 0; j < RUN; j += 4) {  // the same fma order over d as one 8-value step
                        const float4 qa = *reinterpret_cast<const float4*>(&q_s[r][d + j]);
                        x = fmaf(qa.x, k[j], x);
                        x = fmaf(qa.y, k[j + 1], x);
                        x = fmaf(qa.z, k[j + 2], x);
                        x = fmaf(qa.w, k[j + 3], x);
                    }
                    s[i] = x;
                }
            }
            const int key = t0 + lane;
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) {
                const int r = warp + i * PS_ATTN_WARPS;
                const bool visible = key < k_end && key <= pos_s[r] && key >= lo_s[r];  // pos_s = -1: padding
                p_s[r][lane] = visible ? s[i] : neg_inf();
            }
        }
        __syncthreads();  // every warp is done reading k_s

        if (it + 1 < num_kv_tiles)
            load_tile<HEAD_DIM, BLOCK_SIZE, KV>(k_s, k_cache, block_table, num_kv_heads, kv_head, key_lo,
                                                t0 + PS_TILE_N, k_end);
        cp_async_commit();  // possibly empty: keeps the group count uniform

        // Online softmax, base 2. Warp w owns rows w, w + 4, ... (the rows it just scored).
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            const int r = warp + i * PS_ATTN_WARPS;
            const float s = p_s[r][lane];
            const float m_new = fmaxf(m_row[i], warp_max(s));
            const float m_use = (m_new == neg_inf()) ? 0.f : m_new;  // a row with no key yet
            const float p = exp2f(s - m_use);
            const float alpha = exp2f(m_row[i] - m_use);
            l_row[i] = fmaf(l_row[i], alpha, warp_sum(p));
            m_row[i] = m_new;
            p_s[r][lane] = p;
            if (lane == 0) alpha_s[r] = alpha;
        }

        cp_async_wait<1>();  // this tile's V has landed (the next K may still be in flight)
        __syncthreads();

        // acc = acc * alpha + P.V: thread = (pair of dims, rows row_group, row_group + ROW_GROUPS, ...)
#pragma unroll
        for (int j = 0; j < ROWS_PER_THREAD; ++j) {
            const float a = alpha_s[row_group + j * ROW_GROUPS];
            acc[j].x *= a;
            acc[j].y *= a;
        }
#pragma unroll 4
        for (int t = 0; t < PS_TILE_N; ++t) {
            const float2 v = kv_tile_pair<KV, HEAD_DIM>(v_s, t, 2 * pair);
#pragma unroll
            for (int j = 0; j < ROWS_PER_THREAD; ++j) {
                const float p = p_s[row_group + j * ROW_GROUPS][t];
                acc[j].x = fmaf(p, v.x, acc[j].x);
                acc[j].y = fmaf(p, v.y, acc[j].y);
            }
        }
        __syncthreads();  // every warp is done reading v_s and p_s

        if (it + 1 < num_kv_tiles)
            load_tile<HEAD_DIM, BLOCK_SIZE, KV>(v_s, v_cache, block_table, num_kv_heads, kv_head, key_lo,
                                                t0 + PS_TILE_N, k_end);
        cp_async_commit();
    }
    cp_async_wait<0>();

    if (lane == 0) {
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) {
            m_s[warp + i * PS_ATTN_WARPS] = m_row[i];
            l_s[warp + i * PS_ATTN_WARPS] = l_row[i];
        }
    }
    __syncthreads();

#pragma unroll
    for (int j = 0; j < ROWS_PER_THREAD; ++j) {
        const int r = row_group + j * ROW_GROUPS;
        if (pos_s[r] < 0) continue;
        const long long head = (long long)kv_head * group + r % group;
        if (!split) {
            const long long token = token0 + r / group;
            const float l = l_s[r];
            const float inv = l > 0.f ? 1.f / l : 0.f;
            unsigned int* dst = reinterpret_cast<unsigned int*>(out + (token * num_heads + head) * HEAD_DIM + 2 * pair);
            *dst = pack2<T>(acc[j].x * inv, acc[j].y * inv);
        } else {
            const long long slot = ((long long)(seq - seq_begin) * num_heads + head) * max_parts + part;
            float2* dst = reinterpret_cast<float2*>(part_acc + slot * HEAD_DIM + 2 * pair);
            *dst = acc[j];
            if (pair == 0) {
                part_ml[2 * slot] = m_s[r];
                part_ml[2 * slot + 1] = l_s[r];
            }
        }
    }
}

// Combine the partitions of split (single-token) sequences: one CTA per (sequence of the range, query
// head), one thread per output dim. Partitions are folded in index order, so the result depends only on
// the sequence.
template <int HEAD_DIM, typename T = f16>
__global__ void __launch_bounds__(HEAD_DIM)
paged_attention_reduce_kernel(T* __restrict__ out, const float* __restrict__ part_acc,
                              const float* __restrict__ part_ml, const int* __restrict__ query_start_loc,
                              const int* __restrict__ seq_lens, int num_heads, int max_parts, int seq_begin,
                              int sliding_window) {
    const int seq = seq_begin + blockIdx.x;
    const int head = blockIdx.y;
    const int d = threadIdx.x;
    const int q_begin = query_start_loc[seq];
    const int seq_len = seq_lens[seq];
    if (query_start_loc[seq + 1] - q_begin != 1 || seq_len <= PS_PARTITION_SIZE) return;
    // The partitions the attention kernel wrote: from the one holding the window's oldest key.
    const int first_part = sliding_window > 0 ? max(0, seq_len - sliding_window) / PS_PARTITION_SIZE : 0;
    const int num_parts = (seq_len + PS_PARTITION_SIZE - 1) / PS_PARTITION_SIZE - first_part;
    const long long base = ((long long)blockIdx.x * num_heads + head) * max_parts;

    float m = neg_inf();
    for (int z = 0; z < num_parts; ++z) m = fmaxf(m, part_ml[2 * (base + z)]);
    float l = 0.f;
    float acc = 0.f;
    for (int z = 0; z < num_parts; ++z) {
        const float w = exp2f(part_ml[2 * (base + z)] - m);
        l = fmaf(part_ml[2 * (base + z) + 1], w, l);
        acc = fmaf(part_acc[(base + z) * HEAD_DIM + d], w, acc);
    }
    const float inv = l > 0.f ? 1.f / l : 0.f;
    out[((long long)q_begin * num_heads + head) * HEAD_DIM + d] = from_float<T>(acc * inv);
}
