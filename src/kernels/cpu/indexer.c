/* Lightning indexer top-k and indexer KL loss: the code is indexer.inc, written over `real`;
 * compiled here in float (cpu_<op>, cpu.h) and in double (the _f64 twins of kernels_f64.h, used by
 * the finite-difference tests). */
#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/vmath.h"
#include "kernels/kernels_f64.h"

#include <math.h>
#include <omp.h>
#include <string.h>

/* vmath.h passes GCC vector types by value; its functions are all static inline, so the note that this
 * ABI changes without -mavx does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define KERNEL_TEMPLATE "indexer.inc"
#include "twin.h"

/* The plan backend's indexer: the workspace of the float kernels, allocated and freed, and the outputs
 * the KL loss writes before it computes (0 rows, loss 0); no tensor data. */
void cpu_indexer_topk_fwd_plan(const indexer_topk_args *a) {
    if (a->dims.K <= 0) return;
    int64_t nmax;
    size_t per;
    int P;
    ds4_free(cpu_ix_topk_workspace(&a->dims, true, a->t0, &nmax, &per, &P));
}

void cpu_indexer_kl_fwd_bwd_plan(const indexer_kl_args *a) {
    *a->kl_sum = 0;
    *a->n_rows = 0;
    int64_t nmax = cpu_ix_kl_set_max(a);
    if (nmax == 0) return;
    ix_kl_layout L;
    ds4_free(cpu_ix_kl_workspace(a, true, nmax, &L));
}

int64_t cpu_indexer_kl_rows(int64_t B, int64_t T, int64_t ratio) { return T >= ratio ? B * (T - ratio + 1) : 0; }
