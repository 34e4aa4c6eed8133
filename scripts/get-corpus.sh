#!/usr/bin/env bash
# Writes a real English corpus for demos and smoke tests to PATH (default data/kjv.txt): the King
# James Bible from Debian's bible-kjv package (public domain), 31,102 verses, about 4.3 MB of
# plain text: one verse per line, a blank line between chapters. Installs the package when the
# `bible` program is missing (needs root, as on the project's machines); running it again is a
# no-op apart from rewriting PATH with the same bytes.
#
#   scripts/get-corpus.sh data/kjv.txt
#   build/ds4 tokenize --input data/kjv.txt --out data/kjv --tokenizer byte
set -euo pipefail
out=${1:-data/kjv.txt}

if ! command -v bible >/dev/null 2>&1; then
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get install -y --no-install-recommends bible-kjv >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y --no-install-recommends bible-kjv >/dev/null
    fi
fi

mkdir -p "$(dirname "$out")"
tmp="$out.tmp.$$"
trap 'rm -f "$tmp"' EXIT
# `bible -f` prints "Ge1:1 In the beginning ..." one verse a line; drop the reference, and start
# each chapter after a blank line.
bible -f 'gen1:1-rev22:21' </dev/null |
    sed -E 's/^([1-3]?[A-Za-z]+[0-9]+):[0-9]+ /\1\t/' |
    awk -F'\t' 'NR > 1 && $1 != prev { print "" } { prev = $1; print $2 }' >"$tmp"

verses=$(grep -c . "$tmp" || true)
if [ "$verses" -ne 31102 ]; then
    echo "error: expected 31102 verses from bible-kjv, got $verses" >&2
    exit 1
fi
mv "$tmp" "$out"
trap - EXIT
echo "wrote $out: $verses verses, $(wc -c <"$out") bytes"
