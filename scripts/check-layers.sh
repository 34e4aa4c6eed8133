#!/usr/bin/env bash
# Layers only point down. Every file of src/ and every public header of include/ds4/ belongs to a layer;
# an #include "..." of a file in a higher layer, or in another folder of the same layer (siblings stay
# independent), is an error:  file:line includes X (layer L) from layer M. A header inside src/ (e.g.
# "model/block.h") is private to its folder; only src/model reaches into src/kernels (the kernels have
# no public header yet), so the layers above call the kernels through the model.
#
#   0 core     src/core, ds4/core.h             types, status, allocator, rng
#   1 io       src/io, ds4/{config,io,tensors,toml,tokenizer,shard,pipeline}.h
#                                               files and formats: config, safetensors, model dirs; it needs
#                                               only core, so model, memory and train can all read files
#   1 kernels  src/kernels                      the numeric kernels (io's sibling: neither uses the other)
#   2 model    src/model, ds4/{model,decode}.h  parameter table, units, blocks, decode
#   3 memory   src/memory, ds4/{offload,recompute}.h
#   3 dist     src/dist, ds4/dist.h             (memory's sibling)
#   4 train    src/train, ds4/{train,trainer,data,plot,memplan}.h (memplan runs the trainer's step)
#   5 tools    tools/                           the ds4 command
#
# Usage: scripts/check-layers.sh [ROOT]   (ROOT: the repository, default: this script's). Exit 1 on a
# violation that is not in the allow-list below.
set -u
ROOT=${1:-$(cd "$(dirname "$0")/.." && pwd)}
cd "$ROOT" || exit 2

# Known upward includes that are tolerated, one "file -> included header" per line: none.
ALLOW='
'

# U := the folder (unit) of a path as written in an #include or as a file of the tree; L := its layer.
unit_of() {
    case "$1" in
        ds4/core.h | src/core/* | core/*) U=core ;;
        ds4/config.h | ds4/io.h | ds4/tensors.h | ds4/toml.h | ds4/tokenizer.h | ds4/shard.h | ds4/pipeline.h | src/io/* | io/*) U=io ;;
        ds4/kernels.h | ds4/profile.h | src/kernels/* | kernels/*) U=kernels ;;
        ds4/model.h | ds4/decode.h | src/model/* | model/*) U=model ;;
        ds4/offload.h | ds4/recompute.h | ds4/actstore.h | src/memory/* | memory/*) U=memory ;;
        ds4/dist.h | src/dist/* | dist/*) U=dist ;;
        ds4/train.h | ds4/trainer.h | ds4/data.h | ds4/plot.h | ds4/memplan.h | ds4/pp_schedule.h | src/train/* | train/*) U=train ;;
        tools/*) U=tools ;;
        *) U=unknown ;;
    esac
    case "$U" in
        core) L=0 ;; io | kernels) L=1 ;; model) L=2 ;; memory | dist) L=3 ;; train) L=4 ;; tools) L=5 ;; *) L=99 ;;
    esac
}

# U, L of file $1 (a public header is named as its includers name it)
file_unit() { case "$1" in include/ds4/*) unit_of "ds4/${1#include/ds4/}" ;; *) unit_of "$1" ;; esac; }

bad=0
files=$(find src include/ds4 tools -name '*.[ch]' | sort)
for f in $files; do
    file_unit "$f"
    if [ "$U" = unknown ]; then
        echo "$f: not in any layer (add it to scripts/check-layers.sh)"
        bad=1
    fi
done
# every quoted include of the tree at once, as file:line:included path
while IFS=: read -r f line inc; do
    [ -n "$f" ] || continue
    case "$inc" in ds4/* | core/* | io/* | kernels/* | model/* | memory/* | dist/* | train/*) ;; *) continue ;; esac
    file_unit "$f"
    fu=$U fl=$L
    unit_of "$inc"
    iu=$U il=$L
    [ "$iu" = "$fu" ] && continue
    case "$ALLOW" in *"
$f -> $inc
"*) continue ;; esac
    if [ "$il" -ge "$fl" ]; then
        echo "$f:$line includes $inc (layer $il, $iu) from layer $fl ($fu)"
        bad=1
    elif [ "${inc#ds4/}" = "$inc" ] && ! [ "$iu" = kernels -a "$fu" = model ]; then
        echo "$f:$line includes $inc (private to src/$iu) from layer $fl ($fu)"
        bad=1
    fi
done < <(grep -Hn '^[[:space:]]*#[[:space:]]*include[[:space:]]*"' $files | sed -n 's|^\([^:]*\):\([0-9]*\):[^"]*"\([^"]*\)".*|\1:\2:\3|p')
if [ $bad = 0 ]; then echo "layers: ok"; fi
exit $bad
