/* The mHC production kernels (kernels.h: hc_split_sinkhorn, hc_pre, hc_post, hc_head, forward and
 * backward) against the scalar double oracles of src/kernels/ref/oracle_hc.c, under bounds derived
 * from float32 rounding (tests/test_oracle_check.h), and each oracle's backward against finite
 * differences of its own forward.
 *
 * Bounds of the Sinkhorn part. Each normalisation y = x/(S + eps) rounds n−1 additions, the + eps, the
 * reciprocal and the product: it injects <= (n+2)·U relative error. A relative error δ already in x
 * leaves as δ − (the line-weighted mean of δ): a projection, so errors do not grow from step to step
 * in the weighted 2-norm; per element we allow a factor n for that propagation (a model of the error,
 * not a proof: the test below shows the resulting bound still sits far below real changes).
 * Over `steps` = 2·iters − 1 normalisations after the softmax (its own error: 2 roundings of
 * L = m·scale + base, expf, the sum and the division, (n+4)U + 2U·|L|max), the comb is within
 *   E_comb = n·((n+5)·U + 4U·|L|max + steps·(n+2)·U) relative;
 * the backward reverses the same steps ((n+3) roundings each) and gets the same kind of bound with
 * (n+3). test_sinkhorn_bound_discriminates checks that these bounds are far below the change of one
 * Sinkhorn iteration more or less and of a transposed comb, so the comparison can see such bugs. */
#include "kernels/kernels.h"
#include "kernels/ref/oracle.h"
#include "test_oracle_check.h"

#define HC_EPS ((double)1e-6f) /* hc_eps and norm_eps, as the float kernels see them */

static int64_t sk_steps(int64_t iters) { return 2 * iters - 1; }

/* |L| max of the comb logits L = mixes·scale2 + base of one token. */
static double comb_logit_max(const double *mixes, const double *scale, const double *base, int64_t n) {
    double m = 0;
    for (int64_t e = 2 * n; e < (2 + n) * n; e++) m = fmax(m, fabs(mixes[e] * scale[2] + base[e]));
    return m;
}
static double sk_fwd_rel(int64_t n, int64_t iters, double Lmax) {
    return (double)n * ((double)(n + 5) * U_F32 + 4 * U_F32 * Lmax + (double)(sk_steps(iters) * (n + 2)) * U_F32);
}

/* pre_j = σ(a) + eps with a = m·s + b (2 roundings: 2U·(|m·s| + |a|)), σ' <= 1/4, σ within 4U, + eps:
 * |err| <= U·(0.5·(|m·s| + |a|) + 5·σ + 1e-30) — we use U·(|m·s| + |a| + 6). post: twice that. */
static double gate_tol(double m, double s, double b) { return U_F32 * (fabs(m * s) + fabs(m * s + b) + 6); }

/* ---------------------------------------------------------------- Sinkhorn split */

typedef struct {
    double *mixes, *scale, *base;
    const double *rp, *rq, *rc; /* objective weights on pre, post, comb */
    int64_t n, iters;
    double eps;
} sk_ctx;
static double sk_obj(void *p) {
    sk_ctx *c = p;
    double pre[8], post[8], comb[64];
    oracle_hc_sinkhorn_fwd(pre, post, comb, c->mixes, c->scale, c->base, c->n, c->iters, c->eps);
    return oc_dot(c->rp, pre, c->n) + oc_dot(c->rq, post, c->n) + oc_dot(c->rc, comb, c->n * c->n);
}

static void sinkhorn_case(int64_t n, int64_t iters, float amp, unsigned seed) {
    const double eps = (double)1e-6f;
    int64_t M = (2 + n) * n, nn = n * n;
    oc_buf mixes = oc_rand(M, seed, amp), scale = oc_rand(3, seed + 1, 1.0f), base = oc_rand(M, seed + 2, 0.5f);
    oc_buf pre = oc_zero(n), post = oc_zero(n), comb = oc_zero(nn);
    oc_buf dpre = oc_rand(n, seed + 3, 1.0f), dpost = oc_rand(n, seed + 4, 1.0f), dcomb = oc_rand(nn, seed + 5, 1.0f);
    oc_buf dmix = oc_rand(M, seed + 6, 0.5f), dsc = oc_rand(3, seed + 7, 0.5f), dbase = oc_rand(M, seed + 8, 0.5f);
    double wpre[8], wpost[8], wcomb[64], tp[8], tq[8], tc[64];
    hc_split_sinkhorn_fwd(CPU_EXEC, &(hc_sinkhorn_args){.n = n, .iters = iters, .eps = (float)eps, .mixes = mixes.f,
        .scale = scale.f, .base = base.f, .pre = pre.f, .post = post.f, .comb = comb.f});
    oracle_hc_sinkhorn_fwd(wpre, wpost, wcomb, mixes.d, scale.d, base.d, n, iters, eps);
    double Lmax = comb_logit_max(mixes.d, scale.d, base.d, n), ec = sk_fwd_rel(n, iters, Lmax);
    for (int64_t j = 0; j < n; j++) {
        tp[j] = gate_tol(mixes.d[j], scale.d[0], base.d[j]);
        tq[j] = 2 * gate_tol(mixes.d[n + j], scale.d[1], base.d[n + j]);
    }
    for (int64_t e = 0; e < nn; e++) tc[e] = ec * fabs(wcomb[e]);
    oc_check("sinkhorn pre", pre.f, wpre, tp, n);
    oc_check("sinkhorn post", post.f, wpost, tq, n);
    oc_check("sinkhorn comb", comb.f, wcomb, tc, nn);

    /* backward: dmixes/dbase of the comb part are (dL) = sm·(g − Σ g·sm) with g the gradient reversed
     * through the steps: each step (n+3) roundings; the errors of sm and of the saved-step inputs
     * (E_comb) enter once more: |err| <= (E_comb + n·steps·(n+3)·U)·G, G = the largest |term|, bounded
     * by max|dcomb|·(the largest 1/(S + eps) gain, ~1 for doubly stochastic steps)·n. dscale sums M
     * such terms times |mixes|. pre/post parts: σ' within 8U plus a's error: 8U·|dout|·(1 + |a|). */
    double wdm[64], wdb[64], wds[3], g_dm[64] = {0}, g_db[64] = {0}, g_ds[3] = {0};
    memcpy(wdm, dmix.d, (size_t)M * sizeof(double));
    memcpy(wdb, dbase.d, (size_t)M * sizeof(double));
    memcpy(wds, dsc.d, 3 * sizeof(double));
    hc_split_sinkhorn_bwd(CPU_EXEC, &(hc_sinkhorn_args){.n = n, .iters = iters, .eps = (float)eps, .mixes = mixes.f,
        .scale = scale.f, .base = base.f}, &(hc_sinkhorn_grads){.dpre = dpre.f, .dpost = dpost.f, .dcomb = dcomb.f,
        .dmixes = dmix.f, .dscale = dsc.f, .dbase = dbase.f});
    oracle_hc_sinkhorn_bwd(wdm, wds, wdb, dpre.d, dpost.d, dcomb.d, mixes.d, scale.d, base.d, n, iters, eps);
    double G = (double)n * oc_absmax_d(dcomb.d, nn);
    double eb = ec + (double)(n * sk_steps(iters) * (n + 3)) * U_F32;
    double tdm[64], tdb[64], tds[3];
    for (int64_t i = 0; i < M; i++) {
        int part = i < n ? 0 : i < 2 * n ? 1 : 2;
        double a = mixes.d[i] * scale.d[part] + base.d[i];
        double gate = part == 2 ? eb * G : 8 * U_F32 * (part ? 2 * fabs(dpost.d[i - n]) : fabs(dpre.d[i])) * (1 + fabs(a));
        tdb[i] = gate + U_F32 * fabs(dbase.d[i]);
        tdm[i] = gate * fabs(scale.d[part]) * (1 + U_F32) + 2 * U_F32 * fabs(wdm[i] - dmix.d[i]) + U_F32 * fabs(dmix.d[i]);
    }
    for (int p = 0; p < 3; p++) {
        double s = 0;
        for (int64_t i = (p == 2 ? 2 * n : p * n); i < (p == 2 ? M : (p + 1) * n); i++) s += fabs(mixes.d[i]) * (tdb[i] + fabs(wdb[i] - dbase.d[i]) * (double)M * U_F32);
        tds[p] = s + U_F32 * fabs(dsc.d[p]);
    }
    oc_check("sinkhorn_bwd dmixes", dmix.f, wdm, tdm, M);
    oc_check("sinkhorn_bwd dbase", dbase.f, wdb, tdb, M);
    oc_check("sinkhorn_bwd dscale", dsc.f, wds, tds, 3);

    sk_ctx c = {mixes.d, scale.d, base.d, dpre.d, dpost.d, dcomb.d, n, iters, eps};
    oracle_hc_sinkhorn_bwd(g_dm, g_ds, g_db, dpre.d, dpost.d, dcomb.d, mixes.d, scale.d, base.d, n, iters, eps);
    oc_fd_check("oracle sinkhorn dmixes", sk_obj, &c, mixes.d, M, g_dm);
    oc_fd_check("oracle sinkhorn dbase", sk_obj, &c, base.d, M, g_db);
    oc_fd_check("oracle sinkhorn dscale", sk_obj, &c, scale.d, 3, g_ds);
    oc_free(&mixes), oc_free(&scale), oc_free(&base), oc_free(&pre), oc_free(&post), oc_free(&comb);
    oc_free(&dpre), oc_free(&dpost), oc_free(&dcomb), oc_free(&dmix), oc_free(&dsc), oc_free(&dbase);
}

static void test_sinkhorn(void) {
    sinkhorn_case(4, 20, 1.0f, 1); /* DeepSeek-V4 */
    sinkhorn_case(4, 20, 4.0f, 2); /* peaked softmax */
    sinkhorn_case(3, 3, 1.0f, 3);
    sinkhorn_case(2, 1, 1.0f, 4); /* a single column normalisation */
    sinkhorn_case(1, 2, 1.0f, 5);
}

/* The Sinkhorn bound above is meaningful: one iteration more or less (at 2 iterations; these small
 * matrices converge so fast that from ~4 iterations on the count moves comb by less than float
 * rounding, and at 20 not at all in double), or the comb transposed, moves some element by far more than the bound allows. */
static void test_sinkhorn_bound_discriminates(void) {
    const int64_t n = 4, M = 24;
    oc_buf mixes = oc_rand(M, 11, 2.0f), scale = oc_rand(3, 12, 1.0f), base = oc_rand(M, 13, 0.5f);
    double pre[4], post[4], c[3][16], c20[16];
    for (int k = 0; k < 3; k++) oracle_hc_sinkhorn_fwd(pre, post, c[k], mixes.d, scale.d, base.d, n, 1 + k, 1e-6);
    oracle_hc_sinkhorn_fwd(pre, post, c20, mixes.d, scale.d, base.d, n, 20, 1e-6);
    double Lmax = comb_logit_max(mixes.d, scale.d, base.d, n), e2 = sk_fwd_rel(n, 2, Lmax), e20 = sk_fwd_rel(n, 20, Lmax);
    double d1 = 0, d3 = 0, dT = 0;
    for (int64_t j = 0; j < n; j++)
        for (int64_t k = 0; k < n; k++) {
            double tol = e2 * fabs(c[1][j * n + k]);
            d1 = fmax(d1, fabs(c[0][j * n + k] - c[1][j * n + k]) / tol);
            d3 = fmax(d3, fabs(c[2][j * n + k] - c[1][j * n + k]) / tol);
            dT = fmax(dT, fabs(c20[k * n + j] - c20[j * n + k]) / (e20 * fabs(c20[j * n + k])));
        }
    CHECK(d1 > 10 && d3 > 10 && dT > 10, "Sinkhorn bound too loose: 1 vs 2 its %.3g×, 3 vs 2 its %.3g×, transposed %.3g×",
          d1, d3, dT);
    oc_free(&mixes), oc_free(&scale), oc_free(&base);
}

/* ---------------------------------------------------------------- hc_pre, hc_head */

typedef struct {
    double *X, *fn, *scale, *base;
    const double *ry, *rp, *rc;
    int64_t N, n, D, iters;
    int head;
} pre_ctx;
static double pre_obj(void *p) {
    pre_ctx *c = p;
    int64_t N = c->N, n = c->n, D = c->D;
    double *y = oc_dalloc(N * D), *post = oc_dalloc(N * n), *comb = oc_dalloc(N * n * n), L;
    if (c->head) {
        oracle_hc_head_fwd(y, c->X, c->fn, c->scale, c->base, N, n, D, HC_EPS, HC_EPS);
        L = oc_dot(c->ry, y, N * D);
    } else {
        oracle_hc_pre_fwd(y, post, comb, NULL, NULL, c->X, c->fn, c->scale, c->base, N, n, D, c->iters, HC_EPS, HC_EPS);
        L = oc_dot(c->ry, y, N * D) + oc_dot(c->rp, post, N * n) + oc_dot(c->rc, comb, N * n * n);
    }
    free(y), free(post), free(comb);
    return L;
}

/* Forward, per token. mixes = r·(fn·x): an nD-term dot and r = 1/sqrtf(dot(x, x)/nD + eps) (nD/2 + 3
 * roundings relative): |err(mixes_i)| <= (3nD/2 + 6)·U·r·Σ|fn_i·x| =: δm_i. pre, post: gate_tol plus
 * σ'·|s|·δm; comb: E_comb plus the logits' share 2·|s2|·δm relative (exp of a shifted logit);
 * y = Σ_j pre_j·X_j: |err| <= Σ_j (|δpre_j| + (n+1)·U·pre_j)·|X_j|.
 * Backward, normwise per tensor, with the oracle's per-token Sinkhorn gradient gm (|gm| <= Gm):
 *   the gm of the production carries the forward's δm through σ', the Sinkhorn backward (above) and a
 *   D-term dot ⟨dy, X_j⟩ for dpre: relative error Egm = E_bwd + (D + nD + 10)·U (hc_head: no Sinkhorn).
 *   dX:    (M + 4)·U on each of its terms + Egm on the gm terms: (M+4)U·|init,dy| + (Egm + (M+4)U)·r·Gm·(M·max|fn| + Σ|mixes|·max|x|·r/nD)
 *   dfn:   N terms gm·r·x: (N + 3)·U + Egm relative, on N·Gm·max r·max|x| (+ U|init|)
 *   dbase, dscale: per-token parts (|db| <= Bmax; dscale's terms db·mixes) summed over N tokens:
 *          (N + M + 3)·U + Egm relative, on N·Bmax and on Σ|db·mixes|. */
static void hc_pre_head_case(int64_t N, int64_t n, int64_t D, int64_t iters, int head, unsigned seed) {
    const double hc_eps = HC_EPS, norm_eps = HC_EPS;
    int64_t M = head ? n : (2 + n) * n, nD = n * D, nsc = head ? 1 : 3;
    oc_buf X = oc_rand(N * nD, seed, 1.5f), fn = oc_rand(M * nD, seed + 1, 0.3f);
    oc_buf scale = oc_rand(nsc, seed + 2, 1.0f), base = oc_rand(M, seed + 3, 0.5f);
    oc_buf y = oc_zero(N * D), post = oc_zero(N * n), comb = oc_zero(N * n * n), mixes = oc_zero(N * M), rs = oc_zero(N);
    oc_buf dy = oc_rand(N * D, seed + 4, 1.0f), dpost = oc_rand(N * n, seed + 5, 1.0f), dcomb = oc_rand(N * n * n, seed + 6, 1.0f);
    oc_buf dX = oc_rand(N * nD, seed + 7, 0.5f), dfn = oc_rand(M * nD, seed + 8, 0.5f);
    oc_buf dsc = oc_rand(nsc, seed + 9, 0.5f), dbase = oc_rand(M, seed + 10, 0.5f);
    double *wy = oc_dalloc(N * D), *wpost = oc_dalloc(N * n), *wcomb = oc_dalloc(N * n * n), *wmix = oc_dalloc(N * M);
    double *wr = oc_dalloc(N), *ty = oc_dalloc(N * D), *tpost = oc_dalloc(N * n), *tcomb = oc_dalloc(N * n * n);
    double *tmix = oc_dalloc(N * M);
    char what[80];
    snprintf(what, sizeof what, "%s N=%lld n=%lld D=%lld iters=%lld", head ? "hc_head" : "hc_pre", (long long)N,
             (long long)n, (long long)D, (long long)iters);
    if (head) {
        hc_head_fwd(CPU_EXEC, &(hc_head_args){.dims = {.N = N, .n = n, .D = D}, .hc_eps = (float)hc_eps,
            .norm_eps = (float)norm_eps, .X = X.f, .fn = fn.f, .scale = scale.f, .base = base.f, .y = y.f,
            .mixes = mixes.f, .rsqrt = rs.f});
        oracle_hc_head_fwd(wy, X.d, fn.d, scale.d, base.d, N, n, D, hc_eps, norm_eps);
    } else {
        hc_pre_fwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = iters}, .hc_eps = (float)hc_eps,
            .norm_eps = (float)norm_eps, .X = X.f, .fn = fn.f, .scale = scale.f, .base = base.f, .y = y.f,
            .post = post.f, .comb = comb.f, .mixes = mixes.f, .rsqrt = rs.f});
        oracle_hc_pre_fwd(wy, wpost, wcomb, wmix, wr, X.d, fn.d, scale.d, base.d, N, n, D, iters, hc_eps, norm_eps);
    }
    double Gm = 0, Bmax = 0, DSabs = 0, Lmax = 0, *gm = oc_dalloc(M), *db = oc_dalloc(M), ds[3];
    for (int64_t t = 0; t < N; t++) {
        const double *x = X.d + t * nD;
        double ss = 0, *mx = wmix + t * M;
        for (int64_t c = 0; c < nD; c++) ss += x[c] * x[c];
        double r = 1 / sqrt(ss / (double)nD + norm_eps);
        if (head) wr[t] = r;
        double dm[64], pre[8], dpre[8];
        for (int64_t i = 0; i < M; i++) {
            double s = 0, a = 0;
            for (int64_t c = 0; c < nD; c++) s += fn.d[i * nD + c] * x[c], a += fabs(fn.d[i * nD + c] * x[c]);
            if (head) mx[i] = r * s;
            dm[i] = (1.5 * (double)nD + 6) * U_F32 * r * a;
            tmix[t * M + i] = dm[i];
        }
        for (int64_t j = 0; j < n; j++) {
            double a = mx[j] * scale.d[0] + base.d[j], sg = 1 / (1 + exp(-a));
            pre[j] = sg + hc_eps;
            dpre[j] = gate_tol(mx[j], scale.d[0], base.d[j]) + 0.25 * fabs(scale.d[0]) * dm[j];
            if (!head)
                tpost[t * n + j] = 2 * (gate_tol(mx[n + j], scale.d[1], base.d[n + j]) + 0.25 * fabs(scale.d[1]) * dm[n + j]);
        }
        for (int64_t d = 0; d < D; d++) {
            double s = 0;
            for (int64_t j = 0; j < n; j++) s += (dpre[j] + (double)(n + 1) * U_F32 * pre[j]) * fabs(x[j * D + d]);
            ty[t * D + d] = s;
        }
        double dmax = 0;
        for (int64_t i = 2 * n; !head && i < M; i++) dmax = fmax(dmax, dm[i]);
        double lm = head ? 0 : comb_logit_max(mx, scale.d, base.d, n);
        Lmax = fmax(Lmax, lm);
        for (int64_t e = 0; !head && e < n * n; e++)
            tcomb[t * n * n + e] = (sk_fwd_rel(n, iters, lm) + 2 * n * fabs(scale.d[2]) * dmax) * fabs(wcomb[t * n * n + e]);
        /* this token's gm, from the oracles */
        double dp[8];
        for (int64_t j = 0; j < n; j++) {
            dp[j] = 0;
            for (int64_t d = 0; d < D; d++) dp[j] += dy.d[t * D + d] * x[j * D + d];
        }
        memset(gm, 0, (size_t)M * sizeof(double));
        memset(db, 0, (size_t)M * sizeof(double));
        memset(ds, 0, sizeof ds);
        if (head) {
            for (int64_t j = 0; j < n; j++) {
                double sg = 1 / (1 + exp(-(mx[j] * scale.d[0] + base.d[j])));
                db[j] = dp[j] * sg * (1 - sg);
                gm[j] = db[j] * scale.d[0];
            }
        } else {
            oracle_hc_sinkhorn_bwd(gm, ds, db, dp, dpost.d + t * n, dcomb.d + t * n * n, mx, scale.d, base.d, n,
                                   iters, hc_eps);
        }
        for (int64_t i = 0; i < M; i++) Gm = fmax(Gm, fabs(gm[i])), Bmax = fmax(Bmax, fabs(db[i])), DSabs += fabs(db[i] * mx[i]);
    }
    oc_check(what, y.f, wy, ty, N * D);
    oc_check("hc mixes", mixes.f, wmix, tmix, N * M);
    for (int64_t t = 0; t < N; t++) /* r: an nD-term float dot, /nD, + eps, sqrtf, 1/: (nD/2 + 4)·U relative */
        CHECK(fabs(rs.f[t] - wr[t]) <= (0.5 * (double)nD + 4) * U_F32 * wr[t], "hc rsqrt[%lld]: %.9g vs %.9g",
              (long long)t, rs.f[t], wr[t]);
    if (!head) {
        oc_check("hc_pre post", post.f, wpost, tpost, N * n);
        oc_check("hc_pre comb", comb.f, wcomb, tcomb, N * n * n);
    }

    /* backward */
    double *wdX = oc_dalloc(N * nD), *wdfn = oc_dalloc(M * nD), wds[3], *wdb = oc_dalloc(M);
    memcpy(wdX, dX.d, (size_t)(N * nD) * sizeof(double));
    memcpy(wdfn, dfn.d, (size_t)(M * nD) * sizeof(double));
    memcpy(wds, dsc.d, (size_t)nsc * sizeof(double));
    memcpy(wdb, dbase.d, (size_t)M * sizeof(double));
    if (head) {
        hc_head_bwd(CPU_EXEC, &(hc_head_args){.dims = {.N = N, .n = n, .D = D}, .hc_eps = (float)hc_eps,
            .norm_eps = (float)norm_eps, .X = X.f, .fn = fn.f, .scale = scale.f, .base = base.f, .mixes = mixes.f,
            .rsqrt = rs.f}, &(hc_head_grads){.dy = dy.f, .dX = dX.f, .dfn = dfn.f, .dscale = dsc.f, .dbase = dbase.f});
        oracle_hc_head_bwd(wdX, wdfn, wds, wdb, dy.d, X.d, fn.d, scale.d, base.d, N, n, D, hc_eps, norm_eps);
    } else {
        hc_pre_bwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = iters}, .hc_eps = (float)hc_eps,
            .norm_eps = (float)norm_eps, .X = X.f, .fn = fn.f, .scale = scale.f, .base = base.f, .mixes = mixes.f,
            .rsqrt = rs.f}, &(hc_pre_grads){.dy = dy.f, .dpost = dpost.f, .dcomb = dcomb.f, .dX = dX.f, .dfn = dfn.f,
            .dscale = dsc.f, .dbase = dbase.f});
        oracle_hc_pre_bwd(wdX, wdfn, wds, wdb, dy.d, dpost.d, dcomb.d, X.d, fn.d, scale.d, base.d, N, n, D, iters,
                          hc_eps, norm_eps);
    }
    double Egm = (head ? 0 : sk_fwd_rel(n, iters, Lmax) + (double)(n * sk_steps(iters) * (n + 3)) * U_F32) +
                 (double)(D + nD + 10) * U_F32;
    double rmax = oc_absmax_d(wr, N), xmax = oc_absmax_d(X.d, N * nD), fmax_ = oc_absmax_d(fn.d, M * nD);
    double mixmax = oc_absmax_d(wmix, N * M), dymax = oc_absmax_d(dy.d, N * D);
    double gm_terms = rmax * Gm * ((double)M * fmax_ + (double)M * mixmax * xmax * rmax / (double)nD);
    double t_dX = (double)(M + 4) * U_F32 * (oc_absmax_d(dX.d, N * nD) + dymax * 1.01) + (Egm + (double)(M + 4) * U_F32) * gm_terms;
    double t_dfn = U_F32 * oc_absmax_d(dfn.d, M * nD) + (Egm + (double)(N + 3) * U_F32) * (double)N * Gm * rmax * xmax;
    double t_db = U_F32 * oc_absmax_d(dbase.d, M) + (Egm + (double)(N + M + 3) * U_F32) * (double)N * Bmax;
    double t_ds = U_F32 * oc_absmax_d(dsc.d, nsc) + (Egm + (double)(N + M + 3) * U_F32) * DSabs;
    oc_check_all("hc dX", dX.f, wdX, t_dX, N * nD);
    oc_check_all("hc dfn", dfn.f, wdfn, t_dfn, M * nD);
    oc_check_all("hc dbase", dbase.f, wdb, t_db, M);
    oc_check_all("hc dscale", dsc.f, wds, t_ds, nsc);

    /* the oracle's backward against finite differences of its forward */
    double *gX = oc_dalloc(N * nD), *gfn = oc_dalloc(M * nD), gs[3] = {0}, *gb = oc_dalloc(M);
    if (head)
        oracle_hc_head_bwd(gX, gfn, gs, gb, dy.d, X.d, fn.d, scale.d, base.d, N, n, D, hc_eps, norm_eps);
    else
        oracle_hc_pre_bwd(gX, gfn, gs, gb, dy.d, dpost.d, dcomb.d, X.d, fn.d, scale.d, base.d, N, n, D, iters, hc_eps,
                          norm_eps);
    pre_ctx c = {X.d, fn.d, scale.d, base.d, dy.d, dpost.d, dcomb.d, N, n, D, iters, head};
    oc_fd_check("oracle hc dX", pre_obj, &c, X.d, N * nD, gX);
    oc_fd_check("oracle hc dfn", pre_obj, &c, fn.d, M * nD, gfn);
    oc_fd_check("oracle hc dscale", pre_obj, &c, scale.d, nsc, gs);
    oc_fd_check("oracle hc dbase", pre_obj, &c, base.d, M, gb);

    free(wy), free(wpost), free(wcomb), free(wmix), free(wr), free(ty), free(tpost), free(tcomb), free(tmix);
    free(gm), free(db), free(wdX), free(wdfn), free(wdb), free(gX), free(gfn), free(gb);
    oc_free(&X), oc_free(&fn), oc_free(&scale), oc_free(&base), oc_free(&y), oc_free(&post), oc_free(&comb);
    oc_free(&mixes), oc_free(&rs), oc_free(&dy), oc_free(&dpost), oc_free(&dcomb), oc_free(&dX), oc_free(&dfn);
    oc_free(&dsc), oc_free(&dbase);
}

static void test_hc_pre(void) {
    hc_pre_head_case(3, 4, 6, 20, 0, 21);
    hc_pre_head_case(1, 4, 40, 20, 0, 22); /* nD = 160: the production's 16-lane dots have a tail */
    hc_pre_head_case(4, 3, 5, 3, 0, 23);
    hc_pre_head_case(2, 2, 9, 1, 0, 24);
}

static void test_hc_head(void) {
    hc_pre_head_case(3, 4, 6, 0, 1, 31);
    hc_pre_head_case(2, 4, 40, 0, 1, 32);
    hc_pre_head_case(5, 3, 7, 0, 1, 33);
}

/* ---------------------------------------------------------------- hc_post */

typedef struct {
    double *x, *res, *post, *comb;
    const double *r;
    double *Y;
    int64_t N, n, D;
} post_ctx;
static double post_obj(void *p) {
    post_ctx *c = p;
    oracle_hc_post_fwd(c->Y, c->x, c->res, c->post, c->comb, c->N, c->n, c->D);
    return oc_dot(c->r, c->Y, c->N * c->n * c->D);
}

static double *abs_copy(const double *x, int64_t n) {
    double *y = oc_dalloc(n);
    for (int64_t i = 0; i < n; i++) y[i] = fabs(x[i]);
    return y;
}

/* Sums of products only: Y is n+1 terms, dx n terms (+ init), dres n terms (+ init), dpost and
 * dcomb D-term dots (+ init): |err| <= (K + 2)·U·(the same sums over absolute values), which the
 * oracle itself computes on |inputs| (and |init|). */
static void hc_post_case(int64_t N, int64_t n, int64_t D, unsigned seed) {
    int64_t nD = n * D;
    oc_buf x = oc_rand(N * D, seed, 1.0f), res = oc_rand(N * nD, seed + 1, 1.0f), post = oc_rand(N * n, seed + 2, 2.0f);
    oc_buf comb = oc_rand(N * n * n, seed + 3, 1.0f), dY = oc_rand(N * nD, seed + 4, 1.0f), Y = oc_zero(N * nD);
    oc_buf dx = oc_rand(N * D, seed + 5, 0.5f), dres = oc_rand(N * nD, seed + 6, 0.5f);
    oc_buf dpost = oc_rand(N * n, seed + 7, 0.5f), dcomb = oc_rand(N * n * n, seed + 8, 0.5f);
    double *wY = oc_dalloc(N * nD), *tY = oc_dalloc(N * nD);
    double *ax = abs_copy(x.d, x.n), *ares = abs_copy(res.d, res.n), *apost = abs_copy(post.d, post.n);
    double *acomb = abs_copy(comb.d, comb.n), *adY = abs_copy(dY.d, dY.n);
    hc_post_fwd(CPU_EXEC, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = x.f, .res = res.f, .post = post.f,
        .comb = comb.f, .Y = Y.f});
    oracle_hc_post_fwd(wY, x.d, res.d, post.d, comb.d, N, n, D);
    oracle_hc_post_fwd(tY, ax, ares, apost, acomb, N, n, D);
    for (int64_t i = 0; i < N * nD; i++) tY[i] *= (double)(n + 3) * U_F32;
    oc_check("hc_post Y", Y.f, wY, tY, N * nD);

    double *w[4], *t[4];
    oc_buf *g[4] = {&dx, &dres, &dpost, &dcomb};
    for (int k = 0; k < 4; k++) {
        w[k] = oc_dalloc(g[k]->n), t[k] = abs_copy(g[k]->d, g[k]->n);
        memcpy(w[k], g[k]->d, (size_t)g[k]->n * sizeof(double));
    }
    hc_post_bwd(CPU_EXEC, &(hc_post_args){.dims = {.N = N, .n = n, .D = D}, .x = x.f, .res = res.f, .post = post.f,
        .comb = comb.f}, &(hc_post_grads){.dY = dY.f, .dx = dx.f, .dres = dres.f, .dpost = dpost.f, .dcomb = dcomb.f});
    oracle_hc_post_bwd(w[0], w[1], w[2], w[3], dY.d, x.d, res.d, post.d, comb.d, N, n, D);
    oracle_hc_post_bwd(t[0], t[1], t[2], t[3], adY, ax, ares, apost, acomb, N, n, D);
    const int64_t K[4] = {n, n, D, D};
    const char *name[4] = {"hc_post dx", "hc_post dres", "hc_post dpost", "hc_post dcomb"};
    for (int k = 0; k < 4; k++) {
        for (int64_t i = 0; i < g[k]->n; i++) t[k][i] *= (double)(K[k] + 3) * U_F32;
        oc_check(name[k], g[k]->f, w[k], t[k], g[k]->n);
    }

    double *gr[4];
    for (int k = 0; k < 4; k++) gr[k] = oc_dalloc(g[k]->n);
    oracle_hc_post_bwd(gr[0], gr[1], gr[2], gr[3], dY.d, x.d, res.d, post.d, comb.d, N, n, D);
    post_ctx c = {x.d, res.d, post.d, comb.d, dY.d, wY, N, n, D};
    double *in[4] = {x.d, res.d, post.d, comb.d};
    for (int k = 0; k < 4; k++) {
        char fdname[48];
        snprintf(fdname, sizeof fdname, "oracle %s", name[k]);
        oc_fd_check(fdname, post_obj, &c, in[k], g[k]->n, gr[k]);
    }
    for (int k = 0; k < 4; k++) free(w[k]), free(t[k]), free(gr[k]);
    free(wY), free(tY), free(ax), free(ares), free(apost), free(acomb), free(adY);
    oc_free(&x), oc_free(&res), oc_free(&post), oc_free(&comb), oc_free(&dY), oc_free(&Y);
    oc_free(&dx), oc_free(&dres), oc_free(&dpost), oc_free(&dcomb);
}

static void test_hc_post(void) {
    hc_post_case(3, 4, 6, 41);
    hc_post_case(1, 4, 37, 42); /* a D that is not a multiple of the production's 16 lanes */
    hc_post_case(5, 2, 3, 43);
}

int main(void) {
    RUN(test_sinkhorn);
    RUN(test_sinkhorn_bound_discriminates);
    RUN(test_hc_pre);
    RUN(test_hc_head);
    RUN(test_hc_post);
    TEST_MAIN_END("test_oracle_hc");
}
