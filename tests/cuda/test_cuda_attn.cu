/* The attention-family CUDA kernels (src/kernels/cuda/attn.cu, indexer.cu, compressor.cu) against the cpu
 * backend on the same inputs: sparse attention with sinks (forward and backward, fp32 and bf16 keys), the
 * indexer top-k (identical selections), the indexer KL loss and its gradients, compressor pooling.
 *
 * Bounds. Every float result is compared with a double-precision oracle written here (the exact value up
 * to ~1e-16) within a bound derived per element by running error analysis along the op's chain: a sum of
 * n float terms in any order is within γ_n·Σ|terms| (γ_n ≈ n·u, u = 2^-24) of the exact sum of the terms
 * (Higham, Accuracy and Stability, §3.1), a product adds u of its value, and an error δx of an input
 * carries through as |∂f/∂x|·δx. expf is within 2 ulp on the GPU and 1 ulp in glibc: a relative error of
 * at most E = 4u; logf within 1 ulp: 2u of its value. The same bound is checked for the cpu's result
 * too, so a bound that is too tight fails on either side. The indexer's scores are the cpu's bits, so
 * its top-k must equal the cpu's exactly. Each launcher also runs twice (same bits), and the attention
 * once per batch row (one launch per row instead of one for all: the same bits). */
#include "test_cuda_attn_util.h"
#include "kernels/cuda/attn.cuh"
extern "C" { /* a C header without its own extern "C" */
#include "kernels/cpu/cpu.h"
}

static const double U = CC_U32;       /* unit roundoff of fp32 */
static const double E = 4 * CC_U32;   /* relative error of expf (2 ulp on the GPU, 1 in glibc) */
static const double UD = 0x1p-52;     /* the double oracle's own roundoff: its error is below n·UD·Σ|terms| */
static const cudaStream_t S = 0;      /* the legacy stream: ordered with the harness's copies */

static const ds4_kernel_backend *cpu(void) { return ds4_kernel_backend_cpu(); }
static const ds4_exec k_cpu_exec = {}; /* the cpu entries' context: real, fp32 */

/* got [n] (float) vs the oracle want [n] (double): |got − want| <= bound + the oracle's own error. */
static bool ck_near(const char *what, const float *got, const double *want, const double *bound, int64_t n) {
    double worst = 0;
    int64_t bad = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        const double b = bound[i] + 64 * UD * fabs(want[i]), d = fabs((double)got[i] - want[i]);
        if (!(d <= b) && bad++ == 0) first = i;
        if (b > 0 && d / b > worst) worst = d / b;
    }
    t_note("  %s: max err/bound %.3g (n %lld)", what, worst, (long long)n);
    if (bad)
        CHECK(bad == 0, "%s: %lld of %lld outside the bound; first [%lld] %.9g vs %.9g (bound %.3g)", what, (long long)bad,
              (long long)n, (long long)first, got[first], want[first], bound[first]);
    return bad == 0;
}

/* The checks of one case's results k < nres: the gpu's first run and the cpu's within the oracle's bound,
 * the gpu's two runs the same bits. */
static void ck_results(const char *name, int nres, float *const *gpu1, float *const *gpu2, const float *const *cpu_r,
                       const double *const *want, const double *const *bound, const int64_t *n,
                       const char *const *names) {
    char what[192];
    for (int k = 0; k < nres; k++) {
        snprintf(what, sizeof what, "%s gpu %s", name, names[k]);
        ck_near(what, gpu1[k], want[k], bound[k], n[k]);
        snprintf(what, sizeof what, "%s cpu %s", name, names[k]);
        ck_near(what, cpu_r[k], want[k], bound[k], n[k]);
        snprintf(what, sizeof what, "%s %s: two runs", name, names[k]);
        cc_same_bits(what, gpu1[k], gpu2[k], (size_t)n[k] * 4);
    }
}

/* Device copy of `bytes` of host data (ints, bf16 bits); a zeroed host array of n doubles. */
static void *up_b(const void *h, size_t bytes) { return cc_up(h, bytes ? bytes : 1); }
static double *dalloc(int64_t n) { return (double *)cc_host((size_t)(n > 0 ? n : 1) * sizeof(double)); }

/* Random top-k rows: distinct usable ids in random slots, −1 elsewhere; some rows take fewer than they
 * could, every 7th row none. */
static void make_topk(int32_t *topk, int64_t B, int64_t T, int64_t Nc, int64_t ratio, int64_t K, unsigned seed) {
    unsigned long s = seed * 7919ul + 1;
    int32_t *pool = (int32_t *)cc_host((size_t)(Nc + 1) * sizeof(int32_t));
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t t = bt % T, nu = ratio > 0 ? ((t + 1) / ratio < Nc ? (t + 1) / ratio : Nc) : 0;
        int32_t *row = topk + bt * K;
        for (int64_t k = 0; k < K; k++) row[k] = -1;
        s = s * 6364136223846793005ul + 1442695040888963407ul;
        int64_t m = nu < K ? nu : K;
        if ((s >> 33) % 3 == 0) m /= 2;
        if (bt % 7 == 3) m = 0;
        for (int64_t i = 0; i < nu; i++) pool[i] = (int32_t)i;
        for (int64_t i = 0; i < m; i++) {
            s = s * 6364136223846793005ul + 1442695040888963407ul;
            int64_t j = i + (int64_t)((s >> 33) % (unsigned long)(nu - i));
            int32_t x = pool[i];
            pool[i] = pool[j], pool[j] = x;
        }
        for (int64_t i = 0; i < m; i++) {
            s = s * 6364136223846793005ul + 1442695040888963407ul;
            int64_t k = (int64_t)((s >> 33) % (unsigned long)K);
            while (row[k] >= 0) k = (k + 1) % K;
            row[k] = pool[i];
        }
    }
    free(pool);
}

/* x [n] rounded to bf16 in place; bits [n] its bf16 bits. */
static void to_bf16(float *x, uint16_t *bits, int64_t n) {
    for (int64_t i = 0; i < n; i++) bits[i] = gemm_bf16_bits(x[i]), x[i] = bf16_widen(bits[i]);
}

/* ================================================================ sparse attention */

typedef struct {
    const char *name;
    int64_t B, T, H, c, window, ratio, Nc, K;
    int topk, bf16;
} acase;

typedef struct {
    acase g;
    float scale;
    float *q, *kv, *kvc, *sink, *dout, *dq0, *dkv0, *dkvc0, *dsink0; /* host; kv, kvc: the values the keys hold */
    uint16_t *kv16, *kvc16;                                           /* bf16 bits of kv, kvc (bf16 cases) */
    int32_t *topk;                                                    /* NULL unless g.topk */
} ain;

static ain ain_make(acase g, unsigned seed) {
    ain a;
    memset(&a, 0, sizeof a);
    a.g = g;
    a.scale = (float)(1.0 / sqrt((double)g.c));
    const int64_t nq = g.B * g.T * g.H * g.c, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c;
    a.q = cc_hostf(nq), a.kv = cc_hostf(nkv), a.kvc = cc_hostf(nkvc + 1), a.sink = cc_hostf(g.H);
    a.dout = cc_hostf(nq), a.dq0 = cc_hostf(nq), a.dkv0 = cc_hostf(nkv), a.dkvc0 = cc_hostf(nkvc + 1);
    a.dsink0 = cc_hostf(g.H);
    cc_fill(a.q, nq, seed + 1, 1.5f);
    cc_fill(a.kv, nkv, seed + 2, 1.5f);
    cc_fill(a.kvc, nkvc, seed + 3, 1.5f);
    cc_fill(a.sink, g.H, seed + 4, 1.0f);
    cc_fill(a.dout, nq, seed + 5, 1.0f);
    cc_fill(a.dq0, nq, seed + 6, 0.5f);
    cc_fill(a.dkv0, nkv, seed + 7, 0.5f);
    cc_fill(a.dkvc0, nkvc, seed + 8, 0.5f);
    cc_fill(a.dsink0, g.H, seed + 9, 0.5f);
    if (g.bf16) {
        a.kv16 = (uint16_t *)cc_host((size_t)nkv * 2), a.kvc16 = (uint16_t *)cc_host((size_t)(nkvc + 1) * 2);
        to_bf16(a.kv, a.kv16, nkv);
        to_bf16(a.kvc, a.kvc16, nkvc);
    }
    if (g.topk) {
        a.topk = (int32_t *)cc_host((size_t)(g.B * g.T * g.K) * sizeof(int32_t));
        make_topk(a.topk, g.B, g.T, g.Nc, g.ratio, g.K, seed);
    }
    return a;
}

static void ain_free(ain *a) {
    free(a->q), free(a->kv), free(a->kvc), free(a->sink), free(a->dout), free(a->dq0), free(a->dkv0);
    free(a->dkvc0), free(a->dsink0), free(a->kv16), free(a->kvc16), free(a->topk);
}

/* Keys of (b, t) as rows of [kv_b | kvc_b] (j < T window row, T + e entry e), as kernels.h defines them. */
static int64_t key_rows(int64_t *rows, const ain *a, int64_t b, int64_t t) {
    const acase *g = &a->g;
    int64_t n = 0;
    for (int64_t j = t - g->window + 1 > 0 ? t - g->window + 1 : 0; j <= t; j++) rows[n++] = j;
    if (g->ratio <= 0) return n;
    if (a->topk) {
        for (int64_t k = 0; k < g->K; k++) {
            int32_t id = a->topk[(b * g->T + t) * g->K + k];
            if (id >= 0 && id < g->Nc) rows[n++] = g->T + id;
        }
    } else {
        for (int64_t e = 0; e < g->Nc && (e + 1) * g->ratio <= t + 1; e++) rows[n++] = g->T + e;
    }
    return n;
}
static const float *key_vec(const ain *a, int64_t b, int64_t j) {
    const acase *g = &a->g;
    return j < g->T ? a->kv + (b * g->T + j) * g->c : a->kvc + (b * g->Nc + j - g->T) * g->c;
}

/* The oracle: values in double and their bounds (float result vs exact), forward and backward.
 * Per query head (b, t, h), with keys k of the set (n of them), scores s_k = scale·q·v_k:
 *  - a score's float error: δs_k = (c+2)·u·scale·Σ|q·v_k| (the dot, then the scale's rounding);
 *  - p_k = exp(s_k − m)/z: relative error ρ_k = δs_k + max δs (through z) + u·|s_k − m| + u·max|s − m|
 *    (the subtractions) + 2E (exp of the key and, through z, of the others) + (n + 3)·u (z's sum, the
 *    division); the common max m cancels between numerator and z;
 *  - o_i = Σ_k p_k·v_ki: Σ_k p_k·|v_ki|·(ρ_k + (n + 1)·u) (the p errors and the n-term sum) + u·|o_i|;
 *  - lse = m + log z: max δs + u·max|s − m| + E + (n + 2)·u (z) + 2u·|log z| (logf) + u·|lse|.
 * Backward (p recomputed as exp(s − lse) from the float lse): δp_k = p_k·(δs_k + δlse + u·|s_k − lse| + E);
 * D = dO·o: (c+2)·u·Σ|dO·o| + Σ|dO_i|·δo_i; dp_k = dO·v_k: (c+2)·u·Σ|dO·v_k|;
 * ds_k = p_k·(dp_k − D): δp_k·|dp_k − D| + p_k·(δdp_k + δD + u·|dp_k − D|) + u·|ds_k|; coef = scale·ds: + u.
 *  - dq_i = dq0_i + Σ_k coef_k·v_ki: Σ δcoef·|v| + (n + 2)·u·(|dq0| + Σ|coef·v|) (n + 1 leaves);
 *  - dkey_i = dkey0_i + Σ over its m (query, head) items of coef·q_i + p·dO_i: Σ (δcoef·|q_i| + δp·|dO_i|)
 *    + (2m + 3)·u·(|dkey0| + Σ|terms|) (2m + 1 leaves, any order: the cpu sums query blocks first);
 *  - dsink_h = dsink0 − Σ_(b,t) p_sink·D, p_sink = exp(sink − lse): Σ p_sink·((δlse + u·|sink − lse| + E)·|D|
 *    + δD + u·|D|) + 2u·(|dsink0| + Σ|p_sink·D|) (a double sum, rounded once, added once). */
typedef struct {
    double *o, *lse, *bo, *blse;                                   /* forward */
    double *dq, *bdq, *dkv, *bdkv, *dkvc, *bdkvc, *dsink, *bdsink; /* backward, initial values included */
} aref;

static aref attn_oracle(const ain *a) {
    const acase *g = &a->g;
    const int64_t B = g->B, T = g->T, H = g->H, c = g->c, Nc = g->Nc;
    const int64_t nq = B * T * H * c, nkv = B * T * c, nkvc = B * Nc * c;
    aref r;
    r.o = dalloc(nq), r.bo = dalloc(nq), r.lse = dalloc(B * T * H), r.blse = dalloc(B * T * H);
    r.dq = dalloc(nq), r.bdq = dalloc(nq), r.dkv = dalloc(nkv), r.bdkv = dalloc(nkv), r.dkvc = dalloc(nkvc);
    r.bdkvc = dalloc(nkvc), r.dsink = dalloc(H), r.bdsink = dalloc(H);
    /* key-gradient accumulators: value, Σ carried errors, Σ|terms|, item count */
    double *kerr = dalloc(nkv + nkvc), *kabs = dalloc(nkv + nkvc);
    int64_t *kcnt = (int64_t *)cc_host((size_t)(B * (T + Nc) + 1) * sizeof(int64_t));
    double *kval = dalloc(nkv + nkvc), *serr = dalloc(H), *sabs = dalloc(H), *sval = dalloc(H);
    int64_t *rows = (int64_t *)cc_host((size_t)(T + Nc + g->K + 1) * sizeof(int64_t));
    double *s = dalloc(T + Nc + g->K + 1), *ds = dalloc(T + Nc + g->K + 1), *p = dalloc(T + Nc + g->K + 1);
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            const int64_t nk = key_rows(rows, a, b, t);
            for (int64_t h = 0; h < H; h++) {
                const int64_t bth = (b * T + t) * H + h;
                const float *q = a->q + bth * c, *go = a->dout + bth * c;
                const double snk = a->sink[h];
                double m = snk, dsmax = 0, xmax = 0;
                for (int64_t k = 0; k < nk; k++) {
                    const float *v = key_vec(a, b, rows[k]);
                    double d = 0, A = 0;
                    for (int64_t i = 0; i < c; i++) d += (double)q[i] * v[i], A += fabs((double)q[i] * v[i]);
                    s[k] = a->scale * d;
                    ds[k] = (c + 2) * U * a->scale * A + U * fabs(s[k]);
                    m = s[k] > m ? s[k] : m;
                    dsmax = ds[k] > dsmax ? ds[k] : dsmax;
                }
                double z = exp(snk - m);
                xmax = fabs(snk - m);
                for (int64_t k = 0; k < nk; k++) z += exp(s[k] - m), xmax = fmax(xmax, fabs(s[k] - m));
                const double lse = m + log(z);
                r.lse[bth] = lse;
                r.blse[bth] = dsmax + U * xmax + E + (nk + 2) * U + 2 * U * fabs(log(z)) + U * fabs(lse);
                for (int64_t k = 0; k < nk; k++) p[k] = exp(s[k] - lse);
                for (int64_t i = 0; i < c; i++) {
                    double o = 0, bo = 0;
                    for (int64_t k = 0; k < nk; k++) {
                        const double vk = key_vec(a, b, rows[k])[i];
                        const double rho = ds[k] + dsmax + U * (fabs(s[k] - m) + xmax) + 2 * E + (nk + 3) * U;
                        o += p[k] * vk;
                        bo += p[k] * fabs(vk) * (rho + (nk + 1) * U);
                    }
                    r.o[bth * c + i] = o;
                    r.bo[bth * c + i] = bo + U * fabs(o);
                }
                /* backward */
                const double dlse = r.blse[bth];
                double D = 0, dD = 0;
                for (int64_t i = 0; i < c; i++) {
                    D += go[i] * r.o[bth * c + i];
                    dD += (c + 2) * U * fabs(go[i] * r.o[bth * c + i]) + fabs((double)go[i]) * r.bo[bth * c + i];
                }
                double *dqv = r.dq + bth * c, *dqb = r.bdq + bth * c;
                for (int64_t i = 0; i < c; i++) dqv[i] = a->dq0[bth * c + i], dqb[i] = 0;
                double *dq_abs = dalloc(c);
                for (int64_t i = 0; i < c; i++) dq_abs[i] = fabs((double)a->dq0[bth * c + i]);
                for (int64_t k = 0; k < nk; k++) {
                    const float *v = key_vec(a, b, rows[k]);
                    double dp = 0, G = 0;
                    for (int64_t i = 0; i < c; i++) dp += (double)go[i] * v[i], G += fabs((double)go[i] * v[i]);
                    const double ddp = (c + 2) * U * G;
                    const double dpk = p[k] * (ds[k] + dlse + U * fabs(s[k] - lse) + E);
                    const double dsk = p[k] * (dp - D);
                    const double ddsk = dpk * fabs(dp - D) + p[k] * (ddp + dD + U * fabs(dp - D)) + U * fabs(dsk);
                    const double coef = a->scale * dsk, dcoef = a->scale * ddsk + U * fabs(coef);
                    const int64_t kr = rows[k] < T ? b * T + rows[k] : B * T + b * Nc + rows[k] - T; /* key row */
                    const int64_t ko = rows[k] < T ? (b * T + rows[k]) * c : nkv + (b * Nc + rows[k] - T) * c;
                    kcnt[kr]++;
                    for (int64_t i = 0; i < c; i++) {
                        dqv[i] += coef * v[i];
                        dqb[i] += dcoef * fabs((double)v[i]);
                        dq_abs[i] += fabs(coef * v[i]);
                        kval[ko + i] += coef * q[i] + p[k] * go[i];
                        kerr[ko + i] += dcoef * fabs((double)q[i]) + dpk * fabs((double)go[i]);
                        kabs[ko + i] += fabs(coef * q[i]) + fabs(p[k] * go[i]);
                    }
                }
                for (int64_t i = 0; i < c; i++) dqb[i] += (nk + 2) * U * dq_abs[i];
                free(dq_abs);
                const double ps = exp(snk - lse);
                sval[h] -= ps * D;
                serr[h] += ps * ((dlse + U * fabs(snk - lse) + E) * fabs(D) + dD + U * fabs(D));
                sabs[h] += fabs(ps * D);
            }
        }
    for (int64_t x = 0; x < nkv + nkvc; x++) {
        const bool w = x < nkv;
        const double d0 = w ? a->dkv0[x] : a->dkvc0[x - nkv];
        const int64_t kr = w ? x / c : B * T + (x - nkv) / c;
        const double v = d0 + kval[x], bnd = kerr[x] + (2 * kcnt[kr] + 3) * U * (fabs(d0) + kabs[x]);
        if (w)
            r.dkv[x] = v, r.bdkv[x] = bnd;
        else
            r.dkvc[x - nkv] = v, r.bdkvc[x - nkv] = bnd;
    }
    for (int64_t h = 0; h < H; h++) {
        r.dsink[h] = a->dsink0[h] + sval[h];
        r.bdsink[h] = serr[h] + 2 * U * (fabs((double)a->dsink0[h]) + sabs[h]);
    }
    free(kerr), free(kabs), free(kcnt), free(kval), free(serr), free(sabs), free(sval), free(rows), free(s), free(ds),
        free(p);
    return r;
}

static void aref_free(aref *r) {
    free(r->o), free(r->lse), free(r->bo), free(r->blse), free(r->dq), free(r->bdq), free(r->dkv), free(r->bdkv);
    free(r->dkvc), free(r->bdkvc), free(r->dsink), free(r->bdsink);
}

/* Device copies of one case's inputs and gradients (gradients reset to their initial values by reload). */
typedef struct {
    float *q, *kv, *kvc, *sink, *dout, *o, *lse, *dq, *dkv, *dkvc, *dsink;
    uint16_t *kv16, *kvc16;
    int32_t *topk;
} adev;

static adev adev_make(const ain *a) {
    const acase *g = &a->g;
    const int64_t nq = g->B * g->T * g->H * g->c, nkv = g->B * g->T * g->c, nkvc = g->B * g->Nc * g->c;
    adev d;
    memset(&d, 0, sizeof d);
    d.q = up_f(a->q, nq), d.sink = up_f(a->sink, g->H), d.dout = up_f(a->dout, nq);
    if (g->bf16) {
        d.kv16 = (uint16_t *)up_b(a->kv16, (size_t)nkv * 2), d.kvc16 = (uint16_t *)up_b(a->kvc16, (size_t)nkvc * 2);
    } else {
        d.kv = up_f(a->kv, nkv), d.kvc = up_f(a->kvc, nkvc);
    }
    if (a->topk) d.topk = (int32_t *)up_b(a->topk, (size_t)(g->B * g->T * g->K) * sizeof(int32_t));
    d.o = (float *)cc_dev((size_t)nq * 4), d.lse = (float *)cc_dev((size_t)(g->B * g->T * g->H) * 4);
    d.dq = up_f(a->dq0, nq), d.dkv = up_f(a->dkv0, nkv), d.dkvc = up_f(a->dkvc0, nkvc), d.dsink = up_f(a->dsink0, g->H);
    return d;
}

static void adev_reload_grads(adev *d, const ain *a) {
    const acase *g = &a->g;
    cc_reload(d->dq, a->dq0, (size_t)(g->B * g->T * g->H * g->c) * 4);
    cc_reload(d->dkv, a->dkv0, (size_t)(g->B * g->T * g->c) * 4);
    cc_reload(d->dkvc, a->dkvc0, (size_t)(g->B * g->Nc * g->c) * 4);
    cc_reload(d->dsink, a->dsink0, (size_t)g->H * 4);
}

static void adev_free(adev *d) {
    cc_free(d->q), cc_free(d->kv), cc_free(d->kvc), cc_free(d->sink), cc_free(d->dout), cc_free(d->o), cc_free(d->lse);
    cc_free(d->dq), cc_free(d->dkv), cc_free(d->dkvc), cc_free(d->dsink), cc_free(d->kv16), cc_free(d->kvc16);
    cc_free(d->topk);
}

#define ADIMS(g) ((sparse_attn_dims){(g).B, (g).T, (g).H, (g).c, (g).window, (g).ratio, (g).Nc, (g).K})

static sparse_attn_args adev_args(const adev *d, const ain *a) {
    sparse_attn_args x;
    memset(&x, 0, sizeof x);
    x.dims = ADIMS(a->g), x.scale = a->scale, x.q = d->q, x.kv = d->kv, x.kvc = d->kvc, x.sink = d->sink;
    x.kv16 = d->kv16, x.kvc16 = d->kvc16, x.topk = d->topk, x.o = d->o, x.lse = d->lse;
    return x;
}
static sparse_attn_grads adev_grads(const adev *d) {
    sparse_attn_grads g = {d->dout, d->dq, d->dkv, d->dkvc, d->dsink};
    return g;
}

/* The batch row b of a case as a case of its own (B = 1), pointers offset: the same rows, one launch each. */
static void args_row(sparse_attn_args *x, sparse_attn_grads *gr, const adev *d, const ain *a, int64_t b) {
    const acase *g = &a->g;
    const int64_t qo = b * g->T * g->H * g->c, ko = b * g->T * g->c, co = b * g->Nc * g->c;
    *x = adev_args(d, a);
    *gr = adev_grads(d);
    x->dims.B = 1;
    x->q += qo, x->o += qo, x->lse += b * g->T * g->H;
    if (x->kv) x->kv += ko, x->kvc += co;
    if (x->kv16) x->kv16 += ko, x->kvc16 += co;
    if (x->topk) x->topk += b * g->T * g->K;
    gr->dout += qo, gr->dq += qo, gr->dkv += ko, gr->dkvc += co;
    gr->dsink = NULL; /* a sum over every row: split, it would be two roundings */
}

static void attn_case(acase g, unsigned seed) {
    ain a = ain_make(g, seed);
    const int64_t nq = g.B * g.T * g.H * g.c, nl = g.B * g.T * g.H, nkv = g.B * g.T * g.c, nkvc = g.B * g.Nc * g.c;
    char what[160];
    /* cpu */
    float *o_c = cc_hostf(nq), *lse_c = cc_hostf(nl);
    float *dq_c = hclone(a.dq0, nq), *dkv_c = hclone(a.dkv0, nkv), *dkvc_c = hclone(a.dkvc0, nkvc + 1),
          *dsink_c = hclone(a.dsink0, g.H);
    sparse_attn_args ac;
    memset(&ac, 0, sizeof ac);
    ac.dims = ADIMS(g), ac.scale = a.scale, ac.sink = a.sink, ac.q = a.q, ac.topk = a.topk, ac.o = o_c, ac.lse = lse_c;
    if (g.bf16)
        ac.kv16 = a.kv16, ac.kvc16 = a.kvc16;
    else
        ac.kv = a.kv, ac.kvc = a.kvc;
    cpu()->sparse_attn_fwd(&k_cpu_exec, &ac);
    sparse_attn_grads gc = {a.dout, dq_c, dkv_c, dkvc_c, dsink_c};
    cpu()->sparse_attn_bwd(&k_cpu_exec, &ac, &gc);
    /* gpu, twice */
    adev d = adev_make(&a);
    sparse_attn_args x = adev_args(&d, &a);
    sparse_attn_grads gx = adev_grads(&d);
    float *res[2][6];
    for (int run = 0; run < 2; run++) {
        if (run) cc_poison(d.o, (size_t)nq * 4), cc_poison(d.lse, (size_t)nl * 4), adev_reload_grads(&d, &a);
        CC_OK(cuda_sparse_attn_fwd(S, &x));
        CC_OK(cuda_sparse_attn_bwd(S, &x, &gx));
        res[run][0] = down_f(d.o, nq), res[run][1] = down_f(d.lse, nl), res[run][2] = down_f(d.dq, nq);
        res[run][3] = down_f(d.dkv, nkv), res[run][4] = down_f(d.dkvc, nkvc), res[run][5] = down_f(d.dsink, g.H);
    }
    /* the oracle's bounds, for the gpu and the cpu */
    aref r = attn_oracle(&a);
    const float *cpu_res[6] = {o_c, lse_c, dq_c, dkv_c, dkvc_c, dsink_c};
    const double *want[6] = {r.o, r.lse, r.dq, r.dkv, r.dkvc, r.dsink}, *bnd[6] = {r.bo, r.blse, r.bdq, r.bdkv, r.bdkvc, r.bdsink};
    const int64_t n[6] = {nq, nl, nq, nkv, nkvc, g.H};
    const char *nm[6] = {"o", "lse", "dq", "dkv", "dkvc", "dsink"};
    ck_results(g.name, 6, res[0], res[1], cpu_res, want, bnd, n, nm);
    /* one launch per batch row: the same bits as one launch for all rows */
    if (g.B > 1) {
        cc_poison(d.o, (size_t)nq * 4), cc_poison(d.lse, (size_t)nl * 4), adev_reload_grads(&d, &a);
        for (int64_t b = 0; b < g.B; b++) {
            sparse_attn_args xb;
            sparse_attn_grads gb;
            args_row(&xb, &gb, &d, &a, b);
            CC_OK(cuda_sparse_attn_fwd(S, &xb));
            CC_OK(cuda_sparse_attn_bwd(S, &xb, &gb));
        }
        float *split[5] = {down_f(d.o, nq), down_f(d.lse, nl), down_f(d.dq, nq), down_f(d.dkv, nkv),
                           down_f(d.dkvc, nkvc)};
        for (int k = 0; k < 5; k++) {
            snprintf(what, sizeof what, "%s %s: one launch per batch row", g.name, nm[k]);
            cc_same_bits(what, split[k], res[0][k], (size_t)n[k] * 4);
            free(split[k]);
        }
    }
    for (int run = 0; run < 2; run++)
        for (int k = 0; k < 6; k++) free(res[run][k]);
    aref_free(&r);
    adev_free(&d);
    free(o_c), free(lse_c), free(dq_c), free(dkv_c), free(dkvc_c), free(dsink_c);
    ain_free(&a);
}

/* The four layer kinds (T not a multiple of r, window < T), tests' configs and V4's head dim. */
static void test_attn_small(void) {
    attn_case((acase){"swa", 2, 21, 5, 11, 6, 0, 0, 0, 0, 0}, 100);
    attn_case((acase){"csa-topk", 2, 21, 5, 11, 6, 4, 5, 3, 1, 0}, 110);
    attn_case((acase){"csa-dense", 2, 22, 5, 11, 6, 4, 5, 3, 0, 0}, 120);
    attn_case((acase){"hca16", 2, 37, 6, 11, 16, 16, 2, 0, 0, 0}, 130);
}
static void test_attn_configs(void) {
    /* tests/configs/tiny-a.json (window 16, ratios 4 / 16, top-4, 4 heads of 32) and tiny-b.json
     * (window 32, ratios 4 / 32, top-8, 8 heads of 64) */
    attn_case((acase){"tiny-a csa", 2, 64, 4, 32, 16, 4, 16, 4, 1, 0}, 200);
    if (!ta_full()) return;
    attn_case((acase){"tiny-a hca", 1, 64, 4, 32, 16, 16, 4, 0, 0, 0}, 210);
    attn_case((acase){"tiny-b csa", 2, 96, 8, 64, 32, 4, 24, 8, 1, 0}, 220);
    attn_case((acase){"tiny-b hca", 1, 96, 8, 64, 32, 32, 3, 0, 0, 0}, 230);
}
static void test_attn_v4_dims(void) {
    /* V4's head dim 512 and window 128 (more keys than one batch of 32), top-16 of ratio 4; bf16 keys */
    attn_case((acase){"tiny-b csa bf16", 2, 96, 8, 64, 32, 4, 24, 8, 1, 1}, 320);
    if (!ta_full()) return;
    attn_case((acase){"c512 csa", 1, 160, 3, 512, 128, 4, 40, 16, 1, 0}, 300);
    attn_case((acase){"c512 csa bf16", 2, 80, 2, 512, 128, 4, 20, 16, 1, 1}, 310);
    /* more query rows than the inverse lists' 512 chunks: 3 rows per chunk */
    attn_case((acase){"long csa", 1, 1100, 2, 16, 8, 4, 275, 8, 1, 0}, 330);
}

/* ================================================================ indexer top-k */

/* qi [B,T,HI,dI], ki [B,Nc,dI], w [B,T,HI]: the gpu's top-k equals the cpu's, slot for slot. ki has
 * repeated rows (every 5th entry copies the one before), so exact ties occur and go to the lower index. */
static void topk_case(const char *name, int64_t B, int64_t T, int64_t HI, int64_t dI, int64_t ratio, int64_t K,
                      bool bf16, unsigned seed) {
    const int64_t Nc = T / ratio, nqi = B * T * HI * dI, nki = B * Nc * dI, nw = B * T * HI, nt = B * T * K;
    float *qi = cc_hostf(nqi), *ki = cc_hostf(nki + 1), *w = cc_hostf(nw);
    cc_fill(qi, nqi, seed, 1.0f);
    cc_fill(ki, nki, seed + 1, 1.0f);
    cc_fill(w, nw, seed + 2, 1.0f);
    for (int64_t e = 1; e < B * Nc; e++)
        if (e % 5 == 0) memcpy(ki + e * dI, ki + (e - 1) * dI, (size_t)dI * 4);
    uint16_t *ki16 = NULL;
    if (bf16) ki16 = (uint16_t *)cc_host((size_t)(nki + 1) * 2), to_bf16(ki, ki16, nki);
    int32_t *tc = (int32_t *)cc_host((size_t)nt * 4), *tg = (int32_t *)cc_host((size_t)nt * 4),
            *tg2 = (int32_t *)cc_host((size_t)nt * 4);
    const float wscale = (float)(1.0 / sqrt((double)(dI * HI)));
    indexer_topk_args a;
    memset(&a, 0, sizeof a);
    a.dims = (indexer_dims){B, T, HI, dI, Nc, ratio, K};
    a.wscale = wscale, a.qi = qi, a.w = w, a.topk = tc;
    if (bf16)
        a.ki16 = ki16;
    else
        a.ki = ki;
    cpu()->indexer_topk_fwd(&k_cpu_exec, &a);
    float *dqi = up_f(qi, nqi), *dw = up_f(w, nw), *dki = bf16 ? NULL : up_f(ki, nki);
    uint16_t *dki16 = bf16 ? (uint16_t *)up_b(ki16, (size_t)nki * 2) : NULL;
    int32_t *dt = (int32_t *)cc_dev((size_t)nt * 4);
    a.qi = dqi, a.w = dw, a.ki = dki, a.ki16 = dki16, a.topk = dt;
    CC_OK(cuda_indexer_topk_fwd(S, &a));
    cc_down(tg, dt, (size_t)nt * 4);
    cc_poison(dt, (size_t)nt * 4);
    CC_OK(cuda_indexer_topk_fwd(S, &a));
    cc_down(tg2, dt, (size_t)nt * 4);
    char what[128];
    snprintf(what, sizeof what, "%s topk: gpu vs cpu", name);
    cc_same_bits(what, tg, tc, (size_t)nt * 4);
    snprintf(what, sizeof what, "%s topk: two runs", name);
    cc_same_bits(what, tg2, tg, (size_t)nt * 4);
    int64_t full = 0; /* rows where the selection actually chose (more usable entries than K) */
    for (int64_t bt = 0; bt < B * T; bt++) full += (bt % T + 1) / ratio > K;
    CHECK(full > 0, "%s: no row has more than K usable entries: the test selects nothing", name);
    free(qi), free(ki), free(w), free(ki16), free(tc), free(tg), free(tg2);
    cc_free(dqi), cc_free(dw), cc_free(dki), cc_free(dki16), cc_free(dt);
}

static void test_indexer_topk(void) {
    topk_case("tiny-a", 2, 64, 2, 16, 4, 4, false, 400);
    topk_case("odd dims", 1, 77, 3, 21, 4, 5, false, 420);
    topk_case("tiny-b bf16", 2, 96, 4, 32, 4, 8, true, 440);
    if (!ta_full()) return;
    topk_case("tiny-b", 2, 96, 4, 32, 4, 8, false, 410);
    topk_case("V4 heads", 1, 300, 64, 128, 4, 64, false, 430);
}

/* ================================================================ indexer KL loss */

typedef struct {
    const char *name;
    int64_t B, T, HI, dI, ratio, K, H, c;
    int topk, bf16;
} kcase;

/* The oracle of one KL case: kl_sum (double), n_rows, the gradients (initial values included) and their
 * bounds. Per scored row and selected entry s (n of them), heads h:
 *  - teacher terms exp(scale·q_h·kvc_s − lse_h): relative error (c+2)·u·scale·Σ|q·kvc| + u·|scale·d| +
 *    u·|x| + E; acc_s (H terms): + (H + 1)·u; z (n terms): + (n + 1)·u; p = acc/z: ρp = ρacc + ρz + u;
 *  - d_hs = qi_h·ki_s: (dI + 2)·u·Σ|qi·ki|; I_s = Σ_h ww_h·ReLU(d_hs), ww = wscale·w:
 *    δI = Σ_h (|ww|·δd + 2u·|ww·ReLU|) + (HI + 1)·u·Σ_h |ww·ReLU|;
 *  - lz = log Σ exp(I): max δI + u·max|I − m| + E + (n + 2)·u + 2u·|log zs| + u·|lz|; logq = I − lz: δI + δlz
 *    + u·|logq|;
 *  - kl_row = Σ p·(log p − logq) (double): Σ p·(ρp·|log p − logq| + ρp + 2u·|log p| + δlogq);
 *  - dI = gs·(exp(logq) − p): |gs|·(q·(δlogq + E) + p·ρp + u·|q − p|) + u·|dI|;
 *  - dw_h += wscale·Σ_s dI·d (d > 0): wscale·(Σ (δdI·|d| + |dI|·δd) + (n + 1)·u·Σ|dI·d|) + 2u·(|dw0| + ...);
 *  - dqi_h += Σ_s g·ki_s, g = dI·ww (d > 0): Σ (δg·|ki|) + (n + 2)·u·(|dqi0| + Σ|g·ki|), δg = |ww|·(δdI + 2u·|dI|);
 *    dki_s += Σ over (row, h) of g·qi_h likewise. Where |d| <= δd the float mask may differ from the
 *    exact one: the whole term |g·ki| (|g·qi|) is added to the bound. */
typedef struct {
    double kl, bkl;
    int64_t rows;
    double *dqi, *bdqi, *dki, *bdki, *dw, *bdw;
} kref;

typedef struct {
    kcase g;
    int64_t Nc;
    float scale, wscale, grad_scale;
    float *qi, *ki, *w, *q, *kvc, *lse, *dqi0, *dki0, *dw0;
    uint16_t *ki16, *kvc16;
    int32_t *topk;
} kin;

static kin kin_make(kcase g, unsigned seed) {
    kin a;
    memset(&a, 0, sizeof a);
    a.g = g;
    a.Nc = g.T / g.ratio;
    const int64_t BT = g.B * g.T, Nc = a.Nc;
    a.scale = (float)(1.0 / sqrt((double)g.c)), a.wscale = (float)(1.0 / sqrt((double)(g.dI * g.HI)));
    a.grad_scale = 0.37f;
    a.qi = cc_hostf(BT * g.HI * g.dI), a.ki = cc_hostf(g.B * Nc * g.dI + 1), a.w = cc_hostf(BT * g.HI);
    a.q = cc_hostf(BT * g.H * g.c), a.kvc = cc_hostf(g.B * Nc * g.c + 1), a.lse = cc_hostf(BT * g.H);
    a.dqi0 = cc_hostf(BT * g.HI * g.dI), a.dki0 = cc_hostf(g.B * Nc * g.dI + 1), a.dw0 = cc_hostf(BT * g.HI);
    cc_fill(a.qi, BT * g.HI * g.dI, seed, 1.0f);
    cc_fill(a.ki, g.B * Nc * g.dI, seed + 1, 1.0f);
    cc_fill(a.w, BT * g.HI, seed + 2, 1.0f);
    cc_fill(a.q, BT * g.H * g.c, seed + 3, 1.5f);
    cc_fill(a.kvc, g.B * Nc * g.c, seed + 4, 1.5f);
    cc_fill(a.dqi0, BT * g.HI * g.dI, seed + 5, 0.5f);
    cc_fill(a.dki0, g.B * Nc * g.dI, seed + 6, 0.5f);
    cc_fill(a.dw0, BT * g.HI, seed + 7, 0.5f);
    if (g.bf16) {
        a.ki16 = (uint16_t *)cc_host((size_t)(g.B * Nc * g.dI + 1) * 2);
        a.kvc16 = (uint16_t *)cc_host((size_t)(g.B * Nc * g.c + 1) * 2);
        to_bf16(a.ki, a.ki16, g.B * Nc * g.dI);
        to_bf16(a.kvc, a.kvc16, g.B * Nc * g.c);
    }
    /* lse as the main attention's: the usable entries' mass plus 1 for the window keys and the sink */
    for (int64_t bt = 0; bt < BT; bt++)
        for (int64_t h = 0; h < g.H; h++) {
            const int64_t b = bt / g.T, t = bt % g.T;
            double z = 1;
            for (int64_t e = 0; e < Nc && (e + 1) * g.ratio <= t + 1; e++) {
                double d = 0;
                for (int64_t i = 0; i < g.c; i++) d += (double)a.q[(bt * g.H + h) * g.c + i] * a.kvc[(b * Nc + e) * g.c + i];
                z += exp(a.scale * d);
            }
            a.lse[bt * g.H + h] = (float)log(z);
        }
    if (g.topk) {
        a.topk = (int32_t *)cc_host((size_t)(BT * g.K) * sizeof(int32_t));
        make_topk(a.topk, g.B, g.T, Nc, g.ratio, g.K, seed);
    }
    return a;
}

static void kin_free(kin *a) {
    free(a->qi), free(a->ki), free(a->w), free(a->q), free(a->kvc), free(a->lse), free(a->dqi0), free(a->dki0);
    free(a->dw0), free(a->ki16), free(a->kvc16), free(a->topk);
}

static kref kl_oracle(const kin *a) {
    const kcase *g = &a->g;
    const int64_t T = g->T, HI = g->HI, dI = g->dI, H = g->H, c = g->c, Nc = a->Nc, BT = g->B * T;
    kref r;
    memset(&r, 0, sizeof r);
    const int64_t nqi = BT * HI * dI, nki = g->B * Nc * dI, nw = BT * HI;
    r.dqi = dalloc(nqi), r.bdqi = dalloc(nqi), r.dki = dalloc(nki), r.bdki = dalloc(nki), r.dw = dalloc(nw);
    r.bdw = dalloc(nw);
    double *dqi_abs = dalloc(nqi), *dki_abs = dalloc(nki), *dw_abs = dalloc(nw);
    int64_t *dki_cnt = (int64_t *)cc_host((size_t)(g->B * Nc + 1) * sizeof(int64_t));
    for (int64_t x = 0; x < nqi; x++) r.dqi[x] = a->dqi0[x], dqi_abs[x] = fabs((double)a->dqi0[x]);
    for (int64_t x = 0; x < nki; x++) r.dki[x] = a->dki0[x], dki_abs[x] = fabs((double)a->dki0[x]);
    for (int64_t x = 0; x < nw; x++) r.dw[x] = a->dw0[x], dw_abs[x] = U * fabs((double)a->dw0[x]); /* rows not scored */
    const int64_t nmax = Nc + g->K + 1;
    int64_t *ids = (int64_t *)cc_host((size_t)nmax * sizeof(int64_t));
    double *p = dalloc(nmax), *rp = dalloc(nmax), *I = dalloc(nmax), *dIe = dalloc(nmax), *lq = dalloc(nmax);
    double *dlq = dalloc(nmax), *gI = dalloc(nmax), *ddI = dalloc(nmax);
    double *d = dalloc(nmax * HI), *dd = dalloc(nmax * HI);
    for (int64_t bt = 0; bt < BT; bt++) {
        const int64_t b = bt / T, t = bt % T;
        int64_t n = 0;
        if (a->topk) {
            for (int64_t k = 0; k < g->K; k++) {
                int32_t id = a->topk[bt * g->K + k];
                if (id >= 0 && id < Nc) ids[n++] = id;
            }
        } else {
            for (int64_t e = 0; e < Nc && (e + 1) * g->ratio <= t + 1; e++) ids[n++] = e;
        }
        if (n == 0) continue;
        /* teacher */
        double z = 0, racc_max = 0;
        for (int64_t j = 0; j < n; j++) {
            double acc = 0, eps = 0;
            for (int64_t h = 0; h < H; h++) {
                double dd_ = 0, A = 0;
                const float *qv = a->q + (bt * H + h) * c, *kv = a->kvc + (b * Nc + ids[j]) * c;
                for (int64_t i = 0; i < c; i++) dd_ += (double)qv[i] * kv[i], A += fabs((double)qv[i] * kv[i]);
                const double x = a->scale * dd_ - a->lse[bt * H + h];
                acc += exp(x);
                eps = fmax(eps, (c + 2) * U * a->scale * A + U * fabs(a->scale * dd_) + U * fabs(x) + E);
            }
            p[j] = acc, rp[j] = eps + (H + 1) * U;
            z += acc, racc_max = fmax(racc_max, rp[j]);
        }
        const double rz = racc_max + (n + 1) * U;
        for (int64_t j = 0; j < n; j++) p[j] /= z, rp[j] += rz + U;
        /* student */
        double m = -INFINITY, dImax = 0;
        for (int64_t j = 0; j < n; j++) {
            double s = 0, err = 0, sabs = 0;
            for (int64_t h = 0; h < HI; h++) {
                const double ww = (double)a->wscale * a->w[bt * HI + h];
                const float *qv = a->qi + (bt * HI + h) * dI, *kv = a->ki + (b * Nc + ids[j]) * dI;
                double dv = 0, A = 0;
                for (int64_t i = 0; i < dI; i++) dv += (double)qv[i] * kv[i], A += fabs((double)qv[i] * kv[i]);
                d[j * HI + h] = dv, dd[j * HI + h] = (dI + 2) * U * A;
                const double rl = dv > 0 ? dv : 0;
                s += ww * rl;
                err += fabs(ww) * dd[j * HI + h] + 2 * U * fabs(ww * rl);
                sabs += fabs(ww * rl);
            }
            I[j] = s, dIe[j] = err + (HI + 1) * U * sabs;
            m = fmax(m, s), dImax = fmax(dImax, dIe[j]);
        }
        double zs = 0, xmax = 0;
        for (int64_t j = 0; j < n; j++) zs += exp(I[j] - m), xmax = fmax(xmax, fabs(I[j] - m));
        const double lz = m + log(zs);
        const double dlz = dImax + U * xmax + E + (n + 2) * U + 2 * U * fabs(log(zs)) + U * fabs(lz);
        double kl = 0, bkl = 0;
        for (int64_t j = 0; j < n; j++) {
            lq[j] = I[j] - lz, dlq[j] = dIe[j] + dlz + U * fabs(lq[j]);
            const double lp = log(p[j]);
            kl += p[j] * (lp - lq[j]);
            bkl += p[j] * (rp[j] * fabs(lp - lq[j]) + rp[j] + 2 * U * fabs(lp) + dlq[j]);
            const double qj = exp(lq[j]);
            gI[j] = a->grad_scale * (qj - p[j]);
            ddI[j] = fabs(a->grad_scale) * (qj * (dlq[j] + E) + p[j] * rp[j] + U * fabs(qj - p[j])) + U * fabs(gI[j]);
        }
        r.kl += kl, r.bkl += bkl, r.rows++;
        /* gradients */
        for (int64_t h = 0; h < HI; h++) {
            const double ww = (double)a->wscale * a->w[bt * HI + h];
            double dwr = 0, dwe = 0, dwa = 0;
            const int64_t qo = (bt * HI + h) * dI;
            for (int64_t j = 0; j < n; j++) {
                const double dv = d[j * HI + h], ddv = dd[j * HI + h];
                const bool on = dv > 0, maybe = fabs(dv) <= ddv; /* the float mask may differ */
                if (on) dwr += gI[j] * dv;
                dwe += ddI[j] * fabs(dv) + fabs(gI[j]) * ddv;
                dwa += fabs(gI[j] * dv);
                const double gq = gI[j] * ww, dg = fabs(ww) * (ddI[j] + 2 * U * fabs(gI[j]));
                const int64_t ko = (b * Nc + ids[j]) * dI;
                dki_cnt[b * Nc + ids[j]]++;
                for (int64_t i = 0; i < dI; i++) {
                    const double kv = a->ki[ko + i], qv = a->qi[qo + i];
                    if (on) r.dqi[qo + i] += gq * kv, r.dki[ko + i] += gq * qv;
                    r.bdqi[qo + i] += dg * fabs(kv) + (maybe ? fabs(gq * kv) : 0);
                    r.bdki[ko + i] += dg * fabs(qv) + (maybe ? fabs(gq * qv) : 0);
                    dqi_abs[qo + i] += fabs(gq * kv), dki_abs[ko + i] += fabs(gq * qv);
                }
            }
            const double ws = a->wscale;
            r.dw[bt * HI + h] = a->dw0[bt * HI + h] + ws * dwr;
            dw_abs[bt * HI + h] = ws * (dwe + (n + 1) * U * dwa) + 2 * U * (fabs((double)a->dw0[bt * HI + h]) + ws * dwa);
            for (int64_t i = 0; i < dI; i++) r.bdqi[qo + i] += (n + 2) * U * dqi_abs[qo + i], dqi_abs[qo + i] = 0;
        }
    }
    for (int64_t x = 0; x < nw; x++) r.bdw[x] = dw_abs[x];
    for (int64_t x = 0; x < nki; x++) r.bdki[x] += (dki_cnt[x / dI] + 2) * U * dki_abs[x];
    free(dqi_abs), free(dki_abs), free(dw_abs), free(dki_cnt), free(ids), free(p), free(rp), free(I), free(dIe);
    free(lq), free(dlq), free(gI), free(ddI), free(d), free(dd);
    return r;
}

static void kref_free(kref *r) {
    free(r->dqi), free(r->bdqi), free(r->dki), free(r->bdki), free(r->dw), free(r->bdw);
}

static void kl_case(kcase g, unsigned seed) {
    kin a = kin_make(g, seed);
    const int64_t BT = g.B * g.T, Nc = a.Nc, nqi = BT * g.HI * g.dI, nki = g.B * Nc * g.dI, nw = BT * g.HI;
    /* cpu */
    float *dqi_c = hclone(a.dqi0, nqi), *dki_c = hclone(a.dki0, nki + 1), *dw_c = hclone(a.dw0, nw);
    double kl_c = 0;
    int64_t rows_c = 0;
    indexer_kl_args x;
    memset(&x, 0, sizeof x);
    x.dims = (indexer_dims){g.B, g.T, g.HI, g.dI, Nc, g.ratio, g.K};
    x.H = g.H, x.c = g.c, x.scale = a.scale, x.wscale = a.wscale, x.grad_scale = a.grad_scale;
    x.qi = a.qi, x.w = a.w, x.q = a.q, x.lse = a.lse, x.topk = a.topk;
    if (g.bf16)
        x.ki16 = a.ki16, x.kvc16 = a.kvc16;
    else
        x.ki = a.ki, x.kvc = a.kvc;
    x.dqi = dqi_c, x.dki = dki_c, x.dw = dw_c, x.kl_sum = &kl_c, x.n_rows = &rows_c;
    cpu()->indexer_kl_fwd_bwd(&k_cpu_exec, &x);
    /* gpu, twice */
    float *d_qi = up_f(a.qi, nqi), *d_w = up_f(a.w, nw), *d_q = up_f(a.q, BT * g.H * g.c), *d_lse = up_f(a.lse, BT * g.H);
    float *d_ki = g.bf16 ? NULL : up_f(a.ki, nki), *d_kvc = g.bf16 ? NULL : up_f(a.kvc, g.B * Nc * g.c);
    uint16_t *d_ki16 = g.bf16 ? (uint16_t *)up_b(a.ki16, (size_t)nki * 2) : NULL;
    uint16_t *d_kvc16 = g.bf16 ? (uint16_t *)up_b(a.kvc16, (size_t)(g.B * Nc * g.c) * 2) : NULL;
    int32_t *d_topk = a.topk ? (int32_t *)up_b(a.topk, (size_t)(BT * g.K) * 4) : NULL;
    float *d_dqi = up_f(a.dqi0, nqi), *d_dki = up_f(a.dki0, nki), *d_dw = up_f(a.dw0, nw);
    double *d_kl = (double *)cc_dev(sizeof(double));
    int64_t *d_rows = (int64_t *)cc_dev(sizeof(int64_t));
    x.qi = d_qi, x.w = d_w, x.q = d_q, x.lse = d_lse, x.ki = d_ki, x.kvc = d_kvc, x.ki16 = d_ki16, x.kvc16 = d_kvc16;
    x.topk = d_topk, x.dqi = d_dqi, x.dki = d_dki, x.dw = d_dw, x.kl_sum = d_kl, x.n_rows = d_rows;
    float *res[2][3];
    double kl_g[2];
    int64_t rows_g[2];
    for (int run = 0; run < 2; run++) {
        if (run) {
            cc_reload(d_dqi, a.dqi0, (size_t)nqi * 4), cc_reload(d_dki, a.dki0, (size_t)nki * 4);
            cc_reload(d_dw, a.dw0, (size_t)nw * 4), cc_poison(d_kl, 8), cc_poison(d_rows, 8);
        }
        CC_OK(cuda_indexer_kl_fwd_bwd(S, &x));
        res[run][0] = down_f(d_dqi, nqi), res[run][1] = down_f(d_dki, nki), res[run][2] = down_f(d_dw, nw);
        cc_down(&kl_g[run], d_kl, 8), cc_down(&rows_g[run], d_rows, 8);
    }
    kref r = kl_oracle(&a);
    CHECK(rows_g[0] == r.rows && rows_c == r.rows, "%s: rows gpu %lld, cpu %lld, oracle %lld", g.name,
          (long long)rows_g[0], (long long)rows_c, (long long)r.rows);
    const double bkl = r.bkl + 64 * UD * fabs(r.kl);
    t_note("  %s kl: gpu err/bound %.3g, cpu %.3g", g.name, fabs(kl_g[0] - r.kl) / bkl, fabs(kl_c - r.kl) / bkl);
    CHECK(fabs(kl_g[0] - r.kl) <= bkl, "%s: gpu kl_sum %.12g vs oracle %.12g (bound %.3g)", g.name, kl_g[0], r.kl, bkl);
    CHECK(fabs(kl_c - r.kl) <= bkl, "%s: cpu kl_sum %.12g vs oracle %.12g (bound %.3g)", g.name, kl_c, r.kl, bkl);
    CHECK(memcmp(&kl_g[0], &kl_g[1], 8) == 0 && rows_g[0] == rows_g[1], "%s: kl_sum / n_rows differ between runs",
          g.name);
    const float *cres[3] = {dqi_c, dki_c, dw_c};
    const double *want[3] = {r.dqi, r.dki, r.dw}, *bnd[3] = {r.bdqi, r.bdki, r.bdw};
    const int64_t n[3] = {nqi, nki, nw};
    const char *nm[3] = {"dqi", "dki", "dw"};
    ck_results(g.name, 3, res[0], res[1], cres, want, bnd, n, nm);
    for (int run = 0; run < 2; run++)
        for (int k = 0; k < 3; k++) free(res[run][k]);
    kref_free(&r);
    cc_free(d_qi), cc_free(d_w), cc_free(d_q), cc_free(d_lse), cc_free(d_ki), cc_free(d_kvc), cc_free(d_ki16);
    cc_free(d_kvc16), cc_free(d_topk), cc_free(d_dqi), cc_free(d_dki), cc_free(d_dw), cc_free(d_kl), cc_free(d_rows);
    free(dqi_c), free(dki_c), free(dw_c);
    kin_free(&a);
}

static void test_indexer_kl(void) {
    kl_case((kcase){"kl tiny-a topk", 2, 64, 2, 16, 4, 4, 4, 32, 1, 0}, 500);
    kl_case((kcase){"kl tiny-a dense", 2, 64, 2, 16, 4, 4, 4, 32, 0, 0}, 510);
    kl_case((kcase){"kl tiny-b topk bf16", 1, 96, 4, 32, 4, 8, 8, 64, 1, 1}, 530);
    if (!ta_full()) return;
    kl_case((kcase){"kl tiny-b topk", 1, 96, 4, 32, 4, 8, 8, 64, 1, 0}, 520);
    kl_case((kcase){"kl V4 heads", 1, 72, 64, 128, 4, 16, 4, 512, 1, 0}, 540);
    kl_case((kcase){"kl long topk", 1, 1100, 2, 16, 4, 8, 2, 16, 1, 0}, 550); /* 3 rows per inverse-list chunk */
    kl_case((kcase){"kl 96 heads", 1, 64, 96, 128, 4, 8, 2, 16, 1, 0}, 560);  /* 49 KiB of shared memory a row */
}

/* ================================================================ compressor pooling */

/* The oracle per (b, i, ch) over its slots (n of them): v = z + ape (u·|v|), x = v − m (u·|x|; the max m
 * cancels), e = exp(x): ρe = u·|v| + u·|x| + E; se = Σ e: ρse = max ρe + (n + 1)·u;
 * out = Σ e·a / se: Σ e·|a|·(ρe + (n + 1)·u)/se + |out|·(ρse + u).
 * Backward: wg = e·dout/se: |wg|·(ρe + ρse + 2u); t = wg·(a − out): δwg·|a − out| + |wg|·(δout + u·|a − out|)
 * + u·|t|; da = da0 + wg, dz = dz0 + t: + u of the sum; dape = dape0 + Σ over (b, i) of t:
 * Σ δt + (m + 2)·u·(|dape0| + Σ|t|) for m terms. */
static void comp_case(const char *name, int64_t B, int64_t T, int64_t r, int64_t d, bool ov, unsigned seed) {
    const int64_t C = ov ? 2 * d : d, Nc = T / r, ns = ov ? 2 * r : r, na = B * T * C, no = B * Nc * d, nape = r * C;
    float *a = cc_hostf(na), *z = cc_hostf(na), *ape = cc_hostf(nape), *dout = cc_hostf(no);
    float *da0 = cc_hostf(na), *dz0 = cc_hostf(na), *dape0 = cc_hostf(nape);
    cc_fill(a, na, seed, 1.0f), cc_fill(z, na, seed + 1, 2.0f), cc_fill(ape, nape, seed + 2, 1.0f);
    cc_fill(dout, no, seed + 3, 1.0f), cc_fill(da0, na, seed + 4, 0.5f), cc_fill(dz0, na, seed + 5, 0.5f);
    cc_fill(dape0, nape, seed + 6, 0.5f);
    /* oracle */
    double *o = dalloc(no), *bo = dalloc(no), *vda = dalloc(na), *bda = dalloc(na), *vdz = dalloc(na), *bdz = dalloc(na);
    double *vdape = dalloc(nape), *bdape = dalloc(nape), *adape = dalloc(nape);
    int64_t *cdape = (int64_t *)cc_host((size_t)nape * sizeof(int64_t));
    for (int64_t x = 0; x < na; x++) vda[x] = da0[x], vdz[x] = dz0[x], bda[x] = bdz[x] = 0;
    for (int64_t x = 0; x < nape; x++) vdape[x] = dape0[x], adape[x] = fabs((double)dape0[x]);
    double *v = dalloc(ns), *e = dalloc(ns), *re = dalloc(ns);
    int64_t *row = (int64_t *)cc_host((size_t)ns * sizeof(int64_t)), *prow = (int64_t *)cc_host((size_t)ns * sizeof(int64_t));
    for (int64_t bi = 0; bi < B * Nc; bi++)
        for (int64_t ch = 0; ch < d; ch++) {
            const int64_t b = bi / Nc, i = bi % Nc;
            int64_t n = 0;
            for (int64_t s = 0; s < ns; s++) {
                int64_t tok, u, off;
                if (!ov) tok = i * r + s, u = s, off = 0;
                else if (s < r) {
                    if (i == 0) continue;
                    tok = (i - 1) * r + s, u = s, off = 0;
                } else tok = i * r + s - r, u = s - r, off = d;
                row[n] = (b * T + tok) * C + off + ch, prow[n] = u * C + off + ch;
                v[n] = (double)z[row[n]] + ape[prow[n]];
                n++;
            }
            double m = -INFINITY, se = 0, sa = 0, sea = 0, rmax = 0;
            for (int64_t k = 0; k < n; k++) m = fmax(m, v[k]);
            for (int64_t k = 0; k < n; k++) {
                e[k] = exp(v[k] - m), re[k] = U * fabs(v[k]) + U * fabs(v[k] - m) + E;
                se += e[k], sa += e[k] * a[row[k]], rmax = fmax(rmax, re[k]);
            }
            const double rse = rmax + (n + 1) * U, out = sa / se;
            for (int64_t k = 0; k < n; k++) sea += e[k] * fabs((double)a[row[k]]) * (re[k] + (n + 1) * U);
            o[bi * d + ch] = out;
            const double bout = sea / se + fabs(out) * (rse + U);
            bo[bi * d + ch] = bout;
            const double go = dout[bi * d + ch];
            for (int64_t k = 0; k < n; k++) {
                const double wg = e[k] / se * go, dwg = fabs(wg) * (re[k] + rse + 2 * U);
                const double am = a[row[k]] - out, t = wg * am;
                const double dt = dwg * fabs(am) + fabs(wg) * (bout + U * fabs(am)) + U * fabs(t);
                vda[row[k]] += wg, bda[row[k]] = dwg * (1 + U) + U * fabs(vda[row[k]]); /* |fl(x̂) − x| <= |x̂ − x| + u·|x̂| */
                vdz[row[k]] += t, bdz[row[k]] = dt * (1 + U) + U * fabs(vdz[row[k]]);
                vdape[prow[k]] += t, bdape[prow[k]] += dt, adape[prow[k]] += fabs(t), cdape[prow[k]]++;
            }
        }
    for (int64_t x = 0; x < nape; x++) bdape[x] += (cdape[x] + 2) * U * adape[x];
    /* cpu */
    float *o_c = cc_hostf(no), *da_c = hclone(da0, na), *dz_c = hclone(dz0, na), *dape_c = hclone(dape0, nape);
    compressor_pool_args x = {{B, T, r, d, ov}, a, z, ape, o_c};
    cpu()->compressor_pool_fwd(&k_cpu_exec, &x);
    compressor_pool_grads gx = {dout, da_c, dz_c, dape_c};
    cpu()->compressor_pool_bwd(&k_cpu_exec, &x, &gx);
    /* gpu, twice */
    float *d_a = up_f(a, na), *d_z = up_f(z, na), *d_ape = up_f(ape, nape), *d_dout = up_f(dout, no);
    float *d_o = (float *)cc_dev((size_t)no * 4), *d_da = up_f(da0, na), *d_dz = up_f(dz0, na), *d_dape = up_f(dape0, nape);
    x = (compressor_pool_args){{B, T, r, d, ov}, d_a, d_z, d_ape, d_o};
    gx = (compressor_pool_grads){d_dout, d_da, d_dz, d_dape};
    float *res[2][4];
    for (int run = 0; run < 2; run++) {
        if (run) {
            cc_poison(d_o, (size_t)no * 4), cc_reload(d_da, da0, (size_t)na * 4), cc_reload(d_dz, dz0, (size_t)na * 4);
            cc_reload(d_dape, dape0, (size_t)nape * 4);
        }
        CC_OK(cuda_compressor_pool_fwd(S, &x));
        CC_OK(cuda_compressor_pool_bwd(S, &x, &gx));
        res[run][0] = down_f(d_o, no), res[run][1] = down_f(d_da, na), res[run][2] = down_f(d_dz, na);
        res[run][3] = down_f(d_dape, nape);
    }
    const float *cres[4] = {o_c, da_c, dz_c, dape_c};
    const double *want[4] = {o, vda, vdz, vdape}, *bnd[4] = {bo, bda, bdz, bdape};
    const int64_t n[4] = {no, na, na, nape};
    const char *nm[4] = {"out", "da", "dz", "dape"};
    ck_results(name, 4, res[0], res[1], cres, want, bnd, n, nm);
    for (int run = 0; run < 2; run++)
        for (int k = 0; k < 4; k++) free(res[run][k]);
    free(a), free(z), free(ape), free(dout), free(da0), free(dz0), free(dape0), free(o), free(bo), free(vda), free(bda);
    free(vdz), free(bdz), free(vdape), free(bdape), free(adape), free(cdape), free(v), free(e), free(re), free(row);
    free(prow), free(o_c), free(da_c), free(dz_c), free(dape_c);
    cc_free(d_a), cc_free(d_z), cc_free(d_ape), cc_free(d_dout), cc_free(d_o), cc_free(d_da), cc_free(d_dz);
    cc_free(d_dape);
}

static void test_compressor(void) {
    comp_case("pool r4 overlap", 2, 22, 4, 24, true, 600);     /* tail tokens dropped */
    comp_case("pool r16", 2, 37, 16, 20, false, 610);
    if (!ta_full()) return;
    comp_case("pool tiny-b r32", 1, 96, 32, 64, false, 620);
    comp_case("pool V4 main r4", 1, 64, 4, 512, true, 630);   /* d 512, coff 2 */
    comp_case("pool V4 hca r128", 1, 256, 128, 512, false, 640);
}

/* ================================================================ argument checks */

static void test_bad_sizes(void) {
    sparse_attn_args x;
    memset(&x, 0, sizeof x);
    x.dims = (sparse_attn_dims){1, -2, 1, 4, 1, 0, 0, 0};
    CHECK(cuda_sparse_attn_fwd(S, &x) == DS4_ERR_ARG, "negative T accepted");
    float one = 0;
    sparse_attn_grads xg = {&one, &one, NULL, NULL, NULL};
    CHECK(cuda_sparse_attn_bwd(S, &x, &xg) == DS4_ERR_ARG, "backward: negative T accepted");
    indexer_kl_args k;
    memset(&k, 0, sizeof k);
    k.dims = (indexer_dims){1, 8, 1, 4, 2, 4, -3};
    k.H = 1, k.c = 4;
    CHECK(cuda_indexer_kl_fwd_bwd(S, &k) == DS4_ERR_ARG, "KL: negative K accepted");
    indexer_topk_args t;
    memset(&t, 0, sizeof t);
    t.dims = (indexer_dims){1, 4, -1, 4, 1, 4, 1};
    CHECK(cuda_indexer_topk_fwd(S, &t) == DS4_ERR_ARG, "negative HI accepted");
    compressor_pool_args c;
    memset(&c, 0, sizeof c);
    c.dims = (compressor_dims){-1, 4, 4, 4, false};
    CHECK(cuda_compressor_pool_fwd(S, &c) == DS4_ERR_ARG, "negative B accepted");
    compressor_pool_grads cg = {&one, &one, NULL, &one};
    CHECK(cuda_compressor_pool_bwd(S, &c, &cg) == DS4_ERR_ARG, "backward: negative B accepted");
}

int main(void) {
    CUDA_TEST_BEGIN("test_cuda_attn");
    if (!ta_full()) t_note("%s: DS4_CUDA_SMALL: the large cases are skipped", "test_cuda_attn");
    CC_RUN(test_attn_small);
    CC_RUN(test_attn_configs);
    CC_RUN(test_attn_v4_dims);
    CC_RUN(test_indexer_topk);
    CC_RUN(test_indexer_kl);
    CC_RUN(test_compressor);
    CC_RUN(test_bad_sizes);
    CUDA_TEST_END("test_cuda_attn");
}
