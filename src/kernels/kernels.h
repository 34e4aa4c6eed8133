/* ds4 kernels: one forward and one backward function per op, plain float32 pointers plus
 * explicit sizes, row-major. The math of each op is in docs/dsv4-architecture.md (section given).
 *
 * Conventions (every op follows them):
 *  - Forward functions overwrite their outputs.
 *  - Backward functions ACCUMULATE (+=) into every gradient output; callers zero gradients once.
 *    A NULL gradient pointer means "not needed" and skips that work.
 *  - Deterministic: for a fixed thread count, the same inputs give the same bits. No float
 *    atomics; reductions over threads are done in a fixed order.
 *  - `cpu/` holds the portable CPU version of each op (OpenMP, vector types). Where a faster version
 *    exists (the GEMM: gemm.c runs the engine that dispatch.c picks from the CPU at run time, x86/),
 *    the portable one keeps the `_ref` suffix and the fast one has the plain name, same signature and
 *    semantics; tests compare the two. Ops without a faster version are defined once, under the plain
 *    name, in cpu/.
 *  - The same signatures are what a CUDA backend would implement.
 */
#ifndef DS4_KERNELS_H
#define DS4_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ds4/core.h"

/* Every kernel starts with this (after allocating its workspace, if it has one, so that memplan's
 * shape-only run counts the same bytes): in shape-only mode there is no data to compute on. */
#define KERNEL_SHAPE_ONLY_RETURN(...)        \
    do {                                     \
        if (ds4_shape_only()) return __VA_ARGS__; \
    } while (0)

/* ================================================================ gemm (kernels/cpu/gemm.c, gemm.c, x86/)
 * beta is 0 (overwrite C) or 1 (accumulate into C). Leading dimensions in elements. */
/* C[M,N] = beta*C + A[M,K] · B[N,K]^T        (linear forward: out = in · W^T) */
void gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
             float *C, int64_t ldc, float beta);
/* C[M,N] = beta*C + A[M,K] · B[K,N]           (linear backward, input grad: din = dout · W) */
void gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
             float *C, int64_t ldc, float beta);
/* C[M,N] = beta*C + A[K,M]^T · B[K,N]         (linear backward, weight grad: dW = dout^T · in) */
void gemm_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
             float *C, int64_t ldc, float beta);
void gemm_nt_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, float beta);
void gemm_nn_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, float beta);
void gemm_tn_ref(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B, int64_t ldb,
                 float *C, int64_t ldc, float beta);

/* Packing workspace of the fast GEMM, reserved while a model exists (refcounted). Without it the GEMM
 * allocates transient buffers per call. */
void gemm_workspace_reserve(void);
void gemm_workspace_release(void);

/* Mixed precision (ds4_set_matmul_precision(DS4_MATMUL_BF16)): gemm_nt/nn/tn round A and B to bf16
 * (gemm_bf16_round) and accumulate their exact products in fp32 (the engine the dispatch chose: AMX
 * tiles, VDPBF16PS or fp32 FMAs); C stays fp32. The references below round the same way and accumulate
 * in double (cpu/gemm_bf16.c). */
typedef void gemm_signature(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                            int64_t ldb, float *C, int64_t ldc, float beta); /* that of every gemm above */
gemm_signature gemm_nt_bf16_ref, gemm_nn_bf16_ref, gemm_tn_bf16_ref;        /* the layouts of gemm_nt/nn/tn */
/* The operand rounding of the bf16 GEMM, as the CPU's VCVTNE2PS2BF16 does it: round to nearest even,
 * NaN stays a (quiet) NaN, ±Inf stays, fp32 denormals become ±0 (AMX treats bf16 denormals as 0 anyway). */
uint16_t gemm_bf16_bits(float x);
float gemm_bf16_round(float x); /* gemm_bf16_bits widened back to float */

/* Linear layer without bias. out: [N, OC], inp: [N, IC], w: [OC, IC]. */
void linear_fwd(float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC);
/* dinp += dout · w; dw += dout^T · inp. */
void linear_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w, int64_t N,
                int64_t IC, int64_t OC);

/* Grouped (block-diagonal) projection, wo_a (§4.7).
 * z: [N, G, R] = per group g: o[:, g, :] · w[g]^T ; o: [N, G, Din], w: [G, R, Din]. */
void grouped_linear_fwd(float *z, const float *o, const float *w, int64_t N, int64_t G, int64_t R, int64_t Din);
void grouped_linear_bwd(float *do_, float *dw, const float *dz, const float *o, const float *w, int64_t N,
                        int64_t G, int64_t R, int64_t Din);

/* ================================================================ embedding (cpu/embed.c)
 * out: [N, D] = table[ids[n]]; table: [V, D]. */
void embedding_fwd(float *out, const float *table, const int32_t *ids, int64_t N, int64_t D);
void embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int64_t N, int64_t D);

/* ================================================================ RMSNorm (cpu/norm.c), §2
 * y[n] = w ⊙ x[n] · rstd[n], rstd[n] = 1/sqrt(mean(x[n]²) + eps). w == NULL: weightless norm.
 * x, y: [N, D]; rstd: [N] (saved for backward). y may not alias x. */
void rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D, float eps);
void rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x, const float *w, const float *rstd,
                 int64_t N, int64_t D);

/* ================================================================ RoPE (cpu/rope.c), §4.1
 * Interleaved pairs on the trailing rd dims of each head: pair i = (x[hd-rd+2i], x[hd-rd+2i+1])
 * rotated by angle pos·θ_i, θ_i = base^(-2i/rd), with YaRN frequency correction when
 * original_seq_len > 0. */
typedef struct {
    int64_t rd;       /* rope dims (even) */
    int64_t max_pos;  /* table rows */
    float *cos, *sin; /* [max_pos, rd/2] */
} ds4_rope;

/* Builds the table (allocated as DS4_MEM_OTHER). Returns false on allocation failure. */
bool rope_table_init(ds4_rope *r, int64_t rd, int64_t max_pos, double base, double factor,
                     int64_t original_seq_len, double beta_fast, double beta_slow);
void rope_table_free(ds4_rope *r);
/* YaRN-corrected frequencies θ_i, i < rd/2 (exposed for tests). */
void rope_freqs(double *theta, int64_t rd, double base, double factor, int64_t original_seq_len,
                double beta_fast, double beta_slow);

/* In place on x: [N, H, hd]; row n has position (n % period) * mult (tokens: period=T, mult=1;
 * compressed entries of ratio r: period=Nc, mult=r). inverse rotates by -angle. */
void rope_fwd(float *x, int64_t N, int64_t H, int64_t hd, int64_t period, int64_t mult, const ds4_rope *r,
              bool inverse);
/* Backward of rope_fwd(…, inverse) on a gradient, in place: rotation by the opposite angle. */
void rope_bwd(float *dx, int64_t N, int64_t H, int64_t hd, int64_t period, int64_t mult, const ds4_rope *r,
              bool inverse);

/* ================================================================ mHC (cpu/hc.c), §3
 * n = hc_mult streams, M = (2+n)·n mixes. X: [N, n, D] residual streams. */
/* Per token: pre[n], post[n], comb[n,n] from mixes[M] (§3.2, hc_split_sinkhorn). */
void hc_split_sinkhorn_fwd(float *pre, float *post, float *comb, const float *mixes, const float *scale,
                           const float *base, int64_t n, int64_t iters, float eps);
/* Per token: dmixes += …, dscale[3] += …, dbase[M] += … from dpre/dpost/dcomb (any may be NULL = 0). */
void hc_split_sinkhorn_bwd(float *dmixes, float *dscale, float *dbase, const float *dpre, const float *dpost,
                           const float *dcomb, const float *mixes, const float *scale, const float *base,
                           int64_t n, int64_t iters, float eps);

/* y: [N, D] = Σ_j pre[j]·X[j]; post: [N, n]; comb: [N, n, n];
 * saved: mixes [N, M] (= fn·x · rsqrt), rsqrt [N] (over all n·D elements). fn: [M, n·D]. */
void hc_pre_fwd(float *y, float *post, float *comb, float *mixes, float *rsqrt, const float *X, const float *fn,
                const float *scale, const float *base, int64_t N, int64_t n, int64_t D, int64_t iters,
                float hc_eps, float norm_eps);
void hc_pre_bwd(float *dX, float *dfn, float *dscale, float *dbase, const float *dy, const float *dpost,
                const float *dcomb, const float *X, const float *fn, const float *scale, const float *base,
                const float *mixes, const float *rsqrt, int64_t N, int64_t n, int64_t D, int64_t iters,
                float hc_eps, float norm_eps);
/* Y: [N, n, D], Y[k] = post[k]·x + Σ_j comb[j][k]·res[j]; x: [N, D]; res: [N, n, D]. */
void hc_post_fwd(float *Y, const float *x, const float *res, const float *post, const float *comb, int64_t N,
                 int64_t n, int64_t D);
void hc_post_bwd(float *dx, float *dres, float *dpost, float *dcomb, const float *dY, const float *x,
                 const float *res, const float *post, const float *comb, int64_t N, int64_t n, int64_t D);
/* hc_head (§3.4): y: [N, D] = Σ_j pre[j]·X[j], pre = sigmoid(mixes·scale[0] + base) + hc_eps;
 * fn: [n, n·D], base: [n], scale: [1]; saved mixes [N, n], rsqrt [N]. */
void hc_head_fwd(float *y, float *mixes, float *rsqrt, const float *X, const float *fn, const float *scale,
                 const float *base, int64_t N, int64_t n, int64_t D, float hc_eps, float norm_eps);
void hc_head_bwd(float *dX, float *dfn, float *dscale, float *dbase, const float *dy, const float *X,
                 const float *fn, const float *scale, const float *base, const float *mixes, const float *rsqrt,
                 int64_t N, int64_t n, int64_t D, float hc_eps, float norm_eps);

/* ================================================================ compressor pooling (cpu/compressor.c), §4.4
 * a = wkv(x), z = wgate(x): [B, T, C] with C = coff·d, coff = 2 if overlap (ratio 4) else 1.
 * ape: [r, C]. out: [B, Nc, d], Nc = T / r (tail tokens dropped). Per channel softmax over the r
 * (or 2r with overlap: previous block's channels [0,d) then current block's channels [d,2d))
 * slots of z + ape, weights applied to a. */
void compressor_pool_fwd(float *out, const float *a, const float *z, const float *ape, int64_t B, int64_t T,
                         int64_t r, int64_t d, bool overlap);
void compressor_pool_bwd(float *da, float *dz, float *dape, const float *dout, const float *a, const float *z,
                         const float *ape, int64_t B, int64_t T, int64_t r, int64_t d, bool overlap);

/* ================================================================ sparse shared-KV attention (cpu/sparse_attn.c), §4.6, §4.10
 * Keys of query (b, t): the window kv[b, j], max(0, t-window+1) <= j <= t, and compressed entries
 * kvc[b, i]: if ratio == 0 none; else if topk != NULL the ids topk[b, t, 0..K-1] that are >= 0;
 * else every usable entry, (i+1)·ratio <= t+1 (HCA, or dense CSA).
 * s = scale·q·key; p = exp(s - lse); lse = log(Σ_keys exp(s) + exp(sink[h])); o = Σ p·key.
 * q, o: [B, T, H, c]; kv: [B, T, c]; kvc: [B, Nc, c]; topk: [B, T, K]; sink: [H]; lse: [B, T, H].
 * Memory: O(1) per (t, h) besides o and lse: nothing O(T²) or O(T·H·Nc). */
void sparse_attn_fwd(float *o, float *lse, const float *q, const float *kv, const float *kvc, const int32_t *topk,
                     const float *sink, int64_t B, int64_t T, int64_t H, int64_t c, int64_t window,
                     int64_t ratio, int64_t Nc, int64_t K, float scale);
/* Recomputes p from lse. dq, dkv, dkvc, dsink accumulate. */
void sparse_attn_bwd(float *dq, float *dkv, float *dkvc, float *dsink, const float *dout, const float *o,
                     const float *lse, const float *q, const float *kv, const float *kvc, const int32_t *topk,
                     const float *sink, int64_t B, int64_t T, int64_t H, int64_t c, int64_t window,
                     int64_t ratio, int64_t Nc, int64_t K, float scale);

/* ================================================================ lightning indexer (cpu/indexer.c), §4.5, §6.3
 * I[b,t,s] = Σ_h wscale·w[b,t,h]·ReLU(qi[b,t,h]·ki[b,s]) for usable s ((s+1)·ratio <= t+1).
 * qi: [B, T, HI, dI]; ki: [B, Nc, dI]; w: [B, T, HI] (raw weights_proj output).
 * topk: [B, T, K] = the K usable entries with the highest I (ties to the lower index), written in
 * ascending index order, −1 padded when fewer than K are usable. O(Nc) workspace per thread. */
void indexer_topk_fwd(int32_t *topk, const float *qi, const float *ki, const float *w, int64_t B, int64_t T,
                      int64_t HI, int64_t dI, int64_t Nc, int64_t ratio, int64_t K, float wscale);

/* Indexer KL loss and its gradient (docs/contract.md "indexer_loss"), computed from the main
 * attention's saved lse. For each row (b, t) with >= 1 usable entry, over the set S = topk row
 * (or all usable entries if topk == NULL):
 *   teacher p[s] ∝ Σ_h exp(scale·q[b,t,h]·kvc[b,s] − lse[b,t,h]), L1-normalised over S;
 *   student = softmax over S of I[b,t,s];  kl = Σ_s p (log p − log student), p = 0 terms 0.
 * *kl_sum = Σ over rows of kl (double); *n_rows = number of rows counted.
 * Gradients (may be NULL: loss only) accumulate grad_scale·∂kl_sum/∂· into dqi, dki, dw.
 * q: [B, T, H, c] main queries; kvc: [B, Nc, c] main compressed entries; lse: [B, T, H]. */
void indexer_kl_fwd_bwd(double *kl_sum, int64_t *n_rows, float *dqi, float *dki, float *dw, const float *qi,
                        const float *ki, const float *w, const int32_t *topk, const float *q, const float *kvc,
                        const float *lse, int64_t B, int64_t T, int64_t H, int64_t c, int64_t HI, int64_t dI,
                        int64_t Nc, int64_t ratio, int64_t K, float scale, float wscale, float grad_scale);

/* ================================================================ MoE (cpu/moe.c), §5
 * logits: [N, E] gate scores before the affinity; scores: [N, E] = sqrt(softplus(logits)) (saved).
 * Selection: tid2eid[ids[n]] (hash layers, tid2eid: [V, K]) or top-K of scores + bias
 * (bias may be NULL; ties to the lower expert id). idx: [N, K] ascending order not required, but
 * deterministic; weights: [N, K] = scores[idx] / Σ_k scores[idx] · route_scale. */
void moe_gate_fwd(int32_t *idx, float *weights, float *scores, const float *logits, const float *bias,
                  const int64_t *tid2eid, const int32_t *ids, int64_t N, int64_t E, int64_t K, float route_scale);
/* dlogits += ∂weights/∂logits · dweights (only selected experts get gradient). */
void moe_gate_bwd(float *dlogits, const float *dweights, const float *logits, const float *scores,
                  const int32_t *idx, int64_t N, int64_t E, int64_t K, float route_scale);
/* act[n, i] = silu(min(g, limit)) · clamp(u, −limit, limit); limit <= 0: no clamp.
 * g, u, act: [N, I]. Clamped elements (g > limit; |u| > limit) pass no gradient. */
void swiglu_fwd(float *act, const float *g, const float *u, int64_t N, int64_t I, float limit);
void swiglu_bwd(float *dg, float *du, const float *dact, const float *g, const float *u, int64_t N, int64_t I,
                float limit);

/* ================================================================ loss (cpu/loss.c)
 * Cross-entropy over logits [N, V] with targets [N] (−1 = row not scored).
 * *loss_sum = Σ over scored rows of −log softmax(logits)[target] (double); *n_scored rows.
 * dlogits (may be NULL) is OVERWRITTEN: grad_scale·(softmax − onehot) on scored rows, 0 elsewhere. */
void cross_entropy_fwd_bwd(double *loss_sum, int64_t *n_scored, float *dlogits, const float *logits,
                           const int32_t *targets, int64_t N, int64_t V, float grad_scale);

#endif
