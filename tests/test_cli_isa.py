"""`ds4 info` / `ds4 --version` and the DS4_ISA cap, as a user meets them: the CPU features and the engine
of each kernel family are printed; DS4_ISA picks a lower level; an unknown level, or one this CPU lacks,
stops the program with one `error:` line naming DS4_ISA before any command runs."""
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.join(build, "ds4")
LEVELS = ["generic", "avx2", "avx512", "avx512bf16", "amx"]


def run(args, isa=None):
    env = dict(os.environ)
    env.pop("DS4_ISA", None)
    if isa is not None:
        env["DS4_ISA"] = isa
    return subprocess.run([ds4, *args], capture_output=True, text=True, timeout=60, env=env)



def field(out, key):
    for line in out.splitlines():
        if line.startswith(key + ":"):
            return line[len(key) + 1:].strip()
    return None


r = run(["info"])
check("info exits 0", r.returncode == 0, r.stderr)
level = (field(r.stdout, "isa level") or "?").split()[0]
best = (field(r.stdout, "isa level") or "").split("best on this cpu: ")[-1].split(";")[0]
check("info names the level and the best level", level in LEVELS and best in LEVELS and level == best, r.stdout)
for key in ("cpu", "cpu features", "gemm fp32", "gemm bf16", "other kernels"):
    check(f"info prints '{key}'", field(r.stdout, key) is not None, r.stdout)
# a backend built in says what it runs on here: the cuda one its GPUs, or why it cannot run
backends = (field(r.stdout, "backends") or "").split("(")[0].split()
check("info lists the backends built in", backends[:2] == ["cpu", "cpu-guard"], r.stdout)
if "cuda" in backends:
    cuda = [ln for ln in r.stdout.splitlines() if ln.startswith("  cuda: ")]
    check("info: the cuda backend lists its GPUs or says why it cannot run here",
          cuda and all(ln.startswith("  cuda: cuda:") for ln in cuda) or (len(cuda) == 1 and "not usable here" in cuda[0]),
          r.stdout)

v = run(["--version"])
check("--version", v.returncode == 0 and v.stdout.startswith("ds4 ") and field(v.stdout, "isa level"), v.stdout)

# every level up to the best can be chosen, and the engines follow it
for lv in LEVELS[: LEVELS.index(best) + 1]:
    g = run(["info"], isa=lv)
    check(f"DS4_ISA={lv}", g.returncode == 0 and (field(g.stdout, "isa level") or "").startswith(lv + " "), g.stdout + g.stderr)
    if lv == "generic":
        check("generic gemm is the reference", "reference" in (field(g.stdout, "gemm fp32") or ""), g.stdout)

# levels above the best, and names that are not levels: one error line, exit 2, for any command
bad = LEVELS[LEVELS.index(best) + 1:] + ["avx513", "AVX2", " "]
for lv in bad:
    for args in (["info"], ["memplan", "--model", "configs/deepseek-v4-flash.json", "--seq", "64"]):
        e = run(args, isa=lv)
        err = [l for l in e.stderr.splitlines() if l.startswith("error:")]
        check(f"DS4_ISA={lv!r} {args[0]}", e.returncode == 2 and len(err) == 1 and "DS4_ISA" in err[0] and not e.stdout,
              f"rc={e.returncode} stderr={e.stderr!r}")

finish("test_cli_isa")
