/* Data loader: packing of documents into rows, shuffling, data-parallel slicing, train/val split,
 * and bitwise resume from a saved position. */
#include "ds4/data.h"
#include "ds4/shard.h"
#include "test.h"

#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];
#define VOCAB 50
#define BOS 48
#define EOS 49

static const char *path_in(const char *name) {
    static char buf[8][256];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

/* The expected stream, built independently of the loader. */
static int32_t g_stream[100000];
static int64_t g_stream_n;

/* Writes shard `name` with `n_docs` documents; document lengths and tokens follow from `salt`. */
static void make_shard(const char *name, int n_docs, int salt, int32_t bos, int32_t eos, bool record) {
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(path_in(name), VOCAB, bos, eos, &w) == DS4_OK, "%s", ds4_errmsg());
    for (int d = 0; d < n_docs; d++) {
        int32_t doc[64];
        int len = (d * 7 + salt * 3) % 23; /* includes empty documents */
        for (int i = 0; i < len; i++) doc[i] = (int32_t)((d * 31 + i * 17 + salt) % 48);
        CHECK(ds4_shard_writer_add(w, doc, len) == DS4_OK);
        if (record) {
            if (bos >= 0) g_stream[g_stream_n++] = bos;
            for (int i = 0; i < len; i++) g_stream[g_stream_n++] = doc[i];
            if (eos >= 0) g_stream[g_stream_n++] = eos;
        }
    }
    CHECK(ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
}

static ds4_dataloader *open1(const char *pattern, ds4_data_opts o) {
    ds4_dataloader *d = NULL;
    const char *pats[1] = {pattern};
    CHECK(ds4_data_open(pats, 1, &o, &d) == DS4_OK, "%s", ds4_errmsg());
    return d;
}

static ds4_data_opts opts(int64_t T, int64_t B, bool shuffle) {
    ds4_data_opts o = ds4_data_defaults();
    o.seq_len = T;
    o.batch_size = B;
    o.shuffle = shuffle;
    o.seed = 1234;
    return o;
}

static void test_packing(void) {
    ds4_dataloader *d = open1(path_in("train_*.bin"), opts(16, 4, false));
    if (!d) return;
    CHECK(ds4_data_n_shards(d) == 3 && ds4_data_vocab_size(d) == VOCAB && ds4_data_bos(d) == BOS && ds4_data_eos(d) == EOS);
    CHECK(ds4_data_stream_tokens(d) == g_stream_n, "%lld vs %lld", (long long)ds4_data_stream_tokens(d), (long long)g_stream_n);
    int64_t n_rows = ds4_data_n_rows(d);
    CHECK(n_rows == g_stream_n / 16, "rows %lld", (long long)n_rows);
    /* every row is the next 16 stream tokens; the first starts with BOS */
    int32_t row[16];
    int bad = 0;
    for (int64_t i = 0; i < n_rows; i++) {
        ds4_data_row(d, i, row);
        bad += memcmp(row, g_stream + i * 16, sizeof row) != 0;
    }
    CHECK(bad == 0, "%d rows differ from the expected packing", bad);
    CHECK(ds4_data_row(d, 0, row) == DS4_OK && row[0] == BOS);
    CHECK(ds4_data_row(d, n_rows, row) == DS4_ERR_ARG);
    /* unshuffled batches are the rows in order, wrapping into the next epoch */
    int32_t batch[4 * 16];
    for (int64_t b = 0; b * 4 < n_rows + 8; b++) {
        ds4_data_next(d, batch);
        for (int r = 0; r < 4; r++) {
            int64_t i = (b * 4 + r) % n_rows;
            if (memcmp(batch + r * 16, g_stream + i * 16, 16 * sizeof(int32_t)) != 0) bad++;
        }
    }
    CHECK(bad == 0, "%d batch rows out of stream order", bad);
    ds4_data_state st;
    ds4_data_get_state(d, &st);
    CHECK(st.epoch == 1, "epoch %llu after one pass", (unsigned long long)st.epoch);
    ds4_data_close(d);

    /* a directory and a list of files give the same stream as the glob */
    ds4_data_opts o = opts(16, 4, false);
    const char *files[3] = {path_in("train_000000.bin"), path_in("train_000001.bin"), path_in("train_000002.bin")};
    ds4_dataloader *a = NULL;
    CHECK(ds4_data_open(files, 3, &o, &a) == DS4_OK);
    ds4_dataloader *b = open1(path_in("sub"), o);
    if (a && b) {
        CHECK(ds4_data_n_rows(a) == n_rows && ds4_data_n_rows(b) == n_rows);
        int32_t ra[16], rb[16];
        for (int64_t i = 0; i < n_rows; i++) {
            ds4_data_row(a, i, ra);
            ds4_data_row(b, i, rb);
            bad += memcmp(ra, g_stream + i * 16, sizeof ra) != 0 || memcmp(rb, ra, sizeof ra) != 0;
        }
        CHECK(bad == 0);
    }
    ds4_data_close(a);
    ds4_data_close(b);

    /* without BOS: documents are separated by EOS only */
    o = opts(8, 1, false);
    o.bos_id = -1;
    d = open1(path_in("train_000000.bin"), o);
    if (d) {
        ds4_data_row(d, 0, row);
        CHECK(row[0] != BOS && ds4_data_bos(d) == -1);
        int n_bos = 0;
        for (int64_t i = 0; i < ds4_data_n_rows(d); i++) {
            ds4_data_row(d, i, row);
            for (int j = 0; j < 8; j++) n_bos += row[j] == BOS;
        }
        CHECK(n_bos == 0);
    }
    ds4_data_close(d);
}

static int cmp_row8(const void *a, const void *b) { return memcmp(a, b, 8 * sizeof(int32_t)); }

static void test_shuffle(void) {
    ds4_dataloader *d = open1(path_in("train_*.bin"), opts(8, 3, true));
    if (!d) return;
    int64_t n = ds4_data_n_rows(d);
    /* two epochs of batch rows (batches straddle the epoch boundary) */
    int32_t *rows = malloc(sizeof(int32_t) * 8 * (2 * n + 3));
    int64_t got = 0;
    while (got < 2 * n) {
        ds4_data_next(d, rows + got * 8);
        got += 3;
    }
    /* each epoch holds every row once: as multisets, epoch rows == stream rows */
    int32_t *sorted_stream = malloc(sizeof(int32_t) * 8 * n);
    memcpy(sorted_stream, g_stream, sizeof(int32_t) * 8 * n);
    qsort(sorted_stream, (size_t)n, 8 * sizeof(int32_t), cmp_row8);
    int epochs_ok = 1, same = 1, in_order = 1;
    for (int e = 0; e < 2; e++) {
        int32_t *ep = malloc(sizeof(int32_t) * 8 * n);
        memcpy(ep, rows + e * n * 8, sizeof(int32_t) * 8 * n);
        in_order &= memcmp(ep, g_stream, sizeof(int32_t) * 8 * n) == 0;
        qsort(ep, (size_t)n, 8 * sizeof(int32_t), cmp_row8);
        epochs_ok &= memcmp(ep, sorted_stream, sizeof(int32_t) * 8 * n) == 0;
        free(ep);
    }
    same = memcmp(rows, rows + n * 8, sizeof(int32_t) * 8 * n) == 0;
    CHECK(epochs_ok, "every epoch visits every row exactly once");
    CHECK(!same && !in_order, "each epoch has its own order, not the stream order");
    free(rows);
    free(sorted_stream);
    ds4_data_close(d);
    /* same seed: same order; another seed: another order */
    ds4_data_opts o = opts(8, 3, true);
    ds4_dataloader *a = open1(path_in("train_*.bin"), o);
    o.seed = 99;
    ds4_dataloader *b = open1(path_in("train_*.bin"), o);
    ds4_dataloader *c = open1(path_in("train_*.bin"), opts(8, 3, true));
    int32_t ba[24], bb[24], bc[24];
    int diff_seed = 0, diff_same = 0;
    for (int i = 0; i < 10; i++) {
        ds4_data_next(a, ba), ds4_data_next(b, bb), ds4_data_next(c, bc);
        diff_seed += memcmp(ba, bb, sizeof ba) != 0;
        diff_same += memcmp(ba, bc, sizeof ba) != 0;
    }
    CHECK(diff_same == 0 && diff_seed > 0);
    ds4_data_close(a);
    ds4_data_close(b);
    ds4_data_close(c);
}

/* N batches straight == k batches, save, a new loader restored, N-k batches: bitwise. */
static void test_resume(void) {
    const int64_t T = 8, B = 5;
    const int N = 40, K = 13; /* crosses epoch boundaries (about 11 batches per epoch) */
    ds4_dataloader *d = open1(path_in("train_*.bin"), opts(T, B, true));
    if (!d) return;
    CHECK(ds4_data_n_rows(d) < N * B / 2, "the run spans several epochs (%lld rows)", (long long)ds4_data_n_rows(d));
    int32_t *straight = malloc(sizeof(int32_t) * N * B * T), *resumed = malloc(sizeof(int32_t) * N * B * T);
    for (int i = 0; i < N; i++) ds4_data_next(d, straight + i * B * T);
    ds4_data_close(d);
    d = open1(path_in("train_*.bin"), opts(T, B, true));
    for (int i = 0; i < K; i++) ds4_data_next(d, resumed + i * B * T);
    ds4_data_state st;
    ds4_data_get_state(d, &st);
    ds4_data_close(d);
    d = open1(path_in("train_*.bin"), opts(T, B, true));
    CHECK(ds4_data_set_state(d, &st) == DS4_OK, "%s", ds4_errmsg());
    for (int i = K; i < N; i++) ds4_data_next(d, resumed + i * B * T);
    CHECK(memcmp(straight, resumed, sizeof(int32_t) * N * B * T) == 0, "resumed batches differ");
    ds4_data_close(d);
    /* a state from another loader is refused */
    ds4_data_opts o = opts(T, B, true);
    o.seed = 7;
    d = open1(path_in("train_*.bin"), o);
    CHECK(ds4_data_set_state(d, &st) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "seed 1234"), "%s", ds4_errmsg());
    ds4_data_close(d);
    d = open1(path_in("train_*.bin"), opts(T + 1, B, true));
    CHECK(ds4_data_set_state(d, &st) == DS4_ERR_CONFIG);
    ds4_data_state bad = st;
    bad.position = st.n_rows;
    ds4_data_close(d);
    d = open1(path_in("train_*.bin"), opts(T, B, true));
    CHECK(ds4_data_set_state(d, &bad) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "past the"));
    ds4_data_close(d);
    free(straight);
    free(resumed);
}

/* Two ranks with batch B see exactly the rows of one rank with batch 2B. */
static void test_data_parallel(void) {
    const int64_t T = 8, B = 3;
    ds4_dataloader *one = open1(path_in("train_*.bin"), opts(T, 2 * B, true));
    ds4_data_opts o = opts(T, B, true);
    o.dp_size = 2;
    o.dp_rank = 0;
    ds4_dataloader *r0 = open1(path_in("train_*.bin"), o);
    o.dp_rank = 1;
    ds4_dataloader *r1 = open1(path_in("train_*.bin"), o);
    if (!one || !r0 || !r1) return;
    int32_t g[2 * 3 * 8], a[3 * 8], b[3 * 8];
    int bad = 0;
    for (int i = 0; i < 30; i++) {
        ds4_data_next(one, g), ds4_data_next(r0, a), ds4_data_next(r1, b);
        bad += memcmp(g, a, sizeof a) != 0 || memcmp(g + B * T, b, sizeof b) != 0;
    }
    CHECK(bad == 0, "%d batches differ between 2 ranks and 1 rank", bad);
    ds4_data_close(one);
    ds4_data_close(r0);
    ds4_data_close(r1);
    o.dp_rank = 2;
    ds4_dataloader *x = NULL;
    const char *p[1] = {path_in("train_*.bin")};
    CHECK(ds4_data_open(p, 1, &o, &x) == DS4_ERR_ARG && x == NULL);
}

static void test_split(void) {
    ds4_data_opts o = opts(8, 2, true);
    ds4_dataloader *all = open1(path_in("train_*.bin"), opts(8, 2, false));
    o.split = DS4_SPLIT_TRAIN;
    o.val_fraction = 0.1;
    ds4_dataloader *tr = open1(path_in("train_*.bin"), o);
    o.split = DS4_SPLIT_VAL;
    o.shuffle = false;
    ds4_dataloader *va = open1(path_in("train_*.bin"), o);
    if (!all || !tr || !va) return;
    int64_t n = ds4_data_n_rows(all), nt = ds4_data_n_rows(tr), nv = ds4_data_n_rows(va);
    CHECK(nt + nv == n && nv == (int64_t)(n * 0.1), "%lld + %lld vs %lld", (long long)nt, (long long)nv, (long long)n);
    int32_t x[8], y[8];
    int bad = 0;
    for (int64_t i = 0; i < nv; i++) { /* val is the tail of the stream */
        ds4_data_row(va, i, x);
        ds4_data_row(all, nt + i, y);
        bad += memcmp(x, y, sizeof x) != 0;
    }
    for (int64_t i = 0; i < nt; i++) {
        ds4_data_row(tr, i, x);
        ds4_data_row(all, i, y);
        bad += memcmp(x, y, sizeof x) != 0;
    }
    CHECK(bad == 0);
    /* training batches only hold training rows */
    int32_t batch[16];
    int leaks = 0;
    for (int i = 0; i < 3 * (int)nt; i++) {
        ds4_data_next(tr, batch);
        for (int r = 0; r < 2; r++) {
            int64_t id = -1;
            for (int64_t j = 0; j < n && id < 0; j++)
                if (memcmp(batch + r * 8, g_stream + j * 8, sizeof x) == 0) id = j;
            leaks += id < 0 || id >= nt;
        }
    }
    CHECK(leaks == 0, "%d training rows came from the validation tail", leaks);
    ds4_data_close(all);
    ds4_data_close(tr);
    ds4_data_close(va);
    ds4_dataloader *z = NULL;
    const char *p[1] = {path_in("train_*.bin")};
    o.val_fraction = 0;
    CHECK(ds4_data_open(p, 1, &o, &z) == DS4_ERR_ARG && strstr(ds4_errmsg(), "val_fraction"));
}

static void test_errors(void) {
    ds4_dataloader *d = NULL;
    ds4_data_opts o = opts(8, 2, true);
    const char *p[2] = {path_in("nothing_*.bin"), NULL};
    CHECK(ds4_data_open(p, 1, &o, &d) == DS4_ERR_MISSING && strstr(ds4_errmsg(), "no shard matches") && d == NULL);
    p[0] = path_in("empty_dir");
    mkdir(p[0], 0755);
    CHECK(ds4_data_open(p, 1, &o, &d) == DS4_ERR_MISSING && strstr(ds4_errmsg(), "holds no .bin shards"));
    rmdir(p[0]);
    /* shards from different tokenizers */
    make_shard("other_vocab.bin", 3, 1, -1, 2, false); /* same vocab, other bos */
    p[0] = path_in("train_000000.bin");
    p[1] = path_in("other_vocab.bin");
    CHECK(ds4_data_open(p, 2, &o, &d) == DS4_ERR_FORMAT && strstr(ds4_errmsg(), "other_vocab.bin: bos/eos -1/2"), "%s",
          ds4_errmsg());
    ds4_shard_writer *w;
    ds4_shard_writer_open(path_in("big_vocab.bin"), 1000, -1, 999, &w);
    int32_t doc[3] = {1, 2, 3};
    ds4_shard_writer_add(w, doc, 3);
    ds4_shard_writer_close(w);
    p[1] = path_in("big_vocab.bin");
    CHECK(ds4_data_open(p, 2, &o, &d) == DS4_ERR_FORMAT && strstr(ds4_errmsg(), "big_vocab.bin: vocab size 1000, expected 50"));
    p[0] = path_in("big_vocab.bin");
    o.max_vocab = 500;
    CHECK(ds4_data_open(p, 1, &o, &d) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "larger than the model's 500"));
    o.max_vocab = 0;
    o.seq_len = 64;
    CHECK(ds4_data_open(p, 1, &o, &d) == DS4_ERR_ARG && strstr(ds4_errmsg(), "less than one row"), "%s", ds4_errmsg());
    o.seq_len = 1;
    CHECK(ds4_data_open(p, 1, &o, &d) == DS4_ERR_ARG && strstr(ds4_errmsg(), "seq_len 1"));
    unlink(path_in("other_vocab.bin"));
    unlink(path_in("big_vocab.bin"));
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_data_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    /* three shards of documents of 0..22 tokens (some empty) */
    make_shard("train_000000.bin", 20, 1, BOS, EOS, true);
    make_shard("train_000001.bin", 4, 0, BOS, EOS, true); /* lengths 0, 7, 14, 21 */
    make_shard("train_000002.bin", 25, 5, BOS, EOS, true);
    mkdir(path_in("sub"), 0755);
    for (int i = 0; i < 3; i++) { /* the same shards in a directory, plus a file that is not a shard */
        char a[32], b[64];
        snprintf(a, sizeof a, "train_00000%d.bin", i);
        snprintf(b, sizeof b, "sub/%s", a);
        CHECK(link(path_in(a), path_in(b)) == 0);
    }
    FILE *f = fopen(path_in("sub/README.txt"), "w");
    fputs("not a shard", f);
    fclose(f);
    RUN(test_packing);
    RUN(test_shuffle);
    RUN(test_resume);
    RUN(test_data_parallel);
    RUN(test_split);
    RUN(test_errors);
    ds4_mem_get(&m1);
    t_cur_failed = 0;
    CHECK(m1.live_total == m0.live_total, "counted bytes leaked: %lld", (long long)(m1.live_total - m0.live_total));
    if (t_cur_failed) t_failed++; else t_passed++;
    for (int i = 0; i < 3; i++) {
        char a[64];
        snprintf(a, sizeof a, "train_00000%d.bin", i);
        unlink(path_in(a));
        snprintf(a, sizeof a, "sub/train_00000%d.bin", i);
        unlink(path_in(a));
    }
    unlink(path_in("sub/README.txt"));
    rmdir(path_in("sub"));
    rmdir(g_dir);
    TEST_MAIN_END("test_data");
}
