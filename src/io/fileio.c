/* Whole-file IO: read a file into memory, and write files atomically (temp file in the same
 * directory, fsync, rename, fsync the directory), so a crash never leaves a half-written file. */
#include "ds4/io.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *p = ds4_alloc(DS4_MEM_OTHER, n);
    if (p) memcpy(p, s, n);
    return p;
}

static const char *file_kind(mode_t m) {
    return S_ISFIFO(m) ? "a FIFO" : S_ISSOCK(m) ? "a socket" : S_ISCHR(m) ? "a character device" : S_ISBLK(m) ? "a block device"
           : S_ISDIR(m) ? "a directory" : "not a plain file";
}

ds4_status ds4_open_input(const char *path, const char *what, int *fd_out, uint64_t *size) {
    *fd_out = -1;
    *size = 0;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer forever */
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    if (fd < 0) return ds4_fail(DS4_ERR_IO, "%s: cannot open%s%s: %s", path, what ? " " : "", what ? what : "", strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0) {
        ds4_status s = ds4_fail(DS4_ERR_IO, "%s: cannot stat: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return ds4_fail(DS4_ERR_IO, "%s: not a regular file (%s)", path, file_kind(st.st_mode));
    }
    /* a regular file: reads go back to blocking, as everywhere else */
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        ds4_status s = ds4_fail(DS4_ERR_IO, "%s: cannot clear O_NONBLOCK: %s", path, strerror(errno));
        close(fd);
        return s;
    }
    *fd_out = fd;
    *size = (uint64_t)st.st_size;
    return DS4_OK;
}

ds4_status ds4_check_input(const char *path, const char *what) {
    int fd;
    uint64_t size;
    DS4_TRY(ds4_open_input(path, what, &fd, &size));
    close(fd);
    return DS4_OK;
}

ds4_status ds4_read_file(const char *path, char **data, size_t *len) {
    *data = NULL;
    *len = 0;
    int fd;
    uint64_t size;
    DS4_TRY(ds4_open_input(path, NULL, &fd, &size));
    if (size >= SIZE_MAX) {
        close(fd);
        return ds4_fail(DS4_ERR_IO, "%s: file of %llu bytes is too large to read", path, (unsigned long long)size);
    }
    size_t n = (size_t)size;
    char *buf = ds4_alloc(DS4_MEM_OTHER, n + 1);
    if (!buf) {
        close(fd);
        return ds4_fail(DS4_ERR_OOM, "%s: cannot allocate %zu bytes to read it", path, n + 1);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
            ds4_status s = ds4_fail(DS4_ERR_IO, "%s: read failed after %zu of %zu bytes: %s", path, got, n,
                                    r < 0 ? strerror(errno) : "unexpected end of file");
            ds4_free(buf);
            close(fd);
            return s;
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = '\0';
    *data = buf;
    *len = n;
    return DS4_OK;
}

/* fsync the directory holding `path`, so the rename itself is durable. */
static ds4_status fsync_parent_dir(const char *path) {
    const char *slash = strrchr(path, '/');
    char dir[4096];
    if (!slash) snprintf(dir, sizeof dir, ".");
    else if (slash == path) snprintf(dir, sizeof dir, "/");
    else {
        size_t n = (size_t)(slash - path);
        if (n >= sizeof dir) return ds4_fail(DS4_ERR_ARG, "%s: path too long", path);
        memcpy(dir, path, n);
        dir[n] = '\0';
    }
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) return ds4_fail(DS4_ERR_IO, "%s: cannot open directory %s to fsync: %s", path, dir, strerror(errno));
    int rc = fsync(fd);
    int e = errno;
    close(fd);
    /* Some filesystems refuse fsync on directories; the rename has still happened. */
    if (rc != 0 && e != EINVAL && e != EROFS)
        return ds4_fail(DS4_ERR_IO, "%s: fsync of directory %s failed: %s", path, dir, strerror(e));
    return DS4_OK;
}

ds4_status ds4_atomic_open(const char *path, ds4_atomic_file *af) {
    static atomic_uint_fast64_t counter;
    af->fd = -1;
    af->path = af->tmp = NULL;
    if (!path || !*path) return ds4_fail(DS4_ERR_ARG, "atomic write: empty path");
    size_t n = strlen(path) + 64;
    af->path = dup_str(path);
    af->tmp = ds4_alloc(DS4_MEM_OTHER, n);
    if (!af->path || !af->tmp) {
        ds4_atomic_abort(af);
        return ds4_fail(DS4_ERR_OOM, "%s: out of memory", path);
    }
    /* pid + counter keep concurrent writers (threads, processes) apart. */
    snprintf(af->tmp, n, "%s.tmp.%ld.%llu", path, (long)getpid(),
             (unsigned long long)atomic_fetch_add(&counter, 1));
    af->fd = open(af->tmp, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (af->fd < 0) {
        ds4_status s = ds4_fail(DS4_ERR_IO, "%s: cannot create temp file %s: %s", path, af->tmp, strerror(errno));
        ds4_free(af->path);
        ds4_free(af->tmp);
        af->path = af->tmp = NULL;
        return s;
    }
    return DS4_OK;
}

ds4_status ds4_atomic_write(ds4_atomic_file *af, const void *data, size_t len) {
    const char *p = data;
    while (len > 0) {
        size_t chunk = len < ((size_t)1 << 30) ? len : ((size_t)1 << 30);
        ssize_t w = write(af->fd, p, chunk);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            ds4_status s = ds4_fail(DS4_ERR_IO, "%s: write failed: %s", af->path, w < 0 ? strerror(errno) : "no progress");
            ds4_atomic_abort(af);
            return s;
        }
        p += w;
        len -= (size_t)w;
    }
    return DS4_OK;
}

ds4_status ds4_atomic_commit(ds4_atomic_file *af) {
    ds4_status s = DS4_OK;
    if (fsync(af->fd) != 0) s = ds4_fail(DS4_ERR_IO, "%s: fsync failed: %s", af->path, strerror(errno));
    if (close(af->fd) != 0 && s == DS4_OK) s = ds4_fail(DS4_ERR_IO, "%s: close failed: %s", af->path, strerror(errno));
    af->fd = -1;
    if (s == DS4_OK && rename(af->tmp, af->path) != 0)
        s = ds4_fail(DS4_ERR_IO, "%s: rename from %s failed: %s", af->path, af->tmp, strerror(errno));
    if (s != DS4_OK) {
        ds4_atomic_abort(af);
        return s;
    }
    s = fsync_parent_dir(af->path);
    ds4_free(af->path);
    ds4_free(af->tmp);
    af->path = af->tmp = NULL;
    return s;
}

void ds4_atomic_abort(ds4_atomic_file *af) {
    if (af->fd >= 0) close(af->fd);
    af->fd = -1;
    if (af->tmp) unlink(af->tmp);
    ds4_free(af->path);
    ds4_free(af->tmp);
    af->path = af->tmp = NULL;
}

ds4_status ds4_write_file_atomic(const char *path, const void *data, size_t len) {
    ds4_atomic_file af;
    DS4_TRY(ds4_atomic_open(path, &af));
    DS4_TRY(ds4_atomic_write(&af, data, len));
    return ds4_atomic_commit(&af);
}

/* mkdir -p: every missing folder on the way, one at a time, so the message names the one that failed. */
ds4_status ds4_mkdirs(const char *dir, const char *what) {
    char p[4096];
    if (!what) what = "folder";
    if (!dir || !dir[0]) return ds4_fail(DS4_ERR_ARG, "cannot create the %s: empty path", what);
    if (snprintf(p, sizeof p, "%s", dir) >= (int)sizeof p) return ds4_fail(DS4_ERR_ARG, "%.80s...: path too long", dir);
    for (char *c = p + 1;; c++) {
        if (*c != '/' && *c != 0) continue;
        char keep = *c;
        *c = 0;
        struct stat sb;
        if (mkdir(p, 0755) != 0 && (errno != EEXIST || stat(p, &sb) != 0 || !S_ISDIR(sb.st_mode))) {
            const char *why = errno == EEXIST ? "a file of that name is in the way" : strerror(errno);
            if (!strcmp(p, dir)) return ds4_fail(DS4_ERR_IO, "%s: cannot create the %s: %s", dir, what, why);
            return ds4_fail(DS4_ERR_IO, "%s: cannot create the %s: cannot create %s: %s", dir, what, p, why);
        }
        *c = keep;
        if (!keep) return DS4_OK;
    }
}

ds4_status ds4_mkdirs_parent(const char *path, const char *what) {
    const char *slash = path ? strrchr(path, '/') : NULL;
    if (!slash || slash == path) return DS4_OK; /* the working directory or / */
    char dir[4096];
    if (snprintf(dir, sizeof dir, "%.*s", (int)(slash - path), path) >= (int)sizeof dir)
        return ds4_fail(DS4_ERR_ARG, "%.80s...: path too long", path);
    return ds4_mkdirs(dir, what);
}

ds4_status ds4_write_json_atomic(const char *path, const struct cJSON *root) {
    char *text = root ? cJSON_Print(root) : NULL;
    if (!text) return ds4_fail(DS4_ERR_OOM, "%s: out of memory printing the JSON", path);
    ds4_status s = ds4_write_file_atomic(path, text, strlen(text));
    cJSON_free(text);
    return s;
}
