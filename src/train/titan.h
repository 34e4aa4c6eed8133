/* TorchTitan's TOML sections and keys read as ds4's (src/train/titan.c; docs/torchtitan-configs.md).
 * Private to src/train: the trainer's config reader calls these. */
#ifndef DS4_TRAIN_TITAN_H
#define DS4_TRAIN_TITAN_H

#include "ds4/trainer.h"

/* Every key of t is a ds4 key (`known`), a TorchTitan key ds4 maps, or one it names as ignored;
 * a ds4 key and its TorchTitan alias are not both set. */
ds4_status titan_check_keys(const ds4_toml *t, const char *const *known, int64_t n_known);
/* The key to read for ds4 key `key`: its TorchTitan alias when only that is set, else `key`. */
const char *titan_key(const ds4_toml *t, const char *key);
/* The name to show in an error about ds4 key `key`: "TITAN_KEY (ds4's KEY)" when the config set it under
 * its TorchTitan alias (c->titan_names), else `key`. */
const char *titan_label(const ds4_train_cfg *c, const char *key);
/* The TorchTitan-only settings (after the ds4 keys are read into c): parallel degrees, schedule
 * shape, checkpoint switch, activation checkpointing, the model's config, job.dump_folder. */
ds4_status titan_read(const ds4_toml *t, ds4_train_cfg *c);

#endif
