# Shared by the scripts: the pin, paths and tool checks, and thin callers of scripts/series.py (the
# series, the tests-only rule, the patch and quilt options). Source it; don't run it.
set -euo pipefail
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=../pin.env
PIN_FILE=${PIN_FILE:-$ROOT/pin.env}
. "$PIN_FILE"
UPSTREAM=${UPSTREAM:-$ROOT/upstream}
BUILD=${BUILD:-$ROOT/build}
DIST=${DIST:-$ROOT/dist}
CACHE=${CACHE:-$ROOT/.cache}
VENV=${VENV:-$ROOT/.venv}
VENV313=${VENV313:-$ROOT/.venv313}  # builds the cp313 wheel (requirements/build.txt only)
PATCHES=${PATCHES:-$ROOT/patches}
SDIST_NAME=megatron_core-$MCORE_VERSION.tar.gz

die() { echo "error: $*" >&2; exit 1; }
note() { echo "==> $*" >&2; }

# The series, the tests-only rule and the patch/quilt options belong to scripts/series.py; the
# functions below only call it. Its Python: the venv's, else python3, else a 3.12 (stdlib only).
series_py() {
  local py=$VENV/bin/python
  [ -x "$py" ] || py=$(command -v python3 2>/dev/null) || py=$(find_python 3.12)
  "$py" "$ROOT/scripts/series.py" --patches "$PATCHES" "$@"
}
# The patch series, in order (patches/series without comments and blank lines).
series() { series_py list; }
# Does patch file $1 touch something, and only upstream's tests/ (which only the git channel has)?
tests_only() { series_py tests-only "$1"; }
# GNU patch's options (fuzz 0, ...): mapfile -t args < <(patch_args)
patch_args() { series_py patch-args; }

# quilt with series.py's stable settings (fuzz 0, no timestamps, no index lines, ...), always run
# with --quiltrc - so ~/.quiltrc cannot change them. QUILT_PATCHES and QUILT_SERIES are the caller's.
export QUILT_PATCHES=$PATCHES
# The settings are read once a shell (a refresh runs quilt twice a patch).
quilt() {
  if [ ${#_quilt_settings[@]} -eq 0 ]; then
    mapfile -t _quilt_settings < <(series_py quilt-env)
    [ ${#_quilt_settings[@]} -gt 0 ] || die "scripts/series.py quilt-env printed no quilt settings"
  fi
  env "${_quilt_settings[@]}" quilt --quiltrc - "$@"
}
_quilt_settings=()

need_quilt() {
  type -P quilt >/dev/null 2>&1 ||
    die "quilt not found. Install it from Debian's packages: apt-get update && apt-get install -y quilt"
}
need_patch() {
  command -v patch >/dev/null 2>&1 ||
    die "GNU patch not found. Install it from Debian's packages: apt-get install -y patch"
}

# A Python of version $1 (3.12, 3.13): PYTHON312 / PYTHON313 override; pyenv installs are found too.
# megatron-core >= 0.17 requires 3.12 or newer; the wheels are built for 3.12 and 3.13.
find_python() {
  local want=$1 var c
  var=PYTHON${want/./}
  if [ -n "${!var:-}" ]; then
    "${!var}" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" >/dev/null 2>&1 ||
      die "$var=${!var} is not a working Python $want"
    echo "${!var}"; return 0
  fi
  for c in "python$want" "$HOME"/.pyenv/versions/"$want"*/bin/"python$want" "/usr/bin/python$want"; do
    [ -n "$c" ] || continue
    if "$c" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" >/dev/null 2>&1; then
      command -v "$c" 2>/dev/null || echo "$c"
      return 0
    fi
  done
  die "python$want not found (the wheels are built for Python 3.12 and 3.13). Install it (pyenv install $want, or Debian's python$want) or set $var=/path/to/python$want"
}
find_python312() { find_python 3.12; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# The upstream/ submodule's gitlink as recorded in this repository's index (empty if none).
gitlink_commit() { { git -C "$ROOT" ls-files -s -- upstream 2>/dev/null || true; } | awk '$1 == "160000" {print $2}'; }

# Is upstream/ a filled submodule checkout? (an uninitialised submodule is an empty folder)
submodule_filled() { [ -e "$UPSTREAM/.git" ] && git -C "$UPSTREAM" rev-parse HEAD >/dev/null 2>&1; }
