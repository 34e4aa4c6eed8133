/* ds4 train end to end on tiny-a: bitwise resume, SIGINT save, kill -9 during saves, config and data
 * errors before any work starts, learning on a learnable stream. */
#include "ds4/shard.h"
#include "ds4/trainer.h"
#include "ds4/io.h"
#include "ds4/kernels.h"
#include "test.h"
#include "test_files.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

static char g_dir[256], g_ds4[1024];

/* A shard of `ndocs` documents; tokens follow a noisy periodic pattern so the model can learn. */
static void write_shard(const char *path, int64_t vocab, int64_t ndocs, int64_t len) {
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(path, vocab, -1, 1, &w) == DS4_OK, "%s", ds4_errmsg());
    int32_t *doc = malloc((size_t)len * sizeof(int32_t));
    for (int64_t d = 0; d < ndocs; d++) {
        for (int64_t i = 0; i < len; i++) {
            uint64_t r = ds4_rng_u64(7, (uint64_t)d, (uint64_t)i);
            doc[i] = (int32_t)(r % 10 == 0 ? (int64_t)(2 + r % (uint64_t)(vocab - 2)) : 2 + (i * 7 + d) % 16);
        }
        CHECK(ds4_shard_writer_add(w, doc, len) == DS4_OK);
    }
    CHECK(ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
    free(doc);
}

static const char *k_base_toml =
    "[model]\nconfig = \"tests/configs/tiny-a.json\"\nseed = 3\n"
    "[training]\nsteps = 4\nseq_len = 64\nglobal_batch_size = 4\nmicro_batch_size = 2\nseed = 5\nmax_norm = 1.0\n"
    "[optimizer]\nlr = 3e-3\n"
    "[lr_scheduler]\nwarmup_steps = 1\ndecay_steps = 4\n"
    "[data]\ntrain = \"%s/train.bin\"\n"
    "[checkpoint]\nfolder = \"%s/%s\"\nkeep_latest_k = 3\n"
    "[metrics]\nlog_freq = 1\njsonl = \"%s/%s.jsonl\"\npeak_tflops = 1.0\n";

static ds4_status cfg_for(ds4_train_cfg *c, const char *run, const char *extra_key, const char *extra_val) {
    char text[4096];
    snprintf(text, sizeof text, k_base_toml, g_dir, g_dir, run, g_dir, run);
    ds4_toml *t;
    DS4_TRY(ds4_toml_parse(text, strlen(text), "test.toml", &t));
    ds4_status st = extra_key ? ds4_toml_set(t, extra_key, extra_val) : DS4_OK;
    if (st == DS4_OK) st = ds4_train_cfg_from_toml(t, c);
    ds4_toml_free(t);
    return st;
}

/* The "loss" of `step` in a JSONL file (last record of that step wins). */
static double jsonl_loss(const char *path, int step) {
    FILE *f = fopen(path, "r");
    if (!f) return NAN;
    char line[2048];
    double v = NAN;
    while (fgets(line, sizeof line, f)) {
        int s;
        double l;
        if (sscanf(line, "{\"step\": %d, \"loss\": %lf", &s, &l) == 2 && s == step) v = l;
    }
    fclose(f);
    return v;
}

static void test_resume_is_bitwise(void) {
    ds4_train_cfg a, b;
    CHECK(cfg_for(&a, "straight", NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_train_run(&a) == DS4_OK, "%s", ds4_errmsg());
    CHECK(cfg_for(&b, "resumed", "training.steps", "2") == DS4_OK);
    CHECK(ds4_train_run(&b) == DS4_OK, "%s", ds4_errmsg());
    CHECK(cfg_for(&b, "resumed", NULL, NULL) == DS4_OK);
    CHECK(ds4_train_run(&b) == DS4_OK, "%s", ds4_errmsg());
    char p1[512], p2[512];
    for (int s = 1; s <= 4; s++) {
        snprintf(p1, sizeof p1, "%s/straight.jsonl", g_dir);
        snprintf(p2, sizeof p2, "%s/resumed.jsonl", g_dir);
        double l1 = jsonl_loss(p1, s), l2 = jsonl_loss(p2, s);
        CHECK(isfinite(l1) && l1 == l2, "step %d: loss %.9g straight vs %.9g resumed", s, l1, l2);
    }
    const char *files[] = {"model.safetensors", "optim.state"};
    for (int i = 0; i < 2; i++) {
        snprintf(p1, sizeof p1, "%s/straight/step-00000004/%s", g_dir, files[i]);
        snprintf(p2, sizeof p2, "%s/resumed/step-00000004/%s", g_dir, files[i]);
        CHECK(t_files_equal(p1, p2), "%s differs between the straight and the resumed run", files[i]);
    }
    snprintf(p1, sizeof p1, "%s/resumed/step-00000002/state.json", g_dir);
    CHECK(access(p1, F_OK) == 0, "the first leg's checkpoint is kept (keep_latest_k = 3)");
}

/* Offload changes no bit: each swap alone against the straight run of test_resume_is_bitwise, the
 * swapped optimizer also resumed half way (its moments load from the checkpoint into the store). */
static void test_swap_is_bitwise(void) {
    const char *runs[][3] = {{"swap_opt", "memory.swap_optimizer", "true"},
                             {"swap_in", "memory.swap_layer_input", "true"}};
    ds4_train_cfg c;
    for (int r = 0; r < 2; r++) {
        CHECK(cfg_for(&c, runs[r][0], runs[r][1], runs[r][2]) == DS4_OK, "%s", ds4_errmsg());
        if (r == 0) {
            c.steps = 2;
            CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
            c.steps = 4;
        }
        CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
        char p1[512], p2[512];
        snprintf(p1, sizeof p1, "%s/straight.jsonl", g_dir);
        snprintf(p2, sizeof p2, "%s/%s.jsonl", g_dir, runs[r][0]);
        for (int s = 1; s <= 4; s++) {
            double l1 = jsonl_loss(p1, s), l2 = jsonl_loss(p2, s);
            CHECK(isfinite(l1) && l1 == l2, "%s: step %d: loss %.9g straight vs %.9g", runs[r][0], s, l1, l2);
        }
        const char *files[] = {"model.safetensors", "optim.state"};
        for (int i = 0; i < 2; i++) {
            snprintf(p1, sizeof p1, "%s/straight/step-00000004/%s", g_dir, files[i]);
            snprintf(p2, sizeof p2, "%s/%s/step-00000004/%s", g_dir, runs[r][0], files[i]);
            CHECK(t_files_equal(p1, p2), "%s: %s differs from the straight run", runs[r][0], files[i]);
        }
    }
    /* an offload folder that cannot be made (a file in the way; a missing one is made as by mkdir -p) */
    char blocker[600], bad[700];
    snprintf(blocker, sizeof blocker, "%s/a-file", g_dir);
    FILE *bf = fopen(blocker, "w");
    if (bf) fclose(bf);
    snprintf(bad, sizeof bad, "%s/ds4", blocker);
    CHECK(cfg_for(&c, "bad_dir", "memory.offload_dir", bad) == DS4_OK);
    c.swap_optimizer = true;
    ds4_status st = ds4_train_run(&c);
    CHECK(st != DS4_OK && strstr(ds4_errmsg(), bad) && strstr(ds4_errmsg(), "offload folder") &&
          strstr(ds4_errmsg(), "a file of that name is in the way"), "an offload dir that cannot be made: %s", ds4_errmsg());
}

/* Muon: 4 steps straight == 2 + resume + 2 (losses and checkpoint bytes, the momentum included), also
 * with the momentum in the offload store (--swap-optimizer) and resumed there. */
static void same_run_from(const char *a, const char *b, int from, int step) {
    char p1[512], p2[512];
    for (int s = from; s <= step; s++) {
        snprintf(p1, sizeof p1, "%s/%s.jsonl", g_dir, a);
        snprintf(p2, sizeof p2, "%s/%s.jsonl", g_dir, b);
        double l1 = jsonl_loss(p1, s), l2 = jsonl_loss(p2, s);
        CHECK(isfinite(l1) && l1 == l2, "%s vs %s: step %d: loss %.9g vs %.9g", a, b, s, l1, l2);
    }
    const char *files[] = {"model.safetensors", "optim.state"};
    for (int i = 0; i < 2; i++) {
        snprintf(p1, sizeof p1, "%s/%s/step-%08d/%s", g_dir, a, step, files[i]);
        snprintf(p2, sizeof p2, "%s/%s/step-%08d/%s", g_dir, b, step, files[i]);
        CHECK(t_files_equal(p1, p2), "%s differs between %s and %s", files[i], a, b);
    }
}
static void same_run(const char *a, const char *b, int step) { same_run_from(a, b, 1, step); }

static void test_muon_resume_is_bitwise(void) {
    const char *runs[][2] = {{"muon", NULL}, {"muon_resumed", NULL}, {"muon_swap", "true"}};
    for (int r = 0; r < 3; r++) {
        ds4_train_cfg c;
        CHECK(cfg_for(&c, runs[r][0], "optimizer.name", "Muon") == DS4_OK, "%s", ds4_errmsg());
        CHECK(c.optimizer == &ds4_optimizer_muon && c.muon.ns_steps == 10 && c.muon.ns_final_steps == 2 && c.muon.update_rms == 0.18);
        c.swap_optimizer = runs[r][1] != NULL;
        if (r > 0) {
            c.steps = 2;
            CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
            c.steps = 4;
        }
        CHECK(ds4_train_run(&c) == DS4_OK, "%s: %s", runs[r][0], ds4_errmsg());
    }
    same_run("muon", "muon_resumed", 4);
    same_run("muon", "muon_swap", 4);
    char p1[512], p2[512];
    snprintf(p1, sizeof p1, "%s/muon/step-00000004/model.safetensors", g_dir);
    snprintf(p2, sizeof p2, "%s/straight/step-00000004/model.safetensors", g_dir);
    CHECK(!t_files_equal(p1, p2), "Muon trained the same weights as AdamW");
}

/* DIR/optim.state (a Muon run's) rewritten in the layout ds4 wrote before Muon owned its state: adamw.m and
 * adamw.v over every element, the momentum in adamw.m over the Muon group and zeros in adamw.v there (the
 * tensors added in the order that writer added them). */
static void write_old_muon_layout(const char *dir) {
    char path[700];
    snprintf(path, sizeof path, "%s/optim.state", dir);
    ds4_config c;
    ds4_model *m = NULL;
    ds4_optim o = {0};
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK && ds4_model_create(NULL, &c, false, &m) == DS4_OK &&
              ds4_optim_init(&o, &ds4_optimizer_muon, m, NULL, 0) == DS4_OK &&
              ds4_optim_state_load(&o, m, NULL, &ds4_optimizer_muon, path, NULL) == DS4_OK,
          "%s", ds4_errmsg());
    if (!m || !o.runs) return;
    const int64_t n = ds4_model_numel(m), one = 1;
    float *mo = calloc((size_t)n, sizeof(float)), *v = calloc((size_t)n, sizeof(float));
    float *mom = calloc((size_t)n, sizeof(float));
    CHECK(ds4_optim_expand(&o, DS4_OPT_ADAMW, 0, mo) == DS4_OK && ds4_optim_expand(&o, DS4_OPT_ADAMW, 1, v) == DS4_OK &&
          ds4_optim_expand(&o, DS4_OPT_OWN, 0, mom) == DS4_OK);
    const float *flat = ds4_model_params_flat(m);
    int64_t moved = 0;
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        if (!ds4_param_in_flat(p) || !ds4_param_is_muon(p)) continue;
        memcpy(mo + (p->data - flat), mom + (p->data - flat), (size_t)p->numel * sizeof(float));
        moved += p->numel;
    }
    CHECK(moved == o.g[DS4_OPT_OWN].n && moved > 0, "%lld momentum elements placed", (long long)moved);
    ds4_st_writer *w = NULL;
    CHECK(ds4_st_writer_new(&w) == DS4_OK && ds4_st_writer_add(w, "adamw.m", DS4_F32, 1, &n, mo) == DS4_OK &&
              ds4_st_writer_add(w, "adamw.v", DS4_F32, 1, &n, v) == DS4_OK &&
              ds4_st_writer_add(w, "adamw.step", DS4_I64, 1, &one, &o.step) == DS4_OK &&
              ds4_st_writer_add(w, "muon.step", DS4_I64, 1, &one, &o.step) == DS4_OK && ds4_st_writer_write(w, path) == DS4_OK,
          "%s", ds4_errmsg());
    ds4_st_writer_free(w);
    ds4_st_file *f = NULL;
    CHECK(ds4_st_open(path, &f) == DS4_OK && !ds4_st_find(f, "muon.momentum") &&
              ds4_st_entry_numel(ds4_st_find(f, "adamw.m")) == n,
          "%s is not in the old layout", path);
    if (f) ds4_st_close(f);
    free(mo);
    free(v);
    free(mom);
    ds4_optim_free(&o);
    ds4_model_free(m);
}

/* A Muon checkpoint in the layout ds4 wrote before Muon owned its state (momentum in adamw.m) resumes to
 * the bits of the straight run, resident and into the offload store (--swap-optimizer). The layout was
 * checked once against a checkpoint written by that ds4 (commit 5d55471): it resumed to the same bits. */
static void test_muon_old_layout_resumes_bitwise(void) {
    const char *runs[] = {"muon_old", "muon_old_swap"};
    for (int r = 0; r < 2; r++) {
        char cmd[1200], dir[600];
        snprintf(dir, sizeof dir, "%s/%s/step-00000002", g_dir, runs[r]);
        snprintf(cmd, sizeof cmd, "rm -rf %s/%s && mkdir -p %s/%s && cp -r %s/muon_resumed/step-00000002 %s/%s/", g_dir, runs[r],
                 g_dir, runs[r], g_dir, g_dir, runs[r]);
        CHECK(system(cmd) == 0, "%s", cmd);
        write_old_muon_layout(dir);
        ds4_train_cfg c;
        CHECK(cfg_for(&c, runs[r], "optimizer.name", "Muon") == DS4_OK, "%s", ds4_errmsg());
        c.swap_optimizer = r == 1;
        CHECK(ds4_train_run(&c) == DS4_OK, "%s: %s", runs[r], ds4_errmsg());
        same_run_from("muon", runs[r], 3, 4);
    }
}

/* `ds4 train` of run `run` with extra flags, its stdout into out [n]; returns the exit status. */
static int ds4_train_output(const char *run, const char *flags, char *out, size_t n) {
    char cfgp[512], text[4096], cmd[2048];
    snprintf(cfgp, sizeof cfgp, "%s/%s.toml", g_dir, run);
    snprintf(text, sizeof text, k_base_toml, g_dir, g_dir, run, g_dir, run);
    FILE *f = fopen(cfgp, "w");
    if (!f) return -1;
    fputs(text, f);
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s train --config %s --training.threads 2 %s 2>&1", g_ds4, cfgp, flags);
    FILE *p = popen(cmd, "r");
    if (!p) return -1;
    size_t got = fread(out, 1, n - 1, p);
    out[got] = 0;
    return pclose(p);
}

/* The "mfu" of every step of a JSONL file, in order; returns how many (at most n). */
static int jsonl_mfus(const char *path, double *mfu, int n) {
    FILE *f = fopen(path, "r");
    if (!f) return 0;
    char line[2048];
    int k = 0;
    while (k < n && fgets(line, sizeof line, f)) {
        const char *at = strstr(line, "\"mfu\": ");
        if (at && sscanf(at + 7, "%lf", &mfu[k]) == 1) k++;
    }
    fclose(f);
    return k;
}

/* MFU is never above 100%. With the probe's peak the header line says how the peak was measured and every
 * step's mfu is in (0, 100]; with a configured peak far below what the run does (1 MFLOP/s), the log says
 * once that the peak was too low, and no step's mfu exceeds 100 (the first one's is 100). */
static void test_mfu_is_honest(void) {
    static char out[1 << 16];
    const char *runs[] = {"mfu_probe", "mfu_low"}, *flags[] = {"--metrics.peak_tflops 0", "--metrics.peak_tflops 1e-6"};
    for (int r = 0; r < 2; r++) {
        CHECK(ds4_train_output(runs[r], flags[r], out, sizeof out) == 0, "%s: %s", runs[r], out);
        char path[512];
        snprintf(path, sizeof path, "%s/%s.jsonl", g_dir, runs[r]);
        double mfu[8];
        const int k = jsonl_mfus(path, mfu, 8);
        CHECK(k == 4, "%s: %d steps logged", runs[r], k);
        for (int i = 0; i < k; i++) CHECK(mfu[i] > 0 && mfu[i] <= 100, "%s: step %d: mfu %g", runs[r], i + 1, mfu[i]);
        const char *note = strstr(out, "note: step 1 ran at");
        if (r == 0) {
            CHECK(strstr(out, "(theoretical FMA rate: ") && strstr(out, "best of") && strstr(out, "CPU time") &&
                      strstr(out, "FLOP/cycle") && strstr(out, "x 2 threads)"),
                  "the header says how the peak was obtained: %s", out);
            CHECK(!note, "no step ran above the theoretical peak: %s", out);
        } else {
            CHECK(strstr(out, "(metrics.peak_tflops = 1e-06)"), "the header names the configured peak: %s", out);
            CHECK(note && strstr(note, "that peak was too low") && !strstr(note + 1, "note: step"),
                  "one note says the peak was too low: %s", out);
            CHECK(k > 0 && mfu[0] == 100, "the first step ran at the raised peak: %g", k ? mfu[0] : -1);
        }
    }
}

/* A run can change optimizer at a resume: the other optimizer's state of the Muon group starts at zero
 * and the message says which state is new and which is kept; the next checkpoint is the new optimizer's. */
static void test_switch_optimizer_at_resume(void) {
    char out[16384], p[512];
    CHECK(ds4_train_output("switch", "--training.steps 2", out, sizeof out) == 0, "%s", out);
    CHECK(ds4_train_output("switch", "--optimizer.name Muon --training.steps 3", out, sizeof out) == 0, "%s", out);
    CHECK(strstr(out, "AdamW -> Muon") && strstr(out, "Muon momentum of 181 matrices") &&
              strstr(out, "starts at zero (new)") && strstr(out, "AdamW moments of the AdamW group and the step count are kept"),
          "no switch message:\n%s", out);
    snprintf(p, sizeof p, "%s/switch/step-00000003/optim.state", g_dir);
    ds4_st_file *f = NULL;
    CHECK(ds4_st_open(p, &f) == DS4_OK, "%s", ds4_errmsg());
    CHECK(f && ds4_st_find(f, ds4_optimizer_muon.mark) && ds4_st_find(f, "muon.momentum"),
          "the Muon run's checkpoint lacks %s or muon.momentum", ds4_optimizer_muon.mark);
    if (f) ds4_st_close(f);
    CHECK(ds4_train_output("switch", "", out, sizeof out) == 0, "%s", out);
    CHECK(strstr(out, "Muon -> AdamW") && strstr(out, "former Muon matrices"), "no switch message:\n%s", out);
    CHECK(ds4_train_output("switch", "--optimizer.name Muon --training.steps 5", out, sizeof out) == 0, "%s", out);
    CHECK(strstr(out, "AdamW -> Muon"), "no second switch message:\n%s", out);
    CHECK(ds4_train_output("switch", "--optimizer.name Muon --training.steps 6", out, sizeof out) == 0, "%s", out);
    CHECK(strstr(out, "resumed from") && !strstr(out, "switched"), "Muon -> Muon is no switch:\n%s", out);
    snprintf(p, sizeof p, "%s/switch.jsonl", g_dir);
    CHECK(isfinite(jsonl_loss(p, 6)), "no loss for step 6 after the switches");
}

static void expect_error(const char *key, const char *val, const char *needle) {
    ds4_train_cfg c;
    ds4_status st = cfg_for(&c, "bad", key, val);
    if (st == DS4_OK) st = ds4_train_run(&c);
    CHECK(st != DS4_OK, "%s = %s accepted", key, val);
    CHECK(strstr(ds4_errmsg(), needle) != NULL, "%s = %s: message '%s' lacks '%s'", key, val, ds4_errmsg(), needle);
}

static void expect_error(const char *key, const char *val, const char *needle);

/* training.matmul_precision = "bf16" (on whatever bf16 engine this CPU has): a different computation (not
 * the fp32 bits) that stays close to fp32 and is itself deterministic; a bad value is a config error
 * naming the key. */
static void test_bf16_matmul(void) {
    ds4_train_cfg c;
    const char *runs[] = {"bf16", "bf16_again"};
    for (int r = 0; r < 2; r++) {
        CHECK(cfg_for(&c, runs[r], "training.matmul_precision", "bf16") == DS4_OK, "%s", ds4_errmsg());
        ds4_status st = ds4_train_run(&c);
        CHECK(st == DS4_OK, "%s", ds4_errmsg());
        if (st != DS4_OK) return; /* no losses to compare */
    }
    char ps[512], pb[512], pa[512];
    snprintf(ps, sizeof ps, "%s/straight.jsonl", g_dir);
    snprintf(pb, sizeof pb, "%s/bf16.jsonl", g_dir);
    snprintf(pa, sizeof pa, "%s/bf16_again.jsonl", g_dir);
    int same_as_fp32 = 0;
    for (int s = 1; s <= 4; s++) {
        double f = jsonl_loss(ps, s), b = jsonl_loss(pb, s), b2 = jsonl_loss(pa, s);
        CHECK(isfinite(b) && b == b2, "step %d: bf16 loss %.9g, again %.9g", s, b, b2);
        CHECK_CLOSE(b, f, 2e-2, 1.0);
        same_as_fp32 += b == f;
    }
    CHECK(same_as_fp32 < 4, "bf16 losses equal the fp32 ones at every step: the switch did nothing");
    expect_error("training.matmul_precision", "fp8", "training.matmul_precision");
}

static void test_bad_config_and_data(void) {
    expect_error("training.seqlen", "64", "training.seq_len");                /* unknown key: closest named */
    expect_error("training.seq_len", "8", "window");                          /* shorter than the window */
    expect_error("training.global_batch_size", "3", "micro_batch_size");      /* contradictory batches */
    expect_error("data.train", "/nonexistent/x.bin", "/nonexistent/x.bin");   /* missing data */
    char p[512];
    snprintf(p, sizeof p, "%s/big_vocab.bin", g_dir);
    write_shard(p, 1000, 2, 300);
    expect_error("data.train", p, "big_vocab.bin");                           /* shard from another vocab */
    expect_error("optimizer.name", "SGD", "AdamW");
    expect_error("optimizer.momentum", "1.5", "optimizer.momentum");          /* the Muon knobs, by name */
    expect_error("optimizer.ns_steps", "0", "optimizer.ns_steps");
    expect_error("optimizer.ns_final_steps", "11", "optimizer.ns_final_steps");
    expect_error("optimizer.adjust_lr", "\"max\"", "optimizer.adjust_lr");
    expect_error("optimizer.update_rms", "-1", "optimizer.update_rms");
    expect_error("optimizer.nesterov", "3", "optimizer.nesterov");
    expect_error("lr_scheduler.decay_type", "step", "cosine");
    /* a corrupt checkpoint is refused on resume, naming the file */
    ds4_train_cfg c;
    CHECK(cfg_for(&c, "corrupt", "training.steps", "1") == DS4_OK);
    CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
    snprintf(p, sizeof p, "%s/corrupt/step-00000001/model.safetensors", g_dir);
    CHECK(truncate(p, 100) == 0);
    CHECK(cfg_for(&c, "corrupt", "training.steps", "2") == DS4_OK);
    CHECK(ds4_train_run(&c) != DS4_OK, "a truncated checkpoint was loaded");
    CHECK(strstr(ds4_errmsg(), "model.safetensors") != NULL, "%s", ds4_errmsg());
}

/* Runs `ds4 train` on the same config as a child process; returns its pid. */
static pid_t spawn_train(const char *run, const char *steps, const char *interval) {
    char cfgp[512], text[4096];
    snprintf(cfgp, sizeof cfgp, "%s/%s.toml", g_dir, run);
    snprintf(text, sizeof text, k_base_toml, g_dir, g_dir, run, g_dir, run);
    FILE *f = fopen(cfgp, "w");
    fputs(text, f);
    fclose(f);
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", 1);
        dup2(null, 1);
        execl(g_ds4, g_ds4, "train", "--config", cfgp, "--training.steps", steps, "--lr_scheduler.decay_steps", steps,
              "--checkpoint.interval", interval, "--training.threads", "1", (char *)NULL);
        _exit(127);
    }
    return pid;
}

/* Ctrl-C and a scheduler's SIGTERM: the step finishes, a checkpoint is saved, the exit status is 0. */
static void test_sigint_saves_and_exits_zero(void) {
    const struct {
        const char *run;
        int sig;
    } cases[] = {{"sigint", SIGINT}, {"sigterm", SIGTERM}};
    for (int k = 0; k < 2; k++) {
        pid_t pid = spawn_train(cases[k].run, "100000", "0");
        char jl[512], root[512], path[600];
        snprintf(jl, sizeof jl, "%s/%s.jsonl", g_dir, cases[k].run);
        int status = t_signal_after_file(pid, jl, 300, cases[k].sig);
        CHECK(status >= 0, "%s: training never logged a step", cases[k].run);
        CHECK(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "%s: exit status %d", cases[k].run, status);
        snprintf(root, sizeof root, "%s/%s", g_dir, cases[k].run);
        CHECK(ds4_checkpoint_find(root, -1, path, sizeof path) == DS4_OK, "%s: no checkpoint: %s", cases[k].run,
              ds4_errmsg());
    }
}

static void test_kill9_during_saves_keeps_a_loadable_checkpoint(void) {
    ds4_config mc;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &mc) == DS4_OK);
    char root[512], path[600];
    snprintf(root, sizeof root, "%s/kill9", g_dir);
    char first[600];
    snprintf(first, sizeof first, "%s/step-00000001/state.json", root);
    for (int trial = 0; trial < 4; trial++) {
        pid_t pid = spawn_train("kill9", "100000", "1"); /* saves every step */
        if (trial == 0) CHECK(t_wait_for_file(first, 120), "no checkpoint was written"); /* later trials resume and save at once */
        usleep((useconds_t)(37 + 61 * trial) * 1000); /* land at different moments of a save */
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        if (ds4_checkpoint_find(root, -1, path, sizeof path) != DS4_OK) continue; /* killed before the first save */
        ds4_model *m;
        CHECK(ds4_model_create(NULL, &mc, false, &m) == DS4_OK);
        ds4_ckpt_meta meta;
        CHECK(ds4_checkpoint_load(path, m, NULL, &meta) == DS4_OK, "trial %d: %s", trial, ds4_errmsg());
        ds4_model_free(m);
    }
    CHECK(ds4_checkpoint_find(root, -1, path, sizeof path) == DS4_OK, "no checkpoint was ever written");
}

static void test_loss_falls(void) {
    ds4_train_cfg c;
    CHECK(cfg_for(&c, "learn", "training.steps", "30") == DS4_OK);
    c.sched.total_steps = 30;
    c.ckpt_folder[0] = 0;
    CHECK(ds4_train_run(&c) == DS4_OK, "%s", ds4_errmsg());
    char p[512];
    snprintf(p, sizeof p, "%s/learn.jsonl", g_dir);
    double first = jsonl_loss(p, 1), last = jsonl_loss(p, 30);
    CHECK(last < first - 1.0, "loss %g -> %g did not fall", first, last);
}

/* ---------------------------------------------------------------- a DeepSeek-V4-Flash-0731-shaped model */

/* A model directory of `cfg` initialised from seed 3 (the main tensors' values depend on the seed and
 * their names only, so a config with and one without DSpark get the same main model). */
static void write_base(const ds4_config *cfg, const char *name, char *dir, size_t n) {
    snprintf(dir, n, "%s/%s", g_dir, name);
    ds4_model *m;
    CHECK(ds4_model_create(NULL, cfg, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    ds4_model_init_random(m, 3);
    CHECK(ds4_model_save(m, dir, DS4_F32) == DS4_OK, "%s", ds4_errmsg());
    ds4_model_free(m);
}

/* Fine-tunes the model in `dir` for `steps` steps as run `run`. */
static void finetune(const char *run, const char *dir, int steps) {
    ds4_train_cfg c;
    CHECK(cfg_for(&c, run, NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    c.model_config[0] = 0;
    snprintf(c.model_dir, sizeof c.model_dir, "%s", dir);
    c.steps = steps;
    CHECK(ds4_train_run(&c) == DS4_OK, "%s: %s", run, ds4_errmsg());
}

/* Tensors of file a named like those of file b (all of b's when `only_a` is false, else the ones b lacks)
 * hold the same bytes; returns how many were compared. */
static int64_t same_tensors(const char *a, const char *b, bool only_a) {
    ds4_st_file *fa = NULL, *fb = NULL;
    CHECK(ds4_st_open(a, &fa) == DS4_OK && ds4_st_open(b, &fb) == DS4_OK, "%s", ds4_errmsg());
    int64_t n = 0;
    for (int64_t i = 0; fa && fb && i < ds4_st_count(fa); i++) {
        const ds4_st_entry *ea = ds4_st_entry_at(fa, i), *eb = ds4_st_find(fb, ea->name);
        bool drafter = !strncmp(ea->name, "mtp.", 4);
        if (drafter != only_a) continue;
        CHECK(eb && eb->dtype == ea->dtype && eb->end - eb->begin == ea->end - ea->begin &&
                  !memcmp(ds4_st_bytes(fa, ea), ds4_st_bytes(fb, eb), ea->end - ea->begin),
              "%s: %s differs from %s", ea->name, a, b);
        n++;
    }
    ds4_st_close(fa);
    ds4_st_close(fb);
    return n;
}

/* tiny-dspark: tiny-a's four layers plus three DSpark stages (mtp.0..2, 46 compress_ratios entries in
 * the real 0731, 7 here), no NextN block. Fine-tuning it trains the main model exactly as the same
 * model without the drafter (same losses, same weights, same AdamW state), carries the drafter
 * unchanged through checkpoints and a bitwise resume, and exports it byte for byte. */
static void test_dspark_carried(void) {
    ds4_config dc, pc;
    CHECK(ds4_config_load("tests/configs/tiny-dspark.json", &dc) == DS4_OK, "%s", ds4_errmsg());
    pc = dc; /* the same model without the drafter */
    pc.dspark_n_stages = pc.dspark_block_size = pc.dspark_noise_token_id = pc.dspark_markov_rank = 0;
    pc.dspark_nextn_declared = 0;
    memset(pc.dspark_target_layer_ids, 0, sizeof pc.dspark_target_layer_ids);
    char base_d[512], base_p[512], a[600], b[600];
    write_base(&dc, "base_dspark", base_d, sizeof base_d);
    write_base(&pc, "base_plain", base_p, sizeof base_p);
    finetune("dsp", base_d, 4);
    finetune("dsp_resumed", base_d, 2);
    finetune("dsp_resumed", base_d, 4);
    finetune("plain", base_p, 4);
    for (int s = 1; s <= 4; s++) {
        snprintf(a, sizeof a, "%s/dsp.jsonl", g_dir);
        snprintf(b, sizeof b, "%s/plain.jsonl", g_dir);
        double ld = jsonl_loss(a, s), lp = jsonl_loss(b, s);
        snprintf(b, sizeof b, "%s/dsp_resumed.jsonl", g_dir);
        double lr = jsonl_loss(b, s);
        CHECK(isfinite(ld) && ld == lp && ld == lr, "step %d: loss %.9g with the drafter, %.9g without, %.9g resumed", s, ld, lp, lr);
    }
    const char *files[] = {"model.safetensors", "optim.state"};
    for (int i = 0; i < 2; i++) {
        snprintf(a, sizeof a, "%s/dsp/step-00000004/%s", g_dir, files[i]);
        snprintf(b, sizeof b, "%s/dsp_resumed/step-00000004/%s", g_dir, files[i]);
        CHECK(t_files_equal(a, b), "%s differs between the straight and the resumed run", files[i]);
    }
    /* the drafter has no AdamW state: the moments are those of the model without it */
    snprintf(a, sizeof a, "%s/dsp/step-00000004/optim.state", g_dir);
    snprintf(b, sizeof b, "%s/plain/step-00000004/optim.state", g_dir);
    CHECK(t_files_equal(a, b), "the drafter changed the optimizer state");
    /* main tensors as trained without the drafter; the drafter's as the base had them */
    char ck[600], bf[600];
    snprintf(ck, sizeof ck, "%s/dsp/step-00000004/model.safetensors", g_dir);
    snprintf(b, sizeof b, "%s/plain/step-00000004/model.safetensors", g_dir);
    CHECK(same_tensors(b, ck, false) == 210, "every tensor of the model without the drafter (210) is compared");
    snprintf(bf, sizeof bf, "%s/model.safetensors", base_d);
    CHECK(same_tensors(bf, ck, true) == 144, "the drafter's 144 tensors are carried unchanged");
    CHECK(!t_files_equal(bf, ck), "training changed nothing");
    /* export (bf16, official names): the drafter's bytes are those of the base's export */
    char ex_ck[400], ex_base[400];
    snprintf(ex_ck, sizeof ex_ck, "%s/dsp_export", g_dir);
    snprintf(ex_base, sizeof ex_base, "%s/base_export", g_dir);
    snprintf(a, sizeof a, "%s/dsp/step-00000004", g_dir);
    ds4_convert_opts o = {.in_dir = a, .out_dir = ex_ck, .dtype = DS4_BF16, .model_shards_only = true};
    ds4_convert_report r;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    o.in_dir = base_d;
    o.out_dir = ex_base;
    CHECK(ds4_convert(&o, &r) == DS4_OK, "%s", ds4_errmsg());
    snprintf(a, sizeof a, "%s/model.safetensors", ex_ck);
    snprintf(b, sizeof b, "%s/model.safetensors", ex_base);
    CHECK(same_tensors(b, a, true) == 144);
    /* the export is a complete 0731-shaped model directory (ds4 inspect --check) */
    ds4_model_dir *d;
    int64_t problems = -1;
    CHECK(ds4_model_dir_open(ex_ck, &d) == DS4_OK, "%s", ds4_errmsg());
    if (d) CHECK(ds4_model_dir_check(d, NULL, NULL, &problems) == DS4_OK && problems == 0, "%lld problems", (long long)problems);
    if (d) CHECK(ds4_model_dir_config(d)->dspark_n_stages == 3);
    ds4_model_dir_close(d);
}

int main(int argc, char **argv) {
    (void)argc;
    snprintf(g_ds4, sizeof g_ds4, "%s", argv[0]);
    char *slash = strstr(g_ds4, "/tests/");
    if (slash) strcpy(slash, "/ds4");
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-train-%d", (int)getpid());
    mkdir(g_dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/train.bin", g_dir);
    write_shard(p, 256, 8, 1500);
    ds4_set_threads(2);
    RUN(test_resume_is_bitwise);
    RUN(test_swap_is_bitwise);
    RUN(test_muon_resume_is_bitwise);
    RUN(test_muon_old_layout_resumes_bitwise);
    RUN(test_switch_optimizer_at_resume);
    RUN(test_bf16_matmul);
    RUN(test_bad_config_and_data);
    RUN(test_sigint_saves_and_exits_zero);
    RUN(test_kill9_during_saves_keeps_a_loadable_checkpoint);
    RUN(test_loss_falls);
    RUN(test_dspark_carried);
    RUN(test_mfu_is_honest);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir);
    if (!t_failed && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_MAIN_END("test_train");
}
