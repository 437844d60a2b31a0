# Shared by the scripts: the pin, paths, tool checks and quilt's settings. Source it; don't run it.
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

# quilt, stable output: no timestamps, no index lines, sorted files, fuzz 0 (quilt's default push
# allows fuzz 2), unified rejects. quilt is always run with --quiltrc - so ~/.quiltrc cannot change this.
export QUILT_PATCHES=$PATCHES
export QUILT_PUSH_ARGS="--fuzz=0"
export QUILT_REFRESH_ARGS="-p ab --no-timestamps --no-index --sort --strip-trailing-whitespace"
export QUILT_DIFF_ARGS="-p ab --no-timestamps --no-index --sort"
export QUILT_PATCH_OPTS="--unified --reject-format=unified"
export QUILT_DIFF_OPTS="--show-c-function"
quilt() { command quilt --quiltrc - "$@"; }

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

# The patch series, in order: non-empty lines of patches/series without comments.
series() { sed -e 's/[[:space:]]#.*//' -e 's/^#.*//' -e '/^[[:space:]]*$/d' "$PATCHES/series"; }

# Does patch file $1 touch only upstream's tests/ (which only the git channel has)?
tests_only() { ! grep -E '^\+\+\+ b/' "$1" | grep -qv '^+++ b/tests/'; }

sha256_of() { sha256sum "$1" | cut -d' ' -f1; }

# The upstream/ submodule's gitlink as recorded in this repository's index (empty if none).
gitlink_commit() { { git -C "$ROOT" ls-files -s -- upstream 2>/dev/null || true; } | awk '$1 == "160000" {print $2}'; }

# Is upstream/ a filled submodule checkout? (an uninitialised submodule is an empty folder)
submodule_filled() { [ -e "$UPSTREAM/.git" ] && git -C "$UPSTREAM" rev-parse HEAD >/dev/null 2>&1; }
