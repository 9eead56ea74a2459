// A fake libcublas for tests without a GPU: the symbols cupy_kernels/cuda/cublas.py binds, with cuBLAS's
// C signatures, acting on host memory. Each call is appended to a text log (fake_cublas_log) so a test
// can check the order and the arguments; cublasGemmEx checks its leading dimensions the way cuBLAS does
// (CUBLAS_STATUS_INVALID_VALUE) and computes the column-major GEMM, so the binding's row-major
// marshalling is checked against numpy. Stricter than cuBLAS in one way, on purpose: a GEMM on a handle
// without a workspace of its own fails (CUBLAS_STATUS_NOT_INITIALIZED), because under stream capture
// cuBLAS would otherwise allocate one; cublasSetStream drops the workspace, as the real one does.
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    void* stream;
    void* workspace;
    size_t workspace_bytes;
    int math_mode;
} Handle;

static char log_buf[1 << 16];
static size_t log_len = 0;

static void note(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(log_buf + log_len, sizeof(log_buf) - log_len, fmt, ap);
    va_end(ap);
    if (n > 0 && log_len + (size_t)n + 1 < sizeof(log_buf)) {
        log_len += (size_t)n;
        log_buf[log_len++] = '\n';
        log_buf[log_len] = 0;
    }
}

const char* fake_cublas_log(void) { return log_buf; }
void fake_cublas_reset(void) { log_len = 0; log_buf[0] = 0; }

int cublasCreate_v2(void** handle) {
    Handle* h = (Handle*)calloc(1, sizeof(Handle));
    *handle = h;
    note("create");
    return 0;
}

int cublasDestroy_v2(void* handle) {
    free(handle);
    note("destroy");
    return 0;
}

int cublasGetVersion_v2(void* handle, int* version) {
    (void)handle;
    *version = 130000;
    return 0;
}

int cublasSetMathMode(void* handle, int mode) {
    ((Handle*)handle)->math_mode = mode;
    note("math %d", mode);
    return 0;
}

int cublasSetStream_v2(void* handle, void* stream) {
    Handle* h = (Handle*)handle;
    h->stream = stream;
    h->workspace = NULL;  // cuBLAS: "unconditionally resets the cuBLAS library workspace"
    h->workspace_bytes = 0;
    note("stream %llu", (unsigned long long)(uintptr_t)stream);
    return 0;
}

int cublasSetWorkspace_v2(void* handle, void* workspace, size_t bytes) {
    Handle* h = (Handle*)handle;
    h->workspace = workspace;
    h->workspace_bytes = bytes;
    note("workspace %llu %zu", (unsigned long long)(uintptr_t)workspace, bytes);
    return 0;
}

static double load(const void* p, int type, long i) {
    switch (type) {
        case 0: return ((const float*)p)[i];
        case 1: return ((const double*)p)[i];
        case 2: return (double)((const _Float16*)p)[i];
        case 14: {
            uint32_t bits = (uint32_t)((const uint16_t*)p)[i] << 16;
            float f;
            memcpy(&f, &bits, 4);
            return f;
        }
    }
    abort();
}

static void store(void* p, int type, long i, double v) {
    switch (type) {
        case 0: ((float*)p)[i] = (float)v; return;
        case 1: ((double*)p)[i] = v; return;
        case 2: ((_Float16*)p)[i] = (_Float16)(float)v; return;
        case 14: {
            float f = (float)v;
            uint32_t bits;
            memcpy(&bits, &f, 4);
            bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
            ((uint16_t*)p)[i] = (uint16_t)(bits >> 16);
            return;
        }
    }
    abort();
}

typedef struct {
    int transa, transb, m, n, k, atype, lda, btype, ldb, ctype, ldc, compute;
    const void *alpha, *A, *B, *beta;
    void* C;
} Gemm;

static int capturing = 0;
static Gemm recorded[64];
static int num_recorded = 0;

void fake_cublas_capture(int on) {
    capturing = on;
    if (on) num_recorded = 0;
}

static void run_gemm(const Gemm* g) {
    const int wide = g->compute == 70;  // CUBLAS_COMPUTE_64F: double alpha/beta and sums; 68: float
    const double a = wide ? *(const double*)g->alpha : *(const float*)g->alpha;
    const double b = wide ? *(const double*)g->beta : *(const float*)g->beta;
    for (int j = 0; j < g->n; ++j)
        for (int i = 0; i < g->m; ++i) {
            double acc = 0;
            float facc = 0;
            for (int p = 0; p < g->k; ++p) {
                const double x = load(g->A, g->atype, g->transa == 0 ? i + (long)p * g->lda : p + (long)i * g->lda);
                const double y = load(g->B, g->btype, g->transb == 0 ? p + (long)j * g->ldb : j + (long)p * g->ldb);
                if (wide) acc += x * y;
                else facc += (float)x * (float)y;
            }
            double v = a * (wide ? acc : (double)facc);
            if (b != 0) v += b * load(g->C, g->ctype, i + (long)j * g->ldc);
            store(g->C, g->ctype, i + (long)j * g->ldc, v);
        }
}

int fake_cublas_replay(void) {
    for (int r = 0; r < num_recorded; ++r) run_gemm(&recorded[r]);
    return num_recorded;
}

int cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k, const void* alpha, const void* A,
                 int atype, int lda, const void* B, int btype, int ldb, const void* beta, void* C, int ctype, int ldc,
                 int compute, int algo) {
    Handle* h = (Handle*)handle;
    note("gemm transa=%d transb=%d m=%d n=%d k=%d lda=%d ldb=%d ldc=%d atype=%d btype=%d ctype=%d compute=%d algo=%d "
         "stream=%llu",
         transa, transb, m, n, k, lda, ldb, ldc, atype, btype, ctype, compute, algo,
         (unsigned long long)(uintptr_t)h->stream);
    if (!h->workspace || !h->workspace_bytes) return 1;
    if (m < 0 || n < 0 || k < 0 || (transa != 0 && transa != 1) || (transb != 0 && transb != 1)) return 7;
    if (lda < (transa == 0 ? m : k) || lda < 1 || ldb < (transb == 0 ? k : n) || ldb < 1 || ldc < m || ldc < 1)
        return 7;
    if (atype != btype || atype != ctype) return 15;
    if (compute != 70 && compute != 68) return 15;
    const Gemm g = {transa, transb, m, n, k, atype, lda, btype, ldb, ctype, ldc, compute, alpha, A, B, beta, C};
    if (capturing) {
        if (num_recorded == 64) return 3;
        recorded[num_recorded++] = g;  // alpha and beta are read at replay, from the caller's host buffers
        return 0;
    }
    run_gemm(&g);
    return 0;
}
