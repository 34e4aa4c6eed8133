/* Which kernel backend runs: the one place that looks at the shape-only (plan) mode. */
#include <stddef.h>

#include "kernels/backend.h"

const ds4_kernel_backend *ds4_kernels(void) {
    return ds4_shape_only() ? ds4_kernel_backend_plan() : ds4_kernel_backend_cpu();
}

const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b) {
#define DS4_KERNEL_ENTRY_PRESENT(e) \
    if (!b->e) return #e;
    DS4_KERNEL_ENTRIES(DS4_KERNEL_ENTRY_PRESENT)
#undef DS4_KERNEL_ENTRY_PRESENT
    return NULL;
}
