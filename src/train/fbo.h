/* Two passes on one thread, taking turns (MoE forward-backward overlap, --moe-fb-overlap; fbo.c).
 *
 * fbo_pair runs a(actx) on a stack of its own and b(bctx) on the caller's, a first. Each gives way to
 * the other only at fbo_yield, which the EP all-to-alls call between their start and their wait (and,
 * without EP, the step's hooks after each gather): while one pass's rows travel the other computes.
 * Everything stays on the calling thread (MPI is FUNNELED), the switch points are the same on every rank
 * and every run, so the collectives are issued in the same order everywhere and the interleaving is
 * deterministic. A pass that has returned never runs again; the other then runs alone to its end. */
#ifndef DS4_TRAIN_FBO_H
#define DS4_TRAIN_FBO_H

#include "ds4/core.h"

typedef struct fbo fbo;
typedef ds4_status (*fbo_fn)(void *ctx);

/* A scheduler with its coroutine stack (virtual memory, committed as it is used; not counted by the
 * allocator: it is the thread's stack, not ds4's data). NULL on failure. */
fbo *fbo_new(void);
void fbo_free(fbo *f);
/* Runs a and b to their ends, interleaved at fbo_yield; *sa, *sb: their statuses. */
void fbo_pair(fbo *f, fbo_fn a, void *actx, fbo_fn b, void *bctx, ds4_status *sa, ds4_status *sb);
/* The running pass gives way to the other (nothing outside fbo_pair or once the other has returned).
 * ctx: the fbo. */
void fbo_yield(void *ctx);

#endif
