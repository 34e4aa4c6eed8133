/* Scalar oracles of the attention family (docs/dsv4-architecture.md §4.5, §4.6, §4.10, §6.3;
 * docs/contract.md "indexer_loss", "Selections"): sparse shared-KV attention with sinks, the
 * lightning-indexer top-k and the indexer KL loss with its gradient (see oracle.h).
 * Every query row scans all T + Nc candidate key rows and asks oracle_attn_key_count whether each is
 * one of its keys: slow and plain on purpose. */
#include "kernels/ref/oracle.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---------------------------------------------------------------- key sets */

int64_t oracle_attn_key_count(int64_t j, int64_t b, int64_t t, const int32_t *topk, int64_t T, int64_t window,
                              int64_t ratio, int64_t Nc, int64_t K) {
    if (j < T) return j <= t && j > t - window ? 1 : 0; /* window: t−window < j <= t */
    int64_t i = j - T;
    if (ratio <= 0 || i >= Nc) return 0;
    if (!topk) return (i + 1) * ratio <= t + 1 ? 1 : 0; /* every usable entry */
    int64_t count = 0;
    for (int64_t k = 0; k < K; k++) count += topk[(b * T + t) * K + k] == i;
    return count;
}

/* Key row j of batch b: kv[b, j] (j < T) or kvc[b, j − T]. */
static const double *key_row(const double *kv, const double *kvc, int64_t b, int64_t j, int64_t T, int64_t Nc,
                             int64_t c) {
    return j < T ? kv + (b * T + j) * c : kvc + (b * Nc + j - T) * c;
}

static double dot(const double *a, const double *b, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

/* One (b, t, h): cnt[j] (key multiplicities) and s[j] = scale·q·key_j over the nrow = T + Nc rows;
 * returns lse = log(Σ_j cnt_j·exp(s_j) + exp(sink)), and o [c] = Σ_j cnt_j·exp(s_j − lse)·key_j. */
static double attn_row(double *o, int64_t *cnt, double *s, const double *qv, const double *kv, const double *kvc,
                       const int32_t *topk, double sink, int64_t b, int64_t t, int64_t T, int64_t c, int64_t window,
                       int64_t ratio, int64_t Nc, int64_t K, double scale) {
    int64_t nrow = T + Nc;
    double m = sink, z = 0;
    for (int64_t j = 0; j < nrow; j++) {
        cnt[j] = oracle_attn_key_count(j, b, t, topk, T, window, ratio, Nc, K);
        s[j] = cnt[j] ? scale * dot(qv, key_row(kv, kvc, b, j, T, Nc, c), c) : -INFINITY;
        m = fmax(m, s[j]);
    }
    for (int64_t i = 0; i < c; i++) o[i] = 0;
    if (m == -INFINITY) return -INFINITY; /* no key and a −inf sink: nothing to attend to */
    z = exp(sink - m);
    for (int64_t j = 0; j < nrow; j++) z += (double)cnt[j] * exp(s[j] - m);
    double lse = m + log(z);
    for (int64_t j = 0; j < nrow; j++) {
        if (!cnt[j]) continue;
        double p = (double)cnt[j] * exp(s[j] - lse);
        const double *key = key_row(kv, kvc, b, j, T, Nc, c);
        for (int64_t i = 0; i < c; i++) o[i] += p * key[i];
    }
    return lse;
}

void oracle_sparse_attn_fwd(double *o, double *lse, const double *q, const double *kv, const double *kvc,
                            const int32_t *topk, const double *sink, int64_t B, int64_t T, int64_t H, int64_t c,
                            int64_t window, int64_t ratio, int64_t Nc, int64_t K, double scale) {
    if (!kvc) ratio = 0, Nc = 0;
    int64_t *cnt = malloc((size_t)(T + Nc) * sizeof(int64_t));
    double *s = malloc((size_t)(T + Nc) * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                int64_t bth = (b * T + t) * H + h;
                lse[bth] = attn_row(o + bth * c, cnt, s, q + bth * c, kv, kvc, topk, sink[h], b, t, T, c, window,
                                    ratio, Nc, K, scale);
            }
    free(cnt), free(s);
}

/* L = Σ dout·o, o = Σ_j p_j·key_j, p_j = exp(s_j − lse), p_sink = exp(sink − lse), Σ p + p_sink = 1.
 * ∂p_j/∂s_k = p_j(δ_jk − p_k), ∂p_j/∂sink = −p_j·p_sink. With dp_j = dout·key_j and Dsum = dout·o:
 *   ds_j = p_j·(dp_j − Dsum);  dsink = −p_sink·Dsum;
 *   dq = scale·Σ_j ds_j·key_j;  dkey_j += scale·ds_j·q (as a key) + p_j·dout (as a value).
 * A key taken twice (a repeated topk id) counts twice. */
void oracle_sparse_attn_bwd(double *dq, double *dkv, double *dkvc, double *dsink, const double *dout,
                            const double *q, const double *kv, const double *kvc, const int32_t *topk,
                            const double *sink, int64_t B, int64_t T, int64_t H, int64_t c, int64_t window,
                            int64_t ratio, int64_t Nc, int64_t K, double scale) {
    if (!kvc) ratio = 0, Nc = 0, dkvc = NULL;
    int64_t *cnt = malloc((size_t)(T + Nc) * sizeof(int64_t));
    double *s = malloc((size_t)(T + Nc) * sizeof(double)), *o = malloc((size_t)c * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++)
            for (int64_t h = 0; h < H; h++) {
                int64_t bth = (b * T + t) * H + h;
                const double *qv = q + bth * c, *g = dout + bth * c;
                double lse = attn_row(o, cnt, s, qv, kv, kvc, topk, sink[h], b, t, T, c, window, ratio, Nc, K, scale);
                if (lse == -INFINITY) continue;
                double Dsum = dot(g, o, c);
                if (dsink) dsink[h] -= exp(sink[h] - lse) * Dsum;
                for (int64_t j = 0; j < T + Nc; j++) {
                    if (!cnt[j]) continue;
                    const double *key = key_row(kv, kvc, b, j, T, Nc, c);
                    double p = (double)cnt[j] * exp(s[j] - lse);
                    double ds = p * (dot(g, key, c) - Dsum);
                    double *dkey = j < T ? (dkv ? dkv + (b * T + j) * c : NULL)
                                         : (dkvc ? dkvc + (b * Nc + j - T) * c : NULL);
                    for (int64_t i = 0; i < c; i++) {
                        if (dq) dq[bth * c + i] += scale * ds * key[i];
                        if (dkey) dkey[i] += scale * ds * qv[i] + p * g[i];
                    }
                }
            }
    free(cnt), free(s), free(o);
}

/* ---------------------------------------------------------------- indexer scores and top-k */

double oracle_indexer_score(const double *qi, const double *ki, const double *w, int64_t b, int64_t t, int64_t s,
                            int64_t T, int64_t HI, int64_t dI, int64_t Nc, double wscale) {
    double I = 0;
    for (int64_t h = 0; h < HI; h++) {
        double d = dot(qi + ((b * T + t) * HI + h) * dI, ki + (b * Nc + s) * dI, dI);
        I += wscale * w[(b * T + t) * HI + h] * (d > 0 ? d : 0);
    }
    return I;
}

/* Entries of query t whose whole block is in the past: (s+1)·ratio <= t+1. */
static int64_t usable_entries(int64_t t, int64_t ratio, int64_t Nc) {
    if (ratio <= 0) return 0;
    int64_t nu = (t + 1) / ratio;
    return nu < Nc ? nu : Nc;
}

void oracle_indexer_topk(int32_t *topk, const double *qi, const double *ki, const double *w, int64_t B, int64_t T,
                         int64_t HI, int64_t dI, int64_t Nc, int64_t ratio, int64_t K, double wscale) {
    double *I = malloc((size_t)(Nc > 0 ? Nc : 1) * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            int32_t *out = topk + (b * T + t) * K;
            int64_t nu = usable_entries(t, ratio, Nc), n = 0;
            for (int64_t s = 0; s < nu; s++) I[s] = oracle_indexer_score(qi, ki, w, b, t, s, T, HI, dI, Nc, wscale);
            /* entry s is selected iff fewer than K entries rank before it (higher score, or equal and lower index);
             * scanning s upwards writes the selection in ascending order */
            for (int64_t s = 0; s < nu && n < K; s++) {
                int64_t before = 0;
                for (int64_t u = 0; u < nu; u++) before += I[u] > I[s] || (I[u] == I[s] && u < s);
                if (before < K) out[n++] = (int32_t)s;
            }
            for (; n < K; n++) out[n] = -1;
        }
    free(I);
}

/* ---------------------------------------------------------------- indexer KL */

/* The set S of row (b, t) as a list of entry ids (a repeated topk id is listed twice). Returns its size. */
static int64_t kl_set(int32_t *ids, const int32_t *topk, int64_t b, int64_t t, int64_t T, int64_t ratio, int64_t Nc,
                      int64_t K) {
    int64_t n = 0;
    if (!topk) {
        for (int64_t s = 0; s < usable_entries(t, ratio, Nc); s++) ids[n++] = (int32_t)s;
        return n;
    }
    for (int64_t k = 0; k < K; k++) {
        int32_t s = topk[(b * T + t) * K + k];
        if (s >= 0 && s < Nc) ids[n++] = s;
    }
    return n;
}

/* kl = Σ_s p_s(log p_s − log q_s), q = softmax(I) over S, p fixed, Σ p = 1:
 *   ∂kl/∂I_m = −Σ_s p_s(δ_sm − q_m) = q_m − p_m =: dI_m.
 * I_s = Σ_h wscale·w_h·ReLU(d_hs), d_hs = qi_h·ki_s:
 *   dw_h += Σ_s dI_s·wscale·ReLU(d_hs);  dqi_h += Σ_s dI_s·wscale·w_h·[d_hs > 0]·ki_s;
 *   dki_s += Σ_h dI_s·wscale·w_h·[d_hs > 0]·qi_h;   all times grad_scale. */
void oracle_indexer_kl(double *kl_sum, int64_t *n_rows, double *dqi, double *dki, double *dw, const double *qi,
                       const double *ki, const double *w, const int32_t *topk, const double *q, const double *kvc,
                       const double *lse, int64_t B, int64_t T, int64_t H, int64_t c, int64_t HI, int64_t dI,
                       int64_t Nc, int64_t ratio, int64_t K, double scale, double wscale, double grad_scale) {
    *kl_sum = 0;
    *n_rows = 0;
    if (ratio <= 0) return;
    int64_t nmax = (topk ? K : Nc) > 0 ? (topk ? K : Nc) : 1;
    int32_t *ids = malloc((size_t)nmax * sizeof(int32_t));
    double *p = malloc((size_t)nmax * sizeof(double)), *I = malloc((size_t)nmax * sizeof(double));
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) {
            int64_t bt = b * T + t, n = kl_set(ids, topk, b, t, T, ratio, Nc, K);
            if (n == 0) continue;
            /* teacher: the main attention's probability of entry s, summed over heads, L1-normalised over S */
            double mass = 0;
            for (int64_t j = 0; j < n; j++) {
                p[j] = 0;
                for (int64_t h = 0; h < H; h++)
                    p[j] += exp(scale * dot(q + (bt * H + h) * c, kvc + (b * Nc + ids[j]) * c, c) - lse[bt * H + h]);
                mass += p[j];
            }
            if (!(mass > 0) || !isfinite(mass)) continue;
            for (int64_t j = 0; j < n; j++) p[j] /= mass;
            /* student: log softmax over S of the indexer scores */
            double m = -INFINITY, z = 0, kl = 0;
            for (int64_t j = 0; j < n; j++) {
                I[j] = oracle_indexer_score(qi, ki, w, b, t, ids[j], T, HI, dI, Nc, wscale);
                m = fmax(m, I[j]);
            }
            for (int64_t j = 0; j < n; j++) z += exp(I[j] - m);
            for (int64_t j = 0; j < n; j++)
                if (p[j] > 0) kl += p[j] * (log(p[j]) - (I[j] - m - log(z)));
            *kl_sum += kl;
            (*n_rows)++;
            for (int64_t j = 0; j < n; j++) {
                double dIj = grad_scale * (exp(I[j] - m) / z - p[j]);
                const double *kv_s = ki + (b * Nc + ids[j]) * dI;
                for (int64_t h = 0; h < HI; h++) {
                    const double *qh = qi + (bt * HI + h) * dI;
                    double d = dot(qh, kv_s, dI), wh = wscale * w[bt * HI + h];
                    if (dw) dw[bt * HI + h] += dIj * wscale * (d > 0 ? d : 0);
                    if (!(d > 0)) continue;
                    for (int64_t i = 0; i < dI; i++) {
                        if (dqi) dqi[(bt * HI + h) * dI + i] += dIj * wh * kv_s[i];
                        if (dki) dki[(b * Nc + ids[j]) * dI + i] += dIj * wh * qh[i];
                    }
                }
            }
        }
    free(ids), free(p), free(I);
}
