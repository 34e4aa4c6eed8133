/* The host/device boundary for the layers above the model (ds4/model.h, "flat arrays on a context's
 * backend"): buffers, copies and the step's ops of the context's backend. A scalar an op produces lands in
 * a device buffer of 8 bytes and is read back here, the one place the step waits for it. */
#include "model/model_internal.h"

void *ds4_dev_alloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes) { return buf_alloc(ex, cat, bytes); }

void *ds4_dev_zalloc(const ds4_exec *ex, ds4_mem_cat cat, size_t bytes) {
    void *p = buf_alloc(ex, cat, bytes);
    if (p) tensor_zero(ex, p, bytes);
    return p;
}

void ds4_dev_free(const ds4_exec *ex, void *p) { buf_free(ex, p); }

void ds4_dev_to_host(const ds4_exec *ex, void *dst, const void *src, size_t bytes) {
    copy_to_host(ex, dst, src, bytes);
    synchronize(ex);
}

void ds4_dev_copy(const ds4_exec *ex, void *dst, const void *src, size_t bytes) { tensor_copy(ex, dst, src, bytes); }

void ds4_dev_to_device(const ds4_exec *ex, void *dst, const void *src, size_t bytes) {
    copy_to_device(ex, dst, src, bytes);
    synchronize(ex);
}

const void *ds4_dev_host_view(const ds4_exec *ex, const void *src, size_t bytes) {
    if (ds4_exec_host_memory(ex)) return src;
    void *h = ds4_alloc(DS4_MEM_OTHER, bytes ? bytes : 1);
    if (!h) {
        ds4_fail(DS4_ERR_OOM, "out of memory for a host copy of %zu bytes", bytes);
        return NULL;
    }
    ds4_dev_to_host(ex, h, src, bytes);
    return h;
}

void ds4_dev_host_view_free(const ds4_exec *ex, const void *view, const void *src) {
    (void)ex;
    if (view != src) ds4_free((void *)view);
}

ds4_status ds4_dev_status(const ds4_exec *ex) {
    synchronize(ex);
    return ops_status(ex);
}

/* An 8-byte device scalar for one result: a plan's is counted and reads back 0. */
static ds4_status scalar_new(const ds4_exec *ex, const char *what, void **out) {
    if (!(*out = buf_alloc(ex, DS4_MEM_WORK, 8))) return ds4_fail(DS4_ERR_OOM, "out of memory for the %s", what);
    return DS4_OK;
}

ds4_status ds4_dev_count_nonfinite(const ds4_exec *ex, const float *x, int64_t n, int64_t *out) {
    void *d;
    *out = 0;
    DS4_TRY(scalar_new(ex, "finite check", &d));
    count_nonfinite(ex, d, x, n);
    copy_to_host(ex, out, d, sizeof *out);
    synchronize(ex);
    buf_free(ex, d);
    return DS4_OK;
}

ds4_status ds4_dev_sumsq_exact(const ds4_exec *ex, const float *x, int64_t n, ds4_sumsq_acc *acc) {
    void *d;
    memset(acc, 0, sizeof *acc);
    const char *owner = ds4_mem_owner_enter("step: gradient norm"); /* memplan --memory-report's name for it */
    d = buf_alloc(ex, DS4_MEM_WORK, sizeof *acc);
    ds4_mem_owner_leave(owner);
    if (!d) return ds4_fail(DS4_ERR_OOM, "out of memory for the sum of squares");
    sumsq_exact(ex, d, x, n);
    copy_to_host(ex, acc, d, sizeof *acc);
    synchronize(ex);
    buf_free(ex, d);
    return DS4_OK;
}

void ds4_dev_rank_sum_add(const ds4_exec *ex, float *g, const float *recv, int n, int64_t len) {
    rank_sum_add(ex, g, recv, n, len);
}

void ds4_dev_zero(const ds4_exec *ex, void *dst, size_t bytes) { tensor_zero(ex, dst, bytes); }

void ds4_dev_scale(const ds4_exec *ex, float *x, int64_t n, float s) { scale_f32(ex, x, n, s); }

void ds4_dev_adamw_update(const ds4_exec *ex, int64_t n, float *w, const float *g, float *m, float *v,
                          ds4_adamw_consts k, bool decay) {
    adamw_update(ex, n, w, g, m, v, k, decay);
}

void ds4_dev_muon_momentum(const ds4_exec *ex, int64_t n, const float *g, float *mom, float *u, float mu,
                           bool nesterov) {
    muon_momentum(ex, n, g, mom, u, mu, nesterov);
}

void ds4_dev_muon_apply(const ds4_exec *ex, int64_t n, float *w, const float *o, float decay, float step) {
    muon_apply(ex, n, w, o, decay, step);
}
