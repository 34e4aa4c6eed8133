/* TensorBoard event files, written by hand: what TensorBoard's own reader opens.
 *
 * File: events.out.tfevents.<unix time, 10 digits>.<host name>, a sequence of TFRecord records:
 *   uint64 length (little-endian) | uint32 masked CRC32C of those 8 bytes | data | uint32 masked CRC32C
 *   of data, where masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8 and CRC32C is the Castagnoli CRC.
 * Data: a protobuf `Event` (tensorflow/core/util/event.proto):
 *   1 wall_time double (fixed64) | 2 step int64 (varint) | 3 file_version string | 5 summary Summary |
 *   7 session_log SessionLog { 1 status enum: START = 1 }   (6 is the deprecated log_message: TensorBoard
 *   reads a SessionLog there as a log line and purges nothing)
 *   Summary { repeated Value value = 1 }   Value { 1 tag string | 2 simple_value float (fixed32) }
 * The first record is the Event with file_version "brain.Event:2"; each later one carries scalars. */
#include "ds4/io.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------------ CRC32C (Castagnoli) */
/* Bitwise, reflected polynomial 0x82F63B78 (events are a few hundred bytes: no table needed). */
uint32_t ds4_crc32c(const void *data, size_t n) {
    const uint8_t *p = data;
    uint32_t c = 0xFFFFFFFFu;
    for (size_t i = 0; i < n; i++) {
        c ^= p[i];
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    }
    return c ^ 0xFFFFFFFFu;
}

uint32_t ds4_crc32c_masked(const void *data, size_t n) {
    uint32_t c = ds4_crc32c(data, n);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

/* ------------------------------------------------------------------ protobuf encoding */
/* An encoded message being built: at most DS4_TB_MAX_EVENT bytes (ds4's events are far smaller). */
#define DS4_TB_MAX_EVENT 4096
typedef struct {
    uint8_t b[DS4_TB_MAX_EVENT];
    size_t n;
    bool full;
} pb_buf;

static void pb_bytes(pb_buf *m, const void *p, size_t n) {
    if (m->full || n > sizeof m->b - m->n) {
        m->full = true;
        return;
    }
    memcpy(m->b + m->n, p, n);
    m->n += n;
}

static void pb_varint(pb_buf *m, uint64_t v) {
    uint8_t t[10];
    size_t k = 0;
    do {
        t[k++] = (uint8_t)((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
        v >>= 7;
    } while (v);
    pb_bytes(m, t, k);
}

static void pb_key(pb_buf *m, unsigned field, unsigned wire) { pb_varint(m, (uint64_t)field << 3 | wire); }

static void pb_le(pb_buf *m, uint64_t v, int n) { /* n little-endian bytes of v */
    uint8_t t[8];
    for (int i = 0; i < n; i++) t[i] = (uint8_t)(v >> (8 * i));
    pb_bytes(m, t, (size_t)n);
}

static void pb_double(pb_buf *m, unsigned field, double v) {
    uint64_t u;
    memcpy(&u, &v, 8);
    pb_key(m, field, 1);
    pb_le(m, u, 8);
}

static void pb_float(pb_buf *m, unsigned field, float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    pb_key(m, field, 5);
    pb_le(m, u, 4);
}

static void pb_len(pb_buf *m, unsigned field, const void *p, size_t n) {
    pb_key(m, field, 2);
    pb_varint(m, n);
    pb_bytes(m, p, n);
}

/* Event header: wall_time, then step unless 0 (proto3 leaves defaults out). */
static void event_head(pb_buf *m, double wall_time, int64_t step) {
    pb_double(m, 1, wall_time);
    if (step) {
        pb_key(m, 2, 0);
        pb_varint(m, (uint64_t)step);
    }
}

/* ------------------------------------------------------------------ the writer */
struct ds4_tfevents {
    FILE *f;
    char path[4200];
};

static ds4_status write_record(ds4_tfevents *w, const pb_buf *m) {
    if (m->full) return ds4_fail(DS4_ERR_INTERNAL, "%s: an event is over %d bytes", w->path, DS4_TB_MAX_EVENT);
    uint8_t len[8], crc[4];
    for (int i = 0; i < 8; i++) len[i] = (uint8_t)((uint64_t)m->n >> (8 * i));
    uint32_t c1 = ds4_crc32c_masked(len, 8), c2 = ds4_crc32c_masked(m->b, m->n);
    bool ok = fwrite(len, 1, 8, w->f) == 8;
    for (int i = 0; i < 4; i++) crc[i] = (uint8_t)(c1 >> (8 * i));
    ok = ok && fwrite(crc, 1, 4, w->f) == 4 && fwrite(m->b, 1, m->n, w->f) == m->n;
    for (int i = 0; i < 4; i++) crc[i] = (uint8_t)(c2 >> (8 * i));
    ok = ok && fwrite(crc, 1, 4, w->f) == 4 && fflush(w->f) == 0;
    return ok ? DS4_OK : ds4_fail(DS4_ERR_IO, "%s: cannot write an event: %s", w->path, strerror(errno));
}

/* A new file: the name TensorBoard looks for; a second writer in the same second adds its pid. */
static ds4_status create_file(ds4_tfevents *w, const char *dir, double wall_time) {
    char host[256] = "localhost";
    if (gethostname(host, sizeof host - 1) != 0) snprintf(host, sizeof host, "localhost");
    for (char *h = host; *h; h++)
        if (*h == '/') *h = '_';
    for (int attempt = 0; attempt < 2; attempt++) {
        int n = attempt == 0 ? snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%010lld.%s", dir,
                                        (long long)wall_time, host)
                             : snprintf(w->path, sizeof w->path, "%s/events.out.tfevents.%010lld.%s.%d", dir,
                                        (long long)wall_time, host, (int)getpid());
        if (n >= (int)sizeof w->path) return ds4_fail(DS4_ERR_ARG, "%.80s...: path too long", dir);
        int fd = open(w->path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
        if (fd < 0 && errno == EEXIST) continue;
        if (fd < 0 || !(w->f = fdopen(fd, "wb"))) {
            if (fd >= 0) close(fd);
            return ds4_fail(DS4_ERR_IO, "%s: cannot create the TensorBoard event file: %s", w->path, strerror(errno));
        }
        return DS4_OK;
    }
    return ds4_fail(DS4_ERR_IO, "%s: exists already", w->path);
}

ds4_status ds4_tfevents_open(const char *dir, double wall_time, ds4_tfevents **out) {
    *out = NULL;
    DS4_TRY(ds4_mkdirs(dir, "TensorBoard folder"));
    ds4_tfevents *w = ds4_calloc(DS4_MEM_OTHER, sizeof *w);
    if (!w) return ds4_fail(DS4_ERR_OOM, "out of memory for the TensorBoard writer");
    ds4_status st = create_file(w, dir, wall_time);
    if (st == DS4_OK) {
        pb_buf m = {.n = 0};
        event_head(&m, wall_time, 0);
        static const char version[] = "brain.Event:2";
        pb_len(&m, 3, version, sizeof version - 1);
        st = write_record(w, &m);
    }
    if (st != DS4_OK) {
        ds4_tfevents_close(w);
        return st;
    }
    *out = w;
    return DS4_OK;
}

ds4_status ds4_tfevents_scalars(ds4_tfevents *w, int64_t step, double wall_time, int n, const char *const *tags,
                                const double *values) {
    pb_buf summary = {.n = 0}, value, m = {.n = 0};
    for (int i = 0; i < n; i++) {
        value.n = 0;
        value.full = false;
        pb_len(&value, 1, tags[i], strlen(tags[i]));
        pb_float(&value, 2, (float)values[i]);
        if (value.full) summary.full = true;
        pb_len(&summary, 1, value.b, value.n);
    }
    event_head(&m, wall_time, step);
    if (summary.full) m.full = true;
    pb_len(&m, 5, summary.b, summary.n);
    return write_record(w, &m);
}

ds4_status ds4_tfevents_restart(ds4_tfevents *w, int64_t step, double wall_time) {
    pb_buf log = {.n = 0}, m = {.n = 0};
    pb_key(&log, 1, 0);
    pb_varint(&log, 1); /* SessionLog.START: TensorBoard drops the earlier events of steps >= step */
    event_head(&m, wall_time, step);
    pb_len(&m, 7, log.b, log.n);
    return write_record(w, &m);
}

const char *ds4_tfevents_path(const ds4_tfevents *w) { return w->path; }

ds4_status ds4_tfevents_close(ds4_tfevents *w) {
    if (!w) return DS4_OK;
    ds4_status st = DS4_OK;
    if (w->f && fclose(w->f) != 0) st = ds4_fail(DS4_ERR_IO, "%s: cannot close: %s", w->path, strerror(errno));
    ds4_free(w);
    return st;
}
