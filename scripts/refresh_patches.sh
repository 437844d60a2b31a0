#!/usr/bin/env bash
# refresh_patches.sh: re-export every patch with quilt's stable settings (lib.sh) against the pin's
# pristine tree, in a scratch copy. Headers are kept; only the diff part is rewritten. A patch
# that needs fuzz stops the refresh (quilt push --fuzz=0) and names the patch.
. "$(dirname "$0")/lib.sh"
need_quilt
work=$(mktemp -d "${TMPDIR:-/tmp}/refresh.XXXXXX")
trap 'rm -rf "$work"' EXIT
channel=$("$ROOT/scripts/pristine_tree.sh" "$work/tree")
# tests-only patches need upstream's tests/ (git channel); without them they are left as they are
[ "$channel" != git ] || git -C "$UPSTREAM" archive "$MCORE_GIT_COMMIT" tests | tar -x -C "$work/tree"
export QUILT_SERIES=$work/series
while read -r p; do
  if [ ! -d "$work/tree/tests" ] && tests_only "$PATCHES/$p"; then note "left $p as it is (tests only; needs upstream/)"; else echo "$p"; fi
done < <(series) >"$QUILT_SERIES"
cd "$work/tree"
n=0
while read -r p; do
  quilt push -q >/dev/null || die "quilt push $p failed with fuzz 0: fix it by hand (quilt push -f, edit, quilt refresh) or run make rebase"
  quilt refresh >/dev/null
  n=$((n + 1))
done <"$QUILT_SERIES"
quilt pop -a -q >/dev/null
note "refreshed $n patches in patches/ (git diff patches/ shows what changed)"
