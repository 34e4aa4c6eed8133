/* Tokenizers: the byte tokenizer and Hugging Face byte-level BPE (tokenizer.json).
 *
 * Encoding runs in three stages, as the HF library does:
 *   1. added tokens are found in the raw text (leftmost, longest first) and emitted as-is;
 *   2. each stretch between them goes through the pre-tokenizer steps (Split regexes, ByteLevel,
 *      Digits), each step cutting every piece of the previous step into smaller pieces;
 *   3. every final piece is BPE-merged: start from one symbol per byte, repeatedly merge the
 *      adjacent pair with the lowest merge rank (leftmost first among equals).
 * Byte-level BPE vocab strings spell bytes through the GPT-2 byte->unicode map; we undo that map
 * when loading, so BPE and decode work on plain bytes. */
#include "ds4/tokenizer.h"
#include "ds4/io.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <pcre2.h>

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define MAX_STEPS 16

enum { STEP_SPLIT, STEP_BYTELEVEL };
enum { B_ISOLATED, B_REMOVED, B_MERGED_PREV, B_MERGED_NEXT, B_CONTIGUOUS };

/* The pre-tokenisation regex of GPT-2, used by ByteLevel when use_regex is true. */
static const char *k_gpt2_regex =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

typedef struct {
    int type;
    pcre2_code *re;        /* the split regex (NULL: ByteLevel without regex) */
    int behavior;
    bool invert;
    bool add_prefix_space; /* ByteLevel */
} pretok_step;

typedef struct {
    char *s;
    int64_t n;
    int32_t id;
} added_tok;

struct ds4_tokenizer {
    char *name;
    int64_t vocab_size;
    int32_t bos, eos;
    char **tok;             /* [vocab_size] bytes of each id; NULL for ids without a token */
    int64_t *tok_len;       /* [vocab_size] */
    bool *tok_mergeable;    /* [vocab_size] reachable by BPE (a byte-level vocab entry) */
    int32_t byte_id[256];   /* id of the one-byte token of each byte */
    int32_t *map;           /* bytes -> id hash (mergeable tokens), open addressing, -1 = empty */
    int64_t map_cap;
    uint64_t *pair_key;     /* merges: (left << 32 | right), UINT64_MAX = empty */
    int32_t *pair_rank, *pair_out;
    int64_t pair_cap, n_merges;
    bool ignore_merges;
    added_tok *added;       /* sorted longest first */
    int64_t n_added;
    bool added_start[256];  /* some added token starts with this byte */
    int16_t cp2byte[512];   /* GPT-2 map, inverted: code point -> byte, -1 = none */
    pretok_step steps[MAX_STEPS];
    int n_steps;
};

/* ---------------------------------------------------------------- small helpers */

void ds4_tokens_free(ds4_tokens *t) {
    ds4_free(t->ids);
    t->ids = NULL;
    t->n = t->cap = 0;
}

ds4_status ds4_tokens_push(ds4_tokens *t, int32_t id) {
    if (t->n == t->cap && !ds4_grow((void **)&t->ids, &t->cap, t->n + 1, sizeof(int32_t)))
        return ds4_fail(DS4_ERR_OOM, "out of memory growing a token list to %lld ids", (long long)t->n + 1);
    t->ids[t->n++] = id;
    return DS4_OK;
}

static uint64_t hash_bytes(const char *s, int64_t n) {
    uint64_t h = 0xcbf29ce484222325ULL;
    for (int64_t i = 0; i < n; i++) h = (h ^ (uint8_t)s[i]) * 0x100000001b3ULL;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

/* Length of the UTF-8 character at s (1 for an invalid byte), never past end. */
static int64_t char_len(const unsigned char *s, const unsigned char *end) {
    int n = s[0] < 0xc0 ? 1 : s[0] < 0xe0 ? 2 : s[0] < 0xf0 ? 3 : 4;
    if (end - s < n) return 1;
    for (int i = 1; i < n; i++)
        if ((s[i] & 0xc0) != 0x80) return 1;
    return n;
}

/* ---------------------------------------------------------------- GPT-2 byte <-> unicode map */

/* Printable bytes stand for themselves; the other 68 bytes take code points 256, 257, ... */
static uint32_t byte_to_cp(int b) {
    uint32_t next = 256;
    for (int i = 0; i < 256; i++) {
        bool keep = (i >= 0x21 && i <= 0x7e) || (i >= 0xa1 && i <= 0xac) || (i >= 0xae && i <= 0xff);
        if (i == b) return keep ? (uint32_t)i : next;
        if (!keep) next++;
    }
    return 0;
}

static void build_cp_table(int16_t cp2byte[512]) {
    for (int i = 0; i < 512; i++) cp2byte[i] = -1;
    for (int b = 0; b < 256; b++) cp2byte[byte_to_cp(b)] = (int16_t)b;
}

/* A byte-level vocab string -> its bytes (out has room for n bytes). False when some character is
 * not in the map (the token is not reachable by BPE, e.g. a special token in the vocab). */
static bool unmap_bytelevel(const int16_t cp2byte[512], const char *s, int64_t n, char *out, int64_t *out_n) {
    const unsigned char *p = (const unsigned char *)s, *end = p + n;
    int64_t k = 0;
    while (p < end) {
        uint32_t cp;
        int len;
        if (p[0] < 0x80) cp = p[0], len = 1;
        else if ((p[0] & 0xe0) == 0xc0 && end - p >= 2) cp = ((uint32_t)(p[0] & 0x1f) << 6) | (p[1] & 0x3f), len = 2;
        else return false; /* every mapped code point is < 512: one or two bytes */
        int b = cp < 512 ? cp2byte[cp] : -1;
        if (b < 0) return false;
        out[k++] = (char)b;
        p += len;
    }
    *out_n = k;
    return true;
}

/* ---------------------------------------------------------------- tables */

static int32_t map_find(const ds4_tokenizer *t, const char *s, int64_t n) {
    if (!t->map_cap) return -1;
    uint64_t mask = (uint64_t)t->map_cap - 1;
    for (uint64_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = t->map[i];
        if (id < 0) return -1;
        if (t->tok_len[id] == n && memcmp(t->tok[id], s, (size_t)n) == 0) return id;
    }
}

static void map_insert(ds4_tokenizer *t, int32_t id) {
    uint64_t mask = (uint64_t)t->map_cap - 1;
    uint64_t i = hash_bytes(t->tok[id], t->tok_len[id]) & mask;
    while (t->map[i] >= 0) i = (i + 1) & mask;
    t->map[i] = id;
}

/* Merge (left, right) -> index into pair_* or -1. */
static int64_t pair_find(const ds4_tokenizer *t, int32_t left, int32_t right) {
    if (!t->pair_cap) return -1;
    uint64_t key = ((uint64_t)(uint32_t)left << 32) | (uint32_t)right;
    uint64_t mask = (uint64_t)t->pair_cap - 1;
    for (uint64_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
        if (t->pair_key[i] == UINT64_MAX) return -1;
        if (t->pair_key[i] == key) return (int64_t)i;
    }
}

static int64_t pow2_at_least(int64_t n) {
    int64_t c = 16;
    while (c < n) c *= 2;
    return c;
}

/* ---------------------------------------------------------------- lifetime */

void ds4_tokenizer_free(ds4_tokenizer *t) {
    if (!t) return;
    for (int64_t i = 0; i < t->vocab_size && t->tok; i++) ds4_free(t->tok[i]);
    ds4_free(t->tok);
    ds4_free(t->tok_len);
    ds4_free(t->tok_mergeable);
    ds4_free(t->map);
    ds4_free(t->pair_key);
    ds4_free(t->pair_rank);
    ds4_free(t->pair_out);
    for (int64_t i = 0; i < t->n_added; i++) ds4_free(t->added[i].s);
    ds4_free(t->added);
    for (int i = 0; i < t->n_steps; i++) pcre2_code_free(t->steps[i].re);
    ds4_free(t->name);
    ds4_free(t);
}

static ds4_status alloc_vocab(ds4_tokenizer *t, int64_t vocab_size) {
    t->vocab_size = vocab_size;
    t->tok = ds4_calloc(DS4_MEM_OTHER, (size_t)vocab_size * sizeof(char *));
    t->tok_len = ds4_calloc(DS4_MEM_OTHER, (size_t)vocab_size * sizeof(int64_t));
    t->tok_mergeable = ds4_calloc(DS4_MEM_OTHER, (size_t)vocab_size * sizeof(bool));
    if (!t->tok || !t->tok_len || !t->tok_mergeable)
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory for a vocab of %lld", t->name, (long long)vocab_size);
    return DS4_OK;
}

static ds4_status build_map(ds4_tokenizer *t) {
    t->map_cap = pow2_at_least(2 * t->vocab_size + 1);
    t->map = ds4_alloc(DS4_MEM_OTHER, (size_t)t->map_cap * sizeof(int32_t));
    if (!t->map) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for the vocab table", t->name);
    for (int64_t i = 0; i < t->map_cap; i++) t->map[i] = -1;
    for (int64_t id = 0; id < t->vocab_size; id++)
        if (t->tok_mergeable[id] && map_find(t, t->tok[id], t->tok_len[id]) < 0) map_insert(t, (int32_t)id);
    return DS4_OK;
}

static int cmp_added_longest_first(const void *a, const void *b) {
    const added_tok *x = a, *y = b;
    if (x->n != y->n) return x->n > y->n ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

static void index_added(ds4_tokenizer *t) {
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, cmp_added_longest_first);
    memset(t->added_start, 0, sizeof t->added_start);
    for (int64_t i = 0; i < t->n_added; i++) t->added_start[(uint8_t)t->added[i].s[0]] = true;
}

ds4_status ds4_tokenizer_byte(ds4_tokenizer **out) {
    *out = NULL;
    ds4_tokenizer *t = ds4_calloc(DS4_MEM_OTHER, sizeof *t);
    if (!t || !(t->name = ds4_strndup("byte", 4))) {
        ds4_free(t);
        return ds4_fail(DS4_ERR_OOM, "byte tokenizer: out of memory");
    }
    ds4_status st = alloc_vocab(t, 258);
    static const char *specials[2] = {"<|begin_of_text|>", "<|end_of_text|>"};
    t->added = st ? NULL : ds4_calloc(DS4_MEM_OTHER, 2 * sizeof(added_tok));
    if (!st && !t->added) st = ds4_fail(DS4_ERR_OOM, "byte tokenizer: out of memory");
    for (int b = 0; b < 256 && !st; b++) {
        char c = (char)b;
        if (!(t->tok[b] = ds4_strndup(&c, 1))) st = ds4_fail(DS4_ERR_OOM, "byte tokenizer: out of memory");
        t->tok_len[b] = 1;
        t->tok_mergeable[b] = true;
        t->byte_id[b] = b;
    }
    for (int i = 0; i < 2 && !st; i++) {
        size_t n = strlen(specials[i]);
        t->tok[256 + i] = ds4_strndup(specials[i], n);
        t->added[i].s = ds4_strndup(specials[i], n);
        if (!t->tok[256 + i] || !t->added[i].s) { st = ds4_fail(DS4_ERR_OOM, "byte tokenizer: out of memory"); break; }
        t->tok_len[256 + i] = (int64_t)n;
        t->added[i].n = (int64_t)n;
        t->added[i].id = 256 + i;
        t->n_added = i + 1;
    }
    if (st) {
        ds4_tokenizer_free(t);
        return st;
    }
    index_added(t);
    t->bos = 256;
    t->eos = 257;
    *out = t;
    return DS4_OK;
}

/* ---------------------------------------------------------------- tokenizer.json */

static ds4_status jfail(const ds4_tokenizer *t, ds4_status code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static ds4_status jfail(const ds4_tokenizer *t, ds4_status code, const char *fmt, ...) {
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    for (char *p = msg; *p; p++) /* token text may hold control characters: keep the message on one line */
        if ((unsigned char)*p < 0x20) *p = '?';
    return ds4_fail(code, "%s: %s", t->name, msg);
}

static const char *jstr(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

static bool jbool(const cJSON *o, const char *key, bool def) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsBool(v) ? cJSON_IsTrue(v) : def;
}

/* Ids above this are taken for corruption rather than allocating tables for them. */
#define MAX_TOKEN_ID ((1 << 24) - 1)

/* A JSON number that is a token id. */
static bool jid(const cJSON *v, int32_t *id) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0 && d <= MAX_TOKEN_ID) || d != (double)(int64_t)d) return false;
    *id = (int32_t)d;
    return true;
}

static ds4_status compile_regex(ds4_tokenizer *t, const char *where, const char *pat, size_t n, bool literal,
                                pcre2_code **out) {
    int err;
    PCRE2_SIZE off;
    /* UCP: \s, \w and friends mean their Unicode classes, as in the HF library's regex engine */
    uint32_t opts = PCRE2_UTF | PCRE2_MATCH_INVALID_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pat, n, opts, &err, &off, NULL);
    if (!re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof msg);
        return jfail(t, DS4_ERR_FORMAT, "%s: regex does not compile at offset %zu: %s", where, (size_t)off, (char *)msg);
    }
    pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* best effort: without JIT the interpreter runs */
    *out = re;
    return DS4_OK;
}

static ds4_status add_step(ds4_tokenizer *t, const char *where, pretok_step s) {
    if (t->n_steps == MAX_STEPS) {
        pcre2_code_free(s.re);
        return jfail(t, DS4_ERR_UNSUPPORTED, "%s: more than %d pre-tokenizer steps", where, MAX_STEPS);
    }
    t->steps[t->n_steps++] = s;
    return DS4_OK;
}

static ds4_status parse_pretok(ds4_tokenizer *t, const cJSON *j, const char *where, int depth, bool *bytelevel) {
    if (!j || cJSON_IsNull(j)) return DS4_OK;
    const char *type = jstr(j, "type");
    if (!cJSON_IsObject(j) || !type) return jfail(t, DS4_ERR_FORMAT, "%s: expected an object with a \"type\"", where);
    char sub[256];
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(j, "pretokenizers");
        if (!cJSON_IsArray(list)) return jfail(t, DS4_ERR_FORMAT, "%s.pretokenizers: expected an array", where);
        if (depth > 4) return jfail(t, DS4_ERR_UNSUPPORTED, "%s: Sequence nested too deeply", where);
        int i = 0;
        const cJSON *it;
        cJSON_ArrayForEach(it, list) {
            snprintf(sub, sizeof sub, "%s.pretokenizers[%d]", where, i++);
            DS4_TRY(parse_pretok(t, it, sub, depth + 1, bytelevel));
        }
        return DS4_OK;
    }
    pretok_step s = {0};
    if (strcmp(type, "Split") == 0) {
        const cJSON *pat = cJSON_GetObjectItemCaseSensitive(j, "pattern");
        const char *re = jstr(pat, "Regex"), *lit = jstr(pat, "String");
        if (!cJSON_IsObject(pat) || (!re && !lit))
            return jfail(t, DS4_ERR_FORMAT, "%s.pattern: expected {\"Regex\": ...} or {\"String\": ...}", where);
        const char *beh = jstr(j, "behavior");
        static const char *names[] = {"Isolated", "Removed", "MergedWithPrevious", "MergedWithNext", "Contiguous"};
        s.behavior = -1;
        for (int b = 0; b < 5; b++)
            if (beh && strcmp(beh, names[b]) == 0) s.behavior = b;
        if (s.behavior < 0)
            return jfail(t, DS4_ERR_FORMAT, "%s.behavior: expected Isolated, Removed, MergedWithPrevious, MergedWithNext "
                                            "or Contiguous, got %s", where, beh ? beh : "nothing");
        s.type = STEP_SPLIT;
        s.invert = jbool(j, "invert", false);
        snprintf(sub, sizeof sub, "%s.pattern", where);
        const char *p = re ? re : lit;
        DS4_TRY(compile_regex(t, sub, p, strlen(p), !re, &s.re));
        return add_step(t, where, s);
    }
    if (strcmp(type, "ByteLevel") == 0) {
        s.type = STEP_BYTELEVEL;
        s.behavior = B_ISOLATED;
        s.add_prefix_space = jbool(j, "add_prefix_space", true);
        if (jbool(j, "use_regex", true)) DS4_TRY(compile_regex(t, where, k_gpt2_regex, strlen(k_gpt2_regex), false, &s.re));
        *bytelevel = true;
        return add_step(t, where, s);
    }
    if (strcmp(type, "Digits") == 0) {
        s.type = STEP_SPLIT;
        s.behavior = jbool(j, "individual_digits", false) ? B_ISOLATED : B_CONTIGUOUS;
        DS4_TRY(compile_regex(t, where, "\\p{N}", 5, false, &s.re));
        return add_step(t, where, s);
    }
    return jfail(t, DS4_ERR_UNSUPPORTED, "%s: pre-tokenizer type \"%s\" is not supported (ByteLevel, Split, Digits, "
                                         "Sequence are)", where, type);
}

static ds4_status parse_vocab(ds4_tokenizer *t, const cJSON *model, const cJSON *added) {
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsObject(vocab)) return jfail(t, DS4_ERR_FORMAT, "model.vocab: expected an object of token: id");
    int64_t max_id = -1;
    const cJSON *it;
    cJSON_ArrayForEach(it, vocab) {
        int32_t id;
        if (!jid(it, &id)) return jfail(t, DS4_ERR_FORMAT, "model.vocab[\"%.80s\"]: expected an integer id in [0, %d]", it->string, MAX_TOKEN_ID);
        if (id > max_id) max_id = id;
    }
    if (cJSON_IsArray(added)) {
        int i = 0;
        cJSON_ArrayForEach(it, added) {
            int32_t id;
            const char *content = jstr(it, "content");
            if (!jid(cJSON_GetObjectItemCaseSensitive(it, "id"), &id) || !content || !*content)
                return jfail(t, DS4_ERR_FORMAT, "added_tokens[%d]: expected {\"id\": integer in [0, %d], \"content\": non-empty string}", i, MAX_TOKEN_ID);
            if (id > max_id) max_id = id;
            i++;
        }
    } else if (added && !cJSON_IsNull(added)) {
        return jfail(t, DS4_ERR_FORMAT, "added_tokens: expected an array");
    }
    if (max_id < 0) return jfail(t, DS4_ERR_FORMAT, "model.vocab: empty vocabulary");
    DS4_TRY(alloc_vocab(t, max_id + 1));
    cJSON_ArrayForEach(it, vocab) {
        int32_t id = 0;
        jid(it, &id); /* checked above */
        if (t->tok[id]) return jfail(t, DS4_ERR_FORMAT, "model.vocab[\"%.80s\"]: id %d is used twice", it->string, id);
        int64_t n = (int64_t)strlen(it->string), bn;
        if (!(t->tok[id] = ds4_alloc(DS4_MEM_OTHER, (size_t)n + 1))) return jfail(t, DS4_ERR_OOM, "out of memory");
        if (unmap_bytelevel(t->cp2byte, it->string, n, t->tok[id], &bn)) {
            t->tok_len[id] = bn;
            t->tok_mergeable[id] = true;
        } else { /* not byte-level: keep its text for decode */
            memcpy(t->tok[id], it->string, (size_t)n);
            t->tok_len[id] = n;
        }
        t->tok[id][t->tok_len[id]] = 0;
    }
    if (cJSON_IsArray(added)) {
        int64_t n_added = cJSON_GetArraySize(added);
        t->added = ds4_calloc(DS4_MEM_OTHER, (size_t)n_added * sizeof(added_tok));
        if (n_added && !t->added) return jfail(t, DS4_ERR_OOM, "out of memory");
        cJSON_ArrayForEach(it, added) {
            int32_t id = 0;
            jid(cJSON_GetObjectItemCaseSensitive(it, "id"), &id); /* checked above */
            const char *content = jstr(it, "content");
            int64_t n = (int64_t)strlen(content);
            /* an added token either takes a fresh id or names the vocab token that has its id */
            if (t->tok[id] && (t->tok_len[id] != n || memcmp(t->tok[id], content, (size_t)n) != 0))
                return jfail(t, DS4_ERR_FORMAT, "added_tokens[%lld]: id %d is already the vocab token \"%.*s\"",
                             (long long)t->n_added, id, (int)(t->tok_len[id] < 80 ? t->tok_len[id] : 80), t->tok[id]);
            added_tok *a = &t->added[t->n_added];
            if (!(a->s = ds4_strndup(content, (size_t)n))) return jfail(t, DS4_ERR_OOM, "out of memory");
            a->n = n;
            a->id = id;
            t->n_added++;
            ds4_free(t->tok[id]); /* an added token decodes to its content */
            if (!(t->tok[id] = ds4_strndup(content, (size_t)n))) return jfail(t, DS4_ERR_OOM, "out of memory");
            t->tok_len[id] = n;
            t->tok_mergeable[id] = false;
        }
        index_added(t);
    }
    DS4_TRY(build_map(t));
    for (int b = 0; b < 256; b++) { /* -1: a vocab trained without the full byte alphabet; encode then refuses it */
        char c = (char)b;
        t->byte_id[b] = map_find(t, &c, 1);
    }
    return DS4_OK;
}

/* A merge's side ("a" of "a b") -> id. */
static ds4_status merge_side(ds4_tokenizer *t, int64_t i, const char *s, int64_t n, int32_t *id) {
    char buf[1024];
    int64_t bn;
    if (n > (int64_t)sizeof buf || !unmap_bytelevel(t->cp2byte, s, n, buf, &bn) || (*id = map_find(t, buf, bn)) < 0)
        return jfail(t, DS4_ERR_FORMAT, "model.merges[%lld]: \"%.*s\" is not a byte-level token of model.vocab",
                     (long long)i, (int)(n < 80 ? n : 80), s);
    return DS4_OK;
}

static ds4_status parse_merges(ds4_tokenizer *t, const cJSON *model) {
    const cJSON *merges = cJSON_GetObjectItemCaseSensitive(model, "merges");
    if (!merges || cJSON_IsNull(merges)) return DS4_OK;
    if (!cJSON_IsArray(merges)) return jfail(t, DS4_ERR_FORMAT, "model.merges: expected an array");
    int64_t n = cJSON_GetArraySize(merges);
    t->pair_cap = pow2_at_least(2 * n + 1);
    t->pair_key = ds4_alloc(DS4_MEM_OTHER, (size_t)t->pair_cap * sizeof(uint64_t));
    t->pair_rank = ds4_alloc(DS4_MEM_OTHER, (size_t)t->pair_cap * sizeof(int32_t));
    t->pair_out = ds4_alloc(DS4_MEM_OTHER, (size_t)t->pair_cap * sizeof(int32_t));
    if (!t->pair_key || !t->pair_rank || !t->pair_out) return jfail(t, DS4_ERR_OOM, "out of memory for %lld merges", (long long)n);
    for (int64_t i = 0; i < t->pair_cap; i++) t->pair_key[i] = UINT64_MAX;
    int64_t rank = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, merges) {
        const char *a, *b;
        int64_t na, nb;
        if (cJSON_IsString(it)) { /* "a b" */
            a = it->valuestring;
            const char *sp = strchr(a, ' ');
            if (!sp || strchr(sp + 1, ' ') || sp == a || !sp[1])
                return jfail(t, DS4_ERR_FORMAT, "model.merges[%lld]: expected \"left right\" with one space, got \"%.80s\"",
                             (long long)rank, a);
            na = sp - a, b = sp + 1, nb = (int64_t)strlen(b);
        } else if (cJSON_IsArray(it) && cJSON_GetArraySize(it) == 2 && cJSON_IsString(cJSON_GetArrayItem(it, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(it, 1))) { /* ["a", "b"] */
            a = cJSON_GetArrayItem(it, 0)->valuestring, na = (int64_t)strlen(a);
            b = cJSON_GetArrayItem(it, 1)->valuestring, nb = (int64_t)strlen(b);
        } else {
            return jfail(t, DS4_ERR_FORMAT, "model.merges[%lld]: expected \"left right\" or [\"left\", \"right\"]", (long long)rank);
        }
        int32_t ia, ib;
        DS4_TRY(merge_side(t, rank, a, na, &ia));
        DS4_TRY(merge_side(t, rank, b, nb, &ib));
        int64_t la = t->tok_len[ia], lb = t->tok_len[ib];
        char *ab = ds4_alloc(DS4_MEM_WORK, (size_t)(la + lb));
        if (!ab) return jfail(t, DS4_ERR_OOM, "out of memory");
        memcpy(ab, t->tok[ia], (size_t)la);
        memcpy(ab + la, t->tok[ib], (size_t)lb);
        int32_t iab = map_find(t, ab, la + lb);
        ds4_free(ab);
        if (iab < 0)
            return jfail(t, DS4_ERR_FORMAT, "model.merges[%lld]: the merged token \"%.*s%.*s\" is not in model.vocab",
                         (long long)rank, (int)(na < 60 ? na : 60), a, (int)(nb < 60 ? nb : 60), b);
        if (pair_find(t, ia, ib) < 0) { /* a repeated pair keeps its first (lowest) rank */
            uint64_t key = ((uint64_t)(uint32_t)ia << 32) | (uint32_t)ib;
            uint64_t mask = (uint64_t)t->pair_cap - 1, i = hash_u64(key) & mask;
            while (t->pair_key[i] != UINT64_MAX) i = (i + 1) & mask;
            t->pair_key[i] = key;
            t->pair_rank[i] = (int32_t)rank;
            t->pair_out[i] = iab;
        }
        rank++;
    }
    t->n_merges = rank;
    return DS4_OK;
}

/* bos_token / eos_token of tokenizer_config.json: "text" or {"content": "text"}. */
static ds4_status config_special(ds4_tokenizer *t, const cJSON *cfg, const char *key, int32_t *out) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    const char *s = cJSON_IsString(v) ? v->valuestring : jstr(v, "content");
    if (!s) return DS4_OK;
    *out = ds4_tokenizer_special_id(t, s);
    if (*out < 0) return jfail(t, DS4_ERR_FORMAT, "tokenizer_config.json: %s \"%.80s\" is not an added token", key, s);
    return DS4_OK;
}

static void guess_specials(ds4_tokenizer *t) {
    static const char *bos[] = {"<\xef\xbd\x9c" "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "<|begin_of_text|>",
                                "<s>", "<bos>", "<|startoftext|>"};
    static const char *eos[] = {"<\xef\xbd\x9c" "end\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "<|end_of_text|>",
                                "<|endoftext|>", "</s>", "<eos>"};
    for (size_t i = 0; i < sizeof bos / sizeof *bos && t->bos < 0; i++) t->bos = ds4_tokenizer_special_id(t, bos[i]);
    for (size_t i = 0; i < sizeof eos / sizeof *eos && t->eos < 0; i++) t->eos = ds4_tokenizer_special_id(t, eos[i]);
}

static ds4_status parse_json(ds4_tokenizer *t, const cJSON *root, const char *config_json) {
    if (!cJSON_IsObject(root)) return jfail(t, DS4_ERR_FORMAT, "expected a JSON object at the top");
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model)) return jfail(t, DS4_ERR_FORMAT, "missing \"model\" object");
    const char *type = jstr(model, "type");
    if (type && strcmp(type, "BPE") != 0)
        return jfail(t, DS4_ERR_UNSUPPORTED, "model.type \"%s\" is not supported (only \"BPE\")", type);
    if (!type && !cJSON_GetObjectItemCaseSensitive(model, "merges"))
        return jfail(t, DS4_ERR_FORMAT, "model: expected \"type\": \"BPE\"");
    const char *prefix = jstr(model, "continuing_subword_prefix"), *suffix = jstr(model, "end_of_word_suffix");
    if ((prefix && *prefix) || (suffix && *suffix))
        return jfail(t, DS4_ERR_UNSUPPORTED, "model: continuing_subword_prefix / end_of_word_suffix are not supported");
    const cJSON *norm = cJSON_GetObjectItemCaseSensitive(root, "normalizer");
    if (norm && !cJSON_IsNull(norm)) {
        const char *nt = jstr(norm, "type");
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(norm, "normalizers");
        if (!nt || strcmp(nt, "Sequence") != 0 || cJSON_GetArraySize(list) != 0)
            return jfail(t, DS4_ERR_UNSUPPORTED, "normalizer \"%s\" is not supported (only none or an empty Sequence)",
                         nt ? nt : "?");
    }
    t->ignore_merges = jbool(model, "ignore_merges", false);
    build_cp_table(t->cp2byte);
    DS4_TRY(parse_vocab(t, model, cJSON_GetObjectItemCaseSensitive(root, "added_tokens")));
    DS4_TRY(parse_merges(t, model));
    bool bytelevel = false;
    DS4_TRY(parse_pretok(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), "pre_tokenizer", 0, &bytelevel));
    const char *dec = jstr(cJSON_GetObjectItemCaseSensitive(root, "decoder"), "type");
    if (!bytelevel && !(dec && strcmp(dec, "ByteLevel") == 0))
        return jfail(t, DS4_ERR_UNSUPPORTED, "only byte-level BPE is supported (no ByteLevel pre-tokenizer or decoder)");
    t->bos = t->eos = -1;
    if (config_json) {
        cJSON *cfg = cJSON_Parse(config_json);
        if (!cJSON_IsObject(cfg)) {
            cJSON_Delete(cfg);
            return jfail(t, DS4_ERR_FORMAT, "tokenizer_config.json: not a JSON object");
        }
        ds4_status st = config_special(t, cfg, "bos_token", &t->bos);
        if (!st) st = config_special(t, cfg, "eos_token", &t->eos);
        cJSON_Delete(cfg);
        DS4_TRY(st);
    }
    guess_specials(t);
    return DS4_OK;
}

ds4_status ds4_tokenizer_parse(const char *json, size_t len, const char *name, const char *config_json,
                               ds4_tokenizer **out) {
    *out = NULL;
    if (!name) name = "<tokenizer.json>";
    ds4_tokenizer *t = ds4_calloc(DS4_MEM_OTHER, sizeof *t);
    if (!t || !(t->name = ds4_strndup(name, strlen(name)))) {
        ds4_free(t);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", name);
    }
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, len, &end, false);
    ds4_status st = DS4_OK;
    if (!root) {
        int line = 1, col = 1;
        const char *stop = (end && end >= json && end <= json + len) ? end : json;
        for (const char *p = json; p < stop; p++) {
            if (*p == '\n') line++, col = 1;
            else col++;
        }
        st = ds4_fail(DS4_ERR_FORMAT, "%s:%d:%d: invalid JSON", name, line, col);
    } else {
        st = parse_json(t, root, config_json);
        cJSON_Delete(root);
    }
    if (st) {
        ds4_tokenizer_free(t);
        return st;
    }
    *out = t;
    return DS4_OK;
}


ds4_status ds4_tokenizer_load(const char *path, ds4_tokenizer **out) {
    *out = NULL;
    char file[4096], cfg_path[4096];
    struct stat sb;
    if (stat(path, &sb) == 0 && S_ISDIR(sb.st_mode)) snprintf(file, sizeof file, "%s/tokenizer.json", path);
    else snprintf(file, sizeof file, "%s", path);
    const char *slash = strrchr(file, '/');
    int dir_len = slash ? (int)(slash - file) : 0;
    snprintf(cfg_path, sizeof cfg_path, "%.*s%stokenizer_config.json", dir_len, file, slash ? "/" : "");
    char *json, *cfg = NULL;
    size_t len, cfg_len;
    DS4_TRY(ds4_check_input(file, NULL));
    DS4_TRY(ds4_read_file(file, &json, &len));
    if (stat(cfg_path, &sb) == 0) {
        ds4_status st = ds4_check_input(cfg_path, NULL);
        if (st == DS4_OK) st = ds4_read_file(cfg_path, &cfg, &cfg_len);
        if (st) {
            ds4_free(json);
            return st;
        }
    }
    ds4_status st = ds4_tokenizer_parse(json, len, file, cfg, out);
    ds4_free(json);
    ds4_free(cfg);
    return st;
}

ds4_status ds4_tokenizer_open(const char *spec, ds4_tokenizer **out) {
    if (strcmp(spec, "byte") == 0) return ds4_tokenizer_byte(out);
    return ds4_tokenizer_load(spec, out);
}

int64_t ds4_tokenizer_vocab_size(const ds4_tokenizer *t) { return t->vocab_size; }
int32_t ds4_tokenizer_bos(const ds4_tokenizer *t) { return t->bos; }
int32_t ds4_tokenizer_eos(const ds4_tokenizer *t) { return t->eos; }
const char *ds4_tokenizer_name(const ds4_tokenizer *t) { return t->name; }

int32_t ds4_tokenizer_special_id(const ds4_tokenizer *t, const char *content) {
    for (int64_t i = 0; i < t->n_added; i++)
        if (strcmp(t->added[i].s, content) == 0) return t->added[i].id;
    return -1;
}

const char *ds4_tokenizer_token(const ds4_tokenizer *t, int32_t id, size_t *len) {
    if (id < 0 || id >= t->vocab_size || !t->tok[id]) return NULL;
    *len = (size_t)t->tok_len[id];
    return t->tok[id];
}

/* ---------------------------------------------------------------- encoding */

typedef struct {
    int64_t start, len;
    bool match;
} span;

typedef struct {
    int32_t rank;
    int32_t pos;          /* left symbol */
    int32_t left, right;  /* ids when pushed: a mismatch later means the entry is stale */
} cand;

/* Scratch of one encode call: nothing here outlives it, so encode stays thread-safe. */
typedef struct {
    const ds4_tokenizer *t;
    ds4_tokens *out;
    pcre2_match_data *md;
    span *segs[MAX_STEPS], *pieces[MAX_STEPS];
    int64_t segs_cap[MAX_STEPS], pieces_cap[MAX_STEPS];
    int32_t *sym, *prev, *next;
    int64_t sym_cap;
    cand *heap;
    int64_t heap_n, heap_cap;
} enc_ctx;

static void enc_free(enc_ctx *c) {
    pcre2_match_data_free(c->md);
    for (int i = 0; i < MAX_STEPS; i++) {
        ds4_free(c->segs[i]);
        ds4_free(c->pieces[i]);
    }
    ds4_free(c->sym);
    ds4_free(c->prev);
    ds4_free(c->next);
    ds4_free(c->heap);
}

static ds4_status enc_oom(const enc_ctx *c) { return ds4_fail(DS4_ERR_OOM, "%s: out of memory while encoding", c->t->name); }

static bool cand_less(cand a, cand b) { return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos; }

static bool heap_push(enc_ctx *c, cand x) {
    if (!ds4_grow((void **)&c->heap, &c->heap_cap, c->heap_n + 1, sizeof(cand))) return false;
    int64_t i = c->heap_n++;
    while (i > 0 && cand_less(x, c->heap[(i - 1) / 2])) {
        c->heap[i] = c->heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    c->heap[i] = x;
    return true;
}

static cand heap_pop(enc_ctx *c) {
    cand top = c->heap[0], last = c->heap[--c->heap_n];
    int64_t i = 0, n = c->heap_n;
    for (;;) {
        int64_t k = 2 * i + 1;
        if (k >= n) break;
        if (k + 1 < n && cand_less(c->heap[k + 1], c->heap[k])) k++;
        if (!cand_less(c->heap[k], last)) break;
        c->heap[i] = c->heap[k];
        i = k;
    }
    if (n > 0) c->heap[i] = last;
    return top;
}

/* Pushes the merge candidate for the pair starting at symbol `pos`, if that pair has a merge. */
static bool push_pair(enc_ctx *c, int32_t pos) {
    int32_t nx = c->next[pos];
    if (nx < 0) return true;
    int64_t m = pair_find(c->t, c->sym[pos], c->sym[nx]);
    if (m < 0) return true;
    cand x = {c->t->pair_rank[m], pos, c->sym[pos], c->sym[nx]};
    return heap_push(c, x);
}

/* BPE of one piece: bytes -> symbols -> merges by rank -> ids appended to the output. */
static ds4_status bpe_piece(enc_ctx *c, const char *p, int64_t n) {
    const ds4_tokenizer *t = c->t;
    if (n == 0) return DS4_OK;
    if (t->ignore_merges) {
        int32_t id = map_find(t, p, n);
        if (id >= 0) return ds4_tokens_push(c->out, id);
    }
    for (int64_t i = 0; i < n; i++)
        if (t->byte_id[(uint8_t)p[i]] < 0)
            return ds4_fail(DS4_ERR_ARG, "%s: byte 0x%02x has no token in model.vocab (the vocab lacks part of the byte "
                                         "alphabet)", t->name, (uint8_t)p[i]);
    if (t->n_merges == 0 || n == 1) {
        for (int64_t i = 0; i < n; i++) DS4_TRY(ds4_tokens_push(c->out, t->byte_id[(uint8_t)p[i]]));
        return DS4_OK;
    }
    if (n > INT32_MAX) return ds4_fail(DS4_ERR_ARG, "%s: a single piece of %lld bytes is too long", t->name, (long long)n);
    if (n > c->sym_cap) {
        int64_t cap = c->sym_cap, cap2 = c->sym_cap, cap3 = c->sym_cap;
        if (!ds4_grow((void **)&c->sym, &cap, n, sizeof(int32_t)) || !ds4_grow((void **)&c->prev, &cap2, n, sizeof(int32_t)) ||
            !ds4_grow((void **)&c->next, &cap3, n, sizeof(int32_t)))
            return enc_oom(c);
        c->sym_cap = cap;
    }
    for (int64_t i = 0; i < n; i++) {
        c->sym[i] = t->byte_id[(uint8_t)p[i]];
        c->prev[i] = (int32_t)i - 1;
        c->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    c->heap_n = 0;
    for (int32_t i = 0; i + 1 < n; i++)
        if (!push_pair(c, i)) return enc_oom(c);
    while (c->heap_n > 0) {
        cand x = heap_pop(c);
        int32_t nx = c->next[x.pos];
        if (c->sym[x.pos] != x.left || nx < 0 || c->sym[nx] != x.right) continue; /* stale */
        c->sym[x.pos] = t->pair_out[pair_find(t, x.left, x.right)];
        c->sym[nx] = -1; /* dead */
        c->next[x.pos] = c->next[nx];
        if (c->next[nx] >= 0) c->prev[c->next[nx]] = x.pos;
        if (c->prev[x.pos] >= 0 && !push_pair(c, c->prev[x.pos])) return enc_oom(c);
        if (!push_pair(c, x.pos)) return enc_oom(c);
    }
    for (int32_t i = 0; i >= 0; i = c->next[i]) DS4_TRY(ds4_tokens_push(c->out, c->sym[i]));
    return DS4_OK;
}

/* Cuts p[0, n) by the step's regex into match / gap spans covering it, in c->segs[k]. */
static ds4_status find_segments(enc_ctx *c, int k, const char *p, int64_t n, int64_t *n_segs) {
    const pretok_step *s = &c->t->steps[k];
    int64_t ns = 0, prev = 0, off = 0;
    uint32_t opts = 0;
#define PUSH_SEG(a, b, m)                                                                              \
    do {                                                                                               \
        if (!ds4_grow((void **)&c->segs[k], &c->segs_cap[k], ns + 1, sizeof(span))) return enc_oom(c);     \
        c->segs[k][ns++] = (span){(a), (b) - (a), (m)};                                                \
    } while (0)
    while (off < n) {
        int rc = pcre2_match(s->re, (PCRE2_SPTR)p, (PCRE2_SIZE)n, (PCRE2_SIZE)off, opts, c->md, NULL);
        if (rc == PCRE2_ERROR_NOMATCH) break;
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !(opts & PCRE2_NO_JIT)) {
            opts |= PCRE2_NO_JIT; /* deep backtracking: the interpreter uses the heap instead */
            continue;
        }
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof msg);
            return ds4_fail(DS4_ERR_INTERNAL, "%s: pre-tokenizer step %d: regex match failed: %s", c->t->name, k, (char *)msg);
        }
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        int64_t a = (int64_t)ov[0], b = (int64_t)ov[1];
        if (a > prev) PUSH_SEG(prev, a, false);
        if (b > a) PUSH_SEG(a, b, true);
        prev = b;
        if (b > a) off = b;
        else if (b >= n) break; /* an empty match at the end */
        else off = b + char_len((const unsigned char *)p + b, (const unsigned char *)p + n); /* step over one character */
    }
    if (prev < n) PUSH_SEG(prev, n, false);
#undef PUSH_SEG
    *n_segs = ns;
    return DS4_OK;
}

/* Match / gap spans -> pieces, by the split behaviour (as the HF library folds them). */
static int64_t fold_segments(const span *seg, int64_t ns, int behavior, bool invert, span *out) {
    int64_t no = 0;
    bool prev_match = false;
    if (behavior == B_MERGED_NEXT) {
        for (int64_t i = ns - 1; i >= 0; i--) { /* a match joins the piece after it */
            span s = seg[i];
            s.match ^= invert;
            if (s.match && !prev_match && no > 0) out[no - 1].len += out[no - 1].start - s.start, out[no - 1].start = s.start;
            else out[no++] = s;
            prev_match = s.match;
        }
        for (int64_t i = 0; i < no / 2; i++) {
            span tmp = out[i];
            out[i] = out[no - 1 - i];
            out[no - 1 - i] = tmp;
        }
        return no;
    }
    for (int64_t i = 0; i < ns; i++) {
        span s = seg[i];
        s.match ^= invert;
        switch (behavior) {
        case B_ISOLATED: out[no++] = s; break;
        case B_REMOVED:
            if (!s.match) out[no++] = s;
            break;
        case B_MERGED_PREV: /* a match joins the piece before it */
            if (s.match && !prev_match && no > 0) out[no - 1].len = s.start + s.len - out[no - 1].start;
            else out[no++] = s;
            break;
        case B_CONTIGUOUS: /* runs of the same kind become one piece */
            if (s.match == prev_match && no > 0) out[no - 1].len = s.start + s.len - out[no - 1].start;
            else out[no++] = s;
            break;
        }
        prev_match = s.match;
    }
    return no;
}

static ds4_status run_steps(enc_ctx *c, int k, const char *p, int64_t n);

/* Step k's regex cuts p[0, n) into pieces; each goes on through the later steps. */
static ds4_status split_pieces(enc_ctx *c, int k, const char *p, int64_t n) {
    const pretok_step *s = &c->t->steps[k];
    int64_t ns;
    DS4_TRY(find_segments(c, k, p, n, &ns));
    if (!ds4_grow((void **)&c->pieces[k], &c->pieces_cap[k], ns, sizeof(span))) return enc_oom(c);
    int64_t np = fold_segments(c->segs[k], ns, s->behavior, s->invert, c->pieces[k]);
    for (int64_t i = 0; i < np; i++) {
        span pc = c->pieces[k][i]; /* deeper steps use their own arrays, so this one stays valid */
        DS4_TRY(run_steps(c, k + 1, p + pc.start, pc.len));
    }
    return DS4_OK;
}

/* Runs pre-tokenizer steps k.. on p[0, n), then BPE on every final piece. */
static ds4_status run_steps(enc_ctx *c, int k, const char *p, int64_t n) {
    if (n == 0) return DS4_OK;
    if (k == c->t->n_steps) return bpe_piece(c, p, n);
    const pretok_step *s = &c->t->steps[k];
    if (s->type == STEP_BYTELEVEL && s->add_prefix_space && p[0] != ' ') {
        char *q = ds4_alloc(DS4_MEM_WORK, (size_t)n + 1); /* " " + piece */
        if (!q) return enc_oom(c);
        q[0] = ' ';
        memcpy(q + 1, p, (size_t)n);
        ds4_status st = s->re ? split_pieces(c, k, q, n + 1) : run_steps(c, k + 1, q, n + 1);
        ds4_free(q);
        return st;
    }
    return s->re ? split_pieces(c, k, p, n) : run_steps(c, k + 1, p, n);
}

/* The added token starting at text[i], longest first, or NULL. */
static const added_tok *match_added(const ds4_tokenizer *t, const char *text, size_t len, size_t i) {
    if (!t->added_start[(uint8_t)text[i]]) return NULL;
    for (int64_t a = 0; a < t->n_added; a++) {
        const added_tok *x = &t->added[a];
        if ((size_t)x->n <= len - i && memcmp(text + i, x->s, (size_t)x->n) == 0) return x;
    }
    return NULL;
}

ds4_status ds4_tokenizer_encode(const ds4_tokenizer *t, const char *text, size_t len, bool parse_special,
                                ds4_tokens *out) {
    enc_ctx c = {.t = t, .out = out};
    if (t->n_steps > 0 && !(c.md = pcre2_match_data_create(4, NULL))) return enc_oom(&c);
    ds4_status st = DS4_OK;
    size_t start = 0;
    for (size_t i = 0; i < len && !st; i++) {
        const added_tok *a = parse_special ? match_added(t, text, len, i) : NULL;
        if (!a) continue;
        st = run_steps(&c, 0, text + start, (int64_t)(i - start));
        if (!st) st = ds4_tokens_push(out, a->id);
        start = i + (size_t)a->n;
        i = start - 1;
    }
    if (!st) st = run_steps(&c, 0, text + start, (int64_t)(len - start));
    enc_free(&c);
    return st;
}

ds4_status ds4_tokenizer_decode(const ds4_tokenizer *t, const int32_t *ids, int64_t n, char **text, size_t *len) {
    *text = NULL;
    *len = 0;
    size_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= t->vocab_size || !t->tok[ids[i]])
            return ds4_fail(DS4_ERR_ARG, "%s: cannot decode id %d at position %lld: no such token (vocab %lld)", t->name,
                            ids[i], (long long)i, (long long)t->vocab_size);
        total += (size_t)t->tok_len[ids[i]];
    }
    char *s = ds4_alloc(DS4_MEM_OTHER, total + 1);
    if (!s) return ds4_fail(DS4_ERR_OOM, "%s: out of memory decoding %lld ids", t->name, (long long)n);
    size_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        memcpy(s + off, t->tok[ids[i]], (size_t)t->tok_len[ids[i]]);
        off += (size_t)t->tok_len[ids[i]];
    }
    s[total] = 0;
    *text = s;
    *len = total;
    return DS4_OK;
}

/* ---------------------------------------------------------------- the byte tokenizer as Hugging Face files */

/* tokenizer.json of ds4's byte tokenizer: a byte-level BPE with no merges, so each byte is one token and
 * its id is the byte (the vocab spells byte b by its GPT-2 character); <|begin_of_text|> (256) and
 * <|end_of_text|> (257) are special added tokens, and the post-processor starts every sequence with BOS as
 * ds4 generate does. tokenizer_config.json names them. */
static cJSON *byte_tokenizer_json(void) {
    cJSON *r = cJSON_CreateObject();
    cJSON_AddStringToObject(r, "version", "1.0");
    cJSON_AddNullToObject(r, "truncation");
    cJSON_AddNullToObject(r, "padding");
    static const char *specials[2] = {"<|begin_of_text|>", "<|end_of_text|>"};
    cJSON *added = cJSON_AddArrayToObject(r, "added_tokens");
    for (int i = 0; i < 2; i++) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", 256 + i);
        cJSON_AddStringToObject(a, "content", specials[i]);
        cJSON_AddBoolToObject(a, "single_word", false);
        cJSON_AddBoolToObject(a, "lstrip", false);
        cJSON_AddBoolToObject(a, "rstrip", false);
        cJSON_AddBoolToObject(a, "normalized", false);
        cJSON_AddBoolToObject(a, "special", true);
        cJSON_AddItemToArray(added, a);
    }
    cJSON_AddNullToObject(r, "normalizer");
    cJSON *pre = cJSON_AddObjectToObject(r, "pre_tokenizer");
    cJSON_AddStringToObject(pre, "type", "ByteLevel");
    cJSON_AddBoolToObject(pre, "add_prefix_space", false);
    cJSON_AddBoolToObject(pre, "trim_offsets", false);
    cJSON_AddBoolToObject(pre, "use_regex", false);
    cJSON *post = cJSON_AddObjectToObject(r, "post_processor");
    cJSON_AddStringToObject(post, "type", "TemplateProcessing");
    const char *single[2] = {"<|begin_of_text|>", "$A"}, *pair[4] = {"<|begin_of_text|>", "$A", "<|begin_of_text|>", "$B"};
    for (int k = 0; k < 2; k++) {
        cJSON *seq = cJSON_AddArrayToObject(post, k ? "pair" : "single");
        int n = k ? 4 : 2;
        for (int i = 0; i < n; i++) {
            const char *x = k ? pair[i] : single[i];
            cJSON *item = cJSON_CreateObject();
            cJSON *o = cJSON_AddObjectToObject(item, x[0] == '$' ? "Sequence" : "SpecialToken");
            cJSON_AddStringToObject(o, "id", x[0] == '$' ? x + 1 : x);
            cJSON_AddNumberToObject(o, "type_id", k && i >= 2 ? 1 : 0);
            cJSON_AddItemToArray(seq, item);
        }
    }
    cJSON *st = cJSON_AddObjectToObject(post, "special_tokens");
    cJSON *bos = cJSON_AddObjectToObject(st, specials[0]);
    cJSON_AddStringToObject(bos, "id", specials[0]);
    cJSON *ids = cJSON_AddArrayToObject(bos, "ids");
    cJSON_AddItemToArray(ids, cJSON_CreateNumber(256));
    cJSON *toks = cJSON_AddArrayToObject(bos, "tokens");
    cJSON_AddItemToArray(toks, cJSON_CreateString(specials[0]));
    cJSON *dec = cJSON_AddObjectToObject(r, "decoder");
    cJSON_AddStringToObject(dec, "type", "ByteLevel");
    cJSON_AddBoolToObject(dec, "add_prefix_space", false);
    cJSON_AddBoolToObject(dec, "trim_offsets", false);
    cJSON_AddBoolToObject(dec, "use_regex", false);
    cJSON *model = cJSON_AddObjectToObject(r, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddNullToObject(model, "continuing_subword_prefix");
    cJSON_AddNullToObject(model, "end_of_word_suffix");
    cJSON_AddBoolToObject(model, "fuse_unk", false);
    cJSON_AddBoolToObject(model, "byte_fallback", false);
    cJSON_AddBoolToObject(model, "ignore_merges", false);
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        uint32_t cp = byte_to_cp(b);
        char s[3] = {0};
        if (cp < 0x80) s[0] = (char)cp;
        else s[0] = (char)(0xc0 | (cp >> 6)), s[1] = (char)(0x80 | (cp & 0x3f));
        cJSON_AddNumberToObject(vocab, s, b);
    }
    cJSON_AddArrayToObject(model, "merges");
    return r;
}

/* Writes r to path, then frees it. */
static ds4_status write_json_file(const char *path, cJSON *r) {
    ds4_status st = ds4_write_json_atomic(path, r);
    cJSON_Delete(r);
    return st;
}

ds4_status ds4_tokenizer_byte_write_hf(const char *dir, int64_t model_max_length) {
    char p[4200];
    snprintf(p, sizeof p, "%s/tokenizer.json", dir);
    DS4_TRY(write_json_file(p, byte_tokenizer_json()));
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "tokenizer_class", "PreTrainedTokenizerFast");
    cJSON_AddStringToObject(c, "bos_token", "<|begin_of_text|>");
    cJSON_AddStringToObject(c, "eos_token", "<|end_of_text|>");
    cJSON_AddBoolToObject(c, "add_bos_token", true);
    cJSON_AddBoolToObject(c, "add_eos_token", false);
    cJSON_AddBoolToObject(c, "clean_up_tokenization_spaces", false);
    if (model_max_length > 0) cJSON_AddNumberToObject(c, "model_max_length", (double)model_max_length);
    snprintf(p, sizeof p, "%s/tokenizer_config.json", dir);
    return write_json_file(p, c);
}
