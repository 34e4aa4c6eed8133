/* TOML parser: values, tables, errors with file:line:col, typed getters, overrides, the schema
 * check, and a deterministic mutation fuzz (run it under ASan: `make asan`). */
#include "ds4/toml.h"
#include "test.h"

#include <unistd.h>

/* Parses from an exact-size heap copy, so any read past `len` is an ASan error. */
static ds4_status parse_exact(const char *text, size_t len, ds4_toml **out) {
    char *copy = malloc(len ? len : 1);
    memcpy(copy, text, len);
    ds4_status st = ds4_toml_parse(copy, len, "t.toml", out);
    free(copy);
    return st;
}

static ds4_toml *parse_ok(const char *text) {
    ds4_toml *t = NULL;
    ds4_status st = parse_exact(text, strlen(text), &t);
    CHECK(st == DS4_OK, "parse failed: %s\n--- input:\n%s", ds4_errmsg(), text);
    return t;
}

/* The parse must fail and the message must contain `want`. */
static void parse_bad(const char *text, const char *want) {
    ds4_toml *t = NULL;
    ds4_status st = parse_exact(text, strlen(text), &t);
    CHECK(st == DS4_ERR_FORMAT, "expected a format error for: %s", text);
    CHECK(t == NULL, "tree returned on error");
    CHECK(strstr(ds4_errmsg(), want) != NULL, "message '%s' lacks '%s' (input: %s)", ds4_errmsg(), want, text);
    ds4_toml_free(t);
}

static int64_t I(const ds4_toml *r, const char *k) {
    int64_t v = -999;
    CHECK(ds4_toml_get_int(r, k, &v) == DS4_OK, "%s: %s", k, ds4_errmsg());
    return v;
}
static double F(const ds4_toml *r, const char *k) {
    double v = -999;
    CHECK(ds4_toml_get_float(r, k, &v) == DS4_OK, "%s: %s", k, ds4_errmsg());
    return v;
}
static const char *S(const ds4_toml *r, const char *k) {
    const char *v = "";
    CHECK(ds4_toml_get_string(r, k, &v) == DS4_OK, "%s: %s", k, ds4_errmsg());
    return v;
}

static const char *k_config =
    "# ds4 training config\n"
    "[job]\n"
    "name = \"dsv4-tiny\"   # trailing comment\n"
    "dump_folder = './out'\n"
    "\n"
    "[model]\n"
    "config = \"configs/tiny.json\"\n"
    "\n"
    "[training]\n"
    "seq_len = 2_048\n"
    "batch_size = 8\n"
    "steps = 0x10\n"
    "seed = -7\n"
    "compile = false\n"
    "lr = 3e-4\n"
    "warmup = 1.5\n"
    "dataset.path = \"data/train_*.bin\"\n"
    "dataset.\"val fraction\" = 0.01\n"
    "\n"
    "[optimizer.adamw]\n"
    "betas = [0.9, 0.95,]\n"
    "eps = 1e-8\n"
    "\n"
    "[parallel]\n"
    "ranks = [\n"
    "  [0, 1],   # first pair\n"
    "  [2, 3],\n"
    "]\n"
    "inline = { a = 1, b.c = \"x\" }\n";

static void test_values(void) {
    ds4_toml *r = parse_ok(k_config);
    if (!r) return;
    CHECK(strcmp(S(r, "job.name"), "dsv4-tiny") == 0);
    CHECK(strcmp(S(r, "job.dump_folder"), "./out") == 0);
    CHECK(I(r, "training.seq_len") == 2048);
    CHECK(I(r, "training.steps") == 16);
    CHECK(I(r, "training.seed") == -7);
    bool b = true;
    CHECK(ds4_toml_get_bool(r, "training.compile", &b) == DS4_OK && b == false);
    CHECK(F(r, "training.lr") == 3e-4);
    CHECK(F(r, "training.warmup") == 1.5);
    CHECK(F(r, "training.batch_size") == 8.0, "floats accept integers");
    CHECK(strcmp(S(r, "training.dataset.path"), "data/train_*.bin") == 0);
    const ds4_toml *ds = ds4_toml_find(r, "training.dataset");
    CHECK(ds && ds->type == DS4_TOML_TABLE && ds->n_kids == 2);
    if (ds && ds->n_kids == 2) CHECK(strcmp(ds->kids[1]->key, "val fraction") == 0 && ds->kids[1]->v.f == 0.01);
    const ds4_toml *betas = ds4_toml_find(r, "optimizer.adamw.betas");
    CHECK(betas && betas->type == DS4_TOML_ARRAY && betas->n_kids == 2);
    if (betas && betas->n_kids == 2) CHECK(betas->kids[0]->v.f == 0.9 && betas->kids[1]->v.f == 0.95);
    CHECK(F(r, "optimizer.adamw.eps") == 1e-8);
    const ds4_toml *ranks = ds4_toml_find(r, "parallel.ranks");
    CHECK(ranks && ranks->n_kids == 2 && ranks->kids[1]->type == DS4_TOML_ARRAY && ranks->kids[1]->kids[1]->v.i == 3);
    CHECK(I(r, "parallel.inline.a") == 1);
    CHECK(strcmp(S(r, "parallel.inline.b.c"), "x") == 0);
    CHECK(ds4_toml_find(r, "training.nope") == NULL);
    CHECK(ds4_toml_find(r, "training.seq_len.x") == NULL, "a leaf has no children");
    /* positions: line 10 holds seq_len, column 1 */
    const ds4_toml *sl = ds4_toml_find(r, "training.seq_len");
    CHECK(sl && sl->line == 10 && sl->col == 1, "seq_len at %d:%d", sl ? sl->line : -1, sl ? sl->col : -1);
    /* defaults */
    int64_t v = 0;
    CHECK(ds4_toml_int_or(r, "training.missing", 42, &v) == DS4_OK && v == 42);
    const char *s = NULL;
    CHECK(ds4_toml_string_or(r, "job.missing", "dflt", &s) == DS4_OK && strcmp(s, "dflt") == 0);
    ds4_toml_free(r);
}

static void test_strings(void) {
    ds4_toml *r = parse_ok("a = \"tab\\there \\\"q\\\" back\\\\ \\u00e9 \\U0001F600\"\n"
                           "b = 'C:\\path\\no escapes'\n"
                           "c = \"\"\"\nline1\nline2 \\\n    joined\"\"\"\n"
                           "d = '''\nraw \\n text\n'''\n"
                           "e = \"\"\"two \"\" quotes\"\"\"\"\"\n"
                           "f = \"\"\n"
                           "\"quoted key\" = 1\n"
                           "'lit.key' = 2\n"
                           "g = \"caf\xc3\xa9 \xe4\xb8\xad\"\n");
    if (!r) return;
    CHECK(strcmp(S(r, "a"), "tab\there \"q\" back\\ \xc3\xa9 \xf0\x9f\x98\x80") == 0, "a = [%s]", S(r, "a"));
    CHECK(strcmp(S(r, "b"), "C:\\path\\no escapes") == 0);
    CHECK(strcmp(S(r, "c"), "line1\nline2 joined") == 0, "c = [%s]", S(r, "c"));
    CHECK(strcmp(S(r, "d"), "raw \\n text\n") == 0, "d = [%s]", S(r, "d"));
    CHECK(strcmp(S(r, "e"), "two \"\" quotes\"\"") == 0, "e = [%s]", S(r, "e"));
    CHECK(strcmp(S(r, "f"), "") == 0);
    CHECK(r->n_kids == 9 && strcmp(r->kids[6]->key, "quoted key") == 0 && strcmp(r->kids[7]->key, "lit.key") == 0);
    CHECK(strcmp(S(r, "g"), "caf\xc3\xa9 \xe4\xb8\xad") == 0);
    ds4_toml_free(r);
}

static void test_numbers(void) {
    ds4_toml *r = parse_ok("a = +99\nb = -0\nc = 1_000_000\nd = 0xDEAD_beef\ne = 0o755\nf = 0b1101\n"
                           "g = 9223372036854775807\nh = -9223372036854775808\n"
                           "i = 6.626e-34\nj = -1E+3\nk = 1_0.2_5\nl = inf\nm = -inf\nn = nan\no = +inf\np = 0.0\n"
                           "q = true\nr = false\n");
    if (!r) return;
    CHECK(I(r, "a") == 99 && I(r, "b") == 0 && I(r, "c") == 1000000);
    CHECK(I(r, "d") == 0xdeadbeef && I(r, "e") == 0755 && I(r, "f") == 13);
    CHECK(I(r, "g") == INT64_MAX && I(r, "h") == INT64_MIN);
    CHECK(F(r, "i") == 6.626e-34 && F(r, "j") == -1000.0 && F(r, "k") == 10.25);
    CHECK(isinf(F(r, "l")) && F(r, "l") > 0 && isinf(F(r, "m")) && F(r, "m") < 0 && isnan(F(r, "n")));
    CHECK(isinf(F(r, "o")) && F(r, "p") == 0.0);
    bool q = false, rr = true;
    CHECK(ds4_toml_get_bool(r, "q", &q) == DS4_OK && q && ds4_toml_get_bool(r, "r", &rr) == DS4_OK && !rr);
    ds4_toml_free(r);

    parse_bad("a = 012\n", "leading zeros");
    parse_bad("a = 1__0\n", "invalid number '1__0'");
    parse_bad("a = _1\n", "t.toml:1:5:");
    parse_bad("a = 1_\n", "invalid number");
    parse_bad("a = 9223372036854775808\n", "does not fit in 64 bits");
    parse_bad("a = -9223372036854775809\n", "does not fit in 64 bits");
    parse_bad("a = 0xFFFFFFFFFFFFFFFFF\n", "does not fit in 64 bits");
    parse_bad("a = -0x10\n", "take no sign");
    parse_bad("a = 1.\n", "expected digits after '.'");
    parse_bad("a = .5\n", "expected a value");
    parse_bad("a = 1e\n", "exponent");
    parse_bad("a = 1e999\n", "out of range");
    parse_bad("a = 0x\n", "invalid number");
    parse_bad("a = 0b102\n", "invalid number");
    parse_bad("a = truex\n", "expected a value");
    parse_bad("a = 1979-05-27\n", "dates and times are not supported");
    parse_bad("a = 07:32:00\n", "dates and times are not supported");
}

/* TOML 1.0's number grammar: the specification's valid and invalid examples, and the floats of
 * TorchTitan's configs (2.2e-4 once read as a date because its fifth character is '-'). */
static void test_number_grammar(void) {
    static const struct {
        const char *text;
        double want;
    } floats[] = {{"2.2e-4", 2.2e-4},   {"6.0e-4", 6.0e-4},   {"2.2E-4", 2.2e-4},  {"1.5e-10", 1.5e-10},
                  {"1000e-5", 1000e-5}, {"8e-4", 8e-4},       {"+1.0", 1.0},       {"3.1415", 3.1415},
                  {"-0.01", -0.01},     {"5e+22", 5e+22},     {"1e06", 1e06},      {"-2E-2", -2e-2},
                  {"6.626e-34", 6.626e-34}, {"224_617.445_991_228", 224617.445991228}, {"-0.0", -0.0},
                  {"+0.0", 0.0},        {"1e1_0", 1e10},      {"0e0", 0.0},        {"1_2.3_4e-0_1", 1.234}};
    for (size_t i = 0; i < sizeof floats / sizeof floats[0]; i++) {
        char text[96];
        snprintf(text, sizeof text, "lr = %s\n", floats[i].text);
        ds4_toml *r = parse_ok(text);
        const ds4_toml *n = r ? ds4_toml_find(r, "lr") : NULL;
        CHECK(n && n->type == DS4_TOML_FLOAT && n->v.f == floats[i].want, "%s", floats[i].text);
        ds4_toml_free(r);
        /* the same on the command line */
        r = parse_ok("[optimizer]\nlr = 1\n");
        char *argv[] = {"ds4", "--optimizer.lr", (char *)floats[i].text, NULL};
        int argc = 3;
        CHECK(r && ds4_toml_apply_overrides(r, &argc, argv) == DS4_OK, "%s", ds4_errmsg());
        n = r ? ds4_toml_find(r, "optimizer.lr") : NULL;
        CHECK(n && n->type == DS4_TOML_FLOAT && n->v.f == floats[i].want, "--optimizer.lr %s", floats[i].text);
        ds4_toml_free(r);
    }
    static const struct {
        const char *text;
        int64_t want;
    } ints[] = {{"+99", 99},  {"42", 42},           {"0", 0},          {"-17", -17},         {"1_000", 1000},
                {"5_349_221", 5349221}, {"53_49_221", 5349221}, {"1_2_3_4_5", 12345}, {"0xDEADBEEF", 0xdeadbeef},
                {"0xdead_beef", 0xdeadbeef}, {"0o01234567", 01234567}, {"0o755", 0755}, {"0b11010110", 0xd6},
                {"+0", 0},    {"-0", 0},            {"0x00ff", 255}};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) {
        char text[96];
        snprintf(text, sizeof text, "k = %s\n", ints[i].text);
        ds4_toml *r = parse_ok(text);
        const ds4_toml *n = r ? ds4_toml_find(r, "k") : NULL;
        CHECK(n && n->type == DS4_TOML_INT && n->v.i == ints[i].want, "%s", ints[i].text);
        ds4_toml_free(r);
    }
    ds4_toml *r = parse_ok("a = inf\nb = +inf\nc = -inf\nd = nan\ne = +nan\nf = -nan\n");
    if (r) CHECK(isinf(F(r, "b")) && F(r, "b") > 0 && F(r, "c") < 0 && isnan(F(r, "e")) && isnan(F(r, "f")));
    ds4_toml_free(r);
    static const char *bad[] = {".7",   "7.",    "3.e+20", "1e",     "1e+",   "1e_1",  "1e1_",   "1._5",  "1_.5",
                                "01.5", "00",    "0_1",    "+01",    "1__2",  "_1",    "1_",     "0x",    "0xg",
                                "0X10", "+0x1",  "-0o7",   "0o8",    "0b2",   "0x_1",  "0x1_",   "1.5.2", "1e5e5",
                                "1E",   "e5",    "+",      "-",      "++1",   "+-1",   "infx",   "Inf",   "NaN",
                                "1-2",  "2.2e-", "1.0e-4x", "0.1_",  "1__0.5", "1e--5", "2.2f-4"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        char text[96];
        snprintf(text, sizeof text, "k = %s\n", bad[i]);
        ds4_toml *t = NULL;
        CHECK(parse_exact(text, strlen(text), &t) == DS4_ERR_FORMAT, "'%s' was accepted", bad[i]);
        CHECK(!strstr(ds4_errmsg(), "dates"), "'%s' called a date: %s", bad[i], ds4_errmsg());
        ds4_toml_free(t);
    }
    static const char *dates[] = {"1979-05-27", "1979-05-27T07:32:00Z", "1979-05-27T00:32:00.999999-07:00",
                                  "07:32:00", "00:32:00.999999", "1979-05-27 07:32:00"};
    for (size_t i = 0; i < sizeof dates / sizeof dates[0]; i++) {
        char text[96];
        snprintf(text, sizeof text, "k = %s\n", dates[i]);
        parse_bad(text, "dates and times are not supported");
    }
}

static void test_errors(void) {
    parse_bad("a = 1\na = 2\n", "t.toml:2:1: duplicate key 'a' (first defined at line 1)");
    parse_bad("[x]\nk = 1\n[y]\n[x]\n", "t.toml:4:1: duplicate table [x] (first defined at line 1)");
    parse_bad("x.y = 1\nx.y = 2\n", "duplicate key 'x.y'");
    parse_bad("x = 1\nx.y = 2\n", "key 'x' is already an integer (line 1)");
    parse_bad("x = 1\n[x.y]\n", "is already an integer");
    parse_bad("[a]\nb.c = 1\n[a.b]\n", "table [a.b] was already defined by dotted keys at line 2");
    parse_bad("[a.b]\n[a]\nb.c = 1\n", "dotted keys cannot extend it");
    parse_bad("a = {b = 1}\na.c = 2\n", "defined inline");
    parse_bad("a = {b = 1}\n[a.c]\n", "defined inline");
    parse_bad("a = {b = 1, b = 2}\n", "duplicate key 'b'");
    parse_bad("key value\n", "t.toml:1:5: expected '=' after key 'key', got 'v'");
    parse_bad("key = \n", "t.toml:1:7: expected a value");
    parse_bad("key =", "got end of file");
    parse_bad("= 1\n", "t.toml:1:1: expected a key, got '='");
    parse_bad("a = \"open\n", "newline in a single-line string");
    parse_bad("a = \"open", "unterminated string opened at line 1");
    parse_bad("a = '''open\n\n", "unterminated string");
    parse_bad("a = \"bad \\q\"\n", "t.toml:1:10: invalid escape '\\q'");
    parse_bad("a = \"\\u12\"\n", "expected 4 hex digits");
    parse_bad("a = \"\\uD800\"\n", "not a Unicode scalar value");
    parse_bad("a = \"\\u0000\"\n", "NUL");
    parse_bad("a = \"bad \xff utf8\"\n", "invalid UTF-8");
    parse_bad("a = \"ctl \x01\"\n", "control character 0x01");
    parse_bad("a = [1, 2\n", "unterminated array opened at line 1");
    parse_bad("a = [1 2]\n", "expected ',' or ']' in array, got '2'");
    parse_bad("a = [,]\n", "expected a value");
    parse_bad("a = {x = 1\n", "expected ',' or '}' in inline table");
    parse_bad("a = {x = 1,}\n", "expected a key, got '}'");
    parse_bad("[[fruit]]\n", "t.toml:1:1: arrays of tables [[...]] are not supported");
    parse_bad("[a\n", "expected ']' after table name 'a'");
    parse_bad("[]\n", "expected a key");
    parse_bad("a = 1 b = 2\n", "t.toml:1:7: expected end of line, got 'b'");
    parse_bad("a = 1\r", "expected end of line");
    parse_bad("\"multi\nkey\" = 1\n", "newline in a single-line string");
    parse_bad("\"\"\"k\"\"\" = 1\n", "multi-line strings cannot be keys");
    /* deep nesting is an error, not a stack overflow */
    char deep[400];
    memset(deep, '[', sizeof deep);
    memcpy(deep, "a = ", 4);
    deep[sizeof deep - 1] = 0;
    parse_bad(deep, "nested deeper than 64");
    /* ok edge cases */
    ds4_toml *r = parse_ok("");
    CHECK(r && r->n_kids == 0);
    ds4_toml_free(r);
    r = parse_ok("\xef\xbb\xbf# only a comment");
    ds4_toml_free(r);
    r = parse_ok("a=1\r\nb = [\r\n 2 ,\r\n]\r\n[t] # c\r\n");
    if (r) CHECK(I(r, "a") == 1 && ds4_toml_find(r, "b")->n_kids == 1 && ds4_toml_find(r, "t") != NULL);
    ds4_toml_free(r);
    r = parse_ok("[a.b.c]\nx = 1\n[a]\ny = 2\n[a.b]\nz = 3\n");
    if (r) CHECK(I(r, "a.b.c.x") == 1 && I(r, "a.y") == 2 && I(r, "a.b.z") == 3);
    ds4_toml_free(r);
    r = parse_ok("[fruit]\napple.color = 'red'\n[fruit.apple.texture]\nsmooth = true\n");
    ds4_toml_free(r);
}

/* Corner cases from the TOML 1.0 specification's own examples. */
static void test_spec_examples(void) {
    ds4_toml *r = parse_ok("\"key with spaces\" = 1\n"
                           "site.\"google.com\" = true\n"
                           "3.14159 = \"pi\"\n"
                           "a . b . c = 2\n"
                           "str4 = \"\"\"Here are two quotation marks: \"\". Simple enough.\"\"\"\n"
                           "str5 = \"\"\"Here are three quotation marks: \"\"\\\".\"\"\"\n"
                           "str7 = \"\"\"\"This,\" she said, \"is just a pointless statement.\"\"\"\"\n"
                           "regex2 = '''I [dw]on't need \\d{2} apples'''\n"
                           "apos15 = \"Here are fifteen apostrophes: '''''''''''''''\"\n"
                           "int7 = 0o0\n"
                           "flt8 = 224_617.445_991_228\n"
                           "contributors = [\n  \"Foo Bar <foo@example.com>\",\n"
                           "  { name = \"Baz Qux\", email = \"bazqux@example.com\" }\n]\n"
                           "nested_mixed_array = [ [ 1, 2 ], [\"a\", \"b\", \"c\"] ]\n"
                           "[dog.\"tater.man\"]\ntype.name = \"pug\"\n"
                           "[ j . \"\xca\x9e\" . 'l' ]  # spaces in a header\nk = 1\n");
    if (!r) return;
    const ds4_toml *pi = ds4_toml_find(r, "3.14159");
    CHECK(pi && pi->type == DS4_TOML_STRING && strcmp(pi->v.s, "pi") == 0, "dotted key 3.14159 is table 3, key 14159");
    CHECK(I(r, "a.b.c") == 2);
    CHECK(strcmp(S(r, "str4"), "Here are two quotation marks: \"\". Simple enough.") == 0);
    CHECK(strcmp(S(r, "str5"), "Here are three quotation marks: \"\"\".") == 0, "[%s]", S(r, "str5"));
    CHECK(strcmp(S(r, "str7"), "\"This,\" she said, \"is just a pointless statement.\"") == 0, "[%s]", S(r, "str7"));
    CHECK(strcmp(S(r, "regex2"), "I [dw]on't need \\d{2} apples") == 0);
    CHECK(strcmp(S(r, "apos15"), "Here are fifteen apostrophes: '''''''''''''''") == 0);
    CHECK(I(r, "int7") == 0 && F(r, "flt8") == 224617.445991228);
    const ds4_toml *c = ds4_toml_find(r, "contributors");
    CHECK(c && c->n_kids == 2 && c->kids[1]->type == DS4_TOML_TABLE && c->kids[1]->n_kids == 2);
    const ds4_toml *dog = ds4_toml_find(r, "dog");
    CHECK(dog && dog->n_kids == 1 && strcmp(dog->kids[0]->key, "tater.man") == 0);
    const ds4_toml *j = ds4_toml_find(r, "j");
    CHECK(j && strcmp(j->kids[0]->key, "\xca\x9e") == 0 && strcmp(j->kids[0]->kids[0]->key, "l") == 0);
    ds4_toml_free(r);
}

static void test_getter_errors(void) {
    ds4_toml *r = parse_ok("[training]\nseq_len = \"long\"\nlr = 1\nflag = 1\n");
    if (!r) return;
    int64_t v;
    double f;
    bool b;
    const char *s;
    CHECK(ds4_toml_get_int(r, "training.seq_len", &v) == DS4_ERR_CONFIG);
    CHECK(strcmp(ds4_errmsg(), "t.toml:2:1: key training.seq_len: expected integer, got string \"long\"") == 0, "%s",
          ds4_errmsg());
    CHECK(ds4_toml_get_float(r, "training.lr", &f) == DS4_OK && f == 1.0);
    CHECK(ds4_toml_get_bool(r, "training.flag", &b) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "expected boolean, got integer"));
    CHECK(ds4_toml_get_string(r, "training.lr", &s) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "expected string, got integer"));
    CHECK(ds4_toml_get_int(r, "training.steps", &v) == DS4_ERR_MISSING);
    CHECK(strcmp(ds4_errmsg(), "t.toml: missing key training.steps") == 0, "%s", ds4_errmsg());
    CHECK(ds4_toml_int_or(r, "training.seq_len", 5, &v) == DS4_ERR_CONFIG, "wrong type is an error even with a default");
    CHECK(ds4_toml_get_int(r, "training", &v) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "got table"));
    ds4_toml_free(r);
}

static void test_overrides(void) {
    ds4_toml *r = parse_ok("[training]\nseq_len = 128\nlr = 1e-3\n[job]\nname = 'a'\n");
    if (!r) return;
    char *argv[] = {"ds4", "train", "--config", "x.toml", "--training.seq_len", "256", "--training.lr=3e-4",
                    "--job.name", "run 2", "--new.table.key", "[1, 2]", "--training.compile", "--verbose",
                    "--optimizer.eps", "-1e-8", "--training.flag", NULL};
    int argc = 16;
    CHECK(ds4_toml_apply_overrides(r, &argc, argv) == DS4_OK, "%s", ds4_errmsg());
    CHECK(argc == 5, "argc = %d", argc);
    CHECK(strcmp(argv[1], "train") == 0 && strcmp(argv[2], "--config") == 0 && strcmp(argv[3], "x.toml") == 0 &&
          strcmp(argv[4], "--verbose") == 0 && argv[5] == NULL);
    CHECK(I(r, "training.seq_len") == 256);
    CHECK(F(r, "training.lr") == 3e-4);
    CHECK(strcmp(S(r, "job.name"), "run 2") == 0, "unparseable value falls back to a string");
    const ds4_toml *a = ds4_toml_find(r, "new.table.key");
    CHECK(a && a->type == DS4_TOML_ARRAY && a->n_kids == 2 && a->kids[1]->v.i == 2);
    bool b = false;
    CHECK(ds4_toml_get_bool(r, "training.compile", &b) == DS4_OK && b, "bare dotted flag followed by a flag is true");
    CHECK(ds4_toml_get_bool(r, "training.flag", &b) == DS4_OK && b, "bare dotted flag at the end is true");
    CHECK(F(r, "optimizer.eps") == -1e-8, "negative number is a value, not a flag");
    /* an override that makes a type wrong is reported against the flag */
    CHECK(ds4_toml_set(r, "training.seq_len", "lots") == DS4_OK);
    int64_t v;
    CHECK(ds4_toml_get_int(r, "training.seq_len", &v) == DS4_ERR_CONFIG);
    CHECK(strcmp(ds4_errmsg(), "--training.seq_len: expected integer, got string \"lots\"") == 0, "%s", ds4_errmsg());
    CHECK(ds4_toml_set(r, "training.lr.x", "1") == DS4_ERR_ARG && strstr(ds4_errmsg(), "not a table"));
    CHECK(ds4_toml_set(r, "training", "1") == DS4_ERR_ARG && strstr(ds4_errmsg(), "is a table"));
    CHECK(ds4_toml_set(r, "a..b", "1") == DS4_ERR_ARG);
    CHECK(ds4_toml_set(r, "quoted", "'x y'") == DS4_OK && strcmp(S(r, "quoted"), "x y") == 0);
    ds4_toml_free(r);
}

static void test_schema(void) {
    static const char *known[] = {"job.name", "training.seq_len", "training.lr", "training.steps",
                                  "optimizer.name", "model.extra.*", "empty.key"};
    int64_t nk = 7;
    ds4_toml *r = parse_ok("[job]\nname = 'x'\n[training]\nseq_len = 1\nlr = 2\n[model.extra]\nanything.goes = 1\n[empty]\n");
    if (!r) return;
    CHECK(ds4_toml_check_keys(r, known, nk) == DS4_OK, "%s", ds4_errmsg());
    ds4_toml_free(r);
    r = parse_ok("[training]\nseq_len = 1\nseq_lne = 2\n");
    CHECK(ds4_toml_check_keys(r, known, nk) == DS4_ERR_CONFIG);
    CHECK(strcmp(ds4_errmsg(), "t.toml:3:1: unknown key 'training.seq_lne' (did you mean 'training.seq_len'?)") == 0,
          "%s", ds4_errmsg());
    CHECK(ds4_toml_set(r, "training.seq_lne", "3") == DS4_OK); /* now set by an override */
    CHECK(ds4_toml_check_keys(r, known, nk) == DS4_ERR_CONFIG);
    CHECK(strcmp(ds4_errmsg(), "--training.seq_lne: unknown key (did you mean 'training.seq_len'?)") == 0, "%s",
          ds4_errmsg());
    ds4_toml_free(r);
    r = parse_ok("[optimiser]\nname = 'adamw'\n");
    CHECK(ds4_toml_check_keys(r, known, nk) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "did you mean 'optimizer.name'"),
          "%s", ds4_errmsg());
    ds4_toml_free(r);
    r = parse_ok("[nothing]\n");
    CHECK(ds4_toml_check_keys(r, known, nk) == DS4_ERR_CONFIG && strstr(ds4_errmsg(), "unknown key 'nothing'"));
    ds4_toml_free(r);
    CHECK(ds4_edit_distance("kitten", "sitting") == 3);
    CHECK(ds4_edit_distance("", "abc") == 3 && ds4_edit_distance("abc", "abc") == 0);
    CHECK(ds4_closest_name("trainng.lr", known, nk) == 2);
}

static void test_load(void) {
    char path[] = "/tmp/ds4_test_toml_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    if (fd < 0) return;
    const char *text = "[a]\nb = 'x'\nc = [\n";
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    ds4_toml *r = NULL;
    CHECK(ds4_toml_load(path, &r) == DS4_ERR_FORMAT && r == NULL);
    char want[128];
    snprintf(want, sizeof want, "%s:4:1: unterminated array", path);
    CHECK(strstr(ds4_errmsg(), want) == ds4_errmsg(), "%s", ds4_errmsg());
    unlink(path);
    CHECK(ds4_toml_load("/nonexistent/dir/x.toml", &r) == DS4_ERR_IO);
    CHECK(strstr(ds4_errmsg(), "/nonexistent/dir/x.toml: cannot open") != NULL, "%s", ds4_errmsg());
}

/* Walks a parsed tree and checks what every node must satisfy. */
static int64_t check_tree(const ds4_toml *n, int depth) {
    CHECK(depth < 5000);
    int64_t count = 1;
    if (n->type == DS4_TOML_STRING) CHECK(n->v.s != NULL);
    if (n->type == DS4_TOML_TABLE)
        for (int64_t i = 0; i < n->n_kids; i++) CHECK(n->kids[i]->key != NULL);
    for (int64_t i = 0; i < n->n_kids; i++) count += check_tree(n->kids[i], depth + 1);
    return count;
}

static void test_fuzz(void) {
    const char *tokens[] = {"[", "]", "{", "}", "\"", "'", "\"\"\"", "'''", "=", ",", ".", "\n", "#", "\\", "\\u",
                            "0x", "_", "e", "-", "+", "inf", "nan", "true", " ", "\r\n", "[[", "a.b", "\xc3", "\xff", "9"};
    size_t base_len = strlen(k_config);
    char *buf = malloc(base_len + 64);
    int n_ok = 0, n_err = 0;
    for (uint64_t it = 0; it < 20000; it++) {
        size_t len = base_len;
        memcpy(buf, k_config, len);
        int n_mut = 1 + (int)(ds4_rng_u64(11, it, 0) % 3);
        for (int m = 0; m < n_mut; m++) {
            uint64_t r = ds4_rng_u64(11, it, 1 + (uint64_t)m);
            size_t pos = len ? (size_t)((r >> 8) % len) : 0;
            switch (r % 5) {
            case 0: if (len) buf[pos] = (char)(r >> 40); break;                          /* flip a byte */
            case 1: if (len) memmove(buf + pos, buf + pos + 1, len - pos - 1), len--; break; /* delete */
            case 2: len = pos; break;                                                    /* truncate */
            default: {                                                                   /* insert a token */
                const char *t = tokens[(r >> 40) % (sizeof tokens / sizeof *tokens)];
                size_t tl = strlen(t);
                if (len + tl > base_len + 60) break;
                memmove(buf + pos + tl, buf + pos, len - pos);
                memcpy(buf + pos, t, tl);
                len += tl;
            }
            }
        }
        ds4_toml *r = NULL;
        ds4_status st = parse_exact(buf, len, &r);
        if (st == DS4_OK) {
            n_ok++;
            CHECK(r != NULL);
            if (r) check_tree(r, 0);
            ds4_toml_free(r);
        } else {
            n_err++;
            CHECK(st == DS4_ERR_FORMAT, "status %d", (int)st);
            CHECK(r == NULL);
            CHECK(strncmp(ds4_errmsg(), "t.toml:", 7) == 0, "message without location: %s", ds4_errmsg());
        }
    }
    free(buf);
    CHECK(n_ok > 1000 && n_err > 1000, "mutations should hit both outcomes: %d ok, %d errors", n_ok, n_err);
}

int main(void) {
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    RUN(test_values);
    RUN(test_strings);
    RUN(test_numbers);
    RUN(test_number_grammar);
    RUN(test_errors);
    RUN(test_spec_examples);
    RUN(test_getter_errors);
    RUN(test_overrides);
    RUN(test_schema);
    RUN(test_load);
    RUN(test_fuzz);
    ds4_mem_get(&m1);
    t_cur_failed = 0;
    CHECK(m1.live_total == m0.live_total, "counted bytes leaked: %lld", (long long)(m1.live_total - m0.live_total));
    if (t_cur_failed) t_failed++; else t_passed++;
    TEST_MAIN_END("test_toml");
}
