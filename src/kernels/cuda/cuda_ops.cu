/* The row ops of the CUDA backend: embedding, RMSNorm, RoPE, clamped SwiGLU, cross-entropy.
 *
 * Bits: element-wise arithmetic is the cpu's, operation for operation (no FMA contraction: -fmad=false),
 * so RoPE, the embedding and the RMSNorm weight gradient give the cpu's bits. Row sums (RMSNorm's sum of
 * squares and dot, cross-entropy's exponential sum) are double, as on the cpu, but summed by a block in
 * a fixed tree order instead of left to right: deterministic, and within a few double roundings of the
 * cpu's sum. Exponentials are the double exp rounded to float (the cpu's glibc expf is within 0.502 ulp
 * of the exact value, so the two differ by at most one ulp, rarely). */
#include "kernels/cuda/cuda_common.cuh"

#define ROW_THREADS CUDA_ROW_THREADS
#define CE_CHUNKS 64    /* the cpu's fixed row ranges of the loss sum (cpu/loss.c) */

/* The largest of one float per thread over the block (exact: no order matters). */
static __device__ float block_max(float v) {
    __shared__ float part[ROW_THREADS / 32];
    __shared__ float total;
    for (int o = 16; o > 0; o /= 2) {
        const float w = __shfl_down_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        v = part[0];
        for (int w = 1; w < ROW_THREADS / 32; w++) v = part[w] > v ? part[w] : v;
        total = v;
    }
    __syncthreads();
    v = total;
    __syncthreads();
    return v;
}

/* ---------------------------------------------------------------- embedding
 * The lookup is a row gather and its backward a row scatter-add (cuda_moe.cu): one thread per column
 * walks the tokens in order, so a row hit by several tokens sums them in token order, the cpu's chain. */
ds4_status cuda_embedding_fwd(cudaStream_t s, float *out, const float *table, const int32_t *ids, int64_t N,
                              int64_t D) {
    return cuda_rows_gather(s, out, table, ids, N, D);
}
ds4_status cuda_embedding_bwd(cudaStream_t s, float *dtable, const float *dout, const int32_t *ids, int64_t N,
                              int64_t D) {
    return cuda_rows_scatter_add(s, dtable, dout, ids, N, D);
}

/* ---------------------------------------------------------------- RMSNorm */
/* Block per row: y = (x · r) · w, r = 1/sqrt(Σx²/D + eps), the sum in double. y, x: [N, D]; rstd: [N]. */
static __global__ void rmsnorm_fwd_kernel(float *y, float *rstd, const float *x, const float *w, int64_t D, float eps) {
    const int64_t n = blockIdx.x;
    const float *xr = x + n * D;
    float *yr = y + n * D;
    double ss = 0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) ss += (double)xr[j] * xr[j];
    ss = cuda_block_sum(ss);
    const float r = (float)(1.0 / sqrt(ss / (double)D + (double)eps));
    if (threadIdx.x == 0) rstd[n] = r;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) yr[j] = w ? (xr[j] * r) * w[j] : xr[j] * r;
}
ds4_status cuda_rmsnorm_fwd(cudaStream_t s, float *y, float *rstd, const float *x, const float *w, int64_t N,
                            int64_t D, float eps) {
    CUDA_ARG(N >= 0 && D >= 1 && N <= INT32_MAX, "rmsnorm_fwd", "N %lld D %lld", (long long)N, (long long)D);
    if (N == 0) return DS4_OK;
    rmsnorm_fwd_kernel<<<(unsigned)N, ROW_THREADS, 0, s>>>(y, rstd, x, w, D, eps);
    CUDA_LAUNCHED("rmsnorm_fwd");
    return DS4_OK;
}

/* dx += r·gw − c·x, gw = w ⊙ dy (dy if weightless), c = r³·⟨gw, x⟩/D with the dot in double. */
static __global__ void rmsnorm_bwd_dx_kernel(float *dx, const float *dy, const float *x, const float *w,
                                             const float *rstd, int64_t D) {
    const int64_t n = blockIdx.x;
    const float *xr = x + n * D, *gr = dy + n * D;
    float *dxr = dx + n * D;
    const float r = rstd[n];
    double dot = 0;
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dot += (double)(w ? gr[j] * w[j] : gr[j]) * xr[j];
    dot = cuda_block_sum(dot);
    const float c = (float)((double)r * r * r * dot / (double)D);
    for (int64_t j = threadIdx.x; j < D; j += blockDim.x) dxr[j] += r * (w ? gr[j] * w[j] : gr[j]) - c * xr[j];
}
/* dw [j] += Σ_n dy·x·r with a double accumulator, n in order: the cpu's sum for column j. A block owns
 * DW_COLS columns: all its threads load a tile of DW_ROWS rows of terms (dy·x)·r into shared memory (many
 * loads in flight), then one warp, a thread per column, adds the tile's terms to its accumulator in row
 * order. */
#define DW_COLS 32
#define DW_ROWS 64
static __global__ void rmsnorm_bwd_dw_kernel(float *dw, const float *dy, const float *x, const float *rstd, int64_t N,
                                             int64_t D) {
    __shared__ float term[DW_ROWS][DW_COLS];
    const int64_t j0 = (int64_t)blockIdx.x * DW_COLS;
    const int c = threadIdx.x % DW_COLS;
    double acc = 0;
    for (int64_t n0 = 0; n0 < N; n0 += DW_ROWS) {
        for (int r = threadIdx.x / DW_COLS; r < DW_ROWS; r += blockDim.x / DW_COLS) {
            const int64_t n = n0 + r, j = j0 + c;
            term[r][c] = n < N && j < D ? dy[n * D + j] * x[n * D + j] * rstd[n] : 0.0f;
        }
        __syncthreads();
        if (threadIdx.x < DW_COLS) {
            const int rows = N - n0 < DW_ROWS ? (int)(N - n0) : DW_ROWS;
            for (int r = 0; r < rows; r++) acc += (double)term[r][c];
        }
        __syncthreads();
    }
    if (threadIdx.x < DW_COLS && j0 + c < D) dw[j0 + c] += (float)acc;
}
ds4_status cuda_rmsnorm_bwd(cudaStream_t s, float *dx, float *dw, const float *dy, const float *x, const float *w,
                            const float *rstd, int64_t N, int64_t D) {
    CUDA_ARG(N >= 0 && D >= 1 && N <= INT32_MAX, "rmsnorm_bwd", "N %lld D %lld", (long long)N, (long long)D);
    if (N == 0) return DS4_OK;
    if (dx) {
        rmsnorm_bwd_dx_kernel<<<(unsigned)N, ROW_THREADS, 0, s>>>(dx, dy, x, w, rstd, D);
        CUDA_LAUNCHED("rmsnorm_bwd dx");
    }
    if (dw && w) {
        rmsnorm_bwd_dw_kernel<<<cuda_blocks(D, DW_COLS), ROW_THREADS, 0, s>>>(dw, dy, x, rstd, N, D);
        CUDA_LAUNCHED("rmsnorm_bwd dw");
    }
    return DS4_OK;
}

/* ---------------------------------------------------------------- RoPE */
/* One thread per rotated pair (n, h, i) of x [N, H, hd]: the pair at hd − rd + 2i turned by pos·θ_i,
 * pos = (n % period)·mult; sign −1 turns the other way. */
static __global__ void rope_kernel(float *x, int64_t N, int64_t H, int64_t hd, int64_t period, int64_t mult, int64_t rd,
                                   const float *cos_t, const float *sin_t, bool inverse) {
    const int64_t half = rd / 2;
    CUDA_GRID_STRIDE(q, N * H * half) {
        const int64_t i = q % half, h = q / half % H, n = q / (half * H);
        const int64_t pos = (n % period) * mult;
        float *p = x + (n * H + h) * hd + (hd - rd);
        const float c = cos_t[pos * half + i], sn = sin_t[pos * half + i], sg = inverse ? -sn : sn;
        const float x0 = p[2 * i], x1 = p[2 * i + 1];
        p[2 * i] = x0 * c - x1 * sg;
        p[2 * i + 1] = x0 * sg + x1 * c;
    }
}
static ds4_status rope(cudaStream_t s, float *x, const rope_args *a, bool inverse, const char *name) {
    const ds4_rope *t = a->table;
    CUDA_ARG(a->N >= 0 && a->H >= 0 && a->period >= 1 && t && t->rd >= 2 && t->rd % 2 == 0 && t->rd <= a->hd &&
                 (a->period - 1) * a->mult < t->max_pos,
             "rope", "%s: N %lld H %lld hd %lld period %lld mult %lld, table rd %lld max_pos %lld", name,
             (long long)a->N, (long long)a->H, (long long)a->hd, (long long)a->period, (long long)a->mult,
             t ? (long long)t->rd : -1LL, t ? (long long)t->max_pos : -1LL);
    const int64_t n = a->N * a->H * (t->rd / 2);
    if (n == 0) return DS4_OK;
    rope_kernel<<<cuda_blocks(n, ROW_THREADS), ROW_THREADS, 0, s>>>(x, a->N, a->H, a->hd, a->period, a->mult, t->rd,
                                                                    t->cos, t->sin, inverse);
    CUDA_LAUNCHED("rope");
    return DS4_OK;
}
ds4_status cuda_rope_fwd(cudaStream_t s, float *x, const rope_args *a) { return rope(s, x, a, a->inverse, "rope_fwd"); }
/* The adjoint of a rotation is the rotation by the opposite angle. */
ds4_status cuda_rope_bwd(cudaStream_t s, float *dx, const rope_args *a) {
    return rope(s, dx, a, !a->inverse, "rope_bwd");
}

ds4_status cuda_rope_table_upload(cudaStream_t s, ds4_rope *dev, const ds4_rope *host) {
    const size_t bytes = (size_t)(host->max_pos * (host->rd / 2)) * sizeof(float);
    *dev = *host;
    dev->cos = dev->sin = NULL;
    ds4_status st = cuda_alloc((void **)&dev->cos, bytes);
    if (st == DS4_OK) st = cuda_alloc((void **)&dev->sin, bytes);
    if (st == DS4_OK) st = cuda_copy_h2d(s, dev->cos, host->cos, bytes);
    if (st == DS4_OK) st = cuda_copy_h2d(s, dev->sin, host->sin, bytes);
    if (st == DS4_OK) st = cuda_stream_sync(s); /* host may free its table after return */
    if (st != DS4_OK) cuda_rope_table_free(dev);
    return st;
}
void cuda_rope_table_free(ds4_rope *dev) {
    cudaFree(dev->cos);
    cudaFree(dev->sin);
    dev->cos = dev->sin = NULL;
}

/* ---------------------------------------------------------------- clamped SwiGLU */
/* e^x rounded once to float (see the top of this file) */
static __device__ __forceinline__ float exp_f(float x) { return (float)exp((double)x); }
static __device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + exp_f(-x)); }

/* act = silu(min(g, L)) · clamp(u, −L, L); L <= 0: no clamp. g, u, act: [N·I] */
static __global__ void swiglu_fwd_kernel(float *act, const float *g, const float *u, int64_t n, float limit) {
    CUDA_GRID_STRIDE(t, n) {
        float gc = g[t], uc = u[t];
        if (limit > 0) {
            gc = gc > limit ? limit : gc;
            uc = uc > limit ? limit : uc < -limit ? -limit : uc;
        }
        act[t] = gc * sigmoid_f(gc) * uc;
    }
}
ds4_status cuda_swiglu_fwd(cudaStream_t s, float *act, const float *g, const float *u, int64_t N, int64_t I,
                           float limit) {
    CUDA_ARG(N >= 0 && I >= 0, "swiglu_fwd", "N %lld I %lld", (long long)N, (long long)I);
    if (N * I == 0) return DS4_OK;
    swiglu_fwd_kernel<<<cuda_blocks(N * I, ROW_THREADS), ROW_THREADS, 0, s>>>(act, g, u, N * I, limit);
    CUDA_LAUNCHED("swiglu_fwd");
    return DS4_OK;
}

/* dg += dact·u·σ(g)(1 + g(1 − σ(g))), du += dact·silu(g); zero where clamped. */
static __global__ void swiglu_bwd_kernel(float *dg, float *du, const float *dact, const float *g, const float *u,
                                         int64_t n, float limit) {
    CUDA_GRID_STRIDE(t, n) {
        const bool g_clamped = limit > 0 && g[t] > limit;
        const bool u_clamped = limit > 0 && (u[t] > limit || u[t] < -limit);
        const float gc = g_clamped ? limit : g[t];
        const float uc = u_clamped ? (u[t] > 0 ? limit : -limit) : u[t];
        const float sg = sigmoid_f(gc);
        if (dg && !g_clamped) dg[t] += dact[t] * uc * (sg * (1 + gc * (1 - sg)));
        if (du && !u_clamped) du[t] += dact[t] * (gc * sg);
    }
}
ds4_status cuda_swiglu_bwd(cudaStream_t s, float *dg, float *du, const float *dact, const float *g, const float *u,
                           int64_t N, int64_t I, float limit) {
    CUDA_ARG(N >= 0 && I >= 0, "swiglu_bwd", "N %lld I %lld", (long long)N, (long long)I);
    if (N * I == 0 || (!dg && !du)) return DS4_OK;
    swiglu_bwd_kernel<<<cuda_blocks(N * I, ROW_THREADS), ROW_THREADS, 0, s>>>(dg, du, dact, g, u, N * I, limit);
    CUDA_LAUNCHED("swiglu_bwd");
    return DS4_OK;
}

/* ---------------------------------------------------------------- cross-entropy */
/* Block per row n: row_loss[n] = log Σ e^(l − m) + m − l[t] (0 for a row not scored, t outside [0, V));
 * drow = grad_scale·(softmax − onehot(t)), 0 on a row not scored; drow may be l (each thread reads l[v]
 * before it writes drow[v]). */
static __global__ void ce_row_kernel(double *row_loss, float *dlogits, const float *logits, const int32_t *targets,
                                     int64_t V, float grad_scale) {
    const int64_t n = blockIdx.x;
    const float *l = logits + n * V;
    float *drow = dlogits ? dlogits + n * V : NULL;
    const int32_t t = targets[n];
    if (t < 0 || t >= V) { /* the whole block takes this branch */
        if (drow)
            for (int64_t v = threadIdx.x; v < V; v += blockDim.x) drow[v] = 0;
        if (threadIdx.x == 0) row_loss[n] = 0;
        return;
    }
    const float lt = l[t]; /* before any thread writes an in-place drow (block_max synchronises) */
    float m = l[0];
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) m = l[v] > m ? l[v] : m;
    m = block_max(m);
    double sum = 0;
    for (int64_t v = threadIdx.x; v < V; v += blockDim.x) sum += (double)exp_f(l[v] - m);
    sum = cuda_block_sum(sum);
    if (drow) {
        const float inv = (float)(1.0 / sum);
        for (int64_t v = threadIdx.x; v < V; v += blockDim.x) {
            float d = grad_scale * (exp_f(l[v] - m) * inv);
            if (v == t) d -= grad_scale;
            drow[v] = d;
        }
    }
    if (threadIdx.x == 0) row_loss[n] = log(sum) + (double)m - (double)lt;
}
/* One block of CE_CHUNKS threads: thread c sums the scored rows of range c in order, then thread 0 adds
 * the ranges in order: the cpu's two-level sum. */
static __global__ void ce_sum_kernel(double *loss_sum, int64_t *n_scored, const double *row_loss,
                                     const int32_t *targets, int64_t N, int64_t V) {
    __shared__ double part[CE_CHUNKS];
    __shared__ int64_t cnt[CE_CHUNKS];
    const int64_t c = threadIdx.x;
    double p = 0;
    int64_t k = 0;
    for (int64_t n = c * N / CE_CHUNKS; n < (c + 1) * N / CE_CHUNKS; n++)
        if (targets[n] >= 0 && targets[n] < V) {
            p += row_loss[n];
            k++;
        }
    part[c] = p;
    cnt[c] = k;
    __syncthreads();
    if (c == 0) {
        double s = 0;
        int64_t total = 0;
        for (int i = 0; i < CE_CHUNKS; i++) {
            s += part[i];
            total += cnt[i];
        }
        *loss_sum = s;
        *n_scored = total;
    }
}
size_t cuda_cross_entropy_scratch_bytes(int64_t N) { return (size_t)(N > 0 ? N : 1) * sizeof(double); }

ds4_status cuda_cross_entropy_fwd_bwd(cudaStream_t s, double *loss_sum, int64_t *n_scored, float *dlogits,
                                      const float *logits, const int32_t *targets, int64_t N, int64_t V,
                                      float grad_scale, double *row_loss) {
    CUDA_ARG(N >= 0 && V >= 1 && N <= INT32_MAX, "cross_entropy_fwd_bwd", "N %lld V %lld", (long long)N, (long long)V);
    if (N > 0) {
        ce_row_kernel<<<(unsigned)N, ROW_THREADS, 0, s>>>(row_loss, dlogits, logits, targets, V, grad_scale);
        CUDA_LAUNCHED("cross_entropy rows");
    }
    ce_sum_kernel<<<1, CE_CHUNKS, 0, s>>>(loss_sum, n_scored, row_loss, targets, N, V);
    CUDA_LAUNCHED("cross_entropy sum");
    return DS4_OK;
}
