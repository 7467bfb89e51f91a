#!/usr/bin/env bash
# Pre-trains the embedded default's tiny base anew (~5 minutes on one thread; src/qlora/train/tiny_default.h)
# into an empty cache, ignoring the shipped copy, and copies the result to OUT
# (default: src/qlora/train/tiny_base_v<N>/, the copy the qlora binary uses: run this after any change to
# the pre-training, which bumps kBaseVersion, and commit the directory).
# OUT/made_on records the CPU it was made on (vendor, ISA ATen dispatches to): the bits are the same
# only where the kernels round the same way; tests/recipes/test_tiny_base_shipped.py (recipe.tiny_base_shipped)
# then wants them bit for bit, elsewhere by held-out accuracy.
# Usage: bash scripts/make_tiny_base.sh [OUT]   (needs build/qlora, or QLORA_BIN: bash scripts/setup.sh)
#        bash scripts/make_tiny_base.sh --prefix STEPS OUT
#          the same, but pre-training stops after its step STEPS (of the whole run's schedule) and OUT gets
#          the base as it stands then: what recipe.tiny_base_shipped compares in seconds, not minutes
#          (needs build/qlora_faults, the test binary whose fault plan stops it, or QLORA_FAULTS_BIN)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
QLORA_BIN="${QLORA_BIN:-${QLORA_BUILD_DIR:-build}/qlora}"
plan=
if [ "${1:-}" = "--prefix" ]; then
  [ $# = 3 ] || { echo "usage: bash scripts/make_tiny_base.sh --prefix STEPS OUT" >&2; exit 2; }
  QLORA_BIN="${QLORA_FAULTS_BIN:-${QLORA_BUILD_DIR:-build}/qlora_faults}"
  plan="stop_pretraining_after=$2"
  shift 2
fi
ver="$(sed -n 's/^constexpr int kBaseVersion = \([0-9]*\);/\1/p' src/qlora/train/tiny_default.cpp)"
[ -n "$ver" ] || { echo "make_tiny_base: no kBaseVersion in src/qlora/train/tiny_default.cpp" >&2; exit 1; }
OUT="${1:-src/qlora/train/tiny_base_v$ver}"

# "<vendor_id> <AVX512|AVX2|DEFAULT>": ATen's dispatch level (ATEN_CPU_CAPABILITY caps it) from
# /proc/cpuinfo; test_tiny_base_shipped.py computes the same.
cpu_key() {
  local vendor flags isa=DEFAULT
  vendor="$(sed -n 's/^vendor_id[[:space:]]*: *//p' /proc/cpuinfo | head -1)"
  flags=" $(sed -n 's/^flags[[:space:]]*: *//p' /proc/cpuinfo | head -1) "
  if [[ $flags == *" avx512f "* && $flags == *" avx512bw "* && $flags == *" avx512vl "* && $flags == *" avx512dq "* ]]; then
    isa=AVX512
  elif [[ $flags == *" avx2 "* && $flags == *" fma "* ]]; then
    isa=AVX2
  fi
  case "${ATEN_CPU_CAPABILITY:-}" in
    avx2) [ "$isa" = AVX512 ] && isa=AVX2 ;;
    default) isa=DEFAULT ;;
  esac
  echo "${vendor:-unknown} $isa"
}

tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
QLORA_FAULT_PLAN="$plan" QLORA_NO_SHIPPED_BASE=1 QLORA_CACHE_DIR="$tmp/cache" "$QLORA_BIN" run lora_finetune \
  checkpoint.output_dir="$tmp/run" training.epochs=1 training.max_steps_per_epoch=1 \
  checkpoint.adapter_only=true logging.progress=plain
mkdir -p "$OUT"
cp "$tmp/cache/tiny_base_v$ver/"{config.json,model.safetensors,tokenizer.model} "$OUT/"
cpu_key > "$OUT/made_on"
echo "tiny base v$ver${plan:+ (pre-training stopped: $plan)} -> $OUT (made on: $(cat "$OUT/made_on"))"
