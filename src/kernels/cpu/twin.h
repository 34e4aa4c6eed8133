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
/* the fp32 GEMMs on the calling thread with the buffer ws (cpu_gemm_serial_*), and that buffer's bound */
#define KGEMM_SERIAL(op, ws, ...) cpu_gemm_serial_##op(DS4_MATMUL_FP32, ws, __VA_ARGS__)
#define KGEMM_SERIAL_BYTES(M, N, K) cpu_gemm_serial_bytes(M, N, K)
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
#undef KGEMM_SERIAL
#undef KGEMM_SERIAL_BYTES
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
#define KGEMM_SERIAL(op, ws, ...) ((void)(ws), gemm_##op##_ref_f64(__VA_ARGS__))
#define KGEMM_SERIAL_BYTES(M, N, K) ((void)(M), (void)(N), (void)(K), (size_t)0)
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
#undef KGEMM_SERIAL
#undef KGEMM_SERIAL_BYTES
#undef EXP
#undef LOG
#undef SQRT
#undef KPREC_PARAM
#undef KPREC_ARG
