/* `mpirun -np 2 ds4 train` end to end on tiny-a (FSDP, and FSDP + EP over both ranks):
 *  (a) two identical 2-rank runs log the same losses and write the same checkpoint bytes;
 *  (b) ep 1 and ep 2 log the same losses and write the same checkpoint bytes (EP changes no math);
 *  (c) 4 steps straight == 2 steps + resume + 2 steps under 2 ranks (losses, model and optimizer bytes);
 *  (d) a checkpoint written by 2 ranks resumes in one process; its next loss is close to the 2-rank one;
 *  (e) the first loss of 2 ranks is close to one process's with the same global batch;
 *  (g) --swap-optimizer --swap-layer-input, resumed half way: the same losses and checkpoint bytes;
 *  (j) overlap (the default prefetch depth 1) vs blocking collectives (--prefetch-depth 0) vs depth 2 with
 *      EP 2 under a simulated link with a trace: the same losses and checkpoint bytes; the log line and the
 *      JSONL carry the compute / exposed FSDP / exposed EP breakdown, the trace file is written;
 *  (k) --moe-fb-overlap (forward(i) beside backward(i - 1)) with EP 2, with csa + mhc recompute and
 *      --swap-layer-input, with full recompute, with 3 micro-batches per rank, and in one process: the
 *      losses and checkpoint bytes of the sequential schedule; with one micro-batch per rank one `error:`
 *      line naming parallel.moe_fb_overlap and the micro-batches;
 *  (h) kill -USR1 <mpirun>: every rank finishes the step, a checkpoint is saved, exit 0;
 *  (f) --parallel.ep 3 on 2 ranks: one `error:` line naming parallel.ep, a non-zero exit, no hang;
 *  (i) a checkpoint folder rank 0 cannot use: one `error:` line naming it before any step, no hang;
 *  (j) checkpoint.per_rank: resumed with EP 2 from the ranks' shard files, the one-writer run's losses and
 *      final state; eval, generate and export print and write the same from either format.
 * Runs build/ds4 (next to the tests folder) under mpirun; the one-process runs happen in this process. */
#include "ds4/shard.h"
#include "ds4/io.h"
#include "ds4/offload.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_files.h"

#include <sys/stat.h>
#include <unistd.h>

#define MAX_STEPS 8
static char g_dir[256], g_ds4[1024], g_toml[512];

/* Global batch 4 as micro-batches of 1: two per rank on 2 ranks, four in one process. */
static const char *k_toml =
    "[model]\nconfig = \"tests/configs/tiny-a.json\"\nseed = 11\n"
    "[training]\nsteps = 4\nseq_len = 64\nglobal_batch_size = 4\nmicro_batch_size = 1\nseed = 2\nthreads = 1\n"
    "[optimizer]\nlr = 3e-3\n"
    "[lr_scheduler]\nwarmup_steps = 1\ndecay_steps = 4\n"
    "[data]\ntrain = \"%s/train.bin\"\n"
    "[checkpoint]\ninterval = 2\nkeep_latest_k = 3\n"
    "[metrics]\npeak_tflops = 1.0\n";

/* build/ds4 (next to build/tests/), a fresh folder, a shard of random documents over the vocabulary of
 * tiny-a and base.toml. */
static void setup(const char *argv0) {
    const char *tests = strstr(argv0, "/tests/");
    snprintf(g_ds4, sizeof g_ds4, "%.*s/ds4", tests ? (int)(tests - argv0) : 5, tests ? argv0 : "build");
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-test-train-dist-%d", (int)getpid());
    mkdir(g_dir, 0755);
    char p[512];
    snprintf(p, sizeof p, "%s/train.bin", g_dir);
    ds4_shard_writer *w;
    CHECK(ds4_shard_writer_open(p, 256, -1, 1, &w) == DS4_OK, "%s", ds4_errmsg());
    int32_t doc[700];
    for (uint64_t d = 0; d < 6; d++) {
        for (uint64_t i = 0; i < 700; i++) doc[i] = (int32_t)(2 + ds4_rng_u64(31, d, i) % 254);
        CHECK(ds4_shard_writer_add(w, doc, 700) == DS4_OK);
    }
    CHECK(ds4_shard_writer_close(w) == DS4_OK, "%s", ds4_errmsg());
    char text[2048];
    snprintf(text, sizeof text, k_toml, g_dir);
    snprintf(g_toml, sizeof g_toml, "%s/base.toml", g_dir);
    CHECK(ds4_write_file_atomic(g_toml, text, strlen(text)) == DS4_OK, "%s", ds4_errmsg());
}

/* Runs `mpirun -np 2 ds4 train --config base.toml` for run `name` (its own checkpoint folder and JSONL)
 * with extra flags; returns the exit status, the output in out (may be NULL). */
static int mpi_train(const char *name, const char *extra, char *out, size_t n) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd,
             "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
             "OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 timeout 120 mpirun -np 2 --bind-to none '%s' train "
             "--config '%s' --checkpoint.folder '%s/%s' --metrics.jsonl '%s/%s.jsonl' %s 2>&1",
             g_ds4, g_toml, g_dir, name, g_dir, name, extra);
    FILE *pf = popen(cmd, "r");
    CHECK(pf != NULL, "cannot run mpirun");
    if (!pf) return -1;
    size_t len = 0;
    char line[4096];
    while (fgets(line, sizeof line, pf)) {
        if (out && len + strlen(line) < n) {
            memcpy(out + len, line, strlen(line) + 1);
            len += strlen(line);
        }
        if (getenv("DS4_TEST_VERBOSE")) fputs(line, stderr);
    }
    int rc = pclose(pf);
    if (rc != 0 && out) fprintf(stderr, "%s", out);
    return rc;
}

/* The JSONL of a run: per step, the logged text of "loss" and the value (steps without a record: NAN). */
typedef struct {
    char text[MAX_STEPS + 1][32];
    double loss[MAX_STEPS + 1];
} run_log;

static void read_log(const char *name, run_log *l) {
    for (int s = 0; s <= MAX_STEPS; s++) {
        l->text[s][0] = 0;
        l->loss[s] = NAN;
    }
    char p[512], line[2048];
    snprintf(p, sizeof p, "%s/%s.jsonl", g_dir, name);
    FILE *f = fopen(p, "r");
    CHECK(f != NULL, "%s: no metrics", p);
    while (f && fgets(line, sizeof line, f)) {
        const char *ls = strstr(line, "\"loss\": ");
        int step = atoi(line + strlen("{\"step\": "));
        if (!ls || step < 1 || step > MAX_STEPS) continue;
        ls += strlen("\"loss\": ");
        snprintf(l->text[step], sizeof l->text[step], "%.*s", (int)strcspn(ls, ","), ls);
        l->loss[step] = strtod(ls, NULL);
    }
    if (f) fclose(f);
}

/* Losses of steps [from, to] logged with the same text (and finite). */
static void same_losses(const char *a, const char *b, int from, int to) {
    run_log x, y;
    read_log(a, &x);
    read_log(b, &y);
    for (int s = from; s <= to; s++)
        CHECK(isfinite(x.loss[s]) && !strcmp(x.text[s], y.text[s]), "step %d: loss %s (%s) vs %s (%s)", s, x.text[s], a,
              y.text[s], b);
}

static bool same_file(const char *run_a, const char *run_b, int step, const char *file) {
    char pa[600], pb[600];
    snprintf(pa, sizeof pa, "%s/%s/step-%08d/%s", g_dir, run_a, step, file);
    snprintf(pb, sizeof pb, "%s/%s/step-%08d/%s", g_dir, run_b, step, file);
    return t_files_equal(pa, pb);
}

static void same_checkpoint(const char *a, const char *b, int step) {
    CHECK(same_file(a, b, step, "model.safetensors"), "step %d: model.safetensors of %s and %s differ", step, a, b);
    CHECK(same_file(a, b, step, "optim.state"), "step %d: optim.state of %s and %s differ", step, a, b);
}

/* A one-process run of base.toml in this process: run `name`, plus one override. */
static ds4_status local_train(const char *name, const char *key, const char *val) {
    char text[2048], v[600];
    snprintf(text, sizeof text, k_toml, g_dir);
    ds4_toml *t;
    DS4_TRY(ds4_toml_parse(text, strlen(text), "base.toml", &t));
    snprintf(v, sizeof v, "%s/%s", g_dir, name);
    ds4_status st = ds4_toml_set(t, "checkpoint.folder", v);
    snprintf(v, sizeof v, "%s/%s.jsonl", g_dir, name);
    if (st == DS4_OK) st = ds4_toml_set(t, "metrics.jsonl", v);
    if (st == DS4_OK && key) st = ds4_toml_set(t, key, val);
    ds4_train_cfg c;
    if (st == DS4_OK) st = ds4_train_cfg_from_toml(t, &c);
    ds4_toml_free(t);
    return st == DS4_OK ? ds4_train_run(&c) : st;
}

/* The runs the checks share: "fsdp" (ep 1, 4 steps, checkpoints at 2 and 4). */
static bool g_have_fsdp;

static void test_two_runs_are_bitwise_equal(void) {
    g_have_fsdp = mpi_train("fsdp", "", NULL, 0) == 0;
    CHECK(g_have_fsdp, "mpirun -np 2 ds4 train failed");
    CHECK(mpi_train("fsdp_again", "", NULL, 0) == 0);
    same_losses("fsdp", "fsdp_again", 1, 4);
    same_checkpoint("fsdp", "fsdp_again", 4);
}

static void test_ep_changes_no_math(void) {
    char out[16384];
    CHECK(mpi_train("ep2", "--parallel.ep 2", out, sizeof out) == 0);
    CHECK(strstr(out, "expert parallel 2") != NULL, "the run does not report EP 2");
    same_losses("fsdp", "ep2", 1, 4);
    same_checkpoint("fsdp", "ep2", 2);
    same_checkpoint("fsdp", "ep2", 4);
}

/* Offload changes no bit: both swaps, resumed half way (the swapped moments load from the checkpoint). */
static void test_swap_changes_no_math(void) {
    char out[16384];
    CHECK(mpi_train("swap", "--swap-optimizer --swap-layer-input --training.steps 2", out, sizeof out) == 0);
    CHECK(strstr(out, "offload: optimizer state, layer inputs") != NULL, "the run does not report its offload");
    CHECK(mpi_train("swap", "--swap-optimizer --swap-layer-input", NULL, 0) == 0);
    same_losses("fsdp", "swap", 1, 4);
    same_checkpoint("fsdp", "swap", 2);
    same_checkpoint("fsdp", "swap", 4);
}

static void test_resume_is_bitwise_under_two_ranks(void) {
    CHECK(mpi_train("resumed", "--training.steps 2", NULL, 0) == 0);
    char out[16384];
    CHECK(mpi_train("resumed", "", out, sizeof out) == 0);
    CHECK(strstr(out, "resumed from") != NULL, "the second leg did not resume");
    same_losses("fsdp", "resumed", 1, 4);
    same_checkpoint("fsdp", "resumed", 4);
}

static void test_overlap_changes_no_math(void) {
    char out[16384], trace[600], p[600];
    CHECK(mpi_train("blocking", "--prefetch-depth 0", NULL, 0) == 0);
    same_losses("fsdp", "blocking", 1, 4);
    same_checkpoint("fsdp", "blocking", 2);
    same_checkpoint("fsdp", "blocking", 4);
    snprintf(trace, sizeof trace, "--prefetch-depth 2 --parallel.ep 2 --sim-link-gbps 100 --sim-link-latency-us 10 "
                                  "--trace %s/deep.trace.json",
             g_dir);
    CHECK(mpi_train("deep", trace, out, sizeof out) == 0);
    same_losses("fsdp", "deep", 1, 4);
    same_checkpoint("fsdp", "deep", 4);
    CHECK(strstr(out, "  compute ") && strstr(out, "  exposed_fsdp ") && strstr(out, "  exposed_ep "),
          "the log line has no breakdown:\n%s", out);
    snprintf(p, sizeof p, "%s/deep.jsonl", g_dir);
    char *jsonl = NULL;
    size_t n = 0;
    CHECK(ds4_read_file(p, &jsonl, &n) == DS4_OK, "%s", ds4_errmsg());
    CHECK(jsonl && strstr(jsonl, "\"exposed_fsdp_time\": ") && strstr(jsonl, "\"exposed_ep_time\": ") &&
              strstr(jsonl, "\"compute_time\": "),
          "the JSONL has no breakdown");
    ds4_free(jsonl);
    snprintf(p, sizeof p, "%s/deep.trace.json", g_dir);
    struct stat sb;
    CHECK(stat(p, &sb) == 0 && sb.st_size > 100, "%s: no trace", p);
}

/* The 2-rank checkpoint of step 2, copied, continues in one process for a step. */
static void test_two_rank_checkpoint_loads_in_one_process(void) {
    if (!g_have_fsdp) return;
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "mkdir -p %s/single && cp -r %s/fsdp/step-00000002 %s/single/", g_dir, g_dir, g_dir);
    CHECK(system(cmd) == 0);
    CHECK(local_train("single", "training.steps", "3") == DS4_OK, "%s", ds4_errmsg());
    run_log two, one;
    read_log("fsdp", &two);
    read_log("single", &one);
    CHECK(isnan(one.loss[2]), "the one-process run did not resume after step 2");
    CHECK(isfinite(one.loss[3]), "no loss for step 3");
    CHECK_CLOSE(one.loss[3], two.loss[3], 1e-5, 1e-3);
}

/* The same safetensors layout (names, dtypes, shapes, offsets, in order) in two checkpoint files. */
static void same_layout(const char *a, const char *b) {
    ds4_st_file *x = NULL, *y = NULL;
    CHECK(ds4_st_open(a, &x) == DS4_OK && ds4_st_open(b, &y) == DS4_OK, "%s", ds4_errmsg());
    CHECK(x && y && ds4_st_count(x) == ds4_st_count(y), "%s and %s hold different tensors", a, b);
    for (int64_t i = 0; x && y && i < ds4_st_count(x) && i < ds4_st_count(y); i++) {
        const ds4_st_entry *p = ds4_st_entry_at(x, i), *q = ds4_st_entry_at(y, i);
        bool same = !strcmp(p->name, q->name) && p->dtype == q->dtype && p->ndim == q->ndim &&
                    !memcmp(p->shape, q->shape, sizeof p->shape) && p->begin == q->begin && p->end == q->end;
        CHECK(same, "entry %lld: %s vs %s", (long long)i, p->name, q->name);
        if (!same) break;
    }
    ds4_st_close(x);
    ds4_st_close(y);
}

static void test_first_loss_matches_one_process(void) {
    CHECK(local_train("one", "training.steps", "1") == DS4_OK, "%s", ds4_errmsg());
    /* the checkpoint streamed by 2 ranks is laid out as one process writes it */
    const char *files[] = {"model.safetensors", "optim.state"};
    for (int i = 0; i < 2; i++) {
        char a[600], b[600];
        snprintf(a, sizeof a, "%s/fsdp/step-00000002/%s", g_dir, files[i]);
        snprintf(b, sizeof b, "%s/one/step-00000001/%s", g_dir, files[i]);
        same_layout(a, b);
    }
    run_log two, one;
    read_log("fsdp", &two);
    read_log("one", &one);
    CHECK(isfinite(one.loss[1]) && isfinite(two.loss[1]));
    CHECK_CLOSE(one.loss[1], two.loss[1], 1e-5, 1e-3);
}

/* The tensors of file a whose names start (drafter) or do not start with "mtp." have the same bytes in
 * file b; returns how many were compared. */
static int64_t same_tensors(const char *a, const char *b, bool drafter) {
    ds4_st_file *x = NULL, *y = NULL;
    CHECK(ds4_st_open(a, &x) == DS4_OK && ds4_st_open(b, &y) == DS4_OK, "%s", ds4_errmsg());
    int64_t n = 0;
    for (int64_t i = 0; x && y && i < ds4_st_count(x); i++) {
        const ds4_st_entry *p = ds4_st_entry_at(x, i), *q = ds4_st_find(y, p->name);
        if ((strncmp(p->name, "mtp.", 4) == 0) != drafter) continue;
        CHECK(q && q->end - q->begin == p->end - p->begin && !memcmp(ds4_st_bytes(x, p), ds4_st_bytes(y, q), p->end - p->begin),
              "%s differs between %s and %s", p->name, a, b);
        n++;
    }
    ds4_st_close(x);
    ds4_st_close(y);
    return n;
}

/* A DeepSeek-V4-Flash-0731-shaped model (tests/configs/tiny-dspark.json) under FSDP: the drafter is
 * whole on every rank, not trained, checkpointed after the streamed shards in the one-process layout
 * and resumed bitwise; the main model trains as the same model without the drafter does. */
static void test_dspark_under_two_ranks(void) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-dspark.json", &c) == DS4_OK, "%s", ds4_errmsg());
    c.dspark_n_stages = c.dspark_block_size = c.dspark_noise_token_id = c.dspark_markov_rank = c.dspark_nextn_declared = 0;
    memset(c.dspark_target_layer_ids, 0, sizeof c.dspark_target_layer_ids);
    char plain[600], flags[700], a[600], b[600];
    snprintf(plain, sizeof plain, "%s/tiny-plain.json", g_dir);
    CHECK(ds4_config_save(&c, plain) == DS4_OK, "%s", ds4_errmsg());
    const char *dsp = "--model.config tests/configs/tiny-dspark.json";
    CHECK(mpi_train("dsp2", dsp, NULL, 0) == 0);
    snprintf(flags, sizeof flags, "%s --training.steps 2", dsp);
    CHECK(mpi_train("dsp2_resumed", flags, NULL, 0) == 0);
    CHECK(mpi_train("dsp2_resumed", dsp, NULL, 0) == 0);
    snprintf(flags, sizeof flags, "--model.config %s", plain);
    CHECK(mpi_train("plain2", flags, NULL, 0) == 0);
    same_losses("dsp2", "dsp2_resumed", 1, 4);
    same_checkpoint("dsp2", "dsp2_resumed", 4);
    same_losses("dsp2", "plain2", 1, 4);
    CHECK(same_file("dsp2", "plain2", 4, "optim.state"), "the drafter changed the optimizer state");
    snprintf(a, sizeof a, "%s/plain2/step-00000004/model.safetensors", g_dir);
    snprintf(b, sizeof b, "%s/dsp2/step-00000004/model.safetensors", g_dir);
    CHECK(same_tensors(a, b, false) == 210, "the main model's 210 tensors are those trained without the drafter");
    /* one process, one step: the same layout, and the drafter (same seed, never trained) the same bytes */
    CHECK(local_train("dsp1", "model.config", "tests/configs/tiny-dspark.json") == DS4_OK, "%s", ds4_errmsg());
    snprintf(a, sizeof a, "%s/dsp1/step-00000004/model.safetensors", g_dir);
    same_layout(a, b);
    CHECK(same_tensors(a, b, true) == 144, "the drafter's 144 tensors are carried unchanged");
}

/* kill -USR1 <mpirun>: mpirun forwards it to the ranks, which finish the step, save and exit 0. */
static void test_sigusr1_stops_every_rank_with_a_checkpoint(void) {
    char cmd[4096], jl[600];
    snprintf(jl, sizeof jl, "%s/usr1.jsonl", g_dir);
    snprintf(cmd, sizeof cmd,
             "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
             "OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 exec mpirun -np 2 --bind-to none '%s' train --config '%s' "
             "--checkpoint.folder '%s/usr1' --metrics.jsonl '%s' --training.steps 100000 "
             "--lr_scheduler.decay_steps 100000 --checkpoint.interval 0 > '%s/usr1.out' 2>&1",
             g_ds4, g_toml, g_dir, jl, g_dir);
    pid_t pid = fork();
    if (pid == 0) {
        execl("/bin/sh", "sh", "-c", cmd, (char *)NULL);
        _exit(127);
    }
    int status = t_signal_after_file(pid, jl, 0, SIGUSR1);
    CHECK(status >= 0, "training never logged a step");
    CHECK(status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == 0, "mpirun exit status %d", status);
    char root[600], path[700];
    snprintf(root, sizeof root, "%s/usr1", g_dir);
    CHECK(ds4_checkpoint_find(root, -1, path, sizeof path) == DS4_OK, "no checkpoint after SIGUSR1: %s", ds4_errmsg());
}

/* MoE forward-backward overlap changes no bit (base.toml: two micro-batches per rank, four in one process). */
static void test_moe_fb_overlap_changes_no_math(void) {
    CHECK(mpi_train("fbo", "--parallel.ep 2 --moe-fb-overlap", NULL, 0) == 0);
    same_losses("ep2", "fbo", 1, 4);
    same_checkpoint("ep2", "fbo", 2);
    same_checkpoint("ep2", "fbo", 4);
    CHECK(mpi_train("fbo_mem", "--parallel.ep 2 --moe-fb-overlap --recompute-csa-attention --mhc-recompute "
                               "--swap-layer-input", NULL, 0) == 0);
    same_losses("ep2", "fbo_mem", 1, 4);
    same_checkpoint("ep2", "fbo_mem", 4);
    CHECK(mpi_train("fbo_full", "--moe-fb-overlap --recompute-granularity full --recompute-method uniform "
                                "--recompute-num-layers 1 --swap-layer-input", NULL, 0) == 0);
    same_losses("fsdp", "fbo_full", 1, 4);
    same_checkpoint("fsdp", "fbo_full", 4);
    /* mixed precision: the bf16 compute copy gathered by FSDP, bf16 keys, recompute + swap, paired passes */
    CHECK(mpi_train("ep2_bf16", "--parallel.ep 2 --training.mixed_precision_param bfloat16", NULL, 0) == 0);
    CHECK(mpi_train("fbo_bf16", "--parallel.ep 2 --training.mixed_precision_param bfloat16 --moe-fb-overlap "
                                "--recompute-csa-attention --mhc-recompute --swap-layer-input", NULL, 0) == 0);
    same_losses("ep2_bf16", "fbo_bf16", 1, 4);
    same_checkpoint("ep2_bf16", "fbo_bf16", 4);
    run_log f32, b16;
    read_log("ep2", &f32);
    read_log("ep2_bf16", &b16);
    CHECK(strcmp(f32.text[4], b16.text[4]) != 0, "the bf16 run logs the fp32 run's step-4 loss %s", f32.text[4]);
    /* three micro-batches per rank: two pairs */
    CHECK(mpi_train("mb3", "--parallel.ep 2 --training.global_batch_size 6 --training.steps 2", NULL, 0) == 0);
    CHECK(mpi_train("mb3_fbo", "--parallel.ep 2 --training.global_batch_size 6 --training.steps 2 --moe-fb-overlap",
                    NULL, 0) == 0);
    same_losses("mb3", "mb3_fbo", 1, 2);
    same_checkpoint("mb3", "mb3_fbo", 2);
    /* one process (four micro-batches): the passes take turns at the gathers */
    CHECK(local_train("one4", NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    CHECK(local_train("one4_fbo", "parallel.moe_fb_overlap", "true") == DS4_OK, "%s", ds4_errmsg());
    same_losses("one4", "one4_fbo", 1, 4);
    same_checkpoint("one4", "one4_fbo", 4);
}

/* One micro-batch per rank has nothing to pair: one `error:` line naming the key and the micro-batches. */
static void test_moe_fb_overlap_needs_two_micro_batches(void) {
    char out[16384] = "";
    int rc = mpi_train("fbo1", "--moe-fb-overlap --training.global_batch_size 2", out, sizeof out);
    CHECK(rc != 0, "--moe-fb-overlap with one micro-batch per rank was accepted");
    int errors = 0;
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, "error:", 6)) {
            errors++;
            CHECK(strstr(l, "parallel.moe_fb_overlap") && strstr(l, "micro_batch_size") && strstr(l, "= 1"),
                  "message: %.300s", l);
        }
    CHECK(errors == 1, "%d error lines (one expected):\n%s", errors, out);
}

static void test_bad_ep_fails_on_every_rank(void) {
    char out[16384] = "";
    int rc = mpi_train("bad", "--parallel.ep 3", out, sizeof out);
    CHECK(rc != 0, "--parallel.ep 3 on 2 ranks was accepted");
    int errors = 0;
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, "error:", 6)) {
            errors++;
            CHECK(strstr(l, "parallel.ep") != NULL && strstr(l, "3") != NULL, "message: %.200s", l);
        }
    CHECK(errors == 1, "%d error lines (one expected):\n%s", errors, out);
}

/* An unusable checkpoint folder is found by rank 0 before any work and every rank stops: one `error:`
 * line naming the folder, a non-zero exit, no hang. */
static void test_unusable_checkpoint_folder_fails_on_every_rank(void) {
    char plain[600], extra[800], out[16384] = "";
    snprintf(plain, sizeof plain, "%s/plainfile", g_dir);
    CHECK(ds4_write_file_atomic(plain, "x", 1) == DS4_OK, "%s", ds4_errmsg());
    snprintf(extra, sizeof extra, "--checkpoint.folder '%s/ckpt'", plain);
    int rc = mpi_train("unusable", extra, out, sizeof out);
    CHECK(rc != 0, "a checkpoint folder inside a plain file was accepted");
    int errors = 0;
    for (const char *l = out; l && *l; l = strchr(l, '\n') ? strchr(l, '\n') + 1 : NULL)
        if (!strncmp(l, "error:", 6)) {
            errors++;
            CHECK(strstr(l, "plainfile/ckpt") != NULL, "message: %.200s", l);
        }
    CHECK(errors == 1, "%d error lines (one expected):\n%s", errors, out);
    CHECK(!strstr(out, "grad_norm"), "a step ran before the folder was checked:\n%s", out);
}

/* ------------------------------------------------------------------ Muon under FSDP + EP */
/* One gradient value per (parameter, element, step), whatever the layout holding it. */
static float muon_grad(const ds4_param *p, int64_t k, int step) {
    uint64_t h = 1469598103934665603u;
    for (const char *c = p->name; *c; c++) h = (h ^ (uint8_t)*c) * 1099511628211u;
    return (float)((int64_t)(ds4_rng_u64(h, (uint64_t)k, (uint64_t)step) % 2001) - 1000) * 5e-4f;
}

typedef struct {
    float *g;
    int step;
} grad_fill;
static void fill_piece(void *ctx, ds4_param *p, int64_t k0, int64_t k1, int64_t s0) {
    grad_fill *x = ctx;
    for (int64_t k = k0; k < k1; k++) x->g[s0 + k - k0] = muon_grad(p, k, x->step);
}

static const ds4_adamw_cfg k_adamw = {.lr = 3e-3, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

/* Rank side of test_muon_step_is_one_process_bitwise (this binary under mpirun, "--muon-rank EP SWAP"):
 * 3 AdamW + Muon steps of the FSDP + EP shard of tiny-a on the same gradients as one process; rank 0
 * compares the collected weights and momentum with the whole-model steps, bit for bit, and prints
 * "muon-rank: N weights, M moments differ". */
static int muon_rank(int ep, bool swap) {
    ds4_set_threads(1);
    if (ds4_dist_init() != DS4_OK) return 2;
    ds4_comm *world = ds4_comm_world();
    ds4_config c;
    ds4_model *mu = NULL, *whole = NULL;
    ds4_fsdp *f = NULL;
    ds4_offload *store = NULL;
    ds4_optim o = {0}, ow = {0};
    ds4_status st = ds4_config_load("tests/configs/tiny-a.json", &c);
    if (st == DS4_OK) st = ds4_model_create(NULL, &c, true, &mu);
    if (st == DS4_OK) st = ds4_fsdp_create(mu, world, ep, &f);
    if (st == DS4_OK) st = ds4_fsdp_init_random(f, 9);
    if (st == DS4_OK && swap) st = ds4_offload_open(NULL, NULL, &store);
    if (st == DS4_OK) st = ds4_optim_init_shard(&o, &ds4_optimizer_muon, f, swap ? store : NULL, 4096);
    const ds4_muon_cfg mc = ds4_muon_defaults();
    for (int s = 0; s < 3 && st == DS4_OK; s++) {
        grad_fill x = {ds4_fsdp_shard_grads(f), s};
        ds4_fsdp_for_each_piece(f, fill_piece, &x);
        st = ds4_adamw_step_flat(&o, ds4_fsdp_shard_params(f), ds4_fsdp_shard_grads(f), &k_adamw, k_adamw.lr);
        if (st == DS4_OK) st = ds4_fsdp_muon_step(f, &o, &mc, k_adamw.weight_decay, k_adamw.lr);
    }
    const bool root = ds4_comm_rank(world) == 0;
    const int64_t nu = ds4_model_numel(mu);
    /* the weights, then each state array (AdamW's m and v, Muon's momentum) laid out like the weights */
    float *w = root ? calloc((size_t)nu, sizeof(float)) : NULL, *m[3] = {NULL, NULL, NULL};
    float *tmp = malloc((size_t)(ds4_fsdp_shard_numel(f) + 1) * sizeof(float));
    if (st == DS4_OK) st = ds4_fsdp_collect(f, false, w, 0);
    for (int k = 0; k < 3 && st == DS4_OK; k++) {
        m[k] = root ? calloc((size_t)nu, sizeof(float)) : NULL;
        st = ds4_optim_expand(&o, k < 2 ? DS4_OPT_ADAMW : DS4_OPT_OWN, k % 2, tmp);
        if (st == DS4_OK) st = ds4_fsdp_collect_buf(f, tmp, m[k], 0);
    }
    free(tmp);
    int64_t bad_w = 0, bad_m = 0;
    if (st == DS4_OK && root) { /* the same 3 steps on the whole model */
        st = ds4_model_create(NULL, &c, false, &whole);
        if (st == DS4_OK) ds4_model_init_random(whole, 9);
        if (st == DS4_OK) st = ds4_optim_init(&ow, &ds4_optimizer_muon, whole, NULL, 0);
        for (int s = 0; s < 3 && st == DS4_OK; s++) {
            for (int64_t i = 0; i < ds4_model_nparams(whole); i++) {
                ds4_param *p = ds4_model_param(whole, i);
                for (int64_t k = 0; !p->is_int && k < p->numel; k++) p->grad[k] = muon_grad(p, k, s);
            }
            st = ds4_adamw_step(&ow, whole, &k_adamw, k_adamw.lr);
            if (st == DS4_OK) st = ds4_muon_step(&ow, whole, &mc, k_adamw.weight_decay, k_adamw.lr);
        }
        const float *fw = ds4_model_params_flat(whole), *fu = ds4_model_params_flat(mu);
        float *mw = malloc((size_t)ds4_model_numel(whole) * sizeof(float));
        for (int j = 0; j < 3 && st == DS4_OK; j++) {
            st = ds4_optim_expand(&ow, j < 2 ? DS4_OPT_ADAMW : DS4_OPT_OWN, j % 2, mw);
            for (int64_t i = 0; st == DS4_OK && i < ds4_model_nparams(whole); i++) {
                const ds4_param *p = ds4_model_param(whole, i), *q = ds4_model_param(mu, i);
                if (p->is_int) continue;
                const int64_t a = p->data - fw, b = q->data - fu;
                for (int64_t k = 0; k < p->numel; k++) {
                    bad_w += j == 0 && memcmp(&fw[a + k], &w[b + k], sizeof(float)) != 0;
                    bad_m += memcmp(&mw[a + k], &m[j][b + k], sizeof(float)) != 0;
                }
            }
        }
        free(mw);
        ds4_optim_free(&ow);
        printf("muon-rank: %lld weights, %lld moments differ%s%s\n", (long long)bad_w, (long long)bad_m,
               st == DS4_OK ? "" : ": ", st == DS4_OK ? "" : ds4_errmsg());
    }
    if (st != DS4_OK) fprintf(stderr, "rank %d: %s\n", ds4_comm_rank(world), ds4_errmsg());
    ds4_optim_free(&o);
    ds4_offload_close(store);
    free(w);
    for (int k = 0; k < 3; k++) free(m[k]);
    ds4_model_free(whole);
    ds4_fsdp_free(f);
    ds4_model_free(mu);
    ds4_dist_finalize();
    return st == DS4_OK && bad_w == 0 && bad_m == 0 ? 0 : 1;
}

/* The sharded Muon step (each matrix gathered on its owner rank, orthogonalized, scattered back) is bit for
 * bit the one-process step on the same gradients, at EP 1, EP 2 and with the momentum swapped. */
static void test_muon_step_is_one_process_bitwise(const char *self) {
    const char *modes[][2] = {{"1", "0"}, {"2", "0"}, {"1", "1"}};
    for (int i = 0; i < 3; i++) {
        char cmd[2048], out[4096] = "";
        snprintf(cmd, sizeof cmd,
                 "OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 "
                 "OMP_NUM_THREADS=1 ASAN_OPTIONS=detect_leaks=0 timeout 120 mpirun -np 2 --bind-to none '%s' "
                 "--muon-rank %s %s 2>&1",
                 self, modes[i][0], modes[i][1]);
        FILE *pf = popen(cmd, "r");
        size_t len = pf ? fread(out, 1, sizeof out - 1, pf) : 0;
        out[len] = 0;
        int rc = pf ? pclose(pf) : -1;
        CHECK(rc == 0 && strstr(out, "muon-rank: 0 weights, 0 moments differ"), "ep %s swap %s: rc %d:\n%s",
              modes[i][0], modes[i][1], rc, out);
    }
}

/* The float weights, the optimizer's arrays and its step of two checkpoints load to the same bits (each
 * into a state of the optimizer that wrote it). */
static void same_state(const char *a, const char *b) {
    ds4_config c;
    CHECK(ds4_config_load("tests/configs/tiny-a.json", &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m[2] = {NULL, NULL};
    ds4_optim o[2];
    memset(o, 0, sizeof o);
    const char *path[2] = {a, b};
    for (int i = 0; i < 2; i++) {
        ds4_ckpt_meta meta;
        CHECK(ds4_checkpoint_load_meta(path[i], &meta) == DS4_OK, "%s", ds4_errmsg());
        CHECK(ds4_model_create(NULL, &c, false, &m[i]) == DS4_OK &&
              ds4_optim_init(&o[i], meta.optimizer, m[i], NULL, 0) == DS4_OK);
        CHECK(ds4_checkpoint_load(path[i], m[i], &o[i], &meta) == DS4_OK, "%s", ds4_errmsg());
    }
    bool same = o[0].opt == o[1].opt && o[0].step == o[1].step &&
                !memcmp(ds4_model_params_flat(m[0]), ds4_model_params_flat(m[1]), (size_t)o[0].n * sizeof(float));
    for (int g = 0; same && g < DS4_OPT_NGROUPS; g++)
        for (int k = 0; k < o[0].g[g].k; k++)
            same = same && !memcmp(o[0].g[g].mem[k], o[1].g[g].mem[k], (size_t)o[0].g[g].n * sizeof(float));
    CHECK(same, "%s and %s load to different weights or optimizer state", a, b);
    for (int i = 0; i < 2; i++) {
        ds4_optim_free(&o[i]);
        ds4_model_free(m[i]);
    }
}

/* Runs a ds4 command (output to file `out` under the test folder); returns its exit status. */
static int run_ds4(const char *args, const char *out) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "OMP_NUM_THREADS=1 '%s' %s > '%s/%s' 2>&1", g_ds4, args, g_dir, out);
    return system(cmd);
}

/* checkpoint.per_rank: every rank writes its shard file; a run resumed from them with another EP degree
 * logs the losses of the one-writer run and ends in the same state; eval, generate and export read them. */
static void test_per_rank_checkpoints(void) {
    if (!g_have_fsdp) return;
    CHECK(mpi_train("pr", "--checkpoint.per_rank true --training.steps 2", NULL, 0) == 0);
    char p[700], q[700], args[2048], cmdl[2200];
    snprintf(p, sizeof p, "%s/pr/step-00000002/shard-00001-of-00002.safetensors", g_dir);
    snprintf(q, sizeof q, "%s/pr/step-00000002/model.safetensors", g_dir);
    CHECK(access(p, F_OK) == 0 && access(q, F_OK) != 0, "step 2 is not in the per-rank format");
    char out[16384];
    CHECK(mpi_train("pr", "--checkpoint.per_rank true --parallel.ep 2", out, sizeof out) == 0);
    CHECK(strstr(out, "resumed from") != NULL, "the second leg did not resume");
    same_losses("fsdp", "pr", 1, 4);
    snprintf(p, sizeof p, "%s/pr/step-00000004", g_dir);
    snprintf(q, sizeof q, "%s/fsdp/step-00000004", g_dir);
    same_state(p, q);
    /* the readers of a checkpoint: the same output from either format */
    const char *cmd[3] = {"generate --no-bos --ignore-eos --prompt 'ab' --max-new-tokens 8 --checkpoint '%s/%s/step-00000004'",
                          "eval --data '%s/train.bin' --seq-len 64 --max-batches 2 --checkpoint '%s/%s/step-00000004'",
                          "export --quiet --dtype f32 --out '%s/%s-export' --checkpoint '%s/%s/step-00000004'"};
    const char *run[2] = {"fsdp", "pr"};
    for (int c = 0; c < 3; c++) {
        for (int r = 0; r < 2; r++) {
            if (c == 0) snprintf(args, sizeof args, cmd[c], g_dir, run[r]);
            else if (c == 1) snprintf(args, sizeof args, cmd[c], g_dir, g_dir, run[r]);
            else snprintf(args, sizeof args, cmd[c], g_dir, run[r], g_dir, run[r]);
            snprintf(p, sizeof p, "%s-%d.out", run[r], c);
            CHECK(run_ds4(args, p) == 0, "ds4 %s failed", args);
        }
        if (c < 2) { /* the printed text, but for the lines naming the checkpoint's path or a speed */
            snprintf(args, sizeof args, "cd '%s' && cmp -s <(grep -v '^model \\|/s' fsdp-%d.out) <(grep -v '^model \\|/s' pr-%d.out)",
                     g_dir, c, c);
            snprintf(cmdl, sizeof cmdl, "bash -c \"%s\"", args);
            CHECK(system(cmdl) == 0, "ds4 %s prints different text for the two formats", c == 0 ? "generate" : "eval");
        }
    }
    snprintf(p, sizeof p, "diff -r -x .ds4-convert-progress.json '%s/fsdp-export' '%s/pr-export' >/dev/null", g_dir, g_dir);
    CHECK(system(p) == 0, "ds4 export wrote different files for the two formats");
    snprintf(p, sizeof p, "%s/pr-export.whole-tmp", g_dir);
    CHECK(access(p, F_OK) != 0, "ds4 export left %s behind", p);
}

/* `ds4 train --optimizer.name Muon` under 2 ranks: EP changes no bit, a resume is bitwise (momentum in the
 * store too), and the 2-rank checkpoint continues in one process. */
static void test_muon_train_under_two_ranks(void) {
    CHECK(mpi_train("muon", "--optimizer.name Muon", NULL, 0) == 0);
    CHECK(mpi_train("muon_ep2", "--optimizer.name Muon --parallel.ep 2", NULL, 0) == 0);
    same_losses("muon", "muon_ep2", 1, 4);
    same_checkpoint("muon", "muon_ep2", 4);
    CHECK(mpi_train("muon_resumed", "--optimizer.name Muon --swap-optimizer --training.steps 2", NULL, 0) == 0);
    CHECK(mpi_train("muon_resumed", "--optimizer.name Muon --swap-optimizer", NULL, 0) == 0);
    same_losses("muon", "muon_resumed", 1, 4);
    same_checkpoint("muon", "muon_resumed", 4);
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "mkdir -p %s/muon_single && cp -r %s/muon/step-00000002 %s/muon_single/", g_dir, g_dir,
             g_dir);
    CHECK(system(cmd) == 0);
    CHECK(local_train("muon_single", "optimizer.name", "Muon") == DS4_OK, "%s", ds4_errmsg());
    run_log two, one;
    read_log("muon", &two);
    read_log("muon_single", &one);
    CHECK(isnan(one.loss[2]) && isfinite(one.loss[3]), "the one-process run did not resume after step 2");
    CHECK_CLOSE(one.loss[3], two.loss[3], 1e-5, 1e-3);
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--muon-rank")) return muon_rank(atoi(argv[2]), atoi(argv[3]) != 0);
    ds4_set_threads(1);
    setup(argv[0]);
    RUN(test_two_runs_are_bitwise_equal);
    RUN(test_ep_changes_no_math);
    RUN(test_swap_changes_no_math);
    RUN(test_overlap_changes_no_math);
    RUN(test_resume_is_bitwise_under_two_ranks);
    RUN(test_two_rank_checkpoint_loads_in_one_process);
    RUN(test_first_loss_matches_one_process);
    RUN(test_per_rank_checkpoints);
    RUN(test_dspark_under_two_ranks);
    RUN(test_moe_fb_overlap_changes_no_math);
    RUN(test_moe_fb_overlap_needs_two_micro_batches);
    RUN(test_bad_ep_fails_on_every_rank);
    RUN(test_unusable_checkpoint_folder_fails_on_every_rank);
    t_cur_failed = 0; /* RUN takes no argument */
    test_muon_step_is_one_process_bitwise(argv[0]);
    if (t_cur_failed) {
        t_failed++;
        fprintf(stderr, "not ok test_muon_step_is_one_process_bitwise\n");
    } else t_passed++;
    RUN(test_muon_train_under_two_ranks);
    RUN(test_sigusr1_stops_every_rank_with_a_checkpoint);
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf %s", g_dir); /* kept after a failure, to look at */
    if (!t_failed && system(cmd) != 0) fprintf(stderr, "could not remove %s\n", g_dir);
    TEST_MAIN_END("test_train_dist");
}
