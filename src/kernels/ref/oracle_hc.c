/* Scalar oracles of manifold-constrained hyper-connections (mHC, docs/dsv4-architecture.md §3):
 * the Sinkhorn split, hc_pre, hc_post and hc_head, forward and backward (see oracle.h). */
#include "kernels/ref/oracle.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

/* ---------------------------------------------------------------- Sinkhorn split */

/* Normalisations after the softmax: one column step, then (iters − 1) × (row, column). */
static int64_t sinkhorn_steps(int64_t iters) { return 1 + 2 * (iters > 1 ? iters - 1 : 0); }
static bool step_is_row(int64_t s) { return s % 2 == 1; }

/* sm[j][k] = softmax over k of mixes[2n + n·j + k]·scale2 + base[2n + n·j + k]. sm: [n, n]. */
static void comb_softmax(double *sm, const double *mixes, const double *scale, const double *base, int64_t n) {
    for (int64_t j = 0; j < n; j++) {
        double m = -INFINITY, z = 0;
        for (int64_t k = 0; k < n; k++) m = fmax(m, mixes[2 * n + n * j + k] * scale[2] + base[2 * n + n * j + k]);
        for (int64_t k = 0; k < n; k++) z += exp(mixes[2 * n + n * j + k] * scale[2] + base[2 * n + n * j + k] - m);
        for (int64_t k = 0; k < n; k++)
            sm[j * n + k] = exp(mixes[2 * n + n * j + k] * scale[2] + base[2 * n + n * j + k] - m) / z;
    }
}

/* Sum of line `a` of x along the step's axis: row a (Σ_k x[a][k]) or column a (Σ_j x[j][a]). */
static double line_sum(const double *x, int64_t n, bool row, int64_t a) {
    double s = 0;
    for (int64_t b = 0; b < n; b++) s += row ? x[a * n + b] : x[b * n + a];
    return s;
}

/* y = x / (line sum + eps), the line of each element being its row or its column. */
static void normalise(double *y, const double *x, int64_t n, bool row, double eps) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t k = 0; k < n; k++) y[j * n + k] = x[j * n + k] / (line_sum(x, n, row, row ? j : k) + eps);
}

/* xs: [(steps + 1), n, n]: xs[0] = softmax + eps, xs[s + 1] = step s applied to xs[s]. */
static void sinkhorn_trace(double *xs, const double *mixes, const double *scale, const double *base, int64_t n,
                           int64_t steps, double eps) {
    comb_softmax(xs, mixes, scale, base, n);
    for (int64_t e = 0; e < n * n; e++) xs[e] += eps;
    for (int64_t s = 0; s < steps; s++) normalise(xs + (s + 1) * n * n, xs + s * n * n, n, step_is_row(s), eps);
}

void oracle_hc_sinkhorn_fwd(double *pre, double *post, double *comb, const double *mixes, const double *scale,
                            const double *base, int64_t n, int64_t iters, double eps) {
    for (int64_t j = 0; j < n; j++) {
        pre[j] = sigmoid(mixes[j] * scale[0] + base[j]) + eps;
        post[j] = 2.0 * sigmoid(mixes[n + j] * scale[1] + base[n + j]);
    }
    int64_t steps = sinkhorn_steps(iters);
    double *xs = malloc((size_t)((steps + 1) * n * n) * sizeof(double));
    sinkhorn_trace(xs, mixes, scale, base, n, steps, eps);
    memcpy(comb, xs + steps * n * n, (size_t)(n * n) * sizeof(double));
    free(xs);
}

/* pre_j = σ(a_j) + eps, a_j = mixes_j·scale0 + base_j: ∂pre_j/∂a_j = σ(1 − σ); post likewise with 2σ(1 − σ).
 * A normalisation y_e = x_e / (S + eps), S = the sum of e's line: for e, f on one line,
 * ∂y_e/∂x_f = δ_ef/(S + eps) − x_e/(S + eps)²  ⇒  dx_f = g_f/(S + eps) − Σ_{e in line} g_e·x_e/(S + eps)².
 * Softmax c = softmax(L) over a row: dL_k = c_k·(g_k − Σ_k' g_k'·c_k'); L = mixes·scale2 + base. */
void oracle_hc_sinkhorn_bwd(double *dmixes, double *dscale, double *dbase, const double *dpre, const double *dpost,
                            const double *dcomb, const double *mixes, const double *scale, const double *base,
                            int64_t n, int64_t iters, double eps) {
    for (int64_t j = 0; j < n; j++) {
        double sp = sigmoid(mixes[j] * scale[0] + base[j]), sq = sigmoid(mixes[n + j] * scale[1] + base[n + j]);
        double da_pre = dpre ? dpre[j] * sp * (1.0 - sp) : 0.0;
        double da_post = dpost ? dpost[j] * 2.0 * sq * (1.0 - sq) : 0.0;
        if (dmixes) dmixes[j] += da_pre * scale[0], dmixes[n + j] += da_post * scale[1];
        if (dscale) dscale[0] += da_pre * mixes[j], dscale[1] += da_post * mixes[n + j];
        if (dbase) dbase[j] += da_pre, dbase[n + j] += da_post;
    }
    if (!dcomb) return;
    int64_t nn = n * n, steps = sinkhorn_steps(iters);
    double *xs = malloc((size_t)((steps + 1) * nn) * sizeof(double));
    double *g = malloc((size_t)nn * sizeof(double)), *gx = malloc((size_t)nn * sizeof(double));
    sinkhorn_trace(xs, mixes, scale, base, n, steps, eps);
    memcpy(g, dcomb, (size_t)nn * sizeof(double));
    for (int64_t s = steps - 1; s >= 0; s--) {
        const double *x = xs + s * nn;
        bool row = step_is_row(s);
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = 0; k < n; k++) {
                int64_t a = row ? j : k;
                double S = line_sum(x, n, row, a) + eps, gxe = 0;
                for (int64_t b = 0; b < n; b++) {
                    int64_t e = row ? a * n + b : b * n + a;
                    gxe += g[e] * x[e];
                }
                gx[j * n + k] = g[j * n + k] / S - gxe / (S * S);
            }
        memcpy(g, gx, (size_t)nn * sizeof(double));
    }
    /* the + eps after the softmax has Jacobian 1; xs[0] − eps is the softmax */
    for (int64_t j = 0; j < n; j++) {
        double gc = 0;
        for (int64_t k = 0; k < n; k++) gc += g[j * n + k] * (xs[j * n + k] - eps);
        for (int64_t k = 0; k < n; k++) {
            int64_t e = 2 * n + j * n + k;
            double dL = (xs[j * n + k] - eps) * (g[j * n + k] - gc);
            if (dmixes) dmixes[e] += dL * scale[2];
            if (dscale) dscale[2] += dL * mixes[e];
            if (dbase) dbase[e] += dL;
        }
    }
    free(xs), free(g), free(gx);
}

/* ---------------------------------------------------------------- shared: mixes of one token */

/* x: [nD]; mixes: [M] = r·(fn·x), fn: [M, nD]; returns r = (Σ x²/nD + eps)^(-1/2). */
static double token_mixes(double *mixes, const double *x, const double *fn, int64_t M, int64_t nD, double eps) {
    double ss = 0;
    for (int64_t c = 0; c < nD; c++) ss += x[c] * x[c];
    double r = 1.0 / sqrt(ss / (double)nD + eps);
    for (int64_t i = 0; i < M; i++) {
        double s = 0;
        for (int64_t c = 0; c < nD; c++) s += fn[i * nD + c] * x[c];
        mixes[i] = r * s;
    }
    return r;
}

/* Backward of mixes_i = r·Σ_c fn[i, c]·x_c with ∂r/∂x_c = −r³·x_c/nD, given gm = ∂L/∂mixes:
 * dfn[i, c] += gm_i·r·x_c;  dx_c += Σ_i gm_i·(r·fn[i, c] − (fn_i·x)·r³·x_c/nD). */
static void token_mixes_bwd(double *dx, double *dfn, const double *gm, const double *x, const double *fn, int64_t M,
                            int64_t nD, double eps) {
    double ss = 0;
    for (int64_t c = 0; c < nD; c++) ss += x[c] * x[c];
    double r = 1.0 / sqrt(ss / (double)nD + eps);
    for (int64_t i = 0; i < M; i++) {
        double fx = 0;
        for (int64_t c = 0; c < nD; c++) fx += fn[i * nD + c] * x[c];
        for (int64_t c = 0; c < nD; c++) {
            if (dfn) dfn[i * nD + c] += gm[i] * r * x[c];
            if (dx) dx[c] += gm[i] * (r * fn[i * nD + c] - fx * r * r * r * x[c] / (double)nD);
        }
    }
}

/* ---------------------------------------------------------------- hc_pre */

void oracle_hc_pre_fwd(double *y, double *post, double *comb, double *mixes, double *rsqrt, const double *X,
                       const double *fn, const double *scale, const double *base, int64_t N, int64_t n, int64_t D,
                       int64_t iters, double hc_eps, double norm_eps) {
    int64_t M = (2 + n) * n, nD = n * D;
    double *mx = malloc((size_t)M * sizeof(double)), *pre = malloc((size_t)n * sizeof(double));
    for (int64_t t = 0; t < N; t++) {
        const double *x = X + t * nD;
        double r = token_mixes(mx, x, fn, M, nD, norm_eps);
        if (rsqrt) rsqrt[t] = r;
        if (mixes) memcpy(mixes + t * M, mx, (size_t)M * sizeof(double));
        oracle_hc_sinkhorn_fwd(pre, post + t * n, comb + t * n * n, mx, scale, base, n, iters, hc_eps);
        for (int64_t d = 0; d < D; d++) {
            double s = 0;
            for (int64_t j = 0; j < n; j++) s += pre[j] * x[j * D + d];
            y[t * D + d] = s;
        }
    }
    free(mx), free(pre);
}

/* y = Σ_j pre_j·X_j:  dX_j += pre_j·dy,  dpre_j = ⟨dy, X_j⟩; then the Sinkhorn split backward gives
 * gm = ∂L/∂mixes (and dscale, dbase), and the mixes backward adds its part to dX and dfn. */
void oracle_hc_pre_bwd(double *dX, double *dfn, double *dscale, double *dbase, const double *dy,
                       const double *dpost, const double *dcomb, const double *X, const double *fn,
                       const double *scale, const double *base, int64_t N, int64_t n, int64_t D, int64_t iters,
                       double hc_eps, double norm_eps) {
    int64_t M = (2 + n) * n, nD = n * D;
    double *mx = malloc((size_t)M * sizeof(double)), *gm = malloc((size_t)M * sizeof(double));
    double *pre = malloc((size_t)n * sizeof(double)), *post = malloc((size_t)n * sizeof(double));
    double *comb = malloc((size_t)(n * n) * sizeof(double)), *dpre = malloc((size_t)n * sizeof(double));
    for (int64_t t = 0; t < N; t++) {
        const double *x = X + t * nD;
        token_mixes(mx, x, fn, M, nD, norm_eps);
        oracle_hc_sinkhorn_fwd(pre, post, comb, mx, scale, base, n, iters, hc_eps);
        for (int64_t j = 0; j < n; j++) {
            dpre[j] = 0;
            for (int64_t d = 0; dy && d < D; d++) {
                dpre[j] += dy[t * D + d] * x[j * D + d];
                if (dX) dX[t * nD + j * D + d] += pre[j] * dy[t * D + d];
            }
        }
        memset(gm, 0, (size_t)M * sizeof(double));
        oracle_hc_sinkhorn_bwd(gm, dscale, dbase, dy ? dpre : NULL, dpost ? dpost + t * n : NULL,
                               dcomb ? dcomb + t * n * n : NULL, mx, scale, base, n, iters, hc_eps);
        token_mixes_bwd(dX ? dX + t * nD : NULL, dfn, gm, x, fn, M, nD, norm_eps);
    }
    free(mx), free(gm), free(pre), free(post), free(comb), free(dpre);
}

/* ---------------------------------------------------------------- hc_post */

void oracle_hc_post_fwd(double *Y, const double *x, const double *res, const double *post, const double *comb,
                        int64_t N, int64_t n, int64_t D) {
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < n; k++)
            for (int64_t d = 0; d < D; d++) {
                double s = post[t * n + k] * x[t * D + d];
                for (int64_t j = 0; j < n; j++) s += comb[(t * n + j) * n + k] * res[(t * n + j) * D + d];
                Y[(t * n + k) * D + d] = s;
            }
}

/* dx = Σ_k post_k·g_k;  dres_j += Σ_k comb[j][k]·g_k;  dpost_k += ⟨g_k, x⟩;  dcomb[j][k] += ⟨g_k, res_j⟩. */
void oracle_hc_post_bwd(double *dx, double *dres, double *dpost, double *dcomb, const double *dY, const double *x,
                        const double *res, const double *post, const double *comb, int64_t N, int64_t n,
                        int64_t D) {
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < n; k++) {
            const double *g = dY + (t * n + k) * D;
            for (int64_t d = 0; d < D; d++) {
                if (dx) dx[t * D + d] += post[t * n + k] * g[d];
                if (dpost) dpost[t * n + k] += g[d] * x[t * D + d];
                for (int64_t j = 0; j < n; j++) {
                    if (dres) dres[(t * n + j) * D + d] += comb[(t * n + j) * n + k] * g[d];
                    if (dcomb) dcomb[(t * n + j) * n + k] += g[d] * res[(t * n + j) * D + d];
                }
            }
        }
}

/* ---------------------------------------------------------------- hc_head */

void oracle_hc_head_fwd(double *y, const double *X, const double *fn, const double *scale, const double *base,
                        int64_t N, int64_t n, int64_t D, double hc_eps, double norm_eps) {
    int64_t nD = n * D;
    double *mx = malloc((size_t)n * sizeof(double));
    for (int64_t t = 0; t < N; t++) {
        const double *x = X + t * nD;
        token_mixes(mx, x, fn, n, nD, norm_eps);
        for (int64_t d = 0; d < D; d++) {
            double s = 0;
            for (int64_t j = 0; j < n; j++) s += (sigmoid(mx[j] * scale[0] + base[j]) + hc_eps) * x[j * D + d];
            y[t * D + d] = s;
        }
    }
    free(mx);
}

/* pre_j = σ(a_j) + eps, a_j = mixes_j·scale + base_j:  da_j = ⟨dy, X_j⟩·σ(1 − σ);
 * dmixes_j = da_j·scale, dscale += Σ_j da_j·mixes_j, dbase_j += da_j; X also gets pre_j·dy. */
void oracle_hc_head_bwd(double *dX, double *dfn, double *dscale, double *dbase, const double *dy, const double *X,
                        const double *fn, const double *scale, const double *base, int64_t N, int64_t n, int64_t D,
                        double hc_eps, double norm_eps) {
    int64_t nD = n * D;
    double *mx = malloc((size_t)n * sizeof(double)), *gm = malloc((size_t)n * sizeof(double));
    for (int64_t t = 0; t < N; t++) {
        const double *x = X + t * nD;
        token_mixes(mx, x, fn, n, nD, norm_eps);
        for (int64_t j = 0; j < n; j++) {
            double sg = sigmoid(mx[j] * scale[0] + base[j]), dpre = 0;
            for (int64_t d = 0; d < D; d++) {
                dpre += dy[t * D + d] * x[j * D + d];
                if (dX) dX[t * nD + j * D + d] += (sg + hc_eps) * dy[t * D + d];
            }
            double da = dpre * sg * (1.0 - sg);
            gm[j] = da * scale[0];
            if (dscale) dscale[0] += da * mx[j];
            if (dbase) dbase[j] += da;
        }
        token_mixes_bwd(dX ? dX + t * nD : NULL, dfn, gm, x, fn, n, nD, norm_eps);
    }
    free(mx), free(gm);
}
