/* One entry point per `ds4` subcommand; each returns the process exit code. */
#ifndef DS4_TOOLS_CMDS_H
#define DS4_TOOLS_CMDS_H
int cmd_init(int argc, char **argv);
int cmd_inspect(int argc, char **argv);
int cmd_convert(int argc, char **argv);
int cmd_export(int argc, char **argv);
int cmd_debug_state(int argc, char **argv);
int cmd_tokenize(int argc, char **argv);
int cmd_train(int argc, char **argv);
int cmd_plot(int argc, char **argv);
int cmd_generate(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_memplan(int argc, char **argv);
/* The run description of `ds4 CMD --config FILE.toml [--section.key value ...] [flags]`: the TOML, its
 * overrides and the trainer's flags, as ds4 train reads them (ds4 memplan --config plans the same run).
 * notes: print what became of TorchTitan's keys. Returns 0, or the exit code with the message set (2:
 * the command line, 1: the config). */
#include "ds4/trainer.h"
int cli_run_description(const char *cmd, int argc, char **argv, bool notes, ds4_train_cfg *cfg);
/* The same for a command that runs the description here, in one process (memplan, debug-state): a bad one
 * gets its one-line error, the run's thread count is applied. 0, or the exit code. */
int cli_run_here(const char *cmd, int argc, char **argv, ds4_train_cfg *cfg);
/* ds4 init --dry-run / ds4 inspect --config: validates CONFIG.json and prints its census. */
int cmd_config_census(const char *path);
#endif
