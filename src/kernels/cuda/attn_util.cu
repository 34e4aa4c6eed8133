/* The inverse key lists of a top-k and the stream-ordered workspace of the attention-family kernels
 * (attn_util.cuh says what they are). */
#include "kernels/cuda/attn_util.cuh"

cudaError_t au_ws_alloc(void **p, size_t bytes, cudaStream_t s) {
    *p = NULL;
    return bytes ? cudaMallocAsync(p, bytes, s) : cudaSuccess;
}

void au_ws_free(void *p, cudaStream_t s) {
    if (p) cudaFreeAsync(p, s);
}

/* Chunks of query rows the counting sort splits each batch row into: enough threads to fill in
 * parallel, a count matrix of nchunk·Nc. Only speed depends on it (the lists are unique). */
static int64_t au_nchunk(int64_t T) { return T < 512 ? T : 512; }

size_t au_inverse_bytes(int64_t B, int64_t T, int64_t K, int64_t Nc) {
    int64_t nchunk = au_nchunk(T);
    return AU_ALIGN((size_t)(B * Nc + 1) * sizeof(int64_t)) + AU_ALIGN((size_t)(B * T * K) * sizeof(int32_t)) +
           AU_ALIGN((size_t)(B * nchunk * Nc) * sizeof(int64_t));
}

/* cur [B, nchunk, Nc] (zeroed) += 1 per valid slot. One thread per slot. */
__global__ void au_inverse_count(int64_t *cur, const int32_t *topk, int64_t B, int64_t T, int64_t K, int64_t Nc,
                                 int64_t nchunk, int64_t rpc) {
    int64_t slot = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (slot >= B * T * K) return;
    int32_t id = topk[slot];
    if (id < 0 || id >= Nc) return;
    int64_t bt = slot / K, b = bt / T, t = bt % T;
    atomicAdd((unsigned long long *)&cur[(b * nchunk + t / rpc) * Nc + id], 1ull);
}

/* One block of 1024 threads: counts -> each chunk's start in its entry's list (entry order, then chunk
 * order), start [B·Nc + 1] = the lists' offsets. */
#define AU_SCAN_THREADS 1024
__global__ void __launch_bounds__(AU_SCAN_THREADS) au_inverse_scan(int64_t *start, int64_t *cur, int64_t B, int64_t Nc,
                                                                   int64_t nchunk) {
    __shared__ int64_t part[AU_SCAN_THREADS];
    const int64_t G = B * Nc;
    /* per entry: exclusive sums over its chunks; the entry's total into start[g] */
    for (int64_t g = threadIdx.x; g < G; g += AU_SCAN_THREADS) {
        int64_t b = g / Nc, e = g % Nc, run = 0;
        for (int64_t ch = 0; ch < nchunk; ch++) {
            int64_t *p = &cur[(b * nchunk + ch) * Nc + e];
            int64_t v = *p;
            *p = run;
            run += v;
        }
        start[g] = run;
    }
    __syncthreads();
    /* exclusive sum of the totals: each thread a contiguous range, the ranges' sums in thread order */
    const int64_t per = (G + AU_SCAN_THREADS - 1) / AU_SCAN_THREADS;
    const int64_t g0 = threadIdx.x * per < G ? threadIdx.x * per : G, g1 = g0 + per < G ? g0 + per : G;
    int64_t sum = 0;
    for (int64_t g = g0; g < g1; g++) sum += start[g];
    part[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t run = 0;
        for (int i = 0; i < AU_SCAN_THREADS; i++) {
            int64_t v = part[i];
            part[i] = run;
            run += v;
        }
        start[G] = run;
    }
    __syncthreads();
    int64_t run = part[threadIdx.x];
    for (int64_t g = g0; g < g1; g++) {
        int64_t v = start[g];
        start[g] = run;
        run += v;
    }
    __syncthreads();
    for (int64_t g = threadIdx.x; g < G; g += AU_SCAN_THREADS) {
        int64_t b = g / Nc, e = g % Nc, s0 = start[g];
        for (int64_t ch = 0; ch < nchunk; ch++) cur[(b * nchunk + ch) * Nc + e] += s0;
    }
}

/* One thread per (batch row, chunk): its rows' slots in order, each at its entry's cursor. */
__global__ void au_inverse_fill(int32_t *list, int64_t *cur, const int32_t *topk, int64_t B, int64_t T, int64_t K,
                                int64_t Nc, int64_t nchunk, int64_t rpc) {
    int64_t bc = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (bc >= B * nchunk) return;
    int64_t b = bc / nchunk, ch = bc % nchunk;
    int64_t t0 = ch * rpc, t1 = t0 + rpc < T ? t0 + rpc : T;
    int64_t *c = cur + bc * Nc;
    for (int64_t t = t0; t < t1; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t slot = (b * T + t) * K + k;
            int32_t id = topk[slot];
            if (id >= 0 && id < Nc) list[c[id]++] = (int32_t)slot;
        }
}

cudaError_t au_inverse_build(au_inverse *inv, void *ws, const int32_t *topk, int64_t B, int64_t T, int64_t K,
                             int64_t Nc, cudaStream_t s) {
    char *p = (char *)ws;
    inv->nchunk = au_nchunk(T);
    inv->rows_per_chunk = (T + inv->nchunk - 1) / inv->nchunk;
    inv->start = (int64_t *)p;
    p += AU_ALIGN((size_t)(B * Nc + 1) * sizeof(int64_t));
    inv->list = (int32_t *)p;
    p += AU_ALIGN((size_t)(B * T * K) * sizeof(int32_t));
    inv->cur = (int64_t *)p;
    if (B * T * K >= INT32_MAX) return cudaErrorInvalidValue; /* slots are stored as int32 */
    cudaError_t e = cudaMemsetAsync(inv->cur, 0, (size_t)(B * inv->nchunk * Nc) * sizeof(int64_t), s);
    if (e != cudaSuccess) return e;
    const int64_t slots = B * T * K;
    if (slots > 0)
        au_inverse_count<<<(unsigned)((slots + 255) / 256), 256, 0, s>>>(inv->cur, topk, B, T, K, Nc, inv->nchunk,
                                                                        inv->rows_per_chunk);
    au_inverse_scan<<<1, AU_SCAN_THREADS, 0, s>>>(inv->start, inv->cur, B, Nc, inv->nchunk);
    const int64_t nb = B * inv->nchunk;
    if (nb > 0)
        au_inverse_fill<<<(unsigned)((nb + 127) / 128), 128, 0, s>>>(inv->list, inv->cur, topk, B, T, K, Nc,
                                                                    inv->nchunk, inv->rows_per_chunk);
    return cudaGetLastError();
}
