#!/usr/bin/env bash
# Runs every C test binary in $BUILD/tests and every tests/test_*.py, adds up their "N passed, N failed"
# lines and prints the total. Exits non-zero if anything failed or a test binary crashed without printing
# its line. Each line says the test and its wall time, so a slow test is visible in CI's log.
#
# Tests run DS4_TEST_JOBS at a time (default: the machine's cores): most of them keep one core busy (a
# Python driver, one mpirun rank per core), so two at a time use a 2-core machine's second core. The
# slowest start first; every test makes its own temporary names (pid / mkdtemp), so they can share a
# machine. With more than one at a time OpenMP's idle threads sleep (OMP_WAIT_POLICY=passive) instead of
# spinning on a core another test needs; results do not depend on it (tests/test_threads.c).
# DS4_SKIP_PY=1: C tests only. DS4_PY_ONLY="a.py b.py": of the Python tests only these.
set -u
BUILD=${BUILD:-build}
JOBS=${DS4_TEST_JOBS:-$(nproc 2>/dev/null || echo 1)}
cd "$(dirname "$0")/.."
[ "$JOBS" -gt 1 ] 2>/dev/null && export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} || JOBS=1
# The slowest tests first (measured, tests/run.sh's own times), so the last to finish is a short one.
SLOW_FIRST="test_golden_guard.py test_golden.py test_pp_train.py test_dist test_guard_cli.py test_train_dist
test_kernels_bf16 test_train test_pp_local test_recompute test_parity.py test_ref_selfcheck.py test_hf_roundtrip.py"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ds4-run-XXXXXX")
trap 'rm -rf "$WORK"' EXIT

# One test: NAME CMD...; its printable lines go to $WORK/NAME.out, "PASSED FAILED CRASHED" to $WORK/NAME.res;
# then the lines are printed in one piece (the lock keeps two tests' lines apart).
run_one() {
    local name=$1; shift
    local out rc line t0=$EPOCHREALTIME p=0 f=0 c=0
    out=$("$@" 2>&1); rc=$?
    local secs; secs=$(awk -v a="$t0" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }')
    line=$(printf '%s\n' "$out" | grep -E '[0-9]+ passed, [0-9]+ failed' | tail -n 1)
    {
        if [ -z "$line" ]; then
            printf '%s\n' "$out" | tail -n 30
            echo "$name: CRASHED (rc=$rc, no result line, $secs s)"
            c=1
        else
            p=$(printf '%s' "$line" | sed -E 's/^(.*[^0-9])?([0-9]+) passed.*/\2/')
            f=$(printf '%s' "$line" | sed -E 's/.* ([0-9]+) failed.*/\1/')
            if [ "$f" != 0 ] || [ $rc != 0 ]; then
                printf '%s\n' "$out" | grep -vE '^ok ' | tail -n 60
                [ $rc != 0 ] && [ "$f" = 0 ] && { echo "$name: exit code $rc"; c=1; }
            fi
            echo "$line ($name, $secs s)"
        fi
    } > "$WORK/$name.out"
    echo "$p $f $c" > "$WORK/$name.res"
    flock "$WORK/print.lock" cat "$WORK/$name.out"
}

# The tests, slowest first: NAME<TAB>CMD lines.
list_tests() {
    local t
    for t in "$BUILD"/tests/test_*; do
        [ -x "$t" ] && printf '%s\t%s\n' "$(basename "$t")" "$t"
    done
    if [ -z "${DS4_SKIP_PY:-}" ]; then
        for t in tests/test_*.py; do
            [ -f "$t" ] || continue
            [ -n "${DS4_PY_ONLY:-}" ] && [[ " $DS4_PY_ONLY " != *" $(basename "$t") "* ]] && continue
            printf '%s\t/usr/bin/python3 %s --build %s\n' "$(basename "$t")" "$t" "$BUILD"
        done
    fi
}
ordered=$( { list_tests | while IFS=$'\t' read -r name cmd; do
    rank=999; i=0
    for s in $SLOW_FIRST; do [ "$s" = "$name" ] && rank=$i; i=$((i + 1)); done
    printf '%03d\t%s\t%s\n' "$rank" "$name" "$cmd"
done; } | sort -s -t $'\t' -k1,1n | cut -f2-)

running=0
while IFS=$'\t' read -r -u 3 name cmd; do
    [ -n "$name" ] || continue
    if [ $running -ge "$JOBS" ]; then wait -n; running=$((running - 1)); fi
    # shellcheck disable=SC2086  # cmd is a command line of words without spaces inside them
    run_one "$name" $cmd < /dev/null &
    running=$((running + 1))
done 3<<< "$ordered"
wait

passed=0; failed=0; crashed=0
n_tests=$(printf '%s\n' "$ordered" | grep -c .)
n_res=$(find "$WORK" -name '*.res' | wc -l)
[ "$n_res" = "$n_tests" ] || { echo "run.sh: $n_tests tests started, $n_res gave a result"; crashed=$((n_tests - n_res)); }
for r in "$WORK"/*.res; do
    [ -f "$r" ] || continue
    read -r p f c < "$r"
    passed=$((passed + p)); failed=$((failed + f)); crashed=$((crashed + c))
done
echo
echo "total: $passed passed, $((failed + crashed)) failed"
[ $failed = 0 ] && [ $crashed = 0 ]
