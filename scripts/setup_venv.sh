#!/usr/bin/env bash
# setup_venv.sh [REQUIREMENTS...]: .venv with Python 3.12 and the given requirements files from PyPI
# (default requirements/dev.txt). VENV=DIR PYTHON_VERSION=3.13 makes another one (make venv makes
# .venv313 for the cp313 wheel that way). Re-run is a no-op for a file while it is unchanged (a
# stamp per file holds its sha256).
. "$(dirname "$0")/lib.sh"
[ $# -gt 0 ] || set -- "$ROOT/requirements/dev.txt"
for req in "$@"; do
  [ -f "$req" ] || die "$req: no such requirements file"
  stamp=$VENV/.requirements-$(basename "$req" .txt).sha256
  want=$(sha256_of "$req")
  if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then continue; fi
  if [ ! -x "$VENV/bin/python" ]; then
    py=$(find_python "${PYTHON_VERSION:-3.12}")
    note "creating $VENV with $py$( [ "$(basename "$req")" = dev.txt ] && echo ' (torch from PyPI is ~5 GB; a few minutes)')"
    "$py" -m venv "$VENV"
  fi
  note "installing $(basename "$req") into $VENV"
  "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" ||
    die "pip could not install $req into $VENV (is PyPI reachable?)"
  echo "$want" >"$stamp"
done
