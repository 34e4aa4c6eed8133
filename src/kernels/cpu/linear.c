/* Linear layers: float on the fast gemms (kernels.h), double on the reference gemms (kernels_f64.h). */
#include "kernels/kernels.h"
#include "kernels/kernels_f64.h"

#define KERNEL_TEMPLATE "linear.inc"
#include "twin.h"
