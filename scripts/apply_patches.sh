#!/usr/bin/env bash
# apply_patches.sh [--check] [--reverse] DIR: apply patches/series to DIR with GNU patch the way
# dpkg does: -F0 (no fuzz), -N, and any hunk that lands at an offset is an error too.
# Patches that touch only tests/ (upstream's own tests, git channel) are skipped where DIR has none.
#   --check    dry run on a scratch copy; DIR is not touched
#   --reverse  unapply, last patch first
. "$(dirname "$0")/lib.sh"
need_patch
check=0 reverse=0
while [ $# -gt 1 ]; do
  case "$1" in --check) check=1 ;; --reverse) reverse=1 ;; *) die "unknown option $1" ;; esac
  shift
done
dir=${1:?usage: apply_patches.sh [--check] [--reverse] DIR}
[ -d "$dir" ] || die "$dir: no such directory"
if [ "$check" = 1 ]; then
  scratch=$(mktemp -d "${TMPDIR:-/tmp}/apply-check.XXXXXX")
  trap 'rm -rf "$scratch"' EXIT
  cp -a "$dir/." "$scratch/"
  dir=$scratch
fi
names=$(series) || die "cannot read $PATCHES/series"
mapfile -t list <<<"$names"
[ -n "$names" ] || list=()
mapfile -t pargs < <(patch_args)
[ ${#pargs[@]} -gt 0 ] || die "scripts/series.py patch-args printed no options"
if [ "$reverse" = 1 ]; then
  for ((i = 0, j = ${#list[@]} - 1; i < j; i++, j--)); do t=${list[i]}; list[i]=${list[j]}; list[j]=$t; done
fi
for p in "${list[@]}"; do
  [ -f "$PATCHES/$p" ] || die "patches/series names $p, which is not in patches/"
  # A patch that only touches upstream's tests/ (git channel only) applies where tests/ exists.
  if [ ! -d "$dir/tests" ] && tests_only "$PATCHES/$p"; then
    echo "skipped $p (tests only; this tree has no tests/)"
    continue
  fi
  args=(-d "$dir" "${pargs[@]}" -N -i "$PATCHES/$p")
  [ "$reverse" = 1 ] && args=(-R "${args[@]}")
  if ! out=$(patch "${args[@]}" 2>&1); then
    printf '%s\n' "$out" >&2
    die "patches/$p does not apply with fuzz 0 to the pinned tree; refresh it against the pin (README: 'Changing a patch') or run 'make rebase'"
  fi
  if grep -qE 'offset|fuzz' <<<"$out"; then
    printf '%s\n' "$out" >&2
    die "patches/$p applies only at an offset; refresh it (make refresh) so every hunk lands at its recorded line"
  fi
  echo "$( [ "$reverse" = 1 ] && echo unapplied || echo applied ) $p"
done
