/* MoE routing as data ops (cpu_<op>, cpu.h; semantics: kernels.h): grouping the router's assignments by
 * expert and moving rows between token order and expert order. Plain loops in a fixed order, so every
 * element is written or accumulated exactly as the MoE unit's own loops did. */
#include <string.h>

#include "kernels/cpu/cpu.h"

void cpu_moe_balanced_table(int64_t *table, int32_t *ids, int64_t N, int64_t K, int64_t E) {
    for (int64_t j = 0; j < N * K; j++) table[j] = j % E;
    for (int64_t t = 0; t < N; t++) ids[t] = (int32_t)t;
}

/* A counting sort: eoff[e] is first advanced through expert e's assignments as their write position,
 * which leaves it at the start of expert e + 1, then shifted back by one expert. */
void cpu_moe_group_by_expert(int64_t *eoff, int32_t *etok, int32_t *eslot, const int32_t *idx, int64_t N, int64_t E,
                             int64_t K) {
    memset(eoff, 0, (size_t)(E + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < N * K; i++) eoff[idx[i] + 1]++;
    for (int64_t e = 0; e < E; e++) eoff[e + 1] += eoff[e];
    for (int64_t t = 0; t < N; t++)
        for (int64_t k = 0; k < K; k++) {
            int64_t j = eoff[idx[t * K + k]]++;
            etok[j] = (int32_t)t;
            eslot[j] = (int32_t)k;
        }
    for (int64_t e = E - 1; e > 0; e--) eoff[e] = eoff[e - 1];
    eoff[0] = 0;
}

void cpu_moe_expert_counts(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK) {
    (void)NK;
    for (int64_t e = 0; e < E; e++) cnt[e] = eoff[e + 1] - eoff[e];
}

/* The plan backend's entry: the counts of balanced routing, slot j to expert j mod E. */
void cpu_moe_expert_counts_plan(int64_t *cnt, const int64_t *eoff, int64_t E, int64_t NK) {
    (void)eoff;
    for (int64_t e = 0; e < E; e++) cnt[e] = NK / E + (e < NK % E);
}

void cpu_moe_expert_load(int64_t *load, const int64_t *eoff, int64_t E) {
    for (int64_t e = 0; e < E; e++) load[e] += eoff[e + 1] - eoff[e];
}

void cpu_moe_assignment_weights(float *wj, const float *w, const int32_t *etok, const int32_t *eslot, int64_t NK,
                                int64_t K) {
    for (int64_t j = 0; j < NK; j++) wj[j] = w[(int64_t)etok[j] * K + eslot[j]];
}

void cpu_moe_weight_grads_add(float *dgw, const float *dw, const int32_t *etok, const int32_t *eslot, int64_t NK,
                              int64_t K) {
    for (int64_t j = 0; j < NK; j++) dgw[(int64_t)etok[j] * K + eslot[j]] += dw[j];
}

#define ROWS_PAR_MIN 65536 /* elements below which one thread beats starting a team */

void cpu_rows_gather(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
#pragma omp parallel for schedule(static) if (n * D > ROWS_PAR_MIN)
    for (int64_t i = 0; i < n; i++) memcpy(dst + i * D, src + (int64_t)rows[i] * D, (size_t)D * sizeof(float));
}

void cpu_rows_scatter_add(float *dst, const float *src, const int32_t *rows, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        float *d = dst + (int64_t)rows[i] * D;
        for (int64_t k = 0; k < D; k++) d[k] += src[i * D + k];
    }
}

void cpu_rows_pack(float *dst, const float *x, const int32_t *rows, const float *w, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(dst + i * (D + 1), x + (rows ? (int64_t)rows[i] : i) * D, (size_t)D * sizeof(float));
        dst[i * (D + 1) + D] = w[i];
    }
}

void cpu_rows_unpack(float *x, float *w, const float *src, int64_t n, int64_t D) {
    for (int64_t i = 0; i < n; i++) {
        memcpy(x + i * D, src + i * (D + 1), (size_t)D * sizeof(float));
        w[i] = src[i * (D + 1) + D];
    }
}

void cpu_moe_unpack_grads_add(float *dx, float *dgw, const float *src, const int32_t *etok, const int32_t *eslot,
                              int64_t NK, int64_t D, int64_t K) {
    for (int64_t j = 0; j < NK; j++) {
        float *d = dx + (int64_t)etok[j] * D;
        const float *s = src + j * (D + 1);
        for (int64_t k = 0; k < D; k++) d[k] += s[k];
        dgw[(int64_t)etok[j] * K + eslot[j]] += s[D];
    }
}
