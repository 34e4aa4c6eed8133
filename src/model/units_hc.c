/* The mHC units of a block (docs/dsv4-architecture.md §2.2): pre and post around attention and around
 * the FFN. X: [N, n, D] streams; pre mixes them into one row y: [N, D] (post: [N, n], comb: [N, n, n]
 * say how the sub-layer's output goes back); post writes the next streams. */
#include "model/block.h"

static const act_slot k_hc_pre_outs[] = {
    [HC_MIXES] = {"mixes", ACT_F32, {X_N, X_MIX}},
    [HC_RSQRT] = {"rsqrt", ACT_F32, {X_N}},
    [HC_POST] = {"post", ACT_F32, {X_N, X_HC}},
    [HC_COMB] = {"comb", ACT_F32, {X_N, X_HC, X_HC}},
    [HC_Y] = {"y", ACT_F32, {X_N, X_D}},
};

/* ------------------------------------------------------------------ hc_pre_attn: from the block input */
static ds4_status hc_pre_attn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_ATTN;
    hc_pre_fwd(F32(u, HC_Y), F32(u, HC_POST), F32(u, HC_COMB), F32(u, HC_MIXES), F32(u, HC_RSQRT), a->X_in,
               W->hc_attn_fn, W->hc_attn_scale, W->hc_attn_base, N, n, D, c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
    return DS4_OK;
}

static ds4_status hc_pre_attn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_ATTN;
    hc_pre_bwd(g->dX_in, Gw->hc_attn_fn, Gw->hc_attn_scale, Gw->hc_attn_base, g->dyA, g->dpostA, g->dcombA, a->X_in,
               W->hc_attn_fn, W->hc_attn_scale, W->hc_attn_base, F32(u, HC_MIXES), F32(u, HC_RSQRT), N, n, D,
               c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
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
static const act_slot k_hc_post_attn_outs[] = {[HP_X] = {"X_mid", ACT_F32, {X_N, X_HC, X_D}}};

static ds4_status hc_post_attn_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    hc_post_fwd(F32(U_HC_POST_ATTN, HP_X), F32(U_O_PROJ, OP_OUT), a->X_in, F32(U_HC_PRE_ATTN, HC_POST),
                F32(U_HC_PRE_ATTN, HC_COMB), N, n, D);
    return DS4_OK;
}

static ds4_status hc_post_attn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    hc_post_bwd(g->dattn, g->dX_in, g->dpostA, g->dcombA, g->dX_mid, F32(U_O_PROJ, OP_OUT), a->X_in,
                F32(U_HC_PRE_ATTN, HC_POST), F32(U_HC_PRE_ATTN, HC_COMB), N, n, D);
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
    hc_pre_fwd(F32(u, HC_Y), F32(u, HC_POST), F32(u, HC_COMB), F32(u, HC_MIXES), F32(u, HC_RSQRT),
               F32(U_HC_POST_ATTN, HP_X), W->hc_ffn_fn, W->hc_ffn_scale, W->hc_ffn_base, N, n, D,
               c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
    return DS4_OK;
}

static ds4_status hc_pre_ffn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const unit_id u = U_HC_PRE_FFN;
    hc_pre_bwd(g->dX_mid, Gw->hc_ffn_fn, Gw->hc_ffn_scale, Gw->hc_ffn_base, g->dyF, g->dpostF, g->dcombF,
               F32(U_HC_POST_ATTN, HP_X), W->hc_ffn_fn, W->hc_ffn_scale, W->hc_ffn_base, F32(u, HC_MIXES),
               F32(u, HC_RSQRT), N, n, D, c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
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
    hc_post_fwd(a->X_out, F32(U_MOE, MOE_OUT), F32(U_HC_POST_ATTN, HP_X), F32(U_HC_PRE_FFN, HC_POST),
                F32(U_HC_PRE_FFN, HC_COMB), N, n, D);
    return DS4_OK;
}

static ds4_status hc_post_ffn_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    hc_post_bwd(g->dffn, g->dX_mid, g->dpostF, g->dcombF, g->dX_out, F32(U_MOE, MOE_OUT), F32(U_HC_POST_ATTN, HP_X),
                F32(U_HC_PRE_FFN, HC_POST), F32(U_HC_PRE_FFN, HC_COMB), N, n, D);
    return DS4_OK;
}

/* Its output X_out belongs to the pass (the next block's input): nothing saved, never released. */
const unit_decl unit_hc_post_ffn = {
    .name = "hc_post_ffn",
    .inputs = UNIT_BIT(U_MOE) | UNIT_BIT(U_HC_POST_ATTN) | UNIT_BIT(U_HC_PRE_FFN),
    .fwd = hc_post_ffn_fwd, .bwd = hc_post_ffn_bwd,
    .bwd_reads = UNIT_BIT(U_MOE) | UNIT_BIT(U_HC_POST_ATTN) | UNIT_BIT(U_HC_PRE_FFN),
};
