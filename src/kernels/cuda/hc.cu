/* mHC on the GPU (docs/dsv4-architecture.md §3; semantics: kernels.h hc_*; the cpu code: cpu/hc.inc).
 *
 * Per token, n streams of width D: X [n, D] as x [n·D]; M = (2+n)·n mixes (pre [0, n), post [n, 2n),
 * comb [2n, 2n+n²)). One block of HC_THREADS per token for the forward and the per-token part of the
 * backward; the cross-token sums of the backward (dfn, dbase, dscale) run one thread per output element
 * over the tokens in order, as the cpu does.
 *
 * Every dot product is cpu/hc.inc's hc_dot in its own order: 16 lanes (a half-warp here: lane l sums
 * elements l, l + 16, ... of the whole 16-blocks), the lanes folded 8, 4, 2, 1 apart, then the tail; with
 * -fmad=false that is the cpu's bits. Sinkhorn (per token, one thread) runs the cpu's steps; its
 * backward recomputes step s's input from the softmax instead of storing all steps (O(steps²) tiny
 * steps of n² elements). Only expf and logf differ from the cpu's libm. */
#include "kernels/cuda/attn_util.cuh" /* au_with_ws */
#include "kernels/cuda/cuda_common.cuh"
#include "kernels/cuda/hc.cuh"

#define HC_THREADS 256
#define HC_HALVES (HC_THREADS / 16) /* half-warps of a block: the dot products in flight */
#define HC_MMAX ((2 + HC_CUDA_NMAX) * HC_CUDA_NMAX)

/* ---------------------------------------------------------------- dot products */

/* a·b over n elements in hc_dot's order, by the 16 lanes of a half-warp (l = lane within it). Both
 * half-warps of a warp must call it together (the shuffles span the warp); every lane returns the sum. */
__device__ __forceinline__ float hc_dot16(const float *a, const float *b, int64_t n, int l) {
    const int64_t nfull = n / 16 * 16;
    float acc = 0.f;
    for (int64_t k = l; k < nfull; k += 16) acc += a[k] * b[k];
    for (int w = 8; w > 0; w >>= 1) {
        float o = __shfl_down_sync(0xffffffffu, acc, w, 16);
        if (l < w) acc += o;
    }
    float s = __shfl_sync(0xffffffffu, acc, 0, 16);
    for (int64_t k = nfull; k < n; k++) s += a[k] * b[k];
    return s;
}

/* The same sum by one thread (short vectors: the M mixes). */
__device__ __forceinline__ float hc_dot1(const float *a, const float *b, int64_t n) {
    float acc[16];
    for (int l = 0; l < 16; l++) acc[l] = 0.f;
    int64_t k = 0;
    for (; k + 16 <= n; k += 16)
        for (int l = 0; l < 16; l++) acc[l] += a[k + l] * b[k + l];
    for (int w = 8; w > 0; w >>= 1)
        for (int l = 0; l < w; l++) acc[l] += acc[l + w];
    float s = acc[0];
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* Dot products job = 0..njobs-1 of one block, each by a half-warp: out[job] = a(job)·b(job) over n.
 * Every thread of the block calls it; the jobs' vectors come from `vec(job, &a, &b)`. */
template <typename Vec>
__device__ __forceinline__ void hc_dots(float *out, int njobs, int64_t n, Vec vec) {
    const int half = threadIdx.x >> 4, l = threadIdx.x & 15;
    for (int j0 = 0; j0 < njobs; j0 += HC_HALVES) {
        const int job = j0 + half < njobs ? j0 + half : njobs - 1; /* spare half-warps redo the last job */
        const float *a, *b;
        vec(job, &a, &b);
        float s = hc_dot16(a, b, n, l);
        if (l == 0 && j0 + half < njobs) out[job] = s;
    }
    __syncthreads();
}

/* ---------------------------------------------------------------- Sinkhorn (§3.2), one thread */

__device__ __forceinline__ float hc_sigmoid(float a) { return 1.f / (1.f + expf(-a)); }

/* Number of Sinkhorn normalisations: one column step, then (iters-1) × (row, column); step s is a row
 * step iff s is odd (cpu/hc.c hc_sk_steps). */
__device__ __forceinline__ int64_t hc_sk_steps(int64_t iters) { return 1 + 2 * (iters > 1 ? iters - 1 : 0); }

/* sm [n, n] = softmax over k of mixes[2n+nj+k]·scale[2] + base[2n+nj+k]. */
__device__ void hc_comb_softmax(float *sm, const float *mixes, const float *scale, const float *base, int64_t n) {
    const float *mc = mixes + 2 * n, *bc = base + 2 * n;
    for (int64_t j = 0; j < n; j++) {
        float *row = sm + j * n, mx = -INFINITY;
        for (int64_t k = 0; k < n; k++) {
            row[k] = mc[j * n + k] * scale[2] + bc[j * n + k];
            mx = row[k] > mx ? row[k] : mx;
        }
        float s = 0.f;
        for (int64_t k = 0; k < n; k++) {
            row[k] = expf(row[k] - mx);
            s += row[k];
        }
        for (int64_t k = 0; k < n; k++) row[k] /= s;
    }
}

/* dst = src / (Σ_axis src + eps) over rows (row != 0) or columns; inv [n] = 1 / (sum + eps). In place ok. */
__device__ void hc_sk_step(float *dst, float *inv, const float *src, int64_t n, int row, float eps) {
    if (row) {
        for (int64_t j = 0; j < n; j++) {
            float s = 0.f;
            for (int64_t k = 0; k < n; k++) s += src[j * n + k];
            inv[j] = 1.f / (s + eps);
            for (int64_t k = 0; k < n; k++) dst[j * n + k] = src[j * n + k] * inv[j];
        }
    } else {
        for (int64_t k = 0; k < n; k++) inv[k] = src[k];
        for (int64_t j = 1; j < n; j++)
            for (int64_t k = 0; k < n; k++) inv[k] += src[j * n + k];
        for (int64_t k = 0; k < n; k++) inv[k] = 1.f / (inv[k] + eps);
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = 0; k < n; k++) dst[j * n + k] = src[j * n + k] * inv[k];
    }
}

/* Backward of one step y = x·inv, in place on g: dx = (g − Σ_axis g⊙y)·inv. */
__device__ void hc_sk_step_bwd(float *g, const float *y, const float *inv, int64_t n, int row) {
    float gy[HC_CUDA_NMAX];
    if (row) {
        for (int64_t j = 0; j < n; j++) {
            gy[j] = 0.f;
            for (int64_t k = 0; k < n; k++) gy[j] += g[j * n + k] * y[j * n + k];
        }
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = 0; k < n; k++) g[j * n + k] = (g[j * n + k] - gy[j]) * inv[j];
    } else {
        for (int64_t k = 0; k < n; k++) gy[k] = g[k] * y[k];
        for (int64_t j = 1; j < n; j++)
            for (int64_t k = 0; k < n; k++) gy[k] += g[j * n + k] * y[j * n + k];
        for (int64_t j = 0; j < n; j++)
            for (int64_t k = 0; k < n; k++) g[j * n + k] = (g[j * n + k] - gy[k]) * inv[k];
    }
}

/* pre[j] = sigmoid(mixes[j]·scale[0] + base[j]) + eps. */
__device__ void hc_pre_weights(float *pre, const float *mixes, const float *scale, const float *base, int64_t n,
                               float eps) {
    for (int64_t j = 0; j < n; j++) pre[j] = hc_sigmoid(mixes[j] * scale[0] + base[j]) + eps;
}

__device__ void hc_sinkhorn_fwd(float *pre, float *post, float *comb, const float *mixes, const float *scale,
                                const float *base, int64_t n, int64_t iters, float eps) {
    hc_pre_weights(pre, mixes, scale, base, n, eps);
    for (int64_t j = 0; j < n; j++) post[j] = 2 * hc_sigmoid(mixes[n + j] * scale[1] + base[n + j]);
    hc_comb_softmax(comb, mixes, scale, base, n);
    for (int64_t e = 0; e < n * n; e++) comb[e] += eps;
    float inv[HC_CUDA_NMAX];
    const int64_t steps = hc_sk_steps(iters);
    for (int64_t s = 0; s < steps; s++) hc_sk_step(comb, inv, comb, n, (int)(s & 1), eps);
}

/* dmixes, dscale, dbase += the gradient from dpre, dpost, dcomb (any NULL = 0). Step s's output and inv
 * are recomputed from the softmax (the same operations as the forward, so the same bits). */
__device__ void hc_sinkhorn_bwd(float *dmixes, float *dscale, float *dbase, const float *dpre, const float *dpost,
                                const float *dcomb, const float *mixes, const float *scale, const float *base,
                                int64_t n, int64_t iters, float eps) {
    for (int64_t j = 0; j < n; j++)
        for (int part = 0; part < 2; part++) {
            const float *dout = part ? dpost : dpre;
            if (!dout) continue;
            const int64_t i = part * n + j;
            const float sg = hc_sigmoid(mixes[i] * scale[part] + base[i]);
            const float da = dout[j] * (part ? 2.f : 1.f) * sg * (1 - sg);
            if (dmixes) dmixes[i] += da * scale[part];
            if (dscale) dscale[part] += da * mixes[i];
            if (dbase) dbase[i] += da;
        }
    if (!dcomb) return;
    const int64_t nn = n * n, steps = hc_sk_steps(iters);
    float sm[HC_CUDA_NMAX * HC_CUDA_NMAX], y[HC_CUDA_NMAX * HC_CUDA_NMAX], g[HC_CUDA_NMAX * HC_CUDA_NMAX];
    float inv[HC_CUDA_NMAX];
    hc_comb_softmax(sm, mixes, scale, base, n);
    for (int64_t e = 0; e < nn; e++) g[e] = dcomb[e];
    for (int64_t s = steps - 1; s >= 0; s--) {
        for (int64_t e = 0; e < nn; e++) y[e] = sm[e] + eps;
        for (int64_t q = 0; q <= s; q++) hc_sk_step(y, inv, y, n, (int)(q & 1), eps); /* y = output of step s */
        hc_sk_step_bwd(g, y, inv, n, (int)(s & 1));
    }
    const int64_t o = 2 * n;
    for (int64_t j = 0; j < n; j++) {
        float gs = 0.f;
        for (int64_t k = 0; k < n; k++) gs += g[j * n + k] * sm[j * n + k];
        for (int64_t k = 0; k < n; k++) {
            const int64_t e = j * n + k;
            const float dL = (g[e] - gs) * sm[e];
            if (dmixes) dmixes[o + e] += dL * scale[2];
            if (dscale) dscale[2] += dL * mixes[o + e];
            if (dbase) dbase[o + e] += dL;
        }
    }
}

__global__ void hc_sinkhorn_fwd_kernel(hc_sinkhorn_args a) {
    hc_sinkhorn_fwd(a.pre, a.post, a.comb, a.mixes, a.scale, a.base, a.n, a.iters, a.eps);
}
__global__ void hc_sinkhorn_bwd_kernel(hc_sinkhorn_args a, hc_sinkhorn_grads g) {
    hc_sinkhorn_bwd(g.dmixes, g.dscale, g.dbase, g.dpre, g.dpost, g.dcomb, a.mixes, a.scale, a.base, a.n, a.iters,
                    a.eps);
}

/* ---------------------------------------------------------------- hc_pre / hc_head forward */

/* The vectors of the mixes' dots of token x: job 0 = x·x, job 1 + i = fn[i]·x. */
struct hc_mix_vecs {
    const float *x, *fn;
    int64_t nD;
    __device__ void operator()(int job, const float **a, const float **b) const {
        *a = job == 0 ? x : fn + (int64_t)(job - 1) * nD;
        *b = x;
    }
};

/* rsqrt over all n·D elements, then mixes [M] = (fn·x)·rsqrt, into mx (shared) and the saved outputs.
 * dots: M + 1 floats of shared memory. */
__device__ __forceinline__ void hc_block_mixes(float *mx, float *dots, const float *x, const float *fn, int64_t M,
                                               int64_t nD, float norm_eps, float *mixes_out, float *rsqrt_out) {
    hc_dots(dots, (int)M + 1, nD, hc_mix_vecs{x, fn, nD});
    if (threadIdx.x == 0) {
        const float rs = 1.f / sqrtf(dots[0] / (float)nD + norm_eps);
        *rsqrt_out = rs;
        for (int64_t i = 0; i < M; i++) mixes_out[i] = mx[i] = dots[1 + i] * rs;
    }
}

/* y [D] = Σ_j w[j]·X[j] (j ascending per element). */
__device__ __forceinline__ void hc_block_collapse(float *y, const float *X, const float *w, int64_t n, int64_t D) {
    for (int64_t d = threadIdx.x; d < D; d += HC_THREADS) {
        float v = w[0] * X[d];
        for (int64_t j = 1; j < n; j++) v += w[j] * X[j * D + d];
        y[d] = v;
    }
}

/* One block per token: mixes, Sinkhorn (pre, post, comb), y. */
__global__ void __launch_bounds__(HC_THREADS) hc_pre_fwd_kernel(hc_pre_args a) {
    __shared__ float mx[HC_MMAX], dots[HC_MMAX + 1], pre[HC_CUDA_NMAX];
    const int64_t t = blockIdx.x, n = a.dims.n, D = a.dims.D, M = (2 + n) * n, nD = n * D;
    const float *x = a.X + t * nD;
    hc_block_mixes(mx, dots, x, a.fn, M, nD, a.norm_eps, a.mixes + t * M, a.rsqrt + t);
    if (threadIdx.x == 0)
        hc_sinkhorn_fwd(pre, a.post + t * n, a.comb + t * n * n, mx, a.scale, a.base, n, a.dims.iters, a.hc_eps);
    __syncthreads();
    hc_block_collapse(a.y + t * D, x, pre, n, D);
}

/* One block per token: mixes [n], pre = sigmoid(mixes·scale[0] + base) + eps, y. */
__global__ void __launch_bounds__(HC_THREADS) hc_head_fwd_kernel(hc_head_args a) {
    __shared__ float mx[HC_CUDA_NMAX], dots[HC_CUDA_NMAX + 1], pre[HC_CUDA_NMAX];
    const int64_t t = blockIdx.x, n = a.dims.n, D = a.dims.D, nD = n * D;
    const float *x = a.X + t * nD;
    hc_block_mixes(mx, dots, x, a.fn, n, nD, a.norm_eps, a.mixes + t * n, a.rsqrt + t);
    if (threadIdx.x == 0) hc_pre_weights(pre, mx, a.scale, a.base, n, a.hc_eps);
    __syncthreads();
    hc_block_collapse(a.y + t * D, x, pre, n, D);
}

/* ---------------------------------------------------------------- hc_pre / hc_head backward
 * Workspace per token (width W = n + 2M + 3): pre [n], gm = ∂/∂mixes [M], its dbase part [M], its
 * dscale part [3]. */

__host__ __device__ static inline int64_t hc_ws_width(int64_t n, int64_t M) { return n + 2 * M + 3; }

size_t cuda_hc_bwd_workspace_bytes(int64_t N, int64_t n, int64_t M) {
    return (size_t)(N * hc_ws_width(n, M)) * sizeof(float);
}

/* The vectors of ⟨dy, X[j]⟩. */
struct hc_dy_vecs {
    const float *dy, *X;
    int64_t D;
    __device__ void operator()(int job, const float **a, const float **b) const {
        *a = dy;
        *b = X + (int64_t)job * D;
    }
};

/* dX of token t from the collapse and the mixes path (cpu hc_mix_bwd, per element in its order):
 * dX[j] += pre[j]·dy − cx·x, then dX += Σ_i r·gm[i]·fn[i] (i ascending), cx = r²/(nD)·⟨gm, mixes⟩. */
__device__ __forceinline__ void hc_block_dx(float *dx, const float *dy, const float *x, const float *fn,
                                            const float *mx, const float *ws_t, float r, int64_t n, int64_t D,
                                            int64_t M, float *cx_s) {
    const float *pre = ws_t, *gm = ws_t + n;
    const int64_t nD = n * D;
    if (threadIdx.x == 0) *cx_s = r * r / (float)nD * hc_dot1(gm, mx, M);
    __syncthreads();
    const float cx = *cx_s;
    for (int64_t c = threadIdx.x; c < nD; c += HC_THREADS) {
        const int64_t j = c / D, d = c % D;
        float v = dx[c];
        if (dy)
            v += pre[j] * dy[d] - cx * x[c];
        else
            v -= cx * x[c];
        for (int64_t i = 0; i < M; i++) v += r * gm[i] * fn[i * nD + c];
        dx[c] = v;
    }
}

/* One block per token: pre, ⟨dy, X[j]⟩, the Sinkhorn backward into the token's workspace, then its dX. */
__global__ void __launch_bounds__(HC_THREADS) hc_pre_bwd_token_kernel(hc_pre_args a, hc_pre_grads g, float *ws) {
    __shared__ float dpre[HC_CUDA_NMAX], cx;
    const int64_t t = blockIdx.x, n = a.dims.n, D = a.dims.D, M = (2 + n) * n, nD = n * D, W = hc_ws_width(n, M);
    float *w = ws + t * W;
    const float *mx = a.mixes + t * M, *x = a.X + t * nD;
    if (g.dy) hc_dots(dpre, (int)n, D, hc_dy_vecs{g.dy + t * D, x, D});
    if (threadIdx.x == 0) {
        float *pre = w, *gm = w + n, *db = gm + M, *ds = db + M;
        for (int64_t i = 0; i < 2 * M + 3; i++) gm[i] = 0.f;
        hc_pre_weights(pre, mx, a.scale, a.base, n, a.hc_eps);
        hc_sinkhorn_bwd(gm, ds, db, g.dy ? dpre : NULL, g.dpost ? g.dpost + t * n : NULL,
                        g.dcomb ? g.dcomb + t * n * n : NULL, mx, a.scale, a.base, n, a.dims.iters, a.hc_eps);
    }
    __syncthreads();
    if (g.dX) hc_block_dx(g.dX + t * nD, g.dy ? g.dy + t * D : NULL, x, a.fn, mx, w, a.rsqrt[t], n, D, M, &cx);
}

/* One block per token: pre, da = ⟨dy, X[j]⟩·σ', gm = da·scale[0], dbase part da, dscale part Σ da·mixes;
 * then its dX. */
__global__ void __launch_bounds__(HC_THREADS) hc_head_bwd_token_kernel(hc_head_args a, hc_head_grads g, float *ws) {
    __shared__ float dpre[HC_CUDA_NMAX], cx;
    const int64_t t = blockIdx.x, n = a.dims.n, D = a.dims.D, M = n, nD = n * D, W = hc_ws_width(n, M);
    float *w = ws + t * W;
    const float *mx = a.mixes + t * M, *x = a.X + t * nD;
    if (g.dy) hc_dots(dpre, (int)n, D, hc_dy_vecs{g.dy + t * D, x, D});
    if (threadIdx.x == 0) {
        float *pre = w, *gm = w + n, *db = gm + M, *ds = db + M;
        ds[0] = 0.f;
        for (int64_t j = 0; j < n; j++) {
            const float sg = hc_sigmoid(mx[j] * a.scale[0] + a.base[j]);
            pre[j] = sg + a.hc_eps;
            const float da = g.dy ? dpre[j] * sg * (1 - sg) : 0.f;
            gm[j] = da * a.scale[0];
            db[j] = da;
            ds[0] += da * mx[j];
        }
    }
    __syncthreads();
    if (g.dX) hc_block_dx(g.dX + t * nD, g.dy ? g.dy + t * D : NULL, x, a.fn, mx, w, a.rsqrt[t], n, D, M, &cx);
}

/* dfn [M, nD] += Σ_t (gm_t[i]·r_t)·x_t: one thread per element, tokens in order. */
__global__ void hc_dfn_kernel(float *dfn, const float *X, const float *rsqrt, const float *ws, int64_t N, int64_t n,
                              int64_t M, int64_t nD) {
    const int64_t W = hc_ws_width(n, M);
    CUDA_GRID_STRIDE(e, M * nD) {
        const int64_t i = e / nD, c = e % nD;
        float v = dfn[e];
        for (int64_t t = 0; t < N; t++) v += ws[t * W + n + i] * rsqrt[t] * X[t * nD + c];
        dfn[e] = v;
    }
}

/* dbase [M] and dscale [nscale] += the tokens' parts, tokens in order. One thread per element. */
__global__ void hc_params_kernel(float *dscale, float *dbase, const float *ws, int64_t N, int64_t n, int64_t M,
                                 int64_t nscale) {
    const int64_t W = hc_ws_width(n, M), e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e < M && dbase) {
        float v = dbase[e];
        for (int64_t t = 0; t < N; t++) v += ws[t * W + n + M + e];
        dbase[e] = v;
    } else if (e >= M && e < M + nscale && dscale) {
        float v = dscale[e - M];
        for (int64_t t = 0; t < N; t++) v += ws[t * W + n + 2 * M + (e - M)];
        dscale[e - M] = v;
    }
}

/* ---------------------------------------------------------------- hc_post (§3.3) */

/* Y[t, k, d] = post[k]·x[d] + Σ_j comb[j][k]·res[j][d]: one thread per element. */
__global__ void hc_post_fwd_kernel(hc_post_args a) {
    const int64_t n = a.dims.n, D = a.dims.D;
    CUDA_GRID_STRIDE(e, a.dims.N * n * D) {
        const int64_t d = e % D, tk = e / D, k = tk % n, t = tk / n;
        const float *rt = a.res + t * n * D, *cb = a.comb + t * n * n;
        float v = a.post[t * n + k] * a.x[t * D + d];
        for (int64_t j = 0; j < n; j++) v += cb[j * n + k] * rt[j * D + d];
        a.Y[e] = v;
    }
}

/* The vectors of hc_post's dots of token t: job k < n: ⟨g[k], x⟩; job n + j·n + k: ⟨g[k], res[j]⟩. */
struct hc_post_vecs {
    const float *g, *x, *res;
    int64_t n, D;
    __device__ void operator()(int job, const float **a, const float **b) const {
        if (job < n) {
            *a = g + (int64_t)job * D, *b = x;
        } else {
            const int64_t jk = job - n, j = jk / n, k = jk % n;
            *a = g + k * D, *b = res + j * D;
        }
    }
};

/* One block per token: dx += Σ_k post[k]·g[k]; dres[j] += Σ_k comb[j][k]·g[k]; dpost, dcomb += dots. */
__global__ void __launch_bounds__(HC_THREADS) hc_post_bwd_kernel(hc_post_args a, hc_post_grads gr) {
    __shared__ float dots[HC_CUDA_NMAX + HC_CUDA_NMAX * HC_CUDA_NMAX];
    const int64_t t = blockIdx.x, n = a.dims.n, D = a.dims.D;
    const float *g = gr.dY + t * n * D, *xt = a.x + t * D, *rt = a.res + t * n * D;
    const float *p = a.post + t * n, *cb = a.comb + t * n * n;
    if (gr.dx)
        for (int64_t d = threadIdx.x; d < D; d += HC_THREADS) {
            float v = gr.dx[t * D + d];
            for (int64_t k = 0; k < n; k++) v += p[k] * g[k * D + d];
            gr.dx[t * D + d] = v;
        }
    if (gr.dres)
        for (int64_t e = threadIdx.x; e < n * D; e += HC_THREADS) {
            const int64_t j = e / D, d = e % D;
            float v = gr.dres[t * n * D + e];
            for (int64_t k = 0; k < n; k++) v += cb[j * n + k] * g[k * D + d];
            gr.dres[t * n * D + e] = v;
        }
    if (gr.dpost || gr.dcomb) {
        hc_dots(dots, (int)(n + n * n), D, hc_post_vecs{g, xt, rt, n, D});
        if (gr.dpost)
            for (int64_t k = threadIdx.x; k < n; k += HC_THREADS) gr.dpost[t * n + k] += dots[k];
        if (gr.dcomb)
            for (int64_t e = threadIdx.x; e < n * n; e += HC_THREADS) gr.dcomb[t * n * n + e] += dots[n + e];
    }
}

/* ---------------------------------------------------------------- launchers */

static ds4_status hc_check(const hc_dims *d, const char *op) {
    if (d->N < 0 || d->D < 0 || d->n < 1 || d->n > HC_CUDA_NMAX)
        return ds4_fail(DS4_ERR_ARG, "cuda %s: N %lld, n %lld, D %lld: expected N, D >= 0 and 1 <= n <= %d", op,
                        (long long)d->N, (long long)d->n, (long long)d->D, HC_CUDA_NMAX);
    if (d->N > INT32_MAX) return ds4_fail(DS4_ERR_ARG, "cuda %s: %lld tokens, more than one launch holds", op, (long long)d->N);
    return DS4_OK;
}

ds4_status cuda_hc_split_sinkhorn_fwd(cudaStream_t s, const hc_sinkhorn_args *a) {
    CUDA_ARG(a->n >= 1 && a->n <= HC_CUDA_NMAX, "hc_split_sinkhorn_fwd", "n %lld: expected 1..%d", (long long)a->n,
             HC_CUDA_NMAX);
    hc_sinkhorn_fwd_kernel<<<1, 1, 0, s>>>(*a);
    CUDA_LAUNCHED("hc_split_sinkhorn_fwd");
    return DS4_OK;
}

ds4_status cuda_hc_split_sinkhorn_bwd(cudaStream_t s, const hc_sinkhorn_args *a, const hc_sinkhorn_grads *g) {
    CUDA_ARG(a->n >= 1 && a->n <= HC_CUDA_NMAX, "hc_split_sinkhorn_bwd", "n %lld: expected 1..%d", (long long)a->n,
             HC_CUDA_NMAX);
    hc_sinkhorn_bwd_kernel<<<1, 1, 0, s>>>(*a, *g);
    CUDA_LAUNCHED("hc_split_sinkhorn_bwd");
    return DS4_OK;
}

ds4_status cuda_hc_pre_fwd(cudaStream_t s, const hc_pre_args *a) {
    DS4_TRY(hc_check(&a->dims, "hc_pre_fwd"));
    if (a->dims.N == 0) return DS4_OK;
    hc_pre_fwd_kernel<<<(unsigned)a->dims.N, HC_THREADS, 0, s>>>(*a);
    CUDA_LAUNCHED("hc_pre_fwd");
    return DS4_OK;
}

ds4_status cuda_hc_head_fwd(cudaStream_t s, const hc_head_args *a) {
    DS4_TRY(hc_check(&a->dims, "hc_head_fwd"));
    if (a->dims.N == 0) return DS4_OK;
    hc_head_fwd_kernel<<<(unsigned)a->dims.N, HC_THREADS, 0, s>>>(*a);
    CUDA_LAUNCHED("hc_head_fwd");
    return DS4_OK;
}

/* The cross-token sums after the per-token kernel: dfn, then dbase / dscale. */
static ds4_status hc_bwd_params(cudaStream_t s, float *dfn, float *dscale, float *dbase, const float *X,
                                const float *rsqrt, const float *ws, int64_t N, int64_t n, int64_t D, int64_t M,
                                int64_t nscale) {
    if (dfn) {
        hc_dfn_kernel<<<cuda_blocks(M * n * D, 256), 256, 0, s>>>(dfn, X, rsqrt, ws, N, n, M, n * D);
        CUDA_LAUNCHED("hc_bwd");
    }
    if (dscale || dbase) {
        hc_params_kernel<<<cuda_blocks(M + nscale, 128), 128, 0, s>>>(dscale, dbase, ws, N, n, M, nscale);
        CUDA_LAUNCHED("hc_bwd");
    }
    return DS4_OK;
}

ds4_status cuda_hc_pre_bwd_ws(cudaStream_t s, const hc_pre_args *a, const hc_pre_grads *g, void *ws) {
    DS4_TRY(hc_check(&a->dims, "hc_pre_bwd"));
    const int64_t N = a->dims.N, n = a->dims.n, M = (2 + n) * n;
    if (N == 0) return DS4_OK;
    hc_pre_bwd_token_kernel<<<(unsigned)N, HC_THREADS, 0, s>>>(*a, *g, (float *)ws);
    CUDA_LAUNCHED("hc_pre_bwd");
    return hc_bwd_params(s, g->dfn, g->dscale, g->dbase, a->X, a->rsqrt, (const float *)ws, N, n, a->dims.D, M, 3);
}

ds4_status cuda_hc_pre_bwd(cudaStream_t s, const hc_pre_args *a, const hc_pre_grads *g) {
    const int64_t n = a->dims.n;
    return au_with_ws(s, a->dims.N > 0 && n > 0 ? cuda_hc_bwd_workspace_bytes(a->dims.N, n, (2 + n) * n) : 0,
                      [&](void *ws) { return cuda_hc_pre_bwd_ws(s, a, g, ws); });
}

ds4_status cuda_hc_head_bwd_ws(cudaStream_t s, const hc_head_args *a, const hc_head_grads *g, void *ws) {
    DS4_TRY(hc_check(&a->dims, "hc_head_bwd"));
    const int64_t N = a->dims.N, n = a->dims.n, M = n;
    if (N == 0) return DS4_OK;
    hc_head_bwd_token_kernel<<<(unsigned)N, HC_THREADS, 0, s>>>(*a, *g, (float *)ws);
    CUDA_LAUNCHED("hc_head_bwd");
    return hc_bwd_params(s, g->dfn, g->dscale, g->dbase, a->X, a->rsqrt, (const float *)ws, N, n, a->dims.D, M, 1);
}

ds4_status cuda_hc_head_bwd(cudaStream_t s, const hc_head_args *a, const hc_head_grads *g) {
    const int64_t n = a->dims.n;
    return au_with_ws(s, a->dims.N > 0 && n > 0 ? cuda_hc_bwd_workspace_bytes(a->dims.N, n, n) : 0,
                      [&](void *ws) { return cuda_hc_head_bwd_ws(s, a, g, ws); });
}

ds4_status cuda_hc_post_fwd(cudaStream_t s, const hc_post_args *a) {
    DS4_TRY(hc_check(&a->dims, "hc_post_fwd"));
    const int64_t n = a->dims.N * a->dims.n * a->dims.D;
    if (n == 0) return DS4_OK;
    hc_post_fwd_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(*a);
    CUDA_LAUNCHED("hc_post_fwd");
    return DS4_OK;
}

ds4_status cuda_hc_post_bwd(cudaStream_t s, const hc_post_args *a, const hc_post_grads *g) {
    DS4_TRY(hc_check(&a->dims, "hc_post_bwd"));
    if (a->dims.N == 0 || (!g->dx && !g->dres && !g->dpost && !g->dcomb)) return DS4_OK;
    hc_post_bwd_kernel<<<(unsigned)a->dims.N, HC_THREADS, 0, s>>>(*a, *g);
    CUDA_LAUNCHED("hc_post_bwd");
    return DS4_OK;
}
