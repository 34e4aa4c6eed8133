/* Sparse shared-KV attention with sinks: the code is sparse_attn.inc, written over `real`;
 * compiled here in float (kernels.h names) and in double (the _f64 twins of kernels_f64.h, used by
 * the finite-difference tests). */
#include "ds4/core.h"
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"

#include <math.h>
#include <omp.h>
#include <string.h>

/* The vector helpers of the .inc pass GCC vector types by value; they are all static, so the
 * note that this ABI changes without -mavx does not apply. */
#pragma GCC diagnostic ignored "-Wpsabi"

#define KERNEL_TEMPLATE "sparse_attn.inc"
#include "twin.h"
