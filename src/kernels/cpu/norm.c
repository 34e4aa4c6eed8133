/* RMSNorm in float (cpu_<op>, cpu.h) and double (kernels_f64.h). */
#include <math.h>

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define NORM_PAR_MIN ((int64_t)1 << 15) /* below this many elements, one thread */
#define NORM_COLS 128                   /* columns per thread block in the dw reduction */

#define KERNEL_TEMPLATE "norm.inc"
#include "twin.h"
