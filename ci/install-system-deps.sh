#!/usr/bin/env bash
# System packages the build and tests need, from Debian's packages: quilt and GNU patch.
# (Python 3.12 itself comes with these machines through pyenv; scripts/lib.sh finds it.)
set -euo pipefail
missing=()
for tool in quilt patch; do command -v "$tool" >/dev/null 2>&1 || missing+=("$tool"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "error: missing ${missing[*]}; install with: sudo apt-get install -y ${missing[*]}" >&2
  exit 1
fi
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
