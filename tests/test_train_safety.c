/* ds4 train against bad values and faults: every numeric key range-checked at config load, the
 * validation loop bounded by its data, a diverged (NaN / Inf) state never saved nor rotating away the
 * last good checkpoint, more than 4096 checkpoints, state.json values range-checked, a checkpoint of
 * another model refused, metrics.jsonl cut back on resume and its writes checked (a full disk, by
 * RLIMIT_FSIZE), a failed save leaving no .tmp-step-N, and one run per checkpoint folder. */
#include "ds4/shard.h"
#include "ds4/trainer.h"
#include "ds4/io.h"
#include "test.h"
#include "test_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[256], g_ds4[1024];

static void write_shard(const char *path, int64_t ndocs, int64_t len) {
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(path, 256, -1, 1, &w) == DS4_OK, "%s", ds4_errmsg());
    int32_t doc[2000];
    for (int64_t d = 0; d < ndocs; d++) {
        for (int64_t i = 0; i < len && i < 2000; i++) doc[i] = (int32_t)(2 + ds4_rng_u64(5, (uint64_t)d, (uint64_t)i) % 254);
        CHECK(ds4_shard_writer_add(w, doc, len) == DS4_OK);
    }
    CHECK(ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
}

/* Small and quick: 2 rows of 32 tokens per step. */
static const char *k_toml =
    "[model]\nconfig = \"tests/configs/tiny-a.json\"\nseed = 3\n"
    "[training]\nsteps = 2\nseq_len = 32\nglobal_batch_size = 2\nmicro_batch_size = 2\nseed = 5\nthreads = 2\n"
    "[optimizer]\nlr = 3e-3\n"
    "[lr_scheduler]\nwarmup_steps = 1\n"
    "[data]\ntrain = \"%s/train.bin\"\n"
    "[checkpoint]\nfolder = \"%s/%s\"\nkeep_latest_k = 3\n"
    "[metrics]\njsonl = \"%s/%s.jsonl\"\npeak_tflops = 1.0\n";

/* The config of run `run` (its own checkpoint folder and metrics file) with up to two overrides. */
static ds4_status cfg_for2(ds4_train_cfg *c, const char *run, const char *k1, const char *v1, const char *k2,
                           const char *v2) {
    char text[4096];
    snprintf(text, sizeof text, k_toml, g_dir, g_dir, run, g_dir, run);
    ds4_toml *t;
    DS4_TRY(ds4_toml_parse(text, strlen(text), "safety.toml", &t));
    ds4_status st = k1 ? ds4_toml_set(t, k1, v1) : DS4_OK;
    if (st == DS4_OK && k2) st = ds4_toml_set(t, k2, v2);
    if (st == DS4_OK) st = ds4_train_cfg_from_toml(t, c);
    ds4_toml_free(t);
    return st;
}

static ds4_status cfg_for(ds4_train_cfg *c, const char *run, const char *key, const char *val) {
    return cfg_for2(c, run, key, val, NULL, NULL);
}

static void path_of(char *p, size_t n, const char *run, const char *rest) {
    snprintf(p, n, "%s/%s%s", g_dir, run, rest);
}

static bool exists(const char *p) { return access(p, F_OK) == 0; }

/* ------------------------------------------------------------------ 1. value ranges */
static void test_every_numeric_key_has_a_range(void) {
    static const struct {
        const char *key, *val, *msg;
    } bad[] = {
        {"optimizer.lr", "nan", "optimizer.lr = nan: expected a finite number > 0"},
        {"optimizer.lr", "inf", "optimizer.lr = inf: expected a finite number > 0"},
        {"optimizer.lr", "-1e-4", "optimizer.lr = -0.0001: expected a finite number > 0"},
        {"optimizer.lr", "0", "optimizer.lr = 0: expected"},
        {"optimizer.beta1", "1.0", "optimizer.beta1 = 1: expected a finite number in [0, 1)"},
        {"optimizer.beta1", "-0.1", "optimizer.beta1 = -0.1"},
        {"optimizer.beta2", "1.5", "optimizer.beta2 = 1.5"},
        {"optimizer.beta2", "nan", "optimizer.beta2 = nan"},
        {"optimizer.eps", "0", "optimizer.eps = 0: expected a finite number > 0"},
        {"optimizer.eps", "-1e-8", "optimizer.eps = -1e-08"},
        {"optimizer.weight_decay", "nan", "optimizer.weight_decay = nan: expected a finite number >= 0"},
        {"optimizer.weight_decay", "-0.1", "optimizer.weight_decay = -0.1"},
        {"training.max_norm", "-1", "training.max_norm = -1: expected a finite number >= 0"},
        {"training.max_norm", "nan", "training.max_norm = nan"},
        {"training.router_bias_gamma", "nan", "training.router_bias_gamma = nan"},
        {"training.router_bias_gamma", "-1e-3", "training.router_bias_gamma = -0.001"},
        {"training.mtp_loss_weight", "nan", "training.mtp_loss_weight = nan"},
        {"training.indexer_loss_coeff", "inf", "training.indexer_loss_coeff = inf"},
        {"lr_scheduler.warmup_steps", "-1", "lr_scheduler.warmup_steps = -1: expected an integer in [0,"},
        {"lr_scheduler.decay_steps", "-5", "lr_scheduler.decay_steps = -5"},
        {"lr_scheduler.min_lr", "nan", "lr_scheduler.min_lr = nan"},
        {"lr_scheduler.min_lr", "-1", "lr_scheduler.min_lr = -1"},
        {"checkpoint.interval", "-1", "checkpoint.interval = -1"},
        {"checkpoint.keep_latest_k", "-1", "checkpoint.keep_latest_k = -1"},
        {"checkpoint.load_step", "-3", "checkpoint.load_step = -3"},
        {"training.threads", "100000", "training.threads = 100000: expected an integer in [0, 1024]"},
        {"training.threads", "-2", "training.threads = -2"},
        {"data.val_batches", "1000000000000", "data.val_batches = 1000000000000"},
        {"data.val_batches", "-1", "data.val_batches = -1"},
        {"training.micro_batch_size", "4611686018427387904", "training.micro_batch_size = 4611686018427387904"},
        {"training.global_batch_size", "-4", "training.global_batch_size = -4"},
        {"training.seq_len", "9223372036854775807", "training.seq_len = 9223372036854775807"},
        {"training.steps", "-1", "training.steps = -1"},
        {"training.steps", "0", "training.steps = 0"},
        {"training.seed", "-1", "training.seed = -1"},
        {"training.csa_dense_steps", "-1", "training.csa_dense_steps = -1"},
        {"model.seed", "-3", "model.seed = -3"},
        {"metrics.log_freq", "0", "metrics.log_freq = 0"},
        {"metrics.peak_tflops", "nan", "metrics.peak_tflops = nan"},
        {"metrics.peak_tflops", "-1", "metrics.peak_tflops = -1"},
        {"parallel.ep", "0", "parallel.ep = 0"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        ds4_train_cfg c;
        ds4_status st = cfg_for(&c, "ranges", bad[i].key, bad[i].val);
        CHECK(st == DS4_ERR_CONFIG, "%s = %s accepted at config load", bad[i].key, bad[i].val);
        CHECK(strstr(ds4_errmsg(), bad[i].msg) != NULL, "message '%s' lacks '%s'", ds4_errmsg(), bad[i].msg);
        CHECK(!strchr(ds4_errmsg(), '\n'), "one line: %s", ds4_errmsg());
    }
    /* a batch x seq_len product past int64 (it wrapped to a tiny buffer: a segfault) */
    ds4_train_cfg c;
    CHECK(cfg_for2(&c, "ranges", "training.micro_batch_size", "16777216", "training.seq_len", "16777216") ==
              DS4_ERR_CONFIG && strstr(ds4_errmsg(), "tokens per micro-batch"), "%s", ds4_errmsg());
    /* the spec's float forms, on the command line as in TorchTitan's configs */
    CHECK(cfg_for(&c, "ranges", "optimizer.lr", "2.2e-4") == DS4_OK && c.adamw.lr == 2.2e-4, "%s", ds4_errmsg());
    /* a program that fills the struct itself is checked by the run too, before any work */
    CHECK(cfg_for(&c, "ranges", NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    c.threads = 100000;
    CHECK(ds4_train_run(&c) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "training.threads = 100000"), "%s", ds4_errmsg());
    char p[600];
    path_of(p, sizeof p, "ranges", ".jsonl");
    CHECK(!exists(p), "a bad config wrote metrics");
}

/* data.val_batches larger than the validation data: one pass over it, then stop (not a loop). */
static void test_validation_stops_at_the_end_of_its_data(void) {
    char val[600], cfgp[600], cmd[2400], out[8192] = "", text[4096];
    path_of(val, sizeof val, "val", ".bin");
    write_shard(val, 3, 60); /* (3 x 60 + BOS/EOS) / 32 = 5 rows: 2 batches of 2 */
    snprintf(text, sizeof text, k_toml, g_dir, g_dir, "val", g_dir, "val");
    path_of(cfgp, sizeof cfgp, "val", ".toml");
    CHECK(ds4_write_file_atomic(cfgp, text, strlen(text)) == DS4_OK, "%s", ds4_errmsg());
    snprintf(cmd, sizeof cmd,
             "timeout -s KILL 300 '%s' train --config '%s' --training.steps 1 --data.val '%s' --data.val_batches 1000000 2>&1",
             g_ds4, cfgp, val);
    FILE *pf = popen(cmd, "r");
    size_t len = 0;
    for (char line[1024]; pf && fgets(line, sizeof line, pf);)
        if (len + strlen(line) < sizeof out) len += (size_t)snprintf(out + len, sizeof out - len, "%s", line);
    int rc = pf ? pclose(pf) : -1;
    CHECK(rc == 0, "exit %d:\n%s", rc, out);
    CHECK(strstr(out, "(2 batches)") != NULL, "validation did not stop after its 5 rows:\n%s", out);
}

/* ------------------------------------------------------------------ 3. checkpoints */
static int count_entries(const char *dir, const char *prefix) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *e; d && (e = readdir(d));) n += strncmp(e->d_name, prefix, strlen(prefix)) == 0;
    if (d) closedir(d);
    return n;
}

/* More step-* folders than the old fixed list of 4096: the newest is found, rotation keeps k. */
static void test_more_than_4096_checkpoints(void) {
    char root[600], p[700], tmp[700];
    path_of(root, sizeof root, "many", "");
    mkdir(root, 0755);
    for (int s = 1; s <= 5000; s++) {
        snprintf(p, sizeof p, "%s/step-%08d", root, s);
        CHECK(mkdir(p, 0755) == 0);
    }
    CHECK(ds4_checkpoint_find(root, -1, p, sizeof p) == DS4_OK && strstr(p, "step-00005000"), "found %s", p);
    ds4_ckpt_meta meta = {.step = 5001, .seed = 1, .data_state = "0 0 1 4"};
    CHECK(ds4_checkpoint_begin(root, 5001, tmp, sizeof tmp) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_checkpoint_commit(root, 2, tmp, &meta) == DS4_OK, "%s", ds4_errmsg());
    CHECK(count_entries(root, "step-") == 2, "%d checkpoints left, keep_latest_k = 2", count_entries(root, "step-"));
    snprintf(p, sizeof p, "%s/step-00005000", root);
    CHECK(exists(p), "the second newest was removed");
    CHECK(ds4_checkpoint_find(root, -1, p, sizeof p) == DS4_OK && strstr(p, "step-00005001"), "found %s", p);
}

/* Rotation never removes the step just saved (a run resumed from an older checkpoint). */
static void test_rotation_keeps_the_new_save(void) {
    char root[600], p[700], tmp[700];
    path_of(root, sizeof root, "rot", "");
    mkdir(root, 0755);
    snprintf(p, sizeof p, "%s/step-00000009", root);
    mkdir(p, 0755);
    ds4_ckpt_meta meta = {.step = 3, .seed = 1, .data_state = "0 0 1 4"};
    CHECK(ds4_checkpoint_begin(root, 3, tmp, sizeof tmp) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_checkpoint_commit(root, 1, tmp, &meta) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/step-00000003/state.json", root);
    CHECK(exists(p), "the checkpoint just saved was rotated away");
}

static void write_text(const char *path, const char *text) {
    CHECK(ds4_write_file_atomic(path, text, strlen(text)) == DS4_OK, "%s", ds4_errmsg());
}

static void test_state_json_values_are_range_checked(void) {
    char dir[600], p[700];
    path_of(dir, sizeof dir, "state", "");
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/state.json", dir);
    static const struct {
        const char *json, *msg;
    } bad[] = {
        {"{\"step\": 1e300, \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}", "key step = 1e+300"},
        {"{\"step\": -7, \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}", "key step = -7"},
        {"{\"step\": 2.5, \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}", "key step = 2.5"},
        {"{\"step\": \"3\", \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}", "key step: expected a number"},
        {"{\"step\": 3, \"seed\": \"-5\", \"data_state\": \"0 0 5 4\"}", "key seed"},
        {"{\"step\": 3, \"seed\": \"99999999999999999999999\", \"data_state\": \"0 0 5 4\"}", "key seed"},
        {"{\"step\": 3, \"seed\": \"5x\", \"data_state\": \"0 0 5 4\"}", "key seed"},
        {"{\"step\": 3, \"seed\": \"5\", \"data_state\": 7}", "key data_state"},
        {"{\"step\": 3, \"seed\": \"5\", \"data_state\": \"0 0 5 4\", \"format\": \"other\"}", "key format"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        write_text(p, bad[i].json);
        ds4_ckpt_meta meta;
        CHECK(ds4_checkpoint_load_meta(dir, &meta) == DS4_ERR_FORMAT, "accepted: %s", bad[i].json);
        CHECK(strstr(ds4_errmsg(), "state.json") && strstr(ds4_errmsg(), bad[i].msg), "message '%s' lacks '%s'",
              ds4_errmsg(), bad[i].msg);
    }
    write_text(p, "{\"step\": 3, \"seed\": \"18446744073709551615\", \"data_state\": \"0 0 5 4\"}");
    ds4_ckpt_meta meta;
    CHECK(ds4_checkpoint_load_meta(dir, &meta) == DS4_OK && meta.step == 3 && meta.seed == UINT64_MAX, "%s",
          ds4_errmsg());
    /* a folder step-N holds step N: a hand-edited step that disagrees is one error naming file, key and folder */
    path_of(dir, sizeof dir, "state", "/step-00000004");
    mkdir(dir, 0755);
    snprintf(p, sizeof p, "%s/state.json", dir);
    write_text(p, "{\"step\": 1000, \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}");
    CHECK(ds4_checkpoint_load_meta(dir, &meta) == DS4_ERR_FORMAT && strstr(ds4_errmsg(), "state.json") &&
              strstr(ds4_errmsg(), "key step = 1000") && strstr(ds4_errmsg(), "step-00000004"),
          "%s", ds4_errmsg());
    write_text(p, "{\"step\": 4, \"seed\": \"5\", \"data_state\": \"0 0 5 4\"}");
    CHECK(ds4_checkpoint_load_meta(dir, &meta) == DS4_OK && meta.step == 4, "%s", ds4_errmsg());
}

/* One saved step of run `run` (checkpoint step-00000001). */
static bool one_saved_step(const char *run) {
    ds4_train_cfg c;
    CHECK(cfg_for2(&c, run, "training.steps", "1", "checkpoint.keep_latest_k", "1") == DS4_OK, "%s", ds4_errmsg());
    ds4_status st = ds4_train_run(&c);
    CHECK(st == DS4_OK, "%s", ds4_errmsg());
    return st == DS4_OK;
}

/* A resume of `run` to 2 steps must fail with a message holding both needles. */
static void resume_fails(const char *run, const char *needle1, const char *needle2) {
    ds4_train_cfg c;
    CHECK(cfg_for(&c, run, NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_train_run(&c) != DS4_OK, "%s: resumed", run);
    CHECK(strstr(ds4_errmsg(), needle1) && strstr(ds4_errmsg(), needle2), "message '%s' lacks '%s' / '%s'",
          ds4_errmsg(), needle1, needle2);
}

/* A checkpoint of another model (or a bad data-loader position) is refused, naming what differs. */
static void test_resume_refuses_another_model(void) {
    if (!one_saved_step("other")) return;
    char p[700], saved[700];
    path_of(p, sizeof p, "other", "/step-00000001/config.json");
    path_of(saved, sizeof saved, "other", "/config.saved");
    CHECK(rename(p, saved) == 0);
    ds4_config mc;
    CHECK(ds4_config_load(saved, &mc) == DS4_OK, "%s", ds4_errmsg());
    mc.rope_theta = 20000;
    CHECK(ds4_config_save(&mc, p) == DS4_OK, "%s", ds4_errmsg());
    resume_fails("other", "rope_theta = 20000", "10000");
    mc.rope_theta = 10000;
    mc.hc_sinkhorn_iters = 7;
    CHECK(ds4_config_save(&mc, p) == DS4_OK, "%s", ds4_errmsg());
    resume_fails("other", "hc_sinkhorn_iters = 7", "20");
    CHECK(rename(saved, p) == 0);
    /* data_state with a negative or non-integer field */
    char st[700];
    path_of(st, sizeof st, "other", "/step-00000001/state.json");
    write_text(st, "{\"step\": 1, \"seed\": \"5\", \"data_state\": \"0 -1 5 2\", \"format\": \"ds4-checkpoint-1\"}");
    resume_fails("other", "data_state", "-1");
    write_text(st, "{\"step\": 1, \"seed\": \"5\", \"data_state\": \"0 1e300 5 2\", \"format\": \"ds4-checkpoint-1\"}");
    resume_fails("other", "data_state", "1e300");
}

/* A run whose state turns non-finite stops naming the step, saves nothing and keeps the last good
 * checkpoint (keep_latest_k = 1 used to rotate it away in favour of the NaN one). */
static void test_diverged_state_is_never_saved(void) {
    if (!one_saved_step("nan")) return;
    ds4_train_cfg c;
    /* lr 1e39: step 2's loss is finite, its update overflows the weights to Inf */
    CHECK(cfg_for2(&c, "nan", "optimizer.lr", "1e39", "training.steps", "3") == DS4_OK, "%s", ds4_errmsg());
    c.ckpt_interval = 1;
    c.keep_latest_k = 1;
    CHECK(ds4_train_run(&c) != DS4_OK, "a diverged run succeeded");
    CHECK(strstr(ds4_errmsg(), "step 2") && strstr(ds4_errmsg(), "non-finite"), "%s", ds4_errmsg());
    char p[700];
    path_of(p, sizeof p, "nan", "/step-00000001/state.json");
    CHECK(exists(p), "the last good checkpoint was rotated away");
    path_of(p, sizeof p, "nan", "/step-00000002");
    CHECK(!exists(p), "the non-finite state was saved");
    path_of(p, sizeof p, "nan", "");
    CHECK(count_entries(p, ".tmp-step-") == 0, "a temporary checkpoint was left behind");
}

/* The "step" of each line of a metrics file, in order; returns the number of lines (-1: no file). */
static int metrics_steps(const char *path, int *steps, int cap) {
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    int n = 0;
    for (char line[4096]; fgets(line, sizeof line, f);) {
        int s = -1;
        if (sscanf(line, "{\"step\": %d,", &s) != 1 || !strchr(line, '\n')) s = -1;
        if (n < cap) steps[n] = s;
        n++;
    }
    fclose(f);
    return n;
}

/* After a kill the re-run steps are not logged twice: the metrics are cut back to the checkpoint. */
static void test_metrics_cut_back_on_resume(void) {
    ds4_train_cfg c;
    CHECK(cfg_for(&c, "cut", "training.steps", "3") == DS4_OK, "%s", ds4_errmsg());
    c.ckpt_interval = 1;
    CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
    /* as if killed during step 3's save, in the middle of writing a line */
    char p[700], cmd[800];
    path_of(p, sizeof p, "cut", "/step-00000003");
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", p);
    CHECK(system(cmd) == 0);
    path_of(p, sizeof p, "cut", ".jsonl");
    FILE *f = fopen(p, "a");
    fputs("{\"step\": 4, \"loss\": 5.1", f);
    fclose(f);
    CHECK(cfg_for(&c, "cut", "training.steps", "4") == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
    int steps[16], n = metrics_steps(p, steps, 16);
    CHECK(n == 4, "%d metrics lines, expected 4 (steps 1..4 once each)", n);
    for (int i = 0; i < n && i < 16; i++) CHECK(steps[i] == i + 1, "line %d: step %d", i + 1, steps[i]);
}

/* Runs c with the size of any file this process writes limited to `bytes` (a full disk). */
static ds4_status run_with_file_limit(const ds4_train_cfg *c, rlim_t bytes) {
    struct rlimit old, lim;
    getrlimit(RLIMIT_FSIZE, &old);
    lim = old;
    lim.rlim_cur = bytes;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    setrlimit(RLIMIT_FSIZE, &lim);
    ds4_status st = ds4_train_run(c);
    setrlimit(RLIMIT_FSIZE, &old);
    signal(SIGXFSZ, prev);
    return st;
}

static void test_full_disk_fails_the_run(void) {
    /* the metrics lines: a failed write is an error naming the file, not a lost line and exit 0 */
    ds4_train_cfg c;
    CHECK(cfg_for(&c, "full", "training.steps", "6") == DS4_OK, "%s", ds4_errmsg());
    c.ckpt_folder[0] = 0;
    ds4_status st = run_with_file_limit(&c, 1000);
    CHECK(st == DS4_ERR_IO, "a run that could not write its metrics returned %d", (int)st);
    CHECK(strstr(ds4_errmsg(), "full.jsonl") && strstr(ds4_errmsg(), "File too large"), "%s", ds4_errmsg());
    /* a checkpoint save: the error names the file and no .tmp-step-N is left behind */
    CHECK(cfg_for(&c, "fullsave", "training.steps", "1") == DS4_OK, "%s", ds4_errmsg());
    st = run_with_file_limit(&c, 16 << 10);
    CHECK(st == DS4_ERR_IO, "a save past the file size limit returned %d", (int)st);
    CHECK(strstr(ds4_errmsg(), "fullsave") && strstr(ds4_errmsg(), "File too large"), "%s", ds4_errmsg());
    char root[600];
    path_of(root, sizeof root, "fullsave", "");
    CHECK(count_entries(root, ".tmp-step-") == 0 && count_entries(root, "step-") == 0,
          "a failed save left %d .tmp-step-N and %d step-N", count_entries(root, ".tmp-step-"),
          count_entries(root, "step-"));
}

/* ------------------------------------------------------------------ output folders */
static pid_t spawn_long_run(const char *run) {
    char cfgp[600], text[4096];
    snprintf(text, sizeof text, k_toml, g_dir, g_dir, run, g_dir, run);
    path_of(cfgp, sizeof cfgp, run, ".toml");
    write_text(cfgp, text);
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", 1);
        dup2(null, 1);
        dup2(null, 2);
        execl(g_ds4, g_ds4, "train", "--config", cfgp, "--training.steps", "100000", "--training.threads", "1",
              (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* A second run on a checkpoint folder in use fails at the start, naming it; an unusable folder fails
 * before the first step instead of at the first save. */
static void test_one_run_per_checkpoint_folder(void) {
    pid_t pid = spawn_long_run("locked");
    char jl[600], root[600];
    path_of(jl, sizeof jl, "locked", ".jsonl");
    path_of(root, sizeof root, "locked", "");
    bool started = t_wait_for_file(jl, 120);
    CHECK(started, "the first run never logged a step");
    ds4_train_cfg c;
    CHECK(cfg_for(&c, "locked", NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    snprintf(c.jsonl, sizeof c.jsonl, "%s/locked2.jsonl", g_dir);
    if (started) {
        CHECK(ds4_train_run(&c) == DS4_ERR_IO, "a second run on %s was started", root);
        CHECK(strstr(ds4_errmsg(), root) && strstr(ds4_errmsg(), "another ds4 train run"), "%s", ds4_errmsg());
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    CHECK(ds4_train_run(&c) == DS4_OK, "the folder stays locked after the first run died: %s", ds4_errmsg());
    /* a checkpoint folder that cannot be created */
    char file[600];
    path_of(file, sizeof file, "plainfile", "");
    write_text(file, "x");
    CHECK(cfg_for(&c, "unwritable", NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    snprintf(c.ckpt_folder, sizeof c.ckpt_folder, "%s/ckpt", file);
    CHECK(ds4_train_run(&c) == DS4_ERR_IO && strstr(ds4_errmsg(), c.ckpt_folder), "%s", ds4_errmsg());
    path_of(jl, sizeof jl, "unwritable", ".jsonl");
    int steps[4];
    CHECK(metrics_steps(jl, steps, 4) <= 0, "steps ran before the checkpoint folder was found unusable");
}

int main(int argc, char **argv) {
    (void)argc;
    snprintf(g_ds4, sizeof g_ds4, "%s", argv[0]);
    char *slash = strstr(g_ds4, "/tests/");
    if (slash) strcpy(slash, "/ds4");
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-train-safety-%d", (int)getpid());
    mkdir(g_dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/train.bin", g_dir);
    write_shard(p, 4, 300);
    ds4_set_threads(2);
    RUN(test_every_numeric_key_has_a_range);
    RUN(test_validation_stops_at_the_end_of_its_data);
    RUN(test_more_than_4096_checkpoints);
    RUN(test_rotation_keeps_the_new_save);
    RUN(test_state_json_values_are_range_checked);
    RUN(test_resume_refuses_another_model);
    RUN(test_diverged_state_is_never_saved);
    RUN(test_metrics_cut_back_on_resume);
    RUN(test_full_disk_fails_the_run);
    RUN(test_one_run_per_checkpoint_folder);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (!t_failed && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_MAIN_END("test_train_safety");
}
