"""ds4 init --dry-run and ds4 inspect --config on the real April configs, under a 1 GiB address-space
limit (the real Flash model would need ~4 TiB): both succeed and print the official V4-Flash figures
(69,187 tensors, 159,609,485,896 checkpoint bytes); a bad config is one `error:` line; --dry-run
writes nothing."""
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

build = sys.argv[sys.argv.index("--build") + 1] if "--build" in sys.argv else "build"
ds4 = os.path.abspath(os.path.join(build, "ds4"))


def run_limited(*args):
    """ds4 with its virtual memory capped at 1 GiB (ulimit -v)."""
    cmd = "ulimit -v 1048576 && exec " + " ".join([ds4, *args])
    return subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=60)


def field(out, pattern):
    m = re.search(pattern, out, re.M)
    return int(m.group(1)) if m else None


flash = run_limited("init", "--config", "configs/deepseek-v4-flash.json", "--dry-run")
check("flash dry-run exit", flash.returncode == 0, flash.stderr)
check("flash bytes", field(flash.stdout, r"(\d+) bytes$") == 159609485896, flash.stdout)
check("flash tensors", field(flash.stdout, r"(\d+) tensors,") == 69187, flash.stdout)
check("flash elements", field(flash.stdout, r"(\d+) stored elements") == 158069433298, flash.stdout)
check("flash expert", field(flash.stdout, r"^  expert +(\d+)") == 277025390592, flash.stdout)
check("flash MTP", field(flash.stdout, r"^  MTP +(\d+)") == 6610048891, flash.stdout)
check("flash FP4 bytes", field(flash.stdout, r"^  I8 +(\d+) bytes") == 141733920768, flash.stdout)

pro = run_limited("inspect", "--config", "configs/deepseek-v4-pro.json")
check("pro inspect exit", pro.returncode == 0, pro.stderr)
check("pro total", field(pro.stdout, r"^  total +(\d+)") == 1598837347742, pro.stdout)
check("pro bytes", field(pro.stdout, r"(\d+) bytes$") == 864704792696, pro.stdout)

# DeepSeek-V4-Flash-0731 (DSpark drafter): the official index's total_size, the main model unchanged
v0731 = run_limited("init", "--config", "tests/data/deepseek-v4-flash-0731.config.json", "--dry-run")
check("0731 dry-run exit", v0731.returncode == 0, v0731.stderr)
check("0731 bytes", field(v0731.stdout, r"(\d+) bytes$") == 166878536440, v0731.stdout)
check("0731 expert", field(v0731.stdout, r"^  expert +(\d+)") == 277025390592, v0731.stdout)
check("0731 DSpark", (field(v0731.stdout, r"^  DSpark +(\d+)") or 0) > 0, v0731.stdout)

with tempfile.TemporaryDirectory() as tmp:
    bad = os.path.join(tmp, "bad.json")
    with open("configs/deepseek-v4-flash.json") as f:
        text = f.read()
    with open(bad, "w") as f:
        f.write(text.replace('"o_groups": 8', '"o_groups": 7'))
    r = run_limited("init", "--config", bad, "--dry-run")
    err = [l for l in r.stderr.splitlines() if l.startswith("error:")]
    check("bad config", r.returncode != 0 and len(err) == 1 and "o_groups" in err[0] and r.stdout == "",
          r.stderr + r.stdout)
    out = os.path.join(tmp, "out")
    r = run_limited("init", "--config", "tests/configs/tiny-a.json", "--out", out, "--dry-run")
    check("dry-run writes nothing", r.returncode == 0 and not os.path.exists(out), r.stderr)
    r = run_limited("inspect", "--config", "configs/deepseek-v4-flash.json", "--stats")
    check("inspect --config with --stats", r.returncode == 2 and r.stderr.startswith("error:"), r.stderr)

finish("test_dry_run.py")
