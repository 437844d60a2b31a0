#!/usr/bin/env bash
# pristine_tree.sh DEST: lay out the unpatched megatron-core source of the pin in DEST (which must
# not exist) and print the channel used, "git" or "sdist".
#   CHANNEL=auto (default): the upstream/ submodule when it is filled, else the PyPI sdist.
#   CHANNEL=git | CHANNEL=sdist force one.
# Both channels give the same tree: the git channel builds an sdist from the pinned commit with the
# same setuptools backend (the file selection PyPI's sdist has), then applies the release's version
# stamp (PRE_RELEASE '' in megatron_fsdp/package_info.py, 'rc0' in git). A test compares the two.
. "$(dirname "$0")/lib.sh"
dest=${1:?usage: pristine_tree.sh DEST}
[ ! -e "$dest" ] || die "$dest already exists"
channel=${CHANNEL:-auto}
py=$VENV/bin/python
[ -x "$py" ] || die "no virtual environment at $VENV: run 'make venv' first"

if [ "$channel" = auto ]; then
  if submodule_filled && [ -n "${MCORE_GIT_COMMIT:-}" ]; then channel=git; else channel=sdist; fi
fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/mcore-pristine.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

case "$channel" in
  sdist)
    [ -n "${MCORE_VERSION:-}" ] || die "the pin is git-only (no MCORE_VERSION in pin.env): fill upstream/ (git -c protocol.file.allow=always submodule update --init upstream)"
    sdist=$("$ROOT/scripts/fetch_sdist.sh")
    ;;
  git)
    [ -n "${MCORE_GIT_COMMIT:-}" ] || die "CHANNEL=git but the pin is PyPI-only (no MCORE_GIT_COMMIT in pin.env)"
    submodule_filled ||
      die "CHANNEL=git but upstream/ is not filled: git -c protocol.file.allow=always submodule update --init upstream (see README)"
    link=$(gitlink_commit)
    [ -z "$link" ] || [ "$link" = "$MCORE_GIT_COMMIT" ] ||
      die "the upstream/ gitlink ($link) differs from MCORE_GIT_COMMIT in pin.env ($MCORE_GIT_COMMIT)"
    head=$(git -C "$UPSTREAM" rev-parse HEAD)
    [ "$head" = "$MCORE_GIT_COMMIT" ] ||
      die "$UPSTREAM is checked out at $head, not the pinned $MCORE_GIT_COMMIT: run 'git submodule update upstream' (or CHANNEL=sdist)"
    [ -z "$(git -C "$UPSTREAM" status --porcelain)" ] ||
      die "upstream/ has local changes; the build never patches it in place. Clean it (git -C upstream status) or use CHANNEL=sdist"
    mkdir "$tmp/export"
    git -C "$UPSTREAM" archive "$MCORE_GIT_COMMIT" megatron pyproject.toml setup.py MANIFEST.in README.md |
      tar -x -C "$tmp/export"
    # NO_VCS_VERSION: package_info.py would otherwise append our repository's git hash to the version.
    sdist=$(cd "$tmp/export" && NO_VCS_VERSION=1 "$py" -c \
      'import sys; from setuptools.build_meta import build_sdist; print(build_sdist(sys.argv[1]))' \
      "$tmp/sdist" 2>"$tmp/sdist.log" | tail -n 1) || { cat "$tmp/sdist.log" >&2; die "building an sdist from upstream/ failed"; }
    sdist=$tmp/sdist/$sdist
    ;;
  *) die "CHANNEL must be auto, git or sdist (got $channel)" ;;
esac

mkdir "$tmp/unpack"
tar -xzf "$sdist" -C "$tmp/unpack"
src=$(echo "$tmp"/unpack/megatron_core-*)
[ -d "$src/megatron/core" ] || die "$sdist does not hold megatron/core"
mkdir -p "$tmp/tree"
for f in megatron pyproject.toml setup.py MANIFEST.in README.md; do cp -a "$src/$f" "$tmp/tree/"; done
# file modes differ between the two tarballs (umask); the wheel records them, so fix them here
chmod -R u=rwX,go=rX "$tmp/tree"

if [ "$channel" = git ] && [ -n "${MCORE_VERSION:-}" ]; then
  # The release stamp: the published sdist of this commit has no pre-release tag.
  sed -i "s/^PRE_RELEASE = '[a-z0-9]*'$/PRE_RELEASE = ''/" \
    "$tmp/tree/megatron/core/package_info.py" \
    "$tmp/tree/megatron/core/distributed/fsdp/src/megatron_fsdp/package_info.py"
fi
version=$(cd "$tmp/tree" && NO_VCS_VERSION=1 "$py" -c \
  'import runpy; print(runpy.run_path("megatron/core/package_info.py")["__version__"])')
[ -z "${MCORE_VERSION:-}" ] || [ "$version" = "$MCORE_VERSION" ] ||
  die "the $channel tree says version $version, the pin says $MCORE_VERSION"

mkdir -p "$(dirname "$dest")"
mv "$tmp/tree" "$dest"
note "pristine megatron-core $version from the $channel channel in $dest"
echo "$channel"
