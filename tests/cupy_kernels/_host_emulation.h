// Host emulation of the small CUDA subset pagedserve's kernels use, for tests without a GPU.
//
// The kernel family files (paged_attention.cu, norm.cu, ...) are compiled unchanged as C++ after this
// header, which stands in for cupy_kernels/cuda/common.cu (whose PTX asm cannot run on a CPU) and for the
// CUDA built-ins. Each CUDA thread of a CTA runs as a fiber (ucontext); __syncthreads and warp shuffles
// are barriers that switch fibers, so the kernels' real control flow, indexing and synchronisation
// run, CTA after CTA (a fiber is entered once with setcontext, then switched with _setjmp/_longjmp,
// which skip the signal-mask system calls of swapcontext). A barrier that can never complete (a divergent __syncthreads) aborts with a
// message. Dynamic shared memory (dynamic_shared_memory below) is a buffer of exactly the launch's shared_mem bytes.
//
// What the device would get wrong, made to fail here (issue 59):
// - cp.async: a copy's destination is poisoned (0xFF bytes: NaN) when it is issued, and its data lands only at the
//   issuing thread's cp.async.wait_group that retires its group (wait_group N lands every committed group but the
//   newest N; copies not yet committed never land); a CTA ending with copies in flight aborts. So a wait that lets
//   a tile still in flight be read (wait<2> for wait<1>) reads NaN, as the device may read stale data.
// - static __shared__ arrays (C++ statics here: the loader registers their addresses from the library's symbol
//   table, ps_add_static_shared) are refilled before every CTA, alternately with 0xFF bytes (NaN, -1) and 0x7F
//   bytes (f16 NaN, float 3.4e38, int 2139062143): a CTA reads back nothing plausible that it did not write itself,
//   where a C++ static would hand it the previous CTA's values.
// ps_set_hazards(0) turns both models off (copies land at once, statics carried over): the mutation tests show
// that a fault passes without them and fails with them.
//
// Not emulated: timing, memory-model races between CTAs, fast-math approximations (exp2f is libm's).
#pragma once

#include <cmath>
#include <math.h>  // exp2f, expf, fmaf, fmaxf, sqrtf in the global namespace, as in CUDA
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>
#include <dlfcn.h>
#include <setjmp.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static
#define PS_HOST_EMULATION 1

struct ps_dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

// ---- the fiber scheduler -------------------------------------------------------------------------

struct PsCopy {  // one cp.async of 16 bytes: where it lands and what (read at issue: the sources are read-only)
    void* dst;
    unsigned char data[16];
};

struct PsFiber {
    std::vector<PsCopy> uncommitted;          // issued since the last commit_group
    std::deque<std::vector<PsCopy>> groups;   // committed, not yet landed; oldest first
    ucontext_t ctx;
    jmp_buf env;
    bool started = false;
    std::vector<char> stack;
    ps_dim3 tid;
    int linear = 0;
    bool done = false;
    bool waiting = false;
};

struct PsBarrier {
    int expected = 0;
    int arrived = 0;
    std::vector<int> waiters;
};

static std::vector<PsFiber> ps_fibers;
static jmp_buf ps_sched_env;
static int ps_cur = 0;
static ps_dim3 ps_block_idx, ps_block_dim, ps_grid_dim;
static PsBarrier ps_cta_barrier;
static std::vector<PsBarrier> ps_warp_barriers;
static std::vector<unsigned long long> ps_warp_slots;  // 32 per warp
static std::vector<unsigned> ps_mma_slots;              // 32 lanes x 10 words per warp: a[4], b[2], c[4]
static std::function<void()> ps_body;

// Dynamic shared memory (extern __shared__ on the GPU; a kernel reaches it through dynamic_shared_memory(bytes),
// `bytes` being what its layout needs). One buffer of the launch's shared_mem bytes plus a guard, refilled with
// 0xFF (NaN) before each CTA; a layout size other than the launch's, or a write into the guard, aborts.
static std::vector<uint4> ps_dynamic_buf;
static int ps_dynamic_bytes = 0;
constexpr int PS_DYNAMIC_GUARD = 64;
inline unsigned char* dynamic_shared_memory(int bytes) {
    if (bytes != ps_dynamic_bytes) {
        std::fprintf(stderr, "host emulation: the kernel's layout needs %d bytes of dynamic shared memory, the launch "
                             "brought %d\n", bytes, ps_dynamic_bytes);
        std::abort();
    }
    return reinterpret_cast<unsigned char*>(ps_dynamic_buf.data());
}
static int ps_hazards = 1;
extern "C" void ps_set_hazards(int on) { ps_hazards = on; }
struct PsRange { unsigned char* p; std::size_t n; };
static std::vector<PsRange> ps_static_shared;
static unsigned long ps_cta_count = 0;
// offset: the static's address in the library's symbol table (nm), relative to where the library is loaded.
extern "C" void ps_add_static_shared(unsigned long offset, unsigned long bytes) {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&ps_add_static_shared), &info)) std::abort();
    ps_static_shared.push_back({static_cast<unsigned char*>(info.dli_fbase) + offset, (std::size_t)bytes});
}
extern "C" int ps_static_shared_count() { return (int)ps_static_shared.size(); }
static void ps_dynamic_reset() {
    std::memset(ps_dynamic_buf.data(), 0xFF, (std::size_t)ps_dynamic_bytes + PS_DYNAMIC_GUARD);
    if (!ps_hazards) return;
    const int poison = (ps_cta_count++ & 1) ? 0x7F : 0xFF;
    for (const PsRange& r : ps_static_shared) std::memset(r.p, poison, r.n);
}
static void ps_dynamic_check_guard() {
    const unsigned char* guard = reinterpret_cast<const unsigned char*>(ps_dynamic_buf.data()) + ps_dynamic_bytes;
    for (int i = 0; i < PS_DYNAMIC_GUARD; ++i)
        if (guard[i] != 0xFF) {
            std::fprintf(stderr, "host emulation: a CTA wrote past its %d bytes of dynamic shared memory\n",
                         ps_dynamic_bytes);
            std::abort();
        }
}

#define threadIdx (ps_fibers[ps_cur].tid)
#define blockIdx ps_block_idx
#define blockDim ps_block_dim
#define gridDim ps_grid_dim

static void ps_arrive(PsBarrier& b) {
    if (++b.arrived == b.expected) {
        b.arrived = 0;
        for (int w : b.waiters) ps_fibers[w].waiting = false;
        b.waiters.clear();
        return;
    }
    ps_fibers[ps_cur].waiting = true;
    b.waiters.push_back(ps_cur);
    if (!_setjmp(ps_fibers[ps_cur].env)) _longjmp(ps_sched_env, 1);  // back to the scheduler
}

static void ps_fiber_entry() {
    ps_body();
    ps_fibers[ps_cur].done = true;
    _longjmp(ps_sched_env, 1);  // never returns: the fiber's stack is simply abandoned
}

static void ps_resume(int i) {
    ps_cur = i;
    if (!_setjmp(ps_sched_env)) {
        if (!ps_fibers[i].started) {
            ps_fibers[i].started = true;
            setcontext(&ps_fibers[i].ctx);
        }
        _longjmp(ps_fibers[i].env, 1);
    }
}

inline void __syncthreads() { ps_arrive(ps_cta_barrier); }

template <typename T>
inline T __shfl_xor_sync(unsigned /*mask*/, T value, int lane_mask) {
    static_assert(sizeof(T) <= 8, "shuffle of a type wider than 8 bytes");
    const int me = ps_fibers[ps_cur].linear;
    const int warp = me / 32;
    const int lane = me % 32;
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    ps_warp_slots[warp * 32 + lane] = bits;
    ps_arrive(ps_warp_barriers[warp]);
    bits = ps_warp_slots[warp * 32 + (lane ^ lane_mask)];
    ps_arrive(ps_warp_barriers[warp]);  // nobody overwrites a slot before every lane has read it
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

// Gather one 32-bit value from every lane of the caller's warp (every lane must call it: a barrier).
// The caller reads the slots, then calls ps_warp_release() before any lane may write them again.
static unsigned* ps_warp_gather(const unsigned* words, int count) {
    const int me = ps_fibers[ps_cur].linear;
    const int warp = me / 32;
    unsigned* slots = &ps_mma_slots[(std::size_t)warp * 32 * 10];
    std::memcpy(slots + (me % 32) * 10, words, sizeof(unsigned) * count);
    ps_arrive(ps_warp_barriers[warp]);
    return slots;
}
static void ps_warp_release() { ps_arrive(ps_warp_barriers[ps_fibers[ps_cur].linear / 32]); }
static int ps_lane() { return ps_fibers[ps_cur].linear % 32; }

// Run one CTA: one fiber per thread, scheduled round-robin between barriers.
static void ps_run_cta(const std::function<void()>& body) {
    const int n = (int)(ps_block_dim.x * ps_block_dim.y * ps_block_dim.z);
    if (n % 32) {
        std::fprintf(stderr, "host emulation: block size %d is not a multiple of 32\n", n);
        std::abort();
    }
    ps_body = body;
    ps_fibers.resize(n);
    ps_cta_barrier = PsBarrier{n, 0, {}};
    ps_warp_barriers.assign(n / 32, PsBarrier{32, 0, {}});
    ps_warp_slots.assign(n, 0);
    ps_mma_slots.assign((std::size_t)n * 10, 0);
    for (int i = 0; i < n; ++i) {
        PsFiber& f = ps_fibers[i];
        f.stack.resize(1 << 16);
        f.linear = i;
        f.tid.x = i % ps_block_dim.x;
        f.tid.y = (i / ps_block_dim.x) % ps_block_dim.y;
        f.tid.z = i / (ps_block_dim.x * ps_block_dim.y);
        f.done = f.waiting = f.started = false;
        f.uncommitted.clear();
        f.groups.clear();
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack.data();
        f.ctx.uc_stack.ss_size = f.stack.size();
        f.ctx.uc_link = nullptr;
        makecontext(&f.ctx, ps_fiber_entry, 0);
    }
    for (;;) {
        bool ran = false, pending = false;
        for (int i = 0; i < n; ++i) {
            if (ps_fibers[i].done) continue;
            pending = true;
            if (ps_fibers[i].waiting) continue;
            ran = true;
            ps_resume(i);
        }
        if (!pending) {
            for (int i = 0; i < n; ++i)
                if (!ps_fibers[i].groups.empty() || !ps_fibers[i].uncommitted.empty()) {
                    std::fprintf(stderr, "host emulation: thread %d of CTA (%u, %u, %u) ended with cp.async copies "
                                         "never waited for\n", i, ps_block_idx.x, ps_block_idx.y, ps_block_idx.z);
                    std::abort();
                }
            return;
        }
        if (!ran) {
            std::fprintf(stderr, "host emulation: deadlock in CTA (%u, %u, %u): a barrier is never reached by all "
                                 "threads\n", ps_block_idx.x, ps_block_idx.y, ps_block_idx.z);
            std::abort();
        }
    }
}

// Launch `kernel` with its arguments read from `args` (the CUDA kernelParams convention: one pointer
// per parameter). `sizes` holds the byte size of what the caller put behind each pointer; a mismatch
// with the kernel's parameter types aborts, so the Python launch code is checked too.
// CTAs of a real launch run in any order; ps_reverse_grid = 1 runs them last to first, so a test can
// show that a result does not depend on the order (see ps_set_reverse_grid).
static int ps_reverse_grid = 0;
extern "C" void ps_set_reverse_grid(int on) { ps_reverse_grid = on; }

template <typename... P, std::size_t... I>
static void ps_launch_impl(void (*kernel)(P...), void** args, std::index_sequence<I...>) {
    for (unsigned z = 0; z < ps_grid_dim.z; ++z)
        for (unsigned y = 0; y < ps_grid_dim.y; ++y)
            for (unsigned x = 0; x < ps_grid_dim.x; ++x) {
                ps_block_idx.x = ps_reverse_grid ? ps_grid_dim.x - 1 - x : x;
                ps_block_idx.y = ps_reverse_grid ? ps_grid_dim.y - 1 - y : y;
                ps_block_idx.z = ps_reverse_grid ? ps_grid_dim.z - 1 - z : z;
                ps_dynamic_reset();
                ps_run_cta([&] { kernel(*static_cast<P*>(args[I])...); });
                ps_dynamic_check_guard();
            }
}

// dynamic_bytes: the launch's dynamic shared memory (CuPy's shared_mem).
template <typename... P>
static int ps_launch(void (*kernel)(P...), const unsigned* dims, void** args, int nargs, const int* sizes,
                     int dynamic_bytes = 0) {
    const int expected_sizes[] = {(int)sizeof(P)..., 0};
    if (nargs != (int)sizeof...(P)) {
        std::fprintf(stderr, "host emulation: kernel takes %d arguments, launch passed %d\n", (int)sizeof...(P), nargs);
        return 1;
    }
    for (int i = 0; i < nargs; ++i)
        if (sizes[i] != expected_sizes[i]) {
            std::fprintf(stderr, "host emulation: argument %d is %d bytes, the kernel expects %d\n", i, sizes[i],
                         expected_sizes[i]);
            return 2;
        }
    if (dynamic_bytes < 0) {
        std::fprintf(stderr, "host emulation: %d bytes of dynamic shared memory\n", dynamic_bytes);
        return 3;
    }
    ps_grid_dim = ps_dim3{dims[0], dims[1], dims[2]};
    ps_block_dim = ps_dim3{dims[3], dims[4], dims[5]};
    ps_dynamic_bytes = dynamic_bytes;
    ps_dynamic_buf.assign(((std::size_t)dynamic_bytes + PS_DYNAMIC_GUARD + 15) / 16, uint4{});
    ps_launch_impl(kernel, args, std::index_sequence_for<P...>{});
    return 0;
}

// ---- CUDA built-ins --------------------------------------------------------------------------------

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
    return f;
}
inline unsigned int __float_as_uint(float f) {
    unsigned int u;
    std::memcpy(&u, &f, 4);
    return u;
}
inline float __uint_as_float(unsigned int u) {
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }

// ---- stand-ins for common.cu -----------------------------------------------------------------------

struct alignas(2) f16 {
    unsigned short bits;
};

inline float h2f(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}
inline unsigned short f2h(float f) {
    const _Float16 v = (_Float16)f;  // round to nearest even
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}
inline float to_float(f16 x) { return h2f(x.bits); }
inline float to_float(float x) { return x; }
template <typename T> inline T from_float(float x);
template <> inline f16 from_float<f16>(float x) { return f16{f2h(x)}; }
template <> inline float from_float<float>(float x) { return x; }
inline float2 half2_to_float2(unsigned int v) {
    return float2{h2f((unsigned short)(v & 0xffffu)), h2f((unsigned short)(v >> 16))};
}
inline unsigned int float2_to_half2(float a, float b) { return (unsigned int)f2h(a) | ((unsigned int)f2h(b) << 16); }
inline float neg_inf() { return -INFINITY; }
inline float warp_sum(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
}
inline float warp_max(float x) {
    for (int offset = 16; offset > 0; offset >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
    return x;
}
inline void cp_async_16(void* smem, const void* gmem, int src_bytes) {
    if (!ps_hazards) {  // the model off: the copy lands at once
        std::memset(smem, 0, 16);
        if (src_bytes) std::memcpy(smem, gmem, (std::size_t)src_bytes);
        return;
    }
    PsCopy c;
    c.dst = smem;
    std::memset(c.data, 0, 16);  // bytes past src_bytes are zero-filled, as cp.async's src-size does
    if (src_bytes) std::memcpy(c.data, gmem, (std::size_t)src_bytes);
    std::memset(smem, 0xFF, 16);  // in flight: whoever reads it before the wait reads NaN
    ps_fibers[ps_cur].uncommitted.push_back(c);
}
inline void cp_async_commit() {
    PsFiber& f = ps_fibers[ps_cur];
    f.groups.push_back(std::move(f.uncommitted));
    f.uncommitted.clear();
}
// cp.async.wait_group N: every committed group of this thread but the newest N has landed.
template <int N> inline void cp_async_wait() {
    PsFiber& f = ps_fibers[ps_cur];
    while ((int)f.groups.size() > N) {
        for (const PsCopy& c : f.groups.front()) std::memcpy(c.dst, c.data, 16);
        f.groups.pop_front();
    }
}

// ---- stand-ins for tensor_core.cuh: bfloat16 and the warp-level mma fragment model -----------------

struct alignas(2) bf16 {
    unsigned short bits;
};

inline float bf2f(unsigned short h) { return __int_as_float((int)(((unsigned)h) << 16)); }
// float32 -> bfloat16, round to nearest even (NaN stays a quiet NaN), as cvt.rn.bf16.f32 does.
inline unsigned short f2bf(float f) {
    unsigned u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}
inline float to_float(bf16 x) { return bf2f(x.bits); }
template <> inline bf16 from_float<bf16>(float x) { return bf16{f2bf(x)}; }

template <typename T> inline float2 pair_to_float2(unsigned int v);
template <> inline float2 pair_to_float2<f16>(unsigned int v) { return half2_to_float2(v); }
template <> inline float2 pair_to_float2<bf16>(unsigned int v) {
    return float2{bf2f((unsigned short)(v & 0xffffu)), bf2f((unsigned short)(v >> 16))};
}
template <typename T> inline unsigned int pack2(float lo, float hi);
template <> inline unsigned int pack2<f16>(float lo, float hi) { return float2_to_half2(lo, hi); }
template <> inline unsigned int pack2<bf16>(float lo, float hi) {
    return (unsigned int)f2bf(lo) | ((unsigned int)f2bf(hi) << 16);
}

template <typename T> inline float ps_elem(unsigned word, int half) {
    const unsigned short h = (unsigned short)(half ? word >> 16 : word & 0xffffu);
    return std::is_same<T, bf16>::value ? bf2f(h) : h2f(h);
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}.{f16,bf16}.f32 with d as c: the warp's fragments are
// gathered, A (16x16), B (16x8) and C (16x8) rebuilt from them by the PTX ISA's per-lane layout, and each lane
// keeps its own four D values. D = C + sum_k A[r][k] B[k][n], products exact, summed in float32 from k = 0
// (the tensor core's internal order and rounding are not specified: tests allow for that).
template <typename T>
inline void mma_m16n8k16(float (&d)[4], const unsigned int (&a)[4], const unsigned int (&b)[2]) {
    unsigned words[10];
    for (int i = 0; i < 4; ++i) words[i] = a[i];
    words[4] = b[0];
    words[5] = b[1];
    std::memcpy(words + 6, d, 16);
    const unsigned* s = ps_warp_gather(words, 10);
    const int lane = ps_lane(), g = lane >> 2, t = lane & 3;
    float out[4];
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i & 1);
        float acc = d[i];
        for (int k = 0; k < 16; ++k) {
            // A[row][k]: lane (row % 8, (k % 8) / 2), register (row >= 8) + 2 (k >= 8), half k & 1
            const unsigned aw = s[((row & 7) * 4 + ((k & 7) >> 1)) * 10 + (row >= 8) + 2 * (k >= 8)];
            // B[k][col]: lane (col, (k % 8) / 2), register k >= 8, half k & 1
            const unsigned bw = s[(col * 4 + ((k & 7) >> 1)) * 10 + 4 + (k >= 8)];
            acc += ps_elem<T>(aw, k & 1) * ps_elem<T>(bw, k & 1);
        }
        out[i] = acc;
    }
    ps_warp_release();
    for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ldmatrix.sync.aligned.m8n8.x4{.trans}.shared.b16: lane 8i + r gives row r of matrix i (16 bytes, 16-byte
// aligned, as on the GPU). r[i] of lane (g, t) becomes (M_i[g][2t], M_i[g][2t+1]), or with .trans
// (M_i[2t][g], M_i[2t+1][g]).
inline void ps_ldmatrix_x4(unsigned int (&r)[4], const void* row_addr, bool trans) {
    if (reinterpret_cast<std::uintptr_t>(row_addr) % 16) {
        std::fprintf(stderr, "host emulation: ldmatrix row address %p is not 16-byte aligned\n", row_addr);
        std::abort();
    }
    unsigned words[2];
    const std::uintptr_t p = reinterpret_cast<std::uintptr_t>(row_addr);
    words[0] = (unsigned)(p & 0xffffffffu);
    words[1] = (unsigned)(p >> 32);
    const unsigned* s = ps_warp_gather(words, 2);
    const int lane = ps_lane(), g = lane >> 2, t = lane & 3;
    for (int i = 0; i < 4; ++i) {
        unsigned short h[2];
        for (int j = 0; j < 2; ++j) {
            const int row = trans ? 2 * t + j : g;  // M_i's row held by lane 8i + row
            const int col = trans ? g : 2 * t + j;
            const int src = 8 * i + row;
            const std::uintptr_t addr = (std::uintptr_t)s[src * 10] | ((std::uintptr_t)s[src * 10 + 1] << 32);
            std::memcpy(&h[j], reinterpret_cast<const char*>(addr) + 2 * col, 2);
        }
        r[i] = (unsigned)h[0] | ((unsigned)h[1] << 16);
    }
    ps_warp_release();
}
inline void ldmatrix_x4(unsigned int (&r)[4], const void* row_addr) { ps_ldmatrix_x4(r, row_addr, false); }
inline void ldmatrix_x4_trans(unsigned int (&r)[4], const void* row_addr) { ps_ldmatrix_x4(r, row_addr, true); }
