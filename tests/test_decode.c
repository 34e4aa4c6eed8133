/* Incremental decoding and sampling: the cached decoder's logits equal the full-sequence forward at
 * every position (window wrap, overlapping-compressor blocks, HCA entries, real indexer
 * selections), with random and perturbed weights (non-zero sinks, ape, router bias, mHC base) and
 * dense CSA; its memory is O(window + max_len / r); sampling is greedy / temperature / top-p from
 * the counter RNG. */
#include "ds4/decode.h"
#include "ds4/io.h"
#include "ds4/model.h"
#include "test.h"

static ds4_model *make_model(const char *cfg_path, bool csa_dense, uint64_t seed) {
    ds4_config cfg;
    ds4_status st = ds4_config_load(cfg_path, &cfg);
    CHECK(st == DS4_OK, "%s: %s", cfg_path, ds4_errmsg());
    if (st != DS4_OK) return NULL;
    cfg.csa_dense = csa_dense;
    ds4_model *m = NULL;
    st = ds4_model_create(NULL, &cfg, false, &m);
    CHECK(st == DS4_OK, "model create: %s", ds4_errmsg());
    if (st != DS4_OK) return NULL;
    ds4_model_init_random(m, seed);
    return m;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && !strcmp(s + a - b, suffix);
}

/* The parameters the init leaves at 0 get values that matter: sinks and ape in [-1, 1), router
 * bias in [-0.3, 0.3) (enough to change selections), mHC bases in [-0.5, 0.5). */
static void perturb(ds4_model *m, uint64_t seed) {
    for (int64_t i = 0; i < ds4_model_nparams(m); i++) {
        ds4_param *p = ds4_model_param(m, i);
        if (p->is_int) continue;
        float amp = ends_with(p->name, "attn_sink") || ends_with(p->name, ".ape") ? 1.0f
                    : ends_with(p->name, "gate.bias")                             ? 0.3f
                    : ends_with(p->name, "_base")                                 ? 0.5f
                                                                                  : 0.0f;
        if (amp == 0) continue;
        uint64_t stream = ds4_hash_str(p->name);
        for (int64_t k = 0; k < p->numel; k++)
            p->data[k] = amp * (2 * ds4_rng_uniform(seed, stream, (uint64_t)k) - 1);
    }
}

static void make_ids(int32_t *ids, int64_t n, int64_t V, uint64_t seed) {
    for (int64_t i = 0; i < n; i++) ids[i] = (int32_t)(ds4_rng_u64(seed, 7, (uint64_t)i) % (uint64_t)V);
}

/* True when some CSA row selected entries other than the first K usable ones: the indexer's
 * scores decided. */
static bool indexer_really_selects(const ds4_pass *p, const ds4_config *c, int64_t T) {
    const int64_t K = c->index_topk;
    for (int64_t l = 0; l < c->n_layers; l++) {
        const int32_t *tk = ds4_pass_topk(p, l);
        if (ds4_layer_ratio(c, l) != 4 || !tk) continue;
        for (int64_t t = 0; t < T; t++)
            for (int64_t k = 0; k < K; k++)
                if (tk[t * K + k] != (int32_t)k && tk[t * K + k] >= 0) return true;
    }
    return false;
}

/* Decodes ids [T] token by token with a decoder of max_len and compares every position's logits
 * with the full forward's; returns the largest relative error (−1 on a failure). */
static double decode_vs_forward(ds4_model *m, const int32_t *ids, int64_t T, int64_t max_len, bool check_selects,
                                bool check_reset) {
    const ds4_config *c = ds4_model_config(m);
    const int64_t V = c->vocab_size;
    /* need_backward keeps the top-k for the check; the forward's numbers are the same either way */
    ds4_pass_opts o = {.need_backward = check_selects, .keep_logits = true};
    ds4_pass *p = NULL;
    ds4_status st = ds4_forward(m, ids, 1, T, &o, &p);
    CHECK(st == DS4_OK, "forward: %s", ds4_errmsg());
    if (st != DS4_OK) return -1;
    if (check_selects && !c->csa_dense) CHECK(indexer_really_selects(p, c, T), "the indexer never had to choose");
    const float *ref = ds4_pass_logits(p);
    ds4_decoder *dec = NULL;
    st = ds4_decoder_new(m, max_len, &dec);
    CHECK(st == DS4_OK, "decoder: %s", ds4_errmsg());
    float *lg = malloc((size_t)(T * V) * sizeof(float));
    double worst = 0;
    int64_t bad = 0;
    for (int64_t t = 0; dec && lg && t < T; t++) {
        st = ds4_decoder_step(dec, ids[t], lg + t * V);
        CHECK(st == DS4_OK, "step %lld: %s", (long long)t, ds4_errmsg());
        if (st != DS4_OK) break;
        double e = t_rel_err(lg + t * V, ref + t * V, (long)V);
        if (e > worst) worst = e;
        if (!(e <= 1e-5) && bad++ < 5) CHECK(e <= 1e-5, "position %lld: relative error %.3g", (long long)t, e);
    }
    CHECK(bad == 0, "%lld of %lld positions differ", (long long)bad, (long long)T);
    CHECK(dec && ds4_decoder_pos(dec) == T);
    /* reset: the same sequence again gives the same bits */
    if (check_reset && dec && lg && st == DS4_OK) {
        ds4_decoder_reset(dec);
        float *again = malloc((size_t)V * sizeof(float));
        bool same = again != NULL;
        for (int64_t t = 0; same && t < T; t++) {
            same = ds4_decoder_step(dec, ids[t], again) == DS4_OK;
            same = same && !memcmp(again, lg + t * V, (size_t)V * sizeof(float));
        }
        CHECK(same, "decoding after reset differs from the first decode");
        free(again);
    }
    free(lg);
    ds4_decoder_free(dec);
    ds4_pass_free(p);
    return bad ? -1 : worst;
}

static void run_case(const char *cfg_path, bool dense, bool perturbed, int64_t T, int64_t max_len, bool reset) {
    ds4_model *m = make_model(cfg_path, dense, 11);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    CHECK(T >= 5 * c->window, "T = %lld must be >= 5·window to cover wraps and selections", (long long)T);
    if (perturbed) perturb(m, 5);
    int32_t *ids = malloc((size_t)T * sizeof(int32_t));
    make_ids(ids, T, c->vocab_size, 3);
    double e = decode_vs_forward(m, ids, T, max_len, true, reset);
    t_note("  %s%s%s T=%lld max_len=%lld: max relative error %.3g", cfg_path, dense ? " dense-CSA" : "",
           perturbed ? " perturbed" : "", (long long)T, (long long)max_len, e);
    free(ids);
    ds4_model_free(m);
}

static void test_tiny_a_random(void) { run_case("tests/configs/tiny-a.json", false, false, 100, 100, true); }
static void test_tiny_a_perturbed(void) { run_case("tests/configs/tiny-a.json", false, true, 100, 256, false); }
static void test_tiny_a_dense_csa(void) { run_case("tests/configs/tiny-a.json", true, true, 100, 100, false); }
static void test_tiny_b_random(void) { run_case("tests/configs/tiny-b.json", false, false, 160, 160, false); }
static void test_tiny_b_perturbed(void) { run_case("tests/configs/tiny-b.json", false, true, 160, 192, true); }

/* The decoder's bytes, all through the counted allocator, are affine in max_len with the slope of
 * the compressed entries (main + indexer keys) plus two per-entry workspaces: the attention key
 * list (int32, one per compressed entry of the layer that attends the most: an HCA / dense layer)
 * and the indexer's row scores (a float and two u64 sort keys per CSA entry). That is
 * O(window + max_len / r), where a cache of every position would grow by n_layers·head_dim floats
 * per token. */
static void test_cache_memory(void) {
    ds4_model *m = make_model("tests/configs/tiny-a.json", false, 1);
    if (!m) return;
    const ds4_config *c = ds4_model_config(m);
    const int64_t lens[3] = {1024, 4096, 16384};
    int64_t bytes[3] = {0};
    ds4_decoder *warm = NULL; /* the model's rope tables grow to the longest length first */
    CHECK(ds4_decoder_new(m, lens[2], &warm) == DS4_OK, "%s", ds4_errmsg());
    ds4_decoder_free(warm);
    for (int i = 0; i < 3; i++) {
        ds4_mem_stats s0, s1;
        ds4_mem_get(&s0);
        ds4_decoder *dec = NULL;
        ds4_status st = ds4_decoder_new(m, lens[i], &dec);
        CHECK(st == DS4_OK, "decoder of %lld: %s", (long long)lens[i], ds4_errmsg());
        if (st != DS4_OK) break;
        ds4_mem_get(&s1);
        bytes[i] = s1.live_total - s0.live_total;
        CHECK(bytes[i] == ds4_decoder_bytes(dec), "allocator saw %lld bytes, decoder reports %lld",
              (long long)bytes[i], (long long)ds4_decoder_bytes(dec));
        ds4_decoder_free(dec);
    }
    /* expected bytes per token: the compressed entries and the key list, twice (the backend's copy the kernel
     * reads and the host's it is built in); the indexer's top-k scores live in the kernel's own workspace for
     * the duration of its call (it is the pass's kernel), not in the decoder */
    double entries = 0, key_list = 0;
    for (int64_t l = 0; l < c->n_layers; l++) {
        int64_t r = ds4_layer_ratio(c, l);
        if (r == 0) continue;
        entries += 4.0 * (double)(c->head_dim + (r == 4 ? c->index_head_dim : 0)) / (double)r;
        if (r != 4 && 2 * 4.0 / (double)r > key_list) key_list = 2 * 4.0 / (double)r;
    }
    const double want = entries + key_list, naive = 4.0 * (double)(c->n_layers * c->head_dim);
    double s01 = (double)(bytes[1] - bytes[0]) / (double)(lens[1] - lens[0]);
    double s12 = (double)(bytes[2] - bytes[1]) / (double)(lens[2] - lens[1]);
    CHECK(s01 == s12, "bytes are not affine in max_len: %.4f vs %.4f B/token", s01, s12);
    CHECK(s01 == want, "slope %.4f B/token, expected %.4f (entries %.2f + key list %.2f)", s01, want, entries,
          key_list);
    CHECK(s01 < naive / 4, "slope %.4f B/token is not O(1/r) (a full cache: %.1f)", s01, naive);
    int64_t fixed = bytes[0] - (int64_t)(s01 * (double)lens[0]);
    CHECK(fixed > 0 && fixed < 64 * 1024, "the window-sized part is %lld bytes", (long long)fixed);
    t_note("  decoder bytes: max_len %lld -> %lld, %lld -> %lld, %lld -> %lld (%.2f B/token + %lld; a full kv "
           "cache would add %.0f B/token)",
           (long long)lens[0], (long long)bytes[0], (long long)lens[1], (long long)bytes[1], (long long)lens[2],
           (long long)bytes[2], s01, (long long)fixed, naive);
    ds4_model_free(m);
}

static void test_decoder_errors(void) {
    ds4_model *m = make_model("tests/configs/tiny-a.json", false, 1);
    if (!m) return;
    ds4_decoder *dec = NULL;
    CHECK(ds4_decoder_new(m, 0, &dec) == DS4_ERR_ARG && dec == NULL);
    CHECK(ds4_decoder_new(m, 2, &dec) == DS4_OK);
    float lg[256];
    CHECK(ds4_decoder_step(dec, 256, lg) == DS4_ERR_ARG, "token outside the vocabulary");
    CHECK(ds4_decoder_step(dec, -1, lg) == DS4_ERR_ARG);
    CHECK(ds4_decoder_pos(dec) == 0);
    CHECK(ds4_decoder_step(dec, 3, lg) == DS4_OK && ds4_decoder_step(dec, 4, lg) == DS4_OK);
    CHECK(ds4_decoder_step(dec, 5, lg) == DS4_ERR_ARG, "past max_len");
    CHECK(strstr(ds4_errmsg(), "max_len") != NULL, "message: %s", ds4_errmsg());
    ds4_decoder_free(dec);
    ds4_model_free(m);
}

/* Decode speed on tiny-b (reported; the test checks only that it ran). */
static void test_decode_speed(void) {
    ds4_model *m = make_model("tests/configs/tiny-b.json", false, 2);
    if (!m) return;
    const int64_t T = 128, V = ds4_model_config(m)->vocab_size;
    ds4_decoder *dec = NULL;
    CHECK(ds4_decoder_new(m, T, &dec) == DS4_OK);
    float *lg = malloc((size_t)V * sizeof(float));
    ds4_sample_opts so = ds4_sample_defaults();
    int32_t tok = 0;
    double t0 = ds4_now();
    for (int64_t t = 0; dec && t < T; t++) {
        CHECK(ds4_decoder_step(dec, tok, lg) == DS4_OK);
        CHECK(ds4_sample(lg, V, &so, (uint64_t)t, &tok) == DS4_OK);
    }
    double dt = ds4_now() - t0;
    t_note("  tiny-b greedy decode: %lld tokens in %.3f s = %.0f tokens/s", (long long)T, dt, (double)T / dt);
    free(lg);
    ds4_decoder_free(dec);
    ds4_model_free(m);
}

/* ------------------------------------------------------------------ sampling */
static void test_sample_greedy(void) {
    float lg[6] = {0.5f, 2.0f, NAN, 2.0f, -INFINITY, 1.0f};
    ds4_sample_opts o = ds4_sample_defaults();
    int32_t t = -1;
    CHECK(ds4_sample(lg, 6, &o, 0, &t) == DS4_OK && t == 1, "argmax, ties to the lower id: got %d", t);
    o.temperature = 1;
    o.top_p = 1e-9; /* the nucleus of one token is greedy */
    CHECK(ds4_sample(lg, 6, &o, 123, &t) == DS4_OK && t == 1, "got %d", t);
    float none[3] = {-INFINITY, NAN, -INFINITY};
    CHECK(ds4_sample(none, 3, &o, 0, &t) == DS4_ERR_ARG, "no finite logit is an error");
}

/* Frequencies of n draws (steps 0..n-1) over V tokens. */
static void draw_freq(const float *lg, int64_t V, const ds4_sample_opts *o, int64_t n, double *freq) {
    for (int64_t v = 0; v < V; v++) freq[v] = 0;
    for (int64_t i = 0; i < n; i++) {
        int32_t t = -1;
        if (ds4_sample(lg, V, o, (uint64_t)i, &t) != DS4_OK || t < 0 || t >= V) {
            CHECK(false, "draw %lld failed", (long long)i);
            return;
        }
        freq[t] += 1.0 / (double)n;
    }
}

static void test_sample_distributions(void) {
    const double p[4] = {0.5, 0.3, 0.15, 0.05};
    float lg[4];
    for (int k = 0; k < 4; k++) lg[k] = (float)log(p[k]) + 3.0f;
    const int64_t n = 20000; /* binomial sd <= 0.0036: 0.015 is > 4 sd */
    double f[4];
    ds4_sample_opts o = {.temperature = 1, .top_p = 1, .seed = 42};
    draw_freq(lg, 4, &o, n, f);
    for (int k = 0; k < 4; k++) CHECK(fabs(f[k] - p[k]) < 0.015, "T=1 token %d: %.4f vs %.4f", k, f[k], p[k]);
    /* temperature 0.5: p² renormalised */
    o.temperature = 0.5;
    draw_freq(lg, 4, &o, n, f);
    double s2 = 0;
    for (int k = 0; k < 4; k++) s2 += p[k] * p[k];
    for (int k = 0; k < 4; k++)
        CHECK(fabs(f[k] - p[k] * p[k] / s2) < 0.015, "T=0.5 token %d: %.4f vs %.4f", k, f[k], p[k] * p[k] / s2);
    /* top-p 0.7: {0, 1} only, in proportion 0.5 : 0.3 */
    o.temperature = 1;
    o.top_p = 0.7;
    draw_freq(lg, 4, &o, n, f);
    CHECK(f[2] == 0 && f[3] == 0, "outside the nucleus: %.4f %.4f", f[2], f[3]);
    CHECK(fabs(f[0] - 0.625) < 0.015 && fabs(f[1] - 0.375) < 0.015, "nucleus {0,1}: %.4f %.4f", f[0], f[1]);
    o.top_p = 0.9; /* {0, 1, 2} */
    draw_freq(lg, 4, &o, n, f);
    CHECK(f[3] == 0 && fabs(f[2] - 0.15 / 0.95) < 0.015, "nucleus {0,1,2}: %.4f %.4f", f[2], f[3]);
}

static void test_sample_repeats(void) {
    float lg[64];
    for (int k = 0; k < 64; k++) lg[k] = (float)(k % 7) * 0.3f;
    ds4_sample_opts a = {.temperature = 0.8, .top_p = 0.95, .seed = 9}, b = a;
    b.seed = 10;
    int same = 0, differ = 0;
    for (uint64_t i = 0; i < 200; i++) {
        int32_t x, y, z;
        ds4_sample(lg, 64, &a, i, &x);
        ds4_sample(lg, 64, &a, i, &y);
        ds4_sample(lg, 64, &b, i, &z);
        same += x == y;
        differ += x != z;
    }
    CHECK(same == 200, "the same (seed, step) gave different tokens");
    CHECK(differ > 100, "another seed changed only %d of 200 draws", differ);
}

int main(void) {
    RUN(test_tiny_a_random);
    RUN(test_tiny_a_perturbed);
    RUN(test_tiny_a_dense_csa);
    RUN(test_tiny_b_random);
    RUN(test_tiny_b_perturbed);
    RUN(test_cache_memory);
    RUN(test_decoder_errors);
    RUN(test_decode_speed);
    RUN(test_sample_greedy);
    RUN(test_sample_distributions);
    RUN(test_sample_repeats);
    TEST_MAIN_END("test_decode");
}
