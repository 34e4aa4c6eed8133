/* A DeepSeek-V4 block, forward and backward, unit by unit (docs/dsv4-architecture.md §2, §3, §4, §5):
 *   hc_pre_attn → attn_norm → q_path → kv_path → compressor → indexer → sparse_attn → o_proj → hc_post_attn
 *   hc_pre_ffn → ffn_norm → router → experts → shared_expert → hc_post_ffn
 * Backward runs the same units in reverse. Kernel conventions: forwards overwrite, backwards accumulate. */
#include "model/block.h"

#include <math.h>
#include <string.h>

/* ------------------------------------------------------------------ allocation helpers */
static float *act_alloc(block_acts *a, int64_t n, size_t elt) {
    if (a->nowned >= BLOCK_MAX_ACTS) {
        ds4_fail(DS4_ERR_INTERNAL, "block: too many saved activations");
        return NULL;
    }
    void *p = ds4_alloc(DS4_MEM_ACT, (size_t)n * elt);
    if (p) a->owned[a->nowned++] = p;
    return p;
}
#define ACT_F(a, n) act_alloc((a), (n), sizeof(float))
#define ACT_I32(a, n) ((int32_t *)act_alloc((a), (n), sizeof(int32_t)))
#define ACT_I64(a, n) ((int64_t *)act_alloc((a), (n), sizeof(int64_t)))

void block_acts_free(block_acts *a) {
    for (int i = 0; i < a->nowned; i++) ds4_free(a->owned[i]);
    memset(a, 0, sizeof *a);
}

static float *work_zeros(int64_t n) { return ds4_calloc(DS4_MEM_WORK, (size_t)n * sizeof(float)); }
static float *work(int64_t n) { return ds4_alloc(DS4_MEM_WORK, (size_t)n * sizeof(float)); }

#define NEED(p)                                                           \
    do {                                                                  \
        if (!(p)) return ds4_fail(DS4_ERR_OOM, "out of memory in block forward/backward"); \
    } while (0)

static const ds4_rope *block_rope(const ds4_model *m, int64_t ratio) {
    return ratio > 0 ? &m->rope_cmp : &m->rope_main;
}

static int64_t usable_rows(int64_t B, int64_t T, int64_t r) { return T >= r ? B * (T - r + 1) : 0; }

/* ================================================================== attention sub-layer, forward */
static ds4_status attn_fwd(const block_ctx *bc, block_acts *a, const float *X_in, double *kl_sum,
                           int64_t *kl_rows) {
    ds4_model *m = bc->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[bc->layer];
    const int64_t B = bc->B, T = bc->T, N = B * T, D = c->dim, n = c->hc_mult, M = mix_hc(c);
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank, r = a->ratio, Nc = a->Nc;
    const float eps = (float)c->norm_eps;
    const ds4_rope *rope = block_rope(m, r);

    /* hc_pre_attn: collapse the n streams */
    NEED(a->hcA_mixes = ACT_F(a, N * M));
    NEED(a->hcA_rsqrt = ACT_F(a, N));
    NEED(a->hcA_post = ACT_F(a, N * n));
    NEED(a->hcA_comb = ACT_F(a, N * n * n));
    NEED(a->hcA_y = ACT_F(a, N * D));
    hc_pre_fwd(a->hcA_y, a->hcA_post, a->hcA_comb, a->hcA_mixes, a->hcA_rsqrt, X_in, W->hc_attn_fn,
               W->hc_attn_scale, W->hc_attn_base, N, n, D, c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
    /* attn_norm: xa [N, D] */
    NEED(a->xa = ACT_F(a, N * D));
    NEED(a->xa_rstd = ACT_F(a, N));
    rmsnorm_fwd(a->xa, a->xa_rstd, a->hcA_y, W->attn_norm, N, D, eps);

    /* q path: qr = q_norm(wq_a xa) [N, QR]; q = rope(headnorm(wq_b qr)) [N, H, hd] */
    NEED(a->qa = ACT_F(a, N * QR));
    NEED(a->qa_rstd = ACT_F(a, N));
    NEED(a->qr = ACT_F(a, N * QR));
    linear_fwd(a->qa, a->xa, W->wq_a, N, D, QR);
    rmsnorm_fwd(a->qr, a->qa_rstd, a->qa, W->q_norm, N, QR, eps);
    NEED(a->qraw = ACT_F(a, N * H * hd));
    NEED(a->q_rstd = ACT_F(a, N * H));
    NEED(a->q = ACT_F(a, N * H * hd));
    linear_fwd(a->qraw, a->qr, W->wq_b, N, QR, H * hd);
    rmsnorm_fwd(a->q, a->q_rstd, a->qraw, NULL, N * H, hd, eps);
    rope_fwd(a->q, N, H, hd, T, 1, rope, false);

    /* kv path: kv = rope(kv_norm(wkv xa)) [N, hd], the one shared K = V head */
    NEED(a->kvraw = ACT_F(a, N * hd));
    NEED(a->kv_rstd = ACT_F(a, N));
    NEED(a->kv = ACT_F(a, N * hd));
    linear_fwd(a->kvraw, a->xa, W->wkv, N, D, hd);
    rmsnorm_fwd(a->kv, a->kv_rstd, a->kvraw, W->kv_norm, N, hd, eps);
    rope_fwd(a->kv, N, 1, hd, T, 1, rope, false);

    /* compressor: kvc [B, Nc, hd], entry i roped at position i·r */
    if (r > 0) {
        int64_t coff = r == 4 ? 2 : 1;
        NEED(a->ca = ACT_F(a, N * coff * hd));
        NEED(a->cz = ACT_F(a, N * coff * hd));
        NEED(a->cpool = ACT_F(a, B * Nc * hd));
        NEED(a->c_rstd = ACT_F(a, B * Nc));
        NEED(a->kvc = ACT_F(a, B * Nc * hd));
        linear_fwd(a->ca, a->xa, W->cmp.wkv, N, D, coff * hd);
        linear_fwd(a->cz, a->xa, W->cmp.wgate, N, D, coff * hd);
        compressor_pool_fwd(a->cpool, a->ca, a->cz, W->cmp.ape, B, T, r, hd, r == 4);
        rmsnorm_fwd(a->kvc, a->c_rstd, a->cpool, W->cmp.norm, B * Nc, hd, eps);
        rope_fwd(a->kvc, B * Nc, 1, hd, Nc, r, rope, false);
    }

    /* indexer (CSA): its own queries, weights and compressed keys from detached xa, qr; top-k */
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, K = c->index_topk;
    const float wscale = (float)(1.0 / sqrt((double)dI) / sqrt((double)HI));
    if (r == 4) {
        NEED(a->iqi = ACT_F(a, N * HI * dI));
        NEED(a->iwi = ACT_F(a, N * HI));
        NEED(a->ica = ACT_F(a, N * 2 * dI));
        NEED(a->icz = ACT_F(a, N * 2 * dI));
        NEED(a->ipool = ACT_F(a, B * Nc * dI));
        NEED(a->i_rstd = ACT_F(a, B * Nc));
        NEED(a->iki = ACT_F(a, B * Nc * dI));
        NEED(a->topk = ACT_I32(a, N * K));
        linear_fwd(a->iqi, a->qr, W->idx_wq_b, N, QR, HI * dI);
        rope_fwd(a->iqi, N, HI, dI, T, 1, rope, false);
        linear_fwd(a->iwi, a->xa, W->idx_weights_proj, N, D, HI);
        linear_fwd(a->ica, a->xa, W->idx_cmp.wkv, N, D, 2 * dI);
        linear_fwd(a->icz, a->xa, W->idx_cmp.wgate, N, D, 2 * dI);
        compressor_pool_fwd(a->ipool, a->ica, a->icz, W->idx_cmp.ape, B, T, 4, dI, true);
        rmsnorm_fwd(a->iki, a->i_rstd, a->ipool, W->idx_cmp.norm, B * Nc, dI, eps);
        rope_fwd(a->iki, B * Nc, 1, dI, Nc, 4, rope, false);
        indexer_topk_fwd(a->topk, a->iqi, a->iki, a->iwi, B, T, HI, dI, Nc, 4, K, wscale);
    }

    /* sparse attention over window + (selected | all usable) compressed entries, with the sink */
    const float scale = (float)(1.0 / sqrt((double)hd));
    const int32_t *sel = (r == 4 && !bc->dense_csa) ? a->topk : NULL;
    NEED(a->o = ACT_F(a, N * H * hd));
    NEED(a->lse = ACT_F(a, N * H));
    sparse_attn_fwd(a->o, a->lse, a->q, a->kv, a->kvc, sel, W->attn_sink, B, T, H, hd, c->window, r, Nc,
                    sel ? K : 0, scale);
    if (r == 4 && !bc->keep) {
        /* forward-only pass: the indexer KL cannot wait for backward */
        double kl = 0;
        int64_t rows = 0;
        indexer_kl_fwd_bwd(&kl, &rows, NULL, NULL, NULL, a->iqi, a->iki, a->iwi, sel, a->q, a->kvc, a->lse, B,
                           T, H, hd, HI, dI, Nc, 4, sel ? K : 0, scale, wscale, 0.0f);
        *kl_sum += kl;
        *kl_rows += rows;
    }

    /* o_proj: inverse rope at the query position, grouped wo_a, wo_b */
    const int64_t G = c->o_groups, R = c->o_lora_rank;
    NEED(a->o_r = ACT_F(a, N * H * hd));
    NEED(a->z = ACT_F(a, N * G * R));
    NEED(a->attn_out = ACT_F(a, N * D));
    memcpy(a->o_r, a->o, (size_t)(N * H * hd) * sizeof(float));
    rope_fwd(a->o_r, N, H, hd, T, 1, rope, true);
    grouped_linear_fwd(a->z, a->o_r, W->wo_a, N, G, R, H * hd / G);
    linear_fwd(a->attn_out, a->z, W->wo_b, N, G * R, D);

    /* hc_post_attn: expand back to n streams with the residual mix */
    NEED(a->X_mid = ACT_F(a, N * n * D));
    hc_post_fwd(a->X_mid, a->attn_out, X_in, a->hcA_post, a->hcA_comb, N, n, D);
    return DS4_OK;
}

/* ================================================================== FFN sub-layer, forward */
/* Groups the N·K (token, slot) assignments by expert, tokens ascending within an expert. */
static ds4_status route_assignments(block_acts *a, int64_t N, int64_t E, int64_t K, int64_t *load) {
    memset(a->eoff, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N * K; i++) a->eoff[a->gidx[i] + 1]++;
    for (int64_t e = 0; e < E; e++) {
        if (load) load[e] += a->eoff[e + 1];
        a->eoff[e + 1] += a->eoff[e];
    }
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

static void gather_rows(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * D, src + (int64_t)rows[i] * D, (size_t)D * sizeof(float));
}

/* act[i] = swiglu(h1[i], h3[i]) · gw[token i, slot i] for the assignments of one expert. */
static void weighted_swiglu(float *act, const float *h1, const float *h3, const block_acts *a, int64_t j0,
                            int64_t ne, int64_t I, int64_t K, float limit) {
    swiglu_fwd(act, h1, h3, ne, I, limit);
    for (int64_t i = 0; i < ne; i++) {
        float w = a->gw[(int64_t)a->etok[j0 + i] * K + a->eslot[j0 + i]];
        for (int64_t u = 0; u < I; u++) act[i * I + u] *= w;
    }
}

static ds4_status ffn_fwd(const block_ctx *bc, block_acts *a, float *X_out, int64_t *load) {
    ds4_model *m = bc->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[bc->layer];
    const int64_t N = bc->B * bc->T, D = c->dim, n = c->hc_mult, M = mix_hc(c);
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts;
    const float eps = (float)c->norm_eps, limit = (float)c->swiglu_limit;

    NEED(a->hcF_mixes = ACT_F(a, N * M));
    NEED(a->hcF_rsqrt = ACT_F(a, N));
    NEED(a->hcF_post = ACT_F(a, N * n));
    NEED(a->hcF_comb = ACT_F(a, N * n * n));
    NEED(a->hcF_y = ACT_F(a, N * D));
    hc_pre_fwd(a->hcF_y, a->hcF_post, a->hcF_comb, a->hcF_mixes, a->hcF_rsqrt, a->X_mid, W->hc_ffn_fn,
               W->hc_ffn_scale, W->hc_ffn_base, N, n, D, c->hc_sinkhorn_iters, (float)c->hc_eps, eps);
    NEED(a->xf = ACT_F(a, N * D));
    NEED(a->xf_rstd = ACT_F(a, N));
    rmsnorm_fwd(a->xf, a->xf_rstd, a->hcF_y, W->ffn_norm, N, D, eps);

    /* router: sqrt-softplus scores, bias (selection only) or hash table, normalised weights */
    NEED(a->glogits = ACT_F(a, N * E));
    NEED(a->gscores = ACT_F(a, N * E));
    NEED(a->gidx = ACT_I32(a, N * K));
    NEED(a->gw = ACT_F(a, N * K));
    linear_fwd(a->glogits, a->xf, W->gate, N, D, E);
    bool hash = block_is_hash(c, bc->layer);
    moe_gate_fwd(a->gidx, a->gw, a->gscores, a->glogits, hash ? NULL : W->gate_bias,
                 hash ? m->tid2eid[bc->layer] : NULL, bc->ids, N, E, K, (float)c->route_scale);

    /* routed experts: y = Σ_k w_k · w2(swiglu(w1 x, w3 x)) */
    NEED(a->eoff = ACT_I64(a, E + 1));
    NEED(a->etok = ACT_I32(a, N * K));
    NEED(a->eslot = ACT_I32(a, N * K));
    NEED(a->h1 = ACT_F(a, N * K * I));
    NEED(a->h3 = ACT_F(a, N * K * I));
    NEED(a->ffn_out = ACT_F(a, N * D));
    DS4_TRY(route_assignments(a, N, E, K, load));
    memset(a->ffn_out, 0, (size_t)(N * D) * sizeof(float));
    float *xe = work(N * K * D), *act = work(N * K * (I > Is ? I : Is)), *ye = work(N * K * D);
    ds4_status st = (xe && act && ye) ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory in MoE forward");
    for (int64_t e = 0; st == DS4_OK && e < E; e++) {
        int64_t j0 = a->eoff[e], ne = a->eoff[e + 1] - j0;
        if (ne == 0) continue;
        const expert_w *ew = &W->experts[e];
        gather_rows(xe, a->xf, a->etok + j0, ne, D);
        linear_fwd(a->h1 + j0 * I, xe, ew->w1, ne, D, I);
        linear_fwd(a->h3 + j0 * I, xe, ew->w3, ne, D, I);
        weighted_swiglu(act, a->h1 + j0 * I, a->h3 + j0 * I, a, j0, ne, I, K, limit);
        linear_fwd(ye, act, ew->w2, ne, I, D);
        for (int64_t i = 0; i < ne; i++) {
            float *dst = a->ffn_out + (int64_t)a->etok[j0 + i] * D;
            for (int64_t d = 0; d < D; d++) dst[d] += ye[i * D + d];
        }
    }
    /* shared expert, always on, weight 1 */
    if (st == DS4_OK) {
        NEED(a->sh1 = ACT_F(a, N * Is));
        NEED(a->sh3 = ACT_F(a, N * Is));
        linear_fwd(a->sh1, a->xf, W->shared.w1, N, D, Is);
        linear_fwd(a->sh3, a->xf, W->shared.w3, N, D, Is);
        swiglu_fwd(act, a->sh1, a->sh3, N, Is, limit);
        linear_fwd(ye, act, W->shared.w2, N, Is, D);
        for (int64_t i = 0; i < N * D; i++) a->ffn_out[i] += ye[i];
        hc_post_fwd(X_out, a->ffn_out, a->X_mid, a->hcF_post, a->hcF_comb, N, n, D);
    }
    ds4_free(xe);
    ds4_free(act);
    ds4_free(ye);
    return st;
}

ds4_status block_fwd(const block_ctx *bc, block_acts *a, const float *X_in, float *X_out, int64_t *expert_load,
                     double *kl_sum, int64_t *kl_rows) {
    memset(a, 0, sizeof *a);
    a->ratio = ds4_layer_ratio(&bc->m->cfg, bc->layer);
    a->Nc = a->ratio > 0 ? bc->T / a->ratio : 0;
    ds4_status st = attn_fwd(bc, a, X_in, kl_sum, kl_rows);
    if (st == DS4_OK) st = ffn_fwd(bc, a, X_out, expert_load);
    if (st != DS4_OK || !bc->keep) block_acts_free(a);
    return st;
}

/* ================================================================== FFN sub-layer, backward */
/* dX_mid += ∂/∂X_mid given dX_out. */
static ds4_status ffn_bwd(const block_ctx *bc, block_acts *a, const float *dX_out, float *dX_mid) {
    ds4_model *m = bc->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[bc->layer];
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t N = bc->B * bc->T, D = c->dim, n = c->hc_mult, M = mix_hc(c);
    const int64_t E = c->n_routed_experts, K = c->n_activated_experts, I = c->moe_inter_dim;
    const int64_t Is = I * c->n_shared_experts, Imax = I > Is ? I : Is;
    const float eps = (float)c->norm_eps, limit = (float)c->swiglu_limit;
    (void)M;

    float *dffn = work_zeros(N * D), *dpost = work_zeros(N * n), *dcomb = work_zeros(N * n * n);
    float *dxf = work_zeros(N * D), *dy = work_zeros(N * D), *dgw = work_zeros(N * K);
    float *dlog = work_zeros(N * E), *act = work(N * K * Imax), *dact = work(N * K * Imax);
    float *dh1 = work(N * K * Imax), *dh3 = work(N * K * Imax), *xe = work(N * K * D), *dye = work(N * K * D);
    float *dxe = work(N * K * D);
    ds4_status st = DS4_OK;
    if (!dffn || !dpost || !dcomb || !dxf || !dy || !dgw || !dlog || !act || !dact || !dh1 || !dh3 || !xe ||
        !dye || !dxe) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory in FFN backward");
        goto done;
    }
    /* hc_post_ffn */
    hc_post_bwd(dffn, dX_mid, dpost, dcomb, dX_out, a->ffn_out, a->X_mid, a->hcF_post, a->hcF_comb, N, n, D);

    /* shared expert */
    swiglu_fwd(act, a->sh1, a->sh3, N, Is, limit);
    memset(dact, 0, (size_t)(N * Is) * sizeof(float));
    linear_bwd(dact, Gw->shared.w2, dffn, act, W->shared.w2, N, Is, D);
    memset(dh1, 0, (size_t)(N * Is) * sizeof(float));
    memset(dh3, 0, (size_t)(N * Is) * sizeof(float));
    swiglu_bwd(dh1, dh3, dact, a->sh1, a->sh3, N, Is, limit);
    linear_bwd(dxf, Gw->shared.w1, dh1, a->xf, W->shared.w1, N, D, Is);
    linear_bwd(dxf, Gw->shared.w3, dh3, a->xf, W->shared.w3, N, D, Is);

    /* routed experts, one at a time; scatter of dx in a fixed (expert, token) order */
    for (int64_t e = 0; e < E; e++) {
        int64_t j0 = a->eoff[e], ne = a->eoff[e + 1] - j0;
        if (ne == 0) continue;
        const expert_w *ew = &W->experts[e];
        expert_w *eg = &Gw->experts[e];
        const float *h1 = a->h1 + j0 * I, *h3 = a->h3 + j0 * I;
        gather_rows(xe, a->xf, a->etok + j0, ne, D);
        gather_rows(dye, dffn, a->etok + j0, ne, D);
        /* act = swiglu (unweighted); the weighted activation feeds w2 */
        swiglu_fwd(act, h1, h3, ne, I, limit);
        float *wact = dh1; /* scratch: weighted activation */
        for (int64_t i = 0; i < ne; i++) {
            float w = a->gw[(int64_t)a->etok[j0 + i] * K + a->eslot[j0 + i]];
            for (int64_t u = 0; u < I; u++) wact[i * I + u] = act[i * I + u] * w;
        }
        memset(dact, 0, (size_t)(ne * I) * sizeof(float));
        linear_bwd(dact, eg->w2, dye, wact, ew->w2, ne, I, D);
        /* dweight = <d wact, act>; d act = d wact · weight */
        for (int64_t i = 0; i < ne; i++) {
            int64_t gi = (int64_t)a->etok[j0 + i] * K + a->eslot[j0 + i];
            double s = 0;
            for (int64_t u = 0; u < I; u++) s += (double)dact[i * I + u] * act[i * I + u];
            dgw[gi] += (float)s;
            float w = a->gw[gi];
            for (int64_t u = 0; u < I; u++) dact[i * I + u] *= w;
        }
        memset(dh1, 0, (size_t)(ne * I) * sizeof(float));
        memset(dh3, 0, (size_t)(ne * I) * sizeof(float));
        swiglu_bwd(dh1, dh3, dact, h1, h3, ne, I, limit);
        memset(dxe, 0, (size_t)(ne * D) * sizeof(float));
        linear_bwd(dxe, eg->w1, dh1, xe, ew->w1, ne, D, I);
        linear_bwd(dxe, eg->w3, dh3, xe, ew->w3, ne, D, I);
        for (int64_t i = 0; i < ne; i++) {
            float *dst = dxf + (int64_t)a->etok[j0 + i] * D;
            for (int64_t d = 0; d < D; d++) dst[d] += dxe[i * D + d];
        }
    }
    /* router */
    moe_gate_bwd(dlog, dgw, a->glogits, a->gscores, a->gidx, N, E, K, (float)c->route_scale);
    linear_bwd(dxf, Gw->gate, dlog, a->xf, W->gate, N, D, E);
    /* ffn_norm, hc_pre_ffn */
    rmsnorm_bwd(dy, Gw->ffn_norm, dxf, a->hcF_y, W->ffn_norm, a->xf_rstd, N, D);
    hc_pre_bwd(dX_mid, Gw->hc_ffn_fn, Gw->hc_ffn_scale, Gw->hc_ffn_base, dy, dpost, dcomb, a->X_mid, W->hc_ffn_fn,
               W->hc_ffn_scale, W->hc_ffn_base, a->hcF_mixes, a->hcF_rsqrt, N, n, D, c->hc_sinkhorn_iters,
               (float)c->hc_eps, eps);
done:
    ds4_free(dffn);
    ds4_free(dpost);
    ds4_free(dcomb);
    ds4_free(dxf);
    ds4_free(dy);
    ds4_free(dgw);
    ds4_free(dlog);
    ds4_free(act);
    ds4_free(dact);
    ds4_free(dh1);
    ds4_free(dh3);
    ds4_free(xe);
    ds4_free(dye);
    ds4_free(dxe);
    return st;
}

/* ================================================================== attention sub-layer, backward */
/* Compressor backward from d(normalised, roped entries): dxa += …; dkvc is consumed (rotated in place). */
static void compressor_bwd(compressor_w *G, const compressor_w *W, float *dxa, float *dkvc, const float *a_,
                           const float *z, const float *pool, const float *rstd, const float *xa, const ds4_rope *rope,
                           int64_t B, int64_t T, int64_t r, int64_t d, int64_t D, int64_t Nc) {
    int64_t N = B * T, coff = r == 4 ? 2 : 1;
    float *dpool = work_zeros(B * Nc * d), *da = work_zeros(N * coff * d), *dz = work_zeros(N * coff * d);
    if (!dpool || !da || !dz) goto done;
    rope_bwd(dkvc, B * Nc, 1, d, Nc, r, rope, false);
    rmsnorm_bwd(dpool, G->norm, dkvc, pool, W->norm, rstd, B * Nc, d);
    compressor_pool_bwd(da, dz, G->ape, dpool, a_, z, W->ape, B, T, r, d, r == 4);
    linear_bwd(dxa, G->wkv, da, xa, W->wkv, N, D, coff * d);
    linear_bwd(dxa, G->wgate, dz, xa, W->wgate, N, D, coff * d);
done:
    ds4_free(dpool);
    ds4_free(da);
    ds4_free(dz);
}

/* Indexer KL loss and its gradient into the indexer's own parameters (inputs detached). */
static ds4_status indexer_bwd(const block_ctx *bc, block_acts *a, double *kl_sum, int64_t *kl_rows) {
    ds4_model *m = bc->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[bc->layer];
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t B = bc->B, T = bc->T, N = B * T, D = c->dim, H = c->n_heads, hd = c->head_dim;
    const int64_t HI = c->index_n_heads, dI = c->index_head_dim, K = c->index_topk, QR = c->q_lora_rank;
    const int64_t Nc = a->Nc;
    const float scale = (float)(1.0 / sqrt((double)hd));
    const float wscale = (float)(1.0 / sqrt((double)dI) / sqrt((double)HI));
    const int32_t *sel = bc->dense_csa ? NULL : a->topk;
    int64_t rows = usable_rows(B, T, 4);
    float gscale = rows > 0 ? (float)(c->indexer_loss_coeff / (double)rows) : 0.0f;
    float *dqi = work_zeros(N * HI * dI), *dki = work_zeros(B * Nc * dI), *dwi = work_zeros(N * HI);
    if (!dqi || !dki || !dwi) {
        ds4_free(dqi);
        ds4_free(dki);
        ds4_free(dwi);
        return ds4_fail(DS4_ERR_OOM, "out of memory in indexer backward");
    }
    double kl = 0;
    int64_t got = 0;
    indexer_kl_fwd_bwd(&kl, &got, dqi, dki, dwi, a->iqi, a->iki, a->iwi, sel, a->q, a->kvc, a->lse, B, T, H, hd,
                       HI, dI, Nc, 4, sel ? K : 0, scale, wscale, gscale);
    *kl_sum += kl;
    *kl_rows += got;
    /* detached inputs: only parameter gradients */
    linear_bwd(NULL, Gw->idx_weights_proj, dwi, a->xa, W->idx_weights_proj, N, D, HI);
    rope_bwd(dqi, N, HI, dI, T, 1, &m->rope_cmp, false);
    linear_bwd(NULL, Gw->idx_wq_b, dqi, a->qr, W->idx_wq_b, N, QR, HI * dI);
    compressor_bwd(&Gw->idx_cmp, &W->idx_cmp, NULL, dki, a->ica, a->icz, a->ipool, a->i_rstd, a->xa, &m->rope_cmp,
                   B, T, 4, dI, D, Nc);
    ds4_free(dqi);
    ds4_free(dki);
    ds4_free(dwi);
    if (got != rows)
        return ds4_fail(DS4_ERR_INTERNAL, "indexer loss: %lld rows counted, %lld expected", (long long)got,
                        (long long)rows);
    return DS4_OK;
}

static ds4_status attn_bwd(const block_ctx *bc, block_acts *a, const float *X_in, const float *dX_mid,
                           float *dX_in, double *kl_sum, int64_t *kl_rows) {
    ds4_model *m = bc->m;
    const ds4_config *c = &m->cfg;
    const block_w *W = &m->w.blocks[bc->layer];
    block_w *Gw = &m->g.blocks[bc->layer];
    const int64_t B = bc->B, T = bc->T, N = B * T, D = c->dim, n = c->hc_mult;
    const int64_t H = c->n_heads, hd = c->head_dim, QR = c->q_lora_rank, r = a->ratio, Nc = a->Nc;
    const int64_t G = c->o_groups, R = c->o_lora_rank, K = c->index_topk;
    const float eps = (float)c->norm_eps, scale = (float)(1.0 / sqrt((double)hd));
    const ds4_rope *rope = block_rope(m, r);
    (void)eps;

    float *dattn = work_zeros(N * D), *dpost = work_zeros(N * n), *dcomb = work_zeros(N * n * n);
    float *dz = work_zeros(N * G * R), *do_ = work_zeros(N * H * hd), *dq = work_zeros(N * H * hd);
    float *dkv = work_zeros(N * hd), *dkvc = r > 0 ? work_zeros(B * Nc * hd) : NULL;
    float *dxa = work_zeros(N * D), *dqraw = work_zeros(N * H * hd), *dqr = work_zeros(N * QR);
    float *dqa = work_zeros(N * QR), *dkvraw = work_zeros(N * hd), *dy = work_zeros(N * D);
    ds4_status st = DS4_OK;
    if (!dattn || !dpost || !dcomb || !dz || !do_ || !dq || !dkv || (r > 0 && !dkvc) || !dxa || !dqraw || !dqr ||
        !dqa || !dkvraw || !dy) {
        st = ds4_fail(DS4_ERR_OOM, "out of memory in attention backward");
        goto done;
    }
    /* hc_post_attn */
    hc_post_bwd(dattn, dX_in, dpost, dcomb, dX_mid, a->attn_out, X_in, a->hcA_post, a->hcA_comb, N, n, D);
    /* o_proj */
    linear_bwd(dz, Gw->wo_b, dattn, a->z, W->wo_b, N, G * R, D);
    grouped_linear_bwd(do_, Gw->wo_a, dz, a->o_r, W->wo_a, N, G, R, H * hd / G);
    rope_bwd(do_, N, H, hd, T, 1, rope, true);
    /* indexer KL (CSA), from the saved lse, before the attention activations go */
    if (r == 4) {
        st = indexer_bwd(bc, a, kl_sum, kl_rows);
        if (st != DS4_OK) goto done;
    }
    /* sparse attention */
    const int32_t *sel = (r == 4 && !bc->dense_csa) ? a->topk : NULL;
    sparse_attn_bwd(dq, dkv, dkvc, Gw->attn_sink, do_, a->o, a->lse, a->q, a->kv, a->kvc, sel, W->attn_sink, B, T,
                    H, hd, c->window, r, Nc, sel ? K : 0, scale);
    /* compressor */
    if (r > 0)
        compressor_bwd(&Gw->cmp, &W->cmp, dxa, dkvc, a->ca, a->cz, a->cpool, a->c_rstd, a->xa, rope, B, T, r, hd, D,
                       Nc);
    /* kv path */
    rope_bwd(dkv, N, 1, hd, T, 1, rope, false);
    rmsnorm_bwd(dkvraw, Gw->kv_norm, dkv, a->kvraw, W->kv_norm, a->kv_rstd, N, hd);
    linear_bwd(dxa, Gw->wkv, dkvraw, a->xa, W->wkv, N, D, hd);
    /* q path */
    rope_bwd(dq, N, H, hd, T, 1, rope, false);
    rmsnorm_bwd(dqraw, NULL, dq, a->qraw, NULL, a->q_rstd, N * H, hd);
    linear_bwd(dqr, Gw->wq_b, dqraw, a->qr, W->wq_b, N, QR, H * hd);
    rmsnorm_bwd(dqa, Gw->q_norm, dqr, a->qa, W->q_norm, a->qa_rstd, N, QR);
    linear_bwd(dxa, Gw->wq_a, dqa, a->xa, W->wq_a, N, D, QR);
    /* attn_norm, hc_pre_attn */
    rmsnorm_bwd(dy, Gw->attn_norm, dxa, a->hcA_y, W->attn_norm, a->xa_rstd, N, D);
    hc_pre_bwd(dX_in, Gw->hc_attn_fn, Gw->hc_attn_scale, Gw->hc_attn_base, dy, dpost, dcomb, X_in, W->hc_attn_fn,
               W->hc_attn_scale, W->hc_attn_base, a->hcA_mixes, a->hcA_rsqrt, N, n, D, c->hc_sinkhorn_iters,
               (float)c->hc_eps, (float)c->norm_eps);
done:
    ds4_free(dattn);
    ds4_free(dpost);
    ds4_free(dcomb);
    ds4_free(dz);
    ds4_free(do_);
    ds4_free(dq);
    ds4_free(dkv);
    ds4_free(dkvc);
    ds4_free(dxa);
    ds4_free(dqraw);
    ds4_free(dqr);
    ds4_free(dqa);
    ds4_free(dkvraw);
    ds4_free(dy);
    return st;
}

ds4_status block_bwd(const block_ctx *bc, block_acts *a, const float *X_in, const float *dX_out, float *dX_in,
                     double *kl_sum, int64_t *kl_rows) {
    const ds4_config *c = &bc->m->cfg;
    int64_t N = bc->B * bc->T;
    float *dX_mid = work_zeros(N * c->hc_mult * c->dim);
    if (!dX_mid) return ds4_fail(DS4_ERR_OOM, "out of memory in block backward");
    ds4_status st = ffn_bwd(bc, a, dX_out, dX_mid);
    if (st == DS4_OK) st = attn_bwd(bc, a, X_in, dX_mid, dX_in, kl_sum, kl_rows);
    ds4_free(dX_mid);
    return st;
}
