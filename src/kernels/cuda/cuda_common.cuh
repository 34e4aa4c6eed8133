/* Internal to the CUDA backend's .cu files: turning CUDA errors into ds4_status, launch checks, the grid
 * arithmetic every launcher shares, and the bf16 rounding of kernels.h on the device. */
#ifndef DS4_KERNELS_CUDA_COMMON_CUH
#define DS4_KERNELS_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>

#include "kernels/cuda/cuda.h"

/* A CUDA runtime call whose failure becomes ds4_fail(...) returned from the enclosing function, the
 * message naming the call, the runtime's reason and the place. Out of memory is DS4_ERR_OOM. */
static inline ds4_status cuda_status(cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess) return DS4_OK;
    (void)cudaGetLastError(); /* clear a sticky-free error so the next call starts clean */
    return ds4_fail(e == cudaErrorMemoryAllocation ? DS4_ERR_OOM : DS4_ERR_INTERNAL, "cuda: %s: %s (%s:%d)", what,
                    cudaGetErrorString(e), file, line);
}
#define CUDA_TRY(call)                                                                   \
    do {                                                                                 \
        ds4_status cuda_try_s_ = cuda_status((call), #call, __FILE__, __LINE__);         \
        if (cuda_try_s_ != DS4_OK) return cuda_try_s_;                                   \
    } while (0)
/* After a <<<...>>> launch: a bad configuration or a missing kernel image is reported here (errors
 * inside the kernel surface at the next synchronizing call). */
#define CUDA_LAUNCHED(op) CUDA_TRY(cudaGetLastError())

/* A size argument that must be >= 0 (and fit the kernels' int64 indexing). */
#define CUDA_ARG(cond, op, ...)                                                         \
    do {                                                                                \
        if (!(cond)) return ds4_fail(DS4_ERR_ARG, "cuda " op ": " __VA_ARGS__);         \
    } while (0)

/* Blocks of `threads` covering n items (at least 1 block; callers return early for n == 0). The grid's
 * x dimension holds 2^31 − 1 blocks: grid-stride loops cover the rest. */
static inline unsigned cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads;
    if (b < 1) b = 1;
    return (unsigned)(b > 65535 * 1024 ? 65535 * 1024 : b);
}
#define CUDA_GRID_STRIDE(i, n) \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (int64_t)gridDim.x * blockDim.x)

/* kernels.h bf16_round_u32 on the device: nearest even, NaN quiet, ±Inf stays, zero and denormals to a
 * signed zero. */
__device__ __forceinline__ uint32_t cuda_bf16_round_u32(uint32_t u) {
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    const uint32_t quiet_nan = (u | 0x00400000u) & 0xffff0000u;
    const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded;
    return (u & 0x7f800000u) == 0 ? u & 0x80000000u : r;
}
__device__ __forceinline__ uint16_t cuda_bf16_bits(float x) {
    return (uint16_t)(cuda_bf16_round_u32(__float_as_uint(x)) >> 16);
}
__device__ __forceinline__ float cuda_bf16_widen(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }

/* Threads of a block that owns one row (a row sum, a row's softmax). */
#define CUDA_ROW_THREADS 256

/* Sum of one double per thread over a block of CUDA_ROW_THREADS threads, in a fixed tree order (warp
 * shuffles, then the warps' sums by warp 0): deterministic; every thread gets the sum. */
static __device__ __forceinline__ double cuda_block_sum(double v) {
    __shared__ double part[CUDA_ROW_THREADS / 32];
    __shared__ double total;
    for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x < 32) {
        v = threadIdx.x < CUDA_ROW_THREADS / 32 ? part[threadIdx.x] : 0.0;
        for (int o = 16; o > 0; o /= 2) v += __shfl_down_sync(0xffffffffu, v, o);
        if (threadIdx.x == 0) total = v;
    }
    __syncthreads();
    v = total;
    __syncthreads(); /* the next call may overwrite part and total */
    return v;
}

#endif
