/* Quantized checkpoint formats (§8.2): every E4M3 / E5M2 / E2M1 / E8M0 code, FP8 128x128 block
 * dequantization with partial edge blocks, FP4 1x32 dequantization with the low nibble first, and
 * transparent dequantization through ds4_st_read_f32 / ds4_model_dir_read_f32 (scale in another shard). */
#include "ds4/io.h"
#include "test.h"

#include <ftw.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[256];

static bool msg_has(const char *s) { return strstr(ds4_errmsg(), s) != NULL; }

static bool same_float(float a, float b) { return (isnan(a) && isnan(b)) || (a == b && signbit(a) == signbit(b)); }

/* E4M3FN: checked against anchors and against its structure (8 values per binade, evenly spaced). */
static void test_e4m3_codes(void) {
    CHECK(ds4_e4m3_to_f32(0x00) == 0.0f && !signbit(ds4_e4m3_to_f32(0x00)));
    CHECK(ds4_e4m3_to_f32(0x80) == 0.0f && signbit(ds4_e4m3_to_f32(0x80)));
    CHECK(ds4_e4m3_to_f32(0x01) == 0x1p-9f);      /* smallest subnormal */
    CHECK(ds4_e4m3_to_f32(0x07) == 7 * 0x1p-9f);  /* largest subnormal */
    CHECK(ds4_e4m3_to_f32(0x08) == 0x1p-6f);      /* smallest normal */
    CHECK(ds4_e4m3_to_f32(0x38) == 1.0f);
    CHECK(ds4_e4m3_to_f32(0x39) == 1.125f);
    CHECK(ds4_e4m3_to_f32(0x40) == 2.0f);
    CHECK(ds4_e4m3_to_f32(0x7e) == 448.0f);       /* max finite */
    CHECK(ds4_e4m3_to_f32(0xfe) == -448.0f);
    CHECK(isnan(ds4_e4m3_to_f32(0x7f)) && isnan(ds4_e4m3_to_f32(0xff)));
    CHECK(ds4_e4m3_to_f32(0x78) == 256.0f && ds4_e4m3_to_f32(0x77) == 240.0f);
    int nan = 0;
    for (int b = 0; b < 256; b++) nan += isnan(ds4_e4m3_to_f32((uint8_t)b));
    CHECK(nan == 2, "%d NaN codes", nan);
    /* positive codes 0..126: strictly increasing; step inside binade e is 2^(e-10) (subnormals 2^-9) */
    for (int b = 1; b <= 126; b++) {
        float lo = ds4_e4m3_to_f32((uint8_t)(b - 1)), hi = ds4_e4m3_to_f32((uint8_t)b);
        int e = (b - 1) >> 3;
        float step = e == 0 ? 0x1p-9f : ldexpf(1.0f, e - 10);
        CHECK(hi - lo == step, "code %d: %g - %g != %g", b, hi, lo, step);
        CHECK(ds4_e4m3_to_f32((uint8_t)(b | 0x80)) == -hi, "sign of code %d", b);
    }
}

static void test_e5m2_codes(void) {
    CHECK(ds4_e5m2_to_f32(0x3c) == 1.0f && ds4_e5m2_to_f32(0x01) == 0x1p-16f && ds4_e5m2_to_f32(0x04) == 0x1p-14f);
    CHECK(ds4_e5m2_to_f32(0x7b) == 57344.0f && ds4_e5m2_to_f32(0xbc) == -1.0f);
    CHECK(isinf(ds4_e5m2_to_f32(0x7c)) && ds4_e5m2_to_f32(0xfc) < 0 && isinf(ds4_e5m2_to_f32(0xfc)));
    CHECK(isnan(ds4_e5m2_to_f32(0x7d)) && isnan(ds4_e5m2_to_f32(0x7f)) && isnan(ds4_e5m2_to_f32(0xfe)));
    for (int b = 1; b <= 0x7b; b++) {
        float lo = ds4_e5m2_to_f32((uint8_t)(b - 1)), hi = ds4_e5m2_to_f32((uint8_t)b);
        int e = (b - 1) >> 2;
        CHECK(hi - lo == (e == 0 ? 0x1p-16f : ldexpf(1.0f, e - 17)), "e5m2 code %d", b);
    }
}

static void test_e2m1_codes(void) {
    const float want[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
    for (int c = 0; c < 16; c++) CHECK(same_float(ds4_e2m1_to_f32((uint8_t)c), want[c]), "e2m1 code %d", c);
}

static void test_e8m0_codes(void) {
    float z = ds4_e8m0_to_f32(0);
    CHECK(z == 0x1p-127f && z > 0 && fpclassify(z) == FP_SUBNORMAL, "e8m0(0) = %g", z);
    CHECK(ds4_e8m0_to_f32(1) == 0x1p-126f && fpclassify(ds4_e8m0_to_f32(1)) == FP_NORMAL);
    CHECK(ds4_e8m0_to_f32(127) == 1.0f && ds4_e8m0_to_f32(128) == 2.0f && ds4_e8m0_to_f32(120) == 1.0f / 128);
    CHECK(ds4_e8m0_to_f32(254) == 0x1p127f && isnan(ds4_e8m0_to_f32(255)));
    for (int b = 1; b <= 254; b++) CHECK(ds4_e8m0_to_f32((uint8_t)b) == 2 * ds4_e8m0_to_f32((uint8_t)(b - 1)), "e8m0 %d", b);
}

/* 130 x 200 weight: 2 x 2 blocks, the last row block 2 rows tall and the last column block 72 wide. */
static void test_fp8_block_edges(void) {
    enum { R = 130, C = 200 };
    static uint8_t w[R * C];
    static float out[R * C];
    for (int i = 0; i < R * C; i++) w[i] = (uint8_t)((i * 37 + 11) % 256);
    const float s[4] = {0.5f, 2.0f, 8.0f, 0x1p-127f};   /* [2, 2] */
    ds4_dequant_fp8_block(w, s, R, C, out);
    int bad = 0;
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            float sc = s[(i >= 128) * 2 + (j >= 128)];
            bad += !same_float(out[i * C + j], ds4_e4m3_to_f32(w[i * C + j]) * sc);
        }
    CHECK(bad == 0, "%d mismatches", bad);
    /* the four block corners by hand */
    w[127 * C + 127] = 0x38, w[127 * C + 128] = 0x38, w[128 * C + 127] = 0x38, w[129 * C + 199] = 0x38;
    ds4_dequant_fp8_block(w, s, R, C, out);
    CHECK(out[127 * C + 127] == 0.5f && out[127 * C + 128] == 2.0f && out[128 * C + 127] == 8.0f &&
          out[129 * C + 199] == 0x1p-127f);
    /* a NaN scale makes its whole block NaN, and only that block */
    const float sn[4] = {1, NAN, 1, 1};
    ds4_dequant_fp8_block(w, sn, R, C, out);
    w[5 * C + 5] = 0x38;
    ds4_dequant_fp8_block(w, sn, R, C, out);
    CHECK(isnan(out[0 * C + 128]) && isnan(out[127 * C + 199]));
    CHECK(out[128 * C + 127] == 1.0f && out[129 * C + 199] == 1.0f && out[5 * C + 5] == 1.0f);
}

/* 3 x 70: packed [3, 35], scales [3, 3] (last scale group 6 wide). */
static void test_fp4_rows(void) {
    enum { R = 3, C = 70 };
    uint8_t p[R * C / 2];
    float out[R * C];
    for (int i = 0; i < R * C / 2; i++) p[i] = (uint8_t)((i * 29 + 5) % 256);
    p[0] = 0x21;   /* row 0: col 0 = code 1 (0.5), col 1 = code 2 (1.0) */
    p[16] = 0xf7;  /* row 0: col 32 = code 7 (6), col 33 = code 15 (-6) */
    const float s[R * 3] = {1, 2, 4, 0.25f, 0.5f, 1, 8, 16, 32};
    ds4_dequant_fp4_row32(p, s, R, C, out);
    CHECK(out[0] == 0.5f && out[1] == 1.0f, "%g %g", out[0], out[1]);
    CHECK(out[32] == 12.0f && out[33] == -12.0f, "%g %g", out[32], out[33]);
    int bad = 0;
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) {
            uint8_t byte = p[i * (C / 2) + j / 2];
            uint8_t nib = (j % 2) ? byte >> 4 : byte & 15;
            bad += !same_float(out[i * C + j], ds4_e2m1_to_f32(nib) * s[i * 3 + j / 32]);
        }
    CHECK(bad == 0, "%d mismatches", bad);
}

/* ---------------------------------------------------------------- through files */

static void write_one(const char *path, int n, const char **names, const ds4_dtype *dt, const int64_t (*shape)[2],
                      const void **data) {
    ds4_st_writer *w;
    ds4_st_writer_new(&w);
    for (int i = 0; i < n; i++) CHECK(ds4_st_writer_add(w, names[i], dt[i], 2, shape[i], data[i]) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_st_writer_write(w, path) == DS4_OK, "%s", ds4_errmsg());
    ds4_st_writer_free(w);
}

static void test_model_dir_dequant(void) {
    char dir[300], p[400];
    snprintf(dir, sizeof dir, "%s/qmodel", g_dir);
    mkdir(dir, 0755);
    /* config.json: a small valid quantized config */
    ds4_config c = {.vocab_size = 256, .dim = 64, .n_layers = 2, .n_mtp_layers = 0, .n_heads = 4, .n_kv_heads = 1,
                    .head_dim = 32, .rope_head_dim = 8, .q_lora_rank = 32, .o_groups = 2, .o_lora_rank = 16, .window = 16,
                    .compress_ratios = {0, 4}, .index_n_heads = 2, .index_head_dim = 16, .index_topk = 4, .hc_mult = 4,
                    .hc_sinkhorn_iters = 20, .hc_eps = 1e-6, .n_routed_experts = 8, .n_shared_experts = 1,
                    .n_activated_experts = 2, .moe_inter_dim = 32, .n_hash_layers = 1, .route_scale = 1.5,
                    .swiglu_limit = 10, .rope_theta = 10000, .compress_rope_theta = 160000, .rope_factor = 1,
                    .norm_eps = 1e-6, .eos_token_id = 1, .mtp_loss_weight = 0.3, .indexer_loss_coeff = 0.01,
                    .quantized = true, .expert_fp4 = true};
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK(ds4_config_save(&c, p) == DS4_OK, "%s", ds4_errmsg());

    /* FP8 [130, 200] with E8M0 scales [2, 2] in shard 2; FP4 [3, 70] with F32 scales [3, 3] */
    enum { R = 130, C = 200, FR = 3, FC = 70 };
    static uint8_t w8[R * C];
    for (int i = 0; i < R * C; i++) w8[i] = (uint8_t)((i * 13 + 3) % 256);
    const uint8_t s8[4] = {126, 129, 0, 255};  /* 0.5, 4, 2^-127, NaN */
    uint8_t w4[FR * FC / 2];
    for (int i = 0; i < FR * FC / 2; i++) w4[i] = (uint8_t)(i * 57 + 1);
    const float s4[FR * 3] = {1, 2, 3, 4, 5, 6, 7, 8, 9};
    const uint8_t s4e[FR * 3] = {127, 128, 129, 126, 125, 124, 130, 131, 0};
    {
        const char *n[] = {"layers.0.attn.wq_a.weight", "layers.0.ffn.experts.0.w1.weight", "layers.0.ffn.experts.0.w1.scale",
                           "layers.0.ffn.experts.1.w1.weight"};
        ds4_dtype dt[] = {DS4_F8_E4M3, DS4_I8, DS4_F32, DS4_I8};
        const int64_t sh[][2] = {{R, C}, {FR, FC / 2}, {FR, 3}, {FR, FC / 2}};
        const void *d[] = {w8, w4, s4, w4};
        snprintf(p, sizeof p, "%s/model-00001-of-00002.safetensors", dir);
        write_one(p, 4, n, dt, sh, d);
    }
    {
        const char *n[] = {"layers.0.attn.wq_a.scale", "layers.0.ffn.experts.1.w1.scale"};
        ds4_dtype dt[] = {DS4_F8_E8M0, DS4_F8_E8M0};
        const int64_t sh[][2] = {{2, 2}, {FR, 3}};
        const void *d[] = {s8, s4e};
        snprintf(p, sizeof p, "%s/model-00002-of-00002.safetensors", dir);
        write_one(p, 2, n, dt, sh, d);
    }
    ds4_model_dir *md = NULL;
    CHECK(ds4_model_dir_open(dir, &md) == DS4_OK, "%s", ds4_errmsg());
    if (!md) return;
    CHECK(ds4_model_dir_config(md)->quantized && ds4_model_dir_config(md)->expert_fp4);
    static float out[R * C], want[R * C];
    int64_t shape[2] = {R, C};
    float sf[4];
    for (int i = 0; i < 4; i++) sf[i] = ds4_e8m0_to_f32(s8[i]);
    ds4_dequant_fp8_block(w8, sf, R, C, want);
    CHECK(ds4_model_dir_read_f32(md, "layers.0.attn.wq_a.weight", 2, shape, out) == DS4_OK, "%s", ds4_errmsg());
    int bad = 0;
    for (int i = 0; i < R * C; i++) bad += !same_float(out[i], want[i]);
    CHECK(bad == 0, "%d fp8 mismatches", bad);
    CHECK(isnan(out[128 * C + 128]) && out[0] == ds4_e4m3_to_f32(w8[0]) * 0.5f);

    int64_t fshape[2] = {FR, FC};
    float fo[FR * FC], fw[FR * FC];
    ds4_dequant_fp4_row32(w4, s4, FR, FC, fw);
    CHECK(ds4_model_dir_read_f32(md, "layers.0.ffn.experts.0.w1.weight", 2, fshape, fo) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(fo, fw, sizeof fo) == 0);
    float se[FR * 3];
    for (int i = 0; i < FR * 3; i++) se[i] = ds4_e8m0_to_f32(s4e[i]);
    ds4_dequant_fp4_row32(w4, se, FR, FC, fw);
    CHECK(ds4_model_dir_read_f32(md, "layers.0.ffn.experts.1.w1.weight", 2, fshape, fo) == DS4_OK, "%s", ds4_errmsg());
    CHECK(memcmp(fo, fw, sizeof fo) == 0);

    /* within one file, ds4_st_read_f32 dequantizes too (scale in the same shard) */
    const ds4_st_file *f0 = ds4_model_dir_file(md, 0);
    CHECK(ds4_st_read_f32(f0, "layers.0.ffn.experts.0.w1.weight", 2, fshape, fo) == DS4_OK, "%s", ds4_errmsg());
    /* ... but not across shards: the scale of wq_a lives in shard 2 */
    CHECK(ds4_st_read_f32(f0, "layers.0.attn.wq_a.weight", 2, shape, out) == DS4_ERR_UNSUPPORTED &&
          msg_has("'layers.0.attn.wq_a.weight'") && msg_has("layers.0.attn.wq_a.scale"), "%s", ds4_errmsg());

    /* errors: wrong logical shape, 3-D request, odd FP4 width */
    int64_t wrong[2] = {R, C + 1};
    CHECK(ds4_model_dir_read_f32(md, "layers.0.attn.wq_a.weight", 2, wrong, out) == DS4_ERR_SHAPE &&
          msg_has("'layers.0.attn.wq_a.weight'") && msg_has("[130, 201]"), "%s", ds4_errmsg());
    int64_t three[3] = {1, R, C};
    CHECK(ds4_model_dir_read_f32(md, "layers.0.attn.wq_a.weight", 3, three, out) == DS4_ERR_SHAPE);
    int64_t fodd[2] = {FR, FC - 1}, fwide[2] = {FR, FC + 2};
    CHECK(ds4_model_dir_read_f32(md, "layers.0.ffn.experts.0.w1.weight", 2, fodd, fo) == DS4_ERR_SHAPE &&
          msg_has("FP4") && msg_has("[3, 35]"), "%s", ds4_errmsg());
    CHECK(ds4_model_dir_read_f32(md, "layers.0.ffn.experts.0.w1.weight", 2, fwide, fo) == DS4_ERR_SHAPE);
    ds4_model_dir_close(md);

    /* a scale of the wrong shape or dtype */
    {
        const char *n[] = {"a.weight", "a.scale", "b.weight", "b.scale", "c.weight"};
        ds4_dtype dt[] = {DS4_F8_E4M3, DS4_F8_E8M0, DS4_F8_E4M3, DS4_I32, DS4_I8};
        const int64_t sh[][2] = {{R, C}, {2, 1}, {R, C}, {1, 1}, {2, 2}};
        const void *d[] = {w8, s8, w8, s8, w8};
        snprintf(p, sizeof p, "%s/bad.safetensors", g_dir);
        write_one(p, 5, n, dt, sh, d);
        ds4_st_file *f;
        CHECK(ds4_st_open(p, &f) == DS4_OK);
        if (f) {
            CHECK(ds4_st_read_f32(f, "a.weight", 2, shape, out) == DS4_ERR_SHAPE && msg_has("'a.scale'") && msg_has("[2, 1]") &&
                  msg_has("[2, 2]"), "%s", ds4_errmsg());
            CHECK(ds4_st_read_f32(f, "b.weight", 2, shape, out) == DS4_ERR_SHAPE && msg_has("'b.scale'") && msg_has("[1, 1]"),
                  "%s", ds4_errmsg());
            /* an I8 tensor without a scale is just an integer tensor: not readable as float */
            int64_t cs[2] = {2, 2};
            CHECK(ds4_st_read_f32(f, "c.weight", 2, cs, out) == DS4_ERR_SHAPE && msg_has("I8"), "%s", ds4_errmsg());
            ds4_st_close(f);
        }
    }
}

/* A scale of an unsupported dtype is named with its dtype. */
static void test_scale_dtype(void) {
    enum { R = 4, C = 8 };
    uint8_t w[R * C] = {0x38};
    int32_t si[1] = {1};
    const char *n[] = {"x.weight", "x.scale"};
    ds4_dtype dt[] = {DS4_F8_E4M3, DS4_I32};
    const int64_t sh[][2] = {{R, C}, {1, 1}};
    const void *d[] = {w, si};
    char p[400];
    snprintf(p, sizeof p, "%s/sdt.safetensors", g_dir);
    write_one(p, 2, n, dt, sh, d);
    ds4_st_file *f;
    CHECK(ds4_st_open(p, &f) == DS4_OK);
    if (!f) return;
    float out[R * C];
    int64_t shape[2] = {R, C};
    CHECK(ds4_st_read_f32(f, "x.weight", 2, shape, out) == DS4_ERR_SHAPE && msg_has("'x.scale'") && msg_has("I32") &&
          msg_has("F8_E8M0"), "%s", ds4_errmsg());
    ds4_st_close(f);
}

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftwb) {
    (void)sb, (void)flag, (void)ftwb;
    return remove(p);
}

static void test_no_leaks(void) {
    ds4_mem_stats m;
    ds4_mem_get(&m);
    CHECK(m.live_total == 0, "%lld bytes still live", (long long)m.live_total);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4_test_quant_XXXXXX");
    if (!mkdtemp(g_dir)) return 1;
    RUN(test_e4m3_codes);
    RUN(test_e5m2_codes);
    RUN(test_e2m1_codes);
    RUN(test_e8m0_codes);
    RUN(test_fp8_block_edges);
    RUN(test_fp4_rows);
    RUN(test_model_dir_dequant);
    RUN(test_scale_dtype);
    RUN(test_no_leaks);
    nftw(g_dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
    TEST_MAIN_END("test_quant");
}
