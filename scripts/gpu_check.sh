#!/usr/bin/env bash
# Builds and tests qlora with CUDA on the GPU machine, which has nvcc, cmake, ninja and a
# python3 holding torch, but no package registry: everything else comes from .gpu_deps/, made
# by scripts/gpu_prepare.sh on a machine that reaches Debian and PyPI, and carried over
# (device tool: carry [".gpu_deps/debs", ".gpu_deps/wheels", ".gpu_deps/cache", ".deps"]).
#
#   scripts/gpu_check.sh [STEP...]      from the repo root; default: every step but train, in
#                                       this order (train is minutes a configuration: name it)
#     deps       unpack the .debs into .gpu_deps/root (never into /), venv with the wheels
#     configure  cmake -G Ninja, Release, QLORA_CUDA=ON, into build-gpu
#     build      cmake --build
#     test       ctest, all tests (GPU ones included)
#     crash      the embedded default with an empty cache (it pre-trains the tiny base on the CPU,
#                where the first GPU run segfaulted), stopped after 60 s if it lives: a crash
#                leaves its symbolized call stack and, where cuda-gdb exists (GPU_CHECK_GDB=0:
#                not), its backtrace from a second run under it
#     recipe     the embedded default with model.device=cuda (the carried pre-trained base), then
#                qlora generate --device cuda on its export; 120 s at most each
#     bench      build-gpu/bench_nf4 --device cuda > $OUT/bench_nf4_cuda.json
#     train      bench_train_step --device cuda beside the torch + torchao peer (eager, compiled) and
#                transformers + peft: Llama-2-7B and Llama-3.1-8B shapes, seq 2048, batch 1 and 4 (GPU_CHECK_TRAIN
#                narrows it: e.g. "llama2-7b:1"), one JSON each under $OUT
#
# A device call is limited to 10 minutes: run `deps configure build` in one call and
# `test bench` in the next if the whole does not fit (build-gpu and .gpu_deps/root stay on a
# warm machine; every step re-checks the unpacked tree, so any later step can come first).
# Exits non-zero if any step fails; a failing test still lets bench run.
#
# Env: GPU_CHECK_STEPS (steps, if no arguments), GPU_CHECK_PYTHON (default python3),
#      GPU_CHECK_BUILD_DIR (default build-gpu), GPU_CHECK_JOBS (default nproc),
#      GPU_CHECK_TARGETS (build only these targets; default all),
#      GPU_CHECK_CTEST_ARGS (extra ctest arguments), OUT (logs and bench JSON go there).
set -euo pipefail

repo=$(pwd)
if [[ ! -f $repo/CMakeLists.txt || ! -f $repo/scripts/gpu_check.sh ]]; then
  echo "gpu_check: run from the repository root" >&2
  exit 2
fi
deps=$repo/.gpu_deps
root=$deps/root
venv=$deps/venv
vpy=$venv/bin/python3
build=${GPU_CHECK_BUILD_DIR:-build-gpu}
[[ $build == /* ]] || build=$repo/$build
py=${GPU_CHECK_PYTHON:-python3}
jobs=${GPU_CHECK_JOBS:-$(nproc)}
multiarch=x86_64-linux-gnu

if (($#)); then steps=("$@"); else read -r -a steps <<<"${GPU_CHECK_STEPS:-deps configure build test crash recipe bench}"; fi
for s in "${steps[@]}"; do
  case $s in deps | configure | build | test | crash | recipe | bench | train) ;;
    *) echo "gpu_check: unknown step '$s'" >&2; exit 2 ;;
  esac
done

if [[ -n ${OUT:-} ]]; then  # the device tool returns only the output's tail: keep all of it
  mkdir -p "$OUT"
  exec > >(tee -a "$OUT/gpu_check.log") 2>&1
fi
say() { printf '[gpu_check] %s\n' "$*"; }

# ---- deps ------------------------------------------------------------------------------------
unpack_deb() {  # dpkg -x, or ar + tar where the image has no dpkg
  if command -v dpkg-deb >/dev/null; then
    dpkg-deb -x "$1" "$root"
  else
    local tmp
    tmp=$(mktemp -d)
    (cd "$tmp" && ar x "$1" && tar -xf data.tar.* -C "$root")
    rm -rf "$tmp"
  fi
}

ensure_deps() {
  shopt -s nullglob
  local debs=("$deps"/debs/*.deb) wheels=("$deps"/wheels/*.whl)
  shopt -u nullglob
  if ((${#debs[@]} == 0 || ${#wheels[@]} == 0)); then
    echo "gpu_check: no .debs or wheels under $deps: run scripts/gpu_prepare.sh on a machine" \
         "with registries and carry .gpu_deps/debs, .gpu_deps/wheels, .gpu_deps/cache and .deps" >&2
    return 1
  fi
  # The unpacked tree is keyed by what was unpacked and where (.pc files hold absolute paths).
  local stamp
  stamp=$(printf '%s\n' "$root" "${debs[@]##*/}" "${wheels[@]##*/}" | sha256sum | cut -d' ' -f1)
  if [[ -f $root/.stamp && $(cat "$root/.stamp") == "$stamp" && -x $vpy ]]; then
    return 0
  fi
  say "unpacking ${#debs[@]} .debs into $root"
  rm -rf "$root"
  mkdir -p "$root"
  local f
  for f in "${debs[@]}"; do unpack_deb "$f"; done
  # .pc files name /usr outright (prefix=/usr, libdir=/usr/lib/..., -I/usr/include): point
  # them at the unpacked tree. The CMake config files (GTest, nlohmann_json, benchmark) compute
  # their prefix from their own location and need nothing.
  find "$root" -name '*.pc' -exec sed -i -e "s#=/usr#=$root/usr#g" \
    -e "s#-I/usr/#-I$root/usr/#g" -e "s#-L/usr/#-L$root/usr/#g" {} +

  say "venv $venv (system site packages: torch) with ${wheels[*]##*/}"
  rm -rf "$venv"
  # --without-pip: the image's interpreter may lack ensurepip; its own pip installs below.
  "$py" -m venv --system-site-packages --without-pip "$venv"
  local site
  site=$("$vpy" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # When python3 is itself a venv (/opt/torch/.venv), --system-site-packages reaches only the
  # base interpreter's packages, not torch: add the outer interpreter's site dirs by a .pth.
  if ! "$vpy" -c 'import torch' 2>/dev/null; then
    "$py" -c 'import site; print("\n".join(site.getsitepackages()))' >"$site/_qlora_outer.pth"
  fi
  # --target into the venv: exact pinned versions shadow the image's (safetensors 0.8 there).
  "$py" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile \
    --upgrade --target "$site" "${wheels[@]}"
  "$vpy" -c 'import torch, torchao, safetensors
print("[gpu_check] python", __import__("sys").version.split()[0], "torch", torch.__version__,
      "torchao", torchao.__version__, "safetensors", safetensors.__version__,
      "cuda", torch.cuda.is_available())'
  echo "$stamp" >"$root/.stamp"
}

# Environment every step needs (nothing persists between device calls but files).
use_deps() {
  export PKG_CONFIG_PATH=$root/usr/lib/$multiarch/pkgconfig:$root/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}
  # Shared libs (toml++, benchmark, libpkgconf): for the linker's DT_NEEDED
  # lookups, the tests and the bench.
  export LD_LIBRARY_PATH=$root/usr/lib/$multiarch${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  export CMAKE_INCLUDE_PATH=$root/usr/include CMAKE_LIBRARY_PATH=$root/usr/lib/$multiarch
  [[ -d /usr/local/cuda/bin ]] && export PATH=/usr/local/cuda/bin:$PATH
  # The pre-trained tiny default base, made by gpu_prepare.sh here: the recipe and its tests then
  # skip minutes of one-thread pre-training on the device's clock.
  [[ -d $deps/cache ]] && export QLORA_CACHE_DIR=$deps/cache
  pkg_config=$(command -v pkg-config || true)
  [[ -n $pkg_config ]] || pkg_config=$root/usr/bin/pkgconf
}

# ---- steps -----------------------------------------------------------------------------------
step_deps() { ensure_deps; }

step_configure() {
  ensure_deps
  local torch_prefix nvcc
  torch_prefix=$("$vpy" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')
  nvcc=$(command -v nvcc)
  say "configure $build (torch: $torch_prefix, nvcc: $nvcc, pkg-config: $pkg_config)"
  # -g1: line tables, so that a crash report's frames name their lines (scripts/symbolize_crash.sh).
  cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DQLORA_CUDA=ON -DCMAKE_CXX_FLAGS=-g1 \
    -DCMAKE_CUDA_COMPILER="$nvcc" \
    -DCMAKE_PREFIX_PATH="$torch_prefix;$root/usr" \
    -DPKG_CONFIG_EXECUTABLE="$pkg_config" \
    -DPython3_EXECUTABLE="$vpy"
}

step_build() {
  ensure_deps
  [[ -f $build/CMakeCache.txt ]] || step_configure
  say "build $build (-j$jobs${GPU_CHECK_TARGETS:+, targets: $GPU_CHECK_TARGETS})"
  # shellcheck disable=SC2086  # the target list is split on purpose
  cmake --build "$build" -j "$jobs" ${GPU_CHECK_TARGETS:+--target $GPU_CHECK_TARGETS}
}

step_test() {
  ensure_deps
  say "ctest $build"
  local rc=0
  # shellcheck disable=SC2086  # extra arguments are split on purpose
  ctest --test-dir "$build" --output-on-failure ${GPU_CHECK_CTEST_ARGS:-} || rc=$?
  if [[ -n ${OUT:-} && -f $build/Testing/Temporary/LastTest.log ]]; then
    cp "$build/Testing/Temporary/LastTest.log" "$OUT/ctest_LastTest.log"
  fi
  return $rc
}

out_dir() { echo "${OUT:-$build}"; }

# Runs "$@" (a qlora command line) with its output in log $1, killed after RUN_LIMIT_S seconds
# (default 540); on a death by signal, the symbolized crash report and, where cuda-gdb exists, a
# backtrace from a second run under it. Returns the command's status (137: the limit's SIGKILL).
run_logged() {
  local log=$1 rc=0
  shift
  timeout -s KILL "${RUN_LIMIT_S:-540}" "$@" >"$log" 2>&1 || rc=$?
  tail -4 "$log"
  if ((rc > 128 && rc != 137)); then
    say "died of signal $((rc - 128)): $*"
    bash "$repo/scripts/symbolize_crash.sh" "$log" | grep -A60 "fatal signal" | head -70 | tee "$log.stack" || true
    if [[ ${GPU_CHECK_GDB:-1} == 1 ]] && command -v cuda-gdb >/dev/null; then
      say "again under cuda-gdb (backtrace in $log.gdb)"
      timeout -s KILL "${RUN_LIMIT_S:-540}" cuda-gdb -q -batch -ex run -ex bt -ex "info threads" --args "$@" \
        >"$log.gdb" 2>&1 || true
      grep -B2 -A40 "received signal" "$log.gdb" | head -60 || true
    fi
  fi
  return $rc
}

step_crash() {
  ensure_deps
  local dir=$build/crash_check
  rm -rf "$dir"
  mkdir -p "$dir"
  say "crash: qlora run lora_finetune with an empty cache (pre-trains the tiny base), at most 60 s"
  local rc=0 start=$SECONDS
  QLORA_NO_SHIPPED_BASE=1 QLORA_CACHE_DIR=$dir/cache RUN_LIMIT_S=60 run_logged "$(out_dir)/crash_check.log" \
    "$build/qlora" run lora_finetune checkpoint.output_dir="$dir/out" logging.progress=plain || rc=$?
  # 137 is also what the kernel's OOM killer gives: only a stop at the limit counts as "no crash".
  if ((rc == 137 && SECONDS - start >= 59)); then say "no crash within 60 s (stopped)"; return 0; fi
  return $rc
}

step_recipe() {
  ensure_deps
  local dir=$build/recipe_cuda
  rm -rf "$dir"
  say "recipe: qlora run lora_finetune model.device=cuda (QLORA_CACHE_DIR=${QLORA_CACHE_DIR:-unset:" \
      "the tiny base is pre-trained first; carry .gpu_deps/cache})"
  RUN_LIMIT_S=120 run_logged "$(out_dir)/recipe_cuda.log" "$build/qlora" run lora_finetune model.device=cuda \
    checkpoint.output_dir="$dir" logging.progress=plain
  local epoch
  epoch=$(ls -d "$dir"/epoch_* | sort -V | tail -1)
  say "generate: qlora generate --device cuda --checkpoint $epoch"
  RUN_LIMIT_S=120 run_logged "$(out_dir)/generate_cuda.log" "$build/qlora" generate --device cuda --checkpoint "$epoch" \
    --instruction "Reverse the word." --input kite
}

step_train() {
  ensure_deps
  local what=${GPU_CHECK_TRAIN:-llama2-7b:1 llama2-7b:4 llama3.1-8b:1 llama3.1-8b:4} w rc=0
  for w in $what; do
    [[ $w =~ ^[a-z0-9.-]+:[0-9]+$ ]] || { echo "gpu_check: GPU_CHECK_TRAIN entry '$w' is not SHAPE:BATCH" >&2; return 2; }
    local shape=${w%%:*} batch=${w##*:}
    local dest
    dest=$(out_dir)/train_step_${shape}_b${batch}.json
    say "train: bench_train_step --device cuda --shape $shape --batch $batch > $dest"
    "$build/bench_train_step" --device cuda --shape "$shape" --batch "$batch" >"$dest" 2>"$dest.err" || rc=$?
    "$vpy" - "$dest" <<'PY' || rc=1
import json, sys
r = json.load(open(sys.argv[1]))
for side, f in r.get("figures", {}).items():
    mem = f.get("max_reserved_bytes")
    print(f"  {side:14s} tokens/s {f.get('tokens_per_s', 0):9.0f}  MFU {f.get('mfu') or 0:.3f}  "
          f"max reserved {(mem or 0) / 2**30:6.2f} GiB  losses {f.get('losses', f.get('error'))}")
print("  vs faster peer:", r.get("vs_faster_peer"), " first losses' max rel diff:", r.get("first_losses_max_rel_diff"))
for side, p in r.get("profile", {}).items():
    kinds = ", ".join(f"{k} {v['share']:.0%}" for k, v in list(p.get("by_kind", {}).items())[:5])
    print(f"  {side:14s} traced step: kernels {p.get('kernel_ms', 0):.1f} ms, idle {p.get('idle_fraction') or 0:.0%}: {kinds}")
PY
  done
  return $rc
}

step_bench() {
  ensure_deps
  local dest=${OUT:+$OUT/bench_nf4_cuda.json}
  dest=${dest:-$build/bench_nf4_cuda.json}
  say "bench: $build/bench_nf4 --device cuda > $dest"
  "$build/bench_nf4" --device cuda >"$dest" || { local rc=$?; rm -f "$dest"; return $rc; }
  cat "$dest"
}

# ---- main ------------------------------------------------------------------------------------
use_deps
say "host $(uname -srm); $(. /etc/os-release 2>/dev/null && echo "$PRETTY_NAME")"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else say "no nvidia-smi"; fi
for tool in cmake ninja nvcc; do
  command -v "$tool" >/dev/null || { echo "gpu_check: '$tool' not found" >&2; exit 1; }
done
command -v c++ >/dev/null || command -v g++ >/dev/null ||
  { echo "gpu_check: no C++ compiler (c++ or g++) found" >&2; exit 1; }

failed=()
for s in "${steps[@]}"; do
  start=$SECONDS
  # A subshell outside any `if`/`||`, so that set -e really stops a step at its first error.
  set +e
  (set -e; "step_$s")
  rc=$?
  set -e
  if ((rc == 0)); then
    say "step $s: ok ($((SECONDS - start)) s)"
  else
    say "step $s: FAILED with exit code $rc ($((SECONDS - start)) s)"
    failed+=("$s")
    # Nothing after a failed deps/configure/build can mean anything; the later steps are
    # independent of each other.
    [[ $s == deps || $s == configure || $s == build ]] && break
  fi
done
if ((${#failed[@]})); then
  say "FAILED: ${failed[*]}"
  exit 1
fi
say "all steps passed: ${steps[*]}"
