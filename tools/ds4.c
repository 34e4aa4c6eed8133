/* ds4 command line: one subcommand per verb. */
#include "cmds.h"
#include "ds4/dist.h"
#include "ds4/kernels.h"

#include <stdio.h>
#include <string.h>

#define DS4_VERSION "0.9.0"

/* `ds4 info` and `ds4 --version`: the version, then the CPU features found and the engine each kernel
 * family runs (DS4_ISA caps the level), and the backends built in. */
static int cmd_info(int argc, char **argv) {
    if (argc > 1) {
        fprintf(stderr, "error: %s takes no options (got '%s')\n", argv[0], argv[1]);
        return 2;
    }
    char buf[4096];
    ds4_isa_describe(buf, sizeof buf);
    printf("ds4 %s\n%s", DS4_VERSION, buf);
    printf("backends:");
    for (int i = 0; i < ds4_backend_count(); i++) printf(" %s", ds4_backend_name(i));
    printf(" (training.device, --device)\n");
    for (int i = 0; i < ds4_backend_count(); i++) { /* the devices of each, or why it cannot run here */
        ds4_backend_describe(i, buf, sizeof buf);
        char *save = NULL;
        for (char *ln = strtok_r(buf, "\n", &save); ln; ln = strtok_r(NULL, "\n", &save))
            printf("  %s: %s\n", ds4_backend_name(i), ln);
    }
    return 0;
}

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *what;
} command;

static const command k_commands[] = {
    {"init", cmd_init, "write a randomly initialised model directory"},
    {"inspect", cmd_inspect, "list the tensors of a .safetensors file or model directory (--stats, --check)"},
    {"convert", cmd_convert, "dequantize an official FP8/FP4 checkpoint to bf16/f32 (official or HF names)"},
    {"export", cmd_export, "write a Hugging Face model directory from a ds4 checkpoint folder"},
    {"tokenize", cmd_tokenize, "turn text / JSONL into token shards"},
    {"train", cmd_train, "train a model from a TOML config"},
    {"plot", cmd_plot, "render loss / memory curves from the train metrics JSONL to SVG (or PNG)"},
    {"eval", cmd_eval, "validation loss and perplexity of a model on held-out token shards"},
    {"generate", cmd_generate, "continue a prompt with the cached decoder (greedy, temperature, top-p)"},
    {"memplan", cmd_memplan, "peak memory of one training step, without running it"},
    {"debug-state", cmd_debug_state, "one forward+backward; write logits, losses, gradients, top-k"},
    {"info", cmd_info, "version, CPU features and the kernel engine of each family (also --version)"},
};

static void usage(void) {
    fprintf(stderr, "usage: ds4 <command> [options]\n\ncommands:\n");
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        fprintf(stderr, "  %-12s %s\n", k_commands[i].name, k_commands[i].what);
}

static int run_command(int argc, char **argv) {
    if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        usage();
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) return cmd_info(argc - 1, argv + 1);
    for (size_t i = 0; i < sizeof k_commands / sizeof k_commands[0]; i++)
        if (!strcmp(argv[1], k_commands[i].name)) return k_commands[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "error: unknown command '%s'\n", argv[1]);
    usage();
    return 2;
}

/* DS4_ISA is checked before any command runs; MPI starts here when mpirun launched us (a no-op
 * otherwise) and ends after the command, whatever it returned. */
int main(int argc, char **argv) {
    ds4_host_memory_keep();
    if (ds4_isa_from_env() != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 2;
    }
    if (ds4_dist_init() != DS4_OK) {
        fprintf(stderr, "error: %s\n", ds4_errmsg());
        return 1;
    }
    int rc = run_command(argc, argv);
    ds4_dist_finalize();
    return rc;
}
