/* The kernel backend seam: one table of entry points per backend. Model code never names a backend's
 * functions; it calls the wrappers of kernels.h, which call through the table ds4_kernels() returns.
 *
 * Backends today (README.md in this folder says how to add one, e.g. CUDA):
 *  - "cpu"  (cpu/, x86/): portable C with OpenMP and vector types; its GEMM runs the engine that
 *           dispatch.c picks from the CPU at start (ISA level, DS4_ISA caps it).
 *  - "plan" (plan.c): what a plan step runs (memplan): no data is touched; the entries that
 *           allocate workspace in the cpu backend allocate and free the same bytes, so a plan counts
 *           what a real step allocates; every other entry is NULL (the wrapper does nothing).
 * ds4_kernels() is the one place that picks between them. */
#ifndef DS4_KERNELS_BACKEND_H
#define DS4_KERNELS_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ds4/core.h"

/* The descriptors of the ops with many operands (defined, with their shapes, in kernels.h). */
typedef struct rope_args rope_args;
typedef struct hc_sinkhorn_args hc_sinkhorn_args;
typedef struct hc_sinkhorn_grads hc_sinkhorn_grads;
typedef struct hc_pre_args hc_pre_args;
typedef struct hc_pre_grads hc_pre_grads;
typedef struct hc_post_args hc_post_args;
typedef struct hc_post_grads hc_post_grads;
typedef struct hc_head_args hc_head_args;
typedef struct hc_head_grads hc_head_grads;
typedef struct compressor_pool_args compressor_pool_args;
typedef struct compressor_pool_grads compressor_pool_grads;
typedef struct sparse_attn_args sparse_attn_args;
typedef struct sparse_attn_grads sparse_attn_grads;
typedef struct indexer_topk_args indexer_topk_args;
typedef struct indexer_kl_args indexer_kl_args;
typedef struct moe_gate_args moe_gate_args;
typedef struct moe_gate_grads moe_gate_grads;
typedef struct moe_expert_w moe_expert_w;
typedef struct moe_experts_args moe_experts_args;
typedef struct moe_experts_grads moe_experts_grads;

/* C[M,N] = beta·C + op(A)·op(B): the signature of gemm_nt / gemm_nn / gemm_tn (kernels.h). */
typedef void gemm_signature(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                            int64_t ldb, float *C, int64_t ldc, float beta);

/* The same with B given as bf16 bits (gemm_nt / gemm_nn of a weight's bf16 compute copy). */
typedef void gemm_signature_hb(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const uint16_t *B,
                               int64_t ldb, float *C, int64_t ldc, float beta);

/* One backend. Semantics of every entry: kernels.h (same name). A NULL entry does nothing: only the
 * plan backend has them; a compute backend fills every entry (ds4_kernel_backend_missing checks). */
typedef struct ds4_kernel_backend {
    const char *name;
    gemm_signature *gemm_nt, *gemm_nn, *gemm_tn;
    void (*gemm_workspace_reserve)(void);
    void (*gemm_workspace_release)(void);
    void (*linear_fwd)(float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC);
    void (*linear_bwd)(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int64_t N,
                       int64_t IC, int64_t OC);
    void (*grouped_linear_fwd)(float *z, const float *o, const float *w, int64_t N, int64_t G, int64_t R,
                               int64_t Din);
    void (*grouped_linear_bwd)(float *do_, float *dw, const float *dz, const float *o, const float *w, int64_t N,
                               int64_t G, int64_t R, int64_t Din);
    void (*linear_fwd_bf16w)(float *out, const float *inp, const uint16_t *w, int64_t N, int64_t IC, int64_t OC);
    void (*linear_bwd_bf16w)(float *dinp, float *dw, const float *dout, const float *inp, const uint16_t *w, int64_t N,
                             int64_t IC, int64_t OC);
    void (*grouped_linear_fwd_bf16w)(float *z, const float *o, const uint16_t *w, int64_t N, int64_t G, int64_t R,
                                     int64_t Din);
    void (*grouped_linear_bwd_bf16w)(float *do_, float *dw, const float *dz, const float *o, const uint16_t *w,
                                     int64_t N, int64_t G, int64_t R, int64_t Din);
    void (*embedding_fwd)(float *out, const float *table, const int32_t *ids, int64_t N, int64_t D);
    void (*embedding_bwd)(float *dtable, const float *dout, const int32_t *ids, int64_t N, int64_t D);
    void (*rmsnorm_fwd)(float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D, float eps);
    void (*rmsnorm_bwd)(float *dx, float *dw, const float *dy, const float *x, const float *w, const float *rstd,
                        int64_t N, int64_t D);
    void (*rope_fwd)(float *x, const rope_args *a);
    void (*rope_bwd)(float *dx, const rope_args *a);
    void (*hc_split_sinkhorn_fwd)(const hc_sinkhorn_args *a);
    void (*hc_split_sinkhorn_bwd)(const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g);
    void (*hc_pre_fwd)(const hc_pre_args *a);
    void (*hc_pre_bwd)(const hc_pre_args *a, const hc_pre_grads *g);
    void (*hc_post_fwd)(const hc_post_args *a);
    void (*hc_post_bwd)(const hc_post_args *a, const hc_post_grads *g);
    void (*hc_head_fwd)(const hc_head_args *a);
    void (*hc_head_bwd)(const hc_head_args *a, const hc_head_grads *g);
    void (*compressor_pool_fwd)(const compressor_pool_args *a);
    void (*compressor_pool_bwd)(const compressor_pool_args *a, const compressor_pool_grads *g);
    void (*sparse_attn_fwd)(const sparse_attn_args *a);
    void (*sparse_attn_bwd)(const sparse_attn_args *a, const sparse_attn_grads *g);
    void (*indexer_topk_fwd)(const indexer_topk_args *a);
    void (*indexer_kl_fwd_bwd)(const indexer_kl_args *a);
    int64_t (*indexer_kl_rows)(int64_t B, int64_t T, int64_t ratio);
    void (*moe_gate_fwd)(const moe_gate_args *a);
    void (*moe_gate_bwd)(const moe_gate_args *a, const moe_gate_grads *g);
    void (*moe_balanced_table)(int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E);
    void (*moe_group_by_expert)(int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx, int64_t N,
                                int64_t E, int64_t K);
    void (*moe_expert_counts)(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK);
    void (*moe_expert_load)(int64_t *load, const int64_t *eoff, int64_t E);
    void (*moe_assignment_weights)(float *wj, const float *w, const int32_t *etok, const int32_t *eslot, int64_t NK,
                                   int64_t K);
    void (*moe_weight_grads_add)(float *dgw, const float *dw, const int32_t *etok, const int32_t *eslot, int64_t NK,
                                 int64_t K);
    void (*rows_gather)(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D);
    void (*rows_scatter_add)(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D);
    void (*rows_pack)(float *dst, const float *x, const int32_t *rows, const float *w, int64_t n, int64_t D);
    void (*rows_unpack)(float *x, float *w, const float *src, int64_t n, int64_t D);
    void (*moe_unpack_grads_add)(float *dx, float *dgw, const float *src, const int32_t *etok, const int32_t *eslot,
                                 int64_t NK, int64_t D, int64_t K);
    void (*moe_experts_fwd)(const moe_experts_args *a, float *y);
    void (*moe_experts_bwd)(const moe_experts_args *a, const moe_experts_grads *g);
    void (*swiglu_fwd)(float *act, const float *g, const float *u, int64_t N, int64_t I, float limit);
    void (*swiglu_bwd)(float *dg, float *du, const float *dact, const float *g, const float *u, int64_t N,
                       int64_t I, float limit);
    void (*cross_entropy_fwd_bwd)(double *loss_sum, int64_t *n_scored, float *dlogits, const float *logits,
                                  const int32_t *targets, int64_t N, int64_t V, float grad_scale);
    void (*tensor_copy)(void *dst, const void *src, size_t bytes);
    void (*tensor_zero)(void *dst, size_t bytes);
    void (*tensor_add)(float *dst, const float *src, int64_t n);
    void (*tensor_round_bf16)(float *x, int64_t n);
    void (*tensor_pack_bf16)(uint16_t *dst, const float *src, int64_t n);
    void (*tensor_unpack_bf16)(float *dst, const uint16_t *src, int64_t n);
    void (*shift_ids)(int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift, int32_t fill);
    void (*streams_expand)(float *X, int64_t N, int64_t n, int64_t D);
    void (*streams_add)(float *X, const float *x, int64_t N, int64_t n, int64_t D);
    void (*streams_sum)(float *dx, const float *dX, int64_t N, int64_t n, int64_t D);
} ds4_kernel_backend;

/* Every entry of the table, for checks that walk it (X(name) per entry). */
#define DS4_KERNEL_ENTRIES(X)                                                                                 \
    X(gemm_nt) X(gemm_nn) X(gemm_tn) X(gemm_workspace_reserve) X(gemm_workspace_release) X(linear_fwd)        \
    X(linear_bwd) X(grouped_linear_fwd) X(grouped_linear_bwd) X(linear_fwd_bf16w) X(linear_bwd_bf16w)          \
    X(grouped_linear_fwd_bf16w) X(grouped_linear_bwd_bf16w) X(embedding_fwd) X(embedding_bwd)               \
    X(rmsnorm_fwd) X(rmsnorm_bwd) X(rope_fwd) X(rope_bwd) X(hc_split_sinkhorn_fwd) X(hc_split_sinkhorn_bwd)   \
    X(hc_pre_fwd) X(hc_pre_bwd) X(hc_post_fwd) X(hc_post_bwd) X(hc_head_fwd) X(hc_head_bwd)                   \
    X(compressor_pool_fwd) X(compressor_pool_bwd) X(sparse_attn_fwd) X(sparse_attn_bwd) X(indexer_topk_fwd)   \
    X(indexer_kl_fwd_bwd) X(indexer_kl_rows) X(moe_gate_fwd) X(moe_gate_bwd) X(moe_balanced_table)            \
    X(moe_group_by_expert) X(moe_expert_counts) X(moe_expert_load) X(moe_assignment_weights)                  \
    X(moe_weight_grads_add) X(rows_gather) X(rows_scatter_add) X(rows_pack) X(rows_unpack)                    \
    X(moe_unpack_grads_add) X(moe_experts_fwd) X(moe_experts_bwd) X(swiglu_fwd) X(swiglu_bwd)                 \
    X(cross_entropy_fwd_bwd) X(tensor_copy) X(tensor_zero) X(tensor_add) X(tensor_round_bf16)     \
    X(tensor_pack_bf16) X(tensor_unpack_bf16) X(shift_ids) X(streams_expand)       \
    X(streams_add) X(streams_sum)

/* The table in use: the plan backend while the allocator serves a plan (ds4_exec_current), else the
 * compute backend. */
const ds4_kernel_backend *ds4_kernels(void);
/* The backends, for tests and `ds4 info`. */
const ds4_kernel_backend *ds4_kernel_backend_cpu(void);
const ds4_kernel_backend *ds4_kernel_backend_plan(void);
/* The name of the first NULL entry of b, or NULL when b fills every entry (a compute backend must). */
const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b);

#endif
