/* Embedding in float (cpu_<op>, cpu.h) and double (kernels_f64.h). */
#include <string.h>

#include "kernels/cpu/cpu.h"
#include "kernels/kernels_f64.h"

#define EMBED_PAR_MIN ((int64_t)1 << 15) /* below this many elements, one thread */
#define EMBED_COLS 64                    /* columns per thread block in backward */

#define KERNEL_TEMPLATE "embed.inc"
#include "twin.h"
