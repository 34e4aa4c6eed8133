/* Gradient norms and clipping on the device, the rules of src/core/norm.c with the cpu's bits:
 *  - cuda_sumsq: Σ x² in double over fixed chunks of 2^16 elements, each summed left to right, the
 *    chunks' sums added in order (ds4_sumsq). A block owns a chunk: its threads stage the chunk through
 *    shared memory in coalesced tiles and one thread adds the squares in element order.
 *  - cuda_sumsq_exact: Σ x² exactly in the fixed-point limbs of ds4_sumsq_acc (ds4_sumsq_exact). Integer
 *    addition is associative, so the blocks add their elements' limbs with integer atomics in any order
 *    and the normalized result is the cpu's, bit for bit.
 *  - cuda_clip_scale: g *= max_norm / (norm + 1e-6) when the norm (a device scalar, so the step need not
 *    read it) exceeds max_norm (ds4_clip_scale). */
#include "kernels/cuda/cuda_common.cuh"

#define SQ_CHUNK ((int64_t)1 << 16) /* ds4_sumsq's chunk */
#define SQ_TILE 2048                /* elements a block stages at a time */
#define SQ_THREADS 256

/* part [c] = Σ x² over chunk c, element order, in double. */
static __global__ void sumsq_chunk_kernel(double *part, const float *x, int64_t n) {
    __shared__ float tile[SQ_TILE];
    const int64_t c0 = (int64_t)blockIdx.x * SQ_CHUNK, c1 = c0 + SQ_CHUNK < n ? c0 + SQ_CHUNK : n;
    double s = 0;
    for (int64_t t0 = c0; t0 < c1; t0 += SQ_TILE) {
        const int m = c1 - t0 < SQ_TILE ? (int)(c1 - t0) : SQ_TILE;
        for (int i = threadIdx.x; i < m; i += blockDim.x) tile[i] = x[t0 + i];
        __syncthreads();
        if (threadIdx.x == 0)
            for (int i = 0; i < m; i++) s += (double)tile[i] * tile[i];
        __syncthreads();
    }
    if (threadIdx.x == 0) part[blockIdx.x] = s;
}
/* *out = the chunks' sums added in order (one thread) */
static __global__ void sumsq_total_kernel(double *out, const double *part, int64_t nchunks) {
    double t = 0;
    for (int64_t c = 0; c < nchunks; c++) t += part[c];
    *out = t;
}

size_t cuda_sumsq_scratch_bytes(int64_t n) {
    const int64_t nchunks = (n + SQ_CHUNK - 1) / SQ_CHUNK;
    return (size_t)(nchunks > 0 ? nchunks : 1) * sizeof(double);
}

ds4_status cuda_sumsq(cudaStream_t s, double *out, const float *x, int64_t n, double *part) {
    CUDA_ARG(n >= 0, "sumsq", "n = %lld", (long long)n);
    const int64_t nchunks = (n + SQ_CHUNK - 1) / SQ_CHUNK;
    CUDA_ARG(nchunks <= INT32_MAX, "sumsq", "n = %lld", (long long)n);
    if (nchunks > 0) {
        sumsq_chunk_kernel<<<(unsigned)nchunks, SQ_THREADS, 0, s>>>(part, x, n);
        CUDA_LAUNCHED("sumsq chunks");
    }
    sumsq_total_kernel<<<1, 1, 0, s>>>(out, part, nchunks);
    CUDA_LAUNCHED("sumsq total");
    return DS4_OK;
}

/* ---------------------------------------------------------------- exact */
/* x² added into limbs (ds4_sumsq_exact's rule): x = mant·2^e, mant < 2^24, so x² = mant²·2^(2e) spans
 * three 32-bit limbs from bit pos = 2(e − 150) + 298; a non-finite x counts in the last limb. */
static __device__ void sq_add_atomic(unsigned long long *limb, float x) {
    const uint32_t bits = __float_as_uint(x), e = (bits >> 23) & 0xffu, frac = bits & 0x7fffffu;
    if (e == 255) {
        atomicAdd(&limb[DS4_SUMSQ_LIMBS], 1ull);
        return;
    }
    const uint64_t mant = e ? (frac | 0x800000u) : frac, sq = mant * mant;
    if (sq == 0) return;
    const int64_t pos = 2 * ((e ? (int64_t)e : 1) - 150) + 298, b = pos / 32, sh = pos % 32;
    const uint64_t lo = (sq & 0xffffffffu) << sh, hi = (sq >> 32) << sh;
    atomicAdd(&limb[b], lo & 0xffffffffu);
    atomicAdd(&limb[b + 1], (lo >> 32) + (hi & 0xffffffffu));
    atomicAdd(&limb[b + 2], hi >> 32);
}
/* The block adds its elements into shared limbs, then the shared limbs into acc (integer atomics: any
 * order gives the same number). */
static __global__ void sumsq_exact_kernel(unsigned long long *acc, const float *x, int64_t c0, int64_t c1) {
    __shared__ unsigned long long limb[DS4_SUMSQ_LIMBS + 1];
    for (int i = threadIdx.x; i <= DS4_SUMSQ_LIMBS; i += blockDim.x) limb[i] = 0;
    __syncthreads();
    for (int64_t i = c0 + (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < c1; i += (int64_t)gridDim.x * blockDim.x)
        sq_add_atomic(limb, x[i]);
    __syncthreads();
    for (int i = threadIdx.x; i <= DS4_SUMSQ_LIMBS; i += blockDim.x)
        if (limb[i]) atomicAdd(&acc[i], limb[i]);
}
/* Carries so that every limb but the top one is in [0, 2^32): ds4_sumsq_normalize (one thread). */
static __global__ void sumsq_normalize_kernel(int64_t *limb) {
    for (int i = 0; i + 1 < DS4_SUMSQ_LIMBS; i++) {
        limb[i + 1] += limb[i] >> 32;
        limb[i] &= 0xffffffff;
    }
}

ds4_status cuda_sumsq_exact(cudaStream_t s, ds4_sumsq_acc *acc, const float *x, int64_t n) {
    CUDA_ARG(n >= 0, "sumsq_exact", "n = %lld", (long long)n);
    DS4_TRY(cuda_fill(s, acc, 0, sizeof *acc));
    /* chunks of 2^28 elements, normalized after each: a limb gains < 2^34 per element, so no overflow */
    const int64_t chunk = (int64_t)1 << 28;
    for (int64_t c0 = 0; c0 < n; c0 += chunk) {
        const int64_t c1 = c0 + chunk < n ? c0 + chunk : n;
        const unsigned blocks = cuda_blocks(c1 - c0, SQ_THREADS) < 4096 ? cuda_blocks(c1 - c0, SQ_THREADS) : 4096;
        sumsq_exact_kernel<<<blocks, SQ_THREADS, 0, s>>>((unsigned long long *)acc->limb, x, c0, c1);
        CUDA_LAUNCHED("sumsq_exact");
        sumsq_normalize_kernel<<<1, 1, 0, s>>>(acc->limb);
        CUDA_LAUNCHED("sumsq_exact normalize");
    }
    return DS4_OK;
}

/* *value = ds4_sumsq_value(acc): from the top limb down, NaN if an element was not finite. */
static __global__ void sumsq_value_kernel(double *value, const ds4_sumsq_acc *a) {
    double s = 0;
    for (int i = DS4_SUMSQ_LIMBS - 1; i >= 0; i--) s += ldexp((double)a->limb[i], 32 * i - 298);
    *value = a->limb[DS4_SUMSQ_LIMBS] ? __longlong_as_double(0x7ff8000000000000ll) : s; /* NAN */
}
ds4_status cuda_sumsq_value(cudaStream_t s, double *value, const ds4_sumsq_acc *acc) {
    sumsq_value_kernel<<<1, 1, 0, s>>>(value, acc);
    CUDA_LAUNCHED("sumsq_value");
    return DS4_OK;
}

/* ---------------------------------------------------------------- clipping */
/* g [n] *= (float)(max_norm / (norm + 1e-6)) when max_norm > 0 and *norm > max_norm */
static __global__ void clip_scale_kernel(float *g, int64_t n, double max_norm, const double *norm) {
    const double nm = *norm;
    if (!(max_norm > 0 && nm > max_norm)) return;
    const float sc = (float)(max_norm / (nm + 1e-6));
    CUDA_GRID_STRIDE(i, n) g[i] *= sc;
}
ds4_status cuda_clip_scale(cudaStream_t s, float *g, int64_t n, double max_norm, const double *norm) {
    CUDA_ARG(n >= 0, "clip_scale", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    clip_scale_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(g, n, max_norm, norm);
    CUDA_LAUNCHED("clip_scale");
    return DS4_OK;
}

/* *norm = sqrt(*sumsq) (the step's norm from either sum, on the device) */
static __global__ void sqrt_kernel(double *norm, const double *sumsq) { *norm = sqrt(*sumsq); }
ds4_status cuda_sqrt(cudaStream_t s, double *norm, const double *sumsq) {
    sqrt_kernel<<<1, 1, 0, s>>>(norm, sumsq);
    CUDA_LAUNCHED("sqrt");
    return DS4_OK;
}

/* ---------------------------------------------------------------- scaling, the finite check */
/* x [n] *= sc (ds4_scale_f32: one product per element) */
static __global__ void scale_kernel(float *x, int64_t n, float sc) { CUDA_GRID_STRIDE(i, n) x[i] *= sc; }
ds4_status cuda_scale_f32(cudaStream_t s, float *x, int64_t n, float sc) {
    CUDA_ARG(n >= 0, "scale_f32", "n = %lld", (long long)n);
    if (n == 0) return DS4_OK;
    scale_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>(x, n, sc);
    CUDA_LAUNCHED("scale_f32");
    return DS4_OK;
}

/* *out += the non-finite elements of x [n]: an integer count, the same in any order */
static __global__ void nonfinite_kernel(unsigned long long *out, const float *x, int64_t n) {
    unsigned long long bad = 0;
    CUDA_GRID_STRIDE(i, n) bad += !isfinite(x[i]);
    if (bad) atomicAdd(out, bad);
}
ds4_status cuda_count_nonfinite(cudaStream_t s, int64_t *out, const float *x, int64_t n) {
    CUDA_ARG(n >= 0, "count_nonfinite", "n = %lld", (long long)n);
    CUDA_TRY(cudaMemsetAsync(out, 0, sizeof *out, s));
    if (n == 0) return DS4_OK;
    nonfinite_kernel<<<cuda_blocks(n, 256), 256, 0, s>>>((unsigned long long *)out, x, n);
    CUDA_LAUNCHED("count_nonfinite");
    return DS4_OK;
}
