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
 *  - Every op takes its context first (`const ds4_exec *ex`: the backend, plan or real, the stream) and
 *    runs on the table that context picks (backend.h, ds4_exec_kernels): the cpu backend (cpu/, x86/)
 *    computes; in a plan (memplan) the backend's plan twin touches no data and only counts the workspace
 *    the backend would allocate. The ops are listed once, in ops.def, which the wrappers at the end of
 *    this file are generated from; this file holds their descriptor types and the math of each family.
 *    README.md in this folder says how a backend (CUDA) slots in.
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
#include "kernels/profile.h"

/* ================================================================ gemm (gemm.c, cpu/gemm.c, x86/)
 * beta is 0 (overwrite C) or 1 (accumulate into C). Leading dimensions in elements.
 * Precision: ds4_set_matmul_precision (fp32 or bf16 operands, fp32 accumulation). */


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
 * ascending index order, −1 padded when fewer than K are usable. O(Nc) workspace per thread. Row t of each
 * batch row is position t0 + t: a pass has t0 = 0; the cached decoder selects for one position p with
 * T = 1, t0 = p (usable: (s+1)·ratio <= p+1). */
struct indexer_topk_args {
    indexer_dims dims;
    int64_t t0;
    float wscale;
    const float *qi, *ki, *w;
    const uint16_t *ki16; /* bf16 keys read instead of ki, or NULL */
    int32_t *topk;
};

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
    float *act;              /* [R, I] scratch, R = off[nexp] (expert e's rows at off[e]: experts may run side by side) */
};
/* Backward given dy [R, D]: dx [R, D] and dw [R] (d routing weight) are overwritten; weight gradients
 * accumulate into g [nexp]. Scratch dact, dh1, dh3: [R, I], as act. */
struct moe_experts_grads {
    moe_expert_w *g;
    const float *dy;
    float *dx, *dw;
    float *dact, *dh1, *dh3;
};



/* ================================================================ data movement (cpu/data.c)
 * The model's copies and fills, as ops: a plan (memplan) then skips them with every other op. */

/* ================================================================ the wrappers
 * One per op of ops.def: runs the op on the table of context ex (ds4_exec_kernels); with no entry (a
 * plan's SKIP ops) it does nothing, and a query returns its absent value. With the kernel profile on
 * (ds4/profile.h) the call is timed and counted under its op (profile.c); off, that is one branch. */
#define DS4_OP(name, plan, cpu, params, args)                                   \
    static inline void name params {                                         \
        const ds4_kernel_backend *k_ = ds4_exec_kernels(ex);                  \
        if (!k_->name) return;                                               \
        if (__builtin_expect(ds4_profile_on, 0)) {                           \
            const int64_t t0_ = ds4_profile_begin();                          \
            k_->name args;                                                   \
            ds4_profile_end(DS4_OPID_##name, t0_, DS4_SPREAD args);          \
        } else {                                                             \
            k_->name args;                                                   \
        }                                                                    \
    }
#define DS4_QUERY(name, plan, cpu, type, absent, params, args)                    \
    static inline type name params {                                         \
        const ds4_kernel_backend *k_ = ds4_exec_kernels(ex);                  \
        if (!k_->name) return (absent);                                      \
        if (!__builtin_expect(ds4_profile_on, 0)) return k_->name args;      \
        const int64_t t0_ = ds4_profile_begin();                              \
        type r_ = k_->name args;                                              \
        ds4_profile_end(DS4_OPID_##name, t0_, DS4_SPREAD args);              \
        return r_;                                                           \
    }
#include "kernels/ops.def"

#endif
