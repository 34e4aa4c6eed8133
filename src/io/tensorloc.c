/* Logical tensors: where the values of a named tensor live and how to read them by rows.
 *
 * A name resolves to a stored tensor (any shard), with its quantization scale when it is an FP8
 * or packed-FP4 weight (§8.2), or, in a Hugging Face directory, to a row block of a fused expert
 * tensor. Reads go by logical rows so that a pass over a 150 GB checkpoint holds one chunk at a
 * time; the stored pages can be dropped from the resident set afterwards (ds4_tensor_loc_release). */
#include "ds4/io.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

/* Finds a tensor by name in a file or a directory; returns its file. */
typedef const ds4_st_file *(*find_fn)(const void *src, const char *name, const ds4_st_entry **e);

static const ds4_st_file *find_in_file(const void *src, const char *name, const ds4_st_entry **e) {
    const ds4_st_file *f = src;
    *e = ds4_st_find(f, name);
    return *e ? f : NULL;
}
static const ds4_st_file *find_in_dir(const void *src, const char *name, const ds4_st_entry **e) {
    return ds4_model_dir_find(src, name, e);
}

/* The official `.scale` sibling: "x.weight" -> "x.scale", otherwise "x" -> "x.scale". */
static void scale_name(const char *name, char *buf, size_t n) {
    size_t len = strlen(name);
    if (len >= 7 && strcmp(name + len - 7, ".weight") == 0) snprintf(buf, n, "%.*s.scale", (int)(len - 7), name);
    else snprintf(buf, n, "%s.scale", name);
}

static bool is_plain_float(ds4_dtype t) { return t == DS4_F32 || t == DS4_BF16 || t == DS4_F16; }

/* rows = shape[0], cols = the product of the other dims. The logical shape comes from a file: it must
 * fit (zero dims included) with 8 bytes an element, the widest a reader writes (int64 tables), so
 * rows x cols and every read buffer size are exact. */
static ds4_status set_matrix(ds4_tensor_loc *loc) {
    if (!ds4_shape_fits(loc->ndim, loc->shape, 8, NULL)) {
        char b[160];
        return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s': logical shape %s is too large (its size overflows 64 bits)",
                        ds4_st_path(loc->file), loc->name, ds4_dims_str(loc->ndim, loc->shape, b, sizeof b));
    }
    loc->rows = loc->ndim > 0 ? loc->shape[0] : 1;
    loc->cols = 1;
    for (int i = 1; i < loc->ndim; i++) loc->cols *= loc->shape[i];
    return DS4_OK;
}

/* Validates a quantized pair (weight we, scale se) and fills the logical shape. */
static ds4_status quant_pair(const ds4_st_file *wf, const ds4_st_entry *we, const ds4_st_file *sf, const ds4_st_entry *se,
                             ds4_tensor_loc *loc) {
    const char *wp = ds4_st_path(wf);
    char b1[128], b2[128];
    if (we->ndim != 2)
        return ds4_fail(DS4_ERR_SHAPE, "%s: quantized tensor '%s' has shape %s; only 2-D weights are quantized", wp, we->name,
                        ds4_dims_str(we->ndim, we->shape, b1, sizeof b1));
    loc->fp4 = we->dtype == DS4_I8;
    int64_t rows = we->shape[0], cols = loc->fp4 ? 2 * we->shape[1] : we->shape[1];
    int64_t want[2] = {loc->fp4 ? rows : (rows + 127) / 128, loc->fp4 ? (cols + 31) / 32 : (cols + 127) / 128};
    if (se->ndim != 2 || se->shape[0] != want[0] || se->shape[1] != want[1])
        return ds4_fail(DS4_ERR_SHAPE, "%s: scale tensor '%s' of '%s' has shape %s, expected %s (%s weight of logical shape [%" PRId64
                        ", %" PRId64 "])", ds4_st_path(sf), se->name, we->name, ds4_dims_str(se->ndim, se->shape, b1, sizeof b1),
                        ds4_dims_str(2, want, b2, sizeof b2), loc->fp4 ? "FP4 1x32-block" : "FP8 128x128-block", rows, cols);
    if (se->dtype != DS4_F8_E8M0 && se->dtype != DS4_F32 && se->dtype != DS4_BF16)
        return ds4_fail(DS4_ERR_SHAPE, "%s: scale tensor '%s' of '%s' has dtype %s, expected F8_E8M0, F32 or BF16", ds4_st_path(sf),
                        se->name, we->name, ds4_dtype_name(se->dtype));
    loc->scale_file = sf;
    loc->scale = se;
    loc->ndim = 2;
    loc->shape[0] = rows;
    loc->shape[1] = cols;
    return set_matrix(loc);
}

static ds4_status loc_init(ds4_tensor_loc *loc, const char *name, const ds4_st_file *f, const ds4_st_entry *e) {
    memset(loc, 0, sizeof *loc);
    snprintf(loc->name, sizeof loc->name, "%s", name);
    loc->file = f;
    loc->entry = e;
    loc->expert = -1;
    loc->ndim = e->ndim;
    for (int i = 0; i < e->ndim; i++) loc->shape[i] = e->shape[i];
    return set_matrix(loc);
}

/* A stored tensor; an FP8 / I8 tensor with a scale sibling (official `.scale` or HF
 * `_scale_inv`) found through `find` is a quantized weight. */
static ds4_status locate_stored(find_fn find, const void *src, const char *name, const ds4_st_file *f,
                                const ds4_st_entry *e, ds4_tensor_loc *loc) {
    DS4_TRY(loc_init(loc, name, f, e));
    if (e->dtype != DS4_F8_E4M3 && e->dtype != DS4_I8) return DS4_OK;
    char sn[256];
    const ds4_st_entry *se;
    scale_name(e->name, sn, sizeof sn);
    const ds4_st_file *sf = find(src, sn, &se);
    if (!sf) {
        snprintf(sn, sizeof sn, "%s_scale_inv", e->name);
        sf = find(src, sn, &se);
    }
    return sf ? quant_pair(f, e, sf, se, loc) : DS4_OK;
}

ds4_status ds4_st_locate(const ds4_st_file *f, const char *name, ds4_tensor_loc *loc) {
    const ds4_st_entry *e = ds4_st_find(f, name);
    if (!e) return ds4_fail(DS4_ERR_MISSING, "%s: tensor '%s' not found", ds4_st_path(f), name);
    return locate_stored(find_in_file, f, name, f, e, loc);
}

/* Row block `ref` of the fused HF expert tensor e [E, nparts * rows, cols]. */
static ds4_status locate_slice(const char *name, const ds4_st_file *f, const ds4_st_entry *e, const ds4_hf_ref *ref,
                               ds4_tensor_loc *loc) {
    char b[128];
    if (!is_plain_float(e->dtype))
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: fused expert tensor '%s' (holding '%s') has dtype %s; only F32, BF16 or F16 are supported",
                        ds4_st_path(f), e->name, name, ds4_dtype_name(e->dtype));
    if (e->ndim != 3 || e->shape[0] <= ref->expert || e->shape[1] % ref->nparts != 0)
        return ds4_fail(DS4_ERR_SHAPE, "%s: fused expert tensor '%s' (holding '%s') has shape %s, expected [E > %" PRId64 ", %d x rows, cols]",
                        ds4_st_path(f), e->name, name, ds4_dims_str(e->ndim, e->shape, b, sizeof b), ref->expert, ref->nparts);
    DS4_TRY(loc_init(loc, name, f, e));
    int64_t R = e->shape[1] / ref->nparts;
    loc->ndim = 2;
    loc->shape[0] = R;
    loc->shape[1] = e->shape[2];
    DS4_TRY(set_matrix(loc));
    loc->expert = ref->expert;
    loc->row0 = ref->expert * e->shape[1] + ref->part * R;
    return DS4_OK;
}

ds4_status ds4_model_dir_locate(const ds4_model_dir *d, const char *name, ds4_tensor_loc *loc) {
    const ds4_st_entry *e;
    const ds4_st_file *f = ds4_model_dir_find(d, name, &e);
    if (f) return locate_stored(find_in_dir, d, name, f, e, loc);
    ds4_hf_ref ref;
    if (ds4_name_to_hf(name, &ref)) {
        f = ds4_model_dir_find(d, ref.name, &e);
        if (f && ref.expert < 0) return locate_stored(find_in_dir, d, name, f, e, loc);
        if (f) return locate_slice(name, f, e, &ref, loc);
        char saved[192]; /* the name transformers' save_pretrained writes */
        if (ds4_name_to_hf_saved(name, saved, sizeof saved) && (f = ds4_model_dir_find(d, saved, &e)))
            return locate_stored(find_in_dir, d, name, f, e, loc);
        return ds4_fail(DS4_ERR_MISSING, "%s: tensor '%s' (Hugging Face name '%s') not found in any shard", ds4_model_dir_path(d),
                        name, ref.name);
    }
    return ds4_fail(DS4_ERR_MISSING, "%s: tensor '%s' not found in any shard", ds4_model_dir_path(d), name);
}

bool ds4_tensor_loc_is_float(const ds4_tensor_loc *loc) { return loc->scale || is_plain_float(loc->entry->dtype); }

ds4_status ds4_tensor_loc_check_shape(const ds4_tensor_loc *loc, int ndim, const int64_t *shape) {
    bool ok = loc->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = loc->shape[i] == shape[i];
    if (ok) return DS4_OK;
    const char *p = ds4_st_path(loc->file);
    char got[128], want[128], st[128];
    ds4_dims_str(loc->ndim, loc->shape, got, sizeof got);
    ds4_dims_str(ndim, shape, want, sizeof want);
    if (loc->fp4)
        return ds4_fail(DS4_ERR_SHAPE, "%s: FP4 tensor '%s' is stored as %s (two E2M1 per byte of logical %s), expected logical %s", p,
                        loc->name, ds4_dims_str(loc->entry->ndim, loc->entry->shape, st, sizeof st), got, want);
    if (loc->expert >= 0)
        return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s' (expert %" PRId64 " of '%s') has shape %s, expected %s", p, loc->name,
                        loc->expert, loc->entry->name, got, want);
    return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s' has shape %s, expected %s", p, loc->name, got, want);
}

/* ---------------------------------------------------------------- reading */

static void decode_float(ds4_dtype t, const uint8_t *src, int64_t n, float *out) {
    if (t == DS4_F32) {
        memcpy(out, src, (size_t)n * 4);
        return;
    }
    #pragma omp parallel for schedule(static) if (n > (1 << 16))
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        out[i] = t == DS4_BF16 ? ds4_bf16_to_f32(h) : ds4_f16_to_f32(h);
    }
}

/* Scale elements [i0, i0 + n) -> float. */
static void decode_scales(const ds4_st_file *sf, const ds4_st_entry *se, int64_t i0, int64_t n, float *out) {
    const uint8_t *src = ds4_st_bytes(sf, se);
    if (se->dtype == DS4_F8_E8M0)
        for (int64_t i = 0; i < n; i++) out[i] = ds4_e8m0_to_f32(src[i0 + i]);
    else decode_float(se->dtype, src + (size_t)i0 * ds4_dtype_size(se->dtype), n, out);
}

static ds4_status not_float(const ds4_tensor_loc *loc) {
    const char *p = ds4_st_path(loc->file);
    if (loc->entry->dtype == DS4_F8_E4M3) {
        char sn[256];
        scale_name(loc->entry->name, sn, sizeof sn);
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: tensor '%s' is F8_E4M3 and needs dequantization, but its scale '%s' is absent", p,
                        loc->name, sn);
    }
    return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s' has dtype %s, expected F32, BF16 or F16", p, loc->name,
                    ds4_dtype_name(loc->entry->dtype));
}

ds4_status ds4_tensor_loc_read_rows(const ds4_tensor_loc *loc, int64_t r0, int64_t r1, float *out) {
    if (!ds4_tensor_loc_is_float(loc)) return not_float(loc);
    if (r0 < 0 || r1 < r0 || r1 > loc->rows)
        return ds4_fail(DS4_ERR_ARG, "%s: tensor '%s': rows [%" PRId64 ", %" PRId64 ") out of range (%" PRId64 " rows)",
                        ds4_st_path(loc->file), loc->name, r0, r1, loc->rows);
    int64_t n = r1 - r0, C = loc->cols;
    if (n == 0 || C == 0) return DS4_OK;
    const uint8_t *w = ds4_st_bytes(loc->file, loc->entry);
    if (!loc->scale) {
        size_t es = ds4_dtype_size(loc->entry->dtype);
        decode_float(loc->entry->dtype, w + (size_t)((loc->row0 + r0) * C) * es, n * C, out);
        return DS4_OK;
    }
    /* scales for the rows read: FP8 one row per 128 weight rows, FP4 one per weight row */
    int64_t sc = loc->scale->shape[1];
    int64_t s0 = loc->fp4 ? r0 : r0 / 128, s1 = loc->fp4 ? r1 : (r1 - 1) / 128 + 1;
    float *s = ds4_alloc(DS4_MEM_WORK, (size_t)((s1 - s0) * sc) * sizeof(float));
    if (!s) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the scales of '%s'", ds4_st_path(loc->file), loc->name);
    decode_scales(loc->scale_file, loc->scale, s0 * sc, (s1 - s0) * sc, s);
    if (loc->fp4) ds4_dequant_fp4_row32(w + (size_t)(r0 * (C / 2)), s, n, C, out);
    else ds4_dequant_fp8_rows(w + (size_t)(r0 * C), s, C, r0, n, out);
    ds4_free(s);
    return DS4_OK;
}

ds4_status ds4_tensor_loc_read_i64(const ds4_tensor_loc *loc, int64_t *out) {
    ds4_dtype t = loc->entry->dtype;
    if ((t != DS4_I32 && t != DS4_I64) || loc->expert >= 0)
        return ds4_fail(DS4_ERR_SHAPE, "%s: tensor '%s' has dtype %s, expected I32 or I64", ds4_st_path(loc->file), loc->name,
                        ds4_dtype_name(t));
    const uint8_t *src = ds4_st_bytes(loc->file, loc->entry);
    int64_t n = ds4_st_entry_numel(loc->entry);
    if (t == DS4_I64) memcpy(out, src, (size_t)n * 8);
    else
        for (int64_t i = 0; i < n; i++) {
            int32_t v;
            memcpy(&v, src + 4 * i, 4);
            out[i] = v;
        }
    return DS4_OK;
}

/* Byte range [begin, end) of the stored weight behind loc, in its file's data section. */
static void weight_range(const ds4_tensor_loc *loc, uint64_t *begin, uint64_t *end) {
    if (loc->expert < 0) {
        *begin = loc->entry->begin;
        *end = loc->entry->end;
        return;
    }
    uint64_t rb = (uint64_t)loc->cols * ds4_dtype_size(loc->entry->dtype);
    *begin = loc->entry->begin + (uint64_t)loc->row0 * rb;
    *end = *begin + (uint64_t)loc->rows * rb;
}

void ds4_tensor_loc_release(const ds4_tensor_loc *loc) {
    uint64_t b, e;
    weight_range(loc, &b, &e);
    ds4_st_release(loc->file, b, e);
    if (loc->scale) ds4_st_release(loc->scale_file, loc->scale->begin, loc->scale->end);
}

void ds4_tensor_loc_release_rows(const ds4_tensor_loc *loc, int64_t r0, int64_t r1) {
    if (r1 <= r0) return;
    /* bytes per logical row: FP4 packs two columns per byte, FP8 one, floats their size */
    uint64_t rb = loc->fp4 ? (uint64_t)loc->cols / 2 : (uint64_t)loc->cols * ds4_dtype_size(loc->entry->dtype);
    uint64_t b = loc->entry->begin + (uint64_t)(loc->row0 + r0) * rb;
    ds4_st_release(loc->file, b, b + (uint64_t)(r1 - r0) * rb);
}

uint64_t ds4_tensor_loc_bytes(const ds4_tensor_loc *loc) {
    uint64_t b, e;
    weight_range(loc, &b, &e);
    return (e - b) + (loc->scale ? loc->scale->end - loc->scale->begin : 0);
}

/* ---------------------------------------------------------------- statistics */

static void stats_add(ds4_tensor_stats *st, double *sum, double v) {
    st->n++;
    if (isnan(v)) {
        st->nan++;
        return;
    }
    if (isinf(v)) st->inf++;
    int64_t k = st->n - st->nan;
    if (k == 1 || v < st->min) st->min = v;
    if (k == 1 || v > st->max) st->max = v;
    *sum += v;
}

/* Numeric value of element i of a non-float stored tensor. */
static double elem_value(ds4_dtype t, const uint8_t *p, int64_t i) {
    switch (t) {
    case DS4_I8: return (int8_t)p[i];
    case DS4_U8: case DS4_BOOL: return p[i];
    case DS4_F8_E4M3: return ds4_e4m3_to_f32(p[i]);
    case DS4_F8_E5M2: return ds4_e5m2_to_f32(p[i]);
    case DS4_F8_E8M0: return ds4_e8m0_to_f32(p[i]);
    case DS4_I16: { int16_t v; memcpy(&v, p + 2 * i, 2); return v; }
    case DS4_I32: { int32_t v; memcpy(&v, p + 4 * i, 4); return v; }
    case DS4_I64: { int64_t v; memcpy(&v, p + 8 * i, 8); return (double)v; }
    case DS4_F64: { double v; memcpy(&v, p + 8 * i, 8); return v; }
    default: return NAN;
    }
}

ds4_status ds4_tensor_loc_stats(const ds4_tensor_loc *loc, ds4_tensor_stats *st) {
    memset(st, 0, sizeof *st);
    double sum = 0;
    if (!ds4_tensor_loc_is_float(loc)) {
        const uint8_t *p = ds4_st_bytes(loc->file, loc->entry);
        int64_t n = ds4_st_entry_numel(loc->entry);
        for (int64_t i = 0; i < n; i++) stats_add(st, &sum, elem_value(loc->entry->dtype, p, i));
        ds4_tensor_loc_release(loc);
    } else if (loc->rows > 0 && loc->cols > 0) {
        int64_t chunk = (1 << 22) / loc->cols;
        if (chunk < 1) chunk = 1;
        if (chunk > loc->rows) chunk = loc->rows;
        float *buf = ds4_alloc(DS4_MEM_WORK, (size_t)(chunk * loc->cols) * sizeof(float));
        if (!buf) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the statistics of '%s'", ds4_st_path(loc->file), loc->name);
        for (int64_t r = 0; r < loc->rows; r += chunk) {
            int64_t r1 = r + chunk < loc->rows ? r + chunk : loc->rows;
            ds4_status s = ds4_tensor_loc_read_rows(loc, r, r1, buf);
            if (s != DS4_OK) {
                ds4_free(buf);
                return s;
            }
            for (int64_t i = 0; i < (r1 - r) * loc->cols; i++) stats_add(st, &sum, buf[i]);
            ds4_tensor_loc_release_rows(loc, r, r1);
        }
        ds4_free(buf);
        ds4_tensor_loc_release(loc);
    }
    if (st->n > st->nan) st->mean = sum / (double)(st->n - st->nan);
    return DS4_OK;
}

/* ---------------------------------------------------------------- whole-tensor reads */

static ds4_status read_all_f32(const ds4_tensor_loc *loc, int ndim, const int64_t *shape, float *out) {
    if (!ds4_tensor_loc_is_float(loc)) return not_float(loc);
    DS4_TRY(ds4_tensor_loc_check_shape(loc, ndim, shape));
    return ds4_tensor_loc_read_rows(loc, 0, loc->rows, out);
}

static ds4_status read_all_i64(const ds4_tensor_loc *loc, int ndim, const int64_t *shape, int64_t *out) {
    ds4_dtype t = loc->entry->dtype;
    if (t != DS4_I32 && t != DS4_I64) return ds4_tensor_loc_read_i64(loc, out);   /* the dtype error */
    DS4_TRY(ds4_tensor_loc_check_shape(loc, ndim, shape));
    return ds4_tensor_loc_read_i64(loc, out);
}

ds4_status ds4_st_read_f32(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, float *out) {
    ds4_tensor_loc loc;
    DS4_TRY(ds4_st_locate(f, name, &loc));
    return read_all_f32(&loc, ndim, shape, out);
}

ds4_status ds4_st_read_i64(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, int64_t *out) {
    ds4_tensor_loc loc;
    DS4_TRY(ds4_st_locate(f, name, &loc));
    return read_all_i64(&loc, ndim, shape, out);
}

ds4_status ds4_model_dir_read_f32(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, float *out) {
    ds4_tensor_loc loc;
    DS4_TRY(ds4_model_dir_locate(d, name, &loc));
    return read_all_f32(&loc, ndim, shape, out);
}

ds4_status ds4_model_dir_read_i64(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, int64_t *out) {
    ds4_tensor_loc loc;
    DS4_TRY(ds4_model_dir_locate(d, name, &loc));
    return read_all_i64(&loc, ndim, shape, out);
}

ds4_status ds4_st_read_dequant(const ds4_st_file *wf, const ds4_st_entry *we, const ds4_st_file *sf,
                               const ds4_st_entry *se, int ndim, const int64_t *shape, float *out) {
    ds4_tensor_loc loc;
    DS4_TRY(loc_init(&loc, we->name, wf, we));
    if (we->dtype != DS4_F8_E4M3 && we->dtype != DS4_I8)
        return ds4_fail(DS4_ERR_UNSUPPORTED, "%s: tensor '%s' has dtype %s, which has no dequantization (expected F8_E4M3 or I8/FP4)",
                        ds4_st_path(wf), we->name, ds4_dtype_name(we->dtype));
    DS4_TRY(quant_pair(wf, we, sf, se, &loc));
    return read_all_f32(&loc, ndim, shape, out);
}
