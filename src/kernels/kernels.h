/* ds4 kernels: one forward and one backward function per op, float32 tensors, row-major. The math of
 * each op is in docs/dsv4-architecture.md (section given).
 *
 * Conventions (every op follows them):
 *  - Forward functions overwrite their outputs.
 *  - Backward functions ACCUMULATE (+=) into every gradient output; callers zero gradients once.
 *    A NULL gradient pointer means "not needed" and skips that work.
 *  - Deterministic for any thread count: the same inputs give the same bits on 1 thread or N. No
 *    float atomics; a sum over work shared among threads runs over a fixed partition (chunks, column
 *    blocks or query blocks whose size does not depend on the thread count), its parts combined in
 *    partition order; the thread count may only set how many parts are in flight (tests/test_threads.c).
 *  - Ops with a few operands take plain pointers plus explicit sizes. Ops with many take a
 *    descriptor: `<op>_args` holds the sizes (a `dims` struct), the scalars and the forward's tensors
 *    in named fields; a backward takes the same descriptor (its outputs are then read) plus
 *    `<op>_grads` (the incoming gradient and the gradient outputs).
 *  - Every function here calls through the kernel backend table (backend.h): the cpu backend
 *    (cpu/, x86/) computes; in a plan (memplan) the plan backend touches no data and only
 *    counts the workspace the cpu backend would allocate. README.md in this folder says how a backend
 *    (CUDA) slots in.
 */
#ifndef DS4_KERNELS_H
#define DS4_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "ds4/core.h"
#include "ds4/kernels.h"
#include "kernels/backend.h"

/* ================================================================ gemm (gemm.c, cpu/gemm.c, x86/)
 * beta is 0 (overwrite C) or 1 (accumulate into C). Leading dimensions in elements.
 * Precision: ds4_set_matmul_precision (fp32 or bf16 operands, fp32 accumulation). */
/* C[M,N] = beta*C + A[M,K] · B[N,K]^T        (linear forward: out = in · W^T) */
static inline void gemm_nt(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, float beta) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->gemm_nt) k->gemm_nt(M, N, K, A, lda, B, ldb, C, ldc, beta);
}
/* C[M,N] = beta*C + A[M,K] · B[K,N]           (linear backward, input grad: din = dout · W) */
static inline void gemm_nn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, float beta) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->gemm_nn) k->gemm_nn(M, N, K, A, lda, B, ldb, C, ldc, beta);
}
/* C[M,N] = beta*C + A[K,M]^T · B[K,N]         (linear backward, weight grad: dW = dout^T · in) */
static inline void gemm_tn(int64_t M, int64_t N, int64_t K, const float *A, int64_t lda, const float *B,
                           int64_t ldb, float *C, int64_t ldc, float beta) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->gemm_tn) k->gemm_tn(M, N, K, A, lda, B, ldb, C, ldc, beta);
}

/* Packing workspace of the GEMM, reserved while a model exists (refcounted). Without it the GEMM
 * allocates transient buffers per call. */
static inline void gemm_workspace_reserve(void) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->gemm_workspace_reserve) k->gemm_workspace_reserve();
}
static inline void gemm_workspace_release(void) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->gemm_workspace_release) k->gemm_workspace_release();
}

/* The operand rounding of the bf16 GEMM, as the CPU's VCVTNE2PS2BF16 does it: round to nearest even,
 * NaN stays a (quiet) NaN, ±Inf stays, fp32 denormals become ±0 (AMX treats bf16 denormals as 0 anyway). */
uint16_t gemm_bf16_bits(float x);
float gemm_bf16_round(float x); /* gemm_bf16_bits widened back to float */
/* The same rounding on an fp32 bit pattern u, giving the fp32 bits of the result (low 16 bits zero).
 * Branch-free, so the loops that round whole arrays (GEMM panels, bf16 activations) vectorize. */
static inline uint32_t bf16_round_u32(uint32_t u) {
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u; /* nearest even; ±Inf stays */
    const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
    return (u & 0x7f800000u) == 0 ? u & 0x80000000u : r; /* ±0 and denormals: a zero of the same sign */
}
/* x [n] in place: each value gemm_bf16_round(x). */
static inline void bf16_round_array(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) { /* memcpy: the bit cast without breaking aliasing rules (compiles to moves) */
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        u = bf16_round_u32(u);
        memcpy(x + i, &u, sizeof u);
    }
}

/* The float whose bits are bf16 bits h followed by 16 zero bits (exact: how every bf16 buffer is read). */
static inline float bf16_widen(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

/* Linear layer without bias. out: [N, OC], inp: [N, IC], w: [OC, IC]. */
static inline void linear_fwd(float *out, const float *inp, const float *w, int64_t N, int64_t IC, int64_t OC) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->linear_fwd) k->linear_fwd(out, inp, w, N, IC, OC);
}
/* dinp += dout · w; dw += dout^T · inp. */
static inline void linear_bwd(float *dinp, float *dw, const float *dout, const float *inp, const float *w,
                              int64_t N, int64_t IC, int64_t OC) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->linear_bwd) k->linear_bwd(dinp, dw, dout, inp, w, N, IC, OC);
}

/* Grouped (block-diagonal) projection, wo_a (§4.7).
 * z: [N, G, R] = per group g: o[:, g, :] · w[g]^T ; o: [N, G, Din], w: [G, R, Din]. */
static inline void grouped_linear_fwd(float *z, const float *o, const float *w, int64_t N, int64_t G, int64_t R,
                                      int64_t Din) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->grouped_linear_fwd) k->grouped_linear_fwd(z, o, w, N, G, R, Din);
}
static inline void grouped_linear_bwd(float *do_, float *dw, const float *dz, const float *o, const float *w,
                                      int64_t N, int64_t G, int64_t R, int64_t Din) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->grouped_linear_bwd) k->grouped_linear_bwd(do_, dw, dz, o, w, N, G, R, Din);
}

/* The same layers on a weight's bf16 compute copy w (uint16 bits, the weight's gemm_bf16_bits): bf16
 * GEMMs (whatever the matmul precision) that give the bits linear_fwd / linear_bwd / grouped_linear_*
 * give in bf16 precision on the fp32 weight, without rounding the weight per call (mixed precision:
 * docs/mixed-precision.md). The weight gradient dw is the same fp32 GEMM as theirs. */
static inline void linear_fwd_bf16w(float *out, const float *inp, const uint16_t *w, int64_t N, int64_t IC,
                                    int64_t OC) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->linear_fwd_bf16w) k->linear_fwd_bf16w(out, inp, w, N, IC, OC);
}
static inline void linear_bwd_bf16w(float *dinp, float *dw, const float *dout, const float *inp, const uint16_t *w,
                                    int64_t N, int64_t IC, int64_t OC) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->linear_bwd_bf16w) k->linear_bwd_bf16w(dinp, dw, dout, inp, w, N, IC, OC);
}
static inline void grouped_linear_fwd_bf16w(float *z, const float *o, const uint16_t *w, int64_t N, int64_t G,
                                            int64_t R, int64_t Din) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->grouped_linear_fwd_bf16w) k->grouped_linear_fwd_bf16w(z, o, w, N, G, R, Din);
}
static inline void grouped_linear_bwd_bf16w(float *do_, float *dw, const float *dz, const float *o,
                                            const uint16_t *w, int64_t N, int64_t G, int64_t R, int64_t Din) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->grouped_linear_bwd_bf16w) k->grouped_linear_bwd_bf16w(do_, dw, dz, o, w, N, G, R, Din);
}

/* ================================================================ embedding (cpu/embed.c)
 * out: [N, D] = table[ids[n]]; table: [V, D]. */
static inline void embedding_fwd(float *out, const float *table, const int32_t *ids, int64_t N, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->embedding_fwd) k->embedding_fwd(out, table, ids, N, D);
}
static inline void embedding_bwd(float *dtable, const float *dout, const int32_t *ids, int64_t N, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->embedding_bwd) k->embedding_bwd(dtable, dout, ids, N, D);
}

/* ================================================================ RMSNorm (cpu/norm.c), §2
 * y[n] = w ⊙ x[n] · rstd[n], rstd[n] = 1/sqrt(mean(x[n]²) + eps). w == NULL: weightless norm.
 * x, y: [N, D]; rstd: [N] (saved for backward). y may not alias x. */
static inline void rmsnorm_fwd(float *y, float *rstd, const float *x, const float *w, int64_t N, int64_t D,
                               float eps) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rmsnorm_fwd) k->rmsnorm_fwd(y, rstd, x, w, N, D, eps);
}
static inline void rmsnorm_bwd(float *dx, float *dw, const float *dy, const float *x, const float *w,
                               const float *rstd, int64_t N, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rmsnorm_bwd) k->rmsnorm_bwd(dx, dw, dy, x, w, rstd, N, D);
}

/* ================================================================ RoPE (cpu/rope.c), §4.1
 * Interleaved pairs on the trailing rd dims of each head: pair i = (x[hd-rd+2i], x[hd-rd+2i+1])
 * rotated by angle pos·θ_i, θ_i = base^(-2i/rd), with YaRN frequency correction when
 * original_seq_len > 0. */
typedef struct ds4_rope {
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

/* x: [N, H, hd] rotated in place; row n has position (n % period) * mult (tokens: period=T, mult=1;
 * compressed entries of ratio r: period=Nc, mult=r). inverse rotates by -angle. Needs period >= 1,
 * (period − 1)·mult < table->max_pos and table->rd <= hd. */
struct rope_args {
    int64_t N, H, hd, period, mult;
    const ds4_rope *table;
    bool inverse;
};
static inline void rope_fwd(float *x, const rope_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rope_fwd) k->rope_fwd(x, a);
}
/* Backward of rope_fwd(…, a) on a gradient dx [N, H, hd], in place: rotation by the opposite angle. */
static inline void rope_bwd(float *dx, const rope_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rope_bwd) k->rope_bwd(dx, a);
}

/* ================================================================ mHC (cpu/hc.c), §3
 * n = hc_mult streams, M = (2+n)·n mixes. X: [N, n, D] residual streams. */
typedef struct {
    int64_t N, n, D; /* tokens, streams, model dim */
    int64_t iters;   /* Sinkhorn iterations (hc_pre only) */
} hc_dims;

/* One token (§3.2, hc_split_sinkhorn): pre[n], post[n], comb[n,n] from mixes[M], scale[3], base[M]. */
struct hc_sinkhorn_args {
    int64_t n, iters;
    float eps;
    const float *mixes, *scale, *base;
    float *pre, *post, *comb;
};
/* dmixes[M], dscale[3], dbase[M] += … from dpre/dpost/dcomb (any may be NULL = 0). */
struct hc_sinkhorn_grads {
    const float *dpre, *dpost, *dcomb;
    float *dmixes, *dscale, *dbase;
};
static inline void hc_split_sinkhorn_fwd(const hc_sinkhorn_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_split_sinkhorn_fwd) k->hc_split_sinkhorn_fwd(a);
}
static inline void hc_split_sinkhorn_bwd(const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_split_sinkhorn_bwd) k->hc_split_sinkhorn_bwd(a, g);
}

/* y: [N, D] = Σ_j pre[j]·X[j]; post: [N, n]; comb: [N, n, n]; fn: [M, n·D], scale: [3], base: [M];
 * saved: mixes [N, M] (= fn·x · rsqrt), rsqrt [N] (over all n·D elements). The backward reads X, fn,
 * scale, base, mixes and rsqrt. */
struct hc_pre_args {
    hc_dims dims;
    float hc_eps, norm_eps;
    const float *X, *fn, *scale, *base;
    float *y, *post, *comb, *mixes, *rsqrt;
};
/* dy: [N, D], dpost: [N, n], dcomb: [N, n, n] (NULL = 0); dX, dfn, dscale, dbase accumulate. */
struct hc_pre_grads {
    const float *dy, *dpost, *dcomb;
    float *dX, *dfn, *dscale, *dbase;
};
static inline void hc_pre_fwd(const hc_pre_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_pre_fwd) k->hc_pre_fwd(a);
}
static inline void hc_pre_bwd(const hc_pre_args *a, const hc_pre_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_pre_bwd) k->hc_pre_bwd(a, g);
}

/* Y: [N, n, D], Y[k] = post[k]·x + Σ_j comb[j][k]·res[j]; x: [N, D]; res: [N, n, D]; post: [N, n];
 * comb: [N, n, n] (dims.iters unused). */
struct hc_post_args {
    hc_dims dims;
    const float *x, *res, *post, *comb;
    float *Y;
};
struct hc_post_grads {
    const float *dY;
    float *dx, *dres, *dpost, *dcomb;
};
static inline void hc_post_fwd(const hc_post_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_post_fwd) k->hc_post_fwd(a);
}
static inline void hc_post_bwd(const hc_post_args *a, const hc_post_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_post_bwd) k->hc_post_bwd(a, g);
}

/* hc_head (§3.4): y: [N, D] = Σ_j pre[j]·X[j], pre = sigmoid(mixes·scale[0] + base) + hc_eps;
 * fn: [n, n·D], base: [n], scale: [1]; saved mixes [N, n], rsqrt [N] (dims.iters unused). */
struct hc_head_args {
    hc_dims dims;
    float hc_eps, norm_eps;
    const float *X, *fn, *scale, *base;
    float *y, *mixes, *rsqrt;
};
struct hc_head_grads {
    const float *dy;
    float *dX, *dfn, *dscale, *dbase;
};
static inline void hc_head_fwd(const hc_head_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_head_fwd) k->hc_head_fwd(a);
}
static inline void hc_head_bwd(const hc_head_args *a, const hc_head_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->hc_head_bwd) k->hc_head_bwd(a, g);
}

/* ================================================================ compressor pooling (cpu/compressor.c), §4.4
 * a = wkv(x), z = wgate(x): [B, T, C] with C = coff·d, coff = 2 if overlap (ratio 4) else 1.
 * ape: [r, C]. out: [B, Nc, d], Nc = T / r (tail tokens dropped). Per channel softmax over the r
 * (or 2r with overlap: previous block's channels [0,d) then current block's channels [d,2d))
 * slots of z + ape, weights applied to a. */
typedef struct {
    int64_t B, T, r, d;
    bool overlap;
} compressor_dims;
struct compressor_pool_args {
    compressor_dims dims;
    const float *a, *z, *ape;
    float *out;
};
struct compressor_pool_grads {
    const float *dout;
    float *da, *dz, *dape;
};
static inline void compressor_pool_fwd(const compressor_pool_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->compressor_pool_fwd) k->compressor_pool_fwd(a);
}
static inline void compressor_pool_bwd(const compressor_pool_args *a, const compressor_pool_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->compressor_pool_bwd) k->compressor_pool_bwd(a, g);
}

/* ================================================================ sparse shared-KV attention (cpu/sparse_attn.c), §4.6, §4.10
 * Keys of query (b, t): the window kv[b, j], max(0, t-window+1) <= j <= t, and compressed entries
 * kvc[b, i]: if ratio == 0 none; else if topk != NULL the ids topk[b, t, 0..K-1] that are >= 0;
 * else every usable entry, (i+1)·ratio <= t+1 (HCA, or dense CSA).
 * s = scale·q·key; p = exp(s - lse); lse = log(Σ_keys exp(s) + exp(sink[h])); o = Σ p·key.
 * q, o: [B, T, H, c]; kv: [B, T, c]; kvc: [B, Nc, c]; topk: [B, T, K]; sink: [H]; lse: [B, T, H].
 * Mixed precision passes the keys as bf16 bits instead, kv16 / kvc16 (then kv and kvc are not read): the
 * kernels widen them where they load them and accumulate in fp32 as for fp32 keys, so bf16 keys give
 * the bits of fp32 keys holding the same (rounded) values. Gradients stay fp32.
 * Memory: O(1) per (t, h) besides o and lse: nothing O(T²) or O(T·H·Nc). */
typedef struct {
    int64_t B, T, H, c;             /* batch, tokens, heads, head dim */
    int64_t window, ratio, Nc, K;   /* window keys, compression ratio, compressed entries, top-k */
} sparse_attn_dims;
struct sparse_attn_args {
    sparse_attn_dims dims;
    float scale;
    const float *q, *kv, *kvc, *sink;
    const uint16_t *kv16, *kvc16; /* bf16 keys (either set: both read as bf16), or NULL */
    const int32_t *topk;
    float *o, *lse; /* written by the forward, read by the backward */
};
/* Recomputes p from lse. dq, dkv, dkvc, dsink accumulate. dout: [B, T, H, c]. */
struct sparse_attn_grads {
    const float *dout;
    float *dq, *dkv, *dkvc, *dsink;
};
static inline void sparse_attn_fwd(const sparse_attn_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->sparse_attn_fwd) k->sparse_attn_fwd(a);
}
static inline void sparse_attn_bwd(const sparse_attn_args *a, const sparse_attn_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->sparse_attn_bwd) k->sparse_attn_bwd(a, g);
}

/* ================================================================ lightning indexer (cpu/indexer.c), §4.5, §6.3
 * I[b,t,s] = Σ_h wscale·w[b,t,h]·ReLU(qi[b,t,h]·ki[b,s]) for usable s ((s+1)·ratio <= t+1).
 * qi: [B, T, HI, dI]; ki: [B, Nc, dI]; w: [B, T, HI] (raw weights_proj output).
 * Mixed precision passes the keys (ki, and the KL's kvc) as bf16 bits instead, ki16 / kvc16, widened
 * where they are loaded: the bits of fp32 keys holding the same values. Gradients stay fp32. */
typedef struct {
    int64_t B, T, HI, dI;   /* batch, tokens, indexer heads, indexer head dim */
    int64_t Nc, ratio, K;   /* compressed entries, compression ratio, top-k */
} indexer_dims;
/* topk: [B, T, K] = the K usable entries with the highest I (ties to the lower index), written in
 * ascending index order, −1 padded when fewer than K are usable. O(Nc) workspace per thread. */
struct indexer_topk_args {
    indexer_dims dims;
    float wscale;
    const float *qi, *ki, *w;
    const uint16_t *ki16; /* bf16 keys read instead of ki, or NULL */
    int32_t *topk;
};
static inline void indexer_topk_fwd(const indexer_topk_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->indexer_topk_fwd) k->indexer_topk_fwd(a);
}

/* Indexer KL loss and its gradient (docs/contract.md "indexer_loss"), computed from the main
 * attention's saved lse. For each row (b, t) with >= 1 usable entry, over the set S = topk row
 * (or all usable entries if topk == NULL):
 *   teacher p[s] ∝ Σ_h exp(scale·q[b,t,h]·kvc[b,s] − lse[b,t,h]), L1-normalised over S;
 *   student = softmax over S of I[b,t,s];  kl = Σ_s p (log p − log student), p = 0 terms 0.
 * *kl_sum = Σ over rows of kl (double); *n_rows = number of rows counted.
 * Gradients (may be NULL: loss only) accumulate grad_scale·∂kl_sum/∂· into dqi, dki, dw.
 * q: [B, T, H, c] main queries; kvc: [B, Nc, c] main compressed entries; lse: [B, T, H]. */
struct indexer_kl_args {
    indexer_dims dims;
    int64_t H, c; /* main attention heads, head dim */
    float scale, wscale, grad_scale;
    const float *qi, *ki, *w, *q, *kvc, *lse;
    const uint16_t *ki16, *kvc16; /* bf16 keys read instead of ki and kvc (both or neither), or NULL */
    const int32_t *topk;
    float *dqi, *dki, *dw;
    double *kl_sum;
    int64_t *n_rows;
};
/* The rows indexer_kl_fwd_bwd scores over [B, T] at ratio r: every row that sees a compressed entry,
 * B·(T − r + 1). A plan scores none (0), as its KL writes 0 rows. */
static inline int64_t indexer_kl_rows(int64_t B, int64_t T, int64_t ratio) {
    const ds4_kernel_backend *k = ds4_kernels();
    return k->indexer_kl_rows ? k->indexer_kl_rows(B, T, ratio) : 0;
}
static inline void indexer_kl_fwd_bwd(const indexer_kl_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->indexer_kl_fwd_bwd) k->indexer_kl_fwd_bwd(a);
}

/* ================================================================ MoE (cpu/moe.c), §5
 * logits: [N, E] gate scores before the affinity; scores: [N, E] = sqrt(softplus(logits)) (saved).
 * Selection: tid2eid[ids[n]] (hash layers, tid2eid: [V, K]) or top-K of scores + bias
 * (bias may be NULL; ties to the lower expert id). idx: [N, K] ascending order not required, but
 * deterministic; weights: [N, K] = scores[idx] / Σ_k scores[idx] · route_scale. */
typedef struct {
    int64_t N, E, K; /* tokens, experts, experts per token */
} moe_gate_dims;
struct moe_gate_args {
    moe_gate_dims dims;
    float route_scale;
    const float *logits, *bias;
    const int64_t *tid2eid;
    const int32_t *ids;
    int32_t *idx;           /* written by the forward, read by the backward */
    float *weights, *scores; /* scores: read by the backward */
};
/* dlogits [N, E] += ∂weights/∂logits · dweights [N, K] (only selected experts get gradient). */
struct moe_gate_grads {
    const float *dweights;
    float *dlogits;
};
static inline void moe_gate_fwd(const moe_gate_args *a) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_gate_fwd) k->moe_gate_fwd(a);
}
static inline void moe_gate_bwd(const moe_gate_args *a, const moe_gate_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_gate_bwd) k->moe_gate_bwd(a, g);
}

/* ---- MoE routing as data ops (cpu/route.c): the data-dependent steps of the router and the MoE unit.
 * A plan skips them with every other op; its routing is balanced (moe_expert_counts). NK = N·K
 * assignments (token t, slot k), grouped by expert: expert e's are [eoff[e], eoff[e + 1]). */
/* force_balance's table: table [N·K] = j mod E, read through ids [N] = 0, 1, ..., N − 1. */
static inline void moe_balanced_table(int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_balanced_table) k->moe_balanced_table(table, ids, N, K, E);
}
/* Groups the assignments idx [N, K] by expert, tokens ascending within an expert: eoff [E + 1],
 * etok [N·K] (token of each), eslot [N·K] (its top-k slot). */
static inline void moe_group_by_expert(int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx, int64_t N,
                                       int64_t E, int64_t K) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_group_by_expert) k->moe_group_by_expert(eoff, etok, eslot, idx, N, E, K);
}
/* cnt [E] = assignments per expert: eoff [E + 1] differenced. The plan backend writes those of balanced
 * routing (slot j to expert j mod E) instead, so a plan sizes expert parallelism's rows as
 * moe_force_balance routes them. */
static inline void moe_expert_counts(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_expert_counts) k->moe_expert_counts(cnt, eoff, E, NK);
}
/* load [E] += assignments per expert (eoff [E + 1] differenced): the expert load of the step. */
static inline void moe_expert_load(int64_t *load, const int64_t *eoff, int64_t E) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_expert_load) k->moe_expert_load(load, eoff, E);
}
/* wj [NK] = w [N, K] at (etok[j], eslot[j]): the routing weight of each assignment. */
static inline void moe_assignment_weights(float *wj, const float *w, const int32_t *etok, const int32_t *eslot,
                                          int64_t NK, int64_t K) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_assignment_weights) k->moe_assignment_weights(wj, w, etok, eslot, NK, K);
}
/* dgw [N, K] at (etok[j], eslot[j]) += dw [j], j ascending. */
static inline void moe_weight_grads_add(float *dgw, const float *dw, const int32_t *etok, const int32_t *eslot,
                                        int64_t NK, int64_t K) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_weight_grads_add) k->moe_weight_grads_add(dgw, dw, etok, eslot, NK, K);
}
/* dst [n, D] = src rows rows[i] (src: [*, D]). */
static inline void rows_gather(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rows_gather) k->rows_gather(dst, src, rows, n, D);
}
/* dst row rows[i] += src row i, i ascending (deterministic). dst: [*, D]; src: [n, D]. */
static inline void rows_scatter_add(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rows_scatter_add) k->rows_scatter_add(dst, src, rows, n, D);
}
/* Rows with a trailing weight, as expert parallelism sends them: dst [n, D + 1], row i = (x row
 * rows[i] (rows NULL: row i) | w[i]). unpack: the inverse, x [n, D] and w [n] from src [n, D + 1]. */
static inline void rows_pack(float *dst, const float *x, const int32_t *rows, const float *w, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rows_pack) k->rows_pack(dst, x, rows, w, n, D);
}
static inline void rows_unpack(float *x, float *w, const float *src, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->rows_unpack) k->rows_unpack(x, w, src, n, D);
}
/* Backward of a packed send: dx row etok[j] += src row j [:D], dgw (etok[j], eslot[j]) += src[j, D],
 * j ascending. src: [NK, D + 1]; dx: [N, D]; dgw: [N, K]. */
static inline void moe_unpack_grads_add(float *dx, float *dgw, const float *src, const int32_t *etok,
                                        const int32_t *eslot, int64_t NK, int64_t D, int64_t K) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_unpack_grads_add) k->moe_unpack_grads_add(dx, dgw, src, etok, eslot, NK, D, K);
}
/* dst [n] += src [n], in index order. */
static inline void tensor_add(float *dst, const float *src, int64_t n) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_add) k->tensor_add(dst, src, n);
}

/* ---- routed experts (cpu/experts.c): SwiGLU experts on rows grouped by expert, §5.
 * Expert e of the nexp run here owns rows [off[e], off[e + 1]) of x [R, D] (routing weights rw [R]);
 * each runs h1 = w1 x, h3 = w3 x (saved [R, I]), y = w2(rw · swiglu(h1, h3)) [R, D]. A plan runs none:
 * which rows go where is data. */
struct moe_expert_w {
    float *w1, *w2, *w3; /* w1, w3: [I, D]; w2: [D, I] */
};
struct moe_experts_args {
    int64_t nexp, D, I;
    float limit;
    const int64_t *off;      /* [nexp + 1] */
    const moe_expert_w *w;   /* [nexp] */
    /* Mixed precision: the buffer the weights lie in and its bf16 compute copy; the GEMMs read weight x as
     * the bits hcopy + (x − wbase) (linear_fwd_bf16w). hcopy NULL: they read the fp32 weights. */
    const float *wbase;
    const uint16_t *hcopy;
    const float *x, *rw;     /* [R, D], [R] */
    float *h1, *h3;          /* [R, I]: written by the forward, read by the backward */
    float *act;              /* [rows of the largest expert, I] scratch */
};
/* Backward given dy [R, D]: dx [R, D] and dw [R] (d routing weight) are overwritten; weight gradients
 * accumulate into g [nexp]. Scratch dact, dh1, dh3: [rows of the largest expert, I]. */
struct moe_experts_grads {
    moe_expert_w *g;
    const float *dy;
    float *dx, *dw;
    float *dact, *dh1, *dh3;
};
static inline void moe_experts_fwd(const moe_experts_args *a, float *y) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_experts_fwd) k->moe_experts_fwd(a, y);
}
static inline void moe_experts_bwd(const moe_experts_args *a, const moe_experts_grads *g) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->moe_experts_bwd) k->moe_experts_bwd(a, g);
}

/* act[n, i] = silu(min(g, limit)) · clamp(u, −limit, limit); limit <= 0: no clamp.
 * g, u, act: [N, I]. Clamped elements (g > limit; |u| > limit) pass no gradient. */
static inline void swiglu_fwd(float *act, const float *g, const float *u, int64_t N, int64_t I, float limit) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->swiglu_fwd) k->swiglu_fwd(act, g, u, N, I, limit);
}
static inline void swiglu_bwd(float *dg, float *du, const float *dact, const float *g, const float *u, int64_t N,
                              int64_t I, float limit) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->swiglu_bwd) k->swiglu_bwd(dg, du, dact, g, u, N, I, limit);
}

/* ================================================================ loss (cpu/loss.c)
 * Cross-entropy over logits [N, V] with targets [N] (−1 = row not scored).
 * *loss_sum = Σ over scored rows of −log softmax(logits)[target] (double); *n_scored rows.
 * dlogits (may be NULL) is OVERWRITTEN: grad_scale·(softmax − onehot) on scored rows, 0 elsewhere. */
static inline void cross_entropy_fwd_bwd(double *loss_sum, int64_t *n_scored, float *dlogits, const float *logits,
                                         const int32_t *targets, int64_t N, int64_t V, float grad_scale) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->cross_entropy_fwd_bwd)
        k->cross_entropy_fwd_bwd(loss_sum, n_scored, dlogits, logits, targets, N, V, grad_scale);
}

/* ================================================================ data movement (cpu/data.c)
 * The model's copies and fills, as ops: a plan (memplan) then skips them with every other op. */
/* dst[bytes] = src[bytes] (no overlap). */
static inline void tensor_copy(void *dst, const void *src, size_t bytes) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_copy) k->tensor_copy(dst, src, bytes);
}
/* dst[bytes] = 0. */
static inline void tensor_zero(void *dst, size_t bytes) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_zero) k->tensor_zero(dst, bytes);
}
/* Mixed precision's bf16 activations (docs/mixed-precision.md), rounded as the bf16 GEMM rounds its operands
 * (gemm_bf16_bits), so a GEMM that reads them again rounds nothing. x: [n] in place. */
static inline void tensor_round_bf16(float *x, int64_t n) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_round_bf16) k->tensor_round_bf16(x, n);
}
/* dst [n] bf16 bits of src [n] (gemm_bf16_bits); exact when src was rounded by tensor_round_bf16. */
static inline void tensor_pack_bf16(uint16_t *dst, const float *src, int64_t n) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_pack_bf16) k->tensor_pack_bf16(dst, src, n);
}
/* dst [n] = the floats of the bf16 bits src [n]. */
static inline void tensor_unpack_bf16(float *dst, const uint16_t *src, int64_t n) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->tensor_unpack_bf16) k->tensor_unpack_bf16(dst, src, n);
}
/* Token ids shifted left along each sequence: out[b, t] = ids[b, t + shift] while t + shift < T, else
 * fill. out, ids: [B, T] (shift 0: a copy). */
static inline void shift_ids(int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift, int32_t fill) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->shift_ids) k->shift_ids(out, ids, B, T, shift, fill);
}
/* The n residual streams of one row (§3): X [N, n, D], whose first N·D floats hold x [N, D] on entry,
 * gets X[t, k] = x[t] for every k, in place. */
static inline void streams_expand(float *X, int64_t N, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->streams_expand) k->streams_expand(X, N, n, D);
}
/* X[t, k] += x[t] for every stream k. X: [N, n, D]; x: [N, D]. */
static inline void streams_add(float *X, const float *x, int64_t N, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->streams_add) k->streams_add(X, x, N, n, D);
}
/* Backward of both: dx[t] += Σ_k dX[t, k], k in order. dx: [N, D]; dX: [N, n, D]. */
static inline void streams_sum(float *dx, const float *dX, int64_t N, int64_t n, int64_t D) {
    const ds4_kernel_backend *k = ds4_kernels();
    if (k->streams_sum) k->streams_sum(dx, dX, N, n, D);
}

#endif
