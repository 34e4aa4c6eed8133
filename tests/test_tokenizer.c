/* Tokenizers: the byte tokenizer, and byte-level BPE from a small tokenizer.json that this test
 * writes (DeepSeek's pre-tokenizer layout), checked against encodings worked out by hand. */
#include "ds4/tokenizer.h"
#include "test.h"

#include <stdint.h>
#include <unistd.h>

/* ---------------------------------------------------------------- building tokenizer.json */

typedef struct {
    char *d;
    size_t n, cap;
} buf_t;

static void put(buf_t *b, const char *s, size_t n) {
    if (b->n + n + 1 > b->cap) {
        b->cap = (b->n + n + 1) * 2;
        b->d = realloc(b->d, b->cap);
    }
    memcpy(b->d + b->n, s, n);
    b->n += n;
    b->d[b->n] = 0;
}
static void puts_(buf_t *b, const char *s) { put(b, s, strlen(s)); }

/* GPT-2's byte -> code point map, written independently of the library's. */
static unsigned gpt2_cp(unsigned char c) {
    unsigned n = 0;
    for (unsigned b = 0; b < 256; b++) {
        int printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        if (b == c) return printable ? b : 256 + n;
        if (!printable) n++;
    }
    return 0;
}

/* Raw bytes -> JSON string of their byte-level spelling ("Ġthe" for " the"). */
static void put_bytelevel(buf_t *b, const char *s, size_t n) {
    puts_(b, "\"");
    for (size_t i = 0; i < n; i++) {
        unsigned cp = gpt2_cp((unsigned char)s[i]);
        char u[3];
        if (cp == '"' || cp == '\\') { u[0] = '\\'; u[1] = (char)cp; put(b, u, 2); }
        else if (cp < 0x80) { u[0] = (char)cp; put(b, u, 1); }
        else { u[0] = (char)(0xc0 | (cp >> 6)); u[1] = (char)(0x80 | (cp & 0x3f)); put(b, u, 2); }
    }
    puts_(b, "\"");
}

/* The DeepSeek-V3/V4 pre-tokenizer: digit runs of 1-3, CJK runs, then words / punctuation /
 * whitespace, then ByteLevel without its own regex. */
static const char *k_deepseek_pretok =
    "{\"type\": \"Sequence\", \"pretokenizers\": ["
    "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"\\\\p{N}{1,3}\"}, \"behavior\": \"Isolated\", \"invert\": false},"
    "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"[\xe4\xb8\x80-\xe9\xbe\xa5\xe3\x81\x80-\xe3\x82\x9f\xe3\x82\xa0-\xe3\x83\xbf]+\"}, "
    "\"behavior\": \"Isolated\", \"invert\": false},"
    "{\"type\": \"Split\", \"pattern\": {\"Regex\": \"[!\\\"#$%&'()*+,\\\\-./:;<=>?@\\\\[\\\\\\\\\\\\]^_`{|}~][A-Za-z]+|"
    "[^\\r\\n\\\\p{L}\\\\p{P}\\\\p{S}]?[\\\\p{L}\\\\p{M}]+| ?[\\\\p{P}\\\\p{S}]+[\\r\\n]*|\\\\s*[\\r\\n]+|\\\\s+(?!\\\\S)|\\\\s+\"}, "
    "\"behavior\": \"Isolated\", \"invert\": false},"
    "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]}";

typedef struct {
    const char *a, *b; /* raw bytes */
} merge_t;

/* Ranks 0.. in order; the merged token of merge i gets id 256 + i. */
static const merge_t k_merges[] = {
    {" ", "t"},         /* 256 " t"   */
    {"h", "e"},         /* 257 "he"   */
    {" t", "he"},       /* 258 " the" */
    {"i", "n"},         /* 259 "in"   */
    {" ", "a"},         /* 260 " a"   */
    {"c", "a"},         /* 261 "ca"   */
    {"ca", "t"},        /* 262 "cat"  */
    {"\n", "\n"},       /* 263 "\n\n" */
    {"\xc3", "\xa9"},   /* 264 "é"    */
    {"a", "a"},         /* 265 "aa"   */
    {"a", "\xe4"},      /* 266 "a" + first byte of 中: only reachable without the CJK split */
    {" ", " "},         /* 267 "  "   */
};
#define N_MERGES ((int)(sizeof k_merges / sizeof *k_merges))
#define ID_CAT_SPACE 268 /* " cat": in the vocab, no merge makes it (ignore_merges reaches it) */

typedef struct {
    const char *pretok;       /* pre_tokenizer JSON */
    const merge_t *merges;
    int n_merges;
    bool pair_form;           /* merges as ["a", "b"] instead of "a b" */
    bool ignore_merges;
    bool added;               /* the added tokens 269..271, right after the vocab */
} spec_t;

static char *make_json(spec_t s) {
    buf_t b = {0};
    puts_(&b, "{\"version\": \"1.0\", \"truncation\": null, \"padding\": null, \"added_tokens\": [");
    if (s.added)
        puts_(&b, "{\"id\": 269, \"content\": \"<|begin_of_text|>\", \"single_word\": false, \"lstrip\": false, "
                  "\"rstrip\": false, \"normalized\": false, \"special\": true},"
                  "{\"id\": 270, \"content\": \"<|end_of_text|>\", \"single_word\": false, \"lstrip\": false, "
                  "\"rstrip\": false, \"normalized\": false, \"special\": true},"
                  "{\"id\": 271, \"content\": \"<|end\", \"single_word\": false, \"lstrip\": false, "
                  "\"rstrip\": false, \"normalized\": false, \"special\": true}");
    puts_(&b, "], \"normalizer\": {\"type\": \"Sequence\", \"normalizers\": []}, \"pre_tokenizer\": ");
    puts_(&b, s.pretok);
    puts_(&b, ", \"post_processor\": null, \"decoder\": {\"type\": \"ByteLevel\", \"add_prefix_space\": true, "
              "\"trim_offsets\": true, \"use_regex\": true}, \"model\": {\"type\": \"BPE\", \"dropout\": null, "
              "\"unk_token\": null, \"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, "
              "\"fuse_unk\": false, \"byte_fallback\": false, ");
    puts_(&b, s.ignore_merges ? "\"ignore_merges\": true, " : "\"ignore_merges\": false, ");
    puts_(&b, "\"vocab\": {");
    char num[32], one[1];
    for (int i = 0; i < 256; i++) {
        one[0] = (char)i;
        put_bytelevel(&b, one, 1);
        snprintf(num, sizeof num, ": %d, ", i);
        puts_(&b, num);
    }
    for (int i = 0; i < s.n_merges; i++) {
        char cat[64];
        snprintf(cat, sizeof cat, "%s%s", s.merges[i].a, s.merges[i].b);
        put_bytelevel(&b, cat, strlen(cat));
        snprintf(num, sizeof num, ": %d, ", 256 + i);
        puts_(&b, num);
    }
    put_bytelevel(&b, " cat", 4);
    snprintf(num, sizeof num, ": %d", ID_CAT_SPACE);
    puts_(&b, num);
    puts_(&b, "}, \"merges\": [");
    for (int i = 0; i < s.n_merges; i++) {
        if (i) puts_(&b, ", ");
        if (s.pair_form) {
            puts_(&b, "[");
            put_bytelevel(&b, s.merges[i].a, strlen(s.merges[i].a));
            puts_(&b, ", ");
            put_bytelevel(&b, s.merges[i].b, strlen(s.merges[i].b));
            puts_(&b, "]");
        } else { /* "a b": join the two spellings inside one JSON string */
            buf_t x = {0}, y = {0};
            put_bytelevel(&x, s.merges[i].a, strlen(s.merges[i].a));
            put_bytelevel(&y, s.merges[i].b, strlen(s.merges[i].b));
            put(&b, x.d, x.n - 1);
            puts_(&b, " ");
            put(&b, y.d + 1, y.n - 1);
            free(x.d);
            free(y.d);
        }
    }
    puts_(&b, "]}}");
    return b.d;
}

static ds4_tokenizer *load_spec(spec_t s) {
    char *json = make_json(s);
    ds4_tokenizer *t = NULL;
    ds4_status st = ds4_tokenizer_parse(json, strlen(json), "tok.json", NULL, &t);
    CHECK(st == DS4_OK, "parse: %s", ds4_errmsg());
    free(json);
    return t;
}

static spec_t deepseek_spec(void) {
    return (spec_t){k_deepseek_pretok, k_merges, N_MERGES, false, false, true};
}

/* ---------------------------------------------------------------- checking encodings */

static int check_ids(const ds4_tokenizer *t, const char *text, size_t len, bool special, const int32_t *want, int64_t n) {
    ds4_tokens out = {0};
    ds4_status st = ds4_tokenizer_encode(t, text, len, special, &out);
    int ok = st == DS4_OK && out.n == n && (n == 0 || memcmp(out.ids, want, (size_t)n * sizeof(int32_t)) == 0);
    if (!ok) {
        fprintf(stderr, "  encode(\"%.*s\") = [", (int)len, text);
        for (int64_t i = 0; i < out.n; i++) fprintf(stderr, "%s%d", i ? ", " : "", out.ids[i]);
        fprintf(stderr, "], want [");
        for (int64_t i = 0; i < n; i++) fprintf(stderr, "%s%d", i ? ", " : "", want[i]);
        fprintf(stderr, "] (%s)\n", st ? ds4_errmsg() : "ok");
    }
    ds4_tokens_free(&out);
    return ok;
}

#define ENC(t, text, special, ...)                                                                        \
    do {                                                                                                  \
        const int32_t want_[] = {__VA_ARGS__};                                                            \
        CHECK(check_ids(t, text, sizeof(text) - 1, special, want_, (int64_t)(sizeof want_ / sizeof *want_)), \
              "encoding of \"%s\"", text);                                                                \
    } while (0)

static int round_trips(const ds4_tokenizer *t, const char *text, size_t len) {
    ds4_tokens ids = {0};
    char *back = NULL;
    size_t blen = 0;
    int ok = ds4_tokenizer_encode(t, text, len, false, &ids) == DS4_OK &&
             ds4_tokenizer_decode(t, ids.ids, ids.n, &back, &blen) == DS4_OK && blen == len &&
             memcmp(back, text, len) == 0;
    ds4_tokens_free(&ids);
    ds4_free(back);
    return ok;
}

/* ---------------------------------------------------------------- tests */

static void test_byte_tokenizer(void) {
    ds4_tokenizer *t = NULL;
    CHECK(ds4_tokenizer_open("byte", &t) == DS4_OK);
    if (!t) return;
    CHECK(ds4_tokenizer_vocab_size(t) == 258 && ds4_tokenizer_bos(t) == 256 && ds4_tokenizer_eos(t) == 257);
    ENC(t, "hi \xff", false, 104, 105, 32, 255);
    ENC(t, "<|begin_of_text|>a<|end_of_text|>", true, 256, 97, 257);
    ENC(t, "<|end_of_text|>", false, 60, 124, 101, 110, 100, 95, 111, 102, 95, 116, 101, 120, 116, 124, 62);
    ENC(t, "<|end_of_tex", true, 60, 124, 101, 110, 100, 95, 111, 102, 95, 116, 101, 120);
    size_t n;
    const char *s = ds4_tokenizer_token(t, 257, &n);
    CHECK(s && n == 15 && memcmp(s, "<|end_of_text|>", 15) == 0);
    CHECK(ds4_tokenizer_token(t, 258, &n) == NULL && ds4_tokenizer_token(t, -1, &n) == NULL);
    CHECK(round_trips(t, "any\0bytes\x80\n", 11));
    ds4_tokenizer_free(t);
}

static void test_deepseek_layout(void) {
    ds4_tokenizer *t = load_spec(deepseek_spec());
    if (!t) return;
    CHECK(ds4_tokenizer_vocab_size(t) == 272, "vocab %lld", (long long)ds4_tokenizer_vocab_size(t));
    CHECK(ds4_tokenizer_bos(t) == 269 && ds4_tokenizer_eos(t) == 270, "bos/eos from the added-token names");
    /* words: "the" -> t + he; " the" -> " t" + "he" -> " the"; " cat" -> ca, cat after the space */
    ENC(t, "the", false, 116, 257);
    ENC(t, " the", false, 258);
    ENC(t, "the the", false, 116, 257, 258);
    ENC(t, "the cat", false, 116, 257, 32, 262);
    /* equal ranks merge leftmost first: aaa -> aa + a */
    ENC(t, "aaa", false, 265, 97);
    ENC(t, "aaaa", false, 265, 265);
    /* newlines are their own piece (\s*[\r\n]+) and merge */
    ENC(t, "a\n\nb", false, 97, 263, 98);
    /* two spaces before a word: \s+(?!\S) takes one, the word takes the other; "  " never forms */
    ENC(t, "x  y", false, 120, 32, 32, 121);
    ENC(t, "x  ", false, 120, 267);
    /* digits split in runs of at most three */
    ENC(t, "12345", false, 49, 50, 51, 52, 53);
    ENC(t, "in12", false, 259, 49, 50);
    /* unicode: é is two bytes merged; CJK is split off before the word regex, so "a" + 中 never merge */
    ENC(t, "caf\xc3\xa9", false, 261, 102, 264);
    ENC(t, "a\xe4\xb8\xad", false, 97, 228, 184, 173);
    ENC(t, "\xe4\xb8\xad\xe6\x96\x87", false, 228, 184, 173, 230, 150, 135);
    /* punctuation followed by letters is one piece: "'s" */
    ENC(t, "it's", false, 105, 116, 39, 115);
    /* invalid UTF-8 is matched by no regex and stays bytes */
    ENC(t, "\xff\xfe", false, 255, 254);
    /* added tokens, longest first, before pre-tokenisation */
    ENC(t, "<|begin_of_text|>the<|end_of_text|>", true, 269, 116, 257, 270);
    ENC(t, "<|endx", true, 271, 120);
    ENC(t, "<|end", false, 60, 124, 101, 110, 100);
    ENC(t, " the<|end_of_text|><|end_of_text|>", true, 258, 270, 270);
    CHECK(check_ids(t, "", 0, true, NULL, 0), "empty text, no ids");
    CHECK(ds4_tokenizer_special_id(t, "<|end") == 271 && ds4_tokenizer_special_id(t, "<|nope|>") == -1);
    /* decode: bytes back, added tokens as their text, ids without a token are an error */
    const int32_t ids[] = {269, 258, 32, 262, 264, 270};
    char *text = NULL;
    size_t len = 0;
    CHECK(ds4_tokenizer_decode(t, ids, 6, &text, &len) == DS4_OK);
    CHECK(text && len == strlen("<|begin_of_text|> the cat\xc3\xa9<|end_of_text|>") &&
          strcmp(text, "<|begin_of_text|> the cat\xc3\xa9<|end_of_text|>") == 0, "decoded [%s]", text);
    ds4_free(text);
    const int32_t bad[] = {116, 280};
    CHECK(ds4_tokenizer_decode(t, bad, 2, &text, &len) == DS4_ERR_ARG && strstr(ds4_errmsg(), "cannot decode id 280 at position 1"));
    /* round trips over mixed text and random bytes */
    const char *mixed = "The cat sat.\n\n  Caf\xc3\xa9 \xe4\xb8\xad\xe6\x96\x87 1234567 it's <|end_of_text|> \t\r\n x";
    CHECK(round_trips(t, mixed, strlen(mixed)));
    char rnd[257];
    int bad_trips = 0;
    for (uint64_t it = 0; it < 300; it++) {
        size_t n = (size_t)(ds4_rng_u64(5, it, 0) % 256);
        for (size_t i = 0; i < n; i++) {
            uint64_t r = ds4_rng_u64(5, it, 1 + i);
            /* mostly text-like bytes, some arbitrary */
            static const char pool[] = " aeht\n1\xc3\xa9,'c";
            rnd[i] = (r & 3) ? pool[(r >> 8) % (sizeof pool - 1)] : (char)(r >> 16);
        }
        bad_trips += !round_trips(t, rnd, n);
    }
    CHECK(bad_trips == 0, "%d random strings did not round-trip", bad_trips);
    ds4_tokenizer_free(t);
}

static void test_merge_forms(void) {
    spec_t s = deepseek_spec();
    s.pair_form = true;
    ds4_tokenizer *t = load_spec(s);
    if (!t) return;
    ENC(t, "the cat", false, 116, 257, 32, 262);
    ENC(t, "caf\xc3\xa9", false, 261, 102, 264);
    ds4_tokenizer_free(t);
    /* ignore_merges: a piece that is a whole vocab entry is emitted as it is */
    s = deepseek_spec();
    s.ignore_merges = true;
    t = load_spec(s);
    if (!t) return;
    ENC(t, "the cat", false, 116, 257, ID_CAT_SPACE);
    ds4_tokenizer_free(t);
}

/* GPT-2 style: ByteLevel alone, with its own regex and a prefix space. */
static void test_gpt2_layout(void) {
    spec_t s = {"{\"type\": \"ByteLevel\", \"add_prefix_space\": true, \"trim_offsets\": true, \"use_regex\": true}", k_merges, N_MERGES, false,
                false, false};
    ds4_tokenizer *t = load_spec(s);
    if (!t) return;
    ENC(t, "the the", false, 258, 258);
    ENC(t, " the", false, 258);
    ENC(t, "12 cat's", false, 32, 49, 50, 32, 262, 39, 115);
    CHECK(ds4_tokenizer_bos(t) == -1 && ds4_tokenizer_eos(t) == -1, "no added tokens, no BOS/EOS");
    ds4_tokenizer_free(t);
}

/* Split behaviours on "-" with merges that cross the piece boundaries. */
static void test_split_behaviors(void) {
    static const merge_t m[] = {{"a", "-"}, {"-", "b"}, {"-", "-"}, {"1", "2"}}; /* ids 256..259 */
    char pre[512];
    const char *fmt = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"String\": \"-\"}, "
                      "\"behavior\": \"%s\", \"invert\": %s}, {\"type\": \"ByteLevel\", \"add_prefix_space\": false, "
                      "\"use_regex\": false}]}";
    struct {
        const char *behavior, *invert, *text;
        int32_t want[6];
        int n;
    } cases[] = {
        {"Isolated", "false", "a-b", {97, 45, 98}, 3},
        {"Removed", "false", "a-b", {97, 98}, 2},
        {"MergedWithPrevious", "false", "a-b", {256, 98}, 2},
        {"MergedWithNext", "false", "a-b", {97, 257}, 2},
        {"Contiguous", "false", "a--b", {97, 258, 98}, 3},
        {"Isolated", "false", "a--b", {97, 45, 45, 98}, 4},
        {"Removed", "true", "a-b", {45}, 1},
        {"MergedWithPrevious", "false", "-a--", {45, 256, 45}, 3},
        {"MergedWithNext", "false", "--b-", {45, 257, 45}, 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        snprintf(pre, sizeof pre, fmt, cases[i].behavior, cases[i].invert);
        spec_t s = {pre, m, 4, false, false, false};
        ds4_tokenizer *t = load_spec(s);
        if (!t) continue;
        CHECK(check_ids(t, cases[i].text, strlen(cases[i].text), false, cases[i].want, cases[i].n), "%s invert=%s on %s",
              cases[i].behavior, cases[i].invert, cases[i].text);
        ds4_tokenizer_free(t);
    }
    /* a regex that also matches empty: every empty match still cuts the text (so "12" cannot merge),
     * including the one at the very end */
    const char *empty_re = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Split\", \"pattern\": {\"Regex\": \"-*\"}, "
                           "\"behavior\": \"Isolated\", \"invert\": false}, {\"type\": \"ByteLevel\", \"add_prefix_space\": "
                           "false, \"trim_offsets\": true, \"use_regex\": false}]}";
    ds4_tokenizer *e = load_spec((spec_t){empty_re, m, 4, false, false, false});
    if (e) {
        ENC(e, "12", false, 49, 50);
        ENC(e, "a--b", false, 97, 258, 98);
        ENC(e, "xa-", false, 120, 97, 45);
    }
    ds4_tokenizer_free(e);
    /* Digits */
    const char *dig = "{\"type\": \"Sequence\", \"pretokenizers\": [{\"type\": \"Digits\", \"individual_digits\": %s}, "
                      "{\"type\": \"ByteLevel\", \"add_prefix_space\": false, \"trim_offsets\": true, \"use_regex\": false}]}";
    snprintf(pre, sizeof pre, dig, "true");
    ds4_tokenizer *t = load_spec((spec_t){pre, m, 4, false, false, false});
    if (t) ENC(t, "123", false, 49, 50, 51);
    ds4_tokenizer_free(t);
    snprintf(pre, sizeof pre, dig, "false");
    t = load_spec((spec_t){pre, m, 4, false, false, false});
    if (t) ENC(t, "x123", false, 120, 259, 51);
    ds4_tokenizer_free(t);
}

static void bad_json(const char *json, ds4_status code, const char *want) {
    ds4_tokenizer *t = NULL;
    ds4_status st = ds4_tokenizer_parse(json, strlen(json), "tok.json", NULL, &t);
    CHECK(st == code, "status %d, want %d: %s", (int)st, (int)code, ds4_errmsg());
    CHECK(t == NULL);
    CHECK(strstr(ds4_errmsg(), want) != NULL, "message '%s' lacks '%s'", ds4_errmsg(), want);
    ds4_tokenizer_free(t);
}

/* The valid JSON with the first `from` replaced by `to`. */
static char *edit(const char *json, const char *from, const char *to) {
    const char *at = strstr(json, from);
    if (!at) return NULL;
    buf_t b = {0};
    put(&b, json, (size_t)(at - json));
    puts_(&b, to);
    puts_(&b, at + strlen(from));
    return b.d;
}

static void test_corrupt(void) {
    char *good = make_json(deepseek_spec());
    char *j;
    /* truncated file: the position of the failure is named */
    char *cut = strdup(good);
    cut[strlen(cut) / 2] = 0;
    bad_json(cut, DS4_ERR_FORMAT, "tok.json:1:");
    bad_json(cut, DS4_ERR_FORMAT, "invalid JSON");
    free(cut);
    bad_json("[]", DS4_ERR_FORMAT, "tok.json: expected a JSON object");
    bad_json("{}", DS4_ERR_FORMAT, "tok.json: missing \"model\" object");
    j = edit(good, "\"type\": \"BPE\"", "\"type\": \"WordPiece\"");
    bad_json(j, DS4_ERR_UNSUPPORTED, "model.type \"WordPiece\" is not supported");
    free(j);
    j = edit(good, ": 97,", ": \"97\",");
    bad_json(j, DS4_ERR_FORMAT, "model.vocab[\"a\"]: expected an integer id in [0, 16777215]");
    free(j);
    j = edit(good, ": 97,", ": 98,");
    bad_json(j, DS4_ERR_FORMAT, "id 98 is used twice");
    free(j);
    /* a vocab without some byte loads (HF trainers can make one) but cannot encode that byte */
    j = edit(good, "\"z\": 122,", "");
    ds4_tokenizer *t = NULL;
    CHECK(ds4_tokenizer_parse(j, strlen(j), "tok.json", NULL, &t) == DS4_OK, "%s", ds4_errmsg());
    if (t) {
        ds4_tokens ids = {0};
        CHECK(ds4_tokenizer_encode(t, "the", 3, false, &ids) == DS4_OK && ids.n == 2);
        CHECK(ds4_tokenizer_encode(t, " z", 2, false, &ids) == DS4_ERR_ARG &&
              strstr(ds4_errmsg(), "tok.json: byte 0x7a has no token in model.vocab"), "%s", ds4_errmsg());
        ds4_tokens_free(&ids);
    }
    ds4_tokenizer_free(t);
    free(j);
    j = edit(good, "\"merges\": [\"", "\"merges\": [\"zz q\", \"");
    bad_json(j, DS4_ERR_FORMAT, "model.merges[0]: \"zz\" is not a byte-level token of model.vocab");
    free(j);
    j = edit(good, "\"merges\": [\"", "\"merges\": [\"x y\", \"");
    bad_json(j, DS4_ERR_FORMAT, "model.merges[0]: the merged token \"xy\" is not in model.vocab");
    free(j);
    j = edit(good, "\"merges\": [\"", "\"merges\": [\"xy\", \"");
    bad_json(j, DS4_ERR_FORMAT, "model.merges[0]: expected \"left right\" with one space");
    free(j);
    j = edit(good, "\"merges\": [\"", "\"merges\": [7, \"");
    bad_json(j, DS4_ERR_FORMAT, "model.merges[0]: expected \"left right\" or [\"left\", \"right\"]");
    free(j);
    j = edit(good, "\\\\p{N}{1,3}", "(\\\\p{N}");
    bad_json(j, DS4_ERR_FORMAT, "pre_tokenizer.pretokenizers[0].pattern: regex does not compile at offset");
    free(j);
    j = edit(good, "\"behavior\": \"Isolated\"", "\"behavior\": \"Sideways\"");
    bad_json(j, DS4_ERR_FORMAT, "pre_tokenizer.pretokenizers[0].behavior: expected Isolated");
    free(j);
    j = edit(good, "{\"type\": \"Split\"", "{\"type\": \"Metaspace\"");
    bad_json(j, DS4_ERR_UNSUPPORTED, "pre_tokenizer.pretokenizers[0]: pre-tokenizer type \"Metaspace\" is not supported");
    free(j);
    j = edit(good, "{\"type\": \"Sequence\", \"normalizers\": []}", "{\"type\": \"NFC\"}");
    bad_json(j, DS4_ERR_UNSUPPORTED, "normalizer \"NFC\" is not supported");
    free(j);
    j = edit(good, "{\"id\": 270, \"content\": \"<|end_of_text|>\"", "{\"id\": -1, \"content\": \"<|end_of_text|>\"");
    bad_json(j, DS4_ERR_FORMAT, "added_tokens[1]: expected {\"id\": integer in [0, 16777215], \"content\": non-empty string}");
    free(j);
    j = edit(good, "{\"id\": 269,", "{\"id\": 97,");
    bad_json(j, DS4_ERR_FORMAT, "added_tokens[0]: id 97 is already the vocab token \"a\"");
    free(j);
    /* tokenizer_config.json names BOS/EOS; an unknown name is an error */
    t = NULL;
    CHECK(ds4_tokenizer_parse(good, strlen(good), "tok.json", "{\"bos_token\": {\"content\": \"<|end\"}, \"eos_token\": null}",
                              &t) == DS4_OK, "%s", ds4_errmsg());
    if (t) CHECK(ds4_tokenizer_bos(t) == 271 && ds4_tokenizer_eos(t) == 270);
    ds4_tokenizer_free(t);
    t = NULL;
    CHECK(ds4_tokenizer_parse(good, strlen(good), "tok.json", "{\"bos_token\": \"<nope>\"}", &t) == DS4_ERR_FORMAT &&
          strstr(ds4_errmsg(), "bos_token \"<nope>\" is not an added token"));
    /* mutations of the file never crash: each parse either works or fails with a message */
    size_t n = strlen(good);
    char *m = malloc(n + 1);
    int ok = 0, err = 0;
    for (uint64_t it = 0; it < 400; it++) {
        memcpy(m, good, n + 1);
        for (int k = 0; k < 4; k++) {
            uint64_t r = ds4_rng_u64(9, it, (uint64_t)k);
            m[(r >> 8) % n] = "\"{}[],:\\ 0a-"[(r >> 40) % 12];
        }
        t = NULL;
        ds4_status st = ds4_tokenizer_parse(m, n, "tok.json", NULL, &t);
        if (st == DS4_OK) {
            ok++;
            CHECK(t != NULL);
            CHECK(round_trips(t, "the cat sat", 11)); /* a parsed tokenizer still works */
        } else {
            err++;
            CHECK(t == NULL && strncmp(ds4_errmsg(), "tok.json", 8) == 0, "%s", ds4_errmsg());
        }
        ds4_tokenizer_free(t);
    }
    CHECK(err > 50, "mutations should mostly break the file (%d ok, %d errors)", ok, err);
    free(m);
    free(good);
}

static void test_load_dir(void) {
    char dir[] = "/tmp/ds4_test_tok_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char path[256], cfg[256];
    snprintf(path, sizeof path, "%s/tokenizer.json", dir);
    snprintf(cfg, sizeof cfg, "%s/tokenizer_config.json", dir);
    char *json = make_json(deepseek_spec());
    FILE *f = fopen(path, "wb");
    fputs(json, f);
    fclose(f);
    f = fopen(cfg, "wb");
    fputs("{\"bos_token\": \"<|end_of_text|>\", \"eos_token\": {\"content\": \"<|end\", \"special\": true}}", f);
    fclose(f);
    ds4_tokenizer *t = NULL;
    CHECK(ds4_tokenizer_open(dir, &t) == DS4_OK, "%s", ds4_errmsg());
    if (t) {
        CHECK(ds4_tokenizer_bos(t) == 270 && ds4_tokenizer_eos(t) == 271, "specials from tokenizer_config.json");
        CHECK(strcmp(ds4_tokenizer_name(t), path) == 0);
        ENC(t, "the cat", false, 116, 257, 32, 262);
    }
    ds4_tokenizer_free(t);
    unlink(cfg);
    t = NULL;
    CHECK(ds4_tokenizer_open(path, &t) == DS4_OK && ds4_tokenizer_bos(t) == 269);
    ds4_tokenizer_free(t);
    unlink(path);
    rmdir(dir);
    free(json);
    t = NULL;
    CHECK(ds4_tokenizer_open("/nonexistent/tokenizer.json", &t) == DS4_ERR_IO && strstr(ds4_errmsg(), "/nonexistent/tokenizer.json"));
}

/* Long pieces (one 200 KB word, 200 KB of spaces) stay fast and exact. */
static void test_long_pieces(void) {
    ds4_tokenizer *t = load_spec(deepseek_spec());
    if (!t) return;
    size_t n = 200000;
    char *s = malloc(n);
    memset(s, 'a', n);
    ds4_tokens out = {0};
    double t0 = ds4_now();
    CHECK(ds4_tokenizer_encode(t, s, n, false, &out) == DS4_OK, "%s", ds4_errmsg());
    CHECK(out.n == (int64_t)n / 2, "aaaa... merges pairwise: %lld ids", (long long)out.n);
    int all_aa = 1;
    for (int64_t i = 0; i < out.n; i++) all_aa &= out.ids[i] == 265;
    CHECK(all_aa);
    ds4_tokens_free(&out);
    memset(s, ' ', n);
    CHECK(ds4_tokenizer_encode(t, s, n, false, &out) == DS4_OK, "%s", ds4_errmsg());
    CHECK(out.n == (int64_t)n / 2 && out.ids[0] == 267);
    ds4_tokens_free(&out);
    CHECK(ds4_now() - t0 < 2.0, "long pieces took %.2f s", ds4_now() - t0);
    free(s);
    ds4_tokenizer_free(t);
}

int main(void) {
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    RUN(test_byte_tokenizer);
    RUN(test_deepseek_layout);
    RUN(test_merge_forms);
    RUN(test_gpt2_layout);
    RUN(test_split_behaviors);
    RUN(test_corrupt);
    RUN(test_load_dir);
    RUN(test_long_pieces);
    ds4_mem_get(&m1);
    t_cur_failed = 0;
    CHECK(m1.live_total == m0.live_total, "counted bytes leaked: %lld", (long long)(m1.live_total - m0.live_total));
    if (t_cur_failed) t_failed++; else t_passed++;
    TEST_MAIN_END("test_tokenizer");
}
