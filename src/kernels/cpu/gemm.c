/* The portable reference GEMMs in float (cpu_gemm_*_ref, cpu.h) and double (gemm_*_ref_f64, kernels_f64.h). */
#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define GEMM_REF_PAR_MIN ((int64_t)1 << 18) /* below this many multiply-adds, one thread */
#define GEMM_REF_COLS 64                     /* columns accumulated together in nn / tn */

#define KERNEL_TEMPLATE "gemm.inc"
#include "twin.h"
