/* Scalar oracles of the basic ops: linear, grouped linear, embedding, RMSNorm, RoPE, clamped
 * SwiGLU, compressor pooling, the MoE gate and cross-entropy (see oracle.h). Plain double loops,
 * written from docs/dsv4-architecture.md §2, §4.1, §4.4, §4.7, §5 and docs/contract.md. */
#include "kernels/ref/oracle.h"

#include <math.h>
#include <stddef.h>

/* ---------------------------------------------------------------- linear */

/* out[n, o] = Σ_i inp[n, i]·w[o, i] */
void oracle_linear_fwd(double *out, const double *inp, const double *w, int64_t N, int64_t IC, int64_t OC) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t o = 0; o < OC; o++) {
            double s = 0;
            for (int64_t i = 0; i < IC; i++) s += inp[n * IC + i] * w[o * IC + i];
            out[n * OC + o] = s;
        }
}

/* ∂out[n, o]/∂inp[n, i] = w[o, i]  ⇒ dinp[n, i] += Σ_o dout[n, o]·w[o, i]
 * ∂out[n, o]/∂w[o, i] = inp[n, i]  ⇒ dw[o, i]  += Σ_n dout[n, o]·inp[n, i] */
void oracle_linear_bwd(double *dinp, double *dw, const double *dout, const double *inp, const double *w, int64_t N,
                       int64_t IC, int64_t OC) {
    if (dinp)
        for (int64_t n = 0; n < N; n++)
            for (int64_t i = 0; i < IC; i++) {
                double s = 0;
                for (int64_t o = 0; o < OC; o++) s += dout[n * OC + o] * w[o * IC + i];
                dinp[n * IC + i] += s;
            }
    if (dw)
        for (int64_t o = 0; o < OC; o++)
            for (int64_t i = 0; i < IC; i++) {
                double s = 0;
                for (int64_t n = 0; n < N; n++) s += dout[n * OC + o] * inp[n * IC + i];
                dw[o * IC + i] += s;
            }
}

/* z[n, g, r] = Σ_i o[n, g, i]·w[g, r, i] */
void oracle_grouped_linear_fwd(double *z, const double *o, const double *w, int64_t N, int64_t G, int64_t R,
                               int64_t Din) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t g = 0; g < G; g++)
            for (int64_t r = 0; r < R; r++) {
                double s = 0;
                for (int64_t i = 0; i < Din; i++) s += o[(n * G + g) * Din + i] * w[(g * R + r) * Din + i];
                z[(n * G + g) * R + r] = s;
            }
}

/* do[n, g, i] += Σ_r dz[n, g, r]·w[g, r, i];  dw[g, r, i] += Σ_n dz[n, g, r]·o[n, g, i] */
void oracle_grouped_linear_bwd(double *do_, double *dw, const double *dz, const double *o, const double *w,
                               int64_t N, int64_t G, int64_t R, int64_t Din) {
    for (int64_t g = 0; g < G; g++)
        for (int64_t i = 0; i < Din; i++) {
            if (do_)
                for (int64_t n = 0; n < N; n++) {
                    double s = 0;
                    for (int64_t r = 0; r < R; r++) s += dz[(n * G + g) * R + r] * w[(g * R + r) * Din + i];
                    do_[(n * G + g) * Din + i] += s;
                }
            if (dw)
                for (int64_t r = 0; r < R; r++) {
                    double s = 0;
                    for (int64_t n = 0; n < N; n++) s += dz[(n * G + g) * R + r] * o[(n * G + g) * Din + i];
                    dw[(g * R + r) * Din + i] += s;
                }
        }
}

/* ---------------------------------------------------------------- embedding */

void oracle_embedding_fwd(double *out, const double *table, const int32_t *ids, int64_t N, int64_t D) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) out[n * D + j] = table[(int64_t)ids[n] * D + j];
}

void oracle_embedding_bwd(double *dtable, const double *dout, const int32_t *ids, int64_t N, int64_t D) {
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < D; j++) dtable[(int64_t)ids[n] * D + j] += dout[n * D + j];
}

/* ---------------------------------------------------------------- RMSNorm */

static double rms_inv(const double *x, int64_t D, double eps) {
    double ss = 0;
    for (int64_t j = 0; j < D; j++) ss += x[j] * x[j];
    return 1.0 / sqrt(ss / (double)D + eps);
}

void oracle_rmsnorm_fwd(double *y, double *rstd, const double *x, const double *w, int64_t N, int64_t D,
                        double eps) {
    for (int64_t n = 0; n < N; n++) {
        double r = rms_inv(x + n * D, D, eps);
        if (rstd) rstd[n] = r;
        for (int64_t j = 0; j < D; j++) y[n * D + j] = (w ? w[j] : 1.0) * x[n * D + j] * r;
    }
}

/* y_j = w_j·x_j·r, r = (Σ x²/D + eps)^(-1/2), ∂r/∂x_i = −r³·x_i/D. With g = dy:
 * dx_i = Σ_j g_j·∂y_j/∂x_i = w_i·g_i·r − (r³/D)·x_i·Σ_j g_j·w_j·x_j;   dw_j = Σ_n g_j·x_j·r. */
void oracle_rmsnorm_bwd(double *dx, double *dw, const double *dy, const double *x, const double *w, int64_t N,
                        int64_t D, double eps) {
    for (int64_t n = 0; n < N; n++) {
        const double *xr = x + n * D, *g = dy + n * D;
        double r = rms_inv(xr, D, eps);
        double gwx = 0;
        for (int64_t j = 0; j < D; j++) gwx += g[j] * (w ? w[j] : 1.0) * xr[j];
        if (dx)
            for (int64_t i = 0; i < D; i++)
                dx[n * D + i] += (w ? w[i] : 1.0) * g[i] * r - r * r * r / (double)D * xr[i] * gwx;
        if (dw && w)
            for (int64_t j = 0; j < D; j++) dw[j] += g[j] * xr[j] * r;
    }
}

/* ---------------------------------------------------------------- RoPE */

/* The dim index at which frequency θ_i makes `turns` full turns over L positions:
 * L·base^(−2i/rd) = 2π·turns  ⇔  i = rd·ln(L/(2π·turns)) / (2·ln base). */
static double yarn_dim(double turns, int64_t rd, double base, int64_t L) {
    return (double)rd * log((double)L / (2.0 * M_PI * turns)) / (2.0 * log(base));
}

void oracle_rope_freqs(double *theta, int64_t rd, double base, double factor, int64_t original_seq_len,
                       double beta_fast, double beta_slow) {
    double low = 0, high = 0;
    if (original_seq_len > 0) {
        low = fmax(floor(yarn_dim(beta_fast, rd, base, original_seq_len)), 0.0);
        high = fmin(ceil(yarn_dim(beta_slow, rd, base, original_seq_len)), (double)(rd - 1));
        if (high == low) high = low + 0.001; /* a ramp of width 0 would divide by 0 */
    }
    for (int64_t i = 0; i < rd / 2; i++) {
        double th = pow(base, -2.0 * (double)i / (double)rd);
        if (original_seq_len > 0) {
            double ramp = fmin(fmax(((double)i - low) / (high - low), 0.0), 1.0); /* 0: keep θ, 1: θ/factor */
            th = ramp * (th / factor) + (1.0 - ramp) * th;
        }
        theta[i] = th;
    }
}

/* Rotation of the pair (x0, x1) by angle a: (x0·cos a − x1·sin a, x0·sin a + x1·cos a). */
static void rotate_pairs(double *x, int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult,
                         const double *theta, double sign) {
    for (int64_t n = 0; n < N; n++) {
        double pos = (double)((n % period) * mult);
        for (int64_t h = 0; h < H; h++)
            for (int64_t i = 0; i < rd / 2; i++) {
                double *p = x + (n * H + h) * hd + (hd - rd) + 2 * i;
                double a = sign * pos * theta[i], x0 = p[0], x1 = p[1];
                p[0] = x0 * cos(a) - x1 * sin(a);
                p[1] = x0 * sin(a) + x1 * cos(a);
            }
    }
}

void oracle_rope_fwd(double *x, int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult,
                     const double *theta, bool inverse) {
    rotate_pairs(x, N, H, hd, rd, period, mult, theta, inverse ? -1.0 : 1.0);
}

/* y = R(a)·x  ⇒  dx = R(a)^T·dy = R(−a)·dy. */
void oracle_rope_bwd(double *dx, int64_t N, int64_t H, int64_t hd, int64_t rd, int64_t period, int64_t mult,
                     const double *theta, bool inverse) {
    rotate_pairs(dx, N, H, hd, rd, period, mult, theta, inverse ? 1.0 : -1.0);
}

/* ---------------------------------------------------------------- SwiGLU */

static double sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

void oracle_swiglu_fwd(double *act, const double *g, const double *u, int64_t n_el, double limit) {
    for (int64_t t = 0; t < n_el; t++) {
        double gc = limit > 0 ? fmin(g[t], limit) : g[t];
        double uc = limit > 0 ? fmin(fmax(u[t], -limit), limit) : u[t];
        act[t] = gc * sigmoid(gc) * uc;
    }
}

/* silu(g) = g·σ(g), silu'(g) = σ(g) + g·σ(g)(1 − σ(g)); a clamped input is constant: gradient 0. */
void oracle_swiglu_bwd(double *dg, double *du, const double *dact, const double *g, const double *u, int64_t n_el,
                       double limit) {
    for (int64_t t = 0; t < n_el; t++) {
        bool g_clamped = limit > 0 && g[t] > limit;
        bool u_clamped = limit > 0 && fabs(u[t]) > limit;
        double gc = g_clamped ? limit : g[t];
        double uc = u_clamped ? copysign(limit, u[t]) : u[t];
        double sg = sigmoid(gc);
        if (dg && !g_clamped) dg[t] += dact[t] * uc * (sg + gc * sg * (1.0 - sg));
        if (du && !u_clamped) du[t] += dact[t] * gc * sg;
    }
}

/* ---------------------------------------------------------------- compressor pooling */

/* Slot s of entry i (s < 2r with overlap, else s < r): its token, its place u in its block and its
 * column offset. Returns false for the absent previous block of entry 0. */
static bool pool_slot(int64_t s, int64_t i, int64_t r, int64_t d, bool overlap, int64_t *tok, int64_t *u,
                      int64_t *col) {
    if (!overlap) {
        *tok = i * r + s, *u = s, *col = 0;
        return true;
    }
    if (s < r) { /* previous block, first d columns */
        *tok = (i - 1) * r + s, *u = s, *col = 0;
        return i > 0;
    }
    *tok = i * r + s - r, *u = s - r, *col = d; /* current block, last d columns */
    return true;
}

/* Softmax weights wt[s] of the slots of entry (b, i), channel ch (0 for absent slots). */
static void pool_weights(double *wt, const double *z, const double *ape, int64_t b, int64_t i, int64_t ch,
                         int64_t T, int64_t r, int64_t d, bool overlap) {
    int64_t C = overlap ? 2 * d : d, ns = overlap ? 2 * r : r, tok, u, col;
    double m = -INFINITY, sum = 0;
    for (int64_t s = 0; s < ns; s++)
        if (pool_slot(s, i, r, d, overlap, &tok, &u, &col))
            m = fmax(m, z[(b * T + tok) * C + col + ch] + ape[u * C + col + ch]);
    for (int64_t s = 0; s < ns; s++) {
        wt[s] = 0;
        if (pool_slot(s, i, r, d, overlap, &tok, &u, &col))
            wt[s] = exp(z[(b * T + tok) * C + col + ch] + ape[u * C + col + ch] - m);
        sum += wt[s];
    }
    for (int64_t s = 0; s < ns; s++) wt[s] /= sum;
}

/* out[b, i, ch] = Σ_s wt_s·a[slot s] */
void oracle_compressor_pool_fwd(double *out, const double *a, const double *z, const double *ape, int64_t B,
                                int64_t T, int64_t r, int64_t d, bool overlap) {
    if (r <= 0) return;
    int64_t C = overlap ? 2 * d : d, ns = overlap ? 2 * r : r, Nc = T / r, tok, u, col;
    double wt[ns];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Nc; i++)
            for (int64_t ch = 0; ch < d; ch++) {
                pool_weights(wt, z, ape, b, i, ch, T, r, d, overlap);
                double o = 0;
                for (int64_t s = 0; s < ns; s++)
                    if (pool_slot(s, i, r, d, overlap, &tok, &u, &col)) o += wt[s] * a[(b * T + tok) * C + col + ch];
                out[(b * Nc + i) * d + ch] = o;
            }
}

/* out = Σ_s wt_s·a_s, wt = softmax(v), v_s = z_s + ape_u:
 * ∂out/∂a_s = wt_s;  ∂out/∂v_s = wt_s·(a_s − out) (softmax Jacobian), and ∂v_s/∂z_s = ∂v_s/∂ape_u = 1. */
void oracle_compressor_pool_bwd(double *da, double *dz, double *dape, const double *dout, const double *a,
                                const double *z, const double *ape, int64_t B, int64_t T, int64_t r, int64_t d,
                                bool overlap) {
    if (r <= 0) return;
    int64_t C = overlap ? 2 * d : d, ns = overlap ? 2 * r : r, Nc = T / r, tok, u, col;
    double wt[ns];
    for (int64_t b = 0; b < B; b++)
        for (int64_t i = 0; i < Nc; i++)
            for (int64_t ch = 0; ch < d; ch++) {
                pool_weights(wt, z, ape, b, i, ch, T, r, d, overlap);
                double o = 0, g = dout[(b * Nc + i) * d + ch];
                for (int64_t s = 0; s < ns; s++)
                    if (pool_slot(s, i, r, d, overlap, &tok, &u, &col)) o += wt[s] * a[(b * T + tok) * C + col + ch];
                for (int64_t s = 0; s < ns; s++) {
                    if (!pool_slot(s, i, r, d, overlap, &tok, &u, &col)) continue;
                    int64_t at = (b * T + tok) * C + col + ch;
                    double dv = g * wt[s] * (a[at] - o);
                    if (da) da[at] += g * wt[s];
                    if (dz) dz[at] += dv;
                    if (dape) dape[u * C + col + ch] += dv;
                }
            }
}

/* ---------------------------------------------------------------- MoE gate */

/* torch's softplus: log(1 + e^x), the identity above 20. */
static double softplus(double x) { return x > 20 ? x : log1p(exp(x)); }

/* Is expert e ranked before expert f? Higher value first, the lower id on a tie. */
static bool ranks_before(double ve, int64_t e, double vf, int64_t f) { return ve > vf || (ve == vf && e < f); }

void oracle_moe_gate_fwd(int32_t *idx, double *weights, double *scores, const double *logits, const double *bias,
                         const int64_t *tid2eid, const int32_t *ids, int64_t N, int64_t E, int64_t K,
                         double route_scale) {
    for (int64_t n = 0; n < N; n++) {
        const double *l = logits + n * E;
        double *s = scores + n * E;
        int32_t *ix = idx + n * K;
        for (int64_t e = 0; e < E; e++) s[e] = sqrt(softplus(l[e]));
        if (tid2eid) {
            for (int64_t k = 0; k < K; k++) ix[k] = (int32_t)tid2eid[(int64_t)ids[n] * K + k];
        } else { /* expert e takes place `rank` = the number of experts ranked before it */
            for (int64_t e = 0; e < E; e++) {
                double ve = s[e] + (bias ? bias[e] : 0.0);
                int64_t rank = 0;
                for (int64_t f = 0; f < E; f++)
                    if (f != e && ranks_before(s[f] + (bias ? bias[f] : 0.0), f, ve, e)) rank++;
                if (rank < K) ix[rank] = (int32_t)e;
            }
        }
        double S = 0;
        for (int64_t k = 0; k < K; k++) S += s[ix[k]];
        for (int64_t k = 0; k < K; k++) weights[n * K + k] = route_scale * s[ix[k]] / S;
    }
}

/* w_k = R·s_k/S, S = Σ_k s_k:  ∂w_k/∂s_m = R·(δ_km/S − s_k/S²)  ⇒  ds_m = (R/S)·(dw_m − Σ_k dw_k·s_k/S);
 * s = sqrt(sp(l)):  ds/dl = sp'(l)/(2s), sp'(l) = σ(l) (1 above the threshold 20). */
void oracle_moe_gate_bwd(double *dlogits, const double *dweights, const double *logits, const int32_t *idx,
                         int64_t N, int64_t E, int64_t K, double route_scale) {
    for (int64_t n = 0; n < N; n++) {
        const double *l = logits + n * E, *dw = dweights + n * K;
        const int32_t *ix = idx + n * K;
        double S = 0, dot = 0;
        for (int64_t k = 0; k < K; k++) S += sqrt(softplus(l[ix[k]]));
        for (int64_t k = 0; k < K; k++) dot += dw[k] * sqrt(softplus(l[ix[k]])) / S;
        for (int64_t k = 0; k < K; k++) {
            int64_t e = ix[k];
            double s = sqrt(softplus(l[e]));
            double dsdl = s > 0 ? (l[e] > 20 ? 1.0 : sigmoid(l[e])) / (2.0 * s) : 0.0;
            dlogits[n * E + e] += route_scale / S * (dw[k] - dot) * dsdl;
        }
    }
}

/* ---------------------------------------------------------------- cross-entropy */

/* loss = log Σ_v exp(l_v) − l_t;  ∂loss/∂l_v = softmax(l)_v − [v == t]. */
void oracle_cross_entropy(double *loss_sum, int64_t *n_scored, double *dlogits, const double *logits,
                          const int32_t *targets, int64_t N, int64_t V, double grad_scale) {
    *loss_sum = 0;
    *n_scored = 0;
    for (int64_t n = 0; n < N; n++) {
        const double *l = logits + n * V;
        int32_t t = targets[n];
        bool scored = t >= 0 && t < V;
        double m = -INFINITY, z = 0;
        for (int64_t v = 0; v < V; v++) m = fmax(m, l[v]);
        for (int64_t v = 0; v < V; v++) z += exp(l[v] - m);
        if (scored) *loss_sum += m + log(z) - l[t], (*n_scored)++;
        if (dlogits)
            for (int64_t v = 0; v < V; v++)
                dlogits[n * V + v] = scored ? grad_scale * (exp(l[v] - m) / z - (v == t ? 1.0 : 0.0)) : 0.0;
    }
}
