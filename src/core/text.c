/* Text from input: UTF-8 validation, and escaping of the bytes a terminal would act on, so a name or
 * key read from a hostile file can never move the cursor, recolour or retitle the user's terminal
 * when ds4 prints it in an error message or a listing. */
#include "ds4/core.h"

#include <stdio.h>
#include <string.h>

/* Length (1..4) of the valid UTF-8 sequence at s[0, n), its code point in *cp; 0 when invalid
 * (stray continuation byte, overlong form, surrogate, above U+10FFFF, cut short). */
static size_t utf8_seq(const unsigned char *s, size_t n, uint32_t *cp) {
    unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len = c >= 0xc2 && c <= 0xdf ? 2 : c >= 0xe0 && c <= 0xef ? 3 : c >= 0xf0 && c <= 0xf4 ? 4 : 0;
    if (len == 0 || len > n) return 0;
    uint32_t v = c & (0x7f >> len);
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xc0) != 0x80) return 0;
        v = v << 6 | (s[i] & 0x3f);
    }
    static const uint32_t min_of_len[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (v < min_of_len[len] || v > 0x10ffff || (v >= 0xd800 && v <= 0xdfff)) return 0;
    *cp = v;
    return len;
}

bool ds4_utf8_valid(const char *s, size_t n) {
    const unsigned char *p = (const unsigned char *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = utf8_seq(p + i, n - i, &cp);
        if (k == 0) return false;
        i += k;
    }
    return true;
}

/* C0 controls, DEL and the C1 controls U+0080..U+009F (CSI among them). */
static bool is_control(uint32_t cp) { return cp < 0x20 || (cp >= 0x7f && cp <= 0x9f); }

const char *ds4_escape(const char *src, char *dst, size_t cap) {
    if (cap == 0) return dst;
    const unsigned char *p = (const unsigned char *)src;
    size_t n = strlen(src), o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp = 0;
        size_t k = utf8_seq(p + i, n - i, &cp);
        bool raw = k > 0 && !is_control(cp);
        /* a control character or an invalid byte: every byte of it as \xNN */
        size_t need = raw ? k : 4 * (k ? k : 1);
        if (o + need >= cap) break;
        if (raw) memcpy(dst + o, p + i, k);
        else
            for (size_t j = 0; j < (k ? k : 1); j++) snprintf(dst + o + 4 * j, 5, "\\x%02x", p[i + j]);
        o += need;
        i += k ? k : 1;
    }
    dst[o] = '\0';
    return dst;
}
