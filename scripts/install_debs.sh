#!/usr/bin/env bash
# Installs those of the given Debian packages that are missing (apt, with sudo when not root);
# nothing to do is quick. Used by setup.sh (the build's packages) and sanitize.sh (clang's).
#   bash scripts/install_debs.sh PKG...
set -euo pipefail
missing=()
for p in "$@"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
((${#missing[@]})) || exit 0
printf '[install_debs] installing Debian packages: %s\n' "${missing[*]}"
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
