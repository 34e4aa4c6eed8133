/* The cpu backend: the entry points its table (cpu/backend.c) points to, the portable reference GEMMs
 * its GEMM driver falls back to, and the workspace mirrors the plan backend runs. Semantics: kernels.h
 * (same name without `cpu_`). Model code calls kernels.h, never these; tests call them to compare the
 * engines of one backend. */
#ifndef DS4_KERNELS_CPU_H
#define DS4_KERNELS_CPU_H

#include "kernels/kernels.h"

/* The cpu backend's plan twin (../plan.c): what memplan runs in its place. */
extern const ds4_kernel_backend ds4_kernel_backend_plan_table;

/* The cpu backend's table per ISA level (backend.c, compiled once per level by the Makefile): generic
 * always; avx2 and avx512 where the build defines DS4_CPU_LEVELS (x86-64, not portable-only). The
 * dispatch (../dispatch.c) picks one: ds4_kernel_backend_cpu(). */
extern const ds4_kernel_backend ds4_cpu_kernels_generic, ds4_cpu_kernels_avx2, ds4_cpu_kernels_avx512;

/* How a cpu table entry calls its function (ops.def's `cpu` column): fn(operands) for PLAIN, fn(the
 * context's matmul precision, operands) for PREC. args is the entry's argument list, context first. */
static inline ds4_matmul_precision cpu_precision_of(const ds4_exec *ex) {
    return ex ? ex->matmul_precision : DS4_MATMUL_FP32;
}
#define CPU_CALL_PLAIN(fn, args) ((void)DS4_FIRST args, fn(DS4_DROP_FIRST args))
#define CPU_CALL_PREC(fn, args) fn(cpu_precision_of(DS4_FIRST args), DS4_DROP_FIRST args)

/* ---- memory (cpu/memory.c): host blocks of the one allocator; their plan mirrors count without memory ---- */
void *cpu_buf_alloc(ds4_mem_cat cat, size_t bytes);
void cpu_buf_free(void *p);
void cpu_copy_to_device(void *dst, const void *src, size_t bytes);
void cpu_copy_to_host(void *dst, const void *src, size_t bytes);
void cpu_synchronize(void);
ds4_status cpu_ops_status(void);
void *cpu_buf_alloc_plan(ds4_mem_cat cat, size_t bytes);
void cpu_buf_free_plan(void *p);
/* Reserved ranges: host address space (ds4_range_*, core.h); a plan's pieces are only counted. */
void *cpu_range_reserve(size_t bytes);
void cpu_range_release(void *p, size_t bytes);
bool cpu_range_map(void *p, size_t bytes, ds4_mem_cat cat);
void cpu_range_unmap(void *p, size_t bytes, ds4_mem_cat cat);
void *cpu_range_reserve_plan(size_t bytes);
void cpu_range_release_plan(void *p, size_t bytes);
bool cpu_range_map_plan(void *p, size_t bytes, ds4_mem_cat cat);
void cpu_range_unmap_plan(void *p, size_t bytes, ds4_mem_cat cat);

/* ---- GEMM: the blocked driver (../gemm.c) on the engine the dispatch chose ---- */
/* The drivers take the matmul precision first: it picks the engine family (fp32 or bf16 operands). */
typedef void gemm_driver_signature(ds4_matmul_precision prec, int64_t M, int64_t N, int64_t K, const float *A,
                                   int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta);
gemm_driver_signature cpu_gemm_nt, cpu_gemm_nn, cpu_gemm_tn;
void cpu_gemm_workspace_reserve(void);
/* The GEMMs on the calling thread with the caller's packing buffer ws (at least cpu_gemm_serial_bytes(M, N,
 * K) bytes, a bound that does not depend on the CPU), for kernels that share work among their own threads
 * (sparse attention's query blocks, the routed experts): the driver's bits (cpu_gemm_*) in that precision. */
size_t cpu_gemm_serial_bytes(int64_t M, int64_t N, int64_t K);
typedef void gemm_serial_signature(ds4_matmul_precision prec, void *ws, int64_t M, int64_t N, int64_t K,
                                   const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc,
                                   float beta);
gemm_serial_signature cpu_gemm_serial_nt, cpu_gemm_serial_nn, cpu_gemm_serial_tn;
/* ... and with B as bf16 bits (cpu_gemm_nt_hb / _nn_hb's bits) */
typedef void gemm_serial_signature_hb(void *ws, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                                      const uint16_t *B, int64_t ldb, float *C, int64_t ldc, float beta);
gemm_serial_signature_hb cpu_gemm_serial_nt_hb, cpu_gemm_serial_nn_hb;
void cpu_gemm_workspace_release(void);

/* The portable reference GEMMs (cpu/gemm.c): one fp32 sum per element, k ascending. What the driver
 * runs without an engine (DS4_ISA=generic, a CPU below AVX2, a non-x86 target). */
gemm_signature cpu_gemm_nt_ref, cpu_gemm_nn_ref, cpu_gemm_tn_ref;
/* Their bf16 precision (cpu/gemm_bf16.c): operands rounded by gemm_bf16_round, products summed in
 * double: the oracle of the bf16 engines (layouts of cpu_gemm_nt/nn/tn). */
gemm_signature cpu_gemm_nt_bf16_ref, cpu_gemm_nn_bf16_ref, cpu_gemm_tn_bf16_ref;
/* The bf16 GEMMs with B given as bf16 bits (a weight's compute copy, kernels.h linear_fwd_bf16w): the
 * driver on the bf16 engine whatever the matmul precision, and their reference (cpu/gemm_bf16.c). Same
 * bits as cpu_gemm_nt/nn in bf16 precision on the fp32 values the bits were rounded from. */
gemm_signature_hb cpu_gemm_nt_hb, cpu_gemm_nn_hb, cpu_gemm_nt_hb_ref, cpu_gemm_nn_hb_ref;

/* ---- the other ops (cpu/<op>.c, compiled from cpu/<op>.inc) ---- */
void cpu_linear_fwd(ds4_matmul_precision prec, float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC);
void cpu_linear_bwd(ds4_matmul_precision prec, float *dinp, float *dw, const float *dout, const float *inp, const float *w, int64_t N,
                    int64_t IC, int64_t OC);
void cpu_grouped_linear_fwd(ds4_matmul_precision prec, float *z, const float *o, const float *w, int64_t N, int64_t G, int64_t R, int64_t Din);
void cpu_grouped_linear_bwd(ds4_matmul_precision prec, float *do_, float *dw, const float *dz, const float *o, const float *w, int64_t N,
                            int64_t G, int64_t R, int64_t Din);
void cpu_linear_fwd_bf16w(float *out, const float *inp, const uint16_t *w, int64_t N, int64_t IC, int64_t OC);
void cpu_linear_bwd_bf16w(ds4_matmul_precision prec, float *dinp, float *dw, const float *dout, const float *inp, const uint16_t *w, int64_t N,
                          int64_t IC, int64_t OC);
void cpu_grouped_linear_fwd_bf16w(float *z, const float *o, const uint16_t *w, int64_t N, int64_t G, int64_t R,
                                  int64_t Din);
void cpu_grouped_linear_bwd_bf16w(ds4_matmul_precision prec, float *do_, float *dw, const float *dz, const float *o, const uint16_t *w,
                                  int64_t N, int64_t G, int64_t R, int64_t Din);
void cpu_embedding_fwd(float *out, const float *table, const int32_t *ids, int64_t N, int64_t D);
void cpu_embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int64_t N, int64_t D);
void cpu_rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D, float eps);
void cpu_rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x, const float *w, const float *rstd,
                     int64_t N, int64_t D);
void cpu_rope_fwd(float *x, const rope_args *a);
void cpu_rope_bwd(float *dx, const rope_args *a);
void cpu_hc_split_sinkhorn_fwd(const hc_sinkhorn_args *a);
void cpu_hc_split_sinkhorn_bwd(const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g);
void cpu_hc_pre_fwd(const hc_pre_args *a);
void cpu_hc_pre_bwd(const hc_pre_args *a, const hc_pre_grads *g);
void cpu_hc_post_fwd(const hc_post_args *a);
void cpu_hc_post_bwd(const hc_post_args *a, const hc_post_grads *g);
void cpu_hc_head_fwd(const hc_head_args *a);
void cpu_hc_head_bwd(const hc_head_args *a, const hc_head_grads *g);
void cpu_compressor_pool_fwd(const compressor_pool_args *a);
void cpu_compressor_pool_bwd(const compressor_pool_args *a, const compressor_pool_grads *g);
void cpu_sparse_attn_fwd(const sparse_attn_args *a);
void cpu_sparse_attn_bwd(const sparse_attn_args *a, const sparse_attn_grads *g);
void cpu_indexer_topk_fwd(const indexer_topk_args *a);
void cpu_indexer_kl_fwd_bwd(const indexer_kl_args *a);
int64_t cpu_indexer_kl_rows(int64_t B, int64_t T, int64_t ratio);
void cpu_moe_gate_fwd(const moe_gate_args *a);
void cpu_moe_gate_bwd(const moe_gate_args *a, const moe_gate_grads *g);
void cpu_moe_balanced_table(int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E);
void cpu_moe_group_by_expert(int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx, int64_t N, int64_t E,
                             int64_t K);
void cpu_moe_expert_counts(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK);
void cpu_moe_expert_load(int64_t *load, const int64_t *eoff, int64_t E);
void cpu_moe_assignment_weights(float *wj, const float *w, const int32_t *etok, const int32_t *eslot, int64_t NK,
                                int64_t K);
void cpu_moe_weight_grads_add(float *dgw, const float *dw, const int32_t *etok, const int32_t *eslot, int64_t NK,
                              int64_t K);
void cpu_rows_gather(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D);
void cpu_rows_scatter_add(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D);
void cpu_rows_pack(float *dst, const float *x, const int32_t *rows, const float *w, int64_t n, int64_t D);
void cpu_rows_unpack(float *x, float *w, const float *src, int64_t n, int64_t D);
void cpu_moe_unpack_grads_add(float *dx, float *dgw, const float *src, const int32_t *etok, const int32_t *eslot,
                              int64_t NK, int64_t D, int64_t K);
void cpu_moe_experts_fwd(ds4_matmul_precision prec, const moe_experts_args *a, float *y);
void cpu_moe_experts_bwd(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g);
void cpu_swiglu_fwd(float *act, const float *g, const float *u, int64_t N, int64_t I, float limit);
void cpu_swiglu_bwd(float *dg, float *du, const float *dact, const float *g, const float *u, int64_t N, int64_t I,
                    float limit);
void cpu_cross_entropy_fwd_bwd(double *loss_sum, int64_t *n_scored, float *dlogits, const float *logits,
                               const int32_t *targets, int64_t N, int64_t V, float grad_scale);
void cpu_tensor_copy(void *dst, const void *src, size_t bytes);
void cpu_tensor_zero(void *dst, size_t bytes);
void cpu_tensor_add(float *dst, const float *src, int64_t n);
void cpu_tensor_round_bf16(float *x, int64_t n);
void cpu_tensor_pack_bf16(uint16_t *dst, const float *src, int64_t n);
void cpu_tensor_unpack_bf16(float *dst, const uint16_t *src, int64_t n);
void cpu_shift_ids(int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift, int32_t fill);
void cpu_streams_expand(float *X, int64_t N, int64_t n, int64_t D);
void cpu_streams_add(float *X, const float *x, int64_t N, int64_t n, int64_t D);
void cpu_streams_sum(float *dx, const float *dX, int64_t N, int64_t n, int64_t D);

/* ---- the step around the passes (cpu/step.c) ---- */
void cpu_sumsq(double *out, const float *x, int64_t n);
void cpu_sumsq_exact(ds4_sumsq_acc *acc, const float *x, int64_t n);
void cpu_rank_sum_add(float *g, const float *recv, int n, int64_t len);
void cpu_scale_f32(float *x, int64_t n, float s);
void cpu_count_nonfinite(int64_t *out, const float *x, int64_t n);
void cpu_adamw_update(int64_t n, float *w, const float *g, float *m, float *v, ds4_adamw_consts k, bool decay);
void cpu_muon_momentum(int64_t n, const float *g, float *mom, float *u, float mu, bool nesterov);
void cpu_muon_apply(int64_t n, float *w, const float *o, float decay, float step);
void cpu_newton_schulz(ds4_matmul_precision prec, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                       int64_t iters, float eps);

/* ---- workspace mirrors (the plan backend's entries) ----
 * Same signature as the entry they mirror; they allocate and free exactly the workspace that entry
 * would (sizes from the same code), write the outputs that entry writes before it computes anything
 * (indexer KL: *kl_sum = 0, *n_rows = 0), and touch no tensor data. */
gemm_driver_signature cpu_gemm_nt_plan, cpu_gemm_nn_plan, cpu_gemm_tn_plan;
void cpu_gemm_workspace_reserve_plan(void);
void cpu_linear_fwd_plan(ds4_matmul_precision prec, float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC);
void cpu_linear_bwd_plan(ds4_matmul_precision prec, float *dinp, float *dw, const float *dout, const float *inp, const float *w, int64_t N,
                         int64_t IC, int64_t OC);
void cpu_grouped_linear_fwd_plan(ds4_matmul_precision prec, float *z, const float *o, const float *w, int64_t N, int64_t G, int64_t R,
                                 int64_t Din);
void cpu_grouped_linear_bwd_plan(ds4_matmul_precision prec, float *do_, float *dw, const float *dz, const float *o, const float *w, int64_t N,
                                 int64_t G, int64_t R, int64_t Din);
gemm_signature_hb cpu_gemm_nt_hb_plan, cpu_gemm_nn_hb_plan;
void cpu_linear_fwd_bf16w_plan(float *out, const float *inp, const uint16_t *w, int64_t N, int64_t IC, int64_t OC);
void cpu_linear_bwd_bf16w_plan(ds4_matmul_precision prec, float *dinp, float *dw, const float *dout, const float *inp, const uint16_t *w,
                               int64_t N, int64_t IC, int64_t OC);
void cpu_grouped_linear_fwd_bf16w_plan(float *z, const float *o, const uint16_t *w, int64_t N, int64_t G, int64_t R,
                                       int64_t Din);
void cpu_grouped_linear_bwd_bf16w_plan(ds4_matmul_precision prec, float *do_, float *dw, const float *dz, const float *o, const uint16_t *w,
                                       int64_t N, int64_t G, int64_t R, int64_t Din);
void cpu_sparse_attn_fwd_plan(const sparse_attn_args *a);
void cpu_sparse_attn_bwd_plan(const sparse_attn_args *a, const sparse_attn_grads *g);
void cpu_indexer_topk_fwd_plan(const indexer_topk_args *a);
void cpu_indexer_kl_fwd_bwd_plan(const indexer_kl_args *a);
void cpu_moe_experts_fwd_plan(ds4_matmul_precision prec, const moe_experts_args *a, float *y);
void cpu_moe_experts_bwd_plan(ds4_matmul_precision prec, const moe_experts_args *a, const moe_experts_grads *g);
void cpu_newton_schulz_plan(ds4_matmul_precision prec, float *x, int64_t rows, int64_t cols, const ds4_ns_coef *coef,
                            int64_t iters, float eps);
/* Not a workspace mirror: a plan's routing is balanced (kernels.h: moe_expert_counts). */
void cpu_moe_expert_counts_plan(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK);

#endif
