/* The mHC CUDA kernels (src/kernels/cuda/hc.cu) against the cpu backend on the same inputs.
 *
 * The kernels run cpu/hc.inc's float operations in its order (hc_dot's 16-lane sums, the Sinkhorn steps,
 * the per-token and per-column loops; -fmad=false as the cpu's -ffp-contract=off), so wherever no
 * transcendental function enters, the results must be the cpu's bits: hc_post forward and backward, the
 * mixes and rsqrt of hc_pre / hc_head. expf differs between CUDA (2 ulp) and glibc (1 ulp), but exp(0) = 1
 * exactly in both: with every exp argument 0 (base = −mixes·scale, scale 1: tokens with the same streams
 * have the same mixes) the whole forward and backward must be the cpu's bits too, Sinkhorn included.
 * With random logits the exp-dependent results are compared within a bound derived from the logits'
 * sensitivity (see hc_L, hc_sensitivity, hc_magnitudes). Every launcher runs twice for the same bits. */
#include "test_cuda_attn_util.h"
#include "kernels/cuda/hc.cuh"
extern "C" { /* C headers without their own extern "C" */
#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"
}

static const cudaStream_t S = 0;
static const double U = CC_U32;

static bool same(const char *what, const float *a, const float *b, int64_t n) {
    return cc_same_bits(what, a, b, (size_t)n * sizeof(float));
}

/* ================================================================ hc_post: the cpu's bits */

static void post_case(int64_t N, int64_t n, int64_t D, unsigned seed) {
    const int64_t nx = N * D, nr = N * n * D, np = N * n, nc = N * n * n;
    float *x = cc_hostf(nx), *res = cc_hostf(nr), *post = cc_hostf(np), *comb = cc_hostf(nc), *dY = cc_hostf(nr);
    float *dx0 = cc_hostf(nx), *dres0 = cc_hostf(nr), *dpost0 = cc_hostf(np), *dcomb0 = cc_hostf(nc);
    cc_fill(x, nx, seed, 1), cc_fill(res, nr, seed + 1, 1), cc_fill(post, np, seed + 2, 2), cc_fill(comb, nc, seed + 3, 1);
    cc_fill(dY, nr, seed + 4, 1), cc_fill(dx0, nx, seed + 5, 1), cc_fill(dres0, nr, seed + 6, 1);
    cc_fill(dpost0, np, seed + 7, 1), cc_fill(dcomb0, nc, seed + 8, 1);
    float *Yc = cc_hostf(nr), *dxc = hclone(dx0, nx), *drc = hclone(dres0, nr), *dpc = hclone(dpost0, np),
          *dcc = hclone(dcomb0, nc);
    hc_post_args a = {{N, n, D, 0}, x, res, post, comb, Yc};
    hc_post_grads g = {dY, dxc, drc, dpc, dcc};
    cpu_hc_post_fwd(&a);
    cpu_hc_post_bwd(&a, &g);
    float *d_x = up_f(x, nx), *d_res = up_f(res, nr), *d_post = up_f(post, np), *d_comb = up_f(comb, nc);
    float *d_dY = up_f(dY, nr), *d_Y = (float *)cc_dev((size_t)nr * 4), *d_dx = up_f(dx0, nx), *d_dr = up_f(dres0, nr);
    float *d_dp = up_f(dpost0, np), *d_dc = up_f(dcomb0, nc);
    hc_post_args ad = {{N, n, D, 0}, d_x, d_res, d_post, d_comb, d_Y};
    hc_post_grads gd = {d_dY, d_dx, d_dr, d_dp, d_dc};
    char what[96];
    for (int run = 0; run < 2; run++) {
        if (run) {
            cc_poison(d_Y, (size_t)nr * 4), cc_reload(d_dx, dx0, (size_t)nx * 4), cc_reload(d_dr, dres0, (size_t)nr * 4);
            cc_reload(d_dp, dpost0, (size_t)np * 4), cc_reload(d_dc, dcomb0, (size_t)nc * 4);
        }
        CC_OK(cuda_hc_post_fwd(S, &ad));
        CC_OK(cuda_hc_post_bwd(S, &ad, &gd));
        float *r[5] = {down_f(d_Y, nr), down_f(d_dx, nx), down_f(d_dr, nr), down_f(d_dp, np), down_f(d_dc, nc)};
        const float *want[5] = {Yc, dxc, drc, dpc, dcc};
        const int64_t cnt[5] = {nr, nx, nr, np, nc};
        const char *nm[5] = {"Y", "dx", "dres", "dpost", "dcomb"};
        for (int k = 0; k < 5; k++) {
            snprintf(what, sizeof what, "hc_post N%lld n%lld D%lld run %d %s", (long long)N, (long long)n, (long long)D,
                     run, nm[k]);
            same(what, r[k], want[k], cnt[k]);
            free(r[k]);
        }
    }
    free(x), free(res), free(post), free(comb), free(dY), free(dx0), free(dres0), free(dpost0), free(dcomb0);
    free(Yc), free(dxc), free(drc), free(dpc), free(dcc);
    cc_free(d_x), cc_free(d_res), cc_free(d_post), cc_free(d_comb), cc_free(d_dY), cc_free(d_Y), cc_free(d_dx);
    cc_free(d_dr), cc_free(d_dp), cc_free(d_dc);
}

static void test_hc_post(void) {
    post_case(19, 4, 64, 10);
    post_case(7, 3, 33, 30); /* odd n and D: the dot tails */
    if (ta_full()) post_case(3, 4, 4096, 20); /* V4's width */
}

/* ================================================================ hc_pre / hc_head */

/* One hc_pre (head = false) or hc_head (head = true) case: inputs, the cpu's results, the gpu's twice. */
typedef struct {
    int64_t N, n, D, iters, M;
    bool head;
    float hc_eps, norm_eps;
    float *X, *fn, *scale, *base, *dy, *dpost, *dcomb, *dX0, *dfn0, *dscale0, *dbase0;
} hcase;

static hcase hcase_make(bool head, int64_t N, int64_t n, int64_t D, int64_t iters, unsigned seed) {
    hcase h;
    memset(&h, 0, sizeof h);
    h.head = head, h.N = N, h.n = n, h.D = D, h.iters = iters, h.M = head ? n : (2 + n) * n;
    h.hc_eps = 1e-6f, h.norm_eps = 1e-6f;
    const int64_t nD = n * D, M = h.M;
    h.X = cc_hostf(N * nD), h.fn = cc_hostf(M * nD), h.scale = cc_hostf(3), h.base = cc_hostf(M);
    h.dy = cc_hostf(N * D), h.dpost = cc_hostf(N * n), h.dcomb = cc_hostf(N * n * n);
    h.dX0 = cc_hostf(N * nD), h.dfn0 = cc_hostf(M * nD), h.dscale0 = cc_hostf(3), h.dbase0 = cc_hostf(M);
    cc_fill(h.X, N * nD, seed, 1.0f), cc_fill(h.fn, M * nD, seed + 1, 0.05f), cc_fill(h.scale, 3, seed + 2, 1.0f);
    cc_fill(h.base, M, seed + 3, 1.0f), cc_fill(h.dy, N * D, seed + 4, 1.0f), cc_fill(h.dpost, N * n, seed + 5, 1.0f);
    cc_fill(h.dcomb, N * n * n, seed + 6, 1.0f), cc_fill(h.dX0, N * nD, seed + 7, 0.5f);
    cc_fill(h.dfn0, M * nD, seed + 8, 0.5f), cc_fill(h.dscale0, 3, seed + 9, 0.5f), cc_fill(h.dbase0, M, seed + 10, 0.5f);
    return h;
}

static void hcase_free(hcase *h) {
    free(h->X), free(h->fn), free(h->scale), free(h->base), free(h->dy), free(h->dpost), free(h->dcomb), free(h->dX0);
    free(h->dfn0), free(h->dscale0), free(h->dbase0);
}

/* The results of one run: y [N, D], post [N, n], comb [N, n, n], mixes [N, M], rsqrt [N], then the
 * gradients dX [N, nD], dfn [M, nD], dscale [3], dbase [M]. */
enum { R_Y, R_POST, R_COMB, R_MIX, R_RSQ, R_DX, R_DFN, R_DSCALE, R_DBASE, R_N };
static const char *r_name[R_N] = {"y", "post", "comb", "mixes", "rsqrt", "dX", "dfn", "dscale", "dbase"};
typedef struct {
    float *r[R_N];
    int64_t n[R_N];
} hres;

static void hres_sizes(hres *o, const hcase *h) {
    const int64_t N = h->N, n = h->n, nD = n * h->D, M = h->M;
    const int64_t cnt[R_N] = {N * h->D, h->head ? 0 : N * n, h->head ? 0 : N * n * n, N * M, N, N * nD, M * nD,
                              h->head ? 1 : 3, M};
    for (int k = 0; k < R_N; k++) o->n[k] = cnt[k];
}

static hres hres_alloc(const hcase *h) {
    hres o;
    hres_sizes(&o, h);
    for (int k = 0; k < R_N; k++) o.r[k] = cc_hostf(o.n[k] > 0 ? o.n[k] : 1);
    memcpy(o.r[R_DX], h->dX0, (size_t)o.n[R_DX] * 4), memcpy(o.r[R_DFN], h->dfn0, (size_t)o.n[R_DFN] * 4);
    memcpy(o.r[R_DSCALE], h->dscale0, (size_t)o.n[R_DSCALE] * 4), memcpy(o.r[R_DBASE], h->dbase0, (size_t)o.n[R_DBASE] * 4);
    return o;
}
static void hres_free(hres *o) {
    for (int k = 0; k < R_N; k++) free(o->r[k]);
}

static void run_cpu(hres *o, const hcase *h) {
    hc_dims d = {h->N, h->n, h->D, h->iters};
    if (h->head) {
        hc_head_args a = {d, h->hc_eps, h->norm_eps, h->X, h->fn, h->scale, h->base, o->r[R_Y], o->r[R_MIX], o->r[R_RSQ]};
        hc_head_grads g = {h->dy, o->r[R_DX], o->r[R_DFN], o->r[R_DSCALE], o->r[R_DBASE]};
        cpu_hc_head_fwd(&a);
        cpu_hc_head_bwd(&a, &g);
    } else {
        hc_pre_args a = {d, h->hc_eps, h->norm_eps, h->X, h->fn, h->scale, h->base, o->r[R_Y], o->r[R_POST],
                         o->r[R_COMB], o->r[R_MIX], o->r[R_RSQ]};
        hc_pre_grads g = {h->dy, h->dpost, h->dcomb, o->r[R_DX], o->r[R_DFN], o->r[R_DSCALE], o->r[R_DBASE]};
        cpu_hc_pre_fwd(&a);
        cpu_hc_pre_bwd(&a, &g);
    }
}

static void run_gpu(hres *o, const hcase *h) {
    hres_sizes(o, h);
    const int64_t N = h->N, n = h->n, D = h->D, nD = n * D;
    float *X = up_f(h->X, N * nD), *fn = up_f(h->fn, h->M * nD), *sc = up_f(h->scale, 3), *bs = up_f(h->base, h->M);
    float *dy = up_f(h->dy, N * D), *dp = up_f(h->dpost, N * n), *dc = up_f(h->dcomb, N * n * n);
    float *dev[R_N];
    for (int k = 0; k < R_N; k++) dev[k] = (float *)cc_dev((size_t)(o->n[k] > 0 ? o->n[k] : 1) * 4);
    cc_reload(dev[R_DX], h->dX0, (size_t)o->n[R_DX] * 4), cc_reload(dev[R_DFN], h->dfn0, (size_t)o->n[R_DFN] * 4);
    cc_reload(dev[R_DSCALE], h->dscale0, (size_t)o->n[R_DSCALE] * 4);
    cc_reload(dev[R_DBASE], h->dbase0, (size_t)o->n[R_DBASE] * 4);
    hc_dims d = {N, n, D, h->iters};
    if (h->head) {
        hc_head_args a = {d, h->hc_eps, h->norm_eps, X, fn, sc, bs, dev[R_Y], dev[R_MIX], dev[R_RSQ]};
        hc_head_grads g = {dy, dev[R_DX], dev[R_DFN], dev[R_DSCALE], dev[R_DBASE]};
        CC_OK(cuda_hc_head_fwd(S, &a));
        CC_OK(cuda_hc_head_bwd(S, &a, &g));
    } else {
        hc_pre_args a = {d, h->hc_eps, h->norm_eps, X, fn, sc, bs, dev[R_Y], dev[R_POST], dev[R_COMB], dev[R_MIX], dev[R_RSQ]};
        hc_pre_grads g = {dy, dp, dc, dev[R_DX], dev[R_DFN], dev[R_DSCALE], dev[R_DBASE]};
        CC_OK(cuda_hc_pre_fwd(S, &a));
        CC_OK(cuda_hc_pre_bwd(S, &a, &g));
    }
    for (int k = 0; k < R_N; k++) o->r[k] = down_f(dev[k], o->n[k]), cc_free(dev[k]);
    cc_free(X), cc_free(fn), cc_free(sc), cc_free(bs), cc_free(dy), cc_free(dp), cc_free(dc);
}

/* Makes every exp argument 0: every token gets token 0's streams (so the same mixes), scale = 1 and
 * base = −mixes (the cpu's mixes: they do not depend on base). */
static void zero_logits(hcase *h) {
    const int64_t nD = h->n * h->D;
    for (int64_t t = 1; t < h->N; t++) memcpy(h->X + t * nD, h->X, (size_t)nD * 4);
    for (int i = 0; i < 3; i++) h->scale[i] = 1.0f;
    hres o = hres_alloc(h);
    run_cpu(&o, h);
    for (int64_t i = 0; i < h->M; i++) h->base[i] = -o.r[R_MIX][i];
    hres_free(&o);
}

/* hc_pre / hc_head with every exp argument 0: every output the cpu's bits, twice. */
static void exact_case(bool head, int64_t N, int64_t n, int64_t D, int64_t iters, unsigned seed) {
    hcase h = hcase_make(head, N, n, D, iters, seed);
    zero_logits(&h);
    hres c = hres_alloc(&h), g1, g2;
    run_cpu(&c, &h);
    run_gpu(&g1, &h);
    run_gpu(&g2, &h);
    char what[128];
    for (int k = 0; k < R_N; k++) {
        if (!c.n[k]) continue;
        snprintf(what, sizeof what, "%s exp-args-0 N%lld n%lld D%lld %s", head ? "hc_head" : "hc_pre", (long long)N,
                 (long long)n, (long long)D, r_name[k]);
        same(what, g1.r[k], c.r[k], c.n[k]);
        snprintf(what, sizeof what, "%s N%lld %s: two runs", head ? "hc_head" : "hc_pre", (long long)N, r_name[k]);
        same(what, g2.r[k], g1.r[k], c.n[k]);
    }
    /* the case exercises every path: the gradients are not zero */
    double s = 0;
    for (int64_t i = 0; i < c.n[R_DFN]; i++) s += fabs((double)c.r[R_DFN][i] - h.dfn0[i]);
    CHECK(s > 0, "%s exact case: dfn got no gradient", head ? "hc_head" : "hc_pre");
    hres_free(&c), hres_free(&g1), hres_free(&g2), hcase_free(&h);
}

static void test_hc_exact(void) {
    exact_case(false, 6, 4, 64, 20, 100);
    exact_case(false, 5, 3, 33, 7, 120);
    exact_case(true, 6, 4, 64, 0, 130);
    if (!ta_full()) return;
    exact_case(false, 3, 4, 4096, 20, 110); /* V4's width, 20 iterations */
    exact_case(true, 2, 4, 4096, 0, 140);
}

/* hc_split_sinkhorn alone, one token, every exp argument 0: the cpu's bits. */
static void test_hc_sinkhorn_exact(void) {
    const int64_t n = 4, M = (2 + n) * n;
    float mixes[M], scale[3] = {1, 1, 1}, base[M], dpre[n], dpost[n], dcomb[n * n];
    cc_fill(mixes, M, 7, 2.0f), cc_fill(dpre, n, 8, 1), cc_fill(dpost, n, 9, 1), cc_fill(dcomb, n * n, 10, 1);
    for (int64_t i = 0; i < M; i++) base[i] = -mixes[i];
    float pre_c[n], post_c[n], comb_c[n * n], dm_c[M] = {0}, ds_c[3] = {0}, db_c[M] = {0};
    hc_sinkhorn_args a = {n, 20, 1e-6f, mixes, scale, base, pre_c, post_c, comb_c};
    hc_sinkhorn_grads g = {dpre, dpost, dcomb, dm_c, ds_c, db_c};
    cpu_hc_split_sinkhorn_fwd(&a);
    cpu_hc_split_sinkhorn_bwd(&a, &g);
    float *d_m = up_f(mixes, M), *d_s = up_f(scale, 3), *d_b = up_f(base, M), *d_dpre = up_f(dpre, n);
    float *d_dpost = up_f(dpost, n), *d_dcomb = up_f(dcomb, n * n), *d_pre = (float *)cc_dev(n * 4);
    float *d_post = (float *)cc_dev(n * 4), *d_comb = (float *)cc_dev(n * n * 4);
    float zero[M] = {0};
    float *d_dm = up_f(zero, M), *d_ds = up_f(zero, 3), *d_db = up_f(zero, M);
    hc_sinkhorn_args ad = {n, 20, 1e-6f, d_m, d_s, d_b, d_pre, d_post, d_comb};
    hc_sinkhorn_grads gd = {d_dpre, d_dpost, d_dcomb, d_dm, d_ds, d_db};
    CC_OK(cuda_hc_split_sinkhorn_fwd(S, &ad));
    CC_OK(cuda_hc_split_sinkhorn_bwd(S, &ad, &gd));
    float *r[6] = {down_f(d_pre, n), down_f(d_post, n), down_f(d_comb, n * n), down_f(d_dm, M), down_f(d_ds, 3),
                   down_f(d_db, M)};
    const float *want[6] = {pre_c, post_c, comb_c, dm_c, ds_c, db_c};
    const int64_t cnt[6] = {n, n, n * n, M, 3, M};
    const char *nm[6] = {"pre", "post", "comb", "dmixes", "dscale", "dbase"};
    char what[64];
    for (int k = 0; k < 6; k++) {
        snprintf(what, sizeof what, "sinkhorn exp-args-0 %s", nm[k]);
        same(what, r[k], want[k], cnt[k]);
        free(r[k]);
    }
    cc_free(d_m), cc_free(d_s), cc_free(d_b), cc_free(d_dpre), cc_free(d_dpost), cc_free(d_dcomb), cc_free(d_pre);
    cc_free(d_post), cc_free(d_comb), cc_free(d_dm), cc_free(d_ds), cc_free(d_db);
}

/* ================================================================ random logits */

/* Bound of |gpu − cpu| for a result that depends on exp. The two run the same float operations in the same
 * order; they differ because an exp result may differ by up to 3 ulp (2 on the GPU, 1 in glibc): a
 * relative 6u, the same as moving that exp's argument — a logit a = mixes·scale + base of some token —
 * by 6u (first order). Once an input of a later float operation differs, its result may also round to the
 * other neighbour: at most one more ulp, a relative 2u of a quantity that (in the Sinkhorn chain) is an
 * exp times row and column scalings, so again a logit move of 2u. With L such roundings after the first
 * exp on a path, the result moves by at most (6 + 2L)·u·Σ_{t,i} |∂r/∂a_{t,i}|, the sensitivity measured
 * on the double twin by central differences (one token at a time: ∂/∂base_i is ∂/∂a_{t,i} there), plus the
 * result's own rounding 2u·|r|. L: the Sinkhorn forward's 2 roundings per step (steps = 2·iters − 1),
 * its backward's 2n + 2 per step, and 2M + n + 8 for softmax, sigmoids and the sums after.
 * The last sums of a result (y = Σ_j pre·X; dX's pre·dy − cx·x + Σ_i r·gm_i·fn_i; dfn, dbase, dscale over
 * the tokens) add terms that are not exp-like: each of their ℓ roundings may go to the other neighbour,
 * at most 2u of a partial sum, so 2u·ℓ·Σ|terms| more (hc_magnitudes, from the double twin's values). */
static double hc_L(const hcase *h) {
    const double steps = h->head ? 0 : 2.0 * (double)h->iters - 1;
    return 2 * steps + (2.0 * h->n + 2) * steps + 2.0 * h->M + h->n + 8;
}

/* sens [R_N][...]: Σ_{t,i} |∂r/∂a_{t,i}| per result element, from the double twin on one token at a time. */
static void hc_sensitivity(double **sens, const hcase *h) {
    const int64_t N = h->N, n = h->n, D = h->D, nD = n * D, M = h->M;
    double *X = (double *)cc_host((size_t)nD * 8), *fn = (double *)cc_host((size_t)(M * nD) * 8);
    double sc[3], bs[HC_CUDA_NMAX * (2 + HC_CUDA_NMAX)], *dyv = (double *)cc_host((size_t)D * 8);
    double dp[HC_CUDA_NMAX], dc[HC_CUDA_NMAX * HC_CUDA_NMAX];
    for (int64_t i = 0; i < M * nD; i++) fn[i] = h->fn[i];
    for (int i = 0; i < 3; i++) sc[i] = h->scale[i];
    /* outputs of one token, for base ± step */
    const int64_t ny = D, nX = nD, nfn = M * nD;
    double *out[2][R_N];
    for (int s = 0; s < 2; s++) {
        out[s][R_Y] = (double *)cc_host((size_t)ny * 8), out[s][R_POST] = (double *)cc_host(HC_CUDA_NMAX * 8);
        out[s][R_COMB] = (double *)cc_host(HC_CUDA_NMAX * HC_CUDA_NMAX * 8), out[s][R_MIX] = (double *)cc_host((size_t)M * 8);
        out[s][R_RSQ] = (double *)cc_host(8), out[s][R_DX] = (double *)cc_host((size_t)nX * 8);
        out[s][R_DFN] = (double *)cc_host((size_t)nfn * 8), out[s][R_DSCALE] = (double *)cc_host(3 * 8);
        out[s][R_DBASE] = (double *)cc_host((size_t)M * 8);
    }
    hres sz;
    hres_sizes(&sz, h);
    for (int64_t t = 0; t < N; t++) {
        for (int64_t i = 0; i < nD; i++) X[i] = h->X[t * nD + i];
        for (int64_t i = 0; i < D; i++) dyv[i] = h->dy[t * D + i];
        for (int64_t i = 0; i < n; i++) dp[i] = h->dpost[t * n + i];
        for (int64_t i = 0; i < n * n; i++) dc[i] = h->dcomb[t * n * n + i];
        for (int64_t i = 0; i < M; i++) {
            const double step = 1e-5;
            for (int s = 0; s < 2; s++) {
                for (int64_t k = 0; k < M; k++) bs[k] = h->base[k];
                bs[i] += s ? -step : step;
                for (int64_t k = 0; k < nX; k++) out[s][R_DX][k] = 0;
                for (int64_t k = 0; k < nfn; k++) out[s][R_DFN][k] = 0;
                for (int k = 0; k < 3; k++) out[s][R_DSCALE][k] = 0;
                for (int64_t k = 0; k < M; k++) out[s][R_DBASE][k] = 0;
                hc_dims d1 = {1, n, D, h->iters};
                if (h->head) {
                    hc_head_args_f64 a = {d1, h->hc_eps, h->norm_eps, X, fn, sc, bs, out[s][R_Y], out[s][R_MIX], out[s][R_RSQ]};
                    hc_head_grads_f64 g = {dyv, out[s][R_DX], out[s][R_DFN], out[s][R_DSCALE], out[s][R_DBASE]};
                    hc_head_fwd_f64(&a);
                    hc_head_bwd_f64(&a, &g);
                } else {
                    hc_pre_args_f64 a = {d1, h->hc_eps, h->norm_eps, X, fn, sc, bs, out[s][R_Y], out[s][R_POST],
                                         out[s][R_COMB], out[s][R_MIX], out[s][R_RSQ]};
                    hc_pre_grads_f64 g = {dyv, dp, dc, out[s][R_DX], out[s][R_DFN], out[s][R_DSCALE], out[s][R_DBASE]};
                    hc_pre_fwd_f64(&a);
                    hc_pre_bwd_f64(&a, &g);
                }
            }
            /* the token's share of each result: rows t of the per-token results, all of the summed ones */
            for (int k = 0; k < R_N; k++) {
                if (!sz.n[k]) continue;
                const bool summed = k == R_DFN || k == R_DSCALE || k == R_DBASE;
                const int64_t per = summed ? sz.n[k] : sz.n[k] / N, off = summed ? 0 : t * per;
                for (int64_t e = 0; e < per; e++)
                    sens[k][off + e] += fabs(out[0][k][e] - out[1][k][e]) / (2 * step);
            }
        }
    }
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < R_N; k++) free(out[s][k]);
    free(X), free(fn), free(dyv);
}

/* mag [R_N][...]: Σ|terms| of each result's last sum (with its initial value) and ℓ, its roundings. */
static void hc_magnitudes(double **mag, double *ell, const hcase *h, const hres *c) {
    const int64_t N = h->N, n = h->n, D = h->D, nD = n * D, M = h->M;
    for (int k = 0; k < R_N; k++) ell[k] = 0;
    ell[R_Y] = (double)n + 1, ell[R_DX] = (double)M + 3;
    ell[R_DFN] = ell[R_DSCALE] = ell[R_DBASE] = (double)N + 1;
    for (int64_t e = 0; e < M * nD; e++) mag[R_DFN][e] = fabs((double)h->dfn0[e]);
    for (int64_t e = 0; e < M; e++) mag[R_DBASE][e] = fabs((double)h->dbase0[e]);
    for (int64_t e = 0; e < (h->head ? 1 : 3); e++) mag[R_DSCALE][e] = fabs((double)h->dscale0[e]);
    double mx[HC_CUDA_NMAX * (2 + HC_CUDA_NMAX)], sc[3], bs[HC_CUDA_NMAX * (2 + HC_CUDA_NMAX)];
    double pre[HC_CUDA_NMAX], post[HC_CUDA_NMAX], comb[HC_CUDA_NMAX * HC_CUDA_NMAX], dpre[HC_CUDA_NMAX];
    double dp[HC_CUDA_NMAX], dc[HC_CUDA_NMAX * HC_CUDA_NMAX];
    double gm[HC_CUDA_NMAX * (2 + HC_CUDA_NMAX)], db[HC_CUDA_NMAX * (2 + HC_CUDA_NMAX)], ds[3];
    for (int i = 0; i < 3; i++) sc[i] = h->scale[i];
    for (int64_t i = 0; i < M; i++) bs[i] = h->base[i];
    for (int64_t t = 0; t < N; t++) {
        const float *x = h->X + t * nD, *dy = h->dy + t * D;
        const double r = c->r[R_RSQ][t];
        for (int64_t i = 0; i < M; i++) mx[i] = c->r[R_MIX][t * M + i], gm[i] = 0, db[i] = 0;
        ds[0] = ds[1] = ds[2] = 0;
        for (int64_t j = 0; j < n; j++) {
            double d = 0;
            for (int64_t k = 0; k < D; k++) d += (double)dy[k] * x[j * D + k];
            dpre[j] = d;
            const double sg = 1 / (1 + exp(-(mx[j] * sc[0] + bs[j])));
            pre[j] = sg + h->hc_eps;
            if (h->head) gm[j] = d * sg * (1 - sg) * sc[0], db[j] = d * sg * (1 - sg), ds[0] += db[j] * mx[j];
        }
        if (!h->head) {
            for (int64_t j = 0; j < n; j++) dp[j] = h->dpost[t * n + j];
            for (int64_t j = 0; j < n * n; j++) dc[j] = h->dcomb[t * n * n + j];
            hc_sinkhorn_args_f64 a = {n, h->iters, h->hc_eps, mx, sc, bs, pre, post, comb};
            hc_sinkhorn_grads_f64 g = {dpre, dp, dc, gm, ds, db};
            hc_split_sinkhorn_fwd_f64(&a);
            hc_split_sinkhorn_bwd_f64(&a, &g);
        }
        double cx = 0;
        for (int64_t i = 0; i < M; i++) cx += gm[i] * mx[i];
        cx *= r * r / (double)nD;
        for (int64_t d = 0; d < D; d++) {
            double m = 0;
            for (int64_t j = 0; j < n; j++) m += fabs(pre[j] * x[j * D + d]);
            mag[R_Y][t * D + d] = m;
        }
        for (int64_t cc = 0; cc < nD; cc++) {
            double m = fabs((double)h->dX0[t * nD + cc]) + fabs(pre[cc / D] * dy[cc % D]) + fabs(cx * x[cc]);
            for (int64_t i = 0; i < M; i++) {
                m += fabs(r * gm[i] * h->fn[i * nD + cc]);
                mag[R_DFN][i * nD + cc] += fabs(gm[i] * r * x[cc]);
            }
            mag[R_DX][t * nD + cc] = m;
        }
        for (int64_t i = 0; i < M; i++) mag[R_DBASE][i] += fabs(db[i]);
        for (int64_t i = 0; i < (h->head ? 1 : 3); i++) mag[R_DSCALE][i] += fabs(ds[i]);
    }
}

/* Random logits: the results without exp (mixes, rsqrt) are the cpu's bits; the others within
 * the bound of hc_L; two runs the same bits. */
static void random_case(bool head, int64_t N, int64_t n, int64_t D, int64_t iters, unsigned seed) {
    hcase h = hcase_make(head, N, n, D, iters, seed);
    hres c = hres_alloc(&h), g1, g2;
    run_cpu(&c, &h);
    run_gpu(&g1, &h);
    run_gpu(&g2, &h);
    double *sens[R_N], *mag[R_N], ell[R_N];
    for (int k = 0; k < R_N; k++) {
        sens[k] = (double *)cc_host((size_t)(c.n[k] > 0 ? c.n[k] : 1) * 8);
        mag[k] = (double *)cc_host((size_t)(c.n[k] > 0 ? c.n[k] : 1) * 8);
    }
    hc_sensitivity(sens, &h);
    hc_magnitudes(mag, ell, &h, &c);
    const double L = hc_L(&h);
    char what[128];
    for (int k = 0; k < R_N; k++) {
        if (!c.n[k]) continue;
        snprintf(what, sizeof what, "%s random N%lld n%lld D%lld %s", head ? "hc_head" : "hc_pre", (long long)N,
                 (long long)n, (long long)D, r_name[k]);
        if (k == R_MIX || k == R_RSQ) {
            same(what, g1.r[k], c.r[k], c.n[k]);
        } else {
            double *b = (double *)cc_host((size_t)c.n[k] * 8);
            for (int64_t e = 0; e < c.n[k]; e++) b[e] = (6 + 2 * L) * U * sens[k][e] + 2 * U * ell[k] * mag[k][e] + 2 * U * fabs((double)c.r[k][e]);
            cc_within(what, g1.r[k], c.r[k], b, c.n[k]);
            free(b);
        }
        snprintf(what, sizeof what, "%s random N%lld %s: two runs", head ? "hc_head" : "hc_pre", (long long)N, r_name[k]);
        same(what, g2.r[k], g1.r[k], c.n[k]);
    }
    for (int k = 0; k < R_N; k++) free(sens[k]), free(mag[k]);
    hres_free(&c), hres_free(&g1), hres_free(&g2), hcase_free(&h);
}

static void test_hc_random(void) {
    random_case(false, 7, 4, 64, 20, 200);
    random_case(false, 5, 3, 33, 5, 220);
    random_case(true, 7, 4, 64, 0, 230);
    if (!ta_full()) return;
    random_case(false, 2, 4, 1024, 20, 210);
    random_case(false, 2, 4, 4096, 20, 215); /* V4's width */
    random_case(true, 3, 4, 512, 0, 240);
}

static void test_hc_bad_sizes(void) {
    hc_pre_args a;
    memset(&a, 0, sizeof a);
    a.dims = (hc_dims){4, HC_CUDA_NMAX + 1, 8, 20};
    CHECK(cuda_hc_pre_fwd(S, &a) == DS4_ERR_ARG, "n above HC_CUDA_NMAX accepted");
    hc_post_args p;
    memset(&p, 0, sizeof p);
    p.dims = (hc_dims){-1, 4, 8, 0};
    CHECK(cuda_hc_post_fwd(S, &p) == DS4_ERR_ARG, "negative N accepted");
}

int main(void) {
    CUDA_TEST_BEGIN("test_cuda_hc");
    if (!ta_full()) t_note("%s: DS4_CUDA_SMALL: the large cases are skipped", "test_cuda_hc");
    CC_RUN(test_hc_post);
    CC_RUN(test_hc_exact);
    CC_RUN(test_hc_sinkhorn_exact);
    CC_RUN(test_hc_random);
    CC_RUN(test_hc_bad_sizes);
    CUDA_TEST_END("test_cuda_hc");
}
