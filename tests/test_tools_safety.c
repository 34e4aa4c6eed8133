/* The ds4 tools on bad days: `ds4 tokenize --overwrite` that fails half-way keeps the old shards,
 * "\u0000" in a JSONL text reaches the tokenizer, `ds4 init --out a/b/c` creates the parents, a FIFO
 * or a directory given as an input file is refused instead of hanging, and `ds4 debug-state` writes
 * the same file whatever the recompute policy. Runs build/ds4 (next to the tests folder). */
#include "ds4/io.h"
#include "ds4/shard.h"
#include "test.h"
#include "test_files.h"

#include <dirent.h>
#include <ftw.h>
#include <stdarg.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_ds4[512], g_dir[256], g_err[8192];

/* g_dir/name; each call its own buffer (the tests keep many paths at once). */
static const char *tpath(const char *name) {
    static char buf[256][512];
    static int k;
    char *p = buf[k++ & 255];
    snprintf(p, 512, "%s/%s", g_dir, name);
    return p;
}

/* Runs `ds4 ARGS` (at most 30 s: a hang fails the test instead of the suite); its stderr in g_err.
 * Returns the exit code, or -1 when it did not exit normally. */
static int ds4(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int ds4(const char *fmt, ...) {
    char args[4096], cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(args, sizeof args, fmt, ap);
    va_end(ap);
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=2 timeout 30 '%s' %s >'%s/stdout' 2>'%s/stderr'", g_ds4, args, g_dir, g_dir);
    int st = system(cmd);
    g_err[0] = 0;
    FILE *f = fopen(tpath("stderr"), "r");
    if (f) {
        g_err[fread(g_err, 1, sizeof g_err - 1, f)] = 0;
        fclose(f);
    }
    if (getenv("DS4_TEST_VERBOSE")) fprintf(stderr, "$ ds4 %s\n%s", args, g_err);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* Names in dir, sorted, joined by '\n' (hidden ones too). */
static void list_dir(const char *dir, char *out, size_t n) {
    struct dirent **names;
    int k = scandir(dir, &names, NULL, alphasort);
    size_t at = 0;
    out[0] = 0;
    for (int i = 0; i < k; i++) {
        if (strcmp(names[i]->d_name, ".") && strcmp(names[i]->d_name, ".."))
            at += (size_t)snprintf(out + at, at < n ? n - at : 0, "%s\n", names[i]->d_name);
        free(names[i]);
    }
    if (k >= 0) free(names);
}

/* ---------------------------------------------------------------- tokenize --overwrite */

/* n_docs JSONL documents "document i ...", then a line without "text" when bad_at > 0 (line bad_at). */
static void write_jsonl(const char *path, int n_docs, int bad_at) {
    FILE *f = fopen(path, "wb");
    if (!f) return;
    for (int i = 1; i <= n_docs; i++) {
        if (i == bad_at) fputs("{\"txt\": \"no text key\"}\n", f);
        else fprintf(f, "{\"text\": \"document %d, some words to tokenize\"}\n", i);
    }
    fclose(f);
}

static void test_tokenize_failure_keeps_old_shards(void) {
    const char *out = tpath("shards"), *good = tpath("good.jsonl"), *bad = tpath("bad.jsonl");
    write_jsonl(good, 300, 0);
    CHECK(ds4("tokenize --input %s --out %s --shard-tokens 2000 --val-fraction 0.1", good, out) == 0, "%s", g_err);
    char before[4096], after[4096];
    list_dir(out, before, sizeof before);
    CHECK(strstr(before, "train_000002.bin") && strstr(before, "val_000000.bin"), "old shards: %s", before);
    /* keep their bytes */
    char copies[8][1024];
    int n = 0;
    for (const char *p = before; *p && n < 8; n++) {
        const char *nl = strchr(p, '\n');
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(nl - p), p);
        snprintf(copies[n], sizeof copies[n], "%s/copy_%s", g_dir, name);
        char src[1024];
        snprintf(src, sizeof src, "%s/%s", out, name);
        char *d = NULL;
        size_t len = 0;
        CHECK(ds4_read_file(src, &d, &len) == DS4_OK);
        CHECK(ds4_write_file_atomic(copies[n], d, len) == DS4_OK);
        ds4_free(d);
        p = nl + 1;
    }
    /* line 6000 is bad: 4096 documents were encoded and written as shards before it is read */
    write_jsonl(bad, 6000, 6000);
    int rc = ds4("tokenize --input %s --out %s --shard-tokens 500 --val-fraction 0 --overwrite", bad, out);
    CHECK(rc == 1 && strstr(g_err, "bad.jsonl:6000") && strstr(g_err, "\"text\""), "rc %d: %s", rc, g_err);
    list_dir(out, after, sizeof after);
    CHECK(strcmp(before, after) == 0, "the folder changed:\n%s\nbecame\n%s", before, after);
    for (int i = 0; i < n; i++) {
        char name[600];
        snprintf(name, sizeof name, "%s/%s", out, strstr(copies[i], "copy_") + 5);
        CHECK(t_files_equal(name, copies[i]), "%s changed", name);
    }
    /* a second input that cannot be read fails the same way */
    rc = ds4("tokenize --input %s --input %s --out %s --shard-tokens 500 --val-fraction 0 --overwrite", good,
             tpath("missing.jsonl"), out);
    CHECK(rc != 0, "rc %d", rc);
    list_dir(out, after, sizeof after);
    CHECK(strcmp(before, after) == 0, "the folder changed:\n%s\nbecame\n%s", before, after);

    /* success: one new shard replaces train_000000, the old train_000001.. and val_000000 go */
    write_jsonl(good, 20, 0);
    CHECK(ds4("tokenize --input %s --out %s --val-fraction 0 --overwrite", good, out) == 0, "%s", g_err);
    list_dir(out, after, sizeof after);
    CHECK(strcmp(after, "train_000000.bin\n") == 0, "after --overwrite: %s", after);
    ds4_shard sh;
    CHECK(ds4_shard_open(tpath("shards/train_000000.bin"), 258, &sh) == DS4_OK, "%s", ds4_errmsg());
    CHECK(sh.n_docs == 20, "%lld documents", (long long)sh.n_docs);
    ds4_shard_close(&sh);
}

/* ---------------------------------------------------------------- JSONL strings */

static void test_jsonl_keeps_nul(void) {
    const char *in = tpath("nul.jsonl"), *out = tpath("nul_out");
    /* a nested "text" first (not the document), U+0000, an escaped quote, é, and an emoji as a surrogate pair */
    write_text(in, "{\"meta\": {\"text\": \"no\", \"n\": [1, {\"a\": \"}\"}]}, \"text\": \"a\\u0000b\\\"\\u00e9\\ud83d\\ude00\"}\n"
                   "{\"id\": 7, \"text\": \"\\u0000\"}\n");
    CHECK(ds4("tokenize --input %s --out %s --val-fraction 0", in, out) == 0, "%s", g_err);
    ds4_shard sh;
    if (ds4_shard_open(tpath("nul_out/train_000000.bin"), 258, &sh) != DS4_OK) {
        CHECK(0, "%s", ds4_errmsg());
        return;
    }
    const int32_t want[] = {'a', 0, 'b', '"', 0xc3, 0xa9, 0xf0, 0x9f, 0x98, 0x80, 0};
    const int64_t nw = (int64_t)(sizeof want / sizeof want[0]);
    CHECK(sh.n_docs == 2 && sh.n_tokens == nw && sh.doc_offsets[1] == nw - 1, "%lld docs, %lld tokens", (long long)sh.n_docs,
          (long long)sh.n_tokens);
    int32_t got[16] = {0};
    if (sh.n_tokens == nw) ds4_shard_read(&sh, 0, nw, got);
    CHECK(memcmp(got, want, sizeof want) == 0, "tokens %d %d %d %d ...", got[0], got[1], got[2], got[3]);
    ds4_shard_close(&sh);
    /* a raw NUL byte is not JSON: one error naming the line */
    FILE *f = fopen(tpath("raw.jsonl"), "wb");
    if (f) {
        fputs("{\"text\": \"ok\"}\n{\"text\": \"a", f);
        fputc(0, f);
        fputs("b\"}\n", f);
        fclose(f);
    }
    CHECK(ds4("tokenize --input %s --out %s --val-fraction 0", tpath("raw.jsonl"), tpath("raw_out")) == 1 &&
              strstr(g_err, "raw.jsonl:2") && strstr(g_err, "NUL"),
          "%s", g_err);
}

/* ---------------------------------------------------------------- ds4 init */

static void test_init_creates_parents(void) {
    const char *cfg = "tests/configs/tiny-a.json";
    char out[600];
    snprintf(out, sizeof out, "%s/a/b/c", g_dir);
    CHECK(ds4("init --config %s --seed 1 --out %s", cfg, out) == 0, "%s", g_err);
    char p[700];
    snprintf(p, sizeof p, "%s/config.json", out);
    CHECK(access(p, F_OK) == 0, "no %s", p);
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    CHECK(access(p, F_OK) == 0, "no %s", p);
    /* impossible: a parent is a regular file */
    write_text(tpath("plain"), "x");
    int rc = ds4("init --config %s --out %s/plain/m", cfg, g_dir);
    CHECK(rc == 1 && strstr(g_err, "error:") && strstr(g_err, "plain"), "rc %d: %s", rc, g_err);
}

/* ---------------------------------------------------------------- FIFOs and directories */

static void test_inputs_must_be_regular(void) {
    const char *fifo = tpath("fifo.jsonl");
    CHECK(mkfifo(fifo, 0644) == 0);
    int rc = ds4("tokenize --input %s --out %s", fifo, tpath("fifo_out"));
    CHECK(rc == 1 && strstr(g_err, "fifo.jsonl") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    /* a tokenizer.json that is a FIFO, or a directory named tokenizer.json */
    write_text(tpath("in.txt"), "some text\n");
    mkdir(tpath("tokdir"), 0755);
    CHECK(mkfifo(tpath("tokdir/tokenizer.json"), 0644) == 0);
    rc = ds4("tokenize --input %s --out %s --tokenizer %s", tpath("in.txt"), tpath("tok_out"), tpath("tokdir"));
    CHECK(rc == 1 && strstr(g_err, "tokenizer.json") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    mkdir(tpath("tokdir2"), 0755);
    mkdir(tpath("tokdir2/tokenizer.json"), 0755);
    rc = ds4("tokenize --input %s --out %s --tokenizer %s", tpath("in.txt"), tpath("tok_out"), tpath("tokdir2"));
    CHECK(rc == 1 && strstr(g_err, "tokenizer.json") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    /* ds4 init --config FIFO */
    const char *fifo_cfg = tpath("fifo_config.json");
    CHECK(mkfifo(fifo_cfg, 0644) == 0);
    rc = ds4("init --config %s --out %s", fifo_cfg, tpath("fifo_init"));
    CHECK(rc == 1 && strstr(g_err, "fifo_config.json") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    /* export: a checkpoint whose config.json or tokenizer.json is a FIFO */
    const char *ck = tpath("fifo_ckpt");
    CHECK(ds4("init --config tests/configs/tiny-a.json --out %s", ck) == 0, "%s", g_err);
    /* debug-state --batch FIFO */
    rc = ds4("debug-state --model %s --batch %s --out %s", ck, fifo, tpath("fifo_state.safetensors"));
    CHECK(rc == 1 && strstr(g_err, "fifo.jsonl") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    char p[700];
    snprintf(p, sizeof p, "%s/model-2.safetensors", ck);
    CHECK(mkfifo(p, 0644) == 0);
    rc = ds4("export --checkpoint %s --out %s --quiet", ck, tpath("fifo_export0"));
    CHECK(rc == 1 && strstr(g_err, "model-2.safetensors") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    unlink(p);
    snprintf(p, sizeof p, "%s/tokenizer.json", ck);
    CHECK(mkfifo(p, 0644) == 0);
    rc = ds4("export --checkpoint %s --out %s --quiet", ck, tpath("fifo_export"));
    CHECK(rc == 1 && strstr(g_err, "tokenizer.json") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
    unlink(p);
    snprintf(p, sizeof p, "%s/config.json", ck);
    unlink(p);
    CHECK(mkfifo(p, 0644) == 0);
    rc = ds4("export --checkpoint %s --out %s --quiet", ck, tpath("fifo_export2"));
    CHECK(rc == 1 && strstr(g_err, "config.json") && strstr(g_err, "not a regular file"), "rc %d: %s", rc, g_err);
}

/* ---------------------------------------------------------------- debug-state and recompute */

static void test_debug_state_same_file_any_policy(void) {
    const char *model = tpath("ds_model"), *batch = tpath("ds_batch.safetensors");
    CHECK(ds4("init --config tests/configs/tiny-a.json --seed 3 --out %s", model) == 0, "%s", g_err);
    int32_t ids[2 * 40];
    for (int i = 0; i < 80; i++) ids[i] = (int32_t)((i * 37 + 11) % 256);
    ds4_st_writer *w;
    int64_t shape[2] = {2, 40};
    CHECK(ds4_st_writer_new(&w) == DS4_OK);
    CHECK(ds4_st_writer_add(w, "input_ids", DS4_I32, 2, shape, ids) == DS4_OK);
    CHECK(ds4_st_writer_write(w, batch) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    const char *base = tpath("ds_off.safetensors");
    CHECK(ds4("debug-state --model %s --batch %s --out %s --threads 2", model, batch, base) == 0, "%s", g_err);
    ds4_st_file *f;
    if (ds4_st_open(base, &f) == DS4_OK) {
        CHECK(ds4_st_find(f, "indexer_topk.1") && ds4_st_find(f, "indexer_topk.3"), "the top-k of CSA layers 1 and 3");
        ds4_st_close(f);
    } else CHECK(0, "%s", ds4_errmsg());
    const char *policies[] = {
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 4",
        "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
        "--recompute-csa-attention --mhc-recompute",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 4 --swap-layer-input",
    };
    for (int i = 0; i < 4; i++) {
        char out[64];
        snprintf(out, sizeof out, "ds_policy%d.safetensors", i);
        CHECK(ds4("debug-state --model %s --batch %s --out %s --threads 2 %s --offload-dir %s", model, batch, tpath(out),
                  policies[i], g_dir) == 0,
              "%s", g_err);
        CHECK(t_files_equal(tpath(out), base), "%s: the file differs from the one without recompute", policies[i]);
        CHECK(!strstr(g_err, "not written"), "%s: %s", policies[i], g_err);
    }
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftwb) {
    (void)sb, (void)flag, (void)ftwb;
    return remove(p);
}

int main(int argc, char **argv) {
    (void)argc;
    const char *tests = strstr(argv[0], "/tests/");
    if (getenv("DS4_BIN")) snprintf(g_ds4, sizeof g_ds4, "%s", getenv("DS4_BIN"));
    else snprintf(g_ds4, sizeof g_ds4, "%.*s/ds4", tests ? (int)(tests - argv[0]) : 5, tests ? argv[0] : "build");
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_tools_safety_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(test_tokenize_failure_keeps_old_shards);
    RUN(test_jsonl_keeps_nul);
    RUN(test_init_creates_parents);
    RUN(test_inputs_must_be_regular);
    RUN(test_debug_state_same_file_any_policy);
    if (!getenv("DS4_TEST_KEEP")) nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_MAIN_END("test_tools_safety");
}
