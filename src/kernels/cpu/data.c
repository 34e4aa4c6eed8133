/* Data movement of the model around its ops: copies and fills, the shifted token ids, and the n residual
 * streams made from one row and summed back (cpu_<op>, cpu.h). Plain loops in a fixed order: every
 * element is written (or accumulated) exactly as the model's own loops did, so results keep their bits. */
#include <string.h>

#include "kernels/cpu/cpu.h"

/* Large copies and fills in fixed 64 KiB pieces shared among the threads (below 1 MiB one thread: a
 * team costs more than it saves). */
#define DATA_PIECE ((size_t)1 << 16)
#define DATA_PAR_BYTES ((size_t)1 << 20)

void cpu_tensor_copy(void *dst, const void *src, size_t bytes) {
    if (bytes < DATA_PAR_BYTES) {
        memcpy(dst, src, bytes);
        return;
    }
    const int64_t n = (int64_t)((bytes + DATA_PIECE - 1) / DATA_PIECE);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        size_t o = (size_t)i * DATA_PIECE;
        memcpy((char *)dst + o, (const char *)src + o, bytes - o < DATA_PIECE ? bytes - o : DATA_PIECE);
    }
}

void cpu_tensor_zero(void *dst, size_t bytes) {
    if (bytes < DATA_PAR_BYTES) {
        memset(dst, 0, bytes);
        return;
    }
    const int64_t n = (int64_t)((bytes + DATA_PIECE - 1) / DATA_PIECE);
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        size_t o = (size_t)i * DATA_PIECE;
        memset((char *)dst + o, 0, bytes - o < DATA_PIECE ? bytes - o : DATA_PIECE);
    }
}

/* bf16 activations: element by element (simd lanes included), so the bits do not depend on the thread
 * count or the vector width. */
void cpu_tensor_round_bf16(float *x, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        u = bf16_round_u32(u);
        memcpy(x + i, &u, sizeof u);
    }
}

void cpu_tensor_pack_bf16(uint16_t *dst, const float *src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, src + i, sizeof u);
        dst[i] = (uint16_t)(bf16_round_u32(u) >> 16);
    }
}

void cpu_tensor_unpack_bf16(float *dst, const uint16_t *src, int64_t n) {
#pragma omp parallel for simd schedule(static) if (n > 65536)
    for (int64_t i = 0; i < n; i++) dst[i] = bf16_widen(src[i]);
}

/* out[b, t] = ids[b, t + shift] while t + shift < T, else fill. out, ids: [B, T]. */
void cpu_shift_ids(int32_t *out, const int32_t *ids, int64_t B, int64_t T, int64_t shift, int32_t fill) {
    for (int64_t b = 0; b < B; b++)
        for (int64_t t = 0; t < T; t++) out[b * T + t] = t + shift < T ? ids[b * T + t + shift] : fill;
}

/* X: [N, n, D], its first N·D floats holding x [N, D]: every stream X[t, k] becomes x[t]. In place, from
 * the last token down, so no row is overwritten before it is read. */
void cpu_streams_expand(float *X, int64_t N, int64_t n, int64_t D) {
    for (int64_t t = N - 1; t >= 0; t--)
        for (int64_t k = n - 1; k >= 0; k--) memmove(X + (t * n + k) * D, X + t * D, (size_t)D * sizeof(float));
}

/* X[t, k] += x[t] for every stream k. X: [N, n, D]; x: [N, D]. */
void cpu_streams_add(float *X, const float *x, int64_t N, int64_t n, int64_t D) {
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < n; k++) {
            float *dst = X + (t * n + k) * D;
            for (int64_t d = 0; d < D; d++) dst[d] += x[t * D + d];
        }
}

/* dx[t] += Σ_k dX[t, k], streams in order (the backward of expand and add). dx: [N, D]; dX: [N, n, D]. */
void cpu_streams_sum(float *dx, const float *dX, int64_t N, int64_t n, int64_t D) {
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < n; k++)
            for (int64_t d = 0; d < D; d++) dx[t * D + d] += dX[(t * n + k) * D + d];
}

void cpu_tensor_add(float *dst, const float *src, int64_t n) {
    for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}
