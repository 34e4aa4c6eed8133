/* The census of a config: what its model holds, counted from the parameter table's walk without
 * allocating a byte of it (ds4 init --dry-run, ds4 inspect --config). Parameters fall into routed
 * experts of the main layers, the rest of the main model, and the MTP block; the checkpoint bytes are
 * those of the format the config names: DeepSeek's official one when it has a quantization_config
 * (docs/dsv4-architecture.md §8.1: FP8 e4m3 projections with one E8M0 scale per 128 x 128 block,
 * routed experts FP4 packed two to a byte with one E8M0 scale per 32 inputs when expert_dtype is fp4,
 * the rest BF16, the F32 tensors of ds4/tensors.h, the hash table I64), else BF16 with the same F32
 * and I64 tensors. */
#include "model/param_table.h"

#include "ds4/model.h"

#include <string.h>

/* Tensors the checkpoint keeps in F32 (f32 = 1 in ds4/tensors.h), by official name. */
#define F32_NAME(field, nd, a, b, official, hf, rule, f32) f32 ? official : NULL,
static const char *const k_f32_names[] = {
    DS4_BLOCK_TENSORS(F32_NAME) DS4_COMPRESSOR_TENSORS(F32_NAME) DS4_ROUTER_BIAS_TENSORS(F32_NAME)
    DS4_HEAD_TENSORS(F32_NAME) DS4_MTP_TENSORS(F32_NAME) DS4_DSPARK_FIRST_TENSORS(F32_NAME)
    DS4_DSPARK_LAST_TENSORS(F32_NAME)};
#undef F32_NAME

/* The projections the official checkpoint stores in FP8 (a Linear of DeepSeek's model.py with the
 * fp8 dtype): attention, the indexer's query, the shared experts, MTP's two input projections, the
 * DSpark drafter's main_proj (docs/dspark.md).
 * Embedding, head, router, compressors and the indexer's weights_proj stay BF16. */
static const char *const k_fp8_names[] = {
    "attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_a.weight", "attn.wo_b.weight",
    "attn.indexer.wq_b.weight", "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight", "mtp.0.e_proj.weight", "mtp.0.h_proj.weight", "main_proj.weight",
};

/* `name` is `suffix` or ends in "." + suffix. */
static bool ends_with_part(const char *name, const char *suffix) {
    size_t n = strlen(name), m = suffix ? strlen(suffix) : 0;
    return m && n >= m && !strcmp(name + n - m, suffix) && (n == m || name[n - m - 1] == '.');
}

static bool in_list(const char *name, const char *const *list, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (ends_with_part(name, list[i])) return true;
    return false;
}

typedef enum { STORE_BF16, STORE_F32, STORE_I64, STORE_FP8, STORE_FP4 } store_kind;

typedef struct {
    ds4_param_census *out;
    int64_t group, expert; /* of the region the walk is in */
    ds4_status st;
} census_ctx;

static store_kind store_of(const ds4_config *c, const param_entry *e, bool routed_expert) {
    if (e->init == DS4_INIT_EXPERT_IDS) return STORE_I64;
    if (in_list(e->name, k_f32_names, sizeof k_f32_names / sizeof k_f32_names[0])) return STORE_F32;
    if (!c->quantized || e->ndim != 2) return STORE_BF16;
    if (routed_expert) return c->expert_fp4 ? STORE_FP4 : STORE_FP8;
    return in_list(e->name, k_fp8_names, sizeof k_fp8_names / sizeof k_fp8_names[0]) ? STORE_FP8 : STORE_BF16;
}

/* *acc += v; false on overflow (a config far beyond any machine). */
static bool add_to(int64_t *acc, int64_t v) { return ds4_add_i64(*acc, v, acc); }

static ds4_status overflow(const char *name) {
    return ds4_fail(DS4_ERR_CONFIG, "tensor %s: the model's sizes overflow 64-bit counts", name);
}

/* Adds one stored tensor of `n` elements of dtype t. */
static bool add_stored(ds4_param_census *o, ds4_dtype t, int64_t n) {
    int64_t bytes;
    o->stored_tensors++;
    return ds4_mul_i64(n, (int64_t)ds4_dtype_size(t), &bytes) && add_to(&o->stored_elements, n) &&
           add_to(&o->bytes[t], bytes);
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* A weight [R, C] and its scale: FP8 [R, C] with E8M0 [ceil(R/128), ceil(C/128)]; FP4 two per byte,
 * I8 [R, C/2], with E8M0 [R, C/32]. */
static ds4_status add_quantized(ds4_param_census *o, const param_entry *e, store_kind k, int64_t n) {
    const int64_t R = e->shape[0], C = e->shape[1];
    if (k == STORE_FP4 && C % 32)
        return ds4_fail(DS4_ERR_CONFIG, "tensor %s [%lld, %lld]: FP4 experts need a multiple of 32 inputs", e->name,
                        (long long)R, (long long)C);
    bool ok = k == STORE_FP8
                  ? add_stored(o, DS4_F8_E4M3, n) && add_stored(o, DS4_F8_E8M0, cdiv(R, 128) * cdiv(C, 128))
                  : add_stored(o, DS4_I8, n / 2) && add_stored(o, DS4_F8_E8M0, R * (C / 32));
    return ok ? DS4_OK : overflow(e->name);
}

static void census_region(param_walk *w, int64_t group, int64_t expert) {
    census_ctx *x = w->ctx;
    x->group = group;
    x->expert = expert;
}

static bool census_tensor(param_walk *w, const param_entry *e) {
    census_ctx *x = w->ctx;
    ds4_param_census *o = x->out;
    /* the DSpark stages are walked without regions: their routed experts are known by name */
    const bool mtp = !e->carried && x->group == group_mtp(w->c),
               routed = e->carried ? strstr(e->name, ".ffn.experts.") != NULL : x->expert >= 0;
    const store_kind k = store_of(w->c, e, routed);
    int64_t n = 1;
    bool ok = true;
    for (int d = 0; d < e->ndim && ok; d++) ok = ds4_mul_i64(n, e->shape[d], &n);
    int64_t *count = k == STORE_I64 ? &o->hash_entries
                     : e->carried   ? &o->params_dspark
                     : mtp          ? &o->params_mtp
                     : routed       ? &o->params_expert
                                    : &o->params_dense;
    o->tensors++;
    if (!ok || !add_to(count, n)) x->st = overflow(e->name);
    else if (k == STORE_FP8 || k == STORE_FP4) x->st = add_quantized(o, e, k, n);
    else if (!add_stored(o, k == STORE_I64 ? DS4_I64 : k == STORE_F32 ? DS4_F32 : DS4_BF16, n)) x->st = overflow(e->name);
    return x->st == DS4_OK;
}

ds4_status ds4_model_census(const ds4_config *c, ds4_param_census *out) {
    memset(out, 0, sizeof *out);
    DS4_TRY(ds4_config_validate(c, "config"));
    out->quantized = c->quantized;
    out->expert_fp4 = c->quantized && c->expert_fp4;
    census_ctx x = {.out = out, .expert = -1};
    param_walk w = {.c = c, .ctx = &x, .region = census_region, .tensor = census_tensor};
    param_walk_run(&w);
    DS4_TRY(x.st);
    bool ok = add_to(&out->params_total, out->params_expert) && add_to(&out->params_total, out->params_dense) &&
              add_to(&out->params_total, out->params_mtp) && add_to(&out->params_total, out->params_dspark);
    for (int t = 0; t < DS4_DTYPE_COUNT && ok; t++) ok = add_to(&out->total_bytes, out->bytes[t]);
    return ok ? DS4_OK : ds4_fail(DS4_ERR_CONFIG, "config: the model's sizes overflow 64-bit counts");
}
