/* Token shards: write/read round trips, atomic writes, one test per corruption the reader must
 * name, and deterministic byte mutations that must never crash the reader (run under ASan). */
#include "ds4/shard.h"
#include "test.h"

#include <dirent.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char buf[8][256];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

/* Three documents (the middle one empty) of a vocab of `vocab`. */
static ds4_status write_sample(const char *path, int64_t vocab) {
    ds4_shard_writer *w;
    DS4_TRY(ds4_shard_writer_open(path, vocab, 1, 2, &w));
    int32_t d0[5] = {3, 4, 5, (int32_t)vocab - 1, 0};
    int32_t d2[3] = {7, 8, 9};
    ds4_status s = ds4_shard_writer_add(w, d0, 5);
    if (!s) s = ds4_shard_writer_add(w, NULL, 0);
    if (!s) s = ds4_shard_writer_add(w, d2, 3);
    if (s) {
        ds4_shard_writer_abort(w);
        return s;
    }
    CHECK(ds4_shard_writer_tokens(w) == 8 && ds4_shard_writer_docs(w) == 3);
    return ds4_shard_writer_close(w);
}

static int count_files(void) {
    DIR *d = opendir(g_dir);
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)))
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

static void test_round_trip(void) {
    const int64_t vocabs[3] = {258, 65536, 129280};
    for (int v = 0; v < 3; v++) {
        const char *path = tmp_path("rt.bin");
        CHECK(write_sample(path, vocabs[v]) == DS4_OK, "%s", ds4_errmsg());
        ds4_shard s;
        CHECK(ds4_shard_open(path, vocabs[v], &s) == DS4_OK, "%s", ds4_errmsg());
        CHECK(s.vocab_size == vocabs[v] && s.token_bytes == (vocabs[v] <= 65536 ? 2 : 4));
        CHECK(s.bos_id == 1 && s.eos_id == 2 && s.n_tokens == 8 && s.n_docs == 3);
        CHECK(s.doc_offsets[0] == 0 && s.doc_offsets[1] == 5 && s.doc_offsets[2] == 5 && s.doc_offsets[3] == 8);
        int32_t got[8];
        ds4_shard_read(&s, 0, 8, got);
        const int32_t want[8] = {3, 4, 5, (int32_t)vocabs[v] - 1, 0, 7, 8, 9};
        CHECK(memcmp(got, want, sizeof want) == 0);
        CHECK(ds4_shard_token(&s, 3) == (uint32_t)vocabs[v] - 1);
        struct stat st;
        stat(path, &st);
        CHECK(st.st_size == 48 + 8 * 4 + 8 * s.token_bytes, "file size %lld", (long long)st.st_size);
        ds4_shard_close(&s);
        CHECK(s.map == NULL && s.path == NULL);
        unlink(path);
    }
    /* an empty shard is valid */
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(tmp_path("empty.bin"), 258, -1, 257, &w) == DS4_OK);
    CHECK(ds4_shard_writer_close(w) == DS4_OK);
    ds4_shard s;
    CHECK(ds4_shard_open(tmp_path("empty.bin"), 0, &s) == DS4_OK && s.n_docs == 0 && s.n_tokens == 0 && s.bos_id == -1);
    ds4_shard_close(&s);
    unlink(tmp_path("empty.bin"));
}

static void test_writer(void) {
    /* atomic: nothing but the final file is left; an old file is replaced whole */
    CHECK(count_files() == 0);
    const char *path = tmp_path("a.bin");
    FILE *f = fopen(path, "wb");
    fputs("old contents", f);
    fclose(f);
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(path, 300, -1, -1, &w) == DS4_OK);
    int32_t doc[2] = {299, 0};
    CHECK(ds4_shard_writer_add(w, doc, 2) == DS4_OK);
    CHECK(count_files() == 1, "nothing is written before close");
    CHECK(ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
    CHECK(count_files() == 1, "no temp file left behind");
    ds4_shard s;
    CHECK(ds4_shard_open(path, 300, &s) == DS4_OK && s.n_tokens == 2);
    ds4_shard_close(&s);
    /* bad tokens are refused with the document and position */
    CHECK(ds4_shard_writer_open(path, 300, -1, -1, &w) == DS4_OK);
    int32_t bad[3] = {1, 300, 2};
    CHECK(ds4_shard_writer_add(w, bad, 3) == DS4_ERR_ARG);
    CHECK(strstr(ds4_errmsg(), "document 0 token 1 is id 300, outside the vocab [0, 300)") != NULL, "%s", ds4_errmsg());
    bad[1] = -5;
    CHECK(ds4_shard_writer_add(w, bad, 3) == DS4_ERR_ARG);
    ds4_shard_writer_abort(w);
    CHECK(ds4_shard_writer_open(path, 300, 300, -1, &w) == DS4_ERR_ARG && w == NULL);
    /* a directory that does not exist: the error names the path, nothing is created */
    CHECK(ds4_shard_writer_open("/nonexistent/dir/x.bin", 300, -1, -1, &w) == DS4_OK);
    CHECK(ds4_shard_writer_close(w) == DS4_ERR_IO && strstr(ds4_errmsg(), "/nonexistent/dir/x.bin"), "%s", ds4_errmsg());
    unlink(path);
    CHECK(count_files() == 0);
}

/* Reads a file into a malloc'ed buffer. */
static uint8_t *slurp(const char *path, size_t *len) {
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*len + 16);
    CHECK(fread(b, 1, *len, f) == *len);
    fclose(f);
    return b;
}

static void spit(const char *path, const uint8_t *b, size_t len) {
    FILE *f = fopen(path, "wb");
    fwrite(b, 1, len, f);
    fclose(f);
}

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }

/* Writes the edited sample to a file and checks that opening it fails naming the file and `want`. */
static void expect_bad(const uint8_t *b, size_t len, int64_t expect_vocab, const char *want) {
    const char *path = tmp_path("bad.bin");
    spit(path, b, len);
    ds4_shard s;
    ds4_status st = ds4_shard_open(path, expect_vocab, &s);
    CHECK(st == DS4_ERR_FORMAT, "status %d for '%s'", (int)st, want);
    CHECK(s.map == NULL && s.tokens == NULL);
    char full[512];
    snprintf(full, sizeof full, "%s: %s", path, want);
    CHECK(strstr(ds4_errmsg(), full) == ds4_errmsg(), "message '%s', want '%s'", ds4_errmsg(), full);
    unlink(path);
}

static void test_corrupt(void) {
    const char *path = tmp_path("good.bin");
    CHECK(write_sample(path, 1000) == DS4_OK);
    size_t len;
    uint8_t *good = slurp(path, &len);
    unlink(path);
    CHECK(len == 48 + 32 + 16);
    uint8_t *b = malloc(len + 16);
#define EDIT(stmt, vocab, want)       \
    do {                              \
        memcpy(b, good, len);         \
        size_t n = len;               \
        stmt;                         \
        expect_bad(b, n, vocab, want); \
    } while (0)
    EDIT(b[0] = 'X', 0, "not a ds4 token shard (bad magic)");
    EDIT(put_u32(b + 8, 2), 0, "shard version 2, this build reads version 1");
    EDIT((void)0, 258, "vocab size 1000, expected 258 (tokenized with another tokenizer?)");
    EDIT(put_u32(b + 12, 0), 0, "bad vocab size 0");
    EDIT(put_u32(b + 16, 4), 0, "4-byte tokens, but vocab 1000 takes 2-byte tokens");
    EDIT(put_u32(b + 20, 1000), 0, "bos_id 1000 / eos_id 2 outside [-1, 1000)");
    EDIT(put_u32(b + 28, 7), 0, "reserved header field is 7, expected 0");
    EDIT(n = 10, 0, "truncated: 10 bytes, a shard header is 48");
    EDIT(n = len - 1, 0, "truncated: header says 8 tokens, the file holds 7");
    EDIT(n = 60, 0, "truncated: header says 3 documents, the file has room for 1 offsets");
    EDIT((b[len] = 0, n = len + 1), 0, "1 bytes after the last token");
    EDIT(put_u64(b + 40, 1u << 30), 0, "truncated: header says 1073741824 documents");
    EDIT(put_u64(b + 32, UINT64_MAX / 2), 0, "truncated: header says 9223372036854775807 tokens");
    EDIT(put_u64(b + 48, 1), 0, "doc_offsets[0] = 1, expected 0");
    EDIT(put_u64(b + 56, 9), 0, "doc_offsets[1] = 9 is past the 8 tokens");
    EDIT(put_u64(b + 64, 4), 0, "doc_offsets[2] = 4 goes back from 5");
    EDIT(put_u64(b + 72, 7), 0, "doc_offsets[3] = 7, expected n_tokens = 8");
    EDIT((b[80 + 2 * 6] = 0xe8, b[80 + 2 * 6 + 1] = 0x03), 0, "token 6 is id 1000, not below the vocab size 1000");
#undef EDIT
    ds4_shard s;
    CHECK(ds4_shard_open(tmp_path("missing.bin"), 0, &s) == DS4_ERR_IO && strstr(ds4_errmsg(), "missing.bin: cannot open shard"));
    CHECK(ds4_shard_open(g_dir, 0, &s) == DS4_ERR_IO && strstr(ds4_errmsg(), "not a regular file"));
    free(b);
    free(good);
}

/* Any bytes: the check either fails with a message naming the shard, or what it accepts is sound. */
static void test_fuzz(void) {
    const char *path = tmp_path("fz.bin");
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(path, 70000, 5, 6, &w) == DS4_OK); /* u32 tokens */
    for (int d = 0; d < 6; d++) {
        int32_t doc[9];
        for (int i = 0; i < d + 3; i++) doc[i] = (int32_t)((d * 7919 + i * 104729) % 70000);
        CHECK(ds4_shard_writer_add(w, doc, d + 3) == DS4_OK);
    }
    CHECK(ds4_shard_writer_close(w) == DS4_OK);
    size_t len;
    uint8_t *good = slurp(path, &len);
    unlink(path);
    int ok = 0, err = 0;
    for (uint64_t it = 0; it < 20000; it++) {
        size_t n = len;
        uint8_t *b = malloc(len);
        memcpy(b, good, len);
        int muts = 1 + (int)(ds4_rng_u64(21, it, 0) % 3);
        for (int m = 0; m < muts; m++) {
            uint64_t r = ds4_rng_u64(21, it, 1 + (uint64_t)m);
            size_t pos = (size_t)((r >> 8) % n);
            if (r % 7 == 0) n = pos; /* truncate */
            else if (r % 7 == 1) b[pos] ^= (uint8_t)(1u << ((r >> 40) % 8));
            else b[pos] = (uint8_t)(r >> 48);
            if (n == 0) break;
        }
        ds4_shard s;
        ds4_status st = ds4_shard_check(b, n, "fz.bin", 0, &s);
        if (st == DS4_OK) {
            ok++;
            CHECK(s.doc_offsets[0] == 0 && s.doc_offsets[s.n_docs] == (uint64_t)s.n_tokens);
            for (int64_t i = 0; i < s.n_tokens; i++) CHECK(ds4_shard_token(&s, i) < (uint32_t)s.vocab_size);
            CHECK(48 + 8 * (s.n_docs + 1) + s.token_bytes * s.n_tokens == (int64_t)n);
        } else {
            err++;
            CHECK(st == DS4_ERR_FORMAT && strncmp(ds4_errmsg(), "fz.bin: ", 8) == 0, "%s", ds4_errmsg());
        }
        free(b);
    }
    CHECK(ok > 100 && err > 5000, "mutations should hit both outcomes: %d ok, %d errors", ok, err);
    free(good);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_shard_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    RUN(test_round_trip);
    RUN(test_writer);
    RUN(test_corrupt);
    RUN(test_fuzz);
    ds4_mem_get(&m1);
    t_cur_failed = 0;
    CHECK(m1.live_total == m0.live_total, "counted bytes leaked: %lld", (long long)(m1.live_total - m0.live_total));
    if (t_cur_failed) t_failed++; else t_passed++;
    rmdir(g_dir);
    TEST_MAIN_END("test_shard");
}
