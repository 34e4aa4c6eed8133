/* Data movement of the CUDA backend (cpu/data.c's ops): copies and fills, bf16 rounding and packing,
 * shifted token ids, the n residual streams. One thread per output element, each doing the cpu's
 * arithmetic for that element (a sum over streams runs k = 0, 1, ... as on the cpu): the same bits. */
#include "kernels/cuda/cuda_common.cuh"

#define DATA_THREADS 256

ds4_status cuda_tensor_copy(cudaStream_t s, void *dst, const void *src, size_t bytes) {
    return cuda_copy_d2d(s, dst, src, bytes);
}

ds4_status cuda_tensor_zero(cudaStream_t s, void *dst, size_t bytes) { return cuda_fill(s, dst, 0, bytes); }

/* dst [n] += src [n] */
static __global__ void add_kernel(float *dst, const float *src, int64_t n) {
    CUDA_GRID_STRIDE(i, n) dst[i] += src[i];
}
ds4_status cuda_tensor_add(cudaStream_t s, float *dst, const float *src, int64_t n) {
    CUDA_ARG(n >= 0, "tensor_add", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    add_kernel<<<cuda_blocks(n, DATA_THREADS), DATA_THREADS, 0, s>>>(dst, src, n);
    CUDA_LAUNCHED("tensor_add");
    return DS4_OK;
}

/* x [n] in place: each value rounded to bf16 (gemm_bf16_round) */
static __global__ void round_bf16_kernel(float *x, int64_t n) {
    CUDA_GRID_STRIDE(i, n) x[i] = __uint_as_float(cuda_bf16_round_u32(__float_as_uint(x[i])));
}
ds4_status cuda_tensor_round_bf16(cudaStream_t s, float *x, int64_t n) {
    CUDA_ARG(n >= 0, "tensor_round_bf16", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    round_bf16_kernel<<<cuda_blocks(n, DATA_THREADS), DATA_THREADS, 0, s>>>(x, n);
    CUDA_LAUNCHED("tensor_round_bf16");
    return DS4_OK;
}

/* dst [n] = bf16 bits of src [n] */
static __global__ void pack_bf16_kernel(uint16_t *dst, const float *src, int64_t n) {
    CUDA_GRID_STRIDE(i, n) dst[i] = cuda_bf16_bits(src[i]);
}
ds4_status cuda_tensor_pack_bf16(cudaStream_t s, uint16_t *dst, const float *src, int64_t n) {
    CUDA_ARG(n >= 0, "tensor_pack_bf16", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    pack_bf16_kernel<<<cuda_blocks(n, DATA_THREADS), DATA_THREADS, 0, s>>>(dst, src, n);
    CUDA_LAUNCHED("tensor_pack_bf16");
    return DS4_OK;
}

/* dst [n] = the floats of bf16 bits src [n] */
static __global__ void unpack_bf16_kernel(float *dst, const uint16_t *src, int64_t n) {
    CUDA_GRID_STRIDE(i, n) dst[i] = cuda_bf16_widen(src[i]);
}
ds4_status cuda_tensor_unpack_bf16(cudaStream_t s, float *dst, const uint16_t *src, int64_t n) {
    CUDA_ARG(n >= 0, "tensor_unpack_bf16", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    unpack_bf16_kernel<<<cuda_blocks(n, DATA_THREADS), DATA_THREADS, 0, s>>>(dst, src, n);
    CUDA_LAUNCHED("tensor_unpack_bf16");
    return DS4_OK;
}

/* out[b, t] = ids[b, t + shift] while t + shift < T, else fill. out, ids: [B, T] */
static __global__ void shift_ids_kernel(int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift,
                                        int32_t fill) {
    CUDA_GRID_STRIDE(i, B * T) {
        const int64_t t = i % T;
        out[i] = t + shift < T ? ids[i + shift] : fill;
    }
}
ds4_status cuda_shift_ids(cudaStream_t s, int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift,
                          int32_t fill) {
    CUDA_ARG(B >= 0 && T >= 0 && shift >= 0, "shift_ids", "B %lld T %lld shift %lld", (long long)B, (long long)T,
             (long long)shift);
    if (B * T == 0) return DS4_OK;
    shift_ids_kernel<<<cuda_blocks(B * T, DATA_THREADS), DATA_THREADS, 0, s>>>(out, ids, B, T, shift, fill);
    CUDA_LAUNCHED("shift_ids");
    return DS4_OK;
}

/* Tokens [t0, t1) of the in-place expand: X[t, k] = X's row t (read where x [N, D] lies). */
static __global__ void streams_expand_kernel(float *X, int64_t t0, int64_t t1, int64_t n, int64_t D) {
    CUDA_GRID_STRIDE(i, (t1 - t0) * n * D) {
        const int64_t d = i % D, k = i / D % n, t = t0 + i / (n * D);
        X[(t * n + k) * D + d] = X[t * D + d];
    }
}
/* X [N, n, D], its first N·D floats holding x [N, D], gets every stream X[t, k] = x[t], in place and
 * without scratch: in launches over token ranges [t0, t1) from the last tokens down, each with
 * t1 <= t0·n, so a launch writes [t0·n·D, t1·n·D), above the rows [t0·D, t1·D) it reads, and only over
 * rows of tokens already expanded. Token 0 alone last (its stream 0 is its own row: rewritten unchanged). */
ds4_status cuda_streams_expand(cudaStream_t s, float *X, int64_t N, int64_t n, int64_t D) {
    CUDA_ARG(N >= 0 && n >= 1 && D >= 0, "streams_expand", "N %lld n %lld D %lld", (long long)N, (long long)n,
             (long long)D);
    if (N * D == 0 || n == 1) return DS4_OK;
    for (int64_t t1 = N; t1 > 0;) {
        const int64_t t0 = t1 == 1 ? 0 : (t1 + n - 1) / n;
        streams_expand_kernel<<<cuda_blocks((t1 - t0) * n * D, DATA_THREADS), DATA_THREADS, 0, s>>>(X, t0, t1, n, D);
        CUDA_LAUNCHED("streams_expand");
        t1 = t0;
    }
    return DS4_OK;
}

/* X[t, k] += x[t] for every stream k */
static __global__ void streams_add_kernel(float *X, const float *x, int64_t N, int64_t n, int64_t D) {
    CUDA_GRID_STRIDE(i, N * n * D) {
        const int64_t d = i % D, t = i / (n * D);
        X[i] += x[t * D + d];
    }
}
ds4_status cuda_streams_add(cudaStream_t s, float *X, const float *x, int64_t N, int64_t n, int64_t D) {
    CUDA_ARG(N >= 0 && n >= 1 && D >= 0, "streams_add", "N %lld n %lld D %lld", (long long)N, (long long)n,
             (long long)D);
    if (N * D == 0) return DS4_OK;
    streams_add_kernel<<<cuda_blocks(N * n * D, DATA_THREADS), DATA_THREADS, 0, s>>>(X, x, N, n, D);
    CUDA_LAUNCHED("streams_add");
    return DS4_OK;
}

/* dx[t] += Σ_k dX[t, k], k ascending: the cpu adds each stream into dx in turn, so the element's chain is
 * ((dx + dX[t,0]) + dX[t,1]) + ... */
static __global__ void streams_sum_kernel(float *dx, const float *dX, int64_t N, int64_t n, int64_t D) {
    CUDA_GRID_STRIDE(i, N * D) {
        const int64_t d = i % D, t = i / D;
        float acc = dx[i];
        for (int64_t k = 0; k < n; k++) acc += dX[(t * n + k) * D + d];
        dx[i] = acc;
    }
}
ds4_status cuda_streams_sum(cudaStream_t s, float *dx, const float *dX, int64_t N, int64_t n, int64_t D) {
    CUDA_ARG(N >= 0 && n >= 1 && D >= 0, "streams_sum", "N %lld n %lld D %lld", (long long)N, (long long)n,
             (long long)D);
    if (N * D == 0) return DS4_OK;
    streams_sum_kernel<<<cuda_blocks(N * D, DATA_THREADS), DATA_THREADS, 0, s>>>(dx, dX, N, n, D);
    CUDA_LAUNCHED("streams_sum");
    return DS4_OK;
}
