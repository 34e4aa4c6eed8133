"""Layers only point down (scripts/check-layers.sh): the tree as it stands passes, and a copy of it with one
upward include, one sibling include or one reach into another folder's private header fails, naming the
file, the line and both layers."""
import os
import shutil
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import check, finish  # noqa: E402

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
script = os.path.join(root, "scripts", "check-layers.sh")



def run(tree):
    return subprocess.run(["bash", script, tree], capture_output=True, text=True, timeout=60)


r = run(root)
check("the tree passes", r.returncode == 0 and "layers: ok" in r.stdout, r.stdout + r.stderr)

# (file to append to, include added, the line the check must print)
cases = [
    ("src/core/status.c", '"ds4/model.h"', "includes ds4/model.h (layer 2, model) from layer 0 (core)"),
    ("src/io/names.c", '"ds4/train.h"', "includes ds4/train.h (layer 4, train) from layer 1 (io)"),
    ("include/ds4/model.h", '"ds4/offload.h"', "includes ds4/offload.h (layer 3, memory) from layer 2 (model)"),
    ("src/dist/comm.c", '"ds4/recompute.h"', "includes ds4/recompute.h (layer 3, memory) from layer 3 (dist)"),
    ("src/train/optim.c", '"kernels/kernels.h"', "includes kernels/kernels.h (private to src/kernels) from layer 4"),
    ("src/memory/offload.c", '"model/block.h"', "includes model/block.h (private to src/model) from layer 3"),
]
with tempfile.TemporaryDirectory() as tmp:
    for rel, inc, want in cases:
        tree = os.path.join(tmp, "t")
        shutil.rmtree(tree, ignore_errors=True)
        for d in ("src", "include", "tools", "scripts"):
            shutil.copytree(os.path.join(root, d), os.path.join(tree, d))
        path = os.path.join(tree, rel)
        with open(path) as f:
            nlines = len(f.read().splitlines())
        with open(path, "a") as f:
            f.write(f"#include {inc}\n")
        r = run(tree)
        check(f"{rel} + {inc} fails", r.returncode == 1, r.stdout)
        check(f"{rel} + {inc} is named", f"{rel}:{nlines + 1} {want}" in r.stdout, r.stdout)

finish("test_layers")
