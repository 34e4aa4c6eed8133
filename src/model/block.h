/* One DeepSeek-V4 block (main layer or MTP block) as a fixed sequence of named units. Each unit has a
 * forward that (re)computes its outputs from its inputs, and the block's backward reads unit outputs
 * through block_need(), which replays a released unit (and, recursively, released inputs) first.
 *
 * Recompute is a property of the saved tensors (DESIGN.md idea 2): the pass gives each block a
 * release mask; a masked unit's outputs are freed right after their last forward reader and replayed
 * in backward with the same deterministic kernels, so losses and gradients are bitwise unchanged. */
#ifndef DS4_MODEL_BLOCK_H
#define DS4_MODEL_BLOCK_H

#include "model/model_internal.h"

/* Units in forward order. */
typedef enum {
    U_HC_PRE_ATTN = 0, /* mHC pre of attention: y, post, comb (+ mixes, rsqrt) */
    U_ATTN_NORM,       /* xa = attn_norm(y) */
    U_Q_DOWN,          /* qr = q_norm(wq_a xa) */
    U_Q_UP,            /* q = rope(head_norm(wq_b qr)) */
    U_KV,              /* kv = rope(kv_norm(wkv xa)) */
    U_COMPRESSOR,      /* kvc = rope(norm(pool(wkv xa, wgate xa))) */
    U_INDEXER,         /* indexer queries, weights, compressed keys */
    U_INDEXER_TOPK,    /* the indexer's top-k selection (small: saved even when the indexer is released) */
    U_SPARSE_ATTN,     /* o, lse */
    U_O_PROJ,          /* attn_out = wo_b(wo_a(inverse_rope(o))) */
    U_HC_POST_ATTN,    /* X_mid */
    U_HC_PRE_FFN,
    U_FFN_NORM,
    U_ROUTER,          /* gate logits, scores, top-k experts, weights, assignments */
    U_MOE,             /* routed + shared experts: ffn_out */
    U_HC_POST_FFN,     /* X_out (the next block's input, owned by the pass) */
    U_COUNT
} unit_id;

const char *unit_name(unit_id u);

#define UNIT_MAX_OUTS 12

/* Per (block, unit) accounting for the memory report. */
typedef struct {
    int64_t bytes;          /* bytes of the unit's outputs (one copy) */
    int64_t released;       /* times released after forward */
    int64_t replays;        /* times replayed for backward */
    double replay_seconds;
} unit_stats;

/* Saved activations of one block for one pass. N = B·T tokens; shapes in comments. */
typedef struct {
    void *owned[U_COUNT][UNIT_MAX_OUTS]; /* allocations of each unit's outputs */
    int nowned[U_COUNT];
    bool present[U_COUNT];
    uint32_t release_mask;  /* units to release after their last forward reader */
    unit_stats *stats;      /* [U_COUNT] or NULL */
    const float *X_in;      /* [N, n, D] block input (owned by the pass) */
    float *X_out;           /* [N, n, D] block output (owned by the pass) */
    int64_t ratio, Nc;
    /* U_HC_PRE_ATTN */
    float *hcA_mixes, *hcA_rsqrt;  /* [N, M], [N] */
    float *hcA_post, *hcA_comb;    /* [N, n], [N, n, n] */
    float *hcA_y;                  /* [N, D] */
    /* U_ATTN_NORM */
    float *xa, *xa_rstd;           /* [N, D], [N] */
    /* U_Q_DOWN */
    float *qa, *qa_rstd, *qr;      /* [N, qr], [N], [N, qr] */
    /* U_Q_UP */
    float *qraw, *q_rstd, *q;      /* [N, H, c], [N·H], [N, H, c] (normalised, roped) */
    /* U_KV */
    float *kvraw, *kv_rstd, *kv;   /* [N, c], [N], [N, c] (normalised, roped) */
    /* U_COMPRESSOR (ratio > 0) */
    float *ca, *cz;                /* [N, coff·c] */
    float *cpool, *c_rstd, *kvc;   /* [B, Nc, c], [B·Nc], [B, Nc, c] (normalised, roped) */
    /* U_INDEXER (ratio == 4) */
    float *iqi, *iwi;              /* [N, HI, dI] (roped), [N, HI] */
    float *ica, *icz;              /* [N, 2·dI] */
    float *ipool, *i_rstd, *iki;   /* [B, Nc, dI], [B·Nc], [B, Nc, dI] */
    /* U_INDEXER_TOPK */
    int32_t *topk;                 /* [N, index_topk] */
    /* U_SPARSE_ATTN */
    float *o, *lse;                /* [N, H, c], [N, H] */
    /* U_O_PROJ */
    float *z, *attn_out;           /* [N, G·R], [N, D] (the inverse-roped o is rebuilt from o when needed) */
    /* U_HC_POST_ATTN */
    float *X_mid;                  /* [N, n, D] */
    /* U_HC_PRE_FFN, U_FFN_NORM */
    float *hcF_mixes, *hcF_rsqrt, *hcF_post, *hcF_comb, *hcF_y;
    float *xf, *xf_rstd;
    /* U_ROUTER */
    float *glogits, *gscores;      /* [N, E] */
    int32_t *gidx;                 /* [N, K] */
    float *gw;                     /* [N, K] */
    int64_t *eoff;                 /* [E + 1] offsets into the assignment list */
    int32_t *etok, *eslot;         /* [N·K] token and top-k slot of each assignment, grouped by expert */
    /* U_MOE */
    ds4_ep_route *route;           /* expert parallelism: where the assignments went (NULL: all local) */
    float *xr, *wr;                /* EP: received rows [R, D] and their routing weights [R] */
    float *h1, *h3;                /* [R, I] routed w1 / w3 outputs (R = N·K without EP) */
    float *sh1, *sh3;              /* [N, Is] shared expert w1 / w3 outputs */
    float *ffn_out;                /* [N, D] */
} block_acts;

/* Everything a block pass needs to know about its context. */
typedef struct {
    ds4_model *m;
    int64_t layer;      /* block index: 0..n_layers-1 main, n_layers = MTP */
    int64_t B, T;
    const int32_t *ids; /* [B, T] ids for hash routing */
    bool dense_csa;
    bool keep;          /* keep activations for backward */
    const ds4_ep_ops *ep; /* expert parallelism (NULL: every expert local) */
    bool force_balance; /* route slot k of token t to expert (t·K + k) mod E */
    int32_t *topk_copy; /* [N, index_topk]: the top-k is copied here before a recompute release (NULL: not kept) */
} block_ctx;

/* X_out: [N, n, D] from X_in: [N, n, D] (both owned by the caller, X_in kept until backward).
 * Forward-only passes compute the indexer KL here (kl_sum/kl_rows); training passes in backward. */
ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, uint32_t release_mask,
                     unit_stats *stats, int64_t *expert_load, double *kl_sum, int64_t *kl_rows);
/* dX_in += ∂/∂X_in given dX_out; parameter gradients accumulate into the model. Returns the indexer
 * KL of the layer (computed here from the saved lse). Frees the block's activations. */
ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *dX_out, float *dX_in, double *kl_sum,
                     int64_t *kl_rows);
void block_acts_free(block_acts *a);
/* Bytes currently held by the block's unit outputs. */
int64_t block_acts_bytes(const block_acts *a);

#endif
