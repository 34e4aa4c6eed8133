/* Model helpers the tests share (include after test.h: they CHECK). */
#ifndef DS4_TEST_MODELS_H
#define DS4_TEST_MODELS_H

#include "ds4/config.h"
#include "ds4/model.h"

/* A model of the config at cfg_path with random weights from seed; NULL (and a failed CHECK) if it
 * cannot be made. */
static inline ds4_model *tiny_model(const char *cfg_path, uint64_t seed) {
    ds4_config c;
    ds4_model *m = NULL;
    CHECK(ds4_config_load(cfg_path, &c) == DS4_OK, "%s", ds4_errmsg());
    CHECK(ds4_model_create(NULL, &c, false, &m) == DS4_OK, "%s", ds4_errmsg());
    if (m) ds4_model_init_random(m, seed);
    return m;
}

#endif
