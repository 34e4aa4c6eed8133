"""Pass/fail bookkeeping shared by the Python tests: check() records one assertion, finish() prints the
`NAME: N passed, N failed` line that tests/run.sh adds up and exits non-zero on any failure."""
import sys

counts = {"passed": 0, "failed": 0}


def check(name, ok, detail=""):
    """Counts one assertion; a failure prints `FAIL name: detail`."""
    if ok:
        counts["passed"] += 1
    else:
        counts["failed"] += 1
        print(f"FAIL {name}: {detail}")


def failed():
    return counts["failed"]


def finish(test_name):
    print(f"{test_name}: {counts['passed']} passed, {counts['failed']} failed")
    sys.exit(1 if counts["failed"] else 0)
