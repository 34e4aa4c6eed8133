/* Hostile inputs: every one is refused with a one-line error naming the file, key or flag, and none
 * crashes, hangs or prints raw control bytes.
 *   sizes from input: a [0, 2^40, 2^40] tensor, heads x head_dim past 2^63 (both kept fuzz crashes),
 *     batch x sequence in memplan and ds4 eval, ds4 generate --max-new-tokens near INT64_MAX;
 *   absurd config.json values, each named with its allowed range;
 *   FIFOs (and devices) where a file is expected: config.json, a safetensors file, a shard, an entry
 *     of a model directory or a data glob — refused at once (an alarm fails a test that would hang);
 *   control bytes in names reach messages and ds4 inspect escaped; non-UTF-8 names are refused.
 * The CLI cases run build/ds4 (next to build/tests/). */
#include "ds4/data.h"
#include "ds4/decode.h"
#include "ds4/io.h"
#include "ds4/memplan.h"
#include "ds4/model.h"
#include "ds4/shard.h"
#include "test.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[256], g_ds4[512];
static const char *g_test = "?";

static const char *tpath(const char *name) {
    static char buf[8][600];
    static int k;
    char *p = buf[k++ & 7];
    snprintf(p, 600, "%s/%s", g_dir, name);
    return p;
}

/* A file shipped in the repository (tests run from its root, or below it). */
static const char *repo_file(const char *name) {
    static char buf[4][512];
    static int k;
    char *p = buf[k++ & 3];
    const char *roots[] = {".", "..", "../.."};
    for (int i = 0; i < 3; i++) {
        snprintf(p, 512, "%s/%s", roots[i], name);
        if (access(p, R_OK) == 0) return p;
    }
    return name;
}

static bool msg_has(const char *s) { return strstr(ds4_errmsg(), s) != NULL; }

static bool has_raw_control(const char *s, size_t n) {
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)s[i] < 0x20 && s[i] != '\n') return true;
    return false;
}

/* A test that would block forever fails instead: the alarm reports it and ends the run. */
static void on_alarm(int sig) {
    (void)sig;
    char line[256];
    int n = snprintf(line, sizeof line, "  FAIL %s: hung (alarm)\ntest_inputs: %d passed, %d failed\n", g_test, t_passed,
                     t_failed + 1);
    if (write(1, line, (size_t)n) < 0) _exit(2);
    _exit(1);
}
#define RUN_GUARDED(fn, seconds) \
    do {                         \
        g_test = #fn;            \
        alarm(seconds);          \
        RUN(fn);                 \
        alarm(0);                \
    } while (0)

/* Runs build/ds4 with argv (NULL-terminated); its stdout and stderr land in *out / *err (ds4_free
 * them). Returns the wait status. */
static int run_ds4(char *const argv[], char **out, char **err) {
    const char *po = tpath("cli.out"), *pe = tpath("cli.err");
    pid_t pid = fork();
    if (pid == 0) {
        int fo = open(po, O_WRONLY | O_CREAT | O_TRUNC, 0644), fe = open(pe, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fo < 0 || fe < 0 || dup2(fo, 1) < 0 || dup2(fe, 2) < 0) _exit(127);
        execv(g_ds4, argv);
        _exit(127);
    }
    int status = -1;
    waitpid(pid, &status, 0);
    size_t n;
    if (ds4_read_file(po, out, &n) != DS4_OK) *out = NULL;
    if (ds4_read_file(pe, err, &n) != DS4_OK) *err = NULL;
    return status;
}

/* Exited (no signal) with `code`, one "error:" line holding `needle` (when code != 0), no sanitizer report. */
static bool cli_result_is(int status, const char *err, int code, const char *needle) {
    if (!WIFEXITED(status) || WEXITSTATUS(status) != code || !err) return false;
    if (strstr(err, "Sanitizer") || strstr(err, "runtime error")) return false;
    if (code == 0) return true;
    const char *e = strstr(err, "error:");
    return e && !strstr(e + 1, "error:") && strstr(e, needle);
}

/* ---------------------------------------------------------------- sizes from input */

static ds4_status open_image_file(const char *path, ds4_st_file **f) {
    char *data;
    size_t n;
    DS4_TRY(ds4_read_file(path, &data, &n));
    ds4_status s = ds4_st_open_memory(data, n, "kept.safetensors", f);
    ds4_free(data);
    return s;
}

static ds4_status open_header(const char *header, const char *name, ds4_st_file **f) {
    size_t hl = strlen(header);
    uint8_t buf[1024] = {0};
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(buf + 8, header, hl);
    return ds4_st_open_memory(buf, 8 + hl + 16, name, f);
}

/* A tensor with no elements but dims whose product overflows is refused at open: readers take rows x
 * columns of any shape (the kept fuzz crash overflowed there). */
static void test_zero_dim_huge_shape(void) {
    ds4_st_file *f = NULL;
    ds4_status s = open_image_file(repo_file("tests/fuzz/regressions/safetensors/zero-dim-huge-cols"), &f);
    CHECK(s == DS4_ERR_FORMAT && f == NULL && msg_has("kept.safetensors") && msg_has("'t'") && msg_has("overflows"), "%s: %s",
          ds4_status_name(s), ds4_errmsg());
    ds4_st_close(f);
    f = NULL;
    /* fits in bytes as U8, not as the int64 / float a reader makes of it */
    s = open_header("{\"z\":{\"dtype\":\"U8\",\"shape\":[1099511627776,0,16777216],\"data_offsets\":[0,0]}}", "u8.safetensors", &f);
    CHECK(s == DS4_ERR_FORMAT && f == NULL && msg_has("u8.safetensors") && msg_has("'z'"), "%s", ds4_errmsg());
    ds4_st_close(f);
    f = NULL;
    /* a zero-element tensor whose other dims fit is fine, and reads as 0 rows */
    s = open_header("{\"e\":{\"dtype\":\"F32\",\"shape\":[0,1024,1024],\"data_offsets\":[0,0]}}", "ok.safetensors", &f);
    CHECK(s == DS4_OK, "%s", ds4_errmsg());
    ds4_tensor_loc loc;
    if (f) CHECK(ds4_st_locate(f, "e", &loc) == DS4_OK && loc.rows == 0 && loc.cols == 1024 * 1024);
    ds4_st_close(f);
}

/* The kept fuzz crash: num_attention_heads x head_dim past 2^63 is a range error, not an overflow. */
static void test_config_heads_overflow(void) {
    ds4_config c;
    const char *p = repo_file("tests/fuzz/regressions/config/heads-times-head-dim-overflow");
    ds4_status s = ds4_config_load(p, &c);
    CHECK(s == DS4_ERR_CONFIG && msg_has(p) && msg_has("'num_attention_heads' = 4294967296 is out of range [1, 1024]"), "%s: %s",
          ds4_status_name(s), ds4_errmsg());
}

static ds4_config tiny_config(void) {
    ds4_config c = {0};
    if (ds4_config_load(repo_file("tests/configs/tiny-a.json"), &c) != DS4_OK) t_note("tiny-a.json: %s", ds4_errmsg());
    return c;
}

/* memplan's batch x sequence comes from flags: an overflowing product is an argument error. */
static void test_memplan_batch_overflow(void) {
    ds4_config c = tiny_config();
    ds4_step_memory out;
    ds4_status s = ds4_step_memory_run(&c, (int64_t)1 << 62, 4, NULL, true, &out);
    CHECK(s == DS4_ERR_ARG && msg_has("memplan") && msg_has("4611686018427387904"), "%s: %s", ds4_status_name(s), ds4_errmsg());
    s = ds4_step_memory_run(&c, INT64_MAX, INT64_MAX, NULL, true, &out);
    CHECK(s == DS4_ERR_ARG, "%s: %s", ds4_status_name(s), ds4_errmsg());
}

/* A decoder length whose rope table (positions x frequencies x 4 bytes) passes 2^64 fails cleanly. */
static void test_decoder_huge_length(void) {
    ds4_config c = tiny_config();
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    ds4_decoder *dec = NULL;
    ds4_status s = ds4_decoder_new(m, (int64_t)1 << 62, &dec);   /* x 4 frequencies x 4 bytes wraps to 0 */
    CHECK(s != DS4_OK && dec == NULL, "%s", ds4_status_name(s));
    ds4_decoder_free(dec);
    ds4_model_free(m);
}

/* ---------------------------------------------------------------- config.json ranges */

/* tiny-a.json with `key` set to the raw JSON `value` (a '/'-separated path for nested keys). */
static ds4_status parse_with(const char *base, const char *key, const char *value) {
    cJSON *r = cJSON_Parse(base), *obj = r;
    char k[128];
    snprintf(k, sizeof k, "%s", key);
    char *slash = strchr(k, '/');
    if (slash) {
        *slash = 0;
        obj = cJSON_GetObjectItemCaseSensitive(r, k);
        memmove(k, slash + 1, strlen(slash + 1) + 1);
    }
    cJSON *v = cJSON_CreateRaw(value);
    if (cJSON_GetObjectItemCaseSensitive(obj, k)) cJSON_ReplaceItemInObjectCaseSensitive(obj, k, v);
    else cJSON_AddItemToObject(obj, k, v);
    char *text = cJSON_PrintUnformatted(r);
    cJSON_Delete(r);
    ds4_config c;
    ds4_status s = ds4_config_parse(text, strlen(text), "cfg.json", &c);
    cJSON_free(text);
    return s;
}

static void test_config_absurd_values(void) {
    char *base;
    size_t n;
    CHECK(ds4_read_file(repo_file("tests/configs/tiny-a.json"), &base, &n) == DS4_OK);
    if (!base) return;
    static const struct {
        const char *key, *value, *needle;
    } bad[] = {
        {"hc_mult", "1000", "key 'hc_mult' = 1000 is out of range [1, 16]"},
        {"hc_sinkhorn_iters", "1e15", "key 'hc_sinkhorn_iters' = 1000000000000000 is out of range [1, 100]"},
        {"hc_sinkhorn_iters", "1000000", "key 'hc_sinkhorn_iters' = 1000000 is out of range [1, 100]"},
        {"sliding_window", "1e12", "key 'sliding_window' = 1000000000000 is out of range [1, 65536]"},
        {"index_topk", "1e9", "key 'index_topk' = 1000000000 is out of range [1, 65536]"},
        {"hidden_size", "9007199254740992", "key 'hidden_size' = 9007199254740992 is out of range [1, 65536]"},
        {"compress_ratios", "[0, 4, 1e12, 4, 0]", "key 'compress_ratios' entry 2 is 1000000000000, must be 0 (window only) or in [2, 65536]"},
        {"n_routed_experts", "1e9", "key 'n_routed_experts' = 1000000000 is out of range [1, 2048]"},
        {"vocab_size", "1099511627776", "key 'vocab_size' = 1099511627776 is out of range [1, 16777216]"},
        {"num_attention_heads", "-3", "key 'num_attention_heads' = -3 is out of range [1, 1024]"},
        {"moe_intermediate_size", "0", "key 'moe_intermediate_size' = 0 is out of range [1, 65536]"},
        {"n_shared_experts", "-1", "key 'n_shared_experts' = -1 is out of range [0, 64]"},
        {"num_nextn_predict_layers", "5", "key 'num_nextn_predict_layers' = 5 is out of range [0, 1]"},
        {"max_position_embeddings", "1e10", "key 'max_position_embeddings' = 10000000000 is out of range [0, 16777216]"},
        {"rope_scaling/original_max_position_embeddings", "1e12",
         "key 'rope_scaling.original_max_position_embeddings' = 1000000000000 is out of range [0, 16777216]"},
        {"head_dim", "2.5", "key 'head_dim' must be an integer in [1, 4096], got 2.5"},
        {"head_dim", "1e300", "key 'head_dim' must be an integer in [1, 4096], got 1.0000000000000001e+300"},
        {"q_lora_rank", "-1e300", "key 'q_lora_rank' must be an integer in [1, 65536], got -1.0000000000000001e+300"},
        {"hc_mult", "\"4\"", "key 'hc_mult' must be an integer in [1, 16]"},
        {"o_groups", "null", "key 'o_groups' must be an integer in [1, 1024]"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_status s = parse_with(base, bad[i].key, bad[i].value);
        CHECK(s == DS4_ERR_CONFIG && msg_has("cfg.json: ") && msg_has(bad[i].needle), "%s = %s: %s: %s", bad[i].key, bad[i].value,
              ds4_status_name(s), ds4_errmsg());
    }
    /* the bounds themselves are accepted */
    static const struct {
        const char *key, *value;
    } edge[] = {{"hc_mult", "16"}, {"hc_sinkhorn_iters", "100"}, {"sliding_window", "65536"}, {"index_topk", "65536"},
                {"n_shared_experts", "0"}, {"max_position_embeddings", "16777216"}, {"compress_ratios", "[0, 4, 65536, 4, 0]"}};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++)
        CHECK(parse_with(base, edge[i].key, edge[i].value) == DS4_OK, "%s = %s: %s", edge[i].key, edge[i].value, ds4_errmsg());
    ds4_free(base);
    /* ds4_config_validate applies the same table to a struct built in code */
    ds4_config c = tiny_config();
    c.hc_sinkhorn_iters = INT64_MAX;
    CHECK(ds4_config_validate(&c, "v.json") == DS4_ERR_CONFIG && msg_has("v.json: key 'hc_sinkhorn_iters'"), "%s", ds4_errmsg());
    c = tiny_config();
    c.n_layers = INT64_MAX;   /* once summed with the MTP layer */
    CHECK(ds4_config_validate(&c, "v.json") == DS4_ERR_CONFIG && msg_has("'num_hidden_layers'"), "%s", ds4_errmsg());
}

/* ---------------------------------------------------------------- non-regular files */

static bool is_not_regular_error(ds4_status s, const char *path, const char *kind) {
    return s == DS4_ERR_IO && msg_has(path) && msg_has("not a regular file") && msg_has(kind);
}

static void test_fifo_inputs(void) {
    const char *fifo = tpath("config.json");
    CHECK(mkfifo(fifo, 0600) == 0);
    ds4_config c;
    ds4_status s = ds4_config_load(fifo, &c);
    CHECK(is_not_regular_error(s, fifo, "FIFO"), "%s", ds4_errmsg());
    char *data = NULL;
    size_t n;
    s = ds4_read_file(fifo, &data, &n);
    CHECK(is_not_regular_error(s, fifo, "FIFO") && data == NULL, "%s", ds4_errmsg());
    const char *stf = tpath("x.safetensors");
    CHECK(mkfifo(stf, 0600) == 0);
    ds4_st_file *f = NULL;
    s = ds4_st_open(stf, &f);
    CHECK(is_not_regular_error(s, stf, "FIFO") && f == NULL, "%s", ds4_errmsg());
    const char *shard = tpath("tokens.bin");
    CHECK(mkfifo(shard, 0600) == 0);
    ds4_shard sh;
    s = ds4_shard_open(shard, 0, &sh);
    CHECK(is_not_regular_error(s, shard, "FIFO"), "%s", ds4_errmsg());
    /* a data glob that matches the FIFO */
    ds4_data_opts o = ds4_data_defaults();
    o.seq_len = 4;
    const char *pat[1] = {tpath("tok*.bin")};
    ds4_dataloader *dl = NULL;
    s = ds4_data_open(pat, 1, &o, &dl);
    CHECK(is_not_regular_error(s, shard, "FIFO") && dl == NULL, "%s", ds4_errmsg());
    ds4_data_close(dl);
    /* a device */
    s = ds4_config_load("/dev/null", &c);
    CHECK(is_not_regular_error(s, "/dev/null", "character device"), "%s", ds4_errmsg());
    unlink(fifo);
    unlink(stf);
    unlink(shard);
}

/* A model directory whose shard listing holds a FIFO. */
static void test_fifo_in_model_dir(void) {
    char dir[600], p[700];
    snprintf(dir, sizeof dir, "%s", tpath("fifo-model"));
    CHECK(mkdir(dir, 0700) == 0);
    ds4_config c = tiny_config();
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK(ds4_config_save(&c, p) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/model-00001-of-00001.safetensors", dir);
    CHECK(mkfifo(p, 0600) == 0);
    ds4_model_dir *d = NULL;
    ds4_status s = ds4_model_dir_open(dir, &d);
    CHECK(is_not_regular_error(s, p, "FIFO") && d == NULL, "%s", ds4_errmsg());
    ds4_model_dir_close(d);
    unlink(p);
}

/* ---------------------------------------------------------------- names */

static void test_non_utf8_names(void) {
    static const struct {
        const char *header, *needle;
    } bad[] = {
        {"{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "tensor name 'a\\xff' is not valid UTF-8"},
        {"{\"\xc0\xaf\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "is not valid UTF-8"},    /* overlong '/' */
        {"{\"\xed\xa0\x80\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "is not valid UTF-8"}, /* surrogate */
        {"{\"__metadata__\":{\"k\xfe\":\"v\"}}", "__metadata__ key 'k\\xfe' is not valid UTF-8"},
        {"{\"__metadata__\":{\"k\":\"v\x80\"}}", "__metadata__ value 'v\\x80' is not valid UTF-8"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_st_file *f = NULL;
        ds4_status s = open_header(bad[i].header, "u.safetensors", &f);
        CHECK(s == DS4_ERR_FORMAT && f == NULL && msg_has("u.safetensors: ") && msg_has(bad[i].needle), "case %zu: %s: %s", i,
              ds4_status_name(s), ds4_errmsg());
        ds4_st_close(f);
    }
    /* UTF-8 names are fine */
    ds4_st_file *f = NULL;
    CHECK(open_header("{\"caf\xc3\xa9.\xf0\x9f\x98\x80\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", "ok.safetensors",
                      &f) == DS4_OK,
          "%s", ds4_errmsg());
    CHECK(f && ds4_st_find(f, "caf\xc3\xa9.\xf0\x9f\x98\x80") != NULL);
    ds4_st_close(f);
    /* and ds4 never writes a name it would refuse to read */
    ds4_st_writer *w;
    float x = 1;
    CHECK(ds4_st_writer_new(&w) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "bad\xff", DS4_F32, 1, (const int64_t[]){1}, &x) == DS4_ERR_ARG && msg_has("UTF-8"), "%s",
          ds4_errmsg());
    ds4_st_writer_free(w);
}

/* A control character inside a name reaches an error message escaped. */
static void test_control_bytes_in_messages(void) {
    ds4_st_file *f = NULL;
    ds4_status s = open_header("{\"x\\u001b[2J\\u0007\":{\"dtype\":\"Q9\",\"shape\":[1],\"data_offsets\":[0,4]}}", "c.safetensors", &f);
    CHECK(s == DS4_ERR_FORMAT && msg_has("tensor 'x\\x1b[2J\\x07'") && !has_raw_control(ds4_errmsg(), strlen(ds4_errmsg())),
          "%s", ds4_errmsg());
    ds4_st_close(f);
    ds4_config c;
    const char *text = "{\"hidden\\u001b]0;pwned\\u0007\": 1}";
    s = ds4_config_parse(text, strlen(text), "cfg.json", &c);
    CHECK(s == DS4_ERR_CONFIG && msg_has("unknown key 'hidden\\x1b]0;pwned\\x07'"), "%s", ds4_errmsg());
}

/* ---------------------------------------------------------------- the CLI */

/* tiny-a saved as a model directory, with a data shard next to it (once). */
static const char *cli_model(void) {
    static bool made;
    const char *dir = tpath("cli-model");
    if (made) return dir;
    ds4_config c = tiny_config();
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return dir;
    ds4_model_init_random(m, 1);
    mkdir(dir, 0700);
    CHECK(ds4_model_save(m, dir, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_free(m);
    ds4_shard_writer *w;
    int32_t tok[40];
    for (int i = 0; i < 40; i++) tok[i] = (i * 37 + 11) % 256;
    CHECK(ds4_shard_writer_open(tpath("eval.bin"), 256, 0, 1, &w) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_shard_writer_add(w, tok, 40) == DS4_OK && ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
    made = true;
    return dir;
}

static void test_generate_max_new_tokens(void) {
    char *model = (char *)cli_model(), *out = NULL, *err = NULL;
    char *huge[] = {"ds4", "generate", "--model", model, "--no-bos", "--prompt", "hi", "--max-new-tokens", "9223372036854775000", NULL};
    int st = run_ds4(huge, &out, &err);
    CHECK(cli_result_is(st, err, 2, "--max-new-tokens 9223372036854775000 is out of range [0, 16777216]"), "status %d: %s", st,
          err ? err : "");
    ds4_free(out), ds4_free(err);
    /* within ds4's limit but past the model's context (max_position_embeddings 4096) */
    char *past[] = {"ds4", "generate", "--model", model, "--no-bos", "--prompt", "hi", "--max-new-tokens", "5000", NULL};
    st = run_ds4(past, &out, &err);
    CHECK(cli_result_is(st, err, 1, "context of 4096 positions (max_position_embeddings"), "status %d: %s", st, err ? err : "");
    ds4_free(out), ds4_free(err);
    char *ok[] = {"ds4", "generate", "--model", model, "--no-bos", "--prompt", "hi", "--max-new-tokens", "3", NULL};
    st = run_ds4(ok, &out, &err);
    CHECK(cli_result_is(st, err, 0, "") && err && strstr(err, "generated 3 tokens"), "status %d: %s", st, err ? err : "");
    ds4_free(out), ds4_free(err);
}

/* --batch far past the data: one batch of every row, not a batch buffer sized by a wrapped product. */
static void test_eval_huge_batch(void) {
    char *model = (char *)cli_model(), *out = NULL, *err = NULL, *data = (char *)tpath("eval.bin");
    char *argv[] = {"ds4", "eval", "--model", model, "--data", data, "--seq-len", "4", "--batch", "4611686018427387905", NULL};
    int st = run_ds4(argv, &out, &err);
    CHECK(cli_result_is(st, err, 0, "") && out && strstr(out, "eval loss ") && strstr(err, "1 batches of up to"), "status %d: %s",
          st, err ? err : "");
    ds4_free(out), ds4_free(err);
}

/* ds4 inspect lists names from the file escaped, in the listing and in --check's problems. */
static void test_inspect_escapes_names(void) {
    char *model = (char *)cli_model(), *out = NULL, *err = NULL;
    char extra[700];
    snprintf(extra, sizeof extra, "%s/zz-extra.safetensors", model);
    ds4_st_writer *w;
    float x[2] = {1, 2};
    CHECK(ds4_st_writer_new(&w) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "evil\x1b[2J\x1b]0;title\x07\xc2\x9b" "1m", DS4_F32, 1, (const int64_t[]){2}, x) == DS4_OK, "%s",
          ds4_errmsg());
    CHECK(ds4_st_writer_write(w, extra) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    const char *want = "evil\\x1b[2J\\x1b]0;title\\x07\\xc2\\x9b1m";
    char *list[] = {"ds4", "inspect", extra, NULL};
    int st = run_ds4(list, &out, &err);
    CHECK(cli_result_is(st, err, 0, "") && out && strstr(out, want) && !has_raw_control(out, strlen(out)) && !strstr(out, "\xc2\x9b"),
          "status %d: %s", st, out ? out : "");
    ds4_free(out), ds4_free(err);
    char *check[] = {"ds4", "inspect", "--check", model, NULL};
    st = run_ds4(check, &out, &err);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1 && out && strstr(out, "extra") && strstr(out, want) &&
              !has_raw_control(out, strlen(out)),
          "status %d: %s", st, out ? out : "");
    ds4_free(out), ds4_free(err);
    unlink(extra);
}

/* ---------------------------------------------------------------- main */

static void cleanup(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
}

int main(int argc, char **argv) {
    (void)argc;
    const char *tests = strstr(argv[0], "/tests/");
    snprintf(g_ds4, sizeof g_ds4, "%.*s/ds4", tests ? (int)(tests - argv[0]) : 5, tests ? argv[0] : "build");
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-inputs-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    signal(SIGALRM, on_alarm);
    RUN_GUARDED(test_zero_dim_huge_shape, 20);
    RUN_GUARDED(test_config_heads_overflow, 20);
    RUN_GUARDED(test_memplan_batch_overflow, 20);
    RUN_GUARDED(test_decoder_huge_length, 20);
    RUN_GUARDED(test_config_absurd_values, 20);
    RUN_GUARDED(test_fifo_inputs, 10);
    RUN_GUARDED(test_fifo_in_model_dir, 10);
    RUN_GUARDED(test_non_utf8_names, 20);
    RUN_GUARDED(test_control_bytes_in_messages, 20);
    RUN_GUARDED(test_generate_max_new_tokens, 120);
    RUN_GUARDED(test_eval_huge_batch, 120);
    RUN_GUARDED(test_inspect_escapes_names, 120);
    cleanup();
    TEST_MAIN_END("test_inputs");
}
