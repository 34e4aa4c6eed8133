/* The attention units of a block (docs/dsv4-architecture.md §3, §4): attn_norm → q_down → q_up → kv →
 * compressor → indexer → indexer_topk → sparse_attn → o_proj. Each unit: its saved outputs, forward,
 * backward, declaration; the units that look across positions also have the cached decoder's variant
 * (one position against the layer's cache, model/decode.c). Forwards overwrite, backwards accumulate. */
#include "model/block.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------ attn_norm: xa = attn_norm(y) */
static const act_slot k_attn_norm_outs[] = {
    [NORM_X] = {"xa", ACT_F32_BF16, {X_N, X_D}},
    [NORM_RSTD] = {"rstd", ACT_F32, {X_N}},
};

static ds4_status attn_norm_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    rmsnorm_fwd(&bc->m->exec, F32(U_ATTN_NORM, NORM_X), F32(U_ATTN_NORM, NORM_RSTD), F32(U_HC_PRE_ATTN, HC_Y), W->attn_norm, N, D,
                eps);
    return DS4_OK;
}

static ds4_status attn_norm_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    rmsnorm_bwd(&bc->m->exec, g->dyA, Gw->attn_norm, g->dxa, F32(U_HC_PRE_ATTN, HC_Y), W->attn_norm, F32(U_ATTN_NORM, NORM_RSTD),
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
    [QD_QA] = {"qa", ACT_F32_BF16, {X_N, X_QR}},
    [QD_RSTD] = {"rstd", ACT_F32, {X_N}},
    [QD_QR] = {"qr", ACT_F32_BF16, {X_N, X_QR}},
};

static ds4_status q_down_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t QR = c->q_lora_rank;
    model_linear_fwd(m, F32(U_Q_DOWN, QD_QA), F32(U_ATTN_NORM, NORM_X), W->wq_a, N, D, QR);
    rmsnorm_fwd(&bc->m->exec, F32(U_Q_DOWN, QD_QR), F32(U_Q_DOWN, QD_RSTD), F32(U_Q_DOWN, QD_QA), W->q_norm, N, QR, eps);
    return DS4_OK;
}

static ds4_status q_down_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t QR = c->q_lora_rank;
    float *dqa = work_zeros(bc, N * QR);
    if (!dqa) return ds4_fail(DS4_ERR_OOM, "out of memory in q backward");
    rmsnorm_bwd(&bc->m->exec, dqa, Gw->q_norm, g->dqr, F32(U_Q_DOWN, QD_QA), W->q_norm, F32(U_Q_DOWN, QD_RSTD), N, QR);
    model_linear_bwd(m, g->dxa, Gw->wq_a, dqa, F32(U_ATTN_NORM, NORM_X), W->wq_a, N, D, QR);
    work_free(bc, dqa);
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
    [QU_RAW] = {"qraw", ACT_F32_BF16, {X_N, X_H, X_HD}},
    [QU_RSTD] = {"rstd", ACT_F32, {X_N, X_H}},
    [QU_Q] = {"q", ACT_F32_BF16, {X_N, X_H, X_HD}}, /* normalised, roped */
};

static ds4_status q_up_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    float *q = F32(U_Q_UP, QU_Q);
    model_linear_fwd(m, F32(U_Q_UP, QU_RAW), F32(U_Q_DOWN, QD_QR), W->wq_b, N, QR, H * hd);
    rmsnorm_fwd(&bc->m->exec, q, F32(U_Q_UP, QU_RSTD), F32(U_Q_UP, QU_RAW), NULL, N * H, hd, eps);
    rope_fwd(&bc->m->exec, q, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1, .table = block_rope(bc, a->ratio),
        .inverse = false});
    return DS4_OK;
}

static ds4_status q_up_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank;
    /* dqraw [N, H, hd] takes the buffer of o's gradient, which sparse attention's backward (the last reader)
     * has consumed: no second [N, H, hd] in the workspace */
    float *dqraw = g->do_;
    tensor_zero(&bc->m->exec, dqraw, (size_t)(N * H * hd) * sizeof(float));
    rope_bwd(&bc->m->exec, g->dq, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1,
        .table = block_rope(bc, a->ratio), .inverse = false});
    rmsnorm_bwd(&bc->m->exec, dqraw, NULL, g->dq, F32(U_Q_UP, QU_RAW), NULL, F32(U_Q_UP, QU_RSTD), N * H, hd);
    model_linear_bwd(m, g->dqr, Gw->wq_b, dqraw, F32(U_Q_DOWN, QD_QR), W->wq_b, N, QR, H * hd);
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
    [KV_RAW] = {"kvraw", ACT_F32_BF16, {X_N, X_HD}},
    [KV_RSTD] = {"rstd", ACT_F32, {X_N}},
    [KV_KV] = {"kv", ACT_BF16, {X_N, X_HD}}, /* normalised, roped; read by attention only */
};

static ds4_status kv_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t hd = c->head_dim;
    float *kv = F32(U_KV, KV_KV);
    model_linear_fwd(m, F32(U_KV, KV_RAW), F32(U_ATTN_NORM, NORM_X), W->wkv, N, D, hd);
    rmsnorm_fwd(&bc->m->exec, kv, F32(U_KV, KV_RSTD), F32(U_KV, KV_RAW), W->kv_norm, N, hd, eps);
    rope_fwd(&bc->m->exec, kv, &(rope_args){.N = N, .H = 1, .hd = hd, .period = T, .mult = 1, .table = block_rope(bc, a->ratio),
        .inverse = false});
    return DS4_OK;
}

static ds4_status kv_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t hd = c->head_dim;
    float *dkvraw = work_zeros(bc, N * hd);
    if (!dkvraw) return ds4_fail(DS4_ERR_OOM, "out of memory in kv backward");
    rope_bwd(&bc->m->exec, g->dkv, &(rope_args){.N = N, .H = 1, .hd = hd, .period = T, .mult = 1,
        .table = block_rope(bc, a->ratio), .inverse = false});
    rmsnorm_bwd(&bc->m->exec, dkvraw, Gw->kv_norm, g->dkv, F32(U_KV, KV_RAW), W->kv_norm, F32(U_KV, KV_RSTD), N, hd);
    model_linear_bwd(m, g->dxa, Gw->wkv, dkvraw, F32(U_ATTN_NORM, NORM_X), W->wkv, N, D, hd);
    work_free(bc, dkvraw);
    return DS4_OK;
}

/* Decoding: the position's kv also goes into the window ring. */
static ds4_status kv_decode(const block_ctx *bc, block_acts *a, unit_cache *kc) {
    const int64_t hd = bc->m->cfg.head_dim;
    DS4_TRY(kv_fwd(bc, a));
    tensor_copy(&bc->m->exec, kc->keys + (kc->ncap + kc->pos % bc->m->cfg.window) * hd, F32(U_KV, KV_KV),
                (size_t)hd * sizeof(float));
    return DS4_OK;
}

const unit_decl unit_kv = {
    .name = "kv",
    .inputs = UNIT_BIT(U_ATTN_NORM),
    .outs = k_kv_outs, .nouts = 3,
    .fwd = kv_fwd, .bwd = kv_bwd, .decode = kv_decode,
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
    model_linear_fwd(m, ca, xa, cw->wkv, N, D, coff * d);
    model_linear_fwd(m, cz, xa, cw->wgate, N, D, coff * d);
    compressor_pool_fwd(&bc->m->exec, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = r == 4},
        .a = ca, .z = cz, .ape = cw->ape, .out = pool});
    rmsnorm_fwd(&bc->m->exec, out, F32(u, first + CMP_RSTD), pool, cw->norm, B * Nc, d, eps);
    rope_fwd(&bc->m->exec, out, &(rope_args){.N = B * Nc, .H = 1, .hd = d, .period = Nc, .mult = r, .table = block_rope(bc, r),
        .inverse = false});
}

/* Its backward from d(normalised, roped entries) (dout is rotated in place); dxa += … (NULL: detached). */
static ds4_status compress_bwd(const block_ctx *bc, block_acts *a, unit_id u, int first, compressor_w *G,
                               const compressor_w *cw, float *dxa, float *dout, int64_t r, int64_t d) {
    UNIT_PROLOGUE;
    const int64_t coff = r == 4 ? 2 : 1, Nc = a->Nc;
    const float *ca = F32(u, first + CMP_A), *cz = F32(u, first + CMP_Z), *xa = F32(U_ATTN_NORM, NORM_X);
    float *dpool = work_zeros(bc, B * Nc * d), *da = work_zeros(bc, N * coff * d), *dz = work_zeros(bc, N * coff * d);
    ds4_status st = DS4_OK;
    if (!dpool || !da || !dz) st = ds4_fail(DS4_ERR_OOM, "out of memory in compressor backward");
    if (st == DS4_OK) {
        rope_bwd(&bc->m->exec, dout, &(rope_args){.N = B * Nc, .H = 1, .hd = d, .period = Nc, .mult = r,
            .table = block_rope(bc, r), .inverse = false});
        rmsnorm_bwd(&bc->m->exec, dpool, G->norm, dout, F32(u, first + CMP_POOL), cw->norm, F32(u, first + CMP_RSTD), B * Nc, d);
        compressor_pool_bwd(&bc->m->exec, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = r == 4},
            .a = ca, .z = cz, .ape = cw->ape}, &(compressor_pool_grads){.dout = dpool, .da = da, .dz = dz,
            .dape = G->ape});
        model_linear_bwd(m, dxa, G->wkv, da, xa, cw->wkv, N, D, coff * d);
        model_linear_bwd(m, dxa, G->wgate, dz, xa, cw->wgate, N, D, coff * d);
    }
    work_free(bc, dpool);
    work_free(bc, da);
    work_free(bc, dz);
    return st;
}

/* Decoding: appends position p's wkv / wgate rows (from xa: [D]) to the pending block; when the block
 * completes, (p + 1) % r == 0, emits entry i = (p + 1)/r − 1 = rope(norm(pool)) at position i·r, as the
 * pass's pooling of that block (T = r, or T = 2r with the previous block for ratio 4, taking entry 1). */
static void compress_decode(const block_ctx *bc, unit_cache *kc, cmp_cache *cs, const compressor_w *cw,
    const float *xa) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t p = kc->pos, r = cs->r, d = cs->d, C = cs->C, row = (cs->overlap ? r : 0) + p % r;
    model_linear_fwd(bc->m, cs->a + row * C, xa, cw->wkv, 1, c->dim, C);   // [C]
    model_linear_fwd(bc->m, cs->z + row * C, xa, cw->wgate, 1, c->dim, C); // [C]
    if ((p + 1) % r != 0) return;
    const int64_t i = (p + 1) / r - 1;
    const float *pooled = kc->pool; // [d]
    if (!cs->overlap) {
        compressor_pool_fwd(&bc->m->exec, &(compressor_pool_args){.dims = {.B = 1, .T = r, .r = r, .d = d, .overlap = false},
            .a = cs->a, .z = cs->z, .ape = cw->ape, .out = kc->pool});
    } else if (i == 0) { /* no previous block: the current block alone, as the pass's entry 0 */
        compressor_pool_fwd(&bc->m->exec, &(compressor_pool_args){.dims = {.B = 1, .T = r, .r = r, .d = d, .overlap = true},
            .a = cs->a + r * C, .z = cs->z + r * C, .ape = cw->ape, .out = kc->pool});
    } else { /* [previous | current] as a 2-entry sequence; its entry 1 is this one */
        compressor_pool_fwd(&bc->m->exec, &(compressor_pool_args){.dims = {.B = 1, .T = 2 * r, .r = r, .d = d, .overlap = true},
            .a = cs->a, .z = cs->z, .ape = cw->ape, .out = kc->pool});
        pooled = kc->pool + d;
    }
    if (cs->overlap) { /* the current block becomes the previous one */
        tensor_copy(&bc->m->exec, cs->a, cs->a + r * C, (size_t)(r * C) * sizeof(float));
        tensor_copy(&bc->m->exec, cs->z, cs->z + r * C, (size_t)(r * C) * sizeof(float));
    }
    float *e = cs->out + i * d; // [d]
    const ds4_rope at = rope_view(&bc->m->rope_cmp, i * r); /* the entry's position */
    rmsnorm_fwd(&bc->m->exec, e, kc->rstd, pooled, cw->norm, 1, d, (float)c->norm_eps);
    rope_fwd(&bc->m->exec, e, &(rope_args){.N = 1, .H = 1, .hd = d, .period = 1, .mult = 1, .table = &at, .inverse = false});
    cs->n = i + 1;
}

/* compressor: kvc [B, Nc, hd] (ratio > 0) */
static const act_slot k_compressor_outs[] = {
    [CMP_A] = {"a", ACT_F32_BF16, {X_N, X_CMP_C}},
    [CMP_Z] = {"z", ACT_F32, {X_N, X_CMP_C}},
    [CMP_POOL] = {"pool", ACT_F32_BF16, {X_B, X_NC, X_HD}},
    [CMP_RSTD] = {"rstd", ACT_F32, {X_B, X_NC}},
    [CMP_OUT] = {"kvc", ACT_BF16, {X_B, X_NC, X_HD}}, /* normalised, roped; read by attention and the indexer KL */
};

static ds4_status compressor_fwd(const block_ctx *bc, block_acts *a) {
    compress_fwd(bc, a, U_COMPRESSOR, 0, &bc->m->w.blocks[bc->layer].cmp, a->ratio, bc->m->cfg.head_dim);
    return DS4_OK;
}

static ds4_status compressor_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    return compress_bwd(bc, a, U_COMPRESSOR, 0, &Gw->cmp, &W->cmp, g->dxa, g->dkvc, a->ratio, c->head_dim);
}

static ds4_status compressor_decode(const block_ctx *bc, block_acts *a, unit_cache *kc) {
    compress_decode(bc, kc, &kc->cmp, &bc->m->w.blocks[bc->layer].cmp, F32(U_ATTN_NORM, NORM_X));
    return DS4_OK;
}

const unit_decl unit_compressor = {
    .name = "compressor",
    .on = ON_COMPRESSED,
    .inputs = UNIT_BIT(U_ATTN_NORM),
    .outs = k_compressor_outs, .nouts = 5,
    .fwd = compressor_fwd, .bwd = compressor_bwd, .decode = compressor_decode,
    .bwd_reads = UNIT_BIT(U_COMPRESSOR) | UNIT_BIT(U_ATTN_NORM),
};

/* ------------------------------------------------------------------ indexer (CSA) */
/* Lightning indexer: queries, weights and compressed keys from xa, qr (detached in backward). */
static const act_slot k_indexer_outs[] = {
    [IDX_QI] = {"qi", ACT_F32_BF16, {X_N, X_HI, X_DI}}, /* roped */
    [IDX_WI] = {"wi", ACT_F32, {X_N, X_HI}},
    [IDX_CMP + CMP_A] = {"a", ACT_F32_BF16, {X_N, X_IDX_C}},
    [IDX_CMP + CMP_Z] = {"z", ACT_F32, {X_N, X_IDX_C}},
    [IDX_CMP + CMP_POOL] = {"pool", ACT_F32_BF16, {X_B, X_NC, X_DI}},
    [IDX_CMP + CMP_RSTD] = {"rstd", ACT_F32, {X_B, X_NC}},
    [IDX_CMP + CMP_OUT] = {"ki", ACT_BF16, {X_B, X_NC, X_DI}}, /* read by the indexer's top-k and KL */
};

/* The indexer's queries qi (roped) and head weights wi of every position. */
static void indexer_queries(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, QR = c->q_lora_rank;
    float *qi = F32(U_INDEXER, IDX_QI);
    model_linear_fwd(m, qi, F32(U_Q_DOWN, QD_QR), W->idx_wq_b, N, QR, HI * dI);
    rope_fwd(&bc->m->exec, qi, &(rope_args){.N = N, .H = HI, .hd = dI, .period = T, .mult = 1, .table = bc->rope_cmp,
        .inverse = false});
    model_linear_fwd(m, F32(U_INDEXER, IDX_WI), F32(U_ATTN_NORM, NORM_X), W->idx_weights_proj, N, D, HI);
}

static ds4_status indexer_fwd(const block_ctx *bc, block_acts *a) {
    indexer_queries(bc, a);
    compress_fwd(bc, a, U_INDEXER, IDX_CMP, &bc->m->w.blocks[bc->layer].idx_cmp, 4, bc->m->cfg.index_head_dim);
    return DS4_OK;
}

/* Decoding: the position's queries; its keys join the indexer's compressed entries in the cache. */
static ds4_status indexer_decode(const block_ctx *bc, block_acts *a, unit_cache *kc) {
    indexer_queries(bc, a);
    compress_decode(bc, kc, &kc->icmp, &bc->m->w.blocks[bc->layer].idx_cmp, F32(U_ATTN_NORM, NORM_X));
    return DS4_OK;
}

/* The indexer KL loss (the layer's: the kernel writes it into g->kl_sum / g->kl_rows, the layer's slots of the
 * pass's scalars on the backend) and its gradient into the indexer's own parameters (its inputs are
 * detached). */
static ds4_status indexer_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, QR = c->q_lora_rank, Nc = a->Nc;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t rows = indexer_kl_rows(&bc->m->exec, B, T, 4); /* the rows the KL scores (a plan: none) */
    const float gscale = rows > 0 ? (float)(c->indexer_loss_coeff / (double)rows) : 0.0f;
    float *dqi = work_zeros(bc, N * HI * dI), *dki = work_zeros(bc, B * Nc * dI + 1), *dwi = work_zeros(bc, N * HI);
    ds4_status st = DS4_OK;
    if (!dqi || !dki || !dwi) st = ds4_fail(DS4_ERR_OOM, "out of memory in indexer backward");
    const int64_t oom = ds4_alloc_failures();
    if (st == DS4_OK) {
        indexer_kl_fwd_bwd(&bc->m->exec, &(indexer_kl_args){.dims = {.B = B, .T = T, .HI = HI, .dI = dI, .Nc = Nc, .ratio = 4,
            .K = sel ? c->index_topk : 0}, .H = c->n_heads, .c = c->head_dim, .scale = attn_scale(c),
            .wscale = indexer_wscale(c), .grad_scale = gscale, .qi = F32(U_INDEXER, IDX_QI),
            .ki = KEYS_F32(U_INDEXER, IDX_CMP + CMP_OUT), .ki16 = KEYS_BF16(U_INDEXER, IDX_CMP + CMP_OUT),
            .w = F32(U_INDEXER, IDX_WI), .q = F32(U_Q_UP, QU_Q), .kvc = KEYS_F32(U_COMPRESSOR, CMP_OUT),
            .kvc16 = KEYS_BF16(U_COMPRESSOR, CMP_OUT), .lse = F32(U_SPARSE_ATTN, SA_LSE), .topk = sel, .dqi = dqi,
            .dki = dki, .dw = dwi, .kl_sum = g->kl_sum, .n_rows = g->kl_rows});
        st = kernel_status(oom, "indexer backward");
    }
    if (st == DS4_OK) {
        model_linear_bwd(m, NULL, Gw->idx_weights_proj, dwi, F32(U_ATTN_NORM, NORM_X), W->idx_weights_proj, N, D, HI);
        rope_bwd(&bc->m->exec, dqi, &(rope_args){.N = N, .H = HI, .hd = dI, .period = T, .mult = 1, .table = bc->rope_cmp,
            .inverse = false});
        model_linear_bwd(m, NULL, Gw->idx_wq_b, dqi, F32(U_Q_DOWN, QD_QR), W->idx_wq_b, N, QR, HI * dI);
        st = compress_bwd(bc, a, U_INDEXER, IDX_CMP, &Gw->idx_cmp, &W->idx_cmp, NULL, dki, 4, dI);
    }
    work_free(bc, dqi);
    work_free(bc, dki);
    work_free(bc, dwi);
    return st; /* the rows it counted are checked against `rows` once they reach the host (model.c) */
}

/* Its backward is the KL against the attention's distribution, so it reads the attention's inputs and
 * log-sum-exp, and runs before sparse attention's backward. */
const unit_decl unit_indexer = {
    .name = "indexer",
    .on = ON_CSA,
    .inputs = UNIT_BIT(U_ATTN_NORM) | UNIT_BIT(U_Q_DOWN),
    .outs = k_indexer_outs, .nouts = 7,
    .fwd = indexer_fwd, .bwd = indexer_bwd, .decode = indexer_decode,
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
    indexer_topk_fwd(&bc->m->exec, &(indexer_topk_args){.dims = {.B = B, .T = T, .HI = c->index_n_heads, .dI = c->index_head_dim,
        .Nc = a->Nc, .ratio = 4, .K = c->index_topk}, .wscale = indexer_wscale(c), .qi = F32(U_INDEXER, IDX_QI),
        .ki = KEYS_F32(U_INDEXER, IDX_CMP + CMP_OUT), .ki16 = KEYS_BF16(U_INDEXER, IDX_CMP + CMP_OUT),
        .w = F32(U_INDEXER, IDX_WI), .topk = I32(U_INDEXER_TOPK, TOPK_SEL)});
    return kernel_status(oom, "indexer top-k");
}

/* Decoding: the top-k of the position's row over the indexer entries emitted so far, by the indexer's
 * kernel for one row at position p (T = 1, t0 = p): the same scores and selection as the pass's row p. */
static ds4_status indexer_topk_decode(const block_ctx *bc, block_acts *a, unit_cache *kc) {
    if (bc->dense_csa) return DS4_OK;
    const ds4_config *c = &bc->m->cfg;
    const int64_t oom = ds4_alloc_failures();
    indexer_topk_fwd(&bc->m->exec, &(indexer_topk_args){.dims = {.B = 1, .T = 1, .HI = c->index_n_heads,
        .dI = c->index_head_dim, .Nc = kc->icmp.n, .ratio = 4, .K = c->index_topk}, .t0 = kc->pos,
        .wscale = indexer_wscale(c), .qi = F32(U_INDEXER, IDX_QI), .ki = kc->icmp.out, .w = F32(U_INDEXER, IDX_WI),
        .topk = I32(U_INDEXER_TOPK, TOPK_SEL)});
    return kernel_status(oom, "the decoder's indexer top-k");
}

/* A selection: no gradient of its own. */
const unit_decl unit_indexer_topk = {
    .name = "indexer_topk",
    .on = ON_CSA,
    .inputs = UNIT_BIT(U_INDEXER),
    .outs = k_indexer_topk_outs, .nouts = 1,
    .fwd = indexer_topk_fwd_unit, .decode = indexer_topk_decode,
};

/* ------------------------------------------------------------------ sparse_attn */
/* Sparse attention over window + (selected | all usable) compressed entries, with the sink. */
static const act_slot k_sparse_attn_outs[] = {
    [SA_O] = {"o", ACT_F32_BF16, {X_N, X_H, X_HD}},
    [SA_LSE] = {"lse", ACT_F32, {X_N, X_H}},
};

static ds4_status sparse_attn_fwd_unit(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t oom = ds4_alloc_failures();
    sparse_attn_fwd(&bc->m->exec, &(sparse_attn_args){.dims = {.B = B, .T = T, .H = H, .c = hd, .window = c->window,
        .ratio = a->ratio, .Nc = a->Nc, .K = sel ? c->index_topk : 0}, .scale = attn_scale(c),
        .q = F32(U_Q_UP, QU_Q), .kv = KEYS_F32(U_KV, KV_KV), .kvc = KEYS_F32(U_COMPRESSOR, CMP_OUT),
        .kv16 = KEYS_BF16(U_KV, KV_KV), .kvc16 = KEYS_BF16(U_COMPRESSOR, CMP_OUT), .sink = W->attn_sink,
        .topk = sel, .o = F32(U_SPARSE_ATTN, SA_O), .lse = F32(U_SPARSE_ATTN, SA_LSE)});
    return kernel_status(oom, "sparse attention");
}

static ds4_status sparse_attn_bwd_unit(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, r = a->ratio;
    const int32_t *sel = attn_selection(bc, a);
    const int64_t oom = ds4_alloc_failures();
    sparse_attn_bwd(&bc->m->exec, &(sparse_attn_args){.dims = {.B = B, .T = T, .H = H, .c = hd, .window = c->window, .ratio = r,
        .Nc = a->Nc, .K = sel ? c->index_topk : 0}, .scale = attn_scale(c), .q = F32(U_Q_UP, QU_Q),
        .kv = KEYS_F32(U_KV, KV_KV), .kvc = KEYS_F32(U_COMPRESSOR, CMP_OUT), .kv16 = KEYS_BF16(U_KV, KV_KV),
        .kvc16 = KEYS_BF16(U_COMPRESSOR, CMP_OUT), .sink = W->attn_sink, .topk = sel,
        .o = F32(U_SPARSE_ATTN, SA_O), .lse = F32(U_SPARSE_ATTN, SA_LSE)}, &(sparse_attn_grads){.dout = g->do_,
        .dq = g->dq, .dkv = g->dkv, .dkvc = r > 0 ? g->dkvc : NULL, .dsink = Gw->attn_sink});
    return kernel_status(oom, "sparse attention backward");
}

/* Decoding: the query at p over the window and the compressed entries (selected by the top-k on sparse
 * CSA layers, all emitted otherwise) with the sink: a T = 1, window 0 call whose "compressed entries" are
 * the layer's key buffer and whose top-k list names the keys in the pass's order (window rows by
 * position, then the compressed entries), so the kernel runs the same row math. The list is built on the
 * host (the selection read back: a wait per CSA layer and token) and copied over. */
static ds4_status sparse_attn_decode(const block_ctx *bc, block_acts *a, unit_cache *kc) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t win = c->window, H = c->n_heads, hd = c->head_dim, p = kc->pos;
    const int32_t *sel = attn_selection(bc, a);
    int32_t *list = kc->keylist_host;
    int64_t nk = 0;
    for (int64_t j = p - win + 1 > 0 ? p - win + 1 : 0; j <= p; j++) list[nk++] = (int32_t)(kc->ncap + j % win);
    if (kc->ratio > 0) {
        if (sel) {
            ds4_model_to_host(bc->m, kc->sel_host, sel, (size_t)c->index_topk * sizeof(int32_t));
            for (int64_t k = 0; k < c->index_topk; k++)
                if (kc->sel_host[k] >= 0) list[nk++] = kc->sel_host[k];
        } else {
            for (int64_t i = 0; i < kc->cmp.n; i++) list[nk++] = (int32_t)i;
        }
    }
    ds4_model_to_device(bc->m, kc->keylist, list, (size_t)nk * sizeof(int32_t));
    sparse_attn_fwd(&bc->m->exec, &(sparse_attn_args){.dims = {.B = 1, .T = 1, .H = H, .c = hd, .window = 0, .ratio = 1,
        .Nc = kc->ncap + win, .K = nk}, .scale = attn_scale(c), .q = F32(U_Q_UP, QU_Q), .kv = kc->keys,
        .kvc = kc->keys, .sink = bc->m->w.blocks[bc->layer].attn_sink, .topk = kc->keylist,
        .o = F32(U_SPARSE_ATTN, SA_O), .lse = F32(U_SPARSE_ATTN, SA_LSE)});
    return DS4_OK;
}

const unit_decl unit_sparse_attn = {
    .name = "sparse_attn",
    .inputs = UNIT_BIT(U_Q_UP) | UNIT_BIT(U_KV) | UNIT_BIT(U_COMPRESSOR) | UNIT_BIT(U_INDEXER_TOPK),
    .outs = k_sparse_attn_outs, .nouts = 2,
    .fwd = sparse_attn_fwd_unit, .bwd = sparse_attn_bwd_unit, .decode = sparse_attn_decode,
    .bwd_reads = UNIT_BIT(U_SPARSE_ATTN) | UNIT_BIT(U_Q_UP) | UNIT_BIT(U_KV) | UNIT_BIT(U_COMPRESSOR) |
                 UNIT_BIT(U_INDEXER_TOPK),
};

/* ------------------------------------------------------------------ o_proj */
/* attn_out [N, D] = wo_b(wo_a(inverse_rope(o))), grouped wo_a. The inverse-roped o is cheap to rebuild,
 * so o_proj keeps only its GEMM outputs. */
static const act_slot k_o_proj_outs[] = {
    [OP_Z] = {"z", ACT_F32_BF16, {X_N, X_GR}},
    [OP_OUT] = {"attn_out", ACT_F32_BF16, {X_N, X_D}},
};

/* o with the inverse rope at the query position, [N, H, hd], built in o_r (the backward's whole copy). */
static float *inverse_roped_o(const block_ctx *bc, const block_acts *a, float *o_r) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t N = bc->B * bc->T, H = c->n_heads, hd = c->head_dim;
    tensor_copy(&bc->m->exec, o_r, F32(U_SPARSE_ATTN, SA_O), (size_t)(N * H * hd) * sizeof(float));
    rope_fwd(&bc->m->exec, o_r, &(rope_args){.N = N, .H = H, .hd = hd, .period = bc->T, .mult = 1,
        .table = block_rope(bc, a->ratio), .inverse = true});
    return o_r;
}

/* The forward makes and consumes the inverse-roped o in tiles of at most this many tokens of one sequence:
 * its copy is [O_PROJ_TILE, H, hd] whatever T. Each tile is a block of rows of the grouped GEMM, whose rows
 * do not change another row's sums (the K slicing is the engine's), so the bits are the whole GEMM's. */
#define O_PROJ_TILE 128

static ds4_status o_proj_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, R = c->o_lora_rank;
    const int64_t tile = T < O_PROJ_TILE ? T : O_PROJ_TILE;
    float *o_r = work(bc, tile * H * hd); /* [tile, H, hd] */
    if (!o_r) return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer);
    const ds4_rope *rope = block_rope(bc, a->ratio);
    const float *o = F32(U_SPARSE_ATTN, SA_O);
    float *z = F32(U_O_PROJ, OP_Z); /* [N, G·R] */
    for (int64_t b = 0; b < B; b++)
        for (int64_t t0 = 0; t0 < T; t0 += tile) {
            const int64_t rows = T - t0 < tile ? T - t0 : tile, n0 = b * T + t0;
            tensor_copy(&m->exec, o_r, o + n0 * H * hd, (size_t)(rows * H * hd) * sizeof(float));
            ds4_rope at = *rope; /* the table from position t0: row i of the tile sits at t0 + i */
            at.cos += t0 * (rope->rd / 2);
            at.sin += t0 * (rope->rd / 2);
            at.max_pos = rope->max_pos - t0;
            rope_fwd(&m->exec, o_r, &(rope_args){.N = rows, .H = H, .hd = hd, .period = rows, .mult = 1, .table = &at,
                .inverse = true});
            model_grouped_linear_fwd(m, z + n0 * G * R, o_r, W->wo_a, rows, G, R, H * hd / G);
        }
    work_free(bc, o_r);
    model_linear_fwd(m, F32(U_O_PROJ, OP_OUT), z, W->wo_b, N, G * R, D);
    return DS4_OK;
}

static ds4_status o_proj_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t H = c->n_heads, hd = c->head_dim, G = c->o_groups, R = c->o_lora_rank;
    /* the copy [N, H, hd] is built in the buffer of q's gradient, which nothing has written yet (sparse
     * attention's backward, its first writer, comes next): zeroed again after its last read */
    float *o_r = inverse_roped_o(bc, a, g->dq);
    model_linear_bwd(m, g->dz, Gw->wo_b, g->dattn, F32(U_O_PROJ, OP_Z), W->wo_b, N, G * R, D);
    model_grouped_linear_bwd(m, g->do_, Gw->wo_a, g->dz, o_r, W->wo_a, N, G, R, H * hd / G);
    tensor_zero(&bc->m->exec, g->dq, (size_t)(N * H * hd) * sizeof(float));
    rope_bwd(&bc->m->exec, g->do_, &(rope_args){.N = N, .H = H, .hd = hd, .period = T, .mult = 1,
        .table = block_rope(bc, a->ratio), .inverse = true});
    return DS4_OK;
}

const unit_decl unit_o_proj = {
    .name = "o_proj",
    .inputs = UNIT_BIT(U_SPARSE_ATTN),
    .outs = k_o_proj_outs, .nouts = 2,
    .fwd = o_proj_fwd, .bwd = o_proj_bwd,
    .bwd_reads = UNIT_BIT(U_O_PROJ) | UNIT_BIT(U_SPARSE_ATTN),
};
