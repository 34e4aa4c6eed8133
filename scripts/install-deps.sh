#!/usr/bin/env bash
# Installs the Debian packages ds4 needs (build, tests, reference, main job). Idempotent.
set -euo pipefail
PKGS=(build-essential make pkg-config libcjson-dev libpcre2-dev libomp-dev
      libopenmpi-dev openmpi-bin python3 python3-numpy python3-torch bible-kjv
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
