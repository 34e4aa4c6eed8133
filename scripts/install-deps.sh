#!/usr/bin/env bash
# Installs the Debian packages ds4 needs (build, tests, reference, main job). Idempotent.
set -euo pipefail
PKGS=(build-essential make pkg-config libcjson-dev libpcre2-dev libomp-dev
      libopenmpi-dev openmpi-bin python3 python3-numpy python3-torch python3-venv bible-kjv
      clang libclang-rt-14-dev lld)
missing=()
for p in "${PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "install-deps: all packages present"
# The tools users check ds4's files with, for the round-trip tests (tests/hf_venv.py): transformers (with
# tokenizers; jinja2 for chat templates) and tensorboard from PyPI in a venv of the repository (.venv-hf, git-ignored). No torch from
# PyPI: transformers needs none for configs and tokenizers; the model round trip runs where a torch >= 2.6 is
# present and says SKIP elsewhere. Best effort: without PyPI those checks say SKIP.
HF_PKGS=(transformers==5.23.0 tensorboard==2.21.0 jinja2)
VENV="$(cd "$(dirname "$0")/.." && pwd)/.venv-hf"
if ! "$VENV/bin/python" -c "import transformers, tensorboard" 2>/dev/null; then
    if python3 -m venv --system-site-packages "$VENV" && "$VENV/bin/pip" install -q "${HF_PKGS[@]}"; then
        echo "install-deps: ${HF_PKGS[*]} in $VENV"
    else
        echo "install-deps: warning: could not install ${HF_PKGS[*]} into $VENV; their checks will say SKIP"
    fi
fi
