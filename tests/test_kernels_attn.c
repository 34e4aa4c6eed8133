/* Sparse shared-KV attention with sinks, lightning-indexer top-k and the indexer KL loss:
 * forward against a naive dense oracle, every gradient against central finite differences (on the
 * _f64 twins), the KL value and the top-k selection against naive computations, float against
 * double, and the same bits at any thread count. */
#include "ds4/core.h"
#include "kernels/cpu/vmath.h"
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"
#include "test.h"

#include <omp.h>
#include <stdint.h>

/* ---------------------------------------------------------------- helpers */

typedef struct {
    int64_t B, T, H, c, window, ratio, Nc, K;
    int use_topk; /* CSA: a topk list; else every usable entry (HCA / dense CSA) */
} acfg;

static uint64_t lcg(uint64_t *s) {
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return *s >> 33;
}

static double *widen(const float *x, int64_t n) {
    double *y = malloc((size_t)n * sizeof(double));
    for (int64_t i = 0; i < n; i++) y[i] = x[i];
    return y;
}

static float *frand(int64_t n, unsigned seed, float amp) {
    float *x = malloc((size_t)n * sizeof(float));
    t_fill(x, n, seed, amp);
    return x;
}

static double rel_err_d(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += (a[i] - b[i]) * (a[i] - b[i]), den += b[i] * b[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

/* ‖f − d‖/‖d‖ for a float result against a double one. */
static double rel_err_fd(const float *f, const double *d, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) num += (f[i] - d[i]) * (f[i] - d[i]), den += d[i] * d[i];
    return den > 0 ? sqrt(num / den) : sqrt(num);
}

static float t_absmax(const float *x, int64_t n) {
    float m = 0;
    for (int64_t i = 0; i < n; i++) m = fabsf(x[i]) > m ? fabsf(x[i]) : m;
    return m;
}

static int64_t usable(int64_t t, int64_t ratio, int64_t Nc) {
    if (ratio <= 0) return 0;
    return (t + 1) / ratio < Nc ? (t + 1) / ratio : Nc;
}

/* Random topk rows: distinct usable ids in random slots, −1 elsewhere; some rows take fewer than
 * they could, and every 7th row is all −1. */
static void make_topk(int32_t *topk, acfg g, uint64_t seed) {
    uint64_t s = seed * 7919 + 1;
    int32_t pool[4096];
    for (int64_t bt = 0; bt < g.B * g.T; bt++) {
        int64_t t = bt % g.T, nu = usable(t, g.ratio, g.Nc);
        int32_t *row = topk + bt * g.K;
        for (int64_t k = 0; k < g.K; k++) row[k] = -1;
        int64_t m = nu < g.K ? nu : g.K;
        if (lcg(&s) % 3 == 0) m = m / 2;
        if (bt % 7 == 3) m = 0;
        for (int64_t i = 0; i < nu; i++) pool[i] = (int32_t)i;
        for (int64_t i = 0; i < m; i++) { /* partial Fisher–Yates: m distinct ids */
            int64_t j = i + (int64_t)(lcg(&s) % (uint64_t)(nu - i));
            int32_t tmp = pool[i];
            pool[i] = pool[j], pool[j] = tmp;
        }
        for (int64_t i = 0; i < m; i++) { /* into a random free slot */
            int64_t k = (int64_t)(lcg(&s) % (uint64_t)g.K);
            while (row[k] >= 0) k = (k + 1) % g.K;
            row[k] = pool[i];
        }
    }
}

/* Attention inputs in float and the same values widened to double. */
typedef struct {
    acfg g;
    double scale;
    float *q, *kv, *kvc, *sink;
    double *qd, *kvd, *kvcd, *sinkd;
    int32_t *topk; /* NULL unless g.use_topk */
} ainputs;

static ainputs ain_make(acfg g, unsigned seed) {
    ainputs a = {.g = g, .scale = 1.0 / sqrt((double)g.c)};
    int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c;
    a.q = frand(nq, seed + 1, 1.5f);
    a.kv = frand(nkv, seed + 2, 1.5f);
    a.kvc = frand(nkvc > 0 ? nkvc : 1, seed + 3, 1.5f);
    a.sink = frand(g.H, seed + 4, 1.0f);
    a.qd = widen(a.q, nq), a.kvd = widen(a.kv, nkv), a.kvcd = widen(a.kvc, nkvc > 0 ? nkvc : 1);
    a.sinkd = widen(a.sink, g.H);
    a.topk = NULL;
    if (g.use_topk) {
        a.topk = malloc((size_t)(g.B * g.T * g.K) * sizeof(int32_t));
        make_topk(a.topk, g, seed);
    }
    return a;
}

static void ain_free(ainputs *a) {
    free(a->q), free(a->kv), free(a->kvc), free(a->sink);
    free(a->qd), free(a->kvd), free(a->kvcd), free(a->sinkd), free(a->topk);
}

/* Naive dense oracle: per (b, t, h) the full logits over [T window columns | Nc compressed
 * columns | sink], masked to −inf outside the key set, one softmax; o = Σ p·key (the sink has
 * value 0). P (optional): [B, T, H, T + Nc] the probabilities of the key columns. */
static void oracle_attn(double *o, double *lse, double *P, const ainputs *a) {
    acfg g = a->g;
    int64_t ncol = g.T + g.Nc;
    double *L = malloc((size_t)(ncol + 1) * sizeof(double));
    for (int64_t b = 0; b < g.B; b++)
        for (int64_t t = 0; t < g.T; t++)
            for (int64_t h = 0; h < g.H; h++) {
                int64_t bth = (b * g.T + t) * g.H + h;
                const double *qv = a->qd + bth * g.c;
                for (int64_t j = 0; j <= ncol; j++) L[j] = -INFINITY;
                for (int64_t j = 0; j < g.T; j++) {
                    if (j > t || j < t - g.window + 1) continue;
                    double d = 0;
                    for (int64_t i = 0; i < g.c; i++) d += qv[i] * a->kvd[(b * g.T + j) * g.c + i];
                    L[j] = a->scale * d;
                }
                for (int64_t e = 0; e < g.Nc && g.ratio > 0; e++) {
                    int in = 0;
                    if (g.use_topk) {
                        for (int64_t k = 0; k < g.K; k++) in |= a->topk[(b * g.T + t) * g.K + k] == e;
                    } else {
                        in = (e + 1) * g.ratio <= t + 1;
                    }
                    if (!in) continue;
                    double d = 0;
                    for (int64_t i = 0; i < g.c; i++) d += qv[i] * a->kvcd[(b * g.Nc + e) * g.c + i];
                    L[g.T + e] = a->scale * d;
                }
                L[ncol] = a->sinkd[h];
                double m = -INFINITY, z = 0;
                for (int64_t j = 0; j <= ncol; j++) m = L[j] > m ? L[j] : m;
                for (int64_t j = 0; j <= ncol; j++) z += exp(L[j] - m);
                lse[bth] = m + log(z);
                for (int64_t i = 0; i < g.c; i++) o[bth * g.c + i] = 0;
                for (int64_t j = 0; j < ncol; j++) {
                    double p = exp(L[j] - lse[bth]);
                    if (P) P[bth * ncol + j] = p;
                    const double *key = j < g.T ? a->kvd + (b * g.T + j) * g.c : a->kvcd + (b * g.Nc + j - g.T) * g.c;
                    for (int64_t i = 0; i < g.c; i++) o[bth * g.c + i] += p * key[i];
                }
            }
    free(L);
}

#define ACFG_DIMS(g) \
    ((sparse_attn_dims){.B = (g).B, .T = (g).T, .H = (g).H, .c = (g).c, .window = (g).window, .ratio = (g).ratio, \
                        .Nc = (g).Nc, .K = (g).K})

/* The four layer kinds, with T not a multiple of r and window < T. */
static const acfg k_cfgs[] = {
    {2, 21, 5, 11, 6, 0, 0, 0, 0},   /* SWA only */
    {2, 21, 5, 11, 6, 4, 5, 3, 1},   /* CSA: topk with −1 slots */
    {2, 22, 5, 11, 6, 4, 5, 3, 0},   /* dense CSA: every usable entry */
    {2, 37, 6, 11, 16, 16, 2, 0, 0}, /* HCA-like ratio 16 */
    {1, 64, 4, 32, 16, 4, 16, 4, 1}, /* tiny-A CSA layer, vector widths exact */
};
static const char *k_names[] = {"swa", "csa-topk", "csa-dense", "hca16", "tiny-csa"};
#define N_CFGS ((int)(sizeof k_cfgs / sizeof k_cfgs[0]))

/* ---------------------------------------------------------------- (1) forward vs dense oracle */

static void test_attn_fwd_matches_dense_oracle(void) {
    for (int ci = 0; ci < N_CFGS; ci++) {
        acfg g = k_cfgs[ci];
        ainputs a = ain_make(g, 100 + ci);
        int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
        double *o_ref = malloc(no * sizeof(double)), *l_ref = malloc(nl * sizeof(double));
        oracle_attn(o_ref, l_ref, NULL, &a);
        float *o = malloc(no * sizeof(float)), *l = malloc(nl * sizeof(float));
        sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
            .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l});
        double *od = malloc(no * sizeof(double)), *ld = malloc(nl * sizeof(double));
        sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = od, .lse = ld});
        double eo = rel_err_fd(o, o_ref, no), el = rel_err_fd(l, l_ref, nl);
        double eod = rel_err_d(od, o_ref, no), eld = rel_err_d(ld, l_ref, nl);
        CHECK(eo <= 1e-6 && el <= 1e-6, "%s float: o err %.3g, lse err %.3g", k_names[ci], eo, el);
        CHECK(eod <= 1e-13 && eld <= 1e-13, "%s double: o err %.3g, lse err %.3g", k_names[ci], eod, eld);
        free(o_ref), free(l_ref), free(o), free(l), free(od), free(ld);
        ain_free(&a);
    }
}

/* With every compressed slot −1 the CSA layer is exactly SWA; with a huge negative sink the sink
 * carries no mass; a key set that is the window alone at t = 0 gives o = p·kv[0]. */
static void test_attn_fwd_edge_cases(void) {
    acfg g = {1, 9, 4, 8, 3, 4, 2, 2, 1};
    ainputs a = ain_make(g, 7);
    for (int64_t i = 0; i < g.B * g.T * g.K; i++) a.topk[i] = -1;
    int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
    double *o1 = malloc(no * sizeof(double)), *l1 = malloc(nl * sizeof(double));
    double *o2 = malloc(no * sizeof(double)), *l2 = malloc(nl * sizeof(double));
    sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
        .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = o1, .lse = l1});
    sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = {.B = g.B, .T = g.T, .H = g.H, .c = g.c, .window = g.window,
        .ratio = 0, .Nc = 0, .K = 0}, .scale = a.scale, .q = a.qd, .kv = a.kvd, .sink = a.sinkd, .o = o2, .lse = l2});
    CHECK(memcmp(o1, o2, no * sizeof(double)) == 0 && memcmp(l1, l2, nl * sizeof(double)) == 0,
          "all -1 topk differs from window-only");
    /* t = 0: keys {kv[0]} and the sink: o = kv[0]·e^s/(e^s + e^sink) */
    for (int64_t h = 0; h < g.H; h++) {
        double s = 0;
        for (int64_t i = 0; i < g.c; i++) s += a.qd[h * g.c + i] * a.kvd[i];
        s *= a.scale;
        double p = exp(s) / (exp(s) + exp(a.sinkd[h]));
        CHECK_CLOSE(o1[h * g.c + 3], p * a.kvd[3], 1e-14, 1e-300);
        CHECK_CLOSE(l1[h], log(exp(s) + exp(a.sinkd[h])), 1e-14, 1e-300);
    }
    free(o1), free(l1), free(o2), free(l2);
    ain_free(&a);
}

/* ---------------------------------------------------------------- (2) finite differences, attention */

/* f = Σ r ⊙ o of the double forward. */
static double attn_obj(const ainputs *a, const double *r, double *o, double *l) {
    acfg g = a->g;
    sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a->scale, .q = a->qd, .kv = a->kvd,
        .kvc = a->kvcd, .sink = a->sinkd, .topk = a->topk, .o = o, .lse = l});
    double f = 0;
    for (int64_t i = 0; i < g.B * g.T * g.H * g.c; i++) f += r[i] * o[i];
    return f;
}

/* Central differences of attn_obj over every element of x[0..n) (an input of a). */
static void attn_fd(double *num, double *x, int64_t n, const ainputs *a, const double *r, double *o, double *l) {
    const double h = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        double x0 = x[i];
        x[i] = x0 + h;
        double fp = attn_obj(a, r, o, l);
        x[i] = x0 - h;
        double fm = attn_obj(a, r, o, l);
        x[i] = x0;
        num[i] = (fp - fm) / (2 * h);
    }
}

static void test_attn_bwd_finite_differences(void) {
    static const acfg fd_cfgs[] = {
        {2, 13, 5, 6, 4, 0, 0, 0, 0},
        {2, 13, 5, 6, 4, 4, 3, 2, 1},
        {2, 14, 5, 6, 4, 4, 3, 2, 0},
        {1, 35, 3, 5, 8, 16, 2, 0, 0},
    };
    for (int ci = 0; ci < 4; ci++) {
        acfg g = fd_cfgs[ci];
        ainputs a = ain_make(g, 300 + ci);
        int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nl = g.B * g.T * g.H;
        float *rf = frand(nq, 900 + ci, 1.0f);
        double *r = widen(rf, nq), *o = malloc(nq * sizeof(double)), *l = malloc(nl * sizeof(double));
        double *dq = calloc(nq, sizeof(double)), *dkv = calloc(nkv, sizeof(double));
        double *dkvc = calloc(nkvc + 1, sizeof(double)), *dsink = calloc(g.H, sizeof(double));
        attn_obj(&a, r, o, l);
        sparse_attn_bwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads_f64){.dout = r,
            .dq = dq, .dkv = dkv, .dkvc = g.ratio ? dkvc : NULL, .dsink = dsink});
        double *num = malloc((size_t)(nq + nkv + nkvc + g.H) * sizeof(double));
        double *o2 = malloc(nq * sizeof(double)), *l2 = malloc(nl * sizeof(double));
        attn_fd(num, a.qd, nq, &a, r, o2, l2);
        double e = rel_err_d(dq, num, nq);
        CHECK(e <= 1e-6, "fd cfg %d: dq err %.3g", ci, e);
        attn_fd(num, a.kvd, nkv, &a, r, o2, l2);
        e = rel_err_d(dkv, num, nkv);
        CHECK(e <= 1e-6, "fd cfg %d: dkv err %.3g", ci, e);
        if (g.ratio) {
            attn_fd(num, a.kvcd, nkvc, &a, r, o2, l2);
            e = rel_err_d(dkvc, num, nkvc);
            CHECK(e <= 1e-6, "fd cfg %d: dkvc err %.3g", ci, e);
            double nrm = 0;
            for (int64_t i = 0; i < nkvc; i++) nrm += fabs(num[i]);
            CHECK(nrm > 0, "fd cfg %d: compressed entries got no gradient at all", ci);
        }
        attn_fd(num, a.sinkd, g.H, &a, r, o2, l2);
        e = rel_err_d(dsink, num, g.H);
        CHECK(e <= 1e-6, "fd cfg %d: dsink err %.3g", ci, e);
        free(rf), free(r), free(o), free(l), free(dq), free(dkv), free(dkvc), free(dsink), free(num), free(o2),
            free(l2);
        ain_free(&a);
    }
}

/* Gradients accumulate (+=) into what is there, and NULL outputs skip work without changing the
 * others (bitwise). */
static void test_attn_bwd_accumulates_and_nulls(void) {
    acfg g = k_cfgs[1];
    ainputs a = ain_make(g, 41);
    int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nl = g.B * g.T * g.H;
    float *dout = frand(nq, 42, 1.0f), *o = malloc(nq * sizeof(float)), *l = malloc(nl * sizeof(float));
    sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l});
    float *dq = calloc(nq, 4), *dkv = calloc(nkv, 4), *dkvc = calloc(nkvc, 4), *ds = calloc(g.H, 4);
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads){.dout = dout, .dq = dq,
        .dkv = dkv, .dkvc = dkvc, .dsink = ds});
    /* only dkvc */
    float *dkvc2 = calloc(nkvc, 4);
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads){.dout = dout,
        .dkvc = dkvc2});
    CHECK(memcmp(dkvc, dkvc2, nkvc * 4) == 0, "dkvc alone differs from dkvc with all gradients");
    /* only dq and dsink */
    float *dq2 = calloc(nq, 4), *ds2 = calloc(g.H, 4);
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads){.dout = dout, .dq = dq2,
        .dsink = ds2});
    CHECK(memcmp(dq, dq2, nq * 4) == 0 && memcmp(ds, ds2, g.H * 4) == 0, "dq/dsink alone differ");
    /* every output accumulates onto a prefilled gradient */
    float *b_q = frand(nq, 43, t_absmax(dq, nq)), *b_kv = frand(nkv, 44, t_absmax(dkv, nkv));
    float *b_kvc = frand(nkvc, 45, t_absmax(dkvc, nkvc)), *b_s = frand(g.H, 46, t_absmax(ds, g.H));
    float *aq = malloc(nq * 4), *akv = malloc(nkv * 4), *akvc = malloc(nkvc * 4), *as = malloc(g.H * 4);
    memcpy(aq, b_q, nq * 4), memcpy(akv, b_kv, nkv * 4), memcpy(akvc, b_kvc, nkvc * 4), memcpy(as, b_s, g.H * 4);
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads){.dout = dout, .dq = aq,
        .dkv = akv, .dkvc = akvc, .dsink = as});
    const float *acc[4] = {aq, akv, akvc, as}, *base[4] = {b_q, b_kv, b_kvc, b_s}, *fresh[4] = {dq, dkv, dkvc, ds};
    int64_t cnt[4] = {nq, nkv, nkvc, g.H};
    for (int k = 0; k < 4; k++) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < cnt[k]; i++) {
            double d = (double)acc[k][i] - base[k][i] - fresh[k][i];
            num += d * d, den += (double)fresh[k][i] * fresh[k][i];
        }
        CHECK(den > 0 && sqrt(num / den) < 1e-5, "gradient %d does not accumulate: err %.3g", k, sqrt(num / den));
    }
    free(b_q), free(b_kv), free(b_kvc), free(b_s), free(aq), free(akv), free(akvc), free(as);
    free(dout), free(o), free(l), free(dq), free(dkv), free(dkvc), free(ds), free(dkvc2), free(dq2), free(ds2);
    ain_free(&a);
}

/* ---------------------------------------------------------------- indexer inputs and naive oracles */

typedef struct {
    int64_t HI, dI;
    double wscale;
    float *qi, *ki, *w;
    double *qid, *kid, *wd;
} iinputs;

static iinputs iin_make(acfg g, int64_t HI, int64_t dI, unsigned seed) {
    iinputs x = {.HI = HI, .dI = dI, .wscale = 1.0 / sqrt((double)(HI * dI))};
    int64_t nq = g.B * g.T * HI * dI, nk = g.B * g.Nc * dI, nw = g.B * g.T * HI;
    x.qi = frand(nq, seed + 11, 1.0f), x.ki = frand(nk, seed + 12, 1.0f), x.w = frand(nw, seed + 13, 1.0f);
    x.qid = widen(x.qi, nq), x.kid = widen(x.ki, nk), x.wd = widen(x.w, nw);
    return x;
}

static void iin_free(iinputs *x) { free(x->qi), free(x->ki), free(x->w), free(x->qid), free(x->kid), free(x->wd); }

/* I[b, t, s] in double, straight from the definition. */
static double naive_score(const iinputs *x, acfg g, int64_t bt, int64_t s) {
    int64_t b = bt / g.T;
    double I = 0;
    for (int64_t h = 0; h < x->HI; h++) {
        double d = 0;
        const double *qv = x->qid + (bt * x->HI + h) * x->dI, *kv = x->kid + (b * g.Nc + s) * x->dI;
        for (int64_t i = 0; i < x->dI; i++) d += qv[i] * kv[i];
        I += x->wscale * x->wd[bt * x->HI + h] * (d > 0 ? d : 0);
    }
    return I;
}

/* Full-score stable sort (descending score, ties to the lower index), first K, ascending, −1 pad.
 * Counts the rows where the K-th and (K+1)-th scores tie (*ties). */
static void naive_topk(int32_t *out, const iinputs *x, acfg g, int *ties) {
    double *I = malloc((size_t)g.Nc * sizeof(double));
    int32_t *idx = malloc((size_t)g.Nc * sizeof(int32_t));
    for (int64_t bt = 0; bt < g.B * g.T; bt++) {
        int64_t nu = usable(bt % g.T, g.ratio, g.Nc);
        for (int64_t s = 0; s < nu; s++) I[s] = naive_score(x, g, bt, s), idx[s] = (int32_t)s;
        for (int64_t i = 1; i < nu; i++) /* insertion sort: stable */
            for (int64_t j = i; j > 0 && I[idx[j]] > I[idx[j - 1]]; j--) {
                int32_t tmp = idx[j];
                idx[j] = idx[j - 1], idx[j - 1] = tmp;
            }
        if (nu > g.K && I[idx[g.K - 1]] == I[idx[g.K]]) (*ties)++;
        int64_t m = nu < g.K ? nu : g.K;
        for (int64_t i = 1; i < m; i++) /* selected ids ascending */
            for (int64_t j = i; j > 0 && idx[j] < idx[j - 1]; j--) {
                int32_t tmp = idx[j];
                idx[j] = idx[j - 1], idx[j - 1] = tmp;
            }
        for (int64_t k = 0; k < g.K; k++) out[bt * g.K + k] = k < m ? idx[k] : -1;
    }
    free(I), free(idx);
}

/* KL of the contract, from the oracle's probabilities P [B, T, H, T + Nc]. */
static double naive_kl(int64_t *nrows, const double *P, const iinputs *x, const int32_t *topk, acfg g) {
    int64_t ncol = g.T + g.Nc;
    double kl = 0, *p = malloc(g.Nc * sizeof(double)), *I = malloc(g.Nc * sizeof(double));
    int32_t *S = malloc(g.Nc * sizeof(int32_t));
    *nrows = 0;
    for (int64_t bt = 0; bt < g.B * g.T; bt++) {
        int64_t n = 0;
        if (topk) {
            for (int64_t k = 0; k < g.K; k++)
                if (topk[bt * g.K + k] >= 0) S[n++] = topk[bt * g.K + k];
        } else {
            for (int64_t s = 0; s < usable(bt % g.T, g.ratio, g.Nc); s++) S[n++] = (int32_t)s;
        }
        if (n == 0) continue;
        double z = 0, m = -INFINITY, zs = 0;
        for (int64_t j = 0; j < n; j++) {
            p[j] = 0;
            for (int64_t h = 0; h < g.H; h++) p[j] += P[(bt * g.H + h) * ncol + g.T + S[j]];
            z += p[j];
            I[j] = naive_score(x, g, bt, S[j]);
            m = I[j] > m ? I[j] : m;
        }
        for (int64_t j = 0; j < n; j++) zs += exp(I[j] - m);
        for (int64_t j = 0; j < n; j++) {
            double pj = p[j] / z, lq = I[j] - m - log(zs);
            if (pj > 0) kl += pj * (log(pj) - lq);
        }
        (*nrows)++;
    }
    free(p), free(I), free(S);
    return kl;
}

/* ---------------------------------------------------------------- (3) KL value */

static void test_indexer_kl_matches_naive(void) {
    static const acfg cfgs[] = {{2, 29, 3, 7, 5, 4, 7, 3, 1}, {2, 29, 3, 7, 5, 4, 7, 0, 0}};
    for (int ci = 0; ci < 2; ci++) {
        acfg g = cfgs[ci];
        ainputs a = ain_make(g, 500 + ci);
        iinputs x = iin_make(g, 6, 9, 600 + ci);
        int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
        double *o = malloc(no * sizeof(double)), *l = malloc(nl * sizeof(double));
        double *P = malloc((size_t)(nl * (g.T + g.Nc)) * sizeof(double));
        oracle_attn(o, l, P, &a);
        int64_t nref;
        double kl_ref = naive_kl(&nref, P, &x, a.topk, g);
        /* double kernel, with the kernel's own lse */
        double *od = malloc(no * sizeof(double)), *ld = malloc(nl * sizeof(double));
        sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = od, .lse = ld});
        double kl;
        int64_t nrows;
        indexer_kl_fwd_bwd_f64(&(indexer_kl_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = a.scale, .wscale = x.wscale, .grad_scale = 1.0,
            .qi = x.qid, .ki = x.kid, .w = x.wd, .q = a.qd, .kvc = a.kvcd, .lse = ld, .topk = a.topk, .kl_sum = &kl,
            .n_rows = &nrows});
        CHECK(nrows == nref, "cfg %d: rows %lld vs %lld", ci, (long long)nrows, (long long)nref);
        CHECK_CLOSE(kl, kl_ref, 1e-12, 1e-300);
        CHECK(kl_ref > 1e-3, "cfg %d: KL %.3g too small to test anything", ci, kl_ref);
        /* rows skipped: those with no usable entry, and (topk) the all −1 rows */
        int64_t expect = 0;
        for (int64_t bt = 0; bt < g.B * g.T; bt++) {
            int any = 0;
            if (a.topk)
                for (int64_t k = 0; k < g.K; k++) any |= a.topk[bt * g.K + k] >= 0;
            else
                any = usable(bt % g.T, g.ratio, g.Nc) > 0;
            expect += any;
        }
        CHECK(nrows == expect && nrows < g.B * g.T, "cfg %d: %lld rows counted, expected %lld", ci,
              (long long)nrows, (long long)expect);
        /* float kernel */
        float *of = malloc(no * sizeof(float)), *lf = malloc(nl * sizeof(float));
        sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
            .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = of, .lse = lf});
        double klf;
        int64_t nf;
        indexer_kl_fwd_bwd(CPU_EXEC, &(indexer_kl_args){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = (float)a.scale, .wscale = (float)x.wscale,
            .grad_scale = 1.0f, .qi = x.qi, .ki = x.ki, .w = x.w, .q = a.q, .kvc = a.kvc, .lse = lf, .topk = a.topk,
            .kl_sum = &klf, .n_rows = &nf});
        CHECK(nf == nref);
        CHECK_CLOSE(klf, kl_ref, 1e-5, 1e-300);
        free(o), free(l), free(P), free(od), free(ld), free(of), free(lf);
        ain_free(&a), iin_free(&x);
    }
}


/* KL gradients accumulate (+=), NULL outputs change nothing else (bitwise), the loss does not
 * depend on grad_scale or on which gradients are asked for. */
static void test_indexer_kl_accumulates_and_nulls(void) {
    acfg g = {2, 29, 3, 7, 5, 4, 7, 3, 1};
    ainputs a = ain_make(g, 510);
    iinputs x = iin_make(g, 6, 9, 610);
    int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
    int64_t nqi = g.B * g.T * x.HI * x.dI, nki = g.B * g.Nc * x.dI, nw = g.B * g.T * x.HI;
    float *o = malloc(no * 4), *l = malloc(nl * 4);
    sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
        .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l});
    float *dqi = calloc(nqi, 4), *dki = calloc(nki, 4), *dw = calloc(nw, 4);
    double kl0, kl1, kl2;
    int64_t n0, n1, n2;
#define KL_CALL(kl, n, a1, a2, a3, gs)                                                                             \
    indexer_kl_fwd_bwd(CPU_EXEC, &(indexer_kl_args){                                                                         \
        .dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc, .ratio = g.ratio, .K = g.K}, .H = g.H,    \
        .c = g.c, .scale = (float)a.scale, .wscale = (float)x.wscale, .grad_scale = gs, .qi = x.qi, .ki = x.ki,    \
        .w = x.w, .q = a.q, .kvc = a.kvc, .lse = l, .topk = a.topk, .dqi = a1, .dki = a2, .dw = a3, .kl_sum = &kl, \
        .n_rows = &n})
    KL_CALL(kl0, n0, dqi, dki, dw, 0.25f);
    KL_CALL(kl1, n1, NULL, NULL, NULL, 1.0f);
    CHECK(kl0 == kl1 && n0 == n1, "loss depends on the gradient request");
    float *dki2 = calloc(nki, 4);
    KL_CALL(kl2, n2, NULL, dki2, NULL, 0.25f);
    CHECK(memcmp(dki, dki2, nki * 4) == 0, "dki alone differs");
    float *dqi2 = calloc(nqi, 4), *dw2 = calloc(nw, 4);
    KL_CALL(kl2, n2, dqi2, NULL, dw2, 0.25f);
    CHECK(memcmp(dqi, dqi2, nqi * 4) == 0 && memcmp(dw, dw2, nw * 4) == 0, "dqi/dw alone differ");
    /* prefill of the gradients' own size, so the check is not float cancellation */
    float *b_q = frand(nqi, 47, t_absmax(dqi, nqi)), *b_k = frand(nki, 48, t_absmax(dki, nki));
    float *b_w = frand(nw, 49, t_absmax(dw, nw));
    float *aq = malloc(nqi * 4), *ak = malloc(nki * 4), *aw = malloc(nw * 4);
    memcpy(aq, b_q, nqi * 4), memcpy(ak, b_k, nki * 4), memcpy(aw, b_w, nw * 4);
    KL_CALL(kl2, n2, aq, ak, aw, 0.25f);
#undef KL_CALL
    const float *acc[3] = {aq, ak, aw}, *base[3] = {b_q, b_k, b_w}, *fresh[3] = {dqi, dki, dw};
    int64_t cnt[3] = {nqi, nki, nw};
    for (int k = 0; k < 3; k++) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < cnt[k]; i++) {
            double d = (double)acc[k][i] - base[k][i] - fresh[k][i];
            num += d * d, den += (double)fresh[k][i] * fresh[k][i];
        }
        CHECK(den > 0 && sqrt(num / den) < 1e-5, "kl gradient %d does not accumulate: err %.3g", k, sqrt(num / den));
    }
    free(o), free(l), free(dqi), free(dki), free(dw), free(dki2), free(dqi2), free(dw2);
    free(b_q), free(b_k), free(b_w), free(aq), free(ak), free(aw);
    ain_free(&a), iin_free(&x);
}

/* Teacher terms that are exactly 0 contribute 0 (not 0·log 0 = NaN): one huge compressed entry
 * takes all the mass of the rows that like it and none of the others'. */
static void test_indexer_kl_zero_teacher_terms(void) {
    acfg g = {1, 29, 3, 7, 5, 4, 7, 0, 0};
    ainputs a = ain_make(g, 520);
    iinputs x = iin_make(g, 6, 9, 620);
    for (int64_t i = 0; i < g.c; i++) a.kvcd[1 * g.c + i] *= 3000;
    int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H, ncol = g.T + g.Nc;
    double *o = malloc(no * 8), *l = malloc(nl * 8), *P = malloc(nl * ncol * 8);
    oracle_attn(o, l, P, &a);
    int64_t zeros = 0;
    for (int64_t bt = 0; bt < g.B * g.T; bt++)
        for (int64_t e = 0; e < usable(bt % g.T, g.ratio, g.Nc); e++) {
            double p = 0;
            for (int64_t h = 0; h < g.H; h++) p += P[(bt * g.H + h) * ncol + g.T + e];
            zeros += p == 0;
        }
    CHECK(zeros > 3, "only %lld zero teacher terms", (long long)zeros);
    int64_t nref, n;
    double kl_ref = naive_kl(&nref, P, &x, NULL, g), kl;
    sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
        .kvc = a.kvcd, .sink = a.sinkd, .o = o, .lse = l});
    double *dqi = calloc(g.T * x.HI * x.dI, 8), *dki = calloc(g.Nc * x.dI, 8), *dw = calloc(g.T * x.HI, 8);
    indexer_kl_fwd_bwd_f64(&(indexer_kl_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = a.scale, .wscale = x.wscale, .grad_scale = 1.0,
        .qi = x.qid, .ki = x.kid, .w = x.wd, .q = a.qd, .kvc = a.kvcd, .lse = l, .dqi = dqi, .dki = dki, .dw = dw,
        .kl_sum = &kl, .n_rows = &n});
    CHECK(isfinite(kl) && n == nref);
    CHECK_CLOSE(kl, kl_ref, 1e-12, 1e-300);
    int finite = 1;
    for (int64_t i = 0; i < g.T * x.HI * x.dI; i++) finite &= isfinite(dqi[i]);
    for (int64_t i = 0; i < g.Nc * x.dI; i++) finite &= isfinite(dki[i]);
    CHECK(finite, "non-finite gradient");
    free(o), free(l), free(P), free(dqi), free(dki), free(dw);
    ain_free(&a), iin_free(&x);
}

/* ---------------------------------------------------------------- (2) finite differences, indexer KL */

static double kl_obj(const iinputs *x, const ainputs *a, const double *lse) {
    acfg g = a->g;
    double kl;
    int64_t n;
    indexer_kl_fwd_bwd_f64(&(indexer_kl_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x->HI, .dI = x->dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = a->scale, .wscale = x->wscale, .grad_scale = 1.0,
        .qi = x->qid, .ki = x->kid, .w = x->wd, .q = a->qd, .kvc = a->kvcd, .lse = lse, .topk = a->topk, .kl_sum = &kl,
        .n_rows = &n});
    return kl;
}

static void kl_fd(double *num, double *v, int64_t n, const iinputs *x, const ainputs *a, const double *lse,
                  double gs) {
    const double h = 1e-6;
    for (int64_t i = 0; i < n; i++) {
        double v0 = v[i];
        v[i] = v0 + h;
        double fp = kl_obj(x, a, lse);
        v[i] = v0 - h;
        double fm = kl_obj(x, a, lse);
        v[i] = v0;
        num[i] = gs * (fp - fm) / (2 * h);
    }
}

static void test_indexer_kl_finite_differences(void) {
    static const acfg cfgs[] = {{2, 19, 3, 5, 4, 4, 4, 2, 1}, {2, 19, 3, 5, 4, 4, 4, 0, 0}};
    const double gs = 0.37;
    for (int ci = 0; ci < 2; ci++) {
        acfg g = cfgs[ci];
        ainputs a = ain_make(g, 700 + ci);
        iinputs x = iin_make(g, 5, 6, 800 + ci);
        int64_t no = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H;
        int64_t nqi = g.B * g.T * x.HI * x.dI, nki = g.B * g.Nc * x.dI, nw = g.B * g.T * x.HI;
        double *o = malloc(no * sizeof(double)), *l = malloc(nl * sizeof(double));
        sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = o, .lse = l});
        double *dqi = calloc(nqi, 8), *dki = calloc(nki, 8), *dw = calloc(nw, 8), kl;
        int64_t nrows;
        indexer_kl_fwd_bwd_f64(&(indexer_kl_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = a.scale, .wscale = x.wscale, .grad_scale = gs,
            .qi = x.qid, .ki = x.kid, .w = x.wd, .q = a.qd, .kvc = a.kvcd, .lse = l, .topk = a.topk, .dqi = dqi,
            .dki = dki, .dw = dw, .kl_sum = &kl, .n_rows = &nrows});
        CHECK_CLOSE(kl, kl_obj(&x, &a, l), 0, 1e-300); /* grad_scale and gradients do not change the loss */
        double *num = malloc((size_t)(nqi + nki + nw) * sizeof(double));
        kl_fd(num, x.qid, nqi, &x, &a, l, gs);
        double e = rel_err_d(dqi, num, nqi);
        CHECK(e <= 1e-6, "kl fd cfg %d: dqi err %.3g", ci, e);
        kl_fd(num, x.kid, nki, &x, &a, l, gs);
        e = rel_err_d(dki, num, nki);
        CHECK(e <= 1e-6, "kl fd cfg %d: dki err %.3g", ci, e);
        kl_fd(num, x.wd, nw, &x, &a, l, gs);
        e = rel_err_d(dw, num, nw);
        CHECK(e <= 1e-6, "kl fd cfg %d: dw err %.3g", ci, e);
        double nrm = 0;
        for (int64_t i = 0; i < nw; i++) nrm += fabs(dw[i]);
        CHECK(nrm > 1e-6, "kl fd cfg %d: dw is zero", ci);
        free(o), free(l), free(dqi), free(dki), free(dw), free(num);
        ain_free(&a), iin_free(&x);
    }
}

/* ---------------------------------------------------------------- (4) top-k */

static void test_indexer_topk_matches_naive_sort(void) {
    /* (a) small integer-valued inputs: every score is exact in float and double, with many exact
     * ties (few distinct key rows, ReLU zeros, and one row whose query is all zero) */
    acfg g = {2, 50, 1, 1, 1, 4, 12, 5, 1};
    iinputs x = iin_make(g, 3, 3, 77);
    uint64_t s = 99;
    int64_t nq = g.B * g.T * x.HI * x.dI, nk = g.B * g.Nc * x.dI, nw = g.B * g.T * x.HI;
    for (int64_t i = 0; i < nq; i++) x.qi[i] = (float)((int)(lcg(&s) % 3) - 1);
    for (int64_t i = 0; i < nk; i++) x.ki[i] = (float)((int)(lcg(&s) % 3) - 1);
    for (int64_t i = 0; i < nw; i++) x.w[i] = 0.5f * (float)((int)(lcg(&s) % 5) - 1);
    int64_t zrow = 47; /* b = 0, t = 47: I = 0 for every entry → ids 0..K-1 */
    for (int64_t i = 0; i < x.HI * x.dI; i++) x.qi[zrow * x.HI * x.dI + i] = 0;
    x.wscale = 0.25;
    for (int64_t i = 0; i < nq; i++) x.qid[i] = x.qi[i];
    for (int64_t i = 0; i < nk; i++) x.kid[i] = x.ki[i];
    for (int64_t i = 0; i < nw; i++) x.wd[i] = x.w[i];
    int32_t *ref = malloc(g.B * g.T * g.K * 4), *got = malloc(g.B * g.T * g.K * 4), *gotd = malloc(g.B * g.T * g.K * 4);
    int ties = 0;
    naive_topk(ref, &x, g, &ties);
    indexer_topk_fwd(CPU_EXEC, &(indexer_topk_args){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .wscale = (float)x.wscale, .qi = x.qi, .ki = x.ki, .w = x.w, .topk = got});
    indexer_topk_fwd_f64(&(indexer_topk_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .wscale = x.wscale, .qi = x.qid, .ki = x.kid, .w = x.wd, .topk = gotd});
    CHECK(ties > 5, "only %d rows with a tie at the K-th place", ties);
    CHECK(memcmp(ref, got, g.B * g.T * g.K * 4) == 0, "float top-k differs from the naive sort");
    CHECK(memcmp(ref, gotd, g.B * g.T * g.K * 4) == 0, "double top-k differs from the naive sort");
    for (int64_t k = 0; k < g.K; k++)
        CHECK(got[zrow * g.K + k] == k, "all-tied row slot %lld = %d", (long long)k, got[zrow * g.K + k]);
    /* short rows: t = 9 has (9+1)/4 = 2 usable entries → 0, 1, −1, −1, −1 */
    CHECK(got[9 * g.K + 0] == 0 && got[9 * g.K + 1] == 1 && got[9 * g.K + 2] == -1 && got[9 * g.K + 4] == -1);
    CHECK(got[0] == -1 && got[g.K - 1] == -1, "t = 0 has no usable entry");
    iin_free(&x);
    free(ref), free(got), free(gotd);

    /* (b) random real-valued inputs, Nc smaller than the usable count of late rows */
    acfg g2 = {2, 70, 1, 1, 1, 4, 15, 6, 1};
    iinputs y = iin_make(g2, 5, 7, 78);
    size_t nb = (size_t)(g2.B * g2.T * g2.K) * 4;
    int32_t *r2 = malloc(nb), *f2 = malloc(nb), *d2 = malloc(nb);
    ties = 0;
    naive_topk(r2, &y, g2, &ties);
    indexer_topk_fwd(CPU_EXEC, &(indexer_topk_args){.dims = {.B = g2.B, .T = g2.T, .HI = y.HI, .dI = y.dI, .Nc = g2.Nc,
        .ratio = g2.ratio, .K = g2.K}, .wscale = (float)y.wscale, .qi = y.qi, .ki = y.ki, .w = y.w, .topk = f2});
    indexer_topk_fwd_f64(&(indexer_topk_args_f64){.dims = {.B = g2.B, .T = g2.T, .HI = y.HI, .dI = y.dI, .Nc = g2.Nc,
        .ratio = g2.ratio, .K = g2.K}, .wscale = y.wscale, .qi = y.qid, .ki = y.kid, .w = y.wd, .topk = d2});
    CHECK(memcmp(r2, f2, nb) == 0, "float top-k differs from the naive sort (random)");
    CHECK(memcmp(r2, d2, nb) == 0, "double top-k differs from the naive sort (random)");
    iin_free(&y);
    free(r2), free(f2), free(d2);
}

/* ---------------------------------------------------------------- (5) float vs double */

static void test_float_matches_double(void) {
    for (int ci = 1; ci < N_CFGS; ci++) {
        acfg g = k_cfgs[ci];
        ainputs a = ain_make(g, 1000 + ci);
        iinputs x = iin_make(g, 6, 10, 1100 + ci);
        int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nl = g.B * g.T * g.H;
        int64_t nqi = g.B * g.T * x.HI * x.dI, nki = g.B * g.Nc * x.dI, nw = g.B * g.T * x.HI;
        float *dout = frand(nq, 1200 + ci, 1.0f);
        double *doutd = widen(dout, nq);
        float *o = malloc(nq * 4), *l = malloc(nl * 4);
        double *od = malloc(nq * 8), *ld = malloc(nl * 8);
        sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
            .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l});
        sparse_attn_fwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = od, .lse = ld});
        float *dq = calloc(nq, 4), *dkv = calloc(nkv, 4), *dkvc = calloc(nkvc, 4), *ds = calloc(g.H, 4);
        double *dqd = calloc(nq, 8), *dkvd = calloc(nkv, 8), *dkvcd = calloc(nkvc, 8), *dsd = calloc(g.H, 8);
        sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a.scale, .q = a.q, .kv = a.kv,
            .kvc = a.kvc, .sink = a.sink, .topk = a.topk, .o = o, .lse = l}, &(sparse_attn_grads){.dout = dout,
            .dq = dq, .dkv = dkv, .dkvc = dkvc, .dsink = ds});
        sparse_attn_bwd_f64(&(sparse_attn_args_f64){.dims = ACFG_DIMS(g), .scale = a.scale, .q = a.qd, .kv = a.kvd,
            .kvc = a.kvcd, .sink = a.sinkd, .topk = a.topk, .o = od, .lse = ld}, &(sparse_attn_grads_f64){.dout = doutd,
            .dq = dqd, .dkv = dkvd, .dkvc = dkvcd, .dsink = dsd});
        double e[4] = {rel_err_fd(dq, dqd, nq), rel_err_fd(dkv, dkvd, nkv), rel_err_fd(dkvc, dkvcd, nkvc),
                       rel_err_fd(ds, dsd, g.H)};
        for (int i = 0; i < 4; i++) CHECK(e[i] <= 1e-5, "%s: attn grad %d float vs double %.3g", k_names[ci], i, e[i]);
        /* indexer KL on this layer's lse (topk of the config, or dense) */
        float *dqi = calloc(nqi, 4), *dki = calloc(nki, 4), *dw = calloc(nw, 4);
        double *dqid = calloc(nqi, 8), *dkid = calloc(nki, 8), *dwd = calloc(nw, 8), kl, kld;
        int64_t n1, n2;
        indexer_kl_fwd_bwd(CPU_EXEC, &(indexer_kl_args){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = (float)a.scale, .wscale = (float)x.wscale,
            .grad_scale = 0.5f, .qi = x.qi, .ki = x.ki, .w = x.w, .q = a.q, .kvc = a.kvc, .lse = l, .topk = a.topk,
            .dqi = dqi, .dki = dki, .dw = dw, .kl_sum = &kl, .n_rows = &n1});
        indexer_kl_fwd_bwd_f64(&(indexer_kl_args_f64){.dims = {.B = g.B, .T = g.T, .HI = x.HI, .dI = x.dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = a.scale, .wscale = x.wscale, .grad_scale = 0.5,
            .qi = x.qid, .ki = x.kid, .w = x.wd, .q = a.qd, .kvc = a.kvcd, .lse = ld, .topk = a.topk, .dqi = dqid,
            .dki = dkid, .dw = dwd, .kl_sum = &kld, .n_rows = &n2});
        CHECK(n1 == n2 && n1 > 0);
        CHECK_CLOSE(kl, kld, 1e-5, 1e-300);
        double ei[3] = {rel_err_fd(dqi, dqid, nqi), rel_err_fd(dki, dkid, nki), rel_err_fd(dw, dwd, nw)};
        for (int i = 0; i < 3; i++) CHECK(ei[i] <= 1e-5, "%s: kl grad %d float vs double %.3g", k_names[ci], i, ei[i]);
        free(dout), free(doutd), free(o), free(l), free(od), free(ld), free(dq), free(dkv), free(dkvc), free(ds);
        free(dqd), free(dkvd), free(dkvcd), free(dsd), free(dqi), free(dki), free(dw), free(dqid), free(dkid),
            free(dwd);
        ain_free(&a), iin_free(&x);
    }
}

/* ---------------------------------------------------------------- (6) determinism */

typedef struct {
    int32_t *topk;
    float *o, *l, *dq, *dkv, *dkvc, *ds, *dqi, *dki, *dw;
    double kl;
    int64_t n;
} pipe_out;

/* bf16 bits of x [n] (rounded by the activations' rounding), malloc'd. */
static uint16_t *bf16_bits(const float *x, int64_t n) {
    uint16_t *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    for (int64_t i = 0; i < n; i++) h[i] = gemm_bf16_bits(x[i]);
    return h;
}

/* Indexer top-k → attention forward/backward → indexer KL, at a given thread count. bf16: the keys (kv,
 * kvc, ki) are passed as bf16 bits of their values (which the caller has rounded), the fp32 ones not at all. */
static pipe_out run_pipeline_keys(const ainputs *a, const iinputs *x, int threads, bool bf16) {
    acfg g = a->g;
    int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nl = g.B * g.T * g.H;
    int64_t nqi = g.B * g.T * x->HI * x->dI, nki = g.B * g.Nc * x->dI, nw = g.B * g.T * x->HI;
    uint16_t *kv16 = bf16 ? bf16_bits(a->kv, nkv) : NULL, *kvc16 = bf16 ? bf16_bits(a->kvc, nkvc) : NULL;
    uint16_t *ki16 = bf16 ? bf16_bits(x->ki, nki) : NULL;
    const float *kv = bf16 ? NULL : a->kv, *kvc = bf16 ? NULL : a->kvc, *ki = bf16 ? NULL : x->ki;
    int saved = omp_get_max_threads();
    omp_set_num_threads(threads);
    pipe_out r = {0};
    r.topk = g.use_topk ? malloc(g.B * g.T * g.K * 4) : NULL;
    if (r.topk)
        indexer_topk_fwd(CPU_EXEC, &(indexer_topk_args){.dims = {.B = g.B, .T = g.T, .HI = x->HI, .dI = x->dI, .Nc = g.Nc,
            .ratio = g.ratio, .K = g.K}, .wscale = (float)x->wscale, .qi = x->qi, .ki = ki, .ki16 = ki16, .w = x->w,
            .topk = r.topk});
    r.o = malloc(nq * 4), r.l = malloc(nl * 4);
    sparse_attn_fwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a->scale, .q = a->q, .kv = kv,
        .kvc = kvc, .kv16 = kv16, .kvc16 = kvc16, .sink = a->sink, .topk = r.topk, .o = r.o, .lse = r.l});
    r.dq = calloc(nq, 4), r.dkv = calloc(nkv, 4), r.dkvc = calloc(nkvc, 4), r.ds = calloc(g.H, 4);
    sparse_attn_bwd(CPU_EXEC, &(sparse_attn_args){.dims = ACFG_DIMS(g), .scale = (float)a->scale, .q = a->q, .kv = kv,
        .kvc = kvc, .kv16 = kv16, .kvc16 = kvc16, .sink = a->sink, .topk = r.topk, .o = r.o, .lse = r.l},
        &(sparse_attn_grads){.dout = a->q /* any dO */, .dq = r.dq, .dkv = r.dkv, .dkvc = r.dkvc, .dsink = r.ds});
    r.dqi = calloc(nqi, 4), r.dki = calloc(nki, 4), r.dw = calloc(nw, 4);
    indexer_kl_fwd_bwd(CPU_EXEC, &(indexer_kl_args){.dims = {.B = g.B, .T = g.T, .HI = x->HI, .dI = x->dI, .Nc = g.Nc,
        .ratio = g.ratio, .K = g.K}, .H = g.H, .c = g.c, .scale = (float)a->scale, .wscale = (float)x->wscale,
        .grad_scale = 0.01f, .qi = x->qi, .ki = ki, .ki16 = ki16, .w = x->w, .q = a->q, .kvc = kvc, .kvc16 = kvc16,
        .lse = r.l, .topk = r.topk, .dqi = r.dqi, .dki = r.dki, .dw = r.dw, .kl_sum = &r.kl, .n_rows = &r.n});
    omp_set_num_threads(saved);
    free(kv16), free(kvc16), free(ki16);
    return r;
}

static pipe_out run_pipeline(const ainputs *a, const iinputs *x, int threads) {
    return run_pipeline_keys(a, x, threads, false);
}

static void pipe_free(pipe_out *r) {
    free(r->topk), free(r->o), free(r->l), free(r->dq), free(r->dkv), free(r->dkvc), free(r->ds), free(r->dqi),
        free(r->dki), free(r->dw);
}

static int pipe_same(const pipe_out *a, const pipe_out *b, acfg g, const iinputs *x) {
    int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nl = g.B * g.T * g.H;
    int64_t nqi = g.B * g.T * x->HI * x->dI, nki = g.B * g.Nc * x->dI, nw = g.B * g.T * x->HI;
    return (!a->topk || memcmp(a->topk, b->topk, g.B * g.T * g.K * 4) == 0) && memcmp(a->o, b->o, nq * 4) == 0 &&
           memcmp(a->l, b->l, nl * 4) == 0 && memcmp(a->dq, b->dq, nq * 4) == 0 &&
           memcmp(a->dkv, b->dkv, nkv * 4) == 0 && memcmp(a->dkvc, b->dkvc, nkvc * 4) == 0 &&
           memcmp(a->ds, b->ds, g.H * 4) == 0 && memcmp(a->dqi, b->dqi, nqi * 4) == 0 &&
           memcmp(a->dki, b->dki, nki * 4) == 0 && memcmp(a->dw, b->dw, nw * 4) == 0 &&
           memcmp(&a->kl, &b->kl, sizeof a->kl) == 0 && a->n == b->n;
}

/* Every output, gradients and the KL included, has the same bits at 1, 2, 3 and 5 threads: the key and
 * indexer-key gradients are summed over fixed blocks of queries in block order. The shapes cover B > 1,
 * T not a multiple of the block, a window longer than a block and one longer than T, HCA without top-k. */
static void test_determinism_threads(void) {
    static const acfg cfgs[] = {{2, 64, 4, 32, 16, 4, 16, 4, 1},
                                {2, 64, 4, 32, 16, 4, 16, 0, 0},
                                {3, 50, 4, 32, 40, 4, 12, 4, 1},
                                {2, 40, 4, 16, 64, 16, 2, 0, 0}};
    static const int counts[] = {2, 3, 5};
    for (int ci = 0; ci < (int)(sizeof cfgs / sizeof cfgs[0]); ci++) {
        acfg g = cfgs[ci];
        ainputs a = ain_make(g, 1300 + ci);
        iinputs x = iin_make(g, 4, 16, 1400 + ci);
        pipe_out r1 = run_pipeline(&a, &x, 1), r1b = run_pipeline(&a, &x, 1);
        CHECK(pipe_same(&r1, &r1b, g, &x), "cfg %d: 1 thread not bitwise repeatable", ci);
        CHECK(r1.n > 0, "cfg %d: no KL row scored", ci);
        for (int k = 0; k < 3; k++) {
            pipe_out r = run_pipeline(&a, &x, counts[k]);
            CHECK(pipe_same(&r, &r1, g, &x), "cfg %d: %d threads differ from 1", ci, counts[k]);
            pipe_free(&r);
        }
        pipe_free(&r1), pipe_free(&r1b);
        ain_free(&a), iin_free(&x);
    }
}

/* Mixed precision: attention, the indexer top-k and the indexer KL reading bf16 keys give the bits of the
 * same kernels reading fp32 keys that hold the same (rounded) values: outputs, lse, top-k, KL and every
 * gradient, forward and backward. Shapes: the layer kinds of k_cfgs (head dims 11 and 32, so the scalar
 * tails and a last block of fewer than 4 heads run), the determinism shapes, indexer dims 5 and 16; 1 and
 * 3 threads. A sanity check that the inputs were not already bf16: unrounded keys give other bits. */
static void test_bf16_keys_match_rounded_fp32(void) {
    static const acfg extra[] = {{2, 64, 4, 32, 16, 4, 16, 4, 1}, {3, 50, 4, 32, 40, 4, 12, 4, 1},
                                 {2, 40, 4, 16, 64, 16, 2, 0, 0}};
    const int ncfg = N_CFGS + (int)(sizeof extra / sizeof extra[0]);
    for (int ci = 0; ci < ncfg; ci++) {
        acfg g = ci < N_CFGS ? k_cfgs[ci] : extra[ci - N_CFGS];
        ainputs a = ain_make(g, 1600 + ci);
        iinputs x = iin_make(g, ci % 2 ? 3 : 4, ci % 2 ? 5 : 16, 1700 + ci);
        int64_t nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c, nki = g.B * g.Nc * x.dI;
        pipe_out raw = run_pipeline(&a, &x, 1);
        tensor_round_bf16(CPU_EXEC, a.kv, nkv), tensor_round_bf16(CPU_EXEC, a.kvc, nkvc), tensor_round_bf16(CPU_EXEC, x.ki, nki);
        for (int th = 1; th <= 3; th += 2) {
            pipe_out f = run_pipeline_keys(&a, &x, th, false), h = run_pipeline_keys(&a, &x, th, true);
            CHECK(pipe_same(&h, &f, g, &x), "%d: bf16 keys differ from rounded fp32 keys (%d threads)", ci, th);
            if (th == 1) CHECK(!pipe_same(&raw, &f, g, &x), "%d: rounding the keys changed nothing", ci);
            pipe_free(&f), pipe_free(&h);
        }
        pipe_free(&raw);
        ain_free(&a), iin_free(&x);
    }
}

static void test_no_workspace_leak(void) {
    ds4_mem_stats before, after;
    acfg g = k_cfgs[1];
    ainputs a = ain_make(g, 1500);
    iinputs x = iin_make(g, 3, 5, 1501);
    ds4_mem_get(&before);
    pipe_out r = run_pipeline(&a, &x, 2);
    ds4_mem_get(&after);
    CHECK(after.live[DS4_MEM_WORK] == before.live[DS4_MEM_WORK], "workspace leaked: %lld bytes",
          (long long)(after.live[DS4_MEM_WORK] - before.live[DS4_MEM_WORK]));
    pipe_free(&r);
    ain_free(&a), iin_free(&x);
}

/* The vector exp of the softmaxes (vmath.h): within 2 ulp of double exp over the normal range (every
 * 97th float bit pattern from −87.3 to 88.3, and the integers and half-integers of the range), exactly 1
 * at 0, 0 below the range and at −inf, +inf above it, NaN for NaN. */
static void test_vector_exp(void) {
    double worst = 0;
    float at_worst = 0;
    int64_t n = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t b0 = pass ? 0u : 0x80000000u, b1 = pass ? 0x42b0c000u : 0xc2aeac4fu; /* +0..88.38, −0..−87.3 */
        for (uint32_t b = b0; b < b1; b += 97) {
            float x;
            memcpy(&x, &b, sizeof x);
            vm_f8 v = (vm_f8){0} + x, y = vm_exp8(v);
            double e = exp((double)x), ulp = ldexp(1.0, ilogb(e) - 23);
            double err = fabs((double)y[0] - e) / ulp;
            if (err > worst) worst = err, at_worst = x;
            n++;
        }
    }
    for (int i = -174; i <= 176; i++) {
        float x = 0.5f * (float)i;
        vm_f8 y = vm_exp8((vm_f8){0} + x);
        double e = exp((double)x), err = fabs((double)y[0] - e) / ldexp(1.0, ilogb(e) - 23);
        if (err > worst) worst = err, at_worst = x;
    }
    CHECK(worst <= 2.0, "vector exp: %.2f ulp at x = %.9g (%lld points)", worst, (double)at_worst, (long long)n);
    vm_f8 sp = vm_exp8((vm_f8){0.0f, -0.0f, -100.0f, -INFINITY, 100.0f, INFINITY, NAN, -87.0f});
    CHECK(sp[0] == 1 && sp[1] == 1 && sp[2] == 0 && sp[3] == 0, "exp(0), exp(-0), exp(-100), exp(-inf): %g %g %g %g",
          sp[0], sp[1], sp[2], sp[3]);
    CHECK(isinf(sp[4]) && sp[4] > 0 && isinf(sp[5]) && isnan(sp[6]) && sp[7] > 0, "exp(100), exp(inf), exp(NaN), exp(-87): %g %g %g %g",
          sp[4], sp[5], sp[6], sp[7]);
    t_note("test_kernels_attn: vector exp worst %.2f ulp at %.9g over %lld points", worst, (double)at_worst, (long long)n);
}

int main(void) {
    RUN(test_vector_exp);
    RUN(test_attn_fwd_matches_dense_oracle);
    RUN(test_attn_fwd_edge_cases);
    RUN(test_attn_bwd_finite_differences);
    RUN(test_attn_bwd_accumulates_and_nulls);
    RUN(test_indexer_kl_matches_naive);
    RUN(test_indexer_kl_accumulates_and_nulls);
    RUN(test_indexer_kl_zero_teacher_terms);
    RUN(test_indexer_kl_finite_differences);
    RUN(test_indexer_topk_matches_naive_sort);
    RUN(test_float_matches_double);
    RUN(test_determinism_threads);
    RUN(test_bf16_keys_match_rounded_fp32);
    RUN(test_no_workspace_leak);
    TEST_MAIN_END("test_kernels_attn");
}
