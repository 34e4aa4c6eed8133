#!/usr/bin/env bash
# Builds the libFuzzer targets (clang, -fsanitize=fuzzer,address,undefined) and, for each:
#   1. replays every input kept in tests/fuzz/regressions/<target>/ (a crash there fails the run);
#   2. fuzzes from the seeds in tests/fuzz/corpus/<target>/ for its share of SECONDS (total <= 60 s).
# A new crash input is written to tests/fuzz/regressions/<target>/ (keep it: it is replayed by every
# later run) and the script exits non-zero. Usage: tests/fuzz/run.sh [SECONDS]   (default 30)
set -euo pipefail
cd "$(dirname "$0")/../.."
TOTAL=${1:-30}
[ "$TOTAL" -gt 60 ] && TOTAL=60
TARGETS=(safetensors index config shards)
PER=$(( TOTAL / ${#TARGETS[@]} )); [ "$PER" -lt 1 ] && PER=1
OUT=${FUZZ_BUILD:-build-fuzz}
CC=${FUZZ_CC:-$(command -v clang-14 || command -v clang)}
SAN="-fsanitize=address,undefined -fno-sanitize-recover=undefined"
CFLAGS="-std=c17 -D_GNU_SOURCE -g -O1 -fno-omit-frame-pointer -fopenmp -Iinclude -Isrc -Wall -Wno-unknown-pragmas
        -ffunction-sections -fdata-sections"
LIBS="-lcjson -lpcre2-8 -lm"
# the code under test: core, the safetensors / model-directory / config / dequantization readers, the
# per-rank checkpoint index (its model-building half, params.c, is linked but dropped with the kernels it
# would need by lld's --gc-sections; ld.bfd keeps the sanitizers' sections alive and fails)
SRC="$(ls src/core/*.c) src/io/safetensors.c src/io/modeldir.c src/io/config.c src/io/fileio.c src/io/quant.c
     src/io/names.c src/io/tensorloc.c src/model/dircheck.c src/model/param_table.c src/model/params.c
     src/train/ckpt_shards.c"
mkdir -p "$OUT/obj" "$OUT/tmp"
objs=()
for s in $SRC; do
    o="$OUT/obj/$(echo "$s" | tr / _).o"
    if [ ! -f "$o" ] || [ "$s" -nt "$o" ] || [ include/ds4/io.h -nt "$o" ] || [ include/ds4/train.h -nt "$o" ]; then
        $CC $CFLAGS $SAN -fsanitize=fuzzer-no-link -c "$s" -o "$o"
    fi
    objs+=("$o")
done
export DS4_FUZZ_TMP="$OUT/tmp"
export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
status=0
for t in "${TARGETS[@]}"; do
    bin="$OUT/fuzz_$t"
    $CC $CFLAGS $SAN -fsanitize=fuzzer "tests/fuzz/fuzz_$t.c" "${objs[@]}" -o "$bin" -fuse-ld=lld -Wl,--gc-sections $LIBS
    reg="tests/fuzz/regressions/$t"
    mkdir -p "$reg" "$OUT/corpus_$t"
    mapfile -t kept < <(find "$reg" -type f ! -name '.*' | sort)
    if [ ${#kept[@]} -gt 0 ]; then
        if ! "$bin" -runs=1 "${kept[@]}" > "$OUT/replay_$t.log" 2>&1; then
            tail -n 40 "$OUT/replay_$t.log"
            echo "fuzz $t: a kept regression input crashes"; status=1; continue
        fi
    fi
    echo "fuzz $t: ${#kept[@]} regression inputs replayed; fuzzing ${PER}s"
    if ! "$bin" -max_total_time="$PER" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 \
            -artifact_prefix="$reg/" "$OUT/corpus_$t" "tests/fuzz/corpus/$t" > "$OUT/fuzz_$t.log" 2>&1; then
        tail -n 40 "$OUT/fuzz_$t.log"
        echo "fuzz $t: CRASH, input kept in $reg/"; status=1; continue
    fi
    grep -E "^stat::number_of_executed_units|^#[0-9]+ +DONE" "$OUT/fuzz_$t.log" | tail -n 2 | sed "s/^/fuzz $t: /"
done
rm -rf "$OUT/tmp"
[ $status = 0 ] && echo "fuzz: all targets clean"
exit $status
