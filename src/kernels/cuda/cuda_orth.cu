/* Newton–Schulz orthogonalization on the device, the matrix step of Muon: src/model/orth.c's steps
 * (transpose to the short side, divide by the Frobenius norm + eps, quintic iterations, transpose back)
 * with its GEMMs on cuBLASLt in the run's precision and its element-wise steps with the cpu's arithmetic.
 * The norm is cuda_sumsq's (ds4_sumsq's bits) and is read on the device: nothing comes back to the host. */
#include "kernels/cuda/cuda_common.cuh"

/* out [c, r] = x [r, c] transposed */
static __global__ void transpose_kernel(float *out, const float *x, int64_t r, int64_t c) {
    CUDA_GRID_STRIDE(q, r * c) {
        const int64_t i = q / c, j = q % c;
        out[j * r + i] = x[q];
    }
}
/* x [n] /= (float)sqrt(*sumsq) + eps */
static __global__ void normalize_kernel(float *x, int64_t n, const double *sumsq, float eps) {
    const float d = (float)sqrt(*sumsq) + eps;
    CUDA_GRID_STRIDE(i, n) x[i] = x[i] / d;
}
/* B [n] = b·A + c·B */
static __global__ void combine_kernel(float *B, const float *A, int64_t n, float b, float c) {
    CUDA_GRID_STRIDE(i, n) B[i] = b * A[i] + c * B[i];
}
/* x [n] = a·x + y */
static __global__ void update_kernel(float *x, const float *y, int64_t n, float a) {
    CUDA_GRID_STRIDE(i, n) x[i] = a * x[i] + y[i];
}

/* The scratch's pieces for x [rows, cols], r = min, c = max: A, B [r, r], y [r, c], t [r, c] when
 * rows > cols, then the norm's doubles (cuda_sumsq's sum and chunk sums). Returns the bytes. */
static size_t ns_layout(int64_t rows, int64_t cols, size_t off[5]) {
    const int64_t r = rows < cols ? rows : cols, c = rows < cols ? cols : rows;
    const size_t f = sizeof(float);
    off[0] = 0;                                       /* A */
    off[1] = off[0] + (size_t)(r * r) * f;            /* B */
    off[2] = off[1] + (size_t)(r * r) * f;            /* y */
    off[3] = off[2] + (size_t)(r * c) * f;            /* t (tall only) */
    off[4] = off[3] + (rows > cols ? (size_t)(r * c) * f : 0);
    off[4] = (off[4] + 7) / 8 * 8;                    /* the doubles */
    return off[4] + 8 + cuda_sumsq_scratch_bytes(r * c);
}
size_t cuda_newton_schulz_scratch_bytes(int64_t rows, int64_t cols) {
    size_t off[5];
    return ns_layout(rows, cols, off);
}

ds4_status cuda_newton_schulz(cuda_blas *bl, cudaStream_t s, ds4_matmul_precision p, float *x, int64_t rows,
                              int64_t cols, const float *coef, int64_t iters, float eps, void *scratch) {
    CUDA_ARG(rows >= 1 && cols >= 1 && iters >= 0, "newton_schulz", "a %lld x %lld matrix, %lld iterations",
             (long long)rows, (long long)cols, (long long)iters);
    const bool tall = rows > cols; /* work on xᵀ: the Gram matrix is then the small one */
    const int64_t r = tall ? cols : rows, c = tall ? rows : cols, n = r * c;
    size_t off[5];
    ns_layout(rows, cols, off);
    char *base = (char *)scratch;
    float *A = (float *)(base + off[0]), *B = (float *)(base + off[1]), *y = (float *)(base + off[2]);
    float *t = tall ? (float *)(base + off[3]) : x;
    double *sumsq = (double *)(base + off[4]), *part = sumsq + 1;
    const unsigned gn = cuda_blocks(n, 256), grr = cuda_blocks(r * r, 256);
    if (tall) {
        transpose_kernel<<<gn, 256, 0, s>>>(t, x, rows, cols);
        CUDA_LAUNCHED("newton_schulz transpose");
    }
    DS4_TRY(cuda_sumsq(s, sumsq, t, n, part));
    normalize_kernel<<<gn, 256, 0, s>>>(t, n, sumsq, eps);
    CUDA_LAUNCHED("newton_schulz normalize");
    for (int64_t i = 0; i < iters; i++) { /* A = t·tᵀ, B = b·A + c·A·A, t = a·t + B·t */
        const float ka = coef[3 * i], kb = coef[3 * i + 1], kc = coef[3 * i + 2];
        DS4_TRY(cuda_gemm_nt(bl, s, p, r, r, c, t, c, t, c, A, r, 0.0f));
        DS4_TRY(cuda_gemm_nn(bl, s, p, r, r, r, A, r, A, r, B, r, 0.0f));
        combine_kernel<<<grr, 256, 0, s>>>(B, A, r * r, kb, kc);
        CUDA_LAUNCHED("newton_schulz combine");
        DS4_TRY(cuda_gemm_nn(bl, s, p, r, c, r, B, r, t, c, y, c, 0.0f));
        update_kernel<<<gn, 256, 0, s>>>(t, y, n, ka);
        CUDA_LAUNCHED("newton_schulz update");
    }
    if (tall) {
        transpose_kernel<<<gn, 256, 0, s>>>(x, t, r, c);
        CUDA_LAUNCHED("newton_schulz transpose");
    }
    return DS4_OK;
}
