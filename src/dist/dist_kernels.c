/* The rank-ordered sums and EP's row permutes (dist_kernels.h). */
#include "dist/dist_kernels.h"

#include <stdbool.h>
#include <stddef.h>
#include <string.h>

void rank_sum_f64(double *x, const double *all, int n, int64_t len) {
    for (int64_t i = 0; i < len; i++) {
        double s = 0;
        for (int r = 0; r < n; r++) s += all[(int64_t)r * len + i];
        x[i] = s;
    }
}

void rank_sum_i64(int64_t *x, const int64_t *all, int n, int64_t len) {
    for (int64_t i = 0; i < len; i++) {
        int64_t s = 0;
        for (int r = 0; r < n; r++) s += all[(int64_t)r * len + i];
        x[i] = s;
    }
}

/* Block (source s, expert i) of cnt rows sits at `wire` rows in the wire layout and at the expert-major
 * offset: the rows of experts 0 .. i-1 from every source, then expert i's rows from sources 0 .. s-1. */
static void ep_rows_permute(const int64_t *recv_cnt, int n, int64_t L, const float *src, float *dst, int64_t width,
                            bool to_experts) {
    int64_t wire = 0;
    for (int s = 0; s < n; s++)
        for (int64_t i = 0; i < L; i++) {
            int64_t cnt = recv_cnt[i * n + s], exp_off = 0;
            for (int64_t j = 0; j < i; j++)
                for (int q = 0; q < n; q++) exp_off += recv_cnt[j * n + q];
            for (int q = 0; q < s; q++) exp_off += recv_cnt[i * n + q];
            size_t bytes = (size_t)(cnt * width) * sizeof(float);
            if (to_experts) memcpy(dst + exp_off * width, src + wire * width, bytes);
            else memcpy(dst + wire * width, src + exp_off * width, bytes);
            wire += cnt;
        }
}

void ep_rows_wire_to_experts(const int64_t *recv_cnt, int n, int64_t L, const float *wire, float *experts,
                             int64_t width) {
    ep_rows_permute(recv_cnt, n, L, wire, experts, width, true);
}

void ep_rows_experts_to_wire(const int64_t *recv_cnt, int n, int64_t L, const float *experts, float *wire,
                             int64_t width) {
    ep_rows_permute(recv_cnt, n, L, experts, wire, width, false);
}
