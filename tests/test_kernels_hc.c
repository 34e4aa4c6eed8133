/* mHC (hc_split_sinkhorn, hc_pre, hc_post, hc_head) and compressor pooling kernels:
 * forwards against plain oracles written from the spec (§3, §4.4), every backward against central
 * finite differences of the float64 twins, float against float64, and bitwise determinism. */
#include <stdint.h>

#include "ds4/core.h"
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"
#include "test.h"

#define FD_H 1e-6
#define FD_TOL 1e-6    /* per tensor ‖analytic − fd‖ / ‖fd‖ */
#define F32_TOL 1e-5   /* float vs float64, per tensor */
#define ORACLE_TOL 1e-12

/* ---------------------------------------------------------------- buffers (freed per test) */
static void *bufs[512];
static int nbufs;

static double *dbuf(long n) {
    double *p = calloc((size_t)(n > 0 ? n : 1), sizeof(double));
    bufs[nbufs++] = p;
    return p;
}
static float *fbuf(long n) {
    float *p = calloc((size_t)(n > 0 ? n : 1), sizeof(float));
    bufs[nbufs++] = p;
    return p;
}
static void free_bufs(void) {
    while (nbufs > 0) free(bufs[--nbufs]);
}

/* Random values that are exact floats, so the float and float64 runs see the same inputs. */
static double *drand_(long n, unsigned seed, double amp) {
    float *f = fbuf(n);
    t_fill(f, n, seed, (float)amp);
    double *d = dbuf(n);
    for (long i = 0; i < n; i++) d[i] = f[i];
    return d;
}
static float *to_f(const double *d, long n) {
    float *f = fbuf(n);
    for (long i = 0; i < n; i++) f[i] = (float)d[i];
    return f;
}
static double *dfill(long n, double v) {
    double *d = dbuf(n);
    for (long i = 0; i < n; i++) d[i] = v;
    return d;
}
static double dsum_prod(const double *a, const double *b, long n) {
    double s = 0;
    for (long i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}
static double rel_dd(const double *a, const double *b, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        num += (a[i] - b[i]) * (a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
static double rel_fd_(const float *a, const double *b, long n) {
    double num = 0, den = 0;
    for (long i = 0; i < n; i++) {
        num += ((double)a[i] - b[i]) * ((double)a[i] - b[i]);
        den += b[i] * b[i];
    }
    return den > 0 ? sqrt(num / den) : sqrt(num);
}
static double norm_d(const double *a, long n) { return sqrt(dsum_prod(a, a, n)); }

/* Central differences of obj over every element of x [n], compared with the analytic gradient g. */
typedef double (*obj_fn)(void *ctx);
static double fd_err(obj_fn obj, void *ctx, double *x, long n, const double *g) {
    double *fd = dbuf(n);
    for (long i = 0; i < n; i++) {
        double xi = x[i];
        x[i] = xi + FD_H;
        double fp = obj(ctx);
        x[i] = xi - FD_H;
        double fm = obj(ctx);
        x[i] = xi;
        fd[i] = (fp - fm) / (2 * FD_H);
    }
    return rel_dd(g, fd, n);
}

#define CHECK_FD(name, obj, ctx, x, n, g)                                                        \
    do {                                                                                         \
        double e_ = fd_err(obj, ctx, x, n, g);                                                   \
        CHECK(norm_d(g, n) > 1e-3, "%s: gradient is (almost) zero: %g", name, norm_d(g, n));      \
        CHECK(e_ <= FD_TOL, "%s: fd rel err %.3g", name, e_);                                     \
    } while (0)

#define CHECK_F32(name, a, b, n)                                                                 \
    do {                                                                                         \
        double e_ = rel_fd_(a, b, n);                                                            \
        CHECK(e_ <= F32_TOL, "%s: float vs double rel err %.3g", name, e_);                      \
    } while (0)

/* ---------------------------------------------------------------- oracles written from the spec */
static double sigm(double a) { return 1.0 / (1.0 + exp(-a)); }

/* §3.2 hc_split_sinkhorn for one token, as the spec's code reads. */
static void oracle_sinkhorn(double *pre, double *post, double *comb, const double *mx, const double *scale,
                            const double *base, int n, int iters, double eps) {
    for (int j = 0; j < n; j++) {
        pre[j] = sigm(mx[j] * scale[0] + base[j]) + eps;
        post[j] = 2 * sigm(mx[n + j] * scale[1] + base[n + j]);
    }
    double L[64], rs[8], cs[8];
    for (int j = 0; j < n; j++) {
        double mxv = -1e300, s = 0;
        for (int k = 0; k < n; k++) {
            L[j * n + k] = mx[2 * n + j * n + k] * scale[2] + base[2 * n + j * n + k];
            if (L[j * n + k] > mxv) mxv = L[j * n + k];
        }
        for (int k = 0; k < n; k++) s += exp(L[j * n + k] - mxv);
        for (int k = 0; k < n; k++) comb[j * n + k] = exp(L[j * n + k] - mxv) / s + eps;
    }
    for (int it = 0; it < iters; it++) {
        if (it > 0) {
            for (int j = 0; j < n; j++) {
                rs[j] = 0;
                for (int k = 0; k < n; k++) rs[j] += comb[j * n + k];
            }
            for (int j = 0; j < n; j++)
                for (int k = 0; k < n; k++) comb[j * n + k] /= rs[j] + eps;
        }
        for (int k = 0; k < n; k++) {
            cs[k] = 0;
            for (int j = 0; j < n; j++) cs[k] += comb[j * n + k];
        }
        for (int j = 0; j < n; j++)
            for (int k = 0; k < n; k++) comb[j * n + k] /= cs[k] + eps;
    }
}

/* rsqrt and mixes of one token x [n·D] with fn [M, n·D]. */
static double oracle_mixes(double *mx, const double *x, const double *fn, long M, long nD, double norm_eps) {
    double ss = 0;
    for (long c = 0; c < nD; c++) ss += x[c] * x[c];
    double r = 1.0 / sqrt(ss / (double)nD + norm_eps);
    for (long i = 0; i < M; i++) {
        double s = 0;
        for (long c = 0; c < nD; c++) s += fn[i * nD + c] * x[c];
        mx[i] = s * r;
    }
    return r;
}

/* §4.4: out[b,i,ch] from the overlap transform, slot by slot. */
static void oracle_pool(double *out, const double *a, const double *z, const double *ape, long B, long T, long r,
                        long d, bool overlap) {
    long C = overlap ? 2 * d : d, Nc = T / r;
    for (long b = 0; b < B; b++)
        for (long i = 0; i < Nc; i++)
            for (long ch = 0; ch < d; ch++) {
                double sc[512], va[512];
                int ns = 0;
                if (overlap && i > 0)
                    for (long u = 0; u < r; u++) {
                        long tok = (i - 1) * r + u;
                        sc[ns] = z[(b * T + tok) * C + ch] + ape[u * C + ch];
                        va[ns++] = a[(b * T + tok) * C + ch];
                    }
                long off = overlap ? d : 0;
                for (long u = 0; u < r; u++) {
                    long tok = i * r + u;
                    sc[ns] = z[(b * T + tok) * C + off + ch] + ape[u * C + off + ch];
                    va[ns++] = a[(b * T + tok) * C + off + ch];
                }
                double m = -1e300, s = 0, o = 0;
                for (int q = 0; q < ns; q++) m = sc[q] > m ? sc[q] : m;
                for (int q = 0; q < ns; q++) s += exp(sc[q] - m);
                for (int q = 0; q < ns; q++) o += exp(sc[q] - m) / s * va[q];
                out[(b * Nc + i) * d + ch] = o;
            }
}

/* ================================================================ Sinkhorn */
typedef struct {
    int n, iters;
    double eps;
    double *mixes, *scale, *base, *rpre, *rpost, *rcomb, *pre, *post, *comb;
} sk_ctx;

static double sk_obj(void *p) {
    sk_ctx *c = p;
    hc_split_sinkhorn_fwd_f64(&(hc_sinkhorn_args_f64){.n = c->n, .iters = c->iters, .eps = c->eps, .mixes = c->mixes,
        .scale = c->scale, .base = c->base, .pre = c->pre, .post = c->post, .comb = c->comb});
    return dsum_prod(c->rpre, c->pre, c->n) + dsum_prod(c->rpost, c->post, c->n) +
           dsum_prod(c->rcomb, c->comb, c->n * c->n);
}

static sk_ctx sk_make(int n, int iters, unsigned seed, double amp) {
    int M = (2 + n) * n;
    sk_ctx c = {n, iters, 1e-6, drand_(M, seed, amp), drand_(3, seed + 1, 0.5), drand_(M, seed + 2, 0.5),
                drand_(n, seed + 3, 1), drand_(n, seed + 4, 1), drand_(n * n, seed + 5, 1),
                dbuf(n), dbuf(n), dbuf(n * n)};
    for (int i = 0; i < 3; i++) c.scale[i] += 1.0; /* scales around 1 */
    return c;
}

static void test_sinkhorn_matches_spec_and_is_doubly_stochastic(void) {
    for (int seed = 0; seed < 4; seed++) {
        sk_ctx c = sk_make(4, 20, 100 + seed, 2.0);
        double pre[4], post[4], comb[16];
        sk_obj(&c);
        oracle_sinkhorn(pre, post, comb, c.mixes, c.scale, c.base, 4, 20, 1e-6);
        CHECK(rel_dd(c.pre, pre, 4) <= ORACLE_TOL);
        CHECK(rel_dd(c.post, post, 4) <= ORACLE_TOL);
        CHECK(rel_dd(c.comb, comb, 16) <= ORACLE_TOL, "comb vs oracle %g", rel_dd(c.comb, comb, 16));
        for (int k = 0; k < 4; k++) { /* last step is a column normalisation: Σ_j comb[j][k] = s/(s+eps) */
            double cs = 0, rs = 0;
            for (int j = 0; j < 4; j++) cs += c.comb[j * 4 + k], rs += c.comb[k * 4 + j];
            CHECK(fabs(cs - 1) <= 1e-5, "col sum %d = %.9g", k, cs);
            CHECK(fabs(rs - 1) <= 1e-3, "row sum %d = %.9g (Sinkhorn did not converge)", k, rs);
        }
    }
    /* the general-n path and few iterations (far from converged) */
    int ns[3] = {3, 5, 4}, its[3] = {3, 20, 2};
    for (int v = 0; v < 3; v++) {
        int n = ns[v], nn = n * n;
        sk_ctx c = sk_make(n, its[v], 150 + v, 2.0);
        double pre[8], post[8], comb[64];
        sk_obj(&c);
        oracle_sinkhorn(pre, post, comb, c.mixes, c.scale, c.base, n, its[v], 1e-6);
        CHECK(rel_dd(c.pre, pre, n) <= ORACLE_TOL && rel_dd(c.post, post, n) <= ORACLE_TOL);
        CHECK(rel_dd(c.comb, comb, nn) <= ORACLE_TOL, "n=%d iters=%d: comb vs oracle %g", n, its[v],
              rel_dd(c.comb, comb, nn));
    }
    /* all logits equal: pre = 1/2 + eps, post = 1, comb = 1/n (to eps) */
    double mx[24] = {0}, base[24] = {0}, scale[3] = {1, 1, 1}, pre[4], post[4], comb[16];
    hc_split_sinkhorn_fwd_f64(&(hc_sinkhorn_args_f64){.n = 4, .iters = 20, .eps = 1e-6, .mixes = mx, .scale = scale,
        .base = base, .pre = pre, .post = post, .comb = comb});
    for (int j = 0; j < 4; j++) {
        CHECK_CLOSE(pre[j], 0.5 + 1e-6, 1e-15, 1e-30);
        CHECK_CLOSE(post[j], 1.0, 1e-15, 1e-30);
    }
    for (int e = 0; e < 16; e++) CHECK_CLOSE(comb[e], 0.25, 1e-5, 1e-30);
    free_bufs();
}

static void test_sinkhorn_bwd_fd(void) {
    int iters_list[3] = {20, 1, 3};
    for (int v = 0; v < 3; v++) {
        sk_ctx c = sk_make(4, iters_list[v], 200 + v, 2.0);
        int M = 24;
        double *dm = dbuf(M), *ds = dbuf(3), *db = dbuf(M);
        hc_split_sinkhorn_bwd_f64(&(hc_sinkhorn_args_f64){.n = 4, .iters = c.iters, .eps = c.eps, .mixes = c.mixes,
            .scale = c.scale, .base = c.base}, &(hc_sinkhorn_grads_f64){.dpre = c.rpre, .dpost = c.rpost,
            .dcomb = c.rcomb, .dmixes = dm, .dscale = ds, .dbase = db});
        CHECK_FD("sinkhorn dmixes", sk_obj, &c, c.mixes, M, dm);
        CHECK_FD("sinkhorn dscale", sk_obj, &c, c.scale, 3, ds);
        CHECK_FD("sinkhorn dbase", sk_obj, &c, c.base, M, db);
    }
    /* n = 3 (the general-n path, M = 15), converged and not */
    for (int v = 0; v < 2; v++) {
        int iters = v ? 3 : 20;
        sk_ctx c = sk_make(3, iters, 250 + v, 2.0);
        double *dm = dbuf(15), *ds = dbuf(3), *db = dbuf(15);
        hc_split_sinkhorn_bwd_f64(&(hc_sinkhorn_args_f64){.n = 3, .iters = iters, .eps = c.eps, .mixes = c.mixes,
            .scale = c.scale, .base = c.base}, &(hc_sinkhorn_grads_f64){.dpre = c.rpre, .dpost = c.rpost,
            .dcomb = c.rcomb, .dmixes = dm, .dscale = ds, .dbase = db});
        CHECK_FD("sinkhorn n=3 dmixes", sk_obj, &c, c.mixes, 15, dm);
        CHECK_FD("sinkhorn n=3 dscale", sk_obj, &c, c.scale, 3, ds);
        CHECK_FD("sinkhorn n=3 dbase", sk_obj, &c, c.base, 15, db);
    }
    free_bufs();
}

static void test_sinkhorn_float_and_nulls(void) {
    sk_ctx c = sk_make(4, 20, 300, 2.0);
    int M = 24;
    double *dm = dbuf(M), *ds = dbuf(3), *db = dbuf(M);
    sk_obj(&c);
    hc_split_sinkhorn_bwd_f64(&(hc_sinkhorn_args_f64){.n = 4, .iters = 20, .eps = c.eps, .mixes = c.mixes,
        .scale = c.scale, .base = c.base}, &(hc_sinkhorn_grads_f64){.dpre = c.rpre, .dpost = c.rpost, .dcomb = c.rcomb,
        .dmixes = dm, .dscale = ds, .dbase = db});
    float *fm = to_f(c.mixes, M), *fs = to_f(c.scale, 3), *fb = to_f(c.base, M);
    float *fpre = fbuf(4), *fpost = fbuf(4), *fcomb = fbuf(16), *fdm = fbuf(M), *fds = fbuf(3), *fdb = fbuf(M);
    hc_split_sinkhorn_fwd(CPU_EXEC, &(hc_sinkhorn_args){.n = 4, .iters = 20, .eps = 1e-6f, .mixes = fm, .scale = fs, .base = fb,
        .pre = fpre, .post = fpost, .comb = fcomb});
    hc_split_sinkhorn_bwd(CPU_EXEC, &(hc_sinkhorn_args){.n = 4, .iters = 20, .eps = 1e-6f, .mixes = fm, .scale = fs, .base = fb},
        &(hc_sinkhorn_grads){.dpre = to_f(c.rpre, 4), .dpost = to_f(c.rpost, 4), .dcomb = to_f(c.rcomb, 16),
        .dmixes = fdm, .dscale = fds, .dbase = fdb});
    CHECK_F32("pre", fpre, c.pre, 4);
    CHECK_F32("post", fpost, c.post, 4);
    CHECK_F32("comb", fcomb, c.comb, 16);
    CHECK_F32("dmixes", fdm, dm, M);
    CHECK_F32("dscale", fds, ds, 3);
    CHECK_F32("dbase", fdb, db, M);
    /* NULL upstream gradients are zeros; NULL outputs are skipped */
    double *z4 = dbuf(4), *z16 = dbuf(16);
    double *a1 = dbuf(M), *a2 = dbuf(M), *s1 = dbuf(3), *s2 = dbuf(3);
    hc_split_sinkhorn_bwd_f64(&(hc_sinkhorn_args_f64){.n = 4, .iters = 20, .eps = c.eps, .mixes = c.mixes,
        .scale = c.scale, .base = c.base}, &(hc_sinkhorn_grads_f64){.dpost = c.rpost, .dmixes = a1, .dscale = s1});
    hc_split_sinkhorn_bwd_f64(&(hc_sinkhorn_args_f64){.n = 4, .iters = 20, .eps = c.eps, .mixes = c.mixes,
        .scale = c.scale, .base = c.base}, &(hc_sinkhorn_grads_f64){.dpre = z4, .dpost = c.rpost, .dcomb = z16,
        .dmixes = a2, .dscale = s2});
    CHECK(memcmp(a1, a2, M * sizeof(double)) == 0 && memcmp(s1, s2, 3 * sizeof(double)) == 0);
    for (int i = 0; i < 4; i++) CHECK(a1[i] == 0 && a1[8 + i] == 0, "pre/comb part should get nothing");
    CHECK(a1[4] != 0 && s1[1] != 0, "post part should get gradient");
    free_bufs();
}

/* ================================================================ hc_pre */
typedef struct {
    long N, n, D, iters;
    double hc_eps, norm_eps;
    double *X, *fn, *scale, *base, *ry, *rpost, *rcomb;
    double *y, *post, *comb, *mixes, *rsqrt;
} pre_ctx;

static double pre_obj(void *p) {
    pre_ctx *c = p;
    hc_pre_fwd_f64(&(hc_pre_args_f64){.dims = {.N = c->N, .n = c->n, .D = c->D, .iters = c->iters}, .hc_eps = c->hc_eps,
        .norm_eps = c->norm_eps, .X = c->X, .fn = c->fn, .scale = c->scale, .base = c->base, .y = c->y, .post = c->post,
        .comb = c->comb, .mixes = c->mixes, .rsqrt = c->rsqrt});
    return dsum_prod(c->ry, c->y, c->N * c->D) + dsum_prod(c->rpost, c->post, c->N * c->n) +
           dsum_prod(c->rcomb, c->comb, c->N * c->n * c->n);
}

static pre_ctx pre_make(long N, long n, long D, unsigned seed) {
    long M = (2 + n) * n;
    pre_ctx c = {N, n, D, 20, 1e-6, 1e-6,
                 drand_(N * n * D, seed, 1.5), drand_(M * n * D, seed + 1, 0.3), drand_(3, seed + 2, 0.4),
                 drand_(M, seed + 3, 0.5), drand_(N * D, seed + 4, 1), drand_(N * n, seed + 5, 1),
                 drand_(N * n * n, seed + 6, 1),
                 dbuf(N * D), dbuf(N * n), dbuf(N * n * n), dbuf(N * M), dbuf(N)};
    for (int i = 0; i < 3; i++) c.scale[i] += 1.0;
    return c;
}

static void pre_bwd(pre_ctx *c, double *dX, double *dfn, double *ds, double *db) {
    hc_pre_bwd_f64(&(hc_pre_args_f64){.dims = {.N = c->N, .n = c->n, .D = c->D, .iters = c->iters}, .hc_eps = c->hc_eps,
        .norm_eps = c->norm_eps, .X = c->X, .fn = c->fn, .scale = c->scale, .base = c->base, .mixes = c->mixes,
        .rsqrt = c->rsqrt}, &(hc_pre_grads_f64){.dy = c->ry, .dpost = c->rpost, .dcomb = c->rcomb, .dX = dX, .dfn = dfn,
        .dscale = ds, .dbase = db});
}

static void test_hc_pre_fwd_matches_spec(void) {
    pre_ctx c = pre_make(5, 4, 8, 400);
    long M = 24, nD = 32;
    pre_obj(&c);
    for (long t = 0; t < c.N; t++) {
        double mx[24], pre[4], post[4], comb[16], y[8] = {0};
        double r = oracle_mixes(mx, c.X + t * nD, c.fn, M, nD, c.norm_eps);
        oracle_sinkhorn(pre, post, comb, mx, c.scale, c.base, 4, 20, c.hc_eps);
        for (long j = 0; j < 4; j++)
            for (long d = 0; d < 8; d++) y[d] += pre[j] * c.X[t * nD + j * 8 + d];
        CHECK_CLOSE(c.rsqrt[t], r, ORACLE_TOL, 0);
        CHECK(rel_dd(c.mixes + t * M, mx, M) <= ORACLE_TOL);
        CHECK(rel_dd(c.post + t * 4, post, 4) <= ORACLE_TOL);
        CHECK(rel_dd(c.comb + t * 16, comb, 16) <= ORACLE_TOL);
        CHECK(rel_dd(c.y + t * 8, y, 8) <= ORACLE_TOL, "token %ld y rel %g", t, rel_dd(c.y + t * 8, y, 8));
    }
    free_bufs();
}

static void test_hc_pre_bwd_fd(void) {
    pre_ctx c = pre_make(3, 4, 8, 500);
    long M = 24, nD = 32;
    pre_obj(&c);
    double *dX = dbuf(c.N * nD), *dfn = dbuf(M * nD), *ds = dbuf(3), *db = dbuf(M);
    pre_bwd(&c, dX, dfn, ds, db);
    CHECK_FD("hc_pre dX", pre_obj, &c, c.X, c.N * nD, dX);
    CHECK_FD("hc_pre dfn", pre_obj, &c, c.fn, M * nD, dfn);
    CHECK_FD("hc_pre dscale", pre_obj, &c, c.scale, 3, ds);
    CHECK_FD("hc_pre dbase", pre_obj, &c, c.base, M, db);
    /* each upstream gradient alone reaches the parameters (none of the three is silently ignored) */
    double *zy = dbuf(c.N * c.D), *zp = dbuf(c.N * 4), *zc = dbuf(c.N * 16);
    double *ups[3] = {c.ry, c.rpost, c.rcomb};
    for (int which = 0; which < 3; which++) {
        double *dfn1 = dbuf(M * nD);
        hc_pre_bwd_f64(&(hc_pre_args_f64){.dims = {.N = c.N, .n = 4, .D = c.D, .iters = 20}, .hc_eps = c.hc_eps,
            .norm_eps = c.norm_eps, .X = c.X, .fn = c.fn, .scale = c.scale, .base = c.base, .mixes = c.mixes,
            .rsqrt = c.rsqrt}, &(hc_pre_grads_f64){.dy = which == 0 ? ups[0] : zy, .dpost = which == 1 ? ups[1] : zp,
            .dcomb = which == 2 ? ups[2] : zc, .dfn = dfn1});
        CHECK(norm_d(dfn1, M * nD) > 1e-3, "upstream %d gives no dfn", which);
    }
    free_bufs();
}

static void test_hc_pre_float_chunks_accumulate(void) {
    /* N = 150 spans several backward chunks; D = 64 as in the tiny config */
    pre_ctx c = pre_make(150, 4, 64, 600);
    long M = 24, nD = 256, N = c.N;
    pre_obj(&c);
    double *dX = dbuf(N * nD), *dfn = dbuf(M * nD), *ds = dbuf(3), *db = dbuf(M);
    pre_bwd(&c, dX, dfn, ds, db);
    /* the whole batch == token by token (the chunking changes nothing) */
    double *dX1 = dbuf(N * nD), *dfn1 = dbuf(M * nD), *ds1 = dbuf(3), *db1 = dbuf(M);
    for (long t = 0; t < N; t++)
        hc_pre_bwd_f64(&(hc_pre_args_f64){.dims = {.N = 1, .n = 4, .D = c.D, .iters = 20}, .hc_eps = c.hc_eps,
            .norm_eps = c.norm_eps, .X = c.X + t * nD, .fn = c.fn, .scale = c.scale, .base = c.base,
            .mixes = c.mixes + t * M, .rsqrt = c.rsqrt + t}, &(hc_pre_grads_f64){.dy = c.ry + t * c.D,
            .dpost = c.rpost + t * 4, .dcomb = c.rcomb + t * 16, .dX = dX1 + t * nD, .dfn = dfn1, .dscale = ds1,
            .dbase = db1});
    CHECK(rel_dd(dX1, dX, N * nD) <= 1e-13 && rel_dd(dfn1, dfn, M * nD) <= 1e-13);
    CHECK(rel_dd(ds1, ds, 3) <= 1e-13 && rel_dd(db1, db, M) <= 1e-13);
    /* float == double */
    float *fX = to_f(c.X, N * nD), *ffn = to_f(c.fn, M * nD), *fs = to_f(c.scale, 3), *fb = to_f(c.base, M);
    float *fy = fbuf(N * c.D), *fpost = fbuf(N * 4), *fcomb = fbuf(N * 16), *fmx = fbuf(N * M), *frs = fbuf(N);
    hc_pre_fwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = 4, .D = c.D, .iters = 20}, .hc_eps = 1e-6f, .norm_eps = 1e-6f,
        .X = fX, .fn = ffn, .scale = fs, .base = fb, .y = fy, .post = fpost, .comb = fcomb, .mixes = fmx,
        .rsqrt = frs});
    CHECK_F32("y", fy, c.y, N * c.D);
    CHECK_F32("post", fpost, c.post, N * 4);
    CHECK_F32("comb", fcomb, c.comb, N * 16);
    CHECK_F32("mixes", fmx, c.mixes, N * M);
    CHECK_F32("rsqrt", frs, c.rsqrt, N);
    float *fdX = fbuf(N * nD), *fdfn = fbuf(M * nD), *fds = fbuf(3), *fdb = fbuf(M);
    hc_pre_bwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = 4, .D = c.D, .iters = 20}, .hc_eps = 1e-6f, .norm_eps = 1e-6f,
        .X = fX, .fn = ffn, .scale = fs, .base = fb, .mixes = fmx, .rsqrt = frs},
        &(hc_pre_grads){.dy = to_f(c.ry, N * c.D), .dpost = to_f(c.rpost, N * 4), .dcomb = to_f(c.rcomb, N * 16),
        .dX = fdX, .dfn = fdfn, .dscale = fds, .dbase = fdb});
    CHECK_F32("dX", fdX, dX, N * nD);
    CHECK_F32("dfn", fdfn, dfn, M * nD);
    CHECK_F32("dscale", fds, ds, 3);
    CHECK_F32("dbase", fdb, db, M);
    /* backward accumulates: start from 0.5 everywhere */
    double *aX = dfill(N * nD, 0.5), *afn = dfill(M * nD, 0.5), *as = dfill(3, 0.5), *ab = dfill(M, 0.5);
    pre_bwd(&c, aX, afn, as, ab);
    for (long i = 0; i < N * nD; i++) aX[i] -= 0.5;
    for (long i = 0; i < M * nD; i++) afn[i] -= 0.5;
    for (long i = 0; i < 3; i++) as[i] -= 0.5;
    for (long i = 0; i < M; i++) ab[i] -= 0.5;
    CHECK(rel_dd(aX, dX, N * nD) <= 1e-12 && rel_dd(afn, dfn, M * nD) <= 1e-12);
    CHECK(rel_dd(as, ds, 3) <= 1e-12 && rel_dd(ab, db, M) <= 1e-12);
    free_bufs();
}

/* ================================================================ hc_post */
typedef struct {
    long N, n, D;
    double *x, *res, *post, *comb, *rY, *Y;
} post_ctx;

static double post_obj(void *p) {
    post_ctx *c = p;
    hc_post_fwd_f64(&(hc_post_args_f64){.dims = {.N = c->N, .n = c->n, .D = c->D}, .x = c->x, .res = c->res,
        .post = c->post, .comb = c->comb, .Y = c->Y});
    return dsum_prod(c->rY, c->Y, c->N * c->n * c->D);
}

static void test_hc_post(void) {
    long N = 3, n = 4, D = 8;
    post_ctx c = {N, n, D, drand_(N * D, 700, 1), drand_(N * n * D, 701, 1), drand_(N * n, 702, 1),
                  drand_(N * n * n, 703, 1), drand_(N * n * D, 704, 1), dbuf(N * n * D)};
    post_obj(&c);
    /* oracle: Y[k] = post[k]·x + Σ_j comb[j][k]·res[j] (sum over the FIRST comb index) */
    double *Yo = dbuf(N * n * D);
    for (long t = 0; t < N; t++)
        for (long k = 0; k < n; k++)
            for (long d = 0; d < D; d++) {
                double v = c.post[t * n + k] * c.x[t * D + d];
                for (long j = 0; j < n; j++) v += c.comb[t * n * n + j * n + k] * c.res[(t * n + j) * D + d];
                Yo[(t * n + k) * D + d] = v;
            }
    CHECK(rel_dd(c.Y, Yo, N * n * D) <= ORACLE_TOL);
    double *dx = dbuf(N * D), *dres = dbuf(N * n * D), *dpost = dbuf(N * n), *dcomb = dbuf(N * n * n);
    hc_post_bwd_f64(&(hc_post_args_f64){.dims = {.N = N, .n = n, .D = D}, .x = c.x, .res = c.res, .post = c.post,
        .comb = c.comb}, &(hc_post_grads_f64){.dY = c.rY, .dx = dx, .dres = dres, .dpost = dpost, .dcomb = dcomb});
    CHECK_FD("hc_post dx", post_obj, &c, c.x, N * D, dx);
    CHECK_FD("hc_post dres", post_obj, &c, c.res, N * n * D, dres);
    CHECK_FD("hc_post dpost", post_obj, &c, c.post, N * n, dpost);
    CHECK_FD("hc_post dcomb", post_obj, &c, c.comb, N * n * n, dcomb);
    /* float == double on a bigger shape */
    long N2 = 40, D2 = 64;
    double *x2 = drand_(N2 * D2, 710, 1), *r2 = drand_(N2 * n * D2, 711, 1), *p2 = drand_(N2 * n, 712, 1);
    double *c2 = drand_(N2 * n * n, 713, 1), *g2 = drand_(N2 * n * D2, 714, 1), *Y2 = dbuf(N2 * n * D2);
    double *dx2 = dbuf(N2 * D2), *dr2 = dbuf(N2 * n * D2), *dp2 = dbuf(N2 * n), *dc2 = dbuf(N2 * n * n);
    hc_post_fwd_f64(&(hc_post_args_f64){.dims = {.N = N2, .n = n, .D = D2}, .x = x2, .res = r2, .post = p2, .comb = c2,
        .Y = Y2});
    hc_post_bwd_f64(&(hc_post_args_f64){.dims = {.N = N2, .n = n, .D = D2}, .x = x2, .res = r2, .post = p2, .comb = c2},
        &(hc_post_grads_f64){.dY = g2, .dx = dx2, .dres = dr2, .dpost = dp2, .dcomb = dc2});
    float *fx = to_f(x2, N2 * D2), *fr = to_f(r2, N2 * n * D2), *fp = to_f(p2, N2 * n), *fc = to_f(c2, N2 * n * n);
    float *fY = fbuf(N2 * n * D2), *fdx = fbuf(N2 * D2), *fdr = fbuf(N2 * n * D2), *fdp = fbuf(N2 * n);
    float *fdc = fbuf(N2 * n * n);
    hc_post_fwd(CPU_EXEC, &(hc_post_args){.dims = {.N = N2, .n = n, .D = D2}, .x = fx, .res = fr, .post = fp, .comb = fc,
        .Y = fY});
    hc_post_bwd(CPU_EXEC, &(hc_post_args){.dims = {.N = N2, .n = n, .D = D2}, .x = fx, .res = fr, .post = fp, .comb = fc},
        &(hc_post_grads){.dY = to_f(g2, N2 * n * D2), .dx = fdx, .dres = fdr, .dpost = fdp, .dcomb = fdc});
    CHECK_F32("Y", fY, Y2, N2 * n * D2);
    CHECK_F32("dx", fdx, dx2, N2 * D2);
    CHECK_F32("dres", fdr, dr2, N2 * n * D2);
    CHECK_F32("dpost", fdp, dp2, N2 * n);
    CHECK_F32("dcomb", fdc, dc2, N2 * n * n);
    free_bufs();
}

/* ================================================================ hc_head */
typedef struct {
    long N, n, D;
    double hc_eps, norm_eps;
    double *X, *fn, *scale, *base, *ry, *y, *mixes, *rsqrt;
} head_ctx;

static double head_obj(void *p) {
    head_ctx *c = p;
    hc_head_fwd_f64(&(hc_head_args_f64){.dims = {.N = c->N, .n = c->n, .D = c->D}, .hc_eps = c->hc_eps,
        .norm_eps = c->norm_eps, .X = c->X, .fn = c->fn, .scale = c->scale, .base = c->base, .y = c->y,
        .mixes = c->mixes, .rsqrt = c->rsqrt});
    return dsum_prod(c->ry, c->y, c->N * c->D);
}

static head_ctx head_make(long N, long n, long D, unsigned seed) {
    head_ctx c = {N, n, D, 1e-6, 1e-6, drand_(N * n * D, seed, 1.5), drand_(n * n * D, seed + 1, 0.3),
                  drand_(1, seed + 2, 0.4), drand_(n, seed + 3, 0.5), drand_(N * D, seed + 4, 1),
                  dbuf(N * D), dbuf(N * n), dbuf(N)};
    c.scale[0] += 1.0;
    return c;
}

static void test_hc_head(void) {
    head_ctx c = head_make(3, 4, 8, 800);
    long n = 4, nD = 32, N = 3;
    head_obj(&c);
    for (long t = 0; t < N; t++) { /* oracle: pre = sigmoid(mixes·scale + base) + eps, y = Σ pre[j]·X[j] */
        double mx[4], y[8] = {0};
        double r = oracle_mixes(mx, c.X + t * nD, c.fn, n, nD, c.norm_eps);
        for (long j = 0; j < n; j++) {
            double pre = sigm(mx[j] * c.scale[0] + c.base[j]) + c.hc_eps;
            for (long d = 0; d < 8; d++) y[d] += pre * c.X[t * nD + j * 8 + d];
        }
        CHECK_CLOSE(c.rsqrt[t], r, ORACLE_TOL, 0);
        CHECK(rel_dd(c.mixes + t * n, mx, n) <= ORACLE_TOL);
        CHECK(rel_dd(c.y + t * 8, y, 8) <= ORACLE_TOL);
    }
    double *dX = dbuf(N * nD), *dfn = dbuf(n * nD), *ds = dbuf(1), *db = dbuf(n);
    hc_head_bwd_f64(&(hc_head_args_f64){.dims = {.N = N, .n = n, .D = c.D}, .hc_eps = c.hc_eps, .norm_eps = c.norm_eps,
        .X = c.X, .fn = c.fn, .scale = c.scale, .base = c.base, .mixes = c.mixes, .rsqrt = c.rsqrt},
        &(hc_head_grads_f64){.dy = c.ry, .dX = dX, .dfn = dfn, .dscale = ds, .dbase = db});
    CHECK_FD("hc_head dX", head_obj, &c, c.X, N * nD, dX);
    CHECK_FD("hc_head dfn", head_obj, &c, c.fn, n * nD, dfn);
    CHECK_FD("hc_head dscale", head_obj, &c, c.scale, 1, ds);
    CHECK_FD("hc_head dbase", head_obj, &c, c.base, n, db);

    /* float == double over several chunks */
    head_ctx b = head_make(700, 4, 64, 810);
    long N2 = b.N, nD2 = 256;
    head_obj(&b);
    double *dX2 = dbuf(N2 * nD2), *dfn2 = dbuf(n * nD2), *ds2 = dbuf(1), *db2 = dbuf(n);
    hc_head_bwd_f64(&(hc_head_args_f64){.dims = {.N = N2, .n = n, .D = b.D}, .hc_eps = 1e-6, .norm_eps = 1e-6, .X = b.X,
        .fn = b.fn, .scale = b.scale, .base = b.base, .mixes = b.mixes, .rsqrt = b.rsqrt},
        &(hc_head_grads_f64){.dy = b.ry, .dX = dX2, .dfn = dfn2, .dscale = ds2, .dbase = db2});
    float *fX = to_f(b.X, N2 * nD2), *ffn = to_f(b.fn, n * nD2), *fs = to_f(b.scale, 1), *fb = to_f(b.base, n);
    float *fy = fbuf(N2 * b.D), *fmx = fbuf(N2 * n), *frs = fbuf(N2);
    hc_head_fwd(CPU_EXEC, &(hc_head_args){.dims = {.N = N2, .n = n, .D = b.D}, .hc_eps = 1e-6f, .norm_eps = 1e-6f, .X = fX,
        .fn = ffn, .scale = fs, .base = fb, .y = fy, .mixes = fmx, .rsqrt = frs});
    CHECK_F32("head y", fy, b.y, N2 * b.D);
    CHECK_F32("head mixes", fmx, b.mixes, N2 * n);
    float *fdX = fbuf(N2 * nD2), *fdfn = fbuf(n * nD2), *fds = fbuf(1), *fdb = fbuf(n);
    hc_head_bwd(CPU_EXEC, &(hc_head_args){.dims = {.N = N2, .n = n, .D = b.D}, .hc_eps = 1e-6f, .norm_eps = 1e-6f, .X = fX,
        .fn = ffn, .scale = fs, .base = fb, .mixes = fmx, .rsqrt = frs}, &(hc_head_grads){.dy = to_f(b.ry, N2 * b.D),
        .dX = fdX, .dfn = fdfn, .dscale = fds, .dbase = fdb});
    CHECK_F32("head dX", fdX, dX2, N2 * nD2);
    CHECK_F32("head dfn", fdfn, dfn2, n * nD2);
    CHECK_F32("head dscale", fds, ds2, 1);
    CHECK_F32("head dbase", fdb, db2, n);
    free_bufs();
}

/* ================================================================ compressor pooling */
typedef struct {
    long B, T, r, d;
    bool overlap;
    double *a, *z, *ape, *rout, *out;
} cp_ctx;

static double cp_obj(void *p) {
    cp_ctx *c = p;
    compressor_pool_fwd_f64(&(compressor_pool_args_f64){.dims = {.B = c->B, .T = c->T, .r = c->r, .d = c->d,
        .overlap = c->overlap}, .a = c->a, .z = c->z, .ape = c->ape, .out = c->out});
    return dsum_prod(c->rout, c->out, c->B * (c->T / c->r) * c->d);
}

static cp_ctx cp_make(long B, long T, long r, long d, bool overlap, unsigned seed) {
    long C = overlap ? 2 * d : d;
    cp_ctx c = {B, T, r, d, overlap, drand_(B * T * C, seed, 1), drand_(B * T * C, seed + 1, 2),
                drand_(r * C, seed + 2, 1), drand_(B * (T / r) * d, seed + 3, 1), dbuf(B * (T / r) * d)};
    return c;
}

static void cp_check(long B, long T, long r, long d, bool overlap, unsigned seed) {
    cp_ctx c = cp_make(B, T, r, d, overlap, seed);
    long C = overlap ? 2 * d : d, Nc = T / r, NO = B * Nc * d;
    cp_obj(&c);
    double *o = dbuf(NO);
    oracle_pool(o, c.a, c.z, c.ape, B, T, r, d, overlap);
    CHECK(rel_dd(c.out, o, NO) <= ORACLE_TOL, "overlap %d: out vs oracle %g", overlap, rel_dd(c.out, o, NO));
    double *da = dbuf(B * T * C), *dz = dbuf(B * T * C), *dape = dbuf(r * C);
    compressor_pool_bwd_f64(&(compressor_pool_args_f64){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = overlap},
        .a = c.a, .z = c.z, .ape = c.ape}, &(compressor_pool_grads_f64){.dout = c.rout, .da = da, .dz = dz,
        .dape = dape});
    CHECK_FD(overlap ? "pool(overlap) da" : "pool da", cp_obj, &c, c.a, B * T * C, da);
    CHECK_FD(overlap ? "pool(overlap) dz" : "pool dz", cp_obj, &c, c.z, B * T * C, dz);
    CHECK_FD(overlap ? "pool(overlap) dape" : "pool dape", cp_obj, &c, c.ape, r * C, dape);
    /* the tail tokens (T % r of them) get exactly nothing, with overlap the last block's channels [0, d) too */
    for (long b = 0; b < B; b++)
        for (long t = Nc * r; t < T; t++)
            for (long ch = 0; ch < C; ch++)
                CHECK(da[(b * T + t) * C + ch] == 0 && dz[(b * T + t) * C + ch] == 0, "tail token %ld", t);
    if (overlap)
        for (long b = 0; b < B; b++)
            for (long t = (Nc - 1) * r; t < Nc * r; t++)
                for (long ch = 0; ch < d; ch++) CHECK(da[(b * T + t) * C + ch] == 0 && dz[(b * T + t) * C + ch] == 0);

    /* float == double */
    float *fa = to_f(c.a, B * T * C), *fz = to_f(c.z, B * T * C), *fp = to_f(c.ape, r * C), *fo = fbuf(NO);
    float *fda = fbuf(B * T * C), *fdz = fbuf(B * T * C), *fdp = fbuf(r * C);
    compressor_pool_fwd(CPU_EXEC, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = overlap}, .a = fa,
        .z = fz, .ape = fp, .out = fo});
    compressor_pool_bwd(CPU_EXEC, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = overlap}, .a = fa,
        .z = fz, .ape = fp}, &(compressor_pool_grads){.dout = to_f(c.rout, NO), .da = fda, .dz = fdz, .dape = fdp});
    CHECK_F32("pool out", fo, c.out, NO);
    CHECK_F32("pool da", fda, da, B * T * C);
    CHECK_F32("pool dz", fdz, dz, B * T * C);
    CHECK_F32("pool dape", fdp, dape, r * C);
    free_bufs();
}

static void test_compressor_pool_fd(void) {
    cp_check(2, 11, 4, 21, true, 900);   /* ratio 4 overlap: Nc = 2, 3 tail tokens, d over one channel block */
    cp_check(2, 11, 3, 21, false, 910);  /* no overlap: Nc = 3, 2 tail tokens */
    cp_check(2, 16, 4, 5, true, 920);    /* no tail */
}

static void test_compressor_block0_and_constant_scores(void) {
    long B = 2, T = 12, r = 4, d = 3, C = 6, Nc = 3;
    cp_ctx c = cp_make(B, T, r, d, true, 1000);
    cp_obj(&c);
    /* block 0 only sees its own tokens' channels [d, 2d) */
    for (long b = 0; b < B; b++)
        for (long ch = 0; ch < d; ch++) {
            double s = 0, o = 0;
            for (long u = 0; u < r; u++) s += exp(c.z[(b * T + u) * C + d + ch] + c.ape[u * C + d + ch]);
            for (long u = 0; u < r; u++)
                o += exp(c.z[(b * T + u) * C + d + ch] + c.ape[u * C + d + ch]) / s * c.a[(b * T + u) * C + d + ch];
            CHECK_CLOSE(c.out[(b * Nc) * d + ch], o, 1e-13, 0);
        }
    /* changing block 0's channels [0, d) moves entry 1 but never entry 0 */
    double *before = dbuf(B * Nc * d);
    memcpy(before, c.out, sizeof(double) * B * Nc * d);
    for (long u = 0; u < r; u++)
        for (long ch = 0; ch < d; ch++) c.a[u * C + ch] += 1.0, c.z[u * C + ch] -= 0.7;
    cp_obj(&c);
    for (long ch = 0; ch < d; ch++) {
        CHECK(c.out[ch] == before[ch], "entry 0 moved");
        CHECK(c.out[d + ch] != before[d + ch], "entry 1 did not move");
    }
    /* equal scores: the entry is the plain mean of its slots (4 for block 0, 8 after) */
    for (long i = 0; i < B * T * C; i++) c.z[i] = 0.25;
    for (long i = 0; i < r * C; i++) c.ape[i] = 0;
    cp_obj(&c);
    for (long i = 0; i < Nc; i++)
        for (long ch = 0; ch < d; ch++) {
            double m = 0;
            for (long u = 0; u < r; u++) m += c.a[(i * r + u) * C + d + ch];
            if (i > 0)
                for (long u = 0; u < r; u++) m += c.a[((i - 1) * r + u) * C + ch];
            m /= i > 0 ? 2 * r : r;
            CHECK_CLOSE(c.out[i * d + ch], m, 1e-14, 1e-14);
        }
    free_bufs();
}

/* ================================================================ determinism */
static void test_deterministic_across_runs_and_threads(void) {
    int nt0 = ds4_get_threads();
    long N = 160, n = 4, D = 64, M = 24, nD = 256;
    pre_ctx c = pre_make(N, n, D, 1100);
    float *X = to_f(c.X, N * nD), *fn = to_f(c.fn, M * nD), *sc = to_f(c.scale, 3), *ba = to_f(c.base, M);
    float *dy = to_f(c.ry, N * D), *dp = to_f(c.rpost, N * n), *dc = to_f(c.rcomb, N * n * n);
    long B = 2, T = 67, r = 4, d = 40, C = 80, Nc = T / r;
    float *a = fbuf(B * T * C), *z = fbuf(B * T * C), *ape = fbuf(r * C), *go = fbuf(B * Nc * d);
    t_fill(a, B * T * C, 1, 1.f), t_fill(z, B * T * C, 2, 2.f), t_fill(ape, r * C, 3, 1.f);
    t_fill(go, B * Nc * d, 4, 1.f);
    const long nout = 7;
    long sizes[7] = {N * nD, M * nD, 3, M, B * T * C, B * T * C, r * C};
    float *runs[3][7];
    int threads[3] = {2, 2, 1};
    for (int run = 0; run < 3; run++) {
        ds4_set_threads(threads[run]);
        float *y = fbuf(N * D), *post = fbuf(N * n), *comb = fbuf(N * n * n), *mx = fbuf(N * M), *rs = fbuf(N);
        for (int k = 0; k < nout; k++) runs[run][k] = fbuf(sizes[k]);
        hc_pre_fwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = 20}, .hc_eps = 1e-6f, .norm_eps = 1e-6f,
            .X = X, .fn = fn, .scale = sc, .base = ba, .y = y, .post = post, .comb = comb, .mixes = mx, .rsqrt = rs});
        hc_pre_bwd(CPU_EXEC, &(hc_pre_args){.dims = {.N = N, .n = n, .D = D, .iters = 20}, .hc_eps = 1e-6f, .norm_eps = 1e-6f,
            .X = X, .fn = fn, .scale = sc, .base = ba, .mixes = mx, .rsqrt = rs}, &(hc_pre_grads){.dy = dy, .dpost = dp,
            .dcomb = dc, .dX = runs[run][0], .dfn = runs[run][1], .dscale = runs[run][2], .dbase = runs[run][3]});
        compressor_pool_bwd(CPU_EXEC, &(compressor_pool_args){.dims = {.B = B, .T = T, .r = r, .d = d, .overlap = true}, .a = a,
            .z = z, .ape = ape}, &(compressor_pool_grads){.dout = go, .da = runs[run][4], .dz = runs[run][5],
            .dape = runs[run][6]});
    }
    ds4_set_threads(nt0);
    for (int run = 1; run < 3; run++)
        for (int k = 0; k < nout; k++)
            CHECK(memcmp(runs[0][k], runs[run][k], sizeof(float) * sizes[k]) == 0,
                  "output %d differs in run %d (threads %d)", k, run, threads[run]);
    free_bufs();
}

int main(void) {
    RUN(test_sinkhorn_matches_spec_and_is_doubly_stochastic);
    RUN(test_sinkhorn_bwd_fd);
    RUN(test_sinkhorn_float_and_nulls);
    RUN(test_hc_pre_fwd_matches_spec);
    RUN(test_hc_pre_bwd_fd);
    RUN(test_hc_pre_float_chunks_accumulate);
    RUN(test_hc_post);
    RUN(test_hc_head);
    RUN(test_compressor_pool_fd);
    RUN(test_compressor_block0_and_constant_scores);
    RUN(test_deterministic_across_runs_and_threads);
    TEST_MAIN_END("test_kernels_hc");
}
