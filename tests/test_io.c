/* IO tests: safetensors writer -> reader for every dtype, every malformed-header case, truncation,
 * model directories with shards and an index, atomic writes, config.json parsing / validation /
 * save round trip, a deterministic mutation fuzz of both parsers, and the transformers spelling of
 * config.json (same struct as DeepSeek's, its own errors, respelling both ways). */
#include "ds4/io.h"
#include "test.h"
#include "test_files.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];   /* per-run temp directory */

static const char *tpath(const char *name) {
    static char buf[8][512];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { fprintf(stderr, "cannot write %s\n", path); return; }
    if (n) fwrite(data, 1, n, f);
    fclose(f);
}

/* A safetensors file from a header string, with a given header length field and data bytes. */
static void write_st_raw(const char *path, const char *header, uint64_t len_field, const void *data, size_t dlen) {
    size_t hl = strlen(header);
    uint8_t *buf = malloc(8 + hl + dlen + 1);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(len_field >> (8 * i));
    memcpy(buf + 8, header, hl);
    if (dlen) memcpy(buf + 8 + hl, data, dlen);
    write_bytes(path, buf, 8 + hl + dlen);
    free(buf);
}
static void write_st(const char *path, const char *header, size_t dlen) {
    uint8_t *data = calloc(1, dlen + 1);
    write_st_raw(path, header, strlen(header), data, dlen);
    free(data);
}

static bool msg_has(const char *s) { return strstr(ds4_errmsg(), s) != NULL; }

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftwb) {
    (void)sb, (void)flag, (void)ftwb;
    return remove(p);
}

/* ---------------------------------------------------------------- safetensors round trip */

static void test_roundtrip_all_dtypes(void) {
    ds4_st_writer *w;
    CHECK(ds4_st_writer_new(&w) == DS4_OK);
    int64_t shape[2] = {3, 5};
    uint8_t bytes[DS4_DTYPE_COUNT][15 * 8];
    char names[DS4_DTYPE_COUNT][32];
    for (int t = 0; t < DS4_DTYPE_COUNT; t++) {
        for (int i = 0; i < (int)sizeof bytes[t]; i++) bytes[t][i] = (uint8_t)(t * 31 + i * 7 + 1);
        snprintf(names[t], sizeof names[t], "t.%s", ds4_dtype_name((ds4_dtype)t));
        CHECK(ds4_st_writer_add(w, names[t], (ds4_dtype)t, 2, shape, bytes[t]) == DS4_OK, "%s", ds4_errmsg());
    }
    /* exact float values for the typed reads */
    float f32[15];
    uint16_t bf[15], h16[15];
    int32_t i32[15];
    int64_t i64[15];
    for (int i = 0; i < 15; i++) {
        f32[i] = (float)i * 0.25f - 1.5f;
        bf[i] = ds4_f32_to_bf16(f32[i]);
        h16[i] = (uint16_t)(i == 0 ? 0 : 0x3c00 + i * 64);  /* 1.0, 1.0625, ... */
        i32[i] = -7 + i * 1000;
        i64[i] = (int64_t)1 << (40 + i % 20);
    }
    CHECK(ds4_st_writer_add(w, "f32", DS4_F32, 2, shape, f32) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "bf16", DS4_BF16, 2, shape, bf) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "f16", DS4_F16, 2, shape, h16) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "i32", DS4_I32, 2, shape, i32) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "i64", DS4_I64, 2, shape, i64) == DS4_OK);
    float scalar = 3.5f;
    CHECK(ds4_st_writer_add(w, "scalar", DS4_F32, 0, NULL, &scalar) == DS4_OK);
    int64_t eshape[2] = {0, 4};
    CHECK(ds4_st_writer_add(w, "empty", DS4_BF16, 2, eshape, NULL) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "we\"ird\\name\n", DS4_U8, 1, shape, bytes[0]) == DS4_OK);
    const char *path = tpath("rt.safetensors");
    CHECK(ds4_st_writer_write(w, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);

    ds4_st_file *f;
    CHECK(ds4_st_open(path, &f) == DS4_OK, "%s", ds4_errmsg());
    if (!f) return;
    CHECK(ds4_st_count(f) == DS4_DTYPE_COUNT + 8, "count %lld", (long long)ds4_st_count(f));
    CHECK(strcmp(ds4_st_path(f), path) == 0);
    for (int t = 0; t < DS4_DTYPE_COUNT; t++) {
        const ds4_st_entry *e = ds4_st_find(f, names[t]);
        CHECK(e != NULL, "%s", names[t]);
        if (!e) continue;
        size_t sz = ds4_dtype_size((ds4_dtype)t);
        CHECK(e->dtype == (ds4_dtype)t && e->ndim == 2 && e->shape[0] == 3 && e->shape[1] == 5, "%s", names[t]);
        CHECK(e->end - e->begin == 15 * sz, "%s", names[t]);
        CHECK(memcmp(ds4_st_bytes(f, e), bytes[t], 15 * sz) == 0, "%s bytes differ", names[t]);
        CHECK((uintptr_t)ds4_st_bytes(f, e) % sz == 0, "%s not aligned", names[t]);
    }
    float out[15];
    CHECK(ds4_st_read_f32(f, "f32", 2, shape, out) == DS4_OK && memcmp(out, f32, sizeof out) == 0);
    CHECK(ds4_st_read_f32(f, "bf16", 2, shape, out) == DS4_OK && memcmp(out, f32, sizeof out) == 0);
    CHECK(ds4_st_read_f32(f, "f16", 2, shape, out) == DS4_OK);
    for (int i = 0; i < 15; i++) CHECK(out[i] == (i == 0 ? 0.0f : 1.0f + (float)i / 16.0f), "f16[%d] = %g", i, out[i]);
    int64_t iout[15];
    CHECK(ds4_st_read_i64(f, "i32", 2, shape, iout) == DS4_OK);
    for (int i = 0; i < 15; i++) CHECK(iout[i] == i32[i]);
    CHECK(ds4_st_read_i64(f, "i64", 2, shape, iout) == DS4_OK && memcmp(iout, i64, sizeof iout) == 0);
    CHECK(ds4_st_read_f32(f, "scalar", 0, NULL, out) == DS4_OK && out[0] == 3.5f);
    CHECK(ds4_st_read_f32(f, "empty", 2, eshape, out) == DS4_OK);
    const ds4_st_entry *we = ds4_st_find(f, "we\"ird\\name\n");
    CHECK(we && we->dtype == DS4_U8 && memcmp(ds4_st_bytes(f, we), bytes[0], 3) == 0);
    CHECK(ds4_st_find(f, "nope") == NULL);
    CHECK(ds4_st_entry_at(f, -1) == NULL && ds4_st_entry_at(f, ds4_st_count(f)) == NULL);
    ds4_st_close(f);

    /* the file itself: header length multiple of 8, "__metadata__" {"format":"pt"} */
    char *raw;
    size_t n;
    CHECK(ds4_read_file(path, &raw, &n) == DS4_OK);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++) hl |= (uint64_t)(uint8_t)raw[i] << (8 * i);
    CHECK((8 + hl) % 8 == 0 && hl < n);
    CHECK(strstr(raw + 8, "\"__metadata__\":{\"format\":\"pt\"}") != NULL);
    ds4_free(raw);
}

static void test_read_errors(void) {
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    int64_t shape[2] = {3, 5}, bad[2] = {5, 3};
    uint8_t data[15 * 4] = {0};
    ds4_st_writer_add(w, "x.f32", DS4_F32, 2, shape, data);
    ds4_st_writer_add(w, "x.i32", DS4_I32, 2, shape, data);
    ds4_st_writer_add(w, "x.e4m3.weight", DS4_F8_E4M3, 2, shape, data);
    ds4_st_writer_add(w, "x.f64", DS4_F64, 1, shape, data);
    const char *path = tpath("err.safetensors");
    CHECK(ds4_st_writer_write(w, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    ds4_st_file *f;
    CHECK(ds4_st_open(path, &f) == DS4_OK);
    if (!f) return;
    float out[15];
    int64_t iout[15];
    CHECK(ds4_st_read_f32(f, "x.none", 2, shape, out) == DS4_ERR_MISSING && msg_has(path) && msg_has("'x.none'"));
    CHECK(ds4_st_read_f32(f, "x.f32", 2, bad, out) == DS4_ERR_SHAPE && msg_has(path) && msg_has("'x.f32'") &&
          msg_has("[3, 5]") && msg_has("[5, 3]"), "%s", ds4_errmsg());
    CHECK(ds4_st_read_f32(f, "x.f32", 1, bad, out) == DS4_ERR_SHAPE && msg_has("[5]"), "%s", ds4_errmsg());
    CHECK(ds4_st_read_f32(f, "x.i32", 2, shape, out) == DS4_ERR_SHAPE && msg_has("'x.i32'") && msg_has("I32"));
    CHECK(ds4_st_read_f32(f, "x.f64", 1, shape, out) == DS4_ERR_SHAPE && msg_has("F64"));
    CHECK(ds4_st_read_f32(f, "x.e4m3.weight", 2, shape, out) == DS4_ERR_UNSUPPORTED && msg_has(path) &&
          msg_has("'x.e4m3.weight'") && msg_has("F8_E4M3") && msg_has("dequantization") && msg_has("x.e4m3.scale"),
          "%s", ds4_errmsg());
    CHECK(ds4_st_read_i64(f, "x.f32", 2, shape, iout) == DS4_ERR_SHAPE && msg_has("'x.f32'") && msg_has("F32"));
    CHECK(ds4_st_read_i64(f, "x.i32", 2, bad, iout) == DS4_ERR_SHAPE && msg_has("'x.i32'"));
    CHECK(ds4_st_read_i64(f, "zz", 2, bad, iout) == DS4_ERR_MISSING && msg_has("'zz'"));
    ds4_st_close(f);

    /* writer argument errors */
    ds4_st_writer_new(&w);
    int64_t neg[1] = {-2};
    CHECK(ds4_st_writer_add(w, "n", DS4_F32, 1, neg, data) == DS4_ERR_ARG && msg_has("'n'"));
    CHECK(ds4_st_writer_add(w, "n", DS4_F32, 7, shape, data) == DS4_ERR_ARG && msg_has("'n'"));
    CHECK(ds4_st_writer_add(w, "n", DS4_F32, 2, shape, NULL) == DS4_ERR_ARG && msg_has("'n'"));
    CHECK(ds4_st_writer_add(w, "__metadata__", DS4_F32, 2, shape, data) == DS4_ERR_ARG);
    CHECK(ds4_st_writer_add(w, "", DS4_F32, 2, shape, data) == DS4_ERR_ARG);
    CHECK(ds4_st_writer_add(w, "d", DS4_F32, 2, shape, data) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "d", DS4_F32, 2, shape, data) == DS4_OK);
    CHECK(ds4_st_writer_write(w, tpath("dup.safetensors")) == DS4_ERR_ARG && msg_has("'d'") && msg_has("twice"));
    CHECK(access(tpath("dup.safetensors"), F_OK) != 0);
    CHECK(ds4_st_writer_write(w, "/nonexistent-dir/x.safetensors") != DS4_OK);
    ds4_st_writer_free(w);
}

/* Every malformed header: the code, and a message naming the file and (where there is one) the tensor. */
static void test_bad_headers(void) {
    static const struct {
        const char *header;
        size_t dlen;
        ds4_status code;
        const char *needle;
    } cases[] = {
        {"{not json", 0, DS4_ERR_FORMAT, "not valid JSON"},
        {"[1, 2]", 0, DS4_ERR_FORMAT, "not a JSON object"},
        {"{} xyz", 0, DS4_ERR_FORMAT, "trailing"},
        {"{\"w\": 5}", 0, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,12]}}", 16, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2,2],\"data_offsets\":[0,16]}}", 8, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,4]}}", 8, DS4_ERR_FORMAT, "'w'"},
        {"{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
         12, DS4_ERR_FORMAT, "overlap"},
        {"{\"w\":{\"dtype\":\"F12\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "F12"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
         8, DS4_ERR_FORMAT, "twice"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[-1,2],\"data_offsets\":[0,0]}}", 0, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,10]}}", 10, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1e300],\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"U8\",\"shape\":[4294967296,4294967296,16],\"data_offsets\":[0,0]}}", 0, DS4_ERR_FORMAT, "overflow"},
        {"{\"w\":{\"dtype\":\"F64\",\"shape\":[4294967296,536870912],\"data_offsets\":[0,0]}}", 0, DS4_ERR_FORMAT, "overflow"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1,1,1,1,1,1,1],\"data_offsets\":[0,4]}}", 4, DS4_ERR_UNSUPPORTED, "'w'"},
        {"{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "dtype"},
        {"{\"w\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "shape"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4, DS4_ERR_FORMAT, "data_offsets"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0]}}", 4, DS4_ERR_FORMAT, "data_offsets"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[\"0\",4]}}", 4, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":\"F32\",\"shape\":\"1\",\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "'w'"},
        {"{\"w\":{\"dtype\":7,\"shape\":[1],\"data_offsets\":[0,4]}}", 4, DS4_ERR_FORMAT, "'w'"},
        {"{\"__metadata__\": 3}", 0, DS4_ERR_FORMAT, "__metadata__"},
        {"{\"__metadata__\": {\"k\": 3}}", 0, DS4_ERR_FORMAT, "'k'"},
        /* valid: header padded with spaces, zero tensors, zero-size tensors next to others */
        {"{}        ", 0, DS4_OK, ""},
        {"{\"__metadata__\":{\"format\":\"pt\"},\"e\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[4,4]},"
         "\"w\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8, DS4_OK, ""},
    };
    const char *path = tpath("bad.safetensors");
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_st(path, cases[i].header, cases[i].dlen);
        ds4_st_file *f = NULL;
        ds4_status s = ds4_st_open(path, &f);
        CHECK(s == cases[i].code, "case %zu: got %s (%s), want %s", i, ds4_status_name(s), ds4_errmsg(),
              ds4_status_name(cases[i].code));
        if (s != DS4_OK) CHECK(msg_has(path) && msg_has(cases[i].needle) && f == NULL, "case %zu: %s", i, ds4_errmsg());
        ds4_st_close(f);
    }

    /* header length field problems */
    const char *hdr = "{}";
    write_st_raw(path, hdr, 1000, NULL, 0);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path) && msg_has("exceeds the file size"));
    write_st_raw(path, hdr, 200000000ull, NULL, 0);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path) && msg_has("100 MB"));
    write_st_raw(path, hdr, UINT64_MAX, NULL, 0);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path));
    write_st_raw(path, hdr, 0, NULL, 0);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path));
    write_bytes(path, "\x02\0\0", 3);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path) && msg_has("too short"));
    write_bytes(path, "", 0);
    CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has(path));
    write_st_raw(path, "{\"a\"\0:1}", 8, NULL, 0);   /* strlen stops at the NUL: header is 4 bytes */
    {
        uint8_t buf[16] = {8, 0, 0, 0, 0, 0, 0, 0, '{', '"', 'a', 0, '"', ':', '1', '}'};
        write_bytes(path, buf, sizeof buf);
        CHECK(ds4_st_open(path, &(ds4_st_file *){0}) == DS4_ERR_FORMAT && msg_has("NUL"));
    }
    CHECK(ds4_st_open(tpath("does-not-exist.safetensors"), &(ds4_st_file *){0}) == DS4_ERR_IO && msg_has("does-not-exist"));
    CHECK(ds4_st_open(g_dir, &(ds4_st_file *){0}) == DS4_ERR_IO);
}

/* Cutting a valid file anywhere must fail cleanly (the last tensor ends at the end of the file). */
static void test_truncated(void) {
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    float a[6] = {1, 2, 3, 4, 5, 6};
    int64_t sa[2] = {2, 3};
    ds4_st_writer_add(w, "a", DS4_F32, 2, sa, a);
    ds4_st_writer_add(w, "b", DS4_BF16, 2, sa, a);
    const char *full = tpath("full.safetensors");
    CHECK(ds4_st_writer_write(w, full) == DS4_OK);
    ds4_st_writer_free(w);
    char *raw;
    size_t n;
    CHECK(ds4_read_file(full, &raw, &n) == DS4_OK);
    const char *cut = tpath("cut.safetensors");
    int fails = 0;
    for (size_t len = 0; len < n; len++) {
        write_bytes(cut, raw, len);
        ds4_st_file *f = NULL;
        ds4_status s = ds4_st_open(cut, &f);
        fails += s != DS4_OK && msg_has(cut) && f == NULL;
        ds4_st_close(f);
    }
    CHECK(fails == (int)n, "%d of %zu truncations rejected", fails, n);
    write_bytes(cut, raw, n);
    ds4_st_file *f = NULL;
    CHECK(ds4_st_open(cut, &f) == DS4_OK);
    ds4_st_close(f);
    ds4_free(raw);
}

/* ---------------------------------------------------------------- atomic files */


static void test_atomic_write(void) {
    const char *p = tpath("atomic.txt");
    CHECK(ds4_write_file_atomic(p, "hello", 5) == DS4_OK);
    CHECK(ds4_write_file_atomic(p, "bye", 3) == DS4_OK);
    char *d;
    size_t n;
    CHECK(ds4_read_file(p, &d, &n) == DS4_OK && n == 3 && strcmp(d, "bye") == 0);
    ds4_free(d);
    CHECK(t_count_tmp_files(g_dir) == 0);
    CHECK(ds4_write_file_atomic("/nonexistent-dir/f", "x", 1) == DS4_ERR_IO && msg_has("/nonexistent-dir/f"));
    CHECK(ds4_read_file(tpath("nope"), &d, &n) == DS4_ERR_IO && msg_has("nope") && d == NULL);
    /* abort leaves nothing behind and keeps the old file */
    ds4_atomic_file af;
    CHECK(ds4_atomic_open(p, &af) == DS4_OK);
    CHECK(ds4_atomic_write(&af, "partial", 7) == DS4_OK);
    ds4_atomic_abort(&af);
    ds4_atomic_abort(&af);
    CHECK(t_count_tmp_files(g_dir) == 0);
    CHECK(ds4_read_file(p, &d, &n) == DS4_OK && n == 3);
    ds4_free(d);
}

/* ---------------------------------------------------------------- config */

static const char *find_config(const char *name) {
    static char buf[512];
    const char *roots[] = {".", "..", "../.."};
    for (int i = 0; i < 3; i++) {
        snprintf(buf, sizeof buf, "%s/%s", roots[i], name);
        if (access(buf, R_OK) == 0) return buf;
    }
    return name;
}

static void test_config_flash(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-flash.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(c.vocab_size == 129280 && c.dim == 4096 && c.n_layers == 43 && c.n_mtp_layers == 1);
    CHECK(c.n_heads == 64 && c.n_kv_heads == 1 && c.head_dim == 512 && c.rope_head_dim == 64);
    CHECK(c.q_lora_rank == 1024 && c.o_groups == 8 && c.o_lora_rank == 1024 && c.window == 128);
    CHECK(c.index_n_heads == 64 && c.index_head_dim == 128 && c.index_topk == 512);
    CHECK(c.hc_mult == 4 && c.hc_sinkhorn_iters == 20 && c.hc_eps == 1e-6);
    CHECK(c.n_routed_experts == 256 && c.n_shared_experts == 1 && c.n_activated_experts == 6 && c.moe_inter_dim == 2048);
    CHECK(c.n_hash_layers == 3 && c.route_scale == 1.5 && c.swiglu_limit == 10.0);
    CHECK(c.rope_theta == 10000 && c.compress_rope_theta == 160000);
    CHECK(c.rope_factor == 16 && c.original_seq_len == 65536 && c.beta_fast == 32 && c.beta_slow == 1);
    CHECK(c.norm_eps == 1e-6 && c.max_position_embeddings == 1048576 && c.bos_token_id == 0 && c.eos_token_id == 1);
    CHECK(c.quantized && c.expert_fp4);
    CHECK(c.mtp_loss_weight == 0.3 && c.indexer_loss_coeff == 0.01 && !c.csa_dense);
    int n4 = 0, n128 = 0;
    for (int l = 0; l < 44; l++) n4 += c.compress_ratios[l] == 4, n128 += c.compress_ratios[l] == 128;
    CHECK(c.compress_ratios[0] == 0 && c.compress_ratios[1] == 0 && c.compress_ratios[2] == 4 && c.compress_ratios[3] == 128);
    CHECK(c.compress_ratios[42] == 4 && c.compress_ratios[43] == 0 && n4 == 21 && n128 == 20 && c.compress_ratios[44] == 0);
}

static void test_config_pro(void) {
    ds4_config c;
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-pro.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(c.dim == 7168 && c.n_layers == 61 && c.n_mtp_layers == 1 && c.n_heads == 128 && c.q_lora_rank == 1536);
    CHECK(c.o_groups == 16 && c.index_topk == 1024 && c.n_routed_experts == 384 && c.moe_inter_dim == 3072);
    CHECK(c.route_scale == 2.5 && c.quantized && c.expert_fp4);
    int n4 = 0, n128 = 0;
    for (int l = 0; l < 62; l++) n4 += c.compress_ratios[l] == 4, n128 += c.compress_ratios[l] == 128;
    CHECK(c.compress_ratios[0] == 128 && c.compress_ratios[1] == 128 && c.compress_ratios[60] == 4 && c.compress_ratios[61] == 0);
    CHECK(n4 == 30 && n128 == 31);
}

static void test_config_tiny_files(void) {
    /* the test configs shipped next to the tests load too */
    ds4_config c;
    CHECK(ds4_config_load(find_config("tests/configs/tiny-a.json"), &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(c.dim == 64 && c.n_layers == 4 && c.original_seq_len == 16 && c.rope_factor == 4 && !c.quantized);
}

static void test_config_roundtrip(void) {
    ds4_config a, b;
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-flash.json"), &a) == DS4_OK);
    const char *p = tpath("cfg.json");
    CHECK(ds4_config_save(&a, p) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_config_load(p, &b) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(&a, &b, sizeof a) == 0, "flash config differs after save/load");
    /* a small config without YaRN, quantization, with non-default training keys */
    memset(&a, 0, sizeof a);
    a = (ds4_config){.vocab_size = 256, .dim = 64, .n_layers = 3, .n_mtp_layers = 1, .n_heads = 4, .n_kv_heads = 1,
                     .head_dim = 32, .rope_head_dim = 8, .q_lora_rank = 32, .o_groups = 2, .o_lora_rank = 16, .window = 16,
                     .compress_ratios = {0, 4, 16, 0}, .index_n_heads = 2, .index_head_dim = 16, .index_topk = 4,
                     .hc_mult = 4, .hc_sinkhorn_iters = 20, .hc_eps = 1e-6, .n_routed_experts = 8, .n_shared_experts = 1,
                     .n_activated_experts = 2, .moe_inter_dim = 32, .n_hash_layers = 1, .route_scale = 1.5,
                     .swiglu_limit = 0.0, .rope_theta = 10000, .compress_rope_theta = 160000, .rope_factor = 1.0,
                     .norm_eps = 1.0 / 3.0, .max_position_embeddings = 0, .bos_token_id = 5, .eos_token_id = 7,
                     .mtp_loss_weight = 0.1, .indexer_loss_coeff = 0.123456789012345678, .csa_dense = true};
    CHECK(ds4_config_save(&a, p) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_config_load(p, &b) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(&a, &b, sizeof a) == 0, "tiny config differs after save/load");
    CHECK(b.original_seq_len == 0 && b.csa_dense && b.norm_eps == 1.0 / 3.0);
    /* factor/beta without original_seq_len survive too */
    a.beta_fast = 8;
    a.beta_slow = 2;
    CHECK(ds4_config_save(&a, p) == DS4_OK && ds4_config_load(p, &b) == DS4_OK && memcmp(&a, &b, sizeof a) == 0);
    /* save refuses an invalid config and leaves nothing behind */
    a.n_kv_heads = 2;
    CHECK(ds4_config_save(&a, tpath("bad.json")) == DS4_ERR_CONFIG && access(tpath("bad.json"), F_OK) != 0);
}

/* Mutations of the Flash config.json as a JSON tree. */
typedef enum { M_DEL, M_NUM, M_STR, M_BOOL, M_RAW, M_ADD_RAW } mop;
typedef struct {
    mop op;
    const char *key;
    double num;
    const char *str;
    ds4_status code;
    const char *needle;  /* must appear in the message */
} mutation;

static ds4_status parse_mutated_into(const char *base, const mutation *m, ds4_config *c) {
    cJSON *r = cJSON_Parse(base);
    cJSON *v = NULL;
    switch (m->op) {
    case M_DEL: cJSON_DeleteItemFromObjectCaseSensitive(r, m->key); break;
    case M_NUM: v = cJSON_CreateNumber(m->num); break;
    case M_STR: v = cJSON_CreateString(m->str); break;
    case M_BOOL: v = cJSON_CreateBool(m->num != 0); break;
    case M_RAW: v = cJSON_CreateRaw(m->str); break;
    case M_ADD_RAW: cJSON_AddItemToObject(r, m->key, cJSON_CreateRaw(m->str)); break;
    }
    if (v) {
        if (cJSON_GetObjectItemCaseSensitive(r, m->key)) cJSON_ReplaceItemInObjectCaseSensitive(r, m->key, v);
        else cJSON_AddItemToObject(r, m->key, v);
    }
    char *text = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    ds4_status s = ds4_config_parse(text, strlen(text), "mut.json", c);
    cJSON_free(text);
    return s;
}

static ds4_status parse_mutated(const char *base, const mutation *m) {
    ds4_config c;
    return parse_mutated_into(base, m, &c);
}

static void test_config_errors(void) {
    char *base;
    size_t n;
    CHECK(ds4_read_file(find_config("configs/deepseek-v4-flash.json"), &base, &n) == DS4_OK);
    if (!base) return;
    static const mutation ms[] = {
        {M_DEL, "hidden_size", 0, 0, DS4_ERR_CONFIG, "'hidden_size' is missing"},
        {M_DEL, "compress_ratios", 0, 0, DS4_ERR_CONFIG, "'compress_ratios' is missing"},
        {M_DEL, "num_nextn_predict_layers", 0, 0, DS4_ERR_CONFIG, "num_nextn_predict_layers"},
        {M_ADD_RAW, "hiden_size", 0, "4096", DS4_ERR_CONFIG, "unknown key 'hiden_size' (did you mean 'hidden_size'?)"},
        {M_ADD_RAW, "index_top_k", 0, "512", DS4_ERR_CONFIG, "did you mean 'index_topk'"},
        {M_ADD_RAW, "hidden_size", 0, "4096", DS4_ERR_CONFIG, "appears twice"},
        {M_STR, "hidden_size", 0, "4096", DS4_ERR_CONFIG, "'hidden_size' must be an integer"},
        {M_NUM, "hidden_size", 4096.5, 0, DS4_ERR_CONFIG, "'hidden_size' must be an integer"},
        {M_STR, "rope_theta", 0, "1e4", DS4_ERR_CONFIG, "'rope_theta' must be a number"},
        {M_NUM, "tie_word_embeddings", 0, 0, DS4_ERR_CONFIG, "'tie_word_embeddings' must be true or false"},
        {M_RAW, "compress_ratios", 0, "[0, 4]", DS4_ERR_CONFIG, "'compress_ratios' has 2 entries"},
        {M_RAW, "compress_ratios", 0, "{}", DS4_ERR_CONFIG, "'compress_ratios' must be an array"},
        {M_STR, "scoring_func", 0, "softmax", DS4_ERR_CONFIG, "scoring_func"},
        {M_STR, "topk_method", 0, "greedy", DS4_ERR_CONFIG, "topk_method"},
        {M_STR, "hidden_act", 0, "gelu", DS4_ERR_CONFIG, "hidden_act"},
        {M_BOOL, "norm_topk_prob", 0, 0, DS4_ERR_CONFIG, "norm_topk_prob"},
        {M_BOOL, "tie_word_embeddings", 1, 0, DS4_ERR_CONFIG, "tie_word_embeddings"},
        {M_STR, "expert_dtype", 0, "int4", DS4_ERR_CONFIG, "expert_dtype"},
        {M_RAW, "rope_scaling", 0, "{\"type\":\"linear\",\"factor\":2}", DS4_ERR_CONFIG, "rope_scaling.type"},
        {M_RAW, "rope_scaling", 0, "{\"type\":\"yarn\",\"factor\":2,\"mscale\":1}", DS4_ERR_CONFIG, "rope_scaling.mscale"},
        {M_RAW, "rope_scaling", 0, "{\"type\":\"yarn\",\"factor\":2}", DS4_ERR_CONFIG, "rope_scaling.original_max_position_embeddings"},
        {M_RAW, "rope_scaling", 0, "[]", DS4_ERR_CONFIG, "rope_scaling"},
        {M_RAW, "quantization_config", 0, "{\"quant_method\":\"int8\"}", DS4_ERR_CONFIG, "quant_method"},
        {M_RAW, "quantization_config", 0, "{\"weight_block_size\":[64,64]}", DS4_ERR_CONFIG, "weight_block_size"},
        {M_NUM, "num_key_value_heads", 8, 0, DS4_ERR_CONFIG, "num_key_value_heads"},
        {M_NUM, "vocab_size", 0, 0, DS4_ERR_CONFIG, "vocab_size"},
        /* accepted variations */
        {M_RAW, "rope_scaling", 0, "null", DS4_OK, ""},
        {M_RAW, "quantization_config", 0, "null", DS4_OK, ""},
        {M_RAW, "expert_dtype", 0, "null", DS4_OK, ""},
        {M_DEL, "transformers_version", 0, 0, DS4_OK, ""},
        {M_ADD_RAW, "first_k_dense_replace", 0, "0", DS4_OK, ""},
        {M_ADD_RAW, "mtp_loss_weight", 0, "0.1", DS4_OK, ""},
    };
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        ds4_status s = parse_mutated(base, &ms[i]);
        CHECK(s == ms[i].code, "mutation %zu (%s): got %s: %s", i, ms[i].key, ds4_status_name(s), ds4_errmsg());
        if (s != DS4_OK) CHECK(msg_has("mut.json") && msg_has(ms[i].needle), "mutation %zu: '%s' lacks '%s'", i, ds4_errmsg(),
                               ms[i].needle);
    }
    /* malformed JSON text */
    ds4_config c;
    const char *bad[] = {"", "{", "{\"hidden_size\": }", "[]", "{} {}", "{\"a\":1,}", "nul"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(ds4_config_parse(bad[i], strlen(bad[i]), "m.json", &c) == DS4_ERR_FORMAT && msg_has("m.json"), "bad %zu: %s", i,
              ds4_errmsg());
    CHECK(ds4_config_load(tpath("no-such.json"), &c) == DS4_ERR_IO && msg_has("no-such.json"));
    ds4_free(base);
}

static cJSON *load_tree(const char *path) {
    char *t;
    size_t n;
    if (ds4_read_file(path, &t, &n) != DS4_OK) return NULL;
    cJSON *r = cJSON_ParseWithLength(t, n);
    ds4_free(t);
    return r;
}

/* DeepSeek-V4-Flash-0731 (tests/data/deepseek-v4-flash-0731.config.json, docs/dspark.md): the April
 * config plus the DSpark keys and one compress_ratios entry per DSpark stage. */
static void test_config_0731(void) {
    char path[512];
    snprintf(path, sizeof path, "%s", find_config("tests/data/deepseek-v4-flash-0731.config.json"));
    ds4_config c, april, back;
    CHECK(ds4_config_load(path, &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-flash.json"), &april) == DS4_OK);
    CHECK(c.dspark_n_stages == 3 && c.dspark_block_size == 5 && c.dspark_noise_token_id == 128799 && c.dspark_markov_rank == 256);
    CHECK(c.dspark_target_layer_ids[0] == 40 && c.dspark_target_layer_ids[1] == 41 && c.dspark_target_layer_ids[2] == 42);
    /* the stages own mtp.*: no NextN block, the declared count kept for writing back */
    CHECK(c.n_mtp_layers == 0 && c.dspark_nextn_declared == 1);
    /* entries 0..42 are the main layers (April's), 43..45 the three stages (window only) */
    CHECK(memcmp(c.compress_ratios, april.compress_ratios, 43 * sizeof(int64_t)) == 0);
    CHECK(c.compress_ratios[43] == 0 && c.compress_ratios[44] == 0 && c.compress_ratios[45] == 0 && c.compress_ratios[46] == 0);
    CHECK(c.dim == april.dim && c.n_layers == april.n_layers && c.n_routed_experts == april.n_routed_experts);
    /* save writes what it read */
    const char *p = tpath("cfg-0731.json");
    CHECK(ds4_config_save(&c, p) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_config_load(p, &back) == DS4_OK && memcmp(&c, &back, sizeof c) == 0, "0731 config differs after save/load");
    cJSON *saved = load_tree(p);
    CHECK(saved && cJSON_GetArraySize(cJSON_GetObjectItem(saved, "compress_ratios")) == 46);
    CHECK(saved && cJSON_GetObjectItem(saved, "num_nextn_predict_layers")->valuedouble == 1);
    cJSON_Delete(saved);
    /* the transformers spelling carries the DSpark keys too */
    cJSON *r = load_tree(path);
    CHECK(r && ds4_config_json_respell(r, true, "0731") == DS4_OK, "%s", ds4_errmsg());
    CHECK(r && ds4_config_json_respell(r, false, "0731") == DS4_OK, "%s", ds4_errmsg());
    cJSON_Delete(r);

    char *base;
    size_t n;
    CHECK(ds4_read_file(path, &base, &n) == DS4_OK);
    if (!base) return;
    static const mutation ms[] = {
        {M_DEL, "dspark_markov_rank", 0, 0, DS4_ERR_CONFIG, "required key 'dspark_markov_rank' is missing"},
        {M_NUM, "dspark_block_size", 0, 0, DS4_ERR_CONFIG, "key 'dspark_block_size' = 0 is out of range [1, 256]"},
        {M_NUM, "dspark_noise_token_id", 129280, 0, DS4_ERR_CONFIG, "key 'dspark_noise_token_id' = 129280 is out of range"},
        {M_NUM, "dspark_markov_rank", -1, 0, DS4_ERR_CONFIG, "key 'dspark_markov_rank' = -1"},
        {M_STR, "dspark_block_size", 0, "5", DS4_ERR_CONFIG, "'dspark_block_size' must be an integer"},
        {M_RAW, "dspark_target_layer_ids", 0, "[40, 43, 42]", DS4_ERR_CONFIG, "'dspark_target_layer_ids' entry 1 must be"},
        {M_RAW, "dspark_target_layer_ids", 0, "[41, 40, 42]", DS4_ERR_CONFIG, "strictly increasing"},
        {M_RAW, "dspark_target_layer_ids", 0, "[]", DS4_ERR_CONFIG, "'dspark_target_layer_ids' is empty"},
        {M_RAW, "dspark_target_layer_ids", 0, "[1,2,3,4,5,6,7,8,9]", DS4_ERR_CONFIG, "more than 8 entries"},
        /* one entry per stage: April's 44 entries are one short, two stages are one too many */
        {M_RAW, "dspark_target_layer_ids", 0, "[41, 42]", DS4_ERR_CONFIG, "'compress_ratios' has 46 entries, expected "
                                                                          "num_hidden_layers + one per DSpark stage"},
        {M_RAW, "compress_ratios", 0, "[0,0,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,"
                                       "128,4,128,4,128,4,128,4,128,4,128,4,128,4,0,0,4]",
         DS4_ERR_CONFIG, "'compress_ratios' entry 45 (DSpark stage) is 4, must be 0"},
        /* accepted: -1 (the embedding output, as DeepSpec allows) and no NextN declared */
        {M_RAW, "dspark_target_layer_ids", 0, "[-1, 20, 42]", DS4_OK, ""},
        {M_NUM, "num_nextn_predict_layers", 0, 0, DS4_OK, ""},
    };
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        ds4_status s = parse_mutated(base, &ms[i]);
        CHECK(s == ms[i].code, "0731 mutation %zu (%s): got %s: %s", i, ms[i].key, ds4_status_name(s), ds4_errmsg());
        if (s != DS4_OK) CHECK(msg_has("mut.json") && msg_has(ms[i].needle), "0731 mutation %zu: '%s' lacks '%s'", i, ds4_errmsg(),
                               ms[i].needle);
    }
    ds4_free(base);
}

/* Each structural rule, applied to a valid config struct. */
static void test_config_validate(void) {
    ds4_config base;
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-flash.json"), &base) == DS4_OK);
    CHECK(ds4_config_validate(&base, "v") == DS4_OK);
    const char *needles[] = {"num_key_value_heads", "qk_rope_head_dim", "qk_rope_head_dim", "qk_rope_head_dim", "o_groups",
                             "compress_ratios' entry 5", "compress_ratios' entry 7", "entry 43 (MTP layer)", "hc_mult",
                             "num_experts_per_tok", "num_hash_layers", "vocab_size", "sliding_window",
                             "num_nextn_predict_layers", "rms_norm_eps", "bos_token_id", "rope_scaling.factor", "beta_slow",
                             "index_topk", "hidden_size", "eos_token_id", "routed_scaling_factor", "mtp_loss_weight",
                             "n_shared_experts", "head_dim"};
    int nrules = (int)(sizeof needles / sizeof needles[0]);
    for (int r = 0; r < nrules; r++) {
        ds4_config c = base;
        switch (r) {
        case 0: c.n_kv_heads = 2; break;
        case 1: c.rope_head_dim = 63; break;
        case 2: c.rope_head_dim = 514; c.index_head_dim = 1024; break;  /* > head_dim */
        case 3: c.index_head_dim = 32; break;                            /* rope 64 > index_head_dim */
        case 4: c.o_groups = 3; break;
        case 5: c.compress_ratios[5] = 1; break;
        case 6: c.compress_ratios[7] = -4; break;
        case 7: c.compress_ratios[43] = 4; break;
        case 8: c.hc_mult = 0; break;
        case 9: c.n_activated_experts = 257; break;
        case 10: c.n_hash_layers = 44; break;
        case 11: c.vocab_size = 0; break;
        case 12: c.window = 0; break;
        case 13: c.n_mtp_layers = 2; break;
        case 14: c.norm_eps = 0; break;
        case 15: c.bos_token_id = c.vocab_size; break;
        case 16: c.rope_factor = 0.5; break;
        case 17: c.beta_slow = 0; break;
        case 18: c.index_topk = 0; break;
        case 19: c.dim = -1; break;
        case 20: c.eos_token_id = -1; break;
        case 21: c.route_scale = NAN; break;
        case 22: c.mtp_loss_weight = -0.1; break;
        case 23: c.n_shared_experts = -1; break;
        case 24: c.head_dim = 0; break;
        }
        ds4_status s = ds4_config_validate(&c, "v.json");
        CHECK(s == DS4_ERR_CONFIG && msg_has("v.json") && msg_has(needles[r]), "rule %d: %s: %s", r, ds4_status_name(s),
              ds4_errmsg());
    }
    /* a ratio of 0 on the MTP layer and 2 on a main layer are fine */
    ds4_config c = base;
    c.compress_ratios[5] = 2;
    CHECK(ds4_config_validate(&c, "v") == DS4_OK, "%s", ds4_errmsg());
}

/* ---------------------------------------------------------------- model directories */

static void write_tiny_config(const char *dir) {
    ds4_config c;
    CHECK(ds4_config_load(find_config("configs/deepseek-v4-flash.json"), &c) == DS4_OK);
    char p[600];
    snprintf(p, sizeof p, "%.512s/config.json", dir);
    CHECK(ds4_config_save(&c, p) == DS4_OK, "%s", ds4_errmsg());
}

static void write_shard(const char *path, const char *n1, const float *d1, const char *n2, const int64_t *d2) {
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    int64_t s1[2] = {2, 4}, s2[1] = {3};
    if (n1) ds4_st_writer_add(w, n1, DS4_F32, 2, s1, d1);
    if (n2) ds4_st_writer_add(w, n2, DS4_I64, 1, s2, d2);
    CHECK(ds4_st_writer_write(w, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
}

static void test_model_dir(void) {
    char dir[512];
    snprintf(dir, sizeof dir, "%s/model", g_dir);
    mkdir(dir, 0755);
    ds4_model_dir *d = NULL;
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_IO && msg_has("config.json"));
    write_tiny_config(dir);
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_MISSING && msg_has(dir) && msg_has("safetensors"));
    float a[8] = {1, 2, 3, 4, 5, 6, 7, 8}, b[8] = {-1, -2, -3, -4, -5, -6, -7, -8};
    int64_t t[3] = {5, 6, 7};
    char p1[600], p2[600], p3[600];
    snprintf(p1, sizeof p1, "%s/model-00001-of-00002.safetensors", dir);
    snprintf(p2, sizeof p2, "%s/model-00002-of-00002.safetensors", dir);
    write_shard(p1, "layers.0.w", a, "layers.0.ffn.gate.tid2eid", t);
    write_shard(p2, "layers.1.w", b, NULL, NULL);
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (d) {
        CHECK(ds4_model_dir_nfiles(d) == 2);
        CHECK(strcmp(ds4_st_path(ds4_model_dir_file(d, 0)), p1) == 0 && strcmp(ds4_st_path(ds4_model_dir_file(d, 1)), p2) == 0);
        CHECK(ds4_model_dir_config(d)->n_layers == 43);
        const ds4_st_entry *e;
        CHECK(ds4_model_dir_find(d, "layers.1.w", &e) == ds4_model_dir_file(d, 1) && e && strcmp(e->name, "layers.1.w") == 0);
        CHECK(ds4_model_dir_find(d, "layers.9.w", &e) == NULL && e == NULL);
        float out[8];
        int64_t sh[2] = {2, 4}, s3[1] = {3}, iout[3];
        CHECK(ds4_model_dir_read_f32(d, "layers.0.w", 2, sh, out) == DS4_OK && memcmp(out, a, sizeof a) == 0);
        CHECK(ds4_model_dir_read_f32(d, "layers.1.w", 2, sh, out) == DS4_OK && memcmp(out, b, sizeof b) == 0);
        CHECK(ds4_model_dir_read_i64(d, "layers.0.ffn.gate.tid2eid", 1, s3, iout) == DS4_OK && iout[2] == 7);
        CHECK(ds4_model_dir_read_f32(d, "layers.9.w", 2, sh, out) == DS4_ERR_MISSING && msg_has(dir) && msg_has("'layers.9.w'"));
        CHECK(ds4_model_dir_read_i64(d, "layers.9.t", 1, s3, iout) == DS4_ERR_MISSING && msg_has("'layers.9.t'"));
        int64_t wrong[2] = {4, 2};
        CHECK(ds4_model_dir_read_f32(d, "layers.1.w", 2, wrong, out) == DS4_ERR_SHAPE && msg_has(p2) && msg_has("'layers.1.w'"));
        ds4_model_dir_close(d);
    }
    /* a third shard repeating a tensor */
    snprintf(p3, sizeof p3, "%s/extra.safetensors", dir);
    write_shard(p3, "layers.1.w", a, NULL, NULL);
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has("'layers.1.w'") && msg_has(p2) && msg_has(p3), "%s",
          ds4_errmsg());
    /* with an index, only the listed shards are opened */
    char ip[600];
    snprintf(ip, sizeof ip, "%s/model.safetensors.index.json", dir);
    const char *idx = "{\"metadata\":{\"total_size\":72},\"weight_map\":{"
                      "\"layers.0.w\":\"model-00001-of-00002.safetensors\","
                      "\"layers.0.ffn.gate.tid2eid\":\"model-00001-of-00002.safetensors\","
                      "\"layers.1.w\":\"model-00002-of-00002.safetensors\"}}";
    write_bytes(ip, idx, strlen(idx));
    CHECK(ds4_model_dir_open(dir, &d) == DS4_OK, "%s", ds4_errmsg());
    if (d) {
        CHECK(ds4_model_dir_nfiles(d) == 2);
        float out[8];
        int64_t sh[2] = {2, 4};
        CHECK(ds4_model_dir_read_f32(d, "layers.1.w", 2, sh, out) == DS4_OK && out[0] == -1);
        ds4_model_dir_close(d);
    }
    const char *lie = "{\"weight_map\":{\"layers.1.w\":\"model-00001-of-00002.safetensors\"}}";
    write_bytes(ip, lie, strlen(lie));
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has(ip) && msg_has("'layers.1.w'"), "%s", ds4_errmsg());
    const char *ghost = "{\"weight_map\":{\"layers.7.w\":\"model-00001-of-00002.safetensors\"}}";
    write_bytes(ip, ghost, strlen(ghost));
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has("'layers.7.w'") && msg_has("no shard"));
    const char *escape = "{\"weight_map\":{\"layers.1.w\":\"../x.safetensors\"}}";
    write_bytes(ip, escape, strlen(escape));
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has("'layers.1.w'"), "%s", ds4_errmsg());
    const char *missing = "{\"weight_map\":{\"layers.1.w\":\"model-9.safetensors\"}}";
    write_bytes(ip, missing, strlen(missing));
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_IO && msg_has("model-9.safetensors"));
    write_bytes(ip, "{\"weight_map\": 3}", 17);
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has(ip));
    write_bytes(ip, "{", 1);
    CHECK(ds4_model_dir_open(dir, &d) == DS4_ERR_FORMAT && msg_has(ip));
    CHECK(d == NULL);
}

/* ---------------------------------------------------------------- fuzz */

static uint64_t fz_state;
static uint64_t fz_next(void) {
    fz_state = fz_state * 6364136223846793005ull + 1442695040888963407ull;
    return fz_state >> 17;
}

/* Random byte flips, byte sets, truncations, length-field edits and JSON-significant characters. */
static size_t mutate(uint8_t *buf, size_t n, size_t cap, bool has_len_field) {
    static const char special[] = "{}[]\",:0123456789-.e \\";
    int k = 1 + (int)(fz_next() % 4);
    for (int j = 0; j < k && n > 0; j++) {
        switch (fz_next() % 6) {
        case 0: buf[fz_next() % n] ^= (uint8_t)(1u << (fz_next() % 8)); break;
        case 1: buf[fz_next() % n] = (uint8_t)fz_next(); break;
        case 2: n = fz_next() % n; break;
        case 3:
            if (has_len_field && n >= 8) {
                uint64_t v = 0;
                for (int i = 0; i < 8; i++) v |= (uint64_t)buf[i] << (8 * i);
                int sel = (int)(fz_next() % 3);
                v = sel == 0 ? v + (fz_next() % 17) - 8 : sel == 1 ? fz_next() % (n + 16) : fz_next() << (fz_next() % 24);
                for (int i = 0; i < 8; i++) buf[i] = (uint8_t)(v >> (8 * i));
            }
            break;
        case 4: buf[fz_next() % n] = (uint8_t)special[fz_next() % (sizeof special - 1)]; break;
        case 5:
            if (n < cap) { /* duplicate a byte range: grows the text */
                size_t at = fz_next() % n, len = 1 + fz_next() % 8;
                if (n + len > cap) len = cap - n;
                memmove(buf + at + len, buf + at, n - at);
                n += len;
            }
            break;
        }
    }
    return n;
}

static void test_fuzz(void) {
    /* a small valid safetensors file */
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    float a[6] = {1, 2, 3, 4, 5, 6};
    int64_t sa[2] = {2, 3}, sb[1] = {4};
    int64_t ids[4] = {0, 1, 2, 3};
    ds4_st_writer_add(w, "layers.0.w.weight", DS4_F32, 2, sa, a);
    ds4_st_writer_add(w, "layers.0.w.scale", DS4_F8_E8M0, 1, sb, a);
    ds4_st_writer_add(w, "q.weight", DS4_F8_E4M3, 1, sb, a);
    ds4_st_writer_add(w, "b", DS4_BF16, 2, sa, a);
    ds4_st_writer_add(w, "tid2eid", DS4_I64, 1, sb, ids);
    const char *good = tpath("fz_good.safetensors");
    CHECK(ds4_st_writer_write(w, good) == DS4_OK);
    ds4_st_writer_free(w);
    char *st;
    size_t st_n;
    CHECK(ds4_read_file(good, &st, &st_n) == DS4_OK);
    char *cfg;
    size_t cfg_n;
    CHECK(ds4_read_file(find_config("tests/configs/tiny-a.json"), &cfg, &cfg_n) == DS4_OK);
    if (!st || !cfg) return;

    fz_state = 12345;
    size_t cap = st_n + 256 > cfg_n + 256 ? st_n + 256 : cfg_n + 256;
    uint8_t *buf = malloc(cap);
    const char *path = tpath("fz.safetensors");
    int ok = 0, err = 0, bad = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, st, st_n);
        size_t n = mutate(buf, st_n, st_n + 256, true);
        write_bytes(path, buf, n);
        ds4_st_file *f = NULL;
        ds4_status s = ds4_st_open(path, &f);
        if (s == DS4_OK) {
            ok++;
            /* touch every tensor through the typed readers */
            for (int64_t i = 0; i < ds4_st_count(f); i++) {
                const ds4_st_entry *e = ds4_st_entry_at(f, i);
                int64_t numel = ds4_st_entry_numel(e);
                if (numel > (1 << 20)) continue;
                float *o = malloc((size_t)(numel ? numel : 1) * sizeof(double) * 2);
                int64_t shp[2] = {e->ndim > 0 ? e->shape[0] : 1, e->ndim > 1 ? e->shape[1] : 1};
                (void)ds4_st_read_f32(f, e->name, e->ndim, e->shape, o);
                (void)ds4_st_read_f32(f, e->name, 2, shp, o);
                (void)ds4_st_read_i64(f, e->name, e->ndim, e->shape, (int64_t *)o);
                free(o);
            }
            ds4_st_close(f);
        } else {
            err++;
            bad += f != NULL || ds4_errmsg()[0] == '\0';
        }
    }
    CHECK(bad == 0, "%d failures left an open file or no message", bad);
    CHECK(ok > 0 && err > 0, "ok %d, err %d: mutations should produce both", ok, err);
    int cok = 0, cerr = 0, cbad = 0;
    for (int it = 0; it < 3000; it++) {
        memcpy(buf, cfg, cfg_n);
        size_t n = mutate(buf, cfg_n, cfg_n + 256, false);
        ds4_config c;
        ds4_status s = ds4_config_parse((const char *)buf, n, "fz.json", &c);
        if (s == DS4_OK) cok++, cbad += ds4_config_validate(&c, "fz.json") != DS4_OK;
        else cerr++, cbad += !msg_has("fz.json");
    }
    CHECK(cbad == 0 && cerr > 0 && cok > 0, "config fuzz: ok %d err %d bad %d", cok, cerr, cbad);
    if (getenv("DS4_TEST_VERBOSE")) t_note("fuzz: safetensors ok %d err %d; config ok %d err %d", ok, err, cok, cerr);
    free(buf);
    ds4_free(st);
    ds4_free(cfg);
}

/* ---------------------------------------------------------------- transformers config spelling */

/* tests/configs/tiny-a.json in the spelling of the transformers DeepseekV4Config, plus the keys
 * transformers writes that ds4 ignores. compress_ratios [0, 4, 16, 4, 0] -> layer_types (no MTP
 * entry) + compress_rates; num_hash_layers 1 -> mlp_layer_types; qk_rope_head_dim 8 of head_dim 32
 * -> partial_rotary_factor 0.25; rope_scaling -> rope_parameters (YaRN on the compressed layers). */
static const char k_tiny_a_hf[] =
    "{\"architectures\": [\"DeepseekV4ForCausalLM\"], \"model_type\": \"deepseek_v4\", \"transformers_version\": \"5.0.0\","
    " \"vocab_size\": 256, \"hidden_size\": 64, \"num_hidden_layers\": 4, \"num_nextn_predict_layers\": 1,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 1, \"head_dim\": 32, \"q_lora_rank\": 32,"
    " \"o_groups\": 2, \"o_lora_rank\": 16, \"sliding_window\": 16,"
    " \"layer_types\": [\"sliding_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\","
    " \"compressed_sparse_attention\"],"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 16},"
    " \"mlp_layer_types\": [\"hash_moe\", \"moe\", \"moe\", \"moe\"],"
    " \"partial_rotary_factor\": 0.25,"
    " \"index_n_heads\": 2, \"index_head_dim\": 16, \"index_topk\": 4,"
    " \"n_routed_experts\": 8, \"n_shared_experts\": 1, \"num_experts_per_tok\": 2, \"moe_intermediate_size\": 32,"
    " \"scoring_func\": \"sqrtsoftplus\", \"norm_topk_prob\": true, \"routed_scaling_factor\": 1.5, \"swiglu_limit\": 10.0,"
    " \"hc_mult\": 4, \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-6, \"rms_norm_eps\": 1e-6,"
    " \"rope_theta\": 10000, \"compress_rope_theta\": 160000,"
    " \"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"rope_theta\": 10000, \"partial_rotary_factor\": 0.25},"
    " \"compress\": {\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 16, \"beta_fast\": 32,"
    " \"beta_slow\": 1, \"rope_theta\": 160000, \"partial_rotary_factor\": 0.25, \"attention_factor\": 1.0}},"
    " \"max_position_embeddings\": 4096, \"bos_token_id\": 0, \"eos_token_id\": 1, \"pad_token_id\": null,"
    " \"hidden_act\": \"silu\", \"tie_word_embeddings\": false, \"dtype\": \"float32\", \"use_cache\": true,"
    " \"attention_bias\": false, \"mlp_bias\": false, \"attention_dropout\": 0.0, \"initializer_range\": 0.02,"
    " \"output_router_logits\": false, \"router_aux_loss_coef\": 0.001, \"router_jitter_noise\": 0.0,"
    " \"mtp_loss_weight\": 0.3, \"indexer_loss_coeff\": 0.01, \"csa_dense\": false}";

#define YARN_COMPRESS "\"compress\": {\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 16, " \
                      "\"beta_fast\": 32, \"beta_slow\": 1}"

/* The transformers spelling loads to the very struct of the DeepSeek spelling; so do the other
 * rope_parameters forms transformers accepts. */
static void test_hf_config_equivalent(void) {
    ds4_config a, b;
    CHECK(ds4_config_load(find_config("tests/configs/tiny-a.json"), &a) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_config_parse(k_tiny_a_hf, strlen(k_tiny_a_hf), "hf.json", &b) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(&a, &b, sizeof a) == 0, "transformers-spelled tiny-a differs from tiny-a");
    CHECK(b.compress_ratios[2] == 16 && b.compress_ratios[4] == 0 && b.n_hash_layers == 1 && b.rope_head_dim == 8);
    CHECK(b.original_seq_len == 16 && b.rope_factor == 4 && b.beta_fast == 32 && b.beta_slow == 1);
    static const mutation same[] = {
        /* flat: the YaRN keys of the compressed layers only */
        {M_RAW, "rope_parameters", 0, "{\"rope_type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 16, "
                                      "\"beta_fast\": 32, \"beta_slow\": 1}", DS4_OK, ""},
        /* nested, with the top-level rope_type leftover, "type" for "rope_type", no theta / factor copies */
        {M_RAW, "rope_parameters", 0, "{\"rope_type\": \"default\", \"main\": {\"type\": \"default\"}, " YARN_COMPRESS "}", DS4_OK, ""},
    };
    for (size_t i = 0; i < sizeof same / sizeof same[0]; i++) {
        cJSON *r = cJSON_Parse(k_tiny_a_hf);
        cJSON_ReplaceItemInObjectCaseSensitive(r, same[i].key, cJSON_CreateRaw(same[i].str));
        char *t = cJSON_PrintUnformatted(r);
        cJSON_Delete(r);
        memset(&b, 0xa5, sizeof b);
        CHECK(ds4_config_parse(t, strlen(t), "hf.json", &b) == DS4_OK && memcmp(&a, &b, sizeof a) == 0, "variant %zu: %s", i,
              ds4_errmsg());
        cJSON_free(t);
    }
    /* rope_parameters null: no YaRN anywhere */
    mutation m = {M_RAW, "rope_parameters", 0, "null", DS4_OK, ""};
    CHECK(parse_mutated(k_tiny_a_hf, &m) == DS4_OK, "%s", ds4_errmsg());
}

/* Every transformers-specific rule fails with a message that names the key. */
static void test_hf_config_errors(void) {
    static const mutation ms[] = {
        /* both spellings of one setting: accepted when they agree (save_pretrained writes qk_rope_head_dim beside
         * partial_rotary_factor), one error naming both keys when they do not */
        {M_ADD_RAW, "compress_ratios", 0, "[0, 4, 16, 4, 0]", DS4_OK, ""},
        {M_ADD_RAW, "num_hash_layers", 0, "1", DS4_OK, ""},
        {M_ADD_RAW, "qk_rope_head_dim", 0, "8", DS4_OK, ""},
        {M_ADD_RAW, "rope_scaling", 0, "{\"type\": \"yarn\", \"factor\": 4, \"original_max_position_embeddings\": 16, "
                                    "\"beta_fast\": 32, \"beta_slow\": 1}", DS4_OK, ""},
        {M_ADD_RAW, "compress_ratios", 0, "[0, 4, 32, 4, 0]", DS4_ERR_CONFIG,
         "key 'compress_ratios' entry 2 is 32, but keys 'layer_types' + 'compress_rates' give 16: the two spellings disagree"},
        {M_ADD_RAW, "compress_ratios", 0, "[0, 4, 16, 4]", DS4_ERR_CONFIG, "key 'compress_ratios' has 4 entries"},
        {M_ADD_RAW, "num_hash_layers", 0, "2", DS4_ERR_CONFIG,
         "key 'num_hash_layers' is 2, but key 'mlp_layer_types' has 1 \"hash_moe\" layers: the two spellings disagree"},
        {M_ADD_RAW, "qk_rope_head_dim", 0, "16", DS4_ERR_CONFIG,
         "key 'qk_rope_head_dim' is 16, but key 'partial_rotary_factor' (0.25) * head_dim (32) is 8: the two spellings disagree"},
        {M_ADD_RAW, "rope_scaling", 0, "null", DS4_ERR_CONFIG,
         "keys 'rope_scaling' and 'rope_parameters' give different YaRN settings"},
        /* unknown keys: the hint comes from the transformers spelling */
        {M_ADD_RAW, "mlp_layer_type", 0, "[]", DS4_ERR_CONFIG, "unknown key 'mlp_layer_type' (did you mean 'mlp_layer_types'?)"},
        {M_ADD_RAW, "compress_rate", 0, "{}", DS4_ERR_CONFIG, "did you mean 'compress_rates'"},
        {M_ADD_RAW, "rope_parameter", 0, "{}", DS4_ERR_CONFIG, "did you mean 'rope_parameters'"},
        {M_ADD_RAW, "index_top_k", 0, "4", DS4_ERR_CONFIG, "did you mean 'index_topk'"},
        /* required keys */
        {M_DEL, "compress_rates", 0, 0, DS4_ERR_CONFIG, "required key 'compress_rates' is missing"},
        {M_DEL, "mlp_layer_types", 0, 0, DS4_ERR_CONFIG, "required key 'mlp_layer_types' is missing"},
        {M_DEL, "partial_rotary_factor", 0, 0, DS4_ERR_CONFIG, "required key 'partial_rotary_factor' is missing"},
        {M_DEL, "model_type", 0, 0, DS4_ERR_CONFIG, "model_type \"deepseek_v4\""},
        {M_STR, "model_type", 0, "deepseek_v3", DS4_ERR_CONFIG, "model_type \"deepseek_v4\""},
        /* layer_types / compress_rates */
        {M_RAW, "layer_types", 0, "[\"sliding_attention\"]", DS4_ERR_CONFIG, "'layer_types' has 1 entries, expected num_hidden_layers = 4"},
        {M_RAW, "layer_types", 0, "[\"sliding_attention\", \"compressed_sparse_attention\", \"heavily_compressed_attention\", "
                                  "\"compressed_sparse_attention\", \"sliding_attention\"]", DS4_ERR_CONFIG, "has 5 entries"},
        {M_RAW, "layer_types", 0, "[\"sliding_attention\", \"full_attention\", \"sliding_attention\", \"sliding_attention\"]",
         DS4_ERR_CONFIG, "'layer_types' entry 1 must be"},
        {M_RAW, "layer_types", 0, "[0, 4, 16, 4]", DS4_ERR_CONFIG, "'layer_types' entry 0 must be"},
        {M_RAW, "layer_types", 0, "{}", DS4_ERR_CONFIG, "'layer_types' must be an array"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": 8, \"heavily_compressed_attention\": 16}", DS4_ERR_CONFIG,
         "'compress_rates.compressed_sparse_attention' is 8, ds4 runs compressed sparse attention at ratio 4 only"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 4}", DS4_ERR_CONFIG,
         "'compress_rates.heavily_compressed_attention' is 4, must be >= 2 and not 4"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 1}", DS4_ERR_CONFIG,
         "'compress_rates.heavily_compressed_attention' is 1"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": 4}", DS4_ERR_CONFIG,
         "required key 'compress_rates.heavily_compressed_attention' is missing"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": 4, \"heavily_compressed_attention\": 16, \"sliding_attention\": 0}",
         DS4_ERR_CONFIG, "unknown key 'compress_rates.sliding_attention'"},
        {M_RAW, "compress_rates", 0, "{\"compressed_sparse_attention\": \"4\", \"heavily_compressed_attention\": 16}", DS4_ERR_CONFIG,
         "'compress_rates.compressed_sparse_attention' must be an integer"},
        /* mlp_layer_types */
        {M_RAW, "mlp_layer_types", 0, "[\"moe\", \"hash_moe\", \"moe\", \"moe\"]", DS4_ERR_CONFIG,
         "'mlp_layer_types' entry 1 is \"hash_moe\" after a \"moe\" layer"},
        {M_RAW, "mlp_layer_types", 0, "[\"hash_moe\", \"dense\", \"moe\", \"moe\"]", DS4_ERR_CONFIG,
         "'mlp_layer_types' entry 1 must be \"hash_moe\" or \"moe\""},
        {M_RAW, "mlp_layer_types", 0, "[\"hash_moe\", \"moe\", \"moe\"]", DS4_ERR_CONFIG, "'mlp_layer_types' has 3 entries"},
        /* partial_rotary_factor (validation names it, not qk_rope_head_dim) */
        {M_NUM, "partial_rotary_factor", 0.3, 0, DS4_ERR_CONFIG, "is not a whole number of channels"},
        {M_NUM, "partial_rotary_factor", 0, 0, DS4_ERR_CONFIG, "'partial_rotary_factor' is 0, must be in (0, 1]"},
        {M_NUM, "partial_rotary_factor", 1.5, 0, DS4_ERR_CONFIG, "must be in (0, 1]"},
        {M_NUM, "partial_rotary_factor", 0.15625, 0, DS4_ERR_CONFIG,
         "'rope_parameters.main.partial_rotary_factor' (0.25) disagrees with key 'partial_rotary_factor' (0.15625)"},
        /* rope_parameters */
        {M_RAW, "rope_parameters", 0, "{\"main\": {\"rope_theta\": 5000}, " YARN_COMPRESS "}", DS4_ERR_CONFIG,
         "'rope_parameters.main.rope_theta' (5000) disagrees with key 'rope_theta' (10000)"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, \"compress\": {\"rope_theta\": 10000}}", DS4_ERR_CONFIG,
         "'rope_parameters.compress.rope_theta' (10000) disagrees with key 'compress_rope_theta'"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {\"partial_rotary_factor\": 0.5}, " YARN_COMPRESS "}", DS4_ERR_CONFIG,
         "'rope_parameters.main.partial_rotary_factor' (0.5) disagrees"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {\"rope_type\": \"yarn\"}, " YARN_COMPRESS "}", DS4_ERR_CONFIG,
         "'rope_parameters.main.rope_type' is \"yarn\""},
        {M_RAW, "rope_parameters", 0, "{\"main\": {\"factor\": 4}, " YARN_COMPRESS "}", DS4_ERR_CONFIG,
         "unknown key 'rope_parameters.main.factor'"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, \"compress\": {\"rope_type\": \"yarn\", \"factor\": 4, "
                                      "\"original_max_position_embeddings\": 16, \"beta_fast\": 32}}", DS4_ERR_CONFIG,
         "required key 'rope_parameters.compress.beta_slow' is missing"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, \"compress\": {\"factor\": 4}}", DS4_ERR_CONFIG,
         "'rope_parameters.compress.factor' is set but 'rope_parameters.compress.rope_type' is \"default\""},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, \"compress\": {\"rope_type\": \"yarn\", \"factor\": 4, "
                                      "\"original_max_position_embeddings\": 16, \"beta_fast\": 32, \"beta_slow\": 1, "
                                      "\"attention_factor\": 1.2772588722239781}}", DS4_ERR_CONFIG,
         "'rope_parameters.compress.attention_factor' is 1.27726"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, \"compress\": {\"rope_type\": \"yarn\", \"factor\": 4, "
                                      "\"original_max_position_embeddings\": 16, \"beta_fast\": 32, \"beta_slow\": 1, \"mscale\": 1}}",
         DS4_ERR_CONFIG, "unknown key 'rope_parameters.compress.mscale'"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}, " YARN_COMPRESS ", \"truncate\": false}", DS4_ERR_CONFIG,
         "unknown key 'rope_parameters.truncate'"},
        {M_RAW, "rope_parameters", 0, "{\"main\": {}}", DS4_ERR_CONFIG, "required key 'rope_parameters.compress' is missing"},
        {M_RAW, "rope_parameters", 0, "{\"rope_type\": \"linear\", \"factor\": 2}", DS4_ERR_CONFIG,
         "'rope_parameters.rope_type' is \"linear\""},
        {M_RAW, "rope_parameters", 0, "{\"rope_type\": \"yarn\", \"type\": \"default\"}", DS4_ERR_CONFIG,
         "'rope_parameters.rope_type' and 'rope_parameters.type' disagree"},
        {M_RAW, "rope_parameters", 0, "[]", DS4_ERR_CONFIG, "'rope_parameters' must be an object or null"},
        /* shared rules still hold, and the ignored transformers keys are type-checked */
        {M_BOOL, "mlp_bias", 1, 0, DS4_ERR_CONFIG, "mlp_bias"},
        {M_STR, "pad_token_id", 0, "0", DS4_ERR_CONFIG, "'pad_token_id' must be an integer or null"},
        {M_NUM, "num_key_value_heads", 8, 0, DS4_ERR_CONFIG, "num_key_value_heads"},
        {M_NUM, "num_hidden_layers", 3, 0, DS4_ERR_CONFIG, "'layer_types' has 4 entries, expected num_hidden_layers = 3"},
        /* accepted */
        {M_NUM, "pad_token_id", 3, 0, DS4_OK, ""},
        {M_DEL, "dtype", 0, 0, DS4_OK, ""},
        {M_DEL, "rope_parameters", 0, 0, DS4_OK, ""},
    };
    for (size_t i = 0; i < sizeof ms / sizeof ms[0]; i++) {
        ds4_status s = parse_mutated(k_tiny_a_hf, &ms[i]);
        CHECK(s == ms[i].code, "hf mutation %zu (%s): got %s: %s", i, ms[i].key, ds4_status_name(s), ds4_errmsg());
        if (s != DS4_OK) CHECK(msg_has("mut.json") && msg_has(ms[i].needle), "hf mutation %zu: '%s' lacks '%s'", i, ds4_errmsg(),
                               ms[i].needle);
    }
    /* validation names partial_rotary_factor where DeepSeek's config would say qk_rope_head_dim */
    cJSON *flat = cJSON_Parse(k_tiny_a_hf);
    cJSON_ReplaceItemInObjectCaseSensitive(flat, "rope_parameters", cJSON_CreateNull());
    char *flat_text = cJSON_PrintUnformatted(flat);
    cJSON_Delete(flat);
    mutation odd = {M_NUM, "partial_rotary_factor", 0.15625, 0, DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(flat_text, &odd) == DS4_ERR_CONFIG && msg_has("key 'partial_rotary_factor' * 'head_dim' is 5, must be even"),
          "%s", ds4_errmsg());
    mutation wide = {M_NUM, "partial_rotary_factor", 1.0, 0, DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(flat_text, &wide) == DS4_ERR_CONFIG &&
          msg_has("key 'partial_rotary_factor' * 'head_dim' (32) exceeds index_head_dim (16)"), "%s", ds4_errmsg());
    cJSON_free(flat_text);
    /* a typo of a DeepSeek-only key in a transformers config is not "corrected" into a mixed config */
    mutation typo = {M_ADD_RAW, "qk_rope_head_dims", 0, "8", DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(k_tiny_a_hf, &typo) == DS4_ERR_CONFIG && msg_has("unknown key 'qk_rope_head_dims'") &&
          !msg_has("'qk_rope_head_dim'"), "%s", ds4_errmsg());
    /* transformers keys beside DeepSeek's in DeepSeek's config: the same model when they agree, one error
     * naming both keys when they do not */
    char *off;
    size_t n;
    CHECK(ds4_read_file(find_config("tests/configs/tiny-a.json"), &off, &n) == DS4_OK);
    if (!off) return;
    ds4_config plain, both;
    CHECK(ds4_config_parse(off, n, "off.json", &plain) == DS4_OK, "%s", ds4_errmsg());
    mutation add_mlp = {M_ADD_RAW, "mlp_layer_types", 0, "[\"hash_moe\", \"moe\", \"moe\", \"moe\"]", DS4_OK, ""};
    CHECK(parse_mutated_into(off, &add_mlp, &both) == DS4_OK && memcmp(&plain, &both, sizeof both) == 0, "%s", ds4_errmsg());
    mutation add_prf = {M_ADD_RAW, "partial_rotary_factor", 0, "0.25", DS4_OK, ""};
    CHECK(parse_mutated_into(off, &add_prf, &both) == DS4_OK && memcmp(&plain, &both, sizeof both) == 0, "%s", ds4_errmsg());
    mutation add_types = {M_ADD_RAW, "layer_types", 0, "[\"sliding_attention\", \"compressed_sparse_attention\", "
                          "\"heavily_compressed_attention\", \"compressed_sparse_attention\"]", DS4_OK, ""};
    CHECK(parse_mutated_into(off, &add_types, &both) == DS4_ERR_CONFIG && msg_has("required key 'compress_rates' is missing"),
          "%s", ds4_errmsg());
    mutation bad_mlp = {M_ADD_RAW, "mlp_layer_types", 0, "[\"hash_moe\", \"hash_moe\", \"moe\", \"moe\"]", DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(off, &bad_mlp) == DS4_ERR_CONFIG && msg_has("key 'num_hash_layers' is 1, but key 'mlp_layer_types' has 2"),
          "%s", ds4_errmsg());
    mutation bad_prf = {M_ADD_RAW, "partial_rotary_factor", 0, "0.5", DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(off, &bad_prf) == DS4_ERR_CONFIG && msg_has("key 'qk_rope_head_dim' is 8") &&
          msg_has("key 'partial_rotary_factor' (0.5)"), "%s", ds4_errmsg());
    /* and DeepSeek's config still hints DeepSeek keys */
    mutation ds_typo = {M_ADD_RAW, "compress_ratio", 0, "[]", DS4_ERR_CONFIG, ""};
    CHECK(parse_mutated(off, &ds_typo) == DS4_ERR_CONFIG && msg_has("did you mean 'compress_ratios'"), "%s", ds4_errmsg());
    ds4_free(off);
}

/* Parses printed JSON of r into c. */
static ds4_status parse_tree(const cJSON *r, ds4_config *c) {
    char *t = cJSON_PrintUnformatted(r);
    ds4_status s = ds4_config_parse(t, strlen(t), "tree.json", c);
    cJSON_free(t);
    return s;
}


static const char *str_at(const cJSON *arr, int i) {
    const cJSON *e = cJSON_GetArrayItem(arr, i);
    return cJSON_IsString(e) ? e->valuestring : "";
}

/* ds4_config_json_respell: DeepSeek -> transformers -> DeepSeek keeps the struct, writes what
 * transformers' DeepseekV4Config reads, and refuses what it cannot carry. */
static void test_hf_config_respell(void) {
    const char *files[] = {"configs/deepseek-v4-flash.json", "configs/deepseek-v4-pro.json", "tests/configs/tiny-a.json",
                           "tests/configs/tiny-b.json"};
    for (int f = 0; f < 4; f++) {
        ds4_config a, b;
        CHECK(ds4_config_load(find_config(files[f]), &a) == DS4_OK, "%s", ds4_errmsg());
        cJSON *r = load_tree(find_config(files[f]));
        CHECK(r != NULL);
        if (!r) continue;
        CHECK(ds4_config_json_respell(r, true, files[f]) == DS4_OK, "%s: %s", files[f], ds4_errmsg());
        CHECK(!cJSON_GetObjectItem(r, "compress_ratios") && !cJSON_GetObjectItem(r, "num_hash_layers") &&
              !cJSON_GetObjectItem(r, "qk_rope_head_dim") && !cJSON_GetObjectItem(r, "rope_scaling"), "%s", files[f]);
        CHECK(parse_tree(r, &b) == DS4_OK && memcmp(&a, &b, sizeof a) == 0, "%s: transformers spelling differs: %s", files[f],
              ds4_errmsg());
        /* respelling into the spelling it has changes nothing */
        char *t1 = cJSON_PrintUnformatted(r);
        CHECK(ds4_config_json_respell(r, true, files[f]) == DS4_OK);
        char *t2 = cJSON_PrintUnformatted(r);
        CHECK(strcmp(t1, t2) == 0);
        cJSON_free(t1);
        cJSON_free(t2);
        CHECK(ds4_config_json_respell(r, false, files[f]) == DS4_OK, "%s", ds4_errmsg());
        CHECK(!cJSON_GetObjectItem(r, "layer_types") && !cJSON_GetObjectItem(r, "compress_rates") &&
              !cJSON_GetObjectItem(r, "mlp_layer_types") && !cJSON_GetObjectItem(r, "partial_rotary_factor") &&
              !cJSON_GetObjectItem(r, "rope_parameters"), "%s", files[f]);
        memset(&b, 0, sizeof b);
        CHECK(parse_tree(r, &b) == DS4_OK && memcmp(&a, &b, sizeof a) == 0, "%s: back in DeepSeek's spelling differs", files[f]);
        cJSON_Delete(r);
    }
    /* Flash: the layer schedule transformers derives from compress_ratios (0/4/128 -> SWA/CSA/HCA) */
    cJSON *r = load_tree(find_config("configs/deepseek-v4-flash.json"));
    if (!r) return;
    CHECK(ds4_config_json_respell(r, true, "flash") == DS4_OK);
    const cJSON *lt = cJSON_GetObjectItem(r, "layer_types"), *mt = cJSON_GetObjectItem(r, "mlp_layer_types");
    const cJSON *cr = cJSON_GetObjectItem(r, "compress_rates"), *rp = cJSON_GetObjectItem(r, "rope_parameters");
    CHECK(cJSON_GetArraySize(lt) == 43 && cJSON_GetArraySize(mt) == 43);
    CHECK(!strcmp(str_at(lt, 0), "sliding_attention") && !strcmp(str_at(lt, 1), "sliding_attention") &&
          !strcmp(str_at(lt, 2), "compressed_sparse_attention") && !strcmp(str_at(lt, 3), "heavily_compressed_attention") &&
          !strcmp(str_at(lt, 42), "compressed_sparse_attention"));
    CHECK(!strcmp(str_at(mt, 2), "hash_moe") && !strcmp(str_at(mt, 3), "moe"));
    CHECK(cJSON_GetObjectItem(cr, "compressed_sparse_attention")->valuedouble == 4 &&
          cJSON_GetObjectItem(cr, "heavily_compressed_attention")->valuedouble == 128);
    CHECK(cJSON_GetObjectItem(r, "partial_rotary_factor")->valuedouble == 0.125);
    const cJSON *cmp = cJSON_GetObjectItem(rp, "compress"), *mn = cJSON_GetObjectItem(rp, "main");
    CHECK(cmp && !strcmp(cJSON_GetObjectItem(cmp, "rope_type")->valuestring, "yarn") &&
          cJSON_GetObjectItem(cmp, "attention_factor")->valuedouble == 1.0 &&
          cJSON_GetObjectItem(cmp, "rope_theta")->valuedouble == 160000 && cJSON_GetObjectItem(cmp, "factor")->valuedouble == 16 &&
          cJSON_GetObjectItem(cmp, "original_max_position_embeddings")->valuedouble == 65536);
    CHECK(mn && !strcmp(cJSON_GetObjectItem(mn, "rope_type")->valuestring, "default") &&
          cJSON_GetObjectItem(mn, "rope_theta")->valuedouble == 10000 && !cJSON_GetObjectItem(mn, "factor"));
    CHECK(!strcmp(cJSON_GetObjectItem(r, "model_type")->valuestring, "deepseek_v4"));
    cJSON_Delete(r);
    /* two HCA ratios: the transformers spelling has one rate per layer type; the tree stays as it was */
    r = load_tree(find_config("tests/configs/tiny-a.json"));
    if (!r) return;
    cJSON_ReplaceItemInObjectCaseSensitive(r, "compress_ratios", cJSON_Parse("[0, 4, 16, 8, 0]"));
    char *before = cJSON_PrintUnformatted(r);
    CHECK(ds4_config_json_respell(r, true, "two.json") == DS4_ERR_CONFIG && msg_has("two.json") && msg_has("layers 2 and 3") &&
          msg_has("one rate"), "%s", ds4_errmsg());
    char *after = cJSON_PrintUnformatted(r);
    CHECK(strcmp(before, after) == 0);
    cJSON_free(before);
    cJSON_free(after);
    /* an invalid config is refused, not respelled */
    cJSON_ReplaceItemInObjectCaseSensitive(r, "compress_ratios", cJSON_Parse("[0, 4]"));
    CHECK(ds4_config_json_respell(r, true, "bad.json") == DS4_ERR_CONFIG && msg_has("compress_ratios"));
    cJSON_Delete(r);
    /* a config without YaRN: rope_parameters.compress stays "default" */
    ds4_config a, b;
    CHECK(ds4_config_load(find_config("tests/configs/tiny-a.json"), &a) == DS4_OK);
    a.original_seq_len = 0, a.rope_factor = 1, a.beta_fast = a.beta_slow = 0;
    CHECK(ds4_config_save(&a, tpath("noyarn.json")) == DS4_OK);
    r = load_tree(tpath("noyarn.json"));
    if (!r) return;
    CHECK(ds4_config_json_respell(r, true, "noyarn") == DS4_OK, "%s", ds4_errmsg());
    cmp = cJSON_GetObjectItem(cJSON_GetObjectItem(r, "rope_parameters"), "compress");
    CHECK(cmp && !strcmp(cJSON_GetObjectItem(cmp, "rope_type")->valuestring, "default") && !cJSON_GetObjectItem(cmp, "factor"));
    CHECK(parse_tree(r, &b) == DS4_OK && memcmp(&a, &b, sizeof a) == 0);
    cJSON_Delete(r);
}

/* The mutation fuzz of the config parser, on the transformers spelling. */
static void test_hf_config_fuzz(void) {
    size_t n0 = strlen(k_tiny_a_hf), cap = n0 + 256;
    uint8_t *buf = malloc(cap);
    fz_state = 777;
    int ok = 0, err = 0, bad = 0;
    for (int it = 0; it < 2000; it++) {
        memcpy(buf, k_tiny_a_hf, n0);
        size_t n = mutate(buf, n0, cap, false);
        ds4_config c;
        if (ds4_config_parse((const char *)buf, n, "fzh.json", &c) == DS4_OK) ok++, bad += ds4_config_validate(&c, "fzh.json") != DS4_OK;
        else err++, bad += !msg_has("fzh.json");
    }
    CHECK(bad == 0 && ok > 0 && err > 0, "hf config fuzz: ok %d err %d bad %d", ok, err, bad);
    free(buf);
}

/* Every allocation made by the IO code, on success and error paths alike, was returned. */
static void test_no_leaks(void) {
    ds4_mem_stats m;
    ds4_mem_get(&m);
    CHECK(m.live_total == 0, "%lld bytes still live", (long long)m.live_total);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_io_XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_roundtrip_all_dtypes);
    RUN(test_read_errors);
    RUN(test_bad_headers);
    RUN(test_truncated);
    RUN(test_atomic_write);
    RUN(test_config_flash);
    RUN(test_config_0731);
    RUN(test_config_pro);
    RUN(test_config_tiny_files);
    RUN(test_config_roundtrip);
    RUN(test_config_errors);
    RUN(test_config_validate);
    RUN(test_model_dir);
    RUN(test_fuzz);
    RUN(test_hf_config_equivalent);
    RUN(test_hf_config_errors);
    RUN(test_hf_config_respell);
    RUN(test_hf_config_fuzz);
    RUN(test_no_leaks);
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_MAIN_END("test_io");
}
