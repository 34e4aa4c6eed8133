/* Thread-local error message behind every ds4_status. */
#include "ds4/core.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char g_msg[1024];

/* Messages quote names, keys and paths read from input: each is formatted into a local buffer first
 * (an argument may be ds4_errmsg() itself), then stored with its control bytes escaped (ds4_escape),
 * so printing a message never hands a terminal an escape sequence from a file. */
ds4_status ds4_fail(ds4_status code, const char *fmt, ...) {
    char raw[sizeof g_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    ds4_escape(raw, g_msg, sizeof g_msg);
    return code;
}

ds4_status ds4_fail_prefix(ds4_status code, const char *fmt, ...) {
    char raw[512], prefix[512], old[sizeof g_msg];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(raw, sizeof raw, fmt, ap);
    va_end(ap);
    ds4_escape(raw, prefix, sizeof prefix);
    memcpy(old, g_msg, sizeof old);   /* already escaped */
    size_t k = strlen(prefix);
    if (k > sizeof g_msg - 3) k = sizeof g_msg - 3;
    memcpy(g_msg, prefix, k);
    memcpy(g_msg + k, ": ", 2);
    size_t room = sizeof g_msg - k - 3;
    size_t m = strnlen(old, room);
    memcpy(g_msg + k + 2, old, m);
    g_msg[k + 2 + m] = 0;
    return code;
}

const char *ds4_errmsg(void) { return g_msg; }

const char *ds4_status_name(ds4_status s) {
    switch (s) {
    case DS4_OK: return "ok";
    case DS4_ERR_IO: return "io";
    case DS4_ERR_FORMAT: return "format";
    case DS4_ERR_CONFIG: return "config";
    case DS4_ERR_SHAPE: return "shape";
    case DS4_ERR_MISSING: return "missing";
    case DS4_ERR_ARG: return "argument";
    case DS4_ERR_OOM: return "out of memory";
    case DS4_ERR_UNSUPPORTED: return "unsupported";
    case DS4_ERR_INTERNAL: return "internal";
    }
    return "unknown";
}
