/* Linear layers: float on the fast gemms (kernels.h), double on the reference gemms (kernels_f64.h). */
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"

#define real float
#define KFN(n) n
#define KGEMM(op) gemm_##op
#include "linear.inc"
#undef real
#undef KFN
#undef KGEMM

#define real double
#define KFN(n) n##_f64
#define KGEMM(op) gemm_##op##_ref_f64
#include "linear.inc"
#undef real
#undef KFN
#undef KGEMM
