/* Fast fp32 GEMM for x86 with AVX-512 (same signatures and semantics as the reference gemms), and
 * the blocked driver that also runs the bf16 AMX engine of gemm_amx.c when the matmul precision is
 * bf16 (ds4_set_matmul_precision; the engine brings its own panel layouts, tile kernel and sizes).
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
static void pack_a(void *dstv, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    float *dst = dstv;
    if (A.cs == 1) { /* rows contiguous in k (gemm_nt, gemm_nn) */
        pack_transposed(dst, MR, lanes(MR), A.p + i0 * A.rs + k0, A.rs, mr, kc);
    } else { /* A stored transposed (gemm_tn, rs == 1): each k holds a contiguous run over i */
        __mmask16 m = lanes(mr);
        for (int64_t k = 0; k < kc; k++)
            _mm512_mask_storeu_ps(dst + k * MR, lanes(MR), _mm512_maskz_loadu_ps(m, A.p + (k0 + k) * A.cs + i0));
    }
}

/* dst: [kc][NR] = B rows [k0, k0+kc) × columns [j0, j0+nr) (B viewed as K×N), columns >= nr zero. */
static void pack_b(void *dstv, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    float *dst = dstv;
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
static void kernel_14x32(int64_t kc, const void *ap, const void *bp, float *C, int64_t ldc, int64_t mr,
                         int64_t nr, float cscale) {
    const float *restrict a = ap, *restrict b = bp;
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

/* The fp32 engine: 14×32 register tiles over [kc][MR] and [kc][NR] float panels. */
static const gemm_engine k_fp32_engine = {
    .mr = MR, .nr = NR, .kc = KC, .mc = MC, .nt = NT, .nc = NC, .kalign = 1, .elem = sizeof(float),
    .pack_a = pack_a, .pack_b = pack_b, .tile = kernel_14x32,
};

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
static int64_t round_up(int64_t a, int64_t b) { return cdiv(a, b) * b; }

/* Task shape: start from mc rows × nt columns and shrink (columns first, then rows) until there
 * are at least 4 tasks per thread, so threads stay balanced on skinny outputs. Only the split of
 * the work changes, never the arithmetic of an element. */
static void task_shape(const gemm_engine *e, int64_t M, int64_t N, int nth, int64_t *mc, int64_t *nt) {
    *mc = e->mc;
    *nt = e->nt;
    if (nth <= 1) return;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *nt > 2 * e->nr) *nt /= 2;
    while (cdiv(M, *mc) * cdiv(N, *nt) < 4 * nth && *mc > 4 * e->mr) *mc = e->mr * (*mc / e->mr / 2);
}

/* Packing workspace reserved for a model's lifetime: GEMMs inside a pass then allocate nothing, so a
 * pass's memory (and memplan's prediction of it) does not depend on the routing of tokens to experts.
 * Sized for the fp32 engine's largest slice (KC × NC of B, KC × MC of A per thread); the bf16 engine's
 * slices (twice as deep, half the bytes per element) fit in the same bytes. */
#define POOL_B_BYTES ((size_t)KC * NC * sizeof(float))
#define POOL_A_BYTES ((size_t)KC * MC * sizeof(float)) /* per thread */
static struct {
    char *bp, *ap;
    int threads;
    int refs;
    bool shape_only; /* reserved in shape-only mode: counted, no memory behind it */
} g_ws;

void gemm_workspace_reserve(void) {
    if (g_ws.refs++ > 0) return;
    g_ws.threads = omp_get_max_threads();
    g_ws.shape_only = ds4_shape_only();
    g_ws.bp = ds4_alloc(DS4_MEM_WORK, POOL_B_BYTES);
    g_ws.ap = ds4_alloc(DS4_MEM_WORK, (size_t)g_ws.threads * POOL_A_BYTES);
}

void gemm_workspace_release(void) {
    if (g_ws.refs <= 0 || --g_ws.refs > 0) return;
    ds4_free(g_ws.bp);
    ds4_free(g_ws.ap);
    memset(&g_ws, 0, sizeof g_ws);
}

static bool workspace_usable(int nth, size_t b_bytes, size_t a_bytes) {
    return g_ws.bp && g_ws.ap && nth <= g_ws.threads && g_ws.shape_only == ds4_shape_only() && !omp_in_parallel() &&
           b_bytes <= POOL_B_BYTES && a_bytes <= POOL_A_BYTES;
}

/* C[M,N] = beta·C + A·B with A viewed M×K and B viewed K×N. Returns false (nothing written) when
 * the packing buffers cannot be allocated. */
static bool gemm_fast(const gemm_engine *e, int64_t M, int64_t N, int64_t K, gemm_view A, gemm_view B, float *C,
                      int64_t ldc, float beta) {
    if (M <= 0 || N <= 0) return true;
    if (K <= 0 && ds4_shape_only()) return true;
    if (K <= 0) { /* empty sum: C = beta·C */
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) C[i * ldc + j] = beta == 0 ? 0 : beta * C[i * ldc + j];
        return true;
    }
    int nth = omp_in_parallel() || M * N * K < PAR_MIN ? 1 : omp_get_max_threads();
    int64_t nc_max = min64(N, e->nc), kcp_max = round_up(min64(K, e->kc), e->kalign), mc, nt;
    task_shape(e, M, nc_max, nth, &mc, &nt);
    if (nth > cdiv(M, mc) * cdiv(nc_max, nt)) nth = (int)(cdiv(M, mc) * cdiv(nc_max, nt));
    size_t b_bytes = (size_t)(kcp_max * round_up(nc_max, e->nr)) * e->elem;
    size_t a_bytes = (size_t)(kcp_max * round_up(min64(M, mc), e->mr)) * e->elem; /* packed A per thread */
    char *bp, *ap;
    bool pooled = workspace_usable(nth, b_bytes, a_bytes);
    if (pooled) {
        bp = g_ws.bp;
        ap = g_ws.ap;
        a_bytes = POOL_A_BYTES; /* the pool's per-thread stride */
    } else {
        bp = ds4_alloc(DS4_MEM_WORK, b_bytes);
        ap = ds4_alloc(DS4_MEM_WORK, (size_t)nth * a_bytes);
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
        char *apt = ap + (size_t)omp_get_thread_num() * a_bytes;
        if (e->thread_begin) e->thread_begin();
        for (int64_t jc = 0; jc < N; jc += e->nc) {
            int64_t nc = min64(e->nc, N - jc), npan = cdiv(nc, e->nr), ntn = cdiv(nc, nt), ntasks = cdiv(M, mc) * ntn;
            for (int64_t pc = 0; pc < K; pc += e->kc) {
                int64_t kc = min64(e->kc, K - pc), kcp = round_up(kc, e->kalign);
                size_t a_pan = (size_t)(kcp * e->mr) * e->elem, b_pan = (size_t)(kcp * e->nr) * e->elem;
                float cscale = pc == 0 ? beta : 1;
                /* B slice: npan panels of b_pan bytes */
#pragma omp for schedule(static)
                for (int64_t p = 0; p < npan; p++)
                    e->pack_b(bp + (size_t)p * b_pan, B, pc, kc, jc + p * e->nr, min64(e->nr, nc - p * e->nr));
                /* tasks in row-block-major order; a thread keeps its packed A block while it
                 * takes tasks of the same row block. Dynamic: a descheduled thread does not hold
                 * the others back (results do not depend on who computes a task). */
                int64_t packed_ib = -1;
#pragma omp for schedule(dynamic, 1)
                for (int64_t t = 0; t < ntasks; t++) {
                    int64_t ib = t / ntn, jt = t % ntn;
                    int64_t i0 = ib * mc, mcur = min64(mc, M - i0);
                    if (ib != packed_ib) { /* A block: cdiv(mcur, mr) panels of a_pan bytes */
                        for (int64_t ir = 0; ir < mcur; ir += e->mr)
                            e->pack_a(apt + (size_t)(ir / e->mr) * a_pan, A, i0 + ir, min64(e->mr, mcur - ir), pc, kc);
                        packed_ib = ib;
                    }
                    int64_t j_end = min64(nc, (jt + 1) * nt);
                    for (int64_t jr = jt * nt; jr < j_end; jr += e->nr) {
                        const char *b = bp + (size_t)(jr / e->nr) * b_pan;
                        for (int64_t ir = 0; ir < mcur; ir += e->mr)
                            e->tile(kc, apt + (size_t)(ir / e->mr) * a_pan, b, C + (i0 + ir) * ldc + jc + jr, ldc,
                                    min64(e->mr, mcur - ir), min64(e->nr, j_end - jr), cscale);
                    }
                }
            }
        }
        if (e->thread_end) e->thread_end();
    }
    if (!pooled) {
        ds4_free(bp);
        ds4_free(ap);
    }
    return true;
}

#pragma GCC pop_options

static bool bf16_mode(void) { return ds4_get_matmul_precision() == DS4_MATMUL_BF16; }

/* The engine of the current matmul precision, NULL for none (fp32 on a CPU without AVX-512; bf16 in
 * a build without AMX code, which the precision switch does not allow). Without an engine or its
 * buffers, the reference of the current precision computes the product. */
static const gemm_engine *current_engine(void) {
    if (bf16_mode()) return gemm_amx_engine();
    return __builtin_cpu_supports("avx512f") ? &k_fp32_engine : NULL;
}

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T */
void gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    const gemm_engine *e = current_engine();
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1}, (gemm_view){B, 1, ldb}, C, ldc, beta))
        (bf16_mode() ? gemm_nt_bf16_ref : gemm_nt_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[M,K] · B[K,N] */
void gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    const gemm_engine *e = current_engine();
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, lda, 1}, (gemm_view){B, ldb, 1}, C, ldc, beta))
        (bf16_mode() ? gemm_nn_bf16_ref : gemm_nn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* C[M,N] = beta*C + A[K,M]^T · B[K,N] */
void gemm_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb, float *C,
             int64_t ldc, float beta) {
    const gemm_engine *e = current_engine();
    if (!e || !gemm_fast(e, M, N, K, (gemm_view){A, 1, lda}, (gemm_view){B, ldb, 1}, C, ldc, beta))
        (bf16_mode() ? gemm_tn_bf16_ref : gemm_tn_ref)(M, N, K, A, lda, B, ldb, C, ldc, beta);
}
