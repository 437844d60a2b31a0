#!/usr/bin/env bash
# pack_tilelang_site.sh [OUT.tar.xz] [TILELANG_VERSION]: TileLang and what it needs from PyPI as one
# xz tarball of an unpacked site folder, for a CUDA host with Python 3.12 and torch but no package
# index (default .site/tilelang-site.tar.xz, TileLang 0.1.15; ~45 MB; ~82 MB as wheels).
# scripts/gpu_run.sh unpacks it when TileLang is not importable there. By hand on the GPU host:
#   mkdir -p /tmp/site && tar xJf OUT.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PYTHONPATH
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.site/tilelang-site.tar.xz}
ver=${2:-0.1.15}
command -v xz >/dev/null || { echo "error: xz not found (apt-get install -y xz-utils)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)
for req in "tilelang==$ver" "apache-tvm-ffi<0.1.13,>=0.1.11" torch-c-dlpack-ext "z3-solver<4.15.5,>=4.13.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$work/wheels" "$req"
done
mkdir -p "$work/site" "$(dirname "$out")"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
tar cf - -C "$work/site" . | xz -9 -T0 >"$work/site.tar.xz"
mv "$work/site.tar.xz" "$out"
ls -la "$out"
