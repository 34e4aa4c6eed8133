/* A DeepSeek-V4 block, forward and backward, unit by unit (docs/dsv4-architecture.md §2–§5):
 *   hc_pre_attn → attn_norm → q_down → q_up → kv → compressor → indexer → sparse_attn → o_proj → hc_post_attn
 *   hc_pre_ffn → ffn_norm → router → moe → hc_post_ffn
 * Each unit forward reads its inputs from block_acts and allocates its own outputs, so the same
 * function serves the first run and any replay. Kernel conventions: forwards overwrite, backwards
 * accumulate. */
#include "model/block.h"

#include <math.h>
#include <string.h>

/* ================================================================== unit table */
#define BIT(u) (1u << (u))

/* Units whose outputs a unit's forward reads (replayed first when released). */
static const uint32_t k_deps[U_COUNT] = {
    [U_HC_PRE_ATTN] = 0,
    [U_ATTN_NORM] = BIT(U_HC_PRE_ATTN),
    [U_Q_DOWN] = BIT(U_ATTN_NORM),
    [U_Q_UP] = BIT(U_Q_DOWN),
    [U_KV] = BIT(U_ATTN_NORM),
    [U_COMPRESSOR] = BIT(U_ATTN_NORM),
    [U_INDEXER] = BIT(U_ATTN_NORM) | BIT(U_Q_DOWN),
    [U_INDEXER_TOPK] = BIT(U_INDEXER),
    [U_SPARSE_ATTN] = BIT(U_Q_UP) | BIT(U_KV) | BIT(U_COMPRESSOR) | BIT(U_INDEXER_TOPK),
    [U_O_PROJ] = BIT(U_SPARSE_ATTN),
    [U_HC_POST_ATTN] = BIT(U_O_PROJ) | BIT(U_HC_PRE_ATTN),
    [U_HC_PRE_FFN] = BIT(U_HC_POST_ATTN),
    [U_FFN_NORM] = BIT(U_HC_PRE_FFN),
    [U_ROUTER] = BIT(U_FFN_NORM),
    [U_MOE] = BIT(U_FFN_NORM) | BIT(U_ROUTER),
    [U_HC_POST_FFN] = BIT(U_MOE) | BIT(U_HC_POST_ATTN) | BIT(U_HC_PRE_FFN),
};

static const char *k_unit_names[U_COUNT] = {
    "hc_pre_attn", "attn_norm", "q_down", "q_up", "kv", "compressor", "indexer", "indexer_topk", "sparse_attn",
    "o_proj", "hc_post_attn", "hc_pre_ffn", "ffn_norm", "router", "moe", "hc_post_ffn",
};

const char *unit_name(unit_id u) { return (unsigned)u < U_COUNT ? k_unit_names[u] : "?"; }

/* The last unit whose forward reads u: u may be released once that unit has run. */
static unit_id last_forward_reader(unit_id u) {
    unit_id last = u;
    for (int v = (int)u + 1; v < U_COUNT; v++)
        if (k_deps[v] & BIT(u)) last = (unit_id)v;
    return last;
}

/* ================================================================== allocation helpers */
static void *out_alloc(block_acts *a, unit_id u, int64_t n, size_t elt) {
    if (a->nowned[u] >= UNIT_MAX_OUTS) {
        ds4_fail(DS4_ERR_INTERNAL, "unit %s: too many outputs", unit_name(u));
        return NULL;
    }
    void *p = ds4_alloc(DS4_MEM_ACT, (size_t)n * elt);
    if (p) a->owned[u][a->nowned[u]++] = p;
    return p;
}
#define OUT_F(u, n) ((float *)out_alloc(a, (u), (n), sizeof(float)))
#define OUT_I32(u, n) ((int32_t *)out_alloc(a, (u), (n), sizeof(int32_t)))
#define OUT_I64(u, n) ((int64_t *)out_alloc(a, (u), (n), sizeof(int64_t)))

#define NEED(p)                                                                                  \
    do {                                                                                         \
        if (!(p)) return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer); \
    } while (0)

/* The field pointers each unit fills, so a release can clear them (reads of a released tensor then
 * find NULL and crash loudly instead of reading stale memory). */
static void clear_unit_fields(block_acts *a, unit_id u) {
    switch (u) {
    case U_HC_PRE_ATTN: a->hcA_mixes = a->hcA_rsqrt = a->hcA_post = a->hcA_comb = a->hcA_y = NULL; break;
    case U_ATTN_NORM: a->xa = a->xa_rstd = NULL; break;
    case U_Q_DOWN: a->qa = a->qa_rstd = a->qr = NULL; break;
    case U_Q_UP: a->qraw = a->q_rstd = a->q = NULL; break;
    case U_KV: a->kvraw = a->kv_rstd = a->kv = NULL; break;
    case U_COMPRESSOR: a->ca = a->cz = a->cpool = a->c_rstd = a->kvc = NULL; break;
    case U_INDEXER: a->iqi = a->iwi = a->ica = a->icz = a->ipool = a->i_rstd = a->iki = NULL; break;
    case U_INDEXER_TOPK: a->topk = NULL; break;
    case U_SPARSE_ATTN: a->o = a->lse = NULL; break;
    case U_O_PROJ: a->z = a->attn_out = NULL; break;
    case U_HC_POST_ATTN: a->X_mid = NULL; break;
    case U_HC_PRE_FFN: a->hcF_mixes = a->hcF_rsqrt = a->hcF_post = a->hcF_comb = a->hcF_y = NULL; break;
    case U_FFN_NORM: a->xf = a->xf_rstd = NULL; break;
    case U_ROUTER:
        a->glogits = a->gscores = a->gw = NULL;
        a->gidx = a->etok = a->eslot = NULL;
        a->eoff = NULL;
        break;
    case U_MOE:
        a->h1 = a->h3 = a->sh1 = a->sh3 = a->ffn_out = a->xr = a->wr = NULL;
        ds4_ep_route_free(a->route);
        a->route = NULL;
        break;
    default: break;
    }
}

static int64_t unit_bytes(const block_acts *a, unit_id u) {
    int64_t b = 0;
    for (int i = 0; i < a->nowned[u]; i++) b += (int64_t)ds4_alloc_size(a->owned[u][i]);
    return b;
}

/* Frees a unit's outputs; their bytes go back to the allocator at once. */
static void unit_release(block_acts *a, unit_id u) {
    for (int i = 0; i < a->nowned[u]; i++) ds4_free(a->owned[u][i]);
    a->nowned[u] = 0;
    a->present[u] = false;
    clear_unit_fields(a, u);
}

void block_acts_free(block_acts *a) {
    for (int u = 0; u < U_COUNT; u++) unit_release(a, (unit_id)u);
    memset(a, 0, sizeof *a);
}

int64_t block_acts_bytes(const block_acts *a) {
    int64_t b = 0;
    for (int u = 0; u < U_COUNT; u++) b += unit_bytes(a, (unit_id)u);
    return b;
}

static float *work_zeros(int64_t n) { return ds4_calloc(DS4_MEM_WORK, (size_t)n * sizeof(float)); }
static float *work(int64_t n) { return ds4_alloc(DS4_MEM_WORK, (size_t)n * sizeof(float)); }

static const ds4_rope *block_rope(const ds4_model *m, int64_t ratio) {
    return ratio > 0 ? &m->rope_cmp : &m->rope_main;
}

static int64_t usable_rows(int64_t B, int64_t T, int64_t r) { return T >= r ? B * (T - r + 1) : 0; }

static float attn_scale(const ds4_config *c) { return (float)(1.0 / sqrt((double)c->head_dim)); }
static float indexer_wscale(const ds4_config *c) {
    return (float)(1.0 / sqrt((double)c->index_head_dim) / sqrt((double)c->index_n_heads));
}

/* Shorthands every unit uses. */
#define UNIT_PROLOGUE                                                                            \
    ds4_model *m = bc->m;                                                                        \
    const ds4_config *c = &m->cfg;                                                               \
    const block_w *W = &m->w.blocks[bc->layer];                                                  \
    const int64_t B = bc->B, T = bc->T, N = B * T, D = c->dim, n = c->hc_mult;                    \
    const float eps = (float)c->norm_eps;                                                        \
    (void)W; (void)B; (void)T; (void)N; (void)D; (void)n; (void)eps

/* ================================================================== unit forwards */
/* mHC pre of one sub-layer: y [N, D], post [N, n], comb [N, n, n] (+ mixes [N, M], rsqrt [N]) from X. */
static ds4_status hc_pre_unit(const block_ctx *bc, block_acts *a, unit_id u, const float *X, const float *fn,
                              const float *scale, const float *base, float **mixes, float **rsqrt, float **post,
                              float **comb, float **y) {
    UNIT_PROLOGUE;
    const int64_t M = mix_hc(c);
    NEED(*mixes = OUT_F(u, N * M));
    NEED(*rsqrt = OUT_F(u, N));
    NEED(*post = OUT_F(u, N * n));
    NEED(*comb = OUT_F(u, N * n * n));
    NEED(*y = OUT_F(u, N * D));
    hc_pre_fwd(&(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
        .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = X, .fn = fn, .scale = scale, .base = base, .y = *y,
        .post = *post, .comb = *comb, .mixes = *mixes, .rsqrt = *rsqrt});
    return DS4_OK;
}

static ds4_status u_hc_pre_attn(const block_ctx *bc, block_acts *a) {
    const block_w *W = &bc->m->w.blocks[bc->layer];
    return hc_pre_unit(bc, a, U_HC_PRE_ATTN, a->X_in, W->hc_attn_fn, W->hc_attn_scale, W->hc_attn_base,
                       &a->hcA_mixes, &a->hcA_rsqrt, &a->hcA_post, &a->hcA_comb, &a->hcA_y);
}

static ds4_status u_attn_norm(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    NEED(a->xa = OUT_F(U_ATTN_NORM, N * D));
    NEED(a->xa_rstd = OUT_F(U_ATTN_NORM, N));
    rmsnorm_fwd(a->xa, a->xa_rstd, a->hcA_y, W->attn_norm, N, D, eps);
    return DS4_OK;
}

/* qr = q_norm(wq_a xa): [N, QR] — also the indexer's query latent */
static ds4_status u_q_down(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t QR = c->q_lora_rank;
    NEED(a->qa = OUT_F(U_Q_DOWN, N * QR));
    NEED(a->qa_rstd = OUT_F(U_Q_DOWN, N));
    NEED(a->qr = OUT_F(U_Q_DOWN, N * QR));
    linear_fwd(a->qa, a->xa, W->wq_a, N, D, QR);
    rmsnorm_fwd(a->qr, a->qa_rstd, a->qa, W->q_norm, N, QR, eps);
    return DS4_OK;
}

/* q = rope(headnorm(wq_b qr)): [N, H, hd] */
static ds4_status u_q_up(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    NEED(a->qraw = OUT_F(U_Q_UP, N * H * hd));
    NEED(a->q_rstd = OUT_F(U_Q_UP, N * H));
    NEED(a->q = OUT_F(U_Q_UP, N * H * hd));
    linear_fwd(a->qraw, a->qr, W->wq_b, N, QR, H * hd);
    rmsnorm_fwd(a->q, a->q_rstd, a->qraw, NULL, N * H, hd, eps);
    rope_fwd(a->q, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1, .table = block_rope(m, a->ratio),
        .inverse = false});
    return DS4_OK;
}

/* kv = rope(kv_norm(wkv xa)): [N, hd], the one shared K = V head */
static ds4_status u_kv(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t hd = c->head_dim;
    NEED(a->kvraw = OUT_F(U_KV, N * hd));
    NEED(a->kv_rstd = OUT_F(U_KV, N));
    NEED(a->kv = OUT_F(U_KV, N * hd));
    linear_fwd(a->kvraw, a->xa, W->wkv, N, D, hd);
    rmsnorm_fwd(a->kv, a->kv_rstd, a->kvraw, W->kv_norm, N, hd, eps);
    rope_fwd(a->kv, &(rope_args){.N = N, .H = 1, .hd = hd, .period = T, .mult = 1, .table = block_rope(m, a->ratio),
        .inverse = false});
    return DS4_OK;
}

/* One compressor: out [B, Nc, d] = rope(norm(pool(wkv xa, wgate xa))), entry i roped at i·r. */
static ds4_status compress(const block_ctx *bc, block_acts *a, unit_id u, const compressor_w *cw, int64_t r,
                           int64_t d, float **ca, float **cz, float **pool, float **rstd, float **out) {
    UNIT_PROLOGUE;
    const int64_t coff = r == 4 ? 2 : 1, Nc = a->Nc;
    NEED(*ca = OUT_F(u, N * coff * d));
    NEED(*cz = OUT_F(u, N * coff * d));
    NEED(*pool = OUT_F(u, B * Nc * d));
    NEED(*rstd = OUT_F(u, B * Nc));
    NEED(*out = OUT_F(u, B * Nc * d));
    linear_fwd(*ca, a->xa, cw->wkv, N, D, coff * d);
    linear_fwd(*cz, a->xa, cw->wgate, N, D, coff * d);
    compressor_pool_fwd(&(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = r == 4}, .a = *ca,
        .z = *cz, .ape = cw->ape, .out = *pool});
    rmsnorm_fwd(*out, *rstd, *pool, cw->norm, B * Nc, d, eps);
    rope_fwd(*out, &(rope_args){.N = B * Nc, .H = 1, .hd = d, .period = Nc, .mult = r, .table = block_rope(m, r),
        .inverse = false});
    return DS4_OK;
}

static ds4_status u_compressor(const block_ctx *bc, block_acts *a) {
    if (a->ratio == 0) return DS4_OK;
    const block_w *W = &bc->m->w.blocks[bc->layer];
    return compress(bc, a, U_COMPRESSOR, &W->cmp, a->ratio, bc->m->cfg.head_dim, &a->ca, &a->cz, &a->cpool,
                    &a->c_rstd, &a->kvc);
}

/* Lightning indexer (CSA): queries, weights and compressed keys from xa, qr (detached in backward). */
static ds4_status u_indexer(const block_ctx *bc, block_acts *a) {
    if (a->ratio != 4) return DS4_OK;
    UNIT_PROLOGUE;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, QR = c->q_lora_rank;
    NEED(a->iqi = OUT_F(U_INDEXER, N * HI * dI));
    NEED(a->iwi = OUT_F(U_INDEXER, N * HI));
    linear_fwd(a->iqi, a->qr, W->idx_wq_b, N, QR, HI * dI);
    rope_fwd(a->iqi, &(rope_args){.N = N, .H = HI, .hd = dI, .period = T, .mult = 1, .table = &m->rope_cmp,
        .inverse = false});
    linear_fwd(a->iwi, a->xa, W->idx_weights_proj, N, D, HI);
    return compress(bc, a, U_INDEXER, &W->idx_cmp, 4, dI, &a->ica, &a->icz, &a->ipool, &a->i_rstd, &a->iki);
}

/* The attention kernels return no status: an allocation failing inside one (the failure count moved
 * since `before`) left a poisoned or empty result, so the unit fails. */
static ds4_status kernel_status(int64_t before, const char *what) {
    return ds4_alloc_failures() == before ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in %s", what);
}

/* Top-k of the indexer scores: [N, index_topk], ties to the lower index. */
static ds4_status u_indexer_topk(const block_ctx *bc, block_acts *a) {
    if (a->ratio != 4) return DS4_OK;
    UNIT_PROLOGUE;
    const int64_t K = c->index_topk;
    NEED(a->topk = OUT_I32(U_INDEXER_TOPK, N * K));
    const int64_t oom = ds4_alloc_failures();
    indexer_topk_fwd(&(indexer_topk_args){.dims = {.B = B, .T = T, .HI = c->index_n_heads, .dI = c->index_head_dim,
        .Nc = a->Nc, .ratio = 4, .K = K}, .wscale = indexer_wscale(c), .qi = a->iqi, .ki = a->iki, .w = a->iwi,
        .topk = a->topk});
    return kernel_status(oom, "indexer top-k");
}

static const int32_t *attn_selection(const block_ctx *bc, const block_acts *a) {
    return (a->ratio == 4 && !bc->dense_csa) ? a->topk : NULL;
}

/* Sparse attention over window + (selected | all usable) compressed entries, with the sink. */
static ds4_status u_sparse_attn(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim;
    const int32_t *sel = attn_selection(bc, a);
    NEED(a->o = OUT_F(U_SPARSE_ATTN, N * H * hd));
    NEED(a->lse = OUT_F(U_SPARSE_ATTN, N * H));
    const int64_t oom = ds4_alloc_failures();
    sparse_attn_fwd(&(sparse_attn_args){.dims = {.B = B, .T = T, .H = H, .c = hd, .window = c->window,
        .ratio = a->ratio, .Nc = a->Nc, .K = sel ? c->index_topk : 0}, .scale = attn_scale(c), .q = a->q, .kv = a->kv,
        .kvc = a->kvc, .sink = W->attn_sink, .topk = sel, .o = a->o, .lse = a->lse});
    return kernel_status(oom, "sparse attention");
}

/* Workspace copy of o with the inverse rope at the query position: [N, H, hd]. Cheap to rebuild, so
 * o_proj keeps only its GEMM outputs. */
static float *inverse_roped_o(const block_ctx *bc, const block_acts *a) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t N = bc->B * bc->T, H = c->n_heads, hd = c->head_dim;
    float *o_r = work(N * H * hd);
    if (!o_r) return NULL;
    if (!ds4_shape_only()) memcpy(o_r, a->o, (size_t)(N * H * hd) * sizeof(float));
    rope_fwd(o_r, &(rope_args){.N = N, .H = H, .hd = hd, .period = bc->T, .mult = 1,
        .table = block_rope(bc->m, a->ratio), .inverse = true});
    return o_r;
}

/* o_proj: inverse rope at the query position, grouped wo_a, wo_b. attn_out: [N, D] */
static ds4_status u_o_proj(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, R = c->o_lora_rank;
    NEED(a->z = OUT_F(U_O_PROJ, N * G * R));
    NEED(a->attn_out = OUT_F(U_O_PROJ, N * D));
    float *o_r = inverse_roped_o(bc, a);
    NEED(o_r);
    grouped_linear_fwd(a->z, o_r, W->wo_a, N, G, R, H * hd / G);
    linear_fwd(a->attn_out, a->z, W->wo_b, N, G * R, D);
    ds4_free(o_r);
    return DS4_OK;
}

static ds4_status u_hc_post_attn(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    NEED(a->X_mid = OUT_F(U_HC_POST_ATTN, N * n * D));
    hc_post_fwd(&(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = a->attn_out, .res = a->X_in, .post = a->hcA_post,
        .comb = a->hcA_comb, .Y = a->X_mid});
    return DS4_OK;
}

static ds4_status u_hc_pre_ffn(const block_ctx *bc, block_acts *a) {
    const block_w *W = &bc->m->w.blocks[bc->layer];
    return hc_pre_unit(bc, a, U_HC_PRE_FFN, a->X_mid, W->hc_ffn_fn, W->hc_ffn_scale, W->hc_ffn_base, &a->hcF_mixes,
                       &a->hcF_rsqrt, &a->hcF_post, &a->hcF_comb, &a->hcF_y);
}

static ds4_status u_ffn_norm(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    NEED(a->xf = OUT_F(U_FFN_NORM, N * D));
    NEED(a->xf_rstd = OUT_F(U_FFN_NORM, N));
    rmsnorm_fwd(a->xf, a->xf_rstd, a->hcF_y, W->ffn_norm, N, D, eps);
    return DS4_OK;
}

/* Groups the N·K (token, slot) assignments by expert, tokens ascending within an expert. */
static ds4_status route_assignments(block_acts *a, int64_t N, int64_t E, int64_t K) {
    memset(a->eoff, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N * K; i++) a->eoff[a->gidx[i] + 1]++;
    for (int64_t e = 0; e < E; e++) a->eoff[e + 1] += a->eoff[e];
    int64_t *fill = ds4_alloc(DS4_MEM_WORK, (size_t)E * sizeof(int64_t));
    if (!fill) return ds4_fail(DS4_ERR_OOM, "out of memory routing tokens to experts");
    memcpy(fill, a->eoff, (size_t)E * sizeof(int64_t));
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t e = a->gidx[t * K + k], j = fill[e]++;
            a->etok[j] = (int32_t)t;
            a->eslot[j] = (int32_t)k;
        }
    ds4_free(fill);
    return DS4_OK;
}

/* Router: sqrt-softplus scores, bias (selection only) or hash table, normalised weights. */
static ds4_status u_router(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts;
    unit_id u = U_ROUTER;
    NEED(a->glogits = OUT_F(u, N * E));
    NEED(a->gscores = OUT_F(u, N * E));
    NEED(a->gidx = OUT_I32(u, N * K));
    NEED(a->gw = OUT_F(u, N * K));
    NEED(a->eoff = OUT_I64(u, E + 1));
    NEED(a->etok = OUT_I32(u, N * K));
    NEED(a->eslot = OUT_I32(u, N * K));
    linear_fwd(a->glogits, a->xf, W->gate, N, D, E);
    bool hash = block_is_hash(c, bc->layer);
    const int64_t *table = hash ? m->tid2eid[bc->layer] : NULL;
    const int32_t *ids = bc->ids;
    int64_t *forced = NULL; /* force_balance: a per-token table [N, K] read through ids = 0, 1, ..., N-1 */
    int32_t *iota = NULL;
    if (bc->force_balance) {
        forced = ds4_alloc(DS4_MEM_WORK, (size_t)(N * K) * sizeof(int64_t));
        iota = ds4_alloc(DS4_MEM_WORK, (size_t)N * sizeof(int32_t));
        if (!forced || !iota) {
            ds4_free(forced);
            ds4_free(iota);
            return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer);
        }
        for (int64_t j = 0; j < (ds4_shape_only() ? 0 : N * K); j++) forced[j] = j % E;
        for (int64_t t = 0; t < (ds4_shape_only() ? 0 : N); t++) iota[t] = (int32_t)t;
        table = forced;
        ids = iota;
    }
    moe_gate_fwd(&(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)c->route_scale,
        .logits = a->glogits, .bias = table ? NULL : W->gate_bias, .tid2eid = table, .ids = ids, .idx = a->gidx,
        .weights = a->gw, .scores = a->gscores});
    ds4_free(forced);
    ds4_free(iota);
    return ds4_shape_only() ? DS4_OK : route_assignments(a, N, E, K);
}

static void gather_rows(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * D, src + (int64_t)rows[i] * D, (size_t)D * sizeof(float));
}

/* dst[rows[i]] += src[i], in row order (deterministic). */
static void scatter_add_rows(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        float *d = dst + (int64_t)rows[i] * D;
        for (int64_t k = 0; k < D; k++) d[k] += src[i * D + k];
    }
}

/* Routing weight of assignment j. */
static float assignment_weight(const block_acts *a, int64_t j, int64_t K) {
    return a->gw[(int64_t)a->etok[j] * K + a->eslot[j]];
}

/* One expert on ne rows: x [ne, D] with routing weights w [ne] → h1, h3 [ne, I] (saved for backward)
 * and y [ne, D] = w2(w · swiglu(h1, h3)). act: [ne, I] scratch. */
static void expert_fwd(const expert_w *ew, const float *x, const float *w, int64_t ne, int64_t D, int64_t I,
                       float limit, float *h1, float *h3, float *act, float *y) {
    linear_fwd(h1, x, ew->w1, ne, D, I);
    linear_fwd(h3, x, ew->w3, ne, D, I);
    swiglu_fwd(act, h1, h3, ne, I, limit);
    for (int64_t i = 0; i < ne; i++)
        for (int64_t k = 0; k < I; k++) act[i * I + k] *= w[i]; /* routing weight before w2 */
    linear_fwd(y, act, ew->w2, ne, I, D);
}

ds4_ep_route *ds4_ep_route_new(int nsrc, int64_t e0, int64_t e1) {
    ds4_ep_route *r = ds4_calloc(DS4_MEM_OTHER, sizeof *r);
    if (!r) return NULL;
    r->nsrc = nsrc;
    r->e0 = e0;
    r->e1 = e1;
    r->recv_cnt = ds4_calloc(DS4_MEM_OTHER, (size_t)((e1 - e0) * nsrc + 1) * sizeof(int64_t));
    r->send_cnt = ds4_calloc(DS4_MEM_OTHER, (size_t)nsrc * sizeof(int64_t));
    r->recv_from = ds4_calloc(DS4_MEM_OTHER, (size_t)nsrc * sizeof(int64_t));
    if (!r->recv_cnt || !r->send_cnt || !r->recv_from) {
        ds4_ep_route_free(r);
        return NULL;
    }
    return r;
}

void ds4_ep_route_free(ds4_ep_route *r) {
    if (!r) return;
    ds4_free(r->recv_cnt);
    ds4_free(r->send_cnt);
    ds4_free(r->recv_from);
    ds4_free(r);
}

/* Per-expert assignment counts of the pass: from the routing, or those of balanced routing in
 * shape-only mode (slot j → expert j mod E, as force_balance routes). cnt: [E] */
static void assignment_counts(const block_acts *a, int64_t N, int64_t E, int64_t K, int64_t *cnt) {
    for (int64_t e = 0; e < E; e++)
        cnt[e] = ds4_shape_only() ? N * K / E + (e < N * K % E) : a->eoff[e + 1] - a->eoff[e];
}

/* Expert parallelism: tells the experts' owners how many rows are coming (a collective). */
static ds4_status moe_route(const block_ctx *bc, block_acts *a) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t E = c->n_routed_experts, N = bc->B * bc->T;
    int64_t *cnt = ds4_alloc(DS4_MEM_OTHER, (size_t)E * sizeof(int64_t));
    if (!cnt) return ds4_fail(DS4_ERR_OOM, "out of memory routing block %lld", (long long)bc->layer);
    assignment_counts(a, N, E, c->n_activated_experts, cnt);
    ds4_status st = bc->ep->route(bc->ep->ctx, cnt, &a->route);
    ds4_free(cnt);
    return st;
}

/* Rows of local expert i in the received layout: first row and count (all sources). */
static int64_t route_expert_rows(const ds4_ep_route *r, int64_t i, int64_t *first) {
    int64_t o = 0, n = 0;
    for (int64_t j = 0; j <= i; j++)
        for (int s = 0; s < r->nsrc; s++) {
            if (j < i) o += r->recv_cnt[j * r->nsrc + s];
            else n += r->recv_cnt[j * r->nsrc + s];
        }
    *first = o;
    return n;
}

/* Routed experts, every expert local: ffn_out += Σ over assignments (expert-major, then token order). */
static void moe_routed_fwd_local(const block_ctx *bc, block_acts *a, const float *wj, float *xe, float *act, float *ye) {
    UNIT_PROLOGUE;
    const int64_t E = c->n_routed_experts, I = c->moe_inter_dim;
    for (int64_t e = 0; e < E; e++) {
        int64_t j0 = a->eoff[e], ne = a->eoff[e + 1] - j0;
        if (ne == 0) continue;
        gather_rows(xe, a->xf, a->etok + j0, ne, D);
        expert_fwd(&W->experts[e], xe, wj + j0, ne, D, I, (float)c->swiglu_limit, a->h1 + j0 * I, a->h3 + j0 * I,
                   act, ye);
        scatter_add_rows(a->ffn_out, ye, a->etok + j0, ne, D);
    }
}

/* Routed experts over EP: rows (x | weight) go to the experts' owners, the owners run their experts on
 * everything they received (saving x and the weights for backward), results come back in assignment
 * order and are added in that order, so every rank's output is what a single process computes. */
static ds4_status moe_routed_fwd_ep(const block_ctx *bc, block_acts *a, const float *wj, float *act) {
    UNIT_PROLOGUE;
    const int64_t K = c->n_activated_experts, I = c->moe_inter_dim, NK = N * K, R = a->route->rows;
    const bool shape = ds4_shape_only();
    NEED(a->xr = OUT_F(U_MOE, R * D));
    NEED(a->wr = OUT_F(U_MOE, R));
    float *send = work(NK * (D + 1)), *recv = work(R * (D + 1)), *yr = work(R * D), *ys = work(NK * D);
    ds4_status st = send && recv && yr && ys ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    for (int64_t j = 0; st == DS4_OK && !shape && j < NK; j++) {
        memcpy(send + j * (D + 1), a->xf + (int64_t)a->etok[j] * D, (size_t)D * sizeof(float));
        send[j * (D + 1) + D] = wj[j];
    }
    if (st == DS4_OK) st = bc->ep->dispatch(bc->ep->ctx, a->route, send, recv, D + 1);
    for (int64_t i = 0; st == DS4_OK && !shape && i < R; i++) {
        memcpy(a->xr + i * D, recv + i * (D + 1), (size_t)D * sizeof(float));
        a->wr[i] = recv[i * (D + 1) + D];
    }
    for (int64_t i = 0; st == DS4_OK && !shape && i < a->route->e1 - a->route->e0; i++) {
        int64_t o, ne = route_expert_rows(a->route, i, &o);
        if (ne > 0)
            expert_fwd(&W->experts[a->route->e0 + i], a->xr + o * D, a->wr + o, ne, D, I, (float)c->swiglu_limit,
                       a->h1 + o * I, a->h3 + o * I, act, yr + o * D);
    }
    if (st == DS4_OK) st = bc->ep->combine(bc->ep->ctx, a->route, yr, ys, D);
    if (st == DS4_OK && !shape) scatter_add_rows(a->ffn_out, ys, a->etok, NK, D);
    ds4_free(send);
    ds4_free(recv);
    ds4_free(yr);
    ds4_free(ys);
    return st;
}

/* MoE: ffn_out = Σ_k w_k · w2(swiglu(w1 x, w3 x)) over routed experts + the shared expert. */
static ds4_status u_moe(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts;
    const float limit = (float)c->swiglu_limit;
    unit_id u = U_MOE;
    const bool shape = ds4_shape_only(); /* memplan: no routing data; the per-expert GEMMs allocate nothing */
    if (bc->ep) DS4_TRY(moe_route(bc, a));
    const int64_t R = bc->ep ? a->route->rows : N * K; /* routed rows computed here */
    NEED(a->h1 = OUT_F(u, R * I));
    NEED(a->h3 = OUT_F(u, R * I));
    NEED(a->sh1 = OUT_F(u, N * Is));
    NEED(a->sh3 = OUT_F(u, N * Is));
    NEED(a->ffn_out = OUT_F(u, N * D));
    if (!shape) memset(a->ffn_out, 0, (size_t)(N * D) * sizeof(float));
    const int64_t Rmax = R > N * K ? R : N * K;
    float *wj = work(N * K), *act = work(Rmax * I > N * Is ? Rmax * I : N * Is), *ye = work(N * (K * D > D ? K * D : D));
    float *xe = bc->ep ? NULL : work(N * K * D);
    ds4_status st = (wj && act && ye && (bc->ep || xe)) ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    for (int64_t j = 0; st == DS4_OK && !shape && j < N * K; j++) wj[j] = assignment_weight(a, j, K);
    if (st == DS4_OK && bc->ep) st = moe_routed_fwd_ep(bc, a, wj, act);
    else if (st == DS4_OK && !shape) moe_routed_fwd_local(bc, a, wj, xe, act, ye);
    if (st == DS4_OK) {
        linear_fwd(a->sh1, a->xf, W->shared.w1, N, D, Is);
        linear_fwd(a->sh3, a->xf, W->shared.w3, N, D, Is);
        swiglu_fwd(act, a->sh1, a->sh3, N, Is, limit);
        linear_fwd(ye, act, W->shared.w2, N, Is, D);
        for (int64_t i = 0; i < (shape ? 0 : N * D); i++) a->ffn_out[i] += ye[i];
    }
    ds4_free(wj);
    ds4_free(xe);
    ds4_free(act);
    ds4_free(ye);
    return st;
}

static ds4_status u_hc_post_ffn(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    hc_post_fwd(&(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = a->ffn_out, .res = a->X_mid, .post = a->hcF_post,
        .comb = a->hcF_comb, .Y = a->X_out});
    return DS4_OK;
}

typedef ds4_status (*unit_fwd_fn)(const block_ctx *, block_acts *);
static const unit_fwd_fn k_fwd[U_COUNT] = {
    u_hc_pre_attn, u_attn_norm, u_q_down, u_q_up, u_kv, u_compressor, u_indexer, u_indexer_topk, u_sparse_attn,
    u_o_proj, u_hc_post_attn, u_hc_pre_ffn, u_ffn_norm, u_router, u_moe, u_hc_post_ffn,
};

/* Makes unit u's outputs present, replaying it (and its released inputs, in forward order) if needed. */
static ds4_status block_need(const block_ctx *bc, block_acts *a, unit_id u) {
    if (a->present[u]) return DS4_OK;
    if (u == U_HC_POST_FFN) return ds4_fail(DS4_ERR_INTERNAL, "hc_post_ffn is never replayed");
    for (int d = 0; d < (int)u; d++)
        if (k_deps[u] & BIT(d)) DS4_TRY(block_need(bc, a, (unit_id)d));
    double t0 = ds4_now();
    DS4_TRY(k_fwd[u](bc, a));
    a->present[u] = true;
    if (a->stats) {
        a->stats[u].replays++;
        a->stats[u].replay_seconds += ds4_now() - t0;
    }
    return DS4_OK;
}

static ds4_status need_all(const block_ctx *bc, block_acts *a, uint32_t units) {
    for (int u = 0; u < U_COUNT; u++)
        if (units & BIT(u)) DS4_TRY(block_need(bc, a, (unit_id)u));
    return DS4_OK;
}

/* ================================================================== block forward */
/* Forward-only pass: the indexer KL cannot wait for backward. */
static ds4_status indexer_kl_forward_only(const block_ctx *bc, block_acts *a, double *kl_sum, int64_t *kl_rows) {
    const ds4_config *c = &bc->m->cfg;
    const int32_t *sel = attn_selection(bc, a);
    double kl = 0;
    int64_t rows = 0;
    const int64_t oom = ds4_alloc_failures();
    indexer_kl_fwd_bwd(&(indexer_kl_args){.dims = {.B = bc->B, .T = bc->T, .HI = c->index_n_heads,
        .dI = c->index_head_dim, .Nc = a->Nc, .ratio = 4, .K = sel ? c->index_topk : 0}, .H = c->n_heads,
        .c = c->head_dim, .scale = attn_scale(c), .wscale = indexer_wscale(c), .grad_scale = 0.0f, .qi = a->iqi,
        .ki = a->iki, .w = a->iwi, .q = a->q, .kvc = a->kvc, .lse = a->lse, .topk = sel, .kl_sum = &kl,
        .n_rows = &rows});
    *kl_sum += kl;
    *kl_rows += rows;
    return kernel_status(oom, "the indexer loss");
}

ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, uint32_t release_mask,
                     unit_stats *stats, int64_t *expert_load, double *kl_sum, int64_t *kl_rows) {
    memset(a, 0, sizeof *a);
    a->X_in = X_in;
    a->X_out = X_out;
    a->ratio = ds4_layer_ratio(&bc->m->cfg, bc->layer);
    a->Nc = a->ratio > 0 ? bc->T / a->ratio : 0;
    a->release_mask = bc->keep ? release_mask & ~BIT(U_HC_POST_FFN) : 0;
    a->stats = stats;
    ds4_status st = DS4_OK;
    for (int u = 0; u < U_COUNT && st == DS4_OK; u++) {
        st = k_fwd[u](bc, a);
        a->present[u] = true;
        if (st != DS4_OK) break;
        if (stats) stats[u].bytes = unit_bytes(a, (unit_id)u);
        if (u == U_SPARSE_ATTN && a->ratio == 4 && !bc->keep) st = indexer_kl_forward_only(bc, a, kl_sum, kl_rows);
        if (st != DS4_OK) break;
        if (u == U_ROUTER && expert_load && !ds4_shape_only()) {
            const int64_t E = bc->m->cfg.n_routed_experts;
            for (int64_t e = 0; e < E; e++) expert_load[e] += a->eoff[e + 1] - a->eoff[e];
        }
        /* release every masked unit whose last forward reader has now run */
        for (int v = 0; v <= u; v++)
            if ((a->release_mask & BIT(v)) && a->present[v] && last_forward_reader((unit_id)v) == (unit_id)u) {
                if (v == U_INDEXER_TOPK && bc->topk_copy && a->topk && !ds4_shape_only())
                    memcpy(bc->topk_copy, a->topk, (size_t)(bc->B * bc->T * bc->m->cfg.index_topk) * sizeof(int32_t));
                unit_release(a, (unit_id)v);
                if (stats) stats[v].released++;
            }
    }
    if (st != DS4_OK || !bc->keep) block_acts_free(a);
    return st;
}

/* ================================================================== block backward */
/* Gradient buffers of one block backward (workspace, zeroed). */
typedef struct {
    float *dX_mid;                   /* [N, n, D] */
    float *dffn, *dpostF, *dcombF;   /* [N, D], [N, n], [N, n, n] */
    float *dxf, *dyF;                /* [N, D] */
    float *dattn, *dpostA, *dcombA;  /* [N, D], [N, n], [N, n, n] */
    float *dz, *do_, *dq, *dkv, *dkvc;
    float *dqr;                      /* [N, QR] */
    float *dxa, *dyA;
} block_grads;

static void grads_free(block_grads *g) {
    float **f = (float **)g;
    for (size_t i = 0; i < sizeof *g / sizeof(float *); i++) ds4_free(f[i]);
    memset(g, 0, sizeof *g);
}

static ds4_status grads_alloc(const block_ctx *bc, const block_acts *a, block_grads *g) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t N = bc->B * bc->T, D = c->dim, n = c->hc_mult, H = c->n_heads, hd = c->head_dim;
    memset(g, 0, sizeof *g);
    g->dX_mid = work_zeros(N * n * D);
    g->dffn = work_zeros(N * D);
    g->dpostF = work_zeros(N * n);
    g->dcombF = work_zeros(N * n * n);
    g->dxf = work_zeros(N * D);
    g->dyF = work_zeros(N * D);
    g->dattn = work_zeros(N * D);
    g->dpostA = work_zeros(N * n);
    g->dcombA = work_zeros(N * n * n);
    g->dz = work_zeros(N * c->o_groups * c->o_lora_rank);
    g->do_ = work_zeros(N * H * hd);
    g->dq = work_zeros(N * H * hd);
    g->dkv = work_zeros(N * hd);
    g->dkvc = work_zeros(bc->B * a->Nc * hd + 1);
    g->dqr = work_zeros(N * c->q_lora_rank);
    g->dxa = work_zeros(N * D);
    g->dyA = work_zeros(N * D);
    float **f = (float **)g;
    for (size_t i = 0; i < sizeof *g / sizeof(float *); i++)
        if (!f[i]) {
            grads_free(g);
            return ds4_fail(DS4_ERR_OOM, "out of memory for the gradients of block %lld", (long long)bc->layer);
        }
    return DS4_OK;
}

/* Backward of one expert on ne rows (expert_fwd's inputs x, w, saved h1, h3; dy = d of its output):
 * dx [ne, D] and dw [ne] (d routing weight) are overwritten; weight gradients accumulate into eg.
 * Scratch act, dact, dh1, dh3: [ne, I]. */
static void expert_bwd(const expert_w *ew, expert_w *eg, const float *x, const float *dy, const float *w,
                       const float *h1, const float *h3, int64_t ne, int64_t D, int64_t I, float limit, float *dx,
                       float *dw, float *act, float *dact, float *dh1, float *dh3) {
    swiglu_fwd(act, h1, h3, ne, I, limit); /* unweighted activation */
    float *wact = dh1;                     /* scratch: the weighted activation that fed w2 */
    for (int64_t i = 0; i < ne; i++)
        for (int64_t k = 0; k < I; k++) wact[i * I + k] = act[i * I + k] * w[i];
    memset(dact, 0, (size_t)(ne * I) * sizeof(float));
    linear_bwd(dact, eg->w2, dy, wact, ew->w2, ne, I, D);
    /* d weight = ⟨d wact, act⟩; d act = d wact · weight */
    for (int64_t i = 0; i < ne; i++) {
        double s = 0;
        for (int64_t k = 0; k < I; k++) s += (double)dact[i * I + k] * act[i * I + k];
        dw[i] = (float)s;
        for (int64_t k = 0; k < I; k++) dact[i * I + k] *= w[i];
    }
    memset(dh1, 0, (size_t)(ne * I) * sizeof(float));
    memset(dh3, 0, (size_t)(ne * I) * sizeof(float));
    swiglu_bwd(dh1, dh3, dact, h1, h3, ne, I, limit);
    memset(dx, 0, (size_t)(ne * D) * sizeof(float));
    linear_bwd(dx, eg->w1, dh1, x, ew->w1, ne, D, I);
    linear_bwd(dx, eg->w3, dh3, x, ew->w3, ne, D, I);
}

/* Scratch of the routed-expert backward, each big enough for the rows one expert gets from one source. */
typedef struct {
    float *act, *dact, *dh1, *dh3; /* [N·K, I] */
    float *xe, *dye, *dxe, *dwe;   /* [N·K, D] ×3, [N·K] */
    float *wj;                     /* [N·K] routing weight of each assignment */
} moe_scratch;

/* Routed experts, every expert local, one at a time; dx scattered in a fixed (expert, token) order. */
static void moe_routed_bwd_local(const block_ctx *bc, block_acts *a, block_grads *g, float *dgw, const moe_scratch *s) {
    UNIT_PROLOGUE;
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    for (int64_t e = 0; e < E; e++) {
        int64_t j0 = a->eoff[e], ne = a->eoff[e + 1] - j0;
        if (ne == 0) continue;
        gather_rows(s->xe, a->xf, a->etok + j0, ne, D);
        gather_rows(s->dye, g->dffn, a->etok + j0, ne, D);
        expert_bwd(&W->experts[e], &Gw->experts[e], s->xe, s->dye, s->wj + j0, a->h1 + j0 * I, a->h3 + j0 * I, ne,
                   D, I, (float)c->swiglu_limit, s->dxe, s->dwe, s->act, s->dact, s->dh1, s->dh3);
        for (int64_t i = 0; i < ne; i++) dgw[(int64_t)a->etok[j0 + i] * K + a->eslot[j0 + i]] += s->dwe[i];
        scatter_add_rows(g->dxf, s->dxe, a->etok + j0, ne, D);
    }
}

/* Adds n floats of src into dst, in index order. */
static void add_into(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

/* Routed experts over EP. The output gradients travel to the experts' owners; each (expert, source)
 * block is differentiated on its own — weight gradients into a zeroed buffer that is then added to the
 * expert's gradient in source order — so the expert gradient is the rank-ordered sum of what each
 * source alone would give; (dx | d weight) rows come back in assignment order. */
static ds4_status moe_routed_bwd_ep(const block_ctx *bc, block_acts *a, block_grads *g, float *dgw,
                                    const moe_scratch *s) {
    UNIT_PROLOGUE;
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t K = c->n_activated_experts, I = c->moe_inter_dim, NK = N * K;
    const ds4_ep_route *r = a->route;
    const int64_t R = r->rows;
    const bool shape = ds4_shape_only(), split = r->nsrc > 1;
    float *dys = work(NK * D), *dyr = work(R * D), *dxr = work(R * (D + 1)), *dxs = work(NK * (D + 1));
    float *tmp = split ? work(3 * I * D) : NULL;
    ds4_status st = dys && dyr && dxr && dxs && (!split || tmp) ? DS4_OK
                                                                 : ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
    if (st == DS4_OK && !shape) gather_rows(dys, g->dffn, a->etok, NK, D);
    if (st == DS4_OK) st = bc->ep->dispatch(bc->ep->ctx, r, dys, dyr, D);
    expert_w tg = {tmp, tmp ? tmp + I * D : NULL, tmp ? tmp + 2 * I * D : NULL};
    for (int64_t i = 0, o = 0; st == DS4_OK && !shape && i < r->e1 - r->e0; i++) {
        const int64_t e = r->e0 + i;
        for (int src = 0; src < r->nsrc; o += r->recv_cnt[i * r->nsrc + src], src++) {
            const int64_t ne = r->recv_cnt[i * r->nsrc + src];
            if (ne == 0) continue;
            if (split) memset(tmp, 0, (size_t)(3 * I * D) * sizeof(float));
            expert_bwd(&W->experts[e], split ? &tg : &Gw->experts[e], a->xr + o * D, dyr + o * D, a->wr + o,
                       a->h1 + o * I, a->h3 + o * I, ne, D, I, (float)c->swiglu_limit, s->dxe, s->dwe, s->act, s->dact,
                       s->dh1, s->dh3);
            if (split) {
                add_into(Gw->experts[e].w1, tg.w1, I * D);
                add_into(Gw->experts[e].w2, tg.w2, I * D);
                add_into(Gw->experts[e].w3, tg.w3, I * D);
            }
            for (int64_t q = 0; q < ne; q++) {
                memcpy(dxr + (o + q) * (D + 1), s->dxe + q * D, (size_t)D * sizeof(float));
                dxr[(o + q) * (D + 1) + D] = s->dwe[q];
            }
        }
    }
    if (st == DS4_OK) st = bc->ep->combine(bc->ep->ctx, r, dxr, dxs, D + 1);
    for (int64_t j = 0; st == DS4_OK && !shape && j < NK; j++) {
        float *d = g->dxf + (int64_t)a->etok[j] * D;
        const float *src = dxs + j * (D + 1);
        for (int64_t k = 0; k < D; k++) d[k] += src[k];
        dgw[(int64_t)a->etok[j] * K + a->eslot[j]] += src[D];
    }
    ds4_free(dys);
    ds4_free(dyr);
    ds4_free(dxr);
    ds4_free(dxs);
    ds4_free(tmp);
    return st;
}

/* Backward of the MoE unit: dxf += …, expert and router weights' gradients. */
static ds4_status moe_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts, Imax = (K * I > Is ? K * I : Is);
    const float limit = (float)c->swiglu_limit;
    float *dgw = work_zeros(N * K), *dlog = work_zeros(N * E);
    moe_scratch s = {.act = work(N * Imax), .dact = work(N * Imax), .dh1 = work(N * Imax), .dh3 = work(N * Imax),
                     .xe = bc->ep ? NULL : work(N * K * D), .dye = bc->ep ? NULL : work(N * K * D),
                     .dxe = work(N * K * D), .dwe = work(N * K), .wj = work(N * K)};
    ds4_status st = DS4_OK;
    if (!dgw || !dlog || !s.act || !s.dact || !s.dh1 || !s.dh3 || (!bc->ep && (!s.xe || !s.dye)) || !s.dxe ||
        !s.dwe || !s.wj) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
        goto done;
    }
    const bool shape = ds4_shape_only(); /* memplan: no data, and no routing to follow */
    /* shared expert */
    swiglu_fwd(s.act, a->sh1, a->sh3, N, Is, limit);
    if (!shape) memset(s.dact, 0, (size_t)(N * Is) * sizeof(float));
    linear_bwd(s.dact, Gw->shared.w2, g->dffn, s.act, W->shared.w2, N, Is, D);
    if (!shape) memset(s.dh1, 0, (size_t)(N * Is) * sizeof(float));
    if (!shape) memset(s.dh3, 0, (size_t)(N * Is) * sizeof(float));
    swiglu_bwd(s.dh1, s.dh3, s.dact, a->sh1, a->sh3, N, Is, limit);
    linear_bwd(g->dxf, Gw->shared.w1, s.dh1, a->xf, W->shared.w1, N, D, Is);
    linear_bwd(g->dxf, Gw->shared.w3, s.dh3, a->xf, W->shared.w3, N, D, Is);
    /* routed experts */
    for (int64_t j = 0; !shape && j < N * K; j++) s.wj[j] = assignment_weight(a, j, K);
    if (bc->ep) st = moe_routed_bwd_ep(bc, a, g, dgw, &s);
    else if (!shape) moe_routed_bwd_local(bc, a, g, dgw, &s);
    if (st != DS4_OK) goto done;
    /* router */
    moe_gate_bwd(&(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)c->route_scale,
        .logits = a->glogits, .scores = a->gscores, .idx = a->gidx}, &(moe_gate_grads){.dweights = dgw,
        .dlogits = dlog});
    linear_bwd(g->dxf, Gw->gate, dlog, a->xf, W->gate, N, D, E);
done:
    ds4_free(dgw);
    ds4_free(dlog);
    ds4_free(s.act);
    ds4_free(s.dact);
    ds4_free(s.dh1);
    ds4_free(s.dh3);
    ds4_free(s.xe);
    ds4_free(s.dye);
    ds4_free(s.dxe);
    ds4_free(s.dwe);
    ds4_free(s.wj);
    return st;
}

/* Compressor backward from d(normalised, roped entries) (dout is rotated in place); dxa += … */
static ds4_status compressor_bwd(const block_ctx *bc, compressor_w *G, const compressor_w *W, float *dxa,
                                 float *dout, const float *ca, const float *cz, const float *pool, const float *rstd,
                                 const float *xa, int64_t r, int64_t d, int64_t Nc) {
    const int64_t B = bc->B, T = bc->T, N = B * T, D = bc->m->cfg.dim, coff = r == 4 ? 2 : 1;
    float *dpool = work_zeros(B * Nc * d), *da = work_zeros(N * coff * d), *dz = work_zeros(N * coff * d);
    ds4_status st = DS4_OK;
    if (!dpool || !da || !dz) st = ds4_fail(DS4_ERR_OOM, "out of memory in compressor backward");
    if (st == DS4_OK) {
        rope_bwd(dout, &(rope_args){.N = B * Nc, .H = 1, .hd = d, .period = Nc, .mult = r,
            .table = block_rope(bc->m, r), .inverse = false});
        rmsnorm_bwd(dpool, G->norm, dout, pool, W->norm, rstd, B * Nc, d);
        compressor_pool_bwd(&(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = r == 4},
            .a = ca, .z = cz, .ape = W->ape}, &(compressor_pool_grads){.dout = dpool, .da = da, .dz = dz,
            .dape = G->ape});
        linear_bwd(dxa, G->wkv, da, xa, W->wkv, N, D, coff * d);
        linear_bwd(dxa, G->wgate, dz, xa, W->wgate, N, D, coff * d);
    }
    ds4_free(dpool);
    ds4_free(da);
    ds4_free(dz);
    return st;
}

/* Indexer KL loss and its gradient into the indexer's own parameters (its inputs are detached). */
static ds4_status indexer_bwd(const block_ctx *bc, block_acts *a, double *kl_sum, int64_t *kl_rows) {
    UNIT_PROLOGUE;
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, QR = c->q_lora_rank, Nc = a->Nc;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t rows = usable_rows(B, T, 4);
    const float gscale = rows > 0 ? (float)(c->indexer_loss_coeff / (double)rows) : 0.0f;
    float *dqi = work_zeros(N * HI * dI), *dki = work_zeros(B * Nc * dI + 1), *dwi = work_zeros(N * HI);
    ds4_status st = DS4_OK;
    if (!dqi || !dki || !dwi) st = ds4_fail(DS4_ERR_OOM, "out of memory in indexer backward");
    double kl = 0;
    int64_t got = 0;
    const int64_t oom = ds4_alloc_failures();
    if (st == DS4_OK) {
        indexer_kl_fwd_bwd(&(indexer_kl_args){.dims = {.B = B, .T = T, .HI = HI, .dI = dI, .Nc = Nc, .ratio = 4,
            .K = sel ? c->index_topk : 0}, .H = c->n_heads, .c = c->head_dim, .scale = attn_scale(c),
            .wscale = indexer_wscale(c), .grad_scale = gscale, .qi = a->iqi, .ki = a->iki, .w = a->iwi, .q = a->q,
            .kvc = a->kvc, .lse = a->lse, .topk = sel, .dqi = dqi, .dki = dki, .dw = dwi, .kl_sum = &kl,
            .n_rows = &got});
        *kl_sum += kl;
        *kl_rows += got;
        st = kernel_status(oom, "indexer backward");
    }
    if (st == DS4_OK) {
        linear_bwd(NULL, Gw->idx_weights_proj, dwi, a->xa, W->idx_weights_proj, N, D, HI);
        rope_bwd(dqi, &(rope_args){.N = N, .H = HI, .hd = dI, .period = T, .mult = 1, .table = &m->rope_cmp,
            .inverse = false});
        linear_bwd(NULL, Gw->idx_wq_b, dqi, a->qr, W->idx_wq_b, N, QR, HI * dI);
        st = compressor_bwd(bc, &Gw->idx_cmp, &W->idx_cmp, NULL, dki, a->ica, a->icz, a->ipool, a->i_rstd, a->xa, 4,
                            dI, Nc);
    }
    ds4_free(dqi);
    ds4_free(dki);
    ds4_free(dwi);
    if (st == DS4_OK && got != rows && !ds4_shape_only())
        st = ds4_fail(DS4_ERR_INTERNAL, "indexer loss: %lld rows counted, %lld expected", (long long)got,
                      (long long)rows);
    return st;
}

/* Backward steps in order, each with the units whose outputs it reads. After the last step that
 * reads a unit, the unit's outputs (saved or replayed) are freed. */
typedef enum {
    B_HC_POST_FFN, B_MOE, B_FFN_NORM, B_HC_PRE_FFN, B_HC_POST_ATTN, B_O_PROJ, B_INDEXER, B_SPARSE_ATTN,
    B_COMPRESSOR, B_KV, B_Q_UP, B_Q_DOWN, B_ATTN_NORM, B_HC_PRE_ATTN, B_COUNT
} bwd_step;

static const uint32_t k_bwd_reads[B_COUNT] = {
    [B_HC_POST_FFN] = BIT(U_MOE) | BIT(U_HC_POST_ATTN) | BIT(U_HC_PRE_FFN),
    [B_MOE] = BIT(U_FFN_NORM) | BIT(U_ROUTER) | BIT(U_MOE),
    [B_FFN_NORM] = BIT(U_HC_PRE_FFN) | BIT(U_FFN_NORM),
    [B_HC_PRE_FFN] = BIT(U_HC_POST_ATTN) | BIT(U_HC_PRE_FFN),
    [B_HC_POST_ATTN] = BIT(U_O_PROJ) | BIT(U_HC_PRE_ATTN),
    [B_O_PROJ] = BIT(U_O_PROJ) | BIT(U_SPARSE_ATTN),
    [B_INDEXER] = BIT(U_INDEXER) | BIT(U_INDEXER_TOPK) | BIT(U_Q_UP) | BIT(U_COMPRESSOR) | BIT(U_SPARSE_ATTN) |
                  BIT(U_ATTN_NORM) | BIT(U_Q_DOWN),
    [B_SPARSE_ATTN] = BIT(U_SPARSE_ATTN) | BIT(U_Q_UP) | BIT(U_KV) | BIT(U_COMPRESSOR) | BIT(U_INDEXER_TOPK),
    [B_COMPRESSOR] = BIT(U_COMPRESSOR) | BIT(U_ATTN_NORM),
    [B_KV] = BIT(U_KV) | BIT(U_ATTN_NORM),
    [B_Q_UP] = BIT(U_Q_UP) | BIT(U_Q_DOWN),
    [B_Q_DOWN] = BIT(U_Q_DOWN) | BIT(U_ATTN_NORM),
    [B_ATTN_NORM] = BIT(U_HC_PRE_ATTN) | BIT(U_ATTN_NORM),
    [B_HC_PRE_ATTN] = BIT(U_HC_PRE_ATTN),
};

static ds4_status bwd_run_step(const block_ctx *bc, block_acts *a, block_grads *g, bwd_step s, float *dX_in,
                               const float *dX_out, double *kl_sum, int64_t *kl_rows) {
    UNIT_PROLOGUE;
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank, r = a->ratio;
    const int64_t G = c->o_groups, R = c->o_lora_rank;
    const ds4_rope *rope = block_rope(m, r);
    switch (s) {
    case B_HC_POST_FFN:
        hc_post_bwd(&(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = a->ffn_out, .res = a->X_mid,
            .post = a->hcF_post, .comb = a->hcF_comb}, &(hc_post_grads){.dY = dX_out, .dx = g->dffn, .dres = g->dX_mid,
            .dpost = g->dpostF, .dcomb = g->dcombF});
        return DS4_OK;
    case B_MOE: return moe_bwd(bc, a, g);
    case B_FFN_NORM: rmsnorm_bwd(g->dyF, Gw->ffn_norm, g->dxf, a->hcF_y, W->ffn_norm, a->xf_rstd, N, D); return DS4_OK;
    case B_HC_PRE_FFN:
        hc_pre_bwd(&(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
            .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = a->X_mid, .fn = W->hc_ffn_fn, .scale = W->hc_ffn_scale,
            .base = W->hc_ffn_base, .mixes = a->hcF_mixes, .rsqrt = a->hcF_rsqrt}, &(hc_pre_grads){.dy = g->dyF,
            .dpost = g->dpostF, .dcomb = g->dcombF, .dX = g->dX_mid, .dfn = Gw->hc_ffn_fn, .dscale = Gw->hc_ffn_scale,
            .dbase = Gw->hc_ffn_base});
        return DS4_OK;
    case B_HC_POST_ATTN:
        hc_post_bwd(&(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = a->attn_out, .res = a->X_in,
            .post = a->hcA_post, .comb = a->hcA_comb}, &(hc_post_grads){.dY = g->dX_mid, .dx = g->dattn, .dres = dX_in,
            .dpost = g->dpostA, .dcomb = g->dcombA});
        return DS4_OK;
    case B_O_PROJ: {
        float *o_r = inverse_roped_o(bc, a);
        if (!o_r) return ds4_fail(DS4_ERR_OOM, "out of memory in o_proj backward");
        linear_bwd(g->dz, Gw->wo_b, g->dattn, a->z, W->wo_b, N, G * R, D);
        grouped_linear_bwd(g->do_, Gw->wo_a, g->dz, o_r, W->wo_a, N, G, R, H * hd / G);
        rope_bwd(g->do_, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1, .table = rope,
            .inverse = true});
        ds4_free(o_r);
        return DS4_OK;
    }
    case B_INDEXER: return r == 4 ? indexer_bwd(bc, a, kl_sum, kl_rows) : DS4_OK;
    case B_SPARSE_ATTN: {
        const int32_t *sel = attn_selection(bc, a);
        const int64_t oom = ds4_alloc_failures();
        sparse_attn_bwd(&(sparse_attn_args){.dims = {.B = B, .T = T, .H = H, .c = hd, .window = c->window, .ratio = r,
            .Nc = a->Nc, .K = sel ? c->index_topk : 0}, .scale = attn_scale(c), .q = a->q, .kv = a->kv, .kvc = a->kvc,
            .sink = W->attn_sink, .topk = sel, .o = a->o, .lse = a->lse}, &(sparse_attn_grads){.dout = g->do_,
            .dq = g->dq, .dkv = g->dkv, .dkvc = r > 0 ? g->dkvc : NULL, .dsink = Gw->attn_sink});
        return kernel_status(oom, "sparse attention backward");
    }
    case B_COMPRESSOR:
        if (r == 0) return DS4_OK;
        return compressor_bwd(bc, &Gw->cmp, &W->cmp, g->dxa, g->dkvc, a->ca, a->cz, a->cpool, a->c_rstd, a->xa, r, hd,
                              a->Nc);
    case B_KV: {
        float *dkvraw = work_zeros(N * hd);
        if (!dkvraw) return ds4_fail(DS4_ERR_OOM, "out of memory in kv backward");
        rope_bwd(g->dkv, &(rope_args){.N = N, .H = 1, .hd = hd, .period = T, .mult = 1, .table = rope,
            .inverse = false});
        rmsnorm_bwd(dkvraw, Gw->kv_norm, g->dkv, a->kvraw, W->kv_norm, a->kv_rstd, N, hd);
        linear_bwd(g->dxa, Gw->wkv, dkvraw, a->xa, W->wkv, N, D, hd);
        ds4_free(dkvraw);
        return DS4_OK;
    }
    case B_Q_UP: {
        float *dqraw = work_zeros(N * H * hd);
        if (!dqraw) return ds4_fail(DS4_ERR_OOM, "out of memory in q backward");
        rope_bwd(g->dq, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1, .table = rope,
            .inverse = false});
        rmsnorm_bwd(dqraw, NULL, g->dq, a->qraw, NULL, a->q_rstd, N * H, hd);
        linear_bwd(g->dqr, Gw->wq_b, dqraw, a->qr, W->wq_b, N, QR, H * hd);
        ds4_free(dqraw);
        return DS4_OK;
    }
    case B_Q_DOWN: {
        float *dqa = work_zeros(N * QR);
        if (!dqa) return ds4_fail(DS4_ERR_OOM, "out of memory in q backward");
        rmsnorm_bwd(dqa, Gw->q_norm, g->dqr, a->qa, W->q_norm, a->qa_rstd, N, QR);
        linear_bwd(g->dxa, Gw->wq_a, dqa, a->xa, W->wq_a, N, D, QR);
        ds4_free(dqa);
        return DS4_OK;
    }
    case B_ATTN_NORM: rmsnorm_bwd(g->dyA, Gw->attn_norm, g->dxa, a->hcA_y, W->attn_norm, a->xa_rstd, N, D); return DS4_OK;
    case B_HC_PRE_ATTN:
        hc_pre_bwd(&(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
            .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = a->X_in, .fn = W->hc_attn_fn, .scale = W->hc_attn_scale,
            .base = W->hc_attn_base, .mixes = a->hcA_mixes, .rsqrt = a->hcA_rsqrt}, &(hc_pre_grads){.dy = g->dyA,
            .dpost = g->dpostA, .dcomb = g->dcombA, .dX = dX_in, .dfn = Gw->hc_attn_fn, .dscale = Gw->hc_attn_scale,
            .dbase = Gw->hc_attn_base});
        return DS4_OK;
    default: return ds4_fail(DS4_ERR_INTERNAL, "unknown backward step %d", (int)s);
    }
}

ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *dX_out, float *dX_in, double *kl_sum,
                     int64_t *kl_rows) {
    /* last backward step reading each unit */
    int last[U_COUNT];
    for (int u = 0; u < U_COUNT; u++) {
        last[u] = -1;
        for (int s = 0; s < B_COUNT; s++)
            if (k_bwd_reads[s] & BIT(u)) last[u] = s;
    }
    block_grads g;
    ds4_status st = grads_alloc(bc, a, &g);
    for (int s = 0; s < B_COUNT && st == DS4_OK; s++) {
        st = need_all(bc, a, k_bwd_reads[s]);
        if (st == DS4_OK) st = bwd_run_step(bc, a, &g, (bwd_step)s, dX_in, dX_out, kl_sum, kl_rows);
        for (int u = 0; u < U_COUNT; u++)
            if (last[u] == s && a->present[u]) unit_release(a, (unit_id)u);
    }
    grads_free(&g);
    block_acts_free(a);
    return st;
}
