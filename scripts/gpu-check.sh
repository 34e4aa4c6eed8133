#!/usr/bin/env bash
# The GPU checks of the CUDA backend (docs/cuda.md), compiled beforehand on a CPU machine with nvcc so
# the GPU's minutes go to running them.
#
#   scripts/gpu-check.sh stage DEST   (on the build machine) copies build/tests/test_cuda_*, the shared
#                                     libraries they need beyond the C runtime (MPI, cJSON, libgomp, ...:
#                                     a bare GPU machine may lack them) into DEST/lib, and this script
#                                     into DEST/gpu-check.sh.
#   bash DEST/gpu-check.sh            (on the GPU machine) nvidia-smi, every test binary, compute-sanitizer
#                                     memcheck on each, racecheck and synccheck on a small case; logs and
#                                     summary.txt under $OUT (default DEST/out). Exit 0 when all passed.
# Each step has its own time limit (CHECK_TEST_S, CHECK_SAN_S seconds) so the whole run fits a short lease.
set -u

if [ "${1:-}" = stage ]; then
    DEST=${2:?usage: scripts/gpu-check.sh stage DEST}
    BUILD=${BUILD:-build}
    cd "$(dirname "$0")/.." || exit 2
    rm -rf "$DEST" && mkdir -p "$DEST/tests" "$DEST/lib" || exit 2
    cp "$BUILD"/tests/test_cuda_* "$DEST/tests/" || exit 2
    rm -f "$DEST"/tests/*.o "$DEST"/tests/*.d
    cp scripts/gpu-check.sh "$DEST/gpu-check.sh"
    # every library ldd resolves, except the C runtime, the C++ runtime and the CUDA libraries, which the
    # GPU machine's own (newer) system and toolkit provide
    for t in "$DEST"/tests/test_cuda_*; do ldd "$t"; done | awk '$3 ~ /^\// {print $3}' | sort -u |
        grep -vE '/(libc|libm|libdl|librt|libpthread|ld-linux[^/]*|libstdc\+\+|libgcc_s|libcublas[^/]*|libcudart[^/]*)\.so' |
        while read -r lib; do cp -L "$lib" "$DEST/lib/"; done
    (cd "$DEST" && git -C .. rev-parse HEAD > commit.txt 2>/dev/null; du -sh . | cut -f1) |
        sed 's/^/staged: /'
    ls "$DEST/tests" "$DEST/lib"
    exit 0
fi

HERE=$(cd "$(dirname "$0")" && pwd)
OUT=${OUT:-$HERE/out}
TEST_S=${CHECK_TEST_S:-120}
SAN_S=${CHECK_SAN_S:-150}
mkdir -p "$OUT"
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

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
} > "$OUT/nvidia-smi.txt" 2>&1
say "gpu: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>&1 | head -n 1)"
say "commit: $(cat "$HERE/commit.txt" 2>/dev/null)"

fail=0
# 1. the tests
for t in "$HERE"/tests/test_cuda_*; do
    name=$(basename "$t")
    start=$(date +%s%N)
    timeout "$TEST_S" "$t" > "$OUT/$name.log" 2>&1
    rc=$?
    secs=$(awk -v a="$start" -v b="$(date +%s%N)" 'BEGIN { printf "%.1f", (b - a) / 1e9 }')
    line=$(grep -E '[0-9]+ passed, [0-9]+ failed' "$OUT/$name.log" | tail -n 1)
    say "test $name: rc $rc, ${line:-no result line}, ${secs}s"
    [ "$rc" = 0 ] && [ -n "$line" ] || fail=1
done

# 2. compute-sanitizer: memcheck on every binary (DS4_CUDA_SMALL=1 asks the tests for their small cases
#    where they have a choice), racecheck and synccheck on the small row ops
CS=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer /opt/nvidia/*/compute-sanitizer 2>/dev/null | head -n 1)
if [ -z "$CS" ]; then
    say "compute-sanitizer: not found"
    fail=1
else
    for t in "$HERE"/tests/test_cuda_*; do
        name=$(basename "$t")
        DS4_CUDA_SMALL=1 timeout "$SAN_S" "$CS" --tool memcheck --leak-check full --error-exitcode 9 "$t" \
            > "$OUT/memcheck_$name.log" 2>&1
        rc=$?
        say "memcheck $name: rc $rc, $(grep -E 'ERROR SUMMARY' "$OUT/memcheck_$name.log" | tail -n 1)"
        [ "$rc" = 0 ] || fail=1
    done
    for tool in racecheck synccheck; do
        t=$HERE/tests/test_cuda_basic
        [ -x "$t" ] || continue
        DS4_CUDA_SMALL=1 DS4_CUDA_ONLY=${CHECK_RACE_ONLY:-rmsnorm,cross_entropy,embedding} timeout "$SAN_S" "$CS" \
            --tool "$tool" --error-exitcode 9 "$t" > "$OUT/${tool}_test_cuda_basic.log" 2>&1
        rc=$?
        say "$tool test_cuda_basic: rc $rc, $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/${tool}_test_cuda_basic.log" | tail -n 1)"
        [ "$rc" = 0 ] || fail=1
    done
fi

# the logs as one file each kind (the lease returns a few files only)
cat "$OUT"/test_cuda_*.log > "$OUT/tests.log" 2>/dev/null
cat "$OUT"/memcheck_*.log "$OUT"/racecheck_*.log "$OUT"/synccheck_*.log > "$OUT/sanitizer.log" 2>/dev/null
rm -f "$OUT"/test_cuda_*.log "$OUT"/memcheck_*.log "$OUT"/racecheck_*.log "$OUT"/synccheck_*.log
say "gpu-check: $([ $fail = 0 ] && echo PASS || echo FAIL)"
exit $fail
