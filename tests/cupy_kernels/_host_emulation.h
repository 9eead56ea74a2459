// Host emulation of the small CUDA subset pagedserve's kernels use, for tests without a GPU.
//
// The kernel family files (paged_attention.cu, norm.cu, ...) are compiled unchanged as C++ after this
// header, which stands in for cupy_kernels/cuda/common.cu (whose PTX asm cannot run on a CPU) and for the
// CUDA built-ins. Each CUDA thread of a CTA runs as a fiber (ucontext); __syncthreads and warp shuffles
// are barriers that switch fibers, so the kernels' real control flow, indexing and synchronisation
// run, CTA after CTA (a fiber is entered once with setcontext, then switched with _setjmp/_longjmp,
// which skip the signal-mask system calls of swapcontext). A barrier that can never complete (a divergent __syncthreads) aborts with a
// message. cp.async copies happen at once; the wait/commit calls are no-ops.
//
// Not emulated: timing, memory-model races between CTAs, fast-math approximations (exp2f is libm's).
#pragma once

#include <cmath>
#include <math.h>  // exp2f, expf, fmaf, fmaxf, sqrtf in the global namespace, as in CUDA
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>
#include <setjmp.h>
#include <ucontext.h>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))
#define __shared__ static

struct ps_dim3 { unsigned x = 1, y = 1, z = 1; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };

// ---- the fiber scheduler -------------------------------------------------------------------------

struct PsFiber {
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
static std::function<void()> ps_body;

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
    for (int i = 0; i < n; ++i) {
        PsFiber& f = ps_fibers[i];
        f.stack.resize(1 << 16);
        f.linear = i;
        f.tid.x = i % ps_block_dim.x;
        f.tid.y = (i / ps_block_dim.x) % ps_block_dim.y;
        f.tid.z = i / (ps_block_dim.x * ps_block_dim.y);
        f.done = f.waiting = f.started = false;
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
        if (!pending) return;
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
                ps_run_cta([&] { kernel(*static_cast<P*>(args[I])...); });
            }
}

template <typename... P>
static int ps_launch(void (*kernel)(P...), const unsigned* dims, void** args, int nargs, const int* sizes) {
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
    ps_grid_dim = ps_dim3{dims[0], dims[1], dims[2]};
    ps_block_dim = ps_dim3{dims[3], dims[4], dims[5]};
    ps_launch_impl(kernel, args, std::index_sequence_for<P...>{});
    return 0;
}

// ---- CUDA built-ins --------------------------------------------------------------------------------

inline float __int_as_float(int i) {
    float f;
    std::memcpy(&f, &i, 4);
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
    std::memset(smem, 0, 16);
    if (src_bytes) std::memcpy(smem, gmem, (std::size_t)src_bytes);
}
inline void cp_async_commit() {}
template <int N> inline void cp_async_wait() {}
