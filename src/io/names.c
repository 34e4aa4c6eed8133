/* Official checkpoint names <-> Hugging Face transformers DeepSeek-V4 names (§8.1, §8.2).
 *
 *   official                                   HF
 *   embed.weight                               model.embed_tokens.weight
 *   norm.weight / head.weight                  model.norm.weight / lm_head.weight
 *   hc_head_{fn,base,scale}                    model.hc_head.hc_{fn,base,scale}
 *   layers.L.<suffix>                          model.layers.L.<hf suffix>      (table below)
 *   layers.L.ffn.experts.E.w1.weight           model.layers.L.mlp.experts.gate_up_proj[E, 0:I]
 *   layers.L.ffn.experts.E.w3.weight           model.layers.L.mlp.experts.gate_up_proj[E, I:2I]
 *   layers.L.ffn.experts.E.w2.weight           model.layers.L.mlp.experts.down_proj[E]
 *   mtp.0.*                                    (none: HF does not load MTP; the name is kept)
 *
 * What transformers' save_pretrained writes is a third spelling: it reverses its renaming of DeepSeek's
 * checkpoint names on the model's names, which gives the official per-layer names under "model."
 * (model.layers.L.attn.wq_a.weight, one tensor per routed expert: model.layers.L.ffn.experts.E.w1.weight),
 * except that attn.kv_norm comes out as attn.norm (its renaming .norm. -> .kv_norm. read backwards);
 * head.weight keeps its official name, embed, norm and hc_head their HF ones; the MTP block is dropped.
 */
#include "ds4/io.h"
#include "ds4/tensors.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    const char *official, *hf;
} name_pair;

/* Whole-model tensors (full names), from the table of ds4/tensors.h. */
#define PAIR(field, nd, a, b, official, hf, rule, f32) {official, hf},
static const name_pair k_global[] = {DS4_EMBED_TENSORS(PAIR) DS4_HEAD_TENSORS(PAIR)};

/* Per-layer tensors: suffix after "layers.L." / after "model.layers.L."; routed experts are fused below. */
#define CMP_PAIR(field, nd, a, b, official, hf, rule, f32) {"attn.compressor." official, "self_attn.compressor." hf},
#define IDX_CMP_PAIR(field, nd, a, b, official, hf, rule, f32) \
    {"attn.indexer.compressor." official, "self_attn.compressor.indexer." hf},
static const name_pair k_layer[] = {
    DS4_BLOCK_TENSORS(PAIR) DS4_COMPRESSOR_TENSORS(CMP_PAIR) DS4_INDEXER_TENSORS(PAIR)
    DS4_COMPRESSOR_TENSORS(IDX_CMP_PAIR) DS4_ROUTER_TENSORS(PAIR) DS4_ROUTER_BIAS_TENSORS(PAIR)
    DS4_ROUTER_HASH_TENSORS(PAIR) DS4_SHARED_EXPERT_TENSORS(PAIR)};

#define COUNT(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* "PREFIX<digits>.rest": the layer index and a pointer to rest; false otherwise. Leading zeros and
 * empty digit runs are refused so the mapping stays one-to-one. */
static bool split_layer(const char *name, const char *prefix, int64_t *layer, const char **rest) {
    size_t pl = strlen(prefix);
    if (strncmp(name, prefix, pl) != 0) return false;
    const char *p = name + pl;
    if (*p < '0' || *p > '9' || (p[0] == '0' && p[1] >= '0' && p[1] <= '9')) return false;
    int64_t v = 0;
    for (; *p >= '0' && *p <= '9'; p++) {
        if (v > (INT64_MAX - 9) / 10) return false;
        v = 10 * v + (*p - '0');
    }
    if (*p != '.') return false;
    *layer = v;
    *rest = p + 1;
    return true;
}

/* snprintf result w into a buffer of n bytes: true when nothing was cut. */
static bool fits(size_t n, int w) { return w >= 0 && (size_t)w < n; }

bool ds4_name_to_hf(const char *official, ds4_hf_ref *ref) {
    memset(ref, 0, sizeof *ref);
    ref->expert = -1;
    for (int i = 0; i < COUNT(k_global); i++)
        if (strcmp(official, k_global[i].official) == 0)
            return fits(sizeof ref->name, snprintf(ref->name, sizeof ref->name, "%s", k_global[i].hf));
    int64_t l;
    const char *rest;
    if (!split_layer(official, "layers.", &l, &rest)) return false;
    for (int i = 0; i < COUNT(k_layer); i++)
        if (strcmp(rest, k_layer[i].official) == 0)
            return fits(sizeof ref->name,
                       snprintf(ref->name, sizeof ref->name, "model.layers.%" PRId64 ".%s", l, k_layer[i].hf));
    /* routed experts: ffn.experts.E.w{1,2,3}.weight */
    int64_t e;
    const char *w;
    if (!split_layer(rest, "ffn.experts.", &e, &w)) return false;
    const char *fused;
    if (strcmp(w, "w1.weight") == 0) fused = "gate_up_proj", ref->part = 0, ref->nparts = 2;
    else if (strcmp(w, "w3.weight") == 0) fused = "gate_up_proj", ref->part = 1, ref->nparts = 2;
    else if (strcmp(w, "w2.weight") == 0) fused = "down_proj", ref->part = 0, ref->nparts = 1;
    else return false;
    ref->expert = e;
    return fits(sizeof ref->name, snprintf(ref->name, sizeof ref->name, "model.layers.%" PRId64 ".mlp.experts.%s", l, fused));
}

bool ds4_name_from_hf(const char *hf, char *official, size_t n) {
    for (int i = 0; i < COUNT(k_global); i++)
        if (strcmp(hf, k_global[i].hf) == 0) return fits(n, snprintf(official, n, "%s", k_global[i].official));
    int64_t l;
    const char *rest;
    if (!split_layer(hf, "model.layers.", &l, &rest)) return false;
    for (int i = 0; i < COUNT(k_layer); i++)
        if (strcmp(rest, k_layer[i].hf) == 0)
            return fits(n, snprintf(official, n, "layers.%" PRId64 ".%s", l, k_layer[i].official));
    return false;
}

int ds4_name_hf_fused_parts(const char *hf) {
    int64_t l;
    const char *rest;
    if (!split_layer(hf, "model.layers.", &l, &rest)) return 0;
    if (strcmp(rest, "mlp.experts.gate_up_proj") == 0) return 2;
    if (strcmp(rest, "mlp.experts.down_proj") == 0) return 1;
    return 0;
}

bool ds4_name_hf_fused_part(const char *hf, int64_t expert, int part, char *official, size_t n) {
    int np = ds4_name_hf_fused_parts(hf);
    if (np == 0 || part < 0 || part >= np || expert < 0) return false;
    int64_t l;
    const char *rest;
    split_layer(hf, "model.layers.", &l, &rest);
    const char *w = np == 1 ? "w2" : part == 0 ? "w1" : "w3";
    return fits(n, snprintf(official, n, "layers.%" PRId64 ".ffn.experts.%" PRId64 ".%s.weight", l, expert, w));
}

/* "attn.kv_norm.weight" is saved as "attn.norm.weight"; every other per-layer name is official. */
static const char k_kv_norm[] = "attn.kv_norm.weight", k_kv_norm_saved[] = "attn.norm.weight";

/* rest is an official per-layer name: a table entry or ffn.experts.E.w{1,2,3}.weight. */
static bool official_layer_suffix(const char *rest) {
    for (int i = 0; i < COUNT(k_layer); i++)
        if (strcmp(rest, k_layer[i].official) == 0) return true;
    int64_t e;
    const char *w;
    return split_layer(rest, "ffn.experts.", &e, &w) &&
           (!strcmp(w, "w1.weight") || !strcmp(w, "w2.weight") || !strcmp(w, "w3.weight"));
}

bool ds4_name_to_hf_saved(const char *official, char *saved, size_t n) {
    int64_t l;
    const char *rest;
    if (!split_layer(official, "layers.", &l, &rest) || !official_layer_suffix(rest)) return false;
    return fits(n, snprintf(saved, n, "model.layers.%" PRId64 ".%s", l, strcmp(rest, k_kv_norm) ? rest : k_kv_norm_saved));
}

bool ds4_name_from_hf_saved(const char *saved, char *official, size_t n) {
    int64_t l;
    const char *rest;
    if (!split_layer(saved, "model.layers.", &l, &rest)) return false;
    if (!strcmp(rest, k_kv_norm_saved)) rest = k_kv_norm;
    else if (!strcmp(rest, k_kv_norm) || !official_layer_suffix(rest)) return false;
    return fits(n, snprintf(official, n, "layers.%" PRId64 ".%s", l, rest));
}
