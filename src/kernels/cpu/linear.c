/* Linear layers: float on the cpu backend's GEMM (cpu.h), double on the reference gemms (kernels_f64.h),
 * and a third time in float on the plan GEMMs: the plan backend's linear layers count the same packing
 * buffers as the real ones, by construction. */
#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define KERNEL_TEMPLATE "linear.inc"
#include "twin.h"

#define real float
#define KFN(n) cpu_##n##_plan
#define KGEMM(op) cpu_gemm_##op##_plan
#include "linear.inc"
#undef real
#undef KFN
#undef KGEMM
