/* The AVX-512F engine of the blocked GEMM (driver: ../gemm.c): 14×32 register tiles (28 zmm
 * accumulators) over [kc][14] and [kc][32] float panels, FMA chains k ascending within a K slice of 256.
 * The same engine runs the bf16 precision on CPUs without AVX512-BF16: the driver then rounds its packed
 * panels to bf16 values (dispatch.c). Compiled for AVX-512 whatever the build flags; the dispatch runs it
 * only on a CPU that has it. */
#include "kernels/dispatch.h"
#if DS4_X86_ENGINES
#include <immintrin.h>

#include "ds4/core.h"
#include "kernels/dispatch.h"
#include "kernels/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,fma")
#include "kernels/x86/avx512_tile.h"

#define MR 14         /* register tile rows: 14×2 zmm accumulators + 2 B vectors */
#define NR 32         /* register tile columns: two zmm */
#define KC 256        /* K slice depth; fixes the summation order (do not tune per thread count) */
#define MC (MR * 16)  /* rows per task at most: the packed A block (224×256 floats) lives in L2 */
#define NT (NR * 16)  /* columns per task at most */
#define NC (NR * 256) /* columns of B packed per slice (8192: 8 MB at KC = 256) */

/* ---------------------------------------------------------------- packing */


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

/* B from bf16 bits (a weight's compute copy), widened: the panel pack_b makes of the rounded values. */
static void pack_b_bf16(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    gemm_pack_b_bf16_f32(dst, NR, B, k0, kc, j0, nr);
}

/* ---------------------------------------------------------------- microkernel */

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

/* ---------------------------------------------------------------- engine */

static const gemm_engine k_avx512_engine = {
    .name = "avx512 fp32 FMA 14x32", .mr = MR, .nr = NR, .kc = KC, .mc = MC, .nt = NT, .nc = NC, .kalign = 1,
    .elem = sizeof(float), .pack_a = pack_a, .pack_b = pack_b, .pack_b_bf16 = pack_b_bf16, .tile = kernel_14x32,
};

#pragma GCC pop_options

const gemm_engine *gemm_engine_avx512_f32(void) { return &k_avx512_engine; }

#else /* another target or compiler: no AVX-512 engine */

const gemm_engine *gemm_engine_avx512_f32(void) { return NULL; }

#endif
