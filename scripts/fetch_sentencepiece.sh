#!/usr/bin/env bash
# Unpacks SentencePiece's C++ source, from its PyPI source distribution (which carries its own
# protobuf-lite), into .deps/sentencepiece-<version>/ (git-ignored): CMakeLists.txt builds it as a
# static library compiled into qlora with its symbols hidden, so that the binary loads no shared
# sentencepiece and exports no protobuf symbol (torch's libtorch_cpu.so defines protobuf too, and two
# definitions bound by load order could mix two versions in one process; tests: build.no_shared_protobuf).
# 0.2.0 is the last release whose source distribution carries protobuf-lite (later ones fetch it with git).
# Idempotent; pip's download cache keeps the archive. Usage: bash scripts/fetch_sentencepiece.sh [PIP]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VERSION=0.2.0
DEST="$ROOT/.deps/sentencepiece-$VERSION"
PIP="${1:-$ROOT/.venv/bin/pip}"
[ -f "$DEST/sentencepiece/src/sentencepiece_processor.cc" ] && exit 0
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
"$PIP" download --disable-pip-version-check -q --no-binary :all: --no-deps "sentencepiece==$VERSION" -d "$tmp"
mkdir -p "$ROOT/.deps"
tar xzf "$tmp/sentencepiece-$VERSION.tar.gz" -C "$tmp"
rm -rf "$DEST"
mv "$tmp/sentencepiece-$VERSION" "$DEST"
echo "[setup] sentencepiece $VERSION source -> $DEST"
