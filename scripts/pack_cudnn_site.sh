#!/usr/bin/env bash
# pack_cudnn_site.sh [OUTDIR]: what megatron-core's cuDNN DSA backend (the benchmark's cudnn rows)
# needs on a GPU host without a package index, from PyPI: cudnn-frontend 1.32.0 and cutlass-dsl 4.8.1
# with its base, core and CUDA 13 libs, unpacked into one site folder (~295 MB), xz-compressed (~71 MB)
# and split into OUTDIR/a/part.00 and OUTDIR/b/part.01 (default .site/cudnn), each small enough for
# one device call (64 MiB). sgl-flash-mla (flash_mla, 9.9 MB), the backend's forward, goes to .whl/
# as a plain wheel. The host already has cuda-bindings, cuda-core and the cuDNN library.
#
# On the GPU host, in consecutive calls while the machine stays warm (/tmp survives 30 s idle):
#   call 1 (carry .site/cudnn/a):  mkdir -p /tmp/stage && cp .site/cudnn/a/* /tmp/stage/
#   call 2 (carry .site/cudnn/b):  cp .site/cudnn/b/* /tmp/stage/ && mkdir -p /tmp/cudnn-site &&
#                                  cat /tmp/stage/part.* | tar -xJ -C /tmp/cudnn-site
#   later calls: CUDNN_SITE=/tmp/cudnn-site scripts/gpu_run.sh ... (bench/cudnn_peer.py adds it
#   with site.addsitedir: cutlass-dsl's .pth file must run, which PYTHONPATH alone does not do)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-.site/cudnn}
command -v xz >/dev/null || { echo "error: xz not found (apt-get install -y xz-utils)" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
plat=(--platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_34_x86_64)
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${plat[@]}" -d "$1" "$2"
}
for req in nvidia-cudnn-frontend==1.32.0 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
           nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1; do
  dl "$work/wheels" "$req"
done
dl .whl sgl-flash-mla==1.0.0
mkdir -p "$work/site" "$work/out/a" "$work/out/b"
for w in "$work"/wheels/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
tar cf - -C "$work/site" . | xz -9 -T0 >"$work/site.tar.xz"
split -b 36M -d "$work/site.tar.xz" "$work/part."
[ ! -e "$work/part.02" ] || { echo "error: more than two parts; raise the split size" >&2; exit 1; }
mv "$work/part.00" "$work/out/a/" && mv "$work/part.01" "$work/out/b/"
rm -rf "$out" && mkdir -p "$(dirname "$out")" && mv "$work/out" "$out"
ls -la "$out/a" "$out/b" .whl/sgl_flash_mla-*.whl
