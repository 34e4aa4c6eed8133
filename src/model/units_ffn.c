/* The FFN units of a block (docs/dsv4-architecture.md §5): ffn_norm → router → moe. Each unit: its
 * saved outputs, forward, backward, declaration. Forwards overwrite, backwards accumulate. */
#include "model/block.h"

#include <string.h>

/* ------------------------------------------------------------------ ffn_norm: xf = ffn_norm(y) */
static const act_slot k_ffn_norm_outs[] = {
    [NORM_X] = {"xf", ACT_F32_BF16, {X_N, X_D}},
    [NORM_RSTD] = {"rstd", ACT_F32, {X_N}},
};

static ds4_status ffn_norm_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    rmsnorm_fwd(&bc->m->exec, F32(U_FFN_NORM, NORM_X), F32(U_FFN_NORM, NORM_RSTD), F32(U_HC_PRE_FFN, HC_Y), W->ffn_norm, N, D, eps);
    return DS4_OK;
}

static ds4_status ffn_norm_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    rmsnorm_bwd(&bc->m->exec, g->dyF, Gw->ffn_norm, g->dxf, F32(U_HC_PRE_FFN, HC_Y), W->ffn_norm, F32(U_FFN_NORM, NORM_RSTD), N, D);
    return DS4_OK;
}

const unit_decl unit_ffn_norm = {
    .name = "ffn_norm",
    .inputs = UNIT_BIT(U_HC_PRE_FFN),
    .outs = k_ffn_norm_outs, .nouts = 2,
    .fwd = ffn_norm_fwd, .bwd = ffn_norm_bwd,
    .bwd_reads = UNIT_BIT(U_HC_PRE_FFN) | UNIT_BIT(U_FFN_NORM),
};

/* ------------------------------------------------------------------ router */
/* Gate logits and scores, the top-k experts of each token with their normalised weights, and the N·K
 * (token, slot) assignments grouped by expert: expert e's are [eoff[e], eoff[e + 1]). */
static const act_slot k_router_outs[] = {
    [RT_LOGITS] = {"logits", ACT_F32, {X_N, X_E}},
    [RT_SCORES] = {"scores", ACT_F32, {X_N, X_E}},
    [RT_IDX] = {"idx", ACT_I32, {X_N, X_K}},
    [RT_W] = {"w", ACT_F32, {X_N, X_K}},
    [RT_EOFF] = {"eoff", ACT_I64, {X_E1}},
    [RT_ETOK] = {"etok", ACT_I32, {X_N, X_K}},  /* token of each assignment */
    [RT_ESLOT] = {"eslot", ACT_I32, {X_N, X_K}}, /* its top-k slot */
};

/* The router's assignment lists as the MoE unit reads them. */
typedef struct {
    const int64_t *eoff; /* [E + 1] */
    const int32_t *etok, *eslot; /* [N·K] */
    const float *w;      /* [N, K] */
} routing;

static routing routing_of(const block_acts *a) {
    return (routing){I64(U_ROUTER, RT_EOFF), I32(U_ROUTER, RT_ETOK), I32(U_ROUTER, RT_ESLOT), F32(U_ROUTER, RT_W)};
}

/* sqrt-softplus scores, bias (selection only) or hash table, normalised weights. */
static ds4_status router_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts;
    float *logits = F32(U_ROUTER, RT_LOGITS);
    model_linear_fwd(m, logits, F32(U_FFN_NORM, NORM_X), W->gate, N, D, E);
    bool hash = block_is_hash(c, bc->layer);
    const int64_t *table = hash ? m->tid2eid[bc->layer] : NULL;
    const int32_t *ids = bc->ids;
    int64_t *forced = NULL; /* force_balance: a per-token table [N, K] read through ids = 0, 1, ..., N-1 */
    int32_t *iota = NULL;
    if (bc->force_balance) {
        forced = dev_alloc(m, DS4_MEM_WORK, (size_t)(N * K) * sizeof(int64_t));
        iota = dev_alloc(m, DS4_MEM_WORK, (size_t)N * sizeof(int32_t));
        if (!forced || !iota) {
            work_free(bc, forced);
            work_free(bc, iota);
            return ds4_fail(DS4_ERR_OOM, "out of memory in block %lld", (long long)bc->layer);
        }
        moe_balanced_table(&bc->m->exec, forced, iota, N, K, E);
        table = forced;
        ids = iota;
    }
    moe_gate_fwd(&bc->m->exec, &(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)c->route_scale,
        .logits = logits, .bias = table ? NULL : W->gate_bias, .tid2eid = table, .ids = ids,
        .idx = I32(U_ROUTER, RT_IDX), .weights = F32(U_ROUTER, RT_W), .scores = F32(U_ROUTER, RT_SCORES)});
    work_free(bc, forced);
    work_free(bc, iota);
    moe_group_by_expert(&bc->m->exec, I64(U_ROUTER, RT_EOFF), I32(U_ROUTER, RT_ETOK), I32(U_ROUTER, RT_ESLOT), I32(U_ROUTER, RT_IDX),
                        N, E, K);
    return DS4_OK;
}

/* The gate's gradient needs d(routing weights) from the experts: the router is differentiated at the
 * end of moe's backward. */
const unit_decl unit_router = {
    .name = "router",
    .inputs = UNIT_BIT(U_FFN_NORM),
    .outs = k_router_outs, .nouts = 7,
    .fwd = router_fwd,
};

/* ------------------------------------------------------------------ moe */
/* ffn_out = Σ_k w_k · w2(swiglu(w1 x, w3 x)) over the routed experts + the shared expert. Under expert
 * parallelism the rows go to the experts' owners, which save what they received (xr, wr). */
static const act_slot k_moe_outs[] = {
    [MOE_H1] = {"h1", ACT_F32_BF16, {X_ROWS, X_I}}, /* routed w1 outputs */
    [MOE_H3] = {"h3", ACT_F32_BF16, {X_ROWS, X_I}},
    [MOE_SH1] = {"sh1", ACT_F32_BF16, {X_N, X_IS}}, /* shared expert */
    [MOE_SH3] = {"sh3", ACT_F32_BF16, {X_N, X_IS}},
    [MOE_OUT] = {"ffn_out", ACT_F32_BF16, {X_N, X_D}},
    [MOE_XR] = {"xr", ACT_F32_BF16, {X_ROWS, X_D}, .ep_only = true}, /* received rows */
    [MOE_WR] = {"wr", ACT_F32, {X_ROWS}, .ep_only = true},      /* their routing weights */
};

/* The routed experts' arguments over rows grouped by expert: nexp experts from W->experts[e0], rows
 * [off[e], off[e + 1]) each, saved h1/h3 from row `first` on. */
static moe_experts_args experts_args(const block_ctx *bc, block_acts *a, int64_t e0, int64_t nexp, const int64_t *off,
                                     int64_t first, const float *x, const float *rw, float *act) {
    const ds4_config *c = &bc->m->cfg;
    const int64_t I = c->moe_inter_dim;
    return (moe_experts_args){.nexp = nexp, .D = c->dim, .I = I, .limit = (float)c->swiglu_limit, .off = off,
        .w = &bc->m->w.blocks[bc->layer].experts[e0], .wbase = bc->m->flat, .hcopy = weight_bf16(bc->m, bc->m->flat),
        .x = x, .rw = rw, .h1 = F32(U_MOE, MOE_H1) + first * I,
        .h3 = F32(U_MOE, MOE_H3) + first * I, .act = act};
}

/* moe's prepare under expert parallelism: tells the experts' owners how many rows are coming (a
 * collective), which sizes the received rows. */
static ds4_status moe_route(const block_ctx *bc, block_acts *a) {
    if (!bc->ep) return DS4_OK;
    const ds4_config *c = &bc->m->cfg;
    const int64_t E = c->n_routed_experts, N = bc->B * bc->T;
    int64_t *cnt = ds4_alloc(DS4_MEM_OTHER, (size_t)E * sizeof(int64_t)); /* host: the op brings the counts over */
    if (!cnt) return ds4_fail(DS4_ERR_OOM, "out of memory routing block %lld", (long long)bc->layer);
    moe_expert_counts(&bc->m->exec, cnt, I64(U_ROUTER, RT_EOFF), E, N * c->n_activated_experts);
    ds4_status st = bc->ep->route(bc->ep->ctx, cnt, &a->route);
    ds4_free(cnt);
    return st;
}

static void moe_route_free(block_acts *a) {
    ds4_free(a->route); /* one allocation (ds4/model.h) */
    a->route = NULL;
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

/* Routed experts, every expert local: ffn_out += Σ over assignments (expert-major, then token order).
 * xe, ye: [N·K, D] scratch. */
static void moe_routed_fwd_local(const block_ctx *bc, block_acts *a, const float *wj, float *xe, float *act,
    float *ye) {
    UNIT_PROLOGUE;
    const int64_t NK = N * c->n_activated_experts;
    const routing r = routing_of(a);
    rows_gather(&bc->m->exec, xe, F32(U_FFN_NORM, NORM_X), r.etok, NK, D);
    const moe_experts_args ea = experts_args(bc, a, 0, c->n_routed_experts, r.eoff, 0, xe, wj, act);
    moe_experts_fwd(&bc->m->exec, &ea, ye);
    rows_scatter_add(&bc->m->exec, F32(U_MOE, MOE_OUT), ye, r.etok, NK, D);
}

/* Routed experts over EP: rows (x | weight) go to the experts' owners, the owners run their experts on
 * everything they received (saving x and the weights for backward), results come back in assignment
 * order and are added in that order, so every rank's output is what a single process computes. */
static ds4_status moe_routed_fwd_ep(const block_ctx *bc, block_acts *a, const float *wj, float *act) {
    UNIT_PROLOGUE;
    const int64_t K = c->n_activated_experts, NK = N * K, R = a->route->rows;
    const int32_t *etok = I32(U_ROUTER, RT_ETOK);
    float *xr = F32(U_MOE, MOE_XR), *wr = F32(U_MOE, MOE_WR);
    /* The exchange's buffers live only while a step needs them (at most two at once): send [N·K, D + 1] and
     * recv [R, D + 1] around the dispatch, yr [R, D] from the experts to the combine, ys [N·K, D] after it. */
    float *send = work(bc, NK * (D + 1)), *recv = work(bc, R * (D + 1)), *yr = NULL, *ys = NULL;
    ds4_status st = send && recv ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    if (st == DS4_OK) rows_pack(&bc->m->exec, send, F32(U_FFN_NORM, NORM_X), etok, wj, NK, D);
    if (st == DS4_OK) st = bc->ep->dispatch(bc->ep->ctx, a->route, send, recv, D + 1);
    work_free(bc, send);
    send = NULL;
    if (st == DS4_OK) rows_unpack(&bc->m->exec, xr, wr, recv, R, D);
    work_free(bc, recv);
    recv = NULL;
    if (st == DS4_OK && !(yr = work(bc, R * D))) st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    for (int64_t i = 0; st == DS4_OK && i < a->route->e1 - a->route->e0; i++) {
        int64_t o, ne = route_expert_rows(a->route, i, &o);
        const int64_t off[2] = {0, ne};
        const moe_experts_args ea = experts_args(bc, a, a->route->e0 + i, 1, off, o, xr + o * D, wr + o, act);
        moe_experts_fwd(&bc->m->exec, &ea, yr + o * D);
    }
    if (st == DS4_OK && !(ys = work(bc, NK * D))) st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    if (st == DS4_OK) st = bc->ep->combine(bc->ep->ctx, a->route, yr, ys, D);
    work_free(bc, yr);
    yr = NULL;
    if (st == DS4_OK) rows_scatter_add(&bc->m->exec, F32(U_MOE, MOE_OUT), ys, etok, NK, D);
    work_free(bc, send);
    work_free(bc, recv);
    work_free(bc, yr);
    work_free(bc, ys);
    return st;
}

static ds4_status moe_fwd(const block_ctx *bc, block_acts *a) {
    UNIT_PROLOGUE;
    const int64_t K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts;
    const float limit = (float)c->swiglu_limit;
    float *ffn_out = F32(U_MOE, MOE_OUT), *sh1 = F32(U_MOE, MOE_SH1), *sh3 = F32(U_MOE, MOE_SH3);
    const float *xf = F32(U_FFN_NORM, NORM_X);
    tensor_zero(&bc->m->exec, ffn_out, (size_t)(N * D) * sizeof(float));
    /* rows of one routed-experts call: every assignment without EP, one local expert's (all sources) under EP */
    int64_t rows = N * K;
    if (bc->ep) {
        rows = 1; /* no allocation of 0 bytes when this rank received nothing */
        for (int64_t i = 0, o; i < a->route->e1 - a->route->e0; i++) {
            const int64_t ne = route_expert_rows(a->route, i, &o);
            rows = ne > rows ? ne : rows;
        }
    }
    float *wj = work(bc, N * K), *act = work(bc, rows * I > N * Is ? rows * I : N * Is),
        *ye = work(bc, bc->ep ? N * D : N * K * D); /* the local experts' [N·K, D]; the shared expert's [N, D] */
    float *xe = bc->ep ? NULL : work(bc, N * K * D);
    ds4_status st = (wj && act && ye && (bc->ep || xe)) ? DS4_OK : ds4_fail(DS4_ERR_OOM,
        "out of memory in MoE forward");
    if (st == DS4_OK) {
        const routing r = routing_of(a);
        moe_assignment_weights(&bc->m->exec, wj, r.w, r.etok, r.eslot, N * K, K);
    }
    if (st == DS4_OK && bc->ep) st = moe_routed_fwd_ep(bc, a, wj, act);
    else if (st == DS4_OK) moe_routed_fwd_local(bc, a, wj, xe, act, ye);
    if (st == DS4_OK) {
        model_linear_fwd(m, sh1, xf, W->shared.w1, N, D, Is);
        model_linear_fwd(m, sh3, xf, W->shared.w3, N, D, Is);
        swiglu_fwd(&bc->m->exec, act, sh1, sh3, N, Is, limit);
        model_linear_fwd(m, ye, act, W->shared.w2, N, Is, D);
        tensor_add(&bc->m->exec, ffn_out, ye, N * D);
    }
    work_free(bc, wj);
    work_free(bc, xe);
    work_free(bc, act);
    work_free(bc, ye);
    return st;
}

/* Scratch of the routed-expert backward, each big enough for the rows of one experts call (rows: N·K without
 * EP, the largest (expert, source) block under EP) and for the shared expert's [N, Is]. */
typedef struct {
    float *act, *dact, *dh1, *dh3; /* [max(rows·I, N·Is)] */
    float *xe, *dye;               /* [N·K, D] without EP */
    float *dxe, *dwe;              /* [rows, D], [rows] */
    float *wj;                     /* [N·K] routing weight of each assignment */
} moe_scratch;

/* The routed experts' backward: dx, dw [rows] from dy, weight gradients into g, on s's scratch. */
static moe_experts_grads experts_grads(const moe_scratch *s, moe_expert_w *g, const float *dy, float *dx, float *dw) {
    return (moe_experts_grads){.g = g, .dy = dy, .dx = dx, .dw = dw, .dact = s->dact, .dh1 = s->dh1, .dh3 = s->dh3};
}

/* Routed experts, every expert local, one at a time; dx scattered in a fixed (expert, token) order. */
static void moe_routed_bwd_local(const block_ctx *bc, block_acts *a, block_grads *g, float *dgw,
    const moe_scratch *s) {
    UNIT_PROLOGUE;
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, NK = N * K;
    const routing r = routing_of(a);
    rows_gather(&bc->m->exec, s->xe, F32(U_FFN_NORM, NORM_X), r.etok, NK, D);
    rows_gather(&bc->m->exec, s->dye, g->dffn, r.etok, NK, D);
    const moe_experts_args ea = experts_args(bc, a, 0, E, r.eoff, 0, s->xe, s->wj, s->act);
    const moe_experts_grads eg = experts_grads(s, Gw->experts, s->dye, s->dxe, s->dwe);
    moe_experts_bwd(&bc->m->exec, &ea, &eg);
    moe_weight_grads_add(&bc->m->exec, dgw, s->dwe, r.etok, r.eslot, NK, K);
    rows_scatter_add(&bc->m->exec, g->dxf, s->dxe, r.etok, NK, D);
}

/* Routed experts over EP. The output gradients travel to the experts' owners; each (expert, source)
 * block is differentiated on its own — weight gradients into a zeroed buffer that is then added to the
 * expert's gradient in source order — so the expert gradient is the rank-ordered sum of what each
 * source alone would give; (dx | d weight) rows come back in assignment order. */
static ds4_status moe_routed_bwd_ep(const block_ctx *bc, block_acts *a, block_grads *g, float *dgw,
                                    const moe_scratch *s) {
    UNIT_PROLOGUE;
    const int64_t K = c->n_activated_experts, I = c->moe_inter_dim, NK = N * K;
    const ds4_ep_route *r = a->route;
    const routing rt = routing_of(a);
    const int64_t R = r->rows;
    const bool split = r->nsrc > 1;
    const float *xr = F32(U_MOE, MOE_XR), *wr = F32(U_MOE, MOE_WR);
    /* The exchange's buffers live only while a step needs them: dys [N·K, D] until the dispatch, dyr [R, D]
     * through the experts, dxr [R, D + 1] from the experts to the combine, dxs [N·K, D + 1] from the combine;
     * at most two at once. */
    float *dys = work(bc, NK * D), *dyr = work(bc, R * D), *dxr = NULL, *dxs = NULL;
    float *tmp = NULL;
    ds4_status st = dys && dyr ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
    if (st == DS4_OK) rows_gather(&bc->m->exec, dys, g->dffn, rt.etok, NK, D);
    if (st == DS4_OK) st = bc->ep->dispatch(bc->ep->ctx, r, dys, dyr, D);
    work_free(bc, dys);
    dys = NULL;
    if (st == DS4_OK) {
        dxr = work(bc, R * (D + 1));
        tmp = split ? work(bc, 3 * I * D) : NULL;
        if (!dxr || (split && !tmp)) st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
    }
    expert_w tg = {tmp, tmp ? tmp + I * D : NULL, tmp ? tmp + 2 * I * D : NULL};
    for (int64_t i = 0, o = 0; st == DS4_OK && i < r->e1 - r->e0; i++) {
        const int64_t e = r->e0 + i;
        for (int src = 0; src < r->nsrc; o += r->recv_cnt[i * r->nsrc + src], src++) {
            const int64_t ne = r->recv_cnt[i * r->nsrc + src], off[2] = {0, ne};
            if (ne == 0) continue;
            if (split) tensor_zero(&bc->m->exec, tmp, (size_t)(3 * I * D) * sizeof(float));
            const moe_experts_args ea = experts_args(bc, a, e, 1, off, o, xr + o * D, wr + o, s->act);
            const moe_experts_grads eg = experts_grads(s, split ? &tg : &Gw->experts[e], dyr + o * D, s->dxe, s->dwe);
            moe_experts_bwd(&bc->m->exec, &ea, &eg);
            if (split) {
                tensor_add(&bc->m->exec, Gw->experts[e].w1, tg.w1, I * D);
                tensor_add(&bc->m->exec, Gw->experts[e].w2, tg.w2, I * D);
                tensor_add(&bc->m->exec, Gw->experts[e].w3, tg.w3, I * D);
            }
            rows_pack(&bc->m->exec, dxr + o * (D + 1), s->dxe, NULL, s->dwe, ne, D);
        }
    }
    work_free(bc, tmp);
    tmp = NULL;
    work_free(bc, dyr);
    dyr = NULL;
    if (st == DS4_OK && !(dxs = work(bc, NK * (D + 1)))) st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
    if (st == DS4_OK) st = bc->ep->combine(bc->ep->ctx, r, dxr, dxs, D + 1);
    if (st == DS4_OK) moe_unpack_grads_add(&bc->m->exec, g->dxf, dgw, dxs, rt.etok, rt.eslot, NK, D, K);
    work_free(bc, dys);
    work_free(bc, dyr);
    work_free(bc, dxr);
    work_free(bc, dxs);
    work_free(bc, tmp);
    return st;
}

static void moe_scratch_free(const block_ctx *bc, moe_scratch *s) {
    work_free(bc, s->act);
    work_free(bc, s->dact);
    work_free(bc, s->dh1);
    work_free(bc, s->dh3);
    work_free(bc, s->xe);
    work_free(bc, s->dye);
    work_free(bc, s->dxe);
    work_free(bc, s->dwe);
    work_free(bc, s->wj);
}

/* The shared expert's backward: dxf += …, its weights' gradients. */
static void shared_expert_bwd(const block_ctx *bc, block_acts *a, block_grads *g, const moe_scratch *s) {
    UNIT_PROLOGUE;
    const int64_t Is = c->moe_inter_dim * c->n_shared_experts;
    const float limit = (float)c->swiglu_limit;
    const float *sh1 = F32(U_MOE, MOE_SH1), *sh3 = F32(U_MOE, MOE_SH3), *xf = F32(U_FFN_NORM, NORM_X);
    swiglu_fwd(&bc->m->exec, s->act, sh1, sh3, N, Is, limit);
    tensor_zero(&bc->m->exec, s->dact, (size_t)(N * Is) * sizeof(float));
    model_linear_bwd(m, s->dact, Gw->shared.w2, g->dffn, s->act, W->shared.w2, N, Is, D);
    tensor_zero(&bc->m->exec, s->dh1, (size_t)(N * Is) * sizeof(float));
    tensor_zero(&bc->m->exec, s->dh3, (size_t)(N * Is) * sizeof(float));
    swiglu_bwd(&bc->m->exec, s->dh1, s->dh3, s->dact, sh1, sh3, N, Is, limit);
    model_linear_bwd(m, g->dxf, Gw->shared.w1, s->dh1, xf, W->shared.w1, N, D, Is);
    model_linear_bwd(m, g->dxf, Gw->shared.w3, s->dh3, xf, W->shared.w3, N, D, Is);
}

/* dxf += …: the shared expert, the routed experts, then the router (its gate from d routing weights). */
static ds4_status moe_bwd(const block_ctx *bc, block_acts *a, block_grads *g) {
    UNIT_PROLOGUE;
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts;
    /* Rows of one routed-experts call: every assignment at once without EP; under EP one (expert, source)
     * block at a time, so the scratch is the largest block's, not every received row's. */
    int64_t rows = N * K;
    if (bc->ep) {
        rows = 1; /* no allocation of 0 bytes when this rank received nothing */
        for (int64_t i = 0; i < (a->route->e1 - a->route->e0) * a->route->nsrc; i++)
            rows = a->route->recv_cnt[i] > rows ? a->route->recv_cnt[i] : rows;
    }
    const int64_t hsz = rows * I > N * Is ? rows * I : N * Is; /* the routed [rows, I] or the shared [N, Is] */
    float *dgw = work_zeros(bc, N * K), *dlog = work_zeros(bc, N * E);
    moe_scratch s = {.act = work(bc, hsz), .dact = work(bc, hsz), .dh1 = work(bc, hsz), .dh3 = work(bc, hsz),
                     .xe = bc->ep ? NULL : work(bc, N * K * D), .dye = bc->ep ? NULL : work(bc, N * K * D),
                     .dxe = work(bc, rows * D), .dwe = work(bc, rows), .wj = work(bc, N * K)};
    ds4_status st = DS4_OK;
    if (!dgw || !dlog || !s.act || !s.dact || !s.dh1 || !s.dh3 || (!bc->ep && (!s.xe || !s.dye)) || !s.dxe ||
        !s.dwe || !s.wj)
        st = ds4_fail(DS4_ERR_OOM, "out of memory in MoE backward");
    if (st == DS4_OK) {
        const routing r = routing_of(a);
        shared_expert_bwd(bc, a, g, &s);
        moe_assignment_weights(&bc->m->exec, s.wj, r.w, r.etok, r.eslot, N * K, K);
        if (bc->ep) st = moe_routed_bwd_ep(bc, a, g, dgw, &s);
        else moe_routed_bwd_local(bc, a, g, dgw, &s);
    }
    if (st == DS4_OK) {
        moe_gate_bwd(&bc->m->exec, &(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)c->route_scale,
            .logits = F32(U_ROUTER, RT_LOGITS), .scores = F32(U_ROUTER, RT_SCORES), .idx = I32(U_ROUTER, RT_IDX)},
            &(moe_gate_grads){.dweights = dgw, .dlogits = dlog});
        model_linear_bwd(m, g->dxf, Gw->gate, dlog, F32(U_FFN_NORM, NORM_X), W->gate, N, D, E);
    }
    work_free(bc, dgw);
    work_free(bc, dlog);
    moe_scratch_free(bc, &s);
    return st;
}

const unit_decl unit_moe = {
    .name = "moe",
    .inputs = UNIT_BIT(U_FFN_NORM) | UNIT_BIT(U_ROUTER),
    .outs = k_moe_outs, .nouts = 7,
    .prepare = moe_route, .discard = moe_route_free,
    .fwd = moe_fwd, .bwd = moe_bwd,
    .bwd_reads = UNIT_BIT(U_FFN_NORM) | UNIT_BIT(U_ROUTER) | UNIT_BIT(U_MOE),
};
