/* The CUDA backend's ground floor against the cpu backend (tests/cuda/cuda_check.h): GEMMs in fp32 and
 * bf16 (and fp32 is not TF32), linear and grouped layers (fp32, bf16, bf16 weights), embedding, RMSNorm,
 * RoPE, clamped SwiGLU, cross-entropy, the data ops, AdamW, the MoE gate, routing and routed experts;
 * each also run twice for the same bits.
 * The argument checks run without a GPU too. */
#include "cuda_check.h"
#include "ds4/model.h"
#include "ds4/train.h"

static const ds4_kernel_backend *cpu(void) { return ds4_kernel_backend_cpu(); }
/* The cpu backend's entries called as the model's wrappers call them, and the precision its GEMMs use:
 * the one place to adapt when the entries take a context. */
static ds4_exec g_cpu_exec; /* the cpu entries' context: real, its matmul precision set by cpu_precision */
#define CPU(op, ...) cpu()->op(&g_cpu_exec, __VA_ARGS__)
static void cpu_precision(ds4_matmul_precision p) { g_cpu_exec.matmul_precision = p; }
static cudaStream_t S; /* the stream every launcher here runs on */
static cuda_blas *BL;

/* ---------------------------------------------------------------- GEMM bounds */
/* Row-major operands as the GEMM reads them: A(i, k) and B(k, j) of op ("nt", "nn", "tn"). */
static double op_a(const char *op, const float *A, int64_t lda, int64_t i, int64_t k) {
    return op[0] == 't' ? A[k * lda + i] : A[i * lda + k];
}
static double op_b(const char *op, const float *B, int64_t ldb, int64_t k, int64_t j) {
    return op[1] == 't' ? B[j * ldb + k] : B[k * ldb + j];
}
static double bf(double x, bool round) { return round ? (double)gemm_bf16_round((float)x) : x; }

/* bound [M, N] of C = beta·C0 + op(A)·op(B), two fp32 results computed in different orders:
 * cc_dot_bound(K + 1, beta·|C0| + Σ_k |a·b|) with a, b rounded to bf16 first when bf16. */
static void gemm_bound(double *bound, const char *op, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                       const float *B, int64_t ldb, const float *C0, int64_t ldc, float beta, bool bf16) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = beta != 0 ? fabs((double)C0[i * ldc + j]) : 0;
            for (int64_t k = 0; k < K; k++) s += fabs(bf(op_a(op, A, lda, i, k), bf16) * bf(op_b(op, B, ldb, k, j), bf16));
            bound[i * N + j] = cc_dot_bound(K + 1, s);
        }
}

typedef ds4_status cuda_gemm_fn(cuda_blas *, cudaStream_t, ds4_matmul_precision, int64_t, int64_t, int64_t,
                                const float *, int64_t, const float *, int64_t, float *, int64_t, float);

/* One GEMM shape: the cpu's gemm_<op> in precision p vs cuda_gemm_<op>, within the bound; twice: same bits. */
static void gemm_case(const char *op, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K, int64_t pad, float beta,
                      unsigned seed) {
    const bool ta = op[0] == 't', tb = op[1] == 't';
    const int64_t lda = (ta ? M : K) + pad, ldb = (tb ? K : N) + pad, ldc = N + pad;
    const int64_t na = (ta ? K : M) * lda, nb = (tb ? N : K) * ldb, nc = M * ldc;
    float *A = cc_hostf(na), *B = cc_hostf(nb), *C0 = cc_hostf(nc), *Cc = cc_hostf(nc), *Cg = cc_hostf(nc),
          *Cg2 = cc_hostf(nc);
    cc_fill(A, na, seed, 1.0f);
    cc_fill(B, nb, seed + 1, 1.0f);
    cc_fill(C0, nc, seed + 2, 1.0f);
    memcpy(Cc, C0, (size_t)nc * sizeof(float));
    cuda_gemm_fn *gf = op[0] == 't' ? cuda_gemm_tn : op[1] == 't' ? cuda_gemm_nt : cuda_gemm_nn;
    cpu_precision(p);
    if (ta) CPU(gemm_tn, M, N, K, A, lda, B, ldb, Cc, ldc, beta);
    else if (tb) CPU(gemm_nt, M, N, K, A, lda, B, ldb, Cc, ldc, beta);
    else CPU(gemm_nn, M, N, K, A, lda, B, ldb, Cc, ldc, beta);
    cpu_precision(DS4_MATMUL_FP32);
    float *dA = cc_upf(A, na), *dB = cc_upf(B, nb), *dC = cc_upf(C0, nc);
    CC_OK(gf(BL, S, p, M, N, K, dA, lda, dB, ldb, dC, ldc, beta));
    cc_down(Cg, dC, (size_t)nc * sizeof(float));
    cc_reload(dC, C0, (size_t)nc * sizeof(float));
    CC_OK(gf(BL, S, p, M, N, K, dA, lda, dB, ldb, dC, ldc, beta));
    cc_down(Cg2, dC, (size_t)nc * sizeof(float));
    /* compare the M×N results (padding columns must be untouched: compared bitwise with C0) */
    double *bound = (double *)malloc((size_t)(M * N) * sizeof(double));
    float *rc = cc_hostf(M * N), *rg = cc_hostf(M * N);
    gemm_bound(bound, op, M, N, K, A, lda, B, ldb, C0, ldc, beta, p == DS4_MATMUL_BF16);
    bool pad_kept = true;
    for (int64_t i = 0; i < M; i++) {
        memcpy(rc + i * N, Cc + i * ldc, (size_t)N * sizeof(float));
        memcpy(rg + i * N, Cg + i * ldc, (size_t)N * sizeof(float));
        for (int64_t j = N; j < ldc; j++) pad_kept &= memcmp(&Cg[i * ldc + j], &C0[i * ldc + j], 4) == 0;
    }
    char what[128];
    snprintf(what, sizeof what, "gemm_%s %s M%lld N%lld K%lld pad %lld beta %g", op, ds4_matmul_precision_name(p),
             (long long)M, (long long)N, (long long)K, (long long)pad, (double)beta);
    cc_within(what, rg, rc, bound, M * N);
    CHECK(pad_kept, "%s: wrote outside its M×N block", what);
    CHECK(memcmp(Cg, Cg2, (size_t)nc * sizeof(float)) == 0, "%s: two runs differ", what);
    free(bound), free(rc), free(rg), free(A), free(B), free(C0), free(Cc), free(Cg), free(Cg2);
    cc_free(dA), cc_free(dB), cc_free(dC);
}

static void test_gemm_fp32(void) {
    const char *ops[] = {"nt", "nn", "tn"};
    for (int o = 0; o < 3; o++) {
        gemm_case(ops[o], DS4_MATMUL_FP32, 67, 45, 131, 3, 0, 10 + o);
        gemm_case(ops[o], DS4_MATMUL_FP32, 67, 45, 131, 0, 1, 20 + o);
        gemm_case(ops[o], DS4_MATMUL_FP32, 256, 192, 512, 0, 1, 30 + o);
        gemm_case(ops[o], DS4_MATMUL_FP32, 48, 200, 4096, 0, 1, 35 + o); /* V4's hidden width as K */
        gemm_case(ops[o], DS4_MATMUL_FP32, 1, 7, 1, 0, 0, 40 + o);
        gemm_case(ops[o], DS4_MATMUL_FP32, 5, 6, 0, 2, 0, 45 + o); /* K = 0: C = 0 (padding kept) */
    }
}

static void test_gemm_bf16(void) {
    const char *ops[] = {"nt", "nn", "tn"};
    for (int o = 0; o < 3; o++) {
        gemm_case(ops[o], DS4_MATMUL_BF16, 67, 45, 131, 3, 0, 50 + o);
        gemm_case(ops[o], DS4_MATMUL_BF16, 256, 192, 512, 0, 1, 60 + o);
        gemm_case(ops[o], DS4_MATMUL_BF16, 128, 64, 8, 8, 1, 70 + o);
        gemm_case(ops[o], DS4_MATMUL_BF16, 48, 200, 4096, 0, 1, 75 + o);
    }
}

/* The handle keeps 64 shapes' plans: a shape evicted by 70 others and planned again gives the same bits
 * (the algorithm is the heuristic's choice for the shape, not an accident of the cache). */
static void test_gemm_plan_cache(void) {
    const int64_t M = 96, N = 80, K = 72;
    float *A = cc_hostf(M * K), *B = cc_hostf(N * K), *C1 = cc_hostf(M * N), *C2 = cc_hostf(M * N);
    cc_fill(A, M * K, 90, 1.0f);
    cc_fill(B, N * K, 91, 1.0f);
    float *dA = cc_upf(A, M * K), *dB = cc_upf(B, N * K), *dC = (float *)cc_dev((size_t)(M * N) * 4);
    for (int p = 0; p < 2; p++) {
        const ds4_matmul_precision prec = p ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32;
        CC_OK(cuda_gemm_nt(BL, S, prec, M, N, K, dA, K, dB, K, dC, N, 0));
        cc_down(C1, dC, (size_t)(M * N) * 4);
        for (int64_t i = 1; i <= 70; i++) /* 70 other shapes */
            CC_OK(cuda_gemm_nt(BL, S, prec, M - i % 7, N - i / 7, K, dA, K, dB, K, dC, N, 0));
        cc_poison(dC, (size_t)(M * N) * 4);
        CC_OK(cuda_gemm_nt(BL, S, prec, M, N, K, dA, K, dB, K, dC, N, 0));
        cc_down(C2, dC, (size_t)(M * N) * 4);
        CHECK(!memcmp(C1, C2, (size_t)(M * N) * 4), "gemm %s: the shape planned again gives other bits",
              ds4_matmul_precision_name(prec));
    }
    free(A), free(B), free(C1), free(C2), cc_free(dA), cc_free(dB), cc_free(dC);
}

/* fp32 is true fp32: a = 1 + 2^-13 has 13 fraction bits, TF32 keeps 10 (bf16 7), so Σ_k a·1 over 256 terms
 * is exactly 256 + 2^-5 in fp32 and 256 in TF32 or bf16. The bf16 mode must give 256: it rounds. */
static void test_gemm_not_tf32(void) {
    const int64_t M = 256, N = 256, K = 256;
    float *A = cc_hostf(M * K), *B = cc_hostf(N * K), *C = cc_hostf(M * N);
    for (int64_t i = 0; i < M * K; i++) A[i] = 1.0f + 0x1p-13f;
    for (int64_t i = 0; i < N * K; i++) B[i] = 1.0f;
    float *dA = cc_upf(A, M * K), *dB = cc_upf(B, N * K), *dC = cc_upf(C, M * N);
    const float want[2] = {256.0f + 0x1p-5f, 256.0f};
    for (int p = 0; p < 2; p++) {
        CC_OK(cuda_gemm_nt(BL, S, p ? DS4_MATMUL_BF16 : DS4_MATMUL_FP32, M, N, K, dA, K, dB, K, dC, N, 0));
        cc_down(C, dC, (size_t)(M * N) * sizeof(float));
        int64_t bad = 0;
        for (int64_t i = 0; i < M * N; i++) bad += C[i] != want[p];
        CHECK(bad == 0, "gemm %s: %lld of %lld elements are not %.9g (first %.9g): %s", p ? "bf16" : "fp32",
              (long long)bad, (long long)(M * N), (double)want[p], (double)C[0],
              p ? "operands not rounded to bf16" : "the fp32 GEMM is not true fp32 (TF32?)");
    }
    free(A), free(B), free(C), cc_free(dA), cc_free(dB), cc_free(dC);
}

/* ---------------------------------------------------------------- linear layers */
/* Σ_k |a·b| bounds of the three GEMMs of a linear layer: fwd [N, OC], dinp [N, IC], dw [OC, IC]. */
static void linear_case(ds4_matmul_precision p, bool bf16w, int64_t N, int64_t IC, int64_t OC, unsigned seed) {
    float *inp = cc_hostf(N * IC), *w = cc_hostf(OC * IC), *dout = cc_hostf(N * OC), *dinp0 = cc_hostf(N * IC),
          *dw0 = cc_hostf(OC * IC);
    cc_fill(inp, N * IC, seed, 1.0f);
    cc_fill(w, OC * IC, seed + 1, 0.5f);
    cc_fill(dout, N * OC, seed + 2, 1.0f);
    cc_fill(dinp0, N * IC, seed + 3, 1.0f);
    cc_fill(dw0, OC * IC, seed + 4, 1.0f);
    uint16_t *wh = (uint16_t *)cc_host((size_t)(OC * IC) * 2);
    for (int64_t i = 0; i < OC * IC; i++) wh[i] = gemm_bf16_bits(w[i]);
    /* cpu */
    float *out_c = cc_hostf(N * OC), *dinp_c = cc_hostf(N * IC), *dw_c = cc_hostf(OC * IC);
    memcpy(dinp_c, dinp0, (size_t)(N * IC) * 4);
    memcpy(dw_c, dw0, (size_t)(OC * IC) * 4);
    cpu_precision(p);
    if (bf16w) {
        CPU(linear_fwd_bf16w, out_c, inp, wh, N, IC, OC);
        CPU(linear_bwd_bf16w, dinp_c, dw_c, dout, inp, wh, N, IC, OC);
    } else {
        CPU(linear_fwd, out_c, inp, w, N, IC, OC);
        CPU(linear_bwd, dinp_c, dw_c, dout, inp, w, N, IC, OC);
    }
    cpu_precision(DS4_MATMUL_FP32);
    /* cuda, twice */
    float *din = cc_upf(inp, N * IC), *dwt = cc_upf(w, OC * IC), *ddout = cc_upf(dout, N * OC);
    uint16_t *dwh = (uint16_t *)cc_up(wh, (size_t)(OC * IC) * 2);
    float *dout_g = (float *)cc_dev((size_t)(N * OC) * 4), *ddinp = cc_upf(dinp0, N * IC), *ddw = cc_upf(dw0, OC * IC);
    float *got[2][3];
    for (int r = 0; r < 2; r++) {
        cc_reload(ddinp, dinp0, (size_t)(N * IC) * 4);
        cc_reload(ddw, dw0, (size_t)(OC * IC) * 4);
        cc_poison(dout_g, (size_t)(N * OC) * 4);
        if (bf16w) {
            CC_OK(cuda_linear_fwd_bf16w(BL, S, dout_g, din, dwh, N, IC, OC));
            CC_OK(cuda_linear_bwd_bf16w(BL, S, p, ddinp, ddw, ddout, din, dwh, N, IC, OC));
        } else {
            CC_OK(cuda_linear_fwd(BL, S, p, dout_g, din, dwt, N, IC, OC));
            CC_OK(cuda_linear_bwd(BL, S, p, ddinp, ddw, ddout, din, dwt, N, IC, OC));
        }
        got[r][0] = cc_hostf(N * OC), got[r][1] = cc_hostf(N * IC), got[r][2] = cc_hostf(OC * IC);
        cc_down(got[r][0], dout_g, (size_t)(N * OC) * 4);
        cc_down(got[r][1], ddinp, (size_t)(N * IC) * 4);
        cc_down(got[r][2], ddw, (size_t)(OC * IC) * 4);
    }
    const bool bw = bf16w || p == DS4_MATMUL_BF16; /* the GEMMs that read w: bf16 */
    const bool bdw = p == DS4_MATMUL_BF16;          /* the dw GEMM: precision p */
    double *b_out = (double *)malloc((size_t)(N * OC) * 8), *b_in = (double *)malloc((size_t)(N * IC) * 8),
           *b_w = (double *)malloc((size_t)(OC * IC) * 8);
    gemm_bound(b_out, "nt", N, OC, IC, inp, IC, w, IC, NULL, OC, 0, bw);
    gemm_bound(b_in, "nn", N, IC, OC, dout, OC, w, IC, dinp0, IC, 1, bw);
    gemm_bound(b_w, "tn", OC, IC, N, dout, OC, inp, IC, dw0, IC, 1, bdw);
    char what[96];
    const char *name = bf16w ? "linear_bf16w" : "linear";
    snprintf(what, sizeof what, "%s %s out", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][0], out_c, b_out, N * OC);
    snprintf(what, sizeof what, "%s %s dinp", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][1], dinp_c, b_in, N * IC);
    snprintf(what, sizeof what, "%s %s dw", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][2], dw_c, b_w, OC * IC);
    CHECK(!memcmp(got[0][0], got[1][0], (size_t)(N * OC) * 4) && !memcmp(got[0][1], got[1][1], (size_t)(N * IC) * 4) &&
              !memcmp(got[0][2], got[1][2], (size_t)(OC * IC) * 4),
          "%s: two runs differ", name);
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 3; k++) free(got[r][k]);
    free(b_out), free(b_in), free(b_w), free(inp), free(w), free(dout), free(dinp0), free(dw0), free(wh);
    free(out_c), free(dinp_c), free(dw_c);
    cc_free(din), cc_free(dwt), cc_free(ddout), cc_free(dwh), cc_free(dout_g), cc_free(ddinp), cc_free(ddw);
}

static void test_linear(void) {
    linear_case(DS4_MATMUL_FP32, false, 96, 80, 48, 100);
    linear_case(DS4_MATMUL_BF16, false, 96, 80, 48, 110);
    linear_case(DS4_MATMUL_FP32, true, 96, 80, 48, 120);
    linear_case(DS4_MATMUL_BF16, true, 33, 72, 40, 130);
}

/* Grouped layer: z [N, G, R] = per group o[:, g, :] · w[g]^T, and its backward, cpu vs cuda. */
static void grouped_case(ds4_matmul_precision p, bool bf16w, int64_t N, int64_t G, int64_t R, int64_t Din,
                         unsigned seed) {
    const int64_t no = N * G * Din, nw = G * R * Din, nz = N * G * R;
    float *o = cc_hostf(no), *w = cc_hostf(nw), *dz = cc_hostf(nz), *do0 = cc_hostf(no), *dw0 = cc_hostf(nw);
    cc_fill(o, no, seed, 1.0f);
    cc_fill(w, nw, seed + 1, 0.5f);
    cc_fill(dz, nz, seed + 2, 1.0f);
    cc_fill(do0, no, seed + 3, 1.0f);
    cc_fill(dw0, nw, seed + 4, 1.0f);
    uint16_t *wh = (uint16_t *)cc_host((size_t)nw * 2);
    for (int64_t i = 0; i < nw; i++) wh[i] = gemm_bf16_bits(w[i]);
    float *z_c = cc_hostf(nz), *do_c = cc_hostf(no), *dw_c = cc_hostf(nw);
    memcpy(do_c, do0, (size_t)no * 4);
    memcpy(dw_c, dw0, (size_t)nw * 4);
    cpu_precision(p);
    if (bf16w) {
        CPU(grouped_linear_fwd_bf16w, z_c, o, wh, N, G, R, Din);
        CPU(grouped_linear_bwd_bf16w, do_c, dw_c, dz, o, wh, N, G, R, Din);
    } else {
        CPU(grouped_linear_fwd, z_c, o, w, N, G, R, Din);
        CPU(grouped_linear_bwd, do_c, dw_c, dz, o, w, N, G, R, Din);
    }
    cpu_precision(DS4_MATMUL_FP32);
    float *d_o = cc_upf(o, no), *d_w = cc_upf(w, nw), *d_dz = cc_upf(dz, nz), *d_z = (float *)cc_dev((size_t)nz * 4);
    float *d_do = cc_upf(do0, no), *d_dw = cc_upf(dw0, nw);
    uint16_t *d_wh = (uint16_t *)cc_up(wh, (size_t)nw * 2);
    float *got[2][3];
    for (int r = 0; r < 2; r++) {
        cc_reload(d_do, do0, (size_t)no * 4);
        cc_reload(d_dw, dw0, (size_t)nw * 4);
        cc_poison(d_z, (size_t)nz * 4);
        if (bf16w) {
            CC_OK(cuda_grouped_linear_fwd_bf16w(BL, S, d_z, d_o, d_wh, N, G, R, Din));
            CC_OK(cuda_grouped_linear_bwd_bf16w(BL, S, p, d_do, d_dw, d_dz, d_o, d_wh, N, G, R, Din));
        } else {
            CC_OK(cuda_grouped_linear_fwd(BL, S, p, d_z, d_o, d_w, N, G, R, Din));
            CC_OK(cuda_grouped_linear_bwd(BL, S, p, d_do, d_dw, d_dz, d_o, d_w, N, G, R, Din));
        }
        got[r][0] = cc_hostf(nz), got[r][1] = cc_hostf(no), got[r][2] = cc_hostf(nw);
        cc_down(got[r][0], d_z, (size_t)nz * 4);
        cc_down(got[r][1], d_do, (size_t)no * 4);
        cc_down(got[r][2], d_dw, (size_t)nw * 4);
    }
    /* bounds group by group, through the GEMM views of cpu/linear.inc */
    const bool bw = bf16w || p == DS4_MATMUL_BF16, bdw = p == DS4_MATMUL_BF16;
    double *bz = (double *)malloc((size_t)nz * 8), *bo = (double *)malloc((size_t)no * 8),
           *bw_ = (double *)malloc((size_t)nw * 8);
    double *t = (double *)malloc((size_t)(N * (R > Din ? R : Din) + R * Din) * 8);
    for (int64_t g = 0; g < G; g++) {
        gemm_bound(t, "nt", N, R, Din, o + g * Din, G * Din, w + g * R * Din, Din, NULL, 0, 0, bw);
        for (int64_t n = 0; n < N; n++)
            for (int64_t r = 0; r < R; r++) bz[(n * G + g) * R + r] = t[n * R + r];
        gemm_bound(t, "nn", N, Din, R, dz + g * R, G * R, w + g * R * Din, Din, do0 + g * Din, G * Din, 1, bw);
        for (int64_t n = 0; n < N; n++)
            for (int64_t d = 0; d < Din; d++) bo[(n * G + g) * Din + d] = t[n * Din + d];
        gemm_bound(t, "tn", R, Din, N, dz + g * R, G * R, o + g * Din, G * Din, dw0 + g * R * Din, Din, 1, bdw);
        memcpy(bw_ + g * R * Din, t, (size_t)(R * Din) * 8);
    }
    char what[96];
    const char *name = bf16w ? "grouped_linear_bf16w" : "grouped_linear";
    snprintf(what, sizeof what, "%s %s z", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][0], z_c, bz, nz);
    snprintf(what, sizeof what, "%s %s do", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][1], do_c, bo, no);
    snprintf(what, sizeof what, "%s %s dw", name, ds4_matmul_precision_name(p));
    cc_within(what, got[0][2], dw_c, bw_, nw);
    CHECK(!memcmp(got[0][0], got[1][0], (size_t)nz * 4) && !memcmp(got[0][1], got[1][1], (size_t)no * 4) &&
              !memcmp(got[0][2], got[1][2], (size_t)nw * 4),
          "%s: two runs differ", name);
    for (int r = 0; r < 2; r++)
        for (int k = 0; k < 3; k++) free(got[r][k]);
    free(bz), free(bo), free(bw_), free(t), free(o), free(w), free(dz), free(do0), free(dw0), free(wh);
    free(z_c), free(do_c), free(dw_c);
    cc_free(d_o), cc_free(d_w), cc_free(d_dz), cc_free(d_z), cc_free(d_do), cc_free(d_dw), cc_free(d_wh);
}

static void test_grouped_linear(void) {
    grouped_case(DS4_MATMUL_FP32, false, 40, 4, 24, 32, 200);
    grouped_case(DS4_MATMUL_BF16, false, 40, 4, 24, 32, 210);
    grouped_case(DS4_MATMUL_FP32, true, 40, 8, 16, 24, 220);
    grouped_case(DS4_MATMUL_BF16, true, 17, 3, 8, 40, 230);
}

/* ---------------------------------------------------------------- embedding */
static void test_embedding(void) {
    const int64_t V = 50, N = 301, D = 200;
    float *table = cc_hostf(V * D), *dout = cc_hostf(N * D), *dt0 = cc_hostf(V * D);
    int32_t *ids = (int32_t *)cc_host((size_t)N * 4);
    cc_fill(table, V * D, 1, 1.0f);
    cc_fill(dout, N * D, 2, 1.0f);
    cc_fill(dt0, V * D, 3, 1.0f);
    cc_fill_ids(ids, N, 4, (int32_t)V); /* 301 tokens over 50 rows: every row hit several times */
    float *out_c = cc_hostf(N * D), *dt_c = cc_hostf(V * D), *out_g = cc_hostf(N * D), *dt_g = cc_hostf(V * D),
          *dt_g2 = cc_hostf(V * D);
    memcpy(dt_c, dt0, (size_t)(V * D) * 4);
    CPU(embedding_fwd, out_c, table, ids, N, D);
    CPU(embedding_bwd, dt_c, dout, ids, N, D);
    float *d_t = cc_upf(table, V * D), *d_out = (float *)cc_dev((size_t)(N * D) * 4), *d_do = cc_upf(dout, N * D),
          *d_dt = cc_upf(dt0, V * D);
    int32_t *d_ids = (int32_t *)cc_up(ids, (size_t)N * 4);
    CC_OK(cuda_embedding_fwd(S, d_out, d_t, d_ids, N, D));
    CC_OK(cuda_embedding_bwd(S, d_dt, d_do, d_ids, N, D));
    cc_down(out_g, d_out, (size_t)(N * D) * 4);
    cc_down(dt_g, d_dt, (size_t)(V * D) * 4);
    cc_reload(d_dt, dt0, (size_t)(V * D) * 4);
    CC_OK(cuda_embedding_bwd(S, d_dt, d_do, d_ids, N, D));
    cc_down(dt_g2, d_dt, (size_t)(V * D) * 4);
    cc_same_bits("embedding_fwd vs cpu", out_g, out_c, (size_t)(N * D) * 4);
    cc_same_bits("embedding_bwd vs cpu", dt_g, dt_c, (size_t)(V * D) * 4);
    cc_same_bits("embedding_bwd rerun", dt_g2, dt_g, (size_t)(V * D) * 4);
    free(table), free(dout), free(dt0), free(ids), free(out_c), free(dt_c), free(out_g), free(dt_g), free(dt_g2);
    cc_free(d_t), cc_free(d_out), cc_free(d_do), cc_free(d_dt), cc_free(d_ids);
}

/* ---------------------------------------------------------------- RMSNorm */
/* rstd: the sum of squares is double on both sides in different orders (relative difference ~D·2^-53), so
 * the float r = 1/sqrt(...) is the same or one ulp apart: bound 2^-23·r. y = (x·r)·w: one ulp of r plus
 * two roundings that may go the other way: under 4 ulps, bound 2^-21·|y|. */
static void rmsnorm_case(int64_t N, int64_t D, bool weighted, unsigned seed) {
    float *x = cc_hostf(N * D), *w = cc_hostf(D), *dy = cc_hostf(N * D), *dx0 = cc_hostf(N * D), *dw0 = cc_hostf(D);
    cc_fill(x, N * D, seed, 2.0f);
    cc_fill(w, D, seed + 1, 1.0f);
    cc_fill(dy, N * D, seed + 2, 1.0f);
    cc_fill(dx0, N * D, seed + 3, 1.0f);
    cc_fill(dw0, D, seed + 4, 1.0f);
    const float *wp = weighted ? w : NULL;
    const float eps = 1e-6f;
    float *y_c = cc_hostf(N * D), *r_c = cc_hostf(N), *dx_c = cc_hostf(N * D), *dw_c = cc_hostf(D);
    memcpy(dx_c, dx0, (size_t)(N * D) * 4);
    memcpy(dw_c, dw0, (size_t)D * 4);
    CPU(rmsnorm_fwd, y_c, r_c, x, wp, N, D, eps);
    CPU(rmsnorm_bwd, dx_c, dw_c, dy, x, wp, r_c, N, D);
    float *d_x = cc_upf(x, N * D), *d_w = weighted ? cc_upf(w, D) : NULL, *d_y = (float *)cc_dev((size_t)(N * D) * 4),
          *d_r = (float *)cc_dev((size_t)N * 4), *d_dy = cc_upf(dy, N * D), *d_dx = cc_upf(dx0, N * D),
          *d_dw = cc_upf(dw0, D), *d_rc = cc_upf(r_c, N);
    float *y_g = cc_hostf(N * D), *r_g = cc_hostf(N), *dx_g = cc_hostf(N * D), *dw_g = cc_hostf(D), *y_g2 = cc_hostf(N * D),
          *dx_g2 = cc_hostf(N * D);
    CC_OK(cuda_rmsnorm_fwd(S, d_y, d_r, d_x, d_w, N, D, eps));
    cc_down(y_g, d_y, (size_t)(N * D) * 4);
    cc_down(r_g, d_r, (size_t)N * 4);
    /* the backward from the cpu's rstd, so it sees the cpu's inputs exactly */
    CC_OK(cuda_rmsnorm_bwd(S, d_dx, d_dw, d_dy, d_x, d_w, d_rc, N, D));
    cc_down(dx_g, d_dx, (size_t)(N * D) * 4);
    cc_down(dw_g, d_dw, (size_t)D * 4);
    CC_OK(cuda_rmsnorm_fwd(S, d_y, d_r, d_x, d_w, N, D, eps));
    cc_down(y_g2, d_y, (size_t)(N * D) * 4);
    cc_reload(d_dx, dx0, (size_t)(N * D) * 4);
    CC_OK(cuda_rmsnorm_bwd(S, d_dx, NULL, d_dy, d_x, d_w, d_rc, N, D));
    cc_down(dx_g2, d_dx, (size_t)(N * D) * 4);
    char what[80];
    snprintf(what, sizeof what, "rmsnorm%s N%lld D%lld rstd", weighted ? "" : " weightless", (long long)N, (long long)D);
    cc_within_rel(what, r_g, r_c, N, 0x1p-23, 0);
    snprintf(what, sizeof what, "rmsnorm%s y", weighted ? "" : " weightless");
    cc_within_rel(what, y_g, y_c, N * D, 0x1p-21, 0);
    /* dx = dx0 + (r·gw − c·x), c = r³·dot/D from a double dot (same or one ulp apart): the difference of
     * c·x (2 ulps) and three roundings that may flip: bound 2^-22·(|dx0| + |r·gw| + 3·|c·x|) per element. */
    double *b = (double *)malloc((size_t)(N * D) * 8);
    for (int64_t n = 0; n < N; n++) {
        double dot = 0;
        for (int64_t j = 0; j < D; j++) dot += (double)(dy[n * D + j] * (weighted ? w[j] : 1.0f)) * x[n * D + j];
        const double r = r_c[n], c = r * r * r * dot / (double)D;
        for (int64_t j = 0; j < D; j++)
            b[n * D + j] = 0x1p-22 * (fabs(dx0[n * D + j]) + fabs(r * dy[n * D + j] * (weighted ? w[j] : 1.0f)) +
                                      3 * fabs(c * x[n * D + j]));
    }
    snprintf(what, sizeof what, "rmsnorm%s dx", weighted ? "" : " weightless");
    cc_within(what, dx_g, dx_c, b, N * D);
    snprintf(what, sizeof what, "rmsnorm%s dw (column owners, n in order) vs cpu", weighted ? "" : " weightless");
    cc_same_bits(what, dw_g, dw_c, (size_t)D * 4);
    cc_same_bits("rmsnorm y rerun", y_g2, y_g, (size_t)(N * D) * 4);
    cc_same_bits("rmsnorm dx rerun", dx_g2, dx_g, (size_t)(N * D) * 4);
    free(b), free(x), free(w), free(dy), free(dx0), free(dw0), free(y_c), free(r_c), free(dx_c), free(dw_c);
    free(y_g), free(r_g), free(dx_g), free(dw_g), free(y_g2), free(dx_g2);
    cc_free(d_x), cc_free(d_w), cc_free(d_y), cc_free(d_r), cc_free(d_dy), cc_free(d_dx), cc_free(d_dw), cc_free(d_rc);
}

static void test_rmsnorm(void) {
    rmsnorm_case(37, 1000, true, 300);
    rmsnorm_case(64, 4096, true, 310);
    rmsnorm_case(9, 129, false, 320);
}

/* ---------------------------------------------------------------- RoPE: the same bits */
static void test_rope(void) {
    const int64_t N = 48, H = 3, hd = 40, rd = 16, period = 12, mult = 4;
    ds4_rope host, dev;
    CHECK(rope_table_init(&host, rd, period * mult, 10000.0, 4.0, 32, 32.0, 1.0), "%s", ds4_errmsg());
    CC_OK(cuda_rope_table_upload(S, &dev, &host));
    float *x = cc_hostf(N * H * hd), *xc = cc_hostf(N * H * hd), *xg = cc_hostf(N * H * hd), *xg2 = cc_hostf(N * H * hd);
    cc_fill(x, N * H * hd, 400, 1.0f);
    for (int inv = 0; inv < 2; inv++)
        for (int bwd = 0; bwd < 2; bwd++) {
            rope_args ac = {N, H, hd, period, mult, &host, inv != 0}, ag = ac;
            ag.table = &dev;
            memcpy(xc, x, (size_t)(N * H * hd) * 4);
            if (bwd) CPU(rope_bwd, xc, &ac);
            else CPU(rope_fwd, xc, &ac);
            float *d = cc_upf(x, N * H * hd);
            CC_OK(bwd ? cuda_rope_bwd(S, d, &ag) : cuda_rope_fwd(S, d, &ag));
            cc_down(xg, d, (size_t)(N * H * hd) * 4);
            cc_reload(d, x, (size_t)(N * H * hd) * 4);
            CC_OK(bwd ? cuda_rope_bwd(S, d, &ag) : cuda_rope_fwd(S, d, &ag));
            cc_down(xg2, d, (size_t)(N * H * hd) * 4);
            char what[64];
            snprintf(what, sizeof what, "rope_%s%s vs cpu", bwd ? "bwd" : "fwd", inv ? " inverse" : "");
            cc_same_bits(what, xg, xc, (size_t)(N * H * hd) * 4);
            CHECK(!memcmp(xg, xg2, (size_t)(N * H * hd) * 4), "%s: two runs differ", what);
            cc_free(d);
        }
    cuda_rope_table_free(&dev);
    rope_table_free(&host);
    free(x), free(xc), free(xg), free(xg2);
}

/* ---------------------------------------------------------------- SwiGLU */
/* e = exp(−g) is the double exp rounded to float here and glibc's expf on the cpu (within 0.502 ulp): the
 * same or one ulp apart; σ = 1/(1 + e) then within 3 ulps, act = (g·σ)·u within 5: bound 2^-20·|act|.
 * Backward terms: each within 16 ulps of its size, |dact·u|·(1 + |g|) bounds every term (σ <= 1,
 * |1 − σ| <= 1), |dact·g| the du term: bound 2^-20·(|grad0| + |term|). */
static void test_swiglu(void) {
    const int64_t N = 33, I = 301, n = N * I;
    const float limit = 3.0f;
    float *g = cc_hostf(n), *u = cc_hostf(n), *dact = cc_hostf(n), *dg0 = cc_hostf(n), *du0 = cc_hostf(n);
    cc_fill(g, n, 500, 6.0f); /* beyond the limit on both sides: clamped elements */
    cc_fill(u, n, 501, 6.0f);
    cc_fill(dact, n, 502, 1.0f);
    cc_fill(dg0, n, 503, 1.0f);
    cc_fill(du0, n, 504, 1.0f);
    for (int lim = 0; lim < 2; lim++) {
        const float L = lim ? limit : 0.0f;
        float *act_c = cc_hostf(n), *dg_c = cc_hostf(n), *du_c = cc_hostf(n);
        memcpy(dg_c, dg0, (size_t)n * 4);
        memcpy(du_c, du0, (size_t)n * 4);
        CPU(swiglu_fwd, act_c, g, u, N, I, L);
        CPU(swiglu_bwd, dg_c, du_c, dact, g, u, N, I, L);
        float *d_g = cc_upf(g, n), *d_u = cc_upf(u, n), *d_da = cc_upf(dact, n), *d_act = (float *)cc_dev((size_t)n * 4),
              *d_dg = cc_upf(dg0, n), *d_du = cc_upf(du0, n);
        float *act_g = cc_hostf(n), *dg_g = cc_hostf(n), *du_g = cc_hostf(n), *act_g2 = cc_hostf(n), *dg_g2 = cc_hostf(n);
        CC_OK(cuda_swiglu_fwd(S, d_act, d_g, d_u, N, I, L));
        CC_OK(cuda_swiglu_bwd(S, d_dg, d_du, d_da, d_g, d_u, N, I, L));
        cc_down(act_g, d_act, (size_t)n * 4);
        cc_down(dg_g, d_dg, (size_t)n * 4);
        cc_down(du_g, d_du, (size_t)n * 4);
        CC_OK(cuda_swiglu_fwd(S, d_act, d_g, d_u, N, I, L));
        cc_reload(d_dg, dg0, (size_t)n * 4);
        CC_OK(cuda_swiglu_bwd(S, d_dg, NULL, d_da, d_g, d_u, N, I, L));
        cc_down(act_g2, d_act, (size_t)n * 4);
        cc_down(dg_g2, d_dg, (size_t)n * 4);
        double *bg = (double *)malloc((size_t)n * 8), *bu = (double *)malloc((size_t)n * 8);
        for (int64_t i = 0; i < n; i++) {
            const double gc = L > 0 && g[i] > L ? L : g[i];
            const double uc = L > 0 ? fmin(fmax(u[i], -L), L) : u[i];
            bg[i] = 0x1p-20 * (fabs(dg0[i]) + fabs(dact[i] * uc) * (1 + fabs(gc)));
            bu[i] = 0x1p-20 * (fabs(du0[i]) + fabs(dact[i] * gc));
        }
        char what[64];
        snprintf(what, sizeof what, "swiglu limit %g act", (double)L);
        cc_within_rel(what, act_g, act_c, n, 0x1p-20, 0);
        snprintf(what, sizeof what, "swiglu limit %g dg", (double)L);
        cc_within(what, dg_g, dg_c, bg, n);
        snprintf(what, sizeof what, "swiglu limit %g du", (double)L);
        cc_within(what, du_g, du_c, bu, n);
        CHECK(!memcmp(act_g, act_g2, (size_t)n * 4) && !memcmp(dg_g, dg_g2, (size_t)n * 4), "swiglu: two runs differ");
        if (L > 0) { /* clamped elements pass no gradient: exactly the initial values there */
            int64_t leak = 0;
            for (int64_t i = 0; i < n; i++) leak += (g[i] > L && dg_g[i] != dg0[i]) || (fabs(u[i]) > L && du_g[i] != du0[i]);
            CHECK(leak == 0, "swiglu: %lld clamped elements got a gradient", (long long)leak);
        }
        free(bg), free(bu), free(act_c), free(dg_c), free(du_c), free(act_g), free(dg_g), free(du_g), free(act_g2),
            free(dg_g2);
        cc_free(d_g), cc_free(d_u), cc_free(d_da), cc_free(d_act), cc_free(d_dg), cc_free(d_du);
    }
    free(g), free(u), free(dact), free(dg0), free(du0);
}

/* ---------------------------------------------------------------- cross-entropy */
/* Row loss log Σe + m − l[t]: each e within one ulp of the cpu's (see swiglu), so Σe within 2^-23
 * relative, plus double sums in other orders (V·2^-53): the log within 2^-22 absolute; the total within
 * N·2^-22 plus the double sums' 2^-40 relative. dlogits = gs·(e·inv) (− gs at the target): e, inv one ulp
 * each, two roundings: bound 2^-20·(|d| + |gs|). */
static void ce_case(int64_t N, int64_t V, unsigned seed) {
    const float gs = 0.25f;
    float *logits = cc_hostf(N * V);
    int32_t *tg = (int32_t *)cc_host((size_t)N * 4);
    cc_fill(logits, N * V, seed, 8.0f);
    cc_fill_ids(tg, N, seed + 1, (int32_t)V);
    tg[1] = -1, tg[N / 2] = -1, tg[N - 1] = (int32_t)V; /* not scored: −1 and out of range */
    double loss_c = 0;
    int64_t n_c = 0;
    float *dl_c = cc_hostf(N * V), *dl_g = cc_hostf(N * V), *dl_g2 = cc_hostf(N * V);
    CPU(cross_entropy_fwd_bwd, &loss_c, &n_c, dl_c, logits, tg, N, V, gs);
    float *d_l = cc_upf(logits, N * V), *d_dl = (float *)cc_dev((size_t)(N * V) * 4);
    int32_t *d_t = (int32_t *)cc_up(tg, (size_t)N * 4);
    double *d_loss = (double *)cc_dev(8), *d_rows = (double *)cc_dev(cuda_cross_entropy_scratch_bytes(N));
    int64_t *d_n = (int64_t *)cc_dev(8);
    double loss_g = 0, loss_g2 = 0;
    int64_t n_g = 0;
    CC_OK(cuda_cross_entropy_fwd_bwd(S, d_loss, d_n, d_dl, d_l, d_t, N, V, gs, d_rows));
    cc_down(&loss_g, d_loss, 8);
    cc_down(&n_g, d_n, 8);
    cc_down(dl_g, d_dl, (size_t)(N * V) * 4);
    cc_poison(d_dl, (size_t)(N * V) * 4);
    CC_OK(cuda_cross_entropy_fwd_bwd(S, d_loss, d_n, d_dl, d_l, d_t, N, V, gs, d_rows));
    cc_down(&loss_g2, d_loss, 8);
    cc_down(dl_g2, d_dl, (size_t)(N * V) * 4);
    CHECK(n_g == n_c && n_c == N - 3, "cross_entropy: scored %lld rows on the gpu, %lld on the cpu, want %lld",
          (long long)n_g, (long long)n_c, (long long)(N - 3));
    const double lb = (double)N * 0x1p-22 + 0x1p-40 * fabs(loss_c);
    t_note("  cross_entropy loss sum: gpu %.17g cpu %.17g, |diff| %.3g (bound %.3g)", loss_g, loss_c,
           fabs(loss_g - loss_c), lb);
    CHECK(fabs(loss_g - loss_c) <= lb, "cross_entropy: loss sum %.17g vs cpu %.17g", loss_g, loss_c);
    double *b = (double *)malloc((size_t)(N * V) * 8);
    for (int64_t i = 0; i < N * V; i++) b[i] = 0x1p-20 * (fabs(dl_c[i]) + gs);
    cc_within("cross_entropy dlogits", dl_g, dl_c, b, N * V);
    CHECK(memcmp(&loss_g, &loss_g2, 8) == 0 && !memcmp(dl_g, dl_g2, (size_t)(N * V) * 4), "cross_entropy: two runs differ");
    /* loss only (dlogits NULL): the same sum */
    CC_OK(cuda_cross_entropy_fwd_bwd(S, d_loss, d_n, NULL, d_l, d_t, N, V, gs, d_rows));
    cc_down(&loss_g2, d_loss, 8);
    CHECK(memcmp(&loss_g, &loss_g2, 8) == 0, "cross_entropy: loss without dlogits %.17g vs %.17g", loss_g2, loss_g);
    free(b), free(logits), free(tg), free(dl_c), free(dl_g), free(dl_g2);
    cc_free(d_l), cc_free(d_dl), cc_free(d_t), cc_free(d_loss), cc_free(d_rows), cc_free(d_n);
}

static void test_cross_entropy(void) {
    ce_case(70, 3001, 600);
    ce_case(6, 129280, 610); /* V4's vocabulary: rows of 129280 logits */
}

/* ---------------------------------------------------------------- data ops: the same bits */
static void test_data_ops(void) {
    const int64_t n = 10007;
    float *a = cc_hostf(n), *b = cc_hostf(n), *c = cc_hostf(n), *g = cc_hostf(n);
    cc_fill(a, n, 700, 3.0f);
    cc_fill(b, n, 701, 3.0f);
    /* the rounding's corner cases: ties (odd and even), NaN, ±Inf, denormals, ±0, overflow to Inf */
    const uint32_t special[] = {0x3f808000u, 0x3f818000u, 0x7fc00001u, 0xff800001u, 0x7f800000u, 0xff800000u,
                                0x00000001u, 0x807fffffu, 0x00000000u, 0x80000000u, 0x7f7fffffu, 0x3f80ffffu};
    for (size_t i = 0; i < sizeof special / 4; i++) memcpy(&a[i], &special[i], 4);
    float *da = cc_upf(a, n), *db = cc_upf(b, n);
    /* add */
    memcpy(c, a, (size_t)n * 4);
    CPU(tensor_add, c, b, n);
    CC_OK(cuda_tensor_add(S, da, db, n));
    cc_down(g, da, (size_t)n * 4);
    cc_same_floats("tensor_add (NaN payloads aside)", g, c, n);
    /* round_bf16 */
    cc_reload(da, a, (size_t)n * 4);
    memcpy(c, a, (size_t)n * 4);
    CPU(tensor_round_bf16, c, n);
    CC_OK(cuda_tensor_round_bf16(S, da, n));
    cc_down(g, da, (size_t)n * 4);
    cc_same_bits("tensor_round_bf16", g, c, (size_t)n * 4);
    /* pack / unpack */
    uint16_t *hc = (uint16_t *)cc_host((size_t)n * 2), *hg = (uint16_t *)cc_host((size_t)n * 2);
    uint16_t *dh = (uint16_t *)cc_dev((size_t)n * 2);
    cc_reload(da, a, (size_t)n * 4);
    CPU(tensor_pack_bf16, hc, a, n);
    CC_OK(cuda_tensor_pack_bf16(S, dh, da, n));
    cc_down(hg, dh, (size_t)n * 2);
    cc_same_bits("tensor_pack_bf16", hg, hc, (size_t)n * 2);
    CPU(tensor_unpack_bf16, c, hc, n);
    CC_OK(cuda_tensor_unpack_bf16(S, db, dh, n));
    cc_down(g, db, (size_t)n * 4);
    cc_same_bits("tensor_unpack_bf16", g, c, (size_t)n * 4);
    /* copy / zero */
    CC_OK(cuda_tensor_copy(S, db, da, (size_t)n * 4));
    cc_down(g, db, (size_t)n * 4);
    cc_same_bits("tensor_copy", g, a, (size_t)n * 4);
    CC_OK(cuda_tensor_zero(S, db, (size_t)n * 4));
    cc_down(g, db, (size_t)n * 4);
    memset(c, 0, (size_t)n * 4);
    cc_same_bits("tensor_zero", g, c, (size_t)n * 4);
    free(hc), free(hg), cc_free(dh);
    /* shift_ids */
    const int64_t B = 3, T = 37;
    int32_t *ids = (int32_t *)cc_host((size_t)(B * T) * 4), *oc = (int32_t *)cc_host((size_t)(B * T) * 4),
            *og = (int32_t *)cc_host((size_t)(B * T) * 4);
    cc_fill_ids(ids, B * T, 702, 1000);
    int32_t *dids = (int32_t *)cc_up(ids, (size_t)(B * T) * 4), *dout = (int32_t *)cc_dev((size_t)(B * T) * 4);
    for (int64_t shift = 0; shift <= T; shift += 18) {
        CPU(shift_ids, oc, ids, B, T, shift, -7);
        CC_OK(cuda_shift_ids(S, dout, dids, B, T, shift, -7));
        cc_down(og, dout, (size_t)(B * T) * 4);
        cc_same_bits("shift_ids", og, oc, (size_t)(B * T) * 4);
    }
    free(ids), free(oc), free(og), cc_free(dids), cc_free(dout);
    free(a), free(b), free(c), free(g), cc_free(da), cc_free(db);
}

static void test_streams(void) {
    const int64_t N = 53, D = 70;
    for (int64_t ns = 1; ns <= 4; ns++) {
        const int64_t nX = N * ns * D;
        float *X = cc_hostf(nX), *x = cc_hostf(N * D), *Xc = cc_hostf(nX), *Xg = cc_hostf(nX), *dx = cc_hostf(N * D),
              *dxc = cc_hostf(N * D), *dxg = cc_hostf(N * D);
        cc_fill(X, nX, 800 + (unsigned)ns, 1.0f);
        cc_fill(x, N * D, 810, 1.0f);
        cc_fill(dx, N * D, 820, 1.0f);
        float *dX = cc_upf(X, nX), *dxx = cc_upf(x, N * D), *ddx = cc_upf(dx, N * D);
        memcpy(Xc, X, (size_t)nX * 4);
        CPU(streams_expand, Xc, N, ns, D);
        CC_OK(cuda_streams_expand(S, dX, N, ns, D));
        cc_down(Xg, dX, (size_t)nX * 4);
        cc_same_bits("streams_expand", Xg, Xc, (size_t)nX * 4);
        cc_reload(dX, X, (size_t)nX * 4);
        memcpy(Xc, X, (size_t)nX * 4);
        CPU(streams_add, Xc, x, N, ns, D);
        CC_OK(cuda_streams_add(S, dX, dxx, N, ns, D));
        cc_down(Xg, dX, (size_t)nX * 4);
        cc_same_bits("streams_add", Xg, Xc, (size_t)nX * 4);
        cc_reload(dX, X, (size_t)nX * 4);
        memcpy(dxc, dx, (size_t)(N * D) * 4);
        CPU(streams_sum, dxc, X, N, ns, D);
        CC_OK(cuda_streams_sum(S, ddx, dX, N, ns, D));
        cc_down(dxg, ddx, (size_t)(N * D) * 4);
        cc_same_bits("streams_sum", dxg, dxc, (size_t)(N * D) * 4);
        free(X), free(x), free(Xc), free(Xg), free(dx), free(dxc), free(dxg);
        cc_free(dX), cc_free(dxx), cc_free(ddx);
    }
}

/* ---------------------------------------------------------------- AdamW: the cpu optimizer's bits */
/* The cpu optimizer's per-element update (ds4_adamw_update, src/core/norm.c) and the CUDA one on the same
 * constants, three steps, one range with weight decay and one without: the same bits. */
static void test_adamw(void) {
    const int64_t n = 5003, half = 2500;
    const ds4_adamw_cfg cfg = {3e-3, 0.9, 0.95, 1e-8, 0.1};
    float *w = cc_hostf(n), *g = cc_hostf(n), *wg = cc_hostf(n), *mg = cc_hostf(n), *vg = cc_hostf(n);
    float *m = cc_hostf(n), *v = cc_hostf(n);
    cc_fill(w, n, 900, 1.0f);
    memset(m, 0, (size_t)n * 4);
    memset(v, 0, (size_t)n * 4);
    float *dw = cc_upf(w, n), *dg = (float *)cc_dev((size_t)n * 4), *dm = (float *)cc_dev((size_t)n * 4),
          *dv = (float *)cc_dev((size_t)n * 4);
    CC_OK(cuda_fill(S, dm, 0, (size_t)n * 4));
    CC_OK(cuda_fill(S, dv, 0, (size_t)n * 4));
    for (int step = 1; step <= 3; step++) {
        cc_fill(g, n, 910 + (unsigned)step, 0.1f);
        const double lr = cfg.lr * step / 3;
        const cuda_adamw_k k = cuda_adamw_consts(step, cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay, lr);
        const ds4_adamw_consts kc = {.b1 = k.b1, .b2 = k.b2, .eps = k.eps, .omb1 = k.omb1, .omb2 = k.omb2, .step_size = k.step_size,
                                     .inv_sqrt_bc2 = k.inv_sqrt_bc2, .decay = k.decay};
        ds4_adamw_update(half, w, g, m, v, kc, true);
        ds4_adamw_update(n - half, w + half, g + half, m + half, v + half, kc, false);
        cc_reload(dg, g, (size_t)n * 4);
        CC_OK(cuda_adamw_update(S, &k, half, dm, dv, 1, dw, dg));
        CC_OK(cuda_adamw_update(S, &k, n - half, dm + half, dv + half, 0, dw + half, dg + half));
    }
    cc_down(wg, dw, (size_t)n * 4);
    cc_down(mg, dm, (size_t)n * 4);
    cc_down(vg, dv, (size_t)n * 4);
    cc_same_bits("adamw w after 3 steps", wg, w, (size_t)n * 4);
    cc_same_bits("adamw m", mg, m, (size_t)n * 4);
    cc_same_bits("adamw v", vg, v, (size_t)n * 4);
    free(w), free(g), free(wg), free(mg), free(vg), free(m), free(v);
    cc_free(dw), cc_free(dg), cc_free(dm), cc_free(dv);
}

/* ---------------------------------------------------------------- MoE gate */
/* scores = sqrt(softplus(l)): expf and log1pf each within an ulp of the cpu's, sqrt halves the relative
 * difference: bound 2^-21·s. weights = s/S·scale with S a K-term sum of such scores: bound 2^-20·w. The
 * selection must be the cpu's (random logits leave no two scores within a few ulps). */
static void gate_case(bool hashed, bool with_bias, unsigned seed) {
    const int64_t N = 200, E = 64, K = 6, V = 97;
    const float rs = 2.5f;
    float *logits = cc_hostf(N * E), *bias = cc_hostf(E), *dwts = cc_hostf(N * K), *dl0 = cc_hostf(N * E);
    int64_t *tid2eid = (int64_t *)cc_host((size_t)(V * K) * 8);
    int32_t *ids = (int32_t *)cc_host((size_t)N * 4);
    cc_fill(logits, N * E, seed, 24.0f); /* some above softplus's threshold of 20 */
    cc_fill(bias, E, seed + 1, 0.5f);
    cc_fill(dwts, N * K, seed + 2, 1.0f);
    cc_fill(dl0, N * E, seed + 3, 1.0f);
    cc_fill_ids(ids, N, seed + 4, (int32_t)V);
    for (int64_t v = 0; v < V; v++)
        for (int64_t k = 0; k < K; k++) tid2eid[v * K + k] = (v * 7 + k * 11) % E;
    int32_t *idx_c = (int32_t *)cc_host((size_t)(N * K) * 4), *idx_g = (int32_t *)cc_host((size_t)(N * K) * 4);
    float *w_c = cc_hostf(N * K), *s_c = cc_hostf(N * E), *w_g = cc_hostf(N * K), *s_g = cc_hostf(N * E);
    moe_gate_args ac = {{N, E, K}, rs, logits, with_bias ? bias : NULL, hashed ? tid2eid : NULL, ids, idx_c, w_c, s_c};
    CPU(moe_gate_fwd, &ac);
    float *d_l = cc_upf(logits, N * E), *d_b = cc_upf(bias, E), *d_w = (float *)cc_dev((size_t)(N * K) * 4),
          *d_s = (float *)cc_dev((size_t)(N * E) * 4);
    int64_t *d_t2e = (int64_t *)cc_up(tid2eid, (size_t)(V * K) * 8);
    int32_t *d_ids = (int32_t *)cc_up(ids, (size_t)N * 4), *d_idx = (int32_t *)cc_dev((size_t)(N * K) * 4);
    moe_gate_args ag = {{N, E, K}, rs, d_l, with_bias ? d_b : NULL, hashed ? d_t2e : NULL, d_ids, d_idx, d_w, d_s};
    CC_OK(cuda_moe_gate_fwd(S, &ag));
    cc_down(idx_g, d_idx, (size_t)(N * K) * 4);
    cc_down(w_g, d_w, (size_t)(N * K) * 4);
    cc_down(s_g, d_s, (size_t)(N * E) * 4);
    char what[80];
    snprintf(what, sizeof what, "moe_gate_fwd%s%s idx", hashed ? " hashed" : "", with_bias ? " bias" : "");
    cc_same_bits(what, idx_g, idx_c, (size_t)(N * K) * 4);
    cc_within_rel("moe_gate_fwd scores", s_g, s_c, N * E, 0x1p-21, 0);
    cc_within_rel("moe_gate_fwd weights", w_g, w_c, N * K, 0x1p-20, 0);
    /* backward from the cpu's idx and scores: only σ(l) differs (three ulps): bound 2^-20·(|dl0| + |term|) */
    float *dl_c = cc_hostf(N * E), *dl_g = cc_hostf(N * E), *dl_g2 = cc_hostf(N * E);
    memcpy(dl_c, dl0, (size_t)(N * E) * 4);
    moe_gate_grads gc = {dwts, dl_c};
    CPU(moe_gate_bwd, &ac, &gc);
    cc_reload(d_idx, idx_c, (size_t)(N * K) * 4);
    cc_reload(d_s, s_c, (size_t)(N * E) * 4);
    float *d_dw = cc_upf(dwts, N * K), *d_dl = cc_upf(dl0, N * E);
    moe_gate_grads gg = {d_dw, d_dl};
    CC_OK(cuda_moe_gate_bwd(S, &ag, &gg));
    cc_down(dl_g, d_dl, (size_t)(N * E) * 4);
    cc_reload(d_dl, dl0, (size_t)(N * E) * 4);
    CC_OK(cuda_moe_gate_bwd(S, &ag, &gg));
    cc_down(dl_g2, d_dl, (size_t)(N * E) * 4);
    double *b = (double *)malloc((size_t)(N * E) * 8);
    for (int64_t i = 0; i < N * E; i++) b[i] = 0x1p-20 * fabs(dl0[i]);
    for (int64_t n = 0; n < N; n++) {
        double S_ = 0, dot = 0;
        for (int64_t k = 0; k < K; k++) S_ += s_c[n * E + idx_c[n * K + k]];
        for (int64_t k = 0; k < K; k++) dot += dwts[n * K + k] * (s_c[n * E + idx_c[n * K + k]] / S_);
        for (int64_t k = 0; k < K; k++) {
            const int64_t e = idx_c[n * K + k];
            const double l = logits[n * E + e], sc = s_c[n * E + e];
            const double dsdl = sc == 0 ? 0 : (l > 20 ? 1 : 1 / (1 + exp(-l))) / (2 * sc);
            b[n * E + e] += 0x1p-20 * fabs(rs / S_ * (dwts[n * K + k] - dot) * dsdl);
        }
    }
    cc_within("moe_gate_bwd dlogits", dl_g, dl_c, b, N * E);
    CHECK(!memcmp(dl_g, dl_g2, (size_t)(N * E) * 4), "moe_gate_bwd: two runs differ");
    free(b), free(logits), free(bias), free(dwts), free(dl0), free(tid2eid), free(ids), free(idx_c), free(idx_g);
    free(w_c), free(s_c), free(w_g), free(s_g), free(dl_c), free(dl_g), free(dl_g2);
    cc_free(d_l), cc_free(d_b), cc_free(d_w), cc_free(d_s), cc_free(d_t2e), cc_free(d_ids), cc_free(d_idx);
    cc_free(d_dw), cc_free(d_dl);
}

static void test_moe_gate(void) {
    gate_case(false, true, 1000);
    gate_case(false, false, 1010);
    gate_case(true, false, 1020);
}

/* Routing as data ops: grouping, counts, the row moves and their accumulating backwards: the cpu's bits. */
static void test_moe_routing(void) {
    const int64_t N = 123, E = 16, K = 4, D = 37, NK = N * K;
    int32_t *idx = (int32_t *)cc_host((size_t)NK * 4);
    cc_fill_ids(idx, NK, 1100, (int32_t)(E - 1)); /* expert E − 1 gets nothing: an empty group */
    int64_t *eoff_c = (int64_t *)cc_host((size_t)(E + 1) * 8), *eoff_g = (int64_t *)cc_host((size_t)(E + 1) * 8);
    int32_t *etok_c = (int32_t *)cc_host((size_t)NK * 4), *eslot_c = (int32_t *)cc_host((size_t)NK * 4);
    int32_t *etok_g = (int32_t *)cc_host((size_t)NK * 4), *eslot_g = (int32_t *)cc_host((size_t)NK * 4);
    CPU(moe_group_by_expert, eoff_c, etok_c, eslot_c, idx, N, E, K);
    int32_t *d_idx = (int32_t *)cc_up(idx, (size_t)NK * 4), *d_etok = (int32_t *)cc_dev((size_t)NK * 4),
            *d_eslot = (int32_t *)cc_dev((size_t)NK * 4);
    int64_t *d_eoff = (int64_t *)cc_dev((size_t)(E + 1) * 8);
    CC_OK(cuda_moe_group_by_expert(S, d_eoff, d_etok, d_eslot, d_idx, N, E, K));
    cc_down(eoff_g, d_eoff, (size_t)(E + 1) * 8);
    cc_down(etok_g, d_etok, (size_t)NK * 4);
    cc_down(eslot_g, d_eslot, (size_t)NK * 4);
    cc_same_bits("moe_group_by_expert eoff", eoff_g, eoff_c, (size_t)(E + 1) * 8);
    cc_same_bits("moe_group_by_expert etok", etok_g, etok_c, (size_t)NK * 4);
    cc_same_bits("moe_group_by_expert eslot", eslot_g, eslot_c, (size_t)NK * 4);
    /* counts and load */
    int64_t *cnt_c = (int64_t *)cc_host((size_t)E * 8), *cnt_g = (int64_t *)cc_host((size_t)E * 8);
    int64_t *d_cnt = (int64_t *)cc_dev((size_t)E * 8);
    CPU(moe_expert_counts, cnt_c, eoff_c, E, NK);
    CC_OK(cuda_moe_expert_counts(S, d_cnt, d_eoff, E, NK));
    cc_down(cnt_g, d_cnt, (size_t)E * 8);
    cc_same_bits("moe_expert_counts", cnt_g, cnt_c, (size_t)E * 8);
    CPU(moe_expert_load, cnt_c, eoff_c, E);
    CC_OK(cuda_moe_expert_load(S, d_cnt, d_eoff, E));
    cc_down(cnt_g, d_cnt, (size_t)E * 8);
    cc_same_bits("moe_expert_load", cnt_g, cnt_c, (size_t)E * 8);
    /* weights of the assignments and their gradient */
    float *w = cc_hostf(NK), *wj_c = cc_hostf(NK), *wj_g = cc_hostf(NK), *dgw_c = cc_hostf(NK), *dgw_g = cc_hostf(NK);
    cc_fill(w, NK, 1101, 1.0f);
    cc_fill(dgw_c, NK, 1102, 1.0f);
    float *d_w = cc_upf(w, NK), *d_wj = (float *)cc_dev((size_t)NK * 4), *d_dgw = cc_upf(dgw_c, NK);
    CPU(moe_assignment_weights, wj_c, w, etok_c, eslot_c, NK, K);
    CC_OK(cuda_moe_assignment_weights(S, d_wj, d_w, d_etok, d_eslot, NK, K));
    cc_down(wj_g, d_wj, (size_t)NK * 4);
    cc_same_bits("moe_assignment_weights", wj_g, wj_c, (size_t)NK * 4);
    CPU(moe_weight_grads_add, dgw_c, wj_c, etok_c, eslot_c, NK, K);
    CC_OK(cuda_moe_weight_grads_add(S, d_dgw, d_wj, d_etok, d_eslot, NK, K));
    cc_down(dgw_g, d_dgw, (size_t)NK * 4);
    cc_same_bits("moe_weight_grads_add", dgw_g, dgw_c, (size_t)NK * 4);
    /* rows: gather by etok, scatter-add back (rows repeat: a token's K assignments), pack / unpack */
    float *x = cc_hostf(N * D), *g_c = cc_hostf(NK * D), *g_g = cc_hostf(NK * D), *acc_c = cc_hostf(N * D),
          *acc_g = cc_hostf(N * D);
    cc_fill(x, N * D, 1103, 1.0f);
    cc_fill(acc_c, N * D, 1104, 1.0f);
    float *d_x = cc_upf(x, N * D), *d_g = (float *)cc_dev((size_t)(NK * D) * 4), *d_acc = cc_upf(acc_c, N * D);
    CPU(rows_gather, g_c, x, etok_c, NK, D);
    CC_OK(cuda_rows_gather(S, d_g, d_x, d_etok, NK, D));
    cc_down(g_g, d_g, (size_t)(NK * D) * 4);
    cc_same_bits("rows_gather", g_g, g_c, (size_t)(NK * D) * 4);
    CPU(rows_scatter_add, acc_c, g_c, etok_c, NK, D);
    CC_OK(cuda_rows_scatter_add(S, d_acc, d_g, d_etok, NK, D));
    cc_down(acc_g, d_acc, (size_t)(N * D) * 4);
    cc_same_bits("rows_scatter_add", acc_g, acc_c, (size_t)(N * D) * 4);
    float *p_c = cc_hostf(NK * (D + 1)), *p_g = cc_hostf(NK * (D + 1));
    float *d_p = (float *)cc_dev((size_t)(NK * (D + 1)) * 4);
    for (int with_rows = 0; with_rows < 2; with_rows++) {
        const int64_t n = with_rows ? NK : N;
        CPU(rows_pack, p_c, x, with_rows ? etok_c : NULL, w, n, D);
        CC_OK(cuda_rows_pack(S, d_p, d_x, with_rows ? d_etok : NULL, d_w, n, D));
        cc_down(p_g, d_p, (size_t)(n * (D + 1)) * 4);
        cc_same_bits(with_rows ? "rows_pack (rows)" : "rows_pack", p_g, p_c, (size_t)(n * (D + 1)) * 4);
    }
    float *ux_c = cc_hostf(NK * D), *uw_c = cc_hostf(NK), *ux_g = cc_hostf(NK * D), *uw_g = cc_hostf(NK);
    float *d_ux = (float *)cc_dev((size_t)(NK * D) * 4), *d_uw = (float *)cc_dev((size_t)NK * 4);
    CPU(rows_unpack, ux_c, uw_c, p_c, NK, D);
    CC_OK(cuda_rows_unpack(S, d_ux, d_uw, d_p, NK, D));
    cc_down(ux_g, d_ux, (size_t)(NK * D) * 4);
    cc_down(uw_g, d_uw, (size_t)NK * 4);
    cc_same_bits("rows_unpack x", ux_g, ux_c, (size_t)(NK * D) * 4);
    cc_same_bits("rows_unpack w", uw_g, uw_c, (size_t)NK * 4);
    CPU(moe_unpack_grads_add, acc_c, dgw_c, p_c, etok_c, eslot_c, NK, D, K);
    CC_OK(cuda_moe_unpack_grads_add(S, d_acc, d_dgw, d_p, d_etok, d_eslot, NK, D, K));
    cc_down(acc_g, d_acc, (size_t)(N * D) * 4);
    cc_down(dgw_g, d_dgw, (size_t)NK * 4);
    cc_same_bits("moe_unpack_grads_add dx", acc_g, acc_c, (size_t)(N * D) * 4);
    cc_same_bits("moe_unpack_grads_add dgw", dgw_g, dgw_c, (size_t)NK * 4);
    /* balanced routing's table */
    int64_t *tab_c = (int64_t *)cc_host((size_t)NK * 8), *tab_g = (int64_t *)cc_host((size_t)NK * 8);
    int32_t *bid_c = (int32_t *)cc_host((size_t)N * 4), *bid_g = (int32_t *)cc_host((size_t)N * 4);
    int64_t *d_tab = (int64_t *)cc_dev((size_t)NK * 8);
    int32_t *d_bid = (int32_t *)cc_dev((size_t)N * 4);
    CPU(moe_balanced_table, tab_c, bid_c, N, K, E);
    CC_OK(cuda_moe_balanced_table(S, d_tab, d_bid, N, K, E));
    cc_down(tab_g, d_tab, (size_t)NK * 8);
    cc_down(bid_g, d_bid, (size_t)N * 4);
    cc_same_bits("moe_balanced_table", tab_g, tab_c, (size_t)NK * 8);
    cc_same_bits("moe_balanced_table ids", bid_g, bid_c, (size_t)N * 4);
    free(idx), free(eoff_c), free(eoff_g), free(etok_c), free(eslot_c), free(etok_g), free(eslot_g), free(cnt_c);
    free(cnt_g), free(w), free(wj_c), free(wj_g), free(dgw_c), free(dgw_g), free(x), free(g_c), free(g_g), free(acc_c);
    free(acc_g), free(p_c), free(p_g), free(ux_c), free(uw_c), free(ux_g), free(uw_g), free(tab_c), free(tab_g);
    free(bid_c), free(bid_g);
    cc_free(d_idx), cc_free(d_etok), cc_free(d_eslot), cc_free(d_eoff), cc_free(d_cnt), cc_free(d_w), cc_free(d_wj);
    cc_free(d_dgw), cc_free(d_x), cc_free(d_g), cc_free(d_acc), cc_free(d_p), cc_free(d_ux), cc_free(d_uw);
    cc_free(d_tab), cc_free(d_bid);
}

/* ---------------------------------------------------------------- gradient norms: the cpu's bits */
static void test_grad_norm(void) {
    const int64_t n = 300007; /* four full chunks of 2^16 and a partial one */
    float *x = cc_hostf(n), *gc = cc_hostf(n), *gg = cc_hostf(n);
    cc_fill(x, n, 1300, 3.0f);
    /* the exact sum's corners: subnormals, the largest float, zeros, tiny and huge squares together */
    const uint32_t special[] = {0x00000001u, 0x80000003u, 0x007fffffu, 0x7f7fffffu, 0xff7fffffu, 0x00000000u,
                                0x80000000u, 0x1f800000u, 0x5f000000u};
    for (size_t i = 0; i < sizeof special / 4; i++) memcpy(&x[1000 * i + 7], &special[i], 4);
    float *dx = cc_upf(x, n);
    double *d_out = (double *)cc_dev(8), *d_part = (double *)cc_dev(cuda_sumsq_scratch_bytes(n)), got = 0;
    /* chunked double sum: without the huge elements (their squares overflow to Inf in both) */
    float *xs = cc_hostf(n);
    cc_fill(xs, n, 1301, 3.0f);
    float *dxs = cc_upf(xs, n);
    const double want = ds4_sumsq(xs, n);
    CC_OK(cuda_sumsq(S, d_out, dxs, n, d_part));
    cc_down(&got, d_out, 8);
    CHECK(memcmp(&got, &want, 8) == 0, "sumsq: gpu %.17g cpu %.17g", got, want);
    /* exact sum in limbs, its value, and the count of non-finite elements */
    ds4_sumsq_acc ac, ag;
    ds4_sumsq_exact(x, n, &ac);
    ds4_sumsq_acc *d_acc = (ds4_sumsq_acc *)cc_dev(sizeof ag);
    CC_OK(cuda_sumsq_exact(S, d_acc, dx, n));
    cc_down(&ag, d_acc, sizeof ag);
    cc_same_bits("sumsq_exact limbs", &ag, &ac, sizeof ag);
    const double vc = ds4_sumsq_value(&ac);
    double vg = 0;
    CC_OK(cuda_sumsq_value(S, d_out, d_acc));
    cc_down(&vg, d_out, 8);
    CHECK(memcmp(&vg, &vc, 8) == 0, "sumsq_value: gpu %.17g cpu %.17g", vg, vc);
    float inf = INFINITY;
    cc_reload(dx + 5, &inf, 4);
    CC_OK(cuda_sumsq_exact(S, d_acc, dx, n));
    CC_OK(cuda_sumsq_value(S, d_out, d_acc));
    cc_down(&vg, d_out, 8);
    cc_down(&ag, d_acc, sizeof ag);
    CHECK(vg != vg && ag.limb[DS4_SUMSQ_LIMBS] == 1, "sumsq_exact with an Inf: value %g, non-finite count %lld", vg,
          (long long)ag.limb[DS4_SUMSQ_LIMBS]);
    /* clipping by the norm on the device: above max_norm scales, below leaves g alone */
    for (int above = 0; above < 2; above++) {
        const double norm = sqrt(want), max_norm = above ? norm / 3 : norm * 2;
        memcpy(gc, xs, (size_t)n * 4);
        ds4_clip_scale(gc, n, max_norm, norm);
        CC_OK(cuda_sumsq(S, d_out, dxs, n, d_part));
        CC_OK(cuda_sqrt(S, d_out, d_out));
        CC_OK(cuda_clip_scale(S, dxs, n, max_norm, d_out));
        cc_down(gg, dxs, (size_t)n * 4);
        cc_same_bits(above ? "clip_scale (norm above max)" : "clip_scale (norm below max)", gg, gc, (size_t)n * 4);
        cc_reload(dxs, xs, (size_t)n * 4);
    }
    free(x), free(gc), free(gg), free(xs);
    cc_free(dx), cc_free(dxs), cc_free(d_out), cc_free(d_part), cc_free(d_acc);
}

/* ---------------------------------------------------------------- routed experts */
/* The experts chain GEMMs and SwiGLU, so a difference early (an ulp of h1) moves what follows: each
 * element's bound is the propagated one. With Δ the bound of an input difference and M the sum of
 * absolute products of a GEMM (operands rounded to bf16 in bf16: factor (1 + 2^-8)²), a GEMM adds
 * Σ|w|·Δ + cc_dot_bound(K, M); SwiGLU's act moves by at most 1.1·|u|·Δg + |silu(g)|·Δu (+ Δg·Δu) plus its
 * own 2^-20·|act|; a product by a routing weight adds a rounding (2^-23 relative); an operand the bf16
 * GEMM rounds may round the other way when it differs at all (+ 2^-8 of it). */
static double silu_d(double g) { return g / (1 + exp(-g)); }
static double bf_flip(double delta, double mag, bool bf) { return bf && delta > 0 ? delta + 0x1p-8 * mag : delta; }

static void experts_case(bool bf16w, unsigned seed) {
    const int64_t nexp = 4, D = 48, I = 40, L = 3 * I * D; /* per expert w1, w3 [I, D], w2 [D, I] */
    const int64_t off[5] = {0, 5, 5, 17, 30}, R = off[nexp];
    const float limit = 1.0f;
    const bool bf = bf16w;
    const double f = bf ? (1 + 0x1p-8) * (1 + 0x1p-8) : 1.0;
    float *W = cc_hostf(nexp * L), *x = cc_hostf(R * D), *rw = cc_hostf(R), *dy = cc_hostf(R * D), *G0 = cc_hostf(nexp * L);
    cc_fill(W, nexp * L, seed, 0.4f);
    cc_fill(x, R * D, seed + 1, 1.0f);
    cc_fill(rw, R, seed + 2, 1.0f);
    cc_fill(dy, R * D, seed + 3, 1.0f);
    cc_fill(G0, nexp * L, seed + 4, 0.5f);
    uint16_t *Wh = (uint16_t *)cc_host((size_t)(nexp * L) * 2);
    for (int64_t i = 0; i < nexp * L; i++) Wh[i] = gemm_bf16_bits(W[i]);
    /* cpu */
    moe_expert_w wc[4], gc[4], wg[4], gg[4];
    float *Gc = cc_hostf(nexp * L);
    memcpy(Gc, G0, (size_t)(nexp * L) * 4);
    float *d_W = cc_upf(W, nexp * L), *d_G = cc_upf(G0, nexp * L);
    uint16_t *d_Wh = (uint16_t *)cc_up(Wh, (size_t)(nexp * L) * 2);
    for (int e = 0; e < nexp; e++) {
        wc[e] = (moe_expert_w){W + e * L, W + e * L + 2 * I * D, W + e * L + I * D};
        gc[e] = (moe_expert_w){Gc + e * L, Gc + e * L + 2 * I * D, Gc + e * L + I * D};
        wg[e] = (moe_expert_w){d_W + e * L, d_W + e * L + 2 * I * D, d_W + e * L + I * D};
        gg[e] = (moe_expert_w){d_G + e * L, d_G + e * L + 2 * I * D, d_G + e * L + I * D};
    }
    float *h1c = cc_hostf(R * I), *h3c = cc_hostf(R * I), *act = cc_hostf(R * I), *yc = cc_hostf(R * D);
    float *dxc = cc_hostf(R * D), *dwc = cc_hostf(R), *s1 = cc_hostf(R * I), *s2 = cc_hostf(R * I), *s3 = cc_hostf(R * I);
    moe_experts_args ac = {nexp, D, I, limit, off, wc, W, bf16w ? Wh : NULL, x, rw, h1c, h3c, act};
    moe_experts_grads grc = {gc, dy, dxc, dwc, s1, s2, s3};
    CPU(moe_experts_fwd, &ac, yc);
    CPU(moe_experts_bwd, &ac, &grc);
    /* cuda: forward, then the backward from the cpu's saved h1, h3 (the same inputs) */
    float *d_x = cc_upf(x, R * D), *d_rw = cc_upf(rw, R), *d_dy = cc_upf(dy, R * D);
    float *d_h1 = (float *)cc_dev((size_t)(R * I) * 4), *d_h3 = (float *)cc_dev((size_t)(R * I) * 4),
          *d_act = (float *)cc_dev((size_t)(R * I) * 4), *d_y = (float *)cc_dev((size_t)(R * D) * 4),
          *d_dx = (float *)cc_dev((size_t)(R * D) * 4), *d_dw = (float *)cc_dev((size_t)R * 4),
          *d_s1 = (float *)cc_dev((size_t)(R * I) * 4), *d_s2 = (float *)cc_dev((size_t)(R * I) * 4),
          *d_s3 = (float *)cc_dev((size_t)(R * I) * 4);
    moe_experts_args ag = {nexp, D, I, limit, off, wg, d_W, bf16w ? d_Wh : NULL, d_x, d_rw, d_h1, d_h3, d_act};
    moe_experts_grads grg = {gg, d_dy, d_dx, d_dw, d_s1, d_s2, d_s3};
    CC_OK(cuda_moe_experts_fwd(BL, S, DS4_MATMUL_FP32, &ag, d_y));
    float *yg = cc_hostf(R * D), *h1g = cc_hostf(R * I), *h3g = cc_hostf(R * I), *dxg = cc_hostf(R * D),
          *dwg = cc_hostf(R), *Gg = cc_hostf(nexp * L), *dxg2 = cc_hostf(R * D);
    cc_down(yg, d_y, (size_t)(R * D) * 4);
    cc_down(h1g, d_h1, (size_t)(R * I) * 4);
    cc_down(h3g, d_h3, (size_t)(R * I) * 4);
    cc_reload(d_h1, h1c, (size_t)(R * I) * 4);
    cc_reload(d_h3, h3c, (size_t)(R * I) * 4);
    CC_OK(cuda_moe_experts_bwd(BL, S, DS4_MATMUL_FP32, &ag, &grg));
    cc_down(dxg, d_dx, (size_t)(R * D) * 4);
    cc_down(dwg, d_dw, (size_t)R * 4);
    cc_down(Gg, d_G, (size_t)(nexp * L) * 4);
    CC_OK(cuda_moe_experts_bwd(BL, S, DS4_MATMUL_FP32, &ag, &grg)); /* dx is overwritten: a rerun gives it again */
    cc_down(dxg2, d_dx, (size_t)(R * D) * 4);
    /* bounds, expert by expert */
    double *bh1 = (double *)calloc((size_t)(R * I), 8), *bh3 = (double *)calloc((size_t)(R * I), 8),
           *by = (double *)calloc((size_t)(R * D), 8), *bdx = (double *)calloc((size_t)(R * D), 8),
           *bdw = (double *)calloc((size_t)R, 8), *bG = (double *)calloc((size_t)(nexp * L), 8);
    double *dwa = (double *)calloc((size_t)I, 8), *dd1 = (double *)calloc((size_t)(R * I), 8),
           *dd3 = (double *)calloc((size_t)(R * I), 8), *m1 = (double *)calloc((size_t)(R * I), 8),
           *m3 = (double *)calloc((size_t)(R * I), 8), *dwact = (double *)calloc((size_t)(R * I), 8),
           *mwact = (double *)calloc((size_t)(R * I), 8);
    for (int64_t e = 0; e < nexp; e++) {
        const float *w1 = wc[e].w1, *w2 = wc[e].w2, *w3 = wc[e].w3;
        const float *g10 = G0 + e * L, *g20 = G0 + e * L + 2 * I * D, *g30 = G0 + e * L + I * D;
        for (int64_t i = off[e]; i < off[e + 1]; i++) {
            /* forward: h1, h3, act, wact, y */
            for (int64_t k = 0; k < I; k++) {
                double M1 = 0, M3 = 0;
                for (int64_t d = 0; d < D; d++) M1 += fabs(x[i * D + d] * w1[k * D + d]), M3 += fabs(x[i * D + d] * w3[k * D + d]);
                bh1[i * I + k] = cc_dot_bound(D, f * M1), bh3[i * I + k] = cc_dot_bound(D, f * M3);
                const double g = fmin(h1c[i * I + k], limit), u = fmin(fmax(h3c[i * I + k], -limit), limit);
                const double a = silu_d(g) * u, da = 1.1 * fabs(u) * bh1[i * I + k] + fabs(silu_d(g)) * bh3[i * I + k] +
                                                    bh1[i * I + k] * bh3[i * I + k] + 0x1p-20 * fabs(a);
                mwact[i * I + k] = fabs(a * rw[i]);
                dwact[i * I + k] = bf_flip(fabs(rw[i]) * da + 0x1p-23 * mwact[i * I + k], mwact[i * I + k], bf);
            }
            for (int64_t j = 0; j < D; j++) {
                double M = 0, P = 0;
                for (int64_t k = 0; k < I; k++) M += fabs(w2[j * I + k]) * mwact[i * I + k], P += fabs(w2[j * I + k]) * dwact[i * I + k];
                by[i * D + j] = P + cc_dot_bound(I, f * M);
            }
            /* backward from identical h1, h3: act within 2^-20, dact0 = dy·w2 a GEMM of identical inputs */
            for (int64_t k = 0; k < I; k++) {
                const double g = fmin(h1c[i * I + k], limit), u = fmin(fmax(h3c[i * I + k], -limit), limit);
                const double a = silu_d(g) * u, da = 0x1p-20 * fabs(a);
                mwact[i * I + k] = fabs(a * rw[i]);
                dwact[i * I + k] = bf_flip(fabs(rw[i]) * da + 0x1p-23 * mwact[i * I + k], mwact[i * I + k], bf);
                double dact0 = 0, M = 0;
                for (int64_t j = 0; j < D; j++) dact0 += (double)dy[i * D + j] * w2[j * I + k], M += fabs(dy[i * D + j] * w2[j * I + k]);
                const double ddact0 = cc_dot_bound(D, f * M);
                dwa[k] = ddact0 * fabs(a) + fabs(dact0) * da + ddact0 * da;
                const double dact = dact0 * rw[i], ddact = fabs(rw[i]) * ddact0 + 0x1p-23 * fabs(dact);
                const bool gcl = h1c[i * I + k] > limit, ucl = fabs(h3c[i * I + k]) > limit;
                const double sg = 1 / (1 + exp(-g)), dh1 = gcl ? 0 : dact * u * sg * (1 + g * (1 - sg)),
                             dh3 = ucl ? 0 : dact * silu_d(g);
                m1[i * I + k] = fabs(dh1), m3[i * I + k] = fabs(dh3);
                dd1[i * I + k] = gcl ? 0 : bf_flip(1.1 * fabs(u) * ddact + 0x1p-20 * fabs(dact * u) * (1 + fabs(g)), fabs(dh1), bf);
                dd3[i * I + k] = ucl ? 0 : bf_flip(fabs(silu_d(g)) * ddact + 0x1p-20 * fabs(dact * g), fabs(dh3), bf);
            }
            double sdw = 0;
            for (int64_t k = 0; k < I; k++) sdw += dwa[k];
            bdw[i] = sdw + 0x1p-22 * fabs(dwc[i]);
            for (int64_t d = 0; d < D; d++) {
                double M = 0, P = 0;
                for (int64_t k = 0; k < I; k++) {
                    M += m1[i * I + k] * fabs(w1[k * D + d]) + m3[i * I + k] * fabs(w3[k * D + d]);
                    P += dd1[i * I + k] * fabs(w1[k * D + d]) + dd3[i * I + k] * fabs(w3[k * D + d]);
                }
                bdx[i * D + d] = P + cc_dot_bound(2 * I + 1, f * M);
            }
        }
        /* weight gradients: sums over the expert's rows */
        const int64_t ne = off[e + 1] - off[e];
        for (int64_t j = 0; j < D; j++)
            for (int64_t k = 0; k < I; k++) {
                double M = fabs(g20[j * I + k]), P = 0;
                for (int64_t i = off[e]; i < off[e + 1]; i++) M += f * fabs(dy[i * D + j]) * mwact[i * I + k], P += fabs(dy[i * D + j]) * dwact[i * I + k];
                bG[e * L + 2 * I * D + j * I + k] = ne ? P + cc_dot_bound(ne + 1, M) : 0;
            }
        for (int64_t k = 0; k < I; k++)
            for (int64_t d = 0; d < D; d++) {
                double M1 = fabs(g10[k * D + d]), M3 = fabs(g30[k * D + d]), P1 = 0, P3 = 0;
                for (int64_t i = off[e]; i < off[e + 1]; i++) {
                    M1 += f * m1[i * I + k] * fabs(x[i * D + d]), P1 += dd1[i * I + k] * fabs(x[i * D + d]);
                    M3 += f * m3[i * I + k] * fabs(x[i * D + d]), P3 += dd3[i * I + k] * fabs(x[i * D + d]);
                }
                bG[e * L + k * D + d] = ne ? P1 + cc_dot_bound(ne + 1, M1) : 0;
                bG[e * L + I * D + k * D + d] = ne ? P3 + cc_dot_bound(ne + 1, M3) : 0;
            }
    }
    const char *v = bf16w ? "moe_experts bf16w" : "moe_experts fp32";
    char what[64];
    snprintf(what, sizeof what, "%s h1", v), cc_within(what, h1g, h1c, bh1, R * I);
    snprintf(what, sizeof what, "%s h3", v), cc_within(what, h3g, h3c, bh3, R * I);
    snprintf(what, sizeof what, "%s y", v), cc_within(what, yg, yc, by, R * D);
    snprintf(what, sizeof what, "%s dx", v), cc_within(what, dxg, dxc, bdx, R * D);
    snprintf(what, sizeof what, "%s dw", v), cc_within(what, dwg, dwc, bdw, R);
    snprintf(what, sizeof what, "%s weight grads", v), cc_within(what, Gg, Gc, bG, nexp * L);
    CHECK(!memcmp(dxg, dxg2, (size_t)(R * D) * 4), "%s: two backward runs give other dx bits", v);
    free(W), free(x), free(rw), free(dy), free(G0), free(Wh), free(Gc), free(h1c), free(h3c), free(act), free(yc);
    free(dxc), free(dwc), free(s1), free(s2), free(s3), free(yg), free(h1g), free(h3g), free(dxg), free(dwg), free(Gg);
    free(dxg2), free(bh1), free(bh3), free(by), free(bdx), free(bdw), free(bG), free(dwa), free(dd1), free(dd3), free(m1);
    free(m3), free(dwact), free(mwact);
    cc_free(d_W), cc_free(d_G), cc_free(d_Wh), cc_free(d_x), cc_free(d_rw), cc_free(d_dy), cc_free(d_h1), cc_free(d_h3);
    cc_free(d_act), cc_free(d_y), cc_free(d_dx), cc_free(d_dw), cc_free(d_s1), cc_free(d_s2), cc_free(d_s3);
}

static void test_moe_experts(void) {
    experts_case(false, 1200);
    experts_case(true, 1210);
}

/* ---------------------------------------------------------------- Newton–Schulz */
/* out [m, n] = Σ_k P [m, k]·Q [k, n] */
static void mm_d(double *out, const double *P, const double *Q, int64_t m, int64_t k, int64_t n) {
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double acc = 0;
            for (int64_t q = 0; q < k; q++) acc += P[i * k + q] * Q[q * n + j];
            out[i * n + j] = acc;
        }
}
static void tr_d(double *out, const double *x, int64_t r, int64_t c) {
    for (int64_t i = 0; i < r; i++)
        for (int64_t j = 0; j < c; j++) out[j * r + i] = x[i * c + j];
}
/* δ of C = P·Q from the operands' values and bounds (m×k, k×n): |δP|·(|P| + δQ... ) products of bounds,
 * plus the two orders' rounding, cc_dot_bound(k, f·|P|·|Q|), with bf16 operands possibly rounding the
 * other way where they differ (bf_flip). Magnitudes |value| + δ bound the floats either path holds. */
static void mm_bound(double *dC, const double *P, const double *dP, const double *Q, const double *dQ, int64_t m,
                     int64_t k, int64_t n, bool bf) {
    const double f = bf ? (1 + 0x1p-8) * (1 + 0x1p-8) : 1.0;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double M = 0, D = 0;
            for (int64_t q = 0; q < k; q++) {
                const double p = fabs(P[i * k + q]) + dP[i * k + q], qq = fabs(Q[q * n + j]) + dQ[q * n + j];
                const double dp = bf_flip(dP[i * k + q], p, bf), dq = bf_flip(dQ[q * n + j], qq, bf);
                M += p * qq;
                D += dp * qq + p * dq + dp * dq;
            }
            dC[i * n + j] = D + cc_dot_bound(k, f * M);
        }
}

/* One Newton–Schulz call (normalisation, then one iteration) on x [rows, cols], GPU vs cpu
 * ds4_newton_schulz: the normalisation gives both the same bits (cuda_sumsq is ds4_sumsq); the
 * iteration's GEMMs and combines move the bound as mm_bound and the element-wise roundings say (2^-23 of
 * each term, their inputs differing). Returns the cpu's result in xc. */
static void ns_step(const float *x, float *xc, int64_t rows, int64_t cols, const ds4_ns_coef *k,
                    ds4_matmul_precision p, const char *what) {
    const float eps = 1e-7f;
    const bool tall = rows > cols, bf = p == DS4_MATMUL_BF16;
    const int64_t r = tall ? cols : rows, c = tall ? rows : cols, n = rows * cols;
    float *xg = cc_hostf(n);
    memcpy(xc, x, (size_t)n * 4);
    cpu_precision(p);
    CC_OK(ds4_newton_schulz(&g_cpu_exec, xc, rows, cols, k, 1, eps));
    cpu_precision(DS4_MATMUL_FP32);
    float *dx = cc_upf(x, n);
    void *scratch = cc_dev(cuda_newton_schulz_scratch_bytes(rows, cols));
    CC_OK(cuda_newton_schulz(BL, S, p, dx, rows, cols, &k->a, 1, eps, scratch));
    cc_down(xg, dx, (size_t)n * 4);
    /* the bound, on the short side's t [r, c] */
    double *t = (double *)calloc((size_t)(r * c), 8), *dt = (double *)calloc((size_t)(r * c), 8);
    double *tT = (double *)calloc((size_t)(r * c), 8), *dtT = (double *)calloc((size_t)(r * c), 8);
    double *A = (double *)calloc((size_t)(r * r), 8), *dA = (double *)calloc((size_t)(r * r), 8);
    double *AA = (double *)calloc((size_t)(r * r), 8), *dAA = (double *)calloc((size_t)(r * r), 8);
    double *B = (double *)calloc((size_t)(r * r), 8), *dB = (double *)calloc((size_t)(r * r), 8);
    double *Y = (double *)calloc((size_t)(r * c), 8), *dY = (double *)calloc((size_t)(r * c), 8);
    float *t0 = cc_hostf(n);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) t0[tall ? j * rows + i : i * cols + j] = x[i * cols + j];
    const float d = (float)sqrt(ds4_sumsq(t0, n)) + eps; /* both sides' normalisation, the same bits */
    for (int64_t i = 0; i < n; i++) t[i] = t0[i] / d;
    const double ka = k->a, kb = k->b, kc = k->c;
    tr_d(tT, t, r, c);
    mm_d(A, t, tT, r, c, r);
    mm_bound(dA, t, dt, tT, dtT, r, c, r, bf);
    mm_d(AA, A, A, r, r, r);
    mm_bound(dAA, A, dA, A, dA, r, r, r, bf);
    for (int64_t i = 0; i < r * r; i++) {
        B[i] = kb * A[i] + kc * AA[i];
        dB[i] = fabs(kb) * dA[i] + fabs(kc) * dAA[i] + 0x1p-23 * (fabs(kb * A[i]) + fabs(kc * AA[i]) + fabs(B[i]));
    }
    mm_d(Y, B, t, r, r, c);
    mm_bound(dY, B, dB, t, dt, r, r, c, bf);
    double *bound = (double *)malloc((size_t)n * 8);
    for (int64_t i = 0; i < rows; i++)
        for (int64_t j = 0; j < cols; j++) {
            const int64_t q = tall ? j * rows + i : i * cols + j;
            const double tn = ka * t[q] + Y[q];
            bound[i * cols + j] = dY[q] + 0x1p-23 * (fabs(ka * t[q]) + fabs(Y[q]) + fabs(tn));
        }
    cc_within(what, xg, xc, bound, n);
    free(xg), free(t), free(dt), free(tT), free(dtT), free(A), free(dA), free(AA), free(dAA), free(B), free(dB), free(Y);
    free(dY), free(t0), free(bound);
    cc_free(dx), cc_free(scratch);
}

/* Five iterations, checked one call at a time from the cpu's previous result (an iteration multiplies
 * small singular directions' differences by about a = 3.4, so a bound over the five compounded is
 * useless), and the five-iteration GPU call run twice for the same bits. */
static void ns_case(int64_t rows, int64_t cols, ds4_matmul_precision p, unsigned seed) {
    const ds4_ns_coef k[5] = {{3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f},
                              {3.4445f, -4.7750f, 2.0315f}, {3.4445f, -4.7750f, 2.0315f}};
    const int64_t n = rows * cols;
    float *x = cc_hostf(n), *xc = cc_hostf(n), *x0 = cc_hostf(n), *g1 = cc_hostf(n), *g2 = cc_hostf(n);
    cc_fill(x, n, seed, 1.0f);
    memcpy(x0, x, (size_t)n * 4);
    for (int it = 0; it < 5; it++) {
        char what[80];
        snprintf(what, sizeof what, "newton_schulz %lldx%lld %s step %d", (long long)rows, (long long)cols,
                 ds4_matmul_precision_name(p), it + 1);
        ns_step(x, xc, rows, cols, &k[it], p, what);
        memcpy(x, xc, (size_t)n * 4);
    }
    float *dx = cc_upf(x0, n);
    void *scratch = cc_dev(cuda_newton_schulz_scratch_bytes(rows, cols));
    for (int run = 0; run < 2; run++) {
        cc_reload(dx, x0, (size_t)n * 4);
        CC_OK(cuda_newton_schulz(BL, S, p, dx, rows, cols, &k[0].a, 5, 1e-7f, scratch));
        cc_down(run ? g2 : g1, dx, (size_t)n * 4);
    }
    CHECK(!memcmp(g1, g2, (size_t)n * 4), "newton_schulz %lldx%lld: two five-iteration runs differ", (long long)rows,
          (long long)cols);
    free(x), free(xc), free(x0), free(g1), free(g2), cc_free(dx), cc_free(scratch);
}

static void test_newton_schulz(void) {
    ns_case(24, 40, DS4_MATMUL_FP32, 1400);
    ns_case(40, 24, DS4_MATMUL_FP32, 1410); /* tall: on the transpose */
    ns_case(32, 48, DS4_MATMUL_BF16, 1420);
}

/* ---------------------------------------------------------------- memory and streams */
static void test_memory(void) {
    /* h2d, d2d, d2h through pinned memory on a stream; an event orders a second stream after the first */
    const size_t bytes = (size_t)1 << 20;
    unsigned char *h = NULL, *back = NULL;
    void *d1 = NULL, *d2 = NULL;
    cudaStream_t s2 = NULL;
    cudaEvent_t e = NULL;
    CC_OK(cuda_alloc_pinned((void **)&h, bytes));
    CC_OK(cuda_alloc_pinned((void **)&back, bytes));
    CC_OK(cuda_alloc(&d1, bytes));
    CC_OK(cuda_alloc(&d2, bytes));
    CC_OK(cuda_stream_create(&s2));
    CC_OK(cuda_event_create(&e));
    if (!h || !back || !d1 || !d2) return;
    for (size_t i = 0; i < bytes; i++) h[i] = (unsigned char)(i * 131 + 7);
    CC_OK(cuda_copy_h2d(S, d1, h, bytes));
    CC_OK(cuda_copy_d2d(S, d2, d1, bytes));
    CC_OK(cuda_event_record(e, S));
    CC_OK(cuda_stream_wait(s2, e));
    CC_OK(cuda_copy_d2h(s2, back, d2, bytes));
    CC_OK(cuda_stream_sync(s2));
    CHECK(memcmp(back, h, bytes) == 0, "h2d, d2d, d2h across two streams changed bytes");
    CC_OK(cuda_fill(S, d1, 0x5a, bytes));
    CC_OK(cuda_fill_f32(S, (float *)d2, -1.5f, (int64_t)(bytes / 4)));
    CC_OK(cuda_copy_d2h(S, back, d1, bytes));
    CC_OK(cuda_stream_sync(S));
    size_t bad = 0;
    for (size_t i = 0; i < bytes; i++) bad += back[i] != 0x5a;
    CHECK(bad == 0, "cuda_fill: %zu bytes not 0x5a", bad);
    float *f = (float *)back;
    CC_OK(cuda_copy_d2h(S, back, d2, bytes));
    CC_OK(cuda_stream_sync(S));
    bad = 0;
    for (size_t i = 0; i < bytes / 4; i++) bad += f[i] != -1.5f;
    CHECK(bad == 0, "cuda_fill_f32: %zu floats not -1.5", bad);
    /* the device's memory: an allocation of 1 GiB shows in the free bytes */
    size_t free0 = 0, total = 0, free1 = 0;
    void *gib = NULL;
    CC_OK(cuda_device_memory(&free0, &total));
    CC_OK(cuda_alloc(&gib, (size_t)1 << 30));
    CC_OK(cuda_device_memory(&free1, &total));
    CHECK(total > 0 && free0 <= total && free1 + ((size_t)1 << 30) <= free0,
          "device memory: total %zu, free %zu before and %zu after allocating 1 GiB", total, free0, free1);
    CC_OK(cuda_free(gib));
    /* an allocation larger than any GPU: DS4_ERR_OOM with a message, nothing allocated */
    void *huge = (void *)1;
    ds4_status st = cuda_alloc(&huge, (size_t)1 << 50);
    CHECK(st == DS4_ERR_OOM && huge == NULL, "cuda_alloc of 1 PiB: %s, %p", ds4_status_name(st), huge);
    CHECK(strstr(ds4_errmsg(), "device memory") != NULL, "message: %s", ds4_errmsg());
    char desc[256];
    CC_OK(cuda_device_describe(0, desc, sizeof desc));
    t_note("  %s", desc);
    CC_OK(cuda_event_destroy(e));
    CC_OK(cuda_stream_destroy(s2));
    CC_OK(cuda_free(d1));
    CC_OK(cuda_free(d2));
    CC_OK(cuda_free_pinned(h));
    CC_OK(cuda_free_pinned(back));
}

/* Reserved ranges (FSDP's model layout): pieces on 4 KiB pages, neighbours sharing a granule, each mapped
 * piece reads zeros (also after its neighbour kept the granule with other bytes in it), survives its
 * neighbour's unmap, and the range goes back whole. */
static void test_ranges(void) {
    const size_t page = 4096, bytes = (size_t)8 << 20;
    char *r = NULL;
    CC_OK(cuda_range_reserve((void **)&r, bytes));
    if (!r) return;
    unsigned char *h = NULL;
    CC_OK(cuda_alloc_pinned((void **)&h, 3 * page));
    if (!h) return;
    CC_OK(cuda_range_map(S, r, 2 * page));           /* piece a: pages 0-1 */
    CC_OK(cuda_range_map(S, r + 2 * page, page));    /* piece b: page 2, the same granule */
    CC_OK(cuda_fill(S, r, 0x11, 2 * page));
    CC_OK(cuda_fill(S, r + 2 * page, 0x22, page));
    CC_OK(cuda_range_unmap(S, r, 2 * page));         /* b keeps the granule */
    CC_OK(cuda_range_map(S, r, 2 * page));           /* a again: zeros, not the 0x11 it held */
    CC_OK(cuda_copy_d2h(S, h, r, 3 * page));
    CC_OK(cuda_stream_sync(S));
    size_t bad = 0;
    for (size_t i = 0; i < 3 * page; i++) bad += h[i] != (i < 2 * page ? 0 : 0x22);
    CHECK(bad == 0, "reserved range: %zu bytes not as mapped (zeros, then the neighbour's 0x22)", bad);
    CC_OK(cuda_range_map(S, r + (6 << 20), page));   /* a piece in another granule */
    CC_OK(cuda_range_release(S, r, bytes));           /* with pieces still mapped */
    /* rank_sum_add: rank order first, then into g (the cpu's bits) */
    const int n = 3;
    const int64_t len = 1000;
    float hr[3 * 1000], hg[1000], want[1000], got[1000];
    for (int64_t i = 0; i < n * len; i++) hr[i] = (float)((i * 7919) % 1013) * 1e-3f - 0.5f;
    for (int64_t i = 0; i < len; i++) want[i] = hg[i] = (float)(i % 17) * 0.25f;
    CPU(rank_sum_add, want, hr, n, len);
    float *dg = NULL, *dr = NULL;
    CC_OK(cuda_alloc((void **)&dg, sizeof hg));
    CC_OK(cuda_alloc((void **)&dr, sizeof hr));
    if (!dg || !dr) return;
    CC_OK(cuda_copy_h2d(S, dg, hg, sizeof hg));
    CC_OK(cuda_copy_h2d(S, dr, hr, sizeof hr));
    CC_OK(cuda_rank_sum_add(S, dg, dr, n, len));
    CC_OK(cuda_copy_d2h(S, got, dg, sizeof got));
    CC_OK(cuda_stream_sync(S));
    CHECK(memcmp(got, want, sizeof got) == 0, "rank_sum_add: not the cpu's bits");
    CC_OK(cuda_free(dg));
    CC_OK(cuda_free(dr));
    CC_OK(cuda_free_pinned(h));
}

/* ---------------------------------------------------------------- without a GPU */
/* Bad sizes are one clear error naming the op, before any device work (also where no GPU is visible). */
static void test_arg_errors(void) {
    ds4_status st = cuda_rmsnorm_fwd(NULL, NULL, NULL, NULL, NULL, 4, 0, 1e-6f);
    CHECK(st == DS4_ERR_ARG && strstr(ds4_errmsg(), "rmsnorm_fwd"), "rmsnorm D 0: %s: %s", ds4_status_name(st),
          ds4_errmsg());
    st = cuda_gemm_nt(NULL, NULL, DS4_MATMUL_FP32, 2, 2, 2, NULL, 2, NULL, 2, NULL, 2, 0.5f);
    CHECK(st == DS4_ERR_ARG && strstr(ds4_errmsg(), "beta"), "gemm beta 0.5: %s: %s", ds4_status_name(st), ds4_errmsg());
    st = cuda_tensor_add(NULL, NULL, NULL, -1);
    CHECK(st == DS4_ERR_ARG && strstr(ds4_errmsg(), "tensor_add"), "tensor_add n -1: %s", ds4_errmsg());
    int n = -1;
    CC_OK(cuda_device_count(&n));
    CHECK(n >= 0, "cuda_device_count: %d", n);
}

int main(void) {
    RUN(test_arg_errors);
    int ndev = 0;
    if (cuda_device_count(&ndev) != DS4_OK || ndev == 0) {
        printf("test_cuda_basic: SKIP the device tests (no CUDA device visible)\n");
        TEST_MAIN_END("test_cuda_basic");
    }
    CUDA_TEST_BEGIN("test_cuda_basic");
    /* a blocking stream: ordered after the harness's copies on the legacy stream */
    if (cudaStreamCreate(&S) != cudaSuccess || cuda_blas_create(&BL, 0) != DS4_OK) {
        fprintf(stderr, "cuda setup: %s\n", ds4_errmsg());
        return 1;
    }
    CC_RUN(test_memory);
    CC_RUN(test_ranges);
    CC_RUN(test_gemm_not_tf32);
    CC_RUN(test_gemm_fp32);
    CC_RUN(test_gemm_plan_cache);
    CC_RUN(test_gemm_bf16);
    CC_RUN(test_linear);
    CC_RUN(test_grouped_linear);
    CC_RUN(test_embedding);
    CC_RUN(test_rmsnorm);
    CC_RUN(test_rope);
    CC_RUN(test_swiglu);
    CC_RUN(test_cross_entropy);
    CC_RUN(test_data_ops);
    CC_RUN(test_streams);
    CC_RUN(test_adamw);
    CC_RUN(test_grad_norm);
    CC_RUN(test_newton_schulz);
    CC_RUN(test_moe_gate);
    CC_RUN(test_moe_routing);
    CC_RUN(test_moe_experts);
    cuda_blas_destroy(BL);
    cuda_stream_destroy(S);
    CUDA_TEST_END("test_cuda_basic");
}
