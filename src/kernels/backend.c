/* Which kernel table runs: the context's backend (cpu when it names none), or that backend's plan when
 * the context is a plan. The one place that picks; it reads only the context it is given. */
#include <stddef.h>
#include <string.h>

#include "kernels/backend.h"

const ds4_kernel_backend *ds4_exec_kernels(const ds4_exec *x) {
    const ds4_kernel_backend *b = x && x->backend ? x->backend : ds4_kernel_backend_cpu();
    return x && x->plan ? b->plan : b;
}

const char *const ds4_kernel_op_names[] = {
#define DS4_OP(name, plan, params, args) #name,
#define DS4_QUERY(name, plan, type, absent, params, args) #name,
#include "kernels/ops.def"
};
const int ds4_kernel_op_count = (int)(sizeof ds4_kernel_op_names / sizeof ds4_kernel_op_names[0]);

const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b) {
#define DS4_OP(name, plan, params, args) \
    if (!b->name) return #name;
#define DS4_QUERY(name, plan, type, absent, params, args) \
    if (!b->name) return #name;
#include "kernels/ops.def"
    return NULL;
}
