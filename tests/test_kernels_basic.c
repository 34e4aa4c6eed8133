/* Basic kernels: fast gemm vs reference on edge shapes and its determinism; finite-difference
 * checks (on the float64 twins) of every backward of linear, grouped linear, embedding, RMSNorm,
 * RoPE, the MoE gate, clamped SwiGLU and cross-entropy; float vs double agreement; YaRN. */
#include <omp.h>
#include <stdint.h>

#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dispatch.h"
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"
#include "test.h"
#include "test_gemm.h"

#define FD_H 1e-6
#define FD_TOL 1e-6  /* ‖analytic − FD‖/‖FD‖ on the double twins */
#define F32_TOL 1e-5 /* float kernel vs its double twin on the same inputs */

/* ---------------------------------------------------------------- helpers */

static double *dalloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(double)); }
static float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

/* Uniform in [-amp, amp), deterministic, via test.h's float fill widened to double. */
static void dfill(double *x, int64_t n, unsigned seed, double amp) {
    float *t = falloc(n);
    t_fill(t, n, seed, 1.0f);
    for (int64_t i = 0; i < n; i++) x[i] = amp * (double)t[i];
    free(t);
}
static void to_f(float *y, const double *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
}
static void to_d(double *y, const float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = (double)x[i];
}
/* ‖a − b‖ / ‖b‖ in double */
static double rel_d(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
/* float result vs double result */
static double rel_fd(const float *a, const double *b, int64_t n) {
    double *t = dalloc(n);
    to_d(t, a, n);
    double r = rel_d(t, b, n);
    free(t);
    return r;
}
static double dot_d(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static double norm_d(const double *a, int64_t n) { return sqrt(dot_d(a, a, n)); }

/* Central differences of a scalar objective over x[0..n). */
typedef double (*objective)(void *ctx);
static void fd_grad(objective f, void *ctx, double *x, int64_t n, double *g) {
    for (int64_t i = 0; i < n; i++) {
        double xi = x[i];
        x[i] = xi + FD_H;
        double fp = f(ctx);
        x[i] = xi - FD_H;
        double fm = f(ctx);
        x[i] = xi;
        g[i] = (fp - fm) / (2 * FD_H);
    }
}
/* Analytic gradient = (after − before) of an accumulating backward, compared with FD. */
static void check_grad(const char *what, const double *before, const double *after, const double *fd, int64_t n) {
    double *a = dalloc(n);
    for (int64_t i = 0; i < n; i++) a[i] = after[i] - before[i];
    double e = rel_d(a, fd, n);
    CHECK(e <= FD_TOL, "%s: analytic vs FD rel err %.3g (‖fd‖ = %.3g)", what, e, norm_d(fd, n));
    CHECK(norm_d(fd, n) > 0, "%s: FD gradient is zero, the check proves nothing", what);
    free(a);
}

/* ---------------------------------------------------------------- gemm */

static gemm_fn ref_of(int op) {
    return op == OP_NT ? cpu_gemm_nt_ref : op == OP_NN ? cpu_gemm_nn_ref : cpu_gemm_tn_ref;
}

/* Stored shapes (rows × cols) of A and B for an op. */
static void ab_shape(int op, int64_t M, int64_t N, int64_t K, int64_t *ar, int64_t *ac, int64_t *br, int64_t *bc) {
    *ar = op == OP_TN ? K : M;
    *ac = op == OP_TN ? M : K;
    *br = op == OP_NT ? N : K;
    *bc = op == OP_NT ? K : N;
}

/* Fast vs reference on one shape with padded leading dims; checks the tolerance, and that no
 * element outside the M×N window of C is touched. Returns the relative error. */
static double gemm_case(int op, int64_t M, int64_t N, int64_t K, int64_t pad, float beta) {
    int64_t ar, ac, br, bc;
    ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = falloc(ar * lda), *B = falloc(br * ldb);
    float *Cf = falloc(M * ldc), *Cr = falloc(M * ldc);
    t_fill(A, ar * lda, (unsigned)(M * 31 + K), 1.0f);
    t_fill(B, br * ldb, (unsigned)(N * 17 + K + 5), 1.0f);
    t_fill(Cr, M * ldc, 99, 1.0f);
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = N; j < ldc; j++) Cr[i * ldc + j] = 12345.0f; /* sentinel in the padding */
    if (beta == 0)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) Cr[i * ldc + j] = NAN; /* beta 0 must not read C */
    memcpy(Cf, Cr, (size_t)(M * ldc) * sizeof(float));
    ref_of(op)(M, N, K, A, lda, B, ldb, Cr, ldc, beta);
    gemm_op(CPU_EXEC, op, M, N, K, A, lda, B, ldb, Cf, ldc, beta);
    double num = 0, den = 0;
    int bad_pad = 0, nonfinite = 0;
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++) {
            double d = (double)Cf[i * ldc + j] - Cr[i * ldc + j];
            num += d * d;
            den += (double)Cr[i * ldc + j] * Cr[i * ldc + j];
            nonfinite += !isfinite(Cf[i * ldc + j]);
        }
        for (int64_t j = N; j < ldc; j++) bad_pad += Cf[i * ldc + j] != 12345.0f;
    }
    double e = den > 0 ? sqrt(num / den) : sqrt(num);
    /* Both sides round a K-term sum (the fast one with FMAs and per-slice partial sums): random-walk
     * error growth ~ u·sqrt(K) with u = 6e-8; allow 8u·sqrt(K) (measured worst: ~0.9u·sqrt(K)). */
    double tol = 5e-7 * sqrt((double)(K > 1 ? K : 1));
    CHECK(e <= tol && !nonfinite, "%s gemm_%s M=%lld N=%lld K=%lld pad=%lld beta=%g: rel err %.3g > %.3g (%d nonfinite)",
          ds4_isa_name(ds4_isa_current()), OP_NAME[op], (long long)M, (long long)N, (long long)K, (long long)pad, beta, e, tol, nonfinite);
    CHECK(bad_pad == 0, "gemm_%s M=%lld N=%lld K=%lld: %d elements beyond column N written", OP_NAME[op],
          (long long)M, (long long)N, (long long)K, bad_pad);
    free(A);
    free(B);
    free(Cf);
    free(Cr);
    return e;
}

static void test_gemm_edge_shapes(void) {
    /* Around the register tile (14×32), the K slice (256), the row block (224) and the task width. */
    static const int64_t MS[] = {1, 2, 13, 14, 15, 29, 64, 225};
    static const int64_t NS[] = {1, 3, 16, 17, 31, 32, 33, 70, 513};
    static const int64_t KS[] = {1, 5, 64, 255, 257, 520};
    int64_t n_cases = 0;
    for (int op = 0; op < 3; op++)
        for (size_t a = 0; a < sizeof MS / sizeof *MS; a++)
            for (size_t b = 0; b < sizeof NS / sizeof *NS; b++) {
                size_t c = (a * 3 + b * 5 + (size_t)op) % (sizeof KS / sizeof *KS); /* a spread of K */
                int64_t M = MS[a], N = NS[b], K = KS[c];
                if (M * N * K > 30000000) K = 64;
                gemm_case(op, M, N, K, (a + b) % 2 ? 3 : 0, (a + b + c) % 2 ? 1.0f : 0.0f);
                n_cases++;
            }
    /* every K on a shape with full and partial tiles */
    for (int op = 0; op < 3; op++)
        for (size_t c = 0; c < sizeof KS / sizeof *KS; c++) {
            gemm_case(op, 30, 45, KS[c], 2, 0.0f);
            gemm_case(op, 30, 45, KS[c], 0, 1.0f);
        }
    /* wider than one packed B block of 8192 columns, and multi-slice K with several row blocks */
    for (int op = 0; op < 3; op++) {
        gemm_case(op, 3, 8200, 7, 1, 1.0f);
        gemm_case(op, 460, 40, 600, 0, 0.0f);
    }
    CHECK(n_cases == 3 * 8 * 9);
}

/* K = 0: the empty sum (C = beta·C); M or N = 0: nothing written. */
static void test_gemm_degenerate(void) {
    float C[6] = {1, 2, 3, 4, 5, 6}, A[4] = {0}, B[4] = {0};
    for (int op = 0; op < 3; op++) {
        float c1[6], c0[6];
        memcpy(c1, C, sizeof C);
        for (int i = 0; i < 6; i++) c0[i] = NAN; /* beta 0 must not read C */
        gemm_op(CPU_EXEC, op, 2, 3, 0, A, 1, B, 3, c1, 3, 1.0f);
        gemm_op(CPU_EXEC, op, 2, 3, 0, A, 1, B, 3, c0, 3, 0.0f);
        CHECK(memcmp(c1, C, sizeof C) == 0, "gemm_%s K=0 beta=1 changed C", OP_NAME[op]);
        for (int i = 0; i < 6; i++) CHECK(c0[i] == 0, "gemm_%s K=0 beta=0: C[%d] = %g", OP_NAME[op], i, c0[i]);
        gemm_op(CPU_EXEC, op, 0, 3, 2, A, 2, B, 3, c1, 3, 0.0f);
        gemm_op(CPU_EXEC, op, 2, 0, 2, A, 2, B, 2, c1, 3, 0.0f);
        CHECK(memcmp(c1, C, sizeof C) == 0, "gemm_%s M or N = 0 wrote C", OP_NAME[op]);
    }
    /* a 1×1×1 product is exact */
    float a = 3, b = -2, c = 0.5f;
    gemm_nt(CPU_EXEC, 1, 1, 1, &a, 1, &b, 1, &c, 1, 1.0f);
    CHECK(c == -5.5f, "1x1x1 accumulate: %g", c);
}

/* Same inputs → same bits: run to run, and for 1, 2 and 3 threads (tasks split differently). */
static void test_gemm_deterministic_threads(void) {
    int saved = omp_get_max_threads();
    const int64_t M = 300, N = 200, K = 600; /* 36M multiply-adds: threaded, 3 K slices */
    for (int op = 0; op < 3; op++) {
        int64_t ar, ac, br, bc;
        ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
        float *A = falloc(ar * ac), *B = falloc(br * bc), *C[4];
        t_fill(A, ar * ac, 7, 1.0f);
        t_fill(B, br * bc, 8, 1.0f);
        for (int r = 0; r < 4; r++) {
            C[r] = falloc(M * N);
            t_fill(C[r], M * N, 9, 1.0f);
            omp_set_num_threads(r == 0 ? 1 : r);
            gemm_op(CPU_EXEC, op, M, N, K, A, ac, B, bc, C[r], N, 1.0f);
        }
        omp_set_num_threads(saved);
        CHECK(memcmp(C[0], C[1], (size_t)(M * N) * sizeof(float)) == 0, "gemm_%s: run to run differs", OP_NAME[op]);
        CHECK(memcmp(C[1], C[2], (size_t)(M * N) * sizeof(float)) == 0, "gemm_%s: 1 vs 2 threads differ",
              OP_NAME[op]);
        CHECK(memcmp(C[1], C[3], (size_t)(M * N) * sizeof(float)) == 0, "gemm_%s: 1 vs 3 threads differ",
              OP_NAME[op]);
        for (int r = 0; r < 4; r++) free(C[r]);
        free(A);
        free(B);
    }
}

/* The three ops compute the same product from transposed storage: bitwise equal results (the
 * packed panels, hence the arithmetic, are the same). */
static void test_gemm_ops_agree(void) {
    const int64_t M = 37, N = 45, K = 300;
    float *A = falloc(M * K), *At = falloc(K * M), *B = falloc(K * N), *Bt = falloc(N * K);
    t_fill(A, M * K, 21, 1.0f);
    t_fill(B, K * N, 22, 1.0f);
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) At[k * M + i] = A[i * K + k];
    for (int64_t k = 0; k < K; k++)
        for (int64_t j = 0; j < N; j++) Bt[j * K + k] = B[k * N + j];
    float *c1 = falloc(M * N), *c2 = falloc(M * N), *c3 = falloc(M * N);
    gemm_nt(CPU_EXEC, M, N, K, A, K, Bt, K, c1, N, 0);
    gemm_nn(CPU_EXEC, M, N, K, A, K, B, N, c2, N, 0);
    gemm_tn(CPU_EXEC, M, N, K, At, M, B, N, c3, N, 0);
    CHECK(memcmp(c1, c2, (size_t)(M * N) * sizeof(float)) == 0, "nt vs nn differ");
    CHECK(memcmp(c1, c3, (size_t)(M * N) * sizeof(float)) == 0, "nt vs tn differ");
    /* the references too: each element is one sum over k ascending, whatever the loop order */
    cpu_gemm_nt_ref(M, N, K, A, K, Bt, K, c1, N, 0);
    cpu_gemm_nn_ref(M, N, K, A, K, B, N, c2, N, 0);
    cpu_gemm_tn_ref(M, N, K, At, M, B, N, c3, N, 0);
    CHECK(memcmp(c1, c2, (size_t)(M * N) * sizeof(float)) == 0, "nt_ref vs nn_ref differ");
    CHECK(memcmp(c1, c3, (size_t)(M * N) * sizeof(float)) == 0, "nt_ref vs tn_ref differ");
    free(A);
    free(At);
    free(B);
    free(Bt);
    free(c1);
    free(c2);
    free(c3);
}

/* ---------------------------------------------------------------- linear, grouped linear */

typedef struct {
    double *out, *inp, *w, *r;
    int64_t N, IC, OC, G, R, Din;
    int grouped;
} lin_ctx;

static double lin_obj(void *p) {
    lin_ctx *c = p;
    if (c->grouped)
        grouped_linear_fwd_f64(c->out, c->inp, c->w, c->N, c->G, c->R, c->Din);
    else
        linear_fwd_f64(c->out, c->inp, c->w, c->N, c->IC, c->OC);
    return dot_d(c->out, c->r, c->grouped ? c->N * c->G * c->R : c->N * c->OC);
}

static void linear_check(int grouped) {
    lin_ctx c = {0};
    c.grouped = grouped;
    c.N = 5;
    if (grouped) {
        c.G = 3, c.R = 4, c.Din = 6;
        c.IC = c.G * c.Din, c.OC = c.G * c.R;
    } else {
        c.IC = 7, c.OC = 6;
    }
    int64_t nin = c.N * c.IC, nout = c.N * c.OC, nw = grouped ? c.G * c.R * c.Din : c.OC * c.IC;
    const char *name = grouped ? "grouped_linear" : "linear";
    c.inp = dalloc(nin), c.w = dalloc(nw), c.out = dalloc(nout), c.r = dalloc(nout);
    dfill(c.inp, nin, 1, 1.0);
    dfill(c.w, nw, 2, 0.5);
    dfill(c.r, nout, 3, 1.0);
    /* the forward against plain loops */
    lin_obj(&c);
    double err = 0;
    for (int64_t n = 0; n < c.N; n++)
        for (int64_t o = 0; o < c.OC; o++) {
            double s = 0;
            if (grouped) {
                int64_t g = o / c.R, rr = o % c.R;
                for (int64_t d = 0; d < c.Din; d++) s += c.inp[n * c.IC + g * c.Din + d] * c.w[(g * c.R + rr) * c.Din + d];
            } else {
                for (int64_t i = 0; i < c.IC; i++) s += c.inp[n * c.IC + i] * c.w[o * c.IC + i];
            }
            err = fmax(err, fabs(s - c.out[n * c.OC + o]));
        }
    CHECK(err < 1e-12, "%s fwd vs loops: %.3g", name, err);
    /* analytic (accumulating onto nonzero gradients) vs FD */
    double *din0 = dalloc(nin), *dw0 = dalloc(nw), *din = dalloc(nin), *dw = dalloc(nw);
    double *fdin = dalloc(nin), *fdw = dalloc(nw);
    dfill(din0, nin, 4, 1.0);
    dfill(dw0, nw, 5, 1.0);
    memcpy(din, din0, (size_t)nin * sizeof(double));
    memcpy(dw, dw0, (size_t)nw * sizeof(double));
    if (grouped)
        grouped_linear_bwd_f64(din, dw, c.r, c.inp, c.w, c.N, c.G, c.R, c.Din);
    else
        linear_bwd_f64(din, dw, c.r, c.inp, c.w, c.N, c.IC, c.OC);
    fd_grad(lin_obj, &c, c.inp, nin, fdin);
    fd_grad(lin_obj, &c, c.w, nw, fdw);
    check_grad(grouped ? "grouped_linear d_o" : "linear dinp", din0, din, fdin, nin);
    check_grad(grouped ? "grouped_linear dw" : "linear dw", dw0, dw, fdw, nw);
    /* float (fast gemms) vs double, with the NULL-skips */
    float *fin = falloc(nin), *fw = falloc(nw), *fr = falloc(nout), *fout = falloc(nout);
    float *fdi = falloc(nin), *fdww = falloc(nw);
    to_f(fin, c.inp, nin);
    to_f(fw, c.w, nw);
    to_f(fr, c.r, nout);
    to_d(c.inp, fin, nin);
    to_d(c.w, fw, nw);
    to_d(c.r, fr, nout);
    memset(din, 0, (size_t)nin * sizeof(double));
    memset(dw, 0, (size_t)nw * sizeof(double));
    if (grouped) {
        grouped_linear_fwd(CPU_EXEC, fout, fin, fw, c.N, c.G, c.R, c.Din);
        grouped_linear_fwd_f64(c.out, c.inp, c.w, c.N, c.G, c.R, c.Din);
        grouped_linear_bwd(CPU_EXEC, fdi, NULL, fr, fin, fw, c.N, c.G, c.R, c.Din);
        grouped_linear_bwd(CPU_EXEC, NULL, fdww, fr, fin, fw, c.N, c.G, c.R, c.Din);
        grouped_linear_bwd_f64(din, dw, c.r, c.inp, c.w, c.N, c.G, c.R, c.Din);
    } else {
        linear_fwd(CPU_EXEC, fout, fin, fw, c.N, c.IC, c.OC);
        linear_fwd_f64(c.out, c.inp, c.w, c.N, c.IC, c.OC);
        linear_bwd(CPU_EXEC, fdi, NULL, fr, fin, fw, c.N, c.IC, c.OC);
        linear_bwd(CPU_EXEC, NULL, fdww, fr, fin, fw, c.N, c.IC, c.OC);
        linear_bwd_f64(din, dw, c.r, c.inp, c.w, c.N, c.IC, c.OC);
    }
    CHECK(rel_fd(fout, c.out, nout) <= F32_TOL, "%s fwd float vs double %.3g", name, rel_fd(fout, c.out, nout));
    CHECK(rel_fd(fdi, din, nin) <= F32_TOL, "%s dinp float vs double %.3g", name, rel_fd(fdi, din, nin));
    CHECK(rel_fd(fdww, dw, nw) <= F32_TOL, "%s dw float vs double %.3g", name, rel_fd(fdww, dw, nw));
    free(fin), free(fw), free(fr), free(fout), free(fdi), free(fdww);
    free(din0), free(dw0), free(din), free(dw), free(fdin), free(fdw);
    free(c.inp), free(c.w), free(c.out), free(c.r);
}

static void test_linear(void) { linear_check(0); }
static void test_grouped_linear(void) { linear_check(1); }

/* ---------------------------------------------------------------- embedding */

typedef struct {
    double *out, *table, *r;
    const int32_t *ids;
    int64_t N, D;
} emb_ctx;

static double emb_obj(void *p) {
    emb_ctx *c = p;
    embedding_fwd_f64(c->out, c->table, c->ids, c->N, c->D);
    return dot_d(c->out, c->r, c->N * c->D);
}

static void test_embedding(void) {
    const int64_t V = 6, N = 7, D = 5;
    static const int32_t ids[7] = {2, 0, 2, 5, 2, 1, 0}; /* repeats: row 2 three times; rows 3, 4 unused */
    emb_ctx c = {dalloc(N * D), dalloc(V * D), dalloc(N * D), ids, N, D};
    dfill(c.table, V * D, 11, 1.0);
    dfill(c.r, N * D, 12, 1.0);
    emb_obj(&c);
    int ok = 1;
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) ok &= c.out[n * D + j] == c.table[ids[n] * D + j];
    CHECK(ok, "embedding_fwd is not a row copy");
    double *g0 = dalloc(V * D), *g = dalloc(V * D), *fd = dalloc(V * D);
    dfill(g0, V * D, 13, 1.0);
    memcpy(g, g0, (size_t)(V * D) * sizeof(double));
    embedding_bwd_f64(g, c.r, ids, N, D);
    fd_grad(emb_obj, &c, c.table, V * D, fd);
    check_grad("embedding dtable", g0, g, fd, V * D);
    CHECK(g[3 * D] == g0[3 * D] && g[4 * D + 4] == g0[4 * D + 4], "unused rows got gradient");
    /* float vs double */
    float *ft = falloc(V * D), *fr = falloc(N * D), *fg = falloc(V * D), *fo = falloc(N * D);
    to_f(ft, c.table, V * D);
    to_f(fr, c.r, N * D);
    to_d(c.r, fr, N * D);
    memset(g, 0, (size_t)(V * D) * sizeof(double));
    embedding_bwd(CPU_EXEC, fg, fr, ids, N, D);
    embedding_bwd_f64(g, c.r, ids, N, D);
    embedding_fwd(CPU_EXEC, fo, ft, ids, N, D);
    CHECK(rel_fd(fg, g, V * D) <= F32_TOL, "embedding_bwd float vs double");
    CHECK(fo[3 * D + 1] == ft[5 * D + 1], "float embedding_fwd row");
    free(ft), free(fr), free(fg), free(fo), free(g0), free(g), free(fd);
    free(c.out), free(c.table), free(c.r);
}

/* Big enough to run threaded: token order of the scatter-add is kept for 1 and 2 threads. */
static void test_embedding_bwd_deterministic(void) {
    const int64_t V = 50, N = 600, D = 300;
    int32_t *ids = malloc((size_t)N * sizeof(int32_t));
    for (int64_t n = 0; n < N; n++) ids[n] = (int32_t)((n * 7 + n / 3) % V);
    float *dout = falloc(N * D), *g1 = falloc(V * D), *g2 = falloc(V * D);
    t_fill(dout, N * D, 5, 1.0f);
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    embedding_bwd(CPU_EXEC, g1, dout, ids, N, D);
    omp_set_num_threads(2);
    embedding_bwd(CPU_EXEC, g2, dout, ids, N, D);
    omp_set_num_threads(saved);
    CHECK(memcmp(g1, g2, (size_t)(V * D) * sizeof(float)) == 0, "embedding_bwd: 1 vs 2 threads differ");
    /* and it equals the serial sum in token order */
    float s = 0;
    for (int64_t n = 0; n < N; n++)
        if (ids[n] == 3) s += dout[n * D + 17];
    CHECK(g1[3 * D + 17] == s, "embedding_bwd order: %g vs %g", g1[3 * D + 17], s);
    free(ids), free(dout), free(g1), free(g2);
}

/* ---------------------------------------------------------------- RMSNorm */

typedef struct {
    double *y, *rstd, *x, *w, *r;
    int64_t N, D;
    double eps;
} norm_ctx;

static double norm_obj(void *p) {
    norm_ctx *c = p;
    rmsnorm_fwd_f64(c->y, c->rstd, c->x, c->w, c->N, c->D, c->eps);
    return dot_d(c->y, c->r, c->N * c->D);
}

static void rmsnorm_check(int weighted) {
    const int64_t N = 4, D = 9;
    const char *nm = weighted ? "weighted" : "weightless";
    norm_ctx c = {dalloc(N * D), dalloc(N), dalloc(N * D), weighted ? dalloc(D) : NULL, dalloc(N * D), N, D, 1e-6};
    dfill(c.x, N * D, 21, 2.0);
    if (weighted) dfill(c.w, D, 22, 1.5);
    dfill(c.r, N * D, 23, 1.0);
    norm_obj(&c);
    /* forward against the formula */
    double err = 0;
    for (int64_t n = 0; n < N; n++) {
        double ss = 0;
        for (int64_t j = 0; j < D; j++) ss += c.x[n * D + j] * c.x[n * D + j];
        double r = 1 / sqrt(ss / D + c.eps);
        err = fmax(err, fabs(r - c.rstd[n]) / r);
        for (int64_t j = 0; j < D; j++)
            err = fmax(err, fabs(c.x[n * D + j] * r * (weighted ? c.w[j] : 1) - c.y[n * D + j]));
    }
    CHECK(err < 1e-14, "rmsnorm %s fwd vs formula %.3g", nm, err);
    double *dx0 = dalloc(N * D), *dx = dalloc(N * D), *fdx = dalloc(N * D);
    double *dw0 = dalloc(D), *dw = dalloc(D), *fdw = dalloc(D);
    dfill(dx0, N * D, 24, 1.0);
    dfill(dw0, D, 25, 1.0);
    memcpy(dx, dx0, (size_t)(N * D) * sizeof(double));
    memcpy(dw, dw0, (size_t)D * sizeof(double));
    rmsnorm_bwd_f64(dx, weighted ? dw : NULL, c.r, c.x, c.w, c.rstd, N, D);
    fd_grad(norm_obj, &c, c.x, N * D, fdx);
    check_grad(weighted ? "rmsnorm weighted dx" : "rmsnorm weightless dx", dx0, dx, fdx, N * D);
    if (weighted) {
        fd_grad(norm_obj, &c, c.w, D, fdw);
        check_grad("rmsnorm dw", dw0, dw, fdw, D);
    }
    /* float vs double */
    float *fx = falloc(N * D), *fw = falloc(D), *fr = falloc(N * D), *fy = falloc(N * D), *frs = falloc(N);
    float *fdxx = falloc(N * D), *fdww = falloc(D);
    to_f(fx, c.x, N * D);
    if (weighted) to_f(fw, c.w, D);
    to_f(fr, c.r, N * D);
    to_d(c.x, fx, N * D);
    if (weighted) to_d(c.w, fw, D);
    to_d(c.r, fr, N * D);
    norm_obj(&c);
    memset(dx, 0, (size_t)(N * D) * sizeof(double));
    memset(dw, 0, (size_t)D * sizeof(double));
    rmsnorm_bwd_f64(dx, weighted ? dw : NULL, c.r, c.x, c.w, c.rstd, N, D);
    rmsnorm_fwd(CPU_EXEC, fy, frs, fx, weighted ? fw : NULL, N, D, 1e-6f);
    rmsnorm_bwd(CPU_EXEC, fdxx, weighted ? fdww : NULL, fr, fx, weighted ? fw : NULL, frs, N, D);
    CHECK(rel_fd(fy, c.y, N * D) <= F32_TOL, "rmsnorm %s fwd float vs double", nm);
    CHECK(rel_fd(fdxx, dx, N * D) <= F32_TOL, "rmsnorm %s dx float vs double %.3g", nm, rel_fd(fdxx, dx, N * D));
    if (weighted) CHECK(rel_fd(fdww, dw, D) <= F32_TOL, "rmsnorm dw float vs double");
    free(fx), free(fw), free(fr), free(fy), free(frs), free(fdxx), free(fdww);
    free(dx0), free(dx), free(fdx), free(dw0), free(dw), free(fdw);
    free(c.y), free(c.rstd), free(c.x), free(c.w), free(c.r);
}

static void test_rmsnorm_weighted(void) { rmsnorm_check(1); }
static void test_rmsnorm_weightless(void) { rmsnorm_check(0); }

static void test_rmsnorm_deterministic(void) {
    const int64_t N = 300, D = 260; /* threaded; D not a multiple of the column block */
    float *x = falloc(N * D), *w = falloc(D), *dy = falloc(N * D), *y = falloc(N * D), *rs = falloc(N);
    float *dx[2] = {falloc(N * D), falloc(N * D)}, *dw[2] = {falloc(D), falloc(D)};
    t_fill(x, N * D, 1, 3.0f);
    t_fill(w, D, 2, 1.0f);
    t_fill(dy, N * D, 3, 1.0f);
    int saved = omp_get_max_threads();
    for (int t = 0; t < 2; t++) {
        omp_set_num_threads(t + 1);
        rmsnorm_fwd(CPU_EXEC, y, rs, x, w, N, D, 1e-6f);
        rmsnorm_bwd(CPU_EXEC, dx[t], dw[t], dy, x, w, rs, N, D);
    }
    omp_set_num_threads(saved);
    CHECK(memcmp(dx[0], dx[1], (size_t)(N * D) * sizeof(float)) == 0, "rmsnorm dx: 1 vs 2 threads");
    CHECK(memcmp(dw[0], dw[1], (size_t)D * sizeof(float)) == 0, "rmsnorm dw: 1 vs 2 threads");
    free(x), free(w), free(dy), free(y), free(rs), free(dx[0]), free(dx[1]), free(dw[0]), free(dw[1]);
}

/* ---------------------------------------------------------------- RoPE */

/* Flash's compressed-attention rope: rd 64, base 160000, factor 16, original 65536, beta 32/1
 * → low = 15, high = 25 (§4.1): dims up to 15 keep θ, from 25 on θ/16, linear in between. */
static void test_rope_yarn_freqs(void) {
    double th[32], th0[32];
    rope_freqs(th, 64, 160000.0, 16.0, 65536, 32.0, 1.0);
    rope_freqs(th0, 64, 160000.0, 16.0, 0, 32.0, 1.0); /* no YaRN */
    double err = 0;
    for (int i = 0; i < 32; i++) err = fmax(err, fabs(th0[i] - pow(160000.0, -2.0 * i / 64)) / th0[i]);
    CHECK(err < 1e-15, "plain θ_i = base^(-2i/rd): %.3g", err);
    for (int i = 0; i < 32; i++) {
        double ramp = i <= 15 ? 0 : i >= 25 ? 1 : (i - 15) / 10.0;
        double want = th0[i] / 16 * ramp + th0[i] * (1 - ramp);
        CHECK_CLOSE(th[i], want, 1e-14, 0.0);
    }
    CHECK(th[15] == th0[15] && th[14] == th0[14], "dims <= low must keep θ");
    CHECK_CLOSE(th[25], th0[25] / 16, 1e-15, 0.0);
    CHECK_CLOSE(th[20], th0[20] * (0.5 + 0.5 / 16), 1e-15, 0.0);
    /* low is clipped at 0 and high at rd−1: every dim of a tiny original length is fully scaled */
    double ts[4], ts0[4];
    rope_freqs(ts, 8, 10000.0, 4.0, 1, 32.0, 1.0);
    rope_freqs(ts0, 8, 10000.0, 4.0, 0, 32.0, 1.0);
    for (int i = 1; i < 4; i++) CHECK_CLOSE(ts[i], ts0[i] / 4, 1e-15, 0.0);
    CHECK(ts[0] == ts0[0], "low == high (both 0): the widened ramp keeps θ_0, got %g", ts[0]);
    /* high above rd−1 is clipped: low 0, high 9 → 7, so ramp_i = i/7 */
    rope_freqs(ts, 8, 10000.0, 4.0, 1000000000, 1e8, 1.0);
    for (int i = 0; i < 4; i++) CHECK_CLOSE(ts[i], ts0[i] / 4 * (i / 7.0) + ts0[i] * (1 - i / 7.0), 1e-15, 0.0);
}

/* Table entries are cos/sin of pos·θ_i computed in double. */
static void test_rope_table(void) {
    ds4_rope r;
    CHECK(rope_table_init(&r, 8, 50, 10000.0, 4.0, 16, 32.0, 1.0));
    double th[4];
    rope_freqs(th, 8, 10000.0, 4.0, 16, 32.0, 1.0);
    for (int p = 0; p < 50; p += 7)
        for (int i = 0; i < 4; i++) {
            CHECK(r.cos[p * 4 + i] == (float)cos(p * th[i]), "cos p=%d i=%d", p, i);
            CHECK(r.sin[p * 4 + i] == (float)sin(p * th[i]), "sin p=%d i=%d", p, i);
        }
    rope_table_free(&r);
    CHECK(r.cos == NULL && r.sin == NULL);
    ds4_rope bad;
    CHECK(!rope_table_init(&bad, 7, 10, 10000.0, 1.0, 0, 32.0, 1.0), "odd rd accepted");
}

typedef struct {
    double *x, *y, *r;
    int64_t N, H, hd, period, mult;
    const ds4_rope *rope;
    bool inverse;
} rope_ctx;

static double rope_obj(void *p) {
    rope_ctx *c = p;
    int64_t n = c->N * c->H * c->hd;
    memcpy(c->y, c->x, (size_t)n * sizeof(double));
    rope_fwd_f64(c->y, &(rope_args){.N = c->N, .H = c->H, .hd = c->hd, .period = c->period, .mult = c->mult,
        .table = c->rope, .inverse = c->inverse});
    return dot_d(c->y, c->r, n);
}

static void test_rope_fwd_bwd(void) {
    ds4_rope rp;
    CHECK(rope_table_init(&rp, 6, 64, 10000.0, 4.0, 32, 32.0, 1.0));
    const int64_t N = 6, H = 2, hd = 10, n = N * H * hd;
    for (int inv = 0; inv < 2; inv++)
        for (int pm = 0; pm < 2; pm++) {
            /* tokens (period N, mult 1) and compressed entries of ratio 4 (period 3, mult 4) */
            rope_ctx c = {dalloc(n), dalloc(n), dalloc(n), N, H, hd, pm ? 3 : N, pm ? 4 : 1, &rp, inv};
            dfill(c.x, n, 31, 1.0);
            dfill(c.r, n, 32, 1.0);
            rope_obj(&c);
            /* against the formula; the leading hd − rd dims are untouched */
            double err = 0;
            for (int64_t row = 0; row < N; row++) {
                int64_t pos = (row % c.period) * c.mult;
                for (int64_t h = 0; h < H; h++) {
                    const double *x = c.x + (row * H + h) * hd, *y = c.y + (row * H + h) * hd;
                    for (int64_t j = 0; j < hd - 6; j++) err = fmax(err, fabs(x[j] - y[j]));
                    for (int64_t i = 0; i < 3; i++) {
                        double cs = rp.cos[pos * 3 + i], sn = inv ? -rp.sin[pos * 3 + i] : rp.sin[pos * 3 + i];
                        double x0 = x[hd - 6 + 2 * i], x1 = x[hd - 6 + 2 * i + 1];
                        err = fmax(err, fabs(x0 * cs - x1 * sn - y[hd - 6 + 2 * i]));
                        err = fmax(err, fabs(x0 * sn + x1 * cs - y[hd - 6 + 2 * i + 1]));
                    }
                }
            }
            CHECK(err < 1e-15, "rope fwd (inverse %d, period %lld) vs formula %.3g", inv, (long long)c.period, err);
            /* exact adjoint: <rope(x), g> = <x, rope_bwd(CPU_EXEC, g)> */
            double *g = dalloc(n);
            memcpy(g, c.r, (size_t)n * sizeof(double));
            rope_bwd_f64(g, &(rope_args){.N = N, .H = H, .hd = hd, .period = c.period, .mult = c.mult, .table = &rp,
                .inverse = inv});
            double lhs = dot_d(c.y, c.r, n), rhs = dot_d(c.x, g, n);
            CHECK_CLOSE(lhs, rhs, 1e-13, 1.0);
            /* FD of the backward (accumulation is the caller's: rope_bwd works in place) */
            double *fd = dalloc(n), *zero = dalloc(n);
            fd_grad(rope_obj, &c, c.x, n, fd);
            check_grad("rope_bwd", zero, g, fd, n);
            /* inverse(fwd(x)) = x, and float vs double */
            memcpy(g, c.y, (size_t)n * sizeof(double));
            rope_fwd_f64(g, &(rope_args){.N = N, .H = H, .hd = hd, .period = c.period, .mult = c.mult, .table = &rp,
                .inverse = !inv});
            CHECK(rel_d(g, c.x, n) < 1e-6, "rope inverse round trip %.3g", rel_d(g, c.x, n)); /* float table: cos²+sin² = 1 ± 1e-7 */
            float *fx = falloc(n);
            to_f(fx, c.x, n);
            to_d(c.x, fx, n);
            rope_obj(&c);
            rope_fwd(CPU_EXEC, fx, &(rope_args){.N = N, .H = H, .hd = hd, .period = c.period, .mult = c.mult, .table = &rp,
                .inverse = inv});
            CHECK(rel_fd(fx, c.y, n) <= F32_TOL, "rope float vs double");
            free(fx), free(g), free(fd), free(zero), free(c.x), free(c.y), free(c.r);
        }
    rope_table_free(&rp);
}

/* ---------------------------------------------------------------- MoE gate */

static double sqrt_softplus(double l) { return sqrt(l > 20 ? l : log1p(exp(l))); }

typedef struct {
    double *logits, *bias, *scores, *weights, *r;
    int32_t *idx;
    const int64_t *tid2eid;
    const int32_t *ids;
    int64_t N, E, K;
    double R;
} gate_ctx;

static double gate_obj(void *p) {
    gate_ctx *c = p;
    moe_gate_fwd_f64(&(moe_gate_args_f64){.dims = {.N = c->N, .E = c->E, .K = c->K}, .route_scale = c->R,
        .logits = c->logits, .bias = c->bias, .tid2eid = c->tid2eid, .ids = c->ids, .idx = c->idx,
        .weights = c->weights, .scores = c->scores});
    return dot_d(c->weights, c->r, c->N * c->K);
}

/* FD of the gate through the selected experts (selection fixed: logits have gaps ≫ h). */
static void gate_fd_check(gate_ctx *c, const char *what) {
    int64_t NE = c->N * c->E, NK = c->N * c->K;
    gate_obj(c);
    int32_t *idx0 = malloc((size_t)NK * sizeof(int32_t));
    memcpy(idx0, c->idx, (size_t)NK * sizeof(int32_t));
    double *dl0 = dalloc(NE), *dl = dalloc(NE), *fd = dalloc(NE);
    dfill(dl0, NE, 41, 1.0);
    memcpy(dl, dl0, (size_t)NE * sizeof(double));
    moe_gate_bwd_f64(&(moe_gate_args_f64){.dims = {.N = c->N, .E = c->E, .K = c->K}, .route_scale = c->R,
        .logits = c->logits, .scores = c->scores, .idx = c->idx}, &(moe_gate_grads_f64){.dweights = c->r,
        .dlogits = dl});
    fd_grad(gate_obj, c, c->logits, NE, fd);
    gate_obj(c);
    CHECK(memcmp(idx0, c->idx, (size_t)NK * sizeof(int32_t)) == 0, "%s: selection moved under FD", what);
    check_grad(what, dl0, dl, fd, NE);
    /* only selected experts get gradient */
    int leak = 0;
    for (int64_t n = 0; n < c->N; n++)
        for (int64_t e = 0; e < c->E; e++) {
            int sel = 0;
            for (int64_t k = 0; k < c->K; k++) sel |= c->idx[n * c->K + k] == e;
            if (!sel) leak += dl[n * c->E + e] != dl0[n * c->E + e];
        }
    CHECK(leak == 0, "%s: %d unselected logits got gradient", what, leak);
    /* float vs double */
    float *fl = falloc(NE), *fb = falloc(c->E), *fs = falloc(NE), *fw = falloc(NK), *fr = falloc(NK), *fdl = falloc(NE);
    int32_t *fidx = malloc((size_t)NK * sizeof(int32_t));
    to_f(fl, c->logits, NE);
    to_f(fr, c->r, NK);
    if (c->bias) to_f(fb, c->bias, c->E);
    to_d(c->logits, fl, NE);
    to_d(c->r, fr, NK);
    if (c->bias) to_d(c->bias, fb, c->E);
    gate_obj(c);
    memset(dl, 0, (size_t)NE * sizeof(double));
    moe_gate_bwd_f64(&(moe_gate_args_f64){.dims = {.N = c->N, .E = c->E, .K = c->K}, .route_scale = c->R,
        .logits = c->logits, .scores = c->scores, .idx = c->idx}, &(moe_gate_grads_f64){.dweights = c->r,
        .dlogits = dl});
    moe_gate_fwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = c->N, .E = c->E, .K = c->K}, .route_scale = (float)c->R, .logits = fl,
        .bias = c->bias ? fb : NULL, .tid2eid = c->tid2eid, .ids = c->ids, .idx = fidx, .weights = fw, .scores = fs});
    moe_gate_bwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = c->N, .E = c->E, .K = c->K}, .route_scale = (float)c->R, .logits = fl,
        .scores = fs, .idx = fidx}, &(moe_gate_grads){.dweights = fr, .dlogits = fdl});
    CHECK(memcmp(fidx, c->idx, (size_t)NK * sizeof(int32_t)) == 0, "%s: float selection differs", what);
    CHECK(rel_fd(fs, c->scores, NE) <= F32_TOL, "%s: scores float vs double", what);
    CHECK(rel_fd(fw, c->weights, NK) <= F32_TOL, "%s: weights float vs double", what);
    CHECK(rel_fd(fdl, dl, NE) <= F32_TOL, "%s: dlogits float vs double %.3g", what, rel_fd(fdl, dl, NE));
    free(fl), free(fb), free(fs), free(fw), free(fr), free(fdl), free(fidx);
    free(idx0), free(dl0), free(dl), free(fd);
}

static gate_ctx gate_new(int64_t N, int64_t E, int64_t K, double R) {
    gate_ctx c = {dalloc(N * E), NULL, dalloc(N * E), dalloc(N * K), dalloc(N * K),
                  malloc((size_t)(N * K) * sizeof(int32_t)), NULL, NULL, N, E, K, R};
    /* distinct logits per row (a permutation scaled, plus noise) so top-K has clear gaps */
    for (int64_t n = 0; n < N; n++)
        for (int64_t e = 0; e < E; e++) c.logits[n * E + e] = 0.37 * (double)((e * 3 + n * 5) % E) - 2.0;
    c.logits[0] = 23.0;         /* above the softplus threshold */
    c.logits[E + 1] = -30.0;    /* deep in the exp tail */
    dfill(c.r, N * K, 42, 1.0);
    return c;
}
static void gate_free(gate_ctx *c) {
    free(c->logits), free(c->bias), free(c->scores), free(c->weights), free(c->r), free(c->idx);
}

static void test_moe_gate_topk(void) {
    gate_ctx c = gate_new(5, 11, 3, 1.5);
    gate_obj(&c);
    for (int64_t n = 0; n < c.N; n++) {
        double S = 0;
        for (int64_t e = 0; e < c.E; e++)
            CHECK_CLOSE(c.scores[n * c.E + e], sqrt_softplus(c.logits[n * c.E + e]), 1e-15, 1e-300);
        /* brute force: expert e is selected iff fewer than K experts beat it */
        for (int64_t k = 0; k < c.K; k++) {
            int64_t e = c.idx[n * c.K + k], beat = 0;
            for (int64_t f = 0; f < c.E; f++) beat += c.logits[n * c.E + f] > c.logits[n * c.E + e];
            CHECK(beat == k, "row %lld: slot %lld holds expert %lld with %lld better", (long long)n, (long long)k,
                  (long long)e, (long long)beat);
            S += c.scores[n * c.E + e];
        }
        for (int64_t k = 0; k < c.K; k++)
            CHECK_CLOSE(c.weights[n * c.K + k], c.scores[n * c.E + c.idx[n * c.K + k]] / S * 1.5, 1e-15, 0.0);
    }
    gate_fd_check(&c, "moe_gate topk dlogits");
    gate_free(&c);
}

/* Equal scores: the lower expert id wins, whether the tie is first, last or in the middle. */
static void test_moe_gate_ties(void) {
    const int64_t E = 8, K = 3;
    float logits[8] = {0.5f, 1.0f, 2.0f, 1.0f, 2.0f, 1.0f, 0.1f, 2.0f};
    float scores[8], w[3];
    int32_t idx[3];
    moe_gate_fwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = 1, .E = E, .K = K}, .route_scale = 1.0f, .logits = logits, .idx = idx,
        .weights = w, .scores = scores});
    CHECK(idx[0] == 2 && idx[1] == 4 && idx[2] == 7, "ties at the top: %d %d %d", idx[0], idx[1], idx[2]);
    float l2[8] = {3.0f, 1.0f, 1.0f, 0.0f, 1.0f, 1.0f, 1.0f, -1.0f};
    moe_gate_fwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = 1, .E = E, .K = K}, .route_scale = 1.0f, .logits = l2, .idx = idx,
        .weights = w, .scores = scores});
    CHECK(idx[0] == 0 && idx[1] == 1 && idx[2] == 2, "ties at the boundary: %d %d %d", idx[0], idx[1], idx[2]);
    CHECK(w[1] == w[2] && fabsf(w[0] + w[1] + w[2] - 1.0f) < 1e-6f, "weights of tied experts");
}

/* The bias changes which experts are chosen, never the weights' values. */
static void test_moe_gate_bias_selects_only(void) {
    gate_ctx c = gate_new(4, 10, 2, 2.5);
    c.bias = dalloc(c.E);
    for (int64_t e = 0; e < c.E; e++) c.bias[e] = 0.01 * (double)e;
    c.bias[6] = 100.0; /* expert 6 always chosen, whatever its score */
    gate_obj(&c);
    for (int64_t n = 0; n < c.N; n++) {
        int has6 = 0;
        double S = 0;
        for (int64_t k = 0; k < c.K; k++) {
            has6 |= c.idx[n * c.K + k] == 6;
            S += c.scores[n * c.E + c.idx[n * c.K + k]];
        }
        CHECK(has6, "row %lld: bias did not select expert 6", (long long)n);
        CHECK(c.idx[n * c.K] == 6, "row %lld: biased expert not first", (long long)n);
        for (int64_t k = 0; k < c.K; k++) {
            int64_t e = c.idx[n * c.K + k];
            CHECK_CLOSE(c.weights[n * c.K + k], sqrt_softplus(c.logits[n * c.E + e]) / S * 2.5, 1e-14, 0.0);
        }
    }
    /* the second choice is the best of score + bias among the rest */
    for (int64_t n = 0; n < c.N; n++) {
        int64_t best = -1;
        for (int64_t e = 0; e < c.E; e++)
            if (e != 6 && (best < 0 || c.scores[n * c.E + e] + c.bias[e] > c.scores[n * c.E + best] + c.bias[best]))
                best = e;
        CHECK(c.idx[n * c.K + 1] == best, "row %lld second choice %d, want %lld", (long long)n, c.idx[n * c.K + 1],
              (long long)best);
    }
    gate_fd_check(&c, "moe_gate biased dlogits");
    gate_free(&c);
}

static void test_moe_gate_hash(void) {
    const int64_t V = 5;
    gate_ctx c = gate_new(6, 7, 3, 1.5);
    static const int64_t tid2eid[5 * 3] = {0, 1, 2, 6, 5, 4, 3, 0, 6, 2, 4, 1, 5, 3, 0};
    static const int32_t ids[6] = {4, 1, 1, 0, 3, 2};
    c.tid2eid = tid2eid;
    c.ids = ids;
    gate_obj(&c);
    for (int64_t n = 0; n < c.N; n++) {
        double S = 0;
        for (int64_t k = 0; k < c.K; k++) {
            CHECK(c.idx[n * c.K + k] == tid2eid[ids[n] * c.K + k], "hash idx row %lld", (long long)n);
            S += c.scores[n * c.E + c.idx[n * c.K + k]];
        }
        for (int64_t k = 0; k < c.K; k++)
            CHECK_CLOSE(c.weights[n * c.K + k], c.scores[n * c.E + c.idx[n * c.K + k]] / S * 1.5, 1e-15, 0.0);
    }
    CHECK(V == 5);
    gate_fd_check(&c, "moe_gate hash dlogits");
    gate_free(&c);
}

/* ---------------------------------------------------------------- SwiGLU */

typedef struct {
    double *act, *g, *u, *r;
    int64_t N, I;
    double limit;
} swi_ctx;

static double swi_obj(void *p) {
    swi_ctx *c = p;
    swiglu_fwd_f64(c->act, c->g, c->u, c->N, c->I, c->limit);
    return dot_d(c->act, c->r, c->N * c->I);
}

static double silu(double x) { return x / (1 + exp(-x)); }

static void swiglu_check(double limit) {
    const int64_t N = 3, I = 8, n = N * I;
    swi_ctx c = {dalloc(n), dalloc(n), dalloc(n), dalloc(n), N, I, limit};
    dfill(c.g, n, 51, 3.0);
    dfill(c.u, n, 52, 3.0);
    dfill(c.r, n, 53, 1.0);
    if (limit > 0) { /* near and beyond the clamp, at least 1e-3 from the kinks */
        static const double gs[] = {1.3, 0.998, 1.002, 1.5, 7.0, -0.5};
        static const double us[] = {-1.3, 0.999, -1.004, -0.997, 1.2, 5.0};
        for (int i = 0; i < 6; i++) {
            c.g[i * 4] = gs[i] * limit;
            c.u[i * 4 + 1] = us[i] * limit;
        }
    }
    swi_obj(&c);
    double err = 0;
    for (int64_t t = 0; t < n; t++) {
        double gc = c.g[t], uc = c.u[t];
        if (limit > 0) gc = fmin(gc, limit), uc = fmax(-limit, fmin(uc, limit));
        err = fmax(err, fabs(silu(gc) * uc - c.act[t]));
    }
    CHECK(err < 1e-14, "swiglu fwd (limit %g) vs formula %.3g", limit, err);
    double *dg0 = dalloc(n), *du0 = dalloc(n), *dg = dalloc(n), *du = dalloc(n), *fdg = dalloc(n), *fdu = dalloc(n);
    dfill(dg0, n, 54, 1.0);
    dfill(du0, n, 55, 1.0);
    memcpy(dg, dg0, (size_t)n * sizeof(double));
    memcpy(du, du0, (size_t)n * sizeof(double));
    swiglu_bwd_f64(dg, du, c.r, c.g, c.u, N, I, limit);
    fd_grad(swi_obj, &c, c.g, n, fdg);
    fd_grad(swi_obj, &c, c.u, n, fdu);
    check_grad(limit > 0 ? "swiglu dg (clamped)" : "swiglu dg", dg0, dg, fdg, n);
    check_grad(limit > 0 ? "swiglu du (clamped)" : "swiglu du", du0, du, fdu, n);
    if (limit > 0) {
        int nclamp = 0, leak = 0;
        for (int64_t t = 0; t < n; t++) {
            if (c.g[t] > limit) nclamp++, leak += dg[t] != dg0[t];
            if (fabs(c.u[t]) > limit) nclamp++, leak += du[t] != du0[t];
        }
        CHECK(nclamp >= 6 && leak == 0, "clamped elements: %d, with gradient: %d", nclamp, leak);
    }
    /* float vs double, with the NULL-skips */
    float *fg = falloc(n), *fu = falloc(n), *fr = falloc(n), *fa = falloc(n), *fdgg = falloc(n), *fduu = falloc(n);
    to_f(fg, c.g, n);
    to_f(fu, c.u, n);
    to_f(fr, c.r, n);
    to_d(c.g, fg, n);
    to_d(c.u, fu, n);
    to_d(c.r, fr, n);
    swi_obj(&c);
    memset(dg, 0, (size_t)n * sizeof(double));
    memset(du, 0, (size_t)n * sizeof(double));
    swiglu_bwd_f64(dg, du, c.r, c.g, c.u, N, I, limit);
    swiglu_fwd(CPU_EXEC, fa, fg, fu, N, I, (float)limit);
    swiglu_bwd(CPU_EXEC, fdgg, NULL, fr, fg, fu, N, I, (float)limit);
    swiglu_bwd(CPU_EXEC, NULL, fduu, fr, fg, fu, N, I, (float)limit);
    CHECK(rel_fd(fa, c.act, n) <= F32_TOL, "swiglu fwd float vs double");
    CHECK(rel_fd(fdgg, dg, n) <= F32_TOL, "swiglu dg float vs double");
    CHECK(rel_fd(fduu, du, n) <= F32_TOL, "swiglu du float vs double");
    free(fg), free(fu), free(fr), free(fa), free(fdgg), free(fduu);
    free(dg0), free(du0), free(dg), free(du), free(fdg), free(fdu);
    free(c.act), free(c.g), free(c.u), free(c.r);
}

static void test_swiglu_clamped(void) { swiglu_check(2.0); }
static void test_swiglu_unclamped(void) { swiglu_check(0.0); }

/* ---------------------------------------------------------------- cross-entropy */

typedef struct {
    double *logits;
    const int32_t *targets;
    int64_t N, V;
    double gs;
} ce_ctx;

static double ce_obj(void *p) {
    ce_ctx *c = p;
    double loss;
    int64_t cnt;
    cross_entropy_fwd_bwd_f64(&loss, &cnt, NULL, c->logits, c->targets, c->N, c->V, c->gs);
    return c->gs * loss;
}

static void test_cross_entropy(void) {
    const int64_t N = 5, V = 7;
    static const int32_t targets[5] = {3, -1, 0, 6, -1};
    ce_ctx c = {dalloc(N * V), targets, N, V, 0.25};
    dfill(c.logits, N * V, 61, 3.0);
    for (int64_t v = 0; v < V; v++) c.logits[2 * V + v] += 1000.0; /* stable under a huge offset */
    double loss;
    int64_t cnt;
    double *dl = dalloc(N * V), *fd = dalloc(N * V), *zero = dalloc(N * V);
    for (int64_t i = 0; i < N * V; i++) dl[i] = 99.0; /* overwritten, not accumulated */
    cross_entropy_fwd_bwd_f64(&loss, &cnt, dl, c.logits, targets, N, V, c.gs);
    double want = 0;
    for (int64_t n = 0; n < N; n++) {
        if (targets[n] < 0) continue;
        double m = c.logits[n * V], s = 0;
        for (int64_t v = 0; v < V; v++) m = fmax(m, c.logits[n * V + v]);
        for (int64_t v = 0; v < V; v++) s += exp(c.logits[n * V + v] - m);
        want += m + log(s) - c.logits[n * V + targets[n]];
    }
    CHECK(cnt == 3, "n_scored %lld", (long long)cnt);
    CHECK_CLOSE(loss, want, 1e-13, 0.0);
    int zero_rows = 1;
    for (int64_t v = 0; v < V; v++) zero_rows &= dl[V + v] == 0 && dl[4 * V + v] == 0;
    CHECK(zero_rows, "ignored rows must get zero gradient");
    fd_grad(ce_obj, &c, c.logits, N * V, fd);
    check_grad("cross_entropy dlogits", zero, dl, fd, N * V);
    /* float vs double */
    float *fl = falloc(N * V), *fdl = falloc(N * V);
    to_f(fl, c.logits, N * V);
    to_d(c.logits, fl, N * V);
    cross_entropy_fwd_bwd_f64(&loss, &cnt, dl, c.logits, targets, N, V, c.gs);
    double floss;
    int64_t fcnt;
    cross_entropy_fwd_bwd(CPU_EXEC, &floss, &fcnt, fdl, fl, targets, N, V, 0.25f);
    CHECK(fcnt == cnt);
    CHECK_CLOSE(floss, loss, F32_TOL, 0.0);
    CHECK(rel_fd(fdl, dl, N * V) <= F32_TOL, "cross_entropy dlogits float vs double %.3g", rel_fd(fdl, dl, N * V));
    double nl;
    cross_entropy_fwd_bwd(CPU_EXEC, &nl, &fcnt, NULL, fl, targets, N, V, 0.25f);
    CHECK(nl == floss, "loss without gradient differs: %.17g vs %.17g", nl, floss);
    free(fl), free(fdl), free(dl), free(fd), free(zero), free(c.logits);
}

static void test_cross_entropy_deterministic(void) {
    const int64_t N = 130, V = 400;
    float *l = falloc(N * V), *d1 = falloc(N * V), *d2 = falloc(N * V);
    int32_t *t = malloc((size_t)N * sizeof(int32_t));
    t_fill(l, N * V, 71, 4.0f);
    for (int64_t n = 0; n < N; n++) t[n] = n % 9 == 0 ? -1 : (int32_t)((n * 37) % V);
    double s1, s2;
    int64_t c1, c2;
    int saved = omp_get_max_threads();
    omp_set_num_threads(1);
    cross_entropy_fwd_bwd(CPU_EXEC, &s1, &c1, d1, l, t, N, V, 1.0f / 115);
    omp_set_num_threads(2);
    cross_entropy_fwd_bwd(CPU_EXEC, &s2, &c2, d2, l, t, N, V, 1.0f / 115);
    omp_set_num_threads(saved);
    CHECK(c1 == 115 && c2 == 115, "n_scored %lld %lld", (long long)c1, (long long)c2);
    CHECK(s1 == s2, "loss 1 vs 2 threads: %.17g vs %.17g", s1, s2);
    CHECK(memcmp(d1, d2, (size_t)(N * V) * sizeof(float)) == 0, "dlogits 1 vs 2 threads differ");
    /* each scored row of the gradient sums to zero (softmax − onehot) */
    double worst = 0;
    for (int64_t n = 0; n < N; n++) {
        double s = 0;
        for (int64_t v = 0; v < V; v++) s += d1[n * V + v];
        worst = fmax(worst, fabs(s));
    }
    CHECK(worst < 1e-7, "row sums of dlogits: %.3g", worst);
    /* in place (dlogits == logits, as the head's backward runs it): the same gradient bits and loss */
    double s3;
    int64_t c3;
    cross_entropy_fwd_bwd(CPU_EXEC, &s3, &c3, l, l, t, N, V, 1.0f / 115);
    CHECK(c3 == 115 && s3 == s1, "in place: loss %.17g vs %.17g", s3, s1);
    CHECK(memcmp(l, d1, (size_t)(N * V) * sizeof(float)) == 0, "in place: dlogits differ");
    free(l), free(d1), free(d2), free(t);
}

/* The serial GEMMs (what sparse attention's query blocks run): the driver's bits in fp32, in a buffer of
 * exactly cpu_gemm_serial_bytes (a canary after it stays intact), from inside a parallel region where
 * each thread computes its own product. */
static void test_gemm_serial(void) {
    static const int64_t SH[][3] = {{16, 64, 128}, {64, 128, 16}, {256, 143, 128}, {143, 128, 256}, {1, 1, 1},
                                    {15, 33, 257}, {225, 513, 520}, {2, 8200, 7}};
    static gemm_serial_signature *const SER[] = {cpu_gemm_serial_nt, cpu_gemm_serial_nn, cpu_gemm_serial_tn};
    const int64_t nsh = (int64_t)(sizeof SH / sizeof *SH);
    int bad[3 * 8] = {0};
#pragma omp parallel for schedule(dynamic, 1) num_threads(2)
    for (int64_t x = 0; x < 3 * nsh; x++) {
        int op = (int)(x % 3);
        int64_t M = SH[x / 3][0], N = SH[x / 3][1], K = SH[x / 3][2], ar, ac, br, bc;
        ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
        float *A = falloc(ar * ac), *B = falloc(br * bc), *c1 = falloc(M * N), *c2 = falloc(M * N);
        t_fill(A, ar * ac, (unsigned)(x + 3), 1.0f);
        t_fill(B, br * bc, (unsigned)(x + 4), 1.0f);
        t_fill(c1, M * N, 5, 1.0f);
        memcpy(c2, c1, (size_t)(M * N) * sizeof(float));
        size_t wb = cpu_gemm_serial_bytes(M, N, K);
        unsigned char *ws = malloc(wb + 64);
        memset(ws + wb, 0xA5, 64);
        SER[op](DS4_MATMUL_FP32, ws, M, N, K, A, ac, B, bc, c1, N, x % 2 ? 1.0f : 0.0f);
#pragma omp critical
        gemm_op(CPU_EXEC, op, M, N, K, A, ac, B, bc, c2, N, x % 2 ? 1.0f : 0.0f);
        int canary = 0;
        for (int i = 0; i < 64; i++) canary += ws[wb + i] != 0xA5;
        bad[x] = (memcmp(c1, c2, (size_t)(M * N) * sizeof(float)) != 0) | (canary ? 2 : 0);
        free(ws), free(A), free(B), free(c1), free(c2);
    }
    for (int64_t x = 0; x < 3 * nsh; x++)
        CHECK(!bad[x], "%s serial gemm_%s %lldx%lldx%lld: %s", ds4_isa_name(ds4_isa_current()), OP_NAME[x % 3],
              (long long)SH[x / 3][0], (long long)SH[x / 3][1], (long long)SH[x / 3][2],
              bad[x] & 1 ? "bits differ from the driver" : "wrote past its buffer");
}

/* The fp32 GEMM tests on every ISA level this CPU runs (each level's engine: avx512 14×32, avx2 6×16,
 * generic = the reference); levels the CPU lacks are reported as skipped. */
static void test_gemm_every_engine(void) {
    ds4_isa was = ds4_isa_current();
    for (int i = DS4_ISA_COUNT - 1; i >= 0; i--) {
        if (ds4_isa_select((ds4_isa)i) != DS4_OK) {
            t_note("test_kernels_basic: SKIP gemm at level %s: %s", ds4_isa_name((ds4_isa)i), ds4_errmsg());
            continue;
        }
        const gemm_engine *e = cpu_engines_active()->gemm_f32;
        t_note("test_kernels_basic: gemm at level %s: %s", ds4_isa_name((ds4_isa)i), e ? e->name : "reference");
        RUN(test_gemm_edge_shapes);
        RUN(test_gemm_degenerate);
        RUN(test_gemm_deterministic_threads);
        RUN(test_gemm_ops_agree);
        RUN(test_gemm_serial);
    }
    if (ds4_isa_select(was) != DS4_OK) t_failed++, t_note("  FAIL restoring the ISA level: %s", ds4_errmsg());
}

int main(void) {
    test_gemm_every_engine();
    RUN(test_linear);
    RUN(test_grouped_linear);
    RUN(test_embedding);
    RUN(test_embedding_bwd_deterministic);
    RUN(test_rmsnorm_weighted);
    RUN(test_rmsnorm_weightless);
    RUN(test_rmsnorm_deterministic);
    RUN(test_rope_yarn_freqs);
    RUN(test_rope_table);
    RUN(test_rope_fwd_bwd);
    RUN(test_moe_gate_topk);
    RUN(test_moe_gate_ties);
    RUN(test_moe_gate_bias_selects_only);
    RUN(test_moe_gate_hash);
    RUN(test_swiglu_clamped);
    RUN(test_swiglu_unclamped);
    RUN(test_cross_entropy);
    RUN(test_cross_entropy_deterministic);
    TEST_MAIN_END("test_kernels_basic");
}
