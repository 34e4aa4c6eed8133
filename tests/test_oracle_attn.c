/* The attention-family production kernels (kernels.h: sparse_attn_fwd/bwd, indexer_topk_fwd,
 * indexer_kl_fwd_bwd) against the scalar double oracles of src/kernels/ref/oracle_attn.c, under
 * bounds derived from float32 rounding (tests/test_oracle_check.h); each oracle's backward against
 * finite differences of its own forward.
 *
 * Shapes cover: T smaller than the window, T not a multiple of the ratio, ratio 4 (CSA: top-k or
 * dense) and 128 (HCA-like, T = 300), T smaller than the ratio (no compressed entry), rows whose top-k
 * is all −1 (an empty selection), head counts that are not a multiple of the production's 4-head
 * blocks, and exact ties in the indexer scores. */
#include "kernels/kernels.h"
#include "kernels/ref/oracle.h"
#include "test_oracle_check.h"

typedef struct {
    int64_t B, T, H, c, window, ratio, Nc, K;
    int use_topk;
} acfg;

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

static int64_t usable(int64_t t, int64_t ratio, int64_t Nc) {
    if (ratio <= 0) return 0;
    return (t + 1) / ratio < Nc ? (t + 1) / ratio : Nc;
}

/* Random top-k rows: distinct usable ids in random slots, −1 elsewhere; some rows take fewer, every
 * 5th row none (an empty selection). */
static int32_t *make_topk(acfg g, uint64_t seed) {
    int32_t *topk = malloc((size_t)(g.B * g.T * g.K > 0 ? g.B * g.T * g.K : 1) * sizeof(int32_t));
    int32_t *pool = malloc((size_t)(g.Nc > 0 ? g.Nc : 1) * sizeof(int32_t));
    uint64_t s = seed * 7919 + 1;
    for (int64_t bt = 0; bt < g.B * g.T; bt++) {
        int64_t nu = usable(bt % g.T, g.ratio, g.Nc), m = nu < g.K ? nu : g.K;
        int32_t *row = topk + bt * g.K;
        for (int64_t k = 0; k < g.K; k++) row[k] = -1;
        if (lcg(&s) % 3 == 0) m /= 2;
        if (bt % 5 == 2) m = 0;
        for (int64_t i = 0; i < nu; i++) pool[i] = (int32_t)i;
        for (int64_t i = 0; i < m; i++) {
            int64_t j = i + (int64_t)(lcg(&s) % (uint64_t)(nu - i));
            int32_t tmp = pool[i];
            pool[i] = pool[j], pool[j] = tmp;
            int64_t k = (int64_t)(lcg(&s) % (uint64_t)g.K);
            while (row[k] >= 0) k = (k + 1) % g.K;
            row[k] = pool[i];
        }
    }
    free(pool);
    return topk;
}

/* ---------------------------------------------------------------- sparse attention */

typedef struct {
    acfg g;
    double scale;
    oc_buf q, kv, kvc, sink;
    int32_t *topk;
} ain;

static ain ain_make(acfg g, unsigned seed) {
    ain a = {.g = g, .scale = 1.0 / sqrt((double)g.c)};
    a.q = oc_rand(g.B * g.T * g.H * g.c, seed, 1.5f);
    a.kv = oc_rand(g.B * g.T * g.c, seed + 1, 1.5f);
    a.kvc = oc_rand(g.B * g.Nc * g.c, seed + 2, 1.5f);
    a.sink = oc_rand(g.H, seed + 3, 1.0f);
    a.topk = g.use_topk ? make_topk(g, seed) : NULL;
    return a;
}
static void ain_free(ain *a) { oc_free(&a->q), oc_free(&a->kv), oc_free(&a->kvc), oc_free(&a->sink), free(a->topk); }

#define ACFG_ARGS(g) (g).B, (g).T, (g).H, (g).c, (g).window, (g).ratio, (g).Nc, (g).K
#define ACFG_DIMS(g) \
    ((sparse_attn_dims){.B = (g).B, .T = (g).T, .H = (g).H, .c = (g).c, .window = (g).window, .ratio = (g).ratio, \
                        .Nc = (g).Nc, .K = (g).K})

/* Most keys of any query row, and the largest Σ_i |q_i·key_i| over every (query head, key row) pair. */
static int64_t max_keys(const ain *a) {
    acfg g = a->g;
    int64_t m = 0;
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t t = 0; t < g.T; t++) {
            int64_t n = 0;
            for (int64_t j = 0; j < g.T + g.Nc; j++) n += oracle_attn_key_count(j, b, t, a->topk, g.T, g.window, g.ratio, g.Nc, g.K);
            m = n > m ? n : m;
        }
    return m;
}
static double max_abs_dot(const ain *a) {
    acfg g = a->g;
    double m = 0;
    for (int64_t bth = 0; bth < g.B * g.T * g.H; bth++) {
        int64_t b = bth / (g.T * g.H);
        for (int64_t j = 0; j < g.T + g.Nc; j++) {
            const double *k = j < g.T ? a->kv.d + (b * g.T + j) * g.c : a->kvc.d + (b * g.Nc + j - g.T) * g.c;
            double s = 0;
            for (int64_t i = 0; i < g.c; i++) s += fabs(a->q.d[bth * g.c + i] * k[i]);
            m = fmax(m, s);
        }
    }
    return m;
}

/* Σ over query rows of each key row's probability (P: [B, T + Nc]) and of each head's sink
 * probability (Ps: [H]), from the oracle's lse. */
static void key_mass(double *P, double *Ps, const ain *a, const double *lse) {
    acfg g = a->g;
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t t = 0; t < g.T; t++)
            for (int64_t h = 0; h < g.H; h++) {
                int64_t bth = (b * g.T + t) * g.H + h;
                Ps[h] += exp(a->sink.d[h] - lse[bth]);
                for (int64_t j = 0; j < g.T + g.Nc; j++) {
                    int64_t cnt = oracle_attn_key_count(j, b, t, a->topk, g.T, g.window, g.ratio, g.Nc, g.K);
                    if (!cnt) continue;
                    const double *k = j < g.T ? a->kv.d + (b * g.T + j) * g.c : a->kvc.d + (b * g.Nc + j - g.T) * g.c;
                    double s = 0;
                    for (int64_t i = 0; i < g.c; i++) s += a->q.d[bth * g.c + i] * k[i];
                    P[b * (g.T + g.Nc) + j] += (double)cnt * exp(a->scale * s - lse[bth]);
                }
            }
}

/* The oracle's backward against central differences of its forward, objective Σ r·o. */
typedef struct {
    const ain *a;
    const double *r;
    double *o, *lse;
} attn_ctx;
static double attn_obj(void *p) {
    attn_ctx *c = p;
    const ain *a = c->a;
    oracle_sparse_attn_fwd(c->o, c->lse, a->q.d, a->kv.d, a->kvc.d, a->topk, a->sink.d, ACFG_ARGS(a->g), a->scale);
    return oc_dot(c->r, c->o, a->q.n);
}
static void fd_attn(const ain *a, const double *r) {
    acfg g = a->g;
    double *gq = oc_dalloc(a->q.n), *gkv = oc_dalloc(a->kv.n), *gkvc = oc_dalloc(a->kvc.n), *gs = oc_dalloc(g.H);
    oracle_sparse_attn_bwd(gq, gkv, gkvc, gs, r, a->q.d, a->kv.d, a->kvc.d, a->topk, a->sink.d, ACFG_ARGS(g), a->scale);
    attn_ctx c = {a, r, oc_dalloc(a->q.n), oc_dalloc(g.B * g.T * g.H)};
    oc_fd_check("oracle sparse_attn dq", attn_obj, &c, a->q.d, a->q.n, gq);
    oc_fd_check("oracle sparse_attn dkv", attn_obj, &c, a->kv.d, a->kv.n, gkv);
    if (g.ratio > 0 && g.Nc > 0) oc_fd_check("oracle sparse_attn dkvc", attn_obj, &c, a->kvc.d, a->kvc.n, gkvc);
    oc_fd_check("oracle sparse_attn dsink", attn_obj, &c, a->sink.d, g.H, gs);
    free(gq), free(gkv), free(gkvc), free(gs), free(c.o), free(c.lse);
}

/* Bounds (per config; nk = most keys of a row, Vm = max|key|, Qk = max Σ|q·key|, Gd = c·max|dO|·Vm
 * bounds |dO·key| and |dO·o|):
 *   s = scale·(q·key): Δs = (c+2)·U·scale·Qk;  each p = exp(s − m)/z: E_p = 2Δs + (nk+6)·U relative
 *     (expf, the sum of nk terms, the reciprocal and the product; lse carries Δs + (nk+6)U);
 *   o = Σ p·key with Σ p <= 1:        |err| <= (E_p + (nk+1)·U)·Vm =: E_o
 *   lse = m + log z:                   |err| <= Δs + (nk+6)·U + U·|lse|
 * Backward (from the production's own o and lse): dp − Dsum is off by 2(c+1)·U·Gd + c·max|dO|·E_o;
 *   ds_j = p_j·(dp_j − Dsum) by p_j·E_ds with E_ds = 2Gd·(E_p + 2U) + 2(c+1)·U·Gd + c·max|dO|·E_o;
 *   dq = init + scale·Σ ds·key:        |err| <= scale·Vm·(E_ds + (nk+3)·U·2Gd) + U·|init|
 *   dkey_j = init + Σ_rows scale·ds·q + p·dO, with P_j = Σ_rows p_j (key_mass):
 *                                      |err| <= P_j·(scale·qm·E_ds + (E_p + 3U)·max|dO|)
 *                                                + (R + 3)·U·P_j·(scale·qm·2Gd + max|dO|) + U·|init|
 *     (R = B·T·H rows at most add into one key);
 *   dsink_h = init − Σ_rows p_sink·Dsum (in double): |err| <= Ps_h·(E_p·Gd + (c+1)·U·Gd + c·max|dO|·E_o + 2U·Gd) + U·|init|. */
static void attn_case(acfg g, unsigned seed, int fd) {
    ain a = ain_make(g, seed);
    int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
    oc_buf o = oc_zero(no), lse = oc_zero(nl);
    double *wo = oc_dalloc(no), *wl = oc_dalloc(nl), *tl = oc_dalloc(nl);
    char what[128];
    snprintf(what, sizeof what, "sparse_attn B=%lld T=%lld H=%lld c=%lld w=%lld r=%lld Nc=%lld K=%lld topk=%d",
             (long long)g.B, (long long)g.T, (long long)g.H, (long long)g.c, (long long)g.window, (long long)g.ratio,
             (long long)g.Nc, (long long)g.K, g.use_topk);
    sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q.f, .kv = a.kv.f,
        .kvc = a.kvc.f, .sink = a.sink.f, .topk = a.topk, .o = o.f, .lse = lse.f});
    oracle_sparse_attn_fwd(wo, wl, a.q.d, a.kv.d, a.kvc.d, a.topk, a.sink.d, ACFG_ARGS(g), a.scale);

    double U = U_F32, nk = (double)max_keys(&a), Vm = fmax(oc_absmax_d(a.kv.d, a.kv.n), oc_absmax_d(a.kvc.d, a.kvc.n));
    double qm = oc_absmax_d(a.q.d, a.q.n), ds_ = (double)(g.c + 2) * U * a.scale * max_abs_dot(&a);
    double Ep = 2 * ds_ + (nk + 6) * U, Eo = (Ep + (nk + 1) * U) * Vm;
    for (int64_t i = 0; i < nl; i++) tl[i] = ds_ + (nk + 6) * U + U * fabs(wl[i]);
    oc_check_all(what, o.f, wo, Eo, no);
    oc_check("sparse_attn lse", lse.f, wl, tl, nl);

    oc_buf dout = oc_rand(no, seed + 10, 1.0f), dq = oc_rand(no, seed + 11, 0.5f), dkv = oc_rand(a.kv.n, seed + 12, 0.5f);
    oc_buf dkvc = oc_rand(a.kvc.n, seed + 13, 0.5f), dsink = oc_rand(g.H, seed + 14, 0.5f);
    double *wdq = oc_dalloc(no), *wdkv = oc_dalloc(a.kv.n), *wdkvc = oc_dalloc(a.kvc.n), *wds = oc_dalloc(g.H);
    memcpy(wdq, dq.d, (size_t)no * sizeof(double));
    memcpy(wdkv, dkv.d, (size_t)a.kv.n * sizeof(double));
    memcpy(wdkvc, dkvc.d, (size_t)a.kvc.n * sizeof(double));
    memcpy(wds, dsink.d, (size_t)g.H * sizeof(double));
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q.f, .kv = a.kv.f,
        .kvc = a.kvc.f, .sink = a.sink.f, .topk = a.topk, .o = o.f, .lse = lse.f}, &(sparse_attn_grads){.dout = dout.f,
        .dq = dq.f, .dkv = dkv.f, .dkvc = dkvc.f, .dsink = dsink.f});
    oracle_sparse_attn_bwd(wdq, wdkv, wdkvc, wds, dout.d, a.q.d, a.kv.d, a.kvc.d, a.topk, a.sink.d, ACFG_ARGS(g),
                           a.scale);
    double dom = oc_absmax_d(dout.d, no), Gd = (double)g.c * dom * Vm, R = (double)(g.B * g.T * g.H);
    double Eds = 2 * Gd * (Ep + 2 * U) + 2 * (double)(g.c + 1) * U * Gd + (double)g.c * dom * Eo;
    double *tdq = oc_dalloc(no), *tkey = oc_dalloc(g.B * (g.T + g.Nc)), *tds = oc_dalloc(g.H);
    double *P = oc_dalloc(g.B * (g.T + g.Nc)), *Ps = oc_dalloc(g.H);
    key_mass(P, Ps, &a, wl);
    for (int64_t i = 0; i < no; i++) tdq[i] = a.scale * Vm * (Eds + (nk + 3) * U * 2 * Gd) + U * fabs(dq.d[i]);
    for (int64_t j = 0; j < g.B * (g.T + g.Nc); j++)
        tkey[j] = P[j] * (a.scale * qm * Eds + (Ep + 3 * U) * dom) + (R + 3) * U * P[j] * (a.scale * qm * 2 * Gd + dom);
    double *tkv = oc_dalloc(a.kv.n), *tkvc = oc_dalloc(a.kvc.n);
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t j = 0; j < g.T + g.Nc; j++)
            for (int64_t i = 0; i < g.c; i++) {
                if (j < g.T)
                    tkv[(b * g.T + j) * g.c + i] = tkey[b * (g.T + g.Nc) + j] + U * fabs(dkv.d[(b * g.T + j) * g.c + i]);
                else
                    tkvc[(b * g.Nc + j - g.T) * g.c + i] = tkey[b * (g.T + g.Nc) + j] + U * fabs(dkvc.d[(b * g.Nc + j - g.T) * g.c + i]);
            }
    for (int64_t h = 0; h < g.H; h++)
        tds[h] = Ps[h] * (Ep * Gd + (double)(g.c + 1) * U * Gd + (double)g.c * dom * Eo + 2 * U * Gd) + U * fabs(dsink.d[h]);
    oc_check("sparse_attn dq", dq.f, wdq, tdq, no);
    oc_check("sparse_attn dkv", dkv.f, wdkv, tkv, a.kv.n);
    if (g.ratio > 0) oc_check("sparse_attn dkvc", dkvc.f, wdkvc, tkvc, a.kvc.n);
    oc_check("sparse_attn dsink", dsink.f, wds, tds, g.H);

    if (fd) fd_attn(&a, dout.d);
    free(wo), free(wl), free(tl), free(wdq), free(wdkv), free(wdkvc), free(wds), free(tdq), free(tkey), free(tds);
    free(P), free(Ps), free(tkv), free(tkvc);
    oc_free(&o), oc_free(&lse), oc_free(&dout), oc_free(&dq), oc_free(&dkv), oc_free(&dkvc), oc_free(&dsink);
    ain_free(&a);
}

static void test_sparse_attn(void) {
    const acfg cfgs[] = {
        {2, 5, 3, 8, 8, 0, 0, 0, 0},          /* SWA, T smaller than the window */
        {2, 21, 5, 11, 6, 4, 5, 3, 1},        /* CSA top-k: −1 slots, empty rows, T % 4 = 1, H % 4 = 1 */
        {1, 22, 4, 9, 6, 4, 5, 0, 0},         /* dense CSA: every usable entry */
        {1, 3, 2, 8, 4, 4, 0, 0, 0},          /* T smaller than the ratio: no compressed entry */
        {1, 64, 4, 32, 16, 4, 16, 4, 1},      /* a tiny-A CSA layer, vector widths exact */
        {1, 300, 2, 8, 128, 128, 2, 0, 0},    /* HCA-like: ratio 128 = window, T % 128 = 44 */
        {1, 7, 2, 5, 3, 4, 1, 2, 1},          /* small: for finite differences */
        {2, 9, 2, 4, 4, 4, 2, 0, 0},          /* small dense: for finite differences */
    };
    for (int i = 0; i < (int)(sizeof cfgs / sizeof cfgs[0]); i++) attn_case(cfgs[i], 100 + 10 * (unsigned)i, i == 0 || i >= 6);
}

/* ---------------------------------------------------------------- indexer top-k */

typedef struct {
    int64_t B, T, HI, dI, Nc, ratio, K;
} icfg;

/* Error of the production's float score I[s] of row (b, t): each head's dI-term dot (dI+1 roundings on
 * Σ|qi·ki|), scaled by wscale·w, then HI terms summed (HI+2 roundings on Σ|term|). */
static double score_err(const double *qi, const double *ki, const double *w, icfg g, int64_t b, int64_t t, int64_t s,
                        double wscale) {
    double e = 0, terms = 0;
    for (int64_t h = 0; h < g.HI; h++) {
        const double *q = qi + ((b * g.T + t) * g.HI + h) * g.dI, *k = ki + (b * g.Nc + s) * g.dI;
        double d = 0, ad = 0;
        for (int64_t i = 0; i < g.dI; i++) d += q[i] * k[i], ad += fabs(q[i] * k[i]);
        e += fabs(wscale * w[(b * g.T + t) * g.HI + h]) * (double)(g.dI + 1) * U_F32 * ad;
        terms += fabs(wscale * w[(b * g.T + t) * g.HI + h] * (d > 0 ? d : 0));
    }
    return e + (double)(g.HI + 2) * U_F32 * terms;
}

/* Production top-k vs the oracle's. Rows with at most K usable entries, and every row when `exact`
 * (inputs built with exact ties, which are exact in float too): equal, slot for slot. Other rows:
 * equal, unless the oracle's scores put a selected and an unselected entry within the sum of their
 * score bounds (a near tie float rounding may flip): then the production's choice must be admissible
 * (ascending, distinct, usable, and no unselected entry above a selected one by more than the bounds).
 * Random data must have no such near tie. */
static void topk_case(icfg g, unsigned seed, int ties) {
    const double wscale = 0.3;
    oc_buf qi = oc_rand(g.B * g.T * g.HI * g.dI, seed, 1.0f), ki = oc_rand(g.B * g.Nc * g.dI, seed + 1, 1.0f);
    oc_buf w = oc_rand(g.B * g.T * g.HI, seed + 2, 1.0f);
    if (ties == 1) /* entries in pairs (2m, 2m+1) with equal keys: equal scores */
        for (int64_t b = 0; b < g.B; b++)
            for (int64_t s = 1; s < g.Nc; s += 2)
                memcpy(ki.f + (b * g.Nc + s) * g.dI, ki.f + (b * g.Nc + s - 1) * g.dI, (size_t)g.dI * sizeof(float));
    if (ties == 2) /* every weight 0: every score 0, the lowest K usable ids win */
        for (int64_t i = 0; i < w.n; i++) w.f[i] = 0;
    oc_sync(&ki), oc_sync(&w);
    int64_t n = g.B * g.T * g.K;
    int32_t *got = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t)), *want = malloc((size_t)(n > 0 ? n : 1) * sizeof(int32_t));
    indexer_topk_fwd(CPU_EXEC, &(indexer_topk_args){.dims = {.B = g.B, .T = g.T, .HI = g.HI, .dI = g.dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .wscale = (float)wscale, .qi = qi.f, .ki = ki.f, .w = w.f, .topk = got});
    oracle_indexer_topk(want, qi.d, ki.d, w.d, g.B, g.T, g.HI, g.dI, g.Nc, g.ratio, g.K, wscale);
    int64_t near = 0, bad = 0, selecting = 0;
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t t = 0; t < g.T; t++) {
            const int32_t *pr = got + (b * g.T + t) * g.K, *orow = want + (b * g.T + t) * g.K;
            int64_t nu = usable(t, g.ratio, g.Nc);
            bool same = memcmp(pr, orow, (size_t)g.K * sizeof(int32_t)) == 0;
            selecting += nu > g.K;
            if (same) continue;
            if (ties || nu <= g.K) {
                bad++;
                continue;
            }
            near++;
            bool ok = true;
            for (int64_t k = 0; k < g.K; k++) ok &= pr[k] >= 0 && pr[k] < nu && (k == 0 || pr[k] > pr[k - 1]);
            for (int64_t k = 0; ok && k < g.K; k++)
                for (int64_t s = 0; s < nu; s++) {
                    bool in = false;
                    for (int64_t k2 = 0; k2 < g.K; k2++) in |= pr[k2] == s;
                    if (in) continue;
                    double Is = oracle_indexer_score(qi.d, ki.d, w.d, b, t, s, g.T, g.HI, g.dI, g.Nc, wscale);
                    double Ik = oracle_indexer_score(qi.d, ki.d, w.d, b, t, pr[k], g.T, g.HI, g.dI, g.Nc, wscale);
                    ok &= Is - Ik <= score_err(qi.d, ki.d, w.d, g, b, t, s, wscale) + score_err(qi.d, ki.d, w.d, g, b, t, pr[k], wscale);
                }
            bad += !ok;
        }
    CHECK(bad == 0, "indexer_topk B=%lld T=%lld Nc=%lld r=%lld K=%lld ties=%d: %lld rows differ from the oracle",
          (long long)g.B, (long long)g.T, (long long)g.Nc, (long long)g.ratio, (long long)g.K, ties, (long long)bad);
    CHECK(near == 0, "indexer_topk: %lld rows with a near tie in random data (pick another seed)", (long long)near);
    CHECK(g.Nc <= g.K || selecting > 0, "indexer_topk: no row selects among more than K entries");
    free(got), free(want);
    oc_free(&qi), oc_free(&ki), oc_free(&w);
}

static void test_indexer_topk(void) {
    topk_case((icfg){2, 40, 3, 5, 10, 4, 4}, 201, 0);   /* T % 4 = 0, selection from t = 19 on */
    topk_case((icfg){1, 43, 5, 8, 10, 4, 3}, 202, 0);   /* T % 4 = 3, HI % 4 = 1 */
    topk_case((icfg){1, 30, 2, 4, 7, 4, 7}, 203, 0);    /* K >= usable everywhere: all usable, no scores */
    topk_case((icfg){1, 600, 2, 4, 4, 128, 2}, 204, 0); /* ratio 128 */
    topk_case((icfg){1, 3, 2, 4, 0, 4, 2}, 205, 0);     /* T smaller than the ratio: all −1 */
    topk_case((icfg){2, 40, 3, 5, 10, 4, 3}, 206, 1);   /* equal scores in pairs: ties to the lower index */
    topk_case((icfg){1, 40, 2, 4, 10, 4, 4}, 207, 2);   /* all scores 0 */
}

/* ---------------------------------------------------------------- indexer KL */

typedef struct {
    acfg g;
    int64_t HI, dI;
    double scale, wscale, gs;
    double *qi, *ki, *w;
    const double *q, *kvc, *lse;
    const int32_t *topk;
} kl_ctx;
static double kl_obj(void *p) {
    kl_ctx *c = p;
    double kl;
    int64_t nr;
    oracle_indexer_kl(&kl, &nr, NULL, NULL, NULL, c->qi, c->ki, c->w, c->topk, c->q, c->kvc, c->lse, c->g.B, c->g.T,
                      c->g.H, c->g.c, c->HI, c->dI, c->g.Nc, c->g.ratio, c->g.K, c->scale, c->wscale, 1.0);
    return c->gs * kl;
}

/* Bounds (nmax = largest set, Qk = max Σ|q·kvc| as in attention, ΔI = the largest score_err,
 * Imax = max|I|, Qi = max Σ|qi·ki|):
 *   teacher p, per head exp(scale·q·kvc − lse) (Δs + U·|arg| + 2U), summed over H and over the set
 *   and divided: relative ε_p = 2(Δs + U·max|arg|) + (H + nmax + 6)·U;
 *   student log q = I − log Σ exp(I − m): δq = 2ΔI + U·(6·Imax + 4·log nmax + nmax + 3);
 *   kl_row = Σ p(log p − log q): Σ|δp|·|log p − log q + 1| + Σ p·δq + 2U·Σ p|log p|, and with
 *   Σ p|log p| <= log n, Σ p|log q| <= kl_row + log n:
 *     |err(kl_sum)| <= (ε_p + 2U)·(n_rows·(2·log nmax + 1) + kl_sum) + n_rows·δq.
 *   dI = gs·(q − p): Σ_s |err| <= gs·(δq + ε_p + 5U) =: E_dI per row, Σ_s |dI| <= 2gs.
 *   dw_h  += wscale·Σ_s dI·ReLU(qi·ki):   |err| <= wscale·Qi·(E_dI + 2gs·(dI + nmax + 5)·U) + U|init|
 *   dqi_h += Σ_s dI·ww_h·[qi·ki > 0]·ki:  |err| <= max|ww|·max|ki|·(E_dI + 2gs·(nmax + 4)·U) + U|init|
 *   dki_s += Σ_rows Σ_h dI·ww·[·]·qi:      |err| <= T·HI·max|ww|·max|qi|·(E_dI + 2gs·(HI + T + 3)·U) + U|init|
 *   ([qi·ki > 0] must be the same in float and double: the test checks no |qi·ki| is within its bound of 0). */
static void kl_case(acfg g, int64_t HI, int64_t dI, unsigned seed, int fd) {
    const double wscale = 0.35, gs = 0.7;
    ain a = ain_make(g, seed);
    oc_buf o = oc_zero(a.q.n), lse = oc_zero(g.B * g.T * g.H);
    sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q.f, .kv = a.kv.f,
        .kvc = a.kvc.f, .sink = a.sink.f, .topk = a.topk, .o = o.f, .lse = lse.f});
    oc_sync(&lse);
    oc_buf qi = oc_rand(g.B * g.T * HI * dI, seed + 20, 1.0f), ki = oc_rand(g.B * g.Nc * dI, seed + 21, 1.0f);
    oc_buf w = oc_rand(g.B * g.T * HI, seed + 22, 1.0f);
    oc_buf dqi = oc_rand(qi.n, seed + 23, 0.3f), dki = oc_rand(ki.n, seed + 24, 0.3f), dw = oc_rand(w.n, seed + 25, 0.3f);
    double *wdqi = oc_dalloc(qi.n), *wdki = oc_dalloc(ki.n), *wdw = oc_dalloc(w.n);
    memcpy(wdqi, dqi.d, (size_t)qi.n * sizeof(double));
    memcpy(wdki, dki.d, (size_t)ki.n * sizeof(double));
    memcpy(wdw, dw.d, (size_t)w.n * sizeof(double));
    double kl, wkl;
    int64_t nr, wnr;
    indexer_kl_fwd_bwd(CPU_EXEC, &(indexer_kl_args){.dims = {.B = g.B, .T = g.T, .HI = HI, .dI = dI, .Nc = g.Nc, .ratio = g.ratio,
        .K = g.K}, .H = g.H, .c = g.c, .scale = (float)a.scale, .wscale = (float)wscale, .grad_scale = (float)gs,
        .qi = qi.f, .ki = ki.f, .w = w.f, .q = a.q.f, .kvc = a.kvc.f, .lse = lse.f, .topk = a.topk, .dqi = dqi.f,
        .dki = dki.f, .dw = dw.f, .kl_sum = &kl, .n_rows = &nr});
    oracle_indexer_kl(&wkl, &wnr, wdqi, wdki, wdw, qi.d, ki.d, w.d, a.topk, a.q.d, a.kvc.d, lse.d, g.B, g.T, g.H, g.c, HI,
                      dI, g.Nc, g.ratio, g.K, a.scale, wscale, gs);
    CHECK(nr == wnr, "indexer_kl rows %lld vs oracle %lld", (long long)nr, (long long)wnr);
    int64_t expect_rows = 0;
    for (int64_t bt = 0; bt < g.B * g.T; bt++) {
        int64_t n = 0;
        for (int64_t k = 0; a.topk && k < g.K; k++) n += a.topk[bt * g.K + k] >= 0;
        expect_rows += (a.topk ? n : usable(bt % g.T, g.ratio, g.Nc)) > 0;
    }
    CHECK(wnr == expect_rows && wnr > 0, "indexer_kl: %lld rows, %lld have a nonempty set", (long long)wnr, (long long)expect_rows);

    /* bounds */
    icfg ig = {g.B, g.T, HI, dI, g.Nc, g.ratio, g.K};
    double U = U_F32, nmax = (double)(a.topk ? g.K : g.Nc), dI_ = 0, Imax = 0, Qi = 0, argmax = 0, near0 = 0;
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t t = 0; t < g.T; t++)
            for (int64_t s = 0; s < g.Nc; s++) {
                dI_ = fmax(dI_, score_err(qi.d, ki.d, w.d, ig, b, t, s, wscale));
                Imax = fmax(Imax, fabs(oracle_indexer_score(qi.d, ki.d, w.d, b, t, s, g.T, HI, dI, g.Nc, wscale)));
                for (int64_t h = 0; h < HI; h++) {
                    double d = 0, ad = 0;
                    for (int64_t i = 0; i < dI; i++) {
                        double x = qi.d[((b * g.T + t) * HI + h) * dI + i] * ki.d[(b * g.Nc + s) * dI + i];
                        d += x, ad += fabs(x);
                    }
                    Qi = fmax(Qi, ad);
                    near0 += fabs(d) <= (double)(dI + 1) * U * ad;
                }
                for (int64_t h = 0; h < g.H; h++) {
                    double d = 0;
                    for (int64_t i = 0; i < g.c; i++) d += a.q.d[((b * g.T + t) * g.H + h) * g.c + i] * a.kvc.d[(b * g.Nc + s) * g.c + i];
                    argmax = fmax(argmax, fabs(a.scale * d - lse.d[(b * g.T + t) * g.H + h]));
                }
            }
    CHECK(near0 == 0, "indexer_kl: %g head-entry dots within rounding of 0 (a ReLU that float may flip)", near0);
    double ds_ = (double)(g.c + 2) * U * a.scale * max_abs_dot(&a);
    double ep = 2 * (ds_ + U * argmax) + (double)(g.H + 6) * U + nmax * U;
    double dq = 2 * dI_ + U * (6 * Imax + 4 * log(nmax) + nmax + 3);
    double tkl = (ep + 2 * U) * ((double)wnr * (2 * log(nmax) + 1) + wkl) + (double)wnr * dq;
    CHECK(fabs(kl - wkl) <= tkl, "indexer_kl kl_sum %.12g vs oracle %.12g (bound %.3g)", kl, wkl, tkl);
    double EdI = gs * (dq + ep + 5 * U), wwm = wscale * oc_absmax_d(w.d, w.n);
    double tw = wscale * Qi * (EdI + 2 * gs * ((double)dI + nmax + 5) * U);
    double tq = wwm * oc_absmax_d(ki.d, ki.n) * (EdI + 2 * gs * (nmax + 4) * U);
    double tk = (double)(g.T * HI) * wwm * oc_absmax_d(qi.d, qi.n) * (EdI + 2 * gs * (double)(HI + g.T + 3) * U);
    double *t_w = oc_dalloc(w.n), *t_q = oc_dalloc(qi.n), *t_k = oc_dalloc(ki.n);
    for (int64_t i = 0; i < w.n; i++) t_w[i] = tw + U * fabs(dw.d[i]);
    for (int64_t i = 0; i < qi.n; i++) t_q[i] = tq + U * fabs(dqi.d[i]);
    for (int64_t i = 0; i < ki.n; i++) t_k[i] = tk + U * fabs(dki.d[i]);
    oc_check("indexer_kl dw", dw.f, wdw, t_w, w.n);
    oc_check("indexer_kl dqi", dqi.f, wdqi, t_q, qi.n);
    oc_check("indexer_kl dki", dki.f, wdki, t_k, ki.n);

    if (fd) {
        double *gq = oc_dalloc(qi.n), *gk = oc_dalloc(ki.n), *gw = oc_dalloc(w.n), x;
        int64_t r;
        oracle_indexer_kl(&x, &r, gq, gk, gw, qi.d, ki.d, w.d, a.topk, a.q.d, a.kvc.d, lse.d, g.B, g.T, g.H, g.c, HI, dI,
                          g.Nc, g.ratio, g.K, a.scale, wscale, gs);
        kl_ctx c = {g, HI, dI, a.scale, wscale, gs, qi.d, ki.d, w.d, a.q.d, a.kvc.d, lse.d, a.topk};
        oc_fd_check("oracle indexer_kl dqi", kl_obj, &c, qi.d, qi.n, gq);
        oc_fd_check("oracle indexer_kl dki", kl_obj, &c, ki.d, ki.n, gk);
        oc_fd_check("oracle indexer_kl dw", kl_obj, &c, w.d, w.n, gw);
        free(gq), free(gk), free(gw);
    }
    free(wdqi), free(wdki), free(wdw), free(t_w), free(t_q), free(t_k);
    oc_free(&o), oc_free(&lse), oc_free(&qi), oc_free(&ki), oc_free(&w), oc_free(&dqi), oc_free(&dki), oc_free(&dw);
    ain_free(&a);
}

static void test_indexer_kl(void) {
    kl_case((acfg){2, 21, 5, 11, 6, 4, 5, 3, 1}, 3, 7, 301, 1);   /* top-k sets with −1 slots and empty rows */
    kl_case((acfg){1, 22, 4, 9, 6, 4, 5, 0, 0}, 2, 5, 302, 1);    /* dense: every usable entry */
    kl_case((acfg){1, 64, 4, 32, 16, 4, 16, 4, 1}, 4, 16, 303, 0); /* tiny-A */
}

int main(void) {
    RUN(test_sparse_attn);
    RUN(test_indexer_topk);
    RUN(test_indexer_kl);
    TEST_MAIN_END("test_oracle_attn");
}
