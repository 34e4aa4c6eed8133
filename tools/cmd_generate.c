/* Inference subcommands on a trained model:
 *   ds4 generate: prompt -> continuation with the cached incremental decoder (greedy / temperature / top-p);
 *   ds4 eval:     validation loss and perplexity of held-out token shards (forward only). */
#include "cli.h"
#include "cmds.h"
#include "ds4/data.h"
#include "ds4/decode.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "ds4/tokenizer.h"
#include "ds4/train.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#define NFLAGS(f) ((int)(sizeof(f) / sizeof((f)[0])))

/* ------------------------------------------------------------------ shared: loading a model */
/* The first non-finite element of tensor p (one that has one), read on the host for the message. */
static ds4_status name_nonfinite(const char *cmd, const char *path, ds4_model *m, const ds4_param *p) {
    float *h = ds4_alloc(DS4_MEM_OTHER, (size_t)p->numel * sizeof(float));
    if (!h) return ds4_fail(DS4_ERR_OOM, "ds4 %s: %s: tensor '%s' holds a non-finite value", cmd, path, p->name);
    ds4_model_to_host(m, h, p->data, (size_t)p->numel * sizeof(float));
    int64_t k = 0;
    while (k < p->numel - 1 && isfinite(h[k])) k++;
    ds4_status st = ds4_fail(DS4_ERR_FORMAT, "ds4 %s: %s: tensor '%s' holds a non-finite value (%g at element %lld): "
                             "the weights are broken", cmd, path, p->name, (double)h[k], (long long)k);
    ds4_free(h);
    return st;
}

/* A weight that is NaN or infinite makes every loss and logit NaN: named here, the first one in table order
 * (counted on the model's backend, tensor by tensor). */
static ds4_status check_finite(const char *cmd, const char *path, ds4_model *m) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        const ds4_param *p = ds4_model_param(m, i);
        int64_t bad = 0;
        if (p->data) DS4_TRY(ds4_dev_count_nonfinite(ds4_model_exec(m), p->data, p->numel, &bad));
        if (bad) return name_nonfinite(cmd, path, m, p);
    }
    return DS4_OK;
}

/* --model DIR, or --checkpoint DIR: a checkpoint folder (ROOT/step-NNNNNNNN: a model directory, or the
 * shard files of every rank with their index) or a checkpoint root, whose latest complete checkpoint is used. */
static ds4_status open_model(const char *cmd, const ds4_exec *ex, const char *model_dir, const char *ckpt,
                             ds4_model **out) {
    *out = NULL;
    if (!model_dir == !ckpt)
        return ds4_fail(DS4_ERR_ARG, "ds4 %s: give exactly one of --model DIR and --checkpoint DIR", cmd);
    char path[4096];
    if (model_dir) {
        snprintf(path, sizeof path, "%s", model_dir);
    } else {
        char cfg[4200];
        struct stat sb;
        snprintf(cfg, sizeof cfg, "%s/config.json", ckpt);
        if (stat(cfg, &sb) == 0) snprintf(path, sizeof path, "%s", ckpt);
        else DS4_TRY(ds4_checkpoint_find(ckpt, -1, path, sizeof path));
    }
    ds4_model *m = NULL;
    ds4_status st;
    if (ckpt && ds4_checkpoint_is_per_rank(path)) { /* shard files of every rank: read back into one model */
        char cfg[4200];
        ds4_config c;
        snprintf(cfg, sizeof cfg, "%s/config.json", path);
        DS4_TRY(ds4_config_load(cfg, &c));
        st = ds4_model_create(ex, &c, false, &m);
        if (st == DS4_OK) st = ds4_checkpoint_load_model(path, m);
    } else {
        ds4_model_dir *d;
        DS4_TRY(ds4_model_dir_open(path, &d));
        st = ds4_model_create(ex, ds4_model_dir_config(d), false, &m);
        if (st == DS4_OK) st = ds4_model_load(m, d);
        ds4_model_dir_close(d);
    }
    if (st == DS4_OK) st = check_finite(cmd, path, m);
    if (st != DS4_OK) {
        ds4_model_free(m);
        return st;
    }
    fprintf(stderr, "model %s: %lld parameters\n", path, (long long)ds4_model_numel(m));
    *out = m;
    return DS4_OK;
}

static bool parse_double(const char *cmd, const char *flag, const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) {
        fprintf(stderr, "error: ds4 %s: --%s expects a number, got '%s'\n", cmd, flag, s);
        return false;
    }
    *out = v;
    return true;
}

/* ------------------------------------------------------------------ ds4 generate */
/* Writes the bytes of token id (nothing for BOS / EOS / unknown ids). */
static void put_token(const ds4_tokenizer *tk, int32_t id) {
    if (id == ds4_tokenizer_bos(tk) || id == ds4_tokenizer_eos(tk)) return;
    size_t len = 0;
    const char *b = ds4_tokenizer_token(tk, id, &len);
    if (b) fwrite(b, 1, len, stdout);
}

typedef struct {
    int64_t max_new;
    ds4_sample_opts sample;
    bool stop_at_eos;
} gen_opts;

/* The prompt and the tokens to generate must fit the model's context, max_position_embeddings (or
 * DS4_MAX_POSITIONS when the config gives none): the decoder sizes its caches and rope tables by it. */
static ds4_status check_context(const ds4_config *c, int64_t prompt, int64_t max_new) {
    const int64_t ctx = c->max_position_embeddings > 0 ? c->max_position_embeddings : DS4_MAX_POSITIONS;
    if (max_new <= ctx - prompt) return DS4_OK;   /* both sides are small: no overflow */
    return ds4_fail(DS4_ERR_ARG, "ds4 generate: --max-new-tokens %lld after a prompt of %lld tokens exceeds the model's context of "
                    "%lld positions (%s)", (long long)max_new, (long long)prompt, (long long)ctx,
                    c->max_position_embeddings > 0 ? "max_position_embeddings in its config.json" : "ds4's limit");
}

/* Feeds the prompt, then samples up to max_new tokens, printing each as it comes. */
static ds4_status generate(ds4_model *m, const ds4_tokenizer *tk, const ds4_tokens *prompt, const gen_opts *g) {
    const int64_t V = ds4_model_config(m)->vocab_size, P = prompt->n;
    ds4_decoder *dec = NULL;
    DS4_TRY(ds4_decoder_new(m, P + g->max_new, &dec));
    float *logits = ds4_alloc(DS4_MEM_OTHER, (size_t)V * sizeof(float));
    ds4_status st = logits ? DS4_OK : ds4_fail(DS4_ERR_OOM, "out of memory for %lld logits", (long long)V);
    for (int64_t i = 0; i < P && st == DS4_OK; i++) {
        st = ds4_decoder_step(dec, prompt->ids[i], logits);
        put_token(tk, prompt->ids[i]);
    }
    fflush(stdout);
    double t0 = ds4_now();
    int64_t made = 0;
    const int32_t eos = ds4_tokenizer_eos(tk);
    const int64_t tv = ds4_tokenizer_vocab_size(tk);
    while (st == DS4_OK && made < g->max_new) {
        for (int64_t v = tv; v < V; v++) logits[v] = -INFINITY; /* ids the tokenizer cannot write */
        int32_t next;
        st = ds4_sample(logits, V, &g->sample, (uint64_t)ds4_decoder_pos(dec), &next);
        if (st != DS4_OK) break;
        made++;
        if (g->stop_at_eos && next == eos) break;
        put_token(tk, next);
        fflush(stdout);
        if (made < g->max_new) st = ds4_decoder_step(dec, next, logits);
    }
    double dt = ds4_now() - t0;
    printf("\n");
    fflush(stdout);
    if (st == DS4_OK)
        fprintf(stderr, "generated %lld tokens in %.3f s (%.1f tokens/s; prompt %lld tokens)\n", (long long)made, dt,
                dt > 0 ? (double)made / dt : 0.0, (long long)P);
    ds4_free(logits);
    ds4_decoder_free(dec);
    return st;
}

int cmd_generate(int argc, char **argv) {
    cli_flag f[] = {{"model", false, NULL, "model directory (config.json + *.safetensors)"},
                    {"checkpoint", false, NULL, "checkpoint folder ROOT/step-N, or ROOT for its latest"},
                    {"prompt", false, NULL, "prompt text"},
                    {"tokenizer", false, NULL, "byte (default) or PATH/tokenizer.json"},
                    {"max-new-tokens", false, NULL, "tokens to generate (default 64)"},
                    {"temperature", false, NULL, "0 = greedy (default); > 0 samples"},
                    {"top-p", false, NULL, "nucleus mass in (0, 1] (default 1)"},
                    {"seed", false, NULL, "sampling seed (default 0)"},
                    {"no-bos", true, NULL, "do not start the prompt with the tokenizer's BOS"},
                    {"ignore-eos", true, NULL, "keep generating after EOS"},
                    {"threads", false, NULL, "OpenMP threads"},
                    {"device", false, NULL, "backend to compute on (default cpu; ds4 info lists them)"}};
    const char *pos[1];
    int npos;
    const char *syn = "--model DIR|--checkpoint DIR --prompt TEXT [--tokenizer byte|PATH] [--max-new-tokens N] "
                      "[--temperature T] [--top-p P] [--seed S]";
    if (cli_want_help(argc, argv)) {
        cli_usage("generate", syn, f, NFLAGS(f));
        return 0;
    }
    if (!cli_parse("generate", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    const char *prompt = cli_get(f, NFLAGS(f), "prompt"), *tks = cli_get(f, NFLAGS(f), "tokenizer");
    const char *s;
    gen_opts g = {.max_new = 64, .sample = ds4_sample_defaults(), .stop_at_eos = !cli_get(f, NFLAGS(f), "ignore-eos")};
    if (!prompt) {
        fprintf(stderr, "error: ds4 generate: --prompt is required\n");
        return 2;
    }
    if ((s = cli_get(f, NFLAGS(f), "max-new-tokens")) && !cli_int("generate", "max-new-tokens", s, &g.max_new))
        return 2;
    if ((s = cli_get(f, NFLAGS(f), "temperature")) &&
        !parse_double("generate", "temperature", s, &g.sample.temperature))
        return 2;
    if ((s = cli_get(f, NFLAGS(f), "top-p")) && !parse_double("generate", "top-p", s, &g.sample.top_p)) return 2;
    int64_t seed = 0;
    if ((s = cli_get(f, NFLAGS(f), "seed")) && !cli_int("generate", "seed", s, &seed)) return 2;
    g.sample.seed = (uint64_t)seed;
    if (g.max_new < 0 || g.max_new > DS4_MAX_POSITIONS) {
        fprintf(stderr, "error: ds4 generate: --max-new-tokens %lld is out of range [0, %lld]\n", (long long)g.max_new,
                (long long)DS4_MAX_POSITIONS);
        return 2;
    }
    if (g.sample.temperature < 0 || !(g.sample.top_p > 0 && g.sample.top_p <= 1)) {
        fprintf(stderr, "error: ds4 generate: need --temperature >= 0, --top-p in (0, 1]\n");
        return 2;
    }
    if (!cli_threads("generate", cli_get(f, NFLAGS(f), "threads"))) return 2;
    ds4_exec ex = {.plan = false};
    if (!cli_device("generate", cli_get(f, NFLAGS(f), "device"), true, &ex)) return 2;

    ds4_tokenizer *tk = NULL;
    ds4_model *m = NULL;
    ds4_tokens ids = {0};
    ds4_status st = ds4_tokenizer_open(tks ? tks : "byte", &tk);
    if (st == DS4_OK)
        st = open_model("generate", &ex, cli_get(f, NFLAGS(f), "model"), cli_get(f, NFLAGS(f), "checkpoint"), &m);
    if (st == DS4_OK && ds4_tokenizer_bos(tk) >= 0 && !cli_get(f, NFLAGS(f), "no-bos"))
        st = ds4_tokens_push(&ids, ds4_tokenizer_bos(tk));
    if (st == DS4_OK) st = ds4_tokenizer_encode(tk, prompt, strlen(prompt), true, &ids);
    if (st == DS4_OK && ids.n == 0)
        st = ds4_fail(DS4_ERR_ARG, "ds4 generate: nothing to start from: the prompt is empty and no BOS is prepended");
    for (int64_t i = 0; st == DS4_OK && i < ids.n; i++)
        if (ids.ids[i] >= ds4_model_config(m)->vocab_size)
            st = ds4_fail(DS4_ERR_ARG, "ds4 generate: prompt token %lld is id %d of tokenizer %s, outside the model's "
                          "vocab_size %lld", (long long)i, ids.ids[i], ds4_tokenizer_name(tk),
                          (long long)ds4_model_config(m)->vocab_size);
    if (st == DS4_OK) st = check_context(ds4_model_config(m), ids.n, g.max_new);
    if (st == DS4_OK) st = generate(m, tk, &ids, &g);
    ds4_tokens_free(&ids);
    ds4_model_free(m);
    ds4_tokenizer_free(tk);
    return st == DS4_OK ? 0 : cli_fail();
}

/* ------------------------------------------------------------------ ds4 eval */
typedef struct {
    int64_t T, B, max_batches;
} eval_opts;

/* Mean next-token loss over every row of the shards in stream order (batches of B, the last one
 * possibly shorter), each row scoring its T − 1 in-row targets. */
static ds4_status evaluate(ds4_model *m, ds4_dataloader *dl, const eval_opts *e) {
    const int64_t rows = ds4_data_n_rows(dl);
    /* a batch [min(B, rows), T]: no larger than the data, so --batch cannot size a buffer past it */
    const int64_t bmax = e->B < rows ? e->B : rows;
    int64_t n = 0;
    ds4_status st = DS4_OK;
    if (!ds4_shape_fits(2, (const int64_t[]){bmax, e->T}, sizeof(int32_t), &n))
        st = ds4_fail(DS4_ERR_ARG, "ds4 eval: a batch of %lld rows x %lld tokens is too large", (long long)bmax, (long long)e->T);
    int32_t *ids = st == DS4_OK ? ds4_alloc(DS4_MEM_OTHER, (size_t)n * sizeof(int32_t)) : NULL;
    if (st == DS4_OK && !ids) st = ds4_fail(DS4_ERR_OOM, "out of memory for a batch");
    double sum = 0, t0 = ds4_now();
    int64_t tokens = 0, batches = 0;
    for (int64_t r0 = 0; st == DS4_OK && r0 < rows && (e->max_batches <= 0 || batches < e->max_batches);
         r0 += e->B) {
        const int64_t b = rows - r0 < e->B ? rows - r0 : e->B;
        for (int64_t i = 0; i < b && st == DS4_OK; i++) st = ds4_data_row(dl, r0 + i, ids + i * e->T);
        ds4_pass_opts po = {.need_backward = false};
        ds4_pass *p = NULL;
        if (st == DS4_OK) st = ds4_forward(m, ids, b, e->T, &po, &p);
        if (st == DS4_OK) {
            const int64_t scored = b * (e->T - 1);
            sum += ds4_pass_losses(p)->loss * (double)scored;
            tokens += scored;
            batches++;
        }
        ds4_pass_free(p);
    }
    if (st == DS4_OK) {
        double loss = sum / (double)tokens, dt = ds4_now() - t0;
        printf("eval loss %.6f ppl %.4f tokens %lld\n", loss, exp(loss), (long long)tokens);
        fprintf(stderr, "%lld batches of up to %lld x %lld in %.2f s (%.0f tokens/s)\n", (long long)batches,
                (long long)e->B, (long long)e->T, dt, dt > 0 ? (double)tokens / dt : 0.0);
    }
    ds4_free(ids);
    return st;
}

/* The held-out rows in stream order; checked before the model is loaded. */
static ds4_status open_eval_data(const char *data, const eval_opts *e, ds4_dataloader **out) {
    ds4_data_opts o = ds4_data_defaults();
    o.seq_len = e->T;
    o.batch_size = e->B;
    o.shuffle = false;
    const char *pats[1] = {data};
    DS4_TRY(ds4_data_open(pats, 1, &o, out));
    if (ds4_data_n_rows(*out) > 0) return DS4_OK;
    ds4_data_close(*out);
    *out = NULL;
    return ds4_fail(DS4_ERR_ARG, "ds4 eval: %s holds no row of %lld tokens", data, (long long)e->T);
}

int cmd_eval(int argc, char **argv) {
    cli_flag f[] = {{"model", false, NULL, "model directory (config.json + *.safetensors)"},
                    {"checkpoint", false, NULL, "checkpoint folder ROOT/step-N, or ROOT for its latest"},
                    {"data", false, NULL, "token shard, directory of shards, or glob (held-out data)"},
                    {"seq-len", false, NULL, "tokens per row (default 256)"},
                    {"batch", false, NULL, "rows per forward (default 4)"},
                    {"max-batches", false, NULL, "stop after N batches (default 0: all rows)"},
                    {"threads", false, NULL, "OpenMP threads"},
                    {"device", false, NULL, "backend to compute on (default cpu; ds4 info lists them)"}};
    const char *pos[1];
    int npos;
    if (cli_want_help(argc, argv)) {
        cli_usage("eval",
                  "--model DIR|--checkpoint DIR --data GLOB_OR_SHARD [--seq-len T] [--batch B] [--max-batches N]", f,
                  NFLAGS(f));
        return 0;
    }
    if (!cli_parse("eval", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    eval_opts e = {.T = 256, .B = 4, .max_batches = 0};
    const char *s, *data = cli_get(f, NFLAGS(f), "data");
    if ((s = cli_get(f, NFLAGS(f), "seq-len")) && !cli_int("eval", "seq-len", s, &e.T)) return 2;
    if ((s = cli_get(f, NFLAGS(f), "batch")) && !cli_int("eval", "batch", s, &e.B)) return 2;
    if ((s = cli_get(f, NFLAGS(f), "max-batches")) && !cli_int("eval", "max-batches", s, &e.max_batches)) return 2;
    if (!data) {
        fprintf(stderr, "error: ds4 eval: --data is required\n");
        return 2;
    }
    if (e.T < 2 || e.B < 1) {
        fprintf(stderr, "error: ds4 eval: need --seq-len >= 2 and --batch >= 1\n");
        return 2;
    }
    if (!cli_threads("eval", cli_get(f, NFLAGS(f), "threads"))) return 2;
    ds4_exec ex = {.plan = false};
    if (!cli_device("eval", cli_get(f, NFLAGS(f), "device"), true, &ex)) return 2;
    ds4_model *m = NULL;
    ds4_dataloader *dl = NULL;
    ds4_status st = open_eval_data(data, &e, &dl);
    if (st == DS4_OK) st = open_model("eval", &ex, cli_get(f, NFLAGS(f), "model"), cli_get(f, NFLAGS(f), "checkpoint"), &m);
    if (st == DS4_OK && ds4_data_vocab_size(dl) > ds4_model_config(m)->vocab_size)
        st = ds4_fail(DS4_ERR_ARG, "ds4 eval: %s has vocab %lld but the model's vocab_size is %lld", data,
                      (long long)ds4_data_vocab_size(dl), (long long)ds4_model_config(m)->vocab_size);
    if (st == DS4_OK) st = evaluate(m, dl, &e);
    ds4_data_close(dl);
    ds4_model_free(m);
    return st == DS4_OK ? 0 : cli_fail();
}
