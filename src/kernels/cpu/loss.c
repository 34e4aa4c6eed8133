/* Cross-entropy in float (cpu_<op>, cpu.h) and double (kernels_f64.h). */
#include <string.h>
#include <tgmath.h>
#undef I /* <complex.h> via <tgmath.h>; ds4 uses I as a size name */

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define CE_PAR_MIN ((int64_t)1 << 15) /* below this many logits, one thread */
#define CE_CHUNKS 64                  /* fixed row ranges: partial sums independent of threads */

#define KERNEL_TEMPLATE "loss.inc"
#include "twin.h"
