/* Sparse shared-KV attention with per-head sinks on the GPU (docs/dsv4-architecture.md §4.6, §4.10;
 * semantics: kernels.h sparse_attn_*). Correctness first, one plain pattern throughout:
 *
 *   a block of AU_THREADS threads owns one output row (a query head, or a key row of the backward);
 *   its items (keys, or (query, head) pairs) go in batches of AU_BATCH: each warp scores some items of
 *   the batch (dot products in a fixed lane order), the scores land in shared memory, then every thread
 *   adds the batch's weighted rows into the elements it owns, items in order.
 *
 * So every sum runs in one order fixed by the code: the results do not depend on the grid, the GPU or
 * the run. The backward gathers instead of scattering: dq per query head, dkv per window key row over
 * the queries t in [j, j + window) and heads, dkvc per compressed entry over the queries that use it
 * (all of t >= (e+1)·ratio − 1 without a top-k; with one, the inverse lists of attn_util.cuh: query rows
 * ascending). dsink: a double per (b, t, h), summed per head in a fixed tree.
 *
 * Key rows are fp32, or bf16 bits (kv16 / kvc16) widened where they are loaded; template BF16. */
#include "kernels/cuda/attn.cuh"
#include "kernels/cuda/attn_util.cuh"

/* The keys of query row (b, t): nw window rows j0.., then nc compressed entries (ids[] in shared
 * memory, or 0..nc-1 when ids == NULL). Matches cpu/sparse_attn.inc sa_key_rows. */
typedef struct {
    int64_t j0;
    int nw, nc;
    const int32_t *ids;
} sa_set;

/* Key k of the set as a row pointer. */
template <bool BF16>
__device__ __forceinline__ const void *sa_key(const sparse_attn_args &a, int64_t b, const sa_set &S, int k) {
    if (k < S.nw) return au_row<BF16>(BF16 ? (const void *)a.kv16 : (const void *)a.kv, b * a.dims.T + S.j0 + k,
                                      a.dims.c);
    const int64_t e = S.ids ? S.ids[k - S.nw] : k - S.nw;
    return au_row<BF16>(BF16 ? (const void *)a.kvc16 : (const void *)a.kvc, b * a.dims.Nc + e, a.dims.c);
}

/* Builds the key set of (b, t) (ids: K ints of shared memory, used with a top-k). Every thread calls. */
__device__ __forceinline__ sa_set sa_key_set(const sparse_attn_args &a, int64_t ratio, int64_t bt, int32_t *ids,
                                             int *cnt) {
    const int64_t T = a.dims.T, t = bt % T, window = a.dims.window, Nc = a.dims.Nc;
    sa_set S;
    S.j0 = t - window + 1 > 0 ? t - window + 1 : 0;
    S.nw = t - S.j0 + 1 > 0 ? (int)(t - S.j0 + 1) : 0;
    S.nc = 0;
    S.ids = NULL;
    if (ratio > 0) {
        if (a.topk) {
            S.nc = au_compact_ids(ids, NULL, a.topk + bt * a.dims.K, a.dims.K, Nc, cnt);
            S.ids = ids;
        } else {
            S.nc = (int)((t + 1) / ratio < Nc ? (t + 1) / ratio : Nc);
        }
    }
    return S;
}

/* acc [c] += Σ_kk w[kk]·key_kk for the nb keys of a batch, each thread its own elements, keys in order. */
template <bool BF16>
__device__ __forceinline__ void sa_add_keys(float *acc, const float *w, const void *const *kp, int nb, int64_t c) {
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) {
        float v = acc[i];
        for (int kk = 0; kk < nb; kk++) v += w[kk] * au_key<BF16>(kp[kk], i);
        acc[i] = v;
    }
}

/* ---------------------------------------------------------------- forward */

/* One block per (b, t, h). Pass 1: m = max(sink, scores). Pass 2: e = exp(s − m), z = exp(sink − m) +
 * Σ e (key order), acc = Σ e·key (key order per element). o = acc / z, lse = m + log z.
 * Shared: acc [c] floats, then the top-k ids [K]. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) sa_fwd_kernel(sparse_attn_args a, int64_t ratio) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t H = a.dims.H, c = a.dims.c;
    float *acc = (float *)smem;
    int32_t *ids = (int32_t *)(acc + c);
    __shared__ float sc[AU_BATCH];
    __shared__ const void *kp[AU_BATCH];
    __shared__ float bcast;
    __shared__ int cnt;
    const int64_t bth = blockIdx.x, h = bth % H, bt = bth / H, b = bt / a.dims.T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const sa_set S = sa_key_set(a, ratio, bt, ids, &cnt);
    const int nk = S.nw + S.nc;
    const float *q = a.q + bth * c, snk = a.sink[h];

    float m = snk; /* thread 0's */
    for (int k0 = 0; k0 < nk; k0 += AU_BATCH) {
        const int nb = nk - k0 < AU_BATCH ? nk - k0 : AU_BATCH;
        for (int kk = warp; kk < nb; kk += AU_WARPS) {
            float d = au_warp_dot<BF16>(q, sa_key<BF16>(a, b, S, k0 + kk), c, lane);
            if (lane == 0) sc[kk] = a.scale * d;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int kk = 0; kk < nb; kk++) m = sc[kk] > m ? sc[kk] : m;
        __syncthreads();
    }
    if (threadIdx.x == 0) bcast = m;
    __syncthreads();
    m = bcast;
    __syncthreads(); /* every thread has read bcast before thread 0 writes z into it */
    float *o = a.o + bth * c;
    if (!(m > -INFINITY)) { /* no key and a −inf sink: nothing to attend to */
        for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) o[i] = 0.f;
        if (threadIdx.x == 0) a.lse[bth] = m;
        return;
    }
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) acc[i] = 0.f;
    float z = expf(snk - m); /* thread 0's */
    for (int k0 = 0; k0 < nk; k0 += AU_BATCH) {
        const int nb = nk - k0 < AU_BATCH ? nk - k0 : AU_BATCH;
        for (int kk = warp; kk < nb; kk += AU_WARPS) {
            const void *k = sa_key<BF16>(a, b, S, k0 + kk);
            float d = au_warp_dot<BF16>(q, k, c, lane);
            if (lane == 0) sc[kk] = a.scale * d, kp[kk] = k;
        }
        __syncthreads();
        if (threadIdx.x == 0)
            for (int kk = 0; kk < nb; kk++) {
                float e = expf(sc[kk] - m);
                sc[kk] = e;
                z += e;
            }
        __syncthreads();
        sa_add_keys<BF16>(acc, sc, kp, nb, c);
        __syncthreads();
    }
    if (threadIdx.x == 0) bcast = z, a.lse[bth] = m + logf(z);
    __syncthreads();
    z = bcast;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) o[i] = acc[i] / z;
}

/* ---------------------------------------------------------------- backward */

/* One block per (b, t, h): Dsum = dO·o into dsum[bth]; the sink's term −exp(sink − lse)·Dsum into
 * dsink_t[bth] (double; if wanted); dq += scale·Σ_k ds_k·key_k with ds = p·(dO·key − Dsum),
 * p = exp(s − lse) (if dq). Shared as the forward's. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) sa_bwd_query_kernel(sparse_attn_args a, sparse_attn_grads g,
                                                                  int64_t ratio, float *dsum, double *dsink_t) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int64_t H = a.dims.H, c = a.dims.c;
    float *acc = (float *)smem;
    int32_t *ids = (int32_t *)(acc + c);
    __shared__ float sc[AU_BATCH];
    __shared__ const void *kp[AU_BATCH];
    __shared__ float red[AU_WARPS];
    __shared__ int cnt;
    const int64_t bth = blockIdx.x, h = bth % H, bt = bth / H, b = bt / a.dims.T;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float *q = a.q + bth * c, *go = g.dout + bth * c, *o = a.o + bth * c;
    float part = 0.f;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) part += go[i] * o[i];
    const float D = au_block_sum(part, red), lse = a.lse[bth];
    if (threadIdx.x == 0) {
        dsum[bth] = D;
        if (dsink_t) dsink_t[bth] = lse > -INFINITY ? -(double)(expf(a.sink[h] - lse) * D) : 0.0;
    }
    if (!g.dq) return;
    const sa_set S = sa_key_set(a, ratio, bt, ids, &cnt);
    const int nk = S.nw + S.nc;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) acc[i] = 0.f;
    for (int k0 = 0; k0 < nk; k0 += AU_BATCH) {
        const int nb = nk - k0 < AU_BATCH ? nk - k0 : AU_BATCH;
        for (int kk = warp; kk < nb; kk += AU_WARPS) {
            const void *k = sa_key<BF16>(a, b, S, k0 + kk);
            float s = a.scale * au_warp_dot<BF16>(q, k, c, lane), dp = au_warp_dot<BF16>(go, k, c, lane);
            float p = lse > -INFINITY ? expf(s - lse) : 0.f;
            if (lane == 0) sc[kk] = a.scale * (p * (dp - D)), kp[kk] = k;
        }
        __syncthreads();
        sa_add_keys<BF16>(acc, sc, kp, nb, c);
        __syncthreads();
    }
    float *dq = g.dq + bth * c;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) dq[i] += acc[i];
}

/* The gradient of one key row `key` (shared memory acc [c], zeroed by the caller) from nitem (query, head)
 * items, item it -> bth = item_bth(it): scale·ds·q + p·dO added in item order. */
template <bool BF16, typename ItemFn>
__device__ __forceinline__ void sa_key_grad(float *acc, const sparse_attn_args &a, const sparse_attn_grads &g,
                                            const float *dsum, const void *key, int64_t nitem, ItemFn item_bth) {
    __shared__ float ca[AU_BATCH], cb[AU_BATCH];
    __shared__ int64_t row[AU_BATCH];
    const int64_t c = a.dims.c;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    for (int64_t i0 = 0; i0 < nitem; i0 += AU_BATCH) {
        const int nb = nitem - i0 < AU_BATCH ? (int)(nitem - i0) : AU_BATCH;
        for (int kk = warp; kk < nb; kk += AU_WARPS) {
            const int64_t bth = item_bth(i0 + kk);
            float s = a.scale * au_warp_dot<BF16>(a.q + bth * c, key, c, lane);
            float dp = au_warp_dot<BF16>(g.dout + bth * c, key, c, lane);
            const float lse = a.lse[bth];
            float p = lse > -INFINITY ? expf(s - lse) : 0.f;
            if (lane == 0) ca[kk] = a.scale * (p * (dp - dsum[bth])), cb[kk] = p, row[kk] = bth;
        }
        __syncthreads();
        for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) {
            float v = acc[i];
            for (int kk = 0; kk < nb; kk++) v += ca[kk] * a.q[row[kk] * c + i] + cb[kk] * g.dout[row[kk] * c + i];
            acc[i] = v;
        }
        __syncthreads();
    }
}

/* The (query, head) items of a key row, as bth indices: a run of queries t0 + it / H (window keys, and
 * compressed entries without a top-k), or the slots of an inverse list (slot / K = b·T + t). */
struct sa_items_run {
    int64_t bt0, H;
    __device__ int64_t operator()(int64_t it) const { return (bt0 + it / H) * H + it % H; }
};
struct sa_items_list {
    const int32_t *slots;
    int64_t K, H;
    __device__ int64_t operator()(int64_t it) const { return (int64_t)(slots[it / H] / K) * H + it % H; }
};

/* One block per window key row (b, j): items (t, h), t = j .. min(T, j + window) − 1, h ascending.
 * Shared: acc [c]. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) sa_bwd_window_kernel(sparse_attn_args a, sparse_attn_grads g,
                                                                   const float *dsum) {
    extern __shared__ __align__(16) unsigned char smem[];
    float *acc = (float *)smem;
    const int64_t T = a.dims.T, H = a.dims.H, c = a.dims.c, bj = blockIdx.x, b = bj / T, j = bj % T;
    const int64_t t1 = j + a.dims.window < T ? j + a.dims.window : T;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) acc[i] = 0.f;
    const void *key = au_row<BF16>(BF16 ? (const void *)a.kv16 : (const void *)a.kv, bj, c);
    sa_key_grad<BF16>(acc, a, g, dsum, key, (t1 - j) * H, sa_items_run{b * T + j, H});
    float *d = g.dkv + bj * c;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) d[i] += acc[i];
}

/* One block per compressed entry (b, e): items (t, h) over the queries that use it, t ascending, h
 * ascending: with a top-k, the slots of its inverse list (start, list; slot / K = b·T + t); without,
 * every t >= (e+1)·ratio − 1. Shared: acc [c]. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) sa_bwd_comp_kernel(sparse_attn_args a, sparse_attn_grads g,
                                                                 int64_t ratio, const float *dsum,
                                                                 const int64_t *start, const int32_t *list) {
    extern __shared__ __align__(16) unsigned char smem[];
    float *acc = (float *)smem;
    const int64_t T = a.dims.T, H = a.dims.H, c = a.dims.c, K = a.dims.K, be = blockIdx.x, b = be / a.dims.Nc;
    const int64_t e = be % a.dims.Nc;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) acc[i] = 0.f;
    const void *key = au_row<BF16>(BF16 ? (const void *)a.kvc16 : (const void *)a.kvc, be, c);
    if (list) {
        sa_key_grad<BF16>(acc, a, g, dsum, key, (start[be + 1] - start[be]) * H, sa_items_list{list + start[be], K, H});
    } else {
        const int64_t tf = (e + 1) * ratio - 1;
        const int64_t nt = T > tf ? T - tf : 0;
        sa_key_grad<BF16>(acc, a, g, dsum, key, nt * H, sa_items_run{b * T + tf, H});
    }
    float *d = g.dkvc + be * c;
    for (int64_t i = threadIdx.x; i < c; i += AU_THREADS) d[i] += acc[i];
}

/* One block per head: dsink[h] += Σ_bt dsink_t[bt·H + h], thread i taking bt = i, i + 256, ... in
 * order, then a fixed tree over the threads (double). */
#define SA_SINK_THREADS 256
__global__ void __launch_bounds__(SA_SINK_THREADS) sa_bwd_sink_kernel(float *dsink, const double *dsink_t,
                                                                      int64_t BT, int64_t H) {
    __shared__ double part[SA_SINK_THREADS];
    const int64_t h = blockIdx.x;
    double s = 0;
    for (int64_t bt = threadIdx.x; bt < BT; bt += SA_SINK_THREADS) s += dsink_t[bt * H + h];
    part[threadIdx.x] = s;
    __syncthreads();
    for (int w = SA_SINK_THREADS / 2; w > 0; w >>= 1) {
        if ((int)threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
        __syncthreads();
    }
    if (threadIdx.x == 0) dsink[h] += (float)part[0];
}

/* ---------------------------------------------------------------- launchers */

static bool sa_is_bf16(const sparse_attn_args *a) { return a->kv16 || a->kvc16; }

/* The ratio in effect: 0 without compressed keys (as the cpu kernel). */
static int64_t sa_ratio(const sparse_attn_args *a) {
    const void *kvc = sa_is_bf16(a) ? (const void *)a->kvc16 : (const void *)a->kvc;
    return kvc ? a->dims.ratio : 0;
}

/* Shared bytes of the per-query kernels: acc [c], then the top-k ids [K]. */
static size_t sa_query_smem(const sparse_attn_args *a, int64_t ratio) {
    return (size_t)a->dims.c * sizeof(float) + (ratio > 0 && a->topk ? (size_t)a->dims.K * sizeof(int32_t) : 0);
}

template <bool BF16>
static ds4_status sa_fwd_launch(cudaStream_t s, const sparse_attn_args *a) {
    const int64_t ratio = sa_ratio(a), nblk = a->dims.B * a->dims.T * a->dims.H;
    const size_t sm = sa_query_smem(a, ratio);
    CUDA_ARG(au_smem(sa_fwd_kernel<BF16>, sm), "sparse_attn_fwd", "head dim %lld and top-k %lld need %zu bytes of shared memory, more than the device gives a block",
             (long long)a->dims.c, (long long)a->dims.K, sm);
    sa_fwd_kernel<BF16><<<(unsigned)nblk, AU_THREADS, sm, s>>>(*a, ratio);
    CUDA_LAUNCHED("sparse_attn_fwd");
    return DS4_OK;
}

/* Sizes every attention launcher checks: >= 0, and B·T·H blocks within the grid. */
static ds4_status sa_check_dims(const sparse_attn_dims *d, const char *op) {
    if (d->B < 0 || d->T < 0 || d->H < 0 || d->c < 0 || d->Nc < 0 || d->K < 0)
        return ds4_fail(DS4_ERR_ARG, "cuda %s: negative size (B %lld, T %lld, H %lld, c %lld, Nc %lld, K %lld)", op,
                        (long long)d->B, (long long)d->T, (long long)d->H, (long long)d->c, (long long)d->Nc,
                        (long long)d->K);
    if (d->B * d->T * d->H > INT32_MAX)
        return ds4_fail(DS4_ERR_ARG, "cuda %s: B·T·H = %lld query heads, more than one launch holds", op,
                        (long long)(d->B * d->T * d->H));
    return DS4_OK;
}

ds4_status cuda_sparse_attn_fwd(cudaStream_t s, const sparse_attn_args *a) {
    DS4_TRY(sa_check_dims(&a->dims, "sparse_attn_fwd"));
    if (a->dims.B * a->dims.T * a->dims.H == 0 || a->dims.c == 0) return DS4_OK;
    return sa_is_bf16(a) ? sa_fwd_launch<true>(s, a) : sa_fwd_launch<false>(s, a);
}

/* What the backward computes (as cpu sa_bwd_wants): the ratio in effect, dkvc (NULL without compressed
 * keys); false when no gradient is wanted. */
static bool sa_bwd_wants(const sparse_attn_args *a, const sparse_attn_grads *g, int64_t *ratio, float **dkvc) {
    *ratio = sa_ratio(a);
    *dkvc = *ratio > 0 ? g->dkvc : NULL;
    return g->dq || g->dkv || *dkvc || g->dsink;
}

/* Workspace: dsum [B·T·H] floats, dsink terms [B·T·H] doubles (with dsink), the inverse lists (dkvc
 * with a top-k). */
size_t cuda_sparse_attn_bwd_workspace_bytes(const sparse_attn_args *a, const sparse_attn_grads *g) {
    int64_t ratio;
    float *dkvc;
    if (!sa_bwd_wants(a, g, &ratio, &dkvc)) return 0;
    const sparse_attn_dims *d = &a->dims;
    const int64_t BTH = d->B * d->T * d->H;
    size_t n = AU_ALIGN((size_t)BTH * sizeof(float));
    if (g->dsink) n += AU_ALIGN((size_t)BTH * sizeof(double));
    if (dkvc && a->topk) n += au_inverse_bytes(d->B, d->T, d->K, d->Nc);
    return n;
}

template <bool BF16>
static ds4_status sa_bwd_launch(cudaStream_t s, const sparse_attn_args *a, const sparse_attn_grads *g, int64_t ratio,
                                float *dkvc, char *ws) {
    const sparse_attn_dims *d = &a->dims;
    const int64_t BTH = d->B * d->T * d->H;
    float *dsum = (float *)ws;
    ws += AU_ALIGN((size_t)BTH * sizeof(float));
    double *dsink_t = NULL;
    if (g->dsink) dsink_t = (double *)ws, ws += AU_ALIGN((size_t)BTH * sizeof(double));
    const size_t smq = sa_query_smem(a, ratio), smk = (size_t)d->c * sizeof(float);
    CUDA_ARG(au_smem(sa_bwd_query_kernel<BF16>, smq) && au_smem(sa_bwd_window_kernel<BF16>, smk) &&
                 au_smem(sa_bwd_comp_kernel<BF16>, smk),
             "sparse_attn_bwd", "head dim %lld and top-k %lld need %zu bytes of shared memory, more than the device gives a block",
             (long long)d->c, (long long)d->K, smq);
    sa_bwd_query_kernel<BF16><<<(unsigned)BTH, AU_THREADS, smq, s>>>(*a, *g, ratio, dsum, dsink_t);
    CUDA_LAUNCHED("sparse_attn_bwd");
    if (g->dkv && d->window > 0) {
        sa_bwd_window_kernel<BF16><<<(unsigned)(d->B * d->T), AU_THREADS, smk, s>>>(*a, *g, dsum);
        CUDA_LAUNCHED("sparse_attn_bwd");
    }
    if (dkvc && d->B * d->Nc > 0) {
        au_inverse inv = {NULL, NULL, NULL, 0, 0};
        if (a->topk) {
            CUDA_ARG(d->B * d->T * d->K < INT32_MAX, "sparse_attn_bwd", "B·T·K = %lld top-k slots, more than int32 holds",
                     (long long)(d->B * d->T * d->K));
            CUDA_TRY(au_inverse_build(&inv, ws, a->topk, d->B, d->T, d->K, d->Nc, s));
        }
        sparse_attn_grads gc = *g;
        gc.dkvc = dkvc;
        sa_bwd_comp_kernel<BF16><<<(unsigned)(d->B * d->Nc), AU_THREADS, smk, s>>>(*a, gc, ratio, dsum, inv.start,
                                                                                   inv.list);
        CUDA_LAUNCHED("sparse_attn_bwd");
    }
    if (g->dsink) {
        sa_bwd_sink_kernel<<<(unsigned)d->H, SA_SINK_THREADS, 0, s>>>(g->dsink, dsink_t, d->B * d->T, d->H);
        CUDA_LAUNCHED("sparse_attn_bwd");
    }
    return DS4_OK;
}

ds4_status cuda_sparse_attn_bwd_ws(cudaStream_t s, const sparse_attn_args *a, const sparse_attn_grads *g, void *ws) {
    int64_t ratio;
    float *dkvc;
    DS4_TRY(sa_check_dims(&a->dims, "sparse_attn_bwd"));
    if (!sa_bwd_wants(a, g, &ratio, &dkvc)) return DS4_OK;
    if (a->dims.B * a->dims.T * a->dims.H == 0 || a->dims.c == 0) return DS4_OK;
    return sa_is_bf16(a) ? sa_bwd_launch<true>(s, a, g, ratio, dkvc, (char *)ws)
                         : sa_bwd_launch<false>(s, a, g, ratio, dkvc, (char *)ws);
}

ds4_status cuda_sparse_attn_bwd(cudaStream_t s, const sparse_attn_args *a, const sparse_attn_grads *g) {
    DS4_TRY(sa_check_dims(&a->dims, "sparse_attn_bwd")); /* before sizing the workspace with them */
    return au_with_ws(s, cuda_sparse_attn_bwd_workspace_bytes(a, g),
                      [&](void *ws) { return cuda_sparse_attn_bwd_ws(s, a, g, ws); });
}
