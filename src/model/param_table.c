/* The order of the parameter table (docs/dsv4-architecture.md §8.1): embed; per block the lists of
 * ds4/tensors.h in order, a compressor where the layer compresses (r > 0), the indexer and its
 * compressor on CSA layers (r = 4), the router bias or, on hash layers, tid2eid, each routed expert
 * in a region of its own, the shared experts; the head; the MTP block and its extras; the DSpark stages
 * (carried, outside the regions). */
#include "model/param_table.h"

#include "ds4/io.h"

#include <stdarg.h>
#include <stdio.h>

static void emit(param_walk *w, float **ws, float **gs, int ndim, int64_t d0, int64_t d1, ds4_init_rule init,
                 bool gemm, const char *fmt, ...) __attribute__((format(printf, 9, 10)));
static void emit(param_walk *w, float **ws, float **gs, int ndim, int64_t d0, int64_t d1, ds4_init_rule init,
                 bool gemm, const char *fmt, ...) {
    if (w->stopped) return;
    param_entry e = {.ndim = ndim, .shape = {d0, d1}, .init = init, .gemm = gemm, .w = ws, .g = gs,
                     .carried = w->carrying};
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.name, sizeof e.name, fmt, ap);
    va_end(ap);
    if (!w->tensor(w, &e)) w->stopped = true;
}

static void region(param_walk *w, int64_t group, int64_t expert) {
    if (!w->stopped && !w->carrying && w->region) w->region(w, group, expert);
}

/* An entry of a list: the slot `field` of struct pointers W / G (NULL in a walk without slots). */
#define SLOTS(W, G, field) (W) ? &(W)->field : NULL, (G) ? &(G)->field : NULL

/* The compute dtype rule (param_entry.gemm): the matrices the GEMMs read are the 2-D weights drawn from
 * N(0, 0.02) that a bf16 checkpoint does not keep in fp32 (the mHC fn matrices are mixed in fp32 by their
 * own kernels); the embedding, also such a matrix, is read by a lookup and is named with `false`. */
#define GEMM_READ(nd, rule, f32) ((nd) == 2 && DS4_INIT_##rule == DS4_INIT_NORMAL && !(f32))

static void compressor(param_walk *w, compressor_w *W, compressor_w *G, const char *pre, int64_t r, int64_t cd,
                       int64_t D) {
    const int64_t cw = r == 4 ? 2 * cd : cd; /* CSA keeps two overlapping series */
#define X(field, nd, a, b, nm, hf, rule, f32) emit(w, SLOTS(W, G, field), nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s." nm, pre);
    DS4_COMPRESSOR_TENSORS(X)
#undef X
}

static void block(param_walk *w, int64_t l, const char *pre, int64_t group) {
    const ds4_config *c = w->c;
    block_w *W = w->W && !w->carrying ? &w->W->blocks[l] : NULL, *G = w->G && !w->carrying ? &w->G->blocks[l] : NULL;
    const int64_t D = c->dim, n = c->hc_mult, M = mix_hc(c), H = c->n_heads, hd = c->head_dim, q = c->q_lora_rank;
    const int64_t Og = c->o_groups, GR = c->o_groups * c->o_lora_rank, r = ds4_layer_ratio(c, l);
    const int64_t E = c->n_routed_experts, I = c->moe_inter_dim, Is = I * c->n_shared_experts;
    const int64_t V = c->vocab_size, K = c->n_activated_experts, ih = c->index_n_heads, id = c->index_head_dim;
    region(w, group, -1);
#define X(field, nd, a, b, nm, hf, rule, f32) emit(w, SLOTS(W, G, field), nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s." nm, pre);
    DS4_BLOCK_TENSORS(X)
    char sub[128];
    if (r > 0) {
        snprintf(sub, sizeof sub, "%s.attn.compressor", pre);
        compressor(w, W ? &W->cmp : NULL, G ? &G->cmp : NULL, sub, r, hd, D);
    }
    if (r == 4) {
        DS4_INDEXER_TENSORS(X)
        snprintf(sub, sizeof sub, "%s.attn.indexer.compressor", pre);
        compressor(w, W ? &W->idx_cmp : NULL, G ? &G->idx_cmp : NULL, sub, 4, id, D);
    }
    DS4_ROUTER_TENSORS(X)
    if (!block_is_hash(c, l)) {
        DS4_ROUTER_BIAS_TENSORS(X)
    } else {
#define X_INT(field, nd, a, b, nm, hf, rule, f32) emit(w, NULL, NULL, nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s." nm, pre);
        DS4_ROUTER_HASH_TENSORS(X_INT)
#undef X_INT
    }
#undef X
    for (int64_t e = 0; e < E; e++) {
        region(w, group, e);
        expert_w *We = W ? &W->experts[e] : NULL, *Ge = G ? &G->experts[e] : NULL;
#define X(field, nd, a, b, nm, hf, rule, f32) \
    emit(w, SLOTS(We, Ge, field), nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s.ffn.experts.%lld." nm, pre, (long long)e);
        DS4_EXPERT_TENSORS(X)
#undef X
    }
    region(w, group, -1);
#define X(field, nd, a, b, nm, hf, rule, f32) emit(w, SLOTS(W, G, field), nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s." nm, pre);
    DS4_SHARED_EXPERT_TENSORS(X)
#undef X
}

/* The DSpark stages after everything else (in no group: carried entries have no flat storage). Stage s
 * reads compress_ratios[n_layers + s] (0) and routes by score, as the stages of the checkpoint do. */
static void dspark_stages(param_walk *w) {
    const ds4_config *c = w->c;
    const int64_t D = c->dim, V = c->vocab_size, n = c->hc_mult, T = c->dspark_n_stages, R = c->dspark_markov_rank;
    w->carrying = true;
    for (int64_t s = 0; s < c->dspark_n_stages; s++) {
        char pre[32];
        snprintf(pre, sizeof pre, "mtp.%lld", (long long)s);
        block(w, c->n_layers + c->n_mtp_layers + s, pre, -1);
#define X(field, nd, a, b, nm, hf, rule, f32) emit(w, NULL, NULL, nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), "%s." nm, pre);
        if (s == 0) {
            DS4_DSPARK_FIRST_TENSORS(X)
        }
        if (s == c->dspark_n_stages - 1) {
            DS4_DSPARK_LAST_TENSORS(X)
        }
#undef X
    }
    w->carrying = false;
}

void param_walk_run(param_walk *w) {
    const ds4_config *c = w->c;
    model_w *W = w->W, *G = w->G;
    const int64_t D = c->dim, V = c->vocab_size, n = c->hc_mult;
    w->stopped = false;
#define X_EMBED(field, nd, a, b, nm, hf, rule, f32) emit(w, SLOTS(W, G, field), nd, a, b, DS4_INIT_##rule, false, nm);
#define X(field, nd, a, b, nm, hf, rule, f32) emit(w, SLOTS(W, G, field), nd, a, b, DS4_INIT_##rule, GEMM_READ(nd, rule, f32), nm);
    region(w, 0, -1);
    DS4_EMBED_TENSORS(X_EMBED)
#undef X_EMBED
    for (int64_t l = 0; l < c->n_layers; l++) {
        char pre[32];
        snprintf(pre, sizeof pre, "layers.%lld", (long long)l);
        block(w, l, pre, group_of_layer(l));
    }
    region(w, group_head(c), -1);
    DS4_HEAD_TENSORS(X)
    if (c->n_mtp_layers > 0) {
        block(w, c->n_layers, "mtp.0", group_mtp(c));
        region(w, group_mtp(c), -1);
        DS4_MTP_TENSORS(X)
    }
#undef X
    dspark_stages(w);
}

/* ------------------------------------------------------------------ the table without a model */
typedef struct {
    ds4_expected_fn fn;
    void *ctx;
    ds4_status st;
} expected_ctx;

static bool expected_tensor(param_walk *w, const param_entry *e) {
    expected_ctx *x = w->ctx;
    x->st = x->fn(x->ctx, e->name, e->ndim, e->shape, e->init == DS4_INIT_EXPERT_IDS);
    return x->st == DS4_OK;
}

ds4_status ds4_model_expected_tensors(const ds4_config *c, ds4_expected_fn fn, void *ctx) {
    DS4_TRY(ds4_config_validate(c, "config"));
    expected_ctx x = {fn, ctx, DS4_OK};
    param_walk w = {.c = c, .ctx = &x, .tensor = expected_tensor};
    param_walk_run(&w);
    return x.st;
}
