#!/usr/bin/env bash
# System tools the build, the tests and the packing scripts need, from Debian's packages: quilt,
# GNU patch and xz. make runs this first (make deps): as root it installs what is missing; as
# another user it stops with one line saying what to install. (Python 3.12 and 3.13 come with
# these machines through pyenv; scripts/lib.sh finds them.)
set -euo pipefail
declare -A pkg=([quilt]=quilt [patch]=patch [xz]=xz-utils)
missing=()
for tool in quilt patch xz; do command -v "$tool" >/dev/null 2>&1 || missing+=("${pkg[$tool]}"); done
[ ${#missing[@]} -eq 0 ] && exit 0
if [ "$(id -u)" != 0 ]; then
  echo "error: missing ${missing[*]}: run 'sudo apt-get install -y ${missing[*]}' (or make as root, which installs them)" >&2
  exit 1
fi
echo "==> installing ${missing[*]} from Debian's packages" >&2
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
