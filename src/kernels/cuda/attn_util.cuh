/* Device helpers shared by the attention-family CUDA kernels (attn.cu, indexer.cu): key loads that
 * widen bf16 bits, dot products in a fixed order, block sums in a fixed order, and the inverse key
 * lists (which query rows use a compressed entry) that let the key gradients be gathered instead of
 * scattered, so no float is ever added by two threads in a racing order.
 *
 * Every reduction here has an order fixed by the code and the compile-time block sizes below, never by
 * the grid or the GPU: the same inputs give the same bits on any launch. */
#ifndef DS4_KERNELS_CUDA_ATTN_UTIL_CUH
#define DS4_KERNELS_CUDA_ATTN_UTIL_CUH

#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/cuda/attn.cuh"
#include "kernels/cuda/cuda_common.cuh"

#define AU_THREADS 128 /* threads of every per-row block of these kernels */
#define AU_WARPS (AU_THREADS / 32)
#define AU_BATCH 32 /* keys (or query items) scored per step before their weighted rows are summed */

/* Element i of a key row: fp32, or bf16 bits widened exactly (a bf16 key reads as the float it was
 * rounded to). */
template <bool BF16>
__device__ __forceinline__ float au_key(const void *row, int64_t i) {
    if (BF16) return __uint_as_float((uint32_t)((const uint16_t *)row)[i] << 16);
    return ((const float *)row)[i];
}

/* Row `r` of a key matrix with rows of n elements (fp32 or bf16 bits). */
template <bool BF16>
__device__ __forceinline__ const void *au_row(const void *base, int64_t r, int64_t n) {
    return (const char *)base + (size_t)(r * n) * (BF16 ? sizeof(uint16_t) : sizeof(float));
}

/* x·k over n elements by one warp: lane l sums elements l, l + 32, ... in order, then a butterfly of
 * shuffles (a fixed tree). Every lane returns the sum. */
template <bool BF16>
__device__ __forceinline__ float au_warp_dot(const float *x, const void *k, int64_t n, int lane) {
    float s = 0.f;
    for (int64_t i = lane; i < n; i += 32) s += x[i] * au_key<BF16>(k, i);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    return s;
}

/* Σ over the block of v (AU_THREADS threads): warp butterflies, then the warp sums in warp order.
 * red: AU_WARPS floats of shared memory. Every thread returns the sum. */
__device__ __forceinline__ float au_block_sum(float v, float *red) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads(); /* red may still be read by a previous call */
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    float s = red[0];
    for (int w = 1; w < AU_WARPS; w++) s += red[w];
    return s;
}

/* x·k over n elements in the cpu kernels' order (cpu/indexer.inc ix_dot4, cpu/sparse_attn.inc sa_dot4):
 * lanes l < 8 of two 8-wide accumulators a (elements i + l) and b (i + 8 + l), i stepping by 16, one more
 * 8-wide step into a, the lanes summed as ((v0+v1)+(v2+v3)) + ((v4+v5)+(v6+v7)) with v = a + b, then
 * the tail in order. Every product and sum rounded on its own (no fused multiply-add, as the cpu build's
 * -ffp-contract=off), so one thread gives the cpu's bits exactly: the indexer's top-k then selects the
 * cpu's entries even at near-ties. */
template <bool BF16>
__device__ __forceinline__ float au_dot_cpu_order(const float *x, const void *k, int64_t n) {
    float a[8], b[8];
#pragma unroll
    for (int l = 0; l < 8; l++) a[l] = 0.f, b[l] = 0.f;
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
#pragma unroll
        for (int l = 0; l < 8; l++) {
            a[l] = __fadd_rn(a[l], __fmul_rn(x[i + l], au_key<BF16>(k, i + l)));
            b[l] = __fadd_rn(b[l], __fmul_rn(x[i + 8 + l], au_key<BF16>(k, i + 8 + l)));
        }
    }
    for (; i + 8 <= n; i += 8) {
#pragma unroll
        for (int l = 0; l < 8; l++) a[l] = __fadd_rn(a[l], __fmul_rn(x[i + l], au_key<BF16>(k, i + l)));
    }
    float v[8];
#pragma unroll
    for (int l = 0; l < 8; l++) v[l] = __fadd_rn(a[l], b[l]);
    float s = __fadd_rn(__fadd_rn(__fadd_rn(v[0], v[1]), __fadd_rn(v[2], v[3])),
                        __fadd_rn(__fadd_rn(v[4], v[5]), __fadd_rn(v[6], v[7])));
    for (; i < n; i++) s = __fadd_rn(s, __fmul_rn(x[i], au_key<BF16>(k, i)));
    return s;
}

/* The valid ids of a top-k row (0 <= id < Nc), in slot order, compacted into out[] by warp 0 with
 * ballots (order kept); slot[] (or NULL) gets each one's slot k. Returns the count to every thread.
 * cnt: one int of shared memory. */
__device__ __forceinline__ int au_compact_ids(int32_t *out, int32_t *slot, const int32_t *ids, int64_t K, int64_t Nc,
                                              int *cnt) {
    if (threadIdx.x < 32) {
        const int lane = threadIdx.x;
        int n = 0;
        for (int64_t k0 = 0; k0 < K; k0 += 32) {
            int64_t k = k0 + lane;
            int32_t id = k < K ? ids[k] : -1;
            bool ok = id >= 0 && id < Nc;
            unsigned m = __ballot_sync(0xffffffffu, ok);
            if (ok) {
                int at = n + __popc(m & ((1u << lane) - 1u));
                out[at] = id;
                if (slot) slot[at] = (int32_t)k;
            }
            n += __popc(m);
        }
        if (lane == 0) *cnt = n;
    }
    __syncthreads();
    return *cnt;
}

/* ---- inverse lists of a top-k: for each compressed entry (b, e), the top-k slots that name it.
 * The result is unique: entry g = b·Nc + e owns list[start[g] .. start[g + 1]), the flat slots
 * bt·K + k with topk[bt·K + k] == e, in ascending order (so query rows ascending, each row's slots
 * ascending). Built by a stable counting sort: counts per (batch row, chunk of query rows, entry)
 * (integer atomics: exact in any order), exclusive sums in (entry, chunk) order, then one thread per
 * chunk writing its rows' slots in order. */
typedef struct {
    int64_t *start; /* [B·Nc + 1] */
    int32_t *list;  /* [B·T·K] (only the first start[B·Nc] are used) */
    int64_t *cur;   /* [B, nchunk, Nc] counts, then write cursors */
    int64_t nchunk, rows_per_chunk;
} au_inverse;

/* Bytes of the inverse lists' workspace for B, T, K, Nc (a plan counts these). */
size_t au_inverse_bytes(int64_t B, int64_t T, int64_t K, int64_t Nc);
/* Builds the lists in ws (au_inverse_bytes of it) on stream s; *inv points into ws. */
cudaError_t au_inverse_build(au_inverse *inv, void *ws, const int32_t *topk, int64_t B, int64_t T, int64_t K,
                             int64_t Nc, cudaStream_t s);

/* Stream-ordered workspace: cudaMallocAsync / cudaFreeAsync on the launch's stream (0 bytes: NULL). */
cudaError_t au_ws_alloc(void **p, size_t bytes, cudaStream_t s);
void au_ws_free(void *p, cudaStream_t s);
/* A launcher without a caller's workspace: `bytes` taken on s, run(ws), freed on s. */
template <typename Run>
static inline ds4_status au_with_ws(cudaStream_t s, size_t bytes, Run run) {
    void *ws;
    CUDA_TRY(au_ws_alloc(&ws, bytes, s));
    ds4_status st = run(ws);
    au_ws_free(ws, s);
    return st;
}

/* Raises a kernel's dynamic shared-memory limit when bytes > 48 KiB; false when the device cannot
 * give that much. */
template <typename F>
static inline bool au_smem(F *kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return true;
    int dev = 0, max = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&max, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev) != cudaSuccess)
        return false;
    if (bytes > (size_t)max) return false;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes) == cudaSuccess;
}

#define AU_ALIGN(n) (((size_t)(n) + 255) & ~(size_t)255)

#endif
