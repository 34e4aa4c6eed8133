/* ds4 inspect: the tensors of a .safetensors file or model directory (dtype, shape, bytes), with
 * --stats their values after dequantization, with --check whether a directory holds exactly what
 * its config needs. A per-rank checkpoint step (shards.json): each shard file's tensors, then the packed
 * ranges the index gives each file and their totals. */
#include "cli.h"
#include "cmds.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/train.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#define NFLAGS(f) ((int)(sizeof(f) / sizeof((f)[0])))

typedef struct {
    bool stats;
    int64_t count, bytes, failed;
} listing;

static void print_stats(const ds4_tensor_loc *loc, listing *ls) {
    ds4_tensor_stats st;
    if (ds4_tensor_loc_stats(loc, &st) != DS4_OK) {
        printf("  (%s)", ds4_errmsg());
        ls->failed++;
        return;
    }
    printf(" %13.6g %13.6g %13.6g %9lld", st.min, st.max, st.mean, (long long)st.nan);
}

/* Names and details come from the file: printed escaped (ds4_escape), never as raw control bytes.
 * A copy with room for every byte escaped (free with ds4_free); NULL only when out of memory. */
static char *escaped(const char *s) {
    size_t cap = 4 * strlen(s) + 1;
    char *e = ds4_alloc(DS4_MEM_OTHER, cap);
    return e ? (char *)ds4_escape(s, e, cap) : NULL;
}

/* One line per stored tensor. d != NULL: locate across the directory (scales in other shards). */
static void list_file(const ds4_model_dir *d, const ds4_st_file *f, listing *ls) {
    for (int64_t i = 0; i < ds4_st_count(f); i++) {
        const ds4_st_entry *e = ds4_st_entry_at(f, i);
        char shape[128], *name = escaped(e->name);
        ds4_dims_str(e->ndim, e->shape, shape, sizeof shape);
        printf("%-64s %-8s %-20s %12llu", name ? name : "(out of memory)", ds4_dtype_name(e->dtype), shape,
               (unsigned long long)(e->end - e->begin));
        ds4_free(name);
        ls->count++;
        ls->bytes += (int64_t)(e->end - e->begin);
        if (ls->stats) {
            ds4_tensor_loc loc;
            ds4_status s = d ? ds4_model_dir_locate(d, e->name, &loc) : ds4_st_locate(f, e->name, &loc);
            if (s != DS4_OK) {
                printf("  (%s)", ds4_errmsg());
                ls->failed++;
            } else print_stats(&loc, ls);
        }
        putchar('\n');
    }
}

static void on_problem(void *ctx, const char *what, const char *name, const char *detail) {
    (void)ctx;
    char *n = escaped(name), *dt = escaped(detail);
    printf("%-8s %s: %s\n", what, n ? n : "(out of memory)", dt ? dt : "(out of memory)");
    ds4_free(n);
    ds4_free(dt);
}

static int run_check(const ds4_model_dir *d) {
    int64_t n;
    if (ds4_model_dir_mtp_absent(d))
        printf("note: %s stores no MTP block (transformers' save_pretrained drops it): checked as the model without MTP\n",
               ds4_model_dir_path(d));
    if (ds4_model_dir_check(d, on_problem, NULL, &n) != DS4_OK) return cli_fail();
    if (n == 0) printf("check: %s holds every tensor its config needs, with the right shapes, and nothing else\n", ds4_model_dir_path(d));
    else printf("check: %lld problem%s in %s\n", (long long)n, n == 1 ? "" : "s", ds4_model_dir_path(d));
    return n == 0 ? 0 : 1;
}

/* A per-rank step folder: the tensors of every shard file (their "params" / "adamw.*" are slices of the packed
 * arrays, not model tensors), then the ranges of the index, sorted by packed offset, and the totals. */
static int list_per_rank(const char *dir, listing *ls) {
    ds4_ckpt_shards *s;
    if (ds4_ckpt_shards_open(dir, -1, &s) != DS4_OK) return cli_fail();
    const int nf = ds4_ckpt_shards_nfiles(s);
    for (int i = 0; i < nf; i++) {
        char *path = escaped(ds4_st_path(ds4_ckpt_shards_file(s, i))); /* the name comes from shards.json */
        printf("%s:\n", path ? path : "(out of memory)");
        ds4_free(path);
        list_file(NULL, ds4_ckpt_shards_file(s, i), ls);
    }
    printf("%lld tensors, %lld bytes\n", (long long)ls->count, (long long)ls->bytes);
    printf("\nper-rank checkpoint %s: step %lld, %d shard files, %lld packed elements of params (each optimizer "
           "array covers its group's elements)\n", dir, (long long)ds4_ckpt_shards_step(s), nf, (long long)ds4_ckpt_shards_packed_numel(s));
    printf("%-40s %14s %8s\n", "file", "elements", "ranges");
    const int64_t nr = ds4_ckpt_shards_nranges(s);
    for (int i = 0; i < nf; i++) {
        int64_t count = 0;
        for (int64_t r = 0; r < nr; r++) count += ds4_ckpt_shards_range(s, r).file == i;
        char *path = escaped(ds4_st_path(ds4_ckpt_shards_file(s, i)));
        const char *base = path ? strrchr(path, '/') : NULL;
        printf("%-40s %14lld %8lld\n", base ? base + 1 : "(out of memory)", (long long)ds4_ckpt_shards_elements(s, i),
               (long long)count);
        ds4_free(path);
    }
    printf("%-40s %14s %14s %14s\n", "range: file", "packed offset", "file offset", "length");
    for (int64_t r = 0; r < nr; r++) {
        const ds4_ckpt_range g = ds4_ckpt_shards_range(s, r);
        printf("%-40d %14lld %14lld %14lld\n", g.file, (long long)g.poff, (long long)g.foff, (long long)g.len);
    }
    printf("%lld ranges tile [0, %lld); `ds4 export --checkpoint %s --out DIR` writes one model directory\n",
           (long long)nr, (long long)ds4_ckpt_shards_packed_numel(s), dir);
    ds4_ckpt_shards_close(s);
    return ls->failed ? 1 : 0;
}

int cmd_inspect(int argc, char **argv) {
    cli_flag f[] = {{"stats", true, NULL, "add min / max / mean / NaN count of each tensor after dequantization"},
                    {"check", true, NULL, "MODEL_DIR: verify every tensor the config needs is there with its shape; list missing and extra"},
                    {"config", false, NULL, "CONFIG.json: validate it and print its parameter counts and checkpoint bytes (nothing allocated)"},
                    {"help", true, NULL, "this text"}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv) || argc < 2) {
        cli_usage("inspect", "FILE.safetensors|MODEL_DIR [--stats] [--check] | --config CONFIG.json", f, NFLAGS(f) - 1);
        return argc < 2 ? 2 : 0;
    }
    if (!cli_parse("inspect", argc, argv, f, NFLAGS(f), pos, 1, &npos)) return 2;
    const char *cfgp = cli_get(f, NFLAGS(f), "config");
    if (cfgp && (npos || cli_get(f, NFLAGS(f), "stats") || cli_get(f, NFLAGS(f), "check"))) {
        fprintf(stderr, "error: ds4 inspect: --config CONFIG.json takes no file, --stats or --check\n");
        return 2;
    }
    if (cfgp) return cmd_config_census(cfgp);
    if (npos != 1) {
        fprintf(stderr, "error: ds4 inspect: give one file or directory\n");
        return 2;
    }
    listing ls = {.stats = cli_get(f, NFLAGS(f), "stats") != NULL};
    bool check = cli_get(f, NFLAGS(f), "check") != NULL;
    struct stat st;
    bool is_dir = stat(pos[0], &st) == 0 && S_ISDIR(st.st_mode);
    if (check && !is_dir) {
        fprintf(stderr, "error: ds4 inspect: --check needs a model directory (config.json + shards), got '%s'\n", pos[0]);
        return 2;
    }
    const bool per_rank = is_dir && ds4_checkpoint_is_per_rank(pos[0]);
    if (check && per_rank) {
        fprintf(stderr, "error: ds4 inspect: --check needs a model directory; '%s' is a per-rank checkpoint "
                        "(shards.json): run `ds4 export --checkpoint %s --out DIR` and check DIR\n", pos[0], pos[0]);
        return 2;
    }
    if (check) {
        ds4_model_dir *d;
        if (ds4_model_dir_open(pos[0], &d) != DS4_OK) return cli_fail();
        int rc = run_check(d);
        ds4_model_dir_close(d);
        return rc;
    }
    printf("%-64s %-8s %-20s %12s", "tensor", "dtype", "shape", "bytes");
    if (ls.stats) printf(" %13s %13s %13s %9s", "min", "max", "mean", "nan");
    putchar('\n');
    if (per_rank) return list_per_rank(pos[0], &ls);
    if (!is_dir) {
        ds4_st_file *sf;
        if (ds4_st_open(pos[0], &sf) != DS4_OK) return cli_fail();
        list_file(NULL, sf, &ls);
        ds4_st_close(sf);
    } else {
        ds4_model_dir *d;
        if (ds4_model_dir_open(pos[0], &d) != DS4_OK) return cli_fail();
        for (int64_t i = 0; i < ds4_model_dir_nfiles(d); i++) list_file(d, ds4_model_dir_file(d, i), &ls);
        ds4_model_dir_close(d);
    }
    printf("%lld tensors, %lld bytes\n", (long long)ls.count, (long long)ls.bytes);
    return ls.failed ? 1 : 0;
}
