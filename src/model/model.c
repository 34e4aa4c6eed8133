/* The whole model, forward and backward (docs/dsv4-architecture.md §2, §2.1; docs/contract.md):
 *   X0 = repeat(embed[ids], n) → blocks → hc_head → norm → head → CE (loss)
 *   MTP: e_proj(enorm(embed[ids_next])) + h_proj(hnorm(X_L)) → MTP block → hc_head → norm → head → CE (mtp_loss)
 *   indexer_loss: Σ over CSA layers of the mean KL over its rows.                                        */
#include "model/block.h"

#include <math.h>
#include <string.h>

/* Head of the main model or of the MTP block: y = hc_head(X), yn = norm(y), logits = head·yn. */
typedef struct {
    float *mixes, *rsqrt; /* [N, n], [N] */
    float *y, *rstd, *yn; /* [N, D], [N], [N, D] */
    float *logits;        /* [N, V] */
    int32_t *targets;     /* [N], −1 = not scored */
} head_acts;

/* The scalars the kernels produce during a pass, in one buffer on the model's backend: the cross-entropy
 * sums of the two heads and each layer's indexer KL. The host reads them once per pass direction, at one
 * named point (read_scalars), into the pass's copy. */
typedef struct {
    double loss_sum[2];                 /* main head, MTP head */
    int64_t n_scored[2];
    double kl_sum[DS4_MAX_LAYERS];      /* each layer's indexer KL (written once per forward-only or backward) */
    int64_t kl_rows[DS4_MAX_LAYERS];
    double discard_sum;                 /* the backward's cross-entropy sums, not needed again */
    int64_t discard_count;
} pass_scalars;

struct ds4_pass {
    ds4_model *m;
    ds4_pass_opts opts;
    int64_t B, T, N;
    int32_t *ids, *ids_next;  /* [N] */
    float **X;                /* [n_layers + 1] boundary streams, [N, n, D] each */
    bool X_bf16[DS4_MAX_LAYERS]; /* mixed precision: X[l] held as bf16 (uint16_t) until block l's backward */
    block_acts *ba;           /* [n_blocks] */
    head_acts head, mhead;
    /* MTP input */
    float *m_e, *m_en, *m_en_rstd; /* [N, D], [N, D], [N] */
    float *m_hn, *m_hn_rstd;       /* [N, n, D], [N·n] */
    float *m_X0, *m_X1;            /* [N, n, D] MTP block input / output */
    int64_t *expert_load;     /* [n_blocks, E] on the model's backend: the routing's counts, added by a kernel */
    int64_t *expert_load_got; /* [n_blocks, E] the host's copy (read_scalars) */
    unit_stats *unit_stats;   /* [n_blocks, U_COUNT] */
    int32_t *topk_kept[DS4_MAX_LAYERS]; /* keep_logits: [N, index_topk] copies of top-k lists recompute released */
    pass_scalars *scal;       /* on the model's backend: written by the kernels */
    pass_scalars got;         /* the host's copy, as of the last read_scalars */
    ds4_losses losses;
    bool backward_done;
    /* The stage it runs (ds4_stage): decoder layers [l0, l1), the embedding before them, the heads after.
     * Kept in the tail padding: the pass's counted bytes (memplan's "other") stay those of a whole pass.
     * After the backward of a stage without the embedding (grad_ready), X[l0] holds ∂/∂X[l0] [N, n, D]
     * instead of the stream, which nothing reads any more. A head stage that hands its MTP rows' gradient on
     * (rows_out, ds4_stage.mtp_rows_out) holds it in m_e [N, D] after its backward, the rows being read no
     * more. Bit-fields: the flags stay in the bytes of tail padding they had. */
    bool embed : 1, has_head : 1, grad_ready : 1, rows_out : 1;
    uint16_t l0, l1;
};
_Static_assert(DS4_MAX_LAYERS <= UINT16_MAX, "a stage's layer bounds are uint16_t");

static float *pass_alloc(const ds4_pass *p, int64_t n) {
    return dev_alloc(p->m, DS4_MEM_ACT, (size_t)n * sizeof(float));
}
static float *pass_work(const ds4_pass *p, int64_t n) { return dev_zalloc(p->m, DS4_MEM_WORK, (size_t)n * sizeof(float)); }

/* Owners of the pass's own buffers outside the blocks (memplan --memory-report). */
#define OWNER_STREAM_GRADS "backward: stream gradients"
#define OWNER_HEAD "head backward"
#define OWNER_MTP_INPUT "MTP input"
#define OWNER_EMBED "embedding backward"

static void head_free(const ds4_pass *p, head_acts *h) {
    dev_free(p->m, h->mixes);
    dev_free(p->m, h->rsqrt);
    dev_free(p->m, h->y);
    dev_free(p->m, h->rstd);
    dev_free(p->m, h->yn);
    dev_free(p->m, h->logits);
    dev_free(p->m, h->targets);
    memset(h, 0, sizeof *h);
}

/* The one point where the pass's scalars reach the host: after the forward (with the expert loads), and
 * after the backward. The host waits for the backend here, so here its ops' first failure, if any, comes
 * back as the pass's status. */
static ds4_status read_scalars(ds4_pass *p, bool loads) {
    const ds4_config *c = &p->m->cfg;
    copy_to_host(&p->m->exec, &p->got, p->scal, sizeof p->got);
    if (loads)
        copy_to_host(&p->m->exec, p->expert_load_got, p->expert_load,
                     (size_t)(n_blocks(c) * c->n_routed_experts) * sizeof(int64_t));
    synchronize(&p->m->exec);
    return ops_status(&p->m->exec);
}

void ds4_pass_free(ds4_pass *p) {
    if (!p) return;
    const ds4_config *c = &p->m->cfg;
    const ds4_act_store *as = &p->opts.store;
    for (int64_t l = p->l0; as->ops && l < p->l1; l++) as->ops->release(as->ctx, l, DS4_UNIT_INPUT, 0);
    if (p->X)
        for (int64_t l = 0; l <= c->n_layers; l++) dev_free(p->m, p->X[l]);
    ds4_free(p->X);
    if (p->ba)
        for (int64_t l = 0; l < n_blocks(c); l++) block_acts_free(&p->ba[l]);
    ds4_free(p->ba);
    head_free(p, &p->head);
    head_free(p, &p->mhead);
    dev_free(p->m, p->ids);
    dev_free(p->m, p->ids_next);
    dev_free(p->m, p->m_e);
    dev_free(p->m, p->m_en);
    dev_free(p->m, p->m_en_rstd);
    dev_free(p->m, p->m_hn);
    dev_free(p->m, p->m_hn_rstd);
    dev_free(p->m, p->m_X0);
    dev_free(p->m, p->m_X1);
    dev_free(p->m, p->scal);
    dev_free(p->m, p->expert_load);
    ds4_free(p->expert_load_got);
    ds4_free(p->unit_stats);
    for (int64_t l = 0; l < c->n_layers; l++) ds4_free(p->topk_kept[l]);
    ds4_free(p);
}

const ds4_losses *ds4_pass_losses(const ds4_pass *p) { return &p->losses; }
const float *ds4_pass_stream_out(const ds4_pass *p) { return p->has_head ? NULL : p->X[p->l1]; }
const float *ds4_pass_stream_grad(const ds4_pass *p) { return p->grad_ready ? p->X[p->l0] : NULL; }
const float *ds4_pass_mtp_rows_grad(const ds4_pass *p) {
    return p->rows_out && p->backward_done && p->m->cfg.n_mtp_layers > 0 ? p->m_e : NULL;
}
const float *ds4_pass_logits(const ds4_pass *p) { return p->opts.keep_logits ? p->head.logits : NULL; }
const float *ds4_pass_mtp_logits(const ds4_pass *p) { return p->opts.keep_logits ? p->mhead.logits : NULL; }
const int32_t *ds4_pass_topk(const ds4_pass *p, int64_t layer) {
    if (layer < 0 || layer >= p->m->cfg.n_layers) return NULL;
    const int32_t *held = p->ba[layer].out[U_INDEXER_TOPK][TOPK_SEL];
    return held ? held : p->topk_kept[layer];
}
const int64_t *ds4_pass_expert_load(const ds4_pass *p, int64_t layer) {
    return p->expert_load_got + layer * p->m->cfg.n_routed_experts;
}

/* A rope table built on the host moved to the model's backend, where the kernels read it. */
static bool rope_to_device(ds4_model *m, ds4_rope *r) {
    const size_t bytes = (size_t)(r->max_pos * (r->rd / 2)) * sizeof(float);
    float *cs = dev_alloc(m, DS4_MEM_OTHER, bytes), *sn = dev_alloc(m, DS4_MEM_OTHER, bytes);
    if (cs && sn) {
        copy_to_device(&m->exec, cs, r->cos, bytes);
        copy_to_device(&m->exec, sn, r->sin, bytes);
        synchronize(&m->exec);
    }
    rope_table_free(r);
    r->cos = cs;
    r->sin = sn;
    return cs && sn;
}

void model_rope_free(ds4_model *m, ds4_rope *r) {
    dev_free(m, r->cos);
    dev_free(m, r->sin);
    r->cos = r->sin = NULL;
}

/* Rope tables cover positions [0, T). */
static ds4_status ensure_rope(ds4_model *m, int64_t T) {
    if (m->rope_len >= T) return DS4_OK;
    const ds4_config *c = &m->cfg;
    model_rope_free(m, &m->rope_main);
    model_rope_free(m, &m->rope_cmp);
    m->rope_len = 0;
    bool ok = rope_table_init(&m->rope_main, c->rope_head_dim, T, c->rope_theta, 1.0, 0, 0, 0) &&
              rope_to_device(m, &m->rope_main);
    ok = ok && rope_table_init(&m->rope_cmp, c->rope_head_dim, T, c->compress_rope_theta, c->rope_factor,
                               c->original_seq_len, c->beta_fast, c->beta_slow) &&
         rope_to_device(m, &m->rope_cmp);
    if (!ok) {
        model_rope_free(m, &m->rope_main); /* no half-built pair stays behind */
        model_rope_free(m, &m->rope_cmp);
        return ds4_fail(DS4_ERR_OOM, "out of memory building rope tables");
    }
    m->rope_len = T;
    return DS4_OK;
}

static block_ctx make_ctx(ds4_pass *p, int64_t layer, const int32_t *ids) {
    return (block_ctx){.m = p->m,
                       .layer = layer,
                       .B = p->B,
                       .T = p->T,
                       .ids = ids,
                       .dense_csa = p->opts.csa_dense || p->m->cfg.csa_dense,
                       .keep = p->opts.need_backward,
                       .bf16_acts = p->opts.bf16_acts,
                       .ep = p->opts.hooks ? p->opts.hooks->ep : NULL,
                       .force_balance = p->opts.moe_force_balance,
                       .rope_main = &p->m->rope_main,
                       .rope_cmp = &p->m->rope_cmp};
}

/* The activation store's policy for (layer l, unit u); KEEP without a store. */
static ds4_act_policy act_policy(const ds4_pass *p, int64_t l, int u) {
    const ds4_act_store *as = &p->opts.store;
    return as->ops ? as->ops->policy(as->ctx, l, u) : DS4_ACT_KEEP;
}

/* The units of main layer l the store recomputes (the mask the block's saved outputs follow). */
static ds4_status recompute_mask(const ds4_pass *p, int64_t l, uint32_t *mask) {
    *mask = 0;
    for (int u = 0; u < U_COUNT; u++) {
        const ds4_act_policy pol = act_policy(p, l, u);
        if (pol == DS4_ACT_SWAP)
            return ds4_fail(DS4_ERR_ARG, "activation store: unit %s of layer %lld cannot be swapped (only a layer's "
                            "input)", unit_name((unit_id)u), (long long)l);
        if (pol == DS4_ACT_RECOMPUTE) *mask |= UNIT_BIT(u);
    }
    return DS4_OK;
}

/* A caller that keeps the logits (debug-state) also gets every CSA layer's top-k, whatever the
 * recompute policy: when the layer's mask releases it, block_fwd copies it to topk_kept first. */
static ds4_status keep_released_topk(ds4_pass *p, int64_t l, uint32_t mask, block_ctx *bc) {
    const ds4_config *c = &p->m->cfg;
    if (!p->opts.keep_logits || !p->opts.need_backward || !(mask & UNIT_BIT(U_INDEXER_TOPK)) ||
        ds4_layer_ratio(c, l) != 4)
        return DS4_OK;
    p->topk_kept[l] = ds4_alloc(DS4_MEM_OTHER, (size_t)(p->N * c->index_topk) * sizeof(int32_t));
    if (!p->topk_kept[l]) return ds4_fail(DS4_ERR_OOM, "out of memory keeping the top-k of layer %lld", (long long)l);
    bc->topk_copy = p->topk_kept[l];
    return DS4_OK;
}

/* Parallel wrappers (ds4_param_hooks): no hooks means the whole model is resident. */
static ds4_status gather(ds4_pass *p, int64_t group) {
    const ds4_param_hooks *h = p->opts.hooks;
    return h && h->gather ? h->gather(h->ctx, group) : DS4_OK;
}
static void drop(ds4_pass *p, int64_t group) {
    const ds4_param_hooks *h = p->opts.hooks;
    if (h && h->drop) h->drop(h->ctx, group);
}
static ds4_status grad_begin(ds4_pass *p, int64_t group) {
    const ds4_param_hooks *h = p->opts.hooks;
    return h && h->grad_begin ? h->grad_begin(h->ctx, group) : DS4_OK;
}
static ds4_status grad_end(ds4_pass *p, int64_t group) {
    const ds4_param_hooks *h = p->opts.hooks;
    return h && h->grad_end ? h->grad_end(h->ctx, group) : DS4_OK;
}
static ds4_status hooks_sync(ds4_pass *p) {
    const ds4_param_hooks *h = p->opts.hooks;
    return h && h->sync ? h->sync(h->ctx) : DS4_OK;
}
/* The order in which a pass (of its stage) gathers weights, position k -> group (-1 past the end).
 * Forward: the embedding, the layers, the head, then the MTP block and the embedding again (its input).
 * Backward: the head, the MTP block, the layers from the last. */
static int64_t fwd_order(const ds4_pass *p, int64_t k) {
    const ds4_config *c = &p->m->cfg;
    const int64_t mtp = c->n_mtp_layers > 0, nl = p->l1 - p->l0;
    if (p->embed && k-- == 0) return 0;
    if (k < nl) return group_of_layer(p->l0 + k);
    k -= nl;
    if (!p->has_head) return -1;
    if (k == 0) return group_head(c);
    if (mtp && k == 1) return group_mtp(c);
    if (mtp && k == 2) return 0;
    return -1;
}
static int64_t bwd_order(const ds4_pass *p, int64_t k) {
    const ds4_config *c = &p->m->cfg;
    const int64_t mtp = c->n_mtp_layers > 0, nl = p->l1 - p->l0;
    if (p->has_head) {
        if (k == 0) return group_head(c);
        if (mtp && k == 1) return group_mtp(c);
        k -= 1 + mtp;
    }
    return k < nl ? group_of_layer(p->l1 - 1 - k) : -1;
}
/* Positions in those orders: of layer l's gather in the forward and in the backward, and of the head's
 * gather in the forward (the MTP block's and the embedding's follow it). */
static int64_t fwd_pos_layer(const ds4_pass *p, int64_t l) { return p->embed + (l - p->l0); }
static int64_t fwd_pos_head(const ds4_pass *p) { return p->embed + (p->l1 - p->l0); }
static int64_t bwd_pos_layer(const ds4_pass *p, int64_t l) {
    return (p->has_head ? 1 + (p->m->cfg.n_mtp_layers > 0) : 0) + (p->l1 - 1 - l);
}
/* After the gather at position pos of an order: the groups that follow, for the wrapper to prefetch. */
static ds4_status hint_next(ds4_pass *p, bool backward, int64_t pos) {
    const ds4_param_hooks *h = p->opts.hooks;
    if (!h || !h->prefetch) return DS4_OK;
    int64_t next[DS4_HOOK_AHEAD], n = 0;
    for (int64_t g; n < DS4_HOOK_AHEAD; n++) {
        g = backward ? bwd_order(p, pos + 1 + n) : fwd_order(p, pos + 1 + n);
        if (g < 0) break;
        next[n] = g;
    }
    return n ? h->prefetch(h->ctx, next, n) : DS4_OK;
}
/* A gather at position pos of the forward order, and the hint of what follows. */
static ds4_status gather_fwd(ds4_pass *p, int64_t group, int64_t pos) {
    DS4_TRY(gather(p, group));
    return hint_next(p, false, pos);
}
/* Layer inputs the store swaps: the block that reads stream X[l] as input, and the one that wrote it,
 * must see where it lives now. */
static void stream_rebind(ds4_pass *p, int64_t l) {
    p->ba[l].X_in = p->X[l];
    if (l > p->l0) p->ba[l - 1].X_out = p->X[l]; /* the block before the stage's first is another stage's */
}
static int64_t stream_numel(const ds4_pass *p) { return p->N * p->m->cfg.hc_mult * p->m->cfg.dim; }
/* Bytes of X[l] as held now: 2 per element while it is bf16. */
static size_t stream_bytes(const ds4_pass *p, int64_t l) {
    return (size_t)stream_numel(p) * (p->X_bf16[l] ? sizeof(uint16_t) : sizeof(float));
}

/* Mixed precision: the residual streams are bf16 values (rounded as soon as they are made, so the next
 * block, the head and every replay read the same values) and held as bf16 between a block's forward and
 * its backward. */
static void stream_round(ds4_pass *p, int64_t l) {
    if (p->opts.bf16_acts) tensor_round_bf16(&p->m->exec, p->X[l], stream_numel(p));
}

static ds4_status stream_convert(ds4_pass *p, int64_t l, bool to_bf16) {
    if (act_convert_bf16(&p->m->exec, (void **)&p->X[l], stream_numel(p), to_bf16) != DS4_OK)
        return ds4_fail(DS4_ERR_OOM, "out of memory converting layer %lld's input stream", (long long)l);
    p->X_bf16[l] = to_bf16;
    stream_rebind(p, l);
    return DS4_OK;
}

/* After block l's forward, its last reader of X[l]. */
static ds4_status act_offload(ds4_pass *p, int64_t l) {
    const ds4_act_store *as = &p->opts.store;
    if (!p->opts.need_backward) return DS4_OK;
    if (p->opts.bf16_acts) DS4_TRY(stream_convert(p, l, true));
    if (act_policy(p, l, DS4_UNIT_INPUT) != DS4_ACT_SWAP) return DS4_OK;
    ds4_status st = as->ops->save(as->ctx, l, DS4_UNIT_INPUT, 0, (void **)&p->X[l], stream_bytes(p, l));
    stream_rebind(p, l);
    return st;
}
/* Before block l's backward (and its replays), the first reader of X[l] in backward. */
static ds4_status act_restore(ds4_pass *p, int64_t l) {
    const ds4_act_store *as = &p->opts.store;
    ds4_status st = DS4_OK;
    if (act_policy(p, l, DS4_UNIT_INPUT) == DS4_ACT_SWAP) {
        st = as->ops->fetch(as->ctx, l, DS4_UNIT_INPUT, 0, (void **)&p->X[l], stream_bytes(p, l));
        stream_rebind(p, l);
        if (st == DS4_OK && !p->X[l])
            st = ds4_fail(DS4_ERR_INTERNAL, "activation store: layer %lld's input stream did not come back",
                          (long long)l);
    }
    if (st == DS4_OK && p->X_bf16[l]) st = stream_convert(p, l, false);
    return st;
}

/* Weights and a gradient buffer of a group, for its backward (position pos of the backward order). */
static ds4_status gather_for_backward(ds4_pass *p, int64_t group, int64_t pos) {
    DS4_TRY(gather(p, group));
    DS4_TRY(hint_next(p, true, pos));
    return grad_begin(p, group);
}
/* After a group's backward: the router bias is not trained by gradients; reduce; drop the weights. */
static ds4_status finish_backward(ds4_pass *p, int64_t group) {
    const ds4_config *c = &p->m->cfg;
    int64_t l = group == group_mtp(c) ? c->n_layers : group - 1;
    if (l >= 0 && l < n_blocks(c) && group != group_head(c) && p->m->g.blocks[l].gate_bias)
        tensor_zero(&p->m->exec, p->m->g.blocks[l].gate_bias, (size_t)c->n_routed_experts * sizeof(float));
    ds4_status st = grad_end(p, group);
    drop(p, group);
    return st;
}

/* ------------------------------------------------------------------ head, forward / backward */
static ds4_status head_fwd(ds4_pass *p, head_acts *h, const float *X, const float *fn, const float *scale,
                           const float *base, const float *normw, int64_t shift) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult, V = c->vocab_size;
    h->mixes = pass_alloc(p, N * n);
    h->rsqrt = pass_alloc(p, N);
    h->y = pass_alloc(p, N * D);
    h->rstd = pass_alloc(p, N);
    h->yn = pass_alloc(p, N * D);
    h->logits = pass_alloc(p, N * V);
    h->targets = dev_alloc(m, DS4_MEM_ACT, (size_t)N * sizeof(int32_t));
    if (!h->mixes || !h->rsqrt || !h->y || !h->rstd || !h->yn || !h->logits || !h->targets)
        return ds4_fail(DS4_ERR_OOM, "out of memory in the head forward");
    hc_head_fwd(&p->m->exec, &(hc_head_args){.dims = {.N = N, .n = n, .D = D}, .hc_eps = (float)c->hc_eps,
        .norm_eps = (float)c->norm_eps, .X = X, .fn = fn, .scale = scale, .base = base, .y = h->y, .mixes = h->mixes,
        .rsqrt = h->rsqrt});
    rmsnorm_fwd(&p->m->exec, h->yn, h->rstd, h->y, normw, N, D, (float)c->norm_eps);
    model_linear_fwd(m, h->logits, h->yn, m->w.head, N, D, V);
    /* position t predicts ids[t + shift] */
    shift_ids(&p->m->exec, h->targets, p->ids, p->B, p->T, shift, -1);
    const int k = h == &p->mhead; /* the head's slot of the pass's scalars */
    cross_entropy_fwd_bwd(&p->m->exec, &p->scal->loss_sum[k], &p->scal->n_scored[k], NULL, h->logits, h->targets, N, V,
                          0.0f);
    return DS4_OK;
}

/* dX += ∂(weight · mean CE)/∂X; head/norm/hc_head gradients accumulate. The logits' gradient [N, V] overwrites
 * the logits, which nothing reads after this (the pass frees them next, keep_logits or not), so the backward
 * holds no second [N, V]. */
static ds4_status head_bwd(ds4_pass *p, head_acts *h, const float *X, float *dX, double weight, float *g_fn,
                           float *g_scale, float *g_base, float *g_norm, const float *fn, const float *scale,
                           const float *base, const float *normw) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult, V = c->vocab_size;
    const char *prev = ds4_mem_owner_enter(OWNER_HEAD);
    float *dlogits = h->logits; /* [N, V], in place */
    float *dyn = pass_work(p, N * D);
    float *dy = pass_work(p, N * D);
    ds4_status st = DS4_OK;
    if (!dlogits || !dyn || !dy) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory in the head backward");
        goto done;
    }
    const int64_t scored = p->got.n_scored[h == &p->mhead]; /* read after the forward */
    float gscale = scored > 0 ? (float)(weight / (double)scored) : 0.0f;
    cross_entropy_fwd_bwd(&p->m->exec, &p->scal->discard_sum, &p->scal->discard_count, dlogits, h->logits, h->targets,
                          N, V, gscale);
    model_linear_bwd(m, dyn, m->g.head, dlogits, h->yn, m->w.head, N, D, V);
    rmsnorm_bwd(&p->m->exec, dy, g_norm, dyn, h->y, normw, h->rstd, N, D);
    hc_head_bwd(&p->m->exec, &(hc_head_args){.dims = {.N = N, .n = n, .D = D}, .hc_eps = (float)c->hc_eps,
        .norm_eps = (float)c->norm_eps, .X = X, .fn = fn, .scale = scale, .base = base, .mixes = h->mixes,
        .rsqrt = h->rsqrt}, &(hc_head_grads){.dy = dy, .dX = dX, .dfn = g_fn, .dscale = g_scale, .dbase = g_base});
done:
    dev_free(m, dyn);
    dev_free(m, dy);
    ds4_mem_owner_leave(prev);
    return st;
}

/* ------------------------------------------------------------------ MTP input */
static ds4_status mtp_input_fwd(ds4_pass *p) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult;
    const float eps = (float)c->norm_eps;
    p->m_e = pass_alloc(p, N * D);
    p->m_en = pass_alloc(p, N * D);
    p->m_en_rstd = pass_alloc(p, N);
    p->m_hn = pass_alloc(p, N * n * D);
    p->m_hn_rstd = pass_alloc(p, N * n);
    p->m_X0 = pass_alloc(p, N * n * D);
    p->m_X1 = pass_alloc(p, N * n * D);
    float *ep = dev_alloc(m, DS4_MEM_WORK, (size_t)(N * D) * sizeof(float));
    if (!p->m_e || !p->m_en || !p->m_en_rstd || !p->m_hn || !p->m_hn_rstd || !p->m_X0 || !p->m_X1 || !ep) {
        dev_free(m, ep);
        return ds4_fail(DS4_ERR_OOM, "out of memory in the MTP input");
    }
    embedding_fwd(&p->m->exec, p->m_e, m->w.embed, p->ids_next, N, D);
    rmsnorm_fwd(&p->m->exec, p->m_en, p->m_en_rstd, p->m_e, m->w.enorm, N, D, eps);
    model_linear_fwd(m, ep, p->m_en, m->w.e_proj, N, D, D);
    rmsnorm_fwd(&p->m->exec, p->m_hn, p->m_hn_rstd, p->X[c->n_layers], m->w.hnorm, N * n, D, eps);
    model_linear_fwd(m, p->m_X0, p->m_hn, m->w.h_proj, N * n, D, D);
    streams_add(&p->m->exec, p->m_X0, ep, N, n, D);
    dev_free(m, ep);
    return DS4_OK;
}

/* dXL += ∂/∂X_L from the MTP input's gradient dX0; enorm/e_proj/hnorm/h_proj grads accumulate; de [N, D]:
 * the gradient of the embedded rows embed[ids_next], scattered into the embedding's gradient by the caller.
 * dhn [N, n, D]: a buffer the caller no longer needs (the MTP block's output gradient), zeroed here. */
static ds4_status mtp_input_bwd(ds4_pass *p, const float *dX0, float *dXL, float *de, float *dhn) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult;
    float *dep = pass_work(p, N * D);
    float *den = pass_work(p, N * D);
    tensor_zero(&m->exec, dhn, (size_t)(N * n * D) * sizeof(float));
    ds4_status st = DS4_OK;
    if (!dep || !den) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory in the MTP input backward");
        goto done;
    }
    streams_sum(&p->m->exec, dep, dX0, N, n, D);
    model_linear_bwd(m, den, m->g.e_proj, dep, p->m_en, m->w.e_proj, N, D, D);
    rmsnorm_bwd(&p->m->exec, de, m->g.enorm, den, p->m_e, m->w.enorm, p->m_en_rstd, N, D);
    model_linear_bwd(m, dhn, m->g.h_proj, dX0, p->m_hn, m->w.h_proj, N * n, D, D);
    rmsnorm_bwd(&p->m->exec, dXL, m->g.hnorm, dhn, p->X[c->n_layers], m->w.hnorm, p->m_hn_rstd, N * n, D);
done:
    dev_free(m, dep);
    dev_free(m, den);
    return st;
}

/* MTP input, block and head (the main head's weights are gathered by the caller). */
static ds4_status mtp_fwd(ds4_pass *p) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    int64_t l = c->n_layers;
    DS4_TRY(gather_fwd(p, group_mtp(c), fwd_pos_head(p) + 1));
    ds4_status st = gather_fwd(p, 0, fwd_pos_head(p) + 2);
    const char *prev = ds4_mem_owner_enter(OWNER_MTP_INPUT);
    if (st == DS4_OK) st = mtp_input_fwd(p);
    ds4_mem_owner_leave(prev);
    drop(p, 0);
    block_ctx bc = make_ctx(p, l, p->ids_next);
    if (st == DS4_OK)
        st = block_fwd(&bc, &p->ba[l], p->m_X0, p->m_X1, 0 /* never recompute MTP */, p->unit_stats + l * U_COUNT,
                       p->expert_load + l * c->n_routed_experts, &p->scal->kl_sum[l], &p->scal->kl_rows[l]);
    if (st == DS4_OK)
        st = head_fwd(p, &p->mhead, p->m_X1, m->w.mtp_hc_head_fn, m->w.mtp_hc_head_scale, m->w.mtp_hc_head_base,
                      m->w.mtp_norm, 2);
    drop(p, group_mtp(c));
    return st;
}

/* MTP backward: dXL += ∂(weighted mtp loss)/∂X_L. In an unmapped model *de [N, D] (allocated here)
 * is the gradient of the rows embed[ids_next], which the caller scatters into the embedding's gradient at
 * the end of the backward; else they are scattered here (*de stays NULL). The head group's gradients are
 * open (caller). */
static ds4_status mtp_bwd(ds4_pass *p, float *dXL, float **de) {
    ds4_model *m = p->m;
    const ds4_config *c = &m->cfg;
    const size_t sbytes = (size_t)(p->N * c->hc_mult * c->dim) * sizeof(float);
    const char *prev = ds4_mem_owner_enter(OWNER_STREAM_GRADS);
    float *dm1 = dev_zalloc(m, DS4_MEM_WORK, sbytes), *dm0 = dev_zalloc(m, DS4_MEM_WORK, sbytes);
    ds4_mem_owner_leave(prev);
    ds4_status st = dm1 && dm0 ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MTP backward");
    if (st == DS4_OK) st = gather_for_backward(p, group_mtp(c), 1);
    if (st == DS4_OK)
        st = head_bwd(p, &p->mhead, p->m_X1, dm1, c->mtp_loss_weight, m->g.mtp_hc_head_fn, m->g.mtp_hc_head_scale,
                      m->g.mtp_hc_head_base, m->g.mtp_norm, m->w.mtp_hc_head_fn, m->w.mtp_hc_head_scale,
                      m->w.mtp_hc_head_base, m->w.mtp_norm);
    head_free(p, &p->mhead);
    block_ctx bc = make_ctx(p, c->n_layers, p->ids_next);
    if (st == DS4_OK)
        st = block_bwd(&bc, &p->ba[c->n_layers], dm1, dm0, &p->scal->kl_sum[c->n_layers], &p->scal->kl_rows[c->n_layers]);
    /* An unmapped model (FSDP: grad_begin maps a group's gradients): the rows' gradient waits [N, D]
     * instead of the embedding's whole gradient [vocab, D] being mapped over every layer's backward;
     * scattered first at the end, the sums are those of scattering it here, which a model holding all
     * its gradients still does. */
    /* A stage handing them on (rows_out) keeps them too: the embedding's stage scatters them. */
    const bool wait = m->unmapped || p->rows_out;
    prev = ds4_mem_owner_enter(m->unmapped ? DS4_OWNER_GRAD_ROWS : OWNER_MTP_INPUT);
    float *rows = dev_zalloc(m, m->unmapped ? DS4_MEM_GRAD : DS4_MEM_WORK, (size_t)(p->N * c->dim) * sizeof(float));
    ds4_mem_owner_leave(prev);
    prev = ds4_mem_owner_enter(OWNER_MTP_INPUT);
    if (st == DS4_OK && !rows) st = ds4_fail(DS4_ERR_OOM, "out of memory in MTP backward");
    if (st == DS4_OK) st = mtp_input_bwd(p, dm0, dXL, rows, dm1); /* dm1: read by nothing after block_bwd */
    ds4_mem_owner_leave(prev);
    if (st == DS4_OK && !wait) embedding_bwd(&m->exec, m->g.embed, rows, p->ids_next, p->N, c->dim);
    if (wait) *de = rows;
    else dev_free(m, rows);
    if (st == DS4_OK) st = finish_backward(p, group_mtp(c));
    dev_free(m, dm1);
    dev_free(m, dm0);
    return st;
}

/* ------------------------------------------------------------------ pass */
static ds4_status check_ids(const ds4_config *c, const int32_t *ids, int64_t B, int64_t T) {
    for (int64_t i = 0; i < B * T; i++)
        if (ids[i] < 0 || ids[i] >= c->vocab_size)
            return ds4_fail(DS4_ERR_ARG, "input_ids[%lld, %lld] = %d is outside the vocabulary [0, %lld)",
                            (long long)(i / T), (long long)(i % T), ids[i], (long long)c->vocab_size);
    return DS4_OK;
}

/* After the backward: each CSA layer's KL scored the rows its gradient was scaled by (indexer_kl_rows). */
static ds4_status check_kl_rows(const ds4_pass *p) {
    const ds4_config *c = &p->m->cfg;
    const int64_t want = indexer_kl_rows(&p->m->exec, p->B, p->T, 4);
    for (int64_t l = p->l0; l < p->l1; l++)
        if (ds4_layer_ratio(c, l) == 4 && p->got.kl_rows[l] != want)
            return ds4_fail(DS4_ERR_INTERNAL, "indexer loss of layer %lld: %lld rows counted, %lld expected",
                            (long long)l, (long long)p->got.kl_rows[l], (long long)want);
    return DS4_OK;
}

double ds4_pass_layer_kl(const ds4_pass *p, int64_t layer) {
    if (layer < 0 || layer >= p->m->cfg.n_layers || p->got.kl_rows[layer] <= 0) return 0.0;
    return p->got.kl_sum[layer] / (double)p->got.kl_rows[layer];
}

ds4_losses ds4_losses_combine(const ds4_config *c, double loss, double mtp_loss, const double *layer_kl) {
    ds4_losses L = {.loss = loss, .mtp_loss = c->n_mtp_layers ? mtp_loss : 0.0};
    for (int64_t l = 0; l < c->n_layers; l++) L.indexer_loss += layer_kl[l]; /* in layer order */
    L.total_loss = L.loss + c->mtp_loss_weight * L.mtp_loss + c->indexer_loss_coeff * L.indexer_loss;
    return L;
}

/* The losses from the scalars the kernels wrote (read_scalars first): of the stage's heads and layers. */
static void finish_losses(ds4_pass *p) {
    const ds4_config *c = &p->m->cfg;
    const pass_scalars *g = &p->got;
    double kl[DS4_MAX_LAYERS];
    for (int64_t l = 0; l < c->n_layers; l++) kl[l] = ds4_pass_layer_kl(p, l);
    p->losses = ds4_losses_combine(c, g->n_scored[0] ? g->loss_sum[0] / (double)g->n_scored[0] : 0.0,
                                   g->n_scored[1] ? g->loss_sum[1] / (double)g->n_scored[1] : 0.0, kl);
}

/* A stage the model can run: its layers in order, the embedding only before layer 0, the heads only after
 * the last layer, an input stream where there is no embedding. */
static ds4_status check_stage(const ds4_model *m, const ds4_stage *s, const float *X_in) {
    const ds4_config *c = &m->cfg;
    if (s->layer_begin < 0 || s->layer_begin > s->layer_end || s->layer_end > c->n_layers)
        return ds4_fail(DS4_ERR_ARG, "stage: layers [%lld, %lld) are not a range of the model's %lld layers",
                        (long long)s->layer_begin, (long long)s->layer_end, (long long)c->n_layers);
    if (s->embedding && s->layer_begin != 0)
        return ds4_fail(DS4_ERR_ARG, "stage: the embedding runs before layer 0, not before layer %lld",
                        (long long)s->layer_begin);
    if (s->head && s->layer_end != c->n_layers)
        return ds4_fail(DS4_ERR_ARG, "stage: the head runs after the last layer %lld, not after layer %lld",
                        (long long)(c->n_layers - 1), (long long)(s->layer_end - 1));
    if (!s->embedding && !X_in)
        return ds4_fail(DS4_ERR_ARG, "stage: layers [%lld, %lld) without the embedding need an input stream",
                        (long long)s->layer_begin, (long long)s->layer_end);
    if (s->mtp_rows_out && (!s->head || s->embedding))
        return ds4_fail(DS4_ERR_ARG, "stage: only the head's stage without the embedding hands the MTP rows' gradient on");
    if (s->head && !s->embedding && c->n_mtp_layers > 0 && m->unmapped && !s->mtp_rows_out)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "stage: an unmapped model's MTP stage without the embedding (its rows' "
                        "gradient waits for the embedding's) hands the rows on (mtp_rows_out)");
    return DS4_OK;
}

ds4_status ds4_forward(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const ds4_pass_opts *opts,
                       ds4_pass **out) {
    const ds4_stage whole = {.layer_begin = 0, .layer_end = m->cfg.n_layers, .embedding = true, .head = true};
    return ds4_stage_forward(m, ids, B, T, opts, &whole, NULL, out);
}

ds4_status ds4_stage_forward(ds4_model *m, const int32_t *ids, int64_t B, int64_t T, const ds4_pass_opts *opts,
                             const ds4_stage *stage, const float *X_in, ds4_pass **out) {
    *out = NULL;
    const ds4_config *c = &m->cfg;
    if (B <= 0 || T < 2) return ds4_fail(DS4_ERR_ARG, "forward: need B >= 1 and T >= 2 (got B=%lld, T=%lld)",
                                         (long long)B, (long long)T);
    DS4_TRY(check_stage(m, stage, X_in));
    DS4_TRY(check_ids(c, ids, B, T));
    DS4_TRY(ensure_rope(m, T));
    ds4_pass *p = ds4_calloc(DS4_MEM_OTHER, sizeof *p);
    if (!p) return DS4_ERR_OOM;
    p->m = m;
    p->opts = *opts;
    p->B = B;
    p->T = T;
    p->N = B * T;
    p->l0 = (uint16_t)stage->layer_begin; /* checked: within [0, n_layers] */
    p->l1 = (uint16_t)stage->layer_end;
    p->embed = stage->embedding;
    p->has_head = stage->head;
    p->rows_out = stage->mtp_rows_out;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult, nb = n_blocks(c);
    ds4_status st = DS4_OK;
    p->ids = dev_alloc(m, DS4_MEM_ACT, (size_t)N * sizeof(int32_t));
    p->ids_next = dev_alloc(m, DS4_MEM_ACT, (size_t)N * sizeof(int32_t));
    p->X = ds4_calloc(DS4_MEM_OTHER, (size_t)(c->n_layers + 1) * sizeof(float *));
    p->ba = ds4_calloc(DS4_MEM_OTHER, (size_t)nb * sizeof(block_acts));
    p->expert_load = dev_zalloc(m, DS4_MEM_OTHER, (size_t)(nb * c->n_routed_experts) * sizeof(int64_t));
    p->expert_load_got = ds4_calloc(DS4_MEM_OTHER, (size_t)(nb * c->n_routed_experts) * sizeof(int64_t));
    p->unit_stats = ds4_calloc(DS4_MEM_OTHER, (size_t)(nb * U_COUNT) * sizeof(unit_stats));
    p->scal = dev_zalloc(m, DS4_MEM_OTHER, sizeof *p->scal);
    if (!p->ids || !p->ids_next || !p->X || !p->ba || !p->expert_load || !p->expert_load_got || !p->unit_stats ||
        !p->scal) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory starting the forward pass");
        goto fail;
    }
    copy_to_device(&m->exec, p->ids, ids, (size_t)N * sizeof(int32_t)); /* the batch crosses to the backend */
    shift_ids(&m->exec, p->ids_next, p->ids, B, T, 1, 0);

    /* the stage's input X[l0] [N, n, D]: the embedding into n identical streams, or the stream handed over */
    p->X[p->l0] = pass_alloc(p, N * n * D);
    if (!p->X[p->l0]) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory for the input stream of layer %lld", (long long)p->l0);
        goto fail;
    }
    if (p->embed) {
        if ((st = gather_fwd(p, 0, 0)) != DS4_OK) goto fail;
        embedding_fwd(&m->exec, p->X[0], m->w.embed, p->ids, N, D);
        drop(p, 0);
        streams_expand(&m->exec, p->X[0], N, n, D);
        stream_round(p, 0);
    } else {
        tensor_copy(&m->exec, p->X[p->l0], X_in, (size_t)(N * n * D) * sizeof(float)); /* rounded by its maker */
    }
    /* blocks */
    for (int64_t l = p->l0; l < p->l1 && st == DS4_OK; l++) {
        p->X[l + 1] = pass_alloc(p, N * n * D);
        if (!p->X[l + 1]) {
            st = ds4_fail(DS4_ERR_OOM, "out of memory for the streams of layer %lld", (long long)l);
            break;
        }
        block_ctx bc = make_ctx(p, l, p->ids);
        uint32_t mask;
        if ((st = recompute_mask(p, l, &mask)) != DS4_OK) break;
        if ((st = keep_released_topk(p, l, mask, &bc)) != DS4_OK) break;
        if ((st = gather_fwd(p, group_of_layer(l), fwd_pos_layer(p, l))) != DS4_OK) break;
        st = block_fwd(&bc, &p->ba[l], p->X[l], p->X[l + 1], mask, p->unit_stats + l * U_COUNT,
                       p->expert_load + l * c->n_routed_experts, &p->scal->kl_sum[l], &p->scal->kl_rows[l]);
        drop(p, group_of_layer(l));
        if (st == DS4_OK) stream_round(p, l + 1);
        if (st == DS4_OK && !opts->need_backward && l > p->l0) {
            dev_free(m, p->X[l]); /* eval: the previous boundary is no longer needed */
            p->X[l] = NULL;
        }
        if (st == DS4_OK) st = act_offload(p, l);
    }
    if (st != DS4_OK) goto fail;
    if (p->has_head) {
        /* the head (also the MTP head's output projection) stays gathered until the MTP head is done */
        if ((st = gather_fwd(p, group_head(c), fwd_pos_head(p))) != DS4_OK) goto fail;
        st = head_fwd(p, &p->head, p->X[c->n_layers], m->w.hc_head_fn, m->w.hc_head_scale, m->w.hc_head_base,
                      m->w.norm, 1);
        if (st == DS4_OK && c->n_mtp_layers > 0) st = mtp_fwd(p);
        drop(p, group_head(c));
    }
    if (st == DS4_OK) st = hooks_sync(p);
    if (st == DS4_OK) st = read_scalars(p, true);
    if (st != DS4_OK) goto fail;
    finish_losses(p);
    *out = p;
    return DS4_OK;
fail:
    (void)hooks_sync(p); /* nothing the wrapper started stays in flight */
    ds4_pass_free(p);
    return st;
}

ds4_status ds4_backward(ds4_model *m, ds4_pass *p) {
    if (!p->embed || !p->has_head)
        return ds4_fail(DS4_ERR_ARG, "backward: the pass is a stage of layers [%lld, %lld): ds4_stage_backward",
                        (long long)p->l0, (long long)p->l1);
    return ds4_stage_backward(m, p, NULL);
}

ds4_status ds4_stage_backward(ds4_model *m, ds4_pass *p, const float *dX_out) {
    return ds4_stage_backward_rows(m, p, dX_out, NULL);
}

ds4_status ds4_stage_backward_rows(ds4_model *m, ds4_pass *p, const float *dX_out, const float *mtp_rows) {
    const ds4_config *c = &m->cfg;
    if (!p->opts.need_backward || p->backward_done)
        return ds4_fail(DS4_ERR_ARG, "backward: the pass was not made for backward or was already used");
    if (!p->has_head && !dX_out)
        return ds4_fail(DS4_ERR_ARG, "backward: the stage of layers [%lld, %lld) without the head needs the gradient "
                        "of its output stream", (long long)p->l0, (long long)p->l1);
    if (mtp_rows && (!p->embed || p->has_head))
        return ds4_fail(DS4_ERR_ARG, "backward: only the embedding's stage without the head takes the MTP rows' "
                        "gradient");
    p->backward_done = true;
    const int64_t N = p->N, D = c->dim, n = c->hc_mult, L = c->n_layers;
    const size_t sbytes = (size_t)(N * n * D) * sizeof(float);
    ds4_status st = DS4_OK;
    const char *prev = ds4_mem_owner_enter(OWNER_STREAM_GRADS);
    float *dX = dev_zalloc(m, DS4_MEM_WORK, sbytes), *dprev = NULL;
    ds4_mem_owner_leave(prev);
    if (!dX) return ds4_fail(DS4_ERR_OOM, "out of memory in backward");
    /* the backward writes each layer's KL again */
    tensor_zero(&m->exec, p->scal->kl_sum, sizeof p->scal->kl_sum);
    tensor_zero(&m->exec, p->scal->kl_rows, sizeof p->scal->kl_rows);

    float *de_mtp = NULL; /* [N, D] the MTP input's embedded rows' gradient, scattered with the embedding's */
    if (p->has_head) {
        st = gather_for_backward(p, group_head(c), 0);
        if (st == DS4_OK)
            st = head_bwd(p, &p->head, p->X[L], dX, 1.0, m->g.hc_head_fn, m->g.hc_head_scale, m->g.hc_head_base,
                          m->g.norm, m->w.hc_head_fn, m->w.hc_head_scale, m->w.hc_head_base, m->w.norm);
        head_free(p, &p->head);
        if (st == DS4_OK && c->n_mtp_layers > 0) st = mtp_bwd(p, dX, &de_mtp);
        if (st == DS4_OK) st = finish_backward(p, group_head(c));
    } else {
        tensor_copy(&m->exec, dX, dX_out, sbytes); /* ∂/∂X[l1], from the next stage */
    }
    for (int64_t l = p->l1 - 1; l >= p->l0 && st == DS4_OK; l--) {
        prev = ds4_mem_owner_enter(OWNER_STREAM_GRADS);
        dprev = dev_zalloc(m, DS4_MEM_WORK, sbytes);
        ds4_mem_owner_leave(prev);
        if (!dprev) {
            st = ds4_fail(DS4_ERR_OOM, "out of memory in backward of layer %lld", (long long)l);
            break;
        }
        block_ctx bc = make_ctx(p, l, p->ids);
        st = act_restore(p, l);
        if (st == DS4_OK) st = gather_for_backward(p, group_of_layer(l), bwd_pos_layer(p, l));
        if (st == DS4_OK) st = block_bwd(&bc, &p->ba[l], dX, dprev, &p->scal->kl_sum[l], &p->scal->kl_rows[l]);
        if (st == DS4_OK) st = finish_backward(p, group_of_layer(l));
        dev_free(m, p->X[l + 1]);
        p->X[l + 1] = NULL;
        dev_free(m, dX);
        dX = dprev;
        dprev = NULL;
    }
    if (st == DS4_OK && !p->embed) {
        dev_free(m, p->X[p->l0]); /* ∂/∂X[l0] takes the stream's place, for the previous stage */
        p->X[p->l0] = dX;
        p->X_bf16[p->l0] = false;
        p->grad_ready = true;
        dX = NULL;
    } else if (st == DS4_OK) {
        /* embedding: the n streams all started as the same row; its gradient opens only now (the MTP's
         * rows first, then the main input's) */
        prev = ds4_mem_owner_enter(OWNER_EMBED);
        float *de = pass_work(p, N * D);
        ds4_mem_owner_leave(prev);
        if (!de) st = ds4_fail(DS4_ERR_OOM, "out of memory in embedding backward");
        else st = grad_begin(p, 0);
        if (st == DS4_OK) {
            const float *rows = de_mtp ? de_mtp : mtp_rows; /* this stage's MTP rows, or the head stage's */
            if (rows) embedding_bwd(&m->exec, m->g.embed, rows, p->ids_next, N, D);
            streams_sum(&m->exec, de, dX, N, n, D);
            embedding_bwd(&m->exec, m->g.embed, de, p->ids, N, D);
            st = grad_end(p, 0);
        }
        dev_free(m, de);
    }
    if (p->rows_out && c->n_mtp_layers > 0) { /* handed on: the rows wait in m_e for the embedding's stage */
        dev_free(m, p->m_e);
        p->m_e = st == DS4_OK ? de_mtp : NULL;
        if (st == DS4_OK) de_mtp = NULL;
    }
    dev_free(m, de_mtp);
    dev_free(m, dX);
    ds4_status sy = hooks_sync(p); /* the last reduce-scatters land in the shard gradients */
    if (st == DS4_OK) st = sy;
    if (st == DS4_OK) st = read_scalars(p, false);
    if (st == DS4_OK) st = check_kl_rows(p);
    if (st == DS4_OK) finish_losses(p);
    return st;
}

/* ------------------------------------------------------------------ unit reports */
const char *ds4_unit_name(int unit) { return unit_name((unit_id)unit); }

int ds4_unit_find(const char *name) {
    for (int u = 0; u < U_COUNT; u++)
        if (!strcmp(unit_name((unit_id)u), name)) return u;
    return -1;
}

ds4_unit_report ds4_pass_unit_report(const ds4_pass *p, int64_t layer, int unit) {
    const unit_stats *s = &p->unit_stats[layer * U_COUNT + unit];
    return (ds4_unit_report){s->bytes, s->released, s->replays, s->replay_seconds};
}

/* ------------------------------------------------------------------ incremental decoding (model/decode.c) */
/* Rope tables covering positions [0, T), for callers that run the blocks' math outside a pass. */
ds4_status model_ensure_rope(ds4_model *m, int64_t T) { return ensure_rope(m, T); }
