#!/usr/bin/env bash
# prepare_tree.sh: build/tree = the pin's pristine source with patches/series applied (fuzz 0, no
# offset). Built in a scratch folder and moved into place only when every patch applied, so a
# failure leaves no half-patched tree. build/tree.channel records which channel it came from.
. "$(dirname "$0")/lib.sh"
mkdir -p "$BUILD"
work=$(mktemp -d "$BUILD/tree.tmp.XXXXXX")
trap 'rm -rf "$work"' EXIT
channel=$("$ROOT/scripts/pristine_tree.sh" "$work/tree")
note "applying patches/series ($(series | wc -l) patches)"
"$ROOT/scripts/apply_patches.sh" "$work/tree" >&2
rm -rf "$BUILD/tree" "$BUILD/tree.channel"
mv "$work/tree" "$BUILD/tree"
echo "$channel" >"$BUILD/tree.channel"
note "patched tree: $BUILD/tree (channel: $channel)"
