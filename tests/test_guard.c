/* The "cpu-guard" backend: a device-like test backend whose buffers the host cannot reach outside its
 * ops. A model made on it runs its passes with the cpu's bits (so everything the model layer does with
 * tensor bytes goes through ops and copies), and a host read of one of its buffers kills the process with a
 * message that names the buffer and the call stack. */
#include <omp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ds4/core.h"
#include "ds4/dist.h"
#include "ds4/kernels.h"
#include "ds4/model.h"
#include "kernels/backend.h"
#include "test.h"
#include "test_store.h"

static const ds4_kernel_backend *guard_backend(void) {
    const ds4_kernel_backend *b = NULL;
    CHECK(ds4_backend_find("--device", "cpu-guard", &b) == DS4_OK, "%s", ds4_errmsg());
    return b;
}

static void test_table(void) {
    const ds4_kernel_backend *g = guard_backend();
    if (!g) return;
    CHECK(!strcmp(g->name, "cpu-guard") && ds4_kernel_backend_missing(g) == NULL, "the guard fills every entry");
    CHECK(g->plan == ds4_kernel_backend_plan(), "its plan is the cpu's (the same workspace)");
    CHECK(ds4_backend_count() == 2 && !strcmp(ds4_backend_name(1), "cpu-guard"), "ds4 info lists it");
}

/* The whole model on cpu-guard against the same model on the cpu: same losses, logits and gradients, bit
 * for bit, with and without recompute. The guard model gets the cpu model's parameters through copies. */
static void pass_equals_cpu(bool recompute) {
    const ds4_kernel_backend *gb = guard_backend();
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    const ds4_exec on_guard = {.backend = gb};
    ds4_model *mc = NULL, *mg = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &mc) == DS4_OK && ds4_model_create(&on_guard, &c, false, &mg) == DS4_OK,
          "%s", ds4_errmsg());
    if (!gb || !mc || !mg) return;
    ds4_model_init_random(mc, 11);
    const int64_t n = ds4_model_numel(mc);
    ds4_model_to_device(mg, ds4_model_params_flat(mg), ds4_model_params_flat(mc), (size_t)n * sizeof(float));
    for (int64_t i = 0; i < ds4_model_nparams(mc); i++) { /* the hash layers' tables */
        const ds4_param *pc = ds4_model_param(mc, i), *pg = ds4_model_param(mg, i);
        if (pc->is_int) ds4_model_to_device(mg, pg->idata, pc->idata, (size_t)pc->numel * sizeof(int64_t));
    }
    ds4_model_zero_grad(mc);
    ds4_model_zero_grad(mg);
    const int64_t B = 2, T = 64, V = c.vocab_size;
    int32_t ids[2 * 64];
    for (int64_t i = 0; i < B * T; i++) ids[i] = (int32_t)((i * 7 + 3) % V);
    ds4_pass_opts o = {.need_backward = true, .keep_logits = true};
    if (recompute) o.store.ops = &test_recompute_store;
    ds4_pass *pc = NULL, *pg = NULL;
    CHECK(ds4_forward(mc, ids, B, T, &o, &pc) == DS4_OK, "cpu: %s", ds4_errmsg());
    CHECK(ds4_forward(mg, ids, B, T, &o, &pg) == DS4_OK, "guard: %s", ds4_errmsg());
    if (pc && pg) { /* the logits live until the backward */
        float *logits = malloc((size_t)(B * T * V) * sizeof(float));
        ds4_model_to_host(mg, logits, ds4_pass_logits(pg), (size_t)(B * T * V) * sizeof(float));
        CHECK(!memcmp(logits, ds4_pass_logits(pc), (size_t)(B * T * V) * sizeof(float)), "recompute %d: logits",
              recompute);
        free(logits);
        CHECK(ds4_backward(mc, pc) == DS4_OK && ds4_backward(mg, pg) == DS4_OK, "%s", ds4_errmsg());
        const ds4_losses *lc = ds4_pass_losses(pc), *lg = ds4_pass_losses(pg);
        CHECK(lc->loss == lg->loss && lc->mtp_loss == lg->mtp_loss && lc->indexer_loss == lg->indexer_loss &&
                  lc->total_loss == lg->total_loss && lc->indexer_loss > 0,
              "recompute %d: losses %.17g %.17g %.17g (guard) vs %.17g %.17g %.17g", recompute, lg->loss, lg->mtp_loss,
              lg->indexer_loss, lc->loss, lc->mtp_loss, lc->indexer_loss);
        float *grads = malloc((size_t)n * sizeof(float));
        ds4_model_to_host(mg, grads, ds4_model_grads_flat(mg), (size_t)n * sizeof(float));
        CHECK(!memcmp(grads, ds4_model_grads_flat(mc), (size_t)n * sizeof(float)), "recompute %d: gradients",
              recompute);
        free(grads);
    }
    ds4_pass_free(pc);
    ds4_pass_free(pg);
    ds4_model_free(mc);
    ds4_model_free(mg);
}

static void test_pass_equals_cpu(void) { pass_equals_cpu(false); }
static void test_recompute_pass_equals_cpu(void) { pass_equals_cpu(true); }

/* A host read of a guard buffer outside an op: the process dies of SIGSEGV, its message naming the buffer
 * (category, size, offset) and the call stack. touch runs in a child, whose stderr the test reads; want:
 * the words the message must hold. */
typedef void touch_fn(const ds4_exec *on_guard, const ds4_config *c);
static void expect_named_fault(const char *what, touch_fn *touch, const char *want) {
    const ds4_kernel_backend *gb = guard_backend();
    if (!gb) return;
    int fds[2];
    CHECK(pipe(fds) == 0, "pipe");
    fflush(NULL);
    const pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        omp_set_num_threads(1); /* the parent's OpenMP threads do not exist here: no team may start */
        ds4_config c;
        const ds4_exec on_guard = {.backend = gb};
        if (ds4_config_load("tests/configs/tiny-a.json", &c) != DS4_OK) _exit(3);
        touch(&on_guard, &c);
        _exit(0);
    }
    close(fds[1]);
    char buf[8192];
    size_t got = 0;
    ssize_t r;
    while (got < sizeof buf - 1 && (r = read(fds[0], buf + got, sizeof buf - 1 - got)) > 0) got += (size_t)r;
    buf[got] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV, "%s: the child was not killed by SIGSEGV (status %d): %s",
          what, status, buf);
    CHECK(strstr(buf, "cpu-guard") && strstr(buf, want) && strstr(buf, "call stack"), "%s: the message names the place: %s",
          what, buf);
}

/* The host reaching into a model's parameters. */
static void touch_params(const ds4_exec *on_guard, const ds4_config *c) {
    ds4_model *m = NULL;
    if (ds4_model_create(on_guard, c, false, &m)) _exit(3);
    volatile float x = ds4_model_params_flat(m)[5];
    (void)x;
}

/* An FSDP model on the guard, initialised (one process: the world of one rank, staged); exits on failure. */
static ds4_fsdp *fsdp_on_guard(const ds4_exec *on_guard, const ds4_config *c, ds4_model **m) {
    ds4_fsdp *f = NULL;
    if (ds4_model_create(on_guard, c, true, m) || ds4_fsdp_create(*m, ds4_comm_world(), 1, &f) ||
        ds4_fsdp_init_random(f, 3))
        _exit(3);
    return f;
}

/* The host reaching into an FSDP shard. */
static void touch_shard(const ds4_exec *on_guard, const ds4_config *c) {
    ds4_model *m = NULL;
    volatile float x = ds4_fsdp_shard_grads(fsdp_on_guard(on_guard, c, &m))[7];
    (void)x;
}

/* The host reaching into a gathered group's weights (a mapped piece of the model's reserved range). */
static void touch_gathered(const ds4_exec *on_guard, const ds4_config *c) {
    ds4_model *m = NULL;
    const ds4_param_hooks *h = ds4_fsdp_hooks(fsdp_on_guard(on_guard, c, &m));
    if (h->gather(h->ctx, 0) != DS4_OK) _exit(4);
    volatile float x = ds4_model_params_flat(m)[ds4_model_region(m, 0)->start + 2];
    (void)x;
}

static void test_host_touch_is_named(void) { expect_named_fault("params", touch_params, "byte 20 of a"); }
static void test_shard_touch_is_named(void) { expect_named_fault("shard", touch_shard, "byte 28 of a"); }
static void test_gathered_touch_is_named(void) {
    expect_named_fault("gathered", touch_gathered, "byte 8 of a");
}

int main(void) {
    RUN(test_table);
    RUN(test_pass_equals_cpu);
    RUN(test_recompute_pass_equals_cpu);
    RUN(test_host_touch_is_named);
    RUN(test_shard_touch_is_named);
    RUN(test_gathered_touch_is_named);
    TEST_MAIN_END("test_guard");
}
