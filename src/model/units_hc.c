/* The mHC units of a block (docs/dsv4-architecture.md §2.2): pre and post around attention and around
 * the FFN. X: [N, n, D] streams; pre mixes them into one row y: [N, D] (post: [N, n], comb: [N, n, n]
 * say how the sub-layer's output goes back); post writes the next streams. */
#include "model/block.h"

static const act_slot k_hc_pre_outs[] = {
    [HC_MIXES] = {"mixes", ACT_F32, {X_N, X_MIX}},
    [HC_RSQRT] = {"rsqrt", ACT_F32, {X_N}},
    [HC_POST] = {"post", ACT_F32, {X_N, X_HC}},
    [HC_COMB] = {"comb", ACT_F32, {X_N, X_HC, X_HC}},
    [HC_Y] = {"y", ACT_F32_BF16, {X_N, X_D}},
};

/* ------------------------------------------------------------------ hc_pre_attn: from the block input */
static ds4_status hc_pre_attn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_ATTN;
    hc_pre_fwd(&bc->m->exec, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
        .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = a->X_in, .fn = W->hc_attn_fn, .scale = W->hc_attn_scale,
        .base = W->hc_attn_base, .y = F32(u, HC_Y), .post = F32(u, HC_POST), .comb = F32(u, HC_COMB),
        .mixes = F32(u, HC_MIXES), .rsqrt = F32(u, HC_RSQRT)});
    return DS4_OK;
}

static ds4_status hc_pre_attn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_ATTN;
    hc_pre_bwd(&bc->m->exec, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
        .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = a->X_in, .fn = W->hc_attn_fn, .scale = W->hc_attn_scale,
        .base = W->hc_attn_base, .mixes = F32(u, HC_MIXES), .rsqrt = F32(u, HC_RSQRT)},
        &(hc_pre_grads){.dy = g->dyA, .dpost = g->dpostA, .dcomb = g->dcombA, .dX = g->dX_in, .dfn = Gw->hc_attn_fn,
        .dscale = Gw->hc_attn_scale, .dbase = Gw->hc_attn_base});
    return DS4_OK;
}

const unit_decl unit_hc_pre_attn = {
    .name = "hc_pre_attn",
    .inputs = 0, /* the block input X_in */
    .outs = k_hc_pre_outs, .nouts = 5,
    .fwd = hc_pre_attn_fwd, .bwd = hc_pre_attn_bwd,
    .bwd_reads = UNIT_BIT(U_HC_PRE_ATTN),
};

/* ------------------------------------------------------------------ hc_post_attn: X_mid */
static const act_slot k_hc_post_attn_outs[] = {[HP_X] = {"X_mid", ACT_F32_BF16, {X_N, X_HC, X_D}}};

static ds4_status hc_post_attn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    hc_post_fwd(&bc->m->exec, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = F32(U_O_PROJ, OP_OUT), .res = a->X_in,
        .post = F32(U_HC_PRE_ATTN, HC_POST), .comb = F32(U_HC_PRE_ATTN, HC_COMB), .Y = F32(U_HC_POST_ATTN, HP_X)});
    return DS4_OK;
}

static ds4_status hc_post_attn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    hc_post_bwd(&bc->m->exec, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = F32(U_O_PROJ, OP_OUT), .res = a->X_in,
        .post = F32(U_HC_PRE_ATTN, HC_POST), .comb = F32(U_HC_PRE_ATTN, HC_COMB)}, &(hc_post_grads){.dY = g->dX_mid,
        .dx = g->dattn, .dres = g->dX_in, .dpost = g->dpostA, .dcomb = g->dcombA});
    return DS4_OK;
}

const unit_decl unit_hc_post_attn = {
    .name = "hc_post_attn",
    .inputs = UNIT_BIT(U_O_PROJ) | UNIT_BIT(U_HC_PRE_ATTN),
    .outs = k_hc_post_attn_outs, .nouts = 1,
    .fwd = hc_post_attn_fwd, .bwd = hc_post_attn_bwd,
    .bwd_reads = UNIT_BIT(U_O_PROJ) | UNIT_BIT(U_HC_PRE_ATTN),
};

/* ------------------------------------------------------------------ hc_pre_ffn: from X_mid */
static ds4_status hc_pre_ffn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_FFN;
    hc_pre_fwd(&bc->m->exec, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
        .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = F32(U_HC_POST_ATTN, HP_X), .fn = W->hc_ffn_fn,
        .scale = W->hc_ffn_scale, .base = W->hc_ffn_base, .y = F32(u, HC_Y), .post = F32(u, HC_POST),
        .comb = F32(u, HC_COMB), .mixes = F32(u, HC_MIXES), .rsqrt = F32(u, HC_RSQRT)});
    return DS4_OK;
}

static ds4_status hc_pre_ffn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_FFN;
    hc_pre_bwd(&bc->m->exec, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = c->hc_sinkhorn_iters},
        .hc_eps = (float)c->hc_eps, .norm_eps = eps, .X = F32(U_HC_POST_ATTN, HP_X), .fn = W->hc_ffn_fn,
        .scale = W->hc_ffn_scale, .base = W->hc_ffn_base, .mixes = F32(u, HC_MIXES), .rsqrt = F32(u, HC_RSQRT)},
        &(hc_pre_grads){.dy = g->dyF, .dpost = g->dpostF, .dcomb = g->dcombF, .dX = g->dX_mid, .dfn = Gw->hc_ffn_fn,
        .dscale = Gw->hc_ffn_scale, .dbase = Gw->hc_ffn_base});
    return DS4_OK;
}

const unit_decl unit_hc_pre_ffn = {
    .name = "hc_pre_ffn",
    .inputs = UNIT_BIT(U_HC_POST_ATTN),
    .outs = k_hc_pre_outs, .nouts = 5,
    .fwd = hc_pre_ffn_fwd, .bwd = hc_pre_ffn_bwd,
    .bwd_reads = UNIT_BIT(U_HC_POST_ATTN) | UNIT_BIT(U_HC_PRE_FFN),
};

/* ------------------------------------------------------------------ hc_post_ffn: the block output */
static ds4_status hc_post_ffn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    hc_post_fwd(&bc->m->exec, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = F32(U_MOE, MOE_OUT),
        .res = F32(U_HC_POST_ATTN, HP_X), .post = F32(U_HC_PRE_FFN, HC_POST), .comb = F32(U_HC_PRE_FFN, HC_COMB),
        .Y = a->X_out});
    return DS4_OK;
}

static ds4_status hc_post_ffn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    hc_post_bwd(&bc->m->exec, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = F32(U_MOE, MOE_OUT),
        .res = F32(U_HC_POST_ATTN, HP_X), .post = F32(U_HC_PRE_FFN, HC_POST), .comb = F32(U_HC_PRE_FFN, HC_COMB)},
        &(hc_post_grads){.dY = g->dX_out, .dx = g->dffn, .dres = g->dX_mid, .dpost = g->dpostF, .dcomb = g->dcombF});
    return DS4_OK;
}

/* Its output X_out belongs to the pass (the next block's input): nothing saved, never released. */
const unit_decl unit_hc_post_ffn = {
    .name = "hc_post_ffn",
    .inputs = UNIT_BIT(U_MOE) | UNIT_BIT(U_HC_POST_ATTN) | UNIT_BIT(U_HC_PRE_FFN),
    .fwd = hc_post_ffn_fwd, .bwd = hc_post_ffn_bwd,
    .bwd_reads = UNIT_BIT(U_MOE) | UNIT_BIT(U_HC_POST_ATTN) | UNIT_BIT(U_HC_PRE_FFN),
};
