/* Byte sizes from input: "64GiB", "64GB", "1.5TiB", "68719476736" -> bytes, in checked int64 arithmetic
 * (no floating point, so "1.5TiB" is exactly 1649267441664 bytes). */
#include "ds4/core.h"

#include <ctype.h>
#include <string.h>
#include <strings.h>

/* The units and their bytes; matched case-insensitively against the whole rest of the text. */
typedef struct {
    const char *name;
    int64_t bytes;
} size_unit;

static const size_unit k_units[] = {
    {"b", 1},
    {"kb", 1000},              {"mb", 1000000},           {"gb", 1000000000},
    {"tb", 1000000000000},     {"pb", 1000000000000000},
    {"kib", (int64_t)1 << 10}, {"mib", (int64_t)1 << 20}, {"gib", (int64_t)1 << 30},
    {"tib", (int64_t)1 << 40}, {"pib", (int64_t)1 << 50},
};

/* Digits after the point, at most (a 13th would be worth about a byte of a PiB). */
#define MAX_FRAC_DIGITS 12

static ds4_status bad_size(const char *what, const char *s, const char *why) {
    return ds4_fail(DS4_ERR_ARG, "%s: '%s' is not a byte size (%s; e.g. 64GiB, 64GB, 1.5TiB or 68719476736)", what, s,
                    why);
}

/* floor(a · b / c) for 0 <= a < c <= 10^12 and 0 <= b < 2^62, exactly: b's bits from the top, doubling the
 * quotient q and remainder r (r < c) and adding a where a bit is set, so nothing exceeds 3c or b. */
static int64_t mul_div_floor(int64_t a, int64_t b, int64_t c) {
    int64_t q = 0, r = 0;
    for (int bit = 62; bit >= 0; bit--) {
        q *= 2, r *= 2;
        if (b >> bit & 1) r += a;
        q += r / c, r %= c;
    }
    return q;
}

ds4_status ds4_parse_bytes(const char *what, const char *s, int64_t *out) {
    if (*s == '-' || *s == '+') return bad_size(what, s, "a size has no sign");
    /* the number: whole digits [. fraction digits], the fraction as frac / scale */
    const char *p = s;
    int64_t whole = 0, frac = 0, scale = 1;
    int ndig = 0;
    for (; isdigit((unsigned char)*p); p++, ndig++)
        if (!ds4_mul_i64(whole, 10, &whole) || !ds4_add_i64(whole, *p - '0', &whole))
            return bad_size(what, s, "too large");
    if (*p == '.')
        for (p++; isdigit((unsigned char)*p); p++, ndig++) {
            if (scale == 1000000000000) return bad_size(what, s, "more than 12 digits after the point");
            frac = frac * 10 + (*p - '0'), scale *= 10;
        }
    if (ndig == 0) return bad_size(what, s, "no number");
    while (*p == ' ' || *p == '\t') p++;
    /* the unit: none means bytes */
    int64_t unit = *p == '\0' ? 1 : 0;
    for (size_t i = 0; !unit && i < sizeof k_units / sizeof k_units[0]; i++)
        if (!strcasecmp(p, k_units[i].name)) unit = k_units[i].bytes;
    if (!unit) {
        const bool bare = strlen(p) == 1 && strchr("kmgtpKMGTP", *p);
        return bad_size(what, s, bare ? "say KiB or KB, MiB or MB, GiB or GB, TiB or TB, PiB or PB"
                                      : "unknown unit; units are B, KB, MB, GB, TB, PB (powers of 1000) and KiB, "
                                        "MiB, GiB, TiB, PiB (powers of 1024)");
    }
    /* whole · unit + floor(frac · unit / scale) */
    int64_t bytes;
    if (!ds4_mul_i64(whole, unit, &bytes) || !ds4_add_i64(bytes, mul_div_floor(frac, unit, scale), &bytes))
        return bad_size(what, s, "too large");
    *out = bytes;
    return DS4_OK;
}
