/* One DeepSeek-V4 block (main layer or MTP block) as a sequence of named units, each with a forward
 * and a backward, and the activations each unit saves for backward. */
#ifndef DS4_MODEL_BLOCK_H
#define DS4_MODEL_BLOCK_H

#include "model/model_internal.h"

#define BLOCK_MAX_ACTS 64

/* Saved activations of one block for one pass. N = B·T tokens; shapes in comments. */
typedef struct {
    void *owned[BLOCK_MAX_ACTS]; /* every allocation below, freed together */
    int nowned;
    int64_t ratio, Nc;
    /* hc_pre_attn */
    float *hcA_mixes, *hcA_rsqrt;  /* [N, M], [N] */
    float *hcA_post, *hcA_comb;    /* [N, n], [N, n, n] */
    float *hcA_y;                  /* [N, D] */
    /* attn_norm */
    float *xa, *xa_rstd;           /* [N, D], [N] */
    /* q path: q_down, q_norm, q_up, q_head_norm + rope */
    float *qa, *qa_rstd, *qr;      /* [N, qr], [N], [N, qr] */
    float *qraw, *q_rstd, *q;      /* [N, H, c], [N·H], [N, H, c] (normalised, roped) */
    /* kv path */
    float *kvraw, *kv_rstd, *kv;   /* [N, c], [N], [N, c] (normalised, roped) */
    /* compressor (ratio > 0) */
    float *ca, *cz;                /* [N, coff·c] */
    float *cpool, *c_rstd, *kvc;   /* [B, Nc, c], [B·Nc], [B, Nc, c] (normalised, roped) */
    /* indexer (ratio == 4) */
    float *iqi, *iwi;              /* [N, HI, dI] (roped), [N, HI] */
    float *ica, *icz;              /* [N, 2·dI] */
    float *ipool, *i_rstd, *iki;   /* [B, Nc, dI], [B·Nc], [B, Nc, dI] */
    int32_t *topk;                 /* [N, index_topk] */
    /* sparse attention */
    float *o, *lse;                /* [N, H, c], [N, H] */
    /* o_proj: inverse rope, grouped wo_a, wo_b */
    float *o_r, *z, *attn_out;     /* [N, H, c], [N, G·R], [N, D] */
    /* hc_post_attn */
    float *X_mid;                  /* [N, n, D] */
    /* hc_pre_ffn, ffn_norm */
    float *hcF_mixes, *hcF_rsqrt, *hcF_post, *hcF_comb, *hcF_y;
    float *xf, *xf_rstd;
    /* router */
    float *glogits, *gscores;      /* [N, E] */
    int32_t *gidx;                 /* [N, K] */
    float *gw;                     /* [N, K] */
    /* routed experts: assignments grouped by expert */
    int64_t *eoff;                 /* [E + 1] offsets into the assignment list */
    int32_t *etok, *eslot;         /* [N·K] token and top-k slot of each assignment */
    float *h1, *h3;                /* [N·K, I] */
    /* shared expert */
    float *sh1, *sh3;              /* [N, Is] */
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
} block_ctx;

/* X_out: [N, n, D] from X_in: [N, n, D]. Fills a (its saved activations). Forward-only passes
 * compute the indexer KL here (kl_sum/kl_rows); training passes compute it in backward. */
ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, int64_t *expert_load,
                     double *kl_sum, int64_t *kl_rows);
/* dX_in += ∂/∂X_in given dX_out; parameter gradients accumulate into the model. Also returns the
 * indexer KL of the layer (computed here from the saved lse). */
ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *X_in, const float *dX_out, float *dX_in,
                     double *kl_sum, int64_t *kl_rows);
void block_acts_free(block_acts *a);

#endif
