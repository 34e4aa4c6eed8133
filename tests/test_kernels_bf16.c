/* The bf16 matmul precision on every engine: operand rounding, each engine of the bf16 GEMM (AMX tiles,
 * AVX512-BF16 dot products, fp32 FMAs of rounded operands on AVX-512 or AVX2, the VDPBF16PS panel
 * layout with a portable tile, the portable reference) against the bf16 reference on edge shapes with
 * a derived bound, determinism over threads and runs, the precision and ISA switches and their errors,
 * and memory that does not depend on the data (a plan run counts the same bytes). An engine the CPU
 * lacks is reported as skipped. */
#include <float.h>
#include <omp.h>
#include <stdint.h>

#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/dispatch.h"
#include "kernels/kernels.h"
#include "test.h"
#include "test_gemm.h"

static float *falloc(int64_t n) { return calloc((size_t)(n > 0 ? n : 1), sizeof(float)); }

static float f_of(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static uint32_t u_of(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The engine under test (its name for messages); NULL while the portable reference is under test. */
static const gemm_engine *g_engine;
static const char *g_engine_name = "";

/* The engine tests' context: real, bf16 GEMMs; and its plan. */
#define BF16_EXEC (&(const ds4_exec){.matmul_precision = DS4_MATMUL_BF16})
#define BF16_PLAN_EXEC (&(const ds4_exec){.plan = true, .matmul_precision = DS4_MATMUL_BF16})
static gemm_fn bf16_ref_of(int op) {
    return op == OP_NT ? cpu_gemm_nt_bf16_ref : op == OP_NN ? cpu_gemm_nn_bf16_ref : cpu_gemm_tn_bf16_ref;
}

/* Stored shapes (rows × cols) of A and B for an op. */
static void ab_shape(int op, int64_t M, int64_t N, int64_t K, int64_t *ar, int64_t *ac, int64_t *br, int64_t *bc) {
    *ar = op == OP_TN ? K : M;
    *ac = op == OP_TN ? M : K;
    *br = op == OP_NT ? N : K;
    *bc = op == OP_NT ? K : N;
}
/* A[i,k] and B[k,j] of an op's stored operands. */
static float a_at(int op, const float *A, int64_t lda, int64_t i, int64_t k) {
    return op == OP_TN ? A[k * lda + i] : A[i * lda + k];
}
static float b_at(int op, const float *B, int64_t ldb, int64_t k, int64_t j) {
    return op == OP_NT ? B[j * ldb + k] : B[k * ldb + j];
}

/* ---------------------------------------------------------------- rounding */

/* Hand-picked values: ties go to even, NaN stays NaN (quiet), Inf stays, overflow rounds to Inf,
 * denormals become zero of the same sign (as VCVTNE2PS2BF16 does). */
static void test_bf16_rounding_values(void) {
    static const struct {
        uint32_t in;
        uint16_t out;
    } cases[] = {
        {0x3f800000u, 0x3f80}, /* 1 */
        {0x3f808000u, 0x3f80}, /* 1 + 2^-8: tie, even stays down */
        {0x3f818000u, 0x3f82}, /* tie with odd low bit: up to even */
        {0x3f808001u, 0x3f81}, /* just above the tie: up */
        {0x3f807fffu, 0x3f80}, /* just below the tie: down */
        {0xbfc00000u, 0xbfc0}, /* -1.5 exact */
        {0xbf80c000u, 0xbf81}, /* negative, above tie: away from zero */
        {0x7f800000u, 0x7f80}, /* +Inf */
        {0xff800000u, 0xff80}, /* -Inf */
        {0x7fc00000u, 0x7fc0}, /* quiet NaN */
        {0x7f800001u, 0x7fc0}, /* signalling NaN with a low payload: stays NaN, made quiet */
        {0xffa12345u, 0xffe1}, /* negative NaN keeps sign and top payload */
        {0x7f7fffffu, 0x7f80}, /* FLT_MAX rounds up to Inf */
        {0x7f7f7fffu, 0x7f7f}, /* largest that stays finite */
        {0x00800000u, 0x0080}, /* smallest normal */
        {0x00000001u, 0x0000}, /* denormal → +0 */
        {0x807fffffu, 0x8000}, /* negative denormal → -0 */
        {0x80000000u, 0x8000}, /* -0 */
        {0x00000000u, 0x0000}, /* +0 */
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        uint16_t got = gemm_bf16_bits(f_of(cases[i].in));
        CHECK(got == cases[i].out, "bf16(0x%08x) = 0x%04x, expected 0x%04x", cases[i].in, got, cases[i].out);
        CHECK(u_of(gemm_bf16_round(f_of(cases[i].in))) == (uint32_t)cases[i].out << 16, "gemm_bf16_round(0x%08x)",
              cases[i].in);
    }
    /* On normal numbers it is the library's bf16 conversion (safetensors writer) exactly. */
    for (uint32_t i = 0; i < 100000; i++) {
        uint32_t u = (uint32_t)ds4_rng_u64(5, 1, i);
        if ((u & 0x7f800000u) == 0 || (u & 0x7f800000u) == 0x7f800000u) continue;
        CHECK(gemm_bf16_bits(f_of(u)) == ds4_f32_to_bf16(f_of(u)), "0x%08x", u);
    }
    /* The array kernels of mixed precision's activations (round in place, pack, unpack) give the same
     * bits as gemm_bf16_bits on every kind of value, the hand-picked ones and random patterns of every
     * exponent (Inf, NaN, denormals included); more than one OpenMP chunk. */
    enum { NV = 300000 };
    float *x = malloc(NV * sizeof(float)), *back = malloc(NV * sizeof(float));
    uint16_t *packed = malloc(NV * sizeof(uint16_t));
    uint16_t *want = malloc(NV * sizeof(uint16_t));
    const size_t nc = sizeof cases / sizeof *cases;
    for (uint32_t i = 0; i < NV; i++) {
        const uint32_t u = i < nc ? cases[i].in : (uint32_t)ds4_rng_u64(6, 2, i);
        x[i] = f_of(u);
        want[i] = gemm_bf16_bits(x[i]);
    }
    tensor_pack_bf16(CPU_EXEC, packed, x, NV);
    tensor_round_bf16(CPU_EXEC, x, NV);
    tensor_unpack_bf16(CPU_EXEC, back, packed, NV);
    int64_t bad = 0;
    for (uint32_t i = 0; i < NV; i++)
        bad += packed[i] != want[i] || u_of(x[i]) != (uint32_t)want[i] << 16 || u_of(back[i]) != (uint32_t)want[i] << 16;
    CHECK(bad == 0, "%lld of %d values: the array kernels round differently from gemm_bf16_bits", (long long)bad, NV);
    free(x);
    free(back);
    free(packed);
    free(want);
}

/* Through the engine, K = 1 with the other operand 1.0: C = bf16(x)·1 + 0 exactly, so C shows the
 * packer's rounding of every value (ties, Inf, NaN, overflow to Inf, denormal to 0; the sign of a
 * zero is lost in the + 0), for A and for B of each layout (different packing code). */
static void test_packer_rounding(void) {
    enum { NV = 517 }; /* odd, several 32-tiles and a partial one */
    float v[NV];
    for (int i = 0; i < NV; i++) {
        uint32_t u = (uint32_t)ds4_rng_u64(6, 2, (uint64_t)i);
        if (i % 3 == 0) u = (u & 0xffff0000u) | 0x8000u;        /* exact ties */
        if (i % 7 == 0) u = (u & 0x807fffffu) | 0x3f000000u;    /* moderate magnitudes */
        if ((u & 0x7f800000u) == 0x7f800000u) u &= 0xbfffffffu; /* Inf and NaN only where placed below */
        v[i] = f_of(u);
        if (i % 11 == 0) v[i] = f_of(0x3f808000u + ((uint32_t)i << 16)); /* tie at various exponents */
    }
    v[5] = INFINITY, v[6] = -INFINITY, v[100] = NAN, v[200] = f_of(0x7f7fffffu), v[300] = f_of(0x00000003u);
    float one[NV], C[NV];
    for (int i = 0; i < NV; i++) one[i] = 1.0f;
    for (int op = 0; op < 3; op++)
        for (int side = 0; side < 2; side++) {
            /* side 0: A holds the values (M = NV, N = 1); side 1: B holds them (M = 1, N = NV). With K = 1
             * every stored layout is a plain vector, leading dimension 1 or the vector length. */
            int64_t M = side ? 1 : NV, N = side ? NV : 1;
            const float *A = side ? one : v, *B = side ? v : one;
            int64_t lda = op == OP_TN ? M : 1, ldb = op == OP_NT ? 1 : N;
            for (int i = 0; i < NV; i++) C[i] = NAN;
            gemm_op(BF16_EXEC, op, M, N, 1, A, lda, B, ldb, C, N, 0.0f);
            int bad = 0;
            for (int i = 0; i < NV; i++)
                if (u_of(C[i]) != u_of(gemm_bf16_round(v[i])) && !(isnan(C[i]) && isnan(v[i])) &&
                    !(C[i] == 0 && gemm_bf16_round(v[i]) == 0) && bad++ < 3) /* 0 + (-0) is +0 */
                    t_note("  0x%08x -> 0x%08x, expected 0x%08x", u_of(v[i]), u_of(C[i]), u_of(gemm_bf16_round(v[i])));
            CHECK(bad == 0, "%s gemm_%s %s packer: %d of %d values not rounded like gemm_bf16_bits", g_engine_name,
                  OP_NAME[op], side ? "B" : "A", bad, NV);
        }
}

/* The AVX512-BF16 engine's AVX-512 packers make the portable packers' panels word for word: both layouts
 * they take (lanes adjacent, runs along k contiguous) and a strided one they hand on, every tile edge (rows
 * or columns 1..width, K odd and even, past 32), values at rounding ties, ±0, denormals, Inf and NaN. */
static void test_avx512bf16_packers(void) {
    const gemm_engine *fast = gemm_engine_avx512bf16(), *ref = gemm_engine_dpbf16_portable();
    if (!fast || ds4_isa_best() < DS4_ISA_AVX512BF16) {
        t_note("test_kernels_bf16: SKIP the AVX-512 packers: this CPU or build has no AVX512-BF16");
        return;
    }
    enum { L = 40, KMAX = 70, S = 3 }; /* up to 40 lanes (32-column panels + a partial), K up to 70 */
    float *v = falloc((int64_t)L * KMAX * S);
    uint16_t *h = calloc((size_t)L * KMAX * S, sizeof *h);
    for (int i = 0; i < L * KMAX * S; i++) {
        uint32_t u = (uint32_t)ds4_rng_u64(9, 4, (uint64_t)i);
        if (i % 3 == 0) u = (u & 0xffff0000u) | 0x8000u; /* ties */
        if (i % 13 == 0) u &= 0x807fffffu;               /* denormals and zeros */
        v[i] = f_of(u);
        h[i] = (uint16_t)u;
    }
    v[7] = INFINITY, v[8] = -INFINITY, v[9] = NAN, v[10] = -0.0f, v[11] = f_of(0x7f7fffffu), v[12] = f_of(0x7fa00001u);
    const int64_t words = (KMAX / 2 + 1) * 32;
    uint32_t *pf = calloc((size_t)words, 4), *pr = calloc((size_t)words, 4);
    int bad = 0, cases = 0;
    /* layouts: 0 lanes adjacent, 1 runs along k contiguous, 2 both strided */
    for (int layout = 0; layout < 3; layout++)
        for (int64_t kc = 1; kc <= KMAX; kc += kc < 36 ? 1 : 17)
            for (int64_t nl = 1; nl <= 32; nl += nl < 16 ? 1 : 5) {
                const int64_t ls = layout == 0 ? 1 : layout == 1 ? KMAX : S * KMAX, ks = layout == 0 ? L : layout == 1 ? 1 : S;
                for (int side = 0; side < 3; side++) { /* A, B, B from bf16 bits */
                    if (side == 0 && nl > fast->mr) continue;
                    const int64_t width = side == 0 ? fast->mr : fast->nr;
                    memset(pf, 0xab, (size_t)words * 4);
                    memset(pr, 0xcd, (size_t)words * 4);
                    if (side == 0) {
                        const gemm_view A = {.p = v, .rs = ls, .cs = ks};
                        fast->pack_a(pf, A, 1, nl, 2, kc), ref->pack_a(pr, A, 1, nl, 2, kc);
                    } else if (side == 1) {
                        const gemm_view B = {.p = v, .rs = ks, .cs = ls};
                        fast->pack_b(pf, B, 2, kc, 1, nl), ref->pack_b(pr, B, 2, kc, 1, nl);
                    } else {
                        const gemm_view B = {.h = h, .rs = ks, .cs = ls};
                        fast->pack_b_bf16(pf, B, 2, kc, 1, nl), ref->pack_b_bf16(pr, B, 2, kc, 1, nl);
                    }
                    cases++;
                    const int64_t n = (kc + 1) / 2 * width;
                    if (memcmp(pf, pr, (size_t)n * 4) != 0 && bad++ < 3)
                        t_note("  layout %d side %d kc %lld lanes %lld: panels differ", layout, side, (long long)kc,
                               (long long)nl);
                }
            }
    CHECK(bad == 0, "AVX-512 packers: %d of %d panels differ from the portable packers'", bad, cases);
    free(v), free(h), free(pf), free(pr);
}

/* ---------------------------------------------------------------- accuracy against the reference */

/* The engine vs the bf16 reference on one shape, padded leading dimensions, beta 0 (C preset to NaN:
 * must not be read) or 1. Bound per element: the products of bf16 operands are exact in fp32, and an
 * engine's result is an fp32 sum of those K products and beta·C in some fixed order: the classical recursive
 * summation bound (Higham, Accuracy and Stability, eq. 4.4) gives |err| <= γ_K·S with S = Σ_k |ã_ik·b̃_kj|
 * + |beta·C_ij| and γ_K = K·u/(1 − K·u), u = 2^-24. The reference is the exact sum rounded once (u·S).
 * So |C − ref| <= (K + 2)·u·S (γ's denominator is below 1.0001 for K < 1700). The same bound would
 * fail for an engine that did not round its operands to bf16 (errors ~2^-9·S). */
static void bf16_case(int op, int64_t M, int64_t N, int64_t K, int64_t pad, float beta, double *worst_ratio) {
    int64_t ar, ac, br, bc;
    ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = falloc(ar * lda), *B = falloc(br * ldb), *Cf = falloc(M * ldc), *Cr = falloc(M * ldc),
          *C0 = falloc(M * ldc);
    t_fill(A, ar * lda, (unsigned)(M * 31 + K), 1.0f);
    t_fill(B, br * ldb, (unsigned)(N * 17 + K + 5), 1.0f);
    t_fill(C0, M * ldc, 99, 4.0f);
    for (int64_t e = 0; e < M * ldc; e++) /* padding: a sentinel; with beta 0, C must not be read: NaN */
        if (e % ldc >= N || beta == 0) C0[e] = e % ldc >= N ? 12345.0f : NAN;
    memcpy(Cf, C0, (size_t)(M * ldc) * sizeof(float));
    memcpy(Cr, C0, (size_t)(M * ldc) * sizeof(float));
    bf16_ref_of(op)(M, N, K, A, lda, B, ldb, Cr, ldc, beta);
    gemm_op(BF16_EXEC, op, M, N, K, A, lda, B, ldb, Cf, ldc, beta);
    int bad = 0, bad_pad = 0;
    for (int64_t i = 0; i < M; i++) {
        for (int64_t j = 0; j < N; j++) {
            double s = beta == 0 ? 0 : fabs((double)C0[i * ldc + j]);
            for (int64_t k = 0; k < K; k++)
                s += fabs((double)gemm_bf16_round(a_at(op, A, lda, i, k)) * gemm_bf16_round(b_at(op, B, ldb, k, j)));
            double bound = (double)(K + 2) * 0x1p-24 * s * 1.0001, err = fabs((double)Cf[i * ldc + j] - Cr[i * ldc + j]);
            if (!(err <= bound)) {
                if (bad++ < 3)
                    t_note("  gemm_%s M=%lld N=%lld K=%lld [%lld,%lld]: %.9g vs ref %.9g, err %.3g > bound %.3g",
                           OP_NAME[op], (long long)M, (long long)N, (long long)K, (long long)i, (long long)j,
                           Cf[i * ldc + j], Cr[i * ldc + j], err, bound);
            } else if (bound > 0 && err / bound > *worst_ratio) {
                *worst_ratio = err / bound;
            }
        }
        for (int64_t j = N; j < ldc; j++) bad_pad += Cf[i * ldc + j] != 12345.0f;
    }
    CHECK(bad == 0, "%s gemm_%s M=%lld N=%lld K=%lld pad=%lld beta=%g: %d elements beyond the bound", g_engine_name, OP_NAME[op],
          (long long)M, (long long)N, (long long)K, (long long)pad, beta, bad);
    CHECK(bad_pad == 0, "gemm_%s M=%lld N=%lld K=%lld: %d elements beyond column N written", OP_NAME[op],
          (long long)M, (long long)N, (long long)K, bad_pad);
    free(A), free(B), free(Cf), free(Cr), free(C0);
}

static void test_edge_shapes(void) {
    /* around the tiles (6, 14, 16, 32), the K chunk (32), the K slices (256, 512) and the row blocks (192,
     * 224); K = 1 and odd K exercise the zero-padded pair of the VNNI layout */
    static const int64_t MS[] = {1, 2, 15, 16, 17, 33, 64, 225};
    static const int64_t NS[] = {1, 3, 16, 17, 31, 32, 33, 70, 513};
    static const int64_t KS[] = {1, 2, 3, 31, 32, 33, 63, 511, 513, 1025};
    double worst = 0;
    int64_t n_cases = 0;
    for (int op = 0; op < 3; op++)
        for (size_t a = 0; a < sizeof MS / sizeof *MS; a++)
            for (size_t b = 0; b < sizeof NS / sizeof *NS; b++) {
                size_t c = (a * 3 + b * 7 + (size_t)op) % (sizeof KS / sizeof *KS);
                int64_t M = MS[a], N = NS[b], K = KS[c];
                if (M * N * K > 4000000) K = 33;
                bf16_case(op, M, N, K, (a + b) % 2 ? 3 : 0, (a + b + c) % 2 ? 1.0f : 0.0f, &worst);
                n_cases++;
            }
    /* every K on a shape with full and partial tiles, both betas */
    for (int op = 0; op < 3; op++)
        for (size_t c = 0; c < sizeof KS / sizeof *KS; c++) {
            bf16_case(op, 40, 45, KS[c], 2, 0.0f, &worst);
            bf16_case(op, 40, 45, KS[c], 0, 1.0f, &worst);
        }
    /* wider than one packed B block (8192 columns); several K slices and row blocks, threaded */
    for (int op = 0; op < 3; op++) {
        bf16_case(op, 3, 8200, 7, 1, 1.0f, &worst);
        bf16_case(op, 460, 40, 1100, 0, 0.0f, &worst);
    }
    CHECK(n_cases == 3 * 8 * 9);
    t_note("  %s vs bf16 reference: worst err/bound %.3g", g_engine_name, worst);
}

/* In bf16 mode too: K = 0 is the empty sum (C = beta·C; beta 0 writes zeros without reading C),
 * M or N = 0 write nothing, and a 1×1×1 product of bf16 values accumulates exactly. */
static void test_degenerate(void) {
    const float A[4] = {0}, B[4] = {0}, before[6] = {1, 2, 3, 4, 5, 6};
    for (int op = 0; op < 3; op++)
        for (int beta = 0; beta <= 1; beta++) {
            float c[6];
            for (int i = 0; i < 6; i++) c[i] = beta ? before[i] : NAN;
            gemm_op(BF16_EXEC, op, 2, 3, 0, A, 1, B, 3, c, 3, (float)beta);
            int bad = 0;
            for (int i = 0; i < 6; i++) bad += c[i] != (beta ? before[i] : 0.0f);
            gemm_op(BF16_EXEC, op, 0, 3, 2, A, 2, B, 3, c, 3, 0.0f); /* M = 0 */
            gemm_op(BF16_EXEC, op, 2, 0, 2, A, 2, B, 2, c, 3, 0.0f); /* N = 0 */
            for (int i = 0; i < 6; i++) bad += c[i] != (beta ? before[i] : 0.0f);
            CHECK(bad == 0, "gemm_%s beta=%d: K = 0 or M, N = 0 gave the wrong C", OP_NAME[op], beta);
        }
    float a = 3, b = -2, c = 0.5f;
    gemm_nt(BF16_EXEC, 1, 1, 1, &a, 1, &b, 1, &c, 1, 1.0f);
    CHECK(c == -5.5f, "1x1x1 accumulate: %g", c);
}

/* ---------------------------------------------------------------- determinism */

/* A fixed C plus A·B, computed on `threads` OpenMP threads (a new array). */
static float *product_on(int threads, int op, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                         const float *B, int64_t ldb) {
    float *C = falloc(M * N);
    t_fill(C, M * N, 9, 1.0f);
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    gemm_op(BF16_EXEC, op, M, N, K, A, lda, B, ldb, C, N, 1.0f);
    omp_set_num_threads(saved);
    return C;
}

/* Same inputs → same bits: run to run, and for 1, 2 and 3 threads (tasks split differently); and
 * the three layouts compute the same bits from transposed storage (their packers agree). */
static void test_deterministic(void) {
    const int64_t M = 300, N = 200, K = 1100; /* 66M multiply-adds: threaded, 3 K slices */
    float *ref = falloc(M * N);
    for (int op = 0; op < 3; op++) {
        int64_t ar, ac, br, bc;
        ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
        float *A = falloc(ar * ac), *B = falloc(br * bc), *C[4];
        /* the same logical A and B for every op, stored per layout */
        float *Al = falloc(M * K), *Bl = falloc(K * N);
        t_fill(Al, M * K, 7, 1.0f);
        t_fill(Bl, K * N, 8, 1.0f);
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++) A[op == OP_TN ? k * M + i : i * K + k] = Al[i * K + k];
        for (int64_t k = 0; k < K; k++)
            for (int64_t j = 0; j < N; j++) B[op == OP_NT ? j * K + k : k * N + j] = Bl[k * N + j];
        for (int r = 0; r < 4; r++) C[r] = product_on(r == 0 ? 1 : r, op, M, N, K, A, ac, B, bc);
        size_t bytes = (size_t)(M * N) * sizeof(float);
        CHECK(memcmp(C[0], C[1], bytes) == 0, "gemm_%s: run to run differs", OP_NAME[op]);
        CHECK(memcmp(C[1], C[2], bytes) == 0, "gemm_%s: 1 vs 2 threads differ", OP_NAME[op]);
        CHECK(memcmp(C[1], C[3], bytes) == 0, "gemm_%s: 1 vs 3 threads differ", OP_NAME[op]);
        if (op == 0) memcpy(ref, C[1], bytes);
        else CHECK(memcmp(ref, C[1], bytes) == 0, "gemm_%s vs gemm_nt: different bits", OP_NAME[op]);
        for (int r = 0; r < 4; r++) free(C[r]);
        free(A), free(B), free(Al), free(Bl);
    }
    free(ref);
}

/* Called from inside a parallel region (each thread its own GEMM, as a caller parallel over experts
 * would): every thread configures and releases its own tiles, and gets the serial bits. */
static void test_nested_parallel(void) {
    const int64_t M = 130, N = 70, K = 600;
    float *A = falloc(M * K), *B = falloc(N * K), *ref = falloc(M * N), *C[2] = {falloc(M * N), falloc(M * N)};
    t_fill(A, M * K, 51, 1.0f);
    t_fill(B, N * K, 52, 1.0f);
    gemm_nt(BF16_EXEC, M, N, K, A, K, B, K, ref, N, 0);
#pragma omp parallel num_threads(2)
    {
        int t = omp_get_thread_num();
        if (t < 2) gemm_nt(BF16_EXEC, M, N, K, A, K, B, K, C[t], N, 0);
    }
    for (int t = 0; t < 2; t++)
        CHECK(memcmp(ref, C[t], (size_t)(M * N) * sizeof(float)) == 0, "nested call on thread %d differs", t);
    free(A), free(B), free(ref), free(C[0]), free(C[1]);
}

/* ---------------------------------------------------------------- the switch */

/* The precision is the context's: bf16 works on every CPU (whatever engine the dispatch chose) and is the
 * bf16 product, not the fp32 one; a bf16 context between two fp32 ones leaves the fp32 results bit for bit
 * as they were. */
static void test_precision_switch(void) {
    CHECK(!strcmp(ds4_matmul_precision_name(DS4_MATMUL_BF16), "bf16"));
    CHECK(!strcmp(ds4_matmul_precision_name(DS4_MATMUL_FP32), "fp32"));
    const int64_t M = 70, N = 90, K = 300;
    float *A = falloc(M * K), *B = falloc(N * K), *c0 = falloc(M * N), *c1 = falloc(M * N), *c2 = falloc(M * N);
    t_fill(A, M * K, 31, 1.0f);
    t_fill(B, N * K, 32, 1.0f);
    gemm_nt(CPU_EXEC, M, N, K, A, K, B, K, c0, N, 0);
    gemm_nt(BF16_EXEC, M, N, K, A, K, B, K, c1, N, 0);
    CHECK(memcmp(c0, c1, (size_t)(M * N) * sizeof(float)) != 0, "bf16 mode gave the fp32 bits");
    /* bf16 mode is the bf16 product (fp32 accumulation error only); fp32 mode is far from it (operand
     * rounding, ~2^-9 relative per operand) */
    float *r = falloc(M * N);
    cpu_gemm_nt_bf16_ref(M, N, K, A, K, B, K, r, N, 0);
    CHECK(t_rel_err(c1, r, M * N) < 1e-6, "bf16 mode vs bf16 reference: %.3g", t_rel_err(c1, r, M * N));
    CHECK(t_rel_err(c0, r, M * N) > 1e-4, "fp32 mode vs bf16 reference: %.3g", t_rel_err(c0, r, M * N));
    free(r);
    gemm_nt(CPU_EXEC, M, N, K, A, K, B, K, c2, N, 0);
    CHECK(memcmp(c0, c2, (size_t)(M * N) * sizeof(float)) == 0, "fp32 bits changed after a bf16 context");
    /* fp32 mode is an fp32 kernel, not a bf16 one: within the fp32 tolerance of the fp32 reference */
    cpu_gemm_nt_ref(M, N, K, A, K, B, K, c1, N, 0);
    CHECK(t_rel_err(c2, c1, M * N) < 1e-6, "fp32 mode error %.3g", t_rel_err(c2, c1, M * N));
    free(A), free(B), free(c0), free(c1), free(c2);
}

/* ISA levels: names parse both ways; a level above this CPU's best is refused with the missing feature
 * named and the level kept; every level up to the best can be selected and picks an engine of that
 * level or below. */
static void test_isa_switch(void) {
    for (int i = 0; i < DS4_ISA_COUNT; i++) {
        ds4_isa back;
        CHECK(ds4_isa_parse(ds4_isa_name((ds4_isa)i), &back) && back == (ds4_isa)i, "level %d", i);
    }
    ds4_isa x;
    CHECK(!ds4_isa_parse("avx513", &x) && !ds4_isa_parse("", &x) && !ds4_isa_parse(NULL, &x));
    ds4_isa best = ds4_isa_best(), was = ds4_isa_current();
    CHECK(was <= best);
    if (best + 1 < DS4_ISA_COUNT) {
        CHECK(ds4_isa_select((ds4_isa)(best + 1)) == DS4_ERR_UNSUPPORTED);
        CHECK(strstr(ds4_errmsg(), "missing") && strstr(ds4_errmsg(), ds4_isa_name(best)), "%s", ds4_errmsg());
        CHECK(ds4_isa_current() == was);
    }
    CHECK(ds4_isa_select((ds4_isa)99) == DS4_ERR_ARG);
    for (int i = 0; i <= (int)best; i++) {
        CHECK(ds4_isa_select((ds4_isa)i) == DS4_OK, "%s: %s", ds4_isa_name((ds4_isa)i), ds4_errmsg());
        const cpu_engines *t = cpu_engines_active();
        CHECK(t->isa == (ds4_isa)i);
        CHECK((i == DS4_ISA_GENERIC) == (t->gemm_f32 == NULL), "%s: fp32 engine %s", ds4_isa_name((ds4_isa)i),
              t->gemm_f32 ? t->gemm_f32->name : "none");
        CHECK((i == DS4_ISA_GENERIC) == (t->gemm_bf16 == NULL), "%s: bf16 engine %s", ds4_isa_name((ds4_isa)i),
              t->gemm_bf16 ? t->gemm_bf16->name : "none");
    }
    char info[2048];
    ds4_isa_describe(info, sizeof info);
    CHECK(strstr(info, "gemm fp32:") && strstr(info, "gemm bf16:") && strstr(info, "isa level:"), "%s", info);
    CHECK(ds4_isa_select(was) == DS4_OK);
}

/* ---------------------------------------------------------------- memory */

/* WORK bytes (peak above live) of one bf16 GEMM, real or in a plan context, with the workspace reserved
 * (in the same context, as a model does) or not. */
static int64_t work_peak_of(int op, bool plan, bool reserve, const float *A, const float *B, float *C,
                            int64_t M, int64_t N, int64_t K) {
    ds4_mem_stats s0, s1;
    if (reserve) gemm_workspace_reserve(plan ? BF16_PLAN_EXEC : BF16_EXEC);
    ds4_mem_reset_peak();
    ds4_mem_get(&s0);
    int64_t lda = op == OP_TN ? M : K, ldb = op == OP_NT ? K : N;
    gemm_op(plan ? BF16_PLAN_EXEC : BF16_EXEC, op, M, N, K, A, lda, B, ldb, C, N, 0.0f);
    ds4_mem_get(&s1);
    if (reserve) gemm_workspace_release(plan ? BF16_PLAN_EXEC : BF16_EXEC);
    return s1.peak[DS4_MEM_WORK] - s0.live[DS4_MEM_WORK];
}

/* The packing buffers depend on the shape only: a run in a plan context (memplan) counts what a real run
 * allocates; with the workspace reserved the bf16 slices fit in it (nothing more allocated) and the
 * result bits do not depend on which buffers were used. */
static void test_memory(void) {
    if (!g_engine) return; /* the reference packs nothing */
    const int64_t M = 500, N = 300, K = 700;
    float *A = falloc(M * K), *B = falloc(K * N), *c1 = falloc(M * N), *c2 = falloc(M * N);
    t_fill(A, M * K, 41, 1.0f);
    t_fill(B, K * N, 42, 1.0f);
    for (int op = 0; op < 3; op++) {
        int64_t real = work_peak_of(op, false, false, A, B, c1, M, N, K);
        int64_t plan = work_peak_of(op, true, false, A, B, c2, M, N, K);
        CHECK(real > 0 && real == plan, "gemm_%s: real run %lld WORK bytes, plan %lld", OP_NAME[op],
              (long long)real, (long long)plan);
        int64_t pooled = work_peak_of(op, false, true, A, B, c2, M, N, K);
        int64_t pooled_plan = work_peak_of(op, true, true, A, B, c2, M, N, K);
        CHECK(pooled == 0 && pooled_plan == 0, "gemm_%s with the reserved workspace: %lld / %lld bytes more",
              OP_NAME[op], (long long)pooled, (long long)pooled_plan);
        CHECK(memcmp(c1, c2, (size_t)(M * N) * sizeof(float)) == 0, "gemm_%s: pooled vs transient buffers differ",
              OP_NAME[op]);
    }
    free(A), free(B), free(c1), free(c2);
}

/* ---------------------------------------------------------------- B given as bf16 bits */

static uint16_t *bits_of(const float *x, int64_t n) {
    uint16_t *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) h[i] = gemm_bf16_bits(x[i]);
    return h;
}

static int64_t differing(const float *a, const float *b, int64_t n) {
    int64_t d = 0;
    for (int64_t i = 0; i < n; i++) d += u_of(a[i]) != u_of(b[i]);
    return d;
}

/* One shape: gemm_nt / gemm_nn with B as bf16 bits (a weight's compute copy) against the same GEMM in
 * bf16 precision on the fp32 B, bit for bit (padding columns of C untouched too); B holds denormals
 * (flushed by both), exact bf16 values and values that round up to the next binade. */
static void hb_case(int op, int64_t M, int64_t N, int64_t K, int64_t pad, float beta) {
    int64_t ar, ac, br, bc;
    ab_shape(op, M, N, K, &ar, &ac, &br, &bc);
    int64_t lda = ac + pad, ldb = bc + pad, ldc = N + pad;
    float *A = falloc(ar * lda), *B = falloc(br * ldb), *C1 = falloc(M * ldc), *C2 = falloc(M * ldc);
    t_fill(A, ar * lda, (unsigned)(M * 13 + K), 1.0f);
    t_fill(B, br * ldb, (unsigned)(N * 7 + K + 1), 1.0f);
    for (int64_t e = 0; e < br * ldb; e += 37) B[e] = e % 3 == 0 ? 1e-40f : e % 3 == 1 ? 0.5f : f_of(0x3fffffffu);
    t_fill(C1, M * ldc, 3, 2.0f);
    memcpy(C2, C1, (size_t)(M * ldc) * sizeof(float));
    uint16_t *Bh = bits_of(B, br * ldb);
    if (op == OP_NT) {
        gemm_nt(BF16_EXEC, M, N, K, A, lda, B, ldb, C1, ldc, beta);
        cpu_gemm_nt_hb(M, N, K, A, lda, Bh, ldb, C2, ldc, beta);
    } else {
        gemm_nn(BF16_EXEC, M, N, K, A, lda, B, ldb, C1, ldc, beta);
        cpu_gemm_nn_hb(M, N, K, A, lda, Bh, ldb, C2, ldc, beta);
    }
    int64_t d = differing(C1, C2, M * ldc);
    CHECK(d == 0, "%s gemm_%s M=%lld N=%lld K=%lld pad=%lld beta=%g: %lld elements differ with B as bf16 bits",
          g_engine_name, OP_NAME[op], (long long)M, (long long)N, (long long)K, (long long)pad, beta, (long long)d);
    /* the reference of bf16 bits is the bf16 reference */
    memcpy(C2, C1, (size_t)(M * ldc) * sizeof(float));
    (op == OP_NT ? cpu_gemm_nt_bf16_ref : cpu_gemm_nn_bf16_ref)(M, N, K, A, lda, B, ldb, C1, ldc, 1.0f);
    (op == OP_NT ? cpu_gemm_nt_hb_ref : cpu_gemm_nn_hb_ref)(M, N, K, A, lda, Bh, ldb, C2, ldc, 1.0f);
    d = differing(C1, C2, M * ldc);
    CHECK(d == 0, "gemm_%s_hb_ref M=%lld N=%lld K=%lld: %lld elements differ from the bf16 reference", OP_NAME[op],
          (long long)M, (long long)N, (long long)K, (long long)d);
    free(A), free(B), free(C1), free(C2), free(Bh);
}

static void test_bf16_weight_gemm(void) {
    static const int64_t MS[] = {1, 2, 15, 16, 17, 33, 225};
    static const int64_t NS[] = {1, 3, 16, 17, 31, 32, 33, 513};
    static const int64_t KS[] = {1, 2, 3, 31, 32, 33, 63, 511, 513, 1025};
    for (int op = OP_NT; op <= OP_NN; op++)
        for (size_t a = 0; a < sizeof MS / sizeof *MS; a++)
            for (size_t b = 0; b < sizeof NS / sizeof *NS; b++) {
                size_t c = (a * 5 + b * 3 + (size_t)op) % (sizeof KS / sizeof *KS);
                int64_t K = MS[a] * NS[b] * KS[c] > 4000000 ? 33 : KS[c];
                hb_case(op, MS[a], NS[b], K, (a + b) % 2 ? 3 : 0, (a + c) % 2 ? 1.0f : 0.0f);
            }
    for (int op = OP_NT; op <= OP_NN; op++) {
        hb_case(op, 3, 8200, 7, 1, 1.0f); /* wider than one packed B block */
        hb_case(op, 460, 40, 1100, 0, 0.0f); /* several K slices and row blocks, threaded */
    }
}

/* The layers on a weight's bf16 copy: linear, grouped linear (forward and backward) and the routed
 * experts give the bits of the same layers on the fp32 weights in bf16 precision. */
static void test_bf16_weight_layers(void) {
    const int64_t N = 37, IC = 70, OC = 45, G = 2, R = 9, Din = 35, D = 24, I = 40, ne = 11;
    float *x = falloc(N * IC), *w = falloc(OC * IC), *dout = falloc(N * OC);
    float *o1 = falloc(N * OC), *o2 = falloc(N * OC), *dx1 = falloc(N * IC), *dx2 = falloc(N * IC);
    float *dw1 = falloc(OC * IC), *dw2 = falloc(OC * IC);
    t_fill(x, N * IC, 1, 1.0f), t_fill(w, OC * IC, 2, 0.5f), t_fill(dout, N * OC, 3, 1.0f);
    uint16_t *wh = bits_of(w, OC * IC);
    linear_fwd(BF16_EXEC, o1, x, w, N, IC, OC);
    linear_fwd_bf16w(BF16_EXEC, o2, x, wh, N, IC, OC);
    CHECK(differing(o1, o2, N * OC) == 0, "%s: linear_fwd_bf16w differs from linear_fwd", g_engine_name);
    linear_bwd(BF16_EXEC, dx1, dw1, dout, x, w, N, IC, OC);
    linear_bwd_bf16w(BF16_EXEC, dx2, dw2, dout, x, wh, N, IC, OC);
    CHECK(differing(dx1, dx2, N * IC) == 0 && differing(dw1, dw2, OC * IC) == 0,
          "%s: linear_bwd_bf16w differs from linear_bwd", g_engine_name);
    /* grouped: o [N, G, Din], w [G, R, Din], z [N, G, R] (reusing the buffers above, big enough) */
    uint16_t *gh = bits_of(w, G * R * Din);
    grouped_linear_fwd(BF16_EXEC, o1, x, w, N, G, R, Din);
    grouped_linear_fwd_bf16w(BF16_EXEC, o2, x, gh, N, G, R, Din);
    CHECK(differing(o1, o2, N * G * R) == 0, "%s: grouped_linear_fwd_bf16w differs", g_engine_name);
    memset(dx1, 0, (size_t)(N * IC) * sizeof(float)), memset(dx2, 0, (size_t)(N * IC) * sizeof(float));
    grouped_linear_bwd(BF16_EXEC, dx1, dw1, dout, x, w, N, G, R, Din);
    grouped_linear_bwd_bf16w(BF16_EXEC, dx2, dw2, dout, x, gh, N, G, R, Din);
    CHECK(differing(dx1, dx2, N * G * Din) == 0 && differing(dw1, dw2, G * R * Din) == 0,
          "%s: grouped_linear_bwd_bf16w differs", g_engine_name);
    /* two routed experts on ne rows each */
    float *ew = falloc(6 * I * D), *xr = falloc(2 * ne * D), *rw = falloc(2 * ne), *y1 = falloc(2 * ne * D),
          *y2 = falloc(2 * ne * D), *h[4], *act = falloc(2 * ne * I); /* [R, I]: the experts may run side by side */
    for (int k = 0; k < 4; k++) h[k] = falloc(2 * ne * I);
    t_fill(ew, 6 * I * D, 4, 0.3f), t_fill(xr, 2 * ne * D, 5, 1.0f), t_fill(rw, 2 * ne, 6, 1.0f);
    uint16_t *eh = bits_of(ew, 6 * I * D);
    moe_expert_w ws[2];
    for (int e = 0; e < 2; e++) {
        float *b = ew + 3 * e * I * D;
        ws[e] = (moe_expert_w){b, b + I * D, b + 2 * I * D};
    }
    const int64_t off[3] = {0, ne, 2 * ne};
    moe_experts_args a1 = {.nexp = 2, .D = D, .I = I, .limit = 7.0f, .off = off, .w = ws, .x = xr, .rw = rw,
                           .h1 = h[0], .h3 = h[1], .act = act};
    moe_experts_args a2 = a1;
    a2.wbase = ew, a2.hcopy = eh, a2.h1 = h[2], a2.h3 = h[3];
    moe_experts_fwd(BF16_EXEC, &a1, y1);
    moe_experts_fwd(BF16_EXEC, &a2, y2);
    CHECK(differing(y1, y2, 2 * ne * D) == 0 && differing(h[0], h[2], 2 * ne * I) == 0,
          "%s: routed experts on bf16 copies differ", g_engine_name);
    free(ew), free(xr), free(rw), free(y1), free(y2), free(act), free(eh);
    for (int k = 0; k < 4; k++) free(h[k]);
    free(x), free(w), free(dout), free(o1), free(o2), free(dx1), free(dx2), free(dw1), free(dw2), free(wh), free(gh);
}

/* One engine of the bf16 GEMM through every test above. */
static void run_engine_tests(void) {
    const cpu_engines *t = cpu_engines_active();
    g_engine = t->gemm_bf16;
    g_engine_name = g_engine ? g_engine->name : "portable bf16 reference";
    t_note("test_kernels_bf16: engine %s", g_engine_name);
    RUN(test_packer_rounding);
    RUN(test_edge_shapes);
    RUN(test_degenerate);
    RUN(test_deterministic);
    RUN(test_nested_parallel);
    RUN(test_memory);
    RUN(test_bf16_weight_gemm);
    RUN(test_bf16_weight_layers);
}

int main(void) {
    RUN(test_bf16_rounding_values);
    RUN(test_precision_switch);
    RUN(test_isa_switch);
    RUN(test_avx512bf16_packers);
    ds4_isa was = ds4_isa_current();
    /* every level: its bf16 engine (amx: tiles; avx512bf16: VDPBF16PS; avx512, avx2: fp32 FMAs of rounded
     * operands; generic: the reference itself); levels above this CPU's are skipped, never failed */
    for (int i = DS4_ISA_COUNT - 1; i >= 0; i--) {
        if (ds4_isa_select((ds4_isa)i) != DS4_OK) {
            t_note("test_kernels_bf16: SKIP level %s: %s", ds4_isa_name((ds4_isa)i), ds4_errmsg());
            continue;
        }
        run_engine_tests();
    }
    /* the VDPBF16PS panel layout through a portable tile of the same arithmetic, on any CPU */
    kernels_override_gemm_bf16(gemm_engine_dpbf16_portable());
    run_engine_tests();
    kernels_override_gemm_bf16(NULL);
    if (ds4_isa_select(was) != DS4_OK) t_failed++, t_note("  FAIL restoring the ISA level: %s", ds4_errmsg());
    TEST_MAIN_END("test_kernels_bf16");
}
