#!/usr/bin/env bash
# Print the path of the pinned megatron-core sdist, downloading it into .cache/ if needed.
# pip checks the pinned sha256 (--require-hashes) before it unpacks anything, and so do we
# before handing the file on. SDIST=/path/to/file uses a local file instead (checked the same way).
. "$(dirname "$0")/lib.sh"

check() {  # check FILE: refuse anything but the pinned bytes
  local got
  got=$(sha256_of "$1")
  [ "$got" = "$MCORE_SDIST_SHA256" ] ||
    die "$1: sha256 $got does not match the pinned $MCORE_SDIST_SHA256 (pin.env); refusing to unpack it"
}

if [ -n "${SDIST:-}" ]; then
  [ -f "$SDIST" ] || die "SDIST=$SDIST: no such file"
  check "$SDIST"; echo "$SDIST"; exit 0
fi
dest=$CACHE/$SDIST_NAME
if [ -f "$dest" ]; then check "$dest"; echo "$dest"; exit 0; fi

py=$(find_python312)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "megatron-core==$MCORE_VERSION --hash=sha256:$MCORE_SDIST_SHA256" >"$tmp/req.txt"
note "downloading megatron-core $MCORE_VERSION sdist from PyPI (pip, hash-checked)"
"$py" -m pip download --quiet --no-deps --no-binary :all: --require-hashes -r "$tmp/req.txt" -d "$tmp/dl" >&2 ||
  die "pip could not download megatron-core==$MCORE_VERSION with sha256 $MCORE_SDIST_SHA256 (no network to PyPI, or the file changed)"
check "$tmp/dl/$SDIST_NAME"
mkdir -p "$CACHE"
mv "$tmp/dl/$SDIST_NAME" "$dest"
echo "$dest"
