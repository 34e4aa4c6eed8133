/* The MoE gate and routing as data ops on the device (cpu/moe.inc, cpu/route.c).
 *
 * Gate: one thread per token runs the cpu's per-token code (scores, top-K by insertion with ties to the
 * lower id, weights), so the selection and the weights follow the cpu's order; the transcendental
 * functions are double ones rounded to float (the cpu's glibc float functions are within about half an
 * ulp of exact), so scores agree to an ulp or so, and the selection agrees wherever two experts' scores
 * are not that close.
 * Routing: grouping by expert is a counting sort whose placement walks the assignments in (token, slot)
 * order, one thread per expert: the cpu's order, the cpu's output. Sums into rows that several sources
 * hit (rows_scatter_add, moe_unpack_grads_add) give each column to one thread that walks the sources in
 * order (rows_scatter_add a window of sources at a time): the cpu's sums, bit for bit. */
#include "kernels/cuda/cuda_common.cuh"

#define MOE_THREADS 128

/* ---------------------------------------------------------------- gate */
static __device__ __forceinline__ float expf_r(float x) { return (float)exp((double)x); }
/* torch's softplus, linear above 20: log1p of the rounded exponential, as log1pf(expf(x)) */
static __device__ __forceinline__ float softplus_f(float x) {
    return x > 20 ? x : (float)log1p((double)expf_r(x));
}
static __device__ __forceinline__ float sigmoid_f(float x) { return 1.0f / (1.0f + expf_r(-x)); }
static __device__ __forceinline__ float sel_value(const float *s, const float *bias, int64_t e) {
    return bias ? s[e] + bias[e] : s[e];
}

/* One thread per token n: scores [E], idx and weights [K]. */
static __global__ void moe_gate_fwd_kernel(moe_gate_args a) {
    const int64_t N = a.dims.N, E = a.dims.E, K = a.dims.K;
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float *l = a.logits + n * E;
    float *s = a.scores + n * E;
    int32_t *ix = a.idx + n * K;
    float *wt = a.weights + n * K;
    for (int64_t e = 0; e < E; e++) s[e] = sqrtf(softplus_f(l[e]));
    if (a.tid2eid) {
        for (int64_t k = 0; k < K; k++) ix[k] = (int32_t)a.tid2eid[(int64_t)a.ids[n] * K + k];
    } else { /* the K largest of s + bias, descending; a later equal value never displaces an earlier one */
        int64_t cnt = 0;
        for (int64_t e = 0; e < E; e++) {
            const float v = sel_value(s, a.bias, e);
            if (cnt == K && !(v > sel_value(s, a.bias, ix[K - 1]))) continue;
            int64_t p = cnt < K ? cnt++ : K - 1;
            while (p > 0 && v > sel_value(s, a.bias, ix[p - 1])) {
                ix[p] = ix[p - 1];
                p--;
            }
            ix[p] = (int32_t)e;
        }
    }
    float S = 0;
    for (int64_t k = 0; k < K; k++) S += s[ix[k]];
    for (int64_t k = 0; k < K; k++) wt[k] = s[ix[k]] / S * a.route_scale;
}
ds4_status cuda_moe_gate_fwd(cudaStream_t s, const moe_gate_args *a) {
    CUDA_ARG(a->dims.N >= 0 && a->dims.K >= 1 && a->dims.K <= a->dims.E, "moe_gate_fwd", "N %lld E %lld K %lld",
             (long long)a->dims.N, (long long)a->dims.E, (long long)a->dims.K);
    if (a->dims.N == 0) return DS4_OK;
    moe_gate_fwd_kernel<<<cuda_blocks(a->dims.N, MOE_THREADS), MOE_THREADS, 0, s>>>(*a);
    CUDA_LAUNCHED("moe_gate_fwd");
    return DS4_OK;
}

/* dlogits [n, idx[k]] += ∂weights/∂logits · dweights: one thread per token, the cpu's arithmetic. */
static __global__ void moe_gate_bwd_kernel(moe_gate_args a, moe_gate_grads g) {
    const int64_t N = a.dims.N, E = a.dims.E, K = a.dims.K;
    const int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    const float *l = a.logits + n * E, *s = a.scores + n * E, *dw = g.dweights + n * K;
    const int32_t *ix = a.idx + n * K;
    float *dl = g.dlogits + n * E;
    float S = 0;
    for (int64_t k = 0; k < K; k++) S += s[ix[k]];
    float dot = 0;
    for (int64_t k = 0; k < K; k++) dot += dw[k] * (s[ix[k]] / S);
    for (int64_t k = 0; k < K; k++) {
        const int64_t e = ix[k];
        const float ds = a.route_scale / S * (dw[k] - dot);
        const float dsdl = s[e] == 0 ? 0 : (l[e] > 20 ? 1 : sigmoid_f(l[e])) / (2 * s[e]);
        dl[e] += ds * dsdl;
    }
}
ds4_status cuda_moe_gate_bwd(cudaStream_t s, const moe_gate_args *a, const moe_gate_grads *g) {
    CUDA_ARG(a->dims.N >= 0 && a->dims.K >= 1 && a->dims.K <= a->dims.E, "moe_gate_bwd", "N %lld E %lld K %lld",
             (long long)a->dims.N, (long long)a->dims.E, (long long)a->dims.K);
    if (a->dims.N == 0 || !g->dlogits) return DS4_OK;
    moe_gate_bwd_kernel<<<cuda_blocks(a->dims.N, MOE_THREADS), MOE_THREADS, 0, s>>>(*a, *g);
    CUDA_LAUNCHED("moe_gate_bwd");
    return DS4_OK;
}

/* ---------------------------------------------------------------- grouping by expert */
/* table [N·K] = j mod E; ids [N] = 0, 1, ..., N − 1 */
static __global__ void balanced_table_kernel(int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E) {
    CUDA_GRID_STRIDE(j, N * K) {
        table[j] = j % E;
        if (j < N) ids[j] = (int32_t)j;
    }
}
ds4_status cuda_moe_balanced_table(cudaStream_t s, int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E) {
    CUDA_ARG(N >= 0 && K >= 1 && E >= 1, "moe_balanced_table", "N %lld K %lld E %lld", (long long)N, (long long)K,
             (long long)E);
    if (N == 0) return DS4_OK;
    balanced_table_kernel<<<cuda_blocks(N * K, MOE_THREADS), MOE_THREADS, 0, s>>>(table, ids, N, K, E);
    CUDA_LAUNCHED("moe_balanced_table");
    return DS4_OK;
}

/* cnt [E]: thread e counts the assignments to expert e. */
static __global__ void expert_count_kernel(int64_t *cnt, const int32_t *idx, int64_t NK, int64_t E) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    int64_t c = 0;
    for (int64_t i = 0; i < NK; i++) c += idx[i] == e;
    cnt[e + 1] = c;
}
/* eoff [E + 1]: the counts in eoff[1..E] made running starts (one thread: E is small). */
static __global__ void expert_scan_kernel(int64_t *eoff, int64_t E) {
    eoff[0] = 0;
    for (int64_t e = 0; e < E; e++) eoff[e + 1] += eoff[e];
}
/* Thread e writes expert e's assignments in (token, slot) order from eoff[e] on. */
static __global__ void expert_place_kernel(int32_t *etok, int32_t *eslot, const int64_t *eoff, const int32_t *idx,
                                           int64_t NK, int64_t K, int64_t E) {
    const int64_t e = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= E) return;
    int64_t j = eoff[e];
    for (int64_t i = 0; i < NK; i++)
        if (idx[i] == e) {
            etok[j] = (int32_t)(i / K);
            eslot[j] = (int32_t)(i % K);
            j++;
        }
}
ds4_status cuda_moe_group_by_expert(cudaStream_t s, int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx,
                                    int64_t N, int64_t E, int64_t K) {
    CUDA_ARG(N >= 0 && E >= 1 && K >= 1, "moe_group_by_expert", "N %lld E %lld K %lld", (long long)N, (long long)E,
             (long long)K);
    const unsigned blocks = cuda_blocks(E, MOE_THREADS);
    expert_count_kernel<<<blocks, MOE_THREADS, 0, s>>>(eoff, idx, N * K, E);
    CUDA_LAUNCHED("moe_group_by_expert count");
    expert_scan_kernel<<<1, 1, 0, s>>>(eoff, E);
    CUDA_LAUNCHED("moe_group_by_expert scan");
    if (N > 0) {
        expert_place_kernel<<<blocks, MOE_THREADS, 0, s>>>(etok, eslot, eoff, idx, N * K, K, E);
        CUDA_LAUNCHED("moe_group_by_expert place");
    }
    return DS4_OK;
}

/* cnt [E] = eoff differenced (add: load [E] += it) */
static __global__ void expert_diff_kernel(int64_t *out, const int64_t *eoff, int64_t E, bool add) {
    CUDA_GRID_STRIDE(e, E) out[e] = (add ? out[e] : 0) + (eoff[e + 1] - eoff[e]);
}
ds4_status cuda_moe_expert_counts(cudaStream_t s, int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK) {
    (void)NK;
    CUDA_ARG(E >= 1, "moe_expert_counts", "E %lld", (long long)E);
    expert_diff_kernel<<<cuda_blocks(E, MOE_THREADS), MOE_THREADS, 0, s>>>(cnt, eoff, E, false);
    CUDA_LAUNCHED("moe_expert_counts");
    return DS4_OK;
}
ds4_status cuda_moe_expert_load(cudaStream_t s, int64_t *load, const int64_t *eoff, int64_t E) {
    CUDA_ARG(E >= 1, "moe_expert_load", "E %lld", (long long)E);
    expert_diff_kernel<<<cuda_blocks(E, MOE_THREADS), MOE_THREADS, 0, s>>>(load, eoff, E, true);
    CUDA_LAUNCHED("moe_expert_load");
    return DS4_OK;
}

/* ---------------------------------------------------------------- moving rows */
/* wj [NK] = w [etok[j], eslot[j]] */
static __global__ void assignment_weights_kernel(float *wj, const float *w, const int32_t *etok, const int32_t *eslot,
                                                 int64_t NK, int64_t K) {
    CUDA_GRID_STRIDE(j, NK) wj[j] = w[(int64_t)etok[j] * K + eslot[j]];
}
ds4_status cuda_moe_assignment_weights(cudaStream_t s, float *wj, const float *w, const int32_t *etok,
                                       const int32_t *eslot, int64_t NK, int64_t K) {
    CUDA_ARG(NK >= 0 && K >= 1, "moe_assignment_weights", "NK %lld K %lld", (long long)NK, (long long)K);
    if (NK == 0) return DS4_OK;
    assignment_weights_kernel<<<cuda_blocks(NK, MOE_THREADS), MOE_THREADS, 0, s>>>(wj, w, etok, eslot, NK, K);
    CUDA_LAUNCHED("moe_assignment_weights");
    return DS4_OK;
}

/* dgw [etok[j], eslot[j]] += dw [j]: a grouping names each (token, slot) once, so no two j meet. */
static __global__ void weight_grads_add_kernel(float *dgw, const float *dw, const int32_t *etok, const int32_t *eslot,
                                               int64_t NK, int64_t K) {
    CUDA_GRID_STRIDE(j, NK) dgw[(int64_t)etok[j] * K + eslot[j]] += dw[j];
}
ds4_status cuda_moe_weight_grads_add(cudaStream_t s, float *dgw, const float *dw, const int32_t *etok,
                                     const int32_t *eslot, int64_t NK, int64_t K) {
    CUDA_ARG(NK >= 0 && K >= 1, "moe_weight_grads_add", "NK %lld K %lld", (long long)NK, (long long)K);
    if (NK == 0) return DS4_OK;
    weight_grads_add_kernel<<<cuda_blocks(NK, MOE_THREADS), MOE_THREADS, 0, s>>>(dgw, dw, etok, eslot, NK, K);
    CUDA_LAUNCHED("moe_weight_grads_add");
    return DS4_OK;
}

/* dst [n, D] = src rows rows[i] */
static __global__ void rows_gather_kernel(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    CUDA_GRID_STRIDE(q, n * D) dst[q] = src[(int64_t)rows[q / D] * D + q % D];
}
ds4_status cuda_rows_gather(cudaStream_t s, float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    CUDA_ARG(n >= 0 && D >= 0, "rows_gather", "n %lld D %lld", (long long)n, (long long)D);
    if (n * D == 0) return DS4_OK;
    rows_gather_kernel<<<cuda_blocks(n * D, MOE_THREADS), MOE_THREADS, 0, s>>>(dst, src, rows, n, D);
    CUDA_LAUNCHED("rows_gather");
    return DS4_OK;
}

/* dst row rows[i] += src row i, i ascending, so each element's chain of adds is the cpu's. A warp owns 32
 * columns and walks the sources in windows of SA_WIN: it loads the window's source values and, for each
 * row's first source in the window, the destination value, all independent loads in flight at once; then
 * it adds in source order, carrying a row's running value from its previous source in the window (shared
 * memory) instead of rereading the destination, and stores a row after its last source in the window. */
#define SA_WIN 32
static __global__ void rows_scatter_add_kernel(float *__restrict__ dst, const float *__restrict__ src,
                                               const int32_t *__restrict__ rows, int64_t n, int64_t D) {
    __shared__ int64_t wrow[SA_WIN];
    __shared__ int wprev[SA_WIN];  /* the previous source of the same row in the window, −1 if none */
    __shared__ bool wlast[SA_WIN]; /* the row's last source in the window */
    __shared__ float run[SA_WIN][32];
    const int lane = threadIdx.x; /* blockDim.x == 32 */
    const int64_t k = (int64_t)blockIdx.x * 32 + lane;
    for (int64_t i0 = 0; i0 < n; i0 += SA_WIN) {
        const int w = n - i0 < SA_WIN ? (int)(n - i0) : SA_WIN;
        if (lane < w) wrow[lane] = rows[i0 + lane];
        __syncwarp();
        if (lane < w) {
            int prev = -1;
            bool last = true;
            for (int u = 0; u < w; u++)
                if (wrow[u] == wrow[lane]) {
                    if (u < lane) prev = u;
                    if (u > lane) last = false;
                }
            wprev[lane] = prev;
            wlast[lane] = last;
        }
        __syncwarp();
        if (k < D) {
            float v[SA_WIN], base[SA_WIN];
#pragma unroll
            for (int u = 0; u < SA_WIN; u++)
                if (u < w) {
                    v[u] = src[(i0 + u) * D + k];
                    base[u] = wprev[u] < 0 ? dst[wrow[u] * D + k] : 0.0f;
                }
#pragma unroll
            for (int u = 0; u < SA_WIN; u++)
                if (u < w) {
                    const float acc = (wprev[u] < 0 ? base[u] : run[wprev[u]][lane]) + v[u];
                    run[u][lane] = acc;
                    if (wlast[u]) dst[wrow[u] * D + k] = acc;
                }
        }
        __syncwarp(); /* every lane is done with the window before the next one overwrites it */
    }
}
ds4_status cuda_rows_scatter_add(cudaStream_t s, float *dst, const float *src, const int32_t *rows, int64_t n,
                                 int64_t D) {
    CUDA_ARG(n >= 0 && D >= 0, "rows_scatter_add", "n %lld D %lld", (long long)n, (long long)D);
    if (n * D == 0) return DS4_OK;
    rows_scatter_add_kernel<<<cuda_blocks(D, 32), 32, 0, s>>>(dst, src, rows, n, D);
    CUDA_LAUNCHED("rows_scatter_add");
    return DS4_OK;
}

/* dst [n, D + 1]: row i = (x row rows[i] (rows NULL: i) | w[i]) */
static __global__ void rows_pack_kernel(float *dst, const float *x, const int32_t *rows, const float *w, int64_t n,
                                        int64_t D) {
    CUDA_GRID_STRIDE(q, n * (D + 1)) {
        const int64_t i = q / (D + 1), k = q % (D + 1);
        dst[q] = k == D ? w[i] : x[(rows ? (int64_t)rows[i] : i) * D + k];
    }
}
ds4_status cuda_rows_pack(cudaStream_t s, float *dst, const float *x, const int32_t *rows, const float *w, int64_t n,
                          int64_t D) {
    CUDA_ARG(n >= 0 && D >= 0, "rows_pack", "n %lld D %lld", (long long)n, (long long)D);
    if (n == 0) return DS4_OK;
    rows_pack_kernel<<<cuda_blocks(n * (D + 1), MOE_THREADS), MOE_THREADS, 0, s>>>(dst, x, rows, w, n, D);
    CUDA_LAUNCHED("rows_pack");
    return DS4_OK;
}
/* x [n, D], w [n] from src [n, D + 1] */
static __global__ void rows_unpack_kernel(float *x, float *w, const float *src, int64_t n, int64_t D) {
    CUDA_GRID_STRIDE(q, n * (D + 1)) {
        const int64_t i = q / (D + 1), k = q % (D + 1);
        if (k == D) w[i] = src[q];
        else x[i * D + k] = src[q];
    }
}
ds4_status cuda_rows_unpack(cudaStream_t s, float *x, float *w, const float *src, int64_t n, int64_t D) {
    CUDA_ARG(n >= 0 && D >= 0, "rows_unpack", "n %lld D %lld", (long long)n, (long long)D);
    if (n == 0) return DS4_OK;
    rows_unpack_kernel<<<cuda_blocks(n * (D + 1), MOE_THREADS), MOE_THREADS, 0, s>>>(x, w, src, n, D);
    CUDA_LAUNCHED("rows_unpack");
    return DS4_OK;
}

/* dx row etok[j] += src row j [:D], j ascending (thread k owns column k; column D is the routing weight's:
 * its thread adds src[j, D] into dgw (etok[j], eslot[j]), which no two j share). */
static __global__ void unpack_grads_add_kernel(float *dx, float *dgw, const float *src, const int32_t *etok,
                                               const int32_t *eslot, int64_t NK, int64_t D, int64_t K) {
    const int64_t k = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k > D) return;
    for (int64_t j = 0; j < NK; j++) {
        const float v = src[j * (D + 1) + k];
        if (k < D) dx[(int64_t)etok[j] * D + k] += v;
        else dgw[(int64_t)etok[j] * K + eslot[j]] += v;
    }
}
ds4_status cuda_moe_unpack_grads_add(cudaStream_t s, float *dx, float *dgw, const float *src, const int32_t *etok,
                                     const int32_t *eslot, int64_t NK, int64_t D, int64_t K) {
    CUDA_ARG(NK >= 0 && D >= 0 && K >= 1, "moe_unpack_grads_add", "NK %lld D %lld K %lld", (long long)NK,
             (long long)D, (long long)K);
    if (NK == 0) return DS4_OK;
    unpack_grads_add_kernel<<<cuda_blocks(D + 1, MOE_THREADS), MOE_THREADS, 0, s>>>(dx, dgw, src, etok, eslot, NK, D,
                                                                                    K);
    CUDA_LAUNCHED("moe_unpack_grads_add");
    return DS4_OK;
}
