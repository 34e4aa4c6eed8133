/* The basic production kernels (kernels.h: linear, grouped linear, embedding, RMSNorm, RoPE, clamped
 * SwiGLU, compressor pooling, MoE gate, cross-entropy) against the scalar double oracles of
 * src/kernels/ref/oracle_basic.c, element by element under bounds derived from float32 rounding
 * (see tests/test_oracle_check.h), and each oracle's backward against finite differences of its
 * own forward. */
#include "kernels/kernels.h"
#include "kernels/ref/oracle.h"
#include "test_oracle_check.h"

/* ---------------------------------------------------------------- linear and grouped linear */

typedef struct {
    const double *inp, *w;
    const double *r; /* the weights of the objective Σ r·out */
    double *out;
    int64_t N, IC, OC, G; /* G > 0: grouped (IC = Din, OC = R per group) */
} lin_ctx;

static void lin_oracle_fwd(double *out, const double *inp, const double *w, const lin_ctx *c) {
    if (c->G)
        oracle_grouped_linear_fwd(out, inp, w, c->N, c->G, c->OC, c->IC);
    else
        oracle_linear_fwd(out, inp, w, c->N, c->IC, c->OC);
}
static void lin_oracle_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w,
                           const lin_ctx *c) {
    if (c->G)
        oracle_grouped_linear_bwd(dinp, dw, dout, inp, w, c->N, c->G, c->OC, c->IC);
    else
        oracle_linear_bwd(dinp, dw, dout, inp, w, c->N, c->IC, c->OC);
}
static double lin_obj(void *p) {
    lin_ctx *c = p;
    lin_oracle_fwd(c->out, c->inp, c->w, c);
    return oc_dot(c->r, c->out, c->N * (c->G ? c->G : 1) * c->OC);
}

static double *absd(const double *x, int64_t n) {
    double *y = oc_dalloc(n);
    for (int64_t i = 0; i < n; i++) y[i] = fabs(x[i]);
    return y;
}

/* Each output is a K-term dot product (K = IC forward, OC for dinp, N for dw) plus, in the backward,
 * the initial value it accumulates onto: |err| <= γ_(K+1)·(|init| + Σ|terms|) <= (K+2)·U·S, with S
 * computed by the oracle itself on absolute values. */
static void linear_case(int64_t N, int64_t IC, int64_t OC, int64_t G, unsigned seed) {
    int64_t Gm = G ? G : 1, nin = N * Gm * IC, nw = Gm * OC * IC, nout = N * Gm * OC;
    oc_buf inp = oc_rand(nin, seed, 1.0f), w = oc_rand(nw, seed + 1, 1.0f), dout = oc_rand(nout, seed + 2, 1.0f);
    oc_buf dinp = oc_rand(nin, seed + 3, 0.5f), dw = oc_rand(nw, seed + 4, 0.5f), out = oc_zero(nout);
    lin_ctx c = {inp.d, w.d, dout.d, out.d, N, IC, OC, G};
    char what[96];
    snprintf(what, sizeof what, "%slinear N=%lld IC=%lld OC=%lld G=%lld", G ? "grouped_" : "", (long long)N,
             (long long)IC, (long long)OC, (long long)G);

    double *want = oc_dalloc(nout), *tol = oc_dalloc(nout);
    double *ai = absd(inp.d, nin), *aw = absd(w.d, nw), *ag = absd(dout.d, nout);
    if (G)
        grouped_linear_fwd(CPU_EXEC, out.f, inp.f, w.f, N, G, OC, IC);
    else
        linear_fwd(CPU_EXEC, out.f, inp.f, w.f, N, IC, OC);
    lin_oracle_fwd(want, inp.d, w.d, &c);
    lin_oracle_fwd(tol, ai, aw, &c);
    for (int64_t i = 0; i < nout; i++) tol[i] *= (double)(IC + 2) * U_F32;
    oc_check(what, out.f, want, tol, nout);

    /* backward, accumulating onto nonzero gradients */
    double *wdi = oc_dalloc(nin), *wdw = oc_dalloc(nw), *tdi = absd(dinp.d, nin), *tdw = absd(dw.d, nw);
    memcpy(wdi, dinp.d, (size_t)nin * sizeof(double));
    memcpy(wdw, dw.d, (size_t)nw * sizeof(double));
    if (G)
        grouped_linear_bwd(CPU_EXEC, dinp.f, dw.f, dout.f, inp.f, w.f, N, G, OC, IC);
    else
        linear_bwd(CPU_EXEC, dinp.f, dw.f, dout.f, inp.f, w.f, N, IC, OC);
    lin_oracle_bwd(wdi, wdw, dout.d, inp.d, w.d, &c);
    lin_oracle_bwd(tdi, tdw, ag, ai, aw, &c);
    for (int64_t i = 0; i < nin; i++) tdi[i] *= (double)(OC + 3) * U_F32;
    for (int64_t i = 0; i < nw; i++) tdw[i] *= (double)(N + 3) * U_F32;
    oc_check("linear dinp", dinp.f, wdi, tdi, nin);
    oc_check("linear dw", dw.f, wdw, tdw, nw);

    /* the oracle's backward against finite differences of its forward */
    double *gi = oc_dalloc(nin), *gw = oc_dalloc(nw);
    lin_oracle_bwd(gi, gw, dout.d, inp.d, w.d, &c);
    oc_fd_check("oracle linear dinp", lin_obj, &c, inp.d, nin, gi);
    oc_fd_check("oracle linear dw", lin_obj, &c, w.d, nw, gw);

    free(want), free(tol), free(ai), free(aw), free(ag), free(wdi), free(wdw), free(tdi), free(tdw), free(gi), free(gw);
    oc_free(&inp), oc_free(&w), oc_free(&dout), oc_free(&dinp), oc_free(&dw), oc_free(&out);
}

static void test_linear(void) {
    linear_case(1, 1, 1, 0, 1);
    linear_case(7, 13, 5, 0, 2);
    linear_case(33, 64, 17, 0, 3);
    linear_case(3, 300, 2, 0, 4); /* long dot products */
}

static void test_grouped_linear(void) {
    linear_case(1, 1, 1, 1, 5);
    linear_case(5, 12, 3, 2, 6);
    linear_case(9, 33, 7, 4, 7);
}

/* ---------------------------------------------------------------- embedding */

/* Forward: a copy, exact. Backward: row v gets the rows n with ids[n] = v, summed onto its initial
 * value: <= N terms, |err| <= (N+2)·U·(|init| + Σ|dout|). */
static void test_embedding(void) {
    const int64_t N = 11, D = 7, V = 5;
    int32_t ids[11] = {0, 3, 3, 1, 4, 3, 0, 2, 3, 4, 3}; /* repeats: a row summed from many tokens */
    oc_buf table = oc_rand(V * D, 11, 1.0f), dout = oc_rand(N * D, 12, 1.0f), dtab = oc_rand(V * D, 13, 0.5f);
    oc_buf out = oc_zero(N * D);
    double *want = oc_dalloc(N * D);
    embedding_fwd(CPU_EXEC, out.f, table.f, ids, N, D);
    oracle_embedding_fwd(want, table.d, ids, N, D);
    oc_check("embedding fwd (exact)", out.f, want, NULL, N * D);

    double *wd = oc_dalloc(V * D), *tol = absd(dtab.d, V * D), *ag = absd(dout.d, N * D);
    memcpy(wd, dtab.d, (size_t)(V * D) * sizeof(double));
    embedding_bwd(CPU_EXEC, dtab.f, dout.f, ids, N, D);
    oracle_embedding_bwd(wd, dout.d, ids, N, D);
    oracle_embedding_bwd(tol, ag, ids, N, D);
    for (int64_t i = 0; i < V * D; i++) tol[i] *= (double)(N + 2) * U_F32;
    oc_check("embedding bwd", dtab.f, wd, tol, V * D);
    /* the oracle's backward is the transpose of its forward: ⟨dout, fwd(e_k)⟩ = bwd(dout)[k] */
    double *g = oc_dalloc(V * D), *basis = oc_dalloc(V * D), *o = oc_dalloc(N * D);
    oracle_embedding_bwd(g, dout.d, ids, N, D);
    double worst = 0;
    for (int64_t k = 0; k < V * D; k++) {
        basis[k] = 1;
        oracle_embedding_fwd(o, basis, ids, N, D);
        worst = fmax(worst, fabs(oc_dot(dout.d, o, N * D) - g[k]));
        basis[k] = 0;
    }
    CHECK(worst < 1e-12, "oracle embedding bwd is not the transpose of its forward: %.3g", worst);
    free(want), free(wd), free(tol), free(ag), free(g), free(basis), free(o);
    oc_free(&table), oc_free(&dout), oc_free(&dtab), oc_free(&out);
}

/* ---------------------------------------------------------------- RMSNorm */

typedef struct {
    const double *x, *w, *r;
    double *y;
    int64_t N, D;
    double eps;
} norm_ctx;
static double norm_obj(void *p) {
    norm_ctx *c = p;
    oracle_rmsnorm_fwd(c->y, NULL, c->x, c->w, c->N, c->D, c->eps);
    return oc_dot(c->r, c->y, c->N * c->D);
}

/* Production: Σx² in double (exact to ~2^-53), r = (float)(1/sqrt(…)) (1 rounding), y = (x·r)·w (2).
 *   y:    |err| <= 4U·|x·r·w|;  rstd: <= 2U·r.
 *   dx = init + r·(g·w) − c·x, c = (float)(r³·Σ(g·w)·x/D) from the saved float r (2U off the oracle's r,
 *        6U in r³): r·(g·w) 4U, c·x 9U·(r³/D)·Σ|g w x|·|x|, then 2 additions:
 *        |err| <= 12U·(|init| + |r·g·w| + (r³/D)·Σ|g w x|·|x|).
 *   dw = init + Σ_n (float)(g·x·r) in double: per term 2 roundings + r's 2U, then the cast and the add:
 *        |err| <= 6U·(|init| + Σ_n |g·x·r|). */
static void rmsnorm_case(int64_t N, int64_t D, int weighted, unsigned seed) {
    const double eps = 1e-6;
    oc_buf x = oc_rand(N * D, seed, 2.0f), w = oc_rand(D, seed + 1, 1.5f), dy = oc_rand(N * D, seed + 2, 1.0f);
    oc_buf dx = oc_rand(N * D, seed + 3, 0.5f), dw = oc_rand(D, seed + 4, 0.5f);
    oc_buf y = oc_zero(N * D), rs = oc_zero(N);
    const float *wf = weighted ? w.f : NULL;
    const double *wd = weighted ? w.d : NULL;
    double *want = oc_dalloc(N * D), *r = oc_dalloc(N), *tol = oc_dalloc(N * D), *tr = oc_dalloc(N);
    rmsnorm_fwd(CPU_EXEC, y.f, rs.f, x.f, wf, N, D, (float)eps);
    oracle_rmsnorm_fwd(want, r, x.d, wd, N, D, (double)(float)eps);
    for (int64_t n = 0; n < N; n++) {
        tr[n] = 2 * U_F32 * r[n];
        for (int64_t j = 0; j < D; j++) tol[n * D + j] = 4 * U_F32 * fabs(x.d[n * D + j] * r[n] * (wd ? wd[j] : 1));
    }
    oc_check(weighted ? "rmsnorm y" : "rmsnorm (weightless) y", y.f, want, tol, N * D);
    oc_check("rmsnorm rstd", rs.f, r, tr, N);

    double *wdx = oc_dalloc(N * D), *wdw = oc_dalloc(D), *tdx = oc_dalloc(N * D), *tdw = oc_dalloc(D);
    memcpy(wdx, dx.d, (size_t)(N * D) * sizeof(double));
    memcpy(wdw, dw.d, (size_t)D * sizeof(double));
    rmsnorm_bwd(CPU_EXEC, dx.f, wf ? dw.f : NULL, dy.f, x.f, wf, rs.f, N, D);
    oracle_rmsnorm_bwd(wdx, wd ? wdw : NULL, dy.d, x.d, wd, N, D, (double)(float)eps);
    for (int64_t j = 0; j < D; j++) tdw[j] = fabs(dw.d[j]);
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x.d + n * D, *g = dy.d + n * D;
        double agwx = 0;
        for (int64_t j = 0; j < D; j++) agwx += fabs(g[j] * (wd ? wd[j] : 1) * xr[j]);
        double c3 = r[n] * r[n] * r[n] / (double)D * agwx;
        for (int64_t j = 0; j < D; j++) {
            tdx[n * D + j] = 12 * U_F32 * (fabs(dx.d[n * D + j]) + fabs(r[n] * g[j] * (wd ? wd[j] : 1)) + c3 * fabs(xr[j]));
            tdw[j] += fabs(g[j] * xr[j] * r[n]);
        }
    }
    for (int64_t j = 0; j < D; j++) tdw[j] *= 6 * U_F32;
    oc_check("rmsnorm dx", dx.f, wdx, tdx, N * D);
    if (weighted) oc_check("rmsnorm dw", dw.f, wdw, tdw, D);

    norm_ctx c = {x.d, wd, dy.d, want, N, D, eps};
    double *gx = oc_dalloc(N * D), *gw = oc_dalloc(D);
    oracle_rmsnorm_bwd(gx, wd ? gw : NULL, dy.d, x.d, wd, N, D, eps);
    /* D = 1: y = w·x/sqrt(x² + eps) is flat (dx ~ eps/x²), FD rounding noise would dominate */
    if (D > 1) oc_fd_check("oracle rmsnorm dx", norm_obj, &c, x.d, N * D, gx);
    if (weighted) oc_fd_check("oracle rmsnorm dw", norm_obj, &c, w.d, D, gw);
    free(want), free(r), free(tol), free(tr), free(wdx), free(wdw), free(tdx), free(tdw), free(gx), free(gw);
    oc_free(&x), oc_free(&w), oc_free(&dy), oc_free(&dx), oc_free(&dw), oc_free(&y), oc_free(&rs);
}

static void test_rmsnorm(void) {
    rmsnorm_case(1, 1, 1, 21);
    rmsnorm_case(5, 37, 1, 22);
    rmsnorm_case(4, 200, 0, 23);
    rmsnorm_case(3, 130, 1, 24); /* crosses the production's 128-column dw blocks */
}

/* ---------------------------------------------------------------- RoPE */

typedef struct {
    const double *x0, *r, *theta;
    double *x;
    int64_t N, H, hd, rd, period, mult;
    bool inverse;
} rope_ctx;
static double rope_obj(void *p) {
    rope_ctx *c = p;
    int64_t n = c->N * c->H * c->hd;
    memcpy(c->x, c->x0, (size_t)n * sizeof(double));
    oracle_rope_fwd(c->x, c->N, c->H, c->hd, c->rd, c->period, c->mult, c->theta, c->inverse);
    return oc_dot(c->r, c->x, n);
}

/* Frequencies: both sides in double (pow, log, the YaRN ramp in another order): <= 1e-14 relative.
 * Rotation: the production table holds (float)cos and (float)sin (1 rounding each), then two products
 * and a sum (3 more): |err| <= 4U·(|x0| + |x1|) + |x|·(angle error ≤ pos·1e-14·θ), the latter < 1e-12.
 * Dims outside the rope slice are untouched: exact. The backward is the same rotation, reversed. */
static void rope_case(int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult, int64_t L0,
                      unsigned seed) {
    const double base = 10000.0, factor = 4.0, bf = 32.0, bs = 1.0;
    double *th_prod = oc_dalloc(rd / 2), *theta = oc_dalloc(rd / 2);
    rope_freqs(th_prod, rd, base, factor, L0, bf, bs);
    oracle_rope_freqs(theta, rd, base, factor, L0, bf, bs);
    double worst = 0;
    for (int64_t i = 0; i < rd / 2; i++) worst = fmax(worst, fabs(th_prod[i] - theta[i]) / theta[i]);
    CHECK(worst <= 1e-14, "rope_freqs rd=%lld L0=%lld: rel err %.3g vs the oracle's YaRN", (long long)rd,
          (long long)L0, worst);

    ds4_rope tab;
    CHECK(rope_table_init(&tab, rd, (period - 1) * mult + 1, base, factor, L0, bf, bs), "rope_table_init");
    int64_t n = N * H * hd;
    oc_buf x = oc_rand(n, seed, 2.0f), r = oc_rand(n, seed + 1, 1.0f);
    double *tol = oc_dalloc(n), *want = oc_dalloc(n);
    for (int64_t e = 0; e < n; e++) {
        int64_t dim = e % hd;
        if (dim < hd - rd) continue; /* tol 0: exact */
        int64_t pair = e - (dim - (hd - rd)) % 2;
        tol[e] = 4 * U_F32 * (fabs(x.d[pair]) + fabs(x.d[pair + 1])) + 1e-12;
    }
    for (int inverse = 0; inverse < 2; inverse++) {
        float *xf = oc_falloc(n);
        memcpy(xf, x.f, (size_t)n * sizeof(float));
        memcpy(want, x.d, (size_t)n * sizeof(double));
        rope_fwd(CPU_EXEC, xf, &(rope_args){.N = N, .H = H, .hd = hd, .period = period, .mult = mult, .table = &tab,
            .inverse = inverse});
        oracle_rope_fwd(want, N, H, hd, rd, period, mult, theta, inverse);
        oc_check(inverse ? "rope inverse" : "rope", xf, want, tol, n);
        memcpy(xf, x.f, (size_t)n * sizeof(float));
        memcpy(want, x.d, (size_t)n * sizeof(double));
        rope_bwd(CPU_EXEC, xf, &(rope_args){.N = N, .H = H, .hd = hd, .period = period, .mult = mult, .table = &tab,
            .inverse = inverse});
        oracle_rope_bwd(want, N, H, hd, rd, period, mult, theta, inverse);
        oc_check(inverse ? "rope_bwd inverse" : "rope_bwd", xf, want, tol, n);

        double *scratch = oc_dalloc(n), *g = oc_dalloc(n);
        memcpy(g, r.d, (size_t)n * sizeof(double));
        oracle_rope_bwd(g, N, H, hd, rd, period, mult, theta, inverse);
        rope_ctx c = {want, r.d, theta, scratch, N, H, hd, rd, period, mult, inverse};
        memcpy(want, x.d, (size_t)n * sizeof(double));
        oc_fd_check(inverse ? "oracle rope_bwd inverse" : "oracle rope_bwd", rope_obj, &c, want, n, g);
        free(scratch), free(g), free(xf);
    }
    rope_table_free(&tab);
    free(th_prod), free(theta), free(tol), free(want);
    oc_free(&x), oc_free(&r);
}

static void test_rope(void) {
    rope_case(5, 3, 12, 8, 5, 1, 16, 31); /* tokens, YaRN on */
    rope_case(6, 2, 8, 8, 3, 4, 0, 32);   /* compressed entries at positions i·4, the whole head rotated, no YaRN */
    rope_case(4, 1, 6, 2, 4, 1, 8, 33);   /* one pair */
    rope_case(3, 2, 70, 64, 3, 128, 65536, 34); /* Flash's rope dims, ratio-128 positions */
}

/* ---------------------------------------------------------------- SwiGLU */

typedef struct {
    const double *g, *u, *r;
    double *act;
    int64_t n;
    double limit;
} swi_ctx;
static double swi_obj(void *p) {
    swi_ctx *c = p;
    oracle_swiglu_fwd(c->act, c->g, c->u, c->n, c->limit);
    return oc_dot(c->r, c->act, c->n);
}

/* σ(x) = 1/(1 + expf(−x)): 2U + 1 + 1 = 4U relative. act = (gc·σ)·uc: 6U, use 8U·|act|.
 * dg = init + dact·uc·(σ·(1 + gc·(1 − σ))): 1 − σ carries σ's absolute 4U·σ + U, times |gc|, plus the
 * products and the final add: |err| <= 12U·(|init| + |dact·uc|·(1 + |gc|)).
 * du = init + dact·(gc·σ): |err| <= 8U·(|init| + |dact·gc|). Clamped inputs: no gradient, exact. */
static void swiglu_case(int64_t n, double limit, unsigned seed) {
    oc_buf g = oc_rand(n, seed, 15.0f), u = oc_rand(n, seed + 1, 15.0f), dact = oc_rand(n, seed + 2, 1.0f);
    oc_buf dg = oc_rand(n, seed + 3, 0.5f), du = oc_rand(n, seed + 4, 0.5f), act = oc_zero(n);
    double *want = oc_dalloc(n), *tol = oc_dalloc(n), *wdg = oc_dalloc(n), *wdu = oc_dalloc(n);
    double *tdg = oc_dalloc(n), *tdu = oc_dalloc(n);
    swiglu_fwd(CPU_EXEC, act.f, g.f, u.f, 1, n, (float)limit);
    oracle_swiglu_fwd(want, g.d, u.d, n, limit);
    int clamped = 0;
    for (int64_t i = 0; i < n; i++) {
        tol[i] = 8 * U_F32 * fabs(want[i]);
        bool gc_ = limit > 0 && g.d[i] > limit, uc_ = limit > 0 && fabs(u.d[i]) > limit;
        double gc = gc_ ? limit : g.d[i], uc = uc_ ? copysign(limit, u.d[i]) : u.d[i];
        clamped += gc_ || uc_;
        tdg[i] = gc_ ? 0 : 12 * U_F32 * (fabs(dg.d[i]) + fabs(dact.d[i] * uc) * (1 + fabs(gc)));
        tdu[i] = uc_ ? 0 : 8 * U_F32 * (fabs(du.d[i]) + fabs(dact.d[i] * gc));
    }
    CHECK(limit <= 0 || clamped > 0, "swiglu: no clamped element, the clamp is not tested");
    oc_check("swiglu act", act.f, want, tol, n);
    memcpy(wdg, dg.d, (size_t)n * sizeof(double));
    memcpy(wdu, du.d, (size_t)n * sizeof(double));
    swiglu_bwd(CPU_EXEC, dg.f, du.f, dact.f, g.f, u.f, 1, n, (float)limit);
    oracle_swiglu_bwd(wdg, wdu, dact.d, g.d, u.d, n, limit);
    oc_check("swiglu dg", dg.f, wdg, tdg, n);
    oc_check("swiglu du", du.f, wdu, tdu, n);

    double *gg = oc_dalloc(n), *gu = oc_dalloc(n);
    oracle_swiglu_bwd(gg, gu, dact.d, g.d, u.d, n, limit);
    swi_ctx c = {g.d, u.d, dact.d, want, n, limit};
    oc_fd_check("oracle swiglu dg", swi_obj, &c, g.d, n, gg);
    oc_fd_check("oracle swiglu du", swi_obj, &c, u.d, n, gu);
    free(want), free(tol), free(wdg), free(wdu), free(tdg), free(tdu), free(gg), free(gu);
    oc_free(&g), oc_free(&u), oc_free(&dact), oc_free(&dg), oc_free(&du), oc_free(&act);
}

static void test_swiglu(void) {
    swiglu_case(257, 10.0, 41); /* inputs in ±15: both clamps hit */
    swiglu_case(64, 0.0, 42);   /* no clamp */
}

/* ---------------------------------------------------------------- compressor pooling */

typedef struct {
    const double *a, *z, *ape, *r;
    double *out;
    int64_t B, T, rr, d;
    bool overlap;
} pool_ctx;
static double pool_obj(void *p) {
    pool_ctx *c = p;
    oracle_compressor_pool_fwd(c->out, c->a, c->z, c->ape, c->B, c->T, c->rr, c->d, c->overlap);
    return oc_dot(c->r, c->out, c->B * (c->T / c->rr) * c->d);
}

/* Per channel, over ns slots (2r with overlap, else r): v = z + ape (1 rounding), v − max (1),
 * expf (2): each weight's exponential is off by ε = U·(3·max|v| + 2) relatively; Σe and Σe·a add
 * γ_ns; the division one more. With Σw = 1:
 *   out: |err| <= (2ε + (2ns+3)U)·max|a| =: E_out
 *   da = init + w·g: |err| <= (2ε + (ns+4)U)·max|g| + U|init|
 *   dz = init + w·g·(a − out): |err| <= max|g|·(E_out + (2ε + (ns+5)U)·2max|a|) + U|init|
 *   dape: the dz terms of Ne = B·Nc entries summed: Ne·(that) with γ_Ne added. */
static void pool_case(int64_t B, int64_t T, int64_t r, int64_t d, bool overlap, unsigned seed) {
    int64_t C = overlap ? 2 * d : d, Nc = T / r, ns = overlap ? 2 * r : r, Ne = B * Nc;
    oc_buf a = oc_rand(B * T * C, seed, 1.0f), z = oc_rand(B * T * C, seed + 1, 2.0f), ape = oc_rand(r * C, seed + 2, 1.0f);
    oc_buf dout = oc_rand(Ne * d, seed + 3, 1.0f), da = oc_rand(B * T * C, seed + 4, 0.5f);
    oc_buf dz = oc_rand(B * T * C, seed + 5, 0.5f), dape = oc_rand(r * C, seed + 6, 0.5f);
    oc_buf out = oc_rand(Ne * d, seed + 7, 1.0f);
    double *want = oc_dalloc(Ne * d);
    char what[96];
    snprintf(what, sizeof what, "compressor_pool B=%lld T=%lld r=%lld d=%lld overlap=%d", (long long)B, (long long)T,
             (long long)r, (long long)d, overlap);
    double vmax = 3.0, amax = oc_absmax_d(a.d, a.n), gmax = oc_absmax_d(dout.d, dout.n);
    double eps_e = U_F32 * (3 * vmax + 2);
    double e_out = (2 * eps_e + (2 * ns + 3) * U_F32) * amax;
    double e_dz = gmax * (e_out + (2 * eps_e + (ns + 5) * U_F32) * 2 * amax);
    compressor_pool_fwd(CPU_EXEC, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = overlap}, .a = a.f,
        .z = z.f, .ape = ape.f, .out = out.f});
    oracle_compressor_pool_fwd(want, a.d, z.d, ape.d, B, T, r, d, overlap);
    oc_check_all(what, out.f, want, e_out, Ne * d);

    double *wda = oc_dalloc(da.n), *wdz = oc_dalloc(dz.n), *wdape = oc_dalloc(dape.n);
    double *tda = oc_dalloc(da.n), *tdz = oc_dalloc(dz.n), *tdape = oc_dalloc(dape.n);
    memcpy(wda, da.d, (size_t)da.n * sizeof(double));
    memcpy(wdz, dz.d, (size_t)dz.n * sizeof(double));
    memcpy(wdape, dape.d, (size_t)dape.n * sizeof(double));
    for (int64_t i = 0; i < da.n; i++) {
        tda[i] = (2 * eps_e + (ns + 4) * U_F32) * gmax + U_F32 * fabs(da.d[i]);
        tdz[i] = e_dz + U_F32 * fabs(dz.d[i]);
    }
    for (int64_t i = 0; i < dape.n; i++) tdape[i] = Ne * (e_dz + (Ne + 1) * U_F32 * gmax * 2 * amax) + U_F32 * fabs(dape.d[i]);
    compressor_pool_bwd(CPU_EXEC, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = overlap}, .a = a.f,
        .z = z.f, .ape = ape.f}, &(compressor_pool_grads){.dout = dout.f, .da = da.f, .dz = dz.f, .dape = dape.f});
    oracle_compressor_pool_bwd(wda, wdz, wdape, dout.d, a.d, z.d, ape.d, B, T, r, d, overlap);
    oc_check("compressor_pool da", da.f, wda, tda, da.n);
    oc_check("compressor_pool dz", dz.f, wdz, tdz, dz.n);
    oc_check("compressor_pool dape", dape.f, wdape, tdape, dape.n);

    if (Ne > 0) {
        double *ga = oc_dalloc(da.n), *gz = oc_dalloc(dz.n), *gp = oc_dalloc(dape.n);
        oracle_compressor_pool_bwd(ga, gz, gp, dout.d, a.d, z.d, ape.d, B, T, r, d, overlap);
        pool_ctx c = {a.d, z.d, ape.d, dout.d, want, B, T, r, d, overlap};
        oc_fd_check("oracle compressor_pool da", pool_obj, &c, a.d, a.n, ga);
        oc_fd_check("oracle compressor_pool dz", pool_obj, &c, z.d, z.n, gz);
        oc_fd_check("oracle compressor_pool dape", pool_obj, &c, ape.d, ape.n, gp);
        free(ga), free(gz), free(gp);
    }
    free(want), free(wda), free(wdz), free(wdape), free(tda), free(tdz), free(tdape);
    oc_free(&a), oc_free(&z), oc_free(&ape), oc_free(&dout), oc_free(&da), oc_free(&dz), oc_free(&dape), oc_free(&out);
}

static void test_compressor_pool(void) {
    pool_case(2, 13, 4, 5, true, 51);     /* CSA: overlap, T not a multiple of 4 */
    pool_case(1, 8, 4, 20, true, 52);     /* more channels than one production block (16) */
    pool_case(2, 9, 4, 3, false, 53);     /* ratio 4 without overlap */
    pool_case(1, 300, 128, 3, false, 54); /* HCA-like ratio 128, tail of 44 tokens dropped */
    pool_case(1, 3, 4, 4, true, 55);      /* T < ratio: no entry, nothing written, nothing read */
}

/* ---------------------------------------------------------------- MoE gate */

typedef struct {
    const double *logits, *bias, *r;
    const int64_t *tid2eid;
    const int32_t *ids;
    int32_t *idx;
    double *w, *s;
    int64_t N, E, K;
    double rs;
} gate_ctx;
static double gate_obj(void *p) {
    gate_ctx *c = p;
    oracle_moe_gate_fwd(c->idx, c->w, c->s, c->logits, c->bias, c->tid2eid, c->ids, c->N, c->E, c->K, c->rs);
    return oc_dot(c->r, c->w, c->N * c->K);
}

/* Position of expert e in row idx[0..K), or −1. */
static int64_t find_k(const int32_t *idx, int64_t K, int64_t e) {
    for (int64_t k = 0; k < K; k++)
        if (idx[k] == e) return k;
    return -1;
}

/* Scores s = sqrtf(softplus) with expf, log1pf (2U each) and sqrtf (U): <= 5U·s. Selection values
 * s + bias: one more rounding, δ_e = 5U·s_e + U·|s_e + b_e|. The selection is compared as a set:
 * where the oracle's K-th and (K+1)-th values are more than 2·max δ apart the sets must be equal;
 * closer (a near tie that float rounding may flip) the production's set must be admissible: no
 * unselected value above a selected one by more than their δs. Exact ties (equal logits) are
 * exact in both and must go to the lower id.
 * weights: S = Σ of K scores (γ_K), s/S and ·R (2 more), s's 5U twice: <= (K+13)U·|w|.
 * dlogits = init + (R/S)·(dw − Σ dw·s/S)·σ/(2s): S, the dot, σ (4U) and s (5U), the products:
 *   |err| <= (2K+24)U·(R/S)·(|dw_k| + Σ|dw|)·|σ/(2s)| + U·|init|. */
static void gate_case(int64_t N, int64_t E, int64_t K, int hash, int with_bias, int ties, unsigned seed) {
    const double R = 1.5;
    oc_buf logits = oc_rand(N * E, seed, 4.0f), bias = oc_rand(E, seed + 1, 0.3f), dwt = oc_rand(N * K, seed + 2, 1.0f);
    oc_buf dl = oc_rand(N * E, seed + 3, 0.5f);
    if (ties) /* rows of pairwise equal logits: every selection value ties with another */
        for (int64_t i = 0; i < N * E; i++) logits.f[i] = logits.f[(i / E) * E + (i % E) / 2 * 2];
    logits.f[0] = 25.0f; /* above the softplus threshold */
    oc_sync(&logits);
    const float *bf = with_bias ? bias.f : NULL;
    const double *bd = with_bias ? bias.d : NULL;
    int64_t V = 7, *t2e = malloc((size_t)(V * K) * sizeof(int64_t));
    int32_t *ids = malloc((size_t)N * sizeof(int32_t));
    for (int64_t v = 0; v < V; v++)
        for (int64_t k = 0; k < K; k++) t2e[v * K + k] = (v * 3 + k * 5) % E; /* distinct within a row for these (E, K) */
    for (int64_t n = 0; n < N; n++) ids[n] = (int32_t)((n * 5 + 2) % V);
    const int64_t *tab = hash ? t2e : NULL;

    int32_t *idx = malloc((size_t)(N * K) * sizeof(int32_t)), *widx = malloc((size_t)(N * K) * sizeof(int32_t));
    oc_buf wts = oc_zero(N * K), sc = oc_zero(N * E);
    double *ww = oc_dalloc(N * K), *ws = oc_dalloc(N * E);
    moe_gate_fwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)R, .logits = logits.f,
        .bias = bf, .tid2eid = tab, .ids = ids, .idx = idx, .weights = wts.f, .scores = sc.f});
    oracle_moe_gate_fwd(widx, ww, ws, logits.d, bd, tab, ids, N, E, K, R);
    double *ts = oc_dalloc(N * E);
    for (int64_t i = 0; i < N * E; i++) ts[i] = 5 * U_F32 * ws[i];
    oc_check("moe_gate scores", sc.f, ws, ts, N * E);

    int64_t near_ties = 0;
    for (int64_t n = 0; n < N; n++) {
        const int32_t *pi = idx + n * K, *oi = widx + n * K;
        bool same = true;
        for (int64_t k = 0; k < K; k++) same &= find_k(pi, K, oi[k]) >= 0;
        if (!hash && !ties && !same) { /* admissible only across a near tie */
            double dmax = 0, worst = -INFINITY;
            for (int64_t e = 0; e < E; e++) {
                double v = ws[n * E + e] + (bd ? bd[e] : 0);
                dmax = fmax(dmax, 5 * U_F32 * ws[n * E + e] + U_F32 * fabs(v));
            }
            for (int64_t k = 0; k < K; k++)
                for (int64_t e = 0; e < E; e++)
                    if (find_k(pi, K, e) < 0)
                        worst = fmax(worst, ws[n * E + e] + (bd ? bd[e] : 0) - ws[n * E + pi[k]] - (bd ? bd[pi[k]] : 0));
            near_ties++;
            CHECK(worst <= 2 * dmax, "moe_gate row %lld: an unselected expert beats a selected one by %.3g > %.3g",
                  (long long)n, worst, 2 * dmax);
            continue;
        }
        CHECK(same, "moe_gate row %lld (%s): selection differs from the oracle's", (long long)n, hash ? "hash" : "ties");
        double S = 0;
        for (int64_t k = 0; k < K; k++) S += ws[n * E + oi[k]];
        for (int64_t k = 0; k < K; k++) { /* weights, matched by expert id */
            int64_t kp = find_k(pi, K, oi[k]);
            if (kp < 0) continue;
            double want = ww[n * K + k], got = wts.f[n * K + kp];
            CHECK(fabs(got - want) <= (K + 13) * U_F32 * fabs(want), "moe_gate row %lld weight of expert %d: %.9g vs %.9g",
                  (long long)n, oi[k], got, want);
        }
    }
    CHECK(near_ties == 0 || ties, "moe_gate: %lld rows with a near tie in random data", (long long)near_ties);

    /* backward on the production's own selection (a constant of both) */
    double *wdl = oc_dalloc(N * E), *tdl = oc_dalloc(N * E);
    memcpy(wdl, dl.d, (size_t)(N * E) * sizeof(double));
    for (int64_t i = 0; i < N * E; i++) tdl[i] = U_F32 * fabs(dl.d[i]);
    for (int64_t n = 0; n < N; n++) {
        double S = 0, adw = 0;
        for (int64_t k = 0; k < K; k++) S += ws[n * E + idx[n * K + k]], adw += fabs(dwt.d[n * K + k]);
        for (int64_t k = 0; k < K; k++) {
            int64_t e = idx[n * K + k];
            double l = logits.d[n * E + e], s = ws[n * E + e];
            double dsdl = (l > 20 ? 1.0 : 1.0 / (1.0 + exp(-l))) / (2 * s);
            tdl[n * E + e] += (2 * K + 24) * U_F32 * R / S * (fabs(dwt.d[n * K + k]) + adw) * dsdl;
        }
    }
    moe_gate_bwd(CPU_EXEC, &(moe_gate_args){.dims = {.N = N, .E = E, .K = K}, .route_scale = (float)R, .logits = logits.f,
        .scores = sc.f, .idx = idx}, &(moe_gate_grads){.dweights = dwt.f, .dlogits = dl.f});
    oracle_moe_gate_bwd(wdl, dwt.d, logits.d, idx, N, E, K, R);
    oc_check("moe_gate dlogits", dl.f, wdl, tdl, N * E);

    if (!ties) { /* FD: random gaps keep the selection fixed under ±FD_H */
        double *g = oc_dalloc(N * E);
        oracle_moe_gate_bwd(g, dwt.d, logits.d, widx, N, E, K, R);
        gate_ctx c = {logits.d, bd, dwt.d, tab, ids, malloc((size_t)(N * K) * sizeof(int32_t)), ww, ws, N, E, K, R};
        oc_fd_check("oracle moe_gate dlogits", gate_obj, &c, logits.d, N * E, g);
        free(c.idx), free(g);
    }
    free(t2e), free(ids), free(idx), free(widx), free(ww), free(ws), free(ts), free(wdl), free(tdl);
    oc_free(&logits), oc_free(&bias), oc_free(&dwt), oc_free(&dl), oc_free(&wts), oc_free(&sc);
}

static void test_moe_gate(void) {
    gate_case(9, 8, 2, 0, 1, 0, 61);   /* bias steers selection */
    gate_case(7, 16, 6, 0, 0, 0, 62);  /* no bias, Flash's K = 6 */
    gate_case(6, 8, 3, 1, 0, 0, 63);   /* hash routing */
    gate_case(8, 8, 3, 0, 0, 1, 64);   /* exact ties: to the lower id */
    gate_case(8, 10, 3, 0, 1, 1, 65);  /* ties with a bias */
}

/* ---------------------------------------------------------------- cross-entropy */

typedef struct {
    const double *l;
    const int32_t *t;
    int64_t N, V;
} ce_ctx;
static double ce_obj(void *p) {
    ce_ctx *c = p;
    double loss;
    int64_t n;
    oracle_cross_entropy(&loss, &n, NULL, c->l, c->t, c->N, c->V, 1.0);
    return loss;
}

/* Per row: e_v = expf(l_v − m) (the subtraction and expf: U·|l − m| + 2U relative), summed and logged
 * in double: loss_row is off by <= U·(max|l − m| + 3); summed over rows in double.
 * dlogits = gs·(e_v·(float)(1/Σe)) − gs·[v = t]: the e's error, the reciprocal, two products and the
 * subtraction: |err| <= U·|gs|·((max|l − m| + 6)·p_v + 2·[v = t]). Unscored rows: exactly 0. */
static void test_cross_entropy(void) {
    const int64_t N = 7, V = 37;
    const float gs = 0.25f;
    oc_buf l = oc_rand(N * V, 71, 8.0f), dl = oc_rand(N * V, 72, 1.0f);
    l.f[2 * V + 5] = 30.0f, l.f[2 * V + 6] = -30.0f; /* a wide row */
    oc_sync(&l);
    int32_t t[7] = {3, -1, 5, 36, 37, 0, 6}; /* −1 and V: not scored */
    double loss, wloss, *wdl = oc_dalloc(N * V), *tol = oc_dalloc(N * V);
    int64_t ns, wns;
    cross_entropy_fwd_bwd(CPU_EXEC, &loss, &ns, dl.f, l.f, t, N, V, gs);
    oracle_cross_entropy(&wloss, &wns, wdl, l.d, t, N, V, gs);
    CHECK(ns == wns && ns == 5, "cross_entropy scored %lld rows, oracle %lld (5 expected)", (long long)ns, (long long)wns);
    double tl = 0;
    for (int64_t n = 0; n < N; n++) {
        double m = -INFINITY, lo = INFINITY;
        for (int64_t v = 0; v < V; v++) m = fmax(m, l.d[n * V + v]), lo = fmin(lo, l.d[n * V + v]);
        bool scored = t[n] >= 0 && t[n] < V;
        if (scored) tl += U_F32 * (m - lo + 3);
        for (int64_t v = 0; v < V; v++)
            tol[n * V + v] = scored ? U_F32 * gs * ((m - lo + 6) * fabs(wdl[n * V + v] / gs + (v == t[n])) + 2.0 * (v == t[n])) : 0;
    }
    CHECK(fabs(loss - wloss) <= tl, "cross_entropy loss %.12g vs oracle %.12g (bound %.3g)", loss, wloss, tl);
    oc_check("cross_entropy dlogits", dl.f, wdl, tol, N * V);

    double *g = oc_dalloc(N * V), dummy;
    oracle_cross_entropy(&dummy, &wns, g, l.d, t, N, V, 1.0);
    ce_ctx c = {l.d, t, N, V};
    oc_fd_check("oracle cross_entropy", ce_obj, &c, l.d, N * V, g);
    free(wdl), free(tol), free(g);
    oc_free(&l), oc_free(&dl);
}

int main(void) {
    RUN(test_linear);
    RUN(test_grouped_linear);
    RUN(test_embedding);
    RUN(test_rmsnorm);
    RUN(test_rope);
    RUN(test_swiglu);
    RUN(test_compressor_pool);
    RUN(test_moe_gate);
    RUN(test_cross_entropy);
    TEST_MAIN_END("test_oracle_basic");
}
