/* Per-rank checkpoints (checkpoint.per_rank) under `mpirun -np 2` and `-np 4`, on tiny-dspark (integer
 * tables and the carried drafter included):
 *  (a) a base checkpoint (one process, random weights and moments) loads on 2 ranks, which save it per rank
 *      and in the one-writer format; both load back in one process to exactly the base's bits (weights,
 *      tables, carried tensors, AdamW's moments and Muon's momentum, the step, the Muon mark), resident and
 *      with --swap-optimizer, and so do the per-rank files rewritten in the layout of ds4 before Muon owned
 *      its state (the momentum in adamw.m);
 *  (b) 4 ranks with EP 2 and --swap-optimizer load the 2-rank per-rank checkpoint (resharding) and save it
 *      again both ways: still the base's bits, in one process;
 *  (c) keep_latest_k rotates per-rank checkpoints (the hidden folder of a save killed half way is replaced);
 *      a rank whose write fails (a file size limit: a full
 *      disk on one rank) fails the save on every rank, leaves no step folder and no hidden one, and the
 *      previous checkpoint loads;
 *  (d) a truncated shard file, a missing one and an index whose ranges overlap give one-line errors
 *      naming the file; a one-writer checkpoint is never taken for a per-rank one.
 * Run plainly it makes the base, launches itself under mpirun ("--child save|reshard") and checks. */
#include "ds4/io.h"
#include "ds4/offload.h"
#include "ds4/trainer.h"
#include "test.h"
#include "test_mpi.h"

#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *k_cfg = "tests/configs/tiny-dspark.json";
static char g_dir[256];

/* ------------------------------------------------------------------ the ranks */
static ds4_comm *g_world;
static int g_ep;
static bool g_swap;

static ds4_status open_state(bool per_rank, ds4_train_state **s) {
    ds4_config c;
    DS4_TRY(ds4_config_load(k_cfg, &c));
    ds4_train_state_opts o = {.ep = g_ep, .swap_optimizer = g_swap, .per_rank_ckpt = per_rank,
                               .optimizer = &ds4_optimizer_muon};
    return ds4_train_state_open(&c, NULL, 3, g_world, &o, s);
}

/* Loads src and saves it again as step 1 under ROOT g_dir/name, per rank or in the one-writer format. */
static ds4_status load_and_save(const char *src, const char *name, bool per_rank) {
    ds4_train_state *s;
    char root[512];
    snprintf(root, sizeof root, "%s/%s", g_dir, name);
    DS4_TRY(open_state(per_rank, &s));
    ds4_ckpt_meta meta;
    ds4_status st = ds4_train_state_load(s, src, &meta);
    if (st == DS4_OK) st = ds4_train_state_save(s, root, 0, &meta);
    ds4_train_state_free(s);
    return st;
}

/* (a), (b) on the ranks: the source saved both ways, under ROOTs pr<W> and ow<W>. */
static void rank_save_both(void) {
    char src[512], pr[16], ow[16];
    const int W = ds4_comm_size(g_world);
    if (W == 2) snprintf(src, sizeof src, "%s/base/step-00000001", g_dir);
    else snprintf(src, sizeof src, "%s/pr2/step-00000001", g_dir); /* resharding the 2-rank per-rank files */
    snprintf(pr, sizeof pr, "pr%d", W);
    snprintf(ow, sizeof ow, "ow%d", W);
    CHECK(load_and_save(src, pr, true) == DS4_OK, "%s", ds4_errmsg());
    CHECK(load_and_save(src, ow, false) == DS4_OK, "%s", ds4_errmsg());
}

static bool exists(const char *fmt, const char *a, int64_t step) {
    char p[1024];
    snprintf(p, sizeof p, fmt, a, (long long)step);
    return access(p, F_OK) == 0;
}

/* (c) on the ranks: rotation with keep_latest_k 2, then a save that fails on the last rank only. */
static void rank_rotation_and_failure(void) {
    ds4_comm *world = g_world;
    ds4_train_state *s;
    char src[512], root[512], p[1400];
    snprintf(src, sizeof src, "%s/base/step-00000001", g_dir);
    snprintf(root, sizeof root, "%s/rot", g_dir);
    CHECK(open_state(true, &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    ds4_ckpt_meta meta;
    CHECK(ds4_train_state_load(s, src, &meta) == DS4_OK, "%s", ds4_errmsg());
    if (ds4_comm_rank(world) == 0) { /* the leftovers of a save killed half way: replaced, never loaded */
        snprintf(p, sizeof p, "mkdir -p '%s/.tmp-step-00000002' && echo junk > '%s/.tmp-step-00000002/shard-00000-of-00002.safetensors'",
                 root, root);
        CHECK(system(p) == 0, "%s", p);
    }
    CHECK(ds4_comm_barrier(world) == DS4_OK);
    for (int64_t step = 2; step <= 4; step++) {
        meta.step = step;
        CHECK(ds4_train_state_save(s, root, 2, &meta) == DS4_OK, "step %lld: %s", (long long)step, ds4_errmsg());
    }
    const bool lead = ds4_comm_rank(world) == 0, last = ds4_comm_rank(world) == ds4_comm_size(world) - 1;
    if (lead) {
        CHECK(!exists("%s/step-%08lld", root, 2) && exists("%s/step-%08lld", root, 3) && exists("%s/step-%08lld", root, 4),
              "keep_latest_k = 2 did not keep exactly steps 3 and 4");
    }
    /* the last rank cannot write more than 4 KiB: its shard file fails half way */
    struct rlimit old, small = {.rlim_cur = 4096};
    getrlimit(RLIMIT_FSIZE, &old);
    small.rlim_max = old.rlim_max;
    signal(SIGXFSZ, SIG_IGN);
    if (last) setrlimit(RLIMIT_FSIZE, &small);
    meta.step = 5;
    ds4_status st = ds4_train_state_save(s, root, 2, &meta);
    if (last) setrlimit(RLIMIT_FSIZE, &old);
    if (getenv("DS4_TEST_VERBOSE") && lead) fprintf(stderr, "failed save: %s\n", ds4_errmsg());
    CHECK(st != DS4_OK, "a save that failed on rank %d succeeded on rank %d", ds4_comm_size(world) - 1,
          ds4_comm_rank(world));
    if (lead) {
        CHECK(!exists("%s/step-%08lld", root, 5) && !exists("%s/.tmp-step-%08lld", root, 5),
              "a failed save left a step folder or its hidden folder");
        CHECK(exists("%s/step-%08lld", root, 3) && exists("%s/step-%08lld", root, 4), "a failed save rotated a checkpoint away");
    }
    snprintf(p, sizeof p, "%s/step-00000004", root);
    CHECK(ds4_train_state_load(s, p, &meta) == DS4_OK && meta.step == 4, "%s", ds4_errmsg());
    ds4_train_state_free(s);
}

/* (d) the one-writer format: rank 0 cannot write more than 4 KiB, so its model file fails half way while
 * every rank still gathers: each returns the failure (rank 0 naming the file), no rank crashes or hangs,
 * nothing is left behind and the last checkpoint still loads. */
static void rank_writer_failure(void) {
    ds4_comm *world = g_world;
    ds4_train_state *s;
    char src[512], root[512], p[1400];
    snprintf(src, sizeof src, "%s/base/step-00000001", g_dir);
    snprintf(root, sizeof root, "%s/wfail", g_dir);
    CHECK(open_state(false, &s) == DS4_OK, "%s", ds4_errmsg());
    if (!s) return;
    ds4_ckpt_meta meta;
    CHECK(ds4_train_state_load(s, src, &meta) == DS4_OK, "%s", ds4_errmsg());
    meta.step = 1;
    CHECK(ds4_train_state_save(s, root, 2, &meta) == DS4_OK, "%s", ds4_errmsg());
    const bool lead = ds4_comm_rank(world) == 0;
    struct rlimit old, small = {.rlim_cur = 4096};
    getrlimit(RLIMIT_FSIZE, &old);
    small.rlim_max = old.rlim_max;
    signal(SIGXFSZ, SIG_IGN);
    if (lead) setrlimit(RLIMIT_FSIZE, &small);
    meta.step = 2;
    ds4_status st = ds4_train_state_save(s, root, 2, &meta);
    if (lead) setrlimit(RLIMIT_FSIZE, &old);
    CHECK(st != DS4_OK, "a save whose writer failed succeeded on rank %d", ds4_comm_rank(world));
    if (lead) {
        CHECK(strstr(ds4_errmsg(), "model.safetensors") != NULL, "the writer's error does not name its file: %s",
              ds4_errmsg());
        CHECK(!exists("%s/step-%08lld", root, 2) && !exists("%s/.tmp-step-%08lld", root, 2),
              "a failed save left a step folder or its hidden folder");
    }
    snprintf(p, sizeof p, "%s/step-00000001", root);
    CHECK(ds4_train_state_load(s, p, &meta) == DS4_OK && meta.step == 1, "%s", ds4_errmsg());
    ds4_train_state_free(s);
}

/* "save": 2 ranks, EP 1, resident moments; "reshard": 4 ranks, EP 2, swapped moments. */
static int child_main(const char *mode) {
    CHECK(ds4_dist_init() == DS4_OK, "%s", ds4_errmsg());
    g_world = ds4_comm_world();
    const bool save = !strcmp(mode, "save");
    g_ep = save ? 1 : 2;
    g_swap = !save;
    RUN(rank_save_both);
    if (save) RUN(rank_rotation_and_failure);
    if (save) RUN(rank_writer_failure);
    fprintf(stderr, "rank %d: %d ok, %d not ok\n", ds4_comm_rank(g_world), t_passed, t_failed);
    ds4_dist_finalize();
    return t_failed ? 1 : 0;
}

/* ------------------------------------------------------------------ the parent */
/* Runs this binary under mpirun with `ranks` ranks in `mode`; every rank must pass. */
static void under_mpirun(int ranks, const char *mode) {
    char args[4096];
    snprintf(args, sizeof args, "--child %s '%s'", mode, g_dir);
    const int ok = t_mpirun_self(ranks, args, 0);
    CHECK(ok == ranks, "%d of %d ranks passed (%s)", ok, ranks, mode);
}

/* A whole model and Muon state as a checkpoint loads them. */
typedef struct {
    ds4_model *m;
    ds4_optim o;
    ds4_offload *store;
    ds4_ckpt_meta meta;
} whole;

static ds4_status load_whole(const char *path, bool swap, whole *w) {
    memset(w, 0, sizeof *w);
    ds4_config c;
    DS4_TRY(ds4_config_load(k_cfg, &c));
    DS4_TRY(ds4_model_create(NULL, &c, false, &w->m));
    if (swap) {
        DS4_TRY(ds4_offload_open(NULL, NULL, &w->store));
        DS4_TRY(ds4_optim_init(&w->o, &ds4_optimizer_muon, w->m, w->store, 4096));
    } else {
        DS4_TRY(ds4_optim_init(&w->o, &ds4_optimizer_muon, w->m, NULL, 0));
    }
    return ds4_checkpoint_load(path, w->m, &w->o, &w->meta);
}

static void free_whole(whole *w) {
    ds4_optim_free(&w->o);
    ds4_offload_close(w->store);
    ds4_model_free(w->m);
}

/* Element i of array a of group g (resident or swapped). */
static float moment_at(const ds4_optim *o, int g, int a, int64_t i) {
    float x = NAN;
    ds4_optim_read(o, g, a, i, 1, &x);
    return x;
}

/* Every tensor, both moments and the step of a and b are the same bits. */
static void same_state(const whole *a, const whole *b, const char *what) {
    int64_t bad = 0;
    for (int64_t i = 0; i < ds4_model_nparams(a->m); i++) {
        const ds4_param *p = ds4_model_param(a->m, i), *q = ds4_model_param(b->m, i);
        size_t bytes = (size_t)p->numel * (p->is_int ? sizeof(int64_t) : sizeof(float));
        bad += memcmp(p->is_int ? (void *)p->idata : (void *)p->data, q->is_int ? (void *)q->idata : (void *)q->data,
                      bytes) != 0;
    }
    CHECK(bad == 0, "%s: %lld tensors differ", what, (long long)bad);
    int64_t mism = 0;
    for (int k = 0; k < 3; k++) { /* AdamW's m, v; Muon's momentum */
        const int g = k < 2 ? DS4_OPT_ADAMW : DS4_OPT_OWN, n = (int)(a->o.g[g].n == b->o.g[g].n);
        const int64_t stride = a->o.store || b->o.store ? 97 : 1; /* swapped: a sample of elements, read one by one */
        for (int64_t i = 0; i < a->o.g[g].n; i += stride) {
            float x = moment_at(&a->o, g, k % 2, i), y = moment_at(&b->o, g, k % 2, i);
            mism += memcmp(&x, &y, sizeof x) != 0 || !n;
        }
    }
    CHECK(a->o.n == b->o.n && mism == 0, "%s: %lld optimizer state elements differ", what, (long long)mism);
    CHECK(a->meta.optimizer == &ds4_optimizer_muon && b->meta.optimizer == &ds4_optimizer_muon, "%s: the Muon mark is lost",
          what);
    CHECK(a->o.step == b->o.step && a->meta.step == b->meta.step && !strcmp(a->meta.data_state, b->meta.data_state),
          "%s: steps %lld/%lld vs %lld/%lld", what, (long long)a->o.step, (long long)a->meta.step, (long long)b->o.step,
          (long long)b->meta.step);
}

static whole g_base;

/* The base: random weights (tables and drafter included) and random moments, step 1, one process. */
static void test_make_base(void) {
    ds4_config c;
    CHECK(ds4_config_load(k_cfg, &c) == DS4_OK, "%s", ds4_errmsg());
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (!m) return;
    ds4_model_init_random(m, 11);
    ds4_optim o;
    CHECK(ds4_optim_init(&o, &ds4_optimizer_muon, m, NULL, 0) == DS4_OK); /* Muon marks the files */
    t_fill(o.g[DS4_OPT_ADAMW].mem[0], (long)o.g[DS4_OPT_ADAMW].n, 5, 0.01f);
    t_fill(o.g[DS4_OPT_ADAMW].mem[1], (long)o.g[DS4_OPT_ADAMW].n, 6, 1e-4f);
    t_fill(o.g[DS4_OPT_OWN].mem[0], (long)o.g[DS4_OPT_OWN].n, 7, 0.01f);
    o.step = 7;
    ds4_ckpt_meta meta = {.step = 1, .seed = 42};
    snprintf(meta.data_state, sizeof meta.data_state, "position 123");
    char root[512];
    snprintf(root, sizeof root, "%s/base", g_dir);
    CHECK(ds4_checkpoint_save(root, 0, m, &o, &meta) == DS4_OK, "%s", ds4_errmsg());
    ds4_optim_free(&o);
    ds4_model_free(m);
    snprintf(root, sizeof root, "%s/base/step-00000001", g_dir);
    CHECK(load_whole(root, false, &g_base) == DS4_OK, "%s", ds4_errmsg());
    CHECK(!ds4_checkpoint_is_per_rank(root), "a one-writer checkpoint taken for a per-rank one");
}

/* path (a step folder) loads in one process, resident and swapped, to the base's bits. */
static void equals_base(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s/step-00000001", g_dir, name);
    for (int swap = 0; swap < 2; swap++) {
        whole w;
        ds4_status st = load_whole(path, swap, &w);
        CHECK(st == DS4_OK, "%s: %s", name, ds4_errmsg());
        if (st == DS4_OK) same_state(&g_base, &w, name);
        free_whole(&w);
    }
    /* the weights alone, as eval / generate / export read them */
    ds4_model *m = NULL;
    CHECK(ds4_model_create(NULL, ds4_model_config(g_base.m), false, &m) == DS4_OK);
    CHECK(m && ds4_checkpoint_load_model(path, m) == DS4_OK, "%s: %s", name, ds4_errmsg());
    CHECK(m && !memcmp(ds4_model_params_flat(m), ds4_model_params_flat(g_base.m),
                       (size_t)ds4_model_numel(m) * sizeof(float)), "%s: weights differ", name);
    ds4_model_free(m);
}

/* NAME's step folder (per rank) rewritten as ds4 wrote it before Muon owned its state, from the base's
 * state: each file's adamw.m and adamw.v over all its elements in the params' layout, the momentum in adamw.m
 * over the Muon group (0 in adamw.v there and in the padding), no muon.momentum; every other tensor as is. */
static void write_old_per_rank_layout(const char *name) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/%s/step-00000001", g_dir, name);
    const ds4_optim *o = &g_base.o;
    float *m = malloc((size_t)o->n * sizeof(float)), *v = malloc((size_t)o->n * sizeof(float)); /* whole = packed */
    for (int64_t i = 0; i < o->n; i++) {
        int64_t j;
        const int g = ds4_optim_locate(o, i, &j);
        m[i] = o->g[g].mem[0][j];
        v[i] = g == DS4_OPT_OWN ? 0.0f : o->g[g].mem[1][j];
    }
    ds4_ckpt_shards *s = NULL;
    CHECK(ds4_checkpoint_is_per_rank(dir) && ds4_ckpt_shards_open(dir, o->n, &s) == DS4_OK, "%s", ds4_errmsg());
    for (int f = 0; s && f < ds4_ckpt_shards_nfiles(s); f++) {
        const int64_t k = ds4_ckpt_shards_elements(s, f);
        float *fm = calloc((size_t)k + 1, sizeof(float)), *fv = calloc((size_t)k + 1, sizeof(float));
        for (int64_t r = 0; r < ds4_ckpt_shards_nranges(s); r++) {
            const ds4_ckpt_range g = ds4_ckpt_shards_range(s, r);
            if (g.file != f) continue;
            memcpy(fm + g.foff, m + g.poff, (size_t)g.len * sizeof(float));
            memcpy(fv + g.foff, v + g.poff, (size_t)g.len * sizeof(float));
        }
        char path[700];
        snprintf(path, sizeof path, "%s", ds4_st_path(ds4_ckpt_shards_file(s, f)));
        ds4_st_file *in = NULL;
        ds4_st_writer *w = NULL;
        ds4_status st = ds4_st_open(path, &in);
        if (st == DS4_OK) st = ds4_st_writer_new(&w);
        for (int64_t i = 0; st == DS4_OK && i < ds4_st_count(in); i++) {
            const ds4_st_entry *e = ds4_st_entry_at(in, i);
            const bool am = !strcmp(e->name, "adamw.m"), av = !strcmp(e->name, "adamw.v");
            if (!strcmp(e->name, "muon.momentum")) continue;
            st = ds4_st_writer_add(w, e->name, e->dtype, am || av ? 1 : e->ndim, am || av ? &k : e->shape,
                                   am ? (const void *)fm : av ? (const void *)fv : ds4_st_bytes(in, e));
        }
        if (st == DS4_OK) st = ds4_st_writer_write(w, path);
        CHECK(st == DS4_OK, "%s: %s", path, ds4_errmsg());
        ds4_st_writer_free(w);
        ds4_st_close(in);
        free(fm);
        free(fv);
    }
    ds4_ckpt_shards_close(s);
    free(m);
    free(v);
}

static void test_two_ranks(void) {
    under_mpirun(2, "save");
    char p[512];
    snprintf(p, sizeof p, "%s/pr2/step-00000001", g_dir);
    CHECK(ds4_checkpoint_is_per_rank(p), "the 2-rank per-rank save has no index");
    snprintf(p, sizeof p, "%s/pr2/step-00000001/shard-00001-of-00002.safetensors", g_dir);
    CHECK(access(p, F_OK) == 0, "%s missing", p);
    equals_base("pr2");
    equals_base("ow2");
    /* the per-rank files of ds4 before Muon owned its state load to the same bits */
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf %s/old2 && mkdir -p %s/old2 && cp -r %s/pr2/step-00000001 %s/old2/", g_dir, g_dir,
             g_dir, g_dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    write_old_per_rank_layout("old2");
    equals_base("old2");
}

static void test_four_ranks_reshard(void) {
    under_mpirun(4, "reshard");
    char p[512];
    snprintf(p, sizeof p, "%s/pr4/step-00000001/shard-00003-of-00004.safetensors", g_dir);
    CHECK(access(p, F_OK) == 0, "%s missing", p);
    equals_base("pr4");
    equals_base("ow4");
}

/* A copy of pr2's step folder to break. */
static void copy_pr2(const char *name, char *dst, size_t n) {
    char cmd[2048];
    snprintf(dst, n, "%s/%s", g_dir, name);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s/pr2/step-00000001' '%s'", dst, g_dir, dst);
    CHECK(system(cmd) == 0, "%s", cmd);
}

/* Loading path fails with one line that names `file`. */
static void fails_naming(const char *path, const char *file) {
    whole w;
    ds4_status st = load_whole(path, false, &w);
    const char *msg = ds4_errmsg();
    CHECK(st != DS4_OK, "%s loaded", path);
    CHECK(strstr(msg, file) != NULL && !strchr(msg, '\n'), "message does not name %s in one line: %s", file, msg);
    free_whole(&w);
}

static void test_broken_files(void) {
    char dir[512], p[1024];
    copy_pr2("trunc", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/shard-00001-of-00002.safetensors", dir);
    struct stat sb;
    CHECK(stat(p, &sb) == 0 && truncate(p, sb.st_size / 2) == 0, "cannot truncate %s", p);
    fails_naming(dir, "shard-00001-of-00002.safetensors");

    copy_pr2("missing", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/shard-00000-of-00002.safetensors", dir);
    CHECK(unlink(p) == 0);
    fails_naming(dir, "shard-00000-of-00002.safetensors");

    /* an index whose first file claims the second file's first range as well */
    copy_pr2("overlap", dir, sizeof dir);
    snprintf(p, sizeof p, "%s/shards.json", dir);
    char *txt;
    size_t len;
    CHECK(ds4_read_file(p, &txt, &len) == DS4_OK);
    char *r0 = strstr(txt, "\"ranges\""), *r1 = r0 ? strstr(r0 + 1, "\"ranges\"") : NULL;
    char *a = r0 ? strchr(strchr(r0, '[') + 1, '[') : NULL;
    CHECK(a && r1, "shards.json has no ranges");
    if (a && r1) {
        char *b = strchr(strchr(r1, '[') + 1, '['); /* [poff, foff, len] of file 1: make file 0's first range start there */
        long long poff = strtoll(b + 1, NULL, 10);
        char *comma = strchr(a, ',');
        char head[64];
        int h = snprintf(head, sizeof head, "[%lld", poff);
        size_t keep = (size_t)(a - txt);
        char *out = malloc(len + 64);
        memcpy(out, txt, keep);
        memcpy(out + keep, head, (size_t)h);
        memcpy(out + keep + h, comma, len - (size_t)(comma - txt));
        size_t outlen = keep + (size_t)h + (len - (size_t)(comma - txt));
        CHECK(ds4_write_file_atomic(p, out, outlen) == DS4_OK);
        free(out);
        fails_naming(dir, "shards.json");
    }
    ds4_free(txt);
}

int main(int argc, char **argv) {
    if (argc > 3 && !strcmp(argv[1], "--child")) {
        snprintf(g_dir, sizeof g_dir, "%s", argv[3]);
        return child_main(argv[2]);
    }
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_ckpt_dist_%d", (int)getpid());
    mkdir(g_dir, 0755);
    RUN(test_make_base);
    RUN(test_two_ranks);
    RUN(test_four_ranks_reshard);
    RUN(test_broken_files);
    free_whole(&g_base);
    char cmd[512];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_dir);
    if (!t_failed && system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", g_dir);
    TEST_MAIN_END("test_ckpt_dist");
}
