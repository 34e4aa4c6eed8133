/* Float64 twins of the reference kernels, for finite-difference tests. Each op's reference code is
 * written once in a cpu/<op>.inc template and compiled twice: in float under the names of kernels.h
 * and in double under the same name + `_f64` (every float parameter becomes double; int pointers
 * stay). Same semantics as kernels.h. Each op family keeps its own section below. */
#ifndef DS4_KERNELS_F64_H
#define DS4_KERNELS_F64_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "kernels/kernels.h"

/* ---- gemm, linear, embedding, norm, rope, moe gate, swiglu, loss ---- */
void gemm_nt_ref_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda, const double *B,
                     int64_t ldb, double *C, int64_t ldc, double beta);
void gemm_nn_ref_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda, const double *B,
                     int64_t ldb, double *C, int64_t ldc, double beta);
void gemm_tn_ref_f64(int64_t M, int64_t N, int64_t K, const double *A, int64_t lda, const double *B,
                     int64_t ldb, double *C, int64_t ldc, double beta);
void linear_fwd_f64(double *out, const double *inp, const double *w, int64_t N, int64_t IC, int64_t OC);
void linear_bwd_f64(double *dinp, double *dw, const double *dout, const double *inp, const double *w, int64_t N,
                    int64_t IC, int64_t OC);
void grouped_linear_fwd_f64(double *z, const double *o, const double *w, int64_t N, int64_t G, int64_t R,
                            int64_t Din);
void grouped_linear_bwd_f64(double *do_, double *dw, const double *dz, const double *o, const double *w,
                            int64_t N, int64_t G, int64_t R, int64_t Din);
void embedding_fwd_f64(double *out, const double *table, const int32_t *ids, int64_t N, int64_t D);
void embedding_bwd_f64(double *dtable, const double *dout, const int32_t *ids, int64_t N, int64_t D);
void rmsnorm_fwd_f64(double *y, double *rstd, const double *x, const double *w, int64_t N, int64_t D,
                     double eps);
void rmsnorm_bwd_f64(double *dx, double *dw, const double *dy, const double *x, const double *w,
                     const double *rstd, int64_t N, int64_t D);
/* The rope table stays float (ds4_rope); the double rotation reads it widened. */
void rope_fwd_f64(double *x, int64_t N, int64_t H, int64_t hd, int64_t period, int64_t mult, const ds4_rope *r,
                  bool inverse);
void rope_bwd_f64(double *dx, int64_t N, int64_t H, int64_t hd, int64_t period, int64_t mult, const ds4_rope *r,
                  bool inverse);
void moe_gate_fwd_f64(int32_t *idx, double *weights, double *scores, const double *logits, const double *bias,
                      const int64_t *tid2eid, const int32_t *ids, int64_t N, int64_t E, int64_t K,
                      double route_scale);
void moe_gate_bwd_f64(double *dlogits, const double *dweights, const double *logits, const double *scores,
                      const int32_t *idx, int64_t N, int64_t E, int64_t K, double route_scale);
void swiglu_fwd_f64(double *act, const double *g, const double *u, int64_t N, int64_t I, double limit);
void swiglu_bwd_f64(double *dg, double *du, const double *dact, const double *g, const double *u, int64_t N,
                    int64_t I, double limit);
void cross_entropy_fwd_bwd_f64(double *loss_sum, int64_t *n_scored, double *dlogits, const double *logits,
                               const int32_t *targets, int64_t N, int64_t V, double grad_scale);

/* ---- end gemm, linear, embedding, norm, rope, moe gate, swiglu, loss ---- */

/* ---- hc (mHC), cpu/hc.c ---- */
void hc_split_sinkhorn_fwd_f64(double *pre, double *post, double *comb, const double *mixes, const double *scale,
                               const double *base, int64_t n, int64_t iters, double eps);
void hc_split_sinkhorn_bwd_f64(double *dmixes, double *dscale, double *dbase, const double *dpre,
                               const double *dpost, const double *dcomb, const double *mixes, const double *scale,
                               const double *base, int64_t n, int64_t iters, double eps);
void hc_pre_fwd_f64(double *y, double *post, double *comb, double *mixes, double *rsqrt, const double *X,
                    const double *fn, const double *scale, const double *base, int64_t N, int64_t n, int64_t D,
                    int64_t iters, double hc_eps, double norm_eps);
void hc_pre_bwd_f64(double *dX, double *dfn, double *dscale, double *dbase, const double *dy, const double *dpost,
                    const double *dcomb, const double *X, const double *fn, const double *scale,
                    const double *base, const double *mixes, const double *rsqrt, int64_t N, int64_t n, int64_t D,
                    int64_t iters, double hc_eps, double norm_eps);
void hc_post_fwd_f64(double *Y, const double *x, const double *res, const double *post, const double *comb,
                     int64_t N, int64_t n, int64_t D);
void hc_post_bwd_f64(double *dx, double *dres, double *dpost, double *dcomb, const double *dY, const double *x,
                     const double *res, const double *post, const double *comb, int64_t N, int64_t n, int64_t D);
void hc_head_fwd_f64(double *y, double *mixes, double *rsqrt, const double *X, const double *fn,
                     const double *scale, const double *base, int64_t N, int64_t n, int64_t D, double hc_eps,
                     double norm_eps);
void hc_head_bwd_f64(double *dX, double *dfn, double *dscale, double *dbase, const double *dy, const double *X,
                     const double *fn, const double *scale, const double *base, const double *mixes,
                     const double *rsqrt, int64_t N, int64_t n, int64_t D, double hc_eps, double norm_eps);

/* ---- compressor pooling, cpu/compressor.c ---- */
void compressor_pool_fwd_f64(double *out, const double *a, const double *z, const double *ape, int64_t B,
                             int64_t T, int64_t r, int64_t d, bool overlap);
void compressor_pool_bwd_f64(double *da, double *dz, double *dape, const double *dout, const double *a,
                             const double *z, const double *ape, int64_t B, int64_t T, int64_t r, int64_t d,
                             bool overlap);
/* ---- end hc (mHC), compressor pooling ---- */

/* ---- sparse attention, indexer (cpu/sparse_attn.c, cpu/indexer.c) ---- */
void sparse_attn_fwd_f64(double *o, double *lse, const double *q, const double *kv, const double *kvc,
                         const int32_t *topk, const double *sink, int64_t B, int64_t T, int64_t H, int64_t c,
                         int64_t window, int64_t ratio, int64_t Nc, int64_t K, double scale);
void sparse_attn_bwd_f64(double *dq, double *dkv, double *dkvc, double *dsink, const double *dout,
                         const double *o, const double *lse, const double *q, const double *kv, const double *kvc,
                         const int32_t *topk, const double *sink, int64_t B, int64_t T, int64_t H, int64_t c,
                         int64_t window, int64_t ratio, int64_t Nc, int64_t K, double scale);
void indexer_topk_fwd_f64(int32_t *topk, const double *qi, const double *ki, const double *w, int64_t B,
                          int64_t T, int64_t HI, int64_t dI, int64_t Nc, int64_t ratio, int64_t K, double wscale);
void indexer_kl_fwd_bwd_f64(double *kl_sum, int64_t *n_rows, double *dqi, double *dki, double *dw,
                            const double *qi, const double *ki, const double *w, const int32_t *topk,
                            const double *q, const double *kvc, const double *lse, int64_t B, int64_t T, int64_t H,
                            int64_t c, int64_t HI, int64_t dI, int64_t Nc, int64_t ratio, int64_t K, double scale,
                            double wscale, double grad_scale);
/* ---- end sparse attention, indexer ---- */

#endif
