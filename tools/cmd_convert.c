/* ds4 convert: official FP8/FP4 (or HF-named) model directory -> BF16/F32, official or HF names.
 * ds4 export: a ds4 checkpoint folder -> a Hugging Face model directory (weights, config and tokenizer).
 * With --names hf the config.json keys are the transformers spelling (layer_types, compress_rates,
 * mlp_layer_types, partial_rotary_factor, rope_parameters), with --names official DeepSeek's. */
#include "cli.h"
#include "cmds.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/train.h"

#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define NFLAGS(f) ((int)(sizeof(f) / sizeof((f)[0])))

static bool parse_dtype(const char *cmd, const char *s, ds4_dtype *dt) {
    if (!s || !strcmp(s, "bf16")) *dt = DS4_BF16;
    else if (!strcmp(s, "f32")) *dt = DS4_F32;
    else {
        fprintf(stderr, "error: ds4 %s: --dtype must be bf16 or f32, got '%s'\n", cmd, s);
        return false;
    }
    return true;
}

static bool parse_names(const char *cmd, const char *s, bool dflt_hf, bool *hf) {
    if (!s) *hf = dflt_hf;
    else if (!strcmp(s, "hf")) *hf = true;
    else if (!strcmp(s, "official")) *hf = false;
    else {
        fprintf(stderr, "error: ds4 %s: --names must be official or hf, got '%s'\n", cmd, s);
        return false;
    }
    return true;
}

static int run(const char *cmd, ds4_convert_opts *o) {
    ds4_convert_report r;
    if (ds4_convert(o, &r) != DS4_OK) return cli_fail();
    double s = r.seconds > 0 ? r.seconds : 1e-9;
    printf("%s: %s -> %s: %lld shards (%lld already complete), %lld tensors written, %.3f GB read, %.3f GB written in %.2f s "
           "(%.2f GB/s in, %.2f GB/s out)\n",
           cmd, o->in_dir, o->out_dir, (long long)r.shards, (long long)r.shards_skipped, (long long)r.tensors, (double)r.bytes_in / 1e9,
           (double)r.bytes_out / 1e9, r.seconds, (double)r.bytes_in / 1e9 / s, (double)r.bytes_out / 1e9 / s);
    return 0;
}

int cmd_convert(int argc, char **argv) {
    cli_flag f[] = {{"in", false, NULL, "input model directory (config.json + *.safetensors [+ index])"},
                    {"out", false, NULL, "output directory (created; resumes a conversion left unfinished)"},
                    {"dtype", false, NULL, "bf16 (default) or f32"},
                    {"names", false, NULL, "official (default) or hf: tensor names and config.json keys (hf: transformers spelling)"},
                    {"quiet", true, NULL, "no progress bar"}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv)) {
        cli_usage("convert", "--in DIR --out DIR [--dtype bf16|f32] [--names official|hf]", f, NFLAGS(f));
        return 0;
    }
    if (!cli_parse("convert", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    ds4_convert_opts o = {.in_dir = cli_get(f, NFLAGS(f), "in"), .out_dir = cli_get(f, NFLAGS(f), "out"),
                          .progress = !cli_get(f, NFLAGS(f), "quiet")};
    if (!o.in_dir || !o.out_dir) {
        fprintf(stderr, "error: ds4 convert: --in and --out are required\n");
        return 2;
    }
    if (!parse_dtype("convert", cli_get(f, NFLAGS(f), "dtype"), &o.dtype)) return 2;
    if (!parse_names("convert", cli_get(f, NFLAGS(f), "names"), false, &o.hf_names)) return 2;
    return run("convert", &o);
}

/* A per-rank checkpoint (every rank's shard file and their index) is read back into one model and written
 * as a model directory beside --out (OUT.whole-tmp) for the export to convert; dir [n] gets its path. */
static ds4_status write_whole(const char *ckpt, const char *out, char *dir, size_t n) {
    char cfg[4200];
    ds4_config c;
    snprintf(cfg, sizeof cfg, "%s/config.json", ckpt);
    snprintf(dir, n, "%s.whole-tmp", out);
    DS4_TRY(ds4_mkdirs_parent(dir, "folder of --out"));
    DS4_TRY(ds4_config_load(cfg, &c));
    ds4_model *m;
    DS4_TRY(ds4_model_create(NULL, &c, false, &m));
    ds4_status st = ds4_checkpoint_load_model(ckpt, m);
    if (st == DS4_OK) st = ds4_model_save(m, dir, DS4_F32);
    ds4_model_free(m);
    return st;
}

static void remove_whole(const char *dir) {
    char p[4300];
    snprintf(p, sizeof p, "%s/config.json", dir);
    unlink(p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    unlink(p);
    rmdir(dir);
}

/* The tokenizer of an export: --tokenizer, else the checkpoint folder's tokenizer.json, else ds4's byte tokenizer
 * when the model's vocab is the byte tokenizer's 258 (what ds4 tokenize and generate use by default); else none,
 * said on stderr. */
static bool export_tokenizer(const char *ckpt, const char *flag, const char **spec) {
    *spec = flag;
    if (flag) return true;
    char p[4200];
    struct stat st;
    snprintf(p, sizeof p, "%s/tokenizer.json", ckpt);
    if (stat(p, &st) == 0) return true; /* copied from the checkpoint folder */
    ds4_config c;
    snprintf(p, sizeof p, "%s/config.json", ckpt);
    if (ds4_config_load(p, &c) != DS4_OK) return false;
    if (c.vocab_size == 258) *spec = "byte";
    else fprintf(stderr, "note: ds4 export: no tokenizer files written (vocab_size %lld is not the byte tokenizer's 258): pass "
                         "--tokenizer PATH/tokenizer.json\n", (long long)c.vocab_size);
    return true;
}

int cmd_export(int argc, char **argv) {
    cli_flag f[] = {{"checkpoint", false, NULL, "ds4 checkpoint folder (model.safetensors or every rank's shard files; optimizer state is not exported)"},
                    {"out", false, NULL, "output Hugging Face model directory"},
                    {"dtype", false, NULL, "bf16 (default) or f32"},
                    {"names", false, NULL, "hf (default) or official: tensor names and config.json keys (hf: transformers spelling)"},
                    {"tokenizer", false, NULL, "byte, none, or PATH/tokenizer.json (its tokenizer_config.json and chat template "
                                               "too); default: the checkpoint's tokenizer files, else byte for a vocab of 258"},
                    {"quiet", true, NULL, "no progress bar"}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv)) {
        cli_usage("export", "--checkpoint DIR --out DIR [--dtype bf16|f32] [--names hf|official] [--tokenizer byte|none|PATH]", f,
                  NFLAGS(f));
        return 0;
    }
    if (!cli_parse("export", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    ds4_convert_opts o = {.in_dir = cli_get(f, NFLAGS(f), "checkpoint"), .out_dir = cli_get(f, NFLAGS(f), "out"),
                          .progress = !cli_get(f, NFLAGS(f), "quiet"), .model_shards_only = true};
    if (!o.in_dir || !o.out_dir) {
        fprintf(stderr, "error: ds4 export: --checkpoint and --out are required\n");
        return 2;
    }
    if (!parse_dtype("export", cli_get(f, NFLAGS(f), "dtype"), &o.dtype)) return 2;
    if (!parse_names("export", cli_get(f, NFLAGS(f), "names"), true, &o.hf_names)) return 2;
    if (!export_tokenizer(o.in_dir, cli_get(f, NFLAGS(f), "tokenizer"), &o.tokenizer)) return cli_fail();
    if (!ds4_checkpoint_is_per_rank(o.in_dir)) return run("export", &o);
    char whole[4096];
    if (write_whole(o.in_dir, o.out_dir, whole, sizeof whole) != DS4_OK) {
        remove_whole(whole);
        return cli_fail();
    }
    o.in_dir = whole;
    int rc = run("export", &o);
    remove_whole(whole);
    return rc;
}
