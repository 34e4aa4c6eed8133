#!/usr/bin/env bash
# The main job, end to end on a fresh Debian 12 machine (as root): install, build, fetch a real
# corpus (the King James Bible from Debian's bible-kjv), tokenize it, train a small DeepSeek-V4 for a
# few minutes, evaluate, plot the curves and print a generated sample.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
make -j2 build/ds4
bash scripts/get-corpus.sh data/kjv.txt
build/ds4 tokenize --input data/kjv.txt --out data/kjv --tokenizer byte --val-fraction 0.01 --overwrite
/usr/bin/python3 - <<'PY'
import collections, math
b = open("data/kjv.txt", "rb").read()
c = collections.Counter(b)
h = -sum(v / len(b) * math.log(v / len(b)) for v in c.values())
print(f"unigram entropy of the corpus: {h:.3f} nats/byte (the loss a model that ignores context reaches)")
PY
rm -rf runs/demo
mkdir -p runs/demo
build/ds4 train --config configs/train/demo.toml "$@"
ckpt=$(ls -d runs/demo/checkpoints/step-* | sort | tail -n 1)
build/ds4 eval --checkpoint "$ckpt" --data 'data/kjv/val_*.bin' --seq-len 256 --batch 8 --max-batches 16
build/ds4 plot --metrics runs/demo/metrics.jsonl --out runs/demo/curves.svg
echo "loss and memory curves: runs/demo/curves.svg"
build/ds4 generate --checkpoint "$ckpt" --tokenizer byte --prompt "And God said" --max-new-tokens 300 \
    --temperature 0.8 --top-p 0.95 --seed 1
