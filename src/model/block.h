/* One DeepSeek-V4 block (main layer or MTP block) as a short list of units. A unit is declared once
 * (unit_decl, next to its code in units_*.c): its inputs, its saved outputs with their shapes and
 * dtypes, a forward that computes the outputs from the inputs, a backward, and the units whose outputs
 * that backward reads. Everything else is derived from the declarations (model/unit_acts.c): allocation
 * of a unit's outputs, release after their last forward reader when the activation store recomputes it,
 * replay (inputs first) before a backward reader, free after the last backward reader, and the per-unit
 * byte count of the memory report. Replays run the same deterministic forward, so losses and gradients
 * are bitwise those of a pass that keeps everything (docs/DESIGN.md idea 2). */
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

#define UNIT_BIT(u) (1u << (u))
#define UNIT_MAX_OUTS 8

/* Output slots of each unit, in allocation order (their shapes and dtypes: the unit's declaration). */
enum { HC_MIXES, HC_RSQRT, HC_POST, HC_COMB, HC_Y };        /* hc_pre_attn, hc_pre_ffn */
enum { NORM_X, NORM_RSTD };                                 /* attn_norm (xa), ffn_norm (xf) */
enum { QD_QA, QD_RSTD, QD_QR };                             /* q_down */
enum { QU_RAW, QU_RSTD, QU_Q };                             /* q_up */
enum { KV_RAW, KV_RSTD, KV_KV };                            /* kv */
enum { CMP_A, CMP_Z, CMP_POOL, CMP_RSTD, CMP_OUT };         /* a compressor: kvc is CMP_OUT */
enum { IDX_QI, IDX_WI, IDX_CMP };                           /* indexer; its compressor's slots from IDX_CMP */
enum { TOPK_SEL };                                          /* indexer_topk */
enum { SA_O, SA_LSE };                                      /* sparse_attn */
enum { OP_Z, OP_OUT };                                      /* o_proj */
enum { HP_X };                                              /* hc_post_attn: X_mid */
enum { RT_LOGITS, RT_SCORES, RT_IDX, RT_W, RT_EOFF, RT_ETOK, RT_ESLOT }; /* router */
enum { MOE_H1, MOE_H3, MOE_SH1, MOE_SH3, MOE_OUT, MOE_XR, MOE_WR };     /* moe */

/* ACT_F32_BF16: a float tensor that mixed precision (ds4_pass_opts.bf16_acts) holds in bf16: its values
 * are rounded to bf16 as soon as the unit has made them (so every reader, replays included, sees the
 * same values) and it is held as bf16 from its last forward reader until a backward reader needs it.
 * ACT_BF16: a float tensor whose readers, forward and backward, all take bf16 (the keys and values of
 * sparse attention and the indexer's keys): mixed precision packs it to bf16 as soon as the unit has
 * made it (the packing rounds) and it stays bf16 until freed; the units read it with KEYS_F32 / KEYS_BF16.
 * ACT_F32 stays fp32 in every mode: normalisation statistics, softmax and Sinkhorn inputs and outputs,
 * log-sum-exp, router scores and weights, the residual streams (docs/mixed-precision.md says why). */
typedef enum { ACT_F32, ACT_F32_BF16, ACT_BF16, ACT_I32, ACT_I64 } act_dtype;

/* Symbolic dimensions of saved tensors, valued per block and pass (unit_acts.c: act_dim_value). */
typedef enum {
    X_1 = 0, /* an unused trailing dimension */
    X_N,     /* tokens B·T */
    X_B,
    X_D,
    X_HC,    /* hc_mult streams */
    X_MIX,   /* mHC mixes (2 + n)·n */
    X_QR,
    X_H,
    X_HD,
    X_NC,    /* compressed entries per sequence T / ratio */
    X_CMP_C, /* the main compressor's channels coff·head_dim */
    X_HI,
    X_DI,
    X_IDX_C, /* the indexer compressor's channels 2·index_head_dim */
    X_TOPK,  /* index_topk */
    X_GR,    /* o_groups · o_lora_rank */
    X_E,
    X_E1,    /* E + 1 */
    X_K,
    X_ROWS,  /* routed rows computed here: N·K, or the rows EP received */
    X_I,
    X_IS,    /* shared experts' inner dim */
} act_dim;

typedef struct {
    const char *name;
    act_dtype dtype;
    act_dim dim[3];
    bool ep_only;      /* only under expert parallelism */
} act_slot;

/* Per (block, unit) accounting for the memory report. */
typedef struct {
    int64_t bytes;          /* bytes of the unit's outputs (one copy) */
    int64_t released;       /* times released after forward */
    int64_t replays;        /* times replayed for backward */
    double replay_seconds;
} unit_stats;

/* Saved outputs of one block for one pass. */
typedef struct {
    void *out[U_COUNT][UNIT_MAX_OUTS]; /* each unit's output slots (NULL: not held), on the model's backend */
    size_t bytes[U_COUNT][UNIT_MAX_OUTS]; /* the bytes each slot holds now (2 per element while bf16) */
    const ds4_model *m;                /* whose backend holds them (set by the first allocation) */
    bool present[U_COUNT];
    uint8_t packed[U_COUNT]; /* bit s: slot s is held as bf16 (uint16_t) until a backward reader needs it */
    bool bf16;              /* mixed precision: ACT_F32_BF16 slots rounded and held as bf16, ACT_BF16 slots bf16 */
    uint32_t release_mask;  /* units to release after their last forward reader */
    unit_stats *stats;      /* [U_COUNT] or NULL */
    const float *X_in;      /* [N, n, D] block input (owned by the pass) */
    float *X_out;           /* [N, n, D] block output (owned by the pass) */
    int64_t ratio, Nc;
    const ds4_ep_ops *ep;   /* expert parallelism (NULL: every expert local) */
    ds4_ep_route *route;    /* where moe's assignments went under EP */
} block_acts;

/* The saved output slot s of unit u, in the block_acts `a` in scope. */
#define F32(u, s) ((float *)a->out[u][s])
#define I32(u, s) ((int32_t *)a->out[u][s])
#define I64(u, s) ((int64_t *)a->out[u][s])
/* A slot as the attention and indexer kernels take their keys: its fp32 form (NULL when held as bf16)
 * and its bf16 form (NULL when fp32); which one, the slot's declaration says (act_held_bf16). */
#define KEYS_F32(u, s) (act_held_bf16(a, u, s) ? NULL : (const float *)a->out[u][s])
#define KEYS_BF16(u, s) (act_held_bf16(a, u, s) ? (const uint16_t *)a->out[u][s] : NULL)

/* Everything a block pass needs to know about its context. */
typedef struct {
    ds4_model *m;
    int64_t layer;      /* block index: 0..n_layers-1 main, n_layers = MTP */
    int64_t B, T;
    const int32_t *ids; /* [B, T] ids for hash routing */
    bool dense_csa;
    bool keep;          /* keep activations for backward */
    bool bf16_acts;     /* mixed precision: ACT_F32_BF16 slots in bf16 (ds4_pass_opts.bf16_acts) */
    const ds4_ep_ops *ep; /* expert parallelism (NULL: every expert local) */
    bool force_balance; /* route slot k of token t to expert (t·K + k) mod E */
    int32_t *topk_copy; /* [N, index_topk]: the top-k is copied here before a recompute release (NULL: not kept) */
    const ds4_rope *rope_main, *rope_cmp; /* tables from position 0 (the pass) or views from the decoded one */
} block_ctx;

/* One compressor's state in the cached decoder. */
typedef struct {
    int64_t r, d, C;      /* ratio, entry width, C = coff·d channels per token */
    bool overlap;         /* ratio 4: entry i also pools block i − 1 */
    float *a, *z;         /* [rows, C] pending wkv / wgate rows: rows = 2r (previous block, then current) or r */
    float *out;           /* [cap, d] emitted entries (normalised, roped at i·r) */
    int64_t cap, n;       /* capacity max_len / r; entries emitted */
} cmp_cache;

/* What the cached decoder (model/decode.c) keeps of one main layer, which the units' decode variants
 * read and extend: a new position needs the window, the compressors' pending blocks and the compressed
 * entries so far. Plus the decoder's one-row scratch those variants use. */
typedef struct {
    int64_t pos;          /* the position being decoded */
    int64_t ratio, ncap;  /* compress ratio (0: SWA); compressed capacity max_len / ratio */
    float *keys;          /* [ncap + window, hd]: compressed entries 0..ncap-1, then the window ring
                           * (position j in row ncap + j % window); each row is key and value */
    cmp_cache cmp;        /* main compressor (ratio > 0); cmp.out points into keys */
    cmp_cache icmp;       /* indexer compressor (ratio == 4) */
    float *pool, *rstd;   /* [2·max(hd, dI)], [1] */
    int32_t *keylist;     /* [window + max compressed keys] the keys one query attends (on the backend) */
    int32_t *keylist_host; /* the same list, built on the host before it is copied over */
    int32_t *sel_host;     /* [index_topk] the indexer's selection, read back to build it */
} unit_cache;

/* Gradient buffers of one block backward (workspace, zeroed), then what the block's backward was given. */
typedef struct {
    float *dX_mid;                   /* [N, n, D] */
    float *dffn, *dpostF, *dcombF;   /* [N, D], [N, n], [N, n, n] */
    float *dxf, *dyF;                /* [N, D] */
    float *dattn, *dpostA, *dcombA;  /* [N, D], [N, n], [N, n, n] */
    float *dz, *do_, *dq, *dkv, *dkvc; /* [N, G·R], [N, H, hd] ×2, [N, hd], [B, Nc, hd] */
    float *dqr;                      /* [N, QR] */
    float *dxa, *dyA;                /* [N, D] */
    /* not owned */
    const float *dX_out;             /* [N, n, D] */
    float *dX_in;                    /* [N, n, D] accumulated */
    double *kl_sum;                  /* the indexer KL of the block (CSA) */
    int64_t *kl_rows;
} block_grads;

typedef ds4_status (*unit_fwd_fn)(const block_ctx *bc, block_acts *a);
typedef ds4_status (*unit_bwd_fn)(const block_ctx *bc, block_acts *a, block_grads *g);
typedef ds4_status (*unit_decode_fn)(const block_ctx *bc, block_acts *a, unit_cache *kc);

typedef enum { ON_EVERY_LAYER = 0, ON_COMPRESSED /* ratio > 0 */, ON_CSA /* ratio 4 */ } unit_layers;

/* The declaration of a unit: the single place that says what it reads, saves and does. */
typedef struct {
    const char *name;
    unit_layers on;          /* layers it runs on (elsewhere it holds nothing and does nothing) */
    uint32_t inputs;         /* UNIT_BIT()s of the units whose outputs fwd reads (and the block input) */
    const act_slot *outs;    /* [nouts] saved outputs, allocated before fwd in this order */
    int nouts;
    unit_fwd_fn prepare;     /* before the outputs are allocated (data-dependent shapes), or NULL */
    unit_fwd_fn fwd;         /* fills the outputs from the inputs (the first run and every replay) */
    unit_bwd_fn bwd;         /* NULL: differentiated inside another unit's backward */
    unit_decode_fn decode;   /* the cached decoder's variant (one position, reads the layer's cache) or NULL:
                              * fwd on one position serves */
    uint32_t bwd_reads;      /* UNIT_BIT()s of the units whose outputs bwd reads */
    void (*discard)(block_acts *a); /* frees what prepare made, or NULL */
} unit_decl;

extern const unit_decl unit_hc_pre_attn, unit_attn_norm, unit_q_down, unit_q_up, unit_kv, unit_compressor,
    unit_indexer, unit_indexer_topk, unit_sparse_attn, unit_o_proj, unit_hc_post_attn, unit_hc_pre_ffn,
    unit_ffn_norm, unit_router, unit_moe, unit_hc_post_ffn;

/* The block: its units in forward order, and the order of their backwards (block.c). */
extern const unit_decl *const k_block_units[U_COUNT];
extern const unit_id k_block_bwd_order[];
extern const int k_block_bwd_steps;

/* Whether slot s of unit u is held as bf16 from its unit's run on (ACT_BF16 under mixed precision). */
static inline bool act_held_bf16(const block_acts *a, unit_id u, int s) {
    return a->bf16 && s < k_block_units[u]->nouts && k_block_units[u]->outs[s].dtype == ACT_BF16;
}

const char *unit_name(unit_id u);
const char *unit_owner(unit_id u); /* the owner its buffers are counted under (ds4/core.h): its name */
bool unit_runs_here(unit_id u, const block_acts *a);
/* Compressed entries per sequence of a layer of compress ratio `ratio` (0: none). */
static inline int64_t block_nc(int64_t T, int64_t ratio) { return ratio > 0 ? T / ratio : 0; }
/* The units a training block releases of a recompute mask: never hc_post_ffn, whose output is the pass's. */
static inline uint32_t block_release_mask(uint32_t mask) { return mask & ~UNIT_BIT(U_HC_POST_FFN); }

/* ------------------------------------------------------------------ saved unit outputs (unit_acts.c) */
/* Runs unit u's forward: prepare, allocate its outputs from the declaration, fwd (or, given the cache
 * of the decoder, the unit's decode variant when it has one). */
ds4_status act_run(const block_ctx *bc, block_acts *a, unit_id u);
ds4_status act_run_cached(const block_ctx *bc, block_acts *a, unit_id u, unit_cache *kc);
/* Releases every masked unit whose last forward reader is u (u has just run); under mixed precision
 * the others of them are held as bf16 from here on. */
ds4_status act_release_after_fwd(const block_ctx *bc, block_acts *a, unit_id u);
/* Makes the outputs of every unit in `units` present, replaying released ones (inputs first) and
 * widening those held as bf16. */
ds4_status act_need(const block_ctx *bc, block_acts *a, uint32_t units);
/* Frees the outputs whose last backward reader is backward step `step` of k_block_bwd_order. */
void act_free_after_bwd(block_acts *a, int step);
void block_acts_free(block_acts *a);
/* Mixed precision: *buf [n] (DS4_MEM_ACT) replaced by its bf16 form (to_bf16: 2-byte bits of values already
 * rounded, exact) or widened back to floats; the old buffer is freed. DS4_ERR_OOM (no message) leaves it. */
ds4_status act_convert_bf16(const ds4_exec *ex, void **buf, int64_t n, bool to_bf16);
/* Bytes held by one unit's outputs. */
int64_t act_unit_bytes(const block_acts *a, unit_id u);

/* ------------------------------------------------------------------ shared by the units */
float *work_zeros(const block_ctx *bc, int64_t n); /* [n] zeroed workspace, on the model's backend */
float *work(const block_ctx *bc, int64_t n);       /* [n] workspace, on the model's backend */
void work_free(const block_ctx *bc, void *p);      /* releases work / work_zeros (NULL: nothing) */
const ds4_rope *block_rope(const block_ctx *bc, int64_t ratio); /* the main or the compressed rope */
ds4_rope rope_view(const ds4_rope *r, int64_t pos); /* the table seen from position pos, one row long */
float attn_scale(const ds4_config *c);
float indexer_wscale(const ds4_config *c);
/* An attention kernel returns no status: an allocation failing inside it (the failure count moved
 * since `before`) left a poisoned or empty result, so the unit fails. */
ds4_status kernel_status(int64_t before, const char *what);
/* The top-k list sparse attention reads (NULL: all usable entries). */
const int32_t *attn_selection(const block_ctx *bc, const block_acts *a);

/* Shorthands every unit uses. */
#define UNIT_PROLOGUE                                                                            \
    ds4_model *m = bc->m;                                                                        \
    const ds4_config *c = &m->cfg;                                                               \
    const block_w *W = &m->w.blocks[bc->layer];                                                  \
    block_w *Gw = &m->g.blocks[bc->layer];                                                       \
    const int64_t B = bc->B, T = bc->T, N = B * T, D = c->dim, n = c->hc_mult;                    \
    const float eps = (float)c->norm_eps;                                                        \
    (void)W; (void)Gw; (void)B; (void)T; (void)N; (void)D; (void)n; (void)eps

/* ------------------------------------------------------------------ the block */
/* X_out: [N, n, D] from X_in: [N, n, D] (both owned by the caller, X_in kept until backward).
 * Forward-only passes compute the indexer KL here (kl_sum/kl_rows); training passes in backward. */
ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, uint32_t release_mask,
                     unit_stats *stats, int64_t *expert_load, double *kl_sum, int64_t *kl_rows);
/* dX_in += ∂/∂X_in given dX_out; parameter gradients accumulate into the model. Returns the indexer
 * KL of the layer (computed here from the saved lse). Frees the block's activations. */
ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *dX_out, float *dX_in, double *kl_sum,
                     int64_t *kl_rows);

#endif
