/* shards.json and the shard files of a per-rank checkpoint are untrusted input: every broken index below
 * must fail ds4_ckpt_shards_open with one line naming the file and the key (or tensor) at fault, never
 * crash, hang or read outside the files. The fixture: two shard files of 3 and 2 elements, packed 5. */
#include "ds4/io.h"
#include "ds4/train.h"
#include "test.h"

#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

static void write_text(const char *name, const char *text) {
    char p[512];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    FILE *f = fopen(p, "wb");
    if (!f) abort();
    fputs(text, f);
    fclose(f);
}

/* shards.json with the given world, packed_numel and the two files' entries. */
static void write_index(const char *world, const char *packed, const char *file0, const char *file1) {
    char t[2048];
    snprintf(t, sizeof t, "{\"format\": \"ds4-per-rank-1\", \"world\": %s, \"packed_numel\": %s, \"files\": [%s%s%s]}",
             world, packed, file0, file1[0] ? ", " : "", file1);
    write_text(DS4_CKPT_INDEX, t);
}

#define F0 "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": [[0, 0, 3]]}"
#define F1 "{\"file\": \"shard-00001-of-00002.safetensors\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}"

static void make_fixture(void) {
    const char *base = getenv("TMPDIR");
    snprintf(g_dir, sizeof g_dir, "%s/ds4_shards_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_dir)) abort();
    const float p[5] = {1, 2, 3, 4, 5}, m[5] = {0}, v[5] = {0};
    for (int r = 0; r < 2; r++) {
        ds4_ckpt_shard_data d = {.params = p + 3 * r, .n = r ? 2 : 3, .step = 7, .narrays = 2,
                                 .names = {"adamw.m", "adamw.v"}, .arrays = {m, v}, .lens = {r ? 2 : 3, r ? 2 : 3}};
        if (ds4_checkpoint_write_shard(g_dir, r, 2, &d) != DS4_OK) abort();
    }
}

/* Opening fails with one line that names `file` and `key`. */
static void fails_naming(const char *what, int64_t packed, const char *file, const char *key) {
    ds4_ckpt_shards *s = (ds4_ckpt_shards *)1;
    ds4_status st = ds4_ckpt_shards_open(g_dir, packed, &s);
    const char *e = ds4_errmsg();
    CHECK(st != DS4_OK && s == NULL, "%s: opened", what);
    CHECK(strstr(e, file) != NULL, "%s: error does not name %s: %s", what, file, e);
    CHECK(strstr(e, key) != NULL, "%s: error does not name %s: %s", what, key, e);
    CHECK(strchr(e, '\n') == NULL, "%s: error is not one line: %s", what, e);
    if (getenv("DS4_TEST_VERBOSE")) fprintf(stderr, "%s: %s\n", what, e);
    if (st == DS4_OK) ds4_ckpt_shards_close(s);
}

static void test_good_index_reads_back(void) {
    write_index("2", "5", F0, F1);
    ds4_ckpt_shards *s;
    CHECK(ds4_ckpt_shards_open(g_dir, 5, &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    float got[5] = {0};
    CHECK(ds4_ckpt_shards_read(s, 0, 5, got) == DS4_OK, "%s", ds4_errmsg());
    for (int i = 0; i < 5; i++) CHECK(got[i] == (float)(i + 1), "element %d = %g", i, got[i]);
    CHECK(ds4_ckpt_shards_step(s) == 7 && ds4_ckpt_shards_nfiles(s) == 2 && ds4_ckpt_shards_nranges(s) == 2);
    CHECK(ds4_ckpt_shards_packed_numel(s) == 5 && ds4_ckpt_shards_elements(s, 1) == 2);
    ds4_ckpt_shards_close(s);
}

static void test_broken_json(void) {
    write_text(DS4_CKPT_INDEX, "{\"format\": \"ds4-per-rank-1\", \"world\": 2, \"packed_numel\": 5, \"files\": [" F0);
    fails_naming("truncated", 5, DS4_CKPT_INDEX, "JSON");
    write_text(DS4_CKPT_INDEX, "");
    fails_naming("empty", 5, DS4_CKPT_INDEX, "JSON");
    write_index("2", "5", "7", F1);
    fails_naming("file entry not an object", 5, DS4_CKPT_INDEX, "files[0]");
    write_index("2", "-5", F0, F1);
    fails_naming("negative packed_numel", -1, DS4_CKPT_INDEX, "packed_numel");
    write_index("2", "6", F0, F1);
    fails_naming("packed_numel not the model's", 5, DS4_CKPT_INDEX, "packed_numel");
}

static void test_bad_ranges(void) {
    static const char *const bad[][2] = {
        {"negative length", "[[0, 0, -3]]"},        {"huge length", "[[0, 0, 1e300]]"},
        {"fraction", "[[0, 0.5, 2]]"},              {"past the arrays", "[[0, 1, 3]]"},
        {"2^53 + file offset", "[[0, 9007199254740992, 3]]"}, {"two values", "[[0, 0]]"},
        {"not numbers", "[[\"0\", 0, 3]]"}};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char f0[256];
        snprintf(f0, sizeof f0, "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": %s}", bad[i][1]);
        write_index("2", "5", f0, F1);
        fails_naming(bad[i][0], 5, "shard-00000-of-00002.safetensors", "ranges[0]");
    }
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": [[9007199254740992, 0, 3]]}", F1);
    fails_naming("huge packed offset", 5, DS4_CKPT_INDEX, "in no file");
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": [[0, 0, 3]]}",
                "{\"file\": \"shard-00001-of-00002.safetensors\", \"elements\": 2, \"ranges\": [[2, 0, 2]]}");
    fails_naming("overlap", -1, DS4_CKPT_INDEX, "element 2 is in files[0] and files[1]");
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": [[0, 0, 2]]}", F1);
    fails_naming("gap", 5, DS4_CKPT_INDEX, "in no file");
    write_index("2", "5", F0, "{\"file\": \"shard-00001-of-00002.safetensors\", \"elements\": 2, \"ranges\": []}");
    fails_naming("missing tail", 5, DS4_CKPT_INDEX, "ranges");
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 3, \"ranges\": 3}", F1);
    fails_naming("ranges not an array", 5, "shard-00000-of-00002.safetensors", "key ranges");
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": -3, \"ranges\": [[0, 0, 3]]}", F1);
    fails_naming("negative elements", 5, "shard-00000-of-00002.safetensors", "elements");
    write_index("2", "5", "{\"file\": \"shard-00000-of-00002.safetensors\", \"elements\": 4, \"ranges\": [[0, 0, 3]]}", F1);
    fails_naming("elements not the file's", 5, "shard-00000-of-00002.safetensors", "params");
}

static void test_bad_files(void) {
    write_index("3", "5", F0, F1);
    fails_naming("world 3 with 2 files", 5, DS4_CKPT_INDEX, "world");
    write_index("\"2\"", "5", F0, F1);
    fails_naming("world a string", 5, DS4_CKPT_INDEX, "world");
    write_index("1", "5", F0, "");
    fails_naming("one file of two", 5, DS4_CKPT_INDEX, "ranges");
    write_index("2", "5", F0, "{\"file\": \"shard-00009-of-00002.safetensors\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("missing file", 5, "shard-00009-of-00002.safetensors", "open");
    write_index("2", "5", F0, "{\"file\": \"../shard-00001-of-00002.safetensors\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("path outside", 5, DS4_CKPT_INDEX, "key file");
    write_index("2", "5", F0, "{\"file\": \"..\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("parent folder", 5, DS4_CKPT_INDEX, "key file");
    char p[512];
    snprintf(p, sizeof p, "%s/sub", g_dir);
    CHECK(mkdir(p, 0700) == 0);
    write_index("2", "5", F0, "{\"file\": \"sub\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("a directory", 5, "sub", "not a regular file");
    snprintf(p, sizeof p, "%s/fifo", g_dir);
    CHECK(mkfifo(p, 0600) == 0);
    write_index("2", "5", F0, "{\"file\": \"fifo\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("a FIFO (must not wait for a writer)", 5, "fifo", "not a regular file");
    write_text("short.safetensors", "abc");
    write_index("2", "5", F0, "{\"file\": \"short.safetensors\", \"elements\": 2, \"ranges\": [[3, 0, 2]]}");
    fails_naming("truncated shard", 5, "short.safetensors", "header");
    /* shards.json itself a FIFO */
    snprintf(p, sizeof p, "%s/" DS4_CKPT_INDEX, g_dir);
    remove(p);
    CHECK(mkfifo(p, 0600) == 0);
    fails_naming("index a FIFO", 5, DS4_CKPT_INDEX, "not a regular file");
}

int main(void) {
    make_fixture();
    RUN(test_good_index_reads_back);
    RUN(test_broken_json);
    RUN(test_bad_ranges);
    RUN(test_bad_files);
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_MAIN_END("test_ckpt_shards_corrupt");
}
