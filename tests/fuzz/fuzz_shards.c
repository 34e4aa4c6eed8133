/* libFuzzer target: a per-rank checkpoint folder with two valid shard files (3 and 2 elements) and a fuzzed
 * one -> ds4_ckpt_shards_open, then reads of every packed element of each array. The input is shards.json,
 * then optionally a NUL byte and the bytes of fuzzed.safetensors (which the index may name). The index may
 * name files, offsets and lengths at will; it must never crash, hang, leak or read outside the files, and
 * an index that opens must tile exactly packed_numel elements that read back. */
#include "ds4/io.h"
#include "ds4/train.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[512], g_index[600], g_fuzzed[600];

static void write_file(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(p, 1, n, f) != n) abort();
    fclose(f);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc, (void)argv;
    const char *base = getenv("DS4_FUZZ_TMP");
    snprintf(g_dir, sizeof g_dir, "%s/ds4_fuzz_shards_XXXXXX", base ? base : "/tmp");
    if (!mkdtemp(g_dir)) abort();
    const float p[5] = {1, 2, 3, 4, 5}, m[5] = {6, 7, 8, 9, 10}, v[5] = {11, 12, 13, 14, 15};
    for (int r = 0; r < 2; r++) {
        ds4_ckpt_shard_data d = {.params = p + 3 * r, .n = r ? 2 : 3, .step = 7, .mark = r ? "muon.step" : NULL,
                                 .narrays = 2, .names = {"adamw.m", "adamw.v"}, .arrays = {m + 3 * r, v + 3 * r},
                                 .lens = {r ? 2 : 3, r ? 2 : 3}};
        if (ds4_checkpoint_write_shard(g_dir, r, 2, &d) != DS4_OK) {
            fprintf(stderr, "fuzz_shards: fixture not written: %s\n", ds4_errmsg());
            abort();
        }
    }
    char sub[600];
    snprintf(sub, sizeof sub, "%s/sub", g_dir); /* a folder the index may name as a file */
    if (mkdir(sub, 0700) != 0) abort();
    snprintf(g_index, sizeof g_index, "%s/" DS4_CKPT_INDEX, g_dir);
    snprintf(g_fuzzed, sizeof g_fuzzed, "%s/fuzzed.safetensors", g_dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    const uint8_t *nul = memchr(data, 0, size);
    const size_t json = nul ? (size_t)(nul - data) : size;
    write_file(g_index, data, json);
    write_file(g_fuzzed, nul ? nul + 1 : data, nul ? size - json - 1 : 0);
    ds4_ckpt_shards *s = NULL;
    if (ds4_ckpt_shards_open(g_dir, -1, &s) != DS4_OK) {
        const char *e = ds4_errmsg();
        if (s || !e[0] || strchr(e, '\n')) abort(); /* one line, nothing half-open */
        if (getenv("DS4_FUZZ_VERBOSE")) fprintf(stderr, "refused: %s\n", e);
    } else {
        const int64_t n = ds4_ckpt_shards_packed_numel(s);
        if (getenv("DS4_FUZZ_VERBOSE")) fprintf(stderr, "opened: %lld packed elements\n", (long long)n);
        float buf[64];
        for (int k = 0; k < 3; k++) {
            ds4_ckpt_shards_select(s, (ds4_ckpt_array)k);
            for (int64_t off = 0; off < n; off += 64) /* an index that opened serves every element */
                if (ds4_ckpt_shards_read(s, off, n - off < 64 ? n - off : 64, buf) != DS4_OK) abort();
        }
        if (ds4_ckpt_shards_read(s, n, 1, buf) == DS4_OK) abort(); /* past the end: an error */
        ds4_ckpt_shards_close(s);
    }
    ds4_mem_stats m;
    ds4_mem_get(&m);
    if (m.live_total != 0) abort();
    return 0;
}
