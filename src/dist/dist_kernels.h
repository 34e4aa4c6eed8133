/* The dist layer's own arithmetic and row moves, in kernel shape (plain pointers, explicit sizes), in one
 * place (private to src/dist): the rank-ordered sums that make FSDP's reduce-scatter and the
 * communicators' sums the same bits whatever the transport does, and EP's row permutes between the
 * wire layout and the experts' layout. Nothing else in src/dist adds or moves tensor elements of a
 * collective, so these are what a device backend takes over (its table, issue 22). */
#ifndef DS4_DIST_KERNELS_H
#define DS4_DIST_KERNELS_H

#include <stdint.h>

/* x [len] := Σ_r all [n][len], from zero, in rank order: ds4_comm_sum_f64 / _i64 after the gather. */
void rank_sum_f64(double *x, const double *all, int n, int64_t len);
void rank_sum_i64(int64_t *x, const int64_t *all, int n, int64_t len);

/* EP's row permutes on this rank's L experts and n sources. recv_cnt [L][n]: the rows source s sends
 * expert i. wire [rows][width]: as the all-to-all delivers them, by source, each source's rows expert by
 * expert. experts [rows][width]: expert-major, each expert's rows source by source (what the experts
 * run on). rows = Σ recv_cnt. */
void ep_rows_wire_to_experts(const int64_t *recv_cnt, int n, int64_t L, const float *wire, float *experts,
                             int64_t width);
void ep_rows_experts_to_wire(const int64_t *recv_cnt, int n, int64_t L, const float *experts, float *wire,
                             int64_t width);

#endif
