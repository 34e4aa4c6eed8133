/* The CUDA backend of ds4 (docs/cuda.md): device memory, copies, streams and the launchers of the ops,
 * callable from C. Not wired into ds4_kernels() yet: the seam that gives every op a stream and a memory
 * half (issue "A backend is ops and memory") plugs these into a table.
 *
 * Conventions of every launcher here:
 *  - Tensor pointers are DEVICE pointers; descriptors (rope_args, moe_gate_args) and sizes are host
 *    values. Semantics and argument order are those of the kernels.h entry of the same name: forward
 *    outputs are overwritten, backward gradients ACCUMULATE (+=), a NULL gradient skips its work.
 *  - Each takes the stream it runs on and returns a ds4_status: a bad size or a failed launch is an error
 *    (ds4_errmsg names the op); nothing here exits. Work is queued, not finished, on return.
 *  - Deterministic: the same inputs give the same bits on every run on the same GPU and build. No float
 *    atomics; every sum runs in an order fixed by the sizes alone (docs/cuda.md lists each op's order).
 *  - Scalars the step reads (the loss sum, the scored rows) land in device buffers, never on the host. */
#ifndef DS4_KERNELS_CUDA_H
#define DS4_KERNELS_CUDA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#include <cuda_runtime_api.h>
#else
typedef struct CUstream_st *cudaStream_t; /* the CUDA runtime's own definition */
typedef struct CUevent_st *cudaEvent_t;
#endif

#ifdef __cplusplus
extern "C" { /* kernels.h and backend.h are C headers without their own guard */
#endif
#include "ds4/core.h"
#include "ds4/kernels.h"
#include "kernels/kernels.h"

/* ================================================================ the backend's table (backend.cu)
 * "cuda": every entry of ds4_kernel_backend on the launchers below (src/kernels/ops.def), the context's
 * stream and matmul precision. ds4_cuda_backend_status: the first failure of its ops since the last call
 * (DS4_OK: none), with its message in ds4_errmsg. */
const struct ds4_kernel_backend *ds4_kernel_backend_cuda(void);
ds4_status ds4_cuda_backend_status(void);
/* Releases what the default queue holds (its cuBLASLt handle and scratch; made again on next use): before
 * a program ends, so that a leak check sees only real leaks. */
void ds4_cuda_backend_release(void);

/* ================================================================ memory, copies, ordering (cuda_mem.cu) */
/* Visible CUDA devices; 0 (and DS4_OK) when there is no driver or no device. */
ds4_status cuda_device_count(int *n);
/* One line naming device `dev`: name, compute capability, memory, multiprocessors. */
ds4_status cuda_device_describe(int dev, char *buf, size_t cap);

/* Free and total bytes of the current device's memory (what a memory plan is checked against). */
ds4_status cuda_device_memory(size_t *free_bytes, size_t *total_bytes);

/* Device memory: *p = bytes of device memory (NULL for 0 bytes); free of NULL is a no-op. */
ds4_status cuda_alloc(void **p, size_t bytes);
ds4_status cuda_free(void *p);
/* Pinned host memory (the offload tier, staging of host-device copies). */
ds4_status cuda_alloc_pinned(void **p, size_t bytes);
ds4_status cuda_free_pinned(void *p);

/* Reserved ranges (cuda_vmm.cu; ops.def range_*): device addresses with memory behind only the mapped
 * pieces; a mapped piece reads zeros. */
ds4_status cuda_range_reserve(void **p, size_t bytes);
ds4_status cuda_range_map(cudaStream_t s, void *p, size_t bytes);
ds4_status cuda_range_unmap(cudaStream_t s, void *p, size_t bytes);
ds4_status cuda_range_release(cudaStream_t s, void *p, size_t bytes);

/* Copies of `bytes` queued on stream s (host buffers should be pinned for the copy to overlap). */
ds4_status cuda_copy_h2d(cudaStream_t s, void *dst, const void *src, size_t bytes);
ds4_status cuda_copy_d2h(cudaStream_t s, void *dst, const void *src, size_t bytes);
ds4_status cuda_copy_d2d(cudaStream_t s, void *dst, const void *src, size_t bytes);
/* dst [bytes] = byte value `byte`; cuda_fill_f32: dst [n] = value. */
ds4_status cuda_fill(cudaStream_t s, void *dst, int byte, size_t bytes);
ds4_status cuda_fill_f32(cudaStream_t s, float *dst, float value, int64_t n);

/* Streams and events: ordering between streams (a copy stream waits for the compute stream's event). */
ds4_status cuda_stream_create(cudaStream_t *s);
ds4_status cuda_stream_destroy(cudaStream_t s);
ds4_status cuda_stream_sync(cudaStream_t s);
ds4_status cuda_event_create(cudaEvent_t *e);
ds4_status cuda_event_destroy(cudaEvent_t e);
ds4_status cuda_event_record(cudaEvent_t e, cudaStream_t s);
ds4_status cuda_stream_wait(cudaStream_t s, cudaEvent_t e); /* later work on s waits for e */
ds4_status cuda_event_sync(cudaEvent_t e);

/* ================================================================ GEMMs (cuda_gemm.cu), cuBLASLt
 * One handle per stream of work: the cuBLASLt handle, its workspace and the bf16 staging of fp32
 * operands. Precision fp32: true fp32 (CUBLAS_COMPUTE_32F, TF32 off). bf16: both operands rounded to
 * bf16 exactly as gemm_bf16_bits rounds them (nearest even, denormals to zero), products accumulated in
 * fp32, fp32 output. The _hb GEMMs take B as bf16 bits (a weight's compute copy) and are bf16 always. */
typedef struct cuda_blas cuda_blas;
ds4_status cuda_blas_create(cuda_blas **b, size_t workspace_bytes); /* 0: 32 MiB */
void cuda_blas_destroy(cuda_blas *b);
/* Device bytes the handle holds now (workspace and bf16 staging), for the memory plan. */
size_t cuda_blas_bytes(const cuda_blas *b);

/* Same layouts and beta rule as gemm_nt / gemm_nn / gemm_tn (kernels.h). */
ds4_status cuda_gemm_nt(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta);
ds4_status cuda_gemm_nn(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta);
ds4_status cuda_gemm_tn(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, int64_t M, int64_t N, int64_t K,
                        const float *A, int64_t lda, const float *B, int64_t ldb, float *C, int64_t ldc, float beta);
ds4_status cuda_gemm_nt_hb(cuda_blas *b, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const uint16_t *B, int64_t ldb, float *C, int64_t ldc, float beta);
ds4_status cuda_gemm_nn_hb(cuda_blas *b, cudaStream_t s, int64_t M, int64_t N, int64_t K, const float *A, int64_t lda,
                           const uint16_t *B, int64_t ldb, float *C, int64_t ldc, float beta);

/* The layers over them (kernels.h linear_*, grouped_linear_*; the groups run as one strided batch). */
ds4_status cuda_linear_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *out, const float *inp,
                           const float *w, int64_t N, int64_t IC, int64_t OC);
ds4_status cuda_linear_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *dinp, float *dw,
                           const float *dout, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC);
ds4_status cuda_grouped_linear_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *z, const float *o,
                                   const float *w, int64_t N, int64_t G, int64_t R, int64_t Din);
ds4_status cuda_grouped_linear_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *do_, float *dw,
                                   const float *dz, const float *o, const float *w, int64_t N, int64_t G, int64_t R,
                                   int64_t Din);
/* bf16w: the GEMMs that read the weight read its bf16 bits; dw is the fp32-weight layer's GEMM in
 * precision p (as on the cpu, whose dw GEMM follows the matmul precision). */
ds4_status cuda_linear_fwd_bf16w(cuda_blas *b, cudaStream_t s, float *out, const float *inp, const uint16_t *w,
                                 int64_t N, int64_t IC, int64_t OC);
ds4_status cuda_linear_bwd_bf16w(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *dinp, float *dw,
                                 const float *dout, const float *inp, const uint16_t *w, int64_t N, int64_t IC,
                                 int64_t OC);
ds4_status cuda_grouped_linear_fwd_bf16w(cuda_blas *b, cudaStream_t s, float *z, const float *o, const uint16_t *w,
                                         int64_t N, int64_t G, int64_t R, int64_t Din);
ds4_status cuda_grouped_linear_bwd_bf16w(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *do_, float *dw,
                                         const float *dz, const float *o, const uint16_t *w, int64_t N, int64_t G,
                                         int64_t R, int64_t Din);

/* ================================================================ data movement (cuda_data.cu)
 * Element by element as cpu/data.c: the same bits. */
ds4_status cuda_tensor_copy(cudaStream_t s, void *dst, const void *src, size_t bytes);
ds4_status cuda_tensor_zero(cudaStream_t s, void *dst, size_t bytes);
ds4_status cuda_tensor_add(cudaStream_t s, float *dst, const float *src, int64_t n);
ds4_status cuda_tensor_round_bf16(cudaStream_t s, float *x, int64_t n);
ds4_status cuda_tensor_pack_bf16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n);
ds4_status cuda_tensor_unpack_bf16(cudaStream_t s, float *dst, const uint16_t *src, int64_t n);
ds4_status cuda_shift_ids(cudaStream_t s, int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift,
                          int32_t fill);
ds4_status cuda_streams_expand(cudaStream_t s, float *X, int64_t N, int64_t n, int64_t D);
ds4_status cuda_streams_add(cudaStream_t s, float *X, const float *x, int64_t N, int64_t n, int64_t D);
ds4_status cuda_streams_sum(cudaStream_t s, float *dx, const float *dX, int64_t N, int64_t n, int64_t D);

/* ================================================================ the row ops (cuda_ops.cu) */
ds4_status cuda_embedding_fwd(cudaStream_t s, float *out, const float *table, const int32_t *ids, int64_t N,
                              int64_t D);
/* rows_scatter_add of dout into dtable: each column's thread walks the tokens in order (the cpu's sums). */
ds4_status cuda_embedding_bwd(cudaStream_t s, float *dtable, const float *dout, const int32_t *ids, int64_t N,
                              int64_t D);
ds4_status cuda_rmsnorm_fwd(cudaStream_t s, float *y, float *rstd, const float *x, const float *w, int64_t N,
                            int64_t D, float eps);
ds4_status cuda_rmsnorm_bwd(cudaStream_t s, float *dx, float *dw, const float *dy, const float *x, const float *w,
                            const float *rstd, int64_t N, int64_t D);
/* a->table's cos and sin must be device copies of the host table (cuda_rope_table_upload). */
ds4_status cuda_rope_fwd(cudaStream_t s, float *x, const rope_args *a);
ds4_status cuda_rope_bwd(cudaStream_t s, float *dx, const rope_args *a);
/* dev = host's table with cos and sin in device memory (cuda_rope_table_free releases them). */
ds4_status cuda_rope_table_upload(cudaStream_t s, ds4_rope *dev, const ds4_rope *host);
void cuda_rope_table_free(ds4_rope *dev);
ds4_status cuda_swiglu_fwd(cudaStream_t s, float *act, const float *g, const float *u, int64_t N, int64_t I,
                           float limit);
ds4_status cuda_swiglu_bwd(cudaStream_t s, float *dg, float *du, const float *dact, const float *g, const float *u,
                           int64_t N, int64_t I, float limit);
/* Cross-entropy: *loss_sum (device double) and *n_scored (device int64) are written on the device, in
 * the cpu's order (rows in 64 fixed ranges, ranges added in order). row_loss: device scratch of N doubles
 * (cuda_cross_entropy_scratch_bytes). dlogits may be NULL. */
size_t cuda_cross_entropy_scratch_bytes(int64_t N);
ds4_status cuda_cross_entropy_fwd_bwd(cudaStream_t s, double *loss_sum, int64_t *n_scored, float *dlogits,
                                      const float *logits, const int32_t *targets, int64_t N, int64_t V,
                                      float grad_scale, double *row_loss);

/* ================================================================ AdamW (cuda_optim.cu)
 * The per-element update of src/train/optim.c, same constants, same operations in the same order, so
 * the same bits. The constants of step `step` (1-based) come from cuda_adamw_consts, as the cpu
 * optimizer computes them. decay: whether decoupled weight decay applies to these n elements. */
typedef struct {
    float b1, b2, eps, omb1, omb2, step_size, inv_sqrt_bc2, decay;
} cuda_adamw_k;
cuda_adamw_k cuda_adamw_consts(int64_t step, double beta1, double beta2, double eps, double weight_decay, double lr);
ds4_status cuda_adamw_update(cudaStream_t s, const cuda_adamw_k *k, int64_t n, float *m, float *v, int decay, float *w,
                             const float *g);
/* Muon's per-element steps (ds4_muon_momentum, ds4_muon_apply), the same bits. g, mom, u, w, o: [n]. */
ds4_status cuda_muon_momentum(cudaStream_t s, int64_t n, const float *g, float *mom, float *u, float mu, int nesterov);
ds4_status cuda_muon_apply(cudaStream_t s, int64_t n, float *w, const float *o, float decay, float step);
/* g [len] += Σ_r recv [n][len], rank order first (ops.def rank_sum_add). */
ds4_status cuda_rank_sum_add(cudaStream_t s, float *g, const float *recv, int n, int64_t len);

/* ================================================================ gradient norms (cuda_norm.cu)
 * src/core/norm.c's rules with the cpu's bits; the results stay in device memory. */
/* *out = ds4_sumsq(x, n): chunks of 2^16 in order. part: device scratch (cuda_sumsq_scratch_bytes). */
size_t cuda_sumsq_scratch_bytes(int64_t n);
ds4_status cuda_sumsq(cudaStream_t s, double *out, const float *x, int64_t n, double *part);
/* *acc (device) = ds4_sumsq_exact(x, n), normalized; *value = ds4_sumsq_value(acc). */
ds4_status cuda_sumsq_exact(cudaStream_t s, ds4_sumsq_acc *acc, const float *x, int64_t n);
ds4_status cuda_sumsq_value(cudaStream_t s, double *value, const ds4_sumsq_acc *acc);
/* *norm = sqrt(*sumsq); ds4_clip_scale(g, n, max_norm, *norm) with the norm read on the device. */
ds4_status cuda_sqrt(cudaStream_t s, double *norm, const double *sumsq);
ds4_status cuda_clip_scale(cudaStream_t s, float *g, int64_t n, double max_norm, const double *norm);
/* x [n] *= sc (ds4_scale_f32). */
ds4_status cuda_scale_f32(cudaStream_t s, float *x, int64_t n, float sc);
/* *out (device) = how many of x [n] are not finite. */
ds4_status cuda_count_nonfinite(cudaStream_t s, int64_t *out, const float *x, int64_t n);

/* ================================================================ Newton–Schulz (cuda_orth.cu)
 * ds4_newton_schulz (src/model/orth.c) on the device: x [rows, cols] := its approximate orthogonal
 * factor, iters quintic iterations with coef [iters][3] = (a, b, c) (ds4_ns_coef's layout), GEMMs in
 * precision p. scratch: device bytes cuda_newton_schulz_scratch_bytes(rows, cols). */
size_t cuda_newton_schulz_scratch_bytes(int64_t rows, int64_t cols);
ds4_status cuda_newton_schulz(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, float *x, int64_t rows,
                              int64_t cols, const float *coef, int64_t iters, float eps, void *scratch);

/* ================================================================ MoE gate and routing (cuda_moe.cu)
 * kernels.h's MoE entries. Counts and offsets (eoff, cnt, load) stay on the device. */
ds4_status cuda_moe_gate_fwd(cudaStream_t s, const moe_gate_args *a);
ds4_status cuda_moe_gate_bwd(cudaStream_t s, const moe_gate_args *a, const moe_gate_grads *g);
ds4_status cuda_moe_balanced_table(cudaStream_t s, int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E);
/* eoff [E + 1], etok, eslot [N·K]: the assignments grouped by expert, (token, slot) ascending within one. */
ds4_status cuda_moe_group_by_expert(cudaStream_t s, int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx,
                                    int64_t N, int64_t E, int64_t K);
ds4_status cuda_moe_expert_counts(cudaStream_t s, int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK);
ds4_status cuda_moe_expert_load(cudaStream_t s, int64_t *load, const int64_t *eoff, int64_t E);
ds4_status cuda_moe_assignment_weights(cudaStream_t s, float *wj, const float *w, const int32_t *etok,
                                       const int32_t *eslot, int64_t NK, int64_t K);
ds4_status cuda_moe_weight_grads_add(cudaStream_t s, float *dgw, const float *dw, const int32_t *etok,
                                     const int32_t *eslot, int64_t NK, int64_t K);
ds4_status cuda_rows_gather(cudaStream_t s, float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D);
ds4_status cuda_rows_scatter_add(cudaStream_t s, float *dst, const float *src, const int32_t *rows, int64_t n,
                                 int64_t D);
ds4_status cuda_rows_pack(cudaStream_t s, float *dst, const float *x, const int32_t *rows, const float *w, int64_t n,
                          int64_t D);
ds4_status cuda_rows_unpack(cudaStream_t s, float *x, float *w, const float *src, int64_t n, int64_t D);
ds4_status cuda_moe_unpack_grads_add(cudaStream_t s, float *dx, float *dgw, const float *src, const int32_t *etok,
                                     const int32_t *eslot, int64_t NK, int64_t D, int64_t K);

/* ================================================================ routed experts (cuda_experts.cu)
 * kernels.h moe_experts_fwd/bwd, expert by expert on the launchers above (precision p for fp32 weights;
 * a->hcopy set: the bf16 copy). a->off is a HOST array [nexp + 1]: each expert's GEMMs need its row
 * count, so the caller copies the grouping's offsets to the host once per MoE layer. */
ds4_status cuda_moe_experts_fwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, const moe_experts_args *a,
                                float *y);
ds4_status cuda_moe_experts_bwd(cuda_blas *b, cudaStream_t s, ds4_matmul_precision p, const moe_experts_args *a,
                                const moe_experts_grads *g);

#ifdef __cplusplus
}
#endif
#endif
