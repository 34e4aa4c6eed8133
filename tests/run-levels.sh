#!/usr/bin/env bash
# The PyTorch parity test once per kernel ISA level strictly between generic and this CPU's best (those
# two run the whole suite: `make test`, `make test-levels`). Prints the usual "N passed, N failed" total.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
best=$("$BUILD/ds4" info | sed -n 's/^isa level: \([a-z0-9]*\) (best on this cpu: \([a-z0-9]*\);.*/\2/p')
levels=(generic avx2 avx512 avx512bf16 amx)
passed=0; failed=0
for lv in "${levels[@]:1}"; do
    [ "$lv" = "$best" ] && break
    out=$(DS4_ISA=$lv /usr/bin/python3 tests/test_parity.py --build "$BUILD" 2>&1); rc=$?
    line=$(printf '%s\n' "$out" | grep -E '[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    echo "DS4_ISA=$lv ${line:-test_parity: no result line (rc=$rc)}"
    p=$(printf '%s' "$line" | sed -nE 's/^(.*[^0-9])?([0-9]+) passed.*/\2/p'); f=$(printf '%s' "$line" | sed -nE 's/.* ([0-9]+) failed.*/\1/p')
    passed=$((passed + ${p:-0})); failed=$((failed + ${f:-1}))
    [ $rc != 0 ] && [ "${f:-1}" = 0 ] && failed=$((failed + 1))
    [ $rc != 0 ] && printf '%s\n' "$out" | tail -n 30
done
[ -z "$best" ] && { echo "run-levels: could not read the best ISA level from $BUILD/ds4 info"; failed=$((failed + 1)); }
echo "levels between generic and ${best:-?}: $passed passed, $failed failed"
[ $failed = 0 ]
