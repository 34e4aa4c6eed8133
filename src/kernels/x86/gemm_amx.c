/* The AMX-BF16 engine of the blocked GEMM (driver: ../gemm.c), chosen by the dispatch (dispatch.c) for
 * the bf16 matmul precision on CPUs with AMX.
 *
 * With DS4_MATMUL_BF16, gemm_nt/nn/tn round A and B to bf16 (round to nearest even, by
 * VCVTNE2PS2BF16, = gemm_bf16_bits) while packing them and multiply them with TDPBF16PS, which sums
 * the exact bf16 products into fp32 tiles. C stays fp32: C = beta·C + A·B.
 *
 * Panels (one 32 × 32 output tile = 2 × 2 AMX tiles of 16 × 16 floats): K is cut into chunks of 32,
 * zero padded (K odd or not a multiple of 32 costs nothing in accuracy: 0·0 adds 0).
 *   A panel, 32 rows:    [chunk][row 0..31][32 bf16 along k]              (tile rows = rows of A)
 *   B panel, 32 columns: [chunk][half 0..1][pair p 0..15][16 columns][k = 2p, 2p+1]  (VNNI pairs)
 * Each chunk of a panel is 2 KB: two tiles of 16 rows × 64 bytes, loaded with stride 64.
 *
 * Determinism: an output tile starts from zero for each K slice (AMX_KC deep), takes the slice's
 * chunks in ascending order, and is then added to C (the first slice: beta·C + tile). The slicing is
 * fixed, so every element gets the same operations in the same order whatever the thread count.
 *
 * Accuracy: the products are exact in fp32 (8-bit × 8-bit significands); each element is a sum of
 * K of them (plus beta·C) in fp32, so |C − exact| <= ~K·2^-24·(Σ|a·b| + |beta·C|) for the rounded
 * operands (the bound tests/test_kernels_amx.c checks). TDPBF16PS treats bf16 denormals as zero and
 * flushes denormal results to zero (the packer already turns fp32 denormals into zeros). */
#include "kernels/dispatch.h"

/* GCC >= 11 knows AMX (its tile intrinsics are inline assembly), so the engine is compiled for it
 * whatever -march says; the dispatch runs it only where CPUID and Linux allow. */
#if DS4_X86_ENGINES && __GNUC__ >= 11
#define GEMM_AMX 1
#include <immintrin.h>
#include <string.h>

#include "ds4/core.h"
#include "kernels/kernels.h"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512bw,avx512dq,avx512bf16,amx-tile,amx-bf16")
#else
#define GEMM_AMX 0
#endif

#if GEMM_AMX

#define AMX_MR 32     /* output tile rows: two AMX tiles of 16 rows */
#define AMX_NR 32     /* output tile columns: two AMX tiles of 16 floats */
#define AMX_KC 512    /* K slice depth (fixes the summation order); 16 chunks of 32 */
#define AMX_MC 224    /* rows per task at most: the packed A block (224 × 512 bf16) */
#define AMX_NT 512    /* columns per task at most */
#define AMX_NC 8192   /* columns of B packed per slice (8 MB at AMX_KC) */
#define CHUNK 2048    /* bytes of a panel per 32 k: two 1 KB tiles */
#define TILE_HALF 1024

/* ---------------------------------------------------------------- conversion helpers */

static __mmask16 lanes16(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? 0 : (__mmask16)((1u << n) - 1); }

/* 32 bf16 from the n (clamped to 0..32) floats at p, zero beyond: word w = bf16(p[w]). */
static inline __m512i bf16_run32(const float *p, int64_t n) {
    __m512 lo = _mm512_maskz_loadu_ps(lanes16(n), p), hi = _mm512_maskz_loadu_ps(lanes16(n - 16), p + 16);
    return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); /* the second operand fills the low words */
}

/* Word order that interleaves two 16-word halves: word 2m from the low half's m, 2m+1 from the high's. */
static const uint16_t k_pair_order[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                          8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* 16 dwords of bf16 pairs from two rows of floats (n valid, zero beyond; r1 NULL: zeros):
 * dword m = (bf16(r0[m]) low, bf16(r1[m]) high). */
static inline __m512i bf16_pairs16(const float *r0, const float *r1, int64_t n) {
    __mmask16 m = lanes16(n);
    __m512 a = _mm512_maskz_loadu_ps(m, r0), b = r1 ? _mm512_maskz_loadu_ps(m, r1) : _mm512_setzero_ps();
    __m512i words = (__m512i)_mm512_cvtne2ps_pbh(b, a);
    return _mm512_permutexvar_epi16(_mm512_loadu_si512(k_pair_order), words);
}

/* The pairs of rows k, k+1 (< kc; zero beyond) of a matrix p with row stride `stride`, n columns. */
static inline __m512i bf16_pair_row(const float *p, int64_t stride, int64_t k, int64_t kc, int64_t n) {
    if (k >= kc || n <= 0) return _mm512_setzero_si512();
    return bf16_pairs16(p + k * stride, k + 1 < kc ? p + (k + 1) * stride : NULL, n);
}

/* Transposes 16 × 16 dwords in registers: x[r] lane c becomes x[c] lane r. Four rounds; round d swaps
 * bit d of the row index with bit d of the lane index (the off-diagonal d × d blocks of each 2d × 2d
 * block), one two-source permute per output row. */
static inline void transpose_dwords16(__m512i x[16]) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int d = 8; d >= 1; d /= 2) {
        __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(d)); /* lanes with bit d set */
        /* low row i keeps its lanes without bit d and takes row i+d's lanes L−d; row i+d the rest */
        __m512i idx_lo = _mm512_mask_add_epi32(lane, upper, lane, _mm512_set1_epi32(16 - d));
        __m512i idx_hi = _mm512_mask_add_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(d)), upper, lane,
                                               _mm512_set1_epi32(16));
        for (int i = 0; i < 16; i++) {
            if (i & d) continue;
            __m512i a = x[i], b = x[i + d];
            x[i] = _mm512_permutex2var_epi32(a, idx_lo, b);
            x[i + d] = _mm512_permutex2var_epi32(a, idx_hi, b);
        }
    }
}

/* ---------------------------------------------------------------- packing */

/* A panel (layout above) of rows [i0, i0+mr) × k [k0, k0+kc); rows >= mr and k >= kc zero. */
static void amx_pack_a(void *dst, gemm_view A, int64_t i0, int64_t mr, int64_t k0, int64_t kc) {
    char *d = dst;
    int64_t nq = (kc + 31) / 32;
    if (A.cs == 1) { /* rows contiguous in k (gemm_nt, gemm_nn): convert runs of 32 */
        for (int64_t r = 0; r < AMX_MR; r++) {
            const float *src = r < mr ? A.p + (i0 + r) * A.rs + k0 : NULL;
            for (int64_t q = 0; q < nq; q++)
                _mm512_store_si512(d + q * CHUNK + r * 64, src ? bf16_run32(src + q * 32, kc - q * 32)
                                                               : _mm512_setzero_si512());
        }
        return;
    }
    /* A stored transposed (gemm_tn, rs == 1): k rows hold runs over i. Pair rows k, k+1 into dwords
     * per i, then transpose 16 i × 16 pairs so each i gets its 32 k of the chunk. Both halves of a
     * chunk in turn: each k row is read as one 128-byte run. */
    for (int64_t q = 0; q < nq; q++)
        for (int64_t h = 0; h < 2; h++) {
            __m512i x[16];
            const float *src = A.p + k0 * A.cs + i0 + 16 * h;
            for (int64_t p = 0; p < 16; p++) x[p] = bf16_pair_row(src, A.cs, q * 32 + 2 * p, kc, mr - 16 * h);
            transpose_dwords16(x);
            for (int64_t r = 0; r < 16; r++) _mm512_store_si512(d + q * CHUNK + (16 * h + r) * 64, x[r]);
        }
}

/* B panel (VNNI layout above) of k [k0, k0+kc) × columns [j0, j0+nr) of B viewed K × N. */
static void amx_pack_b(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    char *d = dst;
    int64_t nq = (kc + 31) / 32;
    for (int64_t h = 0; h < 2; h++) {
        int64_t ncol = nr - 16 * h;
        for (int64_t q = 0; q < nq; q++) {
            char *t = d + q * CHUNK + h * TILE_HALF;
            if (B.cs == 1) { /* rows of B contiguous in j (gemm_nn, gemm_tn): pair rows k, k+1 */
                const float *src = B.p + k0 * B.rs + j0 + 16 * h;
                for (int64_t p = 0; p < 16; p++)
                    _mm512_store_si512(t + p * 64, bf16_pair_row(src, B.rs, q * 32 + 2 * p, kc, ncol));
                continue;
            }
            /* B^T stored (gemm_nt, rs == 1): a column's k run converts to 16 pairs at once; the
             * transpose turns 16 columns × 16 pairs into 16 pair rows × 16 columns. */
            __m512i x[16];
            for (int64_t c = 0; c < 16; c++)
                x[c] = c < ncol ? bf16_run32(B.p + (j0 + 16 * h + c) * B.cs + k0 + q * 32, kc - q * 32)
                                : _mm512_setzero_si512();
            transpose_dwords16(x);
            for (int64_t p = 0; p < 16; p++) _mm512_store_si512(t + p * 64, x[p]);
        }
    }
}

/* The same B panel from bf16 bits B.h (a weight's compute copy): element (k, j) of the slice is copied to
 * chunk k / 32, half j / 16, pair (k % 32) / 2, column j % 16, word k % 2; zero for k >= kc or j >= nr. */
static void amx_pack_b_bf16(void *dst, gemm_view B, int64_t k0, int64_t kc, int64_t j0, int64_t nr) {
    uint16_t *d = dst;
    int64_t nq = (kc + 31) / 32;
    for (int64_t q = 0; q < nq; q++)
        for (int64_t h = 0; h < 2; h++)
            for (int64_t c = 0; c < 16; c++) {
                const int64_t j = 16 * h + c;
                const uint16_t *col = j < nr ? B.h + (k0 + q * 32) * B.rs + (j0 + j) * B.cs : NULL;
                uint16_t *t = d + (q * CHUNK + h * TILE_HALF) / 2 + 2 * c; /* pair p at t + 32·p */
                for (int64_t kk = 0; kk < 32; kk++)
                    t[32 * (kk / 2) + kk % 2] = col && q * 32 + kk < kc ? col[kk * B.rs] : 0;
            }
}

/* ---------------------------------------------------------------- tile kernel */

/* Palette 1, all eight tiles 16 rows × 64 bytes: tmm0..3 accumulate the 2 × 2 output tiles,
 * tmm4/5 hold the two A tiles, tmm6/7 the two B tiles of a chunk. Static: LDTILECFG reads 64 bytes. */
static const struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} k_tile_cfg = {
    .palette = 1,
    .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
    .rows = {16, 16, 16, 16, 16, 16, 16, 16},
};

static void amx_thread_begin(void) { _tile_loadconfig(&k_tile_cfg); }
static void amx_thread_end(void) { _tile_release(); }

/* C tile [mr ≤ 32, nr ≤ 32] = cscale·C + a·b over one packed slice of kc (padded to chunks of 32). */
static void amx_tile_32x32(int64_t kc, const void *a, const void *b, float *C, int64_t ldc, int64_t mr, int64_t nr,
                           float cscale) {
    const char *ap = a, *bp = b;
    /* C's tile is read (cscale != 0) or written after the products: fetch its lines now, so that the
     * memory latency overlaps the tile arithmetic instead of following it */
    for (int64_t r = 0; r < mr; r++) {
        _mm_prefetch((const char *)(C + r * ldc), _MM_HINT_T0);
        _mm_prefetch((const char *)(C + r * ldc + nr - 1), _MM_HINT_T0);
    }
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t q = 0; q < (kc + 31) / 32; q++, ap += CHUNK, bp += CHUNK) {
        _tile_loadd(4, ap, 64);
        _tile_loadd(5, ap + TILE_HALF, 64);
        _tile_loadd(6, bp, 64);
        _tile_loadd(7, bp + TILE_HALF, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
    }
    float acc[AMX_MR * AMX_NR] __attribute__((aligned(64))); /* row-major 32 × 32 */
    _tile_stored(0, acc, AMX_NR * 4);
    _tile_stored(1, acc + 16, AMX_NR * 4);
    _tile_stored(2, acc + 16 * AMX_NR, AMX_NR * 4);
    _tile_stored(3, acc + 16 * AMX_NR + 16, AMX_NR * 4);
    for (int64_t r = 0; r < mr; r++)
        for (int64_t h = 0; h < 2; h++) {
            __mmask16 m = lanes16(nr - 16 * h);
            float *c = C + r * ldc + 16 * h;
            __m512 v = _mm512_load_ps(acc + r * AMX_NR + 16 * h);
            if (cscale != 0) { /* beta 0 never reads C (it may hold garbage) */
                __m512 old = _mm512_maskz_loadu_ps(m, c);
                if (cscale != 1) old = _mm512_mul_ps(_mm512_set1_ps(cscale), old);
                v = _mm512_add_ps(old, v);
            }
            _mm512_mask_storeu_ps(c, m, v);
        }
}

static const gemm_engine k_amx_engine = {
    .name = "amx bf16 tiles 32x32", .mr = AMX_MR, .nr = AMX_NR, .kc = AMX_KC, .mc = AMX_MC, .nt = AMX_NT, .nc = AMX_NC, .kalign = 32, .elem = 2,
    .pack_a = amx_pack_a, .pack_b = amx_pack_b, .pack_b_bf16 = amx_pack_b_bf16, .tile = amx_tile_32x32,
    .thread_begin = amx_thread_begin, .thread_end = amx_thread_end,
};

#pragma GCC pop_options

const gemm_engine *gemm_engine_amx_bf16(void) { return &k_amx_engine; }

#else /* another target or compiler: no AMX engine */

const gemm_engine *gemm_engine_amx_bf16(void) { return NULL; }

#endif
