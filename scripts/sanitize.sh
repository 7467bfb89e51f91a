#!/usr/bin/env bash
# The sanitizer and fuzzing part of the test suite (the end of README's second command, after ctest):
#   1. a clang tree in build-asan (ccache'd) with AddressSanitizer + UndefinedBehaviorSanitizer on
#      every target (QLORA_SANITIZE) and libFuzzer's coverage (QLORA_FUZZ), CUDA off;
#   2. the unit tests of the concerns that parse user files or hold the kernels' reference paths
#      (quant + kernels, io, data, jinja, checkpoint: resume and export, config) under both sanitizers;
#   3. each fuzz target of tests/fuzz for QLORA_FUZZ_SECONDS (default 25) from its seed corpus
#      (tests/fuzz/corpus/<target> plus the real files of tests/data), in a scratch copy.
# The test binaries and the fuzz targets run as many at a time as there are cores.
# A finding stops the script non-zero; the input libFuzzer wrote (crash-*, timeout-*, leak-*) is in
# build-asan/fuzz/<target>/: fix the bug, then add the input to tests/fuzz/corpus/<target>.
# Environment: QLORA_FUZZ_SECONDS, QLORA_VENV (default .venv; the LibTorch of the main build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD=build-asan
VENV="${QLORA_VENV:-$ROOT/.venv}"
SECONDS_PER_TARGET="${QLORA_FUZZ_SECONDS:-25}"
say() { printf '[sanitize] %s\n' "$*"; }

# clang and its sanitizer/libFuzzer runtimes, when missing (setup.sh installed the rest).
bash scripts/install_debs.sh clang libclang-rt-14-dev

export CCACHE_BASEDIR="$ROOT" CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
if [ ! -f "$BUILD/CMakeCache.txt" ]; then
  say "configuring $BUILD (clang, ASan + UBSan, libFuzzer)"
  torch_prefix="$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++ \
        -DCMAKE_PREFIX_PATH="$torch_prefix" -DPython3_EXECUTABLE="$VENV/bin/python" -DQLORA_CUDA=OFF \
        -DQLORA_BENCH=OFF -DQLORA_SANITIZE=ON -DQLORA_FUZZ=ON > "$BUILD.configure.log" 2>&1 \
    || { cat "$BUILD.configure.log"; exit 1; }
fi
TESTS=(qlora_tests qlora_io_tests qlora_images_tests qlora_data_tests qlora_jinja_tests qlora_checkpoint_tests qlora_config_tests)
FUZZ=(safetensors tokenizer records chat_template decoder_config config resume gguf image)
say "building ${TESTS[*]} and the fuzz targets"
cmake --build "$BUILD" -j"$(nproc)" --target "${TESTS[@]}" "${FUZZ[@]/#/fuzz_}"

# LibTorch and its OpenMP runtime are not instrumented: their allocations and exits are outside
# what we check (no leak report for them); container-overflow needs every STL user instrumented.
export ASAN_OPTIONS="detect_leaks=0:detect_container_overflow=0:abort_on_error=1:allocator_may_return_null=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
export QLORA_TEST_DATA="$ROOT/tests/data"

# in_parallel FUNCTION LOG SUMMARY ITEM...: FUNCTION ITEM for every ITEM, as many at a time as there are
# cores; then, in order, the lines of each one's log (LOG, with ITEM for its %s) that match the regex
# SUMMARY, or the log's tail where FUNCTION failed, and exit 1 after the first batch with a failure.
in_parallel() {
  local run=$1 pattern=$2 summary=$3 jobs i k log
  shift 3
  local items=("$@")
  jobs="$(nproc)"
  for ((i = 0; i < ${#items[@]}; i += jobs)); do
    local batch=("${items[@]:i:jobs}") pids=() ok=1
    for k in "${!batch[@]}"; do "$run" "${batch[k]}" & pids+=($!); done
    for k in "${!batch[@]}"; do
      log="$(printf "$pattern" "${batch[k]}")"
      if wait "${pids[k]}"; then
        say "${batch[k]}: $(grep -E "$summary" "$log" | tr '\n' ' ')"
      else
        tail -60 "$log"
        say "FAILED: ${batch[k]}: $log (a fuzz target leaves the input beside it: crash-*, timeout-*, oom-*)"
        ok=0
      fi
    done
    [ "$ok" = 1 ] || exit 1
  done
}

unit_tests() {  # unit_tests BINARY: its cases under ASan + UBSan, logged in $BUILD/BINARY.log
  "$BUILD/$1" --gtest_brief=1 > "$BUILD/$1.log" 2>&1
}
say "${TESTS[*]} under ASan + UBSan"
in_parallel unit_tests "$BUILD/%s.log" '^\[  (PASSED|SKIPPED|FAILED)  \]|tests? from .* ran' "${TESTS[@]}"

seeds() {  # the real files of tests/data that each target's parser reads
  case "$1" in
    safetensors) ls tests/data/tiny_llama/*.safetensors ;;
    tokenizer) ls tests/data/tokenizer*/tokenizer.model ;;
    chat_template) ls tests/data/chat_templates/*.jinja ;;
    decoder_config) ls tests/data/tiny_llama/config.json ;;
    config) ls configs/*.toml ;;
  esac
}
fuzz() {  # fuzz TARGET: TARGET for SECONDS_PER_TARGET from its seeds, in a scratch copy ($BUILD/fuzz/TARGET)
  local f=$1 work="$BUILD/fuzz/$1" s
  rm -rf "$work" && mkdir -p "$work/corpus"
  cp tests/fuzz/corpus/"$f"/* "$work/corpus/"
  for s in $(seeds "$f"); do cp "$s" "$work/corpus/$(echo "$s" | tr / _)"; done
  say "fuzz_$f for ${SECONDS_PER_TARGET} s from $(ls "$work/corpus" | wc -l) seeds"
  cd "$work" && "$ROOT/$BUILD/fuzz_$f" -max_total_time="$SECONDS_PER_TARGET" -timeout=10 -rss_limit_mb=4096 \
      -max_len=65536 -print_final_stats=1 corpus > log 2>&1
}
# One target is one process on one core: each still fuzzes for its SECONDS_PER_TARGET.
in_parallel fuzz "$BUILD/fuzz/%s/log" "stat::number_of_executed_units|stat::peak_rss_mb" "${FUZZ[@]}"
say "done: no sanitizer report, no fuzzer finding"
