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

// sample_rows_kernel: one token per row of logits [B, V] under temperature, top-k, top-p and min-p, with
// the row's own uniform u in [0, 1): exact and deterministic, and no sort of the row. One CTA per row.
// The numpy reference of the same rules: cupy_kernels/reference/sample_rows.py.
//
// Every selection is a threshold found by a k-ary search (SP pivots per pass over the row, so a 32-bit
// key range takes 8 passes and an index range of 128k takes 5), in the spirit of the pivot-based top-k /
// top-p of Qrita (arXiv 2602.01518); each pass's per-pivot counts or masses are reduced in a fixed order,
// so a row's result depends on nothing but the row. Once a top-k set of at most PS_CANDIDATES tokens is
// known it is gathered into shared memory (in an order fixed by a block scan), and every later pass (top-p,
// min-p, the draw) reads those instead of the row. With y = logits / temperature, key = y's float32 bits
// made order-preserving as int32, w = exp(y - max y):
//   top-k (0 < k < V): t_k = the largest key with count(key >= t_k) >= k; every key > t_k is kept, and of the
//     keys == t_k the lowest token ids, up to k in all (i_tie: the last one kept);
//   top-p (top_p < 1), over the top-k set S: t_p = the largest key whose strictly smaller keys in S hold at
//     most (1 - top_p) of S's mass; keys >= t_p are kept (ties at the cut all kept; the top token always);
//   min-p (min_p > 0): w >= min_p (the top token's w is 1);
//   the draw, in token order: the first token id whose running mass of kept tokens exceeds u * W (W: the kept
//     mass); should rounding put u * W at W, the last kept token with weight;
//   or, for a row with by_value set, in value order (largest first, ties lowest id first; the host sampler's order
//     for top-k rows, so a seeded request draws the same token on either): the level t* = the largest key whose
//     kept mass at or above it exceeds u * W, then among the kept tokens at t* (one weight each) the c-th lowest
//     id, c = floor((u * W - the kept mass above t*) / w(t*)) + 1.
#define PS_SP 16  // pivots per pass
#define PS_SAMPLE_THREADS 512  // the most threads a launch uses (the launcher's choice; registers allow no more)
#define PS_CANDIDATES 2048  // a top-k set of at most this many tokens moves to shared memory

__device__ __forceinline__ int ps_float_bits(float f) {
#if defined(__CUDACC__)
    return __float_as_int(f);
#else
    int i;
    __builtin_memcpy(&i, &f, 4);
    return i;
#endif
}

// int32 keys ordered like the floats (-0.0 just below 0.0; -inf lowest).
__device__ __forceinline__ int ps_sort_key(float f) {
    const int b = ps_float_bits(f);
    return b < 0 ? b ^ 0x7fffffff : b;
}

// Sum PS_SP values over a warp in 16 shuffles (not 16 x 5): each butterfly step halves the values a lane
// holds. Afterwards an even lane L holds the warp's total of accumulator L / 2. Every accumulator is summed
// by the same tree, in an order fixed by the lanes alone.
__device__ __forceinline__ float ps_warp_sum_many(float (&v)[PS_SP]) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int half = PS_SP / 2, offset = 16; half >= 1; half >>= 1, offset >>= 1) {
        const bool upper = lane & offset;
#pragma unroll
        for (int j = 0; j < half; ++j) {
            const float send = upper ? v[j] : v[j + half];
            const float keep = upper ? v[j + half] : v[j];
            v[j] = keep + __shfl_xor_sync(0xffffffffu, send, offset);
        }
    }
    return v[0] + __shfl_xor_sync(0xffffffffu, v[0], 1);
}

// Block total of each of the PS_SP accumulators, in a fixed order, into out[PS_SP] (every thread reads it).
__device__ __forceinline__ void ps_block_sum_many(float (&v)[PS_SP], float* scratch /* [32][PS_SP] */,
                                                  float* out) {
    const float s = ps_warp_sum_many(v);
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    if (!(lane & 1)) scratch[warp * PS_SP + (lane >> 1)] = s;
    __syncthreads();
    if ((int)threadIdx.x < PS_SP) {
        const int num_warps = (blockDim.x + 31) >> 5;
        float t = 0.0f;
        for (int w = 0; w < num_warps; ++w) t += scratch[w * PS_SP + threadIdx.x];
        out[threadIdx.x] = t;
    }
    __syncthreads();
}

struct PsRow {
    int vocab;
    float temperature;
    float row_max;
    int key_k;    // top-k threshold key (the lowest key when top-k is off)
    int i_tie;    // of the keys == key_k, ids <= i_tie are in the top-k set
    int key_p;    // top-p threshold key (the lowest key when off)
    float min_p;  // 0 when off
    int key_tie;  // PS_KEPT_TIES_UPTO counts the kept tokens with this key
    // The top-k set gathered into shared memory (num_cand > 0): every later pass reads these, not the row.
    const float* cand_y;
    const int* cand_id;
    int num_cand;
};

template <typename T>
__device__ __forceinline__ float ps_y(const T* x, int i, float temperature) { return to_float(x[i]) / temperature; }

__device__ __forceinline__ bool ps_in_top_k(const PsRow& r, int key, int i) {
    return key > r.key_k || (key == r.key_k && i <= r.i_tie);
}

// What one pass accumulates per pivot (the k-ary searches below).
enum PsMeasure { PS_COUNT_GE_KEY, PS_COUNT_TIES_UPTO, PS_MASS_BELOW_KEY, PS_MASS_UPTO, PS_KEPT_MASS_GE_KEY,
                 PS_KEPT_TIES_UPTO };

__device__ __forceinline__ float ps_key_value(int key) {  // the float a key was made from
    return __int_as_float(key < 0 ? key ^ 0x7fffffff : key);
}

// Element e of what the passes read: the row (token e), or the gathered top-k set (candidate e).
template <typename T>
__device__ __forceinline__ void ps_element(const T* x, const PsRow& r, int e, float& y, int& i) {
    if (r.num_cand) {
        y = r.cand_y[e];
        i = r.cand_id[e];
    } else {
        y = ps_y(x, e, r.temperature);
        i = e;
    }
}

template <typename T, int M>
__device__ void ps_measure(const T* x, const PsRow& r, const long long (&piv)[PS_SP], float* scratch, float* out) {
    float acc[PS_SP];
#pragma unroll
    for (int j = 0; j < PS_SP; ++j) acc[j] = 0.0f;
    const int n = r.num_cand ? r.num_cand : r.vocab;
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        float y;
        int i;
        ps_element(x, r, e, y, i);
        const int key = ps_sort_key(y);
        if (M == PS_COUNT_GE_KEY) {
#pragma unroll
            for (int j = 0; j < PS_SP; ++j) acc[j] += key >= piv[j] ? 1.0f : 0.0f;
        } else if (M == PS_COUNT_TIES_UPTO) {
            if (key == r.key_k) {
#pragma unroll
                for (int j = 0; j < PS_SP; ++j) acc[j] += i <= piv[j] ? 1.0f : 0.0f;
            }
        } else {
            if (!ps_in_top_k(r, key, i)) continue;
            const float w = expf(y - r.row_max);
            if (M == PS_MASS_BELOW_KEY) {
#pragma unroll
                for (int j = 0; j < PS_SP; ++j) acc[j] += key < piv[j] ? w : 0.0f;
            } else {
                if (key < r.key_p || w < r.min_p) continue;  // the kept tokens only
                if (M == PS_MASS_UPTO) {
#pragma unroll
                    for (int j = 0; j < PS_SP; ++j) acc[j] += i <= piv[j] ? w : 0.0f;
                } else if (M == PS_KEPT_MASS_GE_KEY) {
#pragma unroll
                    for (int j = 0; j < PS_SP; ++j) acc[j] += key >= piv[j] ? w : 0.0f;
                } else if (key == r.key_tie) {  // PS_KEPT_TIES_UPTO
#pragma unroll
                    for (int j = 0; j < PS_SP; ++j) acc[j] += i <= piv[j] ? 1.0f : 0.0f;
                }
            }
        }
    }
    ps_block_sum_many(acc, scratch, out);
}

// The largest t in [lo, hi] with ok(measure(t)), ok(lo) known true and ok monotone (true, then false).
template <typename T, int M, typename Ok>
__device__ long long ps_search(const T* x, const PsRow& r, long long lo, long long hi, Ok ok, float* scratch,
                               float* out) {
    while (lo < hi) {  // each pass leaves at most ceil((hi - lo) / PS_SP) candidates
        long long piv[PS_SP];
        const long long span = hi - lo;
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = lo + (span * (j + 1) + PS_SP - 1) / PS_SP;
        ps_measure<T, M>(x, r, piv, scratch, out);
        long long new_lo = lo, new_hi = hi;
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) {
            if (ok(out[j])) {
                new_lo = piv[j] > new_lo ? piv[j] : new_lo;
            } else if (piv[j] - 1 < new_hi) {
                new_hi = piv[j] - 1;
            }
        }
        __syncthreads();  // out[] is rewritten by the next pass
        lo = new_lo;
        hi = new_hi;
    }
    return lo;
}

template <typename T>
__global__ void __launch_bounds__(PS_SAMPLE_THREADS) sample_rows_kernel(long long* __restrict__ out, const T* __restrict__ logits, long long stride,
                                   int vocab, const float* __restrict__ temperature, const int* __restrict__ top_k,
                                   const float* __restrict__ top_p, const float* __restrict__ min_p,
                                   const double* __restrict__ uniforms, const int* __restrict__ by_value) {
    __shared__ float scratch[32 * PS_SP];
    __shared__ float totals[PS_SP];
    __shared__ float red_v[32];
    __shared__ int red_k[32];
    __shared__ float cand_y[PS_CANDIDATES];
    __shared__ int cand_id[PS_CANDIDATES];
    __shared__ int scan[PS_SAMPLE_THREADS];
    const int row = blockIdx.x;
    const T* x = logits + (long long)row * stride;
    const int lane = threadIdx.x & 31;
    const int warp = threadIdx.x >> 5;
    const int num_warps = (blockDim.x + 31) >> 5;
    PsRow r;
    r.vocab = vocab;
    r.temperature = temperature[row];

    // Pass 1: the row's max (as y) and lowest key.
    float m = neg_inf();
    int kmin = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float y = ps_y(x, i, r.temperature);
        m = fmaxf(m, y);
        const int key = ps_sort_key(y);
        kmin = key < kmin ? key : kmin;
    }
    m = warp_max(m);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
        const int o = __shfl_xor_sync(0xffffffffu, kmin, offset);
        kmin = o < kmin ? o : kmin;
    }
    if (lane == 0) {
        red_v[warp] = m;
        red_k[warp] = kmin;
    }
    __syncthreads();
    m = red_v[0];
    kmin = red_k[0];
    for (int w = 1; w < num_warps; ++w) {
        m = fmaxf(m, red_v[w]);
        kmin = red_k[w] < kmin ? red_k[w] : kmin;
    }
    __syncthreads();
    r.row_max = m;
    const int kmax = ps_sort_key(m);
    r.key_k = kmin;
    r.i_tie = vocab - 1;
    r.key_p = kmin;  // (a key below every kept one when top-p is off)
    r.min_p = min_p[row] > 0.0f ? min_p[row] : 0.0f;
    r.key_tie = kmin;
    r.cand_y = cand_y;
    r.cand_id = cand_id;
    r.num_cand = 0;
    int klo = kmin;  // the lowest key a later search needs: the top-k threshold once there is one

    // top-k
    const int k = top_k[row];
    if (k > 0 && k < vocab) {
        const float kf = (float)k;
        r.key_k = (int)ps_search<T, PS_COUNT_GE_KEY>(x, r, kmin, kmax, [kf](float c) { return c >= kf; }, scratch,
                                                     totals);
        // How many keys are above the threshold, and how many equal it: (count >= key_k+1, ties up to V-1).
        long long piv[PS_SP];
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = (long long)r.key_k + 1;
        ps_measure<T, PS_COUNT_GE_KEY>(x, r, piv, scratch, totals);
        const float above = totals[0];
        __syncthreads();
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = vocab - 1;
        ps_measure<T, PS_COUNT_TIES_UPTO>(x, r, piv, scratch, totals);
        const float ties = totals[0];
        __syncthreads();
        const float room = kf - above;
        if (ties > room) {  // the last tied id kept: the largest i with count(ties <= i) < room, plus one
            r.i_tie = (int)ps_search<T, PS_COUNT_TIES_UPTO>(x, r, -1, vocab - 1,
                                                            [room](float c) { return c < room; }, scratch,
                                                            totals) + 1;
        }
        klo = r.key_k;
        if (k <= PS_CANDIDATES) {
            // Gather the top-k set (exactly k tokens) into shared memory, each thread's in token order after the
            // threads before it (a block scan of the counts), so the order, and every sum after, is fixed.
            int mine = 0;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                mine += ps_in_top_k(r, ps_sort_key(ps_y(x, i, r.temperature)), i) ? 1 : 0;
            }
            scan[threadIdx.x] = mine;
            __syncthreads();
            for (int offset = 1; offset < (int)blockDim.x; offset <<= 1) {
                const int add = (int)threadIdx.x >= offset ? scan[threadIdx.x - offset] : 0;
                __syncthreads();
                scan[threadIdx.x] += add;
                __syncthreads();
            }
            int at = scan[threadIdx.x] - mine;
            for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
                const float y = ps_y(x, i, r.temperature);
                if (ps_in_top_k(r, ps_sort_key(y), i)) {
                    cand_y[at] = y;
                    cand_id[at] = i;
                    ++at;
                }
            }
            const int n = scan[blockDim.x - 1];
            __syncthreads();
            r.num_cand = n;  // every candidate is in the top-k set: the test below must pass them all
            r.key_k = (int)0x80000000;
            r.i_tie = 0x7fffffff;
        }
    }

    // top-p over the top-k set
    const float p = top_p[row];
    if (p < 1.0f) {
        long long piv[PS_SP];
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = (long long)kmax + 1;  // every key is below: S's whole mass
        ps_measure<T, PS_MASS_BELOW_KEY>(x, r, piv, scratch, totals);
        const float budget = (1.0f - p) * totals[0];
        __syncthreads();
        r.key_p = (int)ps_search<T, PS_MASS_BELOW_KEY>(x, r, klo, kmax, [budget](float s) { return s <= budget; },
                                                       scratch, totals);
    }

    long long piv[PS_SP];
    if (by_value[row]) {  // the draw in value order (see the top)
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = klo;
        ps_measure<T, PS_KEPT_MASS_GE_KEY>(x, r, piv, scratch, totals);
        const double target = uniforms[row] * (double)totals[0];
        __syncthreads();
        const long long level = ps_search<T, PS_KEPT_MASS_GE_KEY>(
            x, r, klo, kmax, [target](float s) { return (double)s > target; }, scratch, totals);
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = level + 1;
        ps_measure<T, PS_KEPT_MASS_GE_KEY>(x, r, piv, scratch, totals);
        const double above = totals[0];
        __syncthreads();
        r.key_tie = (int)level;
#pragma unroll
        for (int j = 0; j < PS_SP; ++j) piv[j] = vocab - 1;
        ps_measure<T, PS_KEPT_TIES_UPTO>(x, r, piv, scratch, totals);
        const float ties = totals[0];
        __syncthreads();
        const double w_level = expf(ps_key_value((int)level) - r.row_max);
        double c = floor((target - above) / w_level) + 1.0;
        c = c < 1.0 ? 1.0 : (c > ties ? ties : c);
        const float cf = (float)c;
        const long long token = ps_search<T, PS_KEPT_TIES_UPTO>(x, r, -1, vocab - 1,
                                                                [cf](float n) { return n < cf; }, scratch,
                                                                totals) + 1;
        if (threadIdx.x == 0) out[row] = token;
        return;
    }
    // The draw in token order: the largest id whose running kept mass is <= u * W, plus one.
#pragma unroll
    for (int j = 0; j < PS_SP; ++j) piv[j] = vocab - 1;
    ps_measure<T, PS_MASS_UPTO>(x, r, piv, scratch, totals);
    const double target = uniforms[row] * (double)totals[0];
    __syncthreads();
    long long token = ps_search<T, PS_MASS_UPTO>(x, r, -1, vocab - 1,
                                                 [target](float s) { return (double)s <= target; }, scratch,
                                                 totals) + 1;
    if (token >= vocab) {  // rounding put u * W at W: the last kept token with weight
        int last = -1;
        const int n = r.num_cand ? r.num_cand : vocab;
        for (int e = threadIdx.x; e < n; e += blockDim.x) {
            float y;
            int i;
            ps_element(x, r, e, y, i);
            const int key = ps_sort_key(y);
            const float w = expf(y - r.row_max);
            if (ps_in_top_k(r, key, i) && key >= r.key_p && w >= r.min_p && w > 0.0f) last = i;
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset >>= 1) {
            const int o = __shfl_xor_sync(0xffffffffu, last, offset);
            last = o > last ? o : last;
        }
        if (lane == 0) red_k[warp] = last;
        __syncthreads();
        last = red_k[0];
        for (int w = 1; w < num_warps; ++w) last = red_k[w] > last ? red_k[w] : last;
        token = last;
    }
    if (threadIdx.x == 0) out[row] = token;
}
