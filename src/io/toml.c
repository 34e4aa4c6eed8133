/* A small TOML parser for training configs: one pass over the bytes, a tree of ds4_toml nodes,
 * strict about duplicates, one-line errors with file:line:col. See include/ds4/toml.h for the
 * supported subset. The input need not be NUL-terminated; nothing reads past `len`. */
#include "ds4/toml.h"
#include "ds4/io.h"

#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* How a table came to exist; decides which later definitions are duplicates. */
enum { HOW_IMPLICIT = 0, HOW_HEADER, HOW_DOTTED, HOW_INLINE };

#define MAX_DEPTH 64     /* nesting of arrays / inline tables in one value */
#define MAX_KEY_PARTS 64 /* parts of one dotted key */

typedef struct {
    const char *p, *end;
    const char *line_start;
    int line;
    const char *name;
} parser;

/* ---------------------------------------------------------------- small helpers */

typedef struct {
    char *d;
    int64_t n, cap;
} sbuf;

static bool sb_put(sbuf *b, const char *s, int64_t n) {
    if (!ds4_grow((void **)&b->d, &b->cap, b->n + n + 1, 1)) return false;
    memcpy(b->d + b->n, s, (size_t)n);
    b->n += n;
    b->d[b->n] = 0;
    return true;
}

static bool sb_putc(sbuf *b, char c) { return sb_put(b, &c, 1); }

/* Length of the valid UTF-8 sequence at s (no overlongs, no surrogates, <= U+10FFFF), else 0. */
static int utf8_seq_len(const unsigned char *s, const unsigned char *end) {
    unsigned c = s[0];
    int n;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07;
    else return 0;
    if (end - s < n) return 0;
    for (int i = 1; i < n; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        cp = (cp << 6) | (s[i] & 0x3f);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff))) return 0;
    if (cp >= 0xd800 && cp <= 0xdfff) return 0;
    return n;
}

static int utf8_encode(uint32_t cp, char out[4]) {
    if (cp < 0x80) { out[0] = (char)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (char)(0xc0 | (cp >> 6)); out[1] = (char)(0x80 | (cp & 0x3f));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (char)(0xe0 | (cp >> 12)); out[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
        out[2] = (char)(0x80 | (cp & 0x3f));
        return 3;
    }
    out[0] = (char)(0xf0 | (cp >> 18)); out[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
    out[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); out[3] = (char)(0x80 | (cp & 0x3f));
    return 4;
}

/* Control characters (from escapes in quoted keys or strings) become '?', so that messages stay
 * on one line. Works in place; returns s. */
static char *one_line(char *s) {
    for (char *p = s; *p; p++)
        if ((unsigned char)*p < 0x20 || *p == 0x7f) *p = '?';
    return s;
}

const char *ds4_toml_type_name(ds4_toml_type t) {
    static const char *names[] = {"table", "array", "string", "integer", "float", "boolean"};
    return (unsigned)t <= DS4_TOML_BOOL ? names[t] : "?";
}

static const char *a_or_an(ds4_toml_type t) {
    return (t == DS4_TOML_ARRAY || t == DS4_TOML_INT) ? "an" : "a";
}

/* ---------------------------------------------------------------- nodes */

static ds4_toml *node_new(ds4_toml_type type, int line, int col) {
    ds4_toml *n = ds4_calloc(DS4_MEM_OTHER, sizeof *n);
    if (!n) return NULL;
    n->type = type;
    n->line = line;
    n->col = col;
    return n;
}

void ds4_toml_free(ds4_toml *n) {
    if (!n) return;
    for (int64_t i = 0; i < n->n_kids; i++) ds4_toml_free(n->kids[i]);
    ds4_free(n->kids);
    if (n->type == DS4_TOML_STRING) ds4_free(n->v.s);
    ds4_free(n->key);
    ds4_free(n->src);
    ds4_free(n);
}

static bool node_append(ds4_toml *parent, ds4_toml *kid) {
    if (!ds4_grow((void **)&parent->kids, &parent->cap_kids, parent->n_kids + 1, sizeof(ds4_toml *)))
        return false;
    parent->kids[parent->n_kids++] = kid;
    return true;
}

static ds4_toml *table_find(const ds4_toml *t, const char *key) {
    for (int64_t i = 0; i < t->n_kids; i++)
        if (strcmp(t->kids[i]->key, key) == 0) return t->kids[i];
    return NULL;
}

/* ---------------------------------------------------------------- parser errors */

static int pcol(const parser *P) { return (int)(P->p - P->line_start) + 1; }

static ds4_status vperr(const parser *P, int line, int col, const char *fmt, va_list ap) {
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    return ds4_fail(DS4_ERR_FORMAT, "%s:%d:%d: %s", P->name, line, col, one_line(msg));
}

/* An error at the cursor. */
static ds4_status perr(const parser *P, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static ds4_status perr(const parser *P, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ds4_status st = vperr(P, P->line, pcol(P), fmt, ap);
    va_end(ap);
    return st;
}

/* An error at a remembered place (a key that turned out to be a duplicate). */
static ds4_status perr_at(const parser *P, int line, int col, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static ds4_status perr_at(const parser *P, int line, int col, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    ds4_status st = vperr(P, line, col, fmt, ap);
    va_end(ap);
    return st;
}

/* What the cursor is looking at, for "expected X, got Y". */
static const char *got(const parser *P, char buf[24]) {
    if (P->p >= P->end) return "end of file";
    unsigned char c = (unsigned char)*P->p;
    if (c == '\n' || c == '\r') return "end of line";
    if (c >= 0x20 && c < 0x7f) snprintf(buf, 24, "'%c'", c);
    else snprintf(buf, 24, "byte 0x%02x", c);
    return buf;
}

static ds4_status oom(const parser *P) { return perr(P, "out of memory"); }

/* ---------------------------------------------------------------- lexing */

static bool at_eof(const parser *P) { return P->p >= P->end; }
static bool at(const parser *P, char c) { return P->p < P->end && *P->p == c; }

static bool at_nl(const parser *P) {
    return at(P, '\n') || (at(P, '\r') && P->p + 1 < P->end && P->p[1] == '\n');
}

static void eat_nl(parser *P) {
    P->p += (*P->p == '\r') ? 2 : 1;
    P->line++;
    P->line_start = P->p;
}

static void skip_ws(parser *P) {
    while (P->p < P->end && (*P->p == ' ' || *P->p == '\t')) P->p++;
}

static void skip_comment(parser *P) {
    while (P->p < P->end && *P->p != '\n' && *P->p != '\r') P->p++;
}

/* Whitespace, newlines and comments, as allowed between array items. */
static ds4_status skip_ws_nl(parser *P) {
    for (;;) {
        skip_ws(P);
        if (at(P, '#')) skip_comment(P);
        if (at_nl(P)) eat_nl(P);
        else if (at(P, '\r')) return perr(P, "expected a newline after carriage return");
        else return DS4_OK;
    }
}

static bool is_bare(char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_' ||
           c == '-';
}

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

/* ---------------------------------------------------------------- strings */

/* One escape after a backslash in a basic string; P->p is on the backslash. */
static ds4_status parse_escape(parser *P, bool multi, sbuf *b) {
    const char *bs = P->p;
    if (P->p + 1 >= P->end) { P->p++; return perr(P, "unterminated string: expected an escape after '\\'"); }
    char e = P->p[1];
    const char *simple = "b\bt\tn\nf\fr\r\"\"\\\\e\033";
    for (const char *s = simple; *s; s += 2)
        if (e == s[0]) {
            P->p += 2;
            return sb_putc(b, s[1]) ? DS4_OK : oom(P);
        }
    if (e == 'u' || e == 'U') {
        int nd = e == 'u' ? 4 : 8;
        uint32_t cp = 0;
        P->p += 2;
        for (int i = 0; i < nd; i++) {
            int h = P->p < P->end ? hexval(*P->p) : -1;
            if (h < 0) return perr(P, "expected %d hex digits after '\\%c'", nd, e);
            cp = cp * 16 + (uint32_t)h;
            P->p++;
        }
        if (cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return perr(P, "escape U+%X is not a Unicode scalar value", cp);
        if (cp == 0) return perr(P, "escape \\u0000 (NUL) is not allowed in ds4 configs");
        char u[4];
        return sb_put(b, u, utf8_encode(cp, u)) ? DS4_OK : oom(P);
    }
    if (multi) { /* line-ending backslash: trim it, the newline and following whitespace */
        P->p = bs + 1;
        skip_ws(P);
        if (at_nl(P)) {
            while (!at_eof(P) && (at_nl(P) || *P->p == ' ' || *P->p == '\t')) {
                if (at_nl(P)) eat_nl(P);
                else P->p++;
            }
            return DS4_OK;
        }
    }
    P->p = bs;
    return perr(P, "invalid escape '\\%c' (expected one of \\b \\t \\n \\f \\r \\\" \\\\ \\uXXXX \\UXXXXXXXX)",
                (e >= 0x20 && e < 0x7f) ? e : '?');
}

/* Basic "..." / literal '...' strings and their multi-line forms; P->p on the opening quote. */
static ds4_status parse_string(parser *P, bool allow_multi, char **out) {
    char q = *P->p;
    int line0 = P->line;
    bool multi = P->p + 2 < P->end && P->p[1] == q && P->p[2] == q;
    if (multi && !allow_multi) return perr(P, "multi-line strings cannot be keys");
    sbuf b = {0};
    ds4_status st = DS4_OK;
    P->p += multi ? 3 : 1;
    if (multi && at_nl(P)) eat_nl(P); /* a newline right after the opening quotes is trimmed */
    if (!sb_put(&b, "", 0)) return oom(P);
    for (;;) {
        if (at_eof(P)) {
            st = perr(P, "unterminated string opened at line %d: expected %s", line0,
                      multi ? (q == '"' ? "\"\"\"" : "'''") : (q == '"' ? "'\"'" : "\"'\""));
            break;
        }
        unsigned char c = (unsigned char)*P->p;
        if (c == (unsigned char)q) {
            if (!multi) { P->p++; break; }
            int k = 0;
            while (P->p + k < P->end && P->p[k] == q) k++;
            if (k >= 3) {
                if (k > 5) { st = perr(P, "too many quotes closing a multi-line string"); break; }
                for (int i = 0; i < k - 3; i++)
                    if (!sb_putc(&b, q)) { st = oom(P); break; }
                P->p += k;
                break;
            }
            for (int i = 0; i < k; i++)
                if (!sb_putc(&b, q)) { st = oom(P); break; }
            if (st) break;
            P->p += k;
            continue;
        }
        if (c == '\n' || c == '\r') {
            if (!multi) { st = perr(P, "newline in a single-line string (use \"\"\" for multi-line)"); break; }
            if (!at_nl(P)) { st = perr(P, "carriage return without newline in string"); break; }
            eat_nl(P);
            if (!sb_putc(&b, '\n')) { st = oom(P); break; }
            continue;
        }
        if (c == '\\' && q == '"') {
            if ((st = parse_escape(P, multi, &b))) break;
            continue;
        }
        if ((c < 0x20 && c != '\t') || c == 0x7f) { st = perr(P, "control character 0x%02x in string", c); break; }
        int n = utf8_seq_len((const unsigned char *)P->p, (const unsigned char *)P->end);
        if (n == 0) { st = perr(P, "invalid UTF-8 in string"); break; }
        if (!sb_put(&b, P->p, n)) { st = oom(P); break; }
        P->p += n;
    }
    if (st) {
        ds4_free(b.d);
        return st;
    }
    *out = b.d;
    return DS4_OK;
}

/* ---------------------------------------------------------------- keys */

static ds4_status parse_simple_key(parser *P, char **out) {
    if (at(P, '"') || at(P, '\'')) return parse_string(P, false, out);
    const char *s = P->p;
    while (P->p < P->end && is_bare(*P->p)) P->p++;
    if (P->p == s) {
        char buf[24];
        return perr(P, "expected a key, got %s", got(P, buf));
    }
    *out = ds4_strndup(s, (size_t)(P->p - s));
    return *out ? DS4_OK : oom(P);
}

static void free_parts(char **parts, int n) {
    for (int i = 0; i < n; i++) ds4_free(parts[i]);
}

/* a.b."c d" -> parts; on error nothing is left allocated. */
static ds4_status parse_key(parser *P, char **parts, int *n) {
    *n = 0;
    for (;;) {
        if (*n == MAX_KEY_PARTS) {
            free_parts(parts, *n);
            return perr(P, "key has more than %d dotted parts", MAX_KEY_PARTS);
        }
        ds4_status st = parse_simple_key(P, &parts[*n]);
        if (st) {
            free_parts(parts, *n);
            return st;
        }
        (*n)++;
        skip_ws(P);
        if (!at(P, '.')) return DS4_OK;
        P->p++;
        skip_ws(P);
    }
}

/* "a.b.c" for messages (parts [0, n)). */
static const char *join_key(char **parts, int n, char *buf, size_t cap) {
    size_t off = 0;
    buf[0] = 0;
    for (int i = 0; i < n && off + 1 < cap; i++) {
        int w = snprintf(buf + off, cap - off, "%s%s", i ? "." : "", parts[i]);
        if (w < 0) break;
        off += (size_t)w;
    }
    return one_line(buf);
}

/* ---------------------------------------------------------------- numbers and words */

/* Digits of `base` with single underscores between digits, from s[i]; returns the end index, or -1
 * when an underscore is misplaced. An empty run returns i. */
static int64_t digit_run(const char *s, int64_t i, int64_t n, int base) {
    int64_t start = i;
    for (; i < n; i++) {
        int d = hexval(s[i]);
        if (s[i] == '_') {
            if (i == start || i + 1 >= n || hexval(s[i + 1]) < 0 || hexval(s[i + 1]) >= base) return -1;
            continue;
        }
        if (d < 0 || d >= base) break;
    }
    return i;
}

/* A number token s[0, n) -> int or float node fields. */
static ds4_status parse_number(parser *P, const char *s, int64_t n, ds4_toml *node) {
    char tok[64];
    snprintf(tok, sizeof tok, "%.*s%s", (int)(n < 40 ? n : 40), s, n < 40 ? "" : "...");
    int64_t i = 0;
    bool neg = false, sign = false;
    if (n > 0 && (s[0] == '+' || s[0] == '-')) neg = s[0] == '-', sign = true, i = 1;
    if (n - i == 3 && (memcmp(s + i, "inf", 3) == 0 || memcmp(s + i, "nan", 3) == 0)) {
        node->type = DS4_TOML_FLOAT;
        node->v.f = s[i] == 'i' ? (neg ? -INFINITY : INFINITY) : (neg ? -NAN : NAN);
        return DS4_OK;
    }
    if (n - i >= 2 && s[i] == '0' && (s[i + 1] == 'x' || s[i + 1] == 'o' || s[i + 1] == 'b')) {
        int base = s[i + 1] == 'x' ? 16 : s[i + 1] == 'o' ? 8 : 2;
        if (sign) return perr(P, "invalid number '%s': hex, octal and binary integers take no sign", tok);
        int64_t e = digit_run(s, i + 2, n, base);
        if (e != n || e == i + 2) return perr(P, "invalid number '%s'", tok);
        uint64_t v = 0;
        for (int64_t k = i + 2; k < n; k++) {
            if (s[k] == '_') continue;
            uint64_t d = (uint64_t)hexval(s[k]);
            if (v > ((uint64_t)INT64_MAX - d) / (uint64_t)base)
                return perr(P, "integer '%s' does not fit in 64 bits", tok);
            v = v * (uint64_t)base + d;
        }
        node->type = DS4_TOML_INT;
        node->v.i = (int64_t)v;
        return DS4_OK;
    }
    int64_t int_end = digit_run(s, i, n, 10);
    if (int_end <= i) return perr(P, "invalid number '%s'", tok);
    if (s[i] == '0' && int_end > i + 1) return perr(P, "invalid number '%s': leading zeros are not allowed", tok);
    int64_t e = int_end;
    bool is_float = false;
    if (e < n && s[e] == '.') {
        int64_t f = digit_run(s, e + 1, n, 10);
        if (f <= e + 1) return perr(P, "invalid number '%s': expected digits after '.'", tok);
        e = f;
        is_float = true;
    }
    if (e < n && (s[e] == 'e' || s[e] == 'E')) {
        int64_t x = e + 1;
        if (x < n && (s[x] == '+' || s[x] == '-')) x++;
        int64_t f = digit_run(s, x, n, 10);
        if (f <= x) return perr(P, "invalid number '%s': expected digits in the exponent", tok);
        e = f;
        is_float = true;
    }
    if (e != n) return perr(P, "invalid number '%s'", tok);
    char clean[128];
    int64_t m = 0;
    for (int64_t k = 0; k < n; k++) {
        if (s[k] == '_') continue;
        if (m + 1 >= (int64_t)sizeof clean) return perr(P, "number '%s' is too long", tok);
        clean[m++] = s[k];
    }
    clean[m] = 0;
    if (is_float) {
        errno = 0;
        double v = strtod(clean, NULL);
        if (errno == ERANGE && isinf(v)) return perr(P, "float '%s' is out of range", tok);
        node->type = DS4_TOML_FLOAT;
        node->v.f = v;
        return DS4_OK;
    }
    uint64_t v = 0, lim = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (int64_t k = sign; k < m; k++) {
        uint64_t d = (uint64_t)(clean[k] - '0');
        if (v > (lim - d) / 10) return perr(P, "integer '%s' does not fit in 64 bits", tok);
        v = v * 10 + d;
    }
    node->type = DS4_TOML_INT;
    node->v.i = neg ? (int64_t)(0 - v) : (int64_t)v;
    return DS4_OK;
}

static bool is_word_char(char c) { return is_bare(c) || c == '+' || c == '.' || c == ':'; }

static bool all_digits(const char *s, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (s[i] < '0' || s[i] > '9') return false;
    return true;
}

/* A date (YYYY-MM-DD...) or a time (HH:MM...), the only words TOML 1.0 starts with digits that are not
 * numbers: 2.2e-4 and 1000e-5 are numbers, 1979-05-27 and 07:32:00 are not. */
static bool looks_like_date_or_time(const char *s, int64_t n) {
    bool date = n >= 10 && all_digits(s, 4) && s[4] == '-' && all_digits(s + 5, 2) && s[7] == '-' && all_digits(s + 8, 2);
    bool time = n >= 5 && all_digits(s, 2) && s[2] == ':' && all_digits(s + 3, 2);
    return date || time;
}

/* true / false / inf / nan / numbers; P->p on the first character. */
static ds4_status parse_word(parser *P, ds4_toml *node) {
    const char *s = P->p;
    while (P->p < P->end && is_word_char(*P->p)) P->p++;
    int64_t n = P->p - s;
    const char *cur = P->p;
    P->p = s; /* errors point at the start of the token */
    if (n == 4 && memcmp(s, "true", 4) == 0) node->type = DS4_TOML_BOOL, node->v.b = true;
    else if (n == 5 && memcmp(s, "false", 5) == 0) node->type = DS4_TOML_BOOL, node->v.b = false;
    else if (looks_like_date_or_time(s, n))
        return perr(P, "dates and times are not supported in ds4 configs");
    else if (n == 0 || !((s[0] >= '0' && s[0] <= '9') || s[0] == '+' || s[0] == '-' || s[0] == 'i' || s[0] == 'n')) {
        char buf[24];
        if (n == 0) return perr(P, "expected a value (string, number, boolean, array or inline table), got %s", got(P, buf));
        return perr(P, "expected a value (string, number, boolean, array or inline table), got '%.*s'",
                    (int)(n < 40 ? n : 40), s);
    } else DS4_TRY(parse_number(P, s, n, node));
    P->p = cur;
    return DS4_OK;
}

/* ---------------------------------------------------------------- values and tables */

static ds4_status parse_value(parser *P, int depth, ds4_toml **out);
static ds4_status parse_keyval(parser *P, ds4_toml *table, int depth);

static ds4_status parse_array(parser *P, int depth, ds4_toml *arr) {
    int line0 = P->line;
    P->p++; /* '[' */
    for (;;) {
        DS4_TRY(skip_ws_nl(P));
        char buf[24];
        if (at_eof(P)) return perr(P, "unterminated array opened at line %d: expected ']'", line0);
        if (at(P, ']')) break;
        ds4_toml *item = NULL;
        DS4_TRY(parse_value(P, depth + 1, &item));
        if (!node_append(arr, item)) {
            ds4_toml_free(item);
            return oom(P);
        }
        DS4_TRY(skip_ws_nl(P));
        if (at_eof(P)) return perr(P, "unterminated array opened at line %d: expected ']'", line0);
        if (at(P, ',')) { P->p++; continue; }
        if (at(P, ']')) break;
        return perr(P, "expected ',' or ']' in array, got %s", got(P, buf));
    }
    P->p++;
    return DS4_OK;
}

static ds4_status parse_inline_table(parser *P, int depth, ds4_toml *t) {
    P->p++; /* '{' */
    skip_ws(P);
    if (at(P, '}')) { P->p++; return DS4_OK; }
    for (;;) {
        skip_ws(P);
        DS4_TRY(parse_keyval(P, t, depth + 1));
        skip_ws(P);
        char buf[24];
        if (at(P, ',')) { P->p++; continue; }
        if (at(P, '}')) { P->p++; return DS4_OK; }
        return perr(P, "expected ',' or '}' in inline table, got %s (inline tables stay on one line)", got(P, buf));
    }
}

static ds4_status parse_value(parser *P, int depth, ds4_toml **out) {
    if (depth > MAX_DEPTH) return perr(P, "values nested deeper than %d levels", MAX_DEPTH);
    char buf[24];
    if (at_eof(P) || at_nl(P) || at(P, '#'))
        return perr(P, "expected a value (string, number, boolean, array or inline table), got %s", got(P, buf));
    ds4_toml *n = node_new(DS4_TOML_STRING, P->line, pcol(P));
    if (!n) return oom(P);
    ds4_status st;
    char c = *P->p;
    if (c == '"' || c == '\'') {
        n->type = DS4_TOML_STRING;
        st = parse_string(P, true, &n->v.s);
    } else if (c == '[') {
        n->type = DS4_TOML_ARRAY;
        st = parse_array(P, depth, n);
    } else if (c == '{') {
        n->type = DS4_TOML_TABLE;
        n->how = HOW_INLINE;
        st = parse_inline_table(P, depth, n);
    } else {
        n->type = DS4_TOML_INT; /* no string payload to free on error */
        st = parse_word(P, n);
    }
    if (st) {
        ds4_toml_free(n);
        return st;
    }
    *out = n;
    return DS4_OK;
}

/* Puts `val` at parts[0..n) under `t`, creating dotted tables on the way. Takes `val` on success. */
static ds4_status insert_dotted(parser *P, ds4_toml *t, char **parts, int n, ds4_toml *val) {
    char key[512];
    for (int i = 0; i < n - 1; i++) {
        ds4_toml *c = table_find(t, parts[i]);
        if (!c) {
            c = node_new(DS4_TOML_TABLE, val->line, val->col);
            if (!c || !(c->key = ds4_strndup(parts[i], strlen(parts[i]))) || !node_append(t, c)) {
                ds4_toml_free(c);
                return oom(P);
            }
            c->how = HOW_DOTTED;
        } else if (c->type != DS4_TOML_TABLE) {
            return perr_at(P, val->line, val->col, "key '%s' is already %s %s (line %d), it cannot hold '%s'", join_key(parts, i + 1, key, sizeof key),
                        a_or_an(c->type), ds4_toml_type_name(c->type), c->line, parts[i + 1]);
        } else if (c->how != HOW_DOTTED) {
            return perr_at(P, val->line, val->col, "table '%s' was defined %s at line %d; dotted keys cannot extend it",
                        join_key(parts, i + 1, key, sizeof key), c->how == HOW_INLINE ? "inline" : "by a [header]", c->line);
        }
        t = c;
    }
    ds4_toml *old = table_find(t, parts[n - 1]);
    if (old)
        return perr_at(P, val->line, val->col, "duplicate key '%s' (first defined at line %d)", join_key(parts, n, key, sizeof key), old->line);
    if (!(val->key = ds4_strndup(parts[n - 1], strlen(parts[n - 1])))) return oom(P);
    if (!node_append(t, val)) return oom(P);
    return DS4_OK;
}

static ds4_status parse_keyval(parser *P, ds4_toml *table, int depth) {
    char *parts[MAX_KEY_PARTS];
    int n = 0;
    int line = P->line, col = pcol(P);
    DS4_TRY(parse_key(P, parts, &n));
    char buf[24], key[512];
    ds4_status st;
    if (!at(P, '=')) {
        st = perr(P, "expected '=' after key '%s', got %s", join_key(parts, n, key, sizeof key), got(P, buf));
        free_parts(parts, n);
        return st;
    }
    P->p++;
    skip_ws(P);
    ds4_toml *val = NULL;
    st = parse_value(P, depth, &val);
    if (st == DS4_OK) {
        val->line = line; /* the key's place: messages about it point there */
        val->col = col;
        st = insert_dotted(P, table, parts, n, val);
        if (st) ds4_toml_free(val);
    }
    free_parts(parts, n);
    return st;
}

/* [a.b.c] -> the table it names, created or upgraded from implicit. */
static ds4_status parse_header(parser *P, ds4_toml *root, ds4_toml **cur) {
    const char *open = P->p;
    P->p++;
    if (at(P, '[')) { P->p = open; return perr(P, "arrays of tables [[...]] are not supported in ds4 configs"); }
    skip_ws(P);
    char *parts[MAX_KEY_PARTS];
    int n = 0;
    DS4_TRY(parse_key(P, parts, &n));
    char buf[24], key[512];
    ds4_status st = DS4_OK;
    join_key(parts, n, key, sizeof key);
    if (!at(P, ']')) st = perr(P, "expected ']' after table name '%s', got %s", key, got(P, buf));
    int line = P->line, col = (int)(open - P->line_start) + 1;
    const char *after = P->p + 1;
    P->p = open;
    ds4_toml *t = root;
    for (int i = 0; i < n && !st; i++) {
        ds4_toml *c = table_find(t, parts[i]);
        bool last = i == n - 1;
        if (!c) {
            c = node_new(DS4_TOML_TABLE, line, col);
            if (!c || !(c->key = ds4_strndup(parts[i], strlen(parts[i]))) || !node_append(t, c)) {
                ds4_toml_free(c);
                st = oom(P);
                break;
            }
            c->how = last ? HOW_HEADER : HOW_IMPLICIT;
        } else if (c->type != DS4_TOML_TABLE) {
            char sub[512];
            st = perr(P, "table [%s]: key '%s' is already %s %s (line %d)", key, join_key(parts, i + 1, sub, sizeof sub),
                      a_or_an(c->type), ds4_toml_type_name(c->type), c->line);
        } else if (c->how == HOW_INLINE) {
            st = perr(P, "table [%s]: '%s' was defined inline at line %d and cannot be extended", key, parts[i], c->line);
        } else if (last && c->how == HOW_HEADER) {
            st = perr(P, "duplicate table [%s] (first defined at line %d)", key, c->line);
        } else if (last && c->how == HOW_DOTTED) {
            st = perr(P, "table [%s] was already defined by dotted keys at line %d", key, c->line);
        } else if (last) {
            c->how = HOW_HEADER, c->line = line, c->col = col;
        }
        t = c;
    }
    free_parts(parts, n);
    if (st) return st;
    P->p = after;
    *cur = t;
    return DS4_OK;
}

static ds4_status parse_document(parser *P, ds4_toml *root) {
    ds4_toml *cur = root;
    for (;;) {
        skip_ws(P);
        if (at_eof(P)) return DS4_OK;
        if (at_nl(P)) { eat_nl(P); continue; }
        if (at(P, '#')) skip_comment(P);
        else if (at(P, '[')) DS4_TRY(parse_header(P, root, &cur));
        else DS4_TRY(parse_keyval(P, cur, 0));
        skip_ws(P);
        if (at(P, '#')) skip_comment(P);
        if (at_eof(P)) return DS4_OK;
        if (!at_nl(P)) {
            char buf[24];
            return perr(P, "expected end of line, got %s", got(P, buf));
        }
        eat_nl(P);
    }
}

ds4_status ds4_toml_parse(const char *text, size_t len, const char *name, ds4_toml **out) {
    *out = NULL;
    if (!name) name = "<string>";
    parser P = {.p = text, .end = text + len, .line_start = text, .line = 1, .name = name};
    if (len >= 3 && memcmp(text, "\xef\xbb\xbf", 3) == 0) P.p += 3, P.line_start = P.p; /* BOM */
    ds4_toml *root = node_new(DS4_TOML_TABLE, 1, 1);
    if (!root || !(root->src = ds4_strndup(name, strlen(name)))) {
        ds4_toml_free(root);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", name);
    }
    root->how = HOW_HEADER;
    ds4_status st = parse_document(&P, root);
    if (st) {
        ds4_toml_free(root);
        return st;
    }
    *out = root;
    return DS4_OK;
}

ds4_status ds4_toml_load(const char *path, ds4_toml **out) {
    *out = NULL;
    char *text;
    size_t len;
    DS4_TRY(ds4_read_file(path, &text, &len));
    ds4_status st = ds4_toml_parse(text, len, path, out);
    ds4_free(text);
    return st;
}

/* ---------------------------------------------------------------- lookup */

/* Walks "a.b.c"; an absent part or a non-table on the way gives NULL. */
const ds4_toml *ds4_toml_find(const ds4_toml *t, const char *dotted) {
    char part[256];
    const char *s = dotted;
    while (t) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        if (n >= sizeof part || t->type != DS4_TOML_TABLE) return NULL;
        memcpy(part, s, n);
        part[n] = 0;
        t = table_find(t, part);
        if (!dot) return t;
        s = dot + 1;
    }
    return NULL;
}

static ds4_status type_err(const ds4_toml *root, const char *key, const ds4_toml *n, const char *want) {
    char val[80] = "";
    if (n->type == DS4_TOML_STRING) snprintf(val, sizeof val, " \"%.60s\"", n->v.s);
    one_line(val);
    if (n->line == 0) return ds4_fail(DS4_ERR_CONFIG, "--%s: expected %s, got %s%s", key, want, ds4_toml_type_name(n->type), val);
    return ds4_fail(DS4_ERR_CONFIG, "%s:%d:%d: key %s: expected %s, got %s%s", root->src ? root->src : "<config>", n->line,
                    n->col, key, want, ds4_toml_type_name(n->type), val);
}

static ds4_status lookup(const ds4_toml *root, const char *key, ds4_toml_type want, bool required,
                         const ds4_toml **out) {
    *out = ds4_toml_find(root, key);
    if (!*out) {
        if (!required) return DS4_OK;
        return ds4_fail(DS4_ERR_MISSING, "%s: missing key %s", root->src ? root->src : "<config>", key);
    }
    bool ok = (*out)->type == want || (want == DS4_TOML_FLOAT && (*out)->type == DS4_TOML_INT);
    return ok ? DS4_OK : type_err(root, key, *out, ds4_toml_type_name(want));
}

ds4_status ds4_toml_int_or(const ds4_toml *root, const char *key, int64_t def, int64_t *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_INT, false, &n));
    *out = n ? n->v.i : def;
    return DS4_OK;
}

ds4_status ds4_toml_float_or(const ds4_toml *root, const char *key, double def, double *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_FLOAT, false, &n));
    *out = !n ? def : n->type == DS4_TOML_INT ? (double)n->v.i : n->v.f;
    return DS4_OK;
}

ds4_status ds4_toml_bool_or(const ds4_toml *root, const char *key, bool def, bool *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_BOOL, false, &n));
    *out = n ? n->v.b : def;
    return DS4_OK;
}

ds4_status ds4_toml_string_or(const ds4_toml *root, const char *key, const char *def, const char **out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_STRING, false, &n));
    *out = n ? n->v.s : def;
    return DS4_OK;
}

ds4_status ds4_toml_get_int(const ds4_toml *root, const char *key, int64_t *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_INT, true, &n));
    *out = n->v.i;
    return DS4_OK;
}

ds4_status ds4_toml_get_float(const ds4_toml *root, const char *key, double *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_FLOAT, true, &n));
    *out = n->type == DS4_TOML_INT ? (double)n->v.i : n->v.f;
    return DS4_OK;
}

ds4_status ds4_toml_get_bool(const ds4_toml *root, const char *key, bool *out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_BOOL, true, &n));
    *out = n->v.b;
    return DS4_OK;
}

ds4_status ds4_toml_get_string(const ds4_toml *root, const char *key, const char **out) {
    const ds4_toml *n;
    DS4_TRY(lookup(root, key, DS4_TOML_STRING, true, &n));
    *out = n->v.s;
    return DS4_OK;
}

/* ---------------------------------------------------------------- overrides */

/* The value text as a TOML value, or NULL when it is not one (the caller then takes a string). */
static ds4_toml *parse_override_value(const char *text) {
    size_t len = strlen(text);
    parser P = {.p = text, .end = text + len, .line_start = text, .line = 1, .name = "override"};
    skip_ws(&P);
    ds4_toml *v = NULL;
    if (parse_value(&P, 0, &v) != DS4_OK) return NULL;
    skip_ws(&P);
    if (!at_eof(&P)) {
        ds4_toml_free(v);
        return NULL;
    }
    return v;
}

static void mark_override(ds4_toml *n) {
    n->line = 0;
    n->col = 0;
    for (int64_t i = 0; i < n->n_kids; i++) mark_override(n->kids[i]);
}

ds4_status ds4_toml_set(ds4_toml *root, const char *dotted, const char *value) {
    ds4_toml *val = parse_override_value(value);
    if (!val) {
        val = node_new(DS4_TOML_STRING, 0, 0);
        if (!val || !(val->v.s = ds4_strndup(value, strlen(value)))) {
            ds4_toml_free(val);
            return ds4_fail(DS4_ERR_OOM, "--%s: out of memory", dotted);
        }
    }
    mark_override(val);
    ds4_toml *t = root;
    const char *s = dotted;
    ds4_status st = DS4_OK;
    for (;;) {
        const char *dot = strchr(s, '.');
        size_t n = dot ? (size_t)(dot - s) : strlen(s);
        if (n == 0) { st = ds4_fail(DS4_ERR_ARG, "--%s: empty part in key", dotted); break; }
        char *part = ds4_strndup(s, n);
        if (!part) { st = ds4_fail(DS4_ERR_OOM, "--%s: out of memory", dotted); break; }
        ds4_toml *c = table_find(t, part);
        if (!dot) { /* the leaf */
            if (c && c->type == DS4_TOML_TABLE) {
                st = ds4_fail(DS4_ERR_ARG, "--%s: that is a table; set one of its keys", dotted);
                ds4_free(part);
                break;
            }
            val->key = part;
            if (c) {
                for (int64_t i = 0; i < t->n_kids; i++)
                    if (t->kids[i] == c) t->kids[i] = val;
                ds4_toml_free(c);
            } else if (!node_append(t, val)) {
                st = ds4_fail(DS4_ERR_OOM, "--%s: out of memory", dotted);
                break;
            }
            return DS4_OK;
        }
        if (!c) {
            c = node_new(DS4_TOML_TABLE, 0, 0);
            if (!c || !node_append(t, c)) {
                ds4_toml_free(c);
                ds4_free(part);
                st = ds4_fail(DS4_ERR_OOM, "--%s: out of memory", dotted);
                break;
            }
            c->key = part;
            c->how = HOW_HEADER;
        } else {
            ds4_free(part);
            if (c->type != DS4_TOML_TABLE) {
                st = ds4_fail(DS4_ERR_ARG, "--%s: '%.*s' is %s %s, not a table", dotted, (int)(dot - dotted), dotted,
                              a_or_an(c->type), ds4_toml_type_name(c->type));
                break;
            }
        }
        t = c;
        s = dot + 1;
    }
    ds4_toml_free(val);
    return st;
}

ds4_status ds4_toml_apply_overrides(ds4_toml *root, int *argc, char **argv) {
    int w = 1;
    for (int i = 1; i < *argc; i++) {
        const char *a = argv[i];
        const char *name = a + 2, *eq = NULL, *dot = NULL;
        if (a[0] == '-' && a[1] == '-') {
            eq = strchr(name, '=');
            dot = strchr(name, '.');
            if (dot && eq && dot > eq) dot = NULL;
        }
        if (!dot) {
            argv[w++] = argv[i];
            continue;
        }
        char key[256];
        const char *value;
        size_t klen = eq ? (size_t)(eq - name) : strlen(name);
        if (klen >= sizeof key) return ds4_fail(DS4_ERR_ARG, "%s: flag name too long", a);
        memcpy(key, name, klen);
        key[klen] = 0;
        if (eq) value = eq + 1;
        else if (i + 1 < *argc && strncmp(argv[i + 1], "--", 2) != 0) value = argv[++i];
        else value = "true";
        DS4_TRY(ds4_toml_set(root, key, value));
    }
    *argc = w;
    argv[w] = NULL;
    return DS4_OK;
}

/* ---------------------------------------------------------------- schema check */

int64_t ds4_edit_distance(const char *a, const char *b) {
    int64_t na = (int64_t)strlen(a), nb = (int64_t)strlen(b);
    int64_t *row = ds4_alloc(DS4_MEM_WORK, (size_t)(nb + 1) * sizeof(int64_t));
    if (!row) return na > nb ? na : nb;
    for (int64_t j = 0; j <= nb; j++) row[j] = j;
    for (int64_t i = 1; i <= na; i++) {
        int64_t diag = row[0]; /* d[i-1][j-1] */
        row[0] = i;
        for (int64_t j = 1; j <= nb; j++) {
            int64_t up = row[j]; /* d[i-1][j] */
            int64_t best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best) best = up + 1;
            if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    int64_t d = row[nb];
    ds4_free(row);
    return d;
}

int64_t ds4_closest_name(const char *s, const char *const *names, int64_t n) {
    int64_t best = -1, best_d = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t d = ds4_edit_distance(s, names[i]);
        if (best < 0 || d < best_d) best = i, best_d = d;
    }
    return best;
}

static bool key_known(const char *path, const char *const *known, int64_t n) {
    size_t pl = strlen(path);
    for (int64_t i = 0; i < n; i++) {
        const char *k = known[i];
        size_t kl = strlen(k);
        if (strcmp(k, path) == 0) return true;
        if (kl >= 2 && strcmp(k + kl - 2, ".*") == 0) { /* "a.*" accepts a and a.anything */
            size_t bl = kl - 2;
            if (pl >= bl && memcmp(path, k, bl) == 0 && (pl == bl || path[bl] == '.')) return true;
        }
    }
    return false;
}

/* An empty table is fine when some known key lives under it. */
static bool table_known(const char *path, const char *const *known, int64_t n) {
    size_t pl = strlen(path);
    for (int64_t i = 0; i < n; i++)
        if (strncmp(known[i], path, pl) == 0 && known[i][pl] == '.') return true;
    return false;
}

static ds4_status check_table(const ds4_toml *root, const ds4_toml *t, const char *prefix,
                              const char *const *known, int64_t n) {
    for (int64_t i = 0; i < t->n_kids; i++) {
        const ds4_toml *k = t->kids[i];
        size_t len = strlen(prefix) + strlen(k->key) + 2;
        char *path = ds4_alloc(DS4_MEM_WORK, len);
        if (!path) return ds4_fail(DS4_ERR_OOM, "out of memory checking config keys");
        snprintf(path, len, "%s%s%s", prefix, *prefix ? "." : "", k->key);
        one_line(path);
        ds4_status st = DS4_OK;
        bool is_table = k->type == DS4_TOML_TABLE;
        if (key_known(path, known, n)) {
            /* accepted as a whole */
        } else if (is_table && (k->n_kids > 0 || table_known(path, known, n))) {
            st = check_table(root, k, path, known, n);
        } else {
            int64_t c = ds4_closest_name(path, known, n);
            char hint[300] = "";
            if (c >= 0) snprintf(hint, sizeof hint, " (did you mean '%s'?)", known[c]);
            if (k->line == 0) st = ds4_fail(DS4_ERR_CONFIG, "--%s: unknown key%s", path, hint);
            else st = ds4_fail(DS4_ERR_CONFIG, "%s:%d:%d: unknown key '%s'%s", root->src ? root->src : "<config>", k->line,
                               k->col, path, hint);
        }
        ds4_free(path);
        if (st) return st;
    }
    return DS4_OK;
}

ds4_status ds4_toml_check_keys(const ds4_toml *root, const char *const *known, int64_t n_known) {
    return check_table(root, root, "", known, n_known);
}
