#!/usr/bin/env bash
# setup_venv.sh: .venv with Python 3.12 and requirements/dev.txt from PyPI. Re-run is a no-op
# while requirements/dev.txt is unchanged (a stamp holds its sha256).
. "$(dirname "$0")/lib.sh"
req=$ROOT/requirements/dev.txt
stamp=$VENV/.requirements.sha256
want=$(sha256_of "$req")
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/python" ]; then exit 0; fi
py=$(find_python312)
note "creating $VENV with $py and requirements/dev.txt (torch from PyPI is ~5 GB; a few minutes)"
[ -x "$VENV/bin/python" ] || "$py" -m venv "$VENV"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check -r "$req" ||
  die "pip could not install requirements/dev.txt into $VENV (is PyPI reachable?)"
echo "$want" >"$stamp"
