/* The AVX2 + FMA engine of the blocked GEMM (driver: ../gemm.c), for x86-64 CPUs without AVX-512:
 * 6×16 register tiles (12 ymm accumulators, 2 B vectors, 1 broadcast) over [kc][6] and [kc][16] float
 * panels packed by the portable packers; FMA chains k ascending within a K slice of 256. The same
 * engine runs the bf16 precision there: the driver rounds its packed panels to bf16 values first
 * (dispatch.c). Compiled for AVX2 + FMA whatever the build flags; the dispatch runs it only on a CPU
 * that has them. */
#include "kernels/dispatch.h"
#if DS4_X86_ENGINES
#include <immintrin.h>

#include "ds4/core.h"
#include "kernels/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma")

#define MR 6          /* register tile rows: 6×2 ymm accumulators */
#define NR 16         /* register tile columns: two ymm */
#define KC 256        /* K slice depth; fixes the summation order (do not tune per thread count) */
#define MC (MR * 32)  /* rows per task at most: the packed A block (192×256 floats) lives in L2 */
#define NT (NR * 32)  /* columns per task at most */
#define NC 8192       /* columns of B packed per slice (8 MB at KC = 256) */

static void pack_a(void *dst, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    gemm_pack_a_f32(dst, MR, A, i0, mr, k0, kc);
}

static void pack_b(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    gemm_pack_b_f32(dst, NR, B, k0, kc, j0, nr);
}

/* One C row of the tile from its two accumulators: C = acc (cscale 0), C + acc (1), or cscale·C + acc;
 * only the first nr columns (a partial tile goes through a staging row). */
static inline void store_row(float *c, __m256 lo, __m256 hi, int64_t nr, float cscale) {
    float acc[NR];
    _mm256_storeu_ps(acc, lo);
    _mm256_storeu_ps(acc + 8, hi);
    if (nr == NR && cscale == 0) {
        _mm256_storeu_ps(c, lo);
        _mm256_storeu_ps(c + 8, hi);
        return;
    }
    for (int64_t j = 0; j < nr; j++) {
        float old = cscale == 0 ? 0.0f : cscale == 1 ? c[j] : cscale * c[j];
        c[j] = cscale == 0 ? acc[j] : old + acc[j];
    }
}

#define ACC_DECL(i) __m256 c##i##l = _mm256_setzero_ps(), c##i##h = _mm256_setzero_ps();
#define ACC_FMA(i)                                      \
    {                                                   \
        __m256 ai = _mm256_broadcast_ss(a + i);         \
        c##i##l = _mm256_fmadd_ps(ai, b0, c##i##l);     \
        c##i##h = _mm256_fmadd_ps(ai, b1, c##i##h);     \
    }
#define ACC_STORE(i) \
    if (i < mr) store_row(C + i * ldc, c##i##l, c##i##h, nr, cscale);
#define ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5)

/* C tile [mr ≤ MR, nr ≤ NR] (row stride ldc) ⊕= a[kc][MR] · b[kc][NR]. */
static void kernel_6x16(int64_t kc, const void *ap, const void *bp, float *C, int64_t ldc, int64_t mr, int64_t nr,
                        float cscale) {
    const float *restrict a = ap, *restrict b = bp;
    ROWS(ACC_DECL)
    for (int64_t k = 0; k < kc; k++) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8);
        ROWS(ACC_FMA)
        a += MR;
        b += NR;
    }
    ROWS(ACC_STORE)
}

/* B from bf16 bits (a weight's compute copy), widened: the panel pack_b makes of the rounded values. */
static void pack_b_bf16(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    gemm_pack_b_bf16_f32(dst, NR, B, k0, kc, j0, nr);
}

static const gemm_engine k_avx2_engine = {
    .name = "avx2 fp32 FMA 6x16", .mr = MR, .nr = NR, .kc = KC, .mc = MC, .nt = NT, .nc = NC, .kalign = 1,
    .elem = sizeof(float), .pack_a = pack_a, .pack_b = pack_b, .pack_b_bf16 = pack_b_bf16, .tile = kernel_6x16,
};

#pragma GCC pop_options

const gemm_engine *gemm_engine_avx2_f32(void) { return &k_avx2_engine; }

#else /* another target or compiler: no AVX2 engine */

const gemm_engine *gemm_engine_avx2_f32(void) { return NULL; }

#endif
