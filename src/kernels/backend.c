/* Which kernel table runs: the context's backend (cpu when it names none), or that backend's plan when
 * the context is a plan. The one place that picks; it reads only the context it is given. */
#include <dlfcn.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "ds4/kernels.h"
#include "kernels/backend.h"

const ds4_kernel_backend *ds4_exec_kernels(const ds4_exec *x) {
    const ds4_kernel_backend *b = x && x->backend ? x->backend : ds4_kernel_backend_cpu();
    return x && x->plan ? b->plan : b;
}

bool ds4_exec_host_memory(const ds4_exec *x) {
    return (x && x->backend ? x->backend : ds4_kernel_backend_cpu())->host_memory;
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

/* "cuda" (cuda/backend.cu): linked in (the CUDA tests and benches link libds4cuda.a: a weak reference
 * finds it), or the plugin libds4cuda.so beside the program (mk/cuda.mk) or in its parent folder (the
 * benches in build/bench/ find build/libds4cuda.so), opened the first time a backend past the built-in ones
 * is asked for, so a run on the cpu never loads a CUDA library. */
extern const ds4_kernel_backend *ds4_kernel_backend_cuda(void) __attribute__((weak));

typedef const ds4_kernel_backend *(*backend_entry)(void);
static backend_entry g_cuda_entry; /* the plugin's entry, once opened (a process has one loaded library) */
static bool g_cuda_tried;
static char g_cuda_why[512];       /* why there is none, for ds4 info and errors */

static backend_entry cuda_plugin(void) {
    if (g_cuda_tried) return g_cuda_entry;
    g_cuda_tried = true;
    char path[4096];
    ssize_t n = readlink("/proc/self/exe", path, sizeof path - 32);
    if (n <= 0) {
        snprintf(g_cuda_why, sizeof g_cuda_why, "cannot find the program's folder");
        return NULL;
    }
    path[n] = 0;
    char *slash = strrchr(path, '/');
    snprintf(slash ? slash + 1 : path, 32, "libds4cuda.so");
    if (access(path, F_OK) != 0 && slash) { /* the parent folder: .../build/bench/PROGRAM -> .../build/ */
        *slash = 0;
        char *up = strrchr(path, '/');
        if (up) snprintf(up + 1, 32, "libds4cuda.so");
        else *slash = '/';
    }
    if (access(path, F_OK) != 0) {
        snprintf(g_cuda_why, sizeof g_cuda_why, "this ds4 was built without the CUDA backend (no %.400s)", path);
        return NULL;
    }
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h) *(void **)&g_cuda_entry = dlsym(h, "ds4_kernel_backend_cuda");
    if (!g_cuda_entry) snprintf(g_cuda_why, sizeof g_cuda_why, "%.200s: %.300s", path, dlerror());
    return g_cuda_entry;
}

static const ds4_kernel_backend *cuda_backend(void) {
    if (ds4_kernel_backend_cuda) return ds4_kernel_backend_cuda();
    backend_entry e = cuda_plugin();
    return e ? e() : NULL;
}

/* The compute backends built in, by name. */
static const ds4_kernel_backend *backend_at(int i) {
    switch (i) {
    case 0: return ds4_kernel_backend_cpu();
    case 1: return ds4_kernel_backend_guard();
    case 2: return cuda_backend();
    default: return NULL;
    }
}

ds4_status ds4_backend_ready(const char *what, const ds4_kernel_backend *b) {
    ds4_status st = b && b->ready ? b->ready() : DS4_OK;
    return st == DS4_OK ? DS4_OK : ds4_fail_prefix(st, "%s '%s'", what, b->name);
}

int ds4_backend_count(void) {
    int n = 0;
    while (backend_at(n)) n++;
    return n;
}

void ds4_backend_describe(int i, char *buf, size_t cap) {
    const ds4_kernel_backend *b = backend_at(i);
    if (cap) buf[0] = 0;
    if (!b || !cap) return;
    if (b->ready && b->ready() != DS4_OK) snprintf(buf, cap, "not usable here: %s\n", ds4_errmsg());
    else if (b->describe) b->describe(buf, cap);
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
    if (name && !strcmp(name, "cuda") && g_cuda_why[0])
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s 'cuda': %s (built in: %s)", what, g_cuda_why, list);
    return ds4_fail(DS4_ERR_ARG, "%s '%s': no such backend in this build (built in: %s)", what, name ? name : "",
                    list);
}
