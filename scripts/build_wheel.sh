#!/usr/bin/env bash
# build_wheel.sh: dist/megatron_core-<pin>+<label>-cp3{12,13}-*-manylinux_*.whl from build/tree.
# The copy it builds from gets two stamps and this project's own modules, nothing else: the PEP 440
# local label in package_info.py, megatron/core/glm53_patches.py (the manifest of applied patches;
# `python -m megatron.core.glm53_patches doctor` runs the doctor) and shipped/*.py into megatron/core/.
# Reproducible: fixed SOURCE_DATE_EPOCH, source and build-environment paths mapped out of the C++
# extension (pybind11's headers are in the venv: its path would differ between checkouts).
. "$(dirname "$0")/lib.sh"
py=$VENV/bin/python
[ -x "$py" ] || die "no virtual environment at $VENV: run 'make venv' first"
[ -d "$BUILD/tree/megatron/core" ] || die "no patched tree at $BUILD/tree: run scripts/prepare_tree.sh"
src=$BUILD/wheel-src
out=$BUILD/wheel-out
rm -rf "$src" "$out"
cp -a "$BUILD/tree" "$src"

# the manifest lists the patches applied to this tree: tests-only ones (upstream's tests/) are not
in_wheel=()
while read -r p; do tests_only "$PATCHES/$p" || in_wheel+=("$p"); done < <(series)
"$py" - "$src" "$LOCAL_LABEL" "$PATCHES" "${in_wheel[@]}" <<'PY'
import hashlib, os, pathlib, runpy, sys
src, label, patches = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
series = sys.argv[4:]
info = src / "megatron/core/package_info.py"
os.environ["NO_VCS_VERSION"] = "1"
base = runpy.run_path(str(info))["__version__"]  # the tree's own version (a git-only pin has no MCORE_VERSION)
text = info.read_text()
for old, new in [
    ("__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:])\n",
     f"__version__ = '.'.join(map(str, VERSION[:3])) + ''.join(VERSION[3:]) + '+{label}'\n"),
    # the version names the patch series; a git hash appended at import would make it invalid
    ("if not int(_os.getenv('NO_VCS_VERSION', '0')):\n",
     "if False:  # glm53 patched build: the local label replaces the VCS suffix\n"),
]:
    if text.count(old) != 1:
        sys.exit(f"error: package_info.py no longer has the line the version stamp expects: {old!r}")
    text = text.replace(old, new)
info.write_text(text)
rows = "".join(
    f"    ({name!r}, {hashlib.sha256((patches / name).read_bytes()).hexdigest()!r}),\n" for name in series
)
(src / "megatron/core/glm53_patches.py").write_text(
    '"""Patches applied to this megatron-core build (written by the glm53 patch series build)."""\n\n'
    f"BASE_VERSION = {base!r}\nLOCAL_LABEL = {label!r}\n"
    "# (file name, sha256 of the patch file), in the order applied\n"
    f"PATCHES = (\n{rows})\n\n"
    'if __name__ == "__main__":  # python -m megatron.core.glm53_patches doctor\n'
    "    from megatron.core.glm53_doctor import main\n\n"
    "    raise SystemExit(main())\n"
)
PY
cp "$ROOT"/shipped/*.py "$src/megatron/core/"

# One wheel per Python (cp312 from .venv, cp313 from .venv313), each from the same prepared copy.
# The platform tag is the manylinux tag auditwheel finds the extension consistent with (its symbol
# versions: glibc 2.34 on this build host), set with `wheel tags`; nothing is grafted in.
rm -f "$DIST"/megatron_core-*.whl
mkdir -p "$DIST"
for venv in "$VENV" "$VENV313"; do
  bpy=$venv/bin/python
  [ -x "$bpy" ] || die "no build environment at $venv: run 'make venv' first"
  tag=$("$bpy" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  note "building the $tag wheel (setuptools, no build isolation; compiles megatron.core.datasets.helpers_cpp)"
  rm -rf "$out" "$src/build" "$src"/*.egg-info
  (cd "$src" && SOURCE_DATE_EPOCH=315532800 NO_VCS_VERSION=1 \
    CFLAGS="-ffile-prefix-map=$src=. -ffile-prefix-map=$venv=venv" \
    CXXFLAGS="-ffile-prefix-map=$src=. -ffile-prefix-map=$venv=venv" \
    "$bpy" -m pip wheel --quiet --no-deps --no-build-isolation --disable-pip-version-check -w "$out" . >&2) ||
    die "building the $tag wheel failed"
  whl=$(ls "$out"/megatron_core-*-"$tag"-*linux_x86_64.whl) || die "no $tag wheel in $out"
  plat=$("$py" -m auditwheel show "$whl" 2>&1 | sed -n 's/.*consistent with the following platform tag: "\(manylinux_[0-9_]*x86_64\)".*/\1/p')
  [ -n "$plat" ] || die "auditwheel found $whl consistent with no manylinux tag: $("$py" -m auditwheel show "$whl" 2>&1 | tail -n 3)"
  (cd "$out" && SOURCE_DATE_EPOCH=315532800 "$py" -m wheel tags --remove --platform-tag "$plat" "$(basename "$whl")" >/dev/null) ||
    die "could not tag $whl as $plat"
  tagged=$(ls "$out"/megatron_core-*-"$tag"-"$plat".whl)
  cp "$tagged" "$DIST/"
  note "built $DIST/$(basename "$tagged") (sha256 $(sha256_of "$tagged"))"
  echo "$DIST/$(basename "$tagged")"
done
