/* config.json (Hugging Face DeepSeek-V4 keys, docs/dsv4-architecture.md §1.1) <-> ds4_config.
 *
 * Two spellings are read. DeepSeek's official config.json (compress_ratios, num_hash_layers,
 * qk_rope_head_dim, rope_scaling) and the one the transformers port writes (DeepseekV4Config:
 * layer_types + compress_rates, mlp_layer_types, partial_rotary_factor, rope_parameters). Each of the
 * four settings may be given in either spelling or in both (transformers' save_pretrained writes
 * qk_rope_head_dim beside partial_rotary_factor; ds4's official export writes layer_types +
 * compress_rates beside compress_ratios): both must then say the same, else one error names the two
 * keys. A config is "in the transformers spelling" (for hints and the names in messages) when it has
 * a transformers-only key. Every key of either spelling is known; a key outside that set is an error
 * (with the nearest known key of the config's spelling as a hint), so a typo never silently falls back
 * to a default. */
#include "ds4/io.h"

#include <cjson/cJSON.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Every key of config.json, once: what parsing accepts (JSON kind, required, spelling), the setting it
 * fills (field, default when absent), the range an integer setting must lie in, the one value ds4
 * supports for a fixed key, where ds4_config_save writes it and whether a resumed run must match it.
 * `req` = must be present (in the spelling the key belongs to); `sp`: which spelling the key belongs
 * to; `alt`: the key of the other spelling that carries the same setting. Keys without a field or a
 * fixed value are read for their type only (boilerplate) or by the spelling parsers below.
 *
 * Ranges are generous — at least 4x the largest DeepSeek-V4 value (V4-Pro, configs/deepseek-v4-pro.json,
 * in the comments) — and small enough that every size ds4 derives from them (parameter and activation
 * counts, rope tables, caches) fits in 64 bits, so an absurd config.json is refused at load, naming the
 * key, and never reaches an allocation or a loop. */
typedef enum { J_INT, J_NUM, J_BOOL, J_STR, J_STR_OR_NULL, J_INT_OR_NULL, J_OBJ, J_ARR, J_ANY } jkind;
typedef enum { SP_ANY, SP_DS, SP_HF, SP_SUB } spelling; /* SP_SUB: a key inside an object, never top level */
typedef enum { T_NONE, T_I64, T_F64, T_BOOL } ftype;
typedef struct {
    const char *key;
    jkind kind;
    bool req;
    spelling sp;
    const char *alt;
    ftype type;          /* the ds4_config field the key fills (T_NONE: none) */
    size_t field;        /* offsetof in ds4_config */
    double dflt;         /* its value when the key is absent */
    bool ranged;         /* an integer setting in [min, max] */
    int64_t min, max;
    const char *only;    /* a fixed key: the one value ds4 supports ("true" / "false" for booleans) */
    int save;            /* position in the config.json ds4_config_save writes (0: not written) */
    bool resume;         /* shapes the model or its computation: a resumed run must match it */
} config_key;

#define KEY(k, kd, rq, s, a) .key = k, .kind = kd, .req = rq, .sp = s, .alt = a
#define ANY(k, kd, rq) KEY(k, kd, rq, SP_ANY, NULL)
#define I64(f, d) .type = T_I64, .field = offsetof(ds4_config, f), .dflt = d
#define F64(f, d) .type = T_F64, .field = offsetof(ds4_config, f), .dflt = d
#define BOOL(f) .type = T_BOOL, .field = offsetof(ds4_config, f)
#define RANGE(lo, hi) .ranged = true, .min = lo, .max = hi
#define ONLY(v) .only = v
#define SAVE(n) .save = n
#define RESUME .resume = true

static const config_key k_keys[] = {
    {ANY("vocab_size", J_INT, true), I64(vocab_size, 0), RANGE(1, 1 << 24), SAVE(40), RESUME},                 /* 129280 */
    {ANY("hidden_size", J_INT, true), I64(dim, 0), RANGE(1, 1 << 16), SAVE(11), RESUME},                       /* 7168 */
    {ANY("num_hidden_layers", J_INT, true), I64(n_layers, 0), RANGE(1, DS4_MAX_LAYERS - 1), SAVE(22), RESUME}, /* 61 */
    /* 1: ds4 trains at most one MTP block */
    {ANY("num_nextn_predict_layers", J_INT, true), I64(n_mtp_layers, 0), RANGE(0, 1), SAVE(25), RESUME},
    {ANY("num_attention_heads", J_INT, true), I64(n_heads, 0), RANGE(1, 1024), SAVE(20), RESUME},              /* 128 */
    {ANY("num_key_value_heads", J_INT, false), I64(n_kv_heads, 1), SAVE(24), RESUME},
    {ANY("head_dim", J_INT, true), I64(head_dim, 0), RANGE(1, 4096), SAVE(9), RESUME},                         /* 512 */
    {KEY("qk_rope_head_dim", J_INT, true, SP_DS, "partial_rotary_factor"), I64(rope_head_dim, 0), SAVE(29), RESUME},
    {ANY("q_lora_rank", J_INT, true), I64(q_lora_rank, 0), RANGE(1, 1 << 16), SAVE(28), RESUME},               /* 1536 */
    {ANY("o_groups", J_INT, true), I64(o_groups, 0), RANGE(1, 1024), SAVE(26), RESUME},                        /* 16 */
    {ANY("o_lora_rank", J_INT, true), I64(o_lora_rank, 0), RANGE(1, 1 << 16), SAVE(27), RESUME},               /* 1024 */
    {ANY("sliding_window", J_INT, true), I64(window, 0), RANGE(1, 1 << 16), SAVE(36), RESUME},                 /* 128 */
    {KEY("compress_ratios", J_ARR, true, SP_DS, "layer_types"), SAVE(42)},
    {ANY("index_n_heads", J_INT, true), I64(index_n_heads, 0), RANGE(1, 1024), SAVE(13), RESUME},              /* 64 */
    {ANY("index_head_dim", J_INT, true), I64(index_head_dim, 0), RANGE(1, 4096), SAVE(12), RESUME},            /* 128 */
    {ANY("index_topk", J_INT, true), I64(index_topk, 0), RANGE(1, 1 << 16), SAVE(14), RESUME},                 /* 1024 */
    {ANY("hc_mult", J_INT, true), I64(hc_mult, 0), RANGE(1, 16), SAVE(7), RESUME},                             /* 4 */
    /* 20; the backward keeps every iteration on the stack */
    {ANY("hc_sinkhorn_iters", J_INT, true), I64(hc_sinkhorn_iters, 0), RANGE(1, 100), SAVE(8), RESUME},
    {ANY("hc_eps", J_NUM, true), F64(hc_eps, 0), SAVE(6), RESUME},
    {ANY("n_routed_experts", J_INT, true), I64(n_routed_experts, 0), RANGE(1, 2048), SAVE(17), RESUME},        /* 384 */
    {ANY("n_shared_experts", J_INT, true), I64(n_shared_experts, 0), RANGE(0, 64), SAVE(18), RESUME},          /* 1 */
    {ANY("num_experts_per_tok", J_INT, true), I64(n_activated_experts, 0), RANGE(1, 256), SAVE(21), RESUME},   /* 6 */
    {ANY("moe_intermediate_size", J_INT, true), I64(moe_inter_dim, 0), RANGE(1, 1 << 16), SAVE(16), RESUME},   /* 3072 */
    {KEY("num_hash_layers", J_INT, true, SP_DS, "mlp_layer_types"), I64(n_hash_layers, 0), SAVE(23), RESUME},
    {ANY("scoring_func", J_STR, false), ONLY("sqrtsoftplus"), SAVE(35)},
    {ANY("routed_scaling_factor", J_NUM, true), F64(route_scale, 0), SAVE(34), RESUME},
    {ANY("norm_topk_prob", J_BOOL, false), ONLY("true"), SAVE(19)},
    {ANY("topk_method", J_STR, false), ONLY("noaux_tc"), SAVE(39)},
    {ANY("swiglu_limit", J_NUM, true), F64(swiglu_limit, 0), SAVE(37), RESUME},
    {ANY("rope_theta", J_NUM, true), F64(rope_theta, 0), SAVE(33), RESUME},
    {ANY("compress_rope_theta", J_NUM, true), F64(compress_rope_theta, 0), SAVE(41), RESUME},
    {KEY("rope_scaling", J_ANY, false, SP_DS, "rope_parameters"), SAVE(32)}, /* object or null */
    {ANY("rms_norm_eps", J_NUM, true), F64(norm_eps, 0), SAVE(31), RESUME},
    /* 1048576; 0 = not given */
    {ANY("max_position_embeddings", J_INT, false), I64(max_position_embeddings, 0), RANGE(0, DS4_MAX_POSITIONS), SAVE(15),
     RESUME},
    {ANY("hidden_act", J_STR, false), ONLY("silu"), SAVE(10)},
    {ANY("tie_word_embeddings", J_BOOL, false), ONLY("false"), SAVE(38)},
    {ANY("bos_token_id", J_INT, false), I64(bos_token_id, 0), SAVE(3), RESUME},
    {ANY("eos_token_id", J_INT, false), I64(eos_token_id, 1), SAVE(4), RESUME},
    {ANY("quantization_config", J_ANY, false), SAVE(30)},   /* object or null */
    {ANY("torch_dtype", J_STR, false)},
    {ANY("expert_dtype", J_STR_OR_NULL, false), SAVE(5)},
    /* ds4 training keys (docs/contract.md); the loss weights are not checked on resume: [training] sets
     * them per run, and changing a loss weight on resume is a choice, not a mistake */
    {ANY("mtp_loss_weight", J_NUM, false), F64(mtp_loss_weight, 0.3), SAVE(43)},
    {ANY("indexer_loss_coeff", J_NUM, false), F64(indexer_loss_coeff, 0.01), SAVE(44)},
    {ANY("csa_dense", J_BOOL, false), BOOL(csa_dense), SAVE(45)},
    /* the DSpark drafter of DeepSeek-V4-Flash-0731 (docs/dspark.md): the four come together; parse_dspark
     * reads and range-checks them */
    {ANY("dspark_block_size", J_INT, false), SAVE(46)},
    {ANY("dspark_noise_token_id", J_INT, false), SAVE(47)},
    {ANY("dspark_target_layer_ids", J_ARR, false), SAVE(48)},
    {ANY("dspark_markov_rank", J_INT, false), SAVE(49)},
    /* Hugging Face boilerplate: accepted, ignored */
    {ANY("architectures", J_ARR, false), SAVE(1)},
    {ANY("model_type", J_STR, false), SAVE(2)},
    {ANY("transformers_version", J_STR, false)},
    {ANY("auto_map", J_OBJ, false)},
    {ANY("attention_bias", J_BOOL, false)},
    {ANY("attention_dropout", J_NUM, false)},
    {ANY("initializer_range", J_NUM, false)},
    {ANY("use_cache", J_BOOL, false)},
    {ANY("pretraining_tp", J_INT, false)},
    {ANY("first_k_dense_replace", J_INT, false)},
    {ANY("dtype", J_STR, false)},                   /* newer transformers' torch_dtype */
    {ANY("pad_token_id", J_INT_OR_NULL, false)},
    {ANY("output_router_logits", J_BOOL, false)},
    {ANY("router_aux_loss_coef", J_NUM, false)},
    {ANY("router_jitter_noise", J_NUM, false)},
    {ANY("mlp_bias", J_BOOL, false), ONLY("false")},
    /* the transformers spelling (DeepseekV4Config) of four DeepSeek settings */
    {KEY("layer_types", J_ARR, true, SP_HF, "compress_ratios")},
    {KEY("compress_rates", J_OBJ, true, SP_HF, "compress_ratios")},
    {KEY("mlp_layer_types", J_ARR, true, SP_HF, "num_hash_layers")},
    {KEY("partial_rotary_factor", J_NUM, true, SP_HF, "qk_rope_head_dim")},
    {KEY("rope_parameters", J_ANY, false, SP_HF, "rope_scaling")},  /* object or null */
    /* settings inside rope_scaling (rope_parameters.compress in the transformers spelling) */
    {KEY("rope_scaling.factor", J_NUM, false, SP_SUB, NULL), F64(rope_factor, 1), RESUME},
    /* 65536; 0 = no YaRN */
    {KEY("rope_scaling.original_max_position_embeddings", J_INT, false, SP_SUB,
         "rope_parameters.compress.original_max_position_embeddings"),
     I64(original_seq_len, 0), RANGE(0, DS4_MAX_POSITIONS), RESUME},
    {KEY("rope_scaling.beta_fast", J_NUM, false, SP_SUB, NULL), F64(beta_fast, 0), RESUME},
    {KEY("rope_scaling.beta_slow", J_NUM, false, SP_SUB, NULL), F64(beta_slow, 0), RESUME},
};
#undef KEY
#undef ANY
#undef I64
#undef F64
#undef BOOL
#undef RANGE
#undef ONLY
#undef SAVE
#undef RESUME
#define N_KEYS ((int)(sizeof k_keys / sizeof k_keys[0]))
/* compress_ratios entries: 0 (sliding window only) or a ratio in [2, this]; V4 uses 4 and 128. */
#define MAX_COMPRESS_RATIO (1 << 16)

/* The range of integer setting `key` (a top-level key), NULL if it has none. */
static const config_key *range_of(const char *key) {
    for (int i = 0; i < N_KEYS; i++)
        if (k_keys[i].ranged && k_keys[i].sp != SP_SUB && strcmp(k_keys[i].key, key) == 0) return &k_keys[i];
    return NULL;
}

static const char *kind_name(jkind k) {
    switch (k) {
    case J_INT: return "an integer";
    case J_NUM: return "a number";
    case J_BOOL: return "true or false";
    case J_STR: return "a string";
    case J_STR_OR_NULL: return "a string or null";
    case J_INT_OR_NULL: return "an integer or null";
    case J_OBJ: return "an object";
    case J_ARR: return "an array";
    default: return "a value";
    }
}

/* Levenshtein distance, for the "did you mean" hint. */
static int edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 64 || lb > 64) return la > lb ? la : lb;
    int row[65];
    for (int j = 0; j <= lb; j++) row[j] = j;
    for (int i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = i;
        for (int j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

/* Whether key i belongs to the config's spelling (hf = transformers). */
static bool in_spelling(int i, bool hf) {
    return k_keys[i].sp == SP_ANY || (k_keys[i].sp != SP_SUB && (k_keys[i].sp == SP_HF) == hf);
}

static const char *closest_key(const char *k, bool hf) {
    const char *best = k_keys[0].key;
    int bd = 1 << 30;
    for (int i = 0; i < N_KEYS; i++) {
        if (!in_spelling(i, hf)) continue;
        int d = edit_distance(k, k_keys[i].key);
        if (d < bd) bd = d, best = k_keys[i].key;
    }
    return best;
}

static int find_key(const char *k) {
    for (int i = 0; i < N_KEYS; i++)
        if (k_keys[i].sp != SP_SUB && strcmp(k, k_keys[i].key) == 0) return i;
    return -1;
}

static bool is_int(const cJSON *j) {
    if (!cJSON_IsNumber(j)) return false;
    double v = j->valuedouble;
    return fabs(v) <= 9007199254740992.0 && floor(v) == v;
}

static bool kind_ok(const cJSON *j, jkind k) {
    switch (k) {
    case J_INT: return is_int(j);
    case J_NUM: return cJSON_IsNumber(j) && isfinite(j->valuedouble);
    case J_BOOL: return cJSON_IsBool(j);
    case J_STR: return cJSON_IsString(j);
    case J_STR_OR_NULL: return cJSON_IsString(j) || cJSON_IsNull(j);
    case J_INT_OR_NULL: return is_int(j) || cJSON_IsNull(j);
    case J_OBJ: return cJSON_IsObject(j);
    case J_ARR: return cJSON_IsArray(j);
    default: return true;
    }
}

static const cJSON *get(const cJSON *root, const char *key) { return cJSON_GetObjectItemCaseSensitive(root, key); }

static int64_t get_int(const cJSON *root, const char *key, int64_t dflt) {
    const cJSON *j = get(root, key);
    return j ? (int64_t)j->valuedouble : dflt;
}
static double get_num(const cJSON *root, const char *key, double dflt) {
    const cJSON *j = get(root, key);
    return j ? j->valuedouble : dflt;
}

/* The keys with one supported value (`only`), when present, have it: the strings first, then the
 * booleans. */
static ds4_status check_fixed(const cJSON *root, const char *path) {
    for (int pass = 0; pass < 2; pass++)
        for (int i = 0; i < N_KEYS; i++) {
            const config_key *k = &k_keys[i];
            const cJSON *j = k->only ? get(root, k->key) : NULL;
            if (!j || (k->kind == J_BOOL) != (pass == 1)) continue;
            if (pass == 0 && strcmp(j->valuestring, k->only) != 0)
                return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' is \"%.40s\", ds4 supports only \"%s\"", path, k->key,
                                j->valuestring, k->only);
            bool want = strcmp(k->only, "true") == 0;
            if (pass == 1 && cJSON_IsTrue(j) != want)
                return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' is %s, ds4 supports only %s", path, k->key, want ? "false" : "true",
                                want ? "true" : "false");
        }
    return DS4_OK;
}

/* The settings of the top-level keys of both spellings' common part and DeepSeek's (its four settings
 * when given; the transformers parsers fill or check them after), or their defaults. */
static void read_fields(const cJSON *root, ds4_config *cfg) {
    for (int i = 0; i < N_KEYS; i++) {
        const config_key *k = &k_keys[i];
        if (k->type == T_NONE || !in_spelling(i, false)) continue;
        const cJSON *j = get(root, k->key);
        char *f = (char *)cfg + k->field;
        if (k->type == T_I64) {
            int64_t v = j ? (int64_t)j->valuedouble : (int64_t)k->dflt;
            memcpy(f, &v, sizeof v);
        } else if (k->type == T_F64) {
            double v = j ? j->valuedouble : k->dflt;
            memcpy(f, &v, sizeof v);
        } else {
            bool v = j && cJSON_IsTrue(j);
            memcpy(f, &v, sizeof v);
        }
    }
}

/* The transformers key that makes `root` a transformers-spelled config; NULL for DeepSeek's spelling. */
static const char *hf_marker(const cJSON *root) {
    for (const cJSON *c = root->child; c; c = c->next) {
        int ki = find_key(c->string);
        if (ki >= 0 && k_keys[ki].sp == SP_HF) return c->string;
    }
    return NULL;
}

/* A key whose JSON value has the wrong type; an integer setting names its range and the value seen. */
static ds4_status wrong_kind(const cJSON *c, jkind kind, const char *path) {
    const config_key *r = kind == J_INT ? range_of(c->string) : NULL;
    if (!r) return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' must be %s", path, c->string, kind_name(kind));
    char seen[64] = "";
    if (cJSON_IsNumber(c)) snprintf(seen, sizeof seen, ", got %.17g", c->valuedouble);
    return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' must be an integer in [%" PRId64 ", %" PRId64 "]%s", path, c->string, r->min,
                    r->max, seen);
}

/* A required setting of the two spellings (DeepSeek key k_keys[ds]) is given: by its DeepSeek key or by
 * every transformers key of it (layer_types needs compress_rates). Else the missing key of the config's
 * spelling is named. */
static ds4_status check_setting_given(const cJSON *root, int ds, bool hf, const char *path) {
    const char *missing = NULL;
    int given = 0;
    for (int i = 0; i < N_KEYS; i++) {
        if (k_keys[i].sp != SP_HF || strcmp(k_keys[i].alt, k_keys[ds].key) != 0) continue;
        if (get(root, k_keys[i].key)) given++;
        else if (!missing) missing = k_keys[i].key;
    }
    if (given && missing) return ds4_fail(DS4_ERR_CONFIG, "%s: required key '%s' is missing", path, missing);
    if (given || get(root, k_keys[ds].key)) return DS4_OK;
    return ds4_fail(DS4_ERR_CONFIG, "%s: required key '%s' is missing", path, hf && missing ? missing : k_keys[ds].key);
}

/* Checks every top-level key: known, right JSON type, no duplicates, required ones present (a setting of
 * the two spellings in either). *hf: the config uses the transformers spelling. */
static ds4_status check_keys(const cJSON *root, const char *path, bool *hf) {
    const char *marker = hf_marker(root);
    *hf = marker != NULL;
    for (const cJSON *c = root->child; c; c = c->next) {
        int ki = find_key(c->string);
        if (ki < 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: unknown key '%.80s' (did you mean '%s'?)", path, c->string,
                            closest_key(c->string, *hf));
        for (const cJSON *d = root->child; d != c; d = d->next)
            if (strcmp(d->string, c->string) == 0) return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' appears twice", path, c->string);
        if (!kind_ok(c, k_keys[ki].kind)) return wrong_kind(c, k_keys[ki].kind, path);
    }
    for (int i = 0; i < N_KEYS; i++) {
        if (!k_keys[i].req || k_keys[i].sp == SP_HF) continue;
        if (k_keys[i].sp == SP_DS) DS4_TRY(check_setting_given(root, i, *hf, path));
        else if (!get(root, k_keys[i].key))
            return ds4_fail(DS4_ERR_CONFIG, "%s: required key '%s' is missing", path, k_keys[i].key);
    }
    if (*hf) {
        const cJSON *mt = get(root, "model_type");
        if (!mt || strcmp(mt->valuestring, "deepseek_v4") != 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: transformers-spelled config (key '%s') needs model_type \"deepseek_v4\"", path,
                            marker);
    }
    return DS4_OK;
}

static ds4_status parse_rope_scaling(const cJSON *rs, const char *path, ds4_config *cfg) {
    /* No YaRN unless rope_scaling says so. */
    cfg->original_seq_len = 0;
    cfg->rope_factor = 1.0;
    cfg->beta_fast = cfg->beta_slow = 0.0;
    if (!rs || cJSON_IsNull(rs)) return DS4_OK;
    if (!cJSON_IsObject(rs)) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'rope_scaling' must be an object or null", path);
    static const char *const keys[] = {"type", "rope_type", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"};
    bool have[6] = {0};
    for (const cJSON *c = rs->child; c; c = c->next) {
        int ki = -1;
        for (int i = 0; i < 6; i++)
            if (strcmp(c->string, keys[i]) == 0) ki = i;
        if (ki < 0) return ds4_fail(DS4_ERR_CONFIG, "%s: unknown key 'rope_scaling.%.80s'", path, c->string);
        if (have[ki]) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'rope_scaling.%s' appears twice", path, c->string);
        have[ki] = true;
        bool ok = ki <= 1 ? cJSON_IsString(c) : ki == 3 ? is_int(c) : (cJSON_IsNumber(c) && isfinite(c->valuedouble));
        if (!ok)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'rope_scaling.%s' must be %s", path, c->string,
                            ki <= 1 ? "a string" : ki == 3 ? "an integer" : "a number");
        if (ki <= 1 && strcmp(c->valuestring, "yarn") != 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'rope_scaling.%s' is \"%.40s\", ds4 supports only \"yarn\"", path, c->string,
                            c->valuestring);
    }
    if (!have[0] && !have[1]) return ds4_fail(DS4_ERR_CONFIG, "%s: required key 'rope_scaling.type' is missing", path);
    for (int i = 2; i < 6; i++)
        if (!have[i]) return ds4_fail(DS4_ERR_CONFIG, "%s: required key 'rope_scaling.%s' is missing", path, keys[i]);
    cfg->rope_factor = get_num(rs, "factor", 1.0);
    cfg->original_seq_len = get_int(rs, "original_max_position_embeddings", 0);
    cfg->beta_fast = get_num(rs, "beta_fast", 0.0);
    cfg->beta_slow = get_num(rs, "beta_slow", 0.0);
    return DS4_OK;
}

static ds4_status parse_quant(const cJSON *q, const char *path, ds4_config *cfg) {
    cfg->quantized = false;
    if (!q || cJSON_IsNull(q)) return DS4_OK;
    if (!cJSON_IsObject(q)) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'quantization_config' must be an object or null", path);
    cfg->quantized = true;
    const cJSON *m = get(q, "quant_method"), *f = get(q, "fmt"), *b = get(q, "weight_block_size");
    if (m && (!cJSON_IsString(m) || strcmp(m->valuestring, "fp8") != 0))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'quantization_config.quant_method' must be \"fp8\"", path);
    if (f && (!cJSON_IsString(f) || strcmp(f->valuestring, "e4m3") != 0))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'quantization_config.fmt' must be \"e4m3\"", path);
    if (b && !(cJSON_IsArray(b) && cJSON_GetArraySize(b) == 2 && is_int(b->child) && is_int(b->child->next) &&
               b->child->valuedouble == 128 && b->child->next->valuedouble == 128))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'quantization_config.weight_block_size' must be [128, 128]", path);
    return DS4_OK;
}

/* ---------------------------------------------------------------- the transformers spelling */

static const char k_swa[] = "sliding_attention", k_csa[] = "compressed_sparse_attention", k_hca[] = "heavily_compressed_attention";

/* compress_rates {CSA: m, HCA: m'} + layer_types[num_hidden_layers] -> compress_ratios. The
 * transformers config lists no MTP layer; ds4's MTP entries stay 0 (the MTP block is SWA-only).
 * ds4 tells CSA from HCA by the ratio (4 = CSA: overlapping compressor + indexer), so the CSA rate
 * must be 4 and the HCA rate anything else >= 2. */
static ds4_status parse_hf_layers(const cJSON *root, const char *path, ds4_config *cfg) {
    int64_t rate[2] = {0, 0};   /* CSA, HCA */
    bool have[2] = {false, false};
    for (const cJSON *c = get(root, "compress_rates")->child; c; c = c->next) {
        int k = strcmp(c->string, k_csa) == 0 ? 0 : strcmp(c->string, k_hca) == 0 ? 1 : -1;
        if (k < 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: unknown key 'compress_rates.%.80s' (expected '%s' or '%s')", path, c->string, k_csa,
                            k_hca);
        if (have[k]) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_rates.%s' appears twice", path, c->string);
        if (!is_int(c)) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_rates.%s' must be an integer", path, c->string);
        have[k] = true;
        rate[k] = (int64_t)c->valuedouble;
    }
    for (int k = 0; k < 2; k++)
        if (!have[k]) return ds4_fail(DS4_ERR_CONFIG, "%s: required key 'compress_rates.%s' is missing", path, k ? k_hca : k_csa);
    if (rate[0] != 4)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_rates.%s' is %" PRId64 ", ds4 runs compressed sparse attention at ratio 4 only",
                        path, k_csa, rate[0]);
    if (rate[1] < 2 || rate[1] == 4 || rate[1] > MAX_COMPRESS_RATIO)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_rates.%s' is %" PRId64 ", must be >= 2 and not 4 (ratio 4 is CSA in ds4), at most %d",
                        path, k_hca, rate[1], MAX_COMPRESS_RATIO);
    int64_t n = 0;
    for (const cJSON *c = get(root, "layer_types")->child; c; c = c->next, n++) {
        if (n >= DS4_MAX_LAYERS)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'layer_types' has more than %d entries", path, DS4_MAX_LAYERS);
        const char *t = cJSON_IsString(c) ? c->valuestring : "";
        if (strcmp(t, k_swa) == 0) cfg->compress_ratios[n] = 0;
        else if (strcmp(t, k_csa) == 0) cfg->compress_ratios[n] = rate[0];
        else if (strcmp(t, k_hca) == 0) cfg->compress_ratios[n] = rate[1];
        else
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'layer_types' entry %" PRId64 " must be \"%s\", \"%s\" or \"%s\"", path, n, k_swa,
                            k_csa, k_hca);
    }
    if (n != cfg->n_layers)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'layer_types' has %" PRId64 " entries, expected num_hidden_layers = %" PRId64
                        " (no MTP entry)", path, n, cfg->n_layers);
    for (int64_t l = n; l < n + cfg->n_mtp_layers + cfg->dspark_n_stages && l < DS4_MAX_LAYERS; l++) cfg->compress_ratios[l] = 0;
    return DS4_OK;
}

/* mlp_layer_types[num_hidden_layers]: "hash_moe" for the first num_hash_layers layers, then "moe". */
static ds4_status parse_hf_hash(const cJSON *root, const char *path, ds4_config *cfg) {
    int64_t n = 0, n_hash = 0;
    for (const cJSON *c = get(root, "mlp_layer_types")->child; c; c = c->next, n++) {
        const char *t = cJSON_IsString(c) ? c->valuestring : "";
        bool hash = strcmp(t, "hash_moe") == 0;
        if (!hash && strcmp(t, "moe") != 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'mlp_layer_types' entry %" PRId64 " must be \"hash_moe\" or \"moe\"", path, n);
        if (hash && n_hash < n)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'mlp_layer_types' entry %" PRId64 " is \"hash_moe\" after a \"moe\" layer; "
                            "ds4 hash-routes the first layers only", path, n);
        n_hash += hash;
    }
    if (n != cfg->n_layers)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'mlp_layer_types' has %" PRId64 " entries, expected num_hidden_layers = %" PRId64,
                        path, n, cfg->n_layers);
    cfg->n_hash_layers = n_hash;
    return DS4_OK;
}

/* partial_rotary_factor = qk_rope_head_dim / head_dim; the product must be a whole channel count. */
static ds4_status parse_hf_rotary(const cJSON *root, const char *path, ds4_config *cfg) {
    double f = get_num(root, "partial_rotary_factor", 0), x = f * (double)cfg->head_dim;
    if (!(f > 0 && f <= 1))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'partial_rotary_factor' is %g, must be in (0, 1]", path, f);
    double r = nearbyint(x);
    if (fabs(x - r) > 1e-9 * fmax(1.0, x))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'partial_rotary_factor' (%g) * head_dim (%" PRId64 ") = %g is not a whole number of channels",
                        path, f, cfg->head_dim, x);
    cfg->rope_head_dim = (int64_t)r;
    return DS4_OK;
}

/* One rope dict of rope_parameters (`label` names it in messages). Its rope_theta and
 * partial_rotary_factor, when given, must equal the top-level ones (`theta_key`); YaRN keys only
 * where yarn_ok, required when rope_type is "yarn", and then applied to cfg. */
static ds4_status parse_rope_dict(const cJSON *root, const cJSON *d, const char *label, const char *theta_key, bool yarn_ok,
                                  const char *path, ds4_config *cfg) {
    if (!cJSON_IsObject(d)) return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' must be an object", path, label);
    static const char *const keys[] = {"rope_type", "type", "rope_theta", "partial_rotary_factor", "attention_factor",
                                       "factor", "original_max_position_embeddings", "beta_fast", "beta_slow"};
    enum { NK = sizeof keys / sizeof keys[0], FIRST_YARN = 4 };
    const cJSON *v[NK] = {0};
    for (const cJSON *c = d->child; c; c = c->next) {
        int ki = -1;
        for (int i = 0; i < NK; i++)
            if (strcmp(c->string, keys[i]) == 0) ki = i;
        if (ki < 0 || (ki >= FIRST_YARN && !yarn_ok)) return ds4_fail(DS4_ERR_CONFIG, "%s: unknown key '%s.%.80s'", path, label, c->string);
        if (v[ki]) return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.%s' appears twice", path, label, c->string);
        bool ok = ki <= 1 ? cJSON_IsString(c) : ki == 6 ? is_int(c) : (cJSON_IsNumber(c) && isfinite(c->valuedouble));
        if (!ok)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.%s' must be %s", path, label, c->string,
                            ki <= 1 ? "a string" : ki == 6 ? "an integer" : "a number");
        v[ki] = c;
    }
    const char *type = v[0] ? v[0]->valuestring : v[1] ? v[1]->valuestring : "default";
    if (v[0] && v[1] && strcmp(v[0]->valuestring, v[1]->valuestring) != 0)
        return ds4_fail(DS4_ERR_CONFIG, "%s: keys '%s.rope_type' and '%s.type' disagree", path, label, label);
    bool yarn = strcmp(type, "yarn") == 0;
    if (!(strcmp(type, "default") == 0 || (yarn && yarn_ok)))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.rope_type' is \"%.40s\", ds4 supports only \"default\"%s", path, label, type,
                        yarn_ok ? " or \"yarn\"" : " here");
    if (v[2] && v[2]->valuedouble != get_num(root, theta_key, 0))
        return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.rope_theta' (%g) disagrees with key '%s' (%g)", path, label, v[2]->valuedouble,
                        theta_key, get_num(root, theta_key, 0));
    /* without a top-level partial_rotary_factor (qk_rope_head_dim gives it), against qk_rope_head_dim / head_dim */
    double prf = get_num(root, "partial_rotary_factor", (double)cfg->rope_head_dim / (double)cfg->head_dim);
    if (v[3] && v[3]->valuedouble != prf)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.partial_rotary_factor' (%g) disagrees with key '%s' (%g)", path, label,
                        v[3]->valuedouble, get(root, "partial_rotary_factor") ? "partial_rotary_factor" : "qk_rope_head_dim / head_dim",
                        prf);
    if (v[4] && v[4]->valuedouble != 1.0)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.attention_factor' is %g, DeepSeek-V4 scales no attention (must be 1)", path, label,
                        v[4]->valuedouble);
    for (int i = 5; i < NK; i++) {
        if (yarn && !v[i]) return ds4_fail(DS4_ERR_CONFIG, "%s: required key '%s.%s' is missing", path, label, keys[i]);
        if (!yarn && v[i])
            return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s.%s' is set but '%s.rope_type' is \"default\"", path, label, keys[i], label);
    }
    if (yarn) {
        cfg->rope_factor = v[5]->valuedouble;
        cfg->original_seq_len = (int64_t)v[6]->valuedouble;
        cfg->beta_fast = v[7]->valuedouble;
        cfg->beta_slow = v[8]->valuedouble;
    }
    return DS4_OK;
}

/* rope_parameters: null/absent (no YaRN), the nested {"main": ..., "compress": ...} transformers
 * writes (YaRN only on the compressed layers, as in ds4), or one flat dict that holds the YaRN keys
 * of the compressed layers. */
static ds4_status parse_hf_rope(const cJSON *root, const char *path, ds4_config *cfg) {
    DS4_TRY(parse_rope_scaling(NULL, path, cfg));   /* the no-YaRN defaults */
    const cJSON *rp = get(root, "rope_parameters");
    if (!rp || cJSON_IsNull(rp)) return DS4_OK;
    if (!cJSON_IsObject(rp)) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'rope_parameters' must be an object or null", path);
    const cJSON *main = get(rp, "main"), *cmp = get(rp, "compress");
    if (!main && !cmp) return parse_rope_dict(root, rp, "rope_parameters", "rope_theta", true, path, cfg);
    for (const cJSON *c = rp->child; c; c = c->next) {
        bool known = !strcmp(c->string, "main") || !strcmp(c->string, "compress");
        bool leftover = (!strcmp(c->string, "rope_type") || !strcmp(c->string, "type")) && cJSON_IsString(c);
        if (!known && !leftover)
            return ds4_fail(DS4_ERR_CONFIG, "%s: unknown key 'rope_parameters.%.80s' (expected 'main' and 'compress')", path, c->string);
    }
    if (!main || !cmp)
        return ds4_fail(DS4_ERR_CONFIG, "%s: required key 'rope_parameters.%s' is missing", path, main ? "compress" : "main");
    DS4_TRY(parse_rope_dict(root, main, "rope_parameters.main", "rope_theta", false, path, cfg));
    return parse_rope_dict(root, cmp, "rope_parameters.compress", "compress_rope_theta", true, path, cfg);
}

/* ---------------------------------------------------------------- DSpark */

static const char *const k_dspark_keys[] = {"dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                                            "dspark_markov_rank"};

/* An integer DSpark key in [lo, hi], naming the key. */
static ds4_status dspark_int(const cJSON *root, const char *key, int64_t lo, int64_t hi, const char *path, int64_t *out) {
    int64_t v = get_int(root, key, 0);
    if (v < lo || v > hi)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key '%s' = %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]", path, key, v, lo, hi);
    *out = v;
    return DS4_OK;
}

/* The DSpark keys (all four or none). dspark_target_layer_ids: 1 to DS4_MAX_DSPARK_STAGES main layers,
 * strictly increasing (DeepSpec's rule; -1, the embedding output, is allowed as DeepSpec allows it); one
 * drafter stage per entry. The stages own the checkpoint's mtp.* names, so the NextN block the config
 * declares (num_nextn_predict_layers: 1 in 0731) has no tensors: ds4 keeps the declared count to write
 * it back and runs no MTP block. */
static ds4_status parse_dspark(const cJSON *root, const char *path, ds4_config *cfg) {
    int have = 0;
    for (int i = 0; i < 4; i++) have += get(root, k_dspark_keys[i]) != NULL;
    if (have == 0) return DS4_OK;
    for (int i = 0; have < 4 && i < 4; i++)
        if (!get(root, k_dspark_keys[i]))
            return ds4_fail(DS4_ERR_CONFIG, "%s: required key '%s' is missing (the DSpark keys dspark_block_size, "
                            "dspark_noise_token_id, dspark_target_layer_ids and dspark_markov_rank come together)", path,
                            k_dspark_keys[i]);
    DS4_TRY(dspark_int(root, "dspark_block_size", 1, 256, path, &cfg->dspark_block_size));
    DS4_TRY(dspark_int(root, "dspark_noise_token_id", 0, cfg->vocab_size - 1, path, &cfg->dspark_noise_token_id));
    DS4_TRY(dspark_int(root, "dspark_markov_rank", 1, 1 << 16, path, &cfg->dspark_markov_rank));
    int64_t n = 0;
    for (const cJSON *c = get(root, "dspark_target_layer_ids")->child; c; c = c->next, n++) {
        if (n >= DS4_MAX_DSPARK_STAGES)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'dspark_target_layer_ids' has more than %d entries", path, DS4_MAX_DSPARK_STAGES);
        int64_t id = is_int(c) ? (int64_t)c->valuedouble : INT64_MIN;
        if (id < -1 || id >= cfg->n_layers)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'dspark_target_layer_ids' entry %" PRId64 " must be an integer in [-1, "
                            "num_hidden_layers = %" PRId64 ")", path, n, cfg->n_layers);
        if (n > 0 && id <= cfg->dspark_target_layer_ids[n - 1])
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'dspark_target_layer_ids' entry %" PRId64 " (%" PRId64 ") is not above "
                            "the one before; the ids must be strictly increasing", path, n, id);
        cfg->dspark_target_layer_ids[n] = id;
    }
    if (n == 0) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'dspark_target_layer_ids' is empty, needs one main layer per stage", path);
    cfg->dspark_n_stages = n;
    cfg->dspark_nextn_declared = cfg->n_mtp_layers;
    cfg->n_mtp_layers = 0;
    return DS4_OK;
}

/* ---------------------------------------------------------------- parse */

static ds4_status validate(const ds4_config *c, const char *path, bool hf);
static ds4_status check_ranges(const ds4_config *c, const char *path, bool hf);

/* compress_ratios: one integer per layer, main layers then MTP layers (DeepSeek's spelling). */
static ds4_status parse_ds_layers(const cJSON *root, const char *path, ds4_config *cfg) {
    int64_t nr = 0;
    for (const cJSON *c = get(root, "compress_ratios")->child; c; c = c->next, nr++) {
        if (nr >= DS4_MAX_LAYERS)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_ratios' has more than %d entries", path, DS4_MAX_LAYERS);
        if (!is_int(c)) return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_ratios' entry %" PRId64 " is not an integer", path, nr);
        cfg->compress_ratios[nr] = (int64_t)c->valuedouble;
    }
    if (cfg->dspark_n_stages > 0 && nr != cfg->n_layers + cfg->dspark_n_stages)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_ratios' has %" PRId64 " entries, expected num_hidden_layers + "
                        "one per DSpark stage (len(dspark_target_layer_ids)) = %" PRId64, path, nr,
                        cfg->n_layers + cfg->dspark_n_stages);
    if (nr != cfg->n_layers + cfg->n_mtp_layers + cfg->dspark_n_stages)
        return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_ratios' has %" PRId64 " entries, expected num_hidden_layers + "
                        "num_nextn_predict_layers = %" PRId64, path, nr, cfg->n_layers + cfg->n_mtp_layers);
    return DS4_OK;
}

/* The YaRN settings of two configs agree (without YaRN, factor and betas mean nothing). */
static bool same_yarn(const ds4_config *a, const ds4_config *b) {
    if (a->original_seq_len != b->original_seq_len) return false;
    return a->original_seq_len == 0 || (a->rope_factor == b->rope_factor && a->beta_fast == b->beta_fast &&
                                         a->beta_slow == b->beta_slow);
}

/* The four settings of the two spellings. Each is read from the spelling that gives it; given in both
 * (h: the transformers reading), the two must agree, else one error names both keys. */
static ds4_status parse_spellings(const cJSON *root, const char *path, ds4_config *cfg) {
    ds4_config h = *cfg;
    const bool ds_layers = get(root, "compress_ratios"), hf_layers = get(root, "layer_types");
    if (ds_layers) DS4_TRY(parse_ds_layers(root, path, cfg));
    if (hf_layers) DS4_TRY(parse_hf_layers(root, path, &h));
    for (int64_t l = 0; ds_layers && hf_layers && l < cfg->n_layers + cfg->n_mtp_layers + cfg->dspark_n_stages; l++)
        if (cfg->compress_ratios[l] != h.compress_ratios[l])
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'compress_ratios' entry %" PRId64 " is %" PRId64 ", but keys 'layer_types' + "
                            "'compress_rates' give %" PRId64 ": the two spellings disagree; keep one", path, l,
                            cfg->compress_ratios[l], h.compress_ratios[l]);
    if (!ds_layers) memcpy(cfg->compress_ratios, h.compress_ratios, sizeof cfg->compress_ratios);

    if (get(root, "mlp_layer_types")) {
        DS4_TRY(parse_hf_hash(root, path, &h));
        if (get(root, "num_hash_layers") && h.n_hash_layers != cfg->n_hash_layers)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'num_hash_layers' is %" PRId64 ", but key 'mlp_layer_types' has %" PRId64
                            " \"hash_moe\" layers: the two spellings disagree; keep one", path, cfg->n_hash_layers, h.n_hash_layers);
        cfg->n_hash_layers = h.n_hash_layers;
    }
    if (get(root, "partial_rotary_factor")) {
        DS4_TRY(parse_hf_rotary(root, path, &h));
        if (get(root, "qk_rope_head_dim") && h.rope_head_dim != cfg->rope_head_dim)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'qk_rope_head_dim' is %" PRId64 ", but key 'partial_rotary_factor' (%g) * "
                            "head_dim (%" PRId64 ") is %" PRId64 ": the two spellings disagree; keep one", path, cfg->rope_head_dim,
                            get_num(root, "partial_rotary_factor", 0), cfg->head_dim, h.rope_head_dim);
        cfg->rope_head_dim = h.rope_head_dim;
    }
    DS4_TRY(parse_rope_scaling(get(root, "rope_scaling"), path, cfg));
    if (get(root, "rope_parameters")) {
        DS4_TRY(parse_hf_rope(root, path, &h));
        if (get(root, "rope_scaling") && !same_yarn(cfg, &h))
            return ds4_fail(DS4_ERR_CONFIG, "%s: keys 'rope_scaling' and 'rope_parameters' give different YaRN settings "
                            "(original_max_position_embeddings %" PRId64 " vs %" PRId64 ", factor %g vs %g): the two spellings "
                            "disagree; keep one", path, cfg->original_seq_len, h.original_seq_len, cfg->rope_factor, h.rope_factor);
        cfg->original_seq_len = h.original_seq_len;
        cfg->rope_factor = h.rope_factor;
        cfg->beta_fast = h.beta_fast;
        cfg->beta_slow = h.beta_slow;
    }
    return DS4_OK;
}

/* The checked JSON object -> cfg (validated). *hf: it was in the transformers spelling. */
static ds4_status parse_root(const cJSON *root, const char *path, ds4_config *cfg, bool *hf) {
    memset(cfg, 0, sizeof *cfg);
    DS4_TRY(check_keys(root, path, hf));
    read_fields(root, cfg);
    DS4_TRY(check_ranges(cfg, path, *hf));   /* before any count is derived from them (validate repeats it) */
    DS4_TRY(parse_dspark(root, path, cfg));
    DS4_TRY(parse_spellings(root, path, cfg));

    DS4_TRY(check_fixed(root, path));
    const cJSON *ed = get(root, "expert_dtype");
    if (ed && cJSON_IsString(ed)) {
        if (strcmp(ed->valuestring, "fp4") == 0) cfg->expert_fp4 = true;
        else if (strcmp(ed->valuestring, "fp8") != 0)
            return ds4_fail(DS4_ERR_CONFIG, "%s: key 'expert_dtype' is \"%.40s\", expected \"fp4\", \"fp8\" or null", path, ed->valuestring);
    }
    DS4_TRY(parse_quant(get(root, "quantization_config"), path, cfg));
    return validate(cfg, path, *hf);
}

/* Parses text into a JSON object tree (*root, cJSON_Delete it) or fails naming path. */
static ds4_status parse_json(const char *json_text, size_t len, const char *path, cJSON **root) {
    *root = NULL;
    /* NUL-terminated copy: the parser must not run past the caller's buffer. */
    char *text = ds4_alloc(DS4_MEM_OTHER, len + 1);
    if (!text) return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    memcpy(text, json_text, len);
    text[len] = '\0';
    const char *end = NULL;
    const int64_t oom = ds4_alloc_failures(); /* cJSON says "invalid" also when it ran out of memory */
    cJSON *r = cJSON_ParseWithLengthOpts(text, len, &end, 0);
    ds4_status s = DS4_OK;
    if (!r && ds4_alloc_failures() != oom) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory parsing the JSON", path);
    else if (!r) {
        const char *at = cJSON_GetErrorPtr();
        size_t pos = at && at >= text && at <= text + len ? (size_t)(at - text) : 0;
        s = ds4_fail(DS4_ERR_FORMAT, "%s: not valid JSON (near byte %zu)", path, pos);
    }
    for (const char *q = end; s == DS4_OK && q && q < text + len; q++)
        if (*q != ' ' && *q != '\t' && *q != '\n' && *q != '\r')
            s = ds4_fail(DS4_ERR_FORMAT, "%s: trailing bytes after the JSON object (byte %zu)", path, (size_t)(q - text));
    if (s == DS4_OK && !cJSON_IsObject(r)) s = ds4_fail(DS4_ERR_FORMAT, "%s: top level is not a JSON object", path);
    ds4_free(text);
    if (s == DS4_OK) *root = r;
    else cJSON_Delete(r);
    return s;
}

ds4_status ds4_config_parse(const char *json_text, size_t len, const char *path, ds4_config *cfg) {
    memset(cfg, 0, sizeof *cfg);
    if (!path) path = "config";
    cJSON *root;
    DS4_TRY(parse_json(json_text, len, path, &root));
    bool hf;
    ds4_status s = parse_root(root, path, cfg, &hf);
    cJSON_Delete(root);
    return s;
}

ds4_status ds4_config_load(const char *path, ds4_config *cfg) {
    char *text;
    size_t len;
    DS4_TRY(ds4_read_file(path, &text, &len));
    ds4_status s = ds4_config_parse(text, len, path, cfg);
    ds4_free(text);
    return s;
}

/* ---------------------------------------------------------------- validation */

#define BAD(...) return ds4_fail(DS4_ERR_CONFIG, __VA_ARGS__)

/* Every integer setting within its range (the ranged keys of k_keys). */
static ds4_status check_ranges(const ds4_config *c, const char *path, bool hf) {
    for (int i = 0; i < N_KEYS; i++) {
        const config_key *r = &k_keys[i];
        if (!r->ranged) continue;
        int64_t v;
        memcpy(&v, (const char *)c + r->field, sizeof v);
        if (v < r->min || v > r->max)
            BAD("%s: key '%s' = %" PRId64 " is out of range [%" PRId64 ", %" PRId64 "]", path,
                hf && r->sp == SP_SUB && r->alt ? r->alt : r->key, v, r->min, r->max);
    }
    return DS4_OK;
}

/* The DSpark settings of a config built in code (parse_dspark checks a config.json the same way). */
static ds4_status validate_dspark(const ds4_config *c, const char *path) {
    if (c->dspark_n_stages == 0) return DS4_OK;
    if (c->dspark_n_stages < 0 || c->dspark_n_stages > DS4_MAX_DSPARK_STAGES)
        BAD("%s: key 'dspark_target_layer_ids' has %" PRId64 " entries, must have 1 to %d", path, c->dspark_n_stages,
            DS4_MAX_DSPARK_STAGES);
    if (c->n_mtp_layers != 0)
        BAD("%s: a DSpark config has no NextN block of its own (the stages are mtp.*), n_mtp_layers must be 0", path);
    if (c->dspark_nextn_declared < 0 || c->dspark_nextn_declared > 1)
        BAD("%s: key 'num_nextn_predict_layers' = %" PRId64 " is out of range [0, 1]", path, c->dspark_nextn_declared);
    if (c->n_layers + c->dspark_n_stages > DS4_MAX_LAYERS)
        BAD("%s: num_hidden_layers + the DSpark stages exceed %d", path, DS4_MAX_LAYERS);
    if (c->dspark_block_size < 1 || c->dspark_block_size > 256)
        BAD("%s: key 'dspark_block_size' = %" PRId64 " is out of range [1, 256]", path, c->dspark_block_size);
    if (c->dspark_noise_token_id < 0 || c->dspark_noise_token_id >= c->vocab_size)
        BAD("%s: key 'dspark_noise_token_id' = %" PRId64 " is out of range [0, %" PRId64 "]", path, c->dspark_noise_token_id,
            c->vocab_size - 1);
    if (c->dspark_markov_rank < 1 || c->dspark_markov_rank > (1 << 16))
        BAD("%s: key 'dspark_markov_rank' = %" PRId64 " is out of range [1, 65536]", path, c->dspark_markov_rank);
    for (int64_t s = 0; s < c->dspark_n_stages; s++) {
        int64_t id = c->dspark_target_layer_ids[s];
        if (id < -1 || id >= c->n_layers || (s > 0 && id <= c->dspark_target_layer_ids[s - 1]))
            BAD("%s: key 'dspark_target_layer_ids' entry %" PRId64 " (%" PRId64 ") must be in [-1, %" PRId64 ") and above the one "
                "before", path, s, id, c->n_layers);
    }
    return DS4_OK;
}

/* hf: name the transformers key where a message would name a DeepSeek-only one. */
static ds4_status validate(const ds4_config *c, const char *path, bool hf) {
    if (!path) path = "config";
    const char *rk = hf ? "partial_rotary_factor' * 'head_dim" : "qk_rope_head_dim";
    DS4_TRY(check_ranges(c, path, hf));   /* also keeps num_hidden_layers + num_nextn_predict_layers <= DS4_MAX_LAYERS */
    if (c->n_kv_heads != 1)
        BAD("%s: key 'num_key_value_heads' is %" PRId64 ", DeepSeek-V4 has one shared K=V head (must be 1)", path, c->n_kv_heads);
    if (c->rope_head_dim < 2 || c->rope_head_dim % 2 != 0)
        BAD("%s: key '%s' is %" PRId64 ", must be even and >= 2", path, rk, c->rope_head_dim);
    if (c->rope_head_dim > c->head_dim)
        BAD("%s: key '%s' (%" PRId64 ") exceeds head_dim (%" PRId64 ")", path, rk, c->rope_head_dim, c->head_dim);
    if (c->rope_head_dim > c->index_head_dim)
        BAD("%s: key '%s' (%" PRId64 ") exceeds index_head_dim (%" PRId64 ")", path, rk, c->rope_head_dim,
            c->index_head_dim);
    int64_t q_dim;   /* within range, so the product fits; checked all the same */
    if (!ds4_mul_i64(c->n_heads, c->head_dim, &q_dim))
        BAD("%s: num_attention_heads * head_dim overflows", path);
    if (q_dim % c->o_groups != 0)
        BAD("%s: key 'o_groups' (%" PRId64 ") does not divide num_attention_heads * head_dim = %" PRId64, path, c->o_groups, q_dim);
    DS4_TRY(validate_dspark(c, path));
    for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers + c->dspark_n_stages; l++) {
        int64_t r = c->compress_ratios[l];
        if (r < 0 || r == 1 || r > MAX_COMPRESS_RATIO)
            BAD("%s: key 'compress_ratios' entry %" PRId64 " is %" PRId64 ", must be 0 (window only) or in [2, %d]", path, l, r,
                MAX_COMPRESS_RATIO);
        if (l >= c->n_layers && r != 0)
            BAD("%s: key 'compress_ratios' entry %" PRId64 " (%s) is %" PRId64 ", must be 0 (sliding window only)", path, l,
                l < c->n_layers + c->n_mtp_layers ? "MTP layer" : "DSpark stage", r);
    }
    if (c->n_activated_experts > c->n_routed_experts)
        BAD("%s: key 'num_experts_per_tok' (%" PRId64 ") exceeds n_routed_experts (%" PRId64 ")", path, c->n_activated_experts,
            c->n_routed_experts);
    if (c->n_hash_layers < 0 || c->n_hash_layers > c->n_layers)
        BAD("%s: key 'num_hash_layers' is %" PRId64 ", must be in [0, num_hidden_layers = %" PRId64 "]", path, c->n_hash_layers,
            c->n_layers);
    if (!(c->hc_eps >= 0) || !isfinite(c->hc_eps)) BAD("%s: key 'hc_eps' is %g, must be finite and >= 0", path, c->hc_eps);
    if (!(c->norm_eps > 0) || !isfinite(c->norm_eps)) BAD("%s: key 'rms_norm_eps' is %g, must be finite and > 0", path, c->norm_eps);
    if (!(c->route_scale > 0) || !isfinite(c->route_scale))
        BAD("%s: key 'routed_scaling_factor' is %g, must be finite and > 0", path, c->route_scale);
    if (!(c->swiglu_limit >= 0) || !isfinite(c->swiglu_limit))
        BAD("%s: key 'swiglu_limit' is %g, must be finite and >= 0 (0 = no clamp)", path, c->swiglu_limit);
    if (!(c->rope_theta > 0) || !isfinite(c->rope_theta)) BAD("%s: key 'rope_theta' is %g, must be finite and > 0", path, c->rope_theta);
    if (!(c->compress_rope_theta > 0) || !isfinite(c->compress_rope_theta))
        BAD("%s: key 'compress_rope_theta' is %g, must be finite and > 0", path, c->compress_rope_theta);
    if (c->original_seq_len > 0) {
        if (!(c->rope_factor >= 1) || !isfinite(c->rope_factor))
            BAD("%s: key 'rope_scaling.factor' is %g, must be finite and >= 1", path, c->rope_factor);
        if (!(c->beta_slow > 0) || !(c->beta_fast >= c->beta_slow) || !isfinite(c->beta_fast))
            BAD("%s: keys 'rope_scaling.beta_fast' (%g) and 'beta_slow' (%g) must satisfy beta_fast >= beta_slow > 0", path,
                c->beta_fast, c->beta_slow);
    }
    if (c->bos_token_id < 0 || c->bos_token_id >= c->vocab_size)
        BAD("%s: key 'bos_token_id' is %" PRId64 ", must be in [0, vocab_size = %" PRId64 ")", path, c->bos_token_id, c->vocab_size);
    if (c->eos_token_id < 0 || c->eos_token_id >= c->vocab_size)
        BAD("%s: key 'eos_token_id' is %" PRId64 ", must be in [0, vocab_size = %" PRId64 ")", path, c->eos_token_id, c->vocab_size);
    if (!(c->mtp_loss_weight >= 0) || !isfinite(c->mtp_loss_weight))
        BAD("%s: key 'mtp_loss_weight' is %g, must be finite and >= 0", path, c->mtp_loss_weight);
    if (!(c->indexer_loss_coeff >= 0) || !isfinite(c->indexer_loss_coeff))
        BAD("%s: key 'indexer_loss_coeff' is %g, must be finite and >= 0", path, c->indexer_loss_coeff);
    return DS4_OK;
}

bool ds4_config_resume_field(int i, const char **key, size_t *offset, bool *is_float) {
    for (int k = 0; k < N_KEYS; k++)
        if (k_keys[k].resume && i-- == 0) {
            *key = k_keys[k].key;
            *offset = k_keys[k].field;
            *is_float = k_keys[k].type == T_F64;
            return true;
        }
    return false;
}

ds4_status ds4_config_validate(const ds4_config *c, const char *path) { return validate(c, path, false); }

/* ---------------------------------------------------------------- save */

/* cJSON_AddItemToObject that frees the item when it cannot go in (out of memory) instead of leaking it */
static void add_item(cJSON *o, const char *key, cJSON *item) {
    if (!cJSON_AddItemToObject(o, key, item)) cJSON_Delete(item);
}

/* DSpark key `key` of c into r (none without DSpark). */
static void save_dspark_key(cJSON *r, const ds4_config *c, const char *key) {
    if (c->dspark_n_stages == 0) return;
    if (!strcmp(key, "dspark_target_layer_ids")) {
        cJSON *ids = cJSON_AddArrayToObject(r, key);
        for (int64_t s = 0; s < c->dspark_n_stages; s++) {
            cJSON *id = cJSON_CreateNumber((double)c->dspark_target_layer_ids[s]);
            if (!cJSON_AddItemToArray(ids, id)) cJSON_Delete(id); /* ids NULL: out of memory, counted */
        }
        return;
    }
    int64_t v = !strcmp(key, "dspark_block_size") ? c->dspark_block_size
                : !strcmp(key, "dspark_noise_token_id") ? c->dspark_noise_token_id : c->dspark_markov_rank;
    cJSON_AddNumberToObject(r, key, (double)v);
}

/* Key k of c into r; the structured ones (compress_ratios, rope_scaling, quantization_config) and the
 * optional expert_dtype by hand. */
static void save_key(cJSON *r, const ds4_config *c, const config_key *k) {
    const char *f = (const char *)c + k->field;
    if (k->type == T_I64) {
        int64_t v;
        memcpy(&v, f, sizeof v);
        if (k->field == offsetof(ds4_config, n_mtp_layers) && c->dspark_n_stages > 0) v = c->dspark_nextn_declared;
        cJSON_AddNumberToObject(r, k->key, (double)v);
    } else if (k->type == T_F64) {
        double v;
        memcpy(&v, f, sizeof v);
        cJSON_AddNumberToObject(r, k->key, v);
    } else if (k->type == T_BOOL) {
        bool v;
        memcpy(&v, f, sizeof v);
        cJSON_AddBoolToObject(r, k->key, v);
    } else if (k->only && k->kind == J_BOOL) {
        cJSON_AddBoolToObject(r, k->key, strcmp(k->only, "true") == 0);
    } else if (k->only) {
        cJSON_AddStringToObject(r, k->key, k->only);
    } else if (!strcmp(k->key, "architectures")) {
        const char *arch[] = {"DeepseekV4ForCausalLM"};
        add_item(r, k->key, cJSON_CreateStringArray(arch, 1));
    } else if (!strcmp(k->key, "model_type")) {
        cJSON_AddStringToObject(r, k->key, "deepseek_v4");
    } else if (!strcmp(k->key, "expert_dtype")) {
        if (c->expert_fp4) cJSON_AddStringToObject(r, k->key, "fp4");
    } else if (!strcmp(k->key, "quantization_config")) {
        if (!c->quantized) return;
        cJSON *q = cJSON_AddObjectToObject(r, k->key);
        const int blk[2] = {128, 128};
        cJSON_AddStringToObject(q, "activation_scheme", "dynamic");
        cJSON_AddStringToObject(q, "fmt", "e4m3");
        cJSON_AddStringToObject(q, "quant_method", "fp8");
        cJSON_AddStringToObject(q, "scale_fmt", "ue8m0");
        add_item(q, "weight_block_size", cJSON_CreateIntArray(blk, 2));
    } else if (!strcmp(k->key, "rope_scaling")) {
        /* Written whenever it carries information, so load(save(cfg)) == cfg. */
        if (!(c->original_seq_len > 0 || c->rope_factor != 1.0 || c->beta_fast != 0.0 || c->beta_slow != 0.0)) return;
        cJSON *rs = cJSON_AddObjectToObject(r, k->key);
        cJSON_AddNumberToObject(rs, "beta_fast", c->beta_fast);
        cJSON_AddNumberToObject(rs, "beta_slow", c->beta_slow);
        cJSON_AddNumberToObject(rs, "factor", c->rope_factor);
        cJSON_AddNumberToObject(rs, "original_max_position_embeddings", (double)c->original_seq_len);
        cJSON_AddStringToObject(rs, "type", "yarn");
    } else if (!strncmp(k->key, "dspark_", 7)) {
        save_dspark_key(r, c, k->key);
    } else if (!strcmp(k->key, "compress_ratios")) {
        cJSON *cr = cJSON_AddArrayToObject(r, k->key);
        for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers + c->dspark_n_stages; l++) {
            cJSON *ratio = cJSON_CreateNumber((double)c->compress_ratios[l]);
            if (!cJSON_AddItemToArray(cr, ratio)) cJSON_Delete(ratio); /* cr NULL: out of memory, counted */
        }
    }
}

ds4_status ds4_config_save(const ds4_config *c, const char *path) {
    DS4_TRY(ds4_config_validate(c, path));
    const int64_t oom = ds4_alloc_failures(); /* a cJSON_Add* that failed leaves its key out */
    cJSON *r = cJSON_CreateObject();
    if (!r) return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    int last = 0;
    for (int i = 0; i < N_KEYS; i++) last = k_keys[i].save > last ? k_keys[i].save : last;
    for (int pos = 1; pos <= last; pos++)
        for (int i = 0; i < N_KEYS; i++)
            if (k_keys[i].save == pos) save_key(r, c, &k_keys[i]);
    char *text = cJSON_Print(r);
    cJSON_Delete(r);
    if (text && ds4_alloc_failures() != oom) cJSON_free(text), text = NULL;
    if (!text) return ds4_fail(DS4_ERR_OOM, "%s: out of memory printing the config", path);
    size_t n = strlen(text);
    /* end with a newline, like a hand-written file */
    ds4_status s = DS4_OK;
    char *buf = ds4_alloc(DS4_MEM_OTHER, n + 2);
    if (!buf) s = ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    else {
        memcpy(buf, text, n);
        buf[n] = '\n';
        s = ds4_write_file_atomic(path, buf, n + 1);
        ds4_free(buf);
    }
    cJSON_free(text);
    return s;
}

/* ---------------------------------------------------------------- respell */

/* The one HCA rate of c (compress_rates has one rate per layer type); 128 when no layer is HCA. */
static ds4_status hca_rate(const ds4_config *c, const char *path, int64_t *rate) {
    int64_t first = -1;
    *rate = 128;
    for (int64_t l = 0; l < c->n_layers; l++) {
        int64_t r = c->compress_ratios[l];
        if (r == 0 || r == 4) continue;
        if (first >= 0 && r != *rate)
            return ds4_fail(DS4_ERR_CONFIG, "%s: layers %" PRId64 " and %" PRId64 " compress by %" PRId64 " and %" PRId64 "; the "
                            "transformers spelling has one rate for all %s layers", path, first, l, *rate, r, k_hca);
        if (first < 0) first = l, *rate = r;
    }
    return DS4_OK;
}

static void add_num(cJSON *o, const char *k, double v) { cJSON_AddNumberToObject(o, k, v); }

/* A number JSON readers take as a float: an integral value with ".0" (cJSON prints 1.0 as 1, which
 * Python reads as an int), any other with the shortest digits that read back to the same double. */
static cJSON *float_item(double x) {
    char buf[40];
    if (!isfinite(x)) return cJSON_CreateNumber(x);
    if (x == floor(x) && fabs(x) < 1e15) snprintf(buf, sizeof buf, "%.1f", x);
    else
        for (int digits = 1; digits <= 17; digits++) {
            snprintf(buf, sizeof buf, "%.*g", digits, x);
            if (strtod(buf, NULL) == x) break;
        }
    return cJSON_CreateRaw(buf);
}

/* Key `key` of o as a float. A raw item: it prints, but parses no more (the last step before printing). */
static void float_key(cJSON *o, const char *key) {
    const cJSON *v = get(o, key);
    if (cJSON_IsNumber(v)) cJSON_ReplaceItemInObjectCaseSensitive(o, key, float_item(v->valuedouble));
}

void ds4_config_json_floats(cJSON *root) {
    static const char *const keys[] = {"swiglu_limit", "routed_scaling_factor", "hc_eps", "rms_norm_eps", "partial_rotary_factor",
                                       "router_aux_loss_coef", "router_jitter_noise", "attention_dropout", "initializer_range"};
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) float_key(root, keys[i]);
    const cJSON *rp = get(root, "rope_parameters");
    for (cJSON *d = cJSON_IsObject(rp) ? rp->child : NULL; d; d = d->next)
        if (cJSON_IsObject(d)) float_key(d, "attention_factor"), float_key(d, "partial_rotary_factor");
    if (cJSON_IsObject(rp)) float_key((cJSON *)rp, "attention_factor");
}

/* layer_types + compress_rates: each main layer's attention and the two rates. */
static void add_layer_types(cJSON *r, const ds4_config *c, int64_t hca) {
    cJSON *lt = cJSON_AddArrayToObject(r, "layer_types");
    for (int64_t l = 0; l < c->n_layers; l++) {
        int64_t x = c->compress_ratios[l];
        cJSON_AddItemToArray(lt, cJSON_CreateString(x == 0 ? k_swa : x == 4 ? k_csa : k_hca));
    }
    cJSON *cr = cJSON_AddObjectToObject(r, "compress_rates");
    add_num(cr, k_csa, 4);
    add_num(cr, k_hca, (double)hca);
}

static void add_hf_spelling(cJSON *r, const ds4_config *c, int64_t hca) {
    add_layer_types(r, c, hca);
    cJSON *mt = cJSON_AddArrayToObject(r, "mlp_layer_types");
    for (int64_t l = 0; l < c->n_layers; l++) cJSON_AddItemToArray(mt, cJSON_CreateString(l < c->n_hash_layers ? "hash_moe" : "moe"));
    double prf = (double)c->rope_head_dim / (double)c->head_dim;
    add_num(r, "partial_rotary_factor", prf);
    cJSON *rp = cJSON_AddObjectToObject(r, "rope_parameters");
    cJSON *m = cJSON_AddObjectToObject(rp, "main");
    cJSON_AddStringToObject(m, "rope_type", "default");
    add_num(m, "rope_theta", c->rope_theta);
    add_num(m, "partial_rotary_factor", prf);
    /* YaRN on the compressed layers only, and without an attention factor, as in ds4 */
    cJSON *k = cJSON_AddObjectToObject(rp, "compress");
    cJSON_AddStringToObject(k, "rope_type", c->original_seq_len > 0 ? "yarn" : "default");
    add_num(k, "rope_theta", c->compress_rope_theta);
    add_num(k, "partial_rotary_factor", prf);
    if (c->original_seq_len > 0) {
        add_num(k, "factor", c->rope_factor);
        add_num(k, "original_max_position_embeddings", (double)c->original_seq_len);
        add_num(k, "beta_fast", c->beta_fast);
        add_num(k, "beta_slow", c->beta_slow);
        add_num(k, "attention_factor", 1.0);
    }
    cJSON_DeleteItemFromObjectCaseSensitive(r, "model_type");
    cJSON_AddStringToObject(r, "model_type", "deepseek_v4");
}

static void add_ds_spelling(cJSON *r, const ds4_config *c) {
    cJSON *cr = cJSON_AddArrayToObject(r, "compress_ratios");
    for (int64_t l = 0; l < c->n_layers + c->n_mtp_layers + c->dspark_n_stages; l++)
        cJSON_AddItemToArray(cr, cJSON_CreateNumber((double)c->compress_ratios[l]));
    add_num(r, "num_hash_layers", (double)c->n_hash_layers);
    add_num(r, "qk_rope_head_dim", (double)c->rope_head_dim);
    if (c->original_seq_len > 0) {
        cJSON *rs = cJSON_AddObjectToObject(r, "rope_scaling");
        add_num(rs, "beta_fast", c->beta_fast);
        add_num(rs, "beta_slow", c->beta_slow);
        add_num(rs, "factor", c->rope_factor);
        add_num(rs, "original_max_position_embeddings", (double)c->original_seq_len);
        cJSON_AddStringToObject(rs, "type", "yarn");
    }
}

/* YaRN factor and betas do nothing without original_seq_len; neither spelling needs to keep them. */
static bool same_model(ds4_config a, ds4_config b) {
    if (a.original_seq_len == 0) a.rope_factor = b.rope_factor = 1.0, a.beta_fast = b.beta_fast = a.beta_slow = b.beta_slow = 0.0;
    return memcmp(&a, &b, sizeof a) == 0;
}

ds4_status ds4_config_json_respell(cJSON *root, bool hf, const char *path) {
    if (!path) path = "config";
    if (!cJSON_IsObject(root)) return ds4_fail(DS4_ERR_FORMAT, "%s: top level is not a JSON object", path);
    ds4_config c, back;
    bool was_hf, now_hf;
    DS4_TRY(parse_root(root, path, &c, &was_hf));
    bool other = false; /* a key of the other spelling (a config may give a setting in both) */
    for (int i = 0; i < N_KEYS; i++) other |= k_keys[i].sp == (hf ? SP_DS : SP_HF) && get(root, k_keys[i].key);
    if (was_hf == hf && !other) return DS4_OK;
    int64_t hca = 128;
    if (hf) DS4_TRY(hca_rate(&c, path, &hca));
    for (int i = 0; i < N_KEYS; i++) /* both spellings out, the target's back in */
        if (k_keys[i].sp == SP_DS || k_keys[i].sp == SP_HF) cJSON_DeleteItemFromObjectCaseSensitive(root, k_keys[i].key);
    if (hf) add_hf_spelling(root, &c, hca);
    else add_ds_spelling(root, &c);
    /* the rewrite must read back as the same model */
    DS4_TRY(parse_root(root, path, &back, &now_hf));
    if (now_hf != hf || !same_model(c, back))
        return ds4_fail(DS4_ERR_CONFIG, "%s: the %s spelling of this config does not read back as the same model", path,
                        hf ? "transformers" : "DeepSeek");
    return DS4_OK;
}

ds4_status ds4_config_json_add_layer_types(cJSON *root, const char *path, bool *added) {
    if (!path) path = "config";
    *added = false;
    if (!cJSON_IsObject(root)) return ds4_fail(DS4_ERR_FORMAT, "%s: top level is not a JSON object", path);
    ds4_config c, back;
    bool hf;
    DS4_TRY(parse_root(root, path, &c, &hf));
    int64_t hca;
    if (hca_rate(&c, path, &hca) != DS4_OK) return DS4_OK; /* HCA layers of two rates: transformers has one */
    cJSON_DeleteItemFromObjectCaseSensitive(root, "layer_types");
    cJSON_DeleteItemFromObjectCaseSensitive(root, "compress_rates");
    add_layer_types(root, &c, hca);
    DS4_TRY(parse_root(root, path, &back, &hf));
    if (!same_model(c, back))
        return ds4_fail(DS4_ERR_CONFIG, "%s: layer_types + compress_rates do not read back as the same model", path);
    *added = true;
    return DS4_OK;
}
