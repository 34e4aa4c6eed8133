/* Sparse shared-KV attention with sinks: the code is sparse_attn.inc, written over `real`;
 * compiled here in float (cpu_<op>, cpu.h) and in double (the _f64 twins of kernels_f64.h, used by
 * the finite-difference tests). */
#include "ds4/core.h"
#include "kernels/cpu/cpu.h"
#include "kernels/cpu/vmath.h"
#include "kernels/kernels_f64.h"

#include <math.h>
#include <omp.h>
#include <string.h>

/* The vector helpers of the .inc pass GCC vector types by value; they are all static, so the
 * note that this ABI changes without -mavx does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define KERNEL_TEMPLATE "sparse_attn.inc"
#include "twin.h"

/* The plan backend's attention: the workspace of the float kernels, allocated and freed, nothing else. */
void cpu_sparse_attn_fwd_plan(const sparse_attn_args *a) {
    sa_layout L;
    ds4_free(cpu_sa_workspace(a, true, false, false, &L));
}

void cpu_sparse_attn_bwd_plan(const sparse_attn_args *a, const sparse_attn_grads *g) {
    int64_t ratio;
    float *dkvc;
    bool want_key;
    if (!cpu_sa_bwd_wants(a, g, &ratio, &dkvc, &want_key)) return;
    sa_layout L;
    ds4_free(cpu_sa_workspace(a, true, true, want_key, &L));
}
