/* File helpers the tests share (checkpoint bytes, waiting for a child process to write a file). */
#ifndef DS4_TEST_FILES_H
#define DS4_TEST_FILES_H

#include "ds4/io.h"

#include <dirent.h>
#include <stdbool.h>
#include <string.h>
#include <unistd.h>

/* True when both files can be read and hold the same bytes. */
static inline bool t_files_equal(const char *a, const char *b) {
    char *x = NULL, *y = NULL;
    size_t nx = 0, ny = 0;
    bool eq = ds4_read_file(a, &x, &nx) == DS4_OK && ds4_read_file(b, &y, &ny) == DS4_OK && nx == ny &&
              memcmp(x, y, nx) == 0;
    ds4_free(x);
    ds4_free(y);
    return eq;
}

/* Waits up to `seconds` for `path` to exist (a child is past its start-up). */
static inline bool t_wait_for_file(const char *path, int seconds) {
    for (int i = 0; i < seconds * 20; i++) {
        if (access(path, F_OK) == 0) return true;
        usleep(50 * 1000);
    }
    return false;
}

/* Files in `dir` whose name holds ".tmp." (temporaries an atomic write left behind). */
static inline int t_count_tmp_files(const char *dir) {
    DIR *d = opendir(dir);
    int n = 0;
    for (struct dirent *de; d && (de = readdir(d));) n += strstr(de->d_name, ".tmp.") != NULL;
    if (d) closedir(d);
    return n;
}

#endif
