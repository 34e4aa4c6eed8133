/* Tensor views over refcounted storage. */
#include "ds4/core.h"

#include <stdio.h>
#include <string.h>

bool ds4_shape_fits(int ndim, const int64_t *shape, int64_t elem_bytes, int64_t *numel) {
    if (elem_bytes < 1) return false;
    int64_t nz = elem_bytes, n = 1;   /* nz: product of the non-zero dims and the element size */
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0) return false;
        if (shape[i] > 0 && !ds4_mul_i64(nz, shape[i], &nz)) return false;
        n = shape[i] == 0 ? 0 : n * shape[i];   /* <= nz / elem_bytes: cannot overflow */
    }
    if (numel) *numel = n;
    return true;
}

static ds4_status tensor_alloc(ds4_tensor *t, ds4_mem_cat cat, ds4_dtype dt, int ndim,
                               const int64_t *shape, bool zero) {
    memset(t, 0, sizeof *t);
    if (ndim < 0 || ndim > DS4_MAX_DIMS) return ds4_fail(DS4_ERR_ARG, "tensor rank %d out of range", ndim);
    if ((unsigned)dt >= DS4_DTYPE_COUNT) return ds4_fail(DS4_ERR_ARG, "tensor dtype %d out of range", (int)dt);
    int64_t n;
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0) return ds4_fail(DS4_ERR_ARG, "negative tensor dimension %lld", (long long)shape[i]);
    if (!ds4_shape_fits(ndim, shape, (int64_t)ds4_dtype_size(dt), &n)) {
        char b[160];
        return ds4_fail(DS4_ERR_ARG, "tensor of shape %s and dtype %s: size overflows", ds4_dims_str(ndim, shape, b, sizeof b),
                        ds4_dtype_name(dt));
    }
    for (int i = 0; i < ndim; i++) t->shape[i] = shape[i];
    t->ndim = ndim;
    t->dtype = dt;
    ds4_storage *st = ds4_alloc(DS4_MEM_OTHER, sizeof *st);
    if (!st) return DS4_ERR_OOM;
    st->bytes = (size_t)n * ds4_dtype_size(dt);
    st->cat = cat;
    st->refcount = 1;
    st->data = zero ? ds4_calloc(cat, st->bytes) : ds4_alloc(cat, st->bytes);
    if (!st->data) {
        ds4_free(st);
        return DS4_ERR_OOM;
    }
    t->st = st;
    return DS4_OK;
}

ds4_status ds4_tensor_new(ds4_tensor *t, ds4_mem_cat cat, ds4_dtype dt, int ndim, const int64_t *shape) {
    return tensor_alloc(t, cat, dt, ndim, shape, false);
}

ds4_status ds4_tensor_zeros(ds4_tensor *t, ds4_mem_cat cat, ds4_dtype dt, int ndim, const int64_t *shape) {
    return tensor_alloc(t, cat, dt, ndim, shape, true);
}

void ds4_tensor_free(ds4_tensor *t) {
    if (t->st && --t->st->refcount == 0) {
        ds4_free(t->st->data);
        ds4_free(t->st);
    }
    memset(t, 0, sizeof *t);
}

ds4_tensor ds4_tensor_view(const ds4_tensor *t) {
    ds4_tensor v = *t;
    if (v.st) v.st->refcount++;
    return v;
}

int64_t ds4_tensor_numel(const ds4_tensor *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
    return n;
}

size_t ds4_tensor_bytes(const ds4_tensor *t) {
    return (size_t)ds4_tensor_numel(t) * ds4_dtype_size(t->dtype);
}

const char *ds4_dims_str(int ndim, const int64_t *shape, char *buf, size_t n) {
    size_t k = 0;
    k += (size_t)snprintf(buf + k, n - k, "[");
    for (int i = 0; i < ndim && k < n; i++)
        k += (size_t)snprintf(buf + k, n - k, i ? ", %lld" : "%lld", (long long)shape[i]);
    if (k < n) snprintf(buf + k, n - k, "]");
    return buf;
}

const char *ds4_shape_str(const ds4_tensor *t, char *buf, size_t n) {
    return ds4_dims_str(t->ndim, t->shape, buf, n);
}
