/* ds4 plot: JSONL metrics -> series (sorting, duplicates, NaN / missing / null gaps, errors with
 * file:line) and the SVG (exact polyline coordinates for hand-computed axes, tick labels, titles,
 * legend, clipping, well-formed XML, PNG only through a converter). */
#include "ds4/plot.h"
#include "test.h"

#include <ctype.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

static char g_dir[64];

static const char *tmp_path(const char *name) {
    static char buf[8][256];
    static int next;
    char *p = buf[next++ % 8];
    snprintf(p, 256, "%s/%s", g_dir, name);
    return p;
}

static void write_text(const char *path, const char *text) {
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot write %s", path);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

static int count_of(const char *hay, const char *needle) {
    int n = 0;
    for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) n++;
    return n;
}

/* A small XML checker: tags balance and nest, one root <svg>, quoted attributes terminate, text has
 * no raw '<' and every '&' starts one of the five predefined entities. Returns NULL or the problem. */
static const char *xml_problem(const char *s) {
    enum { MAXD = 64 };
    char stack[MAXD][32];
    int depth = 0, roots = 0;
    for (const char *p = s; *p;) {
        if (*p == '&') {
            static const char *const ents[] = {"&amp;", "&lt;", "&gt;", "&quot;", "&apos;"};
            bool ok = false;
            for (int e = 0; e < 5; e++) ok = ok || !strncmp(p, ents[e], strlen(ents[e]));
            if (!ok) return "bare '&'";
            p++;
            continue;
        }
        if (*p != '<') {
            p++;
            continue;
        }
        if (!strncmp(p, "<?", 2)) {
            const char *e = strstr(p, "?>");
            if (!e) return "unterminated <?";
            p = e + 2;
            continue;
        }
        if (!strncmp(p, "<!--", 4)) {
            const char *e = strstr(p, "-->");
            if (!e) return "unterminated comment";
            p = e + 3;
            continue;
        }
        bool closing = p[1] == '/';
        p += closing ? 2 : 1;
        char name[32];
        int n = 0;
        while (*p && (isalnum((unsigned char)*p) || *p == '-' || *p == ':' || *p == '_') && n < 31) name[n++] = *p++;
        name[n] = 0;
        if (n == 0) return "tag without a name";
        char quote = 0;
        bool self = false;
        for (; *p; p++) {
            if (quote) {
                if (*p == quote) quote = 0;
                else if (*p == '<') return "'<' inside an attribute";
            } else if (*p == '"' || *p == '\'') {
                quote = *p;
            } else if (*p == '>') {
                self = p[-1] == '/';
                break;
            }
        }
        if (!*p) return "unterminated tag";
        p++;
        if (closing) {
            if (depth == 0 || strcmp(stack[depth - 1], name)) return "closing tag does not match";
            depth--;
        } else if (!self) {
            if (depth == 0) roots++;
            if (depth == MAXD) return "too deep";
            snprintf(stack[depth++], 32, "%s", name);
        } else if (depth == 0) {
            return "self-closed root";
        }
        if (depth == 0 && roots == 1 && strcmp(name, "svg")) return "root is not <svg>";
    }
    if (depth) return "unclosed tags at the end";
    if (roots != 1) return "not exactly one root element";
    return NULL;
}

static char *render(const ds4_metrics *runs, int nruns, const int *keys, int nkeys) {
    char *svg = NULL;
    size_t len = 0;
    ds4_status st = ds4_plot_svg(runs, nruns, keys, nkeys, &svg, &len);
    CHECK(st == DS4_OK, "%s", ds4_errmsg());
    if (st != DS4_OK) return NULL;
    CHECK(strlen(svg) == len);
    const char *bad = xml_problem(svg);
    CHECK(bad == NULL, "SVG not well-formed: %s", bad);
    return svg;
}

/* Steps 0,5,10 with loss 4,3,2 and constant memory 1.0: x axis [0,10] (step 2), loss axis [2,4]
 * (step 0.5), memory axis [0.9,1.1] (step 0.05). Plot area x 80..680, panel k has y 40..240 + 300k. */
static void test_hand_computed(void) {
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    const char *path = tmp_path("a.jsonl");
    write_text(path, "{\"step\": 0, \"loss\": 4, \"memory_gib\": 1.0}\n"
                     "{\"step\": 5, \"loss\": 3, \"memory_gib\": 1.0}\n"
                     "{\"step\": 10, \"loss\": 2, \"memory_gib\": 1.0}\n");
    ds4_metrics m;
    CHECK(ds4_metrics_load(path, &m) == DS4_OK, "%s", ds4_errmsg());
    CHECK(m.n == 3 && m.step[2] == 10 && m.val[ds4_plot_key_find("loss")][1] == 3);
    CHECK(ds4_metrics_count(&m, ds4_plot_key_find("grad_norm")) == 0);
    int keys[2] = {ds4_plot_key_find("loss"), ds4_plot_key_find("memory_gib")};
    char *svg = render(&m, 1, keys, 2);
    if (svg) {
        CHECK(strstr(svg, "width=\"720\" height=\"600\""), "size");
        CHECK(strstr(svg, "points=\"80.00,40.00 380.00,140.00 680.00,240.00\""), "loss polyline");
        CHECK(strstr(svg, "points=\"80.00,440.00 380.00,440.00 680.00,440.00\""), "memory polyline");
        CHECK(count_of(svg, "<polyline") == 2 && count_of(svg, "<circle") == 0);
        /* x ticks 0..10 by 2 under both panels; loss ticks 2.0..4.0; memory ticks 0.90..1.10 */
        CHECK(count_of(svg, "<text class=\"xtick\"") == 12);
        CHECK(strstr(svg, "<text class=\"xtick\" x=\"200.00\" y=\"258.00\" text-anchor=\"middle\">2</text>"));
        CHECK(strstr(svg, "<text class=\"xtick\" x=\"680.00\" y=\"558.00\" text-anchor=\"middle\">10</text>"));
        CHECK(strstr(svg, "<text class=\"ytick\" x=\"72.00\" y=\"144.00\" text-anchor=\"end\">3.0</text>"));
        CHECK(strstr(svg, ">2.5</text>") && strstr(svg, ">4.0</text>") && !strstr(svg, ">4.5</text>"));
        CHECK(strstr(svg, "<text class=\"ytick\" x=\"72.00\" y=\"444.00\" text-anchor=\"end\">1.00</text>"));
        CHECK(strstr(svg, ">0.90</text>") && strstr(svg, ">1.10</text>") && strstr(svg, ">0.95</text>"));
        CHECK(strstr(svg, ">loss (main cross-entropy)</text>") && strstr(svg, ">peak memory (GiB)</text>"));
        CHECK(count_of(svg, "class=\"xlabel\"") == 2 && count_of(svg, ">step</text>") == 2);
        CHECK(strstr(svg, ">memory_gib</text>") && strstr(svg, "rotate(-90"));
        /* lines are clipped to their plot area; one legend-less run */
        CHECK(strstr(svg, "<clipPath id=\"plot1\"><rect x=\"80.00\" y=\"340.00\" width=\"600.00\" height=\"200.00\"/>"));
        CHECK(count_of(svg, "clip-path=\"url(#plot") == 2 && !strstr(svg, "class=\"legend\""));
        ds4_free(svg);
    }
    ds4_metrics_free(&m);
    ds4_mem_get(&m1);
    CHECK(m1.live_total == m0.live_total, "leaked %lld bytes", (long long)(m1.live_total - m0.live_total));
}

/* Out-of-order and repeated steps, printf's nan/-nan/inf, null, a missing key, blank lines. */
static void test_gaps_and_order(void) {
    const char *path = tmp_path("gaps.jsonl");
    write_text(path, "{\"step\": 2, \"loss\": 9}\n"
                     "{\"step\": 1, \"loss\": 1}\n"
                     "\n"
                     "{\"step\": 2, \"loss\": 2}\n"
                     "{\"step\": 3, \"loss\": -nan}\n"
                     "{\"step\": 4, \"loss\": 4, \"note\": \"nan stays text\"}\n"
                     "   \n"
                     "{\"step\": 5}\n"
                     "{\"step\": 6, \"loss\": null}\n"
                     "{\"step\": 7, \"loss\": 7}\n"
                     "{\"step\": 8, \"loss\": 8, \"grad_norm\": inf}");
    ds4_metrics m;
    CHECK(ds4_metrics_load(path, &m) == DS4_OK, "%s", ds4_errmsg());
    int kl = ds4_plot_key_find("loss"), kg = ds4_plot_key_find("grad_norm");
    const double want[8] = {1, 2, NAN, 4, NAN, NAN, 7, 8};
    CHECK(m.n == 8, "%lld rows", (long long)m.n);
    for (int64_t i = 0; i < m.n && i < 8; i++) {
        CHECK(m.step[i] == (double)(i + 1));
        CHECK(isnan(want[i]) ? isnan(m.val[kl][i]) : m.val[kl][i] == want[i], "row %lld", (long long)i);
        CHECK(isnan(m.val[kg][i]));
    }
    /* axes [0,8] both ways: x -> 80 + 75x, y -> 40 + 25(8 - y) */
    int keys[2] = {kl, kg};
    char *svg = render(&m, 1, keys, 2);
    if (svg) {
        CHECK(strstr(svg, "points=\"155.00,215.00 230.00,190.00\""), "segment 1..2");
        CHECK(strstr(svg, "points=\"605.00,65.00 680.00,40.00\""), "segment 7..8");
        CHECK(strstr(svg, "<circle cx=\"380.00\" cy=\"140.00\""), "lone point 4");
        CHECK(count_of(svg, "<polyline") == 2 && count_of(svg, "<circle") == 1);
        CHECK(count_of(svg, ">no data</text>") == 1, "grad_norm panel has no data");
        CHECK(!strstr(svg, "nan") && !strstr(svg, "inf"));
        ds4_free(svg);
    }
    ds4_metrics_free(&m);
}

/* One row: both axes constant. x 5 -> [4.4, 5.6] (step 0.2), y 0 -> [-1, 1] (step 0.5). */
static void test_single_point(void) {
    const char *path = tmp_path("one.jsonl");
    write_text(path, "{\"step\": 5, \"loss\": 0}\n");
    ds4_metrics m;
    CHECK(ds4_metrics_load(path, &m) == DS4_OK, "%s", ds4_errmsg());
    int key = ds4_plot_key_find("loss");
    char *svg = render(&m, 1, &key, 1);
    if (svg) {
        CHECK(strstr(svg, "<circle cx=\"380.00\" cy=\"140.00\""), "the point");
        CHECK(strstr(svg, ">4.4</text>") && strstr(svg, ">5.6</text>"));
        CHECK(strstr(svg, ">-1.0</text>") && strstr(svg, ">0.0</text>") && !strstr(svg, "-0.0<"));
        CHECK(count_of(svg, "<polyline") == 0);
        ds4_free(svg);
    }
    ds4_metrics_free(&m);
    /* an empty file is a plot of nothing, not an error */
    const char *empty = tmp_path("empty.jsonl");
    write_text(empty, "");
    CHECK(ds4_metrics_load(empty, &m) == DS4_OK && m.n == 0, "%s", ds4_errmsg());
    svg = render(&m, 1, &key, 1);
    if (svg) CHECK(strstr(svg, ">no data</text>"));
    ds4_free(svg);
    ds4_metrics_free(&m);
}

/* Two runs share the axes (x [0,20] step 5, y [1,4] step 1) under a legend band of 12 + 2·18 px. */
static void test_legend(void) {
    const char *pa = tmp_path("a.jsonl"), *pb = tmp_path("run&b.jsonl");
    write_text(pa, "{\"step\": 0, \"loss\": 4}\n{\"step\": 10, \"loss\": 2}\n");
    write_text(pb, "{\"step\": 0, \"loss\": 3}\n{\"step\": 20, \"loss\": 1}\n");
    ds4_metrics runs[2];
    CHECK(ds4_metrics_load(pa, &runs[0]) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_metrics_load(pb, &runs[1]) == DS4_OK, "%s", ds4_errmsg());
    int key = ds4_plot_key_find("loss");
    char *svg = render(runs, 2, &key, 1);
    if (svg) {
        CHECK(strstr(svg, "height=\"348\""));
        CHECK(strstr(svg, "stroke=\"#1f77b4\" stroke-width=\"1.5\" stroke-linejoin=\"round\" "
                          "points=\"80.00,88.00 380.00,221.33\""), "run a");
        CHECK(strstr(svg, "stroke=\"#d62728\" stroke-width=\"1.5\" stroke-linejoin=\"round\" "
                          "points=\"80.00,154.67 680.00,288.00\""), "run b");
        CHECK(count_of(svg, "class=\"legend\"") == 2);
        CHECK(strstr(svg, "a.jsonl</text>") && strstr(svg, "run&amp;b.jsonl</text>"), "legend labels");
        CHECK(strstr(svg, ">20</text>") && strstr(svg, ">15</text>") && !strstr(svg, ">25</text>"));
        ds4_free(svg);
    }
    /* the .svg file is the rendered text, byte for byte */
    const char *out = tmp_path("two.svg");
    CHECK(ds4_plot_write(out, runs, 2, &key, 1) == DS4_OK, "%s", ds4_errmsg());
    char *want = NULL;
    size_t wlen = 0;
    CHECK(ds4_plot_svg(runs, 2, &key, 1, &want, &wlen) == DS4_OK);
    FILE *f = fopen(out, "rb");
    CHECK(f != NULL);
    if (f && want) {
        char *got = malloc(wlen + 16);
        size_t n = fread(got, 1, wlen + 16, f);
        CHECK(n == wlen && !memcmp(got, want, wlen), "file %zu bytes vs %zu", n, wlen);
        free(got);
    }
    if (f) fclose(f);
    ds4_free(want);
    ds4_metrics_free(&runs[0]);
    ds4_metrics_free(&runs[1]);
}

static void check_load_error(const char *name, const char *text, ds4_status code, const char *msg) {
    const char *path = tmp_path(name);
    write_text(path, text);
    ds4_metrics m;
    ds4_status st = ds4_metrics_load(path, &m);
    CHECK(st == code, "%s: status %s", name, ds4_status_name(st));
    char want[512];
    snprintf(want, sizeof want, "%s%s", path, msg);
    CHECK(strstr(ds4_errmsg(), want), "%s: message '%s' lacks '%s'", name, ds4_errmsg(), want);
    CHECK(m.n == 0 && m.step == NULL);
}

static void test_errors(void) {
    ds4_mem_stats m0, m1;
    ds4_mem_get(&m0);
    ds4_metrics m;
    const char *missing = tmp_path("missing.jsonl");
    CHECK(ds4_metrics_load(missing, &m) == DS4_ERR_IO && strstr(ds4_errmsg(), missing), "%s", ds4_errmsg());
    check_load_error("bad1.jsonl", "{\"step\": 1, \"loss\": 2}\n\n{\"step\": 3, \"loss\": }\n", DS4_ERR_FORMAT,
                     ":3: not a JSON object");
    check_load_error("bad2.jsonl", "{\"step\": 1}\n[1, 2]\n", DS4_ERR_FORMAT, ":2: not a JSON object");
    check_load_error("bad3.jsonl", "{\"loss\": 1}\n", DS4_ERR_FORMAT, ":1: no numeric \"step\"");
    check_load_error("bad4.jsonl", "{\"step\": 1, \"loss\": \"low\"}\n", DS4_ERR_FORMAT, ":1: \"loss\" is not a number");
    check_load_error("bad5.jsonl", "{\"step\": nan, \"loss\": 1}\n", DS4_ERR_FORMAT, ":1: no numeric \"step\"");
    check_load_error("bad6.jsonl", "{\"step\": 1, \"loss\": 1} trailing\n", DS4_ERR_FORMAT, ":1: not a JSON object");
    /* keys */
    CHECK(ds4_plot_key_find("bogus") == -1 && ds4_plot_key_find("step") == -1);
    CHECK(ds4_plot_key_find("loss") == 0 && ds4_plot_key_find("mfu") >= 0 && ds4_plot_key_find("tps") >= 0);
    for (int k = 0; k < DS4_PLOT_NKEYS; k++) CHECK(ds4_plot_key_find(ds4_plot_key_name(k)) == k);
    /* outputs */
    const char *path = tmp_path("ok.jsonl");
    write_text(path, "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": 1}\n");
    CHECK(ds4_metrics_load(path, &m) == DS4_OK);
    int key = 0, badkey = DS4_PLOT_NKEYS;
    char *svg;
    size_t len;
    CHECK(ds4_plot_svg(&m, 1, &badkey, 1, &svg, &len) == DS4_ERR_ARG && svg == NULL);
    CHECK(ds4_plot_svg(&m, 0, &key, 1, &svg, &len) == DS4_ERR_ARG);
    CHECK(ds4_plot_svg(&m, 1, &key, 0, &svg, &len) == DS4_ERR_ARG);
    const char *jpg = tmp_path("out.jpg");
    CHECK(ds4_plot_write(jpg, &m, 1, &key, 1) == DS4_ERR_ARG && strstr(ds4_errmsg(), ".svg or .png"));
    CHECK(access(jpg, F_OK) != 0);
    const char *png = tmp_path("out.png");
    ds4_status st = ds4_plot_write(png, &m, 1, &key, 1);
    if (ds4_plot_png_converter() == NULL) {
        CHECK(st == DS4_ERR_UNSUPPORTED && strstr(ds4_errmsg(), "write a .svg file instead"), "%s", ds4_errmsg());
        CHECK(access(png, F_OK) != 0);
    } else {
        CHECK(st == DS4_OK, "%s", ds4_errmsg());
        FILE *f = fopen(png, "rb");
        unsigned char magic[8] = {0};
        CHECK(f && fread(magic, 1, 8, f) == 8 && !memcmp(magic, "\x89PNG\r\n\x1a\n", 8), "not a PNG");
        if (f) fclose(f);
        unlink(png);
    }
    char tmp[300];
    snprintf(tmp, sizeof tmp, "%s.tmp.svg", png);
    CHECK(access(tmp, F_OK) != 0, "temporary SVG left behind");
    ds4_metrics_free(&m);
    ds4_mem_get(&m1);
    CHECK(m1.live_total == m0.live_total, "leaked %lld bytes", (long long)(m1.live_total - m0.live_total));
}

static void cleanup(void) {
    static const char *const names[] = {"a.jsonl", "gaps.jsonl", "one.jsonl", "empty.jsonl", "run&b.jsonl",
                                        "two.svg", "bad1.jsonl", "bad2.jsonl", "bad3.jsonl", "bad4.jsonl",
                                        "bad5.jsonl", "bad6.jsonl", "ok.jsonl"};
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) unlink(tmp_path(names[i]));
    rmdir(g_dir);
}

int main(void) {
    snprintf(g_dir, sizeof g_dir, "/tmp/ds4-plot-XXXXXX");
    if (!mkdtemp(g_dir)) {
        perror("mkdtemp");
        return 1;
    }
    RUN(test_hand_computed);
    RUN(test_gaps_and_order);
    RUN(test_single_point);
    RUN(test_legend);
    RUN(test_errors);
    cleanup();
    TEST_MAIN_END("test_plot");
}
