/* The attention units of a block (docs/dsv4-architecture.md §3, §4): attn_norm → q_down → q_up → kv →
 * compressor → indexer → indexer_topk → sparse_attn → o_proj. Each unit: its saved outputs, forward,
 * backward, declaration. Forwards overwrite, backwards accumulate. */
#include "model/block.h"

#include <string.h>

/* ------------------------------------------------------------------ attn_norm: xa = attn_norm(y) */
static const act_slot k_attn_norm_outs[] = {
    [NORM_X] = {"xa", ACT_F32, {X_N, X_D}},
    [NORM_RSTD] = {"rstd", ACT_F32, {X_N}},
};

static ds4_status attn_norm_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    rmsnorm_fwd(F32(U_ATTN_NORM, NORM_X), F32(U_ATTN_NORM, NORM_RSTD), F32(U_HC_PRE_ATTN, HC_Y), W->attn_norm, N, D,
                eps);
    return DS4_OK;
}

static ds4_status attn_norm_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    rmsnorm_bwd(g->dyA, Gw->attn_norm, g->dxa, F32(U_HC_PRE_ATTN, HC_Y), W->attn_norm, F32(U_ATTN_NORM, NORM_RSTD),
                N, D);
    return DS4_OK;
}

const unit_decl unit_attn_norm = {
    .name = "attn_norm",
    .inputs = UNIT_BIT(U_HC_PRE_ATTN),
    .outs = k_attn_norm_outs, .nouts = 2,
    .fwd = attn_norm_fwd, .bwd = attn_norm_bwd,
    .bwd_reads = UNIT_BIT(U_HC_PRE_ATTN) | UNIT_BIT(U_ATTN_NORM),
};

/* ------------------------------------------------------------------ q_down: qr = q_norm(wq_a xa) */
/* qr: [N, QR], also the indexer's query latent */
static const act_slot k_q_down_outs[] = {
    [QD_QA] = {"qa", ACT_F32, {X_N, X_QR}},
    [QD_RSTD] = {"rstd", ACT_F32, {X_N}},
    [QD_QR] = {"qr", ACT_F32, {X_N, X_QR}},
};

static ds4_status q_down_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t QR = c->q_lora_rank;
    linear_fwd(F32(U_Q_DOWN, QD_QA), F32(U_ATTN_NORM, NORM_X), W->wq_a, N, D, QR);
    rmsnorm_fwd(F32(U_Q_DOWN, QD_QR), F32(U_Q_DOWN, QD_RSTD), F32(U_Q_DOWN, QD_QA), W->q_norm, N, QR, eps);
    return DS4_OK;
}

static ds4_status q_down_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t QR = c->q_lora_rank;
    float *dqa = work_zeros(N * QR);
    if (!dqa) return ds4_fail(DS4_ERR_OOM, "out of memory in q backward");
    rmsnorm_bwd(dqa, Gw->q_norm, g->dqr, F32(U_Q_DOWN, QD_QA), W->q_norm, F32(U_Q_DOWN, QD_RSTD), N, QR);
    linear_bwd(g->dxa, Gw->wq_a, dqa, F32(U_ATTN_NORM, NORM_X), W->wq_a, N, D, QR);
    ds4_free(dqa);
    return DS4_OK;
}

const unit_decl unit_q_down = {
    .name = "q_down",
    .inputs = UNIT_BIT(U_ATTN_NORM),
    .outs = k_q_down_outs, .nouts = 3,
    .fwd = q_down_fwd, .bwd = q_down_bwd,
    .bwd_reads = UNIT_BIT(U_Q_DOWN) | UNIT_BIT(U_ATTN_NORM),
};

/* ------------------------------------------------------------------ q_up: q = rope(headnorm(wq_b qr)) */
static const act_slot k_q_up_outs[] = {
    [QU_RAW] = {"qraw", ACT_F32, {X_N, X_H, X_HD}},
    [QU_RSTD] = {"rstd", ACT_F32, {X_N, X_H}},
    [QU_Q] = {"q", ACT_F32, {X_N, X_H, X_HD}}, /* normalised, roped */
};

static ds4_status q_up_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    float *q = F32(U_Q_UP, QU_Q);
    linear_fwd(F32(U_Q_UP, QU_RAW), F32(U_Q_DOWN, QD_QR), W->wq_b, N, QR, H * hd);
    rmsnorm_fwd(q, F32(U_Q_UP, QU_RSTD), F32(U_Q_UP, QU_RAW), NULL, N * H, hd, eps);
    rope_fwd(q, N, H, hd, T, 1, block_rope(m, a->ratio), false);
    return DS4_OK;
}

static ds4_status q_up_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    float *dqraw = work_zeros(N * H * hd);
    if (!dqraw) return ds4_fail(DS4_ERR_OOM, "out of memory in q backward");
    rope_bwd(g->dq, N, H, hd, T, 1, block_rope(m, a->ratio), false);
    rmsnorm_bwd(dqraw, NULL, g->dq, F32(U_Q_UP, QU_RAW), NULL, F32(U_Q_UP, QU_RSTD), N * H, hd);
    linear_bwd(g->dqr, Gw->wq_b, dqraw, F32(U_Q_DOWN, QD_QR), W->wq_b, N, QR, H * hd);
    ds4_free(dqraw);
    return DS4_OK;
}

const unit_decl unit_q_up = {
    .name = "q_up",
    .inputs = UNIT_BIT(U_Q_DOWN),
    .outs = k_q_up_outs, .nouts = 3,
    .fwd = q_up_fwd, .bwd = q_up_bwd,
    .bwd_reads = UNIT_BIT(U_Q_UP) | UNIT_BIT(U_Q_DOWN),
};

/* ------------------------------------------------------------------ kv = rope(kv_norm(wkv xa)) */
/* kv: [N, hd], the one shared K = V head */
static const act_slot k_kv_outs[] = {
    [KV_RAW] = {"kvraw", ACT_F32, {X_N, X_HD}},
    [KV_RSTD] = {"rstd", ACT_F32, {X_N}},
    [KV_KV] = {"kv", ACT_F32, {X_N, X_HD}}, /* normalised, roped */
};

static ds4_status kv_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t hd = c->head_dim;
    float *kv = F32(U_KV, KV_KV);
    linear_fwd(F32(U_KV, KV_RAW), F32(U_ATTN_NORM, NORM_X), W->wkv, N, D, hd);
    rmsnorm_fwd(kv, F32(U_KV, KV_RSTD), F32(U_KV, KV_RAW), W->kv_norm, N, hd, eps);
    rope_fwd(kv, N, 1, hd, T, 1, block_rope(m, a->ratio), false);
    return DS4_OK;
}

static ds4_status kv_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t hd = c->head_dim;
    float *dkvraw = work_zeros(N * hd);
    if (!dkvraw) return ds4_fail(DS4_ERR_OOM, "out of memory in kv backward");
    rope_bwd(g->dkv, N, 1, hd, T, 1, block_rope(m, a->ratio), false);
    rmsnorm_bwd(dkvraw, Gw->kv_norm, g->dkv, F32(U_KV, KV_RAW), W->kv_norm, F32(U_KV, KV_RSTD), N, hd);
    linear_bwd(g->dxa, Gw->wkv, dkvraw, F32(U_ATTN_NORM, NORM_X), W->wkv, N, D, hd);
    ds4_free(dkvraw);
    return DS4_OK;
}

const unit_decl unit_kv = {
    .name = "kv",
    .inputs = UNIT_BIT(U_ATTN_NORM),
    .outs = k_kv_outs, .nouts = 3,
    .fwd = kv_fwd, .bwd = kv_bwd,
    .bwd_reads = UNIT_BIT(U_KV) | UNIT_BIT(U_ATTN_NORM),
};

/* ------------------------------------------------------------------ compressors */
/* One compressor of ratio r and entry width d, its slots from `first` of unit u (CMP_* order):
 * out [B, Nc, d] = rope(norm(pool(wkv xa, wgate xa))), entry i roped at i·r. */
static void compress_fwd(const block_ctx *bc, block_acts *a, unit_id u, int first, const compressor_w *cw, int64_t r,
                         int64_t d) {
    UNIT_PROLOGUE;
    const int64_t coff = r == 4 ? 2 : 1, Nc = a->Nc;
    float *ca = F32(u, first + CMP_A), *cz = F32(u, first + CMP_Z), *pool = F32(u, first + CMP_POOL);
    float *out = F32(u, first + CMP_OUT);
    const float *xa = F32(U_ATTN_NORM, NORM_X);
    linear_fwd(ca, xa, cw->wkv, N, D, coff * d);
    linear_fwd(cz, xa, cw->wgate, N, D, coff * d);
    compressor_pool_fwd(pool, ca, cz, cw->ape, B, T, r, d, r == 4);
    rmsnorm_fwd(out, F32(u, first + CMP_RSTD), pool, cw->norm, B * Nc, d, eps);
    rope_fwd(out, B * Nc, 1, d, Nc, r, block_rope(m, r), false);
}

/* Its backward from d(normalised, roped entries) (dout is rotated in place); dxa += … (NULL: detached). */
static ds4_status compress_bwd(const block_ctx *bc, block_acts *a, unit_id u, int first, compressor_w *G,
                               const compressor_w *cw, float *dxa, float *dout, int64_t r, int64_t d) {
    UNIT_PROLOGUE;
    const int64_t coff = r == 4 ? 2 : 1, Nc = a->Nc;
    const float *ca = F32(u, first + CMP_A), *cz = F32(u, first + CMP_Z), *xa = F32(U_ATTN_NORM, NORM_X);
    float *dpool = work_zeros(B * Nc * d), *da = work_zeros(N * coff * d), *dz = work_zeros(N * coff * d);
    ds4_status st = DS4_OK;
    if (!dpool || !da || !dz) st = ds4_fail(DS4_ERR_OOM, "out of memory in compressor backward");
    if (st == DS4_OK) {
        rope_bwd(dout, B * Nc, 1, d, Nc, r, block_rope(m, r), false);
        rmsnorm_bwd(dpool, G->norm, dout, F32(u, first + CMP_POOL), cw->norm, F32(u, first + CMP_RSTD), B * Nc, d);
        compressor_pool_bwd(da, dz, G->ape, dpool, ca, cz, cw->ape, B, T, r, d, r == 4);
        linear_bwd(dxa, G->wkv, da, xa, cw->wkv, N, D, coff * d);
        linear_bwd(dxa, G->wgate, dz, xa, cw->wgate, N, D, coff * d);
    }
    ds4_free(dpool);
    ds4_free(da);
    ds4_free(dz);
    return st;
}

/* compressor: kvc [B, Nc, hd] (ratio > 0) */
static const act_slot k_compressor_outs[] = {
    [CMP_A] = {"a", ACT_F32, {X_N, X_CMP_C}},
    [CMP_Z] = {"z", ACT_F32, {X_N, X_CMP_C}},
    [CMP_POOL] = {"pool", ACT_F32, {X_B, X_NC, X_HD}},
    [CMP_RSTD] = {"rstd", ACT_F32, {X_B, X_NC}},
    [CMP_OUT] = {"kvc", ACT_F32, {X_B, X_NC, X_HD}}, /* normalised, roped */
};

static ds4_status compressor_fwd(const block_ctx *bc, block_acts *a) {
    compress_fwd(bc, a, U_COMPRESSOR, 0, &bc->m->w.blocks[bc->layer].cmp, a->ratio, bc->m->cfg.head_dim);
    return DS4_OK;
}

static ds4_status compressor_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    return compress_bwd(bc, a, U_COMPRESSOR, 0, &Gw->cmp, &W->cmp, g->dxa, g->dkvc, a->ratio, c->head_dim);
}

const unit_decl unit_compressor = {
    .name = "compressor",
    .on = ON_COMPRESSED,
    .inputs = UNIT_BIT(U_ATTN_NORM),
    .outs = k_compressor_outs, .nouts = 5,
    .fwd = compressor_fwd, .bwd = compressor_bwd,
    .bwd_reads = UNIT_BIT(U_COMPRESSOR) | UNIT_BIT(U_ATTN_NORM),
};

/* ------------------------------------------------------------------ indexer (CSA) */
/* Lightning indexer: queries, weights and compressed keys from xa, qr (detached in backward). */
static const act_slot k_indexer_outs[] = {
    [IDX_QI] = {"qi", ACT_F32, {X_N, X_HI, X_DI}}, /* roped */
    [IDX_WI] = {"wi", ACT_F32, {X_N, X_HI}},
    [IDX_CMP + CMP_A] = {"a", ACT_F32, {X_N, X_IDX_C}},
    [IDX_CMP + CMP_Z] = {"z", ACT_F32, {X_N, X_IDX_C}},
    [IDX_CMP + CMP_POOL] = {"pool", ACT_F32, {X_B, X_NC, X_DI}},
    [IDX_CMP + CMP_RSTD] = {"rstd", ACT_F32, {X_B, X_NC}},
    [IDX_CMP + CMP_OUT] = {"ki", ACT_F32, {X_B, X_NC, X_DI}},
};

static ds4_status indexer_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, QR = c->q_lora_rank;
    float *qi = F32(U_INDEXER, IDX_QI);
    linear_fwd(qi, F32(U_Q_DOWN, QD_QR), W->idx_wq_b, N, QR, HI * dI);
    rope_fwd(qi, N, HI, dI, T, 1, &m->rope_cmp, false);
    linear_fwd(F32(U_INDEXER, IDX_WI), F32(U_ATTN_NORM, NORM_X), W->idx_weights_proj, N, D, HI);
    compress_fwd(bc, a, U_INDEXER, IDX_CMP, &W->idx_cmp, 4, dI);
    return DS4_OK;
}

/* The indexer KL loss (the layer's, into kl_sum / kl_rows) and its gradient into the indexer's own
 * parameters (its inputs are detached). */
static ds4_status indexer_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
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
        indexer_kl_fwd_bwd(&kl, &got, dqi, dki, dwi, F32(U_INDEXER, IDX_QI), F32(U_INDEXER, IDX_CMP + CMP_OUT),
                           F32(U_INDEXER, IDX_WI), sel, F32(U_Q_UP, QU_Q), F32(U_COMPRESSOR, CMP_OUT),
                           F32(U_SPARSE_ATTN, SA_LSE), B, T, c->n_heads, c->head_dim, HI, dI, Nc, 4,
                           sel ? c->index_topk : 0, attn_scale(c), indexer_wscale(c), gscale);
        *g->kl_sum += kl;
        *g->kl_rows += got;
        st = kernel_status(oom, "indexer backward");
    }
    if (st == DS4_OK) {
        linear_bwd(NULL, Gw->idx_weights_proj, dwi, F32(U_ATTN_NORM, NORM_X), W->idx_weights_proj, N, D, HI);
        rope_bwd(dqi, N, HI, dI, T, 1, &m->rope_cmp, false);
        linear_bwd(NULL, Gw->idx_wq_b, dqi, F32(U_Q_DOWN, QD_QR), W->idx_wq_b, N, QR, HI * dI);
        st = compress_bwd(bc, a, U_INDEXER, IDX_CMP, &Gw->idx_cmp, &W->idx_cmp, NULL, dki, 4, dI);
    }
    ds4_free(dqi);
    ds4_free(dki);
    ds4_free(dwi);
    if (st == DS4_OK && got != rows && !ds4_shape_only())
        st = ds4_fail(DS4_ERR_INTERNAL, "indexer loss: %lld rows counted, %lld expected", (long long)got,
                      (long long)rows);
    return st;
}

/* Its backward is the KL against the attention's distribution, so it reads the attention's inputs and
 * log-sum-exp, and runs before sparse attention's backward. */
const unit_decl unit_indexer = {
    .name = "indexer",
    .on = ON_CSA,
    .inputs = UNIT_BIT(U_ATTN_NORM) | UNIT_BIT(U_Q_DOWN),
    .outs = k_indexer_outs, .nouts = 7,
    .fwd = indexer_fwd, .bwd = indexer_bwd,
    .bwd_reads = UNIT_BIT(U_INDEXER) | UNIT_BIT(U_INDEXER_TOPK) | UNIT_BIT(U_Q_UP) | UNIT_BIT(U_COMPRESSOR) |
                 UNIT_BIT(U_SPARSE_ATTN) | UNIT_BIT(U_ATTN_NORM) | UNIT_BIT(U_Q_DOWN),
};

/* ------------------------------------------------------------------ indexer_topk */
/* Top-k of the indexer scores: [N, index_topk], ties to the lower index. Small: kept even when the
 * indexer is released. */
static const act_slot k_indexer_topk_outs[] = {[TOPK_SEL] = {"topk", ACT_I32, {X_N, X_TOPK}}};

static ds4_status indexer_topk_fwd_unit(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t oom = ds4_alloc_failures();
    indexer_topk_fwd(I32(U_INDEXER_TOPK, TOPK_SEL), F32(U_INDEXER, IDX_QI), F32(U_INDEXER, IDX_CMP + CMP_OUT),
                     F32(U_INDEXER, IDX_WI), B, T, c->index_n_heads, c->index_head_dim, a->Nc, 4, c->index_topk,
                     indexer_wscale(c));
    return kernel_status(oom, "indexer top-k");
}

/* A selection: no gradient of its own. */
const unit_decl unit_indexer_topk = {
    .name = "indexer_topk",
    .on = ON_CSA,
    .inputs = UNIT_BIT(U_INDEXER),
    .outs = k_indexer_topk_outs, .nouts = 1,
    .fwd = indexer_topk_fwd_unit,
};

/* ------------------------------------------------------------------ sparse_attn */
/* Sparse attention over window + (selected | all usable) compressed entries, with the sink. */
static const act_slot k_sparse_attn_outs[] = {
    [SA_O] = {"o", ACT_F32, {X_N, X_H, X_HD}},
    [SA_LSE] = {"lse", ACT_F32, {X_N, X_H}},
};

static ds4_status sparse_attn_fwd_unit(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t oom = ds4_alloc_failures();
    sparse_attn_fwd(F32(U_SPARSE_ATTN, SA_O), F32(U_SPARSE_ATTN, SA_LSE), F32(U_Q_UP, QU_Q), F32(U_KV, KV_KV),
                    F32(U_COMPRESSOR, CMP_OUT), sel, W->attn_sink, B, T, H, hd, c->window, a->ratio, a->Nc,
                    sel ? c->index_topk : 0, attn_scale(c));
    return kernel_status(oom, "sparse attention");
}

static ds4_status sparse_attn_bwd_unit(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, r = a->ratio;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t oom = ds4_alloc_failures();
    sparse_attn_bwd(g->dq, g->dkv, r > 0 ? g->dkvc : NULL, Gw->attn_sink, g->do_, F32(U_SPARSE_ATTN, SA_O),
                    F32(U_SPARSE_ATTN, SA_LSE), F32(U_Q_UP, QU_Q), F32(U_KV, KV_KV), F32(U_COMPRESSOR, CMP_OUT), sel,
                    W->attn_sink, B, T, H, hd, c->window, r, a->Nc, sel ? c->index_topk : 0, attn_scale(c));
    return kernel_status(oom, "sparse attention backward");
}

const unit_decl unit_sparse_attn = {
    .name = "sparse_attn",
    .inputs = UNIT_BIT(U_Q_UP) | UNIT_BIT(U_KV) | UNIT_BIT(U_COMPRESSOR) | UNIT_BIT(U_INDEXER_TOPK),
    .outs = k_sparse_attn_outs, .nouts = 2,
    .fwd = sparse_attn_fwd_unit, .bwd = sparse_attn_bwd_unit,
    .bwd_reads = UNIT_BIT(U_SPARSE_ATTN) | UNIT_BIT(U_Q_UP) | UNIT_BIT(U_KV) | UNIT_BIT(U_COMPRESSOR) |
                 UNIT_BIT(U_INDEXER_TOPK),
};

/* ------------------------------------------------------------------ o_proj */
/* attn_out [N, D] = wo_b(wo_a(inverse_rope(o))), grouped wo_a. The inverse-roped o is cheap to rebuild,
 * so o_proj keeps only its GEMM outputs. */
static const act_slot k_o_proj_outs[] = {
    [OP_Z] = {"z", ACT_F32, {X_N, X_GR}},
    [OP_OUT] = {"attn_out", ACT_F32, {X_N, X_D}},
};

/* Workspace copy of o with the inverse rope at the query position: [N, H, hd]. */
static float *inverse_roped_o(const block_ctx *bc, const block_acts *a) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t N = bc->B * bc->T, H = c->n_heads, hd = c->head_dim;
    float *o_r = work(N * H * hd);
    if (!o_r) return NULL;
    if (!ds4_shape_only()) memcpy(o_r, F32(U_SPARSE_ATTN, SA_O), (size_t)(N * H * hd) * sizeof(float));
    rope_fwd(o_r, N, H, hd, bc->T, 1, block_rope(bc->m, a->ratio), true);
    return o_r;
}

static ds4_status o_proj_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, R = c->o_lora_rank;
    float *o_r = inverse_roped_o(bc, a);
    if (!o_r) return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer);
    grouped_linear_fwd(F32(U_O_PROJ, OP_Z), o_r, W->wo_a, N, G, R, H * hd / G);
    linear_fwd(F32(U_O_PROJ, OP_OUT), F32(U_O_PROJ, OP_Z), W->wo_b, N, G * R, D);
    ds4_free(o_r);
    return DS4_OK;
}

static ds4_status o_proj_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, R = c->o_lora_rank;
    float *o_r = inverse_roped_o(bc, a);
    if (!o_r) return ds4_fail(DS4_ERR_OOM, "out of memory in o_proj backward");
    linear_bwd(g->dz, Gw->wo_b, g->dattn, F32(U_O_PROJ, OP_Z), W->wo_b, N, G * R, D);
    grouped_linear_bwd(g->do_, Gw->wo_a, g->dz, o_r, W->wo_a, N, G, R, H * hd / G);
    rope_bwd(g->do_, N, H, hd, T, 1, block_rope(m, a->ratio), true);
    ds4_free(o_r);
    return DS4_OK;
}

const unit_decl unit_o_proj = {
    .name = "o_proj",
    .inputs = UNIT_BIT(U_SPARSE_ATTN),
    .outs = k_o_proj_outs, .nouts = 2,
    .fwd = o_proj_fwd, .bwd = o_proj_bwd,
    .bwd_reads = UNIT_BIT(U_O_PROJ) | UNIT_BIT(U_SPARSE_ATTN),
};
