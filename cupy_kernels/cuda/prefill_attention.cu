// Tensor-core prefill attention over the paged KV cache (FlashAttention-2's scheme, mma.sync m16n8k16).
//
// Same layout contract as paged_attention.cu (query [T, H, D], rows may be strided; caches
// [num_blocks, BLOCK_SIZE, KV, D], C-contiguous; query_start_loc [B + 1], seq_lens [B], block_tables [B, stride]);
// T is f16 or bf16 for query, caches and out alike. Query row j of a sequence with n new tokens sits at position
// seq_len - n + j and sees keys 0..pos, with sliding_window = W > 0 only keys pos - W < key <= pos.
//
// Only sequences with n >= 2 new tokens are computed here; rows of single-token sequences are left untouched
// (paged_attention_kernel does them, with prefill_elsewhere = 1).
//
// Work split: one CTA = 4 warps = PS_PREFILL_BLOCK_Q (64) query rows of ONE sequence and ONE query head
//   grid.x  query tiles: sequence s owns tiles tile_start(s) .. with tile_start(s) = (qsl[s] - s) / 64 + s (an
//           upper bound on the count needs only T and B); surplus tiles exit at once.
//   grid.y  query heads (GQA: kv head = head / (H / KV)).
// Warp w owns rows 16w .. 16w + 15: their Q fragments stay in registers for the whole walk (head dims up to 128).
// Per tile of BLOCK_N keys (64, or 32 for head dim 256: two tiles of K and V in 48 KiB of static shared memory)
// K and V come from the cache through the block table by cp.async (keys outside [the first row's window start,
// the last row's position] are zero-filled, never read), S = Q K^T by mma in fp32 (K's B fragments by ldmatrix),
// the causal / window mask, an online softmax per row in base 2 in fp32 (max and sum over the 4 lanes of a
// quad), P rounded to T and O += P V by mma (V's B fragments by ldmatrix.trans). K of the next tile is fetched
// during the softmax and P V of this one, V of the next during its scores. A warp skips a tile none of its rows
// sees (causal diagonal, window): an exact no-op. Tiles are taken last first (the causal tail is the heaviest).
//
// Batch invariance: key tiles sit at fixed positions (multiples of BLOCK_N); a tile a row sees nothing of is an
// exact no-op for it (leading: m stays -inf and alpha = p = 0 on a zero acc; trailing: alpha = 1, p = 0), so a
// row's bits depend only on its query, position, sequence and the cache, never on the tile or the batch.

#ifndef PS_PREFILL_THREADS
#error "modules.py defines PS_PREFILL_THREADS and PS_PREFILL_BLOCK_Q"
#endif

#define PS_PREFILL_WARPS (PS_PREFILL_THREADS / 32)
static_assert(PS_PREFILL_BLOCK_Q == 16 * PS_PREFILL_WARPS, "each warp owns 16 query rows");

__device__ __forceinline__ int prefill_find_sequence(const int* __restrict__ query_start_loc, int num_seqs, int tile) {
    int lo = 0, hi = num_seqs - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        const int start = (query_start_loc[mid] - mid) / PS_PREFILL_BLOCK_Q + mid;
        if (start <= tile) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

// cp.async of keys [t0, t0 + BLOCK_N) of one kv head; keys outside [k_lo, k_end) are zero-filled, never read.
template <int HEAD_DIM, int BLOCK_SIZE, int BLOCK_N, typename T>
__device__ __forceinline__ void prefill_load_tile(T (*dst)[HEAD_DIM + 8], const T* __restrict__ cache,
                                                  const int* __restrict__ block_table, long long slot_stride,
                                                  int kv_head, int k_lo, int t0, int k_end) {
    constexpr int CHUNKS = HEAD_DIM / 8;  // 16-byte chunks per key row
    for (int c = threadIdx.x; c < BLOCK_N * CHUNKS; c += PS_PREFILL_THREADS) {
        const int row = c / CHUNKS;
        const int col = (c % CHUNKS) * 8;
        const int key = t0 + row;
        const T* src = cache;
        int bytes = 0;
        if (key >= k_lo && key < k_end) {
            const long long block = block_table[key / BLOCK_SIZE];
            src = cache + (block * BLOCK_SIZE + key % BLOCK_SIZE) * slot_stride + (long long)kv_head * HEAD_DIM + col;
            bytes = 16;
        }
        cp_async_16(&dst[row][col], src, bytes);
    }
}

// A fragment k-step kk of the warp's 16 query rows (rows g and g + 8 of this lane; zero for padding rows).
template <typename T>
__device__ __forceinline__ void load_q_fragment(unsigned int (&a)[4], const T* const (&q_rows)[2], const int (&pos)[2],
                                                int kk, int t) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int r = i & 1;
        const int col = 16 * kk + 2 * t + 8 * (i >> 1);
        a[i] = pos[r] >= 0 ? *reinterpret_cast<const unsigned int*>(q_rows[r] + col) : 0u;
    }
}

// Head dim 64: at least 3 CTAs an SM (at most 168 registers; left alone ptxas picks 128 and spills on sm_80).
template <int HEAD_DIM, int BLOCK_SIZE, typename T>
__global__ void __launch_bounds__(PS_PREFILL_THREADS, HEAD_DIM <= 64 ? 3 : 1)
prefill_attention_kernel(T* __restrict__ out,  // [T, H, D]
                         const T* __restrict__ query, long long q_stride_token, long long q_stride_head,
                         const T* __restrict__ k_cache, const T* __restrict__ v_cache,
                         const int* __restrict__ query_start_loc, const int* __restrict__ seq_lens,
                         const int* __restrict__ block_tables, long long block_table_stride, int num_seqs,
                         int num_heads, int num_kv_heads, float scale_log2, int sliding_window) {
    static_assert(HEAD_DIM % 32 == 0, "head dim must be a multiple of 32 (two k-steps per ldmatrix)");
    constexpr int BLOCK_N = HEAD_DIM <= 128 ? 64 : 32;  // keys per tile
    constexpr int KSTEPS = HEAD_DIM / 16;                // k-steps of S = Q K^T
    constexpr int NT = BLOCK_N / 8;                      // n-tiles of S
    constexpr int DT = HEAD_DIM / 8;                     // n-tiles of O
    constexpr int PSTEPS = BLOCK_N / 16;                 // k-steps of O += P V

    __shared__ __align__(16) T k_s[BLOCK_N][HEAD_DIM + 8];  // +8: conflict-free fragment reads
    __shared__ __align__(16) T v_s[BLOCK_N][HEAD_DIM + 8];

    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int g = lane >> 2;  // groupID: rows g and g + 8 of the warp's 16
    const int t = lane & 3;   // threadID_in_group
    const int tile = gridDim.x - 1 - blockIdx.x;  // last tiles first: a causal tile's work grows with its index
    const int head = blockIdx.y;
    const int kv_head = head / (num_heads / num_kv_heads);

    const int seq = prefill_find_sequence(query_start_loc, num_seqs, tile);
    const int q_begin = query_start_loc[seq];
    const int num_q = query_start_loc[seq + 1] - q_begin;
    if (num_q < 2) return;  // a decode: paged_attention_kernel's
    const int q0 = (tile - ((q_begin - seq) / PS_PREFILL_BLOCK_Q + seq)) * PS_PREFILL_BLOCK_Q;
    if (q0 >= num_q) return;
    const int seq_len = seq_lens[seq];
    const int tile_q = min(PS_PREFILL_BLOCK_Q, num_q - q0);
    const int first_pos = seq_len - num_q + q0;
    const int kv_end = first_pos + tile_q;
    const int key_lo = sliding_window > 0 ? max(0, first_pos - sliding_window + 1) : 0;
    const int k_begin = key_lo / BLOCK_N * BLOCK_N;
    const int num_kv_tiles = (kv_end - k_begin + BLOCK_N - 1) / BLOCK_N;

    const int* block_table = block_tables + (long long)seq * block_table_stride;
    const long long slot_stride = (long long)num_kv_heads * HEAD_DIM;

    prefill_load_tile<HEAD_DIM, BLOCK_SIZE, BLOCK_N>(k_s, k_cache, block_table, slot_stride, kv_head, key_lo, k_begin,
                                                     kv_end);
    cp_async_commit();
    prefill_load_tile<HEAD_DIM, BLOCK_SIZE, BLOCK_N>(v_s, v_cache, block_table, slot_stride, kv_head, key_lo, k_begin,
                                                     kv_end);
    cp_async_commit();

    // This lane's two rows (r = 0: row g, r = 1: row g + 8 of the warp's slice): position (-1: padding) and
    // oldest visible key.
    int pos[2], lo[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int qi = warp * 16 + g + 8 * r;
        pos[r] = qi < tile_q ? first_pos + qi : -1;
        lo[r] = sliding_window > 0 ? max(0, first_pos + qi - sliding_window + 1) : 0;
    }
    // The warp's key range: tiles outside it are no-ops for all of its rows.
    const int warp_rows = min(16, tile_q - warp * 16);  // <= 0: only padding rows
    const int warp_last = first_pos + warp * 16 + warp_rows - 1;
    const int warp_first_lo = sliding_window > 0 ? max(0, first_pos + warp * 16 - sliding_window + 1) : 0;

    // Q fragments (A operands, row-major 16 x 16 per k-step), straight from global memory: kept in registers for
    // head dims up to 128; re-read (from L1) each tile for 256, whose O accumulators alone take 128 registers.
    constexpr bool Q_IN_REGS = HEAD_DIM <= 128;
    const T* q_rows[2];
#pragma unroll
    for (int r = 0; r < 2; ++r)
        q_rows[r] = query + (long long)(q_begin + q0 + warp * 16 + g + 8 * r) * q_stride_token +
                    (long long)head * q_stride_head;
    unsigned int qf[Q_IN_REGS ? KSTEPS : 1][4];
    if (Q_IN_REGS) {
#pragma unroll
        for (int kk = 0; kk < (Q_IN_REGS ? KSTEPS : 1); ++kk) load_q_fragment(qf[kk], q_rows, pos, kk, t);
    }

    float o[DT][4];
#pragma unroll
    for (int j = 0; j < DT; ++j)
#pragma unroll
        for (int i = 0; i < 4; ++i) o[j][i] = 0.f;
    float m[2] = {neg_inf(), neg_inf()};
    float l[2] = {0.f, 0.f};  // this lane's share of the row sums (the quad's lanes are added at the end)

    for (int it = 0; it < num_kv_tiles; ++it) {
        const int t0 = k_begin + it * BLOCK_N;
        const bool active = warp_rows > 0 && t0 <= warp_last && t0 + BLOCK_N > warp_first_lo;  // warp-uniform
        cp_async_wait<1>();  // this tile's K has landed
        __syncthreads();

        float s[NT][4];
        if (active) {
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) s[j][i] = 0.f;
#pragma unroll
            for (int kk = 0; kk < KSTEPS; kk += 2) {
                unsigned int qa[2][4];
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    if (Q_IN_REGS) {
#pragma unroll
                        for (int i = 0; i < 4; ++i) qa[h][i] = qf[Q_IN_REGS ? kk + h : 0][i];
                    } else {
                        load_q_fragment(qa[h], q_rows, pos, kk + h, t);
                    }
                }
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    // B = K^T: B[k = dim][n = key] = K[key][dim]; one ldmatrix gives keys 8j.. for dims 16kk..16kk+31
                    unsigned int b4[4];
                    ldmatrix_x4(b4, &k_s[8 * j + (lane & 7)][16 * kk + (lane >> 3) * 8]);
                    const unsigned int b0[2] = {b4[0], b4[1]};
                    const unsigned int b1[2] = {b4[2], b4[3]};
                    mma_m16n8k16<T>(s[j], qa[0], b0);
                    mma_m16n8k16<T>(s[j], qa[1], b1);
                }
            }
            float mx[2] = {neg_inf(), neg_inf()};
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const int r = i >> 1;
                    const int key = t0 + 8 * j + 2 * t + (i & 1);
                    const bool visible = key <= pos[r] && key >= lo[r];  // pos = -1: padding
                    s[j][i] = visible ? s[j][i] * scale_log2 : neg_inf();
                    mx[r] = fmaxf(mx[r], s[j][i]);
                }
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
                mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
                const float m_new = fmaxf(m[r], mx[r]);
                const float m_use = m_new == neg_inf() ? 0.f : m_new;  // a row with no key yet
                const float alpha = exp2f(m[r] - m_use);
                m[r] = m_new;
                mx[r] = m_use;
                l[r] *= alpha;
#pragma unroll
                for (int j = 0; j < DT; ++j) {
                    o[j][2 * r] *= alpha;
                    o[j][2 * r + 1] *= alpha;
                }
            }
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int i = 0; i < 4; ++i) {
                    const float p = exp2f(s[j][i] - mx[i >> 1]);
                    s[j][i] = p;
                    l[i >> 1] += p;
                }
        }
        __syncthreads();  // every warp is done reading k_s
        if (it + 1 < num_kv_tiles)
            prefill_load_tile<HEAD_DIM, BLOCK_SIZE, BLOCK_N>(k_s, k_cache, block_table, slot_stride, kv_head, key_lo,
                                                             t0 + BLOCK_N, kv_end);
        cp_async_commit();  // possibly empty: keeps the group count uniform

        cp_async_wait<1>();  // this tile's V has landed
        __syncthreads();
        if (active) {
#pragma unroll
            for (int kk = 0; kk < PSTEPS; ++kk) {
                // A = P (16 x 16 keys): the S accumulators of n-tiles 2kk and 2kk + 1 are already in A's layout.
                const unsigned int a[4] = {pack2<T>(s[2 * kk][0], s[2 * kk][1]), pack2<T>(s[2 * kk][2], s[2 * kk][3]),
                                           pack2<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                                           pack2<T>(s[2 * kk + 1][2], s[2 * kk + 1][3])};
                const int key_row = 16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
                for (int j = 0; j < DT; j += 2) {
                    unsigned int b4[4];  // B fragments of dims 8j.. and 8j + 8..
                    ldmatrix_x4_trans(b4, &v_s[key_row][8 * j + (lane >> 4) * 8]);
                    const unsigned int b0[2] = {b4[0], b4[1]};
                    const unsigned int b1[2] = {b4[2], b4[3]};
                    mma_m16n8k16<T>(o[j], a, b0);
                    mma_m16n8k16<T>(o[j + 1], a, b1);
                }
            }
        }
        __syncthreads();  // every warp is done reading v_s
        if (it + 1 < num_kv_tiles)
            prefill_load_tile<HEAD_DIM, BLOCK_SIZE, BLOCK_N>(v_s, v_cache, block_table, slot_stride, kv_head, key_lo,
                                                             t0 + BLOCK_N, kv_end);
        cp_async_commit();
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (pos[r] < 0) continue;
        const long long token = q_begin + q0 + warp * 16 + g + 8 * r;
        const float inv = l[r] > 0.f ? 1.f / l[r] : 0.f;
        T* dst = out + (token * num_heads + head) * HEAD_DIM + 2 * t;
#pragma unroll
        for (int j = 0; j < DT; ++j)
            *reinterpret_cast<unsigned int*>(dst + 8 * j) = pack2<T>(o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    }
}
