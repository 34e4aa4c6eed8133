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
/* ds4 init --dry-run / ds4 inspect --config: validates CONFIG.json and prints its census. */
int cmd_config_census(const char *path);
#endif
