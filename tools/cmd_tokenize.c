/* ds4 tokenize: text files, or .jsonl files with {"text": ...} per line (the c4 layout), into
 * token shards train_000000.bin ... and val_000000.bin ... (format: include/ds4/shard.h).
 *
 * A plain text file is one document; a .jsonl line is one document. The validation split is the
 * last --val-fraction of the input bytes: documents that start past that point go to val, and a
 * text file that straddles it is cut at the first newline after it. Documents are encoded in
 * parallel in batches and written in input order, so the shards do not depend on the thread count.
 * A JSON "\u0000" in the text is the byte 0 for the tokenizer (as Python's json gives it); a raw NUL
 * byte in a .jsonl line is an error naming the line. With --overwrite the old shards are replaced only
 * once the new ones are complete: a run that fails leaves them as they were. */
#include "cli.h"
#include "cmds.h"
#include "ds4/io.h"
#include "ds4/shard.h"
#include "ds4/tokenizer.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#define NFLAGS(f) ((int)(sizeof(f) / sizeof((f)[0])))

/* Prints "error: ..." and returns 1. */
static int errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int errorf(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("error: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return 1;
}
#define BATCH_BYTES (8 << 20) /* text encoded per parallel batch */
#define BATCH_DOCS 4096

/* ---------------------------------------------------------------- input files */

typedef struct {
    char **path;
    int64_t *bytes;
    int64_t n, cap;
} file_list;

static int add_file(file_list *l, const char *p, int64_t bytes) {
    if (l->n == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 64;
        l->path = realloc(l->path, (size_t)l->cap * sizeof(char *));
        l->bytes = realloc(l->bytes, (size_t)l->cap * sizeof(int64_t));
        if (!l->path || !l->bytes) return errorf("out of memory listing inputs");
    }
    l->path[l->n] = strdup(p);
    l->bytes[l->n++] = bytes;
    return 0;
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static bool is_jsonl(const char *p) { return ends_with(p, ".jsonl") || ends_with(p, ".json"); }

/* FILE, DIR (its regular files, sorted, hidden ones skipped) or GLOB (sorted). */
static int expand_input(const char *pat, file_list *out) {
    struct stat sb;
    if (stat(pat, &sb) == 0 && S_ISREG(sb.st_mode)) return add_file(out, pat, (int64_t)sb.st_size);
    if (stat(pat, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(pat);
        if (!d) return errorf("--input %s: cannot read directory: %s", pat, strerror(errno));
        char **names = NULL;
        size_t n = 0;
        struct dirent *e;
        while ((e = readdir(d))) {
            if (e->d_name[0] == '.') continue;
            names = realloc(names, (n + 1) * sizeof(char *));
            names[n++] = strdup(e->d_name);
        }
        closedir(d);
        if (n) qsort(names, n, sizeof(char *), cmp_str);
        int rc = 0, before = (int)out->n;
        for (size_t i = 0; i < n; i++) {
            char full[4096];
            snprintf(full, sizeof full, "%s/%s", pat, names[i]);
            if (!rc && stat(full, &sb) == 0 && S_ISREG(sb.st_mode)) rc = add_file(out, full, (int64_t)sb.st_size);
            free(names[i]);
        }
        free(names);
        if (!rc && out->n == before) return errorf("--input %s: the directory holds no files", pat);
        return rc;
    }
    if (stat(pat, &sb) == 0) /* a FIFO, socket or device: reading it could block forever */
        return errorf("--input %s: not a regular file or a directory", pat);
    glob_t g;
    int grc = glob(pat, 0, NULL, &g);
    int rc = 0;
    if (grc != 0) {
        rc = errorf("--input %s: no such file or directory, and no file matches it", pat);
    }
    for (size_t i = 0; !rc && i < g.gl_pathc; i++)
        if (stat(g.gl_pathv[i], &sb) == 0 && S_ISREG(sb.st_mode)) rc = add_file(out, g.gl_pathv[i], (int64_t)sb.st_size);
    globfree(&g);
    return rc;
}

/* ---------------------------------------------------------------- progress on stderr */

typedef struct {
    double t0, last;
    int64_t done, total, tokens;
    bool tty;
} progress;

static void progress_show(progress *p, bool final) {
    double now = ds4_now();
    if (!final && now - p->last < (p->tty ? 0.2 : 10.0)) return;
    p->last = now;
    double frac = p->total ? (double)p->done / (double)p->total : 1.0;
    double mb = (double)p->done / 1e6, mbs = mb / (now - p->t0 > 1e-9 ? now - p->t0 : 1e-9);
    char bar[31];
    int fill = (int)(frac * 30);
    for (int i = 0; i < 30; i++) bar[i] = i < fill ? '#' : '.';
    bar[30] = 0;
    fprintf(stderr, "%s%5.1f%% [%s] %.1f/%.1f MB  %.2f MB/s  %.2fM tokens%s", p->tty ? "\r" : "", 100 * frac, bar, mb,
            (double)p->total / 1e6, mbs, (double)p->tokens / 1e6, p->tty && !final ? "" : "\n");
    fflush(stderr);
}

/* ---------------------------------------------------------------- output shards */

/* Shards are written under a staging name that no shard glob matches ("DIR/.train_000000.bin.new-PID"),
 * and take their final names only once every input was read and every shard written (commit_shards):
 * a run that fails half-way leaves the shards already in DIR as they were. */
typedef struct {
    const char *dir, *prefix;
    const ds4_tokenizer *tok;
    int64_t shard_tokens;
    ds4_shard_writer *w;
    int64_t n_shards, tokens, docs;
} split_out;

static void staged_path(const split_out *o, int64_t i, char *buf, size_t n) {
    snprintf(buf, n, "%s/.%s_%06lld.bin.new-%ld", o->dir, o->prefix, (long long)i, (long)getpid());
}

static void final_path(const split_out *o, int64_t i, char *buf, size_t n) {
    snprintf(buf, n, "%s/%s_%06lld.bin", o->dir, o->prefix, (long long)i);
}

/* After a failure: the staged shards go, the unfinished one is dropped unwritten. */
static void discard_staged(split_out *o) {
    ds4_shard_writer_abort(o->w);
    o->w = NULL;
    char p[4096];
    for (int64_t i = 0; i < o->n_shards; i++) {
        staged_path(o, i, p, sizeof p);
        unlink(p);
    }
    o->n_shards = 0;
}

static int out_close(split_out *o) {
    if (!o->w) return 0;
    ds4_status s = ds4_shard_writer_close(o->w);
    o->w = NULL;
    return s ? cli_fail() : 0;
}

static int out_add(split_out *o, const int32_t *ids, int64_t n) {
    if (n == 0) return 0;
    if (!o->w) {
        char path[4096];
        staged_path(o, o->n_shards, path, sizeof path);
        if (ds4_shard_writer_open(path, ds4_tokenizer_vocab_size(o->tok), ds4_tokenizer_bos(o->tok),
                                  ds4_tokenizer_eos(o->tok), &o->w))
            return cli_fail();
        o->n_shards++;
    }
    if (ds4_shard_writer_add(o->w, ids, n)) return cli_fail();
    o->tokens += n;
    o->docs++;
    if (ds4_shard_writer_tokens(o->w) >= o->shard_tokens) return out_close(o);
    return 0;
}

/* ---------------------------------------------------------------- documents in batches */

typedef struct {
    char *text;        /* owned copy */
    int64_t len;
    bool val;
} doc;

typedef struct {
    doc *d;
    int64_t n, cap, bytes;
    ds4_tokens *ids;   /* [cap] */
} batch;

/* Encodes the batch in parallel, then writes it in order and empties it. */
static int flush_batch(batch *b, const ds4_tokenizer *tok, bool special, split_out *train, split_out *val, progress *pr) {
    int failed = 0;
    char msg[1024] = "";
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < b->n; i++) {
        b->ids[i].n = 0;
        if (ds4_tokenizer_encode(tok, b->d[i].text, (size_t)b->d[i].len, special, &b->ids[i]) != DS4_OK) {
#pragma omp critical
            if (!failed) failed = 1, snprintf(msg, sizeof msg, "%s", ds4_errmsg());
        }
    }
    if (failed) return errorf("%s", msg);
    for (int64_t i = 0; i < b->n; i++) {
        if (out_add(b->d[i].val ? val : train, b->ids[i].ids, b->ids[i].n)) return 1;
        pr->tokens += b->ids[i].n;
        free(b->d[i].text);
    }
    b->n = 0;
    b->bytes = 0;
    progress_show(pr, false);
    return 0;
}

static int add_doc(batch *b, const char *text, int64_t len, bool val, const ds4_tokenizer *tok, bool special,
                   split_out *train, split_out *vo, progress *pr) {
    if (len == 0) return 0;
    if (b->n == b->cap && flush_batch(b, tok, special, train, vo, pr)) return 1;
    doc *d = &b->d[b->n];
    if (!(d->text = malloc((size_t)len))) return errorf("out of memory holding a %lld-byte document", (long long)len);
    memcpy(d->text, text, (size_t)len);
    d->len = len;
    d->val = val;
    b->n++;
    b->bytes += len;
    if (b->bytes >= BATCH_BYTES) return flush_batch(b, tok, special, train, vo, pr);
    return 0;
}

/* ---------------------------------------------------------------- regular files only */

/* Opens an input for reading, refusing anything but a regular file with a clear error (a FIFO would
 * block the open or the read forever, a directory fails obscurely). O_NONBLOCK keeps the open of a
 * FIFO from waiting for a writer; it is cleared before reading. Returns the fd, or -1 after errorf. */
static int open_regular(const char *path) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) return errorf("%s: cannot open: %s", path, strerror(errno)), -1;
    struct stat sb;
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        close(fd);
        return errorf("%s: not a regular file (%s); --input reads regular files only", path,
                      S_ISDIR(sb.st_mode) ? "a directory" : S_ISFIFO(sb.st_mode) ? "a FIFO" : "a special file"), -1;
    }
    fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
    return fd;
}

/* A whole regular file into memory (malloc'ed). */
static int read_regular(const char *path, char **data, size_t *len) {
    int fd = open_regular(path);
    if (fd < 0) return 1;
    struct stat sb;
    size_t n = fstat(fd, &sb) == 0 ? (size_t)sb.st_size : 0, got = 0;
    char *buf = malloc(n ? n : 1);
    int rc = buf ? 0 : errorf("%s: out of memory reading %zu bytes", path, n);
    while (!rc && got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) rc = errorf("%s: read failed after %zu of %zu bytes: %s", path, got, n, r < 0 ? strerror(errno) : "the file shrank");
        else got += (size_t)r;
    }
    close(fd);
    if (rc) free(buf);
    *data = rc ? NULL : buf;
    *len = rc ? 0 : n;
    return rc;
}

/* ---------------------------------------------------------------- readers */

typedef struct {
    batch *b;
    const ds4_tokenizer *tok;
    bool special;
    split_out *train, *val;
    progress *pr;
    int64_t boundary;  /* input bytes before this go to train */
    const char *key;   /* the JSON field holding the text */
} ctx;

/* A text file: one document, cut at the first newline past the val boundary when it straddles it. */
static int read_text(ctx *c, const char *path, int64_t start) {
    char *text;
    size_t len;
    if (read_regular(path, &text, &len)) return 1;
    int64_t cut = c->boundary - start; /* bytes of this file that belong to train */
    if (cut < 0) cut = 0;
    if (cut > (int64_t)len) cut = (int64_t)len;
    if (cut > 0 && cut < (int64_t)len) {
        const char *nl = memchr(text + cut, '\n', len - (size_t)cut);
        cut = nl ? nl - text + 1 : (int64_t)len;
    }
    int rc = add_doc(c->b, text, cut, false, c->tok, c->special, c->train, c->val, c->pr);
    if (!rc) rc = add_doc(c->b, text + cut, (int64_t)len - cut, true, c->tok, c->special, c->train, c->val, c->pr);
    free(text);
    c->pr->done += (int64_t)len;
    return rc;
}

/* ---------------------------------------------------------------- JSON strings with their length */

/* cJSON validates a line but hands back NUL-terminated strings, so a "\u0000" in the text would cut
 * the document there. The field is therefore decoded again here, keeping every byte: the tokenizer
 * sees U+0000 as the byte 0, as Python's json module and the Hugging Face loaders give it. These
 * scanners only ever run on a line cJSON has accepted, so they trust its syntax. */

static int hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v = 16 * v + (c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c - 'A' + 10);
    }
    return v;
}

/* Code point cp (< 0x110000) as UTF-8 into o: its byte count. */
static size_t put_utf8(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    int n = cp < 0x800 ? 2 : cp < 0x10000 ? 3 : 4;
    static const uint8_t lead[5] = {0, 0, 0xc0, 0xe0, 0xf0};
    for (int i = n - 1; i > 0; i--, cp >>= 6) o[i] = (char)(0x80 | (cp & 0x3f));
    o[0] = (char)(lead[n] | cp);
    return (size_t)n;
}

/* The JSON string starting at *p (on its opening quote) decoded into out (room for as many bytes as
 * the raw string has: decoding never grows it); *p moves past the closing quote. Returns the length. */
static size_t json_string(const char **p, char *out) {
    const char *s = *p + 1;
    size_t n = 0;
    while (*s != '"') {
        if (*s != '\\') {
            out[n++] = *s++;
            continue;
        }
        char e = s[1];
        s += 2;
        if (e == 'u') {
            uint32_t cp = (uint32_t)hex4(s);
            s += 4;
            if (cp >= 0xd800 && cp < 0xdc00 && s[0] == '\\' && s[1] == 'u') { /* a surrogate pair */
                cp = 0x10000 + ((cp - 0xd800) << 10) + ((uint32_t)hex4(s + 2) - 0xdc00);
                s += 6;
            }
            n += put_utf8(out + n, cp);
        } else {
            out[n++] = e == 'b' ? '\b' : e == 'f' ? '\f' : e == 'n' ? '\n' : e == 'r' ? '\r' : e == 't' ? '\t' : e;
        }
    }
    *p = s + 1;
    return n;
}

static const char *skip_space(const char *s) {
    while (*s == ' ' || *s == '\t' || *s == '\r' || *s == '\n') s++;
    return s;
}

/* Past one JSON value (string, number, literal, or a nested object / array). */
static const char *skip_value(const char *s) {
    int depth = 0;
    do {
        if (*s == '"') {
            for (s++; *s != '"'; s++)
                if (*s == '\\') s++;
            s++;
        } else if (*s == '{' || *s == '[') depth++, s++;
        else if (*s == '}' || *s == ']') depth--, s++;
        else if (depth == 0) {
            while (*s && *s != ',' && *s != '}' && *s != ']' && *s != ' ' && *s != '\t' && *s != '\r' && *s != '\n') s++;
        } else s++;
    } while (depth > 0);
    return s;
}

/* The first top-level member `key` of the object in `line` (NUL-terminated, accepted by cJSON)
 * decoded into buf (as many bytes as the line): its length, or -1 when no member has exactly that
 * name with a string value. */
static int64_t json_field(const char *line, const char *key, char *buf) {
    const size_t klen = strlen(key);
    const char *s = skip_space(skip_space(line) + 1); /* past '{' */
    while (*s == '"') {
        size_t kn = json_string(&s, buf);
        bool match = kn == klen && memcmp(buf, key, klen) == 0;
        s = skip_space(skip_space(s) + 1); /* past ':' */
        if (match) return *s == '"' ? (int64_t)json_string(&s, buf) : -1;
        s = skip_space(skip_value(s));
        if (*s == ',') s = skip_space(s + 1);
    }
    return -1;
}

/* A .jsonl file: one JSON object per line, the document in its string field c->key. */
static int read_jsonl(ctx *c, const char *path, int64_t start) {
    int fd = open_regular(path);
    if (fd < 0) return 1;
    FILE *f = fdopen(fd, "rb");
    if (!f) {
        close(fd);
        return errorf("%s: cannot open: %s", path, strerror(errno));
    }
    char *line = NULL, *text = NULL;
    size_t cap = 0, text_cap = 0;
    ssize_t n;
    int64_t lineno = 0, off = start;
    int rc = 0;
    while (!rc && (n = getline(&line, &cap, f)) > 0) {
        lineno++;
        int64_t line_start = off;
        off += n;
        c->pr->done += n;
        size_t k = 0;
        while (k < (size_t)n && (line[k] == ' ' || line[k] == '\t' || line[k] == '\r' || line[k] == '\n')) k++;
        if (k == (size_t)n) continue; /* blank line */
        if (memchr(line, 0, (size_t)n)) {
            rc = errorf("%s:%lld: a raw NUL byte in the line (JSON writes it as \\u0000 inside a string)", path,
                        (long long)lineno);
            break;
        }
        cJSON *j = cJSON_ParseWithLength(line, (size_t)n);
        bool ok = cJSON_IsObject(j) && cJSON_IsString(cJSON_GetObjectItemCaseSensitive(j, c->key));
        cJSON_Delete(j);
        if (ok && (size_t)n + 1 > text_cap) {
            free(text);
            if (!(text = malloc(text_cap = (size_t)n + 1))) {
                rc = errorf("%s:%lld: out of memory decoding a %lld-byte line", path, (long long)lineno, (long long)n);
                break;
            }
        }
        int64_t len = ok ? json_field(line, c->key, text) : -1;
        if (len < 0) {
            rc = errorf("%s:%lld: expected a JSON object with a string \"%s\"", path, (long long)lineno, c->key);
            break;
        }
        rc = add_doc(c->b, text, len, line_start >= c->boundary, c->tok, c->special, c->train, c->val, c->pr);
    }
    if (!rc && ferror(f)) rc = errorf("%s: read error", path);
    free(line);
    free(text);
    fclose(f);
    return rc;
}

/* ---------------------------------------------------------------- the command */

/* DIR/PREFIX_[0-9]*.bin: the shards of one kind already there. */
static bool glob_shards(const char *dir, const char *prefix, glob_t *g) {
    char pat[4096];
    snprintf(pat, sizeof pat, "%s/%s_[0-9]*.bin", dir, prefix);
    return glob(pat, 0, NULL, g) == 0;
}

/* Existing shards would mix with the new ones under a glob: refused up front without --overwrite
 * (nothing is removed here; commit_shards replaces them once the new ones are complete). */
static int refuse_old_shards(const char *dir, bool overwrite) {
    const char *kinds[2] = {"train", "val"};
    for (int k = 0; k < 2 && !overwrite; k++) {
        glob_t g;
        if (glob_shards(dir, kinds[k], &g)) {
            errorf("%s already holds shards (%s); pass --overwrite to replace them", dir, g.gl_pathv[0]);
            globfree(&g);
            return 1;
        }
        globfree(&g);
    }
    return 0;
}

/* Reads staged shard i back through the loader's checks before it may replace anything. */
static int verify_staged(const split_out *o, int64_t i) {
    char p[4096];
    staged_path(o, i, p, sizeof p);
    ds4_shard sh;
    if (ds4_shard_open(p, ds4_tokenizer_vocab_size(o->tok), &sh)) return cli_fail();
    ds4_shard_close(&sh);
    return 0;
}

/* An old shard that no new shard of its kind replaces by name: removed after the renames. */
static void remove_unreplaced(const split_out *o) {
    glob_t g;
    if (glob_shards(o->dir, o->prefix, &g)) {
        for (size_t k = 0; k < g.gl_pathc; k++) {
            const char *digits = g.gl_pathv[k] + strlen(o->dir) + 1 + strlen(o->prefix) + 1;
            long long i = strtoll(digits, NULL, 10);
            char mine[4096];
            final_path(o, i, mine, sizeof mine);
            if (i < 0 || i >= o->n_shards || strcmp(mine, g.gl_pathv[k]) != 0) unlink(g.gl_pathv[k]);
        }
    }
    globfree(&g);
}

/* Every staged shard checked, then renamed over its final name (train, then val); old shards left
 * unreplaced are removed last and the directory is synced. On an error the caller discards what is
 * still staged. */
static int commit_shards(split_out *const outs[2]) {
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < outs[k]->n_shards; i++)
            if (verify_staged(outs[k], i)) return 1;
    for (int k = 0; k < 2; k++)
        for (int64_t i = 0; i < outs[k]->n_shards; i++) {
            char from[4096], to[4096];
            staged_path(outs[k], i, from, sizeof from);
            final_path(outs[k], i, to, sizeof to);
            if (rename(from, to) != 0) return errorf("%s: cannot rename %s into place: %s", to, from, strerror(errno));
        }
    for (int k = 0; k < 2; k++) remove_unreplaced(outs[k]);
    int fd = open(outs[0]->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
        fsync(fd); /* the renames are durable; a filesystem that refuses it has still renamed */
        close(fd);
    }
    return 0;
}

static int run(const char *const *inputs, int n_inputs, const char *out_dir, const char *tok_spec, int64_t shard_tokens,
               double val_fraction, bool special, bool overwrite, const char *key) {
    file_list files = {0};
    int rc = 0;
    for (int i = 0; i < n_inputs && !rc; i++) rc = expand_input(inputs[i], &files);
    int64_t total = 0;
    for (int64_t i = 0; i < files.n && !rc; i++) {
        const char *p = files.path[i];
        if (ends_with(p, ".gz") || ends_with(p, ".zst") || ends_with(p, ".xz") || ends_with(p, ".bz2")) {
            rc = errorf("%s: compressed input is not read directly; decompress it first (e.g. gunzip -k)", p);
        }
        total += files.bytes[i];
    }
    if (!rc && total == 0) {
        rc = errorf("--input: the %lld input file(s) are empty", (long long)files.n);
    }
    ds4_tokenizer *tok = NULL;
    if (!rc && ds4_tokenizer_open(tok_spec, &tok)) rc = cli_fail();
    if (!rc && ds4_mkdirs(out_dir, "output folder (--out)") != DS4_OK) rc = cli_fail();
    if (!rc) rc = refuse_old_shards(out_dir, overwrite);
    if (!rc && ds4_tokenizer_eos(tok) < 0)
        fprintf(stderr, "warning: %s has no EOS token: the loader will put nothing between documents\n",
                ds4_tokenizer_name(tok));
    split_out train = {out_dir, "train", tok, shard_tokens, NULL, 0, 0, 0};
    split_out val = {out_dir, "val", tok, shard_tokens, NULL, 0, 0, 0};
    batch b = {0};
    b.cap = BATCH_DOCS;
    b.d = calloc((size_t)b.cap, sizeof(doc));
    b.ids = calloc((size_t)b.cap, sizeof(ds4_tokens));
    progress pr = {.t0 = ds4_now(), .total = total, .tty = isatty(2)};
    pr.last = pr.t0;
    ctx c = {&b, tok, special, &train, &val, &pr, total - (int64_t)((double)total * val_fraction), key};
    int64_t start = 0;
    for (int64_t i = 0; i < files.n && !rc; i++) {
        rc = is_jsonl(files.path[i]) ? read_jsonl(&c, files.path[i], start) : read_text(&c, files.path[i], start);
        start += files.bytes[i];
    }
    if (!rc) rc = flush_batch(&b, tok, special, &train, &val, &pr);
    if (!rc) rc = out_close(&train);
    if (!rc) rc = out_close(&val);
    if (!rc && train.tokens + val.tokens == 0) {
        rc = errorf("--input: %lld file(s), %lld bytes, but no text to tokenize", (long long)files.n, (long long)total);
    }
    split_out *const outs[2] = {&train, &val};
    if (!rc) rc = commit_shards(outs);
    if (rc) { /* the shards already in --out stay as they were */
        discard_staged(&train);
        discard_staged(&val);
    }
    if (!rc) {
        progress_show(&pr, true);
        double dt = ds4_now() - pr.t0;
        printf("tokenizer %s: vocab %lld, bos %d, eos %d\n", ds4_tokenizer_name(tok), (long long)ds4_tokenizer_vocab_size(tok),
               ds4_tokenizer_bos(tok), ds4_tokenizer_eos(tok));
        printf("train: %lld tokens, %lld documents, %lld shard(s) %s/train_*.bin\n", (long long)train.tokens,
               (long long)train.docs, (long long)train.n_shards, out_dir);
        printf("val:   %lld tokens, %lld documents, %lld shard(s)%s%s%s\n", (long long)val.tokens, (long long)val.docs,
               (long long)val.n_shards, val.n_shards ? " " : "", val.n_shards ? out_dir : "", val.n_shards ? "/val_*.bin" : "");
        printf("%lld bytes from %lld file(s) in %.2f s (%.2f MB/s, %.2f bytes/token)\n", (long long)total, (long long)files.n,
               dt, (double)total / 1e6 / (dt > 1e-9 ? dt : 1e-9),
               (double)total / (double)(train.tokens + val.tokens));
        if (val_fraction > 0 && val.tokens == 0)
            fprintf(stderr, "warning: no validation data: the input is too small for --val-fraction %g\n", val_fraction);
    }
    for (int64_t i = 0; i < b.n; i++) free(b.d[i].text);
    for (int64_t i = 0; i < b.cap; i++) ds4_tokens_free(&b.ids[i]);
    free(b.d);
    free(b.ids);
    ds4_tokenizer_free(tok);
    for (int64_t i = 0; i < files.n; i++) free(files.path[i]);
    free(files.path);
    free(files.bytes);
    return rc;
}

int cmd_tokenize(int argc, char **argv) {
    cli_flag f[] = {
        {"input", false, NULL, "FILE|DIR|GLOB: text files, or .jsonl with {\"text\": ...} per line (repeatable)"},
        {"out", false, NULL, "DIR for train_000000.bin ... and val_000000.bin ..."},
        {"tokenizer", false, "byte", "byte (default) or PATH to tokenizer.json or its directory"},
        {"shard-tokens", false, "100000000", "tokens per shard before starting the next (default 1e8)"},
        {"val-fraction", false, "0.01", "last fraction of the input bytes held out as validation (default 0.01)"},
        {"text-key", false, "text", "the JSON field holding the text in .jsonl (default text)"},
        {"threads", false, NULL, "OpenMP threads for encoding (default: all)"},
        {"parse-special", true, NULL, "turn special-token text such as <|end_of_text|> into its id"},
        {"overwrite", true, NULL, "replace train_*/val_* shards already in --out (once the new ones are complete)"},
        {"help", true, NULL, "this text"},
    };
    const char *synopsis = "--input FILE|DIR|GLOB --out DIR [--tokenizer byte|PATH] [--shard-tokens N] [--val-fraction F]";
    if (cli_want_help(argc, argv)) {
        cli_usage("tokenize", synopsis, f, NFLAGS(f));
        return 0;
    }
    /* --input may repeat: take them out before the common parser sees the rest */
    const char *inputs[256];
    int n_inputs = 0, w = 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--input") == 0 && i + 1 < argc && n_inputs < 256) inputs[n_inputs++] = argv[++i];
        else argv[w++] = argv[i];
    }
    argc = w;
    const char *pos[1];
    int npos;
    if (!cli_parse("tokenize", argc, argv, f, NFLAGS(f), pos, 0, &npos)) return 2;
    const char *out = cli_get(f, NFLAGS(f), "out");
    if (n_inputs == 0 || !out) {
        fprintf(stderr, "error: ds4 tokenize: --input and --out are required\n");
        cli_usage("tokenize", synopsis, f, NFLAGS(f));
        return 2;
    }
    int64_t shard_tokens;
    if (!cli_int("tokenize", "shard-tokens", cli_get(f, NFLAGS(f), "shard-tokens"), &shard_tokens)) return 2;
    if (shard_tokens < 1) return errorf("ds4 tokenize: --shard-tokens must be at least 1") + 1;
    if (!cli_threads("tokenize", cli_get(f, NFLAGS(f), "threads"))) return 2;
    char *end;
    const char *vf = cli_get(f, NFLAGS(f), "val-fraction");
    double val_fraction = strtod(vf, &end);
    if (end == vf || *end || !(val_fraction >= 0 && val_fraction < 1))
        return errorf("ds4 tokenize: --val-fraction expects a number in [0, 1), got '%s'", vf) + 1;
    return run(inputs, n_inputs, out, cli_get(f, NFLAGS(f), "tokenizer"), shard_tokens, val_fraction,
               cli_get(f, NFLAGS(f), "parse-special") != NULL, cli_get(f, NFLAGS(f), "overwrite") != NULL,
               cli_get(f, NFLAGS(f), "text-key"));
}
