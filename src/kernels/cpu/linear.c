/* Linear layers: float on the cpu backend's GEMM (cpu.h), double on the reference gemms (kernels_f64.h),
 * and a third time in float on the plan GEMMs: the plan backend's linear layers count the same packing
 * buffers as the real ones, by construction. The layers on a weight's bf16 compute copy
 * (linear_bf16w.inc) have no double twin: the twins and oracles stay fp32. */
#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define KERNEL_TEMPLATE "linear.inc"
#include "twin.h"

#define real float
#define KFN(n) cpu_##n##_plan
#define KGEMM(op) cpu_gemm_##op##_plan
#define KPREC_PARAM ds4_matmul_precision prec,
#define KPREC_ARG prec,
#include "linear.inc"
#undef real
#undef KPREC_PARAM
#undef KPREC_ARG

#define KGEMM_HB(op, ...) cpu_gemm_##op##_hb_plan(__VA_ARGS__)
#include "linear_bf16w.inc"
#undef KFN
#undef KGEMM
#undef KGEMM_HB

#define KFN(n) cpu_##n
#define KGEMM(op) cpu_gemm_##op
#define KGEMM_HB(op, ...) cpu_gemm_##op##_hb(__VA_ARGS__)
#include "linear_bf16w.inc"
#undef KFN
#undef KGEMM
#undef KGEMM_HB
