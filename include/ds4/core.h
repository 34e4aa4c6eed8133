/* ds4 core: status codes and error messages, counted memory, tensors, RNG, threads.
 *
 * Every library function that can fail returns a ds4_status and leaves a one-line message,
 * with context (file, tensor, key, value seen, value expected), in a thread-local buffer read
 * by ds4_errmsg(). The library never exits or aborts on bad input. */
#ifndef DS4_CORE_H
#define DS4_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <stdbool.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---------------------------------------------------------------- status */
typedef enum {
    DS4_OK = 0,
    DS4_ERR_IO,          /* open/read/write/rename failed */
    DS4_ERR_FORMAT,      /* a file's bytes do not follow its format */
    DS4_ERR_CONFIG,      /* a config key is missing, unknown or inconsistent */
    DS4_ERR_SHAPE,       /* a tensor has the wrong shape or dtype */
    DS4_ERR_MISSING,     /* a named tensor or key is absent */
    DS4_ERR_ARG,         /* bad argument / flag / input value */
    DS4_ERR_OOM,         /* allocation failed */
    DS4_ERR_UNSUPPORTED, /* recognised but not implemented */
    DS4_ERR_INTERNAL,    /* an invariant of ds4 itself broke */
} ds4_status;

/* Sets the thread-local message (printf format) and returns `code`, so callers write
 *   return ds4_fail(DS4_ERR_FORMAT, "%s: header length %llu exceeds file size", path, n); */
ds4_status ds4_fail(ds4_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prepends "prefix: " to the current message (adds context while unwinding). */
ds4_status ds4_fail_prefix(ds4_status code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
const char *ds4_errmsg(void);
const char *ds4_status_name(ds4_status s);

/* Text that came from input (names in a file, keys, paths) made safe to print: bytes a terminal
 * could act on (C0 controls, DEL, C1 controls, bytes outside valid UTF-8) become \xNN; valid UTF-8
 * stays as it is. Writes at most cap - 1 bytes (never half an escape) + NUL into dst; returns dst.
 * ds4_fail and ds4_fail_prefix pass every message through it. */
const char *ds4_escape(const char *src, char *dst, size_t cap);
/* Whether s[0, n) is valid UTF-8 (shortest forms, no surrogates, at most U+10FFFF). */
bool ds4_utf8_valid(const char *s, size_t n);

#define DS4_TRY(expr)                          \
    do {                                       \
        ds4_status ds4_try_s_ = (expr);        \
        if (ds4_try_s_ != DS4_OK) return ds4_try_s_; \
    } while (0)

/* ---------------------------------------------------------------- checked sizes */
/* Every size ds4 derives from input (a file's header, a config key, a command-line flag) is computed
 * with these, so a hostile value is an error instead of a wrapped product. True when the exact result
 * fits in int64_t (then *out holds it); false on overflow. */
static inline bool ds4_mul_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_mul_overflow(a, b, out); }
static inline bool ds4_add_i64(int64_t a, int64_t b, int64_t *out) { return !__builtin_add_overflow(a, b, out); }
/* A shape from input: true when no dim is negative and the product of its non-zero dims, times
 * elem_bytes, fits in int64_t, so any product of a subset of its dims (rows, columns, bytes) does
 * too, even when a zero dim makes the element count 0. *numel (may be NULL): the element count. */
bool ds4_shape_fits(int ndim, const int64_t *shape, int64_t elem_bytes, int64_t *numel);

/* A byte size from input (a flag such as --device-memory): a decimal number, optionally with a fraction,
 * then optionally blanks and a unit, case-insensitive: B, KB MB GB TB PB (powers of 1000), KiB MiB GiB TiB
 * PiB (powers of 1024); no unit means bytes. "64GiB", "64GB", "68719476736", "1.5TiB" are sizes; a fraction
 * that ends between two bytes is rounded down. A bare K/M/G/T/P, a sign, an empty string, junk or a size
 * over int64_t are errors whose one-line message names `what` (the flag) and the text. */
ds4_status ds4_parse_bytes(const char *what, const char *s, int64_t *out);

/* ---------------------------------------------------------------- memory */
/* One allocator, byte-exact accounting of live and peak bytes per category. */
typedef enum {
    DS4_MEM_PARAM = 0, /* model parameters (fp32 master weights) */
    DS4_MEM_GRAD,      /* parameter gradients */
    DS4_MEM_OPTIM,     /* optimizer state */
    DS4_MEM_ACT,       /* activations saved for backward */
    DS4_MEM_WORK,      /* temporary workspace inside one op or unit */
    DS4_MEM_COMM,      /* communication buffers */
    DS4_MEM_OTHER,     /* IO buffers, tables, everything else */
    DS4_MEM_NCAT
} ds4_mem_cat;

const char *ds4_mem_cat_name(ds4_mem_cat c);

/* 64-byte aligned, counted under `cat`. Returns NULL on failure (and sets the message).
 * bytes == 0 returns a valid unique pointer counted as 0 bytes. Always memory behind the pointer; code
 * that also runs in a plan (ds4_exec below) allocates with ds4_alloc_for. */
void *ds4_alloc(ds4_mem_cat cat, size_t bytes);
void *ds4_calloc(ds4_mem_cat cat, size_t bytes);
/* The allocation a plan makes, whatever the current context: counted exactly as ds4_alloc counts it, with
 * memory behind the pointer only for DS4_MEM_OTHER (a plan backend's buffers; ds4_free releases it). */
void *ds4_alloc_plan(ds4_mem_cat cat, size_t bytes);
/* ds4_alloc_plan when plan, else ds4_alloc: for code that runs both in a plan and for real and is told
 * which (its context's ds4_exec.plan, or the plan backend's mirror of a kernel). calloc: zeroed where
 * backed. */
void *ds4_alloc_for(bool plan, ds4_mem_cat cat, size_t bytes);
void *ds4_calloc_for(bool plan, ds4_mem_cat cat, size_t bytes);
void ds4_free(void *p);             /* NULL is a no-op */
/* Grows *arr (elements of `elem` bytes, counted as DS4_MEM_OTHER) to hold at least `need`,
 * doubling from 16; keeps the contents. False on allocation failure (*arr unchanged). */
bool ds4_grow(void **arr, int64_t *cap, int64_t need, size_t elem);
/* NUL-terminated copy of n bytes (DS4_MEM_OTHER); NULL on allocation failure. */
char *ds4_strndup(const char *s, size_t n);
size_t ds4_alloc_size(const void *p); /* bytes requested for p */
/* Counts memory that is managed outside ds4_alloc (pages of a reserved range made resident or released
 * again, e.g. FSDP's gathered layer weights): delta bytes, positive or negative, under `cat`. */
void ds4_mem_track(ds4_mem_cat cat, int64_t delta);
/* The offload tier (docs/DESIGN.md idea 3): bytes of `cat` that live outside memory, in an offload store
 * (ds4/offload.h). Counted on their own: they never enter live/peak/live_total/peak_total above. */
void ds4_mem_track_offload(ds4_mem_cat cat, int64_t delta);

/* Reserved address ranges: `bytes` of address space with no memory behind it (NULL on failure), whose
 * pieces are made resident and counted one at a time (an FSDP wrapper's view of a model). map makes
 * [p, p + bytes) resident and zero, counted under `cat` (false: out of memory); unmap returns its pages
 * (the contents are lost; a later read faults until it is mapped again). In a plan (plan) both only count. */
void *ds4_range_reserve(size_t bytes);
void ds4_range_release(void *p, size_t bytes);
bool ds4_range_map(bool plan, void *p, size_t bytes, ds4_mem_cat cat);
void ds4_range_unmap(bool plan, void *p, size_t bytes, ds4_mem_cat cat);

/* Owners (memplan's breakdowns, --memory-report): who holds a category's bytes. An owner is a name (a
 * string that lives as long as the program) this thread works under (enter / leave, around the code
 * that allocates); a block remembers the owner it was allocated under, a range mapped or unmapped
 * (ds4_mem_track) counts under the current one. Only while started (ds4_mem_owners_start; memplan's
 * measured step) does a count also go to its owner, and each new peak of a category copies what every
 * owner holds then: the peak explained by the allocations that made it, not by a second formula. */
const char *ds4_mem_owner_enter(const char *name); /* returns the owner to leave back to */
void ds4_mem_owner_leave(const char *prev);
/* bytes of cat go from owner `from` to `to` without being freed (a range changing hands); the totals and
 * peaks do not move. items: a count an owner keeps beside its bytes (FSDP groups), changed by delta. */
void ds4_mem_owner_move(ds4_mem_cat cat, const char *from, const char *to, int64_t bytes);
void ds4_mem_owner_items(ds4_mem_cat cat, const char *owner, int64_t delta);
#define DS4_MEM_OWNERS_MAX 96 /* distinct owners counted; later ones count as no owner (NULL) */
typedef struct {
    const char *name;        /* NULL: allocated under no owner */
    int64_t max;             /* the most bytes of the category it held at once */
    int64_t at_peak;         /* what it held when the category reached its peak */
    int64_t items_at_peak;   /* its items then */
} ds4_mem_owner_stat;
/* Counting per owner from zero on (the category peaks being reset with ds4_mem_reset_peak just before),
 * and off again; what was counted is read until the next start. */
void ds4_mem_owners_start(void);
void ds4_mem_owners_stop(void);
/* The owners that held bytes of cat, in the order they first did; their number (at most cap written). */
int ds4_mem_owners_get(ds4_mem_cat cat, ds4_mem_owner_stat *out, int cap);
/* Names of the gradients' owners: the resident fp32 gradients (a process's whole model, or FSDP's shard)
 * and FSDP's unsharded group gradients, open in the backward or waiting for their reduce-scatter, and the
 * MTP input's embedding rows, waiting for the embedding's group (src/dist/fsdp_hooks.c, src/model). */
#define DS4_OWNER_GRAD_RESIDENT "resident fp32 gradients"
#define DS4_OWNER_GRAD_OPEN "unsharded, group in its backward"
#define DS4_OWNER_GRAD_FLIGHT "unsharded, reduce-scatter in flight"
#define DS4_OWNER_GRAD_ROWS "MTP embedding rows, waiting"

typedef struct {
    int64_t live[DS4_MEM_NCAT];
    int64_t peak[DS4_MEM_NCAT];   /* peak of each category on its own */
    int64_t live_total;
    int64_t peak_total;           /* peak of the sum over categories */
    int64_t n_allocs;             /* number of allocations made since start */
    /* offload tier (ds4_mem_track_offload): live and peak bytes per category, and of their sum */
    int64_t offload_live[DS4_MEM_NCAT];
    int64_t offload_peak[DS4_MEM_NCAT];
    int64_t offload_live_total;
    int64_t offload_peak_total;
} ds4_mem_stats;

void ds4_mem_get(ds4_mem_stats *out);
void ds4_mem_reset_peak(void);    /* peaks := current live (both tiers) */
/* A program's choice, made once at its start (the ds4 command and the benchmarks make it): the C
 * library keeps the memory of freed blocks for the next ones instead of handing every large block back
 * to the OS. A step frees and remakes the same activation and workspace blocks; handed back, each would
 * page-fault in again (the kernel zeroes every page), a cost that grows with the threads (a T = 1024 step
 * of the Flash-shaped bench config: 13% of its time on 1 thread, 25% on 2). The process keeps its peak.
 * Changes no result; a no-op outside glibc. */
void ds4_host_memory_keep(void);

/* ---------------------------------------------------------------- execution context */
/* What a step runs as: real (data and arithmetic) or a plan (memplan): in a plan every allocation is
 * counted exactly as in the real run, but only DS4_MEM_OTHER (metadata: ids, tables, counts) has memory
 * behind it, and no tensor data is read or written. Made by whoever starts the work (the trainer,
 * memplan) and passed down: the train state (ds4/trainer.h) gets it when opened, the optimizer and FSDP
 * read it from what they are given (the AdamW state, a plan communicator). */
/* The precision of the GEMM kernels (gemm_nt/nn/tn and the linear layers on them). FP32 (the default): fp32
 * operands and arithmetic. BF16: operands rounded to bf16 (nearest even), their exact products accumulated
 * in fp32, fp32 output (docs/DESIGN.md, "Matmul precision"). A property of the context work runs in. */
typedef enum { DS4_MATMUL_FP32 = 0, DS4_MATMUL_BF16 } ds4_matmul_precision;

typedef struct ds4_stream ds4_stream; /* a backend's queue of ops (NULL: its default; the cpu runs ops inline) */
struct ds4_kernel_backend;            /* a kernel backend's table (src/kernels/backend.h) */
typedef struct {
    bool plan;
    /* The backend the work runs on (NULL: cpu); in a plan, the backend planned for: the kernels then run
     * that backend's plan twin, which counts the workspace it would allocate. Chosen by name
     * (ds4_backend_find: training.device, --device). */
    const struct ds4_kernel_backend *backend;
    ds4_stream *stream; /* the queue every op of this context goes to (NULL: the backend's default) */
    ds4_matmul_precision matmul_precision; /* of every GEMM run in this context (training.matmul_precision) */
} ds4_exec;


/* Allocation-failure injection (tests only, SQLite's discipline): the n-th allocation from now fails as
 * if memory ran out (NULL and the usual out-of-memory message), once; n <= 0 disables. Counted: ds4_alloc,
 * ds4_calloc, ds4_grow, ds4_strndup and cJSON's allocations (always routed through ds4_alloc_hooked_malloc). */
void ds4_alloc_fail_after(int64_t n);
/* Allocations that have failed so far, injected or not: a caller of a kernel that cannot return a status
 * sees an out-of-memory inside it as this count moving. */
int64_t ds4_alloc_failures(void);
/* malloc with the injection above (for allocations that must be free()d, e.g. cJSON's) */
void *ds4_alloc_hooked_malloc(size_t bytes);

/* ---------------------------------------------------------------- dtypes */
typedef enum {
    DS4_F32 = 0, DS4_BF16, DS4_F16, DS4_F64, DS4_I8, DS4_U8, DS4_I16, DS4_I32, DS4_I64,
    DS4_BOOL, DS4_F8_E4M3, DS4_F8_E5M2, DS4_F8_E8M0, DS4_DTYPE_COUNT
} ds4_dtype;

const char *ds4_dtype_name(ds4_dtype t);      /* safetensors spelling: "F32", "BF16", ... */
bool ds4_dtype_from_name(const char *s, ds4_dtype *out);
size_t ds4_dtype_size(ds4_dtype t);

float ds4_bf16_to_f32(uint16_t h);
uint16_t ds4_f32_to_bf16(float f);  /* round to nearest even, NaN kept NaN */
float ds4_f16_to_f32(uint16_t h);

/* ---------------------------------------------------------------- tensors */
#define DS4_MAX_DIMS 6

/* Refcounted storage. A storage can be released (data freed, bytes returned to the
 * allocator) while tensors still point at it; `data == NULL` then and readers must
 * refill it first (see src/memory). */
typedef struct ds4_storage {
    void *data;
    size_t bytes;
    ds4_mem_cat cat;
    int refcount;
} ds4_storage;

/* A view: storage + element offset + shape (row-major, contiguous). */
typedef struct {
    ds4_storage *st;
    size_t offset;          /* in elements */
    ds4_dtype dtype;
    int ndim;
    int64_t shape[DS4_MAX_DIMS];
} ds4_tensor;

ds4_status ds4_tensor_new(ds4_tensor *t, ds4_mem_cat cat, ds4_dtype dt, int ndim, const int64_t *shape);
ds4_status ds4_tensor_zeros(ds4_tensor *t, ds4_mem_cat cat, ds4_dtype dt, int ndim, const int64_t *shape);
void ds4_tensor_free(ds4_tensor *t);   /* drops one reference; t becomes empty */
ds4_tensor ds4_tensor_view(const ds4_tensor *t); /* new reference to the same storage */
int64_t ds4_tensor_numel(const ds4_tensor *t);
size_t ds4_tensor_bytes(const ds4_tensor *t);
static inline float *ds4_f32(const ds4_tensor *t) {
    return t->st && t->st->data ? (float *)t->st->data + t->offset : NULL;
}
static inline void *ds4_data(const ds4_tensor *t) {
    return t->st && t->st->data ? (char *)t->st->data + t->offset * ds4_dtype_size(t->dtype) : NULL;
}
/* "[2, 3, 4]" into buf */
const char *ds4_shape_str(const ds4_tensor *t, char *buf, size_t n);
const char *ds4_dims_str(int ndim, const int64_t *shape, char *buf, size_t n);

/* ---------------------------------------------------------------- RNG */
/* Counter-based: every value is a pure function of (seed, stream, index), so any sub-range can
 * be regenerated (replay, sharding) without state. */
uint64_t ds4_rng_u64(uint64_t seed, uint64_t stream, uint64_t index);
float ds4_rng_uniform(uint64_t seed, uint64_t stream, uint64_t index);  /* [0, 1) */
float ds4_rng_normal(uint64_t seed, uint64_t stream, uint64_t index);   /* N(0, 1) */
/* Hash of a string, used to derive a per-tensor stream from its name. */
uint64_t ds4_hash_str(const char *s);

/* ---------------------------------------------------------------- threads */
#define DS4_MAX_THREADS 1024   /* the most threads a flag or key may ask for (training.threads, --threads) */
void ds4_set_threads(int n);   /* <= 0: keep the OpenMP default */
int ds4_get_threads(void);

/* ---------------------------------------------------------------- gradient norm (src/core/norm.c) */
/* Σ x² of x [n] in fp64: fixed chunks of 2^16 summed in order, the same bits for any thread count. */
double ds4_sumsq(const float *x, int64_t n);
/* Σ x² exactly, in a fixed-point number of 32-bit limbs (lowest bit 2^-298): the same bits for any
 * order, split over threads or ranks (limbs may be summed across ranks, then normalized). */
#define DS4_SUMSQ_LIMBS 20 /* 640 bits: x² spans bits [0, 554), leaving 86 bits of headroom */
typedef struct {
    int64_t limb[DS4_SUMSQ_LIMBS + 1]; /* the last one counts non-finite elements */
} ds4_sumsq_acc;
void ds4_sumsq_exact(const float *x, int64_t n, ds4_sumsq_acc *out);
void ds4_sumsq_normalize(ds4_sumsq_acc *a);      /* carries: one form per number */
double ds4_sumsq_value(const ds4_sumsq_acc *a);  /* normalized a as a double; NaN if an element was not finite */
/* Gradient clipping: g [n] *= max_norm / (norm + 1e-6) when max_norm > 0 and norm exceeds it. */
void ds4_clip_scale(float *g, int64_t n, double max_norm, double norm);
/* The rule of it: true and *s = the factor when the gradients are to be scaled. */
bool ds4_clip_factor(double max_norm, double norm, float *s);

/* ---------------------------------------------------------------- per-element ops of the step (src/core/norm.c)
 * Plain pointers and explicit sizes, no struct walked inside: what a backend would run. Each element's
 * arithmetic is fixed, so any split of the elements gives the same bits. */
/* x [n] *= s (the mean over micro-batches, clipping). */
void ds4_scale_f32(float *x, int64_t n, float s);
/* How many of x [n] are NaN or Inf. */
int64_t ds4_count_nonfinite(const float *x, int64_t n);
/* AdamW's per-step constants, the same for every element (ds4/train.h derives them from its settings). */
typedef struct {
    float b1, b2, eps;
    float omb1, omb2;   /* 1 − β1, 1 − β2, computed in double and rounded once (as PyTorch's AdamW does) */
    float step_size;    /* lr / (1 − β1^t) */
    float inv_sqrt_bc2; /* 1 / sqrt(1 − β2^t) */
    float decay;        /* lr · weight_decay */
} ds4_adamw_consts;
/* AdamW on n elements: w, g, m, v [n]; m := β1·m + omb1·g, v := β2·v + omb2·g², then w −= decay·w
 * (when decay) and w −= step_size·m / (sqrt(v)·inv_sqrt_bc2 + eps). */
void ds4_adamw_update(int64_t n, float *w, const float *g, float *m, float *v, ds4_adamw_consts k, bool decay);
/* One Newton–Schulz iteration's quintic (Muon): x := a·x + b·(x·xᵀ)·x + c·(x·xᵀ)²·x. */
typedef struct {
    float a, b, c;
} ds4_ns_coef;
/* Muon's momentum on n elements: g, mom, u [n]; mom := μ·mom + g, u := g + μ·mom (nesterov) or mom. */
void ds4_muon_momentum(int64_t n, const float *g, float *mom, float *u, float mu, bool nesterov);
/* Muon's update on n elements: w, o [n]; w −= decay·w, then w −= step·o (o: the orthogonalized u). */
void ds4_muon_apply(int64_t n, float *w, const float *o, float decay, float step);

/* ---------------------------------------------------------------- time */
double ds4_now(void);          /* seconds, monotonic */

#ifdef __cplusplus
}
#endif
#endif
