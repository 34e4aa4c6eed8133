/* Core: allocator accounting, tensors and views, RNG, status messages. */
#include "ds4/core.h"
#include "test.h"

static void test_alloc_counts_exact_bytes(void) {
    ds4_mem_stats a, b, c;
    ds4_mem_get(&a);
    void *p = ds4_alloc(DS4_MEM_ACT, 1000);
    void *q = ds4_alloc(DS4_MEM_GRAD, 24);
    ds4_mem_get(&b);
    CHECK(p && q);
    CHECK(((uintptr_t)p & 63) == 0, "not 64-byte aligned");
    CHECK(b.live[DS4_MEM_ACT] - a.live[DS4_MEM_ACT] == 1000);
    CHECK(b.live[DS4_MEM_GRAD] - a.live[DS4_MEM_GRAD] == 24);
    CHECK(b.live_total - a.live_total == 1024);
    CHECK(ds4_alloc_size(p) == 1000);
    ds4_free(p);
    ds4_mem_get(&c);
    CHECK(c.live[DS4_MEM_ACT] == a.live[DS4_MEM_ACT]);
    CHECK(c.peak[DS4_MEM_ACT] >= a.live[DS4_MEM_ACT] + 1000);
    ds4_free(q);
}

static void test_peak_tracks_sum(void) {
    ds4_mem_reset_peak();
    ds4_mem_stats a, b;
    ds4_mem_get(&a);
    void *p = ds4_alloc(DS4_MEM_ACT, 4096);
    ds4_free(p);
    void *q = ds4_alloc(DS4_MEM_WORK, 100);
    ds4_mem_get(&b);
    CHECK(b.peak_total - a.live_total == 4096, "peak %lld live %lld", (long long)b.peak_total,
          (long long)a.live_total);
    ds4_free(q);
}

static void test_tensor_views_share_storage(void) {
    ds4_tensor t, v;
    int64_t shape[2] = {3, 5};
    CHECK(ds4_tensor_zeros(&t, DS4_MEM_ACT, DS4_F32, 2, shape) == DS4_OK);
    CHECK(ds4_tensor_numel(&t) == 15 && ds4_tensor_bytes(&t) == 60);
    v = ds4_tensor_view(&t);
    ds4_f32(&v)[4] = 2.5f;
    CHECK(ds4_f32(&t)[4] == 2.5f);
    ds4_mem_stats a, b;
    ds4_mem_get(&a);
    ds4_tensor_free(&t);
    ds4_mem_get(&b);
    CHECK(b.live[DS4_MEM_ACT] == a.live[DS4_MEM_ACT], "storage freed while a view is alive");
    ds4_tensor_free(&v);
    ds4_mem_get(&b);
    CHECK(a.live[DS4_MEM_ACT] - b.live[DS4_MEM_ACT] == 60);
    char buf[64];
    CHECK(strcmp(ds4_dims_str(2, shape, buf, sizeof buf), "[3, 5]") == 0);
}

static void test_rng_counter_based(void) {
    CHECK(ds4_rng_u64(1, 2, 3) == ds4_rng_u64(1, 2, 3));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(1, 2, 4));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(1, 3, 3));
    CHECK(ds4_rng_u64(1, 2, 3) != ds4_rng_u64(2, 2, 3));
    double s = 0, s2 = 0;
    int n = 200000;
    for (int i = 0; i < n; i++) {
        double x = ds4_rng_normal(7, 0, (uint64_t)i);
        s += x;
        s2 += x * x;
    }
    CHECK(fabs(s / n) < 0.01, "mean %g", s / n);
    CHECK(fabs(s2 / n - 1.0) < 0.02, "var %g", s2 / n);
    for (int i = 0; i < 1000; i++) {
        float u = ds4_rng_uniform(3, 4, (uint64_t)i);
        CHECK(u >= 0.0f && u < 1.0f);
    }
}

static void test_status_messages(void) {
    ds4_status s = ds4_fail(DS4_ERR_FORMAT, "file %s: bad %d", "x.bin", 7);
    CHECK(s == DS4_ERR_FORMAT);
    CHECK(strcmp(ds4_errmsg(), "file x.bin: bad 7") == 0);
    ds4_fail_prefix(s, "loading");
    CHECK(strcmp(ds4_errmsg(), "loading: file x.bin: bad 7") == 0);
}

static void test_bf16_roundtrip(void) {
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(1.0f)) == 1.0f);
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(-3.5f)) == -3.5f);
    float x = 1.00390625f; /* 1 + 2^-8: exactly half way between bf16 neighbours, rounds to even */
    CHECK(ds4_bf16_to_f32(ds4_f32_to_bf16(x)) == 1.0f);
    CHECK(isnan(ds4_bf16_to_f32(ds4_f32_to_bf16(NAN))));
    CHECK(ds4_f16_to_f32(0x3c00) == 1.0f && ds4_f16_to_f32(0xc000) == -2.0f);
    ds4_dtype d;
    CHECK(ds4_dtype_from_name("F8_E4M3", &d) && d == DS4_F8_E4M3 && ds4_dtype_size(d) == 1);
    CHECK(!ds4_dtype_from_name("F99", &d));
}

/* The checked arithmetic every size from input goes through. */
static void test_checked_sizes(void) {
    int64_t r = -1;
    CHECK(ds4_mul_i64(3, 5, &r) && r == 15);
    CHECK(!ds4_mul_i64((int64_t)1 << 32, (int64_t)1 << 32, &r));
    CHECK(!ds4_mul_i64(INT64_MIN, -1, &r));
    CHECK(ds4_add_i64(INT64_MAX - 1, 1, &r) && r == INT64_MAX);
    CHECK(!ds4_add_i64(INT64_MAX, 1, &r));
    /* zero dims hold no elements but the other dims still multiply (rows x cols of the shape) */
    int64_t n = -1;
    CHECK(ds4_shape_fits(3, (const int64_t[]){2, 3, 4}, 4, &n) && n == 24);
    CHECK(ds4_shape_fits(3, (const int64_t[]){0, 1 << 20, 1 << 20}, 8, &n) && n == 0);
    CHECK(!ds4_shape_fits(3, (const int64_t[]){0, (int64_t)1 << 40, (int64_t)1 << 40}, 1, &n));
    CHECK(!ds4_shape_fits(2, (const int64_t[]){(int64_t)1 << 31, (int64_t)1 << 31}, 4, &n));   /* 2^64 bytes */
    CHECK(ds4_shape_fits(2, (const int64_t[]){(int64_t)1 << 31, (int64_t)1 << 29}, 4, &n) && n == (int64_t)1 << 60);
    CHECK(!ds4_shape_fits(2, (const int64_t[]){-1, 2}, 4, &n));
    CHECK(ds4_shape_fits(0, NULL, 4, &n) && n == 1);
    /* a tensor whose element count fits but whose byte size does not is refused, not wrapped */
    ds4_tensor t;
    CHECK(ds4_tensor_new(&t, DS4_MEM_OTHER, DS4_F32, 2, (const int64_t[]){(int64_t)1 << 31, (int64_t)1 << 31}) == DS4_ERR_ARG);
    CHECK(strstr(ds4_errmsg(), "overflows") != NULL, "%s", ds4_errmsg());
}

static void test_utf8_valid(void) {
    static const struct {
        const char *s;
        bool ok;
    } cases[] = {
        {"", true}, {"layers.0.attn.wq_a.weight", true}, {"caf\xc3\xa9", true}, {"\xe2\x82\xac", true},
        {"\xf0\x9f\x98\x80", true}, {"\xf4\x8f\xbf\xbf", true},          /* U+10FFFF */
        {"\xff", false}, {"\x80", false}, {"a\xc3", false},                    /* stray, continuation, cut short */
        {"\xc0\xaf", false}, {"\xe0\x80\xaf", false}, {"\xf0\x80\x80\xaf", false}, /* overlong '/' */
        {"\xed\xa0\x80", false}, {"\xf4\x90\x80\x80", false},              /* surrogate, > U+10FFFF */
        {"\xc3\x28", false},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK(ds4_utf8_valid(cases[i].s, strlen(cases[i].s)) == cases[i].ok, "case %zu", i);
}

static bool has_raw_control(const char *s) {
    for (const unsigned char *p = (const unsigned char *)s; *p; p++)
        if (*p < 0x20 || *p == 0x7f) return true;
    return false;
}

/* Control bytes from input never reach a terminal raw: every message is stored escaped. */
static void test_messages_escape_controls(void) {
    char buf[64];
    CHECK(strcmp(ds4_escape("a\x1b[2Jb\n\x7f", buf, sizeof buf), "a\\x1b[2Jb\\x0a\\x7f") == 0, "%s", buf);
    CHECK(strcmp(ds4_escape("caf\xc3\xa9", buf, sizeof buf), "caf\xc3\xa9") == 0);        /* UTF-8 stays */
    CHECK(strcmp(ds4_escape("\xc2\x9b" "1m\xff", buf, sizeof buf), "\\xc2\\x9b1m\\xff") == 0, "%s", buf); /* C1 CSI, bad byte */
    CHECK(strcmp(ds4_escape("ab\x01", buf, 6), "ab") == 0);                       /* never half an escape */
    CHECK(ds4_fail(DS4_ERR_FORMAT, "f: tensor '%s' bad", "x\x1b]0;title\x07y") == DS4_ERR_FORMAT);
    CHECK(strcmp(ds4_errmsg(), "f: tensor 'x\\x1b]0;title\\x07y' bad") == 0, "%s", ds4_errmsg());
    CHECK(ds4_fail_prefix(DS4_ERR_FORMAT, "dir\r%s", "\t") == DS4_ERR_FORMAT);
    CHECK(strcmp(ds4_errmsg(), "dir\\x0d\\x09: f: tensor 'x\\x1b]0;title\\x07y' bad") == 0, "%s", ds4_errmsg());
    CHECK(!has_raw_control(ds4_errmsg()));
    /* re-failing with the message itself (an argument in the same buffer) keeps it intact */
    ds4_fail(DS4_ERR_IO, "one\x1b");
    ds4_fail(DS4_ERR_IO, "two: %s", ds4_errmsg());
    CHECK(strcmp(ds4_errmsg(), "two: one\\x1b") == 0, "%s", ds4_errmsg());
    /* a long message of control bytes is cut at a whole escape and stays terminated */
    char raw[2000];
    memset(raw, 0x1b, sizeof raw - 1);
    raw[sizeof raw - 1] = 0;
    ds4_fail(DS4_ERR_IO, "%s", raw);
    size_t n = strlen(ds4_errmsg());
    CHECK(n > 900 && n < 1024 && n % 4 == 0 && !has_raw_control(ds4_errmsg()), "%zu", n);
}

/* Byte sizes from flags: binary and decimal units, fractions exact, and every malformed text an error that
 * names the flag and the text, with *out untouched. */
static void test_parse_bytes(void) {
    static const struct {
        const char *s;
        int64_t bytes;
    } good[] = {
        {"64GiB", 68719476736},        {"64GB", 64000000000},       {"68719476736", 68719476736},
        {"1.5TiB", 1649267441664},     {"64 GiB", 68719476736},     {"64gib", 68719476736},
        {"512MiB", 536870912},         {"2KB", 2000},               {"3KiB", 3072},
        {"0.5KiB", 512},               {"1.1KiB", 1126},            {"7B", 7},
        {"0", 0},                      {".25MB", 250000},           {"2.", 2},
        {"1PiB", (int64_t)1 << 50},    {"8191.999999999999PiB", 9223372036854774682},
        {"9223372036854775807", INT64_MAX},
    };
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++) {
        int64_t v = -1;
        CHECK(ds4_parse_bytes("--device-memory", good[i].s, &v) == DS4_OK, "%s: %s", good[i].s, ds4_errmsg());
        CHECK(v == good[i].bytes, "%s -> %lld, expected %lld", good[i].s, (long long)v, (long long)good[i].bytes);
    }
    static const char *bad[] = {"",     "GiB",   "-1GiB", "+1GiB",  "64G",        "64 g",
                                "64GiBs", "64XB", "1e9",  "1.2.3GB", "0x10",      " 64GiB",
                                "64GiB ", "8192PiB", "9223372036854775808", "1.0000000000001GB", "."};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int64_t v = 12345;
        CHECK(ds4_parse_bytes("--device-memory", bad[i], &v) == DS4_ERR_ARG, "'%s' accepted as %lld", bad[i],
              (long long)v);
        CHECK(v == 12345, "'%s': out written on error", bad[i]);
        const char *m = ds4_errmsg();
        CHECK(strstr(m, "--device-memory") && strstr(m, bad[i]) && !strchr(m, '\n'), "'%s': message '%s'", bad[i], m);
    }
}

int main(void) {
    RUN(test_alloc_counts_exact_bytes);
    RUN(test_peak_tracks_sum);
    RUN(test_tensor_views_share_storage);
    RUN(test_rng_counter_based);
    RUN(test_status_messages);
    RUN(test_bf16_roundtrip);
    RUN(test_checked_sizes);
    RUN(test_utf8_valid);
    RUN(test_messages_escape_controls);
    RUN(test_parse_bytes);
    TEST_MAIN_END("test_core");
}
