#!/usr/bin/env bash
# Pre-trains the embedded default's tiny base anew (~5 minutes on 2 cores; src/qlora/train/tiny_default.h)
# into an empty cache, ignoring the shipped copy, and copies the result to OUT
# (default: src/qlora/train/tiny_base_v<N>/, the copy the qlora binary uses when ~/.cache/qlora has none).
# Usage: bash scripts/make_tiny_base.sh [OUT]   (needs build/qlora: bash scripts/setup.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${QLORA_BUILD_DIR:-build}"
ver="$(sed -n 's/^constexpr int kBaseVersion = \([0-9]*\);/\1/p' src/qlora/train/tiny_default.cpp)"
OUT="${1:-src/qlora/train/tiny_base_v$ver}"
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
QLORA_NO_SHIPPED_BASE=1 QLORA_CACHE_DIR="$tmp/cache" "$BUILD_DIR/qlora" run lora_finetune \
  checkpoint.output_dir="$tmp/run" training.epochs=1 training.max_steps_per_epoch=1 \
  checkpoint.adapter_only=true logging.progress=plain
mkdir -p "$OUT"
cp "$tmp/cache/tiny_base_v$ver/"{config.json,model.safetensors,tokenizer.model} "$OUT/"
echo "tiny base v$ver -> $OUT"
