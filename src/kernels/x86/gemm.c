/* Fast fp32 GEMM for x86 with AVX-512 (same signatures and semantics as the reference gemms).
 *
 * Layout (the classic five loops): for each NC-wide column block of C and each KC-deep slice of K,
 * B's slice is packed once into NR-wide panels [kc][NR]; the output is cut into tasks (MC rows ×
 * up to NT columns) shared among the threads; a task packs its MC×kc slice of A into MR-tall
 * panels [kc][MR] and runs the MR×NR register-tile microkernel over its panels.
 *
 * Determinism: C[i,j] = beta·C[i,j] + Σ over K slices of (FMA chain over the slice, k ascending),
 * slices added in order. The K slicing is fixed (KC), so every element gets the same operations in
 * the same order whichever thread computes it and whatever the thread count or tile position.
 * Rounding differs from the reference (FMA, slice partial sums), not its meaning. */
#include <immintrin.h>
#include <omp.h>
#include <string.h>

#include "ds4/core.h"
#include "kernels/kernels.h"

/* The kernels are compiled for AVX-512 whatever the build flags (the sanitizer build drops
 * -march=native); the public entry points below check the CPU at run time. */
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,fma")

#define MR 14         /* register tile rows: 14×2 zmm accumulators + 2 B vectors */
#define NR 32         /* register tile columns: two zmm */
#define KC 256        /* K slice depth; fixes the summation order (do not tune per thread count) */
#define MC (MR * 16)  /* rows per task at most: the packed A block (224×256 floats) lives in L2 */
#define NT (NR * 16)  /* columns per task at most */
#define NC (NR * 256) /* columns of B packed per slice (8192: 8 MB at KC = 256) */
#define PAR_MIN ((int64_t)1 << 20) /* below this many multiply-adds, one thread */

/* A strided matrix view: element (r, c) at p[r·rs + c·cs]. */
typedef struct {
    const float *p;
    int64_t rs, cs;
} view;

/* ---------------------------------------------------------------- packing */

static __mmask16 lanes(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* In-register transpose: r[a] holds row a (16 floats); afterwards r[c] holds column c. Three rounds:
 * 32-bit interleave of row pairs, 64-bit interleave of pair pairs (u[4i+j] lane L = column 4L+j of
 * rows 4i..4i+3), then a 4×4 transpose of the 128-bit lanes. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    for (int i = 0; i < 4; i++) {
        __m512d a = _mm512_castps_pd(t[4 * i]), b = _mm512_castps_pd(t[4 * i + 1]);
        __m512d c = _mm512_castps_pd(t[4 * i + 2]), d = _mm512_castps_pd(t[4 * i + 3]);
        r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
        r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
        r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
        r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
    }
    for (int j = 0; j < 4; j++) {
        __m512 s0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44), s1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
        __m512 s2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
        __m512 s3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
        t[j] = _mm512_shuffle_f32x4(s0, s2, 0x88);
        t[4 + j] = _mm512_shuffle_f32x4(s0, s2, 0xDD);
        t[8 + j] = _mm512_shuffle_f32x4(s1, s3, 0x88);
        t[12 + j] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* dst[k·ld + c] (c < 16, k < kc) = src[c·stride + k] for c < nrows, 0 for the other c: 16-row
 * blocks of a matrix whose rows are contiguous runs over k, transposed 16×16 at a time. */
static void pack_transposed(float *dst, int64_t ld, __mmask16 store_mask, const float *src, int64_t stride,
                            int64_t nrows, int64_t kc) {
    for (int64_t k = 0; k < kc; k += 16) {
        __mmask16 m = lanes(kc - k);
        __m512 r[16];
        for (int64_t a = 0; a < 16; a++)
            r[a] = a < nrows ? _mm512_maskz_loadu_ps(m, src + a * stride + k) : _mm512_setzero_ps();
        transpose16(r);
        for (int64_t c = 0; c < 16 && k + c < kc; c++) _mm512_mask_storeu_ps(dst + (k + c) * ld, store_mask, r[c]);
    }
}

/* dst: [kc][MR] = A rows [i0, i0+mr) × columns [k0, k0+kc), rows >= mr zero. */
static void pack_a(float *dst, view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    if (A.cs == 1) { /* rows contiguous in k (gemm_nt, gemm_nn) */
        pack_transposed(dst, MR, lanes(MR), A.p + i0 * A.rs + k0, A.rs, mr, kc);
    } else { /* A stored transposed (gemm_tn, rs == 1): each k holds a contiguous run over i */
        __mmask16 m = lanes(mr);
        for (int64_t k = 0; k < kc; k++)
            _mm512_mask_storeu_ps(dst + k * MR, lanes(MR), _mm512_maskz_loadu_ps(m, A.p + (k0 + k) * A.cs + i0));
    }
}

/* dst: [kc][NR] = B rows [k0, k0+kc) × columns [j0, j0+nr) (B viewed as K×N), columns >= nr zero. */
static void pack_b(float *dst, view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    if (B.cs == 1) { /* rows of B contiguous in j (gemm_nn, gemm_tn) */
        __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
        for (int64_t k = 0; k < kc; k++) {
            const float *src = B.p + (k0 + k) * B.rs + j0;
            _mm512_store_ps(dst + k * NR, _mm512_maskz_loadu_ps(m0, src));
            _mm512_store_ps(dst + k * NR + 16, _mm512_maskz_loadu_ps(m1, src + 16));
        }
    } else { /* B^T stored (gemm_nt, rs == 1): each column j is a contiguous run over k */
        const float *src = B.p + j0 * B.cs + k0;
        pack_transposed(dst, NR, 0xFFFF, src, B.cs, nr, kc);
        pack_transposed(dst + 16, NR, 0xFFFF, src + 16 * B.cs, B.cs, nr - 16, kc);
    }
}

/* ---------------------------------------------------------------- microkernel */

/* One C row of the tile: C = acc (cscale 0), C + acc (1), or cscale·C + acc. */
static inline void store_row(float *c, __m512 lo, __m512 hi, __mmask16 m0, __mmask16 m1, float cscale) {
    if (cscale != 0) {
        __m512 c0 = _mm512_maskz_loadu_ps(m0, c), c1 = _mm512_maskz_loadu_ps(m1, c + 16);
        if (cscale != 1) {
            __m512 s = _mm512_set1_ps(cscale);
            c0 = _mm512_mul_ps(s, c0);
            c1 = _mm512_mul_ps(s, c1);
        }
        lo = _mm512_add_ps(c0, lo);
        hi = _mm512_add_ps(c1, hi);
    }
    _mm512_mask_storeu_ps(c, m0, lo);
    _mm512_mask_storeu_ps(c + 16, m1, hi);
}

#define ACC_DECL(i) __m512 c##i##l = _mm512_setzero_ps(), c##i##h = _mm512_setzero_ps();
#define ACC_FMA(i)                                      \
    {                                                   \
        __m512 ai = _mm512_set1_ps(a[i]);               \
        c##i##l = _mm512_fmadd_ps(ai, b0, c##i##l);     \
        c##i##h = _mm512_fmadd_ps(ai, b1, c##i##h);     \
    }
#define ACC_STORE(i) \
    if (i < mr) store_row(C + i * ldc, c##i##l, c##i##h, m0, m1, cscale);
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)

/* C tile [mr ≤ MR, nr ≤ NR] (row stride ldc) ⊕= a[kc][MR] · b[kc][NR]. */
static void kernel_14x32(int64_t kc, const float *restrict a, const float *restrict b, float *C, int64_t ldc,
                         int64_t mr, int64_t nr, float cscale) {
    ROWS(ACC_DECL)
    for (int64_t k = 0; k < kc; k++) {
        __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
        ROWS(ACC_FMA)
        a += MR;
        b += NR;
    }
    __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
    ROWS(ACC_STORE)
}

/* ---------------------------------------------------------------- driver */

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Task shape: start from MC rows × NT columns and shrink (columns first, then rows) until there
 * are at least 4 tasks per thread, so threads stay balanced on skinny outputs. Only the split of
 * the work changes, never the arithmetic of an element. */
static void task_shape(int64_t M, int64_t N, int nth, int64_t *mc, int64_t *nt) {
    *mc = MC;
    *nt = NT;
    if (nth <= 1) return;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *nt > 2 * NR) *nt /= 2;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *mc > 4 * MR) *mc = MR * (*mc / MR / 2);
}

/* Packing workspace reserved for a model's lifetime: GEMMs inside a pass then allocate nothing, so a
 * pass's memory (and memplan's prediction of it) does not depend on the routing of tokens to experts.
 * Sized for the largest slice (KC × NC of B, KC × MC of A per thread). */
static struct {
    float *bp, *ap;
    int threads;
    int refs;
    bool shape_only; /* reserved in shape-only mode: counted, no memory behind it */
} g_ws;

void gemm_workspace_reserve(void) {
    if (g_ws.refs++ > 0) return;
    g_ws.threads = omp_get_max_threads();
    g_ws.shape_only = ds4_shape_only();
    g_ws.bp = ds4_alloc(DS4_MEM_WORK, (size_t)KC * NC * sizeof(float));
    g_ws.ap = ds4_alloc(DS4_MEM_WORK, (size_t)g_ws.threads * KC * MC * sizeof(float));
}

void gemm_workspace_release(void) {
    if (g_ws.refs <= 0 || --g_ws.refs > 0) return;
    ds4_free(g_ws.bp);
    ds4_free(g_ws.ap);
    memset(&g_ws, 0, sizeof g_ws);
}

static bool workspace_usable(int nth) {
    return g_ws.bp && g_ws.ap && nth <= g_ws.threads && g_ws.shape_only == ds4_shape_only() && !omp_in_parallel();
}

/* C[M,N] = beta·C + A·B with A viewed M×K and B viewed K×N. Returns false (nothing written) when
 * the packing buffers cannot be allocated. */
static bool gemm_fast(int64_t M, int64_t N, int64_t K, view A, view B, float *C, int64_t ldc, float beta) {
    if (M <= 0 || N <= 0) return true;
    if (K <= 0 && ds4_shape_only()) return true;
    if (K <= 0) { /* empty sum: C = beta·C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0 ? 0 : beta * C[i * ldc + j];
        return true;
    }
    int nth = omp_in_parallel() || M * N * K < PAR_MIN ? 1 : omp_get_max_threads();
    int64_t nc_max = min64(N, NC), kc_max = min64(K, KC), mc, nt;
    task_shape(M, nc_max, nth, &mc, &nt);
    if (nth > cdiv(M, mc) * cdiv(nc_max, nt)) nth = (int)(cdiv(M, mc) * cdiv(nc_max, nt));
    int64_t ap_len = kc_max * cdiv(min64(M, mc), MR) * MR; /* floats of packed A per thread */
    float *bp, *ap;
    bool pooled = workspace_usable(nth);
    if (pooled) {
        bp = g_ws.bp;
        ap = g_ws.ap;
        ap_len = KC * MC; /* the pool's per-thread stride */
    } else {
        bp = ds4_alloc(DS4_MEM_WORK, (size_t)(kc_max * cdiv(nc_max, NR) * NR) * sizeof(float));
        ap = ds4_alloc(DS4_MEM_WORK, (size_t)nth * (size_t)ap_len * sizeof(float));
    }
    if (!bp || !ap || ds4_shape_only()) { /* shape-only: the buffers were counted, nothing is computed */
        bool ok = bp && ap;
        if (!pooled) {
            ds4_free(bp);
            ds4_free(ap);
        }
        return ok;
    }
#pragma omp parallel num_threads(nth)
    {
        float *apt = ap + (size_t)omp_get_thread_num() * (size_t)ap_len;
        for (int64_t jc = 0; jc < N; jc += NC) {
            int64_t nc = min64(NC, N - jc), npan = cdiv(nc, NR), ntn = cdiv(nc, nt), ntasks = cdiv(M, mc) * ntn;
            for (int64_t pc = 0; pc < K; pc += KC) {
                int64_t kc = min64(KC, K - pc);
                float cscale = pc == 0 ? beta : 1;
                /* B slice: bp [npan][kc][NR] */
#pragma omp for schedule(static)
                for (int64_t p = 0; p < npan; p++)
                    pack_b(bp + p * kc * NR, B, pc, kc, jc + p * NR, min64(NR, nc - p * NR));
                /* tasks in row-block-major order; a thread keeps its packed A block while it
                 * takes tasks of the same row block. Dynamic: a descheduled thread does not hold
                 * the others back (results do not depend on who computes a task). */
                int64_t packed_ib = -1;
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < ntasks; t++) {
                    int64_t ib = t / ntn, jt = t % ntn;
                    int64_t i0 = ib * mc, mcur = min64(mc, M - i0);
                    if (ib != packed_ib) { /* A block: apt [mcur/MR][kc][MR] */
                        for (int64_t ir = 0; ir < mcur; ir += MR)
                            pack_a(apt + ir * kc, A, i0 + ir, min64(MR, mcur - ir), pc, kc);
                        packed_ib = ib;
                    }
                    int64_t j_end = min64(nc, (jt + 1) * nt);
                    for (int64_t jr = jt * nt; jr < j_end; jr += NR) {
                        const float *b = bp + (jr / NR) * kc * NR;
                        for (int64_t ir = 0; ir < mcur; ir += MR)
                            kernel_14x32(kc, apt + ir * kc, b, C + (i0 + ir) * ldc + jc + jr, ldc,
                                         min64(MR, mcur - ir), min64(NR, j_end - jr), cscale);
                    }
                }
            }
        }
    }
    if (!pooled) {
        ds4_free(bp);
        ds4_free(ap);
    }
    return true;
}

#pragma GCC pop_options

/* A CPU without AVX-512 runs the reference loops. */
static bool have_avx512(void) { return __builtin_cpu_supports("avx512f"); }

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T */
void gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    if (!have_avx512() || !gemm_fast(M, N, K, (view){A, lda, 1}, (view){B, 1, ldb}, C, ldc, beta))
        gemm_nt_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N] */
void gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    if (!have_avx512() || !gemm_fast(M, N, K, (view){A, lda, 1}, (view){B, ldb, 1}, C, ldc, beta))
        gemm_nn_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[K,M]^T · B[K,N] */
void gemm_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    if (!have_avx512() || !gemm_fast(M, N, K, (view){A, 1, lda}, (view){B, ldb, 1}, C, ldc, beta))
        gemm_tn_ref(M, N, K, A, lda, B, ldb, C, ldc, beta);
}
