/* Small helpers shared by the ds4 subcommands: flag parsing and error reporting. */
#ifndef DS4_TOOLS_CLI_H
#define DS4_TOOLS_CLI_H

#include "ds4/core.h"

#include <stdbool.h>
#include <stdint.h>

/* A flag the command accepts: "--name" followed by a value (or none when is_switch). */
typedef struct {
    const char *name;
    bool is_switch;
    const char *value; /* filled by cli_parse; "1" for a given switch */
    const char *help;
} cli_flag;

/* Parses argv[1..] (argv[0] is the subcommand). Unknown flags, missing values, positional
 * arguments beyond max_pos are errors printed as "error: ..."; returns false then. */
bool cli_parse(const char *cmd, int argc, char **argv, cli_flag *flags, int nflags, const char **pos, int max_pos,
               int *npos);
const char *cli_get(const cli_flag *flags, int nflags, const char *name);
bool cli_int(const char *cmd, const char *flag, const char *s, int64_t *out);
/* --threads s (NULL: not given, nothing to do): an integer in [0, DS4_MAX_THREADS] (0: every core),
 * then the thread count; false after a one-line error. */
bool cli_threads(const char *cmd, const char *s);
/* --device s (NULL: not given: the cpu): the backend ex runs on, by name (ds4_backend_find), and, for a
 * command that runs on it (run), present here (ds4_backend_ready); false after a one-line error naming the
 * flag and the backends built in, or what the backend lacks. */
bool cli_device(const char *cmd, const char *s, bool run, ds4_exec *ex);
void cli_usage(const char *cmd, const char *synopsis, const cli_flag *flags, int nflags);
/* True when --help or -h is among the arguments. */
bool cli_want_help(int argc, char **argv);
/* Prints "error: <ds4_errmsg()>" and returns 1. */
int cli_fail(void);

#endif
