/* The AVX512-BF16 engine of the blocked GEMM (driver: ../gemm.c) for the bf16 matmul precision on CPUs
 * with AVX512-BF16 but no AMX: VDPBF16PS adds two exact bf16 products per fp32 lane.
 *
 * Panels hold bf16 pairs along k (one 32-bit word = (bf16 of k = 2p) low, (k = 2p+1) high), K zero padded
 * to even (0·0 adds 0):
 *   A panel, 14 rows:    [pair p][row 0..13]       words: a row's pair is broadcast to all lanes
 *   B panel, 32 columns: [pair p][column 0..31]    words: two zmm of 16 columns
 * A 14×32 output tile lives in 28 zmm accumulators; pairs are taken in ascending order within a K slice
 * of 512, slices added to C in order: fixed operations per element whatever the thread count.
 *
 * Accuracy: as the AMX engine (gemm_amx.c): exact products summed in fp32, denormals flushed by the
 * instruction (the packer already turns fp32 denormals into zeros).
 *
 * The portable packers are C compiled outside the AVX-512 region, and so is a tile kernel of the same
 * arithmetic (gemm_engine_dpbf16_portable): tests check the panel layouts on every CPU. Where the dispatch
 * finds AVX512-BF16, the VDPBF16PS kernel runs with AVX-512 packers that make the same panels word for
 * word (tests/test_kernels_bf16.c compares them). */
#include <string.h>

#include "ds4/core.h"
#include "kernels/dispatch.h"
#include "kernels/kernels.h"

#define DP_MR 14   /* register tile rows: 14×2 zmm accumulators + 2 B vectors */
#define DP_NR 32   /* register tile columns: two zmm */
#define DP_KC 512  /* K slice depth (fixes the summation order): 256 pairs */
#define DP_MC 224  /* rows per task at most: the packed A block (224 × 512 bf16) */
#define DP_NT 512  /* columns per task at most */
#define DP_NC 8192 /* columns of B packed per slice (8 MB at DP_KC) */

/* ---------------------------------------------------------------- packing (portable) */

/* The word of bf16 pair p of a run whose element t is at[t·stride], t < n (zero beyond). */
static uint32_t pair_word(const float *at, int64_t stride, int64_t p, int64_t n) {
    uint32_t lo = 2 * p < n ? gemm_bf16_bits(at[2 * p * stride]) : 0;
    uint32_t hi = 2 * p + 1 < n ? gemm_bf16_bits(at[(2 * p + 1) * stride]) : 0;
    return lo | hi << 16;
}

/* A panel: rows [i0, i0+mr) × k [k0, k0+kc), [pair][DP_MR] words; rows >= mr zero. */
static void dp_pack_a(void *dst, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    uint32_t *d = dst;
    int64_t np = (kc + 1) / 2;
    for (int64_t r = 0; r < DP_MR; r++) {
        const float *row = r < mr ? A.p + (i0 + r) * A.rs + k0 * A.cs : NULL;
        for (int64_t p = 0; p < np; p++) d[p * DP_MR + r] = row ? pair_word(row, A.cs, p, kc) : 0;
    }
}

/* B panel: k [k0, k0+kc) × columns [j0, j0+nr) of B viewed K × N, [pair][DP_NR] words; columns >= nr zero. */
static void dp_pack_b(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    uint32_t *d = dst;
    int64_t np = (kc + 1) / 2;
    for (int64_t c = 0; c < DP_NR; c++) {
        const float *col = c < nr ? B.p + k0 * B.rs + (j0 + c) * B.cs : NULL;
        for (int64_t p = 0; p < np; p++) d[p * DP_NR + c] = col ? pair_word(col, B.rs, p, kc) : 0;
    }
}

/* The same panel from bf16 bits B.h (a weight's compute copy): the bits are copied. */
static void dp_pack_b_bf16(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    uint32_t *d = dst;
    int64_t np = (kc + 1) / 2;
    for (int64_t c = 0; c < DP_NR; c++) {
        const uint16_t *col = c < nr ? B.h + k0 * B.rs + (j0 + c) * B.cs : NULL;
        for (int64_t p = 0; p < np; p++) {
            uint32_t lo = col && 2 * p < kc ? col[2 * p * B.rs] : 0;
            uint32_t hi = col && 2 * p + 1 < kc ? col[(2 * p + 1) * B.rs] : 0;
            d[p * DP_NR + c] = lo | hi << 16;
        }
    }
}

/* C = acc (cscale 0: C not read), C + acc (1), or cscale·C + acc. */
static float dp_out(float c, float acc, float cscale) {
    return cscale == 0 ? acc : (cscale == 1 ? c : cscale * c) + acc;
}

static float bf16_lo(uint32_t w) { return ds4_bf16_to_f32((uint16_t)(w & 0xffffu)); }
static float bf16_hi(uint32_t w) { return ds4_bf16_to_f32((uint16_t)(w >> 16)); }

/* The arithmetic of the VDPBF16PS tile in portable C: per element, pairs in ascending order, each adding
 * its low then its high product (exact in fp32) to an fp32 accumulator. */
static void dp_tile_portable(int64_t kc, const void *ap, const void *bp, float *C, int64_t ldc, int64_t mr,
                             int64_t nr, float cscale) {
    const uint32_t *a = ap, *b = bp;
    int64_t np = (kc + 1) / 2;
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            float acc = 0;
            for (int64_t p = 0; p < np; p++) {
                uint32_t x = a[p * DP_MR + i], y = b[p * DP_NR + j];
                acc = acc + bf16_lo(x) * bf16_lo(y);
                acc = acc + bf16_hi(x) * bf16_hi(y);
            }
            C[i * ldc + j] = dp_out(C[i * ldc + j], acc, cscale);
        }
}

static const gemm_engine k_dp_portable = {
    .name = "avx512bf16 panels, portable tile (tests)", .mr = DP_MR, .nr = DP_NR, .kc = DP_KC, .mc = DP_MC,
    .nt = DP_NT, .nc = DP_NC, .kalign = 2, .elem = 2, .pack_a = dp_pack_a, .pack_b = dp_pack_b, .pack_b_bf16 = dp_pack_b_bf16,
    .tile = dp_tile_portable,
};

const gemm_engine *gemm_engine_dpbf16_portable(void) { return &k_dp_portable; }

/* ---------------------------------------------------------------- VDPBF16PS tile kernel */

#if DS4_X86_ENGINES
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16")
#include "kernels/x86/avx512_tile.h"

#define DP_DECL(i) __m512 c##i##l = _mm512_setzero_ps(), c##i##h = _mm512_setzero_ps();
#define DP_DOT(i)                                                           \
    {                                                                       \
        __m512bh ai = (__m512bh)_mm512_set1_epi32((int)a[i]);               \
        c##i##l = _mm512_dpbf16_ps(c##i##l, ai, b0);                        \
        c##i##h = _mm512_dpbf16_ps(c##i##h, ai, b1);                        \
    }
#define DP_STORE(i) \
    if (i < mr) store_row(C + i * ldc, c##i##l, c##i##h, m0, m1, cscale);
#define DP_ROWS(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13)

/* C tile [mr ≤ 14, nr ≤ 32] = cscale·C + a·b over one packed slice (pairs of a: [p][14], of b: [p][32]). */
static void dp_tile_14x32(int64_t kc, const void *ap, const void *bp, float *C, int64_t ldc, int64_t mr, int64_t nr,
                          float cscale) {
    const uint32_t *restrict a = ap, *restrict b = bp;
    int64_t np = (kc + 1) / 2;
    DP_ROWS(DP_DECL)
    for (int64_t p = 0; p < np; p++) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 16);
        DP_ROWS(DP_DOT)
        a += DP_MR;
        b += DP_NR;
    }
    __mmask16 m0 = lanes(nr), m1 = lanes(nr - 16);
    DP_ROWS(DP_STORE)
}

/* ---------------------------------------------------------------- AVX-512 packers
 * The panels of the portable packers above, word for word, 16 lanes at a time, for the two layouts the
 * model's GEMMs pass: a panel's lanes (rows of A, columns of B) adjacent in memory for each k, or each
 * lane's run along k contiguous. Other strides take the portable packers. */

/* bf16_round_u32 on 16 lanes: the rounded bits, the bf16 in the top half and zeros below. */
static inline __m512i dp_round16(__m512i u) {
    const __m512i top = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), top);
    const __m512i quiet_nan = _mm512_and_si512(_mm512_or_si512(u, _mm512_set1_epi32(0x00400000)), top);
    const __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), expo);
    const __mmask16 tiny = _mm512_testn_epi32_mask(u, expo); /* ±0 and denormals */
    const __m512i r = _mm512_mask_blend_epi32(nan, rounded, quiet_nan);
    return _mm512_mask_blend_epi32(tiny, r, _mm512_and_si512(u, _mm512_set1_epi32((int)0x80000000u)));
}

/* Words of 16 lanes whose element 2p is lo and 2p+1 is hi (float bits). */
static inline __m512i dp_words(__m512i lo, __m512i hi) {
    return _mm512_or_si512(_mm512_srli_epi32(dp_round16(lo), 16), dp_round16(hi));
}

/* Panel [pair][width] of nl valid lanes (the rest zero), lane l of element k at base[k·ks + l]. */
static void dp_pack_lanes(uint32_t *d, int64_t width, const float *base, int64_t ks, int64_t nl, int64_t kc) {
    const int64_t np = (kc + 1) / 2;
    for (int64_t p = 0; p < np; p++) {
        const float *e0 = base + 2 * p * ks, *e1 = e0 + ks;
        for (int64_t l0 = 0; l0 < width; l0 += 16) {
            const __mmask16 m = lanes(nl - l0);
            const __m512i lo = _mm512_maskz_loadu_epi32(m, e0 + l0);
            const __m512i hi = 2 * p + 1 < kc ? _mm512_maskz_loadu_epi32(m, e1 + l0) : _mm512_setzero_si512();
            _mm512_mask_storeu_epi32(d + p * width + l0, lanes(width - l0), dp_words(lo, hi));
        }
    }
}

/* The lane offsets of 16 consecutive pairs in a panel of `width` lanes. */
static inline __m512i dp_pair_rows(int64_t width) {
    return _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                              _mm512_set1_epi32((int)width));
}

/* The same panel, lane l's elements contiguous: element k at base[l·ls + k]. */
static void dp_pack_runs(uint32_t *d, int64_t width, const float *base, int64_t ls, int64_t nl, int64_t kc) {
    const int64_t np = (kc + 1) / 2;
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_add_epi32(even, _mm512_set1_epi32(1)), rows = dp_pair_rows(width);
    for (int64_t l = 0; l < width; l++) {
        if (l >= nl) {
            for (int64_t p = 0; p < np; p++) d[p * width + l] = 0;
            continue;
        }
        const float *run = base + l * ls;
        for (int64_t p0 = 0; p0 < np; p0 += 16) {
            const int64_t k = 2 * p0;
            const __m512i r0 = dp_round16(_mm512_maskz_loadu_epi32(lanes(kc - k), run + k));
            const __m512i r1 = dp_round16(_mm512_maskz_loadu_epi32(lanes(kc - k - 16), run + k + 16));
            const __m512i w = _mm512_or_si512(_mm512_srli_epi32(_mm512_permutex2var_epi32(r0, even, r1), 16),
                                              _mm512_permutex2var_epi32(r0, odd, r1));
            _mm512_mask_i32scatter_epi32(d + p0 * width + l, lanes(np - p0), rows, w, 4);
        }
    }
}

static void dp_pack_a_avx512(void *dst, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    const float *base = A.p + i0 * A.rs + k0 * A.cs;
    if (A.rs == 1) dp_pack_lanes(dst, DP_MR, base, A.cs, mr, kc);
    else if (A.cs == 1) dp_pack_runs(dst, DP_MR, base, A.rs, mr, kc);
    else dp_pack_a(dst, A, i0, mr, k0, kc);
}

static void dp_pack_b_avx512(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    const float *base = B.p + k0 * B.rs + j0 * B.cs;
    if (B.cs == 1) dp_pack_lanes(dst, DP_NR, base, B.rs, nr, kc);
    else if (B.rs == 1) dp_pack_runs(dst, DP_NR, base, B.cs, nr, kc);
    else dp_pack_b(dst, B, k0, kc, j0, nr);
}

/* From bf16 bits: a column's run along k is already its words (element 2p low, 2p+1 high); adjacent
 * columns are widened and paired. */
static void dp_pack_b_bf16_avx512(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    uint32_t *d = dst;
    const uint16_t *base = B.h + k0 * B.rs + j0 * B.cs;
    const int64_t np = (kc + 1) / 2;
    if (B.cs == 1) {
        for (int64_t p = 0; p < np; p++)
            for (int64_t l0 = 0; l0 < DP_NR; l0 += 16) {
                const __mmask16 m = lanes(nr - l0);
                const uint16_t *e0 = base + 2 * p * B.rs + l0, *e1 = e0 + B.rs;
                const __m512i lo = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, e0));
                const __m512i hi = 2 * p + 1 < kc ? _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, e1))
                                                  : _mm512_setzero_si512();
                _mm512_storeu_si512(d + p * DP_NR + l0, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
    } else if (B.rs == 1) {
        const __m512i rows = dp_pair_rows(DP_NR);
        for (int64_t l = 0; l < DP_NR; l++) {
            if (l >= nr) {
                for (int64_t p = 0; p < np; p++) d[p * DP_NR + l] = 0;
                continue;
            }
            const uint16_t *run = base + l * B.cs;
            for (int64_t p0 = 0; p0 < np; p0 += 16) {
                const int64_t k = 2 * p0, left = kc - k;
                const __mmask32 m = left >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << left) - 1);
                const __m512i w = _mm512_maskz_loadu_epi16(m, run + k);
                _mm512_mask_i32scatter_epi32(d + p0 * DP_NR + l, lanes(np - p0), rows, w, 4);
            }
        }
    } else {
        dp_pack_b_bf16(dst, B, k0, kc, j0, nr);
    }
}

static const gemm_engine k_dp_engine = {
    .name = "avx512bf16 VDPBF16PS 14x32", .mr = DP_MR, .nr = DP_NR, .kc = DP_KC, .mc = DP_MC, .nt = DP_NT,
    .nc = DP_NC, .kalign = 2, .elem = 2, .pack_a = dp_pack_a_avx512, .pack_b = dp_pack_b_avx512,
    .pack_b_bf16 = dp_pack_b_bf16_avx512, .tile = dp_tile_14x32,
};

#pragma GCC pop_options

const gemm_engine *gemm_engine_avx512bf16(void) { return &k_dp_engine; }

#else /* another target or compiler: no AVX512-BF16 engine */

const gemm_engine *gemm_engine_avx512bf16(void) { return NULL; }

#endif
