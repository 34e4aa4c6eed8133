/* The "cpu-guard" backend: the cpu backend's arithmetic, with its buffers kept where the host cannot
 * reach them outside a backend call, as a device's memory is. Every buffer it gives out (buf_alloc) is a
 * mapping of its own, PROT_NONE except while one of its entries runs: each entry opens every live buffer
 * (read + write), runs the cpu entry of the same name and closes them again. Code above the kernels that
 * reads or writes a device buffer itself, instead of through an op or a copy, faults there; the fault
 * handler names the buffer (category, size, offset of the access) and prints the call stack before the
 * process dies, so the test that ran it names the place. Its plan twin is the cpu's: the same workspace,
 * and its buffers are counted as the cpu's are.
 *
 * Test backend only: slow (two mprotect calls per live buffer per op) and single-threaded above the
 * kernels (ops are called from one thread; the kernels' own OpenMP threads run inside an open call). */
#include <execinfo.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "kernels/cpu/cpu.h"

/* One live buffer: its mapping [base, base + span) of which the caller asked for `bytes`; or a mapped
 * piece of a reserved range (range_map), guarded the same way. */
typedef struct {
    char *base;
    size_t span, bytes;
    ds4_mem_cat cat;
    bool piece;
} guard_buf;

static guard_buf *g_bufs;     /* [g_cap] live buffers, g_n of them */
static int64_t g_n, g_cap;
static int g_open;            /* depth of entries running: buffers are readable while > 0 */

static size_t page_round(size_t n) {
    const size_t pg = (size_t)sysconf(_SC_PAGESIZE);
    return (n + pg - 1) / pg * pg;
}

static void protect_all(int prot) {
    for (int64_t i = 0; i < g_n; i++) mprotect(g_bufs[i].base, g_bufs[i].span, prot);
}

static void guard_open(void) {
    if (g_open++ == 0) protect_all(PROT_READ | PROT_WRITE);
}

static void guard_close(void) {
    if (--g_open == 0) protect_all(PROT_NONE);
}

/* ------------------------------------------------------------------ the fault that names the place */
static struct sigaction g_prev_segv;

static void on_fault(int sig, siginfo_t *si, void *uctx) {
    const char *addr = si->si_addr;
    (void)sig, (void)uctx;
    for (int64_t i = 0; i < g_n; i++) {
        const guard_buf *b = &g_bufs[i];
        if (addr < b->base || addr >= b->base + b->span) continue;
        char msg[256];
        int n = snprintf(msg, sizeof msg,
                         "ds4 cpu-guard: the host touched device memory outside a backend op or copy: byte %zu of a "
                         "%zu-byte %s %s; the call stack (addr2line -f -e PROGRAM +OFFSET names a frame):\n",
                         (size_t)(addr - b->base), b->bytes, ds4_mem_cat_name(b->cat),
                         b->piece ? "range (a mapped piece)" : "buffer");
        if (write(2, msg, (size_t)n) >= 0) {
            void *frames[48];
            backtrace_symbols_fd(frames, backtrace(frames, 48), 2);
        }
        signal(SIGSEGV, SIG_DFL); /* the access faults again and the process dies of it, whatever else is installed */
        return;
    }
    sigaction(SIGSEGV, &g_prev_segv, NULL); /* not ours: the fault goes to the handler that was there before */
}

static void install_fault_handler(void) {
    static bool installed;
    if (installed) return;
    installed = true;
    struct sigaction sa = {.sa_sigaction = on_fault, .sa_flags = SA_SIGINFO};
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
}

/* ------------------------------------------------------------------ memory */
static void *guard_buf_alloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes) {
    (void)ex;
    install_fault_handler();
    if (!ds4_grow((void **)&g_bufs, &g_cap, g_n + 1, sizeof *g_bufs)) return NULL;
    const size_t span = page_round(bytes ? bytes : 1);
    void *p = mmap(NULL, span, g_open ? PROT_READ | PROT_WRITE : PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) {
        ds4_fail(DS4_ERR_OOM, "cpu-guard: out of memory allocating %zu bytes of %s", bytes, ds4_mem_cat_name(cat));
        return NULL;
    }
    g_bufs[g_n++] = (guard_buf){.base = p, .span = span, .bytes = bytes, .cat = cat};
    ds4_mem_track(cat, (int64_t)bytes);
    return p;
}

static void guard_buf_free(const ds4_exec *ex, void *p) {
    (void)ex;
    if (!p) return;
    for (int64_t i = 0; i < g_n; i++) {
        if (g_bufs[i].base != p || g_bufs[i].piece) continue;
        ds4_mem_track(g_bufs[i].cat, -(int64_t)g_bufs[i].bytes);
        munmap(g_bufs[i].base, g_bufs[i].span);
        g_bufs[i] = g_bufs[--g_n];
        return;
    }
    abort(); /* not one of its buffers (ds4_free's or a double free): an internal bug, not input */
}

/* Reserved ranges: the cpu's (address space, pages made resident per piece); each mapped piece is guarded
 * like a buffer while it lives. */
static void *guard_range_reserve(const ds4_exec *ex, size_t bytes) {
    (void)ex;
    install_fault_handler();
    return cpu_range_reserve(bytes);
}

static bool guard_range_map(const ds4_exec *ex, void *p, size_t bytes, ds4_mem_cat cat) {
    (void)ex;
    if (!ds4_grow((void **)&g_bufs, &g_cap, g_n + 1, sizeof *g_bufs) || !cpu_range_map(p, bytes, cat)) return false;
    const size_t span = page_round(bytes ? bytes : 1);
    if (!g_open) mprotect(p, span, PROT_NONE);
    g_bufs[g_n++] = (guard_buf){.base = p, .span = span, .bytes = bytes, .cat = cat, .piece = true};
    return true;
}

static void guard_range_unmap(const ds4_exec *ex, void *p, size_t bytes, ds4_mem_cat cat) {
    (void)ex;
    for (int64_t i = 0; i < g_n; i++)
        if (g_bufs[i].base == p && g_bufs[i].piece) {
            g_bufs[i] = g_bufs[--g_n];
            break;
        }
    cpu_range_unmap(p, bytes, cat);
}

static void guard_range_release(const ds4_exec *ex, void *p, size_t bytes) {
    (void)ex;
    for (int64_t i = 0; i < g_n; i++) /* pieces still mapped go with it */
        if (g_bufs[i].piece && g_bufs[i].base >= (char *)p && g_bufs[i].base < (char *)p + bytes) g_bufs[i--] = g_bufs[--g_n];
    cpu_range_release(p, bytes);
}

/* ------------------------------------------------------------------ every other entry: open, the cpu's, close */
#define DS4_OP(name, plan, cpu, params, args)                                                             \
    static void guard_entry_##name params {                                                               \
        guard_open();                                                                                     \
        ds4_kernel_backend_cpu()->name args;                                                              \
        guard_close();                                                                                    \
    }
#define DS4_QUERY(name, plan, cpu, type, absent, params, args)                                            \
    static type guard_entry_##name params {                                                               \
        guard_open();                                                                                     \
        type r = ds4_kernel_backend_cpu()->name args;                                               \
        guard_close();                                                                                    \
        return r;                                                                                         \
    }
#include "kernels/ops.def"

static const ds4_kernel_backend k_guard_ops = {
    .name = "cpu-guard",
    .plan = &ds4_kernel_backend_plan_table,
#define DS4_OP(name, plan, cpu, params, args) .name = guard_entry_##name,
#define DS4_QUERY(name, plan, cpu, type, absent, params, args) .name = guard_entry_##name,
#include "kernels/ops.def"
};

/* The table: every entry the guarded cpu one, the buffers its own. */
static ds4_kernel_backend g_table;
static pthread_once_t g_table_once = PTHREAD_ONCE_INIT;
static void make_table(void) {
    g_table = k_guard_ops;
    g_table.buf_alloc = guard_buf_alloc;
    g_table.buf_free = guard_buf_free;
    g_table.range_reserve = guard_range_reserve;
    g_table.range_release = guard_range_release;
    g_table.range_map = guard_range_map;
    g_table.range_unmap = guard_range_unmap;
}

const ds4_kernel_backend *ds4_kernel_backend_guard(void) {
    pthread_once(&g_table_once, make_table);
    return &g_table;
}
