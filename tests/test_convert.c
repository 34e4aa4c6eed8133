/* Official <-> Hugging Face names, the expected-tensor table, logical tensors (row reads, slices of
 * fused experts, statistics), the streaming writer, ds4_convert / export (dequantization bitwise
 * against the §8.2 formulas, fusing and splitting experts, resume, atomicity), --check, and the
 * corrupt-file cases (shard missing, index naming a missing tensor, scale shape mismatch, header over
 * 100 MB, overlapping offsets), each with a message naming the file and tensor. */
#include "ds4/io.h"
#include "ds4/model.h"
#include "test.h"
#include "test_files.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <fcntl.h>
#include <ftw.h>
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

static const char *tpath(const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

static bool msg_has(const char *s) { return strstr(ds4_errmsg(), s) != NULL; }
static bool same_float(float a, float b) { return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b)); }
/* bf16 bits equal, any NaN matching any NaN: which NaN a product of two NaNs (an FP8 NaN times a NaN
 * scale) returns depends on the compiler's operand order, not on the format. */
static bool same_bf16(uint16_t a, uint16_t b) { return a == b || ((a & 0x7fff) > 0x7f80 && (b & 0x7fff) > 0x7f80); }

static const char *find_file(const char *name) {
    static char buf[512];
    const char *roots[] = {".", "..", "../.."};
    for (int i = 0; i < 3; i++) {
        snprintf(buf, sizeof buf, "%s/%s", roots[i], name);
        if (access(buf, R_OK) == 0) return buf;
    }
    return name;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

static bool read_json(const char *path, cJSON **out) {
    char *t;
    size_t n;
    *out = NULL;
    if (ds4_read_file(path, &t, &n) != DS4_OK) return false;
    *out = cJSON_ParseWithLength(t, n);
    ds4_free(t);
    return *out != NULL;
}


/* ---------------------------------------------------------------- names */

static void test_names(void) {
    static const struct {
        const char *official, *hf;
    } pairs[] = {
        {"embed.weight", "model.embed_tokens.weight"},
        {"head.weight", "lm_head.weight"},
        {"norm.weight", "model.norm.weight"},
        {"hc_head_fn", "model.hc_head.hc_fn"},
        {"hc_head_scale", "model.hc_head.hc_scale"},
        {"layers.0.attn_norm.weight", "model.layers.0.input_layernorm.weight"},
        {"layers.12.ffn_norm.weight", "model.layers.12.post_attention_layernorm.weight"},
        {"layers.3.hc_attn_fn", "model.layers.3.attn_hc.fn"},
        {"layers.3.hc_ffn_base", "model.layers.3.ffn_hc.base"},
        {"layers.3.attn.attn_sink", "model.layers.3.self_attn.sinks"},
        {"layers.3.attn.wq_a.weight", "model.layers.3.self_attn.q_a_proj.weight"},
        {"layers.3.attn.q_norm.weight", "model.layers.3.self_attn.q_a_norm.weight"},
        {"layers.3.attn.wq_b.weight", "model.layers.3.self_attn.q_b_proj.weight"},
        {"layers.3.attn.wkv.weight", "model.layers.3.self_attn.kv_proj.weight"},
        {"layers.3.attn.wo_a.weight", "model.layers.3.self_attn.o_a_proj.weight"},
        {"layers.3.attn.wo_b.weight", "model.layers.3.self_attn.o_b_proj.weight"},
        {"layers.2.attn.compressor.ape", "model.layers.2.self_attn.compressor.position_bias"},
        {"layers.2.attn.compressor.norm.weight", "model.layers.2.self_attn.compressor.kv_norm.weight"},
        {"layers.2.attn.indexer.wq_b.weight", "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight"},
        {"layers.2.attn.indexer.weights_proj.weight", "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight"},
        {"layers.2.attn.indexer.compressor.wgate.weight", "model.layers.2.self_attn.compressor.indexer.gate_proj.weight"},
        {"layers.5.ffn.gate.bias", "model.layers.5.mlp.gate.e_score_correction_bias"},
        {"layers.0.ffn.gate.tid2eid", "model.layers.0.mlp.gate.tid2eid"},
        {"layers.5.ffn.shared_experts.w1.weight", "model.layers.5.mlp.shared_experts.gate_proj.weight"},
        {"layers.5.ffn.shared_experts.w3.weight", "model.layers.5.mlp.shared_experts.up_proj.weight"},
        {"layers.5.ffn.shared_experts.w2.weight", "model.layers.5.mlp.shared_experts.down_proj.weight"},
    };
    for (size_t i = 0; i < sizeof pairs / sizeof pairs[0]; i++) {
        ds4_hf_ref r;
        char back[192];
        CHECK(ds4_name_to_hf(pairs[i].official, &r) && strcmp(r.name, pairs[i].hf) == 0 && r.expert == -1, "%s -> %s",
              pairs[i].official, r.name);
        CHECK(ds4_name_from_hf(pairs[i].hf, back, sizeof back) && strcmp(back, pairs[i].official) == 0, "%s -> %s", pairs[i].hf, back);
        CHECK(ds4_name_hf_fused_parts(pairs[i].hf) == 0);
    }
    ds4_hf_ref r;
    CHECK(ds4_name_to_hf("layers.7.ffn.experts.41.w1.weight", &r) && !strcmp(r.name, "model.layers.7.mlp.experts.gate_up_proj") &&
          r.expert == 41 && r.part == 0 && r.nparts == 2);
    CHECK(ds4_name_to_hf("layers.7.ffn.experts.41.w3.weight", &r) && r.part == 1 && r.nparts == 2);
    CHECK(ds4_name_to_hf("layers.7.ffn.experts.41.w2.weight", &r) && !strcmp(r.name, "model.layers.7.mlp.experts.down_proj") &&
          r.part == 0 && r.nparts == 1);
    char nm[192];
    CHECK(ds4_name_hf_fused_parts("model.layers.7.mlp.experts.gate_up_proj") == 2);
    CHECK(ds4_name_hf_fused_parts("model.layers.7.mlp.experts.down_proj") == 1);
    CHECK(ds4_name_hf_fused_part("model.layers.7.mlp.experts.gate_up_proj", 41, 1, nm, sizeof nm) &&
          !strcmp(nm, "layers.7.ffn.experts.41.w3.weight"));
    CHECK(ds4_name_hf_fused_part("model.layers.7.mlp.experts.down_proj", 0, 0, nm, sizeof nm) && !strcmp(nm, "layers.7.ffn.experts.0.w2.weight"));
    CHECK(!ds4_name_hf_fused_part("model.layers.7.mlp.experts.down_proj", 0, 1, nm, sizeof nm));
    /* no HF form: MTP, unknown, malformed layer numbers */
    CHECK(!ds4_name_to_hf("mtp.0.attn.wq_a.weight", &r));
    CHECK(!ds4_name_to_hf("layers.x.attn_norm.weight", &r) && !ds4_name_to_hf("layers.01.attn_norm.weight", &r));
    CHECK(!ds4_name_to_hf("layers.0.attn.wq_a.scale", &r) && !ds4_name_to_hf("layers.0.ffn.experts.1.w4.weight", &r));
    CHECK(!ds4_name_from_hf("model.layers.01.input_layernorm.weight", nm, sizeof nm));
    CHECK(!ds4_name_from_hf("model.layers.0.mlp.experts.gate_up_proj", nm, sizeof nm));
    CHECK(!ds4_name_from_hf("embed.weight", nm, sizeof nm));
    CHECK(ds4_name_hf_fused_parts("layers.0.mlp.experts.gate_up_proj") == 0);
    CHECK(!ds4_name_from_hf("model.layers.0.input_layernorm.weight", nm, 10));   /* does not fit: refused */
    /* what transformers' save_pretrained writes: official per-layer names under "model.", kv_norm as attn.norm */
    static const char *const saved[][2] = {
        {"layers.3.attn.wq_a.weight", "model.layers.3.attn.wq_a.weight"},
        {"layers.3.attn.kv_norm.weight", "model.layers.3.attn.norm.weight"},
        {"layers.3.attn.compressor.norm.weight", "model.layers.3.attn.compressor.norm.weight"},
        {"layers.3.attn.indexer.compressor.ape", "model.layers.3.attn.indexer.compressor.ape"},
        {"layers.3.hc_attn_fn", "model.layers.3.hc_attn_fn"},
        {"layers.3.ffn.gate.bias", "model.layers.3.ffn.gate.bias"},
        {"layers.3.ffn.experts.12.w3.weight", "model.layers.3.ffn.experts.12.w3.weight"},
    };
    for (size_t i = 0; i < sizeof saved / sizeof saved[0]; i++) {
        CHECK(ds4_name_to_hf_saved(saved[i][0], nm, sizeof nm) && !strcmp(nm, saved[i][1]), "%s -> %s", saved[i][0], nm);
        CHECK(ds4_name_from_hf_saved(saved[i][1], nm, sizeof nm) && !strcmp(nm, saved[i][0]), "%s -> %s", saved[i][1], nm);
    }
    CHECK(!ds4_name_from_hf_saved("model.layers.3.attn.kv_norm.weight", nm, sizeof nm)); /* not what transformers writes */
    CHECK(!ds4_name_from_hf_saved("model.layers.3.self_attn.q_a_proj.weight", nm, sizeof nm)); /* an HF name */
    CHECK(!ds4_name_from_hf_saved("model.layers.3.ffn.experts.1.w4.weight", nm, sizeof nm));
    CHECK(!ds4_name_to_hf_saved("mtp.0.attn.wq_a.weight", nm, sizeof nm) && !ds4_name_to_hf_saved("head.weight", nm, sizeof nm));
}

/* Every official name of a real config maps to a distinct HF name and back. */
typedef struct {
    int64_t n, bad, mtp;
    char (*hf)[160];
} name_walk;

static ds4_status walk_names(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    (void)ndim, (void)shape, (void)is_int;
    name_walk *w = ctx;
    ds4_hf_ref r;
    char back[192];
    if (!ds4_name_to_hf(name, &r)) {
        w->mtp += strncmp(name, "mtp.0.", 6) == 0;
        w->bad += strncmp(name, "mtp.0.", 6) != 0;
        return DS4_OK;
    }
    if (r.expert < 0) {
        w->bad += !ds4_name_from_hf(r.name, back, sizeof back) || strcmp(back, name) != 0;
        if (w->hf) snprintf(w->hf[w->n++], 160, "%s", r.name);
    } else {
        w->bad += !ds4_name_hf_fused_part(r.name, r.expert, r.part, back, sizeof back) || strcmp(back, name) != 0;
    }
    return DS4_OK;
}

static int cmp_name160(const void *a, const void *b) { return strcmp(a, b); }

static void test_names_cover_config(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-a.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    name_walk w = {0};
    w.hf = calloc(4096, 160);
    CHECK(ds4_model_expected_tensors(&c, walk_names, &w) == DS4_OK);
    CHECK(w.bad == 0 && w.mtp > 0 && w.n > 50, "bad %lld, mtp %lld, n %lld", (long long)w.bad, (long long)w.mtp, (long long)w.n);
    qsort(w.hf, (size_t)w.n, 160, cmp_name160);
    int dup = 0;
    for (int64_t i = 1; i < w.n; i++) dup += strcmp(w.hf[i - 1], w.hf[i]) == 0;
    CHECK(dup == 0, "%d HF names used twice", dup);
    free(w.hf);
}

/* ---------------------------------------------------------------- expected tensors */

typedef struct {
    ds4_model *m;
    int64_t i, bad;
} table_walk;

static ds4_status cmp_table(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    table_walk *t = ctx;
    if (t->i >= ds4_model_nparams(t->m)) {
        t->bad++;
        return DS4_OK;
    }
    const ds4_param *p = ds4_model_param(t->m, t->i++);
    bool ok = strcmp(p->name, name) == 0 && p->ndim == ndim && p->is_int == is_int;
    for (int d = 0; ok && d < ndim; d++) ok = p->shape[d] == shape[d];
    if (!ok && t->bad++ < 3) t_note("  entry %lld: table %s, expected %s", (long long)t->i - 1, p->name, name);
    return DS4_OK;
}

static ds4_status count_numel(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    (void)name, (void)is_int;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    ((int64_t *)ctx)[0]++;
    ((int64_t *)ctx)[1] += n;
    return DS4_OK;
}

static void test_expected_tensors(void) {
    const char *cfgs[] = {"tests/configs/tiny-a.json", "tests/configs/tiny-b.json"};
    for (int k = 0; k < 2; k++) {
        ds4_config c;
        CHECK(ds4_config_load(find_file(cfgs[k]), &c) == DS4_OK, "%s", ds4_errmsg());
        ds4_model *m;
        if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) {
            CHECK(false, "%s", ds4_errmsg());
            continue;
        }
        table_walk t = {m, 0, 0};
        CHECK(ds4_model_expected_tensors(&c, cmp_table, &t) == DS4_OK);
        CHECK(t.bad == 0 && t.i == ds4_model_nparams(m), "%s: %lld mismatches, %lld of %lld", cfgs[k], (long long)t.bad, (long long)t.i,
              (long long)ds4_model_nparams(m));
        ds4_model_free(m);
    }
    /* the full Flash table, without allocating it: 284B-parameter class model listed in a few KB */
    ds4_config c;
    CHECK(ds4_config_load(find_file("configs/deepseek-v4-flash.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_mem_stats before, after;
    ds4_mem_reset_peak();
    ds4_mem_get(&before);
    int64_t cnt[2] = {0, 0};
    CHECK(ds4_model_expected_tensors(&c, count_numel, cnt) == DS4_OK);
    ds4_mem_get(&after);
    CHECK(after.peak_total - before.live_total < (1 << 20), "listing allocated %lld bytes", (long long)(after.peak_total - before.live_total));
    /* 44 blocks x 256 experts x 3 weights dominate the count; experts alone are 44*256*3*2048*4096 values */
    CHECK(cnt[0] > 44 * 256 * 3 && cnt[1] > 44LL * 256 * 3 * 2048 * 4096, "%lld tensors, %lld values", (long long)cnt[0], (long long)cnt[1]);
    ds4_config bad = c;
    bad.n_kv_heads = 2;   /* V4 has one KV head: invalid */
    CHECK(ds4_model_expected_tensors(&bad, count_numel, cnt) != DS4_OK);
}

/* The official checkpoints' stored bytes, from the parameter table and the release dtypes (§8.1, as
 * bench/make_fake_ckpt.c writes them): routed experts packed FP4 (I8 [r, c/2]) + E8M0 scales [r, c/32];
 * the attention / indexer query / shared-expert / MTP and DSpark input projections FP8 E4M3 + E8M0
 * scales per 128x128 block; tid2eid I64; the mHC, sinks, ape and router bias F32; everything else BF16.
 * Counted per "mtp.s." prefix as stored tensors (scales included). */
typedef struct {
    uint64_t bytes;
    int64_t stored[DS4_MAX_DSPARK_STAGES];
} release_size;

static bool release_fp8(const char *n) {
    const char *fp8[] = {".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".indexer.wq_b.",
                         ".shared_experts.", "e_proj.", "h_proj.", ".main_proj."};
    for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; i++)
        if (strstr(n, fp8[i])) return true;
    return false;
}

static ds4_status add_release_bytes(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    release_size *z = ctx;
    uint64_t r = (uint64_t)shape[0], c = ndim > 1 ? (uint64_t)shape[1] : 1, n = r * c;
    size_t len = strlen(name);
    bool f32 = strstr(name, "hc_") || strstr(name, "attn_sink") || (len > 4 && !strcmp(name + len - 4, ".ape")) ||
               strstr(name, "gate.bias");
    int stored = 1;
    if (is_int) z->bytes += 8 * n;
    else if (strstr(name, ".ffn.experts.")) z->bytes += n / 2 + r * (c / 32), stored = 2;
    else if (release_fp8(name)) z->bytes += n + ((r + 127) / 128) * ((c + 127) / 128), stored = 2;
    else z->bytes += (f32 ? 4 : 2) * n;
    long long s;
    if (sscanf(name, "mtp.%lld.", &s) == 1 && s >= 0 && s < DS4_MAX_DSPARK_STAGES) z->stored[s] += stored;
    return DS4_OK;
}

/* DeepSeek-V4-Flash-0731's table is its official index: the total_size of model.safetensors.index.json
 * (166,878,536,440 B; April's 159,609,485,896 B) and the stored tensors of the three DSpark stages
 * (1,568 / 1,565 / 1,572), as public material records them (tests/data/...0731.config.json.source.md). */
static void test_dspark_table(void) {
    ds4_config c;
    release_size april = {0}, v0731 = {0};
    CHECK(ds4_config_load(find_file("configs/deepseek-v4-flash.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_model_expected_tensors(&c, add_release_bytes, &april) == DS4_OK);
    CHECK(april.bytes == 159609485896ULL, "April Flash: %llu bytes", (unsigned long long)april.bytes);
    CHECK(ds4_config_load(find_file("tests/data/deepseek-v4-flash-0731.config.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_model_expected_tensors(&c, add_release_bytes, &v0731) == DS4_OK);
    CHECK(v0731.bytes == 166878536440ULL, "0731: %llu bytes", (unsigned long long)v0731.bytes);
    CHECK(v0731.stored[0] == 1568 && v0731.stored[1] == 1565 && v0731.stored[2] == 1572 && v0731.stored[3] == 0,
          "0731 stages: %lld / %lld / %lld stored tensors", (long long)v0731.stored[0], (long long)v0731.stored[1],
          (long long)v0731.stored[2]);
    /* a tiny DSpark model's table is the listing, with the stages carried (no flat storage, no gradient) */
    CHECK(ds4_config_load(find_file("tests/configs/tiny-dspark.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) {
        CHECK(false, "%s", ds4_errmsg());
        return;
    }
    table_walk t = {m, 0, 0};
    CHECK(ds4_model_expected_tensors(&c, cmp_table, &t) == DS4_OK && t.bad == 0 && t.i == ds4_model_nparams(m));
    int64_t carried = 0, flat = 0, bad = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        bool stage = !strncmp(p->name, "mtp.", 4);
        bad += stage != p->carried || (p->carried && (p->grad || !p->no_grad || !p->data));
        carried += p->carried;
        flat += ds4_param_in_flat(p) ? p->numel : 0;
    }
    CHECK(bad == 0 && carried > 0 && flat == (int64_t)ds4_model_numel(m), "%lld carried, %lld wrong", (long long)carried, (long long)bad);
    const ds4_param *mp = ds4_model_find(m, "mtp.0.main_proj.weight"), *cf = ds4_model_find(m, "mtp.2.confidence_head.proj.weight");
    CHECK(mp && mp->shape[0] == 64 && mp->shape[1] == 3 * 64 && cf && cf->shape[0] == 1 && cf->shape[1] == 64 + 8);
    CHECK(!ds4_model_find(m, "mtp.0.e_proj.weight") && !ds4_model_find(m, "mtp.1.main_proj.weight"));
    CHECK(ds4_param_router_block(&c, ds4_model_find(m, "mtp.1.ffn.gate.bias")) == -1);
    ds4_model_free(m);
}

/* The writer of a release-format directory: every tensor of the table in its release dtype (above),
 * FP8 / FP4 weights with their E8M0 ".scale" siblings; every byte 0 except the scales (2^0). */
typedef struct {
    ds4_st_writer *w;
    uint8_t *zeros, *ones;   /* big enough for any tensor of the tiny config */
} release_writer;

static ds4_status write_release(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    release_writer *x = ctx;
    const int64_t r = shape[0], c = ndim > 1 ? shape[1] : 1;
    char sn[160];
    snprintf(sn, sizeof sn, "%.*s.scale", (int)strlen(name) - 7, name);
    size_t len = strlen(name);
    bool f32 = strstr(name, "hc_") || strstr(name, "attn_sink") || (len > 4 && !strcmp(name + len - 4, ".ape")) ||
               strstr(name, "gate.bias");
    if (is_int) return ds4_st_writer_add(x->w, name, DS4_I64, ndim, shape, x->zeros);
    if (strstr(name, ".ffn.experts.")) {
        DS4_TRY(ds4_st_writer_add(x->w, name, DS4_I8, 2, (const int64_t[]){r, c / 2}, x->zeros));
        return ds4_st_writer_add(x->w, sn, DS4_F8_E8M0, 2, (const int64_t[]){r, c / 32}, x->ones);
    }
    if (release_fp8(name)) {
        DS4_TRY(ds4_st_writer_add(x->w, name, DS4_F8_E4M3, 2, shape, x->zeros));
        return ds4_st_writer_add(x->w, sn, DS4_F8_E8M0, 2, (const int64_t[]){(r + 127) / 128, (c + 127) / 128}, x->ones);
    }
    return ds4_st_writer_add(x->w, name, f32 ? DS4_F32 : DS4_BF16, ndim, shape, x->zeros);
}

/* A 0731-shaped directory in the release format (FP8 main_proj and attention, FP4 experts, BF16 Markov
 * and confidence heads, a quantized config) passes the model-directory check (ds4 inspect --check) and
 * loads, its drafter dequantized into the carried tensors. */
static void test_dspark_release_dir(void) {
    char *text;
    size_t n;
    CHECK(ds4_read_file(find_file("tests/configs/tiny-dspark.json"), &text, &n) == DS4_OK);
    if (!text) return;
    cJSON *r = cJSON_ParseWithLength(text, n);
    ds4_free(text);
    cJSON_AddItemToObject(r, "quantization_config", cJSON_CreateRaw("{\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                                                                   "\"weight_block_size\": [128, 128]}"));
    cJSON_DeleteItemFromObject(r, "expert_dtype");
    cJSON_AddStringToObject(r, "expert_dtype", "fp4");
    char *out = cJSON_Print(r);
    cJSON_Delete(r);
    const char *dir = tpath("dspark_release");
    char p[600];
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_bytes(p, out, strlen(out));
    cJSON_free(out);
    ds4_config c;
    CHECK(ds4_config_load(p, &c) == DS4_OK && c.quantized && c.expert_fp4 && c.dspark_n_stages == 3, "%s", ds4_errmsg());
    release_writer x = {.zeros = calloc(1, 1 << 20), .ones = malloc(1 << 16)};
    memset(x.ones, 127, 1 << 16); /* E8M0 127 = 2^0 */
    CHECK(ds4_st_writer_new(&x.w) == DS4_OK);
    CHECK(ds4_model_expected_tensors(&c, write_release, &x) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    CHECK(ds4_st_writer_write(x.w, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(x.w);
    free(x.zeros);
    free(x.ones);
    ds4_model_dir *d;
    int64_t problems = -1;
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (!d) return;
    CHECK(ds4_model_dir_check(d, NULL, NULL, &problems) == DS4_OK && problems == 0, "%lld problems", (long long)problems);
    ds4_model *m;
    CHECK(ds4_model_create(NULL, ds4_model_dir_config(d), false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (m) {
        ds4_param *mp = ds4_model_find(m, "mtp.0.main_proj.weight");
        if (mp) mp->data[0] = 1.0f;   /* the load must overwrite it with the stored 0 */
        CHECK(ds4_model_load(m, d) == DS4_OK, "%s", ds4_errmsg());
        CHECK(mp && mp->carried && mp->data[0] == 0.0f);
        ds4_model_free(m);
    }
    ds4_model_dir_close(d);
}

/* ---------------------------------------------------------------- streaming writer, memory images */

static void test_stream_writer(void) {
    const char *p = tpath("stream.safetensors");
    int64_t s1[2] = {3, 4}, s2[1] = {5};
    float a[12];
    int64_t b[5] = {9, 8, 7, 6, 5};
    for (int i = 0; i < 12; i++) a[i] = (float)i - 3.5f;
    ds4_st_writer *w;
    CHECK(ds4_st_writer_new(&w) == DS4_OK);
    CHECK(ds4_st_writer_declare(w, "b", DS4_I64, 1, s2) == DS4_OK);
    CHECK(ds4_st_writer_declare(w, "a", DS4_F32, 2, s1) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "c", DS4_F32, 2, s1, a) == DS4_ERR_ARG);   /* no mixing */
    CHECK(ds4_st_writer_begin(w, p) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_st_writer_put(w, b, 16) == DS4_OK && ds4_st_writer_put(w, (char *)b + 16, 24) == DS4_OK);
    CHECK(access(p, F_OK) != 0);   /* nothing visible before finish */
    CHECK(ds4_st_writer_put(w, a, 48) == DS4_OK && ds4_st_writer_finish(w) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    ds4_st_file *f;
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        float ra[12];
        int64_t rb[5];
        CHECK(ds4_st_read_f32(f, "a", 2, s1, ra) == DS4_OK && memcmp(ra, a, sizeof a) == 0);
        CHECK(ds4_st_read_i64(f, "b", 1, s2, rb) == DS4_OK && memcmp(rb, b, sizeof b) == 0);
        CHECK(ds4_st_entry_at(f, 0)->begin == 0 && !strcmp(ds4_st_entry_at(f, 0)->name, "b"));   /* declaration order */
        /* released pages come back on the next read */
        ds4_st_release(f, 0, 88);
        CHECK(ds4_st_read_f32(f, "a", 2, s1, ra) == DS4_OK && memcmp(ra, a, sizeof a) == 0);
        ds4_st_close(f);
    }
    /* too many bytes, too few bytes, duplicate names: an error and no file, no temp file */
    const char *q = tpath("stream_bad.safetensors");
    ds4_st_writer_new(&w);
    ds4_st_writer_declare(w, "a", DS4_F32, 2, s1);
    CHECK(ds4_st_writer_begin(w, q) == DS4_OK);
    CHECK(ds4_st_writer_put(w, a, 52) == DS4_ERR_ARG && msg_has("past the end"));
    CHECK(ds4_st_writer_put(w, a, 4) == DS4_ERR_ARG);   /* aborted */
    ds4_st_writer_free(w);
    ds4_st_writer_new(&w);
    ds4_st_writer_declare(w, "a", DS4_F32, 2, s1);
    CHECK(ds4_st_writer_begin(w, q) == DS4_OK);
    CHECK(ds4_st_writer_put(w, a, 44) == DS4_OK);
    CHECK(ds4_st_writer_finish(w) == DS4_ERR_ARG && msg_has("44 of 48"), "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    ds4_st_writer_new(&w);
    ds4_st_writer_declare(w, "a", DS4_F32, 2, s1);
    ds4_st_writer_declare(w, "a", DS4_F32, 2, s1);
    CHECK(ds4_st_writer_begin(w, q) == DS4_ERR_ARG && msg_has("twice"));
    ds4_st_writer_free(w);
    /* begun and dropped without finish */
    ds4_st_writer_new(&w);
    ds4_st_writer_declare(w, "a", DS4_F32, 2, s1);
    CHECK(ds4_st_writer_begin(w, q) == DS4_OK);
    ds4_st_writer_free(w);
    CHECK(access(q, F_OK) != 0);
    CHECK(t_count_tmp_files(g_dir) == 0, "temp files left in %s", g_dir);

    /* memory image: same parse, same checks */
    char *img;
    size_t n;
    CHECK(ds4_read_file(p, &img, &n) == DS4_OK);
    CHECK(ds4_st_open_memory(img, n, "image", &f) == DS4_OK && ds4_st_count(f) == 2);
    ds4_st_close(f);
    CHECK(ds4_st_open_memory(img, n - 1, "image", &f) == DS4_ERR_FORMAT && msg_has("image") && f == NULL);
    CHECK(ds4_st_open_memory(img, 3, "image", &f) == DS4_ERR_FORMAT && msg_has("too short"));
    ds4_free(img);
}

/* ---------------------------------------------------------------- quantized checkpoint fixture */

/* The §8.2 formulas written out element by element, independent of the library's loops. */
static float ref_fp8(const uint8_t *w, const uint8_t *s, int64_t cols, int64_t i, int64_t j) {
    int64_t sc = (cols + 127) / 128;
    return ds4_e4m3_to_f32(w[i * cols + j]) * ds4_e8m0_to_f32(s[(i / 128) * sc + j / 128]);
}
static float ref_fp4(const uint8_t *w, const float *s, int64_t cols, int64_t i, int64_t j) {
    uint8_t byte = w[i * (cols / 2) + j / 2];
    uint8_t nib = j % 2 == 0 ? byte & 15 : byte >> 4;
    return ds4_e2m1_to_f32(nib) * s[i * ((cols + 31) / 32) + j / 32];
}

enum { QR = 300, QC = 260, ER = 6, EC = 64, NX = 2 };   /* FP8 weight with partial blocks; experts [6, 64] */

typedef struct {
    uint8_t w8[QR * QC], s8[3 * 3];
    uint8_t x4[NX][3][ER * EC / 2];   /* expert e, w1/w2/w3 (w2 is [EC, ER] logical, stored here [ER, EC] too for simplicity) */
    float xs[NX][3][ER * 2];
    uint16_t emb[16 * 8];
    float hc[4];
    int64_t tid[4 * 2];
} qfix;

static qfix g_q;

static void write_config(const char *dir, bool quantized) {
    char *t;
    size_t n;
    if (ds4_read_file(find_file("tests/configs/tiny-a.json"), &t, &n) != DS4_OK) return;
    cJSON *r = cJSON_ParseWithLength(t, n);
    ds4_free(t);
    if (quantized) {
        cJSON *q = cJSON_AddObjectToObject(r, "quantization_config");
        cJSON_AddStringToObject(q, "quant_method", "fp8");
        cJSON_AddStringToObject(q, "fmt", "e4m3");
        cJSON_AddStringToObject(r, "expert_dtype", "fp4");
        cJSON_ReplaceItemInObjectCaseSensitive(r, "torch_dtype", cJSON_CreateString("bfloat16"));
    }
    char *out = cJSON_Print(r);
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    write_bytes(p, out, strlen(out));
    cJSON_free(out);
    cJSON_Delete(r);
}

static const char *k_xw[3] = {"w1", "w2", "w3"};

/* Two shards + index: FP8 wq_a [300, 260] whose E8M0 scale (with a NaN and a 2^-127 code) lives in
 * shard 2; FP4 experts 0..1 (F32 scales) in shard 2; BF16 embed, F32 hc, I64 tid2eid in shard 1. */
static void make_quant_dir(const char *dir) {
    mkdir(dir, 0755);
    write_config(dir, true);
    qfix *q = &g_q;
    for (int i = 0; i < QR * QC; i++) q->w8[i] = (uint8_t)(i * 37 + 11);   /* every code, NaN codes included */
    const uint8_t s8[9] = {127, 126, 130, 0, 255, 120, 133, 127, 1};
    memcpy(q->s8, s8, 9);
    for (int e = 0; e < NX; e++)
        for (int k = 0; k < 3; k++) {
            for (int i = 0; i < ER * EC / 2; i++) q->x4[e][k][i] = (uint8_t)(i * 29 + e * 7 + k * 3);   /* all 256 nibble pairs */
            for (int i = 0; i < ER * 2; i++) q->xs[e][k][i] = ldexpf(1.0f, (i + e + k) % 7 - 3);
        }
    for (int i = 0; i < 16 * 8; i++) q->emb[i] = ds4_f32_to_bf16((float)i * 0.25f - 3.0f);
    for (int i = 0; i < 4; i++) q->hc[i] = (float)i + 0.5f;
    for (int i = 0; i < 8; i++) q->tid[i] = i % 3;
    ds4_st_writer *w;
    char p[600];
    int64_t sw[2] = {QR, QC}, ss[2] = {3, 3}, se[2] = {16, 8}, sh[1] = {4}, st[2] = {4, 2}, sx[2] = {ER, EC / 2}, sxs[2] = {ER, 2};
    ds4_st_writer_new(&w);
    ds4_st_writer_add(w, "layers.0.attn.wq_a.weight", DS4_F8_E4M3, 2, sw, q->w8);
    ds4_st_writer_add(w, "embed.weight", DS4_BF16, 2, se, q->emb);
    ds4_st_writer_add(w, "hc_head_base", DS4_F32, 1, sh, q->hc);
    ds4_st_writer_add(w, "layers.0.ffn.gate.tid2eid", DS4_I64, 2, st, q->tid);
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
    CHECK(ds4_st_writer_write(w, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    ds4_st_writer_new(&w);
    ds4_st_writer_add(w, "layers.0.attn.wq_a.scale", DS4_F8_E8M0, 2, ss, q->s8);
    char nm[6][80];
    for (int e = 0; e < NX; e++)
        for (int k = 0; k < 3; k++) {
            snprintf(nm[0], 80, "layers.0.ffn.experts.%d.%s.weight", e, k_xw[k]);
            snprintf(nm[1], 80, "layers.0.ffn.experts.%d.%s.scale", e, k_xw[k]);
            ds4_st_writer_add(w, nm[0], DS4_I8, 2, sx, q->x4[e][k]);
            ds4_st_writer_add(w, nm[1], DS4_F32, 2, sxs, q->xs[e][k]);
        }
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
    CHECK(ds4_st_writer_write(w, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    /* index */
    cJSON *r = cJSON_CreateObject();
    cJSON *wm = cJSON_AddObjectToObject(r, "weight_map");
    const char *one[] = {"layers.0.attn.wq_a.weight", "embed.weight", "hc_head_base", "layers.0.ffn.gate.tid2eid"};
    for (int i = 0; i < 4; i++) cJSON_AddStringToObject(wm, one[i], "model-00001-of-00002.safetensors");
    cJSON_AddStringToObject(wm, "layers.0.attn.wq_a.scale", "model-00002-of-00002.safetensors");
    for (int e = 0; e < NX; e++)
        for (int k = 0; k < 3; k++) {
            snprintf(nm[0], 80, "layers.0.ffn.experts.%d.%s.weight", e, k_xw[k]);
            snprintf(nm[1], 80, "layers.0.ffn.experts.%d.%s.scale", e, k_xw[k]);
            cJSON_AddStringToObject(wm, nm[0], "model-00002-of-00002.safetensors");
            cJSON_AddStringToObject(wm, nm[1], "model-00002-of-00002.safetensors");
        }
    char *txt = cJSON_Print(r);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    write_bytes(p, txt, strlen(txt));
    cJSON_free(txt);
    cJSON_Delete(r);
}

/* Reads `name` (logical [rows, cols]) from dir as float. */
static bool read_dir(const char *dir, const char *name, int64_t rows, int64_t cols, float *out) {
    ds4_model_dir *d;
    if (ds4_model_dir_open(dir, &d) != DS4_OK) return false;
    int64_t sh[2] = {rows, cols};
    ds4_status s = ds4_model_dir_read_f32(d, name, 2, sh, out);
    if (s != DS4_OK) t_note("  %s", ds4_errmsg());
    ds4_model_dir_close(d);
    return s == DS4_OK;
}

/* Logical rows read in arbitrary ranges equal the whole read (FP8 block rows start mid-range). */
static void test_row_reads(void) {
    const char *dir = tpath("q_rows");
    make_quant_dir(dir);
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (!d) return;
    ds4_tensor_loc loc;
    CHECK(ds4_model_dir_locate(d, "layers.0.attn.wq_a.weight", &loc) == DS4_OK, "%s", ds4_errmsg());
    CHECK(loc.scale && !loc.fp4 && loc.rows == QR && loc.cols == QC && ds4_tensor_loc_is_float(&loc));
    CHECK(ds4_tensor_loc_bytes(&loc) == QR * QC + 9);
    static float whole[QR * QC], part[QR * QC];
    CHECK(ds4_tensor_loc_read_rows(&loc, 0, QR, whole) == DS4_OK);
    int bad = 0;
    for (int64_t i = 0; i < QR; i++)
        for (int64_t j = 0; j < QC; j++) bad += !same_float(whole[i * QC + j], ref_fp8(g_q.w8, g_q.s8, QC, i, j));
    CHECK(bad == 0, "%d FP8 values differ from the formula", bad);
    const int64_t cuts[] = {0, 1, 100, 129, 200, 255, 257, 299, 300};   /* [100, 129) and [255, 257) cross block rows */
    for (size_t k = 0; k + 1 < sizeof cuts / sizeof cuts[0]; k++)
        CHECK(ds4_tensor_loc_read_rows(&loc, cuts[k], cuts[k + 1], part + cuts[k] * QC) == DS4_OK);
    bad = 0;
    for (int i = 0; i < QR * QC; i++) bad += !same_float(part[i], whole[i]);
    CHECK(bad == 0, "%d values differ between chunked and whole reads", bad);
    CHECK(ds4_tensor_loc_read_rows(&loc, 5, 301, part) == DS4_ERR_ARG && msg_has("out of range"));
    CHECK(ds4_model_dir_locate(d, "layers.0.ffn.experts.1.w3.weight", &loc) == DS4_OK && loc.fp4 && loc.cols == EC);
    float x[ER * EC], y[ER * EC];
    CHECK(ds4_tensor_loc_read_rows(&loc, 0, ER, x) == DS4_OK && ds4_tensor_loc_read_rows(&loc, 2, 5, y + 2 * EC) == DS4_OK);
    bad = 0;
    for (int i = 0; i < ER; i++)
        for (int j = 0; j < EC; j++) {
            float r = ref_fp4(g_q.x4[1][2], g_q.xs[1][2], EC, i, j);
            bad += !same_float(x[i * EC + j], r) || (i >= 2 && i < 5 && !same_float(y[i * EC + j], r));
        }
    CHECK(bad == 0, "%d FP4 values differ", bad);
    ds4_tensor_loc_release(&loc);
    ds4_tensor_loc_release_rows(&loc, 1, 3);
    CHECK(ds4_tensor_loc_read_rows(&loc, 0, ER, y) == DS4_OK && memcmp(x, y, sizeof x) == 0);
    /* statistics after dequantization: exact against the formula */
    ds4_tensor_stats st;
    CHECK(ds4_model_dir_locate(d, "layers.0.attn.wq_a.weight", &loc) == DS4_OK && ds4_tensor_loc_stats(&loc, &st) == DS4_OK);
    int64_t nan = 0;
    double mn = INFINITY, mx = -INFINITY, sum = 0;
    for (int i = 0; i < QR * QC; i++) {
        if (isnan(whole[i])) { nan++; continue; }
        mn = fmin(mn, whole[i]), mx = fmax(mx, whole[i]), sum += whole[i];
    }
    CHECK(st.n == QR * QC && st.nan == nan && nan > 128 * 128 && st.min == mn && st.max == mx && st.mean == sum / (double)(QR * QC - nan),
          "n %lld nan %lld/%lld min %g/%g max %g/%g", (long long)st.n, (long long)st.nan, (long long)nan, st.min, mn, st.max, mx);
    CHECK(ds4_model_dir_locate(d, "layers.0.ffn.gate.tid2eid", &loc) == DS4_OK && !ds4_tensor_loc_is_float(&loc) &&
          ds4_tensor_loc_stats(&loc, &st) == DS4_OK && st.n == 8 && st.min == 0 && st.max == 2 && st.nan == 0 && st.mean == 7.0 / 8);
    CHECK(ds4_model_dir_locate(d, "layers.0.attn.wq_a.scale", &loc) == DS4_OK && ds4_tensor_loc_stats(&loc, &st) == DS4_OK &&
          st.nan == 1 && st.min == ldexp(1.0, -127) && st.max == 64);
    CHECK(ds4_tensor_loc_read_rows(&loc, 0, 1, part) == DS4_ERR_SHAPE && msg_has("F8_E8M0"));
    ds4_model_dir_close(d);
}

/* ---------------------------------------------------------------- convert */

static ds4_status convert(const char *in, const char *out, ds4_dtype dt, bool hf, ds4_convert_report *r) {
    ds4_convert_opts o = {.in_dir = in, .out_dir = out, .dtype = dt, .hf_names = hf};
    return ds4_convert(&o, r);
}

static void test_convert_quantized(void) {
    const char *in = tpath("q_in");
    make_quant_dir(in);
    const char *out = tpath("q_bf16");
    ds4_convert_report r;
    CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK, "%s", ds4_errmsg());
    CHECK(r.shards == 2 && r.shards_skipped == 0 && r.tensors == 4 + 6, "%lld shards, %lld tensors", (long long)r.shards,
          (long long)r.tensors);
    /* same shard names, scales folded away, every float tensor BF16 and bitwise bf16(formula) */
    char p[600];
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", out);
    ds4_st_file *f;
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        CHECK(ds4_st_count(f) == 6 && !ds4_st_find(f, "layers.0.attn.wq_a.scale"));
        const ds4_st_entry *e = ds4_st_find(f, "layers.0.ffn.experts.1.w2.weight");
        CHECK(e && e->dtype == DS4_BF16 && e->shape[0] == ER && e->shape[1] == EC);
        int bad = 0;
        for (int i = 0; e && i < ER * EC; i++) {
            uint16_t h;
            memcpy(&h, (const uint8_t *)ds4_st_bytes(f, e) + 2 * i, 2);
            bad += !same_bf16(h, ds4_f32_to_bf16(ref_fp4(g_q.x4[1][1], g_q.xs[1][1], EC, i / EC, i % EC)));
        }
        CHECK(bad == 0, "%d FP4 -> BF16 values differ", bad);
        ds4_st_close(f);
    }
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", out);
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        const ds4_st_entry *e = ds4_st_find(f, "layers.0.attn.wq_a.weight");
        CHECK(e && e->dtype == DS4_BF16 && e->shape[0] == QR && e->shape[1] == QC);
        int bad = 0;
        for (int i = 0; e && i < QR * QC; i++) {
            uint16_t h;
            memcpy(&h, (const uint8_t *)ds4_st_bytes(f, e) + 2 * i, 2);
            bad += !same_bf16(h, ds4_f32_to_bf16(ref_fp8(g_q.w8, g_q.s8, QC, i / QC, i % QC)));
        }
        CHECK(bad == 0, "%d FP8 -> BF16 values differ", bad);
        e = ds4_st_find(f, "embed.weight");
        CHECK(e && e->dtype == DS4_BF16 && memcmp(ds4_st_bytes(f, e), g_q.emb, sizeof g_q.emb) == 0);
        e = ds4_st_find(f, "layers.0.ffn.gate.tid2eid");
        CHECK(e && e->dtype == DS4_I64 && memcmp(ds4_st_bytes(f, e), g_q.tid, sizeof g_q.tid) == 0);
        /* mHC parameters stay F32, bit for bit, as in DeepSeek's checkpoint */
        e = ds4_st_find(f, "hc_head_base");
        CHECK(e && e->dtype == DS4_F32 && memcmp(ds4_st_bytes(f, e), g_q.hc, sizeof g_q.hc) == 0);
        ds4_st_close(f);
    }
    /* config.json: quantization_config gone, expert_dtype null, torch_dtype bfloat16; still a valid config */
    cJSON *c;
    snprintf(p, sizeof p, "%s/config.json", out);
    CHECK(read_json(p, &c));
    CHECK(c && !cJSON_GetObjectItemCaseSensitive(c, "quantization_config") &&
          cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(c, "expert_dtype")) &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(c, "torch_dtype")->valuestring, "bfloat16"));
    cJSON_Delete(c);
    ds4_config cfg;
    CHECK(ds4_config_load(p, &cfg) == DS4_OK && !cfg.quantized && !cfg.expert_fp4, "%s", ds4_errmsg());
    /* index: every tensor, in the shard its source came from, total_size = data bytes */
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", out);
    CHECK(read_json(p, &c));
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(c, "weight_map");
    CHECK(cJSON_GetArraySize(wm) == 10 &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(wm, "embed.weight")->valuestring, "model-00001-of-00002.safetensors") &&
          !strcmp(cJSON_GetObjectItemCaseSensitive(wm, "layers.0.ffn.experts.0.w1.weight")->valuestring,
                  "model-00002-of-00002.safetensors"));
    double total = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(c, "metadata"), "total_size")->valuedouble;
    CHECK(total == (double)(QR * QC * 2 + 16 * 8 * 2 + 4 * 4 + 8 * 8 + NX * 3 * ER * EC * 2), "total_size %g", total);
    cJSON_Delete(c);
    CHECK(r.bytes_out == (uint64_t)total);

    /* F32 + HF names: experts fused gate_up_proj [E, 2R, C] = [w1; w3] per expert, down_proj = w2 */
    const char *hf = tpath("q_hf32");
    CHECK(convert(in, hf, DS4_F32, true, &r) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", hf);
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    if (f) {
        CHECK(ds4_st_count(f) == 2, "%lld tensors", (long long)ds4_st_count(f));
        const ds4_st_entry *gu = ds4_st_find(f, "model.layers.0.mlp.experts.gate_up_proj");
        const ds4_st_entry *dn = ds4_st_find(f, "model.layers.0.mlp.experts.down_proj");
        CHECK(gu && gu->dtype == DS4_F32 && gu->ndim == 3 && gu->shape[0] == NX && gu->shape[1] == 2 * ER && gu->shape[2] == EC);
        CHECK(dn && dn->ndim == 3 && dn->shape[0] == NX && dn->shape[1] == ER && dn->shape[2] == EC);
        int bad = 0;
        for (int e = 0; gu && dn && e < NX; e++)
            for (int i = 0; i < ER; i++)
                for (int j = 0; j < EC; j++) {
                    float v1, v3, v2;
                    const float *g = ds4_st_bytes(f, gu), *dd = ds4_st_bytes(f, dn);
                    v1 = g[((int64_t)e * 2 * ER + i) * EC + j];
                    v3 = g[((int64_t)e * 2 * ER + ER + i) * EC + j];
                    v2 = dd[((int64_t)e * ER + i) * EC + j];
                    bad += !same_float(v1, ref_fp4(g_q.x4[e][0], g_q.xs[e][0], EC, i, j));
                    bad += !same_float(v3, ref_fp4(g_q.x4[e][2], g_q.xs[e][2], EC, i, j));
                    bad += !same_float(v2, ref_fp4(g_q.x4[e][1], g_q.xs[e][1], EC, i, j));
                }
        CHECK(bad == 0, "%d fused expert values differ", bad);
        ds4_st_close(f);
    }
    snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", hf);
    CHECK(ds4_st_open(p, &f) == DS4_OK);
    if (f) {
        CHECK(ds4_st_find(f, "model.layers.0.self_attn.q_a_proj.weight") && ds4_st_find(f, "model.embed_tokens.weight") &&
              ds4_st_find(f, "model.hc_head.hc_base") && ds4_st_find(f, "model.layers.0.mlp.gate.tid2eid") &&
              !ds4_st_find(f, "embed.weight"));
        ds4_st_close(f);
    }
    /* the HF directory reads back under official names, one expert sliced out of the fused tensor */
    float x[ER * EC];
    CHECK(read_dir(hf, "layers.0.ffn.experts.1.w3.weight", ER, EC, x));
    int bad = 0;
    for (int i = 0; i < ER * EC; i++) bad += !same_float(x[i], ref_fp4(g_q.x4[1][2], g_q.xs[1][2], EC, i / EC, i % EC));
    CHECK(bad == 0, "%d sliced values differ", bad);
    {
        ds4_model_dir *d;
        CHECK(ds4_model_dir_open(hf, &d) == DS4_OK);
        int64_t bad_shape[2] = {ER + 1, EC};
        CHECK(ds4_model_dir_read_f32(d, "layers.0.ffn.experts.1.w3.weight", 2, bad_shape, x) == DS4_ERR_SHAPE &&
              msg_has("expert 1") && msg_has("gate_up_proj"), "%s", ds4_errmsg());
        CHECK(ds4_model_dir_read_f32(d, "layers.0.ffn.experts.2.w3.weight", 2, bad_shape, x) == DS4_ERR_SHAPE && msg_has("E > 2"),
              "%s", ds4_errmsg());
        CHECK(ds4_model_dir_read_f32(d, "layers.0.attn.wkv.weight", 2, bad_shape, x) == DS4_ERR_MISSING &&
              msg_has("'layers.0.attn.wkv.weight'") && msg_has("model.layers.0.self_attn.kv_proj.weight"), "%s", ds4_errmsg());
        ds4_model_dir_close(d);
    }
    /* ... and converts back to official names: the same bytes as the direct F32 conversion */
    const char *back = tpath("q_back"), *direct = tpath("q_f32");
    CHECK(convert(hf, back, DS4_F32, false, &r) == DS4_OK, "%s", ds4_errmsg());
    CHECK(convert(in, direct, DS4_F32, false, &r) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_dir *a = NULL, *b = NULL;
    CHECK(ds4_model_dir_open(back, &a) == DS4_OK && ds4_model_dir_open(direct, &b) == DS4_OK);
    int64_t na = 0, nb = 0, diff = 0;
    for (int64_t i = 0; a && b && i < ds4_model_dir_nfiles(b); i++) {
        const ds4_st_file *fb = ds4_model_dir_file(b, i);
        for (int64_t k = 0; k < ds4_st_count(fb); k++) {
            const ds4_st_entry *eb = ds4_st_entry_at(fb, k), *ea;
            const ds4_st_file *fa = ds4_model_dir_find(a, eb->name, &ea);
            nb++;
            diff += !fa || ea->dtype != eb->dtype || ea->end - ea->begin != eb->end - eb->begin ||
                    memcmp(ds4_st_bytes(fa, ea), ds4_st_bytes(fb, eb), eb->end - eb->begin) != 0;
        }
    }
    for (int64_t i = 0; a && i < ds4_model_dir_nfiles(a); i++) na += ds4_st_count(ds4_model_dir_file(a, i));
    CHECK(diff == 0 && na == nb && nb == 10, "%lld differ, %lld vs %lld tensors", (long long)diff, (long long)na, (long long)nb);
    ds4_model_dir_close(a);
    ds4_model_dir_close(b);
}

/* A tensor big enough for several chunks whose boundaries fall inside FP8 block rows. */
static void test_convert_chunks(void) {
    const char *in = tpath("big_in");
    mkdir(in, 0755);
    write_config(in, true);
    enum { R = 1500, C = 3000 };   /* CHUNK / C = 1398 rows: the second chunk starts at row 1398 */
    uint8_t *w = malloc((size_t)R * C);
    uint8_t s[12 * 24];
    for (int64_t i = 0; i < (int64_t)R * C; i++) w[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (int i = 0; i < 12 * 24; i++) s[i] = (uint8_t)(118 + i % 17);
    ds4_st_writer *wr;
    ds4_st_writer_new(&wr);
    int64_t sw[2] = {R, C}, ss[2] = {12, 24};
    ds4_st_writer_add(wr, "layers.0.attn.wo_a.weight", DS4_F8_E4M3, 2, sw, w);
    ds4_st_writer_add(wr, "layers.0.attn.wo_a.scale", DS4_F8_E8M0, 2, ss, s);
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    CHECK(ds4_st_writer_write(wr, p) == DS4_OK);
    ds4_st_writer_free(wr);
    const char *out = tpath("big_out");
    ds4_convert_report r;
    CHECK(convert(in, out, DS4_F32, false, &r) == DS4_OK, "%s", ds4_errmsg());
    CHECK(r.bytes_in == (uint64_t)R * C + 12 * 24 && r.bytes_out == (uint64_t)R * C * 4);
    float *o = malloc((size_t)R * C * 4);
    CHECK(read_dir(out, "layers.0.attn.wo_a.weight", R, C, o));
    int64_t bad = 0;
    for (int64_t i = 0; i < R; i++)
        for (int64_t j = 0; j < C; j++) bad += !same_float(o[i * C + j], ref_fp8(w, s, C, i, j));
    CHECK(bad == 0, "%lld values differ", (long long)bad);
    free(o);
    free(w);
}

static void file_id(const char *p, struct stat *st) {
    memset(st, 0, sizeof *st);
    stat(p, st);
}

/* A conversion stopped after its shards, before config.json (a folder in its way): its progress file
 * records every shard, as a run killed at that point leaves it. */
static void interrupted(const char *in, const char *out, ds4_dtype dt, bool hf) {
    char cfg[600], block[700];
    snprintf(cfg, sizeof cfg, "%s/config.json", out);
    snprintf(block, sizeof block, "%s/x", cfg);
    unlink(cfg);
    CHECK(mkdir(out, 0755) == 0 || errno == EEXIST);
    CHECK(mkdir(cfg, 0755) == 0);
    write_bytes(block, "x", 1);
    ds4_convert_report r;
    CHECK(convert(in, out, dt, hf, &r) != DS4_OK);
    unlink(block);
    rmdir(cfg);
}

static void test_resume(void) {
    const char *in = tpath("r_in"), *out = tpath("r_out");
    make_quant_dir(in);
    ds4_convert_report r;
    char s1[600], s2[600], prog[600];
    snprintf(s1, sizeof s1, "%s/model-00001-of-00002.safetensors", out);
    snprintf(s2, sizeof s2, "%s/model-00002-of-00002.safetensors", out);
    snprintf(prog, sizeof prog, "%s/.ds4-convert-progress.json", out);
    interrupted(in, out, DS4_BF16, false);
    struct stat a1, a2, b1, b2;
    file_id(s1, &a1);
    file_id(s2, &a2);
    CHECK(access(prog, R_OK) == 0);
    /* every shard done: nothing rewritten, config.json written, the progress file gone */
    CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK && r.shards_skipped == 2 && r.tensors == 0 && r.bytes_out == 0);
    file_id(s1, &b1);
    file_id(s2, &b2);
    CHECK(a1.st_ino == b1.st_ino && a2.st_ino == b2.st_ino);
    CHECK(access(prog, F_OK) != 0, "a finished directory keeps no %s", prog);
    /* a finished directory is converted anew */
    CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK && r.shards_skipped == 0 && access(prog, F_OK) != 0);
    /* a shard lost (as if the run died before it) and a stale temp file: only that shard is redone */
    interrupted(in, out, DS4_BF16, false);
    file_id(s1, &a1);
    unlink(s2);
    char tmp[700];
    snprintf(tmp, sizeof tmp, "%s.tmp.999999.0", s2);
    write_bytes(tmp, "partial", 7);
    CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK && r.shards_skipped == 1 && r.tensors == 6, "%lld skipped",
          (long long)r.shards_skipped);
    CHECK(access(tmp, F_OK) != 0 && access(s2, R_OK) == 0);
    file_id(s1, &b1);
    CHECK(a1.st_ino == b1.st_ino);
    /* a damaged shard (size no longer matches) is redone */
    interrupted(in, out, DS4_BF16, false);
    CHECK(truncate(s1, 100) == 0);
    CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK && r.shards_skipped == 1 && r.tensors == 4);
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(out, &d) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_dir_close(d);
    /* a shard whose header does not match the plan (same size, other content) is redone */
    {
        interrupted(in, out, DS4_BF16, false);
        char *img;
        size_t n;
        CHECK(ds4_read_file(s1, &img, &n) == DS4_OK);
        char *at = img ? memmem(img, n, "embed.weight", 12) : NULL;
        if (at) at[0] = 'E';
        if (img) write_bytes(s1, img, n);
        ds4_free(img);
        CHECK(convert(in, out, DS4_BF16, false, &r) == DS4_OK && r.shards_skipped == 1 && r.tensors == 4);
    }
    /* other options: everything redone */
    interrupted(in, out, DS4_BF16, false);
    CHECK(convert(in, out, DS4_F32, false, &r) == DS4_OK && r.shards_skipped == 0 && r.tensors == 10);
    interrupted(in, out, DS4_F32, false);
    CHECK(convert(in, out, DS4_F32, true, &r) == DS4_OK && r.shards_skipped == 0);
    /* the source shard changed (new mtime): redone */
    interrupted(in, out, DS4_F32, true);
    CHECK(convert(in, out, DS4_F32, true, &r) == DS4_OK && r.shards_skipped == 2);
    interrupted(in, out, DS4_F32, true);
    char src[600];
    snprintf(src, sizeof src, "%s/model-00001-of-00002.safetensors", in);
    struct timespec ts[2] = {{.tv_sec = 1000000000}, {.tv_sec = 1000000000}};
    utimensat(AT_FDCWD, src, ts, 0);
    CHECK(convert(in, out, DS4_F32, true, &r) == DS4_OK && r.shards_skipped == 1);
    /* input and output the same directory: refused */
    CHECK(convert(in, in, DS4_F32, true, &r) == DS4_ERR_ARG && msg_has("input directory"));
    ds4_convert_opts bad = {.in_dir = in, .out_dir = out, .dtype = DS4_F16};
    CHECK(ds4_convert(&bad, &r) == DS4_ERR_ARG && msg_has("F16"));
}

/* A full tiny model: official -> HF -> model load gives the same parameters as the original. */
static void test_hf_model_roundtrip(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-b.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m, *m2;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    ds4_model_init_random(m, 7);
    const char *dir = tpath("tiny_off"), *hf = tpath("tiny_hf");
    CHECK(ds4_model_save(m, dir, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    ds4_convert_report r;
    CHECK(convert(dir, hf, DS4_F32, true, &r) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(hf, &d) == DS4_OK, "%s", ds4_errmsg());
    if (!d) {
        ds4_model_free(m);
        return;
    }
    /* no official name outside MTP is stored */
    int official = 0;
    for (int64_t k = 0; k < ds4_st_count(ds4_model_dir_file(d, 0)); k++) {
        const char *nm = ds4_st_entry_at(ds4_model_dir_file(d, 0), k)->name;
        official += strncmp(nm, "model.", 6) != 0 && strcmp(nm, "lm_head.weight") != 0 && strncmp(nm, "mtp.0.", 6) != 0;
    }
    CHECK(official == 0, "%d official names left", official);
    CHECK(ds4_model_create(NULL, &c, false, &m2) == DS4_OK);
    CHECK(ds4_model_load(m2, d) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(ds4_model_params_flat(m), ds4_model_params_flat(m2), (size_t)ds4_model_numel(m) * 4) == 0);
    int tid = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i), *q = ds4_model_param(m2, i);
        if (p->is_int) tid += memcmp(p->idata, q->idata, (size_t)p->numel * 8) != 0;
    }
    CHECK(tid == 0);
    /* check passes on both layouts */
    int64_t np;
    CHECK(ds4_model_dir_check(d, NULL, NULL, &np) == DS4_OK && np == 0, "%lld problems", (long long)np);
    ds4_model_dir_close(d);
    ds4_model_free(m2);
    ds4_model_free(m);
}

/* An HF-named FP8 weight with an F32 `weight_scale_inv` sibling loads under its official name and
 * converts to an official-named tensor with no scale left. */
static void test_hf_scale_inv(void) {
    const char *in = tpath("hf_inv");
    mkdir(in, 0755);
    write_config(in, true);
    enum { R = 130, C = 6 };
    uint8_t w[R * C];
    for (int i = 0; i < R * C; i++) w[i] = (uint8_t)(i * 7 + 1);
    float sc[2] = {0.25f, 3.0f};
    ds4_st_writer *wr;
    ds4_st_writer_new(&wr);
    int64_t sw[2] = {R, C}, ss[2] = {2, 1};
    ds4_st_writer_add(wr, "model.layers.0.self_attn.q_a_proj.weight", DS4_F8_E4M3, 2, sw, w);
    ds4_st_writer_add(wr, "model.layers.0.self_attn.q_a_proj.weight_scale_inv", DS4_F32, 2, ss, sc);
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    CHECK(ds4_st_writer_write(wr, p) == DS4_OK);
    ds4_st_writer_free(wr);
    float out[R * C];
    CHECK(read_dir(in, "layers.0.attn.wq_a.weight", R, C, out));
    int bad = 0;
    for (int i = 0; i < R * C; i++) bad += !same_float(out[i], ds4_e4m3_to_f32(w[i]) * sc[i / C / 128]);
    CHECK(bad == 0, "%d values differ", bad);
    const char *o = tpath("hf_inv_out");
    ds4_convert_report r;
    CHECK(convert(in, o, DS4_F32, false, &r) == DS4_OK && r.tensors == 1, "%s", ds4_errmsg());
    float out2[R * C];
    CHECK(read_dir(o, "layers.0.attn.wq_a.weight", R, C, out2) && memcmp(out, out2, sizeof out) == 0);
}

/* ---------------------------------------------------------------- export */

/* The tensors DeepSeek's checkpoint and Hugging Face keep in F32 (official names). */
static bool is_f32_param(const char *name) {
    const char *suffix[] = {"_fn", "_base", "_scale", ".attn_sink", ".ape", ".ffn.gate.bias"};
    for (int i = 0; i < 6; i++) {
        size_t n = strlen(name), k = strlen(suffix[i]);
        if (n >= k && !strcmp(name + n - k, suffix[i]) && (i >= 3 || strncmp(name, "hc_", 3) == 0 || strstr(name, ".hc_")))
            return true;
    }
    return false;
}

static void test_export(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-a.json"), &c) == DS4_OK);
    ds4_model *m;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    ds4_model_init_random(m, 11);
    const char *ck = tpath("ckpt");
    CHECK(ds4_model_save(m, ck, DS4_F32) == DS4_OK);
    char p[600];
    snprintf(p, sizeof p, "%s/optim.state", ck);
    write_bytes(p, "moments", 7);
    snprintf(p, sizeof p, "%s/state.json", ck);
    write_bytes(p, "{\"step\": 3}", 11);
    /* an optimizer file in safetensors form, whose names collide with the model's */
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    float z[4] = {0};
    int64_t s4[1] = {4};
    ds4_st_writer_add(w, "norm.weight", DS4_F32, 1, s4, z);
    snprintf(p, sizeof p, "%s/optim.safetensors", ck);
    ds4_st_writer_write(w, p);
    ds4_st_writer_free(w);
    const char *out = tpath("exported");
    ds4_convert_opts o = {.in_dir = ck, .out_dir = out, .dtype = DS4_BF16, .hf_names = true, .model_shards_only = true};
    ds4_convert_report r;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/optim.state", out);
    CHECK(access(p, F_OK) != 0);
    snprintf(p, sizeof p, "%s/state.json", out);
    CHECK(access(p, F_OK) != 0);
    snprintf(p, sizeof p, "%s/optim.safetensors", out);
    CHECK(access(p, F_OK) != 0);
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(out, &d) == DS4_OK, "%s", ds4_errmsg());
    if (d) {
        CHECK(ds4_model_dir_nfiles(d) == 1 && ds4_model_dir_find(d, "model.layers.1.mlp.experts.gate_up_proj", NULL));
        ds4_model *m2;
        CHECK(ds4_model_create(NULL, &c, false, &m2) == DS4_OK);
        CHECK(ds4_model_load(m2, d) == DS4_OK, "%s", ds4_errmsg());
        int bad = 0;
        for (int64_t k = 0; k < ds4_model_nparams(m); k++) {
            const ds4_param *a = ds4_model_param(m, k), *b = ds4_model_param(m2, k);
            bool f32 = is_f32_param(a->name);
            for (int64_t i = 0; !a->is_int && i < a->numel; i++)
                bad += b->data[i] != (f32 ? a->data[i] : ds4_bf16_to_f32(ds4_f32_to_bf16(a->data[i])));
        }
        CHECK(bad == 0, "%d parameters differ from bf16(original) (the mHC, sink, ape and router-bias ones: original)", bad);
        ds4_model_free(m2);
        ds4_model_dir_close(d);
    }
    /* a plain convert of the same folder would also read optim.safetensors and fail on the duplicate */
    o.model_shards_only = false;
    o.out_dir = tpath("exported2");
    CHECK(ds4_convert(&o, &r) == DS4_ERR_FORMAT && msg_has("two shards"), "%s", ds4_errmsg());
    ds4_model_free(m);
}

/* ---------------------------------------------------------------- check */

typedef struct {
    char lines[64][256];
    int n;
} problems;

static void on_problem(void *ctx, const char *what, const char *name, const char *detail) {
    problems *p = ctx;
    if (p->n < 64) snprintf(p->lines[p->n++], 256, "%s %s %s", what, name, detail);
}

static bool has_line(const problems *p, const char *a, const char *b) {
    for (int i = 0; i < p->n; i++)
        if (strstr(p->lines[i], a) && (!b || strstr(p->lines[i], b))) return true;
    return false;
}

static void test_check(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-a.json"), &c) == DS4_OK);
    ds4_model *m;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    const char *dir = tpath("chk");
    CHECK(ds4_model_save(m, dir, DS4_BF16) == DS4_OK);
    ds4_model_dir *d;
    int64_t n;
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK && ds4_model_dir_check(d, NULL, NULL, &n) == DS4_OK && n == 0);
    ds4_model_dir_close(d);
    /* rewrite with: one tensor missing, one of the wrong shape, an int table stored as float, an extra
     * tensor, and an FP8 weight whose scale has the wrong shape */
    ds4_st_writer *w;
    float z[64] = {0};
    uint8_t q[64 * 64] = {0};
    int64_t s1[1] = {3}, sq[2] = {64, 64}, ss[2] = {2, 2};
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    ds4_st_writer_new(&w);
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *pp = ds4_model_param(m, i);
        if (!strcmp(pp->name, "layers.2.attn.wkv.weight")) continue;
        int64_t sh[3] = {pp->shape[0], pp->shape[1], pp->shape[2]};
        if (!strcmp(pp->name, "layers.1.ffn.experts.3.w2.weight")) sh[1] -= 1;
        if (!strcmp(pp->name, "mtp.0.e_proj.weight")) {
            ds4_st_writer_add(w, pp->name, DS4_F8_E4M3, 2, sq, q);
            continue;
        }
        if (pp->is_int) ds4_st_writer_add(w, pp->name, DS4_F32, pp->ndim, sh, pp->idata);
        else ds4_st_writer_add(w, pp->name, DS4_F32, pp->ndim, sh, pp->data);
    }
    ds4_st_writer_add(w, "junk.extra", DS4_F32, 1, s1, z);
    ds4_st_writer_add(w, "mtp.0.e_proj.scale", DS4_F8_E8M0, 2, ss, q);
    CHECK(ds4_st_writer_write(w, p) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    problems pr = {0};
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (d) {
        CHECK(ds4_model_dir_check(d, on_problem, &pr, &n) == DS4_OK);
        CHECK(n == 5 && pr.n == 5, "%lld problems", (long long)n);   /* the bad pair is reported once, not as extras */
        CHECK(has_line(&pr, "missing layers.2.attn.wkv.weight", "[32, 64]"));
        CHECK(has_line(&pr, "shape layers.1.ffn.experts.3.w2.weight", "[64, 31]"));
        CHECK(has_line(&pr, "dtype layers.0.ffn.gate.tid2eid", "I32 or I64"));
        CHECK(has_line(&pr, "extra junk.extra", NULL));
        CHECK(has_line(&pr, "bad mtp.0.e_proj.weight", "scale"));
        for (int i = 0; n != 5 && i < pr.n; i++) t_note("  %s", pr.lines[i]);
        ds4_model_dir_close(d);
    }
    ds4_model_free(m);
}

/* ---------------------------------------------------------------- corrupt files */

static void test_corrupt(void) {
    ds4_convert_report r;
    char p[600];
    /* 1. a shard the index names is missing */
    const char *in = tpath("c_noshard");
    make_quant_dir(in);
    snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", in);
    unlink(p);
    CHECK(convert(in, tpath("c_out1"), DS4_BF16, false, &r) == DS4_ERR_IO && msg_has("model-00002-of-00002.safetensors"), "%s",
          ds4_errmsg());
    /* 2. the index names a tensor no shard holds */
    in = tpath("c_ghost");
    make_quant_dir(in);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", in);
    cJSON *j;
    CHECK(read_json(p, &j));
    cJSON_AddStringToObject(cJSON_GetObjectItemCaseSensitive(j, "weight_map"), "layers.0.attn.wkv.weight", "model-00001-of-00002.safetensors");
    char *t = cJSON_Print(j);
    write_bytes(p, t, strlen(t));
    cJSON_free(t);
    cJSON_Delete(j);
    CHECK(convert(in, tpath("c_out2"), DS4_BF16, false, &r) == DS4_ERR_FORMAT && msg_has("'layers.0.attn.wkv.weight'") &&
          msg_has("no shard holds it"), "%s", ds4_errmsg());
    /* 3. a scale whose shape does not match its weight: named, with both shapes; nothing written */
    in = tpath("c_scale");
    mkdir(in, 0755);
    write_config(in, true);
    uint8_t w8[200 * 130] = {0}, s8[4] = {127, 127, 127, 127};
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    int64_t sw[2] = {200, 130}, ss[2] = {2, 1};
    ds4_st_writer_add(w, "layers.0.attn.wq_b.weight", DS4_F8_E4M3, 2, sw, w8);
    ds4_st_writer_add(w, "layers.0.attn.wq_b.scale", DS4_F8_E8M0, 2, ss, s8);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    ds4_st_writer_write(w, p);
    ds4_st_writer_free(w);
    const char *o3 = tpath("c_out3");
    CHECK(convert(in, o3, DS4_BF16, false, &r) == DS4_ERR_SHAPE && msg_has("'layers.0.attn.wq_b.scale'") && msg_has("[2, 1]") &&
          msg_has("[2, 2]") && msg_has(p), "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/model.safetensors", o3);
    CHECK(access(p, F_OK) != 0);
    /* 4. a header length over 100 MB (sparse file, so the test stays small) */
    in = tpath("c_big");
    mkdir(in, 0755);
    write_config(in, false);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    uint64_t hl = 150ull * 1000 * 1000;
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)(hl >> (8 * i));
    CHECK(fd >= 0 && write(fd, len8, 8) == 8 && ftruncate(fd, (off_t)(hl + 64)) == 0);
    close(fd);
    CHECK(convert(in, tpath("c_out4"), DS4_BF16, false, &r) == DS4_ERR_FORMAT && msg_has("100 MB") && msg_has(p), "%s", ds4_errmsg());
    /* 5. overlapping data offsets */
    in = tpath("c_overlap");
    mkdir(in, 0755);
    write_config(in, false);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    const char *hdr = "{\"norm.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                      "\"head.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}";
    size_t hn = strlen(hdr);
    uint8_t *img = calloc(1, 8 + hn + 24);
    for (int i = 0; i < 8; i++) img[i] = (uint8_t)((uint64_t)hn >> (8 * i));
    memcpy(img + 8, hdr, hn);
    write_bytes(p, img, 8 + hn + 24);
    free(img);
    CHECK(convert(in, tpath("c_out5"), DS4_BF16, false, &r) == DS4_ERR_FORMAT && msg_has("overlap") && msg_has("'head.weight'") &&
          msg_has("'norm.weight'"), "%s", ds4_errmsg());
    /* 6. an HF fused expert tensor with an expert part missing from the official side cannot fuse */
    in = tpath("c_fuse");
    mkdir(in, 0755);
    write_config(in, false);
    float z[4 * 8] = {0};
    int64_t sx[2] = {4, 8};
    ds4_st_writer_new(&w);
    ds4_st_writer_add(w, "layers.0.ffn.experts.0.w1.weight", DS4_F32, 2, sx, z);
    ds4_st_writer_add(w, "layers.0.ffn.experts.0.w3.weight", DS4_F32, 2, sx, z);
    ds4_st_writer_add(w, "layers.0.ffn.experts.1.w1.weight", DS4_F32, 2, sx, z);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    ds4_st_writer_write(w, p);
    ds4_st_writer_free(w);
    CHECK(convert(in, tpath("c_out6"), DS4_BF16, true, &r) == DS4_ERR_MISSING && msg_has("gate_up_proj") && msg_has("expert 1"), "%s",
          ds4_errmsg());
    /* 7. both layouts of one tensor in a directory */
    in = tpath("c_both");
    mkdir(in, 0755);
    write_config(in, false);
    ds4_st_writer_new(&w);
    int64_t s4[1] = {4};
    ds4_st_writer_add(w, "norm.weight", DS4_F32, 1, s4, z);
    ds4_st_writer_add(w, "model.norm.weight", DS4_F32, 1, s4, z);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    ds4_st_writer_write(w, p);
    ds4_st_writer_free(w);
    CHECK(convert(in, tpath("c_out7"), DS4_BF16, false, &r) == DS4_ERR_FORMAT && msg_has("'norm.weight'") &&
          msg_has("'model.norm.weight'"), "%s", ds4_errmsg());
}

/* ---------------------------------------------------------------- export: transformers config keys */

static bool json_has(const cJSON *r, const char *k) { return cJSON_GetObjectItemCaseSensitive(r, k) != NULL; }

/* Exact parameter and integer-table equality of two models of one config. */
static int params_differ(ds4_model *a, ds4_model *b) {
    int bad = memcmp(ds4_model_params_flat(a), ds4_model_params_flat(b), (size_t)ds4_model_numel(a) * 4) != 0;
    for (int64_t i = 0; i < ds4_model_nparams(a); i++) {
        ds4_param *p = ds4_model_param(a, i), *q = ds4_model_param(b, i);
        if (p->is_int) bad += memcmp(p->idata, q->idata, (size_t)p->numel * 8) != 0;
    }
    return bad;
}

/* The model in `dir` has config c (memcmp) and loads to the parameters of m (bitwise). `hf`: its
 * config.json is in the transformers spelling, else in DeepSeek's. */
static void check_loads_back(const char *dir, bool hf, const ds4_config *c, ds4_model *m) {
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", dir);
    cJSON *r;
    CHECK(read_json(p, &r));
    if (!r) return;
    bool hf_keys = json_has(r, "layer_types") && json_has(r, "compress_rates") && json_has(r, "mlp_layer_types") &&
                   json_has(r, "partial_rotary_factor") && json_has(r, "rope_parameters");
    bool ds_keys = json_has(r, "compress_ratios") || json_has(r, "num_hash_layers") || json_has(r, "qk_rope_head_dim") ||
                   json_has(r, "rope_scaling");
    /* official names: DeepSeek's keys, plus layer_types + compress_rates for transformers (which maps only
     * the compress ratios 4 and 128) */
    bool official = ds_keys && json_has(r, "compress_ratios") && json_has(r, "layer_types") == json_has(r, "compress_rates") &&
                    !json_has(r, "mlp_layer_types") && !json_has(r, "partial_rotary_factor") && !json_has(r, "rope_parameters");
    CHECK(hf ? hf_keys && !ds_keys : official, "%s: config.json in the wrong spelling", dir);
    if (hf) CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(r, "model_type")->valuestring, "deepseek_v4"));
    cJSON_Delete(r);
    ds4_config back;
    CHECK(ds4_config_load(p, &back) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(c, &back, sizeof back) == 0, "%s: config differs after export", dir);
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (!d) return;
    ds4_model *m2;
    CHECK(ds4_model_create(NULL, ds4_model_dir_config(d), false, &m2) == DS4_OK);
    CHECK(ds4_model_load(m2, d) == DS4_OK, "%s", ds4_errmsg());
    CHECK(params_differ(m, m2) == 0, "%s: parameters differ", dir);
    int64_t np;
    CHECK(ds4_model_dir_check(d, NULL, NULL, &np) == DS4_OK && np == 0, "%lld problems", (long long)np);
    ds4_model_free(m2);
    ds4_model_dir_close(d);
}

/* ds4 export --names hf writes the transformers config spelling, and the export loads back (config
 * and every tensor) to the same model; converting it back with official names returns DeepSeek's
 * spelling. A config the transformers spelling cannot carry fails before any shard is written. */
static void test_export_hf_config(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-a.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    ds4_model_init_random(m, 23);
    const char *ck = tpath("hfc_ckpt"), *hf = tpath("hfc_hf"), *off = tpath("hfc_off");
    CHECK(ds4_model_save(m, ck, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    ds4_convert_opts o = {.in_dir = ck, .out_dir = hf, .dtype = DS4_F32, .hf_names = true, .model_shards_only = true};
    ds4_convert_report r;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    check_loads_back(hf, true, &c, m);
    CHECK(convert(hf, off, DS4_F32, false, &r) == DS4_OK, "%s", ds4_errmsg());
    check_loads_back(off, false, &c, m);
    {   /* one HCA rate: layer_types + compress_rates beside compress_ratios, so transformers reads the ratio */
        char p[600];
        cJSON *j = NULL;
        snprintf(p, sizeof p, "%s/config.json", off);
        CHECK(read_json(p, &j) && json_has(j, "layer_types") && json_has(j, "compress_rates"), "%s: no layer_types", off);
        cJSON_Delete(j);
    }
    ds4_model_free(m);

    /* HCA layers of two ratios */
    c.compress_ratios[3] = 8;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    ds4_model_init_random(m, 24);
    const char *ck2 = tpath("hfc_ckpt2"), *hf2 = tpath("hfc_hf2");
    CHECK(ds4_model_save(m, ck2, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    o.in_dir = ck2, o.out_dir = hf2;
    CHECK(ds4_convert(&o, &r) == DS4_ERR_CONFIG && msg_has("config.json") && msg_has("one rate"), "%s", ds4_errmsg());
    char p[600];
    snprintf(p, sizeof p, "%s/config.json", hf2);
    CHECK(access(p, F_OK) != 0);
    snprintf(p, sizeof p, "%s/model.safetensors", hf2);
    CHECK(access(p, F_OK) != 0, "a shard was written before the config failed");
    /* official names keep DeepSeek's spelling, which carries it (and no layer_types, which cannot) */
    o.hf_names = false;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    check_loads_back(hf2, false, &c, m);
    snprintf(p, sizeof p, "%s/config.json", hf2);
    cJSON *j = NULL;
    CHECK(read_json(p, &j) && !json_has(j, "layer_types"), "%s: layer_types for two HCA rates", hf2);
    cJSON_Delete(j);
    ds4_model_free(m);
}

/* ds4 export --names hf --dtype bf16: the mHC fn/base/scale, sinks, compressor ape and router bias
 * are F32 with ds4's exact bits (under their HF names), the rest BF16; config.json has `dtype`, a
 * float swiglu_limit and none of ds4's own keys; ds4 loads the export back. */
static void test_export_hf_keeps_f32(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_file("tests/configs/tiny-a.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m;
    if (ds4_model_create(NULL, &c, false, &m) != DS4_OK) return;
    ds4_model_init_random(m, 29);
    /* move the parameters init leaves at 0 or 1 off values bf16 holds exactly */
    int64_t n_f32 = 0;
    for (int64_t k = 0; k < ds4_model_nparams(m); k++) {
        ds4_param *p = ds4_model_param(m, k);
        if (p->is_int || !is_f32_param(p->name)) continue;
        n_f32++;
        for (int64_t i = 0; i < p->numel; i++) p->data[i] += 1.0f / 3.0f + 1e-3f * (float)i;
    }
    /* 5 blocks x (6 mHC + sink) + 3 compressor ape + 2 indexer ape + 4 router biases + 2 x 3 head mHC */
    CHECK(n_f32 == 5 * 7 + 3 + 2 + 4 + 6, "%lld F32 tensors", (long long)n_f32);
    const char *ck = tpath("f32_ckpt"), *hf = tpath("f32_hf");
    CHECK(ds4_model_save(m, ck, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    ds4_convert_opts o = {.in_dir = ck, .out_dir = hf, .dtype = DS4_BF16, .hf_names = true, .model_shards_only = true};
    ds4_convert_report r;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    char p[600];
    snprintf(p, sizeof p, "%s/model.safetensors", hf);
    ds4_st_file *f;
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    int64_t seen = 0, wrong = 0;
    for (int64_t k = 0; f && k < ds4_model_nparams(m); k++) {
        const ds4_param *pr = ds4_model_param(m, k);
        ds4_hf_ref ref;
        if (pr->is_int || !ds4_name_to_hf(pr->name, &ref) || ref.expert >= 0) continue;
        const ds4_st_entry *e = ds4_st_find(f, ref.name);
        if (!e) continue;
        if (is_f32_param(pr->name)) {
            seen++;
            bool same = e->dtype == DS4_F32 && memcmp(ds4_st_bytes(f, e), pr->data, (size_t)pr->numel * 4) == 0;
            wrong += !same;
            if (!same) t_note("  %s (%s): %s", ref.name, pr->name, ds4_dtype_name(e->dtype));
        } else wrong += e->dtype != DS4_BF16;
    }
    CHECK(wrong == 0 && seen == n_f32 - 11, "%lld wrong of %lld F32 tensors (the 11 of MTP keep their names)", (long long)wrong,
          (long long)seen);
    const ds4_st_entry *e = f ? ds4_st_find(f, "mtp.0.hc_head_fn") : NULL;
    CHECK(e && e->dtype == DS4_F32);
    e = f ? ds4_st_find(f, "model.layers.1.self_attn.compressor.position_bias") : NULL;
    CHECK(e && e->dtype == DS4_F32);
    ds4_st_close(f);
    /* config.json */
    snprintf(p, sizeof p, "%s/config.json", hf);
    char *text = NULL;
    size_t len = 0;
    CHECK(ds4_read_file(p, &text, &len) == DS4_OK);
    cJSON *cfg = text ? cJSON_Parse(text) : NULL;
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(cfg, "dtype");
    CHECK(cJSON_IsString(dt) && !strcmp(dt->valuestring, "bfloat16"));
    const char *gone[] = {"torch_dtype", "mtp_loss_weight", "indexer_loss_coeff", "csa_dense"};
    for (int i = 0; i < 4; i++) CHECK(!cJSON_GetObjectItemCaseSensitive(cfg, gone[i]), "config.json has %s", gone[i]);
    CHECK(text && strstr(text, "\"swiglu_limit\":\t10.0"), "swiglu_limit not written as 10.0");
    cJSON_Delete(cfg);
    ds4_free(text);
    /* ds4 loads it back: the F32 tensors exactly, the others as bf16 */
    ds4_model_dir *d;
    CHECK(ds4_model_dir_open(hf, &d) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m2 = NULL;
    if (d) {
        CHECK(memcmp(ds4_model_dir_config(d), &c, sizeof c) == 0, "the config reads back differently");
        CHECK(ds4_model_create(NULL, ds4_model_dir_config(d), false, &m2) == DS4_OK);
        CHECK(m2 && ds4_model_load(m2, d) == DS4_OK, "%s", ds4_errmsg());
        ds4_model_dir_close(d);
    }
    int64_t bad = 0;
    for (int64_t k = 0; m2 && k < ds4_model_nparams(m); k++) {
        const ds4_param *a = ds4_model_param(m, k), *b = ds4_model_param(m2, k);
        for (int64_t i = 0; !a->is_int && i < a->numel; i++)
            bad += b->data[i] != (is_f32_param(a->name) ? a->data[i] : ds4_bf16_to_f32(ds4_f32_to_bf16(a->data[i])));
    }
    CHECK(bad == 0, "%lld values differ after the round trip", (long long)bad);
    ds4_model_free(m2);
    ds4_model_free(m);
    /* a model that needs csa_dense cannot be exported under HF names */
    snprintf(p, sizeof p, "%s/config.json", ck);
    CHECK(ds4_read_file(p, &text, &len) == DS4_OK);
    cfg = text ? cJSON_Parse(text) : NULL;
    ds4_free(text);
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "csa_dense", cJSON_CreateTrue());
    text = cJSON_Print(cfg);
    write_bytes(p, text, strlen(text));
    cJSON_free(text);
    cJSON_Delete(cfg);
    o.out_dir = tpath("f32_hf_dense");
    CHECK(ds4_convert(&o, &r) == DS4_ERR_UNSUPPORTED && msg_has("csa_dense") && msg_has("config.json"), "%s", ds4_errmsg());
}

static void test_no_leaks(void) {
    ds4_mem_stats m;
    ds4_mem_get(&m);
    CHECK(m.live_total == 0, "%lld bytes still live", (long long)m.live_total);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftwb) {
    (void)sb, (void)flag, (void)ftwb;
    return remove(p);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_convert_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(test_names);
    RUN(test_names_cover_config);
    RUN(test_expected_tensors);
    RUN(test_dspark_table);
    RUN(test_dspark_release_dir);
    RUN(test_stream_writer);
    RUN(test_row_reads);
    RUN(test_convert_quantized);
    RUN(test_convert_chunks);
    RUN(test_resume);
    RUN(test_hf_model_roundtrip);
    RUN(test_hf_scale_inv);
    RUN(test_export);
    RUN(test_check);
    RUN(test_corrupt);
    RUN(test_export_hf_config);
    RUN(test_export_hf_keeps_f32);
    RUN(test_no_leaks);
    if (!getenv("DS4_TEST_KEEP")) nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_MAIN_END("test_convert");
}
