/* Scalar reference kernels: the tests' oracles.
 *
 * Each function is the math of one ds4 op written as plainly as possible, in double: plain loops,
 * no OpenMP, no vector types, no blocking, no workspace tricks. They are independent of the
 * production kernels (kernels/kernels.h): written from docs/dsv4-architecture.md and
 * docs/contract.md, sharing only the conventions the production code documents (tie-breaking,
 * window and causality, which compressed entries a query sees, the sink, lse, the KL's definition).
 * Backward oracles are derived from the math and recompute every intermediate from the forward
 * inputs; tests check them against finite differences of the oracle's own forward.
 *
 * Conventions (those of kernels.h): row-major, forward functions overwrite their outputs,
 * backward functions ACCUMULATE (+=) into every gradient and skip a NULL one. Speed does not
 * matter here; clarity does. Only the tests call these functions.
 *
 * Sizes: N rows (tokens), B batch, T sequence, H heads, c head dim, n mHC streams, D width. */
#ifndef DS4_ORACLE_H
#define DS4_ORACLE_H

#include <stdbool.h>
#include <stdint.h>

/* ================================================================ oracle_basic.c */

/* Linear without bias: out[N, OC] = inp[N, IC] · w[OC, IC]^T. */
void oracle_linear_fwd(double *out, const double *inp, const double *w, int64_t N, int64_t IC, int64_t OC);
/* dinp[N, IC] += dout[N, OC] · w;  dw[OC, IC] += dout^T · inp. */
void oracle_linear_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w, int64_t N,
                       int64_t IC, int64_t OC);

/* Grouped (block-diagonal) projection: z[n, g, r] = Σ_i o[n, g, i]·w[g, r, i].
 * z: [N, G, R]; o: [N, G, Din]; w: [G, R, Din]. */
void oracle_grouped_linear_fwd(double *z, const double *o, const double *w, int64_t N, int64_t G, int64_t R,
                               int64_t Din);
void oracle_grouped_linear_bwd(double *do_, double *dw, const double *dz, const double *o, const double *w,
                               int64_t N, int64_t G, int64_t R, int64_t Din);

/* Embedding: out[n, :] = table[ids[n], :]; dtable[ids[n], :] += dout[n, :]. out: [N, D]; table: [V, D]. */
void oracle_embedding_fwd(double *out, const double *table, const int32_t *ids, int64_t N, int64_t D);
void oracle_embedding_bwd(double *dtable, const double *dout, const int32_t *ids, int64_t N, int64_t D);

/* RMSNorm: y[n, j] = w[j]·x[n, j]·r[n], r[n] = (mean_j x[n, j]² + eps)^(-1/2); w == NULL: w = 1.
 * x, y: [N, D]; rstd: [N] (may be NULL). The backward recomputes r from x. */
void oracle_rmsnorm_fwd(double *y, double *rstd, const double *x, const double *w, int64_t N, int64_t D,
                        double eps);
void oracle_rmsnorm_bwd(double *dx, double *dw, const double *dy, const double *x, const double *w, int64_t N,
                        int64_t D, double eps);

/* RoPE frequencies θ_i = base^(-2i/rd), i < rd/2, with the YaRN correction when original_seq_len > 0:
 * pairs below dim `low` keep θ, above `high` get θ/factor, a linear ramp between. theta: [rd/2]. */
void oracle_rope_freqs(double *theta, int64_t rd, double base, double factor, int64_t original_seq_len,
                       double beta_fast, double beta_slow);
/* In place on x: [N, H, hd]: the pairs (x[hd-rd+2i], x[hd-rd+2i+1]) of every head rotated by the angle
 * pos·θ_i (−pos·θ_i if inverse), pos = (n % period)·mult. */
void oracle_rope_fwd(double *x, int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult,
                     const double *theta, bool inverse);
/* dx (in place, the gradient of the rotated x) becomes the gradient of the input: the transpose of
 * the rotation applied by oracle_rope_fwd(…, inverse). */
void oracle_rope_bwd(double *dx, int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult,
                     const double *theta, bool inverse);

/* Clamped SwiGLU: act = silu(min(g, L))·clamp(u, −L, L) (L <= 0: no clamp). g, u, act: [N·I].
 * Clamped elements pass no gradient. */
void oracle_swiglu_fwd(double *act, const double *g, const double *u, int64_t n_el, double limit);
void oracle_swiglu_bwd(double *dg, double *du, const double *dact, const double *g, const double *u, int64_t n_el,
                       double limit);

/* Compressor pooling: a, z: [B, T, C], C = 2d if overlap else d; ape: [r, C]; out: [B, Nc, d], Nc = T / r.
 * Entry i, channel ch: softmax over its slots of score = z + ape[u], weights applied to a. Slots:
 * without overlap the r tokens of block i at column ch; with overlap the r tokens of block i−1 at
 * column ch (none for i = 0) and the r tokens of block i at column d + ch. u = token's place in its block. */
void oracle_compressor_pool_fwd(double *out, const double *a, const double *z, const double *ape, int64_t B,
                                int64_t T, int64_t r, int64_t d, bool overlap);
void oracle_compressor_pool_bwd(double *da, double *dz, double *dape, const double *dout, const double *a,
                                const double *z, const double *ape, int64_t B, int64_t T, int64_t r, int64_t d,
                                bool overlap);

/* MoE gate. logits, scores: [N, E]; scores = sqrt(softplus(logits)) (softplus linear above 20).
 * Selection idx: [N, K]: tid2eid[ids[n], :] if tid2eid (tid2eid: [V, K]) else the K experts with the
 * largest scores + bias (bias: [E] or NULL), in descending order, ties to the lower id.
 * weights: [N, K] = route_scale·scores[idx] / Σ_k scores[idx]. */
void oracle_moe_gate_fwd(int32_t *idx, double *weights, double *scores, const double *logits, const double *bias,
                         const int64_t *tid2eid, const int32_t *ids, int64_t N, int64_t E, int64_t K,
                         double route_scale);
/* dlogits[N, E] += ∂(Σ dweights·weights)/∂logits for the given selection idx (constant). */
void oracle_moe_gate_bwd(double *dlogits, const double *dweights, const double *logits, const int32_t *idx,
                         int64_t N, int64_t E, int64_t K, double route_scale);

/* Cross-entropy: *loss_sum = Σ over rows with 0 <= targets[n] < V of −log softmax(logits[n])[targets[n]];
 * *n_scored = their count. dlogits (may be NULL) is OVERWRITTEN with grad_scale·∂loss_sum/∂logits
 * (0 on unscored rows). logits: [N, V]. */
void oracle_cross_entropy(double *loss_sum, int64_t *n_scored, double *dlogits, const double *logits,
                          const int32_t *targets, int64_t N, int64_t V, double grad_scale);

/* ================================================================ oracle_hc.c (mHC)
 * n streams, M = (2+n)·n mixes per token: pre [0, n), post [n, 2n), comb [2n, 2n+n²),
 * comb[j][k] = mixes[2n + n·j + k]. scale: [3]; base: [M]. */

/* One token: pre[j] = σ(mixes[j]·scale0 + base[j]) + eps; post[j] = 2σ(mixes[n+j]·scale1 + base[n+j]);
 * comb[n, n] = Sinkhorn(softmax_k(mixes·scale2 + base) + eps): a column normalisation, then
 * (iters−1) × (row, column), each x / (Σ_axis x + eps). */
void oracle_hc_sinkhorn_fwd(double *pre, double *post, double *comb, const double *mixes, const double *scale,
                            const double *base, int64_t n, int64_t iters, double eps);
/* dmixes[M], dscale[3], dbase[M] += from dpre[n], dpost[n], dcomb[n, n] (each may be NULL = 0). */
void oracle_hc_sinkhorn_bwd(double *dmixes, double *dscale, double *dbase, const double *dpre, const double *dpost,
                            const double *dcomb, const double *mixes, const double *scale, const double *base,
                            int64_t n, int64_t iters, double eps);

/* hc_pre: per token x = X[t] flattened [n·D], r = (mean(x²) + norm_eps)^(-1/2), mixes = r·(fn·x),
 * (pre, post, comb) = Sinkhorn split of mixes, y = Σ_j pre[j]·X[t, j].
 * y: [N, D]; post: [N, n]; comb: [N, n, n]; mixes: [N, M] and rsqrt: [N] (may be NULL);
 * X: [N, n, D]; fn: [M, n·D]. */
void oracle_hc_pre_fwd(double *y, double *post, double *comb, double *mixes, double *rsqrt, const double *X,
                       const double *fn, const double *scale, const double *base, int64_t N, int64_t n, int64_t D,
                       int64_t iters, double hc_eps, double norm_eps);
void oracle_hc_pre_bwd(double *dX, double *dfn, double *dscale, double *dbase, const double *dy,
                       const double *dpost, const double *dcomb, const double *X, const double *fn,
                       const double *scale, const double *base, int64_t N, int64_t n, int64_t D, int64_t iters,
                       double hc_eps, double norm_eps);

/* hc_post: Y[t, k] = post[t, k]·x[t] + Σ_j comb[t, j, k]·res[t, j].
 * Y, res: [N, n, D]; x: [N, D]; post: [N, n]; comb: [N, n, n]. */
void oracle_hc_post_fwd(double *Y, const double *x, const double *res, const double *post, const double *comb,
                        int64_t N, int64_t n, int64_t D);
void oracle_hc_post_bwd(double *dx, double *dres, double *dpost, double *dcomb, const double *dY, const double *x,
                        const double *res, const double *post, const double *comb, int64_t N, int64_t n, int64_t D);

/* hc_head: mixes = r·(fn·x) [n], pre = σ(mixes·scale[0] + base) + hc_eps, y = Σ_j pre[j]·X[t, j].
 * y: [N, D]; X: [N, n, D]; fn: [n, n·D]; base: [n]; scale: [1]. */
void oracle_hc_head_fwd(double *y, const double *X, const double *fn, const double *scale, const double *base,
                        int64_t N, int64_t n, int64_t D, double hc_eps, double norm_eps);
void oracle_hc_head_bwd(double *dX, double *dfn, double *dscale, double *dbase, const double *dy, const double *X,
                        const double *fn, const double *scale, const double *base, int64_t N, int64_t n, int64_t D,
                        double hc_eps, double norm_eps);

/* ================================================================ oracle_attn.c */

/* Is key row j of [kv (T rows) | kvc (Nc rows)] a key of query (b, t)? Window token j < T:
 * max(0, t−window+1) <= j <= t. Compressed entry i = j − T: if ratio <= 0 never; with a topk row
 * (topk != NULL): the number of slots of topk[b, t, :] equal to i (a valid id appears once);
 * otherwise 1 iff (i+1)·ratio <= t+1. Returns the multiplicity (0 = not a key). */
int64_t oracle_attn_key_count(int64_t j, int64_t b, int64_t t, const int32_t *topk, int64_t T, int64_t window,
                              int64_t ratio, int64_t Nc, int64_t K);

/* Sparse shared-KV attention with a sink per head, for query (b, t) and head h:
 * s_j = scale·q·key_j over its keys (oracle_attn_key_count), lse = log(Σ_j exp(s_j) + exp(sink[h])),
 * o = Σ_j exp(s_j − lse)·key_j (the key is also the value; the sink has value 0).
 * q, o: [B, T, H, c]; kv: [B, T, c]; kvc: [B, Nc, c]; topk: [B, T, K] or NULL; sink: [H]; lse: [B, T, H]. */
void oracle_sparse_attn_fwd(double *o, double *lse, const double *q, const double *kv, const double *kvc,
                            const int32_t *topk, const double *sink, int64_t B, int64_t T, int64_t H, int64_t c,
                            int64_t window, int64_t ratio, int64_t Nc, int64_t K, double scale);
/* dq, dkv, dkvc, dsink += the gradients of Σ dout·o (the forward recomputed from the inputs). */
void oracle_sparse_attn_bwd(double *dq, double *dkv, double *dkvc, double *dsink, const double *dout,
                            const double *q, const double *kv, const double *kvc, const int32_t *topk,
                            const double *sink, int64_t B, int64_t T, int64_t H, int64_t c, int64_t window,
                            int64_t ratio, int64_t Nc, int64_t K, double scale);

/* Lightning-indexer score of entry s for query (b, t): I = Σ_h wscale·w[b, t, h]·ReLU(qi[b, t, h]·ki[b, s]).
 * qi: [B, T, HI, dI]; ki: [B, Nc, dI]; w: [B, T, HI]. */
double oracle_indexer_score(const double *qi, const double *ki, const double *w, int64_t b, int64_t t, int64_t s,
                            int64_t T, int64_t HI, int64_t dI, int64_t Nc, double wscale);
/* topk: [B, T, K]: the min(K, usable) usable entries ((s+1)·ratio <= t+1) with the highest score, ties to
 * the lower index, in ascending index order, then −1. */
void oracle_indexer_topk(int32_t *topk, const double *qi, const double *ki, const double *w, int64_t B, int64_t T,
                         int64_t HI, int64_t dI, int64_t Nc, int64_t ratio, int64_t K, double wscale);
/* Indexer KL loss (docs/contract.md "indexer_loss"). For each row (b, t), S = the ids of topk[b, t, :]
 * in [0, Nc) (or every usable entry if topk == NULL); rows with S empty are skipped. Teacher
 * p_s ∝ Σ_h exp(scale·q[b,t,h]·kvc[b,s] − lse[b,t,h]), L1-normalised over S (row skipped if that mass is
 * 0 or not finite); student = softmax over S of the indexer scores; kl = Σ_s p_s(log p_s − log student_s),
 * p = 0 terms 0. *kl_sum = Σ kl over rows, *n_rows = rows counted; dqi, dki, dw (may be NULL) +=
 * grad_scale·∂kl_sum/∂· (the teacher is a constant). q: [B, T, H, c]; kvc: [B, Nc, c]; lse: [B, T, H]. */
void oracle_indexer_kl(double *kl_sum, int64_t *n_rows, double *dqi, double *dki, double *dw, const double *qi,
                       const double *ki, const double *w, const int32_t *topk, const double *q, const double *kvc,
                       const double *lse, int64_t B, int64_t T, int64_t H, int64_t c, int64_t HI, int64_t dI,
                       int64_t Nc, int64_t ratio, int64_t K, double scale, double wscale, double grad_scale);

#endif
