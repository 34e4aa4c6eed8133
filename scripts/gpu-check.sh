#!/usr/bin/env bash
# The GPU checks of the CUDA backend (docs/cuda.md), compiled beforehand on a CPU machine with nvcc so
# the GPU's minutes go to running them.
#
#   scripts/gpu-check.sh stage DEST   (on the build machine) copies build/tests/test_cuda_*, the shared
#                                     libraries they need beyond the C runtime (MPI, cJSON, libgomp, ...:
#                                     a bare GPU machine may lack them) into DEST/lib, and this script
#                                     into DEST/gpu-check.sh.
#                                     Also the ds4 program with its CUDA plugin (libds4cuda.so), tiny-a's
#                                     config and a token shard, for the trainer's check.
#   bash DEST/gpu-check.sh            (on the GPU machine) nvidia-smi, every test binary, `ds4 train
#                                     --training.device cuda` (twice: the same checkpoint bytes; against
#                                     the cpu: the losses; under mpirun -np 2 where the machine has it:
#                                     FSDP on one GPU), compute-sanitizer memcheck, racecheck and
#                                     synccheck on each test (test_cuda_basic: on its ops with shared
#                                     memory), then the benches (bench/cuda_*: timings, not checks); logs
#                                     and summary.txt under $OUT (default DEST/out). Exit 0 when all
#                                     checks passed.
# Each step has its own time limit (CHECK_TEST_S, CHECK_SAN_S seconds) and the whole run a budget
# (CHECK_BUDGET_S): a step that would not fit is skipped and says so, so the run fits a short lease.
# Logs are appended as the steps finish, so a run cut short still leaves what it did.
set -u

if [ "${1:-}" = stage ]; then
    DEST=${2:?usage: scripts/gpu-check.sh stage DEST}
    BUILD=${BUILD:-build}
    cd "$(dirname "$0")/.." || exit 2
    rm -rf "$DEST" && mkdir -p "$DEST/tests" "$DEST/bench" "$DEST/lib" || exit 2
    cp "$BUILD"/tests/test_cuda_* "$DEST/tests/" || exit 2
    mkdir -p "$DEST/train" && cp "$BUILD/ds4" "$BUILD/libds4cuda.so" tests/configs/tiny-a.json "$DEST/train/" || exit 2
    python3 -c "import sys; sys.path.insert(0, 'tests'); from fixed_inputs import write_shard; \
write_shard('$DEST/train/train.bin', 256, 6, 700, seed=31)" || exit 2
    cp "$BUILD"/bench/cuda_* "$DEST/bench/" 2>/dev/null
    rm -f "$DEST"/tests/*.o "$DEST"/tests/*.d "$DEST"/bench/*.o "$DEST"/bench/*.d
    cp scripts/gpu-check.sh "$DEST/gpu-check.sh"
    # every library ldd resolves, except the C runtime, the C++ runtime and the CUDA libraries, which the
    # GPU machine's own (newer) system and toolkit provide
    for t in "$DEST"/tests/test_cuda_* "$DEST"/bench/cuda_* "$DEST"/train/ds4 "$DEST"/train/libds4cuda.so; do
        [ -x "$t" ] && ldd "$t"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
        grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcublas[^/]*|libcudart[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$DEST/lib/"; done
    echo "$(git rev-parse --short HEAD) $(git rev-parse --abbrev-ref HEAD)$(git status --porcelain --untracked-files=no |
        grep -q . && echo ' (with uncommitted changes)')" > "$DEST/commit.txt"
    echo "staged $(du -sh "$DEST" | cut -f1) from $(cat "$DEST/commit.txt")"
    ls "$DEST/tests" "$DEST/lib"
    exit 0
fi

HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/out}
TEST_S=${CHECK_TEST_S:-90}
SAN_S=${CHECK_SAN_S:-120}
DEADLINE=$((SECONDS + ${CHECK_BUDGET_S:-270}))
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
TESTS_LOG=$OUT/tests.log
SAN_LOG=$OUT/sanitizer.log
: > "$SUMMARY"
: > "$TESTS_LOG"
: > "$SAN_LOG"
say() { echo "$*" | tee -a "$SUMMARY"; }
# seconds a step may take: its limit, or what is left of the budget (0: skip it)
limit() {
    local left=$((DEADLINE - SECONDS - 5))
    [ "$left" -lt 15 ] && { echo 0; return; }
    [ "$1" -lt "$left" ] && echo "$1" || echo "$left"
}

# libraries: the staged ones, then cuBLASLt wherever this machine's toolkit or Python wheels keep it
LIBS=$HERE/lib
for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do [ -d "$d" ] && LIBS=$LIBS:$d; done
lt=$(find /usr/local /usr/lib /opt -name 'libcublasLt.so.13*' 2>/dev/null | head -n 1)
[ -z "$lt" ] && lt=$(find / -xdev -name 'libcublasLt.so.13*' 2>/dev/null | head -n 1)
[ -n "$lt" ] && LIBS=$LIBS:$(dirname "$lt")
export LD_LIBRARY_PATH=$LIBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

{
    date -u
    echo "commit: $(cat "$HERE/commit.txt" 2>/dev/null)"
    uname -srm
    nvidia-smi
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
    echo "cublasLt: ${lt:-not found}"
    t=$(ls "$HERE"/tests/test_cuda_* | head -n 1)
    echo "ldd $(basename "$t"):"
    ldd "$t"
    compute-sanitizer --version 2>&1 | tail -n 1
} > "$OUT/nvidia-smi.txt" 2>&1
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -n 1)"
say "commit: $(cat "$HERE/commit.txt" 2>/dev/null)"

fail=0
# 1. the tests
for t in "$HERE"/tests/test_cuda_*; do
    name=$(basename "$t")
    lim=$(limit "$TEST_S")
    [ "$lim" = 0 ] && { say "test $name: skipped (out of time)"; fail=1; continue; }
    echo "==== $name" >> "$TESTS_LOG"
    start=$(date +%s%N)
    timeout "$lim" "$t" > "$OUT/cur.log" 2>&1
    rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    cat "$OUT/cur.log" >> "$TESTS_LOG"
    line=$(grep -E '[0-9]+ passed, [0-9]+ failed' "$OUT/cur.log" | tail -n 1)
    say "test $name: rc $rc, ${line:-no result line}, ${secs}s"
    [ "$rc" = 0 ] && [ -n "$line" ] || fail=1
    grep -q SKIP "$OUT/cur.log" && { say "test $name: SKIPPED on the GPU machine"; fail=1; }
    # a second process must copy back the same bytes (the tests hash every result they read)
    hash1=$(grep -E 'device output hash' "$OUT/cur.log" | tail -n 1)
    lim=$(limit "$TEST_S")
    if [ -n "$hash1" ] && [ "$lim" != 0 ]; then
        hash2=$(timeout "$lim" "$t" 2>/dev/null | grep -E 'device output hash' | tail -n 1)
        if [ "$hash1" = "$hash2" ]; then say "rerun $name: same bits (${hash1#*: })"
        else say "rerun $name: DIFFERENT bits (${hash1#*: } vs ${hash2#*: })"; fail=1; fi
    fi
done

# 2. the trainer on the GPU: tiny-a, 4 steps of AdamW with a checkpoint, twice on cuda (the same bytes: the
#    backend is deterministic) and once on the cpu (the losses within 1e-3 relative: cuBLASLt's fp32 GEMMs
#    sum in another order than the cpu's engines)
T=$HERE/train
if [ -x "$T/ds4" ]; then
    printf '[model]\nconfig = "%s/tiny-a.json"\nseed = 11\n[training]\nsteps = 4\nseq_len = 64\nglobal_batch_size = 4\nmicro_batch_size = 2\nseed = 2\n[optimizer]\nlr = 3e-3\n[lr_scheduler]\nwarmup_steps = 1\n[data]\ntrain = "%s/train.bin"\n[checkpoint]\ninterval = 4\n[metrics]\npeak_tflops = 1.0\n' "$T" "$T" > "$T/train.toml"
    for run in cuda-1 cuda-2 cpu; do
        lim=$(limit "$TEST_S")
        [ "$lim" = 0 ] && { say "train $run: skipped (out of time)"; fail=1; continue; }
        rm -rf "$T/ckpt-$run"
        timeout "$lim" "$T/ds4" train --config "$T/train.toml" --training.device "${run%-*}" \
            --checkpoint.folder "$T/ckpt-$run" --metrics.jsonl "$T/$run.jsonl" > "$OUT/train-$run.log" 2>&1
        rc=$?
        say "train $run: rc $rc, $(grep -E '^step +4 ' "$OUT/train-$run.log" | head -c 120)"
        [ "$rc" = 0 ] || fail=1
    done
    if cmp -s "$T/ckpt-cuda-1/step-00000004/model.safetensors" "$T/ckpt-cuda-2/step-00000004/model.safetensors" &&
        cmp -s "$T/ckpt-cuda-1/step-00000004/optim.state" "$T/ckpt-cuda-2/step-00000004/optim.state"; then
        say "train cuda twice: the same checkpoint bytes"
    else say "train cuda twice: DIFFERENT checkpoints"; fail=1; fi
    if paste -d' ' "$T/cuda-1.jsonl" "$T/cpu.jsonl" 2>/dev/null | awk '{ if (match($0, /"loss": [-0-9.e+]+/)) { a = substr($0, RSTART + 8, RLENGTH - 8); rest = substr($0, RSTART + RLENGTH); if (match(rest, /"loss": [-0-9.e+]+/)) { b = substr(rest, RSTART + 8, RLENGTH - 8); d = a - b; if (d < 0) d = -d; if (d > 1e-3 * (b < 0 ? -b : b)) bad = 1; n++ } } } END { exit !(n == 4 && !bad) }'; then
        say "train cuda vs cpu: the 4 losses within 1e-3 relative"
    else say "train cuda vs cpu: losses differ (see $T/cuda-1.jsonl, $T/cpu.jsonl)"; fail=1; fi
    # FSDP on the GPU: two ranks on one GPU, the shards and gathered groups on the device, the collectives
    # staged through host copies (src/dist/comm_staged.c); the losses within 1e-3 of one process's
    lim=$(limit "$TEST_S")
    if ! command -v mpirun > /dev/null; then say "train cuda mpirun -np 2: no mpirun on this machine"
    elif [ "$lim" = 0 ]; then say "train cuda mpirun -np 2: skipped (out of time)"; fail=1
    else
        rm -rf "$T/ckpt-mpi"
        OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
            timeout "$lim" mpirun -np 2 --bind-to none -x LD_LIBRARY_PATH "$T/ds4" train --config "$T/train.toml" \
            --training.device cuda --checkpoint.folder "$T/ckpt-mpi" --metrics.jsonl "$T/mpi.jsonl" \
            > "$OUT/train-cuda-mpi.log" 2>&1
        rc=$?
        say "train cuda mpirun -np 2: rc $rc, $(grep -E '^step +4 ' "$OUT/train-cuda-mpi.log" | head -c 120)"
        [ "$rc" = 0 ] || fail=1
        if paste -d' ' "$T/mpi.jsonl" "$T/cuda-1.jsonl" 2>/dev/null | awk '{ if (match($0, /"loss": [-0-9.e+]+/)) { a = substr($0, RSTART + 8, RLENGTH - 8); rest = substr($0, RSTART + RLENGTH); if (match(rest, /"loss": [-0-9.e+]+/)) { b = substr(rest, RSTART + 8, RLENGTH - 8); d = a - b; if (d < 0) d = -d; if (d > 1e-3 * (b < 0 ? -b : b)) bad = 1; n++ } } } END { exit !(n == 4 && !bad) }'; then
            say "train cuda mpirun -np 2 vs one process: the 4 losses within 1e-3 relative"
        else say "train cuda mpirun -np 2 vs one process: losses differ (see $T/mpi.jsonl)"; fail=1; fi
    fi
else
    say "train: not staged"
    fail=1
fi

# 3. compute-sanitizer: memcheck on every binary (DS4_CUDA_SMALL=1 asks the tests for their small cases
#    where they have a choice), racecheck and synccheck on the small row ops
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$CS" ]; then
    say "compute-sanitizer: not found"
    fail=1
else
    san() { # tool, binary, extra environment...
        local tool=$1 t=$2 name lim rc
        shift 2
        name=$(basename "$t")
        lim=$(limit "$SAN_S")
        [ "$lim" = 0 ] && { say "$tool $name: skipped (out of time)"; fail=1; return; }
        echo "==== $tool $name $*" >> "$SAN_LOG"
        local extra=()
        [ "$tool" = memcheck ] && extra=(--leak-check full)
        env DS4_CUDA_SMALL=1 "$@" timeout "$lim" "$CS" --tool "$tool" "${extra[@]}" --report-api-errors no \
            --error-exitcode 9 "$t" > "$OUT/cur.log" 2>&1
        rc=$?
        cat "$OUT/cur.log" >> "$SAN_LOG"
        say "$tool $name: rc $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/cur.log" | tail -n 1)," \
            "$(grep -E '[0-9]+ passed, [0-9]+ failed' "$OUT/cur.log" | tail -n 1)"
        [ "$rc" = 0 ] || fail=1
    }
    for t in "$HERE"/tests/test_cuda_*; do san memcheck "$t"; done
    for tool in racecheck synccheck; do
        for t in "$HERE"/tests/test_cuda_*; do
            # test_cuda_basic: the ops with shared memory and barriers (the GEMMs are cuBLASLt's)
            # test_cuda_model: the whole model, whose kernels the other binaries race; memcheck and synccheck
            # cover it (racecheck of every launch of a pass outlasts a short lease)
            if [ "$tool" = racecheck ] && [ "$(basename "$t")" = test_cuda_model ]; then
                say "racecheck test_cuda_model: not run (its kernels are raced in the op tests)"
                continue
            fi
            if [ "$(basename "$t")" = test_cuda_basic ]; then
                san "$tool" "$t" DS4_CUDA_ONLY="${CHECK_RACE_ONLY:-rmsnorm,cross_entropy,embedding,routing,experts,grad_norm}"
            else
                san "$tool" "$t"
            fi
        done
    done
fi

# 4. the benches: timings for the record, last (they check nothing)
for b in "$HERE"/bench/cuda_*; do
    [ -x "$b" ] || continue
    lim=$(limit "${CHECK_BENCH_S:-60}")
    [ "$lim" = 0 ] && { say "bench $(basename "$b"): skipped (out of time)"; continue; }
    echo "==== $(basename "$b")" >> "$OUT/bench.log"
    timeout "$lim" "$b" >> "$OUT/bench.log" 2>&1
    say "bench $(basename "$b"): rc $?"
done

rm -f "$OUT/cur.log"
say "gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
