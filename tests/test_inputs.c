/* Hostile inputs: every one is refused with a one-line error naming the file, and none hangs.
 *   FIFOs (and devices) where a file is expected: config.json, a safetensors file, a shard, an entry
 *     of a model directory or a data glob — refused at once (an alarm fails a test that would hang). */
#include "ds4/data.h"
#include "ds4/io.h"
#include "ds4/shard.h"
#include "test.h"

#include <signal.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];
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

static ds4_config tiny_config(void) {
    ds4_config c = {0};
    if (ds4_config_load(repo_file("tests/configs/tiny-a.json"), &c) != DS4_OK) t_note("tiny-a.json: %s", ds4_errmsg());
    return c;
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

/* ---------------------------------------------------------------- main */

static void cleanup(void) {
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-inputs-XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    signal(SIGALRM, on_alarm);
    RUN_GUARDED(test_fifo_inputs, 10);
    RUN_GUARDED(test_fifo_in_model_dir, 10);
    cleanup();
    TEST_MAIN_END("test_inputs");
}
