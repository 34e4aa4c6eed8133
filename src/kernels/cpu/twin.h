/* Compiles the kernel template KERNEL_TEMPLATE (a .inc written with the type `real`, the name macros
 * KFN (functions) and KTYPE (descriptor types) and the math macros below) twice: in float as the cpu
 * backend's entry points (cpu_<op>, cpu.h; descriptors of kernels.h), and in double under the `_f64`
 * names of kernels_f64.h that the finite-difference tests differentiate. Include it last. */
#ifndef KERNEL_TEMPLATE
#error "define KERNEL_TEMPLATE before including twin.h"
#endif

#define real float
#define REAL_IS_F32 1
#define KFN(n) cpu_##n
#define KTYPE(n) n
#define KGEMM(op) cpu_gemm_##op
#define KPREC_PARAM ds4_matmul_precision prec,
#define KPREC_ARG prec,
#define EXP expf
#define LOG logf
#define SQRT sqrtf
#include KERNEL_TEMPLATE
#undef real
#undef REAL_IS_F32
#undef KFN
#undef KTYPE
#undef KGEMM
#undef KPREC_PARAM
#undef KPREC_ARG
#undef EXP
#undef LOG
#undef SQRT

#define real double
#define REAL_IS_F32 0
#define KFN(n) n##_f64
#define KTYPE(n) n##_f64
#define KGEMM(op) gemm_##op##_ref_f64
#define KPREC_PARAM
#define KPREC_ARG
#define EXP exp
#define LOG log
#define SQRT sqrt
#include KERNEL_TEMPLATE
#undef real
#undef REAL_IS_F32
#undef KFN
#undef KTYPE
#undef KGEMM
#undef EXP
#undef LOG
#undef SQRT
#undef KPREC_PARAM
#undef KPREC_ARG
