/* TensorBoard event files (src/io/tfevents.c): CRC32C against the iSCSI test vectors (RFC 3720 B.4),
 * the TFRecord mask, and the exact bytes of the first record (the file_version Event) and of a scalar
 * Event, encoded here by hand from event.proto. tests/test_tfevents.py decodes a training run's file. */
#include "ds4/io.h"
#include "test.h"
#include "test_files.h"

#include <ftw.h>
#include <unistd.h>

static int rm_cb(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}

static void test_crc32c_known_answers(void) {
    uint8_t zeros[32] = {0}, ones[32], up[32], down[32];
    for (int i = 0; i < 32; i++) ones[i] = 0xff, up[i] = (uint8_t)i, down[i] = (uint8_t)(31 - i);
    CHECK(ds4_crc32c("", 0) == 0);
    CHECK(ds4_crc32c("123456789", 9) == 0xE3069283u, "%08x", ds4_crc32c("123456789", 9));
    CHECK(ds4_crc32c(zeros, 32) == 0x8A9136AAu, "%08x", ds4_crc32c(zeros, 32));
    CHECK(ds4_crc32c(ones, 32) == 0x62A8AB43u, "%08x", ds4_crc32c(ones, 32));
    CHECK(ds4_crc32c(up, 32) == 0x46DD794Eu, "%08x", ds4_crc32c(up, 32));
    CHECK(ds4_crc32c(down, 32) == 0x113FDB5Cu, "%08x", ds4_crc32c(down, 32));
    /* masked: rotate right by 15, add 0xa282ead8 (TFRecord): 0xE3069283 -> 0x2507c60d + 0xa282ead8 */
    CHECK(ds4_crc32c_masked("123456789", 9) == 0xC78AB0E5u, "%08x", ds4_crc32c_masked("123456789", 9));
}

static uint32_t le32(const uint8_t *p) { return p[0] | p[1] << 8 | p[2] << 16 | (uint32_t)p[3] << 24; }

/* One record at *off of buf: checks the framing and both CRCs; returns the data and its length. */
static const uint8_t *record(const uint8_t *buf, size_t n, size_t *off, size_t *len) {
    if (*off + 12 > n) return NULL;
    const uint8_t *p = buf + *off;
    uint64_t l = 0;
    for (int i = 7; i >= 0; i--) l = l << 8 | p[i];
    if (le32(p + 8) != ds4_crc32c_masked(p, 8) || *off + 16 + l > n) return NULL;
    if (le32(p + 12 + l) != ds4_crc32c_masked(p + 12, l)) return NULL;
    *off += 16 + l;
    *len = l;
    return p + 12;
}

static void test_writer_bytes(void) {
    char dir[] = "/tmp/ds4_test_tfevents_XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    char sub[128];
    snprintf(sub, sizeof sub, "%s/run/tb", dir); /* created with its parent */
    ds4_tfevents *w = NULL;
    CHECK(ds4_tfevents_open(sub, 1.5, &w) == DS4_OK, "%s", ds4_errmsg());
    if (!w) return;
    CHECK(strstr(ds4_tfevents_path(w), "/run/tb/events.out.tfevents.0000000001.") != NULL, "%s", ds4_tfevents_path(w));
    const char *tags[] = {"loss"};
    const double v[] = {2.5};
    CHECK(ds4_tfevents_scalars(w, 300, 2.0, 1, tags, v) == DS4_OK);
    char path[4300];
    snprintf(path, sizeof path, "%s", ds4_tfevents_path(w));
    CHECK(ds4_tfevents_close(w) == DS4_OK);
    char *buf = NULL;
    size_t n = 0, off = 0, len = 0;
    CHECK(ds4_read_file(path, &buf, &n) == DS4_OK, "%s", ds4_errmsg());
    if (!buf) return;
    /* Event { wall_time (1, fixed64) = 1.5; file_version (3) = "brain.Event:2" } */
    static const uint8_t first[] = {0x09, 0, 0, 0, 0, 0, 0, 0xf8, 0x3f, 0x1a, 13, 'b', 'r', 'a', 'i', 'n', '.',
                                    'E',  'v', 'e', 'n', 't', ':', '2'};
    const uint8_t *d = record((const uint8_t *)buf, n, &off, &len);
    CHECK(d && len == sizeof first && !memcmp(d, first, len), "first record");
    /* Event { wall_time = 2.0; step (2, varint) = 300 = ac 02; summary (5) { value (1) { tag (1) = "loss";
     * simple_value (2, fixed32) = 2.5f = 0x40200000 } } } */
    static const uint8_t second[] = {0x09, 0, 0, 0, 0, 0, 0, 0, 0x40, 0x10, 0xac, 0x02, 0x2a, 13, 0x0a, 11,
                                     0x0a, 4, 'l', 'o', 's', 's', 0x15, 0, 0, 0x20, 0x40};
    d = record((const uint8_t *)buf, n, &off, &len);
    CHECK(d && len == sizeof second && !memcmp(d, second, len), "scalar record");
    CHECK(off == n, "%zu of %zu bytes read", off, n);
    ds4_free(buf);
    nftw(dir, rm_cb, 16, FTW_DEPTH | FTW_PHYS);
}

static void test_open_errors(void) {
    ds4_tfevents *w = (ds4_tfevents *)1;
    CHECK(ds4_tfevents_open("/proc/ds4-no/tb", 0, &w) != DS4_OK && w == NULL);
    CHECK(strstr(ds4_errmsg(), "/proc/ds4-no") != NULL, "%s", ds4_errmsg());
}

int main(void) {
    RUN(test_crc32c_known_answers);
    RUN(test_writer_bytes);
    RUN(test_open_errors);
    TEST_MAIN_END("test_tfevents");
}
