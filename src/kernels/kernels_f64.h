/* Float64 twins of the cpu backend's kernels, for finite-difference tests. Each op's code is written
 * once in a cpu/<op>.inc template and compiled twice: in float as the cpu backend's entry points
 * (cpu_<op>, cpu/cpu.h) and in double under the kernels.h name + `_f64` (every float becomes double;
 * int pointers and the `dims` structs stay). A descriptor `<op>_args` / `<op>_grads` has a double
 * twin `<op>_args_f64` / `<op>_grads_f64` with the same fields. Same semantics as kernels.h. Each op
 * family keeps its own section below. */
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
void rope_fwd_f64(double *x, const rope_args *a);
void rope_bwd_f64(double *dx, const rope_args *a);
typedef struct {
    moe_gate_dims dims;
    double route_scale;
    const double *logits, *bias;
    const int64_t *tid2eid;
    const int32_t *ids;
    int32_t *idx;
    double *weights, *scores;
} moe_gate_args_f64;
typedef struct {
    const double *dweights;
    double *dlogits;
} moe_gate_grads_f64;
void moe_gate_fwd_f64(const moe_gate_args_f64 *a);
void moe_gate_bwd_f64(const moe_gate_args_f64 *a, const moe_gate_grads_f64 *g);
void swiglu_fwd_f64(double *act, const double *g, const double *u, int64_t N, int64_t I, double limit);
void swiglu_bwd_f64(double *dg, double *du, const double *dact, const double *g, const double *u, int64_t N,
                    int64_t I, double limit);
void cross_entropy_fwd_bwd_f64(double *loss_sum, int64_t *n_scored, double *dlogits, const double *logits,
                               const int32_t *targets, int64_t N, int64_t V, double grad_scale);

/* ---- end gemm, linear, embedding, norm, rope, moe gate, swiglu, loss ---- */

/* ---- hc (mHC), cpu/hc.c ---- */
typedef struct {
    int64_t n, iters;
    double eps;
    const double *mixes, *scale, *base;
    double *pre, *post, *comb;
} hc_sinkhorn_args_f64;
typedef struct {
    const double *dpre, *dpost, *dcomb;
    double *dmixes, *dscale, *dbase;
} hc_sinkhorn_grads_f64;
typedef struct {
    hc_dims dims;
    double hc_eps, norm_eps;
    const double *X, *fn, *scale, *base;
    double *y, *post, *comb, *mixes, *rsqrt;
} hc_pre_args_f64;
typedef struct {
    const double *dy, *dpost, *dcomb;
    double *dX, *dfn, *dscale, *dbase;
} hc_pre_grads_f64;
typedef struct {
    hc_dims dims;
    const double *x, *res, *post, *comb;
    double *Y;
} hc_post_args_f64;
typedef struct {
    const double *dY;
    double *dx, *dres, *dpost, *dcomb;
} hc_post_grads_f64;
typedef struct {
    hc_dims dims;
    double hc_eps, norm_eps;
    const double *X, *fn, *scale, *base;
    double *y, *mixes, *rsqrt;
} hc_head_args_f64;
typedef struct {
    const double *dy;
    double *dX, *dfn, *dscale, *dbase;
} hc_head_grads_f64;
void hc_split_sinkhorn_fwd_f64(const hc_sinkhorn_args_f64 *a);
void hc_split_sinkhorn_bwd_f64(const hc_sinkhorn_args_f64 *a, const hc_sinkhorn_grads_f64 *g);
void hc_pre_fwd_f64(const hc_pre_args_f64 *a);
void hc_pre_bwd_f64(const hc_pre_args_f64 *a, const hc_pre_grads_f64 *g);
void hc_post_fwd_f64(const hc_post_args_f64 *a);
void hc_post_bwd_f64(const hc_post_args_f64 *a, const hc_post_grads_f64 *g);
void hc_head_fwd_f64(const hc_head_args_f64 *a);
void hc_head_bwd_f64(const hc_head_args_f64 *a, const hc_head_grads_f64 *g);

/* ---- compressor pooling, cpu/compressor.c ---- */
typedef struct {
    compressor_dims dims;
    const double *a, *z, *ape;
    double *out;
} compressor_pool_args_f64;
typedef struct {
    const double *dout;
    double *da, *dz, *dape;
} compressor_pool_grads_f64;
void compressor_pool_fwd_f64(const compressor_pool_args_f64 *a);
void compressor_pool_bwd_f64(const compressor_pool_args_f64 *a, const compressor_pool_grads_f64 *g);
/* ---- end hc (mHC), compressor pooling ---- */

/* ---- sparse attention, indexer (cpu/sparse_attn.c, cpu/indexer.c) ---- */
typedef struct {
    sparse_attn_dims dims;
    double scale;
    const double *q, *kv, *kvc, *sink;
    const int32_t *topk;
    double *o, *lse;
} sparse_attn_args_f64;
typedef struct {
    const double *dout;
    double *dq, *dkv, *dkvc, *dsink;
} sparse_attn_grads_f64;
typedef struct {
    indexer_dims dims;
    int64_t t0;
    double wscale;
    const double *qi, *ki, *w;
    int32_t *topk;
} indexer_topk_args_f64;
typedef struct {
    indexer_dims dims;
    int64_t H, c;
    double scale, wscale, grad_scale;
    const double *qi, *ki, *w, *q, *kvc, *lse;
    const int32_t *topk;
    double *dqi, *dki, *dw;
    double *kl_sum;
    int64_t *n_rows;
} indexer_kl_args_f64;
void sparse_attn_fwd_f64(const sparse_attn_args_f64 *a);
void sparse_attn_bwd_f64(const sparse_attn_args_f64 *a, const sparse_attn_grads_f64 *g);
void indexer_topk_fwd_f64(const indexer_topk_args_f64 *a);
void indexer_kl_fwd_bwd_f64(const indexer_kl_args_f64 *a);
/* ---- end sparse attention, indexer ---- */

#endif
