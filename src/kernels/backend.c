/* Which kernel backend runs: the plan backend while the allocator serves a plan (its workspace mirrors
 * must allocate in that context), else the compute backend. The one place that picks. */
#include <stddef.h>

#include "kernels/backend.h"

const ds4_kernel_backend *ds4_kernels(void) {
    return ds4_exec_current().plan ? ds4_kernel_backend_plan() : ds4_kernel_backend_cpu();
}

const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b) {
#define DS4_KERNEL_ENTRY_PRESENT(e) \
    if (!b->e) return #e;
    DS4_KERNEL_ENTRIES(DS4_KERNEL_ENTRY_PRESENT)
#undef DS4_KERNEL_ENTRY_PRESENT
    return NULL;
}
