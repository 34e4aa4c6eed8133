/* Writes a synthetic checkpoint in the official DeepSeek-V4 layout (§8.1): V4-Flash dimensions with
 * fewer layers / experts / vocabulary, FP8 E4M3 linears with 128x128 E8M0 scales, packed FP4 experts
 * with 1x32 E8M0 scales, BF16 / F32 / I64 tensors as in the release, sharded with an index. Values
 * are deterministic pseudo-random bytes (no NaN codes). For measuring `ds4 convert` / `inspect`.
 *
 *   make_fake_ckpt OUT_DIR [--layers 4] [--experts 32] [--vocab 32768] [--shards 4] [--mtp 1]
 *
 * Writes with the streaming writer, so it needs little memory whatever the size. */
#include "ds4/io.h"
#include "ds4/model.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

typedef struct {
    char name[128];
    ds4_dtype dtype;
    int ndim;
    int64_t shape[2];
    int kind;          /* 0 plain, 1 FP8 weight, 2 FP4 weight, 3 E8M0 scale */
    uint64_t bytes;
    int shard;
} gen_tensor;

typedef struct {
    gen_tensor *t;
    int64_t n, cap;
} gen_list;

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && strcmp(s + a - b, suf) == 0;
}

static void push(gen_list *l, const char *name, ds4_dtype dt, int ndim, int64_t d0, int64_t d1, int kind) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 1024;
        l->t = realloc(l->t, (size_t)l->cap * sizeof *l->t);
    }
    gen_tensor *t = &l->t[l->n++];
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->dtype = dt;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = d1;
    t->kind = kind;
    t->bytes = (uint64_t)d0 * (uint64_t)(ndim > 1 ? d1 : 1) * ds4_dtype_size(dt);
}

/* The release's dtype for each tensor (§8.1). */
static ds4_status on_tensor(void *ctx, const char *name, int ndim, const int64_t *shape, bool is_int) {
    gen_list *l = ctx;
    int64_t r = shape[0], c = ndim > 1 ? shape[1] : 1;
    char sn[160];
    snprintf(sn, sizeof sn, "%.*s.scale", (int)(strlen(name) - 7), name);
    bool fp8 = strstr(name, ".attn.wq_a.") || strstr(name, ".attn.wq_b.") || strstr(name, ".attn.wkv.") ||
               strstr(name, ".attn.wo_a.") || strstr(name, ".attn.wo_b.") || strstr(name, ".indexer.wq_b.") ||
               strstr(name, ".shared_experts.") || strstr(name, "e_proj.") || strstr(name, "h_proj.") ||
               strstr(name, ".main_proj."); /* DSpark stage 0 (docs/dspark.md) */
    bool fp4 = strstr(name, ".ffn.experts.") != NULL;
    if (is_int) push(l, name, DS4_I64, 2, r, c, 0);
    else if (fp4) {
        push(l, name, DS4_I8, 2, r, c / 2, 2);
        push(l, sn, DS4_F8_E8M0, 2, r, (c + 31) / 32, 3);
    } else if (fp8) {
        push(l, name, DS4_F8_E4M3, 2, r, c, 1);
        push(l, sn, DS4_F8_E8M0, 2, (r + 127) / 128, (c + 127) / 128, 3);
    } else {
        bool f32 = strstr(name, "hc_") || ends_with(name, "attn_sink") || ends_with(name, ".ape") || ends_with(name, "gate.bias");
        push(l, name, f32 ? DS4_F32 : DS4_BF16, ndim, r, c, 0);
    }
    return DS4_OK;
}

static uint64_t splitmix(uint64_t *s) {
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Bytes [at, at + n) of tensor t into buf. */
static void fill(const gen_tensor *t, uint64_t at, uint64_t n, uint8_t *buf, int64_t experts) {
    uint64_t seed = ds4_hash_str(t->name) ^ (at * 0x2545f4914f6cdd1dull);
    size_t es = ds4_dtype_size(t->dtype);
    for (uint64_t i = 0; i < n; i += 8) {
        uint64_t r = splitmix(&seed);
        uint64_t k = n - i < 8 ? n - i : 8;
        memcpy(buf + i, &r, (size_t)k);
    }
    for (uint64_t i = 0; i < n; i++) {
        uint8_t *b = &buf[i];
        if (t->kind == 1 && (*b & 0x7f) == 0x7f) *b ^= 1;     /* no E4M3 NaN codes */
        if (t->kind == 3) *b = (uint8_t)(118 + *b % 12);     /* scales 2^-9 .. 2^2 */
    }
    if (t->kind == 0 && t->dtype == DS4_BF16)
        for (uint64_t i = 0; i + 1 < n; i += 2) buf[i + 1] = (uint8_t)((buf[i + 1] & 0x80) | 0x3c);   /* |x| in [2^-7, 2^-6) */
    if (t->kind == 0 && t->dtype == DS4_F32)
        for (uint64_t i = 0; i + 3 < n; i += 4) buf[i + 3] = (uint8_t)((buf[i + 3] & 0x80) | 0x3c);
    if (t->dtype == DS4_I64)
        for (uint64_t i = 0; i + 7 < n; i += 8) {
            int64_t v = (int64_t)(((uint64_t)buf[i] | (uint64_t)buf[i + 1] << 8) % (uint64_t)experts);
            memcpy(buf + i, &v, 8);
        }
    (void)es;
}

static int fail(void) {
    fprintf(stderr, "error: %s\n", ds4_errmsg());
    return 1;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: make_fake_ckpt OUT_DIR [--layers 4] [--experts 32] [--vocab 32768] [--shards 4] [--mtp 1]\n");
        return 2;
    }
    const char *out = argv[1];
    int64_t layers = 4, experts = 32, vocab = 32768, shards = 4, mtp = 1;
    for (int i = 2; i + 1 < argc; i += 2) {
        int64_t v = strtoll(argv[i + 1], NULL, 10);
        if (!strcmp(argv[i], "--layers")) layers = v;
        else if (!strcmp(argv[i], "--experts")) experts = v;
        else if (!strcmp(argv[i], "--vocab")) vocab = v;
        else if (!strcmp(argv[i], "--shards")) shards = v;
        else if (!strcmp(argv[i], "--mtp")) mtp = v;
        else {
            fprintf(stderr, "error: unknown flag %s\n", argv[i]);
            return 2;
        }
    }
    if (mkdir(out, 0755) != 0 && errno != EEXIST) {
        perror(out);
        return 1;
    }
    /* config: V4-Flash with fewer layers, experts and tokens */
    const char *roots[] = {"configs", "../configs", "../../configs"};
    char *text = NULL;
    size_t len;
    for (int i = 0; i < 3 && !text; i++) {
        char p[256];
        snprintf(p, sizeof p, "%s/deepseek-v4-flash.json", roots[i]);
        if (access(p, R_OK) == 0 && ds4_read_file(p, &text, &len) != DS4_OK) return fail();
    }
    if (!text) {
        fprintf(stderr, "error: configs/deepseek-v4-flash.json not found (run from the repository)\n");
        return 1;
    }
    cJSON *cfg = cJSON_ParseWithLength(text, len);
    ds4_free(text);
    cJSON *cr = cJSON_GetObjectItemCaseSensitive(cfg, "compress_ratios");
    cJSON *ncr = cJSON_CreateArray();
    for (int64_t l = 0; l < layers + mtp; l++)
        cJSON_AddItemToArray(ncr, cJSON_CreateNumber(l < layers ? cJSON_GetArrayItem(cr, (int)l)->valuedouble : 0));
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "compress_ratios", ncr);
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "num_hidden_layers", cJSON_CreateNumber((double)layers));
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "num_nextn_predict_layers", cJSON_CreateNumber((double)mtp));
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "n_routed_experts", cJSON_CreateNumber((double)experts));
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "vocab_size", cJSON_CreateNumber((double)vocab));
    cJSON_ReplaceItemInObjectCaseSensitive(cfg, "num_hash_layers", cJSON_CreateNumber((double)(layers < 3 ? layers : 3)));
    char *ct = cJSON_Print(cfg);
    char path[4096];
    snprintf(path, sizeof path, "%s/config.json", out);
    if (ds4_write_file_atomic(path, ct, strlen(ct)) != DS4_OK) return fail();
    cJSON_free(ct);
    cJSON_Delete(cfg);
    ds4_config c;
    if (ds4_config_load(path, &c) != DS4_OK) return fail();

    gen_list l = {0};
    if (ds4_model_expected_tensors(&c, on_tensor, &l) != DS4_OK) return fail();
    uint64_t total = 0;
    for (int64_t i = 0; i < l.n; i++) total += l.t[i].bytes;
    /* consecutive tensors fill shards of about total / shards bytes (a weight stays with its scale) */
    uint64_t acc = 0;
    int sh = 0;
    for (int64_t i = 0; i < l.n; i++) {
        if (l.t[i].kind != 3 && acc >= (uint64_t)(sh + 1) * (total / (uint64_t)shards) && sh + 1 < shards) sh++;
        l.t[i].shard = sh;
        acc += l.t[i].bytes;
    }
    int nsh = sh + 1;
    cJSON *idx = cJSON_CreateObject();
    cJSON_AddNumberToObject(cJSON_AddObjectToObject(idx, "metadata"), "total_size", (double)total);
    cJSON *wm = cJSON_AddObjectToObject(idx, "weight_map");
    uint8_t *buf = malloc((size_t)64 << 20);
    double t0 = ds4_now();
    for (int s = 0; s < nsh; s++) {
        char fname[64];
        snprintf(fname, sizeof fname, "model-%05d-of-%05d.safetensors", s + 1, nsh);
        ds4_st_writer *w;
        if (ds4_st_writer_new(&w) != DS4_OK) return fail();
        for (int64_t i = 0; i < l.n; i++)
            if (l.t[i].shard == s) {
                if (ds4_st_writer_declare(w, l.t[i].name, l.t[i].dtype, l.t[i].ndim, l.t[i].shape) != DS4_OK) return fail();
                cJSON_AddStringToObject(wm, l.t[i].name, fname);
            }
        snprintf(path, sizeof path, "%s/%s", out, fname);
        if (ds4_st_writer_begin(w, path) != DS4_OK) return fail();
        for (int64_t i = 0; i < l.n; i++) {
            if (l.t[i].shard != s) continue;
            for (uint64_t at = 0; at < l.t[i].bytes; at += (uint64_t)64 << 20) {
                uint64_t n = l.t[i].bytes - at < ((uint64_t)64 << 20) ? l.t[i].bytes - at : ((uint64_t)64 << 20);
                fill(&l.t[i], at, n, buf, experts);
                if (ds4_st_writer_put(w, buf, (size_t)n) != DS4_OK) return fail();
            }
        }
        if (ds4_st_writer_finish(w) != DS4_OK) return fail();
        ds4_st_writer_free(w);
        fprintf(stderr, "wrote %s\n", path);
    }
    char *it = cJSON_Print(idx);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", out);
    if (ds4_write_file_atomic(path, it, strlen(it)) != DS4_OK) return fail();
    cJSON_free(it);
    cJSON_Delete(idx);
    printf("%s: %lld tensors, %.3f GB in %d shards, written in %.1f s\n", out, (long long)l.n, (double)total / 1e9, nsh,
           ds4_now() - t0);
    free(buf);
    free(l.t);
    return 0;
}
