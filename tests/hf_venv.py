"""The Python that has the tools users check ds4's files with (transformers, tokenizers, tensorboard): PyPI
packages that scripts/install-deps.sh installs into the test venv .venv-hf (no torch from PyPI). A test asks
for the modules it needs and prints SKIP when no interpreter has them."""
import os
import subprocess
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def candidates():
    env = os.environ.get("DS4_HF_PYTHON")
    if env:
        yield env
    yield os.path.join(ROOT, ".venv-hf", "bin", "python")
    yield sys.executable


def venv_python(*modules):
    """The first interpreter that imports every module (None: none does)."""
    prog = "".join(f"import {m}\n" for m in modules)
    for py in candidates():
        if not os.path.exists(py):
            continue
        r = subprocess.run([py, "-c", prog], capture_output=True, text=True, timeout=300)
        if r.returncode == 0:
            return py
    return None
