/* Two passes on one thread, taking turns at fbo_yield (fbo.h): a runs as a coroutine (ucontext) on a
 * stack of its own, b on the caller's. Under AddressSanitizer each switch is announced so it follows
 * the stacks. */
#include "fbo.h"

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define FIBER_START(save, bottom, size) __sanitizer_start_switch_fiber(save, bottom, size)
#define FIBER_FINISH(save, bottom, size) __sanitizer_finish_switch_fiber(save, bottom, size)
#else
#define FIBER_START(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#define FIBER_FINISH(save, bottom, size) ((void)(save), (void)(bottom), (void)(size))
#endif

#define FBO_STACK_BYTES ((size_t)256 << 20) /* reserved, committed page by page as the pass uses it */

struct fbo {
    ucontext_t caller, coro; /* b's (the caller's) and a's contexts while the other runs */
    void *stack;             /* a's stack: [FBO_STACK_BYTES], the lowest page a guard */
    fbo_fn fn;               /* a */
    void *ctx;
    ds4_status st;           /* a's status once it has returned */
    bool active, in_coro, done;
    const void *caller_bottom; /* AddressSanitizer: the caller's stack */
    size_t caller_size;
};

fbo *fbo_new(void) {
    fbo *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->stack = mmap(NULL, FBO_STACK_BYTES, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (f->stack == MAP_FAILED) {
        free(f);
        return NULL;
    }
    mprotect(f->stack, 4096, PROT_NONE); /* an overflow faults instead of writing below the stack */
    return f;
}

void fbo_free(fbo *f) {
    if (!f) return;
    munmap(f->stack, FBO_STACK_BYTES);
    free(f);
}

/* a's entry; its pointer arrives as two ints (makecontext passes int arguments). */
static void coro_main(unsigned hi, unsigned lo) {
    fbo *f = (fbo *)(uintptr_t)(((uint64_t)hi << 32) | lo);
    FIBER_FINISH(NULL, &f->caller_bottom, &f->caller_size);
    f->st = f->fn(f->ctx);
    f->done = true;
    f->in_coro = false;
    FIBER_START(NULL, f->caller_bottom, f->caller_size); /* this stack is finished with */
    /* returns to uc_link: the caller where it last gave way */
}

/* The caller gives way to a (the first time: a starts). */
static void to_coro(fbo *f) {
    void *save = NULL;
    f->in_coro = true;
    FIBER_START(&save, f->stack, FBO_STACK_BYTES);
    swapcontext(&f->caller, &f->coro);
    FIBER_FINISH(save, NULL, NULL);
}

void fbo_yield(void *ctx) {
    fbo *f = ctx;
    if (!f || !f->active || f->done) return;
    if (!f->in_coro) {
        to_coro(f);
        return;
    }
    void *save = NULL;
    f->in_coro = false;
    FIBER_START(&save, f->caller_bottom, f->caller_size);
    swapcontext(&f->coro, &f->caller);
    FIBER_FINISH(save, &f->caller_bottom, &f->caller_size);
}

void fbo_pair(fbo *f, fbo_fn a, void *actx, fbo_fn b, void *bctx, ds4_status *sa, ds4_status *sb) {
    getcontext(&f->coro);
    f->coro.uc_stack.ss_sp = f->stack;
    f->coro.uc_stack.ss_size = FBO_STACK_BYTES;
    f->coro.uc_link = &f->caller;
    const uint64_t p = (uint64_t)(uintptr_t)f;
    makecontext(&f->coro, (void (*)(void))coro_main, 2, (unsigned)(p >> 32), (unsigned)(p & 0xffffffffu));
    f->fn = a;
    f->ctx = actx;
    f->st = DS4_OK;
    f->done = false;
    f->active = true;
    to_coro(f);                      /* a runs first, up to its first yield */
    *sb = b(bctx);                   /* b, giving way to a at each of its yields */
    while (!f->done) to_coro(f);     /* a alone to its end */
    f->active = false;
    *sa = f->st;
}
