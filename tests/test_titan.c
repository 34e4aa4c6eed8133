/* TorchTitan's TOML read as ds4's (src/train/titan.c): the stored TorchTitan DeepSeek debug config
 * (tests/data/torchtitan_deepseek_v3_debug_model.toml) gives the ds4 settings it means, every key of it
 * is ds4's own or reported as read, mapped or ignored; the settings ds4 cannot honour are errors
 * naming the key; the warmup-stable-decay schedule of decay_ratio. tests/test_titan.py trains it. */
#include "ds4/trainer.h"
#include "test.h"

#define FIXTURE "tests/data/torchtitan_deepseek_v3_debug_model.toml"

/* The fixture with `key` set to `value` (key NULL: as it is), read into c. */
static ds4_status read_fixture(ds4_train_cfg *c, const char *key, const char *value) {
    ds4_toml *t;
    DS4_TRY(ds4_toml_load(FIXTURE, &t));
    ds4_status st = key ? ds4_toml_set(t, key, value) : DS4_OK;
    if (st == DS4_OK) st = ds4_train_cfg_from_toml(t, c);
    ds4_toml_free(t);
    return st;
}

static void test_fixture_settings(void) {
    ds4_train_cfg c;
    CHECK(read_fixture(&c, NULL, NULL) == DS4_OK, "%s", ds4_errmsg());
    CHECK(!strcmp(c.model_config, "configs/ds4-demo-small.json"), "%s", c.model_config); /* hf_assets_path */
    CHECK(c.micro_batch == 8 && c.global_batch == -1, "local_batch_size: %lld %lld", (long long)c.micro_batch,
          (long long)c.global_batch);
    CHECK(c.seq_len == 2048 && c.steps == 10 && c.max_norm == 1.0);
    CHECK(c.adamw.lr == 8e-4 && c.adamw.eps == 1e-8);
    CHECK(c.sched.warmup_steps == 2 && c.sched.decay == DS4_DECAY_LINEAR && c.sched.min_lr == 0.0);
    CHECK(c.sched.decay_start == 10 - 8, "decay_ratio 0.8 of 10 steps: %lld", (long long)c.sched.decay_start);
    CHECK(c.ckpt_folder[0] == 0 && c.ckpt_interval == 0, "checkpoint.enable = false");
    CHECK(c.recompute.norm && c.recompute.mhc && !c.recompute.csa_attention && c.ac_every == 0, "selective op");
    CHECK(c.dp_shard == -1 && c.ep == 1 && c.log_freq == 1 && c.tb_folder[0] == 0);
}

typedef struct {
    int alias, mapped, ignored;
    bool saw_local_batch, saw_compile, saw_float8, saw_mode;
} tally;

static void count_note(void *ctx, const char *key, ds4_toml_note_kind kind, const char *what) {
    tally *n = ctx;
    n->alias += kind == DS4_TOML_ALIAS;
    n->mapped += kind == DS4_TOML_MAPPED;
    n->ignored += kind == DS4_TOML_IGNORED;
    if (!strcmp(key, "training.local_batch_size"))
        n->saw_local_batch = kind == DS4_TOML_ALIAS && !strcmp(what, "training.micro_batch_size");
    if (!strcmp(key, "compile.enable")) n->saw_compile = kind == DS4_TOML_IGNORED && strlen(what) > 10;
    if (!strcmp(key, "quantize.grouped_mm.float8.fqns")) n->saw_float8 = kind == DS4_TOML_IGNORED;
    if (!strcmp(key, "activation_checkpoint.mode")) n->saw_mode = kind == DS4_TOML_MAPPED;
}

/* The fixture's 52 keys: 15 are ds4's own (job, metrics, optimizer, lr_scheduler, training and
 * checkpoint keys of the same name and meaning); every other one is reported, each once. */
static void test_fixture_notes(void) {
    ds4_toml *t;
    CHECK(ds4_toml_load(FIXTURE, &t) == DS4_OK, "%s", ds4_errmsg());
    if (!t) return;
    tally n = {0};
    ds4_train_toml_notes(t, count_note, &n);
    CHECK(n.alias == 3, "%d aliases", n.alias); /* local_batch_size, expert_parallel_degree, pipeline_parallel_degree */
    CHECK(n.mapped == 16, "%d mapped", n.mapped);
    CHECK(n.ignored == 18, "%d ignored", n.ignored);
    CHECK(n.alias + n.mapped + n.ignored == 52 - 15, "every key not ds4's own is reported");
    CHECK(n.saw_local_batch && n.saw_compile && n.saw_float8 && n.saw_mode);
    ds4_toml_free(t);
}

static void expect_error(const char *key, const char *value, const char *needle) {
    ds4_train_cfg c;
    ds4_status st = read_fixture(&c, key, value);
    CHECK(st != DS4_OK && strstr(ds4_errmsg(), needle) && !strchr(ds4_errmsg(), '\n'), "%s = %s: %s", key, value,
          st == DS4_OK ? "accepted" : ds4_errmsg());
}

static void test_refused(void) {
    expect_error("parallelism.tensor_parallel_degree", "2", "parallelism.tensor_parallel_degree = 2");
    expect_error("parallel.pp", "4", "parallelism.pipeline_parallel_degree"); /* set twice, differently */
    expect_error("parallelism.pipeline_parallel_degree", "0", "parallelism.pipeline_parallel_degree = 0");
    expect_error("parallelism.pipeline_parallel_schedule", "'GPipe'", "parallelism.pipeline_parallel_schedule");
    expect_error("parallelism.data_parallel_replicate_degree", "2", "data_parallel_replicate_degree");
    expect_error("training.micro_batch_size", "4", "training.local_batch_size");     /* a setting twice */
    expect_error("parallel.ep", "2", "parallelism.expert_parallel_degree");
    expect_error("lr_scheduler.min_lr", "1e-5", "min_lr_factor");
    expect_error("lr_scheduler.decay_type", "sqrt", "lr_scheduler.decay_type");
    expect_error("lr_scheduler.decay_ratio", "1.5", "lr_scheduler.decay_ratio");
    expect_error("model.name", "llama3", "model.name");
    expect_error("activation_checkpoint.mode", "everything", "activation_checkpoint.mode");
    expect_error("activation_checkpoint.selective_ac_option", "x2", "selective_ac_option");
    expect_error("checkpoint.initial_load_path", "/ckpt/step-10", "model.dir");
    expect_error("checkpoint.enable_checkpoint", "true", "checkpoint.enable");
    expect_error("parallelism.tensor_paralel_degree", "1", "tensor_paralel_degree"); /* a typo is unknown... */
    ds4_train_cfg c;
    CHECK(read_fixture(&c, "compile.anything", "1") == DS4_OK); /* ...but a section ds4 ignores is ignored whole */
}

static void test_mapped_variants(void) {
    ds4_train_cfg c;
    CHECK(read_fixture(&c, "activation_checkpoint.mode", "full") == DS4_OK && c.ac_every == 1);
    CHECK(read_fixture(&c, "activation_checkpoint.selective_ac_option", "'3'") == DS4_OK && c.ac_every == 3 &&
          !c.recompute.norm);
    CHECK(read_fixture(&c, "activation_checkpoint.mode", "none") == DS4_OK && c.ac_every == 0 && !c.recompute.mhc);
    CHECK(read_fixture(&c, "checkpoint.enable", "true") == DS4_OK && !strcmp(c.ckpt_folder, "./outputs/checkpoint"),
          "%s", c.ckpt_folder); /* TorchTitan's folder under job.dump_folder */
    CHECK(read_fixture(&c, "metrics.enable_tensorboard", "true") == DS4_OK && !strcmp(c.tb_folder, "./outputs/tb"),
          "%s", c.tb_folder);
    CHECK(read_fixture(&c, "training.global_batch_size", "32") == DS4_OK && c.global_batch == 32);
    CHECK(read_fixture(&c, "lr_scheduler.min_lr_factor", "0.1") == DS4_OK && c.sched.min_lr == 0.1 * 8e-4);
    CHECK(read_fixture(&c, "parallelism.expert_parallel_degree", "2") == DS4_OK && c.ep == 2);
    CHECK(read_fixture(&c, "parallel.ep", "1") == DS4_OK && c.ep == 1); /* --parallel.ep agreeing with the file */
    /* the pipeline degree is read (the run refuses more than one chunk until the schedules exist) */
    CHECK(read_fixture(&c, "parallelism.pipeline_parallel_degree", "4") == DS4_OK && c.recompute.pipe.pp == 4 &&
          !strcmp(c.pp_schedule, "1F1B"));
    CHECK(read_fixture(&c, "training.dataset_path", "'x/*.bin'") == DS4_OK && !strcmp(c.train_data, "x/*.bin"));
    CHECK(read_fixture(&c, "debug.seed", "7") == DS4_OK && c.seed == 7);
    CHECK(read_fixture(&c, "model.hf_assets_path", "''") == DS4_OK && c.model_config[0] == 0); /* "debugmodel" */
    ds4_toml *t;
    CHECK(ds4_toml_load(FIXTURE, &t) == DS4_OK);
    CHECK(ds4_toml_set(t, "model.hf_assets_path", "''") == DS4_OK &&
          ds4_toml_set(t, "model.flavor", "deepseek_v4_flash") == DS4_OK); /* TorchTitan's V4 flavor name */
    CHECK(ds4_train_cfg_from_toml(t, &c) == DS4_OK && !strcmp(c.model_config, "configs/deepseek-v4-flash.json"),
          "%s", c.model_config);
    ds4_toml_free(t);
}

/* decay_ratio 0.5 of 10 steps after 2 warmup steps: lr climbs over steps 1-2, stays until step 5, then
 * decays linearly to min_lr at step 10 (ds4's decay reaches min_lr at the last step). */
static void test_warmup_stable_decay(void) {
    ds4_train_cfg c;
    CHECK(read_fixture(&c, "lr_scheduler.decay_ratio", "0.5") == DS4_OK, "%s", ds4_errmsg());
    const double lr = 8e-4;
    CHECK(ds4_lr_at(&c.sched, 1) == lr * 0.5 && ds4_lr_at(&c.sched, 2) == lr);
    for (int s = 3; s <= 5; s++) CHECK(ds4_lr_at(&c.sched, s) == lr, "step %d: %g", s, ds4_lr_at(&c.sched, s));
    CHECK_CLOSE(ds4_lr_at(&c.sched, 6), lr * 0.8, 1e-12, 0);
    CHECK_CLOSE(ds4_lr_at(&c.sched, 8), lr * 0.4, 1e-12, 0);
    CHECK(ds4_lr_at(&c.sched, 10) == 0.0);
    /* without decay_start the schedule is the one it always was */
    ds4_lr_schedule s = c.sched;
    s.decay_start = 0;
    CHECK_CLOSE(ds4_lr_at(&s, 6), lr * (1.0 - 4.0 / 8.0), 1e-12, 0);
}

int main(void) {
    RUN(test_fixture_settings);
    RUN(test_fixture_notes);
    RUN(test_refused);
    RUN(test_mapped_variants);
    RUN(test_warmup_stable_decay);
    TEST_MAIN_END("test_titan");
}
