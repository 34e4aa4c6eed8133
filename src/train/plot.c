/* Training curves: JSONL metrics -> per-key series -> SVG line charts (see include/ds4/plot.h). */
#include "ds4/plot.h"

#include "ds4/io.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <math.h>
#include <spawn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;

/* ------------------------------------------------------------------ keys */
static const char *const k_names[DS4_PLOT_NKEYS] = {
    "loss", "mtp_loss", "indexer_loss", "total_loss", "grad_norm", "lr", "memory_gib",
    "memory_bytes", "activation_peak_bytes", "tps", "tflops", "mfu", "step_time",
};
static const char *const k_titles[DS4_PLOT_NKEYS] = {
    "loss (main cross-entropy)", "MTP loss", "indexer loss", "total loss", "gradient norm",
    "learning rate", "peak memory (GiB)", "peak memory (bytes)", "peak activation memory (bytes)",
    "throughput (tokens/s)", "TFLOP/s", "MFU (%)", "step time (s)",
};

const char *ds4_plot_key_name(int key) { return key >= 0 && key < DS4_PLOT_NKEYS ? k_names[key] : "?"; }
const char *ds4_plot_key_title(int key) { return key >= 0 && key < DS4_PLOT_NKEYS ? k_titles[key] : "?"; }

int ds4_plot_key_find(const char *name) {
    for (int k = 0; k < DS4_PLOT_NKEYS; k++)
        if (!strcmp(name, k_names[k])) return k;
    return -1;
}

/* ------------------------------------------------------------------ reading */
typedef struct {
    double step;
    double v[DS4_PLOT_NKEYS];
    int64_t order; /* line position: the later of two equal steps wins */
} row;

/* Copies line[0..n) to out, turning bare nan / -nan / inf / -inf / infinity words outside strings
 * (what printf writes for non-finite doubles) into null, so the line parses as JSON. out holds 2n+1. */
static void sanitize_line(const char *line, size_t n, char *out) {
    size_t o = 0;
    bool in_str = false;
    for (size_t i = 0; i < n;) {
        char c = line[i];
        if (in_str) {
            out[o++] = c;
            if (c == '\\' && i + 1 < n) out[o++] = line[++i];
            else if (c == '"') in_str = false;
            i++;
            continue;
        }
        if (c == '"') in_str = true;
        size_t w = i + (c == '-' || c == '+');
        size_t e = w;
        while (e < n && isalpha((unsigned char)line[e])) e++;
        if (e > w) {
            size_t len = e - w;
            bool nonfinite = (len == 3 && (!strncasecmp(line + w, "nan", 3) || !strncasecmp(line + w, "inf", 3))) ||
                             (len == 8 && !strncasecmp(line + w, "infinity", 8));
            if (nonfinite) {
                memcpy(out + o, "null", 4);
                o += 4;
            } else {
                memcpy(out + o, line + i, e - i);
                o += e - i;
            }
            i = e;
            continue;
        }
        out[o++] = c;
        i++;
    }
    out[o] = 0;
}

/* The number of a key: NaN when absent, null or non-finite; an error for any other type. */
static ds4_status key_value(const cJSON *obj, const char *key, const char *path, int64_t lineno, bool required,
                            double *out) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NAN;
    if (!it || cJSON_IsNull(it)) {
        if (required) return ds4_fail(DS4_ERR_FORMAT, "%s:%lld: no numeric \"%s\"", path, (long long)lineno, key);
        return DS4_OK;
    }
    if (!cJSON_IsNumber(it))
        return ds4_fail(DS4_ERR_FORMAT, "%s:%lld: \"%s\" is not a number", path, (long long)lineno, key);
    if (isfinite(it->valuedouble)) *out = it->valuedouble;
    else if (required)
        return ds4_fail(DS4_ERR_FORMAT, "%s:%lld: \"%s\" is not finite", path, (long long)lineno, key);
    return DS4_OK;
}

/* Parses one non-blank line into r. */
static ds4_status parse_line(const char *line, size_t n, char *scratch, const char *path, int64_t lineno, row *r) {
    sanitize_line(line, n, scratch);
    cJSON *obj = cJSON_ParseWithOpts(scratch, NULL, true); /* true: nothing may follow the object */
    if (!obj || !cJSON_IsObject(obj)) {
        cJSON_Delete(obj);
        return ds4_fail(DS4_ERR_FORMAT, "%s:%lld: not a JSON object: '%.40s%s'", path, (long long)lineno, scratch,
                        strlen(scratch) > 40 ? "..." : "");
    }
    ds4_status st = key_value(obj, "step", path, lineno, true, &r->step);
    for (int k = 0; k < DS4_PLOT_NKEYS && st == DS4_OK; k++)
        st = key_value(obj, k_names[k], path, lineno, false, &r->v[k]);
    cJSON_Delete(obj);
    return st;
}

static int row_cmp(const void *a, const void *b) {
    const row *x = a, *y = b;
    if (x->step != y->step) return x->step < y->step ? -1 : 1;
    return (x->order > y->order) - (x->order < y->order);
}

/* Sorted rows (one per step, the last line's) into m's arrays. */
static ds4_status fill_metrics(row *rows, int64_t n, ds4_metrics *m) {
    qsort(rows, (size_t)n, sizeof(row), row_cmp);
    int64_t u = 0;
    for (int64_t i = 0; i < n; i++) {
        if (u > 0 && rows[u - 1].step == rows[i].step) rows[u - 1] = rows[i];
        else rows[u++] = rows[i];
    }
    m->n = u;
    size_t bytes = (size_t)(u > 0 ? u : 1) * sizeof(double);
    bool ok = (m->step = ds4_alloc(DS4_MEM_OTHER, bytes)) != NULL;
    for (int k = 0; k < DS4_PLOT_NKEYS; k++) ok = ok && (m->val[k] = ds4_alloc(DS4_MEM_OTHER, bytes)) != NULL;
    if (!ok) return ds4_fail(DS4_ERR_OOM, "%s: out of memory for %lld metrics rows", m->path, (long long)u);
    for (int64_t i = 0; i < u; i++) {
        m->step[i] = rows[i].step;
        for (int k = 0; k < DS4_PLOT_NKEYS; k++) m->val[k][i] = rows[i].v[k];
    }
    return DS4_OK;
}

ds4_status ds4_metrics_load(const char *path, ds4_metrics *out) {
    memset(out, 0, sizeof *out);
    snprintf(out->path, sizeof out->path, "%s", path);
    char *text;
    size_t len;
    DS4_TRY(ds4_read_file(path, &text, &len));
    int64_t cap = 64, n = 0;
    row *rows = ds4_alloc(DS4_MEM_OTHER, (size_t)cap * sizeof(row));
    char *scratch = NULL;
    size_t scratch_cap = 0;
    ds4_status st = rows ? DS4_OK : ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the metrics", path);
    int64_t lineno = 0;
    for (size_t at = 0; at < len && st == DS4_OK;) {
        const char *line = text + at;
        const char *nl = memchr(line, '\n', len - at);
        size_t ln = nl ? (size_t)(nl - line) : len - at;
        at += ln + 1;
        lineno++;
        size_t b = 0;
        while (b < ln && isspace((unsigned char)line[b])) b++;
        if (b == ln) continue; /* blank */
        if (2 * ln + 1 > scratch_cap) {
            ds4_free(scratch);
            scratch_cap = 2 * ln + 1;
            if (!(scratch = ds4_alloc(DS4_MEM_OTHER, scratch_cap)))
                st = ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the metrics", path);
        }
        if (st == DS4_OK && n == cap) {
            row *bigger = ds4_alloc(DS4_MEM_OTHER, (size_t)(2 * cap) * sizeof(row));
            if (bigger) memcpy(bigger, rows, (size_t)n * sizeof(row));
            ds4_free(rows);
            rows = bigger;
            cap *= 2;
            if (!rows) st = ds4_fail(DS4_ERR_OOM, "%s: out of memory reading the metrics", path);
        }
        if (st != DS4_OK) break;
        rows[n].order = n;
        st = parse_line(line, ln, scratch, path, lineno, &rows[n]);
        if (st == DS4_OK) n++;
    }
    if (st == DS4_OK) st = fill_metrics(rows, n, out);
    ds4_free(scratch);
    ds4_free(rows);
    ds4_free(text);
    if (st != DS4_OK) ds4_metrics_free(out);
    return st;
}

void ds4_metrics_free(ds4_metrics *m) {
    ds4_free(m->step);
    for (int k = 0; k < DS4_PLOT_NKEYS; k++) ds4_free(m->val[k]);
    memset(m, 0, sizeof *m);
}

int64_t ds4_metrics_count(const ds4_metrics *m, int key) {
    int64_t c = 0;
    for (int64_t i = 0; i < m->n; i++) c += isfinite(m->val[key][i]);
    return c;
}

/* ------------------------------------------------------------------ text buffer */
typedef struct {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->n + n + 1) cap *= 2;
        char *q = ds4_alloc(DS4_MEM_OTHER, cap);
        if (!q) {
            b->oom = true;
            return;
        }
        if (b->p) memcpy(q, b->p, b->n);
        ds4_free(b->p);
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_printf(sbuf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sb_printf(sbuf *b, const char *fmt, ...) {
    char small[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    if ((size_t)n < sizeof small) {
        sb_put(b, small, (size_t)n);
        return;
    }
    char *big = malloc((size_t)n + 1);
    if (!big) {
        b->oom = true;
        return;
    }
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    sb_put(b, big, (size_t)n);
    free(big);
}

/* Text content / attribute value with the XML specials escaped. */
static void sb_escape(sbuf *b, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': sb_put(b, "&amp;", 5); break;
        case '<': sb_put(b, "&lt;", 4); break;
        case '>': sb_put(b, "&gt;", 4); break;
        case '"': sb_put(b, "&quot;", 6); break;
        case '\'': sb_put(b, "&apos;", 6); break;
        default:
            if ((unsigned char)*s >= 0x20 || *s == '\t') sb_put(b, s, 1);
        }
    }
}

/* ------------------------------------------------------------------ axes */
typedef struct {
    double lo, hi, step;
    int64_t klo, khi; /* ticks at k·step, k in [klo, khi] */
    int decimals;
    bool sci;         /* labels in %g form (huge or tiny values) */
} axis;

/* A 1-2-5 step giving about five intervals, and the whole multiples of it that cover [mn, mx]. */
static axis make_axis(double mn, double mx) {
    axis a;
    if (!(mn <= mx)) mn = 0, mx = 1; /* no data */
    if (mn == mx) {
        double pad = mn != 0 ? fabs(mn) * 0.1 : 1;
        mn -= pad;
        mx += pad;
    }
    double raw = (mx - mn) / 5;
    double mag = pow(10, floor(log10(raw)));
    double f = raw / mag;
    f = f <= 1 + 1e-9 ? 1 : f <= 2 + 1e-9 ? 2 : f <= 5 + 1e-9 ? 5 : 10;
    a.step = f * mag;
    a.klo = (int64_t)floor(mn / a.step + 1e-9);
    a.khi = (int64_t)ceil(mx / a.step - 1e-9);
    if (a.khi <= a.klo) a.khi = a.klo + 1;
    a.lo = (double)a.klo * a.step;
    a.hi = (double)a.khi * a.step;
    int e = (int)floor(log10(a.step) + 1e-9);
    a.decimals = e < 0 ? -e : 0;
    a.sci = fmax(fabs(a.lo), fabs(a.hi)) >= 1e6 || a.step < 1e-4;
    return a;
}

static void tick_label(const axis *a, int64_t k, char *buf, size_t n) {
    double v = (double)k * a->step + 0.0; /* + 0.0: no "-0" */
    if (a->sci) snprintf(buf, n, "%.4g", v);
    else snprintf(buf, n, "%.*f", a->decimals, v);
}

/* ------------------------------------------------------------------ SVG */
static const char *const k_colors[] = {"#1f77b4", "#d62728", "#2ca02c", "#ff7f0e",
                                       "#9467bd", "#8c564b", "#e377c2", "#17becf"};
#define NCOLORS ((int)(sizeof k_colors / sizeof k_colors[0]))

typedef struct {
    double top;            /* panel top */
    double x0, y0, w, h;   /* plot area */
    axis ax, ay;
} panel;

static double px(const panel *p, double x) { return p->x0 + (x - p->ax.lo) / (p->ax.hi - p->ax.lo) * p->w; }
static double py(const panel *p, double y) { return p->y0 + (p->ay.hi - y) / (p->ay.hi - p->ay.lo) * p->h; }

static panel make_panel(const ds4_metrics *runs, int nruns, int key, double top) {
    panel p = {.top = top, .x0 = DS4_PLOT_L, .y0 = top + DS4_PLOT_T, .w = DS4_PLOT_WIDTH - DS4_PLOT_L - DS4_PLOT_R,
               .h = DS4_PLOT_PANEL_H - DS4_PLOT_T - DS4_PLOT_B};
    double xmn = INFINITY, xmx = -INFINITY, ymn = INFINITY, ymx = -INFINITY;
    for (int r = 0; r < nruns; r++)
        for (int64_t i = 0; i < runs[r].n; i++) {
            double v = runs[r].val[key][i];
            if (!isfinite(v)) continue;
            xmn = fmin(xmn, runs[r].step[i]), xmx = fmax(xmx, runs[r].step[i]);
            ymn = fmin(ymn, v), ymx = fmax(ymx, v);
        }
    p.ax = make_axis(xmn, xmx);
    p.ay = make_axis(ymn, ymx);
    return p;
}

static void draw_axes(sbuf *b, const panel *p, int key) {
    double cx = p->x0 + p->w / 2, bottom = p->y0 + p->h;
    char lab[64];
    sb_printf(b, "<text class=\"title\" x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\" font-size=\"15\" "
                 "font-weight=\"bold\">", cx, p->top + 24);
    sb_escape(b, k_titles[key]);
    sb_printf(b, "</text>\n");
    for (int64_t k = p->ax.klo; k <= p->ax.khi; k++) {
        double x = px(p, (double)k * p->ax.step);
        tick_label(&p->ax, k, lab, sizeof lab);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#e0e0e0\"/>\n", x, p->y0, x, bottom);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#333\"/>\n", x, bottom, x,
                  bottom + 5);
        sb_printf(b, "<text class=\"xtick\" x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">%s</text>\n", x, bottom + 18,
                  lab);
    }
    for (int64_t k = p->ay.klo; k <= p->ay.khi; k++) {
        double y = py(p, (double)k * p->ay.step);
        tick_label(&p->ay, k, lab, sizeof lab);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#e0e0e0\"/>\n", p->x0, y,
                  p->x0 + p->w, y);
        sb_printf(b, "<line x1=\"%.2f\" y1=\"%.2f\" x2=\"%.2f\" y2=\"%.2f\" stroke=\"#333\"/>\n", p->x0 - 5, y, p->x0,
                  y);
        sb_printf(b, "<text class=\"ytick\" x=\"%.2f\" y=\"%.2f\" text-anchor=\"end\">%s</text>\n", p->x0 - 8, y + 4,
                  lab);
    }
    sb_printf(b, "<rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\" fill=\"none\" stroke=\"#333\"/>\n",
              p->x0, p->y0, p->w, p->h);
    sb_printf(b, "<text class=\"xlabel\" x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\">step</text>\n", cx, bottom + 40);
    double ly = p->y0 + p->h / 2;
    sb_printf(b, "<text class=\"ylabel\" x=\"20\" y=\"%.2f\" text-anchor=\"middle\" transform=\"rotate(-90 20 %.2f)\">",
              ly, ly);
    sb_escape(b, k_names[key]);
    sb_printf(b, "</text>\n");
}

/* One <polyline> per maximal run of finite points; a run of one point is a <circle>. */
static void draw_series(sbuf *b, const panel *p, const ds4_metrics *m, int key, const char *color) {
    const double *v = m->val[key];
    for (int64_t i = 0; i < m->n;) {
        if (!isfinite(v[i])) {
            i++;
            continue;
        }
        int64_t j = i;
        while (j < m->n && isfinite(v[j])) j++;
        if (j - i == 1) {
            sb_printf(b, "<circle cx=\"%.2f\" cy=\"%.2f\" r=\"2.5\" fill=\"%s\"/>\n", px(p, m->step[i]),
                      py(p, v[i]), color);
        } else {
            sb_printf(b, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"1.5\" stroke-linejoin=\"round\" "
                         "points=\"", color);
            for (int64_t t = i; t < j; t++)
                sb_printf(b, "%s%.2f,%.2f", t > i ? " " : "", px(p, m->step[t]), py(p, v[t]));
            sb_printf(b, "\"/>\n");
        }
        i = j;
    }
}

static void draw_legend(sbuf *b, const ds4_metrics *runs, int nruns) {
    for (int r = 0; r < nruns; r++) {
        double y = DS4_PLOT_LEGEND_PAD + DS4_PLOT_LEGEND_ROW * r + DS4_PLOT_LEGEND_ROW / 2.0;
        sb_printf(b, "<line x1=\"%d\" y1=\"%.2f\" x2=\"%d\" y2=\"%.2f\" stroke=\"%s\" stroke-width=\"3\"/>\n",
                  DS4_PLOT_L, y, DS4_PLOT_L + 28, y, k_colors[r % NCOLORS]);
        sb_printf(b, "<text class=\"legend\" x=\"%d\" y=\"%.2f\">", DS4_PLOT_L + 36, y + 4);
        sb_escape(b, runs[r].path);
        sb_printf(b, "</text>\n");
    }
}

ds4_status ds4_plot_svg(const ds4_metrics *runs, int nruns, const int *keys, int nkeys, char **svg, size_t *len) {
    *svg = NULL;
    *len = 0;
    if (nruns < 1 || nruns > DS4_PLOT_MAX_RUNS)
        return ds4_fail(DS4_ERR_ARG, "plot: %d metrics files, expected 1 to %d", nruns, DS4_PLOT_MAX_RUNS);
    if (nkeys < 1) return ds4_fail(DS4_ERR_ARG, "plot: no keys to plot");
    for (int i = 0; i < nkeys; i++)
        if (keys[i] < 0 || keys[i] >= DS4_PLOT_NKEYS) return ds4_fail(DS4_ERR_ARG, "plot: key index %d", keys[i]);
    double legend_h = nruns > 1 ? DS4_PLOT_LEGEND_PAD + DS4_PLOT_LEGEND_ROW * nruns : 0;
    double height = legend_h + (double)nkeys * DS4_PLOT_PANEL_H;
    sbuf b = {0};
    sb_printf(&b, "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
    sb_printf(&b, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%.0f\" viewBox=\"0 0 %d %.0f\" "
                  "font-family=\"sans-serif\" font-size=\"12\">\n", DS4_PLOT_WIDTH, height, DS4_PLOT_WIDTH, height);
    sb_printf(&b, "<title>ds4 training metrics</title>\n");
    sb_printf(&b, "<rect x=\"0\" y=\"0\" width=\"%d\" height=\"%.0f\" fill=\"white\"/>\n", DS4_PLOT_WIDTH, height);
    sb_printf(&b, "<defs>\n");
    for (int i = 0; i < nkeys; i++) {
        panel p = make_panel(runs, nruns, keys[i], legend_h + i * DS4_PLOT_PANEL_H);
        sb_printf(&b, "<clipPath id=\"plot%d\"><rect x=\"%.2f\" y=\"%.2f\" width=\"%.2f\" height=\"%.2f\"/></clipPath>\n",
                  i, p.x0, p.y0, p.w, p.h);
    }
    sb_printf(&b, "</defs>\n");
    if (nruns > 1) draw_legend(&b, runs, nruns);
    for (int i = 0; i < nkeys; i++) {
        int key = keys[i];
        panel p = make_panel(runs, nruns, key, legend_h + i * DS4_PLOT_PANEL_H);
        sb_printf(&b, "<g class=\"panel\" id=\"panel-%s\">\n", k_names[key]);
        draw_axes(&b, &p, key);
        int64_t points = 0;
        sb_printf(&b, "<g clip-path=\"url(#plot%d)\">\n", i);
        for (int r = 0; r < nruns; r++) {
            draw_series(&b, &p, &runs[r], key, k_colors[r % NCOLORS]);
            points += ds4_metrics_count(&runs[r], key);
        }
        sb_printf(&b, "</g>\n");
        if (points == 0)
            sb_printf(&b, "<text x=\"%.2f\" y=\"%.2f\" text-anchor=\"middle\" fill=\"#888\">no data</text>\n",
                      p.x0 + p.w / 2, p.y0 + p.h / 2);
        sb_printf(&b, "</g>\n");
    }
    sb_printf(&b, "</svg>\n");
    if (b.oom) {
        ds4_free(b.p);
        return ds4_fail(DS4_ERR_OOM, "plot: out of memory building the SVG");
    }
    *svg = b.p;
    *len = b.n;
    return DS4_OK;
}

/* ------------------------------------------------------------------ files */
static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && !strcasecmp(s + n - k, suffix);
}

const char *ds4_plot_png_converter(void) {
    static char found[4096];
    const char *path = getenv("PATH");
    while (path && *path) {
        const char *colon = strchr(path, ':');
        size_t n = colon ? (size_t)(colon - path) : strlen(path);
        if (n > 0 && n + 16 < sizeof found) {
            snprintf(found, sizeof found, "%.*s/rsvg-convert", (int)n, path);
            if (access(found, X_OK) == 0) return found;
        }
        path = colon ? colon + 1 : NULL;
    }
    if (access("/usr/bin/convert", X_OK) == 0) return "/usr/bin/convert";
    return NULL;
}

/* Runs the converter on the SVG file `svg`, writing `png`. */
static ds4_status convert_png(const char *conv, const char *svg, const char *png) {
    char *argv_rsvg[] = {(char *)conv, "-o", (char *)png, (char *)svg, NULL};
    char *argv_im[] = {(char *)conv, (char *)svg, (char *)png, NULL};
    char **argv = strstr(conv, "rsvg-convert") ? argv_rsvg : argv_im;
    pid_t pid;
    int rc = posix_spawn(&pid, conv, NULL, NULL, argv, environ);
    if (rc != 0) return ds4_fail(DS4_ERR_IO, "%s: cannot run %s: %s", png, conv, strerror(rc));
    int status;
    if (waitpid(pid, &status, 0) < 0 || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        return ds4_fail(DS4_ERR_IO, "%s: %s failed to convert the SVG", png, conv);
    struct stat sb;
    if (stat(png, &sb) != 0 || sb.st_size == 0)
        return ds4_fail(DS4_ERR_IO, "%s: %s wrote no PNG", png, conv);
    return DS4_OK;
}

ds4_status ds4_plot_write(const char *path, const ds4_metrics *runs, int nruns, const int *keys, int nkeys) {
    bool png = ends_with(path, ".png");
    if (!png && !ends_with(path, ".svg"))
        return ds4_fail(DS4_ERR_ARG, "%s: the output must end in .svg or .png", path);
    const char *conv = png ? ds4_plot_png_converter() : NULL;
    if (png && !conv)
        return ds4_fail(DS4_ERR_UNSUPPORTED,
                        "%s: PNG output needs rsvg-convert or ImageMagick (/usr/bin/convert) and neither is "
                        "installed; write a .svg file instead",
                        path);
    char *svg;
    size_t len;
    DS4_TRY(ds4_plot_svg(runs, nruns, keys, nkeys, &svg, &len));
    if (!png) {
        ds4_status st = ds4_write_file_atomic(path, svg, len);
        ds4_free(svg);
        return st;
    }
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.svg", path);
    ds4_status st = ds4_write_file_atomic(tmp, svg, len);
    ds4_free(svg);
    if (st == DS4_OK) st = convert_png(conv, tmp, path);
    unlink(tmp);
    return st;
}
