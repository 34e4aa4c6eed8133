/* File helpers the tests share (checkpoint bytes, waiting for a child process to write a file). */
#ifndef DS4_TEST_FILES_H
#define DS4_TEST_FILES_H

#include "ds4/io.h"

#include <dirent.h>
#include <signal.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <sys/wait.h>
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

/* Waits up to `seconds` for `path` to exist with something in it (a child has logged or saved). */
static inline bool t_wait_for_file(const char *path, int seconds) {
    for (int i = 0; i < seconds * 20; i++) {
        struct stat sb;
        if (stat(path, &sb) == 0 && sb.st_size > 0) return true;
        usleep(50 * 1000);
    }
    return false;
}

/* Once child `pid` has written `path` (up to 120 s), waits delay_ms, sends it `sig` and reaps it:
 * its wait status, or -1 when the file never came (the child is killed then). */
static inline int t_signal_after_file(pid_t pid, const char *path, int delay_ms, int sig) {
    bool came = t_wait_for_file(path, 120);
    if (came) usleep((useconds_t)delay_ms * 1000);
    kill(pid, came ? sig : SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    return came ? status : -1;
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
