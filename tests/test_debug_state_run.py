#!/usr/bin/python3
"""`ds4 debug-state --config FILE.toml`: the pass of the run a training config describes, read as `ds4 train`
reads it. Checks that it gives the bytes of the flag form with the same settings (model.dir's weights, bf16
mixed precision, CSA recompute given as a train flag, a TOML override), that model.config + model.seed give
the weights `ds4 init --seed` writes, and that bad input gets one `error:` line naming the flag or key.

    /usr/bin/python3 tests/test_debug_state_run.py [--build BUILD]
"""
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "ref"))
import safetensors_io as st  # noqa: E402
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.join(build, "ds4")
passed = failed = 0


def run(*args):
    return subprocess.run([ds4, *args], capture_output=True, text=True, timeout=300)


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL {what}")


def same_file(a, b):
    with open(a, "rb") as f, open(b, "rb") as g:
        return f.read() == g.read()


def one_error(r, *needles):
    err = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    return r.returncode > 0 and len(err) == 1 and all(n in err[0] for n in needles)


with tempfile.TemporaryDirectory() as tmp:
    model = os.path.join(tmp, "m")
    tiny = os.path.join(ROOT, "tests", "configs", "tiny-a.json")
    r = run("init", "--config", tiny, "--seed", "1", "--out", model)
    assert r.returncode == 0, r.stderr
    batch = os.path.join(tmp, "b.safetensors")
    torch.manual_seed(0)
    st.save(batch, {"input_ids": torch.randint(0, 256, (2, 40), dtype=torch.int32)})
    out = lambda name: os.path.join(tmp, name)  # noqa: E731

    def toml(name, text):
        path = os.path.join(tmp, name)
        with open(path, "w") as f:
            f.write(text + '\n[data]\ntrain = "never-read.bin"\n')
        return path

    run_dir = toml("dir.toml", f'[model]\ndir = "{model}"\n[training]\nsteps = 1\nseq_len = 40\n'
                               'mixed_precision_param = "bfloat16"')
    a = run("debug-state", "--config", run_dir, "--batch", batch, "--out", out("a.st"), "--recompute-csa-attention")
    b = run("debug-state", "--model", model, "--batch", batch, "--out", out("b.st"), "--recompute-csa-attention",
            "--mixed-precision-param", "bfloat16")
    check(a.returncode == 0 and b.returncode == 0, f"both forms run: {a.stderr.strip()[:300]} {b.stderr.strip()[:300]}")
    check(a.returncode == 0 and same_file(out("a.st"), out("b.st")), "--config == the flags (bf16, csa recompute)")
    # an override of the run's precision is read as ds4 train reads it: back to fp32, which differs
    c = run("debug-state", "--config", run_dir, "--batch", batch, "--out", out("c.st"),
            "--training.mixed_precision_param", "float32")
    d = run("debug-state", "--model", model, "--batch", batch, "--out", out("d.st"))
    check(c.returncode == 0 and same_file(out("c.st"), out("d.st")), "--config with an override == the fp32 flags")
    check(c.returncode == 0 and not same_file(out("c.st"), out("a.st")), "the override changed the pass")

    run_cfg = toml("cfg.toml", f'[model]\nconfig = "{tiny}"\nseed = 1\n[training]\nsteps = 1\nseq_len = 40')
    e = run("debug-state", "--config", run_cfg, "--batch", batch, "--out", out("e.st"))
    check(e.returncode == 0 and same_file(out("e.st"), out("d.st")),
          "model.config + model.seed 1 == the model ds4 init --seed 1 wrote")

    check(one_error(run("debug-state", "--config", run_dir, "--batch", batch), "--out"), "no --out: one error")
    check(one_error(run("debug-state", "--config", run_dir, "--batch", batch, "--out", out("x.st"),
                        "--training.bogus", "3"), "training.bogus"), "an unknown override names the key")
    check(one_error(run("debug-state", "--config", out("none.toml"), "--batch", batch, "--out", out("x.st")),
                    "none.toml"), "a missing config names the file")
    check(not os.path.exists(out("x.st")), "a failing run writes nothing")

print(f"test_debug_state_run: {passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
