/* Which kernel table runs: the context's backend (cpu when it names none), or that backend's plan when
 * the context is a plan. The one place that picks; it reads only the context it is given. */
#include <stddef.h>
#include <stdio.h>
#include <string.h>

#include "ds4/kernels.h"
#include "kernels/backend.h"

const ds4_kernel_backend *ds4_exec_kernels(const ds4_exec *x) {
    const ds4_kernel_backend *b = x && x->backend ? x->backend : ds4_kernel_backend_cpu();
    return x && x->plan ? b->plan : b;
}

const char *const ds4_kernel_op_names[] = {
#define DS4_OP(name, plan, cpu, params, args) #name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) #name,
#include "kernels/ops.def"
};
const int ds4_kernel_op_count = (int)(sizeof ds4_kernel_op_names / sizeof ds4_kernel_op_names[0]);

const char *ds4_kernel_backend_missing(const ds4_kernel_backend *b) {
#define DS4_OP(name, plan, cpu, params, args) \
    if (!b->name) return #name;
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) \
    if (!b->name) return #name;
#include "kernels/ops.def"
    return NULL;
}

/* "cuda" (cuda/backend.cu) is in the programs linked with libds4cuda.a alone: a weak reference, NULL in
 * the others. */
extern const ds4_kernel_backend *ds4_kernel_backend_cuda(void) __attribute__((weak));

/* The compute backends built in, by name. */
static const ds4_kernel_backend *backend_at(int i) {
    switch (i) {
    case 0: return ds4_kernel_backend_cpu();
    case 1: return ds4_kernel_backend_guard();
    case 2: return ds4_kernel_backend_cuda ? ds4_kernel_backend_cuda() : NULL;
    default: return NULL;
    }
}

int ds4_backend_count(void) {
    int n = 0;
    while (backend_at(n)) n++;
    return n;
}

const char *ds4_backend_name(int i) {
    const ds4_kernel_backend *b = backend_at(i);
    return b ? b->name : NULL;
}

ds4_status ds4_backend_find(const char *what, const char *name, const ds4_kernel_backend **out) {
    for (int i = 0; backend_at(i); i++)
        if (name && !strcmp(backend_at(i)->name, name)) return *out = backend_at(i), DS4_OK;
    char list[256] = "";
    for (int i = 0; backend_at(i); i++)
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s", i ? ", " : "", backend_at(i)->name);
    return ds4_fail(DS4_ERR_ARG, "%s '%s': no such backend in this build (built in: %s)", what, name ? name : "",
                    list);
}
