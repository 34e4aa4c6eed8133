/* ds4 IO: safetensors files (read via mmap, write atomically), model directories (config.json +
 * shards), whole-file helpers, and dequantization of the official FP8/FP4 checkpoints.
 *
 * Every function that can fail returns a ds4_status and leaves a one-line message naming the
 * file and the tensor (see ds4_errmsg()). */
#ifndef DS4_IO_H
#define DS4_IO_H

#include "ds4/core.h"
#include "ds4/config.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- safetensors reader */
typedef struct {
    char *name;
    ds4_dtype dtype;
    int ndim;
    int64_t shape[DS4_MAX_DIMS];
    uint64_t begin, end;          /* byte offsets into the data section */
} ds4_st_entry;

typedef struct ds4_st_file ds4_st_file;   /* one open .safetensors (mmap'ed read-only) */

ds4_status ds4_st_open(const char *path, ds4_st_file **out);
void ds4_st_close(ds4_st_file *f);                                  /* NULL is a no-op */
int64_t ds4_st_count(const ds4_st_file *f);
const ds4_st_entry *ds4_st_entry_at(const ds4_st_file *f, int64_t i); /* header order */
const ds4_st_entry *ds4_st_find(const ds4_st_file *f, const char *name); /* NULL if absent */
const void *ds4_st_bytes(const ds4_st_file *f, const ds4_st_entry *e);  /* raw bytes */
const char *ds4_st_path(const ds4_st_file *f);
int64_t ds4_st_entry_numel(const ds4_st_entry *e);
/* DS4_OK if e has exactly shape (ndim, shape); else DS4_ERR_SHAPE naming file, tensor, got vs expected. */
ds4_status ds4_st_check_shape(const ds4_st_file *f, const ds4_st_entry *e, int ndim, const int64_t *shape);

/* Reads tensor `name` as float32 into out[numel], checking shape == (ndim, shape).
 * F32/BF16/F16 accepted; other dtypes: error naming file + tensor + dtype.
 * Missing tensor / wrong shape: error naming file, tensor, got vs expected. */
ds4_status ds4_st_read_f32(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, float *out);
/* Same for integer tables (I32/I64 -> int64), e.g. tid2eid. */
ds4_status ds4_st_read_i64(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, int64_t *out);

/* ---------------------------------------------------------------- safetensors writer */
/* Collects tensors (data pointers must stay valid until write), then writes header + data to a
 * temp file in the same directory, fsync, rename over `path` (atomic). Metadata {"format":"pt"}. */
typedef struct ds4_st_writer ds4_st_writer;
ds4_status ds4_st_writer_new(ds4_st_writer **w);
ds4_status ds4_st_writer_add(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape,
                             const void *data);
ds4_status ds4_st_writer_write(ds4_st_writer *w, const char *path);
void ds4_st_writer_free(ds4_st_writer *w);                          /* NULL is a no-op */

/* ---------------------------------------------------------------- model directory */
/* config.json + one or more *.safetensors (all files in the directory, or those listed by
 * model.safetensors.index.json when present). Tensor lookup across shards by name. */
typedef struct ds4_model_dir ds4_model_dir;
ds4_status ds4_model_dir_open(const char *dir, ds4_model_dir **out);
void ds4_model_dir_close(ds4_model_dir *d);                         /* NULL is a no-op */
const ds4_config *ds4_model_dir_config(const ds4_model_dir *d);     /* parsed config.json */
const char *ds4_model_dir_path(const ds4_model_dir *d);
/* Finds the shard holding `name`; NULL if none. *entry (if entry != NULL) gets its entry. */
const ds4_st_file *ds4_model_dir_find(const ds4_model_dir *d, const char *name, const ds4_st_entry **entry);
int64_t ds4_model_dir_nfiles(const ds4_model_dir *d);
const ds4_st_file *ds4_model_dir_file(const ds4_model_dir *d, int64_t i);
/* Like ds4_st_read_f32 across shards; a quantized weight (F8_E4M3 with a `<name>.scale` sibling,
 * or FP4 packed in I8 with a `.scale` sibling) is dequantized transparently (§8.2). */
ds4_status ds4_model_dir_read_f32(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, float *out);
ds4_status ds4_model_dir_read_i64(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, int64_t *out);

/* ---------------------------------------------------------------- whole files */
/* Atomic whole-file write (temp in same dir, fsync file, rename, fsync dir). */
ds4_status ds4_write_file_atomic(const char *path, const void *data, size_t len);
/* Allocates *data (DS4_MEM_OTHER, free with ds4_free), NUL-terminated; *len excludes the NUL. */
ds4_status ds4_read_file(const char *path, char **data, size_t *len);

/* Streaming form of the atomic write, for files too big to build in memory (checkpoints):
 *   ds4_atomic_file af; DS4_TRY(ds4_atomic_open(path, &af));
 *   ds4_atomic_write(&af, p, n) ...; ds4_atomic_commit(&af);   (or ds4_atomic_abort on error)
 * Data goes to a temp file in the same directory; commit fsyncs it, renames it over `path` and
 * fsyncs the directory. Any failing call aborts (removes the temp file) before returning. */
typedef struct {
    int fd;
    char *path;   /* final path */
    char *tmp;    /* temp path in the same directory */
} ds4_atomic_file;
ds4_status ds4_atomic_open(const char *path, ds4_atomic_file *af);
ds4_status ds4_atomic_write(ds4_atomic_file *af, const void *data, size_t len);
ds4_status ds4_atomic_commit(ds4_atomic_file *af);
void ds4_atomic_abort(ds4_atomic_file *af);   /* safe to call twice */

/* ---------------------------------------------------------------- quantized checkpoints (§8.2) */
float ds4_e4m3_to_f32(uint8_t b);   /* OCP FP8 E4M3FN: bias 7, no inf, 0x7f/0xff = NaN */
float ds4_e5m2_to_f32(uint8_t b);   /* OCP FP8 E5M2: bias 15, IEEE-like inf/NaN */
float ds4_e8m0_to_f32(uint8_t b);   /* 2^(b-127); 0xff = NaN */
float ds4_e2m1_to_f32(uint8_t nib); /* FP4 E2M1 (low 4 bits): {0, .5, 1, 1.5, 2, 3, 4, 6} with sign */

/* FP8 weight w[rows, cols] (E4M3 bytes) with block scales s[ceil(rows/128), ceil(cols/128)]
 * (one float per 128x128 block; partial edge blocks use the same scale) -> out[rows, cols]. */
void ds4_dequant_fp8_block(const uint8_t *w, const float *scale, int64_t rows, int64_t cols, float *out);
/* FP4 weight: packed[rows, cols/2] (two E2M1 per byte, low nibble = even column) with scales
 * s[rows, cols/32] -> out[rows, cols]. cols must be even. */
void ds4_dequant_fp4_row32(const uint8_t *packed, const float *scale, int64_t rows, int64_t cols, float *out);
/* Reads a quantized weight `name` (logical shape [rows, cols]) with its `<name>.scale` sibling
 * (E8M0 or F32) from one file set and dequantizes it; used by ds4_model_dir_read_f32. */
ds4_status ds4_st_read_dequant(const ds4_st_file *wf, const ds4_st_entry *we, const ds4_st_file *sf,
                               const ds4_st_entry *se, int ndim, const int64_t *shape, float *out);

#ifdef __cplusplus
}
#endif
#endif
