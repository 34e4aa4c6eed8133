/* The lightning indexer on the GPU (docs/dsv4-architecture.md §4.5, §6.3; docs/contract.md "indexer_loss",
 * "Selections"; semantics: kernels.h indexer_*).
 *
 * Scores I[s] = Σ_h ww[h]·ReLU(qi[h]·ki[s]), ww = wscale·w, are computed by one thread per entry with
 * the cpu kernel's sums in the cpu kernel's order (au_dot_cpu_order, heads ascending, every operation
 * rounded on its own): the same bits as cpu/indexer.inc, so the top-k is the cpu's selection and the
 * KL loss's ReLU masks are the cpu's masks. A query row's scores live in shared memory: nothing
 * [T, Nc] is ever built.
 *
 * Top-k: an exact radix select (8-bit digits) finds the K-th largest score key, then warp 0 takes the
 * larger ones and the lowest-index equal ones in ascending index order (ballots keep the order).
 *
 * KL loss: one block per query row writes its dqi and dw rows (one writer each), its KL (double) and
 * its dI = grad_scale·(softmax(I) − p) per selected entry; the KL sum is added in the cpu's order
 * (rows of a block of 16 ascending, blocks in order) by one block into the device's kl_sum / n_rows;
 * dki is gathered per entry over the rows that select it (rows ascending, heads ascending). */
#include "kernels/cuda/attn_util.cuh"

#define IX_QB 16 /* query rows per block of the KL sum (cpu/indexer.inc's IX_QB: the same order) */

/* Number of entries usable by query t: (s+1)·ratio <= t+1. */
__host__ __device__ static inline int64_t ix_usable(int64_t t, int64_t ratio, int64_t Nc) {
    if (ratio <= 0) return 0;
    int64_t nu = (t + 1) / ratio;
    return nu < Nc ? nu : Nc;
}

/* Score of one key row k for the query row qi_t [HI, dI] with weights ww [HI]: the cpu's bits. */
template <bool BF16>
__device__ __forceinline__ float ix_score(const float *qi_t, const float *ww, const void *k, int64_t HI, int64_t dI) {
    float acc = 0.f;
    for (int64_t h = 0; h < HI; h++) {
        float d = au_dot_cpu_order<BF16>(qi_t + h * dI, k, dI);
        acc = __fadd_rn(acc, __fmul_rn(ww[h], d > 0 ? d : 0.f));
    }
    return acc;
}

/* A key that orders like the score; NaN ranks lowest (as −inf). Scores are never −0. */
__device__ __forceinline__ uint32_t ix_key(float x) {
    if (x != x) x = -INFINITY;
    uint32_t u = __float_as_uint(x);
    return (u >> 31) ? ~u : (u | 0x80000000u);
}

/* ---------------------------------------------------------------- top-k */

/* One block per query row (b, t). Shared: I [nmax] floats, then ww [HI]. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) ix_topk_kernel(indexer_topk_args a) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int hist[256];
    __shared__ uint32_t prefix_s;
    __shared__ int need_s;
    const int64_t T = a.dims.T, HI = a.dims.HI, dI = a.dims.dI, Nc = a.dims.Nc, K = a.dims.K;
    const int64_t bt = blockIdx.x, b = bt / T, t = bt % T, nu = ix_usable(t, a.dims.ratio, Nc);
    int32_t *out = a.topk + bt * K;
    if (nu <= K) { /* every usable entry is selected; no scores needed */
        for (int64_t n = threadIdx.x; n < K; n += AU_THREADS) out[n] = n < nu ? (int32_t)n : -1;
        return;
    }
    float *I = (float *)smem, *ww = I + ix_usable(T - 1, a.dims.ratio, Nc);
    for (int64_t h = threadIdx.x; h < HI; h += AU_THREADS) ww[h] = __fmul_rn(a.wscale, a.w[bt * HI + h]);
    __syncthreads();
    const void *ki = BF16 ? (const void *)a.ki16 : (const void *)a.ki;
    const float *qi_t = a.qi + bt * HI * dI;
    for (int64_t s = threadIdx.x; s < nu; s += AU_THREADS)
        I[s] = ix_score<BF16>(qi_t, ww, au_row<BF16>(ki, b * Nc + s, dI), HI, dI);
    /* radix select of the K-th largest key, 8 bits at a time from the top */
    uint32_t prefix = 0, mask = 0;
    int need = (int)K;
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += AU_THREADS) hist[i] = 0;
        __syncthreads();
        for (int64_t s = threadIdx.x; s < nu; s += AU_THREADS) {
            uint32_t k = ix_key(I[s]);
            if ((k & mask) == prefix) atomicAdd(&hist[(k >> shift) & 255u], 1); /* integer counts: exact */
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int bkt = 255;
            while (hist[bkt] < need) need -= hist[bkt--];
            prefix_s = prefix | ((uint32_t)bkt << shift);
            need_s = need;
        }
        __syncthreads();
        prefix = prefix_s, need = need_s;
        mask |= 255u << shift;
    }
    /* prefix is the K-th largest key; take the larger keys and the first `need` equal ones, in order */
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int taken = 0, eq_seen = 0;
        for (int64_t s0 = 0; s0 < nu; s0 += 32) {
            const int64_t s = s0 + lane;
            const uint32_t k = s < nu ? ix_key(I[s]) : 0u;
            const bool gt = s < nu && k > prefix, eq = s < nu && k == prefix;
            const unsigned below = (1u << lane) - 1u, em = __ballot_sync(0xffffffffu, eq);
            const bool take = gt || (eq && eq_seen + __popc(em & below) < need);
            const unsigned tm = __ballot_sync(0xffffffffu, take);
            if (take) out[taken + __popc(tm & below)] = (int32_t)s;
            taken += __popc(tm);
            eq_seen += __popc(em);
        }
    }
}

ds4_status cuda_indexer_topk_fwd(cudaStream_t s, const indexer_topk_args *a) {
    const indexer_dims *d = &a->dims;
    CUDA_ARG(d->B >= 0 && d->T >= 0 && d->HI >= 0 && d->dI >= 0 && d->Nc >= 0, "indexer_topk_fwd",
             "negative size (B %lld, T %lld, HI %lld, dI %lld, Nc %lld)", (long long)d->B, (long long)d->T,
             (long long)d->HI, (long long)d->dI, (long long)d->Nc);
    if (d->K <= 0 || d->B * d->T == 0) return DS4_OK;
    CUDA_ARG(d->B * d->T <= INT32_MAX, "indexer_topk_fwd", "B·T = %lld rows, more than one launch holds",
             (long long)(d->B * d->T));
    const size_t sm = (size_t)(ix_usable(d->T - 1, d->ratio, d->Nc) + d->HI) * sizeof(float);
    const bool bf16 = a->ki16 != NULL;
    CUDA_ARG(bf16 ? au_smem(ix_topk_kernel<true>, sm) : au_smem(ix_topk_kernel<false>, sm), "indexer_topk_fwd",
             "%lld usable entries need %zu bytes of shared memory, more than the device gives a block",
             (long long)ix_usable(d->T - 1, d->ratio, d->Nc), sm);
    if (bf16)
        ix_topk_kernel<true><<<(unsigned)(d->B * d->T), AU_THREADS, sm, s>>>(*a);
    else
        ix_topk_kernel<false><<<(unsigned)(d->B * d->T), AU_THREADS, sm, s>>>(*a);
    CUDA_LAUNCHED("indexer_topk_fwd");
    return DS4_OK;
}

/* ---------------------------------------------------------------- KL loss */

/* Most entries a row scores: the top-k width, or every usable entry; 0: nothing to compute. */
static int64_t ix_kl_set_max(const indexer_kl_args *a) {
    const indexer_dims *d = &a->dims;
    int64_t nmax = a->topk ? d->K : ix_usable(d->T - 1, d->ratio, d->Nc);
    return nmax <= 0 || d->ratio <= 0 ? 0 : nmax;
}

/* The KL's workspace: dI [B·T, nmax] floats (slot bt·K + k with a top-k, entry bt·nmax + s without),
 * row KL [B·T] doubles, row scored [B·T] int64, the KL sum's block parts [B·nblk] (double, int64), then
 * the inverse lists (dki with a top-k). base NULL: sizes only. Returns the bytes. */
typedef struct {
    float *dI;
    double *row_kl, *part;
    int64_t *row_ok, *part_n;
    void *inv;
} ix_kl_ws;

static size_t ix_kl_carve(ix_kl_ws *w, char *base, const indexer_kl_args *a, int64_t nmax) {
    const indexer_dims *d = &a->dims;
    const int64_t BT = d->B * d->T, NB = d->B * ((d->T + IX_QB - 1) / IX_QB);
    const size_t sz[6] = {AU_ALIGN((size_t)(BT * nmax) * sizeof(float)), AU_ALIGN((size_t)BT * sizeof(double)),
                          AU_ALIGN((size_t)BT * sizeof(int64_t)),        AU_ALIGN((size_t)NB * sizeof(double)),
                          AU_ALIGN((size_t)NB * sizeof(int64_t)),
                          a->dki && a->topk ? au_inverse_bytes(d->B, d->T, d->K, d->Nc) : 0};
    void *p[6];
    size_t off = 0;
    for (int i = 0; i < 6; i++) p[i] = base ? base + off : NULL, off += sz[i];
    w->dI = (float *)p[0], w->row_kl = (double *)p[1], w->row_ok = (int64_t *)p[2];
    w->part = (double *)p[3], w->part_n = (int64_t *)p[4], w->inv = p[5];
    return off;
}

size_t cuda_indexer_kl_workspace_bytes(const indexer_kl_args *a) {
    const int64_t nmax = ix_kl_set_max(a);
    if (nmax == 0) return 0;
    ix_kl_ws w;
    return ix_kl_carve(&w, NULL, a, nmax);
}

/* One block per query row (b, t). Shared: ids, slots [nmax] int32; pt, I [nmax] floats; ww [HI];
 * dqi row [HI, dI] (the running sums, started from dqi's values as the cpu adds into them). */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) ix_kl_row_kernel(indexer_kl_args a, int64_t nmax, ix_kl_ws w) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ int cnt, ok_s;
    __shared__ float lz_s;
    const int64_t T = a.dims.T, HI = a.dims.HI, dI = a.dims.dI, Nc = a.dims.Nc, K = a.dims.K, H = a.H, c = a.c;
    const int64_t bt = blockIdx.x, b = bt / T, t = bt % T;
    int32_t *ids = (int32_t *)smem, *slot = ids + nmax;
    float *pt = (float *)(slot + nmax), *I = pt + nmax, *ww = I + nmax, *gq = ww + HI;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int n;
    if (a.topk) {
        n = au_compact_ids(ids, slot, a.topk + bt * K, K, Nc, &cnt);
    } else {
        n = (int)ix_usable(t, a.dims.ratio, Nc);
        for (int j = threadIdx.x; j < n; j += AU_THREADS) ids[j] = j, slot[j] = j;
        __syncthreads();
    }
    /* where row entry j's dI lives */
    float *dI_row = a.topk ? w.dI + bt * K : w.dI + bt * nmax;
    if (n == 0) {
        if (threadIdx.x == 0) w.row_kl[bt] = 0, w.row_ok[bt] = 0;
        return;
    }
    const void *ki = BF16 ? (const void *)a.ki16 : (const void *)a.ki;
    const void *kvc = BF16 ? (const void *)a.kvc16 : (const void *)a.kvc;
    /* teacher: pt[j] = Σ_h exp(scale·q[h]·kvc[s] − lse[h]), heads ascending, then L1-normalised */
    const float *q_t = a.q + bt * H * c, *lse_t = a.lse + bt * H;
    for (int j = warp; j < n; j += AU_WARPS) {
        const void *k = au_row<BF16>(kvc, b * Nc + ids[j], c);
        float acc = 0.f;
        for (int64_t h = 0; h < H; h++) {
            float d = au_warp_dot<BF16>(q_t + h * c, k, c, lane);
            acc += expf(a.scale * d - lse_t[h]);
        }
        if (lane == 0) pt[j] = acc;
    }
    for (int64_t h = threadIdx.x; h < HI; h += AU_THREADS) ww[h] = __fmul_rn(a.wscale, a.w[bt * HI + h]);
    __syncthreads();
    if (threadIdx.x == 0) {
        float z = 0.f;
        for (int j = 0; j < n; j++) z += pt[j];
        ok_s = z > 0 && z < INFINITY;
        lz_s = z;
    }
    __syncthreads();
    if (!ok_s) { /* teacher mass 0 or not finite: the row is skipped, its entries get no gradient */
        for (int j = threadIdx.x; j < n; j += AU_THREADS) dI_row[slot[j]] = 0.f;
        if (threadIdx.x == 0) w.row_kl[bt] = 0, w.row_ok[bt] = 0;
        return;
    }
    const float z = lz_s;
    /* student: the scores, their log-softmax over the set */
    const float *qi_t = a.qi + bt * HI * dI;
    for (int j = threadIdx.x; j < n; j += AU_THREADS) {
        pt[j] /= z;
        I[j] = ix_score<BF16>(qi_t, ww, au_row<BF16>(ki, b * Nc + ids[j], dI), HI, dI);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        float m = I[0];
        for (int j = 1; j < n; j++) m = I[j] > m ? I[j] : m;
        float zs = 0.f;
        for (int j = 0; j < n; j++) zs += expf(I[j] - m);
        const float lz = m + logf(zs);
        double kl = 0;
        for (int j = 0; j < n; j++) {
            const float logq = I[j] - lz;
            if (pt[j] > 0) kl += (double)pt[j] * ((double)logf(pt[j]) - (double)logq);
            I[j] = a.grad_scale * (expf(logq) - pt[j]); /* I := dI */
        }
        w.row_kl[bt] = kl, w.row_ok[bt] = 1;
    }
    __syncthreads();
    for (int j = threadIdx.x; j < n; j += AU_THREADS) dI_row[slot[j]] = I[j];
    if (!a.dqi && !a.dw) return;
    /* one thread per head: dw += wscale·Σ_j dI·ReLU(d), dqi += Σ_j dI·ww·1[d>0]·ki, j ascending */
    for (int64_t h = threadIdx.x; h < HI; h += AU_THREADS) {
        float *g = gq + h * dI, *dqi = a.dqi ? a.dqi + (bt * HI + h) * dI : NULL;
        if (dqi)
            for (int64_t i = 0; i < dI; i++) g[i] = dqi[i];
        float dwr = 0.f;
        for (int j = 0; j < n; j++) {
            const void *k = au_row<BF16>(ki, b * Nc + ids[j], dI);
            const float d = au_dot_cpu_order<BF16>(qi_t + h * dI, k, dI);
            if (!(d > 0)) continue;
            dwr += I[j] * d;
            const float gj = I[j] * ww[h];
            if (dqi)
                for (int64_t i = 0; i < dI; i++) g[i] += gj * au_key<BF16>(k, i);
        }
        if (dqi)
            for (int64_t i = 0; i < dI; i++) dqi[i] = g[i];
        if (a.dw) a.dw[bt * HI + h] += a.wscale * dwr;
    }
}

/* One block: kl_sum = Σ over row blocks of 16 (in order) of Σ of the block's scored rows' KL (t
 * ascending), n_rows = scored rows: cpu/indexer.inc's order. part: [B·nblk] doubles of workspace. */
__global__ void __launch_bounds__(1024) ix_kl_sum_kernel(double *kl_sum, int64_t *n_rows, const double *row_kl,
                                                         const int64_t *row_ok, int64_t B, int64_t T, double *part,
                                                         int64_t *part_n) {
    const int64_t nblk = (T + IX_QB - 1) / IX_QB;
    for (int64_t gb = threadIdx.x; gb < B * nblk; gb += blockDim.x) {
        const int64_t b = gb / nblk, t0 = (gb % nblk) * IX_QB, t1 = t0 + IX_QB < T ? t0 + IX_QB : T;
        double s = 0;
        int64_t r = 0;
        for (int64_t t = t0; t < t1; t++)
            if (row_ok[b * T + t]) s += row_kl[b * T + t], r++;
        part[gb] = s, part_n[gb] = r;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        double s = 0;
        int64_t r = 0;
        for (int64_t gb = 0; gb < B * nblk; gb++) s += part[gb], r += part_n[gb];
        *kl_sum = s, *n_rows = r;
    }
}

/* One block per compressed entry (b, e): dki[e] += Σ over the rows that select it (ascending) and heads
 * (ascending) of dI·ww·1[qi·ki > 0]·qi. Items (row, head) in batches: one thread scores an item (the
 * cpu's dot, so the cpu's mask), then every thread adds the batch's rows into its elements. Shared:
 * acc [dI]. */
template <bool BF16>
__global__ void __launch_bounds__(AU_THREADS) ix_kl_dki_kernel(indexer_kl_args a, int64_t nmax, ix_kl_ws w,
                                                               const int64_t *start, const int32_t *list) {
    extern __shared__ __align__(16) unsigned char smem[];
    __shared__ float coef[AU_THREADS];
    __shared__ int64_t qrow[AU_THREADS];
    float *acc = (float *)smem;
    const int64_t T = a.dims.T, HI = a.dims.HI, dI = a.dims.dI, Nc = a.dims.Nc, K = a.dims.K;
    const int64_t be = blockIdx.x, b = be / Nc, e = be % Nc;
    const void *key = au_row<BF16>(BF16 ? (const void *)a.ki16 : (const void *)a.ki, be, dI);
    /* the rows: list slots (slot / K = bt), or every t >= (e+1)·ratio − 1 (dI at bt·nmax + e) */
    const int64_t tf = (e + 1) * a.dims.ratio - 1;
    const int64_t nrows = list ? start[be + 1] - start[be] : (T > tf ? T - tf : 0);
    for (int64_t i = threadIdx.x; i < dI; i += AU_THREADS) acc[i] = 0.f;
    for (int64_t i0 = 0; i0 < nrows * HI; i0 += AU_THREADS) {
        const int64_t it = i0 + threadIdx.x;
        if (it < nrows * HI) {
            const int64_t r = it / HI, h = it % HI;
            int64_t bt, di;
            if (list) {
                const int64_t sl = list[start[be] + r];
                bt = sl / K, di = sl;
            } else {
                bt = b * T + tf + r, di = bt * nmax + e;
            }
            const float *qv = a.qi + (bt * HI + h) * dI;
            const float d = au_dot_cpu_order<BF16>(qv, key, dI);
            coef[threadIdx.x] = d > 0 ? w.dI[di] * __fmul_rn(a.wscale, a.w[bt * HI + h]) : 0.f;
            qrow[threadIdx.x] = bt * HI + h;
        }
        __syncthreads();
        const int nb = nrows * HI - i0 < AU_THREADS ? (int)(nrows * HI - i0) : AU_THREADS;
        for (int64_t i = threadIdx.x; i < dI; i += AU_THREADS) {
            float v = acc[i];
            for (int kk = 0; kk < nb; kk++) v += coef[kk] * a.qi[qrow[kk] * dI + i];
            acc[i] = v;
        }
        __syncthreads();
    }
    float *g = a.dki + be * dI;
    for (int64_t i = threadIdx.x; i < dI; i += AU_THREADS) g[i] += acc[i];
}

template <bool BF16>
static ds4_status ix_kl_launch(cudaStream_t s, const indexer_kl_args *a, int64_t nmax, char *ws) {
    const indexer_dims *d = &a->dims;
    const int64_t BT = d->B * d->T;
    ix_kl_ws w;
    ix_kl_carve(&w, ws, a, nmax);
    const size_t smr = (size_t)nmax * (2 * sizeof(int32_t) + 2 * sizeof(float)) + (size_t)d->HI * sizeof(float) +
                       (size_t)(d->HI * d->dI) * sizeof(float);
    const size_t smk = (size_t)d->dI * sizeof(float);
    CUDA_ARG(au_smem(ix_kl_row_kernel<BF16>, smr) && au_smem(ix_kl_dki_kernel<BF16>, smk), "indexer_kl_fwd_bwd",
             "%lld entries per row and %lld x %lld indexer heads need %zu bytes of shared memory, more than the device gives a block",
             (long long)nmax, (long long)d->HI, (long long)d->dI, smr);
    ix_kl_row_kernel<BF16><<<(unsigned)BT, AU_THREADS, smr, s>>>(*a, nmax, w);
    CUDA_LAUNCHED("indexer_kl_fwd_bwd");
    ix_kl_sum_kernel<<<1, 1024, 0, s>>>(a->kl_sum, a->n_rows, w.row_kl, w.row_ok, d->B, d->T, w.part, w.part_n);
    CUDA_LAUNCHED("indexer_kl_fwd_bwd");
    if (a->dki && d->B * d->Nc > 0) {
        au_inverse inv = {NULL, NULL, NULL, 0, 0};
        if (a->topk) {
            CUDA_ARG(d->B * d->T * d->K < INT32_MAX, "indexer_kl_fwd_bwd", "B·T·K = %lld top-k slots, more than int32 holds",
                     (long long)(d->B * d->T * d->K));
            CUDA_TRY(au_inverse_build(&inv, w.inv, a->topk, d->B, d->T, d->K, d->Nc, s));
        }
        ix_kl_dki_kernel<BF16><<<(unsigned)(d->B * d->Nc), AU_THREADS, smk, s>>>(*a, nmax, w, inv.start, inv.list);
        CUDA_LAUNCHED("indexer_kl_fwd_bwd");
    }
    return DS4_OK;
}

static ds4_status ix_kl_check(const indexer_kl_args *a) {
    const indexer_dims *d = &a->dims;
    CUDA_ARG(d->B >= 0 && d->T >= 0 && d->HI >= 0 && d->dI >= 0 && d->Nc >= 0 && d->K >= 0 && a->H >= 0 && a->c >= 0,
             "indexer_kl_fwd_bwd", "negative size (B %lld, T %lld, HI %lld, dI %lld, Nc %lld, K %lld, H %lld, c %lld)",
             (long long)d->B, (long long)d->T, (long long)d->HI, (long long)d->dI, (long long)d->Nc, (long long)d->K,
             (long long)a->H, (long long)a->c);
    return DS4_OK;
}

ds4_status cuda_indexer_kl_fwd_bwd_ws(cudaStream_t s, const indexer_kl_args *a, void *ws) {
    const indexer_dims *d = &a->dims;
    DS4_TRY(ix_kl_check(a));
    CUDA_TRY(cudaMemsetAsync(a->kl_sum, 0, sizeof(double), s));
    CUDA_TRY(cudaMemsetAsync(a->n_rows, 0, sizeof(int64_t), s));
    const int64_t nmax = ix_kl_set_max(a);
    if (nmax == 0 || d->B * d->T == 0) return DS4_OK;
    CUDA_ARG(d->B * d->T <= INT32_MAX, "indexer_kl_fwd_bwd", "B·T = %lld rows, more than one launch holds",
             (long long)(d->B * d->T));
    return a->ki16 ? ix_kl_launch<true>(s, a, nmax, (char *)ws) : ix_kl_launch<false>(s, a, nmax, (char *)ws);
}

ds4_status cuda_indexer_kl_fwd_bwd(cudaStream_t s, const indexer_kl_args *a) {
    DS4_TRY(ix_kl_check(a)); /* before sizing the workspace with them */
    return au_with_ws(s, cuda_indexer_kl_workspace_bytes(a), [&](void *ws) { return cuda_indexer_kl_fwd_bwd_ws(s, a, ws); });
}
