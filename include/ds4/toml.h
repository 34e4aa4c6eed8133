/* ds4 TOML: the training config format (TorchTitan's convention: a TOML file plus
 * `--section.key value` overrides on the command line).
 *
 * Supported: tables `[a]`, `[a.b]`; bare, quoted and dotted keys; basic, literal and multi-line
 * strings with escapes; integers and floats exactly as TOML 1.0 writes them (sign, `_` between digits, 0x/0o/0b,
 * fraction, exponent e/E, inf, nan: 2.2e-4 is a float, 1979-05-27 a date);
 * booleans; arrays (nested, multi-line, trailing comma); inline tables; comments.
 * Not supported (clear error): arrays of tables `[[a]]`, dates and times.
 * Duplicate keys and redefined tables are errors. Every error names file:line:col and what was
 * expected. */
#ifndef DS4_TOML_H
#define DS4_TOML_H

#include "ds4/core.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DS4_TOML_TABLE = 0,
    DS4_TOML_ARRAY,
    DS4_TOML_STRING,
    DS4_TOML_INT,
    DS4_TOML_FLOAT,
    DS4_TOML_BOOL,
} ds4_toml_type;

/* One node of the tree. Tables keep their entries in file order. Read-only for users. */
typedef struct ds4_toml ds4_toml;
struct ds4_toml {
    ds4_toml_type type;
    char *key;          /* name inside the parent table; NULL for array items and the root */
    int line, col;      /* where it was defined, 1-based; line 0: set by an override */
    union {
        char *s;        /* strings: NUL-terminated (a "\u0000" escape is rejected) */
        int64_t i;
        double f;
        bool b;
    } v;
    ds4_toml **kids;    /* table entries or array items */
    int64_t n_kids, cap_kids;
    int how;            /* tables: how the table came to be (duplicate rules); internal */
    char *src;          /* root only: the name used in messages (file path or "<string>") */
};

/* Parses `len` bytes (no NUL terminator needed). `name` is used in messages. */
ds4_status ds4_toml_parse(const char *text, size_t len, const char *name, ds4_toml **out);
ds4_status ds4_toml_load(const char *path, ds4_toml **out);
void ds4_toml_free(ds4_toml *root);

const char *ds4_toml_type_name(ds4_toml_type t); /* "table", "integer", ... */

/* Node at a dotted path ("training.seq_len") under `table`, or NULL when absent. */
const ds4_toml *ds4_toml_find(const ds4_toml *table, const char *dotted);

/* Typed getters. The required form fails with DS4_ERR_MISSING when the key is absent; the _or
 * form returns `def` then. Both fail with DS4_ERR_CONFIG on a wrong type:
 *   "train.toml:3:1: key training.seq_len: expected integer, got string". Floats accept integers. */
ds4_status ds4_toml_get_int(const ds4_toml *root, const char *key, int64_t *out);
ds4_status ds4_toml_get_float(const ds4_toml *root, const char *key, double *out);
ds4_status ds4_toml_get_bool(const ds4_toml *root, const char *key, bool *out);
ds4_status ds4_toml_get_string(const ds4_toml *root, const char *key, const char **out);
ds4_status ds4_toml_int_or(const ds4_toml *root, const char *key, int64_t def, int64_t *out);
ds4_status ds4_toml_float_or(const ds4_toml *root, const char *key, double def, double *out);
ds4_status ds4_toml_bool_or(const ds4_toml *root, const char *key, bool def, bool *out);
ds4_status ds4_toml_string_or(const ds4_toml *root, const char *key, const char *def, const char **out);

/* Sets `dotted` to `value`, parsed as a TOML value ("3", "1e-4", "true", "[1, 2]", "'x'") or, when
 * that fails, taken as a plain string. Creates missing tables; replaces an existing value. */
ds4_status ds4_toml_set(ds4_toml *root, const char *dotted, const char *value);

/* Applies and removes every `--a.b VALUE` / `--a.b=VALUE` argument (a flag whose name holds a dot)
 * from argv[1..*argc-1], compacting argv. A dotted flag followed by nothing or by another `--flag`
 * is set to true. Other arguments stay in place, in order. */
ds4_status ds4_toml_apply_overrides(ds4_toml *root, int *argc, char **argv);

/* Every key in the tree must be in `known` (dotted paths). An entry "section.*" accepts anything
 * under it. The first unknown key is an error naming where it is and the closest known key. */
ds4_status ds4_toml_check_keys(const ds4_toml *root, const char *const *known, int64_t n_known);

/* Levenshtein distance (bytes); used for "did you mean" suggestions. */
int64_t ds4_edit_distance(const char *a, const char *b);
/* Index of the entry of `names` closest to `s` (ties: the first), -1 when n == 0. */
int64_t ds4_closest_name(const char *s, const char *const *names, int64_t n);

#ifdef __cplusplus
}
#endif
#endif
