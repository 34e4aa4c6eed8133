/* MoE gate and clamped SwiGLU in float (kernels.h) and double (kernels_f64.h). */
#include <tgmath.h>
#undef I /* <complex.h> via <tgmath.h>; ds4 uses I as a size name */

#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"

#define MOE_PAR_MIN ((int64_t)1 << 15) /* below this many elements, one thread */

#define real float
#define KFN(n) n
#include "moe.inc"
#undef real
#undef KFN

#define real double
#define KFN(n) n##_f64
#include "moe.inc"
#undef real
#undef KFN
