/* The step around the passes on the cpu (ops.def's last section): the norms, the finite check and the
 * optimizers' per-element updates call the rules of src/core/norm.c; Newton–Schulz runs its products on
 * the GEMM driver. Element-wise work is split over threads in equal shares: every element's arithmetic is
 * fixed, so the bits do not depend on the thread count. */
#include <math.h>
#include <omp.h>

#include "kernels/cpu/cpu.h"

void cpu_sumsq(double *out, const float *x, int64_t n) { *out = ds4_sumsq(x, n); }
void cpu_sumsq_exact(ds4_sumsq_acc *acc, const float *x, int64_t n) { ds4_sumsq_exact(x, n, acc); }

void cpu_rank_sum_add(float *g, const float *recv, int n, int64_t len) {
#pragma omp parallel for schedule(static) if (len * n >= (1 << 16))
    for (int64_t i = 0; i < len; i++) {
        float t = recv[i];
        for (int r = 1; r < n; r++) t += recv[(int64_t)r * len + i];
        g[i] += t;
    }
}

void cpu_scale_f32(float *x, int64_t n, float s) { ds4_scale_f32(x, n, s); }

void cpu_count_nonfinite(int64_t *out, const float *x, int64_t n) { *out = ds4_count_nonfinite(x, n); }

/* Thread t's share [a, b) of n elements, out of T (small spans stay on one thread: a parallel region per
 * few KiB costs more than it saves). */
#define SHARE_PARALLEL(n) _Pragma("omp parallel if ((n) >= 1 << 15)")
static void share(int64_t n, int64_t *a, int64_t *b) {
    const int64_t T = omp_get_num_threads(), t = omp_get_thread_num();
    *a = n * t / T;
    *b = n * (t + 1) / T;
}

void cpu_adamw_update(int64_t n, float *w, const float *g, float *m, float *v, ds4_adamw_consts k, bool decay) {
    SHARE_PARALLEL(n) {
        int64_t a, b;
        share(n, &a, &b);
        ds4_adamw_update(b - a, w + a, g + a, m + a, v + a, k, decay);
    }
}

void cpu_muon_momentum(int64_t n, const float *g, float *mom, float *u, float mu, bool nesterov) {
    SHARE_PARALLEL(n) {
        int64_t a, b;
        share(n, &a, &b);
        ds4_muon_momentum(b - a, g + a, mom + a, u + a, mu, nesterov);
    }
}

void cpu_muon_apply(int64_t n, float *w, const float *o, float decay, float step) {
    SHARE_PARALLEL(n) {
        int64_t a, b;
        share(n, &a, &b);
        ds4_muon_apply(b - a, w + a, o + a, decay, step);
    }
}

/* ------------------------------------------------------------------ Newton–Schulz */
/* out [c, r] := x [r, c] transposed. */
static void transpose(const float *x, int64_t r, int64_t c, float *out) {
#pragma omp parallel for if (r * c >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) out[j * r + i] = x[i * c + j];
}

/* One iteration on x [r, c] (r <= c): A = x·xᵀ [r, r], B = b·A + c·A·A [r, r], x = a·x + B·x. */
static void ns_iteration(ds4_matmul_precision prec, float *x, int64_t r, int64_t c, ds4_ns_coef k, float *A, float *B,
                         float *y) {
    cpu_gemm_nt(prec, r, r, c, x, c, x, c, A, r, 0.0f);
    cpu_gemm_nn(prec, r, r, r, A, r, A, r, B, r, 0.0f);
#pragma omp parallel for if (r * r >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r * r; i++) B[i] = k.b * A[i] + k.c * B[i];
    cpu_gemm_nn(prec, r, c, r, B, r, x, c, y, c, 0.0f);
#pragma omp parallel for if (r * c >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < r * c; i++) x[i] = k.a * x[i] + y[i];
}

/* x [n] /= (‖x‖_F + eps): the spectral norm is then at most 1, where the iterations converge. */
static void normalize(float *x, int64_t n, float eps) {
    const float d = (float)sqrt(ds4_sumsq(x, n)) + eps;
#pragma omp parallel for if (n >= 1 << 16) schedule(static)
    for (int64_t i = 0; i < n; i++) x[i] = x[i] / d;
}

/* The workspace: A, B [r, r], y [r, c] and, for a tall matrix, its transpose t [r, c] (else t = x). NULL
 * pointers and the allocator's failure count moving on out of memory. */
typedef struct {
    float *A, *B, *y, *t;
} ns_work;
static bool ns_work_alloc(ns_work *w, bool plan, float *x, int64_t r, int64_t c, bool tall) {
    w->A = ds4_alloc_for(plan, DS4_MEM_OPTIM, (size_t)(r * r) * sizeof(float));
    w->B = ds4_alloc_for(plan, DS4_MEM_OPTIM, (size_t)(r * r) * sizeof(float));
    w->y = ds4_alloc_for(plan, DS4_MEM_OPTIM, (size_t)(r * c) * sizeof(float));
    w->t = tall ? ds4_alloc_for(plan, DS4_MEM_OPTIM, (size_t)(r * c) * sizeof(float)) : x;
    return w->A && w->B && w->y && w->t;
}
static void ns_work_free(ns_work *w, bool tall) {
    ds4_free(w->A);
    ds4_free(w->B);
    ds4_free(w->y);
    if (tall) ds4_free(w->t);
}

void cpu_newton_schulz(ds4_matmul_precision prec, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                       int64_t iters, float eps) {
    const bool tall = rows > cols; /* work on xᵀ: the Gram matrix is then the small one */
    const int64_t r = tall ? cols : rows, c = tall ? rows : cols;
    ns_work w;
    if (ns_work_alloc(&w, false, x, r, c, tall)) {
        if (tall) transpose(x, rows, cols, w.t);
        normalize(w.t, r * c, eps);
        for (int64_t i = 0; i < iters; i++) ns_iteration(prec, w.t, r, c, coef[i], w.A, w.B, w.y);
        if (tall) transpose(w.t, r, c, x);
    }
    ns_work_free(&w, tall);
}

void cpu_newton_schulz_plan(ds4_matmul_precision prec, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                            int64_t iters, float eps) {
    (void)prec, (void)coef, (void)iters, (void)eps;
    const bool tall = rows > cols;
    ns_work w;
    ns_work_alloc(&w, true, x, tall ? cols : rows, tall ? rows : cols, tall);
    ns_work_free(&w, tall);
}
