#!/usr/bin/env bash
# Runs every C test binary in $BUILD/tests and every tests/py_*.sh / tests/test_*.py, adds up their
# "N passed, N failed" lines and prints the total. Exits non-zero if anything failed or a test
# binary crashed without printing its line. Each line says the test and its wall time, so a slow test is
# visible in CI's log.
set -u
BUILD=${BUILD:-build}
cd "$(dirname "$0")/.."
passed=0; failed=0; crashed=0
run_one() {
    local name=$1; shift
    local out rc line t0=$EPOCHREALTIME
    out=$("$@" 2>&1); rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    line=$(printf '%s\n' "$out" | grep -E '[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    if [ -z "$line" ]; then
        printf '%s\n' "$out" | tail -n 30
        echo "$name: CRASHED (rc=$rc, no result line)"
        crashed=$((crashed + 1)); return
    fi
    local p f
    p=$(printf '%s' "$line" | sed -E 's/^(.*[^0-9])?([0-9]+) passed.*/\2/')
    f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
    passed=$((passed + p)); failed=$((failed + f))
    if [ "$f" != 0 ] || [ $rc != 0 ]; then
        printf '%s\n' "$out" | grep -vE '^ok ' | tail -n 60
        [ $rc != 0 ] && [ "$f" = 0 ] && { echo "$name: exit code $rc"; crashed=$((crashed + 1)); }
    fi
    echo "$line ($name, $secs s)"
}
for t in "$BUILD"/tests/test_*; do
    [ -x "$t" ] || continue
    run_one "$(basename "$t")" "$t"
done
if [ -z "${DS4_SKIP_PY:-}" ]; then
    for t in tests/test_*.py; do
        [ -f "$t" ] || continue
        run_one "$(basename "$t")" /usr/bin/python3 "$t" --build "$BUILD"
    done
fi
echo
echo "total: $passed passed, $((failed + crashed)) failed"
[ $failed = 0 ] && [ $crashed = 0 ]
