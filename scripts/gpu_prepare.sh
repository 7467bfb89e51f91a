#!/usr/bin/env bash
# Fetches, on a machine that reaches Debian's and PyPI's registries, everything the GPU machine
# lacks to build and test the project, into .gpu_deps/ (git-ignored):
#   .gpu_deps/debs    Debian 12 packages: -dev packages and the runtime libraries they need
#   .gpu_deps/wheels  Python wheels for the conformance tests (no dependencies)
#   .gpu_deps/cache   the pre-trained tiny default base (1.6 MB), so that the GPU machine does not
#                     spend minutes of device time pre-training it on one CPU thread
#   .deps             SentencePiece's C++ source (scripts/fetch_sentencepiece.sh, 12 MB), compiled into
#                     qlora there as here: no shared sentencepiece, no protobuf symbol shared with torch
# The GPU machine has no registry at all, so these travel with the device tool's `carry`
# (carry .gpu_deps/debs, .gpu_deps/wheels, .gpu_deps/cache and .deps, not .gpu_deps: that would replace
# the unpacked tree and venv that scripts/gpu_check.sh keeps there between calls).
#
# Idempotent: a package whose candidate version is already downloaded is not fetched again;
# older versions of it are removed so that gpu_check.sh never unpacks two.
#
# Env: GPU_PYTHON_VERSION (default 3.12, the GPU image's python3), GPU_DEPS_DIR.
set -euo pipefail

repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
deps=${GPU_DEPS_DIR:-$repo/.gpu_deps}
py_version=${GPU_PYTHON_VERSION:-3.12}

# Each -dev package with the shared libraries it links (the closure below the C/C++ runtime,
# which every machine with a compiler has; the check at the end fails on anything missed).
debs=(
  libtomlplusplus-dev libtomlplusplus3
  nlohmann-json3-dev
  libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3  # data/text_regex
  libicu-dev libicu72 icu-devtools  # NFC and Unicode classes of the tokenizers
  libgloo-dev libgloo0 libhiredis0.14 libibverbs1 libibverbs-dev libnl-3-200 libnl-route-3-200 libnl-3-dev libnl-route-3-dev libhiredis-dev ibverbs-providers  # headers of c10d's ProcessGroupGloo (the image's torch lacks them)
  libjpeg62-turbo-dev libjpeg62-turbo libpng-dev libpng16-16 zlib1g-dev zlib1g  # images/decode (JPEG, PNG)
  libwebp-dev libwebp7 libwebpdemux2 libwebpmux3 libexif-dev libexif12  # images/decode (WebP, EXIF orientation)
  libgtest-dev libgmock-dev googletest
  libbenchmark-dev libbenchmark1debian
  pkgconf pkgconf-bin libpkgconf3  # only used there when the image has no pkg-config
)
# Present on any machine that can compile C++: not shipped.
base_libs=" libc6 libc6-dev libc-dev libgcc-s1 libstdc++6 adduser "
# The GPU image has transformers and sentencepiece; peft (and accelerate, which it imports) for
# bench/hf_peer_train_step.py.
wheels=(torchao==0.17.0 safetensors==0.8.0 peft==0.21.2 accelerate==1.15.0)

mkdir -p "$deps/debs" "$deps/wheels"
bash "$repo/scripts/fetch_sentencepiece.sh"

# The GPU machine is x86-64; fetch amd64 packages whatever this machine is.
apt_opts=()
if [[ $(dpkg --print-architecture) != amd64 ]]; then
  mkdir -p /tmp/qlora-apt-amd64/partial
  apt_opts=(-oAPT::Architecture=amd64 -oAPT::Architectures=amd64
            -oDir::State::Lists=/tmp/qlora-apt-amd64)
fi
if ! apt-cache "${apt_opts[@]}" show libtomlplusplus-dev >/dev/null 2>&1; then
  apt-get "${apt_opts[@]}" update -q
fi

candidate() {  # candidate version of package $1
  apt-cache "${apt_opts[@]}" policy "$1" | awk '/Candidate:/ {print $2}'
}

cd "$deps/debs"
for pkg in "${debs[@]}"; do
  want=$(candidate "$pkg")
  if [[ -z $want || $want == "(none)" ]]; then
    echo "gpu_prepare: no candidate for Debian package $pkg" >&2
    exit 1
  fi
  have=""
  for f in "${pkg}"_*.deb; do
    [[ -e $f ]] || continue
    if [[ $(dpkg-deb -f "$f" Package) == "$pkg" && $(dpkg-deb -f "$f" Version) == "$want" ]]; then
      have=$f
    else
      rm -f -- "$f"  # an older version: never ship two
    fi
  done
  if [[ -z $have ]]; then
    # apt-get download runs unsandboxed as root here and says so; the warning is harmless.
    apt-get "${apt_opts[@]}" download -qq "$pkg=$want" 2> >(grep -v "unsandboxed as root" >&2)
  fi
done

# Every dependency of a shipped package must be shipped or be a base library.
missing=()
for f in *.deb; do
  depends=$( { dpkg-deb -f "$f" Depends; dpkg-deb -f "$f" Pre-Depends; } | tr ',' '\n' |
             sed 's/[[:space:]]*(.*)//; s/|.*//; s/:any//; s/[[:space:]]//g' | grep -v '^$' || true)
  for d in $depends; do
    [[ $base_libs == *" $d "* ]] && continue
    compgen -G "${d}_*.deb" >/dev/null || missing+=("$d (needed by $(dpkg-deb -f "$f" Package))")
  done
done
if ((${#missing[@]})); then
  printf 'gpu_prepare: not shipped: %s\n' "${missing[@]}" >&2
  exit 1
fi

# Wheels for the GPU image's interpreter; pip skips files it already has.
cd "$deps/wheels"
python3 -m pip download -q --no-deps --only-binary=:all: \
  --python-version "$py_version" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any \
  -d . "${wheels[@]}"
for spec in "${wheels[@]}"; do  # drop other versions left by earlier pins
  name=${spec%%==*} version=${spec##*==}
  for w in "${name}"-*.whl; do
    [[ -e $w && $w != "${name}-${version}-"* ]] && rm -f -- "$w"
  done
done

# The pre-trained tiny default base, as qlora caches it (src/qlora/train/tiny_default.cpp): the
# shipped one (src/qlora/train/tiny_base_v<N>/, which qlora finds in its source tree anyway), else
# made here by a one-step run of the embedded default if this machine has none yet (minutes, once).
version=$(sed -n 's/^constexpr int kBaseVersion = \([0-9]*\);/\1/p' "$repo/src/qlora/train/tiny_default.cpp")
[[ -n $version ]] || { echo "gpu_prepare: no kBaseVersion in src/qlora/train/tiny_default.cpp" >&2; exit 1; }
base=tiny_base_v$version
cache=${QLORA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/qlora}
[[ -f $repo/src/qlora/train/$base/model.safetensors ]] && cache=$repo/src/qlora/train
if [[ ! -f $deps/cache/$base/model.safetensors ]]; then
  if [[ ! -f $cache/$base/model.safetensors ]]; then
    [[ -x $repo/build/qlora ]] || { echo "gpu_prepare: build qlora first (bash scripts/setup.sh)" >&2; exit 1; }
    tmp=$(mktemp -d)
    QLORA_CACHE_DIR=$cache "$repo/build/qlora" run lora_finetune training.epochs=1 training.max_steps_per_epoch=1 \
      checkpoint.output_dir="$tmp/out" logging.progress=plain >/dev/null
    rm -rf "$tmp"
  fi
  rm -rf "$deps/cache"
  mkdir -p "$deps/cache"
  cp -r "$cache/$base" "$deps/cache/"
fi

echo "gpu_prepare: $(ls "$deps/debs" | wc -l) debs, $(ls "$deps/wheels" | wc -l) wheels, $base," \
     "$(du -sh "$deps/debs" "$deps/wheels" "$deps/cache" | awk '{print $1}' | paste -sd+) in $deps"
