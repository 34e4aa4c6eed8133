/* ds4 command line. */
#include "ds4/core.h"

#include <stdio.h>
#include <string.h>

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: ds4 <command> [options]\n");
        return 2;
    }
    fprintf(stderr, "error: unknown command '%s'\n", argv[1]);
    return 2;
}
