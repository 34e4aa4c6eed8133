/* Dense GEMMs of the CUDA backend through cuBLASLt, and the linear layers over them.
 *
 * ds4's GEMMs are row-major (kernels.h): C[M,N] = beta·C + op(A)·op(B). cuBLASLt is column-major, and a
 * row-major X [r, c] with leading dimension ld is the column-major X^T [c, r] with the same ld, so the
 * row-major product is computed as the column-major C^T [N, M] = op(B)^T · op(A)^T: cuBLASLt's first
 * operand is ds4's B, its second is ds4's A, m = N, n = M.
 *
 * Precision fp32: every type fp32 and CUBLAS_COMPUTE_32F, which is true fp32 (the TF32 modes are the
 * separate CUBLAS_COMPUTE_32F_FAST_TF32; a test checks a product TF32 would round). bf16: the fp32
 * operands are first rounded to bf16 bits in a staging buffer by the rounding of gemm_bf16_bits
 * (nearest even, denormals to zero), then multiplied as CUDA_R_16BF with fp32 accumulation and fp32 C.
 *
 * Determinism: cuBLASLt gives the same bits for the same algorithm, shapes and GPU. The algorithm is
 * the first of its heuristic for the shapes, leading dimensions, types, workspace size and the pointers'
 * alignment class (16 bytes or less, passed as the minimum alignment), never timed autotuning, so it
 * depends on nothing that changes between runs; the handle keeps it with the descriptors per shape (a
 * plan), so a shape seen again skips the heuristic. Every split-K reduction scheme cuBLASLt has is
 * ordered. */
#include <cublasLt.h>

#include "kernels/cuda/cuda_common.cuh"

#define BLAS_WORKSPACE_DEFAULT ((size_t)32 << 20) /* cuBLASLt's recommendation for Hopper */
#define BLAS_PLANS 64                              /* cached GEMM shapes per handle */

/* What fixes a cuBLASLt call's algorithm: types, transposes, sizes, leading dimensions, batch and strides,
 * alignment classes. Zero-initialised before filling, so its padding compares equal. */
typedef struct {
    int32_t type, ta, tb, batch;
    int64_t M, N, K, lda, ldb, ldc, sa, sb, sc;
    uint32_t al_a, al_b, al_c, pad;
} lt_key;

/* One cached call: its descriptors and the algorithm the heuristic chose for them. */
typedef struct {
    lt_key key;
    bool used;
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t a, b, c;
    cublasLtMatmulAlgo_t algo;
} lt_plan;

struct cuda_blas {
    cublasLtHandle_t lt;
    void *work; /* cuBLASLt workspace */
    size_t work_bytes;
    uint16_t *stage; /* bf16 copies of fp32 operands in bf16 precision */
    size_t stage_bytes;
    lt_plan plans[BLAS_PLANS]; /* the shapes seen, each with the algorithm chosen for it once */
    int next_plan;             /* the slot a new shape takes (round robin) */
};

static ds4_status blas_status(cublasStatus_t st, const char *what) {
    if (st == CUBLAS_STATUS_SUCCESS) return DS4_OK;
    return ds4_fail(st == CUBLAS_STATUS_ALLOC_FAILED ? DS4_ERR_OOM : DS4_ERR_INTERNAL, "cuda: cuBLASLt %s: %s (%d)",
                    what, cublasLtGetStatusString(st), (int)st);
}
#define BLAS_TRY(call, what)                                   \
    do {                                                       \
        ds4_status blas_s_ = blas_status((call), what);        \
        if (blas_s_ != DS4_OK) return blas_s_;                 \
    } while (0)

ds4_status cuda_blas_create(cuda_blas **out, size_t workspace_bytes) {
    *out = NULL;
    cuda_blas *b = (cuda_blas *)calloc(1, sizeof *b);
    if (!b) return ds4_fail(DS4_ERR_OOM, "cuda: out of host memory for the cuBLASLt handle");
    b->work_bytes = workspace_bytes ? workspace_bytes : BLAS_WORKSPACE_DEFAULT;
    ds4_status st = blas_status(cublasLtCreate(&b->lt), "create");
    if (st == DS4_OK) st = cuda_alloc(&b->work, b->work_bytes);
    if (st != DS4_OK) {
        cuda_blas_destroy(b);
        return st;
    }
    *out = b;
    return DS4_OK;
}

static void lt_plan_free(lt_plan *d);

void cuda_blas_destroy(cuda_blas *b) {
    if (!b) return;
    for (int i = 0; i < BLAS_PLANS; i++) lt_plan_free(&b->plans[i]);
    cudaFree(b->work);
    cudaFree(b->stage);
    if (b->lt) cublasLtDestroy(b->lt);
    free(b);
}

size_t cuda_blas_bytes(const cuda_blas *b) { return b ? b->work_bytes + b->stage_bytes : 0; }

/* The staging buffer holds at least `bytes`; growing it waits for the work queued on s (the only stream
 * this handle serves), which may still read the old one. */
static ds4_status stage_reserve(cuda_blas *b, cudaStream_t s, size_t bytes) {
    if (bytes <= b->stage_bytes) return DS4_OK;
    CUDA_TRY(cudaStreamSynchronize(s));
    CUDA_TRY(cudaFree(b->stage));
    b->stage = NULL;
    b->stage_bytes = 0;
    DS4_TRY(cuda_alloc((void **)&b->stage, bytes));
    b->stage_bytes = bytes;
    return DS4_OK;
}

/* dst [n] = bf16 bits of src [n] (gemm_bf16_bits) */
static __global__ void bf16_pack_kernel(uint16_t *dst, const float *src, int64_t n) {
    CUDA_GRID_STRIDE(i, n) dst[i] = cuda_bf16_bits(src[i]);
}

/* A row-major operand: `rows` × `cols` with leading dimension ld, `batch` matrices `stride` elements apart;
 * fp32 at f or bf16 bits at h. */
typedef struct {
    const float *f;
    const uint16_t *h;
    int64_t rows, cols, ld, batch, stride;
} gemm_operand;

/* Elements from the operand's first to its last: what its bf16 copy spans. */
static int64_t operand_extent(const gemm_operand *o) {
    if (o->rows == 0 || o->cols == 0) return 0;
    return (o->batch - 1) * o->stride + (o->rows - 1) * o->ld + o->cols;
}

/* The largest of 16, 8, 4, 2 bytes that divides the address and the batch stride in bytes (the alignment
 * class cuBLASLt is told: every matrix of the batch starts that aligned). */
static uint32_t align_class(const void *p, int64_t stride_bytes) {
    const uintptr_t a = (uintptr_t)p | (uintptr_t)stride_bytes;
    for (uint32_t k = 16; k > 2; k /= 2)
        if (a % k == 0) return k;
    return 2;
}

/* The column-major layout of a row-major operand [rows, cols] (ld): [cols, rows] with the same ld. */
static ds4_status layout(cublasLtMatrixLayout_t *l, cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld,
                         int64_t batch, int64_t stride) {
    BLAS_TRY(cublasLtMatrixLayoutCreate(l, t, (uint64_t)cols, (uint64_t)rows, ld), "layout");
    if (batch > 1) {
        const int32_t n = (int32_t)batch;
        BLAS_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT, &n, sizeof n), "layout");
        BLAS_TRY(cublasLtMatrixLayoutSetAttribute(*l, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride,
                                                  sizeof stride),
                 "layout");
    }
    return DS4_OK;
}

static void lt_plan_free(lt_plan *d) {
    if (d->c) cublasLtMatrixLayoutDestroy(d->c);
    if (d->b) cublasLtMatrixLayoutDestroy(d->b);
    if (d->a) cublasLtMatrixLayoutDestroy(d->a);
    if (d->op) cublasLtMatmulDescDestroy(d->op);
    memset(d, 0, sizeof *d);
}

/* The descriptors and algorithm of key k (cuBLASLt's first operand is ds4's B: op N when B is [K, N],
 * i.e. column-major [N, K], else T; its second is ds4's A). */
static ds4_status lt_plan_make(cuda_blas *bl, const lt_key *k, lt_plan *d) {
    const cudaDataType_t t = (cudaDataType_t)k->type;
    const cublasOperation_t opa = k->tb ? CUBLAS_OP_T : CUBLAS_OP_N, opb = k->ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    const uint64_t ws = bl->work_bytes;
    cublasLtMatmulPreference_t pref = NULL;
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    ds4_status st = DS4_OK;
    memset(d, 0, sizeof *d);
#define LT_STEP(call, what)                                           \
    do {                                                              \
        if (st == DS4_OK) st = blas_status((call), what);             \
    } while (0)
    LT_STEP(cublasLtMatmulDescCreate(&d->op, CUBLAS_COMPUTE_32F, CUDA_R_32F), "matmul desc");
    LT_STEP(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSA, &opa, sizeof opa), "transa");
    LT_STEP(cublasLtMatmulDescSetAttribute(d->op, CUBLASLT_MATMUL_DESC_TRANSB, &opb, sizeof opb), "transb");
    if (st == DS4_OK) st = layout(&d->a, t, k->tb ? k->N : k->K, k->tb ? k->K : k->N, k->ldb, k->batch, k->sb);
    if (st == DS4_OK) st = layout(&d->b, t, k->ta ? k->K : k->M, k->ta ? k->M : k->K, k->lda, k->batch, k->sa);
    if (st == DS4_OK) st = layout(&d->c, CUDA_R_32F, k->M, k->N, k->ldc, k->batch, k->sc);
    LT_STEP(cublasLtMatmulPreferenceCreate(&pref), "preference");
    LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws),
            "workspace");
    /* the alignment classes of cuBLASLt's A (ds4's B), B (ds4's A), C and D (both C) */
    const cublasLtMatmulPreferenceAttributes_t al_attr[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    const uint32_t al[4] = {k->al_a, k->al_b, k->al_c, k->al_c};
    for (int i = 0; i < 4; i++)
        LT_STEP(cublasLtMatmulPreferenceSetAttribute(pref, al_attr[i], &al[i], sizeof al[i]), "alignment");
    LT_STEP(cublasLtMatmulAlgoGetHeuristic(bl->lt, d->op, d->a, d->b, d->c, d->c, pref, 1, &res, &found), "heuristic");
#undef LT_STEP
    if (pref) cublasLtMatmulPreferenceDestroy(pref);
    if (st == DS4_OK && found < 1)
        st = ds4_fail(DS4_ERR_UNSUPPORTED, "cuda: cuBLASLt has no algorithm for a %s GEMM M %lld N %lld K %lld",
                      t == CUDA_R_32F ? "fp32" : "bf16", (long long)k->M, (long long)k->N, (long long)k->K);
    if (st != DS4_OK) {
        lt_plan_free(d);
        return st;
    }
    d->key = *k;
    d->algo = res.algo;
    d->used = true;
    return DS4_OK;
}

/* The cached plan of key k, made on a miss (the oldest plan makes room: a model has a few dozen shapes). */
static ds4_status lt_plan_get(cuda_blas *bl, const lt_key *k, const lt_plan **out) {
    for (int i = 0; i < BLAS_PLANS; i++)
        if (bl->plans[i].used && memcmp(&bl->plans[i].key, k, sizeof *k) == 0) {
            *out = &bl->plans[i];
            return DS4_OK;
        }
    lt_plan *slot = &bl->plans[bl->next_plan];
    lt_plan_free(slot);
    DS4_TRY(lt_plan_make(bl, k, slot));
    bl->next_plan = (bl->next_plan + 1) % BLAS_PLANS;
    *out = slot;
    return DS4_OK;
}

/* C[M,N] (ldc, batch stride sc) = beta·C + op(A)·op(B), A and B already in the type t (fp32 or bf16).
 * ta: A is stored [K, M] (else [M, K]); tb: B is stored [N, K] (else [K, N]). */
static ds4_status lt_matmul(cuda_blas *bl, cudaStream_t s, cudaDataType_t t, bool ta, bool tb, int64_t M, int64_t N,
                            int64_t K, const void *A, int64_t lda, int64_t sa, const void *B, int64_t ldb, int64_t sb,
                            float *C, int64_t ldc, int64_t sc, int64_t batch, float beta) {
    const int64_t el = t == CUDA_R_32F ? 4 : 2;
    lt_key k;
    memset(&k, 0, sizeof k);
    k.type = (int32_t)t, k.ta = ta, k.tb = tb, k.batch = (int32_t)batch;
    k.M = M, k.N = N, k.K = K, k.lda = lda, k.ldb = ldb, k.ldc = ldc, k.sa = sa, k.sb = sb, k.sc = sc;
    k.al_a = align_class(B, sb * el), k.al_b = align_class(A, sa * el), k.al_c = align_class(C, sc * 4);
    const lt_plan *pl = NULL;
    DS4_TRY(lt_plan_get(bl, &k, &pl));
    const float alpha = 1.0f;
    return blas_status(cublasLtMatmul(bl->lt, pl->op, &alpha, B, pl->a, A, pl->b, &beta, C, pl->c, C, pl->c, &pl->algo,
                                      bl->work, bl->work_bytes, s),
                       "matmul");
}

/* The GEMM on operands a (M×K or K×M) and b, in precision p; the sizes checked, empty products handled:
 * K == 0 leaves beta·C (0 or C), as the cpu GEMMs do. */
static ds4_status gemm(cuda_blas *bl, cudaStream_t s, ds4_matmul_precision p, const char *name, bool ta, bool tb,
                       int64_t M, int64_t N, int64_t K, gemm_operand a, gemm_operand b, float *C, int64_t ldc,
                       int64_t sc, int64_t batch, float beta) {
    CUDA_ARG(M >= 0 && N >= 0 && K >= 0 && batch >= 1, "gemm", "%s: M %lld N %lld K %lld batch %lld", name,
             (long long)M, (long long)N, (long long)K, (long long)batch);
    CUDA_ARG(beta == 0 || beta == 1, "gemm", "%s: beta %g (0 or 1)", name, (double)beta);
    if (M == 0 || N == 0) return DS4_OK;
    if (K == 0) { /* no products: C = beta·C */
        if (beta == 0)
            for (int64_t g = 0; g < batch; g++)
                CUDA_TRY(cudaMemset2DAsync(C + g * sc, (size_t)ldc * sizeof(float), 0, (size_t)N * sizeof(float),
                                           (size_t)M, s));
        return DS4_OK;
    }
    const bool bf16 = p == DS4_MATMUL_BF16 || b.h;
    if (!bf16) return lt_matmul(bl, s, CUDA_R_32F, ta, tb, M, N, K, a.f, a.ld, a.stride, b.f, b.ld, b.stride, C, ldc,
                                sc, batch, beta);
    /* bf16: stage what is fp32 (A always, B unless given as bits), 256-byte aligned pieces */
    const int64_t na = operand_extent(&a), nb = b.h ? 0 : operand_extent(&b);
    const size_t off_b = ((size_t)na * 2 + 255) / 256 * 256;
    DS4_TRY(stage_reserve(bl, s, off_b + (size_t)nb * 2));
    uint16_t *ha = bl->stage, *hb = b.h ? (uint16_t *)b.h : (uint16_t *)((char *)bl->stage + off_b);
    bf16_pack_kernel<<<cuda_blocks(na, 256), 256, 0, s>>>(ha, a.f, na);
    CUDA_LAUNCHED("gemm bf16 staging");
    if (!b.h) {
        bf16_pack_kernel<<<cuda_blocks(nb, 256), 256, 0, s>>>(hb, b.f, nb);
        CUDA_LAUNCHED("gemm bf16 staging");
    }
    return lt_matmul(bl, s, CUDA_R_16BF, ta, tb, M, N, K, ha, a.ld, a.stride, hb, b.ld, b.stride, C, ldc, sc, batch,
                     beta);
}

static gemm_operand f32_op(const float *p, int64_t rows, int64_t cols, int64_t ld) {
    return (gemm_operand){p, NULL, rows, cols, ld, 1, 0};
}
static gemm_operand h16_op(const uint16_t *p, int64_t rows, int64_t cols, int64_t ld) {
    return (gemm_operand){NULL, p, rows, cols, ld, 1, 0};
}

/* C[M,N] = beta*C + A[M,K] · B[N,K]^T */
ds4_status cuda_gemm_nt(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    return gemm(b, s, p, "gemm_nt", false, true, M, N, K, f32_op(A, M, K, lda), f32_op(B, N, K, ldb), C, ldc, 0, 1,
                beta);
}
/* C[M,N] = beta*C + A[M,K] · B[K,N] */
ds4_status cuda_gemm_nn(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    return gemm(b, s, p, "gemm_nn", false, false, M, N, K, f32_op(A, M, K, lda), f32_op(B, K, N, ldb), C, ldc, 0, 1,
                beta);
}
/* C[M,N] = beta*C + A[K,M]^T · B[K,N] */
ds4_status cuda_gemm_tn(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    return gemm(b, s, p, "gemm_tn", true, false, M, N, K, f32_op(A, K, M, lda), f32_op(B, K, N, ldb), C, ldc, 0, 1,
                beta);
}
ds4_status cuda_gemm_nt_hb(cuda_blas *b, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const uint16_t *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    return gemm(b, s, DS4_MATMUL_BF16, "gemm_nt_hb", false, true, M, N, K, f32_op(A, M, K, lda), h16_op(B, N, K, ldb),
                C, ldc, 0, 1, beta);
}
ds4_status cuda_gemm_nn_hb(cuda_blas *b, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const uint16_t *B, int64_t ldb, float *C, int64_t ldc, float beta) {
    return gemm(b, s, DS4_MATMUL_BF16, "gemm_nn_hb", false, false, M, N, K, f32_op(A, M, K, lda), h16_op(B, K, N, ldb),
                C, ldc, 0, 1, beta);
}

/* ---------------------------------------------------------------- linear layers */
/* out[N,OC] = inp[N,IC] · w[OC,IC]^T */
ds4_status cuda_linear_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *out, const float *inp,
                           const float *w, int64_t N, int64_t IC, int64_t OC) {
    return cuda_gemm_nt(b, s, p, N, OC, IC, inp, IC, w, IC, out, OC, 0);
}
/* dinp[N,IC] += dout[N,OC] · w[OC,IC];  dw[OC,IC] += dout^T · inp[N,IC] */
ds4_status cuda_linear_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *dinp, float *dw,
                           const float *dout, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC) {
    if (dinp) DS4_TRY(cuda_gemm_nn(b, s, p, N, IC, OC, dout, OC, w, IC, dinp, IC, 1));
    if (dw) DS4_TRY(cuda_gemm_tn(b, s, p, OC, IC, N, dout, OC, inp, IC, dw, IC, 1));
    return DS4_OK;
}
ds4_status cuda_linear_fwd_bf16w(cuda_blas *b, cudaStream_t s, float *out, const float *inp, const uint16_t *w,
                                 int64_t N, int64_t IC, int64_t OC) {
    return cuda_gemm_nt_hb(b, s, N, OC, IC, inp, IC, w, IC, out, OC, 0);
}
ds4_status cuda_linear_bwd_bf16w(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *dinp, float *dw,
                                 const float *dout, const float *inp, const uint16_t *w, int64_t N, int64_t IC,
                                 int64_t OC) {
    if (dinp) DS4_TRY(cuda_gemm_nn_hb(b, s, N, IC, OC, dout, OC, w, IC, dinp, IC, 1));
    if (dw) DS4_TRY(cuda_gemm_tn(b, s, p, OC, IC, N, dout, OC, inp, IC, dw, IC, 1));
    return DS4_OK;
}

/* ---------------------------------------------------------------- grouped (block-diagonal) layers
 * o: [N, G, Din], w: [G, R, Din], z: [N, G, R]: group g is one matrix of a strided batch. */
static gemm_operand group_op(const float *f, const uint16_t *h, int64_t rows, int64_t cols, int64_t ld, int64_t G,
                             int64_t stride) {
    return (gemm_operand){f, h, rows, cols, ld, G, stride};
}

/* z[:, g, :] = o[:, g, :] · w[g]^T */
static ds4_status grouped_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *z, const float *o,
                              const float *w, const uint16_t *wh, int64_t N, int64_t G, int64_t R, int64_t Din) {
    CUDA_ARG(G >= 1, "grouped_linear_fwd", "G = %lld", (long long)G);
    return gemm(b, s, p, "grouped_linear_fwd", false, true, N, R, Din, group_op(o, NULL, N, Din, G * Din, G, Din),
                group_op(w, wh, R, Din, Din, G, R * Din), z, G * R, R, G, 0);
}
/* do[:, g, :] += dz[:, g, :] · w[g];  dw[g] += dz[:, g, :]^T · o[:, g, :] (dw in precision p) */
static ds4_status grouped_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *do_, float *dw,
                              const float *dz, const float *o, const float *w, const uint16_t *wh, int64_t N, int64_t G,
                              int64_t R, int64_t Din) {
    CUDA_ARG(G >= 1, "grouped_linear_bwd", "G = %lld", (long long)G);
    if (do_)
        DS4_TRY(gemm(b, s, p, "grouped_linear_bwd", false, false, N, Din, R, group_op(dz, NULL, N, R, G * R, G, R),
                     group_op(w, wh, R, Din, Din, G, R * Din), do_, G * Din, Din, G, 1));
    if (dw)
        DS4_TRY(gemm(b, s, p, "grouped_linear_bwd", true, false, R, Din, N, group_op(dz, NULL, N, R, G * R, G, R),
                     group_op(o, NULL, N, Din, G * Din, G, Din), dw, Din, R * Din, G, 1));
    return DS4_OK;
}

ds4_status cuda_grouped_linear_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *z, const float *o,
                                   const float *w, int64_t N, int64_t G, int64_t R, int64_t Din) {
    return grouped_fwd(b, s, p, z, o, w, NULL, N, G, R, Din);
}
ds4_status cuda_grouped_linear_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *do_, float *dw,
                                   const float *dz, const float *o, const float *w, int64_t N, int64_t G, int64_t R,
                                   int64_t Din) {
    return grouped_bwd(b, s, p, do_, dw, dz, o, w, NULL, N, G, R, Din);
}
ds4_status cuda_grouped_linear_fwd_bf16w(cuda_blas *b, cudaStream_t s, float *z, const float *o, const uint16_t *w,
                                         int64_t N, int64_t G, int64_t R, int64_t Din) {
    return grouped_fwd(b, s, DS4_MATMUL_BF16, z, o, NULL, w, N, G, R, Din);
}
ds4_status cuda_grouped_linear_bwd_bf16w(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *do_, float *dw,
                                         const float *dz, const float *o, const uint16_t *w, int64_t N, int64_t G,
                                         int64_t R, int64_t Din) {
    /* do_ reads the weight's bits (bf16 always); dw is the fp32-weight layer's GEMM in precision p */
    if (do_) DS4_TRY(grouped_bwd(b, s, DS4_MATMUL_BF16, do_, NULL, dz, o, NULL, w, N, G, R, Din));
    if (dw) DS4_TRY(grouped_bwd(b, s, p, NULL, dw, dz, o, NULL, NULL, N, G, R, Din));
    return DS4_OK;
}
