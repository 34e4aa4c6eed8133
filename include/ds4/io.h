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
 * F32/BF16/F16 accepted, and quantized weights whose scale is in the same file (§8.2);
 * other dtypes: error naming file + tensor + dtype.
 * Missing tensor / wrong shape: error naming file, tensor, got vs expected. */
ds4_status ds4_st_read_f32(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, float *out);
/* Same for integer tables (I32/I64 -> int64), e.g. tid2eid. */
ds4_status ds4_st_read_i64(const ds4_st_file *f, const char *name, int ndim, const int64_t *shape, int64_t *out);
/* Parses a safetensors image held in memory (copied; `name` stands for the path in messages). */
ds4_status ds4_st_open_memory(const void *data, size_t len, const char *name, ds4_st_file **out);
/* Drops the pages of data-section bytes [begin, end) from the resident set (the file stays mapped;
 * they are read again on the next access). Bounds the memory of a pass over a huge checkpoint. */
void ds4_st_release(const ds4_st_file *f, uint64_t begin, uint64_t end);

/* ---------------------------------------------------------------- safetensors writer */
/* Collects tensors (data pointers must stay valid until write), then writes header + data to a
 * temp file in the same directory, fsync, rename over `path` (atomic). Metadata {"format":"pt"}. */
typedef struct ds4_st_writer ds4_st_writer;
ds4_status ds4_st_writer_new(ds4_st_writer **w);
ds4_status ds4_st_writer_add(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape,
                             const void *data);
ds4_status ds4_st_writer_write(ds4_st_writer *w, const char *path);
void ds4_st_writer_free(ds4_st_writer *w);                          /* NULL is a no-op; aborts a begun stream */
/* Streaming form, for files larger than memory: declare every tensor (no data), begin (writes the
 * header to a temp file next to `path`), put the data bytes in DECLARATION order (any chunking),
 * finish (checks every byte came, fsync, rename). Any error removes the temp file. */
ds4_status ds4_st_writer_declare(ds4_st_writer *w, const char *name, ds4_dtype dt, int ndim, const int64_t *shape);
ds4_status ds4_st_writer_begin(ds4_st_writer *w, const char *path);
ds4_status ds4_st_writer_put(ds4_st_writer *w, const void *data, size_t len);
ds4_status ds4_st_writer_finish(ds4_st_writer *w);

/* ---------------------------------------------------------------- model directory */
/* config.json + one or more *.safetensors (all files in the directory, or those listed by
 * model.safetensors.index.json when present). Tensor lookup across shards by name. */
typedef struct ds4_model_dir ds4_model_dir;
ds4_status ds4_model_dir_open(const char *dir, ds4_model_dir **out);
/* Same, reading exactly the shard files `shards[n]` (names in `dir`) and ignoring any index. */
ds4_status ds4_model_dir_open_shards(const char *dir, const char *const *shards, int64_t n, ds4_model_dir **out);
void ds4_model_dir_close(ds4_model_dir *d);                         /* NULL is a no-op */
const ds4_config *ds4_model_dir_config(const ds4_model_dir *d);     /* parsed config.json */
/* True when the config declares an MTP block the folder does not store, in transformers' layout (its
 * save_pretrained drops MTP): ds4_model_dir_config then has n_mtp_layers = 0, the model the folder holds. */
bool ds4_model_dir_mtp_absent(const ds4_model_dir *d);
const char *ds4_model_dir_path(const ds4_model_dir *d);
/* Finds the shard holding `name`; NULL if none. *entry (if entry != NULL) gets its entry. */
const ds4_st_file *ds4_model_dir_find(const ds4_model_dir *d, const char *name, const ds4_st_entry **entry);
int64_t ds4_model_dir_nfiles(const ds4_model_dir *d);
const ds4_st_file *ds4_model_dir_file(const ds4_model_dir *d, int64_t i);
/* Like ds4_st_read_f32 across shards; a quantized weight (F8_E4M3 with a `<name>.scale` sibling,
 * or FP4 packed in I8 with a `.scale` sibling) is dequantized transparently (§8.2). `name` is an
 * official name; when the directory holds the Hugging Face layout instead, the tensor is found
 * under its HF name (one expert sliced out of a fused gate_up_proj / down_proj). */
ds4_status ds4_model_dir_read_f32(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, float *out);
ds4_status ds4_model_dir_read_i64(const ds4_model_dir *d, const char *name, int ndim, const int64_t *shape, int64_t *out);

/* ---------------------------------------------------------------- folders */
/* mkdir -p DIR: every missing folder on the way is created (0755). An error names DIR as the `what`
 * ("checkpoint folder", "TensorBoard folder", ...), the folder that could not be made and why. */
ds4_status ds4_mkdirs(const char *dir, const char *what);
/* mkdir -p of the folder that holds the file PATH (nothing when PATH has no folder part). */
ds4_status ds4_mkdirs_parent(const char *path, const char *what);

/* ---------------------------------------------------------------- whole files */
/* Atomic whole-file write (temp in same dir, fsync file, rename, fsync dir). */
ds4_status ds4_write_file_atomic(const char *path, const void *data, size_t len);
/* A cJSON tree, printed (indented), written atomically; NULL root: out of memory. */
struct cJSON;
ds4_status ds4_write_json_atomic(const char *path, const struct cJSON *root);
/* Allocates *data (DS4_MEM_OTHER, free with ds4_free), NUL-terminated; *len excludes the NUL.
 * Opened with ds4_open_input: a FIFO or device is refused, never waited on. */
ds4_status ds4_read_file(const char *path, char **data, size_t *len);
/* The one way ds4 opens a file it reads from input. Opening never blocks: anything but a regular
 * file (a FIFO, socket, device or directory given where a file is expected) is refused with
 * "PATH: not a regular file (...)" instead of hanging the open or the first read. `what` (or NULL)
 * names the file in the "PATH: cannot open WHAT: reason" message. On success *fd is a blocking
 * O_RDONLY | O_CLOEXEC descriptor (close it) and *size the file's length in bytes. */
ds4_status ds4_open_input(const char *path, const char *what, int *fd, uint64_t *size);
/* The same check without keeping the file open: for paths handed to a reader that opens them itself. */
ds4_status ds4_check_input(const char *path, const char *what);

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
/* Rows [r0, r0 + n) of an FP8 weight: w points at row r0, scale at the block row holding r0
 * (ceil(cols/128) floats per block row) -> out[n, cols]. */
void ds4_dequant_fp8_rows(const uint8_t *w, const float *scale, int64_t cols, int64_t r0, int64_t n, float *out);
/* FP4 weight: packed[rows, cols/2] (two E2M1 per byte, low nibble = even column) with scales
 * s[rows, cols/32] -> out[rows, cols]. cols must be even. */
void ds4_dequant_fp4_row32(const uint8_t *packed, const float *scale, int64_t rows, int64_t cols, float *out);
/* Dequantizes the weight we (F8_E4M3, or FP4 packed in I8) with its scale se (E8M0, F32 or BF16)
 * into out, checking the logical shape (ndim, shape). ds4_model_dir_read_f32 does this by name. */
ds4_status ds4_st_read_dequant(const ds4_st_file *wf, const ds4_st_entry *we, const ds4_st_file *sf,
                               const ds4_st_entry *se, int ndim, const int64_t *shape, float *out);


/* ---------------------------------------------------------------- tensor names (§8.1, §8.2) */
/* ds4 uses the official checkpoint names ("layers.3.attn.wq_a.weight"). The Hugging Face
 * transformers layout renames modules ("model.layers.3.self_attn.q_a_proj.weight") and fuses the
 * routed experts of a layer: gate_up_proj [E, 2I, D] = per expert [w1; w3], down_proj [E, D, I] = w2.
 * MTP tensors ("mtp.0.*") have no HF name and keep the official one in both layouts. */
typedef struct {
    char name[160];     /* Hugging Face tensor name */
    int64_t expert;     /* -1: the whole tensor; else index along dim 0 of a fused expert tensor */
    int part, nparts;   /* row block of that expert: w1 is part 0 of 2, w3 part 1 of 2, w2 part 0 of 1 */
} ds4_hf_ref;
/* False when `official` has no HF form (mtp.*, unknown names). */
bool ds4_name_to_hf(const char *official, ds4_hf_ref *ref);
/* HF name -> official name for unfused tensors; false for fused experts and unknown names. */
bool ds4_name_from_hf(const char *hf, char *official, size_t n);
/* The name transformers' save_pretrained writes for per-layer tensor `official` (src/io/names.c: the
 * official name under "model.", attn.kv_norm as attn.norm); false for other names. And back. */
bool ds4_name_to_hf_saved(const char *official, char *saved, size_t n);
bool ds4_name_from_hf_saved(const char *saved, char *official, size_t n);
/* 2 for "...mlp.experts.gate_up_proj", 1 for "...mlp.experts.down_proj", 0 for anything else. */
int ds4_name_hf_fused_parts(const char *hf);
/* Official name of row block `part` of `expert` in the fused tensor `hf`; false if not fused. */
bool ds4_name_hf_fused_part(const char *hf, int64_t expert, int part, char *official, size_t n);

/* ---------------------------------------------------------------- logical tensors */
/* Where the values of one named tensor live: a stored tensor, possibly quantized (with its scale
 * sibling), possibly a row block of a fused HF expert tensor. Logical shape = the dequantized,
 * unpacked, sliced shape; as a matrix it is rows = shape[0] (1 for a scalar) by cols = the rest. */
typedef struct {
    char name[192];                  /* the name asked for (for messages) */
    const ds4_st_file *file;
    const ds4_st_entry *entry;       /* stored tensor (the whole fused tensor for a slice) */
    const ds4_st_file *scale_file;   /* NULL unless quantized */
    const ds4_st_entry *scale;
    bool fp4;                        /* I8 holding packed E2M1, two per byte, low nibble first */
    int ndim;
    int64_t shape[DS4_MAX_DIMS];     /* logical shape */
    int64_t rows, cols;
    int64_t row0;                    /* first stored row of a fused slice (rows of `cols` elements) */
    int64_t expert;                  /* fused slice: expert index; else -1 */
} ds4_tensor_loc;

/* `name` in one file; a quantized weight's scale must be in the same file. Errors: missing tensor,
 * scale of the wrong shape or dtype. */
ds4_status ds4_st_locate(const ds4_st_file *f, const char *name, ds4_tensor_loc *loc);
/* `name` (official, or stored as is) in any shard, else under its HF name. */
ds4_status ds4_model_dir_locate(const ds4_model_dir *d, const char *name, ds4_tensor_loc *loc);
/* True when the values are floats: F32/BF16/F16, or a quantized weight with its scale. */
bool ds4_tensor_loc_is_float(const ds4_tensor_loc *loc);
/* DS4_OK if the logical shape is (ndim, shape); else DS4_ERR_SHAPE naming file, tensor, got vs expected. */
ds4_status ds4_tensor_loc_check_shape(const ds4_tensor_loc *loc, int ndim, const int64_t *shape);
/* Logical rows [r0, r1) as float32 into out[(r1 - r0) * cols], dequantizing as needed (§8.2). */
ds4_status ds4_tensor_loc_read_rows(const ds4_tensor_loc *loc, int64_t r0, int64_t r1, float *out);
/* Integer table (I32/I64, not sliced) -> int64 out[numel]. */
ds4_status ds4_tensor_loc_read_i64(const ds4_tensor_loc *loc, int64_t *out);
/* Drops the stored bytes (weight and scale) of loc from the resident set; _rows: only the weight
 * bytes behind logical rows [r0, r1). */
void ds4_tensor_loc_release(const ds4_tensor_loc *loc);
void ds4_tensor_loc_release_rows(const ds4_tensor_loc *loc, int64_t r0, int64_t r1);
/* Bytes of storage behind loc (weight + scale; the slice's share of a fused tensor). */
uint64_t ds4_tensor_loc_bytes(const ds4_tensor_loc *loc);

typedef struct {
    int64_t n, nan, inf;         /* elements, NaN count, +-Inf count */
    double min, max, mean;       /* over the finite and infinite non-NaN values (0 when none) */
} ds4_tensor_stats;
/* Statistics of the values after dequantization, in a fixed order (deterministic). Integer and
 * other non-float tensors are read element by element as their numeric value. The pages read are
 * dropped from the resident set again (a pass over a whole checkpoint stays small). */
ds4_status ds4_tensor_loc_stats(const ds4_tensor_loc *loc, ds4_tensor_stats *st);

/* ---------------------------------------------------------------- conversion */
/* Converts a model directory (official FP8/FP4 checkpoint, a ds4 checkpoint folder, or an HF-named
 * directory) into OUT: every float tensor dequantized and written as `dtype`, other tensors copied,
 * names official or HF; one output shard per input shard under the same file name (a fused HF expert
 * tensor lives in the shard of its expert 0), each written by streaming (bounded memory) and
 * atomically; model.safetensors.index.json rewritten; config.json copied without
 * quantization_config (expert_dtype null, torch_dtype updated). Resumable: a shard already complete
 * from an earlier, unfinished run with the same options and the same source is kept
 * (OUT/.ds4-convert-progress.json, then its header is verified against the plan); a finished directory
 * keeps no progress file. Tokenizer and generation files travel with the model (`tokenizer`). */
typedef struct {
    const char *in_dir, *out_dir;
    ds4_dtype dtype;            /* DS4_BF16 or DS4_F32 */
    bool hf_names;              /* write Hugging Face names (else official) */
    bool progress;              /* progress bar on stderr */
    bool model_shards_only;     /* without an index, read only model*.safetensors (checkpoint folders) */
    const char *tokenizer;      /* NULL: the input's tokenizer files; "byte": ds4's byte tokenizer as tokenizer.json
                                 * + tokenizer_config.json; "none"; or a tokenizer.json (or its folder) ds4 reads,
                                 * copied with the files beside it (tokenizer_config.json, chat template) */
} ds4_convert_opts;
typedef struct {
    int64_t shards, shards_skipped, tensors;
    uint64_t bytes_in, bytes_out;   /* stored bytes read, bytes written (shards written this run) */
    double seconds;
} ds4_convert_report;
ds4_status ds4_convert(const ds4_convert_opts *opts, ds4_convert_report *report);

/* Rewrites a config.json object (a cJSON tree) into the transformers key spelling (hf) or
 * DeepSeek's: compress_ratios <-> layer_types + compress_rates, num_hash_layers <-> mlp_layer_types,
 * qk_rope_head_dim <-> partial_rotary_factor, rope_scaling <-> rope_parameters; other keys stay.
 * Already in that spelling alone: untouched (a key of the other spelling beside it is removed). Fails,
 * tree untouched, when it is not a valid config or the
 * target spelling cannot carry it (HCA layers of different ratios, in the transformers spelling). */
ds4_status ds4_config_json_respell(struct cJSON *root, bool hf, const char *path_for_errors);
/* Adds layer_types + compress_rates (the transformers spelling of compress_ratios) to a config, so that
 * transformers reads every compress ratio of a DeepSeek-spelled config (it maps compress_ratios entries 4
 * and 128 only). *added false, tree untouched, when HCA layers compress by two rates (transformers has one). */
ds4_status ds4_config_json_add_layer_types(struct cJSON *root, const char *path_for_errors, bool *added);
/* The keys transformers types as float written as floats ("1.0", not 1): swiglu_limit, hc_eps, ...,
 * rope_parameters.*.attention_factor. The items become raw JSON text: call it last, before printing. */
void ds4_config_json_floats(struct cJSON *root);

/* ---------------------------------------------------------------- TensorBoard event files (tfevents.c)
 * CRC32C (Castagnoli) and its TFRecord mask; a writer of events.out.tfevents.<time>.<host> in `dir`
 * (created), whose first record is the file_version event. Every record is flushed when written. */
uint32_t ds4_crc32c(const void *data, size_t n);
uint32_t ds4_crc32c_masked(const void *data, size_t n); /* ((c >> 15) | (c << 17)) + 0xa282ead8 */
typedef struct ds4_tfevents ds4_tfevents;
ds4_status ds4_tfevents_open(const char *dir, double wall_time, ds4_tfevents **out);
/* One Event at `step` with a Summary of n scalars (simple_value, stored as float) named by tags. */
ds4_status ds4_tfevents_scalars(ds4_tfevents *w, int64_t step, double wall_time, int n, const char *const *tags,
                                const double *values);
/* A SessionLog START at `step` (a resumed run): TensorBoard discards earlier events of steps >= step. */
ds4_status ds4_tfevents_restart(ds4_tfevents *w, int64_t step, double wall_time);
const char *ds4_tfevents_path(const ds4_tfevents *w);
ds4_status ds4_tfevents_close(ds4_tfevents *w); /* NULL is a no-op */

#ifdef __cplusplus
}
#endif
#endif
