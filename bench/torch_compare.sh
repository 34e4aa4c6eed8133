#!/usr/bin/env bash
# ds4 against Hugging Face transformers' DeepSeek-V4 (eager fp32, eager bf16 weights, torch.compile) on the
# same config, tokens, weights and cores: bench/torch_compare.py does the work, this script prepares it.
# Not part of CI: the first run installs PyPI's torch (gigabytes) and transformers into the repository's
# own venv .venv-bench (git-ignored): the CPU-only wheels when their index is reachable, else PyPI's torch.
# Usage: bench/torch_compare.sh [torch_compare.py options]  (--help lists them; e.g. --seq 1024 --threads 1 --quick)
# On a machine that already has torch and cannot reach PyPI (a GPU machine: --device cuda), DS4_BENCH_SYSTEM=1
# runs the Python in DS4_BENCH_PYTHON (default python3) as it is (transformers and safetensors importable, e.g.
# through PYTHONPATH), and DS4_BENCH_NO_BUILD=1 takes build/ as it was carried there (nothing is compiled).
# --before REV adds the engines ds4-before-fp32 / -bf16: the tree of REV (git archive) built under
# build/before/REV with bench/train_step.c compiled against it (DS4_TRAIN_STEP_BASIC: only the train-step API),
# so the code as it was runs in the same rounds as the code as it is.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
VENV="$ROOT/.venv-bench"
PY="${DS4_BENCH_PYTHON:-python3}"
TRANSFORMERS="transformers==5.23.0"          # the version tests/test_hf_roundtrip.py checks ds4's files with
TORCH="${DS4_BENCH_TORCH:-torch}"           # e.g. DS4_BENCH_TORCH=torch==2.15.0 to pin
CPU_INDEX="${DS4_BENCH_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"

if [ -n "${DS4_BENCH_SYSTEM:-}" ]; then
    "$PY" -c "import torch, transformers, safetensors" ||
        { echo "torch_compare: DS4_BENCH_SYSTEM=1 but $PY cannot import torch, transformers and safetensors" >&2; exit 2; }
    PYBIN=$(command -v "$PY")
    SOURCE="the machine's own ($PYBIN)"
elif ! "$VENV/bin/python" -c "import torch, transformers, safetensors" 2>/dev/null; then
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    if "$VENV/bin/pip" install -q --timeout 20 --retries 0 --index-url "$CPU_INDEX" "$TORCH"; then
        echo "CPU-only wheel ($CPU_INDEX)" > "$VENV/torch-source"
    else
        echo "torch_compare: the CPU-only wheel index is not reachable; installing PyPI's torch (with its CUDA libraries, large)" >&2
        "$VENV/bin/pip" install -q "$TORCH"
        echo "PyPI wheel (CUDA build, run on the CPU)" > "$VENV/torch-source"
    fi
    "$VENV/bin/pip" install -q "$TRANSFORMERS" safetensors
fi
PYBIN=${PYBIN:-$VENV/bin/python}
SOURCE=${SOURCE:-$(cat "$VENV/torch-source" 2>/dev/null || echo "installed by hand")}
BUILD="${BUILD:-build}"
[ -n "${DS4_BENCH_NO_BUILD:-}" ] || make -C "$ROOT" -s BUILD="$BUILD" "$BUILD/ds4" "$BUILD/bench/train_step" >&2
BEFORE_ARGS=()
prev=""
for arg in "$@"; do
    if [ "$prev" = "--before" ]; then
        rev=$(git -C "$ROOT" rev-parse --short "$arg^{commit}") ||
            { echo "torch_compare: --before $arg: not a commit of this repository" >&2; exit 2; }
        dir="$ROOT/$BUILD/before/$rev"
        if [ ! -x "$dir/build/bench/train_step_basic" ]; then
            rm -rf "$dir" && mkdir -p "$dir"
            git -C "$ROOT" archive "$rev" | tar -x -C "$dir"
            { echo "#define DS4_TRAIN_STEP_BASIC 1"; cat "$ROOT/bench/train_step.c"; } > "$dir/bench/train_step_basic.c"
            make -C "$dir" -s build/ds4 build/bench/train_step_basic >&2 ||
                { echo "torch_compare: --before $arg: building $rev failed (its own dependencies: its scripts/install-deps.sh)" >&2; exit 2; }
        fi
        BEFORE_ARGS=(--before-build "$dir/build")
    fi
    prev=$arg
done
export DS4_BENCH_ARGS="$(printf '%q ' "$@")"
exec "$PYBIN" "$ROOT/bench/torch_compare.py" --build "$ROOT/$BUILD" --torch-source "$SOURCE" "${BEFORE_ARGS[@]}" "$@"
