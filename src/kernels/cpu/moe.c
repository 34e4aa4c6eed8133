/* MoE gate and clamped SwiGLU in float (cpu_<op>, cpu.h) and double (kernels_f64.h). */
#include <tgmath.h>
#undef I /* <complex.h> via <tgmath.h>; ds4 uses I as a size name */

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define MOE_PAR_MIN ((int64_t)1 << 15) /* below this many elements, one thread */

#define KERNEL_TEMPLATE "moe.inc"
#include "twin.h"
