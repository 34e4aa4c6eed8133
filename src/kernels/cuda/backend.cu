/* The "cuda" backend's table (src/kernels/ops.def): every entry on the launchers of this folder, the
 * context's stream (ds4_exec.stream: NULL is the backend's default queue) and the context's matmul
 * precision. Memory is device memory (cudaMalloc), counted by the allocator's statistics per category.
 *
 * An entry cannot return a status (the table's ops are void, as on the cpu): the first launch that fails
 * is kept, with its message, until ds4_cuda_backend_status reads it; the ops after it still run.
 *
 * Linked only into programs that link libds4cuda.a (the tests and benches of tests/cuda, bench/): the
 * registry of src/kernels/backend.c finds it through a weak reference. Its plan twin is the cpu's for
 * now: a plan on it counts the cpu kernels' workspace, not cuBLASLt's or the attention kernels' scratch. */
#include <stdio.h>
#include <string.h>

#include "kernels/cuda/attn.cuh"
#include "kernels/cuda/cuda.h"
#include "kernels/cuda/hc.cuh"

extern "C" {
#include "kernels/backend.h"
#include "kernels/cpu/cpu.h"
}

/* A queue of the backend: a CUDA stream with the cuBLASLt handle and the scratch its ops share. */
struct ds4_stream {
    cudaStream_t s;
    cuda_blas *blas;
    double *ce_rows; /* the cross-entropy's per-row losses [ce_cap] */
    int64_t ce_cap;
    void *scratch; /* the step ops' scratch (sumsq's chunk sums, Newton–Schulz's matrices) [scratch_cap] */
    size_t scratch_cap;
};

/* ------------------------------------------------------------------ errors */
static ds4_status g_first = DS4_OK; /* the first failure since the last ds4_cuda_backend_status */
static char g_first_msg[512];

static void note(ds4_status st) {
    if (st == DS4_OK || g_first != DS4_OK) return;
    g_first = st;
    snprintf(g_first_msg, sizeof g_first_msg, "%s", ds4_errmsg());
}

extern "C" ds4_status ds4_cuda_backend_status(void) {
    const ds4_status st = g_first;
    if (st != DS4_OK) ds4_fail(st, "cuda backend: %s", g_first_msg);
    g_first = DS4_OK;
    return st;
}

/* ------------------------------------------------------------------ the queue of a context */
static ds4_stream g_default; /* the backend's default queue: the legacy stream, made on first use */

static ds4_stream *queue_of(const ds4_exec *ex) {
    if (ex && ex->stream) return ex->stream;
    if (!g_default.blas) note(cuda_blas_create(&g_default.blas, 0));
    return &g_default;
}
static cudaStream_t S(const ds4_exec *ex) { return queue_of(ex)->s; }
static void *queue_scratch(ds4_stream *q, size_t bytes);
static ds4_matmul_precision P(const ds4_exec *ex) { return ex ? ex->matmul_precision : DS4_MATMUL_FP32; }

/* ------------------------------------------------------------------ memory */
/* Live buffers with their size and category, for the statistics when they are freed. */
typedef struct {
    void *p;
    size_t bytes;
    ds4_mem_cat cat;
} dev_buf;
static dev_buf *g_bufs;
static int64_t g_nbufs, g_capbufs;

static void *e_buf_alloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes) {
    (void)ex;
    void *p = NULL;
    if (!ds4_grow((void **)&g_bufs, &g_capbufs, g_nbufs + 1, sizeof *g_bufs)) return NULL;
    if (cuda_alloc(&p, bytes ? bytes : 1) != DS4_OK) {
        ds4_fail(DS4_ERR_OOM, "cuda: out of device memory allocating %zu bytes of %s", bytes, ds4_mem_cat_name(cat));
        return NULL;
    }
    g_bufs[g_nbufs++] = (dev_buf){p, bytes, cat};
    ds4_mem_track(cat, (int64_t)bytes);
    return p;
}

static void e_buf_free(const ds4_exec *ex, void *p) {
    if (!p) return;
    for (int64_t i = 0; i < g_nbufs; i++) {
        if (g_bufs[i].p != p) continue;
        ds4_mem_track(g_bufs[i].cat, -(int64_t)g_bufs[i].bytes);
        g_bufs[i] = g_bufs[--g_nbufs];
        note(cuda_stream_sync(S(ex))); /* ops queued on the buffer finish before it goes back */
        note(cuda_free(p));
        return;
    }
    note(ds4_fail(DS4_ERR_INTERNAL, "cuda: buf_free of %p, not a buffer of this backend", p));
}

static void *e_range_reserve(const ds4_exec *ex, size_t bytes) {
    (void)ex;
    void *p = NULL;
    return cuda_range_reserve(&p, bytes) == DS4_OK ? p : NULL;
}
static void e_range_release(const ds4_exec *ex, void *p, size_t bytes) { note(cuda_range_release(S(ex), p, bytes)); }
static bool e_range_map(const ds4_exec *ex, void *p, size_t bytes, ds4_mem_cat cat) {
    if (cuda_range_map(S(ex), p, bytes) != DS4_OK) return false;
    ds4_mem_track(cat, (int64_t)bytes);
    return true;
}
static void e_range_unmap(const ds4_exec *ex, void *p, size_t bytes, ds4_mem_cat cat) {
    note(cuda_range_unmap(S(ex), p, bytes));
    ds4_mem_track(cat, -(int64_t)bytes);
}

static void e_copy_to_device(const ds4_exec *ex, void *dst, const void *src, size_t bytes) {
    if (bytes) note(cuda_copy_h2d(S(ex), dst, src, bytes));
}
static void e_copy_to_host(const ds4_exec *ex, void *dst, const void *src, size_t bytes) {
    if (bytes) note(cuda_copy_d2h(S(ex), dst, src, bytes));
}
static void e_synchronize(const ds4_exec *ex) { note(cuda_stream_sync(S(ex))); }
static ds4_status e_ops_status(const ds4_exec *ex) {
    (void)ex;
    return ds4_cuda_backend_status();
}

/* ------------------------------------------------------------------ GEMMs and the layers on them */
#define BLAS(ex) queue_of(ex)->blas, S(ex)
static void e_gemm_nt(const ds4_exec *ex, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                      int64_t ldb, float *C, int64_t ldc, float beta) {
    note(cuda_gemm_nt(BLAS(ex), P(ex), M, N, K, A, lda, B, ldb, C, ldc, beta));
}
static void e_gemm_nn(const ds4_exec *ex, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                      int64_t ldb, float *C, int64_t ldc, float beta) {
    note(cuda_gemm_nn(BLAS(ex), P(ex), M, N, K, A, lda, B, ldb, C, ldc, beta));
}
static void e_gemm_tn(const ds4_exec *ex, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                      int64_t ldb, float *C, int64_t ldc, float beta) {
    note(cuda_gemm_tn(BLAS(ex), P(ex), M, N, K, A, lda, B, ldb, C, ldc, beta));
}
/* cuBLASLt keeps its workspace in the queue's handle: nothing to reserve. */
static void e_gemm_workspace_reserve(const ds4_exec *ex) { (void)ex; }
static void e_gemm_workspace_release(const ds4_exec *ex) { (void)ex; }
static void e_linear_fwd(const ds4_exec *ex, float *out, const float *inp, const float *w, int64_t N, int64_t IC,
                         int64_t OC) {
    note(cuda_linear_fwd(BLAS(ex), P(ex), out, inp, w, N, IC, OC));
}
static void e_linear_bwd(const ds4_exec *ex, float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                         int64_t N, int64_t IC, int64_t OC) {
    note(cuda_linear_bwd(BLAS(ex), P(ex), dinp, dw, dout, inp, w, N, IC, OC));
}
static void e_grouped_linear_fwd(const ds4_exec *ex, float *z, const float *o, const float *w, int64_t N, int64_t G,
                                 int64_t R, int64_t Din) {
    note(cuda_grouped_linear_fwd(BLAS(ex), P(ex), z, o, w, N, G, R, Din));
}
static void e_grouped_linear_bwd(const ds4_exec *ex, float *do_, float *dw, const float *dz, const float *o,
                                 const float *w, int64_t N, int64_t G, int64_t R, int64_t Din) {
    note(cuda_grouped_linear_bwd(BLAS(ex), P(ex), do_, dw, dz, o, w, N, G, R, Din));
}
static void e_linear_fwd_bf16w(const ds4_exec *ex, float *out, const float *inp, const uint16_t *w, int64_t N,
                               int64_t IC, int64_t OC) {
    note(cuda_linear_fwd_bf16w(BLAS(ex), out, inp, w, N, IC, OC));
}
static void e_linear_bwd_bf16w(const ds4_exec *ex, float *dinp, float *dw, const float *dout, const float *inp,
                               const uint16_t *w, int64_t N, int64_t IC, int64_t OC) {
    note(cuda_linear_bwd_bf16w(BLAS(ex), P(ex), dinp, dw, dout, inp, w, N, IC, OC));
}
static void e_grouped_linear_fwd_bf16w(const ds4_exec *ex, float *z, const float *o, const uint16_t *w, int64_t N,
                                       int64_t G, int64_t R, int64_t Din) {
    note(cuda_grouped_linear_fwd_bf16w(BLAS(ex), z, o, w, N, G, R, Din));
}
static void e_grouped_linear_bwd_bf16w(const ds4_exec *ex, float *do_, float *dw, const float *dz, const float *o,
                                       const uint16_t *w, int64_t N, int64_t G, int64_t R, int64_t Din) {
    note(cuda_grouped_linear_bwd_bf16w(BLAS(ex), P(ex), do_, dw, dz, o, w, N, G, R, Din));
}

/* ------------------------------------------------------------------ row ops, norms, rope */
static void e_embedding_fwd(const ds4_exec *ex, float *out, const float *table, const int32_t *ids, int64_t N,
                            int64_t D) {
    note(cuda_embedding_fwd(S(ex), out, table, ids, N, D));
}
static void e_embedding_bwd(const ds4_exec *ex, float *dtable, const float *dout, const int32_t *ids, int64_t N,
                            int64_t D) {
    note(cuda_embedding_bwd(S(ex), dtable, dout, ids, N, D));
}
static void e_rmsnorm_fwd(const ds4_exec *ex, float *y, float *rstd, const float *x, const float *w, int64_t N,
                          int64_t D, float eps) {
    note(cuda_rmsnorm_fwd(S(ex), y, rstd, x, w, N, D, eps));
}
static void e_rmsnorm_bwd(const ds4_exec *ex, float *dx, float *dw, const float *dy, const float *x, const float *w,
                          const float *rstd, int64_t N, int64_t D) {
    note(cuda_rmsnorm_bwd(S(ex), dx, dw, dy, x, w, rstd, N, D));
}
/* The model keeps its rope tables in the backend's memory (model.c), as the launchers need them. */
static void e_rope_fwd(const ds4_exec *ex, float *x, const rope_args *a) { note(cuda_rope_fwd(S(ex), x, a)); }
static void e_rope_bwd(const ds4_exec *ex, float *dx, const rope_args *a) { note(cuda_rope_bwd(S(ex), dx, a)); }

/* ------------------------------------------------------------------ mHC, compressor, attention, indexer */
static void e_hc_split_sinkhorn_fwd(const ds4_exec *ex, const hc_sinkhorn_args *a) {
    note(cuda_hc_split_sinkhorn_fwd(S(ex), a));
}
static void e_hc_split_sinkhorn_bwd(const ds4_exec *ex, const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g) {
    note(cuda_hc_split_sinkhorn_bwd(S(ex), a, g));
}
static void e_hc_pre_fwd(const ds4_exec *ex, const hc_pre_args *a) { note(cuda_hc_pre_fwd(S(ex), a)); }
static void e_hc_pre_bwd(const ds4_exec *ex, const hc_pre_args *a, const hc_pre_grads *g) {
    note(cuda_hc_pre_bwd(S(ex), a, g));
}
static void e_hc_post_fwd(const ds4_exec *ex, const hc_post_args *a) { note(cuda_hc_post_fwd(S(ex), a)); }
static void e_hc_post_bwd(const ds4_exec *ex, const hc_post_args *a, const hc_post_grads *g) {
    note(cuda_hc_post_bwd(S(ex), a, g));
}
static void e_hc_head_fwd(const ds4_exec *ex, const hc_head_args *a) { note(cuda_hc_head_fwd(S(ex), a)); }
static void e_hc_head_bwd(const ds4_exec *ex, const hc_head_args *a, const hc_head_grads *g) {
    note(cuda_hc_head_bwd(S(ex), a, g));
}
static void e_compressor_pool_fwd(const ds4_exec *ex, const compressor_pool_args *a) {
    note(cuda_compressor_pool_fwd(S(ex), a));
}
static void e_compressor_pool_bwd(const ds4_exec *ex, const compressor_pool_args *a, const compressor_pool_grads *g) {
    note(cuda_compressor_pool_bwd(S(ex), a, g));
}
static void e_sparse_attn_fwd(const ds4_exec *ex, const sparse_attn_args *a) { note(cuda_sparse_attn_fwd(S(ex), a)); }
static void e_sparse_attn_bwd(const ds4_exec *ex, const sparse_attn_args *a, const sparse_attn_grads *g) {
    note(cuda_sparse_attn_bwd(S(ex), a, g));
}
static void e_indexer_topk_fwd(const ds4_exec *ex, const indexer_topk_args *a) {
    if (a->t0 != 0) { /* the cached decoder's one-position selection */
        note(ds4_fail(DS4_ERR_UNSUPPORTED, "cuda: the indexer top-k of rows from position %lld (the cached decoder) "
                      "is not implemented", (long long)a->t0));
        return;
    }
    note(cuda_indexer_topk_fwd(S(ex), a));
}
static void e_indexer_kl_fwd_bwd(const ds4_exec *ex, const indexer_kl_args *a) {
    note(cuda_indexer_kl_fwd_bwd(S(ex), a));
}
/* A count of the sizes alone, computed on the host as the cpu computes it. */
static int64_t e_indexer_kl_rows(const ds4_exec *ex, int64_t B, int64_t T, int64_t ratio) {
    (void)ex;
    return cpu_indexer_kl_rows(B, T, ratio);
}

/* ------------------------------------------------------------------ MoE */
static void e_moe_gate_fwd(const ds4_exec *ex, const moe_gate_args *a) { note(cuda_moe_gate_fwd(S(ex), a)); }
static void e_moe_gate_bwd(const ds4_exec *ex, const moe_gate_args *a, const moe_gate_grads *g) {
    note(cuda_moe_gate_bwd(S(ex), a, g));
}
static void e_moe_balanced_table(const ds4_exec *ex, int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E) {
    note(cuda_moe_balanced_table(S(ex), table, ids, N, K, E));
}
static void e_moe_group_by_expert(const ds4_exec *ex, int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx,
                                  int64_t N, int64_t E, int64_t K) {
    note(cuda_moe_group_by_expert(S(ex), eoff, etok, eslot, idx, N, E, K));
}
/* The counts cross to the host here (ops.def: the one op whose output is host memory): the differences
 * in the queue's scratch, then a copy and a wait. */
static void e_moe_expert_counts(const ds4_exec *ex, int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK) {
    int64_t *d = (int64_t *)queue_scratch(queue_of(ex), (size_t)(E > 0 ? E : 1) * sizeof(int64_t));
    if (!d) return;
    note(cuda_moe_expert_counts(S(ex), d, eoff, E, NK));
    note(cuda_copy_d2h(S(ex), cnt, d, (size_t)E * sizeof(int64_t)));
    note(cuda_stream_sync(S(ex)));
}
static void e_moe_expert_load(const ds4_exec *ex, int64_t *load, const int64_t *eoff, int64_t E) {
    note(cuda_moe_expert_load(S(ex), load, eoff, E));
}
static void e_moe_assignment_weights(const ds4_exec *ex, float *wj, const float *w, const int32_t *etok,
                                     const int32_t *eslot, int64_t NK, int64_t K) {
    note(cuda_moe_assignment_weights(S(ex), wj, w, etok, eslot, NK, K));
}
static void e_moe_weight_grads_add(const ds4_exec *ex, float *dgw, const float *dw, const int32_t *etok,
                                   const int32_t *eslot, int64_t NK, int64_t K) {
    note(cuda_moe_weight_grads_add(S(ex), dgw, dw, etok, eslot, NK, K));
}
static void e_rows_gather(const ds4_exec *ex, float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    note(cuda_rows_gather(S(ex), dst, src, rows, n, D));
}
static void e_rows_scatter_add(const ds4_exec *ex, float *dst, const float *src, const int32_t *rows, int64_t n,
                               int64_t D) {
    note(cuda_rows_scatter_add(S(ex), dst, src, rows, n, D));
}
static void e_rows_pack(const ds4_exec *ex, float *dst, const float *x, const int32_t *rows, const float *w, int64_t n,
                        int64_t D) {
    note(cuda_rows_pack(S(ex), dst, x, rows, w, n, D));
}
static void e_rows_unpack(const ds4_exec *ex, float *x, float *w, const float *src, int64_t n, int64_t D) {
    note(cuda_rows_unpack(S(ex), x, w, src, n, D));
}
static void e_moe_unpack_grads_add(const ds4_exec *ex, float *dx, float *dgw, const float *src, const int32_t *etok,
                                   const int32_t *eslot, int64_t NK, int64_t D, int64_t K) {
    note(cuda_moe_unpack_grads_add(S(ex), dx, dgw, src, etok, eslot, NK, D, K));
}
/* The experts' row offsets reach the host here, once per MoE layer and direction: each expert's GEMMs are
 * launched with its row count (the model passes them in the backend's memory). run gets a copy of a whose
 * offsets are that host copy. */
template <typename Run> static void with_host_offsets(const ds4_exec *ex, const moe_experts_args *a, Run run) {
    int64_t *off = (int64_t *)ds4_alloc(DS4_MEM_OTHER, (size_t)(a->nexp + 1) * sizeof(int64_t));
    if (!off) return note(DS4_ERR_OOM);
    note(cuda_copy_d2h(S(ex), off, a->off, (size_t)(a->nexp + 1) * sizeof(int64_t)));
    note(cuda_stream_sync(S(ex)));
    moe_experts_args h = *a;
    h.off = off;
    if (g_first == DS4_OK) note(run(&h));
    ds4_free(off);
}
static void e_moe_experts_fwd(const ds4_exec *ex, const moe_experts_args *a, float *y) {
    with_host_offsets(ex, a, [&](const moe_experts_args *h) { return cuda_moe_experts_fwd(BLAS(ex), P(ex), h, y); });
}
static void e_moe_experts_bwd(const ds4_exec *ex, const moe_experts_args *a, const moe_experts_grads *g) {
    with_host_offsets(ex, a, [&](const moe_experts_args *h) { return cuda_moe_experts_bwd(BLAS(ex), P(ex), h, g); });
}
static void e_swiglu_fwd(const ds4_exec *ex, float *act, const float *g, const float *u, int64_t N, int64_t I,
                         float limit) {
    note(cuda_swiglu_fwd(S(ex), act, g, u, N, I, limit));
}
static void e_swiglu_bwd(const ds4_exec *ex, float *dg, float *du, const float *dact, const float *g, const float *u,
                         int64_t N, int64_t I, float limit) {
    note(cuda_swiglu_bwd(S(ex), dg, du, dact, g, u, N, I, limit));
}

/* ------------------------------------------------------------------ loss, data movement */
static void e_cross_entropy_fwd_bwd(const ds4_exec *ex, double *loss_sum, int64_t *n_scored, float *dlogits,
                                    const float *logits, const int32_t *targets, int64_t N, int64_t V,
                                    float grad_scale) {
    ds4_stream *q = queue_of(ex);
    if (q->ce_cap < N) { /* the per-row scratch grows with the longest batch seen */
        note(cuda_stream_sync(q->s));
        note(cuda_free(q->ce_rows));
        q->ce_rows = NULL;
        q->ce_cap = 0;
        void *p = NULL;
        const ds4_status st = cuda_alloc(&p, cuda_cross_entropy_scratch_bytes(N));
        if (st != DS4_OK) return note(st);
        q->ce_rows = (double *)p;
        q->ce_cap = N;
    }
    note(cuda_cross_entropy_fwd_bwd(q->s, loss_sum, n_scored, dlogits, logits, targets, N, V, grad_scale, q->ce_rows));
}
static void e_tensor_copy(const ds4_exec *ex, void *dst, const void *src, size_t bytes) {
    note(cuda_tensor_copy(S(ex), dst, src, bytes));
}
static void e_tensor_zero(const ds4_exec *ex, void *dst, size_t bytes) { note(cuda_tensor_zero(S(ex), dst, bytes)); }
static void e_tensor_add(const ds4_exec *ex, float *dst, const float *src, int64_t n) {
    note(cuda_tensor_add(S(ex), dst, src, n));
}
static void e_tensor_round_bf16(const ds4_exec *ex, float *x, int64_t n) { note(cuda_tensor_round_bf16(S(ex), x, n)); }
static void e_tensor_pack_bf16(const ds4_exec *ex, uint16_t *dst, const float *src, int64_t n) {
    note(cuda_tensor_pack_bf16(S(ex), dst, src, n));
}
static void e_tensor_unpack_bf16(const ds4_exec *ex, float *dst, const uint16_t *src, int64_t n) {
    note(cuda_tensor_unpack_bf16(S(ex), dst, src, n));
}
static void e_shift_ids(const ds4_exec *ex, int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift,
                        int32_t fill) {
    note(cuda_shift_ids(S(ex), out, ids, B, T, shift, fill));
}
static void e_streams_expand(const ds4_exec *ex, float *X, int64_t N, int64_t n, int64_t D) {
    note(cuda_streams_expand(S(ex), X, N, n, D));
}
static void e_streams_add(const ds4_exec *ex, float *X, const float *x, int64_t N, int64_t n, int64_t D) {
    note(cuda_streams_add(S(ex), X, x, N, n, D));
}
static void e_streams_sum(const ds4_exec *ex, float *dx, const float *dX, int64_t N, int64_t n, int64_t D) {
    note(cuda_streams_sum(S(ex), dx, dX, N, n, D));
}

/* ------------------------------------------------------------------ the step around the passes */
/* The queue's scratch, grown to at least `bytes` (the ops queued before finish first); NULL on failure. */
static void *queue_scratch(ds4_stream *q, size_t bytes) {
    if (q->scratch_cap >= bytes) return q->scratch;
    note(cuda_stream_sync(q->s));
    note(cuda_free(q->scratch));
    q->scratch = NULL;
    q->scratch_cap = 0;
    const ds4_status st = cuda_alloc(&q->scratch, bytes);
    if (st != DS4_OK) {
        note(st);
        q->scratch = NULL;
        return NULL;
    }
    q->scratch_cap = bytes;
    return q->scratch;
}
static void e_sumsq(const ds4_exec *ex, double *out, const float *x, int64_t n) {
    double *part = (double *)queue_scratch(queue_of(ex), cuda_sumsq_scratch_bytes(n));
    if (part) note(cuda_sumsq(S(ex), out, x, n, part));
}
static void e_sumsq_exact(const ds4_exec *ex, ds4_sumsq_acc *acc, const float *x, int64_t n) {
    note(cuda_sumsq_exact(S(ex), acc, x, n));
}
static void e_rank_sum_add(const ds4_exec *ex, float *g, const float *recv, int n, int64_t len) {
    note(cuda_rank_sum_add(S(ex), g, recv, n, len));
}
static void e_scale_f32(const ds4_exec *ex, float *x, int64_t n, float s) { note(cuda_scale_f32(S(ex), x, n, s)); }
static void e_count_nonfinite(const ds4_exec *ex, int64_t *out, const float *x, int64_t n) {
    note(cuda_count_nonfinite(S(ex), out, x, n));
}
static void e_adamw_update(const ds4_exec *ex, int64_t n, float *w, const float *g, float *m, float *v,
                           ds4_adamw_consts k, bool decay) {
    const cuda_adamw_k ck = {k.b1, k.b2, k.eps, k.omb1, k.omb2, k.step_size, k.inv_sqrt_bc2, k.decay};
    note(cuda_adamw_update(S(ex), &ck, n, m, v, decay, w, g));
}
static void e_muon_momentum(const ds4_exec *ex, int64_t n, const float *g, float *mom, float *u, float mu,
                            bool nesterov) {
    note(cuda_muon_momentum(S(ex), n, g, mom, u, mu, nesterov));
}
static void e_muon_apply(const ds4_exec *ex, int64_t n, float *w, const float *o, float decay, float step) {
    note(cuda_muon_apply(S(ex), n, w, o, decay, step));
}
static void e_newton_schulz(const ds4_exec *ex, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                            int64_t iters, float eps) {
    void *scratch = queue_scratch(queue_of(ex), cuda_newton_schulz_scratch_bytes(rows, cols));
    if (scratch) note(cuda_newton_schulz(BLAS(ex), P(ex), x, rows, cols, &coef->a, iters, eps, scratch));
}

/* ------------------------------------------------------------------ the table */
static ds4_kernel_backend g_table;

/* A GPU the runtime sees: the backend is built into every ds4 where nvcc was, the device is not. */
static ds4_status e_ready(void) {
    int n = 0;
    DS4_TRY(cuda_device_count(&n));
    if (n < 1) return ds4_fail(DS4_ERR_UNSUPPORTED, "no CUDA device is visible here (no GPU, or no driver)");
    return DS4_OK;
}

/* One line per visible GPU. */
static void e_describe(char *buf, size_t cap) {
    int n = 0;
    size_t used = 0;
    if (cuda_device_count(&n) != DS4_OK) n = 0;
    for (int d = 0; d < n && used + 1 < cap; d++) {
        char line[256];
        if (cuda_device_describe(d, line, sizeof line) != DS4_OK) snprintf(line, sizeof line, "cuda:%d (%s)", d, ds4_errmsg());
        used += (size_t)snprintf(buf + used, cap - used, "%s\n", line);
    }
}

static void make_table(void) {
    g_table.name = "cuda";
    g_table.plan = &ds4_kernel_backend_plan_table;
    g_table.ready = e_ready;
    g_table.describe = e_describe;
#define DS4_OP(name, plan, cpu, params, args) g_table.name = e_##name;
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) g_table.name = e_##name;
#include "kernels/ops.def"
}

extern "C" void ds4_cuda_backend_release(void) {
    if (g_default.blas) {
        note(cuda_stream_sync(g_default.s));
        cuda_blas_destroy(g_default.blas);
    }
    note(cuda_free(g_default.ce_rows));
    note(cuda_free(g_default.scratch));
    g_default = ds4_stream{};
}

extern "C" const ds4_kernel_backend *ds4_kernel_backend_cuda(void) {
    if (!g_table.name) make_table();
    return &g_table;
}
